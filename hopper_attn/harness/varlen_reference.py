"""References for packed batches (hopper_attn.attention_varlen; tests/test_varlen.py,
tools/varlen_gpu_check.py): each sequence on its own through the window references (fp32,
and torch's bf16 SDPA for the error bound; with attention sinks `sink_reference`), document
lengths for benchmarks, the real per-sequence work in FLOPs."""

from __future__ import annotations

import math

import os

import torch

from hopper_attn.harness import window_reference


def sequences(cu_seqlens_q, cu_seqlens_k, seqused_k=None):
    """[(q0, q1, k0, k1)] per sequence, read on the host."""
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    used = None if seqused_k is None else [int(x) for x in seqused_k.tolist()]
    out = []
    for b in range(len(cq) - 1):
        k1 = ck[b + 1] if used is None else ck[b] + used[b]
        out.append((cq[b], cq[b + 1], ck[b], k1))
    return out


@torch.no_grad()
def reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool, softmax_scale=None,
              seqused_k=None, window=(-1, -1), softcap: float = 0.0, lowp: bool = False):
    """Per sequence: (out (total_q, H, d) fp32, lse (H, total_q) fp32) in fp32 math, or with
    `lowp` torch's own SDPA in the input dtype (its output only; lse None). Tokens outside
    every sequence: out 0, lse NaN. Causal and windows aligned bottom-right per sequence."""
    scale = softmax_scale or 1.0 / math.sqrt(q.shape[-1])
    left, right = window
    if causal:
        right = 0
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device=q.device)
    for q0, q1, k0, k1 in sequences(cu_seqlens_q, cu_seqlens_k, seqused_k):
        if q1 == q0:
            continue
        if k1 == k0:
            lse[:, q0:q1] = float("-inf")
            continue
        qs, ks, vs = q[None, q0:q1], k[None, k0:k1], v[None, k0:k1]
        if lowp:
            if softcap:
                o = _lowp_softcap(qs, ks, vs, left, right, scale, softcap)
            else:
                o, _ = window_reference.torch_lowp(qs, ks, vs, left, right, scale)
            out[q0:q1] = o[0]
        else:
            o, l = window_reference.reference(qs, ks, vs, left, right, scale, softcap)
            out[q0:q1], lse[:, q0:q1] = o[0], l[0]
    return out, (None if lowp else lse)


def _lowp_softcap(q, k, v, left, right, scale, softcap):
    """Softcapped attention in the input dtype (scores rounded, softmax in fp32 rounded back,
    P V in the input dtype): torch has no softcap in SDPA."""
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    s = (softcap * torch.tanh(s.float() / softcap))
    seen = window_reference.window_mask(q.shape[1], k.shape[1], left, right, q.device)
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), -1).nan_to_num(0.0).to(q.dtype)
    return torch.einsum("bhij,bjhd->bihd", p, v).float()


def sink_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool, sinks, window=(-1, -1),
                   softmax_scale=None, lowp: bool = False):
    """Per sequence with attention sinks ((heads,) logits, docs/sinks.md), differentiable
    (give it leaves): fp32 math (window_reference.reference) -> (out (total_q, H, d) fp32,
    lse (H, total_q)); with `lowp` the math in q's dtype as transformers' gpt-oss eager
    attention runs it (scores in q's dtype, the sink one more column, softmax in fp32, P
    rounded, P V in q's dtype) -> (out in q's dtype, None): the 2x rule's baseline, gradients
    included. Rows that see no key: output 0, LSE the sink (-inf for a -inf sink). Every
    query token belongs to a sequence (cu_seqlens_q[-1] == total_q)."""
    scale = softmax_scale or 1.0 / math.sqrt(q.shape[-1])
    left, right = window
    if causal:
        right = 0
    outs, lses = [], []
    for q0, q1, k0, k1 in sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0:
            continue
        qs, ks, vs = q[None, q0:q1], k[None, k0:k1], v[None, k0:k1]
        if lowp:
            outs.append(_lowp_sinks(qs, ks, vs, left, right, scale, sinks)[0])
        else:
            o, lse = window_reference.reference(qs, ks, vs, left, right, scale, sinks=sinks)
            outs.append(o[0])
            lses.append(lse[0])
    if lowp:
        return torch.cat(outs), None
    lse = torch.cat(lses, 1)
    return torch.cat(outs), lse.masked_fill(lse < -1e29, float("-inf"))   # (-1e30 masks)


def _lowp_sinks(q, k, v, left, right, scale, sinks):
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    seen = window_reference.window_mask(q.shape[1], k.shape[1], left, right, q.device)
    s = s.masked_fill(~seen, float("-inf"))
    s = torch.cat([s, sinks.to(s.dtype)[None, :, None, None].expand(*s.shape[:3], 1)], -1)
    p = torch.softmax(s.float(), -1).nan_to_num(0.0).to(q.dtype)[..., :-1]
    return torch.einsum("bhij,bjhd->bihd", p, v)


def visible_pairs(nq: int, nk: int, causal: bool, window=(-1, -1)) -> int:
    """Query-key pairs a sequence computes (bottom-right aligned mask)."""
    from hopper_attn.common.contract import normalize_window
    left, right = normalize_window(window, False)
    if causal:
        right = 0
    if left is None and right is None:
        return nq * nk
    total = 0
    for i in range(nq):
        r = i + nk - nq
        hi = min(nk - 1, r + right) if right is not None else nk - 1
        lo = max(0, r - left) if left is not None else 0
        total += max(0, hi - lo + 1)
    return total


def flops(cu_q, cu_k, heads: int, head_dim: int, causal: bool, window=(-1, -1)) -> float:
    """The forward's real work: 4 x heads x d per visible pair, summed over sequences."""
    pairs = sum(visible_pairs(cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b], causal, window)
                for b in range(len(cu_q) - 1))
    return 4.0 * heads * head_dim * pairs


def lognormal_lengths(total: int, seed: int, median: int = 1024, sigma: float = 1.0,
                      cap: int = 16384) -> list:
    """Document lengths drawn lognormal (median `median`, capped at `cap`, at least 1) until
    they fill `total` tokens (the last one cut to fit)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        x = float(torch.empty(1).log_normal_(math.log(median), sigma, generator=gen))
        lengths.append(max(1, min(cap, int(x))))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]


def cu_seqlens(lengths, device="cuda") -> torch.Tensor:
    """int32 [0, l0, l0 + l1, ...]."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int32, device=device)


def gpt_oss_packed(total: int = 16384, seed: int = 16) -> dict:
    """gpt-oss's attention shape over a lognormal document mix (`total` tokens, `seed`):
    packed q (64 heads), k and v (8 heads), d 64, bf16, per-head sink logits, causal window
    (128, 0): {"q", "k", "v", "sinks", "cu", "max_seqlen", "window", "lengths"}."""
    lengths = lognormal_lengths(total, seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(lengths), 64, 64, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(sum(lengths), 8, 64, device="cuda", generator=gen).bfloat16()
            for _ in range(2))
    sinks = torch.randn(64, device="cuda", generator=gen) * 2
    return {"q": q, "k": k, "v": v, "sinks": sinks, "cu": cu_seqlens(lengths),
            "max_seqlen": max(lengths), "window": (128, 0), "lengths": lengths}


def speed_mixes() -> list:
    """The (tokens, seed) document mixes the varlen GPU checks time: VARLEN_TOTALS="16384" keeps the 16k mix."""
    keep = os.environ.get("VARLEN_TOTALS", "16384,65536").split(",")
    return [(t, s) for t, s in ((16384, 16), (65536, 64)) if str(t) in keep]


def speed_dims() -> list:
    """Head dims timed: VARLEN_DIMS="128" keeps d 128."""
    return [int(x) for x in os.environ.get("VARLEN_DIMS", "64,128").split(",")]


def speed_equal_lengths() -> list:
    """(batch, seqlen) of the equal-length comparisons with the dense call (the 4 x 16k one
    only with the 64k mix)."""
    return [(8, 2048)] + ([(4, 16384)] if any(t == 65536 for t, _ in speed_mixes()) else [])
