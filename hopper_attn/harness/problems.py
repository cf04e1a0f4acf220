"""Benchmark problems: the FlashAttention-3 paper's sweep, narrowed by environment variables.

Default sweep: 16k tokens per batch (batch = 16384 / N), hidden size 2048 (heads =
2048 / d), N in 512 .. 16384, d in {64, 128, 256}, causal off and on, bf16. Every tensor is
then 64 MiB, larger than the L2 cache of an H100 (50 MiB) or H200 (60 MiB).

Narrow (or widen) it with comma-separated lists: SEQLEN=4096 HEADDIM=128 CAUSAL=0
[DTYPE=bf16,fp16 BATCH=.. HEADS=..].
"""

from __future__ import annotations

import os

import torch

from hopper_attn.common.contract import Problem

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128, 256)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOKENS = 16384
HIDDEN = 2048


# a valid setting of each environment variable, for the error messages
EXAMPLES = {"SEQLEN": "SEQLEN=1024,4096", "HEADDIM": "HEADDIM=64,128", "CAUSAL": "CAUSAL=0,1",
            "DTYPE": "DTYPE=bf16,fp16", "BATCH": "BATCH=4", "HEADS": "HEADS=16"}


def _env_list(name: str, default, cast=int):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return tuple(default) if default is not None else None
    example = EXAMPLES.get(name, f"{name}=1024,4096")
    try:
        return tuple(cast(x) for x in raw.split(",") if x.strip())
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r}: expected a comma-separated list, e.g. {example} "
                         f"({exc})") from None


def _bool(x: str) -> bool:
    if x.strip().lower() in ("1", "true", "yes", "causal"):
        return True
    if x.strip().lower() in ("0", "false", "no", "full"):
        return False
    raise ValueError(f"CAUSAL must be 0 or 1, got {x!r}")


def _dtype(x: str) -> torch.dtype:
    if x.strip().lower() not in DTYPES:
        raise ValueError(f"DTYPE must be one of {', '.join(DTYPES)}, got {x!r}")
    return DTYPES[x.strip().lower()]


def dtypes() -> tuple:
    return _env_list("DTYPE", (torch.bfloat16,), _dtype)


def sweep() -> list[Problem]:
    seqlens = _env_list("SEQLEN", SEQLENS)
    head_dims = _env_list("HEADDIM", HEAD_DIMS)
    causals = _env_list("CAUSAL", (False, True), _bool)
    batches = _env_list("BATCH", None)
    heads_list = _env_list("HEADS", None)
    problems = []
    for dtype in dtypes():
        for d in head_dims:
            for causal in causals:
                for n in seqlens:
                    for b in batches or (max(1, TOKENS // n),):
                        for h in heads_list or (max(1, HIDDEN // d),):
                            problems.append(Problem(b, h, n, d, causal, dtype))
    return problems


def config_name(p: Problem) -> str:
    """A short name without spaces (used for NVTX ranges and file names)."""
    dtype = "" if p.dtype == torch.bfloat16 else f"_{p.dtype_name}"
    return f"b{p.batch}_h{p.heads}_n{p.seqlen}_d{p.head_dim}_{'causal' if p.causal else 'full'}{dtype}"
