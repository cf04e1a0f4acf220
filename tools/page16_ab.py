"""Paged decode with 16-token pages against the contiguous cache (issue 62): correctness, then
a round-robin A/B with probes that say where page 16's loss comes from.

    python tools/page16_ab.py --quick        # correctness only (< 2 min)
    python tools/page16_ab.py                # correctness + the A/B (~3 min)
    python tools/page16_ab.py --no-correctness

Measured (H200, 2026-11-29, results/h200/2026-11-29_page16_two_producers.json.xz, which
also timed a two-producer loader, K and V from their own warps, since removed: 0.3-3.5%
slower than one warp): page 16 at 0.93-0.99 of the contiguous cache (B1 128k worst,
0.925), 128-token pages at 0.98-1.0; the table in memory order (p16-sorted) recovers part
of page 16's gap (B1 32k 0.970 against 0.956), so part of it is where the pages lie, the
rest the boxes; the 64 x 2 tile (p16-64x2, two CTAs per SM) measured 0.96-0.99
(docs/lab/kvcache.md, "Page 16").

Correctness: harness/kvcache_check.py's check (fp32 reference over the gathered cache, 2x
PyTorch's error, LSE, same bits twice, appends byte for byte) on shuffled page tables with
NaN in unused pages (and indices outside the cache), key counts 1, 17, 1000 and 32769 at
page 16 (and 32 / 64 / 128), GQA 32/8 and 64/8, d 128 and 64, fp16, 4 queries with
appends, forced splits.

A/B (one query, Hq 32 / Hkv 8, d 128, bf16, causal, every request at the full length; B1
32k, B1 128k, B8 32k, B64 4k), all in the same rounds (tools/decode_gpu_check.py's
round robin: each call alone after a sleep kernel, the next of enough cache copies to miss
the L2, medians of 30 rounds):
  contig       the contiguous cache (the target: page 16 at >= 0.95 of its speed)
  p16          16-token pages, shuffled table
  p128         128-token pages, shuffled
  probes (not options; same pools as p16, other tables or tiles):
  p16-sorted   the table in memory order: the same 32 boxes per tile, pages adjacent
  p16-runs8    runs of 8 adjacent pages (one 128-key tile each) in shuffled order: p128's
               memory locality with p16's boxes
  p16-64x6, contig-64x6  the kv tile 64 x 6 stages (same SMEM, one CTA per SM, 16 boxes a
               tile, a finer ring) instead of tile_for's choice
  p16-64x2, contig-64x2  64 x 2, two CTAs per SM (two producer warps per SM, 128 KiB in
               flight instead of 192) and twice the splits at B1
Reading: p16-sorted ~ contig -> the loss is where the pages lie (DRAM / TLB), not the
producer; p16-runs8 ~ p128 and p16 < p16-runs8 -> page scatter at 32 KiB granularity; p16 ~
p16-sorted < contig -> the boxes / the producer's issue (then p16-64x2 should gain);
p16-64x6 > p16 with contig-64x6 ~ contig -> the ring's granularity.
One line per shape (us and speed relative to contig); everything to $OUT/page16_ab.json.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import torch  # noqa: E402

SHAPES = [(1, 32768), (1, 131072), (8, 32768), (64, 4096)]
HQ, HKV, D = 32, 8, 128
L2_BYTES = 50e6


def cases() -> list:
    from hopper_attn.harness.kvcache_check import Case
    return [
        Case((1, 17, 1000, 32769), 32784, 16),
        Case((4095, 1, 17, 1000), 4096, 16, num_splits=7),
        Case((17, 1000, 1, 0), 1024, 16, seqlen_q=4, seqlen_new=3),
        Case((1, 17, 1000, 4095), 4096, 16, unused="far"),
        Case((1000, 17, 1), 2048, 16, heads=64, heads_kv=8, num_splits=1),
        Case((1, 17, 1000, 2047), 2048, 16, head_dim=64, dtype=torch.float16),
        Case((17, 1000, 4095), 4096, 16, causal=False),
        Case((1, 17, 1000, 4094), 4096, 32, seqlen_new=2),
        Case((1, 17, 1000, 4095), 4096, 64),
        Case((1, 17, 1000, 32769), 32896, 128),
    ]


def correctness() -> list:
    from hopper_attn.harness import kvcache_check as kc
    rows = []
    for i, case in enumerate(cases()):
        try:
            row = kc.check_case(case, seed=i)
        except Exception as exc:  # noqa: BLE001 - report and go on
            row = {"case": case.label(), "ok": False,
                   "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        rows.append(row)
        flags = "" if "error" in row else kc.failure_flags(row)
        print(f"{'ok  ' if row['ok'] else 'FAIL'} {row.get('ratio', float('nan')):4.2f} "
              f"{row['case']}{flags}{' ' + row['error'][:100] if 'error' in row else ''}",
              flush=True)
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    print(f"correctness: {sum(r['ok'] for r in rows)}/{len(rows)} pass, max error ratio "
          f"{max(ratios, default=float('nan')):.2f} (limit 2 + 2^-10 / torch error)")
    return rows


def _tables(batch: int, per: int, gen) -> dict:
    """Page tables over one pool of batch x per pages: shuffled, sorted, runs of 8."""
    pages = batch * per
    runs = torch.randperm(pages // 8, device="cuda", generator=gen).int()
    return {"shuffled": torch.randperm(pages, device="cuda", generator=gen).int().view(batch, per),
            "sorted": torch.arange(pages, device="cuda", dtype=torch.int32).view(batch, per),
            "runs8": (runs[:, None] * 8 + torch.arange(8, device="cuda", dtype=torch.int32)
                      ).flatten().view(batch, per)}


def _direct(q, k, v, seqlens, table, block_n: int, stages: int):
    """attention_with_kvcache's launch with a given kv tile (a probe: the API picks it)."""
    from hopper_attn import decode, kvcache
    from hopper_attn.common import cute_runtime as rt
    from hopper_attn.common.contract import LOG2_E
    page_size = k.shape[1] if table is not None else 0
    capacity = table.shape[1] * page_size if table is not None else k.shape[1]
    problem = kvcache.problem_for(q, k.shape[2], capacity, True)
    splits = decode.num_splits_for(problem, block_n, stages)
    tvm_ffi = rt.tvm_ffi_available()
    compiled, _ = kvcache.compile_kernel(D, True, q.dtype, page_size, block_n, stages, tvm_ffi)
    workspace = kvcache._workspace(problem, q.device, block_n, stages, splits)
    ones = kvcache._ones(q.device, q.shape[0], k.shape[2])
    table = table if table is not None else seqlens.view(-1, 1)
    scale = D ** -0.5 * LOG2_E

    def call():
        out = torch.empty_like(q)
        tensors = [q, k, v, out, *workspace, seqlens, table, ones, ones]
        if tvm_ffi:
            compiled(*tensors, scale)
        else:
            compiled(*kvcache._args(tensors, False), scale, rt.current_stream())
        return out
    return call, (block_n, stages, splits)


def _api(q, k, v, seqlens, table):
    from hopper_attn import kvcache

    def call():
        return kvcache.attention_with_kvcache(q, k, v, seqlens, page_table=table)
    return call


def benchmark() -> list:
    from decode_gpu_check import round_robin
    from hopper_attn import kvcache
    from hopper_attn.common.contract import Problem
    rows = []
    for batch, n in SHAPES:
        kv_bytes = 2 * batch * n * HKV * D * 2
        copies = max(2, math.ceil(2 * L2_BYTES / kv_bytes))
        gen = torch.Generator(device="cuda").manual_seed(batch * 7 + n)
        q = torch.randn(batch, 1, HQ, D, device="cuda", generator=gen).to(torch.bfloat16)
        seqlens = torch.full((batch,), n, dtype=torch.int32, device="cuda")

        def pool(rows_per_page):
            shape = (batch, n) if not rows_per_page else (batch * n // rows_per_page,
                                                           rows_per_page)
            k = torch.randn(*shape, HKV, D, device="cuda", generator=gen).to(torch.bfloat16)
            return k, torch.randn_like(k)
        contig = [pool(0) for _ in range(copies)]
        p16 = [(*pool(16), _tables(batch, n // 16, gen)) for _ in range(copies)]
        p128 = [(*pool(128), torch.randperm(batch * n // 128, device="cuda", generator=gen)
                 .int().view(batch, n // 128)) for _ in range(copies)]
        calls = {
            "contig": [_api(q, k, v, seqlens, None) for k, v in contig],
            "p16": [_api(q, k, v, seqlens, t["shuffled"]) for k, v, t in p16],
            "p128": [_api(q, k, v, seqlens, t) for k, v, t in p128],
            "p16-sorted": [_api(q, k, v, seqlens, t["sorted"]) for k, v, t in p16],
            "p16-runs8": [_api(q, k, v, seqlens, t["runs8"]) for k, v, t in p16],
        }
        plans = {}
        for label, kvs, tile in (("p16-64x6", p16, (64, 6)), ("contig-64x6", contig, (64, 6)),
                                 ("p16-64x2", p16, (64, 2)), ("contig-64x2", contig, (64, 2))):
            calls[label] = []
            for entry in kvs:
                call, plans[label] = _direct(q, entry[0], entry[1], seqlens,
                                             entry[2]["shuffled"] if len(entry) > 2 else None,
                                             *tile)
                calls[label].append(call)
        problem = Problem(batch, HQ, 1, D, True, torch.bfloat16, heads_kv=HKV, seqlen_k=n)
        plans["api"] = list(kvcache.plan(problem))
        plans["api_page16"] = list(kvcache.plan(problem, page_size=16))
        # the tile probes against the API's tile on the same table
        diffs = {}
        for a, b in (("p16-64x6", "p16"), ("contig-64x6", "contig"), ("p16-64x2", "p16")):
            try:
                diffs[a] = (calls[a][0]().float() - calls[b][0]().float()).abs().max().item()
            except Exception as exc:  # noqa: BLE001 - round_robin reports the variant too
                diffs[a] = f"{type(exc).__name__}: {str(exc)[:100]}"
        timed = round_robin(calls)
        us = {k: e["ms"] * 1e3 for k, e in timed.items() if "ms" in e}
        base = us.get("contig", float("nan"))
        print(f"B{batch} {n // 1024}k ({kv_bytes / 2**20:.0f} MiB, tile/stages/splits "
              f"{plans['api']}): " + " | ".join(
                  f"{name} {t:.1f} ({base / t:.3f}, {kv_bytes / t / 1e6:.2f} TB/s)"
                  for name, t in us.items()), flush=True)
        rows.append({"batch": batch, "seqlen_k": n, "heads": HQ, "heads_kv": HKV,
                     "head_dim": D, "kv_bytes": kv_bytes, "copies": copies, "plans": plans,
                     "max_diff": diffs, "timed": timed,
                     "speed_vs_contig": {k: base / t for k, t in us.items()}})
        del contig, p16, p128, calls
        torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="correctness only")
    parser.add_argument("--no-correctness", action="store_true")
    args = parser.parse_args()
    from hopper_attn.harness.env import environment
    from hopper_attn.harness.gpu_check import env_line, write_json
    env = environment()
    print(env_line(env))
    result = {"env": env}
    try:
        if not args.no_correctness:
            result["correctness"] = correctness()
        if not args.quick:
            result["benchmark"] = benchmark()
    except Exception:  # noqa: BLE001 - keep what was measured
        result["error"] = traceback.format_exc()
        print(result["error"][-1500:])
    path = write_json(result, "page16_ab.json", os.environ.get("OUT") or os.path.join(
        ROOT, "results"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
