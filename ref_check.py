"""Randomized correctness sweep against an fp32 reference.

    python ref_check.py k2 k3_1 k4 kb1 [--seed 0] [--quick] [--json PATH]

For every supported dtype and head dim, causal off and on, odd and even sequence lengths (1, 17, 64,
113, 128, 1000, 2049), batch 2 x heads 3, plus large-magnitude inputs: fresh random normal
inputs per case, each tensor inside a buffer whose neighbouring memory is NaN, output
poisoned with NaN, error vs fp32 compared with torch's own bf16 SDPA error on the same
inputs (fp16 kernels: torch's fp16 error); the NaN guards must be untouched and a second run must give the same bits.
Backward stages (kb1, ...) get the same sweep plus cross-attention (seqlen_k != seqlen_q) and
GQA cases, checked per gradient (harness/grad_check.py).
Exits 1 and prints the failing configs if any case fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from hopper_attn.harness import registry
from hopper_attn.common.contract import Problem

SEQLENS = (1, 17, 64, 113, 128, 1000, 2049)
QUICK_SEQLENS = (1, 113, 1000)
BATCH, HEADS = 2, 3


def cases(entry, quick: bool):
    """(problem, input scale) pairs for one kernel."""
    head_dims = [d for d in entry.spec.head_dims]
    env_d = os.environ.get("HEADDIM")
    if env_d:
        head_dims = [d for d in head_dims if str(d) in env_d.split(",")]
    out = []
    for dtype in entry.spec.dtypes:
        for d in head_dims:
            for causal in (False, True):
                for n in (QUICK_SEQLENS if quick else SEQLENS):
                    out.append((Problem(BATCH, HEADS, n, d, causal, dtype), 1.0))
                # large scores (std ~ 16 before scaling): the online softmax must not overflow
                out.append((Problem(1, 2, 257, d, causal, dtype), 4.0))
    if entry.name.split(":")[0] in registry.BACKWARD_KERNELS:
        for dtype in entry.spec.dtypes:
            for d in head_dims:
                for causal in (False, True):
                    for nq, nk in ((300, 1000), (1000, 300)):     # a KV prefix, and the reverse
                        out.append((Problem(2, 2, nq, d, causal, dtype, seqlen_k=nk), 1.0))
                    out.append((Problem(2, 6, 257, d, causal, dtype, heads_kv=2), 1.0))  # GQA
    return out


def check_kernel(entry, seed: int, quick: bool = False) -> list[dict]:
    from hopper_attn.harness.checks import ReferenceCase
    from hopper_attn.harness.grad_check import BackwardCase
    backward = entry.name.split(":")[0] in registry.BACKWARD_KERNELS
    results = []
    for i, (problem, scale) in enumerate(cases(entry, quick)):
        row = {"kernel": entry.name, "config": problem.as_dict(), "input_scale": scale}
        reason = entry.spec.unsupported_reason(problem)
        if reason:
            results.append({**row, "skipped": reason})
            continue
        case = (BackwardCase if backward else ReferenceCase)(problem, seed * 1000 + i, scale)
        try:
            handle = entry.compile(problem)
            if backward and dict(entry.options).get("deterministic"):
                results.append({**row, **case.check(entry, handle, deterministic=True)})
            else:
                results.append({**row, **case.check(entry, handle)})
        except Exception as exc:  # noqa: BLE001
            results.append({**row, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:1000]})
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernels", nargs="+")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="fewer sequence lengths")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("ref_check needs a CUDA GPU; on a CPU machine use: python bench.py <kernels> --compile-only")
        return 2
    all_rows, failed = [], []
    for entry in registry.resolve(args.kernels):
        rows = check_kernel(entry, args.seed, args.quick)
        worst = max((r.get("error_ratio", 0.0) for r in rows if "error_ratio" in r), default=0.0)
        bad = [r for r in rows if not r.get("skipped") and not r.get("ok")]
        print(f"{entry.name:7} {len(rows) - len(bad)}/{len(rows)} cases pass, "
              f"worst error / torch bf16 error = {worst:.2f}")
        for r in bad:
            c = r["config"]
            if "dq" in r:                                  # a backward case
                print(f"   FAIL {c}: " + ", ".join(
                    f"{g} max_abs={r[g]['max_abs']:.3g} torch={r[g]['torch_max_abs']:.3g} "
                    f"nan={r[g]['nan']}" for g in ("dq", "dk", "dv"))
                      + f" same_bits={r['same_bits']} guards_intact={r['guards_intact']}")
                continue
            print(f"   FAIL {c['dtype']} B={c['batch']} H={c['heads']} N={c['seqlen']} d={c['head_dim']} "
                  f"causal={c['causal']} scale={r['input_scale']}: "
                  + (r.get("error") or f"max_abs={r['max_abs']:.3g} torch={r['torch_max_abs']:.3g} "
                     f"nan={r['nan']} same_bits={r.get('same_bits')} "
                     f"guards_intact={r.get('guards_intact')}"))
        all_rows += rows
        failed += bad
    if args.json:
        from hopper_attn.harness.env import environment
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"env": environment(), "command": " ".join(sys.argv), "rows": all_rows}, f, separators=(",", ":"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
