"""Variable-length batches (hopper_attn.attention_varlen, common/varlen.py): the ragged TMA
index math in pure python, the argument checks, one compile of the varlen kernel."""

import pytest
import torch

from hopper_attn.common import varlen


@pytest.mark.parametrize("elem_bytes", [1, 2, 4])
def test_ragged_address_lands_on_the_sequence(elem_bytes):
    """Every row inside a sequence maps to its packed address mod 2^64; rows past its end are
    out of TMA's bounds, whatever the neighbours."""
    base, stride = 0x7F3A_0000_0000, 16 * 128        # 16 heads x d 128 per token
    cu = [0, 0, 1, 18, 131, 1131]
    for o, e in zip(cu[:-1], cu[1:]):
        length = e - o
        for row in range(length + 130):
            addr = varlen.ragged_address(base, o, length, row, stride, elem_bytes)
            if 0 <= row < length:
                assert addr == base + (o + row) * stride * elem_bytes
            else:
                assert addr is None


def test_decode_item_covers_every_tile_once():
    cu = [0, 0, 1, 17, 130, 1130, 1130]
    heads, block_m = 3, 128
    tiles = varlen.query_tiles(cu, block_m, heads)
    assert tiles == [0, 3, 3, 3, 24, 0]
    for last_first, groups in ((False, None), (True, None), (True, [2] * 6), (True, [3] * 6)):
        seen = [varlen.decode_item(i, tiles, heads, last_first, groups)
                for i in range(sum(tiles))]
        assert len(set(seen)) == len(seen) == sum(tiles)
        assert varlen.decode_item(sum(tiles), tiles, heads) is None
        assert all(m < -(-(cu[b + 1] - cu[b]) // block_m) for b, m, _ in seen)
    # the last query tile first, then the next head
    assert varlen.decode_item(9, tiles, heads, True) == (4, 7, 0)
    assert varlen.decode_item(17, tiles, heads, True) == (4, 7, 1)
    # head groups of 2 (the remainder, head 0, first): head 0's tiles, then heads 1 and 2
    # alternating, the longest first
    assert [varlen.decode_item(i, tiles, heads, True, [2] * 6)[1:] for i in (9, 16, 17, 18)] \
        == [(7, 0), (0, 0), (7, 1), (7, 2)]


def _warp_decode(index, cu, block_m, heads, last_first):
    """scheduler.varlen_item's steps in python: 32 lanes, an inclusive scan, a ballot."""
    first, rel, batch = 0, index, len(cu) - 1
    while first < batch:
        m_blocks = [-(-(cu[b + 1] - cu[b]) // block_m) if b < batch else 0
                    for b in range(first, first + 32)]
        running = [sum(m * heads for m in m_blocks[:lane + 1]) for lane in range(32)]
        if rel < running[31]:
            at = sum(r <= rel for r in running)
            within = rel - (running[at] - m_blocks[at] * heads)
            m, head = within % m_blocks[at], within // m_blocks[at]
            return first + at, (m_blocks[at] - 1 - m if last_first else m), head
        rel, first = rel - running[31], first + 32
    return None


def test_warp_prefix_sum_decode_matches_the_work_list():
    """Over more than one warp step, with empty sequences among them."""
    import random
    rng = random.Random(3)
    lengths = [rng.choice([0, 0, 1, 63, 64, 65, 128, 129, 700]) for _ in range(75)]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    for block_m, heads in ((128, 2), (192, 3)):
        tiles = varlen.query_tiles(cu, block_m, heads)
        for last_first in (False, True):
            for i in range(sum(tiles) + 3):
                assert _warp_decode(i, cu, block_m, heads, last_first) == \
                    varlen.decode_item(i, tiles, heads, last_first)


def _packed(total_q=40, total_k=48, heads=4, heads_kv=2, d=64, dtype=torch.bfloat16):
    q = torch.zeros(total_q, heads, d, dtype=dtype)
    k = torch.zeros(total_k, heads_kv, d, dtype=dtype)
    v = torch.zeros_like(k)
    cu_q = torch.tensor([0, 0, 17, 40], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 5, 48], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("change, message", [
    (dict(cu_q=torch.tensor([0, 0, 17, 40], dtype=torch.int64)), "int32"),
    (dict(cu_k=torch.tensor([[0, 5, 5, 48]], dtype=torch.int32)), "1-D"),
    (dict(cu_k=torch.tensor([0, 48], dtype=torch.int32)), "same length"),
    (dict(max_q=-1), "max_seqlen_q"),
    (dict(max_q=1 << 30), "max_seqlen_q"),
    (dict(max_q=13), "do not fit"),
    (dict(max_k=2.5), "python int"),
    (dict(seqused_k=torch.zeros(2, dtype=torch.int32)), "seqused_k"),
    (dict(seqused_k=torch.zeros(3, dtype=torch.int64)), "seqused_k"),
    (dict(k=torch.zeros(48, 3, 64, dtype=torch.bfloat16)), "multiple"),
    (dict(q=torch.zeros(40, 4, 64, dtype=torch.float16)), "dtype"),
    (dict(q=torch.zeros(1, 40, 4, 64, dtype=torch.bfloat16)), "total_tokens"),
    (dict(window_size=(3, 2), causal=True), "window_size"),
    (dict(softcap=-1.0), "softcap"),
])
def test_attention_varlen_refuses_bad_arguments(change, message):
    """ValueError before anything is compiled or launched (no GPU here)."""
    from hopper_attn import attention_varlen
    q, k, v, cu_q, cu_k = _packed()
    args = dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, max_q=23, max_k=43)
    kwargs = dict(causal=False)
    for key, value in change.items():
        (args if key in args else kwargs)[key] = value
    if "k" in change:
        args["v"] = change["k"]
    with pytest.raises(ValueError, match=message):
        attention_varlen(args["q"], args["k"], args["v"], args["cu_q"], args["cu_k"],
                         args["max_q"], args["max_k"], **kwargs)


def test_attention_varlen_fake_traces_without_reading_cu_seqlens():
    """The fake implementation (torch.compile, meta tensors): shapes only."""
    from hopper_attn import attention_varlen
    q, k, v, cu_q, cu_k = (t.to("meta") for t in _packed())
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, 23, 43, causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, 40) and lse.dtype == torch.float32


def test_attention_varlen_traces_in_one_graph():
    """torch.compile(fullgraph=True) sees one op (a backend that only records the graph)."""
    from hopper_attn import attention_varlen
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return lambda *args: (None, None)

    f = torch.compile(lambda *a: attention_varlen(*a, 23, 43, causal=True, return_lse=True),
                      fullgraph=True, backend=backend)
    f(*_packed())
    calls = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert len(graphs) == 1 and torch.ops.hopper_attn.attention_varlen in calls


def test_varlen_backward_hook_checks_its_arguments():
    from hopper_attn import api
    with pytest.raises(ValueError, match="q must be a torch.Tensor"):
        api._varlen_backward(*([None] * 15))


def test_k6_varlen_compiles_for_sm90a():
    """One compile of the varlen kernel (d 128, causal, GQA, seqused_k): 5-D ragged TMA for
    Q, K, V and O, the warp prefix sum of the work list, no spills."""
    import tempfile
    from hopper_attn import k6_varlen
    q, k, _, _, _ = _packed(d=128)
    problem = k6_varlen.problem_for(q, k, 3, 1000, 1000, True)
    with tempfile.TemporaryDirectory() as d:
        compiled, kernel = k6_varlen.compile_varlen(
            problem, True, compile_options=f"--keep-ptx --dump-dir={d} --ptxas-options="
            "'--warn-on-spills --warning-as-error'")
        ptx = compiled.__ptx__
    assert kernel.scheduler.varlen and kernel.scheduler.dynamic and kernel.schedule.varlen
    assert "cp.async.bulk.tensor.5d.shared::cta.global" in ptx      # Q, K, V loads
    assert "cp.async.bulk.tensor.5d.global.shared::cta" in ptx      # O's store
    assert "vote.sync.ballot" in ptx


def _gpu_batch(q_lens, k_lens, heads, heads_kv, d, seed=0):
    from hopper_attn.harness.varlen_reference import cu_seqlens
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(q_lens), heads, d, device="cuda", generator=gen).bfloat16()
    k = torch.randn(sum(k_lens), heads_kv, d, device="cuda", generator=gen).bfloat16()
    v = torch.randn(sum(k_lens), heads_kv, d, device="cuda", generator=gen).bfloat16()
    return q, k, v, cu_seqlens(q_lens), cu_seqlens(k_lens)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_varlen_matches_per_sequence_reference(d, causal):
    """Lengths 0, 1, tails, GQA 8/2 with other key lengths (a sequence without keys): output
    within 2x torch's bf16 error of the fp32 reference, LSE within 1e-3 (-inf without keys)."""
    from hopper_attn import attention_varlen
    from hopper_attn.harness.varlen_reference import reference
    q_lens, k_lens = [0, 1, 17, 129, 1000, 5, 300], [3, 1, 40, 129, 1300, 0, 64]
    q, k, v, cu_q, cu_k = _gpu_batch(q_lens, k_lens, 8, 2, d)
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, 1000, 1300, causal=causal,
                                return_lse=True)
    ref, ref_lse = reference(q, k, v, cu_q, cu_k, causal)
    low, _ = reference(q, k, v, cu_q, cu_k, causal, lowp=True)
    assert (out.float() - ref).abs().max() <= 2 * (low - ref).abs().max() + 2 ** -10
    finite = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite)
    assert (lse[finite] - ref_lse[finite]).abs().max() < 1e-3


@pytest.mark.gpu
def test_attention_varlen_compiles_fullgraph_and_captures_in_a_cuda_graph():
    from hopper_attn import attention_varlen
    q, k, v, cu_q, cu_k = _gpu_batch([100, 0, 700], [100, 5, 700], 4, 4, 128)
    eager = attention_varlen(q, k, v, cu_q, cu_k, 700, 700, causal=True)
    compiled = torch.compile(lambda *a: attention_varlen(*a, 700, 700, causal=True),
                             fullgraph=True)
    assert torch.equal(compiled(q, k, v, cu_q, cu_k), eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attention_varlen(q, k, v, cu_q, cu_k, 700, 700, causal=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
