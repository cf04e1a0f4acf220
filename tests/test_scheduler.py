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
