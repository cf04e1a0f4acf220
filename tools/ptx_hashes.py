"""md5 of the PTX of every stage's default configuration over a grid of problems, to show
that a change to the code leaves the defaults' kernels as they were.

    python tools/ptx_hashes.py --out before.json [--stages k6,k7]
    python tools/ptx_hashes.py --compare before.json after.json

Each stage compiles with its defaults (no options) for each problem of the grid: the head
dims and dtypes its SPEC supports, causal off and on, the query lengths of SEQLENS, plus a
GQA problem (4 heads, 1 kv head) and a cross-length one (keys != queries). A problem the
stage refuses is recorded as "unsupported: <reason>" (a change of what is refused shows too).
k7 and k8 take bf16 problems and compile for their e4m3 inputs (SPEC.input_dtype). Run it
from a worktree's root: it imports `hopper_attn` from the current directory.

CuTe DSL 4.8.1's PTX carries no source line info (no `.loc` / `.file` lines, no `__debug_*`
sections); should a later version add it, those lines are dropped before hashing, since they
move with any edit. Kernel names stay in: they hold the module and class name
(`kernel_cutlass_kernel_hopper_attnk4FlashAttentionK4_...`), so renaming or moving a kernel
class changes the hash. Compiles go through the stages' own cache (one fixed
compile_options string), so problems that resolve to the same options compile once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.abspath(os.getcwd()))     # the worktree it runs in (its root)

from hopper_attn.common.contract import DTYPE_NAMES, Problem  # noqa: E402
from hopper_attn.harness import registry  # noqa: E402

STAGES = ("k4", "k5", "k6", "k7", "k8", "kb1", "kb2")
SEQLENS = (128, 1000, 1024, 1536, 2048, 3000, 4000, 4096, 8192, 16000, 16384)
_DEBUG_LINE = re.compile(r"^\s*(\.loc|\.file)\b")


def problems(spec):
    """(key suffix, Problem) for the grid of one stage."""
    for dtype in spec.dtypes:
        for d in spec.head_dims:
            for causal in (False, True):
                tag = f"{DTYPE_NAMES[dtype]}/d{d}/{'causal' if causal else 'full'}"
                for n in SEQLENS:
                    yield f"{tag}/n{n}", Problem(2, 2, n, d, causal, dtype)
                yield f"{tag}/gqa4:1/n2048", Problem(2, 4, 2048, d, causal, dtype, heads_kv=1)
                yield f"{tag}/cross/n1024:k3000", Problem(2, 2, 1024, d, causal, dtype,
                                                           seqlen_k=3000)


def stripped(ptx: str) -> str:
    """PTX without its line info (see the module doc)."""
    out, in_debug = [], False
    for line in ptx.splitlines():
        if line.lstrip().startswith(".section") and "__debug" in line:
            in_debug = True
        if in_debug:
            if line.strip() == "}":
                in_debug = False
            continue
        if not _DEBUG_LINE.match(line):
            out.append(line)
    return "\n".join(out)


def hash_stages(stages) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        here = os.getcwd()
        os.chdir(scratch)            # (--keep-ptx without --dump-dir writes files to the cwd)
        try:
            return _hash_stages(stages)
        finally:
            os.chdir(here)


def _hash_stages(stages) -> dict:
    result = {}
    opts = "--keep-ptx"          # without --dump-dir, __ptx__ is the text itself
    for name in stages:
        entry = registry.get(name)
        t0, count = time.perf_counter(), 0
        for suffix, problem in problems(entry.spec):
            try:
                handle = entry.compile(problem, compile_options=opts)
            except ValueError as exc:
                result[f"{name}/{suffix}"] = f"unsupported: {exc}"
                continue
            except Exception:
                print(f"{name}/{suffix}: the compile failed", file=sys.stderr)
                raise
            ptx = handle.compiled.__ptx__
            if not isinstance(ptx, str):
                raise RuntimeError("CuTe DSL did not return the PTX (--keep-ptx)")
            result[f"{name}/{suffix}"] = hashlib.md5(
                stripped(ptx.rstrip("\0")).encode()).hexdigest()
            count += 1
        print(f"{name}: {count} problems compiled in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)
    return result


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    same = [k for k in a if k in b and a[k] == b[k]]
    differ = [k for k in a if k in b and a[k] != b[k]]
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    print(f"{len(same)} identical, {len(differ)} differ, {len(only_a)} only in {a_path}, "
          f"{len(only_b)} only in {b_path}")
    for k in differ:
        print(f"  differs: {k}: {a[k][:60]} -> {b[k][:60]}")
    for label, keys in ((a_path, only_a), (b_path, only_b)):
        stages = sorted({k.split("/")[0] for k in keys})
        if keys:
            print(f"  only in {label}: {len(keys)} of stages {', '.join(stages)}")
    return 0 if not (differ or only_a or only_b) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write {key: md5} here (JSON)")
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    result = hash_stages([s for s in args.stages.split(",") if s])
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
