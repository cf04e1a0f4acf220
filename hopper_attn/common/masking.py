"""Which tiles a CTA visits and which scores it masks (device side), shared by every kernel.

A CTA owns query rows [m_block * BM, (m_block + 1) * BM) and walks kv tiles of BN columns.

* Tails: the last kv tile may run past the sequence; its columns >= seqlen are masked.
  (Rows >= seqlen of the last query tile are computed on zero-filled Q and never stored.)
* Causal (query i sees keys j <= i): kv tiles entirely right of the diagonal are skipped,
  tiles entirely left of it need no mask, and only the tiles the diagonal crosses are masked.
  With seqlen_k != seqlen_q (k5 on: `n_block_count_kv`, `needs_mask_kv`) the diagonal is aligned
  bottom-right: query i sees keys j <= i + seqlen_k - seqlen_q.
* Sliding window (FlashAttention's `window_size` = (left, right); None: unbounded on that
  side; with causal the right side is 0): query i, at row position r = i + seqlen_k -
  seqlen_q, sees keys r - left <= j <= r + right. A side may be negative (a shifted
  diagonal, e.g. right = -1: keys before the row's own): then a tile's range can hold no
  key of some (or all) of its rows, and the ranges are clamped so that every query tile
  still walks one kv tile and every kv tile one query tile (fully masked where no key is
  seen; `shifted`). A query tile visits only the kv tiles
  between its first row's low limit and its last row's high limit (`n_block_first`,
  `n_block_count_kv`), so the cost grows with the window, not N; masked are only the tiles
  the window's left edge, its right (causal) edge or the key tail cross. The window sizes
  are compile-time fields: without a window every method compiles to the code it had before.
  `window_ranges` and `window_m_range` are the same ranges on the host (tests, estimates).
  Rows that are not consecutive queries (the decode stage's packed (query, head) rows):
  `query_keys` gives one query's [low, limit), `mask_key_ranges` masks by those per row.
* GQA backward (host side): `dkv_parts`, how many parts each k/v head's dK / dV is split
  in, from an estimate of the grid's time in KVTileSchedule's launch order.
* Scheduling: with a causal mask the last query tiles do the most work, so CTA x takes query
  tile (num_m_blocks - 1 - x): the longest CTAs start first and the short ones fill the tail.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32

from hopper_attn.common.scheduler import head_group_order, heads_per_group


@dataclasses.dataclass(frozen=True)   # frozen: a compile-time constant inside dynamic loops
class TileSchedule:
    block_m: int
    block_n: int
    causal: bool
    # False: every kv tile is whole (seqlen_k a multiple of block_n, known when compiling):
    # no tail mask, so without a causal mask the loop has no mask test at all (k6's kv_tail)
    kv_tail: bool = True
    # the sliding window (see the module doc); None: unbounded on that side
    window_left: Optional[int] = None
    window_right: Optional[int] = None
    # a packed batch (common/varlen.py): a sequence may have no keys at all; its query
    # tiles still visit one (zero-filled, fully masked) kv tile, as rows that see no key do
    varlen: bool = False

    @property
    def bounded_right(self) -> bool:
        """Keys right of a row's limit are hidden (causal, or a window's right side)."""
        return self.causal or self.window_right is not None

    @property
    def right(self) -> int:
        """How far right of the diagonal a row sees (0 with causal; negative: left of it;
        0 where unbounded, unused then)."""
        return 0 if self.causal or self.window_right is None else self.window_right

    @property
    def windowed(self) -> bool:
        return self.window_left is not None or (self.window_right is not None
                                                and not self.causal)

    @property
    def shifted(self) -> bool:
        """A side is negative: a tile's rows may see none of its kv range's keys."""
        return shifted_window(self.window_left, None if self.causal else self.window_right)

    def grid(self, seqlen, heads, batch):
        return [cute.ceil_div(seqlen, self.block_m), heads, batch]

    @cute.jit
    def m_block(self, seqlen) -> Int32:
        bx, _, _ = cute.arch.block_idx()
        m_block = bx
        if cutlass.const_expr(self.causal):
            m_block = cute.ceil_div(seqlen, self.block_m) - 1 - bx
        return m_block

    @cute.jit
    def n_block_count(self, m_block, seqlen) -> Int32:
        """Number of kv tiles this CTA visits (kv tiles 0 .. count-1)."""
        count = cute.ceil_div(seqlen, self.block_n)
        if cutlass.const_expr(self.causal):
            # the last visible column is the last row of this query tile
            count = cutlass.min(count, cute.ceil_div((m_block + 1) * self.block_m, self.block_n))
        return count

    @cute.jit
    def work(self, seqlen):
        """(query tile, number of kv tiles) of the calling CTA."""
        m_block = self.m_block(seqlen)
        return m_block, self.n_block_count(m_block, seqlen)

    @cute.jit
    def n_block_count_kv(self, m_block, seqlen_q, seqlen_k) -> Int32:
        """The kv tiles query tile `m_block` visits when keys and queries may differ in
        length (k5 on). The causal mask is then aligned bottom-right, as in FlashAttention:
        query i sees keys j <= i + seqlen_k - seqlen_q. At least one kv tile is visited, so
        that a query tile whose rows see no key at all still runs (fully masked, its rows
        are written as 0)."""
        return self.n_block_count_rows(m_block, self.block_m, seqlen_q, seqlen_k)

    @cute.jit
    def n_block_count_rows(self, m_block, rows, seqlen_q, seqlen_k, n_base=None) -> Int32:
        """`n_block_count_kv` for the first `rows` query rows of tile m_block only (k6's
        `wg_causal_limit`: a consumer warpgroup's rows end `rows` = 64 (wg + 1) into the tile,
        and with a causal mask the upper warpgroups may see one kv tile fewer); with a
        window's left side counted from the item's first kv tile, n_base."""
        count = cute.ceil_div(seqlen_k, self.block_n)
        if cutlass.const_expr(self.bounded_right):
            visible = m_block * self.block_m + rows + seqlen_k - seqlen_q
            if cutlass.const_expr(self.right != 0):
                visible = visible + self.right
            if cutlass.const_expr(self.right < 0):   # (the last query's limit is below nk)
                visible = cutlass.min(visible, seqlen_k + self.right)
            visible = cutlass.max(visible, 1)
            count = cutlass.min(count, cute.ceil_div(visible, self.block_n))
        if cutlass.const_expr(self.varlen):
            count = cutlass.max(count, 1)
        if cutlass.const_expr(self.window_left is not None and n_base is not None):
            count = count - n_base
            if cutlass.const_expr(self.shifted):
                count = cutlass.max(count, 1)   # (rows that see none of the item's keys)
        return count

    @cute.jit
    def n_block_first(self, m_block, seqlen_q, seqlen_k, row=None) -> Int32:
        """The first kv tile query tile m_block visits: 0, or with a window's left side the
        tile of its first row's lowest key. Always below `n_block_count_kv` (a row's low
        limit is at most its high one, and at most seqlen_k - 1; with a negative side
        neither need hold, so it is clamped there). `row`: from the tile's row `row` on
        (k6's per-warpgroup window start)."""
        first = Int32(0)
        if cutlass.const_expr(self.window_left is not None):
            low = m_block * self.block_m + seqlen_k - seqlen_q - self.window_left
            if cutlass.const_expr(row is not None):
                low = low + row
            first = cutlass.max(low, 0) // self.block_n
            if cutlass.const_expr(self.shifted):
                first = cutlass.min(first, self.n_block_count_rows(
                    m_block, self.block_m, seqlen_q, seqlen_k) - 1)
        return first

    @cute.jit
    def needs_mask_kv(self, m_block, n_block, seqlen_q, seqlen_k):
        """`needs_mask` with the bottom-right causal diagonal of `n_block_count_kv`."""
        if cutlass.const_expr(self.windowed):
            return self.needs_window_mask(m_block, n_block, seqlen_q, seqlen_k)
        last_col = (n_block + 1) * self.block_n - 1
        if cutlass.const_expr(not self.kv_tail):
            if cutlass.const_expr(not self.causal):
                return False
            return last_col > m_block * self.block_m + seqlen_k - seqlen_q
        needs = last_col >= seqlen_k
        if cutlass.const_expr(self.causal):
            needs = needs or last_col > m_block * self.block_m + seqlen_k - seqlen_q
        return needs

    @cute.jit
    def needs_window_mask(self, m_block, n_block, seqlen_q, seqlen_k):
        """`needs_mask_kv` with a window: the key tail, a key right of the first row's high
        limit, or one left of the last row's low limit."""
        last_col = (n_block + 1) * self.block_n - 1
        diagonal = m_block * self.block_m + seqlen_k - seqlen_q     # the first row's position
        needs = last_col >= seqlen_k if cutlass.const_expr(self.kv_tail) else False
        if cutlass.const_expr(self.bounded_right):
            needs = needs or last_col > diagonal + self.right
        if cutlass.const_expr(self.window_left is not None):
            needs = needs or n_block * self.block_n < \
                diagonal + (self.block_m - 1 - self.window_left)
        return needs

    @cute.jit
    def needs_mask(self, m_block, n_block, seqlen):
        """True if kv tile `n_block` has a column past the end or right of the diagonal."""
        last_col = (n_block + 1) * self.block_n - 1
        needs = last_col >= seqlen
        if cutlass.const_expr(self.causal):
            needs = needs or last_col > m_block * self.block_m
        return needs


@cute.jit
def mask_scores(s_rc: cute.Tensor, coords_rc: cute.Tensor, row0: Int32, col0: Int32,
                seqlen: Int32, causal: cutlass.Constexpr[bool], causal_offset: Int32 = 0,
                transposed: cutlass.Constexpr[bool] = False,
                per_row_limit: cutlass.Constexpr[bool] = False,
                right: cutlass.Constexpr[int] = 0, left: cutlass.Constexpr = None):
    """Set s to -inf where the key is past the end (`seqlen` keys), or, if causal, after
    the query shifted by `causal_offset` (seqlen_k - seqlen_q: bottom-right alignment).
    A sliding window: `causal` then means the right side is bounded, `right` keys past the
    shifted query (0: causal; negative: before it), and `left` (not None; any sign) also
    hides keys before query + causal_offset - left (two limits per row).

    `coords_rc[r, c]` is the (row, col) of register s_rc[r, c] inside the tile; row0 and col0
    are the tile's offsets in the sequence. Rows are queries and columns keys, or, with
    `transposed` (the backward's S^T), rows are keys and columns queries.

    `per_row_limit` (rows are queries): one limit per row, the first hidden key
    (min(seqlen, query + causal_offset + 1)), and one compare per element instead of two.
    Fewer instructions and registers in the masked tile (k7 at d = 256 spills without it);
    measured on k6 (docs/k7.md): a tie at d = 128 and 256, 3-4% slower at d = 64, so only k7
    uses it.
    """
    minus_inf = s_rc.element_type(-Float32.inf)        # (fp32, or k7's fp16 scores)
    if cutlass.const_expr(transposed and left is not None):
        # the backward with a window's left side: in terms of key - query - offset (one
        # register, `base`, plus the coordinates), a compare against each window edge
        base = row0 - col0 - causal_offset
        tail = seqlen - row0                            # keys from here on are past the end
        for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
                key_in_tile = coords_rc[r, c][0]
                apart = key_in_tile - coords_rc[r, c][1] + base
                hidden = key_in_tile >= tail or apart < -left
                if cutlass.const_expr(causal):
                    hidden = hidden or apart > right
                if hidden:
                    s_rc[r, c] = minus_inf
    elif cutlass.const_expr(per_row_limit and not transposed):
        for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
            limit = seqlen
            if cutlass.const_expr(causal):
                if cutlass.const_expr(right != 0):
                    limit = cutlass.min(limit, coords_rc[r, 0][0] + row0 + causal_offset
                                        + (1 + right))
                else:
                    limit = cutlass.min(limit, coords_rc[r, 0][0] + row0 + causal_offset + 1)
            if cutlass.const_expr(left is not None):
                low = coords_rc[r, 0][0] + row0 + causal_offset - left
                for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
                    col = coords_rc[r, c][1] + col0
                    if col >= limit or col < low:
                        s_rc[r, c] = minus_inf
            else:
                for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
                    if coords_rc[r, c][1] + col0 >= limit:
                        s_rc[r, c] = minus_inf
    else:
        for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
                row = coords_rc[r, c][0] + row0
                col = coords_rc[r, c][1] + col0
                query, key = (col, row) if cutlass.const_expr(transposed) else (row, col)
                hidden = key >= seqlen
                if cutlass.const_expr(causal):
                    if cutlass.const_expr(right != 0):
                        hidden = hidden or key > query + causal_offset + right
                    else:
                        hidden = hidden or key > query + causal_offset
                if cutlass.const_expr(left is not None):
                    hidden = hidden or key < query + causal_offset - left
                if hidden:
                    s_rc[r, c] = minus_inf


# ---- a window's masked tiles by bit masks (k6's `window_mask="bits"`) ----
# A thread's scores of one row of a WGMMA accumulator ([row, col] view, layouts.acc_rows_cols)
# lie at columns thr_col + 8 (c // 2) + c % 2 for its c-th element (column pairs 8 apart):
# the element offsets are compile-time, only thr_col (2 (lane % 4)) is not. So per row the
# window's two limits become two counts of elements (those left of each limit), the counts one
# 32-bit keep mask, and each element a test of a compile-time bit (ptxas may take 7 at once
# with R2P): per element a select and (at most) a bit test, instead of two or three compares
# on its own column (mask_scores). FlashAttention-4's sm90 masks work the same way.

def window_elements_below(limit: int, span: int) -> int:
    """Host mirror of `_elements_below`: how many of a thread's elements lie at offsets <
    limit (offsets 8 (c // 2) + c % 2 below span = 8 x pairs)."""
    t = min(max(limit, 0), span)
    return (t >> 3) * 2 + min(t & 7, 2)


def window_keep_bits(position: int, tail: int, cols: int, bounded_right: bool, right: int,
                     left: Optional[int]) -> int:
    """Host mirror of one row of `mask_window_bits`: the keep mask of a thread's `cols`
    elements, `position` (query + offset) and `tail` (seqlen) counted from its first column."""
    span = 8 * ((cols + 1) // 2)
    limit = min(tail, position + right + 1) if bounded_right else tail
    keep = (1 << window_elements_below(limit, span)) - 1
    if left is not None:
        keep &= ~((1 << window_elements_below(position - left, span)) - 1)
    return keep


@cute.jit
def _elements_below(limit, span: cutlass.Constexpr[int]):
    t = cutlass.min(cutlass.max(limit, 0), span)
    return (t >> 3) * 2 + cutlass.min(t & 7, 2)


@cute.jit
def _low_bits(count):
    """The `count` (0 .. 32) low bits set, without a 32-bit shift by 32 (undefined): two
    shifts of at most 16, the 2^32 of count = 32 wrapping to 0 before the - 1."""
    half = Uint32(count >> 1)
    return ((Uint32(1) << half) << (Uint32(count) - half)) - Uint32(1)


@cute.jit
def mask_window_bits(s_rc: cute.Tensor, coords_rc: cute.Tensor, row0: Int32, col0: Int32,
                     seqlen: Int32, bounded_right: cutlass.Constexpr[bool], offset: Int32,
                     right: cutlass.Constexpr[int] = 0, left: cutlass.Constexpr = None):
    """`mask_scores` with a window (rows are queries, not transposed), by bit masks (above):
    -inf where the key is past `seqlen`, right of query + offset + right (bounded_right), or
    left of query + offset - left (left not None). Sides of any sign: the counts clamp to
    0 .. span. At most 32 elements per row (kv tile <= 128)."""
    cols = cute.size(s_rc, mode=[1])
    if cutlass.const_expr(cols > 32):
        raise ValueError("mask_window_bits: at most 32 scores per row (kv tile <= 128)")
    span = 8 * ((cols + 1) // 2)
    minus_inf = s_rc.element_type(-Float32.inf)
    thr_col = coords_rc[0, 0][1]
    tail = seqlen - col0 - thr_col                  # in this thread's offsets
    for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
        position = coords_rc[r, 0][0] + row0 + offset - col0 - thr_col
        limit = tail
        if cutlass.const_expr(bounded_right):
            limit = cutlass.min(limit, position + (right + 1))
        keep = _low_bits(_elements_below(limit, span))
        if cutlass.const_expr(left is not None):
            keep = keep & ~_low_bits(_elements_below(position - left, span))
        for c in cutlass.range_constexpr(cols):
            if (keep & Uint32(1 << c)) == Uint32(0):
                s_rc[r, c] = minus_inf


@cute.jit
def query_keys(query, shift, seqlen_k, causal: cutlass.Constexpr[bool],
               left: cutlass.Constexpr, right: cutlass.Constexpr):
    """The keys one query sees, [low, limit) (low >= limit: none), for kernels whose rows
    are not consecutive queries (the decode stage's packed (query, head) rows): position r =
    query + shift (shift = seqlen_k - seqlen_q, bottom-right), keys r - left .. r + right
    (right 0 with causal; None: unbounded on that side), clipped to [0, seqlen_k)."""
    limit = seqlen_k
    if cutlass.const_expr(causal or right is not None):
        high = query + shift + 1
        if cutlass.const_expr(not causal and right is not None and right != 0):
            high = high + right
        limit = cutlass.min(seqlen_k, cutlass.max(high, 0))
    low = Int32(0)
    if cutlass.const_expr(left is not None):
        low = cutlass.max(query + shift - left, 0)
    return low, limit


@cute.jit
def mask_key_ranges(s_rc: cute.Tensor, coords_rc: cute.Tensor, col0, lows: cute.Tensor,
                    limits: cute.Tensor, left: cutlass.Constexpr):
    """-inf where a score's key (coords_rc[r, c][1] + col0) is outside its row's [lows[r],
    limits[r]) (`query_keys` per register row; left None: no low side)."""
    for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
            col = col0 + coords_rc[r, c][1]
            hidden = col >= limits[r]
            if cutlass.const_expr(left is not None):
                hidden = hidden or col < lows[r]
            if hidden:
                s_rc[r, c] = -Float32.inf


@dataclasses.dataclass(frozen=True)
class KVTileSchedule:
    """The backward's view of the same mask: a CTA owns kv tile `n_block` (block_n keys) and
    walks the query tiles (block_m rows) that see at least one of its keys. With a causal
    mask (bottom-right: query i sees keys j <= i + seqlen_k - seqlen_q) the query tiles above
    the diagonal are skipped; only the last kv tile (keys past the end) and the tiles the
    diagonal crosses are masked.

    Launch order. Without `l2_rows` the grid is (kv tiles, heads, batch): the hardware starts
    CTAs in that order, kv tile fastest, so the CTAs running at one time are the kv tiles of
    a few heads, which read the same Q and dO tiles and add into the same dQ through L2.
    With a causal mask kv tile n walks fewer query tiles the larger n is (at N = 4k: 64 for
    the first, 2 for the last), and a head's longest CTA starts behind the previous head's
    shortest ones, so the grid ends on long CTAs while other SMs idle. `l2_rows` (causal):
    a 1-D grid, heads (batch x heads) taken in groups that together hold about `l2_rows`
    query rows (their Q, dO and dQ partials fit in L2), and inside a group kv tile 0 of
    every head first, then kv tile 1, ...: the longest CTAs start first, the short ones fill
    the tail, and a group's CTAs still share L2. The group with fewer heads (batch x heads
    not a multiple of the group) runs first, so that no long CTA starts last. Every head's
    kv tile n - 1 still starts before its tile n (the deterministic mode's turns need it).
    Heads with fewer than 16 kv tiles keep the first order (groups of one head);
    `group_heads` fixes the group's size in heads instead (kb2's deterministic mode).
    """

    block_m: int
    block_n: int
    causal: bool
    l2_rows: int = 0
    group_heads: int = 0        # with l2_rows: this many heads per group, whatever the length
    # CTAs per kv tile, each owning a part of d's columns (kb1 at d = 256; without l2_rows):
    # the grid's batch mode counts (batch, part), part fastest
    parts: int = 1
    # heads_first (without l2_rows): the grid is (heads, kv tiles, batch), so the hardware
    # starts kv tile 0 of every head first, then kv tile 1, ...: longest first over all heads,
    # without the 1-D grid's index arithmetic (kb2's gqa variant at d = 64, where that
    # arithmetic's registers spill one)
    heads_first: bool = False
    # the sliding window (TileSchedule's); None: unbounded on that side
    window_left: Optional[int] = None
    window_right: Optional[int] = None
    # below 16 kv tiles per head the reordering lost on the H100 (kb2, d = 128, N = 1k:
    # -0.5% to -10% as the group grew from 16 to 48 heads; docs/kb2.md)
    LONGEST_FIRST_MIN_KV_TILES = 16

    def grid(self, seqlen_k, heads, batch):
        kv_tiles = cute.ceil_div(seqlen_k, self.block_n)
        if cutlass.const_expr(self.l2_rows > 0):
            return [kv_tiles * heads * batch, 1, 1]
        if cutlass.const_expr(self.heads_first):
            return [heads, kv_tiles, batch * self.parts]
        return [kv_tiles, heads, batch * self.parts]

    @cute.jit
    def cta_tile(self, seqlen_q, seqlen_k, heads, batch, q_heads_per_head=None):
        """(n_block, head, batch) of the calling CTA. `q_heads_per_head` (a grid over dK
        heads, kb2 with GQA): the query heads each grid head stands for (`group_heads` counts
        query heads)."""
        if cutlass.const_expr(self.l2_rows == 0 and self.heads_first):
            head, n_block, b = cute.arch.block_idx()
            if cutlass.const_expr(self.parts > 1):
                return Int32(n_block), Int32(head), Int32(b) // self.parts
            return Int32(n_block), Int32(head), Int32(b)
        if cutlass.const_expr(self.l2_rows == 0):
            n_block, head, b = cute.arch.block_idx()
            if cutlass.const_expr(self.parts > 1):
                return Int32(n_block), Int32(head), Int32(b) // self.parts
            return Int32(n_block), Int32(head), Int32(b)
        cta, _, _ = cute.arch.block_idx()
        cta = Int32(cta)
        kv_tiles = cute.ceil_div(seqlen_k, self.block_n)
        heads_total = heads * batch
        if cutlass.const_expr(self.group_heads > 0 and q_heads_per_head is not None):
            group = cutlass.min(cutlass.max(Int32(self.group_heads) // q_heads_per_head, 1),
                                heads_total)
        elif cutlass.const_expr(self.group_heads > 0):
            group = cutlass.min(Int32(self.group_heads), heads_total)
        else:
            group = heads_per_group(self.l2_rows, seqlen_q, heads_total)
        if kv_tiles < self.LONGEST_FIRST_MIN_KV_TILES:
            group = 1                           # one head at a time: the (kv tiles, heads,
                                                # batch) grid's order
        n_block, hb = head_group_order(cta, kv_tiles, heads_total, group)
        uniform = cute.arch.make_warp_uniform
        return uniform(n_block), uniform(hb % heads), uniform(hb // heads)

    def host_order(self, seqlen_q: int, seqlen_k: int, heads: int, batch: int,
                   q_heads_per_head: int = 1) -> list:
        """Host side: the (n_block, head + batch * heads) of every CTA in launch order, as
        `cta_tile` derives them (for estimates of how the grid balances; no parts)."""
        kv_tiles = -(-seqlen_k // self.block_n)
        heads_total = heads * batch
        if self.l2_rows == 0 and self.heads_first:
            return [(n, b * heads + h) for b in range(batch) for n in range(kv_tiles)
                    for h in range(heads)]
        if self.l2_rows == 0:
            return [(n, hb) for hb in range(heads_total) for n in range(kv_tiles)]
        if self.group_heads > 0:
            group = min(max(self.group_heads // q_heads_per_head, 1), heads_total)
        else:
            group = min(max(self.l2_rows // seqlen_q, 1), heads_total)
        if kv_tiles < self.LONGEST_FIRST_MIN_KV_TILES:
            group = 1
        first, order = heads_total % group, []
        for index in range(kv_tiles * heads_total):
            if index < first * kv_tiles:
                order.append((index // first, index % first))
            else:
                rest = index - first * kv_tiles
                in_group = rest % (group * kv_tiles)
                order.append((in_group // group,
                              first + (rest // (group * kv_tiles)) * group + in_group % group))
        return order

    def host_tiles(self, n_block: int, seqlen_q: int, seqlen_k: int) -> int:
        """Host side: how many query tiles kv tile `n_block` walks (`m_block_range`)."""
        if self.windowed:
            first, end = window_m_range(n_block, self.block_m, self.block_n, seqlen_q,
                                        seqlen_k, self.window_left, self.right_limit)
            return end - first
        first = max(n_block * self.block_n - (seqlen_k - seqlen_q), 0) // self.block_m \
            if self.causal else 0
        return -(-seqlen_q // self.block_m) - first

    @property
    def windowed(self) -> bool:
        return self.window_left is not None or (self.window_right is not None
                                                and not self.causal)

    @property
    def right_limit(self) -> Optional[int]:
        """The window's right side (0 with causal), None where unbounded."""
        return 0 if self.causal else self.window_right

    @property
    def right(self) -> int:
        """`right_limit` where bounded, else 0 (mask_scores' `right`)."""
        return 0 if self.right_limit is None else self.right_limit

    @property
    def shifted(self) -> bool:
        """TileSchedule's: a side is negative."""
        return shifted_window(self.window_left, self.right_limit)

    def part(self):
        """Which part of d's columns the calling CTA owns (0 with one part)."""
        if cutlass.const_expr(self.parts == 1):
            return Int32(0)
        _, _, b = cute.arch.block_idx()
        return cute.arch.make_warp_uniform(Int32(b) % self.parts)

    @cute.jit
    def m_block_range(self, n_block, seqlen_q, seqlen_k):
        """(first, end) query tiles that kv tile `n_block` contributes to. With a window's
        left side a kv tile that no query sees still walks one query tile (fully masked:
        it adds nothing, and its dK and dV are written as zeros)."""
        if cutlass.const_expr(self.windowed):
            return self.window_m_block_range(n_block, seqlen_q, seqlen_k)
        first = Int32(0)
        if cutlass.const_expr(self.causal):
            # the first query that sees key n_block * block_n
            first = cutlass.max(n_block * self.block_n - (seqlen_k - seqlen_q), 0) // self.block_m
        return first, cute.ceil_div(seqlen_q, self.block_m)

    @cute.jit
    def cta_work(self, mQ: cute.Tensor, mK: cute.Tensor):
        """This CTA's kv tile, head, batch, k/v head (GQA: the group's), the two lengths and
        the query tiles it walks: (n_block, head, batch, kv_head, seqlen_q, seqlen_k,
        m_first, m_count). mQ, mK: (rows, d, heads, batch)."""
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        n_block, head, batch = self.cta_tile(seqlen_q, seqlen_k, mQ.shape[2], mQ.shape[3])
        kv_head = head // (mQ.shape[2] // mK.shape[2])
        m_first, m_end = self.m_block_range(n_block, seqlen_q, seqlen_k)
        return n_block, head, batch, kv_head, seqlen_q, seqlen_k, m_first, m_end - m_first

    @cute.jit
    def cta_work_kv(self, mQ: cute.Tensor, mK: cute.Tensor, mdK: cute.Tensor):
        """`cta_work` for a grid over dK heads (kb2 with GQA): dK has the k/v heads, or each
        k/v head split in parts (mdK's heads: a multiple of k/v's, a divisor of q's); the
        CTA of kv tile n of dK head j walks the query tiles of query heads j * walk ..
        (j + 1) * walk - 1 (walk = q heads / dK heads), reading k/v head j // parts.
        Returns (n_block, dk_head, kv_head, batch, walk, seqlen_q, seqlen_k, m_first,
        m_count), m_first and m_count per query head. In the longest-first order a dK head
        counts as one query head's rows (its CTAs are `walk` times longer than one query
        head's: more heads per group keep the longest ones at the start)."""
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        walk = mQ.shape[2] // mdK.shape[2]
        n_block, dk_head, batch = self.cta_tile(seqlen_q, seqlen_k, mdK.shape[2], mQ.shape[3],
                                                walk)
        kv_head = dk_head // (mdK.shape[2] // mK.shape[2])
        m_first, m_end = self.m_block_range(n_block, seqlen_q, seqlen_k)
        return (n_block, dk_head, kv_head, batch, walk, seqlen_q, seqlen_k, m_first,
                m_end - m_first)

    @cute.jit
    def window_m_block_range(self, n_block, seqlen_q, seqlen_k):
        """`m_block_range` with a window: from the tile of the first query whose high
        limit reaches key n_block * block_n to that of the last query whose low limit
        reaches key (n_block + 1) * block_n - 1. With a negative right side that query may
        be past the last: the last query tile then (fully masked)."""
        offset = seqlen_k - seqlen_q
        first = Int32(0)
        if cutlass.const_expr(self.right_limit is not None):
            first = cutlass.max(n_block * self.block_n - offset - self.right_limit, 0) \
                // self.block_m
        end = cute.ceil_div(seqlen_q, self.block_m)
        if cutlass.const_expr(self.right_limit is not None and self.right_limit < 0):
            first = cutlass.min(first, end - 1)
        if cutlass.const_expr(self.window_left is not None):
            last = (n_block + 1) * self.block_n - 1 - offset + self.window_left
            if cutlass.const_expr(self.window_left < 0):    # (the last key is below r)
                last = cutlass.min((n_block + 1) * self.block_n, seqlen_k) - 1 - offset \
                    + self.window_left
            end = cutlass.min(end, cutlass.max(last, 0) // self.block_m + 1)
            end = cutlass.max(end, first + 1)
        return first, end

    @cute.jit
    def dq_turn_first(self, m_block, seqlen_q, seqlen_k):
        """The first kv tile that walks query tile `m_block` (its dQ adds come from kv tiles
        dq_turn_first .. in order: kb2's deterministic turns count from it). 0 without a
        window's left side; with one, the first whose keys its first row sees or, before
        it, one whose keys no query sees and whose fully masked tile is this one (the
        left side is unbounded for tile 0). Host mirror: `window_dq_first`."""
        first = Int32(0)
        if cutlass.const_expr(self.window_left is not None):
            diagonal = m_block * self.block_m + seqlen_k - seqlen_q
            first = cutlass.max(diagonal - self.window_left, 0) // self.block_n
            if cutlass.const_expr(self.right_limit is not None):
                # the first kv tile whose m_block_range starts at or past m_block
                past = cutlass.max(diagonal + self.right_limit, 0)
                first = cutlass.min(first, (past + self.block_n - 1) // self.block_n)
            if m_block == 0:
                first = Int32(0)
        return first

    @cute.jit
    def needs_mask(self, m_block, n_block, seqlen_q, seqlen_k):
        if cutlass.const_expr(self.windowed):
            last_key = (n_block + 1) * self.block_n - 1
            diagonal = m_block * self.block_m + seqlen_k - seqlen_q
            needs = last_key >= seqlen_k
            if cutlass.const_expr(self.right_limit is not None):
                needs = needs or last_key > diagonal + self.right_limit
            if cutlass.const_expr(self.window_left is not None):
                needs = needs or n_block * self.block_n < \
                    diagonal + (self.block_m - 1 - self.window_left)
            return needs
        last_key = (n_block + 1) * self.block_n - 1
        needs = last_key >= seqlen_k
        if cutlass.const_expr(self.causal):
            needs = needs or last_key > m_block * self.block_m + seqlen_k - seqlen_q
        return needs


# ---- the same ranges on the host (pure Python: tests, grid estimates) ----

def shifted_window(left: Optional[int], right: Optional[int]) -> bool:
    """A window side (None: unbounded) is negative: the clamps of the module doc apply."""
    return (left is not None and left < 0) or (right is not None and right < 0)


def window_visible(i: int, j: int, seqlen_q: int, seqlen_k: int, left: Optional[int],
                   right: Optional[int]) -> bool:
    """Query i sees key j: j < seqlen_k and r - left <= j <= r + right, r = i + seqlen_k -
    seqlen_q (None: unbounded on that side; causal is right = 0)."""
    r = i + seqlen_k - seqlen_q
    return (0 <= j < seqlen_k and (left is None or j >= r - left)
            and (right is None or j <= r + right))


def window_ranges(m_block: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int,
                  left: Optional[int], right: Optional[int]) -> tuple:
    """TileSchedule's (n_block_first, n_block_count_kv) for query tile m_block."""
    offset = seqlen_k - seqlen_q
    count = -(-seqlen_k // block_n)
    if right is not None:
        rows_end = m_block * block_m + block_m
        if right < 0:
            rows_end = min(rows_end, seqlen_q)
        visible = max(rows_end + offset + right, 1)
        count = min(count, -(-visible // block_n))
    first = max(m_block * block_m + offset - left, 0) // block_n if left is not None else 0
    if shifted_window(left, right):
        first = min(first, count - 1)
    return first, count


def window_needs_mask(m_block: int, n_block: int, block_m: int, block_n: int, seqlen_q: int,
                      seqlen_k: int, left: Optional[int], right: Optional[int]) -> bool:
    """TileSchedule.needs_window_mask (with the tail test) on the host."""
    last_col = (n_block + 1) * block_n - 1
    diagonal = m_block * block_m + seqlen_k - seqlen_q
    return (last_col >= seqlen_k or (right is not None and last_col > diagonal + right)
            or (left is not None and n_block * block_n < diagonal + block_m - 1 - left))


def window_m_range(n_block: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int,
                   left: Optional[int], right: Optional[int]) -> tuple:
    """KVTileSchedule.window_m_block_range on the host: (first, end) query tiles."""
    offset = seqlen_k - seqlen_q
    end = -(-seqlen_q // block_m)
    first = 0
    if right is not None:
        first = max(n_block * block_n - offset - right, 0) // block_m
        if right < 0:
            first = min(first, end - 1)
    if left is not None:
        last = min((n_block + 1) * block_n, seqlen_k if left < 0 else 1 << 62) - 1 - offset \
            + left
        end = max(min(end, max(last, 0) // block_m + 1), first + 1)
    return first, end


def window_dq_first(m_block: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int,
                    left: Optional[int], right: Optional[int]) -> int:
    """KVTileSchedule.dq_turn_first on the host: the first kv tile whose `window_m_range`
    holds query tile m_block (where any does)."""
    if left is None or m_block == 0:
        return 0
    diagonal = m_block * block_m + seqlen_k - seqlen_q
    first = max(diagonal - left, 0) // block_n
    if right is not None:
        first = min(first, -(-max(diagonal + right, 0) // block_n))
    return first


def window_options(problem) -> dict:
    """The problem's sliding window as kernel options (none without one: the options, and
    so the compile cache's key, of a call without a window stay as they were)."""
    if not getattr(problem, "windowed", False):
        return {}
    return {"window_left": problem.window_left, "window_right": problem.window_right}


# gqa: a CTA walks every query head of its group, so with few k/v heads (MQA, small
# batches) the grid has few, long CTAs, and with a mask the longest ones set its end (8 query
# heads on one k/v head at B = 1, N = 8k, d = 128: 64 CTAs for 132 SMs). Each k/v head is
# then split in parts (query heads `walk` = group / parts per CTA), each with its own dK / dV
# rows that run_backward sums: the fewest parts whose estimated grid time (CTAs in launch
# order on the first free SM, each its query tiles plus CTA_OVERHEAD_TILES for K / V in and
# dK / dV out) is within PARTS_SLACK of the best divisor's.
CTA_OVERHEAD_TILES = 1.0
PARTS_SLACK = 1.03


@functools.lru_cache(maxsize=256)
def dkv_parts(schedule: KVTileSchedule, heads: int, kv_heads: int, batch: int, seqlen_q: int,
              seqlen_k: int, sms: int) -> int:
    """How many parts each k/v head's dK / dV is split in (see above)."""
    group = heads // kv_heads
    tiles = [schedule.host_tiles(n, seqlen_q, seqlen_k)
             for n in range(-(-seqlen_k // schedule.block_n))]
    estimates = {}
    for parts in (p for p in range(1, group + 1) if group % p == 0):
        walk = group // parts
        free = [0.0] * sms
        for n_block, _ in schedule.host_order(seqlen_q, seqlen_k, kv_heads * parts, batch,
                                              walk):
            start = heapq.heappop(free)
            heapq.heappush(free, start + tiles[n_block] * walk + CTA_OVERHEAD_TILES)
        estimates[parts] = max(free)
    best = min(estimates.values())
    return min(p for p, t in estimates.items() if t <= PARTS_SLACK * best)
