"""FlashAttention-4's own forward + backward test grid, run through `hopper_attn.attention()`
(issue 63: "every one runs through attention(), none refused, and passes").

    python tools/fa_grid_gpu_check.py --list                 # case counts per head dim (CPU)
    python tools/fa_grid_gpu_check.py --inspect [--quick]    # host-side checks, kernels (CPU)
    python tools/fa_grid_gpu_check.py --plan [--budget 360]  # kernels, time, device calls (CPU)
    source .gpu/prelude.sh && python tools/fa_grid_gpu_check.py [--quick] [--dims 64,128]
        [--start N] [--stop N] [--max-cases M] [--jobs 8] [--deadline S] [--verbose] [--out DIR]
    python tools/fa_grid_gpu_check.py --dry-run [...]       # the plumbing, on the CPU

The whole grid on one H200 (`--plan`'s two device calls, each estimated <= 360 s):

    python tools/fa_grid_gpu_check.py --start 0 --stop 6240 --jobs 8 --deadline 480
    python tools/fa_grid_gpu_check.py --start 6240 --stop 18720 --jobs 8 --deadline 480

The grid: the parametrize lists of `tests/cute/test_flash_attn.py::test_flash_attn_output`
in Dao-AILab/flash-attention (read 2026-11-29, file version 008e636), written here as data:
dtype bf16; mha_type mha / mqa / gqa (6 query heads; 6 / 1 / 3 k/v heads); head dim d 64, 96,
128, 192, 256 with v's head dim dv = d, except (192, 128) and at d = 128 both 64 and 128 (two
calls per test case there, as the test loops over them); causal; local_enum 0-3 (no window;
a window (w0, w1); (None, -w1); (-w0, None), with w0, w1 = `random.randrange(0, seqlen_k)`
after `random.seed(0)`: reproduced here exactly, two draws per call); softcap 0 and 15 (q
scaled by cap / 4 first, as the test does); deterministic; learnable sinks (bf16, one per
query head); 26 (seqlen_q, seqlen_k) pairs from (1, 1) to (4224, 4224); batch 9, or 2 where
seqlen_k > 2048. The test skips local with causal; so does this grid: 26 pairs x 3 mha types
x 5 (causal, or one of the 4 local values) x 2 x 2 x 2 = 3,120 calls per head dim (6,240 at
d = 128), 18,720 in all, 9,408 of them with the backward.

What FA's test runs, this runs: the forward on every call; the backward (autograd: dQ, dK,
dV and the sinks' gradient) where the test does, i.e. dv = d <= 128 or (d, dv) = (192, 128),
and not (causal or a window) with seqlen_k < seqlen_q (on sm90 the test marks the GQA / MQA
backward at (192, 128) xfail, an FA4 gap: run here all the same). q, k, v (and the sinks) require
gradients exactly on those calls; a forward-only call gets inputs without gradients (FA's
test gives every call grad-requiring inputs, but its forward never asks whether a backward
exists; `attention()` does, so `--inspect` also lists what it would refuse there).

Left out, because `attention()` has no such concept: `has_qv` (the grid has only False),
`pack_gqa` (the test runs its forward with False, True and None: ours picks its own GQA
packing, one call), `num_splits` > 1 (skipped on sm90 by the test itself),
`attention_chunk` (only 0 in the grid), fp8 and descales (not in the grid). FA's windows
pass as they are: `attention()`'s `window_size` takes FA4's spelling (a side None is
unbounded, the other literal, negative included: local_enum 2 and 3's shifted diagonals,
e.g. (None, -5) sees keys up to 5 before the diagonal); local_enum 1's (w0, w1) are ints
>= 0, literal in either spelling.

Checks (FlashAttention's rule, as its test applies it): the reference is the same math in
fp32 from the bf16 inputs (harness/window_reference.reference: window, softcap, sinks; rows
that see no key 0), torch's error is that of the same math in bf16 (the test's
`upcast=False, reorder_ops=True` path: bf16 scores of q and k x scale, the cap in bf16,
softmax in bf16, with sinks in fp32 as the test's reference does, bf16 P V; autograd for its
gradients). out, dQ, dK, dV pass when max |ours - ref| <= rtol x max |torch - ref| + atol,
rtol 2 (3 with softcap), atol 2 x the fp32 reference's own rounding (max |(ref + 0.3 - 0.3)
- ref|), + 3e-4 for gradients with softcap, and a gradient's bound at least 2^-16 x the
largest reference gradient of the call (a reference of exact zeros, one key a row, has no
rounding to set atol: FA's own 1 x 1 case passes on its reference's fp32 noise); the sinks' gradient elementwise within rtol x
torch's max error + 2 bf16 ulps of the reference (+ 3e-4 with softcap). NaN fails. `ratio`:
the worst error / bound of a call. This is stricter than FA's test as written, whose
reference (`attention_ref`, upcast) returns its output in bf16, so that its gradients (of
bf16 leaves) are bf16 too and its atol, taken from them in bf16, is about 2^-8 to 2^-7 of
the largest; kept strict here, with KNOWN below for the one understood excess.

Verdict per call: PASS, FAIL (a check failed, or an exception after the forward launched),
KNOWN (only dq / dk / dsinks failed, and each passes the same bound measured against the
fp32 math with D = rowsum(dO * O) taken from the bf16 output and dS rounded to bf16, as
every FlashAttention backward, FA4's included, takes them: `d_from_output_grads`; one
dominant key per row, e.g. one key and a sink, where dS = P (dP - D) cancels and O's
rounding dominates; torch's
reference with sinks runs its softmax in fp32, so has no such term: docs/sinks.md; counted
apart, not a FAIL for the exit status) or REFUSED (ValueError from `attention()` before any
launch, with its message). Prints the FAIL / KNOWN / REFUSED lines (the first 30 of each),
progress every 500 calls, one summary line per head dim and a total; JSON with every call,
the environment and the grid to $OUT/fa_grid.json (or --out), rewritten every 500 calls.
An illegal-address fault poisons the process: rerun with `--start <index>` (the global call
index the progress and failure lines print; the JSON's `resume_from`); `--deadline S` starts
no call after S seconds, so that a run cut short by a time limit still writes its JSON.

Compiles: one per kernel configuration (stage, head dims, mask, window size, cap, sinks,
POLICY row), and the backward's pre- / post-processing kernels (a few per head dim); FA's
windows are drawn per key length and each window size is its own compile in `attention()`
(FA4 passes them at run time). `--inspect` counts them on the CPU (no compile, no launch) and
says which calls `attention()` refuses (none): 2,027 kernels (1,008 forward, 992 backward,
27 pre- / post-processing). `--jobs N` runs N worker processes on the one GPU (each compiles
its own kernels, so the compiles run in parallel on the host's cores), over shards that share
no kernel configuration (`plan_jobs`: groups of calls, none sharing one, dealt by estimated
work). `--plan` (CPU, a few seconds) prints per head dim the calls, kernels and estimated
seconds with `--jobs 8` (COMPILE_S etc. below, from the first H200 pass: ~1.6 s a kernel per
worker), the whole grid's (~540 s: more than one device call) and one command per device
call, index ranges `--start` / `--stop` estimated within `--budget` seconds each, run with
`--deadline 480` (a run that overruns stops starting calls and writes its JSON; rerun its
range from its `resume_from`). `--quick` (QUICK_CALLS: 20 calls, 37 kernels, every feature
axis: each head dim and dv, causal, the three window kinds with negative sides, softcap,
deterministic and sinks with the backward, MHA / MQA / GQA with and without it, forward-only
calls, (1, 1), (1023, 1024) and (4224, 4224)) runs on min(8, cores / 2) workers by default:
~25 s estimated, < 2 min. Runs print the kernel count first; each record's "s" is its call's
seconds with its compiles. `--dry-run`: no GPU; attention()'s host checks, then the checks
against `stand_in_attention` (the fp32 math rounded to bf16) on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import random
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ---- the grid: test_flash_attn_output's parametrize lists (facts, written as data) --------
HEAD_DIMS = (64, 96, 128, 192, 256)
SEQLEN_PAIRS = ((1, 1), (3, 3), (64, 32), (64, 128), (64, 1), (128, 128), (128, 192),
                (256, 256), (255, 256), (239, 1), (799, 3), (113, 203), (113, 128),
                (128, 217), (113, 211), (108, 256), (256, 512), (384, 256), (640, 128),
                (512, 256), (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048),
                (4096, 4096), (4224, 4224))
MHA_TYPES = ("mha", "mqa", "gqa")
KV_HEADS = {"mha": 6, "mqa": 1, "gqa": 3}
HEADS = 6
CAUSAL = (False, True)
LOCAL_ENUM = (0, 1, 2, 3)
SOFTCAPS = (0.0, 15.0)
DETERMINISTIC = (False, True)
SINKS = (False, True)
DTYPES = ("bf16",)


def dv_values(d: int) -> tuple:
    """v's head dims the test loops over for q's d (in its order)."""
    return (128,) if d == 192 else (64, 128) if d == 128 else (d,)


def batch_for(seqlen_k: int) -> int:
    return 9 if seqlen_k <= 2048 else 2


SKIPPED = {
    "has_qv": "no qv input in attention() (the grid has only has_qv=False)",
    "pack_gqa": "the test's forward runs pack_gqa False / True / None; attention() packs GQA "
                "itself: one call",
    "num_splits": "> 1 is skipped on sm90 by the test itself; attention() splits only in decode",
    "attention_chunk": "only 0 in the grid; no chunked attention in attention()",
    "fp8 / descales": "not in the grid (dtype bf16 only)",
}


def _fa_windows(seqlen_k: int, calls: int) -> list:
    """The (w0, w1) draws of the test for its `calls` dv iterations: random.seed(0) at the
    test's start, then two randrange(0, seqlen_k) per iteration (only where local)."""
    rng = random.Random(0)
    return [(rng.randrange(0, seqlen_k), rng.randrange(0, seqlen_k)) for _ in range(calls)]


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention() call of the grid (a test case at one dv)."""
    index: int
    d: int
    dv: int
    seqlen_q: int
    seqlen_k: int
    mha_type: str
    causal: bool
    local_enum: int
    softcap: float
    deterministic: bool
    sinks: bool
    dtype: str
    fa_window: tuple            # FA's window_size: (None, None), or ints / None

    @property
    def batch(self) -> int:
        return batch_for(self.seqlen_k)

    @property
    def heads_kv(self) -> int:
        return KV_HEADS[self.mha_type]

    @property
    def local(self) -> bool:
        return self.local_enum > 0

    @property
    def backward(self) -> bool:
        """Whether FA's test runs the backward on this call (on sm90, bf16)."""
        pair = (self.dv == self.d and self.d <= 128) or (self.d, self.dv) == (192, 128)
        return pair and not ((self.causal or self.local) and self.seqlen_k < self.seqlen_q)

    def window_size(self) -> tuple:
        """attention()'s window_size: FA's as it is (FA4's spelling: None unbounded, the
        other side literal, negative included; (w0, w1) >= 0 literal in either spelling)."""
        return tuple(self.fa_window)

    def label(self) -> str:
        w = "" if not self.local else f" win{self.fa_window}".replace(" ", "").replace(
            "None", "N")
        return (f"#{self.index} d{self.d}/{self.dv} {self.seqlen_q}x{self.seqlen_k} "
                f"{self.mha_type}{' causal' if self.causal else ''}{w}"
                f"{' cap15' if self.softcap else ''}{' det' if self.deterministic else ''}"
                f"{' sinks' if self.sinks else ''}{' +bwd' if self.backward else ''}")


def enumerate_grid() -> list[Case]:
    """Every call of the grid, head dim by head dim (the global index is stable)."""
    cases = []
    for d in HEAD_DIMS:
        dvs = dv_values(d)
        for (nq, nk), mha, causal, local_enum, cap, det, sinks, dtype in itertools.product(
                SEQLEN_PAIRS, MHA_TYPES, CAUSAL, LOCAL_ENUM, SOFTCAPS, DETERMINISTIC, SINKS,
                DTYPES):
            if local_enum and causal:          # the test skips local with causal
                continue
            for dv, (w0, w1) in zip(dvs, _fa_windows(nk, len(dvs))):
                window = {0: (None, None), 1: (w0, w1), 2: (None, -w1),
                          3: (-w0, None)}[local_enum]
                cases.append(Case(len(cases), d, dv, nq, nk, mha, causal, local_enum, cap,
                                  det, sinks, dtype, window))
    return cases


# `--quick`: 20 calls, 37 kernels (forward, backward and the backward's pre- / post-
# processing), each feature axis at least once: (d, dv, (seqlen_q, seqlen_k), mha type, causal,
# local_enum, softcap, deterministic, sinks). Two backward calls per head dim with a backward at
# (113, 203), their masks, caps and GQA kinds rotated; the forward-only (128, 64) and 256;
# then calls that reuse those kernels at other lengths (the one-key (1, 1), odd and long pairs,
# causal with fewer keys than queries: forward only).
_P = (113, 203)
QUICK_CALLS = (
    (64, 64, _P, "mha", True, 0, 0.0, True, True),
    (64, 64, _P, "gqa", False, 1, 15.0, False, False),
    (96, 96, _P, "mqa", False, 2, 0.0, True, True),
    (96, 96, _P, "gqa", False, 0, 0.0, False, False),
    (128, 128, _P, "gqa", False, 3, 15.0, False, True),
    (128, 128, _P, "mha", True, 0, 0.0, True, False),
    (192, 128, _P, "mqa", False, 1, 0.0, True, True),
    (192, 128, _P, "gqa", False, 2, 15.0, False, False),
    (128, 64, _P, "mha", False, 0, 0.0, False, False),
    (256, 256, _P, "mqa", True, 0, 15.0, False, True),
    (256, 256, _P, "gqa", False, 1, 0.0, True, False),
    (64, 64, (1, 1), "mha", True, 0, 0.0, True, True),          # decode's forward, one key
    (128, 128, (4224, 4224), "mha", True, 0, 0.0, True, False),
    (96, 96, (4224, 4224), "gqa", False, 0, 0.0, False, False),
    (96, 96, (1023, 1024), "gqa", False, 0, 0.0, False, False),
    (96, 96, (1, 1), "mqa", False, 0, 0.0, False, False),
    (128, 64, (1, 1), "gqa", False, 0, 0.0, False, False),
    (64, 64, (239, 1), "gqa", True, 0, 0.0, True, True),
    (128, 128, (799, 3), "mqa", True, 0, 0.0, True, False),
    (256, 256, (64, 1), "gqa", True, 0, 15.0, True, True),
)
_QUICK_FIELDS = ("d", "dv", "pair", "mha_type", "causal", "local_enum", "softcap",
                 "deterministic", "sinks")


def quick_cases(cases: list[Case]) -> list[Case]:
    """The grid's calls that QUICK_CALLS names (one each), in its order."""
    chosen = []
    for row in QUICK_CALLS:
        want = dict(zip(_QUICK_FIELDS, row))
        pair = want.pop("pair")
        found = [c for c in cases if (c.seqlen_q, c.seqlen_k) == pair
                 and all(getattr(c, k) == v for k, v in want.items())]
        assert len(found) == 1, (row, len(found))
        chosen += found
    return chosen


def select(cases, quick=False, dims=None, start=0, max_cases=None, stop=None) -> list[Case]:
    chosen = quick_cases(cases) if quick else cases
    chosen = [c for c in chosen if (not dims or c.d in dims) and c.index >= start
              and (stop is None or c.index < stop)]
    return chosen[:max_cases] if max_cases else chosen


# ---- host-side inspection (CPU: meta tensors, no compile, no launch) -----------------------
class _Recorded(Exception):
    """Raised in place of a compile: carries the configuration key it would compile."""


def _recording_compiles():
    """Patch the stages' compile entry points to raise _Recorded(key) instead of compiling
    (the key as compile_attention / compile_backward cache it)."""
    import importlib

    from hopper_attn.common.backward import helper_keys

    def forward(spec, factory, problem, options=None, **_):
        spec.check(problem)
        opts = dict(options or {}, head_dim_v=problem.dv)
        raise _Recorded(("fwd", spec.name, factory.__name__, problem.head_dim, problem.causal,
                         str(problem.dtype), tuple(sorted(opts.items()))))

    made: dict = {}                    # backward key -> its pre- / post-processing keys

    def backward(spec, factory, problem, options=None, **_):
        spec.check(problem)
        opts = dict(options or {}, head_dim_v=problem.dv)
        key = ("bwd", spec.name, factory.__name__, problem.head_dim, problem.causal,
               str(problem.dtype), tuple(sorted(opts.items())))
        if key not in made:            # (the kernel object only: its helpers' keys)
            d, dv = problem.head_dim, problem.dv
            kernel = factory(d, problem.causal, **dict(options or {}, **(
                {"head_dim_v": dv} if dv != d else {})))
            made[key] = helper_keys(kernel, d, dv, str(problem.dtype), False)
        raise _Recorded(key, made[key])

    saved = []
    for name, attr, fn in (("k6", "compile_attention", forward),
                           ("decode", "compile_attention", forward),
                           ("k5", "compile_attention", forward),
                           ("k4", "compile_attention", forward),
                           ("kb2", "compile_backward", backward),
                           ("kb1", "compile_backward", backward)):
        module = importlib.import_module(f"hopper_attn.{name}")
        saved.append((module, attr, getattr(module, attr)))
        setattr(module, attr, fn)

    def restore():
        for module, attr, fn in saved:
            setattr(module, attr, fn)
    return restore


def _compile_key(entry, problem):
    """(the configuration's key, the keys of the helper kernels it launches too)"""
    try:
        entry.compile(problem)
    except _Recorded as recorded:
        return recorded.args[0], (recorded.args[1] if len(recorded.args) > 1 else ())
    return None, ()


def host_check(case: Case, grad: Optional[bool] = None, keys: bool = False) -> dict:
    """What `attention()` decides on the host for `case` (meta tensors): {"status": "OK" or
    "REFUSED", "message", "forward": stage, "backward": stage, and with `keys` the compile
    configurations "fwd_key" / "bwd_key"}. `grad` (default: the case's backward) as q, k, v
    requiring gradients. The checks are attention()'s own, in its order (window, sinks,
    whether a backward exists, the forward stage); the tensor layout / device checks need a
    GPU and are left to the run."""
    import torch

    from hopper_attn import api
    from hopper_attn.common.contract import Problem, normalize_window
    from hopper_attn.common.sinks import as_kernel_sinks

    grad = case.backward if grad is None else grad
    meta = dict(device="meta", dtype=torch.bfloat16)
    q = torch.empty(case.batch, case.seqlen_q, HEADS, case.d, **meta)
    k = torch.empty(case.batch, case.seqlen_k, case.heads_kv, case.d, **meta)
    v = torch.empty(case.batch, case.seqlen_k, case.heads_kv, case.dv, **meta)
    row = {"status": "OK", "message": "", "forward": None, "backward": None}
    try:
        window = normalize_window(case.window_size(), case.causal)
        if case.sinks:
            as_kernel_sinks(torch.empty(HEADS, **meta), HEADS, q.device)
        if grad:
            api._check_differentiable(q, k, v, case.causal, None, case.deterministic,
                                      api._check_softcap(case.softcap), window)
        api._check(q, k, v)
        problem = Problem.from_tensor(q, case.causal, k, window, v)
        entry = api._entry_for(problem, "", case.softcap, case.sinks)
        row["forward"] = entry.name
        bwd = api._backward_entry(problem, case.deterministic, case.softcap) if grad else None
        row["backward"] = bwd.name if bwd else None
    except ValueError as exc:
        return {**row, "status": "REFUSED", "message": str(exc)}
    if keys:
        row["fwd_key"] = _compile_key(entry, problem)[0]
        if bwd is not None:
            row["bwd_key"], row["helper_keys"] = _compile_key(bwd, problem)
    return row


def kernel_keys(row: dict) -> set:
    """Every kernel a host_check(keys=True) row compiles: forward, backward, the backward's
    pre- / post-processing (cached apart: shared by the backward configurations)."""
    return {k for k in (row.get("fwd_key"), row.get("bwd_key"), *row.get("helper_keys", ()))
            if k is not None}


def inspect(cases: list[Case], print_limit: int = 40) -> dict:
    """host_check over `cases`: refusals by reason, forward-only calls that would be refused
    with gradients, and the distinct compile configurations (per head dim, fwd / bwd)."""
    restore = _recording_compiles()
    try:
        rows = [(c, host_check(c, keys=True)) for c in cases]
        grad_refused = [(c, host_check(c, grad=True)) for c, r in rows
                        if not c.backward and r["status"] == "OK"]
    finally:
        restore()
    reasons: dict = {}
    for c, r in rows:
        if r["status"] == "REFUSED":
            reasons.setdefault(_reason(r["message"]), []).append(c.index)
    with_grad: dict = {}
    for c, r in grad_refused:
        if r["status"] == "REFUSED":
            with_grad.setdefault(_reason(r["message"]), []).append(c.index)
    keys = {"fwd": set(), "bwd": set(), "helpers": set()}
    per_dim: dict = {}
    for c, r in rows:
        mine = per_dim.setdefault(c.d, {"fwd": set(), "bwd": set(), "helpers": set()})
        for kind, found in (("fwd", [r.get("fwd_key")]), ("bwd", [r.get("bwd_key")]),
                            ("helpers", r.get("helper_keys", ()))):
            found = [k for k in found if k is not None]
            keys[kind].update(found)
            mine[kind].update(found)
    return {"calls": len(rows), "refused": sum(len(v) for v in reasons.values()),
            "refused_by_reason": {k: {"count": len(v), "first": v[:print_limit]}
                                  for k, v in sorted(reasons.items(), key=lambda kv: -len(kv[1]))},
            "forward_only_refused_with_grad": {k: {"count": len(v), "first": v[:print_limit]}
                                               for k, v in with_grad.items()},
            "compiles": {k: len(v) for k, v in keys.items()},
            "kernels": sum(len(v) for v in keys.values()),
            "compiles_per_head_dim": {d: {k: len(s) for k, s in v.items()}
                                      for d, v in sorted(per_dim.items())},
            "stages": sorted({(r["forward"], r["backward"]) for _, r in rows
                              if r["status"] == "OK"}, key=str)}


def _reason(message: str) -> str:
    """A refusal's message without its numbers' specifics (for grouping)."""
    import re
    if "window_size: right must be" in message or "window_size: left must be" in message:
        return re.sub(r"got -?\d+", "got <negative>", message)
    return message


# ---- the GPU run -------------------------------------------------------------------------
def _seen(nq, nk, left, right, device):
    from hopper_attn.harness.window_reference import window_mask
    return window_mask(nq, nk, left, right, device)


def torch_bf16(q, k, v, left, right, scale, softcap, sinks):
    """The same math in bf16 as FA's test's `upcast=False, reorder_ops=True` reference: bf16
    scores of q and k x scale, the cap in bf16, a bf16 softmax (with sinks: fp32 with the
    sink column, then bf16), bf16 P V; rows that see no key 0. Differentiable."""
    import torch
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    s = torch.einsum("bthd,bshd->bhts", q, k * scale)
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    seen = _seen(q.shape[1], k.shape[1], left, right, q.device)
    blind = ~seen.any(-1)[:, None]                     # rows with no key: no NaN anywhere
    s = s.masked_fill(~seen, float("-inf")).masked_fill(blind, 0.0)
    if sinks is None:
        p = torch.softmax(s, -1)
    else:
        s32, sink = s.float(), sinks.float()[None, :, None, None]
        m = torch.maximum(s32.amax(-1, keepdim=True), sink)
        e = torch.exp(s32 - m)
        p = (e / (e.sum(-1, keepdim=True) + torch.exp(sink - m))).to(q.dtype)
    p = p.masked_fill(blind, 0.0)
    return torch.einsum("bhts,bshd->bthd", p, v)


def _fp32_noise(ref) -> float:
    """max |(ref + 0.3 - 0.3) - ref|: the fp32 reference's own rounding (FA's atol)."""
    return (ref + 0.3 - 0.3 - ref).abs().max().item()


def _judge(ours, ref, low, rtol, extra_atol=0.0, floor=0.0, against=None) -> dict:
    """FA's rule; `against`: the error measured from it instead of `ref` (the bound still
    from ref and torch's error: `explained_by_d`)."""
    against = ref if against is None else against
    err = (ours.float() - against).abs().max().item() if ours.numel() else 0.0
    torch_err = (low.float() - ref).abs().max().item() if ours.numel() else 0.0
    bound = max(rtol * torch_err + 2 * _fp32_noise(ref) + extra_atol, floor) \
        if ours.numel() else 0.0
    nan = bool(ours.isnan().any())
    ratio = float("inf") if nan else (err / bound if bound > 0 else (0.0 if err == 0 else
                                                                     float("inf")))
    return {"error": err, "torch_error": torch_err, "bound": bound, "ratio": ratio,
            "ok": not nan and err <= bound}


def _judge_dsink(ours, ref, low, rtol, atol, against=None) -> dict:
    import torch
    ref_lp = ref.to(ours.dtype).abs()
    ulp = (torch.nextafter(ref_lp, torch.full_like(ref_lp, float("inf"))) - ref_lp).float()
    torch_err = (low.float() - ref).abs().max().item()
    diff = (ours.float() - (ref if against is None else against)).abs()
    tol = rtol * torch_err + 2 * ulp + atol
    nan = bool(ours.isnan().any())
    return {"error": diff.max().item(), "torch_error": torch_err,
            "ratio": float("inf") if nan else (diff / tol.clamp_min(1e-30)).max().item(),
            "ok": not nan and bool((diff <= tol).all())}


def run_case(case: Case, attention=None, dev: str = "cuda") -> dict:
    """One call on the GPU: {"status", "ratio", per tensor verdicts, "message"}.
    `attention`: hopper_attn.attention (another, and `dev`, for the CPU test of the checks)."""
    import torch

    import hopper_attn
    from hopper_attn.harness.window_reference import reference

    attention = attention or hopper_attn.attention
    torch.manual_seed(case.index)
    bf16 = torch.bfloat16
    q = torch.randn(case.batch, case.seqlen_q, HEADS, case.d, device=dev)
    if case.softcap:
        q = q * case.softcap / 4                       # (the test's: scores within the cap)
    q = q.to(bf16)
    k = torch.randn(case.batch, case.seqlen_k, case.heads_kv, case.d, device=dev).to(bf16)
    v = torch.randn(case.batch, case.seqlen_k, case.heads_kv, case.dv, device=dev).to(bf16)
    sinks = torch.randn(HEADS, device=dev).to(bf16) if case.sinks else None
    grad = case.backward
    window = case.window_size()
    mine = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    my_sinks = sinks.clone().requires_grad_(grad) if sinks is not None else None
    try:
        out = attention(*mine, causal=case.causal, window_size=window,
                                    softcap=case.softcap, sinks=my_sinks,
                                    deterministic=case.deterministic)
    except ValueError as exc:
        return {"status": "REFUSED", "message": str(exc), "where": "forward"}
    from hopper_attn.common.contract import normalize_window
    left, right = normalize_window(window, case.causal)
    right = 0 if case.causal else right
    scale = case.d ** -0.5
    rtol = 3 if case.softcap else 2
    leaves = [t.detach().float().requires_grad_(grad) for t in (q, k, v)]
    ref_sinks = sinks.detach().float().requires_grad_(grad) if sinks is not None else None
    ref, _ = reference(*leaves, left, right, scale, case.softcap, ref_sinks)
    lows = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
    low_sinks = sinks.detach().clone().requires_grad_(grad) if sinks is not None else None
    low = torch_bf16(*lows, left, right, scale, case.softcap, low_sinks)
    row = {"out": _judge(out.detach(), ref.detach(), low.detach(), rtol)}
    if grad:
        g = torch.randn_like(out)
        inputs = mine + ([my_sinks] if sinks is not None else [])
        try:
            grads = torch.autograd.grad(out, inputs, g)
        except ValueError as exc:      # attention() refuses before the forward, not here
            return {"status": "FAIL", "message": f"backward raised ValueError after the "
                    f"forward ran: {exc}", "where": "backward", **row}
        refs = torch.autograd.grad(ref, leaves + ([ref_sinks] if sinks is not None else []),
                                   g.float())
        lowg = torch.autograd.grad(low, lows + ([low_sinks] if sinks is not None else []), g)
        atol = 3e-4 if case.softcap else 0.0
        # A gradient whose fp32 reference is exactly 0 (one key a row: dS = P (dP - D) = 0)
        # has no fp32 noise to set FA's atol; 2^-16 of the largest gradient (128x below bf16's
        # resolution there) stands in for it.
        floor = 2 ** -16 * max(r.abs().max().item() for r in refs[:3] if r.numel())
        for name, ours, r, lo in zip(("dq", "dk", "dv"), grads, refs, lowg):
            row[name] = _judge(ours, r, lo, rtol, atol, floor)
        if sinks is not None:
            row["dsinks"] = _judge_dsink(grads[3], refs[3], lowg[3], rtol, atol)
            row["dsinks"]["dtype_ok"] = grads[3].dtype == sinks.dtype
            row["dsinks"]["ok"] &= row["dsinks"]["dtype_ok"]
    checks = {k: v for k, v in row.items() if isinstance(v, dict)}
    ok = all(v["ok"] for v in checks.values())
    worst = max(checks, key=lambda n: checks[n]["ratio"])
    status = "PASS" if ok else "FAIL"
    if not ok and grad and explained_by_d(row, grads, refs, lowg, (q, k, v), g, out.detach(),
                                          sinks, (left, right, scale, case.softcap), rtol,
                                          atol, floor):
        status = "KNOWN"
        row["message"] = KNOWN_D
    return {"status": status, "ratio": checks[worst]["ratio"], "worst": worst, **row}


KNOWN_D = ("dq, dk, dsinks: over the rule against the fp32 reference, within it against the "
           "same math with D = rowsum(dO * O) from the bf16 output and dS in bf16, as every "
           "FlashAttention backward takes them (one dominant key per row: D's cancellation, "
           "docs/sinks.md)")


def d_from_output_grads(q, k, v, g, out, sinks, left, right, scale, softcap=0.0):
    """dq, dk (, dsinks) of the fp32 math with two changes that every FlashAttention backward
    (FA2-FA4, ours) makes: D = rowsum(dO * O) from the bf16 `out`, not from the fp32
    softmax, and dS rounded to bf16 (the operand of the dQ and dK GEMMs). Where P ~ 1,
    dS = P (dP - D) cancels and O's bf16 rounding (not scaled by 1 - P) dominates; torch's
    fp32-softmax reference (the sinks' path) has neither term. Over a GQA group dK sums in
    fp32 (FA4's dk_accum; kb2's bf16 partials of a split group are not emulated)."""
    import torch
    from hopper_attn.harness.window_reference import window_mask
    group = q.shape[2] // k.shape[2]
    qf, gf, kf, vf = q.float(), g.float(), *(t.float().repeat_interleave(group, dim=2)
                                              for t in (k, v))
    raw = torch.einsum("bihd,bjhd->bhij", qf, kf) * scale
    s = softcap * torch.tanh(raw / softcap) if softcap else raw
    seen = window_mask(q.shape[1], k.shape[1], left, right, q.device)
    s = s.masked_fill(~seen, float("-inf"))
    cols = s if sinks is None else torch.cat(
        [s, sinks.float()[None, :, None, None].expand(*s.shape[:3], 1)], -1)
    lse = torch.logsumexp(cols, -1, keepdim=True)
    p = torch.exp(s - lse).nan_to_num(0.0)                 # a row without keys: 0
    d_rows = (gf * out.float()).sum(-1).transpose(1, 2)[..., None]
    ds = p * (torch.einsum("bihd,bjhd->bhij", gf, vf) - d_rows)
    if softcap:
        ds = ds * (1 - torch.tanh(raw / softcap) ** 2)
    ds = ds.to(q.dtype).float()
    dq = torch.einsum("bhij,bjhd->bihd", ds, kf) * scale
    dk = (torch.einsum("bhij,bihd->bjhd", ds, qf) * scale).unflatten(
        2, (k.shape[2], group)).sum(3)
    if sinks is None:
        return dq, dk
    p_sink = torch.exp(sinks.float()[None, :, None] - lse[..., 0]).nan_to_num(0.0)
    return dq, dk, -(p_sink * d_rows[..., 0]).sum((0, 2))


def explained_by_d(row, grads, refs, lowg, qkv, g, out, sinks, mask, rtol, atol,
                   floor) -> bool:
    """Whether a failing call's failures are all dq / dk / dsinks ones that pass the same
    bound (from the fp32 reference and torch's error) with the error measured against
    `d_from_output_grads` instead (adds "d_from_output" to those checks)."""
    failing = [n for n, v in row.items() if isinstance(v, dict) and not v["ok"]]
    if not failing or not set(failing) <= {"dq", "dk", "dsinks"}:
        return False
    left, right, scale, softcap = mask
    alt = d_from_output_grads(*(t.detach() for t in qkv), g, out, sinks, left, right,
                              scale, softcap)
    for name in failing:
        i = ("dq", "dk", "dsinks").index(name)
        if name == "dsinks":
            again = _judge_dsink(grads[3], refs[3], lowg[3], rtol, atol, against=alt[2])
            again["ok"] &= row["dsinks"]["dtype_ok"]
        else:
            again = _judge(grads[i], refs[i], lowg[i], rtol, atol, floor, against=alt[i])
        row[name]["d_from_output"] = {"error": again["error"], "ok": again["ok"]}
    return all(row[n]["d_from_output"]["ok"] for n in failing)


def stand_in_attention(q, k, v, *, causal, window_size, softcap, sinks, deterministic):
    """The fp32 reference rounded to bf16 (differentiable): what `--dry-run` checks in place
    of attention(), on the CPU; FA's rule must pass it."""
    from hopper_attn.common.contract import normalize_window
    from hopper_attn.harness.window_reference import reference
    left, right = normalize_window(window_size, causal)
    out, _ = reference(q.float(), k.float(), v.float(), left, 0 if causal else right,
                       q.shape[-1] ** -0.5, softcap, None if sinks is None else sinks.float())
    return out.to(q.dtype)


def dry_run_case(case: Case) -> dict:
    """`--dry-run`'s call: attention()'s host checks (REFUSED as it would refuse), then
    run_case on the CPU with stand_in_attention."""
    row = host_check(case)
    if row["status"] == "REFUSED":
        return {"status": "REFUSED", "message": row["message"], "where": "host_check"}
    return run_case(case, attention=stand_in_attention, dev="cpu")


def _summary(records, cases_by_index) -> dict:
    per_dim: dict = {}
    for r in records:
        c = cases_by_index[r["index"]]
        row = per_dim.setdefault(c.d, {"PASS": 0, "FAIL": 0, "KNOWN": 0, "REFUSED": 0,
                                       "calls": 0, "worst_ratio": 0.0})
        row[r["status"]] += 1
        row["calls"] += 1
        if r["status"] != "REFUSED" and r.get("ratio") is not None:
            row["worst_ratio"] = max(row["worst_ratio"], r["ratio"])
    total = {k: sum(v.get(k, 0) for v in per_dim.values())
             for k in ("PASS", "FAIL", "KNOWN", "REFUSED", "calls")}
    return {"per_head_dim": per_dim, "total": total}


def _line(d, row) -> str:
    return (f"d {d}: {row['calls']} calls: PASS {row['PASS']} FAIL {row['FAIL']} "
            f"REFUSED {row['REFUSED']}"
            + (f" KNOWN {row['KNOWN']} (D from the bf16 output)" if row.get("KNOWN") else "")
            + (f" (worst ratio {row['worst_ratio']:.2f})" if "worst_ratio" in row else ""))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true",
                        help="print the call count per head dim and exit (CPU, no CUDA)")
    parser.add_argument("--inspect", action="store_true",
                        help="attention()'s host-side checks and the compile count (CPU)")
    parser.add_argument("--plan", action="store_true",
                        help="per head dim the kernels and estimated seconds with --jobs "
                             "(8 if not given), and device calls of <= --budget s (CPU)")
    parser.add_argument("--budget", type=float, default=360,
                        help="--plan: estimated seconds per device call at most")
    parser.add_argument("--quick", action="store_true",
                        help="QUICK_CALLS: 20 calls, every feature axis, 37 kernels (< 2 min)")
    parser.add_argument("--dims", default="", help="head dims to keep, e.g. 64,128")
    parser.add_argument("--start", type=int, default=0,
                        help="skip calls with a global index below this (resume)")
    parser.add_argument("--stop", type=int, default=None,
                        help="skip calls with a global index at or above this (--plan's runs)")
    parser.add_argument("--max-cases", type=int, default=0, help="at most this many calls")
    parser.add_argument("--deadline", type=float, default=0,
                        help="start no call after this many seconds (0: none); the JSON "
                             "says where to resume")
    parser.add_argument("--jobs", type=int, default=None,
                        help="worker processes on the one GPU, each its own compiles (the "
                             "whole grid: 8 on a 16-core host); default 1, with --quick "
                             "min(8, cores / 2)")
    parser.add_argument("--indices", default="",
                        help="(a worker's) file of the global call indices to run")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: attention()'s host checks, then the checks against "
                             "stand_in_attention on the CPU (the tool's plumbing)")
    parser.add_argument("--verbose", action="store_true", help="print every call's line")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    dims = [int(x) for x in args.dims.split(",") if x.strip()]
    cases = enumerate_grid()
    chosen = select(cases, args.quick, dims, args.start, args.max_cases, args.stop)
    if args.indices:
        with open(args.indices) as f:
            chosen = [cases[int(i)] for i in f.read().split()]
    if args.list:
        for d in HEAD_DIMS:
            mine = [c for c in chosen if c.d == d]
            print(f"d {d}: {len(mine)} calls ({sum(c.backward for c in mine)} with the "
                  f"backward)")
        print(f"total: {len(chosen)} calls ({sum(c.backward for c in chosen)} with the "
              f"backward) of {len(cases)}")
        return 0
    if args.plan:
        return print_plan(plan(chosen, args.jobs or 8, args.budget), args)
    if args.inspect:
        t0 = time.time()
        found = inspect(chosen)
        print(f"{found['calls']} calls: {found['refused']} refused by attention() (host "
              f"checks), {found['kernels']} kernels: {found['compiles']['fwd']} forward and "
              f"{found['compiles']['bwd']} backward compile configurations, "
              f"{found['compiles']['helpers']} backward pre- / post-processing "
              f"({time.time() - t0:.0f} s)")
        for d, n in found["compiles_per_head_dim"].items():
            print(f"  d {d}: compiles fwd {n['fwd']} bwd {n['bwd']} helpers {n['helpers']}")
        for reason, row in found["refused_by_reason"].items():
            print(f"  REFUSED x{row['count']}: {reason[:200]}")
        for reason, row in found["forward_only_refused_with_grad"].items():
            print(f"  (forward-only, refused if q/k/v required grad) x{row['count']}: "
                  f"{reason[:160]}")
        print(f"  stages (forward, backward): {found['stages']}")
        return 0
    if args.jobs is None:              # --quick: its few compiles side by side
        args.jobs = min(8, max(1, (os.cpu_count() or 2) // 2)) if args.quick else 1
    if args.jobs > 1 and not args.indices:
        return run_jobs(chosen, cases, args)
    return run(chosen, cases, args)


def print_plan(found: dict, args) -> int:
    """--plan's lines: per head dim, the total, then one command per device call."""
    def seconds(x):
        return f"~{x:.0f} s"
    for d, row in found["per_head_dim"].items():
        k = row["kernels"]
        print(f"d {d}: {row['calls']} calls ({row['backward']} with the backward), "
              f"{k['all']} kernels (fwd {k['fwd']} bwd {k['bwd']} helpers {k['helpers']}): "
              f"{seconds(row['seconds'])} with --jobs {found['jobs']}")
    print(f"all: {found['kernels']['all']} kernels, {seconds(found['seconds_one_run'])} in one "
          f"run with --jobs {found['jobs']}; device calls of <= "
          f"{seconds(found['budget'])} estimated each:")
    extra = (f" --dims {args.dims}" if args.dims else "") + " --quick" * args.quick
    for run_ in found["runs"]:
        dims = ",".join(map(str, run_["dims"]))
        print(f"  python tools/fa_grid_gpu_check.py --start {run_['start']} --stop "
              f"{run_['stop']}{extra} --jobs {found['jobs']} --deadline {PLAN_DEADLINE_S}"
              f"   # d {dims}, {run_['calls']} calls, {seconds(run_['seconds'])}")
    return 0


def _compiled_count() -> int:
    """Kernel configurations compiled in this process (the forward and backward caches)."""
    from hopper_attn.common import backward, contract
    return len(contract._COMPILED) + len(backward._COMPILED)


# rough seconds (for the planners), from the first H200 pass (2026-11-29: 8 workers on the
# 16-core host compiled ~30 kernels and ran ~180 calls each in ~70 s): one kernel compiled
# by one of 8 workers, one call, one refused call, and a run's start (imports, CUDA, planning)
COMPILE_S, CALL_S, REFUSED_S, START_S = 1.6, 0.04, 0.002, 15.0
# --plan's device calls: estimated at most --budget seconds each, run with this --deadline
# (a call stops starting calls there and writes its JSON before the device's 540 s)
PLAN_DEADLINE_S = 480


def key_rows(chosen: list[Case]) -> list[dict]:
    """host_check(keys=True) of every call (no compile, no launch)."""
    restore = _recording_compiles()
    try:
        return [host_check(c, keys=True) for c in chosen]
    finally:
        restore()


def kernel_count(rows: list[dict]) -> dict:
    """The distinct kernels `rows` compile: {"fwd", "bwd", "helpers", "all"}."""
    found = {"fwd": set(), "bwd": set(), "helpers": set()}
    for r in rows:
        found["fwd"].update(k for k in [r.get("fwd_key")] if k is not None)
        found["bwd"].update(k for k in [r.get("bwd_key")] if k is not None)
        found["helpers"].update(r.get("helper_keys", ()))
    counts = {k: len(v) for k, v in found.items()}
    return {**counts, "all": sum(counts.values())}


def plan_jobs(chosen: list[Case], jobs: int, rows: Optional[list] = None
              ) -> tuple[list, list]:
    """`chosen` split into `jobs` shards of about equal work, each compile in one shard only:
    calls grouped by (d, dv, softcap, causal, window), which every kernel configuration's key
    fixes (the sinks' forward differs, their backward does not: they stay together), each
    group's work estimated from its kernels and calls (host_check; the backward's pre- /
    post-processing kernels, few and shared, may compile in more than one shard), dealt
    largest first to the least loaded shard. (shards of indices, loads in seconds)"""
    rows = key_rows(chosen) if rows is None else rows
    groups: dict = {}
    for c, r in zip(chosen, rows):
        group = groups.setdefault((c.d, c.dv, c.softcap, c.causal, c.fa_window),
                                  {"calls": [], "keys": set(), "runnable": 0})
        group["calls"].append(c.index)
        if r["status"] == "OK":
            group["runnable"] += 1
            group["keys"].update(kernel_keys(r))

    def work(keys, calls, runnable):
        return len(keys) * COMPILE_S + runnable * CALL_S + (calls - runnable) * REFUSED_S
    shards = [{"calls": [], "keys": set(), "runnable": 0} for _ in range(jobs)]
    loads = [0.0] * jobs
    for group in sorted(groups.values(), key=lambda g: work(g["keys"], len(g["calls"]),
                                                            g["runnable"]), reverse=True):
        i = loads.index(min(loads))
        shard = shards[i]
        shard["calls"] += group["calls"]
        shard["keys"] |= group["keys"]
        shard["runnable"] += group["runnable"]
        loads[i] = work(shard["keys"], len(shard["calls"]), shard["runnable"])
    return [sorted(s["calls"]) for s in shards], loads


def plan(chosen: list[Case], jobs: int, budget: float) -> dict:
    """`--plan`: per head dim the calls, kernels and estimated seconds of one run with `jobs`
    workers, and index ranges [start, stop) of runs estimated within `budget` seconds each
    (a head dim per run where it fits, several together where they fit, a head dim split
    into equal parts where it does not)."""
    chosen = sorted(chosen, key=lambda c: c.index)      # (--quick's are in its own order)
    rows = dict(zip((c.index for c in chosen), key_rows(chosen)))

    def estimate(part):
        _, loads = plan_jobs(part, jobs, [rows[c.index] for c in part])
        return START_S + max(loads)
    per_dim, units = {}, []
    for d in HEAD_DIMS:
        mine = [c for c in chosen if c.d == d]
        if not mine:
            continue
        seconds = estimate(mine)
        per_dim[d] = {"calls": len(mine), "backward": sum(c.backward for c in mine),
                      "kernels": kernel_count([rows[c.index] for c in mine]),
                      "seconds": seconds}
        parts = 1
        while True:                    # split a head dim that does not fit into equal parts
            size = -(-len(mine) // parts)
            pieces = [mine[i:i + size] for i in range(0, len(mine), size)]
            if parts >= len(mine) or all(estimate(p) <= budget for p in pieces):
                break
            parts += 1
        units += pieces
    runs: list = []
    for unit in units:                 # then whole units together while they fit
        if runs and estimate(runs[-1] + unit) <= budget:
            runs[-1] = runs[-1] + unit
        else:
            runs.append(unit)
    return {"per_head_dim": per_dim, "jobs": jobs, "budget": budget,
            "kernels": kernel_count(list(rows.values())),
            "seconds_one_run": estimate(chosen) if chosen else 0.0,
            "runs": [{"start": r[0].index, "stop": r[-1].index + 1, "calls": len(r),
                      "dims": sorted({c.d for c in r}), "seconds": estimate(r)}
                     for r in runs]}


def run_jobs(chosen, cases, args) -> int:
    """`--jobs N`: N worker processes (this script with --indices) on disjoint shards, their
    JSON under a temporary folder (not $OUT: the device returns few files), merged into
    one. A worker that stops early (a poisoned context, a crash) is restarted on the calls
    it left, twice at most; a call a worker died on without a verdict is a FAIL."""
    import subprocess
    import tempfile

    from hopper_attn.harness.env import environment
    from hopper_attn.harness.gpu_check import env_line
    env = environment()
    print(env_line(env), flush=True)
    t0 = time.time()
    rows = key_rows(chosen)
    shards, loads = plan_jobs(chosen, args.jobs, rows)
    print(f"{len(chosen)} calls, {_kernels_line(kernel_count(rows))}, in {args.jobs} "
          f"workers (estimated {START_S + max(loads):.0f} s)", flush=True)
    folder = tempfile.mkdtemp(prefix="fa_grid_")
    by_index = {c.index: c for c in cases}
    records: dict = {}
    compiles = 0
    pending = {j: shard for j, shard in enumerate(shards) if shard}
    for attempt in range(3):
        procs = {}
        for j, shard in pending.items():
            part = os.path.join(folder, f"job{j}_{attempt}")
            os.makedirs(part)
            with open(os.path.join(part, "indices.txt"), "w") as f:
                f.write(" ".join(map(str, shard)))
            cmd = [sys.executable, os.path.abspath(__file__), "--indices",
                   os.path.join(part, "indices.txt"), "--out", part] + \
                ["--dry-run"] * args.dry_run
            if args.deadline:
                cmd += ["--deadline", str(max(1.0, args.deadline - (time.time() - t0)))]
            log = open(os.path.join(part, "log.txt"), "w")
            procs[j] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), part, log)
        next_pending = {}
        for j, (proc, part, log) in procs.items():
            rc = proc.wait()
            log.close()
            done = {}
            try:
                with open(os.path.join(part, "fa_grid.json")) as f:
                    result = json.load(f)
                done = {r["index"]: r for r in result["records"]}
                compiles += result["summary"].get("compiles", 0)
            except (OSError, ValueError, KeyError):
                result = {}
            records.update(done)
            left = [i for i in pending[j] if i not in done]
            print(f"worker {j}: {len(done)} of {len(pending[j])} calls, exit {rc}"
                  + (f", {len(left)} left" if left else ""), flush=True)
            if not left or (args.deadline and time.time() - t0 > args.deadline):
                continue
            if result.get("stopped", "running") == "running":   # died: on which call?
                try:
                    with open(os.path.join(part, "current.txt")) as f:
                        dead = int(f.read())
                except (OSError, ValueError):
                    dead = left[0]
                records[dead] = {"index": dead, "label": by_index[dead].label(),
                                 "status": "FAIL", "where": "worker",
                                 "message": f"the worker process died on this call (exit "
                                            f"{rc}): {os.path.join(part, 'log.txt')}"}
                left = [i for i in left if i != dead]
            if left:
                next_pending[j] = left
        pending = next_pending
        if not pending:
            break
    ordered = [records[c.index] for c in chosen if c.index in records]
    missing = [c.index for c in chosen if c.index not in records]
    for status in ("FAIL", "KNOWN", "REFUSED"):
        for r in [r for r in ordered if r["status"] == status][:30]:
            detail = f"ratio {r['ratio']:.2f} ({r['worst']})" if "ratio" in r else \
                r.get("message", "")[:160]
            print(f"{by_index[r['index']].label()}: {status} {detail}")
    summary, path = _write(env, args, cases, ordered, by_index, t0,
                           partial=missing[0] if missing else None, compiles=compiles)
    for reason, count in list(summary["refused_by_reason"].items())[:8]:
        print(f"  REFUSED x{count}: {reason[:150]}")
    for d, row in summary["per_head_dim"].items():
        print(_line(d, row))
    print(_line("all", {**summary["total"]}) + f" ({time.time() - t0:.0f} s, "
          f"{compiles} kernels compiled)" + (f"; {len(missing)} calls not run, first "
                                              f"{missing[0]}" if missing else ""))
    print("wrote", path, f"(workers' logs: {folder})")
    return 0 if summary["total"]["FAIL"] == 0 and summary["total"]["REFUSED"] == 0 \
        and not missing else 1


def _kernels_line(counts: dict) -> str:
    return (f"{counts['all']} kernels to compile ({counts['fwd']} forward, {counts['bwd']} "
            f"backward, {counts['helpers']} backward pre- / post-processing)")


# CUDA errors after which the context is unusable (every later call would fail too)
POISONED = ("illegal memory access", "illegal instruction", "unspecified launch failure",
            "misaligned address")


def run(chosen, cases, args) -> int:
    from hopper_attn.harness.env import environment
    from hopper_attn.harness.gpu_check import env_line
    env = environment()
    print(env_line(env), flush=True)
    kernels = "" if args.indices else f", {_kernels_line(kernel_count(key_rows(chosen)))}"
    print(f"{len(chosen)} calls (of {len(cases)}), from index "
          f"{chosen[0].index if chosen else '-'}{kernels}", flush=True)
    records, printed, t0 = [], {"FAIL": 0, "KNOWN": 0, "REFUSED": 0}, time.time()
    by_index = {c.index: c for c in cases}
    stopped = None                         # the index to resume from, if stopped early
    why = None                             # "deadline" or "poisoned" where it stopped early
    for n, case in enumerate(chosen):
        if args.deadline and time.time() - t0 > args.deadline:
            stopped, why = case.index, "deadline"
            print(f"deadline ({args.deadline} s) reached: resume with --start {case.index}",
                  flush=True)
            break
        if args.indices:                   # a worker: which call it is on, should it die
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "current.txt"), "w") as f:
                f.write(str(case.index))
        started = time.time()
        try:
            r = dry_run_case(case) if args.dry_run else run_case(case)
        except Exception as exc:  # noqa: BLE001 - one failure must not stop the sweep
            r = {"status": "FAIL", "message": f"{type(exc).__name__}: {str(exc)[:300]}",
                 "where": "run"}
        status = r["status"]
        # a PASS in brief (the case is its index: enumerate_grid()), the others in full; "s":
        # the call's seconds, its compiles included (the planner's constants)
        records.append({"index": case.index, "status": status, "ratio": r["ratio"],
                        "worst": r["worst"]} if status == "PASS" else
                       {"index": case.index, "label": case.label(), **r})
        records[-1]["s"] = round(time.time() - started, 3)
        if r.get("where") == "run" and any(s in r["message"].lower() for s in POISONED):
            stopped, why = case.index + 1, "poisoned"
            print(f"{case.label()}: FAIL {r['message'][:160]} -- the process is poisoned; "
                  f"rerun with --start {case.index + 1}", flush=True)
            break
        if args.verbose or (status != "PASS" and printed[status] < 30):
            if status != "PASS":
                printed[status] += 1
            detail = f"ratio {r['ratio']:.2f} ({r['worst']})" if "ratio" in r else \
                r.get("message", "")[:160]
            print(f"{case.label()}: {status} {detail}", flush=True)
        if (n + 1) % 500 == 0:
            print(f"... {n + 1}/{len(chosen)} calls, last index {case.index}, "
                  f"{time.time() - t0:.0f} s", flush=True)
        if (n + 1) % 100 == 0:
            _write(env, args, cases, records, by_index, t0, partial=case.index + 1,
                   stopped="running")
    summary, path = _write(env, args, cases, records, by_index, t0, partial=stopped,
                           stopped=why)
    for reason, count in list(summary["refused_by_reason"].items())[:8]:
        print(f"  REFUSED x{count}: {reason[:150]}")
    for d, row in summary["per_head_dim"].items():
        print(_line(d, row))
    print(_line("all", {**summary["total"]}) + f" ({time.time() - t0:.0f} s, "
          f"{summary['compiles']} kernels compiled)")
    print("wrote", path)
    return 0 if summary["total"]["FAIL"] == 0 and summary["total"]["REFUSED"] == 0 else 1


def _write(env, args, cases, records, by_index, t0, partial=None, compiles=None,
           stopped=None):
    """The JSON so far (`partial`: the index a rerun would --start from; None: complete;
    `stopped`: "running" while it runs, "deadline" or "poisoned" where it stopped early)."""
    from hopper_attn.harness.gpu_check import write_json
    summary = _summary(records, by_index)
    reasons: dict = {}
    for r in records:
        if r["status"] == "REFUSED":
            reasons[_reason(r["message"])] = reasons.get(_reason(r["message"]), 0) + 1
    summary["refused_by_reason"] = dict(sorted(reasons.items(), key=lambda kv: -kv[1]))
    summary["compiles"] = _compiled_count() if compiles is None else compiles
    result = {"env": env, "grid": {
        "source": "Dao-AILab/flash-attention tests/cute/test_flash_attn.py::"
                  "test_flash_attn_output (file version 008e636)",
        "head_dims": HEAD_DIMS, "seqlen_pairs": SEQLEN_PAIRS, "mha_types": KV_HEADS,
        "heads": HEADS, "local_enum": LOCAL_ENUM, "softcaps": SOFTCAPS,
        "deterministic": DETERMINISTIC, "sinks": SINKS, "dtypes": DTYPES,
        "skipped": SKIPPED, "calls": len(cases)},
        "args": vars(args), "resume_from": partial, "stopped": stopped, "summary": summary,
        "seconds": time.time() - t0, "records": records}
    return summary, write_json(result, "fa_grid.json", args.out)


if __name__ == "__main__":
    sys.exit(main())
