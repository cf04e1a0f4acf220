"""GPU check of the varlen backward (issue 60): correctness, then speed against FA4 and torch.

    python tools/varlen_bwd_gpu_check.py [--quick] [--out DIR]

1. Correctness: dq, dk, dv of a packed batch against per-sequence references. The forward is
   `hopper_attn.attention_varlen` (its autograd backward, when the package has it; else the
   forward is fp32 torch per sequence, its output cast to bf16, and the backward is called
   directly: common/varlen_backward.varlen_backward). References: fp32 per sequence
   (harness/reference_backward.py; with a window or a softcap an fp32 autograd of the same
   masked softmax), and torch's own bf16 backward per sequence (SDPA; with a window or
   softcap the same autograd in bf16). FlashAttention's rule: a gradient passes when its
   max error <= 2x torch's bf16 error (+ 2^-12 x max |ref|). Inputs live inside NaN-filled
   buffers (a read past a tensor's rows shows as NaN). Lengths 0, 1, 17, 113, 1000, GQA with
   cross lengths (groups split in parts, as such small batches are, and whole), MQA,
   seqused_k, causal and not, d 64 and 128, a window and a softcap, a sequence of 2100
   tokens and equal lengths of 2k (the work list's head groups).
2. Speed (skipped with --quick): the backward alone (autograd.grad on a kept graph; CUDA
   events, L2 flushed, round-robin medians) on tools/varlen_gpu_check.py's document mixes
   (lognormal lengths, median 1k, capped at 16k, seeds 16 and 64, filling 16k and 64k
   tokens; harness/varlen_reference.py), MHA 16 heads and GQA 16/4, d 64 and 128, causal
   and not: ours (attention_varlen's autograd) against FA4's flash_attn_varlen_func and
   torch's varlen_attn (k, v repeated for GQA), and ours with the work list in the batch's
   order instead of longest first, and with the dQ conversion after the whole main kernel
   (no per-sequence early start); TFLOP/s of the real per-sequence work, backward = 2.5x
   the forward's. Then equal lengths (8 x 2k, 4 x 16k, 16 heads) against
   the dense call's backward (kb2) of the same shape (VARLEN_EQUAL_ONLY=1 with --speed-only:
   those rows alone, both shapes).

Prints one line per case; everything goes to $OUT/varlen_bwd.json (or --out).
"""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import hopper_attn  # noqa: E402
from hopper_attn.common.varlen_backward import varlen_backward  # noqa: E402
from hopper_attn.harness.gpu_check import run_check  # noqa: E402
from hopper_attn.harness.grad_check import _torch_lowp_grads  # noqa: E402
from hopper_attn.harness.reference_backward import (attention_backward,  # noqa: E402
                                                    forward_with_lse)

GUARD = 256          # NaN rows before and after every input


def _guarded(rows, heads, d, dtype, gen, fill=True):
    buf = torch.full((rows + 2 * GUARD, heads, d), float("nan"), dtype=dtype, device="cuda")
    view = buf[GUARD:GUARD + rows]
    if fill:
        view.copy_(torch.randn(rows, heads, d, device="cuda", generator=gen).to(dtype))
    return view


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _masked_scores(q, k, causal, window, softcap, scale):
    """(H, Lq, Lk) scores of one sequence (k already repeated to q's heads), masked."""
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    lq, lk = q.shape[0], k.shape[0]
    r = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
    j = torch.arange(lk, device=q.device)[None, :]
    left, right = window
    right = 0 if causal else right
    hidden = torch.zeros(lq, lk, dtype=torch.bool, device=q.device)
    if right >= 0:
        hidden |= j > r + right
    if left >= 0:
        hidden |= j < r - left
    return s.masked_fill(hidden, float("-inf"))


def _autograd_sequence(q, k, v, do, causal, window, softcap, dtype):
    """(out, lse, dq, dk, dv) of one sequence in `dtype` math (fp32 reference, or bf16 for
    torch's error), by autograd through the masked softmax."""
    group = q.shape[1] // k.shape[1]
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    kk, vv = (t.repeat_interleave(group, 1) for t in leaves[1:])
    s = _masked_scores(leaves[0], kk, causal, window, softcap, 1 / math.sqrt(q.shape[2]))
    lse = torch.logsumexp(s.float(), -1)
    p = torch.exp(s.float() - lse[..., None]).nan_to_num(0.0).to(dtype)
    out = torch.einsum("hqk,khd->qhd", p, vv)
    out.backward(do.to(dtype))
    return (out.detach(), lse.detach(), *[t.grad.float() for t in leaves])


def _sequences(cu_q, cu_k, used):
    return [(cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b] + used[b]) for b in range(len(used))]


def check_case(lq, lk, heads, heads_kv, d, causal, seed, used=None, window=(-1, -1),
               softcap=0.0, direct=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = torch.bfloat16
    cu_q, cu_k = _cu(lq), _cu(lk)
    used = list(lk) if used is None else used
    q, do = (_guarded(cu_q[-1], heads, d, dt, gen) for _ in range(2))
    k, v = (_guarded(cu_k[-1], heads_kv, d, dt, gen) for _ in range(2))
    cu_qt, cu_kt = (torch.tensor(c, dtype=torch.int32, device="cuda") for c in (cu_q, cu_k))
    seqused = None if used == list(lk) else torch.tensor(used, dtype=torch.int32, device="cuda")
    special = softcap > 0 or window != (-1, -1)
    seqs = _sequences(cu_q, cu_k, used)
    # references per sequence (and the fp32 forward for the direct path)
    shape = {"q": q.shape, "k": k.shape, "v": v.shape}
    ref = {n: torch.zeros(s, device="cuda") for n, s in shape.items()}
    low = {n: torch.zeros(s, device="cuda") for n, s in shape.items()}
    out32 = torch.zeros(q.shape, device="cuda")
    lse32 = torch.full((heads, cu_q[-1]), float("-inf"), device="cuda")
    for q0, q1, k0, k1 in seqs:
        if q1 == q0 or k1 == k0:
            continue
        qs, ks, vs, dos = q[q0:q1], k[k0:k1], v[k0:k1], do[q0:q1]
        if special:
            o, lse, *grads = _autograd_sequence(qs, ks, vs, dos, causal, window, softcap,
                                                torch.float32)
            lowp = _autograd_sequence(qs, ks, vs, dos, causal, window, softcap, dt)[2:]
        else:
            o, lse = forward_with_lse(qs[None], ks[None], vs[None], causal)
            grads = attention_backward(qs[None], ks[None], vs[None], o, lse, dos[None], causal)
            grads = [g[0] for g in grads]
            lowp = [g[0].float() for g in _torch_lowp_grads(qs[None], ks[None], vs[None],
                                                            dos[None], causal)]
            o, lse = o[0], lse[0]
        out32[q0:q1], lse32[:, q0:q1] = o, lse
        for n, g, lg in zip("qkv", grads, lowp):
            sl = slice(q0, q1) if n == "q" else slice(k0, k1)
            ref[n][sl], low[n][sl] = g, lg
    fn = getattr(hopper_attn, "attention_varlen", None)
    path = "direct" if fn is None or direct else "autograd"
    if path == "autograd":
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]      # (still guarded)
        kwargs = {"causal": causal}
        if seqused is not None:
            kwargs["seqused_k"] = seqused
        if window != (-1, -1):
            kwargs["window_size"] = window
        if softcap:
            kwargs["softcap"] = softcap
        out = fn(*leaves, cu_qt, cu_kt, max(lq), max(lk), **kwargs)
        out.backward(do)
        grads = [t.grad for t in leaves]
    else:
        out = _guarded(cu_q[-1], heads, d, dt, gen, fill=False)
        out.copy_(out32.to(dt))
        grads = varlen_backward(q, k, v, out, do, lse32, cu_qt, cu_kt, max(lq), max(lk),
                                causal, seqused_k=seqused, window=window, softcap=softcap)
    row = {"lengths_q": lq, "lengths_k": lk, "used_k": used, "heads": [heads, heads_kv],
           "d": d, "causal": causal, "window": list(window), "softcap": softcap,
           "path": path, "ratio": {}, "error": {}, "torch_error": {}, "ok": True}
    for n, g in zip("qkv", grads):
        r = ref[n]
        err = (g.float() - r).abs().max().item() if r.numel() else 0.0
        torch_err = (low[n] - r).abs().max().item() if r.numel() else 0.0
        bound = 2 * torch_err + 2 ** -12 * max(1.0, r.abs().max().item() if r.numel() else 0)
        nan = bool(g.isnan().any())
        row["error"][n], row["torch_error"][n] = err, torch_err
        row["ratio"][n] = float("inf") if nan else err / bound
        row["ok"] &= not nan and err <= bound
    return row


CASES = [  # (label, lengths_q, lengths_k, used_k, heads, heads_kv, window, softcap); a label
    # ending in "whole" runs with PARTS_WAVES = 0 (GQA groups never split in parts, which
    # batches this small would otherwise be)
    ("MHA", [0, 1, 17, 113, 1000], None, None, 4, 4, (-1, -1), 0.0),
    ("MHA tails", [63, 64, 65, 79, 81, 127, 129, 200], None, None, 2, 2, (-1, -1), 0.0),
    ("GQA 8:2 cross", [1, 17, 113, 1000, 0, 40], [300, 5, 113, 517, 64, 0], None, 8, 2,
     (-1, -1), 0.0),
    ("GQA 8:2 whole", [1, 17, 113, 1000, 0, 40], [300, 5, 113, 517, 64, 0], None, 8, 2,
     (-1, -1), 0.0),
    ("MQA", [17, 700, 5], [17, 700, 5], None, 4, 1, (-1, -1), 0.0),
    ("MQA whole", [17, 700, 5], [17, 700, 5], None, 4, 1, (-1, -1), 0.0),
    ("seqused_k", [100, 300, 7], [150, 400, 9], [120, 0, 9], 4, 2, (-1, -1), 0.0),
    ("window 64,32", [1, 300, 1000], None, None, 4, 2, (64, 32), 0.0),
    ("softcap 30", [17, 500], [17, 700], None, 4, 4, (-1, -1), 30.0),
    # >= 16 kv tiles: with a mask at d 128 the dense order's L2 groups of heads (2100 keys,
    # 16 heads: a group of 1, then of 15), at equal lengths of (sequence, head) pairs (5 x 4
    # pairs: a group of 4, then of 16; GQA 4/2, groups in 2 parts: one group of 12)
    ("16 heads 2100", [2100, 5, 300], None, None, 16, 16, (-1, -1), 0.0),
    ("equal 5x2k", [2048] * 5, None, None, 4, 4, (-1, -1), 0.0),
    ("equal GQA 3x2k", [2048] * 3, None, None, 4, 2, (-1, -1), 0.0),
]


def correctness(log, direct=False) -> list:
    from hopper_attn.common import varlen_backward as vb
    rows, seed = [], 0
    for label, lq, lk, used, heads, heads_kv, window, softcap in CASES:
        # (a window or a softcap at d 128 only: each is a compile of its own, forward too)
        for d in (64, 128) if window == (-1, -1) and not softcap else (128,):
            for causal in (False, True):
                seed += 1
                w = window
                if causal and window != (-1, -1):
                    w = (window[0], 0)
                waves = vb.PARTS_WAVES
                vb.PARTS_WAVES = 0 if label.endswith("whole") else waves
                try:
                    row = check_case(lq, lk or lq, heads, heads_kv, d, causal, seed, used, w,
                                     softcap, direct)
                except Exception as exc:  # noqa: BLE001 - one failing case, not the run
                    row = {"ok": False, "error_text": f"{type(exc).__name__}: {exc}"[:300],
                           "ratio": {}}
                finally:
                    vb.PARTS_WAVES = waves
                row["dkv_parts"] = 1 if label.endswith("whole") else vb.dkv_parts(
                    heads, heads_kv, sum(lk or lq), len(lq))
                row["label"] = label
                rows.append(row)
                ratio = " ".join(f"d{n} {row['ratio'].get(n, float('nan')):.2f}" for n in "qkv")
                log(f"  {label:14} d{d:<3} {'causal' if causal else 'full':6} "
                    f"{row.get('path', '-'):8} ratio {ratio}  {'PASS' if row['ok'] else 'FAIL'}"
                    + (f"  {row['error_text'][:100]}" if "error_text" in row else ""))
    return rows


# ------------------------------------------------------------------------------ speed

def _providers(log):
    """Baselines' forwards (run(q, k, v, cu, max) -> out), each differentiated by autograd."""
    out = {}
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func

        def fa4(q, k, v, cu, mx, causal):
            o = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                       max_seqlen_q=mx, max_seqlen_k=mx, causal=causal)
            return o[0] if isinstance(o, tuple) else o
        out["fa4"] = fa4
    except Exception as exc:  # noqa: BLE001 - not installed here
        log(f"  fa4 unavailable: {type(exc).__name__}: {str(exc)[:80]}")
    try:
        from torch.nn.attention.varlen import varlen_attn

        def torch_varlen(q, k, v, cu, mx, causal):
            group = q.shape[1] // k.shape[1]      # (k, v repeated for GQA: inside the graph)
            k, v = (t.repeat_interleave(group, dim=1) if group > 1 else t for t in (k, v))
            return varlen_attn(q, k, v, cu, cu, mx, mx,
                               window_size=(-1, 0) if causal else (-1, -1))
        out["varlen_attn"] = torch_varlen
    except Exception as exc:  # noqa: BLE001
        log(f"  torch varlen_attn unavailable: {type(exc).__name__}: {str(exc)[:80]}")
    return out


def _backward_call(forward, q, k, v, do):
    """The backward alone of `forward(q, k, v)`: autograd.grad on a kept graph."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = forward(*leaves)
    call = lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)  # noqa: E731
    call()
    return call


def _switched_off(call, switch):
    """`call` with varlen_backward's module switch `switch` (LONGEST_FIRST: the work list in
    the batch's order; CONVERT_PER_HEAD: dQ converted after the whole main kernel) off."""
    from hopper_attn.common import varlen_backward as vb

    def run():
        setattr(vb, switch, False)
        try:
            return call()
        finally:
            setattr(vb, switch, True)
    return run




def speed(log) -> dict:
    from hopper_attn.harness.timing import L2Flush, benchmark_interleaved, tflops
    from hopper_attn.harness.varlen_reference import (cu_seqlens, flops, lognormal_lengths,
                                                      speed_dims, speed_equal_lengths,
                                                      speed_mixes)
    providers = _providers(log)
    flush, rows, notes = L2Flush(), [], {}
    mixes = []
    equal_only = os.environ.get("VARLEN_EQUAL_ONLY") == "1"   # the equal-length rows alone
    for total, seed in ([] if equal_only else speed_mixes()):   # the forward check's mixes
        lengths = lognormal_lengths(total, seed)
        mixes.append((f"lognormal {total // 1024}k", seed, lengths))
        log(f"  mix {total // 1024}k seed {seed}: {len(lengths)} documents, max {max(lengths)}"
            f", lengths {lengths if len(lengths) <= 20 else str(lengths[:20])[:-1] + ', ...]'}")
    for label, seed, lengths in mixes:
        cu, mx = cu_seqlens(lengths), max(lengths)
        for d in speed_dims():
            for heads, heads_kv in ((16, 16), (16, 4)):
                gen = torch.Generator(device="cuda").manual_seed(seed)
                q, do = (torch.randn(sum(lengths), heads, d, device="cuda", generator=gen)
                         .bfloat16() for _ in range(2))
                k, v = (torch.randn(sum(lengths), heads_kv, d, device="cuda", generator=gen)
                        .bfloat16() for _ in range(2))
                for causal in (False, True):
                    fwds = {"ours": lambda q_, k_, v_: hopper_attn.attention_varlen(
                        q_, k_, v_, cu, cu, mx, mx, causal=causal)}
                    for name, fn in providers.items():
                        fwds[name] = (lambda q_, k_, v_, fn=fn: fn(q_, k_, v_, cu, mx, causal))
                    calls = {}
                    for name, fwd in fwds.items():
                        try:
                            calls[name] = _backward_call(fwd, q, k, v, do)
                        except Exception as exc:  # noqa: BLE001
                            notes[f"{name} {label} d{d} {heads}/{heads_kv} {causal}"] = \
                                f"{type(exc).__name__}: {str(exc)[:100]}"
                    if "ours" in calls:          # the other order, the late dQ conversion
                        calls["ours, given order"] = _switched_off(calls["ours"],
                                                                   "LONGEST_FIRST")
                        calls["ours, late dQ"] = _switched_off(calls["ours"],
                                                               "CONVERT_PER_HEAD")
                    torch.cuda.synchronize()
                    timed = benchmark_interleaved(calls, flush, target_ms=150, max_reps=30)
                    work = 2.5 * flops([int(x) for x in cu.tolist()],
                                       [int(x) for x in cu.tolist()], heads, d, causal)
                    ms = {name: t["ms"] for name, t in timed.items()}
                    row = {"mix": label, "seed": seed, "d": d, "heads": heads,
                           "heads_kv": heads_kv, "causal": causal, "ms": ms,
                           "tflops": {n: tflops(work, t) for n, t in ms.items()}}
                    rows.append(row)
                    line = (f"  {label} d{d} {heads}/{heads_kv} "
                            f"{'causal' if causal else 'full  '} bwd ours "
                            + (f"{row['tflops']['ours']:.0f} TF/s" if "ours" in ms else "-"))
                    for name in (*providers, "ours, given order", "ours, late dQ"):
                        if name in ms and "ours" in ms:
                            line += (f"; {name} {row['tflops'][name]:.0f} "
                                     f"({ms[name] / ms['ours']:.2f}x)")
                    log(line)
                del q, k, v, do
                torch.cuda.empty_cache()
    dense_rows = []
    for batch, n in ([(8, 2048), (4, 16384)] if equal_only else speed_equal_lengths()):
        for d in speed_dims():
            for causal in (False, True):
                gen = torch.Generator(device="cuda").manual_seed(n)
                q, k, v, do = (torch.randn(batch, n, 16, d, device="cuda", generator=gen)
                               .bfloat16() for _ in range(4))
                cu = cu_seqlens([n] * batch)
                flat = [t.reshape(batch * n, 16, d) for t in (q, k, v, do)]
                calls = {
                    "varlen": _backward_call(lambda q_, k_, v_: hopper_attn.attention_varlen(
                        q_, k_, v_, cu, cu, n, n, causal=causal), *flat),
                    "dense": _backward_call(lambda q_, k_, v_: hopper_attn.attention(
                        q_, k_, v_, causal=causal), q, k, v, do)}
                timed = benchmark_interleaved(calls, flush, target_ms=150, max_reps=30)
                ms = {name: t["ms"] for name, t in timed.items()}
                dense_rows.append({"batch": batch, "seqlen": n, "d": d, "causal": causal,
                                   "ms": ms, "varlen_over_dense": ms["varlen"] / ms["dense"]})
                log(f"  equal lengths B{batch} N{n} d{d} {'causal' if causal else 'full  '}: "
                    f"bwd varlen {ms['varlen']:.3f} ms dense {ms['dense']:.3f} ms -> "
                    f"{ms['varlen'] / ms['dense']:.3f}x time")
                del q, k, v, do, flat, calls
                torch.cuda.empty_cache()
    return {"mixes": [{"label": m[0], "seed": m[1], "lengths": m[2]} for m in mixes],
            "rows": rows, "equal_lengths": dense_rows, "notes": notes}


def main() -> int:
    direct = "--direct" in sys.argv
    if direct:
        sys.argv.remove("--direct")
    return run_check(
        __doc__, "varlen_bwd.json", lambda log: correctness(log, direct),
        lambda log, t0: speed(log),
        "correctness (ratio = max error / (2x torch bf16 error + 2^-12 max|ref|), <= 1 passes):",
        "speed, the backward alone, TFLOP/s of the real per-sequence work (2.5x the forward's); "
        "(x): baseline time / ours:")


if __name__ == "__main__":
    sys.exit(main())
