"""kb2: the backward with FlashAttention-3's Hopper techniques, as a diff from kb1.

What changes from kb1:

* Warp specialization (common/warp_roles.py, as in k5). Warpgroup 0 is the producer: warp 0
  issues every TMA load, warp 1 is the dQ writer (below), warps 2-3 idle. Warpgroups 1-2 are
  the consumers (64 keys each). `setmaxnreg`: 24 registers producer, 240 consumers.
* Q and dO through separate 2-stage rings, each with its per-row statistic loaded by TMA
  into the same stage (lse2 with Q, D with dO): S^T = K Q^T starts as soon as Q has landed,
  and the statistics are read from SMEM rather than from global memory.
* dQ through SMEM and a bulk reduce-add (kb1: 32 `red.global.add.f32` per thread and tile):
  a consumer warpgroup writes its fp32 dQ partial to SMEM in its register order, and the dQ
  writer warp adds the block to global memory with one bulk `cp.reduce.async` (so the buffer
  is in "fragment order", which `DqConvertFragments` maps back). Named barriers per
  warpgroup hand the SMEM buffer back and forth (dQ full, dQ empty).
* The consumer's order (FlashAttention-3's): S^T and dP^T issued back to back (each
  thread's lse2 values read from SMEM meanwhile); P^T while dP^T still runs; dS^T; dS^T ->
  SMEM (stmatrix) and dV += P^T dO issued (with a mask its first 16 queries go right after
  P^T instead, the rest after the dS^T stores: `early_dv`, `split_dv`); one barrier;
  dQ = dS K issued, waiting only for dV; dK += dS^T Q issued, waiting only for dQ;
  dQ -> SMEM while dK runs: the tensor core always has the next GEMM queued.
* dv != d, v narrower (`head_dim_v`: (128, 64), (192, 128); docs/head-dim-v.md): V, dO, dV dv wide.
* GQA / MQA (`gqa`, a variant compiled where k and v have fewer heads than q): one CTA per
  (kv tile, dK head, batch) walks the query tiles of every query head of its group, head
  after head, and stores dK and dV once (kb1: per query head, summed by torch). Too few
  CTAs (MQA, small batches): each k/v head split in parts (masking.dkv_parts) whose fp32
  dK / dV (`dkv_fp32`: no second rounding) run_backward sums. With a mask the long CTAs
  start first (longest first at d = 128, `heads_first` at d = 64). The deterministic mode's
  dQ add order is unchanged. At d = 128 with a mask from N = 16k the policy runs per query
  head (MHA's grid) instead: faster there.
* Packed batches (`varlen`, common/varlen_backward.py): one CTA per (kv tile of a sequence,
  dK head) of a work list, each sequence seen through ragged TMA views as a batch of one.
* Logit softcapping (`softcap`, docs/softcap.md): P from tanh(s scale / cap) taken before the
  mask, dS^T times 1 - t^2; 64-row query tiles (`SOFTCAP_TILES`), which hold it without spills
  (d = 256: the swapped tile's S and dS, not transposed).
* Head dims 96, 192 and 256 (issue 63). d = 96 runs d = 128's consumer on 64-row tiles, K in
  a 32-byte swizzle (dQ reads K^T in 48 columns a warpgroup). At d = 192 and 256 a thread
  cannot hold dK and dV of 64 keys: `dkv_swap_ab` (common/backward_dkv_swap.py) accumulates
  dK^T and dV^T with d as WGMMA's M on FA3's 64 x 96 tile (d = 192) and FA4's 64 x 48
  (d = 256), S and dP not transposed, P and dS through SMEM (d = 256 ran kb1 before: 1.44-
  1.50x faster here); at d = 256 the warpgroups split dK^T and dV^T by d's rows in FA4's
  barrier order (`dkv_split_d`). With a softcap d = 192 runs `shared_keys` instead: both consumer
  warpgroups on one 64-key tile, S^T and dP^T split by queries, dK, dV and dQ by columns
  (96 + 96 + 48 floats), P^T through SMEM like dS^T, dV issued after the dS^T barrier.

What stays: kb1's 128-key tiles (d = 192: 96, 256: 48), the transposed formulation (P^T and dS^T
from registers into dV and dK), dS^T through SMEM for dQ (double-buffered), causal tile skipping,
seqlen_k != seqlen_q, the pre/post-processing structure. One CTA per (kv tile, head, batch)
as in kb1 (gqa: per dK head); at d = 128 with a causal mask launched longest first inside
head groups that share L2 (`longest_first`). Query tiles (`POLICY`, FlashAttention-3's):
128 rows at d = 64 (dQ split by query rows, `dq_rows`, but for GQA without a mask); at
d = 128 80 without a mask (dQ transposed, `dq_swap_ab`) and 64 with one. At d = 128 the
prologue is FA4's (K and V on the first Q / dO stages' barriers), and the main kernel and the
dQ conversion are programmatic dependent launches.

Budget (d = 128, 64-row tiles): 384 threads = producer WG + 2 consumer WGs. SMEM: K + V 64 KiB,
2 x (Q + dO) 64 KiB, 2 x dS^T 32 KiB, dQ staging 2 x 16 KiB, LSE and D rows 1 KiB, barriers:
~193 KiB (d = 64: ~113 KiB). Registers: 240 per consumer thread (dK + dV accumulators 128,
S^T 32, dP^T 32, P^T and dS^T as bf16 16 + 16, dQ 32; not all live at once), 24 per
producer thread. d = 192 and 256: common/backward_dkv_swap.py. shared_keys (64 x 64): K + V
48 KiB, 2 x (Q + dO) 96 KiB, 2 x (dS^T + P^T) 32 KiB, dQ staging 48 KiB, rows and barriers
2 KiB: 226 KiB ((192, 128): V, dO 24 less: 202).

Named barriers: 0 = the CTA-wide sync publishing the mbarrier inits; 1 = dS^T written
(256 consumer threads); 2 = epilogue (consumers); 3-4 = dQ full, 5-6 = dQ empty (one per
consumer warpgroup, 128 + 32 threads).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float16, Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from hopper_attn.common import tma, wgmma
from hopper_attn.common.backward import (DQ_EMPTY_BARRIER, DQ_FULL_BARRIER, DQ_HANDOFF_THREADS,
                                         DS_WRITTEN_BARRIER, EPILOGUE_BARRIER, BackwardTiles,
                                         DqWriter, GroupWalk, PolicyRow, backward_smem,
                                         compile_backward, converted, fragment_slot,
                                         kernel_arguments, policy_settings,
                                         run_backward, with_fp32_parts, write_dkv)
from hopper_attn.common.backward_dkv_swap import DkvSwapConsumer, check_dkv_swap, dkv_swap_keys
from hopper_attn.common.backward_stats import row_stats
from hopper_attn.common.compiler_hints import opaque, pin
from hopper_attn.common.contract import LOG2_E, KernelSpec, Lengths
from hopper_attn.common.layouts import acc_as_operand_a, acc_rows_cols, operand_a_as_acc
from hopper_attn.common.masking import KVTileSchedule, mask_scores
from hopper_attn.common.softmax import softcap_scores
from hopper_attn.common.trace import PhaseTrace
from hopper_attn.common.varlen_backward import VarlenKVTileSchedule
from hopper_attn.common.warp_roles import WarpRoles

SPEC = KernelSpec(
    name="kb2",
    summary="kb1 + producer warpgroup, setmaxnreg, Q/dO rings with LSE/D, dQ by bulk reduce-add",
    head_dims=(64, 96, 128, 192, 256),
    dtypes=(torch.bfloat16, torch.float16),
    head_dim_pairs=((128, 64), (192, 128)),     # dv != d: V, dO, dV dv wide
    separate_kv=True,
    window=True,                # sliding windows (compiled per window size)
)


class FlashAttentionBackwardKB2(GroupWalk, DqWriter, DkvSwapConsumer):
    dq_fragment_order = True           # dq_accum as the dQ WGMMA's registers (postprocess)
    takes_semaphores = True            # an int32 per (batch, head, query tile), after dV

    stages = 2                         # Q / dO ring depth (a third stage: docs/kb2.md)

    def __init__(self, head_dim: int, causal: bool, block_m: int = 64, block_n: int = 128,
                 deterministic: bool = False, stmatrix: bool = True, early_dv=None,
                 head_dim_v: int = 0, dp_first: bool = False, ds_address_per_tile: bool = False,
                 kv_with_first_tile: bool = False, pdl: bool = False, split_dv: int = 0,
                 longest_first: bool = False, group_mib: int = 32, group_heads: int = 0,
                 trace: bool = False, convert_per_head: bool = False, gqa: bool = False,
                 heads_first: bool = False, softcap: float = 0.0,
                 window_left: Optional[int] = None, window_right: Optional[int] = None,
                 shared_keys: bool = False, varlen: bool = False,
                 dkv_swap_ab: bool = False, dkv_split_d: bool = False,
                 dq_rows: bool = False, stats_shuffle: bool = False, dkv_fp32: bool = False):
        # lse2 and D shuffled across lane quads, or read at use (common/backward_stats.py)
        self.stats = "shuffle" if stats_shuffle else ""
        if stats_shuffle and (block_m % 64 or shared_keys or dkv_swap_ab):
            raise ValueError("kb2: stats_shuffle takes 64- or 128-row query tiles")
        # logit softcapping, cap * tanh(s / cap), a compile-time cap (0: none)
        self.softcap = float(softcap)
        if not math.isfinite(self.softcap) or self.softcap < 0.0:
            raise ValueError(f"softcap must be finite and >= 0 (0: none), got {softcap}")
        # shared_keys (d = 192): both consumer warpgroups on one 64-key tile, dK and dV split
        # by columns (wgmma.BackwardMmas), P^T through SMEM; dV issued after the dS^T barrier
        self.shared_keys = bool(shared_keys)
        # dkv_swap_ab (d = 192, 256): 96 / 48-key tiles, dK^T and dV^T (backward_dkv_swap.py)
        self.dkv_swap_ab = bool(dkv_swap_ab)
        # dkv_split_d (with it, d = 256): dK^T / dV^T split by d rows, FA4's barriers
        self.dkv_split_d = bool(dkv_split_d)
        if self.dkv_split_d and not self.dkv_swap_ab:
            raise ValueError("kb2: dkv_split_d splits dkv_swap_ab's dK^T and dV^T")
        if block_m not in (64, 80, 128) or block_n != (dkv_swap_keys(head_dim) if dkv_swap_ab
                                                       else 64 if shared_keys else 128):
            raise ValueError("kb2 runs 128-key tiles (one consumer warpgroup per 64 keys; "
                             "shared_keys: 64, dkv_swap_ab: 96, d = 256: 48) and 64, 80 or 128 "
                             f"queries; got {block_m} x {block_n}")
        # dq_swap_ab: 80 query rows are not a multiple of WGMMA's M (64), so dQ is computed
        # transposed, dQ^T = K^T dS^T, with head_dim split between the warpgroups
        self.dq_swap_ab = block_m % 64 != 0
        if self.dq_swap_ab and head_dim != 128:
            raise ValueError(f"kb2 takes 80-row query tiles at head_dim 128 only, got {head_dim}")
        # dq_rows (128-row tiles): dQ split by query rows, not columns (wgmma.dq_mma)
        self.dq_rows = bool(dq_rows)
        if self.dq_rows and (block_m != 128 or shared_keys or dkv_swap_ab):
            raise ValueError("kb2: dq_rows splits 128-row query tiles (64 rows a warpgroup)")
        self.head_dim, self.causal = head_dim, causal
        self.block_m, self.block_n = block_m, block_n
        self.warpgroups = 2                                 # consumer warpgroups
        self.roles = WarpRoles.create(self.warpgroups)      # 24 / 240 registers
        self.threads = self.roles.threads
        self.head_dim_v = head_dim_v or head_dim            # V's, dO's and dV's
        # longest_first (causal): head groups whose Q, dO and fp32 dQ (N x d x 8 bytes a head)
        # share `group_mib` MiB of L2, kv tile 0 of every head first (masking.KVTileSchedule)
        self.longest_first = bool(longest_first) and causal
        l2_rows = (group_mib << 20) // (head_dim * 8) if self.longest_first else 0
        # heads_first (causal): the grid (heads, kv tiles, batch), kv tile 0 of every head first
        self.heads_first = bool(heads_first) and causal and not self.longest_first
        # a sliding window (compile-time sides as Problem's, None: unbounded): kv tile n walks
        # the query tiles it reaches
        window = {} if window_left is None and (causal or window_right is None) else \
            dict(window_left=window_left, window_right=None if causal else window_right)
        # varlen: a packed batch, a work list of (sequence, kv tile) (common/varlen_backward.py)
        self.varlen = bool(varlen)
        if self.varlen and (deterministic or self.heads_first):
            raise ValueError("kb2: varlen has its own launch order, no deterministic mode")
        self.schedule = (VarlenKVTileSchedule if self.varlen else KVTileSchedule)(
            block_m, block_n, causal, l2_rows, group_heads, heads_first=self.heads_first,
            **window)
        # deterministic: kv tiles add into a dQ tile in order (a turn counter per query tile)
        self.deterministic = deterministic
        # stmatrix: dS^T -> SMEM four 8 x 8 blocks a warp instruction, not 4 bytes a store
        self.stmatrix = stmatrix
        # ds_address_per_tile: dS^T's stmatrix addresses recomputed per tile from an opaque
        # thread index, not held across the loop (at 80 rows that register spilled)
        self.ds_address_per_tile = bool(ds_address_per_tile)
        # early_dv: dV += P^T dO issued before the wait for dP^T (queued tensor-core work, and
        # ptxas keeps the exp2 loop ahead of that wait); on at d = 128 on 64-row tiles
        self.early_dv = (head_dim == 128 and block_m == 64) if early_dv is None \
            else bool(early_dv)
        if self.shared_keys and (self.early_dv or dp_first or not stmatrix):
            raise ValueError("kb2: shared_keys issues dV after the dS^T barrier and stores "
                             "P^T by stmatrix (no early_dv nor dp_first)")
        # dp_first: dP^T issued first, from -D (no D registers), S^T behind it
        self.dp_first = dp_first
        # kv_with_first_tile: K on the first Q stage's barrier, V on the first dO stage's
        self.kv_with_first_tile = bool(kv_with_first_tile)
        # pdl: a programmatic dependent launch of the preprocess, and of the dQ conversion
        self.pdl = bool(pdl)
        # split_dv (with early_dv): dV's first `split_dv` K blocks early, the rest between
        # the dS^T stores and their fence (FA4's place), running through the dS^T barrier
        self.split_dv = int(split_dv)
        if self.split_dv and not self.early_dv:
            raise ValueError("kb2: split_dv splits the early dV (early_dv)")
        # convert_per_head: each CTA counts itself in counters[b, h, 0] once its dQ adds have
        # landed; the early dQ conversion starts a head when all have (DqConvertFragments)
        self.convert_per_head = bool(convert_per_head)
        if self.convert_per_head and (deterministic or not pdl):
            raise ValueError("kb2: convert_per_head needs pdl and not the deterministic mode "
                             "(whose turns use the same counters)")
        # gqa: a CTA walks every query head of its group (or part: `dkv_parts`), stores dK
        # and dV once; a separate variant, so the MHA kernels compile as before
        self.gqa = bool(gqa)
        # dkv_fp32 (where a group is split in parts): dK / dV stored fp32, rounded after the sum
        self.dkv_fp32 = bool(dkv_fp32)
        if self.dkv_fp32 and self.varlen:
            raise ValueError("kb2: dkv_fp32 takes fixed-length batches, not varlen")
        self.trace = PhaseTrace(trace)          # iket phase ranges (off: no code at all)
        if dp_first and self.early_dv:
            raise ValueError("kb2: dp_first and early_dv exclude each other (dp_first waits "
                             "for dP^T before the exp2 loop)")
        self.do_stages = check_dkv_swap(self) if self.dkv_swap_ab else self.stages   # dO's ring

    def describe(self) -> dict:
        return {"smem_bytes": getattr(self, "smem_bytes", None), "block_m": self.block_m,
                "block_n": self.block_n, "dq_swap_ab": self.dq_swap_ab, "stages": self.stages,
                "threads": self.threads, "producer_regs": self.roles.producer_regs,
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
        tiles = BackwardTiles.create(mQ, mK, mV, mdO, mdK, mdV, bm, bn, d, self.stages,
                                     shared_keys=self.shared_keys, packed=self.varlen,
                                     head_dim_v=self.head_dim_v,   # (V, dO, dV: dv wide)
                                     dkv_swap_ab=self.dkv_swap_ab, do_stages=self.do_stages)
        q_layout, kv_layout, ds_layout = tiles.q_layout, tiles.kv_layout, tiles.ds_layout
        v_layout, do_layout = tiles.v_layout, tiles.do_layout
        # lse2 / D rings: a TMA writes each stage's row, so stages start 128 bytes apart
        row_stride = -(-bm // 32) * 32
        row_layout = cute.make_layout((bm, self.stages), stride=(1, row_stride))
        q_tiles, do_tiles, k_tiles, v_tiles, dk_tiles, dv_tiles = tiles.tensors
        tma_q, tma_do, tma_k, tma_v, tma_dk, tma_dv = tiles.atoms
        tma_lse, lse_tiles = tma.make_tma_row_load(lse2, bm)
        tma_dsum, dsum_tiles = tma.make_tma_row_load(dsum, bm)
        self.q_bytes = tma.tma_bytes(self.dtype, q_layout) + bm * 4     # + its lse2 row
        self.do_bytes = tma.tma_bytes(self.dtype, do_layout) + bm * 4   # + its D row
        self.k_bytes, self.v_bytes = (tma.tma_bytes(self.dtype, t) for t in (kv_layout, v_layout))

        @cute.struct
        class SharedStorage:
            kv_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            q_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            do_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, row_stride * self.stages], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, row_stride * self.stages], 128]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(kv_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(v_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(do_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(ds_layout)], 1024]
            if cutlass.const_expr(self.shared_keys or self.dkv_swap_ab):   # P^T (or P)
                sPt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(ds_layout)],
                                       1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, bm * d], 128]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        self.kernel(q_tiles, do_tiles, k_tiles, v_tiles, lse_tiles, dsum_tiles, dk_tiles,
                    dv_tiles, tma_q, tma_do, tma_k, tma_v, tma_lse, tma_dsum, tma_dk, tma_dv,
                    mdQacc, mSem, scale_log2, softmax_scale, q_layout, kv_layout, ds_layout,
                    row_layout).launch(
            grid=self.schedule.grid(tiles.seqlen_k, mdK.shape[2] if self.gqa else tiles.heads,
                                    mSem.shape[1] - 1 if self.varlen else tiles.batch),
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
        group = 1
        if cutlass.const_expr(self.varlen):
            # this CTA's sequence, seen as a batch of one (mSem: the sequence table, then its
            # dQ counters)
            (n_block, dk_head, kv_head, group, seqlen_q, seqlen_k, m_first, m_count,
             (mQ, mdO, mK, mV, mLSE2, mD, mdK, mdV, mdQacc, mSem)) = \
                self.schedule.cta_work_varlen(mSem, mQ, mdO, mK, mV, mLSE2, mD, mdK, mdV, mdQacc)
            head, batch = dk_head * group, Int32(0)
        elif cutlass.const_expr(self.gqa):
            (n_block, dk_head, kv_head, batch, group, seqlen_q, seqlen_k, m_first,
             m_count) = self.schedule.cta_work_kv(mQ, mK, mdK)
            head = dk_head * group                  # the first query head it walks
        else:
            (n_block, head, batch, kv_head, seqlen_q, seqlen_k, m_first,
             m_count) = self.schedule.cta_work(mQ, mK)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sK, sV, sQ, sdO, sdSt = backward_smem(storage, q_layout, kv_layout, ds_layout,
                                              self.head_dim_v, self.do_stages)
        sLSE, sD = storage.sLSE.get_tensor(row_layout), storage.sD.get_tensor(row_layout)

        consumer_warps = 4 * self.warpgroups
        kv_pipe = tma.make_tma_ring(storage.kv_barriers.data_ptr(), 1, consumer_warps,
                                    self.k_bytes + self.v_bytes)
        q_pipe = tma.make_tma_ring(storage.q_barriers.data_ptr(), self.stages, consumer_warps,
                                   self.q_bytes)
        do_pipe = tma.make_tma_ring(storage.do_barriers.data_ptr(), self.do_stages,
                                    consumer_warps, self.do_bytes)
        tma.barriers_ready()
        loads = (tma_q, tma_do, tma_k, tma_v, tma_lse, tma_dsum)
        dq_staging = storage.sdQ.data_ptr()

        if warp < 4:
            # ---------------- producer warpgroup ----------------
            self.roles.become_producer()
            if warp == 0:                                   # every TMA load
                tma.prefetch_descriptors(*loads, *(() if self.dkv_fp32 else (tma_dk, tma_dv)))
                self.load(loads, mQ, mdO, mK, mV, mLSE2, mD, sK, sV, sQ, sdO, sLSE, sD,
                          kv_pipe, q_pipe, do_pipe, n_block, head, batch, kv_head, m_first,
                          m_count, group)
            if warp == 1:                                   # the dQ writer
                if cutlass.const_expr(self.pdl):
                    cute.arch.griddepcontrol_wait()             # the dQ buffer is zeroed
                self.write_dq(dq_staging, mdQacc, mSem, n_block, head, batch, m_first, m_count,
                              group, (seqlen_q, seqlen_k))
                if cutlass.const_expr(self.convert_per_head):
                    cute.arch.cp_async_bulk_wait_group(0, read=False)    # adds landed
                    with cute.arch.elect_one():
                        if cutlass.const_expr(self.gqa):        # every head of the group
                            for h in cutlass.range(group, unroll=1):
                                cute.arch.atomic_add(mSem[batch, head + h, None].iterator,
                                                     Int32(1), sem="release", scope="gpu")
                        else:
                            cute.arch.atomic_add(mSem[batch, head, None].iterator, Int32(1),
                                                 sem="release", scope="gpu")
                else:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
        else:
            # ---------------- consumer warpgroups ----------------
            self.roles.become_consumer()
            ctidx = tidx - 128                              # 0 .. 255
            wg = warp // 4 - 1
            sPt = storage.sPt.get_tensor(ds_layout.outer, swizzle=ds_layout.inner) \
                if self.shared_keys or self.dkv_swap_ab else None   # P^T (P: dkv_swap_ab)
            consume = self.consume_dkv_swap if self.dkv_swap_ab else self.consume
            consume(ctidx, wg, kv_pipe, q_pipe, do_pipe, sK, sV, sQ, sdO, sdSt, sLSE, sD,
                    dq_staging, scale_log2, softmax_scale, mdK, mdV, tma_dk, tma_dv, warp,
                    n_block, dk_head if self.gqa else head, batch, m_first, m_count,
                    seqlen_q, seqlen_k, group, sPt)

    @cute.jit
    def load(self, loads, mQ, mdO, mK, mV, mLSE2, mD, sK, sV, sQ, sdO, sLSE, sD, kv_pipe,
             q_pipe, do_pipe, n_block, head, batch, kv_head, m_first, m_count, group):
        """The producer warp: K and V of kv tile `n_block`, then Q + lse2 and dO + D for every
        query tile it visits (gqa: of every query head of the group, `head` the first)."""
        tma_q, tma_do, tma_k, tma_v, tma_lse, tma_dsum = loads
        k_load = tma.TmaTiles.partition(tma_k, mK, kv_head, batch, sK)
        v_load = tma.TmaTiles.partition(tma_v, mV, kv_head, batch, sV)
        if cutlass.const_expr(not self.kv_with_first_tile):
            kv_state = tma.producer_state(1)
            kv_pipe.producer_acquire(kv_state)
            k_load.copy(n_block, kv_pipe.producer_get_barrier(kv_state))
            v_load.copy(n_block, kv_pipe.producer_get_barrier(kv_state))
        if cutlass.const_expr(not self.gqa):
            q_load = tma.TmaTiles.partition(tma_q, mQ, head, batch, sQ)
            do_load = tma.TmaTiles.partition(tma_do, mdO, head, batch, sdO)
            lse_load = tma.TmaTiles.partition_rows(tma_lse, mLSE2, head, batch, sLSE)
            dsum_load = tma.TmaTiles.partition_rows(tma_dsum, mD, head, batch, sD)
        produce = tma.producer_state(self.stages)
        produce_do = None if self.do_stages == self.stages else \
            tma.producer_state(self.do_stages)          # (dkv_swap_ab at dv = 192: depth 1)
        for it in cutlass.range(self.visits(m_count, group), unroll=1):
            if cutlass.const_expr(self.gqa):        # this tile's query head's copies
                head_in_group, m_block = self.work_item(it, m_first, m_count)
                q_head = head + head_in_group
                head_loads = (tma.TmaTiles.partition(tma_q, mQ, q_head, batch, sQ),
                              tma.TmaTiles.partition(tma_do, mdO, q_head, batch, sdO),
                              tma.TmaTiles.partition_rows(tma_lse, mLSE2, q_head, batch, sLSE),
                              tma.TmaTiles.partition_rows(tma_dsum, mD, q_head, batch, sD))
            else:
                m_block = m_first + it
                head_loads = (q_load, do_load, lse_load, dsum_load)
            phase = self.trace.start("load_q")
            q_pipe.producer_acquire(produce)
            self.trace.end(phase)
            barrier = q_pipe.producer_get_barrier(produce)
            if cutlass.const_expr(self.kv_with_first_tile):
                if it == 0:
                    k_load.copy_on_armed(n_block, barrier, self.k_bytes)
            head_loads[0].copy(m_block, barrier, produce.index)
            if cutlass.const_expr(self.pdl):
                if it == 0:
                    cute.arch.griddepcontrol_wait()     # lse2 and D are written
            head_loads[2].copy(m_block, barrier, produce.index)
            phase = self.trace.start("load_do")
            ring_do = produce if produce_do is None else produce_do
            do_pipe.producer_acquire(ring_do)
            self.trace.end(phase)
            barrier = do_pipe.producer_get_barrier(ring_do)
            if cutlass.const_expr(self.kv_with_first_tile):
                if it == 0:
                    v_load.copy_on_armed(n_block, barrier, self.v_bytes)
            head_loads[1].copy(m_block, barrier, ring_do.index)
            head_loads[3].copy(m_block, barrier, ring_do.index)
            produce.advance()
            if cutlass.const_expr(produce_do is not None):
                produce_do.advance()

    @cute.jit
    def consume(self, ctidx, wg, kv_pipe: pipeline.PipelineTmaAsync,
                q_pipe: pipeline.PipelineTmaAsync, do_pipe: pipeline.PipelineTmaAsync,
                sK: cute.Tensor, sV: cute.Tensor, sQ: cute.Tensor, sdO: cute.Tensor,
                sdSt: cute.Tensor, sLSE: cute.Tensor, sD: cute.Tensor, sdQ: cute.Pointer,
                scale_log2: Float32, softmax_scale: Float32, mdK: cute.Tensor,
                mdV: cute.Tensor, tma_dk: cute.CopyAtom, tma_dv: cute.CopyAtom, warp,
                n_block, head, batch, m_first, m_count, seqlen_q, seqlen_k, group, sPt=None):
        """One consumer warpgroup on kv tile `n_block`: every query tile it visits, then dK
        and dV out (`head`: the k/v head; sPt: P^T's SMEM with shared_keys)."""
        bm, bn, d, dtype = self.block_m, self.block_n, self.head_dim, self.dtype
        mmas = wgmma.BackwardMmas.create(self.warpgroups, bm, bn, d, ctidx, sK, sV, sQ, sdO,
                                         sdSt, dtype, self.dq_swap_ab, sPt=sPt,
                                         head_dim_v=self.head_dim_v, dq_rows=self.dq_rows)
        st_coords = mmas.st_coords
        acc_dk = mmas.new_dkv_accumulator(bn, d)
        acc_dv = mmas.new_dv_accumulator(bn, self.head_dim_v)
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
        # the exponents' factor: scale log2(e), or with a softcap cap log2(e) (on tanh)
        score_log2 = scale_log2
        if cutlass.const_expr(self.softcap > 0.0):
            score_log2 = Float32(self.softcap * LOG2_E)
        for it in cutlass.range(self.visits(m_count, group), unroll=1):
            if cutlass.const_expr(self.gqa):
                # a head's query tiles recomputed from opaque inputs, not held through the
                # loop: one register more spilled at d = 64 with a mask
                first, end = self.schedule.m_block_range(opaque(n_block), opaque(seqlen_q),
                                                         opaque(seqlen_k))
                _, m_block = self.work_item(it, first, end - first)
            else:
                m_block = m_first + it
            stage = consume.index
            phase = self.trace.start("wait_q")
            q_pipe.consumer_wait(consume)
            self.trace.end(phase)
            phase = self.trace.start("s_dp")
            acc_st = mmas.new_st_accumulator(bm, bn)
            acc_dpt = mmas.new_st_accumulator(bm, bn)
            st_rc, dpt_rc = acc_rows_cols(acc_st), acc_rows_cols(acc_dpt)
            cols = cute.size(st_rc, mode=[1])
            if cutlass.const_expr(self.softcap > 0.0 and not self.dp_first):
                tanh_slope = cute.make_rmem_tensor(st_rc.shape, Float16)     # 1 - t^2
            if cutlass.const_expr(self.dp_first):
                # dP^T - D out of the GEMM (it starts from -D: no D registers); ptxas makes it
                # wait for every earlier WGMMA, so it goes first and S^T queues behind it
                do_pipe.consumer_wait(consume)
                dsum = row_stats(sD, st_coords, stage, cols, self.stats)
                for c in cutlass.range_constexpr(cols):
                    for r in cutlass.range_constexpr(cute.size(dpt_rc, mode=[0])):
                        dpt_rc[r, c] = -dsum[c]
                wgmma.gemm(mmas.mma_sdp, acc_dpt, mmas.v_frag,
                           mmas.do_frag[None, None, None, stage], zero_init=False)
            wgmma.gemm(mmas.mma_sdp, acc_st, mmas.k_frag, mmas.q_frag[None, None, None, stage],
                       zero_init=True)
            # this thread's LSE (and below D) values, read while the GEMMs run (after the
            # wait their SMEM latency stalled the exp2 loop)
            lse2 = row_stats(sLSE, st_coords, stage, cols, self.stats)
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
            if cutlass.const_expr(self.softcap > 0.0):
                # t = tanh(s scale / cap) before the mask; dS^T times 1 - t^2 (docs/softcap.md):
                # in the exp2 loop with dp_first, else kept in fp16 until dS^T
                softcap_scores(st_rc, scale_log2 * (1.0 / (self.softcap * LOG2_E)))
                if cutlass.const_expr(not self.dp_first):
                    for c in cutlass.range_constexpr(cols):
                        for r in cutlass.range_constexpr(cute.size(st_rc, mode=[0])):
                            tanh_slope[r, c] = Float16(1.0 - st_rc[r, c] * st_rc[r, c])
            if self.schedule.needs_mask(m_block, n_block, seqlen_q, seqlen_k):
                if cutlass.const_expr(self.schedule.windowed):
                    mask_scores(st_rc, st_coords, n_block * bn, m_block * bm, seqlen_k,
                                self.schedule.right_limit is not None, causal_offset,
                                transposed=True, right=self.schedule.right,
                                left=self.schedule.window_left)
                else:
                    mask_scores(st_rc, st_coords, n_block * bn, m_block * bm, seqlen_k,
                                self.causal, causal_offset, transposed=True)
            for c in cutlass.range_constexpr(cols):
                for r in cutlass.range_constexpr(cute.size(st_rc, mode=[0])):
                    t = st_rc[r, c]
                    st_rc[r, c] = cute.math.exp2(t * score_log2 - lse2[c],
                                                 fastmath=True)          # P^T
                    if cutlass.const_expr(self.softcap > 0.0 and self.dp_first):
                        # (a masked t is -inf: the slope's max with 0 keeps 0 * slope finite)
                        dpt_rc[r, c] = st_rc[r, c] * dpt_rc[r, c] * cute.arch.fmax(
                            1.0 - t * t, Float32(0.0))                  # dS^T
            if cutlass.const_expr(not self.dp_first):
                dsum = row_stats(sD, st_coords, stage, cols, self.stats)
            if cutlass.const_expr(self.shared_keys):    # P^T -> SMEM (stmatrix) for dV
                cute.copy(store_ds, thr_store_ds.retile(converted(acc_st, dtype)),
                          thr_store_ds.partition_D(sPt)[None, None, None, it % 2])
            else:
                mmas.pt_frag.store(acc_as_operand_a(acc_st).load().to(dtype))
            self.trace.end(phase)
            if cutlass.const_expr(self.early_dv):
                phase = self.trace.start("dv")
                mmas.issue_dv(acc_dv, stage, (0, self.split_dv or bm // 16))
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
                        if cutlass.const_expr(self.softcap == 0.0):     # (softcap: above)
                            dpt_rc[r, c] = st_rc[r, c] * dpt_rc[r, c]           # dS^T
                    else:
                        dpt_rc[r, c] = st_rc[r, c] * (dpt_rc[r, c] - dsum[c])  # dS^T
                        if cutlass.const_expr(self.softcap > 0.0):
                            dpt_rc[r, c] = dpt_rc[r, c] * Float32(tanh_slope[r, c])
            if cutlass.const_expr(not self.shared_keys):
                mmas.dst_frag.store(acc_as_operand_a(acc_dpt).load().to(dtype))
                pin(mmas.dst_frag)                      # one conversion for both readers
            buf = it % 2
            ds_out = converted(acc_dpt, dtype) if self.shared_keys else \
                operand_a_as_acc(mmas.dst_frag, acc_dpt)              # dS^T, converted once
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
            if cutlass.const_expr((not self.early_dv or self.split_dv > 0)
                                  and not self.shared_keys):
                mmas.issue_dv(acc_dv, stage, (self.split_dv, bm // 16))  # (the rest of) dV
            cute.arch.fence_proxy("async.shared", space="cta")   # dS^T visible to the WGMMAs
            self.trace.end(phase)
            phase = self.trace.start("ds_barrier")
            ds_written.arrive_and_wait()                         # ... of both warpgroups
            self.trace.end(phase)
            phase = self.trace.start("dq_dk")
            if cutlass.const_expr(self.shared_keys):            # P^T of both warpgroups
                mmas.issue_dv(acc_dv, stage, (0, bm // 16), buf)
            acc_dq = mmas.new_dq_accumulator(bm, d)
            wgmma.gemm(mmas.mma_dq, acc_dq, *mmas.dq_operands(buf),
                       zero_init=True)
            self.trace.end(phase)
            phase = self.trace.start("wait_dv_dq")
            warpgroup.wait_group(1)                                     # dV is done
            self.trace.end(phase)
            phase = self.trace.start("dq_dk")
            do_pipe.consumer_release(consume)
            wgmma.gemm(mmas.mma_dkv, acc_dk, mmas.dkv_operand_a(mmas.dst_frag, buf),
                       mmas.qt_frag[None, None, None, stage], zero_init=False)  # dK += dS^T Q
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
        write_dkv(self.dkv_fp32, epilogue, warp, mmas.thr_dkv, mmas.thr_dv, acc_dk, acc_dv, sK,
                  sV, dtype, tma_dk, tma_dv, mdK, mdV, head, batch, n_block)
        self.trace.end(phase)


# Policy: `DEFAULTS`, then the matching rows in `policy`'s mode order; compile_kernel's
# arguments override all. Each row: settings, why (one line), the results that measured it.

DEFAULTS = {"block_m": 64, "stmatrix": True, "dp_first": False, "early_dv": None,
            "ds_address_per_tile": False, "kv_with_first_tile": False, "pdl": False,
            "split_dv": 0, "longest_first": False, "group_mib": 32, "group_heads": 0,
            "convert_per_head": False, "gqa": False, "heads_first": False, "shared_keys": False,
            "dkv_swap_ab": False, "dkv_split_d": False, "dq_rows": False,
            "stats_shuffle": False}


BWD64 = "results/h200/2026-11-29_bwd64_dq_rows.json.xz"
BWD64S = "results/h200/2026-11-29_bwd64_stats_shuffle.json.xz"
POLICY = (
    PolicyRow(64, False, "", {"block_m": 128, "dp_first": True, "dq_rows": True},
              "FA3's 128-row tiles, dP^T first (no D registers, no spills): +8-14% over 64 "
              "rows; dQ split by rows (8 m64n64k16) +1.6-2.1% (MHA; GQA: its row)",
              ("results/h100/2026-11-24_kb2_tiles_d64.json", BWD64)),
    PolicyRow(64, True, "", {"block_m": 128, "early_dv": True, "split_dv": 1, "pdl": True,
                             "convert_per_head": True, "dq_rows": True, "stats_shuffle": True,
                             "ds_address_per_tile": True},
              "128 rows +2-7%; dV split +1.3%; dQ converted per head +0.4-3.6%; dQ split by "
              "rows +4.3-5.9%; dS^T by stmatrix, no spill (stats shuffled) +3.4-6.8%",
              (BWD64S, BWD64, "results/h100/2026-11-24_kb2_tiles_d64.json",
               "results/h100/2026-11-25_kb2_split_dv_d64_causal.json",
               "results/h100/2026-11-26_kb2_per_head_d64.json",
               "results/h100/2026-11-26_kb2_per_head_d64_run2.json")),
    PolicyRow(128, False, "", {"block_m": 80, "ds_address_per_tile": True,
                               "kv_with_first_tile": True, "pdl": True,
                               "convert_per_head": True},
              "80 rows with dQ^T, dS^T addresses per tile (no spill): +2.4-5.4%; FA4's "
              "prologue +0.1-0.4%; dQ converted per head +1.4-1.8% at 2k",
              ("results/h100/2026-11-25_kb2_ds_address_per_tile.json",
               "results/h100/2026-11-25_backward_kb2_d128_prologue.json",
               "results/h100/2026-11-25_kb2_epilogue_d128_full.json",
               "results/h100/2026-11-26_backward_kb2_per_head.json",
               "results/h100/2026-11-26_backward_kb2_per_head_run2.json")),
    PolicyRow(128, True, "", {"kv_with_first_tile": True, "pdl": True, "split_dv": 1,
                              "longest_first": True, "convert_per_head": True},
              "64 rows (80 spill with a mask); FA4's prologue +0.2-0.9%; dV split +2.5-3.7%; "
              "longest first in 32 MiB groups +0.7-3.6%; dQ converted per head +1.4% at 4k",
              ("results/h100/2026-11-25_kb2_prologue_causal.json",
               "results/h100/2026-11-25_kb2_split_dv_causal.json",
               "results/h100/2026-11-26_kb2_longest_first_causal.json",
               "results/h100/2026-11-26_backward_kb2_per_head.json",
               "results/h100/2026-11-26_backward_kb2_per_head_run2.json")),
    PolicyRow(96, False, "", {"early_dv": True, "kv_with_first_tile": True, "pdl": True,
                              "convert_per_head": True},
              "d = 128's settings on 64-row tiles (80 rows need dQ^T, whose M = d is not a "
              "multiple of 64 here); not yet measured", ("tools/bwd_dims_gpu_check.py",)),
    PolicyRow(96, True, "", {"early_dv": True, "split_dv": 1, "kv_with_first_tile": True,
                             "pdl": True, "longest_first": True, "convert_per_head": True},
              "d = 128's causal row; not yet measured", ("tools/bwd_dims_gpu_check.py",)),
    # d = 192 and 256: dK^T / dV^T with d as M (dkv_swap_ab; with a softcap, d = 192 runs
    # shared_keys: compile_kernel). d = 256 ran kb1 before (two CTAs a 128-key tile)
    PolicyRow(192, None, "", {"dkv_swap_ab": True, "kv_with_first_tile": True, "pdl": True,
                              "longest_first": True, "convert_per_head": True},
              "64 x 96 tiles, dK^T / dV^T (dkv_swap_ab): 1.16-1.20x shared_keys' 64 x 64 at "
              "(192, 192), 1.18-1.23x at (192, 128), FA4 / it 1.06-1.07 (est.); the other "
              "settings as at d = 128, not measured alone",
              ("results/h200/2026-11-29_bwd_dims_variant_d192_d256.json",)),
    PolicyRow(256, None, "", {"dkv_swap_ab": True, "dkv_split_d": True},
              "64 x 48 tiles, dK^T / dV^T (dkv_swap_ab): 1.44-1.50x kb1; their d rows split "
              "in FA4's barrier order +0.2-7.3% (B8 N4k, B2 N16k; FA4 / it 0.99-1.01)",
              ("results/h200/2026-11-29_bwd_dims_variant_d192_d256.json",
               "results/h200/2026-11-29_bwd256_split_d.json.xz")),
    # the deterministic mode: CTAs wait for each other's dQ adds (longest first helps far
    # less); its turns use the per-head conversion's counters; fixed-size head groups
    PolicyRow(64, None, "deterministic", {"longest_first": True, "convert_per_head": False,
                                          "group_heads": 32, "dq_rows": False},
              "32-head groups: +14 / +19% at N = 8k / 16k against 32 MiB groups",
              ("results/h100/2026-11-26_kb2_deterministic_group_heads_d64.json",
               "results/h100/2026-11-26_kb2_deterministic_longest_first_d64.json")),
    PolicyRow(128, None, "deterministic", {"longest_first": True, "convert_per_head": False,
                                           "group_heads": 16},
              "16-head groups: +17 / +23% at N = 8k / 16k against 32 MiB groups",
              ("results/h100/2026-11-26_kb2_deterministic_group_heads_d128.json",
               "results/h100/2026-11-26_kb2_deterministic_longest_first_d128.json")),
    PolicyRow(96, None, "deterministic", {"longest_first": True, "convert_per_head": False,
                                          "group_heads": 16},
              "d = 128's 16-head groups; not yet measured", ("tools/bwd_dims_gpu_check.py",)),
    PolicyRow(192, None, "deterministic", {"longest_first": True, "convert_per_head": False,
                                           "group_heads": 8},
              "d = 128's groups scaled to 1.5x the bytes a head; not yet measured",
              ("tools/bwd_dims_gpu_check.py",)),
    PolicyRow(None, None, "gqa", {"gqa": True},
              "no per-query-head dK/dV scratch nor torch sum (not yet measured)",
              ("tools/bwd_gqa_gpu_check.py",)),        # its results: to be run
    # with a mask a CTA's length varies `group` times more: d = 128 keeps the MHA row's
    # longest first; d = 64 heads first (the 1-D grid's index arithmetic spills there)
    PolicyRow(64, False, "gqa", {"dq_rows": False},
              "dQ split by rows -5.1 / -6.3% at 16/4 (B8 N4k, B2 N16k)", (BWD64,)),
    PolicyRow(128, True, "gqa", {"gqa": False},
              "per query head from N = 16k (dK / dV summed by torch): +2.5 / +3.5% at 16/4 B1 "
              "N16k / 32k (+0.2% at 8k); windows unmeasured: the walk",
              ("results/h200/2026-11-29_bwd128_gqa0_long.json.xz",), Lengths(16384), False),
    PolicyRow(128, True, "gqa deterministic", {"gqa": True},
              "the walk kept in the deterministic mode (the A/B above ran without it)",
              ("results/h200/2026-11-29_bwd128_gqa0_long.json.xz",), Lengths(16384)),
    PolicyRow(64, True, "gqa", {"heads_first": True},
              "kv tile 0 of every head first: grid time estimated 1.24 -> 1.01x ideal at 32/8 "
              "B1 N = 8k (dkv_parts' model; not yet measured)",
              ("tools/bwd_gqa_gpu_check.py",)),
    # a sliding window (the causal row first): its masks' second limit costs registers
    PolicyRow(64, None, "window", {"dp_first": True, "stmatrix": False, "early_dv": False,
                                   "split_dv": 0, "dq_rows": False, "stats_shuffle": False,
                                   "ds_address_per_tile": False},
              "dP^T first (no D registers), no stmatrix: the causal row's settings spill with "
              "a window's two limits (4-12 bytes); dQ by columns (rows untried); not yet measured",
              ("tools/window_gpu_check.py",)),
    PolicyRow(64, True, "gqa deterministic", {"longest_first": False},
              "heads first here too (the 1-D grid spills one register); it also starts each "
              "head's kv tile n - 1 before its tile n, which the dQ turns need",
              ("tools/bwd_gqa_gpu_check.py",)),
)


def policy(problem, deterministic: bool = False, tuned: bool = True) -> dict:
    """The settings `POLICY` gives `problem` (`tuned`: the head dim and mask's rows, as
    compile_kernel takes them when block_m is not given), and their rows ("rows")."""
    return policy_settings(POLICY, DEFAULTS, problem, deterministic, tuned)


# softcap (block_m, dp_first, early_dv) per head dim: 64-row query tiles, at d = 128 with dP^T
# first (1 - t^2 used in the exp2 loop, not held until dS^T); the default tiles spill
SOFTCAP_TILES = {64: (64, None, None), 96: (64, None, None), 128: (64, True, False),
                 192: (64, None, None), 256: (64, None, None)}


def compile_kernel(problem, *, compile_options: str = "", block_m: Optional[int] = None,
                   block_n: Optional[int] = None, deterministic: bool = False,
                   stmatrix: Optional[bool] = None, early_dv=None, dp_first: Optional[bool] = None,
                   ds_address_per_tile: Optional[bool] = None,
                   kv_with_first_tile: Optional[bool] = None, pdl: Optional[bool] = None,
                   split_dv: Optional[int] = None, longest_first: Optional[bool] = None,
                   group_mib: Optional[int] = None, group_heads: Optional[int] = None,
                   trace: bool = False, convert_per_head: Optional[bool] = None,
                   gqa: Optional[bool] = None, heads_first: Optional[bool] = None,
                   softcap: float = 0.0, shared_keys: Optional[bool] = None,
                   varlen: bool = False, dkv_swap_ab: Optional[bool] = None,
                   dkv_split_d: Optional[bool] = None, dq_rows: Optional[bool] = None,
                   stats_shuffle: Optional[bool] = None, dkv_fp32: Optional[bool] = None):
    """Compile (or fetch from the cache) kb2 and its pre/post-processing kernels.
    deterministic: dQ's fp32 adds in a fixed order (same bits on every run; slower). An
    option left None takes `policy`'s (the head dim and mask's row only when block_m is not
    given); convert_per_head is also off where pdl is (the early conversion waits per head).
    trace: iket phase ranges (harness/timeline.py). softcap: the forward's cap (0: none).
    varlen: packed batches (common/varlen_backward.compile_for sets the other options).
    dkv_fp32: fp32 dK / dV parts (None: where GQA splits a group, backward.with_fp32_parts)."""
    softcap = float(softcap)
    if softcap and block_m is None:
        # the tile that fits the softcap's registers (tanh and 1 - t^2) without spills
        block_m, dp_first, early_dv = SOFTCAP_TILES.get(problem.head_dim,
                                                        (block_m, dp_first, early_dv))
    settings = policy(problem, deterministic, tuned=block_m is None)
    if dkv_swap_ab is None and problem.head_dim == 256:
        dkv_swap_ab = True                      # (d = 256's only tile, softcap included)
    if shared_keys is None and problem.head_dim == 192:
        # d = 192 without dkv_swap_ab (softcap, or asked for): the 64 x 64 tile that fits
        shared_keys = not (settings["dkv_swap_ab"] if dkv_swap_ab is None else dkv_swap_ab)
    passed = locals()               # the options as given (None: the policy's)
    given = {name: value for name, value in passed.items() if name in DEFAULTS}
    arguments = kernel_arguments(settings, given, problem, block_n, deterministic, trace,
                                 softcap, varlen)
    return compile_backward(SPEC, FlashAttentionBackwardKB2, problem,
                            with_fp32_parts(FlashAttentionBackwardKB2, problem, arguments,
                                            None if dkv_fp32 is None else bool(dkv_fp32)),
                            compile_options=compile_options)


def run_kernel(handle, q, k, v, o, do, lse, dq, dk, dv, softmax_scale=None, checked=False):
    return run_backward(handle, q, k, v, o, do, lse, dq, dk, dv, softmax_scale, checked)
