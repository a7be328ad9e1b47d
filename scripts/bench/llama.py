#!/usr/bin/env python3
"""memtrain's Llama against the same model in transformers (and LoRA against transformers + peft), side by
side in one run, on this CPU.

  llama.py --build build --out docs/benchmarks/llama_cpu.md [--rounds 3]

The model is examples/configs/llama_austen_bpe_cpu.ini's shape (4 layers, 128 wide, 4 heads sharing 2
key/value heads, SwiGLU 384, vocabulary 8,192, context 128), micro-batch 16, fp32, AdamW, random tokens.
Each setting runs as its own process, alternating memtrain and transformers for `rounds` rounds; a row
reports the median of the rounds' medians of ms/step after the warm-up, and each process's peak RSS (the
kernel's count, the same measure for both). memtrain's own counted peak of tensor memory is shown beside.
"""
import argparse, json, os, statistics, subprocess, sys, tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SHAPE = dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=128, ffn=384, block_size=128, vocab=8192, micro_batch=16)
STEPS, WARMUP = 15, 3


def peak_rss_of(args):
    """Runs args; returns (stdout, the child's peak RSS in bytes)."""
    with tempfile.TemporaryFile(mode="w+") as out:
        p = subprocess.Popen(args, stdout=out, stderr=subprocess.PIPE, text=True)
        _, status, usage = os.wait4(p.pid, 0)
        err = p.stderr.read()
        if os.waitstatus_to_exitcode(status) != 0:
            sys.exit(f"{args[0]} failed: {err}")
        out.seek(0)
        return out.read(), usage.ru_maxrss * 1024


def memtrain(build, workdir, name, extra, detail=False):
    s = SHAPE
    args = [os.path.join(build, "memtrain"), "--model.name=llama", f"--model.n_layer={s['n_layer']}",
            f"--model.n_head={s['n_head']}", f"--model.n_kv_head={s['n_kv_head']}", f"--model.n_embd={s['n_embd']}",
            f"--model.ffn_hidden={s['ffn']}", f"--model.block_size={s['block_size']}", f"--model.vocab_size={s['vocab']}",
            "--data.dataset=synthetic", f"--train.micro_batch={s['micro_batch']}", f"--train.steps={STEPS}",
            "--train.eval_every=0", "--train.eval_batches=1", "--log.every=1", "--log.progress=lines",
            f"--log.dir={workdir}", f"--log.name={name}", "--log.overwrite=true", "--checkpoint.save_final=false",
            "--train.warmup_steps=2", "--train.weight_decay=0.1"] + extra
    _, rss = peak_rss_of(args)
    rows = [json.loads(l) for l in open(os.path.join(workdir, name, "metrics.jsonl"))]
    ms = [r["ms_per_step"] for r in rows if r["step"] > WARMUP]
    mem = [json.loads(l) for l in open(os.path.join(workdir, name, "memory.rank0.jsonl"))]
    last = mem[-1]
    parts = {"optimizer_state_bytes": last["optimizer_state"], "grad_bytes": last["grads_at_optimizer"]}
    return statistics.median(ms), rss, max(r["peak_cpu"] for r in rows if r["step"] > 1), parts


def transformers_run(python, extra):
    s = SHAPE
    args = [python, os.path.join(HERE, "torch_llama.py"), "--steps", str(STEPS), "--warmup", str(WARMUP)] + \
        [a for k, v in s.items() for a in (f"--{k}", str(v))] + extra
    out, rss = peak_rss_of(args)
    r = json.loads(out.strip().splitlines()[-1])
    return r["ms_per_step"], rss, r


def mib(b):
    return f"{b / 2**20:.1f} MiB"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks", "llama_cpu.md"))
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    python = sys.executable
    settings = [  # (name, memtrain's keys, transformers' flags)
        ("fp32, full logits", ["--memory.head=plain"], []),
        ("fp32, activation checkpointing (every block)", ["--memory.head=plain", "--memory.recompute=all"], ["--checkpoint"]),
        ("LoRA rank 8 on q_proj,v_proj (peft), base frozen", ["--memory.head=plain", "--lora.rank=8", "--lora.alpha=16",
                                                             "--lora.targets=q_proj,v_proj"],
         ["--lora_rank", "8", "--lora_targets", "q_proj,v_proj"]),
    ]
    rows, states = [], []
    with tempfile.TemporaryDirectory() as work:
        for name, ours, theirs in settings:
            m_ms, m_rss, t_ms, t_rss, counted = [], [], [], [], 0
            for r in range(a.rounds):
                ms, rss, counted, m_parts = memtrain(a.build, work, "llama", ours)
                m_ms.append(ms), m_rss.append(rss)
                ms, rss, t_parts = transformers_run(python, theirs)
                t_ms.append(ms), t_rss.append(rss)
            mm, tm = statistics.median(m_ms), statistics.median(t_ms)
            rows.append((name, mm, tm, mm / tm, max(m_rss), max(t_rss), counted))
            states.append((name, m_parts, t_parts))
            print(f"{name}: memtrain {mm:.1f} ms/step, transformers {tm:.1f} ms/step, ratio {mm / tm:.2f}; "
                  f"peak RSS {mib(max(m_rss))} vs {mib(max(t_rss))}; memtrain's counted tensor peak {mib(counted)}")
    import torch, transformers
    lines = [
        "# Llama: memtrain against transformers on the CPU",
        "",
        f"Written by `scripts/bench/llama.py` (torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{os.cpu_count()} CPUs). The same Llama (4 layers, 128 wide, 4 heads sharing 2 key/value heads, SwiGLU 384, "
        "vocabulary 8,192, context 128; 2.9M parameters), micro-batch 16, fp32, AdamW (fused in both), gradient "
        "clipping, random tokens. transformers: `LlamaForCausalLM` with SDPA attention, loss on its full logits; "
        "its checkpointing is `gradient_checkpointing_enable()` (non-reentrant). Each setting ran "
        f"{a.rounds} rounds, alternating the two, each a fresh process of {STEPS} steps; ms/step is the median of "
        f"the rounds' medians after {WARMUP} warm-up steps. Peak RSS is the kernel's count for each process "
        "(includes each runtime's own libraries: Python, transformers, LibTorch); memtrain's counted peak is "
        "the tensor memory its allocator saw.",
        "",
        "| setting | memtrain ms/step | transformers ms/step | ratio (memtrain / transformers) | memtrain peak RSS | "
        "transformers peak RSS | memtrain counted tensor peak |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, mm, tm, ratio, mr, tr, counted in rows:
        lines.append(f"| {name} | {mm:.1f} | {tm:.1f} | {ratio:.2f}x | {mib(mr)} | {mib(tr)} | {mib(counted)} |")
    lines += ["", "Optimizer state and gradient bytes when the optimizer steps (memtrain: its tracker; transformers: the "
              "AdamW state's tensors and the `.grad` of what trains):", "",
              "| setting | memtrain optimizer state | transformers optimizer state | memtrain gradients | transformers gradients |",
              "|---|---|---|---|---|"]
    for name, m, t in states:
        lines.append(f"| {name} | {m['optimizer_state_bytes']:,} B | {t['optimizer_state_bytes']:,} B | "
                     f"{m['grad_bytes']:,} B | {t['grad_bytes']:,} B |")
    open(a.out, "w").write("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
