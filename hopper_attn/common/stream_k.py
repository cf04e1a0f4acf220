"""Stream-K's partial work items (k6's `stream_k`, common/scheduler.py `TileScheduler.piece`):
an item split across two neighbouring CTAs, the first piece's raw softmax state handed to the
second through a workspace in global memory (the kernel's counter argument) and merged there.

A mixin for a forward kernel class with `head_dim`, `warpgroups`, `roles`, `scheduler`,
`stream_k` and `WG_BARRIER` (the first of one named barrier per consumer warpgroup).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32

from hopper_attn.common.layouts import acc_rows_cols
from hopper_attn.common.softmax import OnlineSoftmax


class StreamKPartials:
    # The workspace (the kernel's counter argument): int32 words [0, 4) unused, then a flag
    # per slot and consumer warpgroup, then per slot the raw state of each consumer thread
    # (O's fp32 fragment, row maxima, per-thread row sums) as fp32, element-major so that
    # the threads of a warp touch consecutive words. Slot c: the item split between CTAs
    # c - 1 and c.
    STREAM_K_FLAGS = 4
    STREAM_K_SLOTS = 1024

    def stream_k_floats(self) -> int:
        """fp32 values one consumer thread leaves: O's 64 x d / 128, two row maxima and sums."""
        return self.head_dim // 2 + 4

    def stream_k_words(self) -> int:
        """The workspace's size in int32 words (0 without stream_k)."""
        if not self.stream_k:
            return 0
        slots = self.scheduler.ctas + 1                 # slot c: between CTAs c - 1 and c
        if slots > self.STREAM_K_SLOTS:
            raise ValueError(f"stream_k: at most {self.STREAM_K_SLOTS - 1} persistent CTAs")
        return (self.STREAM_K_FLAGS + self.STREAM_K_SLOTS * self.warpgroups
                + slots * self.stream_k_floats() * self.roles.consumer_threads)

    @cute.jit
    def partial_state(self, mWork: cute.Tensor, slot, ctidx, acc_o: cute.Tensor):
        """The workspace as fp32, the index of this consumer thread's first value in `slot`
        (then O's values row by row, the row maxima, the row sums, each `stride` apart: the
        consumer threads interleaved, so that a warp's accesses are contiguous), and O as
        [row, col]."""
        data = cute.recast_tensor(mWork, Float32)
        o_rc = acc_rows_cols(acc_o)
        stride = self.roles.consumer_threads
        base = self.STREAM_K_FLAGS + self.STREAM_K_SLOTS * self.warpgroups
        at = base + slot * self.stream_k_floats() * stride + ctidx
        return data, o_rc, stride, at

    @cute.jit
    def save_partial(self, mWork: cute.Tensor, ctidx, wg, acc_o: cute.Tensor,
                     softmax: OnlineSoftmax):
        """A piece that begins an item: this thread's raw state to slot (CTA + 1), then, once
        the warpgroup's 128 threads have written theirs, the slot's flag (release)."""
        cta, _, _ = cute.arch.block_idx()
        slot = Int32(cta) + 1
        data, o_rc, stride, at = self.partial_state(mWork, slot, ctidx, acc_o)
        rows, cols = cute.size(o_rc, mode=[0]), cute.size(o_rc, mode=[1])
        for r in cutlass.range_constexpr(rows):
            for c in cutlass.range_constexpr(cols):
                data[at + (r * cols + c) * stride] = o_rc[r, c]
            data[at + (rows * cols + r) * stride] = softmax.row_max[r]
            data[at + (rows * cols + rows + r) * stride] = softmax.row_sum[r]
        cute.arch.fence_acq_rel_gpu()
        pipeline.NamedBarrier(barrier_id=self.WG_BARRIER + wg,
                              num_threads=128).arrive_and_wait()
        if ctidx % 128 == 0:
            cute.arch.store(mWork.iterator + self.STREAM_K_FLAGS + slot * self.warpgroups + wg,
                            Int32(1), sem="release", scope="gpu")

    @cute.jit
    def merge_partial(self, mWork: cute.Tensor, ctidx, wg, acc_o: cute.Tensor,
                      softmax: OnlineSoftmax):
        """A piece that ends an item: wait for slot CTA's flag (acquire; the previous CTA
        wrote it about an item and a half earlier), reset it for the next launch, and merge
        the other piece's state into this one's: m = max, each side scaled by
        2^(m_side - m), O and the row sums added."""
        cta, _, _ = cute.arch.block_idx()
        slot = Int32(cta)
        if ctidx % 128 == 0:
            flag = mWork.iterator + self.STREAM_K_FLAGS + slot * self.warpgroups + wg
            ready = Int32(0)
            while ready == 0:
                ready = cute.arch.load(flag, Int32, sem="acquire", scope="gpu")
            cute.arch.store(flag, Int32(0))
        pipeline.NamedBarrier(barrier_id=self.WG_BARRIER + wg,
                              num_threads=128).arrive_and_wait()
        data, o_rc, stride, at = self.partial_state(mWork, slot, ctidx, acc_o)
        rows, cols = cute.size(o_rc, mode=[0]), cute.size(o_rc, mode=[1])
        for r in cutlass.range_constexpr(rows):
            a_own, a_other = softmax.merge_row(r, data[at + (rows * cols + r) * stride],
                                               data[at + (rows * cols + rows + r) * stride])
            for c in cutlass.range_constexpr(cols):
                o_rc[r, c] = o_rc[r, c] * a_own + data[at + (r * cols + c) * stride] * a_other
