"""Host-side glue between torch tensors and the CuTe DSL: conversion, streams, compiling.

Importing this module sets ``CUTE_DSL_ARCH=sm_90a`` (unless already set) before ``cutlass`` is
imported: WGMMA and ``setmaxnreg`` need the ``a`` target, and a machine without a GPU would
otherwise default to another architecture.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import torch  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.runtime import from_dlpack, make_fake_stream  # noqa: E402

# Shapes of the example tensors used to compile. Layouts are marked dynamic, so these values
# are not baked into the kernel; they only need to be valid (and not 1, to avoid any chance of
# a degenerate-mode special case).
_EXAMPLE_BATCH, _EXAMPLE_SEQLEN, _EXAMPLE_HEADS = 2, 128, 2


TVM_FFI = "--enable-tvm-ffi"


def to_cute_tensor(t: torch.Tensor, enable_tvm_ffi: bool = False,
                   leading_dim=None) -> cute.Tensor:
    """torch tensor -> CuTe tensor with a dynamic layout whose last mode (or `leading_dim`)
    is the contiguous one.

    Every extent and stride except the unit stride stays a runtime value, so one compiled
    kernel serves any batch, heads and sequence length.
    """
    return from_dlpack(t.detach(), assumed_align=16, enable_tvm_ffi=enable_tvm_ffi) \
        .mark_layout_dynamic(leading_dim=t.dim() - 1 if leading_dim is None else leading_dim)


def attention_args(tensors, enable_tvm_ffi: bool = False, v_seq_major: bool = False) -> list:
    """A forward kernel's tensors (q, k, v, out, ...) as CuTe tensors; v (third) with its
    sequence mode as the contiguous one when it is stored sequence-major (k7)."""
    return [to_cute_tensor(t, enable_tvm_ffi, leading_dim=1 if i == 2 and v_seq_major else None)
            for i, t in enumerate(tensors)]


def current_stream():
    import cuda.bindings.driver as cuda
    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


def example_tensors(head_dim: int, workspace_fn=None, dtype=torch.bfloat16,
                    work_counter: bool = False, input_dtype=None, extra_fn=None,
                    output_dtype=None, head_dim_v: int = 0):
    """Small tensors (on the GPU when there is one, else on the CPU) to compile against:
    q, k, v (in `input_dtype` if given), out (in `output_dtype` if given), the extra inputs,
    the workspace, the counter; v and out with head dim `head_dim_v` (0: head_dim)."""
    from .contract import Problem, work_counter as counter_of
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    shape = (_EXAMPLE_BATCH, _EXAMPLE_SEQLEN, _EXAMPLE_HEADS, head_dim)
    tensors = [torch.empty(shape, dtype=input_dtype or dtype, device=device) for _ in range(3)]
    tensors.append(torch.empty(shape, dtype=output_dtype or dtype, device=device))
    if head_dim_v and head_dim_v != head_dim:
        for i in (2, 3):
            tensors[i] = torch.empty((*shape[:3], head_dim_v), dtype=tensors[i].dtype,
                                     device=device)
    problem = Problem(_EXAMPLE_BATCH, _EXAMPLE_HEADS, _EXAMPLE_SEQLEN, head_dim, dtype=dtype)
    if extra_fn is not None:
        tensors += extra_fn(problem, device)
    if workspace_fn is not None:
        tensors += workspace_fn(problem, device)
    if work_counter:
        tensors.append(counter_of(device))
    return tensors


def compile_for_example(kernel, head_dim: int, workspace_fn=None, compile_options: str = "",
                        dtype=torch.bfloat16, work_counter: bool = False, input_dtype=None,
                        extra_fn=None, v_seq_major: bool = False, output_dtype=None,
                        head_dim_v: int = 0):
    """cute.compile `kernel` (a @cute.jit callable object) against example tensors of
    `dtype` (kernels that take it from their tensors compile one version per dtype;
    `v_seq_major`: v stored with the sequence dim contiguous)."""
    tensors = example_tensors(head_dim, workspace_fn, dtype, work_counter, input_dtype,
                              extra_fn, output_dtype, head_dim_v)
    if v_seq_major:
        b, n, h, d = tensors[2].shape
        tensors[2] = torch.empty((b, h, d, n), dtype=tensors[2].dtype,
                                 device=tensors[2].device).permute(0, 3, 1, 2)
    # With CuTe DSL's TVM-FFI calling path the compiled function takes torch tensors directly
    # and launches on torch's current stream (no stream argument): far less host work per call.
    tvm_ffi = TVM_FFI in compile_options
    if tvm_ffi:
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    else:
        stream = current_stream() if torch.cuda.is_available() else make_fake_stream()
    args = attention_args(tensors, tvm_ffi, v_seq_major)
    opts = compile_options.strip()
    if opts:
        return cute.compile(kernel, *args, cutlass.Float32(1.0), stream, options=opts)
    return cute.compile(kernel, *args, cutlass.Float32(1.0), stream)


def tvm_ffi_available() -> bool:
    """CuTe DSL's TVM-FFI calling path (apache-tvm-ffi installed): the compiled kernels then
    take torch tensors directly and launch on torch's current stream, a few microseconds per
    call instead of ~10 per tensor converted. It compiles against CUDA tensors only, so not
    on a machine without a GPU."""
    import importlib.util
    return torch.cuda.is_available() and importlib.util.find_spec("tvm_ffi") is not None


def compile_with_tensors(fn, *tensors, scalars=(), options: str = "", tvm_ffi: bool = False,
                         leading_dims: dict | None = None):
    """cute.compile a @cute.jit callable against example torch tensors (+ fp32 scalars and a
    stream, its last argument). With `tvm_ffi` the result takes torch tensors (and the
    scalars) and launches on torch's current stream; otherwise CuTe tensors and a stream.
    `leading_dims`: {argument index: its contiguous mode} where that is not the last one."""
    if tvm_ffi:
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        options = f"{options} {TVM_FFI}"
    else:
        stream = current_stream() if torch.cuda.is_available() else make_fake_stream()
    leading_dims = leading_dims or {}
    args = [to_cute_tensor(t, tvm_ffi, leading_dims.get(i)) for i, t in enumerate(tensors)]
    args += [cutlass.Float32(s) for s in scalars]
    if options.strip():
        return cute.compile(fn, *args, stream, options=options.strip())
    return cute.compile(fn, *args, stream)
