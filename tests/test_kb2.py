"""kb2 compiles for sm_90a without spills and its PTX shows what it adds to kb1: the
register split between a producer and two consumer warpgroups, TMA loads of the LSE and D
rows next to Q and dO, dQ leaving through SMEM by bulk reduce-add (no per-element atomics),
and the named barriers that hand the dQ staging buffers between consumers and the writer."""

import re
import tempfile

import pytest
import torch

from hopper_attn.harness.compile_report import resource_usage
from ptx import TMA_LOAD, TMA_STORE, compiled, count

pytestmark = pytest.mark.compile

CONFIGS = [(64, False), (64, True), (128, False), (128, True)]


@pytest.mark.parametrize("d,causal", CONFIGS)
def test_no_spills(d, causal):
    for fn in resource_usage(compiled("kb2", d, causal)["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


@pytest.mark.parametrize("d,causal", CONFIGS)
def test_ptx_shows_the_stage(d, causal):
    art = compiled("kb2", d, causal)
    ptx, kernel = art["ptx"], art["kernel"]
    assert kernel["threads"] == 384 and kernel["smem_bytes"] <= 227 * 1024
    assert count(ptx, r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;") == 1
    assert count(ptx, r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;") == 1
    # dQ: one bulk reduce-add per consumer warpgroup and query tile, no element atomics
    assert count(ptx, r"cp\.reduce\.async\.bulk\.global\.shared::cta\.bulk_group\.add\.f32") == 2
    assert count(ptx, r"\sred\.\S*add\.f32|\satom\.\S*add\.f32") == 0
    # TMA: K, V once; Q, dO (one instruction per 64 columns) and their LSE / D rows per tile
    assert count(ptx, TMA_LOAD) == 4 * (d // 64) + 2
    assert count(ptx, TMA_STORE) == 2 * (d // 64)
    # named barriers: dS^T written (256 consumer threads); dQ full / empty handoffs between a
    # consumer warpgroup (128) and the writer warp (32)
    assert count(ptx, r"bar\.sync\s+1,\s*256;") == 1
    assert count(ptx, r"bar\.(sync|arrive)\s+\S+,\s*160;") == 6
    # the five GEMMs as in kb1: two SMEM x SMEM, two with A from registers (one WGMMA per
    # 16 query rows of the tile), dQ transposed
    assert count(ptx, r"wgmma\.mma_async\S*\s*\{[^}]*\},\s*\{") == 2 * (kernel["block_m"] // 16)


def test_fp16_compiles_to_f16_wgmmas():
    art = compiled("kb2", 128, False, torch.float16)
    assert re.search(r"wgmma\.mma_async\S*\.f32\.f16\.f16", art["ptx"])
    assert not re.search(r"\.bf16", art["ptx"])
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


def test_deterministic_mode_orders_the_dq_adds():
    """One turn counter per query tile: the writer waits (acquire) until the kv tiles before
    its own have added, waits for its bulk adds to complete, then passes the turn (release)."""
    ptx = compiled("kb2:deterministic=1", 128, True)["ptx"]
    assert count(ptx, r"atom\.global\.acquire(\.gpu)?\.add") >= 1
    assert count(ptx, r"atom\.global\.release(\.gpu)?\.add") == 1
    assert count(ptx, r"cp\.async\.bulk\.wait_group\s+0;") >= 1        # not just .read
    assert count(compiled("kb2:convert_per_head=0", 128, True)["ptx"], r"atom\.global") == 0


def test_ds_is_stored_with_stmatrix():
    """dS^T goes to SMEM with stmatrix.x4 (per thread and tile: four for 64 query rows, d =
    128 with a mask; five for 80, without one); the kb2:stmatrix=0 variant keeps one 4-byte
    st.shared per register pair."""
    assert count(compiled("kb2", 128, True)["ptx"], r"stmatrix\.sync\.aligned") == 4
    assert count(compiled("kb2", 128, False)["ptx"], r"stmatrix\.sync\.aligned") == 5
    assert count(compiled("kb2:stmatrix=0", 128, False)["ptx"], r"stmatrix") == 0
    for fn in resource_usage(compiled("kb2:stmatrix=0", 64, True)["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


def _consumer_loop(ptx: str) -> str:
    """From the first WGMMA commit (S^T) to the dS^T barrier shared by both warpgroups."""
    start = ptx.index("wgmma.commit_group.sync.aligned")
    return ptx[start:re.search(r"bar\.sync\s+1,\s*256;", ptx).start()]


@pytest.mark.parametrize("d", [64, 128])
def test_lse_read_while_the_gemms_run(d):
    """The LSE values of a thread's S^T columns are read from SMEM between issuing S^T and
    waiting for it (read after the wait, their latency stalled the exp2 loop)."""
    loop = _consumer_loop(compiled("kb2", d, False)["ptx"])
    first_wait = loop.index("wgmma.wait_group")
    assert count(loop[:first_wait], r"ld\.shared") >= 4


@pytest.mark.parametrize("d,causal,early", [(128, True, True), (64, True, True),
                                             (128, False, False), (64, False, False)])
def test_dv_issued_before_waiting_for_dpt_with_a_mask(d, causal, early):
    """With a mask, dV += P^T dO is issued (in part, below) before the wait for dP^T (no
    wait_group 0 before dS^T is shared); without one, where that order measured slower at
    d = 64 and does not fit d = 128's 80-row tiles, after it."""
    loop = _consumer_loop(compiled("kb2", d, causal)["ptx"])
    assert count(loop, r"wgmma\.wait_group\.sync\.aligned\s+0;") == (0 if early else 1)


@pytest.mark.parametrize("name,d,causal,split", [("kb2", 128, True, True),
                                                 ("kb2", 64, True, True),
                                                 ("kb2:split_dv=0", 128, True, False)])
def test_dv_split_around_the_ds_stores(name, d, causal, split):
    """split_dv (default with a mask): dV's first K block is committed before dP^T is
    waited for, the rest after the last dS^T store and before the fence that publishes them
    (four WGMMA batches up to the dS^T barrier: S^T, dP^T, two of dV); unsplit, dV is one
    batch before the stores."""
    loop = _consumer_loop(compiled(name, d, causal)["ptx"])
    commits = [m.start() for m in re.finditer(r"wgmma\.commit_group", loop)]
    last_store = max(m.start() for m in re.finditer(r"stmatrix|st\.shared", loop))
    fence = loop.rindex("fence.proxy.async")
    assert len(commits) == (4 if split else 3)
    assert (last_store < commits[-1] < fence) == split


@pytest.mark.parametrize("d,causal", CONFIGS)
def test_prologue_at_d128(d, causal):
    """At d = 128, FA4's prologue: K and V ride on the first Q and dO stages' barriers (one
    extra expect_tx each, no K/V barrier of their own), and the main kernel is a programmatic
    dependent launch: the producer waits (griddepcontrol.wait) before its first LSE/D load,
    the dQ writer before its first reduce-add, and the dQ conversion may launch at once.
    At d = 64, where it measured 0.4% slower, none of it; except the early launch with a
    mask, for the conversion that waits per head."""
    ptx = compiled("kb2", d, causal)["ptx"]
    on, pdl = d == 128, d == 128 or causal
    assert count(ptx, r"mbarrier\.expect_tx") == (2 if on else 0)
    assert count(ptx, r"mbarrier\.arrive\.expect_tx") == (2 if on else 3)
    assert count(ptx, r"griddepcontrol\.wait") == (2 if pdl else 0)
    assert count(ptx, r"griddepcontrol\.launch_dependents") == (1 if pdl else 0)


@pytest.mark.parametrize("d,causal,block_m,options", [
    (64, False, 128, {"dp_first": True, "stmatrix": True}),
    (64, True, 128, {"dp_first": False, "stmatrix": False, "early_dv": True, "split_dv": 1,
                     "pdl": True, "convert_per_head": True}),
    (128, False, 80, {"dp_first": False, "stmatrix": True, "ds_address_per_tile": True,
                      "kv_with_first_tile": True, "pdl": True, "convert_per_head": True}),
    (128, True, 64, {"dp_first": False, "stmatrix": True, "ds_address_per_tile": False,
                     "kv_with_first_tile": True, "pdl": True, "split_dv": 1,
                     "longest_first": True, "group_mib": 32, "convert_per_head": True})])
def test_tiles_per_head_dim(d, causal, block_m, options):
    """kb2.TILES: FlashAttention-3's 128-row query tiles at d = 64 (the variants without
    spills that measured fastest); at d = 128 80 rows without a mask, 64 with one."""
    art = compiled("kb2", d, causal)
    assert art["kernel"]["block_m"] == block_m
    for name, value in options.items():
        assert art["kernel"]["options"][name] == value


@pytest.mark.parametrize("name,d,causal,on", [
    ("kb2", 128, True, True), ("kb2", 128, False, True), ("kb2:pdl=0", 128, True, False),
    ("kb2", 64, True, True), ("kb2", 64, False, False)])
def test_each_cta_counts_its_head_for_the_dq_conversion(name, d, causal, on):
    """convert_per_head (d = 128, and d = 64 with a mask; needs pdl): the dQ writer waits
    until its bulk reduce-adds
    have landed (wait_group without .read) and counts the CTA in its head's counter with one
    release atomic; without it, it only waits until the adds have read their SMEM."""
    art = compiled(name, d, causal)
    ptx = art["ptx"]
    assert art["kernel"]["options"]["convert_per_head"] == on
    assert count(ptx, r"atom\.global\.release\.add") == (1 if on else 0)
    assert count(ptx, r"cp\.async\.bulk\.wait_group\s") == (1 if on else 0)


def test_dq_conversion_waits_per_head():
    """The per-head dQ conversion (common/backward.DqConvertFragments with per_head): one
    thread polls its head's counter with acquire loads in a loop instead of waiting for the
    whole main grid at its start; griddepcontrol.wait comes last, so it never completes
    before the main kernel."""
    from hopper_attn.common import cute_runtime as rt
    from hopper_attn.common.backward import DqConvertFragments
    acc = torch.empty(2, 3, 256, 128, dtype=torch.float32)
    dq = torch.empty(2, 256, 3, 128, dtype=torch.bfloat16)
    counters = torch.empty(2, 3, 4, dtype=torch.int32)
    with tempfile.TemporaryDirectory() as dump:
        fn = rt.compile_with_tensors(DqConvertFragments(128, 64, False, True, True), acc, dq,
                                     counters, scalars=(1.0, 1.0),
                                     options=f"--keep-ptx --dump-dir={dump}")
        ptx = fn.__ptx__
    polls = [m.start() for m in re.finditer(r"atom\.global\.acquire\.add", ptx)]
    assert len(polls) >= 1
    wait = ptx.index("griddepcontrol.wait")
    assert count(ptx, r"griddepcontrol\.wait") == 1 and wait > max(polls)
    assert wait > ptx.rindex("st.global")


@pytest.mark.parametrize("name,d,causal,longest_first", [
    ("kb2", 128, True, True), ("kb2", 128, False, False), ("kb2", 64, True, False),
    ("kb2:deterministic=1", 64, True, True), ("kb2:deterministic=1", 64, False, False)])
def test_longest_first_grid(name, d, causal, longest_first):
    """At d = 128 with a mask, and in the deterministic mode with one, the grid is 1-D and
    each CTA derives its (kv tile, head, batch) from its index (masking.KVTileSchedule:
    L2-sized head groups, kv tile 0 of every head of a group first); elsewhere the grid is
    (kv tiles, heads, batch)."""
    ptx = compiled(name, d, causal)["ptx"]
    assert (count(ptx, r"%ctaid\.[yz]") == 0) == longest_first
    group_rows = (32 << 20) // (d * 8)            # query rows of Q, dO and dQ in 32 MiB
    by_rows = longest_first and "deterministic" not in name    # (that mode: fixed heads)
    assert count(ptx, rf"div\.s32\s+%r\d+,\s*{group_rows},") == (1 if by_rows else 0)


def test_80_row_tiles_compute_dq_transposed():
    """80-row query tiles (kb2's and FA4's at d = 128 without a mask): dQ^T = K^T dS^T as
    64 x 80 WGMMAs with both operands from SMEM; without spills with dS^T's stmatrix
    addresses computed per tile (ds_address_per_tile), 4 bytes spilled without that."""
    art = compiled("kb2", 128, False)
    assert art["kernel"]["block_m"] == 80
    assert art["kernel"]["dq_swap_ab"]
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    smem_smem_n80 = r"wgmma\.mma_async\.sync\.aligned\.m64n80k16\S*\s+\{[^}]*\},\s*%rd"
    assert count(art["ptx"], smem_smem_n80) == 3 * (128 // 16)          # S^T, dP^T, dQ^T
