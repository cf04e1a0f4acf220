"""The LSE error of k6's lazy rescale with rounded row sums (d 192 / 256), emulated in
float64 on the CPU (docs/window.md, "Head dims 192 and 256"):

    python tools/rounded_sums_lse.py

Per query tile and kv tile, as k6 runs it: the row maxima a reference that moves only where
some row of a warp's 16 grew by more than 2^8 (exp2 units), P = 2^(s scale_log2 - m_ref)
rounded to bf16 before the row sums (`round_p`), LSE = m_ref scale + ln l. Prints the worst
|LSE - exact| over B1 H4 N1000 random bf16 inputs, with and without a window, rounded and
not: the error is the rounding's, at every mask (the H200's failing check used 1e-3).
"""

from __future__ import annotations

import math

import torch

TILES = {128: (128, 128), 192: (128, 112), 256: (128, 80)}     # k6's (block_m, block_n)


def worst_lse_error(n: int, d: int, left: int, round_p: bool, lazy: bool = True,
                    heads: int = 4, seed: int = 0) -> float:
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(n, heads, d, generator=gen).bfloat16().double() for _ in range(2))
    scale = d ** -0.5
    scale_log2 = scale * math.log2(math.e)
    s = torch.einsum("ihd,jhd->hij", q, k)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    seen = j <= i
    if left >= 0:
        seen &= j >= i - left
    s = s.masked_fill(~seen, -math.inf)
    exact = torch.logsumexp(s * scale, -1)
    block_m, block_n = TILES[d]
    threshold = 8.0 if lazy else 0.0
    worst = 0.0
    for m in range(-(-n // block_m)):
        r0, r1 = m * block_m, min(n, (m + 1) * block_m)
        first = max(0, r0 - left) // block_n if left >= 0 else 0
        rows = s[:, r0:r1]
        m_ref = torch.full(rows.shape[:2], -math.inf, dtype=torch.float64)
        total = torch.zeros(rows.shape[:2], dtype=torch.float64)
        for t in range(first, (r1 - 1) // block_n + 1):
            tile = rows[:, :, t * block_n:(t + 1) * block_n]
            m_new = torch.maximum(m_ref, tile.amax(-1))
            grew = ((m_new - m_ref) * scale_log2).nan_to_num(0.0) > threshold
            votes = torch.zeros_like(grew)
            for w in range(0, r1 - r0, 16):                     # a warp's 16 rows vote
                votes[:, w:w + 16] = grew[:, w:w + 16].any(-1, keepdim=True)
            m_safe = m_new.nan_to_num(0.0, neginf=0.0)
            alpha = torch.exp2((m_ref - m_safe) * scale_log2)
            total = torch.where(votes, total * alpha, total)
            m_ref = torch.where(votes, m_new, m_ref)
            offset = m_ref.nan_to_num(0.0, neginf=0.0)[..., None] * scale_log2
            p = torch.exp2(tile * scale_log2 - offset).float()
            if round_p:
                p = p.bfloat16()
            total = total + p.double().sum(-1)
        lse = m_ref * scale + torch.log(total)
        finite = exact[:, r0:r1].isfinite()
        worst = max(worst, (lse - exact[:, r0:r1])[finite].abs().max().item())
    return worst


def main() -> None:
    for d in (192, 256):
        for left in (127, -1):
            rounded = worst_lse_error(1000, d, left, True)
            plain = worst_lse_error(1000, d, left, False)
            window = f"window ({left}, 0)" if left >= 0 else "full causal"
            print(f"d {d} {window:17} rounded sums {rounded:.2e}  unrounded {plain:.2e}  "
                  f"(bound ln(1 + 2^-8) = {math.log1p(2 ** -8):.2e})")


if __name__ == "__main__":
    main()
