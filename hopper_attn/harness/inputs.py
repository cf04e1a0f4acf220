"""Random inputs (normal, bf16) and a NaN-poisoned output buffer."""

from __future__ import annotations

import torch

from hopper_attn.common.contract import Problem


def make_inputs(problem: Problem, seed: int, scale: float = 1.0, device: str = "cuda"):
    """q, k, v ~ N(0, scale^2) in the problem's dtype, fresh for every call; out = NaN.

    The output starts as NaN so that any element the kernel does not write fails the check.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    shape = problem.shape
    q, k, v = (
        (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale).to(problem.dtype)
        for _ in range(3)
    )
    out = torch.full(shape, float("nan"), dtype=problem.dtype, device=device)
    return q, k, v, out
