"""k4_qk: S = Q K^T on the tensor cores (WGMMA); everything else is k3's.

What changes from k3: the 64 x 64 x d product S = Q K^T, about half of the FLOPs, is one
warpgroup MMA batch per warpgroup instead of 64 FMAs per score on the CUDA cores. The two
warpgroups of the CTA split the 64 kv columns (32 each) and read Q and K directly from the
swizzled SMEM tiles TMA wrote (K-major SMEM descriptors; no copies). The fp32 accumulator
lives in registers in the WGMMA layout, which is not the CUDA-core layout k3's softmax and
P V expect, so it takes a detour: every thread asks an identity tensor, partitioned exactly
like its accumulator, for the (row, col) of each of its registers, and stores the value at
that position of the P^T buffer in SMEM. After a barrier each thread reads back its own
4 x 4 scores in the k3 layout, and k3's softmax, P store and scalar P V run unchanged
(the softmax overwrites each score with its probability in place).

What stays: k3's TMA pipeline, the CUDA-core softmax and P V, the epilogue. The class
inherits from k3's and overrides one method.

Budget: 256 threads = 2 warpgroups; SMEM as k3 (2 stages by default) plus a second P^T
buffer (17 KiB); the accumulator adds 16 fp32 registers per thread (64 x 32 per warpgroup).
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.nvgpu import warpgroup

from hopper_attn.common import wgmma
from hopper_attn.common.contract import KernelSpec, compile_attention, run_attention
from hopper_attn.common.cuda_core import ScalarTile
from hopper_attn.k3 import FlashAttentionK3

SPEC = KernelSpec(
    name="k4_qk",
    summary="k3 with S = QK^T on WGMMA, S handed to the CUDA-core softmax through SMEM",
    head_dims=(64, 128),
)


@dataclasses.dataclass(frozen=True)
class WgmmaScores:
    tile: ScalarTile
    mma: cute.TiledMma
    q_frag: cute.Tensor      # SMEM descriptors of Q for my warpgroup
    k_frag: cute.Tensor      # SMEM descriptors of K, (..., stage)
    acc_coords: cute.Tensor  # (row, col) in the S tile of each of my accumulator registers
    acc_shape: tuple

    @cute.jit
    def __call__(self, stage, p_slots, s_pt):
        acc = cute.make_rmem_tensor(self.acc_shape, Float32)
        wgmma.gemm(self.mma, acc, self.q_frag, self.k_frag[None, None, None, stage], zero_init=True)
        warpgroup.wait_group(0)
        # the coordinate probe: register i holds S[row, col]; park it at P^T[col, row]
        for i in cutlass.range_constexpr(cute.size(acc)):
            row, col = self.acc_coords[i]
            s_pt[col, row] = acc[i]
        cute.arch.sync_threads()
        return self.tile.load_s(p_slots)


class FlashAttentionK4QK(FlashAttentionK3):
    # Threads scatter S into P^T for each other, so a buffer may only be rewritten once every
    # thread is past its P V reads: two buffers used alternately, and the CTA barrier after
    # each scatter, guarantee that.
    p_buffers = 2

    def describe(self) -> dict:
        return {**super().describe(), "qk": "wgmma 64x32x16 per warpgroup"}

    def make_scores(self, sQ, sK, tidx, rg, cg):
        tile = self.tile
        warpgroups_n = tile.threads // 128
        mma = wgmma.qk_mma(1, warpgroups_n, tile.block_n // warpgroups_n)
        wg = wgmma.warpgroup_slice(mma, tidx)
        thr = mma.get_slice(tidx)
        acc_coords = thr.partition_C(cute.make_identity_tensor((tile.block_m, tile.block_n)))
        acc_shape = mma.partition_shape_C((tile.block_m, tile.block_n))
        return WgmmaScores(tile, mma, wg.make_fragment_A(wg.partition_A(sQ)),
                           wg.make_fragment_B(wg.partition_B(sK)), acc_coords, acc_shape)


def compile_kernel(problem, *, compile_options: str = "", stages: int = 2, q_tiles: int = 2,
                   unroll: int = 4):
    """Compile (or fetch from the cache) k4_qk; options as k3's."""
    return compile_attention(SPEC, FlashAttentionK4QK, problem,
                             {"stages": stages, "q_tiles": q_tiles, "unroll": unroll},
                             compile_options=compile_options)


def run_kernel(handle, q, k, v, out):
    run_attention(handle, q, k, v, out)
