"""The simulated ring (hopper_attn/context_parallel.py) on the real kernels, one GPU.

Every case runs `simulate_ring` (W ranks' forward and backward programs in lockstep, the
kernels for every block), one `attention()` call, and two torch bf16 references on the
same bf16 inputs, and measures all against the fp32 reference
(hopper_attn/harness/reference_backward.py):

- "torch": one torch bf16 attention (SDPA forward, autograd backward), the rule for a
  single call;
- "torch ring": the same ring (`simulate_ring`, same schedule, fp32 merge and fp32
  accumulation) with torch's flash-attention ops per block (the ops torch's own
  context_parallel calls): per-block bf16 O / dQ / dK / dV, like the kernels. The "same
  math in bf16" for a ring: every step's bf16 rounding is in it (docs/context-parallel.md,
  "Precision").

A case passes when the ring's error is at most 2x the torch ring's plus the project's usual
slack for the output, dQ, dK and dV, and its LSE is within 2^-9 of the fp32 reference
(beyond the single call's own error). The ratio to one torch bf16 call is reported too, not
judged: a ring rounds each step's partial to bf16, one call only its result. Printed: one
line per case (the worst of out/dq/dk/dv: ring / torch ring, ring / torch, and the single
call / torch), < 40 lines.

    source .gpu/prelude.sh && python tools/cp_gpu_check.py    # ~1 min; $OUT/cp_gpu_check.json
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = (
    # (world_size, causal, heads_q, heads_kv, rows per rank, head_dim, layout)
    *[(w, c, hq, hk, 512, 128, "zigzag") for w in (1, 2, 4, 8) for c in (False, True)
      for hq, hk in ((4, 4), (8, 2))],
    # chunks of 150, 99, 75 and 125 rows; 151 rows per rank (contiguous layout)
    *[(w, c, 4, 2, n, d, layout) for w, n, d, layout in (
        (2, 300, 128, "zigzag"), (4, 198, 64, "zigzag"), (8, 150, 128, "zigzag"),
        (3, 250, 64, "zigzag"), (3, 151, 128, "contiguous")) for c in (False, True)],
)


def _torch_bf16(q, k, v, do, causal):
    """torch's own bf16 output and gradients (SDPA; enable_gqa for fewer k/v heads)."""
    import torch.nn.functional as F
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                       enable_gqa=q.shape[2] != k.shape[2])
    o.backward(do.transpose(1, 2))
    return [t.transpose(1, 2).float() for t in (o.detach(), qt.grad, kt.grad, vt.grad)]


def _to_bhnd(t):
    return t.transpose(1, 2)


def _fold_heads(t, kv_heads):
    """(B, N, H, d) gradients of repeated k/v heads summed per k/v head (fp32), in t's dtype:
    what autograd does through SDPA's repeat for GQA, one rounding."""
    b, n, h, d = t.shape
    return t.float().reshape(b, n, kv_heads, h // kv_heads, d).sum(3).to(t.dtype)


def _flash_forward(q, k, v, causal, scale):
    """torch's flash-attention op on one block: bf16 out (B, N, H, d), fp32 lse (B, H, N),
    and the op's auxiliary outputs its backward takes."""
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        _to_bhnd(q), _to_bhnd(k), _to_bhnd(v), 0.0, causal, False, scale=scale)
    return _to_bhnd(res[0]), res[1][..., :q.shape[1]].contiguous(), res


def torch_ring_block_forward(q, k, v, causal, scale):
    out, lse, _ = _flash_forward(q, k, v, causal, scale)
    return out, lse


def torch_ring_block_backward(q, k, v, out, dout, lse, causal, scale):
    """torch's flash backward op on one block, given the ring's final out and LSE (as torch's
    context_parallel calls it); bf16 dq, dk, dv."""
    _, block_lse, aux = _flash_forward(q, k, v, causal, scale)    # the op's aux outputs
    lse_in = torch.zeros_like(aux[1])
    lse_in[..., :q.shape[1]] = lse
    group = q.shape[2] // k.shape[2]
    kr, vr = (t.repeat_interleave(group, dim=2) for t in (k, v))
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        _to_bhnd(dout), _to_bhnd(q), _to_bhnd(kr), _to_bhnd(vr), _to_bhnd(out), lse_in,
        aux[2], aux[3], aux[4], aux[5], 0.0, causal, aux[6], aux[7], scale=scale)
    return _to_bhnd(dq), _fold_heads(_to_bhnd(dk), k.shape[2]), _fold_heads(_to_bhnd(dv),
                                                                         k.shape[2])


def run_case(world_size, causal, heads_q, heads_kv, per_rank, d=128, seed=0,
             layout="zigzag", batch=2, device="cuda"):
    """One case: dict with the errors (max abs vs fp32) of ring, single call, torch and
    the torch ring for out/dq/dk/dv, both ratios, the LSE errors, and ok."""
    import hopper_attn
    from hopper_attn.context_parallel import simulate_ring
    from hopper_attn.harness.reference_backward import attention_backward, forward_with_lse
    n = per_rank * world_size
    gen = torch.Generator(device=device).manual_seed(seed)
    q, do = (torch.randn(batch, n, heads_q, d, device=device, generator=gen)
             .to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(batch, n, heads_kv, d, device=device, generator=gen)
            .to(torch.bfloat16) for _ in range(2))
    results = {}
    for name in ("ring", "single", "torch_ring"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if name == "single":
            out, lse = hopper_attn.attention(*leaves, causal=causal, return_lse=True)
        else:
            ops = {} if name == "ring" else dict(block_forward=torch_ring_block_forward,
                                                 block_backward=torch_ring_block_backward)
            out, lse = simulate_ring(*leaves, world_size, causal=causal, layout=layout,
                                     return_lse=True, **ops)
        out.backward(do)
        results[name] = [out.detach().float()] + [t.grad.float() for t in leaves] + [lse]
    ref_out, ref_lse = forward_with_lse(q, k, v, causal)
    ref = [ref_out, *attention_backward(q, k, v, ref_out, ref_lse, do, causal)]
    lowp = _torch_bf16(q, k, v, do, causal)
    case = dict(world_size=world_size, causal=causal, heads_q=heads_q, heads_kv=heads_kv,
                per_rank=per_rank, d=d, batch=batch, layout=layout, ok=True, ratio={},
                ratio_vs_torch={})
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        r = ref[i]
        torch_err = (lowp[i] - r).abs().max().item()
        errs = {name: (results[name][i] - r).abs().max().item() for name in results}
        slack = 2 ** -10 if what == "out" else 2 ** -12 * max(1.0, r.abs().max().item())
        finite = all(torch.isfinite(results[name][i]).all().item() for name in results)
        # judged against the same math in bf16: the torch ring
        ok = finite and errs["ring"] <= 2 * errs["torch_ring"] + slack
        case[what] = dict(torch=torch_err, **errs, ok=ok)
        case["ratio"][what] = errs["ring"] / max(errs["torch_ring"], 1e-30)
        case["ratio_vs_torch"][what] = errs["ring"] / max(torch_err, 1e-30)
        case["ok"] &= ok
    lse_errs = {name: (results[name][4] - ref_lse).abs().max().item() for name in results}
    case["lse"] = dict(lse_errs, ok=lse_errs["ring"] <= lse_errs["single"] + 2 ** -9)
    case["ok"] &= case["lse"]["ok"]
    return case


def _refusals():
    """What the ring cannot run raises ValueError before any launch."""
    from hopper_attn.context_parallel import simulate_ring
    x = torch.zeros(1, 300, 2, 64, device="cuda", dtype=torch.bfloat16)
    refused = []
    for why, args in (("N % 2W", (x, x, x, 4)),
                      ("causal q/k lengths", (x, x[:, :200], x[:, :200], 2))):
        try:
            simulate_ring(*args, causal=True)
        except ValueError:
            refused.append(why)
    return refused


def torch_cp_hooks():
    """Does this torch have what docs/context-parallel.md relies on for torch's own
    context_parallel to run on this project's kernels?"""
    import inspect
    import torch.nn.attention as nn_attention
    found = dict(register_flash_attention_impl=hasattr(nn_attention,
                                                       "register_flash_attention_impl"))
    if hasattr(nn_attention, "list_flash_attention_impls"):
        found["impls"] = nn_attention.list_flash_attention_impls()
    try:
        from torch.distributed.tensor.experimental import _attention as cp_attention
        ring = inspect.getsource(inspect.getmodule(cp_attention._templated_ring_attention))
        found["ring_calls_sdpa_flash_op"] = "aten._scaled_dot_product_flash_attention" in ring
        found["ring_backward_takes_final_lse"] = "logsumexp=lse" in ring
    except (ImportError, AttributeError, OSError) as err:
        found["ring"] = repr(err)[:120]
    return found


def main():
    from hopper_attn.harness.env import environment
    from hopper_attn.harness.gpu_check import env_line, write_json
    env = environment()
    print(env_line(env))
    props = torch.cuda.get_device_properties(0)
    print(f"cp_gpu_check: {props.name}, torch {torch.__version__}; worst of out/dq/dk/dv: "
          "ring error / torch bf16 ring's (judged, <= 2x), / one torch bf16 call's, and the "
          "single attention() call's / one torch call's")
    t0, cases = time.time(), []
    for w, causal, hq, hk, per_rank, d, layout in CASES:
        try:
            case = run_case(w, causal, hq, hk, per_rank, d=d, seed=w * 100 + per_rank + causal,
                            layout=layout)
        except Exception as err:                       # noqa: BLE001 (report and go on)
            case = dict(world_size=w, causal=causal, heads_q=hq, heads_kv=hk,
                        per_rank=per_rank, d=d, ok=False, error=repr(err)[:300])
        cases.append(case)
        head = (f"W={w} {'causal' if causal else 'full  '} H{hq}/{hk} n/rank={per_rank:<4} "
                f"d={d:<3}{' contiguous' if layout == 'contiguous' else ''}")
        if "error" in case:
            print(f"{head} FAIL {case['error'][:100]}")
            continue
        worst = max(case["ratio"], key=case["ratio"].get)
        vs_torch = max(case["ratio_vs_torch"], key=case["ratio_vs_torch"].get)
        single = max(case[w_]["single"] / max(case[w_]["torch"], 1e-30)
                     for w_ in ("out", "dq", "dk", "dv"))
        print(f"{head} {'ok  ' if case['ok'] else 'FAIL'} ring/torch-ring "
              f"{case['ratio'][worst]:.2f}x ({worst}) ring/torch "
              f"{case['ratio_vs_torch'][vs_torch]:.2f}x ({vs_torch}) single {single:.2f}x  "
              f"lse {case['lse']['ring']:.1e}")
    hooks = torch_cp_hooks()
    print(f"torch context_parallel hooks: {hooks}")
    refused = _refusals()
    passed = sum(c["ok"] for c in cases)
    print(f"refused with ValueError: {refused} (want 2)")
    print(f"{passed}/{len(cases)} cases pass, {time.time() - t0:.0f} s")
    if os.environ.get("OUT"):
        write_json(dict(env=env, device=props.name, torch=torch.__version__, cases=cases,
                        refused=refused, torch_cp_hooks=hooks), "cp_gpu_check.json")
    return 0 if passed == len(cases) and len(refused) == 2 else 1


if __name__ == "__main__":
    sys.exit(main())
