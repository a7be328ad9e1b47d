#!/usr/bin/env bash
# The GPU benchmark, run by scripts/gpu_check.sh on the GPU machine: GPT-2 124M with each memory
# technique, against a hand-written LibTorch loop and PyTorch eager, in one run. Writes
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
