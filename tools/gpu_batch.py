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

On a host with several GPUs, `--gpus N` runs the steps in N lanes at once, lane k with
CUDA_VISIBLE_DEVICES=k, each taking the next step in order when its last one ends (single-GPU
checks: N times the checks per device second). `--together K` first runs the first K steps
alone with every GPU visible (torchrun jobs; timings that must not share the host). A
step's lines print when it ends, prefixed with its lane.
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
import threading
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


def run_step(step, root, batch, env, left, tail_lines, lane, lock) -> dict:
    """One step in its own $OUT folder and process group, killed at min(timeout, left)."""
    name, timeout, command = step
    prefix = "" if lane is None else f"[gpu {lane}] "
    if left < 20:
        with lock:
            print(f"== {prefix}{name}: skipped ({left:.0f} s left)", flush=True)
        return {"name": name, "command": command, "skipped": True}
    step_out = os.path.join(batch, name)
    os.makedirs(step_out, exist_ok=True)
    log = os.path.join(step_out, "log.txt")
    step_env = dict(env, OUT=step_out)
    if lane is not None:
        step_env["CUDA_VISIBLE_DEVICES"] = str(lane)
    t0 = time.time()
    with open(log, "w") as f:
        # (a session of its own: a timeout kills the command's whole process group)
        proc = subprocess.Popen(command, shell=True, cwd=root, stdout=f,
                                stderr=subprocess.STDOUT, env=step_env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=min(timeout, left))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    seconds = round(time.time() - t0, 1)
    with lock:
        print(f"== {prefix}{name}: rc {rc}, {seconds} s", flush=True)
        for line in tail(log, tail_lines):
            print("  " + line, flush=True)
    return {"name": name, "command": command, "rc": rc, "seconds": seconds,
            **({} if lane is None else {"gpu": lane})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("steps", nargs="+", help="NAME:TIMEOUT:COMMAND")
    ap.add_argument("--deadline", type=int, default=540, help="seconds for all steps")
    ap.add_argument("--tail", type=int, default=8, help="output lines printed per step")
    ap.add_argument("--gpus", type=int, default=1, help="lanes, one GPU each")
    ap.add_argument("--together", type=int, default=0,
                    help="the first K steps run alone, every GPU visible")
    args = ap.parse_args(argv)
    steps = [parse_step(s) for s in args.steps]
    if len({name for name, _, _ in steps}) != len(steps):
        raise ValueError("step names must differ (each gets its own $OUT folder)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = os.environ.get("OUT") or os.path.join(root, "batch_out")
    batch = os.path.join(out, "batch")
    os.makedirs(batch, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH"))
                                          if p))
    start, lock = time.time(), threading.Lock()
    status = {}

    def left():
        return args.deadline - (time.time() - start)

    together = steps[:args.together] if args.gpus > 1 else steps
    for step in together:
        status[step[0]] = run_step(step, root, batch, env, left(), args.tail, None, lock)
    queue = list(steps[len(together):])

    def lane(k):
        while True:
            with lock:
                if not queue:
                    return
                step = queue.pop(0)
            status[step[0]] = run_step(step, root, batch, env, left(), args.tail, k, lock)

    lanes = [threading.Thread(target=lane, args=(k,)) for k in range(args.gpus)]
    for t in lanes:
        t.start()
    for t in lanes:
        t.join()
    ordered = [status[name] for name, _, _ in steps]
    with open(os.path.join(out, "batch.json"), "w") as f:
        json.dump({"steps": ordered, "seconds": round(time.time() - start, 1),
                   "gpus": args.gpus}, f, indent=1)
    with tarfile.open(os.path.join(out, "batch.tar.xz"), "w:xz") as tar:
        tar.add(batch, arcname="batch")
    shutil.rmtree(batch)
    return 0 if all(s.get("rc") == 0 for s in ordered) else 1


if __name__ == "__main__":
    sys.exit(main())
