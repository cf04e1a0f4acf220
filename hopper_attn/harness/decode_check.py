"""The decode stage's GPU checks, shared by tests/test_decode.py and tools/decode_gpu_check.py.

One case: q (batch, seqlen_q, heads, d), k and v (batch, seqlen_k, heads_kv, d), each a
strided slice of a larger NaN-filled buffer (a kernel that reads outside the slice reads NaN);
out and the LSE inside NaN guards, NaN-filled before the run. The stage runs twice; the
check: no NaN left, error against an fp32 reference at most 2x PyTorch's own error in the
same dtype (SDPA on the same inputs) + 2^-10, the LSE within 1e-3 of the fp32 one, the same
bits both times, the guards untouched.
"""

from __future__ import annotations

import dataclasses

import torch

from hopper_attn.harness.gpu_check import capture_graph
from hopper_attn.harness.inputs import guarded_empty, guards_intact


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    seqlen_q: int
    heads: int
    heads_kv: int
    seqlen_k: int
    head_dim: int = 128
    causal: bool = False
    dtype: torch.dtype = torch.bfloat16
    num_splits: int = 0           # 0: the heuristic's
    block_n: int = 0
    stages: int = 0
    combine_chunk: int = 0        # 0: the stage's default
    extra: tuple = ()             # more compile options, (name, value) pairs (sinks, ...)

    def label(self) -> str:
        dt = "fp16" if self.dtype == torch.float16 else "bf16"
        return (f"B{self.batch} q{self.seqlen_q} H{self.heads}/{self.heads_kv} k{self.seqlen_k} "
                f"d{self.head_dim} {'causal' if self.causal else 'full'} {dt}"
                + (f" s{self.num_splits}" if self.num_splits else "")
                + (f" bn{self.block_n}" if self.block_n else "")
                + (f" st{self.stages}" if self.stages else "")
                + (f" c{self.combine_chunk}" if self.combine_chunk else "")
                + "".join(f" {k}{v}" for k, v in self.extra))


def cases() -> list[Case]:
    """1-16 queries; key lengths 1, 17, 113, 1000, 8191; causal and not; GQA 32/8, 64/8,
    MQA, MHA; d 64, 128, 256; bf16 and fp16; splits ending inside the last tile, empty
    splits, one split; two M tiles (64 x 8 heads x 16 queries)."""
    out = []
    for nk in (1, 17, 113, 1000, 8191):
        for nq in (1, 4, 16):
            if nq > nk:
                continue
            for causal in (False, True):
                out.append(Case(2, nq, 32, 8, nk, causal=causal))
    out += [
        Case(1, 1, 64, 8, 8191), Case(3, 16, 64, 8, 1000, causal=True),    # 2 M tiles
        Case(2, 1, 16, 1, 1000), Case(2, 4, 16, 1, 8191, causal=True),     # MQA
        Case(2, 1, 8, 8, 1000), Case(2, 16, 8, 8, 1000, causal=True),      # MHA
        Case(1, 1, 32, 8, 1000, num_splits=3),       # the last split ends in the tail
        Case(1, 4, 32, 8, 1000, causal=True, num_splits=7),
        Case(1, 1, 32, 8, 113, num_splits=5),        # more splits than kv tiles: empty ones
        Case(1, 1, 32, 8, 1, num_splits=4),
        Case(2, 1, 32, 8, 8191, num_splits=1),       # one split: no combine
        Case(2, 4, 32, 8, 8191, causal=True, num_splits=1),
        Case(1, 1, 32, 8, 8191, num_splits=64),
        Case(2, 1, 32, 8, 1000, head_dim=64), Case(2, 4, 32, 8, 8191, head_dim=64, causal=True),
        Case(2, 1, 32, 8, 1000, head_dim=256), Case(2, 4, 32, 8, 8191, head_dim=256, causal=True),
        Case(2, 1, 32, 8, 1000, dtype=torch.float16),
        Case(2, 16, 32, 8, 8191, causal=True, dtype=torch.float16),
        Case(1, 1, 32, 8, 8191, block_n=64, stages=4),
        Case(1, 1, 32, 8, 8191, block_n=128, stages=2),
        # the combine: several rounds of chunks, lanes sharing a piece (1 row: 4 lanes), a
        # partial last chunk, 64 rows, one split per round trip, the two-CTAs-per-SM tile
        Case(1, 1, 32, 8, 8191, num_splits=128), Case(1, 1, 8, 8, 8191, num_splits=100),
        Case(1, 16, 32, 8, 8191, causal=True, num_splits=24),
        Case(1, 4, 32, 8, 8191, num_splits=13, combine_chunk=1),
        Case(1, 1, 32, 8, 8191, block_n=64, stages=2, num_splits=33),
    ]
    return out


def _reference(q, k, v, causal, scale):
    """fp32 O and LSE; k/v heads repeated for GQA; causal aligned bottom-right."""
    group = q.shape[2] // k.shape[2]
    kf = k.float().repeat_interleave(group, dim=2)
    vf = v.float().repeat_interleave(group, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q.float(), kf) * scale
    nq, nk = q.shape[1], k.shape[1]
    if causal:
        hidden = torch.ones(nq, nk, dtype=torch.bool, device=q.device).triu(nk - nq + 1)
        s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", p, vf), lse


def _sdpa(q, k, v, causal):
    mask = None
    if causal:
        nq, nk = q.shape[1], k.shape[1]
        mask = ~torch.ones(nq, nk, dtype=torch.bool, device=q.device).triu(nk - nq + 1)
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        enable_gqa=True).transpose(1, 2)


def strided_slice(shape, dtype, gen, device="cuda"):
    """A random normal tensor of `shape` (batch, seqlen, heads, d), stored as a slice of a
    NaN-filled buffer with 5 more rows and one more head (so neither its seqlen nor its
    heads stride is the compact one)."""
    b, n, h, d = shape
    buffer = torch.full((b, n + 5, h + 1, d), float("nan"), dtype=dtype, device=device)
    view = buffer[:, 2:2 + n, 1:1 + h]
    view.copy_(torch.randn(shape, generator=gen, device=device).to(dtype))
    return buffer, view


def make_inputs(case: Case, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    d = case.head_dim
    _, q = strided_slice((case.batch, case.seqlen_q, case.heads, d), case.dtype, gen)
    _, k = strided_slice((case.batch, case.seqlen_k, case.heads_kv, d), case.dtype, gen)
    _, v = strided_slice((case.batch, case.seqlen_k, case.heads_kv, d), case.dtype, gen)
    return q, k, v


def compile_case(case: Case):
    from hopper_attn import decode
    from hopper_attn.common.contract import Problem
    problem = Problem(case.batch, case.heads, case.seqlen_q, case.head_dim, case.causal,
                      case.dtype, heads_kv=case.heads_kv, seqlen_k=case.seqlen_k)
    chunk = {"combine_chunk": case.combine_chunk} if case.combine_chunk else {}
    return decode.compile_kernel(problem, num_splits=case.num_splits, block_n=case.block_n,
                                 stages=case.stages, **chunk, **dict(case.extra))


def check_case(case: Case, seed: int = 0) -> dict:
    """Run `case` twice (fresh NaN-filled outputs); returns the verdict and the numbers."""
    from hopper_attn import decode
    q, k, v = make_inputs(case, seed)
    handle = compile_case(case)
    outs, lses, guards = [], [], True
    for _ in range(2):
        out_buf, out = guarded_empty(tuple(q.shape), case.dtype, q.device)
        lse_buf, lse = guarded_empty((case.batch, case.heads, case.seqlen_q), torch.float32,
                                     q.device)
        decode.run(handle, q, k, v, out, lse)
        torch.cuda.synchronize()
        guards = guards and guards_intact(out_buf) and guards_intact(lse_buf)
        outs.append(out)
        lses.append(lse)
    scale = case.head_dim ** -0.5
    ref, ref_lse = _reference(q, k, v, case.causal, scale)
    torch_err = (_sdpa(q, k, v, case.causal).float().nan_to_num(0.0) - ref).abs().max().item()
    err = (outs[0].float() - ref).abs().max().item()
    limit = 2 * torch_err + 2 ** -10
    lse_err = (lses[0] - ref_lse).abs().max().item()
    same = torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)) and \
        torch.equal(lses[0].view(torch.int32), lses[1].view(torch.int32))
    no_nan = not outs[0].isnan().any().item() and not lses[0].isnan().any().item()
    ok = no_nan and err <= limit and lse_err <= 1e-3 and same and guards
    return {"case": case.label(), "ok": bool(ok), "err": err, "torch_err": torch_err,
            "ratio": err / max(torch_err, 2 ** -10), "lse_err": lse_err, "same_bits": same,
            "no_nan": no_nan, "guards": guards, "splits": decode.splits_of(handle)}


def check_graph(case: Case = Case(1, 1, 32, 8, 8191), seed: int = 5) -> dict:
    """Capture one decode call in a CUDA graph, replay it on new inputs copied into the
    captured ones: the same bits as an eager call on those inputs."""
    from hopper_attn import decode
    q, k, v = make_inputs(case, seed)
    handle = compile_case(case)
    out = torch.empty_like(q)
    lse = torch.empty((case.batch, case.heads, case.seqlen_q), dtype=torch.float32,
                      device=q.device)
    decode.run(handle, q, k, v, out, lse)          # workspace allocated outside the capture
    torch.cuda.synchronize()
    graph, _ = capture_graph(lambda: decode.run(handle, q, k, v, out, lse))
    ok = True
    for s in range(3):
        q2, k2, v2 = make_inputs(case, seed + 1 + s)
        q.copy_(q2), k.copy_(k2), v.copy_(v2)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager_out = torch.full_like(q, float("nan"))
        eager_lse = torch.empty_like(lse)
        decode.run(handle, q, k, v, eager_out, eager_lse)
        torch.cuda.synchronize()
        ok = ok and torch.equal(out.view(torch.int16), eager_out.view(torch.int16)) and \
            torch.equal(lse.view(torch.int32), eager_lse.view(torch.int32))
    return {"case": "graph " + case.label(), "ok": bool(ok), "splits": decode.splits_of(handle)}
