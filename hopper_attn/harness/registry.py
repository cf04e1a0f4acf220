"""The stage registry, for the harness's tools: it lives in the package (`hopper_attn.stages`)."""

from hopper_attn.stages import (BACKWARD_KERNELS, KERNELS, KernelEntry, get,  # noqa: F401
                                resolve)
