"""Staged FlashAttention kernels for Hopper (forward k1 ... k6, FP8 k7 and k8, backward kb1
and kb2), one file per stage, and `attention()`, the fastest of them as a PyTorch op, and
`attention_fp8()`, k7 from bf16 inputs, `attention_varlen()`, packed batches of
variable-length sequences (hopper_attn/api.py), and `attention_with_kvcache()`, the decode
stage over a contiguous or paged KV cache (hopper_attn/kvcache.py).

Importing the package selects the sm_90a target for the CuTe DSL (unless CUTE_DSL_ARCH is
already set): WGMMA and setmaxnreg need it, and a machine without a GPU would otherwise
compile for another architecture.
"""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from hopper_attn.api import attention, attention_fp8, attention_varlen  # noqa: E402  (after the arch is set)
from hopper_attn.kvcache import attention_with_kvcache  # noqa: E402

__all__ = ["attention", "attention_fp8", "attention_varlen", "attention_with_kvcache"]
