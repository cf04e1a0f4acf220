"""What the GPU check scripts (tools/*_gpu_check.py) share: the line they open with (GPU,
driver and versions from `env.environment()`), a log that prints and keeps its lines for
the JSON, and the JSON itself, written under $OUT with the environment in it."""

from __future__ import annotations

import json
import os


def env_line(env: dict) -> str:
    """One line: GPU, driver, torch, CuTe DSL and FA4 versions."""
    return (f"{env.get('gpu')} driver {env.get('driver')} torch {env.get('torch')} "
            f"cutlass-dsl {env.get('cutlass_dsl')} flash-attn-4 {env.get('flash_attn_4')}")


class Log:
    """Print a line at once (flushed: a long run shows progress) and keep it."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)


def write_json(result: dict, name: str, out_dir: str | None = None) -> str:
    """Write `result` to out_dir/name (default: $OUT, else the current directory), adding
    the environment under "env" if it is not there yet. Returns the path."""
    if "env" not in result:
        from hopper_attn.harness.env import environment
        result = {"env": environment(), **result}
    out_dir = out_dir or os.environ.get("OUT") or "."
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return path
