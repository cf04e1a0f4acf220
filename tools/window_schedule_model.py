"""A CPU model of the windowed forward's schedule (issue 61): k6's persistent dynamic grid
against FlashAttention-4's one-CTA-per-tile grid, at window (4095, 0) causal, d 128.

    python tools/window_schedule_model.py

Work items are query tiles (128 rows; kv tiles of 128 keys: `masking.window_ranges`, masked
ones by `window_needs_mask`). An item costs OVERHEAD + its kv tiles + EXTRA per masked
tile, in units of one unmasked kv tile (~1.6 us of one SM on the H200). Schedules, each a
list schedule onto 132 SMs (an item goes to the SM that frees first, in the given order):

* k6: 132 persistent CTAs taking items from a global counter in `TileScheduler`'s order:
  head by head (no head groups at 16k / 64k), the last query tile of a head first, or
  (``longest_first``) `head_group_order` over groups of `group` heads;
* FA4 (sm90, `is_local`): `SingleTileScheduler`, grid (query tiles, heads, batch), so the
  hardware starts CTAs with the query tile fastest, the first (shortest) tile of a head
  first, each CTA one item (full causal: `SingleTileLPTScheduler`, the last tile first in
  sections of as many heads as 50 MiB holds; our model puts the partial section first).

Printed per case and schedule: items, kv tiles (masked), the makespan in tile units against
the ideal (all work over 132 SMs) and the tail's loss, for OVERHEAD / EXTRA (X / y) 0 / 0
and 2 / 0.3; with a window the K/V bytes an LRU cache of 30 MiB misses (each kv tile read
at its step's time; 128 MiB at 16k, 512 at 64k: every tile once); then the H200's measured
cost per kv tile. A model: no clocks, no overlap beyond what OVERHEAD says. Takes ~20 s.
"""

from __future__ import annotations

import collections
import heapq
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hopper_attn.common.masking import window_needs_mask, window_ranges  # noqa: E402

SMS, BLOCK, HEADS = 132, 128, 16
TILE_KV_BYTES = 2 * BLOCK * 128 * 2          # a kv tile's K and V, d 128, bf16
L2_MIB = 30                                 # (the H200's 60 MiB in two halves)


def items_of_head(seqlen: int, left: int) -> list:
    """(kv tiles, masked tiles) of each query tile m = 0 .. M - 1 of one head (left < 0:
    full causal)."""
    out = []
    for m in range(-(-seqlen // BLOCK)):
        first, count = window_ranges(m, BLOCK, BLOCK, seqlen, seqlen, left, 0)
        masked = sum(window_needs_mask(m, n, BLOCK, BLOCK, seqlen, seqlen, left, 0)
                     for n in range(first, count))
        out.append((count - first, masked))
    return out


def head_group_sequence(m_blocks: int, heads: int, group: int) -> list:
    """(m, head) in `head_group_order`'s order, the last query tile first."""
    seq, first = [], heads % group
    for index in range(m_blocks * heads):
        if index < first * m_blocks:
            slot, hb = index // first, index % first
        else:
            rest = index - first * m_blocks
            in_group = rest % (group * m_blocks)
            slot, hb = in_group // group, first + (rest // (group * m_blocks)) * group \
                + in_group % group
        seq.append((m_blocks - 1 - slot, hb))
    return seq


def makespan(order, per_head, overhead, extra, l2_mib=0):
    """(the last SM's end, MiB of K/V missed by an LRU cache of l2_mib (0: not modelled))."""
    free = [(0.0, sm) for sm in range(SMS)]
    end, reads = 0.0, []
    for m, head in order:
        start, sm = heapq.heappop(free)
        tiles, masked = per_head[m]
        reads += [(start + overhead + i, (head, m - tiles + 1 + i)) for i in range(tiles)]
        t = start + overhead + tiles + extra * masked
        end = max(end, t)
        heapq.heappush(free, (t, sm))
    missed = 0
    if l2_mib:
        cache, capacity = collections.OrderedDict(), (l2_mib << 20) // TILE_KV_BYTES
        for _, key in sorted(reads, key=lambda r: r[0]):
            if key in cache:
                cache.move_to_end(key)
            else:
                missed, cache[key] = missed + 1, True
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return end, missed * TILE_KV_BYTES / 2 ** 20


def orders(m_blocks: int, windowed: bool) -> dict:
    """(m, head) per schedule, in start order."""
    out = {"k6 now (head by head, last tile first)":
           [(m_blocks - 1 - m, h) for h in range(HEADS) for m in range(m_blocks)]}
    for group in (4, 8, 16) if windowed else (16,):
        out[f"k6 window_group={group}"] = head_group_sequence(m_blocks, HEADS, group)
    if windowed:                 # SingleTileScheduler: the grid's order
        out["FA4 (grid, first tile first)"] = [(m, h) for h in range(HEADS)
                                               for m in range(m_blocks)]
    else:                        # SingleTileLPTScheduler: heads by L2 sections, longest first
        swizzle = 1 << max(((50 << 20) // (m_blocks * TILE_KV_BYTES)).bit_length() - 1, 0)
        out[f"FA4 (LPT, {swizzle}-head sections)"] = head_group_sequence(m_blocks, HEADS,
                                                                         swizzle)
    return out


def main() -> int:
    for seqlen in (16384, 65536):
        for left, name in ((4095, "w4096"), (-1, "full causal")):
            per_head = items_of_head(seqlen, left)
            tiles = sum(t for t, _ in per_head)
            masked = sum(k for _, k in per_head)
            m_blocks = len(per_head)
            print(f"N {seqlen // 1024}k {name}: per head {m_blocks} items, {tiles} kv tiles "
                  f"({masked} masked); {m_blocks * HEADS} items on {SMS} SMs = "
                  f"{m_blocks * HEADS / SMS:.2f} per SM")
            for label, order in orders(m_blocks, left >= 0).items():
                cells = []
                for overhead, extra in ((0, 0), (2, 0.3)):
                    ideal = HEADS * (tiles + extra * masked + overhead * m_blocks) / SMS
                    span, _ = makespan(order, per_head, overhead, extra)
                    cells.append(f"X{overhead} y{extra}: {span:.0f} / {ideal:.0f} "
                                 f"(+{100 * (span / ideal - 1):.1f}%)")
                if left >= 0:
                    _, missed = makespan(order, per_head, 2, 0.3, L2_MIB)
                    cells.append(f"K/V missed ({L2_MIB} MiB LRU) {missed:.0f} MiB")
                print(f"  {label:38} " + "; ".join(cells))
    # k6's H200 times (docs/window.md, docs/k6.md): per-tile cost of causal and window
    t_causal, t_win = 1.556 / (HEADS * 8256 / SMS), 0.743 / (HEADS * 3696 / SMS)
    print(f"H200 16k, us per kv tile and SM: k6 causal {t_causal * 1e3:.3f}, window "
          f"{t_win * 1e3:.3f} ({100 * (t_win / t_causal - 1):+.1f}%); FA4 window "
          f"{0.733 / (HEADS * 3696 / SMS) * 1e3:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
