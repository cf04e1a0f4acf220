"""The backward's per-query statistics (lse2 and D) in a kb2 consumer thread's registers.

A thread of the S^T / dP^T WGMMA (keys x queries, m64nN) holds N / 4 query columns: pairs of
adjacent queries 8 apart (query 8 j + 2 (lane % 4) + {0, 1}, j < N / 8). The four threads
of a lane quad hold different columns; the eight quads of a warp hold the same ones.

* `column_stats` (the default): every thread reads its own N / 4 values from SMEM.
* `QuadStats` (`stats_shuffle`, FlashAttention-4's way at d <= 64): quad q of a warp reads
  only the pairs j = q, q + 8, ... of its lane % 4 (N / 64 `LDS.64`, 2 at N = 128), and a
  thread takes column c's value by a warp shuffle from the quad that read it (one `SHFL`
  a column). 32 SMEM values a thread become 4 held registers, so fewer live across the
  exp2 and dS^T loops, for N / 4 shuffles a statistic.
It frees the registers that d = 64 causal's dS^T `stmatrix` stores need (the default's
32 lse2 values live across the S^T wait and the mask make them spill).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

PAIR_STRIDE = 8        # an m64nN accumulator: a thread's column pairs are 8 queries apart
QUADS = 8              # lane quads a warp


@cute.jit
def column_stats(s_rows: cute.Tensor, st_coords: cute.Tensor, stage, cols: cutlass.Constexpr):
    """Each thread's own values: `vals[c]` read from the stage's SMEM row (one `LDS.64` per
    column pair)."""
    vals = cute.make_rmem_tensor((cols,), Float32)
    for c in cutlass.range_constexpr(cols):
        vals[c] = s_rows[st_coords[0, c][1], stage]
    return vals


class QuadStats:
    """A statistic's row of one Q / dO stage shared across each warp's lane quads;
    `stats[c]`: column c's value (c as in acc_rows_cols' columns), one shuffle per column
    (the first use of c issues it, later uses take the same register)."""

    def __init__(self, s_rows: cute.Tensor, st_coords: cute.Tensor, stage, cols: int):
        if cols % (2 * QUADS) != 0:
            raise ValueError(f"stats_shuffle needs a multiple of 16 query columns, got {cols}")
        self.lane = cute.arch.lane_idx()
        quad = self.lane // 4
        row = s_rows[None, stage]
        self.held = cute.make_rmem_tensor((cols // QUADS,), Float32)
        for i in range(cols // (2 * QUADS)):
            # this quad's pair in the i-th group of 8: the thread's own pair 8 i, `quad` on
            query = st_coords[0, 2 * QUADS * i][1] + PAIR_STRIDE * quad
            ptr = row.iterator + query
            pair = cute.make_tensor(cute.make_ptr(Float32, ptr.toint(), ptr.memspace,
                                                  assumed_align=8), cute.make_layout(2))
            cute.autovec_copy(pair, cute.make_tensor(self.held.iterator + 2 * i,
                                                     cute.make_layout(2)))   # one LDS.64
        self.taken = {}

    def __getitem__(self, c: int):
        if c not in self.taken:
            pair = c // 2
            source = (pair % QUADS) * 4 + self.lane % 4        # the quad that read it
            self.taken[c] = cute.arch.shuffle_sync(self.held[c % 2 + 2 * (pair // QUADS)],
                                                   source)
        return self.taken[c]


def row_stats(s_rows: cute.Tensor, st_coords: cute.Tensor, stage, cols: int, how: str = ""):
    """lse2 or D of each S^T column this thread holds, `stats[c]`: read now into registers
    ("") or shared across lane quads ("shuffle": `QuadStats`)."""
    if how == "shuffle":
        return QuadStats(s_rows, st_coords, stage, cols)
    return column_stats(s_rows, st_coords, stage, cols)
