"""GPU check of packed variable-length batches (issue 60): correctness, then speed.

    source .gpu/prelude.sh && python tools/varlen_gpu_check.py [--quick] [--out DIR]

1. Correctness of `hopper_attn.attention_varlen` (k6 with `varlen`) per sequence against an
   fp32 reference (harness/varlen_reference.py), FlashAttention's rule: error at most 2x
   torch's own bf16 error on the same sequence (SDPA; + 2^-10), LSE within 1e-3 of the
   reference where finite and -inf where it is (a sequence without keys). Lengths 0, 1, 17,
   113, 1000 and the tails of 64/128/192-row tiles; max_seqlen larger than the longest; GQA
   8/2 with key lengths other than the query lengths (and sequences without queries or
   without keys); seqused_k with the unused keys NaN; 70 sequences (the work list's prefix
   sum over more than one warp step); causal and not; d 64 and 128 (96, 192, 256, fp16, a
   window and a softcap once each). Every case runs the kernel on views into NaN-poisoned
   buffers (64 tokens before and after q, k, v, the output and the LSE): the poison around
   the output and the LSE must stay NaN (nothing written outside the sequences), and two
   runs must give the same bits (and the public call the same bits as the direct one).
   Attention sinks (`sinks_case`): gpt-oss's shape (64 / 8 heads, d 64, causal) over packed
   lognormal documents (median 512, 4k tokens, + 1, 17, 0 and 129 tokens), with window
   (128, 0) and without: O, LSE and dq, dk, dv, dsinks (attention_varlen's autograd) against
   the fp32 per-sequence reference with the sink in the denominator, 2x torch's bf16 error
   (its gpt-oss eager math); one head's sink -inf, one 8; and a forward whose rows see no
   key (output 0, LSE the sink).
2. Speed (skipped with --quick), CUDA events, L2 flushed, round-robin medians: lognormal
   document lengths (median 1k, capped at 16k; seeds printed, lengths in the JSON) filling
   16k and 64k tokens, causal and not, d 64 and 128, 16 heads MHA and GQA 16/4, against
   FlashAttention-4's `flash_attn_varlen_func` and torch's `varlen_attn` (k and v repeated
   for GQA outside the timed call); TFLOP/s from the real per-sequence work. Then equal
   lengths packed against the dense `attention()` call of the same shape (target: within
   3%). Last, one attention-sinks row: gpt-oss's shape over the 16k mix, window (128, 0),
   forward and backward (with dsinks): ours with sinks, without, and FA4's
   `flash_attn_varlen_func(..., learnable_sink=)` (VARLEN_SPEED=sinks: that row alone).

Prints one line per group or timed case; everything goes to $OUT/varlen.json (or --out).
VARLEN_ONLY=<text> keeps the correctness groups whose label contains it (for
compute-sanitizer: VARLEN_ONLY="tails d64" compute-sanitizer --tool memcheck python
tools/varlen_gpu_check.py --quick).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import hopper_attn  # noqa: E402
from hopper_attn.harness.gpu_check import report_groups, lse_bound, run_check  # noqa: E402
from hopper_attn.harness.varlen_reference import (  # noqa: E402
    cu_seqlens, flops, gpt_oss_packed, lognormal_lengths, reference, speed_dims,
    speed_equal_lengths, speed_mixes)

PAD = 64                    # poisoned tokens before and after every tensor
TAILS = [0, 1, 17, 113, 1000, 63, 64, 65, 127, 128, 129, 191, 192, 193, 0, 300]


def poisoned(tokens: int, heads: int, d: int, dtype, seed: int, fill: bool = True,
             scale: float = 1.0):
    """A (tokens, heads, d) view into a buffer with PAD NaN tokens on each side (random
    normal values times `scale` inside when `fill`) and the buffer."""
    buf = torch.full((tokens + 2 * PAD, heads, d), float("nan"), dtype=dtype, device="cuda")
    view = buf[PAD:PAD + tokens]
    if fill:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        view.copy_((torch.randn(view.shape, generator=gen, device="cuda") * scale).to(dtype))
    return view, buf


def run_direct(q, k, v, cu_q, cu_k, max_q, max_k, causal, seqused_k, window, softcap,
               sinks=None):
    """k6 varlen through k6_varlen.run_varlen on poisoned output and LSE buffers: (out, lse,
    the poison around them intact)."""
    from hopper_attn import k6_varlen
    from hopper_attn.common.contract import normalize_window
    total, heads, d = q.shape
    out, out_buf = poisoned(total, heads, d, q.dtype, 0, fill=False)
    lse_buf = torch.full((heads, total + 2 * PAD), float("nan"), device="cuda")
    lse = lse_buf[:, PAD:PAD + total]
    batch = cu_q.shape[0] - 1
    window = normalize_window(window, causal)
    problem = k6_varlen.problem_for(q, k, batch, max_q, max_k, causal, window)
    compiled, _ = k6_varlen.compile_varlen(problem, seqused_k is not None,
                                           sinks=sinks is not None,
                                           **({"softcap": softcap} if softcap else {}))
    k6_varlen.run_varlen(compiled, q, k, v, out, lse, cu_q, cu_k, seqused_k, d ** -0.5, sinks)
    intact = bool(out_buf[:PAD].isnan().all() and out_buf[PAD + total:].isnan().all()
                  and lse_buf[:, :PAD].isnan().all() and lse_buf[:, PAD + total:].isnan().all())
    return out, lse, intact


def case(label, q_lens, k_lens, heads, heads_kv, d, causal, seed, *, max_extra=0,
         dtype=torch.bfloat16, seqused=None, window=(-1, -1), softcap=0.0,
         scale=1.0) -> dict:
    """One packed batch: sequence b has q_lens[b] queries, k_lens[b] keys (seqused: it uses
    only the first seqused[b], the rest NaN)."""
    cu_q, cu_k = cu_seqlens(q_lens), cu_seqlens(k_lens)
    q, _ = poisoned(sum(q_lens), heads, d, dtype, seed, scale=scale)
    k, _ = poisoned(sum(k_lens), heads_kv, d, dtype, seed + 1, scale=scale)
    v, _ = poisoned(sum(k_lens), heads_kv, d, dtype, seed + 2)
    seqused_k = None
    if seqused is not None:
        seqused_k = torch.tensor(seqused, dtype=torch.int32, device="cuda")
        for b, used in enumerate(seqused):         # the keys past seqused_k: NaN
            k[int(cu_k[b]) + used:int(cu_k[b + 1])] = float("nan")
            v[int(cu_k[b]) + used:int(cu_k[b + 1])] = float("nan")
    max_q, max_k = max(q_lens) + max_extra, max(k_lens) + max_extra
    args = (q, k, v, cu_q, cu_k, max_q, max_k, causal, seqused_k, window, softcap)
    out, lse, intact = run_direct(*args)
    out2, lse2, _ = run_direct(*args)
    public, public_lse = hopper_attn.attention_varlen(
        q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, return_lse=True, seqused_k=seqused_k,
        window_size=window, softcap=softcap)
    same_bits = bool(torch.equal(out, out2) and torch.equal(lse.nan_to_num(), lse2.nan_to_num())
                     and torch.equal(out, public)
                     and torch.equal(lse.nan_to_num(), public_lse.nan_to_num()))
    ref, ref_lse = reference(q, k, v, cu_q, cu_k, causal, None, seqused_k, window, softcap)
    low, _ = reference(q, k, v, cu_q, cu_k, causal, None, seqused_k, window, softcap,
                       lowp=True)
    bound = 2 * (low - ref).abs().max().item() + 2 ** -10 if ref.numel() else 1.0
    nan = bool(out.isnan().any())
    err = (out.float() - ref).abs().max().item() if ref.numel() else 0.0
    finite = ref_lse.isfinite()
    lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    # d 192 / 256 and softcap: POLICY's loops sum P rounded to bf16 (what the PV GEMM adds), so
    # l, and the LSE, may differ from the exact sums by up to log(1 + 2^-8), as in the dense call
    lse_ok = bool(torch.equal(lse.isfinite(), finite)) and \
        lse_err < lse_bound(d, softcap)
    ok = not nan and err <= bound and lse_ok and intact and same_bits
    return {"case": [label, q_lens if len(q_lens) <= 16 else f"{len(q_lens)} sequences",
                     k_lens if len(k_lens) <= 16 else "", heads, heads_kv, d, causal,
                     str(dtype).replace("torch.", ""), max_extra, seqused, list(window),
                     softcap, scale],
            "ratio": float("inf") if nan else err / bound, "error": err, "lse_ok": lse_ok,
            "lse_error": lse_err,
            "poison_intact": intact, "same_bits": same_bits, "ok": ok}


def _poison_free_memory():
    """NaN into the caching allocator's free memory: outputs it hands out (the public call's,
    the backward's) show what a kernel leaves unwritten."""
    free = torch.cuda.mem_get_info()[0]
    torch.empty(min(free // 4, 2 << 30) // 4, device="cuda").fill_(float("nan"))


def sinks_case(label, q_lens, k_lens, causal, seed, *, left=-1, backward=True, heads=64,
               heads_kv=8, d=64) -> dict:
    """Attention sinks over a packed batch (gpt-oss's shape by default): the forward (direct
    on poisoned buffers, twice, and the public call) and the backward (dq, dk, dv, dsinks
    through attention_varlen's autograd) against the fp32 per-sequence reference with the
    sink in the denominator (harness/varlen_reference.sink_reference), each within 2x the
    error of the same math in torch's bf16 (+ 2^-10 for O, + 2^-12 max|ref| for gradients);
    the LSE within 1e-3 and -inf exactly where the reference's is. Head 0's sink is -inf
    (none), head 1's 8 (it dominates its rows)."""
    from hopper_attn.harness.varlen_reference import sink_reference
    cu_q, cu_k = cu_seqlens(q_lens), cu_seqlens(k_lens)
    q, _ = poisoned(sum(q_lens), heads, d, torch.bfloat16, seed)
    k, _ = poisoned(sum(k_lens), heads_kv, d, torch.bfloat16, seed + 1)
    v, _ = poisoned(sum(k_lens), heads_kv, d, torch.bfloat16, seed + 2)
    gen = torch.Generator(device="cuda").manual_seed(seed + 3)
    sinks = torch.randn(heads, device="cuda", generator=gen) * 2
    sinks[0], sinks[1] = float("-inf"), 8.0
    window = (left, 0) if left >= 0 else (-1, -1)
    max_q, max_k = max(q_lens), max(k_lens)
    args = (q, k, v, cu_q, cu_k, max_q, max_k, causal, None, window, 0.0, sinks)
    out, lse, intact = run_direct(*args)
    out2, lse2, _ = run_direct(*args)
    mine = [t.detach().requires_grad_(backward) for t in (q, k, v, sinks)]   # (views)
    _poison_free_memory()
    public, public_lse = hopper_attn.attention_varlen(
        *mine[:3], cu_q, cu_k, max_q, max_k, causal=causal, window_size=window,
        sinks=mine[3], return_lse=True)
    same_bits = bool(torch.equal(out, out2) and torch.equal(lse, lse2)
                     and torch.equal(out, public.detach()) and torch.equal(lse, public_lse))
    ref_leaves = [t.detach().float().requires_grad_(backward) for t in (q, k, v, sinks)]
    ref, ref_lse = sink_reference(*ref_leaves[:3], cu_q, cu_k, causal, ref_leaves[3], window)
    low_leaves = [t.detach().clone().requires_grad_(backward) for t in (q, k, v, sinks)]
    low, _ = sink_reference(*low_leaves[:3], cu_q, cu_k, causal, low_leaves[3], window,
                            lowp=True)
    bound = 2 * (low.detach().float() - ref.detach()).abs().max().item() + 2 ** -10
    nan = bool(out.isnan().any() or lse.isnan().any())
    err = (out.float() - ref.detach()).abs().max().item()
    finite = ref_lse.isfinite()
    lse_err = (lse[finite] - ref_lse.detach()[finite]).abs().max().item() if finite.any() \
        else 0.0
    lse_ok = bool(torch.equal(lse.isfinite(), finite)) and lse_err < 1e-3
    ratios = {"out": float("inf") if nan else err / bound}
    if backward:
        do = torch.randn(public.shape, device="cuda", generator=gen).to(torch.bfloat16)
        _poison_free_memory()
        public.backward(do)
        ref.backward(do.float())
        low.backward(do)
        for name, m, r, lo in zip(("dq", "dk", "dv", "dsinks"), mine, ref_leaves, low_leaves):
            torch_err = (lo.grad.float().nan_to_num(0.0) - r.grad).abs().max().item()
            g_bound = 2 * torch_err + 2 ** -12 * max(1.0, r.grad.abs().max().item())
            ratios[name] = float("inf") if m.grad.isnan().any() else \
                (m.grad.float() - r.grad).abs().max().item() / g_bound
    ok = max(ratios.values()) <= 1 and lse_ok and intact and same_bits
    return {"case": [label, q_lens if len(q_lens) <= 16 else f"{len(q_lens)} sequences",
                     k_lens if len(k_lens) <= 16 else "", heads, heads_kv, d, causal,
                     list(window), "sinks"],
            "ratio": max(ratios.values()), "ratios": ratios, "error": err, "lse_ok": lse_ok,
            "lse_error": lse_err, "poison_intact": intact, "same_bits": same_bits, "ok": ok}


def sinks_lengths() -> list:
    """gpt-oss-like packed documents: lognormal (median 512, capped at 2k; seed 61) filling
    4k tokens, then sequences of 1, 17 and 129 tokens and an empty one."""
    return lognormal_lengths(4096, 61, median=512, cap=2048) + [1, 17, 0, 129]


def correctness(log) -> list:
    groups, seed = {}, 0

    only = os.environ.get("VARLEN_ONLY", "")      # e.g. "tails d64" (compute-sanitizer runs)

    def run(label, *args, fn=case, **kwargs):
        nonlocal seed
        seed += 3
        if only not in label:
            return
        try:
            row = fn(label, *args, seed, **kwargs)
        except Exception as exc:  # noqa: BLE001 - reported as a failure
            row = {"case": [label, *args[2:], kwargs], "ok": False, "ratio": float("inf"),
                   "exception": f"{type(exc).__name__}: {str(exc)[:200]}"}
        groups.setdefault(label, []).append(row)

    rng = torch.Generator().manual_seed(5)
    many = [int(x) for x in torch.randint(0, 200, (70,), generator=rng)]
    cross_q, cross_k = [17, 300, 1000, 5, 0, 129], [40, 100, 1300, 0, 7, 129]
    for d in (64, 128):
        for causal in (False, True):
            run(f"tails d{d}", TAILS, TAILS, 4, 4, d, causal)
            run(f"max_seqlen+3000 d{d}", TAILS, TAILS, 4, 4, d, causal, max_extra=3000)
            run(f"gqa 8/2 cross d{d}", cross_q, cross_k, 8, 2, d, causal)
            run(f"seqused_k d{d}", cross_q, [n + 9 for n in cross_k], 8, 2, d, causal,
                seqused=cross_k)
            run(f"70 sequences d{d}", many, many[::-1], 4, 2, d, causal)
    for d in (96, 192, 256):
        for causal in (False, True):
            run("d 96/192/256", [1000, 17, 300], [1000, 17, 300], 4, 4, d, causal)
    run("fp16", TAILS, TAILS, 4, 2, 128, True, dtype=torch.float16)
    run("window (127, 0)", TAILS, TAILS, 4, 2, 128, True, window=(127, 0))
    run("softcap 30", TAILS, TAILS, 4, 2, 128, True, softcap=30.0)
    run("large scores (inputs x4)", TAILS, TAILS, 4, 2, 128, False, scale=4.0)
    # attention sinks, gpt-oss's shape (64 / 8 heads, d 64), causal, window (128, 0) and none
    docs = sinks_lengths()
    for left in (128, -1):
        run(f"sinks gpt-oss w{left}", docs, docs, True, fn=sinks_case, left=left)
    run("sinks rows without keys", [17, 300, 5, 129], [40, 100, 0, 129], True, fn=sinks_case,
        left=128, backward=False)                     # forward: output 0, LSE the sink
    return report_groups(groups, log, ("lse_ok", "poison_intact", "same_bits"))


def _fa4_varlen():
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError:
        from flash_attn.cute.interface import flash_attn_varlen_func

    def run(q, k, v, cu_q, cu_k, max_q, max_k, causal):
        out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                     max_seqlen_q=max_q, max_seqlen_k=max_k, causal=causal)
        return out[0] if isinstance(out, tuple) else out
    return run


def _torch_varlen():
    from torch.nn.attention.varlen import varlen_attn

    def run(q, k, v, cu_q, cu_k, max_q, max_k, causal):
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k,
                           window_size=(-1, 0) if causal else (-1, -1))
    return run




def _fa4_varlen_sinks(cu, n, window):
    """FA4's flash_attn_varlen_func with `learnable_sink` (4.0.0b36 takes it), causal."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError:
        from flash_attn.cute.interface import flash_attn_varlen_func

    def run(q, k, v, sinks):
        out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                     max_seqlen_q=n, max_seqlen_k=n, causal=True,
                                     window_size=window, learnable_sink=sinks)
        return out[0] if isinstance(out, tuple) else out
    return run


def sinks_speed(log, flush) -> dict:
    """One row: gpt-oss's shape (64 / 8 heads, d 64, causal, window (128, 0), sinks) over the
    16k lognormal mix (seed 16), forward and backward (autograd.grad on a kept graph: dq, dk,
    dv and dsinks), ours with sinks, ours without, FA4 with `learnable_sink` where it runs."""
    from hopper_attn.harness.timing import benchmark_interleaved, tflops
    mix = gpt_oss_packed()
    q, k, v, sinks, cu, n, window = (mix[key] for key in ("q", "k", "v", "sinks", "cu",
                                                          "max_seqlen", "window"))
    do = torch.randn_like(q)
    row = {"mix": "lognormal 16k", "seed": 16, "heads": 64, "heads_kv": 8, "d": 64,
           "window": list(window), "notes": {}}

    def ours(q, k, v, s):
        return hopper_attn.attention_varlen(q, k, v, cu, cu, n, n, causal=True,
                                            window_size=window, sinks=s)
    fwd = {"sinks": lambda: ours(q, k, v, sinks), "no_sinks": lambda: ours(q, k, v, None)}
    try:
        fa4 = _fa4_varlen_sinks(cu, n, window)
        fa4(q, k, v, sinks)
        fwd["fa4_sinks"] = lambda: fa4(q, k, v, sinks)
    except Exception as exc:  # noqa: BLE001 - not installed, or no such option
        row["notes"]["fa4"] = f"{type(exc).__name__}: {str(exc)[:100]}"
    row["fwd_ms"] = {name: t["ms"] for name, t in
                     benchmark_interleaved(fwd, flush, target_ms=150, max_reps=30).items()}
    bwd = {}
    # (name, function, with sinks, their gradient too); FA4 again without dsinks if it fails
    runs = [("sinks", ours, True, True), ("no_sinks", ours, False, False)]
    if "fa4_sinks" in fwd:
        runs += [("fa4_sinks", fa4, True, True), ("fa4_sinks", fa4, True, False)]
    for name, fn, with_sinks, with_dsinks in runs:
        if name in bwd:
            continue
        try:
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
            out = fn(*leaves[:3], leaves[3] if with_sinks else None)
            used = leaves if with_dsinks else leaves[:3]
            bwd[name] = (lambda o=out, u=used: torch.autograd.grad(o, u, do, retain_graph=True))
            bwd[name]()
            row["notes"][f"{name}_bwd_dsinks"] = with_dsinks
        except Exception as exc:  # noqa: BLE001
            bwd.pop(name, None)
            row["notes"][f"{name}_bwd"] = f"{type(exc).__name__}: {str(exc)[:100]}"
    row["bwd_ms"] = {name: t["ms"] for name, t in
                     benchmark_interleaved(bwd, flush, target_ms=150, max_reps=20).items()}
    work = flops([int(x) for x in cu.tolist()], [int(x) for x in cu.tolist()], 64, 64, True,
                 window)
    row["fwd_tflops"] = {name: tflops(work, ms) for name, ms in row["fwd_ms"].items()}
    for what in ("fwd", "bwd"):
        ms = row[f"{what}_ms"]
        line = (f"  sinks gpt-oss 16k w128 {what}: sinks {ms['sinks']:.3f} ms, no sinks "
                f"{ms['no_sinks']:.3f} ({ms['sinks'] / ms['no_sinks']:.3f}x)")
        if "fa4_sinks" in ms:
            line += f", fa4 sinks {ms['fa4_sinks']:.3f} ({ms['fa4_sinks'] / ms['sinks']:.2f}x)"
        log(line)
    return row


def speed(log, t0) -> dict:
    from hopper_attn.harness.timing import L2Flush, benchmark_interleaved, tflops
    flush, rows, baselines, notes = L2Flush(), [], {}, {}
    if os.environ.get("VARLEN_SPEED") == "sinks":       # the attention sinks' row alone
        return {"sinks": sinks_speed(log, flush)}
    for name, make in (("fa4", _fa4_varlen), ("torch_varlen", _torch_varlen)):
        try:
            baselines[name] = make()
        except Exception as exc:  # noqa: BLE001 - not installed
            notes[name] = f"{type(exc).__name__}: {str(exc)[:100]}"
    mixes = []
    for total, seed in speed_mixes():
        lengths = lognormal_lengths(total, seed)
        mixes.append((f"lognormal {total // 1024}k", seed, lengths))
        log(f"  mix {total // 1024}k seed {seed}: {len(lengths)} documents, max {max(lengths)}"
            f", lengths {lengths if len(lengths) <= 20 else str(lengths[:20])[:-1] + ', ...]'}")
    for label, seed, lengths in mixes:
        cu = cu_seqlens(lengths)
        n_max = max(lengths)
        for d in speed_dims():
            for heads, heads_kv in ((16, 16), (16, 4)):
                gen = torch.Generator(device="cuda").manual_seed(seed)
                q = torch.randn(sum(lengths), heads, d, device="cuda", generator=gen).bfloat16()
                k = torch.randn(sum(lengths), heads_kv, d, device="cuda", generator=gen) \
                    .bfloat16()
                v = torch.randn_like(k)
                k_rep, v_rep = (t.repeat_interleave(heads // heads_kv, dim=1) for t in (k, v))
                for causal in (False, True):
                    calls = {"ours": lambda: hopper_attn.attention_varlen(
                        q, k, v, cu, cu, n_max, n_max, causal=causal)}
                    for name, fn in baselines.items():
                        kk, vv = (k_rep, v_rep) if name == "torch_varlen" else (k, v)
                        try:
                            fn(q, kk, vv, cu, cu, n_max, n_max, causal)
                            calls[name] = (lambda fn=fn, kk=kk, vv=vv:
                                           fn(q, kk, vv, cu, cu, n_max, n_max, causal))
                        except Exception as exc:  # noqa: BLE001
                            notes[f"{name} {label} d{d} {heads}/{heads_kv} {causal}"] = \
                                f"{type(exc).__name__}: {str(exc)[:100]}"
                    timed = benchmark_interleaved(calls, flush, target_ms=150, max_reps=30)
                    work = flops([int(x) for x in cu.tolist()], [int(x) for x in cu.tolist()],
                                 heads, d, causal)
                    ms = {name: t["ms"] for name, t in timed.items()}
                    row = {"mix": label, "seed": seed, "d": d, "heads": heads,
                           "heads_kv": heads_kv, "causal": causal, "ms": ms,
                           "tflops": {n: tflops(work, t) for n, t in ms.items()}}
                    rows.append(row)
                    line = (f"  {label} d{d} {heads}/{heads_kv} "
                            f"{'causal' if causal else 'full  '} ours "
                            f"{row['tflops']['ours']:.0f} TF/s")
                    for name in baselines:
                        if name in ms:
                            line += f"; {name} {row['tflops'][name]:.0f} " \
                                    f"({ms[name] / ms['ours']:.2f}x)"
                    log(line)
    dense_rows = []
    for batch, n in speed_equal_lengths():
        for d in speed_dims():
            for causal in (False, True):
                gen = torch.Generator(device="cuda").manual_seed(n)
                q, k, v = (torch.randn(batch, n, 16, d, device="cuda", generator=gen)
                           .bfloat16() for _ in range(3))
                qp, kp, vp = (t.reshape(batch * n, 16, d) for t in (q, k, v))
                cu = cu_seqlens([n] * batch)
                calls = {"varlen": lambda: hopper_attn.attention_varlen(
                             qp, kp, vp, cu, cu, n, n, causal=causal),
                         "dense": lambda: hopper_attn.attention(q, k, v, causal=causal)}
                timed = benchmark_interleaved(calls, flush, target_ms=150, max_reps=30)
                ms = {name: t["ms"] for name, t in timed.items()}
                dense_rows.append({"batch": batch, "seqlen": n, "d": d, "causal": causal,
                                   "ms": ms, "varlen_over_dense": ms["varlen"] / ms["dense"]})
                log(f"  equal lengths B{batch} N{n} d{d} {'causal' if causal else 'full  '}: "
                    f"varlen {ms['varlen']:.3f} ms dense {ms['dense']:.3f} ms -> "
                    f"{ms['varlen'] / ms['dense']:.3f}x time")
    return {"mixes": [{"label": m[0], "seed": m[1], "lengths": m[2]} for m in mixes],
            "rows": rows, "equal_lengths": dense_rows, "notes": notes,
            "sinks": sinks_speed(log, flush)}


if __name__ == "__main__":
    sys.exit(run_check(__doc__, "varlen.json", correctness, speed,
                       "correctness (per-sequence fp32 reference; ratio = error / bound, "
                       "<= 1 passes):",
                       "speed (TFLOP/s of the real work; (x): baseline time / ours):"))
