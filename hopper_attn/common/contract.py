"""The contract every kernel in this repository follows (host side, plain Python).

A kernel module ``hopper_attn/kN.py`` exposes

    SPEC                                  what it supports (head dims, dtypes, limits)
    compile_kernel(problem, **options)    -> CompiledAttention (cached per configuration)
    run_kernel(handle, q, k, v, out)      launches on the current CUDA stream, writes ``out``

Tensors are torch ``(batch, seqlen, heads, head_dim)``, contiguous, bf16, on one CUDA device:
the FlashAttention layout, heads not folded into batch. The softmax scale is 1/sqrt(head_dim).

Everything that can be wrong with a call is checked here, before anything is launched, and
raised as ``ValueError`` (``UnsupportedProblem`` when the problem is valid but this kernel
does not handle it, so the harness can skip with the reason).

Compiled kernels are cached per (kernel, options, head_dim, causal, dtype). Batch, heads and
sequence length are dynamic in the compiled code, so one compile serves every shape.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Optional

import torch

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
MAX_GRID_YZ = 65535
LOG2_E = math.log2(math.e)



@dataclasses.dataclass(frozen=True)
class Lengths:
    """A POLICY row's query lengths: lo <= N < hi, or those `rule` accepts."""
    lo: int = 0
    hi: int = 1 << 31
    rule: Optional[Callable[[int], bool]] = None

    def __contains__(self, n: int) -> bool:
        return self.rule(n) if self.rule else self.lo <= n < self.hi


class UnsupportedProblem(ValueError):
    """A valid attention problem that this particular kernel does not handle."""


@dataclasses.dataclass(frozen=True)
class Problem:
    """One attention forward problem: O = softmax(Q K^T / sqrt(d) [+ causal mask]) V."""

    batch: int
    heads: int
    seqlen: int
    head_dim: int
    causal: bool = False
    dtype: torch.dtype = torch.bfloat16
    # keys/values, when they differ from the queries (0: the same as heads / seqlen):
    # fewer heads than q (GQA/MQA; heads % heads_kv == 0) or another length (cross-attention,
    # a KV prefix; the causal mask is then aligned bottom-right)
    heads_kv: int = 0
    seqlen_k: int = 0
    # a sliding window (FlashAttention's window_size, as `normalize_window` normalizes it;
    # any spelling it takes is normalized here too): query i at row position r = i +
    # seqlen_k - seqlen_q sees keys r - window_left .. r + window_right, each side literal
    # (negative ones too: shifted diagonals); None: unbounded on that side; with causal the
    # right side is 0 and window_right stays None. (None, None): no window
    window_left: Optional[int] = None
    window_right: Optional[int] = None
    # v's (and the output's) head dim when it is not q's and k's (0: head_dim), e.g.
    # DeepSeek's MLA (192, 128)
    head_dim_v: int = 0

    def __post_init__(self):
        for field in ("batch", "heads", "seqlen", "head_dim"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{field} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"{field} must be >= 1, got {value}")
        for field in ("heads_kv", "seqlen_k", "head_dim_v"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{field} must be an int >= 1 (or 0: as q), got {value!r}")
        # (frozen: the normalized sides replace the given ones)
        left, right = normalize_window((self.window_left, self.window_right), self.causal)
        object.__setattr__(self, "window_left", left)
        object.__setattr__(self, "window_right", right)
        if self.heads % self.kv_heads:
            raise ValueError(f"q's heads ({self.heads}) must be a multiple of k/v's "
                             f"({self.kv_heads})")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"unknown dtype {self.dtype}")

    @property
    def windowed(self) -> bool:
        return self.window_left is not None or self.window_right is not None

    @property
    def window(self) -> tuple:
        """(left, right), None unbounded, causal as right = 0."""
        return self.window_left, 0 if self.causal else self.window_right

    @classmethod
    def from_tensor(cls, q: torch.Tensor, causal: bool = False,
                    k: Optional[torch.Tensor] = None, window_size=(None, None),
                    v: Optional[torch.Tensor] = None) -> "Problem":
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t is not None and t.dim() != 4:
                raise ValueError(f"{name} must be 4-D (batch, seqlen, heads, head_dim), "
                                 f"got shape {tuple(t.shape)}")
        b, n, h, d = q.shape
        if k is not None and (k.shape[1] < 1 or k.shape[2] < 1):
            # (0 in Problem's seqlen_k / heads_kv means "as q": an empty k must not read so)
            raise ValueError(f"k must have at least one key and one head, got shape "
                             f"{tuple(k.shape)}")
        left, right = normalize_window(window_size, causal)
        dv = 0 if v is None or v.shape[3] == d else v.shape[3]
        if k is None or (k.shape[1] == n and k.shape[2] == h):
            return cls(b, h, n, d, bool(causal), q.dtype, window_left=left, window_right=right,
                       head_dim_v=dv)
        return cls(b, h, n, d, bool(causal), q.dtype, heads_kv=k.shape[2], seqlen_k=k.shape[1],
                   window_left=left, window_right=right, head_dim_v=dv)

    @property
    def kv_heads(self) -> int:
        return self.heads_kv or self.heads

    @property
    def kv_seqlen(self) -> int:
        return self.seqlen_k or self.seqlen

    @property
    def dv(self) -> int:
        """v's and the output's head dim."""
        return self.head_dim_v or self.head_dim

    @property
    def head_dims(self):
        """head_dim, or (head_dim, dv) where v's differs (k6's POLICY keys)."""
        return self.head_dim if self.dv == self.head_dim else (self.head_dim, self.dv)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The torch shape of q and o: (batch, seqlen, heads, head_dim)."""
        return (self.batch, self.seqlen, self.heads, self.head_dim)

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        """The torch shape of k and v: (batch, seqlen_k, heads_kv, head_dim)."""
        return (self.batch, self.kv_seqlen, self.kv_heads, self.head_dim)

    @property
    def v_shape(self) -> tuple[int, int, int, int]:
        """v's torch shape: k's with head dim dv."""
        return (*self.kv_shape[:3], self.dv)

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        """The output's torch shape: q's with head dim dv."""
        return (*self.shape[:3], self.dv)

    @property
    def flops(self) -> float:
        """4*B*H*N^2*d for the two GEMMs (N^2: query-key pairs); half of that with a causal
        mask on a square problem. With seqlen_k != seqlen_q: 4*B*H*d times the number of
        visible pairs (the causal mask aligned bottom-right). With dv != d, 2*(d + dv)
        in place of 4*d."""
        nq, nk = self.seqlen, self.kv_seqlen
        if self.windowed:          # query i sees keys max(0, r - left) .. min(nk - 1, r + right)
            left, right = self.window
            pairs = sum(max(0, min(nk - 1, nk if right is None else r + right)
                            - max(0, 0 if left is None else r - left) + 1)
                        for r in range(nk - nq, nk))
        elif not self.causal:
            pairs = nq * nk
        elif nq == nk:
            pairs = nq * nq / 2
        else:                      # query i sees min(nk, max(0, i + nk - nq + 1)) keys
            pairs = sum(min(nk, max(0, i + nk - nq + 1)) for i in range(nq))
        return 2.0 * self.batch * self.heads * pairs * (self.head_dim + self.dv)

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]

    def label(self) -> str:
        kv = ""
        if self.heads_kv or self.seqlen_k:
            kv = f" (k/v: H={self.kv_heads} N={self.kv_seqlen})"
        window = f" window={self.window}" if self.windowed else ""
        dv = f" dv={self.dv}" if self.head_dim_v else ""
        return (f"B={self.batch} H={self.heads} N={self.seqlen} d={self.head_dim}{dv} "
                f"{'causal' if self.causal else 'full'}{kv}{window}")

    def as_dict(self) -> dict:
        out = {"batch": self.batch, "heads": self.heads, "seqlen": self.seqlen,
               "head_dim": self.head_dim, "causal": self.causal, "dtype": self.dtype_name}
        if self.heads_kv or self.seqlen_k:
            out.update(heads_kv=self.kv_heads, seqlen_k=self.kv_seqlen)
        if self.windowed:
            out.update(window_left=self.window_left, window_right=self.window_right)
        if self.head_dim_v:
            out.update(head_dim_v=self.head_dim_v)
        return out


def normalize_window(window_size, causal: bool) -> tuple:
    """`window_size` (left, right) checked (ValueError) and normalized to Problem's fields
    (None: unbounded on that side). Two spellings: if a side is None (unbounded) it is
    FlashAttention-4's, the other side literal, negative included ((None, -1): keys <= r -
    1; (-3, None): keys >= r + 3); if both are ints, -1 is unbounded (FlashAttention-2's and
    transformers' convention) and any other int literal, negative included ((5, -3): keys
    r - 5 .. r - 3); two negative ints are no window (as in FlashAttention-2 and -4). With
    causal the right side is 0 (right 0, -1 or None; returned as None). (None, None), and
    (-1, -1) or, with causal, (-1, 0): no window. A normalized
    pair normalizes to itself (a literal -1 only comes with the other side None)."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") \
            from None
    for name, value in (("left", left), ("right", right)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"window_size: {name} must be an int (-1: unbounded where both "
                             f"are ints) or None (unbounded), got {value!r}")
    if causal and right not in (-1, 0, None):
        raise ValueError(f"window_size: with causal=True the right side is 0 (or -1 or None), "
                         f"got {right}")
    if left is not None and right is not None:          # both ints: -1 is unbounded
        if left < 0 and right < 0:                      # (FlashAttention-2 and -4: no window)
            left = right = -1
        left, right = (None if left == -1 else left), (None if right == -1 else right)
    if causal:
        right = None
    return (None if left is None else int(left)), (None if right is None else int(right))


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """What a kernel declares about itself, so callers can skip with a reason."""

    name: str
    summary: str
    head_dims: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)
    max_seqlen: Optional[int] = None
    # bytes of scratch memory a problem needs on the GPU (k1's N x N score matrix)
    workspace_bytes: Optional[Callable[[Problem], int]] = None
    # any other limit (e.g. a grid dimension): returns a reason, or None if supported
    extra_limits: Optional[Callable[[Problem], Optional[str]]] = None
    # k/v with fewer heads (GQA/MQA) or another length than q (cross-attention)
    separate_kv: bool = False
    # strided q/k/v/out (last dim contiguous, other strides multiples of 16 bytes)
    strided_inputs: bool = False
    # one CTA per (query tile, head, batch), heads and batch on grid y and z (<= 65535 each);
    # False for a persistent kernel (a fixed grid that loops over work items)
    grid_per_tile: bool = True
    # the kernel takes the current stream's work counter after its workspace (k5, k6)
    takes_work_counter: bool = False
    # the workspace holds more than the LSE (its first tensor), kept across calls: a caller's
    # LSE replaces only that first tensor (decode: the partials and counters stay)
    keeps_workspace: bool = False
    # the dtype q, k, v arrive in when it is not the problem's (k7: e4m3, quantized from the
    # problem's bf16 by the module's `prepare_inputs`); the output stays in the problem's
    input_dtype: Optional[torch.dtype] = None
    # more input tensors after `out` (k7: the descales); returns examples to compile against
    extra_inputs: Optional[Callable[[Problem, Any], list]] = None
    # run_attention's check of those (None: k7's descales, `check_descales`)
    check_extra_inputs: Optional[Callable[[Problem, tuple], None]] = None
    # v stored with the sequence dim contiguous (v.stride(1) == 1, i.e. a (batch, heads,
    # head_dim, seqlen) buffer seen as (batch, seqlen, heads, head_dim)), seqlen padded to a
    # multiple of 16: k7's default (made by quantize_fp8(v, pack_v=True) or k7.pack_v)
    v_seq_major: bool = False
    # the dtype `out` has when not the problem's (k7 `out_fp8=1`: e4m3, O / descale_v)
    output_dtype: Optional[torch.dtype] = None
    # a sliding window (Problem.window_left / window_right)
    window: bool = False
    # (head_dim, head_dim_v) pairs with v's head dim not q's (Problem.head_dim_v)
    head_dim_pairs: tuple = ()

    def unsupported_reason(self, problem: Problem, *, check_memory: bool = True) -> Optional[str]:
        if problem.dtype not in self.dtypes:
            names = ", ".join(DTYPE_NAMES[d] for d in self.dtypes)
            return f"{self.name} supports dtype {names}, not {problem.dtype_name}"
        if problem.head_dim not in self.head_dims:
            return f"{self.name} supports head_dim in {list(self.head_dims)}, not {problem.head_dim}"
        if problem.dv != problem.head_dim and \
                (problem.head_dim, problem.dv) not in self.head_dim_pairs:
            pairs = ", ".join(map(str, self.head_dim_pairs)) or "none"
            return (f"{self.name}: v's head dim {problem.dv} differs from q's and k's "
                    f"{problem.head_dim}; (d, dv) pairs supported: {pairs}")
        if (problem.heads_kv or problem.seqlen_k) and not self.separate_kv:
            return (f"{self.name} needs k and v with q's heads and sequence length "
                    f"(no GQA/MQA or cross-attention)")
        if problem.windowed and not self.window:
            return f"window_size: k6 / kb2 / decode only, not {self.name}"
        if self.max_seqlen is not None and problem.seqlen > self.max_seqlen:
            return f"{self.name} supports seqlen <= {self.max_seqlen}, not {problem.seqlen}"
        if self.grid_per_tile and (problem.heads > MAX_GRID_YZ or problem.batch > MAX_GRID_YZ):
            # the grid is (query tiles, heads, batch); CUDA caps gridDim.y and .z at 65535
            return (f"{self.name} launches one CTA row per head and one plane per batch entry: "
                    f"heads and batch must be <= {MAX_GRID_YZ}, got heads={problem.heads}, "
                    f"batch={problem.batch}")
        if self.extra_limits is not None:
            reason = self.extra_limits(problem)
            if reason is not None:
                return f"{self.name}: {reason}"
        if check_memory and self.workspace_bytes is not None and torch.cuda.is_available():
            need = self.workspace_bytes(problem)
            free, _ = torch.cuda.mem_get_info()
            # leave room for the inputs, the output and the allocator's own slack
            if need > 0.8 * free:
                return (f"{self.name} needs a {need / 2**30:.1f} GiB workspace for {problem.label()}, "
                        f"but only {free / 2**30:.1f} GiB of GPU memory is free")
        return None

    def check(self, problem: Problem, *, check_memory: bool = True) -> None:
        reason = self.unsupported_reason(problem, check_memory=check_memory)
        if reason is not None:
            raise UnsupportedProblem(reason)


def check_tensors(problem: Problem, q, k, v, out, strided: bool = False,
                  input_dtype: Optional[torch.dtype] = None, v_seq_major: bool = False,
                  output_dtype: Optional[torch.dtype] = None) -> None:
    """Raise ValueError unless q, k, v, out match `problem` and the layout contract:
    contiguous, or with `strided` (stages that read through TMA with runtime strides, k5 on)
    any strides with the last dim contiguous and the others multiples of 16 bytes, e.g. q, k,
    v as views of one packed (batch, seqlen, 3, heads, head_dim) tensor."""
    names = ("q", "k", "v", "out")
    tensors = (q, k, v, out)
    shapes = {"q": problem.shape, "k": problem.kv_shape, "v": problem.v_shape,
              "out": problem.out_shape}
    for name, t in zip(names, tensors):          # what the tensors are ...
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}")
        want_dtype = (output_dtype if name == "out" else input_dtype) or problem.dtype
        if t.dtype != want_dtype:
            raise ValueError(f"{name} has dtype {t.dtype}, expected {want_dtype}")
        want = shapes[name]
        if name == "v" and v_seq_major:         # packed: seqlen rounded up to 16 (k7)
            want = (want[0], -(-want[1] // 16) * 16, *want[2:])
        if tuple(t.shape) != want:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {want} "
                             "(batch, seqlen, heads, head_dim); q and out must match, and k "
                             "and v must match each other, but for v's head dim (dv), "
                             "which out has")
    for name, t in zip(names, tensors):          # ... then how and where they are stored
        if name == "v" and v_seq_major:
            unit = 16 // t.element_size()
            if t.stride(1) != 1 or any(t.stride(i) % unit for i in (0, 2, 3) if t.shape[i] > 1):
                raise ValueError(f"v must be stored sequence-major (v.stride(1) == 1, e.g. a "
                                 f"(batch, heads, head_dim, seqlen) buffer permuted to (batch, "
                                 f"seqlen, heads, head_dim)), the other strides multiples of "
                                 f"{unit} elements; got strides {t.stride()} (k7: V as "
                                 f"prepare_inputs / quantize_fp8(v, pack_v=True) packs it)")
        elif strided:
            unit = 16 // t.element_size()
            if t.stride(-1) != 1 or any(st % unit for st, n in zip(t.stride()[:3], t.shape[:3])
                                        if n > 1):
                raise ValueError(f"{name} needs a contiguous last dim and the other strides "
                                 f"multiples of {unit} elements (16 bytes); got strides "
                                 f"{t.stride()}")
        elif not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (batch, seqlen, heads, head_dim); "
                             f"got strides {t.stride()}")
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned")
    for name, t in zip(names, tensors):
        if not t.is_cuda:
            raise ValueError(f"{name} is on {t.device}; the kernels run on a CUDA device")
    devices = {t.device for t in (q, k, v, out)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v, out must be on one device, got {sorted(map(str, devices))}")


_COUNTERS: dict = {}


def _per_stream(device, words: int) -> torch.Tensor:
    """A zeroed int32 buffer of `words` for `device`'s current stream, made once and kept
    (the kernels leave what must be zero at zero). One per stream, so that launches on
    different streams never share one; launches on one stream run in order."""
    key = (*_stream_key(device), words)
    buffer = _COUNTERS.get(key)
    if buffer is None:
        buffer = _COUNTERS[key] = torch.zeros(words, dtype=torch.int32, device=device)
    return buffer


def _stream_key(device) -> tuple:
    """(device index, raw current stream) of `device` ((-1, 0) off CUDA)."""
    if isinstance(device, str):
        device = torch.device(device)
    if device.type != "cuda":
        return -1, 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return index, torch._C._cuda_getCurrentRawStream(index)


_SHARED_WORKSPACES: dict = {}


def shared_workspace(key, device, make: Callable[[], list]) -> list:
    """`make()`'s buffers, made once per `key` and `device`'s current stream and kept, for a
    workspace that its kernel leaves ready for the next launch (decode's counters back at
    zero) and that many problems can share (decode: every key count with one split count),
    so a decode step with one more key than the last allocates nothing. Launches on one
    stream run in order; another stream gets its own buffers."""
    full_key = (key, _stream_key(device))
    buffers = _SHARED_WORKSPACES.get(full_key)
    if buffers is None:
        if len(_SHARED_WORKSPACES) >= 256:      # (many batch sizes: start over)
            _SHARED_WORKSPACES.clear()
        buffers = _SHARED_WORKSPACES[full_key] = make()
    return buffers


def work_counter(device) -> torch.Tensor:
    """The global work counter of `device`'s current stream (k6's dynamic persistent
    schedule): int32 [next work item, CTAs done], zero between launches (the last CTA of each
    launch resets it)."""
    return _per_stream(device, 2)


def stream_k_workspace(device, words: int) -> torch.Tensor:
    """`work_counter`'s place for a kernel with k6's `stream_k`: int32 [4 unused, a flag per
    slot and consumer warpgroup, the split items' partial results], the flags zero between
    launches (each is reset by the CTA that consumed it)."""
    return _per_stream(device, words)


def kernel_counter(handle, device) -> torch.Tensor:
    """The counter argument of a kernel that takes one: the stream's work counter, or with
    k6's `stream_k` the stream's workspace of the kernel's size."""
    words = getattr(handle.kernel, "stream_k_words", lambda: 0)()
    return stream_k_workspace(device, words) if words else work_counter(device)


# --------------------------------------------------------------------------------------------
# Compilation and launch (CuTe DSL). Imported lazily so that the checks above work without it.
# --------------------------------------------------------------------------------------------

_COMPILED: dict[tuple, tuple[Any, float]] = {}


@dataclasses.dataclass
class CompiledAttention:
    """What compile_kernel returns: a compiled kernel bound to one problem."""

    spec: KernelSpec
    problem: Problem
    options: dict
    compiled: Any            # the CuTe JIT-compiled function, shared by every shape
    compile_seconds: float   # 0.0 when it came from the cache
    kernel: Any              # the kernel object (tile sizes, SMEM bytes, ...)
    workspace_fn: Optional[Callable[[Problem, torch.device], list]] = None
    workspace: list = dataclasses.field(default_factory=list)
    tvm_ffi: bool = False    # compiled for CuTe DSL's TVM-FFI calling path (torch tensors in)
    _bound_key: Any = None
    _bound_args: Any = None

    @property
    def name(self) -> str:
        return self.spec.name

    def describe(self) -> dict:
        return {"kernel": self.spec.name, "options": dict(self.options),
                **getattr(self.kernel, "describe", lambda: {})()}


def _cute():
    from . import cute_runtime  # noqa: F401  (sets CUTE_DSL_ARCH before cutlass is imported)
    return cute_runtime


def compile_attention(spec: KernelSpec, kernel_factory: Callable[..., Any], problem: Problem,
                      options: Optional[dict] = None, *,
                      workspace_fn: Optional[Callable[[Problem, torch.device], list]] = None,
                      compile_options: str = "", use_cache: bool = True) -> CompiledAttention:
    """Validate `problem` for `spec`, then compile (or fetch from the cache) its kernel."""
    options = dict(options or {})
    spec.check(problem)
    if problem.dv != problem.head_dim:
        options["head_dim_v"] = problem.dv          # (a kernel argument only where it differs)
    rt = _cute()
    key = (spec.name, kernel_factory, problem.head_dim, problem.causal, problem.dtype,
           spec.output_dtype, tuple(sorted(options.items())), compile_options)
    cached = _COMPILED.get(key) if use_cache else None
    if cached is None:
        kernel = kernel_factory(problem.head_dim, problem.causal, **options)
        t0 = time.perf_counter()
        compiled = rt.compile_for_example(kernel, problem.head_dim, workspace_fn, compile_options,
                                           problem.dtype, spec.takes_work_counter,
                                           spec.input_dtype, spec.extra_inputs,
                                           spec.v_seq_major, spec.output_dtype,
                                           head_dim_v=problem.dv)
        seconds = time.perf_counter() - t0
        if use_cache:
            _COMPILED[key] = (compiled, kernel)
        return CompiledAttention(spec, problem, options, compiled, seconds, kernel, workspace_fn,
                                 tvm_ffi=rt.TVM_FFI in compile_options)
    compiled, kernel = cached
    return CompiledAttention(spec, problem, options, compiled, 0.0, kernel, workspace_fn,
                             tvm_ffi=rt.TVM_FFI in compile_options)


def check_whole_kv_tiles(stage: str, problem: Problem, block_n: int) -> None:
    """A kernel compiled without the tail test (k6 / k7 `kv_tail=0`) masks no key past the
    end: refuse a key length that is no multiple of its kv tile."""
    if problem.kv_seqlen % block_n:
        raise UnsupportedProblem(f"{stage} kv_tail=0: the key length ({problem.kv_seqlen}) "
                                 f"must be a multiple of the kv tile ({block_n})")


def check_descales(problem: Problem, descales) -> None:
    """k7's per-(batch, head) fp32 descales: q's (batch, heads), k's and v's (batch, heads_kv)."""
    for name, t, heads in zip(("descale_q", "descale_k", "descale_v"), descales,
                              (problem.heads, problem.kv_heads, problem.kv_heads)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or \
                tuple(t.shape) != (problem.batch, heads) or not t.is_contiguous():
            got = (f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            raise ValueError(f"{name} must be a contiguous fp32 tensor of shape "
                             f"{(problem.batch, heads)} (batch, heads), got {got}")
    for name, t in zip(("descale_q", "descale_k", "descale_v"), descales):
        if not t.is_cuda:
            raise ValueError(f"{name} is on {t.device}; the kernels run on a CUDA device")


def run_attention(handle: CompiledAttention, q, k, v, out,
                  softmax_scale: Optional[float] = None, workspace: Optional[list] = None,
                  checked: bool = False, extra_inputs: tuple = (), lse=None) -> None:
    """Check the tensors against the handle's problem (unless the caller has, for this
    layout: `checked`), then launch on the current stream. `softmax_scale` defaults to
    1/sqrt(head_dim). `workspace`: the kernel's extra tensors (k5/k6: the log-sum-exp) to use
    instead of the handle's own (allocated once); `lse`: the log-sum-exp to write instead of
    the handle's own first workspace tensor (with `keeps_workspace` the rest of the handle's
    workspace follows it). Kernels that take a work counter get the current stream's
    (`work_counter`), looked up per call."""
    problem = handle.problem
    if not checked:
        check_tensors(problem, q, k, v, out, strided=handle.spec.strided_inputs,
                      input_dtype=handle.spec.input_dtype, v_seq_major=handle.spec.v_seq_major,
                      output_dtype=handle.spec.output_dtype)
        if handle.spec.extra_inputs is not None:
            (handle.spec.check_extra_inputs or check_descales)(problem, extra_inputs)
    if workspace is None and lse is not None and not handle.spec.keeps_workspace:
        workspace = [lse]
    if workspace is None:
        if handle.workspace_fn is not None and not handle.workspace:
            # re-check memory right before allocating, so we refuse instead of failing mid-run
            # (a workspace_fn that `checks_memory` does so itself, only when it allocates:
            # decode's is shared by key counts, and a generation step has a new one each time,
            # so cudaMemGetInfo would run every step)
            if not getattr(handle.workspace_fn, "checks_memory", False):
                handle.spec.check(problem)
            handle.workspace = handle.workspace_fn(problem, q.device)
        workspace = handle.workspace if lse is None else [lse, *handle.workspace[1:]]
    if handle.spec.takes_work_counter:
        workspace = [*workspace, kernel_counter(handle, q.device)]
    scale = problem.softmax_scale if softmax_scale is None else float(softmax_scale)
    if handle.tvm_ffi:                    # torch tensors straight in, torch's current stream
        handle.compiled(q, k, v, out, *extra_inputs, *workspace, scale * LOG2_E)
        return
    rt = _cute()
    # (shapes too: a decode handle serves every key count of its kv tile count, api.py)
    key = tuple((t.data_ptr(), t.shape, t.stride()) for t in (q, k, v, out, *extra_inputs,
                                                              *workspace))
    if handle._bound_key != key:
        tensors = [q, k, v, out, *extra_inputs, *workspace]
        handle._bound_args = rt.attention_args(tensors, v_seq_major=handle.spec.v_seq_major)
        handle._bound_key = key
    scale_log2 = scale * LOG2_E
    handle.compiled(*handle._bound_args, scale_log2, rt.current_stream())
