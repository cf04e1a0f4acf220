"""Per-warpgroup timelines of a kernel's main loop, recorded in the kernel with CuTe DSL's iket.

    python -m hopper_attn.harness.timeline record k4 --out results/h100/timeline_k4
    python -m hopper_attn.harness.timeline plot results/h100/timeline_k4/k4.trace.json.xz \\
        --out docs/img/h100_timeline_k4.png
    python -m hopper_attn.harness.timeline stats results/h100/timeline_k4/k4.trace.json.xz

`record` compiles the kernel with ``trace=1`` (iket phase ranges around each phase of the
main loop, see hopper_attn/common/trace.py), and runs it under ``iket profile``, which keeps
the ranges in the JIT output and turns them into per-warp timestamps, for one CTA
(``--cta``) of every launch. It writes the decoded trace of the last launch
(``<kernel>.trace.json.xz``), a Perfetto trace of all of them (``<kernel>.pftrace``, open it
in https://ui.perfetto.dev) and ``<kernel>.cost.json``: the kernel's time with and without
the ranges, measured in the same traced process, with the versions it ran with.

`plot` draws one lane per warpgroup (its first warp) of the recorded CTA, a window of a few
microseconds in the steady state, one panel per trace; `stats` sums the phases; `items`
measures where one work item ends and the next begins (k5-k7's persistent loop).
"""

from __future__ import annotations

import argparse
import glob
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tempfile

PHASE_COLORS = {"wait_kv": "#bbbbbb", "wait_k": "#bbbbbb", "wait_v": "#dddddd",
                "qk": "#1f77b4", "softmax": "#ff7f0e", "pv": "#2ca02c", "release": "#9467bd",
                "wait_turn": "#e377c2", "mma": "#08306b", "wait_pv": "#98df8a", "rescale": "#d62728", "load_k": "#17becf", "load_v": "#bcbd22", "epilogue": "#8c564b", "transpose": "#7f7f7f",
                # the backward (kb2)
                "wait_q": "#bbbbbb", "next_item": "#c49c94", "s_dp": "#1f77b4", "wait_s": "#9ecae1", "exp2": "#ff7f0e",
                "dv": "#2ca02c", "wait_dp": "#98df8a", "ds": "#d62728", "ds_barrier": "#e377c2",
                "dq_dk": "#08306b", "wait_dv_dq": "#6baed6", "dq_store": "#8c564b",
                "wait_dk": "#dddddd", "load_q": "#17becf", "load_do": "#bcbd22",
                "wait_dq_full": "#7f7f7f"}


# ------------------------------------------------------------------------- the workload
def workload(args) -> int:
    """Inside `iket profile`: time the kernel without and with its ranges, once each traced."""
    import torch

    from hopper_attn.common.contract import Problem
    from hopper_attn.harness import registry
    from hopper_attn.harness.inputs import make_inputs
    from hopper_attn.harness.timing import benchmark

    problem = Problem(args.batch, args.heads, args.seqlen, args.head_dim, args.causal,
                      # -1: no sliding window (Problem's None; its -1 is a literal side)
                      window_left=args.window_left if args.window_left >= 0 else None)
    backward = args.kernel.partition(":")[0] in registry.BACKWARD_KERNELS
    if backward:                                        # kb1, kb2: gradients of one case
        from hopper_attn.harness.grad_check import BackwardCase
        case = BackwardCase(problem, 0, reference=False)
        q, k, v = case.q, case.k, case.v
    else:
        q, k, v, out = make_inputs(problem, 0)
    cost = {"problem": problem.as_dict()}
    for trace in (0, 1):
        sep = "," if ":" in args.kernel else ":"      # a name with options already
        entry = registry.get(f"{args.kernel}{sep}trace={trace}")
        handle = entry.compile(problem)
        tensors = (case.q, case.k, case.v, case.o, case.do, case.lse, case.dq, case.dk,
                   case.dv) if backward else (*entry.prepare(q, k, v),   # k7: FP8 inputs
                                              entry.output_for(handle, out))
        t = benchmark(lambda: entry.run(handle, *tensors), target_ms=50, max_reps=10)
        cost[f"ms_trace{trace}"] = t["ms"]
    torch.cuda.synchronize()
    cost["overhead"] = cost["ms_trace1"] / cost["ms_trace0"] - 1.0
    from hopper_attn.harness.env import environment
    cost["env"] = environment()
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
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", args.kernel)   # k6:pv_wait=late -> k6_pv_wait_late
    cost_json = os.path.join(args.out, f"{stem}.cost.json")
    # -o belongs to iket's top-level parser, before the subcommand
    # --enabled-cluster: only one CTA (a 1x1x1 cluster) of each launch writes its events
    cmd = [sys.executable, "-m", "iket.cli.main", "-o", os.path.join(work, "run"),
           "profile", "--postprocess", "all", "--enabled-cluster", f"{args.cta},0,0", "--",
           sys.executable, "-m", "hopper_attn.harness.timeline", "workload", args.kernel,
           "--batch", str(args.batch), "--heads", str(args.heads), "--seqlen", str(args.seqlen),
           "--head-dim", str(args.head_dim), "--cost-json", cost_json]
    if args.causal:
        cmd.append("--causal")
    if args.window_left >= 0:
        cmd += ["--window-left", str(args.window_left)]
    print(" ".join(cmd))
    rc = subprocess.run(cmd, env=env).returncode
    for pattern, suffix in (("*.trace.json", ".trace.json"), ("*.pftrace", ".pftrace")):
        found = sorted(glob.glob(os.path.join(work, "run", "**", pattern), recursive=True))
        if found:
            shutil.copy(max(found, key=os.path.getsize), os.path.join(args.out, stem + suffix))
    print("wrote", sorted(os.listdir(args.out)))
    trace = os.path.join(args.out, stem + ".trace.json")
    if os.path.exists(trace):
        _outline(_read(shrink(trace)))
    return rc


def _read(path):
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def shrink(path):
    """Keep only the last launch (the workload's last traced run), xz-compressed: a few
    hundred kB instead of megabytes, small enough to commit."""
    data = _read(path)
    # the last launch with ranges (a backward's dQ conversion, launched after it, has none)
    data["launches"] = [l for l in data["launches"] if l.get("ranges")][-1:]
    out = path if path.endswith(".xz") else path + ".xz"
    with lzma.open(out, "wt") as f:
        json.dump(data, f, separators=(",", ":"))
    if out != path:
        os.remove(path)
    return out


def _outline(obj, path="trace", depth=0):
    """Print the structure of a decoded trace (keys, list lengths, sample leaves)."""
    if depth > 5:
        return
    if isinstance(obj, dict):
        for key, val in list(obj.items())[:25]:
            _outline(val, f"{path}.{key}", depth + 1)
    elif isinstance(obj, list):
        print(f"{path}: list[{len(obj)}]")
        if obj:
            _outline(obj[0], f"{path}[0]", depth + 1)
    else:
        print(f"{path} = {str(obj)[:80]}")


# ------------------------------------------------------------------------------ plotting
def load_ranges(path, launch=-1):
    """Decoded iket trace -> (kernel name, [(warp, phase, start_ns, end_ns)]) of one launch.

    The trace holds `launches` (one per kernel launch; `ranges` with startTs/endTs in
    globaltimer ns, a phase name index into `stringTable` and the recording warp as an
    index into `locationTable`) for the one CTA that `record` enabled.
    """
    data = _read(path)
    names, where = data["stringTable"], data["locationTable"]
    chosen = data["launches"][launch]
    rows = [(where[r["warpLocIdxs"][0]]["warpId"], names[r["rangeNameIdx"]], r["startTs"],
             r["endTs"]) for r in chosen["ranges"]]
    return chosen["kernelName"], rows


def phase_stats(rows) -> dict:
    """(warpgroup, phase) -> {count, mean_ns, total_ns}, for the docs' tables."""
    out = {}
    for warp, name, start, end in rows:
        entry = out.setdefault(f"wg{warp // 4} {name}", {"count": 0, "total_ns": 0})
        entry["count"] += 1
        entry["total_ns"] += end - start
    for entry in out.values():
        entry["mean_ns"] = round(entry["total_ns"] / entry["count"], 1)
    return out


def plot(args) -> int:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = [load_ranges(path) for path in args.trace]
    titles = args.titles.split("|") if args.titles else [os.path.basename(p) for p in args.trace]
    fig, axes = plt.subplots(len(traces), 1, figsize=(11, 1.0 + 1.1 * sum(
        len({w // 4 for w, *_ in rows}) for _, rows in traces) / len(traces) * len(traces)),
        squeeze=False)
    seen = {}
    for ax, (kernel, rows), title in zip(axes[:, 0], traces, titles):
        rows = [r for r in rows if r[0] % 4 == 0]                 # first warp of each warpgroup
        begin = min(r[2] for r in rows)
        t0 = begin + args.skip_us * 1000                          # past the prologue
        t1 = t0 + args.window_us * 1000
        lanes = sorted({w // 4 for w, *_ in rows})
        for warp, name, start, end in rows:
            if end < t0 or start > t1:
                continue
            y = lanes.index(warp // 4)
            bar = ax.barh(y, (min(end, t1) - max(start, t0)) / 1000, left=(max(start, t0) - t0) / 1000,
                          height=0.72, color=PHASE_COLORS.get(name, "#444444"), edgecolor="none")
            seen.setdefault(name, bar)
        loaders = {w // 4 for w, name, *_ in rows if name.startswith("load_")}
        ax.set_yticks(range(len(lanes)),
                      ["producer WG" if wg in loaders else f"WG {wg}" for wg in lanes])
        ax.set_ylim(len(lanes) - 0.4, -0.6)
        ax.set_xlim(0, args.window_us)
        ax.set_title(title, fontsize=10, loc="left")
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel(f"time, us (globaltimer; {args.skip_us:g} us after the CTA's first "
                           "recorded phase)")
    fig.legend(seen.values(), seen.keys(), ncol=len(seen), loc="lower center", frameon=False,
               fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(args.out, dpi=100)
    print("wrote", args.out)
    return 0


def item_ends(rows) -> dict:
    """Per consumer warpgroup (its first warp): the steady kv-tile period (softmax start to
    softmax start inside a work item) and the work item's end (the last softmax start of an
    item to the first of the next), with the median length of each phase in between, in ns.
    A work item ends with its `epilogue` range."""
    import statistics
    out = {}
    for wg in sorted({w // 4 for w, *_ in rows if w % 4 == 0 and w >= 4}):
        ranges = sorted((r for r in rows if r[0] == 4 * wg), key=lambda r: r[2])
        items, current = [], []
        for r in ranges:
            current.append(r)
            if r[1] == "epilogue":
                items.append(current)
                current = []
        starts = [[r[2] for r in item if r[1] == "softmax"] for item in items]
        periods = [b - a for s in starts for a, b in zip(s, s[1:])]
        ends, phases = [], {}
        for (a, b), (sa, sb) in zip(zip(items, items[1:]), zip(starts, starts[1:])):
            if not sa or not sb:
                continue
            between = [r for r in a + b if sa[-1] <= r[2] < sb[0]]
            ends.append(sb[0] - sa[-1])
            for i, r in enumerate(between):
                phases.setdefault((i, r[1]), []).append(r[3] - r[2])
            idle = sum(max(0, n[2] - p[3]) for p, n in zip(between, between[1:]))
            phases.setdefault((len(between), "(no range)"), []).append(idle)
        if not periods or not ends:
            continue
        period, end = statistics.median(periods), statistics.median(ends)
        out[f"wg{wg}"] = {
            "items": len(items), "tile_period_ns": period, "item_end_ns": end,
            "item_end_periods": round(end / period, 2),
            "phases_ns": [(name, statistics.median(v)) for (i, name), v in sorted(phases.items())
                          if len(v) >= len(ends) // 2]}
    return out


def items(args) -> int:
    for path in args.trace:
        print(path)
        for wg, entry in item_ends(load_ranges(path)[1]).items():
            print(f"  {wg}: {entry['items']} items, tile period {entry['tile_period_ns']:.0f} "
                  f"ns, item end {entry['item_end_ns']:.0f} ns "
                  f"({entry['item_end_periods']} periods):")
            print("    " + ", ".join(f"{name} {ns:.0f}" for name, ns in entry["phases_ns"]))
    return 0


def stats(args) -> int:
    out = {}
    for path in args.trace:
        kernel, rows = load_ranges(path)
        out[os.path.basename(path)] = {"kernel": kernel, "phases": phase_stats(rows)}
    print(json.dumps(out, indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("record", "workload"):
        p = sub.add_parser(name)
        p.add_argument("kernel")
        p.add_argument("--batch", type=int, default=4)
        p.add_argument("--heads", type=int, default=16)
        p.add_argument("--seqlen", type=int, default=4096)
        p.add_argument("--head-dim", type=int, default=128)
        p.add_argument("--causal", action="store_true")
        p.add_argument("--window-left", type=int, default=-1,
                       help="a sliding window's left size (forward stages; -1: none)")
        if name == "record":
            p.add_argument("--out", required=True)
            p.add_argument("--cta", type=int, default=7, help="blockIdx.x of the CTA to record")
        else:
            p.add_argument("--cost-json", required=True)
    p = sub.add_parser("plot", help="one timeline per trace, stacked")
    p.add_argument("trace", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--skip-us", type=float, default=20.0)
    p.add_argument("--window-us", type=float, default=6.0)
    p.add_argument("--titles", default="", help="'|'-separated, one per trace")
    p = sub.add_parser("stats", help="count / mean / total time per warpgroup and phase")
    p.add_argument("trace", nargs="+")
    p = sub.add_parser("items", help="per warpgroup: the tile period and a work item's end")
    p.add_argument("trace", nargs="+")
    args = ap.parse_args(argv)
    return {"record": record, "workload": workload, "plot": plot, "stats": stats,
            "items": items}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
