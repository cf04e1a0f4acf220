"""References for sliding-window attention (tests/test_window.py, tools/window_gpu_check.py):
the window's boolean mask, fp32 attention with it (differentiable), and torch's own bf16
result (SDPA with the mask) for the error bound; seeded inputs, and the gradients' errors
against both with the bound the two share."""

from __future__ import annotations

import torch


def window_mask(nq, nk, left, right, device="cuda"):
    """(nq, nk) bool, True where query i sees key j (bottom-right aligned); (left, right) in
    any spelling `normalize_window` takes (None or, with both ints, -1: unbounded; other
    sides literal, negative ones too)."""
    from hopper_attn.common.contract import normalize_window
    left, right = normalize_window((left, right), False)
    i = torch.arange(nq, device=device)[:, None] + (nk - nq)
    j = torch.arange(nk, device=device)[None, :]
    seen = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if left is not None:
        seen &= j >= i - left
    if right is not None:
        seen &= j <= i + right
    return seen


def reference(q, k, v, left, right, scale, softcap=0.0, sinks=None, round_to=None):
    """Attention with the window's mask in fp32 (differentiable: give it fp32 leaves); rows
    that see no key: 0, LSE -inf (masked scores -1e30, not -inf, so no NaN reaches the
    gradients). `sinks` (heads,): attention sinks, one more column per row (docs/sinks.md;
    rows that see no key: 0, LSE the sink). `round_to`: P and O rounded to that dtype (a
    16-bit kernel's own rounding: PyTorch's error where SDPA lacks the softcap or sinks)."""
    rounded = (lambda t: t.to(round_to).float()) if round_to is not None else (lambda t: t)
    group = q.shape[2] // k.shape[2]
    k, v = (t.float().repeat_interleave(group, dim=2) for t in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q.float(), k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    seen = window_mask(q.shape[1], k.shape[1], left, right, q.device)
    s = s.masked_fill(~seen, -1e30)
    if sinks is not None:
        column = sinks.float()[None, :, None, None].expand(*s.shape[:3], 1)
        s = torch.cat([s, column], -1)
        p = rounded(torch.softmax(s, -1)[..., :-1] * seen.any(-1)[:, None].float())
        return rounded(torch.einsum("bhij,bjhd->bihd", p, v)), torch.logsumexp(s, -1)
    p = rounded(torch.softmax(s, -1) * seen.any(-1)[:, None].float())
    lse = torch.logsumexp(s, -1).masked_fill(~seen.any(-1), float("-inf"))
    return rounded(torch.einsum("bhij,bjhd->bihd", p, v)), lse


def torch_lowp(q, k, v, left, right, scale, do=None):
    """torch's own bf16 result (SDPA with the window as a boolean mask, GQA through
    enable_gqa): the output (0 on rows that see no key) and, given `do`, the gradients
    (`do` zeroed on those rows, where SDPA's are undefined; their true gradient is 0)."""
    import torch.nn.functional as F
    seen = window_mask(q.shape[1], k.shape[1], left, right, q.device)
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=seen, scale=scale,
                                       enable_gqa=q.shape[2] != k.shape[2])
    out = o.detach().transpose(1, 2).float().nan_to_num(0.0) * seen.any(-1)[:, None, None]
    if do is None:
        return out, None
    do = do.clone()
    do[:, ~seen.any(-1)] = 0
    o.backward(do.transpose(1, 2))
    return out, [t.grad.transpose(1, 2).float().nan_to_num(0.0) for t in (qt, kt, vt)]


def window_inputs(batch, nq, nk, heads, heads_kv, d, seed):
    """Random bf16 q (batch, nq, heads, d), k and v (batch, nk, heads_kv, d) on the GPU,
    seeded."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, nq, heads, d, device="cuda", generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(batch, nk, heads_kv, d, device="cuda", generator=gen)
            .to(torch.bfloat16) for _ in range(2))
    return q, k, v


def gradient_errors(q, k, v, do, grads, left, right, scale):
    """For `grads` (dQ, dK, dV of bf16 q, k, v with output gradient `do`): per name "q",
    "k", "v", (max error against the fp32 reference, torch's own bf16 error, the bound 2x
    torch's error + 2^-12 max|ref|, at least 2^-12)."""
    ins = [t.float().requires_grad_() for t in (q, k, v)]
    o, _ = reference(*ins, left, right, scale)
    o.backward(do.float())
    _, lowp = torch_lowp(q, k, v, left, right, scale, do)
    errors = {}
    for name, grad, ref, low in zip("qkv", grads, [t.grad for t in ins], lowp):
        torch_err = (low - ref).abs().max().item()
        errors[name] = ((grad.float() - ref).abs().max().item(), torch_err,
                        2 * torch_err + 2 ** -12 * max(1.0, ref.abs().max().item()))
    return errors
