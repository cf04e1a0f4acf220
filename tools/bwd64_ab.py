"""kb2's d = 64 backward: the default (128 x 128 tiles, dQ split by columns, 16 m64n32k16
WGMMAs a warpgroup) against `kb2:dq_rows=1` (dQ split by query rows, 8 m64n64k16: FA4's
split, a third less SMEM operand traffic for dQ), then both against FA4 and cuDNN
(docs/lab/kb2.md, "Why d = 64 trails FA4", 2026-11-29).

    python tools/bwd64_ab.py            # correctness, then speed (~4 min on an H200)
    python tools/bwd64_ab.py --quick    # correctness only (< 2 min with the JIT compiles)

1. Correctness: both kb2 builds launched directly (registry, no autograd) on small d = 64
   problems (MHA and GQA, causal and not, odd lengths), each gradient against the fp32
   reference with FlashAttention's rule (max error <= 2x torch's bf16 error + 2^-12 max|ref|;
   `ratio` = error / bound); whether the variant's bits equal the default's is recorded (dQ
   sums in the same order, so they should).
2. Speed (skipped with --quick): backward alone, CUDA events, L2 flushed, round-robin
   medians (harness/timing.benchmark_interleaved): both kb2 builds launched directly, ours
   (attention(), the default), FA4 and cuDNN through autograd; d = 64, 16 heads MHA and
   GQA 16 / 4, B8 N4k and B2 N16k, full and causal. One line per shape: each provider's
   time / the variant's (> 1: dq_rows faster).

Writes $OUT/bwd64_ab.json (or --out) with the environment.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bwd_gqa_gpu_check import _calls, _hopper, _sdpa  # noqa: E402
from dv_gpu_check import direct_backward  # noqa: E402
from hopper_attn.common.contract import Problem  # noqa: E402
from hopper_attn.harness.baselines import fa4  # noqa: E402
from hopper_attn.harness.gpu_check import run_check  # noqa: E402

DEFAULT, VARIANT = "kb2", "kb2:dq_rows=1"
D = 64
# (batch, heads, heads_kv, nq, nk, causal)
CASES = [(2, 4, 4, 1000, 1000, False), (2, 4, 4, 1000, 1000, True),
         (1, 8, 2, 113, 300, True), (1, 8, 2, 2048, 2048, False), (1, 4, 1, 777, 777, True),
         (1, 16, 4, 1500, 1500, True)]
SHAPES = [(8, 4096), (2, 16384)]            # (batch, seqlen), 16 query heads
KV_HEADS = (16, 4)                          # MHA, GQA 16 / 4


def _inputs(batch, heads, heads_kv, nq, nk, seed, d=D):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(batch, nq, heads, d), (batch, nk, heads_kv, d), (batch, nk, heads_kv, d),
              (batch, nq, heads, d)]
    return [torch.randn(*s, device="cuda", generator=gen).to(torch.bfloat16) for s in shapes]


def _direct_grads(name, q, k, v, do, causal):
    """dQ, dK, dV of one kb2 build (direct_backward's call writes them in place)."""
    from hopper_attn.harness import registry
    entry = registry.get(name)
    handle = entry.compile(Problem.from_tensor(q, causal, k, v=v))
    import hopper_attn
    out, lse = hopper_attn.attention(q, k, v, causal=causal, return_lse=True)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    entry.run(handle, q, k, v, out, do, lse, *grads)
    torch.cuda.synchronize()
    return grads


def correctness(log) -> list:
    from hopper_attn.harness.window_reference import gradient_errors
    rows = []
    for i, (batch, heads, heads_kv, nq, nk, causal) in enumerate(CASES):
        q, k, v, do = _inputs(batch, heads, heads_kv, nq, nk, seed=11 + i)
        base = _direct_grads(DEFAULT, q, k, v, do, causal)
        grads = _direct_grads(VARIANT, q, k, v, do, causal)
        errors = gradient_errors(q, k, v, do, grads, -1, 0 if causal else -1, D ** -0.5)
        row = {"case": [batch, heads, heads_kv, nq, nk, causal], "errors": errors,
               "ratio": {}, "ok": True,
               "same_bits_as_default": all(torch.equal(a, b) for a, b in zip(grads, base))}
        for name, grad in zip("qkv", grads):
            err, _, bound = errors[name]
            nan = bool(grad.isnan().any())
            row["ratio"][name] = float("inf") if nan else err / bound
            row["ok"] &= not nan and err <= bound
        log(f"  {VARIANT} B{batch} {heads}/{heads_kv} {nq}x{nk} "
            f"{'causal' if causal else 'full  '}: ratio dq {row['ratio']['q']:.2f} "
            f"dk {row['ratio']['k']:.2f} dv {row['ratio']['v']:.2f}, same bits as default "
            f"{row['same_bits_as_default']}  {'PASS' if row['ok'] else 'FAIL'}")
        rows.append(row)
    return rows


def speed(log) -> list:
    from hopper_attn.harness.timing import L2Flush, benchmark_interleaved
    providers = {"ours": _hopper}
    for name, make in (("fa4", fa4), ("cudnn", lambda: _sdpa("CUDNN_ATTENTION"))):
        try:
            providers[name] = make()
        except Exception as exc:  # noqa: BLE001 - not installed here
            log(f"  {name} unavailable: {type(exc).__name__}: {str(exc)[:80]}")
    flush, rows = L2Flush(), []
    for (batch, n), heads_kv, causal in ((s, h, c) for s in SHAPES for h in KV_HEADS
                                         for c in (False, True)):
        kind = "MHA" if heads_kv == 16 else f"GQA 16/{heads_kv}"
        shape = f"d64 {kind} B{batch} N{n // 1024}k {'causal' if causal else 'full'}"
        q, k, v, do = _inputs(batch, 16, heads_kv, n, n, seed=7)
        calls, notes = {}, {}
        for name in (DEFAULT, VARIANT):
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
        flops = Problem(batch, 16, n, D, causal).flops
        row = {"shape": shape, "unavailable": notes,
               "bwd": {p: {**t, "tflops": 2.5 * flops / (t["ms"] * 1e-3) / 1e12}
                       for p, t in timed.items()}}
        ref = timed.get(VARIANT, {}).get("ms")
        row["over_variant"] = {p: t["ms"] / ref for p, t in timed.items()
                               if ref and p != VARIANT}
        log(f"  {shape:30} dq_rows " + (f"{ref:.3f} ms" if ref else "-") + "; time / "
            "dq_rows': " + ", ".join(f"{p} {r:.3f}" for p, r in row["over_variant"].items())
            + "".join(f"; {p} failed" for p in notes))
        rows.append(row)
        del q, k, v, do, calls
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    return run_check(
        __doc__, "bwd64_ab.json", correctness, lambda log, t0: speed(log),
        f"{VARIANT} launched directly, gradients against the fp32 reference (ratio = max error "
        "/ (2x torch bf16 error + 2^-12 max|ref|), <= 1 passes):",
        f"backward alone, ms, round-robin medians; {DEFAULT} / {VARIANT} launched directly, "
        "ours / fa4 / cudnn through autograd; > 1: dq_rows faster:")


if __name__ == "__main__":
    sys.exit(main())
