"""Context parallelism (hopper_attn/context_parallel.py): the layout, the ring's schedule, the
LSE merge and the whole ring (simulated in one process, and over gloo with CPU processes)
with a pure-torch stand-in for the per-block kernels, on CPU; the real kernels on the GPU."""

import math
import os

import pytest
import torch

from hopper_attn import context_parallel as cp


# ------------------------------------------------------------------ stand-ins -----------

def _scores(q, k, causal, scale, visible=None):
    """(B, H, Nq, Nk) scores in q's dtype; GQA by repeating k's heads; causal bottom-right;
    `visible` (Nq, Nk) bool: a mask of its own instead."""
    k = k.to(q.dtype).repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if causal:
        nq, nk = q.shape[1], k.shape[1]
        hidden = torch.ones(nq, nk, dtype=torch.bool).triu(nk - nq + 1)
        s = s.masked_fill(hidden, float("-inf"))
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    return s


def torch_block_forward(q, k, v, causal, scale, visible=None):
    s = _scores(q, k, causal, scale, visible)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    vv = v.to(q.dtype).repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    return torch.einsum("bhij,bjhd->bihd", p, vv), lse


def torch_block_backward(q, k, v, out, dout, lse, causal, scale, visible=None):
    """The recomputation backward from the FINAL out and LSE (what the kernel op does)."""
    group = q.shape[2] // k.shape[2]
    s = _scores(q, k, causal, scale, visible)
    p = torch.exp(s - lse.to(s.dtype)[..., None]).nan_to_num(0.0)         # (B, H, i, j)
    vv = v.to(q.dtype).repeat_interleave(group, dim=2)
    kk = k.to(q.dtype).repeat_interleave(group, dim=2)
    dout, out = dout.to(q.dtype), out.to(q.dtype)
    dv = torch.einsum("bhij,bihd->bjhd", p, dout)
    dp = torch.einsum("bihd,bjhd->bhij", dout, vv)
    rows = (dout * out).sum(-1).transpose(1, 2)                             # (B, H, i)
    ds = p * (dp - rows[..., None])
    dq = torch.einsum("bhij,bjhd->bihd", ds, kk) * scale
    dk = torch.einsum("bhij,bihd->bjhd", ds, q) * scale

    def fold(t):                       # GQA: a k/v head's gradient sums over its group
        b, n, h, d = t.shape
        return t.reshape(b, n, h // group, group, d).sum(3)
    return dq, fold(dk), fold(dv)


def full_attention(q, k, v, causal, scale=None, visible=None):
    """Differentiable plain attention (autograd gives the reference gradients)."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    p = torch.softmax(_scores(q, k, causal, scale, visible), -1)
    vv = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    return torch.einsum("bhij,bjhd->bihd", p, vv)


STAND_INS = dict(block_forward=torch_block_forward, block_backward=torch_block_backward)


# ------------------------------------------------------------------ layout --------------

@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_split_merge_round_trip(layout, world_size):
    n = 2 * world_size * 5
    x = torch.arange(2 * n * 3).reshape(2, n, 3, 1)
    shards = cp.split_sequence(x, world_size, layout)
    assert len(shards) == world_size and all(s.shape == (2, n // world_size, 3, 1)
                                            for s in shards)
    assert torch.equal(cp.merge_sequence(shards, layout), x)
    lse = torch.randn(2, 3, n)                                   # the LSE's sequence dim
    assert torch.equal(cp.merge_sequence(cp.split_sequence(lse, world_size, layout, dim=2),
                                         layout, dim=2), lse)
    if layout == "zigzag":
        chunk = n // (2 * world_size)
        for r, shard in enumerate(shards):
            assert torch.equal(shard, cp.zigzag_shard(x, r, world_size))
            assert torch.equal(shard, cp.zigzag_split(x, world_size)[r])
            first, last = shard[0, 0, 0, 0].item() // 3, shard[0, chunk, 0, 0].item() // 3
            assert (first // chunk, last // chunk) == (r, 2 * world_size - 1 - r)
        assert torch.equal(cp.zigzag_merge(shards), x)


def test_split_refuses_uneven_lengths():
    with pytest.raises(ValueError, match="multiple of 8"):
        cp.split_sequence(torch.zeros(1, 12, 1, 1), 4, "zigzag")
    with pytest.raises(ValueError, match="multiple"):
        cp.zigzag_shard(torch.zeros(1, 6, 1, 1), 0, 2)
    with pytest.raises(ValueError, match="layout"):
        cp.split_sequence(torch.zeros(1, 8, 1, 1), 2, "striped")


# ------------------------------------------------------------------ schedule ------------

def _all_pairs(world_size, causal, layout, local_len=4):
    """{(q chunk, kv chunk): [kinds]} over every rank and step, and the work of each
    (rank, step) in chunk x chunk units (a diagonal pair counts one half)."""
    covered, work = {}, {}
    for rank in range(world_size):
        for step in range(world_size):
            task = cp.block_task(rank, world_size, step, causal, layout, local_len, local_len)
            units = 0.0
            if task is not None:
                assert task.kv_rank == (rank - step) % world_size
                for pair, kind in cp.task_chunk_pairs(task, rank, world_size, layout,
                                                      local_len).items():
                    covered.setdefault(pair, []).append(kind)
                    units += {"full": 1.0, "diagonal": 0.5, "masked": 0.0}[kind]
            work[rank, step] = units
    return covered, work


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world_size", range(1, 9))
def test_schedule_covers_every_visible_pair_once(world_size, causal, layout):
    covered, work = _all_pairs(world_size, causal, layout)
    chunks = world_size * (2 if layout == "zigzag" else 1)
    for i in range(chunks):
        for j in range(chunks):
            kinds = [k for k in covered.get((i, j), []) if k != "masked"]
            if not causal or i > j:
                assert kinds == ["full"], (i, j, kinds)
            elif i == j:
                assert kinds == ["diagonal"], (i, j, kinds)
            else:
                assert kinds == [], (i, j, kinds)          # never computed unmasked
    if causal and layout == "zigzag":
        # no fully masked block is handed to the kernel except inside the diagonal step
        for (i, j), kinds in covered.items():
            assert kinds.count("masked") <= 1 and (kinds != ["masked"] or i < j)


@pytest.mark.parametrize("world_size", range(1, 9))
def test_zigzag_balances_every_step(world_size):
    _, work = _all_pairs(world_size, True, "zigzag")
    for step in range(world_size):
        assert {work[r, step] for r in range(world_size)} == {2.0}, step
    # the contiguous layout does not: the last rank works 2W - 1 times the first
    _, flat = _all_pairs(world_size, True, "contiguous", local_len=1)
    totals = [sum(flat[r, s] for s in range(world_size)) for r in range(world_size)]
    assert totals == [r + 0.5 for r in range(world_size)]


def test_docs_picture_matches_the_schedule():
    """docs/context-parallel.md draws who computes which block at W = 4: it must be this."""
    world_size, grid = 4, {}
    for rank in range(world_size):
        for step in range(world_size):
            task = cp.block_task(rank, world_size, step, True, "zigzag", 2, 2)
            for pair, kind in cp.task_chunk_pairs(task, rank, world_size, "zigzag", 2).items():
                if kind != "masked":
                    grid[pair] = f"{rank}{'abcd'[step]}" + ("\\" if kind == "diagonal" else "")
    docs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                        "context-parallel.md")
    rows = [line.split(":", 1)[1].split() for line in open(docs)
            if line.strip().startswith("q ") and line.strip()[2:3].isdigit()]
    assert rows == [[grid.get((i, j), ".") for j in range(8)] for i in range(8)]


def test_non_causal_block_task_takes_everything():
    task = cp.block_task(2, 4, 3, False, "zigzag", 6, 10)
    assert (task.kv_rank, task.q_rows, task.kv_rows, task.causal) == (3, slice(0, 6),
                                                                      slice(0, 10), False)


# ------------------------------------------------------------------ LSE merge -----------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merge_partials_matches_one_softmax(dtype):
    gen = torch.Generator().manual_seed(0)
    b, h, n, nk, d = 2, 3, 7, 12, 5
    s = torch.randn(b, h, n, nk, generator=gen, dtype=dtype) * 4
    s[0, 0, 1] += 3000.0                          # a large row: relative weights only
    v = torch.randn(b, nk, h, d, generator=gen, dtype=dtype)
    owner = torch.randint(0, 3, (nk,), generator=gen)        # keys split into 3 partials
    hidden = torch.rand(b, h, n, nk, generator=gen) < 0.3
    hidden[0, 1, 2] = True                                   # a row that sees no key at all
    hidden[1, 2, :, owner == 1] = True                       # partial 1 sees nothing there
    s = s.masked_fill(hidden, float("-inf"))

    def partial(cols):
        ss = s[..., cols]
        lse = torch.logsumexp(ss, -1)
        p = torch.exp(ss - lse[..., None]).nan_to_num(0.0)
        return torch.einsum("bhij,bjhd->bihd", p, v[:, cols]), lse

    out, lse = torch.zeros(b, n, h, d, dtype=dtype), torch.full((b, h, n), float("-inf"),
                                                                dtype=dtype)
    for part in range(3):
        out, lse = cp.merge_partials(out, lse, *partial(owner == part))
    want_out, want_lse = partial(torch.ones(nk, dtype=torch.bool))
    assert out.dtype == lse.dtype == torch.promote_types(dtype, torch.float32)
    assert not out.isnan().any() and not lse.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert torch.allclose(lse, want_lse, atol=tol, rtol=tol)            # -inf == -inf
    # the row near 3000: fp32 holds its LSE to 2^-12 absolute, so its weights to ~1e-4
    big = 1e-3 if dtype == torch.float32 else tol
    assert torch.allclose(out[0, 1, 0], want_out[0, 1, 0], atol=big, rtol=big)
    out[0, 1, 0] = want_out[0, 1, 0]
    assert torch.allclose(out, want_out, atol=tol, rtol=tol)
    assert lse[0, 1, 2] == float("-inf") and (out[0, 2, 1] == 0).all()


def test_merge_partials_of_low_precision_partials_is_fp32():
    out = torch.randn(1, 4, 2, 8).to(torch.bfloat16)
    lse = torch.randn(1, 2, 4)
    merged, merged_lse = cp.merge_partials(out, lse, out, lse)
    assert merged.dtype == merged_lse.dtype == torch.float32
    assert torch.allclose(merged, out.float()) and torch.allclose(merged_lse, lse + math.log(2))


# ------------------------------------------------------------------ simulated ring ------

def _inputs(b, nq, nk, hq, hk, d, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nq, hq, d, generator=gen, dtype=dtype)
    k, v = (torch.randn(b, nk, hk, d, generator=gen, dtype=dtype) for _ in range(2))
    do = torch.randn(b, nq, hq, d, generator=gen, dtype=dtype)
    return q, k, v, do


def _grads(fn, q, k, v, do):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(do)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_simulated_ring_matches_full_attention_fp64(world_size, causal, layout, heads):
    per = 2 * world_size * 3                         # 3 rows per chunk (odd)
    q, k, v, do = _inputs(2, per, per, *heads, 8, seed=world_size + 10 * causal)
    ring = lambda a, b, c: cp.simulate_ring(a, b, c, world_size, causal=causal,  # noqa: E731
                                            layout=layout, **STAND_INS)
    out, grads = _grads(ring, q, k, v, do)
    want, want_grads = _grads(lambda a, b, c: full_attention(a, b, c, causal), q, k, v, do)
    assert torch.allclose(out, want, atol=1e-12, rtol=1e-10)
    for name, g, w in zip("qkv", grads, want_grads):
        assert torch.allclose(g, w, atol=1e-11, rtol=1e-9), name


@pytest.mark.parametrize("causal", [False, True])
def test_simulated_ring_odd_local_lengths_contiguous(causal):
    """The contiguous layout takes any local length (5 rows per rank here); the zigzag one
    needs two equal chunks per rank."""
    q, k, v, do = _inputs(2, 15, 15, 4, 2, 8, seed=11)
    ring = lambda a, b, c: cp.simulate_ring(a, b, c, 3, causal=causal,  # noqa: E731
                                            layout="contiguous", **STAND_INS)
    out, grads = _grads(ring, q, k, v, do)
    want, want_grads = _grads(lambda a, b, c: full_attention(a, b, c, causal), q, k, v, do)
    assert torch.allclose(out, want, atol=1e-12, rtol=1e-10)
    for g, w in zip(grads, want_grads):
        assert torch.allclose(g, w, atol=1e-11, rtol=1e-9)
    with pytest.raises(ValueError, match="multiple of 6"):
        cp.simulate_ring(q, k, v, 3, causal=causal, **STAND_INS)


@pytest.mark.parametrize("world_size", [2, 4])
def test_simulated_ring_cross_lengths_and_scale_fp32(world_size):
    """Non-causal with more keys than queries, GQA, an explicit scale; fp32 inputs."""
    q, k, v, do = _inputs(1, 4 * world_size, 10 * world_size, 4, 2, 16, torch.float32, 3)
    ring = lambda a, b, c: cp.simulate_ring(a, b, c, world_size, softmax_scale=0.3,  # noqa
                                            **STAND_INS)
    out, grads = _grads(ring, q, k, v, do)
    want, want_grads = _grads(lambda a, b, c: full_attention(a, b, c, False, 0.3), q, k, v,
                              do)
    assert torch.allclose(out, want, atol=2e-6, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        assert torch.allclose(g, w, atol=2e-5, rtol=1e-4)


def test_simulated_ring_returns_the_global_lse():
    q, k, v, _ = _inputs(1, 16, 16, 2, 2, 4)
    out, lse = cp.simulate_ring(q, k, v, 4, causal=True, return_lse=True, **STAND_INS)
    _, want = torch_block_forward(q, k, v, True, 0.5)
    assert torch.allclose(lse, want, atol=1e-12)


def test_ring_refuses_what_it_cannot_run():
    q, k, v, _ = _inputs(1, 12, 12, 2, 2, 4)
    with pytest.raises(ValueError, match="multiple of 8"):
        cp.simulate_ring(q, k, v, 4, causal=True, **STAND_INS)
    with pytest.raises(ValueError, match="same local query and key rows"):
        cp.simulate_ring(q, k[:, :8], v[:, :8], 2, causal=True, **STAND_INS)
    with pytest.raises(ValueError, match="even"):
        cp._check_local(q[:, :5], k[:, :5], v[:, :5], True, "zigzag")
    with pytest.raises(ValueError, match="multiple of k's"):
        cp.simulate_ring(q, k[:, :, :1].repeat(1, 1, 3, 1), v[:, :, :1].repeat(1, 1, 3, 1),
                         2, **STAND_INS)
    with pytest.raises(ValueError, match="layout"):
        cp.simulate_ring(q, k, v, 2, layout="striped", **STAND_INS)


# ------------------------------------------------------------------ bf16 partials -------

def _kernel_like(block_op, dtype):
    """A per-block op with a kernel's precision: fp32 inside, its 4-D outputs (O; dQ, dK,
    dV) rounded to `dtype` (None: left fp32); the LSE stays fp32."""
    def op(*args):
        args = [a.float() if torch.is_tensor(a) and a.dim() == 4 else a for a in args]
        return tuple(r.to(dtype) if dtype is not None and r.dim() == 4 else r
                     for r in block_op(*args))
    return op


def test_ring_error_comes_from_the_bf16_partials():
    """The GPU case where the ring's dV error was 2.5x torch's (W = 2, no mask, 300 rows per
    rank = chunks of 150, GQA 2:1, d 128), with bf16 inputs and a stand-in that, like the
    kernels, computes in fp32 and returns bf16 O / dQ / dK / dV per block. With fp32 block
    outputs the ring is as accurate as one call: merge and accumulations (fp32) lose
    nothing. With bf16 ones its dV is exactly the fp32 sum of the W ranks' bf16-rounded
    partials, rounded once: the per-step rounding is all the extra error, and it makes the
    ring's dV error exceed one call's."""
    world_size, per_rank = 2, 300
    q, k, v, do = (t.to(torch.bfloat16) for t in
                   _inputs(1, world_size * per_rank, world_size * per_rank, 4, 2, 128,
                           torch.float32, seed=402))
    exact = [t.double() for t in (q, k, v, do)]
    want, want_grads = _grads(lambda a, b, c: full_attention(a, b, c, False), *exact)

    def errors(world, dtype):
        ops = dict(block_forward=_kernel_like(torch_block_forward, dtype),
                   block_backward=_kernel_like(torch_block_backward, dtype))
        out, grads = _grads(lambda a, b, c: cp.simulate_ring(a, b, c, world, **ops),
                            q, k, v, do)
        got = [out, *grads]
        return got, [(g.double() - w).abs().max().item()
                     for g, w in zip(got, [want, *want_grads])]

    # one call (W = 1): its outputs' rounding is the final one, bf16 block outputs or not
    _, single = errors(1, torch.bfloat16)
    _, ring32 = errors(world_size, None)
    for r, s in zip(ring32, single):           # only the final bf16 rounding: the same
        assert abs(r - s) <= 0.02 * s, (ring32, single)
    (out, dq, dk, dv), ring = errors(world_size, torch.bfloat16)
    # the model: each rank's dV partial (its queries against all keys) rounded to bf16,
    # the two added in fp32, the sum rounded once
    lse = torch.logsumexp(_scores(*exact[:2], False, 128 ** -0.5), -1)
    p = torch.exp(_scores(*exact[:2], False, 128 ** -0.5) - lse[..., None])
    def ulp(x):                                # of bf16 at |x| (8 significant bits)
        return 2.0 ** (torch.floor(torch.log2(x.abs().clamp_min(2 ** -60))) - 7)
    model = torch.zeros(dv.shape, dtype=torch.float32)
    slack = torch.zeros(dv.shape, dtype=torch.float64)
    rows = cp.split_sequence(torch.arange(q.shape[1]), world_size, dim=0)
    for r in range(world_size):
        part = torch.einsum("bhij,bihd->bjhd", p[:, :, rows[r]], exact[3][:, rows[r]])
        part = part.reshape(*dv.shape[:2], 2, 2, 128).sum(3)
        model += part.to(torch.bfloat16).float()
        slack += ulp(part)       # fp32 vs fp64 may round a partial near a tie the other way
    model = model.to(torch.bfloat16).float()
    assert ((dv.float() - model).abs() <= slack + ulp(model)).all()
    assert (dv.float() == model).float().mean() > 0.99
    ratio = [r / s for r, s in zip(ring, single)]
    assert ratio[3] > 1.3, ratio               # dV: 1.7x one call's error here
    assert all(r < 3.0 for r in ratio), ratio  # <= 3 half-ulps where one call has one


# ------------------------------------------------------------------ packed documents ----

def _piece_mask(block, causal, nq, nk):
    """(nq, nk) bool: what a varlen call over `block` (a cp.DocumentBlock) lets each query
    see: its own sequence's keys, causal bottom-right per sequence. Checks the pieces fit
    the block and max_seqlen bounds them."""
    cq, ck = block.cu_seqlens_q.tolist(), block.cu_seqlens_k.tolist()
    assert len(cq) == len(ck) and cq[0] == ck[0] == 0 and (cq[-1], ck[-1]) == (nq, nk)
    visible = torch.zeros(nq, nk, dtype=torch.bool)
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        assert 0 <= lq <= block.max_seqlen_q and 0 <= lk <= block.max_seqlen_k
        piece = torch.ones(lq, lk, dtype=torch.bool)
        visible[cq[b]:cq[b + 1], ck[b]:ck[b + 1]] = piece.tril(lk - lq) if causal else piece
    return visible


def _document_mask(cu_seqlens, n, causal):
    """(n, n) bool: the whole packed sequence's mask (same document; causal: and earlier)."""
    doc = torch.bucketize(torch.arange(n), cu_seqlens[1:].long(), right=True)
    visible = doc[:, None] == doc[None, :]
    return visible.tril() if causal else visible


def _documents(n, seed):
    """Random documents over n tokens: int32 offsets with an empty document, one of length
    1 and one long one (crossing several chunks) among them; and the longest length."""
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randint(1, n, (max(2, n // 4),), generator=gen).tolist()
    cuts += [cuts[0], min(cuts[0] + 1, n)]                    # empty and length-1 documents
    cuts = sorted(c for c in cuts if not n // 3 < c < 2 * n // 3)   # one long document
    cu = torch.tensor([0, *cuts, n], dtype=torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def torch_varlen_block_forward(q, k, v, causal, scale, block):
    visible = _piece_mask(block, causal, q.shape[0], k.shape[0])
    out, lse = torch_block_forward(q[None], k[None], v[None], False, scale, visible)
    return out[0], lse[0]


def torch_varlen_block_backward(q, k, v, out, dout, lse, causal, scale, block):
    visible = _piece_mask(block, causal, q.shape[0], k.shape[0])
    grads = torch_block_backward(q[None], k[None], v[None], out[None], dout[None], lse[None],
                                 False, scale, visible)
    return tuple(g[0] for g in grads)


VARLEN_STAND_INS = dict(block_forward=torch_varlen_block_forward,
                        block_backward=torch_varlen_block_backward)


def test_clip_cu_seqlens_small_example():
    """W = 2 zigzag, 8 tokens in chunks of 2, documents [0, 3) and [3, 8): rank 0 holds tokens
    0, 1 (chunk 0) and 6, 7 (chunk 3); rank 1 tokens 2, 3 and 4, 5."""
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    assert cp.local_ranges(0, 2, "zigzag", 4, slice(0, 4)) == [(0, 2), (6, 2)]
    assert cp.local_ranges(1, 2, "zigzag", 4, slice(2, 4)) == [(4, 2)]
    assert cp.clip_cu_seqlens(cu, [(0, 2), (6, 2)]).tolist() == [0, 2, 4]
    assert cp.clip_cu_seqlens(cu, [(2, 2), (4, 2)]).tolist() == [0, 1, 4]
    assert cp.clip_cu_seqlens(cu, [(4, 2)]).tolist() == [0, 0, 2]
    assert cp.clip_cu_seqlens(cu, [(2, 2), (4, 2)]).dtype == torch.int32


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_document_blocks_are_the_document_mask(causal, layout):
    """Every block of the ring, seen as a varlen batch of clipped documents (each causal
    bottom-right per piece where the block is), sees exactly what the whole sequence's
    document mask shows of it; together the blocks show every visible pair once."""
    for world_size in range(1, 7):
        local = 2 * 3 if layout == "zigzag" else 5
        n = local * world_size
        positions = cp.split_sequence(torch.arange(n), world_size, layout, dim=0)
        for seed in range(3):
            cu, longest = _documents(n, seed + 10 * world_size)
            want = _document_mask(cu, n, causal)
            seen = torch.zeros(n, n, dtype=torch.int64)
            for rank in range(world_size):
                docs = cp._Documents(cu, longest if seed else None).for_rank(
                    rank, world_size, layout, local)
                for step in range(world_size):
                    task = cp.block_task(rank, world_size, step, causal, layout, local, local)
                    if task is None:
                        continue
                    qpos = positions[rank][task.q_rows]
                    kpos = positions[task.kv_rank][task.kv_rows]
                    for owner, rows, pos in ((rank, task.q_rows, qpos),
                                             (task.kv_rank, task.kv_rows, kpos)):
                        ranges = cp.local_ranges(owner, world_size, layout, local, rows)
                        assert torch.cat([torch.arange(a, a + m) for a, m in ranges]).equal(
                            pos)
                    block = docs.block(task)
                    got = _piece_mask(block, task.causal, len(qpos), len(kpos))
                    assert got.equal(want[qpos][:, kpos]), (world_size, rank, step)
                    seen[qpos[:, None], kpos[None, :]] += got.long()
                    assert docs.block(task) is block          # built once, reused
            assert seen.equal(want.long()), (world_size, seed)


@pytest.mark.parametrize("world_size,layout", [(1, "zigzag"), (2, "zigzag"), (3, "zigzag"),
                                               (4, "zigzag"), (3, "contiguous")])
@pytest.mark.parametrize("causal", [False, True])
def test_simulated_packed_ring_matches_document_masked_attention_fp64(world_size, layout,
                                                                      causal):
    """The ring over packed documents (varlen stand-ins per block) against one attention of
    the whole sequence under its document mask: output, LSE and gradients, GQA 2:1."""
    n = 2 * world_size * 5                            # chunks of 5 rows
    q, k, v, do = (t[0] for t in _inputs(1, n, n, 4, 2, 8, seed=world_size + 7 * causal))
    cu, longest = _documents(n, world_size)
    ring = lambda a, b, c: cp.simulate_ring_varlen(  # noqa: E731
        a, b, c, cu, world_size, causal, max_seqlen=longest, layout=layout,
        **VARLEN_STAND_INS)
    out, grads = _grads(ring, q, k, v, do)
    visible = _document_mask(cu, n, causal)
    whole = lambda a, b, c: full_attention(a[None], b[None], c[None], False,  # noqa: E731
                                           visible=visible)[0]
    want, want_grads = _grads(whole, q, k, v, do)
    assert torch.allclose(out, want, atol=1e-12, rtol=1e-10)
    for name, g, w in zip("qkv", grads, want_grads):
        assert torch.allclose(g, w, atol=1e-11, rtol=1e-9), name
    _, lse = cp.simulate_ring_varlen(q, k, v, cu, world_size, causal, layout=layout,
                                     return_lse=True, **VARLEN_STAND_INS)
    want_lse = torch.logsumexp(_scores(q[None], k[None], False, 8 ** -0.5, visible), -1)[0]
    assert lse.shape == (4, n) and torch.allclose(lse, want_lse, atol=1e-12)


def test_packed_ring_refuses_what_it_cannot_run():
    q, k, v, _ = (t[0] for t in _inputs(1, 16, 16, 2, 2, 4))
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        cp.simulate_ring_varlen(q, k, v, cu.long(), 2, **VARLEN_STAND_INS)
    with pytest.raises(ValueError, match="int32"):
        cp.simulate_ring_varlen(q, k, v, cu[:1], 2, **VARLEN_STAND_INS)
    with pytest.raises(ValueError, match="3-D"):
        cp.simulate_ring_varlen(q[None], k[None], v[None], cu, 2, **VARLEN_STAND_INS)
    with pytest.raises(ValueError, match="same tokens"):
        cp.simulate_ring_varlen(q, k[:8], v[:8], cu, 2, **VARLEN_STAND_INS)
    with pytest.raises(ValueError, match="max_seqlen"):
        cp.simulate_ring_varlen(q, k, v, cu, 2, max_seqlen=0, **VARLEN_STAND_INS)
    with pytest.raises(ValueError, match="multiple of 6"):
        cp.simulate_ring_varlen(q, k, v, cu, 3, **VARLEN_STAND_INS)
    with pytest.raises(ValueError, match="even"):
        cp.ring_attention_varlen(q[:5], k[:5], v[:5], cu, causal=True, **VARLEN_STAND_INS)


# ------------------------------------------------------------------ gloo ring -----------

GLOO_RUNS = (                   # (ranks of the group, causal, layout)
    ((0, 1, 2), True, "zigzag"), ((0, 1, 2), False, "contiguous"), ((1, 2), True, "zigzag"))
GLOO_PACKED_CU = torch.tensor([0, 4, 5, 5, 16, 18], dtype=torch.int32)   # 18 tokens, 3 ranks


def _gloo_worker(rank, world_size, port, result_file):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results = []
        for ranks, causal, layout in GLOO_RUNS:
            group = dist.new_group(list(ranks))          # (every process joins the call)
            if rank not in ranks:
                results.append(None)
                continue
            w, r = len(ranks), ranks.index(rank)
            q, k, v, do = _inputs(1, 2 * w * 3, 2 * w * 3, 4, 2, 8, seed=7)
            split = lambda t: cp.split_sequence(t, w, layout)[r]  # noqa: E731
            leaves = [split(t).requires_grad_() for t in (q, k, v)]
            # k and v as (B, N, H, d) views of (B, H, N, d) memory: the ring sends dense
            # copies
            k_, v_ = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in leaves[1:])
            out = cp.ring_attention(leaves[0], k_, v_, group=None if w == world_size else
                                    group, causal=causal, layout=layout, **STAND_INS)
            out.backward(split(do))
            results.append([out.detach()] + [t.grad for t in leaves])
        # packed documents over the whole group, zigzag causal
        q, k, v, do = (t[0] for t in _inputs(1, 2 * world_size * 3, 2 * world_size * 3, 4, 2,
                                             8, seed=8))
        leaves = [cp.zigzag_shard(t, rank, world_size, dim=0).requires_grad_()
                  for t in (q, k, v)]
        out = cp.ring_attention_varlen(*leaves, GLOO_PACKED_CU, causal=True,
                                       **VARLEN_STAND_INS)
        out.backward(cp.zigzag_shard(do, rank, world_size, dim=0))
        results.append([out.detach()] + [t.grad for t in leaves])
        torch.save(results, f"{result_file}.{rank}")
    finally:
        dist.destroy_process_group()


def test_ring_attention_over_gloo_processes(tmp_path):
    """The real transport (batched isend/irecv) with CPU tensors over gloo, one process per
    rank, against full attention: 3 ranks zigzag causal and contiguous without a mask, and
    a 2-rank subgroup (ranks 1 and 2: group ranks are not global ranks) zigzag causal; and
    packed documents over the 3 ranks (`ring_attention_varlen`), zigzag causal."""
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = str(tmp_path / "rank")
    mp.start_processes(_gloo_worker, args=(3, port, result), nprocs=3, start_method="spawn")
    parts = [torch.load(f"{result}.{r}") for r in range(3)]
    for run, (ranks, causal, layout) in enumerate(GLOO_RUNS):
        w = len(ranks)
        merged = [cp.merge_sequence([parts[r][run][i] for r in ranks], layout)
                  for i in range(4)]
        q, k, v, do = _inputs(1, 2 * w * 3, 2 * w * 3, 4, 2, 8, seed=7)
        want, want_grads = _grads(lambda a, b, c: full_attention(a, b, c, causal), q, k, v,
                                  do)
        assert torch.allclose(merged[0], want, atol=1e-12, rtol=1e-10), run
        for name, g, w_ in zip("qkv", merged[1:], want_grads):
            assert torch.allclose(g, w_, atol=1e-11, rtol=1e-9), (run, name)
    merged = [cp.zigzag_merge([parts[r][-1][i] for r in range(3)], dim=0) for i in range(4)]
    q, k, v, do = (t[0] for t in _inputs(1, 18, 18, 4, 2, 8, seed=8))
    visible = _document_mask(GLOO_PACKED_CU, 18, True)
    want, want_grads = _grads(lambda a, b, c: full_attention(a[None], b[None], c[None], False,
                                                             visible=visible)[0], q, k, v, do)
    assert torch.allclose(merged[0], want, atol=1e-12, rtol=1e-10)
    for name, g, w_ in zip("qkv", merged[1:], want_grads):
        assert torch.allclose(g, w_, atol=1e-11, rtol=1e-9), ("packed", name)


# ------------------------------------------------------------------ GPU -----------------

def _gpu_case(world_size, causal, heads_q, heads_kv, per_rank, d=128, seed=0, layout="zigzag"):
    from tools.cp_gpu_check import run_case
    return run_case(world_size, causal, heads_q, heads_kv, per_rank, d=d, seed=seed,
                    layout=layout)


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_simulated_ring_on_the_kernels(world_size, causal, heads):
    result = _gpu_case(world_size, causal, *heads, per_rank=512, seed=world_size)
    assert result["ok"], result


@pytest.mark.gpu
@pytest.mark.parametrize("world_size,per_rank,d,layout", [
    (2, 300, 128, "zigzag"), (4, 198, 64, "zigzag"), (8, 150, 128, "zigzag"),
    (3, 250, 64, "zigzag"), (3, 151, 128, "contiguous")])
@pytest.mark.parametrize("causal", [False, True])
def test_simulated_ring_odd_local_lengths_on_the_kernels(world_size, per_rank, d, layout,
                                                         causal):
    """Chunk lengths that are no multiple of any tile (150 / 2 = 75 rows, 99, ...; 151 rows
    per rank in the contiguous layout)."""
    result = _gpu_case(world_size, causal, 4, 2, per_rank, d=d, seed=per_rank, layout=layout)
    assert result["ok"], result


@pytest.mark.gpu
@pytest.mark.parametrize("world_size,causal,layout", [(2, True, "zigzag"), (3, False, "zigzag"),
                                                      (4, True, "zigzag"),
                                                      (3, True, "contiguous")])
def test_simulated_packed_ring_on_the_kernels(world_size, causal, layout):
    """Packed documents (one crossing ranks, one of length 1, one empty) on the varlen
    kernels, judged as the dense cases (tools/cp_gpu_check.py, `run_packed_case`)."""
    from tools.cp_gpu_check import run_packed_case
    result = run_packed_case(world_size, causal, 8, 2, 600, seed=world_size, layout=layout)
    assert result["ok"], result


def test_nccl_check_cases_are_runnable_at_two_ranks():
    """tools/cp_nccl_check.py (GPU hosts only): its cases pass the ring's host checks at
    W = 2 (even zigzag halves under a causal mask, lengths a multiple of the chunks), and its
    packed documents cover the sequence exactly."""
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "tools", "cp_nccl_check.py")
    spec = importlib.util.spec_from_file_location("cp_nccl_check", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    for causal, hq, hk, rows, d, layout in tool.DENSE_CASES + tool.PACKED_CASES:
        q = torch.empty(1, rows, hq, d)
        k = torch.empty(1, rows, hk, d)
        cp._check_local(q, k, k, causal, layout)
    for *_, rows, _d, _layout in tool.PACKED_CASES:
        cu = tool._documents(2 * rows, rows, "cpu")
        assert cu[0] == 0 and cu[-1] == 2 * rows and bool((cu[1:] >= cu[:-1]).all())
