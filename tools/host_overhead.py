"""Host (Python) time per call of `attention()` and its integrations, measured on the CPU.

    python tools/host_overhead.py                 # medians of 1000 calls, microseconds
    python tools/host_overhead.py --profile fwd_bwd   # and cProfile's top entries for a path

No GPU: the compiled kernels are replaced by no-op callables (as if launched through CuTe
DSL's TVM-FFI path, which the GPU host uses), `Tensor.is_cuda` reads True, and the tensors
are small CPU tensors in the layouts the callers hand over (so a `.contiguous()` copy or a
GQA sum shows up as CPU work: small here, a kernel launch on the GPU). What is timed is
everything Python and the dispatcher do per call; what is not: a real launch (a few us per
kernel with TVM-FFI) and torch's CUDA allocator.

Paths: fwd (eager, no grad), fwd_grad (the custom op with autograd recording), bwd
(`.backward()` of that output), fwd_bwd (both), tf_fwd_bwd (transformers' attention
function with its (batch, heads, seqlen, head_dim) views), tf_decode (one query over a
cache, no grad), sdpa_fwd / sdpa_fwd_bwd / sdpa_decode (torch's
`_scaled_dot_product_flash_attention` op with this project's provider installed for the
CPU key).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())           # the checkout it runs from (compare branches)

import torch  # noqa: E402


def _noop(*args, **kwargs):
    return None


def install_mocks() -> None:
    """Kernels compile to no-ops on the TVM-FFI path; tensors pass the CUDA checks."""
    torch.Tensor.is_cuda = property(lambda self: True)
    from hopper_attn import api
    from hopper_attn.common import cute_runtime as rt
    api._compile_options = lambda: rt.TVM_FFI
    rt.tvm_ffi_available = lambda: True
    rt.compile_for_example = lambda *a, **k: _noop
    rt.compile_with_tensors = lambda *a, **k: _noop


def median_us(fn, calls: int = 1000, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def paths(batch=1, seqlen=128, heads=16, kv_heads=4, head_dim=128, cache=2304) -> dict:
    import hopper_attn
    from hopper_attn.integrations import sdpa as hopper_sdpa
    from hopper_attn.integrations import transformers as hopper_tf
    dt = torch.bfloat16
    q = torch.randn(batch, seqlen, heads, head_dim, dtype=dt)
    k = torch.randn(batch, seqlen, kv_heads, head_dim, dtype=dt)
    v = torch.randn_like(k)
    do = torch.randn_like(q)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def fwd():
        hopper_attn.attention(q, k, v, causal=True)

    def fwd_bwd():
        hopper_attn.attention(qg, kg, vg, causal=True).backward(do)
        qg.grad = kg.grad = vg.grad = None

    def fwd_grad():
        return hopper_attn.attention(qg, kg, vg, causal=True)

    held = {}

    def bwd_setup():
        held["out"] = fwd_grad()

    def bwd():
        held["out"].backward(do)
        qg.grad = kg.grad = vg.grad = None

    # transformers: projections as (B, N, H, d) seen as (B, H, N, d) (Llama's q/k/v after
    # RoPE keep the projection's memory order); the cache of generation is contiguous (B, H, N, d)
    module = type("Attn", (torch.nn.Module,), {})()
    module.is_causal = True
    tq, tk, tv = (t.clone().transpose(1, 2).requires_grad_() for t in (q, k, v))
    tdo = do.clone()

    def tf_fwd_bwd():
        out, _ = hopper_tf.hopper_attention_forward(module, tq, tk, tv, None, scaling=None)
        out.backward(tdo)
        tq.grad = tk.grad = tv.grad = None

    dq1 = torch.randn(batch, heads, 1, head_dim, dtype=dt)
    ck = torch.randn(batch, kv_heads, cache, head_dim, dtype=dt)
    cv = torch.randn_like(ck)

    def tf_decode():
        with torch.no_grad():
            hopper_tf.hopper_attention_forward(module, dq1, ck, cv, None, scaling=None)

    sq, sk, sv = (t.clone().transpose(1, 2) for t in (q, k, v))
    sqg, skg, svg = (t.clone().requires_grad_() for t in (sq, sk, sv))
    sdo = do.transpose(1, 2)
    flash = torch.ops.aten._scaled_dot_product_flash_attention

    def sdpa_fwd():
        flash(sq, sk, sv, 0.0, True, False)

    def sdpa_fwd_bwd():
        flash(sqg, skg, svg, 0.0, True, False)[0].backward(sdo)
        sqg.grad = skg.grad = svg.grad = None

    def sdpa_decode():
        flash(dq1, ck, cv, 0.0, False, False)

    return {"fwd": (None, fwd), "fwd_grad": (None, fwd_grad), "bwd": (bwd_setup, bwd),
            "fwd_bwd": (None, fwd_bwd), "tf_fwd_bwd": (None, tf_fwd_bwd),
            "tf_decode": (None, tf_decode), "sdpa_fwd": ("sdpa", sdpa_fwd),
            "sdpa_fwd_bwd": ("sdpa", sdpa_fwd_bwd), "sdpa_decode": ("sdpa", sdpa_decode)}, \
        hopper_sdpa


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--seqlen", type=int, default=16,
                        help="small, so that CPU work (a GQA dK/dV sum) stays small")
    parser.add_argument("--kv-heads", type=int, default=4,
                        help="16: no GQA sum at all (only the Python path is timed)")
    parser.add_argument("--profile", default="", help="comma-separated paths to cProfile")
    parser.add_argument("--out", default="", help="JSON path")
    args = parser.parse_args(argv)
    install_mocks()
    table, hopper_sdpa = paths(seqlen=args.seqlen, kv_heads=args.kv_heads)
    handle = hopper_sdpa._install(dispatch_key="CPU")
    results = {}
    try:
        for name, (setup, fn) in table.items():
            if setup == "sdpa" or setup is None:
                results[name] = median_us(fn, args.calls)
            else:                                  # bwd: a fresh forward before each call
                times = []
                for _ in range(args.calls + 20):
                    setup()
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                results[name] = statistics.median(times[20:]) * 1e6
            print(f"{name:<14} {results[name]:8.1f} us")
        for name in filter(None, args.profile.split(",")):
            fn = table[name][1]
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                fn()
            prof.disable()
            print(f"--- cProfile {name} (200 calls, cumulative)")
            pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    finally:
        handle.remove()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"us_per_call": results, "seqlen": args.seqlen, "kv_heads": args.kv_heads,
                       "calls": args.calls}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
