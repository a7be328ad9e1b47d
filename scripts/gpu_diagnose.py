#!/usr/bin/env python3
"""A stage of the GPU check (scripts/gpu_check.sh): what a GPU allocates that memtrain's own estimate does not name.

On the H200 (2026-12-04) every small run's measured peak was 65-76 MiB over its estimate, a near-constant term
(docs/gpu_check/2026-12-04/README.md). This measures, with PyTorch alone, what the caching allocator holds after
a first matmul in the main thread, after the backward (autograd's device thread: another cuBLAS handle), and after
a bf16 autocast matmul (cuBLASLt), then runs memtrain's plain case with memory.snapshot = true and sums the
snapshot's live blocks by the frame that allocated them. Prints a table and writes OUT/diagnose.json and the
snapshot (OUT/snapshot_plain.pickle). Exits 0 whenever it measured (a diagnosis, not a check).

    python3 scripts/gpu_diagnose.py --build build-gpu --out $OUT
"""
import argparse, glob, json, os, pickle, shutil, subprocess, sys, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20


def torch_steps():
    import torch
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to diagnose")
        return None
    torch.cuda.init()
    rows = []
    def mark(what, base):
        torch.cuda.synchronize()
        now = torch.cuda.memory_allocated()
        rows.append((what, now - base))
        return now
    a = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    b = torch.randn(1024, 1024, device="cuda")
    base = torch.cuda.memory_allocated()
    y = a @ b  # fp32 GEMM on this thread's cuBLAS handle
    now = mark("fp32 matmul (main thread), less its 4 MiB output", base + y.numel() * 4)
    y.sum().backward()  # its backward GEMM runs on autograd's device thread
    del y
    now = mark("fp32 backward (autograd's thread), less a.grad's 4 MiB", now - 1024 * 1024 * 4 + a.grad.numel() * 4)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        z = a @ b
    now = mark("bf16 autocast matmul, less its output and the two bf16 casts", now + z.numel() * 2 + 2 * a.numel() * 2)
    z.float().sum().backward()
    del z
    mark("bf16 backward", now)
    total = torch.cuda.memory_allocated() - base - a.grad.numel() * 4
    return {"steps": [{"what": w, "bytes": int(x)} for w, x in rows], "held_after_all": int(total),
            "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
            "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            "CUBLASLT_WORKSPACE_SIZE": os.environ.get("CUBLASLT_WORKSPACE_SIZE")}


def snapshot_by_frame(build, out):
    work = tempfile.mkdtemp(prefix="memtrain-diagnose-")
    cmd = [os.path.join(build, "memtrain"), "--model.name=gpt", "--model.preset=custom", "--model.n_layer=4",
           "--model.n_head=4", "--model.n_embd=256", "--model.block_size=256", "--model.vocab_size=512",
           "--model.dropout=0", "--data.dataset=synthetic", "--train.micro_batch=8", "--train.steps=2",
           "--train.eval_every=0", "--train.device=cuda", "--memory.snapshot=true", "--checkpoint.save_final=false",
           f"--log.dir={work}", "--log.name=plain", "--log.progress=lines"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    est = [l for l in (p.stdout + p.stderr).splitlines() if "estimate" in l and "peak" in l]
    files = glob.glob(os.path.join(work, "plain", "memory_snapshot.rank*.pickle"))
    if p.returncode != 0 or not files:
        print(f"memtrain exited {p.returncode}; no snapshot:\n" + (p.stdout + p.stderr)[-1500:])
        return None
    shutil.copy(files[0], os.path.join(out, "snapshot_plain.pickle"))
    with open(files[0], "rb") as f:
        snap = pickle.load(f)
    by_frame = {}
    for seg in snap.get("segments", []):
        for blk in seg.get("blocks", []):
            if blk.get("state") != "active_allocated":
                continue
            frames = blk.get("frames") or []
            name = next((fr.get("name", "?") for fr in frames if "memtrain" in fr.get("filename", "") or
                         "cublas" in fr.get("name", "").lower() or "Workspace" in fr.get("name", "")),
                        frames[0].get("name", "?") if frames else "(no stack)")
            by_frame[name] = by_frame.get(name, 0) + blk.get("requested_size", blk.get("size", 0))
    shutil.rmtree(work, ignore_errors=True)
    top = sorted(by_frame.items(), key=lambda kv: -kv[1])[:25]
    return {"estimate_lines": est, "live_at_end_by_frame": [{"frame": n[:200], "bytes": b} for n, b in top]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build-gpu"))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    result = {"torch": torch_steps()}
    if result["torch"] is None:
        return 0
    for s in result["torch"]["steps"]:
        print(f"{s['bytes'] / MiB:10.2f} MiB  {s['what']}")
    print(f"{result['torch']['held_after_all'] / MiB:10.2f} MiB  held after all four, beyond a and a.grad")
    try:
        result["memtrain"] = snapshot_by_frame(a.build, a.out)
    except Exception as e:  # the torch part stands on its own
        result["memtrain"] = None
        print(f"memtrain snapshot failed: {type(e).__name__}: {e}")
    if result["memtrain"]:
        for l in result["memtrain"]["estimate_lines"]:
            print(l)
        for r in result["memtrain"]["live_at_end_by_frame"]:
            print(f"{r['bytes'] / MiB:10.2f} MiB  {r['frame']}")
    with open(os.path.join(a.out, "diagnose.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
