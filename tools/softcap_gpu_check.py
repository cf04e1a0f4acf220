"""Logit softcapping on the GPU (issue 61): `source .gpu/prelude.sh && python tools/softcap_gpu_check.py`.
Correctness (tests/test_softcap.check_softcap: o, dq, dk, dv vs fp32, PASS within 2x torch's bf16 error), then
round-robin median ms (L2 flushed): k6 softcap 50 / none / softcap_f16 (tanh.approx.f16x2) / FA4 softcap 50,
forward and forward + backward (d 256: forward only, kb2 has no d 256). JSON: $OUT/softcap.json."""
import json, os, sys
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [root, os.path.join(root, "tests")]
import torch, hopper_attn  # noqa: E402
from test_softcap import check_softcap, within  # noqa: E402
from hopper_attn.harness.timing import L2Flush, benchmark_interleaved  # noqa: E402
res = {"correct": [], "speed": {}}
for d, causal, n, cap, mag, hkv, bwd in [(64, True, 1000, 50., 1, 2, 1), (64, False, 17, 15., 6, 4, 1),
        (128, False, 113, 15., 6, 2, 1), (128, True, 1000, 50., 8, 2, 1), (128, True, 1, 50., 1, 4, 1),
        (256, True, 1000, 50., 6, 2, 0), (256, False, 17, 15., 1, 2, 0), (96, True, 113, 50., 8, 4, 0),
        (192, False, 1000, 15., 6, 2, 0)]:
    e = check_softcap(d, causal, n, cap, mag, hkv, backward=bool(bwd))
    res["correct"].append([d, causal, n, cap, mag, hkv, e, within(e)])
    print(f"d{d} {'causal' if causal else 'full'} N{n} cap {cap} x{mag} kv {hkv}:", "PASS" if within(e) else f"FAIL {e}")
def fa4(q, k, v, causal, cap):
    from flash_attn.cute.interface import flash_attn_func
    out = flash_attn_func(q, k, v, causal=causal, softcap=cap)
    return out[0] if isinstance(out, tuple) else out
ours = lambda cap, stage=None: lambda q, k, v, c: hopper_attn.attention(q, k, v, causal=c, softcap=cap, stage=stage)  # noqa: E731
for label, B, H, Hkv, N, d, causal, bwd in [("d128 causal N16k B1 H16", 1, 16, 16, 16384, 128, True, True),
                                            ("d256 GQA 2:1 N8k B1 H16", 1, 16, 8, 8192, 256, False, False)]:
    q, do = (torch.randn(B, N, H, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, N, Hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    provs = {"cap50": ours(50.0), "none": ours(0.0), "cap50_f16": ours(50.0, "k6:softcap_f16=1"),
             "fa4_cap50": lambda q, k, v, c: fa4(q, k, v, c, 50.0), "fa4_none": lambda q, k, v, c: fa4(q, k, v, c, 0.0)}
    for what in ("fwd", "fwd+bwd") if bwd else ("fwd",):
        fns = {n: (lambda f=f: f(q, k, v, causal)) if what == "fwd" else
               (lambda f=f: torch.autograd.grad(f(*leaves, causal), leaves, do)) for n, f in provs.items()}
        ms = {n: t["ms"] for n, t in benchmark_interleaved(fns, L2Flush()).items()}
        res["speed"][f"{label} {what}"] = ms
        print(f"{label} {what} ms:", " ".join(f"{n} {t:.3f}" for n, t in ms.items()),
              f"| cap50/none {ms['cap50'] / ms['none']:.3f} fa4_cap50/cap50 {ms['fa4_cap50'] / ms['cap50']:.2f}")
os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "softcap.json"), "w"), indent=1, default=str)
