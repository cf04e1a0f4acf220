"""The e4m3 kv-cache decode's consumer loop in two more orders: compile-time A/B variants of
decode.py's k5 order (docs/kvcache.md, "Why the loaders and the consumers take turns").

With an e4m3 cache one consumer warpgroup does all of a CTA's (and SM's) math, and k5's
order runs it in series: issue PV_{j-1} and S_j, wait for both (~520 cycles of fp16 tensor
work a 64-key tile at d 128), then the softmax of tile j (~440 issue cycles: 34 MUFU.EX2 at
8 cycles, maxima, sums, O's rescale), the tensor cores idle meanwhile. ~1,150 cycles a tile
before the loaders take any issue slot, against ~790 for 16 KiB of e4m3 at the HBM's rate.

* "overlap" (k6's order): S_j first, PV_{j-1} behind it; wait for S_j only and release K_j,
  run the softmax of tile j under PV_{j-1}, then wait for PV_{j-1}, release V_{j-1}, rescale
  O and turn P_j into the operand registers (which PV_{j-1} read until then). The same
  arithmetic in the same order as k5's: the same bits.
* "ahead": S_{j+1} issued before the softmax of tile j, into a second S accumulator (32
  registers more), and PV_j as soon as P_j is in its registers (after O's rescale): PV_{j-1}
  and S_{j+1} run under the softmax of tile j, PV_j under the move of S_{j+1} into place
  and the next tile's waits. Only `wait_group(0)`: ptxas cannot tell which group a
  `wait_group(1)` retires across the loop's back edge, and where it cannot it serializes
  every WGMMA (C7514; a "pipe" order that waited for PV_{j-1} alone, S_{j+1} still in
  flight, did). The consumers hold K_{j+1} a tile earlier, so the loaders must widen a tile
  further ahead: with two 16-bit stages they would widen K_{j+1} only after V_j, which
  waits for V_{j-2}'s release in tile j-1: use three (`wide_stages`). The same bits too.

A mixin of decode.DecodeAttention: `self` brings `tile_probs` (mask and softmax of a tile)
and `mma_dtype`.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

from hopper_attn.common import tma, wgmma
from hopper_attn.common.layouts import acc_as_operand_a, acc_rows_cols
from hopper_attn.common.softmax import scale_rows

ORDERS = ("k5", "overlap", "ahead")


class DecodeOrders:
    @cute.jit
    def overlapped_tiles(self, mmas, acc_s: cute.Tensor, acc_o: cute.Tensor, k_ring, v_ring,
                         k_state, v_state, n_first, n_count, softmax, s_coords,
                         limits, lows, keys_all, low_all):
        """Tiles n_first .. + n_count in k6's order; leaves P_{n-1} in the operand
        registers and V_{n-1} to the caller's last PV (as k5's loop does)."""
        o_rc = acc_rows_cols(acc_o)
        for j in cutlass.range(n_count, unroll=1):
            k_ring.consumer_wait(k_state)
            wgmma.gemm(mmas.mma_qk, acc_s, mmas.q_frag,
                       mmas.k_frag[None, None, None, k_state.index], zero_init=True)
            if j > 0:                                   # O += P_{j-1} V_{j-1}, behind S_j
                v_ring.consumer_wait(v_state)
                wgmma.gemm(mmas.mma_pv, acc_o, mmas.p_frag,
                           mmas.vt_frag[None, None, None, v_state.index], zero_init=False)
                warpgroup.wait_group(1)                 # S_j done; PV_{j-1} may still run
            else:
                warpgroup.wait_group(0)
            tma.release_stage(k_ring, k_state)
            k_state.advance()
            alpha = self.tile_probs(acc_s, n_first + j, softmax, s_coords, limits, lows,
                                    keys_all, low_all)
            # (ptxas hoists a WGMMA wait as far up as nothing stops it: the fence keeps it
            # below the softmax)
            cute.arch.fence_acq_rel_cta()
            warpgroup.wait_group(0)                     # PV_{j-1} done: O and P are free
            if j > 0:
                tma.release_stage(v_ring, v_state)
                v_state.advance()
            scale_rows(o_rc, alpha)
            mmas.p_frag.store(acc_as_operand_a(acc_s).load().to(self.mma_dtype))
        return k_state, v_state

    @cute.jit
    def ahead_tiles(self, mmas, acc_s: cute.Tensor, acc_o: cute.Tensor, k_ring, v_ring,
                    k_state, v_state, n_first, n_count, softmax, s_coords,
                    limits, lows, keys_all, low_all):
        """Tiles n_first .. + n_count with S_{j+1} and PV_{j-1} in flight under the softmax
        of tile j; the same hand-over to the caller's last PV (P_{n-1}, V_{n-1})."""
        o_rc = acc_rows_cols(acc_o)
        acc_next = cute.make_rmem_tensor_like(acc_s)
        if n_count > 0:                                 # S_0 alone
            k_ring.consumer_wait(k_state)
            wgmma.gemm(mmas.mma_qk, acc_s, mmas.q_frag,
                       mmas.k_frag[None, None, None, k_state.index], zero_init=True)
            warpgroup.wait_group(0)
            tma.release_stage(k_ring, k_state)
            k_state.advance()
        # at the top of tile j: S_j in acc_s, PV_{j-1} in flight (j > 0)
        for j in cutlass.range(n_count, unroll=1):
            if j + 1 < n_count:                         # S_{j+1}, behind PV_{j-1}
                k_ring.consumer_wait(k_state)
                wgmma.gemm(mmas.mma_qk, acc_next, mmas.q_frag,
                           mmas.k_frag[None, None, None, k_state.index], zero_init=True)
            alpha = self.tile_probs(acc_s, n_first + j, softmax, s_coords, limits, lows,
                                    keys_all, low_all)
            cute.arch.fence_acq_rel_cta()               # (the wait stays below the softmax)
            warpgroup.wait_group(0)                     # PV_{j-1} and S_{j+1} done
            if j > 0:
                tma.release_stage(v_ring, v_state)
                v_state.advance()
            scale_rows(o_rc, alpha)
            mmas.p_frag.store(acc_as_operand_a(acc_s).load().to(self.mma_dtype))
            if j + 1 < n_count:
                tma.release_stage(k_ring, k_state)
                k_state.advance()
                v_ring.consumer_wait(v_state)           # O += P_j V_j, now
                wgmma.gemm(mmas.mma_pv, acc_o, mmas.p_frag,
                           mmas.vt_frag[None, None, None, v_state.index], zero_init=False)
                acc_s.store(acc_next.load())            # (under PV_j)
        return k_state, v_state
