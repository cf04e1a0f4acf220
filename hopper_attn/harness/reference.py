"""fp32 reference attention and error measures.

The reference upcasts the bf16 (fp16) inputs to fp32 and runs the textbook formula in chunks of
query rows (so N = 16k does not need an N x N matrix at once), with TF32 disabled.
A kernel's error is compared with torch's own SDPA error on the same inputs (same dtype): a
bf16 or fp16 kernel is right when its error is at most about twice torch's (`ERROR_RATIO_LIMIT`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

ERROR_RATIO_LIMIT = 2.0
_CHUNK_ELEMENTS = 1 << 27     # fp32 scores per chunk (512 MiB)


@torch.no_grad()
def reference_attention(q, k, v, causal: bool, fp8_probs: bool = False) -> torch.Tensor:
    """fp32 softmax(q k^T / sqrt(d)) v for (B, N, H, d) tensors (v may be (B, N, H, dv));
    returns fp32 (B, N, H, dv).

    `fp8_probs`: emulate an FP8 kernel's P V instead (the yardstick for k7's error): the
    unnormalized probabilities, scaled to a row maximum of 256 as k7 does, rounded to e4m3
    before P V; the row sums stay fp32."""
    b_, n, h, d = q.shape
    scale = 1.0 / math.sqrt(d)
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        out = torch.empty((*q.shape[:3], v.shape[3]), dtype=torch.float32, device=q.device)
        chunk = max(1, min(n, _CHUNK_ELEMENTS // max(1, h * n)))
        cols = torch.arange(n, device=q.device)
        for b in range(b_):
            kb = k[b].float().transpose(0, 1)          # (H, N, d)
            vb = v[b].float().transpose(0, 1)
            for i0 in range(0, n, chunk):
                i1 = min(n, i0 + chunk)
                qc = q[b, i0:i1].float().transpose(0, 1)   # (H, c, d)
                s = torch.matmul(qc, kb.transpose(1, 2)) * scale
                if causal:
                    rows = torch.arange(i0, i1, device=q.device)
                    s.masked_fill_(cols[None, :] > rows[:, None], float("-inf"))
                if fp8_probs:
                    e = torch.exp(s - s.amax(dim=-1, keepdim=True))
                    total = e.sum(dim=-1, keepdim=True)
                    p = (e * 256.0).to(torch.float8_e4m3fn).float() / (total * 256.0)
                else:
                    p = torch.softmax(s, dim=-1)
                out[b, i0:i1] = torch.matmul(p, vb).transpose(0, 1)
        return out
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32


@torch.no_grad()
def torch_lowp_attention(q, k, v, causal: bool) -> torch.Tensor:
    """torch's own SDPA (default backend) on the same bf16 / fp16 inputs, as (B, N, H, d)."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=causal)
    return o.transpose(1, 2)


@torch.no_grad()
def error_stats(out: torch.Tensor, ref: torch.Tensor) -> dict:
    nan = int(torch.isnan(out).sum().item())
    diff = (out.float() - ref).abs()
    return {
        "max_abs": float(diff.nan_to_num(float("inf")).max().item()) if diff.numel() else 0.0,
        "mean_abs": float(diff.nan_to_num(float("inf")).mean().item()) if diff.numel() else 0.0,
        "nan": nan,
    }


def judge(kernel_err: dict, torch_err: dict, ref: torch.Tensor) -> dict:
    """Pass if no NaN and max error <= ERROR_RATIO_LIMIT x torch's (plus a tiny floor)."""
    floor = 2.0 ** -12 * max(1.0, float(ref.abs().max().item()))
    limit = ERROR_RATIO_LIMIT * torch_err["max_abs"] + floor
    ratio = kernel_err["max_abs"] / max(torch_err["max_abs"], floor)
    ok = kernel_err["nan"] == 0 and kernel_err["max_abs"] <= limit
    return {"ok": bool(ok), "max_abs": kernel_err["max_abs"], "mean_abs": kernel_err["mean_abs"],
            "nan": kernel_err["nan"], "torch_max_abs": torch_err["max_abs"],
            "error_ratio": ratio, "limit": limit}
