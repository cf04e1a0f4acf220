"""bf16 -> FP8 (e4m3) inputs for k7, with one fp32 descale per (batch, head).

    q8, k8, v8, descale_q, descale_k, descale_v = quantize_fp8(q, k, v)
    v8_packed, descale_v = quantize_fp8(v, pack_v=True)     # V as k7's kernel loads it
    q8, k8, descale_q, descale_k = quantize_qk_f16_scores(q, k, softmax_scale)

The last form is what k7 with fp16 scores (its default at head_dim 128, and 256 without a
mask) needs for q and k: scales that keep every q8 . k8 within fp16's range and make the
scores' factor a power of two (`quantize_qk_f16_scores`, `check_f16_scores`, at the end).

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

On CUDA tensors it runs two small CuTe DSL kernels instead of torch's passes over memory
(common/fp8_quantize.py: one pass for the per-(batch, head) amax, one that scales, casts
and, for V, packs; k8's rotation fused into both); they give the same bytes (measured:
tests/test_gpu.py) at 4.7x the speed (q, k, v at B1 H16 N16k d128 on an H100: 0.35 against
1.63 ms). `fused=False` forces the torch ops (the reference), `fused=True` the kernels (head
dims that divide 256, d contiguous, 16-byte aligned).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

E4M3_MAX = 448.0

# position p of each 16 keys of a packed V holds key PERM16[p]: the k-slot order of P as an
# FP8 A operand (common/fp8.py)
PERM16 = (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)


def _scale(x: torch.Tensor) -> torch.Tensor:
    """448 / amax per (batch, head) (1 where a slice is all zeros), fp32."""
    if x.dim() != 4:
        raise ValueError(f"expected (batch, seqlen, heads, head_dim), got {tuple(x.shape)}")
    return _scale_from_amax(_amax_in_torch(x))


def _amax_in_torch(x: torch.Tensor) -> torch.Tensor:
    """amax per (batch, head), fp32 (batch, heads)."""
    return x.abs().amax(dim=(1, 3)).float()


def _cast_in_torch(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x times scale per (batch, head), clamped to e4m3's range, rounded to e4m3."""
    return (x * scale[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _max_row_norm(x: torch.Tensor) -> torch.Tensor:
    """The largest row norm (over head_dim) per (batch, head), fp32 (batch, heads)."""
    x = x.float() if x.element_size() == 1 else x          # (no fp32 accumulation for e4m3)
    return torch.linalg.vector_norm(x, dim=3, dtype=torch.float32).amax(dim=1)


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """448 / amax, 1 where amax is 0: one formula for the torch path and the GPU kernels'
    (whose bytes must agree)."""
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
def quantize_fp8(*tensors: torch.Tensor, pack_v: bool = False, fused: Optional[bool] = None,
                 rotate_signs: Optional[torch.Tensor] = None):
    """For each (batch, seqlen, heads, head_dim) tensor: its e4m3 copy; then the descales,
    (batch, heads) fp32 each, in the same order. `pack_v`: the (single) tensor is V, written
    packed for k7 (returned as its (batch, seqlen16, heads, head_dim) view, seqlen16 the
    sequence rounded up to 16). `rotate_signs`: (head_dim,) random signs s; each tensor is
    first rotated, x R with R = diag(s) H / sqrt(head_dim) (k8's incoherent processing).
    `fused`: with the GPU kernels of common/fp8_quantize.py (the same bytes without
    rotation; with it, the same up to fp32 rounding in the rotation); True raises ValueError
    for what they do not support (`fused_unsupported`), None (the default) uses them where
    they can and torch ops elsewhere (e.g. on the CPU), False always torch ops."""
    if pack_v and len(tensors) != 1:
        raise ValueError("pack_v=True quantizes V alone: quantize_fp8(v, pack_v=True)")
    quantized, descales = [], []
    for x in tensors:
        reason = fused_unsupported(x, rotate_signs is not None) if fused is not False else "off"
        if fused and reason:
            raise ValueError(f"quantize_fp8(fused=True): {reason}")
        if not reason:
            x8, scale = _quantize_on_gpu(x, pack_v, rotate_signs)
        else:
            if rotate_signs is not None:
                x = torch.matmul(x.float(), rotation_matrix(rotate_signs.to(x.device)))
            x8, scale = _quantize_in_torch(x, pack_v)
        quantized.append(x8)
        descales.append((1.0 / scale).contiguous())
    return (*quantized, *descales)


def _quantize_in_torch(x: torch.Tensor, pack_v: bool):
    """(e4m3 copy, scale) with torch ops."""
    scale = _scale(x)
    if not pack_v:
        return _cast_in_torch(x, scale), scale
    scaled, rows = _padded_to_16(x, torch.float32)
    torch.mul(x, scale[:, None, :, None], out=rows)
    scaled.clamp_(-E4M3_MAX, E4M3_MAX)
    return _pack(scaled, torch.float8_e4m3fn), scale                 # cast + pack, one pass


def hadamard(d: int) -> torch.Tensor:
    """The d x d Sylvester Hadamard matrix (fp32 entries +-1); d a power of two."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, got {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@functools.lru_cache(maxsize=None)
def _hadamard_on(d: int, device: str) -> torch.Tensor:
    """`hadamard(d)` on `device`, built and copied once (read only)."""
    return hadamard(d).to(device)


def rotation_matrix(signs: torch.Tensor) -> torch.Tensor:
    """R = diag(s) H / sqrt(d) (fp32, orthogonal) for a (d,) vector of signs s, on s's
    device."""
    d = signs.shape[0]
    return signs.float()[:, None] * _hadamard_on(d, str(signs.device)) / math.sqrt(d)


FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FUSED_KERNELS: dict = {}


def fused_unsupported(x: torch.Tensor, rotate: bool = False):
    """Why the GPU quantizer cannot take `x` (None if it can)."""
    if x.dim() != 4:
        return f"expected (batch, seqlen, heads, head_dim), got {tuple(x.shape)}"
    d = x.shape[-1]
    if not x.is_cuda:
        return f"x is on {x.device}, the fused quantizer runs on a CUDA device"
    if x.dtype not in FUSED_DTYPES:
        return f"dtype {x.dtype} (bf16, fp16 or fp32)"
    if d % 8 or 256 % d:
        return f"head_dim {d} (a multiple of 8 that divides 256)"
    if rotate and d < 8:
        return f"head_dim {d}: the rotation needs at least 8"
    if x.stride(-1) != 1 or any(s % 8 for s in x.stride()[:-1]) or x.data_ptr() % 16:
        return "head_dim must be contiguous, the other strides multiples of 8, the data 16-byte aligned"
    return None


def _fused_kernel(kind: str, head_dim: int, packed: bool, rotate: bool, dtype, device,
                  compile_options: str = ""):
    """The compiled AbsMax ("amax") / ScaleCast ("cast") kernel for (head_dim, packed, rotate,
    input dtype) and whether it takes torch tensors (TVM-FFI), cached (compiles on a machine
    without a GPU too, for the CPU tests)."""
    from hopper_attn.common import cute_runtime as rt
    ffi = rt.tvm_ffi_available() and device.type == "cuda"
    key = (kind, head_dim, packed, rotate, dtype, compile_options, ffi)
    if key not in _FUSED_KERNELS:
        from hopper_attn.common.fp8_quantize import AbsMax, ScaleCast
        x = torch.empty((2, 32, 2, head_dim), dtype=dtype, device=device)
        stats = torch.zeros((2, 2), dtype=torch.float32, device=device)
        signs = torch.ones(head_dim, dtype=torch.float32, device=device)
        if kind == "amax":
            compiled = rt.compile_with_tensors(AbsMax(head_dim, rotate=rotate), x, stats, signs,
                                               options=compile_options, tvm_ffi=ffi)
        else:
            compiled = rt.compile_with_tensors(
                ScaleCast(head_dim, packed, rotate), x, _fp8_output(x, packed), stats, signs,
                options=compile_options, tvm_ffi=ffi, leading_dims={1: 1} if packed else None)
        _FUSED_KERNELS[key] = (compiled, ffi)
    return _FUSED_KERNELS[key]


def _launch(kernel, *tensors, leading_dims=None):
    """Run a `_fused_kernel` on torch tensors (converted to CuTe tensors without TVM-FFI)."""
    from hopper_attn.common import cute_runtime as rt
    compiled, ffi = kernel
    if ffi:
        compiled(*tensors)
    else:
        leading_dims = leading_dims or {}
        compiled(*[rt.to_cute_tensor(t, leading_dim=leading_dims.get(i))
                   for i, t in enumerate(tensors)], rt.current_stream())


def _fp8_output(x: torch.Tensor, packed: bool) -> torch.Tensor:
    """An e4m3 tensor for x's quantized copy: contiguous (b, n, h, d), or packed (the (b, n16,
    h, d) view of a (b, h, d, n16) buffer)."""
    b, n, h, d = x.shape
    if not packed:
        return torch.empty((b, n, h, d), dtype=torch.float8_e4m3fn, device=x.device)
    buffer = torch.empty((b, h, d, -(-n // 16) * 16), dtype=torch.float8_e4m3fn, device=x.device)
    return buffer.permute(0, 3, 1, 2)


_NO_SIGNS: dict = {}


def _quantize_on_gpu(x: torch.Tensor, packed: bool, rotate_signs: Optional[torch.Tensor]):
    """(e4m3 copy, scale) with the two kernels; the scale (448 / amax, 1 for an all-zero
    slice) is computed between them by `_scale`'s formula."""
    scale = _scale_from_amax(_amax_on_gpu(x, rotate_signs))
    return _cast_on_gpu(x, scale, packed, rotate_signs), scale


def _signs_for(x: torch.Tensor, rotate_signs: Optional[torch.Tensor]) -> torch.Tensor:
    """The kernels' signs argument: the rotation's, or ones (not read; one per (d, device))."""
    if rotate_signs is not None:
        return rotate_signs.to(device=x.device, dtype=torch.float32).contiguous()
    key = (x.shape[-1], x.device)
    signs = _NO_SIGNS.get(key)
    if signs is None:
        signs = _NO_SIGNS[key] = torch.ones(x.shape[-1], dtype=torch.float32, device=x.device)
    return signs


def _amax_on_gpu(x: torch.Tensor, rotate_signs: Optional[torch.Tensor]) -> torch.Tensor:
    """amax per (batch, head) of x (rotated first with rotate_signs), fp32, by AbsMax."""
    b, n, h, d = x.shape
    amax = torch.zeros((b, h), dtype=torch.float32, device=x.device)
    _launch(_fused_kernel("amax", d, False, rotate_signs is not None, x.dtype, x.device), x,
            amax, _signs_for(x, rotate_signs))
    return amax


def _cast_on_gpu(x: torch.Tensor, scale: torch.Tensor, packed: bool,
                 rotate_signs: Optional[torch.Tensor]) -> torch.Tensor:
    """x (rotated first with rotate_signs) times scale per (batch, head), to e4m3, by
    ScaleCast."""
    out = _fp8_output(x, packed)
    _launch(_fused_kernel("cast", x.shape[-1], packed, rotate_signs is not None, x.dtype,
                          x.device), x, out, scale, _signs_for(x, rotate_signs),
            leading_dims={1: 1} if packed else None)
    return out


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


# k7's `s_f16` (S = Q K^T accumulated in fp16): every partial sum of q8 . k8 must stay within
# fp16's range (65,504). By Cauchy-Schwarz a partial sum is at most |q8 row| |k8 row|; the
# limit leaves a factor 2 of headroom and e4m3's rounding (each element up to 1/16 larger).
F16_SCORE_LIMIT = 2.0 ** 15 / (1.0 + 1.0 / 16) ** 2
F16_SMALLEST_NORMAL = 2.0 ** -14


@torch.no_grad()
def quantize_qk_f16_scores(q: torch.Tensor, k: torch.Tensor, softmax_scale: float,
                           rotate_signs: Optional[torch.Tensor] = None,
                           fused: Optional[bool] = None):
    """(q8, k8, descale_q, descale_k) for k7's fp16 scores (`s_f16`).

    Per (batch, head) as `quantize_fp8`, but with two more constraints: the largest row norms
    of q8 and k8 multiply to at most F16_SCORE_LIMIT (no fp16 overflow in the WGMMA), and
    softmax_scale * log2(e) * descale_q * descale_k, the factor the kernel multiplies fp16
    scores by, is a power of two in fp16's normal range (exact in fp16). k takes up to the
    square root of the limit (or 448 / amax); each q head the rest, then rounds its scale
    down to make the factor a power of two (at most one bit of e4m3's range). On the GPU the
    amax and cast passes are `quantize_fp8`'s kernels (`fused` as there); the row norms are
    one torch reduction each (a rotation leaves them unchanged)."""
    rotate = rotate_signs is not None
    reasons = [fused_unsupported(x, rotate) for x in (q, k)] if fused is not False else ["off"]
    reason = next((r for r in reasons if r), None)
    if fused and reason:
        raise ValueError(f"quantize_qk_f16_scores(fused=True): {reason}")
    if reason and rotate:
        r = rotation_matrix(rotate_signs.to(q.device))
        q, k = torch.matmul(q.float(), r), torch.matmul(k.float(), r)
    if reason:
        amax_q, amax_k = _amax_in_torch(q), _amax_in_torch(k)
    else:
        amax_q, amax_k = _amax_on_gpu(q, rotate_signs), _amax_on_gpu(k, rotate_signs)
    norm_q, norm_k = _max_row_norm(q), _max_row_norm(k)              # (B, H), (B, Hkv)
    group = q.shape[2] // k.shape[2]
    tiny = torch.finfo(torch.float32).tiny
    scale_k = torch.minimum(E4M3_MAX / amax_k.clamp_min(tiny),
                            math.sqrt(F16_SCORE_LIMIT) / norm_k.clamp_min(tiny))
    scale_k_q = scale_k.repeat_interleave(group, dim=1)                # k's, per q head
    norm_k8 = (norm_k * scale_k).repeat_interleave(group, dim=1)
    scale_q = torch.minimum(E4M3_MAX / amax_q.clamp_min(tiny),
                            F16_SCORE_LIMIT / (norm_k8 * norm_q).clamp_min(tiny))
    scale_log2 = softmax_scale * math.log2(math.e)
    factor = torch.exp2(torch.ceil(torch.log2(scale_log2 / (scale_q * scale_k_q))))
    scale_q = scale_log2 / (factor.clamp_min(F16_SMALLEST_NORMAL) * scale_k_q)
    if reason:
        q8, k8 = _cast_in_torch(q, scale_q), _cast_in_torch(k, scale_k)
    else:
        q8, k8 = [_cast_on_gpu(x, sc, False, rotate_signs)
                  for x, sc in ((q, scale_q), (k, scale_k))]
    return q8, k8, (1.0 / scale_q).contiguous(), (1.0 / scale_k).contiguous()


@torch.no_grad()
def check_f16_scores(q8: torch.Tensor, k8: torch.Tensor, descale_q: torch.Tensor,
                     descale_k: torch.Tensor, softmax_scale: float) -> None:
    """Raise ValueError unless e4m3 q8, k8 (batch, seqlen, heads, head_dim) and their
    descales are fit for k7's fp16 scores (`s_f16`): every partial sum of q8 . k8 within
    fp16's range (the product of the largest row norms of a q head and its k head at most
    2^15, half of fp16's largest value) and softmax_scale log2(e) dq dk a power of two at
    least 2^-14. `quantize_qk_f16_scores` guarantees both; for FP8 inputs made elsewhere this
    is the check to run once (it reads q8 and k8 and waits for the GPU)."""
    group = q8.shape[2] // k8.shape[2]
    worst = (_max_row_norm(q8) * _max_row_norm(k8).repeat_interleave(group, dim=1)).max().item()
    if worst > 2.0 ** 15:
        raise ValueError(f"q8 . k8 may reach {worst:.0f} (row norms), past fp16's safe 2^15: "
                         "quantize q and k with quantize_qk_f16_scores, or run k7 with "
                         "s_f16=False")
    factor = (softmax_scale * math.log2(math.e) * descale_q.float()
              * descale_k.float().repeat_interleave(group, dim=1))
    exponent = torch.log2(factor)
    if not (torch.allclose(exponent, exponent.round(), atol=1e-5)
            and (factor >= F16_SMALLEST_NORMAL * (1 - 1e-6)).all()):
        raise ValueError("softmax_scale * log2(e) * descale_q * descale_k must be a power of "
                         "two >= 2^-14 for fp16 scores (quantize_qk_f16_scores makes it one)")
