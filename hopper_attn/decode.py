"""decode: attention for a few queries over many keys (flash-decoding), packed GQA + split-KV.

What changes from the prefill stages (k4-k6), which tile one query head's rows 128 at a time:

* Packed GQA. The `group` = Hq / Hkv query heads that share a k/v head share one 64-row M
  tile: row p of the tile is (query p // group, head p % group of the group). With 1-16
  queries and group 4 that is 4-64 real rows of one WGMMA M = 64 tile, and each K/V tile is
  read once per k/v head instead of once per query head. Rows past group x seqlen_q are
  padding: their Q is zero (never loaded), their scores are finite, they are never stored.
  More rows than 64 take more M tiles (grid z), each reading K/V again.
* Split-KV. One CTA per (split, k/v head, batch x M tile): split s walks its own contiguous
  range of the kv tiles the tile's rows see (`n_total * s // splits` ..), so a decode step
  with few (batch, k/v head) pairs still fills every SM. Each split leaves O / l (fp32) and
  its rows' LSE in a workspace; the last CTA of a (batch, k/v head, M tile) to finish (a
  per-item counter, atomic add acq_rel, reset to 0 by that CTA for the next launch) combines
  them by their LSE (common/split_kv.py) and writes O and the LSE. With one split the CTA
  writes O and the LSE itself: no workspace, no counter. The number of splits is the
  workspace's shape, chosen on the host from the shapes only (`num_splits_for`), so a
  decode step can be captured in a CUDA graph: no host synchronisation, no data-dependent
  allocation.
* One consumer warpgroup (warps 0-3, the 64 rows) and one producer warp (warp 4, TMA loads of
  K and V into rings of `stages`, each with its own full/empty mbarriers): 160 threads, no
  register reallocation. Q is loaded by the consumers with plain 16-byte loads (the packed
  rows are no TMA box), zero-filled past the real rows, stored into the swizzled Q tile and
  fenced for the async proxy. O is stored from registers (a row's (query, head) is no TMA
  box either): the output of a decode step is a few KiB.

The `kv_cache` variant (`kv_cache_call`, for hopper_attn/kvcache.py): each request's key
count comes from a device tensor (the bottom-right diagonal and the splits per request), K
and V from a cache, contiguous or paged (each kv tile gathered by TMA boxes from the pages
that a page table names: common/paged.py), and the last tile's V rows past the request's
keys are zeroed in shared memory before P V (a cache may hold NaN there). With an e4m3
cache (`fp8`), 256 threads: a loader warpgroup (warps 4-7, warp 4 issuing the TMA loads of
e4m3 rings) widens each e4m3 tile into 16-bit rings of `wide_stages` (common/paged.py,
`load_and_widen`; V's rows past the keys as zeros); the consumers' WGMMAs read those in
fp16 (Q converted when loaded, held in registers for an RS WGMMA at d <= 128), the
descales folded into the softmax scale (K) and 1 / l (V), in k6's order: with one consumer
warpgroup per SM its softmax must run under its own PV (the same bits as k5's order).
FP8_TILES: at d = 128, 7 x 2 e4m3 stages 112 KiB + 3 x 2 fp16 ones 96 + 2 = 210 KiB, one
CTA per SM (docs/kvcache.md).

Attention sinks (`sinks=1`, docs/sinks.md): a per-head logit in each row's denominator,
joined once: at the combine (one more split: LSE the sink, O zero), or with one split
folded into the row (`split_kv.fold_sink`); a runtime argument, none without it.

Logit softcapping and a sliding window (`softcap`, `window_left` / `window_right`; compile
time, none of their code without them; both variants, docs/decode.md, docs/kvcache.md): scores
through cap tanh(s scale / cap) before the mask (common/softmax.py, k6's); a packed row's
keys [low, limit) from `masking.query_keys`, the splits over the kv tiles from the tile's
first row's low to its last row's limit (tiles left of every row's window never loaded),
masked per element where a tile crosses an edge (`masking.mask_key_ranges`).

What stays: WGMMA for S = Q K^T (both from SMEM) and O += P V (P from registers, V^T read
MN-major), the online softmax on the accumulator, k5's order inside a tile (PV of tile j-1
and QK of tile j in one batch; e4m3: k6's), TMA zero-fill of keys past the end, the
bottom-right causal diagonal (query i sees keys j <= i + seqlen_k - seqlen_q).

Budget: 160 threads. The kv tile and stages come per shape from TILES (`tile_for`: the
deepest ring whose one wave holds every item). d = 128: 64 x 2 stages: SMEM = Q 16 KiB +
2 x (K + V) 16 KiB + 1 KiB = 81 KiB, two CTAs per SM (143 registers), for many (batch,
k/v head) items; 128 x 3: 16 + 192 + 1 = 209 KiB, one per SM (186 registers, 192 KiB in
flight), where few CTAs must each pull more.
d = 64: 128 x 3: 8 + 96 + 1 = 105 KiB, two per SM; d = 256: 64 x 2: 32 + 128 + 1 = 161 KiB.
Registers per consumer thread: S bn/2 + O d/2 fp32 + P bn/4 + bookkeeping. The combine
works in registers (16 partial O pieces and LSEs in flight per lane), no shared memory.
"""

from __future__ import annotations

import math
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup
import torch

from hopper_attn.common import masking, paged, split_kv, tma, wgmma
from hopper_attn.common.contract import (MAX_GRID_YZ, KernelSpec, UnsupportedProblem,
                                         compile_attention, run_attention, shared_workspace)
from hopper_attn.common.layouts import (acc_as_operand_a, acc_rows_cols, ndhb_view, qkv_smem,
                                        smem_bytes, smem_tile_layout, transposed)
from hopper_attn.common.sinks import sink_inputs, with_sinks
from hopper_attn.common.softmax import (OnlineSoftmax, scale_rows, softcap_scales,
                                        softcap_scores)

ROWS = 64                   # packed (query, head) rows per M tile: one WGMMA M
THREADS = 160               # consumer warpgroup + producer warp
FP8_THREADS = 256           # e4m3 cache: consumer warpgroup + loader warpgroup (TMA, widening)
PRODUCER_WARP = 4
WIDE_STAGES = 3             # e4m3 cache: 16-bit K and V tiles the loaders widen into
CONSUMER_BARRIER = 1        # named barrier of the 128 consumer threads
MAX_SPLITS = 128
SMEM_PER_CTA = 227 * 1024
SMEM_PER_SM = 228 * 1024

# (kv tile, stages) per head dim that `tile_for` picks from: at d = 128, 128 x 3 (209 KiB,
# one CTA per SM, 192 KiB in flight) while the (batch, k/v head) items fit one CTA per SM,
# 64 x 2 (81 KiB, two per SM) for more
TILES = {64: [(128, 3)], 128: [(64, 2), (128, 3)], 256: [(64, 2)]}
# e4m3 cache, (kv tile, e4m3 stages) per head dim, one CTA per SM: at d = 128, 16-bit rings
# of WIDE_STAGES 96 KiB + e4m3 rings 112 + 2 = 210 KiB (112 in flight; d = 256: `wide_stages`)
FP8_TILES = {64: (128, 7), 128: (64, 7), 256: (64, 2)}
COMBINE_CHUNK = 16          # partials a combining lane loads before it uses the first


def m_tiles(problem) -> int:
    """M tiles per (batch, k/v head): the packed rows, 64 at a time."""
    group = problem.heads // problem.kv_heads
    return -(-group * problem.seqlen // ROWS)


def item_rows(problem) -> int:
    """Workspace rows per (batch, k/v head, M tile) and split: the packed rows of a tile,
    64 when there are several tiles."""
    return min(ROWS, problem.heads // problem.kv_heads * problem.seqlen)


def _limits(problem):
    if masking.shifted_window(problem.window_left, problem.window_right):
        return ("a window side below 0 (a shifted diagonal) is for the prefill stages (k6): "
                "the split ranges here take sides >= 0")
    if problem.kv_heads > MAX_GRID_YZ or problem.batch * m_tiles(problem) > MAX_GRID_YZ:
        return (f"the grid is (splits, k/v heads, batch x M tiles): k/v heads "
                f"({problem.kv_heads}) and batch x M tiles ({problem.batch * m_tiles(problem)})"
                f" must be <= {MAX_GRID_YZ}")
    return None


def _workspace_bytes(problem) -> int:
    splits = num_splits_for(problem)
    items = problem.batch * problem.kv_heads * m_tiles(problem)
    partial = items * splits * item_rows(problem) * (problem.head_dim + 1) * 4 \
        if splits > 1 else 0
    return problem.batch * problem.heads * problem.seqlen * 4 + partial


SPEC = KernelSpec(
    name="decode",
    summary="decode: packed GQA rows in one M tile, split-KV combined by LSE in the last CTA",
    head_dims=(64, 128, 256),
    dtypes=(torch.bfloat16, torch.float16),
    separate_kv=True,
    strided_inputs=True,
    grid_per_tile=False,
    window=True,
    extra_limits=_limits,
    workspace_bytes=_workspace_bytes,
    keeps_workspace=True,       # [LSE, partial O, partial LSE, counters]: a caller's LSE first
)


def tile_config(head_dim: int, block_n: int = 0, stages: int = 0) -> tuple[int, int]:
    """(kv tile, stages): the head dim's first TILES entry where 0; ValueError if not a tile."""
    block_n, stages = block_n or TILES[head_dim][0][0], stages or TILES[head_dim][0][1]
    if block_n % 16 or not 16 <= block_n <= 256 or stages < 1:
        raise ValueError(f"bad tile: block_n={block_n} (multiple of 16, 16-256), "
                         f"stages={stages} (>= 1)")
    return block_n, stages


def q_in_registers(head_dim: int, fp8: bool) -> bool:
    """fp8: Q (fp16) held in registers for an RS WGMMA, no Q tile in shared memory (d = 256:
    no registers for it)."""
    return fp8 and head_dim <= 128


def smem_estimate(head_dim: int, block_n: int, stages: int, wide: int = 0) -> int:
    """mbarriers and flags (1 KiB) + Q + the K and V rings, 16-bit elements (`wide` > 0: an
    e4m3 cache, e4m3 rings of `stages` and the 16-bit K and V rings of `wide` stages they are
    widened into; Q's tile, or 1 KiB where Q is held in registers)."""
    if wide:
        q_bytes = 1024 if q_in_registers(head_dim, True) else smem_bytes(ROWS * head_dim * 2)
        return 1024 + q_bytes \
            + 2 * smem_bytes(wide * block_n * head_dim * 2) \
            + 2 * smem_bytes(stages * block_n * head_dim)
    return 1024 + smem_bytes(ROWS * head_dim * 2) + 2 * smem_bytes(stages * block_n * head_dim * 2)


def wide_stages(head_dim: int, block_n: int, stages: int) -> int:
    """16-bit K and V stages of an e4m3 cache: WIDE_STAGES, 2 where a third does not fit."""
    fits = smem_estimate(head_dim, block_n, stages, WIDE_STAGES) <= SMEM_PER_CTA
    return WIDE_STAGES if fits else 2


def ctas_per_sm(head_dim: int, block_n: int, stages: int, fp8: bool = False) -> int:
    """CTAs one SM holds by shared memory (1 KiB reserved per CTA), at most 2 (registers:
    2 x 160 threads x 204); one with `fp8` (256 threads)."""
    if fp8:
        return 1
    return max(1, min(2, SMEM_PER_SM // (smem_estimate(head_dim, block_n, stages) + 1024)))


def max_splits(head_dim: int = 0, block_n: int = 0, stages: int = 0) -> int:
    """Splits per item the workspace may have (the combine keeps nothing per split in shared
    memory: any tile allows MAX_SPLITS)."""
    return MAX_SPLITS


# The split rule (see num_splits_for and docs/decode.md): a split walks at least
# MIN_SPLIT_TILES kv tiles, so the first load's latency and the combine buy some streaming
# (H200, B1 8k: 16 splits of 4 tiles of 128 keys beat 13 splits of 5 by 7%).
MIN_SPLIT_TILES = 4


def split_limits(problem, block_n: int = 0, stages: int = 0, sms: int = 0) -> dict:
    """The three caps on the split count of one (batch, k/v head, M tile) item, each >= 1:
    wave: the split CTAs of all items fit one wave (SMs x CTAs per SM);
    length: every split walks at least MIN_SPLIT_TILES kv tiles;
    combine: the last CTA reads no more partials (splits x rows x (d + 1) fp32) than one
    split reads K/V (kv tiles / splits x 2 x block_n x d x 2 bytes)."""
    from hopper_attn.common.scheduler import sm_count
    block_n, stages = tile_config(problem.head_dim, block_n, stages)
    d, sms = problem.head_dim, sms or sm_count()
    items = problem.batch * problem.kv_heads * m_tiles(problem)
    kv_tiles = walked_tiles(problem, block_n)
    slots = sms * ctas_per_sm(d, block_n, stages)
    # s x rows x (d + 1) x 4 <= kv_tiles x block_n x d x 4 / s
    combine = math.isqrt(kv_tiles * block_n * d // (item_rows(problem) * (d + 1)))
    return dict(wave=max(1, slots // items), length=max(1, kv_tiles // MIN_SPLIT_TILES),
                combine=max(1, combine))


def walked_tiles(problem, block_n: int) -> int:
    """The kv tiles an item walks: all of the keys', or with a sliding window those from
    the first query's window to the last one's (masking.window_ranges), at least 1."""
    if not problem.windowed:
        return -(-problem.kv_seqlen // block_n)
    first, end = masking.window_ranges(0, problem.seqlen, block_n, problem.seqlen,
                                       problem.kv_seqlen, *problem.window)
    return max(end - first, 1)


def num_splits_for(problem, block_n: int = 0, stages: int = 0, sms: int = 0) -> int:
    """How many splits of the keys per (batch, k/v head, M tile), from shapes only (so a
    decode step can be captured in a CUDA graph): the most that `split_limits` allows (one
    wave, splits of >= MIN_SPLIT_TILES tiles, a combine no bigger than a split), at most
    MAX_SPLITS. Items that fill a wave alone get 1: a second wave of splits only adds the
    combine."""
    if not block_n and not stages:
        block_n, stages = tile_for(problem, sms)
    return min(MAX_SPLITS, *split_limits(problem, block_n, stages, sms).values())


def tile_for(problem, sms: int = 0) -> tuple[int, int]:
    """The (kv tile, stages) of TILES[d]: the deepest ring (fewest CTAs per SM) whose one wave
    holds every (batch, k/v head, M tile) item, so few items split over SMs that each pull
    a full share; where none does, the tile with the most CTAs per SM (fewest waves)."""
    from hopper_attn.common.scheduler import sm_count
    d, sms = problem.head_dim, sms or sm_count()
    items = problem.batch * problem.kv_heads * m_tiles(problem)
    by_slots = sorted(TILES[d], key=lambda t: ctas_per_sm(d, *t))    # fewest CTAs per SM first
    return next((t for t in by_slots if items <= sms * ctas_per_sm(d, *t)), by_slots[-1])


def prefers(problem) -> bool:
    """Shapes where this stage should run instead of the prefill stages: every k/v head's
    packed rows (group x seqlen_q) fit one 64-row M tile, at most 16 queries, and the stage
    supports the problem (windows, softcap and sinks included, at any window length)."""
    group = problem.heads // problem.kv_heads
    return (group * problem.seqlen <= ROWS and problem.seqlen <= 16
            and SPEC.unsupported_reason(problem, check_memory=False) is None)


class DecodeAttention:
    def __init__(self, head_dim: int, causal: bool, block_n: int = 0, stages: int = 0,
                 combine_chunk: int = COMBINE_CHUNK, kv_cache: bool = False,
                 page_size: int = 0, fp8: bool = False, softcap: float = 0.0,
                 window_left: Optional[int] = None, window_right: Optional[int] = None):
        """`kv_cache`: the `kv_cache_call` variant (hopper_attn/kvcache.py): each request's
        key count read from a device tensor, a contiguous (page_size 0) or paged cache;
        `fp8`: an e4m3 cache (rings of `stages` e4m3 tiles, widened by a loader warpgroup
        into 16-bit rings; Q converted to fp16 too: fp16 WGMMAs) with per-(request, k/v
        head) descales. `softcap`: logit softcapping's cap (0: none); `window_left`,
        `window_right`: a sliding window as Problem's fields (None: unbounded; sides >= 0;
        with causal the right side is 0 and window_right None). All compile-time: none of
        them, none of their code."""
        block_n, stages = tile_config(head_dim, block_n, stages)
        from hopper_attn.kvcache import PAGE_SIZES
        if page_size and (not kv_cache or page_size not in PAGE_SIZES):
            raise ValueError(f"page_size must be one of {PAGE_SIZES} (kv_cache only), "
                             f"got {page_size}")
        if fp8 and not kv_cache:
            raise ValueError("fp8: kv_cache only")
        if fp8 and block_n * head_dim // 16 % 128:
            raise ValueError(f"fp8: a kv tile of {block_n} x {head_dim} is not a whole number "
                             f"of 16-byte chunks per loader thread (128)")
        self.kv_cache, self.page_size, self.fp8 = kv_cache, page_size, fp8
        self.threads = FP8_THREADS if fp8 else THREADS
        self.q_in_registers = q_in_registers(head_dim, fp8)
        self.wide_stages = wide_stages(head_dim, block_n, stages) if fp8 else 0
        smem = smem_estimate(head_dim, block_n, stages, self.wide_stages)
        if smem > SMEM_PER_CTA:
            raise ValueError(f"kv tile {block_n} at d = {head_dim} with {stages} stages needs "
                             f"{smem} bytes of shared memory; a CTA gets at most {SMEM_PER_CTA}")
        self.head_dim, self.causal = head_dim, causal
        self.block_n, self.stages = block_n, stages
        self.ctas_per_sm = ctas_per_sm(head_dim, block_n, stages, fp8)
        self.max_splits = max_splits(head_dim, block_n, stages)
        if not 1 <= combine_chunk <= 32:
            raise ValueError(f"combine_chunk must be 1-32, got {combine_chunk}")
        self.combine_chunk = combine_chunk
        self.softcap = float(softcap)
        if not math.isfinite(self.softcap) or self.softcap < 0.0:
            raise ValueError(f"softcap must be finite and >= 0 (0: none), got {softcap}")
        if any(w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0)
               for w in (window_left, window_right)) or (causal and window_right is not None):
            raise ValueError(f"bad window ({window_left}, {window_right}): None or >= 0 each, "
                             f"window_right None with causal")
        self.window_left, self.window_right = window_left, window_right
        self.windowed = (window_left, window_right) != (None, None)

    def describe(self) -> dict:
        return {"smem_bytes": getattr(self, "smem_bytes", None), "block_m": ROWS,
                "block_n": self.block_n, "stages": self.stages, "threads": self.threads,
                "ctas_per_sm": self.ctas_per_sm, "max_splits": self.max_splits,
                "combine_chunk": self.combine_chunk,
                **({"softcap": self.softcap} if self.softcap else {}),
                **({"window": (self.window_left, self.window_right)} if self.windowed
                   else {})}

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mOPart: cute.Tensor, mLSEPart: cute.Tensor,
                 mCount: cute.Tensor, scale_log2: Float32, stream):
        self.launch(mQ, mK, mV, mO, mLSE, mOPart, mLSEPart, mCount, None, None, scale_log2,
                    stream)

    @cute.jit
    def kv_cache_call(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                      mO: cute.Tensor, mLSE: cute.Tensor, mOPart: cute.Tensor,
                      mLSEPart: cute.Tensor, mCount: cute.Tensor, mSeqlensK: cute.Tensor,
                      mPageTable: cute.Tensor, mKDescale: cute.Tensor, mVDescale: cute.Tensor,
                      scale_log2: Float32, stream):
        """k and v a cache: (batch, capacity, kv_heads, d), or with a page size (num_pages,
        page_size, kv_heads, d) and the (batch, max_pages) int32 page table; request b sees
        its first mSeqlensK[b] keys (int32, (batch,)). With `fp8`, k and v are e4m3 and
        mKDescale, mVDescale fp32 (batch, kv_heads) (unused otherwise)."""
        self.launch(mQ, mK, mV, mO, mLSE, mOPart, mLSEPart, mCount, mSeqlensK,
                    mPageTable if self.page_size else None, scale_log2, stream,
                    *((mKDescale, mVDescale) if self.fp8 else (None, None)))

    @cute.jit
    def launch(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, mOPart: cute.Tensor, mLSEPart: cute.Tensor,
               mCount: cute.Tensor, mSeqlensK, mPageTable, scale_log2: Float32, stream,
               mKDescale=None, mVDescale=None, mSinks: Optional[cute.Tensor] = None):
        """The launch (attention sinks: `mSinks`, fp32 (heads,), else None)."""
        q, k, v, o = [ndhb_view(t) for t in (mQ, mK, mV, mO)]   # (N, d, H, B)
        bn, d = self.block_n, self.head_dim
        self.dtype = mQ.element_type
        # the WGMMAs' type: q's, or fp16 with an e4m3 cache (one cvt widens two e4m3 values
        # to fp16, exactly; bf16 takes three more through fp32)
        self.mma_dtype = cutlass.Float16 if self.fp8 else self.dtype
        # the partial O rows are d fp32 apart (16-byte multiples): vector loads and stores
        row_stride = mOPart.layout.stride[0]
        if cutlass.const_expr(not isinstance(row_stride, int)):
            row_stride = cute.assume(row_stride, divby=4)
        o_part = cute.make_tensor(mOPart.iterator,
                                  cute.make_layout(mOPart.shape, stride=(row_stride, 1)))
        q_layout = smem_tile_layout(self.mma_dtype, ROWS, d)
        kv_layout = smem_tile_layout(self.mma_dtype, bn, d,
                                     self.wide_stages if self.fp8 else self.stages)
        # (fp8: TMA fills rings of e4m3 tiles; kv_layout: the 16-bit rings they widen into)
        load_dtype = mK.element_type
        load_layout = smem_tile_layout(load_dtype, bn, d, self.stages) if self.fp8 \
            else kv_layout
        load_rows = paged.box_rows(self.page_size, bn) if self.page_size else bn
        box_layout = smem_tile_layout(load_dtype, load_rows, d) if self.page_size \
            else load_layout
        tma_k, k_coords = tma.make_tma_load(k, box_layout, load_rows, d)
        tma_v, v_coords = tma.make_tma_load(v, box_layout, load_rows, d)
        self.tile_bytes = tma.tma_bytes(load_dtype, load_layout)

        if cutlass.const_expr(self.fp8):
            @cute.struct
            class SharedStorage:
                k_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
                v_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
                k16_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.wide_stages]
                v16_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.wide_stages]
                last: cute.struct.MemRange[Int32, 4]
                sK: cute.struct.Align[cute.struct.MemRange[self.mma_dtype,
                                                           cute.cosize(kv_layout)], 1024]
                sV: cute.struct.Align[cute.struct.MemRange[self.mma_dtype,
                                                           cute.cosize(kv_layout)], 1024]
                sK8: cute.struct.Align[cute.struct.MemRange[load_dtype,
                                                            cute.cosize(load_layout)], 1024]
                sV8: cute.struct.Align[cute.struct.MemRange[load_dtype,
                                                            cute.cosize(load_layout)], 1024]
                # (Q in registers: 16 bytes, never read)
                sQ: cute.struct.Align[cute.struct.MemRange[
                    self.mma_dtype, 8 if self.q_in_registers else cute.cosize(q_layout)], 1024]
        else:
            @cute.struct
            class SharedStorage:
                k_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
                v_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
                last: cute.struct.MemRange[Int32, 4]               # this CTA combines (0 / 1)
                sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_layout)], 1024]
                sK: cute.struct.Align[cute.struct.MemRange[self.dtype,
                                                           cute.cosize(kv_layout)], 1024]
                sV: cute.struct.Align[cute.struct.MemRange[self.dtype,
                                                           cute.cosize(kv_layout)], 1024]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        seqlen_q, heads, batch = q.shape[0], q.shape[2], q.shape[3]
        heads_kv = k.shape[2]
        tiles_m = cute.ceil_div((heads // heads_kv) * seqlen_q, ROWS)
        splits = mLSEPart.shape[0]
        self.kernel(q, o, k_coords, v_coords, tma_k, tma_v, mLSE, o_part, mLSEPart, mCount,
                    scale_log2, q_layout, kv_layout, mSeqlensK, mPageTable, mKDescale,
                    mVDescale, load_layout if self.fp8 else None, mSinks).launch(
            grid=[splits, heads_kv, batch * tiles_m],
            block=[self.threads, 1, 1],
            min_blocks_per_mp=self.ctas_per_sm,
            # (two CTAs per SM: all of the SM's shared memory, and no device query)
            **({"preferred_smem_carveout": 100} if self.ctas_per_sm > 1 else {}),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, q: cute.Tensor, o: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
               tma_k: cute.CopyAtom, tma_v: cute.CopyAtom, mLSE: cute.Tensor,
               mOPart: cute.Tensor, mLSEPart: cute.Tensor, mCount: cute.Tensor,
               scale_log2: Float32, q_layout: cute.ComposedLayout,
               kv_layout: cute.ComposedLayout, mSeqlensK, mPageTable, mKDescale, mVDescale,
               load_layout, mSinks: Optional[cute.Tensor] = None):
        bn, d = self.block_n, self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        split, kv_head, tile = cute.arch.block_idx()
        splits, _, _ = cute.arch.grid_dim()
        split, kv_head, tile, splits = Int32(split), Int32(kv_head), Int32(tile), Int32(splits)
        seqlen_q, heads, seqlen_k = q.shape[0], q.shape[2], mK.shape[0]
        heads_kv = mK.shape[2]
        group = heads // heads_kv
        rows_total = group * seqlen_q
        tiles_m = cute.ceil_div(rows_total, ROWS)
        batch = tile // tiles_m
        m_tile = tile - batch * tiles_m
        if cutlass.const_expr(self.kv_cache):
            seqlen_k = mSeqlensK[batch]                     # this request's keys
        row0 = m_tile * ROWS
        rows_valid = cutlass.min(rows_total - row0, ROWS)
        part_rows = cutlass.min(rows_total, ROWS)          # workspace rows per item and split
        # keys every real row of the tile sees (no mask below it), and keys any row sees
        keys_all, keys_any, low_all = seqlen_k, seqlen_k, None
        if cutlass.const_expr(self.windowed):
            # and the keys no row sees below the first tile's (low_any), and the first key
            # every row sees from (low_all): tiles wholly left of every row's window skipped
            window = (self.causal, self.window_left, self.window_right)
            shift = seqlen_k - seqlen_q
            low_any, keys_all = masking.query_keys(row0 // group, shift, seqlen_k, *window)
            low_all, keys_any = masking.query_keys((row0 + rows_valid - 1) // group, shift,
                                                   seqlen_k, *window)
            n_lo = low_any // bn
        elif cutlass.const_expr(self.causal):
            shift = seqlen_k - seqlen_q
            keys_all = cutlass.min(seqlen_k, cutlass.max(row0 // group + shift + 1, 0))
            keys_any = cutlass.min(seqlen_k, cutlass.max(
                (row0 + rows_valid - 1) // group + shift + 1, 0))
        n_total = cute.ceil_div(keys_any, bn)
        if cutlass.const_expr(self.windowed):
            n_total = cutlass.max(n_total - n_lo, 0)
        n_first = split * n_total // splits
        n_count = (split + 1) * n_total // splits - n_first
        if cutlass.const_expr(self.windowed):
            n_first = n_first + n_lo

        if warp == PRODUCER_WARP:
            tma.prefetch_descriptors(tma_k, tma_v)
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sQ, sK, sV = qkv_smem(storage, q_layout, kv_layout)
        sK_load, sV_load = sK, sV                           # where TMA writes K and V
        if cutlass.const_expr(self.fp8):
            sK_load, sV_load = (buf.get_tensor(load_layout.outer, swizzle=load_layout.inner)
                                for buf in (storage.sK8, storage.sV8))
        k_pipe = tma.make_tma_ring(storage.k_barriers.data_ptr(), self.stages, 4,
                                   self.tile_bytes)
        v_pipe = tma.make_tma_ring(storage.v_barriers.data_ptr(), self.stages, 4,
                                   self.tile_bytes)
        k_ring, v_ring = k_pipe, v_pipe                     # the rings the WGMMAs read
        loaders = warp == PRODUCER_WARP
        if cutlass.const_expr(self.fp8):                    # e4m3: the 16-bit rings
            k_ring, v_ring = (paged.wide_ring(barriers.data_ptr(), self.wide_stages) for barriers
                              in (storage.k16_barriers, storage.v16_barriers))
            loaders = warp >= PRODUCER_WARP
        tma.barriers_ready()

        if loaders:
            if cutlass.const_expr(self.fp8):
                # ---- loader warpgroup (e4m3): TMA into the e4m3 rings, widened to 16 bits ----
                paged.load_and_widen(k_pipe, v_pipe, k_ring, v_ring, tma_k, tma_v, mK, mV,
                                     mPageTable, sK_load, sV_load, sK, sV, n_first, n_count,
                                     seqlen_k, kv_head, batch, tidx - 128,
                                     warp == PRODUCER_WARP, self.stages, self.page_size, bn)
            else:
                # -------------- producer warp: K_j, V_j of this split's kv tiles --------------
                paged.produce_kv(k_pipe, v_pipe, tma_k, tma_v, mK, mV, mPageTable, sK_load,
                                 sV_load, n_first, n_count, seqlen_k, kv_head, batch,
                                 self.stages, self.page_size, bn)
        elif warp < PRODUCER_WARP:
            # ---------------- consumer warpgroup: the tile's 64 packed rows ----------------
            consumers = pipeline.NamedBarrier(barrier_id=CONSUMER_BARRIER, num_threads=128)
            if cutlass.const_expr(not self.q_in_registers):
                split_kv.load_q(q, sQ, tidx, row0, rows_valid, group, kv_head, batch)
                cute.arch.fence_proxy("async.shared", space="cta")   # Q visible to the WGMMAs
                consumers.arrive_and_wait()

            mmas = wgmma.AttentionMmas.create(1, ROWS, bn, d, tidx,
                                              None if self.q_in_registers else sQ, sK,
                                              transposed(sV), self.mma_dtype)
            if cutlass.const_expr(self.q_in_registers):     # no SMEM read of Q per tile
                q_acc = cute.make_rmem_tensor(mmas.thr_pv.partition_shape_C((ROWS, d)),
                                              self.mma_dtype)
                split_kv.load_q_registers(q, q_acc, mmas.thr_pv.partition_C(
                    cute.make_identity_tensor((ROWS, d))), row0, rows_valid, group, kv_head,
                    batch)
                mmas = wgmma.with_q_in_registers(mmas, sK, q_acc, tidx)
            acc_o = mmas.new_o_accumulator(ROWS, d)
            acc_s = mmas.new_s_accumulator(ROWS, bn)
            o_rc = acc_rows_cols(acc_o)
            s_coords = mmas.s_coords
            rows = cute.size(s_coords, mode=[0])
            if cutlass.const_expr(self.fp8):                # k_descale: a factor of every score
                scale_log2 = scale_log2 * mKDescale[batch, kv_head]
            prescale, scale_log2 = softcap_scales(scale_log2, self.softcap)
            softmax = OnlineSoftmax.create(rows, scale_log2, lanes_per_row=4,
                                           softcap_prescale=prescale)
            # the first hidden key of each of this thread's rows (padding rows: as the last
            # real query or later, so never fewer keys than the real rows)
            limits = cute.make_rmem_tensor((rows,), Int32)
            lows = cute.make_rmem_tensor((rows,), Int32) if self.windowed else None
            for r in cutlass.range_constexpr(rows):
                limits[r] = seqlen_k
                if cutlass.const_expr(self.windowed):       # (and the first seen key)
                    lows[r], limits[r] = masking.query_keys(
                        (row0 + s_coords[r, 0][0]) // group, shift, seqlen_k, *window)
                elif cutlass.const_expr(self.causal):
                    query = (row0 + s_coords[r, 0][0]) // group
                    limits[r] = cutlass.min(seqlen_k, query + seqlen_k - seqlen_q + 1)

            ring_stages = self.wide_stages if self.fp8 else self.stages
            k_state = tma.consumer_state(ring_stages)
            v_state = tma.consumer_state(ring_stages)
            if cutlass.const_expr(self.fp8):                # k6's order (module doc)
                for j in cutlass.range(n_count, unroll=1):
                    k_ring.consumer_wait(k_state)
                    wgmma.gemm(mmas.mma_qk, acc_s, mmas.q_frag,
                               mmas.k_frag[None, None, None, k_state.index], zero_init=True)
                    if j > 0:                               # O += P_{j-1} V_{j-1}, behind S_j
                        v_ring.consumer_wait(v_state)
                        wgmma.gemm(mmas.mma_pv, acc_o, mmas.p_frag,
                                   mmas.vt_frag[None, None, None, v_state.index], zero_init=False)
                        warpgroup.wait_group(1)             # S_j done; PV_{j-1} may still run
                    else:
                        warpgroup.wait_group(0)
                    tma.release_stage(k_ring, k_state)
                    k_state.advance()
                    alpha = self.tile_probs(acc_s, n_first + j, softmax, s_coords, limits, lows,
                                            keys_all, low_all)
                    cute.arch.fence_acq_rel_cta()           # keeps ptxas's wait below the softmax
                    warpgroup.wait_group(0)                 # PV_{j-1} done: O and P are free
                    if j > 0:
                        tma.release_stage(v_ring, v_state)
                        v_state.advance()
                    scale_rows(o_rc, alpha)
                    mmas.p_frag.store(acc_as_operand_a(acc_s).load().to(self.mma_dtype))
            else:
                for j in cutlass.range(n_count, unroll=1):
                    k_ring.consumer_wait(k_state)
                    if j > 0:                                   # O += P_{j-1} V_{j-1}
                        v_ring.consumer_wait(v_state)
                        wgmma.gemm(mmas.mma_pv, acc_o, mmas.p_frag,
                                   mmas.vt_frag[None, None, None, v_state.index], zero_init=False)
                    wgmma.gemm(mmas.mma_qk, acc_s, mmas.q_frag,
                               mmas.k_frag[None, None, None, k_state.index], zero_init=True)
                    warpgroup.wait_group(0)
                    if j > 0:
                        tma.release_stage(v_ring, v_state)
                        v_state.advance()
                    tma.release_stage(k_ring, k_state)
                    k_state.advance()
                    alpha = self.tile_probs(acc_s, n_first + j, softmax, s_coords, limits, lows,
                                            keys_all, low_all)
                    scale_rows(o_rc, alpha)
                    mmas.p_frag.store(acc_as_operand_a(acc_s).load().to(self.mma_dtype))
            if n_count > 0:                                 # the last tile's PV
                v_ring.consumer_wait(v_state)
                if cutlass.const_expr(self.kv_cache and not self.fp8):
                    # a cache's rows past the request's keys may hold anything, NaN too:
                    # zero them (their P is 0, but 0 x NaN is NaN; e4m3: the loaders do)
                    tail = seqlen_k - (n_first + n_count - 1) * bn
                    if tail < bn:
                        paged.clear_rows_from(sV[None, None, v_state.index], tail, tidx, 128)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        consumers.arrive_and_wait()
                wgmma.gemm(mmas.mma_pv, acc_o, mmas.p_frag,
                           mmas.vt_frag[None, None, None, v_state.index], zero_init=False)
                warpgroup.wait_group(0)
                tma.release_stage(v_ring, v_state)

            inv = softmax.finalize()                        # 1 / l, 0 for a row without keys
            lse = softmax.log_sum_exp(inv)                  # natural log, -inf without keys
            if cutlass.const_expr(self.fp8):                # V's descale into 1 / l
                v_descale = mVDescale[batch, kv_head]
                for r in cutlass.range_constexpr(rows):
                    inv[r] = inv[r] * v_descale
            scale_rows(o_rc, inv)
            o_coords = mmas.thr_pv.partition_C(cute.make_identity_tensor((ROWS, d)))
            if splits == 1:
                if cutlass.const_expr(mSinks is not None):   # the sink joins here, once
                    for r in cutlass.range_constexpr(rows):
                        sink_head = kv_head * group + (row0 + s_coords[r, 0][0]) % group
                        inv[r], lse[r] = split_kv.fold_sink(lse[r], mSinks[sink_head])
                    scale_rows(o_rc, inv)
                o_out = cute.make_rmem_tensor_like(acc_o, self.dtype)
                o_out.store(acc_o.load().to(self.dtype))
                split_kv.store_rows(o, o_out, o_coords, row0, rows_valid, group, kv_head, batch)
                if tidx % 4 == 0:
                    for r in cutlass.range_constexpr(rows):
                        row = s_coords[r, 0][0]
                        if row < rows_valid:
                            p = row0 + row
                            mLSE[batch, kv_head * group + p % group, p // group] = lse[r]
            else:
                item = (batch * heads_kv + kv_head) * tiles_m + m_tile
                split_kv.store_partial(mOPart, acc_o, o_coords,
                                       (item * splits + split) * part_rows, rows_valid)
                if tidx % 4 == 0:
                    for r in cutlass.range_constexpr(rows):
                        row = s_coords[r, 0][0]
                        if row < rows_valid:
                            mLSEPart[split, item * part_rows + row] = lse[r]
                # every consumer thread's partial is written before the count (release);
                # the last CTA's reads come after it (acquire)
                cute.arch.fence_acq_rel_gpu()
                consumers.arrive_and_wait()
                flag = storage.last.get_tensor(cute.make_layout(4))
                if tidx == 0:
                    done = cute.arch.atomic_add(mCount.iterator + item, Int32(1),
                                                sem="acq_rel", scope="gpu")
                    flag[0] = Int32(0)
                    if done == splits - 1:
                        mCount[item] = Int32(0)             # zero again for the next launch
                        flag[0] = Int32(1)
                consumers.arrive_and_wait()
                if flag[0] != 0:
                    cute.arch.fence_acq_rel_gpu()
                    split_kv.combine(mOPart, mLSEPart, o, mLSE, item, splits, rows_valid,
                                     part_rows, row0, group, kv_head, batch, tidx, mSinks,
                                     d, self.combine_chunk, self.dtype)

    @cute.jit
    def tile_probs(self, acc_s, tile, softmax, s_coords, limits, lows, keys_all, low_all):
        """Kv tile `tile`'s scores -> P in place (softcap, the masks, the online softmax);
        returns alpha, by which O is to be rescaled."""
        s_rc, bn = acc_rows_cols(acc_s), self.block_n
        if cutlass.const_expr(self.softcap > 0.0):          # (before the mask: tanh(-inf))
            softcap_scores(s_rc, softmax.softcap_prescale)
        col0 = tile * bn
        if cutlass.const_expr(self.windowed):
            if col0 + bn > keys_all or col0 < low_all:
                masking.mask_key_ranges(s_rc, s_coords, col0, lows, limits, self.window_left)
        elif col0 + bn > keys_all:                          # tail or causal diagonal
            for r in cutlass.range_constexpr(cute.size(s_coords, mode=[0])):
                for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
                    if col0 + s_coords[r, c][1] >= limits[r]:
                        s_rc[r, c] = -Float32.inf
        return softmax.step(s_rc)


class DecodeAttentionSinks(DecodeAttention):
    """The decode stage with attention sinks (`sinks=1`): the (heads,) logits after `out`."""

    def __init__(self, *args, sinks: bool = True, **kwargs):
        super().__init__(*args, **kwargs)

    def describe(self) -> dict:
        return {**super().describe(), "sinks": True}

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mSinks: cute.Tensor, mLSE: cute.Tensor, mOPart: cute.Tensor,
                 mLSEPart: cute.Tensor, mCount: cute.Tensor, scale_log2: Float32, stream):
        self.launch(mQ, mK, mV, mO, mLSE, mOPart, mLSEPart, mCount, None, None, scale_log2,
                    stream, mSinks=mSinks)

    @cute.jit
    def kv_cache_call(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                      mO: cute.Tensor, mLSE: cute.Tensor, mOPart: cute.Tensor,
                      mLSEPart: cute.Tensor, mCount: cute.Tensor, mSeqlensK: cute.Tensor,
                      mPageTable: cute.Tensor, mKDescale: cute.Tensor, mVDescale: cute.Tensor,
                      mSinks: cute.Tensor, scale_log2: Float32, stream):
        """The base class's `kv_cache_call` with the (heads,) fp32 sinks after the descales."""
        self.launch(mQ, mK, mV, mO, mLSE, mOPart, mLSEPart, mCount, mSeqlensK,
                    mPageTable if self.page_size else None, scale_log2, stream,
                    *((mKDescale, mVDescale) if self.fp8 else (None, None)), mSinks=mSinks)


SINKS_SPEC = with_sinks(SPEC)


def decode_workspace(problem, device, block_n: int = 0, stages: int = 0,
                     num_splits: int = 0) -> list:
    """[LSE (batch, heads, seqlen_q) fp32, partial O (rows, d) fp32, partial LSE (splits,
    rows) fp32, counters (items,) int32 zeroed]: sized from the shapes only. The number of
    splits is the partial LSE's first extent (the kernel's grid); with one split the partial
    buffers are placeholders the kernel never touches."""
    import torch
    splits = num_splits or num_splits_for(problem, block_n, stages)
    items = problem.batch * problem.kv_heads * m_tiles(problem)
    f32 = dict(dtype=torch.float32, device=device)
    lse = torch.empty((problem.batch, problem.heads, problem.seqlen), **f32)
    if splits == 1:
        return [lse, torch.empty((ROWS, problem.head_dim), **f32),
                torch.empty((1, ROWS), **f32), torch.zeros((4,), dtype=torch.int32,
                                                           device=device)]
    rows = items * item_rows(problem)
    return [lse, torch.empty((rows * splits, problem.head_dim), **f32),
            torch.empty((splits, rows), **f32),
            torch.zeros((max(items, 4),), dtype=torch.int32, device=device)]


def compile_kernel(problem, *, compile_options: str = "", block_n: int = 0, stages: int = 0,
                   num_splits: int = 0, combine_chunk: int = COMBINE_CHUNK, sinks: int = 0,
                   softcap: float = 0.0):
    """Compile (or fetch from the cache) the decode stage; options: block_n (kv tile), stages
    (of each of the K and V rings; both 0: `tile_for`'s choice), num_splits (0:
    `num_splits_for`'s choice; the kernel is the same for every count, only the workspace
    differs), combine_chunk (partials a combining lane loads at once; 1: one per round trip),
    sinks (1: attention sinks, a (heads,) fp32 input after `out`; docs/sinks.md), softcap
    (logit softcapping's cap, 0: none). The problem's sliding window, like the softcap, is
    compile time; without either the options (and the kernel) are those of before."""
    SPEC.check(problem, check_memory=False)     # (compile_attention checks memory too)
    if not block_n and not stages:
        block_n, stages = tile_for(problem)
    block_n, stages = tile_config(problem.head_dim, block_n, stages)
    limit = max_splits(problem.head_dim, block_n, stages)
    if num_splits < 0 or num_splits > limit:
        raise UnsupportedProblem(f"decode: num_splits must be 0 (automatic) or 1-{limit} "
                                 f"(kv tile {block_n}, {stages} stages), got {num_splits}")

    def workspace(p, device):            # (shared by every key count with its split count)
        splits = num_splits or num_splits_for(p, block_n, stages)

        def make():                      # the memory check only where memory is allocated
            SPEC.check(p)
            return decode_workspace(p, device, block_n, stages, splits)
        return shared_workspace(("decode", p.batch, p.heads, p.seqlen, p.kv_heads,
                                 p.head_dim, splits), device, make)
    workspace.checks_memory = True

    def example_workspace(p, device):
        # (compiled against two splits, so that no extent of the workspace is a 1 that the
        # compiler could take as a constant: the split count is the partial LSE's extent)
        return decode_workspace(p, device, block_n, stages, 2)

    options = {"block_n": block_n, "stages": stages, "combine_chunk": combine_chunk,
               **masking.window_options(problem)}
    if float(softcap):
        options["softcap"] = float(softcap)
    handle = compile_attention(SINKS_SPEC if sinks else SPEC,
                               DecodeAttentionSinks if sinks else DecodeAttention, problem,
                               {**options, "sinks": True} if sinks else options,
                               workspace_fn=example_workspace, compile_options=compile_options)
    handle.workspace_fn = workspace
    handle.options["num_splits"] = num_splits
    return handle


def splits_of(handle) -> int:
    """The number of splits the handle's workspace (allocated on first run) launches."""
    o = handle.options
    return o.get("num_splits") or num_splits_for(handle.problem, o["block_n"], o["stages"])


def run_kernel(handle, q, k, v, out, sinks=None):
    run_attention(handle, q, k, v, out, extra_inputs=sink_inputs(handle, sinks))


def run(handle, q, k, v, out, lse=None, softmax_scale=None, checked: bool = False,
        sinks=None):
    """`run_kernel` writing the LSE into `lse` ((batch, heads, seqlen_q) fp32; None: the
    handle's own buffer), for `attention(..., return_lse=True)`."""
    run_attention(handle, q, k, v, out, softmax_scale, checked=checked, lse=lse,
                  extra_inputs=sink_inputs(handle, sinks))
