"""tools/fwd_dims_gpu_check.py (issues 63 and 61: k6's forward at d = 96, 192 and (d, dv) =
(192, 128)): every candidate
row builds a kernel k6 accepts at each length the GPU check times, and the widest tiles
among them compile for sm_90a without spills (the whole list: `--compile-only`)."""

import importlib.util
import pathlib

import pytest

from hopper_attn import k6

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
        assert 2 <= len(rows) <= 8, (d, causal)
        head_dim, head_dim_v = tool.dims_of(d)
        for name, (row, why) in rows.items():
            assert why and set(row) <= set(k6.BASE) | {"block_m", "block_n"}, name
            for n in (1000, 1024, 2048, 16384):
                problem = tool.make_problem(1, 16, n, d, causal)
                assert problem.head_dim_v == head_dim_v
                settings = tool.candidate_settings(problem, row)
                k6.FlashAttentionK6(head_dim, causal, head_dim_v=head_dim_v, **settings)


@pytest.mark.parametrize("d, causal, name", [(96, False, "w112_turns"),
                                             (96, True, "c192x112_wg")])
def test_widest_candidates_compile_without_spills(d, causal, name):
    """192 x 112 at d = 96 on three warpgroups: S 56 + P 28 + O 48 of 160 registers."""
    from hopper_attn.harness.compile_report import compile_artifacts
    tool = _tool()
    art = compile_artifacts(tool.Candidate(name, tool.CANDIDATES[(d, causal)][name][0]), d,
                            causal, seqlen=4096)
    assert art["ok"], art.get("error")


def test_eager_128x128_candidate_keeps_two_wgmma_groups():
    """(192, 128) causal on FA4's 128 x 128 tile with the PV wait after 7 exp2s: without the
    peeled first tile its steady loop issues QK and PV as one WGMMA group each (peeled, ptxas
    serializes every WGMMA), no spills, and no warp vote (eager: no lazy-rescale branch)."""
    from hopper_attn.harness.compile_report import compile_artifacts, sass
    from hopper_attn.harness.sass_order import loop_body, loops
    tool = _tool()
    row = tool.CANDIDATES[((192, 128), True)]["d192c_w128_eager_after7"][0]
    art = compile_artifacts(tool.Candidate("x", row), 192, True, seqlen=8192, head_dim_v=128)
    assert art["ok"], art.get("error")
    text = sass(art["cubin"])
    body = loop_body(text, max(loops(text), key=lambda lp: lp[1] - lp[0]))
    assert sum("WARPGROUP.ARRIVE" in ln for ln in body) == 2
    assert not any("VOTE" in ln for ln in body)
