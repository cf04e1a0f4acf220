"""The backward reference (the formulas kb1/kb2 implement) against torch autograd, on the
CPU in fp64: causal and not, odd lengths, GQA, cross-attention, a row that sees no key."""

import math

import pytest
import torch

from hopper_attn.harness.reference_backward import attention_backward, forward_with_lse


def autograd_reference(q, k, v, do, causal, scale):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kk, vv = (t.repeat_interleave(group, dim=2) for t in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * scale
    nq, nk = q.shape[1], k.shape[1]
    if causal:
        hidden = torch.ones(nq, nk, dtype=torch.bool).triu(nk - nq + 1)
        s = s.masked_fill(hidden, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    o = torch.einsum("bhij,bjhd->bihd", p, vv)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("b,nq,nk,hq,hk,d,causal", [
    (2, 17, 17, 3, 3, 16, False), (2, 17, 17, 3, 3, 16, True), (1, 33, 33, 4, 2, 8, True),
    (1, 5, 40, 2, 1, 8, True), (1, 40, 5, 2, 2, 8, True), (1, 1, 1, 1, 1, 8, False)])
def test_matches_autograd(b, nq, nk, hq, hk, d, causal):
    gen = torch.Generator().manual_seed(nq * 100 + nk + causal)
    q = torch.randn(b, nq, hq, d, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(b, nk, hk, d, dtype=torch.float64, generator=gen) for _ in range(2))
    do = torch.randn(b, nq, hq, d, dtype=torch.float64, generator=gen)
    scale = 1 / math.sqrt(d)
    o_ref, dq_ref, dk_ref, dv_ref = autograd_reference(q, k, v, do, causal, scale)
    o, lse = forward_with_lse(q, k, v, causal)
    assert torch.allclose(o.double(), o_ref, atol=1e-5)
    dq, dk, dv = attention_backward(q, k, v, o, lse, do, causal)
    for got, want in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert got.shape == want.shape
        assert torch.allclose(got.double(), want, atol=1e-4), (got - want).abs().max()


def test_rows_that_see_no_key_get_zero_gradients():
    """5 queries over 2 keys, causal bottom-right: query i sees keys j <= i - 3, so the
    first three rows see none: lse -inf, output 0, dq 0, no NaN anywhere."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 5, 1, 8, generator=gen)
    k, v = (torch.randn(1, 2, 1, 8, generator=gen) for _ in range(2))
    do = torch.randn(1, 5, 1, 8, generator=gen)
    o, lse = forward_with_lse(q, k, v, causal=True)
    assert torch.isinf(lse[0, 0, :3]).all() and torch.isfinite(lse[0, 0, 3:]).all()
    dq, dk, dv = attention_backward(q, k, v, o, lse, do, causal=True)
    assert not any(t.isnan().any() for t in (o, dq, dk, dv))
    assert (dq[0, :3] == 0).all() and (o[0, :3] == 0).all()
