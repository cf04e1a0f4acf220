"""Logit softcapping (issue 61): softmax(cap * tanh(s / cap)) on the scaled scores, in k6's
forward and kb2's backward. On the CPU: the softcap kernels compile for sm_90a without
spills, with one tanh.approx per score and none without a softcap; k6's exponents against a
fixed 0 where POLICY takes them (bf16, d 128 / 256, cap <= 69); `attention()` refuses a bad cap or a stage without softcap
before any launch. On the GPU (`gpu`): forward and backward against an fp32 reference,
within 2x the error of the same math in torch's bf16."""

import re

import pytest
import torch

from hopper_attn.harness.compile_report import resource_usage
from ptx import compiled

TANH = r"tanh\.approx\.f32"


def _no_spills(art):
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


@pytest.mark.compile
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_k6_softcap_compiles_with_one_tanh_per_score(d, causal):
    art = compiled("k6:softcap=50.0", d, causal)
    _no_spills(art)
    assert re.search(TANH, art["ptx"])
    assert not re.search(TANH, compiled("k6", d, causal)["ptx"])


@pytest.mark.compile
@pytest.mark.parametrize("d,causal", [(128, True), (256, False)])
def test_k6_softcap_fixed_max_drops_the_row_maxima(d, causal):
    """softcap_fixed_max (POLICY's, bf16): exponents against 0, so no max shuffles (SHFL.BFLY
    only for the row sums at the end) and far fewer FMNMX than with the running maxima
    (fp16's kernel); no spills."""
    from hopper_attn.harness.compile_report import sass
    fixed = compiled("k6:softcap=50.0", d, causal)
    assert fixed["kernel"]["options"]["softcap_fixed_max"]
    _no_spills(fixed)
    plain = compiled("k6:softcap=50.0", d, causal, torch.float16)
    assert not plain["kernel"]["options"].get("softcap_fixed_max")
    count = lambda art, op: len(re.findall(op, sass(art["cubin"])))   # noqa: E731
    assert count(fixed, r"\bFMNMX\b") < count(plain, r"\bFMNMX\b") // 4
    assert count(fixed, r"SHFL\.BFLY") < count(plain, r"SHFL\.BFLY")


def test_k6_softcap_fixed_max_where_measured_only():
    """On for softcapped bf16 calls at d 128 / 256 with cap <= 69 (the H200's run,
    results/h200/2026-11-29_softcap.json); off for fp16, larger caps, other head dims, no
    cap; no longer an option."""
    from hopper_attn.common.contract import Problem
    from hopper_attn.k6 import settings_for
    on = lambda d, dtype, cap: settings_for(Problem(1, 2, 256, d, True, dtype),  # noqa: E731
                                            softcap=cap).get("softcap_fixed_max", False)
    assert on(128, torch.bfloat16, 50.0) and on(256, torch.bfloat16, 69.0)
    assert not any([on(128, torch.float16, 30.0), on(128, torch.bfloat16, 70.0),
                    on(64, torch.bfloat16, 50.0), on(192, torch.bfloat16, 50.0),
                    on(128, torch.bfloat16, 0.0)])
    with pytest.raises(ValueError, match="unknown options"):
        settings_for(Problem(1, 2, 256, 128, True), softcap=50.0, softcap_fixed_max=1)


@pytest.mark.compile
def test_k6_round_once_converts_p_once():
    """round_once (POLICY's at d 128 with softcap's fixed 0; docs/softcap.md "P converted
    once"): P converted to the PV operand once, one F2FP per pair in the loop (32, not the
    rounded sums' 64), l summed from the operand's registers; no spills."""
    from hopper_attn.harness import sass_order
    from hopper_attn.harness.compile_report import sass
    once = compiled("k6:softcap=50.0", 128, True)           # (the compile above, cached)
    assert once["kernel"]["options"]["round_once"]
    _no_spills(once)
    text = sass(once["cubin"])
    body = [t for lp in sass_order.loops(text) for t in sass_order.loop_body(text, lp)]
    assert sum(re.search(r"\bF2FP\.", t) is not None for t in body) == 32


def test_k6_round_once_where_measured_only():
    """On where d 128 takes softcap's fixed 0 (results/h200/2026-11-29_round_once.json); off
    at d 256 and in the lazy loops; a bool of k6.BASE (not an option), ignored where P is not
    rounded for l."""
    from hopper_attn.common.contract import Problem
    from hopper_attn.k6 import BASE, FlashAttentionK6, settings_for
    on = lambda d, causal, cap, dtype=torch.bfloat16: settings_for(  # noqa: E731
        Problem(1, 2, 4096, d, causal, dtype), softcap=cap)["round_once"]
    assert on(128, True, 50.0) and on(128, False, 15.0) and not BASE["round_once"]
    assert not any([on(256, True, 50.0), on(192, True, 0.0), on(256, False, 0.0),
                    on(128, True, 0.0), on(128, True, 50.0, torch.float16)])
    with pytest.raises(ValueError, match="round_once"):
        FlashAttentionK6(128, True, 128, 128, round_once="before_qk")
    assert not FlashAttentionK6(128, True, 128, 128, round_once=True).round_once  # eager


@pytest.mark.compile
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_kv", [0, 1])           # 1: the GQA variant
def test_kb2_softcap_compiles_without_spills(d, causal, heads_kv):
    art = compiled("kb2:softcap=50.0", d, causal, heads_kv=heads_kv)
    _no_spills(art)
    assert re.search(TANH, art["ptx"])
    assert not re.search(TANH, compiled("kb2", d, causal, heads_kv=heads_kv)["ptx"])


@pytest.mark.parametrize("cap", [-1.0, float("inf"), float("nan"), "x"])
def test_bad_softcap_is_refused(cap):
    import hopper_attn
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="softcap"):
        hopper_attn.attention(q, q, q, softcap=cap)


@pytest.mark.parametrize("stage", ["k4", "k5", "k7"])
def test_stages_without_softcap_refuse_it(stage):
    import hopper_attn
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="softcap"):
        hopper_attn.attention(q, q, q, softcap=30.0, stage=stage)


@pytest.mark.compile
@pytest.mark.parametrize("causal,heads_kv", [(True, 1), (False, 0)])
def test_kb2_softcap_at_d256_on_the_swapped_tile(causal, heads_kv):
    """d = 256 (Gemma 2): the softcap on kb2's dkv_swap_ab tile (64 x 48), one tanh per
    score, no spills."""
    art = compiled("kb2:softcap=50.0", 256, causal, heads_kv=heads_kv)
    _no_spills(art)
    assert re.search(TANH, art["ptx"]) and art["kernel"]["options"]["dkv_swap_ab"]


def capped_attention(q, k, v, causal, cap, scale=None):
    """softmax(cap tanh(q k^T scale / cap)) v in q's dtype (torch's own math); k/v heads
    repeated for GQA; causal aligned bottom-right."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    s = cap * torch.tanh(s / cap)
    nq, nk = q.shape[1], k.shape[1]
    if causal:
        hidden = torch.ones(nq, nk, dtype=torch.bool, device=q.device).triu(nk - nq + 1)
        s = s.masked_fill(hidden, float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", torch.softmax(s, -1), v)


def check_softcap(d, causal, n, cap, magnitude, heads_kv=2, backward=True, stage=None,
                  seed=0):
    """hopper_attn vs the fp32 reference, within 2x torch's bf16 error on the same math
    (forward; and backward: dq, dk, dv). q and k times `magnitude` saturate the tanh."""
    import hopper_attn
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, do = (torch.randn(2, n, 4, d, device="cuda", generator=gen) for _ in range(2))
    k, v = (torch.randn(2, n, heads_kv, d, device="cuda", generator=gen) for _ in range(2))
    q, k = q * magnitude, k * magnitude
    q, k, v, do = (t.to(torch.bfloat16) for t in (q, k, v, do))
    results = {}
    for name, dtype in (("ours", None), ("fp32", torch.float32), ("torch", torch.bfloat16)):
        leaves = [t.to(dtype or t.dtype, copy=True).requires_grad_(backward)
                  for t in (q, k, v)]
        if dtype is None:
            out = hopper_attn.attention(*leaves, causal=causal, softcap=cap, stage=stage)
        else:
            out = capped_attention(*leaves, causal, cap)
        if backward:
            out.backward(do.to(out.dtype))
        results[name] = [out] + ([t.grad for t in leaves] if backward else [])
    errors = {}
    for i, what in enumerate(("o", "dq", "dk", "dv")[:len(results["ours"])]):
        ref = results["fp32"][i].float()
        err = (results["ours"][i].float() - ref).abs().max().item()
        torch_err = (results["torch"][i].float() - ref).abs().max().item()
        errors[what] = (err, torch_err, ref.abs().max().item())
        assert not results["ours"][i].isnan().any(), what
    return errors


def within(errors):
    """Each error <= 2x torch's + 2^-12 x max(1, max |reference|) (as tests/test_gpu.py)."""
    return all(err <= 2 * torch_err + 2 ** -12 * max(1.0, ref_max)
               for err, torch_err, ref_max in errors.values())


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 17, 113, 1000])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("cap,magnitude", [(50.0, 1.0), (15.0, 6.0), (50.0, 8.0)])
def test_softcap_forward_matches_fp32(d, causal, n, cap, magnitude):
    errors = check_softcap(d, causal, n, cap, magnitude, backward=False, seed=d + n)
    assert within(errors), errors


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 17, 113, 1000])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("heads_kv", [4, 2])             # MHA, GQA 2:1
@pytest.mark.parametrize("cap,magnitude", [(50.0, 1.0), (15.0, 6.0)])
def test_softcap_backward_matches_fp32(d, causal, n, heads_kv, cap, magnitude):
    errors = check_softcap(d, causal, n, cap, magnitude, heads_kv, seed=d + n + heads_kv)
    assert within(errors), errors


@pytest.mark.gpu
@pytest.mark.parametrize("dv", [64, 128])
@pytest.mark.parametrize("seqlen_q", [1, 64, 239])
def test_softcap_one_key_returns_its_value(dv, seqlen_q):
    """One key: every row's output is that key's V, bit for bit (FlashAttention's grid,
    d 128 / dv 64, cap 15: k6's exponents against a fixed 0 sum the rounded P, so P V / l
    is V exactly)."""
    import hopper_attn
    gen = torch.Generator(device="cuda").manual_seed(dv + seqlen_q)
    q = torch.randn(2, seqlen_q, 4, 128, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(2, 1, 4, 128, device="cuda", generator=gen).to(torch.bfloat16)
    v = (3 * torch.randn(2, 1, 4, dv, device="cuda", generator=gen)).to(torch.bfloat16)
    out = hopper_attn.attention(q, k, v, softcap=15.0)
    assert torch.equal(out, v.expand_as(out))
