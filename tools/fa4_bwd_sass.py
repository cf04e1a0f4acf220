"""FlashAttention-4's sm90 backward at d = 64 compiled for sm_90a on a machine without a GPU,
with the SASS summary `hopper_attn.harness.sass_order` prints for this repo's kernels and,
per innermost WGMMA loop, its instruction, HGMMA (by shape), BAR and mbarrier counts.

    python tools/fa4_bwd_sass.py 0 1            # causal 0 / 1
    python tools/fa4_bwd_sass.py --kb2 0 1      # the same counts for kb2's d = 64 loop

FA4 is unpacked and imported as tools/fa4_sass.py does (its package `__init__` files
bypassed). The tile is interface.py's `_tile_size_bwd_sm90` for head_dim <= 64: 128 x 128,
Q, dO and P / dS 2 stages, S^T and dP^T (SdP_swapAB), dK and dV not swapped (P^T, dS^T from
registers), dQ split by rows between the two MMA warpgroups (AtomLayoutMdQ = 2). Nothing
here runs a kernel. Written 2026-11-29 (docs/lab/kb2.md "Why d = 64 trails FA4").
"""

from __future__ import annotations

import collections
import math
import os
import re
import sys
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))


def compile_fa4_backward_d64(causal: bool):
    """PTX and cubin of FA4's sm90 backward, d = 64, bf16, against fake global tensors
    (its LSE and dPsum bulk copies need a global address space)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
    from flash_attn.cute.utils import AuxData
    d = 64
    fa = FlashAttentionBackwardSm90(
        cutlass.BFloat16, d, d, 1, causal, is_local=False, deterministic=False, tile_m=128,
        tile_n=128, Q_stage=2, dO_stage=2, PdS_stage=2, SdP_swapAB=True, dKV_swapAB=False,
        dQ_swapAB=False, AtomLayoutMSdP=1, AtomLayoutNdKV=2, AtomLayoutMdQ=2,
        num_threads=384, V_in_regs=False, dQ_single_wg=False)

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


def compile_kb2_d64(causal: bool, options: str = ""):
    """PTX and cubin of kb2's main kernel at d = 64 (its policy's settings, then `options`,
    e.g. "dq_split_rows=1")."""
    import torch
    from hopper_attn.harness import registry
    from hopper_attn.harness.compile_report import compile_artifacts
    art = compile_artifacts(registry.get("kb2" + (":" + options if options else "")), 64,
                            causal, torch.bfloat16)
    if not art["ok"]:
        raise RuntimeError(f"compile failed: {art['error']}")
    return art["ptx"], art["cubin"]


def loop_counts(sass_text: str) -> str:
    """Per innermost WGMMA loop: instructions; HGMMA by shape; BAR; SYNCS (mbarrier); STS /
    STSM / LDS; UTMA (bulk copies)."""
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


def main(argv):
    from hopper_attn.harness.compile_report import sass
    from hopper_attn.harness.sass_order import summary
    kb2 = "--kb2" in argv
    options = next((a.split("=", 1)[1] for a in argv if a.startswith("--options=")), "")
    specs = [a for a in argv if not a.startswith("--")] or ["0"]
    if not kb2:
        from fa4_sass import fa4_dir, import_fa4
        import_fa4(fa4_dir())
    for spec in specs:
        causal = bool(int(spec))
        if kb2:
            ptx, cubin = compile_kb2_d64(causal, options)
            name = f"kb2{':' + options if options else ''}"
        else:
            ptx, cubin = compile_fa4_backward_d64(causal)
            name = "FA4 sm90 backward"
        print(f"== {name}, d = 64, {'causal' if causal else 'no mask'}")
        text = sass(cubin)
        print(summary(ptx, text))
        print(loop_counts(text))


if __name__ == "__main__":
    main(sys.argv[1:])
