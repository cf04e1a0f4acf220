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
from hopper_attn.harness import registry
from hopper_attn.harness.compile_report import compile_artifacts
print(compile_artifacts(registry.get("k4:trace=1"), 128, False)["ptx"])
"""


def test_trace_on_keeps_one_range_per_phase():
    # what `iket profile` does: ask the JIT to keep the ranges (read when cutlass is imported)
    env = {**os.environ, "CUTE_DSL_COMPILER_OPT": "iket"}
    ptx = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, check=True).stdout
    ranges = set(re.findall(r"__iket_range_decl_([a-z_]+?)_\d+_attrs", ptx))
    assert ranges == {"wait_kv", "qk", "softmax", "pv", "release"}
    assert "globaltimer" in ptx


KB2_PROBE = """
from hopper_attn.harness import registry
from hopper_attn.harness.compile_report import compile_artifacts
print(compile_artifacts(registry.get("kb2:trace=1"), 128, True)["ptx"])
"""


def test_backward_ranges():
    """kb2 (the backward) records its consumers' phases, the producer's waits for free Q and
    dO stages and the dQ writer's wait for each staged block."""
    env = {**os.environ, "CUTE_DSL_COMPILER_OPT": "iket"}
    ptx = subprocess.run([sys.executable, "-c", KB2_PROBE], env=env, capture_output=True,
                         text=True, check=True).stdout
    ranges = set(re.findall(r"__iket_range_decl_([a-z_0-9]+?)_\d+_attrs", ptx))
    assert ranges == {"wait_q", "s_dp", "wait_s", "exp2", "dv", "wait_dp", "ds", "ds_barrier",
                      "dq_dk", "wait_dv_dq", "dq_store", "wait_dk", "epilogue", "load_q",
                      "load_do", "wait_dq_full"}
