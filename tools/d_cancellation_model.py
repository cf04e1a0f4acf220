"""Why the FA grid's one-key learnable-sinks backward calls fail (issue 63), on the CPU.

    python tools/d_cancellation_model.py [--calls 25,3171] [--seeds 200] [--out DIR]
    python tools/d_cancellation_model.py --calls 3171 --grid-draw    # the grid's own draw
    python tools/d_cancellation_model.py --calls 3171 --d-from bf16_out --seeds 200

With one key per row and a sink, p = exp(s) / (exp(s) + exp(sink)) and the true
dS = p (dP - D) = p (1 - p) dP, since D = rowsum(dO * O) = p dP. kb2 (as every FlashAttention
backward, FA4's sm90 one included) takes D from the bf16 output the forward stored: the
rounding of O (2^-9 of |O|, summed over d columns against dO) is then not multiplied by
(1 - p), and where p is near 1 it dominates dS and so dQ and dK. torch's bf16 reference as
FA's test writes it with sinks runs its softmax in fp32 (only P is rounded, after), so its
backward has no such term: its dS error is 2^-9 of dS itself.

This emulates the kernels' roundings in fp32 torch: the forward's P against the keys'
maximum (the sink joins at the end), bf16 into P V, O stored bf16; P recomputed in fp32 from
the fp32 LSE; dP in fp32 from bf16 dO and V; D in fp32 from the bf16 O and dO; dS rounded to
bf16 before the dQ and dK products, bf16 P before dV; dQ, dK, dV accumulated in fp32, then
bf16. GQA / MQA: kb2 sums a group's dK / dV in fp32 inside a CTA, but where that leaves too
few CTAs it splits each k/v head in `dkv_parts` parts, summed by torch (`kb2_dkv_parts`: six
one-head partials at the grid's MQA one-key calls), stored bf16 before `dkv_fp32` (a second
rounding: "kb2_bf16_parts"), fp32 since (one rounding: "kb2"); FA4 sums the group in fp32
(dk_accum) and rounds once ("fa4"). The deterministic mode
changes only dQ's add order over key tiles (one tile here): nothing to emulate.

Default: many draws (seeds 10,000 + i) of each call with D taken three ways (bf16 O: the
kernel; fp32 O: a forward that kept O's rounding residual; rowsum(P dP): D from the softmax),
judged by the grid's rule (tools/fa_grid_gpu_check.py: fp32 reference, rtol 2 (3 with
softcap), atol from the fp32 reference; FAIL / KNOWN / PASS as the grid says) and FA's own
test's rule (its reference's output and gradients bf16, atol from their bf16 rounding).
`--grid-draw`: each call's own draw (its index as the seed): on a GPU the kernel and the
emulation side by side (max |kernel - emulation|); on the CPU the emulation of the GPU's
inputs (torch's CUDA randn emulated: cuda_randn.py; softcap calls' torch bf16 bound differs
from the GPU's). One line per call and variant; JSON to $OUT/d_cancellation_model.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))     # its sibling tools

import torch  # noqa: E402

# the grid's KNOWN calls of the H200 run (session 8), and #3171, its one dK FAIL
KNOWN_CALLS = (25, 27, 41, 63, 105, 225, 1617, 2769, 3145, 3171)
D_FROM = ("bf16_out", "fp32_out", "p_dp")


def _bf16(t):
    return t.to(torch.bfloat16).float()


def kb2_emulated(q, k, v, sinks, g, left, right, scale, softcap=0.0, d_from="bf16_out",
                 dkv_parts=1, parts_fp32=False):
    """(out, dq, dk, dv, dsinks) with kb2's roundings (module docstring); q, k, v, g bf16
    (batch, seqlen, heads, d), sinks (heads,) fp32 or None. `d_from`: D from the bf16 out
    (the kernel), the fp32 out, or rowsum(P dP). `dkv_parts`: each k/v head's dK / dV in
    that many bf16 partials (fp32 over each part's query heads), summed in fp32 and rounded
    again (kb2's GQA split before `dkv_fp32`, run_backward's torch.sum); `parts_fp32`: the
    partials kept fp32, so one rounding after their sum (kb2's `dkv_fp32`); 1: fp32 over the
    whole group, one rounding (FA4's fp32 dk_accum)."""
    from hopper_attn.harness.window_reference import window_mask
    group = q.shape[2] // k.shape[2]
    qf, gf = q.float(), g.float()
    kf, vf = (t.float().repeat_interleave(group, dim=2) for t in (k, v))
    raw = torch.einsum("bihd,bjhd->bhij", qf, kf) * scale
    s = softcap * torch.tanh(raw / softcap) if softcap else raw
    seen = window_mask(q.shape[1], k.shape[1], left, right, q.device)
    s = s.masked_fill(~seen, float("-inf"))
    # forward: P against the keys' maximum (the sink joins at the end: docs/sinks.md), bf16
    # into the PV product, the fp32 accumulator scaled by 2^(c - t) / L
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - m).nan_to_num(0.0)               # (a row without keys: 0)
    row_sum = e.sum(-1, keepdim=True)
    t = m if sinks is None else torch.maximum(m, sinks.float()[None, :, None, None])
    rebase = torch.exp(m - t).nan_to_num(0.0)
    row_sum = row_sum * rebase
    if sinks is not None:
        row_sum = row_sum + torch.exp(sinks.float()[None, :, None, None] - t)
    lse = t + torch.log(row_sum)
    o32 = torch.einsum("bhij,bjhd->bihd", _bf16(e), vf) * (rebase / row_sum).nan_to_num(
        0.0).permute(0, 2, 1, 3)
    out = _bf16(o32)
    # backward
    p = torch.exp(s - lse)
    dp = torch.einsum("bihd,bjhd->bhij", gf, vf)
    if d_from == "bf16_out":
        d_rows = (gf * out).sum(-1).transpose(1, 2)[..., None]
    elif d_from == "fp32_out":
        d_rows = (gf * o32).sum(-1).transpose(1, 2)[..., None]
    else:
        d_rows = (p * dp).sum(-1, keepdim=True)
    ds = p * (dp - d_rows)
    if softcap:
        ds = ds * (1 - torch.tanh(raw / softcap) ** 2)
    ds16 = _bf16(ds)
    dq = _bf16(torch.einsum("bhij,bjhd->bihd", ds16, kf) * scale)

    def per_kv_head(t):          # (b, n, heads, d) -> sum over each group (module docstring)
        if dkv_parts == 1:
            return _bf16(t.unflatten(2, (k.shape[2], group)).sum(3))
        parts = t.unflatten(2, (k.shape[2] * dkv_parts, group // dkv_parts)).sum(3)
        parts = parts if parts_fp32 else _bf16(parts)
        return _bf16(parts.unflatten(2, (k.shape[2], dkv_parts)).sum(3))
    dk = per_kv_head(torch.einsum("bhij,bihd->bjhd", ds16, qf) * scale)
    dv = per_kv_head(torch.einsum("bhij,bihd->bjhd", _bf16(p), gf))
    dsinks = None
    if sinks is not None:
        dsinks = -(torch.exp(sinks.float()[None, :, None] - lse[..., 0]) * d_rows[..., 0]).sum(
            (0, 2))
    return out, dq, dk, dv, dsinks


def emulated_attention(d_from="bf16_out", dkv_parts=1, parts_fp32=False):
    """An attention() stand-in (differentiable) whose forward and backward are
    `kb2_emulated`'s: what fa_grid_gpu_check.run_case checks in place of the GPU."""
    from hopper_attn.common.contract import normalize_window

    class Emulated(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, sinks, left, right, softcap):
            ctx.save_for_backward(q, k, v, sinks)      # (sinks: None allowed)
            ctx.mask = (left, right, softcap)
            g = torch.zeros_like(q[..., :v.shape[-1]])
            return kb2_emulated(q, k, v, sinks, g, left, right, q.shape[-1] ** -0.5,
                                softcap, d_from, dkv_parts, parts_fp32)[0].to(q.dtype)

        @staticmethod
        def backward(ctx, g):
            q, k, v, sinks = ctx.saved_tensors
            left, right, softcap = ctx.mask
            _, dq, dk, dv, dsinks = kb2_emulated(q, k, v, sinks, g, left, right,
                                                 q.shape[-1] ** -0.5, softcap, d_from,
                                                 dkv_parts, parts_fp32)
            return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                    None if sinks is None else dsinks.to(sinks.dtype), None, None, None)

    def attention(q, k, v, *, causal, window_size, softcap, sinks, deterministic):
        left, right = normalize_window(window_size, causal)
        return Emulated.apply(q, k, v, sinks, left, 0 if causal else right, softcap)
    return attention


def kb2_dkv_parts(case) -> int:
    """How many dK / dV partials kb2 writes per k/v head for the grid call `case` (1:
    MHA; GQA: masking.dkv_parts on 132 SMs, what the GQA variant's `dkv_heads` picks on an
    H200; a non-GQA kernel with a group: one per query head, summed by torch)."""
    return kb2_dkv_design(case)[0]


def kb2_dkv_design(case) -> tuple:
    """(partials per k/v head, whether they are fp32: kb2's `dkv_fp32`) for the grid call
    `case`. The kernel object only (no compile)."""
    import fa_grid_gpu_check as grid
    from hopper_attn import api, kb2
    from hopper_attn.common.contract import Problem, normalize_window

    class Made(Exception):
        pass

    def made(spec, factory, problem, options=None, **_):
        options = dict(options or {})
        if problem.dv != problem.head_dim:
            options["head_dim_v"] = problem.dv
        raise Made(factory(problem.head_dim, problem.causal, **options), problem, options)
    meta = dict(device="meta", dtype=torch.bfloat16)
    q = torch.empty(case.batch, case.seqlen_q, grid.HEADS, case.d, **meta)
    k = torch.empty(case.batch, case.seqlen_k, case.heads_kv, case.d, **meta)
    v = torch.empty(case.batch, case.seqlen_k, case.heads_kv, case.dv, **meta)
    problem = Problem.from_tensor(q, case.causal, k,
                                  normalize_window(case.window_size(), case.causal), v)
    saved, kb2.compile_backward = kb2.compile_backward, made
    try:
        api._backward_entry(problem, case.deterministic, case.softcap).compile(problem)
        raise AssertionError("kb2 did not compile")
    except Made as found:
        kernel, problem, options = found.args
    finally:
        kb2.compile_backward = saved
    heads = kernel.dkv_heads(problem) if getattr(kernel, "gqa", False) else problem.heads
    return heads // problem.kv_heads, bool(options.get("dkv_fp32"))


def _fa_rule(ours, ref16, low, rtol, atol_extra):
    """FA's test: ref and its atol in bf16."""
    atol = 2 * (ref16 + 0.3 - 0.3 - ref16).abs().max().item() + atol_extra
    err = (ours.float() - ref16.float()).abs().max().item()
    torch_err = (low.float() - ref16.float()).abs().max().item()
    bound = rtol * torch_err + atol
    return {"error": err, "torch_error": torch_err, "bound": bound, "ratio": err / bound}


def one_call(case, seed, d_from, dkv_parts=1, parts_fp32=False):
    """The grid's inputs for `case` drawn with `seed`; {tensor: grid verdict, ...}."""
    import fa_grid_gpu_check as grid
    from hopper_attn.common.contract import normalize_window
    from hopper_attn.harness.window_reference import reference
    torch.manual_seed(seed)
    bf16 = torch.bfloat16
    q = torch.randn(case.batch, case.seqlen_q, grid.HEADS, case.d)
    if case.softcap:
        q = q * case.softcap / 4
    q = q.to(bf16)
    k = torch.randn(case.batch, case.seqlen_k, case.heads_kv, case.d).to(bf16)
    v = torch.randn(case.batch, case.seqlen_k, case.heads_kv, case.dv).to(bf16)
    sinks = torch.randn(grid.HEADS).to(bf16)
    left, right = normalize_window(case.window_size(), case.causal)
    right = 0 if case.causal else right
    scale, rtol = case.d ** -0.5, 3 if case.softcap else 2
    atol = 3e-4 if case.softcap else 0.0
    g = torch.randn(case.batch, case.seqlen_q, grid.HEADS, case.dv).to(bf16)
    ours = kb2_emulated(q, k, v, sinks.float(), g, left, right, scale, case.softcap, d_from,
                        dkv_parts, parts_fp32)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    sink32 = sinks.float().requires_grad_()
    ref, _ = reference(*leaves, left, right, scale, case.softcap, sink32)
    refs = torch.autograd.grad(ref, leaves + [sink32], g.float())
    lows = [t.clone().requires_grad_() for t in (q, k, v)]
    low_sinks = sinks.clone().requires_grad_()
    low = grid.torch_bf16(*lows, left, right, scale, case.softcap, low_sinks)
    lowg = torch.autograd.grad(low, lows + [low_sinks], g)
    # FA's own reference: the fp32 math, its output rounded to bf16, gradients w.r.t. bf16
    fa_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fa_sinks = sinks.clone().requires_grad_()
    fa_ref, _ = reference(*fa_leaves, left, right, scale, case.softcap, fa_sinks.float())
    fa_ref = fa_ref.to(bf16)
    fa_refs = torch.autograd.grad(fa_ref, fa_leaves, g)
    floor = 2 ** -16 * max(r.abs().max().item() for r in refs[:3])
    row = {"out": grid._judge(ours[0], ref.detach(), low.detach(), rtol)}
    for i, name in enumerate(("dq", "dk", "dv"), 1):
        row[name] = grid._judge(ours[i], refs[i - 1], lowg[i - 1], rtol, atol, floor)
        row[name]["fa_rule"] = _fa_rule(ours[i], fa_refs[i - 1], lowg[i - 1], rtol, atol)
    row["dsinks"] = grid._judge_dsink(ours[4].to(bf16), refs[3], lowg[3], rtol, atol)
    return row


class _Capture(torch.autograd.Function):
    """Identity; keeps the gradient that flows through it in `store[name]`."""
    @staticmethod
    def forward(ctx, x, store, name):
        ctx.store, ctx.name = store, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.store[ctx.name] = g.detach().clone()
        return g, None, None


def capturing(attention, store):
    """`attention` whose q, k, v, sinks gradients (and output) land in `store`."""
    def wrapped(q, k, v, *, sinks=None, **kw):
        q, k, v = (_Capture.apply(t, store, n) for t, n in ((q, "dq"), (k, "dk"), (v, "dv")))
        if sinks is not None:
            sinks = _Capture.apply(sinks, store, "dsinks")
        out = attention(q, k, v, sinks=sinks, **kw)
        store["out"] = out.detach().clone()
        return out
    return wrapped


@contextlib.contextmanager
def cuda_draws():
    """torch.manual_seed / randn / randn_like as on a CUDA device, on the CPU (cuda_randn.py):
    run_case(case, dev="cpu") inside draws the grid's GPU inputs of `case`."""
    from cuda_randn import CudaRandn
    saved = torch.manual_seed, torch.randn, torch.randn_like
    state = {}

    def manual_seed(seed):
        state["gen"] = CudaRandn(int(seed))
        return saved[0](seed)

    def randn(*shape, **_):
        shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
        return state["gen"].randn(*shape)

    def randn_like(t, **_):
        return state["gen"].randn(*t.shape).to(t.dtype)
    torch.manual_seed, torch.randn, torch.randn_like = manual_seed, randn, randn_like
    try:
        yield
    finally:
        torch.manual_seed, torch.randn, torch.randn_like = saved


def grid_draw(case, gpu: bool) -> dict:
    """The grid's own draw of `case` (its seed) through the grid's checks: the emulation with
    kb2's dK / dV partials as it stores them now ("kb2_model": fp32 where `dkv_fp32`), with
    bf16 partials (kb2 before it, "kb2_bf16_parts_model", where the group is split) and with
    FA4's fp32 group sum ("fa4_model"); on a GPU also the kernel (attention()) and
    max |kernel - emulation| per tensor; on the CPU the CUDA draws emulated (cuda_draws)."""
    import fa_grid_gpu_check as grid
    parts, fp32 = kb2_dkv_design(case)
    runs = [("kb2_model", emulated_attention("bf16_out", parts, fp32)),
            ("fa4_model", emulated_attention("bf16_out", 1))]
    if parts > 1:
        runs.insert(1, ("kb2_bf16_parts_model", emulated_attention("bf16_out", parts)))
    if gpu:
        import hopper_attn
        runs.insert(0, ("kernel", hopper_attn.attention))
    row, seen = {"dkv_parts": parts, "dkv_fp32": fp32}, {}
    for name, attention in runs:
        seen[name] = {}
        with contextlib.nullcontext() if gpu else cuda_draws():
            r = grid.run_case(case, attention=capturing(attention, seen[name]),
                              dev="cuda" if gpu else "cpu")
        row[name] = {"status": r["status"], "ratio": r.get("ratio"), "worst": r.get("worst"),
                     **{n: {"error": v["error"], "bound": v.get("bound"), "ok": v["ok"],
                            "d_from_output": v.get("d_from_output")}
                        for n, v in r.items() if isinstance(v, dict)}}
        if "kernel" in seen and name != "kernel":
            row[name]["max_abs_vs_kernel"] = {
                n: (t.float() - seen["kernel"][n].float()).abs().max().item()
                for n, t in seen[name].items() if n in seen["kernel"]}
            # per row (sequence position) of dq / dk: where the kernel parts from the model
            row[name]["by_row_vs_kernel"] = {
                n: (seen[name][n].float() - seen["kernel"][n].float()).abs().amax(
                    (0, 2, 3)).tolist()[:16] for n in ("dq", "dk")}
    return row


def draw_statistics(case, seeds, d_from, parts, parts_fp32=False) -> dict:
    """`seeds` draws of `case` (seeds 10,000 + i, the grid's draw for another index) through
    the grid's checks with the emulation: statuses, failing tensors, error / bound."""
    import dataclasses

    import fa_grid_gpu_check as grid
    attention = emulated_attention(d_from, parts, parts_fp32)
    statuses = {"PASS": 0, "FAIL": 0, "KNOWN": 0}
    failing = {}
    ratio = {n: [] for n in ("dq", "dk", "dv", "out", "dsinks")}
    over_torch = {n: [] for n in ("dq", "dk")}
    fa_rule = []
    for seed in range(seeds):
        row = grid.run_case(dataclasses.replace(case, index=10_000 + seed),
                            attention=attention, dev="cpu")
        statuses[row["status"]] += 1
        for n in ratio:
            ratio[n].append(row[n]["ratio"])
            if row["status"] == "FAIL" and not row[n]["ok"]:
                failing[n] = failing.get(n, 0) + 1
        for n in over_torch:
            over_torch[n].append(row[n]["error"] / row[n]["torch_error"])
        fa = one_call(case, 10_000 + seed, d_from, parts, parts_fp32)
        fa_rule.append(max(fa[n]["fa_rule"]["ratio"] for n in ("dq", "dk", "dv")))
    t = {n: torch.tensor(r) for n, r in ratio.items()}
    e = {n: torch.tensor(r) for n, r in over_torch.items()}
    return {"grid_status": statuses, "fail_fraction": statuses["FAIL"] / seeds,
            "known_fraction": statuses["KNOWN"] / seeds, "failing_tensors": failing,
            "grid_ratio_max": {n: r.max().item() for n, r in t.items()},
            "error_over_torch_median": {n: r.median().item() for n, r in e.items()},
            "error_over_torch_p99": {n: r.quantile(0.99).item() for n, r in e.items()},
            "fa_rule_ratio_max": max(fa_rule),
            "fa_rule_fail": sum(r > 1 for r in fa_rule) / len(fa_rule)}


def main(argv=None) -> int:
    import fa_grid_gpu_check as grid
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--calls", "--cases", dest="calls",
                        default=",".join(map(str, KNOWN_CALLS[:6] + KNOWN_CALLS[8:])),
                        help="grid call indices (comma-separated; default: the KNOWN calls "
                             "and #3171 but for the long #1617 and #2769)")
    parser.add_argument("--grid-draw", action="store_true",
                        help="each call's own grid draw (its seed): the emulation, and on a "
                             "GPU the kernel too (on the CPU the CUDA draws are emulated)")
    parser.add_argument("--d-from", default="all", choices=("all",) + D_FROM,
                        help="the draws' D (default: each of the three)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    cases = grid.enumerate_grid()
    calls = [cases[int(i)] for i in args.calls.replace(" ", ",").split(",") if i]
    report = {"seeds": args.seeds, "calls": {}}
    if args.grid_draw:
        gpu = torch.cuda.is_available()
        report = {"grid_draw": {}, "gpu": gpu}
        if gpu:
            from hopper_attn.harness.env import environment
            report["env"] = environment()
        for case in calls:
            report["grid_draw"][case.label()] = row = grid_draw(case, gpu)
            line = " ".join(f"{n} {row[n]['status']} {row[n]['ratio']:.3f} ({row[n]['worst']})"
                            for n in ("kernel", "kb2_model", "kb2_bf16_parts_model",
                                      "fa4_model") if n in row)
            if gpu:
                diff = row["kb2_model"]["max_abs_vs_kernel"]
                line += f"; |kernel - kb2_model| dq {diff['dq']:.1e} dk {diff['dk']:.1e}"
            print(f"{case.label()[:48]:48s} {line}", flush=True)
    for case in [] if args.grid_draw else calls:
        parts, fp32 = kb2_dkv_design(case)
        # kb2: its dK / dV partials (fp32 where dkv_fp32); kb2_bf16_parts: bf16 partials (kb2
        # before dkv_fp32); fa4: one fp32 sum over the group (the same for MHA)
        designs = {"kb2": (parts, fp32), "kb2_bf16_parts": (parts, False), "fa4": (1, False)} \
            if parts > 1 else {"kb2": (1, False)}
        report["calls"][case.label()] = per_variant = {"dkv_parts": parts, "dkv_fp32": fp32}
        for design, (n, n_fp32) in designs.items():
            for d_from in D_FROM if args.d_from == "all" else (args.d_from,):
                v = per_variant[f"{design}/{d_from}"] = draw_statistics(case, args.seeds,
                                                                         d_from, n, n_fp32)
                print(f"{case.label()[:44]:44s} {design} D {d_from:8s}: grid "
                      f"{v['grid_status']} failing {v['failing_tensors']}; err/torch dq "
                      f"{v['error_over_torch_median']['dq']:.2f} (p99 "
                      f"{v['error_over_torch_p99']['dq']:.2f}) dk "
                      f"{v['error_over_torch_median']['dk']:.2f} (p99 "
                      f"{v['error_over_torch_p99']['dk']:.2f}); FA's rule fails "
                      f"{v['fa_rule_fail']:.3f}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "d_cancellation_model.json"), "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
