"""The decode stage on a GPU: correctness, then speed against SDPA and FlashAttention-4.

    source .gpu/prelude.sh && python tools/decode_gpu_check.py          # both (< 80 lines)
    python tools/decode_gpu_check.py --quick                            # correctness only

Correctness: every case of hopper_attn/harness/decode_check.py (fp32 reference, 2x PyTorch's
error, LSE, same bits twice, NaN guards) and a CUDA graph replay; one line per two cases.
Speed (Hq 32 / Hkv 8, d 128, bf16, no mask): CUDA events around each call, the host kept
ahead by a sleep kernel queued before it (so launch overhead is not timed; `loop` is the
time per call of 50 back-to-back calls, which includes it where the host is slower), 5
warmup calls, the median of 30; each call reads the next of enough K/V copies that they
exceed the 50 MB L2. TB/s: K and V read once, 2 B Hkv Nk d 2 bytes / time. A few decode
tile and split options are swept on four shapes ('!': its output differs from SDPA's by
more than 0.02). Everything goes to $OUT/decode.json.
"""

from __future__ import annotations

import argparse
import json
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
SWEEP_SHAPES = [(1, 1, 32, 8, 8192), (1, 1, 32, 8, 131072), (64, 1, 32, 8, 4096),
                (128, 1, 32, 8, 2048)]
SWEEP_TILES = [(128, 2), (128, 3), (64, 2), (64, 3), (64, 4)]      # (block_n, stages)
D = 128
L2_BYTES = 50e6
SLEEP_CYCLES = 400_000                                   # ~0.2 ms: the host gets ahead
RUNS, WARMUP = 30, 5


def correctness() -> list:
    from hopper_attn.harness.decode_check import Case, cases, check_case, check_graph
    rows = []
    for i, case in enumerate(cases()):
        try:
            rows.append(check_case(case, seed=i))
        except Exception as exc:  # noqa: BLE001 - report and go on
            rows.append({"case": case.label(), "ok": False,
                         "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    for case in (Case(1, 1, 32, 8, 8191), Case(2, 4, 32, 8, 1000, causal=True, num_splits=1)):
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


def _decode_calls(shape, q, kvs, **options):
    from hopper_attn import api, decode
    from hopper_attn.common.contract import Problem
    b, nq, hq, hkv, nk = shape
    problem = Problem(b, hq, nq, D, False, torch.bfloat16, heads_kv=hkv, seqlen_k=nk)
    handle = decode.compile_kernel(problem, compile_options=api._compile_options(), **options)
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, nq, dtype=torch.float32, device="cuda")
    decode.run(handle, q, *kvs[0], out, lse)
    # (this path, TVM-FFI, is not the correctness cases': check its output against SDPA's)
    k, v = kvs[0]
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True).transpose(1, 2)
    diff = (out.float() - sdpa.float()).abs().max().item()
    return [lambda k=k, v=v: decode.run(handle, q, k, v, out, lse, checked=True)
            for k, v in kvs], decode.splits_of(handle), diff


def _baselines(q, kvs):
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
    out["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    out["sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    try:
        from flash_attn.cute.interface import flash_attn_func
        out["fa4"] = [lambda k=k, v=v: flash_attn_func(q, k, v) for k, v in kvs]
    except Exception as exc:  # noqa: BLE001
        out["fa4"] = f"{type(exc).__name__}: {str(exc)[:100]}"
    out["attention"] = [lambda k=k, v=v: hopper_attn.attention(q, k, v) for k, v in kvs]
    return out


def _time(calls):
    if isinstance(calls, str):
        return {"error": calls}
    try:
        calls[0]()
        torch.cuda.synchronize()
        median, loop = _median_ms(calls)
        return {"ms": median, "loop_ms": loop}
    except Exception as exc:  # noqa: BLE001
        torch.cuda.synchronize()
        return {"error": f"{type(exc).__name__}: {str(exc)[:100]}"}


def benchmark() -> list:
    rows = []
    print(f"{'shape (B q Hq/Hkv keys)':<26}{'decode us':>10}{'TB/s':>6}{'loop':>7}{'spl':>4}"
          f"{'sdpa':>7}{'flash':>7}{'cudnn':>7}{'fa4':>7}{'attn()':>8}  best-other/decode")
    for shape in SHAPES:
        b, nq, hq, hkv, nk = shape
        kv_bytes = 2 * b * hkv * nk * D * 2
        copies = max(1, math.ceil(2 * L2_BYTES / kv_bytes))
        q, kvs = _inputs(shape, copies)
        row = {"shape": dict(batch=b, seqlen_q=nq, heads=hq, heads_kv=hkv, seqlen_k=nk,
                             head_dim=D), "kv_bytes": kv_bytes, "copies": copies}
        try:
            calls, splits, diff = _decode_calls(shape, q, kvs)
            row["decode"] = {**_time(calls), "splits": splits, "max_diff_vs_sdpa": diff}
        except Exception as exc:  # noqa: BLE001
            row["decode"] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        for name, calls in _baselines(q, kvs).items():
            row[name] = _time(calls)
        for entry in row.values():
            if isinstance(entry, dict) and "ms" in entry:
                entry["tb_s"] = kv_bytes / (entry["ms"] * 1e-3) / 1e12
        rows.append(row)

        def us(name):
            e = row.get(name, {})
            return f"{e['ms'] * 1e3:7.0f}" if "ms" in e else f"{'n/a':>7}"
        dec = row["decode"]
        others = [row[n]["ms"] for n in ("sdpa", "sdpa_flash", "sdpa_cudnn", "fa4")
                  if "ms" in row[n]]
        ratio = f"{min(others) / dec['ms']:.2f}x" if others and "ms" in dec else "-"
        label = f"B{b} q{nq} {hq}/{hkv} {nk // 1024}k"
        if "ms" in dec:
            print(f"{label:<26}{dec['ms'] * 1e3:10.1f}{dec['tb_s']:6.2f}"
                  f"{dec['loop_ms'] * 1e3:7.0f}{dec['splits']:4d}{us('sdpa')}{us('sdpa_flash')}"
                  f"{us('sdpa_cudnn')}{us('fa4')}{us('attention'):>8}  {ratio}"
                  + (f"  WRONG? max |decode - sdpa| {dec['max_diff_vs_sdpa']:.3f}"
                     if dec["max_diff_vs_sdpa"] > 0.02 else ""))
        else:
            print(f"{label:<26}decode FAILED: {dec['error'][:90]}")
        del q, kvs
        torch.cuda.empty_cache()
    return rows


def sweep() -> list:
    """Decode's tile options and split counts on a few shapes: one line per shape, the
    fastest first."""
    from hopper_attn import decode
    from hopper_attn.common.contract import Problem
    rows = []
    for shape in SWEEP_SHAPES:
        b, nq, hq, hkv, nk = shape
        kv_bytes = 2 * b * hkv * nk * D * 2
        q, kvs = _inputs(shape, max(1, math.ceil(2 * L2_BYTES / kv_bytes)))
        problem = Problem(b, hq, nq, D, False, torch.bfloat16, heads_kv=hkv, seqlen_k=nk)
        results = []
        for block_n, stages in SWEEP_TILES:
            auto = decode.num_splits_for(problem, block_n, stages)
            for splits in sorted({auto, max(1, auto // 2), 2 * auto}):
                if splits > decode.max_splits(D, block_n, stages):
                    continue
                try:
                    calls, _, diff = _decode_calls(shape, q, kvs, block_n=block_n,
                                                   stages=stages, num_splits=splits)
                    t = {**_time(calls), "max_diff_vs_sdpa": diff}
                except Exception as exc:  # noqa: BLE001
                    t = {"error": f"{type(exc).__name__}: {str(exc)[:100]}"}
                results.append({"block_n": block_n, "stages": stages, "splits": splits,
                                "auto": splits == auto, **t})
        rows.append({"shape": shape, "results": results})
        timed = sorted((r for r in results if "ms" in r), key=lambda r: r["ms"])
        text = "  ".join(f"{r['block_n']}/{r['stages']}/s{r['splits']}{'*' if r['auto'] else ''}"
                         f" {r['ms'] * 1e3:.0f}{'!' if r['max_diff_vs_sdpa'] > 0.02 else ''}"
                         for r in timed[:6])
        failed = len(results) - len(timed)
        text += f"  ({failed} failed)" if failed else ""
        print(f"sweep B{b} q{nq} {nk // 1024}k (bn/stages/splits us, *auto): {text}")
        del q, kvs
        torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="correctness only")
    args = parser.parse_args()
    from hopper_attn.harness.env import environment
    env = environment()
    print(f"{env.get('gpu')} driver {env.get('driver')} torch {env['torch']} cute-dsl "
          f"{env.get('cutlass_dsl')} fa4 {env.get('flash_attn_4')}")
    result = {"env": env}
    try:
        result["correctness"] = correctness()
        if not args.quick:
            result["benchmark"] = benchmark()
            result["sweep"] = sweep()
    except Exception:  # noqa: BLE001 - keep what was measured
        result["error"] = traceback.format_exc()
        print(result["error"][-1500:])
    out_dir = os.environ.get("OUT") or os.path.join(ROOT, "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "decode.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
