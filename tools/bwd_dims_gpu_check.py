"""GPU check of kb2's backward at head dims 96, 192, (192, 128) and 256: correctness, then
speed against FlashAttention-4 and cuDNN.

    source .gpu/prelude.sh && python tools/bwd_dims_gpu_check.py [--quick] [--dims 192,256]
        [--settings] [--windows] [--out DIR]

kb2's defaults there (its POLICY): d = 96 runs d = 128's consumer on 64-row tiles; d = 192
(dv 192 or 128) and 256 run `dkv_swap_ab` (common/backward_dkv_swap.py: 64 x 96 and 64 x 48
tiles, dK^T and dV^T with d as WGMMA's M); d = 192 with a softcap runs `shared_keys`.

1. Correctness, all through the user paths: `hopper_attn.attention(...).backward()` for
   each (d, dv) pair, MHA (4 heads) and GQA 4:1 (8 / 2), causal and not, lengths 1, 17, 113,
   1000 and the cross lengths 113 / 300 and 1000 / 517; GQA cases whose dK / dV are split
   in parts and a multi-tile causal MHA case; the deterministic mode run twice (same bits),
   GQA and MHA; logit softcapping (caps 50 and 15, q and k times 6 to saturate the tanh:
   tests/test_softcap.check_softcap) at d = 96 and 192; sliding windows (`WINDOWS`, every
   pair: `window_case`), at d = 192 and 256 also with a softcap (d = 192: the shared_keys
   tile), with sinks (their gradient too), with rows that see no key and keys no query
   sees (`WIDE_WINDOWS`; dK and dV of unseen keys exactly 0), at d = 192 one-sided, and at
   d = 192 and 256 on packed batches (`VARLEN_WINDOWS`); and
   `hopper_attn.attention_varlen(...).backward()` at d = 96, 192 and 256 on packed batches
   (tools/varlen_bwd_gpu_check.check_case: lengths 0-1000, GQA cross lengths, MQA,
   seqused_k, equal 2k lengths). A gradient passes when its max error <= 2x torch's own bf16
   backward error on the same inputs (+ 2^-12 x max |ref|, FlashAttention's rule as
   tests/test_gpu.py applies it); `ratio` = error / that bound.
2. Speed (skipped with --quick): the backward alone (autograd.grad of a kept graph), CUDA
   events, L2 flushed, round-robin medians (harness/timing.benchmark_interleaved), each
   pair at N 4k and 16k (B x N = 32k tokens), MHA (16 heads) and GQA (16 / 4), causal and
   not: ours against FA4's sm90 backward (flash_attn.cute, which runs all four pairs) and
   SDPA's cuDNN backend (where it takes the shape), at d = 256 also kb1 (launched directly,
   the default there until 2026-11-29). Effective TFLOP/s: the backward counts 2.5x the
   forward's flops. `--settings`: POLICY's settings at d = 96 / 192 against variants
   without each (`SETTINGS`, kb2 launched directly, backward alone) on MHA N = 8k.

`--dims 192,256` keeps the pairs of those head dims (the d = 192 and 256 part: about 3.5
minutes on an H200 with the JIT compiles before the window cases; d = 96 adds about 1).
`--windows`: the sliding-window cases only (16 at --dims 192,256, each compiling its own
forward and backward: about a minute more in --quick). Prints one line per group of cases (a window case: one line);
everything goes to $OUT/bwd_dims.json (or --out), with the environment (GPU, driver,
torch, CuTe DSL, FA4).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))

import torch  # noqa: E402

from bwd_gqa_gpu_check import _calls, backward_providers  # noqa: E402
from hopper_attn.common.contract import Problem  # noqa: E402
from hopper_attn.harness.gpu_check import run_check  # noqa: E402

PAIRS = [(96, 96), (192, 192), (192, 128), (256, 256)]       # (d, dv)
GROUPS = [("MHA", 4, 4), ("4:1", 8, 2)]
LENGTHS = [(1, 1), (17, 17), (113, 113), (1000, 1000), (113, 300), (1000, 517)]
# (label, heads, heads_kv, batch, seqlen, causal): dK / dV in parts, many kv tiles
LARGER = [("MQA parts", 8, 1, 1, 4096, True), ("MHA long", 4, 4, 1, 3000, True),
          ("8:1 parts", 16, 2, 1, 2048, False)]
DETERMINISTIC = [(8, 2, 2, 2100, True), (4, 4, 1, 777, False)]
# (causal, n, cap, magnitude, heads_kv) of check_softcap (4 query heads; dv = d only)
SOFTCAP = [(True, 1000, 50.0, 1.0, 2), (False, 113, 15.0, 6.0, 4)]
# (causal, window, nq, nk, heads, heads_kv, softcap, sinks), batch 2: WINDOWS at every pair,
# WIDE_WINDOWS (softcap, sinks with blind rows, unseen keys; then one-sided) at d = 192 and
# (the first three) 256
WINDOWS = [(True, (127, 0), 1000, 1000, 4, 4, 0.0, False),
           (False, (256, 256), 1000, 1300, 8, 2, 0.0, False)]
WIDE_WINDOWS = [(True, (127, 0), 1000, 1000, 8, 2, 30.0, False),
                (True, (127, 0), 1000, 517, 4, 2, 0.0, True),
                (True, (63, 0), 113, 300, 4, 1, 0.0, False),
                (False, (-1, 64), 1000, 1000, 4, 4, 0.0, False),
                (False, (300, -1), 1000, 1300, 4, 2, 0.0, False)]
# packed batches (d = 192, 256): (label, lengths_q, lengths_k, used_k, heads, heads_kv)
VARLEN = [("MHA", [0, 1, 17, 113, 1000], None, None, 4, 4),
          ("GQA 8:2 cross", [1, 17, 113, 1000, 0, 40], [300, 5, 113, 517, 64, 0], None, 8, 2),
          ("MQA", [17, 700, 5], None, None, 4, 1),
          ("seqused_k", [100, 300, 7], [150, 400, 9], [120, 0, 9], 4, 2),
          ("equal GQA 3x2k", [2048] * 3, None, None, 4, 2)]
VARLEN_DIMS = (96, 192, 256)
# packed batches with a window at d = 192 (the swapped tile): (causal, window), on VARLEN's
# GQA cross lengths
VARLEN_WINDOWS = [(True, (127, 0)), (False, (256, 256))]
SEQLENS = (4096, 16384)
TOKENS = 32768
# POLICY's rows at d = 96 / 192, each setting turned off in turn ("kb2": the defaults)
SETTINGS = {96: ["kb2", "kb2:early_dv=0,split_dv=0", "kb2:split_dv=0",
                 "kb2:kv_with_first_tile=0", "kb2:convert_per_head=0", "kb2:longest_first=0"],
            192: ["kb2", "kb2:kv_with_first_tile=0", "kb2:convert_per_head=0",
                  "kb2:pdl=0,convert_per_head=0", "kb2:longest_first=0"]}
CAUSAL_ONLY = ("kb2:split_dv=0", "kb2:longest_first=0")       # (the mask-free rows' own)
SETTINGS_ON = False                     # --settings
WINDOWS_ONLY = False                    # --windows
WATCHDOG_S = 540                        # a hung kernel: exit with the stacks


def _inputs(batch, heads, heads_kv, nq, nk, d, dv, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(batch, nq, heads, d), (batch, nk, heads_kv, d), (batch, nk, heads_kv, dv),
              (batch, nq, heads, dv)]
    return [torch.randn(*s, device="cuda", generator=gen).to(torch.bfloat16) for s in shapes]


def _ours(q, k, v, do, causal, deterministic=False):
    import hopper_attn
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    hopper_attn.attention(*leaves, causal=causal, deterministic=deterministic).backward(do)
    return [t.grad for t in leaves]


def check_case(batch, heads, heads_kv, nq, nk, d, dv, causal, seed,
               deterministic=False) -> dict:
    """One problem through attention()'s backward against the fp32 reference (and, in the
    deterministic mode, a second run: same bits)."""
    from hopper_attn.harness.window_reference import gradient_errors
    q, k, v, do = _inputs(batch, heads, heads_kv, nq, nk, d, dv, seed)
    grads = _ours(q, k, v, do, causal, deterministic)
    errors = gradient_errors(q, k, v, do, grads, -1, 0 if causal else -1, d ** -0.5)
    row = {"shape": [batch, heads, heads_kv, nq, nk, d, dv, causal], "ratio": {},
           "errors": errors, "ok": True, "seed": seed}
    for name, grad in zip("qkv", grads):
        err, _, bound = errors[name]
        nan = bool(grad.isnan().any())
        row["ratio"][name] = float("inf") if nan else err / bound
        row["ok"] &= not nan and err <= bound
    if deterministic:
        again = _ours(q, k, v, do, causal, True)
        row["same_bits"] = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                               for a, b in zip(grads, again))
        row["ok"] &= row["same_bits"]
    return row


def _eager_bf16(q, k, v, seen, scale, softcap, sinks):
    """The windowed attention as torch computes it in bf16 (eager, differentiable): the
    error bound's reference where SDPA has no softcap or sinks."""
    group = q.shape[2] // k.shape[2]
    s = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(group, dim=2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype)[None, :, None, None].expand(*s.shape[:3], 1)], -1)
    p = torch.softmax(s.float(), -1).nan_to_num(0.0).to(q.dtype)
    p = p[..., :-1] if sinks is not None else p
    return torch.einsum("bhij,bjhd->bihd", p, v.repeat_interleave(group, dim=2))


def window_case(batch, nq, nk, heads, heads_kv, d, dv, causal, window, seed, softcap=0.0,
                sinks=False) -> dict:
    """A sliding window through attention()'s backward (softcap, sinks: their gradient too)
    against window_reference.reference in fp32; torch's error: SDPA with the window's mask,
    or with a softcap or sinks the same math eager in bf16; dK and dV of keys no query sees
    exactly 0."""
    import hopper_attn
    from hopper_attn.harness.window_reference import (gradient_errors, reference,
                                                      window_mask)
    q, k, v, do = _inputs(batch, heads, heads_kv, nq, nk, d, dv, seed)
    s = None
    if sinks:
        s = torch.randn(heads, device=q.device, generator=torch.Generator(
            device=q.device).manual_seed(seed)) * 2
        s[0] = 8.0                                      # a sink that dominates its rows
    right, scale = (0 if causal else window[1]), d ** -0.5
    mine = [t.clone().requires_grad_() for t in (q, k, v)] + \
        ([s.clone().requires_grad_()] if sinks else [])
    hopper_attn.attention(*mine[:3], causal=causal, window_size=window, softcap=softcap,
                          sinks=mine[3] if sinks else None).backward(do)
    grads = [t.grad for t in mine]
    if not softcap and not sinks:
        errors = gradient_errors(q, k, v, do, grads, window[0], right, scale)
    else:
        ins = [t.float().requires_grad_() for t in (q, k, v)] + \
            ([s.clone().requires_grad_()] if sinks else [])
        out, _ = reference(*ins[:3], window[0], right, scale, softcap,
                           ins[3] if sinks else None)
        out.backward(do.float())
        low = [t.clone().requires_grad_() for t in (q, k, v)] + \
            ([s.clone().requires_grad_()] if sinks else [])
        seen = window_mask(nq, nk, window[0], right, q.device)
        _eager_bf16(*low[:3], seen, scale, softcap, low[3] if sinks else None).backward(do)
        errors = {}
        for name, grad, ref, lo in zip(("q", "k", "v", "sinks"), grads, ins, low):
            r = ref.grad.nan_to_num(0.0)
            torch_err = (lo.grad.float().nan_to_num(0.0) - r).abs().max().item()
            errors[name] = ((grad.float() - r).abs().max().item(), torch_err,
                            2 * torch_err + 2 ** -12 * max(1.0, r.abs().max().item()))
    unseen = ~window_mask(nq, nk, window[0], right, q.device).any(0)  # keys no query sees
    zero_ok = all(bool((g[:, unseen] == 0).all()) for g in grads[1:3])
    row = {"case": [batch, nq, nk, heads, heads_kv, d, dv, causal, list(window), softcap,
                    sinks], "label": "window", "errors": errors, "ratio": {},
           "unseen_keys": int(unseen.sum()), "zero_ok": zero_ok, "ok": zero_ok, "seed": seed}
    for name, grad in zip(errors, grads):
        err, _, bound = errors[name]
        nan = bool(grad.isnan().any())
        row["ratio"][name] = float("inf") if nan else err / bound
        row["ok"] &= not nan and err <= bound
    return row


def _log_row(log, row, text):
    log(f"  {text}: ratio dq {row['ratio']['q']:.2f} dk {row['ratio']['k']:.2f} "
        f"dv {row['ratio']['v']:.2f}" + (f", same bits {row['same_bits']}"
                                         if "same_bits" in row else "")
        + f"  {'PASS' if row['ok'] else 'FAIL'}")


def correctness(log) -> list:
    rows, seed = [], 100
    for d, dv in PAIRS:
        tag = f"d{d}" if dv == d else f"({d}, {dv})"
        if WINDOWS_ONLY:
            rows += _windows(log, d, dv, tag)
            continue
        for label, heads, heads_kv in GROUPS:
            group_rows = []
            for causal in (False, True):
                for nq, nk in LENGTHS:
                    seed += 1
                    row = check_case(2, heads, heads_kv, nq, nk, d, dv, causal, seed)
                    row["label"] = label
                    group_rows.append(row)
            rows += group_rows
            worst = {n: max(r["ratio"][n] for r in group_rows) for n in "qkv"}
            bad = [r["shape"] for r in group_rows if not r["ok"]]
            log(f"  {tag} {label:4} {len(group_rows):2} cases: worst ratio dq {worst['q']:.2f} "
                f"dk {worst['k']:.2f} dv {worst['v']:.2f}  " + (f"FAIL {bad}" if bad else "PASS"))
        for label, heads, heads_kv, batch, n, causal in LARGER:
            seed += 1
            row = check_case(batch, heads, heads_kv, n, n, d, dv, causal, seed)
            row["label"] = label
            rows.append(row)
            _log_row(log, row, f"{tag} {label:9} {heads}/{heads_kv} B{batch} N{n} "
                               f"{'causal' if causal else 'full'}")
        for heads, heads_kv, batch, n, causal in DETERMINISTIC:
            seed += 1
            row = check_case(batch, heads, heads_kv, n, n, d, dv, causal, seed, True)
            row["label"] = "deterministic"
            rows.append(row)
            _log_row(log, row, f"{tag} deterministic {heads}/{heads_kv} B{batch} N{n} "
                               f"{'causal' if causal else 'full'}")
        rows += _windows(log, d, dv, tag)
        if dv == d:
            rows += _softcap_varlen(log, d)
    return rows


def _windows(log, d, dv, tag) -> list:
    rows = []
    # one-sided windows at d = 192 only (d = 256 runs the same consumer code): --quick's time
    wide = WIDE_WINDOWS if (d, dv) == (192, 192) else WIDE_WINDOWS[:3] if d == 256 else []
    for causal, window, nq, nk, heads, heads_kv, cap, sinks in WINDOWS + wide:
        try:
            row = window_case(2, nq, nk, heads, heads_kv, d, dv, causal, window, nq + nk + d,
                              cap, sinks)
        except Exception as exc:  # noqa: BLE001 - one failing case, not the run
            row = {"case": [nq, nk, heads, heads_kv, d, dv, causal, list(window), cap, sinks],
                   "label": "window", "ok": False, "ratio": {},
                   "error_text": f"{type(exc).__name__}: {exc}"[:300]}
        rows.append(row)
        extra = (f" softcap {cap:g}" if cap else "") + (" sinks" if sinks else "")
        ratio = " ".join(f"d{n} {r:.2f}" for n, r in row["ratio"].items())
        log(f"  {tag} window {window} {heads}/{heads_kv} {nq}/{nk} "
            f"{'causal' if causal else 'full':6}{extra}: ratio {ratio or '-'}"
            + (f", {row['unseen_keys']} unseen keys" if row.get("unseen_keys") else "")
            + f"  {'PASS' if row['ok'] else 'FAIL'}"
            + (f"  {row['error_text'][:100]}" if "error_text" in row else ""))
    if d in VARLEN_DIMS and d > 128 and dv == d:
        from varlen_bwd_gpu_check import check_case as varlen_case
        _, lq, lk, used, heads, heads_kv = VARLEN[1]
        for causal, window in VARLEN_WINDOWS:
            try:
                row = varlen_case(lq, lk, heads, heads_kv, d, causal, seed=d + window[0],
                                  used=used, window=window)
            except Exception as exc:  # noqa: BLE001 - one failing case, not the run
                row = {"ok": False, "error_text": f"{type(exc).__name__}: {exc}"[:300],
                       "ratio": {}}
            row["label"] = "varlen window"
            rows.append(row)
            ratio = " ".join(f"d{n} {row['ratio'].get(n, float('nan')):.2f}" for n in "qkv")
            log(f"  {tag} varlen window {window} {heads}/{heads_kv} cross "
                f"{'causal' if causal else 'full':6}: ratio {ratio}  "
                f"{'PASS' if row['ok'] else 'FAIL'}"
                + (f"  {row['error_text'][:100]}" if "error_text" in row else ""))
    return rows


def _softcap_varlen(log, d) -> list:
    from test_softcap import check_softcap, within
    from varlen_bwd_gpu_check import check_case as varlen_case
    rows = []
    for causal, n, cap, magnitude, heads_kv in SOFTCAP if d <= 192 else []:
        errors = check_softcap(d, causal, n, cap, magnitude, heads_kv, seed=d + n)
        row = {"label": "softcap", "case": [d, causal, n, cap, magnitude, heads_kv],
               "errors": errors, "ok": within(errors)}
        rows.append(row)
        worst = max(e / (2 * t + 2 ** -12 * max(1.0, r)) for e, t, r in errors.values())
        log(f"  d{d} softcap {cap:g} x{magnitude:g} 4/{heads_kv} N{n} "
            f"{'causal' if causal else 'full':6}: worst ratio {worst:.2f}  "
            f"{'PASS' if row['ok'] else 'FAIL'}")
    for label, lq, lk, used, heads, heads_kv in VARLEN if d in VARLEN_DIMS else []:
        for causal in (False, True):
            try:
                row = varlen_case(lq, lk or lq, heads, heads_kv, d, causal,
                                  seed=d + 10 * len(lq) + causal, used=used)
            except Exception as exc:  # noqa: BLE001 - one failing case, not the run
                row = {"ok": False, "error_text": f"{type(exc).__name__}: {exc}"[:300],
                       "ratio": {}}
            row["label"] = f"varlen {label}"
            rows.append(row)
            ratio = " ".join(f"d{n} {row['ratio'].get(n, float('nan')):.2f}" for n in "qkv")
            log(f"  d{d} varlen {label:14} {'causal' if causal else 'full':6} "
                f"{row.get('path', '-')}: ratio {ratio}  {'PASS' if row['ok'] else 'FAIL'}"
                + (f"  {row['error_text'][:100]}" if "error_text" in row else ""))
    return rows


# ------------------------------------------------------------------------------ speed

def _kb1_call(q, k, v, do, causal):
    """kb1's backward alone (v as wide as q), launched through the registry."""
    from dv_gpu_check import direct_backward
    return direct_backward("kb1", q, k, v, do, causal)


def speed(log) -> list:
    from hopper_attn.harness.timing import L2Flush, benchmark_interleaved
    providers = backward_providers(log)
    flush, rows = L2Flush(), []
    log(f"  {'shape':36} ms: ours, others; their time / ours (> 1: ours faster)")
    for d, dv in PAIRS:
        for label, heads, heads_kv in (("MHA", 16, 16), ("GQA", 16, 4)):
            for causal in (False, True):
                for n in SEQLENS:
                    batch = TOKENS // n
                    shape = (f"({d}, {dv}) {label} {heads}/{heads_kv} B{batch} N{n // 1024}k "
                             f"{'causal' if causal else 'full'}")
                    q, k, v, do = _inputs(batch, heads, heads_kv, n, n, d, dv, seed=7)
                    calls, notes = {}, {}
                    for name, forward in providers.items():
                        try:
                            calls[name] = _calls(forward, q, k, v, do, causal)[0]
                        except Exception as exc:  # noqa: BLE001 - e.g. a shape cuDNN refuses
                            notes[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
                    if d == 256:
                        try:
                            calls["kb1"] = _kb1_call(q, k, v, do, causal)
                        except Exception as exc:  # noqa: BLE001
                            notes["kb1"] = f"{type(exc).__name__}: {str(exc)[:100]}"
                    timed = benchmark_interleaved(calls, flush, target_ms=150, max_reps=20)
                    flops = Problem(batch, heads, n, d, causal, heads_kv=heads_kv,
                                    head_dim_v=0 if dv == d else dv).flops
                    row = {"shape": shape, "config": [batch, heads, heads_kv, n, d, dv, causal],
                           "flops_forward": flops, "unavailable": notes,
                           "bwd": {name: {**t, "tflops": 2.5 * flops / (t["ms"] * 1e-3) / 1e12}
                                   for name, t in timed.items()}}
                    ours = row["bwd"].get("ours", {}).get("ms")
                    row["over_ours"] = {p: t["ms"] / ours for p, t in row["bwd"].items()
                                        if ours and p != "ours"}
                    log(f"  {shape:36} " + (f"ours {ours:.3f} ({row['bwd']['ours']['tflops']:.0f}"
                                             " TFLOP/s)" if ours else "ours -") + "".join(
                        f", {p} {row['bwd'][p]['ms']:.3f} ({r:.3f})"
                        for p, r in row["over_ours"].items())
                        + "".join(f"; {p} unavailable" for p in notes))
                    rows.append(row)
                    del q, k, v, do, calls
                    torch.cuda.empty_cache()
    return rows + (settings(log, flush) if SETTINGS_ON else [])


def settings(log, flush) -> list:
    """POLICY's settings at d = 96 / 192 against each turned off: backward alone, kb2
    launched directly (bwd_gqa_gpu_check._direct), MHA B4 H16 N = 8k."""
    from bwd_gqa_gpu_check import _direct
    from hopper_attn.harness.timing import benchmark_interleaved
    rows = []
    for d, names in SETTINGS.items():
        if (d, d) not in PAIRS:
            continue
        for causal in (False, True):
            q, k, v, do = _inputs(4, 16, 16, 8192, 8192, d, d, seed=9)
            calls, notes = {}, {}
            for name in names:
                if name in CAUSAL_ONLY and not causal:
                    continue
                try:
                    calls[name] = _direct(name, q, k, v, do, causal)
                except Exception as exc:  # noqa: BLE001 - recorded, the others still run
                    notes[name] = f"{type(exc).__name__}: {str(exc)[:100]}"
            timed = benchmark_interleaved(calls, flush)
            shape = f"d{d} MHA 16 B4 N8k {'causal' if causal else 'full'}"
            rows.append({"shape": shape, "variants": timed, "unavailable": notes})
            base = timed["kb2"]["ms"] if "kb2" in timed else float("nan")
            log(f"  {shape}: default {base:.3f} ms; time / default's: " + ", ".join(
                f"{n[4:]} {t['ms'] / base:.3f}" for n, t in timed.items() if n != "kb2")
                + "".join(f"; {n} failed" for n in notes))
            del q, k, v, do, calls
            torch.cuda.empty_cache()
    return rows


def main() -> int:
    if "--dims" in sys.argv:                    # e.g. --dims 192,256: those head dims' pairs
        at = sys.argv.index("--dims")
        dims = {int(x) for x in sys.argv[at + 1].split(",")}
        del sys.argv[at:at + 2]
        PAIRS[:] = [pair for pair in PAIRS if pair[0] in dims]
    global SETTINGS_ON, WINDOWS_ONLY
    if "--settings" in sys.argv:                # (run_check parses the other arguments)
        sys.argv.remove("--settings")
        SETTINGS_ON = True
    if "--windows" in sys.argv:                 # the window cases only (with --quick)
        sys.argv.remove("--windows")
        WINDOWS_ONLY = True
    print(f"(d, dv) pairs {PAIRS}", flush=True)
    import faulthandler
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    return run_check(
        __doc__, "bwd_dims.json", correctness, lambda log, t0: speed(log),
        "correctness through attention() / attention_varlen() (ratio = max error / (2x torch "
        "bf16 error + 2^-12 max|ref|), <= 1 passes):",
        "backward alone, ms, round-robin medians; ours / fa4 / cudnn through autograd, kb1 "
        "launched directly:")


if __name__ == "__main__":
    sys.exit(main())
