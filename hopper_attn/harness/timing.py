"""Timing with CUDA events: warm-up, L2 flushed before every run, median of many runs."""

from __future__ import annotations

import random
import statistics
from typing import Optional

import torch


class L2Flush:
    """Overwrite a buffer twice the size of L2 so the next kernel starts with a cold cache."""

    def __init__(self, device=None):
        props = torch.cuda.get_device_properties(device or torch.cuda.current_device())
        size = max(2 * getattr(props, "L2_cache_size", 50 << 20), 64 << 20)
        self.buffer = torch.empty(size, dtype=torch.int8, device="cuda")

    def __call__(self):
        self.buffer.zero_()


def elapsed_ms(fn) -> float:
    """Milliseconds of one `fn()` between CUDA events, the GPU idle before and after."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def benchmark(fn, flush: L2Flush | None = None, *, target_ms: float = 400.0,
              min_reps: int = 5, max_reps: int = 100, warmup: int = 2) -> dict:
    """Time `fn()` (already compiled). Returns median/min/max milliseconds and repetitions."""
    flush = flush or L2Flush()
    fn()                                   # first call: module load, lazy allocations
    estimate = max(elapsed_ms(fn), 1e-3)
    reps = int(min(max_reps, max(min_reps, target_ms / estimate)))
    if estimate > 100.0:                   # slow kernels (k1 at large N): already warm, 3 runs
        reps, warmup = 3, 0
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for s, e in events:
        flush()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in events]
    return {"ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "reps": reps}


def round_orders(names, rounds: int, seed: int = 0) -> list:
    """The order of `names` in each of `rounds` rounds: shuffled, reproducibly."""
    rng = random.Random(seed)
    orders = []
    for _ in range(rounds):
        order = list(names)
        rng.shuffle(order)
        orders.append(order)
    return orders


def benchmark_interleaved(fns: dict, flush: L2Flush | None = None, *,
                          target_ms: float = 400.0, min_reps: int = 5, max_reps: int = 100,
                          warmup: int = 2) -> dict:
    """Time several callables round-robin: every round runs each once (L2 flushed before
    each), in an order shuffled from round to round (seeded, so reproducible). Clock and
    power drift then hit all of them alike, so their ratios are steadier than those of
    back-to-back series, which on the H100 host drifted by up to 10-20% between a kernel's
    fastest and slowest run at long sequences (results/h100/2026-11-23_kb2_noninterleaved.json).
    Shuffled rather than rotated: a rotation keeps each callable's predecessor the same in
    every round, so whatever one kernel leaves behind (the clock after a hot kernel) always
    falls on the same next one. Returns {name: benchmark()-style dict}."""
    flush = flush or L2Flush()
    names = list(fns)
    estimate = {}
    for name in names:
        fns[name]()
        estimate[name] = max(elapsed_ms(fns[name]), 1e-3)
    per_fn_budget = target_ms / max(estimate.values())
    reps = int(min(max_reps, max(min_reps, per_fn_budget)))
    for _ in range(warmup):
        for name in names:
            fns[name]()
    events = []
    for order in round_orders(names, reps):
        for name in order:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            flush()
            s.record()
            fns[name]()
            e.record()
            events.append((name, s, e))
    torch.cuda.synchronize()
    times = {name: [] for name in names}
    for name, s, e in events:
        times[name].append(s.elapsed_time(e))
    return {name: {"ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t),
                   "reps": reps, "interleaved": True, "round_ms": [round(x, 5) for x in t]}
            for name, t in times.items()}


def round_ratios(baseline: dict, kernel: dict) -> Optional[dict]:
    """A baseline's time over a kernel's, round by round (both from one
    `benchmark_interleaved`): the median and the quartiles of the per-round ratios (> 1: the
    kernel is faster), or None when the two were not timed round-robin."""
    b, k = baseline.get("round_ms"), kernel.get("round_ms")
    if not b or not k or len(b) != len(k):
        return None
    ratios = sorted(x / y for x, y in zip(b, k))
    if len(ratios) < 4:
        return {"ratio": statistics.median(ratios), "q1": ratios[0], "q3": ratios[-1]}
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {"ratio": statistics.median(ratios), "q1": q1, "q3": q3}


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12
