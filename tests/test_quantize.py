"""The GPU quantizer (hopper_attn/common/fp8_quantize.py, `quantize_fp8(fused=True)`)
compiles for sm_90a without spills, and its PTX is what the module says: 16-byte loads,
e4m3x2 conversions with saturation, one atomic max per warp, and for packed V 16-byte stores
(one per column of d and 16 keys). Running it (same bytes as the torch path) is a GPU test
(tests/test_gpu.py::test_fused_quantizer_matches_torch)."""

import re
import tempfile

import pytest
import torch

from hopper_attn import quantize
from hopper_attn.harness.compile_report import SPILLS_AS_ERRORS, resource_usage

pytestmark = pytest.mark.compile


def artifacts(kind, d, packed, dtype=torch.bfloat16):
    with tempfile.TemporaryDirectory() as dump:
        compiled = quantize._fused_kernel(
            kind, d, packed, dtype, torch.device("cpu"),
            compile_options=f"--keep-ptx --keep-cubin --dump-dir={dump} {SPILLS_AS_ERRORS}")
        return compiled.__ptx__.rstrip("\0"), bytes(compiled.__cubin__)


def count(ptx, pattern):
    return len(re.findall(pattern, ptx))


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
