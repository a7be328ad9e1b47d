#!/usr/bin/env python3
"""memtrain's memory-technique benchmark: the same GPT with each technique alone and combined, measured
side by side in one run, with ratios against the baseline, a hand-written LibTorch loop and PyTorch eager.

  techniques.py --build build --device cpu  --out docs/benchmarks/techniques_cpu.md
  techniques.py --build build-gpu --device cuda --out $OUT/techniques_gpu.md

Step time is the median over the steps after the warm-up (memtrain logs every step); memory is
memtrain's tracker (memory.rank0.jsonl): the step's peak allocated bytes and its activation peak
(peak minus what was resident at the step's start), maximum over the steps after the first.
"""
import argparse, json, os, statistics, subprocess, sys, tempfile, time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

SIZES = {  # model and batch per device: CPU small enough for 2 cores; CUDA is GPT-2 124M
    # One intra-op thread on the CPU: with two threads on this 2-core machine step times vary by +-10%
    # from run to run, more than the differences being measured.
    "cpu": dict(n_layer=12, n_head=4, n_embd=128, block_size=256, vocab=256, micro_batch=8, steps=10, warmup=3,
                threads=1),
    "cuda": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab=50257, micro_batch=16, steps=12, warmup=3),
}


def model_args(s):
    return ([f"--train.threads={s['threads']}"] if s.get("threads") else []) + [f"--model.n_layer={s['n_layer']}", f"--model.n_head={s['n_head']}", f"--model.n_embd={s['n_embd']}",
            f"--model.block_size={s['block_size']}", f"--model.vocab_size={s['vocab']}"]


def run_memtrain(build, device, s, name, extra, workdir):
    micro = [] if any(e.startswith("--train.micro_batch") for e in extra) else [f"--train.micro_batch={s['micro_batch']}"]
    args = [os.path.join(build, "memtrain"), "--data.dataset=synthetic", f"--train.device={device}",
            f"--train.steps={s['steps']}"] + micro + ["--train.eval_every=0",
            "--train.eval_batches=1", "--log.every=1", "--log.progress=lines", f"--log.dir={workdir}",
            f"--log.name={name}", "--checkpoint.save_final=false", "--train.warmup_steps=2"] + model_args(s) + extra
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    run = os.path.join(workdir, name)
    ms = [json.loads(l)["ms_per_step"] for l in open(os.path.join(run, "metrics.jsonl")) if '"ms_per_step"' in l]
    dev = "cuda:0" if device == "cuda" else "cpu"
    mem = [json.loads(l) for l in open(os.path.join(run, "memory.rank0.jsonl"))]
    mem = [m for m in mem if m["device"] == dev and m["step"] >= 1]
    return {"ms": statistics.median(ms[s["warmup"]:]), "peak": max(m["peak_allocated"] for m in mem),
            "act": max(m["activation_peak"] for m in mem)}


def run_bare(build, device, s, extra):
    args = [os.path.join(build, "memtrain_bare_loop"), "--data.dataset=synthetic", f"--train.device={device}",
            f"--train.steps={s['steps']}", f"--train.micro_batch={s['micro_batch']}"] + model_args(s) + extra
    env = dict(os.environ, OMP_NUM_THREADS=str(s["threads"])) if s.get("threads") else None
    out = subprocess.run(args, check=True, capture_output=True, text=True, env=env).stdout.splitlines()
    ms = [json.loads(l)["ms"] for l in out if '"ms"' in l]
    return {"ms": statistics.median(ms[s["warmup"]:])}


def run_torch(python, device, s, extra):
    args = [python, os.path.join(HERE, "torch_gpt.py"), f"--device={device}"] + \
           [f"--{k}={v}" for k, v in s.items()] + extra
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    r = json.loads(out)
    return {"ms": r["ms_per_step"], "peak": r.get("peak_allocated"), "act": r.get("activation_peak")}


REPEATS = 1  # set from --repeats: each row is the fastest of this many runs (noise only ever adds time)


def guarded(label, failures, fn, *args):
    """Runs one measurement; a failed run is reported in the table, not fatal to the benchmark."""
    try:
        runs = [fn(*args) for _ in range(REPEATS)]
        return min(runs, key=lambda r: r["ms"])
    except subprocess.CalledProcessError as e:
        tail = (e.stderr or "").strip().splitlines()[-1:] or [f"exit {e.returncode}"]
        failures.append((label, tail[0][:300]))
        print(f"{label}: FAILED: {tail[0]}", flush=True)
        return None


def train_flops_per_step(s):
    """6 N + 12 L C T per token (PaLM appendix B), N without the position embedding."""
    L, C, T, V = s["n_layer"], s["n_embd"], s["block_size"], s["vocab"]
    n = V * C + L * (12 * C * C + 13 * C) + 2 * C
    return (6 * n + 12 * L * C * T) * T * s["micro_batch"]


H200_BF16_PEAK = 989.4e12  # dense bf16 tensor-core peak of an H100/H200 SXM (spec sheet)


def mib(b):
    return "—" if b is None else f"{b / 2**20:,.1f} MiB"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="fewer runs (smoke test of this script)")
    ap.add_argument("--repeats", type=int, default=None, help="runs per row, fastest kept (default: CPU 2, CUDA 1)")
    a = ap.parse_args()
    global REPEATS
    REPEATS = a.repeats or (1 if a.device == "cuda" else 2)
    s = dict(SIZES[a.device])
    cuda = a.device == "cuda"
    half = "bf16"
    work = tempfile.mkdtemp(prefix="memtrain-bench-")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    open(a.out + ".jsonl", "w").close()
    rows, t0 = [], time.time()

    failures = []

    def add(label, kind, result, group):
        if result is None:
            return
        rows.append(dict(label=label, kind=kind, group=group, **result))
        with open(a.out + ".jsonl", "a") as raw:  # progressive: survives a run cut short by a time limit
            raw.write(json.dumps(rows[-1]) + "\n")
        print(f"{label:<44} {result['ms']:9.1f} ms  peak {mib(result.get('peak')):>14}  act {mib(result.get('act')):>14}",
              flush=True)

    techniques = [  # (label, group, memtrain overrides)
        ("none (fp32)", "fp32", []),
        ("checkpoint all", "fp32", ["--memory.recompute=all"]),
        ("checkpoint every:2", "fp32", ["--memory.recompute=every:2"]),
        ("checkpoint attn (selective)", "fp32", ["--memory.recompute=attn"]),
        ("checkpoint mlp (selective)", "fp32", ["--memory.recompute=mlp"]),
        (f"{half} autocast", "fp32", [f"--train.precision={half}"]),
        (f"accumulation 4 x {s['micro_batch'] // 4}", "fp32",
         [f"--train.micro_batch={s['micro_batch'] // 4}", "--train.accum_steps=4"]),
        (f"{half} + checkpoint all + accumulation 4", "fp32",
         [f"--train.precision={half}", "--memory.recompute=all", f"--train.micro_batch={s['micro_batch'] // 4}",
          "--train.accum_steps=4"]),
    ]
    techniques += [("fused head (linear + loss in chunks)", "fp32", ["--memory.head=fused"]),
                   ("checkpoint all + fused head", "fp32", ["--memory.recompute=all", "--memory.head=fused"])]
    if cuda:
        techniques += [("bf16 + checkpoint all", "fp32", ["--train.precision=bf16", "--memory.recompute=all"]),
                       ("bf16 + fused head", "fp32", ["--train.precision=bf16", "--memory.head=fused"]),
                       ("bf16 + checkpoint all + fused head", "fp32",
                        ["--train.precision=bf16", "--memory.recompute=all", "--memory.head=fused"]),
                       ("fp16 + loss scaling", "fp32", ["--train.precision=fp16"])]
    if a.quick:
        techniques = techniques[:2]
    results = {}
    for label, group, extra in techniques:
        name = label.split()[0].replace(":", "") + str(len(results))
        r = guarded(label, failures, run_memtrain, a.build, a.device, s, name, extra, work)
        if r:
            results[label] = r
        add(label, "memtrain", r, group)
    base = results["none (fp32)"]  # without the baseline nothing below means anything: let it raise
    # budget: halfway between none and all, so the plan must mix checkpointed and kept blocks.
    if "checkpoint all" in results and not a.quick:
        budget = round((base["act"] + results["checkpoint all"]["act"]) / 2 / 2**20)  # whole MiB: what runs is what is checked
        label = f"checkpoint budget:{budget:.0f} MiB"
        r = guarded(label, failures, run_memtrain, a.build, a.device, s, "budget",
                    [f"--memory.recompute=budget:{budget:.0f}"], work)
        if r:
            r["budget"] = budget * 2**20
            results[label] = r
        add(label, "memtrain", r, "fp32")

    # Baselines: the hand-written LibTorch loop and PyTorch eager on the same model and batch.
    comparisons = [("hand-written LibTorch loop, fp32", "bare", []),
                   ("PyTorch eager, fp32", "torch", []),
                   ("PyTorch eager, torch.utils.checkpoint", "torch", ["--checkpoint"]),
                   (f"PyTorch eager, autocast {half}", "torch", [f"--precision={half}"])]
    if cuda:
        comparisons += [("hand-written LibTorch loop, bf16", "bare", ["--train.precision=bf16"]),
                        ("PyTorch eager, bf16 + checkpoint", "torch", ["--precision=bf16", "--checkpoint"])]
    if a.quick:
        comparisons = comparisons[:2]
    for label, kind, extra in comparisons:
        r = guarded(label, failures, run_bare if kind == "bare" else run_torch,
                    a.build if kind == "bare" else a.python, a.device, s, extra)
        if r:
            results[label] = r
        add(label, kind, r, "baseline")

    # The table and the target checks, ratios from this one run.
    lines = [f"# memtrain memory techniques, {a.device.upper()} benchmark", "",
             f"GPT {s['n_layer']} layers x {s['n_embd']} wide, {s['n_head']} heads, context {s['block_size']}, "
             f"vocab {s['vocab']}, micro-batch {s['micro_batch']} (global batch the same in every row), synthetic "
             f"tokens, AdamW. Median step time over steps {s['warmup'] + 1}-{s['steps']}; memory from memtrain's "
             f"tracker (PyTorch rows: torch.cuda.max_memory_allocated, CUDA only). Generated by "
             f"`scripts/bench/techniques.py` in one run ({time.time() - t0:.0f} s); each row is the fastest of "
             f"{REPEATS} run(s)" + (f", on {s['threads']} intra-op thread" if s.get("threads") else "") + ".", "",
             "| run | ms/step | time vs none | peak allocated | activation peak | activations vs none |"
             + (" MFU (bf16 peak 989 TFLOP/s) |" if cuda else ""),
             "|---|---:|---:|---:|---:|---:|" + ("---:|" if cuda else "")]
    for r in rows:
        tr = r["ms"] / base["ms"]
        ar = f"{r['act'] / base['act']:.2f}" if r.get("act") else "—"
        mfu = f" {100 * train_flops_per_step(s) / (r['ms'] / 1000) / H200_BF16_PEAK:.1f}% |" if cuda else ""
        lines.append(f"| {r['label']} | {r['ms']:.1f} | {tr:.2f} | {mib(r.get('peak'))} | {mib(r.get('act'))} | {ar} |"
                     + mfu)
    checks = []
    if "checkpoint all" in results:
        c = results["checkpoint all"]
        checks.append(("checkpoint all: step time <= 1.35 x none", c["ms"] / base["ms"], c["ms"] / base["ms"] <= 1.35))
        checks.append(("checkpoint all: activation peak <= 0.40 x none", c["act"] / base["act"], c["act"] / base["act"] <= 0.40))
    fh, fa = results.get("fused head (linear + loss in chunks)"), results.get("checkpoint all + fused head")
    if fh and fa:  # the blocks' share, with the head's logits out of the way in both runs
        checks.append(("checkpoint all + fused head: activation peak <= 0.40 x fused head",
                       fa["act"] / fh["act"], fa["act"] / fh["act"] <= 0.40))
        checks.append(("checkpoint all + fused head: step time <= 1.35 x fused head",
                       fa["ms"] / fh["ms"], fa["ms"] / fh["ms"] <= 1.35))
    for k, v in results.items():
        if "budget" in v:
            checks.append((f"{k}: activation peak <= budget", v["act"] / v["budget"], v["act"] <= v["budget"]))
    bare = results.get("hand-written LibTorch loop, fp32")
    if bare:
        checks.append(("memtrain overhead vs hand-written loop <= 1.03", base["ms"] / bare["ms"], base["ms"] / bare["ms"] <= 1.03))
    py = results.get("PyTorch eager, fp32")
    if py:
        checks.append(("memtrain time / PyTorch eager time <= 1.00", base["ms"] / py["ms"], base["ms"] <= py["ms"]))
        pyc = results.get("PyTorch eager, torch.utils.checkpoint")
        if pyc and "checkpoint all" in results:
            r = results["checkpoint all"]["ms"] / pyc["ms"]
            checks.append(("checkpoint all / torch.utils.checkpoint time <= 1.00", r, r <= 1.0))
        if cuda and py.get("peak"):
            checks.append(("memtrain peak / PyTorch eager peak <= 1.00", base["peak"] / py["peak"], base["peak"] <= py["peak"]))
    if cuda:
        bf = results.get("bf16 autocast")
        if bf:
            mfu = train_flops_per_step(s) / (bf["ms"] / 1000) / H200_BF16_PEAK
            checks.append(("GPT-2 124M bf16 MFU >= 0.40 (of 989 TFLOP/s)", mfu, mfu >= 0.40))
    lines += ["", "| target | measured ratio | met |", "|---|---:|:---:|"]
    lines += [f"| {n} | {v:.3f} | {'yes' if ok else '**no**'} |" for n, v, ok in checks]
    if failures:
        lines += ["", "Runs that failed (not in the table):", ""] + [f"- {n}: `{e}`" for n, e in failures]
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    open(a.out, "w").write(text)
    print(text)


if __name__ == "__main__":
    main()
