"""bf16 -> FP8 (e4m3) inputs for k7, with one fp32 descale per (batch, head).

    q8, k8, v8, descale_q, descale_k, descale_v = quantize_fp8(q, k, v)

Each (batch, head) slice of a (batch, seqlen, heads, head_dim) tensor is scaled so that its
largest magnitude maps to e4m3's largest finite value, 448, then rounded to nearest
(`torch.Tensor.to(torch.float8_e4m3fn)`, saturating by the clamp first); x ~= x8 * descale.
A per-(batch, head) scale rather than one per tensor: heads differ in magnitude, and one
large head would otherwise push the others toward e4m3's coarse subnormals. The kernel
applies the descales in fp32 (q's and k's to the scores, v's to the output), so they cost
nothing there. This is a separate pass over memory (its time is reported by bench.py, not
counted in the kernel's).
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


@torch.no_grad()
def quantize_fp8(*tensors: torch.Tensor):
    """For each (batch, seqlen, heads, head_dim) tensor: its e4m3 copy; then the descales,
    (batch, heads) fp32 each, in the same order."""
    quantized, descales = [], []
    for x in tensors:
        if x.dim() != 4:
            raise ValueError(f"expected (batch, seqlen, heads, head_dim), got {tuple(x.shape)}")
        amax = x.abs().amax(dim=(1, 3)).float()                  # (batch, heads)
        scale = torch.where(amax > 0, E4M3_MAX / amax, torch.ones_like(amax))
        x8 = (x.float() * scale[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
        quantized.append(x8.to(torch.float8_e4m3fn))
        descales.append((1.0 / scale).contiguous())
    return (*quantized, *descales)


def dequantize_fp8(x8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """fp32 x8 * descale (the values the kernel computes with)."""
    return x8.float() * descale[:, None, :, None]
