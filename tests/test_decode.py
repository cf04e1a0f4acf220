"""The decode stage (hopper_attn/decode.py).

On the CPU: it compiles for sm_90a without spills at d = 64, 128, 256 (bf16, fp16, causal or
not; a windowed and a softcapped config with sinks); its PTX has the WGMMAs (QK from SMEM,
PV with P in registers), the TMA loads of K and V only, the combine's one acq_rel atomic;
the split heuristic's counts (a window's: its kv tiles only);
refusals raise ValueError before any launch.

On the GPU (marked gpu): every case of harness/decode_check.py against fp32 (2x PyTorch's
error), the LSE, the same bits twice, the guards around the outputs, CUDA graph replay.
"""

import math
import re

import pytest
import torch

from hopper_attn import decode
from hopper_attn.common.contract import Problem, UnsupportedProblem, normalize_window
from hopper_attn.harness.compile_report import resource_usage
from ptx import TMA_LOAD, TMA_STORE, WGMMA_REG_A, compiled, count

CONFIGS = [(64, False), (64, True), (128, False), (128, True), (256, False), (256, True)]


def problem(batch, seqlen_q, heads, heads_kv, seqlen_k, d=128, causal=False,
            dtype=torch.bfloat16):
    return Problem(batch, heads, seqlen_q, d, causal, dtype, heads_kv=heads_kv,
                   seqlen_k=seqlen_k)


@pytest.mark.compile
@pytest.mark.parametrize("d,causal", CONFIGS)
def test_compiles_without_spills(d, causal):
    art = compiled("decode", d, causal)
    kernel = art["kernel"]
    assert kernel["threads"] == 160 and kernel["block_m"] == 64
    (fn,) = resource_usage(art["cubin"])
    assert fn["local"] == 0 and fn["stack"] == 0, fn
    # as many CTAs per SM as shared memory allows must also fit the register file
    assert fn["registers"] * 160 * kernel["ctas_per_sm"] <= 65536, fn
    assert kernel["smem_bytes"] == decode.smem_estimate(d, kernel["block_n"], kernel["stages"])


@pytest.mark.compile
@pytest.mark.parametrize("tile", ["block_n=64,stages=2", "block_n=128,stages=3",
                                  "block_n=64,stages=3"])
def test_both_d128_tiles_fit_their_ctas_per_sm(tile):
    art = compiled(f"decode:{tile}", 128, True)
    kernel = art["kernel"]
    (fn,) = resource_usage(art["cubin"])
    assert fn["local"] == 0 and fn["stack"] == 0, fn
    assert fn["registers"] * 160 * kernel["ctas_per_sm"] <= 65536, fn
    assert kernel["ctas_per_sm"] == (1 if kernel["block_n"] == 128 else 2)
    assert kernel["smem_bytes"] == decode.smem_estimate(128, kernel["block_n"], kernel["stages"])


@pytest.mark.compile
def test_compiles_for_fp16():
    art = compiled("decode", 128, True, torch.float16)
    assert count(art["ptx"], r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.f16\.f16") > 0


@pytest.mark.compile
@pytest.mark.parametrize("d,causal", CONFIGS)
def test_ptx_has_the_expected_wgmmas_and_tma_loads(d, causal):
    art = compiled("decode", d, causal)
    ptx, bn = art["ptx"], art["kernel"]["block_n"]
    # S = Q K^T: 64 x bn, d / 16 k-slices; O += P V: 64 x d, bn / 16 k-slices, twice (in the
    # loop and the last tile's), A = P from registers
    qk = count(ptx, rf"wgmma\.mma_async\.sync\.aligned\.m64n{bn}k16\.f32\.bf16\.bf16\s+\{{[^}}]*\}},\s*%rd")
    pv = count(ptx, WGMMA_REG_A.replace(r"m64n\d+k16", f"m64n{d}k16"))
    if bn == d:     # (the same instruction shape: tell them apart by the A operand)
        qk = count(ptx, rf"wgmma\.mma_async\.sync\.aligned\.m64n{bn}k16\.f32\.bf16\.bf16") - pv
    assert qk == d // 16 and pv == 2 * (bn // 16)
    # K and V only, by TMA (one load site each, d / 64 boxes of 128-byte rows); Q by plain
    # 16-byte loads, O by plain stores: no TMA store
    assert count(ptx, TMA_LOAD) == 2 * (d // 64)
    assert count(ptx, TMA_STORE) == 0
    assert count(ptx, r"ld\.global\.v4\.b32") >= 64 * d // 8 // 128
    # the split counter: one acq_rel atomic add; gpu-scope fences around it
    assert count(ptx, r"atom\.global\.acq_rel(?:\.gpu)?\.add") == 1
    assert count(ptx, r"fence\.acq_rel\.gpu") == 2
    assert count(ptx, r"fence\.proxy\.async\.shared::cta") == 1       # Q for the WGMMAs
    assert re.search(r"\.reqntid 160, 1, 1", ptx)
    assert count(ptx, r"bar\.sync\s+0;") == 1          # one CTA-wide sync, before the roles


@pytest.mark.parametrize("shape,tile,splits", [
    # few items: 128 x 3 (one CTA per SM), split to one full wave: 8 items x 16 = 128 CTAs
    ((1, 1, 32, 8, 8192), (128, 3), 16), ((1, 1, 32, 8, 32768), (128, 3), 16),
    ((1, 1, 32, 8, 131072), (128, 3), 16), ((1, 16, 32, 8, 32768), (128, 3), 16),
    ((8, 1, 32, 8, 8192), (128, 3), 2),    # 64 items x 2 = 128 CTAs
    ((16, 4, 64, 8, 16384), (128, 3), 1),  # 128 items fill the wave alone
    # more items than SMs: 64 x 2 (two CTAs per SM), no split
    ((64, 1, 32, 8, 4096), (64, 2), 1), ((128, 1, 32, 8, 2048), (64, 2), 1),
    ((24, 1, 32, 8, 8192), (64, 2), 1),    # 192 items: one wave at two per SM
    # MQA, one item of 32 rows: the combine cap (15 x 32 rows x 129 x 4 <= 64 tiles / 15 x 64 KiB)
    ((1, 1, 32, 1, 8192), (128, 3), 15),
    ((2, 1, 32, 8, 1), (128, 3), 1),       # one kv tile
    ((2, 1, 32, 8, 1000), (128, 3), 2),    # 8 kv tiles: splits of >= 4 tiles
])
def test_split_heuristic(shape, tile, splits):
    p = problem(*shape)
    assert decode.tile_for(p, sms=132) == tile
    assert decode.num_splits_for(p, sms=132) == splits
    assert decode.num_splits_for(p, *tile, sms=132) == splits
    # one wave: the split CTAs fit the SMs
    if splits > 1:
        items = p.batch * p.kv_heads * decode.m_tiles(p)
        assert items * splits <= 132 * decode.ctas_per_sm(128, *tile)


def test_split_limits_cap_the_combine_by_a_splits_bytes():
    # 64 packed rows read 16x the partials of 4 rows: the combine cap is 4x lower
    one, sixteen = problem(1, 1, 32, 8, 32768), problem(1, 16, 32, 8, 32768)
    c1 = decode.split_limits(one, 128, 3, 132)["combine"]
    c16 = decode.split_limits(sixteen, 128, 3, 132)["combine"]
    assert c16 < c1 and abs(c1 - 4 * c16) <= 4
    # a forced tile keeps its own wave: two CTAs per SM double the slots
    p = problem(1, 1, 32, 8, 32768)
    assert decode.split_limits(p, 64, 2, 132)["wave"] == 2 * decode.split_limits(p, 128, 3, 132)["wave"] + 1


@pytest.mark.compile
@pytest.mark.parametrize("name,d,causal,window", [
    ("decode", 128, True, (4095, -1)),                   # Mistral: 128 x 3, a window
    ("decode:softcap=50.0,sinks=1", 256, False, (64, 32))])   # Gemma 2's cap at d 256
def test_window_and_softcap_compile_without_spills(name, d, causal, window):
    """The plain path's window and softcap (compile time) compile for sm_90a without
    spills within the registers of their CTAs per SM; one tanh per score only with a cap;
    the window's kernel is another compile than the window-free one."""
    from hopper_attn.harness import registry
    from hopper_attn.harness.compile_report import compile_artifacts
    art = compile_artifacts(registry.get(name), d, causal, seqlen=4, heads=16, heads_kv=4,
                            window=window)
    assert art["ok"], art.get("error")
    kernel = art["kernel"]
    (fn,) = resource_usage(art["cubin"])
    assert fn["local"] == 0 and fn["stack"] == 0, fn
    assert fn["registers"] * 160 * kernel["ctas_per_sm"] <= 65536, fn
    assert ("tanh.approx.f32" in art["ptx"]) == ("softcap" in name)
    assert kernel["window"] == normalize_window(window, causal) and \
        kernel.get("softcap", 0.0) == (50.0 * ("softcap" in name))


def test_windowed_splits_and_routing():
    """Splits over the window's kv tiles only; `prefers` takes windows of any length."""
    def windowed(batch, heads, heads_kv, nk, d, left, causal=True, right=-1, nq=1):
        return Problem(batch, heads, nq, d, causal, torch.bfloat16, heads_kv=heads_kv,
                       seqlen_k=nk, window_left=left, window_right=right)
    mistral = windowed(1, 32, 8, 32768, 128, 4095)
    assert decode.walked_tiles(mistral, 128) == 32 and decode.num_splits_for(mistral) == 8
    assert decode.num_splits_for(problem(1, 1, 32, 8, 32768)) == 16
    assert decode.walked_tiles(windowed(1, 32, 8, 100, 128, 4095), 128) == 1
    assert decode.walked_tiles(windowed(1, 32, 8, 5000, 128, 64, causal=False, right=32,
                                        nq=4), 64) == 2    # keys 4932 .. 4999
    assert decode.prefers(mistral) and decode.prefers(windowed(1, 32, 8, 100, 128, 4095))
    gpt_oss = windowed(1, 64, 8, 8192, 64, 128)
    assert decode.prefers(gpt_oss)                                # 2 kv tiles of 128
    assert decode.prefers(windowed(1, 64, 8, 8192, 64, 1024))     # 9 tiles of 128


def test_packed_rows_and_m_tiles():
    assert decode.m_tiles(problem(1, 1, 32, 8, 100)) == 1        # 4 rows
    assert decode.m_tiles(problem(1, 16, 32, 8, 100)) == 1       # 64 rows
    assert decode.m_tiles(problem(1, 16, 64, 8, 100)) == 2       # 128 rows
    assert decode.m_tiles(problem(1, 3, 32, 1, 100)) == 2        # MQA: 96 rows


def test_prefers_decode_shapes_only():
    assert decode.prefers(problem(1, 1, 32, 8, 8192))
    assert decode.prefers(problem(16, 4, 64, 8, 16384))
    assert decode.prefers(problem(1, 16, 32, 8, 32768))
    assert not decode.prefers(problem(1, 16, 64, 8, 32768))      # 128 rows
    assert not decode.prefers(problem(1, 128, 8, 8, 4096))       # prefill
    assert not decode.prefers(problem(1, 1, 32, 8, 8192, d=96))  # unsupported head dim


def test_workspace_is_sized_from_shapes_only():
    p = problem(1, 1, 32, 8, 8192)
    ws = decode.decode_workspace(p, "cpu")
    lse, o_part, lse_part, counters = ws
    assert lse.shape == (1, 32, 1) and lse.dtype == torch.float32
    # 16 splits (num_splits_for at 132 SMs) of 8 (batch, k/v head) items of 4 packed rows
    splits = decode.num_splits_for(p)
    assert lse_part.shape == (splits, 8 * 4) and o_part.shape == (8 * 4 * splits, 128)
    assert counters.dtype == torch.int32 and not counters.any()
    one = decode.decode_workspace(p, "cpu", num_splits=1)
    assert one[2].shape[0] == 1 and one[1].numel() <= 64 * 128


@pytest.mark.parametrize("kwargs", [
    dict(num_splits=129), dict(num_splits=-1), dict(block_n=24), dict(stages=-1), dict(block_n=256, stages=4),
])
def test_bad_options_raise_before_launch(kwargs):
    with pytest.raises(ValueError):
        decode.compile_kernel(problem(1, 1, 32, 8, 8192), **kwargs)


@pytest.mark.parametrize("p", [
    problem(1, 1, 32, 8, 8192, d=96), problem(1, 1, 32, 8, 8192, dtype=torch.float32),
    problem(1, 1, 32, 8, 8192, d=256, causal=True, dtype=torch.float32),
    problem(1, 1, 70000, 70000, 10),                               # k/v heads on grid y
])
def test_unsupported_problems_raise(p):
    with pytest.raises(UnsupportedProblem):
        decode.compile_kernel(p)


def test_tensors_are_checked_before_launch():
    from hopper_attn.common.contract import check_tensors
    p = problem(1, 1, 32, 8, 64)
    q = torch.zeros(1, 1, 32, 128, dtype=torch.bfloat16)
    kv = torch.zeros(1, 64, 4, 128, dtype=torch.bfloat16)          # wrong k/v heads
    with pytest.raises(ValueError):
        check_tensors(p, q, kv, kv, q, strided=decode.SPEC.strided_inputs)


# ------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------

def _case_ids():
    from hopper_attn.harness.decode_check import cases
    return [c.label() for c in cases()]


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(_case_ids())), ids=_case_ids())
def test_decode_matches_fp32(index):
    from hopper_attn.harness.decode_check import cases, check_case
    verdict = check_case(cases()[index], seed=index)
    assert verdict["ok"], verdict


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(22))
def test_decode_features_match_fp32(index):
    """harness/decode_check.py's feature cases: windows, softcap, sinks."""
    from hopper_attn.harness.decode_check import check_case, feature_cases
    verdict = check_case(feature_cases()[index], seed=index)
    assert verdict["ok"], verdict


def test_feature_cases_are_22():
    from hopper_attn.harness.decode_check import feature_cases
    assert len(feature_cases()) == 22 and all(c.features for c in feature_cases())


@pytest.mark.gpu
def test_decode_cuda_graph_replay():
    from hopper_attn.harness.decode_check import Case, check_graph
    assert check_graph()["ok"]
    assert check_graph(Case(2, 4, 32, 8, 1000, causal=True, num_splits=1))["ok"]


@pytest.mark.gpu
def test_generation_steps_share_handles_and_stay_exact():
    """attention() over one more key each call, as a generation loop calls it (views of a
    longer cache, and caches that torch.cat grows: new strides), across kv tile boundaries:
    each step's output and LSE equal a fresh call's (nothing reused) bit for bit, and the
    fp32 reference within bf16's error."""
    import hopper_attn
    from hopper_attn import api
    torch.manual_seed(0)
    q = torch.randn(2, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(2, 4200, 8, 128, device="cuda", dtype=torch.bfloat16)
    steps = [cache[:, :n] for n in [*range(4090, 4100), 4200]]
    steps += [t.transpose(1, 2).contiguous().transpose(1, 2) for t in steps]
    outs = [hopper_attn.attention(q, k, k, return_lse=True) for k in steps]
    for k, (out, lse) in zip(steps, outs):
        api._FAST.clear(), api._DECODE_STEPS.clear()
        fresh, fresh_lse = hopper_attn.attention(q, k, k, return_lse=True)
        assert torch.equal(out, fresh) and torch.equal(lse, fresh_lse), k.shape
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2).float(), k.transpose(1, 2).float(), k.transpose(1, 2).float(),
            enable_gqa=True).transpose(1, 2)
        assert (out.float() - ref).abs().max() < 2e-2, k.shape


def _emulate(q, k, v, causal, splits, block_n):
    """The kernel's algorithm in torch (fp32, CPU), with its index arithmetic: packed rows,
    M tiles, each split's kv tiles, per-row key limits, the LSE combine."""
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    rows_total = group * nq
    tiles_m = -(-rows_total // 64)
    scale = d ** -0.5
    out = torch.full_like(q, float("nan"))
    lse_out = torch.full((b, hq, nq), float("nan"))
    for bi in range(b):
        for g in range(hkv):
            for mt in range(tiles_m):
                row0 = mt * 64
                rows_valid = min(rows_total - row0, 64)
                p = torch.arange(64) + row0
                query, head = p // group, g * group + p % group
                qt = torch.zeros(64, d)
                valid = torch.arange(64) < rows_valid
                qt[valid] = q[bi, query[valid], head[valid]]
                keys_any = nk
                limits = torch.full((64,), nk)
                if causal:
                    keys_any = min(nk, max((row0 + rows_valid - 1) // group + nk - nq + 1, 0))
                    limits = torch.clamp(query + nk - nq + 1, max=nk)
                n_total = -(-keys_any // block_n)
                parts = []
                for s in range(splits):
                    n0, n1 = s * n_total // splits, (s + 1) * n_total // splits
                    keys = torch.arange(n0 * block_n, n1 * block_n)
                    kk = torch.zeros(len(keys), d)
                    vv = torch.zeros(len(keys), d)
                    inside = keys < nk
                    kk[inside] = k[bi, keys[inside], g]
                    vv[inside] = v[bi, keys[inside], g]
                    sc = qt @ kk.T * scale
                    sc = sc.masked_fill(keys[None, :] >= limits[:, None], float("-inf"))
                    lse = torch.logsumexp(sc, -1)
                    o = torch.softmax(sc, -1).nan_to_num(0.0) @ vv
                    parts.append((o, lse))
                lses = torch.stack([x[1] for x in parts])
                m = lses.max(0).values
                m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
                w = torch.exp(lses - m_safe)
                total = w.sum(0)
                o = sum(w[s][:, None] * parts[s][0] for s in range(splits))
                o = torch.where(total[:, None] > 0, o / total.clamp(min=1e-30)[:, None], 0.0)
                lse = torch.where(total > 0, m_safe + total.log(), float("-inf"))
                out[bi, query[valid], head[valid]] = o[valid]
                lse_out[bi, head[valid], query[valid]] = lse[valid]
    return out, lse_out


@pytest.mark.parametrize("b,nq,hq,hkv,nk,causal,splits,block_n", [
    (2, 1, 8, 2, 1, False, 3, 16), (1, 4, 8, 2, 17, True, 2, 16), (1, 16, 4, 4, 113, True, 5, 32),
    (2, 16, 8, 1, 100, True, 4, 16), (1, 3, 32, 1, 50, False, 7, 16), (1, 5, 16, 2, 40, True, 9, 16),
])
def test_emulated_algorithm_matches_reference(b, nq, hq, hkv, nk, causal, splits, block_n):
    """The kernel's index arithmetic and combine, emulated in torch on the CPU, against the
    plain fp32 reference: every row written, no NaN, the same O and LSE."""
    from hopper_attn.harness.decode_check import _reference
    gen = torch.Generator().manual_seed(nk)
    q = torch.randn(b, nq, hq, 64, generator=gen)
    k = torch.randn(b, nk, hkv, 64, generator=gen)
    v = torch.randn(b, nk, hkv, 64, generator=gen)
    out, lse = _emulate(q, k, v, causal, splits, block_n)
    ref, ref_lse = _reference(q, k, v, causal, 64 ** -0.5)
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out - ref).abs().max() < 1e-4
    assert (lse - ref_lse).abs().max() < 1e-4


def _chunked_combine(lses, parts, lanes, chunk):
    """The kernel's combine of one row piece, in torch: lane `sub` reads splits sub, sub +
    lanes, ... `chunk` at a time (indices clamped to the last split, weight 0 past it),
    keeping a running (max, sum, weighted sum); a butterfly merges the lanes."""
    splits = lses.shape[0]
    inf = float("inf")
    state = []
    for sub in range(lanes):
        m, total, acc = -inf, 0.0, torch.zeros(parts.shape[1])
        for s0 in range(0, splits, lanes * chunk):
            idx = [s0 + sub + lanes * i for i in range(chunk)]
            x = [lses[min(s, splits - 1)].item() if s < splits else -inf for s in idx]
            p = [parts[min(s, splits - 1)] for s in idx]
            m_new = max([m] + x)
            m_safe = 0.0 if m_new == -inf else m_new
            rescale = 2.0 ** ((m - m_safe) * 1.4426950408889634)
            total, acc = total * rescale, acc * rescale
            for xi, pi in zip(x, p):
                w = 2.0 ** ((xi - m_safe) * 1.4426950408889634)
                total, acc = total + w, acc + pi * w
            m = m_new
        state.append((m, total, acc))
    offset = 16
    while offset:
        if offset < lanes:
            merged = []
            for sub in range(lanes):
                (m, t, a), (mo, to, ao) = state[sub], state[sub ^ offset]
                m_new = max(m, mo)
                m_safe = 0.0 if m_new == -inf else m_new
                mine, other = math.exp(m - m_safe), math.exp(mo - m_safe)
                merged.append((m_new, t * mine + to * other, a * mine + ao * other))
            state = merged
        offset //= 2
    m, total, acc = state[0]
    out = acc / total if total else torch.zeros_like(acc)
    lse = (0.0 if m == -inf else m) + math.log(total) if total else -inf
    return out, lse


@pytest.mark.parametrize("splits,lanes,chunk,empty", [
    (16, 1, 16, ()), (13, 1, 1, (0, 5)), (100, 4, 16, (99,)), (3, 32, 16, ()),
    (128, 1, 16, tuple(range(0, 128, 3))), (4, 2, 16, (0, 1, 2, 3)),
])
def test_chunked_combine_matches_the_exact_one(splits, lanes, chunk, empty):
    gen = torch.Generator().manual_seed(splits)
    lses = torch.randn(splits, generator=gen, dtype=torch.float64) * 5
    parts = torch.randn(splits, 8, generator=gen, dtype=torch.float64)
    for s in empty:                      # a split that saw no key: LSE -inf, O 0
        lses[s], parts[s] = float("-inf"), 0.0
    out, lse = _chunked_combine(lses, parts, lanes, chunk)
    exact_lse = torch.logsumexp(lses, 0).item()
    if exact_lse == float("-inf"):
        assert lse == float("-inf") and not out.any()
        return
    exact = (torch.softmax(lses, 0)[:, None] * parts).sum(0)
    assert abs(lse - exact_lse) < 1e-9 and (out - exact).abs().max() < 1e-9
