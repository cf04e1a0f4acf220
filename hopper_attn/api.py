"""`attention()`: the fastest stage that supports a problem, as a PyTorch custom op.

    import hopper_attn
    out = hopper_attn.attention(q, k, v, causal=True)          # (B, N, H, d) in, same out

What it does: checks the inputs (raising ValueError before anything is launched), picks the
decode stage where a few queries meet many keys (`decode.prefers`: every k/v head's query
rows, group x seqlen_q, fit one 64-row tile; windows, softcap and sinks too), else the first stage of `PREFERENCE` (per head
dim) that supports the problem (or the one named by `stage=`), compiles it on first use (cached per head dim, mask and options; one compile
serves every batch, sequence length and head count), and launches it on the current CUDA
stream.

It is registered as `torch.ops.hopper_attn.attention` with a fake (meta) implementation, so
`torch.compile(fullgraph=True)` traces through it and CUDA graphs can capture it.

k and v may have fewer heads than q (GQA/MQA: q's heads a multiple of theirs; read in place,
no copies) and another sequence length (cross-attention, a KV prefix); with a causal mask
the diagonal is then aligned bottom-right, as in FlashAttention: query i sees keys
j <= i + seqlen_k - seqlen_q, and a query that sees no key gets a zero output row.
`return_lse=True` also returns the log-sum-exp (fp32, (batch, heads, seqlen_q)). q, k, v
may be strided views (last dim contiguous, other strides multiples of 16 bytes), e.g. of one
packed (batch, seqlen, 3, heads, head_dim) QKV tensor: read in place, no copies.

Gradients: when q, k or v requires grad, the op records what its backward needs (q, k, v,
the output and the LSE) and `.backward()` runs the first backward stage of
`BACKWARD_PREFERENCE` that supports the problem (kb2: head_dim 64, 96, 128, 192 and 256,
bf16 and fp16, GQA, cross-attention; kb1's problems are a subset); a problem none supports is
refused in the forward, before any launch. The LSE output itself is not differentiable. The backward
reads q, k, v, the output and its gradient in place in the strided layouts the forward takes
(transformers' and SDPA's (batch, heads, seqlen, head_dim) views, packed QKV) and returns
dq, dk, dv laid out like q, k, v where those are dense. In eager mode the autograd node is
a plain `torch.autograd.Function` and repeated calls skip the checks they passed (per
shapes, strides, dtypes, mask): tools/host_overhead.py times the host path.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from hopper_attn import stages
from hopper_attn.common.contract import (Problem, UnsupportedProblem, check_tensors,
                                         normalize_window, run_attention)

# Fastest first, by the same-run benchmarks in results/ (k6 alone runs d 96-256 and fp16).
# k6 leads k5 everywhere since 2026-11-26 (round-robin, results/h100/2026-11-26_bench_k4-k6.json:
# d = 64 without a mask 1.15 / 1.09 / 1.05 / 1.03 / 1.02 / 1.01x at N = 512 ... 16k, where k5
# led by 1.6-3.1% on 2026-11-23; with a mask 1.09-1.34x; d = 128 1.13-1.17x, causal 1.13-1.23x).
PREFERENCE = ("k6", "k5", "k4")
PREFERENCE_BY_HEAD_DIM: dict = {}      # (head_dim, causal) -> another order, where measured
BACKWARD_PREFERENCE = ("kb2", "kb1")

_HANDLES: dict = {}


def _first_supporting(names, problem: Problem, what: str):
    """The first registered stage of `names` that supports `problem`, else UnsupportedProblem
    with every stage's reason."""
    reasons = []
    for name in names:
        entry = stages.get(name)
        reason = entry.spec.unsupported_reason(problem)
        if reason is None:
            return entry
        reasons.append(reason)
    raise UnsupportedProblem(f"no {what} supports this problem: " + "; ".join(reasons))


def _backward_entry(problem: Problem, deterministic: bool = False, softcap: float = 0.0):
    if softcap:                                # kb2 alone takes a softcap (d = 64-192)
        from hopper_attn.kb2 import SOFTCAP_TILES
        if problem.head_dim not in SOFTCAP_TILES:
            raise UnsupportedProblem(f"no backward stage with softcap supports head_dim "
                                     f"{problem.head_dim} (kb2: {sorted(SOFTCAP_TILES)})")
        options = f"softcap={softcap!r}" + (",deterministic=1" if deterministic else "")
        return _first_supporting((f"kb2:{options}",), problem, "backward stage with softcap")
    names = ("kb2:deterministic=1",) if deterministic else BACKWARD_PREFERENCE
    return _first_supporting(names, problem, "backward stage")


SOFTCAP_STAGES = ("k6", "decode")  # the forward stages that take a softcap
SINK_STAGES = ("k6", "decode")     # ... and attention sinks


def _check_softcap(softcap) -> float:
    """softcap as a float: finite and >= 0 (0: none), else ValueError."""
    try:
        cap = float(softcap)
    except (TypeError, ValueError):
        raise ValueError(f"softcap must be a number, got {softcap!r}") from None
    if not math.isfinite(cap) or cap < 0.0:
        raise ValueError(f"softcap must be finite and >= 0 (0: no softcap), got {softcap!r}")
    return cap


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, heads, head_dim), "
                             f"got shape {tuple(t.shape)}")
    if tuple(k.shape[:3]) != tuple(v.shape[:3]):
        raise ValueError(f"k and v must have the same shape (but for v's head dim), got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and "
                         "head_dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q's heads ({q.shape[2]}) must be a multiple of k/v's ({k.shape[2]}) "
                         "for grouped-query attention")


def _compile_options() -> str:
    """CuTe DSL's TVM-FFI calling path when its runtime (apache-tvm-ffi) is installed."""
    import importlib.util
    return "--enable-tvm-ffi" if importlib.util.find_spec("tvm_ffi") is not None else ""


def _entry_for(problem: Problem, stage: str, softcap: float = 0.0, sinks: bool = False):
    options = [f"softcap={softcap!r}"] * bool(softcap) + ["sinks=1"] * bool(sinks)
    if not stage:
        from hopper_attn import decode
        # a few queries per k/v head (v as wide as k), the window, softcap and sinks too
        if decode.prefers(problem) and not problem.head_dim_v:
            return stages.get("decode" + (":" + ",".join(options) if options else ""))
    if options:                                # else k6 alone (k4, k5, k7 refuse them)
        name = stage.partition(":")[0] if stage else "k6"
        if softcap and name not in SOFTCAP_STAGES:
            raise ValueError(f"stage {stage!r} has no logit softcapping; softcap runs on "
                             f"{', '.join(SOFTCAP_STAGES)}")
        if sinks and name not in SINK_STAGES:
            raise ValueError(f"stage {stage!r} has no attention sinks; sinks run on "
                             f"{', '.join(SINK_STAGES)}")
        entry = stages.get(f"{stage or 'k6'}{',' if ':' in (stage or '') else ':'}"
                           + ",".join(options))
        entry.spec.check(problem)
        return entry
    if stage:
        entry = stages.get(stage)
        entry.spec.check(problem)              # UnsupportedProblem (a ValueError) with the reason
        return entry
    preference = PREFERENCE_BY_HEAD_DIM.get((problem.head_dim, problem.causal), PREFERENCE)
    return _first_supporting(preference, problem, "stage")


# Calls that passed every check once, by everything the checks looked at except the data
# pointers (shapes, strides, dtypes, devices, mask, stage): they skip straight to the launch.
_FAST: dict = {}
_FAST_LIMIT = 4096


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
         softmax_scale: Optional[float], stage: str, softcap: float = 0.0,
         window: tuple = (None, None), sinks: Optional[torch.Tensor] = None,
         want_lse: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """out and the LSE; with `want_lse=False` (nobody reads it) the LSE may be None: a stage
    that keeps its workspace (decode) then writes it into its own buffer, one allocation
    fewer per call."""
    try:
        key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype,
               k.dtype, v.dtype, q.device, k.device, v.device, causal, stage, softcap,
               window, sinks is None)
        handle = _FAST.get(key)
    except AttributeError:                     # not tensors: the checks below say so
        key = handle = None
    if handle is None and key is not None and window == (None, None):
        handle = _decode_step_handle(q, k, v, key)
    if handle is None or (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16:
        handle = _checked_handle(q, k, v, causal, stage, softcap, window, sinks is not None)
        if len(_FAST) >= _FAST_LIMIT:          # e.g. many sequence lengths: start over
            _FAST.clear()
            _DECODE_STEPS.clear()
        _FAST[key] = handle
        if handle.spec.name == "decode" and window == (None, None):
            _remember_decode_step(k, key, handle)
    out = _out_like(q, v)
    lse = _lse_like(q) if want_lse or not handle.spec.keeps_workspace else None
    if sinks is not None and sinks.data_ptr() % 16:     # (a view: inputs are 16-byte aligned)
        sinks = sinks.clone()
    if handle.workspace_fn is None:            # a stage that does not write the LSE (k4)
        lse.fill_(float("nan"))
        run_attention(handle, q, k, v, out, softmax_scale, checked=True)
    else:                                      # (decode: its partials and counters follow)
        run_attention(handle, q, k, v, out, softmax_scale, checked=True, lse=lse,
                      extra_inputs=() if sinks is None else (sinks,))
    return out, lse


# A generation step has one key more than the last: a new shape (and, for a cache that
# torch.cat grows, new strides), so `_FAST` misses every step and the checks ran each time.
# A decode handle depends on the key count only through its kv tiles (the split count), so
# such a call finds it by everything else and its kv tile count, once what a miss would
# check of k and v there (lengths, strides) passes. Windows excluded: their walked tiles
# depend on the exact count.
_DECODE_STEPS: dict = {}


def _decode_step_family(key) -> tuple:
    """`_run`'s key without k's and v's lengths and strides."""
    q_shape, k_shape, v_shape, q_stride = key[:4]
    return (q_shape, k_shape[0], k_shape[2:], v_shape[2:], q_stride, *key[6:])


def _remember_decode_step(k, key, handle) -> None:
    block_n = getattr(handle, "options", {}).get("block_n", 0)
    if block_n and k.shape[1] >= block_n:
        steps = _DECODE_STEPS.setdefault(_decode_step_family(key), (block_n, {}))[1]
        steps[-(-k.shape[1] // block_n)] = handle


def _decode_step_handle(q, k, v, key):
    """The decode handle of an earlier call that differed from this one only in k's and v's
    lengths and strides, within the same kv tile count, if there was one (else None)."""
    family = _DECODE_STEPS.get(_decode_step_family(key))
    if family is None:
        return None
    block_n, steps = family
    keys = k.shape[1]
    if keys < block_n or v.shape[1] != keys or not (_tma_strides(k) and _tma_strides(v)):
        return None
    return steps.get(-(-keys // block_n))


def _tma_strides(t: torch.Tensor) -> bool:
    """check_tensors' strided layout rule: last dim contiguous, the others 16-byte steps."""
    unit = 16 // t.element_size()
    s0, s1, s2, s3 = t.stride()                # (4-D: the family's key has k's and v's dims)
    n0, n1, n2, _ = t.shape
    return s3 == 1 and (s0 % unit == 0 or n0 == 1) and (s1 % unit == 0 or n1 == 1) \
        and (s2 % unit == 0 or n2 == 1)


def _checked_handle(q, k, v, causal: bool, stage: str, softcap: float = 0.0,
                    window: tuple = (None, None), sinks: bool = False):
    """Every check of a call (ValueError before any launch), then its compiled kernel."""
    _check(q, k, v)
    softcap = _check_softcap(softcap)
    problem = Problem.from_tensor(q, causal, k, window, v)
    entry = _entry_for(problem, stage, softcap, sinks)
    check_tensors(problem, q, k, v, q[..., :problem.dv],   # dtype, device, layout: before
                  strided=entry.spec.strided_inputs)       # compiling
    return _handle(entry, problem, _compile_options())


# decode handles by everything but the key count: the kernel, tile and options come from the
# batch, heads and queries alone, so a decode step with one key more copies its sibling's
# (its workspace, sized by the split count, comes with its first launch)
_DECODE_SIBLINGS: dict = {}


def _handle(entry, problem: Problem, compile_options: str = ""):
    """`entry` compiled for `problem`, once per (stage, problem)."""
    key = (entry.name, problem)
    handle = _HANDLES.get(key)
    if handle is None:
        if len(_HANDLES) >= _FAST_LIMIT:       # (decode: one per key count; compiles stay)
            _HANDLES.clear()
            _DECODE_SIBLINGS.clear()
        sibling_key = None
        if entry.module == "hopper_attn.decode":
            sibling_key = (entry.name, compile_options, problem.batch, problem.heads,
                           problem.seqlen, problem.head_dim, problem.causal, problem.dtype,
                           problem.kv_heads, problem.window_left, problem.window_right,
                           problem.head_dim_v)
        sibling = _DECODE_SIBLINGS.get(sibling_key)
        if sibling is not None:
            handle = dataclasses.replace(sibling, problem=problem, workspace=[],
                                         options=dict(sibling.options), compile_seconds=0.0,
                                         _bound_key=None, _bound_args=None)
        else:
            handle = entry.compile(problem, compile_options=compile_options)
            if sibling_key is not None:
                _DECODE_SIBLINGS[sibling_key] = handle
        _HANDLES[key] = handle
    return handle


@torch.library.custom_op("hopper_attn::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  softmax_scale: Optional[float], stage: str, deterministic: bool = False,
                  softcap: float = 0.0, window_left: Optional[int] = None,
                  window_right: Optional[int] = None,
                  sinks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _run(q, k, v, causal, softmax_scale, stage, softcap, (window_left, window_right),
                sinks)


def _lse_like(q: torch.Tensor) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def _out_like(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The output: q's shape and layout, or with v's head dim dv != d (B, N, H, dv)."""
    if v.shape[3] == q.shape[3]:
        return torch.empty_like(q)
    return q.new_empty((*q.shape[:3], v.shape[3]))


@_attention_op.register_fake
def _(q, k, v, causal, softmax_scale, stage, deterministic=False, softcap=0.0, window_left=None,
      window_right=None, sinks=None):
    _check(q, k, v)
    _check_softcap(softcap)
    normalize_window((window_left, window_right), causal)
    return _out_like(q, v), _lse_like(q)


# The backward stages read q, k, v, out, dout through their strides (TMA descriptors and the
# helpers' indexing take runtime strides); False: copy every non-contiguous one, as before.
BACKWARD_READS_STRIDED = True


def _readable_in_place(t: torch.Tensor) -> bool:
    """Whether the backward stages read `t` as it is: last dim contiguous, the other strides
    positive multiples of 16 bytes (TMA and the helpers' 16-byte accesses), 16-byte aligned;
    e.g. transformers' and SDPA's (batch, heads, seqlen, head_dim) views, packed QKV."""
    if not BACKWARD_READS_STRIDED:
        return t.is_contiguous() and t.data_ptr() % 16 == 0
    unit = 16 // t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(st > 0 and st % unit == 0 for st, n in zip(t.stride()[:3], t.shape[:3])
                    if n > 1))


# Backward calls that passed every check once, by everything the checks looked at except
# the data pointers: shapes, strides, dtypes, device, mask, deterministic -> (run_kernel,
# handle, which of q, k, v, out, dout must be copied to be read).
_BWD_FAST: dict = {}


def _backward_impl(q, k, v, out, dout, lse, causal: bool, softmax_scale: Optional[float],
                   deterministic: bool = False, softcap: float = 0.0,
                   window: tuple = (None, None)):
    """dq, dk, dv (dq like q's layout, dk / dv like k's and v's where those are dense) by the
    first backward stage that supports the problem; ValueError before any launch."""
    return _backward_rows(q, k, v, out, dout, lse, causal, softmax_scale, deterministic,
                          softcap, window)[:3]


def _backward_rows(q, k, v, out, dout, lse, causal: bool, softmax_scale: Optional[float],
                   deterministic: bool = False, softcap: float = 0.0,
                   window: tuple = (None, None)):
    """_backward_impl's dq, dk, dv and the preprocess's D = rowsum(dO * O) (for the sinks'
    gradient)."""
    tensors = (q, k, v, out, dout)
    try:
        key = (q.shape, k.shape, v.shape, out.shape, dout.shape, lse.shape, q.stride(),
               k.stride(), v.stride(), out.stride(), dout.stride(), lse.stride(), q.dtype,
               k.dtype, v.dtype, out.dtype, dout.dtype, lse.dtype, q.device, k.device,
               v.device, out.device, dout.device, lse.device, causal, deterministic, softcap,
               tuple(window))
        fast = _BWD_FAST.get(key)
    except AttributeError:                     # not tensors: the checks below say so
        key = fast = None
    if fast is None or (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr()
                        | dout.data_ptr() | lse.data_ptr()) % 16:
        fast = _checked_backward(tensors, lse, causal, deterministic, softcap, window)
        if len(_BWD_FAST) >= _FAST_LIMIT:
            _BWD_FAST.clear()
        if key is not None:
            _BWD_FAST[key] = fast
    run_kernel, handle, copies = fast
    if copies:                                 # (a stride-0 dout, a layout TMA cannot read)
        q, k, v, out, dout = (t.contiguous() if c else t for t, c in zip(tensors, copies))
    # empty_like keeps a dense tensor's layout (e.g. transformers' (B, H, N, d) views): the
    # kernels write through strides, and autograd gets gradients laid out like the inputs
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    d_rows = run_kernel(handle, q, k, v, out, dout, lse, dq, dk, dv, softmax_scale,
                        checked=True)
    return dq, dk, dv, d_rows


def _checked_backward(tensors, lse, causal: bool, deterministic: bool, softcap: float = 0.0,
                      window: tuple = (None, None)):
    """Every check of a backward call (ValueError before any launch), then its compiled
    stage: (run_kernel, handle, copies)."""
    from hopper_attn.common.backward import check_backward_tensors
    for name, t in zip(("q", "k", "v", "out", "dout", "lse"), (*tensors, lse)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    q, k, v, out, dout = tensors
    _check(q, k, v)
    copies = tuple(t.dim() != 4 or not _readable_in_place(t) for t in tensors)
    q, k, v, out, dout = (t.clone(memory_format=torch.contiguous_format) if c else t
                          for t, c in zip(tensors, copies))
    problem = Problem.from_tensor(q, causal, k, window, v)
    entry = _backward_entry(problem, deterministic, softcap)
    handle = _handle(entry, problem)
    check_backward_tensors(problem, q, k, v, out, dout, lse, q, k, v)
    return entry.load().run_kernel, handle, (copies if any(copies) else None)


@torch.library.custom_op("hopper_attn::attention_backward", mutates_args=())
def _attention_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                           causal: bool, softmax_scale: Optional[float],
                           deterministic: bool = False, softcap: float = 0.0,
                           window_left: Optional[int] = None, window_right: Optional[int] = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_impl(q, k, v, out, dout, lse, causal, softmax_scale, deterministic,
                          softcap, (window_left, window_right))


@_attention_backward_op.register_fake
def _(q, k, v, out, dout, lse, causal, softmax_scale, deterministic=False, softcap=0.0,
      window_left=None, window_right=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op("hopper_attn::attention_backward_sinks", mutates_args=())
def _attention_backward_sinks_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                                 sinks: torch.Tensor, causal: bool,
                                 softmax_scale: Optional[float], deterministic: bool = False,
                                 softcap: float = 0.0, window_left: Optional[int] = None,
                                 window_right: Optional[int] = None
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                            torch.Tensor]:
    """attention_backward and the sinks' gradient from the backward's own D."""
    return _backward_with_sinks(q, k, v, out, dout, lse, sinks, causal, softmax_scale,
                                deterministic, softcap, (window_left, window_right))


@_attention_backward_sinks_op.register_fake
def _(q, k, v, out, dout, lse, sinks, causal, softmax_scale, deterministic=False, softcap=0.0,
      window_left=None, window_right=None):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(sinks))


def _backward_with_sinks(q, k, v, out, dout, lse, sinks, causal, softmax_scale, deterministic,
                         softcap, window):
    from hopper_attn.common.sinks import sink_grad
    dq, dk, dv, d_rows = _backward_rows(q, k, v, out, dout, lse, causal, softmax_scale,
                                        deterministic, softcap, window)
    return dq, dk, dv, sink_grad(sinks, out, dout, lse, d_rows)


def _setup_context(ctx, inputs, output):
    (q, k, v, causal, softmax_scale, stage, deterministic, softcap, window_left,
     window_right, sinks) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks)
    ctx.causal, ctx.softmax_scale, ctx.deterministic = causal, softmax_scale, deterministic
    ctx.softcap, ctx.window = softcap, (window_left, window_right)
    # the LSE output has no gradient: without this autograd fills a zero tensor for it on
    # every backward call (one extra kernel launch)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    if dout is None:                        # only the LSE was used: no gradient flows back
        return (None,) * 11
    q, k, v, out, lse, sinks = ctx.saved_tensors
    dq = dk = dv = None
    if any(ctx.needs_input_grad[:3]) and sinks is not None and ctx.needs_input_grad[10]:
        dq, dk, dv, dsinks = torch.ops.hopper_attn.attention_backward_sinks(
            q, k, v, out, dout, lse, sinks, ctx.causal, ctx.softmax_scale, ctx.deterministic,
            ctx.softcap, *ctx.window)
        return dq, dk, dv, *(None,) * 7, dsinks
    if any(ctx.needs_input_grad[:3]):
        dq, dk, dv = torch.ops.hopper_attn.attention_backward(
            q, k, v, out, dout, lse, ctx.causal, ctx.softmax_scale, ctx.deterministic,
            ctx.softcap, *ctx.window)
    return dq, dk, dv, *(None,) * 7, _sink_grad(ctx, sinks, out, dout, lse, 10)


_attention_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The custom op's autograd in eager mode without the dispatcher round trips (the op's
    autograd wrapper, its backward op's): the same forward and backward functions, tens of
    microseconds less host time per training step (tools/host_overhead.py)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, stage, deterministic, softcap, window,
                sinks):
        out, lse = _run(q, k, v, causal, softmax_scale, stage, softcap, window, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.causal, ctx.softmax_scale, ctx.deterministic = causal, softmax_scale, deterministic
        ctx.softcap, ctx.window = softcap, window
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        if dout is None:
            return (None,) * 10
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq = dk = dv = None
        if any(ctx.needs_input_grad[:3]) and sinks is not None and ctx.needs_input_grad[9]:
            dq, dk, dv, dsinks = _backward_with_sinks(q, k, v, out, dout, lse, sinks,
                                                      ctx.causal, ctx.softmax_scale,
                                                      ctx.deterministic, ctx.softcap,
                                                      ctx.window)
            return dq, dk, dv, *(None,) * 6, dsinks
        if any(ctx.needs_input_grad[:3]):
            dq, dk, dv = _backward_impl(q, k, v, out, dout, lse, ctx.causal,
                                        ctx.softmax_scale, ctx.deterministic, ctx.softcap,
                                        ctx.window)
        return dq, dk, dv, *(None,) * 6, _sink_grad(ctx, sinks, out, dout, lse, 9)


def _sink_grad(ctx, sinks, out, dout, lse, index: int):
    """The sinks' gradient (common/sinks.py) where input `index` (the sinks) needs one."""
    if sinks is None or not ctx.needs_input_grad[index]:
        return None
    from hopper_attn.common.sinks import sink_grad
    return sink_grad(sinks, out, dout, lse)


# Forwards whose backward was found runnable, by what that check looked at.
_DIFFERENTIABLE: set = set()


def _check_differentiable(q, k, v, causal: bool, stage: Optional[str],
                          deterministic: bool = False, softcap: float = 0.0,
                          window: tuple = (None, None)) -> None:
    """Before a forward whose result needs gradients: can a backward stage run it?"""
    try:
        key = (q.shape, k.shape, v.shape, q.dtype, causal, stage, deterministic, softcap,
               tuple(window))
        if key in _DIFFERENTIABLE:
            return
    except AttributeError:
        key = None
    _check(q, k, v)
    problem = Problem.from_tensor(q, causal, k, window, v)
    if softcap:
        _backward_entry(problem, deterministic, softcap)
        return
    if stage == "k4":
        raise ValueError("stage k4 writes no log-sum-exp, which the backward pass needs; "
                         "use k5, k6 or the default")
    # UnsupportedProblem with the reason
    _backward_entry(problem, deterministic)
    if key is not None:
        if len(_DIFFERENTIABLE) >= _FAST_LIMIT:
            _DIFFERENTIABLE.clear()
        _DIFFERENTIABLE.add(key)


_NO_SOFTCAP, _NO_WINDOW = 0.0, (None, None)     # attention()'s defaults


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              softmax_scale: Optional[float] = None, return_lse: bool = False,
              stage: Optional[str] = None, deterministic: bool = False,
              softcap: float = _NO_SOFTCAP, window_size: tuple = _NO_WINDOW,
              sinks: Optional[torch.Tensor] = None):
    """softmax(q k^T * scale [+ causal mask]) v for (batch, seqlen, heads, head_dim) tensors.

    softmax_scale defaults to 1/sqrt(head_dim). With `return_lse`, also returns the
    log-sum-exp of each query row, log(sum_j exp(q_i . k_j * scale)), fp32 (batch, heads,
    seqlen_q); -inf for a row that sees no key (what a backward pass or a split-KV
    combination needs). `stage` picks a stage by name (e.g. "k4", which writes no LSE: NaN)
    instead of the fastest one. Inputs: bf16 or fp16, on one CUDA device, head_dim 64, 96,
    128, 192 or 256 (k6; k5 and k4: 64 and 128, bf16), any sequence length;
    anything else raises ValueError before a launch. Differentiable at head_dim 64, 96, 128,
    192 and 256 (the backward runs kb2); with `deterministic`,
    dQ's additions happen in a fixed order, so the gradients have the same bits on every run
    (slower: docs/kb2.md).

    v may have its own head dim dv (DeepSeek MLA's (d, dv) = (192, 128), and (128, 64); k6,
    docs/head-dim-v.md): v (batch, seqlen_k, heads_kv, dv), the output (batch, seqlen,
    heads, dv); other pairs raise ValueError. Differentiable at both pairs (kb2; at
    (192, 128) d = 192's 64 x 96 tile with a dV^T of 2 blocks of 64 rows).

    `softcap` > 0: logit softcapping (Gemma 2, Grok): softmax(cap * tanh(s / cap)) on the
    scaled scores s = q k^T * scale, the LSE that of the capped scores; k6 (any of its
    head dims) and the decode stage (the cap is compiled in: one compile per cap value),
    differentiable at
    head_dim 64 to 256 (kb2). 0: no softcap, today's kernels. ValueError for a negative or
    non-finite cap, or a stage without it.

    `window_size=(left, right)`: sliding-window attention, FlashAttention's definition: query
    i, at row position r = i + seqlen_k - seqlen_q (bottom-right aligned), sees keys
    r - left <= j <= r + right. A side None is unbounded, and then the other side is taken
    literally, negative included (FlashAttention-4's spelling: (None, -1) sees keys
    j <= r - 1, (-3, None) keys j >= r + 3); with two ints -1 is unbounded
    (FlashAttention-2's and transformers' convention) and any other int literal, negative
    included ((5, -3): keys r - 5 .. r - 3; two negative ints: no window, as in FlashAttention-2
    and -4). With causal the right side is 0 (right must
    be 0, -1 or None). Mistral / Qwen2: (4095, 0) with causal. k6, the decode stage (a few
    queries: only the window's kv tiles are read and split; sides >= 0, a negative one runs
    on k6) and kb2 (gradients at every head dim, deterministic too); compiled once per
    window size. A row that sees no key: zero output, LSE -inf.

    `sinks`: attention sinks (gpt-oss's `s_aux`), one logit per query head, a (heads,)
    fp32, bf16 or fp16 tensor on q's device: each row's softmax gets one more column with
    that logit (natural-log units, like the scaled scores; not scaled) and no value, so
    out_i = sum_j exp(s_ij) v_j / (sum_j exp(s_ij) + exp(sink_h)) and the LSE includes it; a
    row that sees no key: zero output, LSE the sink. k6 and the decode stage (runtime
    values: one compile for any), with windows and softcap; differentiable in q, k, v
    (kb2) and in the sinks (docs/sinks.md).
    """
    # ValueError before anything (the defaults, passed as they are, need no check)
    softcap = 0.0 if softcap is _NO_SOFTCAP else _check_softcap(softcap)
    window = _NO_WINDOW if window_size is _NO_WINDOW else normalize_window(window_size,
                                                                          bool(causal))
    try:
        qkv_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                or v.requires_grad)
        if sinks is not None:
            from hopper_attn.common.sinks import as_kernel_sinks
            sinks = as_kernel_sinks(sinks, q.shape[2], q.device)   # ValueError
    except AttributeError:                     # not tensors: the checks below say so
        qkv_grad = False
    needs_grad = qkv_grad or (sinks is not None and sinks.requires_grad
                              and torch.is_grad_enabled())
    compiling = torch.compiler.is_compiling()
    if qkv_grad and not compiling:             # (traced: the backward op checks)
        _check_differentiable(q, k, v, bool(causal), stage, bool(deterministic), softcap,
                              window)
    if compiling or (needs_grad and type(q) is not torch.Tensor):
        # the custom op: fake implementation, autograd (traced, fake or subclassed tensors)
        out, lse = torch.ops.hopper_attn.attention(q, k, v, bool(causal), softmax_scale,
                                                   stage or "", bool(deterministic), softcap,
                                                   *window, sinks)
    elif needs_grad:                           # eager autograd: no dispatcher round trips
        out, lse = _EagerAttention.apply(q, k, v, bool(causal), softmax_scale, stage or "",
                                         bool(deterministic), softcap, window, sinks)
    else:                                      # eager: no dispatcher round trip
        out, lse = _run(q, k, v, bool(causal), softmax_scale, stage or "", softcap, window,
                        sinks, want_lse=return_lse)
    return (out, lse) if return_lse else out


def attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                  softmax_scale: Optional[float] = None, rotate: bool = False,
                  return_lse: bool = False, out_dtype: torch.dtype = torch.bfloat16):
    """`attention` computed in FP8: q, k, v (bf16) quantized to e4m3 with one scale per
    (batch, head) on the GPU (`hopper_attn.quantize.quantize_fp8`, V packed for the kernel),
    then k7 (both GEMMs on FP8 WGMMA), output bf16. `rotate=True` runs k8 instead: Q and K
    rotated by a random-sign Hadamard matrix inside the quantizer, less error when a few
    head-dim channels are much larger than the rest (docs/k8.md).

    Same shapes, masks, GQA / cross-attention and LSE as `attention`; head_dim 64, 128 or
    256. Expect about 5% RMS error relative to the output (e4m3 keeps 3 mantissa bits;
    docs/k8.md measures it), against 0.2% in bf16. Forward only: inputs that require
    gradients are refused (no FP8 backward). ValueError before any launch otherwise.

    `out_dtype=torch.float8_e4m3fn`: the output in e4m3 too, returned as `(out8, descale_o)`
    with out = out8 * descale_o[:, None, :, None] (descale_o: fp32 (batch, heads), v's
    descale: the kernel keeps O in v8's units, which e4m3's range always holds); with
    `return_lse`, `(out8, descale_o, lse)`.
    """
    from hopper_attn import k7, k8
    _check(q, k, v)
    if {q.dtype, k.dtype, v.dtype} != {torch.bfloat16}:
        raise ValueError(f"attention_fp8 takes bf16 q, k, v (it quantizes them itself), got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise ValueError("attention_fp8 has no backward pass: call it under torch.no_grad() "
                         "or on tensors that do not require gradients (attention() for "
                         "training)")
    if out_dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        raise ValueError(f"attention_fp8 writes bf16 or float8_e4m3fn, not {out_dtype}")
    fp8_out = out_dtype == torch.float8_e4m3fn
    problem = Problem.from_tensor(q, bool(causal), k)
    entry = stages.get(("k8" if rotate else "k7") + (":out_fp8=1" if fp8_out else ""))
    entry.spec.check(problem)            # head dim, dtype (bf16): UnsupportedProblem
    check_tensors(problem, q, k, v, q, strided=True)     # bf16 on one CUDA device
    handle = _handle(entry, problem, _compile_options())
    # (the quantizer makes the scores' factor, softmax scale x descales, a power of two
    # for k7's fp16 scores: it needs the scale the kernel runs with)
    q8, k8_, v8, *descales = (k8 if rotate else k7).prepare_inputs(
        q, k, v, softmax_scale=softmax_scale)
    out, lse = torch.empty_like(q, dtype=out_dtype), _lse_like(q)
    run_attention(handle, q8, k8_, v8, out, softmax_scale, workspace=[lse],
                  extra_inputs=tuple(descales))
    result = (out, k7.output_descale(descales[-1], problem.heads)) if fp8_out else (out,)
    result += (lse,) if return_lse else ()
    return result[0] if len(result) == 1 else result


# --------------------------------------------------------------------------------------------
# Packed batches of variable-length sequences (docs/varlen.md)
# --------------------------------------------------------------------------------------------

def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                  seqused_k, window_size, softcap, sinks=None, on_device: bool = True):
    """Every check of a varlen call that reads no device memory; returns (batch, window,
    softcap). `sinks`: the kernel's form (fp32 (heads,) on q's device), as attention_varlen
    makes it."""
    from hopper_attn.common import varlen
    batch = varlen.check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, seqused_k)
    if sinks is not None:
        from hopper_attn.common.sinks import check_sinks
        check_sinks(sinks, q.shape[1], q.device)
    softcap = _check_softcap(softcap)
    window = normalize_window(window_size, bool(causal))
    for name, t in (("q", q), ("k", k), ("v", v)):
        unit = 16 // t.element_size()
        if t.stride(-1) != 1 or any(st % unit for st in t.stride()[:2]):
            raise ValueError(f"{name}: the head dim must be contiguous and the other strides "
                             f"multiples of 16 bytes, got strides {t.stride()}")
    if on_device and not q.is_cuda:
        raise ValueError(f"q, k, v are on {q.device}; the kernels run on a CUDA device")
    return batch, window, softcap


# Varlen calls that passed every check once, by everything the checks looked at except the
# data pointers -> (batch, compiled kernel, softmax scale)
_VARLEN_FAST: dict = {}


def _varlen_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                seqused_k, window, softcap, sinks=None):
    try:
        tensors = (q, k, v, cu_seqlens_q, cu_seqlens_k) + \
            (() if seqused_k is None else (seqused_k,)) + (() if sinks is None else (sinks,))
        return (tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors),
                seqused_k is None, max_seqlen_q, max_seqlen_k, causal, tuple(window),
                softcap, sinks is None)
    except (AttributeError, TypeError):          # not tensors: the checks say so
        return None


def _run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                causal: bool, softmax_scale: Optional[float], seqused_k, window: tuple,
                softcap: float, sinks: Optional[torch.Tensor] = None):
    from hopper_attn import k6_varlen
    key = _varlen_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      causal, seqused_k, window, softcap, sinks)
    try:
        fast = _VARLEN_FAST.get(key) if key is not None else None
    except TypeError:                          # (symbolic shapes do not hash)
        key = fast = None
    if fast is None:
        batch, window, softcap = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                               max_seqlen_q, max_seqlen_k, causal, seqused_k,
                                               window, softcap, sinks)
        problem = k6_varlen.problem_for(q, k, batch, max_seqlen_q, max_seqlen_k, causal,
                                        window)
        overrides = {"softcap": softcap} if softcap else {}
        compiled, _ = k6_varlen.compile_varlen(problem, seqused_k is not None,
                                               sinks=sinks is not None,
                                               **overrides)   # UnsupportedProblem: d, dtype
        fast = (batch, compiled, problem.softmax_scale)
        if key is not None:
            if len(_VARLEN_FAST) >= _FAST_LIMIT:
                _VARLEN_FAST.clear()
            _VARLEN_FAST[key] = fast
    batch, compiled, default_scale = fast
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16:
        raise ValueError("q, k, v must be 16-byte aligned")
    out = torch.empty_like(q)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    if batch == 0 or q.shape[0] == 0:
        return out, lse
    if k.shape[0] == 0:                        # no keys anywhere: every row is empty
        out.zero_()
        if sinks is None:
            lse.fill_(float("-inf"))
        else:                                  # (only the sink in each row's softmax)
            lse.copy_(sinks[:, None].expand_as(lse))
        return out, lse
    if sinks is not None and sinks.data_ptr() % 16:     # (a view: inputs are 16-byte aligned)
        sinks = sinks.clone()
    # (the kernel is compiled for 16-byte aligned tensors: a slice of a larger cu_seqlens
    # is copied, on the device)
    cu_seqlens_q, cu_seqlens_k, seqused_k = (
        t if t is None or (t.data_ptr() % 16 == 0 and t.is_contiguous()) else t.clone()
        for t in (cu_seqlens_q, cu_seqlens_k, seqused_k))
    scale = default_scale if softmax_scale is None else float(softmax_scale)
    k6_varlen.run_varlen(compiled, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                         scale, sinks)
    return out, lse


@torch.library.custom_op("hopper_attn::attention_varlen", mutates_args=())
def _attention_varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                         softmax_scale: Optional[float], seqused_k: Optional[torch.Tensor],
                         window_left: Optional[int] = None,
                         window_right: Optional[int] = None, softcap: float = 0.0,
                         sinks: Optional[torch.Tensor] = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    return _run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                       softmax_scale, seqused_k, (window_left, window_right), softcap, sinks)


@_attention_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
      seqused_k, window_left=None, window_right=None, softcap=0.0, sinks=None):
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                  seqused_k, (window_left, window_right), softcap, sinks, on_device=False)
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _varlen_backward(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                     max_seqlen_k: int, causal: bool, softmax_scale: Optional[float],
                     seqused_k, window: tuple, softcap: float):
    """dq, dk, dv of `attention_varlen` (laid out like q, k, v): the varlen backward (kb2,
    common/varlen_backward.py)."""
    from hopper_attn.common.varlen_backward import varlen_backward
    return varlen_backward(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, causal, softmax_scale, seqused_k, window, softcap)


def _varlen_backward_rows(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k,
                          max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                          softmax_scale: Optional[float], seqused_k, window: tuple,
                          softcap: float):
    """_varlen_backward's dq, dk, dv and the preprocess's D (heads, total_q) (for the sinks'
    gradient)."""
    from hopper_attn.common.varlen_backward import varlen_backward
    return varlen_backward(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, causal, softmax_scale, seqused_k, window, softcap,
                           return_d=True)


@torch.library.custom_op("hopper_attn::attention_varlen_backward", mutates_args=())
def _attention_varlen_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                                  cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                                  max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                                  softmax_scale: Optional[float],
                                  seqused_k: Optional[torch.Tensor],
                                  window_left: Optional[int] = None,
                                  window_right: Optional[int] = None, softcap: float = 0.0
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _varlen_backward(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, causal, softmax_scale, seqused_k,
                            (window_left, window_right), softcap)


@_attention_varlen_backward_op.register_fake
def _(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
      softmax_scale, seqused_k, window_left=None, window_right=None, softcap=0.0):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op("hopper_attn::attention_varlen_backward_sinks", mutates_args=())
def _attention_varlen_backward_sinks_op(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        dout: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
        softmax_scale: Optional[float], seqused_k: Optional[torch.Tensor],
        window_left: Optional[int] = None, window_right: Optional[int] = None,
        softcap: float = 0.0
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """attention_varlen_backward and the sinks' gradient from the backward's own D."""
    from hopper_attn.common.sinks import varlen_sink_grad
    dq, dk, dv, d_rows = _varlen_backward_rows(
        q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        causal, softmax_scale, seqused_k, (window_left, window_right), softcap)
    return dq, dk, dv, varlen_sink_grad(sinks, out, dout, lse, cu_seqlens_q, d_rows)


@_attention_varlen_backward_sinks_op.register_fake
def _(q, k, v, out, dout, lse, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      causal, softmax_scale, seqused_k, window_left=None, window_right=None, softcap=0.0):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(sinks))


def _setup_varlen_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
     seqused_k, window_left, window_right, softcap, sinks) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, sinks)
    ctx.args = (max_seqlen_q, max_seqlen_k, causal, softmax_scale)
    ctx.rest = (window_left, window_right, softcap)
    ctx.set_materialize_grads(False)


def _varlen_autograd(ctx, dout, dlse):
    if dout is None:
        return (None,) * 14
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, sinks = ctx.saved_tensors
    dq = dk = dv = dsinks = None
    if any(ctx.needs_input_grad[:3]) and sinks is not None and ctx.needs_input_grad[13]:
        # (the sinks' gradient from the preprocess's D: dO and O are not read again)
        dq, dk, dv, dsinks = torch.ops.hopper_attn.attention_varlen_backward_sinks(
            q, k, v, out, dout, lse, sinks, cu_seqlens_q, cu_seqlens_k, *ctx.args, seqused_k,
            *ctx.rest)
        return (dq, dk, dv) + (None,) * 10 + (dsinks,)
    if any(ctx.needs_input_grad[:3]):
        # (the LSE holds the sink: kb2's P = exp(S - LSE) is the sink-inclusive softmax)
        dq, dk, dv = torch.ops.hopper_attn.attention_varlen_backward(
            q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, *ctx.args, seqused_k,
            *ctx.rest)
    if sinks is not None and ctx.needs_input_grad[13]:
        from hopper_attn.common.sinks import varlen_sink_grad
        dsinks = varlen_sink_grad(sinks, out, dout, lse, cu_seqlens_q)
    return (dq, dk, dv) + (None,) * 10 + (dsinks,)


_attention_varlen_op.register_autograd(_varlen_autograd, setup_context=_setup_varlen_context)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                     softmax_scale: Optional[float] = None, return_lse: bool = False,
                     seqused_k: Optional[torch.Tensor] = None, window_size: tuple = (-1, -1),
                     softcap: float = 0.0, sinks: Optional[torch.Tensor] = None):
    """`attention` over a packed batch of variable-length sequences (flash_attn_varlen_func's
    convention): q (total_q, heads, head_dim), k and v (total_k, heads_kv, head_dim), sequence
    b at tokens cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q and cu_seqlens_k[b] ..
    cu_seqlens_k[b + 1] - 1 of k and v (int32 CUDA tensors of batch + 1 entries, starting at 0
    and non-decreasing). `seqused_k` (int32 (batch,)): sequence b uses only its first
    seqused_k[b] keys. max_seqlen_q / max_seqlen_k: python ints, at least the longest
    sequence's length (they pick the kernel's tiles, POLICY's row at that length; larger is
    allowed). Each sequence attends to its own keys only; the causal mask and a window are
    aligned bottom-right per sequence (query i of a sequence with n_q queries and n_k keys
    sees keys j <= i + n_k - n_q); a sequence may have no queries or no keys (zero output
    rows, LSE -inf). GQA/MQA, head dims, dtypes, softcap, windows and attention sinks
    (`sinks`: (heads,) fp32 / bf16 / fp16, one logit per query head; a row without keys then
    gets LSE the sink) as `attention` (k6; docs/sinks.md).

    Returns the output (total_q, heads, head_dim) and with `return_lse` also the LSE, fp32
    (heads, total_q). Tokens past cu_seqlens_q[-1] are not written.

    ValueError before any launch for what is visible without reading device memory: dtypes
    (cu_seqlens int32), devices, shapes, cu_seqlens_q and cu_seqlens_k of different lengths,
    seqused_k's shape, max_seqlen out of range, more queries than batch x max_seqlen_q,
    layouts. Not checked (it would need a device
    sync; nothing here reads cu_seqlens on the host, so the call can be captured in a CUDA
    graph): cu_seqlens_q[-1] == total_q and cu_seqlens_k[-1] <= total_k, offsets
    non-decreasing, lengths <= max_seqlen_*; breaking these reads or writes out of bounds.

    A torch custom op (`torch.ops.hopper_attn.attention_varlen`) with a fake implementation:
    torch.compile(fullgraph=True) traces through it. Differentiable at head dims 64, 96, 128,
    192 and 256 through `attention_varlen_backward` (the varlen backward; with sinks that
    needs a gradient `attention_varlen_backward_sinks`, the sinks' gradient from the backward's D).
    """
    window = normalize_window(window_size, bool(causal))
    softcap = _check_softcap(softcap)
    if sinks is not None and isinstance(q, torch.Tensor) and q.dim() == 3:
        from hopper_attn.common.sinks import as_kernel_sinks
        sinks = as_kernel_sinks(sinks, q.shape[1], q.device)     # ValueError; bf16 -> fp32
    if torch.compiler.is_compiling():          # (the fake implementation checks)
        checked = True
    else:
        checked = _varlen_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              bool(causal), seqused_k, window, softcap, sinks) in _VARLEN_FAST
    if not checked:
        # (before the op: its schema would refuse some arguments with a TypeError)
        _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                      seqused_k, window, softcap, sinks, on_device=False)
    out, lse = torch.ops.hopper_attn.attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, bool(causal),
        softmax_scale, seqused_k, *window, float(softcap), sinks)
    return (out, lse) if return_lse else out
