"""On the GPU: kb2's GQA backward (the gqa variant: one CTA per kv tile of a dK head walks
every query head of its group, issue 59) against the fp32 reference, within 2x torch's own
bf16 backward error on the same inputs (test_gpu._backward_matches_fp32); the deterministic
mode's bits twice."""

import pytest
import torch

from test_gpu import _backward_matches_fp32

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("nq,nk", [(1, 1), (17, 17), (113, 113), (1000, 1000), (113, 300),
                                   (1000, 517)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("heads_q,heads_kv", [(8, 2), (16, 2), (4, 1), (4, 4)])
def test_kb2_gqa_backward_matches_fp32(heads_q, heads_kv, d, causal, nq, nk):
    """GQA 4:1 and 8:1, MQA, MHA; odd and cross lengths (a causal mask bottom-right)."""
    _backward_matches_fp32(2, heads_q, heads_kv, nq, nk, d, causal,
                           seed=heads_q + 3 * heads_kv + nq + nk + d + causal)


@pytest.mark.parametrize("batch,heads_q,heads_kv,seqlen,d,causal", [
    (1, 8, 1, 8192, 128, True),      # MQA: dK / dV heads in 4 parts, summed by run_backward
    (1, 16, 1, 2048, 64, True),      # in 16 parts (one query head per CTA)
    (1, 16, 2, 2048, 64, False),     # 8:1 in 4 parts
    (3, 24, 3, 2100, 128, True),     # longest first: 9 dK heads in groups
    (2, 32, 8, 2100, 64, True),      # heads first (d = 64)
])
def test_kb2_gqa_parts_and_launch_orders(batch, heads_q, heads_kv, seqlen, d, causal):
    """dK / dV split in parts (masking.dkv_parts), and the launch orders with a mask: every
    (kv tile, dK head) visited once."""
    _backward_matches_fp32(batch, heads_q, heads_kv, seqlen, seqlen, d, causal,
                           seed=batch + heads_q + seqlen)


@pytest.mark.parametrize("batch,heads_q,heads_kv,seqlen,d,causal", [
    (2, 8, 2, 2100, 128, True), (1, 16, 2, 1000, 64, True), (2, 4, 1, 777, 128, False)])
def test_kb2_gqa_deterministic_mode_gives_the_same_bits(batch, heads_q, heads_kv, seqlen, d,
                                                        causal):
    import hopper_attn
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, do = (torch.randn(batch, seqlen, heads_q, d, device="cuda", generator=gen)
             .to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(batch, seqlen, heads_kv, d, device="cuda", generator=gen)
            .to(torch.bfloat16) for _ in range(2))
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        hopper_attn.attention(*leaves, causal=causal, deterministic=True).backward(do)
        grads.append([t.grad.view(torch.int16) for t in leaves])
    for first, again in zip(*grads):
        assert torch.equal(first, again)


@pytest.mark.parametrize("d,causal", [(64, True), (128, False)])
def test_kb2_gqa_variant_agrees_with_the_per_head_path(d, causal):
    """The gqa variant (group summed in the kernel, fp32 accumulators) and kb2:gqa=0 (one
    bf16 dK / dV per query head, summed by torch in fp32): dQ within fp32 reordering, dK and
    dV within bf16 rounding of the per-head copies."""
    import hopper_attn
    from hopper_attn.common.contract import Problem
    from hopper_attn.harness import registry
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, do = (torch.randn(2, 1000, 8, d, device="cuda", generator=gen).to(torch.bfloat16)
             for _ in range(2))
    k, v = (torch.randn(2, 1000, 2, d, device="cuda", generator=gen).to(torch.bfloat16)
            for _ in range(2))
    out, lse = hopper_attn.attention(q, k, v, causal=causal, return_lse=True)
    grads = {}
    for name in ("kb2", "kb2:gqa=0"):
        entry = registry.get(name)
        handle = entry.compile(Problem.from_tensor(q, causal, k))
        assert handle.options["gqa"] == (name == "kb2")
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        entry.run(handle, q, k, v, out, do, lse, dq, dk, dv)
        grads[name] = (dq.float(), dk.float(), dv.float())
    for a, b in zip(grads["kb2"], grads["kb2:gqa=0"]):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 2 ** -6 * scale
