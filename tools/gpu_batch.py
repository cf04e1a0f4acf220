"""Run several GPU check commands in one device call, under one time budget.

    source .gpu/prelude.sh && python tools/gpu_batch.py --deadline 540 \\
        "varlen_bwd:150:python tools/varlen_bwd_gpu_check.py --quick" \\
        "kvcache:150:python tools/kvcache_gpu_check.py --quick"

Each step is NAME:TIMEOUT:COMMAND (a shell command, run from the repo root with $OUT set to a
folder of its own, $OUT/batch/NAME, and the repo root on PYTHONPATH). A step starts only if at
least 20 s of the deadline (seconds from the start) are left, and gets at most what is left.
Printed: one header line per step (exit status, seconds) and the last lines of its output,
without the CuTe DSL's JIT warnings. At the end everything under $OUT/batch (each step's log
and files) is packed into one $OUT/batch.tar.xz, beside $OUT/batch.json (the steps' status):
the device returns at most 8 files from $OUT, so one archive keeps every step's JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time

NOISE = ("UserWarning", "exe_args", "warnings.warn", "generate_mlir_function_types")


def parse_step(text: str) -> tuple:
    """"name:timeout:command" -> (name, timeout seconds, command)."""
    name, timeout, command = text.split(":", 2)
    if not name or not all(c.isalnum() or c in "._-" for c in name):
        raise ValueError(f"step name {name!r}: letters, digits, '.', '_' and '-' only")
    return name, int(timeout), command


def tail(path: str, lines: int) -> list:
    with open(path, errors="replace") as f:
        kept = [ln.rstrip() for ln in f if ln.strip() and not any(n in ln for n in NOISE)]
    return [ln[:200] for ln in kept[-lines:]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("steps", nargs="+", help="NAME:TIMEOUT:COMMAND")
    ap.add_argument("--deadline", type=int, default=540, help="seconds for all steps")
    ap.add_argument("--tail", type=int, default=8, help="output lines printed per step")
    args = ap.parse_args(argv)
    steps = [parse_step(s) for s in args.steps]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = os.environ.get("OUT") or os.path.join(root, "batch_out")
    batch = os.path.join(out, "batch")
    os.makedirs(batch, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH"))
                                          if p))
    start, status = time.time(), []
    for name, timeout, command in steps:
        left = args.deadline - (time.time() - start)
        if left < 20:
            print(f"== {name}: skipped ({left:.0f} s left)", flush=True)
            status.append({"name": name, "command": command, "skipped": True})
            continue
        step_out = os.path.join(batch, name)
        os.makedirs(step_out, exist_ok=True)
        log = os.path.join(step_out, "log.txt")
        t0 = time.time()
        with open(log, "w") as f:
            # (a session of its own: a timeout kills the command's whole process group)
            proc = subprocess.Popen(command, shell=True, cwd=root, stdout=f,
                                    stderr=subprocess.STDOUT, env=dict(env, OUT=step_out),
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=min(timeout, left))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = "timeout"
        seconds = round(time.time() - t0, 1)
        print(f"== {name}: rc {rc}, {seconds} s", flush=True)
        for line in tail(log, args.tail):
            print("  " + line, flush=True)
        status.append({"name": name, "command": command, "rc": rc, "seconds": seconds})
    with open(os.path.join(out, "batch.json"), "w") as f:
        json.dump({"steps": status, "seconds": round(time.time() - start, 1)}, f, indent=1)
    with tarfile.open(os.path.join(out, "batch.tar.xz"), "w:xz") as tar:
        tar.add(batch, arcname="batch")
    shutil.rmtree(batch)
    return 0 if all(s.get("rc") == 0 for s in status) else 1


if __name__ == "__main__":
    sys.exit(main())
