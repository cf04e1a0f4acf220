"""GPU check of kb2's deterministic backward with a sliding window (issues 61 / 63).

    source .gpu/prelude.sh && python tools/detwin_gpu_check.py [--quick] [--out DIR]

With a window's left side a query tile's dQ adds come from kv tiles n_first .. n_last, and
the deterministic mode's writer waits for n - n_first (KVTileSchedule.dq_turn_first;
docs/window.md). A wrong n_first hangs the GPU (a turn never comes) or changes the order;
so every case runs under a watchdog: its launches, then torch.cuda.synchronize in a thread
given HANG_S seconds (the first case of each configuration also its JIT compiles, outside
that wait), and a case that runs past CASE_S in all; either way the script prints which
case hung, writes what it has to the JSON and exits with status 3.

1. Correctness through `hopper_attn.attention(..., deterministic=True, window_size=...)
   .backward()`: d 64, 96 and 128 (192 too where kb2 takes a window there), MHA 4/4, GQA
   8/2 and MQA 4/1, windows (127, 0), (3, 0), (0, 0) and a left side past both lengths
   (5000, 0) causal and not, (256, 256) and (5000, 64) without causal; lengths 17, 113,
   1000, 2100 and the cross lengths 300 / 1000, 1000 / 300, 113 / 2100, 2100 / 700 (batch
   2). dQ, dK, dV against the fp32 reference with the window's mask within 2x torch's own
   bf16 error (+ 2^-12 max |ref|: harness/window_reference.gradient_errors, FlashAttention's
   rule); `ratio` = error / bound; and a second run: the same bits. --quick: each
   configuration on two of the lengths (one square, one cross), the full run on all eight.
2. Speed (skipped with --quick): B1 H16 d 128 N 16k causal windows (4095, 0) and (127, 0),
   the backward alone (autograd.grad of a kept graph), default against deterministic,
   CUDA events, L2 flushed, round-robin medians.

Prints one line per case; everything goes to $OUT/detwin.json (or --out).
"""

from __future__ import annotations

import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import hopper_attn  # noqa: E402
from hopper_attn.harness.gpu_check import run_check, write_json  # noqa: E402
from hopper_attn.harness.window_reference import gradient_errors, window_inputs  # noqa: E402

GROUPS = [("MHA", 4, 4), ("GQA 4:1", 8, 2), ("MQA", 4, 1)]
# (causal, window); right 0 with causal
WINDOWS = [(True, (127, 0)), (True, (3, 0)), (True, (0, 0)), (True, (5000, 0)),
           (False, (127, 0)), (False, (3, 0)), (False, (0, 0)), (False, (256, 256)),
           (False, (5000, 64))]
LENGTHS = [(17, 17), (113, 113), (1000, 1000), (2100, 2100), (300, 1000), (1000, 300),
           (113, 2100), (2100, 700)]
# --quick: (head dim, groups, windows), each configuration on two lengths
QUICK_PLAN = [(128, ("MHA",), WINDOWS),
              (128, ("GQA 4:1", "MQA"), [WINDOWS[0], WINDOWS[1], WINDOWS[7], WINDOWS[6]]),
              (64, ("MHA", "MQA"), [WINDOWS[0], WINDOWS[7]]),
              (64, ("MHA",), [WINDOWS[2], WINDOWS[8]]),
              (96, ("MHA", "GQA 4:1"), [WINDOWS[1], WINDOWS[7]]),
              (96, ("MHA",), [WINDOWS[3], WINDOWS[5]]),
              (192, ("MHA", "MQA"), [WINDOWS[0], WINDOWS[7]])]
HANG_S = 30             # a case's kernels (after its launches) may take this long
CASE_S = 240            # a case in all, JIT compiles included
QUICK = "--quick" in sys.argv
ROWS: list = []         # what the watchdog writes if a case hangs


def _hung(label: str) -> None:
    print(f"HANG: {label} did not finish (watchdog); exiting with status 3", flush=True)
    try:
        args = sys.argv[1:]
        out = next((a.split("=", 1)[1] for a in args if a.startswith("--out=")), None)
        if "--out" in args[:-1]:
            out = args[args.index("--out") + 1]
        path = write_json({"hang": label, "correctness": ROWS, "all_pass": False},
                          "detwin.json", out)
        print(f"wrote {path}", flush=True)
    finally:
        os._exit(3)


def _synchronize(label: str) -> None:
    """torch.cuda.synchronize, given HANG_S seconds (a thread: a hung kernel never returns)."""
    done, failed = threading.Event(), []

    def wait():
        try:
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - raised in the caller's thread
            failed.append(exc)
        done.set()
    threading.Thread(target=wait, daemon=True).start()
    if not done.wait(HANG_S):
        _hung(label)
    if failed:
        raise failed[0]


def _grads(q, k, v, do, causal, window, label):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    hopper_attn.attention(*leaves, causal=causal, window_size=window,
                          deterministic=True).backward(do)
    _synchronize(label)
    return [t.grad for t in leaves]


def check_case(batch, nq, nk, heads, heads_kv, d, causal, window, seed) -> dict:
    label = f"d{d} {heads}/{heads_kv} {nq}/{nk} {'causal' if causal else 'full'} {window}"
    q, k, v = window_inputs(batch, nq, nk, heads, heads_kv, d, seed)
    do = torch.randn(batch, nq, heads, d, device="cuda").to(torch.bfloat16)
    grads = _grads(q, k, v, do, causal, window, label)
    again = _grads(q, k, v, do, causal, window, label + " (second run)")
    same = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
               for a, b in zip(grads, again))
    right = 0 if causal else window[1]
    errors = gradient_errors(q, k, v, do, grads, window[0], right, d ** -0.5)
    ratio, ok = {}, same
    for name, grad in zip("qkv", grads):
        err, _, bound = errors[name]
        nan = bool(grad.isnan().any())
        ratio[name] = float("inf") if nan else err / bound
        ok &= not nan and ratio[name] <= 1
    return {"case": [batch, nq, nk, heads, heads_kv, d, causal, list(window)], "label": label,
            "ratio": ratio, "errors": errors, "same_bits": same, "ok": ok}


def _dims() -> list:
    from hopper_attn import stages
    from hopper_attn.common.contract import Problem
    spec = stages.get("kb2").spec
    return [d for d in (64, 96, 128, 192)
            if spec.unsupported_reason(Problem(1, 4, 1000, d, True, window_left=127)) is None]


def _plan(dims) -> list:
    """(d, group, causal, window, lengths) of every configuration."""
    groups = {label: (heads, heads_kv) for label, heads, heads_kv in GROUPS}
    plan = QUICK_PLAN if QUICK else [(d, tuple(groups), WINDOWS) for d in dims]
    configs, turn = [], 0
    for d, labels, windows in plan:
        for label in labels if d in dims else ():
            for causal, window in windows:
                turn += 1       # --quick: one square and one cross length, rotating
                lengths = [LENGTHS[turn % 4], LENGTHS[4 + turn % 4]] if QUICK else LENGTHS
                configs.append((d, label, *groups[label], causal, window, lengths))
    return configs


def correctness(log) -> list:
    dims = _dims()
    log(f"  head dims with a windowed kb2: {dims}")
    seed = 0
    for d, label, heads, heads_kv, causal, window, lengths in _plan(dims):
        for nq, nk in lengths:
            seed += 1
            case = [2, nq, nk, heads, heads_kv, d, causal, list(window)]
            timer = threading.Timer(CASE_S, _hung, (f"d{d} {label} {nq}/{nk} {window} "
                                                    f"(in all)",))
            timer.start()
            try:
                row = check_case(*case[:7], window, seed)
            except Exception as exc:  # noqa: BLE001 - one failing case, not the run
                row = {"case": case, "ok": False, "ratio": {},
                       "exception": f"{type(exc).__name__}: {str(exc)[:200]}"}
            finally:
                timer.cancel()
            ROWS.append(row)
            text = (f"ratio dq {row['ratio']['q']:.2f} dk {row['ratio']['k']:.2f} "
                    f"dv {row['ratio']['v']:.2f} same bits {row['same_bits']}"
                    if row["ratio"] else row["exception"])
            log(f"  d{d} {label:7} {nq:4}/{nk:<4} {'causal' if causal else 'full':6} "
                f"{str(window):11} {text}  {'PASS' if row['ok'] else 'FAIL'}")
    return ROWS


def speed(log, t0) -> list:
    from hopper_attn.harness.timing import L2Flush, benchmark_interleaved
    flush, rows = L2Flush(), []
    for window in ((4095, 0), (127, 0)):
        q, k, v = window_inputs(1, 16384, 16384, 16, 16, 128, seed=7)
        do = torch.randn_like(q)
        calls = {}
        for name, deterministic in (("default", False), ("deterministic", True)):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out = hopper_attn.attention(*leaves, causal=True, window_size=window,
                                        deterministic=deterministic)
            calls[name] = (lambda o=out, ls=leaves: torch.autograd.grad(o, ls, do,
                                                                        retain_graph=True))
            calls[name]()
            _synchronize(f"speed {window} {name}")
        timed = benchmark_interleaved(calls, flush, target_ms=150, max_reps=30)
        row = {"shape": "B1 H16 d128 N16k causal", "window": list(window),
               "bwd_ms": {name: t["ms"] for name, t in timed.items()}}
        rows.append(row)
        ms = row["bwd_ms"]
        log(f"  bwd {row['shape']} {window}: default {ms['default']:.3f} ms, deterministic "
            f"{ms['deterministic']:.3f} ms ({ms['deterministic'] / ms['default']:.2f}x)")
    return rows


if __name__ == "__main__":
    sys.exit(run_check(__doc__, "detwin.json", correctness, speed,
                       "correctness (deterministic + window; ratio <= 1 and the same bits "
                       "twice pass):",
                       "speed (backward alone, round-robin medians):"))
