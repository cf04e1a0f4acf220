"""k7: FP8 (e4m3) forward: both GEMMs on FP8 WGMMA, V loaded transposed.

Hopper's tensor cores multiply e4m3 at twice the bf16 rate (k32 WGMMAs instead of k16).
What changes from k6 (docs/k7.md):

* Inputs: q, k, v in `float8_e4m3fn` with one fp32 descale per (batch, head) each
  (x = x8 * descale; `prepare_inputs` / `hopper_attn.quantize.quantize_fp8` make them from
  bf16). Output bf16 (and the log-sum-exp), as k6. S = Q K^T is an FP8 WGMMA with fp32
  accumulation; the descales of q and k fold into the softmax's scale, v's into the final 1/l.
* P in e4m3 registers as the A operand of O += P V. The softmax scales P by 2^8 (largest
  value 256 of e4m3's 448) so that small probabilities do not flush to zero; l carries the same
  factor. The conversion needs no shuffle: P's kv order is permuted instead
  (common/fp8.py), and V^T's rows follow the same permutation.
* V^T tiles. An FP8 WGMMA reads its SMEM operands K-major only; V as attention gets it,
  (kv, d) with d contiguous, is MN-major for P V. k7 takes V *sequence-major* instead,
  packed by the quantizer in the same pass (`quantize_fp8(v, pack_v=True)`: (B, H, d, N16)
  in memory, keys permuted within 16 as P's k-slots), so the producer warp's TMA writes V^T
  tiles straight into the ring the PV WGMMA reads, as it writes K tiles; nothing else
  changes in the producer.
* Wider kv tiles (TILES): with only K and V^T rings in SMEM, 128 x 192 at d = 128 and
  128 x 128 at d = 256 fit (k6: 128 x 128 and 128 x 80).
* The output is staged in its own bf16 buffer (Q's FP8 buffer is half the size). Option
  `out_fp8`: an e4m3 output instead, O / l in v8's units (descale_o = descale_v; no scale
  to choose: a convex combination of v8's rows stays within e4m3's range).
* Scores in fp16 (`s_f16`, POLICY: d = 128, and d = 256 without a mask): the QK WGMMA
  accumulates S in fp16 (same rate), two scores per register, and the softmax runs on pairs
  (common/softmax.py `OnlineSoftmaxF16`: HMNMX2, HADD2 / HFMA2, ex2.approx.f16x2, HADD2
  row sums). Per score about as many instructions as in fp32 (each packed exp2 pair needs a
  PRMT), but half of S's registers, which at d = 128 pay for 256-wide kv tiles
  (TILES_S_F16). The quantizer must keep every q8 . k8 within fp16's range and make the
  scores' factor a power of two (`prepare_inputs` does, `quantize.quantize_qk_f16_scores`);
  q and k scaled to 448 by `quantize_fp8` alone would overflow: run those with `s_f16=0`
  (docs/lab/k7.md "Scores in fp16").

What stays: k6's consumer loop (`mainloop`: QK issued before the softmax, PV of the previous
tile under it; the PV wait pinned after the softmax, k6's pv_wait="pinned", or at d = 256
with a mask after the tile's 8th exp2; at d = 256 without one O rescaled under the QK GEMM,
rescale="before_pv": POLICY below), its register split (producer 24, consumers 240), the
producer warp's TMA loads, the persistent scheduler, tails, causal skipping, the
(B, N, H, d) layout of q, k and the output, GQA, cross-attention and strided q / k. No
ping-pong between the consumer warpgroups (with GEMMs half as long, taking turns costs more
than it saves).

Where the kernel launches: `__call__` below (k7's own, for the FP8 buffers and descales).

Budget, d = 128 (fp16 scores, 128 x 256 tiles, 2 stages): 384 threads; SMEM = Q 16 KiB + K
and V^T rings 2 x 2 x 32 KiB + O 32 KiB = 176 KiB (+ barriers). Registers per consumer
thread: S 64 (128 fp16 scores) + P 32 + O 64 fp32. With fp32 scores (`s_f16=0`, 128 x 192,
3 stages): Q 16 + 2 x 3 x 24 + O 32 = 192 KiB; S 96 + P 24 + O 64. d = 64: 128 x 256,
3 stages: Q 8 + 2 x 3 x 16 + O 16 = 120 KiB. d = 256: 128 x 128, 2 stages: Q 32 + 2 x 2 x 32
+ O 64 = 224 KiB.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import torch
from cutlass import Float16, Float32

from hopper_attn.common import tma, wgmma
from hopper_attn.common.contract import KernelSpec, compile_attention, run_attention
from hopper_attn.common.fp8 import probs_to_fp8_operand
from hopper_attn.common.layouts import (acc_rows_cols, ndhb_view, smem_bytes, smem_tile_layout,
                                        swap_modes, transposed)
from hopper_attn.common.softmax import OnlineSoftmax, OnlineSoftmaxF16, scale_rows
from hopper_attn.k5 import lse_buffer
from hopper_attn.k6 import ITEM_ENDS, FlashAttentionK6, wg_major_o_buffer
from hopper_attn.quantize import (PERM16, pack_v, quantize_fp8,  # noqa: F401
                                  quantize_qk_f16_scores, unpack_v)

FP8 = torch.float8_e4m3fn


def descale_examples(problem, device) -> list:
    """Example descales to compile against: q's (batch, heads), k's and v's (batch, heads_kv)."""
    return [torch.ones((problem.batch, h), dtype=torch.float32, device=device)
            for h in (problem.heads, problem.kv_heads, problem.kv_heads)]


SPEC = KernelSpec(
    name="k7",
    summary="k6 in FP8 (e4m3): FP8 WGMMA for both GEMMs, V transposed in SMEM, bf16 output",
    head_dims=(64, 128, 256),
    dtypes=(torch.bfloat16,),   # the problem: bf16 attention, computed from e4m3 inputs
    input_dtype=FP8,
    extra_inputs=descale_examples,
    # GQA / cross-attention (k/v descales per k/v head) and strided e4m3 inputs: k6's code
    # paths, GPU-tested for k7 (tests/test_gpu.py::test_k7_gqa_and_cross_attention,
    # ::test_k7_strided_inputs)
    separate_kv=True,
    strided_inputs=True,
    grid_per_tile=False,
    takes_work_counter=True,
)

P_SCALE_LOG2 = 8                 # P in [0, 256]: e4m3 keeps 3 mantissa bits down to 2^-6
# the in-kernel V transpose's V^T ring producers (deleted, last at 2031291): the ring's
# barriers are still initialised, so that the kernels stay as measured (see `kernel`)
TRANSPOSE_WARPS = 2
# head_dim -> (block_m, block_n, stages) with fp32 scores, and with fp16 scores (`s_f16`):
# only K and V^T rings in SMEM, so 192-wide kv tiles at d = 128 (+2-6% over 128), 128 at
# d = 256 (+20-25% over 64); fp16 scores take half of S's registers: 256 wide at d = 128
# (results/h100/2026-11-23_k7_tiles_v_packed.json, results/h200/2026-11-28_k7_s_f16_*.json)
TILES = {64: (128, 256, 3), 128: (128, 192, 3), 256: (128, 128, 2)}
TILES_S_F16 = {64: (128, 256, 3), 128: (128, 256, 2), 256: (128, 128, 2)}


class FlashAttentionK7(FlashAttentionK6):
    def __init__(self, head_dim: int, causal: bool, block_m: int, block_n: int, stages: int,
                 pv_wait: str = "pinned", rescale: str = "eager",
                 item_end: str = "own_buffer", v_lags_k: bool = True, longest_first: int = 0,
                 s_f16: bool = False, trace: bool = False):
        # O has a buffer of its own here whatever item_end says (Q's FP8 buffer is half
        # its size); item_end picks the Q release and the per-warpgroup stores
        if item_end not in ("own_buffer", "own_buffer_wg"):
            raise ValueError("k7 item_end: own_buffer or own_buffer_wg")
        # the masked tile with one key limit per row: without it the 128-wide kv tile at
        # d = 256 spills 76 bytes with a causal mask (docs/k7.md)
        super().__init__(head_dim, causal, block_m, block_n, pingpong=False, pv_wait=pv_wait,
                         rescale=rescale, item_end="q_buffer", v_lags_k=v_lags_k,
                         mask_per_row=True, longest_first=longest_first, stages=stages,
                         trace=trace)
        _, self.early_q_release, self.wg_store = ITEM_ENDS[item_end]
        if self.lazy_rescale:
            raise ValueError("k7: rescale eager or before_pv")
        self.p_scale_log2 = P_SCALE_LOG2
        # S accumulated in fp16 and its softmax in fp16 pairs (OnlineSoftmaxF16); the
        # one-step softmax only (no fences in it)
        self.s_f16 = bool(s_f16)
        if self.s_f16 and (self.softmax_fence_after >= 0 or self.pv_wait_first):
            raise ValueError("s_f16: with the one-step softmax only (no pv_wait after<n> "
                             "or first)")

    def o_apart_from_q(self) -> bool:
        return True                             # O's buffer is always its own here

    def smem_estimate(self, head_dim: int, block_m: int, block_n: int, stages: int) -> int:
        """e4m3 Q, K and V^T rings, the bf16 output buffer, 1 KiB of mbarriers; each buffer
        1024-byte aligned."""
        return (1024 + smem_bytes(block_m * head_dim)
                + 2 * smem_bytes(stages * block_n * head_dim) + smem_bytes(block_m * head_dim * 2))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mDescaleQ: cute.Tensor, mDescaleK: cute.Tensor, mDescaleV: cute.Tensor,
                 mLSE: cute.Tensor, mCounter: cute.Tensor, scale_log2: Float32, stream):
        q, k, v, o = [ndhb_view(t) for t in (mQ, mK, mV, mO)]   # (N, d, H, B)
        bm, bn, d = self.block_m, self.block_n, self.head_dim
        self.dtype = mQ.element_type                            # e4m3
        self.out_dtype = mO.element_type                        # bf16
        q_layout = smem_tile_layout(self.dtype, bm, d)
        kv_layout = smem_tile_layout(self.dtype, bn, d, self.stages)
        vt_layout = smem_tile_layout(self.dtype, d, bn, self.stages)   # V^T: kv contiguous
        o_layout = smem_tile_layout(self.out_dtype, bm, d)
        # with V given transposed (N contiguous), its (bn, d) boxes land as V^T's (d, bn) tile
        atoms, coords, self.q_bytes, kv_bytes = tma.make_qkv_loads(
            q, k, v, q_layout, kv_layout, bm, bn, d,
            v_layout=swap_modes(vt_layout))
        self.tile_bytes = kv_bytes // 2
        tma_o, o_coords = self.make_o_store(o, self.out_dtype)

        @cute.struct
        class SharedStorage:
            q_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            k_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            v_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            vt_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            item_barriers: cute.struct.MemRange[cutlass.Int64, 4]
            items: cute.struct.MemRange[cutlass.Int32, 8]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(kv_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, 8], 1024]   # (unused)
            sVt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(vt_layout)],
                                   1024]
            sO: cute.struct.Align[cute.struct.MemRange[self.out_dtype, cute.cosize(o_layout)],
                                  1024]
            sOnes: cute.struct.Align[cute.struct.MemRange[self.dtype, 8], 1024]   # (unused)

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        self.mbarriers = {"q": 2, "k": 2 * self.stages, "v": 2 * self.stages,
                          "vt": 2 * self.stages}
        seqlen, heads, batch = q.shape[0], q.shape[2], q.shape[3]
        self.kernel(*coords, o_coords, o, mDescaleQ, mDescaleK, mDescaleV, mLSE, mCounter,
                    *atoms, tma_o, scale_log2, q_layout, kv_layout, vt_layout, o_layout).launch(
            grid=self.scheduler.grid(seqlen, heads, batch),
            block=[self.threads, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mOut: cute.Tensor, mDescaleQ: cute.Tensor, mDescaleK: cute.Tensor,
               mDescaleV: cute.Tensor, mLSE: cute.Tensor, mCounter: cute.Tensor,
               tma_q: cute.CopyAtom, tma_k: cute.CopyAtom, tma_v: cute.CopyAtom,
               tma_o: cute.CopyAtom,
               scale_log2: Float32, q_layout: cute.ComposedLayout,
               kv_layout: cute.ComposedLayout, vt_layout: cute.ComposedLayout,
               o_layout: cute.ComposedLayout):
        schedule, roles = self.schedule, self.roles
        bm, bn, d = self.block_m, self.block_n, self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        group = mQ.shape[2] // mK.shape[2]
        if warp == 0:
            tma.prefetch_descriptors(tma_q, tma_k, tma_v, tma_o)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sK = storage.sK.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
        sVt = storage.sVt.get_tensor(vt_layout.outer, swizzle=vt_layout.inner)  # (d, bn, st)
        sV = transposed(sVt)                    # the TMA's view of the V^T ring: (bn, d, st)
        sO = storage.sO.get_tensor(o_layout.outer, swizzle=o_layout.inner)
        if cutlass.const_expr(self.wg_store):                   # one slab per warpgroup
            sO = wg_major_o_buffer(storage, self.out_dtype, self.warpgroups, self.head_dim)

        # stages released from lane 0 (the library's), not an elected lane as in k5 / k6:
        # the elected release lost 2.4% at d = 128 (results/h100/2026-11-25_k7_elect_release_d*)
        loads = tma.SplitKVLoads.create(storage, 4 * self.warpgroups, self.stages,
                                        self.q_bytes, self.tile_bytes,
                                        (tma_q, tma_k, tma_v), (mQ, mK, mV), (sQ, sK, sV),
                                        elect_release=False, spin_waits=self.spin_waits)
        pipeline.PipelineAsync.create(                  # (see TRANSPOSE_WARPS)
            barrier_storage=storage.vt_barriers.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     32 * TRANSPOSE_WARPS),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     roles.consumer_threads),
            defer_sync=True)
        queue = self.item_queue(storage, roles.consumer_threads)
        tma.barriers_ready()

        heads, batch_size, tiles, m_block, head, batch, valid = self.first_item(mQ, seqlen_k)
        if warp < 4:
            # ---------------- producer warpgroup ----------------
            roles.become_producer()
            if warp == 0:
                self.load_loop(loads, queue, mCounter, tiles, m_block, head, batch, valid,
                               seqlen_q, seqlen_k, heads, batch_size, group)
        else:
            # ---------------- consumer warpgroups 1..W ----------------
            roles.become_consumer()
            ctidx = tidx - 128
            wg = warp // 4 - 1
            mmas = wgmma.AttentionMmas.create(self.warpgroups, bm, bn, d, ctidx, sQ, sK, sVt,
                                              self.dtype, self.uniform_descriptors,
                                              vt_k_major=True,
                                              s_dtype=Float16 if self.s_f16 else Float32)
            acc_o = mmas.new_o_accumulator(bm, d)
            o_rc = acc_rows_cols(acc_o)
            if cutlass.const_expr(self.s_f16):
                softmax = OnlineSoftmaxF16.create(cute.size(mmas.s_coords, mode=[0]),
                                                  scale_log2, lanes_per_row=4,
                                                  p_scale_log2=self.p_scale_log2)
            else:
                softmax = OnlineSoftmax.create(cute.size(mmas.s_coords, mode=[0]), scale_log2,
                                               lanes_per_row=4, p_scale_log2=self.p_scale_log2,
                                               fence_after=self.softmax_fence_after,
                                               opaque_exp2=self.opaque_exp2)
            acc_s = mmas.new_s_accumulator(bm, bn)
            o_out = cute.make_rmem_tensor_like(acc_o, self.out_dtype)
            q_state = tma.consumer_state(1)
            k_state = tma.consumer_state(self.stages)
            v_state = tma.consumer_state(self.stages)
            item_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)
            has_items = valid            # (a CTA of a persistent grid may have none)
            if has_items:
                self.pingpong.start(wg)
            while valid:
                kv_head = head // group
                n_count = schedule.n_block_count_kv(m_block, seqlen_q, seqlen_k)
                acc_o.fill(0.0)
                softmax.reset()
                item_softmax = softmax.with_scale(
                    scale_log2 * mDescaleQ[batch, head] * mDescaleK[batch, kv_head])
                phase = self.trace.start("wait_q")
                loads.wait_q(q_state)
                self.trace.end(phase)
                k_state, v_state = self.mainloop(
                    loads, wg, m_block, n_count, seqlen_q, seqlen_k, mmas.mma_qk,
                    mmas.mma_pv, mmas.q_frag, mmas.k_frag, mmas.vt_frag, mmas.p_frag, acc_s,
                    acc_o, mmas.s_coords, item_softmax, k_state, v_state)
                if cutlass.const_expr(not self.early_q_release):   # (else: the main loop's)
                    loads.q_pipe.consumer_release(q_state)  # O has its own buffer
                q_state.advance()

                phase = self.trace.start("epilogue")
                # Epilogue: O * descale_v / l -> bf16 -> SMEM -> one TMA store. An e4m3
                # output (out_fp8) stays in v8's units, O / l: |O / l| <= max |v8| = 448
                # (a convex combination of v8's rows; cvt saturates what P's rounding
                # adds), and its descale is descale_v's (`output_descale`).
                inv_sum = self.finish_rows(item_softmax, mmas, ctidx, mLSE, m_block, head,
                                           batch, seqlen_q)
                if cutlass.const_expr(self.out_dtype.width == 16):
                    descale_v = mDescaleV[batch, kv_head]
                    for r in cutlass.range_constexpr(cute.size(inv_sum)):
                        inv_sum[r] = inv_sum[r] * descale_v
                scale_rows(o_rc, inv_sum)
                o_out.store(acc_o.load().to(self.out_dtype))
                self.store_output(mmas, ctidx, warp, o_out, mOut, sO, tma_o, mO, m_block,
                                  head, batch, seqlen_q)
                self.trace.end(phase)
                phase = self.trace.start("next_item")
                tiles, item_state, m_block, head, batch, valid = self.next_item(
                    queue, item_state, tiles, seqlen_q, heads, batch_size, seqlen_k)
                self.trace.end(phase)
            if has_items:
                self.pingpong.drain(wg)
            self.drain_o_store(warp)

    @cute.jit
    def probs_to_operand(self, acc_s: cute.Tensor, p_frag: cute.Tensor,
                         reverse: cutlass.Constexpr = False):
        # (k6's reverse_p: not for the FP8 operand)
        probs_to_fp8_operand(acc_s, p_frag)


# (head_dim, causal, settings, why, results): POLICY's row for the problem's head dim and
# mask; longest_first (MiB per head group) applies to query lengths 2k-8k only. The tiles
# follow s_f16 (TILES, TILES_S_F16); k6's settings k7 leaves fixed: no turns, eager or
# before_pv rescale, lane-0 releases, sleeping waits, no stream-K, no peeled first tile.
H100, H200 = "results/h100/2026-11-", "results/h200/2026-11-"
BASE = dict(pv_wait="pinned", rescale="eager", item_end="own_buffer_wg", v_lags_k=True,
            longest_first=0, s_f16=False)
POLICY = [
    (64, False, dict(), "fp32 scores: the 256-wide tile has the registers already",
     H200 + "28_k7_s_f16_*.json"),
    (64, True, dict(), "as without a mask", H200 + "28_k7_s_f16_*.json"),
    (128, False, dict(s_f16=True, item_end="own_buffer"),
     "fp16 scores pay for 256-wide kv tiles; the item-end options lost 1.7% at 16k",
     H100 + "26_k7_item_end*.json"),
    (128, True, dict(s_f16=True, longest_first=32), "fp16 scores, longest items first",
     H100 + "26_k7_longest_first_d*.json"),
    (256, False, dict(s_f16=True, rescale="before_pv"),
     "O rescaled under the QK GEMM: +1.8-4.3%", H100 + "26_k7_rescale_before_pv*.json"),
    (256, True, dict(pv_wait="after8", v_lags_k=False, longest_first=32),
     "the PV wait after 8 exp2s (+3.5-12.9%); fp16 scores would lose that fence",
     H100 + "26_k7_pv_wait_after*.json"),
]
LONGEST_FIRST_LENGTHS = (2048, 8192)
OPTIONS = ("tile", "pv_wait", "rescale", "item_end", "v_lags_k", "longest_first", "s_f16")


def settings_for(problem, **overrides) -> dict:
    """FlashAttentionK7's settings for `problem`: its POLICY row, then `overrides` (None:
    the row's), the tile of TILES / TILES_S_F16 unless `tile` is given."""
    unknown = sorted(set(overrides) - set(OPTIONS))
    if unknown:
        raise ValueError(f"k7: unknown options {unknown}; known: {', '.join(OPTIONS)}")
    row = next((settings for d, causal, settings, _why, _results in POLICY
                if d == problem.head_dim and causal == problem.causal), None)
    if row is None:
        raise ValueError(f"k7: no policy row for d = {problem.head_dim}")
    settings = {**BASE, **row}
    lo, hi = LONGEST_FIRST_LENGTHS
    if not lo <= problem.seqlen <= hi:
        settings["longest_first"] = 0
    settings.update({k: v for k, v in overrides.items() if v is not None})
    settings["block_m"], settings["block_n"], settings["stages"] = \
        (TILES_S_F16 if settings["s_f16"] else TILES)[problem.head_dim]
    tile = settings.pop("tile", None)              # "128x128" (block_m x block_n)
    if tile is not None:
        settings["block_m"], settings["block_n"] = (int(x) for x in str(tile).split("x"))
    return settings


def compile_kernel(problem, *, compile_options: str = "", out_fp8: bool = False,
                   trace: bool = False, spec: KernelSpec = SPEC, **overrides):
    """Compile (or fetch from the cache) k7 with POLICY's settings for the problem's head dim
    and mask, any of OPTIONS overridden (k6's tile, pv_wait, rescale ("eager"
    or "before_pv"), item_end ("own_buffer" or "own_buffer_wg"), v_lags_k, longest_first;
    s_f16: S accumulated in fp16, the softmax on fp16 pairs, with TILES_S_F16's tiles; needs
    q and k from `prepare_inputs` / `quantize_qk_f16_scores`). out_fp8: the output in e4m3
    instead of bf16 (O / descale_v, so that `output_descale` gives its descale; `run_kernel`
    then takes an e4m3 `out`). trace: iket phase ranges. `spec`: the stage the kernel is
    compiled for (k8 runs this kernel under its own name)."""
    spec.check(problem)                 # UnsupportedProblem before POLICY's lookup
    spec = dataclasses.replace(spec, v_seq_major=True)
    if out_fp8:
        spec = dataclasses.replace(spec, output_dtype=FP8)
    return compile_attention(spec, FlashAttentionK7, problem,
                             {**settings_for(problem, **overrides), "trace": bool(trace)},
                             workspace_fn=lse_buffer, compile_options=compile_options)


def prepare_inputs(q, k, v, rotate_signs=None, s_f16: Optional[bool] = None,
                   softmax_scale: Optional[float] = None, **_options):
    """bf16 q, k, v -> (q8, k8, v8, descale_q, descale_k, descale_v) for `run_kernel`
    (per (batch, head) amax scaling; outside the timed region in bench.py). v8 packed for
    the kernel's V^T ring (`quantize_fp8(v, pack_v=True)`: sequence-major, keys permuted
    within 16). `rotate_signs`: q and k rotated first (k8). `s_f16` (None: at the head
    dims where POLICY has it):
    q and k scaled for fp16 scores (`quantize_qk_f16_scores`; the kernels without s_f16 take
    them too), for `softmax_scale` (None: 1 / sqrt(head_dim))."""
    d = q.shape[-1]
    if s_f16 is None:
        s_f16 = any(row[2].get("s_f16") for row in POLICY if row[0] == d)
    if s_f16:
        scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
        q8, k8, descale_q, descale_k = quantize_qk_f16_scores(q, k, scale,
                                                              rotate_signs=rotate_signs)
    else:
        q8, k8, descale_q, descale_k = quantize_fp8(q, k, rotate_signs=rotate_signs)
    v8, descale_v = quantize_fp8(v, pack_v=True)
    return q8, k8, v8, descale_q, descale_k, descale_v


def logical_inputs(q8, k8, v8, **_options):
    """The inverse of `prepare_inputs`' packing: q8, k8, v8 as (batch, seqlen, heads, d)."""
    return q8, k8, unpack_v(v8, k8.shape[1])


def output_descale(descale_v: torch.Tensor, heads: int) -> torch.Tensor:
    """The (batch, heads) descale of an e4m3 output (`out_fp8`): O = out8 * descale_o.
    The kernel writes O / descale_v, so it is v's descale, repeated over each k/v head's
    group of query heads."""
    return descale_v.repeat_interleave(heads // descale_v.shape[1], dim=1)


def run_kernel(handle, q8, k8, v8, descale_q, descale_k, descale_v, out):
    """out = attention of the dequantized inputs. With fp16 scores (`handle.options["s_f16"]`,
    the default at d = 128 and 256) q8 and k8 must come from `prepare_inputs` or
    `quantize.quantize_qk_f16_scores`: q and k scaled to e4m3's full range overflow fp16
    (`quantize.check_f16_scores` checks FP8 inputs made elsewhere, once: it syncs)."""
    run_attention(handle, q8, k8, v8, out, extra_inputs=(descale_q, descale_k, descale_v))
