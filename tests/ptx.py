"""Shared by the compile tests: one cache of sm_90a compiles per (kernel, d, causal) for the
whole test session, and the PTX patterns the stages are checked against."""

import re

import torch

from hopper_attn.harness import registry
from hopper_attn.harness.compile_report import compile_artifacts

WGMMA = r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.(?:bf16\.bf16|f16\.f16)"
WGMMA_REG_A = WGMMA + r"\s*\{[^}]*\},\s*\{"                    # A given as a register list
TMA_LOAD = r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global"
TMA_STORE = r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta"

_CACHE = {}


def compiled(name, d, causal, dtype=torch.bfloat16, heads_kv=0):
    """PTX, cubin and kernel description of `name` (a registry name, options allowed);
    `heads_kv`: k/v heads of the problem (0: as q's 2; 1: GQA)."""
    key = (name, d, causal, dtype, heads_kv)
    if key not in _CACHE:
        art = compile_artifacts(registry.get(name), d, causal, dtype, heads_kv=heads_kv)
        assert art["ok"], f"{name} d={d} causal={causal} failed to compile: {art.get('error')}"
        _CACHE[key] = art
    return _CACHE[key]


def count(ptx, pattern):
    return len(re.findall(pattern, ptx))
