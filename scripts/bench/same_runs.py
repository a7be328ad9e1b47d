#!/usr/bin/env python3
"""Does a change leave training as it was? Two builds (before and after a change that should change nothing a run
produces) run the same jobs, and their outputs are compared: every checkpoint and weights file byte for byte,
metrics.jsonl and the console with the timings taken out, and the step time side by side.

  python scripts/bench/same_runs.py --before /tmp/base/build --after build --out docs/benchmarks/same_runs_cpu.md

The jobs: the default job (examples/configs/gpt_austen_cpu.ini, its 600 steps) and a 2-rank ZeRO-3 job of the same
model (200 steps, a checkpoint every 100) through memtrain-run. Each build runs each job twice, interleaved, for the
step times (the faster run of each kept: a busy machine only adds time).
"""
import argparse, hashlib, json, os, re, shutil, statistics, subprocess, tempfile, time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GPT = os.path.join(ROOT, "examples/configs/gpt_austen_cpu.ini")
JOBS = {
    "default job": (1, ["--log.progress=lines"]),
    "2 ranks, ZeRO-3": (2, ["--log.progress=lines", "--dist.zero_stage=3", "--train.steps=200", "--checkpoint.every=100",
                            "--train.eval_every=100"]),
}
# Fields and console text that carry time or the folder, not what was trained.
TIMED_KEYS = {"ms_per_step", "tokens_per_s", "samples_per_s", "flops_per_s", "mfu", "elapsed_s", "seconds", "time_s", "wall_s"}
TIMED_TEXT = re.compile(r"(ETA|elapsed) \S+|[0-9.]+[kMG]? ?(ms|s|tok/s|tokens/s|samples/s|it/s|%)(?![A-Za-z])|MFU [0-9.]+%|/tmp/\S+")


def run(build, job, folder):
    ranks, extra = JOBS[job]
    memtrain = os.path.join(build, "memtrain")
    cmd = [memtrain, "--config", GPT, f"--log.dir={folder}", "--log.name=run", "--log.overwrite=true", *extra]
    if ranks > 1:
        cmd = [os.path.join(build, "memtrain-run"), "--standalone", "--nproc-per-node", str(ranks), "--", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout}{out.stderr}")
    return out.stdout + out.stderr


def digest_files(folder):
    out = {}
    for d, _, files in os.walk(folder):
        for f in files:
            if f.endswith((".safetensors", ".bin", ".pt")) or "checkpoint" in d:
                p = os.path.join(d, f)
                out[os.path.relpath(p, folder)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def metrics(folder):
    rows = []
    for line in open(os.path.join(folder, "run", "metrics.jsonl")):
        row = {k: v for k, v in json.loads(line).items() if k not in TIMED_KEYS and not k.endswith("_ms")}
        rows.append(row)
    return rows


def step_ms(folder):
    ms = [json.loads(l)["ms_per_step"] for l in open(os.path.join(folder, "run", "metrics.jsonl")) if '"ms_per_step"' in l]
    return statistics.median(ms[1:]) if len(ms) > 1 else ms[0]


def console(text):
    return [TIMED_TEXT.sub("#", l) for l in text.splitlines()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default=os.path.join(ROOT, "build"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs/benchmarks/same_runs_cpu.md"))
    ap.add_argument("--only", default="", help="run this job alone")
    ap.add_argument("--steps", type=int, default=0, help="every job this many steps (a quick check of the script)")
    args = ap.parse_args()
    if args.only:
        for job in list(JOBS):
            if job != args.only:
                del JOBS[job]
    if args.steps:
        for _, extra in JOBS.values():
            extra.append(f"--train.steps={args.steps}")
    start = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for job in JOBS:
            seen = {}
            for p in range(2):
                for name, build in (("before", args.before), ("after", args.after)):
                    # Every run writes to the same folder (its path is in the config saved with each checkpoint), then
                    # moves aside.
                    work, folder = os.path.join(tmp, "work"), os.path.join(tmp, f"{name}-{p}")
                    text = run(build, job, work)
                    shutil.rmtree(folder, ignore_errors=True)
                    os.rename(work, folder)
                    r = dict(files=digest_files(folder), metrics=metrics(folder), console=console(text), ms=step_ms(folder))
                    if name in seen:
                        r["ms"] = min(r["ms"], seen[name]["ms"])
                        r["consoles"] = seen[name]["consoles"] + [r["console"]]
                    else:
                        r["consoles"] = [r["console"]]
                    seen[name] = r
                    print(f"{job}, pass {p + 1}, {name}: {r['ms']:.1f} ms/step, {len(r['files'])} files", flush=True)
            b, a = seen["before"], seen["after"]
            same_files = b["files"] == a["files"] and len(b["files"]) > 0
            same_metrics = b["metrics"] == a["metrics"]
            # A line counts as the same when the after build's matches the before build's in either pass: a stage-3
            # peak moves with the ranks' timing, which the before build's own two runs show (`noise`).
            diff = [(x, y) for i, (x, y) in enumerate(zip(b["console"], a["console"]))
                    if all(c[i] != y for c in b["consoles"] if i < len(c))]
            noise = sum(x != y for x, y in zip(*b["consoles"]))
            same_console = not diff and len(b["console"]) == len(a["console"])
            for f in sorted(set(b["files"]) | set(a["files"])):
                if b["files"].get(f) != a["files"].get(f):
                    print(f"  file differs: {f}")
            for i, (x, y) in enumerate(zip(b["metrics"], a["metrics"])):
                if x != y:
                    print(f"  metrics line {i + 1}: " + ", ".join(f"{k} {x.get(k)} -> {y.get(k)}" for k in sorted(set(x) | set(y))
                                                            if x.get(k) != y.get(k)))
            for x, y in diff[:10]:
                print(f"  console before: {x}\n  console after:  {y}")
            rows.append((job, len(b["files"]), same_files, len(b["metrics"]), same_metrics, len(b["console"]), same_console,
                         noise, b["ms"], a["ms"], diff[:5]))
    yes = lambda v: "**identical**" if v else "**differ**"
    lines = ["# The same runs before and after a change, CPU", "",
             f"Generated by `scripts/bench/same_runs.py --before {args.before} --after {args.after}` in one run "
             f"({time.time() - start:.0f} s), 2 threads. Files: every checkpoint and weights file, by SHA-256. Metrics: "
             "metrics.jsonl without its time fields. Console: every line, with timings and temporary paths masked, the same "
             "when the after build's line is one of the before build's two runs' (a stage-3 peak moves with the ranks' "
             "timing). Step "
             "time: the median ms_per_step of the logged steps, the faster of two interleaved runs per build.", "",
             "| job | files | byte for byte | metrics lines | metrics | console lines | console | lines that differ between the before build's own two runs | ms/step before | after | after / before |",
             "|---|---:|---|---:|---|---:|---|---:|---:|---:|---:|"]
    for job, nf, sf, nm, sm, nc, sc, noise, bms, ams, _ in rows:
        lines.append(f"| {job} | {nf} | {yes(sf)} | {nm} | {yes(sm)} | {nc} | {yes(sc)} | {noise} | {bms:.1f} | {ams:.1f} | {ams / bms:.2f} |")
    for job, *_, diff in rows:
        for x, y in diff:
            lines += ["", f"{job}, console before: `{x}`", f"{job}, console after: `{y}`"]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
