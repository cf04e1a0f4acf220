"""Run one kernel once on one small problem and check it: the target for compute-sanitizer.

    compute-sanitizer --tool racecheck python -m hopper_attn.harness.run_once k3_2 --seqlen 200
    compute-sanitizer --tool synccheck python -m hopper_attn.harness.run_once k4 --seqlen 300 --causal
    compute-sanitizer --tool racecheck python -m hopper_attn.harness.run_once kb1 --seqlen 300

The reference is computed on the CPU so that the sanitizer only watches the kernel under
test (and the few torch copies around it).
"""

from __future__ import annotations

import argparse
import sys

import torch

from hopper_attn.harness import registry
from hopper_attn.harness.reference import reference_attention
from hopper_attn.common.contract import Problem


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=200)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    entry = registry.get(args.kernel)
    problem = Problem(args.batch, args.heads, args.seqlen, args.head_dim, args.causal)
    gen = torch.Generator().manual_seed(args.seed)
    q, k, v = (torch.randn(problem.shape, generator=gen).to(torch.bfloat16) for _ in range(3))
    if args.kernel.split(":")[0] in registry.BACKWARD_KERNELS:
        return _backward(entry, problem, q, k, v, gen)
    ref = reference_attention(q, k, v, problem.causal)
    handle = entry.compile(problem)
    qd, kd, vd = (t.cuda() for t in (q, k, v))
    out = torch.full(problem.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    out = entry.output_for(handle, out)                     # (k7:out_fp8=1: e4m3)
    inputs = entry.prepare(qd, kd, vd)                      # k7: FP8 inputs, descales
    entry.run(handle, *inputs, out)
    torch.cuda.synchronize()
    out = entry.output_as_float(out, inputs[3:])
    err = (out.cpu() - ref).abs()
    worst = float(err.nan_to_num(float("inf")).max())
    print(f"{entry.name} {problem.label()}: max abs error {worst:.3g}, NaN {int(out.isnan().sum())}")
    # (FP8 inputs: e4m3's 3 mantissa bits put the end-to-end error near 0.1-0.2 here)
    return 0 if worst < (0.25 if entry.spec.input_dtype is not None else 0.05) else 1


def _backward(entry, problem, q, k, v, gen) -> int:
    """A backward stage: o and the LSE from the fp32 reference, gradients checked against
    the fp32 reference backward (all on the CPU)."""
    from hopper_attn.harness.reference_backward import attention_backward, forward_with_lse
    do = torch.randn(problem.shape, generator=gen).to(torch.bfloat16)
    o, lse = forward_with_lse(q, k, v, problem.causal)
    o = o.to(torch.bfloat16)
    refs = attention_backward(q, k, v, o, lse, do, problem.causal)
    handle = entry.compile(problem)
    dev = [t.cuda() for t in (q, k, v, o, do, lse)]
    grads = [torch.full(t.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
             for t in (q, k, v)]
    entry.run(handle, *dev, *grads)
    torch.cuda.synchronize()
    worst = max(float((g.float().cpu() - r).abs().nan_to_num(float("inf")).max())
                for g, r in zip(grads, refs))
    nan = sum(int(g.isnan().sum()) for g in grads)
    print(f"{entry.name} {problem.label()}: max abs error (dq, dk, dv) {worst:.3g}, NaN {nan}")
    # (FP8 inputs: e4m3's 3 mantissa bits put the end-to-end error near 0.1-0.2 here)
    return 0 if worst < (0.25 if entry.spec.input_dtype is not None else 0.05) else 1


if __name__ == "__main__":
    sys.exit(main())
