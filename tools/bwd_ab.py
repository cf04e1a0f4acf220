"""kb2's backward at one head dim against one variant (a registry name with options), then
both against FA4 and cuDNN: the A/B behind a POLICY change of kb2.

    python tools/bwd_ab.py --dim 64 --variant kb2:dq_rows=0          # ~4 min on an H200
    python tools/bwd_ab.py --dim 256 --variant kb2:dkv_split_d=0 --kv-heads 16
    python tools/bwd_ab.py --dim 128 --variant kb2:gqa=0 --kv-heads 4 \\
        --shapes 1x8192,1x16384,1x32768 --causal 1
    python tools/bwd_ab.py --dim 64 --variant kb2:stats_shuffle=0 --causal 1
    ... --quick                                                     # correctness only

1. Correctness: both builds launched directly (registry, no autograd) on small problems (MHA,
   GQA, MQA, odd and cross lengths, full and causal) against window_reference's fp32
   gradients, FlashAttention's rule (error <= 2x torch's bf16 error + 2^-12 max|ref|;
   `ratio` = error / bound); whether the variant's bits equal the default's is recorded.
2. Speed (skipped with --quick): the backward alone, CUDA events, L2 flushed, round-robin
   medians: both builds launched directly, ours (attention(), the default), FA4 and cuDNN
   through autograd, at 16 query heads, each of --kv-heads, --shapes (BxN), --causal. One line
   per shape: each provider's time / the variant's (> 1: the variant faster). --variant given
   more than once: every variant checked and timed in the same rounds, times over the first's.

Writes $OUT/bwd_ab.json (or --out) with the environment and the arguments.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bwd_gqa_gpu_check import _calls, backward_providers  # noqa: E402
from dv_gpu_check import direct_backward  # noqa: E402
from hopper_attn.common.contract import Problem  # noqa: E402
from hopper_attn.harness.gpu_check import run_check  # noqa: E402

HEADS = 16
# (batch, heads, heads_kv, nq, nk, causal)
CASES = [(2, 4, 4, 1000, 1000, False), (2, 4, 4, 1000, 1000, True),
         (1, 8, 2, 113, 300, True), (1, 8, 2, 2048, 2048, False), (1, 4, 1, 777, 777, True),
         (1, 16, 4, 1500, 1500, True)]


def parse_own_args() -> argparse.Namespace:
    """This tool's arguments; run_check parses the rest (--quick, --speed-only, --out)."""
    parser = argparse.ArgumentParser(add_help=False)
    asked_help = bool({"-h", "--help"} & set(sys.argv))
    parser.add_argument("--dim", type=int, required=not asked_help)
    parser.add_argument("--variant", required=not asked_help, action="append",
                        help="e.g. kb2:dq_rows=0 (again: a further arm, same rounds)")
    parser.add_argument("--default", default="kb2")
    parser.add_argument("--kv-heads", default="16,4", help="k/v heads for 16 query heads")
    parser.add_argument("--shapes", default="8x4096,2x16384", help="BxN, comma-separated")
    parser.add_argument("--causal", default="0,1", help="0 (full), 1 (causal) or both")
    args, rest = parser.parse_known_args()
    args.variants, args.variant = args.variant or [], (args.variant or [None])[0]
    sys.argv[1:] = rest
    return args


ARGS = parse_own_args() if __name__ == "__main__" else None


def _inputs(batch, heads, heads_kv, nq, nk, seed, d):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(batch, nq, heads, d), (batch, nk, heads_kv, d), (batch, nk, heads_kv, d),
              (batch, nq, heads, d)]
    return [torch.randn(*s, device="cuda", generator=gen).to(torch.bfloat16) for s in shapes]


def _direct_grads(name, q, k, v, do, causal):
    """dQ, dK, dV of one kb2 build (its run writes them in place)."""
    import hopper_attn
    from hopper_attn.harness import registry
    entry = registry.get(name)
    handle = entry.compile(Problem.from_tensor(q, causal, k, v=v))
    out, lse = hopper_attn.attention(q, k, v, causal=causal, return_lse=True)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    entry.run(handle, q, k, v, out, do, lse, *grads)
    torch.cuda.synchronize()
    return grads


def correctness(log) -> list:
    from hopper_attn.harness.window_reference import gradient_errors
    rows, d = [], ARGS.dim
    for (i, (batch, heads, heads_kv, nq, nk, causal)), variant in \
            ((c, name) for c in enumerate(CASES) for name in ARGS.variants):
        q, k, v, do = _inputs(batch, heads, heads_kv, nq, nk, 11 + i, d)
        base = _direct_grads(ARGS.default, q, k, v, do, causal)
        grads = _direct_grads(variant, q, k, v, do, causal)
        errors = gradient_errors(q, k, v, do, grads, -1, 0 if causal else -1, d ** -0.5)
        row = {"case": [batch, heads, heads_kv, nq, nk, causal, d], "errors": errors,
               "variant": variant,
               "ratio": {}, "ok": True,
               "same_bits_as_default": all(torch.equal(a, b) for a, b in zip(grads, base))}
        for name, grad in zip("qkv", grads):
            err, _, bound = errors[name]
            nan = bool(grad.isnan().any())
            row["ratio"][name] = float("inf") if nan else err / bound
            row["ok"] &= not nan and err <= bound
        log(f"  {variant} d{d} B{batch} {heads}/{heads_kv} {nq}x{nk} "
            f"{'causal' if causal else 'full  '}: ratio dq {row['ratio']['q']:.2f} "
            f"dk {row['ratio']['k']:.2f} dv {row['ratio']['v']:.2f}, same bits as default "
            f"{row['same_bits_as_default']}  {'PASS' if row['ok'] else 'FAIL'}")
        rows.append(row)
    return rows


def speed(log) -> list:
    from hopper_attn.harness.timing import L2Flush, benchmark_interleaved
    providers = backward_providers(log)
    flush, rows, d = L2Flush(), [], ARGS.dim
    shapes = [tuple(int(x) for x in s.split("x")) for s in ARGS.shapes.split(",")]
    masks = [bool(int(c)) for c in ARGS.causal.split(",")]
    for (batch, n), heads_kv, causal in ((s, int(h), c) for s in shapes
                                         for h in ARGS.kv_heads.split(",") for c in masks):
        kind = "MHA" if heads_kv == HEADS else f"GQA {HEADS}/{heads_kv}"
        shape = f"d{d} {kind} B{batch} N{n // 1024}k {'causal' if causal else 'full'}"
        q, k, v, do = _inputs(batch, HEADS, heads_kv, n, n, 7, d)
        calls, notes = {}, {}
        for name in (ARGS.default, *ARGS.variants):
            try:
                calls[name] = direct_backward(name, q, k, v, do, causal)
            except Exception as exc:  # noqa: BLE001 - recorded, the others still run
                notes[name] = f"{type(exc).__name__}: {str(exc)[:100]}"
        for name, forward in providers.items():
            try:
                calls[name] = _calls(forward, q, k, v, do, causal)[0]
            except Exception as exc:  # noqa: BLE001 - e.g. a shape cuDNN refuses
                notes[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
        timed = benchmark_interleaved(calls, flush, target_ms=150, max_reps=20)
        flops = Problem(batch, HEADS, n, d, causal).flops
        row = {"shape": shape, "unavailable": notes,
               "bwd": {p: {**t, "tflops": 2.5 * flops / (t["ms"] * 1e-3) / 1e12}
                       for p, t in timed.items()}}
        ref = timed.get(ARGS.variant, {}).get("ms")
        row["over_variant"] = {p: t["ms"] / ref for p, t in timed.items()
                               if ref and p != ARGS.variant}
        log(f"  {shape:30} variant " + (f"{ref:.3f} ms" if ref else "-") + "; time / "
            "variant's: " + ", ".join(f"{p} {r:.3f}" for p, r in row["over_variant"].items())
            + "".join(f"; {p} failed" for p in notes))
        rows.append(row)
        del q, k, v, do, calls
        torch.cuda.empty_cache()
    return [{"args": vars(ARGS)}] + rows


def main() -> int:
    return run_check(
        __doc__, "bwd_ab.json", correctness, lambda log, t0: speed(log),
        f"{' and '.join(ARGS.variants)} launched directly, gradients against the fp32 "
        "reference (ratio = max "
        "error / (2x torch bf16 error + 2^-12 max|ref|), <= 1 passes):",
        f"backward alone, ms, round-robin medians; {ARGS.default} / "
        f"{' / '.join(ARGS.variants)} launched directly, ours / fa4 / cudnn through autograd; "
        f"time / {ARGS.variant}'s, > 1: it is faster:")


if __name__ == "__main__":
    sys.exit(main())
