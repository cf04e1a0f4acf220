"""In-kernel phase ranges for timelines, with CuTe DSL's event tracer (iket), off by default.

A kernel built with ``trace=True`` brackets each phase of its main loop (wait for K, QK^T,
softmax, PV, release, ...) in ``cute.experimental.iket`` ranges:

    phase = self.trace.start("softmax")
    ...                                   # the phase's code
    self.trace.end(phase)

With ``trace=False`` (the default) ``start``/``end`` emit nothing at all: the switch is read
while the kernel is traced into MLIR, so the compiled code is the same as without this module.
With ``trace=True`` the ranges are in the kernel's IR, and CuTe DSL keeps them only when its
JIT is told to (``CUTE_DSL_COMPILER_OPT`` containing ``iket``, which the ``iket profile``
command line sets); the profiler then patches them into timestamp writes per warp and writes a
Perfetto trace. ``python -m hopper_attn.harness.timeline`` runs that and draws one lane per
warpgroup (docs/profiling.md).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)   # frozen: a compile-time constant inside dynamic loops
class PhaseTrace:
    enabled: bool = False

    def start(self, name: str):
        """Open range `name`; returns the token for `end` (None when tracing is off)."""
        if not self.enabled:
            return None
        from cutlass.cute.experimental import iket
        return iket.range_start(name)

    def end(self, token) -> None:
        if self.enabled:
            from cutlass.cute.experimental import iket
            iket.range_end(token)
