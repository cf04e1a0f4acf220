"""Every kernel compiles for sm_90a on this (GPU-less) machine, without register spills, and
its PTX/SASS shows what its stage is about. ptxas runs with --warn-on-spills
--warning-as-error, so a spill fails the compile."""

import pytest

from hopper_attn.harness import registry
from hopper_attn.harness.compile_report import resource_usage, sass
from ptx import WGMMA, WGMMA_REG_A, compiled, count

pytestmark = pytest.mark.compile

CONFIGS = [(64, False), (128, True)]   # both head dims, both mask modes, 2 compiles per kernel


def artifacts(name, d, causal):
    return compiled(name, d, causal)


@pytest.mark.parametrize("d,causal", CONFIGS)
@pytest.mark.parametrize("name", list(registry.KERNELS))
def test_compiles_without_spills(name, d, causal):
    art = artifacts(name, d, causal)
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
        assert fn["registers"] <= 255


@pytest.mark.parametrize("d,causal", CONFIGS)
def test_k1_is_three_plain_kernels(d, causal):
    ptx = artifacts("k1", d, causal)["ptx"]
    assert count(ptx, r"\.entry ") == 3
    assert count(ptx, r"wgmma|cp\.async\.bulk|ld\.shared|st\.shared") == 0


@pytest.mark.parametrize("d,causal", CONFIGS)
def test_k2_is_fused_on_cuda_cores(d, causal):
    ptx = artifacts("k2", d, causal)["ptx"]
    assert count(ptx, r"\.entry ") == 1
    assert count(ptx, r"wgmma|cp\.async\.bulk") == 0
    assert count(ptx, r"fma\.rn\.f32") > 100                   # the GEMMs are FMAs
    assert count(ptx, r"shfl\.sync\.bfly") >= 8                # row max/sum across a half-warp
    assert count(ptx, r"ld\.shared\.v4") > 0                   # 16-byte shared-memory reads
    assert count(ptx, r"ld\.global\.v4") > 0                   # 16-byte thread-strided loads


@pytest.mark.parametrize("name", ["k3_1", "k3_2", "k3_3"])
@pytest.mark.parametrize("d,causal", CONFIGS)
def test_k3_loads_with_tma_and_waits_on_mbarriers(name, d, causal):
    ptx = artifacts(name, d, causal)["ptx"]
    assert count(ptx, r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global") > 0
    assert count(ptx, r"mbarrier\.try_wait") > 0
    assert count(ptx, r"ld\.global") == 0                      # nothing loaded by threads
    assert count(ptx, r"wgmma") == 0
    assert count(ptx, r"bar\.sync") <= 2                       # only barrier init: no CTA barrier in the loop


def test_k3_3_uses_the_deepest_ring_that_fits():
    assert artifacts("k3_3", 64, False)["kernel"]["stages"] == 5
    art = artifacts("k3_3", 128, True)
    assert 2 < art["kernel"]["stages"] <= 5
    assert art["kernel"]["smem_bytes"] <= 227 * 1024 - 1024




@pytest.mark.parametrize("d,causal", CONFIGS)
def test_k4_qk_runs_qk_on_wgmma_from_smem(d, causal):
    art = artifacts("k4_qk", d, causal)
    assert count(art["ptx"], WGMMA) == d // 16                 # one per k16 slice of head_dim
    assert count(art["ptx"], WGMMA_REG_A) == 0                 # both operands from SMEM
    assert "HGMMA" in sass(art["cubin"])


@pytest.mark.parametrize("d,causal", CONFIGS)
def test_k4_feeds_p_from_registers(d, causal):
    art = artifacts("k4", d, causal)
    ptx = art["ptx"]
    block_n = art["kernel"]["block_n"]
    assert count(ptx, WGMMA) == d // 16 + block_n // 16        # QK slices + PV slices
    assert count(ptx, WGMMA_REG_A) == block_n // 16            # every PV slice takes A (P) from registers
    assert count(ptx, r"ld\.shared") == 0                      # no thread reads SMEM: P never goes through it
    assert count(ptx, r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta") > 0   # TMA store of O
    assert "HGMMA" in sass(art["cubin"])
