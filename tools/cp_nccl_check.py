"""The real ring over NCCL against the simulated ring, on a host with two or more GPUs.

    source .gpu/prelude.sh && torchrun --nproc-per-node 2 tools/cp_nccl_check.py
    # $OUT/cp_nccl_check.json

`tools/cp_gpu_check.py` judges the simulated ring (`simulate_ring`, all ranks' programs in
one process) against fp32 references by the tolerance rule. This check closes the gap to
the real transport: every rank runs `ring_attention` (or `ring_attention_varlen`) on its
slice over NCCL, rank 0 runs `simulate_ring` on the whole inputs, and each rank's output,
LSE, dQ, dK and dV rows are compared with the simulated ring's rows. Same kernels, same
schedule and merge order, so the two agree to the bit unless a kernel is nondeterministic
(the backward's dQ atomics); a case passes when the largest difference is at most the
simulated ring's own distance from the fp32 reference (the ring adds no error of its own).

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1), set before the process group starts.
"""

from __future__ import annotations

import json
import os
import sys

NCCL_SETTINGS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NCCL_SETTINGS)

import torch                                   # noqa: E402
import torch.distributed as dist               # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DENSE_CASES = (
    # (causal, heads_q, heads_kv, rows per rank, head_dim, layout)
    (True, 8, 2, 2048, 128, "zigzag"), (False, 8, 2, 2048, 128, "zigzag"),
    (True, 4, 4, 1000, 64, "zigzag"), (False, 8, 2, 1001, 128, "contiguous"),
)
PACKED_CASES = ((True, 8, 2, 1024, 128, "zigzag"), (False, 4, 2, 600, 128, "zigzag"))


def _grads(out, leaves, dout):
    for t in leaves:
        t.grad = None
    out.backward(dout)
    return [t.grad.float() for t in leaves]


def _documents(n: int, rows_per_rank: int, device):
    """One document longer than a rank's chunk, one of length 1, one empty, the rest short."""
    lengths = [rows_per_rank + 37, 1, 0]
    while sum(lengths) < n:
        lengths.append(min(97 + 13 * len(lengths), n - sum(lengths)))
    cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
    return cu


def run_case(case, packed: bool, rank: int, world: int):
    from hopper_attn import context_parallel as cp
    from hopper_attn.harness import reference_backward as ref
    causal, hq, hk, rows, d, layout = case
    n = rows * world
    gen = torch.Generator(device="cuda").manual_seed(1234 + n + hq + d)
    lead = () if packed else (1,)
    q, do = (torch.randn(*lead, n, hq, d, device="cuda", generator=gen).bfloat16()
             for _ in range(2))
    k, v = (torch.randn(*lead, n, hk, d, device="cuda", generator=gen).bfloat16()
            for _ in range(2))
    seq_dim = 0 if packed else 1
    cu = _documents(n, rows, q.device) if packed else None

    def shard(t, dim=seq_dim):
        return cp.split_sequence(t, world, layout, dim=dim)[rank]

    # the simulated ring on the whole inputs (every rank computes it: no broadcast needed)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if packed:
        out_s, lse_s = cp.simulate_ring_varlen(*leaves, cu, world, causal, layout=layout,
                                               return_lse=True)
    else:
        out_s, lse_s = cp.simulate_ring(*leaves, world, causal, layout=layout,
                                        return_lse=True)
    sim = [out_s.float(), lse_s.float()] + _grads(out_s, leaves, do)
    # the real ring on this rank's slice
    local = [shard(t).contiguous().requires_grad_() for t in (q, k, v)]
    if packed:
        out_r, lse_r = cp.ring_attention_varlen(*local, cu,
                                                causal=causal, layout=layout,
                                                return_lse=True)
    else:
        out_r, lse_r = cp.ring_attention(*local, causal=causal, layout=layout,
                                         return_lse=True)
    real = [out_r.float(), lse_r.float()] + _grads(out_r, local, shard(do).contiguous())
    lse_dim = 1 if packed else 2
    report = {}
    for name, a, b, dim in zip(("out", "lse", "dq", "dk", "dv"), real, sim,
                               (seq_dim, lse_dim, seq_dim, seq_dim, seq_dim)):
        b_rows = shard(b, dim)
        report[name] = (a - b_rows).abs().max().item()
    # the simulated ring's own distance from fp32 (dense cases; packed: per document
    # references live in cp_gpu_check)
    if not packed:
        o32, l32 = ref.forward_with_lse(q.float(), k.float(), v.float(), causal)
        g32 = ref.attention_backward(q.float(), k.float(), v.float(), o32, l32, do.float(),
                                     causal)
        for name, s, r in zip(("out", "dq", "dk", "dv"), [sim[0]] + sim[2:], [o32, *g32]):
            report[f"{name}_sim_err"] = (s - r).abs().max().item()
    return report


def main():
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows, failures = [], 0
    for packed, cases in ((False, DENSE_CASES), (True, PACKED_CASES)):
        for case in cases:
            try:
                rep = run_case(case, packed, rank, world)
            except Exception as err:                   # noqa: BLE001
                rep = {"error": repr(err)[:300]}
            gathered = [None] * world
            dist.all_gather_object(gathered, rep)
            row = dict(case=list(case), packed=packed, ranks=gathered)
            ok = all("error" not in r for r in gathered)
            if ok:
                worst = {k: max(r[k] for r in gathered) for k in gathered[0]}
                row["worst"] = worst
                for name in ("out", "dq", "dk", "dv"):
                    bound = worst.get(f"{name}_sim_err", float("inf"))
                    ok &= worst[name] <= bound
                ok &= worst["lse"] <= 2.0 ** -9
            row["ok"] = bool(ok)
            failures += not ok
            rows.append(row)
            if rank == 0:
                w = row.get("worst", {})
                print(f"{'packed' if packed else 'dense '} {case}: "
                      f"{'ok ' if ok else 'FAIL'} real-sim out {w.get('out', -1):.1e} "
                      f"lse {w.get('lse', -1):.1e} dq {w.get('dq', -1):.1e} "
                      f"dk {w.get('dk', -1):.1e} dv {w.get('dv', -1):.1e}"
                      + ("" if "error" not in str(gathered) else f" {gathered}"[:300]),
                      flush=True)
    if rank == 0:
        print(f"cp_nccl_check: {len(rows) - failures}/{len(rows)} cases pass on {world} ranks "
              f"({torch.cuda.get_device_name(0)})")
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "cp_nccl_check.json"), "w") as f:
                from hopper_attn.harness.env import environment
                json.dump(dict(env=environment(), nccl_settings=NCCL_SETTINGS, world_size=world,
                               nccl=".".join(map(str, torch.cuda.nccl.version())),
                               rows=rows), f, indent=1)
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
