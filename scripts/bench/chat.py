#!/usr/bin/env python3
"""Packed against padded chat records on this CPU: the same rows per step (micro-batch x block size), so the step
costs about the same, but a packed row carries several records and a padded row one.

  chat.py --build build --out docs/benchmarks/chat_cpu.md [--steps 30]

The Llama of examples/configs/llama_austen_bpe_cpu.ini (4 layers, 128 wide, vocabulary 8,192) at a context of 512,
random weights, set-up's Austen "continue this passage" records (<data>/chat/austen-continue, up to 129 tokens each),
micro-batch 4 rows of 512, fp32. Each
setting runs as its own process; ms/step is the median after 3 warm-up steps; the record tokens per row come from
packing the training records as memtrain does (whole, in the seed's order, a row closed when the next does not fit),
so record tokens/s = rows/s x record tokens per row, and trained tokens/s likewise.
"""
import argparse, json, os, random, statistics, subprocess, sys, tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
T, MICRO, WARMUP = 512, 4, 3


def data_dir():
    return os.environ.get("MEMTRAIN_DATA", os.path.join(os.path.expanduser("~"), ".cache", "memtrain", "data"))


def per_row(folder, pack):
    """Record tokens and trained targets per row, packing the training split as memtrain does (order aside: the
    counts do not depend on it beyond the greedy fit, so the file's order stands in for the seed's)."""
    from safetensors.torch import load_file
    t = load_file(os.path.join(folder, "train.safetensors"))
    off, trained = t["offsets"].tolist(), t["trained"].tolist()
    rows, used, tokens, targets = 0, 0, 0, 0
    for r in range(len(off) - 1):
        pairs = min(T, off[r + 1] - off[r] - 1)
        if used == 0 or used + pairs > T or not pack:
            rows, used = rows + 1, 0
        used += pairs
        tokens += pairs
        targets += sum(trained[off[r] + 1: off[r] + 1 + pairs])
    return tokens / rows, targets / rows, rows


def run(build, work, name, pack):
    args = [os.path.join(build, "memtrain"), "--model.name=llama", "--model.n_layer=4", "--model.n_head=4",
            "--model.n_kv_head=2", "--model.n_embd=128", f"--model.block_size={T}", "--data.dataset=chat",
            f"--data.pack={'true' if pack else 'false'}", f"--train.micro_batch={MICRO}", f"--train.steps={a.steps}",
            "--train.eval_every=0", "--train.eval_batches=1", "--log.every=1", "--log.progress=lines", f"--log.dir={work}",
            f"--log.name={name}", "--log.overwrite=true", "--checkpoint.save_final=false", "--memory.head=fused"]
    subprocess.run(args, check=True, capture_output=True, text=True)
    rows = [json.loads(l) for l in open(os.path.join(work, name, "metrics.jsonl"))]
    ms = statistics.median(r["ms_per_step"] for r in rows if r.get("step", 0) > WARMUP and "ms_per_step" in r)
    peak = max(r["peak_cpu"] for r in rows if "peak_cpu" in r)
    return ms, peak


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks", "chat_cpu.md"))
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    folder = os.path.join(data_dir(), "chat", "austen-continue")
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for pack in (True, False, True, False):  # alternating
            ms, peak = run(a.build, work, "chat", pack)
            results.setdefault(pack, []).append((ms, peak))
    lines = ["# Chat records: packed against padded on the CPU", "",
             "Written by `scripts/bench/chat.py`: the Austen Llama shape (4 layers, 128 wide) at a context of 512, random "
             "weights, set-up's Austen \"continue this passage\" records (up to 129 tokens), micro-batch 4 rows of 512, "
             "fp32, fused head; "
             "two alternating runs each, median ms/step after 3 warm-up steps.", "",
             "| rows | ms/step | record tokens per row | trained targets per row | record tokens/s | trained tokens/s | counted peak |",
             "|---|---|---|---|---|---|---|"]
    out = {}
    for pack in (True, False):
        ms = statistics.median(m for m, _ in results[pack])
        peak = max(p for _, p in results[pack])
        tok, trn, rows = per_row(folder, pack)
        rps = MICRO * 1000 / ms
        out[pack] = tok * rps
        lines.append(f"| {'packed' if pack else 'padded (one record per row)'} | {ms:.1f} | {tok:.1f} of {T} | {trn:.1f} | "
                     f"{tok * rps:,.0f} | {trn * rps:,.0f} | {peak / 2**20:.1f} MiB |")
        print(lines[-1])
    lines += ["", f"Packed trains {out[True] / out[False]:.2f}x the record tokens per second of padded at the same block "
              "size and memory (the rows are the same size; the mask and positions add B x T^2 bytes and 16 B T)."]
    open(a.out, "w").write("\n".join(lines) + "\n")
    print(f"wrote {a.out}")
