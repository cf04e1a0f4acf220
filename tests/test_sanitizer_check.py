"""tools/sanitizer_gpu_check.py on the CPU: its case table resolves, every dense case to the
stages it means to sanitize (a forward stage and, with gradients, a backward one), none
refused (host checks only: no compile, no GPU)."""

import importlib.util
import pathlib
import sys

PATH = pathlib.Path(__file__).resolve().parents[1] / "tools" / "sanitizer_gpu_check.py"


def test_sanitizer_cases_resolve(capsys):
    spec = importlib.util.spec_from_file_location("sanitizer_gpu_check", PATH)
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool          # (its dataclasses look their module up)
    spec.loader.exec_module(tool)
    assert tool.main(["--list", "--plan"]) == 0
    listed = capsys.readouterr().out
    assert "REFUSED" not in listed and "decode_split_d128_gqa" in listed
    names = [c.name for c in tool.cases()]
    assert len(names) == len(set(names))
    regular = [c for c in tool.cases() if not c.probe]
    assert {c.group for c in regular if c.quick} == {c.group for c in regular}
    # probes (a known defect's evidence) only where named, and they resolve too
    probes = sorted({c.group for c in tool.cases() if c.probe})
    assert not any(p in listed for p in probes)
    assert tool.main(["--list", "--plan", "--cases", ",".join(probes)]) == 0
    assert "REFUSED" not in capsys.readouterr().out
