"""One correctness check: fresh random inputs, NaN-poisoned output, fp32 reference, verdict."""

from __future__ import annotations

import torch

from .inputs import make_inputs
from .reference import error_stats, judge, reference_attention, torch_bf16_attention


class ReferenceCase:
    """Inputs for one problem plus the fp32 reference and torch's bf16 error on them."""

    def __init__(self, problem, seed: int, scale: float = 1.0):
        self.problem = problem
        self.q, self.k, self.v, self.out = make_inputs(problem, seed, scale)
        self.ref = reference_attention(self.q, self.k, self.v, problem.causal)
        self.torch_err = error_stats(torch_bf16_attention(self.q, self.k, self.v, problem.causal),
                                     self.ref)

    def check(self, entry, handle) -> dict:
        self.out.fill_(float("nan"))
        entry.run(handle, self.q, self.k, self.v, self.out)
        torch.cuda.synchronize()
        return judge(error_stats(self.out, self.ref), self.torch_err, self.ref)
