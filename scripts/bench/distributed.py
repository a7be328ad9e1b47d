#!/usr/bin/env python3
"""memtrain's distributed benchmark on the CPU: ZeRO stages 0-3 and optimizer offload on 2 and 4 Gloo ranks
(memtrain-run), side by side with PyTorch's DistributedDataParallel + AdamW, DDP + ZeroRedundancyOptimizer and
FSDP2's fully_shard (scripts/bench/torch_ddp.py) on the same GPT, global batch and thread count; then a model
whose parameters and optimizer state do not fit a per-rank memory limit (memory.limit_mib) in stages 0-2,
trained in stage 3.

  flock /tmp/memtrain-build.lock python distributed.py --build build --out docs/benchmarks/distributed_cpu.md

Per run: the median step time over the steps after the warm-up (rank 0), per-rank peak memory (memtrain's
tracker: bytes of live CPU tensors; both sides: the process's peak RSS), per-rank optimizer state, per-rank
gradient bytes and the bytes put into the step's collectives. Ratios: memtrain / PyTorch step time (stage 0
against DDP + AdamW, stages 1 and 2 against DDP + ZeroRedundancyOptimizer, PyTorch's nearest), and each
rank's optimizer state against 1/N of one process's (AdamW: exp_avg + exp_avg_sq, 8 bytes per parameter).

Also its own helper: `distributed.py --rss-wrap DIR -- CMD...` runs CMD (one memtrain rank, started by
memtrain-run) and writes the child's peak RSS to DIR/rss.rank<RANK>. It imports no torch, so it is cheap.
"""
import argparse, json, os, resource, shutil, signal, statistics, subprocess, sys, tempfile, time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# Big enough that the optimizer's state is a visible part of memory (3.26 M parameters: 26 MB of AdamW
# state in one process), small enough for 20 steps of 10 runs on 2 cores in a few minutes.
# Small buckets, so that ZeRO-2 frees gradients during backward (with the 25 MiB default the whole gradient of
# this 13 MB model is one bucket, alive for the whole backward); the same for every stage.
BUCKET_MIB = 2
SHAPE = dict(n_layer=4, n_head=4, n_embd=256, block_size=128, vocab=256, global_batch=16, steps=20, warmup=3)
WORLDS = (2, 4)
# memtrain's rows: label, extra arguments; PyTorch's nearest for the time ratio.
MEMTRAIN = [("memtrain stage 0", ["--dist.zero_stage=0"], "PyTorch DDP + AdamW"),
            ("memtrain stage 1", ["--dist.zero_stage=1"], "PyTorch DDP + ZeroRedundancyOptimizer"),
            ("memtrain stage 2", ["--dist.zero_stage=2"], "PyTorch DDP + ZeroRedundancyOptimizer"),
            ("memtrain stage 3", ["--dist.zero_stage=3"], "PyTorch FSDP2 fully_shard"),
            ("memtrain stage 3, prefetch 0", ["--dist.zero_stage=3", "--dist.prefetch=0"], "PyTorch FSDP2 fully_shard"),
            ("memtrain stage 2 + offload", ["--dist.zero_stage=2", "--dist.offload_optimizer=cpu"],
             "PyTorch DDP + ZeroRedundancyOptimizer"),
            ("memtrain stage 3 + offload", ["--dist.zero_stage=3", "--dist.offload_optimizer=cpu"], "PyTorch FSDP2 fully_shard")]
TORCH = [("PyTorch DDP + AdamW", []), ("PyTorch DDP + ZeroRedundancyOptimizer", ["--zero"]),
         ("PyTorch FSDP2 fully_shard", ["--fsdp"])]
# The memory-limit runs: 25.3 M parameters (101 MB fp32; AdamW state 202 MB in one process) on 4 ranks with a
# limit each rank's stage 2 cannot meet (its full parameters, 101 MB, besides its parts of the state and gradients:
# a 202 MiB peak) and stage 3 can (its part of the parameters and the units gathered: a 146 MiB peak).
BIG = dict(n_layer=8, n_head=8, n_embd=512, block_size=64, vocab=256, global_batch=8, steps=6, warmup=2)
BIG_WORLD = 4
BIG_LIMIT_MIB = 180


def rss_wrap(out_dir, cmd):
    child = subprocess.Popen(cmd)
    for sig in (signal.SIGTERM, signal.SIGINT):  # memtrain-run stops ranks with these: pass them on
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    code = child.wait()
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: KiB
    with open(os.path.join(out_dir, f"rss.rank{os.environ.get('RANK', '0')}"), "w") as f:
        f.write(str(peak))
    return code


def run_memtrain(a, world, extra, work, name, s=SHAPE, limit_mib=0):
    """One run; None and the error line when it stops (out of memory under limit_mib)."""
    run_dir = os.path.join(work, name)
    os.makedirs(run_dir, exist_ok=True)
    args = [os.path.join(a.build, "memtrain-run"), "--standalone", "--nproc-per-node", str(world), "--",
            sys.executable, os.path.abspath(__file__), "--rss-wrap", run_dir, "--",
            os.path.join(a.build, "memtrain"), "--config", os.path.join(ROOT, "examples/configs/gpt_austen_cpu.ini"),
            f"--model.n_layer={s['n_layer']}", f"--model.n_head={s['n_head']}", f"--model.n_embd={s['n_embd']}",
            f"--model.block_size={s['block_size']}", f"--train.micro_batch={s['global_batch'] // world}",
            f"--train.steps={s['steps']}", "--train.threads=1", "--train.eval_every=0", "--train.eval_batches=1",
            "--log.every=1", "--log.progress=lines", "--checkpoint.save_final=false", f"--dist.bucket_mib={BUCKET_MIB}",
            f"--memory.limit_mib={limit_mib}", f"--log.dir={work}", f"--log.name={name}", "--log.overwrite=true"] + extra
    p = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        if limit_mib == 0:
            raise RuntimeError(p.stdout[-3000:])
        why = next((l.split("memtrain: ", 1)[1] for l in p.stdout.splitlines() if "memtrain: " in l and ("out of memory" in l or "cannot fit" in l)),
                   p.stdout.strip().splitlines()[-1] if p.stdout.strip() else "exit code %d" % p.returncode)
        return None, why
    metrics = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if '"ms_per_step"' in l]
    ranks = []
    for r in range(world):
        mem = [json.loads(l) for l in open(os.path.join(run_dir, f"memory.rank{r}.jsonl"))]
        mem = [m for m in mem if m["device"] == "cpu" and m["step"] >= 1]  # the first step builds the state
        last = mem[-1]
        ranks.append(dict(peak_allocated=max(m["peak_allocated"] for m in mem), optimizer_state=last["optimizer_state"],
                          gathered_peak=max((x.get("gathered_peak_bytes", 0) for x in metrics), default=0),
                          data=last["data"],
                          params=last["params"], grads=last["grads_at_optimizer"],
                          at_peak=max(mem, key=lambda m: m["peak_allocated"]).get("at_peak"),
                          peak_rss=int(open(os.path.join(run_dir, f"rss.rank{r}")).read())))
    times = [m["ms_per_step"] for m in metrics]
    r = dict(ms=statistics.median(times[s["warmup"]:]), times=times, comm_bytes=metrics[-1]["comm_bytes"], ranks=ranks)
    return (r, "") if limit_mib else r


def run_torch(a, world, extra):
    s = SHAPE
    args = [a.python, os.path.join(HERE, "torch_ddp.py"), f"--world={world}"] + \
           [f"--{k}={v}" for k, v in s.items()] + extra
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    r = json.loads(out)
    # FSDP2's collectives are not counted (its all-gathers and reduce-scatters are not wrapped).
    return dict(ms=r["ms_per_step"], times=r["times"], comm_bytes=None if "--fsdp" in extra else r["comm_bytes"],
                n_params=r["n_params"], ranks=r["ranks"])


def mib(b):
    return "—" if b is None else f"{b / 2**20:,.1f} MiB"


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--rss-wrap":
        assert sys.argv[3] == "--", "usage: distributed.py --rss-wrap DIR -- CMD..."
        sys.exit(rss_wrap(sys.argv[2], sys.argv[4:]))
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--python", default=sys.executable, help="the venv's python, with torch")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs/benchmarks/distributed_cpu.md"))
    ap.add_argument("--repeats", type=int, default=2, help="runs per configuration, fastest kept (noise only adds)")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="memtrain-dist-bench-")
    t0 = time.time()
    configs = [(w, label, ("memtrain", extra)) for w in WORLDS for label, extra, _ in MEMTRAIN] + \
              [(w, label, ("torch", extra)) for w in WORLDS for label, extra in TORCH]
    nearest = {label: ref for label, _, ref in MEMTRAIN}
    best = {}
    for rep in range(a.repeats):  # all configurations once, then again: drift hits every row alike
        for index, (world, label, (kind, arg)) in enumerate(configs):
            name = f"run{index}_{rep}"
            r = run_memtrain(a, world, arg, work, name) if kind == "memtrain" else run_torch(a, world, arg)
            print(f"N={world} {label:<40} {r['ms']:8.1f} ms/step  comm {mib(r['comm_bytes'])}", flush=True)
            if (world, label) not in best or r["ms"] < best[(world, label)]["ms"]:
                best[(world, label)] = r
    n_params = next(r["n_params"] for r in best.values() if "n_params" in r)
    full_state = 8 * n_params  # AdamW in one process: exp_avg + exp_avg_sq, fp32

    s = SHAPE
    lines = ["# memtrain data parallel and ZeRO, CPU benchmark", "",
             f"GPT {s['n_layer']} layers x {s['n_embd']} wide, {s['n_head']} heads, context {s['block_size']}, vocab "
             f"{s['vocab']} ({n_params:,} parameters), global batch {s['global_batch']} sequences (16 / N per rank), "
             f"fp32, AdamW, gradient clipping at 1.0, Gloo, one intra-op thread per rank, on a 2-core machine "
             f"(N = 4 puts two ranks on each core). Generated by `scripts/bench/distributed.py` in one run "
             f"({time.time() - t0:.0f} s); each row is the fastest of {a.repeats} runs.", "",
             "| N | run | ms/step | time vs PyTorch | tensor peak / rank | peak RSS / rank | params / rank "
             "| optimizer state / rank | state vs 1/N of one process | grads / rank | gathered peak | comm / step |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for world in WORLDS:
        for _, label, (kind, arg) in [c for c in configs if c[0] == world]:
            r = best[(world, label)]
            ref = best[(world, nearest.get(label, label))]
            ratio = f"{r['ms'] / ref['ms']:.2f}" if kind == "memtrain" else "—"
            state = max(x["optimizer_state"] for x in r["ranks"])
            peak = max(x["peak_allocated"] for x in r["ranks"]) if kind == "memtrain" else \
                max((x.get("tensor_peak") or 0 for x in r["ranks"]), default=0) or None
            gathered = max(x.get("gathered_peak", 0) for x in r["ranks"])
            lines.append(f"| {world} | {label} | {r['ms']:.1f} | {ratio} | {mib(peak)} | "
                         f"{mib(max(x['peak_rss'] for x in r['ranks']))} | {mib(max(x['params'] for x in r['ranks']))} | "
                         f"{mib(state)} | {state / (full_state / world):.2f} | {mib(max(x['grads'] for x in r['ranks']))} | "
                         f"{mib(gathered) if gathered else '—'} | {mib(r['comm_bytes'])} |")
    # What the table says about stage 2, from this run's numbers.
    for world in WORLDS:
        p1, p2 = (max(x["peak_allocated"] for x in best[(world, f"memtrain stage {st}")]["ranks"]) for st in (1, 2))
        g1, g2 = (max(x["grads"] for x in best[(world, f"memtrain stage {st}")]["ranks"]) for st in (1, 2))
        lines += ["", f"N = {world}: stage 2 holds {mib(g2)} of gradients when the update begins (none between steps) "
                  f"against stage 1's {mib(g1)} (all along); "
                  f"its step peak is {mib(p1 - p2)} below stage 1's ({mib(p2)} vs {mib(p1)}): a bucket's full-size "
                  f"gradient exists only from its first parameter's gradient to its reduce-scatter "
                  f"(dist.bucket_mib = {BUCKET_MIB}, so a few buckets are alive at a time, not the whole gradient)."]
    for world in WORLDS:
        two, three, z0 = (best[(world, f"memtrain stage {st}")] for st in (2, 3, 0))
        fsdp = best[(world, "PyTorch FSDP2 fully_shard")]
        p2, p3 = (max(x["peak_allocated"] for x in r["ranks"]) for r in (two, three))
        lines += ["", f"N = {world}: stage 3 keeps {mib(max(x['params'] for x in three['ranks']))} of parameters per rank "
                  f"between steps against stage 2's {mib(max(x['params'] for x in two['ranks']))}; at most "
                  f"{mib(max(x['gathered_peak'] for x in three['ranks']))} are gathered at once (the root unit and "
                  f"1 + dist.prefetch blocks), and its step peak is {mib(p3)} against stage 2's {mib(p2)}; without the "
                  f"{mib(max(x['data'] for x in three['ranks']))} of the text dataset memtrain's tally includes, "
                  f"{mib(p3 - max(x['data'] for x in three['ranks']))} against FSDP2's "
                  f"{mib(max(x['tensor_peak'] for x in fsdp['ranks']))} "
                  f"({(p3 - max(x['data'] for x in three['ranks'])) / max(x['tensor_peak'] for x in fsdp['ranks']):.3f}x). "
                  f"At that peak rank 0 held {mib(three['ranks'][0]['at_peak']['gathered'])} of gathered parameters, "
                  f"{mib(three['ranks'][0]['at_peak']['gradients'])} of gradients and "
                  f"{mib(three['ranks'][0]['at_peak']['activations'])} of activations (memory.rank0.jsonl `at_peak`). "
                  f"Its step time is {three['ms'] / fsdp['ms']:.2f}x FSDP2's and {three['ms'] / z0['ms']:.2f}x stage 0's."]

    # A model that does not fit the limit in stages 0-2.
    b = BIG
    big_params = b["n_layer"] * (12 * b["n_embd"] ** 2 + 13 * b["n_embd"]) + (b["vocab"] + b["block_size"] + 2) * b["n_embd"]
    lines += ["", f"## A model over the memory limit: {BIG_WORLD} ranks, memory.limit_mib = {BIG_LIMIT_MIB} per rank", "",
              f"GPT {b['n_layer']} layers x {b['n_embd']} wide, context {b['block_size']} ({big_params:,} parameters: "
              f"{mib(4 * big_params)} fp32, AdamW state {mib(8 * big_params)} in one process), global batch "
              f"{b['global_batch']} ({b['global_batch'] // BIG_WORLD} per rank), {b['steps']} steps. The limit is "
              "enforced by memtrain's counting CPU allocator: memtrain's own estimate stops a run that cannot fit before "
              "the model is built, naming each term and the limit, at every stage alike (with memory.estimate = false "
              "the allocation past the limit is the error, which reads '[memory] out of memory ...' at every stage too).", "",
              "| run | result | ms/step | tensor peak / rank | params / rank | optimizer state / rank | grads / rank |",
              "|---|---|---:|---:|---:|---:|---:|"]
    big_rows = []
    for label, extra, _ in MEMTRAIN:
        if "prefetch" in label:
            continue
        r, why = run_memtrain(a, BIG_WORLD, extra, work, f"big_{len(big_rows)}", s=BIG, limit_mib=BIG_LIMIT_MIB)
        big_rows.append(dict(run=label, ok=r is not None, why=why, result=r))
        print(f"limit {BIG_LIMIT_MIB} MiB: {label:<32} {'trains' if r else 'stops: ' + why}", flush=True)
        if r is None:
            lines.append(f"| {label} | stops: {why.split('; stopping:')[0].split('. Shard the states')[0].replace('|', '/')} | — | — | — | — | — |")
        else:
            m = lambda k: mib(max(x[k] for x in r["ranks"]))
            lines.append(f"| {label} | trains | {r['ms']:.1f} | {m('peak_allocated')} | {m('params')} | "
                         f"{m('optimizer_state')} | {m('grads')} |")
    lines += ["", "On this CPU machine the host is the device: offload moves nothing to another memory, it only adds the "
              "copy of the part the optimizer steps, so its rows show its cost, not its benefit (on a GPU the stepped part, "
              "its gradient and the AdamW state leave the device)."]

    lines += ["", "## How measured", "",
              "- **ms/step**: rank 0's median over steps "
              f"{s['warmup'] + 1}-{s['steps']}. memtrain: `ms_per_step` of metrics.jsonl (log.every = 1: the loss is "
              "averaged over the ranks and read every step); PyTorch: the same step timed in torch_ddp.py (zero_grad, "
              "forward, backward, clip, step, loss all-reduced and read). memtrain reads the Austen text, PyTorch "
              "random tokens: the same shapes, the same work. PyTorch's AdamW is `fused=True`, the same ATen kernel "
              "memtrain steps with (PyTorch's default on CPU is the per-parameter loop). *time vs PyTorch*: stage 0 "
              "against DDP + AdamW, stages 1 and 2 against DDP + ZeroRedundancyOptimizer (PyTorch has no stage 2 "
              "outside FSDP).",
              "- **tensor peak / rank**: memtrain's tracker (memory.rank<r>.jsonl `peak_allocated`): the most bytes "
              "of live CPU tensors during a step, max over ranks and steps 2 onward; it includes the text dataset "
              "(about 4 MiB, the `data` field). PyTorch has no CPU allocator statistics: for FSDP2 only, one extra "
              "step runs under `torch.profiler(profile_memory=True)`, and its peak is the local parameter shards and "
              "optimizer state plus the most its memory events' *Total Allocated* reached in that step.",
              "- **peak RSS / rank**: `ru_maxrss` of each rank's process (memtrain: through a wrapper that waits for "
              "the rank; PyTorch: the spawned rank itself), max over ranks. It includes code and libraries: PyTorch's "
              "ranks hold about " + f"{mib(statistics.mean(x['rss_before_model'] for k, r in best.items() if 'PyTorch' in k[1] for x in r['ranks']))}"
              " after `import torch` and the process group, before the model exists (raw numbers below).",
              "- **optimizer state / rank**: memtrain: `optimizer_state` of memory.rank<r>.jsonl (AdamW moments of "
              "this rank's part); PyTorch: bytes of every tensor in the (local) optimizer's state (exp_avg, "
              "exp_avg_sq, step). Max over ranks. *vs 1/N*: that over (8 bytes x parameters) / N. "
              "ZeroRedundancyOptimizer gives whole parameters to ranks, so its parts are unequal; memtrain cuts flat "
              "buckets into equal parts.",
              "- **grads / rank**: memtrain: `grads_at_optimizer` (the gradient bytes held when the update begins: "
              "stages 0-1 the full-size buckets, plus stage 1's reduced part; stages 2-3 the reduced part only, which "
              "the update then frees); PyTorch: the `.grad` tensors after the step (DDP also keeps a flat bucket copy "
              "of them, not counted).",
              "- **comm / step**: the buffer size of every collective in the last step on rank 0 (an all-reduce "
              "counts its buffer; a reduce-scatter its input; an all-gather its output; a broadcast its tensor): "
              "memtrain's `comm_bytes`; PyTorch: DDP's all-reduce comm hook (the default hook, wrapped to count) and "
              "ZeroRedundancyOptimizer's `dist.broadcast` calls (wrapped to count). The loss average is not counted.",
              "", "## Raw numbers", "", "```"]
    for row in big_rows:
        lines.append(json.dumps(dict(limit_mib=BIG_LIMIT_MIB, world=BIG_WORLD, run=row["run"], trains=row["ok"], why=row["why"],
                                     ms_per_step=round(row["result"]["ms"], 2) if row["ok"] else None,
                                     ranks=row["result"]["ranks"] if row["ok"] else None)))
    for (world, label), r in best.items():
        raw = dict(world=world, run=label, ms_per_step=round(r["ms"], 2), comm_bytes=r["comm_bytes"], ranks=r["ranks"])
        if "times" in r:
            raw["ms_per_step_all"] = [round(t, 1) for t in r["times"]]
        lines.append(json.dumps(raw))
    lines.append("```")
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(text)
    shutil.rmtree(work)  # the runs' folders: everything kept is in the table and the raw numbers
    print(text)


if __name__ == "__main__":
    main()
