"""One correctness check of a backward stage (what ref_check runs for kb1, kb2).

Inputs: fresh random normal q, k, v and dO, each inside a NaN-guarded buffer; o and the LSE
from the fp32 reference forward (o rounded to the input dtype, as a forward kernel would
hand it over), so the check measures the backward alone. dq, dk, dv start as NaN inside NaN
guards. Reference: `reference_backward.attention_backward` in fp32 on the same inputs.
Verdict per gradient, as for the forward: max error <= 2x torch's own low-precision backward
error (autograd through SDPA on the same bf16/fp16 inputs), no NaN, guards untouched; dK and
dV must be bitwise the same on a second run (dQ's fp32 reduce-adds arrive in any order: its
reproducibility is reported, `dq_same_bits`, and required only in deterministic mode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .inputs import guarded_empty, guards_intact
from .reference import error_stats, judge
from .reference_backward import attention_backward, forward_with_lse


def _torch_lowp_grads(q, k, v, do, causal: bool):
    """torch's own backward on the low-precision inputs: autograd through SDPA (GQA through
    enable_gqa; a causal mask with seqlen_k != seqlen_q passed explicitly, bottom-right)."""
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    nq, nk = q.shape[1], k.shape[1]
    kwargs = {"enable_gqa": q.shape[2] != k.shape[2]}
    if causal and nq == nk:
        kwargs["is_causal"] = True
    elif causal:
        kwargs["attn_mask"] = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
        # rows that see no key (nq > nk): SDPA's output and gradients there are undefined
        # (NaN or worse, garbage that leaks into dK and dV); their true gradient is 0 and
        # they contribute nothing, so torch gets a zero dO on them
        do = do.clone()
        do[:, :max(0, nq - nk)] = 0
    o = F.scaled_dot_product_attention(qt, kt, vt, **kwargs)
    o.backward(do.transpose(1, 2))
    return [t.grad.transpose(1, 2).nan_to_num(0.0) for t in (qt, kt, vt)]


class BackwardCase:
    """Inputs (and, with `reference`, the fp32 reference and torch's error) of one problem."""

    def __init__(self, problem, seed: int, scale: float = 1.0, device: str = "cuda",
                 reference: bool = True):
        self.problem = p = problem
        gen = torch.Generator(device=device).manual_seed(seed)
        self.buffers = []

        def guarded(shape, dtype=p.dtype, fill=True):
            buffer, view = guarded_empty(shape, dtype, device)
            if fill:
                view.copy_(torch.randn(shape, generator=gen, device=device) * scale)
            self.buffers.append(buffer)
            return view

        self.q, self.k, self.v = guarded(p.shape), guarded(p.kv_shape), guarded(p.kv_shape)
        self.do = guarded(p.shape)
        o, self.lse = forward_with_lse(self.q, self.k, self.v, p.causal)
        self.o = guarded(p.shape, fill=False)
        self.o.copy_(o)
        del o
        self.dq, self.dk, self.dv = (guarded(s, fill=False)
                                     for s in (p.shape, p.kv_shape, p.kv_shape))
        if not reference:
            return
        self.ref = attention_backward(self.q, self.k, self.v, self.o, self.lse, self.do, p.causal)
        lowp = _torch_lowp_grads(self.q, self.k, self.v, self.do, p.causal)
        self.torch_err = [error_stats(g, r) for g, r in zip(lowp, self.ref)]

    def run(self, entry, handle):
        for t in (self.dq, self.dk, self.dv):
            t.fill_(float("nan"))
        entry.run(handle, self.q, self.k, self.v, self.o, self.do, self.lse,
                  self.dq, self.dk, self.dv)
        torch.cuda.synchronize()
        return [t.clone() for t in (self.dq, self.dk, self.dv)]

    def check(self, entry, handle, deterministic: bool = False) -> dict:
        first = self.run(entry, handle)
        verdict = {"ok": True}
        for name, grad, ref, torch_err in zip(("dq", "dk", "dv"), first, self.ref,
                                              self.torch_err):
            v = judge(error_stats(grad, ref), torch_err, ref)
            verdict[name] = v
            verdict["ok"] = verdict["ok"] and v["ok"]
        second = self.run(entry, handle)
        same = [torch.equal(a.view(torch.int16), b.view(torch.int16))
                for a, b in zip(first, second)]
        verdict["dq_same_bits"], verdict["same_bits"] = same[0], all(same[1:])
        verdict["guards_intact"] = all(guards_intact(b) for b in self.buffers)
        verdict["error_ratio"] = max(verdict[n]["error_ratio"] for n in ("dq", "dk", "dv"))
        verdict["ok"] = (verdict["ok"] and verdict["same_bits"] and verdict["guards_intact"]
                         and (verdict["dq_same_bits"] or not deterministic))
        return verdict
