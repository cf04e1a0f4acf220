"""The report regenerates docs/ and README.md from the committed results, and the docs render:
generated blocks up to date, relative links valid, images present and small."""

import os
import re
import shutil

from hopper_attn.harness import report

ROOT = report.ROOT
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_generated_blocks_are_up_to_date():
    assert report.render(check=True) == []


def test_report_runs_on_the_committed_results(tmp_path):
    shutil.copy(os.path.join(ROOT, "README.md"), tmp_path / "README.md")
    shutil.copytree(os.path.join(ROOT, "docs"), tmp_path / "docs", ignore=shutil.ignore_patterns("img"))
    changed = report.render(root=str(tmp_path), write_plots=True)
    assert changed == []                                   # same text as committed
    for img in ("h100_tflops_d128_full.png", "h100_tflops_d64_causal.png"):
        assert (tmp_path / "docs" / "img" / img).stat().st_size > 10_000


def test_relative_links_and_images_resolve():
    problems = []
    for path in report.markdown_files(ROOT):
        text = open(path).read()
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+://", target) or target.startswith("#"):
                continue
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), target.split("#")[0]))
            if not os.path.exists(resolved):
                problems.append(f"{os.path.relpath(path, ROOT)} -> {target}")
            elif resolved.endswith(".png") and os.path.getsize(resolved) > 300_000:
                problems.append(f"{target} is larger than 300 kB")
    assert not problems, problems


def test_every_docs_page_is_in_the_table_of_contents():
    toc = open(os.path.join(ROOT, "docs", "README.md")).read()
    for page in os.listdir(os.path.join(ROOT, "docs")):
        if page.endswith(".md") and page != "README.md":
            assert f"({page})" in toc, page
