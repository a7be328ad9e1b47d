#!/usr/bin/env python3
"""The PyTorch side of TokenFiles.ABpeGptLearnsAndItsCurveMatchesPyTorchsOnTheSameFiles: the reference GPT
(gpt_ref.py) with memtrain's GPT-2 initialisation, trained on an llm.c token file with the settings of the
test's memtrain run (2 layers x 64 wide, 2 heads, context 64, 16 windows per step, AdamW lr 3e-3 ->
3e-4 on memtrain's warm-up + cosine schedule, betas (0.9, 0.95), weight decay 0.1 on matrices, gradient
clipping at 1). Its own seed and batches: the curves are compared within run-to-run noise, not exactly.
Writes one training loss per line.

  bpe_curve.py --tokens train.bin --steps 150 --out curve.txt
"""
import argparse, math, os, sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_ref import GPT  # noqa: E402

CFG = dict(n_layer=2, n_head=2, n_embd=64, block_size=64)
BATCH, LR, MIN_LR, WARMUP = 16, 3e-3, 3e-4, 10


def lr_at(step, total):  # memtrain's CosineSchedule (optim/src/optimizer.cpp)
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, total - WARMUP)
    return MIN_LR + 0.5 * (LR - MIN_LR) * (1 + math.cos(math.pi * progress))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    raw = np.fromfile(a.tokens, dtype="<i4", count=256)
    assert raw[0] == 20240520 and raw[1] == 1, "not an llm.c v1 token file"
    vocab = int(raw[3])
    ids = torch.from_numpy(np.memmap(a.tokens, dtype="<u2", mode="r", offset=1024).astype(np.int64))
    torch.manual_seed(a.seed)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = GPT(dict(CFG, vocab_size=vocab))
    with torch.no_grad():  # memtrain's GPT-2 initialisation (models/src/gpt.cpp)
        for name, p in model.named_parameters():
            if "ln_" in name:
                continue
            if name.endswith(".bias"):
                p.zero_()
            elif name.endswith("c_proj.weight"):
                p.normal_(0.0, 0.02 / math.sqrt(2 * CFG["n_layer"]))
            else:
                p.normal_(0.0, 0.02)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)
    T = CFG["block_size"]
    losses = []
    for step in range(a.steps):
        starts = torch.randint(0, len(ids) - T, (BATCH,))
        w = torch.stack([ids[s:s + T + 1] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a.steps)
        opt.zero_grad(set_to_none=True)
        _, loss = model(w[:, :T], w[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    with open(a.out, "w") as f:
        f.write("\n".join(f"{l:.6f}" for l in losses) + "\n")


if __name__ == "__main__":
    main()
