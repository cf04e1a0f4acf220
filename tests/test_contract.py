"""The kernel contract: problems, FLOP counts, what kernels declare, input validation."""

import pytest
import torch

from hopper_attn.harness import registry
from hopper_attn.common.contract import (CompiledAttention, KernelSpec, Problem, UnsupportedProblem,
                                         check_tensors, run_attention)


def test_flops_are_4bhn2d_and_half_for_causal():
    p = Problem(batch=2, heads=3, seqlen=100, head_dim=64)
    assert p.flops == 4 * 2 * 3 * 100 * 100 * 64
    assert Problem(2, 3, 100, 64, causal=True).flops == p.flops / 2
    assert p.shape == (2, 100, 3, 64)
    assert p.softmax_scale == pytest.approx(1 / 8)


@pytest.mark.parametrize("field", ["batch", "heads", "seqlen", "head_dim"])
def test_problem_rejects_zero_and_non_int(field):
    kwargs = dict(batch=1, heads=1, seqlen=16, head_dim=64)
    with pytest.raises(ValueError, match=field):
        Problem(**{**kwargs, field: 0})
    with pytest.raises(ValueError, match=field):
        Problem(**{**kwargs, field: 2.0})


def test_problem_from_tensor_reads_bnhd():
    q = torch.empty(2, 17, 3, 64, dtype=torch.bfloat16)
    assert Problem.from_tensor(q, causal=True) == Problem(2, 3, 17, 64, True)
    with pytest.raises(ValueError, match="4-D"):
        Problem.from_tensor(torch.empty(17, 64))


@pytest.mark.parametrize("name", [*registry.KERNELS, *registry.BACKWARD_KERNELS])
def test_every_kernel_declares_bf16_and_head_dims_64_128(name):
    spec = registry.get(name).spec
    assert torch.bfloat16 in spec.dtypes
    assert {64, 128} <= set(spec.head_dims)


@pytest.mark.parametrize("name", [*registry.KERNELS, *registry.BACKWARD_KERNELS])
def test_unsupported_head_dim_and_dtype_are_refused_with_a_reason(name):
    spec = registry.get(name).spec
    reason = spec.unsupported_reason(Problem(1, 1, 64, 80))
    assert reason and "head_dim" in reason
    reason = spec.unsupported_reason(Problem(1, 1, 64, 64, dtype=torch.float32))
    assert reason and "dtype" in reason
    if torch.float16 not in spec.dtypes:
        reason = spec.unsupported_reason(Problem(1, 1, 64, 64, dtype=torch.float16))
        assert reason and "dtype" in reason
    with pytest.raises(UnsupportedProblem):
        registry.get(name).compile(Problem(1, 1, 64, 80))


def test_k1_refuses_grids_it_cannot_launch():
    spec = registry.get("k1").spec
    assert "seqlen" in spec.unsupported_reason(Problem(1, 1, 70000, 64), check_memory=False)
    assert "grid" in spec.unsupported_reason(Problem(300, 300, 64, 64), check_memory=False)


def test_k1_memory_check_refuses_before_allocating(monkeypatch):
    spec = registry.get("k1").spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (8 << 30, 80 << 30))
    reason = spec.unsupported_reason(Problem(16, 16, 8192, 64))   # 64 GiB of scores
    assert reason and "GiB" in reason


def _tensors(shape=(2, 17, 3, 64), dtype=torch.bfloat16):
    return [torch.randn(shape).to(dtype) for _ in range(4)]


def test_check_tensors_messages():
    p = Problem(2, 3, 17, 64)
    q, k, v, o = _tensors()
    with pytest.raises(ValueError, match="dtype"):
        check_tensors(p, q.float(), k, v, o)
    with pytest.raises(ValueError, match="shape"):
        check_tensors(p, q, k[:, :16], v, o)
    with pytest.raises(ValueError, match="4-D"):
        check_tensors(p, q, k, v, o.reshape(2, 17, 192))
    with pytest.raises(ValueError, match="CUDA"):
        check_tensors(p, q, k, v, o)
    with pytest.raises(ValueError, match="torch.Tensor"):
        check_tensors(p, q, k, v, None)


def test_run_checks_before_launching():
    # a handle whose compiled function must never be reached
    spec = KernelSpec("fake", "", (64,))
    handle = CompiledAttention(spec, Problem(2, 3, 17, 64), {}, compiled=None,
                               compile_seconds=0.0, kernel=None)
    q, k, v, o = _tensors()
    with pytest.raises(ValueError, match="CUDA"):
        run_attention(handle, q, k, v, o)
    q2 = torch.randn(2, 18, 3, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="shape"):
        run_attention(handle, q2, k, v, o)


def test_run_attention_passes_workspace_then_the_streams_work_counter(monkeypatch):
    """k5/k6 take (q, k, v, out, lse, counter, scale_log2): the caller's workspace (or the
    handle's own), then the current stream's work counter, looked up per call; `checked`
    skips the tensor checks (attention()'s cache of checked layouts)."""
    from hopper_attn.common import contract
    from hopper_attn.harness import registry
    calls = []
    spec = registry.get("k6").spec
    assert spec.takes_work_counter
    problem = Problem(1, 2, 16, 64)
    handle = contract.CompiledAttention(spec, problem, {}, lambda *a: calls.append(a), 0.0,
                                        None, workspace_fn=None, tvm_ffi=True)
    monkeypatch.setattr(contract, "_cute", lambda: None)
    q = torch.zeros(problem.shape, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 16)
    contract.run_attention(handle, q, q, q, q, workspace=[lse], checked=True)
    args = calls[-1]
    assert args[4] is lse and args[5] is contract.work_counter(q.device)
    assert args[5].dtype == torch.int32 and args[5].tolist() == [0, 0]
    assert args[6] == pytest.approx(contract.LOG2_E / 8.0)       # 1/sqrt(64) * log2(e)
    with pytest.raises(ValueError, match="CUDA"):                  # unchecked: CPU tensors fail
        contract.run_attention(handle, q, q, q, q, workspace=[lse])


def test_problem_from_tensor_refuses_an_empty_k():
    """An empty k (no keys or no heads) is an error, not Problem's 0 = "as q"."""
    q = torch.empty(2, 17, 4, 64, dtype=torch.bfloat16)
    for shape in ((2, 0, 4, 64), (2, 17, 0, 64)):
        with pytest.raises(ValueError, match="at least one key"):
            Problem.from_tensor(q, k=torch.empty(shape, dtype=torch.bfloat16))


def test_a_callers_lse_replaces_only_the_first_workspace_tensor():
    """run_attention(..., lse=): a stage whose workspace is its LSE alone gets [lse]; one that
    keeps more (decode: partials, counters, allocated once per handle) gets [lse, *the rest]."""
    import dataclasses
    import types
    from hopper_attn.common.contract import KernelSpec, run_attention
    q = torch.zeros(1, 2, 2, 64)
    lse = torch.zeros(1, 2, 2)
    for keeps, expect in ((False, 1), (True, 3)):
        spec = KernelSpec("x", "x", (64,), keeps_workspace=keeps)
        made = []
        calls = []

        def workspace_fn(problem, device, made=made):
            made.append(1)
            return [torch.ones(1), torch.ones(2), torch.ones(3)]

        handle = types.SimpleNamespace(problem=Problem(1, 2, 2, 64), spec=spec, tvm_ffi=True,
                                       workspace_fn=workspace_fn, workspace=None,
                                       compiled=lambda *args, calls=calls: calls.append(args))
        for _ in range(2):
            run_attention(handle, q, q, q, q, checked=True, lse=lse)
        workspace = calls[-1][4:-1]
        assert len(workspace) == expect and workspace[0] is lse
        assert len(made) == (1 if keeps else 0)           # allocated once, or never
        assert dataclasses.is_dataclass(spec)
