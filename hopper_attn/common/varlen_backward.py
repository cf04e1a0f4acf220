"""The backward of a packed (variable-length) batch: kb2's kernels over a list of sequences.

A packed batch (common/varlen.py) holds its sequences back to back: q, out, dout and dq are
(total_q, H, d), k, v, dk and dv (total_k, H_kv, d), the forward's LSE (H, total_q) fp32.
The backward runs the three launches of the dense one (common/backward.py), each over a work
list instead of a (tiles, heads, batch) grid:

1. `VarlenPreprocess`, one CTA per (query tile of a sequence, head): D = rowsum(dO * O) and
   lse2 = lse * log2(e) into a *padded* per-sequence layout, (1, H, about total_q + batch x
   block_m rows, `padded_rows`): sequence b's rows start at the tile-aligned row
       padded_q(b) = (cu_seqlens_q[b] + b block_m) // block_m x block_m
   (each sequence's rows move down by less than b + 1 tiles, so the sequences' whole tiles
   never overlap). Rows past a sequence's end in its last tile get D = 0 and lse2 = +inf, as
   the dense preprocess pads, so P = 0 there. The fp32 dQ buffer (1, H, padded rows, d)
   is zeroed tile by tile on the same layout.
2. kb2 with `varlen` (`VarlenKVTileSchedule`), one CTA per (kv tile of a sequence, dK head)
   in a 1-D grid: the CTA finds its sequence, kv tile and head from its index
   (`locate_tile`), then sees its sequence through views (`cta_work_varlen`): Q, dO, K, V
   and dK, dV through common/varlen's ragged TMA tensors (loads past the sequence's end
   zero-filled, stores past it dropped), lse2, D and the dQ buffer offset to padded_q(b), so
   the whole kernel runs as on a batch of one. Causal masks and windows are aligned per
   sequence (bottom-right), as each sequence's lengths are. GQA: kb2's gqa variant, a CTA
   walks its group's query heads, or where that leaves too few CTAs a part of them
   (`dkv_parts`; their dK / dV summed after).
3. `VarlenDqConvert`, one CTA per (query tile of a sequence, head): the padded fragment-order
   dQ buffer -> dq's rows of the sequence, times the softmax scale. Where kb2's policy
   converts dQ per head (`convert_per_head`, launched early), a CTA here waits only for the
   kv tiles of its own sequence (a counter per sequence and head), so finished sequences
   convert during the main kernel's tail.

Work lists. Sequence b has ceil(len_b / block) tiles (the main kernel's list: times the dK
heads, in the dense grid's order for a batch of one, `sequence_entry`); the list lays them
end to end (the sequences by decreasing work where their lengths may differ:
`LONGEST_FIRST`; at equal lengths, where kb2 orders the dense grid longest first, the dense
order over all (sequence, head) pairs) and CTA x takes its x-th entry. Each CTA finds its
entry itself (no host read of cu_seqlens, no extra launch): every warp reads 32 sequences'
table columns at a time, takes a prefix sum of their tile counts by shuffles and finds the
sequence whose range holds x with a ballot. The grid is the bound ceil(total / block) +
batch (the sum of the ceilings is below it), and CTAs past the list's end do nothing (the
main kernel's run with zero lengths: their stores are dropped).

The sequence table (`sequence_table`), one int32 tensor (5 + H, batch + 1) built on the
device (up to 256 sequences by one launch, `SequenceTableKernel`; torch's ops are 6 to 12
small launches, each a few microseconds the preprocess waits behind): a column per
sequence in the list's order with offset_q, seqlen_q, offset_k, seqlen_k (seqused_k, or
the differences of cu_seqlens_k), the sequence's index in the batch (for its padded rows),
then one zeroed dQ counter per head; the last column is spare (the counters of CTAs past
the list's end). kb2 takes it in the place of its per-head counters (`mSem`; the varlen
mode has no deterministic mode, whose turns use them too) and sees its
column's counters in their layout.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Optional

import torch

from . import cute_runtime as rt    # sets the target architecture before cutlass is imported
from .contract import LOG2_E, Problem, normalize_window

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .backward import (CHUNK, HELPER_THREADS, _COMPILED, CompiledBackward, DqConvertFragments,
                       _aligned, _chunk, _row_lanes, _tile_rows, fragment_slot, wait_for_count)
from .layouts import ndhb_view, transposed
from .masking import KVTileSchedule
from .scheduler import head_group_order, heads_per_group
from .varlen import check_inputs, sequence_batch, sequence_rows
from .wgmma import dq_mma, dq_tile_shape


def sequence_table(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                   seqused_k: Optional[torch.Tensor] = None, longest_first: bool = False,
                   heads: int = 0) -> torch.Tensor:
    """(5 + heads, batch + 1) int32 on the device (see the module doc): column j < batch is
    the work list's j-th sequence, rows offset_q, seqlen_q, offset_k, seqlen_k (the keys
    used), its index in the batch, then a zeroed dQ counter per head; column `batch` is
    spare (zeros: the counters CTAs past the list's end count in). `longest_first`:
    sequences by decreasing work (queries x keys). Device ops only (CUDA-graph capturable)."""
    batch = cu_seqlens_q.shape[0] - 1
    seqlen_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    seqlen_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1] if seqused_k is None else seqused_k
    index = torch.arange(batch, dtype=torch.int32, device=seqlen_q.device)
    columns = torch.stack([cu_seqlens_q[:-1], seqlen_q, cu_seqlens_k[:-1], seqlen_k, index])
    if longest_first:
        work = seqlen_q.to(torch.int64) * seqlen_k
        columns = columns[:, torch.argsort(work, descending=True, stable=True)]
    table = torch.zeros((5 + heads, batch + 1), dtype=torch.int32, device=seqlen_q.device)
    table[:5, :batch] = columns
    return table


# The work list's order: the sequences by decreasing work (their long CTAs start first and the
# short ones fill the tail), or as given (False)
LONGEST_FIRST = True
# kb2's early dQ conversion where its policy takes it: per (sequence, head), each CTA of the
# conversion waiting for its sequence's kv tiles (False: after the whole main kernel)
CONVERT_PER_HEAD = True


def padded_rows(total_q: int, batch: int, block_m: int) -> int:
    """Rows of the padded per-sequence layout (lse2, D, the dQ buffer): total_q + batch x
    block_m, rounded up to whole tiles (TMA reads lse2 and D rows: a head's stride must be a
    multiple of 16 bytes)."""
    return -(-(total_q + batch * block_m) // block_m) * block_m


# --------------------------------------------------------------------------------------------
# device side
# --------------------------------------------------------------------------------------------

@cute.jit
def _column(seqs: cute.Tensor, j, batch):
    """Sequence table column j (offset_q, seqlen_q, offset_k, seqlen_k, index), zeros past
    the last."""
    oq, lq, ok, lk, index = Int32(0), Int32(0), Int32(0), Int32(0), Int32(0)
    if j < batch:
        oq, lq, ok, lk, index = seqs[0, j], seqs[1, j], seqs[2, j], seqs[3, j], seqs[4, j]
    return oq, lq, ok, lk, index


# How the main kernel's work list orders a sequence's (kv tile, head) entries
# (`sequence_entry`; VarlenKVTileSchedule.list_order); 0: the helpers' lists, without heads
KV_FASTEST, HEADS_FASTEST, HEAD_GROUPS = 1, 2, 3


@cute.jit
def sequence_entry(order: cutlass.Constexpr[int], l2_rows: cutlass.Constexpr[int], entry,
                   tiles, seqlen_q, heads):
    """(kv tile, head) of a sequence's `entry`-th one of its tiles x heads entries, in the
    dense grid's order. KV_FASTEST (no mask, every kv tile costs the same): each head's kv
    tiles in turn, so the CTAs running together read few heads' Q, dO and dQ;
    HEADS_FASTEST (a mask): kv tile 0 of every head, then kv tile 1, ... (the long CTAs
    first); HEAD_GROUPS (kb2's longest_first): that, from 16 kv tiles on in groups of heads
    holding `l2_rows` query rows (head_group_order)."""
    tile, head = entry // heads, entry % heads
    if cutlass.const_expr(order == KV_FASTEST):
        tile, head = entry % tiles, entry // tiles
    if cutlass.const_expr(order == HEAD_GROUPS):
        if tiles >= KVTileSchedule.LONGEST_FIRST_MIN_KV_TILES:
            tile, head = head_group_order(
                entry, tiles, heads,
                heads_per_group(l2_rows, cutlass.max(seqlen_q, 1), heads))
    return tile, head


@cute.jit
def locate_tile(seqs: cute.Tensor, tile, block: cutlass.Constexpr[int],
                keys: cutlass.Constexpr[bool], order: cutlass.Constexpr[int] = 0,
                l2_rows: cutlass.Constexpr[int] = 0, heads=1):
    """Entry `tile` of the work list that lays the tiles of the sequence table's sequences
    (`sequence_table`; tiles of `block` rows: query rows, or with `keys` the keys used) end
    to end: (valid, tile inside its sequence, head, offset_q, seqlen_q, offset_k, seqlen_k,
    the sequence's index in the batch, its table column); past the list's end valid is 0,
    both lengths 0 and the column the spare one (`batch`).
    Every lane of the calling warp gets the same answer: 32 sequences a step, each lane
    loads its sequence's column (one memory round trip for all of them), prefix sum by
    shuffles, the first lane whose range covers `tile` by ballot.

    `order` > 0 (the main kernel): each sequence holds its tiles times `heads` entries, in
    `sequence_entry`'s order. HEAD_GROUPS, where at most 32 sequences all have one tile count
    (equal lengths): the dense grid's order over the (sequence, head) pairs instead, groups
    of pairs holding `l2_rows` query rows across sequences (one pair a group below 16
    tiles), as KVTileSchedule orders batch x heads."""
    batch = seqs.shape[1] - 1
    lane = cute.arch.lane_idx()
    valid, local, head, index = Int32(0), Int32(0), Int32(0), Int32(0)
    column = Int32(batch)
    offset_q, seqlen_q, offset_k, seqlen_k = Int32(0), Int32(0), Int32(0), Int32(0)
    before, chunk = Int32(0), Int32(0)       # entries of the sequences before the chunk
    lane_oq, lane_lq, lane_ok, lane_lk, lane_b = _column(seqs, lane, batch)
    if cutlass.const_expr(order == HEAD_GROUPS):
        lane_tiles = (lane_lk if cutlass.const_expr(keys) else lane_lq) + (block - 1)
        lane_tiles = lane_tiles // block
        count = cute.arch.shuffle_sync(lane_tiles, 0)
        same = cute.arch.vote_all_sync(lane >= batch or lane_tiles == count)
        if batch <= 32 and same:
            chunk = Int32(32)                # decided here: no scan
            pairs = batch * heads
            if tile < count * pairs:
                # (the whole batch as one group read 8x the dense order's bytes from DRAM at
                # 8 x 2k, 16 heads: tools/bwd_order_model.py)
                group = Int32(1)
                if count >= KVTileSchedule.LONGEST_FIRST_MIN_KV_TILES:
                    group = heads_per_group(
                        l2_rows, cutlass.max(cute.arch.shuffle_sync(lane_lq, 0), 1), pairs)
                local, pair = head_group_order(tile, count, pairs, group)
                pick = pair // heads
                head = pair - pick * heads
                valid, column = Int32(1), pick
                index = cute.arch.shuffle_sync(lane_b, pick)
                offset_q = cute.arch.shuffle_sync(lane_oq, pick)
                seqlen_q = cute.arch.shuffle_sync(lane_lq, pick)
                offset_k = cute.arch.shuffle_sync(lane_ok, pick)
                seqlen_k = cute.arch.shuffle_sync(lane_lk, pick)
    while chunk < batch and valid == 0:
        if chunk > 0:                        # (the first chunk's columns are loaded)
            lane_oq, lane_lq, lane_ok, lane_lk, lane_b = _column(seqs, chunk + lane, batch)
        rows = lane_lq
        if cutlass.const_expr(keys):
            rows = lane_lk
        tiles = (rows + (block - 1)) // block
        entries = tiles
        if cutlass.const_expr(order > 0):
            entries = tiles * heads
        upto = entries                       # inclusive prefix sum over the lanes
        for i in cutlass.range_constexpr(5):
            got = cute.arch.shuffle_sync_up(upto, 1 << i)
            if lane >= (1 << i):
                upto = upto + got
        covered = cute.arch.vote_ballot_sync(tile < before + upto)
        if covered != 0:
            first = Int32(cute.arch.popc((covered & -covered) - 1))    # its lowest lane
            valid, column = Int32(1), chunk + first
            index = cute.arch.shuffle_sync(lane_b, first)
            local = tile - before - cute.arch.shuffle_sync(upto - entries, first)
            offset_q = cute.arch.shuffle_sync(lane_oq, first)
            seqlen_q = cute.arch.shuffle_sync(lane_lq, first)
            offset_k = cute.arch.shuffle_sync(lane_ok, first)
            seqlen_k = cute.arch.shuffle_sync(lane_lk, first)
            if cutlass.const_expr(order > 0):
                local, head = sequence_entry(order, l2_rows, local,
                                             cute.arch.shuffle_sync(tiles, first), seqlen_q,
                                             heads)
        before = before + cute.arch.shuffle_sync(upto, 31)
        chunk = chunk + 32
    return valid, local, head, offset_q, seqlen_q, offset_k, seqlen_k, index, column


@cute.jit
def sequence_tensor(tma_tensor: cute.Tensor, offset, length):
    """One sequence of a ragged TMA tensor (common/varlen.py) as an (N, d, H, 1) tensor, the
    layout kb2 indexes with (head, batch 0)."""
    rows = sequence_rows(tma_tensor, length)[None, None, None, sequence_batch(offset, length)]
    return cute.make_tensor(rows.iterator,
                            cute.append(rows.layout, cute.make_layout(1, stride=0)))


@cute.jit
def sequence_counters(seqs: cute.Tensor, column, heads):
    """The dQ counters of table column `column` as kb2 indexes its per-head counters:
    view[0, head, 0] = seqs[5 + head, column]."""
    base = cute.domain_offset((5, column), seqs).iterator
    return cute.make_tensor(base, cute.make_layout((1, heads, 1),
                                                   stride=(0, seqs.layout.stride[0], 0)))


def _host_group_order(items: int, slots: int, heads_total: int, group: int) -> list:
    """scheduler.head_group_order's (slot, head) of items 0 .. items - 1, on the host."""
    first, out = heads_total % group, []
    for index in range(items):
        if index < first * slots:
            out.append((index // first, index % first))
        else:
            rest = index - first * slots
            in_group = rest % (group * slots)
            out.append((in_group // group,
                        first + rest // (group * slots) * group + in_group % group))
    return out


@dataclasses.dataclass(frozen=True)
class VarlenKVTileSchedule(KVTileSchedule):
    """KVTileSchedule over a packed batch: a 1-D grid over a work list of (sequence, kv tile,
    dK head), sequence by sequence, inside a sequence the dense grid's order (`sequence_entry`:
    without a mask each head's kv tiles in turn; with one kv tile 0 of every head first, or
    with `l2_rows` of every head of an L2-sized group; at equal lengths with `l2_rows` the
    dense order over all (sequence, head) pairs: `locate_tile`). The mask and the query
    tiles a kv tile walks are the dense ones with the sequence's lengths."""

    def grid(self, total_k, heads, sequences):
        return [(cute.ceil_div(total_k, self.block_n) + sequences) * heads, 1, 1]

    def host_work_list(self, lengths_q, lengths_k, heads: int) -> list:
        """Host side: the (sequence, kv tile, head) of every CTA in launch order, as
        `locate_tile` derives them from a table in the sequences' order (for estimates of
        the order's L2 traffic and balance: tools/bwd_order_model.py)."""
        batch, tiles = len(lengths_k), [-(-n // self.block_n) for n in lengths_k]
        if self.list_order == HEAD_GROUPS and 0 < batch <= 32 and len(set(tiles)) == 1:
            pairs = batch * heads
            group = 1 if tiles[0] < self.LONGEST_FIRST_MIN_KV_TILES else \
                min(max(self.l2_rows // max(lengths_q[0], 1), 1), pairs)
            return [(hb // heads, n, hb % heads) for n, hb in
                    _host_group_order(tiles[0] * pairs, tiles[0], pairs, group)]
        return [(b, n, h) for b in range(batch) for n, h in _host_group_order(
            tiles[b] * heads, tiles[b], heads, self.host_heads_group(tiles[b], lengths_q[b],
                                                                     heads))]

    @property
    def list_order(self) -> int:
        """`sequence_entry`'s order of a sequence's entries."""
        if not self.causal:
            return KV_FASTEST
        return HEAD_GROUPS if self.l2_rows > 0 else HEADS_FASTEST

    def host_heads_group(self, tiles: int, seqlen_q: int, heads: int) -> int:
        """How many heads take a sequence's kv tiles together (`sequence_entry`), on the
        host."""
        if self.list_order == KV_FASTEST:
            return 1
        if self.list_order == HEADS_FASTEST or tiles < self.LONGEST_FIRST_MIN_KV_TILES:
            return heads
        return min(max(self.l2_rows // max(seqlen_q, 1), 1), heads)

    @cute.jit
    def cta_work_varlen(self, seqs: cute.Tensor, mQ, mdO, mK, mV, mLSE2, mD, mdK, mdV,
                        mdQacc):
        """This CTA's (n_block, dK head, k/v head, query heads per dK head, seqlen_q,
        seqlen_k, m_first, m_count) and its sequence's views of (mQ, mdO, mK, mV, mLSE2,
        mD, mdK, mdV, mdQacc) (batch 0 of each) and of its dQ counters (kb2's per-head
        counters, [0, head, 0]). Past the list's end, or for a sequence without queries,
        m_count is 0 (dK and dV stored as zeros; past the end: dropped)."""
        cta, _, _ = cute.arch.block_idx()
        _, n_block, dk_head, offset_q, seqlen_q, offset_k, seqlen_k, seq, column = [
            cute.arch.make_warp_uniform(x)
            for x in locate_tile(seqs, Int32(cta), self.block_n, True, self.list_order,
                                 self.l2_rows, mdK.shape[2])]
        m_first, m_end = self.m_block_range(n_block, seqlen_q, seqlen_k)
        m_count = m_end - m_first
        if seqlen_q == 0:
            m_count = Int32(0)
        group = mQ.shape[2] // mdK.shape[2]
        kv_head = dk_head // (mdK.shape[2] // mK.shape[2])
        padded_q = (offset_q + seq * self.block_m) // self.block_m * self.block_m
        views = (sequence_tensor(mQ, offset_q, seqlen_q),
                 sequence_tensor(mdO, offset_q, seqlen_q),
                 sequence_tensor(mK, offset_k, seqlen_k),
                 sequence_tensor(mV, offset_k, seqlen_k),
                 cute.domain_offset((padded_q, 0, 0), mLSE2),
                 cute.domain_offset((padded_q, 0, 0), mD),
                 sequence_tensor(mdK, offset_k, seqlen_k),
                 sequence_tensor(mdV, offset_k, seqlen_k),
                 cute.domain_offset((0, 0, padded_q, 0), mdQacc),
                 sequence_counters(seqs, column, mQ.shape[2]))
        return (n_block, dk_head, kv_head, group, seqlen_q, seqlen_k, m_first, m_count,
                views)


@cute.jit
def _query_tile(seqs: cute.Tensor, block_m: cutlass.Constexpr[int], heads=None):
    """The calling helper CTA's (valid, query tile, offset_q, seqlen_q, padded_q, head,
    seqlen_k, table column); valid is 0 past the work list's end. The grid is (list
    entries, heads), or with `heads` given 1-D, the head fastest."""
    tile, head, _ = cute.arch.block_idx()
    if cutlass.const_expr(heads is not None):
        tile, head = Int32(tile) // heads, Int32(tile) % heads
    valid, m_block, _, offset, seqlen, _, seqlen_k, seq, column = locate_tile(
        seqs, Int32(tile), block_m, False)
    padded = (offset + seq * block_m) // block_m * block_m
    return valid, m_block, offset, seqlen, padded, Int32(head), seqlen_k, column


class VarlenPreprocess:
    """BackwardPreprocess over the query tiles of a packed batch (see the module doc): lse
    (H, total_q) in, lse2 and D (1, H, padded rows) out, the tile's dQ block zeroed."""

    def __init__(self, head_dim: int, block_m: int, pdl: bool = False):
        self.head_dim, self.rows, self.pdl = head_dim, block_m, pdl
        self.lanes, self.rows_per_pass = _tile_rows(head_dim, HELPER_THREADS)

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mSeqs: cute.Tensor,
                 stream):
        o, do = ndhb_view(mO), ndhb_view(mdO)                  # (total_q, d, H, 1)
        self.kernel(o, do, mLSE, mLSE2, mD, mdQacc, mSeqs).launch(
            grid=[cute.ceil_div(o.shape[0], self.rows) + (mSeqs.shape[1] - 1), o.shape[2], 1],
            block=[HELPER_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, o: cute.Tensor, do: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
               mD: cute.Tensor, mdQacc: cute.Tensor, mSeqs: cute.Tensor):
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        valid, m_block, offset, seqlen, padded, head, _, _ = _query_tile(mSeqs, self.rows)
        if valid != 0:
            lane_row, col0, own_column = _row_lanes(tidx, self.lanes, self.head_dim)
            passes = self.rows // self.rows_per_pass
            o_rows = cute.make_rmem_tensor((CHUNK, passes), o.element_type)
            do_rows = cute.make_rmem_tensor((CHUNK, passes), o.element_type)
            lse_rows = cute.make_rmem_tensor((passes,), Float32)
            for p in cutlass.range_constexpr(passes):     # every load first (BackwardPreprocess)
                token = offset + cutlass.min(m_block * self.rows + p * self.rows_per_pass
                                             + lane_row, seqlen - 1)
                cute.autovec_copy(_chunk(o, token, col0, head, 0), o_rows[None, p])
                cute.autovec_copy(_chunk(do, token, col0, head, 0), do_rows[None, p])
                lse_rows[p] = mLSE[head, token]
            block = self.rows * self.head_dim
            base = mdQacc[0, head, None, None].iterator + (padded + m_block * self.rows) \
                * self.head_dim
            zeros = cute.make_rmem_tensor((4,), Float32)
            zeros.fill(0.0)
            for i in cutlass.range_constexpr(block // (4 * HELPER_THREADS)):
                cute.autovec_copy(zeros, _aligned(base + (i * HELPER_THREADS + tidx) * 4, 4))
            for p in cutlass.range_constexpr(passes):
                row = m_block * self.rows + p * self.rows_per_pass + lane_row
                prod = o_rows[None, p].load().to(Float32) * do_rows[None, p].load().to(Float32)
                partial = prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                if cutlass.const_expr(own_column is not None):
                    if not own_column:              # a padding lane counts nothing
                        partial = Float32(0.0)
                dsum = cute.arch.warp_reduction_sum(partial, threads_in_group=self.lanes)
                if tidx % self.lanes == 0:
                    lse2 = Float32.inf
                    if row < seqlen:
                        if lse_rows[p] != -Float32.inf:
                            lse2 = lse_rows[p] * LOG2_E
                    else:
                        dsum = Float32(0.0)
                    mD[0, head, padded + row] = dsum
                    mLSE2[0, head, padded + row] = lse2


class VarlenDqConvert(DqConvertFragments):
    """DqConvertFragments over the query tiles of a packed batch: the padded fragment-order
    dQ buffer -> dq (total_q, H, d), rows of the sequence only. `per_head` (kb2's
    convert_per_head): launched early, a CTA waits until every kv tile of its sequence has
    counted its dQ adds for its head (the table's counters; `block_n`: kb2's kv tile), so
    sequences that are done convert in the main kernel's tail."""

    def __init__(self, head_dim: int, block_m: int, swap_ab: bool = False, pdl: bool = False,
                 per_head: bool = False, block_n: int = 128, rows: bool = False):
        super().__init__(head_dim, block_m, swap_ab, pdl, per_head, rows)
        self.block_n = block_n

    @cute.jit
    def __call__(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, mSeqs: cute.Tensor,
                 scale: Float32, stream):
        dq = ndhb_view(mdQ)                                    # (total_q, d, H, 1)
        self.dtype = mdQ.element_type
        # a 1-D grid, the head fastest: the CTAs start sequence by sequence in the list's
        # order, as the main kernel's finish (per_head: those of a later sequence, which
        # wait for it, start after the earlier ones' conversions, as with the dense grid's
        # batch mode last)
        self.kernel(mdQacc, dq, mSeqs, scale).launch(
            grid=[(cute.ceil_div(dq.shape[0], self.block_m) + (mSeqs.shape[1] - 1))
                  * dq.shape[2], 1, 1],
            block=[256, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, acc_all: cute.Tensor, dq: cute.Tensor, mSeqs: cute.Tensor, scale: Float32):
        bm, d = self.block_m, self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        if cutlass.const_expr(self.pdl and not self.per_head):
            cute.arch.griddepcontrol_wait()          # launched early: wait for the main kernel
        valid, m_block, offset, seqlen, padded, head, seqlen_k, column = _query_tile(
            mSeqs, bm, dq.shape[2])
        kv_tiles = (seqlen_k + (self.block_n - 1)) // self.block_n
        if cutlass.const_expr(self.per_head):
            # every kv tile's adds landed (a sequence without keys has none: its dQ is 0,
            # written without reading the buffer, which the preprocess may still be zeroing)
            if valid != 0 and kv_tiles > 0 and tidx == 0:
                wait_for_count(sequence_counters(mSeqs, column, dq.shape[2])[0, head, None]
                               .iterator, kv_tiles)
            cute.arch.sync_threads()
        smem = cutlass.memory.SmemAllocator()
        tile = smem.allocate_tensor(self.dtype, cute.make_layout((bm, d), stride=(d + CHUNK, 1)),
                                    byte_alignment=16)
        if valid != 0:
            thr = dq_mma(d, self.dtype, self.swap_ab, bm, self.rows).get_slice(tidx)
            acc = cute.make_rmem_tensor(
                thr.partition_shape_C(dq_tile_shape(bm, d, self.swap_ab)), Float32)
            acc.fill(0.0)
            if kv_tiles > 0:
                src = fragment_slot(acc_all[0, head, None, None].iterator + padded * d,
                                    m_block, tidx, bm, d, cute.size(acc))
                cute.autovec_copy(src, cute.make_tensor(acc.iterator, src.layout.shape))
            converted = cute.make_rmem_tensor_like(acc, self.dtype)
            converted.store((acc.load() * scale).to(self.dtype))
            cute.autovec_copy(converted,
                              thr.partition_C(transposed(tile) if self.swap_ab else tile))
            cute.arch.sync_threads()
            lane_row, col0, _ = _row_lanes(tidx, self.lanes, d)
            for p in cutlass.range_constexpr(bm // self.rows_per_pass):
                r = p * self.rows_per_pass + lane_row
                row = m_block * bm + r
                if row < seqlen:
                    out = cute.make_rmem_tensor((CHUNK,), self.dtype)
                    cute.autovec_copy(_aligned(tile[r, None].iterator + col0, CHUNK), out)
                    cute.autovec_copy(out, _chunk(dq, offset + row, col0, head, 0))
        if cutlass.const_expr(self.per_head):
            # do not complete before the main kernel (DqConvertFragments' reason)
            cute.arch.griddepcontrol_wait()


# `sequence_table` in one launch where the batch fits one CTA (torch's ops are 6 small
# launches, 12 with the sort, each one the preprocess waits behind)
TABLE_THREADS = 256


class SequenceTableKernel:
    """`sequence_table` for batch <= TABLE_THREADS: one CTA, thread j reads sequence j's
    offsets and lengths and, with `sort` > 0, ranks its work (queries x keys) among the
    batch's through SMEM (decreasing, ties in batch order: torch's stable argsort) and
    writes its column there; the dQ counters and the spare column are zeroed."""

    def __init__(self, seqused: bool):
        self.seqused = seqused                 # keys used: `used` (else cu_k's differences)

    @cute.jit
    def __call__(self, cu_q: cute.Tensor, cu_k: cute.Tensor, used: cute.Tensor,
                 table: cute.Tensor, sort: Float32, stream):
        self.kernel(cu_q, cu_k, used, table, sort).launch(
            grid=[1, 1, 1], block=[TABLE_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, cu_q: cute.Tensor, cu_k: cute.Tensor, used: cute.Tensor,
               table: cute.Tensor, sort: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        j = Int32(tidx)
        batch = cu_q.shape[0] - 1
        smem = cutlass.memory.SmemAllocator()
        works = smem.allocate_tensor(cutlass.Int64, cute.make_layout(TABLE_THREADS),
                                     byte_alignment=16)
        oq, lq, ok, lk = Int32(0), Int32(0), Int32(0), Int32(0)
        work = cutlass.Int64(0)
        if j < batch:
            oq, ok = cu_q[j], cu_k[j]
            lq, lk = cu_q[j + 1] - oq, cu_k[j + 1] - ok
            if cutlass.const_expr(self.seqused):
                lk = used[j]
            work = cutlass.Int64(lq) * cutlass.Int64(lk)
            works[j] = work
        cute.arch.sync_threads()
        rank = j
        if sort > Float32(0.0):
            if j < batch:
                rank = Int32(0)
                for i in cutlass.range(batch, unroll=1):
                    other = works[i]
                    if other > work or (other == work and i < j):
                        rank = rank + 1
        if j < batch:
            table[0, rank], table[1, rank], table[2, rank] = oq, lq, ok
            table[3, rank], table[4, rank] = lk, j
        columns = batch + 1
        for at in cutlass.range(j, (table.shape[0] - 5) * columns, TABLE_THREADS, unroll=1):
            table[5 + at // columns, at % columns] = Int32(0)
        if j < 5:
            table[j, batch] = Int32(0)


# --------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------

def _example(shape, dtype):
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return torch.empty(shape, dtype=dtype, device=device)


def compile_varlen_backward(spec, kernel_factory, problem: Problem, options: dict,
                            compile_options: str = "") -> CompiledBackward:
    """compile_backward for a packed batch (options with varlen=True): the main kernel
    against packed example tensors, and the varlen pre- and post-processing kernels."""
    options = dict(options)
    spec.check(problem)
    d, dt = problem.head_dim, problem.dtype
    ffi = rt.tvm_ffi_available()
    key = ("varlen", spec.name, kernel_factory, d, problem.causal, dt,
           tuple(sorted(options.items())), compile_options, ffi)
    cached = _COMPILED.get(key)
    if cached is not None:
        return CompiledBackward(spec, problem, options, *cached, 0.0, ffi)
    t0 = time.perf_counter()
    kernel = kernel_factory(d, problem.causal, **options)
    n, h, h_kv, batch = 256, 2, 2, 2
    if getattr(kernel, "gqa", False):
        h, h_kv = 4, 2
    bm, pdl = kernel.block_m, bool(getattr(kernel, "pdl", False))
    rows = padded_rows(n, batch, bm)
    qkv = [_example((1, n, heads, d), dt) for heads in (h, h_kv, h_kv, h)]   # q, k, v, dO
    stats = [_example((1, h, rows), torch.float32) for _ in range(2)]         # lse2, D
    dq_accum = _example((1, h, rows, d), torch.float32)
    dkv = [_example((1, n, h_kv, d), dt) for _ in range(2)]
    seqs = _example((5 + h, batch + 1), torch.int32)
    main = rt.compile_with_tensors(kernel, *qkv, *stats, dq_accum, *dkv, seqs,
                                   scalars=(1.0, 1.0), options=compile_options, tvm_ffi=ffi)
    pre_key = ("varlen preprocess", d, dt, bm, ffi, pdl)
    if pre_key not in _COMPILED:
        lse = _example((h, n), torch.float32)
        _COMPILED[pre_key] = rt.compile_with_tensors(VarlenPreprocess(d, bm, pdl), qkv[0],
                                                     qkv[3], lse, *stats, dq_accum, seqs,
                                                     tvm_ffi=ffi)
    swap_ab = bool(getattr(kernel, "dq_swap_ab", False))
    per_head, bn = bool(getattr(kernel, "convert_per_head", False)), kernel.block_n
    rows = bool(getattr(kernel, "dq_rows", False))
    post_key = ("varlen postprocess", d, dt, bm, swap_ab, ffi, pdl, per_head, bn, rows)
    if post_key not in _COMPILED:
        convert = VarlenDqConvert(d, bm, swap_ab, pdl, per_head, bn, rows)
        _COMPILED[post_key] = rt.compile_with_tensors(convert, dq_accum, qkv[0], seqs,
                                                      scalars=(1.0,), tvm_ffi=ffi)
    _COMPILED[key] = (kernel, main, _COMPILED[pre_key], _COMPILED[post_key])
    return CompiledBackward(spec, problem, options, kernel, main, _COMPILED[pre_key],
                            _COMPILED[post_key], time.perf_counter() - t0, ffi)


def run_varlen_backward(handle: CompiledBackward, q, k, v, out, dout, lse, seqs, dq, dk, dv,
                        softmax_scale: float) -> torch.Tensor:
    """dq, dk, dv (written in place; packed like q, k, v) of a packed batch whose sequence
    table is `seqs` (`sequence_table`); lse (H, total_q) fp32. Three launches on the current
    stream. dk / dv rows of keys no sequence uses (past seqused_k) are not written. Returns
    the preprocess's D = rowsum(dO * O) in the padded layout ((1, H, padded rows) fp32; rows
    between the sequences' tiles unwritten: `packed_rows` reads it back)."""
    heads, d = q.shape[1], q.shape[2]
    rows = padded_rows(q.shape[0], seqs.shape[1] - 1, handle.block_m)
    dev = q.device
    lse2 = torch.empty((1, heads, rows), dtype=torch.float32, device=dev)
    dsum = torch.empty_like(lse2)
    dq_accum = torch.empty((1, heads, rows, d), dtype=torch.float32, device=dev)
    q4, k4, v4, o4, do4, dq4, dk4, dv4 = (t.unsqueeze(0) for t in (q, k, v, out, dout, dq, dk,
                                                                    dv))
    if handle.tvm_ffi:
        handle.preprocess(o4, do4, lse, lse2, dsum, dq_accum, seqs)
        handle.main(q4, k4, v4, do4, lse2, dsum, dq_accum, dk4, dv4, seqs,
                    softmax_scale * LOG2_E, softmax_scale)
        handle.postprocess(dq_accum, dq4, seqs, softmax_scale)
    else:
        stream = rt.current_stream()
        t = rt.to_cute_tensor
        handle.preprocess(t(o4), t(do4), t(lse), t(lse2), t(dsum), t(dq_accum), t(seqs), stream)
        handle.main(t(q4), t(k4), t(v4), t(do4), t(lse2), t(dsum), t(dq_accum), t(dk4), t(dv4),
                    t(seqs), softmax_scale * LOG2_E, softmax_scale, stream)
        handle.postprocess(t(dq_accum), t(dq4), t(seqs), softmax_scale, stream)
    return dsum


def packed_rows(padded: torch.Tensor, cu_seqlens_q: torch.Tensor, total_q: int,
                block_m: int) -> torch.Tensor:
    """Per-row values of the padded layout ((1, H, padded rows): D, lse2) in the packed order,
    (H, total_q): token t of sequence b sits at row padded_q(b) + t - cu_seqlens_q[b]. On
    the device (a searchsorted and a gather; nothing read on the host); tokens past
    cu_seqlens_q[-1] get some row's value (the caller masks them)."""
    cu = cu_seqlens_q.long()
    batch = cu.shape[0] - 1
    t = torch.arange(total_q, device=padded.device)
    b = torch.searchsorted(cu[1:], t, right=True).clamp_(max=max(batch - 1, 0))
    start = cu[b]
    rows = torch.div(start + b * block_m, block_m, rounding_mode="floor") * block_m + t - start
    return padded[0].index_select(1, rows)


def build_sequence_table(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                         seqused_k: Optional[torch.Tensor], longest_first: bool,
                         heads: int) -> torch.Tensor:
    """`sequence_table`, in one launch (`SequenceTableKernel`) where the batch fits it and the
    tensors are on a GPU, else by torch's ops."""
    batch = cu_seqlens_q.shape[0] - 1
    if not cu_seqlens_q.is_cuda or batch > TABLE_THREADS:
        return sequence_table(cu_seqlens_q, cu_seqlens_k, seqused_k, longest_first, heads)
    kernel, ffi = _table_kernel(seqused_k is not None, cu_seqlens_q.device)
    # (compiled for 16-byte aligned tensors: a slice of a larger one is copied)
    cu_q, cu_k, used = (t if t.data_ptr() % 16 == 0 and t.is_contiguous() else
                        t.clone(memory_format=torch.contiguous_format)
                        for t in (cu_seqlens_q, cu_seqlens_k,
                                  cu_seqlens_k if seqused_k is None else seqused_k))
    table = torch.empty((5 + heads, batch + 1), dtype=torch.int32, device=cu_q.device)
    sort = 1.0 if longest_first else 0.0
    if ffi:
        kernel(cu_q, cu_k, used, table, sort)
    else:
        t = rt.to_cute_tensor
        kernel(t(cu_q), t(cu_k), t(used), t(table), sort, rt.current_stream())
    return table


@functools.lru_cache(maxsize=8)
def _table_kernel(seqused: bool, device):
    """(SequenceTableKernel compiled, whether it takes torch tensors: TVM-FFI)."""
    ffi = rt.tvm_ffi_available()
    cu = torch.zeros(3, dtype=torch.int32, device=device)
    table = torch.empty((6, 3), dtype=torch.int32, device=device)
    return rt.compile_with_tensors(SequenceTableKernel(seqused), cu, cu, cu[:2], table,
                                   scalars=(1.0,), tvm_ffi=ffi), ffi


def _readable(t: torch.Tensor) -> bool:
    """TMA and the helpers read `t` in place: last dim contiguous, the other strides
    multiples of 16 bytes, 16-byte aligned."""
    return (t.stride(-1) == 1 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
            and t.data_ptr() % 16 == 0)


def compile_for(q, k, causal: bool, window=(None, None), softcap: float = 0.0,
                deterministic: bool = False, compile_options: str = ""):
    """kb2's varlen kernels for packed q (total_q, H, d), k (total_k, H_kv, d): ValueError
    (UnsupportedProblem) for what kb2 does not run. Cached per configuration (a call's host
    time: kb2's policy is looked up once)."""
    if deterministic:
        raise ValueError("the varlen backward has no deterministic mode")
    # (Problem's fields, None: unbounded)
    left, right = normalize_window((None, None) if window is None else window, bool(causal))
    return _compiled(q.shape[1], k.shape[1], q.shape[2], q.dtype, bool(causal), left, right,
                     float(softcap), compile_options, CONVERT_PER_HEAD)


@functools.lru_cache(maxsize=64)
def _compiled(heads, heads_kv, head_dim, dtype, causal, left, right, softcap, compile_options,
              per_head):
    from hopper_attn import kb2
    # (the lengths pick nothing in kb2's policy: a problem of one token stands for them)
    problem = Problem(1, heads, 1, head_dim, causal, dtype, heads_kv=heads_kv,
                      window_left=left, window_right=right)
    # the work list is the launch order (longest_first: the dense order at equal lengths), GQA
    # always sums a group's dK / dV in the CTA (no parts); the dQ conversion per head as
    # kb2's policy says (per sequence and head here), or, with CONVERT_PER_HEAD off, after
    # the whole main kernel
    return kb2.compile_kernel(problem, varlen=True, softcap=softcap, heads_first=False,
                              convert_per_head=None if per_head else False,
                              gqa=heads_kv != heads, compile_options=compile_options)


def varlen_backward(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                    max_seqlen_k: int, causal: bool, softmax_scale: Optional[float] = None,
                    seqused_k: Optional[torch.Tensor] = None, window=(-1, -1),
                    softcap: float = 0.0, return_d: bool = False):
    """(dq, dk, dv) of attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, ...) = out with
    LSE `lse` ((H, total_q) fp32) for the incoming gradient dout (packed like q). Every
    ValueError before a launch; nothing reads cu_seqlens on the host. dk and dv rows of keys
    past seqused_k are 0. `return_d`: also the preprocess's D = rowsum(dO * O), (H, total_q)
    fp32 in the packed order (for the sinks' gradient; tokens past cu_seqlens_q[-1]: any
    value)."""
    batch = check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         seqused_k)
    for name, t in (("out", out), ("dout", dout)):
        if not isinstance(t, torch.Tensor) or t.shape != q.shape or t.dtype != q.dtype \
                or t.device != q.device:
            raise ValueError(f"{name} must be a {q.dtype} tensor of q's shape "
                             f"{tuple(q.shape)} on {q.device}")
    want = (q.shape[1], q.shape[0])
    if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 \
            or tuple(lse.shape) != want or lse.device != q.device:
        raise ValueError(f"lse must be an fp32 tensor of shape {want} (heads, total_q) on "
                         f"{q.device}, as attention_varlen returns it")
    handle = compile_for(q, k, causal, window, softcap)
    scale = 1.0 / math.sqrt(q.shape[2]) if softmax_scale is None else float(softmax_scale)
    q, k, v, out, dout = (t if _readable(t) else t.contiguous() for t in (q, k, v, out, dout))
    lse = lse if lse.is_contiguous() and lse.data_ptr() % 16 == 0 else lse.clone(
        memory_format=torch.contiguous_format)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    # keys past seqused_k belong to no sequence: their rows are not written
    new = torch.empty if seqused_k is None else torch.zeros
    dk, dv = (new(k.shape, dtype=k.dtype, device=k.device) for _ in range(2))
    if q.shape[0] == 0 or k.shape[0] == 0:            # (out is 0: so is D)
        d_rows = q.new_zeros((q.shape[1], q.shape[0]), dtype=torch.float32)
        return (dq, dk.zero_(), dv.zero_()) + ((d_rows,) if return_d else ())
    # longest first where the lengths may differ (max_seqlen x batch above the token count)
    longest_first = LONGEST_FIRST and (max_seqlen_q * batch > q.shape[0]
                                       or max_seqlen_k * batch > k.shape[0])
    seqs = build_sequence_table(cu_seqlens_q, cu_seqlens_k, seqused_k, longest_first,
                                q.shape[1])
    parts = dkv_parts(q.shape[1], k.shape[1], k.shape[0], batch)
    if parts == 1:
        dsum = run_varlen_backward(handle, q, k, v, out, dout, lse, seqs, dq, dk, dv, scale)
        return (dq, dk, dv) + ((packed_rows(dsum, cu_seqlens_q, q.shape[0], handle.block_m),)
                               if return_d else ())
    # each k/v head's group in `parts` parts, each with its own dK / dV rows, summed in fp32
    shape = (k.shape[0], k.shape[1] * parts, k.shape[2])
    dk_parts, dv_parts = (new(shape, dtype=k.dtype, device=k.device) for _ in range(2))
    dsum = run_varlen_backward(handle, q, k, v, out, dout, lse, seqs, dq, dk_parts, dv_parts,
                               scale)
    split = (k.shape[0], k.shape[1], parts, k.shape[2])
    torch.sum(dk_parts.view(split), 2, out=dk)
    torch.sum(dv_parts.view(split), 2, out=dv)
    return (dq, dk, dv) + ((packed_rows(dsum, cu_seqlens_q, q.shape[0], handle.block_m),)
                           if return_d else ())


# GQA / MQA: a CTA walks its whole group of query heads, so with few k/v heads and few
# tokens the grid has few, long CTAs (MQA 16:1 over 16k tokens: ~140 kv tiles x 1 head).
# Each k/v head's group is then split in parts (the fewest that give PARTS_WAVES waves of
# CTAs on the GPU's SMs, counted from the token count: the lengths are not known here).
PARTS_WAVES = 4


def dkv_parts(heads: int, heads_kv: int, total_k: int, batch: int, block_n: int = 128) -> int:
    """How many parts each k/v head's dK / dV is split in (a divisor of the group)."""
    from .scheduler import sm_count
    group = heads // heads_kv
    ctas = (-(-total_k // block_n) + batch) * heads_kv
    return next(p for p in range(1, group + 1)
                if group % p == 0 and (ctas * p >= PARTS_WAVES * sm_count() or p == group))
