"""TMA loads and the mbarrier pipeline that feeds K/V tiles (shared by k3, k4_qk, k4).

The contract of a TMA load, in four steps:

1. Host: `make_tiled_tma_atom` encodes a tensor descriptor (base address, extents, strides,
   box = one tile, swizzle mode taken from the SMEM layout). Extents are the real ones, so a
   box that runs past the end of the sequence is filled with zeros by the hardware: tails
   need no special load code and nothing is read out of bounds.
2. Device: one thread arms the stage's mbarrier with the number of bytes it expects
   (`arrive_and_expect_tx`), then issues `cp.async.bulk.tensor`; the copy engine writes SMEM
   and decrements that count as bytes land.
3. Consumers wait on the mbarrier's current phase (`mbarrier.try_wait.parity`): it flips
   when the arrival count and the byte count both reach zero.
4. When every consumer warp has finished reading the stage it arrives on the stage's
   "empty" barrier; the producer waits on that before reusing the buffer.

`PipelineTmaAsync` from cutlass.pipeline implements steps 2-4 over a ring of stages, with a
(stage index, phase) state that the producer and the consumers advance independently.
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import dsl_user_op


def make_tma_load(gmem: cute.Tensor, smem_layout, rows: int, cols: int):
    """Host side: TMA atom + TMA tensor for (rows, cols) tiles of an (N, d, H, B) tensor.

    `smem_layout` is one stage's layout (or a staged one; only its first two modes are used).
    """
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), gmem,
                                       cute.select(smem_layout, mode=[0, 1]), (rows, cols))


def make_tma_store(gmem: cute.Tensor, smem_layout, rows: int, cols: int):
    """Host side: TMA atom for storing (rows, cols) SMEM tiles; rows past the end are clipped."""
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), gmem,
                                       cute.select(smem_layout, mode=[0, 1]), (rows, cols))


@dataclasses.dataclass(frozen=True)
class TmaTiles:
    """One operand's TMA copies for one (head, batch): tile t <-> SMEM buffer (stage s)."""

    atom: cute.CopyAtom
    gmem: cute.Tensor    # (copy, tile index)
    smem: cute.Tensor    # (copy, stage) or (copy,)

    @staticmethod
    def partition(atom, tma_tensor: cute.Tensor, head, batch, smem: cute.Tensor,
                  col_tile=0) -> "TmaTiles":
        """`col_tile`: the tile of columns (0 where a tile spans all of d)."""
        rows, cols = cute.size(smem, mode=[0]), cute.size(smem, mode=[1])
        tiles = cute.local_tile(tma_tensor[None, None, head, batch], (rows, cols),
                                (None, col_tile))
        smem_part, gmem_part = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                                     cute.group_modes(smem, 0, 2),
                                                     cute.group_modes(tiles, 0, 2))
        return TmaTiles(atom, gmem_part, smem_part)

    @staticmethod
    def partition_rows(atom, tma_tensor: cute.Tensor, head, batch,
                       smem: cute.Tensor) -> "TmaTiles":
        """`partition` for a vector per row (the backward's LSE and D): tma_tensor is
        (rows, H, B), smem (tile rows, stage)."""
        rows = cute.size(smem, mode=[0])
        tiles = cute.local_tile(tma_tensor[None, head, batch], (rows,), (None,))
        smem_part, gmem_part = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                                     cute.group_modes(smem, 0, 1),
                                                     cute.group_modes(tiles, 0, 1))
        return TmaTiles(atom, gmem_part, smem_part)

    def copy(self, tile_index, barrier, stage=None):
        """Load global tile `tile_index` into the SMEM buffer (of `stage`)."""
        smem = self.smem if stage is None else self.smem[None, stage]
        cute.copy(self.atom, self.gmem[None, tile_index], smem, tma_bar_ptr=barrier)

    def prefetch(self, tile_index):
        """Ask L2 for global tile `tile_index` (`cp.async.bulk.prefetch.tensor`): nothing lands
        in SMEM, no barrier; a hint that costs no ring stage (the decode variants)."""
        cute.prefetch(self.atom, self.gmem[None, tile_index])

    def copy_on_armed(self, tile_index, barrier, nbytes: int):
        """`copy` on a barrier the producer has already armed for another load (kb2: K with
        the first Q stage): its expected byte count grows by this tile's `nbytes` first (one
        lane), before any of the stage's copies can complete the phase."""
        with cute.arch.elect_one():
            cute.arch.mbarrier_expect_tx(barrier, nbytes)
        self.copy(tile_index, barrier)

    def store(self, tile_index, wait_read: bool = True):
        """Store the SMEM buffer to global tile `tile_index` and wait until SMEM is read
        (wait_read=False: the caller waits, with `store_read_wait`, before it writes the
        buffer again or exits)."""
        cute.copy(self.atom, self.smem, self.gmem[None, tile_index])
        cute.arch.cp_async_bulk_commit_group()
        if cutlass.const_expr(wait_read):
            store_read_wait()


def store_read_wait():
    """Wait until this thread's bulk stores have read their shared memory."""
    cute.arch.cp_async_bulk_wait_group(0, read=True)


def make_qkv_loads(q, k, v, q_layout, kv_layout, block_m: int, block_n: int, head_dim: int,
                   v_layout=None, head_dim_v: int = 0):
    """Host side, for the attention kernels: TMA atoms and TMA tensors for Q (one block_m x d
    tile) and K, V (block_n x d ring stages), and the bytes each Q load / K+V stage brings.
    `v_layout`: V's SMEM stage as a (block_n, d) view when it is not K's (k7 with V given
    transposed: the (kv, d) view of a V^T stage; k5-k6 with v's own head dim `head_dim_v`:
    (block_n, dv))."""
    v_layout = kv_layout if v_layout is None else v_layout
    tma_q = make_tma_load(q, q_layout, block_m, head_dim)
    tma_k = make_tma_load(k, kv_layout, block_n, head_dim)
    tma_v = make_tma_load(v, v_layout, block_n, head_dim_v or head_dim)
    atoms = (tma_q[0], tma_k[0], tma_v[0])
    tensors = (tma_q[1], tma_k[1], tma_v[1])
    q_bytes = tma_bytes(q.element_type, q_layout)
    kv_bytes = tma_bytes(k.element_type, kv_layout) + tma_bytes(v.element_type, v_layout)
    return atoms, tensors, q_bytes, kv_bytes


def make_tma_row_load(gmem_rows: cute.Tensor, rows: int):
    """Host side: TMA atom + tensor for `rows`-long pieces of a (rows, H, B) fp32 vector."""
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), gmem_rows,
                                       cute.make_layout((rows,)), (rows,))


@dsl_user_op
def bulk_reduce_add_f32(smem_ptr: cute.Pointer, gmem_ptr: cute.Pointer, num_bytes: int, *,
                        loc=None, ip=None) -> None:
    """global[i] += smem[i] for `num_bytes` of contiguous fp32, by the copy engine
    (`cp.reduce.async.bulk ... .add.f32`; one thread issues it, completion is tracked with
    the bulk-group commit/wait like a TMA store). Both addresses 16-byte aligned, the size a
    multiple of 16."""
    llvm.inline_asm(
        None,
        [gmem_ptr.llvm_ptr, smem_ptr.toint(loc=loc, ip=ip).ir_value(),
         Int32(num_bytes).ir_value(loc=loc, ip=ip)],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def elected_arrive_if(barrier: cute.Pointer, pred, *, loc=None, ip=None) -> None:
    """One lane of the warp (elect.sync) arrives on the mbarrier at `barrier` where `pred`
    (an Int32) is nonzero: election, test and arrive as predicates of one PTX block. An
    `if` around the arrive (or `elect_one` around a predicated one) ends a basic block, and
    ptxas schedules nothing across one (k6's `v_release_last`)."""
    llvm.inline_asm(
        None,
        [barrier.toint(loc=loc, ip=ip).ir_value(), Int32(pred).ir_value(loc=loc, ip=ip)],
        "{\n .reg .pred e, p;\n elect.sync _|e, 0xffffffff;\n"
        " setp.ne.and.b32 p, $1, 0, e;\n"
        " @p mbarrier.arrive.shared::cta.b64 _, [$0];\n}",
        "r,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT)


def prefetch_descriptors(*atoms):
    """Pull the TMA descriptors into the descriptor cache early (call from one warp)."""
    for atom in atoms:
        cpasync.prefetch_descriptor(atom)


def tma_bytes(dtype, smem_layout) -> int:
    """Bytes one TMA tile of `smem_layout` (first two modes) delivers."""
    return cute.size_in_bytes(dtype, cute.select(smem_layout, mode=[0, 1]))


def make_tma_pipeline(barriers: cute.Pointer, stages: int, consumer_warps: int,
                      bytes_per_stage: int, defer_sync: bool = False) -> pipeline.PipelineTmaAsync:
    """A ring of `stages` full/empty mbarrier pairs: one producer thread, `consumer_warps`
    warps releasing each stage (one lane of each arrives once: `release_stage`). Warp 0
    initialises the mbarriers; unless `defer_sync`, the CTA syncs right away to make them
    visible."""
    # consumers as the library counts them: warps (one elected arrive each)
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers,
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
        tx_count=bytes_per_stage,
        defer_sync=defer_sync,
    )


@dataclasses.dataclass(frozen=True)
class KVLoader:
    """K and V tiles through one pipeline: one barrier per stage counts both tiles' bytes."""

    pipe: pipeline.PipelineTmaAsync
    k: TmaTiles
    v: TmaTiles

    def load(self, state: pipeline.PipelineState, tile_index):
        """Producer (one warp): wait until the stage is free, arm it, issue both copies."""
        self.pipe.producer_acquire(state)
        barrier = self.pipe.producer_get_barrier(state)
        self.k.copy(tile_index, barrier, state.index)
        self.v.copy(tile_index, barrier, state.index)
        self.pipe.producer_commit(state)   # a no-op for TMA: the copies complete the barrier


@dataclasses.dataclass(frozen=True)
class AttentionLoads:
    """Everything the producer warp issues for one CTA: Q once (a one-stage pipeline), then
    K/V tiles through the ring. Shared by k3, k4_qk and k4."""

    q_pipe: pipeline.PipelineTmaAsync
    q: TmaTiles
    kv: KVLoader

    @staticmethod
    def create(storage, consumer_warps: int, stages: int, q_bytes: int, kv_bytes: int,
               atoms, tensors, smem, head, batch) -> "AttentionLoads":
        """`atoms`, `tensors`, `smem`: (Q, K, V) TMA atoms, TMA tensors and SMEM buffers;
        `storage` has `q_barriers` (2) and `kv_barriers` (2 * stages)."""
        q_pipe = make_tma_pipeline(storage.q_barriers.data_ptr(), 1, consumer_warps, q_bytes)
        kv_pipe = make_tma_pipeline(storage.kv_barriers.data_ptr(), stages, consumer_warps,
                                    kv_bytes)
        q, k, v = (TmaTiles.partition(a, t, head, batch, s) for a, t, s in zip(atoms, tensors, smem))
        return AttentionLoads(q_pipe, q, KVLoader(kv_pipe, k, v))

    @cute.jit
    def start(self, m_block, n_count, produce: pipeline.PipelineState):
        """Producer prologue (warp 0): Q, then the first `stages` K/V tiles."""
        q_state = producer_state(1)
        self.q_pipe.producer_acquire(q_state)
        self.q.copy(m_block, self.q_pipe.producer_get_barrier(q_state))
        for _ in cutlass.range(cutlass.min(self.kv.pipe.num_stages, n_count), unroll=1):
            self.kv.load(produce, produce.count)
            produce.advance()
        return produce

    @cute.jit
    def refill(self, produce: pipeline.PipelineState, n_count):
        """Producer (warp 0), after its own release: load the next tile, if any, into the
        stage just freed (waits until every consumer warp has released it)."""
        if produce.count < n_count:
            self.kv.load(produce, produce.count)
            produce.advance()
        return produce

    def wait_q(self):
        self.q_pipe.consumer_wait(consumer_state(1))


def producer_state(stages: int):
    return pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)


def consumer_state(stages: int):
    return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)


# --------------------------------------------------------------------------------------------
# From k5 on: a producer warp of its own, and K and V through separate rings.
# --------------------------------------------------------------------------------------------

def make_tma_ring(barriers: cute.Pointer, stages: int, consumer_warps: int,
                  bytes_per_stage: int) -> pipeline.PipelineTmaAsync:
    """`make_tma_pipeline` without its CTA-wide sync: the caller makes every ring's barriers
    visible at once (`barriers_ready`) before any use."""
    return make_tma_pipeline(barriers, stages, consumer_warps, bytes_per_stage, defer_sync=True)


def barriers_ready():
    """Fence the mbarrier inits and sync the CTA (every thread, before the role split)."""
    pipeline.pipeline_init_arrive(is_relaxed=True)
    pipeline.pipeline_init_wait()


def wait_full(pipe, state: pipeline.PipelineState, spin: bool = False):
    """A consumer's wait until `state`'s stage has landed. The library's `consumer_wait` is
    a loop of `mbarrier.try_wait` with a suspend-time hint, which ptxas compiles to a
    `TRYWAIT` followed by `NANOSLEEP.SYNCS` when the try fails: the warp then sleeps until
    the barrier unit wakes it. `spin`: `try_wait` without the hint, in a loop (the hardware
    still suspends the warp inside each try, up to its own time limit), never `NANOSLEEP`."""
    if spin:
        _spin(pipe.sync_object_full, state.index, state.phase)
    else:
        pipe.consumer_wait(state)


def acquire_empty(pipe, state: pipeline.PipelineState, spin: bool = False):
    """The producer's `producer_acquire` (wait until the stage is free, then arm its full
    barrier with the tile's bytes), its wait compiled as in `wait_full`."""
    if spin:
        _spin(pipe.sync_object_empty, state.index, state.phase)
        pipe.producer_acquire(state, cutlass.Boolean(True))   # True: the wait is done
    else:
        pipe.producer_acquire(state)


@cute.jit
def _spin(barriers, index, phase):
    ready = barriers.try_wait(index, phase)
    while not ready:
        ready = barriers.try_wait(index, phase)


def release_stage(pipe, state: pipeline.PipelineState):
    """A consumer warp hands `state`'s stage back to the producer: one arrive per warp on
    the stage's empty barrier. The library's `consumer_release` arrives from lane 0, a
    predicate that ptxas recomputes from the thread index (`S2R` + `LOP3`, tens of cycles)
    before every release of a consumer loop; here one lane is elected (`ELECT`)."""
    with cute.arch.elect_one():
        pipe.sync_object_empty.arrive(state.index, pipe.consumer_mask)


@dataclasses.dataclass(frozen=True)
class SplitKVLoads:
    """Q once per work item (a one-stage ring), then K and V tiles through two rings of
    their own.

    K_j and V_j use the same stage index (they are loaded and consumed in the same order),
    so one PipelineState per role drives both rings; but each has its own full/empty
    mbarriers: a consumer can start S = Q K_j^T as soon as K_j has landed while V_j is still
    in flight, and hands K_j's buffer back as soon as that WGMMA retires, long before it is
    done with V_j.

    The rings live as long as the CTA (a persistent CTA keeps its pipeline states running
    from one work item to the next); the TMA copies are bound to a (head, batch) by `at`.
    """

    q_pipe: pipeline.PipelineTmaAsync
    k_pipe: pipeline.PipelineTmaAsync
    v_pipe: pipeline.PipelineTmaAsync
    atoms: tuple            # (Q, K, V) TMA atoms
    tensors: tuple          # (Q, K, V) TMA tensors
    smem: tuple             # (Q, K, V) SMEM buffers
    q: TmaTiles = None      # set by `at`
    k: TmaTiles = None
    v: TmaTiles = None
    spin_waits: bool = False  # every wait spins (`wait_full`, `acquire_empty`)
    elect_release: bool = True  # `release` from an elected lane (False: the library's)

    @staticmethod
    def create(storage, consumer_warps: int, stages: int, q_bytes: int, tile_bytes: int,
               atoms, tensors, smem, spin_waits: bool = False,
               elect_release: bool = True, v_tile_bytes: int = 0) -> "SplitKVLoads":
        """`storage` has `q_barriers` (2), `k_barriers` and `v_barriers` (2 * stages each).
        Call `barriers_ready()` before the barriers are used. `spin_waits`: every wait of
        the rings spins (`wait_full`, `acquire_empty`). `v_tile_bytes`: a V tile's bytes
        where they are not a K tile's (v's own head dim; 0: tile_bytes)."""
        q_pipe = make_tma_ring(storage.q_barriers.data_ptr(), 1, consumer_warps, q_bytes)
        k_pipe = make_tma_ring(storage.k_barriers.data_ptr(), stages, consumer_warps, tile_bytes)
        v_pipe = make_tma_ring(storage.v_barriers.data_ptr(), stages, consumer_warps,
                               v_tile_bytes or tile_bytes)
        return SplitKVLoads(q_pipe, k_pipe, v_pipe, tuple(atoms), tuple(tensors), tuple(smem),
                            spin_waits=bool(spin_waits), elect_release=bool(elect_release))

    def at(self, head, kv_head, batch) -> "SplitKVLoads":
        """The copies of one work item: Q from head `head`, K and V from `kv_head` (the same
        head, or with GQA the k/v head that a group of query heads shares)."""
        q = TmaTiles.partition(self.atoms[0], self.tensors[0], head, batch, self.smem[0])
        k, v = (TmaTiles.partition(a, t, kv_head, batch, s)
                for a, t, s in zip(self.atoms[1:], self.tensors[1:], self.smem[1:]))
        return dataclasses.replace(self, q=q, k=k, v=v)

    # producer side (one warp)
    def load_q(self, state: pipeline.PipelineState, m_block):
        """Wait until the consumers are done with the Q buffer (a persistent CTA's previous
        output leaves through it), then load query tile `m_block`."""
        self.acquire(self.q_pipe, state)
        self.q.copy(m_block, self.q_pipe.producer_get_barrier(state))

    def load_k(self, state: pipeline.PipelineState, tile_index):
        """Wait until K's stage is free, arm its barrier with the tile's bytes, issue the copy."""
        self.acquire(self.k_pipe, state)
        self.k.copy(tile_index, self.k_pipe.producer_get_barrier(state), state.index)

    def load_v(self, state: pipeline.PipelineState, tile_index):
        self.acquire(self.v_pipe, state)
        self.v.copy(tile_index, self.v_pipe.producer_get_barrier(state), state.index)

    def acquire(self, pipe, state: pipeline.PipelineState):
        acquire_empty(pipe, state, self.spin_waits)

    # consumer side (every consumer thread; one lane of each warp arrives on release)
    def wait(self, pipe, state: pipeline.PipelineState):
        """Wait until `state`'s stage of `pipe` (q_pipe, k_pipe, v_pipe) has landed."""
        wait_full(pipe, state, self.spin_waits)

    def wait_q(self, state: pipeline.PipelineState):
        self.wait(self.q_pipe, state)

    def release(self, pipe, state: pipeline.PipelineState):
        """This warp is done with `state`'s stage of `pipe` (`release_stage`)."""
        if self.elect_release:
            release_stage(pipe, state)
        else:
            pipe.consumer_release(state)

    @cute.jit
    def release_if(self, pipe, stage, cond):
        """`release` of stage index `stage` where `cond` holds: one predicated arrive of an
        elected lane (`elected_arrive_if`), no branch in the caller's block (k6: V_{n-1} on
        every tile but the first, Q after an item's last QK)."""
        flag = Int32(0)
        if cond:
            flag = Int32(1)
        elected_arrive_if(pipe.sync_object_empty.get_barrier(stage), flag)
