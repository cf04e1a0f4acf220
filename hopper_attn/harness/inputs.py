"""Random inputs (normal, bf16) and a NaN-poisoned output buffer, each inside NaN guards."""

from __future__ import annotations

import math

import torch

from hopper_attn.common.contract import Problem

# Elements of NaN before and after every tensor (16 KiB of bf16 on each side, a multiple of
# 16 bytes so the tensor itself stays 16-byte aligned). A kernel that reads past the end of
# q, k or v reads NaN and fails the check; one that writes past `out` changes a guard.
GUARD = 8192


E4M3_NAN_BYTE = 0x7F                  # e4m3's NaN (torch has no NaN fill for fp8)


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill t with NaN, byte-wise for e4m3; returns t."""
    if t.dtype == torch.float8_e4m3fn:
        t.view(torch.uint8).fill_(E4M3_NAN_BYTE)
    else:
        t.fill_(float("nan"))
    return t


def guarded_empty(shape, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): a contiguous `shape` view in the middle of a NaN-filled buffer."""
    numel = math.prod(shape)
    buffer = poison(torch.empty((numel + 2 * GUARD,), dtype=dtype, device=device))
    return buffer, buffer[GUARD:GUARD + numel].view(shape)


def guarded_like(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`guarded_empty` with t's shape, dtype and strides (e.g. k7's sequence-major, padded
    v); padding between rows stays NaN like the guards."""
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    buffer, flat = guarded_empty((span,), t.dtype, t.device)
    return buffer, flat.as_strided(t.shape, t.stride())


def guards_intact(buffer: torch.Tensor) -> bool:
    """True if the NaN guards around the tensor in `buffer` are untouched."""
    if buffer.dtype == torch.float8_e4m3fn:
        raw = buffer.view(torch.uint8)
        return bool((raw[:GUARD] == E4M3_NAN_BYTE).all() and
                    (raw[-GUARD:] == E4M3_NAN_BYTE).all())
    return bool(buffer[:GUARD].isnan().all() and buffer[-GUARD:].isnan().all())


def make_inputs(problem: Problem, seed: int, scale: float = 1.0, device: str = "cuda",
                with_buffers: bool = False):
    """q, k, v ~ N(0, scale^2) in the problem's dtype, fresh for every call; out = NaN.

    The output starts as NaN so that any element the kernel does not write fails the check.
    Each tensor is a view into a larger buffer whose neighbouring memory holds NaN; with
    `with_buffers`, the four buffers are returned too (for `guards_intact`).
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    shapes = (problem.shape, problem.kv_shape, problem.v_shape, problem.out_shape)
    buffers, tensors = [], []
    for i, shape in enumerate(shapes):
        buffer, view = guarded_empty(shape, problem.dtype, device)
        if i < 3:
            view.copy_(torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale)
        buffers.append(buffer)
        tensors.append(view)
    return (*tensors, buffers) if with_buffers else tuple(tensors)
