"""The decode stage's fixed cost on a GPU: tile and split overrides against the default and the
baselines (SDPA, cuDNN, FA4), timed alone, warm and in chains.

    source .gpu/prelude.sh && python tools/decode_fixed_gpu_check.py    # ~2-3 min
    python tools/decode_fixed_gpu_check.py --quick                      # correctness only
    python tools/decode_fixed_gpu_check.py --no-correctness --sweep     # + a 1k-32k B1 sweep

The variants (docs/decode.md, "The fixed cost of one call"; its "Tried and not kept" table
has the compile-time variants measured with this tool and removed): the default and a 64-key
tile of 4 stages at 16 splits (8 serial tiles a split of half the size: half the last tile's
WGMMAs after its bytes land); `--variants` as in tools/decode_gpu_check.py (tile, stages,
combine_chunk, num_splits).

Correctness: for each variant other than the default, cases of
hopper_attn/harness/decode_check.py (fp32 reference, 2x PyTorch's error, LSE, the same bits
twice, NaN guards; splits ending inside the tail, causal, 16 queries, one split).

Speed (Hq 32 / Hkv 8, d 128, bf16; B1 8k / 32k / 128k keys, B16 4 queries Hq 64 16k), every
variant and baseline of a shape in the same rounds, the order rotating, on the next of enough
K/V copies to exceed the L2:
* alone: one call between two events after a sleep kernel that lets the host get ahead (as
  tools/decode_gpu_check.py): a lone decode step after a non-PDL kernel;
* warm: the same, with one call of the same kernel (on another K/V copy) just before the
  first event: its code, parameters and TMA descriptors in the caches and the SMs'
  shared-memory split already its own, its K/V not; alone - warm is what a cold kernel
  costs (instruction misses on the last CTA's combine path, descriptor fetches, the
  carveout), a part of the fixed cost that no split count changes;
* chain: CHAIN calls back to back between two events (after a longer sleep), the time per
  call: the launch of each call behind the previous one, where PDL overlaps the next call's
  launch and prologue could overlap the previous call's tail.
Every call takes the next of >= 3 K/V copies (>= 3x the L2). One line per shape of
baselines (alone/warm/chain us), one per variant: the three times and best-baseline /
variant for each. Everything goes to $OUT/decode_fixed.json.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import torch  # noqa: E402

import decode_gpu_check as dgc  # noqa: E402

SHAPES = [(1, 1, 32, 8, 8192), (1, 1, 32, 8, 32768), (1, 1, 32, 8, 131072),
          (16, 4, 64, 8, 16384)]
VARIANTS = "default;block_n=64,stages=4,num_splits=16"
ROUNDS, WARMUP = 20, 2
CHAIN = 16
SLEEP_ALONE = 400_000                  # ~0.2 ms: the host gets one call ahead
SLEEP_CHAIN = 3_000_000                # ~1.5 ms: the host enqueues a whole chain ahead
MODES = ("alone", "warm", "chain")
SWEEP_KEYS = (1024, 2048, 4096, 8192, 16384, 32768)
SWEEP_VARIANTS = "default;num_splits=1"


def correctness(variants) -> list:
    from hopper_attn.harness.decode_check import Case, check_case
    shapes = [Case(1, 1, 32, 8, 8191), Case(1, 4, 32, 8, 1000, causal=True, num_splits=7),
              Case(2, 16, 32, 8, 8191, causal=True), Case(2, 1, 32, 8, 8191, num_splits=1),
              Case(1, 1, 32, 8, 1000, num_splits=5)]       # 1-2 tiles a split
    rows = []
    for label, options in variants:
        if not options:
            continue                # (the default: tools/decode_gpu_check.py's cases)
        opts = dict(options)
        splits = opts.pop("num_splits", "0")
        for base in shapes:
            case = Case(**{**base.__dict__, **{k: int(v) for k, v in opts.items()
                                               if k in ("block_n", "stages", "combine_chunk")},
                           "num_splits": (int(splits) if splits.isdigit() else 0)
                           or base.num_splits})
            try:
                rows.append({"variant": label, **check_case(case, seed=len(rows))})
            except Exception as exc:  # noqa: BLE001 - report and go on
                rows.append({"variant": label, "case": case.label(), "ok": False,
                             "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            r = rows[-1]
            print(f"{'ok  ' if r['ok'] else 'FAIL'} {label:<12} {r['case']:<44} "
                  + (r.get("error", "")[:60] if "error" in r else
                     f"err/torch {r['ratio']:.2f} lse {r['lse_err']:.1e} s{r['splits']}"
                     + ("" if r["same_bits"] else " BITS")))
    print(f"correctness: {sum(r['ok'] for r in rows)}/{len(rows)} pass")
    return rows


def timed_rounds(calls: dict) -> dict:
    """name -> {mode_ms, mode_iqr_ms} for the MODES (chain: per call), every name once per
    round and mode, the order rotating."""
    names = []
    for name, c in calls.items():
        if isinstance(c, str):
            continue
        try:
            c[0]()
            torch.cuda.synchronize()
            names.append(name)
        except Exception as exc:  # noqa: BLE001
            torch.cuda.synchronize()
            calls[name] = f"{type(exc).__name__}: {str(exc)[:100]}"
    for _ in range(WARMUP):
        for name in names:
            for i in range(CHAIN):
                calls[name][i % len(calls[name])]()
    torch.cuda.synchronize()
    pairs = {mode: {n: [] for n in names} for mode in MODES}
    cursor = 0              # every call takes the next K/V copy: none is still in L2

    def call(c):
        nonlocal cursor
        c[cursor % len(c)]()
        cursor += 1

    for r in range(ROUNDS):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            c = calls[name]
            e = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
            torch.cuda._sleep(SLEEP_ALONE)
            e[0].record()
            call(c)
            e[1].record()
            torch.cuda._sleep(SLEEP_ALONE)
            call(c)                     # the same kernel just before: code and params warm
            e[2].record()
            call(c)
            e[3].record()
            torch.cuda._sleep(SLEEP_CHAIN)
            e[4].record()
            for _ in range(CHAIN):
                call(c)
            e[5].record()
            for mode, (a, b) in zip(MODES, ((0, 1), (2, 3), (4, 5))):
                pairs[mode][name].append((e[a], e[b]))
    torch.cuda.synchronize()
    out = {}
    for name, c in calls.items():
        if isinstance(c, str):
            out[name] = {"error": c}
            continue
        entry = {}
        for mode in MODES:
            per = CHAIN if mode == "chain" else 1
            times = sorted(a.elapsed_time(b) / per for a, b in pairs[mode][name])
            entry[f"{mode}_ms"] = statistics.median(times)
            entry[f"{mode}_iqr_ms"] = times[3 * len(times) // 4] - times[len(times) // 4]
        out[name] = entry
    return out


def benchmark(shapes, variants) -> list:
    rows, wins = [], []
    print(f"{'shape':<20}{'MB':>5}  baselines alone/warm/chain us (sdpa flash cudnn fa4) | "
          "variant: alone, warm, chain us, tile splits, best/variant alone, warm, chain")
    for shape in shapes:
        b, nq, hq, hkv, nk = shape
        kv_bytes = 2 * b * hkv * nk * dgc.D * 2
        copies = max(3, math.ceil(3 * dgc.L2_BYTES / kv_bytes))
        q, kvs = dgc._inputs(shape, copies)
        label = f"B{b} q{nq} {hq}/{hkv} {nk // 1024}k"
        row = {"shape": dict(batch=b, seqlen_q=nq, heads=hq, heads_kv=hkv, seqlen_k=nk,
                             head_dim=dgc.D), "kv_bytes": kv_bytes, "copies": copies,
               "chain": CHAIN, "variants": {}}
        calls, info = {}, {}
        for name, options in variants:
            try:
                c, splits, tile, diff = dgc._decode_calls(shape, q, kvs, options)
                calls["decode " + name] = c
                info[name] = {"splits": splits, "block_n": tile[0], "stages": tile[1],
                              "max_diff_vs_sdpa": diff, "options": options}
            except Exception as exc:  # noqa: BLE001
                info[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        baselines = dgc._baselines(q, kvs, api_too=False)
        calls.update(baselines)
        timed = timed_rounds(calls)
        for name in baselines:
            row[name] = timed[name]
        best = {}
        for mode in MODES:
            others = [timed[n][f"{mode}_ms"] for n in ("sdpa", "flash", "cudnn", "fa4")
                      if f"{mode}_ms" in timed[n]]
            best[mode] = min(others) if others else float("nan")
        row["best_ms"] = best
        base = " ".join("/".join(f"{timed[n][m + '_ms'] * 1e3:.1f}" for m in MODES)
                        if "alone_ms" in timed[n] else "n/a" for n in baselines)
        print(f"{label:<20}{kv_bytes / 1e6:5.0f}  {base}  (best "
              + "/".join(f"{best[m] * 1e3:.1f}" for m in MODES) + " us)")
        for name, _ in variants:
            entry = {**info[name], **timed.get("decode " + name, {})}
            row["variants"][name] = entry
            if "alone_ms" not in entry:
                print(f"  {name:<18}FAILED: {entry.get('error', '?')[:80]}")
                continue
            entry["tb_s"] = kv_bytes / (entry["alone_ms"] * 1e-3) / 1e12
            for m in MODES:
                entry[f"ratio_{m}"] = best[m] / entry[f"{m}_ms"]
            print(f"  {name:<16}" + " ".join(f"{entry[m + '_ms'] * 1e3:6.1f}" for m in MODES)
                  + f" us {entry['block_n']:>3}/{entry['stages']} s{entry['splits']:<3d} "
                  f"iqr {entry['alone_iqr_ms'] * 1e3:3.1f} "
                  + " ".join(f"{entry['ratio_' + m]:.3f}x" for m in MODES)
                  + (f"  WRONG? |decode - sdpa| {entry['max_diff_vs_sdpa']:.3f}"
                     if entry["max_diff_vs_sdpa"] > 0.02 else ""))
        rows.append(row)
        for mode in MODES:
            done = [(e[f"{mode}_ms"], n) for n, e in row["variants"].items() if f"{mode}_ms" in e]
            if done:
                wins.append(f"{label.replace(' 32/8', '')} {mode}: {min(done)[1]}")
        del q, kvs, calls
        torch.cuda.empty_cache()
    print("fastest: " + "; ".join(wins))
    return rows


def sweep(variants) -> list:
    """B1 Hq 32 / Hkv 8 over 1k-32k keys, the decode variants only (alone and warm), and per
    variant a least-squares line through the alone times: intercept (the fixed cost) and
    slope (TB/s on the bytes). With num_splits=1 (8 CTAs, no combine) next to the default,
    the two intercepts differ by the combine's chain."""
    rows = []
    for nk in SWEEP_KEYS:
        shape = (1, 1, 32, 8, nk)
        kv_bytes = 2 * 8 * nk * dgc.D * 2
        q, kvs = dgc._inputs(shape, max(3, math.ceil(3 * dgc.L2_BYTES / kv_bytes)))
        calls = {}
        for name, options in variants:
            try:
                calls[name] = dgc._decode_calls(shape, q, kvs, options)[0]
            except Exception as exc:  # noqa: BLE001
                calls[name] = f"{type(exc).__name__}: {str(exc)[:100]}"
        timed = timed_rounds(calls)
        rows.append({"seqlen_k": nk, "kv_bytes": kv_bytes, "timed": timed})
        print(f"sweep B1 {nk // 1024:>3}k  " + "  ".join(
            f"{n} {e['alone_ms'] * 1e3:.1f}/{e['warm_ms'] * 1e3:.1f}" if "alone_ms" in e
            else f"{n} failed" for n, e in timed.items()))
        del q, kvs, calls
    fits = {}
    for name, _ in variants:
        pts = [(r["kv_bytes"], r["timed"][name]["alone_ms"] * 1e-3) for r in rows
               if "alone_ms" in r["timed"][name]]
        if len(pts) < 2:
            continue
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        fits[name] = {"intercept_us": (my - slope * mx) * 1e6, "tb_s": 1e-12 / slope}
    print("sweep fit (alone): " + "; ".join(f"{n}: {f['intercept_us']:.1f} us + bytes at "
                                           f"{f['tb_s']:.2f} TB/s" for n, f in fits.items()))
    return [{"rows": rows, "fits": fits}]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="correctness only")
    parser.add_argument("--no-correctness", action="store_true")
    parser.add_argument("--sweep", action="store_true",
                        help="also B1 over 1k-32k keys: default and one split (~30 s)")
    parser.add_argument("--variants", default=VARIANTS,
                        help="';'-separated, as tools/decode_gpu_check.py --variants")
    args = parser.parse_args()
    variants = dgc.parse_variants(args.variants)
    from hopper_attn.harness.env import environment
    from hopper_attn.harness.gpu_check import env_line, write_json
    env = environment()
    print(env_line(env))
    result = {"env": env, "variants": [v[0] for v in variants], "rounds": ROUNDS,
              "chain": CHAIN}
    try:
        if not args.no_correctness:
            result["correctness"] = correctness(variants)
        if not args.quick:
            result["benchmark"] = benchmark(SHAPES, variants)
        if args.sweep:
            result["sweep"] = sweep(dgc.parse_variants(SWEEP_VARIANTS))
    except Exception:  # noqa: BLE001 - keep what was measured
        result["error"] = traceback.format_exc()
        print(result["error"][-1500:])
    path = write_json(result, "decode_fixed.json",
                      os.environ.get("OUT") or os.path.join(ROOT, "results"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
