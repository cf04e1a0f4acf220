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
* Scores in fp16 (`s_f16`, S_F16: d = 128, and d = 256 without a mask): the QK WGMMA
  accumulates S in fp16 (same rate), two scores per register, and the softmax runs on pairs
  (common/softmax.py `OnlineSoftmaxF16`: HMNMX2, HADD2 / HFMA2, ex2.approx.f16x2, HADD2
  row sums). Per score about as many instructions as in fp32 (each packed exp2 pair needs a
  PRMT), but half of S's registers, which at d = 128 pay for 256-wide kv tiles
  (TILES_S_F16): +3.6-10.3% there, +5% at d = 256. Option `row_sums_mma`: P's row sums
  from the tensor cores (an m64n8k32 WGMMA of P against a tile of ones in each PV batch,
  wgmma.PWithRowSums, added to l on the CUDA cores per tile) and the row offset in one
  HFMA2: 880 instead of 1,072 instructions a tile, +0.3-2.4% (H200), but l sums P after
  e4m3's rounding and the LSE's error grows tenfold, so off (docs/k7.md "Row sums on the
  tensor cores"). The
  quantizer must keep every q8 . k8 within fp16's range and make the scores' factor a power
  of two (`prepare_inputs` does, `quantize.quantize_qk_f16_scores`); q and k scaled to 448
  by `quantize_fp8` alone would overflow: run those with `s_f16=0` (docs/k7.md "Scores in
  fp16").
* A narrow last kv tile (`tail_n`, TAIL_N; fp32 scores only): at d = 128 without a mask,
  below 8k keys, where
  the 192-wide tile cuts the key length (4k: 21 1/3 tiles), an item's last tile runs after
  the loop with its softmax and its PV on only the keys there are: +5-6% at 1k, +1.2-1.4%
  at 4k (docs/k7.md "Where the phases line up, and a narrow last kv tile").

What stays: k6's consumer loop (`mainloop`: QK issued before the softmax, PV of the previous
tile under it; no late PV wait, which costs FP8 2-7%, but a memory fence in front of the PV
wait, `pin_pv_wait`, so that ptxas keeps the softmax under PV in the same iteration: +1-5%
measured; docs/k7.md; at d = 256 with a mask k6's `pv_wait_after` instead, the wait held after
the tile's 8th exp2: +3.5-12.9%, PV_WAIT_AFTER below; at d = 256 without one O rescaled
under the QK GEMM, `rescale_before_pv`: +3.5-4.3%, RESCALE_BEFORE_PV),
its register split (producer 24, consumers 240), the producer warp's TMA loads, the
persistent scheduler, tails, causal skipping, the (B, N, H, d) layout of q, k and the output,
GQA, cross-attention and strided q / k. No ping-pong between the consumer warpgroups (with
GEMMs half as long, taking turns costs more than it saves).

Option `v_transposed=False` (docs/k7.md, rule 1 of "What changes from k6"): V in the plain
(B, N, H, d) layout, transposed inside the kernel by producer warps 1-2 (ldmatrix.trans,
byte permutes, stmatrix) from a raw V ring into the V^T ring; 56 / 224 registers, the
smaller tiles of TILES_IN_KERNEL_TRANSPOSE; 6-44% slower at d = 128 and 256 (the in-kernel
transpose is what limited d = 256).

Budget, d = 128 (fp16 scores, 128 x 256 tiles, 2 stages): 384 threads; SMEM = Q 16 KiB + K
and V^T rings 2 x 2 x 32 KiB + O 32 KiB = 176 KiB (+ barriers; row_sums_mma: + 2 KiB of
ones). Registers per consumer thread: S 64 (128 fp16 scores) + P 32 + O 64 fp32. With fp32
scores (`s_f16=0`, 128 x 192, 3 stages): Q 16 + 2 x 3 x 24 + O 32 = 192 KiB; S 96 + P 24 +
O 64. d = 64: 128 x 256, 3 stages: Q 8 + 2 x 3 x 16 + O 16 = 120 KiB. d = 256: 128 x 128, 2 stages: Q 32 + 2 x 2 x 32 +
O 64 = 224 KiB (row_sums_mma without a mask: + 1 KiB of ones).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import torch
from cutlass import Float16, Float32, Int32

from hopper_attn.common import tma, wgmma
from hopper_attn.common.contract import (KernelSpec, check_tail_keys, check_whole_kv_tiles,
                                         compile_attention, narrow_tail,
                                         run_attention)
from hopper_attn.common.fp8 import VTranspose, check_row_period, probs_to_fp8_operand
from hopper_attn.common.layouts import (acc_rows_cols, ndhb_view, smem_bytes, smem_tile_layout,
                                        swap_modes, transposed)
from hopper_attn.common.scheduler import longest_first_default
from hopper_attn.common.softmax import OnlineSoftmax, OnlineSoftmaxF16, scale_rows
from hopper_attn.common.warp_roles import WarpRoles
from hopper_attn.k5 import lse_buffer, wg_major_o_buffer
from hopper_attn.k6 import FlashAttentionK6
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

# row_sums_mma: four e4m3 ones (0x38) per word, and the consumers' barrier after writing them
E4M3_ONE_X4 = 0x38383838
ONES_BARRIER = 14
P_SCALE_LOG2 = 8                 # P in [0, 256]: e4m3 keeps 3 mantissa bits down to 2^-6
LAZY_THRESHOLD_LOG2 = 1.8        # with lazy rescaling (P scaled 2^7): P < 2^8.8 < 448
TRANSPOSE_WARPS = 2              # producer warps 1 .. 2
# head_dim -> (block_m, block_n, ping-pong, stages), measured on the H100 round-robin against
# cuDNN FP8 (results/h100/2026-11-23_k7_tiles_v_packed.json, docs/k7.md). With V packed in
# memory only the K and V^T rings take SMEM, so the kv tiles grow: 192 wide at d = 128
# (+2-6% over 128; 224: no faster, and its causal variant spills), 128 at d = 256 (+20-25%
# over 64); no ping-pong (-1..-3% with it: FP8's GEMMs are too short to take turns for).
TILES = {64: (128, 256, False, 3), 128: (128, 192, False, 3), 256: (128, 128, False, 2)}
# with the in-kernel transpose (v_transposed=False) the raw V ring takes its share of SMEM
# (results/h100/2026-11-23_k7_variants.json, _k7_block_n.json, _k7_d64_stages.json): without
# ping-pong +1-3% at d128 and +4-11% at d64; three stages +4-7% at d128; 256-wide kv tiles
# +6-17% at d64; d = 256: Q 32 + 2 stages x (K, V, V^T) 3 x 16 + O 64 = 192 KiB.
TILES_IN_KERNEL_TRANSPOSE = {64: (128, 256, False, 3), 128: (128, 128, False, 3),
                             256: (128, 64, False, 2)}
PRODUCER_CONSUMER_REGS = {1: (56, 256), 2: (56, 224), 3: (32, 160)}   # after setmaxnreg
# (head_dim, causal) where S is accumulated in fp16 and its softmax runs in fp16 pairs
# (`s_f16`; docs/k7.md "Scores in fp16"), with the kv tiles of TILES_S_F16: S takes half the
# registers, so d = 128 affords 256-wide kv tiles (2 stages to fit SMEM). Round-robin against
# the fp32 default with cuDNN FP8 in the run, H200 (results/h200/2026-11-28_k7_s_f16_*.json),
# gain in time at N = 1k / 2k / 4k / 8k / 16k: d = 128 full +10.3 / +7.6 / +6.2 / +4.1 / +3.6%,
# causal +5.3 / +4.4 / +5.0 / +4.6 / +3.9%; d = 256 full +5.0 / +5.1% at 4k / 16k (default
# tiles). Off: d = 64 (-5 / -5% full, -2 / -3% causal: its 256-wide tile already has the
# registers) and d = 256 causal (-7 / -11%: it gives up PV_WAIT_AFTER's fence).
S_F16 = {(128, False), (128, True), (256, False)}
TILES_S_F16 = {128: (128, 256, False, 2)}


def default_tiles(v_transposed: bool, s_f16: bool) -> dict:
    """head_dim -> (block_m, block_n, ping-pong, stages) for V packed in memory or transposed
    in the kernel, with fp32 or fp16 scores."""
    tiles = TILES if v_transposed else TILES_IN_KERNEL_TRANSPOSE
    return {**tiles, **TILES_S_F16} if s_f16 else tiles


class FlashAttentionK7(FlashAttentionK6):
    # the masked tile with one key limit per row: without it the 128-wide kv tile at d = 256
    # spills 76 bytes with a causal mask (docs/k7.md)
    mask_per_row = True

    def __init__(self, head_dim: int, causal: bool, block_m: int = 0, block_n: int = 0,
                 pingpong: Optional[bool] = None, stages: int = 0, transpose_batch: int = 1,
                 fma_exp2_every: int = 0, direct_store: bool = False,
                 wait_pv_late: bool = False, v_transposed: bool = True,
                 pin_pv_wait: bool = True, elect_release: bool = False,
                 defer_store_wait: bool = False, s_f16: bool = False,
                 exact_offset: bool = False, row_sums_mma: bool = False, **options):
        # stages released from an elected lane (k5/k6's default, common/tma.py); off here:
        # against the library's lane-0 release in one run, -2.4/-2.5% at d = 128 without a
        # mask, 0 to -0.6% at d = 64 and 128 causal, +0.8/+1.5% only at d = 256 without one
        # (results/h100/2026-11-25_k7_elect_release_d*.json, docs/k7.md)
        self.elect_release = bool(elect_release)
        default_m, default_n, default_pingpong, default_stages = \
            default_tiles(v_transposed, s_f16)[head_dim]
        self.direct_store = direct_store        # (read by smem_estimate, during __init__)
        self.row_sums_mma = bool(row_sums_mma)  # (likewise)
        # V arrives transposed in global memory (sequence-major, from prepare_inputs): the
        # TMA loads V^T tiles straight into the V^T ring and no warp transposes
        self.v_transposed = v_transposed
        super().__init__(head_dim, causal, block_m or default_m, block_n or default_n,
                         pingpong=default_pingpong if pingpong is None else bool(pingpong),
                         stages=stages or default_stages, wait_pv_late=wait_pv_late,
                         pin_pv_wait=pin_pv_wait, fma_exp2_every=fma_exp2_every,
                         direct_store=direct_store, **options)
        self.transpose = VTranspose(self.block_n, head_dim, TRANSPOSE_WARPS, transpose_batch)
        if self.cluster > 1 and not v_transposed:
            raise ValueError("cluster: with V packed (v_transposed=1) only")
        if self.stream_k and row_sums_mma:
            raise ValueError("row_sums_mma: not with stream_k (its pieces merge l in fp32)")
        if self.stream_k and not v_transposed:
            raise ValueError("stream_k: with V packed (v_transposed=1) only; the transposing "
                             "warps walk whole items")
        # k6's option (O has its own buffer here): the store's read waited for at the next
        # item's epilogue
        self.defer_store_wait = bool(defer_store_wait) and not direct_store
        # lazy rescaling lets P reach 2^(p_scale_log2 + threshold) <= 448 (e4m3's largest)
        self.p_scale_log2 = P_SCALE_LOG2 - 1 if self.lazy_rescale else P_SCALE_LOG2
        self.rescale_threshold_log2 = LAZY_THRESHOLD_LOG2
        # S accumulated in fp16 and its softmax in fp16 pairs (OnlineSoftmaxF16); the
        # one-step softmax only (no lazy rescaling, exp2s on the FMA pipe or fences in it)
        self.s_f16 = bool(s_f16)
        # fp16 scores: x = s c - ref in one instruction per pair (OnlineSoftmaxF16.one_fma),
        # or (s - m) c + p_scale_log2 in two, exact at the row maximum (`exact_offset`, and
        # always without row_sums_mma: the one-HFMA2 row maximum's P takes e4m3's rounding,
        # which l must then share; with fp16 sums a single key's row came out at 2.33x
        # torch's bf16 error, results/h200/2026-11-28_ref_check_k7_one_fma_quick.json)
        self.exact_offset = bool(exact_offset)
        # P's row sums by the tensor cores (wgmma.PWithRowSums: l += P 1 in each PV batch,
        # against a tile of ones in SMEM) instead of HADD2s: fp16 scores only
        if self.row_sums_mma and not self.s_f16:
            raise ValueError("row_sums_mma: with s_f16 only")
        if self.s_f16 and (self.lazy_rescale or fma_exp2_every or self.softmax_fence_after >= 0
                           or self.opaque_exp2 or self.s_ahead or self.pv_wait_first
                           or self.exp_first or self.exp_turns.enabled):
            raise ValueError("s_f16: with the one-step softmax only (no lazy_rescale, "
                             "fma_exp2_every, pv_wait_after, pv_wait_first, exp_first, "
                             "exp_turns or s_ahead)")
        # the transposing warps need more than k6's 24 registers (ptxas spills at 24); with
        # V transposed in memory there are none, and k6's split (24 / 240) applies
        if not v_transposed:
            self.roles = WarpRoles.create(self.warpgroups, PRODUCER_CONSUMER_REGS[self.warpgroups])

    def o_apart_from_q(self) -> bool:
        return not self.direct_store            # O's buffer is always its own here

    def smem_estimate(self, head_dim: int, block_m: int, block_n: int, stages: int) -> int:
        """e4m3 Q, K, V and V^T rings, the bf16 output buffer (unless O is stored straight
        from registers), 1 KiB of mbarriers; each buffer 1024-byte aligned."""
        o_bytes = 0 if self.direct_store else smem_bytes(block_m * head_dim * 2)
        rings = 2 if self.v_transposed else 3                   # K, V^T (and raw V)
        ones_bytes = smem_bytes(wgmma.ROW_SUM_COLUMNS * block_n) if self.row_sums_mma else 0
        return (1024 + smem_bytes(block_m * head_dim)
                + rings * smem_bytes(stages * block_n * head_dim) + o_bytes + ones_bytes)

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
        check_row_period(kv_layout, bn, d)
        check_row_period(vt_layout, d, bn)
        # with V given transposed (N contiguous), its (bn, d) boxes land as V^T's (d, bn) tile
        atoms, coords, self.q_bytes, kv_bytes = tma.make_qkv_loads(
            q, k, v, q_layout, kv_layout, bm, bn, d,
            v_layout=swap_modes(vt_layout) if self.v_transposed else None,
            multicast=self.kv_multicast)
        self.tile_bytes = kv_bytes // 2
        v_elems = 8 if self.v_transposed else cute.cosize(kv_layout)    # no raw V ring
        tma_o, o_coords = self.make_o_store(o, self.out_dtype)
        o_elems = 8 if self.direct_store else cute.cosize(o_layout)    # no staging buffer
        ones_elems = wgmma.ROW_SUM_COLUMNS * bn if self.row_sums_mma else 8

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
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, v_elems], 1024]
            sVt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(vt_layout)],
                                   1024]
            sO: cute.struct.Align[cute.struct.MemRange[self.out_dtype, o_elems], 1024]
            sOnes: cute.struct.Align[cute.struct.MemRange[self.dtype, ones_elems], 1024]

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
            **self.cluster_launch(),
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
        if cutlass.const_expr(self.v_transposed):
            sV = transposed(sVt)                # the TMA's view of the V^T ring: (bn, d, st)
        else:
            sV = storage.sV.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
        sO = storage.sO.get_tensor(o_layout.outer, swizzle=o_layout.inner)
        if cutlass.const_expr(self.wg_store):                   # one slab per warpgroup
            sO = wg_major_o_buffer(storage, self.out_dtype, self.warpgroups, self.head_dim)

        # the raw V ring's consumers are the transposing warps; V^T's, the consumer threads
        transpose_warps = 0 if self.v_transposed else TRANSPOSE_WARPS
        loads = tma.SplitKVLoads.create(storage, 4 * self.warpgroups, self.stages,
                                        self.q_bytes, self.tile_bytes,
                                        (tma_q, tma_k, tma_v), (mQ, mK, mV), (sQ, sK, sV),
                                        v_consumer_warps=transpose_warps,
                                        elect_release=self.elect_release,
                                        spin_waits=self.spin_waits,
                                        cluster=self.kv_multicast)
        vt_pipe = pipeline.PipelineAsync.create(
            barrier_storage=storage.vt_barriers.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     32 * TRANSPOSE_WARPS),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     roles.consumer_threads),
            defer_sync=True)
        # the transposing warps walk the work items too
        queue = self.item_queue(storage, roles.consumer_threads + 32 * transpose_warps)
        tma.barriers_ready(self.cluster)

        heads, batch_size, tiles, m_block, head, batch, valid = self.first_item(mQ, seqlen_k)
        if warp < 4:
            # ---------------- producer warpgroup ----------------
            roles.become_producer()
            if warp == 0:
                self.load_loop(loads, queue, mCounter, tiles, m_block, head, batch, valid,
                               seqlen_q, seqlen_k, heads, batch_size, group)
            else:
                if cutlass.const_expr(not self.v_transposed):
                    if warp <= TRANSPOSE_WARPS:
                        self.transpose_loop(loads, vt_pipe, queue, storage, kv_layout,
                                            vt_layout, warp, tiles, m_block, head, batch,
                                            valid, seqlen_q, seqlen_k, heads, batch_size)
        else:
            # ---------------- consumer warpgroups 1..W ----------------
            roles.become_consumer()
            ctidx = tidx - 128
            wg = warp // 4 - 1
            sOnes = None
            if cutlass.const_expr(self.row_sums_mma):
                sOnes = self.ones_tile(storage, ctidx)
            mmas = wgmma.AttentionMmas.create(self.warpgroups, bm, bn, d, ctidx, sQ, sK, sVt,
                                              self.dtype, self.uniform_descriptors,
                                              vt_k_major=True,
                                              s_dtype=Float16 if self.s_f16 else Float32,
                                              sOnes=sOnes)
            acc_o = mmas.new_o_accumulator(bm, d)
            o_rc = acc_rows_cols(acc_o)
            if cutlass.const_expr(self.s_f16):
                softmax = OnlineSoftmaxF16.create(cute.size(mmas.s_coords, mode=[0]),
                                                  scale_log2, lanes_per_row=4,
                                                  p_scale_log2=self.p_scale_log2,
                                                  one_fma=(self.row_sums_mma
                                                           and not self.exact_offset),
                                                  sums_in_mma=self.row_sums_mma)
            else:
                softmax = OnlineSoftmax.create(cute.size(mmas.s_coords, mode=[0]), scale_log2,
                                               lanes_per_row=4, p_scale_log2=self.p_scale_log2,
                                               fma_exp2_every=self.fma_exp2_every,
                                               fence_after=self.softmax_fence_after,
                                               opaque_exp2=self.opaque_exp2)
            acc_s = mmas.new_s_accumulator(bm, bn)
            o_out = cute.make_rmem_tensor_like(acc_o, self.out_dtype)
            # the consumers see V^T's ring where k6 has V's (the TMA's own, when V arrives
            # transposed)
            consumer_loads = loads if cutlass.const_expr(self.v_transposed) \
                else loads.with_v_pipe(vt_pipe)
            q_state = tma.consumer_state(1)
            k_state = tma.consumer_state(self.stages)
            v_state = tma.consumer_state(self.stages)
            item_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)
            has_items = valid            # (a CTA of a persistent grid may have none)
            if has_items:
                self.start_turns(wg)
            while valid:
                kv_head = head // group
                n_count = schedule.n_block_count_kv(m_block, seqlen_q, seqlen_k)
                k0, k1 = 0, n_count                     # (stream_k: a piece of the item)
                if cutlass.const_expr(self.stream_k):
                    _, _, k0, k1 = self.scheduler.piece(tiles, seqlen_q, seqlen_k, heads,
                                                        batch_size)
                acc_o.fill(0.0)
                if cutlass.const_expr(self.row_sums_mma):
                    mmas.p_frag.reset()
                softmax.reset()
                item_softmax = softmax.with_scale(
                    scale_log2 * mDescaleQ[batch, head] * mDescaleK[batch, kv_head])
                phase = self.trace.start("wait_q")
                loads.wait_q(q_state)
                self.trace.end(phase)
                k_state, v_state = self.mainloop(
                    consumer_loads, wg, m_block, k1 - k0, seqlen_q, seqlen_k, mmas.mma_qk,
                    mmas.mma_pv, mmas.q_frag, mmas.k_frag, mmas.vt_frag, mmas.p_frag, acc_s,
                    acc_o, mmas.s_coords, item_softmax, k_state, v_state, n_base=k0)
                if cutlass.const_expr(not self.early_q_release):   # (else: the main loop's)
                    loads.q_pipe.consumer_release(q_state)  # O has its own buffer
                q_state.advance()

                ends_item = True
                if cutlass.const_expr(self.stream_k):       # (k6's split items)
                    ends_item = self.end_piece(mCounter, ctidx, wg, acc_o, item_softmax, k0,
                                               k1, n_count)
                phase = self.trace.start("epilogue")
                if ends_item:
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
                self.drain_turns(wg)
            self.drain_o_store(warp)

    @cute.jit
    def transpose_loop(self, loads: tma.SplitKVLoads, vt_pipe, queue, storage, kv_layout,
                       vt_layout, warp, tiles, m_block, head, batch, valid, seqlen_q,
                       seqlen_k, heads, batch_size):
        """Producer warps 1..TRANSPOSE_WARPS: every V tile of every work item, from the raw
        V ring into the V^T ring."""
        schedule = self.schedule
        v_state = tma.consumer_state(self.stages)
        vt_state = tma.producer_state(self.stages)
        item_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)
        src, dst, steps = self.transpose.addresses(storage.sV.data_ptr(), kv_layout,
                                                   storage.sVt.data_ptr(), vt_layout,
                                                   warp - 1, cute.arch.lane_idx())
        while valid:
            n_count = schedule.n_block_count_kv(m_block, seqlen_q, seqlen_k)
            for n in cutlass.range(n_count, unroll=1):
                loads.v_pipe.consumer_wait(v_state)       # V_n has landed
                vt_pipe.producer_acquire(vt_state)        # its V^T stage is free
                phase = self.trace.start("transpose")
                self.transpose.stage(src, dst, steps, v_state.index)
                self.trace.end(phase)
                cute.arch.fence_proxy("async.shared", space="cta")  # for the WGMMAs
                vt_pipe.producer_commit(vt_state)
                loads.v_pipe.consumer_release(v_state)    # TMA may refill it
                v_state.advance()
                vt_state.advance()
            tiles, item_state, m_block, head, batch, valid = self.next_item(
                queue, item_state, tiles, seqlen_q, heads, batch_size)

    @cute.jit
    def probs_to_operand(self, acc_s: cute.Tensor, p_frag: cute.Tensor,
                         reverse: cutlass.Constexpr = False):
        # (k6's reverse_p: not for the FP8 operand)
        probs_to_fp8_operand(acc_s, wgmma.pv_operand(p_frag))

    @cute.jit
    def ones_tile(self, storage, ctidx):
        """The (8, block_n) e4m3 tile of ones that `row_sums_mma`'s WGMMA multiplies P by,
        written once by the consumer warpgroups (the same byte everywhere, so its swizzle
        does not matter), fenced for the tensor cores' async proxy, then a barrier of the
        consumers."""
        layout = smem_tile_layout(self.dtype, wgmma.ROW_SUM_COLUMNS, self.block_n)
        words = cute.recast_tensor(storage.sOnes.get_tensor(cute.make_layout(
            wgmma.ROW_SUM_COLUMNS * self.block_n)), Int32)
        threads = 128 * self.warpgroups
        for i in cutlass.range_constexpr(cute.size(words) // threads):
            words[ctidx + i * threads] = Int32(E4M3_ONE_X4)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=ONES_BARRIER, number_of_threads=threads)
        return storage.sOnes.get_tensor(layout.outer, swizzle=layout.inner)


# head_dim -> (MiB per group by k6's bf16 formula, shortest and longest query length) at which
# the dynamic schedule takes its work items head group by head group, longest first (k6's
# `longest_first`), with a causal mask: round-robin on the H100
# (results/h100/2026-11-26_k7_longest_first_d*.json), N = 2k / 4k / 8k / 16k: d = 128 +1.0 /
# +3.8 / +3.6 / -0.6%, d = 256 +6.1 / +8.3 / +8.9 / -0.6% (d = 64 not measured: off)
LONGEST_FIRST = {128: (32, 2048, 8192), 256: (32, 2048, 8192)}
# (head_dim, causal) -> n: k6's `pv_wait_after` (the PV wait after the tile's n-th exp2, held
# there by a fence, instead of after all of them behind `pin_pv_wait`'s fence), with V
# released without a branch. Round-robin against the pinned wait with cuDNN FP8 in the run
# (results/h100/2026-11-26_k7_pv_wait_after*.json): d = 256 causal, n = 8, +3.5 / +5.7 / +8.4
# / +9.8 / +12.9% at N = 1k / 2k / 4k / 8k / 16k (n = 12 alike); d = 256 full -0.3-2.3%,
# d = 128 -1-9%, d = 64 -2-10%: off there
PV_WAIT_AFTER = {(256, True): 8}
# head_dim -> kv tile for `s_ahead` (two S accumulators must fit next to O and P in 240
# registers: S 2 x 64 at d = 64 and 128, 2 x 32 at d = 256; the default tiles spill)
S_AHEAD_BLOCK_N = {64: 128, 128: 128, 256: 64}
# (head_dim, causal) where O is rescaled between the QK and the PV issue, under QK (k6's
# `rescale_before_pv`; k7's PV wait is pinned in the iteration, so nothing serializes).
# Round-robin against the default with cuDNN FP8 in the run, H100
# (results/h100/2026-11-26_k7_rescale_before_pv*.json): d = 256 full +3.5 / +4.3% at N = 4k /
# 16k, and in a second run +1.8 / +2.9 / +3.7 / +3.8 / +4.2% at 1k / 2k / 4k / 8k / 16k
# (`_d256_confirm.json`); d = 256 causal (with PV_WAIT_AFTER's wait) -4.4 / -6.4%, d = 128
# full -1.1 / -1.5%, causal a tie; d = 64 +0.4 / +1.0% full, -0.6 / +0.9% causal (one run,
# `_d64.json`): off there
RESCALE_BEFORE_PV = {(256, False)}
# k6's `early_q_release` and `wg_store` together (docs/k6.md "Where a work item ends"): on
# for these (head_dim, causal). Round-robin against the defaults without them, cuDNN FP8 in
# the run, H100 (results/h100/2026-11-26_k7_item_end*.json), gain in time at N = 1k / 4k /
# 16k: d = 64 +10.5 / +3.2 / +0.7%, with a mask +12.2 / +6.5 / +1.9%; d = 256 +2.5 / +1.5 /
# +0.2%, with a mask +7.6 / +3.8 / +1.3%; d = 128 with a mask +2.5 / +2.5 / +0.4%; d = 128
# without one +1.0 / 0.0 / -1.7%: off there. (early_q_release alone: -1.5 to +2.4%.)
ITEM_END = {(64, False), (64, True), (128, True), (256, False), (256, True)}
# head_dim -> the key length from which an item no longer ends in a narrow kv tile (`tail_n`,
# an option of k6's loop; without a mask): below it, where the key length is no multiple of the kv tile,
# the item's last tile (after the loop) exponentiates and multiplies into O only the keys
# there are, rounded up to 32. Only d = 128's 192-wide tile leaves a partial tile at the
# usual lengths (4k: 21 1/3 tiles). Round-robin against the whole last tile, H100, two runs
# (results/h100/2026-11-26_k7_tail_n*.json), gain in time at N = 1k / 2k / 4k / 8k / 16k:
# +5.7 / +0.3 / +1.2 / -1.0 / -1.0% and +5.3 / +1.0 / +1.3 / -1.0 / -1.0%; a third run with
# cuDNN FP8 (_vs_cudnn_fp8.json) +6.4 / +0.8 / +1.4% at 1k / 2k / 4k. Its QK narrowed
# too (a WGMMA of N = tail_n into S's first registers): -7.6 / -19.1 / -22.0% at 1k / 4k / 16k,
# not kept; narrowing inside the loop (a branch on the last tile): +3.9 / -0.2 / -2.9 / -7.8
# / -5.7%, not kept
TAIL_N = {128: 8192}


def compile_kernel(problem, *, compile_options: str = "", block_m: int = 0,
                   block_n: int = 0, stages: int = 0, pingpong: Optional[bool] = None,
                   persistent: bool = True, persistent_ctas: int = 0,
                   dynamic: Optional[bool] = None, trace: bool = False,
                   transpose_batch: int = 1, fma_exp2_every: int = 0, stmatrix_o: bool = True,
                   direct_store: bool = False, wait_pv_late: bool = False,
                   lazy_rescale: bool = False, v_transposed: bool = True,
                   exp_turns: bool = False, pin_pv_wait: bool = True,
                   v_lags_k: Optional[bool] = None, elect_release: bool = False,
                   spin_waits: bool = False, longest_first: Optional[bool] = None,
                   group_mib: int = 0, pv_wait_after: Optional[int] = None,
                   v_release_last: Optional[bool] = None,
                   rescale_before_pv: Optional[bool] = None, s_ahead: bool = False,
                   defer_store_wait: bool = False, early_q_release: Optional[bool] = None,
                   wg_store: Optional[bool] = None, wg_causal_limit: bool = False,
                   kv_tail: bool = True, peel_first: bool = False,
                   tail_n: Optional[int] = None, stream_k: bool = False,
                   cluster: int = 1, multicast: bool = True, out_fp8: bool = False,
                   pv_wait_first: int = 0, s_f16: Optional[bool] = None,
                   exact_offset: bool = False, row_sums_mma: bool = False,
                   spec: KernelSpec = SPEC):
    """Compile (or fetch from the cache) k7; out_fp8: the output in e4m3 instead of bf16
    (O / descale_v, so that `output_descale` gives its descale; `run_kernel` then takes an
    e4m3 `out`); the other options as k6's (0 / None: TILES' default for
    the head dim), v_transposed (True: V comes packed from `prepare_inputs`; False: the
    kernel transposes plain V itself), and, for the in-kernel transpose, transpose_batch: V
    tile units whose ldmatrix the transposing warps issue back to back (1, the default: one at
    a time; more finishes the transpose sooner but slows the consumers' exp2, which share the
    MIO queue with ldmatrix/stmatrix); v_lags_k: K_{j+1} loaded before V_j (k6's option;
    None: on except at d = 256 with a causal mask, measured round-robin: +2.8-3.4% at
    d = 128, +0.9-1.2% d = 256 full, +0.4-0.7% d = 64, -0.9/+0.5% d = 256 causal;
    results/h100/2026-11-24_k7_v_lags_k.json); spin_waits: the rings' waits spin (k6's);
    longest_first, group_mib: k6's (None / 0: LONGEST_FIRST's); pv_wait_after,
    v_release_last: k6's (None: PV_WAIT_AFTER's, and V released last with it);
    rescale_before_pv: k6's (None: RESCALE_BEFORE_PV's); s_ahead: k6's (QK one tile ahead
    into a second S accumulator, the kv tile of S_AHEAD_BLOCK_N; measured slower);
    defer_store_wait: k6's (the O store's read waited for at the next item's epilogue);
    early_q_release, wg_store: k6's (Q handed back after an item's last QK; each consumer
    warpgroup stores its own rows; None: both where ITEM_END has them, unless direct_store
    or s_ahead); wg_causal_limit: k6's (each consumer warpgroup stops at the last kv tile
    its rows see; off: measured -1.4 to +2.2%, docs/k6.md "Each warpgroup's own diagonal");
    kv_tail: k6's (False: no tail test in the loop, for key lengths that are a multiple of
    the kv tile; measured -1.4 / -2.2% at d = 128, so on); peel_first: k6's (an item's first
    kv tile before the loop; measured -2.4 / -3.0% at d = 128 and -1.7 / -1.8% at d = 256
    without a mask, 4k / 16k, results/h100/2026-11-26_k7_peel_first*.json: off); tail_n:
    the item's last kv tile after the loop, its softmax and PV on its first tail_n keys
    (None: TAIL_N's rule, the key length's remainder rounded up to 32; 0: the whole tile);
    stream_k: k6's (the static schedule's last rounds spread evenly over the CTAs, an item
    split across two of them; without a mask, V packed; measured round-robin at d = 128,
    H100: -1.7% at 4k, -0.2 / +0.1% at 8k / 16k, so off; docs/k7.md); cluster: k6's (K and
    V^T multicast to two CTAs of a cluster; d = 128: +1.5-4.1% clock at the power limit,
    0.2-2.2% less work per clock, -0.8 to +0.4% in the bench: off; docs/k7.md "K and V
    multicast to two CTAs"); pv_wait_first: k6's (the PV wait pinned before the tile's
    exp2s; measured with pin_pv_wait=0 at d = 128 without a mask, H200: -0.7 / -0.2% at 4k /
    16k, results/h200/2026-11-28_k7_pv_wait_first_d128.json: off); s_f16: S accumulated in
    fp16 and the softmax on fp16 pairs (None: S_F16's configurations, with the kv tiles of
    TILES_S_F16; needs q and k quantized by `prepare_inputs` / `quantize_qk_f16_scores`);
    row_sums_mma: with s_f16, P's row sums by a WGMMA against ones and the row offset in
    one HFMA2 (see the header; off: the LSE's error grows tenfold); exact_offset: with
    row_sums_mma, the offset as without it, (s - m) c + 8 in two instructions per pair
    (results/h200/2026-11-28_k7_row_sums_*.json).
    `spec`: the stage the kernel is compiled for (k8 runs this kernel under its own name)."""
    if s_ahead and not block_n:
        block_n = S_AHEAD_BLOCK_N[problem.head_dim]
    if s_f16 is None:
        s_f16 = ((problem.head_dim, problem.causal) in S_F16 and v_transposed
                 and not (lazy_rescale or exp_turns or s_ahead or fma_exp2_every
                          or pv_wait_after or pv_wait_first))
    measured_on, measured_mib = longest_first_default(LONGEST_FIRST, problem)
    longest_first = measured_on if longest_first is None else longest_first
    group_mib = group_mib or measured_mib
    if v_lags_k is None:
        v_lags_k = not (problem.head_dim == 256 and problem.causal)
    if pv_wait_after is None:
        pv_wait_after = PV_WAIT_AFTER.get((problem.head_dim, problem.causal), 0) \
            if v_transposed and not (block_m or block_n or lazy_rescale or exp_turns or s_f16) \
            else 0
    if v_release_last is None:
        v_release_last = pv_wait_after > 0      # a release branch would split the exp2s
    if rescale_before_pv is None:
        rescale_before_pv = ((problem.head_dim, problem.causal) in RESCALE_BEFORE_PV
                             and v_transposed and not wait_pv_late
                             and not (block_m or block_n or lazy_rescale or exp_turns))
    item_end = ((problem.head_dim, problem.causal) in ITEM_END
                and not (direct_store or s_ahead))
    early_q_release = item_end if early_q_release is None else early_q_release
    wg_store = item_end if wg_store is None else wg_store
    tile_n = block_n or default_tiles(v_transposed, s_f16).get(problem.head_dim, (0, 1))[1]
    if not kv_tail:
        check_whole_kv_tiles("k7", problem, tile_n)
    if tail_n is None:
        tail_n = narrow_tail(problem, tile_n) if (
            problem.kv_seqlen < TAIL_N.get(problem.head_dim, 0) and not problem.causal
            and v_transposed
            and not (block_m or block_n or s_ahead or lazy_rescale or exp_turns
                     or wait_pv_late or pv_wait_after or peel_first or stream_k or s_f16)) \
            else 0       # (s_f16's 256-wide tile with a narrow one after the loop spills)
    if tail_n:
        check_tail_keys("k7", problem, tile_n, tail_n)
    if v_transposed:
        spec = dataclasses.replace(spec, v_seq_major=True)
    if out_fp8:
        if direct_store:                # (its stores are written and tested for bf16 only)
            raise ValueError("k7 out_fp8: with O staged in SMEM only, not direct_store")
        spec = dataclasses.replace(spec, output_dtype=FP8)
    return compile_attention(spec, FlashAttentionK7, problem,
                             {"block_m": block_m, "block_n": block_n, "stages": stages,
                              "pingpong": pingpong, "persistent": persistent,
                              "persistent_ctas": int(persistent_ctas),
                              "dynamic": dynamic, "trace": trace,
                              "transpose_batch": transpose_batch,
                              "fma_exp2_every": fma_exp2_every,
                              "stmatrix_o": bool(stmatrix_o),
                              "direct_store": bool(direct_store),
                              "wait_pv_late": bool(wait_pv_late),
                              "lazy_rescale": bool(lazy_rescale),
                              "v_transposed": bool(v_transposed),
                              "exp_turns": bool(exp_turns),
                              "pin_pv_wait": bool(pin_pv_wait),
                              "v_lags_k": bool(v_lags_k),
                              "elect_release": bool(elect_release),
                              "spin_waits": bool(spin_waits),
                              "longest_first": bool(longest_first),
                              "group_mib": int(group_mib),
                              "pv_wait_after": int(pv_wait_after),
                              "pv_wait_first": int(pv_wait_first),
                              "v_release_last": bool(v_release_last),
                              "rescale_before_pv": bool(rescale_before_pv),
                              "s_ahead": bool(s_ahead),
                              "defer_store_wait": bool(defer_store_wait),
                              "early_q_release": bool(early_q_release),
                              "wg_store": bool(wg_store),
                              "wg_causal_limit": bool(wg_causal_limit),
                              "kv_tail": bool(kv_tail),
                              "peel_first": bool(peel_first),
                              "tail_n": int(tail_n),
                              "stream_k": bool(stream_k),
                              "cluster": 1 if problem.causal else int(cluster),
                              "multicast": bool(multicast),
                              "s_f16": bool(s_f16),
                              "exact_offset": bool(exact_offset),
                              "row_sums_mma": bool(row_sums_mma)},
                             workspace_fn=lse_buffer, compile_options=compile_options)


def prepare_inputs(q, k, v, v_transposed: bool = True, rotate_signs=None,
                   s_f16: Optional[bool] = None, softmax_scale: Optional[float] = None,
                   **_options):
    """bf16 q, k, v -> (q8, k8, v8, descale_q, descale_k, descale_v) for `run_kernel`
    (per (batch, head) amax scaling; outside the timed region in bench.py). v8 packed for
    the kernel's V^T ring (`quantize_fp8(v, pack_v=True)`: sequence-major, keys permuted
    within 16) unless the kernel transposes V itself (`v_transposed=False`).
    `rotate_signs`: q and k rotated first (k8). `s_f16` (None: at the head dims S_F16 has):
    q and k scaled for fp16 scores (`quantize_qk_f16_scores`; the kernels without s_f16 take
    them too), for `softmax_scale` (None: 1 / sqrt(head_dim))."""
    d = q.shape[-1]
    if s_f16 is None:
        s_f16 = d in {dim for dim, _ in S_F16}
    if s_f16:
        scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
        q8, k8, descale_q, descale_k = quantize_qk_f16_scores(q, k, scale,
                                                              rotate_signs=rotate_signs)
    else:
        q8, k8, descale_q, descale_k = quantize_fp8(q, k, rotate_signs=rotate_signs)
    v8, descale_v = quantize_fp8(v, pack_v=v_transposed)
    return q8, k8, v8, descale_q, descale_k, descale_v


def logical_inputs(q8, k8, v8, v_transposed: bool = True, **_options):
    """The inverse of `prepare_inputs`' packing: q8, k8, v8 as (batch, seqlen, heads, d)."""
    return q8, k8, unpack_v(v8, k8.shape[1]) if v_transposed else v8


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
