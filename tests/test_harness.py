"""Harness logic that needs no GPU: sweep, registry, reference, verdicts, naming."""

import math
import os
import sys

import pytest
import torch

from hopper_attn.harness import problems, reference, registry
from hopper_attn.harness.env import gpu_slug


def test_default_sweep_is_the_fa3_paper_sweep_plus_d256(monkeypatch):
    for var in ("SEQLEN", "HEADDIM", "CAUSAL", "DTYPE", "BATCH", "HEADS"):
        monkeypatch.delenv(var, raising=False)
    sweep = problems.sweep()
    assert len(sweep) == 6 * 3 * 2
    assert {p.head_dim for p in sweep} == {64, 128, 256}
    for p in sweep:
        assert p.batch * p.seqlen == 16384
        assert p.heads * p.head_dim == 2048
        assert p.seqlen in (512, 1024, 2048, 4096, 8192, 16384)
        assert p.dtype == torch.bfloat16


def test_dtype_env(monkeypatch):
    monkeypatch.setenv("SEQLEN", "1024")
    monkeypatch.setenv("HEADDIM", "64")
    monkeypatch.setenv("CAUSAL", "0")
    monkeypatch.setenv("DTYPE", "bf16,fp16")
    sweep = problems.sweep()
    assert [p.dtype for p in sweep] == [torch.bfloat16, torch.float16]
    assert problems.config_name(sweep[1]) == "b16_h32_n1024_d64_full_fp16"
    monkeypatch.setenv("DTYPE", "fp8")
    with pytest.raises(ValueError, match="DTYPE=bf16,fp16"):
        problems.sweep()


def test_env_narrows_the_sweep(monkeypatch):
    monkeypatch.setenv("SEQLEN", "4096,1000")
    monkeypatch.setenv("HEADDIM", "128")
    monkeypatch.setenv("CAUSAL", "1")
    monkeypatch.setenv("BATCH", "2")
    sweep = problems.sweep()
    assert [(p.seqlen, p.head_dim, p.causal, p.batch, p.heads) for p in sweep] == [
        (4096, 128, True, 2, 16), (1000, 128, True, 2, 16)]
    assert problems.config_name(sweep[0]) == "b2_h16_n4096_d128_causal"


def test_registry_variants_and_options():
    assert dict(registry.get("k3_3").options)["stages"] == 5
    named = dict(registry.get("k6:pv_wait=after7,tile=192x96,pingpong=0").options)
    assert named == {"pv_wait": "after7", "tile": "192x96", "pingpong": 0}
    entry = registry.get("k4:block_n=64,stages=3")
    assert entry.module == "hopper_attn.k4" and dict(entry.options) == {"block_n": 64, "stages": 3}
    with pytest.raises(ValueError, match="unknown stage 'k9'"):
        registry.get("k9")
    assert dict(registry.get("k6:pv_wait=late,tile=192x96").options) == {
        "pv_wait": "late", "tile": "192x96"}                   # named settings stay strings
    with pytest.raises(ValueError, match="unknown option"):
        registry.get("k4:no_such_option=1")
    with pytest.raises(ValueError, match="key=value"):
        registry.get("k4:block_n")


def _naive(q, k, v, causal):
    b, n, h, d = q.shape
    s = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) / math.sqrt(d)
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", torch.softmax(s, -1), v.double())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 17, 130])
def test_reference_matches_float64_formula(n, causal, monkeypatch):
    monkeypatch.setattr(reference, "_CHUNK_ELEMENTS", 2 * 3 * n * 5)   # force several chunks
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(2, n, 3, 32, generator=g).to(torch.bfloat16) for _ in range(3))
    got = reference.reference_attention(q, k, v, causal)
    want = _naive(q, k, v, causal)
    assert (got.double() - want).abs().max() < 1e-5


def test_judge_fails_nan_and_large_errors():
    ref = torch.ones(4)
    torch_err = {"max_abs": 0.01, "mean_abs": 0.001, "nan": 0}
    ok = reference.judge({"max_abs": 0.015, "mean_abs": 0.0, "nan": 0}, torch_err, ref)
    assert ok["ok"] and ok["error_ratio"] == pytest.approx(1.5)
    assert not reference.judge({"max_abs": 0.03, "mean_abs": 0.0, "nan": 0}, torch_err, ref)["ok"]
    assert not reference.judge({"max_abs": 0.0, "mean_abs": 0.0, "nan": 1}, torch_err, ref)["ok"]


def test_error_stats_counts_unwritten_nan():
    out = torch.zeros(3)
    out[1] = float("nan")
    stats = reference.error_stats(out, torch.zeros(3))
    assert stats["nan"] == 1 and math.isinf(stats["max_abs"])


def test_gpu_slug():
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_slug("NVIDIA H200") == "h200"
    assert gpu_slug(None) == "cpu"


def test_guarded_inputs_sit_between_nan_guards():
    from hopper_attn.common.contract import Problem
    from hopper_attn.harness.inputs import GUARD, guards_intact, make_inputs
    q, k, v, out, buffers = make_inputs(Problem(1, 2, 17, 64), 0, device="cpu", with_buffers=True)
    assert q.is_contiguous() and q.data_ptr() % 16 == 0
    assert not q.isnan().any() and out.isnan().all()
    assert all(guards_intact(b) for b in buffers)
    buffers[3][GUARD + out.numel()] = 0.0           # one element written past the end of out
    assert not guards_intact(buffers[3])


def test_bad_sweep_variables_are_reported(monkeypatch):
    monkeypatch.setenv("SEQLEN", "abc")
    with pytest.raises(ValueError, match="SEQLEN=1024,4096"):
        problems.sweep()


def test_an_empty_baseline_list_means_none():
    """`bench.py --baselines ''` times no baseline (an empty list used to mean all of them)."""
    from hopper_attn.harness import baselines
    assert baselines.available([]) == ({}, {})
    assert baselines.backward_available([]) == ({}, {})


def test_every_baseline_has_a_report_label():
    """Each forward baseline bench.py can time (fa4_no_overlap included: FA4 without its
    intra-warpgroup overlap, k5's design) gets a column label in the generated tables."""
    from hopper_attn.harness import baselines, report
    assert "fa4_no_overlap" in baselines.BASELINES
    assert set(baselines.BASELINES) <= set(report.BASELINE_LABEL)


def test_interleaved_rounds_vary_each_kernels_neighbour():
    """bench.py --interleave shuffles the order every round (seeded): a rotation kept each
    kernel's predecessor the same in every round, so one kernel always ran after the same
    other one (kb2 after FA4: docs/profiling.md)."""
    from hopper_attn.harness.timing import round_orders
    names = ["sdpa_flash", "sdpa_cudnn", "fa4", "kb2"]
    orders = round_orders(names, 100)
    assert all(sorted(o) == sorted(names) for o in orders)
    assert orders == round_orders(names, 100)                    # reproducible
    before_kb2 = {o[o.index("kb2") - 1] for o in orders if o.index("kb2") > 0}
    assert before_kb2 == {"sdpa_flash", "sdpa_cudnn", "fa4"}
    assert len({o.index("kb2") for o in orders}) == len(names)   # every position


def test_sass_order_reads_wgmma_groups_and_loops():
    """harness.sass_order on a hand-written SASS fragment: a group ends at the HGMMA with
    gsb0; the loop is the backward branch; exp2s between the waits are counted."""
    from hopper_attn.harness.sass_order import format_groups, loops, wgmma_groups
    text = """
.L_x_1:
        /*0100*/                   WARPGROUP.ARRIVE ;
        /*0110*/                   HGMMA.64x80x16.F32.BF16 R152, gdesc[UR8], RZ, !UPT ;
        /*0120*/                   HGMMA.64x80x16.F32.BF16 R152, gdesc[UR16], R152, gsb0 ;
        /*0130*/                   WARPGROUP.ARRIVE ;
        /*0140*/                   HGMMA.64x256x16.F32.BF16 R24, R192, gdesc[UR8].tnspB, R24, gsb0 ;
        /*0150*/                   WARPGROUP.ARRIVE ;
        /*0160*/                   HGMMA.64x256x16.F32.BF16 R24, R196, gdesc[UR16].tnspB, R24, gsb0 ;
        /*0170*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0180*/                   MUFU.EX2 R1, R1 ;
        /*0190*/                   MUFU.EX2 R2, R2 ;
        /*01a0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*01b0*/                   @P0 BRA `(.L_x_1) ;
"""
    groups = wgmma_groups(text)
    assert groups == [("ss", 80, 2), ("rs", 256, 1), ("rs", 256, 1)]
    assert format_groups(groups) == "ss N80: 2 | rs N256: 1 1"
    (start, end, events), = loops(text)
    assert (start, end) == (0x100, 0x1b0)
    assert events[-3:] == ["DEPBAR 0x1", "EX2 x2", "DEPBAR 0x0"]


def test_sass_order_finds_warpgroup_ops_under_a_warp_vote():
    """harness.sass_order.warpgroup_ops_under_warp_votes on k6's lazy rescale as it was (a
    WGMMA wait behind a branch on a per-warp vote) and as "lazy_after_wait" compiles (only
    multiplies behind it); the vote's predicate written again ends the search."""
    from hopper_attn.harness.sass_order import BARRIER_VOTE, warpgroup_ops_under_warp_votes
    text = """
        /*0100*/                   VOTE.ANY P0, P0 ;
        /*0110*/              @!P0 BRA `(.L_x_32) ;
        /*0120*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0130*/                   FMUL R24, R24, R8 ;
.L_x_32:
        /*0140*/                   VOTE.ANY P0, !P0 ;
        /*0150*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0160*/              @!P0 BRA `(.L_x_33) ;
        /*0170*/                   FMUL R24, R24, R8 ;
.L_x_33:
        /*0180*/                   VOTE.ALL P1, P1 ;
        /*0190*/                   FSETP.GEU.AND P1, PT, R2, R3, PT ;
        /*01a0*/              @!P1 BRA `(.L_x_34) ;
        /*01b0*/                   HGMMA.64x112x16.F32.BF16 R120, gdesc[UR16], RZ, !UPT ;
.L_x_34:
        /*01c0*/                   EXIT ;
"""
    found = warpgroup_ops_under_warp_votes(text)
    assert found == [(0x100, 0x110, [(0x120, "WARPGROUP.DEPBAR.LE gsb0, 0x0")]),
                     (0x140, 0x160, [])]
    # a branch on a warpgroup-wide barrier vote (bar.red.or.pred; k6's lazy_wg, not kept)
    barrier = """
        /*0100*/                   BAR.RED.OR.DEFER_BLOCKING R9, 0x80, P0 ;
        /*0110*/                   B2R.RESULT RZ, P0 ;
        /*0120*/              @!P0 BRA `(.L_x_24) ;
        /*0130*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
.L_x_24:
        /*0140*/                   EXIT ;
"""
    assert warpgroup_ops_under_warp_votes(barrier) == []
    assert warpgroup_ops_under_warp_votes(barrier, BARRIER_VOTE) == \
        [(0x110, 0x120, [(0x130, "WARPGROUP.DEPBAR.LE gsb0, 0x0")])]


def test_power_survey_summary():
    """harness/power.py: the benchmark's shapes, and nvidia-smi samples reduced to the
    medians of their settled part (the first third dropped, malformed lines skipped)."""
    from hopper_attn.harness.power import shape, summarize
    assert shape(16384, 128) == (1, 16) and shape(4096, 64) == (4, 32)
    assert shape(16384, 256) == (1, 8)
    hot = ["1650, 699.5, 0x0000000000000004", "1635, 700.1, 0x0000000000000004",
           "1665, 698.0, 0x0000000000000004"]
    out = summarize(["1980, 300.0, 0x0000000000000000"] * 3 + hot * 2 + ["[N/A]", ""])
    assert out["clock_mhz"] == 1650 and out["power_w"] == 699.5
    assert out["reasons"] == ["0x0000000000000004"] and out["samples"] == 6
    assert summarize([])["clock_mhz"] is None


def test_output_for_and_output_as_float():
    """The harness allocates what the compiled kernel writes: `out` itself for a 16-bit
    output, a NaN-poisoned e4m3 tensor of out's shape inside guards for k7:out_fp8=1, and
    reads an e4m3 output back through v's descale (k7.output_descale)."""
    import types
    from hopper_attn.harness.inputs import GUARD
    entry = registry.get("k7:out_fp8=1")
    out = torch.empty(2, 5, 4, 64, dtype=torch.bfloat16)
    plain = types.SimpleNamespace(spec=types.SimpleNamespace(output_dtype=None))
    assert entry.output_for(plain, out) is out
    fp8 = types.SimpleNamespace(spec=types.SimpleNamespace(output_dtype=torch.float8_e4m3fn))
    out8 = entry.output_for(fp8, out)
    assert out8.dtype == torch.float8_e4m3fn and out8.shape == out.shape
    raw = out8.view(torch.uint8)
    assert bool((raw == 0x7F).all())                           # e4m3's NaN, unwritten
    base = out8.untyped_storage().nbytes()
    assert base == out8.numel() + 2 * GUARD                    # guards on both sides
    values = torch.full(out.shape, 2.0).to(torch.float8_e4m3fn)
    descale_v = torch.tensor([[0.5, 0.25], [1.0, 2.0]])        # (batch, kv heads)
    got = entry.output_as_float(values, (None, None, descale_v))
    want = 2.0 * descale_v.repeat_interleave(2, dim=1)[:, None, :, None].expand(out.shape)
    assert torch.equal(got, want)
    assert torch.equal(entry.output_as_float(out.fill_(1.5), ()), out.float())


def test_gpu_batch_runs_steps_under_one_deadline(tmp_path, monkeypatch):
    """tools/gpu_batch.py: each step in its own $OUT folder, a timed-out step killed, every
    step's files packed into one archive beside a status JSON."""
    import importlib.util
    import json
    import tarfile
    spec = importlib.util.spec_from_file_location(
        "gpu_batch", os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools",
                                  "gpu_batch.py"))
    gpu_batch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_batch)
    monkeypatch.setenv("OUT", str(tmp_path))
    write = f"{sys.executable} -c \"import os; open(os.environ['OUT'] + '/r.json', 'w')\""
    rc = gpu_batch.main(["--deadline", "60", f"ok:20:{write}",
                         f"slow:1:{sys.executable} -c 'import time; time.sleep(30)'"])
    assert rc == 1
    status = json.load(open(tmp_path / "batch.json"))["steps"]
    assert [s["rc"] for s in status] == [0, "timeout"]
    with tarfile.open(tmp_path / "batch.tar.xz") as tar:
        assert "batch/ok/r.json" in tar.getnames()
    assert sorted(os.listdir(tmp_path)) == ["batch.json", "batch.tar.xz"]
    with pytest.raises(ValueError):
        gpu_batch.parse_step("bad/name:1:true")
    # lanes: the first step alone, then two at once on GPUs 0 and 1
    monkeypatch.setenv("OUT", str(tmp_path / "lanes"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    note = (f"{sys.executable} -c \"import os, time; t = time.time(); time.sleep(1); "
            f"open(os.environ['OUT'] + '/gpu', 'w').write("
            f"os.environ['CUDA_VISIBLE_DEVICES'] + ' %f %f' % (t, time.time()))\"")
    assert gpu_batch.main(["--gpus", "2", "--together", "1", f"all:20:{note}",
                           f"a:20:{note}", f"b:20:{note}"]) == 0
    with tarfile.open(tmp_path / "lanes" / "batch.tar.xz") as tar:
        seen = {n.split("/")[1]: tar.extractfile(n).read().decode().split()
                for n in tar.getnames() if n.endswith("/gpu")}
    assert seen["all"][0] == "0,1" and sorted([seen["a"][0], seen["b"][0]]) == ["0", "1"]
    (a0, a1), (b0, b1), (_, all1) = ([float(x) for x in seen[k][1:]] for k in "a b all".split())
    assert a0 < b1 and b0 < a1 and min(a0, b0) >= all1       # side by side, after "all"


def test_case_groups_report():
    """CaseGroups: seeds 1, 2, ...; an exception is a failed row; report prints one line per
    group and the failed rows' fields, and returns every row."""
    from hopper_attn.harness.gpu_check import CaseGroups

    def ok(x, seed):
        return {"case": [x, seed], "ok": True, "ratio": 0.5, "lse_ok": True}

    def broken(x, seed):
        raise RuntimeError("no kernel")

    cases, lines = CaseGroups(), []
    cases.run("a", ok, 1)
    cases.run("a", ok, 2)
    cases.run("b", broken, 3)
    rows = cases.report(lines.append, ("lse_ok",), extra=lambda g: f" ({len(g)})")
    assert [r["case"] for r in rows[:2]] == [[1, 1], [2, 2]] and len(rows) == 3
    assert "PASS (2)" in lines[0] and "FAIL (1)" in lines[1]
    assert "RuntimeError: no kernel" in lines[2] and "lse_ok None" in lines[2]
