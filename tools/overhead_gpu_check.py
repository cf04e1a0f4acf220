"""Host vs GPU us per call (B1 16/4 d128 causal: host = enqueue time, GPU = calls back to back behind a sleep), gradients in the layouts the overhead branch reads in place (max error / (2x SDPA-bf16's + max|ref|/4096) vs fp32, <= 1 passes), the provider's decode split by layer, the models probe; JSON to $OUT/overhead.json."""
import os, statistics as st, sys, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout
import torch, torch.nn.functional as F, hopper_attn  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel; from hopper_attn.harness import models; from hopper_attn.integrations import sdpa as hs, transformers as htf  # noqa: E402
from hopper_attn.harness.env import environment; from hopper_attn.harness.gpu_check import env_line, write_json  # noqa: E402
T, res, grad, bf = lambda t: t.transpose(1, 2), {"env": environment(), "host_gpu_us": {}, "grad_ratio": {}}, torch.autograd.grad, dict(device="cuda", dtype=torch.bfloat16); print(env_line(res["env"]))
def ratio(got, ref, base): return [round(((g.float() - r).abs().max() / (2 * (b.float() - r).abs().max() + r.abs().max() / 4096)).item(), 3) for g, r, b in zip(got, ref, base)]
def sdpa(q, k, v, c=True): return T(F.scaled_dot_product_attention(T(q), T(k), T(v), is_causal=c, enable_gqa=True))
def provider(q, k, v, c=True):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION): return sdpa(q, k, v, c)
ops = {"hopper_attn": lambda q, k, v: hopper_attn.attention(q, k, v, causal=True), "sdpa": sdpa, "sdpa_provider": provider,
       "transformers": lambda q, k, v: htf.hopper_attention_forward(type("M", (), {"is_causal": True})(), T(q), T(k), T(v), None)[0]}
def times(fn, n=10):
    fn(); torch.cuda.synchronize(); host, s, e = [], torch.cuda.Event(True), torch.cuda.Event(True); torch.cuda._sleep(100_000_000); s.record()  # ~50 ms asleep: the host runs ahead
    for _ in range(n): t0 = time.perf_counter(); fn(); host.append(time.perf_counter() - t0)
    e.record(); torch.cuda.synchronize(); return round(st.median(host) * 1e6, 1), round(s.elapsed_time(e) * 1e3 / n, 1)
for n in (1024, 4096):
    q, k, v, do = (torch.randn(1, n, h, 128, **bf, requires_grad=True) for h in (16, 4, 4, 16))
    f32 = [t.detach().float().requires_grad_() for t in (q, k, v)]; ref, base = grad(sdpa(*f32), f32, do.float()), grad(sdpa(q, k, v), (q, k, v), do)
    for name, op in ops.items():
        hs.activate() if name == "sdpa_provider" else hs.deactivate() if hs.is_active() else None
        with torch.no_grad(): res["host_gpu_us"][f"{name} fwd N{n}"] = times(lambda: op(q, k, v))
        res["host_gpu_us"][f"{name} fwd+bwd N{n}"] = times(lambda: grad(op(q, k, v), (q, k, v), do))
        for layout, make in (("bnhd", lambda t: t), ("bhnd memory", lambda t: T(T(t).contiguous()))):   # the latter: strided
            res["grad_ratio"][f"{name} N{n} {layout}"] = ratio(grad(op(*[make(t) for t in (q, k, v)]), (q, k, v), do), ref, base)
    res["grad_ratio"][f"hopper_attn N{n} sum loss (stride-0 dout)"] = ratio(grad(ops["hopper_attn"](q, k, v).sum(), (q, k, v)), grad(sdpa(*f32).sum(), f32), grad(sdpa(q, k, v).sum(), (q, k, v)))
q1, kc = torch.randn(1, 1, 16, 128, **bf), torch.randn(1, 2304, 4, 128, **bf); hs.activate()   # decode: where the provider's time goes
for name, fn in (("attention", lambda: hopper_attn.attention(q1, kc, kc)), ("provider F.sdpa", lambda: provider(q1, kc, kc, False)), ("provider aten op", lambda: torch.ops.aten._scaled_dot_product_flash_attention(T(q1), T(kc), T(kc))), ("provider run_forward", lambda: hs.run_forward(T(q1), T(kc), T(kc), 0.0, False, False, None))): res["host_gpu_us"][f"decode 1x2304 {name}"] = times(fn, 50)
hs.deactivate(); res["probe"] = models.bench_probe(["sdpa", "hopper_attn", "sdpa_provider"], 16, 4, 128, [4096], [(1, 2304), (1, 32768)])
res["pass"], res["provider_counts"] = all(r <= 1 for v in res["grad_ratio"].values() for r in v), hs.counts(); [print(key, val) for part in ("host_gpu_us", "grad_ratio") for key, val in res[part].items()]; models._print_rows(res["probe"]); print("PASS" if res["pass"] else "FAIL", res["provider_counts"])
print("wrote", write_json(res, "overhead.json"))
