"""Per-call cost of attention() on tiny problems, where the host side dominates, against
FlashAttention-4 and torch SDPA in the same process.

    python -m hopper_attn.harness.overhead [--json results/h100/overhead.json]

For each problem and op: wall time of 200 back-to-back calls (after 20 warm-up calls),
divided by 200. On problems this small the GPU finishes each kernel before the host has
issued the next one, so this is the host time per call (argument checks, dispatch, launch).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

PROBLEMS = [(1, 128, 16, 128, False), (1, 128, 16, 128, True), (4, 256, 8, 64, False)]


def per_call_us(fn, calls: int = 200) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import hopper_attn
    from hopper_attn.harness import baselines
    from hopper_attn.harness.env import environment
    found, missing = baselines.available()
    rows = []
    for b, n, h, d, causal in PROBLEMS:
        q, k, v = (torch.randn(b, n, h, d, device="cuda").to(torch.bfloat16) for _ in range(3))
        fns = {"hopper_attn.attention": lambda: hopper_attn.attention(q, k, v, causal=causal)}
        for name, fn in found.items():
            fns[name] = (lambda fn=fn: fn(q, k, v, causal))
        for name, fn in fns.items():
            us = per_call_us(fn)
            rows.append({"op": name, "config": {"batch": b, "seqlen": n, "heads": h,
                                                "head_dim": d, "causal": causal},
                         "us_per_call": round(us, 2)})
            print(f"B{b} N{n} H{h} d{d} {'causal' if causal else 'full':6} {name:22} "
                  f"{us:8.2f} us/call")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": environment(), "command": "python " + " ".join(sys.argv),
                       "baselines_missing": missing, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
