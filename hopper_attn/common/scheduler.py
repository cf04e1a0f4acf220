"""Which (query tile, head, batch) work items a CTA runs, in which order (k5 on).

A work item is one query tile: block_m rows of one head of one batch entry, against all the
kv tiles it may see (`masking.TileSchedule` says which). Two schedules:

* ``persistent=False`` (k5): one CTA per work item, grid (query tiles, heads, batch). With a
  causal mask CTA x takes query tile (tiles - 1 - x): the hardware starts CTAs in launch
  order, so the longest ones start first and the short ones fill the tail. gridDim.y and .z
  are capped at 65535, so heads and batch must be too (`KernelSpec` refuses more).
* ``persistent=True`` (k6): one CTA per SM (grid = min(work items, SMs)), each looping over
  work items in the order of the single-tile grid (query tile fastest, then head, then
  batch; with a causal mask the longest query tiles first), so the CTAs running at one time
  read the same head's K and V through L2. A CTA's K/V rings run on from one work item to
  the next, and its loads for the next item start while it still stores the previous
  output (the producer warp runs ahead), which the single-tile schedule cannot do. Any
  batch x heads fits. Which items a CTA runs:
    - static (full attention, where every item costs the same): items c, c + grid, ...
    - ``dynamic=True`` (causal, where items differ in length): the first item is the CTA's
      index, each later one comes from a global counter (`fetch_next_item`, one atomicAdd
      by the producer warp when it has issued the loads of its current item), and reaches
      the consumer warpgroups through `ItemQueue`. So an item goes to the first CTA that
      is free, as the hardware does with one CTA per item; a static assignment (even one
      that alternates direction every round) measured up to a third slower (docs/k6.md).
    - ``l2_rows`` (dynamic, k6's `longest_first`): item i decoded by `head_group_order`
      (by the producer warp only, which passes the result on through the `ItemQueue`),
      heads taken in groups (about `l2_rows` query rows each, so their K and V share L2)
      and the longest query tile of every head of a group first, instead of head by head:
      a head's long items no longer start behind the previous head's short ones, so the
      schedule does not end on long items (FlashAttention-4's causal forward orders its
      tiles this way too; docs/lab/k6.md "Longest first, by head group").
* ``varlen=True`` (a packed batch, common/varlen.py): the work list holds the query tiles of
  every sequence, sequence by sequence (no empty items): `varlen_item` finds an item's
  sequence by a warp-wide prefix sum of the per-sequence item counts (ceil(seqlen_q / block_m)
  x heads), 32 sequences per step; inside a sequence the query tile runs fastest, then the
  head, as above, or with `l2_rows` in head groups, the longest query tile of every head of
  a group first (with a causal mask the last query tile first). The host bounds the grid
  by (ceil(total_q / block_m) + batch) x heads items without reading the lengths; items past
  the real count are invalid. In the persistent grid the dynamic schedule's producer warp
  decodes each item (as with `l2_rows`) and passes it on.
  (cutlass.utils' StaticPersistentTileScheduler walks the same kind of index, but it is
  deprecated in CuTe DSL 4.8 and moving to the examples; the loop here is a few lines.)
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def head_group_order(index, slots, heads_total, group):
    """(slot, hb) of the `index`-th work item when the heads (hb = batch * heads + head)
    are taken in groups of `group` heads and, inside a group, slot 0 of every head comes
    first, then slot 1, ... (a slot is a tile of the head: the longest first when slot 0 is
    the longest). The group holding the remainder (heads_total % group heads) comes first,
    so that no long item starts last. Used with a causal mask, where a head's tiles differ
    in length, so that the long ones start first while a group's heads still share L2
    (kb2's CTAs, k6's work items)."""
    first = heads_total % group                 # heads in the first, smaller group (or 0)
    slot, hb = Int32(0), Int32(0)
    if index < first * slots:
        slot, hb = index // first, index % first
    else:
        rest = index - first * slots
        in_group = rest % (group * slots)
        slot = in_group // group
        hb = first + (rest // (group * slots)) * group + in_group % group
    return slot, hb


@cute.jit
def heads_per_group(rows_budget: int, rows_per_head, heads_total):
    """How many heads `head_group_order` takes together: as many as hold `rows_budget`
    rows of `rows_per_head` each (at least one, at most all)."""
    return cutlass.min(cutlass.max(rows_budget // rows_per_head, 1), heads_total)


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
    dynamic: bool = False        # persistent: work items from a global counter (below)
    # dynamic (causal): items in groups of heads holding about `l2_rows` query rows, the
    # longest query tile of every head of a group first (head_group_order); 0: head by head
    l2_rows: int = 0
    # the static schedule's item decode with the library's FastDivmod (cute.FastDivmodDivisorV2:
    # a multiply and a shift per division, the divisors' magic numbers computed once per CTA)
    # instead of two integer divisions per item (k6's option)
    fast_divmod: bool = False
    # the static schedule's last one to two rounds as stream-K: their kv tiles spread evenly
    # over the CTAs, an item split across two neighbouring CTAs at most (k6's option; needs
    # no mask: every item has the same ceil(seqlen_k / block_n) kv tiles). See `piece`.
    stream_k: bool = False
    block_n: int = 0             # (stream_k: the kv tile)
    # a packed batch (module doc): `seqlen_q` in `grid` is the total query count and in
    # `work` the cu_seqlens_q tensor; batch_size the number of sequences
    varlen: bool = False

    @property
    def by_head_group(self) -> bool:
        """Items decoded by `head_group_order`: then the producer warp decodes each one and
        passes (query tile, head, batch, valid) on through the `ItemQueue` (seven integer
        divisions in every consumer thread cost 0.5-2% in k6's loop, docs/k6.md)."""
        return (self.l2_rows > 0 or self.varlen) and self.dynamic

    def grid(self, seqlen_q, heads, batch):
        """Host side (inside the @cute.jit __call__)."""
        m_blocks = cute.ceil_div(seqlen_q, self.block_m)
        if cutlass.const_expr(self.varlen):        # at most one partial tile per sequence
            items = (m_blocks + batch) * heads
            return [cutlass.min(items, self.ctas) if self.persistent else items, 1, 1]
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
    # `tiles` is an Int32, the work items this CTA has done; it is reassigned, not mutated,
    # so that the DSL carries it around the loop.
    @cute.jit
    def start(self):
        if cutlass.const_expr(self.dynamic):
            bx, _, _ = cute.arch.block_idx()           # the first work item: the CTA's index
            return cute.arch.make_warp_uniform(Int32(bx))
        return Int32(0)

    @cute.jit
    def advance(self, tiles):
        return cute.arch.make_warp_uniform(tiles + 1)

    @cute.jit
    def piece(self, tiles, seqlen_q, seqlen_k, heads, batch_size):
        """`stream_k`: (work item, valid, first kv tile k0, end k1) of this CTA's piece
        `tiles`. With T items of n kv tiles on G CTAs (T >= G: the grid is min(T, SMs)),
        pieces 0 .. R - 1 are whole items of R = T // G - 1 rounds as in the static schedule;
        the S = T - R G items left (G <= S < 2G) are S n kv-tile steps, CTA c owning the
        steps [c S n // G, (c + 1) S n // G), at least n of them: an item is split across two
        neighbouring CTAs at most, and no piece is cut at both ends. Each CTA walks its steps
        backwards, so the piece that begins an item (k1 < n: it leaves its partial result for
        the next CTA) comes first, and the one that ends an item (k0 > 0: it merges that
        partial) last, in the CTA with the higher index."""
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        c, g = Int32(cta), Int32(grid)
        n = cute.ceil_div(seqlen_k, self.block_n)
        total = cute.ceil_div(seqlen_q, self.block_m) * heads * batch_size
        rounds = total // g - 1
        item = tiles * g + c
        k0, k1 = Int32(0), Int32(n)
        valid = tiles < rounds
        if tiles >= rounds:
            steps = (total - rounds * g) * n
            lo = c * steps // g
            hi = (c + 1) * steps // g
            tail = (hi - 1) // n - (tiles - rounds)      # the tail item, counted from 0
            valid = tail >= 0 and (tail + 1) * n > lo
            item = rounds * g + tail
            k0 = cutlass.max(lo - tail * n, 0)
            k1 = cutlass.min(hi - tail * n, n)
        uniform = cute.arch.make_warp_uniform
        return uniform(item), valid, uniform(k0), uniform(k1)

    @cute.jit
    def work(self, tiles, seqlen_q, heads, batch_size, seqlen_k=None):
        """(query tile, head, batch, valid) of the current work item (stream_k: of the
        current piece; then seqlen_k is needed; varlen: seqlen_q is cu_seqlens_q)."""
        if cutlass.const_expr(self.varlen):
            item = tiles                                # dynamic, or one CTA per item
            if cutlass.const_expr(self.persistent and not self.dynamic):
                cta, _, _ = cute.arch.block_idx()
                grid, _, _ = cute.arch.grid_dim()
                item = tiles * Int32(grid) + Int32(cta)
            elif cutlass.const_expr(not self.persistent):
                cta, _, _ = cute.arch.block_idx()
                item = Int32(cta)
            m_block, head, batch, valid = varlen_item(item, seqlen_q, self.block_m, heads,
                                                      batch_size, self.causal, self.l2_rows)
            if cutlass.const_expr(not self.persistent):
                valid = valid and tiles == 0
            return m_block, head, batch, valid
        m_blocks = cute.ceil_div(seqlen_q, self.block_m)
        if cutlass.const_expr(not self.persistent):
            bx, head, batch = cute.arch.block_idx()
            m_block = bx
            if cutlass.const_expr(self.causal):
                m_block = m_blocks - 1 - bx
            return Int32(m_block), Int32(head), Int32(batch), tiles == 0
        if cutlass.const_expr(self.stream_k):           # the item of piece `tiles`
            item, valid, _, _ = self.piece(tiles, seqlen_q, seqlen_k, heads, batch_size)
        else:
            if cutlass.const_expr(self.dynamic):
                item = tiles                            # the work item's index itself
            else:                                       # round `tiles`: CTA c takes item
                cta, _, _ = cute.arch.block_idx()       # tiles * grid + c
                grid, _, _ = cute.arch.grid_dim()
                item = tiles * Int32(grid) + Int32(cta)
            valid = item < m_blocks * heads * batch_size
        if cutlass.const_expr(self.by_head_group):
            group = heads_per_group(self.l2_rows, seqlen_q, heads * batch_size)
            m_block, hb = head_group_order(item, m_blocks, heads * batch_size, group)
            head, batch = hb % heads, hb // heads
        else:                                           # (query tile, head, batch)
            if cutlass.const_expr(self.fast_divmod):
                rest, m_block = divmod(item, cute.fast_divmod_create_divisor_v2(Int32(m_blocks)))
                batch, head = divmod(rest, cute.fast_divmod_create_divisor_v2(Int32(heads)))
            else:
                m_block = item % m_blocks
                rest = item // m_blocks
                head = rest % heads
                batch = rest // heads
        if cutlass.const_expr(self.causal):             # the longest query tiles first
            m_block = m_blocks - 1 - m_block
        # warp-uniform: ptxas may keep them in uniform registers, off the consumers' budget
        uniform = cute.arch.make_warp_uniform
        return uniform(Int32(m_block)), uniform(Int32(head)), uniform(Int32(batch)), valid


@cute.jit
def varlen_item(index, cu_seqlens_q: cute.Tensor, block_m: int, heads, batch_size,
                last_first: bool, l2_rows: int = 0):
    """(query tile, head, sequence, valid) of work item `index` of a packed batch (module
    doc; every lane of the warp calls it). Each step loads the lengths of 32 sequences, one
    per lane, and prefix-sums their item counts across the warp: the item lies in this step
    when its index is below the sum, in the sequence of the first lane whose running sum
    passes it (the count of lanes at or below it, by a ballot). Inside the sequence: query
    tile fastest, or (l2_rows) `head_group_order`'s head groups of about l2_rows rows."""
    lane = cute.arch.lane_idx()
    first = Int32(0)                    # the step's first sequence
    rel = Int32(index)                  # the index counted from that sequence's first item
    m_block, head, batch, valid = Int32(0), Int32(0), Int32(0), False
    searching = first < batch_size
    while searching:
        b = first + lane
        m_blocks, length = Int32(0), Int32(0)
        if b < batch_size:
            length = cu_seqlens_q[b + 1] - cu_seqlens_q[b]
            m_blocks = cute.ceil_div(length, block_m)
        count = m_blocks * heads
        running = count                 # inclusive prefix sum over the lanes
        for i in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(running, 1 << i)
            if lane >= (1 << i):
                running = running + up
        step_items = cute.arch.shuffle_sync(running, 31)
        if rel < step_items:
            at = cute.arch.popc(cute.arch.vote_ballot_sync(running <= rel))
            tiles = cute.arch.shuffle_sync(m_blocks, at)
            within = rel - cute.arch.shuffle_sync(running - count, at)
            if cutlass.const_expr(l2_rows > 0):
                group = heads_per_group(l2_rows, cute.arch.shuffle_sync(length, at), heads)
                m_block, head = head_group_order(within, tiles, heads, group)
            else:
                m_block = within % tiles
                head = within // tiles
            if cutlass.const_expr(last_first):
                m_block = tiles - 1 - m_block
            batch = first + at
            valid = True
            searching = False
        else:
            rel = rel - step_items
            first = first + 32
            searching = first < batch_size
    uniform = cute.arch.make_warp_uniform
    return uniform(m_block), uniform(head), uniform(batch), valid


# --------------------------------------------------------------------------------------------
# Dynamic persistent scheduling (k6 with a causal mask): the next work item goes to the CTA
# that asks first, as the hardware does with one CTA per work item. The counter is an int32
# [next item, CTAs done] in global memory (contract.work_counter), zero between launches.
# --------------------------------------------------------------------------------------------

@cute.jit
def fetch_next_item(counter: cute.Tensor) -> Int32:
    """Producer warp (all lanes): the next work item. Items 0 .. grid - 1 are the CTAs'
    first ones (by CTA index); later ones come from the counter, one atomicAdd each."""
    grid, _, _ = cute.arch.grid_dim()
    item = Int32(0)
    if cute.arch.lane_idx() == 0:
        item = Int32(grid) + cute.arch.atomic_add(counter.iterator, Int32(1), sem="relaxed",
                                                  scope="gpu")
    return cute.arch.make_warp_uniform(cute.arch.shuffle_sync(item, 0))


@cute.jit
def retire(counter: cute.Tensor):
    """Producer warp, after its last fetch: count this CTA done; the last one to finish zeroes
    the counter for the next launch (acq_rel: every CTA's fetches come before its count)."""
    if cute.arch.lane_idx() == 0:
        grid, _, _ = cute.arch.grid_dim()
        done = cute.arch.atomic_add(counter.iterator + 1, Int32(1), sem="acq_rel", scope="gpu")
        if done == Int32(grid) - 1:
            counter[0] = Int32(0)
            counter[1] = Int32(0)


@dataclasses.dataclass(frozen=True)
class ItemQueue:
    """The producer warp hands each fetched work item to the consumer warpgroups through a
    2-slot ring in shared memory (full/empty mbarriers: cutlass.pipeline.PipelineAsync). A
    slot holds up to slots.shape[0] Int32: the item's index, or (TileScheduler's
    `by_head_group`) the decoded (query tile, head, batch, valid)."""

    pipe: object
    slots: cute.Tensor            # Int32 (values, 2 slots) in SMEM

    @staticmethod
    def create(barriers, slots: cute.Tensor, consumer_threads: int) -> "ItemQueue":
        import cutlass.pipeline as pipeline
        pipe = pipeline.PipelineAsync.create(
            barrier_storage=barriers, num_stages=2,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_threads),
            defer_sync=True)
        return ItemQueue(pipe, slots)

    def publish(self, state, *values):
        """Producer warp (all lanes): one or more Int32 values (a slot holds
        slots.shape[0])."""
        self.pipe.producer_acquire(state)
        for i, value in enumerate(values):
            self.slots[i, state.index] = value
        self.pipe.producer_commit(state)

    def receive(self, state, count: int = 1):
        """Every consumer thread: the slot's first `count` values (one: the value itself)."""
        self.pipe.consumer_wait(state)
        values = [self.slots[i, state.index] for i in range(count)]
        self.pipe.consumer_release(state)
        values = [cute.arch.make_warp_uniform(v) for v in values]
        return values[0] if count == 1 else tuple(values)
