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
    (64, True, 128, {"dp_first": False, "stmatrix": True, "early_dv": True, "split_dv": 1,
                     "pdl": True, "convert_per_head": True, "stats_shuffle": True,
                     "ds_address_per_tile": True}),
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


# ---------------------------------------------------------------------------- GQA (issue 59)

@pytest.mark.parametrize("d,causal", CONFIGS)
def test_gqa_variant_compiles_without_spills(d, causal):
    """With fewer k/v heads than q's, compile_kernel picks the gqa variant (one CTA per kv
    tile of a dK head walks its query heads); it keeps the MHA kernel's tiles and options
    (with a mask, kv tile 0 of every head first) and compiles without spills. (The compile
    problem, B = 2 with one kv tile, splits its group: dkv_fp32=0 keeps the bf16 TMA stores.)"""
    art = compiled("kb2:dkv_fp32=0", d, causal, heads_kv=1)
    mha = compiled("kb2", d, causal)
    options = art["kernel"]["options"]
    assert options["gqa"] and not mha["kernel"]["options"]["gqa"]
    # with a mask the longest CTAs first: the 1-D grid (d = 128) or heads first (d = 64)
    assert (options["longest_first"] or options["heads_first"]) == causal
    for name in ("block_m", "stmatrix", "dp_first", "split_dv", "pdl", "convert_per_head"):
        assert options[name] == mha["kernel"]["options"][name], name
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    # the walk over (query head, query tile) pairs is a loop, not unrolled: as many TMA loads,
    # bulk reduce-adds and dK / dV stores as the MHA kernel
    for pattern in (TMA_LOAD, TMA_STORE, r"cp\.reduce\.async\.bulk"):
        assert count(art["ptx"], pattern) == count(mha["ptx"], pattern), pattern


@pytest.mark.parametrize("d,causal,stores", [(64, True, 32), (128, False, 64), (256, True, 0)])
def test_split_group_stores_fp32_parts(d, causal, stores):
    """Where the group is split in parts (the compile problem: 2 CTAs), dK and dV leave in
    fp32 from the registers (`dkv_fp32`: 8-byte stores; d = 256's dK^T / dV^T 4-byte), no
    TMA store, no spills: run_backward sums the parts and rounds once."""
    art = compiled("kb2", d, causal, heads_kv=1)
    assert art["kernel"]["options"]["dkv_fp32"]
    assert count(art["ptx"], TMA_STORE) == 0
    assert count(art["ptx"], r"st\.global\.v2\.b32") == stores
    if not stores:
        assert count(art["ptx"], r"st\.global\.b32") == 96     # 2 x 48 floats a thread
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


def test_run_backward_sums_fp32_parts_once(monkeypatch):
    """dkv_fp32: the parts' scratch is fp32 with rows padded to whole kv tiles, and their sum
    is rounded once (torch's sum into a bf16 `out` would round the parts first)."""
    from hopper_attn.common import backward
    from hopper_attn.common.backward import run_backward, sum_fp32_parts
    monkeypatch.setattr(backward, "check_backward_tensors", lambda *a: None)   # CPU tensors
    from hopper_attn.common.contract import Problem
    from hopper_attn.kb2 import FlashAttentionBackwardKB2
    problem = Problem(1, 8, 1000, 64, True, heads_kv=1)
    kernel = FlashAttentionBackwardKB2(64, True, block_m=128, heads_first=True, gqa=True,
                                       dkv_fp32=True)
    handle = _fake_handle(kernel, problem)
    tensors = _backward_tensors(problem)
    run_backward(handle, *tensors)
    (args,) = handle.main.calls
    parts = kernel.dkv_heads(problem)
    assert parts > 1 and args[7].dtype == torch.float32
    assert tuple(args[7].shape) == (1, 1024, parts, 64)
    torch.manual_seed(0)
    partials = torch.randn(1, 1024, 4, 64) * 3
    dk, dv = (torch.empty(1, 1000, 1, 64, dtype=torch.bfloat16) for _ in range(2))
    sum_fp32_parts(partials, partials, dk, dv, 1000, 4)
    want = partials[:, :1000].sum(2, keepdim=True).to(torch.bfloat16)
    assert torch.equal(dk, want) and torch.equal(dv, want)
    assert not torch.equal(want, partials[:, :1000].to(torch.bfloat16).float().sum(
        2, keepdim=True).to(torch.bfloat16))                # (two roundings differ)


@pytest.mark.parametrize("d,causal", [(128, True), (64, True), (128, False)])
def test_gqa_counts_every_query_head_of_the_group(d, causal):
    """convert_per_head with gqa: the CTA counts itself once in each of the query heads it
    walked (one release atomic in a loop), since each of their dQ received its adds."""
    art = compiled("kb2", d, causal, heads_kv=1)
    assert art["kernel"]["options"]["convert_per_head"]
    assert count(art["ptx"], r"atom\.global\.release\.add") == 1


def test_gqa_deterministic_mode_compiles():
    """The deterministic mode's turns still per (query head, query tile): the writer waits
    for the kv tiles before its own and passes the turn, in the gqa variant too."""
    art = compiled("kb2:deterministic=1", 128, True, heads_kv=1)
    assert art["kernel"]["options"]["gqa"] and art["kernel"]["options"]["group_heads"] == 16
    assert count(art["ptx"], r"atom\.global\.acquire(\.gpu)?\.add") >= 1
    assert count(art["ptx"], r"atom\.global\.release(\.gpu)?\.add") == 1
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


@pytest.mark.parametrize("name,d,causal,dtype", [
    ("kb2:deterministic=1", 64, True, torch.bfloat16),
    ("kb2:deterministic=1", 128, False, torch.bfloat16),
    ("kb2:longest_first=0,heads_first=1", 128, True, torch.bfloat16),
    ("kb2:heads_first=0", 64, True, torch.bfloat16),
    ("kb2", 128, True, torch.float16),
    ("kb2", 64, False, torch.float16),
])
def test_gqa_variants_compile_without_spills(name, d, causal, dtype):
    """The gqa variant under the other options the GPU check times or the API reaches."""
    art = compiled(name, d, causal, dtype, heads_kv=1)
    assert art["kernel"]["options"]["gqa"]
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


@pytest.mark.parametrize("longest_first,heads_first,group_heads", [
    (False, False, 0), (False, True, 0), (True, False, 0), (True, False, 16)])
@pytest.mark.parametrize("heads,batch,seqlen,walk", [(4, 1, 8192, 4), (9, 3, 2100, 8),
                                                     (2, 2, 1000, 1), (13, 1, 4096, 2)])
def test_host_order_visits_every_cta_once(longest_first, heads_first, group_heads, heads,
                                          batch, seqlen, walk):
    """masking.KVTileSchedule.host_order (what dkv_parts' model launches): every (kv tile,
    head) once, and each head's kv tile n - 1 before its tile n (longest first)."""
    from hopper_attn.common.masking import KVTileSchedule
    schedule = KVTileSchedule(64, 128, True, 32768 if longest_first else 0, group_heads,
                              heads_first=heads_first)
    order = schedule.host_order(seqlen, seqlen, heads, batch, walk)
    kv_tiles = -(-seqlen // 128)
    assert sorted(order) == [(n, hb) for n in range(kv_tiles) for hb in range(heads * batch)]
    seen = {}
    for n, hb in order:
        assert seen.get(hb, -1) == n - 1
        seen[hb] = n


class _Recorder:
    """A stand-in compiled kernel: records the tensors it is called with."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def _fake_handle(kernel, problem):
    from hopper_attn.common.backward import CompiledBackward
    from hopper_attn.kb2 import SPEC
    return CompiledBackward(SPEC, problem, {}, kernel, _Recorder(), _Recorder(), _Recorder(),
                            0.0, tvm_ffi=True)


def _backward_tensors(problem):
    b, n, h, hkv, d = problem.batch, problem.seqlen, problem.heads, problem.kv_heads, 64
    q, o, do, dq = (torch.zeros(b, n, h, d, dtype=torch.bfloat16) for _ in range(4))
    k, v, dk, dv = (torch.zeros(b, n, hkv, d, dtype=torch.bfloat16) for _ in range(4))
    lse = torch.zeros(b, h, n)
    return q, k, v, o, do, lse, dq, dk, dv


@pytest.mark.parametrize("heads,heads_kv,seqlen,parts", [(16, 4, 8192, 1), (8, 1, 8192, 4),
                                                         (4, 4, 1000, 1)])
def test_run_backward_gqa_writes_dk_dv_in_place(heads, heads_kv, seqlen, parts, monkeypatch):
    """run_backward with the gqa variant: the main kernel writes dk and dv themselves (no
    per-query-head scratch, no torch sum) where whole groups give enough CTAs; with one
    k/v head at B = 1 (MQA), each group in `parts` parts, one scratch head per part."""
    from hopper_attn.common import backward
    from hopper_attn.common.backward import run_backward
    monkeypatch.setattr(backward, "check_backward_tensors", lambda *a: None)   # CPU tensors
    from hopper_attn.common.contract import Problem
    from hopper_attn.kb2 import FlashAttentionBackwardKB2
    problem = Problem(1, heads, seqlen, 64, True, heads_kv=heads_kv)
    kernel = FlashAttentionBackwardKB2(64, True, block_m=128, longest_first=True, gqa=True)
    handle = _fake_handle(kernel, problem)
    tensors = _backward_tensors(problem)
    run_backward(handle, *tensors)
    (args,) = handle.main.calls
    dk_out, dv_out = args[7], args[8]
    if parts == 1:
        assert dk_out is tensors[7] and dv_out is tensors[8]
    else:
        assert tuple(dk_out.shape) == (1, seqlen, heads_kv * parts, 64)


def test_run_backward_without_gqa_sums_per_query_head(monkeypatch):
    """kb1 (and kb2:gqa=0): one dK / dV per query head in scratch, summed afterwards."""
    from hopper_attn.common import backward
    from hopper_attn.common.backward import run_backward
    monkeypatch.setattr(backward, "check_backward_tensors", lambda *a: None)   # CPU tensors
    from hopper_attn.common.contract import Problem
    from hopper_attn.kb2 import FlashAttentionBackwardKB2
    problem = Problem(1, 8, 256, 64, False, heads_kv=2)
    handle = _fake_handle(FlashAttentionBackwardKB2(64, False, block_m=128), problem)
    tensors = _backward_tensors(problem)
    run_backward(handle, *tensors)
    (args,) = handle.main.calls
    assert tuple(args[7].shape) == (1, 256, 8, 64)


@pytest.mark.parametrize("heads,heads_kv,batch,seqlen,d,causal,parts", [
    (16, 4, 1, 8192, 128, True, 1),       # the shape: 256 CTAs, longest first
    (32, 8, 1, 8192, 64, True, 1),
    (32, 8, 2, 4096, 128, False, 1),
    (16, 4, 1, 16384, 128, True, 1),
    (8, 1, 1, 8192, 128, True, 4),        # MQA: 64 CTAs of 8 heads each would end the grid
    (32, 1, 1, 4096, 128, True, 8),
])
def test_dkv_parts(heads, heads_kv, batch, seqlen, d, causal, parts):
    from hopper_attn import kb2
    from hopper_attn.common.contract import Problem
    handle_kernel = kb2.FlashAttentionBackwardKB2(
        d, causal, **{k: v for k, v in kb2.policy(Problem(batch, heads, seqlen, d, causal,
                                                         heads_kv=heads_kv)).items()
                     if k in ("block_m", "longest_first", "gqa", "heads_first")})
    problem = Problem(batch, heads, seqlen, d, causal, heads_kv=heads_kv)
    assert handle_kernel.dkv_heads(problem) == heads_kv * parts


def test_gqa_refusals():
    """What the gqa variant cannot take is refused before any compile: heads not a multiple
    of k/v's, a head dim kb2 has no tiles for."""
    from hopper_attn import kb2
    from hopper_attn.common.contract import Problem
    with pytest.raises(ValueError):
        Problem(1, 6, 128, 128, heads_kv=4)
    with pytest.raises(ValueError):
        kb2.compile_kernel(Problem(1, 8, 128, 160, heads_kv=2))


# ------------------------------------------------------------ head dims 96 and 192 (issue 63)

@pytest.mark.parametrize("d,causal", [(96, True), (192, False)])
def test_head_dims_96_and_192_compile_without_spills(d, causal):
    """d = 96: d = 128's consumer on 64-row tiles (dV and dK with A from registers); d = 192
    with a softcap: `shared_keys`, both consumer warpgroups on one 64-key tile, P^T and dS^T
    stored by stmatrix and read from SMEM by dV and dK (no register-A WGMMA). Both within
    227 KiB of SMEM (dynamic + static) and without spills, dQ out by one bulk add per
    warpgroup."""
    art = compiled("kb2:softcap=30.0" if d == 192 else "kb2", d, causal)
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
        assert art["kernel"]["smem_bytes"] + fn["static_smem"] <= 227 * 1024
    ptx, kernel = art["ptx"], art["kernel"]
    assert kernel["threads"] == 384 and kernel["block_m"] == 64
    assert kernel["block_n"] == (64 if d == 192 else 128)
    assert kernel["options"]["shared_keys"] == (d == 192)
    assert count(ptx, r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;") == 1
    assert count(ptx, r"cp\.reduce\.async\.bulk\.global\.shared::cta\.bulk_group\.add\.f32") == 2
    register_a = count(ptx, r"wgmma\.mma_async\S*\s*\{[^}]*\},\s*\{")
    assert register_a == (0 if d == 192 else 2 * 64 // 16)
    # stmatrix.x4 per thread and tile: dS^T's 64 x 64 (d = 96), or P^T's and dS^T's 64 x 32
    assert count(ptx, r"stmatrix\.sync\.aligned") == 4


def test_swizzle_atom_cols():
    """A narrower swizzle only where a warpgroup's MN-major columns split the row's atom."""
    from hopper_attn.common.backward import swizzle_atom_cols
    assert [swizzle_atom_cols(d, d // 2) for d in (64, 96, 128, 192, 256)] == \
        [None, 16, None, 32, None]
    assert swizzle_atom_cols(96, 96) is None and swizzle_atom_cols(192, 192) is None


def test_shared_keys_refusals():
    """shared_keys issues dV after the dS^T barrier: no early dV, dP^T first or 80-row
    tiles."""
    from hopper_attn import kb2
    from hopper_attn.common.contract import Problem
    for options in ({"early_dv": True}, {"dp_first": True}, {"block_m": 80}):
        with pytest.raises(ValueError, match="shared_keys|80-row"):
            kb2.compile_kernel(Problem(1, 2, 128, 192, False), dkv_swap_ab=False, **options)


@pytest.mark.parametrize("name,d,heads_kv,window", [("kb2:softcap=30.0", 192, 1, (-1, -1)),
                                                    ("kb2", 96, 0, (127, -1))])
def test_softcap_at_d192_and_window_at_d96_compile_without_spills(name, d, heads_kv, window):
    """The softcap's tanh and 1 - t^2 with shared_keys (GQA; dkv_swap_ab takes no softcap); a
    window's two limits at d = 96 on d = 128's causal row."""
    from hopper_attn.harness import registry
    from hopper_attn.harness.compile_report import compile_artifacts
    art = compile_artifacts(registry.get(name), d, True, heads_kv=heads_kv, window=window)
    assert art["ok"], art.get("error")
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


@pytest.mark.parametrize("causal,heads_kv,dv", [(True, 1, 192), (False, 0, 128)])
def test_dkv_swap_ab_compiles_without_spills(causal, heads_kv, dv):
    """kb2 at d = 192 (dkv_swap_ab, common/backward_dkv_swap.py): 64 x 96 tiles, dK^T and dV^T
    with the head dim as M, all five GEMMs from SMEM, P and dS by stmatrix (3 x4 each a
    thread), one bulk dQ add per warpgroup; within 227 KiB (dO's ring 1 deep at dv = 192),
    no spills."""
    from hopper_attn.harness import registry
    from hopper_attn.harness.compile_report import compile_artifacts
    art = compile_artifacts(registry.get("kb2"), 192, causal,
                            heads=4 if heads_kv else 2, heads_kv=heads_kv,
                            head_dim_v=0 if dv == 192 else dv)
    assert art["ok"], art.get("error")
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
        assert art["kernel"]["smem_bytes"] + fn["static_smem"] <= 227 * 1024
    ptx, kernel = art["ptx"], art["kernel"]
    assert kernel["block_n"] == 96 and kernel["options"]["dkv_swap_ab"] is True
    assert kernel["options"]["shared_keys"] is False
    # S, dP: 192 / 16 and dv / 16 k-steps; dV^T, dK^T: dv / 64 and 3 M blocks x 4; dQ: 6
    assert count(ptx, r"wgmma\.mma_async") == 12 + dv // 16 + 4 * dv // 64 + 12 + 6
    assert count(ptx, r"wgmma\.mma_async\S*\s*\{[^}]*\},\s*\{") == 0     # no register A
    assert count(ptx, r"stmatrix\.sync\.aligned") == 6
    assert count(ptx, r"cp\.reduce\.async\.bulk\.global\.shared::cta\.bulk_group\.add\.f32") == 2


@pytest.mark.parametrize("split_d", [False, True])
def test_dkv_swap_ab_d256_compiles_without_spills(split_d):
    """kb2 at d = 256 (dkv_swap_ab): 64 x 48 tiles, 24 keys a warpgroup, P and dS by
    stmatrix x2, within 227 KiB with 2 Q stages and 1 dO stage, no spills (causal GQA: the
    longest path); `dkv_split_d`: dK^T and dV^T split by d (2 M blocks of m64n48 a
    warpgroup), three CTA-wide barriers a tile (FA4's order)."""
    from hopper_attn.harness import registry
    from hopper_attn.harness.compile_report import compile_artifacts
    name = "kb2" if split_d else "kb2:dkv_split_d=0"      # split: the default
    art = compile_artifacts(registry.get(name), 256, True, heads=4, heads_kv=2)
    assert art["ok"], art.get("error")
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
        assert art["kernel"]["smem_bytes"] + fn["static_smem"] <= 227 * 1024
    ptx, kernel = art["ptx"], art["kernel"]
    assert kernel["block_n"] == 48 and kernel["options"]["gqa"] is True
    assert kernel["options"]["dkv_swap_ab"] is True
    # S, dP: 16 k-steps each (m64n24); dV^T, dK^T: 4 M blocks x 4 (m64n24), or with
    # split_d 2 x 4 (m64n48); dQ: 3 m64n128
    assert count(ptx, r"wgmma\.mma_async\S*m64n24k16") == (32 if split_d else 64)
    assert count(ptx, r"wgmma\.mma_async\S*m64n48k16") == (16 if split_d else 0)
    assert kernel["options"]["dkv_split_d"] is split_d
    assert count(ptx, r"wgmma\.mma_async\S*m64n128k16") == 3
    assert count(ptx, r"stmatrix\.sync\.aligned\.m8n8\.x2") == 6


@pytest.mark.parametrize("name,d,dv,causal,heads_kv,window,tile", [
    ("kb2", 192, 128, True, 1, (127, -1), "dkv_swap_ab"),
    ("kb2:softcap=30.0", 192, 0, False, 0, (256, 256), "shared_keys"),
    ("kb2:softcap=30.0", 256, 0, True, 1, (127, -1), "dkv_swap_ab")])
def test_windows_at_d192_and_d256_compile_without_spills(name, d, dv, causal, heads_kv,
                                                          window, tile):
    """Sliding windows at d = 192 and 256 (issue 61): the swapped tile masks S (queries x
    keys) with the window's two limits, shared_keys (d = 192 with a softcap) S^T as d = 128
    does; GQA and the softcap on top, within 227 KiB and without spills."""
    from hopper_attn.harness import registry
    from hopper_attn.harness.compile_report import compile_artifacts
    art = compile_artifacts(registry.get(name), d, causal, heads=4 if heads_kv else 2,
                            heads_kv=heads_kv, window=window, head_dim_v=dv)
    assert art["ok"], art.get("error")
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
        assert art["kernel"]["smem_bytes"] + fn["static_smem"] <= 227 * 1024
    assert art["kernel"]["options"][tile] is True
    assert art["kernel"]["options"]["window_left"] == window[0]


@pytest.mark.parametrize("d,keys", [(192, 96), (256, 48)])
def test_dkv_swap_ab_warpgroups_keep_their_keys(d, keys):
    """Why P needs only a warpgroup's barrier (common/backward_dkv_swap.py): warpgroup w's S
    registers, its stmatrix stores of P / dS (x2 at d = 256) and its dV^T / dK^T operand B
    and accumulator all cover keys [h w, h w + h), h = keys / 2; its dQ columns are
    [d w / 2, d (w + 1) / 2), in kb2's dQ register order. Traced, no compile."""
    import cutlass.cute as cute
    from cutlass import BFloat16
    from hopper_attn.common import wgmma
    seen, half = {}, keys // 2

    @cute.jit
    def probe():
        mn, k_major = cute.nvgpu.OperandMajorMode.MN, cute.nvgpu.OperandMajorMode.K
        mma_s = wgmma.qk_mma(1, 2, half, BFloat16)
        mma_dk = wgmma.smem_mma(1, 2, half, mn, mn, BFloat16)
        mma_dq = wgmma.smem_mma(1, 2, d // 2, k_major, mn, BFloat16)
        store = wgmma.stmatrix_store(mma_s, BFloat16, 4 if half % 16 == 0 else 2)
        for t in (0, 77, 128, 255):
            parts = {"S": (mma_s.get_slice(t).partition_C, (64, keys), 1),
                     "stmatrix": (store.get_slice(t).partition_D, (64, keys), 1),
                     "dK^T": (mma_dk.get_slice(t).partition_C, (d, keys), 1),
                     "dK^T B": (mma_dk.get_slice(t - t % 128).partition_B, (keys, 64), 0),
                     "dQ": (mma_dq.get_slice(t).partition_C, (64, d), 1)}
            for name, (partition, shape, mode) in parts.items():
                part = partition(cute.make_identity_tensor(shape))
                seen[(name, t)] = {part[i][mode] for i in range(cute.size(part))}
            # dQ's registers in the order kb2's dQ writer and conversion (dq_mma) take them
            ours, theirs = (m.get_slice(t).partition_C(cute.make_identity_tensor((64, d)))
                            for m in (mma_dq, wgmma.dq_mma(d, BFloat16)))
            seen[("same dQ order", t)] = {int(all(ours[i] == theirs[i]
                                                  for i in range(cute.size(ours))))}

    probe()
    assert len(seen) == 24
    for (name, t), cols in seen.items():
        if name == "same dQ order":
            assert cols == {1}, t
            continue
        w, width = t // 128, d // 2 if name == "dQ" else half
        assert min(cols) >= w * width and max(cols) < (w + 1) * width, (name, t, cols)


def test_dkv_swap_ab_refusals():
    """dkv_swap_ab runs d = 192 (dv 192 or 128) and 256 on 64-row tiles, at d = 192 without
    a softcap: the policy's d = 192 and 256 rows (a softcap at d = 192: shared_keys)."""
    from hopper_attn import kb2
    from hopper_attn.common.contract import Problem
    for d in (192, 256):
        assert kb2.policy(Problem(1, 2, 128, d, True))["dkv_swap_ab"] is True
    assert kb2.policy(Problem(1, 2, 128, 192, True), tuned=False)["dkv_swap_ab"] is False
    for d, options in ((128, {}), (192, {"softcap": 30.0}), (192, {"block_m": 128}),
                       (192, {"shared_keys": True}), (256, {"head_dim_v": 128})):
        with pytest.raises(ValueError, match="dkv_swap_ab"):
            kb2.FlashAttentionBackwardKB2(d, False, block_n=96 if d != 256 else 48,
                                          dkv_swap_ab=True, **{"block_m": 64, **options})
    with pytest.raises(ValueError, match="dkv_split_d"):        # d = 256 only
        kb2.FlashAttentionBackwardKB2(192, False, block_n=96, dkv_swap_ab=True, dkv_split_d=True)


# ------------------------------------------------------------- the policy table (issue 58)

def test_policy_rows_name_their_reason_and_results():
    import os
    from hopper_attn import kb2
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for row in kb2.POLICY:
        assert row.reason and "\n" not in row.reason
        assert set(row.settings) <= set(kb2.DEFAULTS), row
        for path in row.results:
            # (results/ stores large JSON compressed: X.json as X.json.xz)
            full = os.path.join(root, path)
            assert os.path.exists(full) or os.path.exists(full + ".xz"), path
    keys = [(r.head_dim, r.causal, r.mode) for r in kb2.POLICY]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("d,causal,deterministic,heads_kv,expect", [
    (64, False, False, 0, {"block_m": 128, "dp_first": True, "longest_first": False}),
    (128, True, False, 0, {"block_m": 64, "longest_first": True, "convert_per_head": True}),
    (128, True, True, 0, {"longest_first": True, "convert_per_head": False,
                          "group_heads": 16}),
    (64, True, True, 0, {"group_heads": 32, "convert_per_head": False}),
    (64, True, False, 2, {"gqa": True, "heads_first": True, "longest_first": False,
                          "stmatrix": True, "stats_shuffle": True}),
    (64, True, True, 2, {"gqa": True, "longest_first": False, "heads_first": True,
                         "convert_per_head": False}),
    (128, True, True, 2, {"gqa": True, "longest_first": True, "group_heads": 16}),
    (128, True, False, 2, {"gqa": True, "longest_first": True, "heads_first": False}),
    (128, False, False, 2, {"gqa": True, "block_m": 80}),
    (96, True, False, 0, {"block_m": 64, "early_dv": True, "split_dv": 1,
                          "longest_first": True}),
    (192, False, False, 0, {"dkv_swap_ab": True, "shared_keys": False, "block_m": 64,
                            "early_dv": None}),
    (256, True, False, 0, {"dkv_swap_ab": True, "longest_first": False, "pdl": False}),
    (192, True, True, 2, {"dkv_swap_ab": True, "gqa": True, "group_heads": 8,
                          "convert_per_head": False}),
])
def test_policy(d, causal, deterministic, heads_kv, expect):
    from hopper_attn import kb2
    from hopper_attn.common.contract import Problem
    settings = kb2.policy(Problem(1, 4, 1024, d, causal, heads_kv=heads_kv), deterministic)
    for name, value in expect.items():
        assert settings[name] == value, name


def test_policy_d128_causal_gqa_runs_per_query_head_from_16k():
    """d = 128, causal, GQA: the walk up to N = 16k - 1, per query head (gqa off) from 16k
    (results/h200/2026-11-29_bwd128_gqa0_long.json.xz); the deterministic mode, the
    mask-free problem and sliding windows keep the walk."""
    from hopper_attn import kb2
    from hopper_attn.common.contract import Problem
    for n, causal, deterministic, gqa in ((16383, True, False, True), (16384, True, False, False),
                                          (32768, True, False, False), (16384, True, True, True),
                                          (16384, False, False, True)):
        settings = kb2.policy(Problem(1, 16, n, 128, causal, heads_kv=4), deterministic)
        assert settings["gqa"] is gqa, (n, causal, deterministic)
        assert settings["longest_first"] is causal
    windowed = Problem(1, 16, 16384, 128, True, heads_kv=4, window_left=4095)
    assert kb2.policy(windowed, False)["gqa"] is True          # unmeasured there: the walk


def test_dq_rows_compiles_without_spills():
    """dq_rows (d = 64, 128-row tiles): dQ split by query rows between the warpgroups, 8
    m64n64k16 WGMMAs a warpgroup from SMEM instead of 16 m64n32k16 (FA4's split); causal
    GQA compiles without spills, and 64-row tiles are refused."""
    from hopper_attn import kb2
    from hopper_attn.common.contract import Problem
    art = compiled("kb2:dq_rows=1", 64, True, heads_kv=1)
    assert art["kernel"]["options"]["dq_rows"] is True
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    assert count(art["ptx"], r"wgmma\.mma_async\.sync\.aligned\.m64n32k16") == 0
    assert count(art["ptx"], r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\S*\s+\{[^}]*\},"
                             r"\s*%rd") == 128 // 16                           # dQ
    with pytest.raises(ValueError, match="dq_rows"):
        kb2.compile_kernel(Problem(1, 2, 128, 64, True), block_m=64, dq_rows=True)


def test_stats_shuffle_compiles_without_spills():
    """stats_shuffle (d = 64): lse2 and D read once a lane quad (2 ld.shared.v2 a statistic
    and thread) and taken by warp shuffles, FA4's way; GQA without a mask, no spills; 80-row
    tiles refused."""
    art = compiled("kb2:stats_shuffle=1", 64, False, heads_kv=1)
    assert art["kernel"]["options"]["stats_shuffle"] is True
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    assert count(art["ptx"], r"shfl\.sync\.idx") >= 64
    from hopper_attn import kb2
    from hopper_attn.common.contract import Problem
    with pytest.raises(ValueError, match="stats_shuffle"):     # 20 columns a thread
        kb2.compile_kernel(Problem(1, 2, 128, 128, False), block_m=80, stats_shuffle=True)


def test_causal_stmatrix_without_held_stats():
    """d = 64 causal: the 32 lse2 values held across the S^T wait and the mask are what make
    dS^T's stmatrix stores spill (116 bytes; 100 with per-tile addresses). Shuffled (4
    registers a statistic, with per-tile addresses: the causal policy's row), they fit
    beside dQ by rows without spills."""
    art = compiled("kb2", 64, True)
    assert art["kernel"]["options"]["dq_rows"] is True
    assert art["kernel"]["options"]["stats_shuffle"] is True
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    assert count(art["ptx"], r"stmatrix\.sync") > 0
