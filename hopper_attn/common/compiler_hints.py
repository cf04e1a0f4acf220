"""Hints to the compiler (device side).

``opaque(x)``: the same Int32, through an inline-PTX `mov` the compiler may not look through
or move. In a persistent kernel's loop over work items, LLVM hoists every loop-invariant
computation out of the loop: the epilogue's 64-128 swizzled shared-memory addresses (one per
register pair of O) are such values, and kept live across the whole main loop they spill
(k6 at d = 256: 264 bytes). Deriving them from `opaque(thread index)` inside the loop makes
them loop-variant, so they are computed where they are used.
"""

from __future__ import annotations

from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def opaque(x, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.inline_asm(T.i32(), [Int32(x).ir_value(loc=loc, ip=ip)],
                                 "mov.b32 $0, $1;", "=r,r", has_side_effects=True,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))
