"""A kv-cache decode call to profile: B 256, 4k keys, Hq 32 / Hkv 8, d 128, an e4m3 (`fp8`) or
bf16 (`bf16`) cache, run three times; Nsight Compute takes the third
(results/h200/profiles/2026-11-29_ncu_kvcache_*; docs/kvcache.md):

    ncu --clock-control none --kernel-name regex:Decode --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
        --section SchedulerStats --section Occupancy --csv --page details \
        python tools/kvcache_profile.py fp8
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import hopper_attn  # noqa: E402

which = sys.argv[1]
B, N, H, HKV, D = 256, 4096, 32, 8, 128
q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
k = torch.randn(B, N, HKV, D, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
lens = torch.full((B,), N, dtype=torch.int32, device="cuda")
kw = {}
if which == "fp8":
    k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    kw = dict(k_descale=torch.ones(B, HKV, device="cuda"), v_descale=torch.ones(B, HKV, device="cuda"))
for _ in range(3):
    hopper_attn.attention_with_kvcache(q, k, v, lens, **kw)
torch.cuda.synchronize()
print(which, "ok")
