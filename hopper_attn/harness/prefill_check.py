"""Chunked prefill through `attention_with_kvcache`: its GPU checks, shared by
tests/test_kvcache.py and tools/prefill_gpu_check.py.

A case: harness/kvcache_check.py's cache (contiguous or paged with a shuffled table, NaN
past each request's keys and in unused pages), with a chunk of new queries per request:
the dense (batch, seqlen_q) form (optionally appending the chunk's keys) or a varlen query
batch (q (total_q, H, d) + cu_seqlens_q, the keys already in the cache). The check: the
output free of NaN (its memory NaN-filled before each call), error against an fp32
reference over the gathered cache at most 2x PyTorch's own (SDPA in q's dtype on the same
keys; with softcap or sinks an eager computation in q's dtype) + 2^-10, the LSE within 1e-3 (-inf
where a query sees no key), the same bits on a second call, every cache byte after the
append as expected.
"""

from __future__ import annotations

import dataclasses

import torch

from hopper_attn.harness.gpu_check import capture_graph

BF16 = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class PCase:
    lens: tuple                   # keys in each request's cache before the call
    q_lens: tuple                 # new queries per request (dense: all equal)
    capacity: int
    page_size: int = 0
    varlen: bool = False          # q (total_q, H, d) + cu_seqlens_q (no appends)
    seqlen_new: int = 0           # dense only: keys appended by the call
    heads: int = 32
    heads_kv: int = 8
    head_dim: int = 128
    dtype: torch.dtype = BF16
    causal: bool = True
    window_left: int = -1
    softcap: float = 0.0
    sinks: bool = False           # random (heads,) fp32 sinks

    def label(self) -> str:
        def short(xs):
            return ",".join(map(str, xs)) if len(xs) <= 4 else f"{len(xs)}x{min(xs)}-{max(xs)}"
        return (f"{'page' + str(self.page_size) if self.page_size else 'contig'} "
                f"k[{short(self.lens)}]/{self.capacity} "
                f"{'varlen ' if self.varlen else ''}q[{short(self.q_lens)}] "
                f"{self.heads}/{self.heads_kv} d{self.head_dim}"
                + (" causal" if self.causal else "")
                + (f" new{self.seqlen_new}" if self.seqlen_new else "")
                + (" fp16" if self.dtype == torch.float16 else "")
                + (f" win{self.window_left}" if self.window_left >= 0 else "")
                + (f" cap{self.softcap:g}" if self.softcap else "")
                + (" sinks" if self.sinks else ""))


def cases(quick: bool) -> list:
    out = []
    for ps in (0, 16, 64, 128, 256):
        edge = ps or 128
        cap = 4096
        # dense chunks with appends: the new keys cross pages and tiles
        out.append(PCase((0, edge - 1, edge + 1, 3 * edge + 7), (113,) * 4, cap, ps,
                         seqlen_new=113))
        out.append(PCase((1000, 17, 2 * edge, cap - 500), (500,) * 4, cap, ps,
                         seqlen_new=500))
        # varlen chunks, unequal (one empty), keys already in the cache
        out.append(PCase((500, 17, 3000, 4096, 129), (17, 0, 300, 500, 129), cap, ps,
                         varlen=True))
    out += [
        PCase((0, 1, 2031), (17,) * 3, 2048, 32, seqlen_new=17),
        PCase((200, 1500), (17,) * 2, 2048, 16, seqlen_new=0),     # no append, 17 queries
        PCase((300, 1100, 2048), (64, 33, 250), 2048, 16, varlen=True, heads=8),   # MHA
        PCase((3000, 999), (113,) * 2, 4096, 128, seqlen_new=113, head_dim=64),
        PCase((3000, 999), (100, 40), 4096, 0, varlen=True, head_dim=64, heads=8),
        PCase((513, 1948), (200,) * 2, 2048, 64, seqlen_new=100, dtype=torch.float16),
        PCase((700, 1919), (129,) * 2, 2048, 16, seqlen_new=129, causal=False),
        PCase((1000, 2000), (300, 77), 2048, 128, varlen=True, window_left=256),
        PCase((1000, 1998), (113,) * 2, 2048, 0, seqlen_new=50, window_left=100),
        PCase((1000, 2000), (300, 77), 2048, 64, varlen=True, softcap=30.0),
        PCase((0, 700, 1900), (100,) * 3, 2048, 0, seqlen_new=100, sinks=True),
        PCase((1000, 0, 2000), (300, 40, 77), 2048, 16, varlen=True, window_left=128,
              sinks=True),
        PCase(tuple(i * 331 % 4000 for i in range(20)), tuple(17 + i * 37 % 300
                                                               for i in range(20)),
              4096, 16, varlen=True),               # 20 requests: more items than SMs
    ]
    if quick:
        return out
    out += [PCase((5000, 30000, 12000, 1), (500,) * 4, 32768, ps, seqlen_new=500)
            for ps in (0, 16, 128)]
    return out


# ------------------------------------------------------------------ inputs and the call

def make_inputs(case: PCase, seed: int, device="cuda") -> dict:
    """kvcache_check's case (NaN past each request's keys and in unused pages), with q cut
    to the case's chunks (varlen: packed) and cu_seqlens_q."""
    from hopper_attn.harness import kvcache_check as kc
    base = kc.Case(case.lens, case.capacity, case.page_size, max(case.q_lens), case.heads,
                   case.heads_kv, case.head_dim, case.causal, case.seqlen_new, case.dtype)
    i = kc.make_case(base, device, seed)
    if case.varlen:
        i["q_dense"] = i["q"]
        i["q"] = torch.cat([i["q"][b, :n] for b, n in enumerate(case.q_lens)])
        cu = [0]
        for n in case.q_lens:
            cu.append(cu[-1] + n)
        i["cu_seqlens_q"] = torch.tensor(cu, dtype=torch.int32, device=device)
    i["sinks"] = None
    if case.sinks:      # logits around the scores' range
        gen = torch.Generator().manual_seed(seed + 12345)
        i["sinks"] = (torch.randn(case.heads, generator=gen) * 2.0).to(device)
    return i


def call(i: dict, case: PCase):
    from hopper_attn import attention_with_kvcache
    extra = dict(cu_seqlens_q=i["cu_seqlens_q"], max_seqlen_q=max(case.q_lens)) \
        if case.varlen else dict(k_new=i["k_new"], v_new=i["v_new"])
    return attention_with_kvcache(i["q"], i["k_cache"], i["v_cache"], i["cache_seqlens"],
                                  page_table=i["page_table"], causal=case.causal,
                                  return_lse=True, window_size=(case.window_left, -1),
                                  softcap=case.softcap, sinks=i["sinks"], **extra)


def poisoned_call(i: dict, case: PCase):
    """`call` after a NaN-filled block of the output's size was freed: the caching
    allocator hands that memory to the output (rows the kernel skips stay NaN)."""
    junk = torch.full_like(i["q"], float("nan"))
    del junk
    return call(i, case)


# ------------------------------------------------------------------ the reference

def attend(q, k, v, nk: int, case: PCase, scale: float, low_precision: bool, sinks=None):
    """One request: q (nq, H, d), k and v (nk, Hkv, d). fp32 (or, low_precision, q's dtype
    as PyTorch computes it) O (nq, H, d) and LSE (H, nq); zeros / -inf (with sinks: the
    sink) for rows without keys; sinks (H,) in every row's denominator."""
    nq, h, d = q.shape
    group = h // k.shape[1]
    i = torch.arange(nq, device=q.device)[:, None] + nk - nq
    j = torch.arange(nk, device=q.device)[None, :]
    visible = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    if case.causal:
        visible &= j <= i
    if case.window_left >= 0:
        visible &= j >= i - case.window_left
    if low_precision and not case.softcap and sinks is None:
        o = torch.nn.functional.scaled_dot_product_attention(
            q[None].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2),
            attn_mask=visible, enable_gqa=True, scale=scale).transpose(1, 2)[0]
        return o.float().nan_to_num(0.0), None
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if low_precision:       # (softcap, sinks: 16-bit scores and P V, as an eager model)
        s = torch.einsum("ihd,jhd->hij", q, k).float() * scale
    else:
        s = torch.einsum("ihd,jhd->hij", q.float(), k.float()) * scale
    if case.softcap:
        s = case.softcap * torch.tanh(s / case.softcap)
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.float()[:, None, None].expand(h, nq, 1)], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)[..., :nk]
    if low_precision:
        o = torch.einsum("hij,jhd->ihd", p.to(q.dtype), v).float()
    else:
        o = torch.einsum("hij,jhd->ihd", p, v.float())
    return o, lse


def check(case: PCase, seed: int, device="cuda") -> dict:
    from hopper_attn.harness import kvcache_check as kc
    i = make_inputs(case, seed, device)
    table, ps = i["page_table"], case.page_size
    new = None if case.varlen else i["k_new"]
    expect_k = kc.expected_cache(i["k_cache"], new, case.lens, table, ps)
    expect_v = kc.expected_cache(i["v_cache"], None if case.varlen else i["v_new"], case.lens,
                                 table, ps)
    runs = [poisoned_call(i, case) for _ in range(2)]
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    (out, lse), (out2, lse2) = runs
    cache_ok = kc._same_bits(i["k_cache"], expect_k) and kc._same_bits(i["v_cache"], expect_v)
    scale = case.head_dim ** -0.5
    err = t_err = lse_err = 0.0
    lse_ok = True
    row = 0
    q_dense = i.get("q_dense", i["q"])
    for b, nq in enumerate(case.q_lens):
        nk = case.lens[b] + (0 if case.varlen else case.seqlen_new)
        if nq == 0:
            continue
        k = kc.gathered(expect_k, b, nk, table, ps)
        v = kc.gathered(expect_v, b, nk, table, ps)
        q = q_dense[b, :nq]
        ref, ref_lse = attend(q, k, v, nk, case, scale, False, i["sinks"])
        low, _ = attend(q, k, v, nk, case, scale, True, i["sinks"])
        if case.varlen:
            got, got_lse = out[row:row + nq], lse[:, row:row + nq]
            row += nq
        else:
            got, got_lse = out[b], lse[b]
        err = max(err, (got.float() - ref).abs().max().item())
        t_err = max(t_err, (low - ref).abs().max().item())
        finite = ref_lse.isfinite()
        lse_ok = lse_ok and bool(torch.equal(got_lse.isfinite(), finite))
        if finite.any():
            lse_err = max(lse_err, (got_lse[finite] - ref_lse[finite]).abs().max().item())
    no_nan = not out.isnan().any().item() and not lse.isnan().any().item()
    same = kc._same_bits(out, out2) and kc._same_bits(lse, lse2)
    ok = no_nan and err <= 2 * t_err + 2 ** -10 and lse_ok and lse_err <= 1e-3 and same \
        and cache_ok
    return {"case": case.label(), "ok": bool(ok), "err": err, "torch_err": t_err,
            "ratio": err / max(t_err, 2 ** -10), "lse_err": lse_err, "lse_inf_ok": lse_ok,
            "same_bits": same, "no_nan": no_nan, "cache_ok": cache_ok}


def check_graph(seed: int = 5) -> dict:
    """Capture one chunk (append + attention, paged 16) in a CUDA graph; replay it with new
    queries, keys, lengths and a reshuffled table copied in: the eager call's bits."""
    case = PCase((1000, 3000, 17, 0), (129,) * 4, 4096, 16, seqlen_new=129)
    i = make_inputs(case, seed)
    call(i, case)                                # compile outside the capture
    torch.cuda.synchronize()
    graph, (out, lse) = capture_graph(lambda: call(i, case))
    ok = True
    for s in range(3):
        lens = tuple((n * (s + 3) + 11 * s) % (case.capacity - case.seqlen_new)
                     for n in case.lens)
        fresh = make_inputs(dataclasses.replace(case, lens=lens), seed + 1 + s)
        for name in ("q", "k_cache", "v_cache", "cache_seqlens", "page_table", "k_new",
                     "v_new"):
            i[name].copy_(fresh[name])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed = (out.clone(), lse.clone())
        eager = call(i, case)
        torch.cuda.synchronize()
        from hopper_attn.harness import kvcache_check as kc
        ok = ok and kc._same_bits(replayed[0], eager[0]) and \
            kc._same_bits(replayed[1], eager[1]) and not replayed[0].isnan().any().item()
    return {"case": "graph " + case.label(), "ok": bool(ok)}
