"""k2: fused attention, FlashAttention-2 algorithm, on CUDA cores.

What changes from k1: one kernel instead of three, and no N x N matrix anywhere. A CTA owns
64 query rows, keeps them in shared memory, and walks the key/value sequence 64 rows at a
time: S = Q K^T for that tile, an online-softmax update (running row max and sum, deferred
normalization), O += P V, with O in fp32 registers and normalized once at the end.
Memory is O(N); each K/V byte is read once per query tile instead of once per query row.

What stays: plain loads and stores issued by every thread (k3 replaces them with TMA), fp32
FMAs on the CUDA cores (k4 moves the GEMMs to the tensor cores).

Budget: 256 threads (8 warps); SMEM = Q, K, V tiles of 64 x d bf16 (8 KiB each at d = 64,
16 KiB at d = 128) + P^T 17 KiB; ~100-130 registers per thread. The compute body (thread
mapping, S = Q K^T, softmax, P V) is `ScalarTile` in hopper_attn/common/cuda_core.py; this file
shows only the loop around it and how the tiles get into shared memory.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

from hopper_attn.common.contract import KernelSpec, compile_attention, run_attention
from hopper_attn.common.cuda_core import ScalarTile
from hopper_attn.common.layouts import ndhb_view, smem_tile_layout
from hopper_attn.common.masking import TileSchedule

SPEC = KernelSpec(
    name="k2",
    summary="fused FA2 forward: tiled online softmax on CUDA cores",
    head_dims=(64, 128),
)


class FlashAttentionK2:
    def __init__(self, head_dim: int, causal: bool, unroll: int = 4):
        self.head_dim = head_dim
        self.causal = causal
        self.tile = ScalarTile(head_dim, unroll)
        self.schedule = TileSchedule(self.tile.block_m, self.tile.block_n, causal)

    def describe(self) -> dict:
        return {"smem_bytes": getattr(self, "smem_bytes", None), "block_m": self.tile.block_m,
                "block_n": self.tile.block_n, "threads": self.tile.threads}

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 scale_log2: Float32, stream):
        q, k, v, o = [ndhb_view(t) for t in (mQ, mK, mV, mO)]   # (N, d, H, B)
        tile_layout = smem_tile_layout(BFloat16, self.tile.block_m, self.head_dim)
        p_layout = self.tile.p_layout()

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(tile_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(tile_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(tile_layout)], 1024]
            sPt: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(p_layout)], 16]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        seqlen, heads, batch = q.shape[0], q.shape[2], q.shape[3]
        self.kernel(q, k, v, o, scale_log2, tile_layout, p_layout).launch(
            grid=self.schedule.grid(seqlen, heads, batch),
            block=[self.tile.threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               scale_log2: Float32, tile_layout: cute.ComposedLayout, p_layout: cute.Layout):
        tile, schedule = self.tile, self.schedule
        bm, bn, d = tile.block_m, tile.block_n, self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        _, head, batch = cute.arch.block_idx()
        seqlen = mQ.shape[0]
        m_block, n_count = schedule.work(seqlen)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(tile_layout.outer, swizzle=tile_layout.inner)
        sK = storage.sK.get_tensor(tile_layout.outer, swizzle=tile_layout.inner)
        sV = storage.sV.get_tensor(tile_layout.outer, swizzle=tile_layout.inner)
        sPt = storage.sPt.get_tensor(p_layout)[None, None, 0]

        gQ = cute.local_tile(mQ[None, None, head, batch], (bm, d), (m_block, 0))
        gO = cute.local_tile(mO[None, None, head, batch], (bm, d), (m_block, 0))
        gK = cute.local_tile(mK[None, None, head, batch], (bn, d), (None, 0))   # (bn, d, n)
        gV = cute.local_tile(mV[None, None, head, batch], (bn, d), (None, 0))

        rg, cg = tile.thread_groups(tidx)
        q_rows, k_rows = tile.my_rows(sQ, rg), tile.my_kv_rows(sK, cg)
        s_coords, p_slots = tile.s_coords(rg, cg), tile.p_slots(sPt, rg, cg)
        p_rows, v_cols = tile.pv_views(sPt, sV, rg, cg)

        tile.load_tile(gQ, sQ, seqlen - m_block * bm, tidx)
        softmax = tile.new_softmax(scale_log2)
        acc_o = tile.new_o_accumulator()

        for n in cutlass.range(schedule.n_block_count(m_block, seqlen)):
            cute.arch.sync_threads()           # everyone is done with the previous K and V
            tile.load_tile(gK[None, None, n], sK, seqlen - n * bn, tidx)
            tile.load_tile(gV[None, None, n], sV, seqlen - n * bn, tidx)
            cute.arch.sync_threads()           # the tiles are in shared memory
            acc_s = tile.qk(q_rows, k_rows)
            tile.attend(acc_s, acc_o, softmax, schedule.needs_mask(m_block, n, seqlen),
                        s_coords, m_block * bm, n * bn, seqlen, self.causal,
                        p_slots, p_rows, v_cols)

        tile.store_o(acc_o, gO, softmax.finalize(), seqlen - m_block * bm, rg, cg)


def compile_kernel(problem, *, compile_options: str = "", unroll: int = 4):
    """Compile (or fetch from the cache) k2 for `problem`; option: unroll (loop body size)."""
    return compile_attention(SPEC, FlashAttentionK2, problem, {"unroll": unroll},
                             compile_options=compile_options)


def run_kernel(handle, q, k, v, out):
    run_attention(handle, q, k, v, out)
