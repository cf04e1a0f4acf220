"""What every backward stage shares: the pre- and post-processing kernels and the host side.

The backward pass of attention (docs/05-backward-math.md) runs as three launches:

1. preprocess (`BackwardPreprocess`), d/8 threads per query row:
       D[i]    = sum_c dO[i, c] * O[i, c]                 (fp32)
       lse2[i] = lse[i] * log2(e)                          the forward's LSE in base 2
   Both are written to (batch, heads, rows) buffers padded to a whole number of query tiles:
   a padded row gets D = 0 and lse2 = +inf, and so does a row that saw no key (lse = -inf).
   exp2(s * scale_log2 - lse2) is then exactly 0 for those rows, so the main kernel needs no
   bounds checks on them: P = 0 makes their dS, dV and dK contributions 0. It also zeroes
   the fp32 dQ buffer, tile by tile (no separate memset), and one int32 counter per query
   tile (kb2's deterministic mode takes its dQ turns on them).
2. the stage's main kernel (kb1, kb2): dK and dV per kv tile, and dQ accumulated in fp32
   into `dq_accum` (batch, heads, padded rows, d), zeroed before the launch.
3. postprocess (`DqConvert`, or `DqConvertFragments` for kb2's buffer order), d/8 threads
   per query row: dQ = dq_accum * scale, converted to
   the input dtype and written in the (batch, seqlen, heads, head_dim) layout.

Host side: `compile_backward` validates the problem and compiles (cached per configuration)
the three kernels; `run_backward` checks the tensors and launches them on the current stream.
k and v may have fewer heads than q (GQA/MQA): kb2's GQA variant (`gqa`) sums each group's
dK/dV inside the CTA of the k/v head (or of a part of the group, where whole groups leave
too few CTAs: `dkv_heads`); kb1 writes one dK/dV per query head. Where there is more than
one per k/v head they go to a scratch buffer whose sum is taken afterwards (in fp32).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional

import torch

from . import cute_runtime as rt    # sets the target architecture before cutlass is imported
from .contract import LOG2_E, KernelSpec, Lengths, Problem, check_tensors

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import tma
from .layouts import ndhb_view, smem_tile_layout, transposed
from .masking import dkv_parts, window_options
from .wgmma import dq_mma, dq_tile_shape

_COMPILED: dict = {}

# kb2's named barriers (0: the CTA-wide sync publishing the mbarrier inits; dQ full and empty:
# one per consumer warpgroup; common/backward_dkv_swap.py's own from 7 on)
DS_WRITTEN_BARRIER, EPILOGUE_BARRIER, DQ_FULL_BARRIER, DQ_EMPTY_BARRIER = 1, 2, 3, 5
DQ_HANDOFF_THREADS = 128 + 32          # a consumer warpgroup and the dQ writer warp


@dataclasses.dataclass
class CompiledBackward:
    """What a backward stage's compile_kernel returns: three compiled kernels for a problem."""

    spec: KernelSpec
    problem: Problem
    options: dict
    kernel: Any              # the main kernel object (tile sizes, SMEM bytes, ...)
    main: Any
    preprocess: Any
    postprocess: Any
    compile_seconds: float   # 0.0 when everything came from the cache
    tvm_ffi: bool = False    # compiled for the TVM-FFI calling path (torch tensors in)
    # dK / dV heads the main kernel writes, by device (worked out on the first run)
    _dkv_heads: dict = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def compiled(self):
        """The main kernel (what compile reports inspect: its __ptx__ and __cubin__)."""
        return self.main

    @property
    def block_m(self) -> int:
        return self.kernel.block_m

    def describe(self) -> dict:
        return {"kernel": self.spec.name, "options": dict(self.options),
                **getattr(self.kernel, "describe", lambda: {})()}


def padded_rows(seqlen: int, block_m: int) -> int:
    return -(-seqlen // block_m) * block_m


def _example(shape, dtype):
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return torch.empty(shape, dtype=dtype, device=device)


def helper_keys(kernel, d: int, dv: int, dtype, ffi: bool) -> tuple:
    """The cache keys of the pre- and post-processing kernels that `kernel`'s backward
    launches: compiled once for every main kernel that shares them (tools count them)."""
    pdl = bool(getattr(kernel, "pdl", False))
    pre_key = ("preprocess", d, dtype, kernel.block_m, ffi, pdl) + ((dv,) if dv != d else ())
    post_key = ("postprocess", d, dtype, kernel.block_m,
                getattr(kernel, "dq_fragment_order", False),
                getattr(kernel, "dq_swap_ab", False), ffi, pdl,
                bool(getattr(kernel, "convert_per_head", False)),
                getattr(kernel, "dq_rows", False))
    return pre_key, post_key


def compile_backward(spec: KernelSpec, kernel_factory: Callable[..., Any], problem: Problem,
                     options: Optional[dict] = None, compile_options: str = ""
                     ) -> CompiledBackward:
    """Validate `problem` for `spec`, then compile (or fetch) the main kernel and the pre- and
    post-processing kernels for its head dim, mask, dtype and options. `compile_options`
    (e.g. --keep-ptx) apply to the main kernel."""
    options = dict(options or {})
    if options.get("varlen"):                  # a packed batch (common/varlen_backward.py)
        from .varlen_backward import compile_varlen_backward
        return compile_varlen_backward(spec, kernel_factory, problem, options, compile_options)
    spec.check(problem)
    d, dv, dt = problem.head_dim, problem.dv, problem.dtype
    if dv != d:
        options["head_dim_v"] = dv              # (a kernel argument only where it differs)
    ffi = rt.tvm_ffi_available()
    key = (spec.name, kernel_factory, d, problem.causal, dt, tuple(sorted(options.items())),
           compile_options, ffi)
    cached = _COMPILED.get(key)
    if cached is not None:
        kernel, main, pre, post = cached
        return CompiledBackward(spec, problem, options, kernel, main, pre, post, 0.0, ffi)
    t0 = time.perf_counter()
    kernel = kernel_factory(d, problem.causal, **options)
    b, n, h, h_kv = 2, 128, 2, 2
    if getattr(kernel, "gqa", False):          # kb2's GQA variant: fewer k/v heads than q's
        h, h_kv = 4, 2
    rows = padded_rows(n, kernel.block_m)
    qkv = [_example((b, n, heads, dim), dt)                              # q, k, v, dO
           for heads, dim in ((h, d), (h_kv, d), (h_kv, dv), (h, dv))]
    stats = [_example((b, h, rows), torch.float32) for _ in range(2)]         # lse2, D
    dq_accum = _example((b, h, rows, d), torch.float32)
    # kb2's fp32 dK / dV parts (`dkv_fp32`, fp32_parts) or the input type
    dkv = [_example((b, n, h_kv, dim), torch.float32 if options.get("dkv_fp32") else dt)
           for dim in (d, dv)]
    # one int32 per (batch, head, query tile), zeroed by the preprocess: the turn counters
    # of kb2's deterministic mode (kb1 and kb2's default mode do not read them)
    counters = _example((b, h, rows // kernel.block_m), torch.int32)
    sems = [counters] if getattr(kernel, "takes_semaphores", False) else []
    main = rt.compile_with_tensors(kernel, *qkv, *stats, dq_accum, *dkv, *sems,
                                   scalars=(1.0, 1.0), options=compile_options, tvm_ffi=ffi)
    pdl = bool(getattr(kernel, "pdl", False))     # programmatic dependent launches (kb2)
    pre_key, post_key = helper_keys(kernel, d, dv, dt, ffi)
    if pre_key not in _COMPILED:
        lse = _example((b, h, n), torch.float32)
        _COMPILED[pre_key] = rt.compile_with_tensors(
            BackwardPreprocess(dv, kernel.block_m, pdl, d), qkv[0 if dv == d else 3], qkv[3],
            lse, *stats, dq_accum, counters, tvm_ffi=ffi)
    # dq_accum in row order (kb1) or in the dQ WGMMA's fragment order (kb2)
    fragments = getattr(kernel, "dq_fragment_order", False)
    swap_ab, rows = getattr(kernel, "dq_swap_ab", False), getattr(kernel, "dq_rows", False)
    per_head = bool(getattr(kernel, "convert_per_head", False))
    if post_key not in _COMPILED:
        # both conversions take (dq_accum, dq, counters, scale, kv tiles); DqConvert ignores
        # the counters and the kv tile count (only the per-head wait reads them)
        convert = DqConvertFragments(d, kernel.block_m, swap_ab, pdl, per_head, rows) \
            if fragments \
            else DqConvert(d, pdl=pdl)
        _COMPILED[post_key] = rt.compile_with_tensors(convert, dq_accum, qkv[0], counters,
                                                      scalars=(1.0, 1.0), tvm_ffi=ffi)
    pre, post = _COMPILED[pre_key], _COMPILED[post_key]
    _COMPILED[key] = (kernel, main, pre, post)
    return CompiledBackward(spec, problem, options, kernel, main, pre, post,
                            time.perf_counter() - t0, ffi)


def check_backward_tensors(problem: Problem, q, k, v, o, do, lse, dq, dk, dv) -> None:
    """ValueError unless every tensor matches the problem. Strided tensors are read and
    written in place (last dim contiguous, other strides multiples of 16 bytes): the main
    kernels move them with TMA through runtime strides, the pre- and post-processing index
    them through their strides."""
    check_tensors(problem, q, k, v, o, strided=True)
    check_tensors(problem, dq, dk, dv, do, strided=True)     # (do: out's shape, dv wide)
    want = (problem.batch, problem.heads, problem.seqlen)
    if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 \
            or tuple(lse.shape) != want or not lse.is_contiguous() or lse.device != q.device:
        raise ValueError(f"lse must be a contiguous fp32 tensor of shape {want} "
                         f"(batch, heads, seqlen_q) on {q.device}, as the forward returns it")


def run_backward(handle: CompiledBackward, q, k, v, o, do, lse, dq, dk, dv,
                 softmax_scale: Optional[float] = None, checked: bool = False) -> torch.Tensor:
    """dq, dk, dv (written in place) of attention(q, k, v) = o with log-sum-exp lse, for the
    incoming gradient do. Launches preprocess, the main kernel and the dQ conversion on the
    current stream. `checked`: the caller has checked tensors of this layout (api's cache).
    Returns the preprocess's D = rowsum(dO * O) (fp32, (batch, heads, rows >= seqlen), 0 past
    seqlen): the sinks' gradient is a sum over it (common/sinks.py)."""
    p = handle.problem
    if not checked:
        check_backward_tensors(p, q, k, v, o, do, lse, dq, dk, dv)
    scale = p.softmax_scale if softmax_scale is None else float(softmax_scale)
    rows = padded_rows(p.seqlen, handle.block_m)
    dev = q.device
    lse2 = torch.empty((p.batch, p.heads, rows), dtype=torch.float32, device=dev)
    dsum = torch.empty_like(lse2)
    dq_accum = torch.empty((p.batch, p.heads, rows, p.head_dim), dtype=torch.float32,
                           device=dev)                   # zeroed by the preprocess
    # dK / dV heads: one per query head (kb1), summed over each group below; kb2's gqa
    # variant sums a group in the kernel, or, where that leaves too few CTAs, each of a few
    # parts of it (its `dkv_heads`), summed below
    dkv_heads = handle._dkv_heads.get(dev)
    if dkv_heads is None:
        dkv_heads = handle._dkv_heads[dev] = (handle.kernel.dkv_heads(p) if getattr(
            handle.kernel, "gqa", False) else p.heads)
    group = dkv_heads // p.kv_heads
    fp32_rows = 0       # kb2's fp32 parts (`dkv_fp32`): their rows, padded to whole kv tiles
    if getattr(handle.kernel, "dkv_fp32", False):
        fp32_rows = padded_rows(p.kv_seqlen, handle.kernel.block_n)
        dk_out, dv_out = (torch.empty((p.batch, fp32_rows, dkv_heads, dim),
                                      dtype=torch.float32, device=dev)
                          for dim in (p.head_dim, p.dv))
    elif group > 1:
        dk_out, dv_out = (torch.empty((p.batch, p.kv_seqlen, dkv_heads, dim), dtype=q.dtype,
                                      device=dev) for dim in (p.head_dim, p.dv))
    else:
        dk_out, dv_out = dk, dv
    counters = torch.empty((p.batch, p.heads, rows // handle.block_m), dtype=torch.int32,
                           device=dev)                   # zeroed by the preprocess
    sems = [counters] if getattr(handle.kernel, "takes_semaphores", False) else []
    kv_tiles = -(-p.kv_seqlen // getattr(handle.kernel, "block_n", 128))
    if handle.tvm_ffi:                  # torch tensors straight in, torch's current stream
        handle.preprocess(o, do, lse, lse2, dsum, dq_accum, counters)
        handle.main(q, k, v, do, lse2, dsum, dq_accum, dk_out, dv_out, *sems, scale * LOG2_E,
                    scale)
        handle.postprocess(dq_accum, dq, counters, scale, float(kv_tiles))
    else:
        stream = rt.current_stream()
        t = rt.to_cute_tensor
        handle.preprocess(t(o), t(do), t(lse), t(lse2), t(dsum), t(dq_accum), t(counters),
                          stream)
        handle.main(t(q), t(k), t(v), t(do), t(lse2), t(dsum), t(dq_accum), t(dk_out),
                    t(dv_out), *[t(x) for x in sems], scale * LOG2_E, scale, stream)
        handle.postprocess(t(dq_accum), t(dq), t(counters), scale, float(kv_tiles), stream)
    if fp32_rows:
        sum_fp32_parts(dk_out, dv_out, dk, dv, p.kv_seqlen, group)
    elif group > 1:
        shape = (p.batch, p.kv_seqlen, p.kv_heads, group)
        # one reduction kernel each, fp32 accumulation, written into dk / dv's own layout
        torch.sum(dk_out.view(*shape, p.head_dim), 3, out=dk)
        torch.sum(dv_out.view(*shape, p.dv), 3, out=dv)
    return dsum


def sum_fp32_parts(dk_parts, dv_parts, dk, dv, seqlen_k: int, group: int) -> None:
    """dk, dv (their own type and layout) = the sum of each k/v head's `group` fp32 parts
    (B, padded rows, k/v heads x group, d), rounded once. The sum goes through an fp32
    tensor: torch's sum into a 16-bit `out` would round the parts to its type first."""
    for parts, out in ((dk_parts, dk), (dv_parts, dv)):
        parts = parts[:, :seqlen_k].unflatten(2, (out.shape[2], group))
        out.copy_(parts.sum(3) if group > 1 else parts[:, :, :, 0])


# --------------------------------------------------------------------------------------------
# The main kernels' tiles (host side, inside their @cute.jit __call__) and epilogue (device).
# --------------------------------------------------------------------------------------------

def swizzle_atom_cols(head_dim: int, block: int):
    """The swizzle atom (in 16-bit elements: 64, 32 or 16 for 128-, 64- and 32-byte) of a
    tile with `head_dim`-element rows that a WGMMA also reads MN-major in `block`-column
    pieces (per warpgroup), where the widest atom dividing the row does not fit those pieces
    (neither divides the other); None where it does (every tile at d = 64, 128, 256).
    d = 96: K^T in 48 columns for dQ -> 16 (the row's 32 does not divide 48); d = 192 with
    `shared_keys`: Q^T, dO^T and K^T in 96 columns -> 32 (the row's 64 does not)."""
    widths = [w for w in (64, 32, 16) if head_dim % w == 0]
    fits = [w for w in widths if block % w == 0 or w % block == 0]
    return None if fits[:1] == widths[:1] else fits[0]


@dataclasses.dataclass(frozen=True)
class BackwardTiles:
    """What a backward main kernel (kb1, kb2) sets up on the host: the swizzled SMEM layouts
    of its tiles and the TMA atoms and tensors that move them.

    q_layout: (block_m, d, stage), the Q and dO rings; kv_layout: (block_n, d), K and V, later
    dK and dV; ds_layout: (block_n, block_m, 2), dS^T (keys x queries, queries contiguous).
    atoms and tensors: (Q, dO, K, V) loads, then (dK, dV) stores, of dkv_cols columns
    (dkv_layout: (block_n, dkv_cols); kb1 at d = 256 stores half of d per CTA; fp32 dK / dV,
    kb2's `dkv_fp32`: no atoms, the (N, d, H, B) tensors, `store_dkv_fp32`). `kv_tiles`,
    `heads`, `batch`: the grid's extents (one CTA per kv tile of a head)."""

    q_layout: object
    kv_layout: object
    ds_layout: object
    atoms: tuple
    tensors: tuple
    seqlen_k: object
    heads: object
    batch: object
    dkv_layout: object = None
    do_layout: object = None     # (block_m, dv, stage) and (block_n, dv) where v's head dim
    v_layout: object = None      # dv is not d (else q_layout and kv_layout)

    @staticmethod
    def create(mQ, mK, mV, mdO, mdK, mdV, block_m: int, block_n: int, head_dim: int,
               stages: int, dkv_cols: int = 0, shared_keys: bool = False,
               packed: bool = False, head_dim_v: int = 0, dkv_swap_ab: bool = False,
               do_stages: int = 0) -> "BackwardTiles":
        """`shared_keys` (kb2): dK and dV split by columns between two warpgroups, so Q^T and
        dO^T are read MN-major in d / 2 columns (dQ always reads K^T in d / 2). `packed`:
        (1, total, H, d) tensors of a packed batch, moved through common/varlen's ragged TMA
        views (seqlen_k: k's token count). `head_dim_v`: V, dO and dV dv wide (0: d).
        `dkv_swap_ab` (kb2, common/backward_dkv_swap.py): one P / dS buffer, queries x keys,
        read MN-major in block_n / 2 keys; `do_stages`: dO's ring depth (0: `stages`)."""
        q, k, v, do, dk, dv = [ndhb_view(t) for t in (mQ, mK, mV, mdO, mdK, mdV)]
        extents = (k.shape[0], q.shape[2], q.shape[3])
        if packed:
            from .varlen import ragged
            q, k, v, do, dk, dv = [ragged(t) for t in (q, k, v, do, dk, dv)]
        bm, bn, d, dtype = block_m, block_n, head_dim, mQ.element_type
        cols, vd = dkv_cols or d, head_dim_v or d        # vd: V's, dO's and dV's head dim
        q_layout = smem_tile_layout(dtype, bm, d, stages, swizzle_atom_cols(
            d, d // 2 if shared_keys else d))
        kv_layout = smem_tile_layout(dtype, bn, d, atom_cols=swizzle_atom_cols(d, d // 2))
        dkv_layout = kv_layout if cols == d else smem_tile_layout(dtype, bn, cols)
        ds_layout = smem_tile_layout(dtype, bm, bn, 1, swizzle_atom_cols(bn, bn // 2)
                                     if bn // 2 % 16 == 0 else 8) \
            if dkv_swap_ab else smem_tile_layout(dtype, bn, bm, 2)   # (24 keys: no swizzle)
        do_layout, v_layout, dv_layout, dv_cols = q_layout, kv_layout, dkv_layout, cols
        if do_stages and do_stages != stages:
            do_layout = smem_tile_layout(dtype, bm, vd, do_stages)
        if vd != d:                                 # V, dO and dV dv wide
            do_layout = smem_tile_layout(dtype, bm, vd, do_stages or stages)
            v_layout = dv_layout = smem_tile_layout(dtype, bn, vd)
            dv_cols = vd
        copies = [tma.make_tma_load(q, q_layout, bm, d), tma.make_tma_load(do, do_layout, bm, vd),
                  tma.make_tma_load(k, kv_layout, bn, d), tma.make_tma_load(v, v_layout, bn, vd)]
        if mdK.element_type == Float32:
            copies += [(None, dk), (None, dv)]      # fp32 parts: stored by the threads
        else:
            copies += [tma.make_tma_store(dk, dkv_layout, bn, cols),
                       tma.make_tma_store(dv, dv_layout, bn, dv_cols)]
        return BackwardTiles(q_layout, kv_layout, ds_layout, tuple(c[0] for c in copies),
                             tuple(c[1] for c in copies), *extents, dkv_layout, do_layout,
                             v_layout)


def backward_smem(storage, q_layout, kv_layout, ds_layout, head_dim_v: int = 0,
                  do_stages: int = 0):
    """The swizzled SMEM tensors of a backward CTA's SharedStorage (fields sK, sV, sQ, sdO,
    sdS): K and V (block_n, d); Q and dO (block_m, d, stage); dS^T (block_n, block_m, 2);
    with `head_dim_v` (not d) V and dO dv wide; `do_stages`: dO's ring depth (0: Q's)."""
    sK, sV = (buf.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
              for buf in (storage.sK, storage.sV))
    sQ, sdO = (buf.get_tensor(q_layout.outer, swizzle=q_layout.inner)
               for buf in (storage.sQ, storage.sdO))
    sdSt = storage.sdS.get_tensor(ds_layout.outer, swizzle=ds_layout.inner)
    # (a row of d = 192 is ((64, 3)) in a 128-byte-swizzled layout: compare sizes)
    dtype, (bm, _, stages) = sQ.element_type, sQ.shape
    own_do_ring = bool(do_stages) and do_stages != cute.size(sQ, mode=[2])
    if cutlass.const_expr(head_dim_v and head_dim_v != cute.size(sK, mode=[1])):
        v_layout = smem_tile_layout(dtype, sK.shape[0], head_dim_v)
        do_layout = smem_tile_layout(dtype, bm, head_dim_v, do_stages if own_do_ring else stages)
        sV = storage.sV.get_tensor(v_layout.outer, swizzle=v_layout.inner)
        sdO = storage.sdO.get_tensor(do_layout.outer, swizzle=do_layout.inner)
    elif cutlass.const_expr(own_do_ring):
        do_layout = smem_tile_layout(dtype, bm, cute.size(sK, mode=[1]), do_stages)
        sdO = storage.sdO.get_tensor(do_layout.outer, swizzle=do_layout.inner)
    return sK, sV, sQ, sdO, sdSt


def stage_dkv(thr_dkv, acc_dk: cute.Tensor, acc_dv: cute.Tensor, sK: cute.Tensor,
              sV: cute.Tensor, dtype, thr_dv=None, swapped: bool = False):
    """dK and dV (already scaled) -> dtype -> K's and V's SMEM buffers, fenced for the TMA
    unit (`thr_dv`: dV's partition where it is narrower than dK's; `swapped`: accumulators
    of dK^T and dV^T). The caller has made sure no WGMMA still reads K or V."""
    for acc, smem, thr in ((acc_dk, sK, thr_dkv), (acc_dv, sV, thr_dv or thr_dkv)):
        out = cute.make_rmem_tensor_like(acc, dtype)
        out.store(acc.load().to(dtype))
        cute.autovec_copy(out, thr.partition_C(transposed(smem) if swapped else smem))
    cute.arch.fence_proxy("async.shared", space="cta")       # visible to the TMA unit


@cute.jit
def write_dkv(fp32: cutlass.Constexpr, epilogue, warp, thr_dk, thr_dv, acc_dk: cute.Tensor,
              acc_dv: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, dtype, tma_dk, tma_dv,
              mdK: cute.Tensor, mdV: cute.Tensor, head, batch, n_block,
              swapped: cutlass.Constexpr = False):
    """kb2's epilogue, dK (already scaled) and dV out: in dtype through K's and V's SMEM and
    TMA stores (one warp, the first consumer's), or (`fp32`, kb2's dkv_fp32) straight from
    the registers (`store_dkv_fp32`). `epilogue`: the consumers' named barrier."""
    if cutlass.const_expr(fp32):
        store_dkv_fp32(thr_dk, acc_dk, acc_dv, mdK, mdV, head, batch, sK, sV, n_block, thr_dv,
                       swapped)
    else:
        epilogue.arrive_and_wait()                          # every WGMMA has read K and V
        stage_dkv(thr_dk, acc_dk, acc_dv, sK, sV, dtype, thr_dv, swapped)
        epilogue.arrive_and_wait()
        if warp == 4:                                       # the first consumer warp
            store_dkv(tma_dk, tma_dv, mdK, mdV, head, batch, sK, sV, n_block)


def store_dkv(tma_dk, tma_dv, mdK: cute.Tensor, mdV: cute.Tensor, head, batch,
              sK: cute.Tensor, sV: cute.Tensor, n_block, col_tile=0):
    """One warp: the staged dK and dV tiles to global memory (rows past the end clipped);
    `col_tile`: which tile of columns, when a tile holds only part of d."""
    tma.TmaTiles.partition(tma_dk, mdK, head, batch, sK, col_tile).store(n_block)
    tma.TmaTiles.partition(tma_dv, mdV, head, batch, sV, col_tile).store(n_block)


def store_dkv_fp32(thr_dk, acc_dk: cute.Tensor, acc_dv: cute.Tensor, mdK: cute.Tensor,
                   mdV: cute.Tensor, head, batch, sK: cute.Tensor, sV: cute.Tensor, n_block,
                   thr_dv=None, swapped: bool = False):
    """kb2's `dkv_fp32` (a k/v head's group split in parts): each thread stores its dK and
    dV accumulators (already scaled) as they are, in fp32, to (N, d, H, B) tensors whose rows
    are padded to whole kv tiles (no clipping), so the parts' sum is rounded once. No SMEM:
    a quad of lanes holds 8 consecutive floats of a row (`swapped`, dK^T / dV^T: of a
    column), so every 32-byte sector a warp writes is whole. sK / sV give the tile shapes.
    The addresses come from opaque indices and row stride: hoisted above the main loop (they
    are loop-invariant) they would spill (d = 64: 32 bytes). The stride stays a multiple of 4
    floats (a row: dK heads x d, d a multiple of 32), which keeps the 8-byte stores."""
    from .compiler_hints import opaque
    head, batch, n_block = opaque(head), opaque(batch), opaque(n_block)
    for acc, tensor, smem, thr in ((acc_dk, mdK, sK, thr_dk), (acc_dv, mdV, sV, thr_dv or thr_dk)):
        rows = tensor[None, None, head, batch]
        row_stride = cute.assume(opaque(rows.layout.stride[0]), divby=4)
        rows = cute.make_tensor(rows.iterator, cute.make_layout(rows.shape,
                                                                stride=(row_stride, 1)))
        tile = cute.local_tile(rows, (cute.size(smem, mode=[0]), cute.size(smem, mode=[1])),
                               (n_block, 0))
        cute.autovec_copy(acc, thr.partition_C(transposed(tile) if swapped else tile))


CHUNK = 8            # elements per thread and access: 16 bytes of bf16, two 16-byte fp32 halves
HELPER_THREADS = 128


def _tile_rows(head_dim: int, threads: int):
    """How `threads` threads cover rows of `head_dim` elements in 8-element (16-byte) chunks:
    (lanes per row, rows per pass). A row's lanes are consecutive, so one warp instruction
    reads whole rows: coalesced. Their number is a power of two (the preprocess sums a row
    by shuffles within its lanes): at d = 96 and 192 (12 and 24 chunks) 16 and 32 lanes,
    the last 4 or 8 padding (`_padding_lane`)."""
    lanes = 1 << (head_dim // CHUNK - 1).bit_length()
    return lanes, threads // lanes


def _row_lanes(tidx, lanes: int, head_dim: int):
    """Thread `tidx`'s (row within a pass, first column, whether that column is the row's) for
    rows covered by `lanes` lanes of CHUNK elements (`_tile_rows`). At d = 96 and 192 the
    lanes are padded to a power of two and a padding lane reads the row's last chunk
    (`_padding_lane`: every address inside the row); the third value, None where no lane
    pads, says which lanes must count nothing."""
    lane_row, col0 = tidx // lanes, (tidx % lanes) * CHUNK
    if lanes * CHUNK == head_dim:
        return lane_row, col0, None
    own_column, col0 = _padding_lane(col0, head_dim)
    return lane_row, col0, own_column


def _padding_lane(col0, head_dim: int):
    """(whether lane column `col0` is one of the row's, the column it reads): a padding
    lane reads (and the conversions store again, with the same values) the row's last
    chunk, so that every address stays inside the row."""
    return col0 < head_dim, cutlass.min(col0, head_dim - CHUNK)


def _aligned(ptr: cute.Pointer, size: int) -> cute.Tensor:
    """`size` contiguous elements at `ptr`, declared 16-byte aligned (true of every address
    these kernels form: tensor bases are, and offsets are multiples of 16 bytes) so that the
    copies become 16-byte vector accesses."""
    return cute.make_tensor(cute.make_ptr(ptr.dtype, ptr.toint(), ptr.memspace, assumed_align=16),
                            cute.make_layout((size,)))


def _chunk(t: cute.Tensor, row, col0, head, batch) -> cute.Tensor:
    """Elements [col0, col0 + 8) of row `row` of an (N, d, H, B) tensor, statically shaped."""
    return _aligned(t[row, None, head, batch].iterator + col0, CHUNK)


class BackwardPreprocess:
    """Per query tile (see the module docstring): D = rowsum(dO * O) and
    lse2 = lse * log2(e), padded; the tile's block of the fp32 dQ buffer and its counter set
    to 0 (so no separate memset). d/8 consecutive lanes share a row: 16-byte loads, then a
    shuffle sum. Each thread issues all its loads (8 rows of O and dO, 8 LSE values) before
    any store: 69.6 instead of 74.0 us at B8 H16 N2048 d128 on an H200, FA4's 68.9
    (results/h200/2026-11-26_kernel_split_preprocess_2k.json)."""

    def __init__(self, head_dim: int, rows_per_cta: int, pdl: bool = False,
                 dq_head_dim: int = 0):
        self.dq_head_dim = dq_head_dim or head_dim     # dQ's, where O's (dv) is not q's
        self.head_dim, self.rows, self.pdl = head_dim, rows_per_cta, pdl
        self.lanes, self.rows_per_pass = _tile_rows(head_dim, HELPER_THREADS)

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor,
                 mCounters: cute.Tensor, stream):
        o, do = ndhb_view(mO), ndhb_view(mdO)                  # (N, d, H, B)
        self.kernel(o, do, mLSE, mLSE2, mD, mdQacc, mCounters).launch(
            grid=[mLSE2.shape[2] // self.rows, o.shape[2], o.shape[3]],
            block=[HELPER_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, o: cute.Tensor, do: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
               mD: cute.Tensor, mdQacc: cute.Tensor, mCounters: cute.Tensor):
        if cutlass.const_expr(self.pdl):
            # the main kernel may launch now: it reads what this kernel writes only after
            # its `griddepcontrol.wait`, which waits for this whole grid
            cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        lane_row, col0, own_column = _row_lanes(tidx, self.lanes, self.head_dim)
        passes = self.rows // self.rows_per_pass
        seqlen = o.shape[0]
        # Every load first, then the stores: a store to mD may alias o or dO as far as the
        # compiler knows, so loads placed after one wait for it (one memory latency per
        # pass). Rows past the end read the last row (any valid row) and count as 0 below.
        o_rows = cute.make_rmem_tensor((CHUNK, passes), o.element_type)
        do_rows = cute.make_rmem_tensor((CHUNK, passes), o.element_type)
        lse_rows = cute.make_rmem_tensor((passes,), Float32)
        for p in cutlass.range_constexpr(passes):
            row = cutlass.min(m_block * self.rows + p * self.rows_per_pass + lane_row,
                              seqlen - 1)
            cute.autovec_copy(_chunk(o, row, col0, head, batch), o_rows[None, p])
            cute.autovec_copy(_chunk(do, row, col0, head, batch), do_rows[None, p])
            lse_rows[p] = mLSE[batch, head, row]
        # zero this tile's rows x d floats of the dQ buffer (contiguous in either order)
        block = self.rows * self.dq_head_dim
        base = mdQacc[batch, head, None, None].iterator + m_block * block
        zeros = cute.make_rmem_tensor((4,), Float32)
        zeros.fill(0.0)
        for i in cutlass.range_constexpr(block // (4 * HELPER_THREADS)):
            cute.autovec_copy(zeros, _aligned(base + (i * HELPER_THREADS + tidx) * 4, 4))
        if tidx == 0:
            mCounters[batch, head, m_block] = Int32(0)
        for p in cutlass.range_constexpr(passes):
            row = m_block * self.rows + p * self.rows_per_pass + lane_row
            prod = o_rows[None, p].load().to(Float32) * do_rows[None, p].load().to(Float32)
            partial = prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            if cutlass.const_expr(own_column is not None):
                if not own_column:                  # a padding lane counts nothing
                    partial = Float32(0.0)
            dsum = cute.arch.warp_reduction_sum(partial, threads_in_group=self.lanes)
            if tidx % self.lanes == 0:
                lse2 = Float32.inf
                if row < seqlen:
                    if lse_rows[p] != -Float32.inf:
                        lse2 = lse_rows[p] * LOG2_E
                else:
                    dsum = Float32(0.0)
                mD[batch, head, row] = dsum
                mLSE2[batch, head, row] = lse2


class DqConvert:
    """dQ = dq_accum * scale in the input dtype, (batch, seqlen, heads, d) layout; d/8 lanes
    per row, 16-byte stores."""

    def __init__(self, head_dim: int, rows_per_cta: int = 64, pdl: bool = False):
        self.head_dim, self.rows, self.pdl = head_dim, rows_per_cta, pdl
        self.lanes, self.rows_per_pass = _tile_rows(head_dim, HELPER_THREADS)

    @cute.jit
    def __call__(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, mCounters: cute.Tensor,
                 scale: Float32, kv_tiles: Float32, stream):
        """(mCounters and kv_tiles: DqConvertFragments' signature; not read here.)"""
        dq = ndhb_view(mdQ)                                    # (N, d, H, B)
        self.kernel(mdQacc, dq, scale).launch(
            grid=[cute.ceil_div(dq.shape[0], self.rows), dq.shape[2], dq.shape[3]],
            block=[HELPER_THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mdQacc: cute.Tensor, dq: cute.Tensor, scale: Float32):
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()          # launched early: wait for the main kernel
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        lane_row, col0, _ = _row_lanes(tidx, self.lanes, self.head_dim)
        base = mdQacc[batch, head, None, None].iterator
        for p in cutlass.range_constexpr(self.rows // self.rows_per_pass):
            row = m_block * self.rows + p * self.rows_per_pass + lane_row
            if row < dq.shape[0]:
                acc = cute.make_rmem_tensor((CHUNK,), Float32)
                cute.autovec_copy(_aligned(base + (row * self.head_dim + col0), CHUNK), acc)
                out = cute.make_rmem_tensor((CHUNK,), dq.element_type)
                out.store((acc.load() * scale).to(dq.element_type))
                cute.autovec_copy(out, _chunk(dq, row, col0, head, batch))


class DqConvertFragments:
    """`DqConvert` for a dq_accum written in fragment order (kb2): each query tile is one
    contiguous block of block_m x d floats, warpgroup 1's half after warpgroup 0's, in
    the order the dQ WGMMA's accumulator registers are laid out, 4 floats per thread at a
    time (what lets kb2 move it with one bulk copy). A CTA of 256 threads re-creates that
    WGMMA's partition (`swap_ab`: the one computing dQ^T) to know which (row, column) each
    float is, converts, and writes the tile through SMEM (rows padded by 8 elements) so
    that the global stores are 16-byte row chunks."""

    def __init__(self, head_dim: int, block_m: int, swap_ab: bool = False, pdl: bool = False,
                 per_head: bool = False, rows: bool = False):
        self.head_dim, self.block_m, self.swap_ab, self.pdl = head_dim, block_m, swap_ab, pdl
        self.rows = rows                    # dQ split by query rows (kb2's dq_rows, dq_mma)
        # per_head (kb2's convert_per_head): launched early (PDL) but, instead of waiting
        # for the whole main grid, each CTA waits until every kv tile of its head has
        # counted its dQ adds as landed (counters[b, h, 0] == kv_tiles, release/acquire),
        # so conversions of finished heads run in the main kernel's tail
        self.per_head = per_head
        self.lanes, self.rows_per_pass = _tile_rows(head_dim, 256)

    @cute.jit
    def __call__(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, mCounters: cute.Tensor,
                 scale: Float32, kv_tiles: Float32, stream):
        dq = ndhb_view(mdQ)                                    # (N, d, H, B)
        self.dtype = mdQ.element_type
        self.kernel(mdQacc, dq, mCounters, scale, kv_tiles).launch(
            grid=[cute.ceil_div(dq.shape[0], self.block_m), dq.shape[2], dq.shape[3]],
            block=[256, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, acc_all: cute.Tensor, dq: cute.Tensor, mCounters: cute.Tensor,
               scale: Float32, kv_tiles: Float32):
        bm, d = self.block_m, self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.per_head):
            if tidx == 0:
                wait_for_count(mCounters[batch, head, None].iterator, Int32(kv_tiles))
            cute.arch.sync_threads()
        elif cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()          # launched early: wait for the main kernel
        thr = dq_mma(d, self.dtype, self.swap_ab, bm, self.rows).get_slice(tidx)
        acc = cute.make_rmem_tensor(thr.partition_shape_C(dq_tile_shape(bm, d, self.swap_ab)),
                                    Float32)
        src = fragment_slot(acc_all[batch, head, None, None].iterator, m_block, tidx, bm, d,
                            cute.size(acc))
        cute.autovec_copy(src, cute.make_tensor(acc.iterator, src.layout.shape))
        converted = cute.make_rmem_tensor_like(acc, self.dtype)
        converted.store((acc.load() * scale).to(self.dtype))
        smem = cutlass.memory.SmemAllocator()
        tile = smem.allocate_tensor(self.dtype, cute.make_layout((bm, d), stride=(d + CHUNK, 1)),
                                    byte_alignment=16)
        cute.autovec_copy(converted, thr.partition_C(transposed(tile) if self.swap_ab else tile))
        cute.arch.sync_threads()
        lane_row, col0, _ = _row_lanes(tidx, self.lanes, d)
        for p in cutlass.range_constexpr(bm // self.rows_per_pass):
            r = p * self.rows_per_pass + lane_row
            row = m_block * bm + r
            if row < dq.shape[0]:
                out = cute.make_rmem_tensor((CHUNK,), self.dtype)
                cute.autovec_copy(_aligned(tile[r, None].iterator + col0, CHUNK), out)
                cute.autovec_copy(out, _chunk(dq, row, col0, head, batch))
        if cutlass.const_expr(self.per_head):
            # do not complete before the main kernel (its dK / dV stores may still run): a
            # later launch on the stream then waits for both
            cute.arch.griddepcontrol_wait()


@cute.jit
def wait_for_count(counter: cute.Pointer, target):
    """The calling thread spins (acquire loads, as atomic adds of 0) until the int32 counter
    at `counter` reaches `target`; what the threads that counted wrote before their release
    is then visible to it. Used on the per-tile counters the preprocess zeroes: kb2's
    deterministic dQ turns and the per-head dQ conversion."""
    seen = cute.arch.atomic_add(counter, Int32(0), sem="acquire", scope="gpu")
    while seen < target:
        seen = cute.arch.atomic_add(counter, Int32(0), sem="acquire", scope="gpu")


def fragment_slot(base: cute.Pointer, m_block, tidx, block_m: int, head_dim: int, regs: int):
    """Where thread `tidx` (0..255, warpgroup tidx // 128) of the dQ WGMMA keeps its `regs`
    accumulator floats inside query tile `m_block`'s block of a fragment-ordered buffer
    starting at `base`: (4, regs / 4) floats, 4 contiguous, groups 4 x 128 apart (so that
    a warpgroup's 128 threads write 512 contiguous floats per step)."""
    wg, t = tidx // 128, tidx % 128
    ptr = base + (m_block * (block_m * head_dim) + wg * (block_m * head_dim // 2) + t * 4)
    return cute.make_tensor(cute.make_ptr(ptr.dtype, ptr.toint(), ptr.memspace,
                                          assumed_align=16),
                            cute.make_layout((4, regs // 4), stride=(1, 4 * 128)))


@cute.jit
def converted(acc: cute.Tensor, dtype) -> cute.Tensor:
    """A copy of an accumulator in `dtype`, same layout (kb2's shared_keys: P^T and dS^T
    for stmatrix only, no register operand)."""
    out = cute.make_rmem_tensor_like(acc, dtype)
    out.store(acc.load().to(dtype))
    return out


@dataclasses.dataclass(frozen=True)
class PolicyRow:
    """Settings for problems of `head_dim` (None: any) and `causal` (None: either) in `mode`
    ("": every problem, "deterministic", "gqa": fewer k/v heads than query heads, "gqa
    deterministic": both) whose query length is in `lengths` (default: any), with a sliding
    window or not (`windowed`; None: either)."""

    head_dim: Optional[int]
    causal: Optional[bool]
    mode: str
    settings: dict
    reason: str
    results: tuple          # paths from the repository root
    lengths: Lengths = Lengths()
    windowed: Optional[bool] = None     # None: with a sliding window or without

    def matches(self, head_dim: int, causal: bool, mode: str, seqlen: int,
                windowed: bool = False) -> bool:
        return (self.mode == mode and self.head_dim in (None, head_dim)
                and self.causal in (None, causal) and seqlen in self.lengths
                and self.windowed in (None, windowed))


def policy_settings(rows, defaults: dict, problem, deterministic: bool = False,
                    tuned: bool = True) -> dict:
    """`defaults` updated by the `PolicyRow`s of `rows` that match `problem`, in mode order
    ("" and "window" when `tuned`, then "deterministic", "gqa", "gqa deterministic"), and
    the rows they came from ("rows")."""
    settings, used = dict(defaults), []
    # a sliding window takes the causal rows (masked tiles)
    masked = problem.causal or getattr(problem, "windowed", False)
    modes = [""] if tuned else []
    modes += ["window"] if tuned and getattr(problem, "windowed", False) else []
    modes += ["deterministic"] if deterministic else []
    modes += ["gqa"] if problem.kv_heads != problem.heads else []
    modes += ["gqa deterministic"] if deterministic and "gqa" in modes else []
    for mode in modes:
        for row in rows:
            if row.matches(problem.head_dim, masked, mode, problem.seqlen,
                           bool(getattr(problem, "windowed", False))):
                settings.update(row.settings)
                used.append(row)
    settings["rows"] = used
    return settings


class GroupWalk:
    """kb2's GQA walk (`gqa`): a CTA visits every query head of its k/v head's group (or of
    its part of it, masking.dkv_parts), head after head, and stores dK and dV once."""

    @cute.jit
    def work_item(self, it, m_first, m_count):
        """The `it`-th (query head of the group, query tile) pair a CTA visits: each head's
        query tiles in order, the group's heads one after the other."""
        head_in_group = it // m_count
        return head_in_group, m_first + (it - head_in_group * m_count)

    def visits(self, m_count, group):
        """How many query tiles a CTA walks (gqa: times the group's query heads)."""
        return m_count * group if self.gqa else m_count

    def dkv_heads(self, problem) -> int:
        """gqa: the dK / dV heads run_backward launches over (`dkv_parts` per k/v head)."""
        from .scheduler import sm_count
        return problem.kv_heads * dkv_parts(self.schedule, problem.heads, problem.kv_heads,
                                            problem.batch, problem.seqlen, problem.kv_seqlen,
                                            sm_count())


class DqWriter:
    """kb2's dQ writer warp (mixed into its kernel class: block_m, head_dim, warpgroups,
    gqa, deterministic, trace and the GQA walk)."""

    @cute.jit
    def write_dq(self, sdQ: cute.Pointer, mdQacc: cute.Tensor, mSem: cute.Tensor, n_block,
                 head, batch, m_first, m_count, group, seqlens=None):
        """The dQ writer warp: each consumer warpgroup's dQ block of every query tile visited,
        reduce-added from SMEM to the fp32 dQ buffer. `seqlens` (seqlen_q, seqlen_k): the
        deterministic mode's turns with a window's left side, which count from the first kv
        tile that walks the query tile (`KVTileSchedule.dq_turn_first`), not from 0."""
        bm, d = self.block_m, self.head_dim
        dq_block = bm * d // self.warpgroups                # floats per warpgroup and tile
        if cutlass.const_expr(not self.gqa):
            dq_accum = mdQacc[batch, head, None, None].iterator
        for it in cutlass.range(self.visits(m_count, group), unroll=1):
            if cutlass.const_expr(self.gqa):
                head_in_group, m_block = self.work_item(it, m_first, m_count)
                q_head = head + head_in_group
                dq_head = mdQacc[batch, q_head, None, None].iterator
            else:
                m_block = m_first + it
            # hand each staging buffer back once the copy engine has read it (the
            # previous tile's copies were committed in warpgroup order)
            for wg in cutlass.range_constexpr(self.warpgroups):
                cute.arch.cp_async_bulk_wait_group(self.warpgroups - 1 - wg, read=True)
                cute.arch.barrier_arrive(barrier_id=DQ_EMPTY_BARRIER + wg,
                                         number_of_threads=DQ_HANDOFF_THREADS)
            if cutlass.const_expr(self.deterministic):
                if cutlass.const_expr(self.gqa):       # (varlen: mSem is no counter)
                    turn = mSem[batch, q_head, None].iterator + m_block
                else:
                    turn = mSem[batch, head, None].iterator + m_block
                if cute.arch.lane_idx() == 0:      # kv tiles first .. n_block - 1 added
                    if cutlass.const_expr(self.schedule.window_left is not None):
                        wait_for_count(turn, n_block - self.schedule.dq_turn_first(
                            m_block, *seqlens))
                    else:
                        wait_for_count(turn, n_block)
                cute.arch.sync_warp()
            for wg in cutlass.range_constexpr(self.warpgroups):
                phase = self.trace.start("wait_dq_full")
                cute.arch.barrier(barrier_id=DQ_FULL_BARRIER + wg,
                                  number_of_threads=DQ_HANDOFF_THREADS)
                self.trace.end(phase)
                with cute.arch.elect_one():
                    if cutlass.const_expr(self.gqa):
                        tma.bulk_reduce_add_f32(
                            sdQ + wg * dq_block,
                            dq_head + (m_block * (bm * d) + wg * dq_block), dq_block * 4)
                    else:
                        tma.bulk_reduce_add_f32(
                            sdQ + wg * dq_block,
                            dq_accum + (m_block * (bm * d) + wg * dq_block), dq_block * 4)
                cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(self.deterministic):
                cute.arch.cp_async_bulk_wait_group(0, read=False)   # adds performed
                with cute.arch.elect_one():
                    cute.arch.atomic_add(turn, Int32(1), sem="release", scope="gpu")


def with_fp32_parts(kernel_factory, problem, arguments: dict, asked=None) -> dict:
    """kb2's `arguments`, plus `dkv_fp32` where its GQA walk splits a k/v head's group in
    parts (GroupWalk.dkv_heads): their dK / dV are then stored fp32 and rounded once, after
    run_backward's sum (bf16 parts would round twice; FA4 sums a group in fp32). `asked`: a
    caller's choice (None: where the group splits); other problems compile as before. Not
    at d = 64 with a window (its row is at the register limit: the fp32 epilogue spills)."""
    if asked is None:
        asked = False
        if arguments.get("gqa") and not arguments.get("varlen") and not (
                problem.head_dim == 64 and getattr(problem, "windowed", False)):
            dv = {"head_dim_v": problem.dv} if problem.dv != problem.head_dim else {}
            kernel = kernel_factory(problem.head_dim, problem.causal, **arguments, **dv)
            asked = kernel.dkv_heads(problem) > problem.kv_heads
    return {**arguments, "dkv_fp32": True} if asked else arguments


def kernel_arguments(settings: dict, given: dict, problem, block_n, deterministic: bool,
                     trace: bool, softcap: float, varlen: bool) -> dict:
    """kb2's constructor arguments: `policy_settings`' (`settings`), then the options a
    caller `given` (None: the policy's); the per-head dQ conversion needs the early launch
    (pdl) unless a caller asked for it; the window's and the features' arguments only where
    set (so that the kernels without them compile as before)."""
    settings = {k: v for k, v in settings.items() if k != "rows"}
    settings.update({name: value for name, value in given.items() if value is not None})
    if not settings["pdl"] and given.get("convert_per_head") is None:
        settings["convert_per_head"] = False
    counts = ("block_m", "split_dv", "group_mib", "group_heads")
    from .backward_dkv_swap import dkv_swap_keys
    early = settings.pop("early_dv")
    arguments = {name: bool(value) for name, value in settings.items() if name not in counts}
    arguments.update({name: int(settings[name]) for name in counts})
    arguments.update(block_n=block_n or (dkv_swap_keys(problem.head_dim)
                                         if settings["dkv_swap_ab"] else 64
                                         if settings["shared_keys"] else 128),
                     deterministic=bool(deterministic), early_dv=early, trace=bool(trace),
                     **({"softcap": float(softcap)} if softcap else {}),
                     **({"varlen": True} if varlen else {}), **window_options(problem))
    return arguments
