"""torch.randn as a CUDA device draws it, on the CPU: the grid's inputs of a GPU run.

    gen = CudaRandn(seed); q = gen.randn(9, 1, 6, 96)      # = torch.manual_seed(seed);
                                                            #   torch.randn(..., device="cuda")
torch's CUDA normal_ (fp32) runs a grid-stride kernel of 256-thread blocks, min(ceil(numel /
256), SMs x 2048 / 256) of them; thread `idx` draws curand_normal4 from a Philox4x32-10 state
with key = seed, counter = (the generator's offset / 4 + call, idx) (low and high 64 bits),
and writes its four values to elements idx + j x threads (j = 0..3) of each stride of 4 x
threads; each randn advances the offset by 4 x its calls per thread. curand_normal4 is Box-
Muller on two pairs of 32-bit words (u = x 2^-32 + 2^-33, angle y 2^-32 2 pi + half a step).
The device's fast sincos is emulated by the exact one: a value may differ in its last fp32
bit, which the bf16 inputs rarely see. Checked against the H200 grid run (session 8): the
reproduced draws give its torch errors to 6 digits (tests/test_fa_grid.py)."""

from __future__ import annotations

import numpy as np
import torch

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)    # Philox4x32 multipliers
_W0, _W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)    # key schedule (Weyl)
_LOW = np.uint64(0xFFFFFFFF)


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Ten Philox rounds on uint32 arrays (counter words c0..c3, key k0, k1)."""
    k0 = np.full_like(c0, k0)
    k1 = np.full_like(c0, k1)
    for r in range(10):
        p0 = _M0 * c0.astype(np.uint64)
        p1 = _M1 * c2.astype(np.uint64)
        hi0, lo0 = (p0 >> np.uint64(32)).astype(np.uint32), (p0 & _LOW).astype(np.uint32)
        hi1, lo1 = (p1 >> np.uint64(32)).astype(np.uint32), (p1 & _LOW).astype(np.uint32)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        if r < 9:
            k0, k1 = k0 + _W0, k1 + _W1
    return c0, c1, c2, c3


def _box_muller(x, y):
    step = np.float32(2.3283064e-10)                        # 2^-32 as curand rounds it
    turn = step * np.float32(6.2831855)
    u = (x.astype(np.float64) * step + step / 2).astype(np.float32)
    v = (y.astype(np.float64) * turn + turn / 2).astype(np.float32)
    radius = np.sqrt(np.float32(-2.0) * np.log(u.astype(np.float64)).astype(np.float32))
    return (np.sin(v.astype(np.float64)).astype(np.float32) * radius,
            np.cos(v.astype(np.float64)).astype(np.float32) * radius)


class CudaRandn:
    """The CUDA generator after torch.manual_seed(seed): successive fp32 randn draws."""

    def __init__(self, seed: int, sms: int = 132, threads_per_sm: int = 2048):
        self.seed, self.offset = int(seed), 0
        self.max_blocks = sms * (threads_per_sm // 256)

    def randn(self, *shape) -> torch.Tensor:
        numel = int(np.prod(shape))
        threads = 256 * min(self.max_blocks, -(-numel // 256))
        calls = (numel - 1) // (threads * 4) + 1           # curand_normal4 calls per thread
        first, self.offset = self.offset // 4, self.offset + 4 * calls
        out = np.empty(numel, np.float32)
        idx = np.arange(threads, dtype=np.uint64)
        lane = np.arange(threads)
        key = (np.uint32(self.seed & 0xFFFFFFFF), np.uint32(self.seed >> 32))
        for call in range(calls):
            counter = np.uint64(first + call)
            words = (np.full(threads, counter & _LOW).astype(np.uint32),
                     np.full(threads, counter >> np.uint64(32)).astype(np.uint32),
                     (idx & _LOW).astype(np.uint32), (idx >> np.uint64(32)).astype(np.uint32))
            r0, r1, r2, r3 = philox4x32_10(*words, *key)
            for j, values in enumerate((*_box_muller(r0, r1), *_box_muller(r2, r3))):
                at = call * threads * 4 + j * threads + lane
                keep = at < numel
                out[at[keep]] = values[keep]
        return torch.from_numpy(out.reshape(shape))
