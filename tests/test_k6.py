"""k6 compiles for sm_90a without spills and its PTX/SASS shows the intra-warpgroup overlap:
inside the loop the QK WGMMA group is committed before the PV group, the softmax waits
only for the first (`wgmma.wait_group 1`), and in the SASS the wait for both
(`WARPGROUP.DEPBAR.LE gsb0, 0x0`) that the P conversion needs comes after the softmax's exp2s."""

import re

import pytest
import torch

from hopper_attn.harness.compile_report import resource_usage, sass
from hopper_attn.harness.sass_order import wgmma_groups
from hopper_attn.k6 import pv_wait_after, settings_for
from hopper_attn.common.contract import Problem
from ptx import WGMMA, WGMMA_REG_A, compiled, count

pytestmark = pytest.mark.compile


CONFIGS = [(64, False), (64, True), (128, False), (128, True)]
WIDE = [(96, False), (96, True), (192, False), (192, True), (256, False), (256, True)]


def artifacts(d, causal, name="k6", dtype=torch.bfloat16):
    return compiled(name, d, causal, dtype)


@pytest.mark.parametrize("d,causal", CONFIGS + WIDE)
def test_no_spills(d, causal):
    for fn in resource_usage(artifacts(d, causal)["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


@pytest.mark.parametrize("d,causal", [(64, False), (128, True), (256, False)])
def test_fp16(d, causal):
    """fp16 is the same kernel with f16 WGMMAs (and f16 conversions of P and O)."""
    art = artifacts(d, causal, dtype=torch.float16)
    assert re.search(r"wgmma\.mma_async\S*\.f32\.f16\.f16", art["ptx"])
    assert not re.search(r"\.bf16", art["ptx"])
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


@pytest.mark.parametrize("d,block_m,block_n,pingpong", [
    (96, 128, 128, True), (192, 128, 112, False), (256, 128, 80, False)])
def test_wide_head_dim_tiles(d, block_m, block_n, pingpong):
    """Two 2-stage K and V rings of block_n x d fit in 227 KiB only with a narrower kv tile;
    above d = 128 the warpgroups do not take turns (as in FlashAttention-4)."""
    art = artifacts(d, False)
    kernel = art["kernel"]
    assert (kernel["block_m"], kernel["block_n"]) == (block_m, block_n)
    assert kernel["smem_bytes"] <= 227 * 1024
    assert bool(kernel["named_barriers"]["scheduler"]) == pingpong
    assert bool(re.search(r"bar\.sync\s+%r\d+,\s*256;", art["ptx"])) == pingpong
    # QK has block_n columns, PV d: one WGMMA per k16 slice of each
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{block_n}k16", art["ptx"])
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{d}k16", art["ptx"])


def test_too_much_shared_memory_is_refused():
    from hopper_attn.common.contract import Problem
    from hopper_attn import k6
    with pytest.raises(ValueError, match="shared memory"):
        k6.compile_kernel(Problem(1, 1, 128, 192), tile="128x128")


@pytest.mark.parametrize("d,causal", CONFIGS)
def test_softmax_waits_for_qk_only(d, causal):
    # (d = 64 waits for PV inside the tile by default, measured faster there: the option on)
    art = artifacts(d, causal, name="k6:pv_wait=late" if d == 64 else "k6")
    ptx = art["ptx"]
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx)
    assert "1" in waits                                       # S_j ready, PV_{j-1} in flight
    # the QK WGMMA (A from SMEM) is issued right before the PV one (A in registers): the
    # WGMMA in front of the first PV is a QK (in k5's order nothing of the loop precedes it)
    turn = re.search(r"bar\.sync\s+%r\d+,\s*256;", ptx)     # the turn, where there are turns
    loop = ptx[turn.end():] if turn else ptx
    first_pv = re.search(WGMMA_REG_A, loop).start()
    before = [m.start() for m in re.finditer(WGMMA, loop[:first_pv])]
    assert before and not re.match(WGMMA_REG_A, loop[before[-1]:])   # a QK: A from SMEM
    # ptxas did not serialize the WGMMAs (a DEPBAR that allows one group in flight), and did
    # not hoist the full wait above the softmax (docs/k6.md: k6 waits behind the loop's back
    # edge for that reason): the exp2s of a whole tile run between the two waits (the SFU's
    # share of them: every `fma_exp2_every`-th one is FMA-pipe code), or with pv_wait_after
    # (d = 128) at least the ones in front of its fence
    per_thread = art["kernel"]["block_n"] // 2
    every = art["kernel"]["options"].get("fma_exp2_every") or 0
    after = pv_wait_after(art["kernel"]["options"].get("pv_wait", ""))
    expected = after or per_thread - (per_thread // every if every else 0)
    assert exp2_between_waits(sass(art["cubin"])) >= expected


def exp2_between_waits(sass_text: str, conversion: str = "F2FP") -> int:
    """MUFU.EX2 between the loop's `DEPBAR 0x1` (S ready) and the `DEPBAR 0x0` in front of
    the P conversion (the first `conversion` after it; k7 with fp16 scores converts its row
    offsets to fp16 before, so it names P's e4m3 one): the part of the softmax that runs
    under PV."""
    lines = sass_text.splitlines()
    wait_qk = next(i for i, ln in enumerate(lines) if re.search(r"DEPBAR\.LE\s+gsb0,\s*0x1", ln))
    convert = next(i for i in range(wait_qk, len(lines)) if conversion in lines[i])
    wait_all = max(i for i in range(wait_qk, convert)
                   if re.search(r"DEPBAR\.LE\s+gsb0,\s*0x0", lines[i]))
    return sum("MUFU.EX2" in ln for ln in lines[wait_qk:wait_all])


def test_k5_waits_for_both():
    art = compiled("k5", 128, False)
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", art["ptx"])
    assert "1" not in waits


def test_d64_causal_uses_two_consumer_warpgroups():
    assert artifacts(64, True)["kernel"]["block_m"] == 128
    assert artifacts(64, False)["kernel"]["block_m"] == 192


def test_persistent_loop():
    """One CTA per SM (grid = min(work items, SMs)) that steps by gridDim.x; k5 reads no
    grid size at all. Any batch x heads runs (k5 refuses more than 65535)."""
    from hopper_attn.common.contract import Problem
    k6_ptx, k5_ptx = artifacts(128, False)["ptx"], compiled("k5", 128, False)["ptx"]
    assert artifacts(128, False)["kernel"]["persistent_ctas"] > 0
    assert "%nctaid.x" in k6_ptx and "%nctaid" not in k5_ptx
    # with a causal mask the next work item comes from a global counter (one atomicAdd per
    # item; the last CTA resets it with an acq_rel one) and reaches the consumers through
    # a 2-slot ring with its own mbarriers; full attention needs neither
    causal_ptx = artifacts(128, True)["ptx"]
    assert artifacts(128, True)["kernel"]["persistent_ctas"] > 0
    assert re.search(r"atom\.global\.add", causal_ptx)
    assert re.search(r"atom\.global\.acq_rel\.add", causal_ptx)
    assert count(causal_ptx, r"mbarrier\.init") == count(k6_ptx, r"mbarrier\.init") + 4
    assert not re.search(r"atom\.global", k6_ptx)
    big = Problem(1, 70000, 64, 64)
    assert registry_spec("k6").unsupported_reason(big) is None
    assert "65535" in registry_spec("k5").unsupported_reason(big)


def registry_spec(name):
    from hopper_attn.harness import registry
    return registry.get(name).spec


@pytest.mark.parametrize("d,causal", [(128, True), (256, False)])
def test_lazy_rescale_compiles(d, causal):
    """rescale="lazy_after_wait" (O rescaled only when a row maximum grew by more than 2^8,
    P's row sums rounded): no spills, one warp vote per tile for the decision; at d = 256,
    with the PV wait pinned after the softmax, every exp2 of the tile in front of the fenced
    wait (at d < 192 with the late wait the rounded sums' conversions, F2FP as P's, leave
    `exp2_between_waits` nothing to tell apart)."""
    # (all exp2s on the SFU: every 16th at d = 128 would otherwise run on the FMA pipe)
    art = artifacts(d, causal, name="k6:rescale=lazy_after_wait,fma_exp2_every=0," +
                    ("pv_wait=one_group" if d >= 192 else "pv_wait=late"))
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    assert "vote.sync.any" in art["ptx"]
    text = sass(art["cubin"])
    if d >= 192:
        # ptxas lays the rare rescale
        # branch (its own wait) out in front of the exp2s: count up to the fenced wait
        lines = text.splitlines()
        wait_qk = next(i for i, ln in enumerate(lines) if re.search(r"DEPBAR\.LE\s+gsb0,\s*0x1", ln))
        fenced = next(i for i in range(wait_qk, len(lines)) if "MEMBAR" in lines[i])
        assert sum("MUFU.EX2" in ln for ln in lines[wait_qk:fenced]) >= art["kernel"]["block_n"] // 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_d256_rescales_lazily_with_rounded_sums(dtype):
    """d = 256's default (lazy_after_wait): O rescaled only where a row maximum grew by more
    than 2^8 (one warp vote per tile, no WGMMA instruction under it), with P rounded to the input type before the row sums
    (every lazy rescale rounds them): in the steady loop one more pair conversion per pair of P
    (the row sums' next to the PV operand's) than the eager step's, widened back by a shift
    and a mask in bf16; the O rescale's multiplies only in the rare branch; no spills."""
    from hopper_attn.harness.sass_order import loop_body, loops
    art = artifacts(256, False, dtype=dtype)
    plain = artifacts(256, False, name="k6:rescale=eager", dtype=dtype)
    assert art["kernel"]["options"]["rescale"] == "lazy_after_wait"
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    assert "vote.sync.any" in art["ptx"]
    from hopper_attn.harness.sass_order import warpgroup_ops_under_warp_votes
    votes = warpgroup_ops_under_warp_votes(sass(art["cubin"]))
    assert votes and all(not skipped for _, _, skipped in votes), votes
    t = "bf16" if dtype == torch.bfloat16 else "f16"
    pairs = count(art["ptx"], rf"cvt\.rn\.{t}x2\.f32")
    assert pairs > count(plain["ptx"], rf"cvt\.rn\.{t}x2\.f32")
    if t == "bf16":                     # a bf16 widened: the pair's halves moved into place
        assert count(art["ptx"], r"shl\.b32 %r\d+, p, 16;") == \
            count(art["ptx"], r"and\.b32 %r\d+, p, 0xffff0000;") > 0
    else:
        assert count(art["ptx"], r"cvt\.f32\.f16") > count(plain["ptx"], r"cvt\.f32\.f16")

    def steady_f2fp(a):
        text = sass(a["cubin"])
        body = loop_body(text, max(loops(text), key=lambda lp: lp[1] - lp[0]))
        return sum("F2FP" in ln for ln in body)
    # 128 x 80 tiles: 40 probabilities a thread, 20 pairs per tile for PV, 20 for the sums
    assert steady_f2fp(plain) == 20 and steady_f2fp(art) == 40


def test_d192_lazy_before_pv_keeps_wgmma_waits_off_warp_votes():
    """d = 192's default lazy loop (lazy_before_pv) without "lazy"'s undefined behaviour
    (docs/lab/k6.md "The lazy vote per warpgroup"): no WGMMA instruction under a branch on a
    per-warp vote (synccheck's mismatching warpgroup pc), only O's multiplies, with no wait.
    The steady loop's PV wait leaves only P's 28 operand conversions behind it, as "lazy"'s
    does (lazy_after_wait's rounded sums sink behind it at d = 192); no spills."""
    from hopper_attn.harness.sass_order import (BARRIER_VOTE, loop_body, loops,
                                                warpgroup_ops_under_warp_votes)
    art = artifacts(192, False)
    assert art["kernel"]["options"]["rescale"] == "lazy_before_pv"
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    text = sass(art["cubin"])
    votes = warpgroup_ops_under_warp_votes(text)
    assert votes and all(not skipped for _, _, skipped in votes), votes
    assert not warpgroup_ops_under_warp_votes(text, BARRIER_VOTE)
    body = loop_body(text, max(loops(text), key=lambda lp: lp[1] - lp[0]))
    last_wait = max(i for i, t in enumerate(body) if t.startswith("WARPGROUP.DEPBAR.LE")
                    and t.endswith("0x0"))
    assert sum("F2FP" in t for t in body[last_wait:]) == 112 // 4


def test_lazy_rescale_defaults():
    """POLICY: d = 192 and 256 (both masks) rescale lazily with rounded sums in the loop
    whose PV wait is pinned (one PV group; d = 256 after that wait); d <= 128 keeps the
    eager step; a PV wait among or before the exp2s needs the eager step (given, not
    implied)."""
    from hopper_attn import k6
    for d, causal in ((256, False), (256, True), (192, False), (192, True)):
        o = settings_for(Problem(1, 2, 1000, d, causal))
        lazy = "lazy_after_wait" if d == 256 else "lazy_before_pv"
        assert (o["rescale"], o["pv_wait"]) == (lazy, "one_group"), (d, causal)
    for d, causal in ((128, True), (128, False), (64, True)):
        assert settings_for(Problem(1, 2, 1000, d, causal))["rescale"] == "eager"
    with pytest.raises(ValueError, match="eager only"):
        k6.compile_kernel(Problem(1, 2, 1000, 256, False), pv_wait="after14")
    kernel = k6.FlashAttentionK6(256, False, 128, 80, pv_wait="one_group",
                                 rescale="lazy_after_wait")
    assert kernel.lazy_rescale and kernel.round_p_sums and kernel.reverse_p
    assert not kernel.wait_pv_late and kernel.pin_pv_wait


@pytest.mark.parametrize("plain_name,name", [("k6:pv_wait=free,fma_exp2_every=0",
                                              "k6:pv_wait=pinned,fma_exp2_every=0"),
                                             ("k7:pv_wait=free", "k7")])
def test_a_fence_pins_the_pv_wait(plain_name, name):
    """Without the late wait, ptxas hoists the PV wait (`DEPBAR 0x0`) above the softmax; a
    memory fence in front of it (MEMBAR.ALL.CTA) keeps it where the source puts it, after
    every exp2 of the tile, in the same iteration (docs/lab/k6.md "What the SASS says")."""
    plain = artifacts(128, False, name=plain_name)
    pinned = artifacts(128, False, name=name)
    conversion = "F2FP.SATFINITE.E4M3" if name == "k7" else "F2FP"
    assert exp2_between_waits(sass(plain["cubin"]), conversion) == 0
    # every exp2 of the tile before the wait (block_n / 2 per thread); with k7's fp16 scores
    # ptxas still moves a quarter of them (the second row's last pairs) past it
    share = 3 / 4 if pinned["kernel"]["options"].get("s_f16") else 1
    assert exp2_between_waits(sass(pinned["cubin"]), conversion) >= \
        pinned["kernel"]["block_n"] // 2 * share
    assert count(pinned["ptx"], r"fence\.acq_rel\.cta") == 1
    for fn in resource_usage(pinned["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


def test_d64_causal_192_rows_fit_with_one_limit_per_row():
    """Three consumer warpgroups (160 registers) at d = 64 with a causal mask spill with the
    two-compare mask (why k6 uses 128 rows there for short sequences); with one key limit
    per row (POLICY's 192-row causal rows) they fit."""
    from hopper_attn.harness import registry
    from hopper_attn.harness.compile_report import compile_artifacts
    art = compile_artifacts(registry.get("k6"), 64, True, seqlen=1024)
    assert art["ok"] and art["kernel"]["block_m"] == 192
    assert art["kernel"]["options"]["mask_per_row"]
    spills = compile_artifacts(registry.get("k6:tile=192x128,pingpong=0"), 64, True)
    assert not spills["ok"] and spills["spills"]


def test_d64_causal_long_sequences_use_192_rows():
    from hopper_attn import k6
    short = k6.compile_kernel(Problem(1, 2, 767, 64, True))
    long = k6.compile_kernel(Problem(1, 2, 768, 64, True))
    longer = k6.compile_kernel(Problem(1, 2, 4096, 64, True))
    assert short.describe()["block_m"] == 128 and long.describe()["block_m"] == 192
    # the PV wait in the iteration where each warpgroup stops at its own diagonal, after the
    # softmax (measured 2026-11-28, docs/lab/k6.md "The PV wait before the exp2s"); from there
    # among the exp2s, with turns (2026-11-28, "Turns again at d = 64 with a mask")
    assert long.options["mask_per_row"] and long.options["pv_wait"] == "free"
    assert long.options["wg_causal_limit"] and not long.options["pingpong"]
    assert longer.options["mask_per_row"] and longer.options["pv_wait"] == "after4"
    assert not longer.options["wg_causal_limit"] and longer.options["pingpong"]
    assert longer.kernel.opaque_exp2


def test_d64_causal_long_loop_waits_for_pv_among_the_exp2s(tmp_path):
    """From 4k queries (192-row tiles, turns): ptxas keeps the PV wait a few exp2s into the
    tile, not before the first nor after the last, and computes each exp2 once (66 per tile:
    64 of P, two alphas)."""
    from hopper_attn.common.contract import Problem
    from hopper_attn.harness import registry
    from hopper_attn.harness.sass_order import loops
    handle = registry.get("k6").compile(Problem(1, 2, 4096, 64, True),
                                        compile_options=f"--keep-cubin --dump-dir={tmp_path}")
    (_, _, events), = loops(sass(bytes(handle.compiled.__cubin__)))
    exp2s = [int(e.split(" x")[1]) if " x" in e else 1 for e in events if e.startswith("EX2")]
    assert sum(exp2s) == 66
    fence = events.index("MEMBAR")
    wait = events.index("DEPBAR 0x0", fence)
    before = sum(int(e.split(" x")[1]) if " x" in e else 1
                 for e in events[:wait] if e.startswith("EX2"))
    assert 8 <= before <= 24, events


def test_d96_long_sequences():
    """d = 96, N >= 2048: three consumer warpgroups on 192 x 96 tiles without turns
    (no mask), d = 128's causal row (the PV wait after 7 exp2s, spins, 8 MiB head groups
    longest first); no spills (ptxas spill warnings are errors here)."""
    from hopper_attn import k6
    from hopper_attn.common.contract import Problem
    from hopper_attn.harness.compile_report import SPILLS_AS_ERRORS

    def build(seqlen, causal):
        return k6.compile_kernel(Problem(1, 2, seqlen, 96, causal),
                                 compile_options=SPILLS_AS_ERRORS)

    short, full, causal = build(2047, False), build(2048, False), build(2048, True)
    assert (short.describe()["block_m"], short.describe()["block_n"]) == (128, 128)
    kernel = full.describe()
    assert (kernel["block_m"], kernel["block_n"], kernel["consumer_warpgroups"]) == (192, 96, 3)
    assert not kernel["named_barriers"]["scheduler"]
    assert (causal.options["pv_wait"], causal.options["longest_first"]) == ("after7", 8)
    # shorter lengths whose last 192-row query tile leaves at most one warpgroup idle too
    assert [k6.d96_wide_tiles(n) for n in (512, 768, 1024, 1280, 1536, 1792)] == \
        [False, True, False, True, True, False]


def test_own_o_buffer_option():
    """k6:item_end=own_buffer (the default's buffer at d <= 128): O staged in a buffer of its
    own, Q's size more shared memory, no spills; refused where it does not fit (d = 256)."""
    for d in (64, 128):
        plain, own = (artifacts(d, True, name="k6:item_end=q_buffer"),
                      artifacts(d, True, name="k6:item_end=own_buffer"))
        for fn in resource_usage(own["cubin"]):
            assert fn["local"] == 0 and fn["stack"] == 0, fn
        extra = own["kernel"]["block_m"] * d * 2
        assert own["kernel"]["smem_bytes"] - plain["kernel"]["smem_bytes"] >= extra
    from hopper_attn import k6
    with pytest.raises(ValueError, match="shared memory"):
        k6.compile_kernel(Problem(1, 2, 128, 256, False), item_end="own_buffer")


@pytest.mark.parametrize("d,causal", [(64, False), (96, False), (128, True)])
def test_skip_idle_wgs_option(d, causal):
    """k6:skip_idle_wgs=1: a consumer warpgroup whose rows all lie past the sequence's end
    runs `idle_loop` (ring waits and releases, turns; no GEMM, no softmax), chosen once per
    work item, so the compute loop is the default's: the same WGMMA groups and exp2 count,
    within two instructions, no spills."""
    from hopper_attn.harness.sass_order import loop_body, loops
    plain, skip = artifacts(d, causal), artifacts(d, causal, name="k6:skip_idle_wgs=1")
    a, b = sass(plain["cubin"]), sass(skip["cubin"])
    assert wgmma_groups(a) == wgmma_groups(b) and a.count("MUFU.EX2") == b.count("MUFU.EX2")
    assert abs(len(loop_body(a, loops(a)[0])) - len(loop_body(b, loops(b)[0]))) <= 2
    for fn in resource_usage(skip["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


@pytest.mark.parametrize("d,causal", [(64, True), (128, False), (128, True), (256, False)])
def test_v_lags_k_option(d, causal):
    """k6:v_lags_k=1: the producer loads K_{j+1} before V_j and a consumer waits for V_{j-1}
    inside its turn, after issuing S_j (FlashAttention-4's order): no spills, and the loop's
    turn (the first `bar.sync ..., 256` to its `bar.arrive`) holds an mbarrier wait (V's),
    which the default has before the turn."""
    name = "k6:v_lags_k=1"
    art = artifacts(d, causal, name=name)
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    if art["kernel"]["named_barriers"]["scheduler"]:  # where the WGs take turns (d = 64)
        plain = artifacts(d, causal, name="k6:v_lags_k=0")
        for ptx, waits in ((art["ptx"], 1), (plain["ptx"], 0)):
            turn = re.search(r"bar\.sync\s+%r\d+,\s*256;(.*?)bar\.arrive", ptx, re.S)
            assert (count(turn.group(1), r"mbarrier\.try_wait") > 0) == bool(waits)


@pytest.mark.parametrize("d,causal,lags,own", [
    (128, False, True, True), (128, True, True, True), (64, True, True, True),
    (64, False, True, True), (96, False, False, True), (256, False, True, False),
    (256, True, True, False), (192, True, True, False)])
def test_load_order_defaults(d, causal, lags, own):
    """POLICY's V lagging and O buffer (measured round-robin, docs/k6.md)."""
    kernel = artifacts(d, causal)["kernel"]
    assert (kernel["v_lags_k"], kernel["own_o_buffer"]) == (lags, own)


def _thread_index_reads_between_wgmmas(sass_text):
    lines = sass_text.splitlines()
    gemms = [i for i, line in enumerate(lines) if "HGMMA" in line]
    return [line for line in lines[gemms[0]:gemms[-1]] if "SR_TID" in line]


@pytest.mark.parametrize("name", ["k5", "k6"])
def test_releases_from_an_elected_lane(name):
    """Consumer warps hand stages back from an elected lane (`elect.sync`, tma.release_stage):
    the library's lane-0 predicate made ptxas re-read the thread index (S2R) before every
    release inside the GEMM loop."""
    art = artifacts(128, False, name=name)
    assert count(art["ptx"], r"elect\.sync") >= 4
    assert not _thread_index_reads_between_wgmmas(sass(art["cubin"]))


def test_spinning_waits_where_measured():
    """d = 128, d = 64 on its 192-row tiles (`three_wg_d64`) and d = 192 / 256 with a mask
    (POLICY): every ring wait is `mbarrier.try_wait` without a suspend-time hint, in a
    loop (no NANOSLEEP). Elsewhere (here d = 64's 128-row causal tile and d = 256 without a
    mask) the library's wait, which sleeps between tries."""
    hint = r"mbarrier\.try_wait\.parity\S*\s+[^;]*,\s*10000000;"
    for d, causal, spins in ((128, False, True), (64, False, True), (64, True, False),
                             (256, False, False), (256, True, True)):
        art = artifacts(d, causal)
        assert art["kernel"]["spin_waits"] == spins, (d, causal)
        # with a mask the dynamic scheduler's item queue keeps the library's wait (2 sites)
        queue = 2 if causal else 0
        hinted = count(art["ptx"], hint)
        assert (hinted == queue) if spins else (hinted > queue), (d, causal, hinted)
        if not causal:
            assert ("NANOSLEEP" in sass(art["cubin"])) != spins, (d, causal)


def test_every_16th_exp2_on_the_fma_pipe_at_d128():
    """d = 128: one exp2 in 16 of a tile (4 of each thread's 64) is the FMA-pipe cubic
    (`exp2_on_fma`: a `shl.b32` by 23 per value in the PTX), so the loop's 64 MUFU.EX2 become
    60 (+2 for the rows' rescale factors); d = 64 keeps all of them on the SFU."""
    d128, d64 = artifacts(128, False), artifacts(64, False)
    assert d128["kernel"]["options"]["fma_exp2_every"] == 16
    assert d64["kernel"]["options"]["fma_exp2_every"] == 0
    assert count(d128["ptx"], r"shl\.b32\s+tb, tb, 23") == 4     # 2 rows x 32 columns / 16
    assert count(sass(d128["cubin"]), r"MUFU\.EX2") == 62
    assert count(d64["ptx"], r"shl\.b32\s+tb, tb, 23") == 0


def test_d64_192_row_tiles_take_three_settings_together():
    """d = 64 on 192-row tiles: V one tile behind K, spinning waits and uniform-register SMEM
    descriptors together (measured: each alone lost, together +2-3%; docs/k6.md); the
    128-row causal tile (short sequences) keeps none of them but the lagging V."""
    full, causal = artifacts(64, False)["kernel"], artifacts(64, True)["kernel"]
    assert (full["v_lags_k"], full["spin_waits"], full["options"]["uniform_descriptors"]) == \
        (True, True, True)
    assert full["block_m"] == 192 and causal["block_m"] == 128
    assert (causal["v_lags_k"], causal["spin_waits"],
            causal["options"]["uniform_descriptors"]) == (True, False, False)


def test_turns_only_where_they_pay():
    """Ping-pong between the consumer warpgroups (named-barrier turns) only where it measured
    faster: d = 64 without a mask (3.7-5.7% slower without); not at d = 128 (0.8-1.8% faster
    without, since the waits and loads of 2026-11-25) nor on d = 64's 192-row causal tiles
    below 4k (1.4-2.0% faster without, with the PV wait late or after the softmax); from 4k,
    where those wait among the exp2s, turns again."""
    from hopper_attn import k6
    assert artifacts(64, False)["kernel"]["named_barriers"]["scheduler"]
    for causal in (False, True):
        assert not artifacts(128, causal)["kernel"]["named_barriers"]["scheduler"]
    long_causal = k6.compile_kernel(Problem(1, 2, 768, 64, True)).describe()
    assert long_causal["block_m"] == 192 and not long_causal["named_barriers"]["scheduler"]
    # from 4k, with the PV wait among the exp2s, turns again (+1.4-3.8% on the H200)
    longer = k6.compile_kernel(Problem(1, 2, 4096, 64, True)).describe()
    assert longer["block_m"] == 192 and longer["named_barriers"]["scheduler"]


@pytest.mark.parametrize("d", [64, 128])
def test_row_max_and_epilogue_instructions(d):
    """Two small instruction savings shared with k5 and k7: the row maximum across a quad
    of lanes is one `max.f32` per shuffle (common/softmax.py `quad_max`; not the
    NaN-propagating compare-and-select the library emits for a non-Float32 argument), and
    O goes to shared memory with `stmatrix` (d / 16 per thread for its 64 x d rows)."""
    ptx = artifacts(d, False)["ptx"]
    assert count(ptx, r"setp\.nan\.f32") == 0
    shuffles = re.findall(r"shfl\.sync\.bfly\.b32\s+(%r\d+).*\n\s*(\S+)\s+%r\d+, %r\d+, \1;", ptx)
    assert shuffles and all(op == "max.f32" or op == "add.f32" for _, op in shuffles)
    assert count(ptx, r"stmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16") == d // 16


@pytest.mark.parametrize("d", [64, 128, 256])
def test_longest_first_option(d):
    """k6:longest_first=32 (the dynamic schedule's items in head groups of 32 MiB of K and V):
    no spills, and the group's row budget in the PTX."""
    art = artifacts(d, True, "k6:longest_first=32")
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    rows = (32 << 20) // (d * 4)
    assert count(art["ptx"], rf"div\.s32\s+%r\d+,\s*{rows},") >= 1
    assert count(artifacts(d, True)["ptx"], rf"div\.s32\s+%r\d+,\s*{rows},") == 0


def test_longest_first_items_decoded_once():
    """In the head-group order the producer warp decodes each work item and hands (query
    tile, head, batch, valid) to the consumers in one 16-byte SMEM slot; in the head-by-head
    order it hands over the item's index, which every consumer decodes itself."""
    grouped = artifacts(128, True, "k6:longest_first=8")["ptx"]
    plain = artifacts(128, True, "k6:longest_first=0")["ptx"]
    assert count(grouped, r"st\.shared\.v4\.b32") == count(grouped, r"ld\.shared\.v4\.b32") == 1
    assert count(plain, r"st\.shared\.v4\.b32") == count(plain, r"ld\.shared\.v4\.b32") == 0
    assert count(plain, r"ld\.shared\.b32") == 1


def test_longest_first_by_sequence_length():
    """On by default with a mask inside the query lengths where it was measured to pay
    (POLICY: 1k-8k at d = 128, 2k-16k at d = 256, 4k-16k at d = 64, every length at d = 96
    and 192); off without a mask."""
    def on(n, d, causal=True):
        return settings_for(Problem(1, 2, n, d, causal))["longest_first"] > 0
    for d, low, high in ((64, 4096, 16384), (128, 1024, 8192), (256, 2048, 16384)):
        assert on(low, d) and on(high, d) and not on(low - 1, d) and not on(high + 1, d)
        assert not on(low, d, causal=False)
    assert all(on(n, d) and not on(n, d, causal=False) for n in (512, 16384)
               for d in (96, 192))


def _conversions_among_exp2s(text):
    """F2FP (P's bf16 conversions) between the first and the last MUFU.EX2 of the unmasked
    loop path's longest exp2 stretch: the SASS lines from the first to the last exp2 of the
    stretch that holds the most of them."""
    lines = text.splitlines()
    exp2 = [i for i, ln in enumerate(lines) if "MUFU.EX2" in ln]
    runs, start = [], 0                       # stretches of exp2s without a branch between
    for a, b in zip(exp2, exp2[1:]):
        if any(" BRA " in ln for ln in lines[a:b]):
            runs.append((exp2[start], a))
            start = exp2.index(b)
    runs.append((exp2[start], exp2[-1]))
    first, last = max(runs, key=lambda r: sum("MUFU.EX2" in ln for ln in lines[r[0]:r[1]]))
    return sum("F2FP" in ln for ln in lines[first:last])


@pytest.mark.parametrize("name,d,causal,on", [
    ("k6", 64, False, True), ("k6", 128, False, True), ("k6", 256, False, True),
    ("k6", 256, True, True), ("k6", 128, True, False), ("k6", 64, True, False),
    ("k6", 96, False, False), ("k6", 192, False, False)])
def test_v_released_after_p_without_a_branch(name, d, causal, on):
    """v_release_last (POLICY): a tile hands V_{n-1}'s
    stage back after P's conversion with one predicated arrive (elect.sync and n > 0 as
    predicates, no `if`), so the exp2s and P's conversions share one basic block; where the
    PV wait is not late (d = 64), ptxas then spreads the conversions among the exp2s, as in
    FlashAttention-4's loop. (item_end without the early Q release: its Q release is such an
    arrive too.)"""
    art = artifacts(d, causal, name=name + (":item_end=own_buffer" if d <= 128 else ""))
    assert art["kernel"]["options"]["v_release_last"] == on
    assert (count(art["ptx"], r"@p mbarrier\.arrive\.shared::cta\.b64") >= 1) == on
    if d == 64 and not causal:
        off = artifacts(d, causal, name="k6:v_release_last=0")
        assert _conversions_among_exp2s(sass(off["cubin"])) == 0
        assert _conversions_among_exp2s(sass(art["cubin"])) >= 16
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


def _tile_after_pv_wait(text: str):
    """The SASS lines from the loop's PV wait (the first `DEPBAR 0x0` after the `0x1` one) to
    the tile's last exp2 (the last MUFU.EX2 before the next HGMMA)."""
    lines = text.splitlines()
    wait_qk = next(i for i, ln in enumerate(lines) if re.search(r"DEPBAR\.LE\s+gsb0,\s*0x1", ln))
    wait_all = next(i for i in range(wait_qk, len(lines))
                    if re.search(r"DEPBAR\.LE\s+gsb0,\s*0x0", lines[i]))
    next_mma = next(i for i in range(wait_all, len(lines)) if "HGMMA" in lines[i])
    last_exp2 = max(i for i in range(wait_all, next_mma) if "MUFU.EX2" in lines[i])
    return lines[wait_all:last_exp2]


def test_pv_wait_among_the_exp2s():
    """pv_wait="after7" (POLICY: d = 128): a memory fence after the tile's 7th exp2 keeps
    the PV wait, written after the softmax, from rising above it, and the row maxima come
    first, so ptxas spreads O's 64 multiplies and P's 32 conversions over the exp2s that
    follow the wait (FlashAttention-4's order) instead of running them at the loop's top."""
    from hopper_attn import k6
    art = artifacts(128, False)
    assert art["kernel"]["options"]["pv_wait"] == "after7"
    assert art["kernel"]["options"]["v_release_last"]
    assert count(art["ptx"], r"fence\.acq_rel\.cta") == 1
    text = sass(art["cubin"])
    assert exp2_between_waits(text) >= 7
    tail = _tile_after_pv_wait(text)
    assert sum("MUFU.EX2" in ln for ln in tail) >= 16
    assert sum("F2FP" in ln for ln in tail) >= 16
    assert sum(re.search(r"\bFMUL\b", ln) is not None for ln in tail) >= 48
    # the late wait (before): the multiplies and conversions follow the last exp2
    late = _tile_after_pv_wait(sass(artifacts(128, False, name="k6:pv_wait=late")["cubin"]))
    assert sum("F2FP" in ln for ln in late) == 0
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    # with a mask from 2k queries on, with V released last
    short = k6.compile_kernel(Problem(1, 2, 2047, 128, True))
    long = k6.compile_kernel(Problem(1, 2, 2048, 128, True))
    assert short.options["pv_wait"] == "late" and not short.kernel.v_release_last
    assert long.options["pv_wait"] == "after7" and long.kernel.v_release_last


def _pv_groups(text: str) -> list:
    """Sizes of the WGMMA groups of O += P V (A in registers) in the SASS, in code order."""
    return [size for form, _, size in wgmma_groups(text) if form == "rs"]


@pytest.mark.parametrize("name,d,causal,split", [
    ("k6", 64, False, False), ("k6", 96, False, False), ("k6", 128, False, False),
    ("k6", 128, True, False), ("k6", 192, False, False), ("k6", 192, True, False),
    ("k6", 256, False, False), ("k6", 256, True, False),           # PINNED_IN_ITERATION
    ("k6:pv_wait=late,peel_first=0,rescale=lazy_after_wait", 192, False, True),  # late wait
    ("k6:pv_wait=late,peel_first=0", 256, False, True),
    ("k6:pv_wait=late,peel_first=0", 256, True, True),
    ("k6:pv_wait=late", 256, False, False),                         # peel_first keeps PV whole
    ("k6:tile=192x96,pingpong=0,pv_wait=late", 96, False, True),    # d = 96 from N = 2k
    ("k6:tile=192x96,pingpong=0,pv_wait=one_group", 96, False, False)])
def test_pv_wgmma_groups(name, d, causal, split):
    """O += P V is one WGMMA group (block_n / 16 HGMMAs, one `gsb0`), so that the loop's
    `wait_group(1)` waits for QK only. With kv tiles of 80 or 112 keys (d = 256, 192) ptxas
    builds P's last k16 slice in other registers and moves it in after the WGMMA fence, and
    splits the loop's PV into one group per slice: `wait_group(1)` then waits for all of PV but
    its last slice. Converting P last slice first with the PV wait pinned in the iteration
    (pv_wait="one_group": the default at d = 96, 192 and 256 since it measured +0.4-6.7%)
    keeps every PV whole (docs/lab/k6.md "One WGMMA group per P
    slice")."""
    art = artifacts(d, causal, name=name)
    slices = art["kernel"]["block_n"] // 16
    groups = _pv_groups(sass(art["cubin"]))
    assert sum(groups) % slices == 0 and groups
    assert (groups[:slices] == [1] * slices) == split
    if not split:
        assert all(g == slices for g in groups)
    if name == "k6" and d >= 192:
        options = art["kernel"]["options"]
        assert options["pv_wait"] == "one_group"
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


@pytest.mark.parametrize("name,d,causal,seqlen", [("k6:pv_wait=after7", 64, False, 128),
                                                  ("k6", 64, True, 4096)])
def test_exp2s_computed_once(name, d, causal, seqlen):
    """On 192-row tiles, with the fence of pv_wait="after<n>" in the softmax, the compiler
    computed part of P's exp2s a second time for P's conversion after the fence (89 instead
    of 66 `ex2` per tile at d = 64); each exp2 result goes through an opaque move there
    (FlashAttentionK6.opaque_exp2), and the kernel has one per score again, plus one alpha
    per row."""
    from hopper_attn.harness import registry
    from hopper_attn.harness.compile_report import compile_artifacts
    art = compile_artifacts(registry.get(name), d, causal, seqlen=seqlen)
    assert art["ok"] and art["kernel"]["block_m"] == 192
    once = art["kernel"]["block_n"] // 2 + 2
    assert count(art["ptx"], r"ex2\.approx") == once
    assert sass(art["cubin"]).count("MUFU.EX2") == once


def test_item_end_options():
    """A work item's end (ITEM_ENDS, measured 2026-11-26, docs/lab/k6.md "Where a work item
    ends"): with "own_buffer_wg" the loop hands Q's stage back itself (a third predicated
    mbarrier arrive in the loop, next to K's and V's) and each consumer warpgroup stores its
    own rows on a barrier of its 128 threads, and no barrier of all consumer threads is left
    (with "q_buffer_wg", at d >= 192, into its own rows of Q's buffer). O's own buffer is
    refused where it does not fit."""
    from hopper_attn import k6
    from hopper_attn.harness.sass_order import loop_body, loops

    def loop_arrives(art):
        text = sass(art["cubin"])
        return sum("SYNCS.ARRIVE" in line for line in loop_body(text, loops(text)[0]))

    new, old = artifacts(64, False), artifacts(64, False, "k6:item_end=own_buffer")
    assert new["kernel"]["options"]["item_end"] == "own_buffer_wg"
    assert loop_arrives(new) == loop_arrives(old) + 1 == 3
    all_consumers = "bar.sync \t1, 384;"
    assert all_consumers in old["ptx"] and all_consumers not in new["ptx"]
    assert re.search(r"bar\.sync \t%r\d+, 128;", new["ptx"])
    for art in (new, artifacts(128, True), artifacts(96, True)):
        for fn in resource_usage(art["cubin"]):
            assert fn["local"] == 0 and fn["stack"] == 0, fn
    for d, causal, n, end in [(64, False, 1024, "own_buffer_wg"), (64, True, 16384, "own_buffer_wg"),
                              (96, True, 8192, "own_buffer_wg"),
                              (128, True, 16384, "own_buffer_wg"), (256, False, 16384, "q_buffer_wg"),
                              (256, True, 16384, "q_buffer_wg"), (192, False, 8192, "q_buffer_wg")]:
        assert settings_for(Problem(1, 2, n, d, causal))["item_end"] == end, (d, causal, n)
    # d >= 192: O staged in Q's buffer, each warpgroup's rows in its own rows of Q
    d256 = artifacts(256, False)
    assert d256["kernel"]["options"]["item_end"] == "q_buffer_wg"
    assert not d256["kernel"]["own_o_buffer"]
    assert "bar.sync \t1, 256;" not in d256["ptx"]
    with pytest.raises(ValueError, match="shared memory"):
        k6.compile_kernel(Problem(1, 2, 128, 256, False), item_end="own_buffer_wg")


def test_fast_divmod_decode():
    """POLICY's fast_divmod (measured 2026-11-26): at d = 64 without a mask the static
    schedule decodes its work items with the library's FastDivmod (magic numbers computed
    once per CTA: the two 64-bit divisions), not with integer divisions per item; elsewhere
    the divisions stay."""
    fast = artifacts(64, False)
    assert fast["kernel"]["options"]["fast_divmod"]
    assert (len(re.findall(r"div\.s32\s", fast["ptx"])),
            len(re.findall(r"div\.u64\s", fast["ptx"]))) == (2, 2)
    for d, causal, n, on in [(64, False, 1024, True), (64, False, 16384, True),
                             (64, True, 1024, False), (128, False, 1024, False),
                             (96, False, 1024, False)]:
        assert settings_for(Problem(1, 2, n, d, causal))["fast_divmod"] == on, (d, causal, n)


def test_wg_causal_limit():
    """POLICY's wg_causal_limit (measured 2026-11-26, docs/lab/k6.md "Each warpgroup's own diagonal"): with
    a causal mask and no turns each consumer warpgroup stops at the last kv tile its own rows
    see, then takes the item's remaining tiles in a loop of ring waits and releases only
    (`idle_tiles`: a loop in the SASS without WGMMA or exp2); the compute loop stays
    the default's, no spills. On at d = 256 and at d = 64 on 192-row tiles below 4k queries;
    refused with turns."""
    from hopper_attn.harness import sass_order

    def math_free_loops(text):
        """Backward branches whose body has no WGMMA, exp2 or EXIT (retry stubs end in one)."""
        instructions, labels = sass_order._instructions(text)
        found = 0
        for address, line in instructions:
            m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", line)
            if m and labels.get(m.group(1), 1 << 60) < address:
                body = [t for a, t in instructions if labels[m.group(1)] <= a <= address]
                found += not any(re.search(r"HGMMA|MUFU|\bEXIT\b", t) for t in body)
        return found

    on, off = artifacts(256, True), artifacts(256, True, "k6:wg_causal_limit=0")
    assert on["kernel"]["options"]["wg_causal_limit"]
    a, b = sass(on["cubin"]), sass(off["cubin"])
    assert math_free_loops(a) > math_free_loops(b)          # (and its waits' retries)
    assert wgmma_groups(a) == wgmma_groups(b) and a.count("MUFU.EX2") == b.count("MUFU.EX2")
    for fn in resource_usage(on["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    from hopper_attn import k6
    with pytest.raises(ValueError, match="wg_causal_limit"):
        k6.compile_kernel(Problem(1, 2, 128, 256, True), wg_causal_limit=True, pingpong=True)
    for d, causal, n, want in [(64, True, 1024, True), (64, True, 2048, True),
                               (64, True, 4096, False), (64, True, 512, False),  # 128 rows, turns
                               (256, True, 16384, True), (256, False, 1024, False),
                               (128, True, 1024, False), (192, True, 1024, True)]:
        assert settings_for(Problem(1, 2, n, d, causal))["wg_causal_limit"] == want, \
            (d, causal, n)


def test_stream_k():
    """POLICY's stream_k (measured 2026-11-26, docs/lab/k6.md "The static schedule's tail as
    stream-K"): without a mask, at d = 128 from 8k queries and d = 192 at all, the static
    schedule's last rounds are pieces of items; a split item's first piece leaves its state
    in the workspace (the kernel's counter argument, `stream_k_words` int32) and raises a
    flag with a release store, the last piece waits for it with acquire loads and merges.
    No spills; refused with a mask."""
    from hopper_attn import k6
    from hopper_attn.harness import registry
    from hopper_attn.harness.compile_report import compile_artifacts
    art = compile_artifacts(registry.get("k6"), 128, False, seqlen=8192)
    assert art["ok"] and art["kernel"]["options"]["stream_k"]
    assert "st.release.gpu" in art["ptx"] and "ld.acquire.gpu" in art["ptx"]
    assert "st.release.gpu" not in artifacts(128, False)["ptx"]
    kernel = k6.FlashAttentionK6(128, False, 128, 128, stream_k=True)
    assert kernel.stream_k_words() > 133 * 256 * (64 + 4)
    assert k6.FlashAttentionK6(128, False, 128, 128).stream_k_words() == 0
    with pytest.raises(ValueError, match="stream_k"):
        k6.FlashAttentionK6(128, True, 128, 128, stream_k=True)
    for d, causal, n, want in [(128, False, 8192, True), (128, False, 16384, True),
                               (128, False, 4096, False), (128, True, 16384, False),
                               (256, False, 16384, False), (64, False, 16384, False),
                               (192, False, 4096, True), (192, False, 2048, True)]:
        assert settings_for(Problem(1, 2, n, d, causal))["stream_k"] == want, (d, causal, n)


def test_no_tail_test_for_whole_kv_tiles():
    """POLICY's kv_tail="whole" (measured 2026-11-26, docs/lab/k6.md "A loop without the tail test"): at
    d = 256 without a mask, for a key length that is a multiple of the kv tile (80) the loop
    has no mask code (no `FSEL ... -INF`) and no test for it, with the default's GEMMs,
    waits and exp2s; other lengths and head dims keep the test; kv_tail=0 on a length with a
    tail is refused."""
    import tempfile
    from hopper_attn import k6
    from hopper_attn.common.contract import Problem, UnsupportedProblem
    from hopper_attn.harness import registry, sass_order
    from hopper_attn.harness.compile_report import SPILLS_AS_ERRORS

    def loop(name, n):
        with tempfile.TemporaryDirectory() as dump:
            handle = registry.get(name).compile(
                Problem(2, 2, n, 256, False), compile_options=f"--keep-cubin --dump-dir={dump} "
                                                              f"{SPILLS_AS_ERRORS}")
            assert handle.describe()["options"]["kv_tail"] == (name != "k6")
            text = sass(bytes(handle.compiled.__cubin__))
        (found,) = sass_order.loops(text)
        return found[2], sass_order.loop_body(text, found)

    events, body = loop("k6", 4000)
    events_tail, body_tail = loop("k6:kv_tail=1,peel_first=0", 4000)
    # the same GEMMs and exp2s (ptxas may group the exp2s differently around them)
    assert [ev for ev in events if "HGMMA" in ev] == [ev for ev in events_tail if "HGMMA" in ev]
    assert _exp2s(events) == _exp2s(events_tail)
    masks = [sum(bool(re.match(r"FSEL\b.*-INF", t)) for t in b) for b in (body, body_tail)]
    assert masks[0] == 0 and masks[1] >= 32, masks        # 40 scores a thread
    assert len(body) < len(body_tail)
    with pytest.raises(UnsupportedProblem, match="multiple of the kv tile"):
        k6.compile_kernel(Problem(1, 2, 4096, 256, False), kv_tail=False)
    for d, causal, n, nk, want in [(256, False, 4000, 0, False), (256, False, 4096, 0, True),
                                   (256, False, 1000, 16000, False), (256, True, 4000, 0, True),
                                   (128, False, 4096, 0, True), (64, False, 4096, 0, False),
                                   (64, False, 4000, 0, True), (64, True, 4096, 0, True),
                                   (192, False, 4032, 0, True)]:
        problem = Problem(1, 2, n, d, causal, seqlen_k=nk)
        assert settings_for(problem)["kv_tail"] == want, (d, causal, n, nk)


def _exp2s(events):
    """How many MUFU.EX2 a list of `sass_order` loop events holds ('EX2 x64' is 64)."""
    return sum(int(e.split(" x")[1]) if " x" in e else 1 for e in events if e.startswith("EX2"))


def test_pv_wait_before_the_exp2s_at_d64():
    """pv_wait="first" (POLICY: d = 64 without a mask, docs/lab/k6.md "The PV wait before the exp2s"): the
    wait for PV_{n-1} and a memory fence right after the row maxima, so the tile's exp2s of P
    (block_n / 2 a thread) all run after it; only the two rows' alphas may come first. The
    default at whole kv tiles drops the tail test with it. Without the fence, and without the
    test's branch, ptxas waits among the exp2s (what made the loop without the test 5% slower
    alone)."""
    from hopper_attn.harness import sass_order
    art = artifacts(64, False)
    options, per_thread = art["kernel"]["options"], art["kernel"]["block_n"] // 2
    assert options["pv_wait"] == "first" and not options["kv_tail"]
    (loop,) = sass_order.loops(sass(art["cubin"]))
    events = loop[2]
    fence = events.index("MEMBAR")
    assert any(e.startswith("DEPBAR 0x0") for e in events[events.index("DEPBAR 0x1"):fence])
    assert _exp2s(events[:fence]) <= 2 and _exp2s(events[fence:]) == per_thread
    plain = artifacts(64, False, "k6:pv_wait=free,kv_tail=0")
    (loop,) = sass_order.loops(sass(plain["cubin"]))
    events = loop[2]
    last_wait = max(i for i, e in enumerate(events) if e.startswith("DEPBAR 0x0"))
    assert "MEMBAR" not in events and _exp2s(events[:last_wait]) > 2
    from hopper_attn import k6
    with pytest.raises(ValueError, match="eager only"):
        k6.compile_kernel(Problem(1, 2, 128, 64), pv_wait="first", rescale="lazy_after_wait")


def test_first_kv_tile_peeled():
    """POLICY's peel_first (measured 2026-11-26, docs/lab/k6.md "The first kv tile before the loop"): at
    d = 192 and 256 an item's first kv tile runs before the loop, whose `n > 0` tests fold
    away: the loop keeps its GEMM groups and exp2s but loses a branch and the first tile's
    `wait_group(0)`, the kernel gains a second copy of the QK GEMM, nothing is
    serialized (one WGMMA fence per group), no spills. Not at d = 64 / 128 (ptxas then waits
    after every WGMMA) nor where the loop has no tail test (NO_TAIL_TEST's whole tiles)."""
    from hopper_attn import k6
    from hopper_attn.common.contract import Problem
    from hopper_attn.harness import sass_order
    on, off = artifacts(256, False), artifacts(256, False, "k6:peel_first=0")
    assert on["kernel"]["options"]["peel_first"] and not off["kernel"]["options"]["peel_first"]
    a, b = sass(on["cubin"]), sass(off["cubin"])
    (loop_on,), (loop_off,) = sass_order.loops(a), sass_order.loops(b)
    body_on, body_off = sass_order.loop_body(a, loop_on), sass_order.loop_body(b, loop_off)
    assert [e for e in loop_on[2] if "DEPBAR" not in e and "EX2" not in e] == \
        [e for e in loop_off[2] if "DEPBAR" not in e and "EX2" not in e]
    assert _exp2s(loop_on[2]) == _exp2s(loop_off[2])
    branches = [sum(t.split()[0 if t[0] != "@" else 1].startswith("BRA") for t in body)
                for body in (body_on, body_off)]
    assert branches[0] < branches[1], branches
    assert a.count("HGMMA") == b.count("HGMMA") + 16        # tile 0's QK (it has no PV)
    assert a.count("WARPGROUP.ARRIVE") <= b.count("WARPGROUP.ARRIVE") + 2
    for fn in resource_usage(on["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    for d, causal, n, want in [(256, False, 4096, True), (256, True, 4096, True),
                               (256, True, 4000, True), (256, False, 4000, False),
                               (192, False, 4096, True), (192, True, 1024, True),
                               (128, False, 4096, False), (64, True, 4096, False),
                               (96, False, 4096, False)]:
        assert settings_for(Problem(1, 2, n, d, causal))["peel_first"] == want, \
            (d, causal, n)


def test_stale_reference_error_emulation():
    """tools/stale_max_error.py (docs/lab/k6.md "The exp2s before the row maximum"): on the CPU,
    a reference maximum up to 2^8 stale costs the online softmax 1.5x and more of the eager
    step's error on keys that grow along the sequence, as on the GPU, and summing l from the
    bf16-rounded P (the values O adds) takes most of it back."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "stale_max_error.py"
    spec = importlib.util.spec_from_file_location("stale_max_error", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    ratios = tool.error_ratios("growing", thresholds=(0.0, 8.0))
    assert ratios[0.0][0] < 1.05
    assert ratios[8.0][0] > 1.5 and ratios[8.0][1] < 1.3, ratios




def test_policy_table():
    """One row of POLICY per (head dim, mask, query lengths): each with a reason and a
    results file that exists; every head dim and mask covered; at most 15 options a caller
    can set, each on (away from BASE) in some row or a user feature (softcap, trace); the
    steps no row varies are POLICY-only columns, not options."""
    import glob
    import pathlib
    from hopper_attn import k6
    root = pathlib.Path(__file__).resolve().parents[1]
    for d, causal, _lengths, settings, why, results in k6.POLICY:
        pattern = str(root / results) + ("" if "*" in results else "*")
        # (results/ stores large JSON compressed, X.json as X.json.xz: results/README.md)
        assert why and (glob.glob(pattern) or glob.glob(pattern + ".xz")), results
        assert set(settings) <= set(k6.BASE) | {"block_m", "block_n"}, settings
    for d in k6.SPEC.head_dims:
        for causal in (False, True):
            for n in (1, 1000, 4096, 1 << 20):
                k6.policy(Problem(1, 1, n, d, causal))
    assert len(k6.OPTIONS) + 1 <= 15                         # + trace
    rows = [{**k6.BASE, **settings} for *_, settings, _, _ in k6.POLICY]
    for name in set(k6.OPTIONS) - {"tile", "softcap"}:
        assert any(row[name] != k6.BASE[name] for row in rows) or \
            len({str(row[name]) for row in rows}) > 1, name
