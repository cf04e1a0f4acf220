"""k6 compiles for sm_90a without spills and its PTX/SASS shows the intra-warpgroup overlap:
inside the loop the QK WGMMA group is committed before the PV group, and the softmax waits
only for the first (`wgmma.wait_group 1`), the O rescale for both (`wait_group 0`)."""

import re

import pytest

from hopper_attn.harness.compile_report import resource_usage, sass
from ptx import WGMMA, WGMMA_REG_A, compiled

pytestmark = pytest.mark.compile


CONFIGS = [(64, False), (64, True), (128, False), (128, True)]


def artifacts(d, causal, name="k6"):
    return compiled(name, d, causal)


@pytest.mark.parametrize("d,causal", CONFIGS)
def test_no_spills(d, causal):
    for fn in resource_usage(artifacts(d, causal)["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


@pytest.mark.parametrize("d,causal", CONFIGS)
def test_softmax_waits_for_qk_only(d, causal):
    art = artifacts(d, causal)
    ptx = art["ptx"]
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx)
    assert "1" in waits                                       # S_j ready, PV_{j-1} in flight
    # after the turn's bar.sync, the QK WGMMA (A from SMEM) comes before the PV one (A in regs)
    loop = ptx[re.search(r"bar\.sync\s+%r\d+,\s*256;", ptx).end():]
    first_pv = re.search(WGMMA_REG_A, loop).start()
    first_any = re.search(WGMMA, loop).start()
    assert first_any < first_pv
    # ptxas did not serialize the WGMMAs: a DEPBAR that allows one group in flight. (It then
    # hoists the `0x0` wait above the softmax, which undoes most of the overlap: docs/k6.md.
    # When that is solved, assert here that a MUFU.EX2 comes between the two waits.)
    assert re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x1", sass(art["cubin"]))


def test_k5_waits_for_both():
    art = compiled("k5", 128, False)
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", art["ptx"])
    assert "1" not in waits


def test_d64_causal_uses_two_consumer_warpgroups():
    assert artifacts(64, True)["kernel"]["block_m"] == 128
    assert artifacts(64, False)["kernel"]["block_m"] == 192
