"""FP8 error with and without outlier channels: k7 (quantized as is) vs k8 (Q and K rotated
first) vs k7 with an e4m3 output (out_fp8) vs cuDNN's FP8 attention (e4m3 output) vs torch's
bf16 SDPA, all on the same bf16 inputs.

    python -m hopper_attn.harness.fp8_error --json results/h100/DATE_fp8_error.json

Inputs: q, k, v ~ N(0, 1), and in k a few head-dim channels (the same ones in every head)
multiplied by `factor` (1: none, 10, 100): the outlier channels activations often have.
Every output is compared with the fp32 reference on the bf16 inputs (end to end: input
quantization included): max abs error and RMS error relative to the reference's RMS.
Also the cost of the input passes (quantize; rotate + quantize) next to the kernel's time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

OUTLIER_CHANNELS = (3, 17, 40, 61)          # < 64, so every head dim has them
FACTORS = (1.0, 10.0, 100.0)


def _errors(out, ref) -> dict:
    diff = (out.float() - ref).nan_to_num(float("inf"))
    return {"max_abs": float(diff.abs().max()),
            "rms_rel": float(diff.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()),
            "nan": int(out.isnan().sum())}


def main(argv=None) -> int:
    import torch
    from hopper_attn.common.contract import Problem
    from hopper_attn.harness import baselines
    from hopper_attn.harness.env import environment
    from hopper_attn.harness.reference import reference_attention, torch_lowp_attention
    from hopper_attn.harness import registry
    from hopper_attn.harness.timing import benchmark
    from hopper_attn import k8
    from hopper_attn.quantize import quantize_fp8

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args(argv)
    found, _ = baselines.available(["cudnn_fp8"])
    cudnn_fp8 = found.get("cudnn_fp8")
    rows = []
    for d in (64, 128, 256):
        for causal in (False, True):
            problem = Problem(args.batch, args.heads, args.seqlen, d, causal)
            gen = torch.Generator(device="cuda").manual_seed(d + causal)
            for factor in FACTORS:
                q, k, v = (torch.randn(problem.shape, device="cuda", generator=gen)
                           for _ in range(3))
                k[..., list(OUTLIER_CHANNELS)] *= factor
                q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
                ref = reference_attention(q, k, v, causal)
                row = {"head_dim": d, "causal": causal, "factor": factor,
                       "config": problem.as_dict(),
                       "torch_bf16": _errors(torch_lowp_attention(q, k, v, causal), ref)}
                for name in ("k7", "k8", "k7:out_fp8=1"):
                    entry = registry.get(name)
                    handle = entry.compile(problem)
                    out = entry.output_for(handle, torch.full(
                        problem.shape, float("nan"), dtype=torch.bfloat16, device="cuda"))
                    inputs = entry.prepare(q, k, v)
                    entry.run(handle, *inputs, out)
                    torch.cuda.synchronize()
                    row[name] = _errors(entry.output_as_float(out, inputs[3:]), ref)
                if cudnn_fp8 is not None:
                    cudnn_fp8.prepare(q, k, v, causal)()
                    torch.cuda.synchronize()
                    row["cudnn_fp8"] = _errors(cudnn_fp8.output(), ref)
                rows.append(row)
                print(f"d={d} causal={int(causal)} x{factor:g}: " + "  ".join(
                    f"{m} {row[m]['rms_rel']:.2e}/{row[m]['max_abs']:.3f}"
                    for m in ("torch_bf16", "k7", "k8", "k7:out_fp8=1", "cudnn_fp8") if m in row),
                    flush=True)
    # the input passes, next to the kernel (B1 H16 N16384 d128, the sweep's largest)
    problem = Problem(1, 16, 16384, 128)
    q, k, v = (torch.randn(problem.shape, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    out = torch.empty_like(q)
    costs = {"config": problem.as_dict()}
    for name in ("k7", "k8"):
        entry = registry.get(name)
        handle = entry.compile(problem)
        inputs = entry.prepare(q, k, v)
        costs[f"{name}_prepare_ms"] = benchmark(lambda: entry.prepare(q, k, v))["ms"]
        costs[f"{name}_kernel_ms"] = benchmark(lambda: entry.run(handle, *inputs, out))["ms"]
    # k7's inputs through torch's ops (quantize_fp8(fused=False), the reference) and
    # through the GPU quantizer (common/fp8_quantize.py, what prepare_inputs uses on a GPU)
    costs["k7_prepare_torch_ms"] = benchmark(
        lambda: (quantize_fp8(q, k, fused=False), quantize_fp8(v, pack_v=True, fused=False)))["ms"]
    costs["k7_prepare_fused_ms"] = benchmark(
        lambda: (quantize_fp8(q, k, fused=True), quantize_fp8(v, pack_v=True, fused=True)))["ms"]
    signs = k8.signs(problem.head_dim).cuda()               # k8's, with the rotation fused
    costs["k8_prepare_torch_ms"] = benchmark(
        lambda: (quantize_fp8(q, k, fused=False, rotate_signs=signs),
                 quantize_fp8(v, pack_v=True, fused=False)))["ms"]
    costs["k8_prepare_fused_ms"] = benchmark(
        lambda: (quantize_fp8(q, k, fused=True, rotate_signs=signs),
                 quantize_fp8(v, pack_v=True, fused=True)))["ms"]
    print("input passes:", json.dumps(costs))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"env": environment(), "command": " ".join(sys.argv),
                       "outlier_channels": OUTLIER_CHANNELS, "rows": rows, "costs": costs},
                      f, separators=(",", ":"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
