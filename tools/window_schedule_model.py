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
  first, each CTA one item.

Printed per case and schedule: items, kv tiles (masked), the makespan in tile units against
the ideal (all work over 132 SMs) and the tail's loss, for a few OVERHEAD / EXTRA values;
then the overhead per item that the H200's times imply if k6's causal and windowed runs
share one per-tile cost. A model: no L2, no clocks, no overlap beyond what OVERHEAD says.
"""

from __future__ import annotations

import heapq
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hopper_attn.common.masking import window_needs_mask, window_ranges  # noqa: E402

SMS, BLOCK, HEADS = 132, 128, 16


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


def makespan(order, per_head, overhead, extra) -> float:
    free = [0.0] * SMS
    heapq.heapify(free)
    end = 0.0
    for m, _head in order:
        tiles, masked = per_head[m]
        t = heapq.heappop(free) + overhead + tiles + extra * masked
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def orders(m_blocks: int) -> dict:
    return {"k6 (head by head, last tile first)":
            [(m_blocks - 1 - m, h) for h in range(HEADS) for m in range(m_blocks)],
            "k6 longest_first, 4-head groups": head_group_sequence(m_blocks, HEADS, 4),
            "k6 longest_first, all 16 heads": head_group_sequence(m_blocks, HEADS, 16),
            "FA4 (grid, first tile first)": [(m, h) for h in range(HEADS)
                                             for m in range(m_blocks)]}


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
            for label, order in orders(m_blocks).items():
                if left < 0 and "groups" in label:
                    continue
                cells = []
                for overhead, extra in ((0, 0), (1, 0.3), (3, 0.3)):
                    ideal = HEADS * (tiles + extra * masked + overhead * m_blocks) / SMS
                    span = makespan(order, per_head, overhead, extra)
                    cells.append(f"X{overhead} y{extra}: {span:.0f}/{ideal:.0f} "
                                 f"(+{100 * (span / ideal - 1):.1f}%)")
                print(f"  {label:36} " + "; ".join(cells))
    # k6's H200 times (docs/window.md, docs/k6.md): per-tile cost of causal and window
    t_causal, t_win = 1.556 / (HEADS * 8256 / SMS), 0.743 / (HEADS * 3696 / SMS)
    print(f"k6 H200 16k: ms per kv tile per SM, causal {t_causal * 1e3:.3f} us, window "
          f"{t_win * 1e3:.3f} us ({100 * (t_win / t_causal - 1):+.1f}%); FA4 window "
          f"{0.733 / (HEADS * 3696 / SMS) * 1e3:.3f} us")
    # one per-item overhead X (tile units) explaining both: (448 + 15.5 X) / (1000.7 + 15.5 X)
    # = t_win / t_causal x 448 / 1000.7
    w, c, items = HEADS * 3696 / SMS, HEADS * 8256 / SMS, 2048 / SMS
    r = 0.743 / 1.556
    x = (r * c - w) / (items - r * items)
    print(f"  the same per-tile cost in both would need {x:.1f} tiles of overhead per item")
    return 0


if __name__ == "__main__":
    sys.exit(main())
