"""The swapped-operand e4m3 decode's device pieces (hopper_attn/decode_fp8swap.py; the
design and its budget: docs/lab/kvcache.md).

With the keys as WGMMA's M and the packed (query, head) rows as N:

    S^T = K Q'^T        A = K (e4m3, SMEM, as TMA wrote it), B = Q' (e4m3, SMEM)
    O'^T += V^T P'^T    A = V^T (e4m3, registers), B = P'^T (e4m3, SMEM)

Q' and P' are two e4m3 terms each (x = hi + lo, lo = e4m3(x - hi): bf16's precision from
e4m3 bytes), in neighbouring N columns: column 2r is row r's hi, 2r + 1 its lo. Two free
permutations make V^T's register fragment an `ldmatrix.trans` and four `PRMT`s:

* keys: k-slot 4q + i of each 16-slot half holds key 2q + (i % 2) + 8 (i // 2) of its 16
  (k7's PERM16), in the V^T fragment and in P'^T's columns alike;
* d: in warp w's 16 rows of an m64 atom, row g holds d = 16w + 2g, row g + 8 d + 1.

Shared-memory tiles are rows of 128 bytes under the 128-byte swizzle: byte b of row n lies
at n x 128 + ((b / 16) XOR (n % 8)) x 16 + b % 16 (`swizzled`); the helpers address them by
hand (32-bit shared addresses) and the WGMMAs read them through the same layouts.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

Q_TOP = 224.0          # each packed row of Q is scaled to this largest |value| (e4m3: 448)
P_SCALE = 256.0        # P' = P x 2^8 <= 256: small probabilities stay above e4m3's subnormals
PAIR_SELECT = (0x6420, 0x7531)     # PRMT: bytes 0, 2 / 1, 3 of two words (d0 / d0 + 1)
# PRMT joining a lane's two-term word [hi i0, hi i1, lo i0, lo i1] and its partner's (lane
# ^ 4) into one P'^T word of 4 k-slots: even g keeps the hi column, odd g the lo one
JOIN_SELECT = (0x5140, 0x3726)


def _asm(ret, args, text, constraints, side_effects=False):
    return llvm.inline_asm(ret, args, text, constraints, has_side_effects=side_effects,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def ldsm_x4_trans(addr, *, loc=None, ip=None):
    """`ldmatrix.x4.trans` of four 8 x 8 matrices of 16-bit elements: 4 words."""
    i32 = T.i32()
    res = _asm(llvm.StructType.get_literal([i32] * 4),
               [Int32(addr).ir_value(loc=loc, ip=ip)],
               "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];",
               "=r,=r,=r,=r,r", side_effects=True)
    return [Int32(llvm.extractvalue(i32, res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def prmt(a, b, select: int, *, loc=None, ip=None) -> Int32:
    return Int32(_asm(T.i32(), [Int32(a).ir_value(loc=loc, ip=ip),
                                Int32(b).ir_value(loc=loc, ip=ip)],
                      f"prmt.b32 $0, $1, $2, {select:#x};", "=r,r,r"))


@dsl_user_op
def prmt_var(a, b, select, *, loc=None, ip=None) -> Int32:
    """`prmt` with the selector in a register."""
    return Int32(_asm(T.i32(), [Int32(a).ir_value(loc=loc, ip=ip),
                                Int32(b).ir_value(loc=loc, ip=ip),
                                Int32(select).ir_value(loc=loc, ip=ip)],
                      "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r"))


@dsl_user_op
def select_i32(pred, a, b, *, loc=None, ip=None) -> Int32:
    """pred != 0 ? a : b (a `selp`, no branch)."""
    return Int32(_asm(T.i32(), [Int32(pred).ir_value(loc=loc, ip=ip),
                                Int32(a).ir_value(loc=loc, ip=ip),
                                Int32(b).ir_value(loc=loc, ip=ip)],
                      "{\n .reg .pred p;\n setp.ne.b32 p, $1, 0;\n selp.b32 $0, $2, $3, p;\n}",
                      "=r,r,r,r"))


@dsl_user_op
def st_shared_b32(addr, value, *, loc=None, ip=None) -> None:
    _asm(None, [Int32(addr).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)],
         "st.shared.b32 [$0], $1;", "r,r", side_effects=True)


@dsl_user_op
def st_shared_v4(addr, w0, w1, w2, w3, *, loc=None, ip=None) -> None:
    _asm(None, [Int32(x).ir_value(loc=loc, ip=ip) for x in (addr, w0, w1, w2, w3)],
         "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r", side_effects=True)


_TWO_TERMS_PTX = """{
 .reg .b16 h, l;
 .reg .b32 hh;
 .reg .f16 h0, h1;
 .reg .f32 f0, f1;
 cvt.rn.satfinite.e4m3x2.f32 h, $2, $1;
 cvt.rn.f16x2.e4m3x2 hh, h;
 mov.b32 {h0, h1}, hh;
 cvt.f32.f16 f0, h0;
 cvt.f32.f16 f1, h1;
 sub.f32 f0, $1, f0;
 sub.f32 f1, $2, f1;
 cvt.rn.satfinite.e4m3x2.f32 l, f1, f0;
 mov.b32 $0, {h, l};
}"""


@dsl_user_op
def two_terms(x0: Float32, x1: Float32, *, loc=None, ip=None) -> Int32:
    """(x0, x1) as two e4m3 terms each: bytes [hi(x0), hi(x1), lo(x0), lo(x1)], hi = e4m3(x),
    lo = e4m3(x - hi) (the subtraction exact: hi is exact in fp16 and fp32)."""
    return Int32(_asm(T.i32(), [Float32(x0).ir_value(loc=loc, ip=ip),
                                Float32(x1).ir_value(loc=loc, ip=ip)],
                      _TWO_TERMS_PTX, "=r,f,f"))


def swizzled(row, byte):
    """Byte offset of (row, byte) in a tile of 128-byte rows under the 128-byte swizzle
    (`byte` a multiple of 4 within a 16-byte chunk keeps its offset in the chunk)."""
    return row * 128 + (((byte // 16) ^ (row % 8)) * 16) + byte % 16


@cute.jit
def load_q_two_terms(q: cute.Tensor, q_base, row_scale: cute.Tensor, tidx, row0, rows_valid,
                     group, kv_head, batch, rows: cutlass.Constexpr, head_dim: cutlass.Constexpr):
    """The tile's `rows` packed Q rows (zeros past rows_valid) as Q' = Q x s_r in two e4m3
    terms: rows 2r (hi) and 2r + 1 (lo) of the (2 rows, d) tile at shared address q_base,
    s_r = Q_TOP / max |q_r| (1 for a zero row); 1 / s_r into row_scale[r] (SMEM fp32). 128
    threads, min(128 / rows, d / 16) neighbouring lanes per row (rows 8: threads 64-127 idle),
    16 columns a step."""
    lanes = min(128 // rows, head_dim // 16)
    cols = head_dim // lanes                  # per thread: 16 or 32
    r = tidx // lanes
    c0 = (tidx % lanes) * cols
    vals = cute.make_rmem_tensor((cols,), Float32)
    vals.fill(0.0)
    if r < rows_valid:
        p = row0 + r
        src = q[p // group, None, kv_head * group + p % group, batch]
        raw = cute.make_rmem_tensor((cols,), q.element_type)
        cute.autovec_copy(cute.local_tile(src, (cols,), (c0 // cols,)), raw)
        vals.store(raw.load().to(Float32))
    top = Float32(0.0)
    for i in cutlass.range_constexpr(cols):
        top = cute.arch.fmax(top, cute.arch.fmax(vals[i], -vals[i]))
    off = 1
    for _ in cutlass.range_constexpr(lanes.bit_length() - 1):
        top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=off))
        off *= 2
    scale = Float32(1.0)
    if top > Float32(0.0):
        scale = Float32(Q_TOP) / top
    if tidx % lanes == 0 and r < rows:
        row_scale[r] = Float32(1.0) / scale
    if r < rows:
        _store_q_terms(vals, scale, q_base, r, c0, cols)


@cute.jit
def _store_q_terms(vals: cute.Tensor, scale, q_base, r, c0, cols: cutlass.Constexpr):
    for chunk in cutlass.range_constexpr(cols // 16):
        words = cute.make_rmem_tensor((8,), Int32)
        for k in cutlass.range_constexpr(4):
            # bytes [hi a, hi b, lo a, lo b] for columns (4k, 4k+1) and (4k+2, 4k+3)
            x = chunk * 16 + 4 * k
            w01 = two_terms(vals[x] * scale, vals[x + 1] * scale)
            w23 = two_terms(vals[x + 2] * scale, vals[x + 3] * scale)
            words[k] = prmt(w01, w23, 0x5410)          # hi: a, b, c, d
            words[4 + k] = prmt(w01, w23, 0x7632)      # lo
        byte = c0 + chunk * 16
        st_shared_v4(q_base + swizzled(2 * r, byte), words[0], words[1], words[2], words[3])
        st_shared_v4(q_base + swizzled(2 * r + 1, byte), words[4], words[5], words[6],
                     words[7])


@cute.jit
def load_vt_fragment(frag: cute.Tensor, v_base, warp, lane):
    """V^T (e4m3, a (128 keys, d = 128) tile at shared address v_base) into the register A
    fragment of O'^T += V^T P'^T (the module doc's key and d orders): per m64 atom mb and
    k32 step ks, one ldmatrix.x4.trans (matrix i: keys 32 ks + 8i .., the warp's 16 bytes
    of d) and four PRMTs."""
    words = cute.recast_tensor(frag, Int32)
    chunk_d = warp                           # + 4 mb: 16-byte chunk of the warp's d
    row = lane % 8
    for mb in cutlass.range_constexpr(cute.size(frag, mode=[1])):
        for ks in cutlass.range_constexpr(cute.size(frag, mode=[2])):
            key = 32 * ks + 8 * (lane // 8) + row
            m = ldsm_x4_trans(v_base + key * 128 + (((chunk_d + 4 * mb) ^ row) * 16))
            w = words[None, mb, ks]
            w[0] = prmt(m[0], m[1], PAIR_SELECT[0])
            w[1] = prmt(m[0], m[1], PAIR_SELECT[1])
            w[2] = prmt(m[2], m[3], PAIR_SELECT[0])
            w[3] = prmt(m[2], m[3], PAIR_SELECT[1])


@cute.jit
def clear_rows(base, first_row, tidx, rows: cutlass.Constexpr):
    """Zeros in rows first_row .. of a (rows, 128 bytes) tile at shared address `base`, 16
    bytes a store from each of 128 threads (any swizzle: whole rows)."""
    for i in cutlass.range_constexpr(rows * 8 // 128):
        index = tidx + 128 * i
        if index // 8 >= first_row:
            st_shared_v4(base + index * 16, Int32(0), Int32(0), Int32(0), Int32(0))


@cute.jit
def store_p_two_terms(p_base, s_rc: cute.Tensor, warp, lane):
    """P' (fp32, in the hi columns (pair element 0) of the S^T accumulator's [row, col]
    view: keys 64a + 16 warp + g + 8i, rows r = q + 4j) as two e4m3 terms into P'^T (2R
    rows of 128 k-slots at shared address p_base, the module doc's key order): per (a, r)
    one two-term word, one SHFL.BFLY 4 with the partner lane, one PRMT, one STS.32."""
    g, q = lane // 4, lane % 4
    odd = g % 2
    join = select_i32(odd, Int32(JOIN_SELECT[1]), Int32(JOIN_SELECT[0]))
    for a in cutlass.range_constexpr(cute.size(s_rc.shape[0][1])):
        byte = 64 * a + 16 * warp + 4 * (g // 2)
        for j in cutlass.range_constexpr(cute.size(s_rc.shape[1][1])):
            word = two_terms(s_rc[(0, a), (0, j, 0)], s_rc[(1, a), (0, j, 0)])
            other = cute.arch.shuffle_sync_bfly(word, offset=4)
            st_shared_b32(p_base + swizzled(2 * (q + 4 * j) + odd, byte),
                          prmt_var(word, other, join))
