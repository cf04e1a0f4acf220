"""Benchmark kernels against baselines measured in the same run.

    python bench.py k2 k3_3 k4              # default sweep (FlashAttention-3 paper's)
    CHECK=1 python bench.py k4              # check each config against fp32 first
    SEQLEN=4096 HEADDIM=128 CAUSAL=0 python bench.py k4 --json results/x.json
    python bench.py kb2 kb2:stmatrix=1      # two variants, timed round-robin with the baselines
    python bench.py k4 --profile            # one config, once, inside an NVTX range (for ncu)
    python bench.py k2 k4 --compile-only    # no GPU needed: registers, SMEM, spills per config
    CHECK=1 python bench.py k6 k7           # FP8 (k7): cuDNN's FP8 attention joins the baselines
                                            # (needs nvidia-cudnn-frontend)
    CHECK=1 python bench.py kb1             # a backward stage: timed against the baselines'
                                            # own backward passes (autograd)

Prints one table (ms, TFLOP/s = 4*B*H*N^2*d / time, halved for causal, and the ratio to each
baseline: >1 means faster than the baseline). Kernels and baselines of a config are timed
round-robin (every round runs each once, in a shuffled order, L2 flushed before each), so
clock and power drift hit them alike; each ratio is the median of the per-round ratios, with
half their interquartile range after it (1.03±0.01): the spread to expect from a rerun.
--sequential times each one back to back instead (no spread). Backward stages count
10*B*H*N^2*d (2.5x the forward: five N x N x d GEMMs instead of two), halved for causal.
--json writes every row with the environment.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from hopper_attn.harness import problems, registry


def _nvtx_range(name):
    try:
        import nvtx
        return nvtx.annotate(name)
    except ImportError:  # fall back to torch's binding
        import torch
        return torch.cuda.nvtx.range(name)


DEFAULT_BASELINES = "sdpa_flash,sdpa_cudnn,fa4"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernels", nargs="+",
                    help=f"any of: {', '.join(registry.KERNELS)} (forward), "
                         f"{', '.join(registry.BACKWARD_KERNELS)} (backward)")
    ap.add_argument("--json", help="write all rows and the environment to this file")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile for sm_90a and report registers/SMEM/spills (no GPU needed)")
    ap.add_argument("--profile", action="store_true",
                    help="run the first config once per kernel inside an NVTX range")
    ap.add_argument("--baselines", default=None,
                    help="comma-separated baselines to time ('' for none; default "
                         "sdpa_flash,sdpa_cudnn,fa4, plus cudnn_fp8 when an FP8 stage runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--interleave", action="store_true",
                    help="(the default) time kernels and baselines of a config round-robin")
    ap.add_argument("--sequential", action="store_true",
                    help="time each kernel and baseline back to back instead of round-robin "
                         "(ratios then swing by up to 10%% between runs)")
    return ap.parse_args(argv)


def compile_only(entries) -> int:
    from hopper_attn.harness.compile_report import format_rows, report
    head_dims = problems._env_list("HEADDIM", problems.HEAD_DIMS)
    causals = problems._env_list("CAUSAL", (False, True), problems._bool)
    rows = report(entries, head_dims, causals, problems.dtypes())
    print(format_rows(rows))
    bad = [r for r in rows if not r["ok"] or r["spills"] or r.get("local_bytes")]
    return 1 if bad else 0


def profile(entries, args, backward: bool = False) -> int:
    import torch
    from hopper_attn.harness.inputs import make_inputs
    from hopper_attn.harness import baselines
    problem = problems.sweep()[0]
    if backward:                 # a backward stage: its three launches; baselines' backward
        case = _backward_case(problem, args.seed, check=False)
        q, k, v = case.q, case.k, case.v
        tensors = (case.q, case.k, case.v, case.o, case.do, case.lse, case.dq, case.dk, case.dv)
    else:
        q, k, v, out = make_inputs(problem, args.seed)
        tensors = (q, k, v, out)
    for entry in entries:
        reason = entry.spec.unsupported_reason(problem)
        if reason:
            print(f"skip {entry.name}: {reason}")
            continue
        handle = entry.compile(problem)
        args_ = tensors if backward else (*entry.prepare(q, k, v), entry.output_for(handle, out))
        for _ in range(3):                      # warm-up outside the range
            entry.run(handle, *args_)
        torch.cuda.synchronize()
        name = f"{entry.name}__{problems.config_name(problem)}"
        with _nvtx_range(name):
            entry.run(handle, *args_)
        torch.cuda.synchronize()
        print(f"profiled {name}: ncu --nvtx --nvtx-include \"{name}/\" --set full "
              f"-o {name} python bench.py {entry.name} --profile")
    names = [b for b in args.baselines.split(",") if b]   # the baselines, each in its own range
    if backward:
        makers, _ = baselines.backward_available(names)
        found = {b: make(q, k, v, case.do, problem.causal) for b, make in makers.items()}
    else:
        found = {b: baselines.runner(fn, q, k, v, problem.causal)
                 for b, fn in baselines.available(names)[0].items()}
    for bname, fn in found.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        name = f"{bname}__{problems.config_name(problem)}"
        with _nvtx_range(name):
            fn()
        torch.cuda.synchronize()
        print(f"profiled {name}")
    return 0


def _backward_case(problem, seed: int, check: bool):
    """Inputs of one backward problem (with its fp32 reference when checking)."""
    from hopper_attn.harness.grad_check import BackwardCase
    return BackwardCase(problem, seed, reference=check)


def run(entries, args, backward: bool = False) -> int:
    import torch
    from hopper_attn.harness import baselines
    from hopper_attn.harness.checks import ReferenceCase
    from hopper_attn.harness.env import environment
    from hopper_attn.harness.inputs import make_inputs
    from hopper_attn.harness.timing import (L2Flush, benchmark, benchmark_interleaved,
                                            round_ratios, tflops)

    check = os.environ.get("CHECK", "0") not in ("", "0")
    env = environment()
    names = [b for b in args.baselines.split(",") if b]
    found, missing = (baselines.backward_available if backward else baselines.available)(names)
    for name, why in missing.items():
        print(f"baseline {name} unavailable: {why}")
    flush = L2Flush()
    rows, failures = [], []
    for problem in problems.sweep():
        flops = problem.flops * (2.5 if backward else 1.0)
        if backward:
            case = _backward_case(problem, args.seed, check)
            q, k, v, out = case.q, case.k, case.v, case.o
            tensors = (case.q, case.k, case.v, case.o, case.do, case.lse, case.dq, case.dk,
                       case.dv)
        elif check:
            case = ReferenceCase(problem, args.seed)
            q, k, v, out = case.q, case.k, case.v, case.out
            tensors = (q, k, v, out)
        else:
            q, k, v, out = make_inputs(problem, args.seed)
            tensors = (q, k, v, out)
        calls, timed, baseline_errors = {}, {}, {}
        for name, fn in found.items():
            if backward:
                calls[name] = fn(q, k, v, case.do, problem.causal)
            else:                          # (cudnn_fp8: quantized here, untimed)
                calls[name] = baselines.runner(fn, q, k, v, problem.causal)
                if check and hasattr(fn, "prepare"):
                    calls[name]()
                    torch.cuda.synchronize()
                    baseline_errors[name] = fp8_baseline_error(fn, case)
            if args.sequential:
                with _nvtx_range(f"{name}__{problems.config_name(problem)}"):
                    timed[name] = benchmark(calls.pop(name), flush)
        kernel_rows = []
        for entry in entries:
            row = {"kernel": entry.name, "baseline": False, "config": problem.as_dict()}
            reason = entry.spec.unsupported_reason(problem)
            if reason:
                kernel_rows.append({**row, "skipped": reason})
                continue
            try:
                handle = entry.compile(problem)
                row["compile_s"] = round(handle.compile_seconds, 2)
                row["kernel_config"] = handle.describe()
                if check:
                    verdict = case.check(entry, handle)
                    row["check"] = verdict
                    if not verdict["ok"]:
                        failures.append((entry.name, problem.label(), verdict))
                if not backward:        # k7's FP8 inputs: quantized here, outside the timing
                    tensors = (*entry.prepare(q, k, v), entry.output_for(handle, out))
                call = (lambda entry=entry, handle=handle, tensors=tensors:
                        entry.run(handle, *tensors))
                if not args.sequential:
                    calls[entry.name] = call
                else:
                    with _nvtx_range(f"{entry.name}__{problems.config_name(problem)}"):
                        timed[entry.name] = benchmark(call, flush)
            except Exception as exc:  # noqa: BLE001 - record and keep going, fail at the end
                kernel_rows.append({**row, "error": f"{type(exc).__name__}: {exc}"[:2000]})
                failures.append((entry.name, problem.label(), str(exc)[:300]))
                continue
            kernel_rows.append(row)
        if not args.sequential:             # everything of this config, round-robin
            timed.update(benchmark_interleaved(calls, flush))
        calls.clear()
        base_ms = {name: timed[name]["ms"] for name in found}
        for name in found:
            rows.append({"kernel": name, "baseline": True, "config": problem.as_dict(),
                         **timed[name], "tflops": tflops(flops, timed[name]["ms"]),
                         **({"check": baseline_errors[name]} if name in baseline_errors
                            else {})})
        for row in kernel_rows:
            t = timed.get(row["kernel"]) if "error" not in row and "skipped" not in row else None
            if t is not None:
                row.update(t, tflops=tflops(flops, t["ms"]),
                           ratios={b: ms / t["ms"] for b, ms in base_ms.items()})
                spreads = {b: round_ratios(timed[b], t) for b in found}
                if all(spreads.values()):       # round-robin: per-round medians and quartiles
                    row["ratios"] = {b: r["ratio"] for b, r in spreads.items()}
                    row["ratio_quartiles"] = {b: (r["q1"], r["q3"]) for b, r in spreads.items()}
            rows.append(row)
        del q, k, v, out, tensors
        if check or backward:
            del case
        torch.cuda.empty_cache()
        print(f"done {problem.label()}", file=sys.stderr, flush=True)
        if args.json:                       # rewritten after every config: partial runs count
            write_json(args.json, env, check, missing, rows)

    print(format_table(rows, list(found), env))
    ran = [r for r in rows if not r["baseline"] and "ms" in r]
    if not ran:                                     # say so, instead of an empty table
        reasons = sorted({r.get("skipped") or r.get("error", "") for r in rows
                          if not r["baseline"]})
        print("\nno kernel ran on this sweep: " + "; ".join(reasons))
    if args.json:
        print(f"wrote {args.json}")
    if failures:
        print("\nFAILED:")
        for name, label, why in failures:
            print(f"  {name} {label}: {why}")
        return 1
    return 0


def fp8_baseline_error(baseline, case) -> dict:
    """An FP8 baseline's error on the inputs it quantized itself: against the fp32 reference
    on its dequantized inputs (its own error) and on the bf16 inputs (end to end)."""
    from hopper_attn.harness.reference import error_stats, reference_attention
    _, _, tensors, descales = baseline.last
    deq = [t.float() * s.reshape(()) for t, s in zip(tensors, descales)]
    ref = reference_attention(*deq, case.problem.causal)
    out = baseline.output()
    own, end = error_stats(out, ref), error_stats(out, case.ref)
    return {"max_abs": own["max_abs"], "mean_abs": own["mean_abs"], "nan": own["nan"],
            "end_to_end": end, "ref_max": float(ref.abs().max())}


def write_json(path, env, check, missing, rows):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        sweep_env = {k: os.environ[k] for k in ("SEQLEN", "HEADDIM", "CAUSAL", "DTYPE", "BATCH", "HEADS")
                     if os.environ.get(k)}
        json.dump({"env": env, "command": "python " + " ".join(sys.argv), "sweep_env": sweep_env,
                   "check": check,
                   "baselines_missing": missing, "rows": rows}, f, separators=(",", ":"))


def _ratio_cell(row, baseline: str) -> str:
    """'1.03±0.01' (median of per-round ratios ± half their interquartile range), or the
    plain ratio of medians when timed back to back."""
    ratio = row["ratios"].get(baseline, float("nan"))
    quartiles = row.get("ratio_quartiles", {}).get(baseline)
    if quartiles is None:
        return f"{ratio:.2f}"
    return f"{ratio:.2f}±{(quartiles[1] - quartiles[0]) / 2:.2f}"


def format_table(rows, baseline_names, env) -> str:
    head = f"{env.get('gpu')}, torch {env.get('torch')}, cutlass-dsl {env.get('cutlass_dsl')}, {env.get('date_utc')}"
    cols = "".join(f" {('x' + b.replace('sdpa_', ''))[:10]:>10}" for b in baseline_names)
    lines = [head, f"{'config':34} {'kernel':7} {'ms':>9} {'TFLOP/s':>8}{cols} {'err/torch':>9} {'compile s':>9}"]
    for r in rows:
        c = r["config"]
        config = (f"B{c['batch']} H{c['heads']} N{c['seqlen']} d{c['head_dim']} "
                  f"{'causal' if c['causal'] else 'full'}{'' if c['dtype'] == 'bf16' else ' ' + c['dtype']}")
        if r.get("skipped") or r.get("error"):
            lines.append(f"{config:34} {r['kernel']:7} {'skipped: ' + r['skipped'] if r.get('skipped') else 'ERROR: ' + r['error'][:80]}")
            continue
        if r["baseline"]:
            lines.append(f"{config:34} {r['kernel'][:7]:7} {r['ms']:9.3f} {r['tflops']:8.1f}")
            continue
        ratios = "".join(f" {_ratio_cell(r, b):>10}" for b in baseline_names)
        err = f"{r['check']['error_ratio']:9.2f}" if r.get("check") else f"{'-':>9}"
        lines.append(f"{config:34} {r['kernel']:7} {r['ms']:9.3f} {r['tflops']:8.1f}{ratios} {err} "
                     f"{r.get('compile_s', 0):9.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        entries = registry.resolve(args.kernels)
        problems.sweep()                    # the sweep's environment variables, checked early
        problems.dtypes()
    except ValueError as exc:
        print(f"bench.py: {exc}", file=sys.stderr)
        return 2
    if args.baselines is None:
        args.baselines = DEFAULT_BASELINES
        if any(e.spec.input_dtype is not None for e in entries):    # k7, k8
            args.baselines += ",cudnn_fp8"
    if args.compile_only:
        return compile_only(entries)
    import torch
    if not torch.cuda.is_available():
        print("No CUDA device here. The kernels need a Hopper GPU (sm_90a) to run; on this machine\n"
              "you can still compile them and see registers, SMEM and spills:\n"
              f"    python bench.py {' '.join(args.kernels)} --compile-only")
        return 2
    backward = [e.name.split(":")[0] in registry.BACKWARD_KERNELS for e in entries]
    if any(backward) and not all(backward):
        print("bench.py: time forward and backward stages in separate runs "
              f"(backward: {', '.join(registry.BACKWARD_KERNELS)})", file=sys.stderr)
        return 2
    if args.profile:
        return profile(entries, args, backward=all(backward))
    return run(entries, args, backward=all(backward))


if __name__ == "__main__":
    sys.exit(main())
