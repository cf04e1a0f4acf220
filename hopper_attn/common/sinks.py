"""Attention sinks (gpt-oss's `s_aux`): one learned logit per query head that joins every
row's softmax denominator and adds nothing to the output (docs/sinks.md):

    out_i = sum_j exp(s_ij - M) v_j / (sum_j exp(s_ij - M) + exp(sink_h - M))
    lse_i = log(sum_j exp(s_ij) + exp(sink_h))

s_ij the scaled (and softcapped) scores, the sink in the same natural-log units, not scaled.
A row that sees no key: output 0, LSE the sink.

Here: the host side. The kernel side is `OnlineSoftmax.finalize_with_sink` (the sink joins
once, at an item's end) and k5's `finish_rows`, which reads the sinks tensor that k6's
`FlashAttentionK6Sinks` passes to the kernel (a runtime argument: one compile for any
values; without sinks the kernel has no such parameter and its PTX is unchanged). The
backward needs no kernel change: with the sink in the LSE, P = exp(S - LSE) is already the
sink-inclusive softmax; the sinks' own gradient is `sink_grad` below.
"""

from __future__ import annotations

from typing import Optional

import cutlass.cute as cute
import torch
from cutlass import Float32


def check_sinks(sinks, heads: int, device=None) -> None:
    """ValueError unless `sinks` is a (heads,) fp32 tensor (contiguous, on `device` when
    given): the kernel's form (`attention()` converts bf16 / fp16 sinks first)."""
    if not isinstance(sinks, torch.Tensor):
        raise ValueError(f"sinks must be a torch.Tensor of shape ({heads},) (one logit per "
                         f"query head), got {type(sinks).__name__}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must have shape ({heads},) (one logit per query head), got "
                         f"{tuple(sinks.shape)}")
    if sinks.dtype != torch.float32:
        raise ValueError(f"sinks must be float32 here (attention() takes bf16 / fp16 / fp32), "
                         f"got {sinks.dtype}")
    if not sinks.is_contiguous():
        raise ValueError("sinks must be contiguous")
    if device is not None and sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device}; q is on {device}")


def as_kernel_sinks(sinks, heads: int, device) -> torch.Tensor:
    """`attention()`'s `sinks` checked (ValueError) and made the kernel's fp32 (heads,)
    tensor: bf16 / fp16 converted (differentiably), on q's device."""
    if not isinstance(sinks, torch.Tensor):
        raise ValueError(f"sinks must be a torch.Tensor of shape ({heads},) (one logit per "
                         f"query head), got {type(sinks).__name__}")
    if sinks.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"sinks must be float32, bfloat16 or float16, got {sinks.dtype}")
    if sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device}; q is on {device}")
    sinks = sinks.float().contiguous()
    check_sinks(sinks, heads, device)
    return sinks


def sink_grad(sinks: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
              lse: torch.Tensor, d_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """d loss / d sinks, (heads,) fp32. The sink is one more column of each row's softmax
    with probability exp(sink_h - lse_i) and a zero value vector, so its dP is 0 and its
    dS = P (dP - D_i): dsink_h = -sum over batch and rows of exp(sink_h - lse_i) D_i, with
    D_i = rowsum(dO_i * O_i) (the backward's D). out, dout: (batch, seqlen, heads, d); lse:
    (batch, heads, seqlen), the sink-inclusive one the forward wrote. `d_rows`: D as the
    backward's preprocess left it ((batch, heads, rows >= seqlen) fp32, run_backward's
    return): a sum over 4 bytes per row instead of reading dO and O again in fp32."""
    acc = torch.promote_types(sinks.dtype, torch.float32)             # (fp64 references)
    if d_rows is None:
        d_rows = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # (batch, heads, N)
    else:
        d_rows = d_rows[..., :lse.shape[-1]]
    p_sink = torch.exp(sinks.to(acc)[None, :, None] - lse.to(acc)).nan_to_num(0.0)
    return -(p_sink * d_rows).sum((0, 2)).to(sinks.dtype)             # (-inf - -inf: 0)


def varlen_sink_grad(sinks: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                     lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     d_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`sink_grad` over a packed batch (attention_varlen): out, dout (total_q, heads, d), lse
    (heads, total_q). Tokens past cu_seqlens_q[-1], which the forward leaves unwritten, count
    0 (a mask made on the device: nothing read on the host). `d_rows`: D as the varlen
    backward's preprocess computed it, (heads, total_q) (varlen_backward's `return_d`):
    4 bytes per row instead of reading dO and O again in fp32."""
    acc = torch.promote_types(sinks.dtype, torch.float32)
    if d_rows is None:
        d_rows = (dout.to(acc) * out.to(acc)).sum(-1).t()             # (heads, total_q)
    p_sink = torch.exp(sinks.to(acc)[:, None] - lse.to(acc))
    written = torch.arange(lse.shape[1], device=lse.device) < cu_seqlens_q[-1]
    terms = torch.where(written, p_sink * d_rows, 0.0).nan_to_num(0.0)   # (-inf - -inf: 0)
    return -terms.sum(1).to(sinks.dtype)


def with_sinks(spec):
    """A stage's KernelSpec for its kernel with sinks: the sinks an extra input after `out`."""
    import dataclasses
    return dataclasses.replace(spec, extra_inputs=sink_examples,
                               check_extra_inputs=check_sink_inputs)


def sink_inputs(handle, sinks) -> tuple:
    """run_attention's extra inputs for `handle`: (sinks,) for (and only for) a kernel
    compiled with them (`sinks=1`), else ()."""
    if handle.options.get("sinks", False) != (sinks is not None):
        raise ValueError(f"{handle.name}: sinks go with a kernel compiled with sinks=1, and "
                         f"only there")
    return () if sinks is None else (sinks,)


def sink_examples(problem, device) -> list:
    """The sinks tensor to compile against (KernelSpec.extra_inputs)."""
    return [torch.zeros(problem.heads, dtype=torch.float32, device=device)]


def check_sink_inputs(problem, extra_inputs) -> None:
    """run_attention's check of the extra inputs of a kernel with sinks."""
    if len(extra_inputs) != 1:
        raise ValueError("a kernel compiled with sinks takes one sinks tensor")
    check_sinks(extra_inputs[0], problem.heads)
    if extra_inputs[0].data_ptr() % 16:
        raise ValueError("sinks must be 16-byte aligned (as every kernel input)")
    if not extra_inputs[0].is_cuda:
        raise ValueError(f"sinks is on {extra_inputs[0].device}; the kernels run on a CUDA "
                         f"device")


class SinkLogits:
    """A stage's kernel class with sinks: its launch takes the sinks tensor after `out`
    (where run_attention puts extra inputs) and passes it to the kernel."""

    def __init__(self, *args, sinks: bool = True, **kwargs):
        super().__init__(*args, **kwargs)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mSinks: cute.Tensor, mLSE: cute.Tensor, mCounter: cute.Tensor,
                 scale_log2: Float32, stream):
        self.launch(mQ, mK, mV, mO, mLSE, mCounter, scale_log2, stream, mSinks)

    def describe(self) -> dict:
        return {**super().describe(), "sinks": True}


def reference_with_sinks(s: torch.Tensor, seen: torch.Tensor, v: torch.Tensor,
                         sinks: Optional[torch.Tensor]):
    """out, lse of softmax over scores `s` (batch, heads, nq, nk; already scaled, capped),
    keys where `seen` (nq, nk), with the sinks (heads,) as one more column (None: none); v
    (batch, nk, heads or k/v heads, d). Differentiable in every input (float64 for gradient checks)."""
    s = s.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        column = sinks.to(s.dtype)[None, :, None, None].expand(*s.shape[:3], 1)
        s = torch.cat([s, column], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :-1]
    v = v.to(p.dtype).repeat_interleave(s.shape[1] // v.shape[2], dim=2)    # (GQA)
    return torch.einsum("bhij,bjhd->bihd", p, v), lse
