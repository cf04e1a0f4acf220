"""On the GPU: ref_check's randomized sweep for every kernel (odd N, causal, both d), and the
attention() op (against fp32, under torch.compile, captured in a CUDA graph)."""

import pytest
import torch

from hopper_attn.harness import registry

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", [*registry.KERNELS, *registry.BACKWARD_KERNELS])
def test_ref_check(name):
    from ref_check import check_kernel
    rows = check_kernel(registry.get(name), seed=1234)
    bad = [r for r in rows if not r.get("skipped") and not r.get("ok")]
    assert not bad, bad[:3]


def _scores(q, k, causal, scale):
    """fp32 scores (batch, heads, nq, nk); k's heads repeated for GQA; causal aligned
    bottom-right (-inf above the diagonal)."""
    k = k.float().repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q.float(), k) * scale
    nq, nk = q.shape[1], k.shape[1]
    if causal:
        hidden = torch.ones(nq, nk, dtype=torch.bool, device=q.device).triu(nk - nq + 1)
        s = s.masked_fill(hidden, float("-inf"))
    return s


def _reference(q, k, v, causal, scale):
    """fp32 attention; k/v heads repeated for GQA; causal aligned bottom-right; rows that
    see no key are 0."""
    v = v.float().repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    p = torch.softmax(_scores(q, k, causal, scale), -1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", p, v)


def _reference_fp8(q, k, v, causal, scale):
    """`_reference` with P rounded to e4m3 after scaling its row maximum to 256 (k7's), the
    row sums in fp32, the output rounded to bf16: the error an FP8 kernel cannot avoid."""
    v = v.float().repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    s = _scores(q, k, causal, scale)
    e = torch.exp(s - s.amax(-1, keepdim=True)).nan_to_num(0.0)
    total = e.sum(-1, keepdim=True)
    p = ((e * 256).to(torch.float8_e4m3fn).float() / (total * 256)).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", p, v).to(torch.bfloat16).float()


def _reference_lse(q, k, causal, scale):
    """fp32 log-sum-exp per (batch, head, query row); -inf for rows that see no key."""
    return torch.logsumexp(_scores(q, k, causal, scale), -1)


@pytest.mark.parametrize("d,dtype", [(64, torch.bfloat16), (128, torch.bfloat16),
                                     (96, torch.bfloat16), (192, torch.float16),
                                     (256, torch.bfloat16), (128, torch.float16)])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_op_matches_fp32(d, dtype, causal):
    import hopper_attn
    gen = torch.Generator(device="cuda").manual_seed(d + causal)
    q, k, v = (torch.randn(2, 1000, 3, d, device="cuda", generator=gen).to(dtype)
               for _ in range(3))
    for scale in (None, 0.3):
        out = hopper_attn.attention(q, k, v, causal=causal, softmax_scale=scale)
        ref = _reference(q, k, v, causal, d ** -0.5 if scale is None else scale)
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
            scale=scale).transpose(1, 2)                    # torch's own bf16/fp16 error
        torch_err = (sdpa.float() - ref).abs().max().item()
        assert (out.float() - ref).abs().max().item() <= 2 * torch_err + 2 ** -10


def test_attention_op_under_torch_compile_and_cuda_graphs():
    import hopper_attn
    q, k, v = (torch.randn(1, 512, 4, 128, device="cuda").to(torch.bfloat16) for _ in range(3))
    eager = hopper_attn.attention(q, k, v, causal=True)
    compiled = torch.compile(lambda a, b, c: hopper_attn.attention(a, b, c, causal=True),
                             fullgraph=True)
    assert torch.equal(compiled(q, k, v), eager)
    static = [t.clone() for t in (q, k, v)]
    hopper_attn.attention(*static, causal=True)          # compile and bind outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = hopper_attn.attention(*static, causal=True)
    for t in static:
        t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, hopper_attn.attention(*static, causal=True))


# (q heads, k/v heads, seqlen_k): GQA ratios 1, 2, 3, 8, MQA (6:1 and 8:1), cross-attention
@pytest.mark.parametrize("heads_q,heads_kv,seqlen_k", [(6, 6, 300), (6, 3, 300), (6, 1, 300),
                                                      (6, 6, 77), (6, 2, 1000), (16, 2, 300),
                                                      (8, 1, 300)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("stage", ["k5", "k6"])
def test_attention_op_gqa_and_cross_attention(heads_q, heads_kv, seqlen_k, causal, stage):
    import hopper_attn
    gen = torch.Generator(device="cuda").manual_seed(heads_q * 31 + heads_kv * 7 + seqlen_k + causal)
    q = torch.randn(2, 300, heads_q, 128, device="cuda", generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(2, seqlen_k, heads_kv, 128, device="cuda", generator=gen).to(torch.bfloat16)
            for _ in range(2))
    out, lse = hopper_attn.attention(q, k, v, causal=causal, return_lse=True, stage=stage)
    ref = _reference(q, k, v, causal, 128 ** -0.5)
    ref_lse = _reference_lse(q, k, causal, 128 ** -0.5)
    finite = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite)                  # -inf exactly where no key
    assert (lse[finite] - ref_lse[finite]).abs().max().item() < 1e-3
    group = heads_q // heads_kv
    kk, vv = (t.repeat_interleave(group, dim=2) for t in (k, v))
    nq, nk = 300, seqlen_k
    mask = None
    if causal:                                           # torch SDPA's own bf16 error
        mask = ~torch.ones(nq, nk, dtype=torch.bool, device="cuda").triu(nk - nq + 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), attn_mask=mask
    ).transpose(1, 2).float().nan_to_num(0.0)
    torch_err = (sdpa - ref).abs().max().item()
    assert not out.isnan().any()
    assert (out.float() - ref).abs().max().item() <= 2 * torch_err + 2 ** -10


@pytest.mark.parametrize("causal", [False, True])
def test_attention_op_reads_packed_qkv_in_place(causal):
    import hopper_attn
    qkv = torch.randn(2, 333, 3, 4, 128, device="cuda").to(torch.bfloat16)
    q, k, v = qkv.unbind(2)                              # strided views, no copies
    assert not q.is_contiguous()
    out = hopper_attn.attention(q, k, v, causal=causal)
    same = hopper_attn.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=causal)
    assert torch.equal(out, same)                        # the same bits as contiguous inputs


@pytest.mark.parametrize("d,causal", [(64, False), (128, True), (256, True)])
@pytest.mark.parametrize("name", ["k6"])
def test_k6_persistent_ctas_run_many_work_items(d, causal, name):
    """600+ work items on one CTA per SM: every CTA runs several, in the scheduler's order
    (static, no mask) or as they ask for them (dynamic, with a mask: the check runs twice,
    so the work counter must be back at zero after a launch)."""
    from hopper_attn.harness.checks import ReferenceCase
    from hopper_attn.common.contract import Problem
    problem = Problem(3, 24, 1000, d, causal)
    entry = registry.get(name)
    handle = entry.compile(problem)
    assert handle.describe()["persistent_ctas"] > 0
    verdict = ReferenceCase(problem, seed=d + causal).check(entry, handle)
    assert verdict["ok"], verdict


@pytest.mark.parametrize("batch,heads,seqlen,d", [
    (5, 6, 2100, 128),        # 8 MiB of K and V per group: 30 heads in groups of 7 after 2
    (3, 12, 4100, 64),        # 32 MiB: 36 heads in groups of 31 after 5
    (4, 5, 3000, 256),        # 32 MiB: 20 heads in groups of 10
    (3, 7, 2500, 256),        # 21 heads in groups of 13 after 8
])
def test_k6_longest_first_runs_every_work_item(batch, heads, seqlen, d):
    """With a causal mask (d = 128 and 256: 2k-8k queries, d = 64: 4k-16k) k6's dynamic
    schedule hands out work items head group by head group (scheduler.head_group_order):
    an item skipped would leave NaN rows, one run twice is caught by the reference too;
    twice, so the work counter must be back at zero after a launch."""
    from hopper_attn.harness.checks import ReferenceCase
    from hopper_attn.common.contract import Problem
    problem = Problem(batch, heads, seqlen, d, True)
    entry = registry.get("k6")
    handle = entry.compile(problem)
    assert handle.options["longest_first"] > 0
    verdict = ReferenceCase(problem, seed=d + seqlen).check(entry, handle)
    assert verdict["ok"], verdict


@pytest.mark.parametrize("name,d,causal,seqlen", [
    ("k6", 128, False, 1000),                                   # POLICY's defaults: the
    ("k6", 128, True, 2049),                                    # wait after 7 exp2s,
    ("k6", 192, True, 777),                                     # one PV group,
    ("k6", 256, False, 1000),
    ("k6", 64, True, 4097),                                     # turns, the wait among the
    ("k6", 64, True, 6000),                                     # exp2s, opaque P,
    ("k6", 96, False, 2049),                                    # d = 96's one PV group
    ("k6:skip_idle_wgs=1", 64, False, 1000),                    # idle warpgroups:
    ("k6:skip_idle_wgs=1", 64, True, 2230),                     # the last tile's third
    ("k6:skip_idle_wgs=1", 96, False, 2200),                    # (and second) 64 rows empty
    ("k6:skip_idle_wgs=1", 128, True, 17),
    ("k6:pv_wait=after7", 64, False, 1000),                     # measured, not defaults
    ("k6:pv_wait=after7,pingpong=0", 64, True, 2049),
    ("k6:pv_wait=after14,rescale=eager", 256, False, 1000),
    ("k7:rescale=before_pv", 128, False, 1000),                 # FP8: against its emulation
    ("k7:rescale=before_pv", 128, True, 2049),
    ("k7", 256, False, 777)])
def test_k6_pv_wait_variants_match_fp32(name, d, causal, seqlen):
    """The PV wait among the exp2s (pv_wait="after<n>"), one PV group at d = 96 / 192 / 256
    and the settings measured beside them (rescale="before_pv", skip_idle_wgs, item_end;
    docs/k6.md, docs/k7.md) against fp32, odd lengths, NaN guards around every tensor."""
    from hopper_attn.harness.checks import ReferenceCase
    from hopper_attn.common.contract import Problem
    problem = Problem(2, 3, seqlen, d, causal)
    entry = registry.get(name)
    verdict = ReferenceCase(problem, seed=d + seqlen).check(entry, entry.compile(problem))
    assert verdict["ok"], verdict


@pytest.mark.parametrize("name,d", [("k6", 64), ("k6", 256), ("k6:wg_causal_limit=1,pingpong=0", 128),
                                    ("k6:wg_causal_limit=1", 192)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(300, 1000), (1000, 300), (1000, 1000),
                                               (777, 1333), (2049, 2049), (130, 70)])
def test_k6_wg_causal_limit_matches_fp32(name, d, seqlen_q, seqlen_k):
    """Each warpgroup's own causal limit (k6's `wg_causal_limit`, the default at d = 64 on
    192-row tiles and at d = 256): with queries and keys of other lengths the bottom-right
    diagonal crosses the warpgroups' rows anywhere; against fp32, 2x torch's bf16 error."""
    from hopper_attn.common.contract import Problem
    gen = torch.Generator(device="cuda").manual_seed(seqlen_q * 7 + seqlen_k + d)
    q = torch.randn(2, seqlen_q, 3, d, device="cuda", generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(2, seqlen_k, 3, d, device="cuda", generator=gen).to(torch.bfloat16)
            for _ in range(2))
    entry = registry.get(name)
    problem = Problem.from_tensor(q, True, k)
    out = torch.full_like(q, float("nan"))
    entry.run(entry.compile(problem), *entry.prepare(q, k, v), out)
    ref = _reference(q, k, v, True, d ** -0.5)
    hidden = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device="cuda").triu(
        seqlen_k - seqlen_q + 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=~hidden
    ).transpose(1, 2).float().nan_to_num(0.0)
    torch_err = (sdpa - ref).abs().max().item()
    assert not out.isnan().any()
    assert (out.float() - ref).abs().max().item() <= 2 * torch_err + 2 ** -10


@pytest.mark.parametrize("d,heads,seqlen", [(128, 17, 8193), (128, 5, 8192), (192, 17, 4100),
                                             (192, 3, 5000), (192, 7, 1000)])
def test_k6_stream_k_matches_fp32(d, heads, seqlen):
    """k6's `stream_k` (POLICY's default at d = 128 from 8k queries, d = 192 at all: the
    static schedule's tail spread over all CTAs, an item split across two of them and
    merged): shapes whose item count is no multiple of the grid, so that items are split;
    against fp32 with NaN guards, and the same bits on a second run (the split items' flags
    are reset for the next launch)."""
    from hopper_attn.harness.checks import ReferenceCase
    from hopper_attn.common.contract import Problem
    problem = Problem(4, heads, seqlen, d, False)
    entry = registry.get("k6")
    handle = entry.compile(problem)
    assert handle.options["stream_k"]
    verdict = ReferenceCase(problem, seed=d + seqlen).check(entry, handle)
    assert verdict["ok"], verdict


def _run_twice_against_fp32(name, q, k, v, causal):
    """Run kernel `name` twice into NaN-filled outputs: no NaN left, within 2x torch's bf16
    error of the fp32 reference (+ 2^-10), the same bits both times; returns the handle."""
    from hopper_attn.common.contract import Problem
    entry = registry.get(name)
    handle = entry.compile(Problem.from_tensor(q, causal, k))
    outs = []
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        entry.run(handle, *entry.prepare(q, k, v), out)
        outs.append(out)
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    ref = _reference(q, k, v, causal, q.shape[3] ** -0.5)
    mask = None
    if causal:
        mask = ~torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device="cuda").triu(
            seqlen_k - seqlen_q + 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
    ).transpose(1, 2).float().nan_to_num(0.0)
    torch_err = (sdpa - ref).abs().max().item()
    assert not outs[0].isnan().any()
    assert (outs[0].float() - ref).abs().max().item() <= 2 * torch_err + 2 ** -10
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    return handle


@pytest.mark.parametrize("name,d,seqlen_q,seqlen_k,causal", [
    ("k6", 256, 4000, 4000, False), ("k6", 256, 1000, 1600, False), ("k6", 256, 77, 160, False),
    ("k6:kv_tail=0", 256, 1600, 1600, True), ("k6:kv_tail=0", 128, 333, 1024, False),
    ("k6:kv_tail=0", 64, 1024, 1024, True), ("k6:kv_tail=0", 192, 4032, 4032, False),
    ("k6", 64, 2048, 2048, False), ("k6", 64, 1000, 1536, False), ("k6", 64, 77, 128, False)])
def test_k6_whole_kv_tiles_matches_fp32(name, d, seqlen_q, seqlen_k, causal):
    """A loop without the tail test (`kv_tail=0`, the default at d = 64 and 256 for key
    lengths that are multiples of the kv tile; at d = 64 with the PV wait before the exp2s,
    pv_wait="first"; at d = 192 with stream-K pieces), queries and keys of the same and other lengths:
    against fp32 within 2x torch's bf16 error, every element written, same bits twice."""
    gen = torch.Generator(device="cuda").manual_seed(seqlen_q * 7 + seqlen_k + d)
    q = torch.randn(2, seqlen_q, 3, d, device="cuda", generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(2, seqlen_k, 3, d, device="cuda", generator=gen).to(torch.bfloat16)
            for _ in range(2))
    handle = _run_twice_against_fp32(name, q, k, v, causal)
    assert not handle.describe()["options"]["kv_tail"]


@pytest.mark.parametrize("name,d,causal,dtype,keys", [
    ("k6", 256, False, torch.bfloat16, "growing"), ("k6", 256, True, torch.bfloat16, "growing"),
    ("k6", 256, False, torch.float16, "x4"), ("k6", 256, True, torch.float16, "outliers"),
    ("k6", 192, True, torch.bfloat16, "growing"), ("k6", 192, False, torch.float16, "outliers"),
    ("k6:rescale=lazy_after_wait,pv_wait=late", 128, False, torch.float16, "growing"),
    ("k6:rescale=lazy_after_wait", 192, True, torch.bfloat16, "growing"),     # windows'
    ("k6:rescale=lazy_after_wait", 256, False, torch.float16, "outliers"),
    ("k6", 192, False, torch.bfloat16, "growing"),      # d = 192's lazy_before_pv
    ("k6", 192, True, torch.bfloat16, "outliers")])
def test_k6_lazy_rescale_rounded_sums_match_fp32(name, d, causal, dtype, keys):
    """Lazy rescaling (O rescaled only where a row maximum grew by more than 2^8; the default
    at d = 192 and 256) with P rounded to the input type before the row sums: on keys that
    grow along the sequence (the reference maxima trail the true ones on most tiles), larger
    scores and outlier keys, against fp32 within 2x torch's error in the same dtype, every
    element written, same bits twice."""
    gen = torch.Generator(device="cuda").manual_seed(d * 3 + causal)
    n = 1601
    q = torch.randn(2, n, 3, d, device="cuda", generator=gen)
    k, v = (torch.randn(2, n, 3, d, device="cuda", generator=gen) for _ in range(2))
    if keys == "growing":
        k *= torch.linspace(1.0, 4.0, n, device="cuda")[None, :, None, None]
    elif keys == "x4":
        q, k = q * 2.0, k * 2.0
    elif keys == "outliers":
        for j in (n // 7, n // 3, n - 5):
            k[:, j] *= 40.0
    q, k, v = (t.to(dtype) for t in (q, k, v))
    handle = _run_twice_against_fp32(name, q, k, v, causal)
    assert handle.describe()["options"]["rescale"].startswith("lazy")


def test_k6_runs_more_than_65535_heads():
    """k5 launches one CTA row per head (gridDim.y <= 65535) and refuses; k6 loops."""
    from hopper_attn.common.contract import Problem
    problem = Problem(1, 70000, 17, 64, True)
    assert "65535" in registry.get("k5").spec.unsupported_reason(problem)
    q, k, v = (torch.randn(problem.shape, device="cuda").to(torch.bfloat16) for _ in range(3))
    out = torch.full_like(q, float("nan"))
    entry = registry.get("k6")
    handle = entry.compile(problem)
    assert handle.describe()["persistent_ctas"] > 0
    entry.run(handle, q, k, v, out)
    ref = _reference(q, k, v, True, 64 ** -0.5)
    assert (out.float() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("heads_kv,seqlen_k", [(4, 0), (2, 0), (4, 700), (1, 300)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_attention_backward_matches_fp32(d, causal, heads_kv, seqlen_k):
    """attention(...).backward() (k6 forward, kb2 backward, at d = 192 and 256 with
    dkv_swap_ab) against the fp32 reference gradients, within 2x torch's own bf16 backward
    error on the same inputs."""
    _backward_matches_fp32(2, 4, heads_kv, 500, seqlen_k or 500, d, causal,
                           seed=d + 10 * heads_kv + seqlen_k + causal)


@pytest.mark.parametrize("batch,heads_q,heads_kv,seqlen_q,seqlen_k", [
    (5, 7, 7, 2100, 2100),       # 35 heads in groups of 15 after a first group of 5
    (3, 12, 4, 2500, 2700),      # GQA, seqlen_k > seqlen_q: 36 heads, groups of 13 after 10
    (2, 10, 10, 5000, 5000),     # 20 heads in groups of 6 after a first group of 2
    (5, 13, 13, 1000, 1000),     # 8 kv tiles: one head at a time (no reordering)
])
def test_kb2_longest_first_visits_every_kv_tile_once(batch, heads_q, heads_kv, seqlen_q,
                                                    seqlen_k):
    """With a causal mask at d = 128 kb2's 1-D grid takes heads in groups of 32 MiB of Q,
    dO and dQ, the first one smaller (masking.KVTileSchedule): a kv tile skipped would
    leave its dK / dV rows unwritten, one visited twice would add its dQ twice."""
    _backward_matches_fp32(batch, heads_q, heads_kv, seqlen_q, seqlen_k, 128, True,
                           seed=batch + heads_q + seqlen_q)


def _backward_matches_fp32(batch, heads_q, heads_kv, nq, nk, d, causal, seed):
    import hopper_attn
    from hopper_attn.harness.grad_check import _torch_lowp_grads
    from hopper_attn.harness.reference_backward import attention_backward, forward_with_lse
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, do = (torch.randn(batch, nq, heads_q, d, device="cuda", generator=gen)
             .to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(batch, nk, heads_kv, d, device="cuda", generator=gen).to(torch.bfloat16)
            for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    hopper_attn.attention(*leaves, causal=causal).backward(do)
    o, lse = forward_with_lse(q, k, v, causal)
    ref = attention_backward(q, k, v, o, lse, do, causal)
    lowp = _torch_lowp_grads(q, k, v, do, causal)
    for name, leaf, r, t in zip("qkv", leaves, ref, lowp):
        grad = leaf.grad.float()
        torch_err = (t.float() - r).abs().max().item()
        err = (grad - r).abs().max().item()
        assert not grad.isnan().any(), name
        assert err <= 2 * torch_err + 2 ** -12 * max(1.0, r.abs().max().item()), (name, err,
                                                                                   torch_err)


def test_attention_backward_under_torch_compile():
    import hopper_attn
    q, k, v = (torch.randn(1, 256, 2, 64, device="cuda").to(torch.bfloat16) for _ in range(3))

    def loss(a, b, c):
        return hopper_attn.attention(a, b, c, causal=True).float().square().sum()

    grads = []
    for fn in (loss, torch.compile(loss, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fn(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for eager, traced in zip(*grads):                    # dQ's fp32 adds may reorder: close
        assert torch.allclose(eager.float(), traced.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("batch,heads,seqlen,d", [
    (2, 4, 1000, 128),
    (5, 7, 2100, 128),      # longest first: 35 heads in groups of 16 after 3
    (3, 4, 2100, 64),       # longest first (the deterministic mode's order at d = 64 too)
    (2, 4, 1000, 96), (3, 9, 2100, 192),        # issue 63 (192: 8-head groups)
])
def test_attention_backward_deterministic_mode_gives_the_same_bits(batch, heads, seqlen, d):
    import hopper_attn
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, do = (torch.randn(batch, seqlen, heads, d, device="cuda", generator=gen)
                   .to(torch.bfloat16) for _ in range(4))
    grads = []
    for _ in range(3):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        hopper_attn.attention(*leaves, causal=True, deterministic=True).backward(do)
        grads.append([t.grad.view(torch.int16) for t in leaves])
    for first, again in zip(grads[0], grads[1]):
        assert torch.equal(first, again)
    for first, again in zip(grads[0], grads[2]):
        assert torch.equal(first, again)


@pytest.mark.parametrize("heads_q,heads_kv,seqlen_k", [(6, 2, 300), (6, 6, 77), (6, 6, 1000)])
@pytest.mark.parametrize("causal", [False, True])
def test_k7_gqa_and_cross_attention(heads_q, heads_kv, seqlen_k, causal):
    """GQA and cross-attention in FP8, against the fp32 reference on the dequantized inputs,
    within 2x the FP8 emulation's error (V given sequence-major, packed). q and k scaled
    for fp16 scores (k7's default at d = 128; one k descale per group of query heads)."""
    from hopper_attn import k7
    from hopper_attn.common.contract import Problem
    from hopper_attn.quantize import dequantize_fp8, quantize_fp8, quantize_qk_f16_scores
    gen = torch.Generator(device="cuda").manual_seed(heads_kv * 7 + seqlen_k + causal)
    q = torch.randn(2, 300, heads_q, 128, device="cuda", generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(2, seqlen_k, heads_kv, 128, device="cuda", generator=gen)
            .to(torch.bfloat16) for _ in range(2))
    q8, k8, dq, dk = quantize_qk_f16_scores(q, k, 128 ** -0.5)
    v8, dv = quantize_fp8(v)
    problem = Problem.from_tensor(q, causal, k=k)
    handle = k7.compile_kernel(problem)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    k7.run_kernel(handle, q8, k8, k7.pack_v(v8), dq, dk, dv, out)
    torch.cuda.synchronize()
    deq = [dequantize_fp8(t, s) for t, s in ((q8, dq), (k8, dk), (v8, dv))]
    ref = _reference(*deq, causal, 128 ** -0.5)
    emulated = _reference_fp8(*deq, causal, 128 ** -0.5)
    assert not out.isnan().any()
    limit = 2 * (emulated - ref).abs().max().item() + 2 ** -10
    assert (out.float() - ref).abs().max().item() <= limit


@pytest.mark.parametrize("causal", [False, True])
def test_k7_strided_inputs(causal):
    """q and k as views of one packed (B, N, 4, H, d) e4m3 tensor whose unused slots hold
    NaN (v packed for the kernel in its own buffer): the output must match the same inputs
    made contiguous, bit for bit."""
    from hopper_attn import k7
    from hopper_attn.common.contract import Problem
    gen = torch.Generator(device="cuda").manual_seed(11 + causal)
    q, k, v = (torch.randn(2, 333, 4, 128, device="cuda", generator=gen).to(torch.bfloat16)
               for _ in range(3))
    q8, k8, v8, dq, dk, dv = k7.prepare_inputs(q, k, v)
    packed = torch.full((2, 333, 4, 4, 128), 0x7F, dtype=torch.uint8, device="cuda")  # e4m3 NaN
    for i, t in enumerate((q8, k8)):
        packed[:, :, i] = t.view(torch.uint8)
    views = [packed[:, :, i].view(q8.dtype) for i in range(2)] + [v8]
    assert not views[0].is_contiguous()
    problem = Problem.from_tensor(q, causal)
    outs = []
    for inputs in (views, (q8, k8, v8)):
        handle = k7.compile_kernel(problem)
        out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
        k7.run_kernel(handle, *inputs, dq, dk, dv, out)
        torch.cuda.synchronize()
        outs.append(out)
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


@pytest.mark.parametrize("causal", [False, True])
def test_k7_strided_packed_v(causal):
    """A packed V that is a view into a larger buffer (its (batch, heads, d, keys) buffer has
    64 more keys, all e4m3 NaN, and one more head): the same output bits as the packed V in
    its own buffer."""
    from hopper_attn import k7
    from hopper_attn.common.contract import Problem
    gen = torch.Generator(device="cuda").manual_seed(5 + causal)
    q, k, v = (torch.randn(2, 333, 3, 128, device="cuda", generator=gen).to(torch.bfloat16)
               for _ in range(3))
    q8, k8, v8, dq, dk, dv = k7.prepare_inputs(q, k, v)
    n16 = v8.shape[1]
    big = torch.full((2, 4, 128, n16 + 64), 0x7F, dtype=torch.uint8, device="cuda")
    big[:, 1:, :, :n16] = v8.permute(0, 2, 3, 1).view(torch.uint8)
    v_view = big[:, 1:, :, :n16].permute(0, 3, 1, 2).view(v8.dtype)
    assert not v_view.is_contiguous() and v_view.stride(1) == 1
    handle = k7.compile_kernel(Problem.from_tensor(q, causal))
    outs = []
    for v_in in (v_view, v8):
        out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
        k7.run_kernel(handle, q8, k8, v_in, dq, dk, dv, out)
        torch.cuda.synchronize()
        outs.append(out)
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_k7_log_sum_exp(d, causal):
    """k7's LSE (its workspace): the descaled scores' log-sum-exp, with the 2^8 that P
    carries removed, against fp32 on the dequantized inputs (S itself is exact up to fp32
    accumulation there, so the tolerance is tight)."""
    from hopper_attn import k7
    from hopper_attn.common.contract import Problem
    from hopper_attn.quantize import dequantize_fp8
    gen = torch.Generator(device="cuda").manual_seed(d + causal)
    q, k, v = (torch.randn(2, 333, 3, d, device="cuda", generator=gen).to(torch.bfloat16)
               for _ in range(3))
    q8, k8, v8, dq, dk, dv = k7.prepare_inputs(q, k, v)
    handle = k7.compile_kernel(Problem.from_tensor(q, causal))
    out = torch.empty_like(q)
    k7.run_kernel(handle, q8, k8, v8, dq, dk, dv, out)
    torch.cuda.synchronize()
    lse = handle.workspace[0]
    ref = _reference_lse(dequantize_fp8(q8, dq), dequantize_fp8(k8, dk), causal, d ** -0.5)
    assert (lse - ref).abs().max().item() < 2e-3


@pytest.mark.parametrize("d", [128, 256])
def test_quantize_qk_f16_scores_fused_matches_torch(d):
    """quantize_qk_f16_scores through the GPU quantizer's amax and cast kernels: the bytes
    and descales of its torch path (GQA: 6 query heads, 2 k/v heads)."""
    from hopper_attn.quantize import quantize_qk_f16_scores
    gen = torch.Generator(device="cuda").manual_seed(d)
    q = torch.randn(2, 333, 6, d, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(2, 200, 2, d, device="cuda", generator=gen).to(torch.bfloat16)
    fused = quantize_qk_f16_scores(q, k, d ** -0.5, fused=True)
    plain = quantize_qk_f16_scores(q, k, d ** -0.5, fused=False)
    for a, b in zip(fused, plain):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("seqlen", [1, 17, 1000])
@pytest.mark.parametrize("pack_v", [False, True])
def test_fused_quantizer_matches_torch(d, dtype, seqlen, pack_v):
    """quantize_fp8(fused=True) (two CuTe DSL kernels) against the torch path on the same
    input: the same e4m3 bytes and descales. The input is a view of a (B, N + 5, 2, H, d)
    buffer (its other slot and the rows past N hold 1e4, which would raise an amax read out of
    bounds), with one loud head and one all-zero slice."""
    from hopper_attn.quantize import quantize_fp8
    gen = torch.Generator(device="cuda").manual_seed(seqlen + d)
    big = torch.full((2, seqlen + 5, 2, 3, d), 1e4, dtype=dtype, device="cuda")
    x = big[:, :seqlen, 1]
    x.copy_(torch.randn(x.shape, device="cuda", generator=gen).to(dtype))
    x[:, :, 1] *= 50.0
    x[1, :, 2] = 0.0
    fused, descale_fused = quantize_fp8(x, pack_v=pack_v, fused=True)
    plain, descale = quantize_fp8(x, pack_v=pack_v)
    torch.cuda.synchronize()
    assert fused.shape == plain.shape and fused.stride() == plain.stride()
    assert torch.equal(descale_fused, descale)
    assert torch.equal(fused.view(torch.uint8), plain.view(torch.uint8))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_quantizer_rotation(d, dtype):
    """quantize_fp8(fused=True, rotate_signs=s) (the fast Walsh-Hadamard transform in the
    kernels) against the torch path (x @ R in fp32, another summation order): descales equal
    to fp32 rounding, and all but a few e4m3 values equal (the rest one e4m3 step apart:
    values that sat within fp32 rounding of a rounding boundary)."""
    from hopper_attn import k8
    from hopper_attn.quantize import dequantize_fp8, quantize_fp8
    gen = torch.Generator(device="cuda").manual_seed(d)
    x = torch.randn(2, 1000, 3, d, device="cuda", generator=gen).to(dtype)
    x[..., 5] *= 30.0                                            # an outlier channel
    signs = k8.signs(d, seed=1)
    fused, descale_fused = quantize_fp8(x, fused=True, rotate_signs=signs)
    plain, descale = quantize_fp8(x, rotate_signs=signs)
    torch.cuda.synchronize()
    assert torch.allclose(descale_fused, descale, rtol=1e-5, atol=0)
    differ = fused.view(torch.uint8) != plain.view(torch.uint8)
    assert differ.sum().item() <= max(4, differ.numel() // 10000)
    a, b = dequantize_fp8(fused, descale_fused), dequantize_fp8(plain, descale)
    step = descale.max().item() * 2.0 ** -9           # e4m3's subnormal step, dequantized
    assert ((a - b).abs() <= 0.13 * b.abs() + step).all()


@pytest.mark.parametrize("name,d,causal,seqlen", [
    ("k7:out_fp8=1", 128, False, 1000), ("k7:out_fp8=1", 128, True, 2049),
    ("k7:out_fp8=1", 64, True, 17), ("k7:out_fp8=1", 64, False, 4100),
    ("k7:out_fp8=1", 256, False, 113), ("k7:out_fp8=1", 256, True, 1000),
    ("k8:out_fp8=1", 128, False, 777)])
def test_k7_fp8_output_matches_its_emulation(name, d, causal, seqlen):
    """An e4m3 output (out_fp8): read through v's descale, within 2x the error of the FP8
    emulation with its output rounded to e4m3 likewise; NaN guards around out (one byte per
    element), the same bits twice."""
    from hopper_attn.harness.checks import ReferenceCase
    from hopper_attn.common.contract import Problem
    problem = Problem(2, 3, seqlen, d, causal)
    entry = registry.get(name)
    verdict = ReferenceCase(problem, seed=d + seqlen).check(entry, entry.compile(problem))
    assert verdict["ok"], verdict


def test_attention_fp8_e4m3_output():
    """attention_fp8(out_dtype=e4m3): (out8, descale_o) whose product is the bf16-output
    kernel's result rounded to e4m3 (within one e4m3 step: the two round from fp32 and from
    bf16), GQA; other dtypes refused."""
    import hopper_attn
    from hopper_attn.quantize import dequantize_fp8
    gen = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(2, 700, 4, 128, device="cuda", generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(2, 700, 2, 128, device="cuda", generator=gen).to(torch.bfloat16)
            for _ in range(2))
    out = hopper_attn.attention_fp8(q, k, v, causal=True)
    out8, descale_o, lse = hopper_attn.attention_fp8(q, k, v, causal=True, return_lse=True,
                                                     out_dtype=torch.float8_e4m3fn)
    assert out8.dtype == torch.float8_e4m3fn and descale_o.shape == (2, 4)
    assert torch.equal(lse, hopper_attn.attention_fp8(q, k, v, causal=True,
                                                      return_lse=True)[1])
    units = out.float() / descale_o[:, None, :, None]                # out in v8's units
    step = torch.maximum(units.abs(), torch.tensor(2.0 ** -6, device="cuda")) * 2.0 ** -3
    assert ((dequantize_fp8(out8, descale_o).float() / descale_o[:, None, :, None]
             - units).abs() <= step * 1.01).all()
    with pytest.raises(ValueError, match="float16"):
        hopper_attn.attention_fp8(q, k, v, out_dtype=torch.float16)


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_fp8(rotate, causal):
    """hopper_attn.attention_fp8 (quantize on the GPU, then k7 / k8) gives the bits of the
    stage run by hand on prepare_inputs, its LSE, and an FP8-sized error against fp32 (GQA,
    cross-attention length)."""
    import hopper_attn
    from hopper_attn import k7, k8
    from hopper_attn.common.contract import Problem
    gen = torch.Generator(device="cuda").manual_seed(3 + causal + 2 * rotate)
    q = torch.randn(2, 333, 4, 128, device="cuda", generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(2, 401, 2, 128, device="cuda", generator=gen).to(torch.bfloat16)
            for _ in range(2))
    out, lse = hopper_attn.attention_fp8(q, k, v, causal=causal, rotate=rotate,
                                         return_lse=True)
    stage = k8 if rotate else k7
    handle = stage.compile_kernel(Problem.from_tensor(q, causal, k))
    by_hand = torch.empty_like(q)
    stage.run_kernel(handle, *stage.prepare_inputs(q, k, v), by_hand)
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), by_hand.view(torch.int16))
    assert torch.equal(lse, handle.workspace[0])
    ref = _reference(q, k, v, causal, 128 ** -0.5)
    rel = ((out.float() - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
    assert rel < 0.1                                  # ~5% measured (docs/k8.md)
