"""attention(): argument checks, the fake implementation, and tracing with torch.compile, all
without a GPU (the GPU checks are in tests/test_gpu.py)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import hopper_attn
from hopper_attn.common.contract import Problem, UnsupportedProblem
from hopper_attn.harness import registry


def _qkv(shape=(2, 33, 4, 64), dtype=torch.bfloat16, device="cpu"):
    return [torch.randn(shape, device=device).to(dtype) for _ in range(3)]


def test_refuses_what_it_does_not_support_before_launching():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="multiple"):                # 4 q heads, 3 k/v heads
        hopper_attn.attention(q, k[:, :, :3], v[:, :, :3])
    with pytest.raises(ValueError, match="same shape"):
        hopper_attn.attention(q, k, v[:, :17])
    with pytest.raises(ValueError, match="4-D"):
        hopper_attn.attention(q[0], k, v)
    with pytest.raises(ValueError, match="CUDA"):                   # the checks of the contract
        hopper_attn.attention(q, k[:, :17, :2], v[:, :17, :2])
    with pytest.raises(UnsupportedProblem, match="head_dim"):
        hopper_attn.attention(*_qkv((1, 16, 2, 80)))
    with pytest.raises(UnsupportedProblem, match="GQA"):             # k4 has no GQA
        hopper_attn.attention(q, k[:, :, :2], v[:, :, :2], stage="k4")
    with pytest.raises(ValueError, match="unknown stage"):      # a typo raises, never exits
        hopper_attn.attention(q, k, v, stage="k9")
    with pytest.raises(ValueError, match="unknown option"):    # an option k6 no longer has
        hopper_attn.attention(q, k, v, stage="k6:lazy_rescale=0")


def test_problems_with_other_kv_heads_and_lengths():
    q, k, _ = _qkv((2, 100, 8, 64))
    p = Problem.from_tensor(q, True, k[:, :30, :2])
    assert (p.kv_heads, p.kv_seqlen, p.kv_shape) == (2, 30, (2, 30, 2, 64))
    # bottom-right causal: query i sees min(30, max(0, i - 69)) keys
    assert p.flops == 4 * 2 * 8 * 64 * sum(min(30, max(0, i - 69)) for i in range(100))
    assert Problem.from_tensor(q, True, k) == Problem(2, 8, 100, 64, True)
    with pytest.raises(ValueError, match="multiple"):
        Problem(1, 6, 16, 64, heads_kv=4)


def test_batch_and_heads_past_the_grid_limit_are_refused_clearly():
    spec = registry.get("k5").spec
    assert "65535" in spec.unsupported_reason(Problem(1, 70000, 16, 64), check_memory=False)
    assert "65535" in spec.unsupported_reason(Problem(70000, 1, 16, 64), check_memory=False)
    assert spec.unsupported_reason(Problem(65535, 1, 16, 64), check_memory=False) is None


def test_fake_implementation_gives_the_output_shape():
    with FakeTensorMode():
        q, k, v = (torch.empty(2, 100, 8, 128, dtype=torch.bfloat16, device="cuda")
                   for _ in range(3))
        out, lse = torch.ops.hopper_attn.attention(q, k, v, True, None, "")
        assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
        assert lse.shape == (2, 8, 100) and lse.dtype == torch.float32
        kv = torch.empty(2, 37, 2, 128, dtype=torch.bfloat16, device="cuda")   # GQA + cross
        assert torch.ops.hopper_attn.attention(q, kv, kv, True, None, "")[0].shape == q.shape
        kv3 = torch.empty(2, 100, 3, 128, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="multiple"):
            torch.ops.hopper_attn.attention(q, kv3, kv3, True, None, "")


def test_torch_compile_fullgraph_traces_through_the_op():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return lambda *args: (torch.zeros_like(args[0]),)   # record only, nothing runs

    def f(q, k, v):
        return hopper_attn.attention(q, k, v, causal=True) * 2

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    compiled(*_qkv())
    code = graphs[0].code
    assert "hopper_attn.attention" in code and len(graphs) == 1


def test_strided_views_pass_the_checks_of_strided_stages_only():
    from hopper_attn.common.contract import check_tensors
    qkv = torch.randn(2, 33, 3, 4, 64).to(torch.bfloat16)
    q, k, v = qkv.unbind(2)                                   # strides (33*3*4*64, 3*4*64, 64, 1)
    p = Problem.from_tensor(q)
    with pytest.raises(ValueError, match="CUDA"):             # the layout is fine; the device is not
        check_tensors(p, q, k, v, torch.empty_like(q), strided=True)
    with pytest.raises(ValueError, match="contiguous"):
        check_tensors(p, q, k, v, torch.empty_like(q))
    odd = torch.randn(2, 33, 4, 68).to(torch.bfloat16)[..., :64]   # row stride 68: not 16 B
    with pytest.raises(ValueError, match="16 bytes"):
        check_tensors(p, odd, odd, odd, odd, strided=True)


def test_gradients_are_refused_before_launch_where_no_backward_stage_runs():
    q = torch.randn(1, 16, 2, 64).to(torch.bfloat16).requires_grad_()
    with pytest.raises(ValueError, match="k4 writes no log-sum-exp"):
        hopper_attn.attention(q, q, q, stage="k4")
    with torch.no_grad():                                 # no gradient needed: no such check
        with pytest.raises(ValueError, match="CUDA"):
            hopper_attn.attention(q, q, q, stage="k4")


def test_backward_op_fake_and_traced_backward():
    with FakeTensorMode():
        q = torch.empty(2, 100, 8, 64, dtype=torch.bfloat16, device="cuda")
        kv = torch.empty(2, 37, 2, 64, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(2, 8, 100, dtype=torch.float32, device="cuda")
        dq, dk, dv = torch.ops.hopper_attn.attention_backward(q, kv, kv, q, q, lse, True, None)
        assert dq.shape == q.shape and dk.shape == kv.shape and dv.shape == kv.shape
        out, _ = torch.ops.hopper_attn.attention(q, kv, kv, True, None, "", True)  # deterministic
        assert out.shape == q.shape
        grads = torch.ops.hopper_attn.attention_backward(q, kv, kv, q, q, lse, True, None, True)
        assert [g.shape for g in grads] == [q.shape, kv.shape, kv.shape]
    graphs = []

    def backend(gm, example_inputs):                     # AOT-trace forward and backward
        from torch._functorch.aot_autograd import aot_module_simplified

        def record(g, _):
            graphs.append(g.code)
            return g
        return aot_module_simplified(gm, example_inputs, fw_compiler=record, bw_compiler=record)

    def loss(q, k, v):
        return hopper_attn.attention(q, k, v, causal=True).float().sum()

    leaves = [t.requires_grad_() for t in _qkv()]
    with pytest.raises(ValueError, match="CUDA"):         # traced fine; runs on CPU: refused
        torch.compile(loss, fullgraph=True, backend=backend)(*leaves).backward()
    assert any("hopper_attn.attention.default" in g for g in graphs)


def test_picks_the_measured_fastest_stage_per_head_dim():
    """k6 (faster than k5 everywhere in the same-run benchmarks of 2026-11-26, results/),
    also for what k5 refuses."""
    from hopper_attn import api
    pick = lambda **kw: api._entry_for(Problem(**{"batch": 2, "heads": 4, "seqlen": 256,
                                                  "head_dim": 64, "causal": False, **kw}),
                                       "").name
    assert pick() == "k6" and pick(causal=True) == "k6"
    assert pick(head_dim=128) == "k6" and pick(head_dim=256) == "k6"
    assert pick(dtype=torch.float16) == "k6"                       # k5 runs bf16 only
    assert pick(heads=70000, batch=1) == "k6"                      # k5: one CTA per tile


def test_attention_fp8_refuses_before_launching():
    """attention_fp8: bf16 only, head_dim 64 / 128 / 256, CUDA, no gradients; every refusal
    is a ValueError raised before anything runs (on this machine nothing could)."""
    def qkv(d=128, dtype=torch.bfloat16, **kw):
        return [torch.randn(1, 16, 2, d, **kw).to(dtype) for _ in range(3)]
    with pytest.raises(ValueError, match="bf16"):
        hopper_attn.attention_fp8(*qkv(dtype=torch.float16))
    with pytest.raises(UnsupportedProblem, match="head_dim"):
        hopper_attn.attention_fp8(*qkv(d=96))
    with pytest.raises(ValueError, match="CUDA"):
        hopper_attn.attention_fp8(*qkv())
    with pytest.raises(ValueError, match="bf16 or float8_e4m3fn"):
        hopper_attn.attention_fp8(*qkv(), out_dtype=torch.float16)
    q, k, v = qkv()
    q.requires_grad_(True)
    with pytest.raises(ValueError, match="backward"):
        hopper_attn.attention_fp8(q, k, v)


def test_the_api_does_not_reach_into_the_harness():
    """attention() finds its stages through the package's registry (hopper_attn.stages), not
    the benchmark harness, and no library code of the package ends the caller's process."""
    import ast
    import pathlib
    root = pathlib.Path(hopper_attn.__file__).parent
    tree = ast.parse((root / "api.py").read_text())
    imported = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for a in node.names]
    assert not [m for m in imported if "harness" in m], imported
    for path in root.rglob("*.py"):
        text = path.read_text()
        body = text.split('if __name__ == "__main__":')[0]
        assert "sys.exit(" not in body and "SystemExit" not in body, path


# --- the host fast paths (tools/host_overhead.py times them), on the CPU ---------------------

class _Launches:
    """Stand-ins for the compiled stages: every launch recorded, no GPU."""

    def __init__(self, monkeypatch):
        from hopper_attn import api, kb2
        self.forward, self.backward, self.compiles, self.checks = [], [], [], 0
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        for name in ("_HANDLES", "_FAST", "_BWD_FAST"):
            monkeypatch.setattr(api, name, {})
        monkeypatch.setattr(api, "_DIFFERENTIABLE", set())

        def handle(entry, problem, options=""):
            self.compiles.append((entry.name, problem))
            return type("Handle", (), {"workspace_fn": None, "problem": problem,
                                       "spec": entry.spec})()

        def run_forward(handle, q, k, v, out, scale=None, workspace=None, checked=False):
            self.forward.append((q, k, v))
            out.zero_()

        def run_backward(handle, q, k, v, o, do, lse, dq, dk, dv, scale=None, checked=False):
            self.backward.append(dict(handle=handle, q=q, k=k, v=v, o=o, do=do, dq=dq,
                                      dk=dk, dv=dv, checked=checked))
            dq.fill_(1), dk.fill_(2), dv.fill_(3)

        def check(*args):
            self.checks += 1
        monkeypatch.setattr(api, "_handle", handle)
        monkeypatch.setattr(api, "run_attention", run_forward)
        monkeypatch.setattr(kb2, "run_kernel", run_backward)
        from hopper_attn.common import backward
        real_check = backward.check_backward_tensors
        monkeypatch.setattr(backward, "check_backward_tensors",
                            lambda *a: (check(), real_check(*a)))


def _backward_args(b=1, n=64, h=8, h_kv=2, d=64):
    q = torch.randn(b, n, h, d).to(torch.bfloat16)
    k, v = (torch.randn(b, n, h_kv, d).to(torch.bfloat16) for _ in range(2))
    return q, k, v, torch.randn_like(q), torch.randn_like(q), torch.randn(b, h, n)


def test_backward_fast_path_checks_and_compiles_once_per_layout(monkeypatch):
    from hopper_attn import api
    calls = _Launches(monkeypatch)
    args = _backward_args()
    for _ in range(3):
        dq, dk, dv = api._backward_impl(*args, True, None)
    assert calls.checks == 1 and len(calls.compiles) == 1 and len(calls.backward) == 3
    assert len({id(c["handle"]) for c in calls.backward}) == 1
    assert all(c["checked"] for c in calls.backward)
    assert torch.equal(dq, torch.ones_like(dq)) and torch.equal(dv, torch.full_like(dv, 3))
    api._backward_impl(*_backward_args(n=32), True, None)    # another shape: checked again
    assert calls.checks == 2 and len(calls.compiles) == 2


def test_backward_reads_sdpa_and_transformers_views_in_place(monkeypatch):
    """(batch, heads, seqlen, d) tensors seen as (batch, seqlen, heads, d): no copies, and
    the gradients come back in the inputs' layout (what autograd and SDPA hand on)."""
    from hopper_attn import api
    calls = _Launches(monkeypatch)
    q, k, v, out, dout, lse = (t.transpose(1, 2).contiguous().transpose(1, 2)
                               if t.dim() == 4 and i < 5 else t
                               for i, t in enumerate(_backward_args()))
    assert not q.is_contiguous()
    dq, dk, dv = api._backward_impl(q, k, v, out, dout, lse, True, None)
    (seen,) = calls.backward
    for name, t in (("q", q), ("k", k), ("v", v), ("o", out), ("do", dout)):
        assert seen[name].data_ptr() == t.data_ptr() and seen[name].stride() == t.stride()
    assert dq.stride() == q.stride() and dk.stride() == k.stride()
    # a packed QKV view: read in place too
    qkv = torch.randn(1, 64, 3, 8, 64).to(torch.bfloat16)
    api._backward_impl(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], out, dout, lse, True, None)
    assert calls.backward[-1]["q"].data_ptr() == qkv.data_ptr()


def test_backward_copies_what_it_cannot_read(monkeypatch):
    """A broadcast dout (stride 0, e.g. from out.sum()) is made contiguous, every call."""
    from hopper_attn import api
    calls = _Launches(monkeypatch)
    q, k, v, out, _, lse = _backward_args()
    dout = torch.ones((), dtype=q.dtype).expand_as(q)
    for _ in range(2):
        api._backward_impl(q, k, v, out, dout, lse, True, None)
    assert calls.checks == 1
    for seen in calls.backward:
        assert seen["do"].is_contiguous() and torch.equal(seen["do"], dout)
        assert seen["q"] is q


def test_eager_autograd_path_runs_forward_and_backward_without_the_op(monkeypatch):
    from hopper_attn import api
    calls = _Launches(monkeypatch)
    monkeypatch.setattr(torch.ops.hopper_attn, "attention", None, raising=False)
    monkeypatch.setattr(torch.ops.hopper_attn, "attention_backward", None, raising=False)
    q, k, v, *_ = _backward_args()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    for _ in range(2):
        hopper_attn.attention(q, k, v, causal=True).float().sum().backward()
    assert len(calls.forward) == 2 and len(calls.backward) == 2 and calls.checks == 1
    assert torch.equal(q.grad, torch.full_like(q, 2))                  # two backwards of 1s
    assert torch.equal(k.grad, torch.full_like(k, 4))
    assert len(api._DIFFERENTIABLE) == 1


def test_backward_copies_views_when_strided_reads_are_off(monkeypatch):
    """BACKWARD_READS_STRIDED = False: the old behaviour, non-contiguous inputs copied."""
    from hopper_attn import api
    calls = _Launches(monkeypatch)
    monkeypatch.setattr(api, "BACKWARD_READS_STRIDED", False)
    q, k, v, out, dout, lse = _backward_args()
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    api._backward_impl(qt, k, v, out, dout, lse, True, None)
    (seen,) = calls.backward
    assert seen["q"].is_contiguous() and torch.equal(seen["q"], qt) and seen["k"] is k


def test_decode_steps_share_one_compile_and_workspace(monkeypatch):
    """A decode step with one key more than the last (a new shape) copies its sibling's
    handle and reuses the workspace of its split count: no compile, no allocation but the
    output, no memory query (cudaMemGetInfo) but the first; an LSE nobody asked for goes to
    the workspace's own. Refusals stay."""
    from hopper_attn import api
    from hopper_attn.common import contract, cute_runtime as rt
    launches, compiles = [], []
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(api, "_compile_options", lambda: rt.TVM_FFI)
    monkeypatch.setattr(rt, "compile_for_example",
                        lambda *a, **k: compiles.append(1) or (lambda *t: launches.append(t)))
    for name in ("_HANDLES", "_FAST", "_DECODE_SIBLINGS", "_DECODE_STEPS"):
        monkeypatch.setattr(api, name, {})
    monkeypatch.setattr(contract, "_SHARED_WORKSPACES", {})
    memory_queries, reason = [], contract.KernelSpec.unsupported_reason
    real_checked = api._checked_handle

    def counted(self, problem, check_memory=True):
        memory_queries.append(check_memory)
        return reason(self, problem, check_memory=check_memory)
    monkeypatch.setattr(contract.KernelSpec, "unsupported_reason", counted)
    q = torch.randn(1, 1, 32, 128).to(torch.bfloat16)
    cache = torch.zeros(1, 700, 8, 128, dtype=torch.bfloat16)
    for n in range(512, 520):
        hopper_attn.attention(q, cache[:, :n], cache[:, :n])
    # one handle per kv tile count (128 keys here): 512, then 513-519 (`_decode_step_handle`)
    assert len(compiles) == 1 and len(launches) == 8 and len(api._HANDLES) == 2
    assert sum(memory_queries) <= 2, memory_queries      # the compile's and the allocation's
    assert len({id(t[5]) for t in launches}) == 1             # one partial-O buffer
    assert len({id(t[4]) for t in launches}) == 1             # the workspace's LSE
    _, lse = hopper_attn.attention(q, cache[:, :520], cache[:, :520], return_lse=True)
    assert launches[-1][4] is lse and lse is not launches[0][4]
    checked = []
    monkeypatch.setattr(api, "_checked_handle", lambda *a, **k: checked.append(1)
                        or real_checked(*a, **k))
    for n in range(650, 660):      # a cache torch.cat grows: new strides each step, no checks
        grown = torch.zeros(1, 8, n, 128, dtype=torch.bfloat16).transpose(1, 2)
        hopper_attn.attention(q, grown, grown)
    assert len(checked) == 1                                   # 650-659: one kv tile count
    odd = torch.zeros(1, 700, 8, 130, dtype=torch.bfloat16)[..., :128]
    with pytest.raises(ValueError, match="16 bytes"):
        hopper_attn.attention(q, odd[:, :521], odd[:, :521])
    with pytest.raises(ValueError, match="16 bytes"):         # k's strides change in a tile
        hopper_attn.attention(q, odd[:, :531], cache[:, :531])


@pytest.mark.parametrize("model,shape,kwargs,expect", [
    # (batch, queries, q heads, k/v heads, keys, d); transformers' generation step
    ("mistral", (1, 1, 32, 8, 8192, 128), dict(window_size=(4095, 0)), "decode"),
    ("mistral, short prompt", (1, 1, 32, 8, 100, 128), dict(window_size=(4095, 0)), "decode"),
    ("gemma-2 local", (1, 1, 16, 8, 8192, 256), dict(window_size=(4095, 0), softcap=50.0),
     "decode:softcap=50.0"),
    ("gemma-2 global", (1, 1, 16, 8, 8192, 256), dict(softcap=50.0), "decode:softcap=50.0"),
    ("gpt-oss full", (1, 1, 64, 8, 8192, 64), dict(sinks=True), "decode:sinks=1"),
    ("gpt-oss window 128", (1, 1, 64, 8, 8192, 64), dict(window_size=(127, 0), sinks=True),
     "decode:sinks=1"),
    ("gpt-oss window 128, B4", (4, 1, 64, 8, 8192, 64),
     dict(window_size=(127, 0), sinks=True), "decode:sinks=1"),
    ("gemma-2, 4 drafted queries", (2, 4, 16, 8, 8192, 256),
     dict(window_size=(4095, 0), softcap=50.0), "decode:softcap=50.0"),
    ("prefill", (1, 128, 32, 8, 4096, 128), dict(window_size=(4095, 0), softcap=30.0),
     "k6:softcap=30.0"),
])
def test_decode_shapes_with_window_softcap_sinks_pick_the_decode_stage(monkeypatch, model,
                                                                         shape, kwargs, expect):
    """attention()'s choice for a generation step of models with windows, softcaps and
    sinks (causal): the decode stage with the features as compile options, k6 for
    prefill."""
    calls = _Launches(monkeypatch)
    b, nq, hq, hkv, nk, d = shape
    q = torch.randn(b, nq, hq, d).to(torch.bfloat16)
    k = v = torch.zeros(b, nk, hkv, d, dtype=torch.bfloat16)
    if kwargs.pop("sinks", False):
        kwargs["sinks"] = torch.zeros(hq)
    hopper_attn.attention(q, k, v, causal=True, return_lse=True, **kwargs)
    (name, problem), = calls.compiles
    assert name == expect, model
    assert (problem.window_left, problem.window_right) == \
        ((kwargs["window_size"][0], None) if "window_size" in kwargs else (None, None))


def test_the_decode_stage_takes_softcap_and_window_by_name():
    from hopper_attn import api
    p = Problem(1, 32, 1, 128, True, heads_kv=8, seqlen_k=300, window_left=127)
    assert api._entry_for(p, "decode", 30.0).name == "decode:softcap=30.0"
    assert api._entry_for(p, "decode").name == "decode"           # (prefers would take k6)
    with pytest.raises(ValueError, match="softcap"):
        api._entry_for(p, "k5", 30.0)
    with pytest.raises(UnsupportedProblem, match="window_size"):
        api._entry_for(p, "k5")
