"""FlashAttention-4's sm90 forward compiled for sm_90a on a machine without a GPU, and the
same SASS summary as `hopper_attn.harness.sass_order` prints for this repo's kernels
(WGMMA groups, exp2 counts, the order of waits and exp2s in each loop).

    ../shared/gpu/pack --with-fa4            # once: .gpu/fa4-*.tar.xz
    python tools/fa4_sass.py 256:0 256:1 192:0 96:0   # head_dim:causal
    python tools/fa4_sass.py bwd256:0 bwd64:1         # the backward (d = 64 and 256's tiles)
    python tools/fa4_sass.py kb2_64:1 kb2_64:1:dq_rows=0   # kb2's loops, counted the same way
    python tools/fa4_sass.py 192x128:1                # (d x dv):causal, v narrower

FA4 is unpacked from `.gpu/fa4-*.tar.xz` into a temporary folder (or taken from FA4_DIR).
Its package `__init__` files (flash_attn, flash_attn.cute, quack) are bypassed: they import
the JIT interface and unrelated kernels; `quack.dsl` is imported for its tensor patches.
tvm_ffi, which the DSL imports for an option this compile does not use, is stubbed if
missing. Nothing here runs a kernel. Written 2026-11-26 (docs/lab/k6.md "One WGMMA group per P
slice": FA4's PV is one group at d = 192 and 256, k6's default was split).
"""

from __future__ import annotations

import glob
import math
import os
import re
import sys
import tarfile
import tempfile
import types

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# FA4's sm90 forward configuration per head dim (../shared/notes/fa4-sm90-anatomy.md):
# (tile_m, tile_n, P given to PV from registers, intra-warpgroup overlap); d = 96 causal
# uses a 128-wide kv tile
FA4_TILES = {64: (192, 128, True, True), 96: (192, 144, False, True),
             128: (128, 128, True, True), 192: (128, 112, True, True),
             256: (128, 80, True, True)}


def fa4_dir() -> str:
    if os.environ.get("FA4_DIR"):
        return os.environ["FA4_DIR"]
    archives = sorted(glob.glob(os.path.join(ROOT, ".gpu", "fa4-*.tar.xz")))
    if not archives:
        raise SystemExit("no .gpu/fa4-*.tar.xz: run ../shared/gpu/pack --with-fa4, or set FA4_DIR")
    folder = tempfile.mkdtemp(prefix="fa4-")
    with tarfile.open(archives[-1]) as tar:
        tar.extractall(folder)
    return folder


def import_fa4(folder: str):
    sys.path.insert(0, folder)
    if "tvm_ffi" not in sys.modules:
        try:
            import tvm_ffi  # noqa: F401
        except ImportError:
            stub = types.ModuleType("tvm_ffi")
            stub.dtype = lambda name: name
            sys.modules["tvm_ffi"] = stub
    for name in ("quack", "flash_attn", "flash_attn.cute"):
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(folder, *name.split("."))]
        sys.modules[name] = package
    import quack.dsl  # noqa: F401
    from flash_attn.cute.cute_dsl_utils import to_cute_tensor
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
    return FlashAttentionForwardSm90, to_cute_tensor


# FA4's sm90 backward tiles (interface.py's _tile_size_bwd_sm90) per head dim: d = 64 128 x 128,
# Q / dO / P-dS 2 stages, S^T and dP^T, dQ split by rows between the MMA warpgroups; d = 256
# 64 x 48, Q 2 stages, dO and P / dS 1, dK^T / dV^T swapped and split by d's rows
FA4_BWD_TILES = {
    64: dict(tile_m=128, tile_n=128, Q_stage=2, dO_stage=2, PdS_stage=2, SdP_swapAB=True,
             dKV_swapAB=False, dQ_swapAB=False, AtomLayoutMSdP=1, AtomLayoutNdKV=2,
             AtomLayoutMdQ=2, V_in_regs=False, dQ_single_wg=False),
    256: dict(tile_m=64, tile_n=48, Q_stage=2, dO_stage=1, PdS_stage=1, SdP_swapAB=False,
              dKV_swapAB=True, dQ_swapAB=False, AtomLayoutMSdP=1, AtomLayoutNdKV=1,
              AtomLayoutMdQ=1),
}


def compile_fa4_backward(head_dim: int, causal: bool):
    """PTX and cubin of FA4's sm90 backward at `head_dim` (FA4_BWD_TILES), bf16, against fake
    global tensors (its LSE and dPsum bulk copies need a global address space, which CPU
    torch tensors do not give)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
    from flash_attn.cute.utils import AuxData
    if head_dim not in FA4_BWD_TILES:
        raise SystemExit(f"the backward is compiled at d = {sorted(FA4_BWD_TILES)} only")
    d = head_dim
    fa = FlashAttentionBackwardSm90(cutlass.BFloat16, d, d, 1, causal, is_local=False,
                                    deterministic=False, num_threads=384, **FA4_BWD_TILES[d])

    def fake(dtype, rank):         # dynamic extents and strides, the last mode contiguous
        return make_fake_tensor(dtype, tuple(cute.sym_int() for _ in range(rank)),
                                (*(cute.sym_int(divisibility=8) for _ in range(rank - 1)), 1),
                                assumed_align=16)
    bf16, fp32 = cutlass.BFloat16, cutlass.Float32
    # q, k, v, dO (b, s, h, d); LSE, dPsum (b, h, s); dQ accumulator (b, h, s d); dK, dV
    args = [fake(bf16, 4) for _ in range(4)] + [fake(fp32, 3) for _ in range(3)] + \
        [fake(bf16, 4) for _ in range(2)]
    with tempfile.TemporaryDirectory() as dump:
        compiled = cute.compile(fa, *args, Float32(1.0 / math.sqrt(d)), *([None] * 9),
                                AuxData(), None, None, stream=make_fake_stream(),
                                options=f"--keep-ptx --keep-cubin --dump-dir={dump}")
    return compiled.__ptx__.rstrip("\0"), bytes(compiled.__cubin__)


def compile_kb2(head_dim: int, causal: bool, options: str = ""):
    """PTX and cubin of kb2's main kernel (its policy's settings, then `options`)."""
    import torch
    from hopper_attn.harness import registry
    from hopper_attn.harness.compile_report import compile_artifacts
    art = compile_artifacts(registry.get("kb2" + (":" + options if options else "")),
                            head_dim, causal, torch.bfloat16)
    if not art["ok"]:
        raise RuntimeError(f"compile failed: {art['error']}")
    return art["ptx"], art["cubin"]


def loop_sizes(sass_text: str) -> str:
    """Per innermost WGMMA loop: instructions; HGMMA by shape (and with A from registers);
    BAR; SYNCS (mbarrier); STS / STSM / LDS; bulk copies; EX2; warp(group) syncs."""
    import collections
    from hopper_attn.harness.sass_order import loop_body, loops
    out = []
    for loop in loops(sass_text):
        body = loop_body(sass_text, loop)
        count = lambda op: sum(bool(re.search(rf"(^|\s){op}", t)) for t in body)  # noqa: E731
        shapes = collections.Counter(m.group(1) for t in body
                                     for m in [re.search(r"HGMMA\.(\d+x\d+x\d+)", t)] if m)
        rs = sum(bool(re.search(r"HGMMA\S*\s+R\d+,\s*R\d+", t)) for t in body)
        out.append(f"loop {loop[0]:#x}: {len(body)} instructions, {count('HGMMA')} HGMMA "
                   f"{dict(shapes)} ({rs} with A from registers), {count('BAR[.]')} BAR, "
                   f"{count('SYNCS[.]')} SYNCS, {count('STS[.]?')} STS, {count('STSM')} STSM, "
                   f"{count('LDS')} LDS, {count('UBLKRED|UTMA|UBLKCP')} bulk, "
                   f"{count('MUFU.EX2')} EX2, {count('WARPSYNC|WARPGROUP')} wg-sync")
    return "\n".join(out)


def fa4_tile(head_dim: int, head_dim_v: int, causal: bool) -> tuple:
    """FA4_TILES' row, with the kv tile FA4's interface picks for (d, dv) and the mask
    (`_tile_size_fwd_sm90`: d = 96 causal 128 wide; d = 192 with dv <= 128 128 wide)."""
    tile_m, tile_n, pv_rs, overlap = FA4_TILES[head_dim]
    if head_dim == 96 and causal:
        tile_n = 128
    if head_dim == 192 and head_dim_v <= 128:
        tile_n = 128
    return tile_m, tile_n, pv_rs, overlap


def compile_fa4(kernel_class, to_cute_tensor, head_dim: int, causal: bool,
                head_dim_v: int = 0):
    """PTX and cubin of FA4's forward for (B2, N256, H2, head_dim) bf16, v head_dim_v wide
    (0: head_dim)."""
    import cutlass
    import cutlass.cute as cute
    import torch
    from cutlass import Float32
    from cutlass.cute.runtime import make_fake_stream
    dv = head_dim_v or head_dim
    tile_m, tile_n, pv_rs, overlap = fa4_tile(head_dim, dv, causal)
    fa = kernel_class(cutlass.BFloat16, head_dim, dv, 1, is_causal=causal,
                      is_local=False, pack_gqa=False, tile_m=tile_m, tile_n=tile_n,
                      num_stages=2, num_threads=384, Q_in_regs=False,
                      intra_wg_overlap=overlap, mma_pv_is_rs=pv_rs, mask_mod=None,
                      score_mod=None, has_aux_tensors=False, q_subtile_factor=1,
                      paged_kv_non_tma=False)
    tensors = [torch.empty(2, 256, 2, width, dtype=torch.bfloat16)
               for width in (head_dim, head_dim, dv, dv)]      # q, k, v, out
    args = [to_cute_tensor(t, enable_tvm_ffi=False) for t in tensors]
    args.append(to_cute_tensor(torch.empty(2, 2, 256, dtype=torch.float32), assumed_align=4,
                               enable_tvm_ffi=False))
    with tempfile.TemporaryDirectory() as dump:
        compiled = cute.compile(fa, *args, Float32(1.0 / math.sqrt(head_dim)),
                                *([None] * 9), stream=make_fake_stream(),
                                options=f"--keep-ptx --keep-cubin --dump-dir={dump}")
    return compiled.__ptx__.rstrip("\0"), bytes(compiled.__cubin__)


def main(specs):
    from hopper_attn.harness.compile_report import sass
    from hopper_attn.harness.sass_order import summary
    kernel_class, to_cute_tensor = import_fa4(fa4_dir())
    for spec in specs:
        if spec.startswith(("bwd", "kb2")):       # bwd<d>:<causal>, kb2<d>:<causal>[:options]
            head_dim, causal, *options = spec[3:].lstrip("_").split(":")
            mask = "causal" if int(causal) else "no mask"
            if spec.startswith("bwd"):
                ptx, cubin = compile_fa4_backward(int(head_dim), bool(int(causal)))
                print(f"== FA4 sm90 backward, d = {head_dim}, {mask}")
            else:
                ptx, cubin = compile_kb2(int(head_dim), bool(int(causal)), ",".join(options))
                print(f"== kb2{':' + ','.join(options) if options else ''}, d = {head_dim}, "
                      f"{mask}")
            print(summary(ptx, sass(cubin)))
            print(loop_sizes(sass(cubin)))
            continue
        dims, causal = spec.split(":")
        head_dim, head_dim_v = (int(x) for x in (dims + "x0").split("x")[:2])
        ptx, cubin = compile_fa4(kernel_class, to_cute_tensor, head_dim, bool(int(causal)),
                                 head_dim_v)
        pair = f"({head_dim}, {head_dim_v})" if head_dim_v else f"d = {head_dim}"
        print(f"== FA4 sm90 forward, {pair}, {'causal' if int(causal) else 'no mask'}")
        print(summary(ptx, sass(cubin)))


if __name__ == "__main__":
    main(sys.argv[1:] or ["256:0"])
