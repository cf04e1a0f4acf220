"""Host and GPU microseconds per call of the decode and training paths on the GPU (what
tools/host_path_profile.py measures on the CPU with the launches stubbed), one line each;
JSON to $OUT/host_path.json.

    python tools/host_path_gpu_check.py            # 200 calls per path
    python tools/host_path_gpu_check.py --quick    # 20 calls per path (< 2 min with compiles)

Host us: the median time to enqueue one call while the GPU sleeps behind a
torch.cuda._sleep (so the host never waits on the GPU). GPU us: the calls back to back
between two events, divided by their count. Decode shapes (bf16, d 128): B1, one query,
Hq 32 / Hkv 8, 4096 keys; `+1 key per call`: a generation step (views of a longer buffer,
a new key count each call). Training: attention(causal) forward + backward, B1 N 1024
(Hq 16 / Hkv 4, as tools/overhead_gpu_check.py). Also checks each decode output against
SDPA (max abs error < 2e-2: a smoke test, not the accuracy check).
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # checkout

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def times(fn, calls: int) -> tuple:
    fn()
    torch.cuda.synchronize()
    host, start, end = [], torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda._sleep(int(2e6) * calls)          # ~1 ms asleep per call: the host runs ahead
    start.record()
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
    end.record()
    torch.cuda.synchronize()
    return round(statistics.median(host) * 1e6, 1), round(start.elapsed_time(end) * 1e3
                                                           / calls, 1)


def profile(fn, calls: int) -> str:
    """cProfile of `calls` calls (after one warm-up), the top 20 functions by own time."""
    import cProfile
    import io
    import pstats
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
    return "\n".join(line[:150] for line in text.getvalue().splitlines()[6:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--profile", default="",
                        help="comma-separated path names: cProfile each one's timed calls, "
                             "top 20 by own time printed and in the JSON")
    args = parser.parse_args()
    import hopper_attn
    from hopper_attn.harness.env import environment
    from hopper_attn.harness.gpu_check import env_line, write_json
    from hopper_attn.integrations import sdpa as hopper_sdpa
    from torch.nn.attention import SDPBackend, sdpa_kernel
    calls = 20 if args.quick else 200
    env = environment()
    print(env_line(env))
    bf = dict(device="cuda", dtype=torch.bfloat16)
    keys, longest = 4096, 4096 + 4 * calls + 16
    q = torch.randn(1, 1, 32, 128, **bf)
    k_buf, v_buf = (torch.randn(1, longest, 8, 128, **bf) for _ in range(2))
    k, v = k_buf[:, :keys].contiguous(), v_buf[:, :keys].contiguous()
    T = lambda t: t.transpose(1, 2)                               # noqa: E731
    sq, sk, sv = T(q), T(k), T(v)
    s_kbuf, s_vbuf = T(k_buf).contiguous(), T(v_buf).contiguous()   # (B, H, N, d) caches
    seqlens = torch.full((1,), keys, dtype=torch.int32, device="cuda")
    k_paged, v_paged = (t.view(keys // 16, 16, 8, 128) for t in (k, v))
    table = torch.arange(keys // 16, dtype=torch.int32, device="cuda").view(1, -1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    grow = [keys]

    def attn_grow():
        grow[0] = grow[0] + 1 if grow[0] < longest else keys
        hopper_attn.attention(q, k_buf[:, :grow[0]], v_buf[:, :grow[0]])

    def provider_grow():
        grow[0] = grow[0] + 1 if grow[0] < longest else keys
        flash(sq, s_kbuf[:, :, :grow[0]], s_vbuf[:, :, :grow[0]], 0.0, False, False)

    def sdpa_inside():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(sq, sk, sv, enable_gqa=True)

    n = 1024
    tq, tdo = (torch.randn(1, n, 16, 128, **bf) for _ in range(2))
    tk, tv = (torch.randn(1, n, 4, 128, **bf) for _ in range(2))
    tq, tk, tv = (t.requires_grad_() for t in (tq, tk, tv))

    def train():
        torch.autograd.grad(hopper_attn.attention(tq, tk, tv, causal=True), (tq, tk, tv), tdo)

    decode = {
        "attention decode 4k": lambda: hopper_attn.attention(q, k, v),
        "attention decode +1 key per call": attn_grow,
        "attention decode 4k view of a longer cache": lambda: hopper_attn.attention(
            q, k_buf[:, :keys], v_buf[:, :keys]),
        "kvcache contiguous 4k": lambda: hopper_attn.attention_with_kvcache(q, k, v, seqlens),
        "kvcache page 16 4k": lambda: hopper_attn.attention_with_kvcache(
            q, k_paged, v_paged, seqlens, page_table=table),
        "provider aten op 4k": lambda: flash(sq, sk, sv, 0.0, False, False),
        "provider aten op +1 key per call": provider_grow,
        "provider run_forward 4k": lambda: hopper_sdpa.run_forward(sq, sk, sv, 0.0, False,
                                                                   False, None),
        "provider F.sdpa, sdpa_kernel per call": sdpa_inside,
    }
    res = {"env": env, "calls": calls, "host_gpu_us": {}, "max_abs_error": {}}
    ref = F.scaled_dot_product_attention(sq, sk, sv, enable_gqa=True).transpose(1, 2)
    hopper_sdpa.activate()
    try:
        with torch.no_grad():
            checks = {"attention decode 4k": decode["attention decode 4k"],
                      "kvcache contiguous 4k": decode["kvcache contiguous 4k"],
                      "kvcache page 16 4k": decode["kvcache page 16 4k"],
                      "provider aten op 4k": lambda: T(flash(sq, sk, sv, 0.0, False,
                                                             False)[0])}
            for name, fn in checks.items():
                res["max_abs_error"][name] = (fn().float() - ref.float()).abs().max().item()
            for name, fn in decode.items():
                res["host_gpu_us"][name] = times(fn, calls)
            for name in filter(None, args.profile.split(",")):
                res.setdefault("profiles", {})[name] = profile(decode[name], calls)
                print(f"--- cProfile {name}, {calls} calls, by own time\n"
                      + res["profiles"][name])
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):   # (selected once, as a model would)
                res["host_gpu_us"]["provider F.sdpa, flash selected once"] = times(
                    lambda: F.scaled_dot_product_attention(sq, sk, sv, enable_gqa=True),
                    calls)
        counts = hopper_sdpa.counts()
    finally:
        hopper_sdpa.deactivate()
    res["host_gpu_us"]["attention fwd+bwd N1024 16/4 causal"] = times(train, calls // 4 or 1)
    res["provider_counts"] = counts
    for name, (host, gpu) in res["host_gpu_us"].items():
        print(f"{name:<40} host {host:7.1f} us  GPU {gpu:7.1f} us")
    res["pass"] = all(e < 2e-2 for e in res["max_abs_error"].values())
    print("max abs error", {k: round(e, 4) for k, e in res["max_abs_error"].items()},
          "PASS" if res["pass"] else "FAIL", counts)
    print("wrote", write_json(res, "host_path.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
