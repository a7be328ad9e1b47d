#!/usr/bin/env python3
"""The PyTorch side of the tensor-parallel benchmark: transformers' LlamaForCausalLM split by PyTorch's own tensor
parallelism (torch.distributed.tensor.parallel on a 1-D DeviceMesh over Gloo): q, k, v, gate and up ColwiseParallel,
o and down RowwiseParallel, the token embedding RowwiseParallel (rows of the vocabulary, its partial sums all-reduced)
and the head ColwiseParallel with its logits left sharded for `loss_parallel()`'s vocabulary-parallel cross-entropy,
as torchtitan splits Llama (without sequence parallelism). AdamW, gradient clipping at 1.0 (clip_grad_norm_'s rule: clip() below), fp32, random tokens, the
same on every rank of the group. Started by torchrun:

  python -m torch.distributed.run --standalone --nproc-per-node 2 torch_tp.py --n_layer 4 ... --steps 15
With one process (no torchrun) the model is not split. Rank 0 prints one JSON line: median ms/step after the
warm-up, its peak RSS, and the parameter bytes it holds (its slices).
"""
import argparse, json, os, resource, statistics, sys, time

import torch
import torch.nn.functional as F

from torch_llama import adamw, build_llama  # the same model and optimizer as the Llama benchmark's

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
from tp_ref import llama_plan  # the oracle's split (importing it hides GPUs: this benchmark runs on the CPU)


def split(model, T):
    """tp_ref.py's plan (the oracle's split), its head's logits left sharded for loss_parallel()."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    head = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, init_device_mesh("cpu", (T,)), llama_plan(len(model.model.layers), head))


def clip(params, max_norm):
    """clip_grad_norm_ over a model whose split parameters are DTensors and the rest (norms) plain tensors: its foreach
    norm refuses the mix, so each kind's norm is taken apart (get_total_norm; the DTensors' is reduced over the mesh)
    and both kinds are scaled by the same coefficient."""
    dt = [p.grad for p in params if p.grad is not None and hasattr(p.grad, "full_tensor")]
    plain = [p.grad for p in params if p.grad is not None and not hasattr(p.grad, "full_tensor")]
    total = 0.0
    for grads in (dt, plain):
        if grads:
            n = torch.nn.utils.get_total_norm(grads)
            n = n.full_tensor() if hasattr(n, "full_tensor") else n
            total += float(n) ** 2
    coef = min(1.0, max_norm / (total ** 0.5 + 1e-6))
    for grads in (dt, plain):
        if grads and coef < 1.0:
            torch._foreach_mul_(grads, coef)


def main():
    ap = argparse.ArgumentParser()
    for k, v in dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=128, ffn=384, block_size=128, vocab=8192, micro_batch=16,
                     steps=20, warmup=3, threads=1).items():
        ap.add_argument("--" + k, type=int, default=v)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    T = int(os.environ.get("WORLD_SIZE", "1"))
    if T > 1:
        torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    model = build_llama(a)
    model.train()
    if T > 1:
        split(model, T)
    params = list(model.parameters())
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    param_bytes = sum(local(p).numel() * p.element_size() for p in params)
    opt = adamw(params, fused=None)  # PyTorch's default implementation: fused is not defaulted
    g = torch.Generator().manual_seed(1)
    times, losses = [], []
    for step in range(a.steps):
        x = torch.randint(0, a.vocab, (a.micro_batch, a.block_size + 1), generator=g)
        x, y = x[:, :-1], x[:, 1:]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=x).logits
        if T > 1:
            from torch.distributed.tensor.parallel import loss_parallel
            with loss_parallel():
                loss = F.cross_entropy(logits.reshape(-1, a.vocab), y.reshape(-1))
                loss.backward()
        else:
            loss = F.cross_entropy(logits.reshape(-1, a.vocab), y.reshape(-1))
            loss.backward()
        clip(params, 1.0)
        opt.step()
        losses.append(float(local(loss).item() if hasattr(loss, "to_local") else loss.item()))
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"ms_per_step": 1000 * statistics.median(times), "param_bytes": param_bytes,
                          "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                          "first_loss": losses[0], "last_loss": losses[-1]}), flush=True)
    if T > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
