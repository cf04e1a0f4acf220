"""`attn_implementation="hopper_attn"` for Hugging Face transformers (5.x).

    import hopper_attn.integrations.transformers as hopper_tf
    hopper_tf.register()
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16,
                                                 attn_implementation="hopper_attn")
    # or, on a model already built: model.set_attn_implementation("hopper_attn")

`register()` puts two functions under one name: the attention call (transformers'
`AttentionInterface`) and a mask function (`AttentionMaskInterface`). transformers calls
the attention with `(module, query, key, value, attention_mask, dropout, scaling, **kwargs)`,
q, k and v as (batch, heads, seqlen, head_dim) views, k and v with the model's KV heads (no
repeat); this passes them to `hopper_attn.attention` as (batch, seqlen, heads, head_dim)
views (for Llama-style projections those are the projections' own layout: no copy) and
returns the output in that layout, which is what transformers expects. v may be narrower
than q and k where `attention()` runs the pair (DeepSeek's MLA hands it v 128 wide with q
and k 192: forward and backward; docs/head-dim-v.md).

What runs: causal (decoder) and non-causal (encoder, cross-attention) modules, GQA/MQA read
in place, the module's `scaling`, and generation with a growing KV cache (`DynamicCache`,
the default): a query block shorter than the keys is aligned bottom-right, as a cache needs.
bf16 or fp16, the head dims `hopper_attn.attention` runs (64, 96, 128, 192, 256; training
at all of them). Causal sliding windows (Mistral, Qwen2, Gemma 2/3's local layers: the
call's `sliding_window=N`, a query sees itself and the N - 1 keys before it, which is
`window_size=(N - 1, 0)`; every head dim) and logit softcapping (Gemma 2: the call's
`softcap`, `attention(softcap=...)`; training at head dims 64 to 192), attention sinks
(gpt-oss: the call's `s_aux`, one logit per query head, `attention(sinks=...)`, gradients
included); a sliding-window layer's trimmed cache (`DynamicSlidingWindowLayer`) too, since
its keys end at the last query.

Packed sequences (several documents in one row, as `DataCollatorWithFlattening` makes
them) run through `hopper_attn.attention_varlen` (windows, softcap and gpt-oss's sinks
included): either from the `cu_seq_lens_q/k` and
`max_length_q/k` the collator passes (`return_flash_attn_kwargs=True`: nothing read on the
host), or from position ids that restart, which transformers turns into a "same document"
mask pattern when there is neither a mask nor a cache: the mask function then reads the
document boundaries once per forward (one host synchronisation; eager only, so under
torch.compile pass the collator's kwargs).

What is refused, before any launch (`UnsupportedFeature`, both a ValueError and a
NotImplementedError, naming the feature), rather than computed differently: a padding mask
with real padding (a 2-D mask with zeros, or any 4-D mask), bidirectional sliding windows
(eager/SDPA and transformers' flash path disagree on their width), chunked attention,
dropout > 0, a static (preallocated) KV cache; and (a plain
ValueError) a causal call with more queries than keys, a softcap that is not a positive
number, a sliding window below 1.

The mask function is where padding, packing and static caches are seen: transformers hands
it the 2-D padding mask, the mask pattern it built (causal, or causal and "same document"
for packed sequences, ...) and the query/key offsets of the cache, once per forward. It
returns None when the call is plain causal or bidirectional attention over every key, or
causal attention in a sliding window (the window's width reaches the attention call as its
`sliding_window` argument, which every transformers model that builds a sliding mask passes
to its sliding layers), and raises otherwise.

The mapping is plain functions (`plan_call`, `check_mask_request`, `mask_function_parts`)
that need neither a GPU nor transformers; nothing here imports transformers until
`register()` runs.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Callable, Optional

import torch

from hopper_attn.common.contract import UnsupportedProblem

NAME = "hopper_attn"


class UnsupportedFeature(UnsupportedProblem, NotImplementedError):
    """A model feature this integration does not run yet (a ValueError, like every refusal
    in this project, and a NotImplementedError)."""


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """What one attention call of a model becomes: `attention(q, k, v, causal=...,
    softmax_scale=..., window_size=..., softcap=..., sinks=...)` on the (batch, seqlen,
    heads, head_dim) views of its inputs. window_size (-1, -1), softcap 0.0, sinks None:
    none. varlen: packed sequences, `attention_varlen`'s (cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k) over the (batch x seqlen) tokens; None: a plain call."""
    causal: bool
    softmax_scale: Optional[float]
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    varlen: Optional[tuple] = None
    sinks: Optional[torch.Tensor] = dataclasses.field(default=None, compare=False)

    def features(self) -> dict:
        """The keyword arguments a backend gets beyond (q, k, v, causal, softmax_scale):
        only those that are set, so that a backend without windows or softcap still runs
        every call that has neither."""
        out = {}
        if self.window_size != (-1, -1):
            out["window_size"] = self.window_size
        if self.softcap:
            out["softcap"] = self.softcap
        if self.sinks is not None:
            out["sinks"] = self.sinks
        return out


# transformers' mask pieces, by the name of the function that builds them, and what a user
# would call them (transformers/masking_utils.py)
_MASK_FEATURES = {
    "sliding_window_bidirectional_overlay": "a bidirectional sliding window",
    "chunked_overlay": "chunked attention",
    "padding_mask_function": "a padding mask",
    "blockwise_overlay": "a block-wise (bidirectional within blocks) mask",
}
_PLAIN_MASKS = {"causal_mask_function": True, "bidirectional_mask_function": False}
# run without a mask when the attention call carries the window (`sliding_window`)
_WINDOW_MASKS = {"sliding_window_overlay"}
_COMBINATORS = {"and_masks", "or_masks", "add_offsets_to_mask_function"}
# documents packed in a row (position ids that restart): run as a varlen batch
_PACKED_MASK = "packed_sequence_mask_function"


class PackedSequences:
    """Documents packed along the rows of a batch: what this integration's mask function
    returns for one (transformers hands it to every attention call as its
    `attention_mask`), holding transformers' per-token document index (batch, seqlen),
    which counts up inside a row (masking_utils.find_packed_sequence_indices).
    `offsets()` turns it into attention_varlen's (cu_seqlens, max_seqlen) over the
    flattened (batch x seqlen) tokens, once (the layers share it), reading the boundaries on
    the host (one synchronisation); calls that bring the collator's cu_seq_lens never ask."""

    def __init__(self, document_ids: torch.Tensor):
        self.document_ids = document_ids
        self._offsets = None

    def offsets(self) -> tuple:
        """(cu_seqlens int32 on the tokens' device, max_seqlen)."""
        if self._offsets is None:
            if torch.compiler.is_compiling():
                raise UnsupportedFeature(
                    "hopper_attn reads packed documents' boundaries from position ids only "
                    "in eager mode; under torch.compile pass cu_seq_lens_q/k and "
                    "max_length_q/k (the flattening collator's return_flash_attn_kwargs="
                    "True; transformers composes its packed-sequence mask whenever it "
                    "traces a forward with position ids)")
            ids = self.document_ids
            starts = torch.ones_like(ids, dtype=torch.bool)
            starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
            first = starts.flatten().nonzero().flatten()
            end = torch.tensor([ids.numel()], dtype=first.dtype, device=ids.device)
            cu_seqlens = torch.cat([first, end]).to(torch.int32)
            self._offsets = (cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))
        return self._offsets


def packed_document_ids(fn) -> Optional[torch.Tensor]:
    """The document-index tensor inside mask function `fn` (transformers'
    packed_sequence_mask_function closes over it), or None."""
    outer = getattr(fn, "__qualname__", type(fn).__name__).split(".")[0]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:
            continue
        if outer == _PACKED_MASK and isinstance(inner, torch.Tensor):
            return inner
        if outer in _COMBINATORS:
            for item in (inner if isinstance(inner, (tuple, list)) else (inner,)):
                if callable(item) and not isinstance(item, (torch.Tensor, type)):
                    found = packed_document_ids(item)
                    if found is not None:
                        return found
    return None


def mask_function_parts(fn) -> tuple:
    """The names of the transformers functions that built mask function `fn`, combinators
    (and_masks, or_masks) unwrapped: ("causal_mask_function",) for a plain causal mask,
    ("sliding_window_overlay", "causal_mask_function") for a sliding window, ..."""
    outer = getattr(fn, "__qualname__", type(fn).__name__).split(".")[0]
    if outer not in _COMBINATORS:
        return (outer,)
    parts = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:                    # an empty cell
            continue
        for item in (inner if isinstance(inner, (tuple, list)) else (inner,)):
            if callable(item) and not isinstance(item, (torch.Tensor, type)):
                parts.extend(mask_function_parts(item))
    return tuple(parts)


def _refused_mask_features(parts: tuple) -> list:
    features = []
    for part in parts:
        if part in _PLAIN_MASKS or part == _PACKED_MASK:
            continue
        if part in _WINDOW_MASKS:
            if "causal_mask_function" not in parts:
                features.append("a sliding window without a causal mask")
            continue
        feature = _MASK_FEATURES.get(part, f"a custom mask function ({part})")
        if feature not in features:
            features.append(feature)
    return features


def check_mask_request(q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                       mask_function: Optional[Callable] = None,
                       attention_mask: Optional[torch.Tensor] = None,
                       compiling: Optional[bool] = None) -> bool:
    """Whether transformers' mask request is one `hopper_attn.attention` computes without a
    mask; returns the mask's causality (True for causal, False for bidirectional) or raises
    UnsupportedFeature. The arguments are those transformers passes to a mask function
    (masking_utils.py): the query and key lengths and offsets of this forward, the mask
    pattern, the user's 2-D padding mask (batch, past + new tokens) or None."""
    if compiling is None:
        compiling = torch.compiler.is_compiling()
    parts = mask_function_parts(mask_function) if mask_function is not None else (
        "causal_mask_function",)
    refused = _refused_mask_features(parts)
    if refused:
        raise UnsupportedFeature(f"hopper_attn does not run {' and '.join(refused)} yet; use "
                                 "attn_implementation='sdpa' (or 'flash_attention_4') for this "
                                 "model or batch")
    causal = "causal_mask_function" in parts
    if _PACKED_MASK in parts:
        # (under torch.compile transformers composes this part whenever position ids are
        # given: the attention call then needs the collator's cu_seq_lens, PackedSequences)
        if attention_mask is not None or q_offset != 0 or kv_offset != 0 \
                or q_length != kv_length:
            raise UnsupportedFeature("hopper_attn runs packed sequences without a padding "
                                     "mask or a KV cache only")
    # A sliding-window layer's cache (DynamicSlidingWindowLayer) keeps the last window - 1
    # keys: its kv_offset moves with it, and the keys still end at the last query.
    if isinstance(q_offset, torch.Tensor):
        # a StaticLayer's offset (a tensor, so that torch.compile does not specialize on it)
        if compiling:
            raise UnsupportedFeature("hopper_attn does not run a static (preallocated) KV "
                                     "cache: its unfilled slots would be attended; use the "
                                     "default DynamicCache")
        q_offset = int(q_offset)
    if causal and q_offset - kv_offset != kv_length - q_length:
        # keys past the last query's position: a static cache's unfilled slots
        raise UnsupportedFeature(
            f"hopper_attn does not run a KV cache whose keys do not end at the last query "
            f"(queries at {q_offset}..{q_offset + q_length - 1}, keys {kv_offset}.."
            f"{kv_offset + kv_length - 1}: a static, preallocated cache?); use the default "
            "DynamicCache")
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise UnsupportedFeature(f"hopper_attn takes no {attention_mask.dim()}-D "
                                     "attention mask")
        if compiling:
            raise UnsupportedFeature("hopper_attn cannot check a padding mask inside "
                                     "torch.compile; pass attention_mask=None (no padding)")
        mask = attention_mask[:, -kv_length:]
        if mask.shape[-1] != kv_length or not bool(mask.all()):
            raise UnsupportedFeature("hopper_attn does not run a padding mask with real "
                                     "padding yet (variable-length sequences); use batches "
                                     "without padding, or attn_implementation='sdpa'")
    return causal


def hopper_attn_mask(batch_size: int, q_length: Optional[int] = None,
                     kv_length: Optional[int] = None, q_offset=0, kv_offset: int = 0,
                     mask_function: Optional[Callable] = None,
                     attention_mask: Optional[torch.Tensor] = None, cache_position=None,
                     **kwargs):
    """transformers mask function for "hopper_attn": None (no mask: the attention call's
    causal flag and sliding_window say everything), PackedSequences for documents packed in
    the rows (position ids that restart), or UnsupportedFeature. (transformers before 5.8
    passes the query positions as `cache_position` instead of q_length / q_offset.)"""
    if q_length is None and cache_position is not None:
        q_length, q_offset = cache_position.shape[0], cache_position[0]
    check_mask_request(q_length, kv_length, q_offset, kv_offset, mask_function,
                       attention_mask)
    ids = packed_document_ids(mask_function) if mask_function is not None else None
    return None if ids is None else PackedSequences(ids)


_SIMPLE_KWARGS_REFUSED = {
    "position_bias": "an additive position bias (T5-style)",
}


def plan_call(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask=None, dropout: float = 0.0, scaling: Optional[float] = None,
              sliding_window: Optional[int] = None, softcap: Optional[float] = None,
              is_causal: Optional[bool] = None, s_aux=None, **kwargs) -> CallPlan:
    """How one transformers attention call maps onto `hopper_attn.attention`, or
    UnsupportedFeature / ValueError naming what it cannot run. Arguments as transformers
    passes them (query, key, value: (batch, heads, seqlen, head_dim))."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, heads, seqlen, head_dim), "
                             f"got {getattr(t, 'shape', type(t).__name__)}")
    if dropout:
        raise UnsupportedFeature(f"hopper_attn has no attention dropout (dropout={dropout}); "
                                 "set the config's attention_dropout to 0 or call model.eval()")
    if s_aux is not None and (not isinstance(s_aux, torch.Tensor)
                              or tuple(s_aux.shape) != (query.shape[1],)):
        raise ValueError(f"s_aux (attention sinks) must be a tensor of one logit per query "
                         f"head, shape ({query.shape[1]},), got "
                         f"{getattr(s_aux, 'shape', type(s_aux).__name__)}")
    for name, feature in _SIMPLE_KWARGS_REFUSED.items():
        if kwargs.get(name) is not None:
            raise UnsupportedFeature(f"hopper_attn does not run {feature} yet")
    varlen = packed_call(kwargs, attention_mask)
    if isinstance(attention_mask, PackedSequences):
        attention_mask = None                   # (its documents are in `varlen`)
    if attention_mask is not None:
        raise UnsupportedFeature(
            "hopper_attn takes no attention mask (a padding mask or a custom "
            f"{getattr(attention_mask, 'dim', lambda: '?')()}-D mask); its mask function "
            "(registered by hopper_attn.integrations.transformers.register) passes None for "
            "every mask it can run")
    if key.shape[-1] != query.shape[-1]:       # (v's may differ: DeepSeek's MLA, attention())
        raise ValueError(f"hopper_attn needs one head_dim for q and k, got "
                         f"{query.shape[-1]}, {key.shape[-1]}")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal = bool(is_causal)
    window_size = window_from_sliding_window(sliding_window, causal)
    softcap = softcap_value(softcap)
    q_length, kv_length = query.shape[2], key.shape[2]
    if causal and q_length == 1 and window_size == (-1, -1):
        causal = False         # one query over the whole cache: the same thing, fewer checks
    if varlen is not None and (q_length != kv_length or query.shape[0] * q_length
                               != key.shape[0] * kv_length):
        raise UnsupportedFeature("hopper_attn runs packed sequences without a KV cache only")
    if causal and q_length > kv_length:
        raise ValueError(f"a causal call with more queries ({q_length}) than keys "
                         f"({kv_length}): transformers aligns such a mask top-left, "
                         "hopper_attn bottom-right")
    scale = None if scaling is None else float(scaling)
    if varlen is not None or s_aux is not None:
        return CallPlan(causal=causal, softmax_scale=scale, window_size=window_size,
                        softcap=softcap, varlen=varlen, sinks=s_aux)
    return _plain_plan(causal, scale, window_size, softcap)


# The plans of calls without packed sequences or sinks, by their fields (a model's layers
# share a few): a generation step builds none.
_PLAIN_PLANS: dict = {}


def _plain_plan(causal: bool, scale: Optional[float], window_size: tuple,
                softcap: float) -> CallPlan:
    key = (causal, scale, window_size, softcap)
    plan = _PLAIN_PLANS.get(key)
    if plan is None:
        if len(_PLAIN_PLANS) >= 1024:          # (many scales: start over)
            _PLAIN_PLANS.clear()
        plan = _PLAIN_PLANS[key] = CallPlan(causal=causal, softmax_scale=scale,
                                            window_size=window_size, softcap=softcap)
    return plan


def packed_call(kwargs: dict, attention_mask) -> Optional[tuple]:
    """attention_varlen's (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) for a
    packed batch: the flattening collator's `cu_seq_lens_q/k` and `max_length_q/k` when
    the call has them, else the documents this integration's mask function found
    (PackedSequences); None for a plain call."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        if isinstance(attention_mask, PackedSequences):
            cu_seqlens, max_seqlen = attention_mask.offsets()
            return (cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
        return None
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if cu_q is None or cu_k is None or max_q is None or max_k is None:
        raise ValueError("packed sequences need all of cu_seq_lens_q, cu_seq_lens_k, "
                         "max_length_q and max_length_k (a flattening collator with "
                         "return_flash_attn_kwargs=True passes them)")
    return (cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k))


def window_from_sliding_window(sliding_window: Optional[int], causal: bool) -> tuple:
    """transformers' `sliding_window=N` as `attention()`'s window_size: (-1, -1) for None.
    transformers' causal sliding mask keeps key j for query i when i - N < j <= i
    (masking_utils.sliding_window_overlay: the query and the N - 1 keys before it), and its
    flash path passes window_size=(N - 1, N - 1) with causal=True; so (N - 1, 0)."""
    if sliding_window is None:
        return (-1, -1)
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) \
            or sliding_window < 1:
        raise ValueError(f"sliding_window must be an int >= 1 (the tokens a query sees, "
                         f"itself included), got {sliding_window!r}")
    if not causal:
        # eager/SDPA's bidirectional window keeps |i - j| <= N, transformers' flash path
        # |i - j| <= N - 1: no one answer to match
        raise UnsupportedFeature(f"hopper_attn does not run a bidirectional sliding window "
                                 f"(sliding_window={sliding_window} on a non-causal call) yet")
    return (sliding_window - 1, 0)


def softcap_value(softcap: Optional[float]) -> float:
    """transformers' `softcap` (Gemma 2's attn_logit_softcapping: cap * tanh(s / cap) on the
    scaled scores, as `attention(softcap=cap)`) as a float; 0.0 for None."""
    if softcap is None:
        return 0.0
    value = float(softcap)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"softcap must be a positive number (Gemma 2: "
                         f"attn_logit_softcapping), got {softcap!r}")
    return value


def _default_varlen_backend(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale,
                            **features):
    from hopper_attn.api import attention_varlen
    return attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                            softmax_scale=softmax_scale, **features)


def _default_backend(q, k, v, causal, softmax_scale, **features):
    # (only the features a call has: attention() skips the checks of its own defaults)
    from hopper_attn.api import attention
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"hopper_attn runs bf16 or fp16, got {q.dtype}: load the model "
                         "with dtype=torch.bfloat16")
    return attention(q, k, v, causal=causal, softmax_scale=softmax_scale, **features)


_warned_output_attentions = False


def make_attention_forward(backend: Optional[Callable] = None,
                           varlen_backend: Optional[Callable] = None) -> Callable:
    """A transformers attention function that runs `backend(q, k, v, causal,
    softmax_scale, **features) -> out` on (batch, seqlen, heads, head_dim) views, features
    being `window_size=(left, right)`, `softcap=cap` and `sinks=s_aux` when the call has
    them (default:
    `hopper_attn.attention`; another one, e.g. FlashAttention-4's `flash_attn_func`, gets
    the same mapping and the same refusals). Packed sequences run `varlen_backend(q, k, v,
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
    **features)` on (tokens, heads, head_dim) views (default with the default backend:
    `hopper_attn.attention_varlen`; a backend without one refuses them)."""
    run = backend or _default_backend
    run_varlen = varlen_backend or (_default_varlen_backend if backend is None else None)

    def attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                          scaling=None, sliding_window=None, softcap=None, is_causal=None,
                          s_aux=None, **kwargs):
        global _warned_output_attentions
        if kwargs.pop("output_attentions", False) and not _warned_output_attentions:
            _warned_output_attentions = True
            warnings.warn("hopper_attn returns no attention weights (output_attentions)")
        plan = plan_call(module, query, key, value, attention_mask, dropout, scaling,
                         sliding_window, softcap, is_causal, s_aux, **kwargs)
        if plan.varlen is not None:
            if run_varlen is None:
                raise UnsupportedFeature("this backend runs no packed sequences")
            b, h, n, _ = query.shape
            q, k, v = (t.transpose(1, 2).reshape(b * n, t.shape[1], t.shape[3])
                       for t in (query, key, value))
            out = run_varlen(q, k, v, *plan.varlen, plan.causal, plan.softmax_scale,
                             **plan.features())
            return out.view(b, n, h, out.shape[-1]), None
        out = run(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                  plan.causal, plan.softmax_scale, **plan.features())
        if isinstance(out, tuple):           # (out, lse) from FlashAttention-4's interface
            out = out[0]
        return out, None

    return attention_forward


hopper_attention_forward = make_attention_forward()


def register(name: str = NAME, backend: Optional[Callable] = None,
             varlen_backend: Optional[Callable] = None) -> str:
    """Register `name` (default "hopper_attn") with transformers: the attention function and
    its mask function. Then `attn_implementation=name` in `from_pretrained` / a model's
    constructor, or `model.set_attn_implementation(name)`. `backend` and `varlen_backend` as
    in `make_attention_forward`. Returns `name`."""
    from transformers import AttentionInterface, AttentionMaskInterface
    forward = hopper_attention_forward if backend is None and varlen_backend is None else \
        make_attention_forward(backend, varlen_backend)
    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, hopper_attn_mask)
    return name
