"""k4: both GEMMs on WGMMA, P handed from the S accumulator to the P V A-operand in registers.

What changes from k4_qk: nothing goes through shared memory between the two GEMMs.

* S = Q K^T: one WGMMA batch per warpgroup (64 query rows x block_n kv columns each).
* The online softmax runs on the accumulator fragment itself. A thread holds 2 rows x
  block_n/4 columns of S (`acc_rows_cols` view); the 4 lanes of a quad share a row, so row
  maxima and sums need 2 butterfly shuffles instead of k3's 4.
* P is converted to bf16 in registers and *reinterpreted* as the A operand of O += P V
  (`acc_as_operand_a`): for 16-bit WGMMA, the accumulator of an m64nNk16 product and the
  register A operand of the next one have compatible per-thread layouts, pairs of 8-column
  groups becoming one k16 slice. No shuffles, no shared memory.
* V is stored (kv, d) with d contiguous, exactly as TMA loaded it. P V needs B = V^T
  (d x kv): `transposed` re-views the same bytes with the modes swapped, which makes B
  "MN-major" (its N = d dimension is contiguous); the WGMMA descriptor says so and the
  tensor core reads it transposed. No bytes move.
* O (fp32, 64 x d per warpgroup) is rescaled by alpha and accumulated in registers, scaled
  by 1/l once, converted to bf16, staged in shared memory (Q's buffer, no longer needed)
  and written with one TMA store, which clips rows past the end of the sequence.

What stays: k3's TMA + mbarrier pipeline for K and V (one barrier per stage for both
tiles), warp 0 as the producer inside the consumer loop, the tile schedule and masking.

Budget (defaults): d = 128: block 128 x 128, 256 threads = 2 warpgroups, SMEM = Q 32 KiB +
2 stages x (K + V) 64 KiB = 160 KiB; d = 64: block 192 x 128, 384 threads = 3 warpgroups,
SMEM = 24 + 2 x 32 = 88 KiB. Registers per thread: S 64 + O d/2 fp32 + P 32 (bf16 pairs) +
bookkeeping (~195 at d = 128, ~160 at d = 64).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32
from cutlass.cute.nvgpu import warpgroup

from hopper_attn.common import tma, wgmma
from hopper_attn.common.contract import KernelSpec, compile_attention, run_attention
from hopper_attn.common.layouts import (acc_as_operand_a, acc_rows_cols, ndhb_view,
                                        qkv_smem, smem_tile_layout, transposed)
from hopper_attn.common.masking import TileSchedule, mask_scores
from hopper_attn.common.softmax import OnlineSoftmax, scale_rows
from hopper_attn.common.trace import PhaseTrace

SPEC = KernelSpec(
    name="k4",
    summary="WGMMA for QK^T and PV, softmax on the accumulator, P passed in registers",
    head_dims=(64, 128),
)


# Tile sizes chosen by measurement on an H100 (results/h100/k4_tiles_d*.json, docs/k4.md):
# d = 128: 128 x 128, 2 stages (3 stages, block_n = 64 or block_m = 64 were slower);
# d = 64: 192 x 128 (three warpgroups), 2 stages.
DEFAULT_BLOCK_M = {64: 192, 128: 128}


class FlashAttentionK4:
    def __init__(self, head_dim: int, causal: bool, block_m: int = 0, block_n: int = 128,
                 stages: int = 2, trace: bool = False):
        block_m = block_m or DEFAULT_BLOCK_M.get(head_dim, 128)
        if block_m % 64 or block_n % 16 or stages < 1:
            raise ValueError(f"bad tile: block_m={block_m} (multiple of 64), "
                             f"block_n={block_n} (multiple of 16), stages={stages} (>= 1)")
        self.head_dim = head_dim
        self.causal = causal
        self.block_m, self.block_n, self.stages = block_m, block_n, stages
        self.warpgroups = block_m // 64
        self.threads = 128 * self.warpgroups
        self.schedule = TileSchedule(block_m, block_n, causal)
        self.trace = PhaseTrace(trace)          # iket phase ranges (off: no code at all)

    def describe(self) -> dict:
        return {"smem_bytes": getattr(self, "smem_bytes", None), "block_m": self.block_m,
                "block_n": self.block_n, "stages": self.stages, "threads": self.threads}

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 scale_log2: Float32, stream):
        q, k, v, o = [ndhb_view(t) for t in (mQ, mK, mV, mO)]   # (N, d, H, B)
        bm, bn, d = self.block_m, self.block_n, self.head_dim
        q_layout = smem_tile_layout(BFloat16, bm, d)            # also O's staging buffer
        kv_layout = smem_tile_layout(BFloat16, bn, d, self.stages)
        atoms, coords, self.q_bytes, self.kv_bytes = tma.make_qkv_loads(
            q, k, v, q_layout, kv_layout, bm, bn, d)
        tma_o, o_coords = tma.make_tma_store(o, q_layout, bm, d)

        @cute.struct
        class SharedStorage:
            q_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            kv_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(kv_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(kv_layout)], 1024]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        seqlen, heads, batch = q.shape[0], q.shape[2], q.shape[3]
        self.kernel(*coords, o_coords, *atoms, tma_o, scale_log2, q_layout, kv_layout).launch(
            grid=self.schedule.grid(seqlen, heads, batch),
            block=[self.threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               tma_q: cute.CopyAtom, tma_k: cute.CopyAtom, tma_v: cute.CopyAtom,
               tma_o: cute.CopyAtom, scale_log2: Float32, q_layout: cute.ComposedLayout,
               kv_layout: cute.ComposedLayout):
        schedule = self.schedule
        bm, bn, d = self.block_m, self.block_n, self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        _, head, batch = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        seqlen = mQ.shape[0]
        m_block, n_count = schedule.work(seqlen)
        if warp == 0:
            tma.prefetch_descriptors(tma_q, tma_k, tma_v, tma_o)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sQ, sK, sV = qkv_smem(storage, q_layout, kv_layout)    # (bm, d), (bn, d, stage) x 2
        sVt = transposed(sV)                                                    # (d, bn, stage)

        loads = tma.AttentionLoads.create(storage, self.threads // 32, self.stages, self.q_bytes,
                                          self.kv_bytes, (tma_q, tma_k, tma_v), (mQ, mK, mV),
                                          (sQ, sK, sV), head, batch)
        o_store = tma.TmaTiles.partition(tma_o, mO, head, batch, sQ)   # O is staged in Q's buffer
        produce = tma.producer_state(self.stages)
        consume = tma.consumer_state(self.stages)
        if warp == 0:                     # Q once, then the first `stages` K/V tiles
            produce = loads.start(m_block, n_count, produce)

        # Each warpgroup owns 64 query rows. Operand fragments are SMEM descriptors (per
        # warpgroup); accumulators and coordinates are per thread.
        mmas = wgmma.AttentionMmas.create(self.warpgroups, bm, bn, d, tidx, sQ, sK, sVt)
        mma_qk, mma_pv, thr_qk, thr_pv = mmas.mma_qk, mmas.mma_pv, mmas.thr_qk, mmas.thr_pv
        q_frag, k_frag, vt_frag, p_frag = mmas.q_frag, mmas.k_frag, mmas.vt_frag, mmas.p_frag
        s_coords = mmas.s_coords
        acc_o = mmas.new_o_accumulator(bm, d)
        o_rc = acc_rows_cols(acc_o)
        softmax = OnlineSoftmax.create(cute.size(s_coords, mode=[0]), scale_log2, lanes_per_row=4)
        loads.wait_q()

        for n in cutlass.range(n_count, unroll=1):
            phase = self.trace.start("wait_kv")
            loads.kv.pipe.consumer_wait(consume)
            stage = consume.index
            self.trace.end(phase)
            phase = self.trace.start("qk")
            acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((bm, bn)), Float32)
            wgmma.gemm(mma_qk, acc_s, q_frag, k_frag[None, None, None, stage], zero_init=True)
            warpgroup.wait_group(0)
            self.trace.end(phase)
            phase = self.trace.start("softmax")
            s_rc = acc_rows_cols(acc_s)
            if schedule.needs_mask(m_block, n, seqlen):
                mask_scores(s_rc, s_coords, m_block * bm, n * bn, seqlen, self.causal)
            alpha = softmax.step(s_rc)                       # S -> P (unnormalized), in place
            scale_rows(o_rc, alpha)
            p_frag.store(acc_as_operand_a(acc_s).load().to(BFloat16))
            self.trace.end(phase)
            phase = self.trace.start("pv")
            wgmma.gemm(mma_pv, acc_o, p_frag, vt_frag[None, None, None, stage], zero_init=False)
            warpgroup.wait_group(0)
            self.trace.end(phase)
            phase = self.trace.start("release")
            loads.kv.pipe.consumer_release(consume)
            consume.advance()
            if warp == 0:                                   # refill the freed stage
                produce = loads.refill(produce, n_count)
            self.trace.end(phase)

        # Epilogue: O / l -> bf16 -> SMEM (Q's buffer) -> one TMA store.
        scale_rows(o_rc, softmax.finalize())
        cute.arch.sync_threads()                       # both warpgroups are done reading Q
        o_bf16 = cute.make_rmem_tensor_like(acc_o, BFloat16)
        o_bf16.store(acc_o.load().to(BFloat16))
        cute.autovec_copy(o_bf16, thr_pv.partition_C(sQ))
        cute.arch.fence_proxy("async.shared", space="cta")   # make it visible to the TMA unit
        cute.arch.sync_threads()
        if warp == 0:
            o_store.store(m_block)


def compile_kernel(problem, *, compile_options: str = "", block_m: int = 0,
                   block_n: int = 128, stages: int = 2, trace: bool = False):
    """Compile (or fetch from the cache) k4; options: block_m (0: the measured default for
    the head dim), block_n, stages, trace (iket phase ranges, for timelines)."""
    return compile_attention(SPEC, FlashAttentionK4, problem,
                             {"block_m": block_m, "block_n": block_n, "stages": stages,
                              "trace": trace},
                             compile_options=compile_options)


def run_kernel(handle, q, k, v, out):
    run_attention(handle, q, k, v, out)
