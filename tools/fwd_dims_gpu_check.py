"""GPU check of k6's forward at head dims 96 and 192 and at (d, dv) = (192, 128) (issues 63
and 61): POLICY's row and candidate settings, round-robin with FlashAttention-4 and cuDNN.

    python tools/fwd_dims_gpu_check.py [--quick] [--dims 96,192,192x128] [--masks full,causal]
        [--lengths 1024,2048,4096,8192,16384] [--only NAME,...] [--target-ms 200] [--out DIR]
    python tools/fwd_dims_gpu_check.py --compile-only [--dims ...]     (CPU: no GPU needed)

A dim is a head dim (q, k and v) or a pair dxdv, v narrower (`192x128`: DeepSeek MLA's).

--compile-only compiles every row for sm_90a with spills as errors and prints its shared
memory and its steady loop (the longest in the SASS: instructions a thread issues per kv tile
and per key, as compiled, the rare branches' code included).

Each candidate (`CANDIDATES`) is a whole row over k6.BASE, as POLICY's rows are, so that a
winner can be pasted into POLICY as it stands; it may set the columns that are not k6.OPTIONS
(spin_waits, mask_per_row, fast_divmod, stream_k: compiled through FlashAttentionK6 directly).
`policy` is k6.compile_kernel's own choice at each length.

1. Correctness (--quick stops here): every candidate and the POLICY row at B1 H4 N1000
   (the key-length tail) and B2 H16 N2048 (whole 128-key tiles, several items a CTA) against
   the fp32 reference, as ref_check judges it (max error <= 2x torch's bf16 error + 2^-12
   max|ref|, no NaN, the same bits twice, nothing written outside the output).
2. Speed: per (head dim, mask, N), B x 16 heads x N = 256k token-heads (B = 256k / 16 / N),
   bf16, the POLICY row, every candidate that passed, FA4 (flash_attn.cute, where installed)
   and cuDNN (SDPA's CUDNN_ATTENTION backend), all in the same shuffled rounds
   (harness.timing.benchmark_interleaved, L2 flushed). One line per cell: the POLICY row's
   and the best candidate's time as a ratio of the faster baseline's (> 1: k6 faster), with
   the per-round median ratio against FA4.

GPU time (H200), estimated from this box's compiles and the project's d = 96 / 192 runs:
imports ~20 s; 38 k6 kernels compiled once each (0.7-3 s apiece on a shared 2-core CPU, 50 s
for all with --compile-only), ~50 s; correctness ~10 s; FA4's JIT, one kernel per (d, mask),
~20-60 s; timing at --target-ms 200 (each cell's slowest callable sets the rounds: 100 up to
4k, ~55 at 8k, ~28 at 16k) ~20 s for the 20 cells: ~2-3 min in all. Halve it with --dims 96
or --masks causal; --lengths 2048,8192 and --only w112,lf32 cut the timing and compiles.
Prints one line per candidate (correctness), per cell and per (dim, mask) (the three
candidates best against POLICY's row); everything goes to $OUT/fwd_dims.json (or --out).

(192, 128) against FA4, with d = 192's POLICY rows and FA4 in the same kind of rounds
(docs/lab/k6.md "(192, 128) against FA4 in the SASS"; ~4 min on an H200, --quick ~1.5):

    python tools/fwd_dims_gpu_check.py --dims 192x128,192 --lengths 2048,4096,8192,16384 \
        --only d192x128:w112,d192x128:eager_after7,d192x128c:d192c,d192x128c:d192c_eager,\
d192x128c:d192c_eager_after7,d192x128c:d192c_w128_eager,d192x128c:d192c_w128_eager_after7

d = 192's lazy loops without a WGMMA wait under a per-warp vote (docs/lab/k6.md "The lazy
vote per warpgroup"; 2026-11-29_fwd_d192_before_pv: lazy_before_pv with stream-K became
POLICY's row, lazy_wg was not kept), the row against itself without stream-K and after_wait
(~3 min on an H200):

    python tools/fwd_dims_gpu_check.py --dims 192 --lengths 2048,8192,16384 \
        --only d192:no_stream_k,d192:after_wait,d192c:after_wait
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from hopper_attn import k6  # noqa: E402
from hopper_attn.common.contract import Problem, compile_attention  # noqa: E402
from hopper_attn.harness.gpu_check import Log, env_line, write_json  # noqa: E402

TOKEN_HEADS = 256 * 1024
HEADS = 16
LENGTHS = (1024, 2048, 4096, 8192, 16384)
CHECK_SHAPES = ((1, 4, 1000), (2, 16, 2048))        # (batch, heads, seqlen)

# The POLICY rows the candidates start from: d = 96 without a mask from 2k (192 x 96, no
# turns, the one-group PV wait, V before K), d = 96 with one below 4k (128 x 128 with turns)
D96 = dict(k6.policy(Problem(1, 1, 4096, 96, False)))
D96C = dict(k6.policy(Problem(1, 1, 2048, 96, True)))
D64C, D192 = k6.D64C, k6.D192     # d = 64's causal rows' bundle; d = 192's
# d = 192's causal row (POLICY, 2026-11-29_fwd_dims_d192: 1.03-1.07x spins alone); POLICY's
# (192, 128) causal row was D192 + spins only
D192C = dict(k6.policy(Problem(1, 1, 4096, 192, True)))
# eager rescale with the PV wait after n exp2s (d = 128's loop): O's dv / 2 multiplies a
# tile interleaved with the exp2s, as FA4's loop has them, in place of the rounded sums'
# 3 instructions a pair of P; no `needs_rescale` vote, so no WGMMA wait behind one
EAGER_AFTER7 = dict(rescale="eager", pv_wait="after7", v_release_last=True)
# (head dim, causal) -> name -> (row over k6.BASE, why). Registers a consumer thread (fp32
# accumulators): S block_n / 2 + P block_n / 4 + O d / 2, of 160 with three warpgroups (192
# rows) and 240 with two; 192 x 128 at d = 96 (144) and 192 x 112 with pv_wait=after<n>
# spill. Tiles per key: the per-tile work (O's 48 multiplies at d = 96, ring waits,
# branches) is what the d = 96 profile found over FA4's (docs/k6.md, "The profile").
AFTER_WAIT = ("the POLICY row with rescale=lazy_after_wait (windows'): O's lazy rescale "
              "after the PV wait, no WGMMA wait behind a per-warp vote (docs/window.md)")
CANDIDATES = {
    (96, False): {
        "w112": (dict(D96, block_n=112), "14% fewer kv tiles a key; 132 of 160 registers"),
        "w112_turns": (dict(D96, block_n=112, pingpong=True), "w112 with FA4's 3-way turns"),
        "w112_lazy": (dict(D96, block_n=112, rescale="lazy_before_pv"),
                      "w112 without O's 48 multiplies a tile (rounded sums: 84 more; "
                      "measured with \"lazy\", removed since)"),
        "lazy": (dict(D96, rescale="lazy_before_pv"), "O rescaled only where a maximum grew "
                 "by 2^8 (d = 192's lazy_before_pv)"),
        "after4": (dict(D96, pv_wait="after4", v_release_last=True),
                   "PV wait after 4 exp2s (d = 64's causal wait, no turns)"),
        "lags_spin": (dict(D96, v_lags_k=True, spin_waits=True),
                      "V lagging K + spinning waits (paid together on 3 WGs at d = 64)"),
        "turns_lags_spin": (dict(D96, pingpong=True, v_lags_k=True, spin_waits=True,
                                 v_release_last=True), "the same with turns"),
        "d64_first": (dict(D96, pingpong=True, pv_wait="first", v_lags_k=True,
                           spin_waits=True, v_release_last=True),
                      "d = 64's loop: turns, PV wait before the exp2s"),
    },
    (96, True): {
        "lf32": (dict(D96C, longest_first=32), "FA4's LPT order: longest items of 32 MiB of "
                 "heads first (6 MiB a head at 16k)"),
        "turns_after4": (dict(D96C, pv_wait="after4", v_release_last=True, longest_first=32),
                         "PV wait after 4 exp2s with turns (d = 64 causal from 4k)"),
        "d128_row": (dict(block_m=128, block_n=128, item_end="own_buffer_wg",
                          spin_waits=True, fma_exp2_every=16, pv_wait="after7",
                          v_release_last=True, longest_first=8),
                     "d = 128's causal row: 1 exp2 in 16 on the FMA pipe (XU 48% busy)"),
        "c192x96": (dict(D64C, block_n=96, pingpong=True, pv_wait="after4", longest_first=32),
                    "3 WGs (softmax hidden under 2 GEMM pairs), d = 64's causal row"),
        "c192x96_og": (dict(D64C, block_n=96, pingpong=True, pv_wait="one_group",
                            longest_first=32), "3 WGs, turns, the pinned one-group wait"),
        "c192x112_og": (dict(D64C, block_n=112, pingpong=True, pv_wait="one_group",
                             longest_first=32), "the same on 112 keys"),
        "c192x96_wg": (dict(D64C, block_n=96, pv_wait="one_group", wg_causal_limit=True),
                       "3 WGs without turns, each stopping at its own diagonal"),
        "c192x112_wg": (dict(D64C, block_n=112, pv_wait="one_group", wg_causal_limit=True),
                        "the same on 112 keys"),
    },
    (192, False): {
        "no_stream_k": (dict(D192), "the POLICY row without stream-K (the static schedule's "
                        "last rounds whole)"),
        "after_wait": (dict(D192, rescale="lazy_after_wait"), AFTER_WAIT),
        "eager_after7_np": (dict(D192, **EAGER_AFTER7, peel_first=False),
                            "(192, 128)'s eager loop, unpeeled: 0.78-0.82x this row (H200)"),
    },
    # (192, 128): FA4 runs 128 x 128 with and without a mask, eager rescale, PV wait where
    # ptxas puts it (after 10-11 of 66 exp2s); POLICY's rows are d = 192's (docs/lab/k6.md
    # "(192, 128) against FA4 in the SASS")
    ((192, 128), False): {
        "w112": (dict(D192, block_n=112), "d = 192's kv tile (1.03-1.05x 128 x 128 at 4k-16k, "
                 "2026-11-29_dv_speed)"),
        "eager_after7": (dict(D192, block_n=128, **EAGER_AFTER7),
                         "O's 64 multiplies among the exp2s, no rounded sums (96 instructions)"),
    },
    ((192, 128), True): {
        "d192c": (dict(D192C), "d = 192's causal row: each WG to its diagonal, 32 MiB head "
                  "groups longest first, one key limit per row"),
        "d192c_eager_after7": (dict(D192C, **EAGER_AFTER7), "d192c with the eager loop"),
        "d192c_w128_eager_after7": (dict(D192C, block_n=128, **EAGER_AFTER7, peel_first=False),
                                    "FA4's 128 x 128 tile with it (peeled, ptxas serializes "
                                    "every WGMMA)"),
        "d192c_w128_eager": (dict(D192C, block_n=128, rescale="eager"),
                             "FA4's tile, eager, the pinned one-group wait"),
        "d192c_eager": (dict(D192C, rescale="eager"), "d192c eager, the pinned one-group wait"),
    },
    (192, True): {
        "wgl_lf32": (dict(D192, spin_waits=True, wg_causal_limit=True, longest_first=32),
                     "d = 256's causal row from 2k"),
        "wgl_lf32_per_row": (dict(D192, spin_waits=True, wg_causal_limit=True,
                                  longest_first=32, mask_per_row=True), "the three together"),
        "release_last": (dict(D192, spin_waits=True, wg_causal_limit=True, longest_first=32,
                              v_release_last=True), "wgl_lf32 + d = 256's V release"),
        "after_wait": (dict(D192, spin_waits=True, wg_causal_limit=True, longest_first=32,
                            mask_per_row=True, rescale="lazy_after_wait"), AFTER_WAIT),
    },
}


def candidate_settings(problem: Problem, row: dict) -> dict:
    """FlashAttentionK6's arguments for `row` (over k6.BASE) at `problem`: the OPTIONS through
    k6.settings_for (kv_tail="whole" and peel_first resolved as for POLICY's rows), the other
    columns as given (BASE's where the row does not set them)."""
    full = {**k6.BASE, **row}
    tile = f"{full.pop('block_m')}x{full.pop('block_n')}"
    options = {key: value for key, value in full.items() if key in k6.OPTIONS}
    settings = k6.settings_for(problem, tile=tile, **options)
    settings.update({key: value for key, value in full.items() if key not in k6.OPTIONS})
    return settings


class Candidate:
    """A POLICY-like row as a stage entry (compile / run / spec, as harness.registry's)."""

    def __init__(self, name: str, row: dict | None):
        self.name, self.row = name, row
        self.spec = k6.SPEC

    def compile(self, problem: Problem, compile_options: str = ""):
        if self.row is None:
            return k6.compile_kernel(problem, compile_options=compile_options)
        return compile_attention(k6.SPEC, k6.FlashAttentionK6, problem,
                                 candidate_settings(problem, self.row),
                                 workspace_fn=k6.lse_buffer, compile_options=compile_options)

    def run(self, handle, q, k, v, out):
        k6.run_kernel(handle, q, k, v, out)


def dims_of(dim) -> tuple[int, int]:
    """(d, dv) of a dim (a head dim, or a (d, dv) pair); dv 0 where v is d wide."""
    return dim if isinstance(dim, tuple) else (dim, 0)


def dim_name(dim) -> str:
    d, dv = dims_of(dim)
    return f"d{d}x{dv}" if dv else f"d{d}"


def make_problem(batch: int, heads: int, n: int, dim, causal: bool) -> Problem:
    d, dv = dims_of(dim)
    return Problem(batch, heads, n, d, causal, head_dim_v=dv)


def candidates(d, causal: bool, only=None) -> list:
    prefix = f"{dim_name(d)}{'c' if causal else ''}"
    named = [Candidate("policy", None)] + [Candidate(f"{prefix}:{name}", row) for name, (row, _)
                                           in CANDIDATES[(d, causal)].items()]
    return [c for c in named if c.name == "policy" or not only
            or c.name.split(":")[1] in only or c.name in only]


def cells(args):
    for d in args.dims:
        for causal in args.masks:
            yield d, causal


# ----------------------------------------------------------------------- compile only (CPU)

def compile_only(args, log) -> list:
    """Each candidate compiled for sm_90a at every length asked for (kv_tail resolves per
    length), spills as errors: registers, SMEM, seconds."""
    from hopper_attn.harness.compile_report import compile_artifacts, resource_usage, sass
    from hopper_attn.harness.sass_order import loop_body, loops
    rows = []
    for d, causal in cells(args):
        for cand in candidates(d, causal, args.only):
            seen = {}
            for n in args.lengths:
                problem = make_problem(2, 2, n, d, causal)
                settings = k6.settings_for(problem) if cand.row is None else \
                    candidate_settings(problem, cand.row)
                key = repr(sorted(settings.items()))
                if key in seen:
                    continue
                art = compile_artifacts(cand, dims_of(d)[0], causal, seqlen=n,
                                        head_dim_v=dims_of(d)[1])
                row = {"name": cand.name, "head_dim": d, "causal": causal, "seqlen": n,
                       "ok": art["ok"], "spills": art["spills"],
                       "compile_s": round(art["compile_s"], 2)}
                if art["ok"]:
                    usage = resource_usage(art["cubin"])
                    # the steady loop (the longest): instructions a thread issues per kv
                    # tile, and per key (a warpgroup's 64 rows, whatever block_m is)
                    text = sass(art["cubin"])
                    body = loop_body(text, max(loops(text), key=lambda lp: lp[1] - lp[0]))
                    row.update(registers=max(u["registers"] for u in usage),
                               local_bytes=max(u["local"] for u in usage),
                               smem_bytes=art["kernel"].get("smem_bytes"),
                               loop_instructions=len(body),
                               per_key=len(body) / settings["block_n"],
                               fmul=sum("FMUL" in ln for ln in body),
                               branches=sum(" BRA" in ln for ln in body),
                               # 2 a tile (QK, PV); more: ptxas serialized WGMMAs
                               wgmma_groups=sum("WARPGROUP.ARRIVE" in ln for ln in body))
                else:
                    row["error"] = art["error"]
                seen[key] = row
                rows.append(row)
                log(f"  {cand.name:22} N{n:<6} " + (
                    f"ok  smem {row['smem_bytes'] / 1024:.0f} KiB, loop {row['loop_instructions']}"
                    f" a tile ({row['per_key']:.2f} a key, {row['fmul']} FMUL, "
                    f"{row['branches']} BRA, {row['wgmma_groups']} WGMMA groups), "
                    f"{row['compile_s']:.1f} s"
                    if art["ok"] else f"FAIL {'spills' if art['spills'] else row['error'][:90]}"))
    return rows


# ----------------------------------------------------------------------- correctness (GPU)

def correctness(args, log) -> tuple[list, set]:
    from hopper_attn.harness.checks import ReferenceCase
    rows, failed = [], set()
    for d, causal in cells(args):
        cases = [ReferenceCase(make_problem(b, h, n, d, causal), seed=b * n + sum(dims_of(d)))
                 for b, h, n in CHECK_SHAPES]
        for cand in candidates(d, causal, args.only):
            worst, ok, note = 0.0, True, ""
            for case in cases:
                try:
                    verdict = case.check(cand, cand.compile(case.problem))
                except Exception as exc:  # noqa: BLE001 - recorded; the others still run
                    verdict = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
                    note = verdict["error"][:80]
                rows.append({"name": cand.name, "head_dim": d, "causal": causal,
                             "shape": list(case.problem.shape), **verdict})
                ok = ok and verdict["ok"]
                worst = max(worst, verdict.get("error_ratio", float("inf")))
            if not ok:
                failed.add(cand.name)
            log(f"  {dim_name(d):<5} {'causal' if causal else 'full  '} {cand.name:22} worst error "
                f"{worst:.2f}x torch's  {'PASS' if ok else 'FAIL'} {note}")
        del cases
        torch.cuda.empty_cache()
    return rows, failed


# ----------------------------------------------------------------------------- speed (GPU)

def _baselines(log) -> dict:
    from hopper_attn.harness.baselines import _sdpa, fa4
    made = {}
    for name, make in (("fa4", fa4), ("cudnn", lambda: _sdpa("CUDNN_ATTENTION"))):
        try:
            made[name] = make()
        except Exception as exc:  # noqa: BLE001 - FA4 not installed: recorded
            log(f"  {name} unavailable: {type(exc).__name__}: {str(exc)[:80]}")
    return made


def speed(args, log, failed: set) -> list:
    from hopper_attn.harness.inputs import make_inputs
    from hopper_attn.harness.timing import L2Flush, benchmark_interleaved, round_ratios
    baselines, flush, rows = _baselines(log), L2Flush(), []
    for d, causal in cells(args):
        for n in args.lengths:
            batch = max(1, TOKEN_HEADS // (args.heads * n))
            problem = make_problem(batch, args.heads, n, d, causal)
            q, k, v, out = make_inputs(problem, seed=n + sum(dims_of(d)))
            calls, notes = {}, {}
            for cand in candidates(d, causal, args.only):
                if cand.name in failed:
                    continue
                try:
                    handle = cand.compile(problem)
                    calls[cand.name] = (lambda h=handle: k6.run_kernel(h, q, k, v, out))
                except Exception as exc:  # noqa: BLE001 - e.g. a row this length refuses
                    notes[cand.name] = f"{type(exc).__name__}: {str(exc)[:120]}"
            for name, run in baselines.items():
                calls[name] = (lambda r=run: r(q, k, v, causal))
                try:
                    calls[name]()
                except Exception as exc:  # noqa: BLE001
                    notes[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
                    del calls[name]
            timed = benchmark_interleaved(calls, flush, target_ms=args.target_ms)
            row = {"head_dim": d, "causal": causal, "batch": batch, "heads": args.heads,
                   "seqlen": n, "flops": problem.flops, "unavailable": notes,
                   "ms": {name: t["ms"] for name, t in timed.items()}, "timed": timed}
            base_names = [b for b in ("fa4", "cudnn") if b in timed]
            ours = [c for c in timed if c not in baselines]
            if base_names and ours:
                faster = min(base_names, key=lambda b: timed[b]["ms"])
                row["vs_faster_baseline"] = {c: timed[faster]["ms"] / timed[c]["ms"]
                                             for c in ours}
                if "fa4" in timed:
                    row["vs_fa4_rounds"] = {c: round_ratios(timed["fa4"], timed[c])
                                            for c in ours}
                best = max((c for c in ours if c != "policy"),
                           key=lambda c: row["vs_faster_baseline"][c], default="policy")
                ratio = row["vs_faster_baseline"]
                fa4_round = row.get("vs_fa4_rounds", {}).get(best) or {}
                log(f"  {dim_name(d):<5} {'causal' if causal else 'full  '} B{batch:<3} N{n:<6} "
                    f"/{faster}: policy {ratio.get('policy', float('nan')):.3f}, best "
                    f"{best.split(':')[-1]} {ratio[best]:.3f} (x fa4 per round "
                    f"{fa4_round.get('ratio', float('nan')):.3f}); fa4 "
                    f"{timed.get('fa4', {}).get('ms', float('nan')):.3f} ms cudnn "
                    f"{timed.get('cudnn', {}).get('ms', float('nan')):.3f} ms"
                    + (f"; {len(notes)} unavailable" if notes else ""))
            rows.append(row)
            del q, k, v, out, calls
            torch.cuda.empty_cache()
        _summary(log, d, causal, [r for r in rows if (r["head_dim"], r["causal"]) == (d, causal)])
    return rows


def _summary(log, d, causal, rows) -> None:
    """One line per (head dim, mask): the three candidates fastest against the POLICY row
    over the lengths timed (geometric mean of policy's time / theirs), with the per-length
    values."""
    ours = [c for c in (rows[0]["ms"] if rows else {}) if ":" in c]
    if not rows or not ours or any("policy" not in r["ms"] for r in rows):
        return
    gains = {}
    for c in ours:
        per = [r["ms"]["policy"] / r["ms"][c] for r in rows if c in r["ms"]]
        gains[c] = (math.prod(per) ** (1 / len(per)), per)
    top = sorted(gains, key=lambda c: -gains[c][0])[:3]
    log(f"  {dim_name(d):<5} {'causal' if causal else 'full  '} policy / candidate over "
        f"{'/'.join(str(r['seqlen'] // 1024) + 'k' for r in rows)}: " + "; ".join(
            f"{c.split(':')[-1]} {gains[c][0]:.3f} ("
            + " ".join(f"{x:.3f}" for x in gains[c][1]) + ")" for c in top))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="correctness only")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile every candidate for sm_90a (CPU), spills as errors")
    parser.add_argument("--dims", default="96,192")
    parser.add_argument("--masks", default="full,causal")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--only", default="", help="candidate names (the policy row always runs)")
    parser.add_argument("--heads", type=int, default=HEADS)
    parser.add_argument("--target-ms", type=float, default=200.0,
                        help="timing budget per callable and cell (benchmark_interleaved)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    args.dims = [tuple(int(y) for y in x.split("x")) if "x" in x else int(x)
                 for x in args.dims.split(",")]
    masks = {"full": False, "causal": True}
    args.masks = [masks[m] for m in args.masks.split(",")]
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.only = {x for x in args.only.split(",") if x}
    for d, causal in cells(args):
        if (d, causal) not in CANDIDATES:
            parser.error(f"no candidates for {dim_name(d)}")
    known = {name for rows in CANDIDATES.values() for name in rows}
    known |= {f"{dim_name(d)}{'c' if c else ''}:{name}" for (d, c), rows in CANDIDATES.items()
              for name in rows}
    if args.only - known:
        parser.error(f"unknown candidates {sorted(args.only - known)}")
    log, t0 = Log(), time.time()
    result = {"argv": sys.argv[1:], "candidates": {
        f"{dim_name(d)}{'c' if c else ''}": {name: {"row": row, "why": why}
                                    for name, (row, why) in rows.items()}
        for (d, c), rows in CANDIDATES.items()}}
    if args.compile_only:
        result["compiled"] = compile_only(args, log)
        ok = all(r["ok"] for r in result["compiled"])
    else:
        from hopper_attn.harness.env import environment
        result["env"] = environment()
        log(env_line(result["env"]))
        log("correctness (error as a multiple of torch's bf16 error; <= 2 passes):")
        result["correctness"], failed = correctness(args, log)
        ok = not failed
        log(f"correctness: {'ALL PASS' if ok else 'FAILED: ' + ', '.join(sorted(failed))} "
            f"({time.time() - t0:.0f} s)")
        if not args.quick:
            log(f"speed, {TOKEN_HEADS // 1024}k token-heads, {args.heads} heads, bf16: time "
                f"of the faster baseline / ours (> 1: k6 faster), policy and best candidate:")
            try:
                result["speed"] = speed(args, log, failed)
            except Exception as exc:  # noqa: BLE001 - keep the correctness results
                log(f"  speed failed: {type(exc).__name__}: {str(exc)[:160]}")
                result["speed_error"] = repr(exc)
    result["printed"] = log.lines
    path = write_json(result, "fwd_dims.json", args.out)
    print(f"wrote {path} ({time.time() - t0:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
