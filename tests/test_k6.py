"""k6 compiles for sm_90a without spills and its PTX/SASS shows the intra-warpgroup overlap:
inside the loop the QK WGMMA group is committed before the PV group, the softmax waits
only for the first (`wgmma.wait_group 1`), and in the SASS the wait for both
(`WARPGROUP.DEPBAR.LE gsb0, 0x0`) that the P conversion needs comes after the softmax's exp2s."""

import re

import pytest
import torch

from hopper_attn.harness.compile_report import resource_usage, sass
from hopper_attn.harness.sass_order import wgmma_groups
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
        k6.compile_kernel(Problem(1, 1, 128, 192), block_n=128)


@pytest.mark.parametrize("d,causal", CONFIGS)
def test_softmax_waits_for_qk_only(d, causal):
    # (d = 64 waits for PV inside the tile by default, measured faster there: the option on)
    art = artifacts(d, causal, name="k6:wait_pv_late=1" if d == 64 else "k6")
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
    after = art["kernel"]["options"].get("pv_wait_after") or 0
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


@pytest.mark.parametrize("d,causal", [(64, False), (128, True), (256, False)])
def test_lazy_rescale_compiles(d, causal):
    """The option that rescales O only when a row maximum grew by more than 2^8: no spills,
    one warp vote per tile for the decision, and the softmax still under PV."""
    # (all exp2s on the SFU: every 16th at d = 128 would otherwise run on the FMA pipe)
    # (the loop's shape with P's sums unrounded: the rounding's conversions are the next test's)
    art = artifacts(d, causal,
                    name="k6:wait_pv_late=1,lazy_rescale=1,fma_exp2_every=0,round_p_sums=0")
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    assert "vote.sync.any" in art["ptx"]
    text = sass(art["cubin"])
    if d >= 192:
        # the late wait is pinned by a fence (pin_pv_wait), and ptxas lays the rare rescale
        # branch (its own wait) out in front of the exp2s: count up to the fenced wait
        lines = text.splitlines()
        wait_qk = next(i for i, ln in enumerate(lines) if re.search(r"DEPBAR\.LE\s+gsb0,\s*0x1", ln))
        fenced = next(i for i in range(wait_qk, len(lines)) if "MEMBAR" in lines[i])
        assert sum("MUFU.EX2" in ln for ln in lines[wait_qk:fenced]) >= art["kernel"]["block_n"] // 2
    else:
        assert exp2_between_waits(text) >= art["kernel"]["block_n"] // 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_d256_rescales_lazily_with_rounded_sums(dtype):
    """d = 256's default (LAZY_RESCALE): O rescaled only where a row maximum grew by more than
    2^8 (one warp vote per tile), with P rounded to the input type before the row sums
    (`round_p_sums`): in the steady loop one more pair conversion per pair of P (the row sums'
    next to the PV operand's), widened back by a shift and a mask in bf16; the O rescale's
    multiplies only in the rare branch; no spills."""
    from hopper_attn.harness.sass_order import loop_body, loops
    art = artifacts(256, False, dtype=dtype)
    plain = artifacts(256, False, name="k6:round_p_sums=0", dtype=dtype)
    options = art["kernel"]["options"]
    assert options["lazy_rescale"] and options["round_p_sums"]
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    assert "vote.sync.any" in art["ptx"]
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


def test_lazy_rescale_defaults():
    """LAZY_RESCALE: d = 192 and 256 (both masks) rescale lazily with rounded sums in the
    pinned loop; d <= 128 keeps the eager step; an option that needs the eager step
    (exp_first, pv_wait_after, ...) turns the default off."""
    from hopper_attn import k6
    from hopper_attn.common.contract import Problem

    def options(d, causal, **kw):
        return k6.compile_kernel(Problem(1, 2, 1000, d, causal), **kw).describe()["options"]
    for d, causal in ((256, False), (256, True), (192, False), (192, True)):
        o = options(d, causal)
        assert o["lazy_rescale"] and o["round_p_sums"] and o["reverse_p"], (d, causal)
        assert not o["wait_pv_late"] and o["pin_pv_wait"], (d, causal)
    for d, causal in ((128, True), (128, False), (64, True)):
        o = options(d, causal)
        assert not o["lazy_rescale"] and not o["round_p_sums"], (d, causal)
    o = options(256, False, pv_wait_after=14, reverse_p=True)
    assert not o["lazy_rescale"] and o["pv_wait_after"] == 14
    o = options(256, False, lazy_rescale=False)
    assert not o["lazy_rescale"] and not o["round_p_sums"]


def test_pv_wait_first_given_keeps_pv_wait_after_off():
    """A caller's pv_wait_first turns PV_WAIT_AFTER's default off (the two cannot combine):
    d = 64 with a mask from 4k, where the default waits among the exp2s."""
    from hopper_attn import k6
    from hopper_attn.common.contract import Problem
    problem = Problem(1, 2, 4096, 64, True)
    assert k6.compile_kernel(problem).describe()["options"]["pv_wait_after"] > 0
    o = k6.compile_kernel(problem, pv_wait_first=1, wait_pv_late=False).describe()["options"]
    assert o["pv_wait_first"] == 1 and o["pv_wait_after"] == 0


@pytest.mark.parametrize("name", ["k6:wait_pv_late=0,pin_pv_wait=1,fma_exp2_every=0,pv_wait_after=0",
                                  "k7"])
def test_a_fence_pins_the_pv_wait(name):
    """Without the late wait, ptxas hoists the PV wait (`DEPBAR 0x0`) above the softmax; a
    memory fence in front of it (MEMBAR.ALL.CTA) keeps it where the source puts it, after
    every exp2 of the tile, in the same iteration (docs/k6.md "What the SASS says")."""
    plain = artifacts(128, False, name=name.split(":")[0] + ":wait_pv_late=0,pin_pv_wait=0" +
                      (",pv_wait_after=0" if name.startswith("k6") else ""))
    pinned = artifacts(128, False, name=name)
    conversion = "F2FP.SATFINITE.E4M3" if name == "k7" else "F2FP"
    assert exp2_between_waits(sass(plain["cubin"]), conversion) == 0
    # every exp2 of the tile before the wait (block_n / 2 per thread); with k7's fp16 scores
    # ptxas still moves a quarter of them (the second row's last pairs) past it
    share = 3 / 4 if pinned["kernel"]["options"].get("s_f16") else 1
    assert exp2_between_waits(sass(pinned["cubin"]), conversion) >= \
        pinned["kernel"]["block_n"] // 2 * share
    # (k7 at this length: once more in the narrow last tile after the loop, tail_n)
    tiles = 1 + bool(pinned["kernel"]["options"].get("tail_n"))
    assert count(pinned["ptx"], r"fence\.acq_rel\.cta") == tiles
    for fn in resource_usage(pinned["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


def test_d64_causal_192_rows_fit_with_one_limit_per_row():
    """Three consumer warpgroups (160 registers) at d = 64 with a causal mask spill with the
    two-compare mask (why k6 uses 128 rows there); with one key limit per row they fit."""
    art = artifacts(64, True, name="k6:block_m=192,mask_per_row=1")
    assert art["kernel"]["block_m"] == 192
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


def test_d64_causal_long_sequences_use_192_rows():
    from hopper_attn import k6
    from hopper_attn.common.contract import Problem
    short = k6.compile_kernel(Problem(1, 2, k6.LONG_CAUSAL_D64 - 1, 64, True))
    long = k6.compile_kernel(Problem(1, 2, k6.LONG_CAUSAL_D64, 64, True))
    longer = k6.compile_kernel(Problem(1, 2, k6.WG_CAUSAL_LIMIT[64], 64, True))
    assert short.describe()["block_m"] == 128 and long.describe()["block_m"] == 192
    # the PV wait in the iteration where each warpgroup stops at its own diagonal, after the
    # softmax (measured 2026-11-28, docs/k6.md "The PV wait before the exp2s"); from there
    # among the exp2s, with turns (2026-11-28, "Turns again at d = 64 with a mask")
    assert long.options["mask_per_row"] and not long.options["wait_pv_late"]
    assert long.options["wg_causal_limit"] and not long.options["pingpong"]
    assert long.options["pv_wait_after"] == 0
    assert longer.options["mask_per_row"] and not longer.options["wait_pv_late"]
    assert not longer.options["wg_causal_limit"] and longer.options["pingpong"]
    assert longer.options["pv_wait_after"] == k6.PV_WAIT_AFTER[(64, True)][0] == 4
    assert longer.options["opaque_p"]


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
    """d = 96, N >= LONG_D96: three consumer warpgroups on 192 x 96 tiles without turns
    (no mask), the PV wait pinned in place of the late one (causal); no spills (ptxas
    spill warnings are errors here)."""
    from hopper_attn import k6
    from hopper_attn.common.contract import Problem
    from hopper_attn.harness.compile_report import SPILLS_AS_ERRORS

    def build(seqlen, causal):
        return k6.compile_kernel(Problem(1, 2, seqlen, 96, causal),
                                 compile_options=SPILLS_AS_ERRORS)

    short, full, causal = build(k6.LONG_D96 - 1, False), build(k6.LONG_D96, False), \
        build(k6.LONG_D96, True)
    assert (short.describe()["block_m"], short.describe()["block_n"]) == (128, 128)
    kernel = full.describe()
    assert (kernel["block_m"], kernel["block_n"], kernel["consumer_warpgroups"]) == (192, 96, 3)
    assert not kernel["named_barriers"]["scheduler"]
    assert causal.options["wait_pv_late"] is False and causal.options["pin_pv_wait"]
    # shorter lengths whose last 192-row query tile leaves at most one warpgroup idle too
    assert [k6.d96_wide_tiles(n) for n in (512, 768, 1024, 1280, 1536, 1792)] == \
        [False, True, False, True, True, False]


def test_p_in_smem_option():
    """k6:p_in_smem=1 (not yet run on a GPU): P goes to O += P V through shared memory
    (stmatrix), so no WGMMA takes A from registers; a 128-thread barrier per warpgroup
    orders the P stores before the PV; FlashAttention-4's d = 96 tile, 192 x 144, then
    compiles without spills (it spills with P in registers)."""
    name = "k6:p_in_smem=1,block_m=192,block_n=144,wait_pv_late=0,mask_per_row=1"
    for causal in (False, True):
        art = artifacts(96, causal, name=name)
        for fn in resource_usage(art["cubin"]):
            assert fn["local"] == 0 and fn["stack"] == 0, fn
        assert count(art["ptx"], WGMMA) > 0 and count(art["ptx"], WGMMA_REG_A) == 0
        assert count(art["ptx"], r"stmatrix\.sync\.aligned") > 0
        assert re.search(r"bar\.sync\s+%r\d+,\s*128;", art["ptx"])
        assert art["kernel"]["smem_bytes"] <= 227 * 1024


def test_own_o_buffer_option():
    """k6:own_o_buffer=1 (the default at d = 128 and with a mask at d = 64, 96): O staged in a buffer of its own, Q's size
    more shared memory, no spills; refused where it does not fit (d = 256)."""
    for d in (64, 128):
        plain, own = (artifacts(d, True, name="k6:own_o_buffer=0"),
                      artifacts(d, True, name="k6:own_o_buffer=1"))
        for fn in resource_usage(own["cubin"]):
            assert fn["local"] == 0 and fn["stack"] == 0, fn
        extra = own["kernel"]["block_m"] * d * 2
        assert own["kernel"]["smem_bytes"] - plain["kernel"]["smem_bytes"] >= extra
    from hopper_attn import k6
    from hopper_attn.common.contract import Problem
    with pytest.raises(ValueError, match="shared memory"):
        k6.compile_kernel(Problem(1, 2, 128, 256, False), own_o_buffer=True)


@pytest.mark.parametrize("d,causal", [(64, False), (256, True)])
def test_direct_store_option(d, causal):
    """k6:direct_store=1: O from registers straight to global memory (k7's option, shared in
    k5): no TMA store and no O buffer, Q released before the epilogue; no spills. Refused
    together with own_o_buffer (measured: -1 to -12% at d = 192 / 256, docs/k6.md)."""
    art = artifacts(d, causal, name="k6:direct_store=1")
    text = sass(art["cubin"])
    assert "UTMASTG" not in text and "STG.E" in text
    assert not art["kernel"]["options"]["own_o_buffer"]
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    from hopper_attn import k6
    from hopper_attn.common.contract import Problem
    with pytest.raises(ValueError, match="own_o_buffer"):
        k6.compile_kernel(Problem(1, 2, 128, 128, False), direct_store=True, own_o_buffer=True)


@pytest.mark.parametrize("d,causal", [(64, False), (96, False), (128, True)])
def test_skip_idle_wgs_option(d, causal):
    """k6:skip_idle_wgs=1: a consumer warpgroup whose rows all lie past the sequence's end
    runs `idle_loop` (ring waits and releases, turns; no GEMM, no softmax), chosen once per
    work item, so the compute loop is the default's: the same WGMMA groups and exp2 count,
    within two instructions, no spills. Refused with exp_turns (not measured yet)."""
    from hopper_attn.harness.sass_order import loop_body, loops
    plain, skip = artifacts(d, causal), artifacts(d, causal, name="k6:skip_idle_wgs=1")
    a, b = sass(plain["cubin"]), sass(skip["cubin"])
    assert wgmma_groups(a) == wgmma_groups(b) and a.count("MUFU.EX2") == b.count("MUFU.EX2")
    assert abs(len(loop_body(a, loops(a)[0])) - len(loop_body(b, loops(b)[0]))) <= 2
    for fn in resource_usage(skip["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    from hopper_attn import k6
    from hopper_attn.common.contract import Problem
    with pytest.raises(ValueError, match="skip_idle_wgs"):
        k6.compile_kernel(Problem(1, 2, 128, d, causal), skip_idle_wgs=True, exp_turns=True)


@pytest.mark.parametrize("d,causal", [(64, False), (128, True), (192, False)])
def test_s_ahead_loop(d, causal):
    """k6:s_ahead=1 (QK one tile ahead into a second S accumulator, its own defaults: no
    turns, 64-key tiles; docs/k7.md "QK one tile ahead"): each tile of the two per iteration
    issues QK and PV, runs all its exp2s, then its one wait; no serialization, no spills."""
    art = artifacts(d, causal, name="k6:s_ahead=1")
    text = sass(art["cubin"])
    from hopper_attn.harness.sass_order import loops
    events = loops(text)[-1][2]
    waits = [i for i, e in enumerate(events) if e.startswith("DEPBAR")]
    assert [events[i] for i in waits] == ["DEPBAR 0x0", "DEPBAR 0x0"]
    for i in waits:
        assert events[i - 2].startswith("EX2 x") and events[i - 1] == "MEMBAR x2"
    assert text.count("WARPGROUP.DEPBAR") <= 6
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


def test_s_ahead_needs_its_loop_alone():
    """s_ahead replaces the whole loop: refused with the options that change that loop, and
    at d = 256, where no kv tile leaves room for a second S."""
    from hopper_attn import k6
    from hopper_attn.common.contract import Problem, UnsupportedProblem
    with pytest.raises(ValueError, match="s_ahead"):
        k6.compile_kernel(Problem(1, 2, 128, 128, False), s_ahead=True, pingpong=True)
    with pytest.raises(ValueError, match="s_ahead"):
        k6.compile_kernel(Problem(1, 2, 128, 64, False), s_ahead=True, lazy_rescale=True)
    with pytest.raises(UnsupportedProblem, match="s_ahead"):
        k6.compile_kernel(Problem(1, 2, 128, 256, False), s_ahead=True)


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
    """compile_kernel's defaults follow k6.LOAD_ORDER (measured round-robin, docs/k6.md)."""
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
    (k6.SPIN_WAITS): every ring wait is `mbarrier.try_wait` without a suspend-time hint, in a
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
    from hopper_attn.common.contract import Problem
    assert artifacts(64, False)["kernel"]["named_barriers"]["scheduler"]
    for causal in (False, True):
        assert not artifacts(128, causal)["kernel"]["named_barriers"]["scheduler"]
    long_causal = k6.compile_kernel(Problem(1, 2, k6.LONG_CAUSAL_D64, 64, True)).describe()
    assert long_causal["block_m"] == 192 and not long_causal["named_barriers"]["scheduler"]
    # from 4k, with the PV wait among the exp2s, turns again (+1.4-3.8% on the H200)
    longer = k6.compile_kernel(Problem(1, 2, k6.WG_CAUSAL_LIMIT[64], 64, True)).describe()
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
    """k6:longest_first=1 (the dynamic schedule's items head group by head group): no
    spills, and the group's row budget (LONGEST_FIRST's MiB of K and V) in the PTX."""
    from hopper_attn import k6
    art = artifacts(d, True, "k6:longest_first=1")
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    rows = (k6.LONGEST_FIRST[d][0] << 20) // (d * 4)
    assert count(art["ptx"], rf"div\.s32\s+%r\d+,\s*{rows},") >= 1
    assert count(artifacts(d, True)["ptx"], rf"div\.s32\s+%r\d+,\s*{rows},") == 0


def test_longest_first_items_decoded_once():
    """In the head-group order the producer warp decodes each work item and hands (query
    tile, head, batch, valid) to the consumers in one 16-byte SMEM slot; in the head-by-head
    order it hands over the item's index, which every consumer decodes itself."""
    grouped = artifacts(128, True, "k6:longest_first=1")["ptx"]
    plain = artifacts(128, True, "k6:longest_first=0")["ptx"]
    assert count(grouped, r"st\.shared\.v4\.b32") == count(grouped, r"ld\.shared\.v4\.b32") == 1
    assert count(plain, r"st\.shared\.v4\.b32") == count(plain, r"ld\.shared\.v4\.b32") == 0
    assert count(plain, r"ld\.shared\.b32") == 1


def test_longest_first_by_sequence_length():
    """On by default with a mask inside the query lengths where it was measured to pay
    (LONGEST_FIRST: 1k-8k at d = 128, 2k-16k at d = 256, 4k-16k at d = 64); off without a
    mask and at the head dims not measured."""
    from hopper_attn import k6
    from hopper_attn.common.contract import Problem
    on = lambda n, d, causal=True: k6.compile_kernel(Problem(1, 2, n, d, causal)).options[
        "longest_first"]
    for d, (_, low, high) in k6.LONGEST_FIRST.items():
        assert on(low, d) and on(high, d) and not on(low - 1, d) and not on(high + 1, d)
        assert not on(low, d, causal=False)
    assert not on(4096, 96) and not on(4096, 192)


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
    """v_release_last (V_RELEASE_LAST, and d = 64 on 192-row tiles): a tile hands V_{n-1}'s
    stage back after P's conversion with one predicated arrive (elect.sync and n > 0 as
    predicates, no `if`), so the exp2s and P's conversions share one basic block; where the
    PV wait is not late (d = 64), ptxas then spreads the conversions among the exp2s, as in
    FlashAttention-4's loop. (early_q_release off: its Q release is such an arrive too.)"""
    art = artifacts(d, causal, name=name + ":early_q_release=0")
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
    """pv_wait_after (PV_WAIT_AFTER: d = 128): a memory fence after the tile's 7th exp2 keeps
    the PV wait, written after the softmax, from rising above it, and the row maxima come
    first, so ptxas spreads O's 64 multiplies and P's 32 conversions over the exp2s that
    follow the wait (FlashAttention-4's order) instead of running them at the loop's top."""
    from hopper_attn import k6
    from hopper_attn.common.contract import Problem
    art = artifacts(128, False)
    assert art["kernel"]["options"]["pv_wait_after"] == 7
    assert art["kernel"]["options"]["v_release_last"] and not art["kernel"]["options"]["wait_pv_late"]
    assert count(art["ptx"], r"fence\.acq_rel\.cta") == 1
    text = sass(art["cubin"])
    assert exp2_between_waits(text) >= 7
    tail = _tile_after_pv_wait(text)
    assert sum("MUFU.EX2" in ln for ln in tail) >= 16
    assert sum("F2FP" in ln for ln in tail) >= 16
    assert sum(re.search(r"\bFMUL\b", ln) is not None for ln in tail) >= 48
    # the late wait (before): the multiplies and conversions follow the last exp2
    late = _tile_after_pv_wait(sass(artifacts(128, False, name="k6:pv_wait_after=0")["cubin"]))
    assert sum("F2FP" in ln for ln in late) == 0
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    # with a mask from PV_WAIT_AFTER's shortest query length on, with V released last
    short = k6.compile_kernel(Problem(1, 2, 2047, 128, True)).options
    long = k6.compile_kernel(Problem(1, 2, 2048, 128, True)).options
    assert short["pv_wait_after"] == 0 and not short["v_release_last"]
    assert long["pv_wait_after"] == 7 and long["v_release_last"]


def _pv_groups(text: str) -> list:
    """Sizes of the WGMMA groups of O += P V (A in registers) in the SASS, in code order."""
    return [size for form, _, size in wgmma_groups(text) if form == "rs"]


@pytest.mark.parametrize("name,d,causal,split", [
    ("k6", 64, False, False), ("k6", 96, False, False), ("k6", 128, False, False),
    ("k6", 128, True, False), ("k6", 192, False, False), ("k6", 192, True, False),
    ("k6", 256, False, False), ("k6", 256, True, False),           # PINNED_IN_ITERATION
    ("k6:wait_pv_late=1,reverse_p=0,peel_first=0", 192, False, True),  # the defaults before
    ("k6:wait_pv_late=1,reverse_p=0,peel_first=0", 256, False, True),
    ("k6:wait_pv_late=1,reverse_p=0,peel_first=0", 256, True, True),
    ("k6:wait_pv_late=1,reverse_p=0", 256, False, False),           # peel_first keeps PV whole
    ("k6:reverse_p=1,pv_wait_after=8", 256, False, False),
    ("k6:reverse_p=1,pv_wait_after=8", 256, True, False),
    ("k6:reverse_p=1,pv_wait_after=10", 192, False, False),
    ("k6:block_m=192,block_n=96,pingpong=0", 96, False, True),      # d = 96 from N = 2k
    ("k6:block_m=192,block_n=96,pingpong=0,reverse_p=1,pv_wait_after=8", 96, False, False),
    ("k6:block_m=192,block_n=96,pingpong=0,reverse_p=1,wait_pv_late=0,pin_pv_wait=1", 96,
     False, False),
    ("k6:rescale_before_pv=1,reverse_p=1,pv_wait_after=8", 256, False, False)])
def test_pv_wgmma_groups(name, d, causal, split):
    """O += P V is one WGMMA group (block_n / 16 HGMMAs, one `gsb0`), so that the loop's
    `wait_group(1)` waits for QK only. With kv tiles of 80 or 112 keys (d = 256, 192) ptxas
    builds P's last k16 slice in other registers and moves it in after the WGMMA fence, and
    splits the loop's PV into one group per slice: `wait_group(1)` then waits for all of PV but
    its last slice. Converting P last slice first (`reverse_p`) with the PV wait in the
    iteration (`pv_wait_after`, or pinned after the softmax: the default at d = 192 and 256
    since it measured +0.4-5.5%) keeps every PV whole (docs/k6.md "One WGMMA group per P
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
        assert options["reverse_p"] and not options["wait_pv_late"] and options["pin_pv_wait"]
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


@pytest.mark.parametrize("name,d,causal", [
    ("k6:pv_wait_after=7", 64, False),
    ("k6:pv_wait_after=7,block_m=192,mask_per_row=1,wait_pv_late=0,pingpong=0", 64, True),
    ("k6:block_m=192,block_n=96,pingpong=0,reverse_p=1,pv_wait_after=8", 96, False)])
def test_exp2s_computed_once(name, d, causal):
    """On 192-row tiles, with the fence of pv_wait_after in the softmax, the compiler computes
    part of P's exp2s a second time for P's conversion after the fence (89 instead of 66
    `ex2` per tile at d = 64, already in the PTX); `opaque_p` passes each exp2 result through
    an opaque move and the kernel has one per score again, plus one alpha per row (the
    default there since 2026-11-28)."""
    plain = artifacts(d, causal, name=name + ",opaque_p=0")
    opaque = artifacts(d, causal, name=name)
    assert opaque["kernel"]["options"]["opaque_p"]
    once = opaque["kernel"]["block_n"] // 2 + 2
    assert count(plain["ptx"], r"ex2\.approx") > once
    assert count(opaque["ptx"], r"ex2\.approx") == once
    assert sass(opaque["cubin"]).count("MUFU.EX2") == once
    for fn in resource_usage(opaque["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


@pytest.mark.parametrize("d,causal", [(256, False), (256, True), (192, False)])
def test_o_rescaled_under_qk(d, causal):
    """rescale_before_pv (with pv_wait_after): O's d / 2 multiplies per thread run between
    the QK group and the PV issue, as in FlashAttention-4 at d > 128, and the only wait there
    is the free `wait_group(1)` (QK alone in flight), not one for QK."""
    art = artifacts(d, causal,
                    name="k6:rescale_before_pv=1,reverse_p=1,pv_wait_after=8,peel_first=0")
    lines = sass(art["cubin"]).splitlines()
    qk_end = next(i for i, ln in enumerate(lines)
                  if "HGMMA" in ln and "gsb0" in ln and re.search(r"HGMMA\.\S+ R\d+, gdesc", ln))
    pv = next(i for i in range(qk_end, len(lines)) if re.search(r"HGMMA\.\S+ R\d+, R", lines[i]))
    between = lines[qk_end:pv]
    assert sum(re.search(r"\bFMUL\b", ln) is not None for ln in between) >= d // 2
    assert not any(re.search(r"DEPBAR\.LE\s+gsb0,\s*0x0", ln) for ln in between)
    from hopper_attn import k6
    from hopper_attn.common.contract import Problem
    with pytest.raises(ValueError, match="pv_wait_after"):
        k6.compile_kernel(Problem(1, 2, 128, d, causal), rescale_before_pv=True, pv_wait_after=0,
                          wait_pv_late=True)


def test_defer_store_wait():
    """O's own buffer without a mask at d = 64 and 96 (LOAD_ORDER, measured 2026-11-26), and
    where the warpgroups take turns the epilogue's TMA store not waited for until the next
    item's epilogue (`defer_store_wait`): in the PTX the first read-wait comes before the store (the previous
    item's), the last after the loop; the plain epilogue waits right after its store. Refused
    without O's own buffer."""
    import re
    store = re.compile(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared")
    wait = "cp.async.bulk.wait_group.read"
    # (wg_store off: where it is on, each warpgroup defers its own store's wait)
    deferred = artifacts(64, False, "k6:wg_store=0")
    plain = artifacts(128, False, "k6:wg_store=0")
    for art in (deferred, plain, artifacts(96, False)):
        assert art["kernel"]["options"]["own_o_buffer"], art["kernel"]["options"]
    assert deferred["kernel"]["options"]["defer_store_wait"]
    assert not plain["kernel"]["options"]["defer_store_wait"]       # no turns at d = 128
    assert artifacts(64, True, "k6:wg_store=0")["kernel"]["options"]["defer_store_wait"]
    ptx = deferred["ptx"]
    first_store = store.search(ptx).start()
    assert ptx.index(wait) < first_store < ptx.rindex(wait)
    ptx = plain["ptx"]
    assert store.search(ptx).start() < ptx.index(wait)
    for fn in resource_usage(deferred["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    from hopper_attn import k6
    from hopper_attn.common.contract import Problem
    with pytest.raises(ValueError, match="defer_store_wait"):
        k6.compile_kernel(Problem(1, 2, 128, 256, False), defer_store_wait=True)


def test_two_ctas_per_sm():
    """k6:block_m=64,ctas_per_sm=2: two CTAs of one consumer warpgroup on every SM (128
    registers a thread at entry, 32 / 224 after setmaxnreg, twice the persistent grid), no
    spills; refused with more than one consumer warpgroup, or where two CTAs' shared memory
    does not fit (measured slower: docs/k6.md)."""
    art = artifacts(64, True, name="k6:block_m=64,ctas_per_sm=2")
    kernel = art["kernel"]
    assert (kernel["entry_regs_max"], kernel["producer_regs"], kernel["consumer_regs"]) == \
        (128, 32, 224)
    assert kernel["ctas_per_sm"] == 2 and kernel["persistent_ctas"] == 2 * 132
    for fn in resource_usage(art["cubin"]):
        assert fn["registers"] <= 128 and fn["local"] == 0 and fn["stack"] == 0, fn
    from hopper_attn import k6
    from hopper_attn.common.contract import Problem
    with pytest.raises(ValueError, match="consumer warpgroups"):
        k6.compile_kernel(Problem(1, 2, 128, 64, False), block_m=128, ctas_per_sm=2)
    with pytest.raises(ValueError, match="shared memory"):
        k6.compile_kernel(Problem(1, 2, 128, 128, False), block_m=64, ctas_per_sm=2)


def test_item_end_options(monkeypatch):
    """A work item's end (ITEM_END, measured 2026-11-26, docs/k6.md "Where a work item ends"):
    with early_q_release the loop hands Q's stage back itself (a third predicated mbarrier
    arrive in the loop, next to K's and V's); with wg_store each consumer warpgroup stores
    its own rows on a barrier of its 128 threads, and no barrier of all consumer threads is
    left (at d >= 192 into its own rows of Q's buffer). Defaults per ITEM_END; early_q_release
    is refused without O's own buffer, wg_store with direct_store."""
    from hopper_attn.harness.sass_order import loop_body, loops

    def loop_arrives(art):
        text = sass(art["cubin"])
        return sum("SYNCS.ARRIVE" in line for line in loop_body(text, loops(text)[0]))

    new, old = artifacts(64, False), artifacts(64, False, "k6:early_q_release=0,wg_store=0")
    assert new["kernel"]["options"]["early_q_release"] and new["kernel"]["options"]["wg_store"]
    assert loop_arrives(new) == loop_arrives(old) + 1 == 3
    all_consumers = "bar.sync \t1, 384;"
    assert all_consumers in old["ptx"] and all_consumers not in new["ptx"]
    assert re.search(r"bar\.sync \t%r\d+, 128;", new["ptx"])
    for art in (new, artifacts(128, True), artifacts(96, True)):
        for fn in resource_usage(art["cubin"]):
            assert fn["local"] == 0 and fn["stack"] == 0, fn
    from hopper_attn import k6
    from hopper_attn.common.contract import Problem
    options = {}
    monkeypatch.setattr(k6, "compile_attention", lambda spec, cls, problem, opts, **kw: opts)
    for d, causal, n, on in [(64, False, 1024, (True, True)), (64, False, 4096, (True, True)),
                             (64, True, 4096, (True, True)), (64, True, 16384, (True, True)),
                             (96, True, 8192, (False, False)), (128, True, 16384, (True, True)),
                             (256, False, 16384, (False, True)), (256, True, 16384, (False, True)),
                             (192, False, 8192, (False, False))]:
        options = k6.compile_kernel(Problem(1, 2, n, d, causal))
        assert (options["early_q_release"], options["wg_store"]) == on, (d, causal, n)
        assert not (options["wg_store"] and options["defer_store_wait"])
    monkeypatch.undo()
    # d >= 192: O staged in Q's buffer, each warpgroup's rows in its own rows of Q
    d256 = artifacts(256, False)
    assert d256["kernel"]["options"]["wg_store"] and not d256["kernel"]["options"]["own_o_buffer"]
    assert "bar.sync \t1, 256;" not in d256["ptx"]
    with pytest.raises(ValueError, match="direct_store"):
        k6.compile_kernel(Problem(1, 2, 128, 64, False), wg_store=True, direct_store=True)
    with pytest.raises(ValueError, match="own_o_buffer"):
        k6.compile_kernel(Problem(1, 2, 128, 256, False), early_q_release=True)


def test_fast_divmod_decode(monkeypatch):
    """FAST_DIVMOD (measured 2026-11-26): at d = 64 without a mask the static schedule decodes
    its work items with the library's FastDivmod (magic numbers computed
    once per CTA: the two 64-bit divisions), not with integer divisions per item; elsewhere
    the divisions stay (and the kernel with them)."""
    fast, plain = artifacts(64, False), artifacts(64, False, "k6:fast_divmod=0")
    assert fast["kernel"]["options"]["fast_divmod"]
    assert not plain["kernel"]["options"]["fast_divmod"]

    def divisions(art):
        return len(re.findall(r"div\.s32\s", art["ptx"])), len(re.findall(r"div\.u64\s", art["ptx"]))

    assert divisions(plain) == (8, 0)
    assert divisions(fast) == (2, 2)
    from hopper_attn import k6
    from hopper_attn.common.contract import Problem
    monkeypatch.setattr(k6, "compile_attention", lambda spec, cls, problem, opts, **kw: opts)
    for d, causal, n, on in [(64, False, 1024, True), (64, False, 16384, True),
                             (64, True, 1024, False), (128, False, 1024, False),
                             (96, False, 1024, False)]:
        assert k6.compile_kernel(Problem(1, 2, n, d, causal))["fast_divmod"] == on, (d, causal, n)


def test_wg_causal_limit(monkeypatch):
    """WG_CAUSAL_LIMIT (measured 2026-11-26, docs/k6.md "Each warpgroup's own diagonal"): with
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
    from hopper_attn.common.contract import Problem
    with pytest.raises(ValueError, match="wg_causal_limit"):
        k6.compile_kernel(Problem(1, 2, 128, 256, True), wg_causal_limit=True, pingpong=True)
    monkeypatch.setattr(k6, "compile_attention", lambda spec, cls, problem, opts, **kw: opts)
    for d, causal, n, want in [(64, True, 1024, True), (64, True, 2048, True),
                               (64, True, 4096, False), (64, True, 512, False),  # 128 rows, turns
                               (256, True, 16384, True), (256, False, 1024, False),
                               (128, True, 1024, False), (192, True, 1024, False)]:
        assert k6.compile_kernel(Problem(1, 2, n, d, causal))["wg_causal_limit"] == want, \
            (d, causal, n)


def test_stream_k(monkeypatch):
    """STREAM_K (measured 2026-11-26, docs/k6.md "The static schedule's tail as stream-K"):
    without a mask, at d = 128 from 8k queries and d = 192 from 4k, the static schedule's last rounds are
    pieces of items; a split item's first piece leaves its state in the workspace (the
    kernel's counter argument, `stream_k_words` int32) and raises a flag with a release
    store, the last piece waits for it with acquire loads and merges. No spills; refused
    with a mask."""
    from hopper_attn import k6
    from hopper_attn.common.contract import Problem
    art = artifacts(128, False, "k6:stream_k=1")
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    assert "st.release.gpu" in art["ptx"] and "ld.acquire.gpu" in art["ptx"]
    assert "st.release.gpu" not in artifacts(128, False)["ptx"]
    kernel = k6.FlashAttentionK6(128, False, persistent=True, stream_k=True)
    assert kernel.stream_k_words() > 133 * 256 * (64 + 4)
    assert k6.FlashAttentionK6(128, False, persistent=True).stream_k_words() == 0
    with pytest.raises(ValueError, match="stream_k"):
        k6.compile_kernel(Problem(1, 2, 128, 128, True), stream_k=True)
    monkeypatch.setattr(k6, "compile_attention", lambda spec, cls, problem, opts, **kw: opts)
    for d, causal, n, want in [(128, False, 8192, True), (128, False, 16384, True),
                               (128, False, 4096, False), (128, True, 16384, False),
                               (256, False, 16384, False), (64, False, 16384, False),
                               (192, False, 4096, True), (192, False, 2048, False)]:
        assert k6.compile_kernel(Problem(1, 2, n, d, causal))["stream_k"] == want, (d, causal, n)


def test_no_tail_test_for_whole_kv_tiles(monkeypatch):
    """NO_TAIL_TEST (measured 2026-11-26, docs/k6.md "A loop without the tail test"): at
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
    assert events == events_tail
    masks = [sum(bool(re.match(r"FSEL\b.*-INF", t)) for t in b) for b in (body, body_tail)]
    assert masks[0] == 0 and masks[1] >= 32, masks        # 40 scores a thread
    assert len(body) < len(body_tail)
    with pytest.raises(UnsupportedProblem, match="multiple of the kv tile"):
        k6.compile_kernel(Problem(1, 2, 4096, 256, False), kv_tail=False)
    monkeypatch.setattr(k6, "compile_attention", lambda spec, cls, problem, opts, **kw: opts)
    for d, causal, n, nk, want in [(256, False, 4000, 0, False), (256, False, 4096, 0, True),
                                   (256, False, 1000, 16000, False), (256, True, 4000, 0, True),
                                   (128, False, 4096, 0, True), (64, False, 4096, 0, False),
                                   (64, False, 4000, 0, True), (64, True, 4096, 0, True),
                                   (192, False, 4032, 0, True)]:
        problem = Problem(1, 2, n, d, causal, seqlen_k=nk)
        assert k6.compile_kernel(problem)["kv_tail"] == want, (d, causal, n, nk)


def _exp2s(events):
    """How many MUFU.EX2 a list of `sass_order` loop events holds ('EX2 x64' is 64)."""
    return sum(int(e.split(" x")[1]) if " x" in e else 1 for e in events if e.startswith("EX2"))


def test_pv_wait_before_the_exp2s_at_d64():
    """PV_WAIT_FIRST (d = 64 without a mask, docs/k6.md "The PV wait before the exp2s"): the
    wait for PV_{n-1} and a memory fence right after the row maxima, so the tile's exp2s of P
    (block_n / 2 a thread) all run after it; only the two rows' alphas may come first. The
    default at whole kv tiles drops the tail test with it. Without the fence, and without the
    test's branch, ptxas waits among the exp2s (what made the loop without the test 5% slower
    alone)."""
    from hopper_attn.harness import sass_order
    art = artifacts(64, False)
    options, per_thread = art["kernel"]["options"], art["kernel"]["block_n"] // 2
    assert options["pv_wait_first"] == 1 and not options["kv_tail"]
    (loop,) = sass_order.loops(sass(art["cubin"]))
    events = loop[2]
    fence = events.index("MEMBAR")
    assert any(e.startswith("DEPBAR 0x0") for e in events[events.index("DEPBAR 0x1"):fence])
    assert _exp2s(events[:fence]) <= 2 and _exp2s(events[fence:]) == per_thread
    plain = artifacts(64, False, "k6:pv_wait_first=0,kv_tail=0")
    (loop,) = sass_order.loops(sass(plain["cubin"]))
    events = loop[2]
    last_wait = max(i for i, e in enumerate(events) if e.startswith("DEPBAR 0x0"))
    assert "MEMBAR" not in events and _exp2s(events[:last_wait]) > 2
    from hopper_attn import k6
    from hopper_attn.common.contract import Problem
    with pytest.raises(ValueError, match="pv_wait_first: not with lazy_rescale"):
        k6.compile_kernel(Problem(1, 2, 128, 64), pv_wait_first=1, lazy_rescale=True)


def test_split_mask_loops(tmp_path):
    """`split_mask` (measured 2026-11-28, off): an item's kv tiles in two loops, the first
    without any mask code or test, the second masking every tile; the same WGMMA groups
    (one per GEMM) and exp2s in both, no spills."""
    from hopper_attn.common.contract import Problem
    from hopper_attn.harness import registry, sass_order
    from hopper_attn.harness.compile_report import resource_usage
    handle = registry.get("k6:split_mask=1").compile(
        Problem(1, 2, 16384, 64, True), compile_options=f"--keep-cubin --dump-dir={tmp_path}")
    assert handle.describe()["options"]["split_mask"]
    cubin = bytes(handle.compiled.__cubin__)
    for fn in resource_usage(cubin):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    text = sass(cubin)
    plain, masked = sass_order.loops(text)
    assert plain[2] == masked[2]
    masks = [sum(bool(re.match(r"FSEL\b.*-INF", t)) for t in sass_order.loop_body(text, lp))
             for lp in (plain, masked)]
    assert masks[0] == 0 and masks[1] >= 64, masks


def test_first_kv_tile_peeled(monkeypatch):
    """PEEL_FIRST (measured 2026-11-26, docs/k6.md "The first kv tile before the loop"): at
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
    assert [e for e in loop_on[2] if "DEPBAR" not in e] == \
        [e for e in loop_off[2] if "DEPBAR" not in e]
    branches = [sum(t.split()[0 if t[0] != "@" else 1].startswith("BRA") for t in body)
                for body in (body_on, body_off)]
    assert branches[0] < branches[1], branches
    assert a.count("HGMMA") == b.count("HGMMA") + 16        # tile 0's QK (it has no PV)
    assert a.count("WARPGROUP.ARRIVE") <= b.count("WARPGROUP.ARRIVE") + 2
    for fn in resource_usage(on["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    monkeypatch.setattr(k6, "compile_attention", lambda spec, cls, problem, opts, **kw: opts)
    for d, causal, n, want in [(256, False, 4096, True), (256, True, 4096, True),
                               (256, True, 4000, True), (256, False, 4000, False),
                               (192, False, 4096, True), (192, True, 1024, True),
                               (128, False, 4096, False), (64, True, 4096, False),
                               (96, False, 4096, False)]:
        assert k6.compile_kernel(Problem(1, 2, n, d, causal))["peel_first"] == want, \
            (d, causal, n)


@pytest.mark.parametrize("d,causal", [(64, False), (64, True), (128, False)])
def test_exp_first_exp2s_do_not_wait_for_the_row_max(d, causal):
    """`exp_first` (measured 2026-11-26, docs/k6.md "The exp2s before the row maximum"; off
    by default): in the main loop the first MUFU.EX2 comes before the row maxima's quad
    shuffles (SHFL.BFLY), where the default's come after them; no WGMMA serialized (as many
    fences, one or two more waits), no spills; the rare recomputation of S reads q and k from
    global memory (LDG)."""
    from hopper_attn.harness import sass_order
    art, base = artifacts(d, causal, "k6:exp_first=1"), artifacts(d, causal)
    assert art["kernel"]["options"]["exp_first"]

    def first_exp2_and_shuffle(cubin):
        text = sass(cubin)
        bodies = [sass_order.loop_body(text, found) for found in sass_order.loops(text)]
        body = max(bodies, key=lambda b: sum("MUFU.EX2" in t for t in b))
        return (next(i for i, t in enumerate(body) if "MUFU.EX2" in t),
                next(i for i, t in enumerate(body) if "SHFL.BFLY" in t))

    exp2, shuffle = first_exp2_and_shuffle(art["cubin"])
    assert exp2 < shuffle, (exp2, shuffle)
    exp2, shuffle = first_exp2_and_shuffle(base["cubin"])
    assert shuffle < exp2, (exp2, shuffle)
    a, b = sass(art["cubin"]), sass(base["cubin"])
    assert a.count("WARPGROUP.ARRIVE") == b.count("WARPGROUP.ARRIVE")
    assert a.count("WARPGROUP.DEPBAR") <= b.count("WARPGROUP.DEPBAR") + 2
    assert a.count("LDG") > b.count("LDG") + 64
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


def test_exp_first_options():
    """`exp_first` takes lazy rescaling's place (its reference maxima): not with lazy_rescale,
    exp_turns, pv_wait_after or rescale_before_pv; its threshold reaches the kernel."""
    from hopper_attn.k6 import FlashAttentionK6
    for clash in ({"lazy_rescale": True}, {"exp_turns": True}, {"pv_wait_after": 7},
                  {"rescale_before_pv": True}):
        with pytest.raises(ValueError, match="exp_first"):
            FlashAttentionK6(64, False, exp_first=True, **clash)
    kernel = FlashAttentionK6(64, False, exp_first=True, rescale_threshold_log2=1.0)
    assert kernel.exp_first and kernel.lazy_rescale and kernel.rescale_threshold_log2 == 1.0



def test_stale_reference_error_emulation():
    """tools/stale_max_error.py (docs/k6.md "The exp2s before the row maximum"): on the CPU,
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


def test_cluster_multicast(monkeypatch):
    """k6's option `cluster=2` (docs/k6.md "K and V multicast to two CTAs"): without a mask,
    two CTAs of a cluster take neighbouring query tiles of one head and each loads half of
    every K/V tile, multicast into both shared memories (`multicast::cluster` TMA loads, no
    plain ones for K/V); a stage is released into both CTAs' empty barriers (`mapa` +
    remote `mbarrier.arrive`); barrier.cluster publishes the barriers' init. No spills.
    With a mask the option is ignored (cluster 1), stream-K is off with it, and other
    schedules refuse it."""
    from hopper_attn import k6
    from hopper_attn.common.contract import Problem
    multicast = (r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global\S*"
                 r"\.multicast::cluster")
    art = artifacts(128, False, "k6:cluster=2")
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    assert count(art["ptx"], multicast) >= 4
    assert count(art["ptx"], r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global") == 2  # Q
    assert "mapa.shared::cluster" in art["ptx"] and "barrier.cluster.arrive" in art["ptx"]
    assert re.search(r"mbarrier\.arrive\S*\.shared::cluster\.b64", art["ptx"])
    assert art["kernel"]["cluster"] == 2
    assert count(artifacts(128, False)["ptx"], multicast) == 0
    control = artifacts(128, False, "k6:cluster=2,multicast=0")      # clusters, no sharing
    assert count(control["ptx"], multicast) == 0 and "barrier.cluster.arrive" in control["ptx"]
    assert control["kernel"]["cluster"] == 2 and control["kernel"]["kv_multicast"] == 1
    monkeypatch.setattr(k6, "compile_attention", lambda spec, cls, problem, opts, **kw: opts)
    assert k6.compile_kernel(Problem(1, 2, 4096, 128, True), cluster=2)["cluster"] == 1
    opts = k6.compile_kernel(Problem(1, 2, 16384, 128, False), cluster=2)
    assert opts["cluster"] == 2 and not opts["stream_k"]
    for bad in ({"cluster": 3}, {"cluster": 2, "stream_k": True},
                {"cluster": 2, "persistent": False}):
        with pytest.raises(ValueError, match="cluster"):
            k6.FlashAttentionK6(128, False, **bad)
    with pytest.raises(ValueError, match="cluster"):
        k6.FlashAttentionK6(128, True, cluster=2)
