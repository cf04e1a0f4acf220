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

`decode` (not in the default list) has a grid of its own: decode shapes (1-16 queries, GQA,
both of its kv tiles, two M tiles), with and without sinks, then the kv_cache variant
(hopper_attn/kvcache.py) per head dim, mask, page size (0: contiguous) and tile, 16-bit and
e4m3 caches.
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


DECODE_SHAPES = ((1, 1, 32, 8, 8192), (16, 4, 64, 8, 16384), (64, 1, 32, 8, 4096),
                 (2, 16, 64, 8, 1000))     # (batch, seqlen_q, heads, kv heads, keys)
KVCACHE_PAGES = (0, 16, 64, 256)


def decode_items():
    """(key, compile thunk) for the decode stage and its kv_cache variant."""
    import torch
    for sinks in (0, 1):
        entry = registry.get("decode:sinks=1" if sinks else "decode")
        for dtype in entry.spec.dtypes:
            for d in entry.spec.head_dims:
                for causal in (False, True):
                    for b, nq, hq, hkv, nk in DECODE_SHAPES:
                        p = Problem(b, hq, nq, d, causal, dtype, heads_kv=hkv, seqlen_k=nk)
                        key = (f"decode{'+sinks' if sinks else ''}/{DTYPE_NAMES[dtype]}/d{d}/"
                               f"{'causal' if causal else 'full'}/B{b}q{nq}H{hq}:{hkv}k{nk}")
                        yield key, (lambda e=entry, p=p, o=None:
                                    e.compile(p, compile_options=o).compiled)
    from hopper_attn import decode, kvcache
    for d in (64, 128, 256):
        for causal in (False, True):
            for page in KVCACHE_PAGES:
                tiles = [(t, torch.bfloat16, None) for t in decode.TILES[d]]
                tiles += [(decode.TILES[d][0], torch.float16, None),
                          (decode.FP8_TILES[d], torch.bfloat16, kvcache.FP8)]
                for (bn, st), dtype, kv in tiles:
                    key = (f"kvcache/{DTYPE_NAMES[dtype]}{'/e4m3' if kv else ''}/d{d}/"
                           f"{'causal' if causal else 'full'}/page{page}/{bn}x{st}")
                    yield key, (lambda d=d, c=causal, t=dtype, pg=page, bn=bn, st=st, kv=kv,
                                o=None: kvcache.compile_kernel(d, c, t, pg, bn, st,
                                                               compile_options=o,
                                                               kv_dtype=kv)[0])


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
        t0, count = time.perf_counter(), 0
        if name == "decode":
            items = [(key, lambda f=f: f(o=opts)) for key, f in decode_items()]
        else:
            entry = registry.get(name)
            items = [(f"{name}/{suffix}", lambda e=entry, p=problem:
                      e.compile(p, compile_options=opts).compiled)
                     for suffix, problem in problems(entry.spec)]
        for key, compile_one in items:
            try:
                compiled = compile_one()
            except ValueError as exc:
                result[key] = f"unsupported: {exc}"
                continue
            except Exception:
                print(f"{key}: the compile failed", file=sys.stderr)
                raise
            ptx = compiled.__ptx__
            if not isinstance(ptx, str):
                raise RuntimeError("CuTe DSL did not return the PTX (--keep-ptx)")
            result[key] = hashlib.md5(
                stripped(ptx.rstrip("\0")).encode()).hexdigest()
            count += 1
        print(f"{name}: {count} configurations compiled in {time.perf_counter() - t0:.0f} s",
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
