#!/usr/bin/env python3
"""Writes the expected values that memtrain's C++ tests compare against, computed by PyTorch itself.

Run by scripts/reference/write_fixtures.sh (the build, and gpu_deps.sh) with the venv's python:  make_fixtures.py OUT_DIR

  gpt_parity.safetensors   a small GPT's weights, a batch, its logits, loss and every gradient (fp32),
                           then the losses of 5 AdamW steps (llm.c-style golden values) and every
                           parameter after the last one ("adamw_final.<name>")
  gpt_checkpoint.safetensors  the same GPT with dropout 0.1 under torch.utils.checkpoint (non-reentrant):
                           loss and gradients, with the RNG seeded right before the forward
  gpt_bf16.safetensors     the same GPT under torch.autocast("cpu", torch.bfloat16): loss and gradients,
                           single-threaded (as is every fixture here; the C++ test runs it on one thread too)
  gpt_fp16.safetensors     the same GPT trained under torch.autocast("cpu", torch.float16) with
                           torch.amp.GradScaler("cpu") and AdamW, a scale so large that steps overflow: each step's
                           loss, scale and whether it stepped, and every parameter after the last one
  grad_scaler.safetensors  torch.amp.GradScaler's scale after each step for an inf/NaN injection pattern
  ddp_zero.safetensors     2 Gloo ranks under DistributedDataParallel, with torch.optim.AdamW and with
                           ZeroRedundancyOptimizer: batches, losses, final parameters (ddp_ref.py)

The GPT here mirrors memtrain's (models/src/gpt.cpp) operation for operation and name for name.
"""
import json, math, os, struct, sys

# CPU references, on every machine: with a GPU visible, ddp_ref.py's spawned Gloo ranks died with SIGSEGV on the
# H200 machine (2026-12-04; FSDP2's DeviceMesh picks a CUDA device by rank when one exists), which stopped the build
# there. Hidden before torch is imported; the spawned processes inherit it.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch
import torch.nn as nn

from gpt_ref import GPT

CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
BATCH = 4


def save(path, tensors, meta=None):
    """safetensors: u64 header length, JSON header, raw little-endian data."""
    header, blobs, offset = {}, [], 0
    names = {torch.float32: "F32", torch.float64: "F64", torch.int64: "I64"}
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        raw = t.numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if meta:
        header["__metadata__"] = {k: str(v) for k, v in meta.items()}
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    os.replace(path + ".tmp", path)


def make_model(dropout=0.0):
    torch.manual_seed(0)
    m = GPT(CFG, dropout)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "ln_" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)  # non-trivial LayerNorm params
            else:
                p.normal_(0.0, 0.1)
    return m


def batch():
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, CFG["vocab_size"], (BATCH, CFG["block_size"] + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def adamw(params):
    """AdamW with decay on matrices only, as memtrain groups its parameters (optim/src/optimizer.cpp)."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


def grads_of(model):
    return {"grad." + n: p.grad.clone() for n, p in model.named_parameters()}


def gpt_parity(out):
    m = make_model()
    x, y = batch()
    weights = {n: p.detach().clone() for n, p in m.named_parameters()}
    logits, loss = m(x, y)
    loss.backward()
    t = {**weights, "input": x, "target": y, "logits": logits, "loss": loss.reshape(1), **grads_of(m)}
    # 5 AdamW steps on the same batch.
    opt = adamw(list(m.parameters()))
    losses = []
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        _, l = m(x, y)
        l.backward()
        opt.step()
        losses.append(l.item())
    t["adamw_losses"] = torch.tensor(losses, dtype=torch.float64)
    # The parameters after the last step: the losses only show the updates before it.
    t.update({"adamw_final." + n: p.detach().clone() for n, p in m.named_parameters()})
    save(os.path.join(out, "gpt_parity.safetensors"), t, CFG)


def gpt_checkpoint(out):
    m = make_model(dropout=0.1)
    x, y = batch()
    torch.manual_seed(1234)  # the C++ test seeds the same generator right before its forward
    _, loss = m(x, y, checkpoint=True)
    loss.backward()
    save(os.path.join(out, "gpt_checkpoint.safetensors"), {"loss": loss.reshape(1), **grads_of(m)})


def gpt_bf16(out):
    torch.set_num_threads(1)  # main() sets it too; the C++ test compares at 1e-3 on one thread
    m = make_model()
    x, y = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = m(x, y)
    loss.backward()
    save(os.path.join(out, "gpt_bf16.safetensors"), {"loss": loss.reshape(1).float(), **grads_of(m)})


def gpt_master(out):
    """bf16 parameters with fp32 master weights: 3 AdamW steps on the masters, copied back each step."""
    m = make_model()
    x, y = batch()
    names = [n for n, _ in m.named_parameters()]
    masters = [p.detach().clone().float().requires_grad_() for p in m.parameters()]
    m = m.to(torch.bfloat16)
    opt = adamw(masters)
    losses = []
    for _ in range(3):
        m.zero_grad(set_to_none=True)
        _, loss = m(x, y)
        loss.backward()
        for mp, p in zip(masters, m.parameters()):
            mp.grad = p.grad.float()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for mp, p in zip(masters, m.parameters()):
                p.copy_(mp)
        losses.append(loss.item())
    t = {"master." + n: mp for n, mp in zip(names, masters)}
    t["losses"] = torch.tensor(losses, dtype=torch.float64)
    save(os.path.join(out, "gpt_master.safetensors"), t)


def gpt_fp16(out):
    """fp16 autocast on the CPU with dynamic loss scaling: 10 AdamW steps on the fixture batch from a scale of 2^27
    (the first steps' fp16 gradients overflow and are skipped), backoff 0.25, growth after 2 finite steps."""
    m = make_model()
    x, y = batch()
    opt = adamw(list(m.parameters()))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 27, growth_factor=2.0, backoff_factor=0.25, growth_interval=2)
    losses, scales, stepped = [], [], []
    for _ in range(10):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            _, loss = m(x, y)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
        stepped.append(0 if scaler.get_scale() < before else 1)  # a backoff is a skipped step
    t = {"final." + n: p.detach().clone() for n, p in m.named_parameters()}
    t["losses"] = torch.tensor(losses, dtype=torch.float64)
    t["scales"] = torch.tensor(scales, dtype=torch.float64)
    t["stepped"] = torch.tensor(stepped, dtype=torch.int64)
    save(os.path.join(out, "gpt_fp16.safetensors"), t)


def grad_scaler(out):
    """Scale after each update for: finite steps, inf at steps 3 and 4, NaN at step 9, interval 3."""
    p = nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    bad = {3: math.inf, 4: math.inf, 9: math.nan}
    scales, stepped, params = [], [], []
    for step in range(14):
        opt.zero_grad()
        loss = (p * torch.arange(1.0, 5.0)).sum()
        scaler.scale(loss).backward()
        if step in bad:
            p.grad[1] = bad[step]
        before = p.detach().clone()
        scaler.step(opt)
        scaler.update()
        stepped.append(0 if torch.equal(before, p.detach()) else 1)
        scales.append(scaler.get_scale())
        params.append(p.detach().clone())
    save(os.path.join(out, "grad_scaler.safetensors"),
         {"scales": torch.tensor(scales, dtype=torch.float64), "stepped": torch.tensor(stepped, dtype=torch.int64),
          "params": torch.stack(params)}, {"growth_interval": 3})


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)
    gpt_parity(out)
    gpt_checkpoint(out)
    gpt_bf16(out)
    gpt_master(out)
    gpt_fp16(out)
    grad_scaler(out)
    import ddp_ref  # here, not at the top: it imports this module for the GPT, its weights and the writer
    ddp_ref.main(out)
    print(f"fixtures written to {out} (torch {torch.__version__})")


if __name__ == "__main__":
    main()
