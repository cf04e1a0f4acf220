"""The timeline option: iket phase ranges cost nothing when off and are in the kernel when on."""

import os
import re
import subprocess
import sys

import pytest

from hopper_attn.harness import registry
from hopper_attn.harness.compile_report import compile_artifacts

pytestmark = pytest.mark.compile


def _code(ptx: str) -> str:
    return "\n".join(ln for ln in ptx.splitlines() if not ln.lstrip().startswith("//"))


def test_trace_off_emits_no_code():
    plain = compile_artifacts(registry.get("k4"), 128, False)
    traced = compile_artifacts(registry.get("k4:trace=1"), 128, False)
    # without iket's compiler option, the DSL strips the ranges: the same PTX as trace off
    assert _code(plain["ptx"]) == _code(traced["ptx"])
    assert "globaltimer" not in plain["ptx"]


PROBE = """
import sys
from hopper_attn.harness import registry
from hopper_attn.harness.compile_report import compile_artifacts
name, d, causal = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
print(compile_artifacts(registry.get(name), d, causal)["ptx"])
"""


def _ptx_with_ranges(name: str, d: int, causal: bool) -> str:
    """The PTX of `name` compiled as `iket profile` does: the JIT told to keep the ranges
    (read when cutlass is imported, hence a fresh process)."""
    env = {**os.environ, "CUTE_DSL_COMPILER_OPT": "iket"}
    return subprocess.run([sys.executable, "-c", PROBE, name, str(d), str(int(causal))],
                          env=env, capture_output=True, text=True, check=True).stdout


def _ranges(ptx: str) -> set:
    return set(re.findall(r"__iket_range_decl_([a-z_0-9]+?)_\d+_attrs", ptx))


def test_trace_on_keeps_one_range_per_phase():
    ptx = _ptx_with_ranges("k4:trace=1", 128, False)
    assert _ranges(ptx) == {"wait_kv", "qk", "softmax", "pv", "release"}
    assert "globaltimer" in ptx


def test_backward_ranges():
    """kb2 (the backward) records its consumers' phases, the producer's waits for free Q and
    dO stages and the dQ writer's wait for each staged block."""
    ptx = _ptx_with_ranges("kb2:trace=1", 128, True)
    assert _ranges(ptx) == {"wait_q", "s_dp", "wait_s", "exp2", "dv", "wait_dp", "ds",
                            "ds_barrier", "dq_dk", "wait_dv_dq", "dq_store", "wait_dk",
                            "epilogue", "load_q", "load_do", "wait_dq_full"}


def test_item_ends_from_ranges():
    """`timeline items` (harness/timeline.py `item_ends`): on synthetic ranges of one consumer
    warpgroup, two items of three tiles each (period 100 ns) with 250 ns between the last
    softmax start of the first and the first of the second."""
    from hopper_attn.harness.timeline import item_ends
    rows = []
    for start in (0, 450):                       # item starts (ns)
        rows.append((4, "wait_q", start - 10, start))
        for t in range(3):
            rows.append((4, "qk", start + 100 * t, start + 100 * t + 30))
            rows.append((4, "softmax", start + 100 * t + 40, start + 100 * t + 90))
        rows.append((4, "pv", start + 290, start + 310))
        rows.append((4, "epilogue", start + 320, start + 380))
    out = item_ends(rows)["wg1"]
    assert out["items"] == 2 and out["tile_period_ns"] == 100
    assert out["item_end_ns"] == 450 + 40 - 240 and out["item_end_periods"] == 2.5
    names = [name for name, _ in out["phases_ns"]]
    assert names[:3] == ["softmax", "pv", "epilogue"] and names[-1] == "(no range)"
