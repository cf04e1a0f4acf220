"""decode, e4m3 cache, swapped operands: the kv-cache decode's e4m3 consumer at d 128 with
at most 32 packed rows (`kvcache.FP8_CONSUMER`, "auto"; docs/kvcache.md, docs/lab/kvcache.md).

What changes from the e4m3 variant of decode.py (loaders widening e4m3 tiles into 16-bit
rings, 64 packed rows as WGMMA's M of which 4-16 are real): the keys are M and the few
real rows N,

    S^T = K Q'^T         A = K, e4m3 from the TMA ring as it landed (K-major: d contiguous);
                         B = Q' (2R x d, e4m3, two terms per value)
    O'^T += V^T P'^T     A = V^T from registers (ldmatrix.trans + PRMT, no widening pass);
                         B = P'^T (2R x 128 k-slots, e4m3, two terms)

with R = 8, 16 or 32 packed rows (group x queries <= R), N = 2R (common/fp8_swap.py). No
loader warpgroup and no 16-bit rings: the producer warp TMA-loads e4m3 K and V into rings
the consumers read directly (160 threads, the 16-bit kernel's roles). The softmax runs
along M: a row's 128 scores of a tile lie in 8 lanes of each of the 4 consumer warps, so
its maximum goes through 3 shuffles and shared memory (one named barrier a tile); the row
sums stay per thread until the end. The descales as in FlashAttention's fp8 path: k_descale
into each row's score scale (with Q's row scale 1 / s_r), v_descale into 1 / l (with P's
2^-8).

What stays: the split-KV grid and the combine, the bottom-right causal limit per row, the
paged and contiguous loads (common/paged.py), the tail mask (scores of keys past the
request's set to -inf) and V's rows past the keys zeroed before they are read (a cache may
hold NaN there).

Budget at d = 128, 128-key tiles, 3 stages: SMEM = K + V rings 96 KiB + Q' 2R x 128 B +
P'^T 2R x 128 B + row maxima 2 x R x 4 x 4 B + barriers: 101 KiB at R = 8, 105 at R = 16
(two CTAs per SM), 114 at R = 32 (one). Registers per consumer thread: S^T 2R + O'^T 2R
fp32, V^T fragment 32, R / 4 rows of state (139 at R = 8, ~155 at 16, 232 at 32). Leaves
out (ValueError): window, softcap, sinks, d != 128, more than 32 packed rows.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from hopper_attn import decode
from hopper_attn.common import fp8_swap, paged, split_kv, tma, wgmma
from hopper_attn.common.layouts import acc_rows_cols, ndhb_view, smem_bytes, smem_tile_layout

BLOCK_N = 128
STAGES = 3
# With few (request, kv head) pairs the splits are short and a CTA's ring does the overlapping:
# 6 stages, one CTA per SM, 1.06x the 3-stage tile at B1 (32k / 128k keys, 8 kv heads),
# 1.02x at B8; from 512 pairs up, within 2% either way (results/h200/2026-11-29_kvcache_fp8_swap.json.xz).
DEEP_STAGES, DEEP_MAX_PAIRS = 6, 64


def stages_for(problem) -> int:
    """The ring depth for a call: DEEP_STAGES up to DEEP_MAX_PAIRS (request, kv head) pairs."""
    return DEEP_STAGES if problem.batch * problem.kv_heads <= DEEP_MAX_PAIRS else STAGES
ROW_CHOICES = (8, 16, 32)
E4M3 = cutlass.Float8E4M3FN


def rows_for(packed_rows: int) -> int:
    """The tile's R (N / 2): the smallest of ROW_CHOICES that holds the packed rows."""
    for rows in ROW_CHOICES:
        if packed_rows <= rows:
            return rows
    raise ValueError(f"fp8 swap: at most {ROW_CHOICES[-1]} packed rows (group x queries), "
                     f"got {packed_rows}")


def smem_estimate(rows: int, block_n: int = BLOCK_N, stages: int = STAGES,
                  head_dim: int = 128) -> int:
    return 1024 + 2 * smem_bytes(stages * block_n * head_dim) \
        + smem_bytes(2 * rows * head_dim) + smem_bytes(2 * rows * block_n) + 2 * rows * 16


def ctas_per_sm(rows: int, stages: int = STAGES) -> int:
    return max(1, min(2, decode.SMEM_PER_SM // (smem_estimate(rows, stages=stages) + 1024)))


def num_splits_for(problem, stages: int = STAGES, sms: int = 0) -> int:
    """decode.num_splits_for's rule with this kernel's tile and CTAs per SM."""
    from hopper_attn.common.scheduler import sm_count
    sms = sms or sm_count()
    limits = decode.split_limits(problem, BLOCK_N, stages, sms)
    items = problem.batch * problem.kv_heads
    rows = rows_for(problem.heads // problem.kv_heads * problem.seqlen)
    wave = max(1, sms * ctas_per_sm(rows, stages) // items)
    return min(decode.MAX_SPLITS, wave, limits["length"], limits["combine"])


class DecodeFp8Swap(decode.DecodeAttention):
    def __init__(self, head_dim: int, causal: bool, block_n: int = BLOCK_N,
                 stages: int = STAGES, kv_cache: bool = True, page_size: int = 0,
                 fp8: bool = True, softcap: float = 0.0, window_left=None,
                 window_right=None, rows: int = 16):
        if head_dim != 128 or block_n != BLOCK_N or not kv_cache or not fp8:
            raise ValueError("fp8 swap: an e4m3 kv cache at d = 128 with 128-key tiles only")
        if softcap or (window_left, window_right) != (None, None):
            raise ValueError("fp8 swap: no window or softcap (the widening loop has them)")
        if rows not in ROW_CHOICES:
            raise ValueError(f"fp8 swap: rows must be one of {ROW_CHOICES}, got {rows}")
        # (the base's checks and fields for a 16-bit cache of one stage; then this kernel's)
        super().__init__(head_dim, causal, block_n, 1, kv_cache=True, page_size=page_size)
        self.fp8, self.rows, self.threads, self.stages = True, rows, decode.THREADS, stages
        self.wide_stages = 0
        self.ctas_per_sm = ctas_per_sm(rows, stages)
        if smem_estimate(rows, block_n, stages) > decode.SMEM_PER_CTA:
            raise ValueError(f"fp8 swap: {stages} stages do not fit")

    def describe(self) -> dict:
        return {**super().describe(), "fp8_consumer": "swap", "rows": self.rows}

    @cute.jit
    def launch(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, mOPart: cute.Tensor, mLSEPart: cute.Tensor,
               mCount: cute.Tensor, mSeqlensK, mPageTable, scale_log2: Float32, stream,
               mKDescale=None, mVDescale=None, mSinks=None):
        q, k, v, o = [ndhb_view(t) for t in (mQ, mK, mV, mO)]   # (N, d, H, B)
        bn, d, n = self.block_n, self.head_dim, 2 * self.rows
        self.dtype = mQ.element_type
        row_stride = mOPart.layout.stride[0]
        if cutlass.const_expr(not isinstance(row_stride, int)):
            row_stride = cute.assume(row_stride, divby=4)
        o_part = cute.make_tensor(mOPart.iterator,
                                  cute.make_layout(mOPart.shape, stride=(row_stride, 1)))
        load_layout = smem_tile_layout(E4M3, bn, d, self.stages)
        q_layout = smem_tile_layout(E4M3, n, d)
        p_layout = smem_tile_layout(E4M3, n, bn)
        load_rows = paged.box_rows(self.page_size, bn) if self.page_size else bn
        box_layout = smem_tile_layout(E4M3, load_rows, d) if self.page_size else load_layout
        tma_k, k_coords = tma.make_tma_load(k, box_layout, load_rows, d)
        tma_v, v_coords = tma.make_tma_load(v, box_layout, load_rows, d)
        self.tile_bytes = tma.tma_bytes(E4M3, load_layout)

        @cute.struct
        class SharedStorage:
            k_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            v_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            last: cute.struct.MemRange[Int32, 4]
            row_scale: cute.struct.Align[cute.struct.MemRange[Float32, self.rows], 16]
            # per tile (two buffers) and row, the 4 consumer warps' maxima
            row_max: cute.struct.Align[cute.struct.MemRange[Float32, 8 * self.rows], 16]
            sK8: cute.struct.Align[cute.struct.MemRange[E4M3, cute.cosize(load_layout)], 1024]
            sV8: cute.struct.Align[cute.struct.MemRange[E4M3, cute.cosize(load_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[E4M3, cute.cosize(q_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[E4M3, cute.cosize(p_layout)], 1024]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        heads_kv, batch = k.shape[2], q.shape[3]
        splits = mLSEPart.shape[0]
        self.swap_kernel(q, o, k_coords, v_coords, tma_k, tma_v, mLSE, o_part, mLSEPart,
                         mCount, scale_log2, load_layout, q_layout, p_layout, mSeqlensK,
                         mPageTable, mKDescale, mVDescale).launch(
            grid=[splits, heads_kv, batch], block=[self.threads, 1, 1],
            min_blocks_per_mp=self.ctas_per_sm,
            **({"preferred_smem_carveout": 100} if self.ctas_per_sm > 1 else {}),
            stream=stream)

    @cute.kernel
    def swap_kernel(self, q: cute.Tensor, o: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                    tma_k: cute.CopyAtom, tma_v: cute.CopyAtom, mLSE: cute.Tensor,
                    mOPart: cute.Tensor, mLSEPart: cute.Tensor, mCount: cute.Tensor,
                    scale_log2: Float32, load_layout: cute.ComposedLayout,
                    q_layout: cute.ComposedLayout, p_layout: cute.ComposedLayout,
                    mSeqlensK, mPageTable, mKDescale, mVDescale):
        bn, d, rows, n = self.block_n, self.head_dim, self.rows, 2 * self.rows
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        split, kv_head, batch = cute.arch.block_idx()
        splits, _, _ = cute.arch.grid_dim()
        split, kv_head, batch, splits = Int32(split), Int32(kv_head), Int32(batch), Int32(splits)
        seqlen_q, heads = q.shape[0], q.shape[2]
        heads_kv = mK.shape[2]
        group = heads // heads_kv
        rows_valid = group * seqlen_q                      # <= rows (checked on the host)
        seqlen_k = mSeqlensK[batch]
        keys_all, keys_any = seqlen_k, seqlen_k    # keys every / any real row sees
        if cutlass.const_expr(self.causal):
            keys_all = cutlass.min(seqlen_k, cutlass.max(seqlen_k - seqlen_q + 1, 0))
            keys_any = cutlass.min(seqlen_k, cutlass.max(
                (rows_valid - 1) // group + seqlen_k - seqlen_q + 1, 0))
        n_total = cute.ceil_div(keys_any, bn)
        n_first = split * n_total // splits
        n_count = (split + 1) * n_total // splits - n_first

        if warp == decode.PRODUCER_WARP:
            tma.prefetch_descriptors(tma_k, tma_v)
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sK8, sV8 = (buf.get_tensor(load_layout.outer, swizzle=load_layout.inner)
                    for buf in (storage.sK8, storage.sV8))
        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sP = storage.sP.get_tensor(p_layout.outer, swizzle=p_layout.inner)
        k_ring = tma.make_tma_ring(storage.k_barriers.data_ptr(), self.stages, 4,
                                   self.tile_bytes)
        v_ring = tma.make_tma_ring(storage.v_barriers.data_ptr(), self.stages, 4,
                                   self.tile_bytes)
        tma.barriers_ready()

        if warp == decode.PRODUCER_WARP:
            # -------------- producer warp: K_j, V_j of this split's kv tiles (e4m3) --------------
            paged.produce_kv(k_ring, v_ring, tma_k, tma_v, mK, mV, mPageTable, sK8, sV8,
                             n_first, n_count, seqlen_k, kv_head, batch, self.stages,
                             self.page_size, bn)
        elif warp < decode.PRODUCER_WARP:
            # ---------------- consumer warpgroup: S^T, the softmax along M, O'^T ----------------
            lane = tidx % 32
            g, qq = lane // 4, lane % 4
            consumers = pipeline.NamedBarrier(barrier_id=decode.CONSUMER_BARRIER,
                                              num_threads=128)
            row_scale = storage.row_scale.get_tensor(cute.make_layout(rows))
            row_max = storage.row_max.get_tensor(cute.make_layout((4, rows, 2)))
            q_base = Int32(storage.sQ.data_ptr().toint())
            p_base = Int32(storage.sP.data_ptr().toint())
            v_base0 = Int32(storage.sV8.data_ptr().toint())
            fp8_swap.load_q_two_terms(q, q_base, row_scale, tidx, 0, rows_valid, group,
                                      kv_head, batch, rows, d)
            cute.arch.fence_proxy("async.shared", space="cta")     # Q' for the WGMMAs
            consumers.arrive_and_wait()

            kmaj = cute.nvgpu.OperandMajorMode.K
            mma_s = sm90_helpers.make_trivial_tiled_mma(E4M3, E4M3, kmaj, kmaj, Float32,
                                                        (1, 1, 1), tiler_mn=(64, n))
            mma_o = sm90_helpers.make_trivial_tiled_mma(
                E4M3, E4M3, kmaj, kmaj, Float32, (1, 1, 1), tiler_mn=(64, n),
                a_source=warpgroup.OperandSource.RMEM)
            wg_s = wgmma.warpgroup_slice(mma_s, tidx)
            wg_o = wgmma.warpgroup_slice(mma_o, tidx)
            k_frag = wg_s.make_fragment_A(wg_s.partition_A(sK8))
            q_frag = wg_s.make_fragment_B(wg_s.partition_B(sQ))
            p_frag = wg_o.make_fragment_B(wg_o.partition_B(sP))
            vt_frag = wg_o.make_fragment_A(wg_o.partition_shape_A((d, bn)))
            acc_s = cute.make_rmem_tensor(mma_s.get_slice(tidx).partition_shape_C((bn, n)),
                                          Float32)
            acc_o = cute.make_rmem_tensor(mma_o.get_slice(tidx).partition_shape_C((d, n)),
                                          Float32)
            acc_o.fill(0.0)
            s_rc, o_rc = acc_rows_cols(acc_s), acc_rows_cols(acc_o)
            # this thread's rows r = qq + 4j (S^T columns 2r, 2r + 1) and keys of a tile
            # 64a + 16 warp + g + 8i
            my_rows = cute.size(s_rc.shape[1][1])

            # per row: the score scale (log2 units: softmax scale x k_descale / s_r), the
            # first hidden key, the running max and this thread's share of the sum
            row_c = cute.make_rmem_tensor((my_rows,), Float32)
            limits = cute.make_rmem_tensor((my_rows,), Int32)
            m_run = cute.make_rmem_tensor((my_rows,), Float32)
            l_run = cute.make_rmem_tensor((my_rows,), Float32)
            k_scale = scale_log2 * mKDescale[batch, kv_head]
            for j in cutlass.range_constexpr(my_rows):
                r = qq + 4 * j
                row_c[j] = k_scale * row_scale[r]
                limits[j] = seqlen_k
                if cutlass.const_expr(self.causal):
                    limits[j] = cutlass.min(seqlen_k, r // group + seqlen_k - seqlen_q + 1)
                m_run[j] = -Float32.inf
                l_run[j] = Float32(0.0)

            k_state = tma.consumer_state(self.stages)
            v_state = tma.consumer_state(self.stages)
            # k6's order, shifted by a tile: S_j, then PV_{j-1} behind it; the softmax of
            # tile j under PV_{j-1}; then O rescaled, V_j's fragment and P'_j for PV_j. No
            # WGMMA group is in flight across the loop's back edge (ptxas would serialize
            # every WGMMA: C7514).
            alpha = cute.make_rmem_tensor((my_rows,), Float32)
            for jt in cutlass.range(n_count, unroll=1):
                tile = n_first + jt
                k_ring.consumer_wait(k_state)
                wgmma.gemm(mma_s, acc_s, k_frag[None, None, None, k_state.index], q_frag,
                           zero_init=True)
                if jt > 0:                                 # O'^T += V^T_{j-1} P'^T_{j-1}
                    wgmma.gemm(mma_o, acc_o, vt_frag, p_frag, zero_init=False)
                    warpgroup.wait_group(1)                # S^T_j done; PV_{j-1} may run
                else:
                    warpgroup.wait_group(0)
                tma.release_stage(k_ring, k_state)
                k_state.advance()
                self.tile_softmax(s_rc, row_c, limits, m_run, l_run, alpha, row_max, tile,
                                  (tile + 1) * bn > keys_all, jt % 2, warp, lane, consumers)
                cute.arch.fence_acq_rel_cta()              # keeps ptxas's wait below the softmax
                warpgroup.wait_group(0)                    # PV_{j-1} done: O, V^T, P'^T free
                for j in cutlass.range_constexpr(my_rows):
                    for rr in cutlass.range_constexpr(cute.size(o_rc, mode=[0])):
                        for pair in cutlass.range_constexpr(2):
                            o_rc[rr, (pair, j, 0)] = o_rc[rr, (pair, j, 0)] * alpha[j]
                v_ring.consumer_wait(v_state)
                v_base = v_base0 + v_state.index * (bn * d)
                tail = seqlen_k - tile * bn
                if tail < bn:                              # V rows past the keys: zeros
                    fp8_swap.clear_rows(v_base, tail, tidx, bn)
                # every warp past its wait for PV_{j-1} (which read all of P'^T) before any
                # writes P'_j; and V's cleared rows before any warp's ldmatrix
                consumers.arrive_and_wait()
                fp8_swap.load_vt_fragment(vt_frag, v_base, warp, lane)
                if tail < bn:                              # (the async proxy writes it next)
                    cute.arch.fence_proxy("async.shared", space="cta")
                tma.release_stage(v_ring, v_state)
                v_state.advance()
                fp8_swap.store_p_two_terms(p_base, s_rc, warp, lane)
                cute.arch.fence_proxy("async.shared", space="cta")   # P'^T for the WGMMA
                consumers.arrive_and_wait()
            if n_count > 0:                                # the last tile's PV
                wgmma.gemm(mma_o, acc_o, vt_frag, p_frag, zero_init=False)
                warpgroup.wait_group(0)

            # the row sums across the 8 lanes and the 4 warps
            for j in cutlass.range_constexpr(my_rows):
                for off in (4, 8, 16):
                    l_run[j] = l_run[j] + cute.arch.shuffle_sync_bfly(l_run[j], offset=off)
            consumers.arrive_and_wait()                    # (the last tile's maxima read)
            if g == 0:
                for j in cutlass.range_constexpr(my_rows):
                    row_max[warp, qq + 4 * j, 0] = l_run[j]
            consumers.arrive_and_wait()
            inv = cute.make_rmem_tensor((my_rows,), Float32)
            lse = cute.make_rmem_tensor((my_rows,), Float32)
            v_scale = mVDescale[batch, kv_head] * Float32(1.0 / fp8_swap.P_SCALE)
            for j in cutlass.range_constexpr(my_rows):
                sums = cute.make_rmem_tensor((4,), Float32)
                cute.autovec_copy(row_max[None, qq + 4 * j, 0], sums)
                total = sums[0] + sums[1] + sums[2] + sums[3]
                inv[j] = Float32(0.0)
                lse[j] = -Float32.inf
                if total > Float32(0.0):
                    inv[j] = v_scale / total
                    lse[j] = (m_run[j] + cute.math.log2(total, fastmath=True)) \
                        * Float32(split_kv.LN_2)
            self.store_out(o, mLSE, mOPart, mLSEPart, mCount, acc_o, o_rc, inv, lse, storage,
                           consumers, split, splits, kv_head, batch, rows_valid, group, heads_kv,
                           tidx, warp, lane)

    @cute.jit
    def tile_softmax(self, s_rc, row_c, limits, m_run, l_run, alpha, row_max, tile, masked,
                     buf, warp, lane, consumers):
        """S^T's hi and lo columns summed, scaled, masked (where `masked`: a tile with keys
        some row does not see); the rows' maxima across the warpgroup; P' = 2^8 exp2(t - m)
        into the hi columns; the sums rescaled, and `alpha` per row for O'^T."""
        g, qq = lane // 4, lane % 4
        bn = self.block_n
        for j in cutlass.range_constexpr(cute.size(row_c)):
            top = -Float32.inf
            for a in cutlass.range_constexpr(cute.size(s_rc.shape[0][1])):
                for i in cutlass.range_constexpr(2):
                    t = (s_rc[(i, a), (0, j, 0)] + s_rc[(i, a), (1, j, 0)]) * row_c[j]
                    if masked:
                        if tile * bn + 64 * a + 16 * warp + g + 8 * i >= limits[j]:
                            t = -Float32.inf               # (a NaN of the cache replaced)
                    s_rc[(i, a), (0, j, 0)] = t
                    top = cute.arch.fmax(top, t)
            for off in (4, 8, 16):
                top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=off))
            if g == 0:
                row_max[warp, qq + 4 * j, buf] = top
        consumers.arrive_and_wait()
        for j in cutlass.range_constexpr(cute.size(row_c)):
            tops = cute.make_rmem_tensor((4,), Float32)
            cute.autovec_copy(row_max[None, qq + 4 * j, buf], tops)
            m_new = cute.arch.fmax(cute.arch.fmax(m_run[j], tops[0]),
                                   cute.arch.fmax(tops[1], cute.arch.fmax(tops[2], tops[3])))
            m_use = m_new
            if m_new == -Float32.inf:                      # no key yet: P = 0, no NaN
                m_use = Float32(0.0)
            alpha[j] = cute.math.exp2(m_run[j] - m_use, fastmath=True)
            m_run[j] = m_new
            total = Float32(0.0)
            for a in cutlass.range_constexpr(cute.size(s_rc.shape[0][1])):
                for i in cutlass.range_constexpr(2):
                    p = cute.math.exp2(s_rc[(i, a), (0, j, 0)] - m_use, fastmath=True)
                    total = total + p
                    s_rc[(i, a), (0, j, 0)] = p * Float32(fp8_swap.P_SCALE)
            l_run[j] = l_run[j] * alpha[j] + total

    @cute.jit
    def store_out(self, o, mLSE, mOPart, mLSEPart, mCount, acc_o, o_rc, inv, lse, storage,
                  consumers, split, splits, kv_head, batch, rows_valid, group, heads_kv, tidx,
                  warp, lane):
        """O = (hi + lo columns of O'^T) x inv per row, d = 64 mb + 16 warp + 2g + i: pairs
        of neighbouring d per store; with one split to `o` and the LSE, else the partials,
        and the last CTA combines (decode.py's protocol)."""
        g, qq = lane // 4, lane % 4
        d = self.head_dim
        part_rows = rows_valid
        item = batch * heads_kv + kv_head
        for j in cutlass.range_constexpr(cute.size(inv)):
            r = qq + 4 * j
            if r < rows_valid:
                for mb in cutlass.range_constexpr(cute.size(o_rc.shape[0][1])):
                    col = 64 * mb + 16 * warp + 2 * g
                    pair = cute.make_rmem_tensor((2,), Float32)
                    for i in cutlass.range_constexpr(2):
                        pair[i] = (o_rc[(i, mb), (0, j, 0)] + o_rc[(i, mb), (1, j, 0)]) * inv[j]
                    if splits == 1:
                        out = cute.make_rmem_tensor((2,), self.dtype)
                        out.store(pair.load().to(self.dtype))
                        dst = o[r // group, None, kv_head * group + r % group, batch]
                        cute.autovec_copy(out, cute.local_tile(dst, (2,), (col // 2,)))
                    else:
                        cute.autovec_copy(pair, cute.local_tile(
                            mOPart[(item * splits + split) * part_rows + r, None], (2,),
                            (col // 2,)))
                if warp == 0 and g == 0:
                    if splits == 1:
                        mLSE[batch, kv_head * group + r % group, r // group] = lse[j]
                    else:
                        mLSEPart[split, item * part_rows + r] = lse[j]
        if splits > 1:
            cute.arch.fence_acq_rel_gpu()
            consumers.arrive_and_wait()
            flag = storage.last.get_tensor(cute.make_layout(4))
            if tidx == 0:
                done = cute.arch.atomic_add(mCount.iterator + item, Int32(1), sem="acq_rel",
                                            scope="gpu")
                flag[0] = Int32(0)
                if done == splits - 1:
                    mCount[item] = Int32(0)
                    flag[0] = Int32(1)
            consumers.arrive_and_wait()
            if flag[0] != 0:
                cute.arch.fence_acq_rel_gpu()
                split_kv.combine(mOPart, mLSEPart, o, mLSE, item, splits, rows_valid,
                                 part_rows, Int32(0), group, kv_head, batch, tidx, None,
                                 d, self.combine_chunk, self.dtype)
