"""k5: warp specialization, register reallocation, separate K/V pipelines, ping-pong.

What changes from k4 (FlashAttention-3's first two techniques):

* Warp specialization. One more warpgroup, warpgroup 0, is the producer: its warp 0 issues
  every TMA load (K_0, Q, V_0, then K_j and V_j for each kv tile), warps 1-3 have nothing to do
  and fall through to the end. Warpgroups 1..W are consumers (64 query rows each) and only
  wait, compute and release. In k4 warp 0 was also a consumer and refilled the ring from
  inside the main loop, so its warpgroup stalled on its own loads.
* Register reallocation (`setmaxnreg`, common/warp_roles.py). Launched one CTA per SM,
  every thread starts with 65536 / threads registers (168 at 384 threads, 128 at 512). The
  producer needs few, so its warpgroup drops to 24 (d = 128, 2 consumer WGs) or 32 (d = 64,
  3 consumer WGs) and the consumers grow to 240 or 160: 128 x (24 + 2 x 240) = 64,512 and
  128 x (32 + 3 x 160) = 65,536 registers, the whole register file. At d = 128 k4 needed
  ~177 per thread, more than 168, so without the transfer this thread count would spill.
* K and V in separate rings (tma.SplitKVLoads), each with its own full/empty mbarriers.
  S = Q K_j^T starts as soon as K_j has landed, while V_j may still be in flight; K_j's
  stage is released the moment its WGMMA retires (before the softmax), V_j's after P V_j.
* Ping-pong between consumer warpgroups (warp_roles.PingPong, named barriers 2..W+1):
  one warpgroup at a time issues WGMMAs, so while one runs its softmax (exp2 on the SFU,
  shuffles) the other keeps the tensor cores busy. A turn issues the previous tile's PV and
  this tile's QK back to back, then hands the turn on before waiting for them:

      wait K_j (and V_{j-1}); sync(own)
      issue O += P_{j-1} V_{j-1}; issue S_j = Q K_j^T; arrive(next)       <- the turn
      wait for both; release V_{j-1} and K_j
      mask + softmax of tile j, rescale O, P_j -> bf16 registers          <- outside it
      (after the last tile: one more turn for the last PV)

* The epilogue (O / l -> bf16 -> Q's buffer -> one TMA store) synchronises the consumer
  threads only, on named barrier 1: the producer warpgroup has left, so `sync_threads`
  (barrier 0, which counts every thread of the CTA) would hang.

Also from this stage on (for `hopper_attn.attention`): k and v may have fewer heads than q
(GQA/MQA: a CTA reads the k/v head its query head belongs to) and another length
(cross-attention; the causal diagonal is then aligned bottom-right,
`TileSchedule.n_block_count_kv`), and the epilogue writes each row's log-sum-exp (fp32, (batch, heads, seqlen_q)).

Structure for the next stage: every role runs a loop over work items (a query tile of one
(head, batch), common/scheduler.py); in k5 it runs once per CTA (one CTA per work item, as
in k4), k6 makes it a persistent loop. The Q buffer is released after the output staged in
it has been stored, and the producer loads K_0 before Q: both only matter for k6. k6 changes
k5's behaviour by extending `__init__` (its scheduler, turns, settings) and overriding methods
(`mainloop`, `item_queue`, `next_item`, `make_softmax`, `with_buffers`, `o_buffer`,
`o_apart_from_q`, `q_read`, `item_epilogue`, `store_o`, `drain_o_store`, ...). The loops over
work items stay here whole, with the scheduler's modes (k6's dynamic queue, stream-K pieces)
and both load orders (k6's `v_lags_k`): the DSL carries a pipeline state from one item to
the next only where the loop itself advances it, so these cannot move into methods without
changing the kernels. The kernel launches in `__call__` below. With the `varlen` flag
(k6_varlen.py: a packed batch) the loops take each item's lengths, TMA views and LSE rows
from its sequence (common/varlen.py), and the scheduler decodes items by cu_seqlens_q.

What stays: k4's tiles (d = 128: 128 x 128; d = 64: 192 x 128; 2 stages), WGMMA for both
GEMMs with P handed over in registers, the online softmax on the accumulator, the tile
schedule (tails masked, causal tiles skipped, masking only on tiles that need it).

Budget (defaults): d = 128: 384 threads = producer WG + 2 consumer WGs; SMEM = Q 32 KiB +
2 stages x (K + V) 64 KiB = 160 KiB, + 1 KiB for the 10 mbarriers (80 B, padded to sQ's
1024-byte alignment). d = 64: 512 threads = producer + 3 consumer WGs; SMEM = 24 + 2 x 32
+ 1 = 89 KiB. Registers: 240 (d = 128) / 160 (d = 64) per consumer thread, 24 / 32 per
producer thread; the cubin reports the count at entry, 168 / 128.

Named barriers: 0 = __syncthreads (used once, before the role split, to publish the mbarrier
inits), 1 = epilogue (consumer threads), 2.. = one scheduler barrier per consumer warpgroup.
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from hopper_attn.common import tma, varlen, wgmma
from hopper_attn.common.compiler_hints import opaque
from hopper_attn.common.contract import (LOG2_E, KernelSpec, compile_attention,
                                         run_attention)
from hopper_attn.common.layouts import (acc_as_operand_a, acc_rows_cols, ndhb_view, qkv_smem,
                                        smem_bytes, smem_tile_layout, transposed)
from hopper_attn.common.masking import TileSchedule, mask_scores, mask_window_bits
from hopper_attn.common.scheduler import TileScheduler, fetch_next_item, retire
from hopper_attn.common.softmax import OnlineSoftmax, scale_rows
from hopper_attn.common.trace import PhaseTrace
from hopper_attn.common.warp_roles import PingPong, WarpRoles

SPEC = KernelSpec(
    name="k5",
    summary="k4 + producer warpgroup, setmaxnreg, separate K/V pipelines, ping-pong",
    head_dims=(64, 128),
    separate_kv=True,           # GQA/MQA, seqlen_k != seqlen_q
    strided_inputs=True,        # e.g. q, k, v as views of a packed QKV tensor
    takes_work_counter=True,    # a kernel argument (used by k6's dynamic schedule only)
)

DEFAULT_BLOCK_M = {64: 192, 128: 128}      # k4's tiles (FlashAttention-4's too)
EPILOGUE_BARRIER = 1
FIRST_SCHEDULER_BARRIER = 2
SMEM_PER_CTA = 227 * 1024          # the most dynamic shared memory one CTA may use (sm_90)


class FlashAttentionK5:
    # masked tiles: two compares per element (k6 and k7 take one key limit per row instead,
    # common/masking.py)
    mask_per_row = False
    # a window's masked tiles by bit masks (k6's window_mask="bits", common/masking.py)
    window_mask_bits = False
    # a packed batch (common/varlen.py; k6_varlen.py sets it): per-sequence lengths, ragged
    # TMA views, the varlen work list
    varlen = False
    # k6's attention sinks: the kernel's fp32 (heads,) sink logits while it is traced, or None
    sink_logits = None

    def __init__(self, head_dim: int, causal: bool, block_m: int = 0, block_n: int = 128,
                 stages: int = 2, trace: bool = False, head_dim_v: int = 0):
        block_m = block_m or DEFAULT_BLOCK_M.get(head_dim, 128)
        if block_m not in (64, 128, 192) or block_n % 16 or stages < 1:
            raise ValueError(f"bad tile: block_m={block_m} (64, 128 or 192: 1-3 consumer "
                             f"warpgroups), block_n={block_n} (multiple of 16), "
                             f"stages={stages} (>= 1)")
        # v's and O's head dim (k6: MLA's (192, 128), (128, 64)): V's ring tiles, the PV
        # GEMM's N, O's accumulator and store. O is staged in Q's buffer (or O's own) as a
        # (block_m, dv) tile: dv a multiple of 64 and <= d keeps each row at its address
        # in Q's 128-byte-swizzled layout (rows of a 64-column slab first)
        self.head_dim_v = head_dim_v or head_dim
        if self.head_dim_v != head_dim and (self.head_dim_v % 64 or self.head_dim_v > head_dim):
            raise ValueError(f"head_dim_v={head_dim_v}: a multiple of 64, at most head_dim "
                             f"({head_dim})")
        smem = self.smem_estimate(head_dim, block_m, block_n, stages)
        if smem > SMEM_PER_CTA:
            raise ValueError(f"{block_m} x {block_n} tiles at d = {head_dim} with {stages} "
                             f"stages need {smem} bytes of shared memory; a CTA gets at most "
                             f"{SMEM_PER_CTA}")
        self.head_dim = head_dim
        self.causal = causal
        self.block_m, self.block_n, self.stages = block_m, block_n, stages
        self.warpgroups = block_m // 64                 # consumer warpgroups
        self.roles = WarpRoles.create(self.warpgroups)
        self.threads = self.roles.threads               # + the producer warpgroup
        self.pingpong = PingPong(self.warpgroups, FIRST_SCHEDULER_BARRIER, on=True)
        self.epilogue_barrier = pipeline.NamedBarrier(barrier_id=EPILOGUE_BARRIER,
                                                      num_threads=self.roles.consumer_threads)
        self.schedule = TileSchedule(block_m, block_n, causal, True)   # kv tiles, masks
        # one CTA per work item (k6: a persistent grid)
        self.scheduler = TileScheduler(block_m, causal, False, 0, False, 0, False, False,
                                       block_n)
        self.trace = PhaseTrace(trace)          # iket phase ranges (off: no code at all)
        # SMEM descriptors in uniform registers (wgmma.warpgroup_slice)
        self.uniform_descriptors = True
        # the rings' waits spin on `mbarrier.try_wait` instead of sleeping between tries
        # (tma.wait_full), and the producer loads K_{j+1} before V_j (FlashAttention-4's
        # order: a consumer waits for V_{j-1} inside its turn, after issuing S_j = Q K_j^T):
        # +0.7-2.2% together, each alone -2.0% to +0.4%, measured round-robin
        # (results/h100/2026-11-25_k5_options_d*.json, docs/k5.md)
        self.spin_waits = True
        self.v_lags_k = True

    def make_o_store(self, o: cute.Tensor, dtype):
        """Host side: the TMA store of O's (block_m, dv) tiles."""
        return tma.make_tma_store(o, smem_tile_layout(dtype, self.block_m, self.head_dim_v),
                                  self.block_m, self.head_dim_v)

    def item_queue(self, storage, receivers: int):
        """A queue of work items from the producer warp to the consumers: none here (k6's
        dynamic schedule has one)."""
        return None

    def first_item(self, mQ: cute.Tensor, seqlen_k=None, packed=None):
        """(heads, batch size, the scheduler's iterator, and this CTA's first work item:
        query tile, head, batch, valid); packed: a varlen.PackedBatch."""
        heads, batch_size, seqlen_q = mQ.shape[2], mQ.shape[3], mQ.shape[0]
        if cutlass.const_expr(packed is not None):
            batch_size, seqlen_q = packed.batch_size, packed.cu_seqlens_q
        tiles = self.scheduler.start()
        return (heads, batch_size, tiles,
                *self.scheduler.work(tiles, seqlen_q, heads, batch_size, seqlen_k))

    @cute.jit
    def item_lengths(self, packed, batch, seqlen_q, seqlen_k, mO: cute.Tensor,
                     mLSE: cute.Tensor):
        """A work item's (query length, key length, O's TMA tensor, LSE, batch coordinate):
        the problem's, or in a packed batch its sequence's (common/varlen.py)."""
        if cutlass.const_expr(packed is None):
            return seqlen_q, seqlen_k, mO, mLSE, batch
        seq = packed.sequence(batch)
        return (seq.seqlen_q, seq.seqlen_k, varlen.sequence_rows(mO, seq.seqlen_q),
                varlen.lse_rows(mLSE, seq.offset_q, seq.seqlen_q),
                varlen.sequence_batch(seq.offset_q, seq.seqlen_q))

    def kv_boxes(self, atoms, coords, k: cute.Tensor, v: cute.Tensor):
        """Host side: the (Q, K, V) TMA atoms and tensors, K's and V's boxes one kv tile
        each (k6_paged: one page each where pages are smaller)."""
        return atoms, coords

    def sequence_loads(self, loads: tma.SplitKVLoads, head, kv_head, seq, batch):
        """A packed batch's loads of one work item (k6_paged: K and V from pages)."""
        return varlen.sequence_loads(loads, head, kv_head, seq)

    def smem_estimate(self, head_dim: int, block_m: int, block_n: int, stages: int) -> int:
        """Q + K and V rings (16-bit elements; V's tiles dv wide), each 1024-byte aligned,
        + 1 KiB of mbarriers (k7 overrides it: FP8 rings, a V^T ring, an output buffer)."""
        return 1024 + sum(smem_bytes(rows * dim * 2)
                          for rows, dim in ((block_m, head_dim), (stages * block_n, head_dim),
                                            (stages * block_n, self.head_dim_v)))

    def describe(self) -> dict:
        return {"smem_bytes": getattr(self, "smem_bytes", None), "block_m": self.block_m,
                "block_n": self.block_n, "stages": self.stages, "threads": self.threads,
                "persistent_ctas": self.scheduler.ctas if self.scheduler.persistent else 0,
                "consumer_warpgroups": self.warpgroups,
                "producer_regs": self.roles.producer_regs,
                "consumer_regs": self.roles.consumer_regs,
                "entry_regs_max": self.roles.entry_regs,
                "mbarriers": getattr(self, "mbarriers", None),
                "spin_waits": self.spin_waits,
                "named_barriers": {
                    "epilogue": EPILOGUE_BARRIER,
                    "scheduler": [FIRST_SCHEDULER_BARRIER + k for k in range(self.warpgroups)]
                    if self.pingpong.enabled else []}}

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mCounter: cute.Tensor, scale_log2: Float32, stream,
                 mCuSeqlensQ: Optional[cute.Tensor] = None,
                 mCuSeqlensK: Optional[cute.Tensor] = None,
                 mSeqUsedK: Optional[cute.Tensor] = None):
        # (varlen: q, k, v, o as (1, total, H, d), the LSE (1, H, total_q), cu_seqlens_q/k
        # (batch + 1) and seqused_k (batch) int32; common/varlen.py)
        self.launch(mQ, mK, mV, mO, mLSE, mCounter, scale_log2, stream, None, mCuSeqlensQ,
                    mCuSeqlensK, mSeqUsedK)

    @cute.jit
    def launch(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, mCounter: cute.Tensor, scale_log2: Float32, stream,
               mSinks: Optional[cute.Tensor] = None,
               mCuSeqlensQ: Optional[cute.Tensor] = None,
               mCuSeqlensK: Optional[cute.Tensor] = None,
               mSeqUsedK: Optional[cute.Tensor] = None,
               mPageTable: Optional[cute.Tensor] = None):
        """The launch (k6's attention sinks: `mSinks`, fp32 (heads,), else None; a paged
        cache's page table: `mPageTable`, k6_paged.py)."""
        q, k, v, o = [ndhb_view(t) for t in (mQ, mK, mV, mO)]   # (N, d, H, B)
        seqlen, heads, batch = q.shape[0], q.shape[2], q.shape[3]
        if cutlass.const_expr(self.varlen):
            q, k, v, o = [varlen.ragged(t) for t in (q, k, v, o)]
            batch = mCuSeqlensQ.shape[0] - 1
        bm, bn, d = self.block_m, self.block_n, self.head_dim
        self.dtype = mQ.element_type                            # bf16 or fp16 (SPEC.dtypes)
        q_layout = smem_tile_layout(self.dtype, bm, d)          # also O's staging buffer
        kv_layout = smem_tile_layout(self.dtype, bn, d, self.stages)
        dv = self.head_dim_v                                    # V's and O's head dim
        v_layout = kv_layout if dv == d else smem_tile_layout(self.dtype, bn, dv, self.stages)
        atoms, coords, self.q_bytes, kv_bytes = tma.make_qkv_loads(
            q, k, v, q_layout, kv_layout, bm, bn, d, None if dv == d else v_layout, dv)
        atoms, coords = self.kv_boxes(atoms, coords, k, v)     # (k6_paged: page-sized boxes)
        self.tile_bytes = tma.tma_bytes(self.dtype, kv_layout)  # one K tile
        self.v_tile_bytes = kv_bytes - self.tile_bytes          # one V tile (dv wide)
        tma_o, o_coords = self.make_o_store(o, self.dtype)

        @cute.struct
        class SharedStorage:
            q_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            k_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            v_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            # k6's queue of work items (its dynamic schedule; unused here)
            item_barriers: cute.struct.MemRange[cutlass.Int64, 4]
            items: cute.struct.MemRange[cutlass.Int32, 8]          # (4 values, 2 slots)
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(kv_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(v_layout)], 1024]

        self.shared_storage = self.with_buffers(SharedStorage, q_layout)
        self.smem_bytes = self.shared_storage.size_in_bytes()
        self.mbarriers = {"q": 2, "k": 2 * self.stages, "v": 2 * self.stages}
        self.kernel(*coords, o_coords, o, mLSE, mCounter, *atoms, tma_o, scale_log2, q_layout,
                    kv_layout, q, k, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mSinks,
                    mPageTable).launch(
            grid=self.scheduler.grid(seqlen, heads, batch),
            block=[self.threads, 1, 1],
            min_blocks_per_mp=1,        # ptxas: 65536 / threads registers at entry (setmaxnreg)
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mOut: cute.Tensor, mLSE: cute.Tensor, mCounter: cute.Tensor, tma_q: cute.CopyAtom,
               tma_k: cute.CopyAtom, tma_v: cute.CopyAtom, tma_o: cute.CopyAtom,
               scale_log2: Float32, q_layout: cute.ComposedLayout,
               kv_layout: cute.ComposedLayout, q_mem: cute.Tensor, k_mem: cute.Tensor,
               mCuSeqlensQ: Optional[cute.Tensor] = None,
               mCuSeqlensK: Optional[cute.Tensor] = None,
               mSeqUsedK: Optional[cute.Tensor] = None,
               mSinks: Optional[cute.Tensor] = None,
               mPageTable: Optional[cute.Tensor] = None):
        # (q_mem, k_mem: q and k again, unused since k6's exp_first left at 2031291; kept
        # so that the kernel's parameters, and with them its PTX, stay as measured)
        self.sink_logits = mSinks       # (k6's attention sinks, read by `finish_rows`)
        self.page_table = mPageTable    # (k6_paged: read by `sequence_loads`)
        schedule, roles, scheduler = self.schedule, self.roles, self.scheduler
        bm, bn, d = self.block_m, self.block_n, self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        group = mQ.shape[2] // mK.shape[2]        # GQA: `group` q heads share one k/v head
        if warp == 0:
            tma.prefetch_descriptors(tma_q, tma_k, tma_v, tma_o)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sQ, sK, sV = qkv_smem(storage, q_layout, kv_layout)    # (bm, d), (bn, d, stage) x 2
        if cutlass.const_expr(self.head_dim_v != d):            # V's tiles (bn, dv, stage)
            v_layout = smem_tile_layout(self.dtype, bn, self.head_dim_v, self.stages)
            sV = storage.sV.get_tensor(v_layout.outer, swizzle=v_layout.inner)
        sO_buffer = self.o_buffer(storage, sQ, q_layout)       # where O is staged
        sVt = transposed(sV)                                                   # (dv, bn, stage)

        # Warp 0 initialises every mbarrier; the one CTA-wide sync of the kernel publishes
        # them. After the split below nothing may use barrier 0: the producer's warps leave.
        loads = tma.SplitKVLoads.create(storage, 4 * self.warpgroups, self.stages,
                                        self.q_bytes, self.tile_bytes,
                                        (tma_q, tma_k, tma_v), (mQ, mK, mV), (sQ, sK, sV),
                                        spin_waits=self.spin_waits,
                                        v_tile_bytes=self.v_tile_bytes)
        queue = self.item_queue(storage, roles.consumer_threads)
        tma.barriers_ready()

        # Every role walks the same work items (one per CTA here; k6: a persistent loop),
        # each with its own iterator. A work item: query tile m_block of (head, batch).
        packed = None               # a packed batch: lengths per sequence, from global memory
        if cutlass.const_expr(self.varlen):
            packed = varlen.PackedBatch(mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)
        heads, batch_size, tiles, m_block, head, batch, valid = self.first_item(mQ, seqlen_k,
                                                                                packed)
        if cutlass.const_expr(self.varlen):
            seqlen_q = mCuSeqlensQ                  # (what the scheduler decodes items by)
        if warp < 4:
            # ---------------- producer warpgroup ----------------
            roles.become_producer()
            if warp == 0:
                self.load_loop(loads, queue, mCounter, tiles, m_block, head, batch, valid,
                               seqlen_q, seqlen_k, heads, batch_size, group, packed)
        else:
            # ---------------- consumer warpgroups 1..W ----------------
            roles.become_consumer()
            ctidx = tidx - 128                              # 0 .. 128 * W - 1
            wg = warp // 4 - 1                              # consumer warpgroup, 0 .. W - 1

            # Each consumer warpgroup owns 64 query rows (as in k4, indexed by ctidx).
            mmas = wgmma.AttentionMmas.create(self.warpgroups, bm, bn, d, ctidx, sQ, sK, sVt,
                                              self.dtype, self.uniform_descriptors,
                                              head_dim_v=self.head_dim_v)
            acc_o = mmas.new_o_accumulator(bm, self.head_dim_v)
            softmax = self.make_softmax(cute.size(mmas.s_coords, mode=[0]), scale_log2)
            acc_s = mmas.new_s_accumulator(bm, bn)
            o_out = cute.make_rmem_tensor_like(acc_o, self.dtype)   # O in bf16 (fp16)
            q_state = tma.consumer_state(1)
            k_state = tma.consumer_state(self.stages)
            v_state = tma.consumer_state(self.stages)       # one tile behind k_state
            item_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)
            has_items = valid            # (a CTA of a persistent grid may have none)
            if has_items:
                self.pingpong.start(wg)     # warpgroup 0 holds the first turn, for the CTA
            while valid:
                item_q, item_k, item_o, item_lse, item_batch = self.item_lengths(
                    packed, batch, seqlen_q, seqlen_k, mO, mLSE)
                n_count = schedule.n_block_count_kv(m_block, item_q, item_k)
                k0, k1 = 0, n_count                     # (k6's stream_k: a piece of the item)
                if cutlass.const_expr(schedule.window_left is not None):   # (k6's sliding window)
                    k0 = schedule.n_block_first(m_block, item_q, item_k)
                if cutlass.const_expr(scheduler.stream_k):
                    _, _, k0, k1 = scheduler.piece(tiles, seqlen_q, seqlen_k, heads, batch_size)
                acc_o.fill(0.0)
                softmax.reset()
                phase = self.trace.start("wait_q")
                loads.wait_q(q_state)
                self.trace.end(phase)
                k_state, v_state = self.mainloop(
                    loads, wg, m_block, k1 - k0, item_q, item_k, mmas.mma_qk, mmas.mma_pv,
                    mmas.q_frag, mmas.k_frag, mmas.vt_frag, mmas.p_frag, acc_s, acc_o,
                    mmas.s_coords, softmax, k_state, v_state, n_base=k0)
                if cutlass.const_expr(self.o_apart_from_q()):
                    self.q_read(loads, q_state)         # (k6: Q loads under the epilogue)
                    q_state.advance()

                # Epilogue: O / l -> bf16 (fp16) -> SMEM (Q's buffer) -> one TMA store.
                phase = self.trace.start("epilogue")
                self.item_epilogue(softmax, mmas, ctidx, warp, wg, acc_o, o_out, item_lse, mOut,
                                   sO_buffer, tma_o, item_o, mCounter, m_block, head,
                                   item_batch, item_q, k0, k1, n_count)
                if cutlass.const_expr(not self.o_apart_from_q()):
                    loads.release(loads.q_pipe, q_state)    # the next Q may overwrite it
                    q_state.advance()
                self.trace.end(phase)
                tiles, item_state, m_block, head, batch, valid = self.next_item(
                    queue, item_state, tiles, seqlen_q, heads, batch_size, seqlen_k)
            if has_items:
                self.pingpong.drain(wg)     # warpgroup 0 takes the token back
            self.drain_o_store(warp)

    def make_softmax(self, rows: int, scale_log2: Float32) -> OnlineSoftmax:
        """The online softmax of a consumer thread's `rows` rows (k6 adds its options)."""
        return OnlineSoftmax.create(rows, scale_log2, lanes_per_row=4)

    def o_buffer(self, storage, sQ: cute.Tensor, q_layout):
        """Where O is staged for its TMA store: Q's buffer, free once the item's last QK has
        read it (k6: also a buffer of its own, or per-warpgroup slabs); with dv != d a
        (block_m, dv) tile in it (`o_layout`)."""
        if cutlass.const_expr(self.head_dim_v == self.head_dim):
            return sQ
        o_layout = self.o_layout(q_layout)
        return storage.sQ.get_tensor(o_layout.outer, swizzle=o_layout.inner)

    def o_layout(self, q_layout):
        """O's staged (block_m, dv) tile: Q's layout where dv = d."""
        if self.head_dim_v == self.head_dim:
            return q_layout
        return smem_tile_layout(self.dtype, self.block_m, self.head_dim_v)

    def o_apart_from_q(self) -> bool:
        """O staged elsewhere than in Q's buffer (k6, k7): Q is then free after the item's
        loop, not after its epilogue."""
        return False

    @cute.jit
    def q_read(self, loads: tma.SplitKVLoads, q_state):
        """With O staged elsewhere: hand Q's stage back after the item's loop (k6 may have
        handed it back inside the loop already)."""
        loads.release(loads.q_pipe, q_state)

    @cute.jit
    def item_epilogue(self, softmax: OnlineSoftmax, mmas, ctidx, warp, wg, acc_o: cute.Tensor,
                      o_out: cute.Tensor, mLSE: cute.Tensor, mOut: cute.Tensor, sO_buffer,
                      tma_o: cute.CopyAtom, mO: cute.Tensor, mWork: cute.Tensor, m_block, head,
                      batch, seqlen_q, k0, k1, n_count):
        """A work item's end: its output (k6: or, for a piece of a split item, its partial
        state)."""
        self.write_output(softmax, mmas, ctidx, warp, acc_o, o_out, mLSE, mOut, sO_buffer,
                          tma_o, mO, m_block, head, batch, seqlen_q)


    @cute.jit
    def write_output(self, softmax: OnlineSoftmax, mmas, ctidx, warp, acc_o: cute.Tensor,
                     o_out: cute.Tensor, mLSE: cute.Tensor, mOut: cute.Tensor, sO_buffer,
                     tma_o: cute.CopyAtom, mO: cute.Tensor, m_block, head, batch, seqlen_q):
        """A work item's epilogue: its rows' log-sum-exp, O / l -> 16 bits -> global memory."""
        inv_sum = self.finish_rows(softmax, mmas, ctidx, mLSE, m_block, head, batch, seqlen_q)
        scale_rows(acc_rows_cols(acc_o), inv_sum)
        o_out.store(acc_o.load().to(self.dtype))
        self.store_output(mmas, ctidx, warp, o_out, mOut, sO_buffer, tma_o, mO, m_block, head,
                          batch, seqlen_q)

    @cute.jit
    def finish_rows(self, softmax: OnlineSoftmax, mmas, ctidx, mLSE: cute.Tensor, m_block,
                    head, batch, seqlen_q):
        """A work item's rows are complete: their log-sum-exp to mLSE; returns 1/l per row."""
        if cutlass.const_expr(self.sink_logits is not None):
            # (k6) the head's sink logit joins each row's denominator, once
            inv_sum, lse = softmax.finalize_with_sink(self.sink_logits[head] * LOG2_E)
            self.store_lse(mLSE, lse, mmas.s_coords, ctidx, m_block * self.block_m,
                           seqlen_q, head, batch)
        else:
            inv_sum = softmax.finalize()
            self.store_lse(mLSE, softmax.log_sum_exp(inv_sum), mmas.s_coords, ctidx,
                           m_block * self.block_m, seqlen_q, head, batch)
        return inv_sum

    @cute.jit
    def store_output(self, mmas, ctidx, warp, o_out: cute.Tensor, mOut: cute.Tensor, sO_buffer,
                     tma_o: cute.CopyAtom, mO: cute.Tensor, m_block, head, batch, seqlen_q):
        """O (16-bit registers) of one work item to global memory."""
        self.store_o(mmas.mma_pv, ctidx, warp, o_out, sO_buffer, tma_o, mO, m_block, head,
                     batch)

    @cute.jit
    def store_o(self, mma_pv: cute.TiledMma, ctidx, warp, o_out: cute.Tensor, sO: cute.Tensor,
                tma_o: cute.CopyAtom, mO: cute.Tensor, m_block, head, batch,
                wait_read: cutlass.Constexpr = True):
        """O (16-bit registers) -> the SMEM tile sO -> one TMA store, issued by the first
        consumer warp. The first barrier: nobody still reads sO's previous contents (every
        warpgroup's last QK when sO is Q's buffer). The store returns once SMEM is read
        (wait_read; k6 may wait later)."""
        self.epilogue_barrier.arrive_and_wait()
        self.o_to_smem(mma_pv, ctidx, o_out, sO)
        cute.arch.fence_proxy("async.shared", space="cta")   # visible to the TMA unit
        self.epilogue_barrier.arrive_and_wait()
        if warp == 4:
            o_store = tma.TmaTiles.partition(tma_o, mO, head, batch, sO)
            o_store.store(m_block, wait_read=wait_read)

    def drain_o_store(self, warp):
        """After the last work item: nothing (each TMA store has read sO before returning;
        k6 may leave one in flight)."""

    @cute.jit
    def o_to_smem(self, mma_pv: cute.TiledMma, ctidx, o_out: cute.Tensor, sO: cute.Tensor):
        """This thread's O (16-bit, in the PV accumulator's layout) -> the SMEM tile the TMA
        store reads: with `stmatrix` (four 8 x 8 blocks per warp instruction: 4 at d = 64
        against 16 four-byte stores, and less address arithmetic), or one store per register
        pair (an 8-bit output: k7's out_fp8)."""
        # (the SMEM addresses derive from an opaque thread index so that they are computed
        # here, not hoisted out of a persistent loop: compiler_hints.py)
        if cutlass.const_expr(o_out.element_type.width == 16):
            store_o = wgmma.stmatrix_store(mma_pv, o_out.element_type)
            thr_store_o = store_o.get_slice(opaque(ctidx))
            cute.copy(store_o, thr_store_o.retile(o_out), thr_store_o.partition_D(sO))
        else:
            cute.autovec_copy(o_out, mma_pv.get_slice(opaque(ctidx)).partition_C(sO))

    @cute.jit
    def next_item(self, queue, item_state, tiles, seqlen_q, heads, batch_size, seqlen_k=None):
        """A consumer's next work item, the grid-stride step of the scheduler (k6: also from
        the producer warp's queue); returns the iterator, the queue state and the item."""
        tiles = self.scheduler.advance(tiles)
        m_block, head, batch, valid = self.scheduler.work(tiles, seqlen_q, heads, batch_size,
                                                          seqlen_k)
        return tiles, item_state, m_block, head, batch, valid

    @cute.jit
    def load_loop(self, loads: tma.SplitKVLoads, queue, mCounter: cute.Tensor, tiles,
                  m_block, head, batch, valid, seqlen_q, seqlen_k, heads, batch_size, group,
                  packed=None):
        """The producer warp (warp 0): every TMA load of every work item of this CTA
        (packed: a varlen.PackedBatch; seqlen_q is then cu_seqlens_q)."""
        schedule, scheduler = self.schedule, self.scheduler
        # Per work item K_0, Q, K_1, V_0, K_2, V_1, ..., V_last: a consumer uses K_j one tile
        # before V_j (S_j = Q K_j^T goes with O += P_{j-1} V_{j-1}), so K_{j+1} does not queue
        # behind V_j, whose stage is freed a tile later than K_j's (FlashAttention-4's
        # order). Each acquire waits until every consumer warp has released that stage; Q's
        # waits for the previous output to leave its buffer, so K_0 goes first. Every tile
        # loaded here is waited on by the consumers, so no copy is in flight when the CTA
        # ends. (The states stay in this loop: the DSL carries a state from one item to the
        # next only where the loop itself advances it.)
        q_state = tma.producer_state(1)
        produce = tma.producer_state(self.stages)
        produce_v = tma.producer_state(self.stages) if self.v_lags_k else None
        item_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 2)
        while valid:
            item_q, item_k = seqlen_q, seqlen_k
            if cutlass.const_expr(packed is not None):
                seq = packed.sequence(batch)
                item_q, item_k = seq.seqlen_q, seq.seqlen_k
            n_count = schedule.n_block_count_kv(m_block, item_q, item_k)   # >= 1
            first = 0                                   # (k6's stream_k: the piece's tiles)
            if cutlass.const_expr(schedule.window_left is not None):   # (k6's sliding window)
                first = schedule.n_block_first(m_block, item_q, item_k)
                n_count = n_count - first
            if cutlass.const_expr(scheduler.stream_k):
                _, _, first, k1 = scheduler.piece(tiles, seqlen_q, seqlen_k, heads,
                                                  batch_size)
                n_count = k1 - first
            if cutlass.const_expr(packed is not None):
                work = self.sequence_loads(loads, head, head // group, seq, batch)
            else:
                work = loads.at(head, head // group, batch)
            if cutlass.const_expr(self.v_lags_k):
                work.load_k(produce, first)
                produce.advance()
                work.load_q(q_state, m_block)
                for n in cutlass.range(1, n_count, unroll=1):
                    phase = self.trace.start("load_k")
                    work.load_k(produce, first + n)
                    produce.advance()
                    self.trace.end(phase)
                    phase = self.trace.start("load_v")
                    work.load_v(produce_v, first + n - 1)
                    produce_v.advance()
                    self.trace.end(phase)
                work.load_v(produce_v, first + n_count - 1)
                produce_v.advance()
            else:                                       # (k6: V_j before K_{j+1})
                work.load_k(produce, first)
                work.load_q(q_state, m_block)
                work.load_v(produce, first)
                produce.advance()
                for n in cutlass.range(1, n_count, unroll=1):
                    phase = self.trace.start("load_k")
                    work.load_k(produce, first + n)
                    self.trace.end(phase)
                    phase = self.trace.start("load_v")
                    work.load_v(produce, first + n)
                    self.trace.end(phase)
                    produce.advance()
            q_state.advance()
            if cutlass.const_expr(scheduler.dynamic):   # (k6) ask for the next one now
                tiles = fetch_next_item(mCounter)
                if cutlass.const_expr(not scheduler.by_head_group):
                    queue.publish(item_state, tiles)    # each consumer decodes it
                    item_state.advance()
            else:
                tiles = scheduler.advance(tiles)
            m_block, head, batch, valid = scheduler.work(tiles, seqlen_q, heads, batch_size,
                                                         seqlen_k)
            if cutlass.const_expr(scheduler.by_head_group):   # (k6) decoded here, once
                valid_int = Int32(0)
                if valid:
                    valid_int = Int32(1)
                queue.publish(item_state, m_block, head, batch, valid_int)
                item_state.advance()
        if cutlass.const_expr(scheduler.dynamic):
            retire(mCounter)

    @cute.jit
    def mainloop(self, loads: tma.SplitKVLoads, wg, m_block, n_count, seqlen_q, seqlen_k,
                 mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, q_frag: cute.Tensor,
                 k_frag: cute.Tensor, vt_frag: cute.Tensor, p_frag: cute.Tensor,
                 acc_s: cute.Tensor, acc_o: cute.Tensor, s_coords: cute.Tensor,
                 softmax: OnlineSoftmax, k_state, v_state, n_base=0):
        """One consumer warpgroup's loop over the kv tiles of a work item: O and the
        softmax state are updated in place; returns the K and V ring states (k6 overrides
        this method; n_base, the first kv tile, is k6's stream-K's: always 0 here)."""
        pingpong = self.pingpong
        o_rc = acc_rows_cols(acc_o)

        for n in cutlass.range(n_count, unroll=1):
            phase = self.trace.start("wait_kv")
            loads.wait(loads.k_pipe, k_state)           # K_n
            self.trace.end(phase)
            phase = self.trace.start("wait_turn")
            pingpong.sync(wg)                           # --- this WG's turn: both GEMMs
            self.trace.end(phase)
            phase = self.trace.start("mma")
            wgmma.gemm(mma_qk, acc_s, q_frag, k_frag[None, None, None, k_state.index],
                       zero_init=True)                  # S = Q K_n^T
            if n > 0:                                   # V_{n-1} was loaded after K_n
                loads.wait(loads.v_pipe, v_state)
                self.issue_pv(mma_pv, acc_o, p_frag, vt_frag, v_state)   # O += P_{n-1} V_{n-1}
            pingpong.pass_turn(wg)                      # --- the next WG may issue now
            warpgroup.wait_group(0)
            self.trace.end(phase)
            phase = self.trace.start("release")
            if n > 0:
                loads.release(loads.v_pipe, v_state)    # V_{n-1} read: its stage is free
                v_state.advance()
            loads.release(loads.k_pipe, k_state)        # K_n read: its stage is free
            k_state.advance()
            self.trace.end(phase)
            # --- outside the turn: the other WGs' GEMMs run under this softmax
            phase = self.trace.start("softmax")
            alpha = self.scores_to_probs(acc_s, s_coords, softmax, m_block, n, seqlen_q,
                                         seqlen_k)
            scale_rows(o_rc, alpha)                     # O holds P_{n-1} V_{n-1} already
            self.probs_to_operand(acc_s, p_frag)
            self.trace.end(phase)
        v_state = self.last_pv(loads, wg, mma_pv, acc_o, p_frag, vt_frag, v_state)
        return k_state, v_state

    @cute.jit
    def scores_to_probs(self, acc_s: cute.Tensor, s_coords: cute.Tensor,
                        softmax: OnlineSoftmax, m_block, n, seqlen_q, seqlen_k):
        """Mask kv tile n's scores where needed (tails, the causal diagonal), then the
        online-softmax step: S -> P (fp32, unnormalized) in place; returns alpha."""
        return softmax.step(self.masked_scores(acc_s, s_coords, m_block, n, seqlen_q,
                                               seqlen_k))

    @cute.jit
    def masked_scores(self, acc_s: cute.Tensor, s_coords: cute.Tensor, m_block, n, seqlen_q,
                      seqlen_k) -> cute.Tensor:
        """kv tile n's scores as a [row, col] view, -inf where the tail or the causal
        diagonal hides them (only tiles that need it run the mask code)."""
        s_rc = acc_rows_cols(acc_s)
        if self.schedule.needs_mask_kv(m_block, n, seqlen_q, seqlen_k):
            if cutlass.const_expr(self.schedule.windowed and self.window_mask_bits):
                mask_window_bits(s_rc, s_coords, m_block * self.block_m, n * self.block_n,
                                 seqlen_k, self.schedule.bounded_right, seqlen_k - seqlen_q,
                                 right=self.schedule.right, left=self.schedule.window_left)
            elif cutlass.const_expr(self.schedule.windowed):   # (k6's sliding window)
                mask_scores(s_rc, s_coords, m_block * self.block_m, n * self.block_n,
                            seqlen_k, self.schedule.bounded_right, seqlen_k - seqlen_q,
                            per_row_limit=self.mask_per_row, right=self.schedule.right,
                            left=self.schedule.window_left)
            else:
                mask_scores(s_rc, s_coords, m_block * self.block_m, n * self.block_n,
                            seqlen_k, self.causal, seqlen_k - seqlen_q,
                            per_row_limit=self.mask_per_row)
        return s_rc

    @cute.jit
    def probs_to_operand(self, acc_s: cute.Tensor, p_frag: cute.Tensor):
        """P (fp32, in S's registers) -> the register A operand of O += P V, in the input
        dtype (k7's FP8 operand needs a different register order)."""
        p_frag.store(acc_as_operand_a(acc_s).load().to(self.dtype))

    @cute.jit
    def store_lse(self, mLSE: cute.Tensor, lse: cute.Tensor, s_coords: cute.Tensor, ctidx,
                  row0, seqlen_q, head, batch):
        """The log-sum-exp of each query row, (batch, heads, seqlen_q) fp32: the 4 lanes of
        a quad hold the same rows, so lane 0 of each quad writes them; rows past the end of
        the sequence are not written."""
        if ctidx % 4 == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = row0 + s_coords[r, 0][0]
                if row < seqlen_q:
                    mLSE[batch, head, row] = lse[r]

    def with_buffers(self, storage, q_layout):
        """`storage` (a cute.struct) with any buffers a later stage adds (k6: O's own)."""
        return storage

    @cute.jit
    def issue_pv(self, mma_pv: cute.TiledMma, acc_o: cute.Tensor, p_frag: cute.Tensor,
                 vt_frag: cute.Tensor, v_state):
        """O += P V with V from `v_state`'s stage."""
        wgmma.gemm(mma_pv, acc_o, p_frag,
                   vt_frag[None, None, None, v_state.index], zero_init=False)

    @cute.jit
    def last_pv(self, loads: tma.SplitKVLoads, wg, mma_pv: cute.TiledMma, acc_o: cute.Tensor,
                p_frag: cute.Tensor, vt_frag: cute.Tensor, v_state):
        """The last tile's O += P V, in one more turn (shared with k6)."""
        phase = self.trace.start("wait_kv")
        loads.wait(loads.v_pipe, v_state)
        self.trace.end(phase)
        phase = self.trace.start("wait_turn")
        self.pingpong.sync(wg)
        self.trace.end(phase)
        phase = self.trace.start("pv")
        self.issue_pv(mma_pv, acc_o, p_frag, vt_frag, v_state)
        self.pingpong.finish(wg)                        # the next WG's last PV may go
        warpgroup.wait_group(0)
        loads.release(loads.v_pipe, v_state)
        v_state.advance()
        self.trace.end(phase)
        return v_state


def lse_buffer(problem, device) -> list:
    """Where k5 and k6 write the log-sum-exp: (batch, heads, seqlen_q) fp32."""
    import torch
    return [torch.empty((problem.batch, problem.heads, problem.seqlen), dtype=torch.float32,
                        device=device)]


def compile_kernel(problem, *, compile_options: str = "", block_m: int = 0,
                   block_n: int = 128, stages: int = 2, trace: bool = False):
    """Compile (or fetch from the cache) k5; options: block_m (0: the default for the head
    dim; 64, 128 or 192 = 1-3 consumer warpgroups), block_n, stages (of each of the K and V
    rings), trace (iket phase ranges, for timelines)."""
    return compile_attention(SPEC, FlashAttentionK5, problem,
                             {"block_m": block_m, "block_n": block_n, "stages": stages,
                              "trace": trace},
                             workspace_fn=lse_buffer, compile_options=compile_options)


def run_kernel(handle, q, k, v, out):
    run_attention(handle, q, k, v, out)
