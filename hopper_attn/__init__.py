"""Staged FlashAttention forward kernels for Hopper (k1 ... k6), one file per stage, and
`attention()`, the fastest of them as a PyTorch op (hopper_attn/api.py).

Importing the package selects the sm_90a target for the CuTe DSL (unless CUTE_DSL_ARCH is
already set): WGMMA and setmaxnreg need it, and a machine without a GPU would otherwise
compile for another architecture.
"""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from hopper_attn.api import attention  # noqa: E402  (after the arch is set)

__all__ = ["attention"]
