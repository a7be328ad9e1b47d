#!/usr/bin/env python3
"""The GPU check's CLI matrix (scripts/gpu_check.sh runs it after the CUDA tests): memtrain's techniques on a small
GPT with synthetic tokens, each checked against a plain run or by arithmetic, then one performance point (GPT-2 124M
in bf16). Every case has its own time limit under one deadline; a failed case is recorded and the next runs.
Writes OUT/gpu_matrix.md (a table: case, verdict, what was measured) and exits 1 when any case failed.

    python3 scripts/gpu_matrix.py --build build-gpu --out $OUT            # on the GPU machine
    python3 scripts/gpu_matrix.py --build build --device cpu --out /tmp/m  # rehearsal here: the cases a CPU can run

Standard library only (the GPU image's python has torch, but nothing here needs it)."""
import argparse, filecmp, glob, json, math, os, shutil, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--model.name=gpt", "--model.preset=custom", "--model.n_layer=4", "--model.n_head=4", "--model.n_embd=256",
         "--model.block_size=256", "--model.vocab_size=512", "--model.dropout=0", "--data.dataset=synthetic",
         "--train.micro_batch=8", "--train.accum_steps=1", "--train.steps=6", "--train.warmup_steps=2",
         "--train.lr=1e-3", "--train.eval_every=0", "--train.eval_batches=1", "--log.every=1", "--log.progress=lines",
         "--checkpoint.save_final=false", "--log.overwrite=true"]


class Matrix:
    def __init__(self, a):
        self.a, self.rows, self.failed = a, [], 0
        self.work = tempfile.mkdtemp(prefix="memtrain-gpu-matrix-")
        self.deadline = time.time() + a.seconds
        self.log = open(os.path.join(a.out, "gpu_matrix.log"), "w")

    def run(self, name, args, ranks=1, env=None, limit=90, small=True):
        """One memtrain run (ranks > 1: through memtrain-run); its output, exit code and metrics."""
        cmd = [os.path.join(self.a.build, "memtrain")] + (SMALL if small else []) + [
            f"--train.device={self.a.device}", f"--log.dir={self.work}", f"--log.name={name}"] + args
        if ranks > 1:
            cmd = [os.path.join(self.a.build, "memtrain-run"), "--standalone", "--nproc-per-node", str(ranks), "--"] + cmd
        limit = max(5, min(limit, self.deadline - time.time()))
        t0 = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env={**os.environ, **(env or {})})
            out, code = p.stdout + p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            out, code = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), 124
        self.log.write(f"=== {name} ({time.time() - t0:.1f} s, exit {code}): {' '.join(cmd)}\n{out}\n")
        self.log.flush()
        run_dir = os.path.join(self.work, name)
        metrics = []
        if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                metrics = [json.loads(l) for l in f if '"loss"' in l]
        summary = {}
        if os.path.exists(os.path.join(run_dir, "summary.json")):
            with open(os.path.join(run_dir, "summary.json")) as f:
                summary = json.load(f)
        return dict(out=out, code=code, metrics=metrics, summary=summary, dir=run_dir, seconds=time.time() - t0)

    def case(self, name, fn):
        """Runs one check; fn returns a short text of what it measured, or raises AssertionError."""
        if time.time() > self.deadline - 10:
            self.rows.append((name, "NOT RUN", "no time left")); self.failed += 1
            return
        t0 = time.time()
        try:
            detail, verdict = fn(), "pass"
        except AssertionError as e:
            detail, verdict = str(e), "FAIL"
            self.failed += 1
        except Exception as e:  # a broken case is a failure of the check, not of the script
            detail, verdict = f"{type(e).__name__}: {e}", "FAIL"
            self.failed += 1
        self.rows.append((name, verdict, f"{detail} ({time.time() - t0:.0f} s)"))
        print(f"{verdict:4} {name}: {detail}", flush=True)

    def write(self):
        lines = [f"# GPU check: CLI matrix ({self.a.device})", "",
                 "`scripts/gpu_matrix.py` on a GPT of 4 x 256 (vocabulary 512, 256 tokens, synthetic data) unless said;",
                 "each case against a plain run or arithmetic. Log: gpu_matrix.log.", "",
                 "| case | verdict | measured |", "|---|---|---|"]
        lines += [f"| {n} | {v} | {d.replace('|', '/')} |" for n, v, d in self.rows]
        with open(os.path.join(self.a.out, "gpu_matrix.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


def ok(r, what):
    assert r["code"] == 0, f"{what} exited {r['code']}: " + " / ".join(r["out"].strip().splitlines()[-3:])
    assert r["metrics"], f"{what}: no metrics.jsonl lines"
    return r


def losses(r):
    return [m["loss"] for m in r["metrics"]]


def close(a, b, rel, what):
    assert len(a) == len(b) and a, f"{what}: {len(a)} vs {len(b)} logged steps"
    worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
    assert worst <= rel, f"{what}: losses differ by {worst:.2e} relative (limit {rel:.0e}): {a} vs {b}"
    return worst


def cpu_bf16_slowdown():
    """How many times slower a bf16 matmul is than an fp32 one on this CPU (the case shapes: 2048 x 256 x 1024).
    Without native bf16 (AVX2 only, no avx512_bf16 / AMX) oneDNN emulates it, about 20x slower; the bf16 cases
    then run on a smaller GPT so the matrix stays inside its deadline. Timed with the venv's torch when it imports,
    otherwise read from the CPU's flags."""
    try:
        import torch
        torch.set_num_threads(max(1, os.cpu_count() or 1))
        def best(dtype):
            a, b = torch.randn(2048, 256, dtype=dtype), torch.randn(256, 1024, dtype=dtype)
            times = []
            for _ in range(5):
                t0 = time.perf_counter(); a @ b; times.append(time.perf_counter() - t0)
            return min(times[1:])
        return best(torch.bfloat16) / best(torch.float32), "timed"
    except ImportError:
        flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
        native = "avx512_bf16" in flags or "amx_bf16" in flags
        return (1.0 if native else 20.0), "from /proc/cpuinfo flags"


# The bf16 cases' GPT where bf16 is emulated: 4 x 64, 64 tokens, micro-batch 4 (about 1/250 of the FLOPs).
SHRUNK = ["--model.n_embd=64", "--model.n_head=2", "--model.block_size=64", "--train.micro_batch=4"]


def peak(r, device):
    key = f"peak_{device}"
    return max(m.get(key, 0) for m in r["metrics"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build-gpu"))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--seconds", type=float, default=240, help="deadline for the whole matrix")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    m = Matrix(a)
    cuda = a.device == "cuda"
    dev = "cuda:0" if cuda else "cpu"
    plain = {}
    # bf16 cases: the standard GPT, or a smaller one on a CPU that emulates bf16 (said in each row, never silent).
    bf16_args, bf16_note = [], ""
    if not cuda:
        slow, how = cpu_bf16_slowdown()
        if slow > 5:
            bf16_args = SHRUNK
            bf16_note = (f" [shrunk to GPT 4 x 64, 64 tokens, micro-batch 4: a bf16 matmul is {slow:.0f}x slower than "
                         f"fp32 on this CPU ({how}; no native bf16)]")
            print(f"note: bf16 is emulated on this CPU ({slow:.0f}x slower than fp32, {how}); "
                  f"the bf16 cases run on GPT 4 x 64", flush=True)

    def fp32_plain():
        plain["r"] = ok(m.run("plain", []), "plain fp32")
        l = losses(plain["r"])
        assert all(math.isfinite(x) for x in l), f"non-finite loss {l}"
        assert l[-1] < l[0], f"the loss did not fall: {l}"
        # The run's own estimate against its measured peak (summary.json): on the H200 (2026-12-04) it was 26% low
        # here, before the two cuBLAS workspaces were counted.
        est = plain["r"]["summary"].get("memory_estimate", {})
        assert "error" in est, f"no memory_estimate in summary.json: {sorted(plain['r']['summary'])}"
        assert abs(est["error"]) <= 0.10, f"estimate {est['device']['peak'] / 2**20:.1f} MiB is {100 * est['error']:+.1f}% " \
            f"of the measured {peak(plain['r'], dev) / 2**20:.1f} MiB (limit 10%)"
        return (f"losses {l[0]:.4f} -> {l[-1]:.4f}, peak {peak(plain['r'], dev) / 2**20:.1f} MiB, "
                f"estimate {100 * est['error']:+.1f}%")
    m.case("fp32 plain (the reference)", fp32_plain)

    if cuda:
        def fp16_scaler():
            # A huge initial scale (2^40) overflows: the first steps are skipped, each halving it (backoff; about 20
            # halvings bring gradients of ~1e-2 under fp16's 65,504), then a finite run of loss_scale_interval = 2
            # steps doubles it (growth).
            r = ok(m.run("fp16", ["--train.precision=fp16", f"--train.loss_scale_init={2.0**40}",
                                  "--train.loss_scale_interval=2", "--train.steps=40"]), "fp16")
            scales = [x["loss_scale"] for x in r["metrics"]]
            skipped = [x.get("skipped", False) for x in r["metrics"]]
            assert skipped[0], f"step 1 with scale 2^40 was not skipped: {scales[:4]}"
            assert scales[0] <= 2.0**39, f"no backoff after the first step: {scales[:4]}"
            assert not all(skipped), "every step skipped"
            grew = any(b == 2 * x for x, b in zip(scales, scales[1:]))
            assert grew, f"the scale never grew: {scales}"
            assert all(math.isfinite(x) for x, s in zip(losses(r), skipped) if not s)
            return f"{sum(skipped)} of {len(skipped)} steps skipped, scale 2^40 -> {scales[-1]:.3g}, grew after 2 finite steps"
        m.case("fp16: skip, backoff, growth", fp16_scaler)

        def fp16_deferred():
            # train.host_reads = deferred (CUDA's default) logged every 4 steps against each_step: the same weights.
            base = ["--train.precision=fp16", f"--train.loss_scale_init={2.0**40}", "--train.loss_scale_interval=2",
                    "--train.steps=36", "--log.every=4", "--checkpoint.save_final=true"]
            e = ok(m.run("fp16_each", base + ["--train.host_reads=each_step"]), "each_step")
            d = ok(m.run("fp16_deferred", base + ["--train.host_reads=deferred"]), "deferred")
            assert losses(e) == losses(d), f"losses differ: {losses(e)} vs {losses(d)}"
            assert not all(x.get("skipped") for x in d["metrics"]), "every logged step skipped: nothing trained to compare"
            assert filecmp.cmp(f"{e['dir']}/checkpoints/model.safetensors", f"{d['dir']}/checkpoints/model.safetensors",
                               shallow=False), "final weights differ"
            return "deferred flag reads: the same losses and final weights bit for bit as each_step"
        m.case("fp16: deferred host reads = each_step", fp16_deferred)

    def bf16_recompute():
        runs = {p: ok(m.run(f"bf16_{p.replace('+', '_')}", ["--train.precision=bf16", f"--memory.recompute={p.split('+')[0]}"] + bf16_args +
                            (["--memory.offload=true"] if "+" in p else [])), p)
                for p in (["none", "all", "all+offload"] if cuda else ["none", "all"])}
        ref = losses(runs["none"])
        worst = max(close(losses(r), ref, 1e-5, p) for p, r in runs.items())
        peaks = {p: peak(r, dev) for p, r in runs.items()}
        assert peaks["all"] < peaks["none"], f"recompute all did not lower the peak: {peaks}"
        if cuda:
            # On 4 blocks the step's peak is block 0's recomputed backward, where recompute alone keeps only block 0's
            # input too: offload cannot lower it, and the input brought back ahead of its block is one more block input
            # in flight (seen on the H200, 2026-12-04: +1 MiB). Offload must not cost more than that one input (fp32,
            # 8 x 256 x 256); the CUDA test Checkpointing.CudaOffloadCopiesBeforeTheBlockAndFreesAfterRecompute
            # proves the inputs leave the device and come back in time.
            one_input = 8 * 256 * 256 * 4
            assert peaks["all+offload"] <= peaks["all"] + one_input, \
                f"offload raised the peak by more than one block's input ({one_input} B): {peaks}"
        return "losses within %.1e of none; peaks %s%s" % (worst, ", ".join(f"{p} {b / 2**20:.1f} MiB" for p, b in peaks.items()),
                                                          bf16_note)
    m.case("bf16 recompute none / all / all+offload", bf16_recompute)

    def fused_head():
        r = ok(m.run("fused", ["--memory.head=fused"]), "fused head")
        w = close(losses(r), losses(plain["r"]), 1e-5, "fused vs plain")
        return f"losses within {w:.1e} of the plain head; peak {peak(r, dev) / 2**20:.1f} vs {peak(plain['r'], dev) / 2**20:.1f} MiB"
    m.case("fused head = plain head (fp32)", fused_head)

    def masters():
        # On the byte-level text, where 6 steps lower the loss by about 10% (on uniform synthetic tokens the loss sits
        # at ln(512) and a run that never trains would pass): bf16 parameters with fp32 masters must track fp32
        # within a tenth of how far fp32 moved, and move as far.
        text = ["--data.dataset=text", "--model.vocab_size=0"] + bf16_args
        ref = ok(m.run("masters_fp32", text), "plain fp32 on text")
        r = ok(m.run("masters", text + ["--train.param_dtype=bf16", "--train.precision=bf16"]), "bf16 parameters")
        l, f = losses(r), losses(ref)
        fall = (f[0] - f[-1]) / f[0]
        assert fall > 0.03, f"fp32 on text lowered the loss by only {100 * fall:.1f}% in {len(f)} steps: {f}"
        w = close(l, f, fall / 10, "bf16 parameters with fp32 masters vs fp32")
        return (f"bf16 parameters with fp32 masters on text: losses {l[0]:.4f} -> {l[-1]:.4f}, within {w:.1e} of fp32 "
                f"(which fell {100 * fall:.1f}%){bf16_note}")
    m.case("bf16 parameters with masters", masters)

    def zero_one_rank():
        out = []
        for stage in (1, 2, 3):
            r = ok(m.run(f"zero{stage}_offload", [f"--dist.zero_stage={stage}", "--dist.offload_optimizer=cpu"]), f"stage {stage}")
            out.append(f"stage {stage} {close(losses(r), losses(plain['r']), 1e-5, f'stage {stage} + offload'):.1e}")
        return ("over NCCL (a group of one)" if cuda else "over Gloo (a group of one)") + ", losses within: " + ", ".join(out)
    m.case("ZeRO 1/2/3 + offload at world size 1 = plain", zero_one_rank)

    def two_gloo_ranks():
        # The byte-level text (the prepared Austen set; on the GPU machine .gpu/data): its windows are dealt so
        # that 2 ranks x 8 see the samples of 1 x 16 (synthetic tokens are drawn per rank instead).
        text = ["--data.dataset=text", "--model.vocab_size=0"]
        one = ok(m.run("one_of_16", text + ["--train.micro_batch=16"]), "one process")
        out = []
        for stage in (1, 2, 3):
            r = ok(m.run(f"gloo2_zero{stage}", text + ["--train.micro_batch=8", f"--dist.zero_stage={stage}", "--dist.backend=gloo"],
                         ranks=2), f"2 Gloo ranks stage {stage}")
            out.append(f"stage {stage} {close(losses(r), losses(one), 1e-5, f'2 ranks stage {stage}'):.1e}")
        return "text, 2 ranks x 8 against 1 x 16" + (" (both ranks on cuda:0)" if cuda else "") + ": " + ", ".join(out)
    m.case("2 Gloo ranks" + (" with CUDA tensors on one GPU" if cuda else "") + " = one process", two_gloo_ranks)

    def two_tensor_parallel_ranks():
        # dist.tensor_parallel = 2: both ranks take the same 16 samples and split every block (and the vocabulary);
        # with and without sequence parallelism, against one process on the same samples.
        text = ["--data.dataset=text", "--model.vocab_size=0", "--memory.head=plain", "--train.micro_batch=16"]
        one = ok(m.run("tp_one", text), "one process")
        out = []
        for sp in ("on", "off"):
            r = ok(m.run(f"tp2_sp_{sp}", text + ["--dist.tensor_parallel=2", f"--dist.sequence_parallel={sp}",
                                                 "--dist.backend=gloo"], ranks=2), f"T = 2, sequence parallel {sp}")
            out.append(f"sequence parallel {sp} {close(losses(r), losses(one), 1e-4, f'T = 2 sequence parallel {sp}'):.1e}")
        return "text, 2 tensor-parallel ranks" + (" (both on cuda:0)" if cuda else "") + ": " + ", ".join(out)
    m.case("tensor parallel T = 2 over Gloo" + (" with CUDA tensors on one GPU" if cuda else "") + " = one process",
           two_tensor_parallel_ranks)

    def oom_retry():
        # The limit is 70% of the measured peak at micro-batch 32: activations dominate, so half fits.
        big = ["--train.micro_batch=32", "--train.steps=3", "--memory.estimate=false"]
        free = ok(m.run("oom_free", big), "unlimited")
        limit = int(peak(free, dev) * 0.7 / 2**20)
        r = ok(m.run("oom_retry", big + [f"--memory.limit_mib={limit}", "--train.oom=retry"]), "retry")
        assert "retrying it with micro-batches of 16 x 2" in r["out"], "no retry line: " + r["out"][-400:]
        w = close(losses(r)[1:], losses(free)[1:], 1e-4, "retried vs unlimited (steps 2-3)")
        return f"limit {limit} MiB (70% of {peak(free, dev) / 2**20:.0f} MiB): retried at 16 x 2, losses within {w:.1e}"
    m.case("out of memory: retried under memory.limit_mib", oom_retry)

    def budget_auto():
        r = ok(m.run("budget_auto", ["--memory.budget_mib=auto", "--train.steps=4"]), "budget auto")
        assert "chosen:" in r["out"], "no plan printed"
        line = next(l for l in r["out"].splitlines() if "chosen:" in l)
        return line.strip()[:160]
    m.case("memory.budget_mib = auto", budget_auto)

    def resume():
        base = ["--checkpoint.save_final=true", "--log.every=3"]
        straight = ok(m.run("straight", base), "straight")
        saving = ok(m.run("saving", base + ["--checkpoint.every=3"]), "saving")
        step3 = glob.glob(f"{saving['dir']}/checkpoints/step-000003")
        assert step3, "no step-3 checkpoint"
        resumed = ok(m.run("resumed", base + [f"--checkpoint.resume={step3[0]}"]), "resumed")
        a, b = f"{straight['dir']}/checkpoints/model.safetensors", f"{resumed['dir']}/checkpoints/model.safetensors"
        assert filecmp.cmp(a, b, shallow=False), "the resumed run's final weights differ from the straight run's"
        return "saved at step 3, resumed to 6: final weights identical to the straight run's"
    m.case("save and bit-exact resume", resume)

    if cuda:
        def allocator_keys():
            exp = ok(m.run("expandable", ["--memory.expandable_segments=true", "--memory.gc_threshold=0.8",
                                          "--train.steps=3"]), "expandable_segments + gc_threshold")
            refused = m.run("async_refused", ["--memory.cuda_allocator=cudaMallocAsync", "--train.steps=2"])
            assert refused["code"] != 0 and "PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync" in refused["out"], \
                "cudaMallocAsync without the variable was not refused clearly: " + refused["out"][-300:]
            asyn = ok(m.run("async", ["--memory.cuda_allocator=cudaMallocAsync", "--train.steps=3"],
                            env={"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}), "cudaMallocAsync exported")
            return (f"expandable_segments + gc_threshold trains (peak {peak(exp, dev) / 2**20:.1f} MiB); cudaMallocAsync refused "
                    f"without the variable, trains with it")
        m.case("allocator keys", allocator_keys)

    def stage3_repeat():
        args = ["--train.micro_batch=8", "--dist.zero_stage=3", "--dist.backend=gloo"] if not cuda else \
               ["--dist.zero_stage=3", "--dist.offload_optimizer=cpu"]
        ranks = 2 if not cuda else 1
        runs = [ok(m.run(f"race{i}", args + ["--checkpoint.save_final=true"], ranks=ranks), f"run {i}") for i in range(3)]
        for r in runs[1:]:
            assert losses(r) == losses(runs[0]), f"losses differ between identical runs: {losses(r)} vs {losses(runs[0])}"
            assert filecmp.cmp(f"{r['dir']}/checkpoints/model.safetensors", f"{runs[0]['dir']}/checkpoints/model.safetensors",
                               shallow=False), "final weights differ between identical runs"
        return "3 identical stage-3 runs: bitwise equal losses and weights"
    m.case("stage 3 repeated bitwise (race detector)", stage3_repeat)

    if cuda:
        def performance():
            # examples/configs/gpt2_124m_gpu.ini's model and batch, on synthetic tokens (its data.tokens needs text).
            r = ok(m.run("gpt2_124m", ["--model.name=gpt", "--model.preset=gpt2", "--model.vocab_size=50304",
                                       "--model.dropout=0", "--data.dataset=synthetic", "--train.precision=bf16",
                                       "--train.micro_batch=16", "--train.accum_steps=4", "--train.lr=6e-4",
                                       "--train.steps=12", "--train.warmup_steps=2", "--train.eval_every=0",
                                       "--train.eval_batches=1", "--log.every=4", "--log.peak_tflops=989",
                                       "--checkpoint.save_final=false", "--log.overwrite=true", "--log.progress=lines"],
                         small=False, limit=150), "GPT-2 124M")
            last = r["metrics"][-1]
            est = r["summary"].get("memory_estimate", {})
            measured = peak(r, dev)
            text = f"{last['ms_per_step']:.0f} ms/step, {last.get('tokens_per_s', 0) / 1e3:.0f}k tok/s"
            if "mfu" in last:
                text += f", MFU {100 * last['mfu']:.1f}% (989 TFLOP/s bf16 dense)"
            text += f", peak {measured / 2**30:.2f} GiB"
            if est.get("device", {}).get("peak"):
                text += f", estimate {est['device']['peak'] / 2**30:.2f} GiB ({100 * est['error']:+.1f}% of the measured)"
            return text
        m.case("performance: GPT-2 124M bf16, 12 steps", performance)

    m.write()
    shutil.rmtree(m.work, ignore_errors=True)
    print(f"{len(m.rows) - m.failed} of {len(m.rows)} cases passed; table in {os.path.join(a.out, 'gpu_matrix.md')}")
    sys.exit(1 if m.failed else 0)


if __name__ == "__main__":
    main()
