"""A CPU model of kb2's launch orders (dense grid, varlen work list): tile visits, the grid's
balance and the bytes L2 misses, to compare orders without a GPU.

    python tools/bwd_order_model.py [--l2-mib 50]

Each CTA (one per SM: kb2's ~193 KiB of SMEM) walks the query tiles its kv tile sees
(KVTileSchedule.host_tiles' range), one time unit per tile plus OVERHEAD units (prologue,
epilogue); CTAs start in launch order on the first free SM. Each visit reads the query
tile's Q and dO (block_m x d x 2 x 2 bytes) and reduce-adds its fp32 dQ (block_m x d x 4),
each CTA reads its K and V once; the accesses, in time order, go through an LRU cache of
the L2's size. Printed per order: CTAs, visits, the last CTA's end against the ideal
(visits and overheads over the SMs), and the bytes missed (dQ lines count twice in the
DRAM estimate: read for the add, written back). A model: no L2 partitions, no hashing, no
overlap of a CTA's epilogue with the next one's prologue.

Cases: equal lengths (8 x 2k, 16 heads, d 128, causal: the dense grid in 32 MiB head groups,
the varlen list now, and the varlen list tile-major over the whole batch, as it was before
the fix), and the 16k lognormal document mix of tools/varlen_bwd_gpu_check.py, longest
first and in the given order.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hopper_attn.common.masking import KVTileSchedule  # noqa: E402
from hopper_attn.common.varlen_backward import VarlenKVTileSchedule  # noqa: E402

BLOCK_M, BLOCK_N, D, HEADS, SMS = 64, 128, 128, 16, 132
OVERHEAD = 3.0                      # time units (query tile visits) a CTA spends outside them
L2_ROWS = (32 << 20) // (D * 8)     # kb2's longest_first groups (group_mib 32)


def simulate(order, lengths, l2_bytes, causal=True):
    """order: (sequence, kv tile, head) per CTA in launch order."""
    schedule = KVTileSchedule(BLOCK_M, BLOCK_N, causal)
    free = [(0.0, sm) for sm in range(SMS)]
    accesses, end, visits = [], 0.0, 0
    for seq, n, head in order:
        start, sm = heapq.heappop(free)
        n_q = lengths[seq]
        count = schedule.host_tiles(n, n_q, n_q)
        first = -(-n_q // BLOCK_M) - count
        accesses.append((start, ("kv", seq, head, n), 2 * BLOCK_N * D * 2))
        for i in range(count):
            accesses.append((start + 1 + i, ("q", seq, head, first + i), BLOCK_M * D * 4))
            accesses.append((start + 1.5 + i, ("dq", seq, head, first + i), BLOCK_M * D * 4))
        visits += count
        end = max(end, start + OVERHEAD + count)
        heapq.heappush(free, (start + OVERHEAD + count, sm))
    accesses.sort(key=lambda a: a[0])
    cache, used, missed = collections.OrderedDict(), 0, collections.Counter()
    for _, key, size in accesses:
        if key in cache:
            cache.move_to_end(key)
            continue
        missed[key[0]] += size
        cache[key] = size
        used += size
        while used > l2_bytes:
            used -= cache.popitem(last=False)[1]
    ideal = (visits + OVERHEAD * len(order)) / SMS
    dram = missed["kv"] + missed["q"] + 2 * missed["dq"]
    return {"ctas": len(order), "visits": visits, "end": end, "ideal": ideal,
            "missed_mib": {k: round(v / 2**20) for k, v in missed.items()},
            "dram_gib": dram / 2**30}


def line(label, r):
    m = r["missed_mib"]
    return (f"  {label:41} CTAs {r['ctas']:5} visits {r['visits']:6} end {r['end']:6.0f} "
            f"(ideal {r['ideal']:6.0f}) missed MiB K/V {m.get('kv', 0)} Q+dO {m.get('q', 0)} "
            f"dQ {m.get('dq', 0)}: DRAM ~{r['dram_gib']:.2f} GiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--l2-mib", type=int, default=50)
    l2 = parser.parse_args().l2_mib << 20
    batch, n = 8, 2048
    lengths = [n] * batch
    print(f"equal lengths B{batch} N{n} H{HEADS} d{D} causal, L2 {l2 >> 20} MiB:")
    dense = KVTileSchedule(BLOCK_M, BLOCK_N, True, L2_ROWS).host_order(n, n, HEADS, batch)
    print(line("dense kb2 (32 MiB head groups)",
               simulate([(hb // HEADS, nb, hb % HEADS) for nb, hb in dense], lengths, l2)))
    now = VarlenKVTileSchedule(BLOCK_M, BLOCK_N, True, L2_ROWS)
    print(line("varlen (dense order)", simulate(now.host_work_list(lengths, lengths, HEADS),
                                                lengths, l2)))
    whole = VarlenKVTileSchedule(BLOCK_M, BLOCK_N, True, 1 << 30)     # one group: the batch
    print(line("varlen tile-major over the batch (before)",
               simulate(whole.host_work_list(lengths, lengths, HEADS), lengths, l2)))
    from hopper_attn.harness.varlen_reference import lognormal_lengths
    lengths = lognormal_lengths(16384, 16)
    print(f"lognormal 16k (seed 16, {len(lengths)} documents) H{HEADS} d{D} causal:")
    given = now.host_work_list(lengths, lengths, HEADS)
    print(line("varlen, given order", simulate(given, lengths, l2)))
    by_work = sorted(range(len(lengths)), key=lambda b: -lengths[b])
    order = [(by_work[b], t, h) for b, t, h in
             now.host_work_list([lengths[b] for b in by_work], [lengths[b] for b in by_work],
                                HEADS)]
    print(line("varlen, longest first", simulate(order, lengths, l2)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
