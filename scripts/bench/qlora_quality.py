#!/usr/bin/env python3
"""QLoRA against LoRA on the same base, the same data and the same steps: the validation loss each reaches.

  qlora_quality.py --build build --out docs/benchmarks/qlora_quality_cpu.md [--seeds 1 2 3]

The base is the Llama of examples/configs/llama_austen_bpe_cpu.ini (4 layers, 128 wide, trained 400 steps on the
Austen BPE tokens), exported to a Hugging Face folder (trained here once if runs/llama_austen_hf is missing). On it,
examples/configs/llama_austen_lora_cpu.ini's adapters (rank 8 on q_proj,v_proj, 100 steps) train in bf16 autocast,
once with the base as it is (fp32 weights) and once with lora.quantize_base = nf4, for each seed (the adapters'
initial values and the batches' order). The issue's bar: QLoRA's validation loss within 2% of LoRA's.
"""
import argparse, json, os, statistics, subprocess, sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(args):
    p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p.stdout


def val_loss(folder):
    rows = [json.loads(l) for l in open(os.path.join(folder, "metrics.jsonl"))]
    return [r["val_loss"] for r in rows if "val_loss" in r][-1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks", "qlora_quality_cpu.md"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--work", default=os.path.join(ROOT, "runs", "qlora_quality"))
    a = ap.parse_args()
    memtrain = os.path.join(a.build, "memtrain")
    base = os.path.join(ROOT, "runs", "llama_austen_hf")
    if not os.path.exists(os.path.join(base, "config.json")):
        run([memtrain, "--config", "examples/configs/llama_austen_bpe_cpu.ini", "--log.progress=lines", "--log.overwrite=true"])
        run([memtrain, "export", "--checkpoint", "runs/llama_austen_bpe_cpu/checkpoints", "--out", base])
    rows = []
    for seed in a.seeds:
        got = {}
        for name, extra in (("lora", []), ("qlora", ["--lora.quantize_base=nf4"])):
            run([memtrain, "--config", "examples/configs/llama_austen_lora_cpu.ini", f"--model.init_from={base}",
                 "--train.precision=bf16", f"--train.seed={seed}", "--log.progress=lines", f"--log.dir={a.work}",
                 f"--log.name={name}_{seed}", "--log.overwrite=true", "--checkpoint.save_final=false"] + extra)
            got[name] = val_loss(os.path.join(a.work, f"{name}_{seed}"))
        rows.append((seed, got["lora"], got["qlora"], got["qlora"] / got["lora"] - 1))
        print(f"seed {seed}: LoRA {got['lora']:.4f}, QLoRA {got['qlora']:.4f} ({100 * rows[-1][3]:+.2f}%)")
    gaps = [r[3] for r in rows]
    lines = ["# QLoRA against LoRA: validation loss after the same steps", "",
             "Written by `scripts/bench/qlora_quality.py`: the Austen Llama (examples/configs/llama_austen_bpe_cpu.ini, "
             "400 steps, exported) fine-tuned by examples/configs/llama_austen_lora_cpu.ini (rank 8 on q_proj,v_proj, "
             "100 steps, bf16 autocast) with its base as trained (fp32) and with `lora.quantize_base = nf4`; "
             "validation loss over 8 batches at step 100.", "",
             "| seed | LoRA val loss | QLoRA val loss | QLoRA - LoRA |", "|---|---|---|---|"]
    for seed, l, q, g in rows:
        lines.append(f"| {seed} | {l:.4f} | {q:.4f} | {100 * g:+.2f}% |")
    lines += ["", f"Mean gap {100 * statistics.mean(gaps):+.2f}%, spread (max - min) {100 * (max(gaps) - min(gaps)):.2f} "
              f"points over {len(gaps)} seeds; the bar is 2%."]
    open(a.out, "w").write("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
