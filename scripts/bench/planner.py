#!/usr/bin/env python3
"""Does the planner choose well? For a few memory budgets, every combination of the planner's knobs is
run on the CPU (micro-batch x accumulation keeping the global batch, recompute policy, head), and the
planner's pick (memory.budget_mib) is set against the fastest combination whose measured peak fit.

  python scripts/bench/planner.py --build build --out docs/benchmarks/planner_cpu.md

Each run: the default GPT config (4 x 128, context 128, global batch 16) for STEPS steps; its step time is the
median ms_per_step of steps 3..STEPS (log.every = 1), its peak the tracker's (summary.json). The target: the
planner's pick within 10% of the fastest fitting combination's step time, and under its budget.

A shared 2-core machine can be noisy (the same setting seen anywhere from 114 to 189 ms in one minute), so
the grid is run PASSES times and each setting keeps its fastest pass (a busy machine only ever adds time);
then, per budget, the pick and the fastest fitting setting are timed again head to head, ROUNDS times
interleaved, and the ratio is taken of their fastest rounds. The spread of the grid's passes is printed.
"""
import argparse, itertools, json, os, statistics, subprocess, sys, tempfile, time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GPT = os.path.join(ROOT, "examples/configs/gpt_austen_cpu.ini")
STEPS = 20
PASSES = 2
ROUNDS = 3
GLOBAL = 16
MICRO = (16, 8, 4, 2)
POLICIES = ("none", "every:2", "all", "attn")
HEADS = ("plain", "fused")
BUDGETS_MIB = (90, 60, 45, 32, 24)
COMMON = [f"--train.steps={STEPS}", "--train.eval_every=0", "--train.eval_batches=1", "--log.every=1",
          "--log.progress=lines", "--checkpoint.save_final=false", "--log.overwrite=true"]


def run(build, extra, tmp):
    cmd = [os.path.join(build, "memtrain"), "--config", GPT, *COMMON, f"--log.dir={tmp}", "--log.name=p", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return None, out.stdout + out.stderr
    folder = os.path.join(tmp, "p")
    steps = [json.loads(l) for l in open(os.path.join(folder, "metrics.jsonl")) if '"ms_per_step"' in l]
    ms = statistics.median(s["ms_per_step"] for s in steps if s["step"] >= 3)
    summary = json.load(open(os.path.join(folder, "summary.json")))
    cfg = open(os.path.join(folder, "config.ini")).read()
    return dict(ms=ms, peak=summary["peak_allocated_bytes"]["rank0/cpu"], config=cfg), out.stdout


def setting(k):
    micro, policy, head = k
    return [f"--train.micro_batch={micro}", f"--train.accum_steps={GLOBAL // micro}", f"--memory.recompute={policy}",
            f"--memory.head={head}"]


def key_of(cfg):
    values, section = {}, ""
    for line in cfg.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]")
        elif "=" in line and not line.startswith("#"):
            k, v = (x.strip() for x in line.split("=", 1))
            values[f"{section}.{k}"] = v
    return (int(values["train.micro_batch"]), values["memory.recompute"], values["memory.head"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs/benchmarks/planner_cpu.md"))
    args = ap.parse_args()
    start = time.time()
    grid = {}
    with tempfile.TemporaryDirectory() as tmp:
        spread = []
        for p in range(PASSES):
            for k in itertools.product(MICRO, POLICIES, HEADS):
                r, _ = run(args.build, setting(k), tmp)
                if k in grid:
                    spread.append(max(r["ms"], grid[k]["ms"]) / min(r["ms"], grid[k]["ms"]))
                    if r["ms"] >= grid[k]["ms"]:
                        r = grid[k]
                grid[k] = r
                print(f"pass {p + 1}: {k[0]:3} x {GLOBAL // k[0]:2} {k[1]:8} {k[2]:6} {r['ms']:7.1f} ms  "
                      f"peak {r['peak'] / 2**20:6.1f} MiB", flush=True)
        noise = statistics.median(spread) if spread else float("nan")
        rows = []
        for budget in BUDGETS_MIB:
            b = budget * 2**20
            r, out = run(args.build, [f"--train.micro_batch={GLOBAL}", "--train.accum_steps=1", f"--memory.budget_mib={budget}"], tmp)
            fits = {k: v for k, v in grid.items() if v["peak"] <= b}
            best = min(fits.items(), key=lambda kv: kv[1]["ms"]) if fits else None
            if r is None:
                rows.append(dict(budget=budget, pick="error: " + out.strip().splitlines()[-1][:200], best=best))
                print(rows[-1]["pick"])
                continue
            pick = key_of(r["config"])
            # The pick's time from the grid (the same setting, measured there the same way) and from its own run.
            grid_ms = grid[pick]["ms"] if pick in grid else r["ms"]
            # Head to head: the pick and the fastest fitting setting, interleaved, each its fastest round.
            duel = {pick: [], best[0]: []} if best else {}
            for _ in range(ROUNDS if best and best[0] != pick else 0):
                for k in duel:
                    duel[k].append(run(args.build, setting(k), tmp)[0]["ms"])
            ratio = min(duel[pick]) / min(duel[best[0]]) if best and best[0] != pick else 1.0
            rows.append(dict(budget=budget, pick=pick, pick_ms=r["ms"], pick_grid_ms=grid_ms, pick_peak=r["peak"], best=best,
                             fitting=len(fits), ratio=ratio))
            print(f"budget {budget} MiB: planner {pick} {grid_ms:.1f} ms (own run {r['ms']:.1f}), peak {r['peak'] / 2**20:.1f} MiB; "
                  f"fastest fitting {best[0] if best else None} {best[1]['ms'] if best else float('nan'):.1f} ms; "
                  f"head to head {ratio:.2f}", flush=True)
    name = lambda k: f"{k[0]} x {GLOBAL // k[0]}, {k[1]}, {k[2]}"
    lines = ["# The planner's pick against the fastest setting that fits, CPU", "",
             f"Generated by `scripts/bench/planner.py` in one run ({time.time() - start:.0f} s). The default GPT (4 layers x 128, "
             f"context 128, byte-level Austen text), global batch {GLOBAL}, {STEPS} steps per run, 2 threads. Every combination of "
             f"micro-batch {MICRO} (accumulation keeping the global batch), recompute {POLICIES} and head {HEADS} was run "
             f"({len(grid)} settings, {PASSES} passes: each keeps its fastest; the median spread between passes was "
             f"{100 * (noise - 1):.0f}%); for each budget the fastest whose measured peak fit is set against the planner's pick "
             "(`--memory.budget_mib=B`, started from micro-batch 16, which keeps `memory.budget_headroom` = 5% of the "
             "budget free for the estimate's error). Step times are medians of steps 3 onward; the pick's grid time is "
             "the grid's run of the same setting (its own run's time, which includes nothing else, beside it). *Head to "
             f"head* times the pick and the fastest fitting setting again, {ROUNDS} rounds interleaved, fastest round "
             "each: the ratio the target is read from.", "",
             "| budget | planner's pick | its peak | step (grid) | step (own run) | fastest that fits | its step | pick / fastest (grid) | head to head | settings that fit |",
             "|---:|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        best = r["best"]
        if isinstance(r["pick"], str):
            lines.append(f"| {r['budget']} MiB | {r['pick']} | | | | {name(best[0]) if best else 'none'} | "
                         f"{best[1]['ms'] if best else 0:.1f} ms | | | 0 |")
            continue
        ratio = r["pick_grid_ms"] / best[1]["ms"] if best else float("nan")
        lines.append(f"| {r['budget']} MiB | {name(r['pick'])} | {r['pick_peak'] / 2**20:.1f} MiB | {r['pick_grid_ms']:.1f} ms | "
                     f"{r['pick_ms']:.1f} ms | {name(best[0]) if best else 'none'} | {best[1]['ms'] if best else 0:.1f} ms | "
                     f"{ratio:.2f} | {r['ratio']:.2f} | {r['fitting']} |")
    lines += ["", "## Every combination", "", "| micro-batch x accumulation | recompute | head | ms/step | peak |",
              "|---|---|---|---:|---:|"]
    for (micro, policy, head), v in sorted(grid.items(), key=lambda kv: kv[1]["ms"]):
        lines.append(f"| {micro} x {GLOBAL // micro} | {policy} | {head} | {v['ms']:.1f} | {v['peak'] / 2**20:.1f} MiB |")
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
