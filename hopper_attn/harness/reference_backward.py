"""fp32 reference for the attention backward pass, written the way kb1/kb2 will compute it.

Given q, k, v, the forward's output o and log-sum-exp lse (fp32, (B, H, N)) and the
incoming gradient do, per (batch, head), with scale = softmax_scale:

    D   = rowsum(dO * O)                    one number per query row (the "preprocess")
    S   = scale * Q K^T                     recomputed, never stored
    P   = exp(S - lse)                      the forward's probabilities, from the LSE alone
    dV  = P^T dO
    dP  = dO V^T
    dS  = P * (dP - D)                      the softmax's Jacobian, applied row by row
    dQ  = scale * dS K
    dK  = scale * dS^T Q

(docs/05-backward-math.md derives it.) Masked scores have P = 0, so they contribute
nothing; a row that sees no key (lse = -inf) gets P = 0 and dQ = 0. With GQA, the dK and
dV of a k/v head are the sums over its group of query heads. Queries are processed in
chunks of rows (as the forward reference does), so dK and dV accumulate across chunks,
exactly the reduction kb1 does across Q tiles. v (and o, do, dv) may have their own head
dim dv (MLA-style (192, 128)): D, dV and dP then run over dv.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

_CHUNK_ELEMENTS = 1 << 26     # fp32 scores per chunk (256 MiB)


@torch.no_grad()
def forward_with_lse(q, k, v, causal: bool, scale: Optional[float] = None):
    """fp32 (o, lse) for (B, N, H, d) inputs (k/v may have fewer heads, another length;
    causal aligned bottom-right); lse is (B, H, Nq), -inf for rows that see no key."""
    o, lse, _ = _pass(q, k, v, None, None, None, causal, scale, backward=False)
    return o, lse


@torch.no_grad()
def attention_backward(q, k, v, o, lse, do, causal: bool, scale: Optional[float] = None):
    """fp32 (dq, dk, dv), shaped like q, k, v, by the recomputation formulas above."""
    _, _, grads = _pass(q, k, v, o, lse, do, causal, scale, backward=True)
    return grads


def _pass(q, k, v, o, lse, do, causal, scale, backward):
    b_, nq, hq, d = q.shape
    nk, hk = k.shape[1], k.shape[2]
    group = hq // hk
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    f32 = torch.float32
    out = torch.empty((*q.shape[:3], v.shape[3]), dtype=f32, device=q.device) \
        if not backward else None
    lse_out = torch.empty((b_, hq, nq), dtype=f32, device=q.device) if not backward else None
    dq = torch.zeros(q.shape, dtype=f32, device=q.device) if backward else None
    dk = torch.zeros(k.shape, dtype=f32, device=q.device) if backward else None
    dv = torch.zeros(v.shape, dtype=f32, device=q.device) if backward else None
    chunk = max(1, min(nq, _CHUNK_ELEMENTS // max(1, hq * nk)))
    cols = torch.arange(nk, device=q.device)
    for b in range(b_):
        kb = k[b].to(f32).transpose(0, 1).repeat_interleave(group, 0)     # (Hq, Nk, d)
        vb = v[b].to(f32).transpose(0, 1).repeat_interleave(group, 0)
        dkb = torch.zeros_like(kb) if backward else None
        dvb = torch.zeros_like(vb) if backward else None
        for i0 in range(0, nq, chunk):
            i1 = min(nq, i0 + chunk)
            qc = q[b, i0:i1].to(f32).transpose(0, 1)                        # (Hq, c, d)
            s = torch.matmul(qc, kb.transpose(1, 2)) * scale               # (Hq, c, Nk)
            if causal:
                rows = torch.arange(i0, i1, device=q.device)
                s.masked_fill_(cols[None, :] > rows[:, None] + (nk - nq), float("-inf"))
            if not backward:
                row_lse = torch.logsumexp(s, dim=-1)                       # -inf: no key
                p = torch.exp(s - row_lse[..., None]).nan_to_num(0.0)
                out[b, i0:i1] = torch.matmul(p, vb).transpose(0, 1)
                lse_out[b, :, i0:i1] = row_lse
                continue
            row_lse = lse[b, :, i0:i1].to(f32)
            p = torch.exp(s - row_lse[..., None]).nan_to_num(0.0)          # (Hq, c, Nk)
            doc = do[b, i0:i1].to(f32).transpose(0, 1)                      # (Hq, c, d)
            oc = o[b, i0:i1].to(f32).transpose(0, 1)
            big_d = (doc * oc).sum(-1, keepdim=True)                        # D: (Hq, c, 1)
            dvb += torch.matmul(p.transpose(1, 2), doc)
            dp = torch.matmul(doc, vb.transpose(1, 2))
            ds = p * (dp - big_d)
            dq[b, i0:i1] = (torch.matmul(ds, kb) * scale).transpose(0, 1)
            dkb += torch.matmul(ds.transpose(1, 2), qc) * scale
        if backward:            # GQA: a k/v head's gradient sums over its query heads
            dk[b] = dkb.view(hk, group, nk, d).sum(1).transpose(0, 1)
            dv[b] = dvb.view(hk, group, nk, v.shape[3]).sum(1).transpose(0, 1)
    return out, lse_out, (dq, dk, dv)
