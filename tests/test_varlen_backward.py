"""The varlen backward (common/varlen_backward.py, kb2 with `varlen`): its refusals, the
padded per-sequence layout's index math, one compile for sm_90a, and (GPU) gradients against
per-sequence fp32 references (tools/varlen_bwd_gpu_check.py runs the full set)."""

import random
import tempfile

import pytest
import torch

from hopper_attn import kb2
from hopper_attn.common.varlen_backward import (compile_for, dkv_parts, padded_rows,
                                                 sequence_table, varlen_backward)
from hopper_attn.harness.compile_report import SPILLS_AS_ERRORS, resource_usage
from ptx import TMA_STORE, count


def _packed(lengths_q, lengths_k, heads=4, heads_kv=2, d=64, device="cpu"):
    cu = [torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32,
                       device=device) for ls in (lengths_q, lengths_k)]
    q, do = (torch.randn(sum(lengths_q), heads, d, device=device).to(torch.bfloat16)
             for _ in range(2))
    k, v = (torch.randn(sum(lengths_k), heads_kv, d, device=device).to(torch.bfloat16)
            for _ in range(2))
    lse = torch.zeros(heads, sum(lengths_q), device=device)
    return q, k, v, q.clone(), do, lse, *cu


def test_padded_tiles_never_overlap():
    """Sequence b's query tiles start at (cu[b] + b bm) // bm x bm: whole tiles of different
    sequences are disjoint and inside padded_rows."""
    rng = random.Random(0)
    for block_m in (64, 80, 128):
        lengths = [rng.choice([0, 1, 17, 63, 64, 65, 80, 81, 1000]) for _ in range(40)]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        taken = []
        for b, n in enumerate(lengths):
            start = (cu[b] + b * block_m) // block_m * block_m
            taken.append((start, start + -(-n // block_m) * block_m))
        taken.sort()
        assert all(a[1] <= b[0] for a, b in zip(taken, taken[1:]))
        assert taken[-1][1] <= padded_rows(cu[-1], len(lengths), block_m)
        # packed_rows reads a padded per-row buffer back in token order (gaps: NaN)
        from hopper_attn.common.varlen_backward import packed_rows
        padded = torch.full((1, 2, padded_rows(cu[-1], len(lengths), block_m)), float("nan"))
        for b, n in enumerate(lengths):
            start = (cu[b] + b * block_m) // block_m * block_m
            padded[0, :, start:start + n] = torch.arange(cu[b], cu[b] + n, dtype=torch.float32)
        got = packed_rows(padded, torch.tensor(cu, dtype=torch.int32), cu[-1], block_m)
        assert torch.equal(got, torch.arange(cu[-1], dtype=torch.float32).expand(2, -1))


def test_sequence_table_columns():
    """A column per sequence (offsets, lengths, batch index), longest first when asked,
    zeroed dQ counters below, a spare last column."""
    cu_q = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 9, 9], dtype=torch.int32)
    table = sequence_table(cu_q, cu_k, torch.tensor([2, 5, 0], dtype=torch.int32), False, 2)
    assert table.tolist() == [[0, 3, 3, 0], [3, 0, 7, 0], [0, 4, 9, 0], [2, 5, 0, 0],
                              [0, 1, 2, 0], [0] * 4, [0] * 4]
    table = sequence_table(cu_q, cu_k, None, True, 1)            # work 12, 0, 0
    assert table[:5, 0].tolist() == [0, 3, 0, 4, 0] and table.shape == (6, 4)
    cu_q = torch.tensor([0, 1, 11], dtype=torch.int32)           # work 1 x 4 < 10 x 5
    table = sequence_table(cu_q, cu_k[:3], None, True)
    assert table[4, :2].tolist() == [1, 0]


def test_work_list_takes_the_dense_order():
    """The main kernel's work list (host mirror) launches each sequence as the dense grid
    launches a batch of one (kb2 at d 128: causal with 32 MiB head groups, 64-row tiles;
    full 80-row tiles, each head's kv tiles in turn), and equal lengths with a mask as the
    dense batch (8 x 2k, 16 heads: one sequence a group; 4 heads: groups across sequences).
    (Not the dense one: below 16 kv tiles with a mask kv tile 0 of every head comes first.)
    Orders that missed L2 before: tools/bwd_order_model.py."""
    from hopper_attn.common.masking import KVTileSchedule
    from hopper_attn.common.varlen_backward import VarlenKVTileSchedule
    l2_rows = (32 << 20) // (128 * 8)
    for causal, heads, lengths in ((True, 16, [2048] * 8), (True, 4, [2048] * 5),
                                   (True, 16, [16384] * 2), (False, 16, [2048] * 8),
                                   (True, 16, [4096, 2048]), (False, 4, [700, 3000])):
        block_m, rows = (64, l2_rows) if causal else (80, 0)
        varlen = VarlenKVTileSchedule(block_m, 128, causal, rows).host_work_list(
            lengths, lengths, heads)
        dense = KVTileSchedule(block_m, 128, causal, rows)
        if len(set(lengths)) == 1:
            want = [(hb // heads, n, hb % heads) for n, hb in
                    dense.host_order(lengths[0], lengths[0], heads, len(lengths))]
        else:
            want = [(b, n, h) for b, length in enumerate(lengths)
                    for n, h in dense.host_order(length, length, heads, 1)]
        assert varlen == want, (causal, heads, lengths)


def test_gqa_parts_only_where_whole_groups_leave_few_ctas():
    assert dkv_parts(16, 1, 16384, 13) == 4 and dkv_parts(16, 4, 16384, 13) == 1
    assert dkv_parts(16, 1, 65536, 42) == 1 and dkv_parts(8, 8, 100, 1) == 1


def test_refusals_before_any_launch():
    q, k, v, out, do, lse, cu_q, cu_k = _packed([3, 5], [4, 4])
    with pytest.raises(ValueError, match="lse"):
        varlen_backward(q, k, v, out, do, lse.t(), cu_q, cu_k, 5, 4, True)
    with pytest.raises(ValueError, match="int32"):
        varlen_backward(q, k, v, out, do, lse, cu_q.long(), cu_k, 5, 4, True)
    with pytest.raises(ValueError, match="dout"):
        varlen_backward(q, k, v, out, do[:-1], lse, cu_q, cu_k, 5, 4, True)
    with pytest.raises(ValueError, match="deterministic"):
        compile_for(q, k, True, deterministic=True)
    with pytest.raises(ValueError, match="varlen"):
        kb2.FlashAttentionBackwardKB2(128, True, deterministic=True, varlen=True)


@pytest.mark.compile
def test_compiles_without_spills():
    """GQA at d = 128 with a mask (the gqa variant's work list): no spills, dK / dV through
    5-D (ragged) TMA stores, dQ still one bulk reduce-add per warpgroup and tile."""
    q, k = torch.empty(1000, 4, 128, dtype=torch.bfloat16), torch.empty(1000, 2, 128,
                                                                         dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as dump:
        handle = compile_for(q, k, True, compile_options=(
            f"--keep-ptx --keep-cubin --dump-dir={dump} {SPILLS_AS_ERRORS}"))
        ptx, cubin = handle.main.__ptx__.rstrip("\0"), handle.main.__cubin__
    assert handle.options["varlen"] and handle.options["gqa"]
    for fn in resource_usage(cubin):
        assert fn["local"] == 0 and fn["stack"] == 0, fn
    assert count(ptx, TMA_STORE) == count(ptx, r"cp\.async\.bulk\.tensor\.5d\.global") == 4
    assert count(ptx, r"cp\.reduce\.async\.bulk\.global\.shared::cta\.bulk_group\.add\.f32") == 2


@pytest.mark.compile
def test_compiles_at_d192():
    """d = 192 compiles on kb2's default tile (64 x 96, dK^T and dV^T), GQA with a mask, no
    spills, and the preprocess and dQ conversion keep their padding lanes inside the row."""
    q, k = torch.empty(1000, 4, 192, dtype=torch.bfloat16), torch.empty(1000, 2, 192,
                                                                         dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as dump:
        handle = compile_for(q, k, True, compile_options=(
            f"--keep-cubin --dump-dir={dump} {SPILLS_AS_ERRORS}"))
        cubin = handle.main.__cubin__
    assert handle.options["dkv_swap_ab"] and handle.options["block_n"] == 96
    from hopper_attn.common.backward import _row_lanes
    assert _row_lanes(31, 32, 192)[1] == 184 and _row_lanes(31, 16, 128)[2] is None
    for fn in resource_usage(cubin):
        assert fn["local"] == 0 and fn["stack"] == 0, fn


@pytest.mark.compile
def test_table_kernel_compiles_without_spills():
    from hopper_attn.common import cute_runtime as rt
    from hopper_attn.common.varlen_backward import SequenceTableKernel
    cu = torch.zeros(3, dtype=torch.int32)
    with tempfile.TemporaryDirectory() as dump:
        fn = rt.compile_with_tensors(SequenceTableKernel(True), cu, cu, cu[:2],
                                     torch.empty((6, 3), dtype=torch.int32), scalars=(1.0,),
                                     options=f"--keep-cubin --dump-dir={dump} "
                                             f"{SPILLS_AS_ERRORS}")
    assert all(f["local"] == 0 and f["stack"] == 0 for f in resource_usage(fn.__cubin__))


@pytest.mark.gpu
def test_table_kernel_matches_torch():
    """The one-launch table (SequenceTableKernel) equals sequence_table's torch ops: ties kept
    in batch order, lengths 0, seqused_k, a cu_seqlens slice off 16 bytes, up to 256
    sequences; above that build_sequence_table takes torch's ops."""
    from hopper_attn.common.varlen_backward import build_sequence_table
    rng = random.Random(1)
    for batch in (1, 13, 40, 256, 300):
        lengths = [rng.choice([0, 1, 64, 700, 700, 2048]) for _ in range(2 * batch)]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                          device="cuda")
        cu_q, cu_k = cu[:batch + 1], cu[batch:]     # (cu_k: off 16 bytes at batch 1, 13)
        used = torch.tensor(lengths[:batch], dtype=torch.int32, device="cuda")
        for seqused in (None, used):
            for longest_first in (False, True):
                got = build_sequence_table(cu_q, cu_k, seqused, longest_first, 3)
                want = sequence_table(cu_q, cu_k, seqused, longest_first, 3)
                assert torch.equal(got, want), (batch, seqused is not None, longest_first)


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal,waves", [(64, False, 4), (128, True, 4), (128, False, 0)])
def test_gradients_match_per_sequence_references(d, causal, waves, monkeypatch):
    """(waves 4: this small batch's GQA groups split in parts; 0: whole groups per CTA)"""
    from hopper_attn.common import varlen_backward as vb
    monkeypatch.setattr(vb, "PARTS_WAVES", waves)
    from hopper_attn.harness.grad_check import _torch_lowp_grads
    from hopper_attn.harness.reference_backward import attention_backward, forward_with_lse
    lq, lk = [0, 1, 17, 113, 300], [5, 1, 40, 113, 0]
    q, k, v, _, do, _, cu_q, cu_k = _packed(lq, lk, 4, 2, d, device="cuda")
    out = torch.zeros_like(q)
    lse = torch.full((4, q.shape[0]), float("-inf"), device="cuda")
    refs = [torch.zeros(t.shape, device="cuda") for t in (q, k, v)]
    lows = [torch.zeros(t.shape, device="cuda") for t in (q, k, v)]
    qs, ks = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lq)):
        if lq[b] == 0 or lk[b] == 0:
            continue
        sq, sk = slice(qs[b], qs[b + 1]), slice(ks[b], ks[b + 1])
        o, l_ = forward_with_lse(q[None, sq], k[None, sk], v[None, sk], causal)
        out[sq], lse[:, sq] = o[0].to(q.dtype), l_[0]
        grads = attention_backward(q[None, sq], k[None, sk], v[None, sk], o, l_, do[None, sq],
                                   causal)
        low = _torch_lowp_grads(q[None, sq], k[None, sk], v[None, sk], do[None, sq], causal)
        for i, sl in enumerate((sq, sk, sk)):
            refs[i][sl], lows[i][sl] = grads[i][0], low[i][0].float()
    got = varlen_backward(q, k, v, out, do, lse, cu_q, cu_k, max(lq), max(lk), causal)
    for g, r, lw in zip(got, refs, lows):
        bound = 2 * (lw - r).abs().max().item() + 2 ** -12 * max(1.0, r.abs().max().item())
        assert not g.isnan().any()
        assert (g.float() - r).abs().max().item() <= bound


@pytest.mark.gpu
def test_attention_varlen_autograd_matches_the_direct_backward():
    """attention_varlen(...).backward() runs the varlen kb2 backward on its own forward's
    output and LSE: the gradients of the direct call (dK, dV the same bits; dQ's fp32 adds
    land in any order)."""
    from hopper_attn import attention_varlen
    lq = [3, 130, 0, 64]
    q, k, v, _, do, _, cu_q, cu_k = _packed(lq, lq, 4, 1, 128, device="cuda")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_varlen(*leaves, cu_q, cu_k, 130, 130, causal=True, return_lse=True)
    out.backward(do)
    direct = varlen_backward(q, k, v, out.detach(), do, lse.detach(), cu_q, cu_k, 130, 130,
                             True)
    torch.testing.assert_close(leaves[0].grad, direct[0], atol=1e-2, rtol=1e-2)
    for leaf, g in zip(leaves[1:], direct[1:]):
        assert torch.equal(leaf.grad, g)


@pytest.mark.gpu
def test_backward_captures_in_a_cuda_graph_and_follows_new_lengths():
    """Nothing reads cu_seqlens on the host: a captured backward replayed after the lengths
    changed in place (same totals) gives the eager backward of the new lengths."""
    q, k, v, _, do, lse, cu_q, cu_k = _packed([100, 0, 700], [100, 5, 700], 4, 2, 128,
                                              device="cuda")
    out = torch.randn_like(q)
    args = (q, k, v, out, do, lse, cu_q, cu_k, 800, 800, True)
    varlen_backward(*args)                                   # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = varlen_backward(*args)
    cu_q.copy_(torch.tensor([0, 300, 450, 800], dtype=torch.int32))
    cu_k.copy_(torch.tensor([0, 5, 405, 805], dtype=torch.int32))
    graph.replay()
    eager = varlen_backward(*args)
    torch.testing.assert_close(captured[0], eager[0], atol=1e-2, rtol=1e-2)
    for c, e in zip(captured[1:], eager[1:]):
        assert torch.equal(c, e)
