"""What the GPU check scripts (tools/*_gpu_check.py) share: the line they open with (GPU,
driver and versions from `env.environment()`), a log that prints and keeps its lines for
the JSON, and the JSON itself, written under $OUT with the environment in it; and `run_check`, the main()
of a check made of a correctness part and a speed part."""

from __future__ import annotations

import argparse
import json
import math
import os
import time


def capture_graph(call):
    """`call()` captured into a CUDA graph on a side stream (the current stream waits for it
    both ways, as torch's capture requires): (graph, what the captured call returned). Run
    `call` once before (compiles and workspaces stay outside the capture)."""
    import torch
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            result = call()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, result


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


# k6's lazy rescales (d 192 / 256) round P to the input type before l's sums (l adds what
# the PV GEMM multiplies, so O / l is unaffected); each term's relative error is at most
# bf16's unit roundoff 2^-8 and the reference maximum may trail the true one, so no term is
# exact for sure: |LSE - ref| <= ln(1 + 2^-8) (rows that see few keys come nearest to it).
# A softcapped bf16 call at d 128 / 256 (exponents against a fixed 0) sums rounded P too.
# The eager loops (d <= 128): 1e-3.
ROUNDED_SUMS_LSE = math.log1p(2 ** -8)


def lse_bound(head_dim: int, softcap: float = 0.0) -> float:
    """The largest |LSE - fp32 reference| a forward check allows at this head dim."""
    return 1e-3 if head_dim <= 128 and not softcap else ROUNDED_SUMS_LSE


class CaseGroups:
    """Correctness cases of a GPU check, grouped by label: `run(label, fn, *args, **kwargs)`
    calls fn(*args, seed, **kwargs) with the next seed (1, 2, ...), which returns one row or a
    list of rows (each with "ok" and "ratio"); an exception is a failed row of its own."""

    def __init__(self):
        self.groups, self.seed = {}, 0

    def run(self, label, fn, *args, **kwargs):
        self.seed += 1
        try:
            found = fn(*args, self.seed, **kwargs)
        except Exception as exc:  # noqa: BLE001 - reported as a failure
            found = {"case": [label, *args], "ok": False, "ratio": float("inf"),
                     "exception": f"{type(exc).__name__}: {str(exc)[:200]}"}
        self.groups.setdefault(label, []).extend(found if isinstance(found, list) else [found])

    def report(self, log, fields=(), width=24, shown=6, extra=None) -> list:
        """`report_groups` of these groups."""
        return report_groups(self.groups, log, fields, width, shown, extra)


def report_groups(groups: dict, log, fields=(), width=24, shown=6, extra=None) -> list:
    """One line per group (cases, worst ratio, PASS / FAIL, then `extra(group)` if given),
    then up to `shown` failed rows with their ratio(s), exception and `fields` of the row;
    returns every row."""
    rows = []
    for label, group in groups.items():
        bad = [r for r in group if not r["ok"]]
        log(f"  {label:{width}} {len(group):3} cases, worst ratio "
            f"{max(r['ratio'] for r in group):.2f}  {'PASS' if not bad else 'FAIL'}"
            + (extra(group) if extra else ""))
        rows += group
    for row in [r for r in rows if not r["ok"]][:shown]:
        log(f"  FAILED {row['case']}: ratio {row.get('ratios', row['ratio'])} "
            f"{row.get('exception', '')[:90]} "
            + " ".join(f"{name} {row.get(name)}" for name in fields))
    return rows


def run_check(doc: str, json_name: str, correctness, speed, correctness_legend: str,
              speed_legend: str) -> int:
    """Parse --quick (correctness only), --speed-only and --out (default $OUT); print the environment;
    run `correctness(log)` (rows, each with "ok") and print the verdict; then, without
    --quick, `speed(log, t0)` (t0: the start, time.time()), whose failure is logged and
    recorded without losing the correctness rows; write it all, with the printed lines, to
    --out/json_name. Returns the exit status: 1 if a case failed."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="correctness only")
    parser.add_argument("--speed-only", action="store_true",
                        help="no correctness cases (after a --quick run of the same tree)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    from hopper_attn.harness.env import environment
    log = Log()
    env = environment()
    log(env_line(env))
    t0 = time.time()
    log(correctness_legend)
    checks = [] if args.speed_only else correctness(log)
    result = {"env": env, "correctness": checks, "all_pass": all(r["ok"] for r in checks)}
    log(f"correctness: {'ALL PASS' if result['all_pass'] else 'FAILURES'} "
        f"({len(checks)} cases, {time.time() - t0:.0f} s)")
    if not args.quick:
        log(speed_legend)
        try:
            result["speed"] = speed(log, t0)
        except Exception as exc:  # noqa: BLE001 - keep the correctness results
            log(f"  speed failed: {type(exc).__name__}: {str(exc)[:120]}")
            result["speed_error"] = repr(exc)
    result["printed"] = log.lines
    path = write_json(result, json_name, args.out)
    print(f"wrote {path} ({time.time() - t0:.0f} s)")
    return 0 if result["all_pass"] else 1
