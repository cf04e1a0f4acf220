"""`attention_with_kvcache()`: decode attention over a KV cache, contiguous or paged, with
per-request key counts read on the device and new keys appended in the same call.

    out = hopper_attn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens,
                                             page_table=page_table, k_new=k, v_new=v)

The kernel is the decode stage (hopper_attn/decode.py: packed GQA, split-KV, combine by the
LSE in the last CTA) compiled as its `kv_cache` variant: request b's key count is
`cache_seqlens[b]` (+ seqlen_new), read by the kernel from device memory, and with a page
table each kv tile is gathered from the cache's pages (hopper_attn/common/paged.py). The
tile and the number of splits come from the shapes only (the cache's capacity stands for
the key count), so a decode step is capturable in a CUDA graph: no host reads of device
data, no data-dependent allocation. docs/kvcache.md says how.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from hopper_attn.common.contract import LOG2_E, Problem, UnsupportedProblem, normalize_window

PAGE_SIZES = (16, 32, 64, 128, 256)
MAX_QUERIES = 16            # new queries per request (one decode M tile at group <= 4)
MAX_SPLITS = 128            # decode.MAX_SPLITS (not imported here: that loads the CuTe DSL)
FP8 = torch.float8_e4m3fn


DTYPES = (torch.bfloat16, torch.float16)

_COMPILED: dict = {}
_WORKSPACES: dict = {}


def _tensor(name, t, dim=None):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    return t


def _strided_ok(name, t):
    """Last dim contiguous, the other strides multiples of 16 bytes (TMA), 16-byte aligned."""
    unit = 16 // t.element_size()
    if t.stride(-1) != 1 or any(s % unit for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1):
        raise ValueError(f"{name} needs a contiguous last dim and the other strides multiples "
                         f"of {unit} elements (16 bytes); got strides {t.stride()}")
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned")


def check_inputs(q, k_cache, v_cache, cache_seqlens, page_table=None, k_new=None, v_new=None,
                 num_splits: int = 0, softmax_scale=None, k_descale=None,
                 v_descale=None) -> tuple[int, int]:
    """Every check the host can make (ValueError, before any launch); returns (page_size
    (0: contiguous), capacity: keys a request can hold)."""
    _tensor("q", q, 4)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _tensor(name, t, 4)
    batch, seqlen_q, heads, head_dim = q.shape
    if q.dtype not in DTYPES:
        raise ValueError(f"q must be bf16 or fp16, got {q.dtype}")
    if not 1 <= seqlen_q <= MAX_QUERIES:
        raise ValueError(f"attention_with_kvcache takes 1-{MAX_QUERIES} new queries per "
                         f"request, got seqlen_q={seqlen_q} (chunked prefill, longer or "
                         f"varlen query batches, is not there yet: use attention())")
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"k_cache and v_cache must have the same shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    fp8 = k_cache.dtype == FP8
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype and not (t.dtype == FP8 and q.dtype == torch.bfloat16):
            raise ValueError(f"{name} has dtype {t.dtype}, expected q's {q.dtype} (or "
                             f"float8_e4m3fn with bf16 q)")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache must have one dtype, got {k_cache.dtype} and "
                         f"{v_cache.dtype}")
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache's head_dim ({k_cache.shape[3]}) must be q's ({head_dim})")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"q's heads ({heads}) must be a multiple of the cache's kv heads "
                         f"({kv_heads})")
    _tensor("cache_seqlens", cache_seqlens, 1)
    if cache_seqlens.dtype != torch.int32 or tuple(cache_seqlens.shape) != (batch,) \
            or not cache_seqlens.is_contiguous():
        raise ValueError(f"cache_seqlens must be a contiguous int32 tensor of shape "
                         f"({batch},), got {tuple(cache_seqlens.shape)} {cache_seqlens.dtype}")
    if page_table is None:
        page_size = 0
        capacity = k_cache.shape[1]
        if k_cache.shape[0] != batch:
            raise ValueError(f"a contiguous cache is (batch, max_seqlen, kv_heads, d): its "
                             f"batch ({k_cache.shape[0]}) must be q's ({batch}); pass a "
                             f"page_table for a paged cache")
    else:
        _tensor("page_table", page_table, 2)
        page_size = k_cache.shape[1]
        if page_table.dtype != torch.int32 or page_table.shape[0] != batch \
                or page_table.shape[1] < 1 or page_table.stride(-1) != 1:
            raise ValueError(f"page_table must be int32 (batch={batch}, max_pages >= 1) with "
                             f"a contiguous last dim, got {tuple(page_table.shape)} "
                             f"{page_table.dtype} strides {page_table.stride()}")
        if page_size not in PAGE_SIZES:
            raise ValueError(f"a paged cache is (num_pages, page_size, kv_heads, d) with "
                             f"page_size in {PAGE_SIZES}, got page_size {page_size}")
        capacity = page_table.shape[1] * page_size
    if capacity < 1:
        raise ValueError("the cache holds no key (max_seqlen 0)")
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new come together (or neither)")
    if k_new is not None:
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            _tensor(name, t, 4)
            if t.shape[0] != batch or t.shape[1] < 1 or tuple(t.shape[2:]) != (kv_heads,
                                                                                 head_dim):
                raise ValueError(f"{name} must be (batch={batch}, seqlen_new >= 1, kv_heads="
                                 f"{kv_heads}, d={head_dim}), got {tuple(t.shape)}")
            if t.dtype != k_cache.dtype:
                raise ValueError(f"{name} has dtype {t.dtype}, expected the cache's "
                                 f"{k_cache.dtype} (an e4m3 cache takes keys quantized with "
                                 f"its descales)")
        if tuple(k_new.shape) != tuple(v_new.shape):
            raise ValueError(f"k_new and v_new must have the same shape, got "
                             f"{tuple(k_new.shape)} and {tuple(v_new.shape)}")
        if k_new.shape[1] > capacity:
            raise ValueError(f"seqlen_new ({k_new.shape[1]}) is more than the cache holds "
                             f"({capacity} keys per request)")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) \
            or not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be 0 (automatic) or 1-{MAX_SPLITS}, got "
                         f"{num_splits!r}")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float))
                                          and math.isfinite(softmax_scale)):
        raise ValueError(f"softmax_scale must be a finite number or None, got "
                         f"{softmax_scale!r}")
    for name, t in (("k_descale", k_descale), ("v_descale", v_descale)):
        if t is None:
            continue
        if not fp8:
            raise ValueError(f"{name}: descales go with an e4m3 (float8_e4m3fn) cache only")
        _tensor(name, t)
        if t.dtype != torch.float32 or tuple(t.shape) not in ((batch, kv_heads), (kv_heads,)):
            raise ValueError(f"{name} must be fp32 of shape (batch, kv_heads) = "
                             f"{(batch, kv_heads)} or (kv_heads,), got {tuple(t.shape)} "
                             f"{t.dtype}")
    tensors = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
               ("cache_seqlens", cache_seqlens)]
    tensors += [(n, t) for n, t in (("k_descale", k_descale), ("v_descale", v_descale))
                if t is not None]
    tensors += [("page_table", page_table)] if page_table is not None else []
    tensors += [("k_new", k_new), ("v_new", v_new)] if k_new is not None else []
    for name, t in tensors:
        if not t.is_cuda:
            raise ValueError(f"{name} is on {t.device}; the kernels run on a CUDA device")
    if len({t.device for _, t in tensors}) != 1:
        raise ValueError("every tensor must be on one device")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _strided_ok(name, t)
    return page_size, capacity


def check_features(q, causal, window_size=(-1, -1), softcap=0.0, sinks=None) -> tuple:
    """window_size, softcap and sinks checked (ValueError): ((window_left, window_right) as
    Problem's fields (-1: unbounded; causal: right -1), the cap (0.0: none), sinks given)."""
    _tensor("q", q, 4)
    window = normalize_window(window_size, bool(causal))
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) \
            or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0: none), got {softcap!r}")
    if sinks is not None:
        from hopper_attn.common.sinks import check_sinks
        check_sinks(sinks, q.shape[2], q.device)
    return window, float(softcap), sinks is not None


def problem_for(q, kv_heads: int, capacity: int, causal: bool, window=(-1, -1)) -> Problem:
    """The decode Problem the tile and the splits are chosen for: the cache's capacity as
    the key count (shapes only); with a window's left side (Problem's fields) at most the
    keys an M tile's rows see, left + seqlen_q + right, and a kv tile (256) either side."""
    batch, seqlen_q, heads, head_dim = q.shape
    left, right = window
    if left >= 0:
        capacity = min(capacity, left + seqlen_q + max(right, 0) + 2 * 256)
    return Problem(batch, heads, seqlen_q, head_dim, bool(causal), q.dtype, heads_kv=kv_heads,
                   seqlen_k=capacity)


def append_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table=None) -> None:
    """Write k_new / v_new (batch, seqlen_new, kv_heads, d) into the cache at positions
    cache_seqlens[b] .. + seqlen_new of each request (through the page table if given),
    with torch index ops: no host synchronisation, every other cache byte unchanged.
    Positions past the cache (or a page-table slot past its width) are not checked."""
    batch, seqlen_new = k_new.shape[:2]
    pos = cache_seqlens.long()[:, None] + torch.arange(seqlen_new, device=k_new.device)
    if page_table is None:
        rows = torch.arange(batch, device=k_new.device)[:, None].expand(batch, seqlen_new)
        index = (rows, pos)
    else:
        page_size = k_cache.shape[1]
        index = (page_table.long().gather(1, pos // page_size), pos % page_size)
    for cache, new in ((k_cache, k_new), (v_cache, v_new)):
        if cache.dtype == FP8:              # (as bytes: index_put_ has no e4m3 kernel)
            cache, new = cache.view(torch.uint8), new.view(torch.uint8)
        cache[index] = new


def _int_tensor(t, tvm_ffi: bool):
    """A small int32 / fp32 tensor, read one element at a time (4-byte alignment)."""
    from cutlass.cute.runtime import from_dlpack
    return from_dlpack(t.detach(), assumed_align=4, enable_tvm_ffi=tvm_ffi) \
        .mark_layout_dynamic(leading_dim=t.dim() - 1)


def _args(tensors, tvm_ffi: bool) -> list:
    """The kernel's tensors as CuTe tensors: q, k, v, out, the fp32 workspace (16-byte
    aligned), then the key counts, the page table and the descales (4-byte aligned)."""
    from hopper_attn.common import cute_runtime as rt
    return [_int_tensor(t, tvm_ffi) if i >= 8 else rt.to_cute_tensor(t, tvm_ffi)
            for i, t in enumerate(tensors)]


def compile_kernel(head_dim: int, causal: bool, dtype, page_size: int, block_n: int,
                   stages: int, tvm_ffi: bool = False, compile_options: str = "",
                   kv_dtype=None, window=(-1, -1), softcap: float = 0.0, sinks: bool = False,
                   fp8_variant: str = ""):
    """The decode stage's `kv_cache_call` for one (head dim, mask, dtype, page size (0:
    contiguous), tile, cache dtype (None: q's; float8_e4m3fn: the fp8 variant), window (as
    Problem's fields), softcap (0: none), sinks, e4m3 A/B variant (decode.FP8_VARIANTS)),
    compiled once: (compiled function, kernel object)."""
    kv_dtype = kv_dtype or dtype
    features = (tuple(window), float(softcap), bool(sinks))
    key = (head_dim, bool(causal), dtype, page_size, block_n, stages, tvm_ffi, compile_options,
           kv_dtype) + (features if features != ((-1, -1), 0.0, False) else ()) \
        + ((fp8_variant,) if fp8_variant else ())
    hit = _COMPILED.get(key)
    if hit is not None:
        return hit
    from hopper_attn.common import cute_runtime as rt      # (first: it sets the arch)
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream
    from hopper_attn import decode
    kernel = (decode.DecodeAttentionSinks if sinks else decode.DecodeAttention)(
        head_dim, causal, block_n, stages, kv_cache=True, page_size=page_size,
        fp8=kv_dtype == FP8, softcap=softcap, window_left=window[0], window_right=window[1],
        **decode.FP8_VARIANTS[fp8_variant])
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    batch, heads, pages = 2, 2, 4
    q = torch.empty((batch, 2, heads, head_dim), dtype=dtype, device=device)
    cache = torch.empty((pages if page_size else batch, page_size or 128, heads, head_dim),
                        dtype=kv_dtype, device=device)
    problem = Problem(batch, heads, 2, head_dim, bool(causal), dtype, seqlen_k=128)
    workspace = decode.decode_workspace(problem, device, block_n, stages, 2)
    seqlens = torch.zeros((batch,), dtype=torch.int32, device=device)
    table = torch.zeros((batch, 2), dtype=torch.int32, device=device)
    descale = torch.ones((batch, heads), dtype=torch.float32, device=device)
    tensors = [q, cache, cache.clone(), torch.empty_like(q), *workspace, seqlens, table,
               descale, descale.clone()]
    tensors += [torch.zeros((heads,), dtype=torch.float32, device=device)] if sinks else []
    if tvm_ffi:
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        compile_options = f"{compile_options} {rt.TVM_FFI}"
    else:
        stream = rt.current_stream() if torch.cuda.is_available() else make_fake_stream()
    args = [*_args(tensors, tvm_ffi), cutlass.Float32(1.0), stream]
    opts = compile_options.strip()
    compiled = cute.compile(kernel.kv_cache_call, *args, **({"options": opts} if opts else {}))
    _COMPILED[key] = (compiled, kernel)
    return compiled, kernel


def _workspace(problem: Problem, device, block_n: int, stages: int, splits: int) -> list:
    """The decode workspace (partials and counters; the counters stay zero between
    launches) of one problem and split count, made once per device."""
    from hopper_attn import decode
    key = (problem, block_n, stages, splits, device)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = decode.decode_workspace(problem, device, block_n, stages,
                                                        splits)
    return ws


def plan(problem: Problem, num_splits: int = 0, fp8: bool = False,
         fp8_variant: str = "") -> tuple[int, int, int]:
    """(kv tile, stages, splits) for a problem, from its shapes only (`fp8`: the e4m3
    cache's tile and ring depth, decode.FP8_TILES or its variant's, one CTA per SM)."""
    from hopper_attn import decode
    block_n, stages = decode.fp8_tile(problem.head_dim, fp8_variant) if fp8 \
        else decode.tile_for(problem)
    splits = num_splits or decode.num_splits_for(problem, block_n, stages)
    return block_n, stages, splits


_ONES: dict = {}
_FAST: dict = {}


def _prepare(q, k_cache, v_cache, cache_seqlens, page_table, k_new, v_new, k_descale,
             v_descale, causal, num_splits, window_size, softcap, sinks,
             fp8_variant: str = "") -> tuple:
    """Every check of a call (ValueError before any launch), then (compiled kernel, its
    workspace (the LSE first), TVM-FFI or not, head_dim)."""
    from hopper_attn import decode
    from hopper_attn.common import cute_runtime as rt
    if not isinstance(fp8_variant, str) or fp8_variant not in decode.FP8_VARIANTS or \
            (fp8_variant and getattr(k_cache, "dtype", None) != FP8):
        raise ValueError(f"fp8_variant must be one of {sorted(decode.FP8_VARIANTS)} with an "
                         f"e4m3 cache, got {fp8_variant!r}")
    window, cap, with_sinks = check_features(q, causal, window_size, softcap, sinks)
    page_size, capacity = check_inputs(q, k_cache, v_cache, cache_seqlens, page_table, k_new,
                                       v_new, num_splits, None, k_descale, v_descale)
    problem = problem_for(q, k_cache.shape[2], capacity, causal, window)
    decode.SPEC.check(problem, check_memory=False)       # head dim, grid limits
    block_n, stages, splits = plan(problem, num_splits, k_cache.dtype == FP8, fp8_variant)
    tvm_ffi = rt.tvm_ffi_available()
    compiled, _ = compile_kernel(problem.head_dim, problem.causal, q.dtype, page_size,
                                 block_n, stages, tvm_ffi, kv_dtype=k_cache.dtype,
                                 window=window, softcap=cap, sinks=with_sinks,
                                 fp8_variant=fp8_variant)
    workspace = _workspace(problem, q.device, block_n, stages, splits)
    return compiled, workspace, tvm_ffi, problem.head_dim


def _ones(device, batch: int, kv_heads: int) -> torch.Tensor:
    """fp32 ones (batch, kv_heads), made once: the descales of an fp8 call without them,
    and what a 16-bit cache's kernel gets in their place (never read)."""
    key = (device, batch, kv_heads)
    if key not in _ONES:
        _ONES[key] = torch.ones((batch, kv_heads), dtype=torch.float32, device=device)
    return _ONES[key]


def _descale(t, ones) -> torch.Tensor:
    if t is None:
        return ones
    return t if t.dim() == 2 and t.is_contiguous() else t.expand(ones.shape).contiguous()


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           cache_seqlens: torch.Tensor, *,
                           page_table: Optional[torch.Tensor] = None,
                           k_new: Optional[torch.Tensor] = None,
                           v_new: Optional[torch.Tensor] = None, causal: bool = True,
                           softmax_scale: Optional[float] = None, return_lse: bool = False,
                           num_splits: int = 0, k_descale: Optional[torch.Tensor] = None,
                           v_descale: Optional[torch.Tensor] = None, window_size=(-1, -1),
                           softcap: float = 0.0, sinks: Optional[torch.Tensor] = None,
                           fp8_variant: str = ""):
    """Attention of a few new queries per request over its KV cache (a decode step).

    q: (batch, seqlen_q, heads, d), seqlen_q 1-16, bf16 or fp16, d 64, 128 or 256.
    k_cache, v_cache: contiguous (batch, max_seqlen, kv_heads, d), or paged (num_pages,
    page_size, kv_heads, d) with `page_table` int32 (batch, max_pages): request b's key n in
    page page_table[b, n // page_size], row n % page_size; page_size 16, 32, 64, 128 or 256.
    Strided views (e.g. vLLM's (2, num_pages, ...) K/V pair) are read in place: last dim
    contiguous, other strides multiples of 16 bytes.
    cache_seqlens: int32 (batch,), the keys already in each request's cache.
    k_new, v_new: (batch, seqlen_new, kv_heads, d): written into the cache at positions
    cache_seqlens[b] .. + seqlen_new (across pages; nothing else in the cache changes), then
    attended: request b sees cache_seqlens[b] + seqlen_new keys. cache_seqlens itself is not
    updated.
    causal: bottom-right aligned per request: query i sees keys j <= i + keys_b - seqlen_q.
    A request with no key (or a query that sees none) gets zeros, LSE -inf.
    FP8 cache: k_cache, v_cache (and k_new, v_new) float8_e4m3fn with bf16 q; the real
    keys and values are k_cache x k_descale, v_cache x v_descale, fp32 (batch, kv_heads)
    or (kv_heads,) (None: 1). The kernel widens each e4m3 tile to fp16 in shared memory
    (exact) and runs its WGMMAs in fp16 (q converted once: |q| < 65504), folds k_descale
    into the softmax scale and v_descale into the output's 1 / l.
    window_size: (left, right), flash-attn's sliding window (-1: unbounded; with causal the
    right side is 0): query i sees keys i + off - left .. i + off + right, off = keys_b -
    seqlen_q; kv tiles left of every packed row's window are not read, so the work shrinks
    with the window. A key inside a read tile but left of a row's window is masked, and its
    cache rows must hold finite values (0 x NaN in P V): pages a request no longer needs
    may be reused only once a whole kv tile of them lies left of every window.
    softcap: logit softcapping, scores cap * tanh(s * scale / cap) before the mask (0: none).
    sinks: fp32 (heads,), one logit per query head joined to every row's denominator
    (docs/sinks.md). All three are compile-time features: a call without them runs the
    kernel it ran before.
    fp8_variant: an A/B variant of the e4m3 cache's kernel for measurements
    (decode.FP8_VARIANTS; "" the default; docs/kvcache.md).
    Returns out (batch, seqlen_q, heads, d) in q's dtype, and with `return_lse` the fp32
    log-sum-exp (batch, heads, seqlen_q). num_splits: 0 chooses from the shapes (the
    capacity standing for the key count), 1-128 forces a count.

    Cache rows past a request's keys (a fresh cache's NaN, other requests' leftovers) never
    reach an output. No host synchronisation, no allocation that depends on the data: a call
    can be captured in a CUDA graph and replayed with new cache_seqlens and page tables
    (compile and workspace are made by the first call: make it before capturing).
    Forward only. ValueError before any launch for what the host can check (shapes, dtypes,
    devices, strides, page_table dtype and shape, page size, seqlen_q, num_splits,
    window_size, softcap, sinks). Not
    checked (it would need a sync): page indices within the cache, cache_seqlens (+
    seqlen_new) within the capacity (max_seqlen, or max_pages x page_size) and >= 0; values
    outside these read or write outside the cache.
    """
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float))
                                          and math.isfinite(softmax_scale)):
        raise ValueError(f"softmax_scale must be a finite number or None, got "
                         f"{softmax_scale!r}")
    tensors = (q, k_cache, v_cache, cache_seqlens, page_table, k_new, v_new, k_descale,
               v_descale, sinks)
    try:        # calls that passed every check once, by all the checks looked at
        key = (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(),
               k_cache.dtype, k_cache.device, v_cache.shape, v_cache.stride(), v_cache.dtype,
               v_cache.device, cache_seqlens.shape, cache_seqlens.stride(),
               cache_seqlens.dtype, cache_seqlens.device,
               *[None if t is None else (t.shape, t.stride(), t.dtype, t.device)
                 for t in tensors[4:]], bool(causal), num_splits, type(num_splits),
               tuple(window_size), softcap, type(softcap), fp8_variant)
        prepared = _FAST.get(key)
    except (AttributeError, TypeError):     # not tensors: the checks say so
        key = prepared = None
    if prepared is None or (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()) % 16:
        prepared = _prepare(*tensors[:9], causal, num_splits, window_size, softcap, sinks,
                            fp8_variant)
        if key is not None:
            if len(_FAST) >= 4096:
                _FAST.clear()
            _FAST[key] = prepared
    compiled, workspace, tvm_ffi, head_dim = prepared
    seqlens = cache_seqlens
    if k_new is not None:
        append_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table)
        seqlens = cache_seqlens + k_new.shape[1]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    # (an LSE nobody reads goes to the workspace's own: one allocation fewer per call)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32,
                      device=q.device) if return_lse else workspace[0]
    rest = workspace[1:]
    # (a contiguous cache has no table: the key counts stand in, never read as one)
    table = page_table if page_table is not None else seqlens.view(-1, 1)
    ones = _ones(q.device, q.shape[0], k_cache.shape[2])
    tensors = [q, k_cache, v_cache, out, lse, *rest, seqlens, table,
               _descale(k_descale, ones), _descale(v_descale, ones)]
    tensors += [sinks] if sinks is not None else []
    scale = (1.0 / math.sqrt(head_dim) if softmax_scale is None
             else float(softmax_scale)) * LOG2_E
    if tvm_ffi:
        compiled(*tensors, scale)
    else:
        from hopper_attn.common import cute_runtime as rt
        compiled(*_args(tensors, False), scale, rt.current_stream())
    return (out, lse) if return_lse else out


__all__ = ["attention_with_kvcache", "append_kv", "check_inputs", "UnsupportedProblem"]
