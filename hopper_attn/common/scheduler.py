"""Which (query tile, head, batch) work items a CTA runs, in which order (k5 on).

A work item is one query tile: block_m rows of one head of one batch entry, against all the
kv tiles it may see (`masking.TileSchedule` says which). Two schedules:

* ``persistent=False`` (k5): one CTA per work item, grid (query tiles, heads, batch). With a
  causal mask CTA x takes query tile (tiles - 1 - x): the hardware starts CTAs in launch
  order, so the longest ones start first and the short ones fill the tail. gridDim.y and .z
  are capped at 65535, so heads and batch must be too (`KernelSpec` refuses more).
* ``persistent=True`` (k6, full attention): one CTA per SM (grid = min(work items, SMs)),
  each looping over work items: first its CTA index, then every grid-th one, in the order
  of the single-tile grid (query tile fastest, then head, then batch; with a causal mask
  the query tile reversed). The CTAs running at one time share a head's K and V in L2, and
  a CTA's loads for its next work item start while it still stores the previous output
  (its producer warp runs ahead), which the single-tile schedule cannot do. Any batch x
  heads fits. With a causal mask, where work items differ in length, this static
  assignment measured slower than the hardware's own CTA scheduling (docs/k6.md), so k6
  uses it there only when heads or batch exceed 65535.
  (cutlass.utils' StaticPersistentTileScheduler walks the same kind of index, but it is
  deprecated in CuTe DSL 4.8 and moving to the examples; the loop here is a few lines.)
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Int32


def sm_count() -> int:
    """SMs of the current GPU (132 on an H100 SXM or H200; 132 when compiling without one)."""
    import torch
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 132


@dataclasses.dataclass(frozen=True)   # frozen: a compile-time constant
class TileScheduler:
    block_m: int
    causal: bool
    persistent: bool = False
    ctas: int = 132              # persistent CTAs: one per SM

    def grid(self, seqlen_q, heads, batch):
        """Host side (inside the @cute.jit __call__)."""
        m_blocks = cute.ceil_div(seqlen_q, self.block_m)
        if cutlass.const_expr(not self.persistent):
            return [m_blocks, heads, batch]
        return [cutlass.min(m_blocks * heads * batch, self.ctas), 1, 1]

    # ---- device side ----
    # Usage (every role runs the same loop, each with its own iterator):
    #     tiles = scheduler.start()
    #     m_block, head, batch, valid = scheduler.work(tiles, seqlen_q, heads, batch_size)
    #     while valid:
    #         ...
    #         tiles = scheduler.advance(tiles)
    #         m_block, head, batch, valid = scheduler.work(tiles, seqlen_q, heads, batch_size)
    # `tiles` is an Int32: the work items done (single tile) or the current linear index
    # (persistent). It is reassigned, not mutated, so the DSL carries it around the loop.
    @cute.jit
    def start(self):
        if cutlass.const_expr(not self.persistent):
            return Int32(0)
        bx, _, _ = cute.arch.block_idx()
        return cute.arch.make_warp_uniform(Int32(bx))

    @cute.jit
    def advance(self, tiles):
        if cutlass.const_expr(not self.persistent):
            return tiles + 1
        grid, _, _ = cute.arch.grid_dim()
        return cute.arch.make_warp_uniform(tiles + Int32(grid))

    @cute.jit
    def work(self, tiles, seqlen_q, heads, batch_size):
        """(query tile, head, batch, valid) of the current work item."""
        m_blocks = cute.ceil_div(seqlen_q, self.block_m)
        if cutlass.const_expr(not self.persistent):
            bx, head, batch = cute.arch.block_idx()
            m_block = bx
            if cutlass.const_expr(self.causal):
                m_block = m_blocks - 1 - bx
            return Int32(m_block), Int32(head), Int32(batch), tiles == 0
        valid = tiles < m_blocks * heads * batch_size
        m_block = tiles % m_blocks                      # (query tile, head, batch)
        rest = tiles // m_blocks
        head = rest % heads
        batch = rest // heads
        if cutlass.const_expr(self.causal):             # the longest query tiles first
            m_block = m_blocks - 1 - m_block
        # warp-uniform: ptxas may keep them in uniform registers, off the consumers' budget
        uniform = cute.arch.make_warp_uniform
        return uniform(Int32(m_block)), uniform(Int32(head)), uniform(Int32(batch)), valid
