"""k6 over a packed query batch and a paged KV cache (chunked prefill; docs/kvcache.md).

What changes from k6_varlen (the `page_size` of FlashAttentionK6Paged):

* K and V come from a paged cache (num_pages, page_size, kv_heads, d) through an int32
  (batch, max_pages) page table: the producer warp loads each kv tile as boxes of the
  pages the table names (common/paged_prefill.py), one box per tile where a page holds
  whole tiles, else one per page (its TMA atoms then have page-sized boxes: `kv_boxes`).
  Each box is clipped at the request's last key by TMA's bounds check, so rows past it
  arrive as zeros whatever the cache holds there.
* Request b's keys: `seqused_k[b]` (cache_seqlens, + the appended keys); there are no key
  offsets (the kernel's cu_seqlens_k argument is cu_seqlens_q again, never used for keys).
* The kv tile must divide a page or be a multiple of one: where the POLICY row's does
  neither (d 192 and 256 with pages of 32 or more), the tile is 64 keys.
What stays: everything else of k6_varlen (work list, masks, ragged Q and O, the LSE,
attention sinks: `sinks=True`, the (heads,) fp32 logits the last argument).

Budget: k6_varlen's (SMEM, threads, registers: the producer's 24 hold one box at a time).
"""

from __future__ import annotations

from typing import Optional

import cutlass.cute as cute
import torch

from hopper_attn.common import paged, tma
from hopper_attn.common.contract import LOG2_E, Problem, work_counter
from hopper_attn.common.layouts import smem_tile_layout
from hopper_attn.common.paged_prefill import PagedKVLoads
from hopper_attn.k6 import SPEC
from hopper_attn.k6_varlen import FlashAttentionK6Varlen, settings_for_varlen

PAGE_SIZES = (16, 32, 64, 128, 256)


class FlashAttentionK6Paged(FlashAttentionK6Varlen):

    def __init__(self, *args, page_size: int, **kwargs):
        super().__init__(*args, **kwargs)
        if page_size not in PAGE_SIZES or (page_size % self.block_n and
                                           self.block_n % page_size):
            raise ValueError(f"k6_paged: page_size {page_size} (one of {PAGE_SIZES}) and "
                             f"the kv tile {self.block_n} must divide one another")
        self.page_size = page_size

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mCounter: cute.Tensor, scale_log2, stream,
                 mCuSeqlensQ: cute.Tensor, mSeqUsedK: cute.Tensor, mPageTable: cute.Tensor,
                 mSinks: Optional[cute.Tensor] = None):
        # (q, o (1, total_q, H, d); k, v (1, num_pages x page_size, H_kv, d): the cache's
        # tokens; cu_seqlens_q (batch + 1), seqused_k (batch), the page table (batch,
        # max_pages), int32; attention sinks: fp32 (H,), or None)
        self.launch(mQ, mK, mV, mO, mLSE, mCounter, scale_log2, stream, mSinks, mCuSeqlensQ,
                    mCuSeqlensQ, mSeqUsedK, mPageTable)

    def kv_boxes(self, atoms, coords, k: cute.Tensor, v: cute.Tensor):
        rows = paged.box_rows(self.page_size, self.block_n)
        if rows == self.block_n:
            return atoms, coords
        box = smem_tile_layout(self.dtype, rows, self.head_dim)
        (tma_k, k_coords), (tma_v, v_coords) = (tma.make_tma_load(t, box, rows, self.head_dim)
                                                for t in (k, v))
        return (atoms[0], tma_k, tma_v), (coords[0], k_coords, v_coords)

    def sequence_loads(self, loads: tma.SplitKVLoads, head, kv_head, seq, batch):
        return PagedKVLoads.bind(loads, self.page_table, head, kv_head, seq, batch,
                                 self.page_size, self.block_n)


def settings_for_paged(problem: Problem, page_size: int, **overrides) -> dict:
    """k6_varlen's settings, with a 64-key tile where the row's neither divides a page nor
    is a multiple of one."""
    settings = settings_for_varlen(problem, **overrides)
    bn = settings["block_n"]
    if page_size % bn and bn % page_size:
        settings["block_n"] = 64
    return settings


_COMPILED: dict = {}


def compile_paged(problem: Problem, page_size: int, compile_options: str = "",
                  sinks: bool = False, **overrides):
    """(compiled function, kernel object) of k6 over a paged cache of `page_size` for
    `problem`'s head dim, mask, dtype, window and POLICY row (cached); `sinks`: with
    attention sinks (one more argument, last)."""
    from hopper_attn.common import cute_runtime as rt
    import cutlass
    SPEC.check(problem, check_memory=False)
    settings = settings_for_paged(problem, page_size, **overrides)
    key = (problem.head_dim, problem.causal, problem.dtype, page_size,
           tuple(sorted(settings.items())), compile_options, bool(sinks))
    hit = _COMPILED.get(key)
    if hit is not None:
        return hit
    kernel = FlashAttentionK6Paged(problem.head_dim, problem.causal, page_size=page_size,
                                   **settings)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    total, heads, d, batch = 256, 2, problem.head_dim, 2
    qkvo = [torch.empty((1, total, heads, d), dtype=problem.dtype, device=device)
            for _ in range(4)]
    lse = torch.empty((1, heads, total), dtype=torch.float32, device=device)
    ints = [torch.zeros(shape, dtype=torch.int32, device=device)
            for shape in ((batch + 1,), (batch,), (batch, 4))]
    stream = rt.current_stream() if torch.cuda.is_available() else rt.make_fake_stream()
    args = [rt.to_cute_tensor(t) for t in (*qkvo, lse, work_counter(device))]
    options = compile_options.strip()
    extra = {"options": options} if options else {}
    tail = [_int_tensor(t) for t in ints]
    if sinks:
        tail.append(rt.to_cute_tensor(torch.zeros(heads, dtype=torch.float32, device=device)))
    compiled = cute.compile(kernel, *args, cutlass.Float32(1.0), stream, *tail, **extra)
    _COMPILED[key] = (compiled, kernel)
    return compiled, kernel


def _int_tensor(t: torch.Tensor):
    """A small int32 tensor read one element at a time (4-byte aligned: a slice of a larger
    page table or of cache_seqlens is fine)."""
    from cutlass.cute.runtime import from_dlpack
    return from_dlpack(t.detach(), assumed_align=4).mark_layout_dynamic(
        leading_dim=t.dim() - 1)


# The last call's CuTe tensors of its inputs (as k6_varlen's run_varlen)
_BOUND: dict = {}


def run_paged(compiled, q, k, v, out, lse, cu_seqlens_q, seqused_k, page_table,
              softmax_scale: float, sinks: Optional[torch.Tensor] = None) -> None:
    """Launch on the current stream: q, out (total_q, H, d); k, v (num_pages x page_size,
    H_kv, d): the cache's tokens; lse (H, total_q) fp32; sinks (H,) fp32 for (and only for)
    a kernel compiled with them. Nothing here reads the device tensors' contents
    (CUDA-graph capturable)."""
    from hopper_attn.common import cute_runtime as rt
    import cutlass
    if q.shape[0] == 0:
        return
    inputs = (q, k, v, work_counter(q.device), cu_seqlens_q, seqused_k, page_table)
    key = tuple((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in inputs)
    bound = _BOUND.get(key)
    if bound is None:
        bound = [rt.to_cute_tensor(t.unsqueeze(0)) for t in inputs[:3]]
        bound += [rt.to_cute_tensor(inputs[3])] + [_int_tensor(t) for t in inputs[4:]]
        _BOUND.clear()
        _BOUND[key] = bound
    outputs = [rt.to_cute_tensor(t.unsqueeze(0)) for t in (out, lse)]
    extra = () if sinks is None else (rt.to_cute_tensor(sinks),)
    compiled(*bound[:3], *outputs, bound[3], cutlass.Float32(softmax_scale * LOG2_E),
             rt.current_stream(), *bound[4:], *extra)


__all__ = ["FlashAttentionK6Paged", "compile_paged", "run_paged", "settings_for_paged",
           "PAGE_SIZES"]
