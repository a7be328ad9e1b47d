#!/usr/bin/env bash
# The long GPU benchmark, for a second window on the GPU machine (the check itself runs only one performance
# point): device tool, carry [".gpu"], command "GPU_CHECK_MODE=bench bash scripts/gpu_check.sh", which builds
# and then runs this. GPT-2 124M with each memory technique, against a hand-written LibTorch loop and PyTorch
# eager, in one run; the memory_viz snapshot; the offload size sweep. Writes
# $OUT/techniques_gpu.md (the table, to be committed as docs/benchmarks/techniques_gpu.md).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="$(command -v python3)"
"$PY" scripts/bench/techniques.py --build "${MEMTRAIN_BUILD:-build-gpu}" --device cuda --python "$PY" \
  --out "$OUT/techniques_gpu.md"

# The example GPU config on real text (Jane Austen, byte-level), shortened: the loss must fall.
"${MEMTRAIN_BUILD:-build-gpu}/memtrain" --config examples/configs/gpt2_124m_gpu.ini --train.steps=60 \
  --train.warmup_steps=10 --train.eval_every=0 --log.every=10 --log.progress=lines --log.dir=/tmp/memtrain-runs \
  --checkpoint.save_final=false 2>&1 | tee "$OUT/gpt2_124m_austen.log"

# A memory_viz snapshot of GPT-2 124M's steps (memory.snapshot), drawn by PyTorch's own _memory_viz, and the
# estimate against the measured peak on CUDA (summary.json's memory_estimate).
"${MEMTRAIN_BUILD:-build-gpu}/memtrain" --config examples/configs/gpt2_124m_gpu.ini --train.steps=3 \
  --train.warmup_steps=1 --train.eval_every=0 --train.eval_batches=1 --log.every=1 --log.progress=lines \
  --memory.snapshot=true --log.dir=/tmp/memtrain-runs --log.name=snapshot --log.overwrite=true \
  --checkpoint.save_final=false 2>&1 | tee "$OUT/gpt2_124m_snapshot.log"
snap=/tmp/memtrain-runs/snapshot/memory_snapshot.rank0.pickle
[ -f "$snap" ] && "$PY" -m torch.cuda._memory_viz trace_plot "$snap" -o "$OUT/gpt2_124m_memory_viz.html"
cp /tmp/memtrain-runs/snapshot/summary.json "$OUT/gpt2_124m_snapshot_summary.json" 2>/dev/null
"$PY" scripts/plot_memory.py /tmp/memtrain-runs/snapshot && cp /tmp/memtrain-runs/snapshot/memory.png "$OUT/gpt2_124m_memory.png"

# The largest GPT that trains on the one GPU with its optimizer offloaded (ZeRO-Offload in one process:
# bf16 parameters and gradients on the device; fp32 masters, AdamW state and reduced gradients in pinned
# host memory), every block recomputed, the fused head. Sizes grow until one fails; 4 steps each, the
# tokens/s of the last. Host memory bounds it: 16 bytes per parameter on the host (masters, two moments,
# the reduced gradient).
for shape in "24 16 2048" "32 32 2560" "32 32 4096" "40 40 5120"; do
  set -- $shape
  echo "=== GPT ${1} layers x ${3} wide (offload)" | tee -a "$OUT/offload_gpu.log"
  timeout 240 "${MEMTRAIN_BUILD:-build-gpu}/memtrain" --config examples/configs/gpt2_124m_gpu.ini \
    --model.n_layer="$1" --model.n_head="$2" --model.n_embd="$3" --train.micro_batch=4 --train.accum_steps=1 \
    --train.steps=4 --train.warmup_steps=1 --train.eval_every=0 --train.eval_batches=1 --log.every=1 \
    --log.progress=lines --train.param_dtype=bf16 --train.precision=bf16 --memory.recompute=all \
    --memory.head=fused --dist.zero_stage=1 --dist.offload_optimizer=cpu --log.dir=/tmp/memtrain-runs \
    --log.overwrite=true --checkpoint.save_final=false 2>&1 | grep -E "^model|^step|parallel|error|memory|out of" \
    | tee -a "$OUT/offload_gpu.log"
  [ "${PIPESTATUS[0]}" = 0 ] || break
done
