"""k6 over packed batches (variable-length sequences; docs/varlen.md).

What changes from k6 (the `varlen` flag of k5's kernel, common/varlen.py):

* The work list: the query tiles of every sequence, no empty items, found by a warp prefix
  sum over the sequences' tile counts (scheduler.varlen_item) on k6's persistent grid, always
  with the dynamic schedule (sequences differ in length, so items differ in cost with or
  without a mask): the producer warp decodes each item and passes it on. With a causal mask
  or a window a sequence's last query tile (its longest) comes first, and where the POLICY
  row orders the dense problem longest first by head groups (`longest_first`), a sequence's
  heads are taken in such groups too (groups of about that many rows, each sequence's own).
* Lengths per item: each item reads its sequence's offsets and lengths (cu_seqlens_q/k,
  seqused_k) once; k6's masks, tile counts and the tail test take them as they take the
  problem's lengths. A sequence without keys still visits one fully masked tile (zero rows).
* TMA over ragged tensors: Q, K and V load and O stores through the ragged view of
  common/varlen.py, so TMA's bounds check zero-fills loads and drops stores at each
  sequence's end; the LSE ((heads, total_q) fp32) is written row by row below the end.
* Attention sinks (`sinks=True`, `FlashAttentionK6VarlenSinks`; docs/sinks.md): k6's, the
  (heads,) fp32 logits one more kernel argument (last), joined at an item's end; without
  them the kernel has no such parameter.

What stays: everything else of k6, with the POLICY row of the dense problem at max_seqlen_q
(stream-K off: it assumes items of one length; the tail test always on).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32

from hopper_attn.common.contract import LOG2_E, Problem, UnsupportedProblem, work_counter
from hopper_attn.k6 import SPEC, FlashAttentionK6, settings_for


class FlashAttentionK6Varlen(FlashAttentionK6):
    varlen = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.schedule = dataclasses.replace(self.schedule, varlen=True)
        self.scheduler = dataclasses.replace(self.scheduler, varlen=True, dynamic=True,
                                             stream_k=False)


class FlashAttentionK6VarlenSinks(FlashAttentionK6Varlen):
    """k6 varlen with attention sinks: the (heads,) fp32 logits after seqused_k."""

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mCounter: cute.Tensor, scale_log2: Float32, stream,
                 mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
                 mSeqUsedK: Optional[cute.Tensor], mSinks: cute.Tensor):
        self.launch(mQ, mK, mV, mO, mLSE, mCounter, scale_log2, stream, mSinks, mCuSeqlensQ,
                    mCuSeqlensK, mSeqUsedK)

    def describe(self) -> dict:
        return {**super().describe(), "sinks": True}


def problem_for(q: torch.Tensor, k: torch.Tensor, batch: int, max_seqlen_q: int,
                max_seqlen_k: int, causal: bool, window=(None, None)) -> Problem:
    """The dense problem whose POLICY row a packed batch runs with: its longest sequences."""
    return Problem(max(batch, 1), q.shape[1], max(max_seqlen_q, 1), q.shape[2], bool(causal),
                   q.dtype, heads_kv=k.shape[1], seqlen_k=max(max_seqlen_k, 1),
                   window_left=window[0], window_right=window[1])


def settings_for_varlen(problem: Problem, **overrides) -> dict:
    settings = settings_for(problem, **overrides)
    settings.update(stream_k=False, kv_tail=True)
    return settings


_COMPILED: dict = {}


def compile_varlen(problem: Problem, has_seqused_k: bool, compile_options: str = "",
                   sinks: bool = False, **overrides):
    """(compiled function, kernel object) of k6 with `varlen` for `problem`'s head dim, mask,
    dtype and POLICY row (cached); `sinks`: with attention sinks (one more argument, last)."""
    from hopper_attn.common import cute_runtime as rt
    SPEC.check(problem, check_memory=False)
    settings = settings_for_varlen(problem, **overrides)
    key = (problem.head_dim, problem.causal, problem.dtype, has_seqused_k,
           tuple(sorted(settings.items())), compile_options) + (("sinks",) if sinks else ())
    hit = _COMPILED.get(key)
    if hit is not None:
        return hit
    kernel = (FlashAttentionK6VarlenSinks if sinks else FlashAttentionK6Varlen)(
        problem.head_dim, problem.causal, **settings)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    total, heads, d, batch = 256, 2, problem.head_dim, 2
    qkvo = [torch.empty((1, total, heads, d), dtype=problem.dtype, device=device)
            for _ in range(4)]
    lse = torch.empty((1, heads, total), dtype=torch.float32, device=device)
    counter = work_counter(device)
    cu = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    seqused = torch.zeros(batch, dtype=torch.int32, device=device) if has_seqused_k else None
    stream = rt.current_stream() if torch.cuda.is_available() else rt.make_fake_stream()
    args = [rt.to_cute_tensor(t) for t in (*qkvo, lse, counter)]
    tail = [rt.to_cute_tensor(cu), rt.to_cute_tensor(cu),
            rt.to_cute_tensor(seqused) if has_seqused_k else None]
    if sinks:
        tail.append(rt.to_cute_tensor(torch.zeros(heads, dtype=torch.float32, device=device)))
    options = compile_options.strip()
    extra = {"options": options} if options else {}
    compiled = cute.compile(kernel, *args, cutlass.Float32(1.0), stream, *tail, **extra)
    _COMPILED[key] = (compiled, kernel)
    return compiled, kernel


# The last call's CuTe tensors of its inputs, by their pointers, shapes and strides (about
# 10 us saved per tensor); the outputs are converted every call. Only one call's: a CuTe
# tensor keeps its torch tensor's memory.
_BOUND: dict = {}
_BOUND_SINKS: dict = {}        # (the sinks' own: a bf16 parameter arrives as a new fp32 copy)


def run_varlen(compiled, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
               softmax_scale: float, sinks: Optional[torch.Tensor] = None) -> None:
    """Launch on the current stream: q, k, v, out (total, H, d), lse (H, total_q) fp32,
    sinks (H,) fp32 for (and only for) a kernel compiled with them. Nothing here reads the
    device tensors' contents (CUDA-graph capturable)."""
    from hopper_attn.common import cute_runtime as rt
    if q.shape[0] == 0:
        return
    inputs = (q, k, v, work_counter(q.device), cu_seqlens_q, cu_seqlens_k) + \
        (() if seqused_k is None else (seqused_k,))
    key = tuple((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in inputs)
    bound = _BOUND.get(key)
    if bound is None:
        bound = [rt.to_cute_tensor(t.unsqueeze(0)) for t in inputs[:3]]
        bound += [rt.to_cute_tensor(t) for t in inputs[3:]]
        if seqused_k is None:
            bound.append(None)
        _BOUND.clear()
        _BOUND[key] = bound
    extra = ()                         # (a kernel without sinks has no such parameter)
    if sinks is not None:
        sinks_key = (sinks.data_ptr(), sinks.shape)
        if sinks_key not in _BOUND_SINKS:
            _BOUND_SINKS.clear()
            _BOUND_SINKS[sinks_key] = rt.to_cute_tensor(sinks)
        extra = (_BOUND_SINKS[sinks_key],)
    outputs = [rt.to_cute_tensor(t.unsqueeze(0)) for t in (out, lse)]
    compiled(*bound[:3], *outputs, bound[3], cutlass.Float32(softmax_scale * LOG2_E),
             rt.current_stream(), *bound[4:], *extra)


__all__ = ["FlashAttentionK6Varlen", "FlashAttentionK6VarlenSinks", "compile_varlen",
           "run_varlen", "problem_for", "UnsupportedProblem"]
