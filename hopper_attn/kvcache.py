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

Chunked prefill (more than 16 new queries per request, or a varlen query batch with
`cu_seqlens_q`) runs k6 over a packed query batch instead: a
contiguous cache as the packed keys of hopper_attn/k6_varlen.py (cu_seqlens_k a fixed
stride apart, seqused_k the key counts: no new kernel), a paged one through
hopper_attn/k6_paged.py (kv tiles gathered from pages, common/paged_prefill.py). Equally
free of host reads (`_prefill`).
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
                 v_descale=None, queries: bool = True) -> tuple[int, int]:
    """Every check the host can make (ValueError, before any launch); returns (page_size
    (0: contiguous), capacity: keys a request can hold). `queries=False`: any seqlen_q
    (chunked prefill's checks)."""
    _tensor("q", q, 4)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _tensor(name, t, 4)
    batch, seqlen_q, heads, head_dim = q.shape
    if q.dtype not in DTYPES:
        raise ValueError(f"q must be bf16 or fp16, got {q.dtype}")
    if queries and not 1 <= seqlen_q <= MAX_QUERIES:
        raise ValueError(f"the decode path takes 1-{MAX_QUERIES} new queries per request, "
                         f"got seqlen_q={seqlen_q} (attention_with_kvcache takes longer "
                         f"chunks on its chunked-prefill path)")
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
    Problem's fields (None: unbounded; causal: right None), the cap (0.0: none), sinks
    given). A negative side (a shifted diagonal) is refused: the decode kernel's split
    ranges take sides >= 0."""
    _tensor("q", q, 4)
    window = _cache_window(window_size, causal)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) \
            or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0: none), got {softcap!r}")
    if sinks is not None:
        from hopper_attn.common.sinks import check_sinks
        check_sinks(sinks, q.shape[2], q.device)
    return window, float(softcap), sinks is not None


def _cache_window(window_size, causal) -> tuple:
    """normalize_window's, refusing a negative side (a shifted diagonal; ValueError): the
    kv cache's kernels (decode's split ranges, the paged prefill) take sides >= 0."""
    window = normalize_window(window_size, bool(causal))
    if any(w is not None and w < 0 for w in window):
        raise ValueError(f"window_size {window_size!r}: the kv cache takes window sides "
                         f">= 0 (or unbounded), not a shifted diagonal")
    return window


def problem_for(q, kv_heads: int, capacity: int, causal: bool, window=(None, None)) -> Problem:
    """The decode Problem the tile and the splits are chosen for: the cache's capacity as
    the key count (shapes only); with a window's left side (Problem's fields) at most the
    keys an M tile's rows see, left + seqlen_q + right, and a kv tile (256) either side."""
    batch, seqlen_q, heads, head_dim = q.shape
    left, right = window
    if left is not None:
        capacity = min(capacity, left + seqlen_q + (right or 0) + 2 * 256)
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


# The e4m3 cache's consumer. "auto" (the default): the swapped-operand one
# (decode_fp8swap.py: S^T = K Q'^T and O'^T = V^T P'^T with e4m3 WGMMAs) at d 128 with at
# most 32 packed rows and no window / softcap / sinks, where the H200 measured it 1.5-1.9x
# the bf16 cache (docs/kvcache.md); decode.py's widening loaders elsewhere. "swap" forces the
# former (ValueError where it cannot run), "widen" the latter; "swap:S": S e4m3 stages.
FP8_CONSUMER = "auto"


def _swap_stages(problem: Problem) -> int:
    from hopper_attn import decode_fp8swap
    _, _, stages = FP8_CONSUMER.partition(":")
    return int(stages) if stages else decode_fp8swap.stages_for(problem)


def _swap_rows(problem: Problem, fp8: bool, softcap: float = 0.0, sinks: bool = False) -> int:
    """R of the swapped-operand consumer for this call (0: the widening consumer)."""
    consumer = FP8_CONSUMER.partition(":")[0]
    if not fp8 or consumer == "widen":
        return 0
    from hopper_attn import decode_fp8swap
    packed = problem.heads // problem.kv_heads * problem.seqlen
    fits = (problem.head_dim == 128 and not problem.windowed and not softcap and not sinks
            and packed <= decode_fp8swap.ROW_CHOICES[-1])
    if consumer == "auto" and not fits:
        return 0
    if problem.head_dim != 128 or problem.windowed:
        raise ValueError("FP8_CONSUMER 'swap': d = 128 without a window only")
    if softcap or sinks:
        raise ValueError("FP8_CONSUMER 'swap': no sinks or softcap")
    return decode_fp8swap.rows_for(packed)


def compile_kernel(head_dim: int, causal: bool, dtype, page_size: int, block_n: int,
                   stages: int, tvm_ffi: bool = False, compile_options: str = "",
                   kv_dtype=None, window=(None, None), softcap: float = 0.0, sinks: bool = False,
                   swap_rows: int = 0):
    """The decode stage's `kv_cache_call` for one (head dim, mask, dtype, page size (0:
    contiguous), tile, cache dtype (None: q's; float8_e4m3fn: the fp8 variant), window (as
    Problem's fields), softcap (0: none), sinks), compiled once: (compiled function, kernel
    object). `swap_rows` R > 0: the e4m3 cache's swapped-operand consumer (decode_fp8swap)."""
    kv_dtype = kv_dtype or dtype
    features = (tuple(window), float(softcap), bool(sinks))
    if swap_rows:
        features += (("swap", swap_rows),)
    key = (head_dim, bool(causal), dtype, page_size, block_n, stages, tvm_ffi, compile_options,
           kv_dtype) + (features if features != ((None, None), 0.0, False) else ())
    hit = _COMPILED.get(key)
    if hit is not None:
        return hit
    from hopper_attn.common import cute_runtime as rt      # (first: it sets the arch)
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream
    from hopper_attn import decode
    if swap_rows:
        from hopper_attn import decode_fp8swap
        kernel = decode_fp8swap.DecodeFp8Swap(head_dim, causal, block_n, stages,
                                              page_size=page_size, rows=swap_rows)
    else:
        kernel = (decode.DecodeAttentionSinks if sinks else decode.DecodeAttention)(
            head_dim, causal, block_n, stages, kv_cache=True, page_size=page_size,
            fp8=kv_dtype == FP8, softcap=softcap, window_left=window[0],
            window_right=window[1])
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


# page size at or below which the kv tile with the most CTAs per SM is taken (d 128: 64 x 2;
# page 16 at 0.960-0.993 of a contiguous cache against 0.925-0.985 with tile_for's:
# results/h200/2026-11-29_page16_two_producers.json.xz, "p16-64x2")
SMALL_PAGE = 16


def plan(problem: Problem, num_splits: int = 0, fp8: bool = False, softcap: float = 0.0,
         sinks: bool = False, page_size: int = 0) -> tuple[int, int, int]:
    """(kv tile, stages, splits) for a problem, from its shapes only (`fp8`: the e4m3
    cache's consumer: the swapped one's tile, or decode.FP8_TILES, one CTA per SM). Pages of
    SMALL_PAGE tokens or fewer take the tile with the most CTAs per SM (two producers per SM
    issuing the many small page boxes: SMALL_PAGE's measurement)."""
    from hopper_attn import decode
    if _swap_rows(problem, fp8, softcap, sinks):
        from hopper_attn import decode_fp8swap
        stages = _swap_stages(problem)
        return (decode_fp8swap.BLOCK_N, stages,
                num_splits or decode_fp8swap.num_splits_for(problem, stages))
    if fp8:
        block_n, stages = decode.FP8_TILES[problem.head_dim]
    elif 0 < page_size <= SMALL_PAGE:
        block_n, stages = max(decode.TILES[problem.head_dim],
                              key=lambda t: decode.ctas_per_sm(problem.head_dim, *t))
    else:
        block_n, stages = decode.tile_for(problem)
    splits = num_splits or decode.num_splits_for(problem, block_n, stages)
    return block_n, stages, splits


_ONES: dict = {}
_FAST: dict = {}


def _prepare(q, k_cache, v_cache, cache_seqlens, page_table, k_new, v_new, k_descale,
             v_descale, causal, num_splits, window_size, softcap, sinks) -> tuple:
    """Every check of a call (ValueError before any launch), then (compiled kernel, its
    workspace (the LSE first), TVM-FFI or not, head_dim)."""
    from hopper_attn import decode
    from hopper_attn.common import cute_runtime as rt
    window, cap, with_sinks = check_features(q, causal, window_size, softcap, sinks)
    page_size, capacity = check_inputs(q, k_cache, v_cache, cache_seqlens, page_table, k_new,
                                       v_new, num_splits, None, k_descale, v_descale)
    problem = problem_for(q, k_cache.shape[2], capacity, causal, window)
    decode.SPEC.check(problem, check_memory=False)       # head dim, grid limits
    fp8 = k_cache.dtype == FP8
    block_n, stages, splits = plan(problem, num_splits, fp8, cap, with_sinks, page_size)
    tvm_ffi = rt.tvm_ffi_available()
    compiled, _ = compile_kernel(problem.head_dim, problem.causal, q.dtype, page_size,
                                 block_n, stages, tvm_ffi, kv_dtype=k_cache.dtype,
                                 window=window, softcap=cap, sinks=with_sinks,
                                 swap_rows=_swap_rows(problem, fp8, cap, with_sinks))
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
                           cu_seqlens_q: Optional[torch.Tensor] = None,
                           max_seqlen_q: Optional[int] = None):
    """Attention of new queries per request over its KV cache: a decode step (1-16 queries)
    or a chunk of a prefill (any number; below).

    q: (batch, seqlen_q, heads, d), bf16 or fp16; decode: seqlen_q 1-16, d 64, 128 or 256.
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
    window_size: (left, right), flash-attn's sliding window (-1 or None: unbounded; sides
    >= 0, a negative one is a ValueError here; with causal the right side is 0): query i
    sees keys i + off - left .. i + off + right, off = keys_b - seqlen_q; kv tiles left of
    every packed row's window are not read, so the work shrinks with the window. A key
    inside a read tile but left of a row's window is masked, and its cache rows must hold
    finite values (0 x NaN in P V): pages a request no longer needs may be reused only once
    a whole kv tile of them lies left of every window.
    softcap: logit softcapping, scores cap * tanh(s * scale / cap) before the mask (0: none).
    sinks: fp32 (heads,), one logit per query head joined to every row's denominator
    (docs/sinks.md). All three are compile-time features: a call without them runs the
    kernel it ran before.
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

    Chunked prefill (k6 over a packed query batch, hopper_attn/k6_varlen.py and, for a
    paged cache, k6_paged.py; docs/kvcache.md), taken for seqlen_q > 16 and for
    `cu_seqlens_q`:
    * q (batch, seqlen_q, heads, d): seqlen_q new queries per request, keys as above
      (k_new / v_new appended first);
    * q (total_q, heads, d) with `cu_seqlens_q` (int32 (batch + 1,), request b's queries at
      rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1) and `max_seqlen_q` (a python int >=
      the longest; it picks the tile): vLLM's flash_attn_varlen_func convention, request b
      seeing cache_seqlens[b] keys (the caller has written the new ones; no k_new / v_new).
    Causal bottom-right per request (query i of n_q sees keys j <= i + keys_b - n_q),
    `window_size`, `softcap` and `sinks` as in `attention_varlen` (sinks fp32 (heads,)); d
    64, 96, 128, 192, 256; bf16 / fp16 caches only (an e4m3 cache: ValueError), no
    descales, num_splits 0.
    Paged: the pages page_size tokens apart in memory (the (num_pages, page_size, kv_heads,
    d) layout, or a view of vLLM's (2, num_pages, ...) pair); rows past a request's keys
    reach no output here either (TMA zero-fills them). Returns out like q and, with
    return_lse, the LSE (batch, heads, seqlen_q) (a view) or (heads, total_q). The host
    reads no device data (capturable in a CUDA graph after a first call, which compiles);
    a request with no key gets zeros, LSE -inf. Not checked besides the above (a sync):
    cu_seqlens_q starting at 0, non-decreasing, ending at total_q, chunks <= max_seqlen_q.
    """
    if cu_seqlens_q is not None or (
            isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] > MAX_QUERIES):
        return _prefill(q, k_cache, v_cache, cache_seqlens, page_table, k_new, v_new,
                        causal, softmax_scale, return_lse, num_splits, k_descale, v_descale,
                        cu_seqlens_q, max_seqlen_q, window_size, softcap, sinks)
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
               tuple(window_size), softcap, type(softcap), FP8_CONSUMER)
        prepared = _FAST.get(key)
    except (AttributeError, TypeError):     # not tensors: the checks say so
        key = prepared = None
    if prepared is None or (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()) % 16:
        prepared = _prepare(*tensors[:9], causal, num_splits, window_size, softcap, sinks)
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


# --------------------------------------------------------------------------------------------
# Chunked prefill: k6 over a packed query batch (docs/kvcache.md)
# --------------------------------------------------------------------------------------------

def check_prefill_inputs(q, k_cache, v_cache, cache_seqlens, page_table=None, k_new=None,
                         v_new=None, num_splits: int = 0, k_descale=None, v_descale=None,
                         cu_seqlens_q=None, max_seqlen_q=None) -> tuple[int, int, int, int]:
    """Every host check of a chunked-prefill call (ValueError, before any launch); returns
    (batch, max_seqlen_q, page_size (0: contiguous), capacity)."""
    from hopper_attn.common.varlen import BIG
    _tensor("q", q)
    if cu_seqlens_q is None:
        _tensor("q", q, 4)
        batch, max_seqlen_q = q.shape[0], q.shape[1]
        q4 = q
    else:
        _tensor("q", q, 3)
        _tensor("cu_seqlens_q", cu_seqlens_q, 1)
        if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.shape[0] < 1:
            raise ValueError(f"cu_seqlens_q must be int32 with batch + 1 entries, got "
                             f"{tuple(cu_seqlens_q.shape)} {cu_seqlens_q.dtype}")
        batch = cu_seqlens_q.shape[0] - 1
        if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) \
                or not 0 <= max_seqlen_q < BIG:
            raise ValueError(f"max_seqlen_q must be a python int in [0, {BIG}) with "
                             f"cu_seqlens_q, got {max_seqlen_q!r}")
        if q.shape[0] > batch * max_seqlen_q:
            raise ValueError(f"q's {q.shape[0]} tokens do not fit {batch} requests of at "
                             f"most max_seqlen_q = {max_seqlen_q} queries")
        if k_new is not None or v_new is not None:
            raise ValueError("k_new / v_new with cu_seqlens_q: write the new keys into the "
                             "cache first (append_kv), then pass their counts in "
                             "cache_seqlens")
        q4 = q.unsqueeze(0).expand(batch, *q.shape)   # (the decode checks' shapes; no copy)
    if k_cache.dtype == FP8 or v_cache.dtype == FP8 or k_descale is not None \
            or v_descale is not None:
        raise ValueError("chunked prefill reads bf16 / fp16 caches only: an e4m3 cache (and "
                         "descales) is for 1-16 queries per request (the decode path)")
    if num_splits not in (0, 1) or isinstance(num_splits, bool):
        raise ValueError(f"num_splits is the decode path's (1-16 queries); chunked prefill "
                         f"takes 0, got {num_splits!r}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _tensor(name, t, 4)
        rows = t.shape[1]               # a page, or a request's capacity
        if t.shape[0] > 1 and (t.stride(1) == 0 or t.stride(0) % t.stride(1)):
            raise ValueError(f"{name}: its {'pages' if page_table is not None else 'requests'}"
                             f" must lie a whole number of token rows apart, got strides "
                             f"{t.stride()}")
        stride_rows = t.stride(0) // t.stride(1) if t.shape[0] > 1 else rows
        if page_table is not None and stride_rows != rows:
            raise ValueError(f"{name}: chunked prefill reads pages page_size ({rows}) token "
                             f"rows apart ((num_pages, page_size, kv_heads, d) layout), got "
                             f"strides {t.stride()}")
        if (t.shape[0] - 1) * stride_rows + rows >= BIG:
            raise ValueError(f"{name}: at most {BIG - 1} token rows")
    if k_cache.shape[0] > 1 and k_cache.stride()[:2] != v_cache.stride()[:2]:
        raise ValueError(f"k_cache and v_cache must lie alike (one key offset per request "
                         f"or page), got strides {k_cache.stride()} and {v_cache.stride()}")
    page_size, capacity = check_inputs(q4, k_cache, v_cache, cache_seqlens, page_table,
                                       k_new, v_new, queries=False)
    if q.dim() == 3 and cu_seqlens_q.device != q.device:
        raise ValueError(f"cu_seqlens_q is on {cu_seqlens_q.device}, q on {q.device}")
    return batch, max_seqlen_q, page_size, capacity


_ARANGE: dict = {}


def _arange_times(n: int, step: int, device) -> torch.Tensor:
    """int32 [0, step, 2 step, .., n step] on the device, made once (no per-call launch)."""
    key = (n, step, device)
    if key not in _ARANGE:
        if len(_ARANGE) >= 256:
            _ARANGE.clear()
        _ARANGE[key] = torch.arange(n + 1, dtype=torch.int32, device=device) * step
    return _ARANGE[key]


def _tokens(cache: torch.Tensor, rows: int) -> torch.Tensor:
    """The cache as a packed (tokens, kv_heads, d) tensor (a view): `rows` token rows."""
    return cache.as_strided((rows, *cache.shape[2:]), cache.stride()[1:])


_PREFILL_FAST: dict = {}
# Which length picks k6's POLICY row for a chunk: "queries" (max_seqlen_q, as
# attention_varlen does), "keys" (the longer of it and the cache's capacity: a chunk's
# items walk the whole cache, like the long rows' items) or "measured": the keys' row for
# contiguous caches and pages of 128 and more (1.06-1.08x the queries' row), the queries'
# for smaller pages (page 16: 0.96-0.97x with the keys' row; H200,
# results/h200/2026-11-29_prefill_speed.json.xz). tools/prefill_gpu_check.py times both.
PREFILL_POLICY_BY = "measured"


def _rows_by_keys(page_size: int) -> bool:
    """Whether a chunk takes the POLICY row of the cache's length (PREFILL_POLICY_BY)."""
    if PREFILL_POLICY_BY == "measured":
        return page_size == 0 or page_size >= 128
    return PREFILL_POLICY_BY == "keys"


def _prefill(q, k_cache, v_cache, cache_seqlens, page_table, k_new, v_new, causal,
             softmax_scale, return_lse, num_splits, k_descale, v_descale, cu_seqlens_q,
             max_seqlen_q, window_size, softcap, sinks=None):
    from hopper_attn.api import _check_softcap
    from hopper_attn import k6_paged, k6_varlen
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float))
                                          and math.isfinite(softmax_scale)):
        raise ValueError(f"softmax_scale must be a finite number or None, got "
                         f"{softmax_scale!r}")
    window = _cache_window(window_size, causal)
    softcap = _check_softcap(softcap)
    tensors = (q, k_cache, v_cache, cache_seqlens, page_table, k_new, v_new, cu_seqlens_q,
               sinks)
    try:        # calls that passed every check once, by all the checks looked at
        key = (*[None if t is None else (t.shape, t.stride(), t.dtype, t.device)
                 for t in tensors], bool(causal), window, softcap, max_seqlen_q,
               type(max_seqlen_q), num_splits, type(num_splits), k_descale is None,
               v_descale is None, PREFILL_POLICY_BY)
        prepared = _PREFILL_FAST.get(key)
    except (AttributeError, TypeError):
        key = prepared = None
    if prepared is None:
        batch, max_q, page_size, capacity = check_prefill_inputs(
            q, k_cache, v_cache, cache_seqlens, page_table, k_new, v_new, num_splits,
            k_descale, v_descale, cu_seqlens_q, max_seqlen_q)
        if sinks is not None:
            from hopper_attn.common.sinks import check_sinks
            check_sinks(sinks, q.shape[-2], q.device)
        q3 = q if q.dim() == 3 else q.reshape(-1, *q.shape[2:])
        k_rows = k_cache.shape[0] * k_cache.shape[1] if page_size else \
            (batch - 1) * (k_cache.stride(0) // k_cache.stride(1)) + capacity \
            if batch > 1 else capacity
        row_length = max(max_q, capacity) if _rows_by_keys(page_size) else max_q
        problem = k6_varlen.problem_for(q3, _tokens(k_cache, k_rows), batch, row_length,
                                        capacity, causal, window)
        overrides = {"softcap": softcap} if softcap else {}
        if page_size:
            compiled, _ = k6_paged.compile_paged(problem, page_size, sinks=sinks is not None,
                                                 **overrides)
        else:
            compiled, _ = k6_varlen.compile_varlen(problem, True, sinks=sinks is not None,
                                                   **overrides)
        prepared = (batch, max_q, page_size, k_rows, compiled, problem.softmax_scale)
        if key is not None:
            if len(_PREFILL_FAST) >= 4096:
                _PREFILL_FAST.clear()
            _PREFILL_FAST[key] = prepared
    batch, max_q, page_size, k_rows, compiled, default_scale = prepared
    if (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()) % 16:
        raise ValueError("q, k_cache, v_cache must be 16-byte aligned")
    dense = cu_seqlens_q is None
    q3 = q.reshape(-1, *q.shape[2:]) if dense else q
    seqlens = cache_seqlens
    if k_new is not None:
        append_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table)
        seqlens = cache_seqlens + k_new.shape[1]
    # (the kernels are compiled for 16-byte aligned int tensors: a slice is copied, on the
    # device)
    if seqlens.data_ptr() % 16:
        seqlens = seqlens.clone()
    if dense:
        cu_seqlens_q = _arange_times(batch, max_q, q.device)
    elif cu_seqlens_q.data_ptr() % 16 or not cu_seqlens_q.is_contiguous():
        cu_seqlens_q = cu_seqlens_q.clone()
    out = torch.empty(q3.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q3.shape[1], q3.shape[0]), dtype=torch.float32, device=q.device)
    scale = default_scale if softmax_scale is None else float(softmax_scale)
    k3, v3 = _tokens(k_cache, k_rows), _tokens(v_cache, k_rows)
    if batch and q3.shape[0]:
        if page_size:
            k6_paged.run_paged(compiled, q3, k3, v3, out, lse, cu_seqlens_q, seqlens,
                               page_table, scale, sinks)
        else:
            cu_seqlens_k = _arange_times(batch, k_cache.stride(0) // k_cache.stride(1)
                                         if batch > 1 else 0, q.device)
            k6_varlen.run_varlen(compiled, q3, k3, v3, out, lse, cu_seqlens_q, cu_seqlens_k,
                                 seqlens, scale, sinks)
    if dense:
        out = out.view(q.shape)
        lse = lse.view(q.shape[2], batch, max_q).transpose(0, 1)
    return (out, lse) if return_lse else out


__all__ = ["attention_with_kvcache", "append_kv", "check_inputs", "check_prefill_inputs",
           "UnsupportedProblem"]
