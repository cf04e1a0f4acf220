"""tools/fwd_dims_gpu_check.py (issue 63: k6's forward at d = 96 and 192): every candidate
row builds a kernel k6 accepts at each length the GPU check times, and the widest tiles
among them compile for sm_90a without spills (the whole list: `--compile-only`)."""

import importlib.util
import pathlib

import pytest

from hopper_attn import k6
from hopper_attn.common.contract import Problem

PATH = pathlib.Path(__file__).resolve().parents[1] / "tools" / "fwd_dims_gpu_check.py"


def _tool():
    spec = importlib.util.spec_from_file_location("fwd_dims_gpu_check", PATH)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_candidate_rows_build():
    """Each row resolves through k6.settings_for and constructs FlashAttentionK6 (its option
    checks and the shared-memory budget) at 1k and 16k, the lengths of the correctness check
    included; the POLICY rows the candidates start from are POLICY's."""
    tool = _tool()
    assert tool.D96["block_m"] == 192 and tool.D96C["block_n"] == 128
    for (d, causal), rows in tool.CANDIDATES.items():
        assert 4 <= len(rows) <= 8, (d, causal)
        for name, (row, why) in rows.items():
            assert why and set(row) <= set(k6.BASE) | {"block_m", "block_n"}, name
            for n in (1000, 1024, 2048, 16384):
                settings = tool.candidate_settings(Problem(1, 16, n, d, causal), row)
                k6.FlashAttentionK6(d, causal, **settings)


@pytest.mark.parametrize("d, causal, name", [(96, False, "w112_turns"),
                                             (96, True, "c192x112_wg")])
def test_widest_candidates_compile_without_spills(d, causal, name):
    """192 x 112 at d = 96 on three warpgroups: S 56 + P 28 + O 48 of 160 registers."""
    from hopper_attn.harness.compile_report import compile_artifacts
    tool = _tool()
    art = compile_artifacts(tool.Candidate(name, tool.CANDIDATES[(d, causal)][name][0]), d,
                            causal, seqlen=4096)
    assert art["ok"], art.get("error")
