"""Why a stale reference maximum costs accuracy: the online softmax emulated on the CPU.

Lazy rescaling (k6's `lazy_rescale`, `exp_first`) keeps a row's reference maximum until the
true one has grown by more than 2^T (exp2 units), so P = 2^(s - m_ref) may exceed 1. On the
GPU that measured up to 1.9x torch's bf16 error at T = 8 against 1.0x for the eager step
(results/h100/2026-11-26_k6_exp_first_error.txt), and P's size was not the cause (P taken from
m_ref + T, so that P <= 1, measured the same). This emulation reproduces the trend in fp32 /
fp64 with bf16 rounding where the kernel rounds (P for the PV GEMM, the output) and shows the
mechanism: the row sum l adds the *unrounded* P while O adds the bf16-rounded P. In the eager
step the largest P of a row is 2^0 = 1, exact in bf16; with a stale reference it is 2^x for
some fractional x, rounded by up to 2^-9, and in rows that one key dominates O / l is then off
by about that much. l summed from the rounded P (the same values as O) cancels it.

    python tools/stale_max_error.py          # ~10 s, no GPU

Written 2026-11-26 (docs/lab/k6.md "The exp2s before the row maximum").
"""

from __future__ import annotations

import math

import torch


def inputs(keys: str, seqlen_q: int, seqlen_k: int, d: int, seed: int):
    """bf16 q, k, v (B2 H3), as the GPU measurement's: keys 'plain' or 'growing' (k scaled by
    linspace(1, 4) along the keys)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, n, 3, d, generator=gen) for n in (seqlen_q, seqlen_k, seqlen_k))
    if keys == "growing":
        k = k * torch.linspace(1.0, 4.0, seqlen_k)[None, :, None, None]
    return [t.to(torch.bfloat16) for t in (q, k, v)]


def online_softmax(s, v, scale_log2: float, threshold=None, sum_rounded: bool = False,
                   block_n: int = 128):
    """O = softmax(s) v over kv tiles of block_n, as the kernels compute it: fp32 maxima, P
    and l; P rounded to bf16 for O += P V (fp64 here: the GEMM's own error is not the
    question); the output rounded to bf16. threshold None: the eager step (every tile moves
    the reference); else the reference moves only when a row's maximum grew by more than
    2^threshold. sum_rounded: l adds the bf16-rounded P."""
    rows = s.shape[:-1] + (1,)
    m = torch.full(rows, -math.inf)
    l = torch.zeros(rows)
    o = torch.zeros(s.shape[:-1] + (v.shape[-1],), dtype=torch.float64)
    for j in range(0, s.shape[-1], block_n):
        s_j = s[..., j:j + block_n]
        m_tile = torch.maximum(m, s_j.amax(-1, keepdim=True))
        moves = (m_tile - m) * scale_log2 > (0.0 if threshold is None else threshold)
        m_new = torch.where(moves, m_tile, m)
        alpha = torch.exp2((m - m_new) * scale_log2).nan_to_num(0.0)
        p = torch.exp2((s_j - m_new) * scale_log2)
        p_bf16 = p.to(torch.bfloat16).float()
        l = l * alpha + (p_bf16 if sum_rounded else p).sum(-1, keepdim=True)
        o = o * alpha.double() + p_bf16.double() @ v[..., j:j + block_n, :]
        m = m_new
    return (o / l.double()).to(torch.bfloat16).double()


def error_ratios(keys: str, thresholds=(0.0, 1.0, 2.0, 4.0, 8.0), seqlen_q: int = 1000,
                 seqlen_k: int = 1601, d: int = 64) -> dict:
    """Max |O - fp64 reference| of each threshold, with l from the fp32 and from the rounded
    P, as a multiple of the eager step's error: {threshold: (fp32 l, rounded l)}."""
    q, k, v = inputs(keys, seqlen_q, seqlen_k, d, seqlen_q * 5 + seqlen_k + d)
    qf, kf, vf = (t.double().permute(0, 2, 1, 3) for t in (q, k, v))
    s64 = qf @ kf.transpose(-1, -2)
    ref = torch.softmax(s64 * d ** -0.5, -1) @ vf
    s = s64.float()                                       # the GEMM's fp32 scores
    scale_log2 = d ** -0.5 * math.log2(math.e)
    eager = (online_softmax(s, vf, scale_log2) - ref).abs().max().item()
    return {t: tuple((online_softmax(s, vf, scale_log2, t, rounded) - ref).abs().max().item()
                     / eager for rounded in (False, True))
            for t in thresholds}


if __name__ == "__main__":
    for keys in ("plain", "growing"):
        cells = [f"T={t:g}: {a:.2f}x (l from rounded P {b:.2f}x)"
                 for t, (a, b) in error_ratios(keys).items()]
        print(f"{keys:8s} " + " | ".join(cells))
