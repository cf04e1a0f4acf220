"""k3: TMA loads and an mbarrier producer/consumer pipeline (1, 2 or 5 stages).

What changes from k2: the tiles arrive by TMA instead of 256 threads' loads and stores.
The host encodes one tensor descriptor per operand; one warp (warp 0) issues
`cp.async.bulk.tensor` copies; completion is signalled on mbarriers, so nobody waits on a
CTA-wide barrier for data. K and V live in a ring of `stages` buffers: while the CTA
computes on tile n, the copy engine fills tiles n+1 .. n+stages-1. With 1 stage there is no
overlap (load, wait, compute, release, load ...), which is the baseline the others beat.
Sequence tails come for free: the descriptor knows the real extent and TMA writes zeros
past it.

With the loads behind mbarriers, the main loop has no CTA-wide barrier left (k2 needs two
per tile): the P^T exchange is within a half-warp and uses warp barriers. Warps run
independently, waiting only for the data they need.

What stays: the compute body (S = Q K^T, online softmax, P V on CUDA cores) is k2's
`ScalarTile`, unchanged; the epilogue writes O from registers as in k2.

One more change that TMA makes cheap: a CTA holds two 64-row query tiles (q_tiles = 2,
512 threads); each group of 256 threads runs k2's tile on its own rows and both share the
K/V ring, so every load feeds 128 query rows and a deep ring still leaves 16 warps per SM.

Budget (q_tiles = 2): 512 threads; SMEM = Q 128 x d + stages x (K + V) 64 x d + 2 P^T
buffers of 17 KiB: d = 64: 16 + 16 * stages + 34 KiB (5 stages: 131 KiB); d = 128:
32 + 32 * stages + 34 KiB, so 5 stages do not fit in 227 KiB and the ring is lowered to
the deepest that does (4 stages: 195 KiB). ~100-125 registers per thread.
"""


import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

from hopper_attn.common import tma
from hopper_attn.common.contract import KernelSpec, compile_attention, run_attention
from hopper_attn.common.cuda_core import ScalarTile
from hopper_attn.common.layouts import ndhb_view, qkv_smem, smem_tile_layout
from hopper_attn.common.masking import TileSchedule

SPEC = KernelSpec(
    name="k3",
    summary="k2's compute fed by TMA through an mbarrier pipeline",
    head_dims=(64, 128),
)


@dataclasses.dataclass(frozen=True)
class ScalarScores:
    """S = Q K^T for my 4 x 4 scores, on CUDA cores (k2's `ScalarTile.qk`)."""

    tile: ScalarTile
    q_rows: cute.Tensor
    sK: cute.Tensor
    cg: cutlass.Int32

    def __call__(self, stage, p_slots, s_pt):
        return self.tile.qk(self.q_rows, self.tile.my_kv_rows(self.sK[None, None, stage], self.cg))


class FlashAttentionK3:
    p_buffers = 1        # P^T buffers per query tile (k4_qk alternates two)

    def __init__(self, head_dim: int, causal: bool, stages: int = 2, q_tiles: int = 2,
                 unroll: int = 4):
        if stages < 1 or q_tiles < 1:
            raise ValueError(f"stages and q_tiles must be >= 1, got {stages}, {q_tiles}")
        self.head_dim = head_dim
        self.causal = causal
        self.requested_stages = stages
        self.stages = stages               # lowered in __call__ if the ring does not fit SMEM
        self.q_tiles = q_tiles
        self.tile = ScalarTile(head_dim, unroll)
        self.block_m = self.tile.block_m * q_tiles
        self.threads = self.tile.threads * q_tiles
        self.schedule = TileSchedule(self.block_m, self.tile.block_n, causal)

    def describe(self) -> dict:
        return {"smem_bytes": getattr(self, "smem_bytes", None), "block_m": self.block_m,
                "block_n": self.tile.block_n, "threads": self.threads, "stages": self.stages,
                "requested_stages": self.requested_stages}

    def fit_kv_ring(self, q_layout, p_layout):
        """The deepest K/V ring (up to the requested depth) that fits in shared memory."""
        # 227 KiB per CTA, minus the 1 KiB of static shared memory the DSL's kernels declare
        capacity = cutlass.memory.get_smem_capacity_in_bytes("sm_90") - 1024
        while True:
            kv_layout = smem_tile_layout(BFloat16, self.tile.block_n, self.head_dim, self.stages)
            storage = self.shared_storage_for(q_layout, kv_layout, p_layout, self.stages)
            if storage.size_in_bytes() <= capacity or self.stages == 1:
                return kv_layout, storage
            self.stages -= 1

    def shared_storage_for(self, q_layout, kv_layout, p_layout, stages):
        @cute.struct
        class SharedStorage:
            q_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            kv_barriers: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sPt: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(p_layout)], 16]
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(kv_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(kv_layout)], 1024]
        return SharedStorage

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 scale_log2: Float32, stream):
        q, k, v, o = [ndhb_view(t) for t in (mQ, mK, mV, mO)]   # (N, d, H, B)
        bm, bn, d = self.block_m, self.tile.block_n, self.head_dim
        q_layout = smem_tile_layout(BFloat16, bm, d)
        p_layout = self.tile.p_layout(buffers=self.p_buffers * self.q_tiles)
        kv_layout, storage = self.fit_kv_ring(q_layout, p_layout)
        self.shared_storage = storage
        self.smem_bytes = storage.size_in_bytes()

        atoms, coords, self.q_bytes, self.kv_bytes = tma.make_qkv_loads(
            q, k, v, q_layout, kv_layout, bm, bn, d)
        seqlen, heads, batch = q.shape[0], q.shape[2], q.shape[3]
        self.kernel(*coords, o, *atoms, scale_log2, q_layout, kv_layout, p_layout).launch(
            grid=self.schedule.grid(seqlen, heads, batch),
            block=[self.threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               tma_q: cute.CopyAtom, tma_k: cute.CopyAtom, tma_v: cute.CopyAtom,
               scale_log2: Float32, q_layout: cute.ComposedLayout,
               kv_layout: cute.ComposedLayout, p_layout: cute.Layout):
        tile, schedule = self.tile, self.schedule
        bn, d = tile.block_n, self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        _, head, batch = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        seqlen = mQ.shape[0]
        m_block, n_count = schedule.work(seqlen)
        if warp == 0:
            tma.prefetch_descriptors(tma_q, tma_k, tma_v)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sQ, sK, sV = qkv_smem(storage, q_layout, kv_layout)    # (bm, d), (bn, d, stage) x 2
        sPt = storage.sPt.get_tensor(p_layout)

        loads = tma.AttentionLoads.create(storage, self.threads // 32, self.stages, self.q_bytes,
                                          self.kv_bytes, (tma_q, tma_k, tma_v), (mQ, mK, mV),
                                          (sQ, sK, sV), head, batch)
        produce = tma.producer_state(self.stages)
        consume = tma.consumer_state(self.stages)
        if warp == 0:                     # Q once, then the first `stages` K/V tiles
            produce = loads.start(m_block, n_count, produce)

        # Each group of 256 threads runs k2's tile on its own 64 query rows; all groups share
        # the K/V ring (one TMA load feeds block_m = 64 * q_tiles query rows).
        group, local = tidx // tile.threads, tidx % tile.threads
        row0 = m_block * self.block_m + group * tile.block_m
        sQ_mine = cute.local_tile(sQ, (tile.block_m, d), (group, 0))
        rg, cg = tile.thread_groups(local)
        s_coords = tile.s_coords(rg, cg)
        scores = self.make_scores(sQ_mine, sK, local, rg, cg)
        softmax = tile.new_softmax(scale_log2)
        acc_o = tile.new_o_accumulator()
        loads.wait_q()

        for n in cutlass.range(n_count, unroll=1):
            loads.kv.pipe.consumer_wait(consume)            # tile n has landed in stage s
            stage = consume.index
            s_pt = sPt[None, None, group * self.p_buffers + n % self.p_buffers]
            p_slots = tile.p_slots(s_pt, rg, cg)
            p_rows, v_cols = tile.pv_views(s_pt, sV[None, None, stage], rg, cg)
            acc_s = scores(stage, p_slots, s_pt)
            tile.attend(acc_s, acc_o, softmax, schedule.needs_mask(m_block, n, seqlen),
                        s_coords, row0, n * bn, seqlen, self.causal, p_slots, p_rows, v_cols)
            cute.arch.sync_warp()
            loads.kv.pipe.consumer_release(consume)         # this warp is done with stage s
            consume.advance()
            if warp == 0:                                   # refill the freed stage
                produce = loads.refill(produce, n_count)

        gO = cute.local_tile(mO[None, None, head, batch], (tile.block_m, d),
                             (m_block * self.q_tiles + group, 0))
        tile.store_o(acc_o, gO, softmax.finalize(), seqlen - row0, rg, cg)

    def make_scores(self, sQ, sK, tidx, rg, cg):
        """How S = Q K^T is computed for one 64-row query tile (k4_qk: a WGMMA)."""
        return ScalarScores(self.tile, self.tile.my_rows(sQ, rg), sK, cg)


def compile_kernel(problem, *, compile_options: str = "", stages: int = 2, q_tiles: int = 2,
                   unroll: int = 4):
    """Compile (or fetch from the cache) k3; options: stages (K/V ring depth, lowered to
    the deepest that fits SMEM), q_tiles (64-row query tiles per CTA), unroll."""
    return compile_attention(SPEC, FlashAttentionK3, problem,
                             {"stages": stages, "q_tiles": q_tiles, "unroll": unroll},
                             compile_options=compile_options)


def run_kernel(handle, q, k, v, out):
    run_attention(handle, q, k, v, out)
