"""Where a transformers model's host time goes, per step: the time inside the attention and
mask functions, and the host reads of tensor values (each a device synchronization on CUDA
tensors), by call site. Used by tools/host_path_profile.py (the CPU, launches stubbed) and
tools/generate_host_gpu_check.py (the GPU host); `sync_warnings` by tools/cp_gpu_check.py too."""

from __future__ import annotations

import collections
import contextlib
import os
import time

import torch

IMPLEMENTATIONS = ("sdpa", "hopper_attn")     # the functions `timing_interfaces` wraps


def sync_warnings(fn) -> list:
    """fn() under torch's sync debug mode: the warnings it raised for device synchronizations
    (torch's one notice that the mode is a prototype left out)."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [w for w in caught if "prototype feature" not in str(w.message)]


@contextlib.contextmanager
def counting_syncs(counts: collections.Counter):
    """Count host reads of CUDA tensors' values (each a device sync) by call site."""
    import traceback
    names = ("__bool__", "item", "__int__", "__float__", "tolist")
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def counted(name):
        original = saved[name]

        def read(self, *args, **kwargs):
            if not self.is_cuda:                # (a CPU tensor's value is already here)
                return original(self, *args, **kwargs)
            frame = traceback.extract_stack(limit=2)[0]
            where = frame.filename.split("site-packages/")[-1].replace(os.getcwd() + "/", "")
            counts[f"{name} {where}:{frame.lineno} {frame.name}"] += 1
            return original(self, *args, **kwargs)
        return read

    for name in names:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield counts
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


@contextlib.contextmanager
def timing_interfaces(spent: collections.Counter):
    """us inside transformers' attention functions ("attention") and mask functions ("mask")
    of the implementations in use, summed into `spent`."""
    from transformers import masking_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    tables = ((ALL_ATTENTION_FUNCTIONS._global_mapping, "attention"),
              (masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "mask"))
    saved = [(table, dict(table)) for table, _ in tables]

    def timed(fn, part):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - start
        return call

    for table, part in tables:
        for name in IMPLEMENTATIONS:
            if name in table:
                table[name] = timed(table[name], part)
    try:
        yield spent
    finally:
        for table, original in saved:
            table.clear()
            table.update(original)
