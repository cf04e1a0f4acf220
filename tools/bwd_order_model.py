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

Cases, causal and not: equal lengths (8 x 2k and 4 x 16k, as tools/varlen_bwd_gpu_check.py
compares with the dense backward: the dense grid's order, the varlen list now and before),
and the 16k and 64k lognormal document mixes of that check (the varlen list now and
before). Takes about a minute.
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
    return (f"  {label:22} CTAs {r['ctas']:5} visits {r['visits']:7} end {r['end']:6.0f} "
            f"(ideal {r['ideal']:6.0f}) missed MiB K/V {m.get('kv', 0)} Q+dO {m.get('q', 0)} "
            f"dQ {m.get('dq', 0)}: DRAM ~{r['dram_gib']:.2f} GiB")


def before(lengths, causal):
    """The varlen list before this model's findings: inside a sequence kv tile 0 of every
    head, then kv tile 1, ... (with or without a mask); with a mask (d 128) at equal lengths
    (<= 32 sequences) kv tile 0 of every sequence and head first, over the whole batch."""
    tiles = [-(-n // BLOCK_N) for n in lengths]
    if causal and len(set(tiles)) == 1 and len(lengths) <= 32:
        return [(b, n, h) for n in range(tiles[0]) for b in range(len(lengths))
                for h in range(HEADS)]
    return [(b, n, h) for b in range(len(lengths)) for n in range(tiles[b])
            for h in range(HEADS)]


def main() -> int:
    global BLOCK_M
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--l2-mib", type=int, default=50)
    l2 = parser.parse_args().l2_mib << 20
    from hopper_attn.harness.varlen_reference import lognormal_lengths
    print(f"H{HEADS} d{D}, L2 {l2 >> 20} MiB (kb2's tiles at d 128: 64 query rows with a "
          f"mask, 80 without)")
    for causal in (True, False):
        BLOCK_M = 64 if causal else 80
        tag = "causal" if causal else "full"
        now = VarlenKVTileSchedule(BLOCK_M, BLOCK_N, causal, L2_ROWS if causal else 0)
        for batch, n in ((8, 2048), (4, 16384)):
            lengths = [n] * batch
            print(f"equal lengths B{batch} N{n} {tag}:")
            dense = KVTileSchedule(BLOCK_M, BLOCK_N, causal, L2_ROWS if causal else 0)
            order = [(hb // HEADS, nb, hb % HEADS)
                     for nb, hb in dense.host_order(n, n, HEADS, batch)]
            print(line("dense kb2", simulate(order, lengths, l2, causal)))
            print(line("varlen before", simulate(before(lengths, causal), lengths, l2,
                                                 causal)))
            print(line("varlen now", simulate(now.host_work_list(lengths, lengths, HEADS),
                                              lengths, l2, causal)))
        for total, seed in ((16384, 16), (65536, 64)):
            lengths = sorted(lognormal_lengths(total, seed), reverse=True)  # (longest first)
            print(f"lognormal {total // 1024}k (seed {seed}, {len(lengths)} documents, "
                  f"longest first) {tag}:")
            print(line("varlen before", simulate(before(lengths, causal), lengths, l2,
                                                 causal)))
            print(line("varlen now", simulate(now.host_work_list(lengths, lengths, HEADS),
                                              lengths, l2, causal)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
