"""Softcap on the GPU (issue 61): `source .gpu/prelude.sh && python tools/softcap_gpu_check.py`. Correctness (test_softcap.check_softcap:
o, dq, dk, dv vs fp32, PASS within 2x torch's bf16 error); round-robin median ms: k6 softcap 50 (bf16 d 128 / 256: POLICY's exponents against a
fixed 0) / none / FA4 cap 50 and none, fwd and fwd+bwd (d 256's backward: kb2's swapped tile). JSON: $OUT/softcap.json."""
import os, sys
sys.path[:0] = [root := os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.join(root, "tests")]
import torch, hopper_attn; from test_softcap import check_softcap, within  # noqa: E402, E702
from hopper_attn.harness.timing import L2Flush, benchmark_interleaved; from hopper_attn.harness.env import environment; from hopper_attn.harness import baselines  # noqa
from hopper_attn.harness.gpu_check import env_line, write_json; res = {"env": environment(), "correct": [], "speed": {}}; print(env_line(res["env"]))  # noqa
for case in [(64, True, 1000, 50., 1, 2, 1), (64, False, 17, 15., 6, 4, 1),
        (128, False, 113, 15., 6, 2, 1), (128, True, 1000, 50., 8, 2, 1), (128, True, 1, 50., 1, 4, 1),
        (256, True, 1000, 50., 6, 2, 1), (256, False, 17, 15., 1, 2, 1), (96, True, 113, 50., 8, 4, 0),
        (192, False, 1000, 15., 6, 2, 0)] + [(d, True, 1000, 50., m, 2, 0) for d in (128, 256) for m in (1, 6)]:
    e = check_softcap(*case[:6], backward=bool(case[6]))
    res["correct"].append([*case, e, within(e)])
    print(*case, "PASS" if within(e) else f"FAIL {e}")
def fa4(q, k, v, causal, cap): return baselines.fa4(softcap=cap)(q, k, v, causal)  # noqa: E704
def ok(name, f):                # a provider that fails (FA4 without a case) is left out
    try: return f() is not None or True  # noqa: E701
    except Exception as e: return print(name, "left out:", repr(e)[:150])  # noqa: E701
ours = lambda cap, stage=None: lambda q, k, v, c: hopper_attn.attention(q, k, v, causal=c, softcap=cap, stage=stage)  # noqa: E731
for label, B, H, Hkv, N, d, causal, bwd in [("d128 causal N16k B1 H16", 1, 16, 16, 16384, 128, True, True),
                                            ("d256 GQA 2:1 causal N8k B1 H16", 1, 16, 8, 8192, 256, True, True)]:
    q, do, k, v = (torch.randn(B, N, h, d, device="cuda", dtype=torch.bfloat16) for h in (H, H, Hkv, Hkv))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    provs = {"cap50": ours(50.0), "none": ours(0.0),
             "fa4_cap50": lambda q, k, v, c: fa4(q, k, v, c, 50.0), "fa4_none": lambda q, k, v, c: fa4(q, k, v, c, 0.0)}
    for what in ("fwd", "fwd+bwd") if bwd else ("fwd",):
        fns = {n: (lambda f=f: f(q, k, v, causal)) if what == "fwd" else
               (lambda f=f: torch.autograd.grad(f(*leaves, causal), leaves, do)) for n, f in provs.items()}
        fns = {n: f for n, f in fns.items() if ok(n, f)}
        res["speed"][f"{label} {what}"] = ms = {n: t["ms"] for n, t in benchmark_interleaved(fns, L2Flush()).items()}
        print(f"{label} {what} ms:", " ".join(f"{n} {t:.3f}" for n, t in ms.items()),
              f"| cap50/none {ms['cap50'] / ms['none']:.3f} fa4_cap50/cap50 {ms.get('fa4_cap50', 0) / ms['cap50']:.2f}")
print("wrote", write_json(res, "softcap.json"))
