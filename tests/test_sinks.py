"""Attention sinks (issue 61, gpt-oss's `s_aux`; docs/sinks.md): one logit per query head in
every row's softmax denominator. On the CPU: the sinks' gradient formula against autograd
on a float64 reference (and the kernels' unchanged backward formulas with the sink-inclusive
LSE), k6 with sinks compiles once for any values and shapes without spills, bad sinks and
stages without sinks are refused before any launch. On the GPU (`gpu`): forward and
backward against the reference (tools/sinks_gpu_check.py runs the full sweep)."""

import math

import pytest
import torch

import hopper_attn
from hopper_attn.common.contract import Problem
from hopper_attn.common.sinks import reference_with_sinks, sink_grad
from hopper_attn.harness.compile_report import compile_artifacts, resource_usage
from hopper_attn.harness.reference_backward import attention_backward
from hopper_attn.harness.window_reference import window_mask


def _scores(q, k, scale):
    group = q.shape[2] // k.shape[2]
    return torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(group, dim=2)) * scale


@pytest.mark.parametrize("nq,nk,left,causal", [(9, 9, -1, True), (7, 5, 2, True),
                                               (6, 11, 3, False)])
def test_sink_grad_matches_autograd_float64(nq, nk, left, causal):
    """dsinks = -sum_rows exp(sink - lse) rowsum(dO * O) against autograd, with windows and
    rows that see no key (nq > nk, causal: output 0, LSE the sink); the backward's own
    formulas (P = exp(S - LSE), D = rowsum(dO * O)) give autograd's dq, dk, dv once the LSE
    holds the sink, so the kernels' backward needs no change."""
    gen = torch.Generator().manual_seed(nq * 13 + nk)
    q = torch.randn(2, nq, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, nk, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    sinks = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    do = torch.randn(2, nq, 4, 8, generator=gen, dtype=torch.float64)
    seen = window_mask(nq, nk, left, 0 if causal else -1, "cpu")
    scale = 8 ** -0.5
    out, lse = reference_with_sinks(_scores(q, k, scale), seen, v, sinks)
    torch.autograd.backward(out, do)
    blind = ~seen.any(-1)
    assert torch.equal(blind.any(), torch.tensor(nq > nk))
    assert (out[:, blind] == 0).all()
    assert torch.allclose(lse[:, :, blind], sinks.detach()[None, :, None].expand_as(
        lse[:, :, blind]))
    assert torch.allclose(sink_grad(sinks.detach(), out.detach(), do, lse.detach()),
                          sinks.grad, rtol=1e-10, atol=1e-12)
    if left < 0 and causal:             # the reference backward: causal, no window
        dq, dk, dv = attention_backward(q.detach(), k.detach(), v.detach(), out.detach(),
                                        lse.detach(), do, True, scale)
        for mine, theirs in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
            assert torch.allclose(mine.double(), theirs, rtol=1e-4, atol=1e-5)


def test_window_reference_takes_sinks():
    """harness/window_reference.py's fp32 reference with sinks agrees with the float64 one
    (rows that see no key included)."""
    from hopper_attn.harness.window_reference import reference
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 9, 4, 16, generator=gen)
    k, v = (torch.randn(1, 6, 2, 16, generator=gen) for _ in range(2))
    sinks = torch.randn(4, generator=gen)
    out, lse = reference(q, k, v, 2, 0, 0.25, sinks=sinks)
    seen = window_mask(9, 6, 2, 0, "cpu")
    ref, ref_lse = reference_with_sinks(_scores(q.double(), k.double(), 0.25), seen,
                                        v.double(), sinks.double())
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)


def test_sinks_in_reference_match_an_extra_column():
    """The reference's sink is transformers' gpt-oss eager attention: the logit appended as
    a column, softmax, the column dropped; unscaled, in the scaled scores' units."""
    gen = torch.Generator().manual_seed(3)
    s = torch.randn(1, 2, 3, 5, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 5, 2, 4, generator=gen, dtype=torch.float64)
    sinks = torch.tensor([0.5, -2.0], dtype=torch.float64)
    out, lse = reference_with_sinks(s, torch.ones(3, 5, dtype=torch.bool), v, sinks)
    cat = torch.cat([s, sinks[None, :, None, None].expand(1, 2, 3, 1)], -1)
    p = torch.softmax(cat, -1)[..., :-1]
    assert torch.allclose(out, torch.einsum("bhij,bjhd->bihd", p, v))
    assert torch.allclose(lse, torch.logsumexp(cat, -1))


@pytest.mark.compile
def test_k6_sinks_compile_once_without_spills():
    """gpt-oss's shape (d 64, GQA 8:1, causal window (127, 0)) with sinks: one more kernel
    parameter and one exp2 more per row than without; no spills; the compiled kernel serves
    other lengths of its POLICY row, heads and batch (runtime values, no recompile)."""
    import re
    from hopper_attn import k6
    from hopper_attn.harness import registry
    entry = registry.get("k6:sinks=1")
    art = compile_artifacts(entry, 64, True, heads=8, heads_kv=1, window=(127, -1))
    plain = compile_artifacts(registry.get("k6"), 64, True, heads=8, heads_kv=1,
                              window=(127, -1))
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    params = [len(re.findall(r"\.param\s", re.search(r"\.entry\s+\S+\((.*?)\)", a["ptx"],
                                                      re.S).group(1))) for a in (art, plain)]
    assert params[0] == params[1] + 1
    assert art["kernel"]["sinks"] and "sinks" not in plain["kernel"]
    first = k6.compile_kernel(Problem(1, 64, 4096, 64, True, heads_kv=8, window_left=127),
                              sinks=1)
    again = k6.compile_kernel(Problem(3, 16, 6000, 64, True, heads_kv=2, window_left=127),
                              sinks=1)
    assert again.compile_seconds == 0.0 and again.compiled is first.compiled


@pytest.mark.compile
def test_decode_sinks_compile_without_spills():
    """The decode stage with sinks (joined in the one-split path and at the combine): one
    more kernel parameter, no spills."""
    import re
    from hopper_attn.harness import registry
    art = compile_artifacts(registry.get("decode:sinks=1"), 64, True, seqlen=1, heads=64,
                            heads_kv=8)
    plain = compile_artifacts(registry.get("decode"), 64, True, seqlen=1, heads=64, heads_kv=8)
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    params = [len(re.findall(r"\.param\s", re.search(r"\.entry\s+\S+\((.*?)\)", a["ptx"],
                                                        re.S).group(1))) for a in (art, plain)]
    assert params[0] == params[1] + 1 and art["kernel"]["sinks"]


def test_bad_sinks_are_refused_before_a_launch():
    q, k, v = (torch.zeros(1, 16, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    for sinks, words in [(torch.zeros(3), "shape (4,)"), (torch.zeros(1, 4), "shape (4,)"),
                         (torch.zeros(4, dtype=torch.int32), "float32, bfloat16"),
                         (torch.zeros(4, dtype=torch.float64), "float32, bfloat16"),
                         ([0.0] * 4, "torch.Tensor"),
                         (torch.zeros(4, device="meta"), "is on meta")]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            hopper_attn.attention(q, k, v, causal=True, sinks=sinks)
    for stage in ("k5", "k4", "k7", "kb2"):
        with pytest.raises(ValueError, match="no attention sinks"):
            hopper_attn.attention(q, k, v, causal=True, stage=stage, sinks=torch.zeros(4))
    # a good call gets as far as the device check (CPU tensors: no launch)
    with pytest.raises(ValueError, match="CUDA"):
        hopper_attn.attention(q, k, v, causal=True, sinks=torch.zeros(4, dtype=torch.bfloat16))


def test_few_queries_with_sinks_take_the_decode_stage():
    from hopper_attn import api
    pick = lambda n, sinks, **kw: api._entry_for(Problem(1, 64, n, 64, True, heads_kv=8,  # noqa
                                                         seqlen_k=4096), "", 0.0, sinks, **kw)
    assert pick(1, True).name == "decode:sinks=1" and pick(1, False).name == "decode"
    assert pick(64, True).name == "k6:sinks=1"
    assert api._entry_for(Problem(1, 64, 1, 64, True, heads_kv=8, seqlen_k=4096), "",
                          50.0, True).name == "decode:softcap=50.0,sinks=1"


def test_sinks_trace_through_torch_compile_with_their_gradient():
    """The custom op takes the sinks (fake implementation, autograd): a traced forward and
    backward, the backward with the sinks' gradient; on CPU tensors the run is refused."""
    graphs = []

    def backend(gm, example_inputs):
        from torch._functorch.aot_autograd import aot_module_simplified

        def record(g, _):
            graphs.append(g.code)
            return g
        return aot_module_simplified(gm, example_inputs, fw_compiler=record, bw_compiler=record)

    def loss(q, k, v, sinks):
        return hopper_attn.attention(q, k, v, causal=True, sinks=sinks).float().sum()

    leaves = [torch.randn(1, 16, 4, 64).to(torch.bfloat16).requires_grad_() for _ in range(3)]
    sinks = torch.zeros(4, requires_grad=True)
    with pytest.raises(ValueError, match="CUDA"):
        torch.compile(loss, fullgraph=True, backend=backend)(*leaves, sinks).backward()
    assert any("hopper_attn.attention.default" in g for g in graphs)


@pytest.mark.parametrize("path", ["eager", "op"])
def test_autograd_returns_the_sinks_gradient(monkeypatch, path):
    """attention()'s autograd (eager Function and the custom op's) with the kernels replaced
    by the float64 reference: dq, dk, dv from the backward stage, dsinks from `sink_grad`,
    as autograd gives them; sinks alone needing a gradient skip the backward stage."""
    from hopper_attn import api
    scale = 64 ** -0.5
    calls = []

    def run(q, k, v, causal, softmax_scale, stage, softcap=0.0, window=(-1, -1), sinks=None):
        seen = window_mask(q.shape[1], k.shape[1], window[0], 0 if causal else -1, "cpu")
        out, lse = reference_with_sinks(_scores(q.double(), k.double(), scale), seen,
                                        v.double(), sinks.double())
        return out.to(q.dtype), lse.float()

    def backward(q, k, v, out, dout, lse, causal, *args):
        calls.append(1)
        grads = [g.to(t.dtype) for g, t in zip(attention_backward(q, k, v, out, lse, dout,
                                                                  causal, scale), (q, k, v))]
        d_rows = (dout.float() * out.float()).sum(-1).transpose(1, 2)   # the preprocess's D
        return (*grads, torch.cat([d_rows, torch.zeros_like(d_rows)], -1))  # (+ padded rows)
    monkeypatch.setattr(api, "_run", run)
    monkeypatch.setattr(api, "_backward_rows", backward)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 12, 4, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    sinks = torch.randn(4, generator=gen)
    do = torch.randn(1, 12, 4, 64, generator=gen).to(torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref = [t.double().detach().requires_grad_() for t in (q, k, v, sinks)]
    out, _ = reference_with_sinks(_scores(ref[0], ref[1], scale),
                                  torch.ones(12, 12, dtype=torch.bool).tril(), ref[2], ref[3])
    out.backward(do.double())
    if path == "eager":
        mine = hopper_attn.attention(*leaves[:3], causal=True, sinks=leaves[3])
    else:
        mine = torch.ops.hopper_attn.attention(*leaves[:3], True, None, "", False, 0.0, -1,
                                               -1, leaves[3])[0]
    mine.backward(do)
    for t, r in zip(leaves, ref):
        assert torch.allclose(t.grad.double(), r.grad, rtol=0.05, atol=0.02)
    assert calls == [1]
    only_sinks = sinks.clone().requires_grad_()
    hopper_attn.attention(q, k, v, causal=True, sinks=only_sinks).backward(do)
    assert only_sinks.grad is not None and calls == [1]


def test_run_kernel_wants_sinks_exactly_with_a_sinks_kernel():
    from hopper_attn import k6
    from hopper_attn.common.contract import CompiledAttention
    handle = CompiledAttention(k6.SINKS_SPEC, Problem(1, 4, 16, 64), {"sinks": True}, None,
                               0.0, None)
    q = torch.zeros(1, 16, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="sinks=1"):
        k6.run_kernel(handle, q, q, q, q)
    with pytest.raises(ValueError, match="CUDA"):      # the sinks' own check, then q's
        k6.run_kernel(handle, q, q, q, q, torch.zeros(4))


# ---- packed batches (attention_varlen) ----

def _packed_reference(q, k, v, cu_q, cu_k, sinks, causal, left, scale):
    """Per document, float64 and differentiable: (out (cu_q[-1], H, d), lse (H, cu_q[-1]))."""
    outs, lses = [], []
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        if q1 > q0:
            seen = window_mask(q1 - q0, k1 - k0, left, 0 if causal else -1, "cpu")
            o, lse = reference_with_sinks(_scores(q[None, q0:q1], k[None, k0:k1], scale), seen,
                                          v[None, k0:k1], sinks)
            outs.append(o[0])
            lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, 1)


# documents of 9 / 9, 0 / 5, 7 / 0 (rows without keys: output 0, LSE the sink) and 5 / 6
# query / key tokens, then 2 query tokens past cu_seqlens_q[-1] (never written)
_CU_Q, _CU_K, _TOTAL_Q = [0, 9, 9, 16, 21], [0, 9, 14, 14, 20], 23


def _packed_inputs(seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(_TOTAL_Q, 4, 8, generator=gen, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(_CU_K[-1], 2, 8, generator=gen, dtype=torch.float64).to(dtype)
            for _ in range(2))
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    sinks[0] = float("-inf")                                    # a head without a sink
    do = torch.randn(_TOTAL_Q, 4, 8, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v, sinks, do


def test_varlen_sink_grad_matches_autograd_float64():
    """dsinks over the packed layout (out (total_q, H, d), LSE (H, total_q)) against
    autograd of the per-document reference: documents without queries or without keys, a
    -inf sink, a window, and rows past cu_seqlens_q[-1] holding NaN (ignored)."""
    from hopper_attn.common.sinks import varlen_sink_grad
    q, k, v, sinks, do = _packed_inputs(1)
    sinks.requires_grad_()
    n = _CU_Q[-1]
    out, lse = _packed_reference(q, k, v, _CU_Q, _CU_K, sinks, True, 3, 8 ** -0.5)
    torch.autograd.backward(out, do[:n])
    assert (out[9:16] == 0).all() and torch.equal(lse[:, 9:16].detach(),
                                                  sinks.detach()[:, None].expand(4, 7))
    nan_rows = torch.full((2, 4, 8), float("nan"), dtype=torch.float64)
    packed_out = torch.cat([out.detach(), nan_rows])
    packed_lse = torch.cat([lse.detach(), torch.full((4, 2), float("nan"),
                                                     dtype=torch.float64)], 1)
    mine = varlen_sink_grad(sinks.detach(), packed_out, do, packed_lse,
                            torch.tensor(_CU_Q, dtype=torch.int32))
    # (head 0's autograd is NaN: its rows without keys have neither keys nor a sink)
    assert mine[0] == 0 and torch.allclose(mine, sinks.grad.nan_to_num(0.0), rtol=1e-10,
                                           atol=1e-12)
    # the GPU check's references (harness/varlen_reference.py): fp32, and bf16 as torch runs it
    from hopper_attn.harness.varlen_reference import sink_reference
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in (_CU_Q, _CU_K))
    ref, ref_lse = sink_reference(q[:n].float(), k.float(), v.float(), cu_q, cu_k, True,
                                  sinks.detach().float(), (3, -1), 8 ** -0.5)
    low, _ = sink_reference(*(t.bfloat16() for t in (q[:n], k, v)), cu_q, cu_k, True,
                            sinks.detach().float(), (3, -1), 8 ** -0.5, lowp=True)
    assert torch.allclose(ref.double(), out, atol=1e-5)
    assert torch.equal(ref_lse.isfinite(), lse.isfinite())
    assert torch.allclose(ref_lse.double(), lse.detach(), atol=1e-5, equal_nan=True)
    assert torch.allclose(low.double().nan_to_num(0.0), out, atol=0.05)


@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_attention_varlen_autograd_returns_the_sinks_gradient(monkeypatch, path):
    """attention_varlen's autograd, eager and traced by torch.compile(fullgraph=True), with
    the kernels replaced by the float64 reference (the backward hands back autograd's dq,
    dk, dv and D): dsinks from `varlen_sink_grad` over the backward's D (its NaN rows past
    cu_seqlens_q[-1] masked) as autograd gives it (bf16 sinks converted differentiably);
    sinks alone needing a gradient skip the backward kernel (D from dO and O in torch)."""
    from hopper_attn import api
    scale, calls, graphs = 8 ** -0.5, [], []

    def run(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, seqused_k, window,
            softcap, sinks=None):
        out = torch.full(q.shape, float("nan"), dtype=q.dtype)
        lse = torch.full((q.shape[1], q.shape[0]), float("nan"))
        ref, ref_lse = _packed_reference(q.double(), k.double(), v.double(), _CU_Q, _CU_K,
                                         sinks.double(), causal, window[0], scale)
        out[:_CU_Q[-1]], lse[:, :_CU_Q[-1]] = ref.to(q.dtype), ref_lse.float()
        return out, lse

    def backward(q, k, v, out, dout, lse, *args):     # (autograd is off in here)
        calls.append(1)
        grads = [r.grad.to(t.dtype) for r, t in zip(ref, (q, k, v))]
        # the preprocess's D, packed (H, total_q); NaN past cu_seqlens_q[-1], as out there
        return (*grads, (dout.float() * out.float()).sum(-1).t())

    def backend(gm, example_inputs):                 # records the traced graphs
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified

        def record(g, _):
            graphs.append(g.code)
            return make_boxed_func(g)
        return aot_module_simplified(gm, example_inputs, fw_compiler=record, bw_compiler=record)

    monkeypatch.setattr(api, "_run_varlen", run)
    monkeypatch.setattr(api, "_varlen_backward_rows", backward)
    q, k, v, sinks, do = _packed_inputs(2, torch.float32)
    sinks[0] = 0.5                        # (a -inf sink's gradient is NaN in the reference)
    sinks = sinks.to(torch.bfloat16)
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in (_CU_Q, _CU_K))
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref = [t.double().detach().requires_grad_() for t in (q, k, v, sinks)]
    out, _ = _packed_reference(*ref[:3], _CU_Q, _CU_K, ref[3], True, 3, scale)
    out.backward(do[:_CU_Q[-1]].double())

    def call(q, k, v, sinks):
        return hopper_attn.attention_varlen(q, k, v, cu_q, cu_k, 9, 9, causal=True,
                                            window_size=(3, 0), sinks=sinks)
    if path == "compiled":
        call = torch.compile(call, fullgraph=True, backend=backend)
    call(*leaves).backward(do)
    for t, r in zip(leaves, ref):
        assert t.grad.dtype == t.dtype
        assert torch.allclose(t.grad.double(), r.grad, rtol=0.02, atol=1e-3)
    assert calls == [1]
    if path == "compiled":
        assert any("hopper_attn.attention_varlen.default" in g for g in graphs)
        assert any("hopper_attn.attention_varlen_backward_sinks.default" in g for g in graphs)
        return
    only_sinks = sinks.clone().requires_grad_()
    call(q, k, v, only_sinks).backward(do)
    assert only_sinks.grad is not None and calls == [1]


def test_attention_varlen_refuses_bad_sinks():
    q, k, v = torch.zeros(21, 4, 64, dtype=torch.bfloat16), *(
        torch.zeros(20, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in (_CU_Q, _CU_K))
    for sinks, words in [(torch.zeros(2), "shape (4,)"), (torch.zeros(1, 4), "shape (4,)"),
                         (torch.zeros(4, dtype=torch.int32), "float32, bfloat16"),
                         ([0.0] * 4, "torch.Tensor"),
                         (torch.zeros(4, device="meta"), "is on meta")]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            hopper_attn.attention_varlen(q, k, v, cu_q, cu_k, 9, 9, causal=True, sinks=sinks)
    with pytest.raises(ValueError, match="CUDA"):          # good sinks: as far as the device
        hopper_attn.attention_varlen(q, k, v, cu_q, cu_k, 9, 9, sinks=torch.zeros(4))


def test_attention_varlen_fake_takes_sinks():
    """The varlen op's fake implementation (torch.compile, meta tensors) with sinks."""
    meta = [t.to("meta") for t in _packed_inputs(3, torch.bfloat16)[:3]]
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device="meta") for c in (_CU_Q, _CU_K))
    out, lse = hopper_attn.attention_varlen(*meta, cu_q, cu_k, 9, 9, causal=True,
                                            sinks=torch.zeros(4, device="meta"),
                                            return_lse=True)
    assert out.shape == meta[0].shape and lse.shape == (4, _TOTAL_Q)


@pytest.mark.compile
def test_k6_varlen_sinks_compile_without_spills():
    """gpt-oss's shape packed (d 64, GQA 8:1, causal window (127, 0)) with sinks: one more
    kernel parameter than without, no spills."""
    import re
    import tempfile
    from hopper_attn import k6_varlen
    q, k = torch.zeros(40, 64, 64, dtype=torch.bfloat16), torch.zeros(40, 8, 64,
                                                                      dtype=torch.bfloat16)
    problem = k6_varlen.problem_for(q, k, 3, 4096, 4096, True, (127, -1))
    params = []
    with tempfile.TemporaryDirectory() as d:
        options = (f"--keep-ptx --dump-dir={d} --ptxas-options='--warn-on-spills "
                   "--warning-as-error'")
        for sinks in (True, False):
            compiled, kernel = k6_varlen.compile_varlen(problem, False, sinks=sinks,
                                                        compile_options=options)
            entry = re.search(r"\.entry\s+\S+\((.*?)\)", compiled.__ptx__, re.S).group(1)
            params.append(len(re.findall(r"\.param\s", entry)))
            assert kernel.describe().get("sinks", False) == sinks
    assert params[0] == params[1] + 1


# ---- GPU ----

def _gpu_case(b, nq, nk, hq, hk, d, causal, left, seed, grad=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, nq, hq, d, device="cuda", generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(b, nk, hk, d, device="cuda", generator=gen).to(torch.bfloat16)
            for _ in range(2))
    sinks = torch.randn(hq, device="cuda", generator=gen) * 2
    seen = window_mask(nq, nk, left, 0 if causal else -1)
    leaves = [t.double().requires_grad_(grad) for t in (q, k, v, sinks)]
    ref, ref_lse = reference_with_sinks(_scores(*leaves[:2], d ** -0.5), seen, leaves[2],
                                        leaves[3])
    return q, k, v, sinks, leaves, ref, ref_lse


@pytest.mark.gpu
@pytest.mark.parametrize("nq,nk,d,causal,left", [(1000, 1000, 64, True, 128),
                                                 (113, 113, 128, True, -1),
                                                 (300, 200, 64, True, -1),
                                                 (17, 17, 256, False, -1)])
def test_k6_sinks_forward_matches_float64(nq, nk, d, causal, left):
    q, k, v, sinks, _, ref, ref_lse = _gpu_case(2, nq, nk, 8, 2, d, causal, left, nq + d)
    out, lse = hopper_attn.attention(q, k, v, causal=causal, window_size=(left, -1),
                                     sinks=sinks, return_lse=True)
    assert (out.double() - ref).abs().max().item() < 2 ** -7
    assert (lse.double() - ref_lse).abs().max().item() < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("stage", ["", "decode:num_splits=1", "decode:num_splits=7"])
@pytest.mark.parametrize("nq", [1, 4])
def test_decode_sinks_match_float64(stage, nq):
    """gpt-oss decode steps (64 / 8 heads, d 64) over 3000 keys: the sink in the one-split
    path and at the combine of several splits."""
    q, k, v, sinks, _, ref, ref_lse = _gpu_case(1, nq, 3000, 64, 8, 64, True, -1, nq)
    if not stage:
        from hopper_attn import api
        assert api._entry_for(Problem.from_tensor(q, True, k), "", 0.0, True).name == \
            "decode:sinks=1"
    out, lse = hopper_attn.attention(q, k, v, causal=True, sinks=sinks, return_lse=True,
                                     stage=stage or None)
    assert (out.double() - ref).abs().max().item() < 2 ** -7
    assert (lse.double() - ref_lse).abs().max().item() < 1e-3


@pytest.mark.gpu
def test_k6_sinks_backward_matches_float64():
    q, k, v, sinks, leaves, ref, _ = _gpu_case(1, 500, 500, 8, 2, 64, True, 128, 7, True)
    do = torch.randn_like(q)
    torch.autograd.backward(ref, do.double())
    mine = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    out = hopper_attn.attention(*mine[:3], causal=True, window_size=(128, 0), sinks=mine[3])
    out.backward(do)
    for t, r in zip(mine, leaves):
        err = (t.grad.double() - r.grad).abs().max().item()
        assert err <= 0.02 * r.grad.abs().max().item() + 1e-3, err


@pytest.mark.gpu
def test_attention_varlen_sinks_match_the_per_sequence_reference():
    """A packed batch with sinks (lengths 0, 1, 17, 300, 1000; GQA 8/2, d 64, causal window
    (128, 0)): O, LSE, dq, dk, dv and dsinks against the fp32 per-sequence reference within
    2x the error of torch's bf16 math (+ 2^-10 / 2^-12 max|ref|)."""
    from hopper_attn.harness.varlen_reference import cu_seqlens, sink_reference
    lengths = [0, 1, 17, 300, 1000]
    cu = cu_seqlens(lengths)
    gen = torch.Generator(device="cuda").manual_seed(9)
    q = torch.randn(sum(lengths), 8, 64, device="cuda", generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(sum(lengths), 2, 64, device="cuda", generator=gen).to(torch.bfloat16)
            for _ in range(2))
    sinks = torch.randn(8, device="cuda", generator=gen) * 2
    do = torch.randn_like(q)
    mine = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out, lse = hopper_attn.attention_varlen(*mine[:3], cu, cu, 1000, 1000, causal=True,
                                            window_size=(128, 0), sinks=mine[3],
                                            return_lse=True)
    out.backward(do)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v, sinks)]
    ref, ref_lse = sink_reference(*ref_in[:3], cu, cu, True, ref_in[3], (128, 0))
    ref.backward(do.float())
    low_in = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    low, _ = sink_reference(*low_in[:3], cu, cu, True, low_in[3], (128, 0), lowp=True)
    low.backward(do)
    assert (out.float() - ref).abs().max() <= 2 * (low.float() - ref).abs().max() + 2 ** -10
    assert (lse - ref_lse).abs().max() < 1e-3
    for m, r, lo in zip(mine, ref_in, low_in):
        bound = 2 * (lo.grad.float() - r.grad).abs().max() + 2 ** -12 * r.grad.abs().max()
        assert (m.grad.float() - r.grad).abs().max() <= bound
