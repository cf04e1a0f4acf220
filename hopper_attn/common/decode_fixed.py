"""Variants of the decode stage aimed at its fixed cost per call (compile-time, off by default).

A one-wave split (B1: 8 k/v heads x 16 splits = 128 CTAs) pays, once per call and on the
critical path, the launch, every CTA's first K/V latency, the straggler tail of the stream and
the combine's chain (partial stores, fence, counter, the last CTA's L2 reads); docs/decode.md
("The fixed cost of one call") accounts for it. Two options of `DecodeAttention`:

* `pdl`: programmatic dependent launch. The kernel is launched with the
  programmatic-stream-serialization attribute; every CTA inits its mbarriers and prefetches
  the TMA descriptors, then `griddepcontrol.wait`s for the previous grid (its writes of q,
  k, v and of this handle's workspace become visible) before it reads or writes global
  memory, and lets the next grid launch (`griddepcontrol.launch_dependents`). It only pays
  where the kernel before it in the stream is a PDL launch too and no event sits between
  them (a chain of decode calls, a model whose kernels trigger): its launch and prologue
  then overlap that kernel's tail. A lone call after a torch kernel gains nothing.
* `l2_prefetch` = A (tiles): the producer asks L2 for the split's kv tile j + A when it
  issues tile j's TMA (and with the first, for tiles stages..A-1), so a split has up to
  `stages` + A tiles in flight instead of `stages`: the tail of the stream, where a few
  late CTAs finish alone at what their ring holds in flight, is served from L2. Contiguous
  K/V only. A x 64 KiB x 128 CTAs must stay well inside the 50 MB L2 (A <= 4).
* `lean_tail`: the combining CTA zeroes its item's counter after the combine instead of
  before it, and skips the second `fence.acq_rel.gpu`. Thread 0's counter store no longer
  sits in front of its fence (a fence waits for the thread's stores: one L2 round trip on
  the critical path), and the acquire is already there: thread 0's `atom.acq_rel.gpu`
  followed by the CTA barrier orders every consumer's loads after the other splits'
  released partials (the pattern of a split-K semaphore). Nothing else touches the counter
  in this launch (every split has counted), and the kernel's end publishes the zero.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

MAX_L2_PREFETCH = 8


def check_variant(kv_cache: bool, pdl, l2_prefetch, lean_tail) -> tuple[bool, int, bool]:
    """(pdl, l2_prefetch, lean_tail) as the kernel keeps them; ValueError for what it does
    not support."""
    if not 0 <= int(l2_prefetch) <= MAX_L2_PREFETCH:
        raise ValueError(f"l2_prefetch must be 0-{MAX_L2_PREFETCH} tiles, got {l2_prefetch}")
    if kv_cache and (pdl or l2_prefetch):
        raise ValueError("pdl and l2_prefetch: the contiguous decode only (not kv_cache)")
    return bool(pdl), int(l2_prefetch), bool(lean_tail)


def options(pdl, l2_prefetch, lean_tail) -> dict:
    """The compile options of a variant: none for the default (the cache key stays)."""
    return {**({"pdl": True} if pdl else {}),
            **({"l2_prefetch": int(l2_prefetch)} if l2_prefetch else {}),
            **({"lean_tail": True} if lean_tail else {})}


def wait_for_previous_grid():
    """Every thread, after the mbarrier inits: wait for the previous grid's memory, then let
    the next grid launch (it waits the same way before it touches this call's outputs)."""
    cute.arch.griddepcontrol_wait()
    cute.arch.griddepcontrol_launch_dependents()


@cute.jit
def prefetch_ahead(k_tiles, v_tiles, n_first, n_count, j, stages: cutlass.Constexpr[int],
                   ahead: cutlass.Constexpr[int]):
    """The producer, after tile j's TMA: an L2 prefetch of the split's tile j + ahead, and
    after the first, of tiles stages..ahead-1 (the ring's first `stages` are loaded at once
    anyway, and later ones are asked for by the tiles `ahead` before them)."""
    if j == 0:
        for i in cutlass.range_constexpr(stages, ahead):
            if i < n_count:
                with cute.arch.elect_one():
                    k_tiles.prefetch(n_first + i)
                    v_tiles.prefetch(n_first + i)
    if j + ahead < n_count:
        with cute.arch.elect_one():
            k_tiles.prefetch(n_first + j + ahead)
            v_tiles.prefetch(n_first + j + ahead)


@cute.jit
def reset_counter(mCount, item, tidx):
    """`lean_tail`: the combining CTA zeroes its item's counter for the next launch, last."""
    if tidx == 0:
        mCount[item] = cutlass.Int32(0)
