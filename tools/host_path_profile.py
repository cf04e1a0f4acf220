"""Host time per call of the decode and training paths, on the CPU, with the launches stubbed.

    python tools/host_path_profile.py                  # medians of 10k calls per path, us
    python tools/host_path_profile.py --profile attn_decode,kvcache_paged16 --top 15
    python tools/host_path_profile.py --out /tmp/host.json

No GPU: every compiled kernel is a no-op callable taking what the TVM-FFI calling path takes
(torch tensors), `Tensor.is_cuda` reads True (in this process only), and the tensors live on
the meta device (shapes, strides and dtypes without memory: torch ops cost their dispatch,
not their arithmetic), or with `--device cpu` on the CPU. What is timed is what Python and
torch's dispatcher do per call up to the launch; not timed: the launch itself (TVM-FFI's
argument conversion and cuLaunchKernel, a few us per kernel), CUDA's caching allocator
(cheaper on meta), and anything the GPU does. tools/overhead_gpu_check.py measures the same
paths' host and GPU time on the H200.

Paths (Hq 32 / Hkv 8, d 128, bf16):
  attn_decode       hopper_attn.attention(q, k, v): B1, one query over 4k keys, no grad
  sdpa_decode       the SDPA provider's forward (aten::_scaled_dot_product_flash_attention
                    with the provider's kernel installed for this device's key), same shape
  sdpa_run_forward  the provider's own Python (integrations.sdpa.run_forward), same shape
  sdpa_kernel_ctx   `with sdpa_kernel(SDPBackend.FLASH_ATTENTION): pass` (what a caller
                    that selects the flash backend per call pays; not the provider's)
  attn_decode_grow  attn_decode with one more key each call (views of a longer buffer,
                    4096-20480 keys, then again): a generation step, whose new key count
                    misses the per-shape caches
  sdpa_decode_grow  sdpa_decode the same way (a (B, H, N, d) cache, as transformers keeps)
  kvcache_contig    attention_with_kvcache: contiguous cache (1, 4096, 8, 128)
  kvcache_paged16   attention_with_kvcache: page 16, (256, 16, 8, 128) and a page table
  train_n1k         attention(causal=True) forward + .backward(): B1, N 1024, Hq 16 /
                    Hkv 4 (overhead_gpu_check's training shape)

One greedy generation step of `python -m hopper_attn.harness.models`'s Llama (8 layers, 16 /
4 heads of 128, transformers' DynamicCache; what `generate()` calls per new token:
`model(input_ids=<1 token>, attention_mask=<2-D, one longer>, past_key_values=cache)`), on
CPU tensors whatever --device says (on meta every elementwise op runs a Python meta kernel:
~25 ms a step, which hides the attention path), hidden 64 instead of 2048 and one CPU thread
so that the projections cost little; the cache restarts at the prompt every 256 steps:
  tf_decode_step_hopper  attn_implementation="hopper_attn" (integrations/transformers.py)
  tf_decode_step_sdpa    attn_implementation="sdpa", F.scaled_dot_product_attention stubbed
                         (returns an empty output): transformers' own path around it
For these, `--parts` also reports the us per step inside the attention functions (8 calls)
and the mask function (1 call), and every path's host syncs per call: reads of a tensor's
value on the host (`bool()`, `.item()`, `int()`, `float()`, `.tolist()`), each one a
device synchronization on CUDA tensors, by call site.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # checkout

import torch  # noqa: E402

LAUNCHES = [0]


def _stub_kernel(*args, **kwargs):
    LAUNCHES[0] += 1


def install_stubs() -> None:
    """Kernels compile to no-ops on the TVM-FFI path; tensors pass the CUDA checks. (Here
    only: the library is not changed.)"""
    torch.Tensor.is_cuda = property(lambda self: True)
    from hopper_attn import api, kvcache
    from hopper_attn.common import cute_runtime as rt
    api._compile_options = lambda: rt.TVM_FFI
    rt.tvm_ffi_available = lambda: True
    rt.compile_for_example = lambda *a, **k: _stub_kernel
    rt.compile_with_tensors = lambda *a, **k: _stub_kernel
    kvcache.compile_kernel = lambda *a, **k: (_stub_kernel, None)


def paths(device: str) -> dict:
    import hopper_attn
    from hopper_attn.integrations import sdpa as hopper_sdpa
    from torch.nn.attention import SDPBackend, sdpa_kernel
    bf = dict(dtype=torch.bfloat16, device=device)
    heads, kv_heads, d, keys = 32, 8, 128, 4096
    q = torch.randn(1, 1, heads, d, **bf) if device == "cpu" else torch.empty(1, 1, heads, d, **bf)
    k = torch.empty(1, keys, kv_heads, d, **bf)
    v = torch.empty(1, keys, kv_heads, d, **bf)
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    sq, sk, sv = (t.transpose(1, 2) for t in (q, k, v))      # SDPA's (B, H, N, d) views
    seqlens = torch.full((1,), keys - 1, dtype=torch.int32, device=device)
    pages = keys // 16
    k_paged = torch.empty(pages, 16, kv_heads, d, **bf)
    v_paged = torch.empty(pages, 16, kv_heads, d, **bf)
    table = torch.arange(pages, dtype=torch.int32, device=device).view(1, pages)
    n = 1024
    tq = torch.empty(1, n, 16, d, **bf).requires_grad_()
    tk = torch.empty(1, n, 4, d, **bf).requires_grad_()
    tv = torch.empty(1, n, 4, d, **bf).requires_grad_()
    tdo = torch.empty(1, n, 16, d, **bf)

    def train():
        hopper_attn.attention(tq, tk, tv, causal=True).backward(tdo)
        tq.grad = tk.grad = tv.grad = None

    grow = [0]
    longest = keys + 16384
    k_buf = torch.empty(1, longest, kv_heads, d, **bf)
    s_buf = torch.empty(1, kv_heads, longest, d, **bf)

    def attn_grow():
        grow[0] = grow[0] + 1 if grow[0] < longest - keys else 0
        kv = k_buf[:, :keys + grow[0]]
        hopper_attn.attention(q, kv, kv)

    def sdpa_grow():
        grow[0] = grow[0] + 1 if grow[0] < longest - keys else 0
        kv = s_buf[:, :, :keys + grow[0]]
        flash(sq, kv, kv, 0.0, False, False)

    def ctx():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            pass

    return {
        "attn_decode": lambda: hopper_attn.attention(q, k, v),
        "attn_decode_grow": attn_grow,
        "sdpa_decode": lambda: flash(sq, sk, sv, 0.0, False, False),
        "sdpa_decode_grow": sdpa_grow,
        "sdpa_run_forward": lambda: hopper_sdpa.run_forward(sq, sk, sv, 0.0, False, False,
                                                            None),
        "sdpa_kernel_ctx": ctx,
        "kvcache_contig": lambda: hopper_attn.attention_with_kvcache(q, k, v, seqlens),
        "kvcache_paged16": lambda: hopper_attn.attention_with_kvcache(
            q, k_paged, v_paged, seqlens, page_table=table),
        "train_n1k": train,
    }


TF_PROMPT = 256         # keys in the cache before the first step (CPU: the cat stays cheap)
TF_STEPS = 256          # steps before the cache restarts at the prompt
TF_CALLS = 1024         # at most this many timed calls of a tf_ path


def _stub_sdpa() -> None:
    """transformers' sdpa attention without the attention: F.scaled_dot_product_attention
    (as that module calls it) returns an empty output of the query's shape."""
    from transformers.integrations import sdpa_attention

    def empty_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False):
        return torch.empty_like(query)

    functional = type("functional", (), {"__getattr__": lambda self, n: getattr(
        torch.nn.functional, n), "scaled_dot_product_attention": staticmethod(empty_sdpa)})()
    nn = type("nn", (), {"__getattr__": lambda self, n: getattr(torch.nn, n),
                         "functional": functional})()
    sdpa_attention.torch = type("torch", (), {"__getattr__": lambda self, n: getattr(torch, n),
                                              "nn": nn})()


def tf_decode_paths(prompt: int = TF_PROMPT) -> dict:
    """tf_decode_step_* (see the module docstring): one decode step per call."""
    from transformers import DynamicCache
    from transformers.utils import logging as transformers_logging
    import hopper_attn.integrations.transformers as hopper_tf
    from hopper_attn.harness import models
    transformers_logging.set_verbosity_error()
    torch.set_num_threads(1)
    hopper_tf.register()
    _stub_sdpa()
    shape = models.DEFAULT
    model = models.build_model(shape["layers"], 64, shape["heads"], shape["kv_heads"],
                               shape["head_dim"], 128, 256, prompt + TF_STEPS, device="cpu")
    model.eval()

    def path(impl):
        state = {}
        token = torch.zeros(1, 1, dtype=torch.long)

        def restart():
            model.set_attn_implementation(impl)
            cache = DynamicCache(config=model.config)
            mask = torch.ones(1, prompt, dtype=torch.long)
            with torch.no_grad():
                model(input_ids=torch.zeros(1, prompt, dtype=torch.long), attention_mask=mask,
                      past_key_values=cache, use_cache=True)
            state.update(cache=cache, mask=mask, steps=0)

        def step():
            if not state or state["steps"] == TF_STEPS or \
                    model.config._attn_implementation != impl:
                restart()
            state["steps"] += 1
            mask = state["mask"] = torch.cat([state["mask"], state["mask"].new_ones((1, 1))],
                                             dim=-1)
            with torch.no_grad():
                model(input_ids=token.clone(), attention_mask=mask,
                      past_key_values=state["cache"], use_cache=True)
        return step

    return {"tf_decode_step_hopper": path("hopper_attn"),
            "tf_decode_step_sdpa": path("sdpa")}


def parts_of(fn, calls: int) -> dict:
    """us per call inside the attention and mask functions, and host syncs per call by call
    site (one pass each, after the timed calls)."""
    from hopper_attn.harness.host_probe import counting_syncs, timing_interfaces
    spent, syncs = collections.Counter(), collections.Counter()
    with timing_interfaces(spent):
        for _ in range(calls):
            fn()
    with counting_syncs(syncs):
        for _ in range(calls):
            fn()
    return {"attention_us": round(spent["attention"] / calls * 1e6, 2),
            "mask_us": round(spent["mask"] / calls * 1e6, 2),
            "syncs_per_call": sum(syncs.values()) / calls,
            "sync_sites": {k: v / calls for k, v in syncs.items()}}


def time_path(fn, calls: int, warmup: int = 50) -> dict:
    """Median and mean us per call over `calls` calls, and kernel launches per call."""
    for _ in range(warmup):
        fn()
    LAUNCHES[0] = 0
    times = []
    clock = time.perf_counter
    for _ in range(calls):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return {"median_us": round(statistics.median(times) * 1e6, 2),
            "mean_us": round(statistics.fmean(times) * 1e6, 2),
            "launches_per_call": LAUNCHES[0] / calls}


def profile_path(fn, calls: int, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--paths", default="", help="comma-separated (default: all)")
    parser.add_argument("--device", default="meta", choices=("meta", "cpu"))
    parser.add_argument("--profile", default="", help="comma-separated paths to cProfile")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--out", default="", help="JSON path")
    parser.add_argument("--parts", action="store_true",
                        help="also the attention / mask functions' us and the host syncs "
                             "per call (tf_ paths; syncs for every path)")
    parser.add_argument("--tf-prompt", type=int, default=TF_PROMPT,
                        help="keys in the cache before a tf_ path's first step")
    args = parser.parse_args(argv)
    install_stubs()
    from hopper_attn.integrations import sdpa as hopper_sdpa
    names = [p for p in args.paths.split(",") if p]
    table = paths(args.device)
    if not names or any(name.startswith("tf_") for name in names):
        table.update(tf_decode_paths(args.tf_prompt))
    names = names or list(table)
    # the provider's kernels for this device's dispatch key (meta tensors dispatch to Meta)
    handle = hopper_sdpa._install(dispatch_key="Meta" if args.device == "meta" else "CPU")
    results = {}
    try:
        for name in names:
            calls = min(args.calls, TF_CALLS) if name.startswith("tf_") else args.calls
            results[name] = time_path(table[name], calls)
            r = results[name]
            line = (f"{name:<21} {r['median_us']:8.2f} us median {r['mean_us']:8.2f} mean "
                    f"({r['launches_per_call']:g} launches)")
            if args.parts:
                r.update(parts_of(table[name], min(calls, TF_STEPS)))
                line += (f", attention {r['attention_us']:.1f} us, mask {r['mask_us']:.1f} us, "
                         f"{r['syncs_per_call']:g} syncs") if name.startswith("tf_") else \
                    f", {r['syncs_per_call']:g} syncs"
            print(line)
            for site, count in r.get("sync_sites", {}).items():
                print(f"    {count:g} x {site}")
        for name in filter(None, args.profile.split(",")):
            calls = min(args.calls, TF_CALLS) if name.startswith("tf_") else args.calls
            print(f"--- cProfile {name} ({calls} calls, by own time)")
            print(profile_path(table[name], calls, args.top))
    finally:
        handle.remove()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"us_per_call": results, "device": args.device, "calls": args.calls,
                       "torch": torch.__version__}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
