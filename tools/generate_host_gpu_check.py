"""Where a greedy generation step's host time goes on the GPU host, per attention
implementation; one line each, then the differences from SDPA; JSON to
$OUT/generate_host.json.

    python tools/generate_host_gpu_check.py            # prompt 2048, 128 steps, 3 rounds
    python tools/generate_host_gpu_check.py --quick    # 32 steps, 2 rounds (< 2 min)
    python tools/generate_host_gpu_check.py --quick --gc-off   # the collector off
    python tools/generate_host_gpu_check.py --quick --prefill  # the prompt's forward instead

The model of `python -m hopper_attn.harness.models --only generate` (8 layers, hidden 2048,
16 / 4 heads of 128, random weights, DynamicCache) and its implementations (sdpa,
hopper_attn, sdpa_provider). Per implementation:
  ms/step    decode time per generated token: `bench_generate`'s round-robin medians of
             (generate(steps) - generate(1)) / (steps - 1)
  attn, mask host us per step inside transformers' attention functions (8 calls) and its
             mask function (1 call) (hopper_attn.harness.host_probe)
  syncs      device synchronizations per step that torch's sync debug mode reports (the
             Python call sites, and those of `.item()` / `bool()` on CUDA tensors, in the JSON)
  api        CUDA runtime / driver calls per step that torch.profiler records on the host
             (launches, copies, allocations, synchronizations), and their host us per step
  kernels    kernels per step and their GPU us per step (torch.profiler)
Then the functions whose own host time per step (cProfile of one generation) differs most
from SDPA's, and the runtime calls that do. Compare implementations within one run: the
GPU host's speed drifts between runs.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # checkout

import torch  # noqa: E402


def own_times(fn, steps: int) -> dict:
    """cProfile of `fn()`: 'file:line(function)' -> own host us per step."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    stats = pstats.Stats(prof).stats
    out = {}
    for (path, line, name), (_, _, tottime, _, _) in stats.items():
        where = f"{path.split('site-packages/')[-1].replace(os.getcwd() + '/', '')}:{line}({name})"
        out[where] = out.get(where, 0.0) + tottime / steps * 1e6
    return out


def sync_sites(fn) -> collections.Counter:
    """Synchronizations that torch's sync debug mode warns about, by Python call site."""
    from hopper_attn.harness.host_probe import sync_warnings
    sites = collections.Counter()
    for w in sync_warnings(fn):
        if "synchroniz" in str(w.message):
            path = w.filename.split("site-packages/")[-1].replace(os.getcwd() + "/", "")
            sites[f"{path}:{w.lineno}"] += 1
    return sites


def profiled(fn, steps: int) -> dict:
    """torch.profiler of `fn()`: runtime / driver API calls and kernels per step."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    api, kernels = collections.defaultdict(lambda: [0, 0.0]), collections.defaultdict(
        lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels[event.name[:60]]
            entry[0] += 1
            entry[1] += event.device_time
        elif event.name.startswith(("cuda", "cu")) and not event.name.startswith("cutlass"):
            entry = api[event.name]
            entry[0] += 1
            entry[1] += event.cpu_time_total
    per_step = lambda table: {name: [count / steps, us / steps]          # noqa: E731
                              for name, (count, us) in table.items()}
    return {"api": per_step(api), "kernels": per_step(kernels)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--impls", default="sdpa,hopper_attn,sdpa_provider")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--prefill", action="store_true",
                        help="probe the prompt's forward (generate(1)) instead of a decode step")
    parser.add_argument("--gc-off", action="store_true",
                        help="Python's garbage collector off for the whole run (an A/B: does "
                             "collection triggered by the calls' temporaries cost steps?)")
    args = parser.parse_args()
    if args.gc_off:
        import gc
        gc.collect()
        gc.disable()
    from transformers.utils import logging as transformers_logging
    transformers_logging.set_verbosity_error()
    from hopper_attn.harness import models
    from hopper_attn.harness.gpu_check import env_line, write_json
    from hopper_attn.harness.host_probe import counting_syncs, timing_interfaces
    steps, rounds = (32, 2) if args.quick else (128, 3)
    env = models._versions()
    print(env_line(env), f"transformers {env.get('transformers')}; prompt {args.prompt}, "
          f"{steps} steps, {rounds} rounds")
    shape = models.DEFAULT
    model = models.build_model(shape["layers"], shape["hidden"], shape["heads"],
                               shape["kv_heads"], shape["head_dim"], shape["intermediate"],
                               shape["vocab"], args.prompt + steps)
    impls, notes = models.implementations(model, args.impls.split(","))
    rows = models.bench_generate(model, impls, args.prompt, steps, rounds, vocab=shape["vocab"])
    ids = torch.randint(0, shape["vocab"], (1, args.prompt), device="cuda")
    kwargs = dict(do_sample=False, use_cache=True, attention_mask=torch.ones_like(ids))
    result = {"env": env, "prompt": args.prompt, "steps": steps, "rounds": rounds,
              "probe": "prefill" if args.prefill else "decode",
              "notes": notes, "rows": rows, "impls": {}}
    for row in rows:
        name = row["impl"]
        if "error" in row or not row.get("decode_tokens_per_s"):
            print(f"{name:<14} error: {row.get('error', 'no decode time')}")
            continue
        models.select(model, name, impls[name])

        per = 1 if args.prefill else steps          # what one "step" is below

        def generate(tokens=1 if args.prefill else steps, name=name):
            with torch.no_grad(), models.backend_context(name):
                model.generate(ids, max_new_tokens=tokens, **kwargs)

        generate()                                   # (this prompt's shapes, once)
        spent, reads = collections.Counter(), collections.Counter()
        with timing_interfaces(spent):
            generate()
        with counting_syncs(reads):
            generate()
        syncs = sync_sites(generate)
        prof = profiled(generate, per)
        own = own_times(generate, per)
        info = result["impls"][name] = {
            "ms_per_step": (row["prefill_ms"] if args.prefill
                            else 1e3 / row["decode_tokens_per_s"]),
            "attention_us_per_step": spent["attention"] / per * 1e6,
            "mask_us_per_step": spent["mask"] / per * 1e6,
            "syncs_per_step": sum(syncs.values()) / per,
            "sync_sites": {k: v / per for k, v in syncs.items()},
            "value_reads": {k: v / per for k, v in reads.items()},
            **prof, "own_us": own}
        api_calls = sum(c for c, _ in prof["api"].values())
        api_us = sum(us for _, us in prof["api"].values())
        kernels = sum(c for c, _ in prof["kernels"].values())
        kernel_us = sum(us for _, us in prof["kernels"].values())
        print(f"{name:<14} {info['ms_per_step']:6.3f} ms/step  attn "
              f"{info['attention_us_per_step']:7.1f} us  mask {info['mask_us_per_step']:6.1f} "
              f"us  syncs {info['syncs_per_step']:5.2f}  api {api_calls:6.1f} ({api_us:7.1f} us)"
              f"  kernels {kernels:6.1f} ({kernel_us:7.1f} us GPU)")
    models.deselect_provider()
    base = result["impls"].get("sdpa")
    for name, info in result["impls"].items():
        if base is None or name == "sdpa":
            continue
        for part, label in (("own_us", "own host us/step"), ("api", "runtime calls/step"),
                            ("kernels", "kernels/step (GPU us)")):
            if part == "own_us":
                delta = {k: info[part].get(k, 0.0) - base[part].get(k, 0.0)
                         for k in set(info[part]) | set(base[part])}
            else:
                delta = {k: (info[part].get(k, [0, 0])[1] - base[part].get(k, [0, 0])[1],
                             info[part].get(k, [0, 0])[0] - base[part].get(k, [0, 0])[0])
                         for k in set(info[part]) | set(base[part])}
            top = sorted(delta.items(), key=lambda kv: -abs(kv[1] if part == "own_us"
                                                                else kv[1][0]))[:args.top]
            info[f"vs_sdpa_{part}"] = dict(top)
            print(f"-- {name} - sdpa, {label}:")
            for k, v in top:
                print(f"   {v:+8.1f}  {k[:110]}" if part == "own_us" else
                      f"   {v[0]:+8.1f} us {v[1]:+6.1f} calls  {k[:90]}")
    print("wrote", write_json(result, "generate_host.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
