"""Per-call cost of attention() on tiny problems, where the host side dominates, against
FlashAttention-4 and torch SDPA in the same process; and (--gqa) the speed of a
grouped-query, Llama-style problem against the same baselines.

    python -m hopper_attn.harness.overhead [--json results/h100/overhead.json]
    python -m hopper_attn.harness.overhead --gqa [--json results/h100/gqa.json]
    python -m hopper_attn.harness.overhead --breakdown [--json ...]   # where the time goes

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


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal): Llama-3-8B-like prefill,
# and a prefill with a KV prefix (cross-length, bottom-right causal)
GQA_PROBLEMS = [(1, 8192, 8192, 32, 8, 128, True), (1, 8192, 8192, 32, 8, 128, False),
                (2, 2048, 6144, 32, 8, 128, True)]


def gqa(args) -> int:
    import torch.nn.functional as F

    import hopper_attn
    from hopper_attn.common.contract import Problem
    from hopper_attn.harness.env import environment
    from hopper_attn.harness.timing import L2Flush, benchmark, tflops
    from torch.nn.attention import SDPBackend, sdpa_kernel
    ops = {"hopper_attn.attention": lambda q, k, v, c: hopper_attn.attention(q, k, v, causal=c)}
    try:
        from hopper_attn.harness.baselines import fa4
        ops["fa4"] = fa4()                                          # (raises if absent)
    except Exception as exc:  # noqa: BLE001
        print(f"fa4 unavailable: {exc}")

    def cudnn(q, k, v, c):
        nq, nk = q.shape[1], k.shape[1]
        mask = None
        if c and nq != nk:          # SDPA's is_causal is top-left aligned: pass the mask
            mask = ~torch.ones(nq, nk, dtype=torch.bool, device=q.device).triu(nk - nq + 1)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                is_causal=c and nq == nk, enable_gqa=True).transpose(1, 2)
    ops["sdpa_cudnn"] = cudnn
    flush, rows = L2Flush(), []
    for b, nq, nk, h, hkv, d, causal in GQA_PROBLEMS:
        q = torch.randn(b, nq, h, d, device="cuda").to(torch.bfloat16)
        k, v = (torch.randn(b, nk, hkv, d, device="cuda").to(torch.bfloat16) for _ in range(2))
        problem = Problem(b, h, nq, d, causal, heads_kv=hkv, seqlen_k=nk)
        ref = ops["hopper_attn.attention"](q, k, v, causal).float()
        times = {}
        for name, fn in ops.items():
            try:
                err = (fn(q, k, v, causal).float() - ref).abs().max().item()
                t = benchmark(lambda: fn(q, k, v, causal), flush)
            except Exception as exc:  # noqa: BLE001
                print(f"{name} failed on {problem.label()}: {type(exc).__name__}: {exc}"[:300])
                continue
            times[name] = t["ms"]
            rows.append({"op": name, "config": problem.as_dict(), "ms": t["ms"],
                         "tflops": tflops(problem.flops, t["ms"]),
                         "max_abs_diff_vs_hopper_attn": err})
        mine = times.get("hopper_attn.attention")
        for row in rows[-len(times):]:
            row["ratio_vs_hopper_attn"] = (row["ms"] / mine) if mine else None
            print(f"{problem.label():60} {row['op']:22} {row['ms']:8.3f} ms "
                  f"{row['tflops']:7.1f} TFLOP/s  (hopper_attn / it: {mine and row['ms'] / mine:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": environment(), "command": "python " + " ".join(sys.argv),
                       "rows": rows}, f, separators=(",", ":"))
    return 0


def breakdown(args) -> int:
    """Where one call's host time goes (B1 N128 H16 d128, non-causal): the floors (tensor
    allocation, one tiny torch kernel), the compiled kernel called directly, attention(),
    and attention() replayed from a CUDA graph."""
    import hopper_attn
    from hopper_attn import api
    from hopper_attn.common.contract import LOG2_E, kernel_counter
    from hopper_attn.harness.env import environment
    q, k, v = (torch.randn(1, 128, 16, 128, device="cuda").to(torch.bfloat16) for _ in range(3))
    tiny = torch.zeros(16, device="cuda")
    out, lse = hopper_attn.attention(q, k, v, return_lse=True)
    handle = next(iter(api._FAST.values()))
    extra = [kernel_counter(handle, q.device)] if handle.spec.takes_work_counter else []
    scale = handle.problem.softmax_scale * LOG2_E
    direct = ((lambda: handle.compiled(q, k, v, out, lse, *extra, scale)) if handle.tvm_ffi
              else None)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        hopper_attn.attention(q, k, v)                  # warm-up on the capture stream
        with torch.cuda.graph(graph, stream=stream):
            hopper_attn.attention(q, k, v)
    torch.cuda.synchronize()
    fns = {"torch.empty_like(q)": lambda: torch.empty_like(q),
           "out + lse allocation": lambda: (torch.empty_like(q), api._lse_like(q)),
           "tiny torch kernel (x.add_(1))": lambda: tiny.add_(1),
           "compiled kernel, called directly": direct,
           "attention()": lambda: hopper_attn.attention(q, k, v),
           "attention() in a CUDA graph, replayed": graph.replay}
    rows = []
    for name, fn in fns.items():
        if fn is None:
            print(f"{name:40} (no TVM-FFI path here)")
            continue
        us = per_call_us(fn, calls=1000)
        rows.append({"what": name, "us_per_call": round(us, 2)})
        print(f"{name:40} {us:8.2f} us/call")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": environment(), "command": "python " + " ".join(sys.argv),
                       "stage": handle.spec.name, "tvm_ffi": handle.tvm_ffi, "rows": rows},
                      f, separators=(",", ":"))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--gqa", action="store_true", help="GQA / cross-length speed instead")
    ap.add_argument("--breakdown", action="store_true",
                    help="where one call's host time goes (floors, direct call, CUDA graph)")
    args = ap.parse_args(argv)
    if args.gqa:
        return gqa(args)
    if args.breakdown:
        return breakdown(args)
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
                       "baselines_missing": missing, "rows": rows}, f, separators=(",", ":"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
