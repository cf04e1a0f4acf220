"""bf16 -> FP8 (e4m3) inputs for k7, with one fp32 descale per (batch, head).

    q8, k8, v8, descale_q, descale_k, descale_v = quantize_fp8(q, k, v)
    v8_packed, descale_v = quantize_fp8(v, pack_v=True)     # V as k7's kernel loads it

Each (batch, head) slice of a (batch, seqlen, heads, head_dim) tensor is scaled so that its
largest magnitude maps to e4m3's largest finite value, 448, then rounded to nearest
(saturating by the clamp first); x ~= x8 * descale. A per-(batch, head) scale rather than
one per tensor: heads differ in magnitude, and one large head would otherwise push the
others toward e4m3's coarse subnormals. The kernel applies the descales in fp32 (q's and k's
to the scores, v's to the output), so they cost nothing there. This is a separate pass over
memory (its time is reported by bench.py, not counted in the kernel's).

`pack_v=True` writes the e4m3 tensor in the layout k7 loads V in (its TMA fills the V^T ring
directly, docs/k7.md): sequence-major, (batch, heads, head_dim, seqlen16) in memory, seqlen
rounded up to 16 with zeros, and the keys permuted within each 16 as P's k-slots (`PERM16`).
The permutation is a reshape: key 16 t + 8 j + 2 i + c sits at position 16 t + 4 i + 2 j + c,
so the packed buffer seen as (b, h, d, t, i, j, c) and permuted to (b, t, j, i, c, h, d) *is*
V in its logical order, and the quantizer's last step (the cast to e4m3) writes through that
view: packing costs no pass of its own.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0

# position p of each 16 keys of a packed V holds key PERM16[p]: the k-slot order of P as an
# FP8 A operand (common/fp8.py)
PERM16 = (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)


def _scale(x: torch.Tensor) -> torch.Tensor:
    """448 / amax per (batch, head) (1 where a slice is all zeros), fp32."""
    if x.dim() != 4:
        raise ValueError(f"expected (batch, seqlen, heads, head_dim), got {tuple(x.shape)}")
    amax = x.abs().amax(dim=(1, 3)).float()                  # (batch, heads)
    return torch.where(amax > 0, E4M3_MAX / amax, torch.ones_like(amax))


def _packed_as_logical(packed: torch.Tensor) -> torch.Tensor:
    """A (b, h, d, n16) packed buffer as a (b, t, j, i, c, h, d) view in V's key order
    (key 16 t + 8 j + 2 i + c); the matching view of a (b, n16, h, d) tensor is
    `.view(b, n16 // 16, 2, 4, 2, h, d)`."""
    b, h, d, n16 = packed.shape
    return packed.view(b, h, d, n16 // 16, 4, 2, 2).permute(0, 3, 5, 4, 6, 1, 2)


def _blocks_of_16(x: torch.Tensor) -> torch.Tensor:
    b, n16, h, d = x.shape
    return x.view(b, n16 // 16, 2, 4, 2, h, d)


def _padded_to_16(x: torch.Tensor, dtype) -> torch.Tensor:
    """A zero (b, n16, h, d) buffer of `dtype`, n rounded up to 16, and its first n rows as
    a view to fill."""
    b, n, h, d = x.shape
    padded = torch.zeros((b, -(-n // 16) * 16, h, d), dtype=dtype, device=x.device)
    return padded, padded[:, :n]


def _pack(padded: torch.Tensor, dtype) -> torch.Tensor:
    """A (b, n16, h, d) tensor written packed (cast to `dtype` on the way, one pass), as the
    (b, n16, h, d) view of the (b, h, d, n16) buffer."""
    b, n16, h, d = padded.shape
    packed = torch.empty((b, h, d, n16), dtype=dtype, device=padded.device)
    _packed_as_logical(packed).copy_(_blocks_of_16(padded))
    return packed.permute(0, 3, 1, 2)


@torch.no_grad()
def quantize_fp8(*tensors: torch.Tensor, pack_v: bool = False):
    """For each (batch, seqlen, heads, head_dim) tensor: its e4m3 copy; then the descales,
    (batch, heads) fp32 each, in the same order. `pack_v`: the (single) tensor is V, written
    packed for k7 (returned as its (batch, seqlen16, heads, head_dim) view, seqlen16 the
    sequence rounded up to 16)."""
    if pack_v and len(tensors) != 1:
        raise ValueError("pack_v=True quantizes V alone: quantize_fp8(v, pack_v=True)")
    quantized, descales = [], []
    for x in tensors:
        scale = _scale(x)
        if not pack_v:
            scaled = (x * scale[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)   # fp32
            quantized.append(scaled.to(torch.float8_e4m3fn))
        else:
            scaled, rows = _padded_to_16(x, torch.float32)
            torch.mul(x, scale[:, None, :, None], out=rows)
            scaled.clamp_(-E4M3_MAX, E4M3_MAX)
            quantized.append(_pack(scaled, torch.float8_e4m3fn))     # cast + pack, one pass
        descales.append((1.0 / scale).contiguous())
    return (*quantized, *descales)


def pack_v(v8: torch.Tensor) -> torch.Tensor:
    """An e4m3 V (batch, seqlen, heads, d) packed as `quantize_fp8(v, pack_v=True)` packs:
    returned as the (batch, seqlen16, heads, d) view of a (batch, heads, d, seqlen16) buffer."""
    padded, rows = _padded_to_16(v8, torch.uint8)
    rows.copy_(v8.view(torch.uint8))
    return _pack(padded, torch.uint8).view(v8.dtype)


def unpack_v(packed: torch.Tensor, seqlen: int) -> torch.Tensor:
    """`pack_v`'s inverse: (batch, seqlen, heads, d), contiguous."""
    as_buffer = packed.permute(0, 2, 3, 1)                       # (b, h, d, n16), contiguous
    b, h, d, n16 = as_buffer.shape
    out = torch.empty((b, n16, h, d), dtype=torch.uint8, device=packed.device)
    _blocks_of_16(out).copy_(_packed_as_logical(as_buffer.view(torch.uint8)))
    return out[:, :seqlen].contiguous().view(packed.dtype)


def dequantize_fp8(x8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """fp32 x8 * descale (the values the kernel computes with)."""
    return x8.float() * descale[:, None, :, None]
