"""v with its own head dim dv != d (issue 61; DeepSeek MLA's (192, 128), and (128, 64)):
the problem's shapes and checks, the API's refusals before a launch, the fp32 references,
one sm_90a compile of k6 and one of kb2 per (d, dv) pair; on the GPU (marked gpu) forward
and backward against the fp32 references, the tiny DeepSeek-V3's logits and a training step
against eager attention (the full sweep: tools/dv_gpu_check.py)."""

import pytest
import torch

import hopper_attn
from hopper_attn.common.contract import Problem, UnsupportedProblem, check_tensors
from hopper_attn.harness.gpu_check import lse_bound


def _qkv(d, dv, n=33, heads=4, heads_kv=4, device="cpu"):
    q = torch.randn(2, n, heads, d, device=device).to(torch.bfloat16)
    k = torch.randn(2, n, heads_kv, d, device=device).to(torch.bfloat16)
    v = torch.randn(2, n, heads_kv, dv, device=device).to(torch.bfloat16)
    return q, k, v


def test_problem_shapes_and_checks():
    q, k, v = _qkv(192, 128, heads_kv=2)
    p = Problem.from_tensor(q, True, k, v=v)
    assert (p.head_dim, p.dv, p.head_dim_v) == (192, 128, 128)
    assert p.v_shape == (2, 33, 2, 128) and p.out_shape == (2, 33, 4, 128)
    assert p.flops == Problem(2, 4, 33, 160, True).flops      # 2 (d + dv) per visible pair
    assert Problem.from_tensor(q, True, k, v=k).head_dim_v == 0     # dv = d: as before
    with pytest.raises(ValueError, match="shape"):         # out must be dv wide
        check_tensors(p, q, k, v, q, strided=True)
    with pytest.raises(ValueError, match="CUDA"):          # right shapes: only the device
        check_tensors(p, q, k, v, q[..., :128], strided=True)


def test_api_refuses_before_launching():
    q, k, v = _qkv(192, 128)
    with pytest.raises(ValueError, match="same shape"):
        hopper_attn.attention(q, k, v[:, :17])
    with pytest.raises(UnsupportedProblem, match=r"\(d, dv\) pairs"):
        hopper_attn.attention(*_qkv(192, 64))
    with pytest.raises(UnsupportedProblem, match=r"\(d, dv\) pairs"):
        hopper_attn.attention(*_qkv(128, 96))
    with pytest.raises(UnsupportedProblem, match=r"\(d, dv\) pairs"):   # k5: d = dv only
        hopper_attn.attention(*_qkv(128, 64), stage="k5")
    with pytest.raises(ValueError, match="CUDA"):          # supported: only the device is wrong
        hopper_attn.attention(*_qkv(128, 64))
    # kb2 runs both pairs' backward, windowed too: with gradients only the device is wrong
    for d, dv in ((192, 128), (128, 64)):
        q, k, v = _qkv(d, dv)
        with pytest.raises(ValueError, match="CUDA"):
            hopper_attn.attention(q.requires_grad_(), k, v)
        with pytest.raises(ValueError, match="CUDA"):
            hopper_attn.attention(q.requires_grad_(), k, v, window_size=(64, 0))


def test_fake_implementation_gives_dv_wide_output():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, k = (torch.empty(2, 100, 8, 192, dtype=torch.bfloat16, device="cuda")
                for _ in range(2))
        v = torch.empty(2, 100, 8, 128, dtype=torch.bfloat16, device="cuda")
        out, lse = torch.ops.hopper_attn.attention(q, k, v, True, None, "")
        assert out.shape == (2, 100, 8, 128) and lse.shape == (2, 8, 100)


def test_references_agree_on_dv():
    """The forward references (reference.py, reference_backward.py, window_reference.py)
    and the backward reference against autograd, at dv != d (fp32, CPU)."""
    from hopper_attn.harness import reference, reference_backward, window_reference
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 40, 4, d, dtype=torch.float64) for d in (32, 32, 16))
    o, lse = reference_backward.forward_with_lse(q, k, v, True)
    assert o.shape == (1, 40, 4, 16)
    o_ref = reference.reference_attention(q, k, v, True)
    o_win, lse_win = window_reference.reference(q, k, v, -1, 0, 32 ** -0.5)
    assert torch.allclose(o, o_ref, atol=1e-5) and torch.allclose(o, o_win, atol=1e-5)
    assert torch.allclose(lse, lse_win.float(), atol=1e-5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    do = torch.randn(1, 40, 4, 16, dtype=torch.float64)
    window_reference.reference(*leaves, -1, 0, 32 ** -0.5)[0].backward(do)
    grads = reference_backward.attention_backward(q, k, v, o, lse, do, True)
    for grad, leaf in zip(grads, leaves):
        assert grad.shape == leaf.shape
        assert torch.allclose(grad.double(), leaf.grad, atol=1e-4)


@pytest.mark.compile
@pytest.mark.parametrize("d,dv,causal,block_n", [(192, 128, False, 128), (128, 64, True, 128)])
def test_k6_compiles_per_pair(d, dv, causal, block_n):
    """One sm_90a compile per (d, dv): no spills; S = Q K^T is block_n wide (k16 slices over
    d), O += P V dv wide; V's SMEM ring holds dv-wide tiles (in the estimate too)."""
    import re
    from hopper_attn.harness import registry
    from hopper_attn.harness.compile_report import compile_artifacts, resource_usage
    art = compile_artifacts(registry.get("k6"), d, causal, head_dim_v=dv)
    assert art["ok"], art.get("error")
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    assert art["kernel"]["block_n"] == block_n
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{block_n}k16", art["ptx"])
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{dv}k16", art["ptx"])
    kib = art["kernel"]["smem_bytes"] / 1024
    bm, stages = art["kernel"]["block_m"], art["kernel"]["stages"]
    assert kib >= (bm * d + stages * block_n * (d + dv)) * 2 / 1024 and kib <= 227


@pytest.mark.compile
@pytest.mark.parametrize("d,dv,causal,tile,dv_mma", [(128, 64, False, (80, 128), "m64n64k16"),
                                                    (192, 128, True, (64, 96), "m64n48k16")])
def test_kb2_compiles_per_pair(d, dv, causal, tile, dv_mma):
    """kb2 per (d, dv), no spills. (128, 64): d = 128's 80-row tiles (dQ transposed); dP^T =
    V dO^T contracts over dv, dV += P^T dO is dv wide. (192, 128): d = 192's dkv_swap_ab tile
    (64 x 96), dV^T with dv as M (2 blocks of 64) and each warpgroup's 48 keys as N, dQ at
    d / 2 = 96 a warpgroup, V and dO dv wide (dO in 2 stages): 214 KiB of SMEM."""
    import re
    from hopper_attn.harness import registry
    from hopper_attn.harness.compile_report import compile_artifacts, resource_usage
    art = compile_artifacts(registry.get("kb2"), d, causal, head_dim_v=dv)
    assert art["ok"], art.get("error")
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    assert (art["kernel"]["block_m"], art["kernel"]["block_n"]) == tile
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.{dv_mma}", art["ptx"])
    if d == 192:
        assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n96k16", art["ptx"])
        assert art["kernel"]["smem_bytes"] <= 215 * 1024


def _cuda_inputs(nq, nk, heads, heads_kv, d, dv, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(2, n, h, dim, device="cuda", generator=gen).to(torch.bfloat16)
            for n, h, dim in ((nq, heads, d), (nk, heads_kv, d), (nk, heads_kv, dv))]


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", [(192, 128), (128, 64)])
@pytest.mark.parametrize("nq,nk,heads_kv,causal", [(1000, 1000, 4, False),
                                                   (113, 113, 4, True),
                                                   (300, 100, 2, True)])    # blind rows
def test_forward_matches_fp32(d, dv, nq, nk, heads_kv, causal):
    from hopper_attn.harness.window_reference import reference, torch_lowp
    q, k, v = _cuda_inputs(nq, nk, 4, heads_kv, d, dv)
    out, lse = hopper_attn.attention(q, k, v, causal=causal, return_lse=True)
    assert out.shape == (2, nq, 4, dv)
    right = 0 if causal else -1
    ref, ref_lse = reference(q, k, v, -1, right, d ** -0.5)
    low, _ = torch_lowp(q, k, v, -1, right, d ** -0.5)
    assert (out.float() - ref).abs().max() <= 2 * (low - ref).abs().max() + 2 ** -10
    finite = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite)
    # at d = 192 k6's lazy rescale sums P rounded to bf16: the LSE within log(1 + 2^-8)
    assert (lse[finite] - ref_lse[finite]).abs().max() < lse_bound(d)


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", [(192, 128), (128, 64)])
@pytest.mark.parametrize("nq,nk,heads_kv,causal", [(113, 113, 4, False),
                                                   (1000, 1300, 2, True)])
def test_backward_matches_fp32(d, dv, nq, nk, heads_kv, causal):
    from hopper_attn.harness.window_reference import gradient_errors
    q, k, v = _cuda_inputs(nq, nk, 4, heads_kv, d, dv)
    do = torch.randn(2, nq, 4, dv, device="cuda").to(torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    hopper_attn.attention(*leaves, causal=causal).backward(do)
    errors = gradient_errors(q, k, v, do, [t.grad for t in leaves], -1, 0 if causal else -1,
                             d ** -0.5)
    for name, (err, _, bound) in errors.items():
        assert err <= bound, (name, err, bound)


def _tiny_deepseek_v3(transformers):
    """A 2-layer random DeepSeek-V3 (MLA: q/k heads 128 + 64 rotary = 192, v heads 128),
    dense MLPs, eager attention, fp32 on the CPU."""
    config = transformers.DeepseekV3Config(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=2, q_lora_rank=None, kv_lora_rank=64,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=256,
        attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(config)


def test_transformers_mla_reaches_attention_with_dv():
    """transformers' DeepSeek-V3 attention passes v 128 wide (unpadded) to a registered
    attention: the integration hands (192, 192, 128) views to its backend and returns a
    (B, N, H, 128) output (here an fp32 reference backend on the CPU: the eager logits)."""
    transformers = pytest.importorskip("transformers")
    import hopper_attn.integrations.transformers as hopper_tf
    from hopper_attn.harness.window_reference import reference
    seen = []

    def backend(q, k, v, causal, softmax_scale, **features):
        seen.append((q.shape[-1], k.shape[-1], v.shape[-1], causal, features))
        return reference(q, k, v, -1, 0 if causal else -1, softmax_scale)[0].to(q.dtype)

    model = _tiny_deepseek_v3(transformers)
    ids = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        expected = model(ids).logits
        model.set_attn_implementation(hopper_tf.register("hopper_attn_dv_test", backend))
        got = model(ids).logits
    assert seen and all(s[:4] == (192, 192, 128, True) for s in seen)
    assert (got - expected).abs().max() < 1e-4


@pytest.mark.gpu
def test_gpu_deepseek_v3_logits_match_eager():
    """The tiny DeepSeek-V3 in bf16 with hopper_attn ((192, 128) on k6): its logits about
    as far from the fp32 model's as bf16 eager attention's are."""
    transformers = pytest.importorskip("transformers")
    import hopper_attn.integrations.transformers as hopper_tf
    model = _tiny_deepseek_v3(transformers).to("cuda")
    ids = torch.randint(0, 256, (2, 300), device="cuda")
    with torch.no_grad():
        truth = model(ids).logits
        model = model.to(torch.bfloat16)
        base = model(ids).logits.float()
        model.set_attn_implementation(hopper_tf.register())
        ours = model(ids).logits.float()
    err_base, err_ours = ((x - truth).abs().max().item() for x in (base, ours))
    assert err_ours <= 3 * err_base + 2e-3, (err_ours, err_base)


@pytest.mark.gpu
def test_gpu_deepseek_v3_training_matches_eager():
    """One training step of the tiny DeepSeek-V3 in bf16 with hopper_attn ((192, 128): k6
    forward, kb2 backward): logits, loss and every parameter's gradient within 3x (+ 2e-3,
    relative to the largest) bf16 eager attention's error, both against the fp32 model."""
    import copy
    transformers = pytest.importorskip("transformers")
    import hopper_attn.integrations.transformers as hopper_tf
    model = _tiny_deepseek_v3(transformers).to("cuda").train()
    ids = torch.randint(0, 256, (2, 300), device="cuda")

    def step(m, impl):
        m.set_attn_implementation(impl)
        out = m(ids, labels=ids, use_cache=False)
        out.loss.backward()
        result = {"logits": out.logits.detach().float(),
                  "loss": out.loss.detach().float().reshape(1)}
        result.update({n: p.grad.float().clone() for n, p in m.named_parameters()
                       if p.grad is not None})
        m.zero_grad(set_to_none=True)
        return result

    truth = step(model, "eager")
    model = copy.deepcopy(model).to(torch.bfloat16)
    base, ours = step(model, "eager"), step(model, hopper_tf.register())
    assert ours.keys() == truth.keys()
    for what, want in truth.items():
        scale = want.abs().max().clamp_min(1e-6)
        err_base = float((base[what] - want).abs().max() / scale)
        err_ours = float((ours[what] - want).abs().max() / scale)
        assert err_ours <= 3 * err_base + 2e-3, (what, err_ours, err_base)
