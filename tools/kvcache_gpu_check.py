"""`attention_with_kvcache` on a GPU: correctness, then a decode sweep against FA4's paged
path and SDPA over a gathered cache.

    python tools/kvcache_gpu_check.py --quick        # correctness only (< 2 min)
    python tools/kvcache_gpu_check.py                # correctness + the sweep
    python tools/kvcache_gpu_check.py --no-correctness --shapes small
    python tools/kvcache_gpu_check.py --no-correctness --shapes small --fp8-tile 128x2
    python tools/kvcache_gpu_check.py --no-correctness --shapes small --bf16-tile 64x6
    python tools/kvcache_gpu_check.py --no-correctness --shapes small --sorted-pages
    python tools/kvcache_gpu_check.py --features --quick   # window / softcap / sinks (< 2 min)
    python tools/kvcache_gpu_check.py --features           # + their timing rows
    python tools/kvcache_gpu_check.py --fp8-speed          # e4m3 / bf16 speed (~1 min)
    python tools/kvcache_gpu_check.py --fp8-swap           # the swapped-operand e4m3 consumer
    python tools/kvcache_gpu_check.py --fp8-swap --quick   # its correctness only

Correctness: every case of hopper_attn/harness/kvcache_check.py's `quick_cases` (contiguous
and paged caches 16-256, shuffled page tables, NaN in unused pages and past the cache
lengths, lengths 0 .. capacity and at page and tile boundaries, 1 / 4 / 16 queries, GQA
32/8, d 128 and 64 (e4m3: and 256), appends across pages with every other cache byte
checked, forced split counts, out-of-cache indices in unused slots; fp32 reference over the gathered cache, 2x
PyTorch's error, LSE, same bits twice) and a CUDA graph capture + replay of one decode step.
One line per case; then whether NaN in unused page slots reaches the output, here and in
FA4's paged path (pages of 16, 64, 128).

Sweep (1 query, Hq 32 / Hkv 8, d 128, bf16, causal, every request at the full length):
this project's contiguous cache and paged caches of 16 and 128 tokens (shuffled tables),
FA4's `flash_attn_varlen_func` with `seqused_k` (contiguous) and `page_table` (16, 128),
SDPA over the cache gathered through the table (the gather timed with it) and SDPA over the
contiguous cache; and this project's e4m3 cache (the same values, half the bytes; TB/s of
the bytes it reads) in the three layouts. Round-robin timing as tools/decode_gpu_check.py
(each call alone after a sleep kernel, on the next of enough cache copies to exceed the
L2, medians of 30 rounds).
TB/s: K and V read once, 2 x B x Hkv x N x d x 2 bytes / time. `--fp8-tile NxS`: the e4m3
cache's kv tile and ring depth at d 128 for this run (decode.FP8_TILES; correctness runs
with it too), e.g. 128x2 against the default 64x7; `--bf16-tile NxS`: the one 16-bit tile
(decode.TILES) at d 128 for every shape (a probe of paged caches at B1: more, smaller
tiles in flight); `--sorted-pages`: page tables in memory order instead of shuffled (a
probe: whether a paged cache's loss at one request comes from where its pages lie or from
the boxes per tile).

`--features` (instead of the above): harness/kvcache_check.py's `feature_cases` (window_size
left 128 / 1000 with causal and (64, 32) without, softcap 30 / 50, sinks through the combine
and one split's fold, all three together; contiguous and 16-token pages, NaN in unused
pages, appends; the fp32 reference under the same masks, cap and sinks), then (not with
--quick) timing rows at B1 32k (Hq 32 / Hkv 8, d 128, causal, one query; contiguous and
16-token pages): no feature, window (4096, 0), softcap 30, sinks, the same round-robin.
`--fp8-speed` (instead of the above, no correctness: --quick has the e4m3 cases): the
bf16 and the e4m3 cache (the same values), contiguous, at B1 32k, B1 128k, B64 4k and
B256 4k (one query, Hq 32 / Hkv 8, d 128, causal), the same round-robin; e4m3 / bf16 speed.
`--fp8-swap` (instead of the above): the e4m3 consumer with swapped operands (the default
at d 128 with <= 32 packed rows; forced here with kvcache.FP8_CONSUMER = "swap",
hopper_attn/decode_fp8swap.py, docs/kvcache.md):
one-hot probes of its index maps (`swap_probe`: 16 packed rows, each attending to one key
of its own; which rows are wrong and whose V they got), then `swap_cases` (contiguous and 16 / 64 / 128-token pages, NaN in unused pages, odd and zero
key counts, 1-4 queries at group 4 and 4 queries at group 8 (8-32 packed rows), appends,
forced and automatic splits, causal and not, per-kv-head descales) checked as the quick
e4m3 cases are (fp32 reference over the dequantized cache, 2x the error of SDPA over it in
bf16 + 2^-10, LSE, same bits twice); then (not with --quick) the round-robin speed of the
bf16 cache, the current e4m3 loop ("widen") and the swapped one (3 stages, two CTAs per SM;
and "swap:6", 6 stages, one CTA per SM) at the four --fp8-speed shapes and B8 32k, and the largest
difference between the two e4m3 outputs.
Everything goes to $OUT/kvcache.json.
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

SHAPES = [(1, 1024), (1, 8192), (1, 32768), (1, 131072), (8, 8192), (8, 32768), (32, 4096),
          (32, 16384), (64, 4096), (64, 16384), (128, 2048), (128, 8192), (256, 1024),
          (256, 4096)]
SMALL = [(1, 32768), (1, 131072), (64, 4096), (256, 4096)]
HQ, HKV, D = 32, 8, 128
SORTED_PAGES = False        # --sorted-pages
L2_BYTES = 50e6


def correctness(features: bool = False) -> list:
    from hopper_attn.harness import kvcache_check as kc
    rows = []
    for i, case in enumerate(kc.feature_cases() if features else kc.quick_cases()):
        try:
            rows.append(kc.check_case(case, seed=i))
        except Exception as exc:  # noqa: BLE001 - report and go on
            rows.append({"case": case.label(), "ok": False,
                         "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        print(_line(rows[-1]), flush=True)
    if features:
        print(f"features: {sum(r['ok'] for r in rows)}/{len(rows)} pass")
        return rows
    try:
        rows.append(kc.check_graph())
    except Exception as exc:  # noqa: BLE001
        rows.append({"case": "graph", "ok": False,
                     "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    print(_line(rows[-1]), flush=True)
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    print(f"correctness: {sum(r['ok'] for r in rows)}/{len(rows)} pass, max error ratio "
          f"{max(ratios, default=float('nan')):.2f} (limit 2 + 2^-10 / torch error)")
    return rows


def _bf16_and_fp8_sets(batch, n):
    """One query per request, the key counts, and contiguous bf16 caches and their e4m3 copies
    (enough copies that two calls' K and V exceed 2x L2)."""
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + n)
    copies = max(2, math.ceil(2 * L2_BYTES / (2 * batch * n * HKV * D * 2)))
    q = torch.randn(batch, 1, HQ, D, device="cuda", generator=gen).to(torch.bfloat16)
    seqlens = torch.full((batch,), n, dtype=torch.int32, device="cuda")
    sets = [_caches(batch, n, 0, gen)[:2] for _ in range(copies)]
    return q, seqlens, sets, [(k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn))
                              for k, v in sets]


def fp8_speed() -> list:
    """--fp8-speed: the bf16 and the e4m3 cache, contiguous, on SMALL; e4m3 / bf16 speed."""
    from decode_gpu_check import round_robin
    from hopper_attn import attention_with_kvcache
    rows = []
    for batch, n in SMALL:
        q, seqlens, sets, sets8 = _bf16_and_fp8_sets(batch, n)
        timed = round_robin({name: [lambda k=k, v=v: attention_with_kvcache(q, k, v, seqlens)
                                    for k, v in kv] for name, kv in (("bf16", sets),
                                                                     ("fp8", sets8))})
        us = {k: e["ms"] * 1e3 for k, e in timed.items() if "ms" in e}
        ratio = us["bf16"] / us["fp8"] if len(us) == 2 else float("nan")
        print(f"B{batch} {n // 1024}k: bf16 {us.get('bf16', float('nan')):.1f} us | e4m3 "
              f"{us.get('fp8', float('nan')):.1f} us | e4m3 / bf16 speed {ratio:.2f}x",
              flush=True)
        rows.append({"batch": batch, "seqlen_k": n, "timed": timed, "fp8_over_bf16": ratio})
        del sets, sets8
        torch.cuda.empty_cache()
    return rows


def swap_cases() -> list:
    """The e4m3 cases for the swapped-operand consumer (d 128, at most 32 packed rows)."""
    from hopper_attn.harness.kvcache_check import Case
    return [
        Case((0, 1, 127, 128, 129, 1000, 1023, 1024), 1024, 0, fp8=True),
        Case((130, 190, 250, 700), 1024, 0, fp8=True, num_splits=3),
        Case((5, 300, 1000, 777), 1024, 16, seqlen_q=4, seqlen_new=4, fp8=True),
        Case(tuple(i * 97 % 1024 for i in range(20)), 1024, 64, seqlen_new=1, fp8=True),
        Case((3000, 8189, 4096, 1), 8192, 128, seqlen_q=2, seqlen_new=3, fp8=True),
        Case((1000, 2047, 15, 0), 2048, 16, seqlen_q=3, causal=False, fp8=True),
        Case((999, 4097, 33), 8192, 0, seqlen_q=4, heads=64, heads_kv=8, fp8=True),
        Case((777, 31, 2049), 4096, 128, heads=8, heads_kv=8, fp8=True, num_splits=1),
        Case((100001,), 131072, 0, fp8=True),
        Case((65, 4095, 17, 0), 4096, 16, seqlen_q=2, seqlen_new=1, fp8=True, unused="far"),
    ]


def swap_probe() -> list:
    """One-hot probes of the swapped consumer's index maps (a diagnosis where the cases
    fail): 4 queries x 4 heads of one kv head (16 packed rows), 128 keys, not causal; row
    (query i, head h) has q = e_(4i + h) and its own key k_ih with K[k_ih, 4i + h] = 448,
    every other K zero, so its output is V[k_ih] (to 1e-3: the other keys weigh 2^-57).
    Per probe: the rows whose output is not V[k_ih], and for the first such row the key
    whose V it is, and whether it is V[k_ih] with its d permuted."""
    from hopper_attn import attention_with_kvcache, kvcache
    f8 = torch.float8_e4m3fn
    gen = torch.Generator(device="cuda").manual_seed(3)
    n, queries, group = 128, 4, 4
    v = torch.randint(-8, 9, (1, n, 1, D), device="cuda", generator=gen).float()
    rows = []
    for shift in (0, 1, 5, 37):
        q = torch.zeros(1, queries, group, D, device="cuda")
        k = torch.zeros(1, n, 1, D, device="cuda")
        keys = {}
        for i in range(queries):
            for h in range(group):
                c = 4 * i + h
                keys[(i, h)] = (c * 7 + shift) % n
                q[0, i, h, c] = 1.0
                k[0, keys[(i, h)], 0, c] = 448.0
        kvcache.FP8_CONSUMER = "swap"
        try:
            out = attention_with_kvcache(q.to(torch.bfloat16), k.to(f8), v.to(f8),
                                         torch.full((1,), n, dtype=torch.int32,
                                                    device="cuda"), causal=False)[0, :, :, :]
        finally:
            kvcache.FP8_CONSUMER = "auto"
        out = out.float()
        wrong = [(i, h) for (i, h), kk in keys.items()
                 if not torch.allclose(out[i, h], v[0, kk, 0], atol=1e-3)]
        row = {"shift": shift, "wrong_rows": wrong}
        if wrong:
            i, h = wrong[0]
            got, want = out[i, h], v[0, keys[(i, h)], 0]
            row["nearest_key"] = int((v[0, :, 0] - got).abs().sum(-1).argmin())
            row["expected_key"] = keys[(i, h)]
            row["d_permuted"] = bool(torch.equal(got.sort().values, want.sort().values))
            row["sample"] = [got[:8].tolist(), want[:8].tolist()]
        print(f"swap probe shift {shift}: {16 - len(wrong)}/16 rows right"
              + (f"; row {wrong[0]} got key {row['nearest_key']}'s V (expected "
                 f"{row['expected_key']}), d permuted {row['d_permuted']}" if wrong else ""),
              flush=True)
        rows.append(row)
    return rows


def fp8_swap(quick: bool) -> dict:
    """--fp8-swap: one-hot probes and `swap_cases` with the swapped consumer; then e4m3
    speed, both loops."""
    from hopper_attn import kvcache
    from hopper_attn.harness import kvcache_check as kc
    result = {"correctness": []}
    try:
        result["probes"] = swap_probe()
    except Exception as exc:  # noqa: BLE001 - report and go on
        result["probes"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(f"swap probe FAILED: {result['probes'][:200]}", flush=True)
    rows = result["correctness"]
    kvcache.FP8_CONSUMER = "swap"
    try:
        for i, case in enumerate(swap_cases()):
            try:
                rows.append(kc.check_case(case, seed=100 + i))
            except Exception as exc:  # noqa: BLE001 - report and go on
                rows.append({"case": case.label(), "ok": False,
                             "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            print("swap " + _line(rows[-1]), flush=True)
    finally:
        kvcache.FP8_CONSUMER = "auto"
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    print(f"fp8 swap correctness: {sum(r['ok'] for r in rows)}/{len(rows)} pass, max error "
          f"ratio {max(ratios, default=float('nan')):.2f} (limit 2 + 2^-10 / torch error)")
    if not quick:
        result["speed"] = fp8_swap_speed()
    return result


def fp8_swap_speed() -> list:
    """bf16, e4m3 "widen" and e4m3 "swap" at SMALL, contiguous, round-robin."""
    from decode_gpu_check import round_robin
    from hopper_attn import attention_with_kvcache, kvcache

    def call(q, k, v, seqlens, consumer):
        kvcache.FP8_CONSUMER = consumer
        try:
            return attention_with_kvcache(q, k, v, seqlens)
        finally:
            kvcache.FP8_CONSUMER = "auto"

    rows = []
    for batch, n in SMALL + [(8, 32768)]:
        q, seqlens, sets, sets8 = _bf16_and_fp8_sets(batch, n)
        k8, v8 = sets8[0]
        diff = (call(q, k8, v8, seqlens, "swap").float()
                - call(q, k8, v8, seqlens, "widen").float()).abs().max().item()
        timed = round_robin({
            "bf16": [lambda k=k, v=v: call(q, k, v, seqlens, "widen") for k, v in sets],
            "widen": [lambda k=k, v=v: call(q, k, v, seqlens, "widen") for k, v in sets8],
            "swap": [lambda k=k, v=v: call(q, k, v, seqlens, "swap") for k, v in sets8],
            # (6 stages: one CTA per SM, the same 192 KiB in flight per SM)
            "swap:6": [lambda k=k, v=v: call(q, k, v, seqlens, "swap:6") for k, v in sets8]})
        us = {k: e["ms"] * 1e3 for k, e in timed.items() if "ms" in e}
        nan = float("nan")
        print(f"B{batch} {n // 1024}k: bf16 {us.get('bf16', nan):.1f} us | e4m3 widen "
              f"{us.get('widen', nan):.1f} | e4m3 swap {us.get('swap', nan):.1f} | swap / bf16 "
              f"speed {us.get('bf16', nan) / us.get('swap', nan):.2f}x, swap / widen "
              f"{us.get('widen', nan) / us.get('swap', nan):.2f}x | swap:6 (1 CTA/SM) "
              f"{us.get('swap:6', nan):.1f} | max |swap - widen| {diff:.1e}", flush=True)
        rows.append({"batch": batch, "seqlen_k": n, "timed": timed, "swap_minus_widen": diff,
                     "plan_swap": _swap_plan(batch, n)})
        del sets, sets8
        torch.cuda.empty_cache()
    return rows


def _swap_plan(batch: int, n: int) -> list:
    from hopper_attn import kvcache
    from hopper_attn.common.contract import Problem
    kvcache.FP8_CONSUMER = "swap"
    try:
        return list(kvcache.plan(Problem(batch, HQ, 1, D, True, torch.bfloat16, heads_kv=HKV,
                                         seqlen_k=n), 0, True))
    finally:
        kvcache.FP8_CONSUMER = "auto"


def nan_probe() -> list:
    """FA4's paged path and this one on caches whose unused page slots hold NaN (the
    issue's anchor failure: FA4 with 128-token pages), one line per page size."""
    from hopper_attn.harness import kvcache_check as kc
    rows = []
    for ps in (16, 64, 128):
        case = kc.Case((100, 1000, 129, 1), 1024, ps)
        i = kc.make_case(case, "cuda", seed=ps)
        row = {"page_size": ps}
        try:
            out = kc._call(i, case)[0]
            row["ours_nan"] = bool(out.isnan().any().item())
        except Exception as exc:  # noqa: BLE001
            row["ours_error"] = f"{type(exc).__name__}: {str(exc)[:100]}"
        try:
            from flash_attn.cute.interface import flash_attn_varlen_func
            out = flash_attn_varlen_func(i["q"], i["k_cache"], i["v_cache"],
                                         seqused_k=i["cache_seqlens"],
                                         page_table=i["page_table"], causal=True)
            out = out[0] if isinstance(out, tuple) else out
            row["fa4_nan"] = bool(out.isnan().any().item())
        except Exception as exc:  # noqa: BLE001
            row["fa4_error"] = f"{type(exc).__name__}: {str(exc)[:100]}"
        verdict = {who: ("NaN" if row[f"{who}_nan"] else "clean") if f"{who}_nan" in row
                   else row.get(f"{who}_error", "")[:60] for who in ("ours", "fa4")}
        print(f"NaN in unused page slots, page {ps}: ours {verdict['ours']}, FA4 "
              f"{verdict['fa4']}", flush=True)
        rows.append(row)
    return rows


def _line(r: dict) -> str:
    if "error" in r:
        return f"FAIL {r['case']}: {r['error'][:100]}"
    if "ratio" not in r:
        return f"{'ok  ' if r['ok'] else 'FAIL'} {r['case']}"
    from hopper_attn.harness.kvcache_check import failure_flags
    flags = failure_flags(r)
    bn, st, splits = r["plan"]
    return (f"{'ok  ' if r['ok'] else 'FAIL'} {r['ratio']:4.2f} {bn}x{st} s{splits:<3d} "
            f"{r['case']}{flags}")


def _caches(batch: int, n: int, page_size: int, gen):
    """k, v (contiguous, or a page pool with a shuffled table), the table."""
    if not page_size:
        k = torch.randn(batch, n, HKV, D, device="cuda", generator=gen).to(torch.bfloat16)
        return k, torch.randn_like(k), None
    per = -(-n // page_size)
    pages = batch * per
    k = torch.randn(pages, page_size, HKV, D, device="cuda", generator=gen).to(torch.bfloat16)
    perm = torch.randperm(pages, device="cuda", generator=gen).int()
    if SORTED_PAGES:            # (a probe: page order in memory vs TMA boxes per tile)
        perm = torch.arange(pages, device="cuda", dtype=torch.int32)
    return k, torch.randn_like(k), perm.view(batch, per)


def _calls(batch: int, n: int, copies: int):
    """name -> list of calls over the copies, the reference output (SDPA, contiguous)."""
    import torch.nn.functional as F
    from hopper_attn import attention_with_kvcache
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + n)
    q = torch.randn(batch, 1, HQ, D, device="cuda", generator=gen).to(torch.bfloat16)
    seqlens = torch.full((batch,), n, dtype=torch.int32, device="cuda")
    qt = q.transpose(1, 2)
    sets = {ps: [_caches(batch, n, ps, gen) for _ in range(copies)] for ps in (0, 16, 128)}
    calls, outputs, sets8 = {}, {}, {}

    def gather(cache, table):
        return cache[table.long()].flatten(1, 2)[:, :n]

    for ps, label in ((0, "contig"), (16, "p16"), (128, "p128")):
        calls[label] = [lambda k=k, v=v, t=t: attention_with_kvcache(q, k, v, seqlens,
                                                                      page_table=t)
                        for k, v, t in sets[ps]]
        # the same values in e4m3 (|x| < 6: descale 1), half the bytes
        sets8[ps] = [(k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), t)
                     for k, v, t in sets[ps]]
        calls["fp8-" + label] = [lambda k=k, v=v, t=t: attention_with_kvcache(
            q, k, v, seqlens, page_table=t) for k, v, t in sets8[ps]]
        if ps:
            calls[f"sdpa-g{ps}"] = [
                lambda k=k, v=v, t=t: F.scaled_dot_product_attention(
                    qt, gather(k, t).transpose(1, 2), gather(v, t).transpose(1, 2),
                    enable_gqa=True)
                for k, v, t in sets[ps]]
    calls["sdpa"] = [lambda k=k, v=v: F.scaled_dot_product_attention(
        qt, k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True) for k, v, _ in sets[0]]
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func
        for ps, label in ((0, "fa4"), (16, "fa4-p16"), (128, "fa4-p128")):
            calls[label] = [lambda k=k, v=v, t=t: flash_attn_varlen_func(
                q, k, v, seqused_k=seqlens, page_table=t, causal=True)
                for k, v, t in sets[ps]]
    except Exception as exc:  # noqa: BLE001 - FA4 absent: say so
        for label in ("fa4", "fa4-p16", "fa4-p128"):
            calls[label] = f"{type(exc).__name__}: {str(exc)[:100]}"
    # outputs of the first copy, each against SDPA on its own (gathered) cache
    for ps, labels, kvs in ((0, ("contig", "fa4"), sets[0]), (16, ("p16", "fa4-p16"), sets[16]),
                            (128, ("p128", "fa4-p128"), sets[128]),
                            (0, ("fp8-contig",), sets8[0]), (16, ("fp8-p16",), sets8[16]),
                            (128, ("fp8-p128",), sets8[128])):
        k, v, t = (x.to(torch.bfloat16) if x is not None and x.dtype != torch.int32 else x
                   for x in kvs[0])
        ref = F.scaled_dot_product_attention(
            qt, (gather(k, t) if ps else k).transpose(1, 2),
            (gather(v, t) if ps else v).transpose(1, 2), enable_gqa=True).transpose(1, 2)
        for label in labels:
            if isinstance(calls[label], str):
                continue
            try:
                out = calls[label][0]()
                out = out[0] if isinstance(out, tuple) else out
                outputs[label] = (out.float() - ref.float()).abs().max().item()
            except Exception as exc:  # noqa: BLE001
                calls[label] = f"{type(exc).__name__}: {str(exc)[:100]}"
    return calls, outputs


def benchmark(shapes) -> list:
    from decode_gpu_check import round_robin
    rows = []
    print("shape: name us TB/s ... || fp8/bf16 per layout, p16/contig p128/contig, "
          "best(fa4-pX, sdpa-gX)/pX")
    for batch, n in shapes:
        kv_bytes = 2 * batch * n * HKV * D * 2
        copies = max(2, math.ceil(2 * L2_BYTES / kv_bytes))
        row = {"batch": batch, "seqlen_k": n, "heads": HQ, "heads_kv": HKV, "head_dim": D,
               "kv_bytes": kv_bytes, "copies": copies}
        try:
            calls, diffs = _calls(batch, n, copies)
            timed = round_robin(calls)
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"B{batch} {n // 1024}k: FAILED {row['error'][:100]}")
            rows.append(row)
            torch.cuda.empty_cache()
            continue
        for name, entry in timed.items():
            if "ms" in entry:       # (e4m3: the bytes it reads, half)
                read = kv_bytes / 2 if name.startswith("fp8") else kv_bytes
                entry["tb_s"] = read / (entry["ms"] * 1e-3) / 1e12
            if name in diffs:
                entry["max_diff_vs_sdpa"] = diffs[name]
        row["timed"] = timed
        us = {k: e["ms"] * 1e3 for k, e in timed.items() if "ms" in e}
        cells = [f"{k} {us[k]:.1f} {timed[k]['tb_s']:.2f}" for k in timed if k in us]
        ratios = {}
        for label in ("contig", "p16", "p128"):
            if label in us and "fp8-" + label in us:
                ratios[f"fp8/{label}"] = us[label] / us["fp8-" + label]
        for ps in (16, 128):
            mine = us.get(f"p{ps}")
            if mine and "contig" in us:
                ratios[f"p{ps}/contig"] = us["contig"] / mine
            others = [us[k] for k in (f"fa4-p{ps}", f"sdpa-g{ps}") if k in us]
            if mine and others:
                ratios[f"best/p{ps}"] = min(others) / mine
        row["ratios"] = ratios
        wrong = [k for k, d in diffs.items() if d > 0.02]
        print(f"B{batch} {n // 1024}k: " + " | ".join(cells) + "  || "
              + " ".join(f"{k} {v:.2f}" for k, v in ratios.items())
              + (f"  WRONG? {wrong}" if wrong else ""), flush=True)
        rows.append(row)
        del calls
        torch.cuda.empty_cache()
    return rows


def feature_timing(batch: int = 1, n: int = 32768) -> list:
    """B1 32k, one query: each layout without a feature, with window (4096, 0), softcap 30
    and sinks; us and the window's gain (time without / with)."""
    from decode_gpu_check import round_robin
    from hopper_attn import attention_with_kvcache
    gen = torch.Generator(device="cuda").manual_seed(5)
    kv_bytes = 2 * batch * n * HKV * D * 2
    copies = max(2, math.ceil(2 * L2_BYTES / kv_bytes))
    q = torch.randn(batch, 1, HQ, D, device="cuda", generator=gen).to(torch.bfloat16)
    seqlens = torch.full((batch,), n, dtype=torch.int32, device="cuda")
    sinks = torch.randn(HQ, device="cuda", generator=gen)
    features = {"": {}, "window4096": {"window_size": (4096, 0)}, "cap30": {"softcap": 30.0},
                "sinks": {"sinks": sinks}}
    rows = []
    for ps, label in ((0, "contig"), (16, "p16")):
        sets = [_caches(batch, n, ps, gen) for _ in range(copies)]
        calls = {f"{label} {name}".strip(): [
            lambda k=k, v=v, t=t, kw=kw: attention_with_kvcache(q, k, v, seqlens,
                                                                page_table=t, **kw)
            for k, v, t in sets] for name, kw in features.items()}
        timed = round_robin(calls)
        us = {k: e["ms"] * 1e3 for k, e in timed.items() if "ms" in e}
        gain = us.get(label, float("nan")) / us.get(f"{label} window4096", float("nan"))
        print(f"B{batch} {n // 1024}k {label}: " + " | ".join(f"{k} {v:.1f} us"
                                                             for k, v in us.items())
              + f"  || no window / window4096 {gain:.2f}x", flush=True)
        rows.append({"batch": batch, "seqlen_k": n, "page_size": ps, "timed": timed,
                     "window_gain": gain})
        del sets, calls
        torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="correctness only")
    parser.add_argument("--no-correctness", action="store_true")
    parser.add_argument("--shapes", choices=("all", "small"), default="all")
    parser.add_argument("--fp8-tile", default="", help="e4m3 cache tile at d 128, e.g. 128x2")
    parser.add_argument("--bf16-tile", default="", help="16-bit tile at d 128, e.g. 64x6")
    parser.add_argument("--sorted-pages", action="store_true", help="unshuffled page tables")
    parser.add_argument("--features", action="store_true",
                        help="window / softcap / sinks cases (and timing rows) instead")
    parser.add_argument("--fp8-speed", action="store_true",
                        help="e4m3 / bf16 cache speed at four shapes, instead")
    parser.add_argument("--fp8-swap", action="store_true",
                        help="the swapped-operand e4m3 consumer: its cases and speed, instead")
    args = parser.parse_args()
    global SORTED_PAGES
    SORTED_PAGES = args.sorted_pages
    from hopper_attn import decode
    from hopper_attn.harness.env import environment
    from hopper_attn.harness.gpu_check import env_line, write_json
    if args.fp8_tile:
        block_n, stages = (int(x) for x in args.fp8_tile.split("x"))
        decode.FP8_TILES[D] = (block_n, stages)
    if args.bf16_tile:
        block_n, stages = (int(x) for x in args.bf16_tile.split("x"))
        decode.TILES[D] = [(block_n, stages)]
    env = environment()
    print(env_line(env) + f" fp8 tile {decode.FP8_TILES[D]} 16-bit tiles {decode.TILES[D]}")
    result = {"env": env, "fp8_tile_d128": list(decode.FP8_TILES[D]),
              "sorted_pages": SORTED_PAGES,
              "tiles_d128": [list(t) for t in decode.TILES[D]]}
    try:
        if args.fp8_swap:
            result["fp8_swap"] = fp8_swap(args.quick)
        elif args.fp8_speed:
            result["fp8_speed"] = fp8_speed()
        elif args.features:
            result["features"] = correctness(features=True)
            if not args.quick:
                result["feature_timing"] = feature_timing()
        elif not args.no_correctness:
            result["correctness"] = correctness()
            result["nan_probe"] = nan_probe()
        if not args.quick and not args.features and not args.fp8_speed and not args.fp8_swap:
            result["benchmark"] = benchmark(SMALL if args.shapes == "small" else SHAPES)
    except Exception:  # noqa: BLE001 - keep what was measured
        result["error"] = traceback.format_exc()
        print(result["error"][-1500:])
    path = write_json(result, "kvcache.json", os.environ.get("OUT") or os.path.join(ROOT,
                                                                                   "results"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
