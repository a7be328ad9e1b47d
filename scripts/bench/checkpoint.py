#!/usr/bin/env python3
"""Training-state checkpoints: memtrain's save and load against PyTorch's torch.save / torch.load and
torch.distributed.checkpoint (DCP) on the same bytes, and what resuming and the per-step fault checks
cost a training step. Side by side in one run, on this machine's disk.

  flock /tmp/memtrain-build.lock python checkpoint.py --build build --out docs/benchmarks/checkpoint_cpu.md

1. Save / load. memtrain trains a GPT (about 25 M parameters, fp32, AdamW: parameters + two moments,
   300 MB) for 3 steps saving the whole state after each; its log gives each save's time, and a resumed
   run's log the load time (read, every checksum checked, copied into the model and optimizer). PyTorch
   saves a dictionary of tensors of exactly the checkpoint's names, shapes and dtypes (read from its
   manifest) with torch.save (then fsync, as memtrain does) and with DCP's single-process save, and loads
   them back. Medians over 3 repetitions.
2. Step time with the fault handling of the reliability issue on (signal check, non-finite check) is what
   every run now pays; it is compared with the step times in docs/benchmarks/techniques_cpu.md by that
   benchmark, not here.
"""
import argparse, json, os, re, shutil, statistics, subprocess, sys, tempfile, time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SHAPE = dict(n_layer=8, n_head=8, n_embd=512, block_size=128, micro_batch=2, threads=2)
REPEATS = 3


def memtrain_args(build, out, name, steps, extra):
    s = SHAPE
    return [os.path.join(build, "memtrain"), "--config", os.path.join(ROOT, "examples/configs/gpt_austen_cpu.ini"),
            f"--model.n_layer={s['n_layer']}", f"--model.n_head={s['n_head']}", f"--model.n_embd={s['n_embd']}",
            f"--model.block_size={s['block_size']}", f"--train.micro_batch={s['micro_batch']}",
            f"--train.threads={s['threads']}", f"--train.steps={steps}", "--train.eval_every=0", "--train.eval_batches=1",
            "--log.progress=lines", f"--log.dir={out}", f"--log.name={name}"] + extra


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout}\n{p.stderr}")
    return p.stdout


def memtrain_side(build, out):
    saves, loads = [], []
    log = run(memtrain_args(build, out, "save", 3, ["--checkpoint.every=1", "--checkpoint.keep=5"]))
    saves = [float(x) for x in re.findall(r"checkpoint: step \d+ saved to \S+ \([^)]* in ([0-9.]+) s\)", log)]
    bytes_ = None
    ck = os.path.join(out, "save", "checkpoints")
    step1 = os.path.join(ck, "step-000001")
    bytes_ = sum(os.path.getsize(os.path.join(step1, f)) for f in os.listdir(step1))
    for i in range(REPEATS):
        log = run(memtrain_args(build, out, f"load{i}", 3, [f"--checkpoint.resume={os.path.join(ck, 'step-000002')}",
                                                           "--checkpoint.save_final=false"]))
        loads.append(float(re.search(r"read and checked in ([0-9.]+) s", log).group(1)))
    return saves, loads, bytes_, step1


def torch_side(manifest_dir, out):
    import torch
    import torch.distributed.checkpoint as dcp
    torch.set_num_threads(SHAPE["threads"])
    m = json.load(open(os.path.join(manifest_dir, "manifest.json")))
    dtypes = {"F32": torch.float32, "I64": torch.int64, "BF16": torch.bfloat16, "F16": torch.float16, "I32": torch.int32}
    state = {name: torch.randn(t["shape"]).to(dtypes[t["dtype"]]) if dtypes[t["dtype"]].is_floating_point
             else torch.zeros(t["shape"], dtype=dtypes[t["dtype"]]) for name, t in m["tensors"].items()}
    res = {"torch.save": [], "torch.load": [], "dcp.save": [], "dcp.load": []}
    for i in range(REPEATS):
        path = os.path.join(out, f"torch{i}.pt")
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        res["torch.save"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        loaded = torch.load(path)
        res["torch.load"].append(time.perf_counter() - t0)
        del loaded
        d = os.path.join(out, f"dcp{i}")
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=d)
        res["dcp.save"].append(time.perf_counter() - t0)
        target = {k: torch.empty_like(v) for k, v in state.items()}
        t0 = time.perf_counter()
        dcp.load(target, checkpoint_id=d)
        res["dcp.load"].append(time.perf_counter() - t0)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs/benchmarks/checkpoint_cpu.md"))
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="memtrain-bench-ckpt-", dir=os.environ.get("TMPDIR", "/tmp"))
    try:
        saves, loads, nbytes, step1 = memtrain_side(a.build, work)
        ref = torch_side(step1, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    mb = nbytes / 2**20
    rows = [("memtrain save (staged, fsynced, renamed, manifest with CRC-32)", med(saves)),
            ("torch.save + fsync", med(ref["torch.save"])),
            ("dcp.save (torch.distributed.checkpoint, one process)", med(ref["dcp.save"])),
            ("memtrain load (every checksum checked, copied into model + optimizer)", med(loads)),
            ("torch.load", med(ref["torch.load"])),
            ("dcp.load", med(ref["dcp.load"]))]
    lines = [f"# Training-state checkpoints on the CPU ({mb:.1f} MiB: GPT {SHAPE['n_layer']} x {SHAPE['n_embd']}, "
             "fp32 parameters + AdamW moments)", "",
             "`scripts/bench/checkpoint.py`: median of " + f"{REPEATS} each, one run on this machine's disk. The PyTorch "
             "side saves tensors of the checkpoint's own names, shapes and dtypes. memtrain's load time includes "
             "reading every file twice (checksum, then tensors) and copying into the trainer; torch.load/dcp.load "
             "only read.", "",
             "| operation | s | MiB/s | vs PyTorch's |", "|---|---|---|---|"]
    for name, s in rows:
        base = med(ref["torch.save"]) if "save" in name else med(ref["torch.load"])
        ratio = "" if name.startswith(("torch", "dcp")) else f"{s / base:.2f}x torch.{'save' if 'save' in name else 'load'}, " \
            f"{s / med(ref['dcp.save' if 'save' in name else 'dcp.load']):.2f}x dcp"
        lines.append(f"| {name} | {s:.3f} | {mb / s:.0f} | {ratio} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(a.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
