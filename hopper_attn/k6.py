"""k6: intra-warpgroup overlap, head dims 64-256, fp16, a persistent scheduler.

What changes from k5 (docs/k6.md; the measurements behind each step in docs/lab/k6.md):

* The overlap: the softmax of tile j runs under the PV of tile j-1. k5 issued PV_{j-1} and
  S_j = Q K_j^T and waited for both before the softmax; k6 issues S_j first and PV_{j-1}
  second and waits only for the first (`wgmma.wait_group 1`):

      turn:   issue S_j = Q K_j^T; issue O += P_{j-1} V_{j-1}; pass the turn
              wait_group(1)          S_j is ready, PV_{j-1} may still run; release K_j
              mask, max, exp2, sums  -> P_j (fp32, in S_j's registers), alpha_j
              wait_group(0)          PV_{j-1} done: release V_{j-1}
              O *= alpha_j; P_j -> bf16 registers (which PV_{j-1} was reading until now)

  Nothing writes `acc_o` or the bf16 P registers while a WGMMA that reads them is in flight,
  and S_j has its own accumulator, so register use stays k5's.
* Where the PV wait sits (`pv_wait`; ptxas hoists `wait_group(0)` as far as its block
  allows): behind the back edge ("late"), pinned after the softmax by a fence ("pinned",
  "one_group": P's k16 slices also converted last first), after the tile's n-th exp2
  ("after<n>"), before the exp2s ("first"), or where ptxas puts it ("free").
* The lazy rescale (`rescale="lazy_after_wait"` at d 256, "lazy_before_pv" at d 192): O
  rescaled only where a row maximum grew by more than 2^8, after PV's wait / under the next
  QK (a per-warp vote moves the maxima; no WGMMA wait under it: docs/window.md), with P
  rounded to the input type before the row sums (l then adds what the PV GEMM multiplies).
* Head dims 96, 192 and 256 (shared memory sets the kv tile) and fp16 (from the tensors).
* A persistent grid (common/scheduler.py): one CTA per SM loops over work items (query
  tile, head, batch), its K/V rings running on from one item to the next. With a causal
  mask the producer warp takes the next item from a global counter and passes it on to the
  consumers, at some lengths head group by head group, the longest first (`longest_first`);
  without one the static schedule's last rounds may run as stream-K (`stream_k`).
* A work item's end (`item_end`, ITEM_ENDS): O staged in Q's buffer (k5's) or in its own, so
  that the next Q loads under this epilogue; Q handed back after the item's last QK; each
  consumer warpgroup storing its own rows (no barrier of all consumers at an item's end).
* Smaller steps, each a column of POLICY: `v_lags_k`, `spin_waits`, `fma_exp2_every`,
  `v_release_last` (V's stage handed back after P's conversion by a predicated arrive: no
  branch between the exp2s and the conversions), `wg_causal_limit` (each warpgroup stops at
  its own diagonal), `skip_idle_wgs`, `kv_tail` (no tail test for whole kv tiles),
  `peel_first` (an item's first kv tile before the loop), `fast_divmod`.
* Attention sinks (`sinks=1`, docs/sinks.md): per-head logits joined at an item's end.
* Logit softcapping (`softcap`, a compile-time cap; docs/softcap.md): the raw scores through
  tanh(s scale / cap) before the mask, then the same softmax in units of cap log2(e); where
  measured (bf16, d 128 / 256, cap <= 69) against a fixed 0, without row maxima; at d 128
  P converted to the PV operand once, l summed from its registers (`round_once`).
* v narrower than q and k (`head_dim_v`, POLICY's (d, dv) rows; docs/head-dim-v.md): k5's.

What stays: k5's `__call__` (k6 replaces the consumer loop, `mainloop`, and the hooks for
the schedule and an item's end), producer warpgroup, setmaxnreg split, separate K/V rings,
the last tile's PV in one more turn, the epilogue's conversion and TMA store.

Budget: tiles and turns in POLICY. SMEM = (block_m + 4 x block_n) x d x 2 bytes (+ O's own
buffer at d <= 128; + 1 KiB): at d = 256 128 x 80 fills 225 of 227 KiB. Registers per
consumer thread (fp32): S block_n / 2, P block_n / 4, O d / 2 (d = 256: 40 + 20 + 128 of 240).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
import torch
from cutlass.cute.nvgpu import warpgroup

from hopper_attn.common import tma, wgmma
from hopper_attn.common.contract import (LOG2_E, KernelSpec, Lengths, check_whole_kv_tiles,
                                         compile_attention, run_attention)
from hopper_attn.common.layouts import (acc_as_operand_a, acc_rows_cols, smem_bytes,
                                        smem_tile_layout, wg_major_o_buffer)
from hopper_attn.common.masking import TileSchedule
from hopper_attn.common.scheduler import ItemQueue, TileScheduler, sm_count
from hopper_attn.common.sinks import SinkLogits, sink_inputs, with_sinks
from hopper_attn.common.softmax import (OnlineSoftmax, scale_rows, scale_rows_below_one,
                                        softcap_scales, softcap_scores)
from hopper_attn.common.stream_k import StreamKPartials
from hopper_attn.common.warp_roles import PingPong
from hopper_attn.k5 import FIRST_SCHEDULER_BARRIER, FlashAttentionK5, lse_buffer

SPEC = KernelSpec(
    name="k6",
    summary="k5 + intra-warpgroup overlap, head dims 64-256, fp16, persistent scheduler",
    head_dims=(64, 96, 128, 192, 256),
    dtypes=(torch.bfloat16, torch.float16),
    separate_kv=True,           # GQA/MQA, seqlen_k != seqlen_q
    strided_inputs=True,        # e.g. q, k, v as views of a packed QKV tensor
    grid_per_tile=False,        # persistent: any batch x heads
    takes_work_counter=True,    # the dynamic schedule's (causal)
    window=True,                # sliding windows (compiled per window size)
    head_dim_pairs=((192, 128), (128, 64)),     # v's head dim dv != d (POLICY's (d, dv) rows)
)
SINKS_SPEC = with_sinks(SPEC)   # k6:sinks=1 (the sinks an input after out)

# item_end -> (O in a buffer of its own, Q released after the item's last QK, each warpgroup
# stores its own rows)
ITEM_ENDS = {
    "q_buffer": (False, False, False),       # k5's: O staged in Q's buffer
    "q_buffer_wg": (False, False, True),     # each warpgroup its own rows of Q's
    "own_buffer": (True, False, False),      # the next Q loads under the epilogue
    "own_buffer_wg": (True, True, True),
}
PV_WAITS = ("late", "free", "pinned", "one_group", "first")     # and "after<n>"
WG_EPILOGUE_BARRIER = 11         # + consumer warpgroup: item_end's per-warpgroup stores
RESCALES = ("eager", "lazy_after_wait", "before_pv", "lazy_before_pv")
WINDOW_MASKS = ("compare", "bits", "bits_wg_first")
# A windowed problem's masked tiles per head dim (else compares): bit masks where the H200
# measured them faster, at d = 64 without turns (WINDOW_WGS; compares spill on its 192 rows):
# gpt-oss 1.22x FA4 (docs/window.md, results/h200/2026-11-29_window_fwd_masks.json.xz)
WINDOW_MASK = {64: "bits_wg_first", 128: "bits"}
WINDOW_WGS = dict(pingpong=False, wg_causal_limit=True, pv_wait="free")


def pv_wait_after(pv_wait: str) -> int:
    """n of "after<n>" (the PV wait after a tile's n-th exp2), 0 for the other waits."""
    return int(pv_wait[5:]) if pv_wait.startswith("after") else 0


def d96_wide_tiles(seqlen: int) -> bool:
    """d = 96 without a mask: 192 x 96 tiles from 2048 queries, and from 768 where the last
    192-row query tile leaves at most one warpgroup idle (-7% at 1024, where it leaves two)."""
    return seqlen >= 2048 or (seqlen >= 768 and -seqlen % 192 <= 64)


ALL = Lengths()
# The settings every row starts from (FlashAttentionK6's arguments); a row lists what differs
BASE = dict(pingpong=False, pv_wait="late", rescale="eager", item_end="q_buffer",
            v_lags_k=True, spin_waits=False, uniform_descriptors=True, fma_exp2_every=0,
            v_release_last=False, skip_idle_wgs=False, mask_per_row=False,
            wg_causal_limit=False, fast_divmod=False, stream_k=False,
            kv_tail=True, peel_first=False, longest_first=0, round_once=False)
D64C = dict(block_m=192, mask_per_row=True, skip_idle_wgs=True, spin_waits=True,
            v_release_last=True, item_end="own_buffer_wg")        # d = 64 causal, 192 rows
D128 = dict(block_m=128, block_n=128, item_end="own_buffer_wg", spin_waits=True,
            fma_exp2_every=16)
D192 = dict(block_m=128, block_n=112, pv_wait="one_group", rescale="lazy_before_pv",
            item_end="q_buffer_wg", peel_first=True)
D256 = dict(block_m=128, block_n=80, pv_wait="one_group", rescale="lazy_after_wait",
            item_end="q_buffer_wg", v_release_last=True, peel_first=True)
EAGER_AFTER7 = dict(rescale="eager", pv_wait="after7", v_release_last=True)
H100, H200 = "results/h100/2026-11-", "results/h200/2026-11-"
# (head_dim, causal, query lengths, settings, why, results): the first row that matches.
# kv_tail="whole": no tail test where the key length is a multiple of the kv tile;
# peel_first only where the loop keeps its tail test; longest_first: MiB per head group.
POLICY = [
    (64, False, ALL, dict(block_m=192, block_n=128, pingpong=True, pv_wait="first",
                          item_end="own_buffer_wg", spin_waits=True, v_release_last=True,
                          fast_divmod=True, kv_tail="whole"),
     "PV wait before the exp2s; three WGs need V lagging + spins + uniform descriptors",
     H200 + "28_k6_pv_wait_first_*.json"),
    (64, True, Lengths(0, 768), dict(block_m=128, block_n=128, pingpong=True, pv_wait="free",
                                     item_end="own_buffer_wg", uniform_descriptors=False),
     "192 rows spill with the two-compare mask; short items gain from the item end",
     H100 + "26_k6_d64_causal_192_short*.json"),
    (64, True, Lengths(768, 4096), dict(D64C, block_n=128, pv_wait="free",
                                        wg_causal_limit=True),
     "192 rows, one key limit per row; each warpgroup stops at its own diagonal",
     H200 + "28_k6_d64_causal_*.json"),
    (64, True, Lengths(4096, 16385), dict(D64C, block_n=128, pingpong=True, pv_wait="after4",
                                          longest_first=32),
     "turns again, with the PV wait after 4 exp2s; longest items first",
     H200 + "28_k6_d64_causal_turns*.json"),
    (64, True, Lengths(16385), dict(D64C, block_n=128, pingpong=True, pv_wait="after4"),
     "as above, beyond the measured longest-first lengths",
     H200 + "28_k6_d64_causal_turns*.json"),
    (96, False, Lengths(rule=d96_wide_tiles),
     dict(block_m=192, block_n=96, pv_wait="one_group", item_end="own_buffer_wg",
          v_lags_k=False, skip_idle_wgs=True),
     "three warpgroups on 192 x 96 without turns, one PV group",
     H100 + "26_k6_d96_one_pv_group*.json"),
    (96, False, ALL, dict(block_m=128, block_n=128, pingpong=True, item_end="own_buffer_wg",
                          v_lags_k=False),
     "short items: 128 x 128 with turns, the late wait (V lagging lost 4-5%)",
     H100 + "26_k6_d96_192_short*.json"),
    (96, True, ALL, dict(block_m=128, block_n=128, item_end="own_buffer_wg", spin_waits=True,
                         fma_exp2_every=16, pv_wait="after7", v_release_last=True,
                         longest_first=8),
     "d = 128's causal row: 1.08-1.16x the turns rows at 1k-16k (H200)",
     H200 + "29_fwd_dims_d96.json.xz"),
    (128, False, Lengths(0, 8192), dict(D128, pv_wait="after7", v_release_last=True),
     "PV wait after 7 exp2s, 1 exp2 in 16 on the FMA pipe", H100 + "26_k6_pv_wait_after_*.json"),
    (128, False, ALL, dict(D128, pv_wait="after7", v_release_last=True, stream_k=True),
     "the static schedule's tail as stream-K", H100 + "26_k6_stream_k_*.json"),
    (128, True, Lengths(0, 1024), dict(D128),
     "the late wait: among the exp2s lost 4.6% at 1k", H100 + "26_k6_pv_wait_after_*.json"),
    (128, True, Lengths(1024, 2048), dict(D128, longest_first=8),
     "longest items first, 8 MiB head groups", H100 + "26_k6_decode_once_*.json"),
    (128, True, Lengths(2048, 8193), dict(D128, pv_wait="after7", v_release_last=True,
                                          longest_first=8),
     "PV wait after 7 exp2s from 2k", H100 + "26_k6_pv_wait_after_*.json"),
    (128, True, ALL, dict(D128, pv_wait="after7", v_release_last=True),
     "longest-first lost at 16k", H100 + "26_k6_longest_first_*.json"),
    (192, False, ALL, dict(D192, stream_k=True),
     "lazy rescale with O scaled under QK (no WGMMA wait under a per-warp vote: synccheck "
     "clean), stream-K at every length: 0.993-1.006x the earlier rows",
     H200 + "29_fwd_d192_before_pv.json.xz"),
    (192, True, ALL, dict(D192, spin_waits=True, wg_causal_limit=True, longest_first=32,
                          mask_per_row=True),
     "spins; each warpgroup stops at its diagonal, 32 MiB head groups longest first, one key "
     "limit per row: 1.03-1.07x spins alone at 1k-16k (H200)", H200 + "29_fwd_dims_d192.json.xz"),
    (256, False, ALL, dict(D256, kv_tail="whole"),
     "lazy rescale, one PV group; whole kv tiles drop the tail test",
     H200 + "28_k6_d256_lazy_round*.json"),
    (256, True, Lengths(0, 2048), dict(D256, spin_waits=True, wg_causal_limit=True),
     "each warpgroup stops at its own diagonal", H100 + "26_k6_wg_causal_limit*.json"),
    (256, True, Lengths(2048, 16385), dict(D256, spin_waits=True, wg_causal_limit=True,
                                           longest_first=32),
     "longest items first, 32 MiB head groups", H100 + "26_k6_causal_long_d256_peel*.json"),
    (256, True, ALL, dict(D256, spin_waits=True, wg_causal_limit=True),
     "beyond the measured longest-first lengths", H100 + "26_k6_longest_first_*.json"),
    # (d, dv), v narrower than q and k (docs/head-dim-v.md): d's rows, not tuned, no stream-K
    ((192, 128), False, ALL, dict(D192, block_n=128, **EAGER_AFTER7), "FA4's 128 x 128 tile, "
     "eager, PV wait after 7 exp2s: 1.09-1.12x d = 192's", H200 + "29_fwd_192x128.json.xz"),
    ((192, 128), True, ALL, dict(D192, spin_waits=True, wg_causal_limit=True, longest_first=32,
                                 mask_per_row=True, block_n=128, peel_first=False, **EAGER_AFTER7),
     "d = 192's causal row on that tile and loop: 1.16-1.21x it", H200 + "29_fwd_192x128.json.xz"),
    *[((128, 64), c, ALL, dict(D128, pv_wait="after7", v_release_last=True), "d = 128's",
       H100 + "26_k6_pv_wait_after_*.json") for c in (False, True)],
]


def policy(problem) -> dict:
    """The settings of POLICY's first row for the problem's head dim, mask and query length
    (a sliding window takes the causal rows)."""
    masked = problem.causal or getattr(problem, "windowed", False)
    seqlen, dims = problem.seqlen, getattr(problem, "head_dims", problem.head_dim)
    for d, causal, lengths, settings, _why, _results in POLICY:
        if d == dims and causal == masked and seqlen in lengths:
            return {**BASE, **settings}
    raise ValueError(f"k6: no policy row for d = {dims}")


class FlashAttentionK6(StreamKPartials, FlashAttentionK5):
    WG_BARRIER = WG_EPILOGUE_BARRIER     # (stream-K's flags, per-warpgroup stores)

    def __init__(self, head_dim: int, causal: bool, block_m: int, block_n: int,
                 pingpong: bool = False, pv_wait: str = "late", rescale: str = "eager",
                 item_end: str = "q_buffer", v_lags_k: bool = True, spin_waits: bool = False,
                 uniform_descriptors: bool = True, fma_exp2_every: int = 0,
                 v_release_last: bool = False, skip_idle_wgs: bool = False,
                 mask_per_row: bool = False, wg_causal_limit: bool = False,
                 fast_divmod: bool = False, stream_k: bool = False, kv_tail: bool = True,
                 peel_first: bool = False, longest_first: int = 0, softcap: float = 0.0,
                 softcap_fixed_max: bool = False, stages: int = 2, persistent_ctas: int = 0,
                 trace: bool = False, window_left: int | None = None, window_right=None,
                 head_dim_v: int = 0, window_mask: str = "compare", round_once: bool = False):
        if not (pv_wait in PV_WAITS or pv_wait_after(pv_wait) > 0) or \
                rescale not in RESCALES or item_end not in ITEM_ENDS:
            raise ValueError(f"pv_wait: one of {PV_WAITS} or after<n>; rescale: one of "
                             f"{RESCALES}; item_end: one of {tuple(ITEM_ENDS)}")
        after = pv_wait_after(pv_wait)
        # (read by smem_estimate, during k5's __init__)
        self.own_o_buffer, early_q_release, wg_store = ITEM_ENDS[item_end]
        if self.own_o_buffer and head_dim > 128:
            raise ValueError(f"item_end={item_end}: O's own buffer does not fit in shared "
                             f"memory at d > 128")
        # the PV wait (see the module doc; after<n>: OnlineSoftmax's `fence_after`)
        self.wait_pv_late = pv_wait == "late"
        self.pin_pv_wait = pv_wait in ("pinned", "one_group")
        self.reverse_p = pv_wait == "one_group"
        self.pv_wait_first = pv_wait == "first"
        self.softmax_fence_after = after if after else -1
        # with the wait among the exp2s on 192-row tiles ptxas recomputes part of P after the
        # fence: every exp2 result goes through an opaque move (OnlineSoftmax.opaque_exp2)
        self.opaque_exp2 = after > 0 and block_m == 192
        # lazy_after_wait / lazy_before_pv (module doc): O's rows scaled after the PV wait /
        # under QK, never a wait under a per-warp vote (wait_group is .sync.aligned: a
        # warpgroup's warps at one pc); (k7) before_pv: O *= alpha under QK
        self.lazy_rescale = rescale.startswith("lazy")
        self.rescale_after_pv_wait = rescale == "lazy_after_wait"
        self.rescale_threshold_log2 = 8.0
        self.rescale_before_pv = rescale.endswith("before_pv")
        if (after or self.pv_wait_first) and self.lazy_rescale:
            raise ValueError("pv_wait=after<n> / first and rescale=before_pv: eager only")
        if self.rescale_before_pv and self.wait_pv_late:
            # with the late wait ptxas then serializes every WGMMA of the kernel
            raise ValueError("rescale=before_pv needs the PV wait in the iteration")
        # v_release_last (module doc); always with the PV wait among the exp2s
        self.v_release_last = bool(v_release_last) or after > 0
        # causal: each warpgroup stops at its own rows' last kv tile (`idle_tiles` after)
        self.wg_causal_limit = bool(wg_causal_limit) and causal
        if self.wg_causal_limit and pingpong:
            raise ValueError("wg_causal_limit: without turns (pingpong=0)")
        # an item's first kv tile before the loop (its `n > 0` tests then fold away)
        self.peel_first = bool(peel_first)
        # a warpgroup whose rows all lie past the end keeps the rings and turns going only
        self.skip_idle_wgs = bool(skip_idle_wgs)
        # one key limit per row in masked tiles: the 192-row causal tile fits without spills
        self.mask_per_row = bool(mask_per_row)
        super().__init__(head_dim, causal, block_m, block_n, stages, trace, head_dim_v)
        self.early_q_release, self.wg_store = early_q_release, wg_store
        self.pingpong = PingPong(self.warpgroups, FIRST_SCHEDULER_BARRIER, on=bool(pingpong))
        # kv_tail=False: a loop without the tail test (whole kv tiles). A sliding window
        # (compile-time sides, None: unbounded): an item walks kv tiles n_block_first ..
        # n_block_count_kv - 1 (k5's loops start at n_base), masked at the window's edges
        window = (window_left, None if causal else window_right)
        windowed = window != (None, None)
        if windowed and (stream_k or not kv_tail):
            raise ValueError("k6: a sliding window needs kv_tail and no stream_k")
        self.schedule = TileSchedule(self.block_m, self.block_n, causal, bool(kv_tail), *window)
        if window_mask not in WINDOW_MASKS or (window_mask != "compare" and block_n > 128):
            raise ValueError(f"window_mask: one of {WINDOW_MASKS} (bits: kv tile <= 128)")
        self.window_mask_bits = window_mask != "compare" and windowed
        # bits_wg_first: with wg_causal_limit each warpgroup starts at its rows' first kv tile
        self.wg_window_first = self.wg_causal_limit and window_mask == "bits_wg_first"
        # the persistent grid (module doc); head groups of `longest_first` MiB of K and V
        if stream_k and causal:
            raise ValueError("stream_k: the static persistent schedule (no mask) only")
        self.stream_k = bool(stream_k)
        # (a window's items differ in length at the edges: the dynamic schedule, as causal)
        ordered = causal or windowed
        self.scheduler = TileScheduler(self.block_m, ordered, True, persistent_ctas or sm_count(),
                                       ordered, (longest_first << 20) // (head_dim * 4),
                                       bool(fast_divmod), self.stream_k, self.block_n)
        self.uniform_descriptors = bool(uniform_descriptors)
        self.spin_waits = bool(spin_waits)
        # K_{j+1} loaded before V_j (k5's order), or (False) V_j before K_{j+1}
        self.v_lags_k = bool(v_lags_k)
        # every n-th exp2 on the FMA pipe instead of the SFU (OnlineSoftmax)
        self.fma_exp2_every = int(fma_exp2_every)
        # logit softcapping, cap * tanh(s / cap) (0: none); fixed_max: exponents against 0
        self.softcap = float(softcap)
        if not math.isfinite(self.softcap) or self.softcap < 0.0:
            raise ValueError(f"softcap must be finite and >= 0 (0: none), got {softcap}")
        self.softcap_fixed_max = bool(softcap_fixed_max) and self.softcap > 0.0
        if self.softcap_fixed_max and self.rescale_before_pv:
            raise ValueError("softcap_fixed_max rescales nothing: not with rescale=before_pv")
        # a reference maximum that trails the true one (lazy) or a fixed 0: no P is surely 1,
        # so l sums the rounded P the PV GEMM multiplies (a row one key dominates gets its V)
        self.round_p_sums = self.lazy_rescale or self.softcap_fixed_max
        # round_once: P converted once; l sums the PV operand's registers (docs/softcap.md)
        if round_once not in (False, True):
            raise ValueError(f"round_once: True or False, got {round_once!r}")
        self.round_once = bool(round_once) and self.round_p_sums

    def describe(self) -> dict:
        return {**super().describe(), "v_lags_k": self.v_lags_k,
                "own_o_buffer": self.own_o_buffer}

    # ---- the persistent schedule (k5's hooks) ----
    def item_queue(self, storage, receivers: int):
        """The dynamic schedule's queue of work items from the producer warp to `receivers`
        threads (None with the static schedule, which needs none)."""
        if not self.scheduler.dynamic:
            return None
        return ItemQueue.create(storage.item_barriers.data_ptr(),
                                storage.items.get_tensor(cute.make_layout((4, 2))), receivers)

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

    # ---- the softmax and a work item's end (k5's hooks) ----
    def make_softmax(self, rows: int, scale_log2: Float32) -> OnlineSoftmax:
        prescale, scale_log2 = softcap_scales(scale_log2, self.softcap)
        return OnlineSoftmax.create(rows, scale_log2, lanes_per_row=4,
                                    fma_exp2_every=self.fma_exp2_every,
                                    fence_after=self.softmax_fence_after, softcap_prescale=prescale,
                                    opaque_exp2=self.opaque_exp2, fixed_max=self.softcap_fixed_max,
                                    round_p=self.dtype if self.round_p_sums else None,
                                    operand_sums=self.round_once)

    def o_apart_from_q(self) -> bool:
        """O staged in a buffer of its own, not in Q's (k7: always)."""
        return self.own_o_buffer

    def with_buffers(self, storage, q_layout):
        """`storage` with O's own buffer (Q's shape) where item_end has one."""
        if not self.own_o_buffer:
            return storage
        fields = dict(storage._annotations)
        fields["sO"] = cute.struct.Align[
            cute.struct.MemRange[self.dtype, cute.cosize(q_layout)], 1024]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def o_buffer(self, storage, sQ: cute.Tensor, q_layout):
        """O's own buffer or Q's (k5's: dv wide); with per-warpgroup stores as (rows, slabs):
        each warpgroup's slab of O's own buffer, or its own rows of Q's (no slabs)."""
        sQ, o_layout = super().o_buffer(storage, sQ, q_layout), self.o_layout(q_layout)
        if self.wg_store:
            return wg_major_o_buffer(storage, self.dtype, self.warpgroups, self.head_dim_v) \
                if self.o_apart_from_q() else (sQ, None)
        return storage.sO.get_tensor(o_layout.outer, swizzle=o_layout.inner) \
            if self.own_o_buffer else sQ

    def make_o_store(self, o: cute.Tensor, dtype):
        """The whole tile's TMA store, or with per-warpgroup stores one of 64 rows."""
        rows = 64 if self.wg_store else self.block_m
        return tma.make_tma_store(o, smem_tile_layout(dtype, rows, self.head_dim_v), rows,
                                  self.head_dim_v)

    @cute.jit
    def q_read(self, loads: tma.SplitKVLoads, q_state):
        """O in its own buffer: Q is free after the loop (or already, early_q_release)."""
        if cutlass.const_expr(not self.early_q_release):
            loads.release(loads.q_pipe, q_state)

    @cute.jit
    def item_epilogue(self, softmax: OnlineSoftmax, mmas, ctidx, warp, wg, acc_o: cute.Tensor,
                      o_out: cute.Tensor, mLSE: cute.Tensor, mOut: cute.Tensor, sO_buffer,
                      tma_o: cute.CopyAtom, mO: cute.Tensor, mWork: cute.Tensor, m_block, head,
                      batch, seqlen_q, k0, k1, n_count):
        """stream_k: a piece that begins an item leaves its raw state for the next CTA; one
        that ends an item merges the previous CTA's, then stores O."""
        if cutlass.const_expr(self.stream_k):
            if k1 < n_count:
                self.save_partial(mWork, ctidx, wg, acc_o, softmax)
            else:
                if k0 > 0:
                    self.merge_partial(mWork, ctidx, wg, acc_o, softmax)
                self.write_output(softmax, mmas, ctidx, warp, acc_o, o_out, mLSE, mOut,
                                  sO_buffer, tma_o, mO, m_block, head, batch, seqlen_q)
        else:
            self.write_output(softmax, mmas, ctidx, warp, acc_o, o_out, mLSE, mOut, sO_buffer,
                              tma_o, mO, m_block, head, batch, seqlen_q)

    @cute.jit
    def store_o(self, mma_pv: cute.TiledMma, ctidx, warp, o_out: cute.Tensor, sO,
                tma_o: cute.CopyAtom, mO: cute.Tensor, m_block, head, batch):
        """k5's store, or per warpgroup (`store_o_wg`)."""
        if cutlass.const_expr(self.wg_store):
            self.store_o_wg(mma_pv, ctidx, warp, o_out, sO, tma_o, mO, m_block, head, batch)
        else:
            FlashAttentionK5.store_o(self, mma_pv, ctidx, warp, o_out, sO, tma_o, mO, m_block,
                                     head, batch)

    @cute.jit
    def store_o_wg(self, mma_pv: cute.TiledMma, ctidx, warp, o_out: cute.Tensor, sO,
                   tma_o: cute.CopyAtom, mO: cute.Tensor, m_block, head, batch):
        """Each consumer warpgroup stages its own 64 rows of O (in its slab of O's buffer,
        or in its own rows of Q's at d >= 192) and its first warp stores them by TMA, on a
        barrier of the warpgroup's 128 threads: no warpgroup waits for another at an item's
        end (docs/k6.md). A slab's previous store is waited for just before it is rewritten;
        in Q's buffer the store's read is waited for at once."""
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
                cute.local_tile(sO_rows, (64, self.head_dim_v), (wg, 0))
            o_store = tma.TmaTiles.partition(tma_o, mO, head, batch, rows)
            o_store.store(m_block * self.warpgroups + wg, wait_read=not apart)

    @cute.jit
    def drain_o_store(self, warp):
        """After the last item: the last TMA store may still read sO (per-warpgroup slabs)."""
        if cutlass.const_expr(self.wg_store and self.o_apart_from_q()):
            if warp % 4 == 0:
                tma.store_read_wait()

    @cute.jit
    def probs_to_operand(self, acc_s: cute.Tensor, p_frag: cute.Tensor,
                         reverse: cutlass.Constexpr = False):
        """k5's conversion, or (reverse, pv_wait="one_group") the operand's k16 slices
        converted last first."""
        if cutlass.const_expr(reverse):
            p_view = acc_as_operand_a(acc_s)
            slices = cute.size(p_frag, mode=[2])
            for i in cutlass.range_constexpr(slices):
                k = slices - 1 - i
                p_frag[None, None, k].store(p_view[None, None, k].load().to(self.dtype))
        else:
            FlashAttentionK5.probs_to_operand(self, acc_s, p_frag)

    @cute.jit
    def mainloop(self, loads: tma.SplitKVLoads, wg, m_block, n_count, seqlen_q, seqlen_k,
                 mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, q_frag: cute.Tensor,
                 k_frag: cute.Tensor, vt_frag: cute.Tensor, p_frag: cute.Tensor,
                 acc_s: cute.Tensor, acc_o: cute.Tensor, s_coords: cute.Tensor,
                 softmax: OnlineSoftmax, k_state, v_state, n_base=0):
        if cutlass.const_expr(self.skip_idle_wgs or self.wg_causal_limit):
            n_busy = n_count
            if cutlass.const_expr(self.wg_causal_limit):
                n_busy = cutlass.min(n_count, self.schedule.n_block_count_rows(
                    m_block, (wg + 1) * 64, seqlen_q, seqlen_k, n_base))
            busy = True
            if cutlass.const_expr(self.skip_idle_wgs):
                busy = m_block * self.block_m + wg * 64 < seqlen_q
            if busy:
                n_first, n_work = n_base, n_busy
                if cutlass.const_expr(self.wg_window_first):    # from its own first tile on
                    n_skip = cutlass.min(self.schedule.n_block_first(
                        m_block, seqlen_q, seqlen_k, wg * 64) - n_base, n_busy - 1)
                    k_state, v_state = self.idle_tiles(loads, 0, n_skip, k_state, v_state)
                    n_first, n_work = n_base + n_skip, n_busy - n_skip
                k_state, v_state = self.busy_loop(
                    loads, wg, m_block, n_work, seqlen_q, seqlen_k, mma_qk, mma_pv, q_frag,
                    k_frag, vt_frag, p_frag, acc_s, acc_o, s_coords, softmax, k_state, v_state,
                    n_first)
                if cutlass.const_expr(self.wg_causal_limit):
                    k_state, v_state = self.idle_tiles(loads, n_busy, n_count, k_state, v_state)
            else:
                k_state, v_state = self.idle_loop(loads, wg, n_count, k_state, v_state)
        else:
            k_state, v_state = self.busy_loop(
                loads, wg, m_block, n_count, seqlen_q, seqlen_k, mma_qk, mma_pv, q_frag,
                k_frag, vt_frag, p_frag, acc_s, acc_o, s_coords, softmax, k_state, v_state,
                n_base)
        return k_state, v_state

    @cute.jit
    def idle_tiles(self, loads: tma.SplitKVLoads, n_first, n_count, k_state, v_state):
        """`wg_causal_limit`: kv tiles n_first .. n_count - 1, which this warpgroup's rows do
        not see, taken (waited for, so that no release runs ahead of the producer's phase)
        and handed back in the rings' order, without math."""
        for n in cutlass.range(n_first, n_count, unroll=1):
            loads.wait(loads.k_pipe, k_state)
            loads.release(loads.k_pipe, k_state)
            k_state.advance()
            loads.wait(loads.v_pipe, v_state)
            loads.release(loads.v_pipe, v_state)
            v_state.advance()
        return k_state, v_state

    @cute.jit
    def idle_loop(self, loads: tma.SplitKVLoads, wg, n_count, k_state, v_state):
        """`skip_idle_wgs`: a warpgroup without a valid query row takes (waits for, hands
        back) every K and V tile and every turn as `busy_loop` and `last_pv` do, no math."""
        pingpong = self.pingpong
        if cutlass.const_expr(self.early_q_release):
            loads.release_if(loads.q_pipe, 0, True)     # this warpgroup never reads Q
        for n in cutlass.range(n_count, unroll=1):
            loads.wait(loads.k_pipe, k_state)
            if n > 0:
                loads.wait(loads.v_pipe, v_state)       # V_{n-1}
            pingpong.sync(wg)
            pingpong.pass_turn(wg)
            loads.release(loads.k_pipe, k_state)
            k_state.advance()
            if n > 0:
                loads.release(loads.v_pipe, v_state)
                v_state.advance()
        loads.wait(loads.v_pipe, v_state)               # the last tile's V (last_pv's turn)
        pingpong.sync(wg)
        pingpong.finish(wg)
        loads.release(loads.v_pipe, v_state)
        v_state.advance()
        return k_state, v_state

    @cute.jit
    def busy_loop(self, loads: tma.SplitKVLoads, wg, m_block, n_count, seqlen_q, seqlen_k,
                  mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, q_frag: cute.Tensor,
                  k_frag: cute.Tensor, vt_frag: cute.Tensor, p_frag: cute.Tensor,
                  acc_s: cute.Tensor, acc_o: cute.Tensor, s_coords: cute.Tensor,
                  softmax: OnlineSoftmax, k_state, v_state, n_base=0):
        pingpong = self.pingpong
        o_rc = acc_rows_cols(acc_o)
        alpha = cute.make_rmem_tensor((cute.size(softmax.row_max),), Float32)

        n_first = 0
        if cutlass.const_expr(self.peel_first):
            # tile 0 before the loop, then a loop that knows n > 0 (`later`): no branch for it
            k_state, v_state = self.kv_tile(loads, wg, m_block, Int32(0), n_count, seqlen_q,
                                            seqlen_k, mma_qk, mma_pv, q_frag, k_frag, vt_frag,
                                            p_frag, acc_s, acc_o, o_rc, s_coords, softmax,
                                            alpha, k_state, v_state, n_base)
            n_first = 1
        for n in cutlass.range(n_first, n_count, unroll=1):
            k_state, v_state = self.kv_tile(
                loads, wg, m_block, n, n_count, seqlen_q, seqlen_k, mma_qk, mma_pv, q_frag,
                k_frag, vt_frag, p_frag, acc_s, acc_o, o_rc, s_coords, softmax, alpha,
                k_state, v_state, n_base, self.peel_first)
        if cutlass.const_expr(self.wait_pv_late):
            v_state = self.finish_tile(loads, n_count - 1, acc_s, o_rc, p_frag, alpha, v_state)
        if cutlass.const_expr(self.rescale_before_pv):
            self.rescale_o(o_rc, p_frag, alpha)
        v_state = self.last_pv(loads, wg, mma_pv, acc_o, p_frag, vt_frag, v_state)  # as in k5
        if cutlass.const_expr(self.round_once):
            softmax.add_operand_sums(p_frag, acc_s)     # the last tile's (every item has one)
        return k_state, v_state

    def after_first(self, n, later: bool):
        """n > 0, or True where the caller knows it (`peel_first`'s loop)."""
        return True if later else n > 0

    @cute.jit
    def kv_tile(self, loads: tma.SplitKVLoads, wg, m_block, n, n_count, seqlen_q, seqlen_k,
                mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, q_frag: cute.Tensor,
                k_frag: cute.Tensor, vt_frag: cute.Tensor, p_frag: cute.Tensor,
                acc_s: cute.Tensor, acc_o: cute.Tensor, o_rc: cute.Tensor, s_coords: cute.Tensor,
                softmax: OnlineSoftmax, alpha: cute.Tensor, k_state, v_state, n_base=0,
                later: cutlass.Constexpr = False):
        """Tile n of a work item (kv tile n_base + n; later: n > 0 is known): S_n and PV_{n-1}
        in this warpgroup's turn, S_n's softmax under PV_{n-1}, then (late wait: at the next
        tile's top) tile n's end (`finish_tile`)."""
        pingpong = self.pingpong
        if cutlass.const_expr(self.wait_pv_late):
            if self.after_first(n, later):      # tile n-1's end, after the back edge
                v_state = self.finish_tile(loads, n - 1, acc_s, o_rc, p_frag, alpha,
                                           v_state, self.reverse_p)
        if cutlass.const_expr(self.round_once):
            if self.after_first(n, later):      # P_{n-1}'s row sums, before the K wait
                softmax.add_operand_sums(p_frag, acc_s)
        phase = self.trace.start("wait_kv")
        loads.wait(loads.k_pipe, k_state)
        if cutlass.const_expr(not self.v_lags_k):
            if self.after_first(n, later):
                loads.wait(loads.v_pipe, v_state)
        self.trace.end(phase)
        phase = self.trace.start("wait_turn")
        pingpong.sync(wg)                               # --- this WG's turn
        self.trace.end(phase)
        phase = self.trace.start("qk")
        wgmma.gemm(mma_qk, acc_s, q_frag, k_frag[None, None, None, k_state.index],
                   zero_init=True)                      # S = Q K_n^T, first in the queue
        if self.after_first(n, later):          # O += P_{n-1} V_{n-1}, behind it
            if cutlass.const_expr(self.rescale_before_pv):
                # (QK_n alone in flight: free; it shows ptxas that no PV still writes O, so it
                # adds no wait of its own for QK before the multiplies)
                warpgroup.wait_group(1)
                self.rescale_o(o_rc, p_frag, alpha)     # O *= alpha_{n-1}, under QK_n
            if cutlass.const_expr(self.v_lags_k):       # V_{n-1} was loaded after K_n
                loads.wait(loads.v_pipe, v_state)
            self.issue_pv(mma_pv, acc_o, p_frag, vt_frag, v_state)
        pingpong.pass_turn(wg)                          # --- the next WG may issue now
        if self.after_first(n, later):
            warpgroup.wait_group(1)                     # S_n done; PV_{n-1} may still run
        else:
            warpgroup.wait_group(0)
        loads.release(loads.k_pipe, k_state)            # K_n read: its stage is free
        k_state.advance()
        if cutlass.const_expr(self.early_q_release):
            # Q's one stage, after the item's last QK (the kernel then only advances its state)
            loads.release_if(loads.q_pipe, 0, n == n_count - 1)
        self.trace.end(phase)
        # --- under PV_{n-1}: everything of the softmax that touches neither O nor P
        phase = self.trace.start("softmax")
        self.scores_to_probs_k6(acc_s, o_rc, s_coords, softmax, alpha, m_block, n_base + n,
                                seqlen_q, seqlen_k)             # S -> P, in place
        self.trace.end(phase)
        if cutlass.const_expr(not self.wait_pv_late):
            v_state = self.finish_tile(loads, n, acc_s, o_rc, p_frag, alpha, v_state,
                                       self.reverse_p, later)
        return k_state, v_state

    @cute.jit
    def scores_to_probs_k6(self, acc_s: cute.Tensor, o_rc: cute.Tensor, s_coords: cute.Tensor,
                           softmax: OnlineSoftmax, alpha: cute.Tensor, m_block, n, seqlen_q,
                           seqlen_k):
        """(softcap: tanh first), mask, then the online-softmax step. Eager: alpha goes to
        `finish_tile`, which rescales O (the PV wait among or before the exp2s: every row's
        maximum and alpha first). Lazy: the reference maxima moved here, only where a row
        maximum of this warp grew by more than 2^rescale_threshold_log2, O's rows scaled by
        `finish_tile` (lazy_after_wait) or under the next QK (lazy_before_pv)."""
        if cutlass.const_expr(self.softcap > 0.0):
            softcap_scores(acc_rows_cols(acc_s), softmax.softcap_prescale)
        if cutlass.const_expr(self.softcap_fixed_max):
            # exponents against the fixed 0: alpha is never used (no rescale)
            softmax.exponentiate(self.masked_scores(acc_s, s_coords, m_block, n, seqlen_q,
                                                    seqlen_k))
        elif cutlass.const_expr(self.softmax_fence_after >= 0 or self.pv_wait_first):
            s_rc = self.masked_scores(acc_s, s_coords, m_block, n, seqlen_q, seqlen_k)
            alpha.store(softmax.rebase(softmax.running_max(s_rc)).load())
            if cutlass.const_expr(self.pv_wait_first):
                warpgroup.wait_group(0)                 # PV_{n-1} done, after the maxima
                cute.arch.fence_acq_rel_cta()           # and before any exp2
            softmax.exponentiate(s_rc)
        elif cutlass.const_expr(not self.lazy_rescale):
            alpha.store(self.scores_to_probs(acc_s, s_coords, softmax, m_block, n, seqlen_q,
                                             seqlen_k).load())
        else:
            s_rc = self.masked_scores(acc_s, s_coords, m_block, n, seqlen_q, seqlen_k)
            softmax.rebase_if_grown(softmax.running_max(s_rc), self.rescale_threshold_log2,
                                    alpha)
            softmax.exponentiate(s_rc)

    def smem_estimate(self, head_dim: int, block_m: int, block_n: int, stages: int) -> int:
        o_bytes = smem_bytes(block_m * head_dim * 2) if self.own_o_buffer else 0
        return super().smem_estimate(head_dim, block_m, block_n, stages) + o_bytes

    @cute.jit
    def rescale_o(self, o_rc: cute.Tensor, p_frag, alpha: cute.Tensor):
        """O *= alpha per row (lazy: where a row of the warp has alpha < 1)."""
        (scale_rows_below_one if self.lazy_rescale else scale_rows)(o_rc, alpha)

    @cute.jit
    def finish_tile(self, loads: tma.SplitKVLoads, n, acc_s: cute.Tensor, o_rc: cute.Tensor,
                    p_frag: cute.Tensor, alpha: cute.Tensor, v_state,
                    reverse_p: cutlass.Constexpr = False, later: cutlass.Constexpr = False):
        """Tile n's end: wait for PV_{n-1}, release V_{n-1}, rescale O (eager), P_n -> the
        PV operand registers (which PV_{n-1} was reading until now)."""
        phase = self.trace.start("wait_pv")
        if cutlass.const_expr(self.pin_pv_wait):
            cute.arch.fence_acq_rel_cta()               # ptxas keeps the wait below this
        warpgroup.wait_group(0)                         # PV_{n-1} done: O and P are free
        if cutlass.const_expr(not self.v_release_last):
            if self.after_first(n, later):
                loads.release(loads.v_pipe, v_state)    # V_{n-1} read: its stage is free
                v_state.advance()
        self.trace.end(phase)
        phase = self.trace.start("rescale")
        if cutlass.const_expr(not self.lazy_rescale and not self.rescale_before_pv
                              and not self.softcap_fixed_max):
            self.rescale_o(o_rc, p_frag, alpha)
        self.probs_to_operand(acc_s, p_frag, reverse_p)
        if cutlass.const_expr(self.v_release_last):
            # tile 0 has no V_{n-1}: a predicated arrive instead of an `if`, so nothing here
            # ends the block that holds the exp2s and P's conversions
            loads.release_if(loads.v_pipe, v_state.index, self.after_first(n, later))
            if self.after_first(n, later):
                v_state.advance()
        if cutlass.const_expr(self.rescale_after_pv_wait):
            scale_rows_below_one(o_rc, alpha)           # the lazy rescale's O, if any
        self.trace.end(phase)
        return v_state


# what a caller may set (`k6:name=value`) over the POLICY row: the user features (softcap) and
# steps some row turns on; BASE's other columns (spin_waits, stream_k, ...) are POLICY's
OPTIONS = ("tile", "pingpong", "pv_wait", "rescale", "item_end", "v_lags_k", "fma_exp2_every",
           "v_release_last", "skip_idle_wgs", "wg_causal_limit", "kv_tail", "peel_first",
           "longest_first", "softcap")
# softcapped exponents against a fixed 0 (no row maxima, no O rescale) where the H200 measured
# them faster and correct: bf16, cap log2(e) <= 100, d 128 and 256 (docs/softcap.md); at d 128
# with round_once (cap 50: 0.97x the time causal at 16k, 0.87x at 4k; d 192 / 256 measured
# 0.996-1.05x: off; results/h200/2026-11-29_round_once.json)
SOFTCAP_FIXED_MAX_DIMS = (128, 256)


def settings_for(problem, window_mask: str = "", **overrides) -> dict:
    """FlashAttentionK6's settings for `problem`: its POLICY row, then `overrides` (None:
    the row's), resolved: kv_tail="whole" and peel_first as POLICY's comment says, softcap's
    fixed 0. window_mask: WINDOW_MASK's choice for this call ("": WINDOW_MASK's)."""
    unknown = sorted(set(overrides) - set(OPTIONS))
    if unknown:
        raise ValueError(f"k6: unknown options {unknown}; known: {', '.join(OPTIONS)}")
    mask = window_mask or WINDOW_MASK.get(getattr(problem, "head_dims", problem.head_dim),
                                          "compare")
    windowed = getattr(problem, "windowed", False)
    own_wgs = WINDOW_WGS if windowed and mask == "bits_wg_first" else {}
    settings = {**policy(problem), **own_wgs,
                **{k: v for k, v in overrides.items() if v is not None}}
    tile = settings.pop("tile", None)              # "192x96" (block_m x block_n)
    if tile is not None:
        settings["block_m"], settings["block_n"] = (int(x) for x in str(tile).split("x"))
    if windowed:
        # the causal row's settings; a window's item starts at kv tile n_block_first, which
        # stream-K's pieces (every item from tile 0, no mask) do not know; the tail test stays
        settings.update(window_left=problem.window_left, window_right=problem.window_right,
                        stream_k=False, kv_tail=True, window_mask=mask)
        if settings["rescale"].startswith("lazy"):      # (what windows measured at d = 192;
            settings["rescale"] = "lazy_after_wait"     # docs/window.md)
    if settings["kv_tail"] == "whole":
        settings["kv_tail"] = problem.causal or problem.kv_seqlen % settings["block_n"] != 0
    settings["kv_tail"] = bool(settings["kv_tail"])
    if not settings["kv_tail"]:
        check_whole_kv_tiles("k6", problem, settings["block_n"])
    settings["peel_first"] = settings["peel_first"] and settings["kv_tail"]
    cap = float(settings.get("softcap", 0.0))
    if 0.0 < cap * LOG2_E <= 100.0 and problem.dtype == torch.bfloat16 and \
            problem.head_dim in SOFTCAP_FIXED_MAX_DIMS and "before_pv" not in settings["rescale"]:
        settings["softcap_fixed_max"] = True
        settings["round_once"] = problem.head_dim == 128
    return settings


def compile_kernel(problem, *, compile_options: str = "", trace: bool = False, sinks: int = 0,
                   window_mask: str = "", **overrides):
    """Compile (or fetch from the cache) k6 with POLICY's settings for the problem's head
    dim, mask and query length, any of OPTIONS overridden (docs/k6.md): tile ("192x96":
    block_m x block_n), kv_tail (0: no tail test; "whole": 0 for whole kv tiles),
    longest_first (MiB of K and V per head group), softcap (compile-time cap; 0: none), the
    others FlashAttentionK6's. trace: iket phase ranges (harness/timeline.py); sinks: 1 for
    attention sinks, a runtime (heads,) fp32 input after `out`; window_mask: settings_for's."""
    SPEC.check(problem)                 # UnsupportedProblem before POLICY's lookup
    settings = {**settings_for(problem, window_mask, **overrides), "trace": bool(trace)}
    return compile_attention(SINKS_SPEC if sinks else SPEC,
                             FlashAttentionK6Sinks if sinks else FlashAttentionK6, problem,
                             {**settings, "sinks": True} if sinks else settings,
                             workspace_fn=lse_buffer, compile_options=compile_options)


class FlashAttentionK6Sinks(SinkLogits, FlashAttentionK6):
    """k6 with attention sinks: the (heads,) logits after `out`, joined at an item's end."""


def run_kernel(handle, q, k, v, out, sinks=None):
    run_attention(handle, q, k, v, out, extra_inputs=sink_inputs(handle, sinks))
