"""What FP8 Q and P would cost in accuracy for an e4m3 KV cache (CPU, torch only): the
max error against an fp64 reference over the dequantized cache, one query per head, of

* torch: bf16 SDPA over the dequantized cache (the error the kvcache check allows 2x of,
  plus 2^-10);
* fp16 Q and P with fp32 accumulation (what the decode kernel's e4m3 path does);
* Q quantized to e4m3 per head (amax scaling), P fp16; P in e4m3, Q fp16; both in e4m3
  (what an FP8 WGMMA for both products would need);
* both as two e4m3 terms, x = hi + lo with lo = e4m3(x - hi), Q scaled to 224 per row and
  P x 2^8 (`e4m3x2_qp`: what hopper_attn/decode_fp8swap.py computes; docs/lab/kvcache.md).

    python tools/fp8_qp_error.py [--lengths 1024,8192,32768]

A CPU emulation (torch's CPU SDPA stands in for the GPU's); docs/kvcache.md quotes it.
"""

from __future__ import annotations

import argparse

import torch

F8 = torch.float8_e4m3fn


def two_terms(x: torch.Tensor) -> torch.Tensor:
    """x as hi + lo, both e4m3 (fp32 values)."""
    hi = x.to(F8).float()
    return hi + (x - hi).to(F8).float()


def attention(q, k, v, p_dtype=None):
    """softmax(q k^T / sqrt(d)) v; with `p_dtype`, exp(s - max) rounded to it before P V
    and 1 / l applied after, in fp32 (as the kernel does)."""
    s = (q @ k.T) * q.shape[-1] ** -0.5
    if p_dtype is None:
        return torch.softmax(s, -1) @ v
    if p_dtype == "e4m3x2":
        e = torch.exp(s - s.max(-1, keepdim=True).values)
        return (two_terms(e * 256) @ v) / (256 * e.sum(-1, keepdim=True))
    e = torch.exp(s - s.max(-1, keepdim=True).values)
    return (e.to(p_dtype).float() @ v) / e.sum(-1, keepdim=True)


def errors(n: int, d: int = 128, heads: int = 32, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, d, generator=gen).to(torch.bfloat16).float()
    k = torch.randn(n, d, generator=gen).to(F8).float()      # dequantized (descale 1)
    v = torch.randn(n, d, generator=gen).to(F8).float()
    ref = attention(q.double(), k.double(), v.double()).float()
    torch_out = torch.nn.functional.scaled_dot_product_attention(
        *(t.to(torch.bfloat16)[None] for t in (q, k, v))).float()[0]
    q_scale = 448 / q.abs().amax(-1, keepdim=True)
    q8 = (q * q_scale).to(F8).float() / q_scale
    q16 = q.half().float()
    q_top = 224 / q.abs().amax(-1, keepdim=True)
    q8x2 = two_terms(q * q_top) / q_top
    outs = {"torch_bf16": torch_out, "fp16_qp": attention(q16, k, v, torch.float16),
            "e4m3_q": attention(q8, k, v, torch.float16),
            "e4m3_p": attention(q16, k, v, F8), "e4m3_qp": attention(q8, k, v, F8),
            "e4m3x2_qp": attention(q8x2, k, v, "e4m3x2")}
    err = {name: (o - ref).abs().max().item() for name, o in outs.items()}
    err["bound"] = 2 * err["torch_bf16"] + 2 ** -10
    return err


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,8192,32768")
    args = parser.parse_args()
    for n in (int(x) for x in args.lengths.split(",")):
        e = errors(n)
        print(f"n {n}: " + " | ".join(f"{k} {v:.2e}" for k, v in e.items()))


if __name__ == "__main__":
    main()
