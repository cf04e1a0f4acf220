"""KV-cache loads for the decode stage: kv tiles gathered from a paged cache through a page
table, and the tail of a request's last kv tile cleared (device side, CuTe DSL).

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
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

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
def widen_tile(src: cute.Tensor, dst: cute.Tensor, tidx, threads: cutlass.Constexpr):
    """An e4m3 (block_n, d) SMEM tile into a 16-bit one of the same shape (both swizzled):
    16 bytes (16 values) a load, two 16-byte stores, from each of `threads` threads (e4m3
    is exact in bf16 and fp16: the descales are applied outside). The caller fences for the
    async proxy and syncs."""
    rows, d = cute.size(src, mode=[0]), cute.size(src, mode=[1])
    chunks = d // 16
    for i in cutlass.range_constexpr(rows * chunks // threads):
        index = tidx + threads * i
        row = index // chunks
        col = index % chunks
        narrow = cute.make_rmem_tensor((16,), src.element_type)
        cute.autovec_copy(cute.local_tile(src[row, None], (16,), (col,)), narrow)
        wide = cute.make_rmem_tensor((16,), dst.element_type)
        wide.store(narrow.load().to(dst.element_type))
        for half in cutlass.range_constexpr(2):
            cute.autovec_copy(cute.local_tile(wide, (8,), (half,)),
                              cute.local_tile(dst[row, None], (8,), (2 * col + half,)))


def last_page_slot(seqlen_k, page_size: int):
    """The page-table slot of a request's last key (0 for an empty request)."""
    return cutlass.max(seqlen_k - 1, Int32(0)) // page_size
