"""GPU check of hopper_attn.integrations: its tests, then the quick model benchmark.

    source .gpu/prelude.sh && python tools/integrations_gpu_check.py [--skip-bench]

1. `pytest tests/test_integrations.py` in this process (the CPU mapping tests and the `gpu`
   ones: a tiny random Llama's logits, loss, gradients and greedy tokens with hopper_attn
   against SDPA; SDPA's flash backend through the provider, with its fallback). Prints the
   summary and any failure in a line each; the full log goes to $OUT/integrations_pytest.log.
2. `python -m hopper_attn.harness.models --quick` in the same process (the kernels compiled
   by the tests are reused): train step, generation and attention probe with SDPA, FA4 and
   hopper_attn; JSON in $OUT/models_quick.json.

About 2-3 minutes on an H200, under 60 printed lines. Exit status 1 if a test failed.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def run_tests(out_dir: str | None) -> int:
    import pytest
    buffer = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buffer):
        status = pytest.main(["-q", "-rfE", "--tb=line", "-p", "no:cacheprovider",
                              os.path.join(ROOT, "tests", "test_integrations.py")])
    log = buffer.getvalue()
    if out_dir:
        with open(os.path.join(out_dir, "integrations_pytest.log"), "w") as f:
            f.write(log)
    lines = log.splitlines()
    shown = [line for line in lines if line.startswith(("FAILED", "ERROR", "E   "))
             or "Error" in line[:60]][:20]
    for line in shown:
        print("  " + line[:200])
    summary = next((line for line in reversed(lines) if " in " in line and
                    ("passed" in line or "failed" in line or "error" in line)), "no summary")
    print(f"tests: {summary.strip('= ')} ({time.perf_counter() - t0:.0f} s)")
    return int(status)


def main() -> int:
    os.chdir(ROOT)
    out_dir = os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    import torch
    print(f"integrations check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    status = run_tests(out_dir)
    if "--skip-bench" not in sys.argv:
        import warnings
        warnings.filterwarnings("ignore")        # e.g. FA4's aux_data note: keep it short
        from hopper_attn.harness import models
        out = os.path.join(out_dir, "models_quick.json") if out_dir else None
        models.main(["--quick"] + (["--out", out] if out else []))
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
