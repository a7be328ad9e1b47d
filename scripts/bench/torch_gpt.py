#!/usr/bin/env python3
"""The Python side of memtrain's benchmarks: the same GPT (scripts/reference/gpt_ref.py), trained eagerly
with PyTorch's own tools: torch.utils.checkpoint, torch.autocast, torch.optim.AdamW(fused=True) (or torchao's AdamW8bit / AdamW4bit).

  torch_gpt.py --device cuda --n_layer 12 --n_head 12 --n_embd 768 --block_size 1024 --vocab 50257 \
               --micro_batch 8 --steps 20 [--checkpoint] [--precision bf16]
Prints one JSON line: median ms/step over the steps after the warm-up, and (CUDA) the peak allocated
bytes and the activation peak (peak minus what was allocated when the step began), as memtrain measures.
"""
import argparse, json, os, statistics, sys, time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
from gpt_ref import GPT  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    for k, v in dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab=50257, micro_batch=8, steps=20,
                     warmup=3, threads=0).items():
        ap.add_argument("--" + k, type=int, default=v)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--checkpoint", action="store_true")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "adamw8bit", "adamw4bit"])
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    torch.manual_seed(0)
    cfg = dict(vocab_size=a.vocab, block_size=a.block_size, n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd)
    model = GPT(cfg).to(dev)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if a.optimizer == "adamw":
        opt = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), fused=True)
    else:  # torchao's blockwise-quantized moments (compiled unless TORCHDYNAMO_DISABLE=1)
        from torchao.optim import AdamW4bit, AdamW8bit
        opt = (AdamW8bit if a.optimizer == "adamw8bit" else AdamW4bit)(groups, lr=1e-4, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(1)
    times, act_peaks, peaks = [], [], []
    for step in range(a.steps):
        x = torch.randint(0, a.vocab, (a.micro_batch, a.block_size + 1), generator=g)
        x, y = x[:, :-1].to(dev), x[:, 1:].to(dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            _, loss = model(x, y, checkpoint=a.checkpoint)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000)
        if dev.type == "cuda":
            peaks.append(torch.cuda.max_memory_allocated())
            act_peaks.append(torch.cuda.max_memory_allocated() - start)
    out = {"ms_per_step": statistics.median(times[a.warmup:]), "final_loss": loss.item()}
    if peaks:
        out["peak_allocated"] = max(peaks[1:])
        out["activation_peak"] = max(act_peaks[1:])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
