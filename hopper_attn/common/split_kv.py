"""The decode stage's packed rows and split-KV (hopper_attn/decode.py), device side: Q in and
O out by rows, a split's partial O and LSE into the workspace, and the combine that the last
CTA of a (batch, k/v head, M tile) item runs over every split's partials (docs/decode.md,
"Combining by the LSE").

Packed rows: row p of an M tile is (query p // group, head kv_head x group + p % group);
rows past the real ones are padding: zero Q, never stored.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from hopper_attn.common.contract import LOG2_E

LN_2 = math.log(2.0)


@cute.jit
def load_q(q: cute.Tensor, sQ: cute.Tensor, tidx, row0, rows_valid, group, kv_head, batch):
    """The tile's packed Q rows into the swizzled Q tile, 16 bytes per load, zeros in the
    padding rows; 128 threads (sQ's type: the WGMMAs', fp16 where q is bf16 with an e4m3
    cache)."""
    dtype, mma_dtype = q.element_type, sQ.element_type
    chunks = cute.size(sQ, mode=[1]) // 8
    for i in cutlass.range_constexpr(cute.size(sQ, mode=[0]) * chunks // 128):
        index = tidx + 128 * i
        row = index // chunks
        col = index % chunks
        frag = cute.make_rmem_tensor((8,), dtype)
        frag.fill(0.0)
        if row < rows_valid:
            p = row0 + row
            src = q[p // group, None, kv_head * group + p % group, batch]
            cute.autovec_copy(cute.local_tile(src, (8,), (col,)), frag)
        if cutlass.const_expr(mma_dtype != dtype):     # (fp8: bf16 -> fp16)
            wide = cute.make_rmem_tensor((8,), mma_dtype)
            wide.store(frag.load().to(mma_dtype))
            frag = wide
        cute.autovec_copy(frag, cute.local_tile(sQ[row, None], (8,), (col,)))


@cute.jit
def load_q_registers(q: cute.Tensor, q_acc: cute.Tensor, coords: cute.Tensor, row0,
                     rows_valid, group, kv_head, batch):
    """fp8: the tile's packed Q rows, converted to fp16, into registers held as a 64 x d
    O accumulator (`coords`: its (row, col) per register; wgmma.with_q_in_registers),
    zeros in the padding rows: each thread's pairs of neighbouring columns, 4 bytes a
    load."""
    q_acc.fill(0.0)
    for rr in cutlass.range_constexpr(cute.size(q_acc.shape[0][1])):
        row = coords[(0, rr, 0), 0, 0][0]
        if row < rows_valid:
            p = row0 + row
            src = q[p // group, None, kv_head * group + p % group, batch]
            for v in cutlass.range_constexpr(cute.size(q_acc.shape[0][2])):
                pair = cute.make_rmem_tensor((2,), q.element_type)
                col = coords[(0, rr, v), 0, 0][1]
                cute.autovec_copy(cute.local_tile(src, (2,), (col // 2,)), pair)
                q_acc[(None, rr, v), 0, 0].store(pair.load().to(q_acc.element_type))


@cute.jit
def store_rows(o: cute.Tensor, o_out: cute.Tensor, o_coords: cute.Tensor, row0,
               rows_valid, group, kv_head, batch):
    """O (16-bit, PV accumulator layout) of the real rows to (query, head) in memory: each
    thread's pairs of neighbouring columns, 4 bytes a store."""
    for rr in cutlass.range_constexpr(cute.size(o_out.shape[0][1])):
        row = o_coords[(0, rr, 0), 0, 0][0]
        if row < rows_valid:
            p = row0 + row
            dst = o[p // group, None, kv_head * group + p % group, batch]
            for v in cutlass.range_constexpr(cute.size(o_out.shape[0][2])):
                col = o_coords[(0, rr, v), 0, 0][1]
                cute.autovec_copy(o_out[(None, rr, v), 0, 0],
                                  cute.local_tile(dst, (2,), (col // 2,)))


@cute.jit
def store_partial(mOPart: cute.Tensor, acc_o: cute.Tensor, o_coords: cute.Tensor, base,
                  rows_valid):
    """A split's O / l (fp32) of the real rows to workspace rows base + row."""
    for rr in cutlass.range_constexpr(cute.size(acc_o.shape[0][1])):
        row = o_coords[(0, rr, 0), 0, 0][0]
        if row < rows_valid:
            for v in cutlass.range_constexpr(cute.size(acc_o.shape[0][2])):
                col = o_coords[(0, rr, v), 0, 0][1]
                cute.autovec_copy(acc_o[(None, rr, v), 0, 0],
                                  cute.local_tile(mOPart[base + row, None], (2,),
                                                  (col // 2,)))



@cute.jit
def combine(mOPart, mLSEPart, o: cute.Tensor, mLSE: cute.Tensor, item, splits, rows_valid,
            part_rows, row0, group, kv_head, batch, tidx, mSinks,
            head_dim: cutlass.Constexpr, chunk: cutlass.Constexpr, dtype: cutlass.Constexpr):
    """The last CTA of an item: O = sum_s exp(lse_s - lse) O_s, lse = log sum_s exp(lse_s).

    The real rows' O in 4-column pieces, `lanes` neighbouring lanes per piece (as many as
    128 threads allow, up to 32), lane `sub` taking splits sub, sub + lanes, ... Each lane
    reads its splits `chunk` at a time, all loads of a chunk issued before any is
    used (indices clamped to the last split, weight 0 past it: no branch between them), so
    a chunk costs one L2 round trip, not one per split; it keeps a running (max, sum,
    weighted sum) as the online softmax does. A butterfly merges the lanes' triples; one
    lane scales by 1 / sum and stores 4 outputs, and the row's LSE with its first piece.
    No shared memory, no barrier. An attention sink joins there, once: one more split
    with the sink as its LSE and O = 0."""
    d = head_dim
    pieces_per_row = d // 4
    pieces = rows_valid * pieces_per_row
    lanes = Int32(1)
    for _ in cutlass.range_constexpr(5):
        if lanes * 2 * pieces <= 128:
            lanes = lanes * 2
    per_round = 128 // lanes
    sub = tidx % lanes
    for k in cutlass.range(cute.ceil_div(pieces, per_round), unroll=1):
        piece = k * per_round + tidx // lanes
        r = cutlass.min(piece // pieces_per_row, rows_valid - 1)
        c = piece % pieces_per_row
        m = -Float32.inf
        total = Float32(0.0)
        acc = cute.make_rmem_tensor((4,), Float32)
        acc.fill(0.0)
        for s0 in cutlass.range(0, splits, lanes * chunk, unroll=1):
            lses = cute.make_rmem_tensor((chunk,), Float32)
            parts = cute.make_rmem_tensor((4, chunk), Float32)
            for i in cutlass.range_constexpr(chunk):
                s = cutlass.min(s0 + sub + lanes * i, splits - 1)
                lses[i] = mLSEPart[s, item * part_rows + r]
                cute.autovec_copy(cute.local_tile(
                    mOPart[(item * splits + s) * part_rows + r, None], (4,), (c,)),
                    parts[None, i])
            m_new = m
            for i in cutlass.range_constexpr(chunk):
                if s0 + sub + lanes * i >= splits:
                    lses[i] = -Float32.inf
                m_new = cute.arch.fmax(m_new, lses[i])
            m_safe = Float32(0.0) if m_new == -Float32.inf else m_new
            rescale = cute.math.exp2((m - m_safe) * LOG2_E, fastmath=True)
            total = total * rescale
            acc.store(acc.load() * rescale)
            for i in cutlass.range_constexpr(chunk):
                w = cute.math.exp2((lses[i] - m_safe) * LOG2_E, fastmath=True)
                total = total + w
                acc.store(acc.load() + parts[None, i].load() * w)
            m = m_new
        for step in cutlass.range_constexpr(5):
            offset = 16 >> step
            if offset < lanes:
                m_other = cute.arch.shuffle_sync_bfly(m, offset)
                total_other = cute.arch.shuffle_sync_bfly(total, offset)
                m_new = cute.arch.fmax(m, m_other)
                m_safe = Float32(0.0) if m_new == -Float32.inf else m_new
                mine = cute.math.exp2((m - m_safe) * LOG2_E, fastmath=True)
                other = cute.math.exp2((m_other - m_safe) * LOG2_E, fastmath=True)
                total = total * mine + total_other * other
                for e in cutlass.range_constexpr(4):
                    acc[e] = acc[e] * mine + cute.arch.shuffle_sync_bfly(acc[e], offset) * other
                m = m_new
        if piece < pieces and sub == 0:
            if cutlass.const_expr(mSinks is not None):
                # (names of their own: the DSL sees every name assigned in this `if`)
                sink = mSinks[kv_head * group + (row0 + r) % group]
                sink_top = cute.arch.fmax(m, sink)
                sink_top = Float32(0.0) if sink_top == -Float32.inf else sink_top
                sink_keep = cute.math.exp2((m - sink_top) * LOG2_E, fastmath=True)
                total = total * sink_keep + cute.math.exp2((sink - sink_top) * LOG2_E,
                                                           fastmath=True)
                acc.store(acc.load() * sink_keep)
                m = cute.arch.fmax(m, sink)
            inv = Float32(0.0) if total == 0.0 else 1.0 / total
            out = cute.make_rmem_tensor((4,), dtype)
            out.store((acc.load() * inv).to(dtype))
            p = row0 + r
            dst = o[p // group, None, kv_head * group + p % group, batch]
            cute.autovec_copy(out, cute.local_tile(dst, (4,), (c,)))
            if c == 0:
                lse = -Float32.inf
                if total != 0.0:
                    m_safe = Float32(0.0) if m == -Float32.inf else m
                    lse = m_safe + cute.math.log2(total, fastmath=True) * LN_2
                mLSE[batch, kv_head * group + p % group, p // group] = lse



@cute.jit
def fold_sink(lse: Float32, sink: Float32):
    """A row's LSE (natural log; -inf: no key) with an attention sink's logit joined: (the
    factor for its normalized O, the new LSE), exponents rebased to max(lse, sink)."""
    top = cute.arch.fmax(lse, sink)
    top = Float32(0.0) if top == -Float32.inf else top
    own = cute.math.exp2((lse - top) * LOG2_E, fastmath=True)
    total = own + cute.math.exp2((sink - top) * LOG2_E, fastmath=True)
    factor, lse_new = Float32(0.0), Float32(-Float32.inf)
    if total != 0.0:
        factor = own / total
        lse_new = top + cute.math.log2(total, fastmath=True) * LN_2
    return factor, lse_new
