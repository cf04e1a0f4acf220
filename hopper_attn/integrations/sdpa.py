"""This project as a provider of torch SDPA's flash backend (torch >= 2.11).

    import hopper_attn.integrations.sdpa as hopper_sdpa
    hopper_sdpa.activate()                   # opt-in; importing this module changes nothing
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    hopper_sdpa.deactivate()                 # torch's own flash kernels again

The mechanism (torch/nn/attention/_registry.py): a provider registers a function under a
name with `torch.nn.attention.register_flash_attention_impl(name, register_fn=...)`;
`activate_flash_attention_impl(name)` first undoes the active provider, then calls that
function, which puts kernels into torch's dispatcher and returns a handle whose `remove()`
takes them out again (`restore_flash_attention_impl()`). torch ships one provider itself,
"FA4" (torch/nn/attention/_fa4.py), which overrides the CUDA kernels of five aten ops.

What this provider overrides: the CUDA kernels of the two ops SDPA's flash backend calls for
dense inputs, `aten::_scaled_dot_product_flash_attention` (forward: q, k, v as (batch,
heads, seqlen, head_dim); returns output, log-sum-exp and seven bookkeeping values) and
`aten::_scaled_dot_product_flash_attention_backward` (dq, dk, dv from grad_out, q, k, v,
out, lse). Both signatures have been stable across torch releases. The lower-level
`aten::_flash_attention_forward/backward` (torch's varlen_attn and nested tensors, whose
signatures change between releases) stay torch's own.

What reaches it: SDPA picks its flash backend only without an attn_mask, with head_dim <=
256 (padded to a multiple of 8, with the scale of the unpadded one), fp16/bf16, GQA/MQA (k
and v with fewer heads, `enable_gqa=True`), causal only with as many queries as keys; on
Hopper with cuDNN > 9.15, torch 2.11 prefers cuDNN attention, so select flash with
`sdpa_kernel(SDPBackend.FLASH_ATTENTION)` (or a priority list). Of those calls this project
runs head_dim 64, 96, 128, 192, 256 forward and backward, any length, GQA,
strided (B, H, N, d) tensors read in place, dropout 0. Everything else falls back, per call,
to torch's own flash kernel: the one this registration overrides, kept with
`torch.library.get_kernel` before overriding (dropout > 0, return_debug_mask, head_dim 80,
fp32 inputs, ...). Where torch has no `get_kernel` (< 2.9) or no
CUDA kernel to keep, such a call raises the ValueError that says why. A forward from one
side and a backward from the other combine correctly: both use the same natural-log LSE,
(batch, heads, seqlen_q) fp32. `counts()` says how many calls ran here and how many fell
back (and the last reason).

`torch.are_deterministic_algorithms_enabled()` selects this project's deterministic
backward (kb2, every head dim above).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Optional

import torch

NAME = "hopper_attn"
FORWARD_OP = "aten::_scaled_dot_product_flash_attention"
BACKWARD_OP = "aten::_scaled_dot_product_flash_attention_backward"

_COUNTS: collections.Counter = collections.Counter()
_LAST_FALLBACK: dict = {}


def available() -> bool:
    """Whether this torch has the provider registry (torch.nn.attention,
    register_flash_attention_impl: torch 2.11 on)."""
    import torch.nn.attention as attention_module
    return all(hasattr(attention_module, name) for name in (
        "register_flash_attention_impl", "activate_flash_attention_impl",
        "restore_flash_attention_impl", "current_flash_attention_impl"))


def counts() -> dict:
    """Calls since the last `reset_counts()`: forward / backward run here, forward_fallback /
    backward_fallback run by torch's kernel, with the last fallback's reason per direction."""
    return {**dict(_COUNTS), "last_fallback": dict(_LAST_FALLBACK)}


def reset_counts() -> None:
    _COUNTS.clear()
    _LAST_FALLBACK.clear()


def _original_kernel(op: str, dispatch_key: str = "CUDA"):
    """torch's current kernel of `op` for `dispatch_key` (a SafeKernelFunction), or None."""
    get_kernel = getattr(torch.library, "get_kernel", None)
    if get_kernel is None:
        return None
    try:
        return get_kernel(op, dispatch_key)
    except RuntimeError:                     # no such kernel (CUDA on a CPU-only build)
        return None


def _fallback(direction: str, original, reason: str, keyset, args, kwargs):
    _COUNTS[direction + "_fallback"] += 1
    _LAST_FALLBACK[direction] = reason
    if original is None:
        raise ValueError(f"hopper_attn's SDPA provider cannot run this {direction} call "
                         f"({reason}) and this torch offers no kernel to fall back to")
    return original.call_boxed(keyset, *args, **kwargs)


def bnhd(t: torch.Tensor) -> torch.Tensor:
    """SDPA's (batch, heads, seqlen, head_dim) as this project's (batch, seqlen, heads,
    head_dim): a view."""
    return t.transpose(1, 2)


def run_forward(query, key, value, dropout_p: float, is_causal: bool,
                return_debug_mask: bool, scale: Optional[float],
                attention: Optional[Callable] = None):
    """`_scaled_dot_product_flash_attention`'s outputs computed by `attention` (default
    `hopper_attn.attention`; a stand-in in the CPU tests), or ValueError (nothing
    launched) when it cannot run the call."""
    if dropout_p:
        raise ValueError(f"dropout_p={dropout_p}: hopper_attn has no dropout")
    if return_debug_mask:
        raise ValueError("return_debug_mask: hopper_attn returns no attention weights")
    if attention is None:     # below autograd already: attention()'s plain eager launch
        from hopper_attn.api import _run
        out, lse = _run(bnhd(query), bnhd(key), bnhd(value), bool(is_causal), scale, "")
    else:
        with torch.no_grad():
            out, lse = attention(bnhd(query), bnhd(key), bnhd(value), causal=bool(is_causal),
                                 softmax_scale=scale, return_lse=True)
    seed, offset, debug = _placeholders(query)
    # (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug mask)
    return (bnhd(out), lse, None, None, query.shape[2], key.shape[2], seed, offset, debug)


_PLACEHOLDERS: dict = {}


def _placeholders(query) -> tuple:
    """The RNG state (seed, offset) and the empty debug mask that the op returns: read only
    with dropout (which falls back to torch's kernel) and never written, so made once per
    device and dtype and returned by every call (three allocations fewer per call)."""
    key = (query.device, query.dtype)
    held = _PLACEHOLDERS.get(key)
    if held is None:
        held = _PLACEHOLDERS[key] = (
            torch.empty((2,), dtype=torch.uint64, device=query.device),
            torch.empty((), dtype=torch.uint64, device=query.device),
            torch.empty(0, dtype=query.dtype, device=query.device))
    return held


def run_backward(grad_out, query, key, value, out, logsumexp, dropout_p: float,
                 is_causal: bool, scale: Optional[float], backward: Optional[Callable] = None):
    """`_scaled_dot_product_flash_attention_backward`'s (dq, dk, dv), (batch, heads, seqlen,
    head_dim) like the inputs, by `backward` (default this project's backward op), or
    ValueError (nothing launched) when it cannot run the call."""
    if dropout_p:
        raise ValueError(f"dropout_p={dropout_p}: hopper_attn has no dropout")
    deterministic = torch.are_deterministic_algorithms_enabled()
    q, k, v, o, do = (bnhd(t) for t in (query, key, value, out, grad_out))
    if backward is None:                     # checks everything before a launch (cached)
        from hopper_attn.api import _backward_impl as backward
    dq, dk, dv = backward(q, k, v, o, do, logsumexp.contiguous(), bool(is_causal), scale,
                          deterministic)
    return bnhd(dq), bnhd(dk), bnhd(dv)


def _install(attention: Optional[Callable] = None, backward: Optional[Callable] = None,
             dispatch_key: str = "CUDA"):
    """The register_fn: override the two ops' CUDA kernels, keeping torch's as fallbacks.
    (`attention`, `backward`, `dispatch_key`: stand-ins and the CPU key for the CPU tests.)"""
    original_forward = _original_kernel(FORWARD_OP, dispatch_key)
    original_backward = _original_kernel(BACKWARD_OP, dispatch_key)

    def forward_impl(keyset, query, key, value, dropout_p=0.0, is_causal=False,
                     return_debug_mask=False, *, scale=None):
        try:
            result = run_forward(query, key, value, dropout_p, is_causal, return_debug_mask,
                                 scale, attention)
        except ValueError as exc:
            return _fallback("forward", original_forward, str(exc), keyset,
                             (query, key, value, dropout_p, is_causal, return_debug_mask),
                             {"scale": scale})
        _COUNTS["forward"] += 1
        return result

    def backward_impl(keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q,
                      cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed,
                      philox_offset, *, scale=None):
        try:
            result = run_backward(grad_out, query, key, value, out, logsumexp, dropout_p,
                                  is_causal, scale, backward)
        except ValueError as exc:
            return _fallback("backward", original_backward, str(exc), keyset,
                             (grad_out, query, key, value, out, logsumexp, cum_seq_q,
                              cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed,
                              philox_offset), {"scale": scale})
        _COUNTS["backward"] += 1
        return result

    library = torch.library.Library("aten", "IMPL", dispatch_key)  # noqa: TOR901
    library.impl(FORWARD_OP.split("::")[1], forward_impl, dispatch_key, with_keyset=True)
    library.impl(BACKWARD_OP.split("::")[1], backward_impl, dispatch_key, with_keyset=True)
    return _Handle(library, original_forward is not None and original_backward is not None)


@dataclasses.dataclass
class _Handle:
    """What activation returns to torch's registry: `remove()` takes the kernels out."""
    library: Optional[torch.library.Library]
    has_fallback: bool

    def remove(self) -> None:
        if self.library is not None:
            destroy = getattr(self.library, "_destroy", None)
            if destroy is not None:
                destroy()
            self.library = None


def _require_registry() -> None:
    if not available():
        raise RuntimeError(f"torch {torch.__version__} has no flash-attention provider "
                           "registry (torch.nn.attention.register_flash_attention_impl, "
                           "torch 2.11 on): call hopper_attn.attention directly")


def register(name: str = NAME) -> str:
    """Add this project to torch's flash-attention providers under `name`, without activating
    it (what a library does on import in torch's design; this one waits to be asked).
    RuntimeError where torch has no registry. Returns `name`."""
    _require_registry()
    from torch.nn.attention import register_flash_attention_impl
    register_flash_attention_impl(name, register_fn=_install)
    return name


def activate(name: str = NAME) -> None:
    """Register (if needed) and activate: from now on SDPA's flash backend runs this
    project's kernels (with torch's own as the per-call fallback)."""
    register(name)
    from torch.nn.attention import activate_flash_attention_impl
    activate_flash_attention_impl(name)


def deactivate() -> None:
    """torch's own flash kernels again, if this provider is the active one."""
    _require_registry()
    from torch.nn.attention import current_flash_attention_impl, restore_flash_attention_impl
    if current_flash_attention_impl() == NAME:
        restore_flash_attention_impl()


def is_active() -> bool:
    if not available():
        return False
    from torch.nn.attention import current_flash_attention_impl
    return current_flash_attention_impl() == NAME
