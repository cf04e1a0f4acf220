"""Where a Llama-shaped training step's GPU time goes, per attention implementation.

    python tools/model_step_profile.py                       # N 16384, sdpa / fa4 / hopper_attn
    python tools/model_step_profile.py --seqlen 8192 --impls sdpa,hopper_attn

The model of `python -m hopper_attn.harness.models` (its defaults: 8 layers, hidden 2048,
16/4 heads, d 128, random weights, transformers); each implementation warmed up with two
steps, then one step (forward + loss + backward) under torch.profiler. Printed per
implementation: the step's wall time (CUDA events), the summed kernel time, and the kernels
grouped by name (first 70 characters), the largest first; then the groups whose time differs
most between the implementations, so a step that does not gain what the attention probe
gains shows where the difference went (copies, casts, allocator gaps). JSON to
$OUT/model_step_profile.json.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # checkout

import torch  # noqa: E402


def kernel_groups(prof) -> dict:
    """kernel name (first 70 characters) -> [total us, count] over the profiled step."""
    groups = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            group = groups[event.name[:70]]
            group[0] += event.device_time
            group[1] += 1
    return dict(groups)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--impls", default="sdpa,fa4,hopper_attn")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    from transformers.utils import logging as transformers_logging
    transformers_logging.set_verbosity_error()
    from hopper_attn.harness import models
    from hopper_attn.harness.gpu_check import env_line, write_json
    env = models._versions()
    print(env_line(env))
    shape = models.DEFAULT
    model = models.build_model(shape["layers"], shape["hidden"], shape["heads"],
                               shape["kv_heads"], shape["head_dim"], shape["intermediate"],
                               shape["vocab"], args.seqlen)
    impls, notes = models.implementations(model, args.impls.split(","))
    model.train()
    ids = torch.randint(0, shape["vocab"], (1, args.seqlen), device="cuda")

    def step(name):
        with models.backend_context(name):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    result = {"env": env, "seqlen": args.seqlen, "notes": notes, "impls": {}}
    for name, impl in impls.items():
        models.select(model, name, impl)
        for _ in range(2):
            step(name)
        wall = sorted(models._timed(lambda: step(name)) for _ in range(3))[1]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step(name)
            torch.cuda.synchronize()
        groups = kernel_groups(prof)
        total = sum(us for us, _ in groups.values())
        result["impls"][name] = {"step_ms": wall, "kernel_ms": total / 1e3, "groups": groups}
        print(f"== {name}: step {wall:.1f} ms (median of 3), kernels {total / 1e3:.1f} ms")
        for kname, (us, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"   {us / 1e3:8.2f} ms {count:5d}x  {kname}")
    models.deselect_provider()
    names = list(result["impls"])
    if len(names) > 1:
        base = result["impls"][names[0]]["groups"]
        for other in names[1:]:
            groups = result["impls"][other]["groups"]
            diff = {k: groups.get(k, [0, 0])[0] - base.get(k, [0, 0])[0]
                    for k in set(base) | set(groups)}
            print(f"== {other} - {names[0]}: largest differences")
            for kname, us in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:args.top]:
                print(f"   {us / 1e3:+8.2f} ms  {kname}")
    print("wrote", write_json(result, "model_step_profile.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
