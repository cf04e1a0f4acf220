"""Baselines measured in the same run as the kernels: torch SDPA (FLASH and CUDNN backends)
and FlashAttention-4's CuTe DSL Hopper kernel when it is importable; forward, and backward
(`backward_available`: each baseline's own backward, through autograd)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _sdpa(backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                  v.transpose(1, 2), is_causal=causal)
    return run


def _fa4():
    from flash_attn.cute.interface import flash_attn_func   # noqa: F401  (raises if absent)

    def run(q, k, v, causal):
        return flash_attn_func(q, k, v, causal=causal)
    return run


BASELINES = {
    "sdpa_flash": lambda: _sdpa("FLASH_ATTENTION"),
    "sdpa_cudnn": lambda: _sdpa("CUDNN_ATTENTION"),
    "fa4": _fa4,
}


def available(names=None) -> dict:
    """name -> callable(q, k, v, causal), for the baselines that run here; reasons for the rest."""
    found, missing = {}, {}
    for name in names or BASELINES:
        try:
            fn = BASELINES[name]()
            q = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
            fn(q, q, q, False)
            torch.cuda.synchronize()
            found[name] = fn
        except Exception as exc:  # noqa: BLE001 - any failure means "not available here"
            missing[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
    return found, missing


def _backward_of(forward):
    """fn(q, k, v, do, causal) -> a callable that runs the baseline's backward once: the
    forward runs once (outside the timing) with grad enabled, then each call is
    torch.autograd.grad of its output (the graph is kept), which launches only the backward."""
    def make(q, k, v, do, causal):
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        out = forward(qg, kg, vg, causal)
        if isinstance(out, tuple):
            out = out[0]
        grad_out = do if out.shape == do.shape else do.transpose(1, 2)
        return lambda: torch.autograd.grad(out, (qg, kg, vg), grad_out, retain_graph=True)
    return make


def backward_available(names=None) -> tuple:
    """name -> make(q, k, v, do, causal) -> callable running one backward; reasons for the rest."""
    found, missing = {}, {}
    for name in names or BASELINES:
        try:
            make = _backward_of(BASELINES[name]())
            q = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
            make(q, q, q, q, False)()
            torch.cuda.synchronize()
            found[name] = make
        except Exception as exc:  # noqa: BLE001 - any failure means "not available here"
            missing[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
    return found, missing
