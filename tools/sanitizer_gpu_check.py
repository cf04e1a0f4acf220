"""compute-sanitizer (memcheck, racecheck, synccheck) over the features added since the last
sanitizer logs (results/h*/..._sanitizer_*.txt): k6's window / softcap / sinks, dv != d, kb2
at d 96 / 192 / 256 (dkv_swap_ab), its GQA parts and deterministic mode, varlen forward and
backward (d 96 / 192 too), the decode stage's split-KV combine, attention_with_kvcache (pages
of 16 and 128, appends, an e4m3 cache, chunked prefill).

    source .gpu/prelude.sh && python tools/sanitizer_gpu_check.py            # all
    source .gpu/prelude.sh && python tools/sanitizer_gpu_check.py --quick    # memcheck, racecheck
    python tools/sanitizer_gpu_check.py --list                               # no GPU needed
    python tools/sanitizer_gpu_check.py --tools racecheck --cases kb2_dims,decode
    python tools/sanitizer_gpu_check.py --run-case k6_window_d128_gqa_causal  # one, unsanitized

Each case is a few tiles (B 1-2, 2-8 heads, 200-400 tokens; decode and the cache: 1-16 queries
over up to 2000 keys) through the public call (`attention`, `attention_varlen`,
`attention_with_kvcache`), forward and, where the feature has one, backward through autograd;
checked against an fp32 reference (harness/window_reference.py; the cache cases with
harness/kvcache_check.py's and prefill_check.py's checks), so a run that the sanitizer passes
also computed the right thing. Cases are grouped by feature; the driver runs, per tool and
group, one subprocess (python, torch and CuTe DSL imported once per group; the JIT compiles
run on the CPU inside it)

    compute-sanitizer --tool T --error-exitcode 99 --report-api-errors no \\
        --kernel-name kns=hopper_attn python tools/sanitizer_gpu_check.py --run-case A,B,...

`--kernel-name kns=hopper_attn`: only this project's kernels are instrumented (CuTe DSL names a
kernel `kernel_cutlass_kernel_hopper_attn<module><Class>...`), torch's (inputs, references,
the cache append) run unchecked; `--report-api-errors no`: CuTe DSL's driver probing makes
harmless cuGetProcAddress API errors (../shared/gpu/README.md). memcheck runs with
PYTORCH_NO_CUDA_MEMORY_CACHING=1, so every tensor is its own allocation and a read or write
past one is reported (the caching allocator would hide it inside its blocks). Subprocesses
run `--jobs` at a time (default 6: the time is mostly CPU, imports and compiles; the H200
host has 16 cores), racecheck's first; one that crashes (rc not 0, 1 or 99) runs again
alone. rc: 0 clean, 99 the sanitizer reported errors, 1 a case failed its check (or
raised), anything else a crash; `timeout` past --timeout seconds (its process group killed).
Time (estimated, not yet measured): --quick 24 subprocesses (2 tools x 12 groups, 14 cases),
~2 min; all 36 (55 cases), ~5-6 min, mostly imports and JIT compiles (1-2 s a kernel).
Probes (a known defect's evidence, `probe=True`) run only where --cases names them (none now).

Prints one line per (tool, group): rc, the sanitizer's summary line, seconds, cases passed.
$OUT/sanitizer.json (or --out): the environment, the commands, per (tool, group) rc, summary,
seconds and each case's check; $OUT/sanitizer_logs/TOOL_GROUP.txt: each subprocess's output,
its first 200 lines and its last 20.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TOOLS = ("memcheck", "racecheck", "synccheck")
QUICK_TOOLS = ("memcheck", "racecheck")
KERNEL_FILTER = "kns=hopper_attn"
CASE_TAG = "SANITIZER_CASE "           # a case's verdict, one JSON line, for the driver
LOG_HEAD, LOG_TAIL = 200, 20
DEVICE = "cuda"                        # (a dry run of the checks' plumbing may set "cpu")


# ------------------------------------------------------------------------------ case specs

@dataclasses.dataclass(frozen=True)
class Dense:
    """`attention(q, k, v, ...)`: q (batch, nq, heads, d), k and v (batch, nk, heads_kv, d /
    dv); `grad`: backward through autograd too (dq, dk, dv and, with sinks, dsinks)."""
    batch: int
    nq: int
    nk: int
    heads: int
    heads_kv: int
    d: int
    dv: int = 0
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    sinks: bool = False
    grad: bool = True
    deterministic: bool = False
    stage: str = ""         # attention(stage=...): "" the default's choice
    inputs: str = ""        # "jump": `_jump_scores`; "" random

    def label(self) -> str:
        return (f"B{self.batch} q{self.nq} k{self.nk} H{self.heads}/{self.heads_kv} d{self.d}"
                + (f"/{self.dv}" if self.dv else "") + " causal" * self.causal
                + (f" w{self.window[0]},{self.window[1]}" if self.window != (-1, -1) else "")
                + (f" cap{self.softcap:g}" if self.softcap else "") + " sinks" * self.sinks
                + " det" * self.deterministic + (" fwd+bwd" if self.grad else " fwd")
                + (f" {self.inputs}" if self.inputs else "")
                + (f" {self.stage}" if self.stage else ""))


@dataclasses.dataclass(frozen=True)
class Varlen:
    """`attention_varlen` over sequences of q_lens queries and k_lens keys."""
    q_lens: tuple
    k_lens: tuple
    heads: int
    heads_kv: int
    d: int
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    sinks: bool = False
    grad: bool = True

    def label(self) -> str:
        return (f"q{list(self.q_lens)} k{list(self.k_lens)} H{self.heads}/{self.heads_kv} "
                f"d{self.d}" + " causal" * self.causal
                + (f" w{self.window[0]},{self.window[1]}" if self.window != (-1, -1) else "")
                + (f" cap{self.softcap:g}" if self.softcap else "") + " sinks" * self.sinks
                + (" fwd+bwd" if self.grad else " fwd"))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    group: str
    spec: object          # Dense, Varlen, or a kvcache_check.Case / prefill_check.PCase
    quick: bool = False   # what --quick runs: one case per feature
    probe: bool = False   # a known defect's evidence: runs only where --cases names it

    def label(self) -> str:
        return self.spec.label()


def _kv(*args, **kw):
    from hopper_attn.harness.kvcache_check import Case as KvCase
    return KvCase(*args, **kw)


def _prefill(*args, **kw):
    from hopper_attn.harness.prefill_check import PCase
    return PCase(*args, **kw)


@functools.lru_cache(maxsize=1)
def cases() -> list[Case]:
    """The table: a few tiles each, multi-tile, boundary tiles partly masked, GQA / MQA, cross
    lengths whose first rows see no key, a split-KV combine, page boundaries."""
    c = []

    def add(group, name, spec, quick=False, probe=False):
        c.append(Case(name, group, spec, quick, probe))

    g = "k6_window"           # k6 forward + kb2 backward (d 64 / 96 / 128), forward at 192, 256
    add(g, "k6_window_d128_gqa_causal", Dense(2, 300, 300, 4, 2, 128, causal=True,
                                              window=(64, 0)), quick=True)
    add(g, "k6_window_d64_two_sided", Dense(1, 257, 257, 2, 2, 64, window=(48, 32)))
    add(g, "k6_window_d96_mqa_cross", Dense(1, 333, 200, 4, 1, 96, causal=True,
                                            window=(100, 0)))      # 133 rows see no key
    add(g, "k6_window_d192_fwd", Dense(1, 300, 300, 2, 2, 192, window=(64, 64), grad=False))
    add(g, "k6_window_d256_fwd", Dense(1, 300, 300, 2, 2, 256, causal=True, window=(100, 0),
                                       grad=False))
    # k6's lazy rescale (d 192 / 256) votes per warp; "lazy" (removed) waited for PV behind it (a
    # warpgroup's warps may part: synccheck's errors on the H200), "lazy_after_wait" (d 256,
    # windows) and "lazy_before_pv" (d 192) do not. Warps part where a causal cross-length
    # problem's no-key rows end at a warp boundary (q - k = 160: rows 128-159 see nothing,
    # 160-191 key 0) or where scores jump in some warps' rows only (`_jump_scores`). The
    # k6_lazy_default_* cases run the defaults on those inputs, expected clean ("lazy" gave
    # synccheck errors there: results/h200/2026-11-29_sanitizer_d192_vote.json.xz; removed)
    g = "k6_lazy_vote"
    after_wait = "k6:rescale=lazy_after_wait"
    add(g, "k6_lazy_vote_d192_cross_causal", Dense(1, 360, 200, 2, 2, 192, causal=True,
                                                   grad=False, stage=after_wait), quick=True)
    add(g, "k6_lazy_vote_d256_jump", Dense(1, 300, 300, 2, 2, 256, grad=False, inputs="jump",
                                           stage=after_wait))
    add(g, "k6_lazy_default_d192_cross_causal", Dense(1, 360, 200, 2, 2, 192, causal=True,
                                                      grad=False))   # before_pv
    add(g, "k6_lazy_default_d192_jump", Dense(1, 300, 300, 2, 2, 192, grad=False,
                                              inputs="jump"))
    add(g, "k6_lazy_default_d256_jump", Dense(1, 300, 300, 2, 2, 256, grad=False,
                                              inputs="jump"))       # after_wait
    g = "k6_softcap"          # kb2's softcap tiles (d 64-192; 192: shared_keys)
    add(g, "k6_softcap_d128_gqa_causal", Dense(2, 300, 300, 4, 2, 128, causal=True,
                                               softcap=30.0), quick=True)
    add(g, "k6_softcap_d64_window", Dense(1, 280, 280, 2, 2, 64, causal=True, window=(96, 0),
                                          softcap=30.0))
    add(g, "k6_softcap_d96", Dense(1, 257, 257, 2, 2, 96, softcap=30.0))
    add(g, "k6_softcap_d192", Dense(1, 280, 280, 2, 2, 192, softcap=50.0))
    add(g, "k6_softcap_d256_fwd", Dense(1, 300, 300, 2, 2, 256, causal=True, softcap=50.0,
                                        grad=False))
    g = "k6_sinks"            # sinks with windows and softcap; dsinks from the backward's D
    add(g, "k6_sinks_d64_gqa_window", Dense(2, 300, 300, 4, 2, 64, causal=True,
                                            window=(128, 0), sinks=True), quick=True)
    add(g, "k6_sinks_d128_full", Dense(1, 257, 257, 2, 2, 128, sinks=True))
    add(g, "k6_sinks_d192_causal", Dense(1, 300, 300, 2, 2, 192, causal=True, sinks=True))
    add(g, "k6_sinks_d256_softcap_fwd", Dense(1, 300, 300, 2, 2, 256, causal=True,
                                              softcap=50.0, sinks=True, grad=False))
    g = "dv"                  # v's own head dim: (192, 128), (128, 64)
    add(g, "dv_192_128_gqa_causal", Dense(1, 300, 300, 4, 2, 192, dv=128, causal=True),
        quick=True)
    add(g, "dv_128_64_full", Dense(2, 257, 257, 2, 2, 128, dv=64))
    add(g, "dv_128_64_mqa_causal", Dense(1, 300, 300, 4, 1, 128, dv=64, causal=True))
    g = "kb2_dims"            # d 96 (64-row tiles), 192 (dkv_swap_ab 64 x 96), 256 (64 x 48)
    add(g, "kb2_d192_full", Dense(1, 300, 300, 2, 2, 192), quick=True)
    add(g, "kb2_d96_gqa_causal", Dense(2, 300, 300, 4, 2, 96, causal=True))
    add(g, "kb2_d96_cross", Dense(1, 200, 350, 2, 2, 96))
    add(g, "kb2_d192_gqa_causal", Dense(1, 300, 300, 4, 2, 192, causal=True))
    add(g, "kb2_d256_causal", Dense(1, 300, 300, 2, 2, 256, causal=True))
    add(g, "kb2_d256_mqa_full", Dense(1, 257, 257, 4, 1, 256))
    g = "kb2_gqa_det"         # GQA parts (MQA, a small batch), the deterministic dQ order
    add(g, "kb2_det_d128_gqa_causal", Dense(2, 300, 300, 4, 2, 128, causal=True,
                                            deterministic=True), quick=True)
    add(g, "kb2_det_d64_full", Dense(1, 257, 257, 2, 2, 64, deterministic=True))
    add(g, "kb2_det_d192_causal", Dense(1, 300, 300, 2, 2, 192, causal=True,
                                        deterministic=True))
    add(g, "kb2_det_softcap_d128", Dense(1, 300, 300, 2, 2, 128, softcap=30.0,
                                         deterministic=True))
    add(g, "kb2_mqa_parts_d128_causal", Dense(1, 400, 400, 4, 1, 128, causal=True))
    add(g, "kb2_mqa_parts_d64_full", Dense(1, 400, 400, 4, 1, 64))
    g = "varlen_fwd"          # k6's packed batches; an empty sequence, keys < queries
    add(g, "varlen_fwd_d128_gqa_causal", Varlen((1, 130, 0, 257), (17, 130, 5, 300), 4, 2,
                                                128, causal=True, grad=False), quick=True)
    add(g, "varlen_fwd_d96_window_softcap", Varlen((200, 77), (150, 300), 4, 2, 96,
                                                   causal=True, window=(64, 0), softcap=30.0,
                                                   grad=False))
    add(g, "varlen_fwd_d192_sinks", Varlen((129, 250), (300, 0), 2, 2, 192, sinks=True,
                                           grad=False))
    add(g, "varlen_fwd_d64_mqa_window", Varlen((300, 64, 1), (300, 200, 50), 4, 1, 64,
                                               window=(32, 16), grad=False))
    g = "varlen_bwd"          # the varlen backward (kb2's packed work list), d 64 and 128
    add(g, "varlen_bwd_d128_gqa_causal", Varlen((1, 130, 0, 257), (17, 130, 5, 300), 4, 2,
                                                128, causal=True), quick=True)
    add(g, "varlen_bwd_d64_window_sinks", Varlen((200, 77, 300), (150, 300, 300), 4, 2, 64,
                                                 causal=True, window=(64, 0), sinks=True))
    add(g, "varlen_bwd_d128_softcap", Varlen((129, 250), (300, 100), 2, 2, 128, softcap=30.0))
    g = "varlen_bwd_d96_192"  # the varlen backward's padding lanes at d = 96 and 192
    add(g, "varlen_bwd_d96_gqa_causal", Varlen((1, 130, 0, 257), (17, 130, 5, 300), 4, 2,
                                               96, causal=True), quick=True)
    add(g, "varlen_bwd_d192_full", Varlen((129, 250), (300, 100), 2, 2, 192))
    g = "decode"              # attention() with 1-16 queries: packed GQA, split-KV + combine
    # (splits on an H200's 132 SMs: 4, 1, 6, 2, 1; the sinks join the combine in the 4th)
    add(g, "decode_split_d128_gqa", Dense(1, 1, 2000, 8, 2, 128, grad=False), quick=True)
    add(g, "decode_window_d128_causal", Dense(2, 4, 1000, 8, 2, 128, causal=True,
                                              window=(128, 0), grad=False))
    add(g, "decode_softcap_d256_causal", Dense(1, 4, 1500, 4, 2, 256, causal=True,
                                               softcap=50.0, grad=False))
    add(g, "decode_window_sinks_split_d64", Dense(1, 1, 2000, 16, 2, 64, causal=True,
                                                  window=(900, 0), sinks=True, grad=False))
    add(g, "decode_sinks_no_key_rows", Dense(2, 16, 5, 4, 1, 128, causal=True, sinks=True,
                                            grad=False))               # rows that see no key
    g = "kvcache"             # attention_with_kvcache: pages, appends, e4m3, chunked prefill
    add(g, "kvcache_page16_append", _kv((15, 16, 257, 500), 512, 16, heads=8, heads_kv=2,
                                        seqlen_new=2), quick=True)
    add(g, "kvcache_page128_splits", _kv((127, 128, 300, 0), 512, 128, seqlen_q=4, heads=8,
                                         heads_kv=2, seqlen_new=4, num_splits=3))
    add(g, "kvcache_e4m3_contig", _kv((0, 1, 127, 129, 500, 512), 512, 0, heads=8,
                                      heads_kv=2, fp8=True))
    add(g, "kvcache_e4m3_page16_append", _kv((5, 300, 1000, 777), 1024, 16, seqlen_q=4,
                                             heads=8, heads_kv=2, seqlen_new=4, fp8=True),
        quick=True)
    add(g, "kvcache_features_page16", _kv((5, 300, 700, 1000), 1024, 16, seqlen_q=4,
                                          heads=8, heads_kv=2, seqlen_new=4, window=(128, 0),
                                          softcap=30.0, sinks=True))
    add(g, "kvcache_prefill_page16_append", _prefill((0, 15, 17, 300), (113,) * 4, 512, 16,
                                                     seqlen_new=113, heads=8, heads_kv=2),
        quick=True)
    add(g, "kvcache_prefill_varlen_page128", _prefill((300, 17, 500), (17, 0, 100), 512, 128,
                                                      varlen=True, heads=8, heads_kv=2))
    return c


def groups(selected: list[Case]) -> dict:
    out: dict = {}
    for case in selected:
        out.setdefault(case.group, []).append(case)
    return out


# ------------------------------------------------------------------------------ running a case

def _rel_err(got, ref) -> float:
    """max |got - ref| / max(1, max |ref|) (NaN: inf)."""
    ref = ref.float()
    err = (got.float() - ref).abs().nan_to_num(float("inf")).max().item() if ref.numel() else 0.0
    return err / max(1.0, ref.abs().max().item() if ref.numel() else 0.0)


OUT_LIMIT, GRAD_LIMIT = 0.02, 0.05     # relative to max(1, max|ref|): garbage, not precision


def _sync() -> None:
    import torch
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _randn(gen, *shape, scale=1.0):
    import torch
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(torch.bfloat16)


def _sinks(heads, gen):
    import torch
    return torch.randn(heads, generator=gen, device=DEVICE) * 2.0


def _jump_scores(q, k, at: int = 240, size: float = 16.0):
    """q and k whose scores jump by size^2 / sqrt(d) (16 nats at d 256) from key `at` on in
    rows 32-63 of every 64 (warps 2 and 3 of a consumer warpgroup) and nowhere else: at that
    kv tile those warps' lazy-rescale votes say yes, warps 0 and 1's no."""
    import torch
    q, k = q.clone(), k.clone()
    q[..., 0], k[..., 0] = 0.0, 0.0
    q[:, (torch.arange(q.shape[1], device=q.device) % 64) >= 32, :, 0] = size
    k[:, at:, :, 0] = size
    return q, k


def _check_dense(s: Dense, seed: int = 0) -> dict:
    import torch

    import hopper_attn
    from hopper_attn.harness import window_reference as wr
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = _randn(gen, s.batch, s.nq, s.heads, s.d)
    k = _randn(gen, s.batch, s.nk, s.heads_kv, s.d)
    if s.inputs == "jump":
        q, k = _jump_scores(q, k)
    v = _randn(gen, s.batch, s.nk, s.heads_kv, s.dv or s.d)
    sinks = _sinks(s.heads, gen) if s.sinks else None
    leaves = [q, k, v] + ([sinks] if s.sinks else [])
    for t in leaves:
        t.requires_grad_(s.grad)
    kw = {}
    if s.window != (-1, -1):
        kw["window_size"] = s.window
    if s.softcap:
        kw["softcap"] = s.softcap
    if s.sinks:
        kw["sinks"] = sinks
    with torch.set_grad_enabled(s.grad):
        out, lse = hopper_attn.attention(q, k, v, causal=s.causal, return_lse=True,
                                         deterministic=s.deterministic,
                                         stage=s.stage or None, **kw)
    do = _randn(gen, *out.shape)
    grads = torch.autograd.grad(out, leaves, do) if s.grad else []
    _sync()
    info = {}
    if not s.grad and s.nq <= 16:          # the decode stage: its split count
        from hopper_attn import api, decode
        from hopper_attn.common.contract import normalize_window
        handle = api._checked_handle(q, k, v, s.causal, "", float(s.softcap),
                                     normalize_window(s.window, s.causal), s.sinks)
        info = {"stage": handle.spec.name}
        if handle.spec.name == "decode":
            info["splits"] = decode.splits_of(handle)
    # the fp32 reference, differentiable in fp32 leaves
    ref_in = [t.detach().float().requires_grad_(s.grad) for t in leaves]
    left, right = s.window[0], (0 if s.causal else s.window[1])
    with torch.set_grad_enabled(s.grad):
        ref, ref_lse = wr.reference(*ref_in[:3], left, right, s.d ** -0.5, s.softcap,
                                    ref_in[3] if s.sinks else None)
    errs = {"out": _rel_err(out, ref)}
    finite = ref_lse.isfinite()
    errs["lse"] = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    lse_ok = bool(torch.equal(lse.isfinite(), finite))
    if s.grad:
        ref_grads = torch.autograd.grad(ref, ref_in, do.float())
        for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
            errs[name] = _rel_err(got, want)
    nan = int(out.isnan().sum()) + sum(int(g.isnan().sum()) for g in grads)
    ok = (nan == 0 and lse_ok and errs["out"] <= OUT_LIMIT and errs["lse"] <= 1e-2
          and all(v <= GRAD_LIMIT for n, v in errs.items() if n.startswith("d")))
    return {"ok": ok, "errs": errs, "nan": nan, "lse_inf_ok": lse_ok, **info}


def _check_varlen(s: Varlen, seed: int = 0) -> dict:
    import torch

    import hopper_attn
    from hopper_attn.harness import window_reference as wr
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    tq, tk = sum(s.q_lens), sum(s.k_lens)
    q = _randn(gen, tq, s.heads, s.d)
    k = _randn(gen, tk, s.heads_kv, s.d)
    v = _randn(gen, tk, s.heads_kv, s.d)
    sinks = _sinks(s.heads, gen) if s.sinks else None
    leaves = [q, k, v] + ([sinks] if s.sinks else [])
    for t in leaves:
        t.requires_grad_(s.grad)

    def cu(lens):
        acc = [0]
        for n in lens:
            acc.append(acc[-1] + n)
        return torch.tensor(acc, dtype=torch.int32, device=DEVICE)

    kw = {"window_size": s.window, "softcap": s.softcap}
    if s.sinks:
        kw["sinks"] = sinks
    with torch.set_grad_enabled(s.grad):
        out, lse = hopper_attn.attention_varlen(q, k, v, cu(s.q_lens), cu(s.k_lens),
                                                max(s.q_lens), max(s.k_lens), causal=s.causal,
                                                return_lse=True, **kw)
    do = _randn(gen, *out.shape)
    grads = torch.autograd.grad(out, leaves, do) if s.grad else []
    _sync()
    # fp32 reference per sequence (a sequence without keys: zeros, LSE -inf or the sink)
    ref_in = [t.detach().float().requires_grad_(s.grad) for t in leaves]
    rq, rk, rv = ref_in[:3]
    rs = ref_in[3] if s.sinks else None
    left, right = s.window[0], (0 if s.causal else s.window[1])
    outs, lses = [], []
    q0 = k0 = 0
    with torch.set_grad_enabled(s.grad):
        for nq, nk in zip(s.q_lens, s.k_lens):
            if nk == 0:
                outs.append(torch.zeros(nq, s.heads, s.d, device=DEVICE))
                lses.append(rs[:, None].expand(s.heads, nq) if rs is not None else
                            torch.full((s.heads, nq), float("-inf"), device=DEVICE))
            elif nq:
                o, l = wr.reference(rq[None, q0:q0 + nq], rk[None, k0:k0 + nk],
                                    rv[None, k0:k0 + nk], left, right, s.d ** -0.5, s.softcap,
                                    rs)
                outs.append(o[0])
                lses.append(l[0])
            q0, k0 = q0 + nq, k0 + nk
        ref, ref_lse = torch.cat(outs), torch.cat(lses, 1)
    errs = {"out": _rel_err(out, ref)}
    finite = ref_lse.isfinite()
    errs["lse"] = (lse[finite] - ref_lse[finite].detach()).abs().max().item() \
        if finite.any() else 0.0
    lse_ok = bool(torch.equal(lse.isfinite(), finite))
    if s.grad:
        ref_grads = torch.autograd.grad(ref, ref_in, do.float(), allow_unused=True)
        for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
            errs[name] = _rel_err(got, torch.zeros_like(got) if want is None else want)
    nan = int(out.isnan().sum()) + sum(int(g.isnan().sum()) for g in grads)
    ok = (nan == 0 and lse_ok and errs["out"] <= OUT_LIMIT and errs["lse"] <= 1e-2
          and all(v <= GRAD_LIMIT for n, v in errs.items() if n.startswith("d")))
    return {"ok": ok, "errs": errs, "nan": nan, "lse_inf_ok": lse_ok}


def run_case(case: Case) -> dict:
    """Run one case in this process; its verdict (never raises)."""
    import torch
    t0 = time.perf_counter()
    try:
        spec = case.spec
        if isinstance(spec, Dense):
            verdict = _check_dense(spec)
        elif isinstance(spec, Varlen):
            verdict = _check_varlen(spec)
        elif type(spec).__name__ == "PCase":
            from hopper_attn.harness import prefill_check
            verdict = prefill_check.check(spec, seed=0)
        else:
            from hopper_attn.harness import kvcache_check
            verdict = kvcache_check.check_case(spec, seed=0)
        _sync()
    except Exception as exc:  # noqa: BLE001 - one case's failure, reported; the rest run
        traceback.print_exc()
        verdict = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    verdict = {"case": case.name, "label": case.label(), **verdict,
               "seconds": round(time.perf_counter() - t0, 2)}
    return verdict


def _case_line(v: dict) -> str:
    errs = v.get("errs")
    if errs:
        detail = " ".join(f"{k} {x:.2g}" for k, x in errs.items())
    elif "err" in v:
        detail = f"err {v['err']:.2g} (torch {v.get('torch_err', 0):.2g})"
        detail += f" plan {v['plan']}" if "plan" in v else ""
    else:
        detail = v.get("error", "")[:120]
    detail += f" splits {v['splits']}" if "splits" in v else ""
    return (f"  {v['case']:<34} {'ok  ' if v['ok'] else 'FAIL'} {detail}  "
            f"[{v['label']}] {v['seconds']:.1f} s")


def run_cases(names: list[str]) -> int:
    by_name = {c.name: c for c in cases()}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; see --list")
    failed = 0
    for name in names:
        v = run_case(by_name[name])
        print(_case_line(v), flush=True)
        print(CASE_TAG + json.dumps(v, default=str), flush=True)
        failed += not v["ok"]
    return 1 if failed else 0


# ------------------------------------------------------------------------------ the driver

def sanitizer_path() -> str | None:
    found = os.environ.get("COMPUTE_SANITIZER") or shutil.which("compute-sanitizer")
    if found:
        return found
    for cand in ("/usr/local/cuda/bin/compute-sanitizer",
                 "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
        if os.path.exists(cand):
            return cand
    return None


def command(sanitizer: str, tool: str, names: list[str], all_kernels: bool) -> list[str]:
    cmd = [sanitizer, "--tool", tool, "--error-exitcode", "99", "--report-api-errors", "no"]
    if not all_kernels:
        cmd += ["--kernel-name", KERNEL_FILTER]
    return cmd + [sys.executable, os.path.abspath(__file__), "--run-case", ",".join(names)]


def _summary(text: str) -> str:
    lines = [ln.strip("= ").strip() for ln in text.splitlines() if "SUMMARY" in ln]
    return lines[-1] if lines else "(no summary line)"


def _trimmed(text: str) -> str:
    lines = text.splitlines()
    if len(lines) <= LOG_HEAD + LOG_TAIL:
        return text
    cut = len(lines) - LOG_HEAD - LOG_TAIL
    return "\n".join(lines[:LOG_HEAD] + [f"... ({cut} lines cut) ..."] + lines[-LOG_TAIL:])


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _run_group(cmd: list[str], env: dict, timeout: float) -> tuple:
    """(rc or "timeout", stdout + stderr); past `timeout` the subprocess's whole process
    group is killed (compute-sanitizer and the python under it)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, _text(out)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return "timeout", _text(out)


def run_one(tool: str, group: str, names: list[str], args, sanitizer: str, log_dir: str) -> dict:
    cmd = command(sanitizer, tool, names, args.all_kernels)
    env = dict(os.environ)
    if tool == "memcheck":                 # every tensor its own allocation (module doc)
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    t0 = time.perf_counter()
    rc, text = _run_group(cmd, env, args.timeout)
    seconds = time.perf_counter() - t0
    verdicts = []
    for ln in text.splitlines():
        if ln.startswith(CASE_TAG):
            try:
                verdicts.append(json.loads(ln[len(CASE_TAG):]))
            except json.JSONDecodeError:
                pass
    log = os.path.join(log_dir, f"{tool}_{group}.txt")
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n" + _trimmed(
            "\n".join(ln for ln in text.splitlines() if not ln.startswith(CASE_TAG))) + "\n")
    return {"tool": tool, "group": group, "cases": names, "rc": rc, "summary": _summary(text),
            "seconds": round(seconds, 1), "cases_ok": sum(v["ok"] for v in verdicts),
            "case_results": verdicts, "log": os.path.relpath(log, args.out),
            "command": " ".join(cmd)}


def _row(r: dict) -> str:
    return (f"{r['tool']:<9} {r['group']:<19} rc {str(r['rc']):<7} {r['summary'][:62]:<62} "
            f"{r['seconds']:6.1f} s  cases {r['cases_ok']}/{len(r['cases'])}")


def select(args) -> tuple[list[str], list[Case]]:
    tools = args.tools.split(",") if args.tools else list(QUICK_TOOLS if args.quick else TOOLS)
    bad = [t for t in tools if t not in TOOLS]
    if bad:
        raise SystemExit(f"unknown tool(s) {bad}: {TOOLS}")
    chosen = cases()
    if args.cases:
        wanted = args.cases.split(",")
        known = {c.group for c in chosen} | {c.name for c in chosen}
        bad = [w for w in wanted if w not in known]
        if bad:
            raise SystemExit(f"unknown group(s) / case(s) {bad}; see --list")
        chosen = [c for c in chosen if c.group in wanted or c.name in wanted]
    else:
        chosen = [c for c in chosen if not c.probe]
    if args.quick:
        chosen = [c for c in chosen if c.quick]
    return tools, chosen


def _plan(case: Case) -> str:
    """The stages a dense case resolves to, on the host (no GPU, no compile): forward and
    backward, or the reason it would be refused."""
    spec = case.spec
    if not isinstance(spec, Dense):
        return ""
    import torch

    from hopper_attn import api
    from hopper_attn.common.contract import Problem, normalize_window
    window = normalize_window(spec.window, spec.causal)
    problem = Problem(spec.batch, spec.heads, spec.nq, spec.d, spec.causal, torch.bfloat16,
                      heads_kv=spec.heads_kv, seqlen_k=spec.nk, window_left=window[0],
                      window_right=window[1], head_dim_v=spec.dv or 0)
    try:
        fwd = api._entry_for(problem, spec.stage, spec.softcap, spec.sinks).name
        bwd = ""
        if spec.grad:
            if problem.windowed and spec.deterministic:
                raise ValueError("deterministic backward has no window")
            bwd = " + " + api._backward_entry(problem, spec.deterministic, spec.softcap).name
        return fwd + bwd
    except ValueError as exc:
        return f"REFUSED: {exc}"


def list_cases(chosen: list[Case], plan: bool) -> int:
    bad = 0
    for group, members in groups(chosen).items():
        print(group)
        for c in members:
            where = _plan(c) if plan else ""
            bad += where.startswith("REFUSED")
            print(f"  {c.name:<34} {'quick ' if c.quick else '      '}{c.label()}"
                  + (f"  -> {where}" if where else ""))
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="one case per group, memcheck + racecheck (< 3 min)")
    ap.add_argument("--tools", help=f"comma-separated, of {','.join(TOOLS)}")
    ap.add_argument("--cases", help="comma-separated groups and / or case names")
    ap.add_argument("--list", action="store_true", help="print the cases (no GPU needed)")
    ap.add_argument("--plan", action="store_true",
                    help="with --list: the stages each dense case resolves to (host only)")
    ap.add_argument("--run-case", help="run these cases here, unsanitized (comma-separated)")
    ap.add_argument("--jobs", type=int, default=6, help="subprocesses at a time")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per subprocess")
    ap.add_argument("--all-kernels", action="store_true",
                    help="check torch's kernels too (no --kernel-name filter)")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else .)")
    args = ap.parse_args(argv)
    if args.run_case:
        return run_cases(args.run_case.split(","))
    tools, chosen = select(args)
    if args.list:
        return list_cases(chosen, args.plan)
    sanitizer = sanitizer_path()
    if sanitizer is None:
        print("compute-sanitizer not found (PATH, $COMPUTE_SANITIZER, /usr/local/cuda/bin)")
        return 2
    args.out = args.out or os.environ.get("OUT") or "."
    log_dir = os.path.join(args.out, "sanitizer_logs")
    os.makedirs(log_dir, exist_ok=True)
    from hopper_attn.harness.env import environment
    from hopper_attn.harness.gpu_check import env_line, write_json
    env = environment()
    print(env_line(env), flush=True)
    grouped = groups(chosen)
    # racecheck's first (the slowest), then memcheck, synccheck
    order = sorted(tools, key=lambda t: ("racecheck", "memcheck", "synccheck").index(t))
    jobs = [(t, g, [c.name for c in members]) for t in order for g, members in grouped.items()]
    print(f"{len(jobs)} subprocesses ({len(tools)} tools x {len(grouped)} groups, "
          f"{len(chosen)} cases), {args.jobs} at a time; filter "
          f"{'none' if args.all_kernels else KERNEL_FILTER}", flush=True)
    t0 = time.perf_counter()
    results = []
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(run_one, t, g, names, args, sanitizer, log_dir)
                   for t, g, names in jobs]
        for fut in futures:                # (printed in submission order)
            r = fut.result()
            results.append(r)
            print(_row(r), flush=True)
    crashed = [i for i, r in enumerate(results) if r["rc"] not in (0, 1, 99, "timeout")]
    if crashed and args.jobs > 1:          # (concurrent sanitized processes: try alone once)
        print(f"{len(crashed)} crashed; again one at a time:", flush=True)
        for i in crashed:
            r = results[i]
            again = run_one(r["tool"], r["group"], r["cases"], args, sanitizer, log_dir)
            again["first_try"] = {key: r[key] for key in ("rc", "summary", "seconds")}
            results[i] = again
            print(_row(again), flush=True)
    wall = time.perf_counter() - t0
    for r in results:                      # rc 0 and every case's verdict seen
        r["clean"] = r["rc"] == 0 and r["cases_ok"] == len(r["cases"])
    clean = all(r["clean"] for r in results)
    print(f"{'all clean' if clean else 'NOT clean'}: {sum(r['clean'] for r in results)}/"
          f"{len(results)} subprocesses clean (rc 0, every case ok), {wall:.0f} s; logs "
          f"{log_dir}", flush=True)
    failing = [(r["tool"], v) for r in results for v in r["case_results"] if not v["ok"]]
    for tool, v in failing[:20]:
        print(f"{tool}: " + _case_line(v).strip(), flush=True)
    path = write_json({"env": env, "quick": args.quick, "tools": tools,
                       "kernel_filter": None if args.all_kernels else KERNEL_FILTER,
                       "jobs": args.jobs, "wall_s": round(wall, 1), "clean": clean,
                       "cases": [{"name": c.name, "group": c.group, "label": c.label(),
                                  "quick": c.quick} for c in chosen],
                       "runs": results}, "sanitizer.json", args.out)
    print("wrote", path)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
