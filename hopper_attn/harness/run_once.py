"""Run one kernel once on one small problem and check it: the target for compute-sanitizer.

    compute-sanitizer --tool racecheck python -m hopper_attn.harness.run_once k3_2 --seqlen 200
    compute-sanitizer --tool synccheck python -m hopper_attn.harness.run_once k4 --seqlen 300 --causal

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
    ref = reference_attention(q, k, v, problem.causal)
    handle = entry.compile(problem)
    qd, kd, vd = (t.cuda() for t in (q, k, v))
    out = torch.full(problem.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    entry.run(handle, qd, kd, vd, out)
    torch.cuda.synchronize()
    err = (out.float().cpu() - ref).abs()
    worst = float(err.nan_to_num(float("inf")).max())
    print(f"{entry.name} {problem.label()}: max abs error {worst:.3g}, NaN {int(out.isnan().sum())}")
    return 0 if worst < 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
