"""Online softmax with deferred normalization (device side), shared by every fused kernel.

A thread holds some rows of the current score tile S (as a [row, col] register view) and the
matching rows of the output accumulator O. The rows are split across ``lanes_per_row``
neighbouring lanes of a warp (16 in the CUDA-core kernels, 4 in the WGMMA ones), so row
maxima are combined with butterfly shuffles; row sums stay per-thread partials until the end.

For each new kv tile, per row (all in base 2: x * scale * log2(e) is folded into one FMA):

    m_new = max(m_old, max_j s_j)
    alpha = 2^((m_old - m_new) * scale_log2)        rescales what was accumulated so far
    p_j   = 2^(s_j * scale_log2 - m_new * scale_log2)
    l     = l * alpha + sum_j p_j
    O     = O * alpha   (by the caller, before adding P V)

At the end O is divided by l once. Masked scores are -inf; a row whose scores are all -inf
so far keeps m = -inf, and we subtract 0 instead of -inf so no NaN appears (exp2(-inf) = 0).
A row with l = 0 at the end (nothing visible) is written as 0, not NaN.
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from hopper_attn.common.contract import LOG2_E
from hopper_attn.common.layouts import acc_rows_cols, operand_a_as_acc

LN_2 = 0.6931471805599453

# 2^x without the SFU (MUFU.EX2): with t = x + 1.5 * 2^23 rounded to an integer j in t's low
# mantissa bits, f = x - j in [-0.5, 0.5], 2^x = 2^j * 2^f, where 2^f is a cubic
# 1 + c1 f + c2 f^2 + c3 f^3 (relative error < 2.1e-4, fitted here in relative terms) and 2^j
# is added to the result's exponent field: bits(t) << 23 is j << 23 (the rest of t's bits
# shift out). x is clamped at -127 and the cubic is exactly 1 at f = 0, so 2^-inf (a masked
# score) comes out as exactly +0 (exponent field 0, mantissa 0), as MUFU.EX2 gives; results
# below 2^-126 are tiny non-negative subnormals, not exact.
# Three FADDs, three FFMAs, one shift-add and a max: on the FMA and ALU pipes, which k7's
# softmax leaves mostly idle while the SFU is the busiest pipe of its loop.
_EXP2_FMA_PTX = """{
 .reg .f32 x, t, j, f, p;
 .reg .b32 tb, pb;
 max.f32 x, $1, 0fC2FE0000;
 add.rn.f32 t, x, 0f4B400000;
 sub.rn.f32 j, t, 0f4B400000;
 sub.rn.f32 f, x, j;
 fma.rn.f32 p, f, 0f3D59A02E, 0f3E78574E;
 fma.rn.f32 p, p, f, 0f3F319B9C;
 fma.rn.f32 p, p, f, 0f3F800000;
 mov.b32 tb, t;
 mov.b32 pb, p;
 shl.b32 tb, tb, 23;
 add.s32 pb, pb, tb;
 mov.b32 $0, pb;
}"""


@dsl_user_op
def opaque(x: Float32, *, loc=None, ip=None) -> Float32:
    """x, through a PTX move the compiler cannot see into: it can no longer recompute the
    expression behind x where x is used again (OnlineSoftmax.opaque_exp2)."""
    return Float32(llvm.inline_asm(Float32.mlir_type, [Float32(x).ir_value(loc=loc, ip=ip)],
                                   "mov.b32 $0, $1;", "=f,f", has_side_effects=False,
                                   is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                                   loc=loc, ip=ip))


@dsl_user_op
def exp2_on_fma(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x computed with FMA-pipe instructions instead of MUFU.EX2 (see above)."""
    return Float32(llvm.inline_asm(Float32.mlir_type, [Float32(x).ir_value(loc=loc, ip=ip)],
                                   _EXP2_FMA_PTX, "=f,f", has_side_effects=False,
                                   is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                                   loc=loc, ip=ip))


@dsl_user_op
def tanh_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """tanh(x) by `tanh.approx.f32` (one MUFU.TANH; relative error about 2^-11): the logit
    softcap's transform (`softcap_scores`)."""
    return Float32(llvm.inline_asm(Float32.mlir_type, [Float32(x).ir_value(loc=loc, ip=ip)],
                                   "tanh.approx.f32 $0, $1;", "=f,f", has_side_effects=False,
                                   is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                                   loc=loc, ip=ip))


def softcap_scales(scale_log2, cap: float):
    """(the scores' factor before the tanh, the softmax's scale_log2) for logit softcapping
    with `cap` (0: none, (None, scale_log2)): tanh(s * scale / cap), then exponents in units
    of cap log2(e), so the kernel's one runtime scalar stays the softmax scale."""
    if cap <= 0.0:
        return None, scale_log2
    return scale_log2 * (1.0 / (cap * LOG2_E)), Float32(cap * LOG2_E)


@cute.jit
def softcap_scores(s_rc: cute.Tensor, prescale: Float32):
    """Logit softcapping, in place on raw q.k scores (before any mask: tanh(-inf) would be
    -1): s -> tanh(s * prescale), prescale = softmax_scale / cap. The caller's softmax then
    runs with scale_log2 = cap * log2(e), so its exponents are cap * tanh(s * scale / cap) in
    base 2, and its LSE the natural-log LSE of the capped scores. One MUFU.TANH per score on
    top of the exp2's MUFU.EX2 (docs/softcap.md: the cheaper tanhs tried)."""
    for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
            s_rc[r, c] = tanh_approx(s_rc[r, c] * prescale)


# A 32-bit register `{w}` of two 16-bit values (the first in the lower half) widened to fp32
# $0, $1, exactly. A bf16 is the upper half of an fp32, so that is a shift and a mask (ptxas
# turns cvt.f32.bf16 into a byte permute and a shift per value); f16 needs `lo, hi` declared.
_WIDEN_PTX = {
    BFloat16: """
 shl.b32 $0, {w}, 16;
 and.b32 $1, {w}, 0xffff0000;""",
    Float16: """
 mov.b32 {{lo, hi}}, {w};
 cvt.f32.f16 $0, lo;
 cvt.f32.f16 $1, hi;""",
}
# a pair of fp32 values rounded to the 16-bit type P is converted to for the PV GEMM, and
# widened back: what the tensor cores will multiply V by (cvt.rn.*x2 packs $3 into the
# upper half, $2 into the lower)
_ROUND_PAIR_PTX = {
    BFloat16: "{\n .reg .b32 p;\n cvt.rn.bf16x2.f32 p, $3, $2;"
              + _WIDEN_PTX[BFloat16].format(w="p") + "\n}",
    Float16: "{\n .reg .b32 p;\n .reg .b16 lo, hi;\n cvt.rn.f16x2.f32 p, $3, $2;"
             + _WIDEN_PTX[Float16].format(w="p") + "\n}",
}


# a 32-bit register of the PV operand -> its two values in fp32 (add_operand_sums)
_UNPACK_PAIR_PTX = {
    BFloat16: "{" + _WIDEN_PTX[BFloat16].format(w="$2") + "\n}",
    Float16: "{\n .reg .b16 lo, hi;" + _WIDEN_PTX[Float16].format(w="$2") + "\n}",
}


@dsl_user_op
def unpack_pair(word: Int32, dtype, *, loc=None, ip=None):
    """The two `dtype` (BFloat16 or Float16) values of a 32-bit register, in fp32
    (OnlineSoftmax.add_operand_sums)."""
    f32 = Float32.mlir_type
    pair = llvm.inline_asm(llvm.StructType.get_literal([f32, f32]),
                           [Int32(word).ir_value(loc=loc, ip=ip)], _UNPACK_PAIR_PTX[dtype],
                           "=f,=f,r", has_side_effects=False, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return (Float32(llvm.extractvalue(f32, pair, [0], loc=loc, ip=ip)),
            Float32(llvm.extractvalue(f32, pair, [1], loc=loc, ip=ip)))


@dsl_user_op
def round_pair(a: Float32, b: Float32, dtype, *, loc=None, ip=None):
    """(a, b) rounded to `dtype` (BFloat16 or Float16) and back to fp32
    (OnlineSoftmax.round_p)."""
    pair = llvm.inline_asm(llvm.StructType.get_literal([Float32.mlir_type, Float32.mlir_type]),
                           [Float32(a).ir_value(loc=loc, ip=ip),
                            Float32(b).ir_value(loc=loc, ip=ip)],
                           _ROUND_PAIR_PTX[dtype],
                           "=f,=f,f,f", has_side_effects=False,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                           loc=loc, ip=ip)
    return (Float32(llvm.extractvalue(Float32.mlir_type, pair, [0], loc=loc, ip=ip)),
            Float32(llvm.extractvalue(Float32.mlir_type, pair, [1], loc=loc, ip=ip)))


@dataclasses.dataclass(frozen=True)   # frozen: register arrays are updated in place, never rebound
class OnlineSoftmax:
    num_rows: int
    lanes_per_row: int
    scale_log2: Float32
    row_max: cute.Tensor
    row_sum: cute.Tensor
    # p_j = 2^(s_j * scale_log2 - m * scale_log2 + p_scale_log2): k7 puts the largest
    # probability at 2^8 = 256 (e4m3 reaches 448), so that small ones stay above e4m3's
    # smallest subnormal (2^-9) after P is quantized; l carries the same factor, so O = P V / l
    # is unchanged. 0 (a constant) adds no code.
    p_scale_log2: int = 0
    # every n-th column's exp2 on the FMA pipe (`exp2_on_fma`) instead of the SFU (0: none)
    fma_exp2_every: int = 0
    # a memory fence after this many of a tile's exp2s (-1: none). ptxas moves no instruction
    # across a fence, so a wait the caller writes after the softmax can rise only this far
    # (k6's pv_wait="after<n>": what follows the wait then interleaves with the other exp2s)
    fence_after: int = -1
    # each exp2 result through `opaque`: with a fence in the tile, the compiler otherwise
    # recomputes some exp2s for P's conversion after it (23 more per tile on k6's 192-row
    # d = 64 tile, docs/lab/k6.md "Exp2s computed twice")
    opaque_exp2: bool = False
    # `exponentiate` rounds P to the PV operand's type (BFloat16 or Float16; None: no)
    # before the row sums, so that l adds the weights the tensor cores multiply V by. With a
    # reference maximum that trails the true one (lazy rescaling), a row's largest P is no longer
    # exactly 1 and is rounded like the others; summed unrounded, l and P V disagree by up
    # to that rounding in rows that a few keys dominate (docs/lab/k6.md "Lazy rescaling with
    # rounded sums")
    round_p: object = None
    # logit softcapping (`softcap_scores`): the raw scores' factor before the tanh,
    # softmax_scale / cap (None: no softcap; scale_log2 is then cap * log2(e))
    softcap_prescale: object = None
    # the scores are bounded (softcapped: |t| <= 1), so every row's exponents are taken
    # against a fixed reference maximum of 0 (row_max stays 0): no running maximum, no
    # rescaling, P in [2^-scale_log2, 2^scale_log2], which fp32 and bf16 hold for
    # scale_log2 <= 100 (`exponentiate` only; `finalize` and the LSE as usual)
    fixed_max: bool = False
    # with round_p: `exponentiate` leaves l alone, and the caller adds each tile's sums from
    # the PV operand once P is converted to it (`add_operand_sums`): P converted once, not
    # rounded in `exponentiate` and converted again
    operand_sums: bool = False

    @staticmethod
    def create(num_rows: int, scale_log2: Float32, lanes_per_row: int,
               p_scale_log2: int = 0, fma_exp2_every: int = 0,
               fence_after: int = -1, opaque_exp2: bool = False,
               round_p=None, softcap_prescale=None, fixed_max: bool = False,
               operand_sums: bool = False) -> "OnlineSoftmax":
        row_max = cute.make_rmem_tensor((num_rows,), Float32)
        row_sum = cute.make_rmem_tensor((num_rows,), Float32)
        row_max.fill(0.0 if fixed_max else -Float32.inf)
        row_sum.fill(0.0)
        return OnlineSoftmax(num_rows, lanes_per_row, scale_log2, row_max, row_sum,
                             p_scale_log2, fma_exp2_every, fence_after, opaque_exp2, round_p,
                             softcap_prescale, fixed_max, operand_sums)

    def with_scale(self, scale_log2: Float32) -> "OnlineSoftmax":
        """The same row state with another score scale (k7: per (batch, head) descales)."""
        return dataclasses.replace(self, scale_log2=scale_log2)

    def reset(self):
        """Start a new set of rows (a persistent kernel's next work item)."""
        self.row_max.fill(0.0 if self.fixed_max else -Float32.inf)
        self.row_sum.fill(0.0)

    def quad_max(self, partial_max):
        """Max over the `lanes_per_row` lanes that share a row. The partial max is cast to
        Float32 first: the library's warp_reduction_max picks `fmax` (one `max.f32`,
        FMNMX) only for a Float32 argument, and a plain reduce() result would get a
        NaN-propagating compare-and-select (four PTX instructions) at the first step."""
        return cute.arch.warp_reduction_max(Float32(partial_max),
                                            threads_in_group=self.lanes_per_row)

    @cute.jit
    def step(self, s_rc: cute.Tensor) -> cute.Tensor:
        """Turn the scores in `s_rc` into unnormalized probabilities, in place.

        Returns the per-row factor alpha by which the caller must rescale O.
        """
        alpha = cute.make_rmem_tensor((self.num_rows,), Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            row = s_rc[r, None].load()
            tile_max = self.quad_max(row.reduce(cute.ReductionOp.MAX, -Float32.inf, 0))
            m_old = self.row_max[r]
            m_new = cute.arch.fmax(m_old, tile_max)
            self.row_max[r] = m_new
            m_safe = 0.0 if m_new == -Float32.inf else m_new
            m_scaled = m_safe * self.scale_log2
            alpha[r] = cute.math.exp2(m_old * self.scale_log2 - m_scaled, fastmath=True)
            if cutlass.const_expr(self.p_scale_log2 != 0):
                m_scaled = m_scaled - Float32(self.p_scale_log2)
            p = self.exp2_row(s_rc, r, row, m_scaled)
            self.row_sum[r] = self.row_sum[r] * alpha[r] + p.reduce(cute.ReductionOp.ADD, 0.0, 0)
        return alpha

    @cute.jit
    def exp2_row(self, s_rc: cute.Tensor, r, row, m_scaled):
        """Row r of S (its scores `row`) -> 2^(s * scale_log2 - m_scaled), in place and
        returned; every fma_exp2_every-th column on the FMA pipe."""
        if cutlass.const_expr(self.fma_exp2_every == 0 and self.fence_after < 0
                              and not self.opaque_exp2):
            p = cute.math.exp2(row * self.scale_log2 - m_scaled, fastmath=True)
            s_rc[r, None].store(p)
        else:
            every = self.fma_exp2_every
            cols = cute.size(s_rc, mode=[1])
            for c in cutlass.range_constexpr(cols):
                x = s_rc[r, c] * self.scale_log2 - m_scaled
                if cutlass.const_expr(every > 0 and c % every == every - 1):
                    s_rc[r, c] = exp2_on_fma(x)
                elif cutlass.const_expr(self.opaque_exp2):
                    s_rc[r, c] = opaque(cute.math.exp2(x, fastmath=True))
                else:
                    s_rc[r, c] = cute.math.exp2(x, fastmath=True)
                if cutlass.const_expr(r * cols + c + 1 == self.fence_after):
                    cute.arch.fence_acq_rel_cta()
            p = s_rc[r, None].load()
        return p

    # --- the same step in three parts, for a loop that rescales O only when it must
    # (k6's lazy rescales): row_max is then a *reference* maximum that may trail the true
    # one by up to `threshold_log2` (in exp2 units), so p_j <= 2^threshold_log2 (times
    # 2^p_scale_log2); O and l stay consistent with it, so O / l is unchanged.

    @cute.jit
    def running_max(self, s_rc: cute.Tensor) -> cute.Tensor:
        """max(reference max, this tile's row max), per row; changes nothing."""
        m_new = cute.make_rmem_tensor((self.num_rows,), Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            tile_max = self.quad_max(s_rc[r, None].load().reduce(cute.ReductionOp.MAX,
                                                                  -Float32.inf, 0))
            m_new[r] = cute.arch.fmax(self.row_max[r], tile_max)
        return m_new

    @cute.jit
    def needs_rescale(self, m_new: cute.Tensor, threshold_log2: float):
        """True for the whole warp if any of its rows' maxima grew by more than
        2^threshold_log2 (a first finite maximum always counts; -inf to -inf never)."""
        grew = False
        for r in cutlass.range_constexpr(self.num_rows):
            grew = grew or (m_new[r] - self.row_max[r]) * self.scale_log2 > threshold_log2
        return cute.arch.vote_any_sync(grew)

    @cute.jit
    def rebase(self, m_new: cute.Tensor) -> cute.Tensor:
        """Move the reference maxima to `m_new`: l *= alpha; returns alpha, by which the
        caller rescales O."""
        alpha = cute.make_rmem_tensor((self.num_rows,), Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            m_safe = 0.0 if m_new[r] == -Float32.inf else m_new[r]
            m_old = self.row_max[r]
            alpha[r] = cute.math.exp2((m_old - m_safe) * self.scale_log2, fastmath=True)
            self.row_max[r] = m_new[r]
            self.row_sum[r] = self.row_sum[r] * alpha[r]
        return alpha

    @cute.jit
    def rebase_if_grown(self, m_new: cute.Tensor, threshold_log2: float, alpha: cute.Tensor):
        """The lazy step without O: `rebase` where `needs_rescale` says so, alpha its factors,
        else alpha = 1; the caller scales O after its PV wait (`scale_rows_below_one`). The
        vote is per warp, and a branch on it must hold no `wgmma.wait_group`: that one is
        .sync.aligned, all four warps of the warpgroup at the same instruction."""
        alpha.fill(1.0)
        if self.needs_rescale(m_new, threshold_log2):
            alpha.store(self.rebase(m_new).load())

    @cute.jit
    def merge_row(self, r, m_other, l_other):
        """Row r of another partial softmax over other keys (its maximum and raw sum) merged
        into this one: both rebased to the larger maximum; returns (this side's factor, the
        other's), by which the caller scales the two partial O rows before adding them."""
        m_own = self.row_max[r]
        m_new = cute.arch.fmax(m_own, m_other)
        m_safe = 0.0 if m_new == -Float32.inf else m_new
        a_other = cute.math.exp2((m_other - m_safe) * self.scale_log2, fastmath=True)
        a_own = cute.math.exp2((m_own - m_safe) * self.scale_log2, fastmath=True)
        self.row_max[r] = m_new
        self.row_sum[r] = self.row_sum[r] * a_own + l_other * a_other
        return a_own, a_other

    @cute.jit
    def exponentiate(self, s_rc: cute.Tensor):
        """S -> P = 2^(s * scale_log2 - reference max (+ p_scale_log2)) in place; l += sums
        (operand_sums: later, `add_operand_sums`)."""
        for r in cutlass.range_constexpr(self.num_rows):
            m_ref = self.row_max[r]
            m_safe = 0.0 if m_ref == -Float32.inf else m_ref
            m_scaled = m_safe * self.scale_log2
            if cutlass.const_expr(self.p_scale_log2 != 0):
                m_scaled = m_scaled - Float32(self.p_scale_log2)
            p = self.exp2_row(s_rc, r, s_rc[r, None].load(), m_scaled)
            if cutlass.const_expr(self.round_p is not None and not self.operand_sums):
                for c in cutlass.range_constexpr(0, cute.size(s_rc, mode=[1]), 2):
                    s_rc[r, c], s_rc[r, c + 1] = round_pair(s_rc[r, c], s_rc[r, c + 1],
                                                            self.round_p)
                p = s_rc[r, None].load()
            if cutlass.const_expr(not self.operand_sums):
                self.row_sum[r] = self.row_sum[r] + p.reduce(cute.ReductionOp.ADD, 0.0, 0)

    @cute.jit
    def add_operand_sums(self, p_frag: cute.Tensor, acc_s: cute.Tensor):
        """l += the row sums of P as the PV operand holds it (`operand_sums`): p_frag written
        through `acc_as_operand_a(acc_s)` (one MMA tile along M: register i of either is
        register i of the other), each 32-bit register unpacked to its two values, summed in
        `exponentiate`'s order. Reads p_frag only, so it may run while a PV GEMM reads it
        (acc_s: its layout only)."""
        words = acc_rows_cols(cute.recast_tensor(operand_a_as_acc(p_frag, acc_s), Int32))
        for r in cutlass.range_constexpr(self.num_rows):
            # word j holds columns 2j and 2j + 1: `exponentiate`'s reduction over the same
            # values in the same order
            cols = 2 * cute.size(words, mode=[1])
            p = cute.make_rmem_tensor((cols,), Float32)
            for j in cutlass.range_constexpr(cols // 2):
                p[2 * j], p[2 * j + 1] = unpack_pair(words[r, j], self.round_p)
            self.row_sum[r] = self.row_sum[r] + p.load().reduce(cute.ReductionOp.ADD, 0.0, 0)

    @cute.jit
    def finalize(self) -> cute.Tensor:
        """Combine the per-lane partial sums; return 1/l per row (0 for empty rows)."""
        inv = cute.make_rmem_tensor((self.num_rows,), Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            total = self.row_total(r)
            inv[r] = 0.0 if total == 0.0 else 1.0 / total
        return inv

    @cute.jit
    def finalize_with_sink(self, sink_log2: Float32):
        """`finalize` and `log_sum_exp` with an attention sink: one more logit, sink_log2
        (natural-log units times log2(e), unscaled: gpt-oss's per-head `s_aux`), in every
        row's denominator and none in O. Returns (O's factor per row, the LSE per row).

        A row's sum is rebased from its offset c (`row_offset`) to t = max(c, sink_log2):
        L = l 2^(c - t) + 2^(sink_log2 - t), O's factor 2^(c - t) / L, LSE (t + log2 L) ln 2.
        No overflow whatever the sink; a row that saw no key (c = -inf, l = 0): O's factor
        0, LSE the sink; a sink of -inf adds nothing (and a row with neither: 0, -inf)."""
        inv = cute.make_rmem_tensor((self.num_rows,), Float32)
        lse = cute.make_rmem_tensor((self.num_rows,), Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            total = self.row_total(r)
            offset = self.row_offset(r)
            top = cute.arch.fmax(offset, sink_log2)
            top = 0.0 if top == -Float32.inf else top
            own = cute.math.exp2(offset - top, fastmath=True)
            total = total * own + cute.math.exp2(sink_log2 - top, fastmath=True)
            inv[r] = 0.0
            lse[r] = -Float32.inf
            if total != 0.0:
                inv[r] = own / total
                lse[r] = (top + cute.math.log2(total, fastmath=True)) * LN_2
        return inv, lse

    @cute.jit
    def row_total(self, r):
        """Row r's l: its lanes' partial sums added up."""
        return cute.arch.warp_reduction_sum(self.row_sum[r],
                                            threads_in_group=self.lanes_per_row)

    @cute.jit
    def row_offset(self, r):
        """What row r's exponents were taken against, m * scale_log2 (in exp2 units), less
        p_scale_log2: l carries 2^p_scale_log2."""
        m_scaled = self.row_max[r] * self.scale_log2
        if cutlass.const_expr(self.p_scale_log2 != 0):
            m_scaled = m_scaled - Float32(self.p_scale_log2)
        return m_scaled

    @cute.jit
    def log_sum_exp(self, inv: cute.Tensor) -> cute.Tensor:
        """Per row, log(sum_j exp(s_j * scale)) in natural log, from `finalize`'s 1/l:
        m * scale + ln(l) = (m * scale_log2 - log2(1/l)) * ln(2); -inf for empty rows."""
        lse = cute.make_rmem_tensor((self.num_rows,), Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            lse[r] = -Float32.inf
            if inv[r] != 0.0:
                lse[r] = (self.row_offset(r) - cute.math.log2(inv[r], fastmath=True)) * LN_2
        return lse


@cute.jit
def scale_rows(o_rc: cute.Tensor, factor: cute.Tensor):
    """o[r, :] *= factor[r] for a [row, col] register view."""
    for r in cutlass.range_constexpr(cute.size(o_rc, mode=[0])):
        o_rc[r, None].store(o_rc[r, None].load() * factor[r])


@cute.jit
def scale_rows_below_one(o_rc: cute.Tensor, factor: cute.Tensor):
    """`scale_rows` where a row of this warp has a factor below 1 (`rebase_if_grown` moved
    its maximum): a per-warp branch of multiplies only, which most tiles skip."""
    below = False
    for r in cutlass.range_constexpr(cute.size(factor)):
        below = below or factor[r] < 1.0
    if cute.arch.vote_any_sync(below):
        scale_rows(o_rc, factor)


@dataclasses.dataclass(frozen=True)
class OnlineSoftmaxF16(OnlineSoftmax):
    """The online softmax on fp16 scores (k7's `s_f16`: S = Q K^T accumulated in fp16, two
    scores per register), in fp16 pairs: the row maxima by HMNMX2, x = (s - m) c +
    p_scale_log2 by HADD2 and HFMA2, the exp2s by ex2.approx.f16x2 (two MUFU.EX2.F16), a
    tile's row sums by HADD2 (then added to l in fp32). Only the one-step `step` (no lazy
    rescaling, no fence among the exp2s).

    |S| must fit fp16 (the quantizer bounds |q8| |k8|), and c (`scale_log2`, the descales
    folded in) should be exact in fp16 (the quantizer makes it a power of two; otherwise it
    is rounded, a relative change of at most 2^-11 to every logit). `row_ref` holds each
    row's offset in fp32, m c - p_scale_log2, which alpha and the LSE use (m c is exact: m
    is an fp16 value and c a power of two; the logits in exp2 units must stay below fp16's
    65,504)."""
    row_ref: cute.Tensor = None

    @staticmethod
    def create(num_rows: int, scale_log2: Float32, lanes_per_row: int,
               p_scale_log2: int = 0) -> "OnlineSoftmaxF16":
        base = OnlineSoftmax.create(num_rows, scale_log2, lanes_per_row, p_scale_log2)
        row_ref = cute.make_rmem_tensor((num_rows,), Float32)
        row_ref.fill(-Float32.inf)
        return OnlineSoftmaxF16(base.num_rows, base.lanes_per_row, base.scale_log2,
                                base.row_max, base.row_sum, p_scale_log2, row_ref=row_ref)

    @cute.jit
    def row_offset(self, r):
        """`row_ref`: the offset the step subtracted (m c - p_scale_log2)."""
        return self.row_ref[r]

    def reset(self):
        super().reset()
        self.row_ref.fill(-Float32.inf)

    @cute.jit
    def step(self, s_rc: cute.Tensor) -> cute.Tensor:
        alpha = cute.make_rmem_tensor((self.num_rows,), Float32)
        c = Float16(self.scale_log2)
        c_exact = Float32(c)                # what the fp16 products use
        cols = cute.size(s_rc, mode=[1])
        for r in cutlass.range_constexpr(self.num_rows):
            row = s_rc[r, None].load()
            tile_max = self.quad_max(Float32(row.reduce(cute.ReductionOp.MAX,
                                                        Float16(-Float32.inf), 0)))
            m_new = cute.arch.fmax(self.row_max[r], tile_max)
            self.row_max[r] = m_new
            m_safe = 0.0 if m_new == -Float32.inf else m_new     # an fp16 value, exactly
            ref = m_safe * c_exact - Float32(self.p_scale_log2)
            alpha[r] = cute.math.exp2(self.row_ref[r] - ref, fastmath=True)
            self.row_ref[r] = ref
            # (s - m) c + p_scale_log2 (HADD2, HFMA2): exactly p_scale_log2 at the row's
            # maximum, so that its P is exactly 2^p_scale_log2, e4m3's rounding or not
            s_rc[r, None].store((row - Float16(m_safe)) * c + Float16(self.p_scale_log2))
            # columns j, j + 1 share a register: exp2 and the sums go by pairs, the sums in
            # two chains (HADD2)
            sums = [(Float16(0.0), Float16(0.0)), (Float16(0.0), Float16(0.0))]
            for j in cutlass.range_constexpr(0, cols, 2):
                p = cute.arch.exp2_packed_f16x2((s_rc[r, j], s_rc[r, j + 1]))
                s_rc[r, j], s_rc[r, j + 1] = p
                sums[(j // 2) % 2] = cute.arch.add_packed_f16x2(sums[(j // 2) % 2], p)
            total = cute.arch.add_packed_f16x2(sums[0], sums[1])
            self.row_sum[r] = (self.row_sum[r] * alpha[r] + Float32(total[0])
                               + Float32(total[1]))
        return alpha
