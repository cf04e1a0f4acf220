"""FP8 (e4m3) pieces of k7 (device side): P as an FP8 operand.

Two layout rules separate an FP8 attention kernel from a 16-bit one (docs/k7.md):

1. An FP8 WGMMA reads its SMEM operands K-major only. S = Q K^T is fine (head_dim is
   contiguous in Q and K). O = P V reduces over the kv index, but V arrives as (kv, d) with d
   contiguous, MN-major for that GEMM: k7 takes V packed sequence-major instead
   (`quantize.pack_v`), and its TMA writes V^T tiles, (d, kv) with kv contiguous.
2. Per thread, an FP8 A operand in registers holds 4 *consecutive* k (bytes) of a row, where
   the fp32 accumulator of S = Q K^T holds pairs of columns 8 apart: k-slot 4q + i of a row
   (q = lane % 4, i = 0..3) would need S column 4q + i, which another thread owns.

The fix of 2 costs nothing. The sum over kv in P V does not depend on the order of kv, as
long as P's columns and V's rows follow the same order. So inside each 16-wide kv block,
k-slot 4q + i takes the S column this thread already has,

    slot 4q + i  <-  S column 2q + (i % 2) + 8 * (i // 2)          (q = 0..3, i = 0..3)

(the accumulator registers c0, c1, c4, c5 of a row, for rows r and r + 8 alike), and V^T's
columns hold V's rows in the same order (`quantize.PERM16`, applied when V is packed). P is
then converted in registers with no shuffle (`probs_to_fp8_operand`).
"""

from __future__ import annotations

import cutlass.cute as cute


def _fp8_operand(shape, stride):
    # S accumulator per thread: ((2, 2, V), MMA_M, MMA_N) = (column pair, rows r / r + 8,
    # V groups of 8 columns). FP8 A operand per k32 slice: ((4 k-slots, 2 rows, 2 halves)).
    # Slot 4q + i of a 16-wide half <- pair element i % 2 of column group i // 2 (see above).
    v = shape[0][2]
    if v % 4:
        raise ValueError("the kv tile must be a multiple of 32 columns to feed a k32 WGMMA")
    s0, s1, s2 = stride[0]
    return (
        (((2, 2), shape[0][1], 2), shape[1], (v // 4, shape[2])),
        (((s0, s2), s1, 2 * s2), stride[1], (4 * s2, stride[2])),
    )


def acc_as_fp8_operand(acc: cute.Tensor) -> cute.Tensor:
    """The S accumulator seen in the FP8 A-operand order (no register moves)."""
    from .layouts import _regrouped
    return cute.make_tensor(acc.iterator, _regrouped(acc.layout, _fp8_operand))


@cute.jit
def probs_to_fp8_operand(acc_s: cute.Tensor, p_frag: cute.Tensor):
    """P (fp32, S's registers) -> e4m3 A operand of O += P V (cvt.rn.satfinite.e4m3x2)."""
    p = acc_as_fp8_operand(acc_s)
    p_frag.store(p.load().to(p_frag.element_type))
