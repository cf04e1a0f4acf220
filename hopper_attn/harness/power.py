"""Sustained speed at the board's power limit: each kernel or baseline runs back to back for a
few seconds while `nvidia-smi` samples the SM clock, the power draw and the clock-event
reasons (0x4: the software power cap).

    python -m hopper_attn.harness.power k7 cudnn_fp8 --head-dim 128 --seqlen 4096,16384 \\
        [--causal] [--seconds 3] [--json results/h100/power.json]

`bench.py` times single launches with the L2 flushed in between (the GPU idles a little
before each), so its numbers sit a few percent above these. Under a sustained load an H100
SXM stays at its 700 W limit for every kernel of this repository, FA4 and cuDNN alike, and
the clock settles where the kernel's power meets it (1455-1830 MHz on 2026-11-26,
docs/lab/k7.md "At the power limit"): TFLOP/s per GHz says what a kernel does per clock, the
clock what its work costs in power. Shapes as the benchmark's sweep (harness/problems.py:
16k tokens, hidden size 2048).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

SMI_FIELDS = "clocks.sm,power.draw,clocks_event_reasons.active"


def shape(seqlen: int, head_dim: int) -> tuple:
    """(batch, heads) of the benchmark's sweep for this length and head dim."""
    from hopper_attn.harness.problems import HIDDEN, TOKENS
    return max(1, TOKENS // seqlen), max(1, HIDDEN // head_dim)


def summarize(lines: list, skip_fraction: float = 1 / 3) -> dict:
    """nvidia-smi samples ('MHz, W, reasons' per line) -> medians of the settled part (the
    first third dropped: the clock takes a moment to come down to the limit)."""
    rows = [[field.strip() for field in line.split(",")] for line in lines if line.strip()]
    rows = [r for r in rows if len(r) == 3]
    settled = rows[int(len(rows) * skip_fraction):] or rows
    if not settled:
        return {"clock_mhz": None, "power_w": None, "reasons": [], "samples": 0}
    return {"clock_mhz": statistics.median(float(r[0]) for r in settled),
            "power_w": statistics.median(float(r[1]) for r in settled),
            "reasons": sorted({r[2] for r in settled}), "samples": len(settled)}


def sustained(run, seconds: float) -> tuple:
    """Launch `run` back to back for `seconds` with nvidia-smi sampling every 100 ms:
    (ms per call from CUDA events, the `summarize`d samples)."""
    import torch
    for _ in range(10):
        run()
    torch.cuda.synchronize()
    time.sleep(1.0)                                     # start from a cool, idle board
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}",
                            "--format=csv,noheader,nounits", "-lms", "100"],
                           stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, t0 = 0, time.time()
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(20):
            run()
        calls += 20
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    samples = summarize(smi.communicate()[0].splitlines())
    return start.elapsed_time(end) / calls, samples


def make_run(name: str, problem, q, k, v, found: dict):
    """A callable that runs kernel `name` (a registry name) or baseline `name` once."""
    import torch
    if name in found:
        from hopper_attn.harness.baselines import runner
        return runner(found[name], q, k, v, problem.causal)
    from hopper_attn.harness import registry
    entry = registry.get(name)
    handle = entry.compile(problem)
    inputs = entry.prepare(q, k, v)
    out = entry.output_for(handle, torch.empty_like(q))      # (k7:out_fp8=1: e4m3)
    return lambda: entry.run(handle, *inputs, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="+", help="kernels (k7, k7:option=1) or baselines (fa4, ...)")
    ap.add_argument("--head-dim", default="128")
    ap.add_argument("--seqlen", default="16384")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import torch

    from hopper_attn.common.contract import Problem
    from hopper_attn.harness import baselines
    from hopper_attn.harness.env import environment
    from hopper_attn.harness.registry import KERNELS
    from hopper_attn.harness.timing import tflops as to_tflops

    wanted = [n for n in args.names if n.partition(":")[0] not in KERNELS]
    found, missing = baselines.available(wanted)
    for name, why in missing.items():
        print(f"{name}: not available ({why})", file=sys.stderr)
    rows = []
    for d in (int(x) for x in args.head_dim.split(",")):
        for n in (int(x) for x in args.seqlen.split(",")):
            batch, heads = shape(n, d)
            q, k, v = (torch.randn(batch, n, heads, d, device="cuda").to(torch.bfloat16)
                       for _ in range(3))
            problem = Problem.from_tensor(q, args.causal)
            for name in args.names:
                if name in missing:
                    continue
                ms, smi = sustained(make_run(name, problem, q, k, v, found), args.seconds)
                tflops = to_tflops(problem.flops, ms)
                row = {"name": name, "batch": batch, "heads": heads, "seqlen": n,
                       "head_dim": d, "causal": args.causal, "ms": ms, "tflops": tflops,
                       "tflops_per_ghz": tflops / smi["clock_mhz"] * 1e3
                       if smi["clock_mhz"] else None, **smi}
                rows.append(row)
                print(f"{name:14s} d{d} N{n} {'causal' if args.causal else 'full'}: "
                      f"{tflops:6.1f} TFLOP/s at {smi['clock_mhz']:.0f} MHz, "
                      f"{smi['power_w']:.0f} W, {row['tflops_per_ghz']:.1f} TFLOP/s per GHz, "
                      f"reasons {','.join(smi['reasons'])}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": environment(), "seconds": args.seconds, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
