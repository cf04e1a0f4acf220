"""Where a generation step's host time goes, per attention implementation (issue 59).

    python tools/generate_profile.py [--impls sdpa,hopper_attn,sdpa_provider] [--steps 32]

The models harness's Llama-shaped model (hopper_attn/harness/models.py: 8 layers, 16 / 4
heads of 128, random bf16 weights), a 2k-token prompt, then `--steps` greedy steps under
torch.profiler (CPU activity only): wall time per step, host synchronizations per step
(cudaStreamSynchronize, cudaDeviceSynchronize, cudaMemcpy(Async) device to host), launches
per step, and the ops with the most self CPU time. JSON: $OUT/generate_profile.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaMemcpy",
         "cudaEventSynchronize")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def main(argv=None) -> int:
    from hopper_attn.harness import models as hm
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impls", default="sdpa,hopper_attn,sdpa_provider")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    shape = dict(hm.DEFAULT)
    model = hm.build_model(**shape, seqlen=args.prompt + args.steps + 8).eval()
    impls, _ = hm.implementations(model, [s for s in args.impls.split(",") if s])
    ids = torch.randint(0, shape["vocab"], (1, args.prompt), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    kwargs = dict(do_sample=False, use_cache=True, attention_mask=torch.ones_like(ids))
    result = {"env": hm._versions(), "shape": shape, "prompt": args.prompt,
              "steps": args.steps, "impls": {}}
    for name, impl in impls.items():
        hm.select(model, name, impl)

        def gen(n):
            with torch.no_grad(), hm.backend_context(name):
                return model.generate(ids, max_new_tokens=n, **kwargs)
        gen(args.steps)
        gen(1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gen(1)
        torch.cuda.synchronize()
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        gen(args.steps)
        torch.cuda.synchronize()
        plain = time.perf_counter() - t0
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            gen(args.steps)
            torch.cuda.synchronize()
        events = prof.key_averages()
        per_step = lambda n: n / args.steps                              # noqa: E731
        syncs = {e.key: per_step(e.count) for e in events if e.key in SYNCS}
        launches = sum(e.count for e in events if e.key in LAUNCHES)
        top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:args.top]
        row = {"ms_per_step": (plain - prefill) / (args.steps - 1) * 1e3,
               "syncs_per_step": syncs, "launches_per_step": per_step(launches),
               "top_self_cpu_us_per_step": [(e.key, per_step(e.self_cpu_time_total),
                                             per_step(e.count)) for e in top]}
        result["impls"][name] = row
        print(f"{name:14s} {row['ms_per_step']:.2f} ms/step, launches {row['launches_per_step']:.0f}"
              f"/step, syncs/step " + ", ".join(f"{k} {v:.1f}" for k, v in syncs.items()))
        for key, us, count in row["top_self_cpu_us_per_step"][:8]:
            print(f"    {us:8.1f} us {count:6.1f}x  {key[:70]}")
    hm.deselect_provider()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "generate_profile.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
