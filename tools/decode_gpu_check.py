"""The decode stage on a GPU: correctness, then speed against SDPA and FlashAttention-4.

    source .gpu/prelude.sh && python tools/decode_gpu_check.py          # both (< 80 lines)
    python tools/decode_gpu_check.py --quick                            # correctness only
    python tools/decode_gpu_check.py --shapes small \
        --variants "default;block_n=128,stages=3;block_n=64,stages=2;num_splits=x2"  # A/B
    python tools/decode_gpu_check.py --features        # window / softcap / sinks (< 90 s)

Correctness: every case of hopper_attn/harness/decode_check.py (fp32 reference, 2x PyTorch's
error, LSE, same bits twice, NaN guards) and a CUDA graph replay; one line per two cases.
Speed (Hq 32 / Hkv 8, d 128, bf16, no mask), round-robin: in each of 30 rounds every decode
variant and every baseline (SDPA default, flash, cuDNN; FA4; attention() in the plain run)
is called once, the order rotating, each call alone on the GPU after a sleep kernel that
lets the host get ahead (launch overhead is not timed), on the next of enough K/V copies to
exceed the 50 MB L2; medians and inter-quartile ranges of the CUDA event times. TB/s: K and
V read once, 2 B Hkv Nk d 2 bytes / time. Per shape one line of baselines, then one line per
variant with its ratio best-baseline / variant (> 1: decode faster); 'WRONG?' where its
output differs from SDPA's by more than 0.02. Everything goes to $OUT/decode.json
($OUT/decode_ab.json with --variants).

`--features` (instead of the above): decode_check.py's `feature_cases` (windows (4095, 0),
(128, 0), (64, 32) non-causal, softcap 30 / 50, sinks, together; fp32 reference under the
same window, cap and sinks; rows that see no key), then (not with --quick) three timing
rows through attention() with the stage forced, the same round-robin: Mistral-like B1 32k
window (4095, 0) (decode, k6, SDPA with the window as a mask, FA4 with window_size) and
gpt-oss-like window (128, 0) with sinks at B1 and B4 (decode, k6; SDPA and FA4 without the
sinks); which stage attention() picks (the decode stage, for every window), and its output against the fp32 reference. Everything goes to $OUT/decode_features.json.
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

import torch  # noqa: E402

SHAPES = [  # (batch, queries, q heads, kv heads, keys)
    (1, 1, 32, 8, 8192), (1, 1, 32, 8, 32768), (1, 1, 32, 8, 131072), (8, 1, 32, 8, 8192),
    (64, 1, 32, 8, 4096), (128, 1, 32, 8, 2048), (16, 4, 64, 8, 16384), (1, 16, 32, 8, 32768),
]
SMALL = [SHAPES[0], SHAPES[1], SHAPES[7], SHAPES[6], SHAPES[5]]    # --shapes small
D = 128
L2_BYTES = 50e6
SLEEP_CYCLES = 400_000                                   # ~0.2 ms: the host gets ahead
ROUNDS, WARMUP = 30, 3
SHORT = {"block_n": "bn", "stages": "st", "combine_chunk": "c",
         "num_splits": "s"}                             # variant options and their labels


def correctness(features: bool = False) -> list:
    from hopper_attn.harness.decode_check import (Case, cases, check_case, check_graph,
                                                  feature_cases)
    rows = []
    for i, case in enumerate(feature_cases() if features else cases()):
        try:
            rows.append(check_case(case, seed=i))
        except Exception as exc:  # noqa: BLE001 - report and go on
            rows.append({"case": case.label(), "ok": False,
                         "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    graphs = [Case(1, 1, 32, 8, 8191), Case(2, 4, 32, 8, 1000, causal=True, num_splits=1)]
    for case in graphs if not features else []:
        try:
            rows.append(check_graph(case))
        except Exception as exc:  # noqa: BLE001
            rows.append({"case": "graph " + case.label(), "ok": False,
                         "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    cells = []
    for r in rows:
        if "error" in r:
            cells.append(f"FAIL {r['case']}: {r['error'][:60]}")
        elif "ratio" in r:
            flags = "" if r["ok"] else (" nan" * (not r["no_nan"]) + " bits" * (not r["same_bits"])
                                        + " guard" * (not r["guards"])
                                        + f" lse{r['lse_err']:.1e}" * (r["lse_err"] > 1e-3))
            cells.append(f"{'ok  ' if r['ok'] else 'FAIL'} {r['ratio']:4.2f} s{r['splits']:<3d}"
                         f"{r['case']}{flags}")
        else:
            cells.append(f"{'ok  ' if r['ok'] else 'FAIL'} {r['case']}")
    for i in range(0, len(cells), 2):
        print(" | ".join(c[:62].ljust(62) for c in cells[i:i + 2]).rstrip())
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    print(f"correctness: {sum(r['ok'] for r in rows)}/{len(rows)} pass, max error ratio "
          f"{max(ratios, default=float('nan')):.2f} (limit 2 + 2^-10 / torch error), max LSE "
          f"error {max((r['lse_err'] for r in rows if 'lse_err' in r), default=0):.1e}")
    return rows


def _median_ms(calls) -> tuple[float, float]:
    """(median event time of one call with the host ahead, mean time of 50 back-to-back
    calls), in ms; `calls` rotate over the K/V copies."""
    for i in range(WARMUP):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    events = []
    for i in range(RUNS):
        torch.cuda._sleep(SLEEP_CYCLES)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        calls[i % len(calls)]()
        e1.record()
        events.append((e0, e1))
    torch.cuda.synchronize()
    median = statistics.median(a.elapsed_time(b) for a, b in events)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for i in range(50):
        calls[i % len(calls)]()
    e1.record()
    torch.cuda.synchronize()
    return median, e0.elapsed_time(e1) / 50


def _inputs(shape, copies):
    b, nq, hq, hkv, nk = shape
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(b, nq, hq, D, device="cuda", generator=gen).to(torch.bfloat16)
    kvs = []
    for _ in range(copies):
        k = torch.randn(b, nk, hkv, D, device="cuda", generator=gen).to(torch.bfloat16)
        v = torch.randn(b, nk, hkv, D, device="cuda", generator=gen).to(torch.bfloat16)
        kvs.append((k, v))
    return q, kvs


def parse_variants(text: str) -> list:
    """'default;block_n=64,stages=2;num_splits=x2' -> [(label, options)]. Options: block_n,
    stages, combine_chunk (ints), num_splits (an int, or xN / /N: the automatic count for
    that tile times / over N)."""
    out = []
    for spec in (v.strip() for v in text.split(";")):
        if not spec:
            continue
        options = {}
        if spec != "default":
            for item in spec.split(","):
                key, _, value = item.partition("=")
                key = key.strip()
                if key not in SHORT:
                    raise SystemExit(f"unknown variant option {key!r} in {spec!r}")
                options[key] = value.strip() if key == "num_splits" else int(value)
        label = "default" if not options else " ".join(f"{SHORT[k]}{v}" for k, v in options.items())
        out.append((label, options))
    return out


def _decode_calls(shape, q, kvs, options):
    """(calls over the K/V copies, splits, (kv tile, stages), max |decode - SDPA|)."""
    from hopper_attn import api, decode
    from hopper_attn.common.contract import Problem
    b, nq, hq, hkv, nk = shape
    problem = Problem(b, hq, nq, D, False, torch.bfloat16, heads_kv=hkv, seqlen_k=nk)
    options = dict(options)
    splits = options.pop("num_splits", "0")
    tile = (options.get("block_n", 0), options.get("stages", 0))
    if not any(tile):
        tile = decode.tile_for(problem)
    tile = decode.tile_config(D, *tile)
    options["block_n"], options["stages"] = tile
    auto = decode.num_splits_for(problem, *tile)
    if isinstance(splits, str) and splits[:1] in "x/" and splits[1:].isdigit():
        n = int(splits[1:])
        splits = auto * n if splits[0] == "x" else max(1, auto // n)
    splits = min(int(splits), decode.MAX_SPLITS)
    handle = decode.compile_kernel(problem, compile_options=api._compile_options(),
                                   num_splits=splits, **options)
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, nq, dtype=torch.float32, device="cuda")
    decode.run(handle, q, *kvs[0], out, lse)
    # (this path, TVM-FFI, is not the correctness cases': check its output against SDPA's)
    k, v = kvs[0]
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True).transpose(1, 2)
    diff = (out.float() - sdpa.float()).abs().max().item()
    return ([lambda k=k, v=v: decode.run(handle, q, k, v, out, lse, checked=True)
             for k, v in kvs], decode.splits_of(handle), tile, diff)


def _baselines(q, kvs, api_too: bool):
    """name -> list of calls (or an error string)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import hopper_attn
    out = {}
    qt = q.transpose(1, 2)
    kvt = [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in kvs]

    def sdpa(backend):
        def call(k, v):
            if backend is None:
                return F.scaled_dot_product_attention(qt, k, v, enable_gqa=True)
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, k, v, enable_gqa=True)
        return [lambda k=k, v=v: call(k, v) for k, v in kvt]

    out["sdpa"] = sdpa(None)
    out["flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    out["cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    try:
        from flash_attn.cute.interface import flash_attn_func
        out["fa4"] = [lambda k=k, v=v: flash_attn_func(q, k, v) for k, v in kvs]
    except Exception as exc:  # noqa: BLE001
        out["fa4"] = f"{type(exc).__name__}: {str(exc)[:100]}"
    if api_too:
        out["attn()"] = [lambda k=k, v=v: hopper_attn.attention(q, k, v) for k, v in kvs]
    return out


def round_robin(calls: dict) -> dict:
    """name -> {ms: median, iqr_ms} over ROUNDS rounds; each round calls every name once (the
    order rotating), each call alone on the GPU after a sleep kernel that lets the host get
    ahead, on the next K/V copy (none still in L2)."""
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
            calls[name][0]()
    torch.cuda.synchronize()
    events = {name: [] for name in names}
    turn = 0
    for r in range(ROUNDS):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            c = calls[name]
            torch.cuda._sleep(SLEEP_CYCLES)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            c[turn % len(c)]()
            e1.record()
            events[name].append((e0, e1))
            turn += 1
    torch.cuda.synchronize()
    out = {}
    for name, c in calls.items():
        if isinstance(c, str):
            out[name] = {"error": c}
            continue
        times = sorted(a.elapsed_time(b) for a, b in events[name])
        q1, q3 = times[len(times) // 4], times[3 * len(times) // 4]
        out[name] = {"ms": statistics.median(times), "iqr_ms": q3 - q1}
    return out


def benchmark(shapes, variants, api_too: bool) -> list:
    """Per shape: a line of the baselines, then a line per decode variant, all timed in the
    same rounds."""
    rows, summary = [], []
    print(f"{'shape (B q Hq/Hkv keys)':<24}{'MB':>5}  baselines us (sdpa flash cudnn fa4"
          f"{' attn()' if api_too else ''}) | variant: us TB/s tile splits, best-baseline/it")
    for shape in shapes:
        b, nq, hq, hkv, nk = shape
        kv_bytes = 2 * b * hkv * nk * D * 2
        copies = max(2, math.ceil(2 * L2_BYTES / kv_bytes))
        q, kvs = _inputs(shape, copies)
        label = f"B{b} q{nq} {hq}/{hkv} {nk // 1024}k"
        row = {"shape": dict(batch=b, seqlen_q=nq, heads=hq, heads_kv=hkv, seqlen_k=nk,
                             head_dim=D), "kv_bytes": kv_bytes, "copies": copies,
               "variants": {}}
        calls, info = {}, {}
        for name, options in variants:
            try:
                c, splits, tile, diff = _decode_calls(shape, q, kvs, options)
                calls["decode " + name] = c
                info[name] = {"splits": splits, "block_n": tile[0], "stages": tile[1],
                              "max_diff_vs_sdpa": diff, "options": options}
            except Exception as exc:  # noqa: BLE001
                info[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        baselines = _baselines(q, kvs, api_too)
        calls.update(baselines)
        timed = round_robin(calls)
        for entry in timed.values():
            if "ms" in entry:
                entry["tb_s"] = kv_bytes / (entry["ms"] * 1e-3) / 1e12
        for name in baselines:
            row[name] = timed[name]
        others = [timed[n]["ms"] for n in ("sdpa", "flash", "cudnn", "fa4") if "ms" in timed[n]]
        best = min(others) if others else float("nan")
        base = " ".join(f"{timed[n]['ms'] * 1e3:.1f}" if "ms" in timed[n] else "n/a"
                        for n in baselines)
        print(f"{label:<24}{kv_bytes / 1e6:5.0f}  {base}  (best {best * 1e3:.1f} us, "
              f"{kv_bytes / (best * 1e-3) / 1e12:.2f} TB/s)")
        for name, _ in variants:
            entry = {**info[name], **timed.get("decode " + name, {})}
            row["variants"][name] = entry
            if "ms" not in entry:
                print(f"  {name:<22}FAILED: {entry.get('error', '?')[:80]}")
                continue
            print(f"  {name:<22}{entry['ms'] * 1e3:7.1f} us {entry['tb_s']:5.2f} TB/s "
                  f"{entry['block_n']:>3}/{entry['stages']} s{entry['splits']:<3d} "
                  f"iqr {entry['iqr_ms'] * 1e3:4.1f}  {best / entry['ms']:.3f}x"
                  + (f"  WRONG? max |decode - sdpa| {entry['max_diff_vs_sdpa']:.3f}"
                     if entry["max_diff_vs_sdpa"] > 0.02 else ""))
        rows.append(row)
        timed_variants = [(e["ms"], n) for n, e in row["variants"].items() if "ms" in e]
        if len(variants) > 1 and timed_variants:
            summary.append(f"{label.replace(' 32/8', '')}: {min(timed_variants)[1]}")
        del q, kvs, calls
        torch.cuda.empty_cache()
    if summary:
        print("fastest variant: " + "; ".join(summary))
    return rows


FEATURE_ROWS = [  # (label, batch, q heads, kv heads, keys, d, window_size, sinks)
    ("mistral B1 32k w4096", 1, 32, 8, 32768, 128, (4095, 0), False),
    ("gpt-oss B1 8k w128 sinks", 1, 64, 8, 8192, 64, (128, 0), True),
    ("gpt-oss B4 8k w128 sinks", 4, 64, 8, 8192, 64, (128, 0), True),
]


def feature_timing() -> list:
    """FEATURE_ROWS, one query, causal: decode and k6 forced through attention(), SDPA with
    the window as a boolean mask, FA4 with window_size (both without sinks); enough K/V
    copies that the window's keys of one call are not in L2 from the last (at most 64)."""
    import torch.nn.functional as F
    import hopper_attn
    from hopper_attn import api
    from hopper_attn.common.contract import Problem, normalize_window
    from hopper_attn.harness.window_reference import reference, window_mask
    rows = []
    for label, b, hq, hkv, nk, d, window, with_sinks in FEATURE_ROWS:
        gen = torch.Generator(device="cuda").manual_seed(11)
        read = 2 * b * hkv * min(nk, window[0] + 1) * d * 2
        copies = min(64, max(2, math.ceil(2 * L2_BYTES / read)))
        q = torch.randn(b, 1, hq, d, device="cuda", generator=gen).to(torch.bfloat16)
        kvs = [tuple(torch.randn(b, nk, hkv, d, device="cuda", generator=gen)
                     .to(torch.bfloat16) for _ in range(2)) for _ in range(copies)]
        sinks = torch.randn(hq, device="cuda", generator=gen) if with_sinks else None
        kw = dict(causal=True, window_size=window, sinks=sinks)
        left, right = normalize_window(window, True)
        picked = api._entry_for(Problem(b, hq, 1, d, True, torch.bfloat16, heads_kv=hkv,
                                        seqlen_k=nk, window_left=left, window_right=right),
                                "", 0.0, with_sinks).name
        mask = window_mask(1, nk, window[0], 0, q.device)
        ref = reference(q, *kvs[0], window[0], 0, d ** -0.5, sinks=sinks)[0]
        err = (hopper_attn.attention(q, *kvs[0], **kw).float() - ref).abs().max().item()
        calls = {name: [lambda k=k, v=v, s=stage: hopper_attn.attention(q, k, v, stage=s, **kw)
                        for k, v in kvs] for name, stage in (("decode", "decode"), ("k6", "k6"))}
        calls["sdpa mask"] = [lambda k=k, v=v: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            enable_gqa=True) for k, v in kvs]
        try:
            from hopper_attn.harness.baselines import fa4
            run = fa4(window_size=window)
            calls["fa4"] = [lambda k=k, v=v: run(q, k, v, True) for k, v in kvs]
        except Exception as exc:  # noqa: BLE001
            calls["fa4"] = f"{type(exc).__name__}: {str(exc)[:100]}"
        timed = round_robin(calls)
        us = {n: e["ms"] * 1e3 for n, e in timed.items() if "ms" in e}
        ratio = us.get("k6", float("nan")) / us.get("decode", float("nan"))
        print(f"{label:<26}" + " ".join(f"{n} {t:.1f}" for n, t in us.items())
              + f" us | k6/decode {ratio:.2f}x | attention() picks {picked}, max err {err:.1e}"
              + "".join(f" | {n}: {e['error'][:40]}" for n, e in timed.items() if "error" in e),
              flush=True)
        rows.append({"label": label, "batch": b, "heads": hq, "heads_kv": hkv, "seqlen_k": nk,
                     "head_dim": d, "window": list(window), "sinks": with_sinks,
                     "copies": copies, "timed": timed, "k6_over_decode": ratio,
                     "attention_picks": picked, "attention_max_err": err})
        del kvs, calls
        torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="correctness only")
    parser.add_argument("--shapes", choices=("all", "small"), default="all",
                        help="small: B1 8k, B1 32k, B1 q16 32k, B16 q4 Hq64 16k, B128 2k")
    parser.add_argument("--variants", default="default",
                        help="decode variants timed in the same rounds, ';'-separated: "
                             "'default' or block_n=,stages=,combine_chunk=,num_splits= "
                             "(num_splits=x2 / =/2: the automatic count times / over 2)")
    parser.add_argument("--no-correctness", action="store_true")
    parser.add_argument("--features", action="store_true",
                        help="window / softcap / sinks cases and timing rows instead")
    args = parser.parse_args()
    variants = parse_variants(args.variants)
    from hopper_attn.harness.env import environment
    from hopper_attn.harness.gpu_check import env_line, write_json
    env = environment()
    print(env_line(env))
    result = {"env": env}
    try:
        if args.features:
            result["features"] = correctness(features=True)
            if not args.quick:
                result["feature_timing"] = feature_timing()
        elif not args.no_correctness:
            result["correctness"] = correctness()
        if not args.quick and not args.features:
            shapes = SMALL if args.shapes == "small" else SHAPES
            result["variants"] = [v[0] for v in variants]
            result["benchmark"] = benchmark(shapes, variants, api_too=args.variants == "default")
    except Exception:  # noqa: BLE001 - keep what was measured
        result["error"] = traceback.format_exc()
        print(result["error"][-1500:])
    name = "decode_features.json" if args.features else \
        "decode.json" if args.variants == "default" else "decode_ab.json"
    path = write_json(result, name, os.environ.get("OUT") or os.path.join(ROOT, "results"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
