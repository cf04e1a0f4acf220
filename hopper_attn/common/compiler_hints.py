"""Hints to the compiler (device side).

``opaque(x)``: the same Int32, through an inline-PTX `mov` the compiler may not look through
or move. In a persistent kernel's loop over work items, LLVM hoists every loop-invariant
computation out of the loop: the epilogue's 64-128 swizzled shared-memory addresses (one per
register pair of O) are such values, and kept live across the whole main loop they spill
(k6 at d = 256: 264 bytes). Deriving them from `opaque(thread index)` inside the loop makes
them loop-variant, so they are computed where they are used.

``pin(frag)``: the other way round. A tile converted to bf16 once (kb2's dS^T) and read
twice, by an SMEM store and by a register-A WGMMA, was converted twice in the PTX: the
compiler recomputed the conversion next to the WGMMA (after `wgmma.fence`) instead of
keeping the packed registers alive. Passing each 32-bit register through `opaque` makes
the converted value something that cannot be recomputed, so one conversion serves both.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def opaque(x, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.inline_asm(T.i32(), [Int32(x).ir_value(loc=loc, ip=ip)],
                                 "mov.b32 $0, $1;", "=r,r", has_side_effects=True,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def pin(frag: cute.Tensor):
    """Pass every 32-bit register of a register tensor through `opaque` (in place)."""
    packed = cute.recast_tensor(frag, Int32)
    for i in cutlass.range_constexpr(cute.size(packed)):
        packed[i] = opaque(packed[i])
