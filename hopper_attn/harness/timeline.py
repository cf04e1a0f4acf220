"""Per-warpgroup timelines of a kernel's main loop, recorded in the kernel with CuTe DSL's iket.

    python -m hopper_attn.harness.timeline record k4 --out results/h100/timeline_k4
    python -m hopper_attn.harness.timeline plot results/h100/timeline_k4/k4.trace.json \\
        --out docs/img/h100_timeline_k4.png

`record` compiles the kernel with ``trace=1`` (iket phase ranges around each phase of the
main loop, see hopper_attn/common/trace.py), and runs it under ``iket profile``, which keeps
the ranges in the JIT output and turns them into per-warp timestamps. It writes the decoded
trace (``<kernel>.trace.json``) and a Perfetto trace (``<kernel>.pftrace``, open it in
https://ui.perfetto.dev) to ``--out``, plus ``<kernel>.cost.json``: the kernel's time with and
without the ranges, measured in the same traced process.

`plot` draws one lane per warpgroup of a few CTAs on one time axis (globaltimer ns).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

PHASE_COLORS = {"wait_kv": "#bbbbbb", "wait_k": "#bbbbbb", "wait_v": "#dddddd",
                "qk": "#1f77b4", "softmax": "#ff7f0e", "pv": "#2ca02c", "release": "#9467bd",
                "wait_turn": "#e377c2", "load_k": "#17becf", "load_v": "#bcbd22", "epilogue": "#8c564b"}


# ------------------------------------------------------------------------- the workload
def workload(args) -> int:
    """Inside `iket profile`: time the kernel without and with its ranges, once each traced."""
    import torch

    from hopper_attn.common.contract import Problem
    from hopper_attn.harness import registry
    from hopper_attn.harness.inputs import make_inputs
    from hopper_attn.harness.timing import benchmark

    problem = Problem(args.batch, args.heads, args.seqlen, args.head_dim, args.causal)
    q, k, v, out = make_inputs(problem, 0)
    cost = {"problem": problem.as_dict()}
    for trace in (0, 1):
        entry = registry.get(f"{args.kernel}:trace={trace}")
        handle = entry.compile(problem)
        t = benchmark(lambda: entry.run(handle, q, k, v, out), target_ms=50, max_reps=10)
        cost[f"ms_trace{trace}"] = t["ms"]
    torch.cuda.synchronize()
    cost["overhead"] = cost["ms_trace1"] / cost["ms_trace0"] - 1.0
    print(json.dumps(cost))
    with open(args.cost_json, "w") as f:
        json.dump(cost, f, indent=1)
    return 0


def record(args) -> int:
    """Run `workload` under `iket profile` and collect the traces into args.out."""
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="iket_")
    env = dict(os.environ)
    # a separate JIT cache: the traced build must not come from (or go into) the normal cache
    env["CUTE_DSL_CACHE_DIR"] = os.path.join(work, "cache")
    cost_json = os.path.join(args.out, f"{args.kernel}.cost.json")
    # -o belongs to iket's top-level parser, before the subcommand
    cmd = [sys.executable, "-m", "iket.cli.main", "-o", os.path.join(work, "run"),
           "profile", "--postprocess", "all", "--",
           sys.executable, "-m", "hopper_attn.harness.timeline", "workload", args.kernel,
           "--batch", str(args.batch), "--heads", str(args.heads), "--seqlen", str(args.seqlen),
           "--head-dim", str(args.head_dim), "--cost-json", cost_json]
    if args.causal:
        cmd.append("--causal")
    print(" ".join(cmd))
    rc = subprocess.run(cmd, env=env).returncode
    for pattern, suffix in (("*.trace.json", ".trace.json"), ("*.pftrace", ".pftrace")):
        found = sorted(glob.glob(os.path.join(work, "run", "**", pattern), recursive=True))
        if found:
            shutil.copy(max(found, key=os.path.getsize), os.path.join(args.out, args.kernel + suffix))
    print("wrote", sorted(os.listdir(args.out)))
    return rc


# ------------------------------------------------------------------------------ plotting
def load_ranges(path, kernel_filter="FlashAttention"):
    """Decoded iket trace -> list of (cta, warp, name, start_ns, end_ns) for one kernel."""
    with open(path) as f:
        data = json.load(f)
    rows = []
    for launch in data.get("launches", []):
        name = launch.get("kernelName", launch.get("name", ""))
        if kernel_filter and kernel_filter not in name:
            continue
        for r in launch.get("ranges", []):
            rows.append((r.get("cta", r.get("block")), r.get("warp"), r.get("name"),
                         r.get("start"), r.get("end")))
        if rows:
            break
    return rows


def plot(args) -> int:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load_ranges(args.trace)
    if not rows:
        print(f"no ranges found in {args.trace}")
        return 1
    ctas = sorted({r[0] for r in rows}, key=str)[: args.ctas]
    rows = [r for r in rows if r[0] in ctas and r[1] % 4 == 0]       # first warp of each warpgroup
    t0 = min(r[3] for r in rows)
    t_end = t0 + args.window_us * 1000 if args.window_us else max(r[4] for r in rows)
    lanes = sorted({(r[0], r[1] // 4) for r in rows}, key=str)
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(lanes) + 1.2))
    for y, lane in enumerate(lanes):
        for cta, warp, name, s, e in rows:
            if (cta, warp // 4) != lane or s > t_end:
                continue
            ax.barh(y, (min(e, t_end) - s) / 1000, left=(s - t0) / 1000, height=0.7,
                    color=PHASE_COLORS.get(name, "#444444"), label=name)
    ax.set_yticks(range(len(lanes)), [f"CTA {c} WG {w}" for c, w in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("time, us (globaltimer)")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), ncol=len(uniq), loc="upper center",
              bbox_to_anchor=(0.5, -0.25 if len(lanes) < 4 else -0.12), frameon=False)
    ax.set_title(args.title or os.path.basename(args.trace))
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print("wrote", args.out)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("record", "workload"):
        p = sub.add_parser(name)
        p.add_argument("kernel")
        p.add_argument("--batch", type=int, default=1)
        p.add_argument("--heads", type=int, default=2)
        p.add_argument("--seqlen", type=int, default=2048)
        p.add_argument("--head-dim", type=int, default=128)
        p.add_argument("--causal", action="store_true")
        if name == "record":
            p.add_argument("--out", required=True)
        else:
            p.add_argument("--cost-json", required=True)
    p = sub.add_parser("plot")
    p.add_argument("trace")
    p.add_argument("--out", required=True)
    p.add_argument("--ctas", type=int, default=2)
    p.add_argument("--window-us", type=float, default=0.0)
    p.add_argument("--title", default="")
    args = ap.parse_args(argv)
    return {"record": record, "workload": workload, "plot": plot}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
