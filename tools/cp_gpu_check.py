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

Packed documents (`PACKED_CASES`, `simulate_ring_varlen`): one packed sequence of documents
(one longer than a rank's chunk, one of length 1, one empty, the rest short) run as the
ring of varlen calls; "single" is one `attention_varlen` call over the whole sequence, the
torch ring is the same ring with torch's flash op per document piece of every block, the
references are per document (fp32, and torch bf16 SDPA); judged by the same rule.

    source .gpu/prelude.sh && python tools/cp_gpu_check.py    # ~1 min; $OUT/cp_gpu_check.json
    python tools/cp_gpu_check.py --quick     # the packed cases and the dense ones at W = 2
    python tools/cp_gpu_check.py --packed    # the packed cases only
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


PACKED_CASES = (
    # (world_size, causal, heads_q, heads_kv, rows per rank, head_dim, layout)
    (2, True, 8, 2, 1024, 128, "zigzag"), (2, False, 8, 2, 1024, 128, "zigzag"),
    (3, True, 4, 4, 600, 128, "zigzag"), (4, True, 8, 2, 1000, 128, "zigzag"),
    (4, False, 4, 4, 512, 128, "zigzag"), (2, True, 4, 2, 300, 64, "zigzag"),
    (3, True, 4, 2, 301, 128, "contiguous"))


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
    _judge(case, results, ref, lowp, ref_lse)
    return case


def _judge(case, results, ref, lowp, ref_lse):
    """Fills `case` with the errors of every result against the fp32 reference `ref`
    (out, dq, dk, dv) and `ref_lse`, the ratios, and ok (the rule in the docstring)."""
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


# ------------------------------------------------------------------ packed documents -------

def packed_documents(n, chunk, seed):
    """Document lengths over n tokens: one longer than a chunk (it crosses ranks), one of
    length 1, one empty, the rest lognormal around a quarter chunk; (int32 offsets on the
    CPU, the longest length)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [min(n - 1, chunk + chunk // 2 + 7), 1, 0]
    while sum(lengths) < n:
        draw = torch.empty(1).log_normal_(0.0, 0.8, generator=gen).item()
        lengths.append(max(1, min(n - sum(lengths), int(chunk / 4 * draw))))
    order = torch.randperm(len(lengths), generator=gen).tolist()
    cu = torch.tensor([0] + [sum(lengths[i] for i in order[:j + 1])
                             for j in range(len(order))], dtype=torch.int32)
    return cu, max(lengths)


def _pieces(block):
    """The (query rows, key rows) of a DocumentBlock's non-empty pieces (reads the offsets
    on the host: a check tool's torch stand-in, not the ring)."""
    cq, ck = block.cu_seqlens_q.tolist(), block.cu_seqlens_k.tolist()
    return [(slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(len(cq) - 1)
            if cq[b + 1] > cq[b] and ck[b + 1] > ck[b]]


def torch_ring_varlen_block_forward(q, k, v, causal, scale, block):
    """torch's flash op on every document piece of a block; rows that see no key: out 0,
    LSE -inf (as the varlen kernel)."""
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32,
                     device=q.device)
    for rows, cols in _pieces(block):
        o, l = torch_ring_block_forward(q[None, rows], k[None, cols], v[None, cols], causal,
                                        scale)
        out[rows], lse[:, rows] = o[0], l[0]
    return out, lse


def torch_ring_varlen_block_backward(q, k, v, out, dout, lse, causal, scale, block):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows, cols in _pieces(block):
        g = torch_ring_block_backward(q[None, rows], k[None, cols], v[None, cols],
                                      out[None, rows], dout[None, rows],
                                      lse[None, :, rows].contiguous(), causal, scale)
        dq[rows], dk[cols], dv[cols] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


def _per_document(cu, fn, *tensors):
    """fn on every non-empty document of packed (N, H, d) tensors as a batch of one; its
    (1, n, H, d) results put back in (N, H, d), its (1, H, n) ones in (H, N) (fp32)."""
    bounds, n = cu.tolist(), tensors[0].shape[0]
    results = None
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b == a:
            continue
        parts = fn(*(t[None, a:b] for t in tensors))
        if results is None:
            results = [torch.zeros((n, *p.shape[2:]) if p.dim() == 4 else (p.shape[1], n),
                                   dtype=torch.float32, device=p.device) for p in parts]
        for r, p in zip(results, parts):
            if p.dim() == 4:
                r[a:b] = p[0].float()
            else:
                r[:, a:b] = p[0].float()
    return results


def run_packed_case(world_size, causal, heads_q, heads_kv, per_rank, d=128, seed=0,
                    layout="zigzag", device="cuda"):
    """One packed-documents case: `simulate_ring_varlen` on the kernels against one
    `attention_varlen` call, the torch ring (torch's flash op per document piece) and the
    per-document references; the same rule and dict as `run_case`."""
    import hopper_attn
    from hopper_attn.context_parallel import simulate_ring_varlen
    from hopper_attn.harness.reference_backward import attention_backward, forward_with_lse
    n = per_rank * world_size
    chunk = per_rank // (2 if layout == "zigzag" else 1)
    cu_host, longest = packed_documents(n, chunk, seed)
    cu = cu_host.to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    q, do = (torch.randn(n, heads_q, d, device=device, generator=gen).to(torch.bfloat16)
             for _ in range(2))
    k, v = (torch.randn(n, heads_kv, d, device=device, generator=gen).to(torch.bfloat16)
            for _ in range(2))
    results = {}
    for name in ("ring", "single", "torch_ring"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if name == "single":
            out, lse = hopper_attn.attention_varlen(*leaves, cu, cu, longest, longest,
                                                    causal=causal, return_lse=True)
        else:
            ops = {} if name == "ring" else dict(
                block_forward=torch_ring_varlen_block_forward,
                block_backward=torch_ring_varlen_block_backward)
            out, lse = simulate_ring_varlen(*leaves, cu, world_size, causal,
                                            max_seqlen=longest, layout=layout,
                                            return_lse=True, **ops)
        out.backward(do)
        results[name] = [out.detach().float()] + [t.grad.float() for t in leaves] + [lse]

    def reference(q_, k_, v_, do_):
        o, l = forward_with_lse(q_, k_, v_, causal)
        return (o, l, *attention_backward(q_, k_, v_, o, l, do_, causal))
    ref_out, ref_lse, *ref_grads = _per_document(cu_host, reference, q, k, v, do)
    ref = [ref_out, *ref_grads]
    lowp = _per_document(cu_host, lambda *t: _torch_bf16(*t, causal), q, k, v, do)
    case = dict(packed=True, world_size=world_size, causal=causal, heads_q=heads_q,
                heads_kv=heads_kv, per_rank=per_rank, d=d, layout=layout,
                documents=(cu_host[1:] - cu_host[:-1]).tolist(), ok=True, ratio={},
                ratio_vs_torch={})
    _judge(case, results, ref, lowp, ref_lse)
    return case


def _refusals():
    """What the ring cannot run raises ValueError before any launch."""
    from hopper_attn.context_parallel import simulate_ring, simulate_ring_varlen
    x = torch.zeros(1, 300, 2, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
    refused = []
    for why, fn, args in (("N % 2W", simulate_ring, (x, x, x, 4)),
                          ("causal q/k lengths", simulate_ring, (x, x[:, :200], x[:, :200], 2)),
                          ("packed: int64 cu_seqlens", simulate_ring_varlen,
                           (x[0], x[0], x[0], cu.long(), 2)),
                          ("packed: N % 2W", simulate_ring_varlen, (x[0], x[0], x[0], cu, 4))):
        try:
            fn(*args, causal=True)
        except ValueError:
            refused.append(why)
    return refused


REFUSALS = 4


def packed_host_syncs(world_size=2, per_rank=1024, heads=(8, 2), d=128):
    """The messages of torch's sync debug mode ("warn") during one packed ring forward and
    backward on the kernels (compiled beforehand): the ring's per-block cu_seqlens are meant
    to need none. Reported, not judged (a launch path below the ring could sync too)."""
    import warnings
    from hopper_attn.context_parallel import simulate_ring_varlen
    n = per_rank * world_size
    cu_host, longest = packed_documents(n, per_rank // 2, 1)
    cu = cu_host.cuda()
    q = torch.randn(n, heads[0], d, device="cuda", dtype=torch.bfloat16).requires_grad_()
    k, v = (torch.randn(n, heads[1], d, device="cuda", dtype=torch.bfloat16)
            .requires_grad_() for _ in range(2))
    do = torch.randn_like(q)

    def step():
        simulate_ring_varlen(q, k, v, cu, world_size, True, max_seqlen=longest).backward(do)
    step()                                    # compiles, caches
    torch.cuda.synchronize()
    from hopper_attn.harness.host_probe import sync_warnings
    caught = sync_warnings(step)
    torch.cuda.synchronize()
    return [str(w.message)[:160] for w in caught]


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
    args = sys.argv[1:]
    if args and not set(args) <= {"--quick", "--packed"}:
        print(f"usage: {sys.argv[0]} [--quick | --packed]")
        return 2
    from hopper_attn.harness.env import environment
    from hopper_attn.harness.gpu_check import env_line, write_json
    env = environment()
    print(env_line(env))
    props = torch.cuda.get_device_properties(0)
    print(f"cp_gpu_check: {props.name}, torch {torch.__version__}; worst of out/dq/dk/dv: "
          "ring error / torch bf16 ring's (judged, <= 2x), / one torch bf16 call's, and the "
          "single attention() call's / one torch call's")
    dense = [] if "--packed" in args else \
        [c for c in CASES if "--quick" not in args or c[0] == 2]
    t0, cases = time.time(), []
    for packed, (w, causal, hq, hk, per_rank, d, layout) in \
            [(False, c) for c in dense] + [(True, c) for c in PACKED_CASES]:
        run = run_packed_case if packed else run_case
        try:
            case = run(w, causal, hq, hk, per_rank, d=d, seed=w * 100 + per_rank + causal,
                       layout=layout)
        except Exception as err:                       # noqa: BLE001 (report and go on)
            case = dict(packed=packed, world_size=w, causal=causal, heads_q=hq, heads_kv=hk,
                        per_rank=per_rank, d=d, ok=False, error=repr(err)[:300])
        cases.append(case)
        head = (f"{'packed ' if packed else ''}W={w} {'causal' if causal else 'full  '} "
                f"H{hq}/{hk} n/rank={per_rank:<4} "
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
    try:
        syncs = packed_host_syncs()
    except Exception as err:                           # noqa: BLE001 (report and go on)
        syncs = [f"error: {err!r}"[:160]]
    print(f"host syncs in one packed ring forward + backward (want 0): {len(syncs)}"
          f"{' first: ' + syncs[0] if syncs else ''}")
    hooks = torch_cp_hooks()
    print(f"torch context_parallel hooks: {hooks}")
    refused = _refusals()
    passed = sum(c["ok"] for c in cases)
    print(f"refused with ValueError: {refused} (want {REFUSALS})")
    print(f"{passed}/{len(cases)} cases pass, {time.time() - t0:.0f} s")
    if os.environ.get("OUT"):
        write_json(dict(env=env, device=props.name, torch=torch.__version__, cases=cases,
                        refused=refused, torch_cp_hooks=hooks, packed_host_syncs=syncs),
                   "cp_gpu_check.json")
    return 0 if passed == len(cases) and len(refused) == REFUSALS else 1


if __name__ == "__main__":
    sys.exit(main())
