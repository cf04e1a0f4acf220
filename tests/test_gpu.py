"""On the GPU: ref_check's randomized sweep for every kernel (odd N, causal, both d), and the
attention() op (against fp32, under torch.compile, captured in a CUDA graph)."""

import pytest
import torch

from hopper_attn.harness import registry

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", list(registry.KERNELS))
def test_ref_check(name):
    from ref_check import check_kernel
    rows = check_kernel(registry.get(name), seed=1234)
    bad = [r for r in rows if not r.get("skipped") and not r.get("ok")]
    assert not bad, bad[:3]


def _reference(q, k, v, causal, scale):
    s = torch.einsum("bihd,bjhd->bhij", q.float(), k.float()) * scale
    if causal:
        n = q.shape[1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", torch.softmax(s, -1), v.float())


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_op_matches_fp32(d, causal):
    import hopper_attn
    gen = torch.Generator(device="cuda").manual_seed(d + causal)
    q, k, v = (torch.randn(2, 1000, 3, d, device="cuda", generator=gen).to(torch.bfloat16)
               for _ in range(3))
    for scale in (None, 0.3):
        out = hopper_attn.attention(q, k, v, causal=causal, softmax_scale=scale)
        ref = _reference(q, k, v, causal, d ** -0.5 if scale is None else scale)
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
            scale=scale).transpose(1, 2)                    # torch's own bf16 error
        torch_err = (sdpa.float() - ref).abs().max().item()
        assert (out.float() - ref).abs().max().item() <= 2 * torch_err + 2 ** -10


def test_attention_op_under_torch_compile_and_cuda_graphs():
    import hopper_attn
    q, k, v = (torch.randn(1, 512, 4, 128, device="cuda").to(torch.bfloat16) for _ in range(3))
    eager = hopper_attn.attention(q, k, v, causal=True)
    compiled = torch.compile(lambda a, b, c: hopper_attn.attention(a, b, c, causal=True),
                             fullgraph=True)
    assert torch.equal(compiled(q, k, v), eager)
    static = [t.clone() for t in (q, k, v)]
    hopper_attn.attention(*static, causal=True)          # compile and bind outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = hopper_attn.attention(*static, causal=True)
    for t in static:
        t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, hopper_attn.attention(*static, causal=True))
