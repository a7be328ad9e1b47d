#!/usr/bin/env python3
"""memory.png of a run folder: per rank, the memory of every step's peak, stacked: what was resident when the
step began (parameters, optimizer state, data, and the rest: resident gradients and anything else), then what
the step added by its peak, taken apart where the tracker could (CPU runs' `at_peak`: gradients born in the
step, the fused head's saved gradients, ZeRO-3's gathered parameters, activations and temporaries; elsewhere
one "step's activation peak"); the peak as a line, and the estimate (summary.json, made before step 1), the
planner's budget (memory.budget_mib) and the memory limit as horizontal lines.

  venv/bin/python scripts/plot_memory.py runs/gpt_austen_cpu        # writes runs/gpt_austen_cpu/memory.png

Reads memory.rank<N>.jsonl (one line per step and device) and summary.json; the device plotted is the
training device (a GPU's when the run had one, else the CPU). Needs matplotlib (set-up installs it).
"""
import glob, json, os, re, sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MIB = 2**20
# Resident at the step's start (the fields are the step end's, the same but in the first step), then the rest of
# start_allocated; then what the step added, from at_peak.
RESIDENT = [("params", "parameters"), ("optimizer_state", "optimizer state"), ("data", "data")]
AT_PEAK = [("gradients_born", "gradients born in the step"), ("head_saved", "fused head's saved gradients"),
           ("gathered", "gathered parameters (ZeRO-3)"), ("activations", "activations and temporaries")]


def layers(row):
    """(label, MiB) from the bottom up; they sum to the step's peak."""
    start = row["start_allocated"]
    resident = {k: row.get(k, 0) for k, _ in RESIDENT}
    # Step 1 creates the optimizer state: at its start only what start_allocated holds was there.
    resident["optimizer_state"] = min(resident["optimizer_state"], max(0, start - resident["params"] - resident["data"]))
    out = [(label, resident[key] / MIB) for key, label in RESIDENT]
    out.append(("other resident (gradients, buffers)", max(0, start - sum(resident.values())) / MIB))
    if "at_peak" in row:
        out += [(label, row["at_peak"].get(key, 0) / MIB) for key, label in AT_PEAK]
    else:
        out.append(("step's activation peak", row["activation_peak"] / MIB))
    return out


def load(run):
    ranks = {}
    for path in sorted(glob.glob(os.path.join(run, "memory.rank*.jsonl"))):
        rank = int(re.search(r"memory\.rank(\d+)\.jsonl$", path).group(1))
        rows = [json.loads(line) for line in open(path) if line.strip()]
        gpu = [r for r in rows if r["device"] != "cpu"]
        ranks[rank] = gpu or rows
    if not ranks:
        raise SystemExit(f"plot_memory: no memory.rank*.jsonl in {run}")
    summary = {}
    if os.path.exists(os.path.join(run, "summary.json")):
        summary = json.load(open(os.path.join(run, "summary.json")))
    limit = budget = None
    cfg = os.path.join(run, "config.ini")
    if os.path.exists(cfg):
        section = ""
        for line in open(cfg):
            line = line.strip()
            if line.startswith("["):
                section = line.strip("[]")
            elif section == "memory" and "=" in line:
                key, value = (x.strip() for x in line.split("=", 1))
                if key == "limit_mib" and float(value) > 0:
                    limit = float(value) * MIB
                elif key == "budget_mib" and value not in ("", "0", "auto"):  # auto: the machine's, not saved
                    budget = float(value) * MIB
    return ranks, summary, limit, budget


def main(argv):
    if len(argv) != 2:
        raise SystemExit(__doc__)
    run = argv[1]
    ranks, summary, limit, budget = load(run)
    fig, axes = plt.subplots(len(ranks), 1, figsize=(11, 3.2 * len(ranks)), squeeze=False, sharex=True)
    estimate = summary.get("memory_estimate", {}).get("device", {}).get("peak")
    for ax, (rank, rows) in zip(axes[:, 0], sorted(ranks.items())):
        steps = [r["step"] for r in rows]
        bottom = [0.0] * len(rows)
        stacks = [layers(r) for r in rows]
        for i, (label, _) in enumerate(stacks[0]):
            values = [st[i][1] if i < len(st) else 0.0 for st in stacks]
            if not any(values):
                continue
            ax.fill_between(steps, bottom, [b + v for b, v in zip(bottom, values)], step="mid", label=label, alpha=0.8)
            bottom = [b + v for b, v in zip(bottom, values)]
        tops = [r["peak_allocated"] / MIB for r in rows]
        ax.plot(steps, tops, drawstyle="steps-mid", color="black", linewidth=1, label="peak allocated")
        if estimate:
            ax.axhline(estimate / MIB, color="tab:red", linestyle="--", linewidth=1, label="estimate (before step 1)")
        if limit:
            ax.axhline(limit / MIB, color="tab:purple", linestyle=":", linewidth=1.5, label="memory.limit_mib")
        if budget:
            ax.axhline(budget / MIB, color="tab:green", linestyle="-.", linewidth=1.5, label="memory.budget_mib (the plan's budget)")
        phases = sorted({r["peak_phase"] for r in rows})
        ax.set_title(f"rank {rank}, {rows[0]['device']}: peak in {', '.join(phases)}", fontsize=9)
        ax.set_ylabel("MiB")
        ax.grid(alpha=0.3)
    # The legend beside the plots, not over the stacked areas it explains.
    axes[0, 0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    out = os.path.join(run, "memory.png")
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv)
