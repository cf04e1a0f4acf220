"""A model of k6's dynamic persistent schedule (no compile): G CTAs, each taking its first
work item by CTA index and every later one from a shared counter, in random interleavings.
Every item must run exactly once, the longest first, and the counter must be back at zero
after the launch (the last CTA resets it), so that the next launch starts clean."""

import random

import pytest


def run_launch(items: int, grid: int, counter: list, rng: random.Random,
               fetched: list = None) -> list:
    """One launch; returns the items in the order they ran (by any CTA); `fetched` collects
    the items in the order the counter handed them out."""
    taken = []
    current = {c: c for c in range(grid)}            # first item: the CTA's index
    done = set()
    while len(done) < grid:
        cta = rng.choice([c for c in range(grid) if c not in done])
        item = current[cta]
        if item < items:                             # valid: run it, then fetch the next
            taken.append(item)
            current[cta] = grid + counter[0]         # fetch_next_item: atomicAdd(counter[0])
            counter[0] += 1
            if fetched is not None:
                fetched.append(current[cta])
        else:                                        # retire: atomicAdd(counter[1]); last resets
            old = counter[1]
            counter[1] += 1
            if old == grid - 1:
                counter[0] = counter[1] = 0
            done.add(cta)
    return taken


@pytest.mark.parametrize("items,grid", [(1, 1), (5, 132), (132, 132), (133, 132), (1000, 132),
                                        (4096, 7)])
def test_every_item_once_and_counter_reset(items, grid):
    rng = random.Random(items * 1000 + grid)
    counter = [0, 0]
    for _ in range(3):                               # three launches on one stream
        grid_size = min(items, grid)                 # the kernel's grid
        taken = run_launch(items, grid_size, counter, rng)
        assert sorted(taken) == list(range(items))
        assert counter == [0, 0]


def test_items_are_handed_out_in_index_order_after_the_first_wave():
    """Items past the first wave are handed out in increasing index, i.e. (causal) the
    longest remaining query tile first, to whichever CTA asks first."""
    counter, fetched = [0, 0], []
    run_launch(500, 20, counter, random.Random(0), fetched)
    assert fetched == list(range(20, 20 + len(fetched)))


def stream_k_pieces(cta: int, grid: int, total: int, n: int) -> list:
    """A model of TileScheduler.piece (k6's stream_k): the pieces of one CTA in the order it
    runs them, as (item, k0, k1)."""
    rounds = total // grid - 1
    pieces = [(t * grid + cta, 0, n) for t in range(rounds)]
    steps = (total - rounds * grid) * n
    lo, hi = cta * steps // grid, (cta + 1) * steps // grid
    tail = (hi - 1) // n
    while tail >= 0 and (tail + 1) * n > lo:                # backwards through the range
        pieces.append((rounds * grid + tail, max(lo - tail * n, 0), min(hi - tail * n, n)))
        tail -= 1
    return pieces


@pytest.mark.parametrize("grid", [1, 7, 132])
def test_stream_k_pieces(grid):
    """Every kv tile of every item exactly once; an item in one piece or in two pieces of
    neighbouring CTAs; the piece that begins a split item (k1 < n) is the first tail piece of
    CTA c and the one that ends it (k0 > 0) the last piece of CTA c + 1 (it waits for a lower
    CTA index only, which then has long written its part); no piece cut at both ends."""
    rng = random.Random(grid)
    for _ in range(200):
        total = rng.randint(grid, 6 * grid)
        n = rng.choice([1, 2, 3, 17, 80, rng.randint(1, 300)])
        owners = {}
        for cta in range(grid):
            pieces = stream_k_pieces(cta, grid, total, n)
            for i, (item, k0, k1) in enumerate(pieces):
                assert 0 <= k0 < k1 <= n and not (k0 > 0 and k1 < n)
                owners.setdefault(item, []).append((cta, k0, k1))
                if k1 < n:                                   # leaves its state: runs first
                    assert i == total // grid - 1, (total, n, cta, pieces)
                if k0 > 0:                                   # merges: runs last
                    assert i == len(pieces) - 1
        assert sorted(owners) == list(range(total))
        for item, parts in owners.items():
            parts.sort(key=lambda p: p[1])
            assert parts[0][1] == 0 and parts[-1][2] == n
            assert all(a[2] == b[1] for a, b in zip(parts, parts[1:]))   # no gap, no overlap
            assert len(parts) <= 2
            if len(parts) == 2:
                assert parts[1][0] == parts[0][0] + 1                    # CTA c, then c + 1
