"""Context parallelism: ring attention over a `torch.distributed` process group.

    from hopper_attn.context_parallel import ring_attention, zigzag_shard, zigzag_merge
    q_local = zigzag_shard(q, rank, world_size)            # (B, N / W, H, d) on each rank
    out_local = ring_attention(q_local, k_local, v_local, causal=True)

When one sequence no longer fits one GPU, each of the W ranks of a group holds a slice of it
(queries, keys and values alike) and the K/V slices travel around the ring: at step s rank r
holds the K/V of rank (r - s) mod W, attends its own queries to them with the single-GPU
kernel (`attention(..., return_lse=True)`), and merges the partial output into its running
output by the partials' log-sum-exps, in fp32. The next K/V slice is in flight (batched
isend/irecv on a side CUDA stream) while the current one is computed.

Causal load balance ("zigzag" layout): the sequence is cut into 2W chunks and rank r holds
chunks r and 2W-1-r, one early and one late, so every rank does the same work at every
step: step 0 (its own K/V) runs causal; at a step whose K/V comes from an earlier rank all
its queries see the first K/V chunk in full and none of the second; from a later rank only
its second query chunk sees anything, and it sees both K/V chunks in full. Either way one
non-causal call on half the pairs, no masked block computed. ("contiguous": rank r holds
chunk r of W; correct, but under a causal mask the last rank works W times the first.)

Backward: the same ring again with K/V, plus a second ring carrying dK/dV (fp32): each rank
adds its contribution to the dK/dV of the K/V it holds and passes them on with it; after W
steps they arrive back at their owner. Every block's gradient comes from the backward op
given the FINAL output and LSE (`torch.ops.hopper_attn.attention_backward`): with the
global LSE, exp(S - lse) of a block is already the block's part of the global softmax, and
D = rowsum(dO * O) is the global one, so the block gradients simply add up.

Precision: the merge and every accumulation are fp32, each result is rounded to the inputs'
dtype once; what a ring adds over one call is the kernels' rounding of each block's O, dQ,
dK, dV to bf16 (docs/context-parallel.md, "Precision").

What is shared between the real ring and the one-process simulation (`simulate_ring`):
everything but the transport. A rank's forward and backward are generators
(`_forward_program`, `_backward_program`) that yield `_Send` / `_Wait` requests; `_drive`
serves them with NCCL (or gloo, for CPU tensors), `_drive_lockstep` runs W of them in one
process and hands each rank what its left neighbour sent. `block_task` (which query and
key rows a rank computes at a step, with which mask) and `merge_partials` are pure
functions that run on CPU tensors.

Packed documents (`ring_attention_varlen`, `simulate_ring_varlen`): one packed sequence of
documents (global `cu_seqlens`) split as above; the same schedule, and every block is one
`attention_varlen` call with each document clipped to the block's query rows and key rows
(`clip_cu_seqlens`: elementwise on the device, no host sync). Off the diagonal a block's
keys all precede its queries, so a piece sees its keys in full; on the diagonal a piece's
query and key rows are the same tokens, so the causal mask per piece is the document's.

Requirements: every rank holds the same number of query rows and of key rows (the ring's
buffers must match); under a causal mask the query and key slices are the same rows
(self-attention), with an even local length in the zigzag layout. ValueError otherwise,
before any launch (the per-block kernels add their own: dtype, head_dim, ...).
docs/context-parallel.md has the schedule drawn out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

LAYOUTS = ("zigzag", "contiguous")


# ---------------------------------------------------------------- layout (pure) --------

def _chunks_per_rank(layout: str) -> int:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return 2 if layout == "zigzag" else 1


def rank_chunks(rank: int, world_size: int, layout: str = "zigzag") -> tuple[int, ...]:
    """The global chunk indices rank `rank` holds, in its local order: (r, 2W-1-r) of 2W
    chunks in the zigzag layout, (r,) of W in the contiguous one."""
    if _chunks_per_rank(layout) == 2:
        return (rank, 2 * world_size - 1 - rank)
    return (rank,)


def split_sequence(x: torch.Tensor, world_size: int, layout: str = "zigzag",
                   dim: int = 1) -> list[torch.Tensor]:
    """The W local slices of a full sequence (dim 1 of (B, N, H, d); dim 2 of an LSE
    (B, H, N)), rank order. N must be a multiple of W (contiguous) or 2W (zigzag)."""
    parts = _chunks_per_rank(layout) * world_size
    if world_size < 1 or x.shape[dim] % parts:
        raise ValueError(f"sequence length {x.shape[dim]} must be a multiple of {parts} "
                         f"(world size {world_size}, layout {layout!r}): every rank must "
                         "hold the same number of rows")
    chunks = x.chunk(parts, dim)
    return [torch.cat([chunks[c] for c in rank_chunks(r, world_size, layout)], dim)
            for r in range(world_size)]


def merge_sequence(shards: Sequence[torch.Tensor], layout: str = "zigzag",
                   dim: int = 1) -> torch.Tensor:
    """The inverse of `split_sequence`: the full sequence from the W ranks' slices."""
    world_size = len(shards)
    per_rank = _chunks_per_rank(layout)
    chunks: list = [None] * (per_rank * world_size)
    for r, shard in enumerate(shards):
        for c, piece in zip(rank_chunks(r, world_size, layout), shard.chunk(per_rank, dim)):
            chunks[c] = piece
    return torch.cat(chunks, dim)


def zigzag_split(x: torch.Tensor, world_size: int, dim: int = 1) -> list[torch.Tensor]:
    """`split_sequence` in the zigzag layout: rank r gets chunks r and 2W-1-r of 2W."""
    return split_sequence(x, world_size, "zigzag", dim)


def zigzag_merge(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """`merge_sequence` in the zigzag layout."""
    return merge_sequence(shards, "zigzag", dim)


def zigzag_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """This rank's zigzag slice of a full sequence (what each rank passes to
    `ring_attention`), without building the other ranks' slices."""
    parts = 2 * world_size
    if x.shape[dim] % parts:
        raise ValueError(f"sequence length {x.shape[dim]} must be a multiple of 2 x world "
                         f"size = {parts}")
    chunks = x.chunk(parts, dim)
    return torch.cat([chunks[rank], chunks[parts - 1 - rank]], dim)


# ---------------------------------------------------------------- schedule (pure) ------

@dataclass(frozen=True)
class BlockTask:
    """What one rank computes at one step: its query rows `q_rows` (a slice of the local
    queries) against rows `kv_rows` of the K/V it holds, which belong to rank `kv_rank`;
    `causal`: with the causal mask (only where the two slices are the same rows)."""
    step: int
    kv_rank: int
    q_rows: slice
    kv_rows: slice
    causal: bool


def block_task(rank: int, world_size: int, step: int, causal: bool, layout: str,
               q_len: int, kv_len: int) -> Optional[BlockTask]:
    """The block rank `rank` computes at ring step `step` (None: nothing is visible).

    q_len / kv_len: the local numbers of query / key rows (equal under a causal mask)."""
    per_rank = _chunks_per_rank(layout)
    kv_rank = (rank - step) % world_size
    every_q, every_kv = slice(0, q_len), slice(0, kv_len)
    if not causal:
        return BlockTask(step, kv_rank, every_q, every_kv, False)
    if kv_rank == rank:                         # the diagonal: own K/V, causal
        return BlockTask(step, kv_rank, every_q, every_kv, True)
    if per_rank == 1:                           # contiguous: earlier chunks in full
        return BlockTask(step, kv_rank, every_q, every_kv, False) if kv_rank < rank else None
    half = q_len // 2
    if kv_rank < rank:          # its chunk kv_rank < r, all queries; 2W-1-kv_rank > 2W-1-r
        return BlockTask(step, kv_rank, every_q, slice(0, half), False)
    # kv_rank > r: chunk r sees neither of its chunks; chunk 2W-1-r sees both
    return BlockTask(step, kv_rank, slice(half, q_len), every_kv, False)


def task_chunk_pairs(task: BlockTask, rank: int, world_size: int, layout: str,
                     local_len: int) -> dict:
    """{(q chunk, kv chunk): "full" | "diagonal" | "masked"} for the global chunks a task
    covers (causal tasks: "masked" where the local mask hides the whole pair). For tests
    and the docs' picture."""
    per_rank = _chunks_per_rank(layout)
    chunk = local_len // per_rank
    q_chunks = rank_chunks(rank, world_size, layout)
    kv_chunks = rank_chunks(task.kv_rank, world_size, layout)
    pairs = {}
    for a, qc in enumerate(q_chunks):
        if not (task.q_rows.start <= a * chunk and (a + 1) * chunk <= task.q_rows.stop):
            continue
        for b, kc in enumerate(kv_chunks):
            if not (task.kv_rows.start <= b * chunk and (b + 1) * chunk <= task.kv_rows.stop):
                continue
            la, lb = a - task.q_rows.start // chunk, b - task.kv_rows.start // chunk
            if not task.causal or la > lb:
                pairs[(qc, kc)] = "full"
            else:
                pairs[(qc, kc)] = "diagonal" if la == lb else "masked"
    return pairs


# ---------------------------------------------------------------- merge (pure) ---------

def _merge_weights(lse_a: torch.Tensor, lse_b: torch.Tensor):
    """(w_a, w_b, lse) for `merge_partials`: the two partials' weights, which add up to 1
    (0 and 0 where both LSEs are -inf), and the merged LSE, all (B, H, N)."""
    acc = torch.promote_types(torch.promote_types(lse_a.dtype, lse_b.dtype), torch.float32)
    lse_a, lse_b = lse_a.to(acc), lse_b.to(acc)
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)      # exp(-inf) = 0
    total = w_a + w_b
    lse = top + torch.log(total)                                     # log(0) = -inf
    total = torch.where(total == 0, torch.ones_like(total), total)
    return w_a / total, w_b / total, lse


def _per_row(w: torch.Tensor) -> torch.Tensor:
    """(B, H, N) row weights as a (B, N, H, 1) view that broadcasts over an output."""
    return w.transpose(1, 2).unsqueeze(-1)


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attention partials over disjoint key sets combined into the attention over both:
    out (B, N, H, d), lse (B, H, N) each; returns fp32 (fp64 for fp64 inputs) (out, lse).

    out = (exp(lse_a) out_a + exp(lse_b) out_b) / (exp(lse_a) + exp(lse_b)), computed
    relative to the larger LSE so nothing overflows; a row with lse = -inf (it saw no key
    in that partial) gets weight 0, and a row -inf in both stays out = 0, lse = -inf."""
    w_a, w_b, lse = _merge_weights(lse_a, lse_b)
    return out_a.to(lse.dtype) * _per_row(w_a) + out_b.to(lse.dtype) * _per_row(w_b), lse


def _merge_into(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_b: torch.Tensor,
                lse_b: torch.Tensor) -> None:
    """`merge_partials` written into the fp32 accumulators (views of the running result) in
    place: no output-sized temporary, only (B, H, N) weights."""
    w_acc, w_b, lse = _merge_weights(lse_acc, lse_b)
    out_acc.mul_(_per_row(w_acc)).addcmul_(out_b, _per_row(w_b))
    lse_acc.copy_(lse)


# ---------------------------------------------------------------- packed documents (pure) -

def local_ranges(rank: int, world_size: int, layout: str, local_len: int,
                 rows: slice) -> list:
    """The global token ranges [(start, length), ...] that rows `rows` of rank `rank`'s local
    slice hold, in local order (which is global order: a rank's chunks are increasing)."""
    per_rank = _chunks_per_rank(layout)
    chunk = local_len // per_rank
    ranges = []
    for a, c in enumerate(rank_chunks(rank, world_size, layout)):
        lo, hi = max(rows.start, a * chunk), min(rows.stop, (a + 1) * chunk)
        if lo < hi:
            ranges.append((c * chunk + lo - a * chunk, hi - lo))
    return ranges


def clip_cu_seqlens(cu_seqlens: torch.Tensor, ranges) -> torch.Tensor:
    """The documents of a packed sequence (global `cu_seqlens`, D + 1 offsets) restricted to
    the tokens of `ranges` (increasing, disjoint (start, length)) laid end to end: entry b is
    how many of those tokens lie before document b's first token, so document b's piece is
    rows clipped[b] .. clipped[b + 1] - 1 (empty where the document has no token there).
    Elementwise on cu_seqlens's device, in its dtype: no host sync."""
    clipped = torch.zeros_like(cu_seqlens)
    for start, length in ranges:
        clipped += (cu_seqlens - start).clamp(0, length)
    return clipped


@dataclass(frozen=True)
class DocumentBlock:
    """A block of a packed ring as a varlen batch: one sequence per document (empty pieces
    included), clipped to the block's query rows and key rows; max_seqlen_*: python bounds
    on the pieces' lengths (the block's rows, or the longest document if smaller)."""
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


class _RankDocuments:
    """One rank's `DocumentBlock` per task, built on the device once (forward) and reused
    (backward). The schedule's blocks (either layout) need no more than clipping: off the
    diagonal every key of a block precedes every query, so a document's piece sees its keys
    in full (non-causal); on the diagonal (own K/V) the query and key rows are the same
    tokens, so a document's piece is square and the causal mask, top-left or bottom-right,
    is the document's own."""

    def __init__(self, cu_seqlens: torch.Tensor, max_seqlen: Optional[int], rank: int,
                 world_size: int, layout: str, local_len: int):
        self.cu_seqlens, self.max_seqlen = cu_seqlens, max_seqlen
        self.rank, self.world_size, self.layout = rank, world_size, layout
        self.local_len = local_len
        self.blocks: dict = {}

    def block(self, task: BlockTask) -> DocumentBlock:
        key = (task.kv_rank, task.q_rows.start, task.q_rows.stop, task.kv_rows.start,
               task.kv_rows.stop)
        if key not in self.blocks:
            sides = []
            for owner, rows in ((self.rank, task.q_rows), (task.kv_rank, task.kv_rows)):
                ranges = local_ranges(owner, self.world_size, self.layout, self.local_len,
                                      rows)
                bound = rows.stop - rows.start
                if self.max_seqlen is not None:
                    bound = min(bound, self.max_seqlen)
                sides.append((clip_cu_seqlens(self.cu_seqlens, ranges), bound))
            (cu_q, max_q), (cu_k, max_k) = sides
            self.blocks[key] = DocumentBlock(cu_q, cu_k, max_q, max_k)
        return self.blocks[key]


@dataclass(frozen=True)
class _Documents:
    """The packed documents of a ring call, before the rank is known."""
    cu_seqlens: torch.Tensor
    max_seqlen: Optional[int]

    def for_rank(self, rank: int, world_size: int, layout: str,
                 local_len: int) -> _RankDocuments:
        return _RankDocuments(self.cu_seqlens, self.max_seqlen, rank, world_size, layout,
                              local_len)


# ---------------------------------------------------------------- per-block ops --------

BlockForward = Callable[..., tuple]     # (q, k, v, causal, scale) -> (out, lse fp32 (B,H,N))
BlockBackward = Callable[..., tuple]    # (q, k, v, out, dout, lse, causal, scale) -> dq,dk,dv


def kernel_block_forward(q, k, v, causal: bool, scale: float):
    """One block on this project's forward kernel: (out, lse)."""
    from hopper_attn.api import attention
    return attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)


def kernel_block_backward(q, k, v, out, dout, lse, causal: bool, scale: float):
    """One block's (dq, dk, dv) from the backward op, given the final out and LSE."""
    return torch.ops.hopper_attn.attention_backward(q, k, v, out, dout, lse, causal, scale,
                                                    False)


# packed documents: (q, k, v (n, H, d), causal, scale, DocumentBlock) -> (out, lse fp32 (H, n))
VarlenBlockForward = Callable[..., tuple]
# (q, k, v, out, dout, lse (H, n), causal, scale, DocumentBlock) -> dq, dk, dv
VarlenBlockBackward = Callable[..., tuple]


def kernel_varlen_block_forward(q, k, v, causal: bool, scale: float, block: DocumentBlock):
    """One block of packed documents on the varlen forward kernel: (out, lse (H, n))."""
    from hopper_attn.api import attention_varlen
    return attention_varlen(q, k, v, block.cu_seqlens_q, block.cu_seqlens_k,
                            block.max_seqlen_q, block.max_seqlen_k, causal=causal,
                            softmax_scale=scale, return_lse=True)


def kernel_varlen_block_backward(q, k, v, out, dout, lse, causal: bool, scale: float,
                                 block: DocumentBlock):
    """One block's (dq, dk, dv) from the varlen backward op, given the final out and LSE."""
    return torch.ops.hopper_attn.attention_varlen_backward(
        q, k, v, out, dout, lse, block.cu_seqlens_q, block.cu_seqlens_k, block.max_seqlen_q,
        block.max_seqlen_k, causal, scale, None)


def _batch_of_one_forward(varlen_forward: VarlenBlockForward) -> BlockForward:
    """A packed block op on the programs' (1, n, H, d) views and (1, H, n) LSEs."""
    def forward(q, k, v, causal, scale, block):
        out, lse = varlen_forward(q[0], k[0], v[0], causal, scale, block)
        return out.unsqueeze(0), lse.unsqueeze(0)
    return forward


def _batch_of_one_backward(varlen_backward: VarlenBlockBackward) -> BlockBackward:
    def backward(q, k, v, out, dout, lse, causal, scale, block):
        grads = varlen_backward(q[0], k[0], v[0], out[0], dout[0], lse[0], causal, scale,
                                block)
        return tuple(g.unsqueeze(0) for g in grads)
    return backward


# ---------------------------------------------------------------- one rank's program ---

def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 accumulators for bf16/fp16/fp32 inputs (fp64 ones stay fp64: the CPU tests)."""
    return torch.promote_types(t.dtype, torch.float32)


@dataclass
class _Send:
    """Send these tensors to the next rank and receive as many (same shapes) from the
    previous one; the yield returns a handle for `_Wait`."""
    tensors: tuple


@dataclass
class _Wait:
    """Wait for a `_Send`'s receive; the yield returns the received tensors."""
    handle: object


def _forward_program(q, k, v, rank: int, world_size: int, causal: bool, scale: float,
                     layout: str, block_forward: BlockForward, documents=None):
    """One rank's forward: generator of `_Send`/`_Wait`, returns (out in q's dtype, lse).
    documents: a `_RankDocuments` (packed documents; the block ops then take the block's
    `DocumentBlock` as a last argument) or None."""
    q_len, kv_len = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape, dtype=_acc_dtype(q), device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q_len), float("-inf"), dtype=_acc_dtype(q),
                     device=q.device)
    kv = (k.contiguous(), v.contiguous())           # (what NCCL sends must be dense)
    for step in range(world_size):
        # the next K/V block travels while this one is computed
        incoming = (yield _Send(kv)) if step + 1 < world_size else None
        task = block_task(rank, world_size, step, causal, layout, q_len, kv_len)
        if task is not None:
            rows = task.q_rows
            extra = () if documents is None else (documents.block(task),)
            o, l = block_forward(q[:, rows], kv[0][:, task.kv_rows], kv[1][:, task.kv_rows],
                                 task.causal, scale, *extra)
            _merge_into(out[:, rows], lse[:, :, rows], o, l)
        if incoming is not None:
            kv = yield _Wait(incoming)
    return out.to(q.dtype), lse


def _backward_program(q, k, v, out, dout, lse, rank: int, world_size: int, causal: bool,
                      scale: float, layout: str, block_backward: BlockBackward,
                      documents=None):
    """One rank's backward: generator of `_Send`/`_Wait`, returns (dq, dk, dv) in the
    inputs' dtypes. dK/dV of the block held travel with it (fp32); they come home after
    the last step's send."""
    q_len, kv_len = q.shape[1], k.shape[1]
    dq = torch.zeros(q.shape, dtype=_acc_dtype(q), device=q.device)
    kv = (k.contiguous(), v.contiguous())
    dkv_in = None
    for step in range(world_size):
        kv_in = (yield _Send(kv)) if step + 1 < world_size else None
        task = block_task(rank, world_size, step, causal, layout, q_len, kv_len)
        part = None
        if task is not None:
            rows, kv_rows = task.q_rows, task.kv_rows
            extra = () if documents is None else (documents.block(task),)
            part = block_backward(q[:, rows], kv[0][:, kv_rows], kv[1][:, kv_rows],
                                  out[:, rows], dout[:, rows],
                                  lse[:, :, rows].contiguous(), task.causal, scale, *extra)
            dq[:, rows] += part[0]
        if step == 0:
            dk = torch.zeros(k.shape, dtype=_acc_dtype(k), device=k.device)
            dv = torch.zeros(v.shape, dtype=_acc_dtype(v), device=v.device)
        else:               # the dK/dV of this block so far (computed before waiting)
            dk, dv = yield _Wait(dkv_in)
        if part is not None:
            dk[:, kv_rows] += part[1]
            dv[:, kv_rows] += part[2]
        if world_size > 1:          # (the last step's send takes them home)
            dkv_in = yield _Send((dk, dv))
        if kv_in is not None:
            kv = yield _Wait(kv_in)
    if world_size > 1:
        dk, dv = yield _Wait(dkv_in)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------- transports -----------

class _ProcessGroupRing:
    """Sends to rank + 1 and receives from rank - 1 of `group` with batched isend/irecv,
    issued on a side CUDA stream (CUDA tensors; gloo serves CPU tensors)."""

    def __init__(self, group):
        import torch.distributed as dist
        self.dist = dist
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.world_size)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world_size)
        self.stream = None

    def post(self, tensors):
        dist = self.dist
        received = tuple(torch.empty_like(t) for t in tensors)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        if tensors[0].is_cuda:
            if self.stream is None:
                self.stream = torch.cuda.Stream(tensors[0].device)
            # the side stream starts after the producer of `tensors`
            self.stream.wait_stream(torch.cuda.current_stream(tensors[0].device))
            with torch.cuda.stream(self.stream):
                works = dist.batch_isend_irecv(ops)
        else:
            works = dist.batch_isend_irecv(ops)
        return works, received, tensors        # tensors: kept alive until the wait

    def wait(self, handle):
        works, received, _ = handle
        for work in works:
            work.wait()                        # (NCCL: the current stream waits)
        if self.stream is not None:
            torch.cuda.current_stream(received[0].device).wait_stream(self.stream)
        return received


def _drive(program, ring: _ProcessGroupRing):
    """Runs one rank's program over a real ring; returns its result."""
    reply = None
    while True:
        try:
            request = program.send(reply)
        except StopIteration as done:
            return done.value
        if isinstance(request, _Send):
            reply = ring.post(tuple(request.tensors))
        else:
            reply = ring.wait(request.handle)


def _drive_lockstep(programs: list) -> list:
    """Runs W ranks' programs in one process: a rank's k-th `_Send` is received by the next
    rank's k-th `_Wait`... exactly the pairing of the real ring (every rank posts the
    same sequence of sends). Received tensors are copies, as over a wire."""
    world_size = len(programs)
    sent: list = [[] for _ in range(world_size)]
    waiting: list = [None] * world_size         # index of the message a rank waits for
    reply: list = [None] * world_size
    results: list = [None] * world_size
    done = [False] * world_size
    while not all(done):
        moved = False
        for r, program in enumerate(programs):
            while not done[r]:
                if waiting[r] is not None:
                    from_prev = sent[(r - 1) % world_size]
                    if len(from_prev) <= waiting[r]:
                        break                   # the previous rank has not sent it yet
                    reply[r], from_prev[waiting[r]] = from_prev[waiting[r]], None
                    waiting[r] = None
                try:
                    request = program.send(reply[r])
                except StopIteration as finished:
                    results[r], done[r], moved = finished.value, True, True
                    break
                moved = True
                if isinstance(request, _Send):
                    sent[r].append(tuple(t.clone() for t in request.tensors))
                    reply[r] = len(sent[r]) - 1
                else:
                    waiting[r] = request.handle
        if not moved:
            raise RuntimeError("ring simulation deadlocked (programs out of step)")
    return results


# ---------------------------------------------------------------- checks ---------------

def _check_local(q, k, v, causal: bool, layout: str) -> None:
    _chunks_per_rank(layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, seqlen, heads, head_dim)")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)}: batch and head_dim must "
                         "agree and q's heads be a multiple of k's")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError("a causal ring needs the same local query and key rows (self-"
                         f"attention), got {q.shape[1]} queries and {k.shape[1]} keys")
    if causal and layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"the zigzag layout holds two equal chunks per rank: the local "
                         f"length must be even, got {q.shape[1]}")
    if q.shape[1] == 0 or k.shape[1] == 0:
        raise ValueError("every rank must hold at least one query and one key row")


def _resolve_scale(q, softmax_scale):
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _check_backward_kernels(q, k, causal: bool) -> None:
    """Before a forward whose result needs gradients: can the backward stage run a block?"""
    from hopper_attn.api import _check_differentiable
    _check_differentiable(q, k, k, causal, None)


# ---------------------------------------------------------------- the ring -------------

class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, layout, block_forward, block_backward,
                documents):
        ring = _ProcessGroupRing(group)
        if documents is not None:
            documents = documents.for_rank(ring.rank, ring.world_size, layout, q.shape[1])
        out, lse = _drive(_forward_program(q, k, v, ring.rank, ring.world_size, causal,
                                           scale, layout, block_forward, documents), ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.causal, ctx.scale, ctx.layout = ring, causal, scale, layout
        ctx.block_backward, ctx.documents = block_backward, documents
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        dq, dk, dv = _drive(_backward_program(q, k, v, out, dout.contiguous(), lse, ring.rank,
                                              ring.world_size, ctx.causal, ctx.scale,
                                              ctx.layout, ctx.block_backward,
                                              ctx.documents), ring)
        return dq, dk, dv, None, None, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
                   causal: bool = False, softmax_scale: Optional[float] = None,
                   layout: str = "zigzag", return_lse: bool = False,
                   block_forward: Optional[BlockForward] = None,
                   block_backward: Optional[BlockBackward] = None):
    """Attention of this rank's queries to the whole sequence's keys, over the ring `group`
    (default: the world). q, k, v: this rank's slice (B, N_local, H, d) in `layout`
    (`zigzag_shard` / `split_sequence` make them); k, v may have fewer heads (GQA). Every
    rank calls it with the same shapes. Returns this rank's output rows (and, with
    `return_lse`, their fp32 LSE (B, H, N_local), not differentiable). Differentiable.

    block_forward / block_backward: the per-block ops (default: this project's kernels;
    e.g. a pure-torch stand-in to run the ring on CPU tensors over gloo)."""
    _check_local(q, k, v, causal, layout)
    scale = _resolve_scale(q, softmax_scale)
    if block_forward is None and block_backward is None and _needs_grad(q, k, v):
        _check_backward_kernels(q, k, causal)
    out, lse = _RingAttention.apply(q, k, v, group, bool(causal), scale, layout,
                                    block_forward or kernel_block_forward,
                                    block_backward or kernel_block_backward, None)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------- simulation -----------

class _SimulatedRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, world_size, causal, scale, layout, block_forward,
                block_backward, documents):
        qs, ks, vs = (split_sequence(t, world_size, layout) for t in (q, k, v))
        ranks = [None if documents is None else
                 documents.for_rank(r, world_size, layout, qs[r].shape[1])
                 for r in range(world_size)]
        results = _drive_lockstep([
            _forward_program(qs[r], ks[r], vs[r], r, world_size, causal, scale, layout,
                             block_forward, ranks[r]) for r in range(world_size)])
        out = merge_sequence([o for o, _ in results], layout)
        lse = merge_sequence([l for _, l in results], layout, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.world_size, ctx.causal, ctx.scale, ctx.layout = world_size, causal, scale, layout
        ctx.block_backward, ctx.documents = block_backward, ranks
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        w, layout = ctx.world_size, ctx.layout
        qs, ks, vs, outs, douts = (split_sequence(t, w, layout) for t in (q, k, v, out, dout))
        lses = split_sequence(lse, w, layout, dim=2)
        results = _drive_lockstep([
            _backward_program(qs[r], ks[r], vs[r], outs[r], douts[r], lses[r], r, w,
                              ctx.causal, ctx.scale, layout, ctx.block_backward,
                              ctx.documents[r])
            for r in range(w)])
        grads = [merge_sequence([g[i] for g in results], layout) for i in range(3)]
        return (*grads, None, None, None, None, None, None, None)


def simulate_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, world_size: int,
                  causal: bool = False, *, softmax_scale: Optional[float] = None,
                  layout: str = "zigzag", return_lse: bool = False,
                  block_forward: Optional[BlockForward] = None,
                  block_backward: Optional[BlockBackward] = None):
    """`ring_attention` of W ranks run in one process on FULL sequences (B, N, H, d): the
    inputs are split in `layout`, every rank's program runs in lockstep (the same schedule,
    merge and backward code as the real ring; only the transport differs), and the ranks'
    outputs are put back in sequence order. Differentiable. N must be a multiple of 2W
    (zigzag) or W (contiguous); under a causal mask, k and v as long as q."""
    if not 1 <= int(world_size) <= 64:
        raise ValueError(f"world_size must be 1 ... 64, got {world_size}")
    per_rank = _chunks_per_rank(layout) * world_size
    for name, t in (("q", q), ("k", k)):
        if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[1] % per_rank:
            raise ValueError(f"{name}'s sequence length {t.shape[1]} must be a multiple of "
                             f"{per_rank} (world size {world_size}, layout {layout!r})")
    _check_local(q, k, v, causal, "contiguous")
    scale = _resolve_scale(q, softmax_scale)
    if block_forward is None and block_backward is None and _needs_grad(q, k, v):
        _check_backward_kernels(q, k, causal)
    out, lse = _SimulatedRing.apply(q, k, v, int(world_size), bool(causal), scale, layout,
                                    block_forward or kernel_block_forward,
                                    block_backward or kernel_block_backward, None)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------- packed documents -----

def _check_packed(q, k, v, cu_seqlens, max_seqlen, causal: bool, layout: str) -> None:
    """ValueError for a packed ring's arguments (what is visible without reading device
    memory); then the dense ring's checks on the (1, n, H, d) views."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor (tokens, heads, head_dim) of packed "
                             "documents")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"packed documents are self-attention: q and k must hold the same "
                         f"tokens, got {q.shape[0]} and {k.shape[0]} rows")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or \
            cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 or cu_seqlens.device != q.device:
        got = (f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)} on {cu_seqlens.device}"
               if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__)
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor of documents + 1 >= 2 "
                         f"offsets on {q.device}, got {got}")
    if max_seqlen is not None and (isinstance(max_seqlen, bool) or
                                   not isinstance(max_seqlen, int) or max_seqlen < 1):
        raise ValueError(f"max_seqlen must be None or a python int >= 1, got {max_seqlen!r}")
    _check_local(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), causal, layout)


def _check_varlen_backward_kernels(q, k, causal: bool) -> None:
    """Before a forward whose result needs gradients: can the varlen backward run a block?"""
    from hopper_attn.common.varlen_backward import compile_for
    compile_for(q, k, causal)              # (UnsupportedProblem, a ValueError, if not)


def ring_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cu_seqlens: torch.Tensor, max_seqlen: Optional[int] = None, *,
                          group=None, causal: bool = False,
                          softmax_scale: Optional[float] = None, layout: str = "zigzag",
                          return_lse: bool = False,
                          block_forward: Optional[VarlenBlockForward] = None,
                          block_backward: Optional[VarlenBlockBackward] = None):
    """`ring_attention` over packed documents: this rank's slice (N_local, H, d) (in
    `layout`: `zigzag_shard(x, rank, W, dim=0)`) of ONE packed sequence of N = W x N_local
    tokens whose documents are `cu_seqlens` (int32 on q's device, D + 1 global offsets, the
    same on every rank); each token attends to the tokens of its own document only (causal:
    the earlier ones). k, v: the same tokens (GQA: fewer heads). max_seqlen: a python bound
    on the longest document (None: each block's rows; it only picks the kernels' tiles).
    Returns the output rows (N_local, H, d) and, with `return_lse`, their fp32 LSE in
    varlen's layout (H, N_local). Differentiable.

    Each ring step is one varlen call with every document clipped to the block's query and
    key rows (`_RankDocuments`); the schedule, merge, transport and backward are the dense
    ring's. The caller's promise, as `attention_varlen`'s (unchecked, it would need a sync):
    cu_seqlens starts at 0, never decreases, ends at N, and no document exceeds max_seqlen.

    block_forward / block_backward: packed per-block ops (default: the varlen kernels;
    signatures `VarlenBlockForward` / `VarlenBlockBackward`)."""
    _check_packed(q, k, v, cu_seqlens, max_seqlen, causal, layout)
    scale = _resolve_scale(q, softmax_scale)
    if block_forward is None and block_backward is None and _needs_grad(q, k, v):
        _check_varlen_backward_kernels(q, k, causal)
    out, lse = _RingAttention.apply(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), group, bool(causal), scale, layout,
        _batch_of_one_forward(block_forward or kernel_varlen_block_forward),
        _batch_of_one_backward(block_backward or kernel_varlen_block_backward),
        _Documents(cu_seqlens, max_seqlen))
    return (out[0], lse[0]) if return_lse else out[0]


def simulate_ring_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cu_seqlens: torch.Tensor, world_size: int, causal: bool = False, *,
                         max_seqlen: Optional[int] = None,
                         softmax_scale: Optional[float] = None, layout: str = "zigzag",
                         return_lse: bool = False,
                         block_forward: Optional[VarlenBlockForward] = None,
                         block_backward: Optional[VarlenBlockBackward] = None):
    """`ring_attention_varlen` of W ranks in one process on the FULL packed sequence
    (N, H, d) with its documents `cu_seqlens`: split in `layout`, the ranks' programs in
    lockstep, the outputs (and LSE (H, N)) put back in token order. Differentiable. N must
    be a multiple of 2W (zigzag) or W (contiguous)."""
    if not 1 <= int(world_size) <= 64:
        raise ValueError(f"world_size must be 1 ... 64, got {world_size}")
    if isinstance(q, torch.Tensor) and q.dim() == 3 and \
            q.shape[0] % (_chunks_per_rank(layout) * world_size):
        raise ValueError(f"the packed length {q.shape[0]} must be a multiple of "
                         f"{_chunks_per_rank(layout) * world_size} (world size {world_size}, "
                         f"layout {layout!r})")
    _check_packed(q, k, v, cu_seqlens, max_seqlen, causal, "contiguous")
    scale = _resolve_scale(q, softmax_scale)
    if block_forward is None and block_backward is None and _needs_grad(q, k, v):
        _check_varlen_backward_kernels(q, k, causal)
    out, lse = _SimulatedRing.apply(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), int(world_size), bool(causal), scale,
        layout, _batch_of_one_forward(block_forward or kernel_varlen_block_forward),
        _batch_of_one_backward(block_backward or kernel_varlen_block_backward),
        _Documents(cu_seqlens, max_seqlen))
    return (out[0], lse[0]) if return_lse else out[0]
