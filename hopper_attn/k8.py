"""k8: k7 with incoherent processing: Q and K rotated by a random orthogonal matrix before
they are quantized.

What changes from k7: only the inputs (`prepare_inputs`); the kernel is k7's (it launches in
k7's `FlashAttentionK7.__call__`, compiled under k8's name). For any orthogonal R
(R R^T = I), (Q R)(K R)^T = Q K^T, so rotating both Q and K leaves the scores and
everything after them unchanged in exact arithmetic; V is not touched. What changes is
what e4m3 has to represent. Activations often have a few *outlier channels* (head-dim
coordinates 10-100x larger than the rest); their rounding error, a fixed fraction of a large
value, then dominates each score q . k. A random rotation spreads every channel's energy
over all d coordinates, so no coordinate is much larger than the others, and the rounding
errors of the d products average out instead of one of them dominating
(FlashAttention-3, section 3.3, after QuIP's "incoherence processing").

R = diag(s) H / sqrt(d): H the d x d Hadamard matrix (entries +-1, Sylvester's
construction, d a power of two), s random signs (`signs`). On the GPU the quantizer applies
it inside its two kernels, as a fast Walsh-Hadamard transform over the values each thread
and its neighbouring lanes hold (common/fp8_quantize.py: d log2 d additions per key, no pass
of its own); elsewhere, and as the reference (`rotate`), as an fp32 matmul. Its time is
reported next to the kernel's, not inside it (docs/k8.md).

Everything else, including the numbers that describe the kernel, is k7's: docs/k8.md.
"""

from __future__ import annotations

import dataclasses

import torch

from hopper_attn import k7
from hopper_attn.quantize import hadamard, rotation_matrix  # noqa: F401 (hadamard: re-exported)

SPEC = dataclasses.replace(
    k7.SPEC, name="k8",
    summary="k7 + incoherent processing: Q and K rotated (random-sign Hadamard) before FP8")

_ROTATIONS: dict = {}


def signs(d: int, seed: int = 0) -> torch.Tensor:
    """The random signs s of R = diag(s) H / sqrt(d): (d,) fp32 +-1, on the CPU, from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (d,), generator=gen).float() * 2 - 1


def rotation(d: int, device, seed: int = 0) -> torch.Tensor:
    """R = diag(s) H / sqrt(d) with random signs s (fp32, orthogonal), cached per
    (d, device, seed)."""
    key = (d, str(device), seed)
    if key not in _ROTATIONS:
        _ROTATIONS[key] = rotation_matrix(signs(d, seed)).to(device)
    return _ROTATIONS[key]


def _signs_on(device, d: int, seed: int) -> torch.Tensor:
    """`signs` on `device`, cached (a host-to-device copy per call would stall the stream)."""
    key = ("signs", d, str(device), seed)
    if key not in _ROTATIONS:
        _ROTATIONS[key] = signs(d, seed).to(device)
    return _ROTATIONS[key]


@torch.no_grad()
def rotate(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """x R in fp32, for (batch, seqlen, heads, head_dim) x."""
    return torch.matmul(x.float(), rotation(x.shape[-1], x.device, seed))


def prepare_inputs(q, k, v, seed: int = 0, s_f16=None, softmax_scale=None, **_options):
    """bf16 q, k, v -> k7's inputs, with q and k rotated first (same R for both; on the GPU
    inside the quantizer's kernels, elsewhere `rotate`'s matmul)."""
    return k7.prepare_inputs(q, k, v, rotate_signs=_signs_on(q.device, q.shape[-1], seed),
                             s_f16=s_f16, softmax_scale=softmax_scale)


def compile_kernel(problem, *, compile_options: str = "", **options):
    """k7's kernel (same options), registered under k8's name."""
    return k7.compile_kernel(problem, compile_options=compile_options, spec=SPEC, **options)


run_kernel = k7.run_kernel          # same inputs: (q8, k8, v8, descales..., out)
logical_inputs = k7.logical_inputs  # V unpacked, for references
output_descale = k7.output_descale  # out_fp8: v's descale
