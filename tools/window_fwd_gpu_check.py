"""GPU check of k6's forward variants for sliding windows (issue 61): correctness of each
variant, then its speed against the current default and FA4.

    python tools/window_fwd_gpu_check.py [--quick] [--speed-only] [--masks] [--out DIR]

Variants (k6 options; docs/window.md "Forward"). Without --masks the default only:
  default   the windowed POLICY row as it is (bit masks at d 64 and 128; head by head)
(the schedule's head groups, window_group=4 / 8, measured 1.004-1.012x on 2026-11-29, were
not kept: docs/window.md "The schedule at window 4096"). With --masks, the masked tiles'
variants (as measured on 2026-11-29):
  default   the windowed POLICY row
  bits      window_mask=bits: masked tiles by per-row 32-bit keep masks (R2P); at d = 64
            the causal row at the problem's length (192-row tiles from 768 queries)
  bits_wg   (d = 64) bits without turns, each warpgroup stopping at its own last kv tile
            (pingpong=0, wg_causal_limit=1, pv_wait=free: the causal row's at 768-4096)
  bits_wg_first  bits_wg, each warpgroup also starting at its own rows' first kv tile
            (window_mask=bits_wg_first: on 192 rows a window of 128 leaves one in six unseen)

1. Correctness (each variant through `hopper_attn.attention(..., stage=...)`, or k6_varlen
   directly for packed batches): O and LSE against an fp32 reference with the same window
   (harness/window_reference.py; with sinks the sink as one more softmax column), the bound
   2x the same math's bf16 error + 2^-10 (`ratio` = error / bound, <= 1 passes), the LSE within
   1e-3, rows that see no key 0 (LSE -inf, or the sink). Where a variant runs the default's
   tiles (d = 128) it should also give the default's bits (`same_bits`, reported). Cases:
   d 128 and 64, windows (4095, 0) (127, 0) (3, 0) (0, 0) causal, (256, 256) and (-1, 64)
   without causal, odd lengths, GQA 4/2 and 64/8, cross lengths whose first rows see no key,
   gpt-oss-shaped sinks, and a packed batch (sequences of 1 to ~2k tokens, one empty).
2. Speed (not with --quick): CUDA events, L2 flushed, round-robin medians, forward only:
   window (4095, 0) causal d 128 B1 H16 at N 16k and 64k; the packed 16k lognormal mix
   (seed 16, window (128, 0), attention_varlen's path; --masks only: packed batches keep
   their own order) with and without sinks; gpt-oss dense (64 / 8 heads, d 64, window
   (127, 0), causal) B1 / B4 at N 8k / 16k with and without sinks (without --masks: B1 8k,
   B1 16k, B4 16k with sinks, a control). FA4 where it runs (flash_attn_func /
   flash_attn_varlen_func with window_size=, learnable_sink=), skipped once 180 s (--masks)
   or 300 s have passed (its compiles are slow).

Prints one line per group or shape; everything goes to $OUT/window_fwd.json (or --out).
"""

from __future__ import annotations

import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import hopper_attn  # noqa: E402
from hopper_attn.harness.gpu_check import CaseGroups, run_check  # noqa: E402
from hopper_attn.harness.varlen_reference import (cu_seqlens, gpt_oss_packed,  # noqa: E402
                                                  lognormal_lengths)
from hopper_attn.harness.window_reference import (reference, torch_lowp,  # noqa: E402
                                                   window_inputs, window_mask)

MASKS = "--masks" in sys.argv             # (run_check parses the rest)
if MASKS:
    sys.argv.remove("--masks")
WG = {"pingpong": 0, "wg_causal_limit": 1, "pv_wait": "free"}
OVERRIDES = {"default": {}, "bits": {"window_mask": "bits"},
             "bits_wg": {"window_mask": "bits", **WG},
             "bits_wg_first": {"window_mask": "bits_wg_first", **WG}}
STAGES = {name: "k6" + (":" if o else "") + ",".join(f"{k}={v}" for k, v in o.items())
          for name, o in OVERRIDES.items()}


def variants(d: int) -> list:
    """--masks: at d = 128 (128-row tiles: one warpgroup's rows reach every kv tile of the
    item) the default and bits, at d = 64 all four. Else the default only."""
    if MASKS:
        return ["default", "bits", "bits_wg", "bits_wg_first"] if d == 64 else ["default", "bits"]
    return ["default"]


def _sinks(heads: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed + 1000)
    s = torch.randn(heads, device="cuda", generator=gen) * 2
    s[0] = float("-inf")                              # a head without a sink
    if heads > 1:
        s[1] = 8.0                                    # a sink that dominates its rows
    return s


def _errors(out, lse, q, k, v, left, right, sinks) -> dict:
    """Error, bound and LSE / blind-row checks of one output against the fp32 reference."""
    scale = q.shape[-1] ** -0.5
    ref, ref_lse = reference(q, k, v, left, right, scale, sinks=sinks)
    if sinks is None:
        low, _ = torch_lowp(q, k, v, left, right, scale)
    else:                                  # (SDPA has no sinks: the reference in bf16 steps)
        low, _ = reference(q, k, v, left, right, scale, sinks=sinks, round_to=torch.bfloat16)
    bound = 2 * (low - ref).abs().max().item() + 2 ** -10
    err = (out.float() - ref).abs().max().item()
    finite = ref_lse.isfinite()
    lse_ok = bool(torch.equal(lse.isfinite(), finite)) and (
        not finite.any() or (lse[finite] - ref_lse[finite]).abs().max().item() < 1e-3)
    blind = ~window_mask(q.shape[1], k.shape[1], left, right).any(-1)
    zero_ok = bool((out[:, blind] == 0).all()) if blind.any() else True
    nan = bool(out.isnan().any())
    return {"ratio": float("inf") if nan else err / bound, "error": err, "lse_ok": lse_ok,
            "blind_rows": int(blind.sum()), "zero_ok": zero_ok,
            "ok": not nan and err <= bound and lse_ok and zero_ok}


def dense_case(batch, nq, nk, heads, heads_kv, d, causal, window, seed, sinks=False) -> list:
    """Every variant on one problem: one row per variant."""
    q, k, v = window_inputs(batch, nq, nk, heads, heads_kv, d, seed)
    s = _sinks(heads, seed) if sinks else None
    right = 0 if causal else window[1]
    rows, outs = [], {}
    for name in variants(d):
        out, lse = hopper_attn.attention(q, k, v, causal=causal, window_size=window,
                                         return_lse=True, stage=STAGES[name], sinks=s)
        outs[name] = out
        row = {"case": ["fwd", batch, nq, nk, heads, heads_kv, d, causal, list(window),
                        "sinks" if sinks else ""], "variant": name,
               **_errors(out, lse, q, k, v, window[0], right, s)}
        if d == 128 and name != "default":       # the same tiles: expected the same bits
            row["same_bits"] = bool(torch.equal(out, outs["default"]))
        rows.append(row)
    return rows


def packed_case(lengths, heads, heads_kv, d, window, seed, sinks=False) -> list:
    """A packed batch through k6_varlen (each variant's overrides), causal, every sequence
    against its own reference."""
    from hopper_attn import k6_varlen
    from hopper_attn.common.contract import normalize_window
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads, d, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(total, heads_kv, d, device="cuda", generator=gen).bfloat16()
            for _ in range(2))
    s = _sinks(heads, seed) if sinks else None
    cu, n = cu_seqlens(lengths), max(lengths)
    window = normalize_window(window, True)
    problem = k6_varlen.problem_for(q, k, len(lengths), n, n, True, window)
    rows = []
    for name in variants(d):
        compiled, _ = k6_varlen.compile_varlen(problem, False, sinks=sinks, **OVERRIDES[name])
        out = torch.full_like(q, float("nan"))
        lse = torch.full((heads, total), float("nan"), device="cuda")
        k6_varlen.run_varlen(compiled, q, k, v, out, lse, cu, cu, None, d ** -0.5, s)
        worst = {"ratio": 0.0, "ok": True}
        for b in range(len(lengths)):
            lo, hi = int(cu[b]), int(cu[b + 1])
            if hi == lo:
                continue
            e = _errors(out[None, lo:hi], lse[None, :, lo:hi], q[None, lo:hi], k[None, lo:hi],
                        v[None, lo:hi], window[0], 0, s)
            if worst["ok"] and (not e["ok"] or e["ratio"] > worst["ratio"]):
                worst = {**e, "sequence": b}        # the first failure, else the worst
        rows.append({"case": ["varlen", len(lengths), total, heads, heads_kv, d, list(window),
                              "sinks" if sinks else ""], "variant": name, **worst})
    return rows


def correctness(log) -> list:
    groups = CaseGroups()
    run = groups.run

    # (window, causal, length): one compile per window and POLICY row, so one length each
    dense = [((4095, 0), True, 5000), ((127, 0), True, 1000), ((3, 0), True, 113),
             ((256, 256), False, 3001), ((0, 0), True, 17), ((-1, 64), False, 1000)]
    for d, windows in ((128, dense), (64, dense[:4])):
        for window, causal, n in windows:
            run(f"d{d} windows", dense_case, 2, n, n, 4, 2, d, causal, window)
    for d in (128, 64):                   # the first rows see no key
        run(f"d{d} cross lengths", dense_case, 1, 300, 100, 2, 2, d, True, (127, 0))
    for n in (1000, 4099):                # gpt-oss-shaped, with sinks
        run("gpt-oss sinks", dense_case, 1, n, n, 64, 8, 64, True, (127, 0), sinks=True)
    docs = lognormal_lengths(4096, 61, median=512, cap=2048) + [1, 17, 0, 129]
    for sinks in (False, True):
        run("packed gpt-oss", packed_case, docs, 64, 8, 64, (128, 0), sinks=sinks)

    def same_bits(group):
        same = [r["same_bits"] for r in group if "same_bits" in r]
        return f"  (same bits as the default: {sum(same)}/{len(same)})" if same else ""
    return groups.report(log, ("variant", "lse_ok", "zero_ok", "same_bits"), width=20,
                         shown=4, extra=same_bits)


def _line(label, ms) -> str:
    base = ms.get("default")
    parts = [f"{name} {t:.3f}" + (f" ({base / t:.3f}x)" if base and name != "default" else "")
             for name, t in ms.items()]
    fa4 = next((t for name, t in ms.items() if name.startswith("fa4")), None)
    best = min((t, name) for name, t in ms.items() if not name.startswith("fa4"))
    tail = f"; best {best[1]} vs fa4 {fa4 / best[0]:.3f}x" if fa4 else ""
    return f"  {label:34} ms: " + ", ".join(parts) + tail


def speed(log, deadline) -> list:
    from hopper_attn import k6_varlen
    from hopper_attn.common.contract import normalize_window
    from hopper_attn.harness.baselines import fa4
    from hopper_attn.harness.timing import L2Flush, benchmark_interleaved
    flush, rows = L2Flush(), []

    def time_row(label, calls, fa4_call, config):
        """fa4_call: makes FA4's zero-argument call (ImportError where FA4 is missing)."""
        notes = {}
        if time.time() < deadline:
            try:
                call = fa4_call()
                call()
                calls["fa4"] = call
            except Exception as exc:  # noqa: BLE001 - not installed, or no such option
                notes["fa4"] = f"{type(exc).__name__}: {str(exc)[:100]}"
        else:
            notes["fa4"] = "skipped (time)"
        timed = benchmark_interleaved(calls, flush, target_ms=150, max_reps=30)
        ms = {name: t["ms"] for name, t in timed.items()}
        log(_line(label, ms))
        rows.append({"shape": label, "config": config, "fwd_ms": ms, "notes": notes})

    for n in (16384, 65536):
        q, k, v = window_inputs(1, n, n, 16, 16, 128, seed=7)
        calls = {name: (lambda s=STAGES[name]: hopper_attn.attention(
            q, k, v, causal=True, window_size=(4095, 0), stage=s)) for name in variants(128)}
        time_row(f"w4096 causal B1 H16 d128 N{n // 1024}k", calls,
                 lambda: functools.partial(fa4(window_size=(4095, 0)), q, k, v, True),
                 [1, 16, 16, n, 128, [4095, 0]])
        del q, k, v, calls
    if not MASKS:                          # the default: dense only
        gpt_oss(time_row, ((1, 8192, False), (1, 16384, False), (4, 16384, True)))
        return rows
    mix = gpt_oss_packed()
    q, k, v, s, cu, n, window = (mix[key] for key in ("q", "k", "v", "sinks", "cu",
                                                      "max_seqlen", "window"))
    problem = k6_varlen.problem_for(q, k, len(mix["lengths"]), n, n, True,
                                    normalize_window(window, True))
    out = torch.empty_like(q)
    lse = torch.empty((64, q.shape[0]), device="cuda")
    for sinks in (None, s):
        calls = {}
        for name in variants(64):
            compiled, _ = k6_varlen.compile_varlen(problem, False, sinks=sinks is not None,
                                                   **OVERRIDES[name])
            calls[name] = (lambda c=compiled, sk=sinks: k6_varlen.run_varlen(
                c, q, k, v, out, lse, cu, cu, None, 64 ** -0.5, sk))

        def fa4_varlen(sk=sinks):
            try:
                from flash_attn.cute import flash_attn_varlen_func
            except ImportError:
                from flash_attn.cute.interface import flash_attn_varlen_func
            extra = {} if sk is None else {"learnable_sink": sk}
            return functools.partial(flash_attn_varlen_func, q, k, v, cu_seqlens_q=cu,
                                     cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n,
                                     causal=True, window_size=window, **extra)
        time_row("varlen gpt-oss 16k mix w128" + (" sinks" if sinks is not None else ""),
                 calls, fa4_varlen, ["lognormal 16k seed 16", 64, 8, 64, list(window),
                                     sinks is not None])
    del q, k, v, out, lse
    gpt_oss(time_row, [(b, n, sk) for b in (1, 4) for n in (8192, 16384)
                       for sk in (False, True)])
    return rows


def gpt_oss(time_row, shapes) -> None:
    """gpt-oss dense rows (64 / 8 heads, d 64, window (127, 0), causal): (batch, N, sinks)."""
    from hopper_attn.harness.baselines import fa4
    for batch, n, with_sinks in shapes:
        q, k, v = window_inputs(batch, n, n, 64, 8, 64, seed=8)
        sinks = _sinks(64, 8) if with_sinks else None
        calls = {name: (lambda st=STAGES[name], sk=sinks: hopper_attn.attention(
            q, k, v, causal=True, window_size=(127, 0), stage=st, sinks=sk))
            for name in variants(64)}
        extra = {} if sinks is None else {"learnable_sink": sinks}
        time_row(f"gpt-oss B{batch} N{n // 1024}k w127" + (" sinks" if with_sinks else ""),
                 calls, lambda e=extra: functools.partial(
                     fa4(window_size=(127, 0), **e), q, k, v, True),
                 [batch, 64, 8, n, 64, [127, 0], with_sinks])
        del q, k, v


def main() -> int:
    return run_check(
        __doc__, "window_fwd.json", correctness,
        lambda log, t0: speed(log, deadline=t0 + (180 if MASKS else 300)),
        "correctness (ratio = max error / (2x the bf16 reference's error + floor), <= 1 "
        "passes; per variant: " + ", ".join(STAGES[name] for name in dict.fromkeys(
            variants(128) + variants(64))) + "):",
        "speed (forward ms, round-robin medians; (x): default / variant):")


if __name__ == "__main__":
    sys.exit(main())
