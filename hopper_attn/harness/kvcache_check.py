"""`attention_with_kvcache`'s checks, shared by tests/test_kvcache.py and
tools/kvcache_gpu_check.py.

One case: a cache (contiguous, or paged with a shuffled page table) filled with NaN, then
random keys and values written into each request's first `lens[b]` rows only; unused
page-table slots point at a NaN page (or, `unused="far"`, at indices far outside the cache:
never read); optional k_new / v_new appended by the call. The check: outputs free of NaN,
error against an fp32 reference over the gathered cache at most 2x PyTorch's own (SDPA in
the same dtype on the same keys; an e4m3 cache: the reference over the cache dequantized
in fp32, PyTorch's SDPA over it dequantized to bf16) + 2^-10, the LSE within 1e-3 or twice
PyTorch's own LSE error (its scores from a 16-bit matmul), whichever is larger (-inf where a
request has no key), the same bits on a second run, and every cache byte after
the call equal to the expected cache (the NaN-filled one with the new rows written by a
plain Python loop). Feature cases (`feature_cases`: window_size, softcap, sinks) compare with
the reference under the same masks, cap and sinks; PyTorch's error there is that reference's
in q's dtype (P and O rounded to it), SDPA having no softcap or sinks.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from hopper_attn.common.contract import normalize_window
from hopper_attn.harness.gpu_check import capture_graph


@dataclasses.dataclass(frozen=True)
class Case:
    lens: tuple                   # keys already cached, per request
    capacity: int                 # keys a request can hold (max_seqlen / max_pages x page)
    page_size: int = 0            # 0: a contiguous cache
    seqlen_q: int = 1
    heads: int = 32
    heads_kv: int = 8
    head_dim: int = 128
    causal: bool = True
    seqlen_new: int = 0
    dtype: torch.dtype = torch.bfloat16
    num_splits: int = 0
    unused: str = "nan"           # unused page-table slots: "nan" (a NaN page), "far"
    fp8: bool = False             # an e4m3 cache, per-kv-head descales
    window: tuple = (-1, -1)      # window_size (left, right) as the call takes it
    softcap: float = 0.0
    sinks: bool = False           # random (heads,) fp32 sinks

    @property
    def batch(self) -> int:
        return len(self.lens)

    def label(self) -> str:
        lens = ",".join(map(str, self.lens)) if len(self.lens) <= 4 else \
            f"{len(self.lens)}x{min(self.lens)}-{max(self.lens)}"
        return (f"{'page' + str(self.page_size) if self.page_size else 'contig'} "
                f"k[{lens}]/{self.capacity} q{self.seqlen_q} {self.heads}/{self.heads_kv} "
                f"d{self.head_dim}{' causal' if self.causal else ''}"
                + (f" new{self.seqlen_new}" if self.seqlen_new else "")
                + (" fp16" if self.dtype == torch.float16 else "")
                + (f" s{self.num_splits}" if self.num_splits else "")
                + (f" {self.unused}" if self.unused != "nan" else "")
                + (" e4m3" if self.fp8 else "")
                + (f" window{self.window[0]},{self.window[1]}" if self.window != (-1, -1)
                   else "")
                + (f" cap{self.softcap:g}" if self.softcap else "")
                + (" sinks" if self.sinks else ""))


def quick_cases() -> list[Case]:
    """Contiguous and every page size; cache lengths 0, 1, page and tile boundaries +-1,
    the full capacity; 1, 4 and 16 queries; GQA 32/8 (and 8/8, 64/8); d 128 and 64 (and
    256 with an e4m3 cache);
    appends crossing pages; forced split counts; out-of-cache indices in unused slots."""
    out = []
    for ps in (0, 16, 32, 64, 128, 256):
        cap = 1024
        edge = ps or 128
        lens = (0, 1, edge - 1, edge, edge + 1, 3 * edge + 7, cap - 1, cap)
        out.append(Case(lens, cap, ps))
        out.append(Case((5, 300, 1000, 777), cap, ps, seqlen_q=4, seqlen_new=4))
        out.append(Case((edge - 3, 2 * edge - 1, 0, 511), cap, ps, seqlen_q=16,
                        seqlen_new=16))
    out += [
        Case((0, 17, 129, 1000), 1024, 16, causal=False),
        Case((3000, 8189, 4096, 1), 8192, 16, seqlen_q=4, seqlen_new=3),
        Case((3000, 8189, 4096, 1), 8192, 128, seqlen_q=4, seqlen_new=3, num_splits=7),
        Case((8000, 20, 4095, 4097), 8192, 0, seqlen_new=1, num_splits=1),
        Case((1000, 2046, 15, 0), 2048, 16, head_dim=64, seqlen_q=4, seqlen_new=2),
        Case((1000, 2047, 15, 0), 2048, 128, head_dim=64),
        Case((1000, 200), 1024, 32, heads=8, seqlen_new=5),                 # MHA
        Case((1000, 200), 1024, 64, heads=64, seqlen_q=16, seqlen_new=16),  # 2 M tiles
        Case((500, 1020), 1024, 16, dtype=torch.float16, seqlen_q=4, seqlen_new=4),
        Case((5000, 7), 8192, 64, num_splits=128),
        # 20 requests x 8 kv heads: more items than SMs, the 64-key tile (2 boxes of a
        # 32-token page; half of a 128-token page)
        Case(tuple(i * 97 % 1024 for i in range(20)), 1024, 32, seqlen_new=1),
        Case(tuple(i * 131 % 1022 for i in range(20)), 1024, 128, seqlen_q=4, seqlen_new=2),
        # e4m3 caches: contiguous and paged, appends, 4 and 16 queries, d 64 and 256 (two
        # 16-bit stages), 3 splits of 1-4 tiles
        Case((0, 1, 127, 128, 129, 1000, 1023, 1024), 1024, 0, fp8=True),
        Case((130, 190, 250, 700), 1024, 0, fp8=True, num_splits=3),
        Case((1000, 2047, 15, 0), 2048, 16, head_dim=256, seqlen_new=1, fp8=True),
        Case((5, 300, 1000, 777), 1024, 16, seqlen_q=4, seqlen_new=4, fp8=True),
        Case((3000, 8189, 4096, 1), 8192, 128, seqlen_q=16, seqlen_new=3, fp8=True),
        Case(tuple(i * 97 % 1024 for i in range(20)), 1024, 64, seqlen_new=1, fp8=True),
        Case((1000, 2046, 15, 0), 2048, 32, head_dim=64, seqlen_new=2, fp8=True),
        Case((100, 1000, 16, 1), 1024, 16, unused="far"),
        Case((100, 1000, 128, 1), 1024, 128, unused="far", seqlen_new=2),
    ]
    return out


def feature_cases() -> list[Case]:
    """window_size (left 128 and 1000 with causal, one (64, 32) without), softcap 30 and 50,
    sinks (the combine's join and one split's fold; a request without keys: LSE the sink),
    each with a contiguous cache and pages of 16; appends; 1, 4 and 16 queries; the three
    together, also on an e4m3 cache."""
    lens = (0, 1, 100, 129, 1000, 4000, 4095)
    out = []
    for ps in (0, 16):
        out += [
            Case(lens, 4096, ps, window=(128, 0)),
            Case((5, 300, 1000, 3000), 4096, ps, seqlen_q=4, seqlen_new=4, window=(128, 0)),
            Case(lens, 4096, ps, window=(1000, -1)),
            Case((17, 1500, 4000, 4080), 4096, ps, seqlen_q=16, seqlen_new=16, window=(1000, 0),
                 heads=64),                                      # 2 M tiles
            Case((0, 90, 700, 2000), 4096, ps, seqlen_q=4, causal=False, window=(64, 32)),
            Case((0, 2, 700, 2000), 4096, ps, seqlen_q=4, window=(128, 0)),   # rows see none
            Case(lens, 4096, ps, softcap=30.0),
            Case((5, 300, 1000, 3000), 4096, ps, seqlen_q=4, seqlen_new=4, softcap=50.0),
            Case(lens, 4096, ps, sinks=True),
            Case((0, 300, 4000, 3), 4096, ps, seqlen_q=4, seqlen_new=2, sinks=True,
                 num_splits=1),
            Case((5, 300, 4000, 3000), 4096, ps, seqlen_q=4, seqlen_new=4, window=(128, 0),
                 softcap=30.0, sinks=True),
        ]
    out += [Case((5, 300, 1000, 777), 1024, 16, seqlen_q=4, seqlen_new=4, fp8=True,
                  window=(128, 0), softcap=30.0, sinks=True),
            Case((3000, 8189, 4096, 1), 8192, 128, seqlen_new=1, window=(1000, 0),
                 num_splits=7)]
    return out


def sinks_for(case: Case, device, seed: int = 0):
    """A case's (heads,) fp32 sinks (None without): logits around the scores' range."""
    if not case.sinks:
        return None
    gen = torch.Generator().manual_seed(seed + 12345)
    return (torch.randn(case.heads, generator=gen) * 2.0).to(device)


# ------------------------------------------------------------------ building a case (any device)

def page_table_for(case: Case, gen: torch.Generator) -> tuple[torch.Tensor, int, int]:
    """(page table (batch, max_pages) int32 on the CPU, num_pages, the NaN page): each
    request's used slots (for lens + seqlen_new keys) get distinct pages of a random
    permutation; unused slots the NaN page, or with unused="far" indices past the cache."""
    ps = case.page_size
    max_pages = -(-case.capacity // ps)
    num_pages = case.batch * max_pages + 2
    perm = torch.randperm(num_pages - 1, generator=gen)
    nan_page = num_pages - 1
    table = torch.full((case.batch, max_pages), nan_page, dtype=torch.int32)
    if case.unused == "far":
        table.fill_(1 << 28)
    used = 0
    for b, n in enumerate(case.lens):
        count = -(-(n + case.seqlen_new) // ps)
        table[b, :count] = perm[used:used + count].int()
        used += count
    return table, num_pages, nan_page


def make_case(case: Case, device, seed: int = 0) -> dict:
    """The inputs of a case on `device`: q, k_cache, v_cache (NaN except the cached rows),
    cache_seqlens, page_table (None: contiguous), k_new, v_new (None without an append)."""
    gen = torch.Generator().manual_seed(seed)
    b, d, hkv = case.batch, case.head_dim, case.heads_kv

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(case.dtype)

    if case.page_size:
        table, num_pages, _ = page_table_for(case, gen)
        shape = (num_pages, case.page_size, hkv, d)
    else:
        table, shape = None, (b, case.capacity, hkv, d)
    caches = []
    for _ in range(2):
        cache = torch.full(shape, float("nan"), dtype=case.dtype)
        for r, n in enumerate(case.lens):
            pos = torch.arange(n)
            cache[cache_index(pos, r, table, case.page_size)] = randn(n, hkv, d)
        caches.append(cache)
    q = randn(b, case.seqlen_q, case.heads, d)
    new = [randn(b, case.seqlen_new, hkv, d) for _ in range(2)] if case.seqlen_new \
        else [None, None]
    descales = [None, None]
    if case.fp8:        # per kv head (the same for every request), from the amax (+ 2x)
        for i in range(2):
            amax = caches[i].float().nan_to_num(0.0).abs().amax(dim=(0, 1, 3)).clamp(min=1.0)
            descales[i] = (2 * amax / 448.0).expand(b, hkv).contiguous()
            caches[i] = quantize(caches[i], descales[i][0])
            new[i] = None if new[i] is None else quantize(new[i], descales[i][0])
    to = (lambda t: None if t is None else t.to(device))
    return {"q": to(q), "k_cache": to(caches[0]), "v_cache": to(caches[1]),
            "cache_seqlens": torch.tensor(case.lens, dtype=torch.int32, device=device),
            "page_table": to(table), "k_new": to(new[0]), "v_new": to(new[1]),
            "k_descale": to(descales[0]), "v_descale": to(descales[1])}


def quantize(t, head_descale) -> torch.Tensor:
    """(..., kv_heads, d) -> e4m3 of t / descale per kv head (NaN stays NaN)."""
    return (t.float() / head_descale[:, None]).to(torch.float8_e4m3fn)


def dequantized(cache, descale) -> torch.Tensor:
    """An e4m3 cache as fp32 values (x its kv heads' descales; every request's alike)."""
    return cache.float() * descale[0][:, None]


def cache_index(pos: torch.Tensor, request: int, table, page_size: int) -> tuple:
    """Where keys `pos` of `request` live: (request, pos) in a contiguous cache, (page,
    row) through the page table."""
    if table is None:
        return (torch.full_like(pos, request), pos)
    return (table[request].long()[pos // page_size], pos % page_size)


def expected_cache(cache, new, lens, table, page_size: int) -> torch.Tensor:
    """The cache after an append of `new` (batch, seqlen_new, ...), one row at a time (an
    e4m3 cache as bytes)."""
    out = cache.clone()
    if new is None:
        return out
    if cache.dtype == torch.float8_e4m3fn:
        return expected_cache(cache.view(torch.uint8), new.view(torch.uint8), lens, table,
                              page_size).view(cache.dtype)
    for r, n in enumerate(lens):
        for i in range(new.shape[1]):
            pos = n + i
            if table is None:
                out[r, pos] = new[r, i]
            else:
                out[int(table[r, pos // page_size]), pos % page_size] = new[r, i]
    return out


def gathered(cache, request: int, keys: int, table, page_size: int) -> torch.Tensor:
    """Request `request`'s first `keys` keys (or values), (keys, kv_heads, d)."""
    pos = torch.arange(keys, device=cache.device)
    if table is not None:
        table = table.to(cache.device)
    return cache[cache_index(pos, request, table, page_size)]


def reference(q, k_cache, v_cache, keys, table, page_size: int, causal: bool, scale: float,
              window=(-1, -1), softcap: float = 0.0, sinks=None, round_to=None,
              round_scores: bool = False):
    """fp32 O (batch, seqlen_q, heads, d) and LSE (batch, heads, seqlen_q) over each
    request's gathered keys (keys[b] of them), causal aligned bottom-right per request;
    zeros and -inf (with sinks: the sink) where a query sees no key. window (left, right),
    -1 unbounded, right 0 with causal: query i sees keys i + off - left .. i + off + right
    (off = keys - seqlen_q); softcap: scores cap * tanh(s / cap) (s scaled); sinks (heads,)
    in every row's denominator; round_to: P and O rounded to that dtype (a 16-bit
    kernel's own rounding, for PyTorch's error with features SDPA lacks); round_scores: the
    scores rounded to round_to as well (torch's 16-bit matmul, for its LSE error)."""
    b, nq, h, d = q.shape
    out = torch.zeros(b, nq, h, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, nq), float("-inf"), dtype=torch.float32, device=q.device)
    left, right = normalize_window(window, False)     # (any spelling; None: unbounded)
    right = 0 if causal else right
    for r in range(b):
        nk = int(keys[r])
        if sinks is not None:
            lse[r] = sinks.float()[:, None].to(q.device)
        if nk == 0:
            continue
        k = gathered(k_cache, r, nk, table, page_size).float()
        v = gathered(v_cache, r, nk, table, page_size).float()
        group = h // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = torch.einsum("ihd,jhd->hij", q[r].float(), k) * scale
        if round_scores:
            s = s.to(round_to).float()
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        pos = torch.arange(nq, device=q.device)[:, None] + (nk - nq)
        j = torch.arange(nk, device=q.device)[None, :]
        hidden = torch.zeros(nq, nk, dtype=torch.bool, device=q.device)
        if right is not None:
            hidden |= j > pos + right
        if left is not None:
            hidden |= j < pos - left
        s = s.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.float().to(q.device)[:, None, None].expand(h, nq, 1)], -1)
        lse[r] = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[r][..., None]).nan_to_num(0.0)[..., :nk]
        if round_to is not None:
            p = p.to(round_to).float()
        out[r] = torch.einsum("hij,jhd->ihd", p, v)
    if round_to is not None:
        out = out.to(round_to).float()
    return out, lse


def torch_error(q, k_cache, v_cache, keys, table, page_size, causal, ref) -> float:
    """max |SDPA in q's dtype - fp32 reference| over the requests with keys."""
    err = 0.0
    nq = q.shape[1]
    for r in range(q.shape[0]):
        nk = int(keys[r])
        if nk == 0:
            continue
        k = gathered(k_cache, r, nk, table, page_size)
        v = gathered(v_cache, r, nk, table, page_size)
        mask = ~torch.ones(nq, nk, dtype=torch.bool, device=q.device).triu(nk - nq + 1) \
            if causal else None
        o = torch.nn.functional.scaled_dot_product_attention(
            q[r:r + 1].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2),
            attn_mask=mask, enable_gqa=True).transpose(1, 2)[0]
        err = max(err, (o.float().nan_to_num(0.0) - ref[r]).abs().max().item())
    return err


# ------------------------------------------------------------------ GPU checks

def _call(inputs, case: Case, **kw):
    from hopper_attn.kvcache import attention_with_kvcache
    i = inputs
    return attention_with_kvcache(i["q"], i["k_cache"], i["v_cache"], i["cache_seqlens"],
                                  page_table=i["page_table"], k_new=i["k_new"],
                                  v_new=i["v_new"], causal=case.causal, return_lse=True,
                                  num_splits=case.num_splits, k_descale=i["k_descale"],
                                  v_descale=i["v_descale"], window_size=case.window,
                                  softcap=case.softcap, sinks=i.get("sinks"), **kw)


def _same_bits(a, b) -> bool:
    view = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def check_case(case: Case, seed: int = 0) -> dict:
    """Run `case` twice (the second append writes the same bytes again); the verdict."""
    from hopper_attn import kvcache
    inputs = make_case(case, "cuda", seed)
    inputs["sinks"] = sinks_for(case, "cuda", seed)
    table, ps = inputs["page_table"], case.page_size
    lens = case.lens
    expect_k = expected_cache(inputs["k_cache"], inputs["k_new"], lens, table, ps)
    expect_v = expected_cache(inputs["v_cache"], inputs["v_new"], lens, table, ps)
    runs = [_call(inputs, case) for _ in range(2)]
    torch.cuda.synchronize()
    (out, lse), (out2, lse2) = runs
    cache_ok = _same_bits(inputs["k_cache"], expect_k) and \
        _same_bits(inputs["v_cache"], expect_v)
    keys = [n + case.seqlen_new for n in lens]
    scale = case.head_dim ** -0.5
    if case.fp8:    # the reference over the dequantized cache; torch's error: bf16 of it
        expect_k = dequantized(expect_k, inputs["k_descale"])
        expect_v = dequantized(expect_v, inputs["v_descale"])
    features = dict(window=case.window, softcap=case.softcap, sinks=inputs["sinks"])
    ref, ref_lse = reference(inputs["q"], expect_k, expect_v, keys, table, ps, case.causal,
                             scale, **features)
    if case.window != (-1, -1) or case.softcap or case.sinks:
        low = reference(inputs["q"], expect_k.to(case.dtype), expect_v.to(case.dtype), keys,
                        table, ps, case.causal, scale, **features, round_to=case.dtype)[0]
        t_err = (low - ref).abs().max().item()
    else:
        t_err = torch_error(inputs["q"], expect_k.to(case.dtype), expect_v.to(case.dtype),
                            keys, table, ps, case.causal, ref)
    err = (out.float() - ref).abs().max().item()
    finite = ref_lse.isfinite()
    lse_ok = bool(torch.equal(lse.isfinite(), finite))
    lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    # The LSE's bound: 1e-3, or twice torch's own (scores from a 16-bit matmul), whichever is
    # larger; an e4m3 consumer that quantizes the queries lands between the two.
    low_lse = reference(inputs["q"], expect_k.to(case.dtype), expect_v.to(case.dtype), keys,
                        table, ps, case.causal, scale, **features, round_to=case.dtype,
                        round_scores=True)[1]
    t_lse_err = (low_lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    lse_limit = max(1e-3, 2 * t_lse_err)
    no_nan = not out.isnan().any().item() and not lse.isnan().any().item()
    same = _same_bits(out, out2) and _same_bits(lse, lse2)
    limit = 2 * t_err + 2 ** -10
    ok = no_nan and err <= limit and lse_ok and lse_err <= lse_limit and same and cache_ok
    window = normalize_window(case.window, case.causal)
    problem = kvcache.problem_for(inputs["q"], case.heads_kv, case.capacity, case.causal,
                                  window)
    return {"case": case.label(), "ok": bool(ok), "err": err, "torch_err": t_err,
            "ratio": err / max(t_err, 2 ** -10), "lse_err": lse_err, "lse_limit": lse_limit,
            "torch_lse_err": t_lse_err, "lse_inf_ok": lse_ok,
            "same_bits": same, "no_nan": no_nan, "cache_ok": cache_ok,
            "plan": kvcache.plan(problem, case.num_splits, case.fp8, case.softcap, case.sinks,
                                 case.page_size)}


def failure_flags(verdict: dict) -> str:
    """What a failed `check` (or prefill_check's) verdict failed on, for a printed line."""
    if verdict["ok"]:
        return ""
    return (" nan" * (not verdict["no_nan"]) + " bits" * (not verdict["same_bits"])
            + " cache" * (not verdict["cache_ok"]) + " lse-inf" * (not verdict["lse_inf_ok"])
            + f" lse{verdict['lse_err']:.1e}" * (verdict["lse_err"] > verdict.get("lse_limit",
                                                                                  1e-3)))


def check_graph(case: Case = Case((1000, 4095, 17, 0), 4096, 16, seqlen_new=1),
                seed: int = 11) -> dict:
    """Capture one decode step (append + attention) in a CUDA graph; replay it with new
    queries, new keys, other cache lengths and a reshuffled page table copied into the
    captured tensors: the same bits as an eager call on those inputs."""
    inputs = make_case(case, "cuda", seed)
    _call(inputs, case)                          # compile and workspace outside the capture
    torch.cuda.synchronize()
    graph, (out, lse) = capture_graph(lambda: _call(inputs, case))
    ok = True
    for s in range(3):
        lens = tuple((n * (s + 3) + 11 * s) % (case.capacity - case.seqlen_new)
                     for n in case.lens)
        fresh = make_case(dataclasses.replace(case, lens=lens), "cuda", seed + 1 + s)
        for name, t in fresh.items():
            if t is not None:
                inputs[name].copy_(t)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed = (out.clone(), lse.clone())
        eager_out, eager_lse = _call(inputs, case)
        torch.cuda.synchronize()
        ok = ok and _same_bits(replayed[0], eager_out) and _same_bits(replayed[1], eager_lse)
        ok = ok and not replayed[0].isnan().any().item()
    return {"case": "graph " + case.label(), "ok": bool(ok)}
