"""bf16 / fp16 / fp32 -> e4m3 with one scale per (batch, head), on the GPU: two small kernels.

`hopper_attn.quantize.quantize_fp8` runs these on CUDA tensors (unless `fused=False`) instead
of its torch ops (several passes over memory: |x|, its maximum, x * scale, the cast, V's
packing): 4.7x faster for q, k, v at B1 H16 N16k d128 on an H100 (docs/k8.md). Per input
tensor (batch, seqlen, heads, d):

1. `AbsMax`: each CTA reads a range of keys of one (head, batch) slice, 16-byte loads,
   takes max |x| per thread, then per warp (shuffles), and one `atomicMax` per warp into
   amax[batch, head] (fp32, zeroed by the host; non-negative floats order like their bits).
2. `ScaleCast`: reads the slice again, x * scale (fp32; scale = 448 / amax, 1 where amax is
   0, computed between the two launches by torch on the (batch, heads) values, exactly as the
   torch path computes it) converted with `cvt.rn.satfinite.e4m3x2.f32`, and writes it
   either in x's layout or, for V, packed for k7 (`quantize.py`: (batch, heads, d, seqlen16)
   in memory, keys permuted within each 16 as `PERM16`, zeros past the end). Rounding to
   nearest with saturation at +-448 is what the torch path's clamp and cast do, so both
   paths give the same bytes.

With `rotate` (k8's incoherent processing, `quantize_fp8(..., rotate_signs=s)`), both kernels
rotate each key's d values first, x R with R = diag(s) H / sqrt(d), by a fast Walsh-Hadamard
transform on the values the thread and its neighbouring lanes already hold (`hadamard`): the
amax is then the rotated tensor's, and nothing but the key's own d values is needed.

Work split (both kernels alike): a thread owns 16 keys x 8 columns of d (one 16-byte load per
key), so d / 8 lanes cover a key block's d and a warp holds 256 / d key blocks side by side.
Loads of one key are then contiguous across lanes (d * 2 bytes), and for packed V the 8
stores of a thread (one per column of d: 16 permuted keys, 16 bytes) from neighbouring lanes
land next to each other when the warp holds more than one key block. A CTA (4 warps) walks
ITERATIONS such groups of keys.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from hopper_attn.common.layouts import ndhb_view
from hopper_attn.quantize import PERM16     # (the host module imports this one lazily)

VEC = 8                 # columns of d per thread: one 16-byte load of a 16-bit input
BLOCK_KEYS = 16         # keys per thread: one block of packed V
WARPS = 4
ITERATIONS = 4


def packed_view(t: cute.Tensor) -> cute.Tensor:
    """A packed V given as the (B, N16, H, d) view of a (B, H, d, N16) buffer -> (N16, d, H,
    B) with the key mode contiguous and the others 16-byte divisible (16 e4m3 per store)."""
    layout = cute.select(t.layout, mode=[1, 3, 2, 0])
    strides = tuple(s if isinstance(s, int) else cute.assume(s, divby=16) for s in layout.stride)
    return cute.make_tensor(t.iterator, cute.make_layout(layout.shape, stride=strides))


class _KeyBlocks:
    """The work split shared by both kernels (module docstring)."""

    def __init__(self, head_dim: int, packed: bool = False, rotate: bool = False):
        if head_dim % VEC or 32 % (head_dim // VEC) or head_dim > 256:
            raise ValueError(f"fused FP8 quantization: head_dim {head_dim} must be 8, 16, 32, "
                             f"64, 128 or 256")
        self.head_dim = head_dim
        self.packed = packed
        self.rotate = rotate
        self.lanes_per_block = head_dim // VEC
        self.blocks_per_warp = 32 // self.lanes_per_block
        self.keys_per_iteration = WARPS * self.blocks_per_warp * BLOCK_KEYS
        self.keys_per_cta = self.keys_per_iteration * ITERATIONS

    def grid(self, keys, heads, batch):
        return [cute.ceil_div(keys, self.keys_per_cta), heads, batch]

    @cute.jit
    def my_keys(self, block):
        """(first key of this thread's block in the CTA's first iteration, its first column
        of d)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp, lane = tidx // 32, tidx % 32
        key_block = (block * WARPS + warp) * self.blocks_per_warp + lane // self.lanes_per_block
        return key_block * BLOCK_KEYS, (lane % self.lanes_per_block) * VEC

    @cute.jit
    def load_row(self, x: cute.Tensor, key, col, head, batch, frag: cute.Tensor,
                 signs: cute.Tensor):
        """frag <- x[key, col:col + 8] in fp32 (zeros for a key past the end), rotated if
        asked (`signs`: this thread's 8 random signs, from `my_signs`)."""
        if key < x.shape[0]:
            raw = cute.make_rmem_tensor((VEC,), x.element_type)
            cute.autovec_copy(cute.local_tile(x[key, None, head, batch], (VEC,), (col // VEC,)),
                              raw)
            frag.store(raw.load().to(Float32))
        else:
            frag.fill(0.0)
        if cutlass.const_expr(self.rotate):
            self.hadamard(frag, signs)

    @cute.jit
    def my_signs(self, mSigns: cute.Tensor, col) -> cute.Tensor:
        """This thread's 8 random signs s[col:col + 8] (unused without rotation)."""
        signs = cute.make_rmem_tensor((VEC,), Float32)
        if cutlass.const_expr(self.rotate):
            for c in cutlass.range_constexpr(VEC):
                signs[c] = mSigns[col + c]
        return signs

    @cute.jit
    def hadamard(self, frag: cute.Tensor, signs: cute.Tensor):
        """x R for one key, R = diag(s) H / sqrt(d) (k8), on the d values that the
        lanes_per_block lanes of a key block hold, 8 each: with column i = 8 c + k (c the
        lane within the block), H_d[i, j] = H_{d/8}[c, c'] H_8[k, k'], so the fast
        Walsh-Hadamard transform runs its three butterfly stages over k inside the thread and
        its log2(d / 8) stages over c between lanes (one shuffle per value and stage). Every
        lane of the warp takes part (keys past the end hold zeros)."""
        for c in cutlass.range_constexpr(VEC):
            frag[c] = frag[c] * signs[c]
        for stage in cutlass.range_constexpr(VEC.bit_length() - 1):   # inside the thread
            h = 1 << stage
            for i in cutlass.range_constexpr(VEC):
                if cutlass.const_expr((i & h) == 0):
                    a, b = frag[i], frag[i + h]
                    frag[i] = a + b
                    frag[i + h] = a - b
        lane = cute.arch.lane_idx()
        for stage in cutlass.range_constexpr(self.lanes_per_block.bit_length() - 1):  # lanes
            m = 1 << stage
            # the lane of a pair with bit m clear keeps mine + other, the other other - mine
            sign = Float32(1 - 2 * ((lane // m) % 2))
            for i in cutlass.range_constexpr(VEC):
                other = cute.arch.shuffle_sync_bfly(frag[i], offset=m)
                frag[i] = other + sign * frag[i]
        for c in cutlass.range_constexpr(VEC):
            frag[c] = frag[c] * Float32(self.head_dim ** -0.5)


class AbsMax(_KeyBlocks):
    """amax[batch, head] = max |x| over the (head, batch) slice (amax zeroed by the caller)."""

    @cute.jit
    def __call__(self, mX: cute.Tensor, mAmax: cute.Tensor, mSigns: cute.Tensor, stream):
        x = ndhb_view(mX)                                       # (N, d, H, B)
        self.kernel(x, mAmax, mSigns).launch(
            grid=self.grid(x.shape[0], x.shape[2], x.shape[3]), block=[32 * WARPS, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor, mAmax: cute.Tensor, mSigns: cute.Tensor):
        cta, head, batch = cute.arch.block_idx()
        key0, col = self.my_keys(cta * ITERATIONS)
        signs = self.my_signs(mSigns, col)
        row = cute.make_rmem_tensor((VEC,), Float32)
        amax = Float32(0.0)
        for it in cutlass.range(ITERATIONS, unroll=1):
            for r in cutlass.range_constexpr(BLOCK_KEYS):
                self.load_row(x, key0 + it * self.keys_per_iteration + r, col, head, batch, row,
                              signs)
                for c in cutlass.range_constexpr(VEC):
                    amax = cute.arch.fmax(amax, cute.math.absf(row[c]))
        amax = cute.arch.warp_reduction_max(amax)
        if cute.arch.lane_idx() == 0:
            cute.arch.atomic_fmax((mAmax.iterator + batch * mAmax.stride[0]
                                   + head * mAmax.stride[1]).llvm_ptr, amax)


class ScaleCast(_KeyBlocks):
    """out = e4m3(x * scale[batch, head]), saturating; in x's layout, or packed (V)."""

    @cute.jit
    def __call__(self, mX: cute.Tensor, mOut: cute.Tensor, mScale: cute.Tensor,
                 mSigns: cute.Tensor, stream):
        x = ndhb_view(mX)                                       # (N, d, H, B)
        out = packed_view(mOut) if cutlass.const_expr(self.packed) else ndhb_view(mOut)
        self.kernel(x, out, mScale, mSigns).launch(
            grid=self.grid(out.shape[0], x.shape[2], x.shape[3]), block=[32 * WARPS, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor, out: cute.Tensor, mScale: cute.Tensor,
               mSigns: cute.Tensor):
        cta, head, batch = cute.arch.block_idx()
        key0, col = self.my_keys(cta * ITERATIONS)
        signs = self.my_signs(mSigns, col)
        scale = mScale[batch, head]
        block = cute.make_rmem_tensor((BLOCK_KEYS, VEC), Float32)     # [key, column]
        for it in cutlass.range(ITERATIONS, unroll=1):
            first = key0 + it * self.keys_per_iteration
            # every lane loads (zeros past the end), so that the rotation's shuffles see the
            # whole warp; only the stores depend on the key
            for r in cutlass.range_constexpr(BLOCK_KEYS):
                self.load_row(x, first + r, col, head, batch, block[r, None], signs)
                for c in cutlass.range_constexpr(VEC):
                    block[r, c] = block[r, c] * scale
            if first < out.shape[0]:
                if cutlass.const_expr(self.packed):
                    # column c of d: its 16 keys in PERM16 order, one 16-byte store
                    for c in cutlass.range_constexpr(VEC):
                        keys = cute.make_rmem_tensor((BLOCK_KEYS,), Float32)
                        for p in cutlass.range_constexpr(BLOCK_KEYS):
                            keys[p] = block[PERM16[p], c]
                        q = cute.make_rmem_tensor((BLOCK_KEYS,), out.element_type)
                        q.store(keys.load().to(out.element_type))
                        cute.autovec_copy(q, cute.local_tile(out[None, col + c, head, batch],
                                                             (BLOCK_KEYS,),
                                                             (first // BLOCK_KEYS,)))
                else:
                    for r in cutlass.range_constexpr(BLOCK_KEYS):
                        if first + r < out.shape[0]:
                            q = cute.make_rmem_tensor((VEC,), out.element_type)
                            q.store(block[r, None].load().to(out.element_type))
                            cute.autovec_copy(q, cute.local_tile(out[first + r, None, head,
                                                                     batch],
                                                                 (VEC,), (col // VEC,)))
