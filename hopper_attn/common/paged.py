"""KV-cache loads for the decode stage: kv tiles gathered from a paged cache through a page
table, the tail of a request's last kv tile cleared, e4m3 tiles widened (device side,
CuTe DSL).

A paged cache is (num_pages, page_size, kv_heads, d), seen as (page_size, d, kv_heads,
num_pages) by `ndhb_view`; request b's key n lives in page `page_table[b, n // page_size]`,
row n % page_size. A kv tile of `block_n` keys is loaded as `block_n / box_rows` TMA boxes
of box_rows = min(page_size, block_n) rows:

* page_size >= block_n: one box, the whole tile, from inside one page (rows
  (n0 % page_size) ..), the page's index read from the table;
* smaller pages: one box per page, each into its rows of the swizzled tile. A box is a
  multiple of 16 rows (2 KiB at d = 64, 128-byte rows), so it starts on a whole 1024-byte
  swizzle pattern: the hardware writes it exactly as the tile's own layout would.

Every box of a tile is always issued (the stage's barrier expects a whole tile's bytes): a
box past the request's last page reads that last page again (its table slot may hold any
index, a page outside the cache included). What such rows hold never matters: their keys
are masked (a score set to -inf replaces a NaN too) and their value rows are cleared by
`clear_rows_from` before P V reads them (0 x NaN would be NaN in the WGMMA).

An e4m3 cache (`load_and_widen`, `widen_tile`, `wide_ring`): a loader warpgroup TMA-loads
e4m3 tiles (the same boxes) and widens them into 16-bit rings the consumers' WGMMAs read,
writing V's rows past the keys as zeros (docs/kvcache.md).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from hopper_attn.common import tma

def box_rows(page_size: int, block_n: int) -> int:
    """Rows of one TMA box: the kv tile, or one page where pages are smaller."""
    return min(page_size, block_n)


@cute.jit
def tile_pages(page_table: cute.Tensor, tile, batch, last_slot,
               page_size: cutlass.Constexpr, block_n: cutlass.Constexpr) -> cute.Tensor:
    """The page of each box of kv tile `tile` of request `batch` (registers, int32), all
    loads issued before any is used; `last_slot`: the request's last page-table slot that
    holds a key (boxes past it read that page again)."""
    rows = box_rows(page_size, block_n)
    pages = cute.make_rmem_tensor((block_n // rows,), Int32)
    for box in cutlass.range_constexpr(block_n // rows):
        slot = cutlass.min((tile * block_n + box * rows) // page_size, last_slot)
        pages[box] = page_table[batch, slot]
    return pages


@cute.jit
def copy_paged_tile(atom: cute.CopyAtom, cache: cute.Tensor, pages: cute.Tensor,
                    smem: cute.Tensor, tile, kv_head, barrier,
                    page_size: cutlass.Constexpr, block_n: cutlass.Constexpr):
    """Kv tile `tile` into `smem` ((block_n, d) stage) as block_n / box_rows TMA boxes on
    one barrier, box b from page pages[b]. `cache`: the TMA tensor of the (page_size, d,
    kv_heads, num_pages) view."""
    rows = box_rows(page_size, block_n)
    d = cute.size(smem, mode=[1])
    for box in cutlass.range_constexpr(block_n // rows):
        key = tile * block_n + box * rows
        src = cute.local_tile(cache[None, None, kv_head, pages[box]], (rows, d),
                              ((key % page_size) // rows, 0))
        dst = cute.local_tile(smem, (rows, d), (box, 0))
        dst_part, src_part = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                                   cute.group_modes(dst, 0, 2),
                                                   cute.group_modes(src, 0, 2))
        cute.copy(atom, src_part, dst_part, tma_bar_ptr=barrier)


@cute.jit
def clear_rows_from(tile: cute.Tensor, first_row, tidx, threads: cutlass.Constexpr):
    """Zeros in rows first_row .. of a swizzled (block_n, d) SMEM tile, 16 bytes a store
    from each of `threads` threads (the caller fences for the async proxy and syncs)."""
    rows, d = cute.size(tile, mode=[0]), cute.size(tile, mode=[1])
    chunks = d // 8
    zeros = cute.make_rmem_tensor((8,), tile.element_type)
    zeros.fill(0.0)
    for i in cutlass.range_constexpr(rows * chunks // threads):
        index = tidx + threads * i
        row = index // chunks
        if row >= first_row:
            cute.autovec_copy(zeros, cute.local_tile(tile[row, None], (8,), (index % chunks,)))


@cute.jit
def widen_tile(src: cute.Tensor, dst: cute.Tensor, tidx, threads: cutlass.Constexpr,
               first_zero_row=None):
    """An e4m3 (block_n, d) SMEM tile into a 16-bit one of the same shape (both swizzled),
    rows from `first_zero_row` on written as zeros (None: none): 16 values (16 bytes) a
    load, two 16-byte stores, from each of `threads` threads. Every load of a thread is
    issued before its first conversion (the stores could alias the loads for the compiler:
    interleaved, each load would wait for the store before it). Thread t of 8 takes row
    t % 8 of 8 neighbouring rows, the same 16 columns: 8 rows of one 128-byte swizzle span
    land in 8 distinct bank groups, for the loads and the stores alike. e4m3 is exact in
    fp16 (the descales are applied outside). The caller fences for the async proxy."""
    if cutlass.const_expr(first_zero_row is None):
        _widen(src, dst, tidx, threads, None)
    else:
        if first_zero_row >= cute.size(src, mode=[0]):     # (no row to clear: no branches)
            _widen(src, dst, tidx, threads, None)
        else:
            _widen(src, dst, tidx, threads, first_zero_row)


@cute.jit
def _widen(src: cute.Tensor, dst: cute.Tensor, tidx, threads: cutlass.Constexpr,
           first_zero_row):
    rows, d = cute.size(src, mode=[0]), cute.size(src, mode=[1])
    chunks = d // 16
    per_thread = rows * chunks // threads
    narrow = cute.make_rmem_tensor((16, per_thread), src.element_type)
    for i in cutlass.range_constexpr(per_thread):
        row, col = _chunk(tidx + threads * i, chunks)
        cute.autovec_copy(cute.local_tile(src[row, None], (16,), (col,)), narrow[None, i])
    zeros = cute.make_rmem_tensor((8,), dst.element_type)
    zeros.fill(0.0)
    for i in cutlass.range_constexpr(per_thread):
        row, col = _chunk(tidx + threads * i, chunks)
        wide = cute.make_rmem_tensor((16,), dst.element_type)
        wide.store(narrow[None, i].load().to(dst.element_type))
        for half in cutlass.range_constexpr(2):
            out = cute.local_tile(dst[row, None], (8,), (2 * col + half,))
            if cutlass.const_expr(first_zero_row is None):
                cute.autovec_copy(cute.local_tile(wide, (8,), (half,)), out)
            else:
                if row < first_zero_row:
                    cute.autovec_copy(cute.local_tile(wide, (8,), (half,)), out)
                else:
                    cute.autovec_copy(zeros, out)


def _chunk(index, chunks: int):
    """(row, 16-column chunk) of a thread's chunk `index`: rows vary fastest, 8 at a time."""
    return (index // (8 * chunks)) * 8 + index % 8, (index // 8) % chunks


def wide_ring(barriers: cute.Pointer, stages: int) -> pipeline.PipelineAsync:
    """e4m3 cache: a ring of 16-bit K or V tiles between the loader warpgroup (each of its
    128 threads arrives once its part of a tile is widened and fenced) and the consumer
    warpgroup (one arrive per warp: `tma.release_stage`); mbarriers made visible by the
    caller (`tma.barriers_ready`)."""
    return pipeline.PipelineAsync.create(
        barrier_storage=barriers, num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4), defer_sync=True)


@cute.jit
def load_and_widen(k_pipe, v_pipe, k16_pipe, v16_pipe, tma_k: cute.CopyAtom,
                   tma_v: cute.CopyAtom, mK: cute.Tensor, mV: cute.Tensor, mPageTable,
                   sK8: cute.Tensor, sV8: cute.Tensor, sK16: cute.Tensor, sV16: cute.Tensor,
                   n_first, n_count, seqlen_k, kv_head, batch, loader_tidx, issuer,
                   stages: cutlass.Constexpr, page_size: cutlass.Constexpr,
                   block_n: cutlass.Constexpr):
    """The loader warpgroup of an e4m3 cache (4 warps, `loader_tidx` 0-127): its first warp
    (`issuer`, warp-uniform) issues the TMA loads of the e4m3 rings, `stages` tiles ahead;
    all four widen each e4m3 K and V stage into the 16-bit rings (k16_pipe, v16_pipe) the
    consumers' WGMMAs read, V's rows past the request's keys as zeros (a cache may hold NaN
    there: 0 x NaN is NaN in P V). The loaders are the e4m3 rings' only consumers: a stage
    is loaded again once all four warps have widened it."""
    if cutlass.const_expr(page_size):
        last_slot = last_page_slot(seqlen_k, page_size)
    else:
        k_tiles = tma.TmaTiles.partition(tma_k, mK, kv_head, batch, sK8)
        v_tiles = tma.TmaTiles.partition(tma_v, mV, kv_head, batch, sV8)
    if issuer:
        produce = tma.producer_state(stages)
        if cutlass.const_expr(page_size):
            # every first tile's page indices in flight at once (one round trip, not stages)
            first_pages = [tile_pages(mPageTable, n_first + j, batch, last_slot, page_size,
                                      block_n) for j in range(stages)]
            for j in cutlass.range_constexpr(stages):
                if j < n_count:
                    load_paged(k_pipe, v_pipe, tma_k, tma_v, mK, mV, first_pages[j], sK8, sV8,
                               produce, n_first + j, kv_head, page_size, block_n)
                produce.advance()
        else:
            for j in cutlass.range(cutlass.min(stages, n_count), unroll=1):
                load_tiles(k_pipe, v_pipe, k_tiles, v_tiles, produce, n_first + j)
                produce.advance()
    landed = tma.consumer_state(stages)
    widened = tma.producer_state(cute.size(sK16, mode=[2]))
    for j in cutlass.range(n_count, unroll=1):
        if cutlass.const_expr(page_size):     # the refill's pages, in flight while it widens
            pages = tile_pages(mPageTable, n_first + j + stages, batch, last_slot, page_size,
                               block_n)
        k_pipe.consumer_wait(landed)
        k16_pipe.producer_acquire(widened)
        widen_tile(sK8[None, None, landed.index], sK16[None, None, widened.index],
                   loader_tidx, 128)
        cute.arch.fence_proxy("async.shared", space="cta")     # for the WGMMAs
        k16_pipe.producer_commit(widened)
        v_pipe.consumer_wait(landed)
        v16_pipe.producer_acquire(widened)
        widen_tile(sV8[None, None, landed.index], sV16[None, None, widened.index],
                   loader_tidx, 128, seqlen_k - (n_first + j) * block_n)
        cute.arch.fence_proxy("async.shared", space="cta")
        v16_pipe.producer_commit(widened)
        tma.release_stage(k_pipe, landed)
        tma.release_stage(v_pipe, landed)
        if issuer:
            if j + stages < n_count:
                # tile j + stages: the producer's stage and phase are tile j's consumer ones
                refill = landed.clone()
                if cutlass.const_expr(page_size):
                    load_paged(k_pipe, v_pipe, tma_k, tma_v, mK, mV, pages, sK8, sV8, refill,
                               n_first + j + stages, kv_head, page_size, block_n)
                else:
                    load_tiles(k_pipe, v_pipe, k_tiles, v_tiles, refill, n_first + j + stages)
        landed.advance()
        widened.advance()


@cute.jit
def load_tiles(k_pipe, v_pipe, k_tiles, v_tiles, produce, tile):
    """Contiguous K and V (`tma.TmaTiles`): tile `tile` into `produce`'s stages of the two
    rings (each waited for empty first)."""
    tma.acquire_empty(k_pipe, produce)
    k_tiles.copy(tile, k_pipe.producer_get_barrier(produce), produce.index)
    tma.acquire_empty(v_pipe, produce)
    v_tiles.copy(tile, v_pipe.producer_get_barrier(produce), produce.index)


@cute.jit
def load_paged(k_pipe, v_pipe, tma_k, tma_v, mK, mV, pages, sK8, sV8, produce, tile,
               kv_head, page_size: cutlass.Constexpr, block_n: cutlass.Constexpr):
    """Paged cache: K and V tile `tile` into `produce`'s stages of the two rings (sK8,
    sV8: e4m3 or 16-bit), box b from page pages[b] (`tile_pages`)."""
    tma.acquire_empty(k_pipe, produce)
    copy_paged_tile(tma_k, mK, pages, sK8[None, None, produce.index], tile, kv_head,
                    k_pipe.producer_get_barrier(produce), page_size, block_n)
    tma.acquire_empty(v_pipe, produce)
    copy_paged_tile(tma_v, mV, pages, sV8[None, None, produce.index], tile, kv_head,
                    v_pipe.producer_get_barrier(produce), page_size, block_n)


@cute.jit
def produce_kv(k_pipe, v_pipe, tma_k, tma_v, mK, mV, mPageTable, sK, sV, n_first, n_count,
               seqlen_k, kv_head, batch, stages: cutlass.Constexpr,
               page_size: cutlass.Constexpr, block_n: cutlass.Constexpr):
    """The decode producer warp's loop: K_j and V_j of kv tiles n_first .. n_first + n_count
    - 1 into the rings, by pages (`page_size` > 0: each tile's page indices read first, in
    flight while it waits for a free stage) or as one contiguous box per tile."""
    if cutlass.const_expr(page_size):
        last_slot = last_page_slot(seqlen_k, page_size)
    else:
        k_tiles = tma.TmaTiles.partition(tma_k, mK, kv_head, batch, sK)
        v_tiles = tma.TmaTiles.partition(tma_v, mV, kv_head, batch, sV)
    produce = tma.producer_state(stages)
    for j in cutlass.range(n_count, unroll=1):
        if cutlass.const_expr(page_size):
            pages = tile_pages(mPageTable, n_first + j, batch, last_slot, page_size, block_n)
            load_paged(k_pipe, v_pipe, tma_k, tma_v, mK, mV, pages, sK, sV, produce,
                       n_first + j, kv_head, page_size, block_n)
        else:
            load_tiles(k_pipe, v_pipe, k_tiles, v_tiles, produce, n_first + j)
        produce.advance()


def last_page_slot(seqlen_k, page_size: int):
    """The page-table slot of a request's last key (0 for an empty request)."""
    return cutlass.max(seqlen_k - 1, Int32(0)) // page_size
