#!/usr/bin/env python3
"""Low-bit optimizer state: memtrain's adamw8bit / adamw4bit against its fp32 AdamW, and against torchao's
AdamW8bit / AdamW4bit in PyTorch on the same GPT, side by side in one run on this machine.

  flock /tmp/memtrain-build.lock python lowbit.py --build build --out docs/benchmarks/lowbit_cpu.md

1. Speed and state. The default job's GPT (examples/configs/gpt_austen_cpu.ini: 4 x 128, context 128, batch
   16) for STEPS steps with each optimizer, alternated ROUNDS times; ms/step is the median of the logged
   steps after the first log line, taking each optimizer's fastest round. The optimizer-state bytes are the
   run's own tracker's (memory.rank0.jsonl). The same model in PyTorch (torch_gpt.py) with torch.optim.AdamW
   (fused) and torchao's AdamW8bit / AdamW4bit, eager: torch.compile of torchao's step takes about a minute per
   parameter shape on this 2-core machine, so its compiled speed is not measured here.
2. Quality. The whole default job (600 steps) with seeds 1337, 1338, 1339 for each optimizer: the final
   validation loss. The spread of fp32 AdamW's losses over the seeds is the yardstick for "within noise".
"""
import argparse, json, os, statistics, subprocess, sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CONFIG = os.path.join(ROOT, "examples/configs/gpt_austen_cpu.ini")
OPTIMIZERS = ["adamw", "adamw8bit", "adamw4bit"]
STEPS, ROUNDS, SEEDS = 60, 2, [1337, 1338, 1339]
THREADS = 2


def run(cmd, env=None):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout}\n{p.stderr}")
    return p.stdout


def memtrain(build, out, name, optimizer, extra):
    run([os.path.join(build, "memtrain"), "--config", CONFIG, f"--train.optimizer={optimizer}",
         f"--train.threads={THREADS}", "--log.progress=lines", f"--log.dir={out}", f"--log.name={name}",
         "--log.overwrite=true", "--checkpoint.save_final=false"] + extra)
    folder = os.path.join(out, name)
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        lines = [json.loads(l) for l in f if '"ms_per_step"' in l]
    with open(os.path.join(folder, "memory.rank0.jsonl")) as f:
        memory = json.loads(f.read().strip().splitlines()[-1])
    with open(os.path.join(folder, "summary.json")) as f:
        summary = json.load(f)
    return dict(ms=statistics.median(l["ms_per_step"] for l in lines[1:]), state=memory["optimizer_state"],
                val=summary.get("val_loss"))


def torch_side(optimizer):
    torchao = os.environ.get("MEMTRAIN_TORCHAO", os.path.join(os.path.dirname(sys.prefix), "torchao0.18.0"))
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", PYTHONPATH=torchao)
    out = run([sys.executable, os.path.join(HERE, "torch_gpt.py"), "--n_layer", "4", "--n_head", "4", "--n_embd", "128",
               "--block_size", "128", "--vocab", "256", "--micro_batch", "16", "--steps", "30",
               "--threads", str(THREADS), "--optimizer", optimizer], env=env)
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs/benchmarks/lowbit_cpu.md"))
    ap.add_argument("--work", default="/tmp/memtrain-bench-lowbit")
    a = ap.parse_args()
    speed = {o: [] for o in OPTIMIZERS}
    for r in range(ROUNDS):
        for o in OPTIMIZERS:
            speed[o].append(memtrain(a.build, a.work, f"speed-{o}-{r}", o,
                                     [f"--train.steps={STEPS}", "--train.eval_every=0", "--train.eval_batches=1"]))
    fastest = {o: min(speed[o], key=lambda x: x["ms"]) for o in OPTIMIZERS}
    py = {o: torch_side(o) for o in OPTIMIZERS}
    quality = {o: [memtrain(a.build, a.work, f"seed-{o}-{s}", o, [f"--train.seed={s}"])["val"] for s in SEEDS]
               for o in OPTIMIZERS}

    base = fastest["adamw"]
    spread = max(quality["adamw"]) - min(quality["adamw"])
    rows = []
    for o in OPTIMIZERS:
        f = fastest[o]
        mean = statistics.mean(quality[o])
        rows.append(dict(optimizer=o, ms=f["ms"], time_ratio=f["ms"] / base["ms"], state=f["state"],
                         state_ratio=f["state"] / base["state"], py_ms=py[o]["ms_per_step"],
                         vs_python=f["ms"] / py[o]["ms_per_step"], val=quality[o], val_mean=mean,
                         val_delta=mean - statistics.mean(quality["adamw"])))
    goals = {"adamw8bit": (1.10, 0.26), "adamw4bit": (1.10, 0.14)}
    lines = ["# Low-bit optimizer state (CPU)", "",
             f"Written by `scripts/bench/lowbit.py` in one run. The default job's GPT (4 x 128, context 128, batch 16, "
             f"{THREADS} threads). Speed: {STEPS} steps per run, each optimizer's fastest of {ROUNDS} alternated "
             "rounds, median ms/step after the first logged interval. State: the run's tracker, optimizer state on "
             "rank 0 (every parameter's moments; the GPT's small tensors keep fp32 moments). PyTorch: the same model "
             "with torch.optim.AdamW(fused=True) or torchao 0.18's AdamW8bit / AdamW4bit, eager (TORCHDYNAMO_DISABLE=1).",
             "", "| optimizer | memtrain ms/step | vs fp32 AdamW | state bytes | vs fp32 | PyTorch ms/step | memtrain / PyTorch |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['optimizer']} | {r['ms']:.1f} | {r['time_ratio']:.3f}x | {r['state']:,} | {r['state_ratio']:.4f}x "
                     f"| {r['py_ms']:.1f} | {r['vs_python']:.2f}x |")
    lines += ["", f"Final validation loss of the whole default job (600 steps), seeds {', '.join(map(str, SEEDS))}; the spread "
              f"of fp32 AdamW's over the seeds is {spread:.4f}.", "",
              "| optimizer | val loss per seed | mean | mean - fp32 mean |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['optimizer']} | {', '.join(f'{v:.4f}' for v in r['val'])} | {r['val_mean']:.4f} | {r['val_delta']:+.4f} |")
    lines += ["", "Targets (issue 24): step time <= 1.10x fp32 AdamW; state <= 0.26x (8-bit), <= 0.14x (4-bit) of fp32 "
              "AdamW's; final loss within the seeds' spread.", ""]
    for o, (t_goal, s_goal) in goals.items():
        r = next(x for x in rows if x["optimizer"] == o)
        ok = lambda b: "yes" if b else "**no**"
        lines.append(f"- {o}: time {r['time_ratio']:.3f}x <= {t_goal}: {ok(r['time_ratio'] <= t_goal)}; state "
                     f"{r['state_ratio']:.4f}x <= {s_goal}: {ok(r['state_ratio'] <= s_goal)}; |loss delta| "
                     f"{abs(r['val_delta']):.4f} <= spread {spread:.4f}: {ok(abs(r['val_delta']) <= spread)}")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(a.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
