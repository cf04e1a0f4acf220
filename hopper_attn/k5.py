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
it has been stored, and the producer loads K_0 before Q: both only matter for k6.

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

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from hopper_attn.common import tma, wgmma
from hopper_attn.common.compiler_hints import opaque
from hopper_attn.common.contract import KernelSpec, compile_attention, run_attention
from hopper_attn.common.layouts import (acc_as_operand_a, acc_rows_cols, first_columns,
                                        ndhb_view, qkv_smem, smem_bytes, smem_tile_layout,
                                        transposed)
from hopper_attn.common.masking import TileSchedule, mask_scores
from hopper_attn.common.scheduler import (ItemQueue, TileScheduler, fetch_next_item, retire,
                                          sm_count)
from hopper_attn.common.softmax import OnlineSoftmax, ScoreSource, scale_rows
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
WG_EPILOGUE_BARRIER = 11         # + consumer warpgroup (k6's wg_store)
SMEM_PER_CTA = 227 * 1024          # the most dynamic shared memory one CTA may use (sm_90)
SMEM_PER_SM = 228 * 1024           # what the CTAs on one SM share


class FlashAttentionK5:
    # masked tiles: one key limit per row instead of two compares per element
    # (common/masking.py; k7 turns it on)
    mask_per_row = False
    # k6's option: P before the tile's row maxima (the kernel then hands q and k in memory on)
    exp_first = False

    def __init__(self, head_dim: int, causal: bool, block_m: int = 0, block_n: int = 128,
                 stages: int = 2, trace: bool = False, pingpong: bool = True,
                 persistent: bool = False, persistent_ctas: int = 0, dynamic: bool = False,
                 uniform_descriptors: bool = True, spin_waits: bool = False,
                 v_lags_k: bool = False, fma_exp2_every: int = 0,
                 stmatrix_o: bool = True, longest_first: bool = False, group_mib: int = 32,
                 ctas_per_sm: int = 1, fast_divmod: bool = False, stream_k: bool = False,
                 kv_tail: bool = True, cluster: int = 1, multicast: bool = True):
        block_m = block_m or DEFAULT_BLOCK_M.get(head_dim, 128)
        if block_m not in (64, 128, 192) or block_n % 16 or stages < 1:
            raise ValueError(f"bad tile: block_m={block_m} (64, 128 or 192: 1-3 consumer "
                             f"warpgroups), block_n={block_n} (multiple of 16), "
                             f"stages={stages} (>= 1)")
        smem = self.smem_estimate(head_dim, block_m, block_n, stages)
        # (k6's ctas_per_sm: CTAs that share an SM; each also keeps 1 KiB for the system)
        smem_limit = SMEM_PER_CTA if ctas_per_sm == 1 else SMEM_PER_SM // ctas_per_sm - 1024
        if smem > smem_limit:
            raise ValueError(f"{block_m} x {block_n} tiles at d = {head_dim} with {stages} "
                             f"stages need {smem} bytes of shared memory; a CTA gets at most "
                             f"{smem_limit} ({ctas_per_sm} per SM)")
        if stream_k and (causal or dynamic or not persistent):
            raise ValueError("stream_k: the static persistent schedule (no mask) only")
        # k6's option: CTAs in clusters of two that share each K/V tile, loaded once from L2
        # and multicast into both (TileScheduler's and SplitKVLoads' `cluster`); the static
        # schedule only, where both query tiles of a cluster's item see the same kv tiles
        if cluster not in (1, 2) or (cluster > 1 and (causal or dynamic or stream_k
                                                       or not persistent or ctas_per_sm > 1)):
            raise ValueError("cluster: 1, or 2 with the static persistent schedule (no mask, "
                             "no stream_k, one CTA per SM)")
        self.cluster = int(cluster)
        # (multicast=False: the clusters' schedule and launch, but each CTA loads its own K/V
        # tiles: a control that separates what the pairing costs from what sharing does)
        self.kv_multicast = self.cluster if multicast else 1
        # k6's option: the static schedule's tail as stream-K (TileScheduler.piece; the
        # workspace for split items is the kernel's counter argument, `stream_k_words`)
        self.stream_k = bool(stream_k)
        self.head_dim = head_dim
        self.causal = causal
        self.block_m, self.block_n, self.stages = block_m, block_n, stages
        self.warpgroups = block_m // 64                 # consumer warpgroups
        self.roles = WarpRoles.create(self.warpgroups, ctas_per_sm=ctas_per_sm)
        self.threads = self.roles.threads               # + the producer warpgroup
        self.pingpong = PingPong(self.warpgroups, FIRST_SCHEDULER_BARRIER, on=pingpong)
        # turns for the softmax's exp2s (k6's option `exp_turns`, off here)
        self.exp_turns = PingPong(self.warpgroups, FIRST_SCHEDULER_BARRIER + self.warpgroups,
                                  on=False)
        self.epilogue_barrier = pipeline.NamedBarrier(barrier_id=EPILOGUE_BARRIER,
                                                      num_threads=self.roles.consumer_threads)
        # kv tiles, masks (kv_tail=False: k6's kernels for a key length that is a multiple of
        # block_n, whose loop then tests no tile for the tail mask)
        self.schedule = TileSchedule(block_m, block_n, causal, kv_tail)
        # longest_first (k6's dynamic schedule): heads in groups whose K and V take
        # `group_mib` MiB (N x d x 4 bytes per head), the longest query tile of every head of
        # a group first (scheduler.head_group_order)
        # (in that order the producer warp alone decodes each item: scheduler.by_head_group,
        # results/h100/2026-11-26_k6_decode_once_*.json)
        l2_rows = (group_mib << 20) // (head_dim * 4) if longest_first else 0
        self.scheduler = TileScheduler(block_m, causal, persistent,   # work items
                                       (persistent_ctas or sm_count() * ctas_per_sm)
                                       if persistent else 0,
                                       dynamic and persistent, l2_rows, bool(fast_divmod),
                                       bool(stream_k), block_n, self.cluster)
        self.trace = PhaseTrace(trace)          # iket phase ranges (off: no code at all)
        self.uniform_descriptors = uniform_descriptors      # wgmma.warpgroup_slice
        self.spin_waits = bool(spin_waits)                  # tma.wait_full
        # the producer loads K_{j+1} before V_j (FlashAttention-4's order), and a consumer
        # waits for V_{j-1} inside its turn, after issuing S_j = Q K_j^T
        self.v_lags_k = bool(v_lags_k)
        # every n-th exp2 on the FMA pipe instead of the SFU (OnlineSoftmax)
        self.fma_exp2_every = int(fma_exp2_every)
        # O to shared memory with `stmatrix` (four 8 x 8 blocks per warp instruction) instead
        # of one 4-byte store per register pair: +0.0-0.9% in k6, +0.0-0.4% here, measured
        # round-robin (results/h100/2026-11-25_k6_quad_max_stmatrix_o.json, _k5_stmatrix_o.json)
        self.stmatrix_o = bool(stmatrix_o)
        self.early_q_release = False            # k6's option (its main loop releases Q)
        self.wg_store = False                   # k6's option: each warpgroup stores its rows

    def cluster_launch(self) -> dict:
        """The launch's cluster shape (k6's option `cluster`), if any."""
        return {"cluster": [self.cluster, 1, 1]} if self.cluster > 1 else {}

    def o_apart_from_q(self) -> bool:
        """O staged in a buffer of its own, not in Q's (k6's own_o_buffer; k7: always)."""
        return self.own_o_buffer

    def make_o_store(self, o: cute.Tensor, dtype):
        """Host side: the TMA store of O's tiles, the whole tile or, with k6's wg_store, one
        consumer warpgroup's 64 rows."""
        rows = 64 if self.wg_store else self.block_m
        return tma.make_tma_store(o, smem_tile_layout(dtype, rows, self.head_dim), rows,
                                  self.head_dim)

    def item_queue(self, storage, receivers: int):
        """The dynamic schedule's queue of work items from the producer warp to `receivers`
        threads (None with a static schedule, which needs none)."""
        if not self.scheduler.dynamic:
            return None
        return ItemQueue.create(storage.item_barriers.data_ptr(),
                                storage.items.get_tensor(cute.make_layout((4, 2))), receivers)

    def first_item(self, mQ: cute.Tensor, seqlen_k=None):
        """(heads, batch size, the scheduler's iterator, and this CTA's first work item:
        query tile, head, batch, valid)."""
        heads, batch_size = mQ.shape[2], mQ.shape[3]
        tiles = self.scheduler.start()
        return (heads, batch_size, tiles,
                *self.scheduler.work(tiles, mQ.shape[0], heads, batch_size, seqlen_k))

    def smem_estimate(self, head_dim: int, block_m: int, block_n: int, stages: int) -> int:
        """Q + K and V rings (16-bit elements), each 1024-byte aligned, + 1 KiB of mbarriers
        (k7 overrides it: FP8 rings, a V^T ring, an output buffer)."""
        return 1024 + sum(smem_bytes(rows * head_dim * 2)
                          for rows in (block_m, stages * block_n, stages * block_n))

    def describe(self) -> dict:
        named = {"epilogue": EPILOGUE_BARRIER,
                 "scheduler": [FIRST_SCHEDULER_BARRIER + k for k in range(self.warpgroups)]
                 if self.pingpong.enabled else []}
        if self.exp_turns.enabled:
            named["exp_turns"] = [self.exp_turns.first_barrier + k
                                  for k in range(self.warpgroups)]
        return {"smem_bytes": getattr(self, "smem_bytes", None), "block_m": self.block_m,
                "block_n": self.block_n, "stages": self.stages, "threads": self.threads,
                "persistent_ctas": self.scheduler.ctas if self.scheduler.persistent else 0,
                "consumer_warpgroups": self.warpgroups,
                "producer_regs": self.roles.producer_regs,
                "consumer_regs": self.roles.consumer_regs,
                "entry_regs_max": self.roles.entry_regs,
                "ctas_per_sm": self.roles.ctas_per_sm,
                "cluster": self.cluster, "kv_multicast": self.kv_multicast,
                "mbarriers": getattr(self, "mbarriers", None),
                "v_lags_k": self.v_lags_k, "own_o_buffer": self.own_o_buffer,
                "spin_waits": self.spin_waits,
                "named_barriers": named}

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mCounter: cute.Tensor, scale_log2: Float32, stream):
        q, k, v, o = [ndhb_view(t) for t in (mQ, mK, mV, mO)]   # (N, d, H, B)
        bm, bn, d = self.block_m, self.block_n, self.head_dim
        self.dtype = mQ.element_type                            # bf16 or fp16 (SPEC.dtypes)
        q_layout = smem_tile_layout(self.dtype, bm, d)          # also O's staging buffer
        kv_layout = smem_tile_layout(self.dtype, bn, d, self.stages)
        atoms, coords, self.q_bytes, kv_bytes = tma.make_qkv_loads(
            q, k, v, q_layout, kv_layout, bm, bn, d, multicast=self.kv_multicast)
        self.tile_bytes = kv_bytes // 2                         # one K (or V) tile
        tma_o, o_coords = self.make_o_store(o, self.dtype)

        @cute.struct
        class SharedStorage:
            q_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            k_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            v_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            item_barriers: cute.struct.MemRange[cutlass.Int64, 4]    # k6, dynamic schedule
            items: cute.struct.MemRange[cutlass.Int32, 8]          # (4 values, 2 slots)
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(kv_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(kv_layout)], 1024]

        self.shared_storage = self.with_buffers(SharedStorage, q_layout)
        self.smem_bytes = self.shared_storage.size_in_bytes()
        self.mbarriers = {"q": 2, "k": 2 * self.stages, "v": 2 * self.stages}
        seqlen, heads, batch = q.shape[0], q.shape[2], q.shape[3]
        self.kernel(*coords, o_coords, o, mLSE, mCounter, *atoms, tma_o, scale_log2, q_layout,
                    kv_layout, q, k).launch(
            grid=self.scheduler.grid(seqlen, heads, batch),
            block=[self.threads, 1, 1],
            # ptxas: 65536 / (threads x CTAs per SM) registers at entry (setmaxnreg)
            min_blocks_per_mp=self.roles.ctas_per_sm,
            # (with two CTAs per SM: all of the SM's shared memory, and no device query)
            **({"preferred_smem_carveout": 100} if self.roles.ctas_per_sm > 1 else {}),
            **self.cluster_launch(),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mOut: cute.Tensor, mLSE: cute.Tensor, mCounter: cute.Tensor, tma_q: cute.CopyAtom,
               tma_k: cute.CopyAtom, tma_v: cute.CopyAtom, tma_o: cute.CopyAtom,
               scale_log2: Float32, q_layout: cute.ComposedLayout,
               kv_layout: cute.ComposedLayout, q_mem: cute.Tensor, k_mem: cute.Tensor):
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
        # O is staged in Q's buffer (k6's option own_o_buffer: a buffer of its own)
        sO_buffer = storage.sO.get_tensor(q_layout.outer, swizzle=q_layout.inner) \
            if cutlass.const_expr(self.own_o_buffer) else sQ
        if cutlass.const_expr(self.wg_store):
            # (each warpgroup's rows: a slab of O's own buffer, or its own rows of Q's)
            sO_buffer = wg_major_o_buffer(storage, self.dtype, self.warpgroups, self.head_dim) \
                if cutlass.const_expr(self.o_apart_from_q()) else (sQ, None)
        sVt = transposed(sV)                                                    # (d, bn, stage)

        # Warp 0 initialises every mbarrier; the one CTA-wide sync of the kernel publishes
        # them. After the split below nothing may use barrier 0: the producer's warps leave.
        loads = tma.SplitKVLoads.create(storage, 4 * self.warpgroups, self.stages,
                                        self.q_bytes, self.tile_bytes,
                                        (tma_q, tma_k, tma_v), (mQ, mK, mV), (sQ, sK, sV),
                                        spin_waits=self.spin_waits,
                                        cluster=self.kv_multicast)
        queue = self.item_queue(storage, roles.consumer_threads)
        tma.barriers_ready(self.cluster)

        # Every role walks the same work items (one per CTA here; k6: a persistent loop),
        # each with its own iterator. A work item: query tile m_block of (head, batch).
        heads, batch_size, tiles, m_block, head, batch, valid = self.first_item(mQ, seqlen_k)
        if warp < 4:
            # ---------------- producer warpgroup ----------------
            roles.become_producer()
            if warp == 0:
                self.load_loop(loads, queue, mCounter, tiles, m_block, head, batch, valid,
                               seqlen_q, seqlen_k, heads, batch_size, group)
        else:
            # ---------------- consumer warpgroups 1..W ----------------
            roles.become_consumer()
            ctidx = tidx - 128                              # 0 .. 128 * W - 1
            wg = warp // 4 - 1                              # consumer warpgroup, 0 .. W - 1

            # Each consumer warpgroup owns 64 query rows (as in k4, indexed by ctidx).
            p_layout = self.p_layout()
            sP = None if cutlass.const_expr(p_layout is None) else \
                storage.sP.get_tensor(p_layout.outer, swizzle=p_layout.inner)
            mmas = wgmma.AttentionMmas.create(self.warpgroups, bm, bn, d, ctidx, sQ, sK, sVt,
                                              self.dtype, self.uniform_descriptors, sP=sP)
            acc_o = mmas.new_o_accumulator(bm, d)
            softmax = OnlineSoftmax.create(cute.size(mmas.s_coords, mode=[0]), scale_log2,
                                           lanes_per_row=4,
                                           fma_exp2_every=self.fma_exp2_every,
                                           fence_after=self.softmax_fence_after,
                                           opaque_exp2=self.opaque_exp2,
                                           round_p=self.dtype if self.round_p_sums
                                           else None)
            acc_s = mmas.new_s_accumulator(bm, bn)
            o_out = cute.make_rmem_tensor_like(acc_o, self.dtype)   # O in bf16 (fp16)
            q_state = tma.consumer_state(1)
            k_state = tma.consumer_state(self.stages)
            v_state = tma.consumer_state(self.stages)       # one tile behind k_state
            item_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)
            has_items = valid            # (a CTA of a persistent grid may have none)
            if has_items:
                self.start_turns(wg)
            while valid:
                n_count = schedule.n_block_count_kv(m_block, seqlen_q, seqlen_k)
                k0, k1 = 0, n_count                     # (stream_k: a piece of the item)
                if cutlass.const_expr(self.stream_k):
                    _, _, k0, k1 = scheduler.piece(tiles, seqlen_q, seqlen_k, heads, batch_size)
                acc_o.fill(0.0)
                softmax.reset()
                phase = self.trace.start("wait_q")
                loads.wait_q(q_state)
                self.trace.end(phase)
                scores = None                           # (k6's exp_first: q and k in memory)
                if cutlass.const_expr(self.exp_first):
                    scores = ScoreSource(q_mem, k_mem, head, head // group, batch)
                k_state, v_state = self.mainloop(
                    loads, wg, m_block, k1 - k0, seqlen_q, seqlen_k, mmas.mma_qk, mmas.mma_pv,
                    mmas.q_frag, mmas.k_frag, mmas.vt_frag, mmas.p_frag, acc_s, acc_o,
                    mmas.s_coords, softmax, k_state, v_state, n_base=k0, scores=scores)
                if cutlass.const_expr(self.own_o_buffer or self.direct_store):
                    # (k6's options) Q is read: the next one loads under the epilogue
                    # (with early_q_release the main loop handed it back after its last QK)
                    if cutlass.const_expr(not self.early_q_release):
                        loads.release(loads.q_pipe, q_state)
                    q_state.advance()

                # Epilogue: O / l -> bf16 (fp16) -> SMEM (Q's buffer) -> one TMA store.
                phase = self.trace.start("epilogue")
                if cutlass.const_expr(self.stream_k):
                    # a piece that begins an item leaves its raw state for the next CTA;
                    # one that ends an item merges the previous CTA's, then stores O
                    if k1 < n_count:
                        self.save_partial(mCounter, ctidx, wg, acc_o, softmax)
                    else:
                        if k0 > 0:
                            self.merge_partial(mCounter, ctidx, wg, acc_o, softmax)
                        self.write_output(softmax, mmas, ctidx, warp, acc_o, o_out, mLSE, mOut,
                                          sO_buffer, tma_o, mO, m_block, head, batch, seqlen_q)
                else:
                    self.write_output(softmax, mmas, ctidx, warp, acc_o, o_out, mLSE, mOut,
                                      sO_buffer, tma_o, mO, m_block, head, batch, seqlen_q)
                if cutlass.const_expr(not (self.own_o_buffer or self.direct_store)):
                    loads.release(loads.q_pipe, q_state)    # the next Q may overwrite it
                    q_state.advance()
                self.trace.end(phase)
                tiles, item_state, m_block, head, batch, valid = self.next_item(
                    queue, item_state, tiles, seqlen_q, heads, batch_size, seqlen_k)
            if has_items:
                self.drain_turns(wg)
            self.drain_o_store(warp)


    @cute.jit
    def start_turns(self, wg):
        """Before a CTA's first work item: consumer warpgroup 0 holds the first turn (of the
        ping-pong, and of k6's exp_turns); the token then lives as long as the CTA."""
        self.pingpong.start(wg)
        self.exp_turns.start(wg)

    @cute.jit
    def drain_turns(self, wg):
        """After a CTA's last work item: warpgroup 0 takes the tokens back (PingPong)."""
        self.pingpong.drain(wg)
        self.exp_turns.drain(wg)

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
        if cutlass.const_expr(isinstance(mmas.p_frag, wgmma.PWithRowSums)):
            softmax.take_row_sums(mmas.p_frag)          # l from the tensor cores
        inv_sum = softmax.finalize()
        self.store_lse(mLSE, softmax.log_sum_exp(inv_sum), mmas.s_coords, ctidx,
                       m_block * self.block_m, seqlen_q, head, batch)
        return inv_sum

    @cute.jit
    def store_output(self, mmas, ctidx, warp, o_out: cute.Tensor, mOut: cute.Tensor, sO_buffer,
                     tma_o: cute.CopyAtom, mO: cute.Tensor, m_block, head, batch, seqlen_q):
        """O (16-bit registers) of one work item to global memory."""
        if cutlass.const_expr(self.direct_store):
            self.store_o_direct(mOut, o_out, mmas.thr_pv, m_block, head, batch, seqlen_q)
        else:
            self.store_o(mmas.mma_pv, ctidx, warp, o_out, sO_buffer, tma_o, mO, m_block, head,
                         batch)

    @cute.jit
    def store_o(self, mma_pv: cute.TiledMma, ctidx, warp, o_out: cute.Tensor, sO: cute.Tensor,
                tma_o: cute.CopyAtom, mO: cute.Tensor, m_block, head, batch):
        """O (16-bit registers) -> the SMEM tile sO -> one TMA store, issued by the first
        consumer warp. The first barrier: nobody still reads sO's previous contents (every
        warpgroup's last QK when sO is Q's buffer; with defer_store_wait the previous item's
        store, which the first warp waits for just before). The store returns once SMEM is
        read, or at once with defer_store_wait (then `drain_o_store` before the CTA exits)."""
        if cutlass.const_expr(self.wg_store):
            self.store_o_wg(mma_pv, ctidx, warp, o_out, sO, tma_o, mO, m_block, head, batch)
            return
        if cutlass.const_expr(self.defer_store_wait):
            if warp == 4:
                tma.store_read_wait()
        self.epilogue_barrier.arrive_and_wait()
        self.o_to_smem(mma_pv, ctidx, o_out, sO)
        cute.arch.fence_proxy("async.shared", space="cta")   # visible to the TMA unit
        self.epilogue_barrier.arrive_and_wait()
        if warp == 4:
            o_store = tma.TmaTiles.partition(tma_o, mO, head, batch, sO)
            o_store.store(m_block, wait_read=not self.defer_store_wait)

    @cute.jit
    def store_o_wg(self, mma_pv: cute.TiledMma, ctidx, warp, o_out: cute.Tensor, sO,
                   tma_o: cute.CopyAtom, mO: cute.Tensor, m_block, head, batch):
        """k6's `wg_store`: each consumer warpgroup writes its own 64 rows of O into its own
        slab of the O buffer and its first warp stores them with a TMA store of 64 rows, on
        a barrier of the warpgroup's 128 threads: no warpgroup waits for another at the end
        of a work item, so the turns keep their stagger into the next one. A slab is written
        again only an item later: its store's read is waited for just before (by the warp
        that issued it), as with defer_store_wait. Where O is staged in Q's buffer (d >= 192)
        a warpgroup writes its own 64 rows of Q (which only its own QK read) and the storing
        warp waits for the read at once: the kernel then hands Q back."""
        sO_rows, sO_slabs = sO
        apart = sO_slabs is not None
        wg = warp // 4 - 1
        barrier = pipeline.NamedBarrier(barrier_id=WG_EPILOGUE_BARRIER + wg,
                                        num_threads=128)
        if cutlass.const_expr(apart):
            if warp % 4 == 0:
                tma.store_read_wait()                   # this slab's previous store
        barrier.arrive_and_wait()
        self.o_to_smem(mma_pv, ctidx, o_out, sO_rows)
        cute.arch.fence_proxy("async.shared", space="cta")   # visible to the TMA unit
        barrier.arrive_and_wait()
        if warp % 4 == 0:
            rows = sO_slabs[None, None, wg] if cutlass.const_expr(apart) else \
                cute.local_tile(sO_rows, (64, self.head_dim), (wg, 0))
            o_store = tma.TmaTiles.partition(tma_o, mO, head, batch, rows)
            o_store.store(m_block * self.warpgroups + wg, wait_read=not apart)

    @cute.jit
    def drain_o_store(self, warp):
        """After the last work item: with defer_store_wait (or wg_store) the last TMA store
        may still be reading sO, which must stay valid until it has."""
        if cutlass.const_expr(self.wg_store and self.o_apart_from_q()):
            if warp % 4 == 0:
                tma.store_read_wait()
        elif cutlass.const_expr(self.defer_store_wait):
            if warp == 4:
                tma.store_read_wait()

    @cute.jit
    def store_o_direct(self, mOut: cute.Tensor, o_out: cute.Tensor, thr_pv, m_block, head,
                       batch, seqlen_q):
        """O (bf16 registers) straight to global memory, no SMEM: each thread stores its
        pairs of neighbouring columns (4 bytes), skipping rows past the sequence's end. Frees
        the output buffer's SMEM for wider kv tiles; the stores are less coalesced than one
        TMA store (a quad of lanes writes 16 contiguous bytes per row)."""
        bm, d = self.block_m, self.head_dim
        g_o = cute.local_tile(mOut[None, None, head, batch], (bm, d), (m_block, 0))
        o_part = thr_pv.partition_C(g_o)
        coords = thr_pv.partition_C(cute.make_identity_tensor((bm, d)))
        rows_left = seqlen_q - m_block * bm
        for rr in cutlass.range_constexpr(cute.size(o_out.shape[0][1])):
            for v in cutlass.range_constexpr(cute.size(o_out.shape[0][2])):
                if coords[(0, rr, v), 0, 0][0] < rows_left:
                    cute.autovec_copy(o_out[(None, rr, v), 0, 0], o_part[(None, rr, v), 0, 0])

    @cute.jit
    def o_to_smem(self, mma_pv: cute.TiledMma, ctidx, o_out: cute.Tensor, sO: cute.Tensor):
        """This thread's O (16-bit, in the PV accumulator's layout) -> the SMEM tile the TMA
        store reads: with `stmatrix` (four 8 x 8 blocks per warp instruction: 4 at d = 64
        against 16 four-byte stores, and less address arithmetic), or one store per register
        pair (an 8-bit output, or stmatrix_o=False)."""
        # (the SMEM addresses derive from an opaque thread index so that they are computed
        # here, not hoisted out of a persistent loop: compiler_hints.py)
        if cutlass.const_expr(self.stmatrix_o and o_out.element_type.width == 16):
            store_o = wgmma.stmatrix_store(mma_pv, o_out.element_type)
            thr_store_o = store_o.get_slice(opaque(ctidx))
            cute.copy(store_o, thr_store_o.retile(o_out), thr_store_o.partition_D(sO))
        else:
            cute.autovec_copy(o_out, mma_pv.get_slice(opaque(ctidx)).partition_C(sO))

    @cute.jit
    def next_item(self, queue, item_state, tiles, seqlen_q, heads, batch_size, seqlen_k=None):
        """A consumer's next work item: from the producer warp's queue (dynamic schedule) or
        the grid-stride step (static); returns the iterator, the queue state and the item."""
        if cutlass.const_expr(self.scheduler.by_head_group):
            # the producer warp decoded the item (query tile, head, batch, valid)
            m_block, head, batch, valid_int = queue.receive(item_state, 4)
            item_state.advance()
            return tiles, item_state, m_block, head, batch, valid_int != 0
        if cutlass.const_expr(self.scheduler.dynamic):
            tiles = queue.receive(item_state)
            item_state.advance()
        else:
            tiles = self.scheduler.advance(tiles)
        m_block, head, batch, valid = self.scheduler.work(tiles, seqlen_q, heads, batch_size,
                                                          seqlen_k)
        return tiles, item_state, m_block, head, batch, valid

    @cute.jit
    def load_loop(self, loads: tma.SplitKVLoads, queue, mCounter: cute.Tensor, tiles,
                  m_block, head, batch, valid, seqlen_q, seqlen_k, heads, batch_size, group):
        """The producer warp (warp 0): every TMA load of every work item of this CTA."""
        schedule, scheduler = self.schedule, self.scheduler
        # Per work item K_0, Q, V_0, then K_j and V_j for every further kv tile. Each
        # acquire waits until every consumer warp has released that stage; Q's waits
        # for the previous output to leave its buffer, so K_0 goes first. Every tile
        # loaded here is waited on by the consumers, so no copy is in flight when the CTA
        # ends; in a cluster (k6's option) the other CTA's consumers still release stages
        # of this one's rings, and `loads.tail` waits for that before the warp exits.
        q_state = tma.producer_state(1)
        produce = tma.producer_state(self.stages)
        # k6's option v_lags_k: V's ring gets a state of its own, one tile behind K's
        produce_v = tma.producer_state(self.stages) if self.v_lags_k else None
        item_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 2)
        while valid:
            n_count = schedule.n_block_count_kv(m_block, seqlen_q, seqlen_k)   # >= 1
            first = 0                                   # (stream_k: the piece's kv tiles)
            if cutlass.const_expr(self.stream_k):
                _, _, first, k1 = scheduler.piece(tiles, seqlen_q, seqlen_k, heads,
                                                  batch_size)
                n_count = k1 - first
            work = loads.at(head, head // group, batch)
            if cutlass.const_expr(self.v_lags_k):
                # K_0, Q, K_1, V_0, K_2, V_1, ..., V_last: a consumer uses K_j one tile
                # before V_j (S_j = Q K_j^T goes with O += P_{j-1} V_{j-1}), so K_{j+1} no
                # longer queues behind V_j, whose stage is freed a tile later than K_j's
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
            else:
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
            if cutlass.const_expr(scheduler.dynamic):   # ask for the next one now
                tiles = fetch_next_item(mCounter)
                if cutlass.const_expr(not scheduler.by_head_group):
                    queue.publish(item_state, tiles)    # each consumer decodes it
                    item_state.advance()
            else:
                tiles = scheduler.advance(tiles)
            m_block, head, batch, valid = scheduler.work(tiles, seqlen_q, heads, batch_size,
                                                         seqlen_k)
            if cutlass.const_expr(scheduler.by_head_group):   # decoded here, once
                valid_int = Int32(0)
                if valid:
                    valid_int = Int32(1)
                queue.publish(item_state, m_block, head, batch, valid_int)
                item_state.advance()
        loads.tail(produce, produce_v)
        if cutlass.const_expr(scheduler.dynamic):
            retire(mCounter)

    @cute.jit
    def mainloop(self, loads: tma.SplitKVLoads, wg, m_block, n_count, seqlen_q, seqlen_k,
                 mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, q_frag: cute.Tensor,
                 k_frag: cute.Tensor, vt_frag: cute.Tensor, p_frag: cute.Tensor,
                 acc_s: cute.Tensor, acc_o: cute.Tensor, s_coords: cute.Tensor,
                 softmax: OnlineSoftmax, k_state, v_state, n_base=0, scores=None):
        """One consumer warpgroup's loop over the kv tiles of a work item: O and the
        softmax state are updated in place; returns the K and V ring states (k6 overrides
        this method; n_base, the first kv tile, is k6's stream_k's: always 0 here; scores,
        k6's exp_first's: unused)."""
        pingpong = self.pingpong
        o_rc = acc_rows_cols(acc_o)

        for n in cutlass.range(n_count, unroll=1):
            phase = self.trace.start("wait_kv")
            loads.wait(loads.k_pipe, k_state)           # K_n, and V_{n-1} for the PV below
            if cutlass.const_expr(not self.v_lags_k):
                if n > 0:
                    loads.wait(loads.v_pipe, v_state)
            self.trace.end(phase)
            phase = self.trace.start("wait_turn")
            pingpong.sync(wg)                           # --- this WG's turn: both GEMMs
            self.trace.end(phase)
            phase = self.trace.start("mma")
            if cutlass.const_expr(not self.v_lags_k):
                if n > 0:                               # O += P_{n-1} V_{n-1}
                    self.issue_pv(mma_pv, acc_o, p_frag, vt_frag, v_state)
            wgmma.gemm(mma_qk, acc_s, q_frag, k_frag[None, None, None, k_state.index],
                       zero_init=True)                  # S = Q K_n^T
            if cutlass.const_expr(self.v_lags_k):       # V_{n-1} was loaded after K_n
                if n > 0:
                    loads.wait(loads.v_pipe, v_state)
                    self.issue_pv(mma_pv, acc_o, p_frag, vt_frag, v_state)
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
                        softmax: OnlineSoftmax, m_block, n, seqlen_q, seqlen_k,
                        mask: cutlass.Constexpr = None):
        """Mask kv tile n's scores where needed (tails, the causal diagonal), then the
        online-softmax step: S -> P (fp32, unnormalized) in place; returns alpha (shared
        with k6; mask as in `masked_scores`)."""
        return softmax.step(self.masked_scores(acc_s, s_coords, m_block, n, seqlen_q, seqlen_k,
                                               mask=mask))

    @cute.jit
    def masked_scores(self, acc_s: cute.Tensor, s_coords: cute.Tensor, m_block, n, seqlen_q,
                      seqlen_k, cols: cutlass.Constexpr = 0,
                      mask: cutlass.Constexpr = None) -> cute.Tensor:
        """kv tile n's scores as a [row, col] view, -inf where the tail or the causal
        diagonal hides them (only tiles that need it run the mask code); cols: the tile's
        first `cols` columns only (k6's narrow last tile, `tail_n`; 0: all); mask: whether
        the tile needs the mask, where the caller knows (k6's `split_mask` loops; None:
        tested here)."""
        s_rc = acc_rows_cols(acc_s)
        if cutlass.const_expr(cols):
            s_rc, s_coords = first_columns(s_rc, cols), first_columns(s_coords, cols)
        needs = self.schedule.needs_mask_kv(m_block, n, seqlen_q, seqlen_k) \
            if cutlass.const_expr(mask is None) else mask
        if needs:
            mask_scores(s_rc, s_coords, m_block * self.block_m, n * self.block_n, seqlen_k,
                        self.causal, seqlen_k - seqlen_q, per_row_limit=self.mask_per_row)
        return s_rc

    @cute.jit
    def probs_to_operand(self, acc_s: cute.Tensor, p_frag: cute.Tensor,
                         reverse: cutlass.Constexpr = False):
        """P (fp32, in S's registers) -> the register A operand of O += P V, in the input
        dtype (shared with k6; k7's FP8 operand needs a different register order).
        reverse: the operand's k16 slices converted last first (k6's `reverse_p`)."""
        if cutlass.const_expr(reverse):
            p_view = acc_as_operand_a(acc_s)
            slices = cute.size(p_frag, mode=[2])
            for i in cutlass.range_constexpr(slices):
                k = slices - 1 - i
                p_frag[None, None, k].store(p_view[None, None, k].load().to(self.dtype))
        else:
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

    def p_layout(self):
        """SMEM layout of a P buffer, or None: P stays in registers (k6's `p_in_smem`)."""
        return None

    # k6's option: O staged in a buffer of its own instead of Q's (False: no code, no SMEM)
    own_o_buffer = False
    # k6's (and k7's) option: O stored from registers straight to global memory, no SMEM
    direct_store = False
    # k6's option with own_o_buffer: the epilogue's TMA store returns at once; the first
    # consumer warp waits for it to have read O's buffer before the next item's epilogue
    defer_store_wait = False
    # k6's options: a memory fence after this many exp2s of a tile (OnlineSoftmax.fence_after),
    # exp2 results the compiler may not recompute (OnlineSoftmax.opaque_exp2)
    softmax_fence_after = -1
    opaque_exp2 = False
    # k6's option: P rounded to the input type before the row sums (OnlineSoftmax.round_p)
    round_p_sums = False
    # k6's option: the item's last kv tile holds at most this many keys (0: a whole tile);
    # its softmax and its PV take only those columns (k6's `tail_n`)
    tail_n = 0

    def with_buffers(self, storage, q_layout):
        """`storage` (a cute.struct) with the buffers k6's options add: sP for `p_layout`,
        sO (Q's shape) for `own_o_buffer`."""
        layout = self.p_layout()
        fields = dict(storage._annotations)
        if layout is not None:
            fields["sP"] = cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(layout)], 1024]
        if self.own_o_buffer:
            fields["sO"] = cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(q_layout)], 1024]
        if len(fields) == len(storage._annotations):
            return storage
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    @cute.jit
    def issue_pv(self, mma_pv: cute.TiledMma, acc_o: cute.Tensor, p_frag: cute.Tensor,
                 vt_frag: cute.Tensor, v_state, keys: cutlass.Constexpr = 0):
        """O += P V with V from `v_state`'s stage (shared with k6); keys: only the tile's
        first `keys` (k6's tail_n; 0: all of them)."""
        k_blocks = None
        if cutlass.const_expr(keys):
            k_blocks = (0, keys * cute.size(wgmma.pv_operand(p_frag), mode=[2])
                        // self.block_n)
        also = None
        if cutlass.const_expr(isinstance(p_frag, wgmma.PWithRowSums)):
            also = p_frag.pv_also()                     # and the tile's row sums, P 1
        wgmma.gemm(mma_pv, acc_o, wgmma.pv_operand(p_frag),
                   vt_frag[None, None, None, v_state.index], zero_init=False,
                   k_blocks=k_blocks, also=also)

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
        self.issue_pv(mma_pv, acc_o, p_frag, vt_frag, v_state, self.tail_n)
        self.pingpong.finish(wg)                        # the next WG's last PV may go
        warpgroup.wait_group(0)
        loads.release(loads.v_pipe, v_state)
        v_state.advance()
        self.trace.end(phase)
        return v_state


@cute.jit
def wg_major_o_buffer(storage, dtype, warpgroups: int, head_dim: int):
    """O's own buffer as one (64, d) tile per consumer warpgroup, each a 64-row TMA box
    (k6's wg_store): (a (64 x W, d) view for the stmatrix partition, the (64, d, W) slabs).
    Both views share the swizzle; every slab is 1024-byte aligned, so it swizzles as a
    tile of its own."""
    slabs = smem_tile_layout(dtype, 64, head_dim, warpgroups)
    outer = slabs.outer
    rows = cute.make_layout(((outer.shape[0], outer.shape[2]), outer.shape[1]),
                            stride=((outer.stride[0], outer.stride[2]), outer.stride[1]))
    return (storage.sO.get_tensor(rows, swizzle=slabs.inner),
            storage.sO.get_tensor(outer, swizzle=slabs.inner))


def lse_buffer(problem, device) -> list:
    """Where k5 and k6 write the log-sum-exp: (batch, heads, seqlen_q) fp32."""
    import torch
    return [torch.empty((problem.batch, problem.heads, problem.seqlen), dtype=torch.float32,
                        device=device)]


def compile_kernel(problem, *, compile_options: str = "", block_m: int = 0,
                   block_n: int = 128, stages: int = 2, trace: bool = False,
                   uniform_descriptors: bool = True, spin_waits: bool = True,
                   v_lags_k: bool = True, fma_exp2_every: int = 0,
                   stmatrix_o: bool = True):
    """Compile (or fetch from the cache) k5; options: block_m (0: the default for the head
    dim; 64, 128 or 192 = 1-3 consumer warpgroups), block_n, stages (of each of the K and V
    rings), trace (iket phase ranges, for timelines), spin_waits (the rings' waits spin on
    `mbarrier.try_wait` instead of sleeping between tries: tma.wait_full), v_lags_k (K_{j+1}
    loaded before V_j, V_{j-1} waited for inside the turn), fma_exp2_every (every n-th exp2
    on the FMA pipe), stmatrix_o (O to SMEM with `stmatrix`). The defaults: the two
    load-order options together, +0.7-2.2% at d = 64 and 128 (each alone -2.0% to +0.4%),
    measured round-robin against FlashAttention-4 with and without its overlap
    (results/h100/2026-11-25_k5_options_d*.json, docs/k5.md); stmatrix_o +0.0-0.4%."""
    return compile_attention(SPEC, FlashAttentionK5, problem,
                             {"block_m": block_m, "block_n": block_n, "stages": stages,
                              "trace": trace, "uniform_descriptors": bool(uniform_descriptors),
                              "spin_waits": bool(spin_waits), "v_lags_k": bool(v_lags_k),
                              "fma_exp2_every": int(fma_exp2_every),
                              "stmatrix_o": bool(stmatrix_o)},
                             workspace_fn=lse_buffer, compile_options=compile_options)


def run_kernel(handle, q, k, v, out):
    run_attention(handle, q, k, v, out)
