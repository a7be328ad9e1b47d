#!/usr/bin/env python3
"""memtrain's speed against PyTorch eager and torch.compile, the same work on both sides in one run (issue 40).

  gpu_speed.py --build build-gpu --device cuda --out $OUT/gpu_speed.md      (one GPU window: scripts/gpu_check.sh speed)
  gpu_speed.py --build build --device cpu --quick --out /tmp/speed.md       (the script's own check: tiny shapes, fp32)

Rows, in order of what a short window must not miss (the table is rewritten after each row):
  1. GPT-2 124M (vocabulary 50,304, bf16 autocast, 16 x 4 micro-batches of 1,024 tokens): memtrain with one step
     after the timed ones profiled (log.profile_step: profile.md, the per-kernel table), PyTorch eager;
  2. Llama-3.2-1B-shaped, random weights (micro-batch 4 of 2,048 tokens): memtrain (profiled the same way), eager;
  3. PyTorch torch.compile on both (a minute or more of compiling each);
  4. memtrain's levers on GPT-2, each alone against row 1: micro-batch 64 x 1, vocabulary 50,257, the fused head,
     bf16 parameters with fp32 masters, cuDNN attention deprioritised (TORCH_CUDNN_SDPA_DEPRIORITIZED=1).
Same model (scripts/reference/gpt_ref.py is memtrain's GPT op for op), vocabulary, tokens per step, micro-batching,
optimizer (fused AdamW, clip 1.0), synthetic tokens drawn on the host, and timed span: the wall time between log
points (every 4 steps), per step, after the warm-up. MFU by memtrain's count (6 N + 12 L C T, N without the position
table; PaLM's for Llama) and, for GPT, llm.c's (6 N + 6 L C T, every parameter). Peak: the allocator's peak over
the run's steps (memtrain: its tracker; PyTorch: max_memory_allocated); memtrain's own estimate beside it.
"""
import argparse, datetime, json, os, shutil, statistics, subprocess, sys, tempfile, time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

SHAPES = {
    "cuda": {
        "gpt": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab=50304, micro_batch=16, accum_steps=4,
                    steps=12, log_every=4, warmup=4),
        "llama": dict(preset="llama-3.2-1b", n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, ffn=8192, vocab=128256,
                      tie=True, block_size=2048, micro_batch=4, accum_steps=1, steps=12, log_every=4, warmup=4),
        "peak_tflops": 989.4,  # dense bf16 tensor-core peak of an H100 / H200 SXM (spec sheet)
    },
    "cpu": {  # the script's own check: tiny shapes, fp32 (bf16 is emulated on most CPUs)
        "gpt": dict(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab=256, micro_batch=4, accum_steps=2, steps=8,
                    log_every=2, warmup=2),
        "llama": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, ffn=128, vocab=256, tie=True, block_size=64,
                      micro_batch=4, accum_steps=1, steps=8, log_every=2, warmup=2),
        "peak_tflops": 1.0,  # a nominal figure: CPU MFU is not a claim, only the arithmetic's check
    },
}


def memtrain_args(model, s, device, precision, steps):
    a = ["--data.dataset=synthetic", f"--train.device={device}", f"--train.precision={precision}",
         f"--train.micro_batch={s['micro_batch']}", f"--train.accum_steps={s['accum_steps']}", f"--train.steps={steps}",
         "--train.warmup_steps=2", "--train.eval_every=0", "--train.eval_batches=1", f"--log.every={s['log_every']}",
         "--log.progress=lines", "--checkpoint.save_final=false", "--log.overwrite=true", f"--model.name={model}",
         f"--model.block_size={s['block_size']}"] + (["--model.dropout=0"] if model == "gpt" else [])
    if s.get("preset"):
        a.append(f"--model.preset={s['preset']}")
    else:
        a += [f"--model.n_layer={s['n_layer']}", f"--model.n_head={s['n_head']}", f"--model.n_embd={s['n_embd']}",
              f"--model.vocab_size={s['vocab']}"]
        if model == "llama":
            a += [f"--model.n_kv_head={s['n_kv_head']}", f"--model.ffn_hidden={s['ffn']}",
                  f"--model.tie_embeddings={'true' if s.get('tie') else 'false'}"]
    return a


def run_checked(args, env=None):
    """Runs a row's process; a failure raises with its last line (the table names it)."""
    p = subprocess.run(args, capture_output=True, text=True, env=dict(os.environ, **(env or {})), timeout=900)
    if p.returncode != 0:
        text = (p.stdout + p.stderr).strip()
        raise RuntimeError(text.splitlines()[-1][:300] if text else f"exit {p.returncode}")
    return p.stdout


def run_memtrain(build, model, s, device, precision, name, work, extra=(), env=None, profile=False):
    # profile: one more step after the timed ones, recorded by the profiler (its recording and synchronisation slow it,
    # and the timed steps run before anything of it is switched on).
    steps = s["steps"] + (1 if profile else 0)
    args = [os.path.join(build, "memtrain")] + memtrain_args(model, s, device, precision, steps) + \
           [f"--log.dir={work}", f"--log.name={name}", f"--log.profile_step={steps if profile else 0}"] + list(extra)
    run_checked(args, env)
    run = os.path.join(work, name)
    logs = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl")) if '"ms_per_step"' in l]
    # Each log line's ms_per_step is the span since the previous log point, per step; the first after the warm-up on.
    timed = [m for m in logs if m["step"] - s["log_every"] >= s["warmup"] and m["step"] <= s["steps"] and
             m["step"] % s["log_every"] == 0]
    summary = json.load(open(os.path.join(run, "summary.json")))
    est = summary.get("memory_estimate", {})
    ms = statistics.median(m["ms_per_step"] for m in timed)
    r = {"ms": ms, "tokens_per_s": statistics.median(m["tokens_per_s"] for m in timed),
         "flops_per_token": timed[-1]["flops_per_s"] / timed[-1]["tokens_per_s"],
         "peak": max((v for k, v in summary.get("peak_allocated_bytes", {}).items() if k.endswith("/" + ("cuda:0" if device == "cuda" else "cpu"))),
                     default=None),
         "estimate": est.get("device", {}).get("peak"),
         "loss": summary.get("final_train_loss"), "run": run}
    if model == "gpt":  # llm.c's count from memtrain's: N = (F - 12 L C T) / 6 without the position table, which llm.c counts
        L, C, T = s["n_layer"], s["n_embd"], s["block_size"]
        n_all = (r["flops_per_token"] - 12 * L * C * T) / 6 + T * C
        r["flops_per_token_llmc"] = 6 * n_all + 6 * L * C * T
    if profile:
        r["profile"] = os.path.join(run, "profile.md")
    return r


def run_torch(python, model, s, device, precision, compile_=False):
    args = [python, os.path.join(HERE, "torch_speed.py"), f"--model={model}", f"--device={device}", f"--precision={precision}"]
    for k in ("n_layer", "n_head", "n_kv_head", "n_embd", "ffn", "block_size", "vocab", "micro_batch", "accum_steps", "steps",
              "log_every", "warmup"):
        if k in s:
            args.append(f"--{k}={s[k]}")
    if s.get("tie"):
        args.append("--tie")
    if compile_:
        args.append("--compile")
    o = json.loads(run_checked(args).strip().splitlines()[-1])
    return {"ms": o["ms_per_step"], "tokens_per_s": o["tokens_per_s"], "flops_per_token": o["flops_per_token"],
            "flops_per_token_llmc": o.get("flops_per_token_llmc"), "peak": o.get("peak_allocated"), "loss": o["final_loss"],
            "sdp_choice": o.get("sdp_choice"), "compile_s": o.get("compile_s")}


def gib(b):
    return "—" if b is None else f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def write_table(path, device, device_name, peak_tflops, rows, base, notes, failures):
    peak = peak_tflops * 1e12
    with open(path, "w") as f:
        f.write(f"# GPU speed: memtrain against PyTorch eager and torch.compile ({datetime.date.today()}, {device_name})\n\n")
        f.write("Written by `scripts/bench/gpu_speed.py` (`scripts/gpu_check.sh` with GPU_CHECK_MODE=speed). Same model, "
                "vocabulary, tokens per step, micro-batching, optimizer and timed span on both sides (the script's "
                "docstring). MFU against " + f"{peak_tflops:g} TFLOP/s" + (" (nominal on a CPU)" if device == "cpu" else "") +
                "; 'llm.c' is llm.c's count (6 N + 6 L C T, every parameter).\n\n")
        f.write("| model | row | ms/step | tokens/s | MFU | MFU (llm.c) | time / memtrain's | peak | memtrain's estimate | loss |\n"
                "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
        for r in rows:
            mfu = r["tokens_per_s"] * r["flops_per_token"] / peak
            llmc = r.get("flops_per_token_llmc")
            llmc = f"{100 * r['tokens_per_s'] * llmc / peak:.1f}%" if llmc else "—"
            ref = base.get(r["model"])
            ratio = f"{r['ms'] / ref['ms']:.2f}x" if ref and r is not ref else "—"
            f.write(f"| {r['model']} | {r['label']} | {r['ms']:.1f} | {r['tokens_per_s']:,.0f} | {100 * mfu:.1f}% | "
                    f"{llmc} | {ratio} | {gib(r.get('peak'))} | {gib(r.get('estimate'))} | {r['loss']:.4f} |\n")
        f.write("\n'time / memtrain's': the row's ms/step over memtrain's first row of that model (above 1: the row "
                "takes longer than memtrain; a lever above 1 is slower than memtrain without it).\n")
        for n in notes:
            f.write(f"\n{n}\n")
        for label, why in failures:
            f.write(f"\n- **{label} failed**: `{why}`\n")


def keep_profile(r, model, steps, out_dir, notes):
    """A profiled memtrain row's table and trace, copied beside the benchmark's table as <model>_profile.*."""
    if not r or not os.path.exists(r.get("profile", "")):
        return
    shutil.copy(r["profile"], os.path.join(out_dir, f"{model}_profile.md"))
    shutil.copy(os.path.join(r["run"], "profile.json"), os.path.join(out_dir, f"{model}_profile_trace.json"))
    notes.append(f"memtrain's step {steps + 1} on {model} (after the timed ones), kernel by kernel: `{model}_profile.md` "
                 f"(its Chrome trace `{model}_profile_trace.json`).")


def levers(g):
    """memtrain's levers on GPT, each alone: (label, run name, shape, run_memtrain's keywords)."""
    whole = g["micro_batch"] * g["accum_steps"]
    return [(f"micro-batch {whole} x 1", "mb1x", dict(g, micro_batch=whole, accum_steps=1), {}),
            ("vocabulary 50,257 (unpadded)", "v50257", dict(g, vocab=50257), {}),
            ("memory.head = fused", "fused", g, {"extra": ["--memory.head=fused"]}),
            ("bf16 parameters, fp32 masters", "bf16p", g, {"extra": ["--train.param_dtype=bf16"]}),
            ("cuDNN attention deprioritised", "nocudnn", g, {"env": {"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"}})]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="no torch.compile rows (the CPU check)")
    ap.add_argument("--skip", default="", help="comma-separated parts to leave out: gpt, compile, llama, levers "
                                               "(llama8b: gpu_check.sh's own stage, ignored here)")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    if a.quick:
        skip |= {"compile"}
    shapes = SHAPES[a.device]
    precision = "bf16" if a.device == "cuda" else "fp32"
    work = tempfile.mkdtemp(prefix="memtrain-speed-")
    out_dir = os.path.dirname(os.path.abspath(a.out))
    os.makedirs(out_dir, exist_ok=True)
    device_name = "cpu"
    if a.device == "cuda":
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True)
        device_name = q.stdout.strip() or "cuda"
    rows, failures, notes = [], [], []
    base = {}

    def write():
        write_table(a.out, a.device, device_name, shapes["peak_tflops"], rows, base, notes, failures)

    def add(model, label, fn, *args, **kw):
        t0 = time.time()
        try:
            r = fn(*args, **kw)
        except Exception as e:  # a failed row is reported in the table, the others still run
            failures.append((f"{model}: {label}", str(e)))
            print(f"{model}: {label}: FAILED: {e}", flush=True)
            write()
            return None
        r.update(model=model, label=label)
        rows.append(r)
        if label == "memtrain":
            base[model] = r
        print(f"{model:<6} {label:<44} {r['ms']:9.1f} ms  {r['tokens_per_s']:12,.0f} tok/s  peak {gib(r.get('peak'))}"
              f"  ({time.time() - t0:.0f} s)", flush=True)
        write()
        return r

    g, l = shapes["gpt"], shapes["llama"]
    if "gpt" not in skip:
        keep_profile(add("gpt", "memtrain", run_memtrain, a.build, "gpt", g, a.device, precision, "gpt", work, profile=True),
                     "gpt", g["steps"], out_dir, notes)
        e = add("gpt", "PyTorch eager", run_torch, a.python, "gpt", g, a.device, precision)
        if e and e.get("sdp_choice") is not None:
            notes.append(f"SDPA's choice for GPT-2's q, k, v (torch._fused_sdp_choice, 0 math, 1 flash, 2 efficient, "
                         f"3 cuDNN): {e['sdp_choice']}.")
    if "llama" not in skip:
        keep_profile(add("llama", "memtrain", run_memtrain, a.build, "llama", l, a.device, precision, "llama", work,
                         profile=True), "llama", l["steps"], out_dir, notes)
        add("llama", "PyTorch eager", run_torch, a.python, "llama", l, a.device, precision)
    # torch.compile after both models' eager rows: a minute or more of compiling each, the first thing a short window
    # may lose.
    if "compile" not in skip and "gpt" not in skip:
        c = add("gpt", "PyTorch torch.compile", run_torch, a.python, "gpt", g, a.device, precision, compile_=True)
        if c and c.get("compile_s"):
            notes.append(f"GPT torch.compile: the first step (compilation) took {c['compile_s']:.0f} s.")
    if "compile" not in skip and "llama" not in skip:
        add("llama", "PyTorch torch.compile", run_torch, a.python, "llama", l, a.device, precision, compile_=True)
    if "levers" not in skip:
        for label, name, shape, kw in levers(g):
            add("gpt", f"lever: {label}", run_memtrain, a.build, "gpt", shape, a.device, precision, name, work, **kw)
    write()
    print(open(a.out).read())
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
