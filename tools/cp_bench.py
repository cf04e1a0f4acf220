"""Two-rank context-parallel benchmark: hopper_attn's ring vs one GPU vs torch's
context_parallel over SDPA, causal, GQA.

    source .gpu/prelude.sh && torchrun --nproc-per-node 2 tools/cp_bench.py   # $OUT/cp.json

For each sequence length N (default 128k, 256k, 512k; batch 1, 32 query heads over 8 k/v
heads, head_dim 128, bf16, causal):
  one GPU   `hopper_attn.attention` on the whole problem (every rank runs it at once; rank
            0's time is reported),
  ring      `ring_attention` on the zigzag halves, two ranks (the slower rank's time),
  torch CP  `context_parallel` over `F.scaled_dot_product_attention` (flash backend,
            enable_gqa, load balancing on, rotate method "alltoall", i.e. a ring), and the
            same again with this project's SDPA provider (hopper_attn/integrations/sdpa.py)
            activated: torch's CP ring calling this project's kernels per step,
each forward alone (no_grad) and forward + backward. Scaling efficiency = one-GPU time /
(2 x two-rank time): 1.0 means two GPUs take exactly half the time.

Before the process group starts it sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1
and NVSHMEM_DISABLE_NVLS=1 (NVLink multicast stays off on the lent hosts). The JSON holds the
versions, the NCCL settings, every time and the ring's largest difference from the one-GPU
output on its rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

NCCL_SETTINGS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NCCL_SETTINGS)               # before torch.distributed starts anything

import torch                                   # noqa: E402
import torch.distributed as dist               # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hopper_attn.harness.timing import elapsed_ms  # noqa: E402


def _args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqlens", default="131072,262144,524288")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--no-torch-cp", action="store_true")
    p.add_argument("--no-provider", action="store_true",
                   help="torch's CP over torch's flash kernels only, not over this project's")
    p.add_argument("--torch-rotate", default="alltoall", choices=("alltoall", "allgather"))
    return p.parse_args()


def _timed(fn, warmup: int, iters: int) -> float:
    """Median seconds of `fn()` over `iters` runs, every rank in step; the slowest rank's."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        times.append(elapsed_ms(fn) / 1e3)
    t = torch.tensor(sorted(times)[len(times) // 2], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _fwd_bwd(fn, leaves, dout):
    def run():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(dout)
    return run


def _fwd(fn, tensors):
    def run():
        with torch.no_grad():
            fn(*tensors)
    return run


def _versions():
    import importlib.metadata as md
    out = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())),
           "device": torch.cuda.get_device_name(0), "python": sys.version.split()[0]}
    for pkg in ("nvidia-cutlass-dsl", "flash-attn-4"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    try:
        out["hopper_attn_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True,
            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        out["hopper_attn_commit"] = None
    return out


def _torch_cp_runner(mesh, q, k, v, do, causal, warmup, iters, provider=None):
    """torch's context_parallel over SDPA (flash backend): (fwd s, fwd+bwd s)."""
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if provider:
        torch.nn.attention.activate_flash_attention_impl(provider)
    # SDPA layout (B, H, N, d); context_parallel shards these copies in place
    qt, kt, vt, dot = (t.transpose(1, 2).contiguous() for t in (q, k, v, do))
    gqa = qt.shape[1] != kt.shape[1]
    _cp_options.enable_load_balance = causal       # (its head-tail layout: causal only)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), context_parallel(
                mesh, buffers=[qt, kt, vt, dot], buffer_seq_dims=[2, 2, 2, 2],
                no_restore_buffers={qt, kt, vt, dot}):
            sdpa = lambda a, b, c: F.scaled_dot_product_attention(  # noqa: E731
                a, b, c, is_causal=causal, enable_gqa=gqa)
            leaves = [t.detach().requires_grad_() for t in (qt, kt, vt)]
            t_fwd = _timed(_fwd(sdpa, leaves), warmup, iters)
            t_both = _timed(_fwd_bwd(sdpa, leaves, dot), warmup, iters)
        return t_fwd, t_both
    finally:
        if provider:
            torch.nn.attention.restore_flash_attention_impl()


def main():
    args = _args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    import hopper_attn
    from hopper_attn.context_parallel import ring_attention, zigzag_shard
    causal = not args.no_causal
    mesh = None
    if not args.no_torch_cp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental._attention import set_rotate_method
        mesh = init_device_mesh("cuda", (world,))
        set_rotate_method(args.torch_rotate)
    providers = []
    if not args.no_provider:
        try:       # this project's SDPA provider (hopper_attn/integrations/sdpa.py), registered
            import hopper_attn.integrations.sdpa as hopper_sdpa   # (not activated) by name
            providers = [hopper_sdpa.register()]
        except Exception as err:                           # noqa: BLE001 (torch < 2.11)
            print(f"no SDPA provider: {err!r}"[:200])
    from hopper_attn.harness.env import environment
    report = dict(env=environment(), versions=_versions(), nccl_settings=NCCL_SETTINGS,
                  world_size=world,
                  batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
                  head_dim=args.head_dim, causal=causal, warmup=args.warmup,
                  iters=args.iters, torch_rotate=args.torch_rotate, providers=providers,
                  rows=[])
    log = print if rank == 0 else (lambda *a, **k: None)
    log(f"cp_bench: {world} ranks, {report['versions']['device']}, torch "
        f"{torch.__version__}, nccl {report['versions']['nccl']}; H{args.heads}/"
        f"{args.kv_heads} d{args.head_dim} {'causal' if causal else 'full'}")
    for n in (int(s) for s in args.seqlens.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(n)
        shape_q = (args.batch, n, args.heads, args.head_dim)
        shape_kv = (args.batch, n, args.kv_heads, args.head_dim)
        q, do = (torch.randn(shape_q, device="cuda", generator=gen, dtype=torch.bfloat16)
                 for _ in range(2))
        k, v = (torch.randn(shape_kv, device="cuda", generator=gen, dtype=torch.bfloat16)
                for _ in range(2))
        row = dict(seqlen=n)
        one = lambda a, b, c: hopper_attn.attention(a, b, c, causal=causal)  # noqa: E731
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        row["one_gpu_fwd_s"] = _timed(_fwd(one, (q, k, v)), args.warmup, args.iters)
        row["one_gpu_fwd_bwd_s"] = _timed(_fwd_bwd(one, leaves, do), args.warmup, args.iters)
        with torch.no_grad():
            want = zigzag_shard(one(q, k, v), rank, world)
        del leaves
        local = [zigzag_shard(t, rank, world).contiguous() for t in (q, k, v, do)]
        ring = lambda a, b, c: ring_attention(a, b, c, causal=causal)  # noqa: E731
        leaves = [t.clone().requires_grad_() for t in local[:3]]
        row["ring_fwd_s"] = _timed(_fwd(ring, local[:3]), args.warmup, args.iters)
        row["ring_fwd_bwd_s"] = _timed(_fwd_bwd(ring, leaves, local[3]), args.warmup,
                                       args.iters)
        with torch.no_grad():
            diff = (ring(*local[:3]).float() - want.float()).abs().max()
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        row["ring_vs_one_gpu_max_abs_diff"] = diff.item()
        del leaves, local, want
        for key in ("fwd", "fwd_bwd"):
            row[f"ring_efficiency_{key}"] = row[f"one_gpu_{key}_s"] / (world * row[f"ring_{key}_s"])
        for name, provider in ([("torch_cp", None)] + [(f"torch_cp_{p}", p) for p in providers]
                               if mesh is not None else []):
            try:
                t_fwd, t_both = _torch_cp_runner(mesh, q, k, v, do, causal, args.warmup,
                                                    args.iters, provider)
                row[f"{name}_fwd_s"], row[f"{name}_fwd_bwd_s"] = t_fwd, t_both
                row[f"{name}_efficiency_fwd_bwd"] = row["one_gpu_fwd_bwd_s"] / (world * t_both)
            except Exception as err:                       # noqa: BLE001 (record, go on)
                row[f"{name}_error"] = repr(err)[:400]
        report["rows"].append(row)
        tcp = (f"torch CP {row['torch_cp_fwd_s']:.3f} / {row['torch_cp_fwd_bwd_s']:.3f} s"
               if "torch_cp_fwd_s" in row else f"torch CP: {row.get('torch_cp_error', 'off')[:60]}")
        log(f"N={n:>7}: one GPU {row['one_gpu_fwd_s']:.3f} / {row['one_gpu_fwd_bwd_s']:.3f} s, "
            f"ring {row['ring_fwd_s']:.3f} / {row['ring_fwd_bwd_s']:.3f} s (fwd / fwd+bwd), "
            f"efficiency {row['ring_efficiency_fwd']:.2f} / {row['ring_efficiency_fwd_bwd']:.2f}, "
            f"max|ring-one| {row['ring_vs_one_gpu_max_abs_diff']:.1e}; {tcp}")
        for p in providers:
            key = f"torch_cp_{p}"
            log(f"           torch CP over {p}: " + (
                f"{row[key + '_fwd_s']:.3f} / {row[key + '_fwd_bwd_s']:.3f} s"
                if key + "_fwd_s" in row else row.get(key + "_error", "?")[:150]))
        del q, k, v, do
        torch.cuda.empty_cache()
    if rank == 0 and os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "cp.json"), "w") as f:
            json.dump(report, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
