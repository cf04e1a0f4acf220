"""GPU check of attention sinks (issue 61, gpt-oss's `s_aux`) and of k6's windows at head dims
192 / 256: correctness, then speed against FA4.

    python tools/sinks_gpu_check.py [--quick] [--out DIR]

1. Correctness through `hopper_attn.attention(..., sinks=...)` (k6 forward, kb2 backward,
   the sinks' gradient in torch), against a float64 reference with the sink as one more
   softmax column (common/sinks.py `reference_with_sinks`). Bound: FlashAttention's rule,
   2x the error of the same math in torch's bf16 (transformers' gpt-oss eager attention:
   bf16 scores, the sink column, fp32 softmax, bf16 P V), + 2^-10 for O, + 2^-12 max|ref|
   for gradients; the LSE within 1e-3 (d <= 128). Cases: gpt-oss-shaped GQA 64/8 d 64,
   causal with and without window (128, 0), lengths 1, 17, 113, 1000 (forward) and 17,
   1000 (backward, dQ dK dV dsinks); d 128 GQA 8/2; cross lengths whose first rows see no
   key (output 0, LSE the sink); decode steps (1 and 4 queries over 3000 keys: the sink at
   the splits' combine, and in the one-split path); one head's sink -inf (no sink) and one
   +8 (rows dominated by it); outputs written into NaN-poisoned memory; the same bits twice.
   Windows at d 192 / 256 (no longer refused): O within the bound and the LSE within
   4e-3 = ln(1 + 2^-8), the bound of their lazy rescale's bf16-rounded row sums, with and
   without the window (the same error without one: docs/window.md), with and without sinks.
2. Speed (skipped with --quick), CUDA events, L2 flushed, round-robin medians: gpt-oss's
   shape (64 q heads, 8 kv heads, d 64, window (128, 0), causal, sinks), N 4k / 8k / 16k at
   batch 4 / 2 / 1, forward and forward + backward: ours with sinks, ours without,
   FA4 `flash_attn_func(..., window_size=(128, 0), learnable_sink=sinks)` (issue target:
   >= 1.0x FA4).

Prints < 40 lines; everything goes to $OUT/sinks.json (or --out).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import hopper_attn  # noqa: E402
from hopper_attn.common.sinks import reference_with_sinks  # noqa: E402
from hopper_attn.harness.gpu_check import CaseGroups, lse_bound, run_check  # noqa: E402
from hopper_attn.harness.window_reference import window_mask  # noqa: E402



def _inputs(batch, nq, nk, heads, heads_kv, d, seed, sinks=True):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, nq, heads, d, device="cuda", generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(batch, nk, heads_kv, d, device="cuda", generator=gen)
            .to(torch.bfloat16) for _ in range(2))
    s = None
    if sinks:
        s = torch.randn(heads, device="cuda", generator=gen) * 2
        s[0] = float("-inf")                            # a head without a sink
        if heads > 1:
            s[1] = 8.0                                  # a sink that dominates its rows
    return q, k, v, s


def _scores(q, k, scale):
    group = q.shape[2] // k.shape[2]
    return torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(group, dim=2)) * scale


def _lowp(q, k, v, sinks, seen, scale):
    """torch in bf16 as transformers' gpt-oss eager attention runs it (differentiable)."""
    s = _scores(q, k, scale).masked_fill(~seen, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype)[None, :, None, None].expand(*s.shape[:3], 1)], -1)
    p = torch.softmax(s.float(), -1).nan_to_num(0.0).to(q.dtype)
    p = p[..., :-1] if sinks is not None else p
    group = q.shape[2] // v.shape[2]
    return torch.einsum("bhij,bjhd->bihd", p, v.repeat_interleave(group, dim=2))


def _poison():
    """Fill free cached memory with NaN, so that a kernel that leaves elements unwritten
    shows it (the outputs come from the caching allocator)."""
    free = torch.cuda.mem_get_info()[0]
    torch.empty(min(free // 4, 2 << 30) // 4, device="cuda").fill_(float("nan"))


def forward_case(batch, nq, nk, heads, heads_kv, d, causal, left, sinks, seed,
                 stage=None) -> dict:
    q, k, v, s = _inputs(batch, nq, nk, heads, heads_kv, d, seed, sinks)
    window = (left, -1)
    _poison()
    out, lse = hopper_attn.attention(q, k, v, causal=causal, window_size=window, sinks=s,
                                     return_lse=True, stage=stage)
    again = hopper_attn.attention(q, k, v, causal=causal, window_size=window, sinks=s,
                                  stage=stage)
    same = bool(torch.equal(out.view(torch.int16), again.view(torch.int16)))
    seen = window_mask(nq, nk, left, 0 if causal else -1)
    scale = d ** -0.5
    ref, ref_lse = reference_with_sinks(_scores(q.double(), k.double(), scale), seen,
                                        v.double(), None if s is None else s.double())
    low = _lowp(q, k, v, s, seen, scale).double()
    bound = 2 * (low - ref).abs().max().item() + 2 ** -10
    nan = bool(out.isnan().any() or lse.isnan().any())
    err = (out.double() - ref).abs().max().item()
    finite = ref_lse.isfinite()
    lse_err = (lse.double()[finite] - ref_lse[finite]).abs().max().item() if finite.any() \
        else 0.0
    lse_tol = lse_bound(d)
    lse_ok = bool(torch.equal(lse.isfinite(), finite)) and lse_err <= lse_tol
    blind = ~seen.any(-1)
    zero_ok = bool((out[:, blind] == 0).all()) if blind.any() else True
    return {"case": ["fwd", batch, nq, nk, heads, heads_kv, d, causal, left, sinks, stage],
            "ratio": float("inf") if nan else err / bound, "error": err, "lse_error": lse_err,
            "lse_ok": lse_ok, "blind_rows": int(blind.sum()), "zero_ok": zero_ok,
            "same_bits": same, "ok": not nan and err <= bound and lse_ok and zero_ok and same}


def backward_case(batch, nq, nk, heads, heads_kv, d, causal, left, sinks, seed) -> dict:
    q, k, v, s = _inputs(batch, nq, nk, heads, heads_kv, d, seed, sinks)
    do = torch.randn(batch, nq, heads, d, device="cuda").to(torch.bfloat16)
    seen = window_mask(nq, nk, left, 0 if causal else -1)
    scale = d ** -0.5
    mine = [t.detach().clone().requires_grad_() for t in (q, k, v, s)]
    _poison()
    hopper_attn.attention(*mine[:3], causal=causal, window_size=(left, -1),
                          sinks=mine[3]).backward(do)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v, s)]
    out, _ = reference_with_sinks(_scores(ref[0], ref[1], scale), seen, ref[2], ref[3])
    out.backward(do.double())
    low = [t.detach().clone().requires_grad_() for t in (q, k, v, s)]
    _lowp(*low, seen, scale).backward(do)
    ratios, ok = {}, True
    for name, m, r, lo in zip(("q", "k", "v", "sinks"), mine, ref, low):
        r_grad = r.grad.nan_to_num(0.0)
        torch_err = (lo.grad.double().nan_to_num(0.0) - r_grad).abs().max().item()
        bound = 2 * torch_err + 2 ** -12 * max(1.0, r_grad.abs().max().item())
        nan = bool(m.grad.isnan().any())
        ratios[name] = float("inf") if nan else \
            (m.grad.double() - r_grad).abs().max().item() / bound
        ok &= not nan and ratios[name] <= 1
    return {"case": ["bwd", batch, nq, nk, heads, heads_kv, d, causal, left, sinks],
            "ratio": max(ratios.values()), "ratios": ratios, "ok": ok}


def correctness(log) -> list:
    cases = CaseGroups()
    run = cases.run

    for left in (128, -1):                              # gpt-oss: GQA 64/8, d 64
        for n in (1, 17, 113, 1000):
            run(f"fwd gpt-oss w{left}", forward_case, 1, n, n, 64, 8, 64, True, left, True)
        for n in (17, 1000):
            run(f"bwd gpt-oss w{left}", backward_case, 1, n, n, 64, 8, 64, True, left, True)
    for n in (113, 1000):
        run("fwd d128 8/2", forward_case, 2, n, n, 8, 2, 128, True, 128, True)
        run("fwd d128 8/2", forward_case, 2, n, n, 8, 2, 128, False, -1, True)
        run("bwd d128 8/2", backward_case, 2, n, n, 8, 2, 128, True, -1, True)
    for nq, nk in ((300, 100), (1000, 17)):             # first rows see no key
        run("cross (blind rows)", forward_case, 1, nq, nk, 8, 2, 64, True, 127, True)
        run("cross (blind rows)", forward_case, 1, nq, nk, 8, 2, 128, True, -1, True)
    for nq in (1, 4):                                   # gpt-oss decode steps
        for stage in (None, "decode:num_splits=1"):     # (None: decode's own split count)
            run("decode", forward_case, 2, nq, 3000, 64, 8, 64, True, -1, True, stage=stage)
    for d in (192, 256):                                # windows there: no longer refused
        for n in (17, 1000):
            for left, sinks in ((127, False), (-1, False), (127, True)):
                run(f"d{d} window LSE", forward_case, 1, n, n, 4, 4, d, True, left, sinks)
        run(f"d{d} window LSE", forward_case, 1, 1000, 1000, 4, 2, d, False, 256, False)
    return cases.report(log, ("lse_error", "zero_ok", "same_bits"), width=22, shown=4,
                        extra=lambda group: ", LSE err {:.1e}".format(
                            max((r.get("lse_error", 0.0) for r in group), default=0.0)))


def speed(log, t0) -> list:
    from hopper_attn.harness.baselines import fa4
    from hopper_attn.harness.timing import L2Flush, benchmark_interleaved
    flush, rows = L2Flush(), []
    window = (128, 0)
    for n, batch in ((4096, 4), (8192, 2), (16384, 1)):
        q, k, v, s = _inputs(batch, n, n, 64, 8, 64, seed=7)
        s[0] = 0.5                                     # (the correctness part's -inf head)
        do = torch.randn_like(q)
        row = {"shape": [batch, n, 64, 8, 64, window], "notes": {}}
        ours = {"sinks": dict(sinks=s), "no_sinks": {}}
        fwd = {name: (lambda kw=kw: hopper_attn.attention(q, k, v, causal=True,
                                                          window_size=window, **kw))
               for name, kw in ours.items()}
        try:
            run = fa4(window_size=window, learnable_sink=s)
            run(q, k, v, True)
            fwd["fa4_sinks"] = lambda: run(q, k, v, True)
        except Exception as exc:  # noqa: BLE001 - not installed, or no such option
            row["notes"]["fa4"] = f"{type(exc).__name__}: {str(exc)[:100]}"
        row["fwd"] = {k_: t["ms"] for k_, t in
                      benchmark_interleaved(fwd, flush, target_ms=150, max_reps=30).items()}
        bwd = {}
        for name, kw in ours.items():
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, s)]
            extra = dict(sinks=leaves[3]) if kw else {}
            out = hopper_attn.attention(*leaves[:3], causal=True, window_size=window, **extra)
            used = leaves if kw else leaves[:3]
            bwd[name] = (lambda o=out, u=used: torch.autograd.grad(o, u, do,
                                                                   retain_graph=True))
        for with_dsinks in ((True, False) if "fa4_sinks" in fwd else ()):
            try:                                        # (without dsinks if FA4 has none)
                leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, s)]
                out = fa4(window_size=window, learnable_sink=leaves[3])(*leaves[:3], True)
                used = leaves if with_dsinks else leaves[:3]
                bwd["fa4_sinks"] = (lambda o=out, u=used: torch.autograd.grad(
                    o, u, do, retain_graph=True))
                bwd["fa4_sinks"]()
                row["notes"]["fa4_bwd_dsinks"] = with_dsinks
                break
            except Exception as exc:  # noqa: BLE001
                bwd.pop("fa4_sinks", None)
                row["notes"]["fa4_bwd"] = f"{type(exc).__name__}: {str(exc)[:100]}"
        row["bwd"] = {k_: t["ms"] for k_, t in
                      benchmark_interleaved(bwd, flush, target_ms=150, max_reps=20).items()}
        for what in ("fwd", "bwd"):
            ms = row[what]
            line = (f"  gpt-oss B{batch} N{n} {what}: sinks {ms['sinks']:.3f} ms, no sinks "
                    f"{ms['no_sinks']:.3f} ({ms['sinks'] / ms['no_sinks']:.3f}x)")
            if "fa4_sinks" in ms:
                line += (f", fa4 sinks {ms['fa4_sinks']:.3f} (fa4/ours "
                         f"{ms['fa4_sinks'] / ms['sinks']:.2f}x)")
            log(line)
        rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(run_check(__doc__, "sinks.json", correctness, speed,
                       "correctness: sinks fwd / bwd, d 192 / 256 windows (ratio: error / "
                       "2x torch bf16's; LSE error)",
                       "speed: gpt-oss shape, window (128, 0), causal (bwd: fwd+bwd grads)"))
