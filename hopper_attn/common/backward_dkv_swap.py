"""kb2's `dkv_swap_ab` consumer, its default at head_dim 192 (dv 192 or 128: 96-key tiles)
and 256 (48-key tiles): dK^T and dV^T accumulated with the head dim as WGMMA's M.

kb2's other d = 192 tile (`shared_keys`, kept for the softcap) holds 64 keys a CTA: both
consumer warpgroups on one 64 x 64 tile, so every Q / dO tile is loaded, and every dQ tile
added, once per 64 keys, and its GEMMs are m64n32 / m64n96 over K = 32-64. This one holds 96
keys (FlashAttention-3's d = 192 tile) by turning the accumulators that do not fit around:

    S  = Q K^T, dP = dO V^T       queries x keys (64 x 96), the warpgroups split the keys
                                  (48 each: m64n48k16); LSE and D per row (2 a thread)
    dV^T += dO^T P                dv x keys: the head dim as WGMMA's M (3 blocks of 64, or
    dK^T += Q^T dS                2 at dv = 128), each warpgroup its own 48 keys as N; A = Q^T
                                  or dO^T, B = P or dS, all four read MN-major from SMEM
    dQ = dS K                     queries x d, the warpgroups split d (m64n96k16, kb2's dQ
                                  register order: the dQ writer and conversion are kb2's)

P and dS go through SMEM (stmatrix; one buffer each). A warpgroup's dV^T and dK^T read only
the P and dS columns it wrote itself (its 48 keys), so P needs a warpgroup-wide barrier only
and dV^T is issued before dS is computed; dQ reads all of dS: a CTA-wide barrier after the
dS stores, and before a warpgroup overwrites dS, the other's previous dQ must have read it
(a named barrier each way: `DS_FREE_BARRIER`, arrive after dQ, wait before the stores).

Budget, registers per consumer thread (of 240): dK^T + dV^T 72 + 72 (dv = 128: 72 + 48),
S + dP 24 + 24, dQ 48 (after S and dP are spent), LSE and D 2 + 2. SMEM (bf16): K 36 KiB,
V 36 (24), Q 2 stages 48, dO 1 stage 24 (dv = 128: 2 stages, 32), P 12, dS 12, dQ staging
48 (64 x 192 fp32), rows and barriers ~1.3: ~217 KiB (dv = 128: ~213). A second dO stage at
dv = 192 would need 241: the producer runs dO's ring at depth 1 (`do_stages`), loading the
next dO once both warpgroups' dV^T has read this one.

d = 256 (dv 256; FlashAttention-4's sm90 tile): 64 x 48, 24 keys a warpgroup (S and dP
m64n24k16, dK^T and dV^T 4 M blocks of m64n24, dQ m64n128k16). 24 is not a multiple of 16,
so P and dS are stored by stmatrix x2 (16 x 8 a warp) into an unswizzled buffer (a 16- or
32-element swizzle atom would straddle the warpgroups' halves). The same code otherwise.

    SMEM (KiB, bf16)   K 24, V 24, Q 2 stages 64, dO 1 stage 32, P 6, dS 6, dQ staging 64
                       (64 x 256 fp32), rows and barriers ~1: 221 (compiled: 223 of 227)
    registers / thread dK^T + dV^T 48 + 48 (256 x 48 fp32 each over 256 threads), S + dP
                       12 + 12, dQ 64 (after S and dP), LSE and D 2 + 2: ~160 + addresses
                       of 240 (compiled without spills)

Other tiles do not fit: 64 x 64 needs 240 KiB with 2 Q stages (208 with one, but then dK^T +
dV^T + dQ = 192 registers before S and dP); 64 x 80 (FA3's C++ tile) 260 KiB; 64 x 32 fits
2 dO stages only without the second Q stage (232 with both) and loads Q / dO and adds dQ
once per 32 keys. kb1's d = 256 (two CTAs a 128-key tile, 128 columns of d each) computes
S and dP in both CTAs: 7 GEMM units a (query tile, 128 keys) against this tile's 5, but
loads Q / dO once per 64 keys (here 48) and adds dQ once per 128 (here 48). FA4's split of
dK^T / dV^T by d's rows instead of keys was slower (docs/kb2.md, "Tried and not kept") with its
P barrier before dV^T; `dkv_split_d` now takes FA4's order (off by default, waiting for its
GPU A/B): a CTA-wide barrier before P is stored (both warpgroups done with the last tile:
P and dS free), one after dS is computed (all of P written; then dS stored, dV^T issued),
one after dS is stored (dQ, dK^T) - the main loop FA4's, m64n48 for dK^T / dV^T.

Sliding windows: which query tiles a kv tile walks is the schedule's (as without one), and
a masked tile gets the window's two limits on S, queries x keys as in the forward (d <= 128
masks S^T). Packed batches (`varlen`) need nothing of their own here: the kernel hands this
consumer a sequence as a batch of one (common/varlen_backward.py).
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float16, Float32
from cutlass.cute.nvgpu import warpgroup

from . import tma, wgmma
from .layouts import acc_rows_cols, transposed
from .contract import LOG2_E
from .masking import mask_scores
from .softmax import softcap_scores

# named barriers (kb2 uses 0-6): P written (one per warpgroup), dS free (one per direction)
P_WRITTEN_BARRIER, DS_FREE_BARRIER = 7, 9


def dkv_swap_keys(head_dim: int) -> int:
    """Keys a CTA holds with dkv_swap_ab (half a warpgroup): 96 at d = 192, 48 at d = 256."""
    return {192: 96, 256: 48}.get(head_dim, 0)


def check_dkv_swap(kernel) -> int:
    """ValueError unless kb2 `kernel`'s other settings go with dkv_swap_ab; dO's ring depth:
    1 at dv = 192 and 256 (two stages do not fit, see above), else kb2's 2."""
    if (kernel.head_dim, kernel.head_dim_v) not in ((192, 192), (192, 128), (256, 256)):
        raise ValueError("kb2's dkv_swap_ab runs head_dim 192 (dv 192 or 128) and 256 (dv 256) "
                         f"only, got ({kernel.head_dim}, {kernel.head_dim_v})")
    others = {"shared_keys": kernel.shared_keys,
              "softcap at d = 192": kernel.softcap > 0.0 and kernel.head_dim == 192,
              "early_dv": kernel.early_dv, "dp_first": kernel.dp_first,
              "block_m != 64": kernel.block_m != 64, "stmatrix=0": not kernel.stmatrix}
    if any(others.values()):
        raise ValueError("kb2's dkv_swap_ab (64 x 96 / 64 x 48 tiles) does not take "
                         + ", ".join(name for name, on in others.items() if on))
    if kernel.dkv_split_d and kernel.head_dim != 256:
        raise ValueError("kb2's dkv_swap_ab splits dK^T / dV^T by d (dkv_split_d) at d = 256 "
                         f"only (4 M blocks), got {kernel.head_dim}")
    return 1 if kernel.head_dim_v >= 192 else kernel.stages


@dataclasses.dataclass(frozen=True)
class SwappedMmas:
    """The five GEMMs of the variant, partitioned for consumer thread `tidx` (0..255):
    `*_frag` are per-warpgroup SMEM operands (Q, dO, Q^T, dO^T with a stage mode; P and dS
    with a buffer mode), `s_coords[r, c]` the (query, key) of S register [r, c]."""

    mma_sdp: cute.TiledMma
    mma_dk: cute.TiledMma
    mma_dv: cute.TiledMma
    mma_dq: cute.TiledMma
    thr_sdp: object
    thr_dk: object
    thr_dv: object
    thr_dq: object
    q_frag: cute.Tensor
    k_frag: cute.Tensor
    do_frag: cute.Tensor
    v_frag: cute.Tensor
    qt_frag: cute.Tensor
    dot_frag: cute.Tensor
    p_frag: cute.Tensor
    dst_frag: cute.Tensor
    ds_frag: cute.Tensor
    kt_frag: cute.Tensor
    s_coords: cute.Tensor

    @staticmethod
    def create(block_m: int, block_n: int, head_dim: int, head_dim_v: int, tidx,
               sK, sV, sQ, sdO, sP, sdS, dtype, split_d: bool = False) -> "SwappedMmas":
        k_major, mn_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        half_n = block_n // 2
        mma_sdp = wgmma.qk_mma(1, 2, half_n, dtype)                    # m64n48, keys split
        # d x keys: each warpgroup its keys (split_d: every key, half of d's rows)
        dkv_wgs, dkv_n = ((2, 1), block_n) if split_d else ((1, 2), half_n)
        mma_dk = wgmma.smem_mma(*dkv_wgs, dkv_n, mn_major, mn_major, dtype)
        mma_dv = mma_dk if head_dim_v == head_dim else \
            wgmma.smem_mma(*dkv_wgs, dkv_n, mn_major, mn_major, dtype)
        mma_dq = wgmma.smem_mma(1, 2, head_dim // 2, k_major, mn_major, dtype)
        wg_sdp, wg_dk, wg_dv, wg_dq = (wgmma.warpgroup_slice(m, tidx)
                                       for m in (mma_sdp, mma_dk, mma_dv, mma_dq))
        thr_sdp = mma_sdp.get_slice(tidx)
        return SwappedMmas(
            mma_sdp, mma_dk, mma_dv, mma_dq, thr_sdp, mma_dk.get_slice(tidx),
            mma_dv.get_slice(tidx), mma_dq.get_slice(tidx),
            q_frag=wg_sdp.make_fragment_A(wg_sdp.partition_A(sQ)),
            k_frag=wg_sdp.make_fragment_B(wg_sdp.partition_B(sK)),
            do_frag=wg_sdp.make_fragment_A(wg_sdp.partition_A(sdO)),
            v_frag=wg_sdp.make_fragment_B(wg_sdp.partition_B(sV)),
            qt_frag=wg_dk.make_fragment_A(wg_dk.partition_A(transposed(sQ))),
            dot_frag=wg_dv.make_fragment_A(wg_dv.partition_A(transposed(sdO))),
            p_frag=wg_dv.make_fragment_B(wg_dv.partition_B(transposed(sP))),
            dst_frag=wg_dk.make_fragment_B(wg_dk.partition_B(transposed(sdS))),
            ds_frag=wg_dq.make_fragment_A(wg_dq.partition_A(sdS)),
            kt_frag=wg_dq.make_fragment_B(wg_dq.partition_B(transposed(sK))),
            s_coords=acc_rows_cols(thr_sdp.partition_C(
                cute.make_identity_tensor((block_m, block_n)))))

    def new_accumulator(self, thr, shape, zero: bool = False) -> cute.Tensor:
        acc = cute.make_rmem_tensor(thr.partition_shape_C(shape), Float32)
        if zero:
            acc.fill(0.0)
        return acc


@cute.jit
def row_stats(s_rows: cute.Tensor, s_coords: cute.Tensor, stage, rows: cutlass.Constexpr):
    """The per-query statistic (lse2 or D) of each S row this thread holds, from the stage's
    SMEM row into registers."""
    vals = cute.make_rmem_tensor((rows,), Float32)
    for r in cutlass.range_constexpr(rows):
        vals[r] = s_rows[s_coords[r, 0][0], stage]
    return vals


class DkvSwapConsumer:
    """kb2's consumer warpgroups with `dkv_swap_ab` (mixed into its kernel class, which
    supplies block_m / block_n / head_dim(_v), schedule, stages, do_stages, the GQA walk
    and kv_with_first_tile; named barriers as in common/backward.py)."""

    @cute.jit
    def consume_dkv_swap(self, ctidx, wg, kv_pipe: pipeline.PipelineTmaAsync,
                         q_pipe: pipeline.PipelineTmaAsync, do_pipe: pipeline.PipelineTmaAsync,
                         sK: cute.Tensor, sV: cute.Tensor, sQ: cute.Tensor, sdO: cute.Tensor,
                         sdS: cute.Tensor, sLSE: cute.Tensor, sD: cute.Tensor,
                         sdQ: cute.Pointer, scale_log2: Float32, softmax_scale: Float32,
                         mdK: cute.Tensor, mdV: cute.Tensor, tma_dk: cute.CopyAtom,
                         tma_dv: cute.CopyAtom, warp, n_block, head, batch, m_first, m_count,
                         seqlen_q, seqlen_k, group, sP=None):
        """kb2's `consume` (same arguments) for the 96-key tile: every query tile the CTA
        visits, then dK and dV out."""
        from .backward import (DQ_EMPTY_BARRIER, DQ_FULL_BARRIER, DQ_HANDOFF_THREADS,
                               DS_WRITTEN_BARRIER, EPILOGUE_BARRIER, fragment_slot, write_dkv)
        bm, bn, d, dv, dtype = (self.block_m, self.block_n, self.head_dim, self.head_dim_v,
                                self.dtype)
        split_d = self.dkv_split_d
        mmas = SwappedMmas.create(bm, bn, d, dv, ctidx, sK, sV, sQ, sdO, sP, sdS, dtype,
                                  split_d)
        s_coords = mmas.s_coords
        acc_dk = mmas.new_accumulator(mmas.thr_dk, (d, bn), zero=True)       # dK^T
        acc_dv = mmas.new_accumulator(mmas.thr_dv, (dv, bn), zero=True)      # dV^T
        store_sdp = wgmma.stmatrix_store(mmas.mma_sdp, dtype, 4 if bn // 2 % 16 == 0 else 2)
        thr_store = store_sdp.get_slice(ctidx)
        p_smem, ds_smem = thr_store.partition_D(sP), thr_store.partition_D(sdS)
        ds_written = pipeline.NamedBarrier(barrier_id=DS_WRITTEN_BARRIER, num_threads=256)

        if cutlass.const_expr(not self.kv_with_first_tile):
            kv_pipe.consumer_wait(tma.consumer_state(1))
        consume = tma.consumer_state(self.stages)
        consume_do = tma.consumer_state(self.do_stages)
        causal_offset = seqlen_k - seqlen_q
        # the exponents' factor: scale log2(e), or with a softcap cap log2(e) (on tanh)
        score_log2 = scale_log2
        if cutlass.const_expr(self.softcap > 0.0):
            score_log2 = Float32(self.softcap * LOG2_E)
        visits = self.visits(m_count, group)
        for it in cutlass.range(visits, unroll=1):
            if cutlass.const_expr(self.gqa):
                first, end = self.schedule.m_block_range(n_block, seqlen_q, seqlen_k)
                _, m_block = self.work_item(it, first, end - first)
            else:
                m_block = m_first + it
            stage, do_stage = consume.index, consume_do.index
            q_pipe.consumer_wait(consume)
            acc_s = mmas.new_accumulator(mmas.thr_sdp, (bm, bn))
            acc_dp = mmas.new_accumulator(mmas.thr_sdp, (bm, bn))
            s_rc, dp_rc = acc_rows_cols(acc_s), acc_rows_cols(acc_dp)
            rows = cute.size(s_rc, mode=[0])
            wgmma.gemm(mmas.mma_sdp, acc_s, mmas.q_frag[None, None, None, stage], mmas.k_frag,
                       zero_init=True)                                        # S
            lse2 = row_stats(sLSE, s_coords, stage, rows)
            do_pipe.consumer_wait(consume_do)
            wgmma.gemm(mmas.mma_sdp, acc_dp, mmas.do_frag[None, None, None, do_stage],
                       mmas.v_frag, zero_init=True)                           # dP
            warpgroup.wait_group(1)                                           # S has landed
            if cutlass.const_expr(self.softcap > 0.0):
                # t = tanh(s scale / cap) before the mask; dS times 1 - t^2, kept in fp16
                # until dS (kb2's softcap without dp_first; docs/softcap.md)
                softcap_scores(s_rc, scale_log2 * (1.0 / (self.softcap * LOG2_E)))
                tanh_slope = cute.make_rmem_tensor(s_rc.shape, Float16)
                for r in cutlass.range_constexpr(rows):
                    for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
                        tanh_slope[r, c] = Float16(1.0 - s_rc[r, c] * s_rc[r, c])
            if self.schedule.needs_mask(m_block, n_block, seqlen_q, seqlen_k):
                if cutlass.const_expr(self.schedule.windowed):     # S: queries x keys
                    mask_scores(s_rc, s_coords, m_block * bm, n_block * bn, seqlen_k,
                                self.schedule.right_limit is not None, causal_offset,
                                right=self.schedule.right,
                                left=self.schedule.window_left)
                else:
                    mask_scores(s_rc, s_coords, m_block * bm, n_block * bn, seqlen_k,
                                self.causal, causal_offset)
            for r in cutlass.range_constexpr(rows):
                for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
                    s_rc[r, c] = cute.math.exp2(s_rc[r, c] * score_log2 - lse2[r],
                                                fastmath=True)               # P
            dsum = row_stats(sD, s_coords, do_stage, rows)
            # P -> SMEM; this warpgroup's dV^T reads only its own 48 keys of it
            p_out = cute.make_rmem_tensor_like(acc_s, dtype)
            p_out.store(acc_s.load().to(dtype))
            if cutlass.const_expr(split_d):
                # FA4's order: both warpgroups done with the previous tile (P and dS free)
                if it > 0:
                    ds_written.arrive_and_wait()
            cute.copy(store_sdp, thr_store.retile(p_out), p_smem[None, None, None, 0])
            cute.arch.fence_proxy("async.shared", space="cta")
            if cutlass.const_expr(not split_d):
                cute.arch.barrier(barrier_id=P_WRITTEN_BARRIER + wg, number_of_threads=128)
                wgmma.gemm(mmas.mma_dv, acc_dv, mmas.dot_frag[None, None, None, do_stage],
                           mmas.p_frag[None, None, None, 0], zero_init=False)  # dV^T += dO^T P
            warpgroup.wait_group(1 if not split_d else 0)                     # dP has landed
            for r in cutlass.range_constexpr(rows):
                for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
                    dp_rc[r, c] = s_rc[r, c] * (dp_rc[r, c] - dsum[r])        # dS
                    if cutlass.const_expr(self.softcap > 0.0):
                        dp_rc[r, c] = dp_rc[r, c] * Float32(tanh_slope[r, c])
            ds_out = cute.make_rmem_tensor_like(acc_dp, dtype)
            ds_out.store(acc_dp.load().to(dtype))
            if cutlass.const_expr(split_d):
                ds_written.arrive_and_wait()          # all of P written; dV^T reads it
                cute.copy(store_sdp, thr_store.retile(ds_out), ds_smem[None, None, None, 0])
                wgmma.gemm(mmas.mma_dv, acc_dv, mmas.dot_frag[None, None, None, do_stage],
                           mmas.p_frag[None, None, None, 0], zero_init=False)  # dV^T += dO^T P
            else:
                if it > 0:      # the other warpgroup's previous dQ has read dS
                    cute.arch.barrier(barrier_id=DS_FREE_BARRIER + wg, number_of_threads=256)
                cute.copy(store_sdp, thr_store.retile(ds_out), ds_smem[None, None, None, 0])
            cute.arch.fence_proxy("async.shared", space="cta")
            ds_written.arrive_and_wait()                                      # both halves
            acc_dq = mmas.new_accumulator(mmas.thr_dq, (bm, d))
            wgmma.gemm(mmas.mma_dq, acc_dq, mmas.ds_frag[None, None, None, 0], mmas.kt_frag,
                       zero_init=True)                                        # dQ = dS K
            warpgroup.wait_group(1)                                           # dV^T is done
            do_pipe.consumer_release(consume_do)
            wgmma.gemm(mmas.mma_dk, acc_dk, mmas.qt_frag[None, None, None, stage],
                       mmas.dst_frag[None, None, None, 0], zero_init=False)  # dK^T += Q^T dS
            warpgroup.wait_group(1)                                           # dQ is done
            if cutlass.const_expr(not split_d):   # (split_d: the next tile's first barrier)
                if it + 1 < visits:
                    cute.arch.barrier_arrive(barrier_id=DS_FREE_BARRIER + 1 - wg,
                                             number_of_threads=256)
            # dQ -> the staging buffer (kb2's register order), once the writer has read the last
            cute.arch.barrier(barrier_id=DQ_EMPTY_BARRIER + wg,
                              number_of_threads=DQ_HANDOFF_THREADS)
            slot = fragment_slot(sdQ, 0, ctidx, bm, d, cute.size(acc_dq))
            cute.autovec_copy(cute.make_tensor(acc_dq.iterator, slot.layout.shape), slot)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier_arrive(barrier_id=DQ_FULL_BARRIER + wg,
                                     number_of_threads=DQ_HANDOFF_THREADS)
            warpgroup.wait_group(0)                                           # dK^T is done
            q_pipe.consumer_release(consume)
            consume.advance()
            consume_do.advance()

        # Epilogue: dK^T * scale and dV^T -> dtype -> K's and V's SMEM (transposed views)
        epilogue = pipeline.NamedBarrier(barrier_id=EPILOGUE_BARRIER, num_threads=256)
        acc_dk.store(acc_dk.load() * softmax_scale)
        write_dkv(self.dkv_fp32, epilogue, warp, mmas.thr_dk, mmas.thr_dv, acc_dk, acc_dv, sK,
                  sV, dtype, tma_dk, tma_dv, mdK, mdV, head, batch, n_block, swapped=True)
