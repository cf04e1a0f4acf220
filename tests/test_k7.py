"""k7 (FP8): compiles for sm_90a without spills, and its PTX shows the stage's idea: both
GEMMs are e4m3 WGMMAs (k32), P is converted to e4m3 in registers, V^T tiles come straight
from the TMA (V packed sequence-major by the quantizer). Plus the host pieces:
the quantizer and V's packing, the input checks, and the FP8 reference emulation that k7's
error is judged against."""

import re

import pytest
import torch

from hopper_attn.common.contract import Problem, check_descales, check_tensors
from hopper_attn.harness.compile_report import resource_usage
from ptx import TMA_STORE, compiled, count

CONFIGS = [(64, False), (64, True), (128, False), (128, True), (256, False), (256, True)]
# an e4m3 WGMMA's N; its accumulator: fp32, or fp16 for S with `s_f16`
E4M3_WGMMA = r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f(?:32|16)\.e4m3\.e4m3"


def p_conversions(art) -> int:
    """P's e4m3 pair conversions in the PTX: from fp32 pairs, or from fp16 pairs with fp16
    scores (`s_f16`)."""
    source = "f16x2" if art["kernel"]["options"]["s_f16"] else "f32"
    return count(art["ptx"], rf"cvt\.rn\.satfinite\.e4m3x2\.{source}")


@pytest.mark.compile
@pytest.mark.parametrize("d,causal", CONFIGS)
def test_no_spills_and_both_gemms_in_fp8(d, causal):
    art = compiled("k7", d, causal)
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    ptx, block_n = art["ptx"], art["kernel"]["block_n"]
    # S = Q K^T (n = block_n) and O += P V (n = d), no 16-bit operands; S accumulated in
    # fp16 where POLICY has it (d = 128, d = 256 without a mask), else fp32
    assert {int(n) for n in re.findall(E4M3_WGMMA, ptx)} == {block_n, d}
    assert not re.search(r"wgmma\S*\.(bf16|f16)\.(bf16|f16)", ptx)
    s_f16 = art["kernel"]["options"]["s_f16"]
    assert s_f16 == (d == 128 or (d == 256 and not causal))
    s_acc = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{block_n}k32\.(f\d+)\.", ptx)
    assert set(s_acc) == {"f16" if s_f16 else "f32"}
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{d}k32\.f32\.", ptx)
    # P -> e4m3 pairs in registers (block_n / 2 scores per thread, two per conversion)
    assert p_conversions(art) == block_n // 4
    # the PV WGMMA takes A from registers: {...} list right after the accumulators
    assert re.search(r"wgmma\.mma_async\S*k32\.f32\.e4m3\.e4m3\s*\{[^}]*\},\s*\{", ptx)


@pytest.mark.compile
@pytest.mark.parametrize("d,causal", [(64, True), (128, False), (256, False)])
def test_fp8_output(d, causal):
    """k7:out_fp8=1: O / l converted to e4m3 pairs (saturating) and stored through SMEM by
    TMA as the bf16 output is, no spills; v's descale is not read (it becomes the output's
    descale)."""
    art = compiled("k7:out_fp8=1", d, causal)
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    ptx, block_n = art["ptx"], art["kernel"]["block_n"]
    tiles = 1
    # P's conversions as in the bf16-output kernel, plus d / 4 (O's d / 2 fp32 per thread)
    o_conversions = count(ptx, r"cvt\.rn\.satfinite\.e4m3x2\.f32")
    if art["kernel"]["options"]["s_f16"]:
        assert p_conversions(art) == block_n // 4 * tiles and o_conversions == d // 4
    else:
        assert o_conversions == block_n // 4 * tiles + d // 4
    assert not re.search(r"cvt\S*\.bf16x2\.f32", ptx)
    # the TMA store's 128-byte boxes: half as many as for bf16 rows of 256 bytes or more
    bf16_out = compiled("k7", d, causal)["ptx"]
    assert count(ptx, TMA_STORE) == count(bf16_out, TMA_STORE) // (2 if d >= 128 else 1)
    assert count(ptx, r"st\.global") == count(bf16_out, r"st\.global")   # (the LSE's)
    descale_loads = r"ld\.global\.b32"           # q's, k's (and for bf16, v's) per item
    assert count(ptx, descale_loads) == count(bf16_out, descale_loads) - 1


def test_fp8_output_descale():
    from hopper_attn import k7
    from hopper_attn.k7 import output_descale
    with pytest.raises(ValueError, match="unknown options"):
        k7.compile_kernel(Problem(1, 2, 256, 128), out_fp8=True, direct_store=True)
    descale_v = torch.tensor([[1.0, 2.0], [3.0, 4.0]])          # (batch 2, kv heads 2)
    assert output_descale(descale_v, 6).tolist() == [[1, 1, 1, 2, 2, 2], [3, 3, 3, 4, 4, 4]]


def test_quantize_round_trip_and_scales():
    from hopper_attn.quantize import E4M3_MAX, dequantize_fp8, quantize_fp8
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 50, 3, 64, generator=gen)
    x[:, :, 1] *= 100.0                                  # one loud head
    x[1, :, 2] = 0.0                                     # an all-zero slice
    x8, descale = quantize_fp8(x.to(torch.bfloat16))
    assert x8.dtype == torch.float8_e4m3fn and descale.shape == (2, 3)
    assert descale.dtype == torch.float32 and descale[1, 2] == 1.0
    assert (x8.float().abs().amax(dim=(1, 3)) <= E4M3_MAX).all()
    back = dequantize_fp8(x8, descale)
    amax = x.abs().amax(dim=(1, 3))[:, None, :, None].clamp_min(1e-9)
    rel = (back - x.to(torch.bfloat16).float()).abs() / amax
    assert rel.max() <= 2 ** -4 + 1e-6                  # within half an e4m3 ulp at the top
    # per (batch, head): the loud head does not coarsen the quiet ones
    quiet = (back[:, :, 0] - x[:, :, 0]).abs().max()
    assert quiet < 0.3


@pytest.mark.compile
@pytest.mark.parametrize("d,causal", [(128, False), (256, True)])
def test_v_transposed_in_memory_needs_no_transpose(d, causal):
    """k7 (V packed in memory): V^T tiles come straight from the TMA (no ldmatrix; the only
    stmatrix are the epilogue's, d / 16 per thread for its 64 x d bf16 rows of O), and SMEM
    holds Q, the K and V^T rings and the output buffer, no raw V ring."""
    art = compiled("k7", d, causal)
    ptx, kernel = art["ptx"], art["kernel"]
    assert not re.search(r"ldmatrix", ptx)
    assert count(ptx, r"stmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16") == d // 16
    assert {int(n) for n in re.findall(E4M3_WGMMA, ptx)} == {kernel["block_n"], d}
    ring_stage = kernel["block_n"] * d                            # bytes, e4m3
    two_rings = kernel["block_m"] * d * 3 + 2 * kernel["stages"] * ring_stage
    assert two_rings <= kernel["smem_bytes"] < two_rings + 4096   # + barriers, alignment


@pytest.mark.parametrize("seqlen", [1, 17, 128, 1000])
def test_packed_v_round_trip(seqlen):
    """V packed for k7: sequence-major, padded to 16 with zeros, kv permuted within 16 as P's
    k-slots (position 2 holds row 8); the quantizer packs in its own pass exactly as pack_v
    packs its output; unpack_v gives V back."""
    from hopper_attn import k7
    from hopper_attn.quantize import quantize_fp8
    v_bf16 = torch.randn(2, seqlen, 3, 64).to(torch.bfloat16)
    v, descale = quantize_fp8(v_bf16)
    packed = k7.pack_v(v)
    n16 = -(-seqlen // 16) * 16
    assert packed.shape == (2, n16, 3, 64) and packed.stride(1) == 1
    assert torch.equal(k7.unpack_v(packed, seqlen).view(torch.uint8), v.view(torch.uint8))
    bytes_, src = packed.view(torch.uint8), v.view(torch.uint8)
    if seqlen > 8:
        assert torch.equal(bytes_[:, 2], src[:, 8])
    padding = [i for i in range(n16) if i - i % 16 + k7.PERM16[i % 16] >= seqlen]
    assert not bytes_[:, padding].any()
    fused, fused_descale = quantize_fp8(v_bf16, pack_v=True)
    assert fused.stride() == packed.stride() and torch.equal(fused_descale, descale)
    assert torch.equal(fused.view(torch.uint8), bytes_)


def test_inputs_must_be_fp8_with_descales():
    p = Problem(2, 3, 17, 64)
    q, k, v = (torch.randn(p.shape).to(torch.float8_e4m3fn) for _ in range(3))
    out = torch.empty(p.shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        check_tensors(p, q.float().to(torch.bfloat16), k, v, out, input_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="on cpu"):
        check_tensors(p, q, k, v, out, input_dtype=torch.float8_e4m3fn)
    p32 = Problem(2, 3, 32, 64)
    plain = [torch.randn(p32.shape).to(torch.float8_e4m3fn) for _ in range(3)]
    with pytest.raises(ValueError, match="sequence-major"):      # k7's default wants V packed
        check_tensors(p32, *plain, torch.empty(p32.shape, dtype=torch.bfloat16),
                      input_dtype=torch.float8_e4m3fn, v_seq_major=True)
    with pytest.raises(ValueError, match=r"out has dtype .*bfloat16, expected .*e4m3"):
        check_tensors(p, q, k, v, out, input_dtype=torch.float8_e4m3fn,   # k7:out_fp8=1
                      output_dtype=torch.float8_e4m3fn)
    good = [torch.ones(2, 3) for _ in range(3)]
    with pytest.raises(ValueError, match=r"descale_k .*\(2, 3\)"):
        check_descales(p, [good[0], torch.ones(3, 2), good[2]])
    with pytest.raises(ValueError, match="descale_v"):
        check_descales(p, [good[0], good[1], good[2].double()])


def test_fp8_emulation_is_close_to_fp32_and_exact_for_one_key():
    from hopper_attn.harness.reference import reference_attention
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 64, 2, 64, generator=gen) for _ in range(3))
    ref = reference_attention(q, k, v, causal=True)
    emu = reference_attention(q, k, v, causal=True, fp8_probs=True)
    err = (emu - ref).abs().max().item()
    assert 0 < err < 0.05                           # P in e4m3: ~3 significant bits
    assert torch.equal(emu[:, 0], ref[:, 0])        # row 0 sees one key: P = 256 exactly


def test_k8_rotation_is_orthogonal_and_keeps_scores():
    from hopper_attn import k8
    for d in (64, 128, 256):
        r = k8.rotation(d, "cpu", seed=3)
        assert torch.allclose(r @ r.T, torch.eye(d), atol=1e-5)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 8, 2, 128, generator=gen) for _ in range(2))
    k[..., 5] *= 100.0                                   # an outlier channel
    s = torch.einsum("bihd,bjhd->bhij", q, k)
    s_rot = torch.einsum("bihd,bjhd->bhij", k8.rotate(q), k8.rotate(k))
    assert torch.allclose(s, s_rot, rtol=1e-4, atol=1e-2)
    # the outlier's energy is spread: no coordinate of the rotated k holds most of it
    assert k8.rotate(k).abs().amax() < 0.3 * k.abs().amax()
    with pytest.raises(ValueError, match="power-of-two"):
        k8.hadamard(96)


def test_register_split_must_fit_what_the_producer_frees(monkeypatch):
    """setmaxnreg.inc takes registers only from the CTA's own pool: a 32/240 split fits the
    register file but hangs (the producer frees 17,408, the consumers want 18,432)."""
    from hopper_attn.common import warp_roles
    for split in [(24, 240), (40, 232), (56, 224)]:
        monkeypatch.setitem(warp_roles.REGISTER_SPLIT, 2, split)
        warp_roles.WarpRoles.create(2)
    monkeypatch.setitem(warp_roles.REGISTER_SPLIT, 2, (32, 240))
    with pytest.raises(ValueError, match="frees"):
        warp_roles.WarpRoles.create(2)


@pytest.mark.compile
@pytest.mark.parametrize("d,causal,lags", [(128, False, True), (128, True, True),
                                           (256, False, True), (256, True, False)])
def test_v_lags_k_default(d, causal, lags):
    """K_{j+1} loaded before V_j (k6's v_lags_k) by default, except at d = 256 with a mask
    (measured round-robin, docs/k7.md)."""
    assert compiled("k7", d, causal)["kernel"]["v_lags_k"] == lags


def test_longest_first_by_sequence_length():
    """k6's head-group order, on by default with a mask at d = 128 and 256 inside
    k7.LONGEST_FIRST_LENGTHS (2k-8k queries)."""
    from hopper_attn import k7

    def on(n, d, causal=True):
        return k7.settings_for(Problem(1, 2, n, d, causal))["longest_first"] > 0
    low, high = k7.LONGEST_FIRST_LENGTHS
    for d in (128, 256):
        assert on(low, d) and on(high, d) and not on(low - 1, d) and not on(high + 1, d)
        assert not on(low, d, causal=False)
    assert not on(4096, 64)


@pytest.mark.compile
@pytest.mark.parametrize("d,causal,after", [(128, False, 0), (128, True, 0), (256, False, 0),
                                            (256, True, 8), (64, True, 0)])
def test_pv_wait_among_the_exp2s_where_measured(d, causal, after):
    """k6's pv_wait="after8" (POLICY: d = 256 with a mask, +3.5-12.9% measured), with V
    released without a branch (implied); elsewhere the PV wait stays pinned after every
    exp2."""
    art = compiled("k7", d, causal)
    options = art["kernel"]["options"]
    assert options["pv_wait"] == (f"after{after}" if after else "pinned")
    assert count(art["ptx"], r"fence\.acq_rel\.cta") == 1          # either fence, never both
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


@pytest.mark.compile
@pytest.mark.parametrize("name,d,causal", [("k7:rescale=before_pv", 128, False),
                                           ("k7:rescale=before_pv", 128, True),
                                           ("k7", 256, False)])      # the default there
def test_o_rescaled_under_qk(name, d, causal):
    """rescale="before_pv" (k6's setting; k7's PV wait is in the iteration, pinned): O's d / 2
    multiplies per thread move from behind the pinned PV wait to between the QK and PV issue,
    under the QK GEMM, with no wait for QK there; what is left behind the PV wait is P's FP8
    packing (docs/lab/k7.md "O rescaled under QK"; the default at d = 256 without a mask)."""
    from hopper_attn.harness.compile_report import sass
    from hopper_attn.harness.sass_order import loop_body, loops
    art = compiled(name, d, causal)
    assert art["kernel"]["options"]["rescale"] == "before_pv"
    text = sass(art["cubin"])
    body = loop_body(text, loops(text)[-1])
    qk_end = next(i for i, t in enumerate(body) if "gsb0" in t and re.search(r"GMMA\.\S+ R\d+, gdesc", t))
    pv = next(i for i in range(qk_end, len(body)) if re.search(r"GMMA\.\S+ R\d+, R", body[i]))
    assert sum(re.search(r"\bFMUL\b", t) is not None for t in body[qk_end:pv]) >= d // 2
    assert not any("gsb0, 0x0" in t for t in body[qk_end:pv])
    pinned = max(i for i, t in enumerate(body) if "MEMBAR" in t)
    assert not any(re.search(r"\bFMUL\b", t) for t in body[pinned:])
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


@pytest.mark.compile
@pytest.mark.parametrize("name,d", [("k7", 128), ("k7", 256)])
def test_no_wgmma_serialization_notes(name, d):
    """ptxas has no performance note (C7512 / C7514 / C7515: every WGMMA serialized) on the
    default loop (skipped where no CUDA toolkit's ptxas is on PATH, as in
    CI; the SASS tests above check the same from the waits)."""
    import shutil
    if shutil.which("ptxas") is None:
        pytest.skip("ptxas not on PATH")
    from hopper_attn.harness.compile_report import ptxas_notes
    assert ptxas_notes(compiled(name, d, False)["ptx"]) == []


@pytest.mark.compile
def test_item_end_defaults():
    """k6's item_end (POLICY, measured 2026-11-26): "own_buffer_wg" at d = 64, 256 and d = 128
    with a mask, each consumer warpgroup storing its own 64 rows (no barrier of all
    consumer threads after the loop); "own_buffer" at d = 128 without a mask."""
    on, off = compiled("k7", 64, False), compiled("k7", 128, False)
    assert on["kernel"]["options"]["item_end"] == "own_buffer_wg"
    assert off["kernel"]["options"]["item_end"] == "own_buffer"
    assert "bar.sync \t1, 256;" in off["ptx"] and "bar.sync \t1, 256;" not in on["ptx"]
    for fn in resource_usage(on["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


@pytest.mark.compile
def test_exp2s_paced_at_the_sfu_rate():
    """ptxas paces k7's exp2s itself (docs/lab/k7.md "Where the phases line up"): in the loop,
    the control bits put 8 cycles between one MUFU.EX2 and the next (a stall of 7 on the
    row-sum FADD between them), the rate one SM sub-partition's SFU takes them at, so a warp
    alone needs 8 cycles per exp2 whatever else it has to issue. (fp32 scores; fp16 ones:
    test_fp16_scores.)"""
    from hopper_attn.harness.compile_report import sass
    from hopper_attn.harness.sass_order import control_bits, exp2_gaps
    text = sass(compiled("k7:s_f16=0", 128, False)["cubin"], encoding=True)
    assert len(control_bits(text)) > 1000
    gaps = max(exp2_gaps(text), key=len)                 # the loop of whole tiles
    assert len(gaps) + 1 >= 96 and set(gaps) == {8}


@pytest.mark.compile
@pytest.mark.parametrize("d", [128, 256])
def test_fp16_scores(d):
    """`s_f16` (the default at d = 128, and d = 256 without a mask; docs/lab/k7.md "Scores in
    fp16"): S = Q K^T accumulates in fp16 and the softmax runs on fp16 pairs: per thread and
    tile (block_n / 2 scores, block_n / 4 pairs) one sub.f16x2 (s - m), one mul and add
    (HFMA2 in the SASS), one ex2.approx.f16x2 (two MUFU.EX2.F16) and one add.f16x2 for the
    row sums per pair; fp32 exp2s only for the two rows' alphas; P converted from fp16 pairs;
    No spills; the settings it cannot combine with are refused."""
    from hopper_attn.harness.compile_report import sass
    from hopper_attn.k7 import FlashAttentionK7
    art = compiled("k7", d, False)
    kernel, ptx = art["kernel"], art["ptx"]
    assert kernel["options"]["s_f16"]
    pairs = kernel["block_n"] // 4
    assert count(ptx, r"ex2\.approx\.f16x2") == pairs
    assert count(ptx, r"sub\.f16x2") == pairs and count(ptx, r"mul\.f16x2") == pairs
    assert count(ptx, r"add\.f16x2") >= 2 * pairs
    assert count(ptx, r"cvt\.rp\.f16\.f32") == 0
    assert count(ptx, r"ex2\.approx\.ftz\.f32") == 2
    assert p_conversions(art) == pairs
    assert sass(art["cubin"]).count("MUFU.EX2.F16") == 2 * pairs
    for fn in resource_usage(art["cubin"]):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    for option in ({"pv_wait": "after4"}, {"pv_wait": "first"}):
        with pytest.raises(ValueError, match="s_f16"):
            FlashAttentionK7(d, False, 128, 128, 2, s_f16=True, **option)
    with pytest.raises(ValueError, match="eager or before_pv"):
        FlashAttentionK7(d, False, 128, 128, 2, rescale="lazy_after_wait", pv_wait="pinned")


def test_prepare_inputs_scales_for_the_scores_type():
    """k7.prepare_inputs scales q and k for fp16 scores at the head dims POLICY has them (the
    scores' factor softmax_scale log2(e) dq dk a power of two, row norms bounded), and to
    e4m3's full range (448 per head) at d = 64; `softmax_scale` reaches the factor."""
    import math
    from hopper_attn import k7
    gen = torch.Generator().manual_seed(3)
    for d, f16 in ((64, False), (128, True), (256, True)):
        q, k, v = (torch.randn(1, 64, 2, d, generator=gen).to(torch.bfloat16) for _ in range(3))
        for scale in (None, 0.05):
            q8, k8, _, dq, dk, _ = k7.prepare_inputs(q, k, v, softmax_scale=scale)
            factor = (d ** -0.5 if scale is None else scale) * math.log2(math.e) * dq * dk
            power_of_two = torch.allclose(torch.log2(factor), torch.log2(factor).round(),
                                          atol=1e-5)
            assert power_of_two == f16, (d, scale)
            top = q8.float().abs().amax(dim=(1, 3))
            assert (top < 448).all() if f16 else (top == 448).all()
