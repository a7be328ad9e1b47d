#!/usr/bin/env python3
"""The PyTorch side of memtrain's distributed benchmark (scripts/bench/distributed.py): the same GPT
(scripts/reference/gpt_ref.py) on N Gloo processes (torch.multiprocessing, spawn), one intra-op thread each,
under DistributedDataParallel with torch.optim.AdamW(fused=True), or with ZeroRedundancyOptimizer over the
same AdamW (--zero), or under FSDP2 (--fsdp: torch.distributed.fsdp.fully_shard on each block, then on the
whole model, parameters resharded after forward; ZeRO stage 3). The step is memtrain's: zero_grad, forward, backward (DDP all-reduces the gradients),
clip_grad_norm_(1.0), optimizer step (ZeRO: each rank steps its parameters, then broadcasts them), and the
loss averaged over the ranks and read on the host (memtrain does that on every logged step; log.every = 1).

  torch_ddp.py --world 2 [--zero] --n_layer 4 --n_head 4 --n_embd 256 --block_size 128 --vocab 256 \
               --global_batch 16 --steps 20 --warmup 3
Prints one JSON line:
  ms_per_step      rank 0's median step time over the steps after the warm-up (times: every step's)
  comm_bytes       per step, rank 0: the buffer size of every collective of the step (DDP's gradient buckets,
                   ZeRO's parameter broadcasts), as memtrain counts its own (the loss average is not counted)
  n_params         parameters of the model
  ranks            per rank: optimizer_state (bytes of the tensors in the optimizer's state on that rank: exp_avg,
                   exp_avg_sq, step), params, grads (.grad tensors; DDP's flat bucket copy of them is extra and
                   not counted), peak_rss (ru_maxrss: the whole process, Python and the torch import included),
                   rss_before_model (RSS after the process group is up, before the model exists); with --fsdp
                   also tensor_peak: bytes of live CPU tensors at the peak of one more step run under
                   torch.profiler(profile_memory=True): the local shards of the parameters and the optimizer
                   state, plus the most the profiler's "Total Allocated" reached in that step (what the step
                   allocated and had not freed: gathered parameters, activations, gradients)
"""
import argparse, json, os, resource, statistics, sys, tempfile, time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
from gpt_ref import GPT  # noqa: E402
from ddp_ref import free_port  # noqa: E402


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def tensor_bytes(tensors):
    """Bytes held on this rank (a DTensor's local shard only)."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in local)


def worker(rank, a, port, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=a.world)
    rss_before_model = rss_bytes()
    torch.manual_seed(0)
    cfg = dict(vocab_size=a.vocab, block_size=a.block_size, n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd)
    model = GPT(cfg)
    comm = [0]
    if a.fsdp:
        for block in model.h:
            fully_shard(block)
        ddp = fully_shard(model)
    else:
        ddp = DDP(model)  # PyTorch's defaults: 25 MiB buckets, gradients copied into the buckets

        def counting_allreduce(state, bucket):  # DDP's own all-reduce hook, counting the bucket's bytes
            comm[0] += bucket.buffer().numel() * bucket.buffer().element_size()
            return default_hooks.allreduce_hook(None, bucket)

        ddp.register_comm_hook(None, counting_allreduce)
    broadcast = dist.broadcast

    def counting_broadcast(tensor, *args, **kwargs):  # ZeroRedundancyOptimizer syncs parameters with these
        comm[0] += tensor.numel() * tensor.element_size()
        return broadcast(tensor, *args, **kwargs)

    dist.broadcast = counting_broadcast
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    adamw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    if a.zero:
        opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **adamw)
        local = opt.optim  # this rank's AdamW over its share of the parameters
    else:
        opt = local = torch.optim.AdamW(groups, **adamw)
    micro = a.global_batch // a.world
    g = torch.Generator().manual_seed(1000 + rank)
    times, comms = [], []
    for step in range(a.steps):
        x = torch.randint(0, a.vocab, (micro, a.block_size + 1), generator=g)
        x, y = x[:, :-1], x[:, 1:]
        comm[0] = 0
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        _, loss = ddp(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        comms.append(comm[0])
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean.item()
        times.append((time.perf_counter() - t0) * 1000)
    state = [t for s in local.state.values() for t in s.values()]
    tensor_peak = None
    if a.fsdp:  # PyTorch keeps no CPU allocator statistics; the profiler's memory events stand in for them
        from torch.profiler import ProfilerActivity, profile
        x = torch.randint(0, a.vocab, (micro, a.block_size + 1), generator=g)
        resident = tensor_bytes(model.parameters()) + tensor_bytes(state)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            opt.zero_grad(set_to_none=True)
            _, loss = ddp(x[:, :-1], x[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        with tempfile.TemporaryDirectory() as d:
            prof.export_chrome_trace(os.path.join(d, "trace.json"))
            events = json.load(open(os.path.join(d, "trace.json")))["traceEvents"]
        tensor_peak = resident + max(e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]")
    results.put(dict(rank=rank, times=times, comm_bytes=comms[-1], n_params=sum(p.numel() for p in model.parameters()),
                     optimizer_state=tensor_bytes(state), params=tensor_bytes(model.parameters()),
                     grads=tensor_bytes(p.grad for p in model.parameters()),
                     peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                     rss_before_model=rss_before_model, tensor_peak=tensor_peak))
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    for k, v in dict(world=2, n_layer=4, n_head=4, n_embd=256, block_size=128, vocab=256, global_batch=16, steps=20,
                     warmup=3).items():
        ap.add_argument("--" + k, type=int, default=v)
    ap.add_argument("--zero", action="store_true", help="ZeroRedundancyOptimizer over AdamW")
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 fully_shard per block + root, AdamW on the shards")
    a = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks before they import torch
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(worker, args=(a, free_port(), results), nprocs=a.world, join=True, start_method="spawn")
    ranks = sorted((results.get() for _ in range(a.world)), key=lambda r: r["rank"])
    r0 = ranks[0]
    print(json.dumps({"ms_per_step": statistics.median(r0["times"][a.warmup:]), "comm_bytes": r0["comm_bytes"],
                      "times": r0["times"], "n_params": r0["n_params"],
                      "ranks": [{k: r[k] for k in ("optimizer_state", "params", "grads", "peak_rss", "rss_before_model",
                                                   "tensor_peak")}
                                for r in ranks]}))


if __name__ == "__main__":
    main()
