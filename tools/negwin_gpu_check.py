"""GPU check of windows with a negative side (FlashAttention's shifted diagonals, issue 63)
through `hopper_attn.attention()` and `attention_varlen()`: forward (k6) and backward (kb2).

    source .gpu/prelude.sh && python tools/negwin_gpu_check.py [--quick] [--out DIR]

Windows in FA4's spelling (a side None: unbounded, the other literal): (None, -1) keys
before the row's own position, (None, -5), (None, -130), (-3, None), (-200, None); both sides
literal: (5, -3), (130, -129), and (3, -5), which no row sees a key of. Per case the output,
LSE and dQ / dK / dV against the fp32 reference with the window's mask
(harness/window_reference.py; tools/window_gpu_check.py's cases and bound: 2x torch's own
bf16 error + a floor), rows that see no key exactly 0 with LSE -inf, keys that no query sees
with dK = dV = 0. Shapes: square, cross lengths both ways (1000 x 300, 300 x 1000: rows and
keys nobody sees), GQA 8 / 2, d 64 (192-row tiles, bit masks with per-warpgroup starts)
and 128 (bit masks); the full run adds d 96 / 192 / 256 (compares; at 192 and 256 kb2's
dkv_swap_ab), the deterministic backward, and a packed batch (attention_varlen, forward
and backward). `--quick`: d 64 and 128 on four windows plus the packed batch (about 25
compiles, < 2 min). No speed part. Prints one line per group; JSON to $OUT/negwin.json.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import hopper_attn  # noqa: E402
from hopper_attn.harness.gpu_check import CaseGroups, run_check  # noqa: E402
from hopper_attn.harness.window_reference import (gradient_errors, reference,  # noqa: E402
                                                   torch_lowp, window_inputs, window_mask)
from window_gpu_check import backward_case, forward_case  # noqa: E402

QUICK = "--quick" in sys.argv
WINDOWS = [(None, -1), (-3, None), (5, -3), (3, -5), (None, -5), (None, -130), (-200, None),
           (130, -129)]
SHAPES = [(1000, 1000), (1000, 300), (300, 1000), (113, 113)]


def varlen_case(d, window, backward, seed) -> dict:
    """A packed batch of three sequences (lengths cross both ways): each sequence's slice
    against its own dense reference and torch's bf16 error (forward_case's bound, and
    gradient_errors')."""
    lengths = [(300, 1000), (1000, 300), (17, 17)]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    heads, heads_kv = 4, 2
    nq, nk = sum(a for a, _ in lengths), sum(b for _, b in lengths)
    q = torch.randn(nq, heads, d, device="cuda", generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(nk, heads_kv, d, device="cuda", generator=gen).to(torch.bfloat16)
            for _ in range(2))
    cu_q, cu_k = ([0], [0])
    for a, b in lengths:
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + b)
    leaves = [t.clone().requires_grad_(backward) for t in (q, k, v)]
    out = hopper_attn.attention_varlen(
        *leaves, torch.tensor(cu_q, dtype=torch.int32, device="cuda"),
        torch.tensor(cu_k, dtype=torch.int32, device="cuda"), max(a for a, _ in lengths),
        max(b for _, b in lengths), window_size=window)
    do = torch.randn(out.shape, device="cuda", generator=gen).to(torch.bfloat16)
    if backward:
        out.backward(do)
    scale, ratio, ok = d ** -0.5, {}, True
    for i, (a, b) in enumerate(lengths):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        qi, ki, vi = q[qs][None], k[ks][None], v[ks][None]
        ref, _ = reference(qi, ki, vi, window[0], window[1], scale)
        low, _ = torch_lowp(qi, ki, vi, window[0], window[1], scale)
        err = (out[qs].float()[None] - ref).abs().max().item()
        nan = bool(out[qs].isnan().any())
        ratio[f"o{i}"] = float("inf") if nan else err / (2 * (low - ref).abs().max().item()
                                                          + 2 ** -10)
        blind = ~window_mask(a, b, window[0], window[1]).any(-1)
        ok &= bool((out[qs][blind] == 0).all())
        if backward:
            grads = [leaf.grad[s][None] for leaf, s in zip(leaves, (qs, ks, ks))]
            for name, (e, _, bound) in gradient_errors(qi, ki, vi, do[qs][None], grads,
                                                        window[0], window[1], scale).items():
                nan = bool(leaves["qkv".index(name)].grad.isnan().any())
                ratio[f"d{name}{i}"] = float("inf") if nan else e / bound
    ok &= all(r <= 1 for r in ratio.values())
    return {"case": ["varlen", d, list(window), backward], "ratio": max(ratio.values()),
            "ratios": ratio, "ok": ok}


def correctness(log) -> list:
    cases = CaseGroups()
    run = cases.run

    windows = WINDOWS[:4] if QUICK else WINDOWS
    for d in (64, 128):
        for window in windows:
            for nq, nk in SHAPES:
                run(f"fwd d{d}", forward_case, 2, nq, nk, 4, 2, d, False, window)
            for nq, nk in SHAPES[:3]:
                run(f"bwd d{d}", backward_case, 1, nq, nk, 4, 4, d, False, window)
        for window in windows[:2]:
            run(f"gqa 8/2 d{d}", forward_case, 1, 1000, 1300, 8, 2, d, False, window)
            run(f"gqa 8/2 d{d}", backward_case, 1, 1000, 1300, 8, 2, d, False, window)
    for backward in (False, True):
        run("varlen d128", varlen_case, 128, (None, -5), backward)
    if not QUICK:
        for d in (96, 192, 256):
            for window in ((None, -5), (-3, None)):
                run(f"fwd d{d}", forward_case, 1, 1000, 1000, 4, 2, d, False, window)
                run(f"bwd d{d}", backward_case, 1, 1000, 300, 4, 2, d, False, window)
        run("varlen d64", varlen_case, 64, (-3, None), True)
        for window in ((None, -5), (5, -3)):    # (last: a wrong turn count would hang)
            run("bwd deterministic d128", _deterministic, 1000, 1300, window)
    return cases.report(log, ("lse_ok", "lse_err", "lse_finite_ok", "zero_ok"))


def _deterministic(nq, nk, window, seed) -> dict:
    """The deterministic backward (dQ turns counted from each query tile's first kv tile)
    twice: the same bits, within the bound."""
    q, k, v = window_inputs(1, nq, nk, 4, 4, 128, seed)
    do = torch.randn(1, nq, 4, 128, device="cuda").to(torch.bfloat16)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        hopper_attn.attention(*leaves, window_size=window, deterministic=True).backward(do)
        runs.append([leaf.grad for leaf in leaves])
    same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(*runs))
    errors = gradient_errors(q, k, v, do, runs[0], window[0], window[1], 128 ** -0.5)
    ratio = {name: float("inf") if g.isnan().any() else e / bound
             for (name, (e, _, bound)), g in zip(errors.items(), runs[0])}
    return {"case": ["bwd det", nq, nk, list(window)], "ratio": max(ratio.values()),
            "ratios": ratio, "same_bits": same,
            "ok": same and all(r <= 1 for r in ratio.values())}


def main() -> int:
    return run_check(
        __doc__, "negwin.json", correctness, lambda log, t0: log("  (no speed part)") or {},
        "correctness (ratio = max error / bound, <= 1 passes):", "speed:")


if __name__ == "__main__":
    sys.exit(main())
