"""k6's `round_once` column on and off, on the GPU (docs/softcap.md "P converted once"):

    source .gpu/prelude.sh && python tools/round_once_gpu_check.py [--quick] [--out DIR]

round_once converts P to the PV operand once and sums l from the operand's registers (before
the next tile's K wait) instead of rounding P in the softmax and converting it again; l adds
the same values in the same order, so O and the LSE must not change by a bit. POLICY turns
it on at d 128 with softcap's fixed 0 (k6.settings_for); a column of k6.BASE, not an option:
each arm is settings_for's row compiled through FlashAttentionK6 with round_once off / on.

1. Bits: O and the LSE with round_once equal to without (torch.equal), over the loops that
   round P: softcap 15 / 50 at d 128 and 256 (fixed 0), d 192 and 256 without a cap (lazy
   rescaling, bf16 and fp16), a window at d 192, GQA, lengths 1-1000, inputs x1 and x6.
2. Speed (skipped with --quick): round-robin median ms, L2 flushed, forward only: off, on
   and the call without a cap, at d 128 cap 50 causal N 16k and N 4k (where it is on) and
   d 256 GQA 2:1 cap 50 (off: the d 192 / 256 loops measured 1.00-1.05x with it).

Prints one line per case; JSON: $OUT/round_once.json (or --out DIR)."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from hopper_attn import k6  # noqa: E402
from hopper_attn.common.contract import Problem, compile_attention, run_attention  # noqa: E402
from hopper_attn.harness.env import environment  # noqa: E402
from hopper_attn.harness.gpu_check import env_line, write_json  # noqa: E402
from hopper_attn.harness.timing import L2Flush, benchmark_interleaved  # noqa: E402

BF16, F16 = torch.bfloat16, torch.float16
# d, causal, seqlen, cap, dtype, heads, heads_kv, input magnitude, window (None: none)
BITS = [(128, True, 1000, 50.0, BF16, 4, 4, 1.0, None),
        (128, True, 1000, 50.0, BF16, 4, 4, 6.0, None),
        (128, False, 113, 15.0, BF16, 4, 2, 6.0, None),
        (128, True, 1, 50.0, BF16, 4, 4, 1.0, None),
        (128, False, 4096, 50.0, BF16, 8, 8, 1.0, None),     # the after7 + stream-K row
        (256, True, 1000, 50.0, BF16, 4, 2, 6.0, None),
        (256, False, 17, 15.0, BF16, 4, 4, 1.0, None),
        (192, True, 1000, 0.0, BF16, 4, 4, 6.0, None),
        (192, False, 777, 0.0, F16, 4, 2, 1.0, None),
        (256, False, 1000, 0.0, BF16, 4, 4, 6.0, None),
        (256, True, 1000, 0.0, F16, 4, 4, 1.0, None),
        (192, True, 1000, 0.0, BF16, 4, 4, 1.0, (255, 0))]
# label, batch, heads, heads_kv, seqlen, d, causal, cap
SPEED = [("d128 causal N16k B1 H16 cap50", 1, 16, 16, 16384, 128, True, 50.0),
         ("d128 N4k B4 H16 cap50", 4, 16, 16, 4096, 128, False, 50.0),
         ("d256 GQA 2:1 causal N8k B1 H16 cap50", 1, 16, 8, 8192, 256, True, 50.0)]


def arm(q, k, v, causal, cap, once, window=None):
    """k6 (the problem's POLICY row, softcap `cap`) with round_once `once`: a callable that
    returns (O, LSE)."""
    batch, n, heads, d = q.shape
    left, right = window if window else (None, None)
    problem = Problem(batch, heads, n, d, causal, q.dtype, heads_kv=k.shape[2],
                      window_left=left, window_right=None if causal else right)
    settings = {**k6.settings_for(problem, softcap=cap), "round_once": once}
    handle = compile_attention(k6.SPEC, k6.FlashAttentionK6, problem, settings,
                               workspace_fn=k6.lse_buffer)
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, n, device=q.device, dtype=torch.float32)

    def run():
        run_attention(handle, q, k, v, out, lse=lse)
        return out, lse
    return run


def bits(case):
    d, causal, n, cap, dtype, heads, heads_kv, scale, window = case
    gen = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v = (torch.randn(2, n, h, d, device="cuda", dtype=dtype, generator=gen) * s
               for h, s in ((heads, scale), (heads_kv, scale), (heads_kv, 1.0)))
    o0, lse0 = (t.clone() for t in arm(q, k, v, causal, cap, False, window)())
    o1, lse1 = arm(q, k, v, causal, cap, True, window)()
    return (torch.equal(o0, o1) and torch.equal(lse0, lse1),
            {"o": (o0.float() - o1.float()).abs().max().item(),
             "lse": (lse0 - lse1).abs().nan_to_num(0.0).max().item()})


def speed(label, batch, heads, heads_kv, n, d, causal, cap):
    q, k, v = (torch.randn(batch, n, h, d, device="cuda", dtype=BF16)
               for h in (heads, heads_kv, heads_kv))
    fns = {"off": arm(q, k, v, causal, cap, False), "on": arm(q, k, v, causal, cap, True),
           "no_cap": arm(q, k, v, causal, 0.0, False)}
    return {name: t["ms"] for name, t in benchmark_interleaved(fns, L2Flush()).items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="bits only")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    res = {"env": environment(), "bits": [], "speed": {}}
    print(env_line(res["env"]))
    failed = 0
    for case in BITS:
        same, diff = bits(case)
        failed += not same
        d, causal, n, cap, dtype, heads, heads_kv, scale, window = case
        res["bits"].append({"d": d, "causal": causal, "seqlen": n, "softcap": cap,
                            "dtype": str(dtype), "heads": heads, "heads_kv": heads_kv,
                            "scale": scale, "window": window, "identical": same, "max_diff": diff})
        print(f"bits d{d} causal={int(causal)} N{n} cap{cap:g} {str(dtype)[6:]} H{heads}/{heads_kv}"
              f" x{scale:g}{' window' + str(window) if window else ''}:",
              "IDENTICAL" if same else f"DIFFER {diff}")
    if not args.quick:
        for label, *shape in SPEED:
            ms = res["speed"][label] = speed(label, *shape)
            print(f"{label} ms: " + " ".join(f"{k} {t:.3f}" for k, t in ms.items())
                  + f" | on/off {ms['on'] / ms['off']:.3f}")
    res["failed"] = failed
    print(("PASS" if not failed else f"FAIL: {failed} cases differ"), "wrote",
          write_json(res, "round_once.json", args.out))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
