"""Regenerate the results tables and plots in README.md and docs/ from results/.

    python -m hopper_attn.harness.report            # rewrite generated blocks and plots in place
    python -m hopper_attn.harness.report --check    # exit 1 if a generated block is out of date

Inputs (all committed): results/<gpu>/*_bench_*.json (bench.py --json), the k4 tile and k3
structure sweeps, ref_check JSON, and Nsight Compute raw CSVs (results/<gpu>/profiles/). A
JSON named `X.json` here and in the tables is read from `X.json.xz` where that is what is
committed (results/README.md).
Outputs: the text between `<!-- BEGIN GENERATED: name -->` and `<!-- END GENERATED -->`
markers in README.md and docs/*.md, and PNG plots in docs/img/. Nothing in those blocks is
typed by hand; every number there comes from one of the files named in the block.
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import lzma
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STAGES = ["k1", "k2", "k3_1", "k3_2", "k3_3", "k4_qk", "k4", "k5", "k6"]
BACKWARD_STAGES = ["kb1", "kb2"]          # results/<gpu>/*_backward_*.json
BASELINES = ["sdpa_flash", "sdpa_cudnn", "fa4"]
BASELINE_LABEL = {"sdpa_flash": "SDPA flash", "sdpa_cudnn": "SDPA cuDNN", "fa4": "FA4 (CuTe)",
                  "fa4_no_overlap": "FA4 without overlap", "cudnn_fp8": "cuDNN FP8"}
FP8_STAGES = ["k7", "k8"]                 # results/<gpu>/*_fp8_*.json
MARK = re.compile(r"(<!-- BEGIN GENERATED: (?P<name>[\w:.-]+) -->\n)(?P<body>.*?)(<!-- END GENERATED -->)",
                  re.S)


# ------------------------------------------------------------------------------- loading
def _load(path):
    """A results JSON; `X.json` is read from `X.json.xz` where only that is committed."""
    if not os.path.exists(path) and os.path.exists(path + ".xz"):
        with lzma.open(path + ".xz", "rt") as f:
            return json.load(f)
    with open(path) as f:
        return json.load(f)


def _glob(folder, pattern):
    """The results JSON matching `pattern`, each by its uncompressed name (`X.json` also
    where `X.json.xz` is what is committed: results/README.md), sorted."""
    found = set(glob.glob(os.path.join(folder, pattern)))
    found |= {p[:-3] for p in glob.glob(os.path.join(folder, pattern + ".xz"))}
    return sorted(found)


def _key(cfg):
    return (cfg["head_dim"], cfg["causal"], cfg["seqlen"], cfg["batch"], cfg["heads"])


class Results:
    """The bench rows of one GPU folder; for each (kernel, config) the newest row wins."""

    def __init__(self, folder, pattern="*_bench_*.json"):
        self.folder = folder
        self.gpu = os.path.basename(folder)
        self.files = _glob(folder, pattern)
        self.rows = {}          # (kernel, key) -> (row, file, env)
        self.baselines = {}     # (baseline, key) -> (row, file, env)
        for path in self.files:
            data = _load(path)
            env = data["env"]
            for row in data["rows"]:
                if row.get("skipped") or row.get("error"):
                    continue
                target = self.baselines if row["baseline"] else self.rows
                k = (row["kernel"], _key(row["config"]))
                if k not in target or target[k][2]["date_utc"] <= env["date_utc"]:
                    target[k] = (row, os.path.relpath(path, ROOT), env)

    def gpu_name(self):
        envs = [e for (_, _, e) in self.rows.values()]
        return envs[0]["gpu"] if envs else self.gpu

    def configs(self, head_dim=None, causal=None):
        keys = sorted({k for (_, k) in self.rows})
        return [k for k in keys if (head_dim is None or k[0] == head_dim)
                and (causal is None or k[1] == causal)]

    def get(self, kernel, key):
        return self.rows.get((kernel, key))

    def sources(self, kernels):
        return sorted({f for (kname, _), (_, f, _) in self.rows.items() if kname in kernels})

    def dates(self, kernels):
        return sorted({e["date_utc"][:10] for (kname, _), (_, _, e) in self.rows.items()
                       if kname in kernels})


def _cfg(key):
    d, causal, n, b, h = key
    return f"B{b} H{h} N{n} d{d} {'causal' if causal else 'full'}"


def _fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


# ------------------------------------------------------------------------------- tables
HEAD_DIMS = (64, 128, 256)        # the default sweep's (d = 256: k6 and the baselines only)


def stage_table(res: Results, kernels, head_dims=HEAD_DIMS, causals=(False, True)) -> str:
    """TFLOP/s of `kernels` over the sweep, with the same-run ratios to each baseline."""
    lines = [f"| config | kernel | ms | TFLOP/s | vs {' | vs '.join(BASELINE_LABEL[b] for b in BASELINES)} |",
             "|---|---|---:|---:|" + "---:|" * len(BASELINES)]
    for d in head_dims:
        for causal in causals:
            for key in res.configs(d, causal):
                for kname in kernels:
                    got = res.get(kname, key)
                    if not got:
                        continue
                    row = got[0]
                    ratios = " | ".join(_fmt(row.get("ratios", {}).get(b), 2) for b in BASELINES)
                    lines.append(f"| {_cfg(key)} | {kname} | {row['ms']:.3f} | {row['tflops']:.1f} | {ratios} |")
    return "\n".join(lines)


def provenance(res: Results, kernels) -> str:
    files = ", ".join(f"`{f}`" for f in res.sources(kernels))
    return (f"Measured on {res.gpu_name()} ({', '.join(res.dates(kernels))}); ratios are to "
            f"baselines timed in the same run (>1 = faster). Source: {files}.")


def summary_table(res: Results, n: int = 4096, stages=None, what: str = "",
                  head_dims=(128, 64, 256)) -> str:
    """README: every stage measured at N = n, per head dim (those with a config at n),
    full and causal, one row per kernel."""
    stages = STAGES if stages is None else stages
    # the config at N = n of each (head dim, mask) measured there
    cols = {(d, c): keys[0] for d in head_dims for c in (False, True)
            if (keys := [k for k in res.configs(d, c) if k[2] == n])}
    head = " | ".join(f"d={d} {'causal' if c else 'full'}" for d, c in cols)
    lines = [f"| kernel | {head} |", "|---|" + "---:|" * len(cols)]
    for kname in stages:
        if not any(res.get(kname, key) for key in cols.values()):
            continue                            # a stage not run on this GPU
        cells = []
        for key in cols.values():
            got = res.get(kname, key)
            if not got:
                cells.append("-")
                continue
            row, r = got[0], got[0].get("ratios", {})
            cells.append(f"{row['tflops']:.1f} &middot; {_fmt(r.get('sdpa_flash'), 2)}x / "
                         f"{_fmt(r.get('sdpa_cudnn'), 2)}x / {_fmt(r.get('fa4'), 2)}x")
        lines.append(f"| {kname} | " + " | ".join(cells) + " |")
    return ("\n".join(lines) + f"\n\nCells: {what}TFLOP/s at N = {n} (B = {16384 // n}, "
            "H = 2048 / d) &middot; speed relative to SDPA FLASH / SDPA cuDNN / "
            f"FlashAttention-4{' (their backward passes)' if what else ''}, measured in the "
            "same run (> 1 = faster). " + provenance(res, stages))


def compile_table(res: Results) -> str:
    lines = ["| kernel | d | mask | JIT compile, s |", "|---|---:|---|---:|"]
    for kname in STAGES:
        for (kn, key), (row, _, _) in sorted(res.rows.items()):
            if kn == kname and row.get("compile_s"):
                lines.append(f"| {kname} | {key[0]} | {'causal' if key[1] else 'full'} | {row['compile_s']:.1f} |")
    return "\n".join(lines) + "\n\nFirst call per configuration in the bench runs (cached afterwards). " \
        + provenance(res, STAGES)


def sweep_table(path, title_filter=None, row_filter=None) -> str:
    """A small sweep file (tile sizes, structure): every row at its configs."""
    data = _load(os.path.join(ROOT, path))
    env = data["env"]
    names = [b for b in BASELINE_LABEL if any(r["kernel"] == b for r in data["rows"])]
    lines = [f"| config | variant | ms | TFLOP/s | vs {' | vs '.join(BASELINE_LABEL[b] for b in names)} |",
             "|---|---|---:|---:|" + "---:|" * len(names)]
    for row in data["rows"]:
        if row["baseline"] or row.get("skipped") or row.get("error"):
            continue
        if title_filter and not title_filter(row["kernel"]):
            continue
        if row_filter and not row_filter(row):
            continue
        ratios = " | ".join(_fmt(row.get("ratios", {}).get(b), 2) for b in names)
        label = row["kernel"]
        opts = row.get("kernel_config", {})
        if opts.get("block_m"):
            label += f" ({opts.get('block_m')} x {opts.get('block_n')}, {opts.get('stages', '-')} stages)"
        lines.append(f"| {_cfg(_key(row['config']))} | {label} | {row['ms']:.3f} | {row['tflops']:.1f} | {ratios} |")
    return "\n".join(lines) + f"\n\nMeasured on {env['gpu']} ({env['date_utc'][:10]}). Source: `{path}`."


def ref_check_table(paths) -> str:
    lines = ["| kernel | cases | passed | worst error / torch bf16 error | worst max abs error |",
             "|---|---:|---:|---:|---:|"]
    # every case (kernel, problem, input scale) counts once, with its newest result: a quick
    # run after a change updates its cases, the full sweep before it still covers the rest
    newest = {}                 # case -> (date, row, path, env)
    for path in paths:
        data = _load(os.path.join(ROOT, path))
        for r in data["rows"]:
            if r.get("skipped"):
                continue
            case = (r["kernel"], json.dumps(r["config"], sort_keys=True), r.get("input_scale"))
            if case not in newest or newest[case][0] <= data["env"]["date_utc"]:
                newest[case] = (data["env"]["date_utc"], r, path, data["env"])
    used = []
    for k in STAGES + FP8_STAGES + BACKWARD_STAGES:
        cases = [v for (kname, _, _), v in newest.items() if kname == k]
        if not cases:
            continue
        rows = [row for _, row, _, _ in cases]
        used += [(path, env) for _, _, path, env in cases]
        ok = sum(1 for r in rows if r.get("ok"))
        worst = max(r.get("error_ratio", 0.0) for r in rows)
        # backward rows: one verdict per gradient (dq, dk, dv)
        worst_abs = max(max([r.get("max_abs", 0.0)] + [r[g]["max_abs"] for g in ("dq", "dk", "dv")
                                                       if isinstance(r.get(g), dict)])
                        for r in rows)
        label = f"{k} (FP8: / its emulation's error)" if k in FP8_STAGES else k
        lines.append(f"| {label} | {len(rows)} | {ok} | {worst:.2f} | {worst_abs:.2e} |")
    srcs = ", ".join(f"`{p}`" for p in sorted({p for p, _ in used}))
    dates = ", ".join(sorted({e["date_utc"][:10] for _, e in used}))
    gpu = used[0][1]["gpu"] if used else "-"
    return "\n".join(lines) + (f"\n\nMeasured on {gpu} ({dates}); each case counts once, with "
                               f"its newest result. Source: {srcs}.")


def fp8_table(path, bf16_stage="k6") -> str:
    """k7 against cuDNN's FP8 attention, cuDNN bf16 (SDPA) and the fastest bf16 stage, all
    from one bench.py run with CHECK=1, with each FP8 kernel's error on the same inputs (max
    abs error against the fp32 reference on its own dequantized inputs, and end to end
    against the bf16 inputs; |O| <= the max |V|)."""
    data = _load(os.path.join(ROOT, path))
    env = data["env"]
    by_cfg = {}
    for r in data["rows"]:
        if "ms" in r:
            by_cfg.setdefault(_key(r["config"]), {})[r["kernel"]] = r
    lines = ["| config | kernel | TFLOP/s | vs cuDNN FP8 | vs cuDNN bf16 | vs " + bf16_stage +
             " (bf16) | cuDNN FP8 TFLOP/s | error: own / end to end | cuDNN FP8 error: "
             "own / end to end |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    variants = sorted({r["kernel"] for r in data["rows"] if r["kernel"].startswith("k7")},
                      key=lambda k: (k != "k7", len(k), k))
    # (k8 runs k7's kernel on rotated inputs: its time is k7's within noise, see docs/k8.md)

    def err(row):
        c = row.get("check")
        if not c:
            return "-"
        return f"{c['max_abs']:.3f} / {c.get('end_to_end', {}).get('max_abs', float('nan')):.3f}"

    for key, rows in by_cfg.items():
        fp8, bf16 = rows.get("cudnn_fp8"), rows.get(bf16_stage)
        for name in variants:
            k7 = rows.get(name)
            if not k7:
                continue
            vs = [fp8["ms"] / k7["ms"] if fp8 else None,
                  rows["sdpa_cudnn"]["ms"] / k7["ms"] if "sdpa_cudnn" in rows else None,
                  bf16["ms"] / k7["ms"] if bf16 else None]
            lines.append(f"| {_cfg(key)} | {name} | {k7['tflops']:.1f} | "
                         + " | ".join(_fmt(x, 2) for x in vs)
                         + f" | {_fmt(fp8['tflops'] if fp8 else None)} | {err(k7)} | "
                         f"{err(fp8) if fp8 else '-'} |")
    return "\n".join(lines) + (f"\n\nMeasured on {env['gpu']} ({env['date_utc'][:10]}, cuDNN "
                               f"{env.get('cudnn', '?')}). Source: `{path}`.")


def fp8_summary(path, n: int = 16384, bf16_stage: str = "k6") -> str:
    """README: k7 at one sequence length per head dim and mask, against cuDNN FP8, cuDNN bf16
    and the fastest bf16 stage of the same run."""
    data = _load(os.path.join(ROOT, path))
    rows = {}
    for r in data["rows"]:
        c = r["config"]
        if "ms" in r and c["seqlen"] == n:
            rows[(c["head_dim"], c["causal"], r["kernel"])] = r
    dims = sorted({d for d, _, _ in rows})
    lines = ["| kernel | " + " | ".join(f"d={d} {'causal' if c else 'full'}"
                                       for d in dims for c in (False, True)) + " |",
             "|---|" + "---:|" * (2 * len(dims))]
    variants = sorted({k for _, _, k in rows if k.startswith("k7")},
                      key=lambda k: (k != "k7", len(k), k))
    for name in variants:
        cells = []
        for d in dims:
            for c in (False, True):
                k7 = rows.get((d, c, name))
                if not k7:
                    cells.append("-")
                    continue
                vs = [rows[(d, c, b)]["ms"] / k7["ms"] if (d, c, b) in rows else None
                      for b in ("cudnn_fp8", "sdpa_cudnn", bf16_stage)]
                cells.append(f"{k7['tflops']:.1f} &middot; " + " / ".join(
                    f"{x:.2f}x" if x else "-" for x in vs))
        lines.append(f"| {name} (FP8) | " + " | ".join(cells) + " |")
    env = data["env"]
    return "\n".join(lines) + (
        f"\n\nCells: TFLOP/s at N = {n} (hidden 2048) &middot; speed relative to cuDNN's FP8 "
        f"attention / cuDNN bf16 (SDPA) / {bf16_stage} (bf16), measured in the same run "
        f"(> 1 = faster). Measured on {env['gpu']} ({env['date_utc'][:10]}). Source: `{path}`.")


def fp8_error_table(path) -> str:
    """fp8_error.py's rows: RMS error relative to the reference's RMS, and max abs error, end
    to end (input quantization included), per head dim, mask and outlier factor."""
    data = _load(os.path.join(ROOT, path))
    methods = [("torch_bf16", "torch bf16"), ("k7", "k7"), ("k8", "k8 (rotated)"),
               ("k7:out_fp8=1", "k7, e4m3 output"), ("cudnn_fp8", "cuDNN FP8 (e4m3 output)")]
    methods = [(m, label) for m, label in methods if any(m in r for r in data["rows"])]
    lines = ["| d | mask | outlier channels | " + " | ".join(label for _, label in methods)
             + " |", "|---:|---|---:|" + "---:|" * len(methods)]
    for r in data["rows"]:
        cells = [f"{r[m]['rms_rel']:.3f} / {r[m]['max_abs']:.2f}" if m in r else "-"
                 for m, _ in methods]
        factor = "none" if r["factor"] == 1 else f"{r['factor']:g}x"
        lines.append(f"| {r['head_dim']} | {'causal' if r['causal'] else 'full'} | {factor} | "
                     + " | ".join(cells) + " |")
    c = data["costs"]
    cfg = c["config"]
    env = data["env"]
    return "\n".join(lines) + (
        f"\n\nCells: RMS error / RMS of the output, then max abs error, against the fp32 "
        f"reference on the bf16 inputs. Input passes at B{cfg['batch']} H{cfg['heads']} "
        f"N{cfg['seqlen']} d{cfg['head_dim']}: quantize {c['k7_prepare_ms']:.2f} ms, rotate + "
        f"quantize {c['k8_prepare_ms']:.2f} ms, the kernel {c['k7_kernel_ms']:.2f} ms. Measured "
        f"on {env['gpu']} ({env['date_utc'][:10]}). Source: `{path}`.")


# ------------------------------------------------------------------------------- profiles
PROFILE_METRICS = [
    ("duration, ms", "gpu__time_duration.sum", 3),
    ("SM throughput, %", "sm__throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("memory throughput, %", "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("DRAM throughput, %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("tensor pipe active, %", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", 1),
    ("FMA pipe active, %", "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active", 1),
    ("achieved occupancy, %", "sm__warps_active.avg.pct_of_peak_sustained_active", 1),
    ("registers / thread", "launch__registers_per_thread", 0),
    ("dynamic SMEM / CTA, KB", "launch__shared_mem_per_block_dynamic", 1),
]
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio")


def load_profile(path):
    """Rows (one per kernel launch) of an ncu --page raw --csv export (.csv or .csv.xz)."""
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(io.StringIO(f.read())))
    header, units, data = rows[0], rows[1], rows[2:]
    scale = {"ns": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "s": 1e3,
             "byte/block": 1e-3, "Kbyte/block": 1.0, "Mbyte/block": 1e3}
    out = []
    for r in data:
        rec = dict(zip(header, r))
        # normalize the units the table uses: durations to ms, shared memory to KB
        for metric in ("gpu__time_duration.sum", "launch__shared_mem_per_block_dynamic"):
            if metric in rec and _num(rec[metric]) is not None:
                unit = units[header.index(metric)]
                rec[metric] = str(_num(rec[metric]) * scale.get(unit, 1.0))
        name = rec.get("Kernel Name", "")
        short = re.sub(r"^kernel_cutlass_", "", name).split("_kernels")[0].split("_hopper_attn")[0]
        if "hopper_attn" not in name and "_kernels" not in name:
            short = "kernel"                     # a baseline's kernel (FA4): one per file
        rec["short"] = short
        out.append(rec)
    return out


def _num(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def profile_table(folder, stages=None) -> str:
    paths = sorted(glob.glob(os.path.join(folder, "profiles", "*_ncu_*.csv*")))
    if stages is not None:
        found = {re.search(r"_ncu_(\w+)\.csv", p).group(1): p for p in paths}
        paths = [found[s] for s in stages if s in found]
    if not paths:
        return "_no profiles committed_"
    cols, stalls = [], []
    for path in paths:
        stage = re.search(r"_ncu_(\w+)\.csv", path).group(1)
        for rec in load_profile(path):
            label = stage if rec["short"] == "kernel" else f"{stage} ({rec['short']})"
            cols.append((label, rec))
            reasons = [(m.group(1), _num(v)) for k, v in rec.items()
                       if (m := STALL.fullmatch(k)) and m.group(1) != "selected" and _num(v)]
            reasons.sort(key=lambda t: -t[1])
            stalls.append(", ".join(f"{n} {v:.2f}" for n, v in reasons[:3]))
    lines = ["| metric | " + " | ".join(c[0] for c in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    threads = [re.search(r"\d+", c[1].get("Block Size", "") or "-") for c in cols]
    lines.append("| threads / CTA | " + " | ".join(t.group() if t else "-" for t in threads) + " |")
    for label, metric, digits in PROFILE_METRICS:
        vals = [_num(c[1].get(metric)) for c in cols]
        lines.append(f"| {label} | " + " | ".join(_fmt(v, digits) for v in vals) + " |")
    lines.append("| top stalls (cycles per issued instruction) | " + " | ".join(stalls) + " |")
    rel = ", ".join(f"`{os.path.relpath(p, ROOT)}`" for p in paths)
    return "\n".join(lines) + (f"\n\nNsight Compute 2025.3 (`--set full`, clocks not locked), "
                               f"B=4 H=16 N=4096 d=128, non-causal. Source: {rel}.")


# ------------------------------------------------------------------------------- plots
def plots(res: Results, img_dir) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(img_dir, exist_ok=True)
    written = []
    styles = {"k1": ":", "k2": "--", "k3_1": "--", "k3_2": "--", "k3_3": "--", "k4_qk": "-.", "k4": "-", "k5": "-", "k6": "-"}
    for d in HEAD_DIMS:
        for causal in (False, True):
            keys = res.configs(d, causal)
            if not keys:
                continue
            fig, ax = plt.subplots(figsize=(7.6, 4.0), dpi=90)
            ns = [k[2] for k in keys]
            for name in BASELINES:
                ys = [res.baselines.get((name, k), (None,))[0] for k in keys]
                if any(ys):
                    ax.plot(ns, [y["tflops"] if y else float("nan") for y in ys], color="0.55",
                            marker="s", ms=3, lw=1,
                            ls={"sdpa_flash": ":", "sdpa_cudnn": "--", "fa4": "-"}[name],
                            label=BASELINE_LABEL[name])
            for kname in STAGES:
                ys = [res.get(kname, k) for k in keys]
                if any(ys):
                    ax.plot(ns, [y[0]["tflops"] if y else float("nan") for y in ys],
                            ls=styles[kname], marker="o", ms=3, label=kname)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(ns, [str(n) for n in ns])
            ax.set_xlabel("sequence length N (batch = 16384 / N, heads = 2048 / d)")
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"{res.gpu_name()}, d = {d}, {'causal' if causal else 'non-causal'}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
            fig.tight_layout()
            path = os.path.join(img_dir, f"{res.gpu}_tflops_d{d}_{'causal' if causal else 'full'}.png")
            fig.savefig(path)
            plt.close(fig)
            written.append(path)
    return written


# ------------------------------------------------------------------------------- blocks
def blocks(folder) -> dict:
    res = Results(folder)
    g = res.gpu
    out = {
        f"summary:{g}": summary_table(res),
        f"compile:{g}": compile_table(res),
        f"profiles:{g}": profile_table(folder, ["k1", "k2", "k3_3", "k4_qk", "k4", "k5", "k6", "fa4"]),
        f"results:{g}": stage_table(res, STAGES) + "\n\n" + provenance(res, STAGES),
    }
    for stage, kernels in {"k1": ["k1", "k2"], "k2": ["k2"], "k3": ["k2", "k3_1", "k3_2", "k3_3"],
                           "k4_qk": ["k3_3", "k4_qk"], "k4": ["k4"], "k5": ["k4", "k5"], "k6": ["k5", "k6"]}.items():
        out[f"stage:{stage}:{g}"] = stage_table(res, kernels) + "\n\n" + provenance(res, kernels)
    backward = Results(folder, "*_backward_*.json")      # bench.py kb1 ... (backward stages)
    if backward.files:
        out[f"backward:{g}"] = (stage_table(backward, BACKWARD_STAGES, head_dims=(64, 128))
                                + "\n\n" + provenance(backward, BACKWARD_STAGES))
        out[f"profile:backward:{g}"] = profile_table(folder, ["kb2", "fa4_bwd"])
        out[f"summary-backward:{g}"] = summary_table(
            backward, stages=BACKWARD_STAGES, what="backward (10 B H N^2 d FLOPs, half causal) ",
            head_dims=(128, 64))
    for stage, profiled in {"k1": ["k1"], "k2": ["k1", "k2"], "k3": ["k2", "k3_3"],
                            "k4_qk": ["k3_3", "k4_qk"], "k4": ["k3_3", "k4_qk", "k4"],
                            "k5": ["k4", "k5", "fa4"],
                            "k5-ceiling": ["k5", "fa4_no_overlap", "fa4"]}.items():
        out[f"profile:{stage}:{g}"] = profile_table(folder, profiled)
    return {**out, **measured_blocks(folder, g)}


def measured_blocks(folder, g) -> dict:
    """The blocks of a GPU's folder that need no bf16 sweep (`*_bench_*.json`): named
    sweeps, FP8, FP8 error, ref_check, plots."""
    out = {}
    sweeps = {"k4_tiles_d128": None, "k4_tiles_d64": None, "k4_tiles_causal_d128": None,
              "k3_structure": None, "scalar_unroll": None, "k6_tiles_d64": None,
              "kb2_variants": None, "kb2_deterministic": None, "kb2_cuts": None,
              "kb2_ab": lambda r: r["config"]["seqlen"] in (4096, 16384),
              "fwd_uniform_descriptors": lambda r: r["config"]["seqlen"] in (4096, 16384),
              "k7_variants": None, "k7_variants_batch": None, "k7_exp2_fma": None,
              "k7_block_n": None, "k7_d64_stages": None, "k7_direct_store": None,
              "k6_wait_pv_late": None, "k7_lazy_rescale": None,
              "k7_v_transposed_tiles": None, "k7_tiles_v_packed": None,
              "k6_v_lags_k_own_o_d128": None, "k6_v_lags_k_own_o_d64": None,
              "k6_v_lags_k_own_o_d64_causal": None, "k6_v_lags_k_own_o_d96": None,
              "k6_v_lags_k_d192_256": None, "k7_v_lags_k": None,
              "kb2_tiles_d128": None, "kb2_tiles_d128_stmatrix": None,
              "kb2_tiles_d64_defaults": None, "k6_ablate_d128": None,
              "bench_k5_v_lags_k_spin": None, "k6_quad_max_stmatrix_o": None,
              "kb2_ds_address_per_tile": None, "kb2_prologue_causal": None,
              "kb2_split_dv_causal": None, "kb2_longest_first_causal": None,
              "k7_rescale_before_pv_d256_confirm": None, "k6_item_end_confirm": None,
              "k7_item_end_confirm": None,
              "k6_fa4": None, "k6_fa4_long_causal": None, "fp8_interleaved": None,
              "k6_d64_ab": None, "k6_d64_causal_ab": None,
              "k6_d64_causal_turns_pv_wait_after": None, "k6_d64_causal_turns_ab_4k": None,
              "k6_d64_causal_turns_ab_long": None, "k6_fa4_end": None,
              "k6_fa4_end_long_causal": None, "k6_d256_lazy_round_lengths": None,
              "k6_fa4_final": None, "k6_closing": None, "k7_s_f16_closing": None,
              "k7_row_sums_d128": None, "k7_row_sums_d128_causal": None,
              "k7_row_sums_d256": None}
    for name, row_filter in sweeps.items():
        hits = _glob(folder, f"*_{name}.json")
        if hits:
            out[f"sweep:{name}:{g}"] = sweep_table(os.path.relpath(hits[-1], ROOT),
                                                   row_filter=row_filter)
    fp8 = _glob(folder, "*_fp8_k7*.json")
    if fp8:
        out[f"fp8:{g}"] = fp8_table(os.path.relpath(fp8[-1], ROOT))
        out[f"summary-fp8:{g}"] = fp8_summary(os.path.relpath(fp8[-1], ROOT))
    fp8_err = _glob(folder, "*_fp8_error*.json")
    if fp8_err:
        out[f"fp8_error:{g}"] = fp8_error_table(os.path.relpath(fp8_err[-1], ROOT))
    refs = _glob(folder, "*_ref_check*.json")
    if refs:
        out[f"ref_check:{g}"] = ref_check_table([os.path.relpath(p, ROOT) for p in refs])
    out[f"plots:{g}"] = "\n".join(
        f"![{os.path.basename(p)}](img/{os.path.basename(p)})" for p in
        [f"{g}_tflops_d{d}_{c}.png" for d in HEAD_DIMS for c in ("full", "causal")
         if os.path.exists(os.path.join(ROOT, "docs", "img", f"{g}_tflops_d{d}_{c}.png"))])
    out[f"plots-readme:{g}"] = out[f"plots:{g}"].replace("](img/", "](docs/img/")
    return out


def markdown_files(root):
    files = [os.path.join(root, "README.md")]
    files += sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    return [f for f in files if os.path.exists(f)]


def render(root=ROOT, check=False, write_plots=True) -> list[str]:
    """Rewrite generated blocks under `root`; return the files that changed (or would)."""
    generated = {}
    for folder in sorted(glob.glob(os.path.join(ROOT, "results", "*"))):
        if os.path.isdir(folder) and _glob(folder, "*_bench_*.json"):
            generated.update(blocks(folder))
            if write_plots and not check:
                plots(Results(folder), os.path.join(root, "docs", "img"))
        elif os.path.isdir(folder):            # (e.g. an H200 with only FP8 runs so far)
            generated.update(measured_blocks(folder, os.path.basename(folder)))
    changed = []
    for path in markdown_files(root):
        with open(path) as f:
            text = f.read()

        def repl(m):
            name = m.group("name")
            if name not in generated:
                raise ValueError(f"{os.path.relpath(path, root)}: unknown generated block {name!r}")
            return m.group(1) + generated[name].rstrip("\n") + "\n" + m.group(4)

        new = MARK.sub(repl, text)
        if new != text:
            changed.append(os.path.relpath(path, root))
            if not check:
                with open(path, "w") as f:
                    f.write(new)
    return changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="fail if a generated block is stale")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    changed = render(check=args.check, write_plots=not args.no_plots)
    if args.check:
        if changed:
            print("stale generated blocks in: " + ", ".join(changed) + " (run python -m hopper_attn.harness.report)")
            return 1
        print("generated blocks are up to date")
        return 0
    print("updated: " + (", ".join(changed) if changed else "nothing (already up to date)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
