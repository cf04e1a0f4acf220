"""`attention_with_kvcache` (hopper_attn/kvcache.py, the decode stage's kv_cache variant).

On the CPU: refusals raise ValueError before any launch; the page-table gather and append
math (torch, CPU tensors) against a plain loop and a contiguous layout of the same keys;
one compile per new variant (contiguous cache, pages smaller than the kv tile: one TMA box
per page, pages as large as the tile or larger: one box per tile; an e4m3 cache; a window,
a softcap with sinks) for sm_90a, no spills. Chunked prefill (k6 over the cache as packed
keys): its refusals, the packed views of the cache, the page boxes' clipping, a compile of
the paged kernel (pages of 16 and 128), the host path with the kernels emulated in torch.

On the GPU (marked gpu): harness/kvcache_check.py's quick cases (fp32 reference over the
gathered cache, NaN in unused pages and past the cache lengths, appends checked byte for
byte, same bits twice) and a CUDA graph replay; harness/prefill_check.py's chunked-prefill
cases and graph replay.
"""

import shutil
import tempfile

import pytest
import torch

from hopper_attn import kvcache
from hopper_attn.harness import kvcache_check as kc
from hopper_attn.harness import prefill_check


def _inputs(**over):
    t = dict(q=torch.zeros(2, 1, 8, 128, dtype=torch.bfloat16),
             k_cache=torch.zeros(6, 16, 2, 128, dtype=torch.bfloat16),
             v_cache=torch.zeros(6, 16, 2, 128, dtype=torch.bfloat16),
             cache_seqlens=torch.zeros(2, dtype=torch.int32),
             page_table=torch.zeros(2, 3, dtype=torch.int32))
    t.update(over)
    return t


def _refused(match, **over):
    t = _inputs(**over)
    extra = {k: t.pop(k) for k in ("k_new", "v_new", "num_splits", "k_descale", "v_descale",
                                   "window_size", "softcap", "sinks", "causal") if k in t}
    with pytest.raises(ValueError, match=match):
        kvcache.attention_with_kvcache(t["q"], t["k_cache"], t["v_cache"], t["cache_seqlens"],
                                       page_table=t["page_table"], **extra)


def test_refusals_before_any_launch():
    bf = torch.bfloat16
    _refused("CUDA device", q=torch.zeros(2, 17, 8, 128, dtype=bf))    # the prefill path
    _refused("bf16 or fp16", q=torch.zeros(2, 1, 8, 128))
    _refused("same shape", v_cache=torch.zeros(6, 32, 2, 128, dtype=bf))
    _refused("dtype", k_cache=torch.zeros(6, 16, 2, 128, dtype=torch.float16),
             v_cache=torch.zeros(6, 16, 2, 128, dtype=torch.float16))
    _refused("multiple of", q=torch.zeros(2, 1, 7, 128, dtype=bf))
    _refused("head_dim", q=torch.zeros(2, 1, 8, 64, dtype=bf))
    _refused("cache_seqlens", cache_seqlens=torch.zeros(2, dtype=torch.int64))
    _refused("cache_seqlens", cache_seqlens=torch.zeros(3, dtype=torch.int32))
    _refused("page_table", page_table=torch.zeros(2, 3, dtype=torch.int64))
    _refused("page_table", page_table=torch.zeros(3, 3, dtype=torch.int32))
    _refused("page_table", page_table=torch.zeros(2, 6, dtype=torch.int32)[:, ::2])
    _refused("page_size", k_cache=torch.zeros(6, 8, 2, 128, dtype=bf),
             v_cache=torch.zeros(6, 8, 2, 128, dtype=bf))
    _refused("batch", page_table=None)
    _refused("together", k_new=torch.zeros(2, 1, 2, 128, dtype=bf), v_new=None)
    _refused("seqlen_new", k_new=torch.zeros(2, 1, 3, 128, dtype=bf),
             v_new=torch.zeros(2, 1, 3, 128, dtype=bf))
    _refused("more than the cache", k_new=torch.zeros(2, 49, 2, 128, dtype=bf),
             v_new=torch.zeros(2, 49, 2, 128, dtype=bf))
    _refused("num_splits", num_splits=129)
    _refused("e4m3", k_descale=torch.ones(2, 2))                 # descales with a bf16 cache
    f8 = torch.float8_e4m3fn
    _refused("one dtype", k_cache=torch.zeros(6, 16, 2, 128, dtype=f8))
    _refused("fp32 of shape", k_cache=torch.zeros(6, 16, 2, 128, dtype=f8),
             v_cache=torch.zeros(6, 16, 2, 128, dtype=f8), k_descale=torch.ones(2, 3))
    _refused("quantized", k_cache=torch.zeros(6, 16, 2, 128, dtype=f8),
             v_cache=torch.zeros(6, 16, 2, 128, dtype=f8),
             k_new=torch.zeros(2, 1, 2, 128, dtype=bf), v_new=torch.zeros(2, 1, 2, 128, dtype=bf))
    _refused("CUDA device")                          # valid but on the CPU: nothing launched
    _refused("CUDA device", window_size=(128, 0), softcap=30.0, sinks=torch.zeros(8))
    _refused("window_size", window_size=(128, 5))                 # causal: right 0
    _refused("window_size", window_size=(-2, 0), causal=False)
    _refused("window_size", window_size=128)
    _refused("softcap", softcap=-1.0)
    _refused("softcap", softcap=float("inf"))
    _refused("softcap", softcap=True)
    _refused("sinks", sinks=torch.zeros(4))                      # (heads,) = (8,)
    _refused("sinks", sinks=torch.zeros(8, dtype=torch.bfloat16))


def test_page_table_gather_and_append_math():
    """A paged cache built from a contiguous one through a shuffled page table gathers back
    to the same keys; append_kv (vectorised index ops) writes what a row-by-row loop
    writes, across page boundaries, and nothing else; the fp32 reference agrees on both
    layouts."""
    case = kc.Case((0, 15, 16, 40), 64, 16, seqlen_q=4, seqlen_new=3, heads=4, heads_kv=2,
                   head_dim=64)
    i = kc.make_case(case, "cpu", seed=3)
    table, ps = i["page_table"], case.page_size
    for name, new in (("k_cache", i["k_new"]), ("v_cache", i["v_new"])):
        expect = kc.expected_cache(i[name], new, case.lens, table, ps)
        got = i[name].clone()
        kvcache.append_kv(got, got.clone(), new, new, i["cache_seqlens"], table)
        assert torch.equal(got.view(torch.int16), expect.view(torch.int16))
    # the same keys laid out contiguously
    k_paged = kc.expected_cache(i["k_cache"], i["k_new"], case.lens, table, ps)
    v_paged = kc.expected_cache(i["v_cache"], i["v_new"], case.lens, table, ps)
    keys = [n + case.seqlen_new for n in case.lens]
    k_flat = torch.full((case.batch, case.capacity, 2, 64), float("nan"), dtype=torch.bfloat16)
    v_flat = k_flat.clone()
    for r, n in enumerate(keys):
        pages = table[r, :-(-n // ps)].long()
        k_flat[r, :n] = k_paged[pages].flatten(0, 1)[:n]
        v_flat[r, :n] = v_paged[pages].flatten(0, 1)[:n]
        assert torch.equal(kc.gathered(k_paged, r, n, table, ps), k_flat[r, :n])
    ref_paged = kc.reference(i["q"], k_paged, v_paged, keys, table, ps, True, 0.125)
    ref_flat = kc.reference(i["q"], k_flat, v_flat, keys, None, 0, True, 0.125)
    assert torch.equal(ref_paged[0], ref_flat[0]) and torch.equal(ref_paged[1], ref_flat[1])
    assert not ref_paged[0].isnan().any()
    # request 0: 3 keys (all new), 4 queries: the first sees none
    assert ref_paged[1][0, :, 0].isinf().all() and ref_paged[1][0, :, 1:].isfinite().all()


@pytest.mark.compile
@pytest.mark.parametrize("page_size,block_n,stages,fp8,boxes", [
    (0, 128, 3, False, 1), (16, 128, 3, False, 8), (256, 64, 2, False, 1),
    (16, 64, 7, True, 4), (0, 128, 2, True, 1)])
def test_kv_cache_variants_compile(page_size, block_n, stages, fp8, boxes):
    from hopper_attn.harness import sass_order
    from hopper_attn.harness.compile_report import SPILLS_AS_ERRORS, resource_usage, sass
    with tempfile.TemporaryDirectory() as dump:
        compiled, kernel = kvcache.compile_kernel(
            128, True, torch.bfloat16, page_size, block_n, stages,
            compile_options=f"--keep-ptx --keep-cubin --dump-dir={dump} {SPILLS_AS_ERRORS}",
            kv_dtype=kvcache.FP8 if fp8 else None)
        ptx, cubin = compiled.__ptx__, bytes(compiled.__cubin__)
    (fn,) = resource_usage(cubin)
    assert fn["local"] == 0 and fn["stack"] == 0, fn
    assert fn["registers"] * kernel.threads * kernel.ctas_per_sm <= 65536, fn
    # K and V: `boxes` TMA boxes per tile, each one instruction per 128-byte row chunk
    # (d = 128: two in bf16, one in e4m3; e4m3: the first `stages` tiles issued apart
    # from the refills, unrolled where paged)
    copies = (stages + 1 if page_size else 2) if fp8 else 2
    assert ptx.count("cp.async.bulk.tensor") == 2 * boxes * copies
    assert kernel.smem_bytes <= (114 if kernel.ctas_per_sm == 2 else 227) * 1024
    if fp8:     # e4m3 pairs widened (through f16) in shared memory
        assert "cvt.rn.f16x2.e4m3x2" in ptx
        # the consumers in k6's order: S and PV one WGMMA group each (not serialized), the
        # softmax's exp2s behind a wait for S_j alone (PV_{j-1} in flight) and before the
        # wait for PV_{j-1}
        events = sass_order.loops(sass(cubin))[-1][2]
        exp2 = next(i for i, e in enumerate(events) if e.startswith("EX2"))
        assert events.count("ARRIVE") == 2, events
        assert "DEPBAR 0x1" in events[:exp2] and "DEPBAR 0x0" in events[exp2:], events


@pytest.mark.compile
@pytest.mark.parametrize("page_size,block_n,stages,features", [
    (16, 128, 3, dict(window=(128, None))), (0, 64, 2, dict(softcap=30.0, sinks=True))])
def test_kv_cache_features_compile(page_size, block_n, stages, features):
    """A windowed (causal, left 128) and a softcapped kv-cache config with sinks compile
    for sm_90a without spills, within the registers of their CTAs per SM; one tanh per
    score only with a softcap."""
    from hopper_attn.harness.compile_report import SPILLS_AS_ERRORS, resource_usage
    with tempfile.TemporaryDirectory() as dump:
        compiled, kernel = kvcache.compile_kernel(
            128, True, torch.bfloat16, page_size, block_n, stages,
            compile_options=f"--keep-ptx --keep-cubin --dump-dir={dump} {SPILLS_AS_ERRORS}",
            **features)
        ptx, cubin = compiled.__ptx__, bytes(compiled.__cubin__)
    (fn,) = resource_usage(cubin)
    assert fn["local"] == 0 and fn["stack"] == 0, fn
    assert fn["registers"] * kernel.threads * kernel.ctas_per_sm <= 65536, fn
    assert ("tanh.approx.f32" in ptx) == bool(features.get("softcap"))
    assert kernel.describe().get("window") == features.get("window")


@pytest.mark.compile
@pytest.mark.parametrize("page_size,rows,boxes", [(0, 16, 1), (16, 8, 8)])
def test_fp8_swap_compiles(page_size, rows, boxes):
    """The swapped-operand e4m3 consumer (decode_fp8swap, opt-in): compiles for sm_90a
    without spills, within the registers of two CTAs per SM; both GEMMs are e4m3 WGMMAs
    (2 m64 atoms x 4 k32 steps each, N = 2R) and V^T comes from ldmatrix.trans, no
    16-bit WGMMA and no widening pass; with a ptxas on PATH, no note that it serialized
    the WGMMAs (C7514 and the like)."""
    from hopper_attn.harness.compile_report import SPILLS_AS_ERRORS, resource_usage
    with tempfile.TemporaryDirectory() as dump:
        compiled, kernel = kvcache.compile_kernel(
            128, True, torch.bfloat16, page_size, 128, 3,
            compile_options=f"--keep-ptx --keep-cubin --dump-dir={dump} {SPILLS_AS_ERRORS}",
            kv_dtype=kvcache.FP8, swap_rows=rows)
        ptx, cubin = compiled.__ptx__, bytes(compiled.__cubin__)
    (fn,) = resource_usage(cubin)
    assert fn["local"] == 0 and fn["stack"] == 0, fn
    assert kernel.ctas_per_sm == 2 and fn["registers"] * kernel.threads * 2 <= 65536, fn
    # S^T and PV_{j-1} in the loop, the last PV after it: 8 m64nNk32 each
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{2 * rows}k32.f32.e4m3.e4m3") == 24
    assert ".f16.f16" not in ptx and "ldmatrix.sync.aligned.m8n8.x4.trans" in ptx
    assert ptx.count("cp.async.bulk.tensor") == 2 * boxes     # (e4m3 rows: one per box)
    if shutil.which("ptxas"):   # (a CUDA toolkit here: its notes on serialized WGMMAs)
        from hopper_attn.harness.compile_report import ptxas_notes
        assert not ptxas_notes(ptx), ptxas_notes(ptx)


def test_small_pages_take_the_most_ctas_per_sm():
    """Pages of SMALL_PAGE tokens or fewer: the 64 x 2 tile at d 128 (two CTAs per SM) at
    any batch; larger pages and contiguous caches: tile_for's choice (B1: 128 x 3)."""
    from hopper_attn.common.contract import Problem
    one = Problem(1, 32, 1, 128, True, torch.bfloat16, heads_kv=8, seqlen_k=32768)
    assert kvcache.plan(one, page_size=16)[:2] == (64, 2)
    assert kvcache.plan(one, page_size=128)[:2] == kvcache.plan(one)[:2] == (128, 3)


def test_fp8_swap_plan(monkeypatch):
    """The default ("auto") takes the swapped consumer at d 128 with <= 32 packed rows and no
    window / softcap / sinks, the widening one elsewhere; "swap" forces it (more than 32
    packed rows refused, ValueError before any launch), "swap:S" sets its stages."""
    from hopper_attn.common.contract import Problem
    problem = Problem(1, 32, 1, 128, True, torch.bfloat16, heads_kv=8, seqlen_k=32768)
    wide = Problem(1, 32, 16, 128, True, torch.bfloat16, heads_kv=8, seqlen_k=4096)
    assert kvcache.plan(problem, 0, fp8=True)[:2] == (128, 6)        # (B1: 8 pairs)
    many = Problem(64, 32, 1, 128, True, torch.bfloat16, heads_kv=8, seqlen_k=4096)
    assert kvcache.plan(many, 0, fp8=True)[:2] == (128, 3)
    for other in (dict(softcap=50.0), dict(sinks=True)):
        assert kvcache.plan(problem, 0, fp8=True, **other)[:2] == (64, 7)
    assert kvcache.plan(wide, 0, fp8=True)[:2] == (64, 7)
    monkeypatch.setattr(kvcache, "FP8_CONSUMER", "widen")
    assert kvcache.plan(problem, 0, fp8=True)[:2] == (64, 7)
    monkeypatch.setattr(kvcache, "FP8_CONSUMER", "swap:3")
    assert kvcache.plan(problem, 0, fp8=True)[:2] == (128, 3)
    monkeypatch.setattr(kvcache, "FP8_CONSUMER", "swap")
    with pytest.raises(ValueError, match="packed rows"):
        kvcache.plan(wide, 0, fp8=True)


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(kc.feature_cases())))
def test_feature_case(index):
    row = kc.check_case(kc.feature_cases()[index], seed=index)
    assert row["ok"], row


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(kc.quick_cases())))
def test_quick_case(index):
    row = kc.check_case(kc.quick_cases()[index], seed=index)
    assert row["ok"], row


@pytest.mark.gpu
def test_graph_replay():
    row = kc.check_graph()
    assert row["ok"], row


def test_prefill_refusals_before_any_launch():
    """Chunked prefill (seqlen_q > 16, cu_seqlens_q, a window or softcap): what it refuses
    on the host, before any launch."""
    bf = torch.bfloat16
    q = torch.zeros(2, 20, 8, 128, dtype=bf)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)

    def refused(match, **over):
        t = _inputs(q=q)
        t.update(over)
        args = [t.pop(k) for k in ("q", "k_cache", "v_cache", "cache_seqlens")]
        with pytest.raises(ValueError, match=match):
            kvcache.attention_with_kvcache(*args, **t)

    f8 = torch.float8_e4m3fn
    refused("e4m3", k_cache=torch.zeros(6, 16, 2, 128, dtype=f8),
            v_cache=torch.zeros(6, 16, 2, 128, dtype=f8))
    refused("num_splits", num_splits=4)
    refused("max_seqlen_q", q=torch.zeros(20, 8, 128, dtype=bf), cu_seqlens_q=cu)
    refused("do not fit", q=torch.zeros(20, 8, 128, dtype=bf), cu_seqlens_q=cu,
            max_seqlen_q=8)
    refused("int32", q=torch.zeros(20, 8, 128, dtype=bf), cu_seqlens_q=cu.long(),
            max_seqlen_q=13)
    refused("append_kv", q=torch.zeros(20, 8, 128, dtype=bf), cu_seqlens_q=cu,
            max_seqlen_q=13, k_new=torch.zeros(2, 1, 2, 128, dtype=bf),
            v_new=torch.zeros(2, 1, 2, 128, dtype=bf))
    pair = torch.zeros(2, 6, 16, 2, 128, dtype=bf)          # vLLM's K/V pair: read in place
    heads_major = torch.zeros(6, 2, 16, 128, dtype=bf).transpose(1, 2)
    refused("page_size .16. token rows apart", k_cache=heads_major,
            v_cache=heads_major.clone())
    refused("CUDA device", k_cache=pair[0], v_cache=pair[1])
    refused("CUDA device", q=torch.zeros(2, 3, 8, 128, dtype=bf), window_size=(8, 0))
    refused("softcap", softcap=-1.0)
    refused("window_size", window_size=(4, 4))          # causal: the right side is 0


@pytest.mark.compile
@pytest.mark.parametrize("page_size", [16, 128])
def test_paged_prefill_compiles(page_size):
    """k6 over a paged cache (chunked prefill), d 128, causal, GQA: sm_90a, no spills; K
    and V each one TMA box per tile (page 128) or a loop over 8 page boxes (page 16), two
    instructions a box at d = 128, at the two places each is loaded, beside Q's load and
    O's store."""
    from hopper_attn import k6_paged
    from hopper_attn.common.contract import Problem
    from hopper_attn.harness.compile_report import SPILLS_AS_ERRORS
    problem = Problem(4, 32, 512, 128, True, torch.bfloat16, heads_kv=8, seqlen_k=8192)
    with tempfile.TemporaryDirectory() as dump:
        compiled, kernel = k6_paged.compile_paged(
            problem, page_size, compile_options=f"--keep-ptx --dump-dir={dump} "
                                                f"{SPILLS_AS_ERRORS}")
        ptx = compiled.__ptx__
    assert (kernel.block_n, kernel.page_size) == (128, page_size)
    assert ptx.count("cp.async.bulk.tensor") == 4 + 4 * 2
    assert kernel.roles.producer_regs == 24


def test_prefill_cache_as_packed_tokens():
    """What chunked prefill hands the varlen kernels: the cache as packed tokens (a view),
    request b's key n at token cu_seqlens_k[b] + n (contiguous: b x the request stride) or
    page_table[b, n // page_size] x page_size + n % page_size (paged, also vLLM's K/V pair
    view); through the ragged TMA view a page's box clips exactly the keys past the
    request's count."""
    from hopper_attn.common import varlen
    cache = torch.randn(3, 40, 2, 8)
    flat = kvcache._tokens(cache, 2 * 40 + 40)
    cu_k = torch.arange(4) * (cache.stride(0) // cache.stride(1))
    for b in range(3):
        assert torch.equal(flat[cu_k[b]:cu_k[b] + 40], cache[b])
    pair = torch.randn(2, 6, 16, 2, 8)                      # (K/V, pages, page_size, H, d)
    table = torch.tensor([[4, 0, 2], [1, 5, 3]])
    for pool in (pair[0], pair[1]):
        tokens = kvcache._tokens(pool, 6 * 16)
        for b in range(2):
            keys = kc.gathered(pool, b, 48, table, 16)
            rows = table[b, torch.arange(48) // 16] * 16 + torch.arange(48) % 16
            assert torch.equal(tokens[rows], keys)
    # copy_page_boxes' coordinates: a tile of 128 keys over 16-token pages, 37 keys
    s, ps, seqlen = 2 * 8, 16, 37
    for n in range(128):
        first = n // ps * ps
        length = max(min(seqlen - first, ps), 0)
        page = int(table[0, min(n // ps, 2)])
        address = varlen.ragged_address(0, page * ps, length, n - first, s, 2)
        assert address == (None if n >= seqlen else (page * ps + n % ps) * s * 2)


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(prefill_check.cases(quick=True))))
def test_prefill_case(index):
    row = prefill_check.check(prefill_check.cases(quick=True)[index], seed=index)
    assert row["ok"], row


@pytest.mark.gpu
def test_prefill_graph_replay():
    row = prefill_check.check_graph()
    assert row["ok"], row


def _emulated_kernel(problem, softcap, q, k, v, out, lse, cu_q, seqused, scale, rows_of,
                     sinks=None):
    """What the varlen kernels compute, from the packed views they are handed: request b's
    queries cu_q[b] .. cu_q[b + 1] - 1 over its keys (token rows `rows_of(b, n)`)."""
    for b in range(cu_q.shape[0] - 1):
        q0, q1, nk = int(cu_q[b]), int(cu_q[b + 1]), int(seqused[b])
        rows = rows_of(b, torch.arange(nk))
        group = q.shape[1] // k.shape[1]
        kk, vv = (t[rows].float().repeat_interleave(group, 1) for t in (k, v))
        s = torch.einsum("ihd,jhd->hij", q[q0:q1].float(), kk) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(q1 - q0)[:, None] + nk - (q1 - q0)
        j = torch.arange(nk)[None]
        visible = (j <= i) if problem.causal else torch.ones_like(j <= i)
        if problem.window_left is not None:
            visible = visible & (j >= i - problem.window_left)
        s = s.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks[:, None, None].expand(-1, q1 - q0, 1)], -1)
        lse[:, q0:q1] = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[:, q0:q1, None]).nan_to_num(0.0)[..., :nk]
        out[q0:q1] = torch.einsum("hij,jhd->ihd", p, vv).to(out.dtype)


@pytest.mark.parametrize("case", [
    prefill_check.PCase((0, 5, 40), (20, 20, 20), 64, 0, seqlen_new=20, heads=4, heads_kv=2,
                        head_dim=64),
    prefill_check.PCase((30, 0, 64), (17, 0, 30), 64, 16, varlen=True, heads=4, heads_kv=2,
                        head_dim=64, window_left=8),
    prefill_check.PCase((3, 33), (20, 20), 64, 32, seqlen_new=20, heads=2, heads_kv=2,
                        head_dim=64, softcap=5.0, sinks=True)], ids=lambda c: c.label())
def test_prefill_host_path_emulated(case, monkeypatch):
    """The chunked-prefill host path on the CPU, the kernels (and the CUDA-device check)
    replaced by torch emulations of what they compute from the tensors they are handed:
    the cache as packed tokens, cu_seqlens_q / cu_seqlens_k / seqused_k, the page table,
    the appended keys, the output and LSE views; harness/prefill_check.py's verdict."""
    from hopper_attn import k6_paged, k6_varlen
    monkeypatch.setattr(kvcache, "check_inputs", lambda q, k, v, seqlens, table=None, *a, **kw:
                        (0, k.shape[1]) if table is None else
                        (k.shape[1], table.shape[1] * k.shape[1]))
    monkeypatch.setattr(k6_varlen, "compile_varlen",
                        lambda p, used, sinks=False, **o: ((p, o.get("softcap", 0.0)), None))
    monkeypatch.setattr(k6_paged, "compile_paged",
                        lambda p, ps, sinks=False, **o: ((p, o.get("softcap", 0.0), ps), None))
    monkeypatch.setattr(k6_varlen, "run_varlen", lambda c, q, k, v, out, lse, cu_q, cu_k, used,
                        scale, sinks=None: _emulated_kernel(
                            *c, q, k, v, out, lse, cu_q, used, scale,
                            lambda b, n: int(cu_k[b]) + n, sinks))
    monkeypatch.setattr(k6_paged, "run_paged", lambda c, q, k, v, out, lse, cu_q, used, table,
                        scale, sinks=None: _emulated_kernel(
                            *c[:2], q, k, v, out, lse, cu_q, used, scale,
                            lambda b, n: table[b, n // c[2]].long() * c[2] + n % c[2], sinks))
    row = prefill_check.check(case, seed=1, device="cpu")
    assert row["ok"], row
