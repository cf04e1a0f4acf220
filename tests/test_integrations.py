"""hopper_attn.integrations: transformers' attention interface and torch's SDPA provider.

The mapping and the refusals run on the CPU without transformers (a stand-in computes the
attention); tests that build a transformers model skip where it is not installed; the
`gpu` tests compare a tiny random-weight Llama and SDPA itself against torch's kernels.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from hopper_attn.integrations import sdpa as hopper_sdpa
from hopper_attn.integrations import transformers as hopper_tf
from hopper_attn.integrations.transformers import UnsupportedFeature, plan_call


def reference(q, k, v, causal, softmax_scale, window_size=(-1, -1), softcap=0.0, sinks=None):
    """(batch, seqlen, heads, head_dim) attention in fp32, GQA, causal and the window
    bottom-right (query i at row r = i + nk - nq sees keys r - left <= j <= r + right),
    softcap as cap * tanh(s / cap) on the scaled scores, sinks (heads,) one more column of
    each row's softmax: `hopper_attn.attention`'s definitions."""
    nq, nk = q.shape[1], k.shape[1]
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(q.shape[-1])
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    row = torch.arange(nq, device=q.device)[:, None] + (nk - nq)
    col = torch.arange(nk, device=q.device)[None, :]
    keep = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    left, right = window_size
    if causal:
        keep &= col <= row
    if left >= 0:
        keep &= col >= row - left
    if right >= 0:
        keep &= col <= row + right
    if not bool(keep.all()):
        s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.float()[None, :, None, None].expand(*s.shape[:3], 1)], -1)
    p = s.softmax(-1)[..., :nk]
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.float()).to(q.dtype)
    return out, torch.logsumexp(s, -1)


def reference_backward(q, k, v, out, dout, causal, softmax_scale):
    """dq, dk, dv of `reference` in closed form (no autograd: it runs below autograd)."""
    b, nq, h, d = q.shape
    nk, hk = k.shape[1], k.shape[2]
    group = h // hk
    kk, vv = (t.repeat_interleave(group, dim=2).float() for t in (k, v))
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(d)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk) * scale
    if causal:
        keep = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
        s = s.masked_fill(~keep, float("-inf"))
    p = s.softmax(-1)
    do = dout.float()
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, vv)
    rows = (do * out.float()).sum(-1).transpose(1, 2)[..., None]      # (b, h, nq, 1)
    ds = p * (dp - rows) * scale
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kk)
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.float())
    fold = lambda t: t.view(b, nk, hk, group, d).sum(3)
    return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)


class Module(torch.nn.Module):
    def __init__(self, is_causal=True):
        super().__init__()
        self.is_causal = is_causal


def bhnd(b, h, n, d=64, dtype=torch.float32):
    return torch.randn(b, h, n, d, dtype=dtype)


# --- transformers mapping, without transformers --------------------------------------------

# stand-ins with the names transformers' masking_utils gives its mask pieces
def causal_mask_function(batch_idx, head_idx, q_idx, kv_idx):
    return kv_idx <= q_idx


def bidirectional_mask_function(batch_idx, head_idx, q_idx, kv_idx):
    return True


def and_masks(*mask_functions):
    def and_mask(batch_idx, head_idx, q_idx, kv_idx):
        return all(f(batch_idx, head_idx, q_idx, kv_idx) for f in mask_functions)
    return and_mask


def packed_sequence_mask_function(packed_sequence_mask):
    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return packed_sequence_mask[batch_idx, q_idx] == packed_sequence_mask[batch_idx, kv_idx]
    return inner_mask


def sliding_window_overlay(sliding_window):
    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx > q_idx - sliding_window
    return inner_mask


def sliding_window_bidirectional_overlay(sliding_window):
    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return abs(q_idx - kv_idx) <= sliding_window
    return inner_mask


def test_mask_function_parts():
    assert hopper_tf.mask_function_parts(causal_mask_function) == ("causal_mask_function",)
    packed = and_masks(causal_mask_function, packed_sequence_mask_function(torch.zeros(1, 4)))
    assert set(hopper_tf.mask_function_parts(packed)) == {"causal_mask_function",
                                                          "packed_sequence_mask_function"}
    nested = and_masks(sliding_window_overlay(8), and_masks(causal_mask_function))
    assert set(hopper_tf.mask_function_parts(nested)) == {"sliding_window_overlay",
                                                          "causal_mask_function"}


def test_mask_request_plain():
    check = hopper_tf.check_mask_request
    assert check(16, 16, 0, 0, causal_mask_function, None, compiling=False) is True
    assert check(16, 16, 0, 0, bidirectional_mask_function, None, compiling=False) is False
    # a cache: 1 new query after 20 tokens, bottom-right
    assert check(1, 21, 20, 0, causal_mask_function, torch.ones(2, 21, dtype=torch.bool),
                 compiling=False) is True
    assert check(1, 21, torch.tensor(20), 0, causal_mask_function, None, compiling=False)
    # a causal sliding window: no mask, the attention call's sliding_window applies it;
    # a sliding layer's trimmed cache (window 8: the last 7 keys and 1 new query at 20)
    sliding = and_masks(sliding_window_overlay(8), causal_mask_function)
    assert check(16, 16, 0, 0, sliding, None, compiling=False) is True
    assert check(1, 8, 20, 13, sliding, torch.ones(2, 21, dtype=torch.bool),
                 compiling=False) is True


@pytest.mark.parametrize("case, words", [
    ("packed_cache", "without a padding mask or a KV"),
    ("sliding_bidirectional", "bidirectional sliding window"),
    ("sliding_padding", "padding"),
    ("padding", "padding"), ("static", "static"), ("static_compiled", "static"),
    ("mask4d", "4-D"), ("custom", "custom mask function"),
])
def test_mask_request_refusals(case, words):
    check = hopper_tf.check_mask_request
    causal = causal_mask_function
    args = {
        "packed_cache": (1, 9, 8, 0, and_masks(causal, packed_sequence_mask_function(None)),
                         None),
        "sliding_bidirectional": (8, 8, 0, 0, and_masks(sliding_window_bidirectional_overlay(4),
                                                        bidirectional_mask_function), None),
        "sliding_padding": (8, 8, 0, 0, and_masks(sliding_window_overlay(4), causal),
                            torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]]).bool()),
        "padding": (8, 8, 0, 0, causal, torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]]).bool()),
        "static": (8, 64, 0, 0, causal, None),             # keys = the preallocated length
        "static_compiled": (1, 64, torch.tensor(9), 0, causal, None),
        "mask4d": (8, 8, 0, 0, causal, torch.ones(1, 1, 8, 8, dtype=torch.bool)),
        "custom": (8, 8, 0, 0, lambda b, h, q, kv: True, None),
    }[case]
    with pytest.raises(UnsupportedFeature, match=words) as info:
        check(*args, compiling=case == "static_compiled")
    assert isinstance(info.value, ValueError) and isinstance(info.value, NotImplementedError)


def test_plan_call_causality_and_scale():
    q, k = bhnd(2, 8, 16), bhnd(2, 2, 16)
    plan = plan_call(Module(True), q, k, k, None, 0.0, 0.125)
    assert plan == hopper_tf.CallPlan(causal=True, softmax_scale=0.125)
    assert plan_call(Module(False), q, k, k, None).causal is False
    assert plan_call(Module(True), q, k, k, None, is_causal=False).causal is False
    assert plan_call(object(), q, k, k, None).causal is True          # no attribute: causal
    # decode: one query over a longer cache (no mask needed), a chunk of queries (causal)
    assert plan_call(Module(True), bhnd(2, 8, 1), bhnd(2, 2, 40), bhnd(2, 2, 40), None).causal \
        is False
    assert plan_call(Module(True), bhnd(2, 8, 4), bhnd(2, 2, 40), bhnd(2, 2, 40), None).causal


def test_plan_call_window_and_softcap():
    """transformers' sliding_window=N (the query and the N - 1 keys before it) is
    window_size=(N - 1, 0) with causal; softcap passes through as a float."""
    q, k = bhnd(2, 8, 16), bhnd(2, 2, 16)
    plan = plan_call(Module(True), q, k, k, None, 0.0, 0.125, sliding_window=4096)
    assert plan == hopper_tf.CallPlan(causal=True, softmax_scale=0.125,
                                      window_size=(4095, 0))
    assert plan.features() == {"window_size": (4095, 0)}
    assert plan_call(Module(True), q, k, k, None, sliding_window=1).window_size == (0, 0)
    plan = plan_call(Module(True), q, k, k, None, softcap=50)
    assert plan.softcap == 50.0 and isinstance(plan.softcap, float)
    assert plan.window_size == (-1, -1) and plan.features() == {"softcap": 50.0}
    # Gemma 2's sliding layer: both
    plan = plan_call(Module(True), q, k, k, None, sliding_window=4, softcap=50.0)
    assert plan.features() == {"window_size": (3, 0), "softcap": 50.0}
    # neither: the backend gets no extra arguments
    assert plan_call(Module(True), q, k, k, None).features() == {}
    sinks = torch.zeros(q.shape[1])                        # gpt-oss's s_aux: passed through
    assert plan_call(Module(True), q, k, k, None, s_aux=sinks).features()["sinks"] is sinks
    # one query over a cache keeps the window (the no-window shortcut drops causal)
    one = plan_call(Module(True), bhnd(2, 8, 1), bhnd(2, 2, 40), bhnd(2, 2, 40), None,
                    sliding_window=8)
    assert one.causal and one.window_size == (7, 0)
    assert hopper_tf.window_from_sliding_window(None, False) == (-1, -1)
    assert hopper_tf.softcap_value(None) == 0.0


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(dropout=0.1), UnsupportedFeature, "dropout"),
    (dict(sliding_window=8, is_causal=False), UnsupportedFeature, "bidirectional sliding"),
    (dict(sliding_window=0), ValueError, "sliding_window"),
    (dict(sliding_window=4.5), ValueError, "sliding_window"),
    (dict(softcap=-30.0), ValueError, "softcap"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(s_aux=torch.zeros(2)), ValueError, "s_aux"),
    (dict(cu_seq_lens_q=torch.tensor([0, 8, 16])), ValueError, "max_length_q"),
    (dict(attention_mask=torch.zeros(2, 1, 16, 16)), UnsupportedFeature, "mask"),
    (dict(position_bias=torch.zeros(1, 8, 16, 16)), UnsupportedFeature, "position bias"),
])
def test_plan_call_refusals(kwargs, error, words):
    q, k = bhnd(2, 8, 16), bhnd(2, 2, 16)
    mask = kwargs.pop("attention_mask", None)
    with pytest.raises(error, match=words):
        plan_call(Module(), q, k, k, mask, **kwargs)


def test_packed_sequences_from_position_ids_and_collator_kwargs():
    """Documents packed in rows: the mask function finds transformers' document index in
    the mask pattern and returns their offsets (PackedSequences); plan_call maps that, or
    the flattening collator's cu_seq_lens / max_length kwargs, to attention_varlen's
    arguments."""
    # position ids [0 1 2 0 1 | 0 1 2 3 0] -> document index [0 0 0 1 1 | 0 0 0 0 1]
    ids = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 1]])
    fn = and_masks(causal_mask_function, packed_sequence_mask_function(ids))
    assert hopper_tf.packed_document_ids(fn) is ids
    assert hopper_tf.packed_document_ids(causal_mask_function) is None
    packed = hopper_tf.hopper_attn_mask(2, 5, 5, 0, 0, fn, None)
    assert packed.document_ids is ids            # (nothing read on the host yet)
    cu_seqlens, max_seqlen = packed.offsets()
    assert cu_seqlens.tolist() == [0, 3, 5, 9, 10] and max_seqlen == 4
    assert cu_seqlens.dtype == torch.int32 and packed.offsets()[0] is cu_seqlens   # once
    assert hopper_tf.hopper_attn_mask(2, 5, 5, 0, 0, causal_mask_function, None) is None
    q, k = bhnd(2, 8, 5), bhnd(2, 2, 5)
    plan = plan_call(Module(True), q, k, k, packed)
    assert plan.causal and plan.varlen[2:] == (4, 4)
    assert plan.varlen[0] is cu_seqlens and plan.varlen[1] is cu_seqlens
    cu = torch.tensor([0, 3, 10])
    kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
    plan = plan_call(Module(True), q, k, k, None, **kwargs)
    assert plan.varlen[0].tolist() == [0, 3, 10] and plan.varlen[2:] == (7, 7)
    # the collator's offsets win over the mask's documents, which are then never read
    lazy = hopper_tf.PackedSequences(ids)
    assert plan_call(Module(True), q, k, k, lazy, **kwargs).varlen[2:] == (7, 7)
    assert lazy._offsets is None
    assert plan_call(Module(True), q, k, k, None).varlen is None


def test_packed_sequences_under_torch_compile_need_the_collator_offsets(monkeypatch):
    """Traced, transformers composes its packed-sequence mask whenever position ids are
    given: the mask function then reads nothing (no sync), a call with the collator's
    cu_seq_lens runs them, one without is refused, naming the kwargs."""
    ids = torch.zeros(1, 6, dtype=torch.long)
    fn = and_masks(causal_mask_function, packed_sequence_mask_function(ids))
    assert hopper_tf.check_mask_request(6, 6, 0, 0, fn, None, compiling=True) is True
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    packed = hopper_tf.hopper_attn_mask(1, 6, 6, 0, 0, fn, None)
    q, k = bhnd(1, 4, 6), bhnd(1, 2, 6)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    plan = plan_call(Module(True), q, k, k, packed, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                     max_length_q=6, max_length_k=6)
    assert plan.varlen[0] is cu
    with pytest.raises(UnsupportedFeature, match="cu_seq_lens_q"):
        plan_call(Module(True), q, k, k, packed)


def test_plan_call_shape_refusals():
    with pytest.raises(ValueError, match="more queries"):
        plan_call(Module(True), bhnd(1, 4, 32), bhnd(1, 4, 16), bhnd(1, 4, 16), None)
    with pytest.raises(ValueError, match="head_dim"):
        plan_call(Module(True), bhnd(1, 4, 16), bhnd(1, 4, 16, 32), bhnd(1, 4, 16), None)
    # v's head dim may differ (MLA); attention() decides which pairs run
    plan_call(Module(True), bhnd(1, 4, 16, 192), bhnd(1, 4, 16, 192), bhnd(1, 4, 16, 128), None)
    with pytest.raises(ValueError, match="4-D"):
        plan_call(Module(True), torch.zeros(4, 16, 64), bhnd(1, 4, 16), bhnd(1, 4, 16), None)


def test_default_backend_refuses_fp32_before_launch():
    with pytest.raises(ValueError, match="bf16 or fp16"):
        hopper_tf.hopper_attention_forward(Module(), bhnd(1, 2, 8), bhnd(1, 2, 8),
                                           bhnd(1, 2, 8), None)


def test_default_backend_passes_only_the_call_features(monkeypatch):
    """A plain call reaches attention() with no window_size / softcap (so it checks no
    defaults), and plain plans are shared, not rebuilt per call (a generation step's host
    time: tools/host_path_profile.py tf_decode_step_hopper)."""
    seen = []
    import hopper_attn.api
    monkeypatch.setattr(hopper_attn.api, "attention",
                        lambda q, k, v, **kw: seen.append(kw) or torch.empty_like(q))
    q, k = bhnd(1, 8, 1, dtype=torch.bfloat16), bhnd(1, 2, 9, dtype=torch.bfloat16)
    hopper_tf.hopper_attention_forward(Module(), q, k, k, None, scaling=0.5)
    hopper_tf.hopper_attention_forward(Module(), q, k, k, None, scaling=0.5, sliding_window=4,
                                       softcap=3.0)
    assert seen == [dict(causal=False, softmax_scale=0.5),
                    dict(causal=True, softmax_scale=0.5, window_size=(3, 0), softcap=3.0)]
    assert plan_call(Module(), q, k, k, scaling=0.5) is plan_call(Module(), q, k, k,
                                                                  scaling=0.5)


@pytest.mark.parametrize("nq, nk, window, softcap", [(16, 16, 4, None), (16, 16, None, 5.0),
                                                    (16, 16, 6, 2.0), (1, 24, 8, None),
                                                    (5, 24, 8, 3.0), (5, 24, 30, None)])
def test_forward_window_and_softcap(nq, nk, window, softcap):
    """The backend gets window_size=(N - 1, 0) and softcap; the stand-in's result is
    transformers' eager attention: capped scores, then the sliding causal mask."""
    seen = []

    def backend(q, k, v, c, scale, **features):
        seen.append((c, features))
        return reference(q, k, v, c, scale, **features)[0]

    forward = hopper_tf.make_attention_forward(backend)
    q, k, v = bhnd(2, 8, nq), bhnd(2, 2, nk), bhnd(2, 2, nk)
    out, _ = forward(Module(True), q, k, v, None, scaling=0.3, sliding_window=window,
                     softcap=softcap)
    expected_features = {}
    if window is not None:
        expected_features["window_size"] = (window - 1, 0)
    if softcap is not None:
        expected_features["softcap"] = softcap
    assert seen == [(window is not None or nq > 1, expected_features)]
    # eager, written out: query i at position p = i + nk - nq sees p - window < j <= p
    s = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(4, 1)) * 0.3
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    pos = torch.arange(nq)[:, None] + nk - nq
    j = torch.arange(nk)[None, :]
    keep = (j <= pos) & ((j > pos - window) if window is not None else True)
    s = s.masked_fill(~keep, float("-inf"))
    expected = (s.softmax(-1) @ v.repeat_interleave(4, 1)).transpose(1, 2)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("nq, nk, causal", [(16, 16, True), (16, 16, False), (1, 24, True),
                                           (5, 24, True)])
def test_forward_layout_gqa_and_cache(nq, nk, causal):
    """transformers' (B, H, N, d) in, (B, N, H, d) out, GQA without repeat, bottom-right."""
    seen = []

    def backend(q, k, v, c, scale):
        seen.append((tuple(q.shape), tuple(k.shape), c, scale))
        return reference(q, k, v, c, scale)[0]

    forward = hopper_tf.make_attention_forward(backend)
    q, k, v = bhnd(2, 8, nq), bhnd(2, 2, nk), bhnd(2, 2, nk)
    out, weights = forward(Module(causal), q, k, v, None, scaling=0.1)
    assert weights is None and out.shape == (2, nq, 8, 64)
    assert seen[0][:2] == ((2, nq, 8, 64), (2, nk, 2, 64))     # k/v keep their 2 heads
    mask = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq) if causal else None
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1),
                                              v.repeat_interleave(4, 1), attn_mask=mask,
                                              scale=0.1).transpose(1, 2)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_no_transformers_import():
    import subprocess
    import sys
    code = ("import sys, hopper_attn.integrations.transformers, hopper_attn.integrations.sdpa, "
            "hopper_attn.harness.models; print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=__file__.rsplit("/tests/", 1)[0])
    assert out.stdout.strip() == "False", out.stderr


# --- transformers, on the CPU (a stand-in backend) -----------------------------------------

def _tiny_llama(attn, layers=2, hidden=128, heads=4, kv_heads=2, vocab=128, **config):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, vocab_size=vocab,
                                   max_position_embeddings=512, attn_implementation=attn,
                                   **config)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _register_cpu_standin():
    pytest.importorskip("transformers")
    return hopper_tf.register("hopper_attn_cpu",
                              backend=lambda q, k, v, c, s, **features:
                              reference(q, k, v, c, s, **features)[0])


def _logits_and_greedy_tokens(model, ids):
    """The logits for `ids`, and 6 greedy tokens after them (with the cache)."""
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=6, do_sample=False,
                                attention_mask=torch.ones_like(ids))
    return logits, tokens


def test_transformers_cpu_model_matches_sdpa():
    name = _register_cpu_standin()
    model = _tiny_llama("sdpa").eval()
    ids = torch.randint(0, 128, (2, 24))
    expected, generated = _logits_and_greedy_tokens(model, ids)
    model.set_attn_implementation(name)
    got, again = _logits_and_greedy_tokens(model, ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(generated, again)


def test_transformers_cpu_refusals():
    name = _register_cpu_standin()
    transformers = pytest.importorskip("transformers")
    model = _tiny_llama(name).eval()
    ids = torch.randint(0, 128, (2, 16))
    padded = torch.ones_like(ids)
    padded[1, :3] = 0
    with torch.no_grad():
        with pytest.raises(UnsupportedFeature, match="padding"):
            model(ids, attention_mask=padded)
        with pytest.raises(UnsupportedFeature, match="packed"):
            model(ids, position_ids=torch.tensor([list(range(8)) * 2] * 2), use_cache=False)
        with pytest.raises(UnsupportedFeature, match="static"):
            model.generate(ids, max_new_tokens=2, do_sample=False,
                           cache_implementation="static")
    model = _tiny_mistral(name, sliding_window=4).eval()
    with torch.no_grad(), pytest.raises(UnsupportedFeature, match="padding"):
        model(ids, attention_mask=padded)


def _tiny_mistral(attn, sliding_window):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MistralConfig(hidden_size=128, intermediate_size=256,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128,
                                     sliding_window=sliding_window, attn_implementation=attn)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(cfg)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _tiny_gemma2(attn, sliding_window, softcap=50.0):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Gemma2Config(hidden_size=128, intermediate_size=256,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=32, vocab_size=128,
                                    query_pre_attn_scalar=32, sliding_window=sliding_window,
                                    attn_logit_softcapping=softcap, attn_implementation=attn)
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(cfg)
    # random weights give scores far below a cap of 50: make the cap bite
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight.data *= 8
        layer.self_attn.k_proj.weight.data *= 8
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _tiny_gpt_oss(attn, sliding_window):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GptOssConfig(hidden_size=128, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=32, vocab_size=128,
                                    num_local_experts=4, num_experts_per_tok=2,
                                    sliding_window=sliding_window,
                                    layer_types=["sliding_attention", "full_attention"],
                                    attn_implementation=attn)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg)
    for layer in model.model.layers:      # sinks that matter (initialized near 0)
        layer.self_attn.sinks.data = torch.randn_like(layer.self_attn.sinks) * 2
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("family, reference_impl", [("mistral", "sdpa"), ("mistral", "eager"),
                                                    ("gemma2", "eager"), ("gpt_oss", "eager")])
def test_transformers_cpu_window_softcap_models(family, reference_impl):
    """A tiny Mistral (sliding_window 6 on every layer), Gemma 2 (softcap, window 6 on
    alternate layers) and gpt-oss (sinks, window 6 on alternate layers) on 24-token prompts:
    the stand-in gives transformers' own logits, and the same greedy tokens with the cache
    (a sliding layer's cache is trimmed to the window)."""
    name = _register_cpu_standin()
    make = {"mistral": _tiny_mistral, "gemma2": _tiny_gemma2, "gpt_oss": _tiny_gpt_oss}
    model = make[family](reference_impl, 6).eval()
    ids = torch.randint(0, 128, (2, 24))
    expected, generated = _logits_and_greedy_tokens(model, ids)
    model.set_attn_implementation(name)
    got, again = _logits_and_greedy_tokens(model, ids)
    with torch.no_grad():
        # the features matter here: a backend that drops them gives other logits
        blind = hopper_tf.register("hopper_attn_cpu_blind", backend=lambda q, k, v, c, s,
                                   **features: reference(q, k, v, c, s)[0])
        model.set_attn_implementation(blind)
        without = model(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(generated, again)
    assert (without - expected).abs().max() > 1e-2


def test_transformers_cpu_packed_gpt_oss_passes_its_sinks():
    """gpt-oss (sinks, window 6 on alternate layers) on one row of packed documents (the
    flattening collator's kwargs; transformers' gpt-oss builds no packed mask from position
    ids): the packed route hands `s_aux` to the varlen backend, and a per-document stand-in
    gives the logits of each document run alone (eager)."""
    pytest.importorskip("transformers")
    features_seen = []

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, **features):
        features_seen.append(sorted(features))
        cq, ck = cu_q.tolist(), cu_k.tolist()
        return torch.cat([reference(q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]],
                                    v[None, ck[b]:ck[b + 1]], causal, scale, **features)[0][0]
                          for b in range(len(cq) - 1)]).to(q.dtype)

    dense = lambda q, k, v, c, s, **features: reference(q, k, v, c, s, **features)[0]  # noqa
    packed_name = hopper_tf.register("hopper_attn_cpu_packed", backend=dense,
                                     varlen_backend=varlen)
    model = _tiny_gpt_oss("eager", 6).eval()
    lengths = (10, 14)
    ids = torch.randint(0, 128, (1, sum(lengths)))
    with torch.no_grad():
        alone = torch.cat([model(part).logits for part in ids.split(lengths, 1)], 1)
        model.set_attn_implementation(packed_name)
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
        packed = model(ids, position_ids=positions, use_cache=False, cu_seq_lens_q=cu,
                       cu_seq_lens_k=cu, max_length_q=max(lengths),
                       max_length_k=max(lengths)).logits
    torch.testing.assert_close(packed, alone, atol=1e-4, rtol=1e-4)
    assert features_seen == [["sinks", "window_size"], ["sinks"]]     # (sliding, full)


# --- SDPA provider, on the CPU ---------------------------------------------------------------

needs_registry = pytest.mark.skipif(not hopper_sdpa.available(),
                                    reason="this torch has no register_flash_attention_impl")


@needs_registry
def test_sdpa_register_activate_restore():
    import torch.nn.attention as attention_module
    assert hopper_sdpa.register() == "hopper_attn"
    assert "hopper_attn" in attention_module.list_flash_attention_impls()
    assert not hopper_sdpa.is_active()                # registering activates nothing
    previous = attention_module.current_flash_attention_impl()
    try:
        hopper_sdpa.activate()
        assert hopper_sdpa.is_active()
        assert torch._C._dispatch_has_kernel_for_dispatch_key(hopper_sdpa.FORWARD_OP, "CUDA")
    finally:
        hopper_sdpa.deactivate()
    assert not hopper_sdpa.is_active()
    assert attention_module.current_flash_attention_impl() == previous


def test_sdpa_register_without_registry(monkeypatch):
    monkeypatch.setattr(hopper_sdpa, "available", lambda: False)
    with pytest.raises(RuntimeError, match="register_flash_attention_impl"):
        hopper_sdpa.register()


def test_sdpa_forward_backward_mapping():
    """SDPA's (B, H, N, d) tensors reach the kernels as (B, N, H, d) views; the outputs come
    back in SDPA's layout and tuple order."""
    def attention(q, k, v, causal, softmax_scale, return_lse):
        assert q.shape == (2, 32, 8, 64) and k.shape == (2, 32, 2, 64) and return_lse
        return reference(q, k, v, causal, softmax_scale)

    q, k, v = bhnd(2, 8, 32), bhnd(2, 2, 32), bhnd(2, 2, 32)
    out, lse, cq, ck, max_q, max_k, seed, offset, debug = hopper_sdpa.run_forward(
        q, k, v, 0.0, True, False, 0.2, attention)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2,
                                              enable_gqa=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert lse.shape == (2, 8, 32) and lse.dtype == torch.float32
    assert (cq, ck, max_q, max_k) == (None, None, 32, 32) and seed.shape == (2,)

    def backward(q_, k_, v_, o_, do_, lse_, causal, scale, deterministic):
        assert q_.shape == (2, 32, 8, 64) and lse_.shape == (2, 8, 32) and causal
        return q_ * 2, k_ * 3, v_ * 4
    dq, dk, dv = hopper_sdpa.run_backward(out, q, k, v, out, lse, 0.0, True, 0.2, backward)
    assert torch.equal(dq, q * 2) and torch.equal(dk, k * 3) and torch.equal(dv, v * 4)


def test_sdpa_dispatcher_round_trip_on_cpu():
    """The provider's kernels installed for the CPU key (stand-ins for the GPU kernels):
    torch's dispatcher hands them the SDPA op's arguments, takes their outputs (None for the
    undefined cum_seq tensors), and autograd's formula for the op calls the backward."""
    seen = []

    def attention(q, k, v, causal, softmax_scale, return_lse):
        return reference(q, k, v, causal, softmax_scale)

    def backward(q, k, v, out, dout, lse, causal, scale, deterministic):
        seen.append((tuple(q.shape), tuple(k.shape), tuple(lse.shape), causal, scale))
        return reference_backward(q, k, v, out, dout, causal, scale)

    hopper_sdpa.reset_counts()
    handle = hopper_sdpa._install(attention, backward, dispatch_key="CPU")
    try:
        q, k, v = (bhnd(2, h, 32).requires_grad_() for h in (8, 2, 2))
        result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False,
                                                                    scale=0.2)
        grad = torch.randn_like(result[0])
        result[0].backward(grad)
    finally:
        handle.remove()
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(hopper_sdpa.FORWARD_OP, "CPU")
    assert seen == [((2, 32, 8, 64), (2, 32, 2, 64), (2, 8, 32), True, 0.2)]
    assert result[2] is None and result[4:6] == (32, 32)
    q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
    expected = F.scaled_dot_product_attention(q2, k2, v2, is_causal=True, scale=0.2,
                                              enable_gqa=True)
    expected.backward(grad)
    for got, want in ((result[0], expected), (q.grad, q2.grad), (k.grad, k2.grad),
                      (v.grad, v2.grad)):
        torch.testing.assert_close(got.detach(), want.detach(), atol=1e-4, rtol=1e-4)
    assert hopper_sdpa.counts()["forward"] == 1 and hopper_sdpa.counts()["backward"] == 1


def test_sdpa_refusal_without_fallback_kernel_says_why():
    def attention(*args, **kwargs):
        raise ValueError("head_dim 80 is not run here")

    handle = hopper_sdpa._install(attention, None, dispatch_key="CPU")
    try:
        q = bhnd(1, 2, 16)
        with pytest.raises(ValueError, match="head_dim 80"):
            torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.0, False, False)
    finally:
        handle.remove()
    assert hopper_sdpa.counts()["last_fallback"]["forward"] == "head_dim 80 is not run here"


def test_sdpa_refuses_dropout_and_debug_mask():
    q = bhnd(1, 2, 8)
    with pytest.raises(ValueError, match="dropout"):
        hopper_sdpa.run_forward(q, q, q, 0.1, False, False, None, lambda *a, **k: None)
    with pytest.raises(ValueError, match="return_debug_mask"):
        hopper_sdpa.run_forward(q, q, q, 0.0, False, True, None, lambda *a, **k: None)
    with pytest.raises(ValueError, match="dropout"):
        hopper_sdpa.run_backward(q, q, q, q, q, q, 0.1, False, None, lambda *a: None)
    with pytest.raises(ValueError, match="no kernel to fall back"):
        hopper_sdpa._fallback("forward", None, "why", None, (), {})


def test_models_harness_help(capsys):
    from hopper_attn.harness import models
    with pytest.raises(SystemExit):
        models.main(["--help"])
    assert "--quick" in capsys.readouterr().out


def test_models_packed_row_and_arguments():
    """The packed part's row: lognormal lengths filling N (seeded, at least 2 tokens each),
    position ids restarting, cu_seqlens, labels -100 on each document's first token, the
    padded batch; and its arguments (nothing built, nothing timed)."""
    from hopper_attn.harness import models, models_packed as mp
    lengths = mp.document_lengths(8192, 8)
    assert sum(lengths) == 8192 and min(lengths) >= 2 and lengths == mp.document_lengths(8192, 8)
    row = mp.packed_row([3, 1, 4], vocab=50, seed=0)
    assert row.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert row.cu_seqlens.tolist() == [0, 3, 4, 8] and row.cu_seqlens.dtype == torch.int32
    assert row.max_length == 4 and row.predictions() == 5
    assert (row.labels == -100).nonzero()[:, 1].tolist() == [0, 3, 4]
    assert row.flash_kwargs()["max_length_q"] == 4
    ids, mask, labels = mp.padded_batch(row)
    assert ids.shape == (3, 4) and mask.sum(1).tolist() == [3, 1, 4]
    assert ids[2].tolist() == row.input_ids[0, 4:].tolist() and (labels != -100).sum() == 5
    pytest.importorskip("transformers")
    for bad in (["--only", "packed,bogus", "--cpu-stand-in"],
                ["--only", "train", "--cpu-stand-in"]):
        with pytest.raises(SystemExit):
            models.main(bad)


# --- GPU -------------------------------------------------------------------------------------

def _gpu_llama(attn):
    model = _tiny_llama(attn, layers=2, hidden=512, heads=4, kv_heads=2, vocab=256)
    return model.to("cuda", torch.bfloat16)


def _training_step(model, impl, ids):
    """One training step of `model` with attention `impl`: logits, loss and every
    parameter's gradient, in fp32."""
    model.set_attn_implementation(impl)
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    result = {"logits": out.logits.float(), "loss": out.loss.float().reshape(1)}
    result.update({n: p.grad.float().clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    return result


def _assert_training_as_close_as(model, baseline, name):
    """bf16 `model` with hopper_attn (`name`): logits, loss and every gradient within 3x
    (+ 2e-3, relative to the largest) the error of bf16 `baseline` attention, both against
    the same model in fp32 with `baseline`."""
    import copy
    fp32_model = copy.deepcopy(model).float()
    ids = torch.randint(0, 256, (2, 384), device="cuda")
    truth = _training_step(fp32_model, baseline, ids)
    base, ours = _training_step(model, baseline, ids), _training_step(model, name, ids)
    for what, want in truth.items():
        scale = want.abs().max().clamp_min(1e-6)
        err_base = float((base[what] - want).abs().max() / scale)
        err_ours = float((ours[what] - want).abs().max() / scale)
        assert err_ours <= 3 * err_base + 2e-3, \
            f"{what}: error vs fp32 {err_ours:.3g}, bf16 {baseline}'s {err_base:.3g}"


@pytest.mark.gpu
def test_gpu_llama_training_matches_sdpa():
    """Logits, loss and every gradient of a 2-layer random Llama (head_dim 128, GQA 4/2) in
    bf16 with hopper_attn: about as far from the same model in fp32 as bf16 SDPA is (a
    wrong mask or scale would be 10-100x further)."""
    pytest.importorskip("transformers")
    name = hopper_tf.register()
    model = _gpu_llama("sdpa").train()
    _assert_training_as_close_as(model, "sdpa", name)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt_oss"])
def test_gpu_window_softcap_training_matches_eager(family):
    """Logits, loss and every gradient of a 2-layer random Mistral (window 128 on every
    layer), Gemma 2 (softcap 50, window 128 on alternate layers), head_dim 128, or gpt-oss
    (sinks, window 128 on alternate layers, head_dim 64, the sinks' gradients too) in bf16
    with hopper_attn: about as far from the same model in fp32 (eager attention) as bf16
    eager is."""
    transformers = pytest.importorskip("transformers")
    name = hopper_tf.register()
    common = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  sliding_window=128, attn_implementation="eager")
    torch.manual_seed(0)
    if family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common))
    elif family == "gpt_oss":
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
            head_dim=64, num_local_experts=4, num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"], **common))
        for layer in model.model.layers:
            layer.self_attn.sinks.data = torch.randn_like(layer.self_attn.sinks) * 2
    else:
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            head_dim=128, query_pre_attn_scalar=128, attn_logit_softcapping=50.0, **common))
    model = model.to("cuda", torch.bfloat16).train()
    _assert_training_as_close_as(model, "eager", name)


@pytest.mark.gpu
def test_gpu_packed_training_matches_separate_documents():
    """A 2-layer random Llama trained on one row of three packed documents (position ids
    that restart; and again with the collator's cu_seq_lens kwargs): logits and every
    gradient within the bf16 rule of SDPA run on each document separately."""
    pytest.importorskip("transformers")
    name = hopper_tf.register()
    model = _gpu_llama("sdpa").train()
    lengths = [300, 17, 195]
    ids = torch.randint(0, 256, (1, sum(lengths)), device="cuda")
    pos = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    cu = torch.tensor([0, 300, 317, 512], dtype=torch.int32, device="cuda")

    def step(impl, dtype, **kw):
        m = model.to(dtype)
        m.zero_grad(set_to_none=True)
        m.set_attn_implementation(impl)
        if impl == "sdpa":          # each document alone
            logits = torch.cat([m(ids[:, a:b], use_cache=False).logits
                                for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], 1)
        else:
            logits = m(ids, position_ids=pos, use_cache=False, **kw).logits
        logits.float().square().mean().backward()
        out = {"logits": logits.float().detach()}
        out.update({n: p.grad.float().clone() for n, p in m.named_parameters()})
        return out
    truth = step("sdpa", torch.float32)
    base = step("sdpa", torch.bfloat16)
    flash_kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=300,
                        max_length_k=300)
    for ours in (step(name, torch.bfloat16), step(name, torch.bfloat16, **flash_kwargs)):
        for what, want in truth.items():
            scale = want.abs().max().clamp_min(1e-6)
            err_base = float((base[what] - want).abs().max() / scale)
            err_ours = float((ours[what] - want).abs().max() / scale)
            assert err_ours <= 3 * err_base + 2e-3, (what, err_ours, err_base)


@pytest.mark.gpu
def test_gpu_llama_generate_matches_sdpa():
    """Greedy tokens with a KV cache (prefill, then one query per step) as SDPA's: every
    step until the first where SDPA's top two logits are a near tie."""
    pytest.importorskip("transformers")
    name = hopper_tf.register()
    model = _gpu_llama("sdpa").eval()
    ids = torch.randint(0, 256, (2, 200), device="cuda")
    kwargs = dict(max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids),
                  output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        expected = model.generate(ids, **kwargs)
        model.set_attn_implementation(name)
        got = model.generate(ids, **kwargs)
    for step, scores in enumerate(expected.scores):
        same = torch.equal(got.sequences[:, 200 + step], expected.sequences[:, 200 + step])
        if not same:
            top2 = scores.float().topk(2, dim=-1).values
            assert (top2[:, 0] - top2[:, 1]).min() < 0.05, f"tokens differ at step {step}"
            break


@pytest.mark.gpu
@pytest.mark.skipif(not hopper_sdpa.available(), reason="no flash-attention provider registry")
def test_gpu_sdpa_provider():
    """F.scaled_dot_product_attention on the flash backend runs this project's kernels once
    activated (GQA, causal, forward and backward), falls back to torch's for head_dim 80, and
    is torch's own again after deactivate()."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(d, causal=True):
        torch.manual_seed(0)
        q = torch.randn(2, 8, 512, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(2, 2, 512, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(2, 2, 512, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        out.backward(torch.ones_like(out))
        return out.float(), q.grad.float(), k.grad.float(), v.grad.float()

    expected = {d: run(d) for d in (128, 80)}
    hopper_sdpa.reset_counts()
    hopper_sdpa.activate()
    try:
        got = {d: run(d) for d in (128, 80)}
        counts = hopper_sdpa.counts()
    finally:
        hopper_sdpa.deactivate()
    assert counts.get("forward") == 1 and counts.get("backward") == 1, counts
    assert counts.get("forward_fallback") == 1 and counts.get("backward_fallback") == 1, counts
    for d in (128, 80):
        for what, a, b in zip(("out", "dq", "dk", "dv"), got[d], expected[d]):
            err = (a - b).abs().max() / b.abs().max().clamp_min(1e-6)
            assert err < 2e-2, f"head_dim {d} {what}: max |diff| / max |torch's| = {err:.3g}"
    hopper_sdpa.reset_counts()
    run(128)
    assert "forward" not in hopper_sdpa.counts()
