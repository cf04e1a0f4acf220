"""GPU check of kb2's backward at head dims 96 and 192 (issue 63): correctness, then speed.

    source .gpu/prelude.sh && python tools/bwd_dims_gpu_check.py [--quick] [--out DIR]

1. Correctness, through `hopper_attn.attention(...).backward()` (kb2's defaults: d = 96 as
   d = 128 on 64-row tiles, d = 192 with `shared_keys`): dQ, dK, dV against the fp32
   reference (harness/reference_backward.py), d = 96 and 192, MHA (4 heads) and GQA 4:1
   (8 / 2), causal and not, lengths 1, 17, 113, 1000 and the cross lengths 113 / 300 and
   1000 / 517; GQA cases whose dK / dV are split in parts and a multi-tile causal MHA case;
   the deterministic mode run twice (same bits), MHA and GQA; logit softcapping (caps 50
   and 15, q and k times 6 to saturate the tanh: tests/test_softcap.check_softcap) at both,
   and sliding windows at d = 96 (tools/window_gpu_check.backward_case: (127, 0) causal,
   (256, 256) GQA cross lengths; d = 192 refused, as k6 does). A gradient
   passes when its max error <= 2x torch's own bf16 backward error on the same inputs
   (+ 2^-12 x max |ref|, FlashAttention's rule as tests/test_gpu.py applies it); `ratio` =
   error / that bound.
   Where a default fails, the same case through kb2 with the prologue, PDL and the per-head
   dQ conversion off (`PLAIN`, launched directly) tells the tile from those options.
2. Speed (skipped with --quick): the backward alone (autograd.grad of a kept graph), CUDA
   events, L2 flushed, round-robin medians (harness/timing.benchmark_interleaved), d = 96
   and 192, N 2k-16k (batch x N = 32k tokens), causal and not, MHA (16 heads) and GQA
   (16 / 4), against FA4's sm90 backward (flash_attn.cute; it runs d <= 128 and (192, 128)
   only, so at d = 192 it is recorded as unavailable) and SDPA's cuDNN and flash backends.
   Effective TFLOP/s: the backward counts 2.5x the forward's flops. Then POLICY's settings
   at these head dims (none measured yet) against variants without each (`VARIANTS`, kb2
   launched directly, backward alone) on MHA N = 8k, causal and not.

Prints one line per group of cases (< 60 lines); everything goes to $OUT/bwd_dims.json (or
--out), with the environment (GPU, driver, torch, CuTe DSL, FA4).

    python tools/bwd_dims_gpu_check.py --variant-check [--dims 256] [--quick] [--out DIR]

checks and times `VARIANT` (kb2 at d = 192 on 64 x 96 tiles, at d = 256 on 64 x 48, with dK^T
and dV^T, common/backward_dkv_swap.py; at d = 256 also with `dkv_split_d`) instead, in ~4
minutes (`--dims 256`: d = 256 alone, ~1.5): its gradients (launched directly) at (192, 192), (192, 128) and (256, 256), MHA 4/4 and
GQA 8/2, causal and not, lengths 17, 113, 1000 and
the cross lengths 113 / 300, 1000 / 517, plus a long causal MHA case, a GQA case whose
dK / dV are split in parts and the deterministic mode (GQA, same bits twice), against the fp32 reference with the bound above
(window_reference.gradient_errors); then (not with --quick) the backward alone, round-robin,
L2 flushed: kb2's default (d = 256: kb1's) and the variant launched directly, ours and FA4's
(and at d = 256 cuDNN's, SDPA) through autograd,
N 4k and 16k (B x N = 32k tokens, 16 heads), causal and not, one line each with
default / variant (> 1: the variant faster) and FA4 / the variant (and cuDNN / it), the
variant's time estimated through autograd as ours x variant / default. JSON: $OUT/bwd_dims_variant.json.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))

import torch  # noqa: E402

from bwd_gqa_gpu_check import _calls, _hopper, _inputs, _sdpa, check_case  # noqa: E402
from hopper_attn.common.contract import Problem  # noqa: E402
from hopper_attn.harness.baselines import fa4  # noqa: E402
from hopper_attn.harness.gpu_check import run_check  # noqa: E402

DIMS = (96, 192)
GROUPS = [("MHA", 4, 4), ("4:1", 8, 2)]
LENGTHS = [(1, 1), (17, 17), (113, 113), (1000, 1000), (113, 300), (1000, 517)]
# (label, heads, heads_kv, batch, seqlen, causal): dK / dV in parts, many kv tiles
LARGER = [("MQA parts", 8, 1, 1, 4096, True), ("MHA long", 4, 4, 1, 3000, True),
          ("8:1 parts", 16, 2, 1, 2048, False)]
DETERMINISTIC = [(8, 2, 2, 2100, True), (4, 4, 1, 777, False)]
# (causal, n, cap, magnitude, heads_kv) of check_softcap (4 query heads)
SOFTCAP = [(True, 1000, 50.0, 1.0, 2), (False, 113, 15.0, 6.0, 4)]
# (causal, window, nq, nk, heads, heads_kv) at d = 96, batch 2
WINDOWS = [(True, (127, 0), 1000, 1000, 4, 4), (False, (256, 256), 1000, 1300, 8, 2)]
PLAIN = "kb2:kv_with_first_tile=0,pdl=0,convert_per_head=0,longest_first=0"
SEQLENS = (2048, 4096, 8192, 16384)
TOKENS = 32768
# POLICY's rows at d = 96 / 192, each setting turned off in turn ("kb2": the defaults)
VARIANTS = {96: ["kb2", "kb2:early_dv=0,split_dv=0", "kb2:split_dv=0",
                 "kb2:kv_with_first_tile=0", "kb2:convert_per_head=0", "kb2:longest_first=0"],
            192: ["kb2", "kb2:kv_with_first_tile=0", "kb2:convert_per_head=0",
                  "kb2:pdl=0,convert_per_head=0", "kb2:longest_first=0"]}
CAUSAL_ONLY = ("kb2:split_dv=0", "kb2:longest_first=0")       # (the mask-free rows' own)
VARIANT = "kb2:dkv_swap_ab=1"           # d = 192 on 64 x 96, 256 on 64 x 48 (--variant-check)
VARIANT_PAIRS = [(192, 192), (192, 128), (256, 256)]
DEFAULT_AT = {256: "kb1"}                 # the default the variant is timed against (else kb2)
# the variants checked at a head dim (else VARIANT): at d = 256 also dK^T / dV^T split by d
VARIANTS_AT = {256: (VARIANT, VARIANT + ",dkv_split_d=1")}
# seconds a (d, dv) pair takes on an H100 / H200, JIT compiles included (the d = 192 pairs
# took ~2 minutes together): correctness (a variant), speed
VARIANT_SECONDS = (30, 30)
VARIANT_LENGTHS = [(17, 17), (113, 113), (1000, 1000), (113, 300), (1000, 517)]
# (label, heads, heads_kv, batch, seqlen, causal): many kv tiles; dK / dV in parts
VARIANT_LARGER = [("MHA long", 4, 4, 1, 3000, True), ("8:1 parts", 16, 2, 1, 2048, False),
                  ("deterministic", 8, 2, 2, 1000, True)]


def _plain_case(batch, heads, heads_kv, nq, nk, d, causal, seed) -> dict:
    """A failing default's case again through `PLAIN`, launched directly: the max error
    ratio per gradient (same bound as check_case)."""
    import hopper_attn
    from hopper_attn.harness import registry
    from hopper_attn.harness.grad_check import _torch_lowp_grads
    from hopper_attn.harness.reference_backward import attention_backward, forward_with_lse
    q, k, v, do = _inputs(batch, heads, heads_kv, nq, nk, d, seed)
    entry = registry.get(PLAIN)
    handle = entry.compile(Problem.from_tensor(q, causal, k))
    out, lse = hopper_attn.attention(q, k, v, causal=causal, return_lse=True)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    entry.run(handle, q, k, v, out, do, lse, *grads)
    o, lse_ref = forward_with_lse(q, k, v, causal)
    ref = attention_backward(q, k, v, o, lse_ref, do, causal)
    lowp = _torch_lowp_grads(q, k, v, do, causal)
    ratios = {}
    for name, grad, r, t in zip("qkv", grads, ref, lowp):
        bound = 2 * (t.float() - r).abs().max().item() + 2 ** -12 * max(1.0, r.abs().max().item())
        ratios[name] = (grad.float() - r).abs().max().item() / bound
    return ratios


def _log_row(log, row, text):
    log(f"  {text}: ratio dq {row['ratio']['q']:.2f} dk {row['ratio']['k']:.2f} "
        f"dv {row['ratio']['v']:.2f}" + (f", same bits {row['same_bits']}"
                                         if "same_bits" in row else "")
        + f"  {'PASS' if row['ok'] else 'FAIL'}")


def correctness(log) -> list:
    rows, failures, seed = [], [], 100
    for d in DIMS:
        for label, heads, heads_kv in GROUPS:
            group_rows = []
            for causal in (False, True):
                for nq, nk in LENGTHS:
                    seed += 1
                    row = check_case(2, heads, heads_kv, nq, nk, d, causal, seed)
                    row.update(label=label, seed=seed)
                    group_rows.append(row)
            rows += group_rows
            worst = {n: max(r["ratio"][n] for r in group_rows) for n in "qkv"}
            bad = [r for r in group_rows if not r["ok"]]
            failures += bad
            log(f"  d{d} {label:4} {len(group_rows):2} cases: worst ratio dq {worst['q']:.2f} "
                f"dk {worst['k']:.2f} dv {worst['v']:.2f}  {'PASS' if not bad else 'FAIL'}")
        for label, heads, heads_kv, batch, n, causal in LARGER:
            seed += 1
            row = check_case(batch, heads, heads_kv, n, n, d, causal, seed)
            row.update(label=label, seed=seed)
            rows.append(row)
            failures += [] if row["ok"] else [row]
            _log_row(log, row, f"d{d} {label:9} {heads}/{heads_kv} B{batch} N{n} "
                               f"{'causal' if causal else 'full'}")
        for heads, heads_kv, batch, n, causal in DETERMINISTIC:
            seed += 1
            row = check_case(batch, heads, heads_kv, n, n, d, causal, seed, deterministic=True)
            row.update(label="deterministic", seed=seed)
            rows.append(row)
            failures += [] if row["ok"] else [row]
            _log_row(log, row, f"d{d} deterministic {heads}/{heads_kv} B{batch} N{n} "
                               f"{'causal' if causal else 'full'}")
        rows += _softcap_and_windows(log, d, failures)
    for row in failures[:4]:
        if "shape" not in row:              # softcap / window: no plain rerun
            log(f"  FAILED {row}")
            continue
        batch, heads, heads_kv, nq, nk, d, causal = row["shape"]
        try:
            row["plain_ratio"] = _plain_case(batch, heads, heads_kv, nq, nk, d, causal,
                                             row["seed"])
            note = ", ".join(f"d{n} {r:.2f}" for n, r in row["plain_ratio"].items())
        except Exception as exc:  # noqa: BLE001 - a diagnosis, not a verdict
            note = f"{type(exc).__name__}: {str(exc)[:80]}"
        log(f"  FAILED {row['label']} {row['shape']}: ratio {row['ratio']}; {PLAIN}: {note}")
    return rows


def _softcap_and_windows(log, d, failures) -> list:
    from test_softcap import check_softcap, within
    from window_gpu_check import backward_case
    rows = []
    for causal, n, cap, magnitude, heads_kv in SOFTCAP:
        errors = check_softcap(d, causal, n, cap, magnitude, heads_kv, seed=d + n)
        row = {"label": "softcap", "case": [d, causal, n, cap, magnitude, heads_kv],
               "errors": errors, "ok": within(errors)}
        rows.append(row)
        failures += [] if row["ok"] else [row]
        worst = max(e / (2 * t + 2 ** -12 * max(1.0, r)) for e, t, r in errors.values())
        log(f"  d{d} softcap {cap:g} x{magnitude:g} 4/{heads_kv} N{n} "
            f"{'causal' if causal else 'full':6}: worst ratio {worst:.2f}  "
            f"{'PASS' if row['ok'] else 'FAIL'}")
    for causal, window, nq, nk, heads, heads_kv in WINDOWS if d == 96 else []:
        row = backward_case(2, nq, nk, heads, heads_kv, d, causal, window, seed=nq + nk)
        row["label"] = "window"
        rows.append(row)
        failures += [] if row["ok"] else [row]
        log(f"  d{d} window {window} {heads}/{heads_kv} {nq}/{nk} "
            f"{'causal' if causal else 'full':6}: worst ratio {row['ratio']:.2f}  "
            f"{'PASS' if row['ok'] else 'FAIL'}")
    return rows


# ------------------------------------------------------------------------------ speed

def speed(log) -> list:
    from hopper_attn.harness.timing import L2Flush, benchmark_interleaved
    providers = {"hopper": _hopper}
    for name, make in (("fa4", fa4), ("cudnn", lambda: _sdpa("CUDNN_ATTENTION")),
                       ("sdpa_flash", lambda: _sdpa("FLASH_ATTENTION"))):
        try:
            providers[name] = make()
        except Exception as exc:  # noqa: BLE001 - not installed here
            log(f"  {name} unavailable: {type(exc).__name__}: {str(exc)[:80]}")
    columns = ("hopper", "fa4", "cudnn", "sdpa_flash")
    flush, rows = L2Flush(), []
    log(f"  {'shape':34}" + " ".join(f"{n:>10}" for n in columns)
        + "  /fa4  /cudnn  /flash")
    for d in DIMS:
        for label, heads, heads_kv in (("MHA", 16, 16), ("GQA", 16, 4)):
            for causal in (False, True):
                for n in SEQLENS:
                    batch = TOKENS // n
                    shape = (f"d{d} {label} {heads}/{heads_kv} B{batch} N{n // 1024}k "
                             f"{'causal' if causal else 'full'}")
                    q, k, v, do = _inputs(batch, heads, heads_kv, n, n, d, seed=7)
                    flops = Problem(batch, heads, n, d, causal, heads_kv=heads_kv).flops
                    calls, notes = {}, {}
                    for name, forward in providers.items():
                        try:
                            calls[name] = _calls(forward, q, k, v, do, causal)[0]
                        except Exception as exc:  # noqa: BLE001 - e.g. FA4 at d = 192
                            notes[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
                    timed = benchmark_interleaved(calls, flush) if calls else {}
                    row = {"shape": shape, "config": [batch, heads, heads_kv, n, d, causal],
                           "flops_forward": flops, "unavailable": notes,
                           "bwd": {name: {**t, "tflops": 2.5 * flops / (t["ms"] * 1e-3) / 1e12}
                                   for name, t in timed.items()}}
                    ratios = {p: row["bwd"][p]["ms"] / row["bwd"]["hopper"]["ms"]
                              for p in columns[1:] if p in row["bwd"] and "hopper" in row["bwd"]}
                    row["hopper_speedup"] = ratios          # their time / ours (> 1: faster)
                    cells = [f"{row['bwd'][p]['tflops']:10.1f}" if p in row["bwd"] else f"{'-':>10}"
                             for p in columns]
                    log(f"  {shape:34}" + " ".join(cells) + "  " + " ".join(
                        f"{ratios[p]:5.2f}" if p in ratios else f"{'-':>5}"
                        for p in columns[1:]))
                    rows.append(row)
                    del q, k, v, do, calls
                    torch.cuda.empty_cache()
    return rows + variants(log, flush)


def variants(log, flush) -> list:
    """POLICY's settings at d = 96 / 192 against each turned off: backward alone, kb2
    launched directly (bwd_gqa_gpu_check._direct), MHA B4 H16 N = 8k."""
    from bwd_gqa_gpu_check import _direct
    from hopper_attn.harness.timing import benchmark_interleaved
    rows = []
    for d, names in VARIANTS.items():
        for causal in (False, True):
            q, k, v, do = _inputs(4, 16, 16, 8192, 8192, d, seed=9)
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


# ------------------------------------------------------------------- --variant-check

def _variant_inputs(batch, heads, heads_kv, nq, nk, d, dv, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(batch, nq, heads, d), (batch, nk, heads_kv, d), (batch, nk, heads_kv, dv),
              (batch, nq, heads, dv)]
    return [torch.randn(*s, device="cuda", generator=gen).to(torch.bfloat16) for s in shapes]


def _direct_dv(name, q, k, v, do, causal):
    """A kb2 setting's backward alone (v dv wide), launched through the registry."""
    import hopper_attn
    from hopper_attn.harness import registry
    entry = registry.get(name)
    handle = entry.compile(Problem.from_tensor(q, causal, k, v=v))
    out, lse = hopper_attn.attention(q, k, v, causal=causal, return_lse=True)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    call = lambda: entry.run(handle, q, k, v, out, do, lse, *grads)  # noqa: E731
    call()
    torch.cuda.synchronize()
    return call, grads


def variant_case(batch, heads, heads_kv, nq, nk, d, dv, causal, seed,
                 deterministic=False, variant=VARIANT) -> dict:
    from hopper_attn.harness.window_reference import gradient_errors
    q, k, v, do = _variant_inputs(batch, heads, heads_kv, nq, nk, d, dv, seed)
    name = variant + (",deterministic=1" if deterministic else "")
    call, grads = _direct_dv(name, q, k, v, do, causal)
    first = [g.clone() for g in grads]
    for grad in grads:
        grad.fill_(float("nan"))                 # every element must be written (again)
    call()
    torch.cuda.synchronize()
    errors = gradient_errors(q, k, v, do, grads, -1, 0 if causal else -1, d ** -0.5)
    row = {"shape": [batch, heads, heads_kv, nq, nk, d, dv, causal], "ratio": {}, "name": name,
           "errors": errors, "ok": True}
    if deterministic:                            # the same bits on both runs
        row["same_bits"] = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                               for a, b in zip(first, grads))
        row["ok"] = row["same_bits"]
    for name, grad in zip("qkv", grads):
        err, _, bound = errors[name]
        nan = bool(grad.isnan().any())
        row["ratio"][name] = float("inf") if nan else err / bound
        row["ok"] &= not nan and err <= bound
    return row


def variant_correctness(log) -> list:
    rows, seed = [], 500
    for d, dv in VARIANT_PAIRS:
        for variant in VARIANTS_AT.get(d, (VARIANT,)):
            tag = f"({d}, {dv})" + (" split_d" if "dkv_split_d" in variant else "")
            for label, heads, heads_kv in GROUPS:
                for causal in (False, True):
                    group_rows = []
                    for nq, nk in VARIANT_LENGTHS:
                        seed += 1
                        group_rows.append(variant_case(2, heads, heads_kv, nq, nk, d, dv,
                                                       causal, seed, variant=variant))
                    rows += group_rows
                    worst = {n: max(r["ratio"][n] for r in group_rows) for n in "qkv"}
                    bad = [r["shape"] for r in group_rows if not r["ok"]]
                    log(f"  {tag} {label:4} {'causal' if causal else 'full':6} "
                        f"{len(group_rows)} cases: worst ratio dq {worst['q']:.2f} dk "
                        f"{worst['k']:.2f} dv {worst['v']:.2f}  "
                        + (f"FAIL {bad}" if bad else "PASS"))
            for label, heads, heads_kv, batch, n, causal in VARIANT_LARGER:
                seed += 1
                deterministic = label == "deterministic"
                row = variant_case(batch, heads, heads_kv, n, n, d, dv, causal, seed,
                                   deterministic, variant=variant)
                rows.append(row)
                log(f"  {tag} {label:13} {heads}/{heads_kv} B{batch} N{n} "
                    f"{'causal' if causal else 'full'}: ratio dq {row['ratio']['q']:.2f} dk "
                    f"{row['ratio']['k']:.2f} dv {row['ratio']['v']:.2f}"
                    + (f", same bits {row['same_bits']}" if deterministic else "")
                    + f"  {'PASS' if row['ok'] else 'FAIL'}")
    return rows


def variant_speed(log) -> list:
    from hopper_attn.harness.timing import L2Flush, benchmark_interleaved, round_ratios
    try:
        run_fa4 = fa4()
    except Exception as exc:  # noqa: BLE001 - not installed here
        log(f"  fa4 unavailable: {type(exc).__name__}: {str(exc)[:80]}")
        run_fa4 = None
    flush, rows = L2Flush(), []
    for d, dv in VARIANT_PAIRS:
        for causal in (False, True):
            for n in (4096, 16384):
                batch = TOKENS // n
                q, k, v, do = _variant_inputs(batch, 16, 16, n, n, d, dv, seed=11)
                calls, notes = {}, {}
                default, variants = DEFAULT_AT.get(d, "kb2"), VARIANTS_AT.get(d, (VARIANT,))
                for name in (default, *variants):
                    try:
                        calls[name] = _direct_dv(name, q, k, v, do, causal)[0]
                    except Exception as exc:  # noqa: BLE001 - recorded, the others still run
                        notes[name] = f"{type(exc).__name__}: {str(exc)[:100]}"
                others = [("ours", _hopper), ("fa4", run_fa4)] + \
                    ([("cudnn", _sdpa("CUDNN_ATTENTION"))] if d == 256 else [])
                for name, forward in others:
                    if forward is None:
                        continue
                    try:
                        calls[name] = _calls(forward, q, k, v, do, causal)[0]
                    except Exception as exc:  # noqa: BLE001
                        notes[name] = f"{type(exc).__name__}: {str(exc)[:100]}"
                timed = benchmark_interleaved(calls, flush, target_ms=150, max_reps=20)
                flops = Problem(batch, 16, n, d, causal, head_dim_v=0 if dv == d else dv).flops
                shape = f"({d}, {dv}) MHA 16 B{batch} N{n // 1024}k {'causal' if causal else 'full'}"
                row = {"shape": shape, "ms": {k_: t["ms"] for k_, t in timed.items()},
                       "timed": timed, "unavailable": notes, "flops_forward": flops}
                short = {VARIANT: "variant", VARIANT + ",dkv_split_d=1": "split_d"}
                line = f"  {shape:32} " + " ".join(f"{short.get(k_, k_)} {t['ms']:.3f}"
                                                     for k_, t in timed.items())
                for variant in variants:
                    if default not in timed or variant not in timed:
                        continue
                    gain = round_ratios(timed[default], timed[variant])
                    est = row.setdefault("estimates", {}).setdefault(variant, {})
                    est["default_over_variant"] = gain
                    line += f" | {default}/{short[variant]} {gain['ratio']:.3f}"
                    if "ours" in timed and "fa4" in timed:
                        # the variant through autograd: ours x variant / default
                        estimate = timed["ours"]["ms"] / gain["ratio"]
                        est["fa4_over_variant_est"] = timed["fa4"]["ms"] / estimate
                        row["fa4_over_ours"] = round_ratios(timed["fa4"], timed["ours"])
                        line += (f", fa4/it {est['fa4_over_variant_est']:.3f} (est., "
                                 f"{2.5 * flops / (estimate * 1e-3) / 1e12:.0f} TFLOP/s)")
                        if "cudnn" in timed:
                            est["cudnn_over_variant_est"] = timed["cudnn"]["ms"] / estimate
                            line += f", cudnn/it {est['cudnn_over_variant_est']:.3f}"
                log(line + "".join(f"; {k_} failed" for k_ in notes))
                rows.append(row)
                del q, k, v, do, calls
                torch.cuda.empty_cache()
    return rows


def main() -> int:
    if "--variant-check" in sys.argv:
        sys.argv.remove("--variant-check")
        if "--dims" in sys.argv:                # e.g. --dims 256: those head dims' pairs only
            at = sys.argv.index("--dims")
            dims = {int(x) for x in sys.argv[at + 1].split(",")}
            del sys.argv[at:at + 2]
            VARIANT_PAIRS[:] = [pair for pair in VARIANT_PAIRS if pair[0] in dims]
        estimate = sum(len(VARIANTS_AT.get(d, (VARIANT,))) * VARIANT_SECONDS[0]
                       + (0 if "--quick" in sys.argv else VARIANT_SECONDS[1])
                       for d, _ in VARIANT_PAIRS)
        print(f"--variant-check: (d, dv) {VARIANT_PAIRS}, estimated ~{estimate} s", flush=True)
        import faulthandler                     # a hung kernel: exit with the stacks
        faulthandler.dump_traceback_later(540, exit=True)
        return run_check(
            __doc__, "bwd_dims_variant.json", variant_correctness,
            lambda log, t0: variant_speed(log),
            f"{VARIANT} correctness (ratio = max error / (2x torch bf16 error + 2^-12 "
            "max|ref|), <= 1 passes):",
            "backward alone, ms (round-robin medians); kb2 / variant launched directly, ours "
            "/ fa4 through autograd; x/y > 1: y faster:")
    return run_check(
        __doc__, "bwd_dims.json", correctness, lambda log, t0: speed(log),
        "correctness (ratio = max error / (2x torch bf16 error + 2^-12 max|ref|), <= 1 passes):",
        "backward speed, effective TFLOP/s (2.5x the forward's flops), round-robin medians; "
        "/x: x's time over ours (> 1: we are faster):")


if __name__ == "__main__":
    sys.exit(main())
