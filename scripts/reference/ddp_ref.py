#!/usr/bin/env python3
"""PyTorch's own data parallelism on the fixture GPT, the expected values of memtrain's DDP/ZeRO parity test
(tests/distributed/ddp_parity_rank.cpp).

Run by make_fixtures.py at the end of its main (or by hand):  ddp_ref.py OUT_DIR

Two Gloo processes (torch.multiprocessing, spawn) train make_fixtures.py's GPT, with gpt_parity.safetensors'
weights, for STEPS steps on a fixed global batch of GLOBAL_BATCH sequences per step (rank r takes rows
[r * GLOBAL_BATCH / 2, (r + 1) * GLOBAL_BATCH / 2)), fp32, no clipping, with AdamW as make_fixtures.adamw
(lr 1e-2, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices only), twice:

  (a) DistributedDataParallel + torch.optim.AdamW
  (b) DistributedDataParallel + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW, same groups)
  (c) FSDP2: torch.distributed.fsdp.fully_shard on each block, then on the whole model (the root: embeddings,
      final norm, tied head), parameters resharded after forward, + torch.optim.AdamW on the sharded (DTensor)
      parameters: ZeRO stage 3

and twice more with plain SGD (lr SGD_LR, no momentum, no weight decay), whose update is proportional to the
gradient: a reduction that sums where it should average moves every weight twice as far (AdamW's update does
not change when every gradient is scaled by the same factor, so (a)-(c) cannot see that):

  (d) DistributedDataParallel + torch.optim.SGD, no clipping
  (e) the same with torch.nn.utils.clip_grad_norm_(max_norm=SGD_CLIP), below every step's norm: the clip
      coefficient max_norm / (norm + 1e-6) decides the update

ddp_zero.safetensors holds
  inputs, targets          (STEPS, GLOBAL_BATCH, T) int64: step s's global batch
  <run>_losses             (STEPS,) f64: each step's loss (before its update), the mean over the ranks
  <run>_grad_norms         (STEPS,) f64: each step's global gradient norm before clipping (of the averaged gradient)
  <run>_final.<name>       every parameter after the last step
  for <run> = ddp (a), zero (b), fsdp (c), sgd (d), sgd_clip (e)
"""
import os, socket, sys

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU references (make_fixtures.py says why); before torch

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as fx  # noqa: E402  (the fixture GPT, its weights, the AdamW groups, the writer)

WORLD = 2
STEPS = 4
GLOBAL_BATCH = 8
SGD_LR = 0.5
SGD_CLIP = 0.25
RUNS = ("ddp", "zero", "fsdp", "sgd", "sgd_clip")


def batches():
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, fx.CFG["vocab_size"], (STEPS, GLOBAL_BATCH, fx.CFG["block_size"] + 1), generator=g)
    return idx[..., :-1].contiguous(), idx[..., 1:].contiguous()


def total_norm(model):
    """The global 2-norm of every gradient (DTensor shards under FSDP2 summed over the ranks)."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    return norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item()


def train(rank, zero=False, fsdp=False, sgd=False, clip=0.0):
    """One run on this rank: the loss and gradient norm of every step (loss: mean over ranks) and the final
    parameters."""
    model = fx.make_model()  # the same seeded weights as gpt_parity.safetensors on every rank
    if fsdp:
        for block in model.h:
            fully_shard(block)
        ddp = fully_shard(model)
    else:
        ddp = DDP(model)
    if sgd:
        opt = torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=0.0, weight_decay=0.0)
    elif fsdp:
        opt = fx.adamw(list(model.parameters()))  # DTensor shards; the same groups by dimension
    elif zero:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = ZeroRedundancyOptimizer([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                      optimizer_class=torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    else:
        opt = fx.adamw(list(model.parameters()))
    inputs, targets = batches()
    rows = slice(rank * GLOBAL_BATCH // WORLD, (rank + 1) * GLOBAL_BATCH // WORLD)
    losses, norms = [], []
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        _, loss = ddp(inputs[s, rows], targets[s, rows])
        loss.backward()  # DDP averages the gradients over the ranks
        norms.append(total_norm(model))
        if clip > 0:
            assert norms[-1] > clip, f"step {s}: norm {norms[-1]} under the clip {clip}: clipping would not act"
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()       # ZeRO: each rank steps its share of the parameters, then broadcasts them
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / WORLD)
    if fsdp:  # full_tensor() gathers the shards: every rank calls it
        return losses, norms, {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def worker(rank, port, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    runs = {"ddp": train(rank), "zero": train(rank, zero=True), "fsdp": train(rank, fsdp=True),
            "sgd": train(rank, sgd=True), "sgd_clip": train(rank, sgd=True, clip=SGD_CLIP)}
    assert tuple(runs) == RUNS
    if rank == 0:
        inputs, targets = batches()
        t = {"inputs": inputs, "targets": targets}
        for run, (losses, norms, final) in runs.items():
            t[run + "_losses"] = torch.tensor(losses, dtype=torch.float64)
            t[run + "_grad_norms"] = torch.tensor(norms, dtype=torch.float64)
            t.update({run + "_final." + n: p for n, p in final.items()})
        fx.save(os.path.join(out, "ddp_zero.safetensors"), t,
                dict(world=WORLD, steps=STEPS, global_batch=GLOBAL_BATCH, sgd_lr=SGD_LR, sgd_clip=SGD_CLIP))
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(out):
    os.makedirs(out, exist_ok=True)
    mp.spawn(worker, args=(free_port(), out), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main(sys.argv[1])
