#!/usr/bin/env python3
"""memtrain's tensor parallelism against PyTorch's (torch.distributed.tensor.parallel on transformers' Llama,
scripts/bench/torch_tp.py) on this CPU, side by side in one run.

  flock /tmp/memtrain-build.lock python tensor_parallel.py --build build --out docs/benchmarks/tensor_parallel_cpu.md

The model is a Llama of 4 layers, 256 wide, 8 heads sharing 4 key/value heads, SwiGLU 768, vocabulary 8,192, context
128, micro-batch 8, fp32, AdamW, clipping at 1.0, random tokens; one intra-op thread per rank, Gloo. Rows: one
process (T = 1), and T = 2 and 4 ranks splitting the model (memtrain without and with sequence parallelism; PyTorch
without: transformers' norms and rotary embedding would need their own SequenceParallel plan). Each setting runs `rounds` times, alternating
memtrain and PyTorch; a row reports the median of the rounds' median ms/step after the warm-up (rank 0), rank 0's peak
RSS (the kernel's count), and the parameter bytes a rank holds (memtrain's tracker; PyTorch: its DTensors' local
shards). The ratio is memtrain's time over PyTorch's at the same T.
"""
import argparse, json, os, statistics, subprocess, sys, tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SHAPE = dict(n_layer=4, n_head=8, n_kv_head=4, n_embd=256, ffn=768, block_size=128, vocab=8192, micro_batch=8)
STEPS, WARMUP = 12, 3


def memtrain(a, work, name, T, extra):
    s = SHAPE
    run_dir = os.path.join(work, name)
    os.makedirs(run_dir, exist_ok=True)
    rank_cmd = [sys.executable, os.path.join(HERE, "distributed.py"), "--rss-wrap", run_dir, "--",
                os.path.join(a.build, "memtrain"), "--model.name=llama", f"--model.n_layer={s['n_layer']}",
                f"--model.n_head={s['n_head']}", f"--model.n_kv_head={s['n_kv_head']}", f"--model.n_embd={s['n_embd']}",
                f"--model.ffn_hidden={s['ffn']}", f"--model.block_size={s['block_size']}",
                f"--model.vocab_size={s['vocab']}", "--data.dataset=synthetic", f"--train.micro_batch={s['micro_batch']}",
                f"--train.steps={STEPS}", "--train.threads=1", "--train.eval_every=0", "--train.eval_batches=1",
                "--log.every=1", "--log.progress=lines", f"--log.dir={work}", f"--log.name={name}", "--log.overwrite=true",
                "--checkpoint.save_final=false", "--train.warmup_steps=2", "--train.weight_decay=0.1",
                "--memory.head=plain", f"--dist.tensor_parallel={T}"] + extra
    args = rank_cmd if T == 1 else [os.path.join(a.build, "memtrain-run"), "--standalone", "--nproc-per-node", str(T),
                                     "--"] + rank_cmd
    p = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        sys.exit(f"memtrain {name} failed:\n{p.stdout[-3000:]}")
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if '"ms_per_step"' in l]
    mem = [json.loads(l) for l in open(os.path.join(run_dir, "memory.rank0.jsonl"))]
    mem = [m for m in mem if m["device"] == "cpu" and m["step"] >= 1]
    return dict(ms=statistics.median(r["ms_per_step"] for r in rows if r["step"] > WARMUP),
                rss=int(open(os.path.join(run_dir, "rss.rank0")).read()), params=mem[-1]["params"],
                peak=max(m["peak_allocated"] for m in mem), first_loss=rows[0]["loss"], last_loss=rows[-1]["loss"])


def pytorch(a, T):
    s = SHAPE
    script = [os.path.join(HERE, "torch_tp.py"), "--steps", str(STEPS), "--warmup", str(WARMUP)] + \
        [x for k, v in s.items() for x in (f"--{k}", str(v))]
    args = [a.python] + (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(T)] if T > 1 else []) + script
    p = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if p.returncode != 0:
        sys.exit(f"PyTorch T={T} failed:\n{p.stderr[-3000:]}")
    r = json.loads([l for l in p.stdout.splitlines() if l.startswith("{")][-1])
    return dict(ms=r["ms_per_step"], rss=r["peak_rss"], params=r["param_bytes"], first_loss=r["first_loss"],
                last_loss=r["last_loss"])


def mib(b):
    return "—" if b is None else f"{b / 2**20:.1f} MiB"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--python", default=sys.executable, help="the venv's python, with torch and transformers")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks", "tensor_parallel_cpu.md"))
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    settings = [  # (label, T, memtrain's keys, PyTorch's T or None)
        ("T = 1 (one process)", 1, [], 1),
        ("T = 2, no sequence parallelism", 2, ["--dist.sequence_parallel=off"], 2),
        ("T = 2, sequence parallelism", 2, ["--dist.sequence_parallel=on"], None),
        # The fused head over the vocabulary's slices (chunks of 256 tokens: 4 per micro-batch), against PyTorch's
        # loss_parallel, which forms each rank's (tokens, V / T) logits whole.
        ("T = 2, no sequence parallelism, fused head", 2, ["--dist.sequence_parallel=off", "--memory.head=fused:256"], 2),
        ("T = 4, no sequence parallelism", 4, ["--dist.sequence_parallel=off"], 4),
        ("T = 4, sequence parallelism", 4, ["--dist.sequence_parallel=on"], None),
    ]
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for r in range(a.rounds):
            for i, (label, T, extra, torch_T) in enumerate(settings):
                results.setdefault(label, {"m": [], "t": []})
                results[label]["m"].append(memtrain(a, work, f"tp{i}", T, extra))
                if torch_T:
                    results[label]["t"].append(pytorch(a, torch_T))
    lines = ["# Tensor parallelism: memtrain against PyTorch's on the CPU", "",
             f"Written by `scripts/bench/tensor_parallel.py` ({os.cpu_count()} CPUs, one intra-op thread per rank, Gloo). "
             "A Llama of 4 layers, 256 wide, 8 heads sharing 4 key/value heads, SwiGLU 768, vocabulary 8,192, context "
             "128 (7.3 M parameters), micro-batch 8, fp32, AdamW, clipping at 1.0, random tokens. PyTorch: transformers' "
             "`LlamaForCausalLM` split by `parallelize_module` (q, k, v, gate, up ColwiseParallel; o, down "
             "RowwiseParallel; embedding RowwiseParallel; head ColwiseParallel with `loss_parallel()`), torch's AdamW "
             "on its DTensors (its default on a CPU: neither fused nor foreach; memtrain's is ATen's fused AdamW). memtrain: "
             "`dist.tensor_parallel`, the plain head with its vocabulary-parallel "
             "cross-entropy, or the fused head (`memory.head = fused:256`: 256 tokens' logits at a time, their log-sum-exp "
             "reduced over the group chunk by chunk) where the row says so, against the same PyTorch T = 2 run."
             f" {a.rounds} rounds alternating the two, {STEPS} steps each; ms/step is the median of the "
             f"rounds' medians after {WARMUP} warm-up steps, rank 0's. On 2 cores a second rank adds a core, not a "
             "second GPU, and T = 4 puts two ranks on each core: the T > 1 rows measure the split's overhead (collectives, "
             "smaller matrices), not a speed-up.",
             "", "| setting | memtrain ms/step | PyTorch ms/step | ratio | memtrain params / rank | PyTorch params / rank | "
             "memtrain peak RSS rank 0 | PyTorch peak RSS rank 0 | memtrain counted tensor peak | first loss (memtrain, PyTorch) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for label, _, _, torch_T in settings:
        m, t = results[label]["m"], results[label]["t"]
        mm = statistics.median(x["ms"] for x in m)
        tm = statistics.median(x["ms"] for x in t) if t else None
        ratio = f"{mm / tm:.2f}x" if tm else "—"
        tloss = f"{t[0]['first_loss']:.3f}" if t else "—"
        lines.append(f"| {label} | {mm:.1f} | {'—' if tm is None else f'{tm:.1f}'} | {ratio} | {mib(m[0]['params'])} | "
                     f"{mib(t[0]['params']) if t else '—'} | {mib(max(x['rss'] for x in m))} | "
                     f"{mib(max(x['rss'] for x in t)) if t else '—'} | {mib(max(x['peak'] for x in m))} | "
                     f"{m[0]['first_loss']:.3f}, {tloss} |")
        print(lines[-1], flush=True)
    lines += ["", "The first losses are both near ln(8192) = 9.01 (random tokens, the same initial-value scale); the "
              "two sides draw different weights and tokens, so only times and bytes are compared here (the same "
              "weights and data: TensorParallel.LossesAndGradientNormsEqualPyTorchsParallelizeModule)."]
    open(a.out, "w").write("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
