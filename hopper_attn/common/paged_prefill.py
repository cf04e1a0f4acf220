"""K and V tiles of a paged KV cache for k6's producer warp (k6_paged.py: chunked prefill),
device side.

The cache (num_pages, page_size, kv_heads, d), its pages page_size tokens apart (the
usual layout, vLLM's and FlashAttention's), is read as a packed tensor of tokens
(common/varlen.py's ragged TMA view over (num_pages x page_size, kv_heads, d)): page p
starts at token p x page_size. A kv tile of block_n keys is loaded as block_n / box_rows
boxes (common/paged.py's: one box of one page where pages hold a whole tile, else one box
per page), each box addressed as a "sequence" of the ragged view: the page's first token
as its offset and, as its length, the request's keys in that page (0 .. page_size). TMA's bounds check then zero-fills every row
past the request's last key, in K and in V, whatever the page holds there (NaN of a fresh
cache, other requests' keys) and whatever page a slot past the request's last one names:
P V never multiplies a stale value (0 x NaN is NaN), and no consumer clears rows (decode's
`clear_rows_from`, which needs every reader of the tile to wait for the clearing threads).
K's rows past the keys are masked as in any varlen sequence.

The page indices of a tile are read from the page table before the producer waits for the
ring stage, so the table's load latency hides under that wait: into registers where a tile
has one or two boxes, else one index per lane of the producer warp (all loads at once),
box b's taken from lane b by a shuffle (`PREFETCHED_BOXES`).
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from hopper_attn.common import paged, tma, varlen


# tiles of at most this many boxes hold their page indices in registers; with more, one
# per lane of the producer warp, and the boxes are issued by a loop, one at a time (8
# indices in registers, or 8 unrolled boxes, spill the producer warp's 24 registers)
PREFETCHED_BOXES = 2


@dataclasses.dataclass(frozen=True)
class PagedKVLoads(tma.SplitKVLoads):
    """`tma.SplitKVLoads` of one work item whose K and V tiles come from the pages of
    request `batch` (Q from its packed queries, as in any varlen item). `load_k` /
    `load_v` keep SplitKVLoads' contract: wait for the stage, arm it with a tile's bytes,
    issue the tile's boxes."""

    page_table: cute.Tensor = None      # (batch, max_pages) int32
    batch: Int32 = None
    kv_head: Int32 = None
    seqlen_k: Int32 = None              # the request's keys
    page_size: int = 0
    block_n: int = 0

    @staticmethod
    def bind(loads: tma.SplitKVLoads, page_table: cute.Tensor, head, kv_head,
             seq: varlen.SeqInfo, batch, page_size: int, block_n: int) -> "PagedKVLoads":
        q = varlen.sequence_loads(loads, head, kv_head, seq).q
        fields = {f.name: getattr(loads, f.name) for f in dataclasses.fields(loads)}
        fields.update(q=q, page_table=page_table, batch=batch, kv_head=kv_head,
                      seqlen_k=seq.seqlen_k, page_size=page_size,
                      block_n=block_n)
        return PagedKVLoads(**fields)

    def load_k(self, state, tile_index):
        self._load(self.k_pipe, self.atoms[1], self.tensors[1], self.smem[1], state,
                   tile_index)

    def load_v(self, state, tile_index):
        self._load(self.v_pipe, self.atoms[2], self.tensors[2], self.smem[2], state,
                   tile_index)

    def _load(self, pipe, atom: cute.CopyAtom, tensor: cute.Tensor, smem: cute.Tensor, state,
              tile_index):
        last_slot = paged.last_page_slot(self.seqlen_k, self.page_size)
        # the page indices in flight during the wait: in registers (a box or two), or one
        # per lane of the producer warp (`lane_pages`)
        if self.block_n // paged.box_rows(self.page_size, self.block_n) <= PREFETCHED_BOXES:
            pages = paged.tile_pages(self.page_table, tile_index, self.batch, last_slot,
                                     self.page_size, self.block_n)
        else:
            pages = lane_pages(self.page_table, tile_index, self.batch, last_slot,
                               self.page_size, self.block_n)
        self.acquire(pipe, state)
        copy_page_boxes(atom, tensor, smem[None, None, state.index], tile_index,
                        self.kv_head, self.seqlen_k, pipe.producer_get_barrier(state),
                        pages, self.page_size, self.block_n)


@cute.jit
def lane_pages(page_table: cute.Tensor, tile, batch, last_slot,
               page_size: cutlass.Constexpr, block_n: cutlass.Constexpr):
    """The page of box `lane` of kv tile `tile` (lanes past the tile's boxes: its last
    box's), one int32 per lane of the producer warp, every lane's load issued at once;
    `copy_page_boxes` takes box b's from lane b by a shuffle."""
    rows = paged.box_rows(page_size, block_n)
    box = cutlass.min(cute.arch.lane_idx(), block_n // rows - 1)
    return page_table[batch, cutlass.min((tile * block_n + box * rows) // page_size,
                                         last_slot)]


@cute.jit
def copy_page_boxes(atom: cute.CopyAtom, tensor: cute.Tensor, smem: cute.Tensor, tile,
                    kv_head, seqlen_k, barrier, pages, page_size: cutlass.Constexpr,
                    block_n: cutlass.Constexpr):
    """Kv tile `tile` into `smem` ((block_n, d) stage) as block_n / box_rows boxes on one
    barrier, box b from page pages[b] (`paged.tile_pages`; with more than PREFETCHED_BOXES
    boxes lane b's `lane_pages`) of the ragged view `tensor` (see the module doc); rows at or
    past `seqlen_k` arrive as zeros."""
    rows = paged.box_rows(page_size, block_n)
    if cutlass.const_expr(block_n // rows > PREFETCHED_BOXES):
        # a loop, not unrolled: one box's page, length and coordinates live at a time (the
        # producer warp has 24 registers), the page from lane `box` (`lane_pages`)
        for box in cutlass.range(block_n // rows, unroll=1):
            _copy_box(atom, tensor, smem, tile * block_n + box * rows, box,
                      cute.arch.shuffle_sync(pages, box), kv_head, seqlen_k, barrier,
                      page_size, rows)
    else:
        for box in cutlass.range_constexpr(block_n // rows):
            _copy_box(atom, tensor, smem, tile * block_n + box * rows, box, pages[box],
                      kv_head, seqlen_k, barrier, page_size, rows)


@cute.jit
def _copy_box(atom: cute.CopyAtom, tensor: cute.Tensor, smem: cute.Tensor, key, box, page,
              kv_head, seqlen_k, barrier, page_size: cutlass.Constexpr,
              rows: cutlass.Constexpr):
    """Keys key .. key + rows - 1 (one page's) into rows box x rows .. of the stage."""
    d = cute.size(smem, mode=[1])
    first = key // page_size * page_size            # the page's first key in the request
    length = cutlass.max(cutlass.min(seqlen_k - first, page_size), 0)
    view = varlen.sequence_rows(tensor, length)[
        None, None, kv_head, varlen.sequence_batch(page * page_size, length)]
    src = cute.local_tile(view, (rows, d), ((key - first) // rows, 0))
    dst = cute.local_tile(smem, (rows, d), (box, 0))
    dst_part, src_part = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                               cute.group_modes(dst, 0, 2),
                                               cute.group_modes(src, 0, 2))
    cute.copy(atom, src_part, dst_part, tma_bar_ptr=barrier)
