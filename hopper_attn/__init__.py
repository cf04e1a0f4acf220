"""Staged FlashAttention forward kernels for Hopper (k1 ... k4), one file per stage.

Importing the package selects the sm_90a target for the CuTe DSL (unless CUTE_DSL_ARCH is
already set): WGMMA and setmaxnreg need it, and a machine without a GPU would otherwise
compile for another architecture.
"""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
