"""GPU check of kb2's GQA backward (issue 59): correctness, then speed against FA4 and SDPA.

    source .gpu/prelude.sh && python tools/bwd_gqa_gpu_check.py [--quick] [--out DIR]

1. Correctness, through `hopper_attn.attention(...).backward()` (kb2, the gqa variant where
   k/v have fewer heads): dQ, dK, dV against the fp32 reference
   (harness/reference_backward.py) for GQA 4:1 and 8:1, MQA and MHA, causal and not, d = 64
   and 128, lengths 1, 17, 113, 1000 and two cross lengths; cases whose dK / dV heads are
   split in parts (`masking.dkv_parts`) and cases with several longest-first head groups; the
   deterministic mode run twice (same bits) on GQA problems. A gradient passes when its
   max error <= 2x torch's own bf16 backward error on the same inputs (+ 2^-12 x max |ref|,
   as tests/test_gpu.py); `ratio` = error / that bound (<= 1 passes).
2. Speed (skipped with --quick): the backward alone (autograd.grad of a kept graph) and
   forward + backward, CUDA events, L2 flushed, round-robin medians
   (harness/timing.benchmark_interleaved), on the issue's five shapes, for hopper_attn
   (default: kb2's gqa variant), FA4 (flash_attn.cute.interface.flash_attn_func) and SDPA's
   cuDNN and flash backends where they run; with GQA also kb2 variants launched directly
   (backward only): the default, kb2:gqa=0 (the old path: one dK / dV per query head,
   summed by torch) and, with a mask, the other launch order (heads first at d = 128, the
   natural order at d = 64). Effective TFLOP/s: the backward counts 2.5x the
   forward's flops, forward + backward 3.5x.

Prints < 60 lines; everything goes to $OUT/bwd_gqa.json (or --out), with the environment
(GPU, driver, torch, CuTe DSL, FA4).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hopper_attn  # noqa: E402
from hopper_attn.common.contract import Problem  # noqa: E402
from hopper_attn.harness.baselines import fa4  # noqa: E402
from hopper_attn.harness.gpu_check import run_check  # noqa: E402
from hopper_attn.harness.grad_check import _torch_lowp_grads  # noqa: E402
from hopper_attn.harness.reference_backward import (attention_backward,  # noqa: E402
                                                    forward_with_lse)

GROUPS = [("4:1", 8, 2), ("8:1", 16, 2), ("MQA", 4, 1), ("MHA", 4, 4)]
LENGTHS = [(1, 1), (17, 17), (113, 113), (1000, 1000), (113, 300), (1000, 517)]
# (label, heads, heads_kv, batch, seqlen, d, causal): dK / dV split in parts, head groups
LARGER = [("MQA parts", 8, 1, 1, 8192, 128, True), ("MQA parts", 16, 1, 1, 2048, 64, True),
          ("8:1 parts", 16, 2, 1, 2048, 64, False), ("groups", 24, 3, 3, 2100, 128, True),
          ("groups", 32, 8, 2, 2100, 64, True)]
DETERMINISTIC = [(8, 2, 2, 2100, 128, True), (16, 2, 1, 1000, 64, True),
                 (4, 1, 2, 777, 128, False)]
BENCH = [("GQA 16/4 B1 N8k d128 causal", 1, 16, 4, 8192, 128, True),
         ("GQA 32/8 B1 N8k d64 causal", 1, 32, 8, 8192, 64, True),
         ("MHA 32 B2 N8k d128 causal", 2, 32, 32, 8192, 128, True),
         ("GQA 32/8 B2 N4k d128 full", 2, 32, 8, 4096, 128, False),
         ("GQA 16/4 B1 N16k d128 causal", 1, 16, 4, 16384, 128, True)]


def _inputs(batch, heads, heads_kv, nq, nk, d, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, do = (torch.randn(batch, nq, heads, d, device="cuda", generator=gen)
             .to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(batch, nk, heads_kv, d, device="cuda", generator=gen)
            .to(torch.bfloat16) for _ in range(2))
    return q, k, v, do


def _ours(q, k, v, do, causal, deterministic=False):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    hopper_attn.attention(*leaves, causal=causal, deterministic=deterministic).backward(do)
    return [t.grad for t in leaves]


def check_case(batch, heads, heads_kv, nq, nk, d, causal, seed, deterministic=False):
    """{'ratio': {q, k, v}, 'ok', 'same_bits' (deterministic)}: see the module docstring."""
    q, k, v, do = _inputs(batch, heads, heads_kv, nq, nk, d, seed)
    grads = _ours(q, k, v, do, causal, deterministic)
    o, lse = forward_with_lse(q, k, v, causal)
    ref = attention_backward(q, k, v, o, lse, do, causal)
    lowp = _torch_lowp_grads(q, k, v, do, causal)
    row = {"shape": [batch, heads, heads_kv, nq, nk, d, causal], "ratio": {}, "error": {},
           "torch_error": {}, "ok": True}
    for name, grad, r, t in zip("qkv", grads, ref, lowp):
        err = (grad.float() - r).abs().max().item()
        torch_err = (t.float() - r).abs().max().item()
        bound = 2 * torch_err + 2 ** -12 * max(1.0, r.abs().max().item())
        nan = bool(grad.isnan().any())
        row["error"][name], row["torch_error"][name] = err, torch_err
        row["ratio"][name] = float("inf") if nan else err / bound
        row["ok"] &= not nan and err <= bound
    if deterministic:
        again = _ours(q, k, v, do, causal, True)
        row["same_bits"] = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                               for a, b in zip(grads, again))
        row["ok"] &= row["same_bits"]
    return row


def correctness(log) -> list:
    rows, failures = [], []
    seed = 0
    for label, heads, heads_kv in GROUPS:
        for d in (64, 128):
            group_rows = []
            for causal in (False, True):
                for nq, nk in LENGTHS:
                    seed += 1
                    row = check_case(2, heads, heads_kv, nq, nk, d, causal, seed)
                    row["label"] = label
                    group_rows.append(row)
            rows += group_rows
            worst = {n: max(r["ratio"][n] for r in group_rows) for n in "qkv"}
            bad = [r for r in group_rows if not r["ok"]]
            failures += bad
            log(f"  {label:4} d{d:<3} {len(group_rows):2} cases: worst ratio dq {worst['q']:.2f} "
                f"dk {worst['k']:.2f} dv {worst['v']:.2f}  {'PASS' if not bad else 'FAIL'}")
    for label, heads, heads_kv, batch, n, d, causal in LARGER:
        seed += 1
        row = check_case(batch, heads, heads_kv, n, n, d, causal, seed)
        row["label"] = label
        parts = _parts(batch, heads, heads_kv, n, d, causal)
        row["dkv_parts"] = parts
        rows.append(row)
        failures += [] if row["ok"] else [row]
        log(f"  {label:9} {heads}/{heads_kv} B{batch} N{n} d{d} {'causal' if causal else 'full':6}"
            f" parts {parts}: ratio dq {row['ratio']['q']:.2f} dk {row['ratio']['k']:.2f} "
            f"dv {row['ratio']['v']:.2f}  {'PASS' if row['ok'] else 'FAIL'}")
    for heads, heads_kv, batch, n, d, causal in DETERMINISTIC:
        seed += 1
        row = check_case(batch, heads, heads_kv, n, n, d, causal, seed, deterministic=True)
        row["label"] = "deterministic"
        rows.append(row)
        failures += [] if row["ok"] else [row]
        log(f"  deterministic {heads}/{heads_kv} B{batch} N{n} d{d} "
            f"{'causal' if causal else 'full':6}: same bits {row['same_bits']}, max ratio "
            f"{max(row['ratio'].values()):.2f}  {'PASS' if row['ok'] else 'FAIL'}")
    for row in failures[:5]:
        log(f"  FAILED {row['label']} {row['shape']}: ratio {row['ratio']}")
    return rows


def _parts(batch, heads, heads_kv, n, d, causal) -> int:
    from hopper_attn import kb2
    problem = Problem(batch, heads, n, d, causal, heads_kv=heads_kv)
    if heads == heads_kv:
        return 1
    handle = kb2.compile_kernel(problem)
    return handle.kernel.dkv_heads(problem) // heads_kv


# ------------------------------------------------------------------------------ speed

def _sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def forward(q, k, v, causal):
        with sdpa_kernel(getattr(SDPBackend, backend)):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                 v.transpose(1, 2), is_causal=causal,
                                                 enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)
    return forward


def _hopper(q, k, v, causal):
    return hopper_attn.attention(q, k, v, causal=causal)


def backward_providers(log) -> dict:
    """name -> forward(q, k, v, causal) for the backward timings: ours (attention()), FA4
    and cuDNN (SDPA's backend) where this host has them (a line logged for each missing)."""
    providers = {"ours": _hopper}
    for name, make in (("fa4", fa4), ("cudnn", lambda: _sdpa("CUDNN_ATTENTION"))):
        try:
            providers[name] = make()
        except Exception as exc:  # noqa: BLE001 - not installed here
            log(f"  {name} unavailable: {type(exc).__name__}: {str(exc)[:80]}")
    return providers


def _calls(forward, q, k, v, do, causal):
    """(backward alone, forward + backward) callables of one provider."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = forward(*leaves, causal)
    backward = lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)  # noqa: E731
    both = lambda: torch.autograd.grad(forward(*leaves, causal), leaves, do)    # noqa: E731
    backward()
    both()
    torch.cuda.synchronize()
    return backward, both


def _variants(heads, heads_kv, d, causal) -> list:
    """kb2 variants timed next to the default (backward alone, launched directly): the old
    GQA path, and the other launch order with a mask."""
    if heads == heads_kv:
        return []
    names = ["kb2", "kb2:gqa=0"]
    if causal and d == 128:
        names.append("kb2:longest_first=0,heads_first=1")
    elif causal:
        names.append("kb2:heads_first=0")         # the MHA grid's natural order
    return names


def _direct(name, q, k, v, do, causal):
    """One kb2 variant's backward alone, launched through the registry (no autograd)."""
    from hopper_attn.harness import registry
    entry = registry.get(name)
    problem = Problem.from_tensor(q, causal, k)
    handle = entry.compile(problem)
    out, lse = hopper_attn.attention(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    call = lambda: entry.run(handle, q, k, v, out, do, lse, dq, dk, dv)  # noqa: E731
    call()
    torch.cuda.synchronize()
    return call


def speed(log) -> list:
    from hopper_attn.harness.timing import L2Flush, benchmark_interleaved
    providers = {"hopper": _hopper, "fa4": None, "cudnn": None, "sdpa_flash": None}
    for name, make in (("fa4", fa4), ("cudnn", lambda: _sdpa("CUDNN_ATTENTION")),
                       ("sdpa_flash", lambda: _sdpa("FLASH_ATTENTION"))):
        try:
            providers[name] = make()
        except Exception as exc:  # noqa: BLE001 - not installed here
            log(f"  {name} unavailable: {type(exc).__name__}: {str(exc)[:80]}")
            del providers[name]
    flush, rows = L2Flush(), []
    columns = ("hopper", "fa4", "cudnn", "sdpa_flash")
    log(f"  {'shape':30} {'':7}" + " ".join(f"{n:>10}" for n in columns)
        + "  hopper/fa4 hopper/cudnn")
    for label, batch, heads, heads_kv, n, d, causal in BENCH:
        q, k, v, do = _inputs(batch, heads, heads_kv, n, n, d, seed=7)
        flops = Problem(batch, heads, n, d, causal, heads_kv=heads_kv).flops
        bwd, both, notes = {}, {}, {}
        for name, forward in providers.items():
            try:
                bwd[name], both[name] = _calls(forward, q, k, v, do, causal)
            except Exception as exc:  # noqa: BLE001 - e.g. a backend without GQA
                notes[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
        for name in _variants(heads, heads_kv, d, causal):
            try:
                bwd[name] = _direct(name, q, k, v, do, causal)
            except Exception as exc:  # noqa: BLE001
                notes[name] = f"{type(exc).__name__}: {str(exc)[:100]}"
        row = {"shape": label, "config": [batch, heads, heads_kv, n, d, causal],
               "flops_forward": flops, "unavailable": notes}
        if notes:
            log(f"  {label}: not run: " + "; ".join(f"{k} ({v[:40]})" for k, v in notes.items()))
        for what, calls, factor in (("bwd", bwd, 2.5), ("fwd+bwd", both, 3.5)):
            timed = benchmark_interleaved(calls, flush)
            row[what] = {name: {**t, "tflops": factor * flops / (t["ms"] * 1e-3) / 1e12}
                         for name, t in timed.items()}
            cells = [f"{row[what][p]['tflops']:10.1f}" if p in row[what] else f"{'-':>10}"
                     for p in columns]
            ratios = [row[what]["hopper"]["tflops"] / row[what][p]["tflops"]
                      if p in row[what] and "hopper" in row[what] else float("nan")
                      for p in ("fa4", "cudnn")]
            row[what]["hopper_over_fa4"], row[what]["hopper_over_cudnn"] = ratios
            log(f"  {label if what == 'bwd' else '':30} {what:7}" + " ".join(cells)
                + f"  {ratios[0]:10.3f} {ratios[1]:11.3f}")
            variants = [name for name in _variants(heads, heads_kv, d, causal)
                        if name in row[what]]
            if variants:
                log(f"  {'':30} kb2 direct: " + ", ".join(
                    f"{name[4:] or 'default'} {row[what][name]['tflops']:.1f}"
                    for name in variants))
        rows.append(row)
        del q, k, v, do, bwd, both
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    return run_check(
        __doc__, "bwd_gqa.json", correctness, lambda log, t0: speed(log),
        "correctness (ratio = max error / (2x torch bf16 error + 2^-12 max|ref|), <= 1 passes):",
        "speed, effective TFLOP/s (backward 2.5x, forward + backward 3.5x the forward's flops), "
        "round-robin medians:")


if __name__ == "__main__":
    sys.exit(main())
