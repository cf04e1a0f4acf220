"""On the GPU: ref_check's randomized sweep for every kernel (odd N, causal, both d)."""

import pytest

from hopper_attn.harness import registry

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", list(registry.KERNELS))
def test_ref_check(name):
    from ref_check import check_kernel
    rows = check_kernel(registry.get(name), seed=1234)
    bad = [r for r in rows if not r.get("skipped") and not r.get("ok")]
    assert not bad, bad[:3]
