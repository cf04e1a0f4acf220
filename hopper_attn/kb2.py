"""kb2: the backward with FlashAttention-3's Hopper techniques, as a diff from kb1.

What changes from kb1:

* Warp specialization (common/warp_roles.py, as in k5). Warpgroup 0 is the producer: its
  warp 0 issues every TMA load (K and V once; then per query tile Q with its LSE row and dO
  with its D row), its warp 1 is the dQ writer (below), warps 2-3 idle. Warpgroups 1-2 are
  the consumers (64 keys each) and only compute. `setmaxnreg`: 24 registers for the producer
  warpgroup, 240 for the consumers.
* Q and dO through separate 2-stage rings, each with its per-row statistic loaded by TMA
  into the same stage (lse2 with Q, D with dO): S^T = K Q^T starts as soon as Q has landed,
  and the statistics are read from SMEM rather than from global memory.
* dQ through SMEM and a bulk reduce-add. kb1 issued 32 `red.global.add.f32` per thread and
  query tile. Here a consumer warpgroup writes its 64 x d/2 fp32 dQ partial to SMEM (16-byte
  vector stores, in the accumulator's own register order: no shuffling), and the dQ writer
  warp adds the whole 16 KiB block to global memory with one
  `cp.reduce.async.bulk.global.shared::cta.add.f32` (tma.bulk_reduce_add_f32). The global
  buffer is therefore in "fragment order"; the postprocess (`DqConvertFragments`) knows the
  mapping back to (row, column). Two named barriers per warpgroup hand the SMEM buffer back
  and forth (dQ full: 128 consumer threads arrive, the writer waits; dQ empty: the writer
  arrives once the copy engine has read it, the consumers wait before writing the next).
* The consumer's order (FlashAttention-3's): S^T and dP^T issued back to back (each
  thread's lse2 values read from SMEM meanwhile); P^T while dP^T still runs; dS^T; dS^T ->
  SMEM (stmatrix) and dV += P^T dO issued (with a mask its first 16 queries go right after
  P^T instead, the rest after the dS^T stores: `early_dv`, `split_dv`); one barrier;
  dQ = dS K issued, waiting only for dV; dK += dS^T Q issued, waiting only for dQ;
  dQ -> SMEM while dK runs. The tensor core always has the next GEMM queued behind the
  current one.

What stays: kb1's 128-key tiles, the transposed formulation (P^T and dS^T from registers
into dV and dK), dS^T through SMEM for dQ (double-buffered), causal tile skipping, GQA and
seqlen_k != seqlen_q, the pre/post-processing structure. One CTA per (kv tile, head, batch)
as in kb1; at d = 128 with a causal mask they are launched longest first inside groups of
heads that share L2 (`longest_first`, masking.KVTileSchedule), so the grid does not end on
the long CTAs of the last heads. Query tiles (`TILES`, FlashAttention-3's
choices): 128 rows at d = 64; at d = 128 80 rows without a mask (dQ computed transposed,
`dq_swap_ab`; dS^T's SMEM addresses recomputed per tile, or one register spills) and 64 with
one. At d = 128 the prologue is FA4's: K rides on the first Q stage's barrier and V on the
first dO stage's (S^T of the first tile waits for K and Q only), and the main kernel is a
programmatic dependent launch of the preprocess (its first loads start before the
preprocess has finished; lse2, D and the zeroed dQ buffer are read after
`griddepcontrol.wait`), as is the dQ conversion of the main kernel.

Budget (d = 128, 64-row tiles): 384 threads = producer WG + 2 consumer WGs. SMEM: K + V 64 KiB,
2 x (Q + dO) 64 KiB, 2 x dS^T 32 KiB, dQ staging 2 x 16 KiB, LSE and D rows 1 KiB, barriers:
~193 KiB (d = 64: ~113 KiB). Registers: 240 per consumer thread (dK + dV accumulators 128,
S^T 32, dP^T 32, P^T and dS^T as bf16 16 + 16, dQ 32; not all live at once), 24 per
producer thread.

Named barriers: 0 = the CTA-wide sync publishing the mbarrier inits; 1 = dS^T written
(256 consumer threads); 2 = epilogue (consumers); 3-4 = dQ full, 5-6 = dQ empty (one per
consumer warpgroup, 128 + 32 threads).
"""

from __future__ import annotations

from typing import Optional

import torch

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from hopper_attn.common import tma, wgmma
from hopper_attn.common.backward import (BackwardTiles, backward_smem, compile_backward,
                                         fragment_slot, run_backward, stage_dkv, store_dkv,
                                         wait_for_count)
from hopper_attn.common.compiler_hints import opaque, pin
from hopper_attn.common.contract import KernelSpec
from hopper_attn.common.layouts import acc_as_operand_a, acc_rows_cols, operand_a_as_acc
from hopper_attn.common.masking import KVTileSchedule, mask_scores
from hopper_attn.common.trace import PhaseTrace
from hopper_attn.common.warp_roles import WarpRoles

SPEC = KernelSpec(
    name="kb2",
    summary="kb1 + producer warpgroup, setmaxnreg, Q/dO rings with LSE/D, dQ by bulk reduce-add",
    head_dims=(64, 128),
    dtypes=(torch.bfloat16, torch.float16),
    separate_kv=True,
)

DS_WRITTEN_BARRIER, EPILOGUE_BARRIER, DQ_FULL_BARRIER, DQ_EMPTY_BARRIER = 1, 2, 3, 5
DQ_HANDOFF_THREADS = 128 + 32          # a consumer warpgroup and the dQ writer warp


class FlashAttentionBackwardKB2:
    dq_fragment_order = True           # dq_accum as the dQ WGMMA's registers (postprocess)
    takes_semaphores = True            # an int32 per (batch, head, query tile), after dV

    def __init__(self, head_dim: int, causal: bool, block_m: int = 64, block_n: int = 128,
                 stages: int = 2, rotate: bool = False, deterministic: bool = False,
                 stmatrix: bool = True, early_dv=None, dp_first: bool = False,
                 ds_address_per_tile: bool = False, kv_with_first_tile: bool = False,
                 pdl: bool = False, split_dv: int = 0, longest_first: bool = False,
                 group_mib: int = 32, group_heads: int = 0, trace: bool = False,
                 convert_per_head: bool = False):
        if block_m not in (64, 80, 128) or block_n != 128:
            raise ValueError("kb2 runs 128-key tiles (one consumer warpgroup per 64 keys) and "
                             f"64, 80 or 128 queries; got {block_m} x {block_n}")
        # dq_swap_ab: 80 query rows are not a multiple of WGMMA's M (64), so dQ is computed
        # transposed, dQ^T = K^T dS^T, with head_dim split between the warpgroups
        self.dq_swap_ab = block_m % 64 != 0
        if self.dq_swap_ab and head_dim != 128:
            raise ValueError(f"kb2 takes 80-row query tiles at head_dim 128 only, got {head_dim}")
        self.head_dim, self.causal = head_dim, causal
        self.block_m, self.block_n, self.stages = block_m, block_n, stages
        self.warpgroups = block_n // 64                     # consumer warpgroups
        self.roles = WarpRoles.create(self.warpgroups)      # 24 / 240 registers
        self.threads = self.roles.threads
        # longest_first (causal): the CTAs launched in groups of heads whose Q, dO and fp32 dQ
        # take `group_mib` MiB (N x d x 8 bytes per head; they share L2), and inside a group
        # kv tile 0 of every head first (its CTA walks the most query tiles), so the grid
        # does not end on a long CTA (masking.KVTileSchedule). 32 MiB measured best or within
        # 1% of it at N >= 2k (16-48 MiB on the H100, 12-50 on an H200; docs/kb2.md)
        self.longest_first = bool(longest_first) and causal
        l2_rows = (group_mib << 20) // (head_dim * 8) if self.longest_first else 0
        self.schedule = KVTileSchedule(block_m, block_n, causal, l2_rows, group_heads)
        # rotate: kv tile n starts its walk at query tile (n mod count), so that the CTAs of
        # one head do not all reduce-add into the same dQ tile at the same time. Off by
        # default: timed round-robin against FA4 it gains nothing without a mask and costs
        # 3-4% with a causal one (results/h100/2026-11-23_kb2_ab.json, docs/kb2.md)
        self.rotate = rotate and not deterministic
        # deterministic: the kv tiles add into each dQ tile in the order 0, 1, 2, ... (a
        # turn counter per query tile), so dQ has the same bits on every run
        self.deterministic = deterministic
        # stmatrix: dS^T -> SMEM with `stmatrix` (four 8 x 8 blocks per warp instruction)
        # instead of one 4-byte store (and its swizzled address) per register pair
        self.stmatrix = stmatrix
        # ds_address_per_tile: the stmatrix addresses of dS^T derived from an opaque thread
        # index inside the loop (compiler_hints.opaque), so they are not held in a register
        # across it: at 80 query rows that register was spilled (4 bytes) and reloaded every
        # tile; at 64 rows, which do not spill, recomputing them costs 3-4%
        self.ds_address_per_tile = bool(ds_address_per_tile)
        # early_dv: issue dV += P^T dO as soon as P^T is in registers, before waiting for
        # dP^T, instead of after dS^T. It gives the tensor core queued work while dS^T is
        # computed, and it is what makes ptxas keep the exp2 loop ahead of that wait (with
        # dV later, the compiled code waited for dP^T before the first exp2). Default: on at
        # d = 128 on 64-row tiles (+1-2%), off at d = 64, where all of dV early measured 5%
        # slower; `TILES` turns it on at d = 64 with a mask, split (split_dv below)
        self.early_dv = (head_dim == 128 and block_m == 64) if early_dv is None \
            else bool(early_dv)
        # dp_first: dP^T is issued first and starts from -D (see `consume`), S^T behind it;
        # the exp2 loop then waits for both. Saves the D registers (what lets 128 x 128
        # tiles at d = 64 run without spills) but gives up dP^T's overlap with the exp2s
        self.dp_first = dp_first
        # kv_with_first_tile: K arrives on the first Q stage's barrier and V on the first dO
        # stage's (FA4's prologue), so S^T of the first tile waits for K and Q only
        self.kv_with_first_tile = bool(kv_with_first_tile)
        # pdl: launched as a programmatic dependent of the preprocess (its loads of K, V, Q
        # and dO start before the preprocess has finished; lse2, D and the zeroed dQ buffer
        # are read after `griddepcontrol.wait`), and lets the dQ conversion launch early
        self.pdl = bool(pdl)
        # split_dv (with early_dv): only dV's first `split_dv` K blocks (16 queries each) go
        # early, enough to keep the exp2s ahead of the wait for dP^T; the rest is issued
        # between the dS^T stores and their fence, FA4's place for dV, so the tensor core has
        # dV to run while the two warpgroups meet at the dS^T barrier (`TILES`: 1 with a mask)
        self.split_dv = int(split_dv)
        if self.split_dv and not self.early_dv:
            raise ValueError("kb2: split_dv splits the early dV (early_dv)")
        # convert_per_head: at its end each CTA waits for its dQ adds to land and counts
        # itself in counters[b, h, 0] (release); the dQ conversion, launched early, starts a
        # head as soon as all its kv tiles have counted (common/backward.DqConvertFragments)
        self.convert_per_head = bool(convert_per_head)
        if self.convert_per_head and (deterministic or not pdl):
            raise ValueError("kb2: convert_per_head needs pdl and not the deterministic mode "
                             "(whose turns use the same counters)")
        self.trace = PhaseTrace(trace)          # iket phase ranges (off: no code at all)
        if dp_first and self.early_dv:
            raise ValueError("kb2: dp_first and early_dv exclude each other (dp_first waits "
                             "for dP^T before the exp2 loop)")

    @cute.jit
    def query_tile(self, it, n_block, m_first, m_count):
        """The `it`-th query tile a CTA visits (every role walks the same order)."""
        m_block = m_first + it
        if cutlass.const_expr(self.rotate):
            m_block = m_first + (it + n_block) % m_count
        return m_block

    def describe(self) -> dict:
        return {"smem_bytes": getattr(self, "smem_bytes", None), "block_m": self.block_m,
                "block_n": self.block_n, "dq_swap_ab": self.dq_swap_ab,
                "stages": self.stages, "threads": self.threads,
                "producer_regs": self.roles.producer_regs,
                "consumer_regs": self.roles.consumer_regs}

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, mSem: cute.Tensor, scale_log2: Float32,
                 softmax_scale: Float32, stream):
        lse2, dsum = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0]))
                      for t in (mLSE2, mD)]                                     # (rows, H, B)
        bm, bn, d = self.block_m, self.block_n, self.head_dim
        self.dtype = mQ.element_type
        tiles = BackwardTiles.create(mQ, mK, mV, mdO, mdK, mdV, bm, bn, d, self.stages)
        q_layout, kv_layout, ds_layout = tiles.q_layout, tiles.kv_layout, tiles.ds_layout
        # lse2 / D rings: a TMA writes each stage's row, so stages start 128 bytes apart
        row_stride = -(-bm // 32) * 32
        row_layout = cute.make_layout((bm, self.stages), stride=(1, row_stride))
        q_tiles, do_tiles, k_tiles, v_tiles, dk_tiles, dv_tiles = tiles.tensors
        tma_q, tma_do, tma_k, tma_v, tma_dk, tma_dv = tiles.atoms
        tma_lse, lse_tiles = tma.make_tma_row_load(lse2, bm)
        tma_dsum, dsum_tiles = tma.make_tma_row_load(dsum, bm)
        self.q_bytes = tma.tma_bytes(self.dtype, q_layout) + bm * 4     # + its lse2 (or D) row
        self.kv_bytes = 2 * tma.tma_bytes(self.dtype, kv_layout)

        @cute.struct
        class SharedStorage:
            kv_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            q_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            do_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, row_stride * self.stages], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, row_stride * self.stages], 128]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(kv_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(kv_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(ds_layout)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, bm * d], 128]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        self.kernel(q_tiles, do_tiles, k_tiles, v_tiles, lse_tiles, dsum_tiles, dk_tiles,
                    dv_tiles, tma_q, tma_do, tma_k, tma_v, tma_lse, tma_dsum, tma_dk, tma_dv,
                    mdQacc, mSem, scale_log2, softmax_scale, q_layout, kv_layout, ds_layout,
                    row_layout).launch(
            grid=self.schedule.grid(tiles.seqlen_k, tiles.heads, tiles.batch),
            block=[self.threads, 1, 1],
            min_blocks_per_mp=1,        # ptxas: 65536 / threads registers at entry (setmaxnreg)
            stream=stream,
            use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mdO: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
               mLSE2: cute.Tensor, mD: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
               tma_q: cute.CopyAtom, tma_do: cute.CopyAtom, tma_k: cute.CopyAtom,
               tma_v: cute.CopyAtom, tma_lse: cute.CopyAtom, tma_dsum: cute.CopyAtom,
               tma_dk: cute.CopyAtom, tma_dv: cute.CopyAtom, mdQacc: cute.Tensor,
               mSem: cute.Tensor, scale_log2: Float32, softmax_scale: Float32,
               q_layout: cute.ComposedLayout, kv_layout: cute.ComposedLayout,
               ds_layout: cute.ComposedLayout, row_layout: cute.Layout):
        bm, d = self.block_m, self.head_dim
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()    # the dQ conversion may launch
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        (n_block, head, batch, kv_head, seqlen_q, seqlen_k, m_first,
         m_count) = self.schedule.cta_work(mQ, mK)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sK, sV, sQ, sdO, sdSt = backward_smem(storage, q_layout, kv_layout, ds_layout)
        sLSE, sD = storage.sLSE.get_tensor(row_layout), storage.sD.get_tensor(row_layout)

        consumer_warps = 4 * self.warpgroups
        kv_pipe = tma.make_tma_ring(storage.kv_barriers.data_ptr(), 1, consumer_warps,
                                    self.kv_bytes)
        q_pipe = tma.make_tma_ring(storage.q_barriers.data_ptr(), self.stages, consumer_warps,
                                   self.q_bytes)
        do_pipe = tma.make_tma_ring(storage.do_barriers.data_ptr(), self.stages,
                                    consumer_warps, self.q_bytes)
        tma.barriers_ready()
        loads = (tma_q, tma_do, tma_k, tma_v, tma_lse, tma_dsum)
        dq_staging = storage.sdQ.data_ptr()

        if warp < 4:
            # ---------------- producer warpgroup ----------------
            self.roles.become_producer()
            if warp == 0:                                   # every TMA load
                tma.prefetch_descriptors(*loads, tma_dk, tma_dv)
                self.load(loads, mQ, mdO, mK, mV, mLSE2, mD, sK, sV, sQ, sdO, sLSE, sD,
                          kv_pipe, q_pipe, do_pipe, n_block, head, batch, kv_head, m_first,
                          m_count)
            if warp == 1:                                   # the dQ writer
                if cutlass.const_expr(self.pdl):
                    cute.arch.griddepcontrol_wait()             # the dQ buffer is zeroed
                self.write_dq(dq_staging, mdQacc, mSem, n_block, head, batch, m_first, m_count)
                if cutlass.const_expr(self.convert_per_head):
                    cute.arch.cp_async_bulk_wait_group(0, read=False)    # adds landed
                    with cute.arch.elect_one():
                        cute.arch.atomic_add(mSem[batch, head, None].iterator, Int32(1),
                                             sem="release", scope="gpu")
                else:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
        else:
            # ---------------- consumer warpgroups ----------------
            self.roles.become_consumer()
            ctidx = tidx - 128                              # 0 .. 255
            wg = warp // 4 - 1
            self.consume(ctidx, wg, kv_pipe, q_pipe, do_pipe, sK, sV, sQ, sdO, sdSt, sLSE, sD,
                         dq_staging, scale_log2, softmax_scale, mdK, mdV, tma_dk, tma_dv, warp,
                         n_block, head, batch, m_first, m_count, seqlen_q, seqlen_k)

    @cute.jit
    def load(self, loads, mQ, mdO, mK, mV, mLSE2, mD, sK, sV, sQ, sdO, sLSE, sD, kv_pipe,
             q_pipe, do_pipe, n_block, head, batch, kv_head, m_first, m_count):
        """The producer warp: K and V of kv tile `n_block`, then Q with its lse2 row and dO
        with its D row for every query tile it visits."""
        tma_q, tma_do, tma_k, tma_v, tma_lse, tma_dsum = loads
        k_load = tma.TmaTiles.partition(tma_k, mK, kv_head, batch, sK)
        v_load = tma.TmaTiles.partition(tma_v, mV, kv_head, batch, sV)
        if cutlass.const_expr(not self.kv_with_first_tile):
            kv_state = tma.producer_state(1)
            kv_pipe.producer_acquire(kv_state)
            k_load.copy(n_block, kv_pipe.producer_get_barrier(kv_state))
            v_load.copy(n_block, kv_pipe.producer_get_barrier(kv_state))
        q_load = tma.TmaTiles.partition(tma_q, mQ, head, batch, sQ)
        do_load = tma.TmaTiles.partition(tma_do, mdO, head, batch, sdO)
        lse_load = tma.TmaTiles.partition_rows(tma_lse, mLSE2, head, batch, sLSE)
        dsum_load = tma.TmaTiles.partition_rows(tma_dsum, mD, head, batch, sD)
        produce = tma.producer_state(self.stages)
        for it in cutlass.range(m_count, unroll=1):
            m_block = self.query_tile(it, n_block, m_first, m_count)
            phase = self.trace.start("load_q")
            q_pipe.producer_acquire(produce)
            self.trace.end(phase)
            barrier = q_pipe.producer_get_barrier(produce)
            if cutlass.const_expr(self.kv_with_first_tile):
                if it == 0:
                    k_load.copy_on_armed(n_block, barrier, self.kv_bytes // 2)
            q_load.copy(m_block, barrier, produce.index)
            if cutlass.const_expr(self.pdl):
                if it == 0:
                    cute.arch.griddepcontrol_wait()     # lse2 and D are written
            lse_load.copy(m_block, barrier, produce.index)
            phase = self.trace.start("load_do")
            do_pipe.producer_acquire(produce)
            self.trace.end(phase)
            barrier = do_pipe.producer_get_barrier(produce)
            if cutlass.const_expr(self.kv_with_first_tile):
                if it == 0:
                    v_load.copy_on_armed(n_block, barrier, self.kv_bytes // 2)
            do_load.copy(m_block, barrier, produce.index)
            dsum_load.copy(m_block, barrier, produce.index)
            produce.advance()

    @cute.jit
    def write_dq(self, sdQ: cute.Pointer, mdQacc: cute.Tensor, mSem: cute.Tensor, n_block,
                 head, batch, m_first, m_count):
        """The dQ writer warp: each consumer warpgroup's dQ block of every query tile of kv
        tile `n_block`, reduce-added from SMEM to the fp32 dQ buffer."""
        bm, d = self.block_m, self.head_dim
        dq_block = bm * d // self.warpgroups                # floats per warpgroup and tile
        dq_accum = mdQacc[batch, head, None, None].iterator
        for it in cutlass.range(m_count, unroll=1):
            m_block = self.query_tile(it, n_block, m_first, m_count)
            # hand each staging buffer back once the copy engine has read it (the
            # previous tile's copies were committed in warpgroup order)
            for wg in cutlass.range_constexpr(self.warpgroups):
                cute.arch.cp_async_bulk_wait_group(self.warpgroups - 1 - wg, read=True)
                cute.arch.barrier_arrive(barrier_id=DQ_EMPTY_BARRIER + wg,
                                         number_of_threads=DQ_HANDOFF_THREADS)
            turn = mSem[batch, head, None].iterator + m_block
            if cutlass.const_expr(self.deterministic):
                if cute.arch.lane_idx() == 0:      # kv tiles 0 .. n_block - 1 added
                    wait_for_count(turn, n_block)
                cute.arch.sync_warp()
            for wg in cutlass.range_constexpr(self.warpgroups):
                phase = self.trace.start("wait_dq_full")
                cute.arch.barrier(barrier_id=DQ_FULL_BARRIER + wg,
                                  number_of_threads=DQ_HANDOFF_THREADS)
                self.trace.end(phase)
                with cute.arch.elect_one():
                    tma.bulk_reduce_add_f32(
                        sdQ + wg * dq_block,
                        dq_accum + (m_block * (bm * d) + wg * dq_block), dq_block * 4)
                cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(self.deterministic):
                cute.arch.cp_async_bulk_wait_group(0, read=False)   # adds performed
                with cute.arch.elect_one():
                    cute.arch.atomic_add(turn, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def consume(self, ctidx, wg, kv_pipe: pipeline.PipelineTmaAsync,
                q_pipe: pipeline.PipelineTmaAsync, do_pipe: pipeline.PipelineTmaAsync,
                sK: cute.Tensor, sV: cute.Tensor, sQ: cute.Tensor, sdO: cute.Tensor,
                sdSt: cute.Tensor, sLSE: cute.Tensor, sD: cute.Tensor, sdQ: cute.Pointer,
                scale_log2: Float32, softmax_scale: Float32, mdK: cute.Tensor,
                mdV: cute.Tensor, tma_dk: cute.CopyAtom, tma_dv: cute.CopyAtom, warp,
                n_block, head, batch, m_first, m_count, seqlen_q, seqlen_k):
        """One consumer warpgroup's work on kv tile `n_block` of (head, batch): every query
        tile it visits, then dK and dV out."""
        bm, bn, d, dtype = self.block_m, self.block_n, self.head_dim, self.dtype
        mmas = wgmma.BackwardMmas.create(self.warpgroups, bm, bn, d, ctidx, sK, sV, sQ, sdO,
                                         sdSt, dtype, self.dq_swap_ab)  # kb1's five GEMMs
        st_coords = mmas.st_coords
        acc_dk = mmas.new_dkv_accumulator(bn, d)
        acc_dv = mmas.new_dkv_accumulator(bn, d)
        if cutlass.const_expr(self.stmatrix):
            store_ds = wgmma.stmatrix_store(mmas.mma_sdp, dtype)
            thr_store_ds = store_ds.get_slice(ctidx)
            ds_smem = thr_store_ds.partition_D(sdSt)             # (..., buffer)
        ds_written = pipeline.NamedBarrier(barrier_id=DS_WRITTEN_BARRIER,
                                           num_threads=128 * self.warpgroups)

        if cutlass.const_expr(not self.kv_with_first_tile):
            kv_pipe.consumer_wait(tma.consumer_state(1))
        consume = tma.consumer_state(self.stages)
        causal_offset = seqlen_k - seqlen_q
        for it in cutlass.range(m_count, unroll=1):
            m_block = self.query_tile(it, n_block, m_first, m_count)
            stage = consume.index
            phase = self.trace.start("wait_q")
            q_pipe.consumer_wait(consume)
            self.trace.end(phase)
            phase = self.trace.start("s_dp")
            acc_st = mmas.new_st_accumulator(bm, bn)
            acc_dpt = mmas.new_st_accumulator(bm, bn)
            st_rc, dpt_rc = acc_rows_cols(acc_st), acc_rows_cols(acc_dpt)
            cols = cute.size(st_rc, mode=[1])
            if cutlass.const_expr(self.dp_first):
                # dP^T - D straight out of the GEMM: it starts from -D instead of zero, so no
                # D register is held through the tile. A WGMMA whose accumulator was written
                # by other instructions waits for every earlier WGMMA (ptxas inserts the
                # wait), so dP^T goes first and S^T queues behind it
                do_pipe.consumer_wait(consume)
                dsum = column_stats(sD, st_coords, stage, cols)
                for c in cutlass.range_constexpr(cols):
                    for r in cutlass.range_constexpr(cute.size(dpt_rc, mode=[0])):
                        dpt_rc[r, c] = -dsum[c]
                wgmma.gemm(mmas.mma_sdp, acc_dpt, mmas.v_frag,
                           mmas.do_frag[None, None, None, stage], zero_init=False)
            wgmma.gemm(mmas.mma_sdp, acc_st, mmas.k_frag, mmas.q_frag[None, None, None, stage],
                       zero_init=True)
            # this thread's LSE (and below D) values, loaded while the GEMMs run: read after
            # the wait, their SMEM latency stalled the exp2 loop (ncu: 9% of warp samples)
            lse2 = column_stats(sLSE, st_coords, stage, cols)
            if cutlass.const_expr(self.dp_first):
                self.trace.end(phase)
                phase = self.trace.start("wait_s")
                warpgroup.wait_group(0)                                 # S^T, dP^T landed
            else:
                do_pipe.consumer_wait(consume)
                wgmma.gemm(mmas.mma_sdp, acc_dpt, mmas.v_frag,
                           mmas.do_frag[None, None, None, stage], zero_init=True)
                self.trace.end(phase)
                phase = self.trace.start("wait_s")
                warpgroup.wait_group(1)                                 # S^T has landed
            self.trace.end(phase)
            phase = self.trace.start("exp2")
            if self.schedule.needs_mask(m_block, n_block, seqlen_q, seqlen_k):
                mask_scores(st_rc, st_coords, n_block * bn, m_block * bm, seqlen_k,
                            self.causal, causal_offset, transposed=True)
            for c in cutlass.range_constexpr(cols):
                for r in cutlass.range_constexpr(cute.size(st_rc, mode=[0])):
                    st_rc[r, c] = cute.math.exp2(st_rc[r, c] * scale_log2 - lse2[c],
                                                 fastmath=True)          # P^T
            if cutlass.const_expr(not self.dp_first):
                dsum = column_stats(sD, st_coords, stage, cols)
            mmas.pt_frag.store(acc_as_operand_a(acc_st).load().to(dtype))
            self.trace.end(phase)
            if cutlass.const_expr(self.early_dv):
                phase = self.trace.start("dv")
                self.issue_dv(mmas, acc_dv, stage, 0, self.split_dv or bm // 16)
                self.trace.end(phase)
                phase = self.trace.start("wait_dp")
                warpgroup.wait_group(1)                                 # dP^T has landed
                self.trace.end(phase)
            elif cutlass.const_expr(not self.dp_first):
                phase = self.trace.start("wait_dp")
                warpgroup.wait_group(0)                                 # dP^T has landed
                self.trace.end(phase)
            phase = self.trace.start("ds")
            for c in cutlass.range_constexpr(cols):
                for r in cutlass.range_constexpr(cute.size(st_rc, mode=[0])):
                    if cutlass.const_expr(self.dp_first):
                        dpt_rc[r, c] = st_rc[r, c] * dpt_rc[r, c]               # dS^T
                    else:
                        dpt_rc[r, c] = st_rc[r, c] * (dpt_rc[r, c] - dsum[c])  # dS^T
            mmas.dst_frag.store(acc_as_operand_a(acc_dpt).load().to(dtype))
            pin(mmas.dst_frag)                          # one conversion for both readers
            buf = it % 2
            ds_out = operand_a_as_acc(mmas.dst_frag, acc_dpt)         # dS^T, converted once
            if cutlass.const_expr(self.stmatrix):
                if cutlass.const_expr(self.ds_address_per_tile):
                    thr_ds = store_ds.get_slice(opaque(ctidx))
                    cute.copy(store_ds, thr_ds.retile(ds_out),
                              thr_ds.partition_D(sdSt)[None, None, None, buf])
                else:
                    cute.copy(store_ds, thr_store_ds.retile(ds_out),
                              ds_smem[None, None, None, buf])
            else:
                cute.autovec_copy(ds_out, mmas.thr_sdp.partition_C(sdSt[None, None, buf]))
            if cutlass.const_expr(not self.early_dv or self.split_dv > 0):
                self.issue_dv(mmas, acc_dv, stage, self.split_dv, bm // 16)  # (the rest of) dV
            cute.arch.fence_proxy("async.shared", space="cta")   # dS^T visible to the WGMMAs
            self.trace.end(phase)
            phase = self.trace.start("ds_barrier")
            ds_written.arrive_and_wait()                         # ... of both warpgroups
            self.trace.end(phase)
            phase = self.trace.start("dq_dk")
            acc_dq = mmas.new_dq_accumulator(bm, d)
            wgmma.gemm(mmas.mma_dq, acc_dq, *mmas.dq_operands(buf),
                       zero_init=True)
            self.trace.end(phase)
            phase = self.trace.start("wait_dv_dq")
            warpgroup.wait_group(1)                                     # dV is done
            self.trace.end(phase)
            phase = self.trace.start("dq_dk")
            do_pipe.consumer_release(consume)
            wgmma.gemm(mmas.mma_dkv, acc_dk, mmas.dst_frag, mmas.qt_frag[None, None, None, stage],
                       zero_init=False)                                  # dK += dS^T Q
            self.trace.end(phase)
            phase = self.trace.start("wait_dv_dq")
            warpgroup.wait_group(1)                                     # dQ is done
            self.trace.end(phase)
            phase = self.trace.start("dq_store")
            # dQ -> the staging buffer (in register order), once the writer has read the last
            cute.arch.barrier(barrier_id=DQ_EMPTY_BARRIER + wg,
                              number_of_threads=DQ_HANDOFF_THREADS)
            slot = fragment_slot(sdQ, 0, ctidx, bm, d, cute.size(acc_dq))
            cute.autovec_copy(cute.make_tensor(acc_dq.iterator, slot.layout.shape), slot)
            cute.arch.fence_proxy("async.shared", space="cta")   # visible to the copy engine
            cute.arch.barrier_arrive(barrier_id=DQ_FULL_BARRIER + wg,
                                     number_of_threads=DQ_HANDOFF_THREADS)
            self.trace.end(phase)
            phase = self.trace.start("wait_dk")
            warpgroup.wait_group(0)                                     # dK is done
            self.trace.end(phase)
            q_pipe.consumer_release(consume)
            consume.advance()

        # Epilogue: dK * scale and dV -> dtype -> SMEM (K's and V's buffers) -> TMA stores
        epilogue = pipeline.NamedBarrier(barrier_id=EPILOGUE_BARRIER,
                                         num_threads=128 * self.warpgroups)
        phase = self.trace.start("epilogue")
        acc_dk.store(acc_dk.load() * softmax_scale)
        epilogue.arrive_and_wait()                          # every WGMMA has read K and V
        stage_dkv(mmas.thr_dkv, acc_dk, acc_dv, sK, sV, dtype)
        epilogue.arrive_and_wait()
        if warp == 4:                                       # the first consumer warp
            store_dkv(tma_dk, tma_dv, mdK, mdV, head, batch, sK, sV, n_block)
        self.trace.end(phase)


    @cute.jit
    def issue_dv(self, mmas, acc_dv: cute.Tensor, stage, first: cutlass.Constexpr,
                 end: cutlass.Constexpr):
        """dV += P^T dO over P^T's K blocks (16 queries each) first .. end - 1, as one WGMMA
        batch: all bm / 16 of them at once, or in the two parts of `split_dv`."""
        wgmma.gemm(mmas.mma_dkv, acc_dv, mmas.pt_frag, mmas.dot_frag[None, None, None, stage],
                   zero_init=False, k_blocks=(first, end))


@cute.jit
def column_stats(s_rows: cute.Tensor, st_coords: cute.Tensor, stage, cols: cutlass.Constexpr):
    """The per-query statistic (lse2 or D) of each S^T column this thread holds, from the
    stage's SMEM row into registers."""
    vals = cute.make_rmem_tensor((cols,), Float32)
    for c in cutlass.range_constexpr(cols):
        vals[c] = s_rows[st_coords[0, c][1], stage]
    return vals


# Tiles per (head_dim, causal) where they differ from 64 x 128, chosen round-robin against
# FA4 (results/h100/2026-11-24_kb2_tiles_*.json, docs/kb2.md): at d = 64 FlashAttention-3's
# 128-row query tiles, +8-14% without a mask (with dp_first) and +2-7% with one (there the
# stmatrix dS^T store spills at 240 registers, so the plain store). At d = 128 the 80-row
# tiles with dQ^T (FA3's and FA4's choice without a mask) spill unless dS^T is stored without
# stmatrix, and then lose 4-5%; since 2026-11-25 they do not, with dS^T's stmatrix addresses
# computed per tile (`ds_address_per_tile`): +2.4-5.4% over 64 rows, 1.00x FA4 at N = 2k-16k
# (results/h100/2026-11-25_kb2_ds_address_per_tile.json). With a causal mask the 80-row tile
# still spills (68 bytes): 64 rows there. At d = 128 the first Q and dO stages also carry K
# and V, and the three kernels are chained by programmatic dependent launch (FA4's prologue):
# +0.2-0.9% with a mask, +0.1-0.4% without, -0.4% at d = 64
# (results/h100/2026-11-25_kb2_prologue_*.json, _kb2_epilogue_*.json). With a mask dV is
# issued in two parts (split_dv, docs/kb2.md): +2.5 / +3.1 / +3.7% at d = 128 (N = 2k / 4k /
# 16k, results/h100/2026-11-25_kb2_split_dv_causal.json), +1.3% at d = 64
# (_kb2_split_dv_d64_causal.json). With a mask at d = 128 the CTAs start longest first in
# 32 MiB head groups (longest_first, docs/kb2.md "Longest first"): +2.7 / +3.6% at N = 4k / 8k,
# +0.7% at 2k (results/h100/2026-11-26_kb2_longest_first_causal.json); at d = 64 a tie or a
# loss (results/h200/2026-11-26_kb2_group_mib_d64.json), so off there. Where the dQ
# conversion launches early (pdl) it waits per head (convert_per_head, docs/kb2.md "dQ
# converted per head"): +1.4-1.8% at d = 128 N = 2k, causal and not, +1.4% at 4k causal,
# 0 at 16k (results/h100/2026-11-26_backward_kb2_per_head{,_run2}.json); with a mask at d = 64,
# with the early launch it needs, +3.6 / +2.6 / +1.5 / +0.4% at N = 1k / 2k / 4k / 16k in two
# runs, without one +1.7-1.8% at 1k but -0.1 to -1.0% from 4k (_kb2_per_head_d64{,_run2}.json).
TILES = {(64, False): {"block_m": 128, "dp_first": True},
         (64, True): {"block_m": 128, "stmatrix": False, "early_dv": True, "split_dv": 1,
                      "pdl": True, "convert_per_head": True},
         (128, False): {"block_m": 80, "ds_address_per_tile": True, "kv_with_first_tile": True,
                        "pdl": True, "convert_per_head": True},
         (128, True): {"kv_with_first_tile": True, "pdl": True, "split_dv": 1,
                       "longest_first": True, "convert_per_head": True}}


# The deterministic mode's head groups (longest first): a fixed number of heads whatever the
# length, the number a 32 MiB group holds at N = 2k. Its CTAs wait for each other's dQ adds,
# and in larger groups a kv tile starts later behind the one before it: against 32 MiB
# groups +17 / +23% at d = 128 N = 8k / 16k, +14 / +19% at d = 64, the same at 2k
# (results/h100/2026-11-26_kb2_deterministic_group_heads_d*.json; 8 heads at d = 128 and 16 at
# d = 64 lose 11-15% at 2k and gain less at 8k).
DETERMINISTIC_GROUP_HEADS = {64: 32, 128: 16}


def compile_kernel(problem, *, compile_options: str = "", block_m: Optional[int] = None,
                   block_n: int = 128, stages: int = 2, rotate: bool = False,
                   deterministic: bool = False, stmatrix: Optional[bool] = None,
                   early_dv=None, dp_first: Optional[bool] = None,
                   ds_address_per_tile: Optional[bool] = None,
                   kv_with_first_tile: Optional[bool] = None, pdl: Optional[bool] = None,
                   split_dv: Optional[int] = None, longest_first: Optional[bool] = None,
                   group_mib: Optional[int] = None, group_heads: Optional[int] = None,
                   trace: bool = False, convert_per_head: Optional[bool] = None):
    """Compile (or fetch from the cache) kb2 and its pre/post-processing kernels.
    deterministic: dQ's fp32 adds in a fixed order (same bits on every run; slower).
    block_m, stmatrix, early_dv, dp_first, ds_address_per_tile, kv_with_first_tile, pdl,
    split_dv, longest_first, group_mib, convert_per_head: None takes `TILES` for the head dim
    and mask (when block_m is not given), else 64 rows, stmatrix on, early_dv by head dim and
    rows (see the class), group_mib 32, the others off (convert_per_head also off without pdl
    or with `deterministic`); longest_first is also on with `deterministic`
    (with a mask its CTAs then wait far less for their dQ turns, docs/kb2.md), in groups of
    group_heads heads (None: DETERMINISTIC_GROUP_HEADS with `deterministic`, else 0: by
    group_mib).
    trace: iket phase ranges (harness/timeline.py)."""
    if deterministic:     # its CTAs wait for each other's dQ adds, far less in this order
        longest_first = True if longest_first is None else longest_first
        # its turns use the per-tile counters that convert_per_head counts heads in
        convert_per_head = False if convert_per_head is None else convert_per_head
        group_heads = DETERMINISTIC_GROUP_HEADS.get(problem.head_dim, 0) \
            if group_heads is None else group_heads
    tuned = TILES.get((problem.head_dim, problem.causal), {}) if block_m is None else {}
    pick = lambda value, name, default: value if value is not None else tuned.get(name, default)
    pdl = bool(pick(pdl, "pdl", False))
    if not pdl:              # the early-launched conversion is what waits per head
        convert_per_head = False if convert_per_head is None else convert_per_head
    return compile_backward(SPEC, FlashAttentionBackwardKB2, problem,
                            {"block_m": pick(block_m, "block_m", 64), "block_n": block_n,
                             "stages": stages, "rotate": bool(rotate),
                             "deterministic": bool(deterministic),
                             "stmatrix": bool(pick(stmatrix, "stmatrix", True)),
                             "dp_first": bool(pick(dp_first, "dp_first", False)),
                             "early_dv": pick(early_dv, "early_dv", None),
                             "ds_address_per_tile": bool(pick(ds_address_per_tile,
                                                              "ds_address_per_tile", False)),
                             "kv_with_first_tile": bool(pick(kv_with_first_tile,
                                                             "kv_with_first_tile", False)),
                             "pdl": pdl,
                             "split_dv": int(pick(split_dv, "split_dv", 0)),
                             "longest_first": bool(pick(longest_first, "longest_first",
                                                        False)),
                             "group_mib": int(pick(group_mib, "group_mib", 32)),
                             "group_heads": int(group_heads or 0),
                             "trace": bool(trace),
                             "convert_per_head": bool(pick(convert_per_head,
                                                           "convert_per_head", False))},
                            compile_options=compile_options)


def run_kernel(handle, q, k, v, o, do, lse, dq, dk, dv, softmax_scale=None):
    run_backward(handle, q, k, v, o, do, lse, dq, dk, dv, softmax_scale)
