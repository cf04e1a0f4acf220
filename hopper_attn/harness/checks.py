"""One correctness check: fresh random inputs inside NaN guards, NaN-poisoned output, fp32
reference, verdict; plus: nothing written outside `out`, and a second run gives the same bits."""

from __future__ import annotations

import torch

from .inputs import guards_intact, make_inputs
from .reference import error_stats, judge, reference_attention, torch_lowp_attention


class ReferenceCase:
    """Inputs for one problem plus the fp32 reference and torch's bf16 error on them."""

    def __init__(self, problem, seed: int, scale: float = 1.0):
        self.problem = problem
        self.q, self.k, self.v, self.out, self.buffers = make_inputs(problem, seed, scale,
                                                                      with_buffers=True)
        self.ref = reference_attention(self.q, self.k, self.v, problem.causal)
        self.torch_err = error_stats(torch_lowp_attention(self.q, self.k, self.v, problem.causal),
                                     self.ref)

    def check(self, entry, handle) -> dict:
        self.out.fill_(float("nan"))
        entry.run(handle, self.q, self.k, self.v, self.out)
        torch.cuda.synchronize()
        verdict = judge(error_stats(self.out, self.ref), self.torch_err, self.ref)
        first = self.out.clone()
        self.out.fill_(float("nan"))
        entry.run(handle, self.q, self.k, self.v, self.out)
        torch.cuda.synchronize()
        # bitwise: compare the raw 16-bit patterns (NaN != NaN as floats)
        verdict["same_bits"] = bool(torch.equal(first.view(torch.int16), self.out.view(torch.int16)))
        verdict["guards_intact"] = all(guards_intact(b) for b in self.buffers)
        verdict["ok"] = verdict["ok"] and verdict["same_bits"] and verdict["guards_intact"]
        return verdict
