"""kb1: the FlashAttention-2 backward pass, on Hopper's WGMMA and TMA.

What it computes (docs/05-backward-math.md): given Q, K, V, dO, the forward's log-sum-exp
and D = rowsum(dO * O) (common/backward.py's preprocess), one CTA per kv tile (block_n keys
of one head) walks the query tiles that see its keys and, per query tile,

    S^T  = K Q^T                 recomputed (rows: keys, columns: queries)
    P^T  = exp2(S^T * scale_log2 - lse2)   the forward's probabilities, from the LSE alone
    dP^T = V dO^T
    dV  += P^T dO
    dS^T = P^T * (dP^T - D)
    dK  += dS^T Q
    dQ  += dS K                  fp32 reduce-adds into a global buffer (other CTAs add theirs)

and at the end writes dK * scale and dV. The postprocess turns the dQ buffer into dQ.

Why transposed (S^T rather than S, as FlashAttention-3 does): a warpgroup owns 64 *keys*,
so the rows of S^T, dP^T and the dK/dV accumulators are the same 64 keys, and P^T and dS^T
go from one WGMMA's accumulator straight into the next one's A operand in registers
(`acc_as_operand_a`, the forward's P V trick): dV += P^T dO and dK += dS^T Q need no SMEM
for P or dS. Q and dO are read twice from the same SMEM tile: K-major as B of S^T and dP^T,
MN-major (`transposed`) as B of dV and dK.

dQ = dS K needs dS with *queries* as rows, the other orientation: each warpgroup stores its
dS^T (bf16) to SMEM, and after a CTA barrier both warpgroups read all of it as an MN-major
A operand; warpgroup w computes dQ's columns [w d/2, (w+1) d/2) and reduce-adds its
64 x d/2 fp32 partial (`red.global.add.f32`, 32 per thread at d = 128) into the buffer. Two
dS buffers alternate, so one barrier per query tile is enough: a warpgroup that writes
buffer b again (two tiles later) has passed the barrier the other one only reaches after
its dQ WGMMA on buffer b retired.

Per query tile: 5 WGMMA batches (S^T and dP^T issued back to back, then dV, dK, dQ), one
CTA barrier, 32 (d = 128) or 16 (d = 64) reduce-adds per thread. Warp 0 issues every TMA
load from inside the loop, as k4 does: K and V once, Q and dO tiles through a 2-stage ring.
What kb2 changes: warp specialization, dQ through SMEM and TMA reduce-add, register budget.

The order of dQ's fp32 additions depends on which CTA gets there first: dQ is not bitwise
reproducible from run to run (dK and dV are).

At d = 256 two CTAs share a kv tile, each owning 128 of d's columns of dK, dV and dQ (both
compute S^T and dP^T over all of d), with one Q / dO stage (docs/kb1.md, "d = 256").

Budget: block 64 (queries) x 128 (keys), 256 threads = 2 warpgroups of 64 keys each.
SMEM (d = 128): K + V 64 KiB, 2 stages x (Q + dO) 64 KiB, 2 dS^T buffers 32 KiB = 160 KiB
(d = 64: 96 KiB). Registers per thread at d = 128: dK + dV accumulators 128, S^T 32,
dP^T 32, P^T and dS^T as bf16 16 + 16, dQ 32 (not all live at once); no spills.
"""

from __future__ import annotations

import torch

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from hopper_attn.common import tma, wgmma
from hopper_attn.common.backward import (BackwardTiles, backward_smem, compile_backward,
                                         run_backward, stage_dkv, store_dkv)
from hopper_attn.common.contract import KernelSpec
from hopper_attn.common.layouts import acc_as_operand_a, acc_rows_cols, operand_a_as_acc
from hopper_attn.common.masking import KVTileSchedule, mask_scores

SPEC = KernelSpec(
    name="kb1",
    summary="FA2 backward on WGMMA: S^T/dP^T recomputed per kv tile, dQ by fp32 reduce-adds",
    head_dims=(64, 128, 256),
    dtypes=(torch.bfloat16, torch.float16),
    separate_kv=True,
)


@cute.jit
def column_part(t: cute.Tensor, part, cols: int) -> cute.Tensor:
    """Columns [part * cols, (part + 1) * cols) of a (rows, d) or (rows, d, stage) SMEM tile
    (a view: with 64-column swizzle atoms, a part of 128 columns is two whole atoms)."""
    rows = cute.size(t, mode=[0])
    tiles = cute.flat_divide(t, (rows, cols))        # (rows, cols, 1, parts[, stage])
    if cutlass.const_expr(cute.rank(t) == 3):
        return tiles[None, None, 0, part, None]
    return tiles[None, None, 0, part]


class FlashAttentionBackwardKB1:
    def __init__(self, head_dim: int, causal: bool, block_m: int = 64, block_n: int = 128,
                 stages: int = 2):
        if block_m != 64 or block_n != 128:
            raise ValueError("kb1 runs 64 x 128 tiles (one warpgroup per 64 keys, "
                             f"dQ split by columns); got {block_m} x {block_n}")
        self.head_dim, self.causal = head_dim, causal
        self.block_m, self.block_n, self.stages = block_m, block_n, stages
        self.warpgroups = block_n // 64
        self.threads = 128 * self.warpgroups
        # d = 256: dK and dV of 64 keys x 256 columns would take 256 accumulator registers
        # per thread. Two CTAs share each kv tile instead, each owning 128 of d's columns of
        # dK, dV and dQ; both compute all of S^T and dP^T (which contract over the whole of d)
        self.d_parts = 2 if head_dim > 128 else 1
        self.d_part = head_dim // self.d_parts
        self.schedule = KVTileSchedule(block_m, block_n, causal, parts=self.d_parts)

    def describe(self) -> dict:
        return {"smem_bytes": getattr(self, "smem_bytes", None), "block_m": self.block_m,
                "block_n": self.block_n, "stages": self.stages, "threads": self.threads,
                "d_parts": self.d_parts}

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, scale_log2: Float32, softmax_scale: Float32, stream):
        bm, bn, d = self.block_m, self.block_n, self.head_dim
        self.dtype = mQ.element_type
        tiles = BackwardTiles.create(mQ, mK, mV, mdO, mdK, mdV, bm, bn, d, self.stages,
                                     dkv_cols=self.d_part)
        q_layout, kv_layout, ds_layout = tiles.q_layout, tiles.kv_layout, tiles.ds_layout
        self.qdo_bytes = 2 * tma.tma_bytes(self.dtype, q_layout)
        self.kv_bytes = 2 * tma.tma_bytes(self.dtype, kv_layout)

        @cute.struct
        class SharedStorage:
            kv_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            qdo_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(kv_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(kv_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(ds_layout)], 1024]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        self.kernel(*tiles.tensors, *tiles.atoms, mLSE2, mD, mdQacc,
                    scale_log2, softmax_scale, q_layout, kv_layout, ds_layout,
                    tiles.dkv_layout).launch(
            grid=self.schedule.grid(tiles.seqlen_k, tiles.heads, tiles.batch),
            block=[self.threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mdO: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
               mdK: cute.Tensor, mdV: cute.Tensor, tma_q: cute.CopyAtom, tma_do: cute.CopyAtom,
               tma_k: cute.CopyAtom, tma_v: cute.CopyAtom, tma_dk: cute.CopyAtom,
               tma_dv: cute.CopyAtom, mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor,
               scale_log2: Float32, softmax_scale: Float32, q_layout: cute.ComposedLayout,
               kv_layout: cute.ComposedLayout, ds_layout: cute.ComposedLayout,
               dkv_layout: cute.ComposedLayout):
        bm, bn, d, dtype = self.block_m, self.block_n, self.head_dim, self.dtype
        d_out = self.d_part                     # dK, dV, dQ columns of this CTA
        tidx, _, _ = cute.arch.thread_idx()
        (n_block, head, batch, kv_head, seqlen_q, seqlen_k, m_first,
         m_count) = self.schedule.cta_work(mQ, mK)
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            tma.prefetch_descriptors(tma_q, tma_do, tma_k, tma_v, tma_dk, tma_dv)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sK, sV, sQ, sdO, sdSt = backward_smem(storage, q_layout, kv_layout, ds_layout)

        # K, V: one load (a one-stage pipeline); Q, dO: a ring, one barrier per stage for both
        kv_pipe = tma.make_tma_ring(storage.kv_barriers.data_ptr(), 1, self.threads // 32,
                                    self.kv_bytes)
        qdo_pipe = tma.make_tma_ring(storage.qdo_barriers.data_ptr(), self.stages,
                                     self.threads // 32, self.qdo_bytes)
        tma.barriers_ready()
        k_load = tma.TmaTiles.partition(tma_k, mK, kv_head, batch, sK)
        v_load = tma.TmaTiles.partition(tma_v, mV, kv_head, batch, sV)
        q_load = tma.TmaTiles.partition(tma_q, mQ, head, batch, sQ)
        do_load = tma.TmaTiles.partition(tma_do, mdO, head, batch, sdO)
        produce = tma.producer_state(self.stages)
        consume = tma.consumer_state(self.stages)
        if warp == 0:
            kv_state = tma.producer_state(1)
            kv_pipe.producer_acquire(kv_state)
            k_load.copy(n_block, kv_pipe.producer_get_barrier(kv_state))
            v_load.copy(n_block, kv_pipe.producer_get_barrier(kv_state))
            for _ in cutlass.range(cutlass.min(self.stages, m_count), unroll=1):
                produce = self.load_q_do(qdo_pipe, q_load, do_load, produce, m_first)

        # the five GEMMs (common/wgmma.py): S^T, dP^T (keys x queries), dV, dK (keys x d, A
        # from registers), dQ (queries x d/2 per warpgroup)
        part = self.schedule.part()
        columns = None
        if cutlass.const_expr(self.d_parts > 1):
            columns = (d_out, column_part(sK, part, d_out), column_part(sQ, part, d_out),
                       column_part(sdO, part, d_out))
        mmas = wgmma.BackwardMmas.create(self.warpgroups, bm, bn, d, tidx, sK, sV, sQ, sdO, sdSt,
                                         dtype, columns=columns)
        st_coords = mmas.st_coords
        acc_dk = mmas.new_dkv_accumulator(bn, d_out)
        acc_dv = mmas.new_dkv_accumulator(bn, d_out)
        dq_accum = mdQacc[batch, head, None, None]                        # (padded rows, d)

        kv_pipe.consumer_wait(tma.consumer_state(1))
        causal_offset = seqlen_k - seqlen_q
        for it in cutlass.range(m_count, unroll=1):
            m_block = m_first + it
            qdo_pipe.consumer_wait(consume)
            stage = consume.index
            acc_st = mmas.new_st_accumulator(bm, bn)
            acc_dpt = mmas.new_st_accumulator(bm, bn)
            wgmma.gemm(mmas.mma_sdp, acc_st, mmas.k_frag, mmas.q_frag[None, None, None, stage],
                       zero_init=True)
            wgmma.gemm(mmas.mma_sdp, acc_dpt, mmas.v_frag, mmas.do_frag[None, None, None, stage],
                       zero_init=True)
            # the per-query statistics of this thread's columns (padded: no bounds checks)
            st_rc, dpt_rc = acc_rows_cols(acc_st), acc_rows_cols(acc_dpt)
            cols = cute.size(st_rc, mode=[1])
            lse2 = cute.make_rmem_tensor((cols,), Float32)
            dsum = cute.make_rmem_tensor((cols,), Float32)
            for c in cutlass.range_constexpr(cols):
                query = m_block * bm + st_coords[0, c][1]
                lse2[c] = mLSE2[batch, head, query]
                dsum[c] = mD[batch, head, query]
            warpgroup.wait_group(1)                                     # S^T has landed
            if self.schedule.needs_mask(m_block, n_block, seqlen_q, seqlen_k):
                mask_scores(st_rc, st_coords, n_block * bn, m_block * bm, seqlen_k,
                            self.causal, causal_offset, transposed=True)
            for r in cutlass.range_constexpr(cute.size(st_rc, mode=[0])):
                for c in cutlass.range_constexpr(cols):
                    st_rc[r, c] = cute.math.exp2(st_rc[r, c] * scale_log2 - lse2[c],
                                                 fastmath=True)          # P^T
            mmas.pt_frag.store(acc_as_operand_a(acc_st).load().to(dtype))
            wgmma.gemm(mmas.mma_dkv, acc_dv, mmas.pt_frag, mmas.dot_frag[None, None, None, stage],
                       zero_init=False)
            warpgroup.wait_group(1)                                     # dP^T has landed
            for r in cutlass.range_constexpr(cute.size(st_rc, mode=[0])):
                for c in cutlass.range_constexpr(cols):
                    dpt_rc[r, c] = st_rc[r, c] * (dpt_rc[r, c] - dsum[c])   # dS^T
            mmas.dst_frag.store(acc_as_operand_a(acc_dpt).load().to(dtype))
            wgmma.gemm(mmas.mma_dkv, acc_dk, mmas.dst_frag, mmas.qt_frag[None, None, None, stage],
                       zero_init=False)
            # dS^T to SMEM for dQ; then every warpgroup's part must be there
            buf = it % 2
            ds_out = operand_a_as_acc(mmas.dst_frag, acc_dpt)         # dS^T, converted once
            cute.autovec_copy(ds_out, mmas.thr_sdp.partition_C(sdSt[None, None, buf]))
            cute.arch.fence_proxy("async.shared", space="cta")   # visible to the WGMMA unit
            cute.arch.barrier()
            acc_dq = mmas.new_dq_accumulator(bm, d_out)
            wgmma.gemm(mmas.mma_dq, acc_dq, *mmas.dq_operands(buf),
                       zero_init=True)
            warpgroup.wait_group(0)
            qdo_pipe.consumer_release(consume)                 # Q, dO of this stage are read
            consume.advance()
            if warp == 0 and produce.count < m_count:
                produce = self.load_q_do(qdo_pipe, q_load, do_load, produce, m_first)
            dq_part = mmas.thr_dq.partition_C(cute.local_tile(dq_accum, (bm, d_out),
                                                              (m_block, part)))
            for i in cutlass.range_constexpr(cute.size(acc_dq)):
                cute.arch.red(dq_part.iterator + cute.crd2idx(i, dq_part.layout), acc_dq[i],
                              op="add", dtype="f32", sem="relaxed", scope="gpu")

        # Epilogue: dK * scale and dV -> dtype -> SMEM (K's and V's buffers) -> TMA stores
        acc_dk.store(acc_dk.load() * softmax_scale)
        cute.arch.barrier()                                      # every WGMMA has read K, V
        # staged in K's and V's buffers (from their start, in the store's own layout)
        sK_out, sV_out = sK, sV
        if cutlass.const_expr(self.d_parts > 1):
            sK_out, sV_out = (buf.get_tensor(dkv_layout.outer, swizzle=dkv_layout.inner)
                              for buf in (storage.sK, storage.sV))
        stage_dkv(mmas.thr_dkv, acc_dk, acc_dv, sK_out, sV_out, dtype)
        cute.arch.barrier()
        if warp == 0:
            store_dkv(tma_dk, tma_dv, mdK, mdV, head, batch, sK_out, sV_out, n_block, part)

    @cute.jit
    def load_q_do(self, qdo_pipe: pipeline.PipelineTmaAsync, q_load: tma.TmaTiles,
                  do_load: tma.TmaTiles, produce: pipeline.PipelineState, m_first: Int32):
        """Producer (warp 0): query tile m_first + produce.count's Q and dO into a free stage."""
        qdo_pipe.producer_acquire(produce)
        barrier = qdo_pipe.producer_get_barrier(produce)
        q_load.copy(m_first + produce.count, barrier, produce.index)
        do_load.copy(m_first + produce.count, barrier, produce.index)
        produce.advance()
        return produce


def compile_kernel(problem, *, compile_options: str = "", block_m: int = 64,
                   block_n: int = 128, stages: int = 0):
    """Compile (or fetch from the cache) kb1 and its pre/post-processing kernels. stages:
    the Q / dO ring (0: 2, and 1 at d = 256, where K and V take 128 KiB of SMEM)."""
    stages = stages or (1 if problem.head_dim > 128 else 2)
    return compile_backward(SPEC, FlashAttentionBackwardKB1, problem,
                            {"block_m": block_m, "block_n": block_n, "stages": stages},
                            compile_options=compile_options)


def run_kernel(handle, q, k, v, o, do, lse, dq, dk, dv, softmax_scale=None, checked=False):
    return run_backward(handle, q, k, v, o, do, lse, dq, dk, dv, softmax_scale, checked)
