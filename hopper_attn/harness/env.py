"""What a result was measured on: GPU, driver, versions, date. Every results file carries this."""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import subprocess


def _dist_version(name: str):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    import torch
    info = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
    }
    try:
        import cutlass
        info["cutlass_dsl"] = cutlass.__version__
    except Exception:  # noqa: BLE001
        info["cutlass_dsl"] = None
    # the baselines' versions: FlashAttention-4 (and the quack kernels it builds on), cuDNN
    info["flash_attn_4"] = _dist_version("flash-attn-4")
    info["quack_kernels"] = _dist_version("quack-kernels")
    info["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sm_count=p.multi_processor_count,
                    capability=f"sm_{p.major}{p.minor}",
                    memory_gib=round(p.total_memory / 2**30, 1),
                    l2_mib=round(getattr(p, "L2_cache_size", 0) / 2**20, 1))
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
            info["nvidia_smi"] = out.stdout.strip()
            info["driver"] = info["nvidia_smi"].split(",")[0].strip() or None
        except Exception:  # noqa: BLE001
            pass
    else:
        info["gpu"] = None
    return info


def gpu_slug(name: str | None) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; used for results/<gpu>/ folders."""
    if not name:
        return "cpu"
    lowered = name.lower()
    for tag in ("h200", "h100", "h800", "h20", "gh200", "b200", "a100"):
        if tag in lowered:
            return tag
    return "".join(c if c.isalnum() else "_" for c in lowered).strip("_")
