"""kb1 (the FA2 backward on WGMMA) compiles for sm_90a without spills, and its PTX shows the
stage: five WGMMA shapes per query tile (S^T and dP^T from SMEM, dV and dK with A from
registers, dQ from SMEM with both operands MN-major), dQ reduce-added in fp32, TMA for every
tile, one CTA barrier per query tile."""

import re

import pytest
import torch

from hopper_attn.harness.compile_report import resource_usage
from ptx import TMA_LOAD, TMA_STORE, compiled, count

pytestmark = pytest.mark.compile

CONFIGS = [(64, False), (64, True), (128, False), (128, True)]


@pytest.mark.parametrize("d,causal", CONFIGS)
def test_no_spills(d, causal):
    for fn in resource_usage(compiled("kb1", d, causal)["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


@pytest.mark.parametrize("d,causal", CONFIGS)
def test_ptx_shows_the_five_gemms(d, causal):
    art = compiled("kb1", d, causal)
    ptx, bm = art["ptx"], art["kernel"]["block_m"]
    shape = r"wgmma\.mma_async\.sync\.aligned\.m64n{}k16\.f32\.bf16\.bf16"
    smem_smem = r"\s*\{{[^}}]*\}},\s*%rd\d+,\s*%rd\d+,\s*p,\s*1,\s*1,\s*{},\s*{};"
    # S^T = K Q^T and dP^T = V dO^T: 64 keys x block_m queries, k16 slices over d, both
    # operands K-major in SMEM (no transpose flags)
    assert count(ptx, shape.format(bm) + smem_smem.format(0, 0)) == 2 * (d // 16)
    # dV += P^T dO and dK += dS^T Q: A (P^T, dS^T) from registers, k16 slices over the queries
    assert count(ptx, shape.format(d) + r"\s*\{[^}]*\},\s*\{") == 2 * (bm // 16)
    # dQ = dS K: each warpgroup half of d's columns, k16 slices over the 128 keys, both
    # operands read transposed (MN-major) from SMEM
    assert count(ptx, shape.format(d // 2) + smem_smem.format(1, 1)) == 128 // 16
    # dQ leaves as fp32 reduce-adds: block_m x d/2 per warpgroup, d/4 per thread
    assert count(ptx, r"red\.relaxed\.gpu(\.global)?\.add\.f32") == bm * (d // 2) // 128
    # TMA: K and V once, Q and dO in the prologue and in the loop's refill; dK and dV stores
    # (one instruction per 64 columns: the 128-byte swizzle's width)
    assert count(ptx, TMA_LOAD) == 6 * (d // 64) and count(ptx, TMA_STORE) == 2 * (d // 64)
    assert count(ptx, r"bar\.sync\s+0;") == 4    # mbarrier init, 1 per query tile, 2 in the epilogue


def test_fp16_compiles_to_f16_wgmmas():
    art = compiled("kb1", 128, True, torch.float16)
    assert re.search(r"wgmma\.mma_async\S*\.f32\.f16\.f16", art["ptx"])
    assert not re.search(r"\.bf16", art["ptx"])
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


def test_backward_contract_checks_tensors_before_launch():
    from hopper_attn import kb1
    from hopper_attn.common.backward import check_backward_tensors
    from hopper_attn.common.contract import Problem
    p = Problem(1, 2, 33, 64)
    q = torch.empty(p.shape, dtype=torch.bfloat16)
    lse = torch.empty(1, 2, 33)
    with pytest.raises(ValueError, match="CUDA"):
        check_backward_tensors(p, q, q, q, q, q, lse, q, q, q)
    with pytest.raises(ValueError, match="shape"):
        check_backward_tensors(p, q, q, q, q[:, :5], q, lse, q, q, q)   # o
    with pytest.raises(ValueError, match="head_dim"):
        kb1.compile_kernel(Problem(1, 1, 64, 96))


@pytest.mark.parametrize("d,rows", [(64, 128), (128, 64), (128, 80)])
def test_preprocess_issues_every_load_before_a_store(d, rows, tmp_path):
    """The shared preprocess (D, lse2, the zeroed dQ buffer and counters) loads all of a
    thread's O, dO and LSE values before its first store: a store placed before a load
    makes the load wait for it (the compiler cannot rule out aliasing), one memory
    latency per row pass."""
    from hopper_attn.common import cute_runtime as rt
    from hopper_attn.common.backward import BackwardPreprocess, _example
    b, n, h = 2, 128, 2
    od = [_example((b, n, h, d), torch.bfloat16) for _ in range(2)]
    lse = _example((b, h, n), torch.float32)
    stats = [_example((b, h, 2 * rows), torch.float32) for _ in range(2)]
    dq_accum = _example((b, h, 2 * rows, d), torch.float32)
    counters = _example((b, h, 2), torch.int32)
    compiled_pre = rt.compile_with_tensors(BackwardPreprocess(d, rows, pdl=True), *od, lse,
                                           *stats, dq_accum, counters,
                                           options=f"--keep-ptx --dump-dir={tmp_path}")
    ptx = compiled_pre.__ptx__
    body = ptx[ptx.index("griddepcontrol.launch_dependents"):]
    loads = [m.start() for m in re.finditer(r"ld\.global", body)]
    stores = [m.start() for m in re.finditer(r"st\.global", body)]
    passes = rows // (128 // (d // 8))
    assert len(loads) == 3 * passes                      # O and dO chunks, an LSE per row
    assert max(loads) < min(stores)


@pytest.mark.parametrize("causal", [False, True])
def test_d256_splits_the_columns_over_two_ctas(causal):
    """At d = 256 two CTAs share a kv tile, each with 128 of d's columns of dK, dV and dQ
    (their accumulators then fit 240 registers: no spills), one Q / dO stage (K and V take
    128 KiB); S^T and dP^T still contract over all 256 columns (16 k-steps each)."""
    art = compiled("kb1", 256, causal)
    kernel, ptx = art["kernel"], art["ptx"]
    assert kernel["d_parts"] == 2 and kernel["stages"] == 1
    assert kernel["smem_bytes"] <= 227 * 1024
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    # S^T and dP^T: 16 k-steps each over d, dQ's 64 of the part's columns per warpgroup:
    # 8 over the keys; dV and dK: 128 columns (the part), 4 k-steps over the queries
    assert count(ptx, r"wgmma\.mma_async\.sync\.aligned\.m64n64k16") == 2 * 256 // 16 + 8
    assert count(ptx, r"wgmma\.mma_async\.sync\.aligned\.m64n128k16") == 2 * 64 // 16
    assert count(ptx, r"wgmma\.mma_async\.sync\.aligned\.m64n256") == 0
