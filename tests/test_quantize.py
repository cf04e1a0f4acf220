"""The GPU quantizer (hopper_attn/common/fp8_quantize.py, `quantize_fp8(fused=True)`)
compiles for sm_90a without spills, and its PTX is what the module says: 16-byte loads,
e4m3x2 conversions with saturation, one atomic max per warp, and for packed V 16-byte stores
(one per column of d and 16 keys). Running it (same bytes as the torch path) is a GPU test
(tests/test_gpu.py::test_fused_quantizer_matches_torch)."""

import tempfile

import pytest
import torch

from hopper_attn import quantize
from hopper_attn.harness.compile_report import SPILLS_AS_ERRORS, resource_usage
from ptx import count

pytestmark = pytest.mark.compile


def artifacts(kind, d, packed, dtype=torch.bfloat16, rotate=False):
    with tempfile.TemporaryDirectory() as dump:
        compiled = quantize._fused_kernel(
            kind, d, packed, rotate, dtype, torch.device("cpu"),
            compile_options=f"--keep-ptx --keep-cubin --dump-dir={dump} {SPILLS_AS_ERRORS}")
        compiled, _ = compiled
        return compiled.__ptx__.rstrip("\0"), bytes(compiled.__cubin__)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_amax_kernel(d):
    ptx, cubin = artifacts("amax", d, False)
    for fn in resource_usage(cubin):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    assert count(ptx, r"ld\.global\.v4\.b32") == 16          # 16 keys x 16 bytes per thread
    assert count(ptx, r"atom\.global\.max") == 1


@pytest.mark.parametrize("d,packed,dtype", [(64, True, torch.bfloat16),
                                            (128, True, torch.bfloat16),
                                            (128, False, torch.bfloat16),
                                            (256, True, torch.float16),
                                            (128, False, torch.float32)])
def test_cast_kernel(d, packed, dtype):
    ptx, cubin = artifacts("cast", d, packed, dtype)
    for fn in resource_usage(cubin):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    loads = 16 * (2 if dtype == torch.float32 else 1)          # 16 keys x 8 values
    assert count(ptx, r"ld\.global\.v4\.b32") == loads
    assert count(ptx, r"cvt\.rn\.satfinite\.e4m3x2\.f32") == 16 * 8 // 2
    if packed:
        assert count(ptx, r"st\.global\.v4\.b32") == 8           # 8 columns x 16 keys
    else:
        assert count(ptx, r"st\.global\.v4\.b16") == 16          # 16 keys x 8 bytes


def test_fused_refuses_what_it_cannot_do():
    x = torch.zeros(1, 4, 1, 128, dtype=torch.bfloat16)
    assert "CUDA" in quantize.fused_unsupported(x)
    with pytest.raises(ValueError, match="fused=True"):
        quantize.quantize_fp8(x, fused=True)


@pytest.mark.parametrize("kind,d,packed", [("amax", 64, False), ("cast", 128, False),
                                           ("cast", 256, True)])
def test_rotation_in_the_kernels(kind, d, packed):
    """With k8's rotation: per key, 8 values x log2(d / 8) butterfly shuffles between lanes
    (the rest of the fast Walsh-Hadamard transform stays in the thread); no spills."""
    ptx, cubin = artifacts(kind, d, packed, rotate=True)
    for fn in resource_usage(cubin):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    stages = (d // 8).bit_length() - 1
    assert count(ptx, r"shfl\.sync\.bfly") == 16 * 8 * stages + (5 if kind == "amax" else 0)


def fwht_as_the_kernel_does(x, signs):
    """The kernels' rotation, emulated for one (..., d) tensor: signs, H_8 inside each group
    of 8 columns, then H_{d/8} across the groups (the lanes), then 1 / sqrt(d)."""
    d = x.shape[-1]
    v = (x * signs).reshape(*x.shape[:-1], d // 8, 8).clone()
    h = 1
    while h < 8:
        for i in range(8):
            if i & h == 0:
                a, b = v[..., i].clone(), v[..., i + h].clone()
                v[..., i], v[..., i + h] = a + b, a - b
        h *= 2
    m = 1
    while m < d // 8:
        lanes = torch.arange(d // 8)
        other = v[..., lanes ^ m, :]
        upper = ((lanes // m) % 2 == 1)[:, None]
        v = torch.where(upper, other - v, other + v)
        m *= 2
    return v.reshape(x.shape) * d ** -0.5


@pytest.mark.parametrize("d", [64, 128, 256])
def test_kernel_rotation_order_is_x_times_r(d):
    from hopper_attn import k8
    x = torch.randn(5, d, dtype=torch.float64)
    s = k8.signs(d, seed=3).double()
    want = x @ quantize.rotation_matrix(s).double()
    assert torch.allclose(fwht_as_the_kernel_does(x, s), want, atol=1e-12)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("magnitude", [0.01, 1.0, 30.0])
def test_f16_scores_fit_and_factor_is_a_power_of_two(d, magnitude):
    """quantize_qk_f16_scores (k7's `s_f16`): every score q8 . k8, and every partial sum of
    one (by Cauchy-Schwarz, at most the product of the row norms), fits fp16 with room to
    spare; the factor the kernel multiplies fp16 scores by, softmax_scale log2(e) dq dk, is
    a power of two in fp16's normal range; the descales give q and k back (GQA: k's descale
    is shared by the query heads of its group), and e4m3's range is respected."""
    import math
    gen = torch.Generator().manual_seed(d)
    q = torch.randn(2, 200, 4, d, generator=gen) * magnitude
    k = torch.randn(2, 300, 2, d, generator=gen) * magnitude
    q[:, :, 1, :3] *= 50.0                               # outlier channels in one head
    k[0, 7] *= 20.0                                      # one loud key
    scale = 1.0 / math.sqrt(d)
    q8, k8, dq, dk = quantize.quantize_qk_f16_scores(q.to(torch.bfloat16),
                                                     k.to(torch.bfloat16), scale)
    assert q8.dtype == k8.dtype == torch.float8_e4m3fn
    assert dq.shape == (2, 4) and dk.shape == (2, 2)
    norms_q = q8.float().norm(dim=3).amax(dim=1)
    norms_k = k8.float().norm(dim=3).amax(dim=1).repeat_interleave(2, dim=1)
    assert (norms_q * norms_k).max() <= 2.0 ** 15
    factor = scale * math.log2(math.e) * dq * dk.repeat_interleave(2, dim=1)
    exponent = torch.log2(factor)
    assert torch.allclose(exponent, exponent.round(), atol=1e-5)
    assert (factor >= 2.0 ** -14 * (1 - 1e-6)).all()
    for x, x8, descale in ((q, q8, dq), (k, k8, dk)):
        assert (x8.float().abs() <= quantize.E4M3_MAX).all()
        back = quantize.dequantize_fp8(x8, descale)
        amax = x.abs().amax(dim=(1, 3))[:, None, :, None]
        err = (back - x.to(torch.bfloat16).float()).abs() / amax
        assert err.max() <= 2.0 ** -4 * 8       # at most a few bits of e4m3 range given up


def test_f16_scores_with_rotation_keep_scores():
    """With k8's rotation the same constraints hold, and the dequantized scores are those of
    the unrotated inputs (R is orthogonal) up to e4m3's rounding."""
    import math
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 64, 2, 128, generator=gen), torch.randn(1, 64, 2, 128, generator=gen)
    signs = torch.randint(0, 2, (128,), generator=gen).float() * 2 - 1
    q8, k8, dq, dk = quantize.quantize_qk_f16_scores(q, k, 1 / math.sqrt(128),
                                                     rotate_signs=signs)
    s = torch.einsum("bnhd,bmhd->bhnm", quantize.dequantize_fp8(q8, dq),
                     quantize.dequantize_fp8(k8, dk))
    ref = torch.einsum("bnhd,bmhd->bhnm", q, k)
    assert (s - ref).abs().max() < 0.1 * ref.abs().max()
    assert (q8.float().norm(dim=3).amax() * k8.float().norm(dim=3).amax()) <= 2.0 ** 15


def test_check_f16_scores():
    """quantize.check_f16_scores accepts what quantize_qk_f16_scores makes and refuses q and
    k scaled to e4m3's full range (448 per head: scores far past fp16's range)."""
    import math
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 100, 4, 128, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 100, 2, 128, generator=gen).to(torch.bfloat16)
    scale = 1 / math.sqrt(128)
    quantize.check_f16_scores(*quantize.quantize_qk_f16_scores(q, k, scale), scale)
    q8, k8, dq, dk = quantize.quantize_fp8(q, k)
    with pytest.raises(ValueError, match="fp16"):
        quantize.check_f16_scores(q8, k8, dq, dk, scale)
    q8, k8, dq, dk = quantize.quantize_qk_f16_scores(q, k, scale)
    with pytest.raises(ValueError, match="power of two"):
        quantize.check_f16_scores(q8, k8, dq * 1.5, dk, scale)
