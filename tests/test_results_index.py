"""results/ stays small enough to travel with the working tree (6 MB), and every file in it is
either cited by the project (README.md, docs/, code, tests, tools/) or listed in its index,
results/README.md. tools/results_index.py does the matching; run it to see which files fail."""

import importlib.util
import json
import lzma
import os

from hopper_attn.harness import report

_spec = importlib.util.spec_from_file_location(
    "results_index", os.path.join(report.ROOT, "tools", "results_index.py"))
results_index = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results_index)


def test_results_stay_under_6_mb():
    assert results_index.size() <= results_index.SIZE_LIMIT


def test_every_results_file_is_cited_or_indexed():
    files = results_index.results_files()
    cited = results_index.citations(files=files).cited
    listed = results_index.index_listed(files=files)
    assert [f for f in files if f not in cited and f not in listed] == []


def test_report_reads_a_compressed_json_by_its_plain_name(tmp_path):
    (tmp_path / "2026-01-01_bench_a.json").write_text(json.dumps({"rows": [1]}))
    with lzma.open(tmp_path / "2026-01-02_bench_b.json.xz", "wt") as f:
        json.dump({"rows": [2]}, f)
    found = report._glob(str(tmp_path), "*_bench_*.json")
    assert [os.path.basename(p) for p in found] == ["2026-01-01_bench_a.json",
                                                    "2026-01-02_bench_b.json"]
    assert [report._load(p)["rows"] for p in found] == [[1], [2]]


def test_the_checker_reads_the_citation_forms():
    files = ["results/h100/2026-11-26_k6_stream_k_d128.json.xz",
             "results/h100/2026-11-26_k6_stream_k_d64.json.xz",
             "results/h100/2026-11-26_k6_stream_k_d64_run2.json",
             "results/h100/2026-11-26_k6_peel_a.json", "results/h100/2026-11-25_k6_lta_d96.json",
             "results/h100/profiles/2026-11-26_ncusrc_fa4_d256.csv.xz",
             "results/h100/2026-11-26_sanitizer_k6.txt", "results/h100/2026-11-26_uncited.json"]
    c = results_index.Citations(files)
    c.scan("x.md", "Two runs (`results/h100/2026-11-26_k6_stream_k_d128.json`, `_d64.json`);\n"
                   "`results/h100/2026-11-26_k6_peel_*.json`, `_k6_lta_*.json`,\n"
                   "`results/h100/profiles/2026-11-26_ncu{,src}_{k6,fa4}_d256.csv.xz`\n\n"
                   "clean (`2026-11-26_sanitizer_k6`).")
    c.repeats()
    assert sorted(f for f in files if f not in c.cited) == ["results/h100/2026-11-26_uncited.json"]
