"""Chunked prefill through `attention_with_kvcache` on a GPU: correctness, then speed against
FA4's `flash_attn_varlen_func` over the same cache.

    python tools/prefill_gpu_check.py --quick          # correctness only (< 2 min)
    python tools/prefill_gpu_check.py                  # correctness + speed
    python tools/prefill_gpu_check.py --speed-only     # speed only

Correctness (one line per case): contiguous caches and paged ones (16, 32, 64, 128, 256;
shuffled page tables), every cache row past a request's keys and every unused page NaN
(harness/kvcache_check.py's `make_case`); 17, 113 and 500 new queries per request (the
dense (batch, seqlen_q) form, with appends of the chunk's own keys across pages) and varlen
query batches (q (total_q, H, d) + cu_seqlens_q, unequal chunks, some empty, the keys
already in the cache); cache lengths 0 .. a few thousand, at page and tile boundaries;
GQA 32/8 and MHA 8/8, d 64 and 128, bf16 and fp16, a sliding window, softcap, sinks; a CUDA
graph capture + replay with new lengths and tables. Checked: the output free of NaN (its
memory NaN-filled before each call), error against an fp32 reference over the gathered
cache at most 2x PyTorch's own (SDPA in q's dtype on the same keys; with softcap or sinks
an eager computation in q's dtype) + 2^-10, the LSE within 1e-3 (-inf where a query sees
no key), the same bits on a second call, every cache byte after the append as expected.

Speed (skipped with --quick): a few hundred new queries per request over long caches
(B 4 / 16, 256 / 512 queries, caches 8k / 32k keys, Hq 32 / Hkv 8, d 128, bf16, causal),
the cache contiguous and paged 16 and 128 (shuffled tables), this project's call against
FA4's flash_attn_varlen_func (seqused_k, page_table; q as (batch, seqlen_q, ...) and, as
"fa4-cu", packed with cu_seqlens_q as vLLM calls it) on the same tensors,
timed round-robin with CUDA events and the L2 flushed before every call
(harness/timing.benchmark_interleaved), medians; TFLOP/s of the causal work (4 x queries x
keys seen x d x Hq per request) and FA4's time over ours. Ours twice: k6's POLICY row
picked by the query length ("ours", kvcache.PREFILL_POLICY_BY = "queries") and by the
cache's ("ours-keysrow", "keys"; ours/keysrow > 1: the keys' row is faster); the default
("measured") takes the keys' row for contiguous caches and pages >= 128.
Everything goes to $OUT/prefill.json (or --out).
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from hopper_attn.harness.prefill_check import (  # noqa: E402
    BF16, cases, check, check_graph)


def _line(r: dict) -> str:
    if "error" in r:
        return f"FAIL {r['case']}: {r['error'][:120]}"
    if "ratio" not in r:
        return f"{'ok  ' if r['ok'] else 'FAIL'} {r['case']}"
    from hopper_attn.harness.kvcache_check import failure_flags
    flags = failure_flags(r)
    return f"{'ok  ' if r['ok'] else 'FAIL'} {r['ratio']:4.2f} {r['case']}{flags}"


def correctness(log, quick: bool = True) -> list:
    rows = []
    for n, case in enumerate(cases(quick)):
        try:
            rows.append(check(case, seed=n))
        except Exception as exc:  # noqa: BLE001 - report and go on
            rows.append({"case": case.label(), "ok": False,
                         "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        log(_line(rows[-1]))
    try:
        rows.append(check_graph())
    except Exception as exc:  # noqa: BLE001
        rows.append({"case": "graph", "ok": False,
                     "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    log(_line(rows[-1]))
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    log(f"max error ratio {max(ratios, default=float('nan')):.2f} (limit 2 + 2^-10 / torch "
        f"error)")
    return rows


# ------------------------------------------------------------------ speed

SPEED_SHAPES = [(4, 256, 8192), (4, 512, 32768), (16, 256, 8192), (16, 512, 8192),
                (16, 256, 32768), (4, 512, 8192)]
HQ, HKV, D = 32, 8, 128


def _cache(batch: int, keys: int, page_size: int, gen):
    """k, v (contiguous (batch, keys, Hkv, d), or a page pool with a shuffled table)."""
    if not page_size:
        k = torch.randn(batch, keys, HKV, D, device="cuda", generator=gen).to(BF16)
        return k, torch.randn_like(k), None
    per = -(-keys // page_size)
    k = torch.randn(batch * per, page_size, HKV, D, device="cuda", generator=gen).to(BF16)
    table = torch.randperm(batch * per, device="cuda", generator=gen).int().view(batch, per)
    return k, torch.randn_like(k), table


def _ours(q, k, v, seqlens, table, policy_by: str):
    """attention_with_kvcache with k6's POLICY row picked by the query length or by the
    cache's (kvcache.PREFILL_POLICY_BY)."""
    from hopper_attn import attention_with_kvcache, kvcache
    default, kvcache.PREFILL_POLICY_BY = kvcache.PREFILL_POLICY_BY, policy_by
    try:
        return attention_with_kvcache(q, k, v, seqlens, page_table=table, causal=True)
    finally:
        kvcache.PREFILL_POLICY_BY = default


def speed(log, t0=None) -> list:
    from hopper_attn.harness.timing import L2Flush, benchmark_interleaved, round_ratios, tflops
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func
    except Exception as exc:  # noqa: BLE001 - FA4 absent: ours alone
        flash_attn_varlen_func = None
        log(f"  FA4 unavailable: {type(exc).__name__}: {str(exc)[:100]}")
    flush = L2Flush()
    rows = []
    for batch, nq, keys in SPEED_SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(batch * 131 + nq + keys)
        q = torch.randn(batch, nq, HQ, D, device="cuda", generator=gen).to(BF16)
        q_packed = q.reshape(batch * nq, HQ, D)
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * nq
        # the chunk's keys are the cache's last nq: keys in the cache, queries at its end
        seqlens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
        flops = 4 * batch * HQ * D * sum(keys - nq + i + 1 for i in range(nq))
        for ps in (0, 16, 128):
            label = f"B{batch} q{nq} k{keys // 1024}k {'page' + str(ps) if ps else 'contig'}"
            row = {"batch": batch, "seqlen_q": nq, "keys": keys, "page_size": ps,
                   "heads": HQ, "heads_kv": HKV, "head_dim": D, "flops": flops}
            try:
                k, v, table = _cache(batch, keys, ps, gen)
                fns = {name: lambda k=k, v=v, t=table, by=by: _ours(
                    q, k, v, seqlens, t, by) for name, by in (("ours", "queries"),
                                                              ("ours-keysrow", "keys"))}
                if flash_attn_varlen_func is not None:
                    # (as tools/kvcache_gpu_check.py calls it: q (batch, seqlen_q, ...); and
                    # as vLLM does: packed q with cu_seqlens_q)
                    fns["fa4"] = lambda k=k, v=v, t=table: flash_attn_varlen_func(
                        q, k, v, seqused_k=seqlens, page_table=t, causal=True)
                    fns["fa4-cu"] = lambda k=k, v=v, t=table: flash_attn_varlen_func(
                        q_packed, k, v, cu_seqlens_q=cu_q, max_seqlen_q=nq, seqused_k=seqlens,
                        page_table=t, causal=True)
                ours = fns["ours"]()
                diffs = {}
                for name, fn in list(fns.items())[1:]:
                    try:
                        other = fn()
                        other = other[0] if isinstance(other, tuple) else other
                        diffs[name] = (other.view(ours.shape).float()
                                       - ours.float()).abs().max().item()
                    except Exception as exc:  # noqa: BLE001
                        row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                        del fns[name]
                timed = benchmark_interleaved(fns, flush)
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                log(f"{label}: FAILED {row['error'][:100]}")
                rows.append(row)
                torch.cuda.empty_cache()
                continue
            for name, entry in timed.items():
                entry["tflops"] = tflops(flops, entry["ms"])
            row["timed"], row["max_diff_vs_ours"] = timed, diffs
            cells = [f"{n} {e['ms'] * 1e3:.0f} us {e['tflops']:.0f} TF/s"
                     for n, e in timed.items()]
            ratio = round_ratios(timed["fa4"], timed["ours"]) if "fa4" in timed else None
            keysrow = round_ratios(timed["ours"], timed["ours-keysrow"])
            row["fa4_over_ours"], row["ours_over_keysrow"] = ratio, keysrow
            extra = f" || fa4/ours {ratio['ratio']:.2f}" if ratio else \
                f" || fa4: {row.get('fa4_error', 'n/a')[:60]}"
            extra += f" ours/keysrow {keysrow['ratio']:.2f}" if keysrow else ""
            wrong = [n for n, d in diffs.items() if d > 0.02]
            log(f"{label}: " + " | ".join(cells) + extra
                + (f"  DIFFER {wrong}" if wrong else ""))
            rows.append(row)
            del fns, k, v, table
            torch.cuda.empty_cache()
    return rows


def main() -> int:
    from hopper_attn.harness.gpu_check import run_check
    quick = "--quick" in sys.argv
    return run_check(
        __doc__, "prefill.json", lambda log: correctness(log, quick), speed,
        "correctness: case per line (ratio = error / PyTorch's bf16 error)",
        "speed: B, queries per request, keys, layout: ours | ours-keysrow | FA4 | FA4-cu "
        "(median us, TFLOP/s); FA4 time / ours (>1: ours faster), ours / keysrow")


if __name__ == "__main__":
    sys.exit(main())
