"""k6: intra-warpgroup overlap, head dims 64-256, fp16, a persistent scheduler.

First step, the overlap: the softmax of tile j under the PV of tile j-1. What changes from
k5: only the order inside a consumer warpgroup's turn and what it waits
for (`mainloop`, below). k5 issued O += P_{j-1} V_{j-1} and S_j = Q K_j^T, then waited for
*both* before starting the softmax of tile j, so during its softmax a warpgroup had nothing
on the tensor cores; only the *other* warpgroup's GEMMs could run (ping-pong), and they are
shorter than a softmax (docs/k5.md). k6 issues S_j first and PV_{j-1} second, and waits
only for the first (`wgmma.wait_group 1`): the row max, the exp2s and the row sums of tile j
run while PV_{j-1} is still on the tensor cores.

    turn:   issue S_j = Q K_j^T; issue O += P_{j-1} V_{j-1}; pass the turn
            wait_group(1)          S_j is ready, PV_{j-1} may still run; release K_j
            mask, max, exp2, sums  -> P_j (fp32, in S_j's registers), alpha_j
            wait_group(0)          PV_{j-1} done: release V_{j-1}
            O *= alpha_j; P_j -> bf16 registers (which PV_{j-1} was reading until now)

Two rules make the overlap safe without extra registers: nothing writes `acc_o` or the bf16
P registers while a WGMMA that reads or accumulates them is in flight (so the O rescale and
the P conversion wait for `wait_group(0)`), and S_j has its own accumulator (as in k5).
Register use is therefore k5's: S 64 + P 32 + O 64 fp32 per thread at d = 128.

Where the wait_group(0) and what follows it (`finish_tile`) sit in the code matters: ptxas
schedules the wait as early as its basic block allows, so written right after the softmax
it lands *before* the softmax, and PV_{j-1} is waited for first after all. k6 therefore
runs tile j's end at the top of iteration j+1, behind the loop's back edge, where it cannot
move up (`wait_pv_late`, the default at d = 96 and, with a memory fence in front,
`pin_pv_wait`, was at d >= 192: +4-5% at d = 192, measured; docs/k6.md "What the SASS says";
d = 128, 192 and 256 have since moved the wait back into the iteration: the seventh and
eighth steps below). The
option `lazy_rescale` also skips the O rescale unless a row maximum grew by more than 2^8
(the default at d = 192 and 256, with P's row sums rounded: the eleventh step
below); the option `exp_first` does so with the exp2s started
before the tile's row maxima are known (d = 64 +2-5%, with the same accuracy cost; docs/k6.md
"The exp2s before the row maximum").

What stays: everything else of k5 (producer warpgroup, setmaxnreg, separate K/V rings,
the ping-pong turn per tile (measured since: kept at d = 64 without a mask, with one from 4k
queries, and on d = 96's 128-row tiles only, see TILES and compile_kernel), the last tile's
PV in one more turn, the epilogue, tiles and budgets), except at d = 64 causal, where
192 x 128 with three 160-register consumer warpgroups spills (P now stays live under the
softmax) and k6 uses 128 x 128 with two, or, for queries of 2,048 and more, 192 x 128 with
the masked tile's one key limit per row, which fits (docs/k6.md).

Second step: head dims 96, 192 and 256 (tiles in TILES, below: shared memory sets the kv
tile; d = 96 without a mask at N >= 2048: three consumer warpgroups on 192 x 96) and fp16
(the element type comes from the tensors).

Third step: a persistent grid (common/scheduler.py): one CTA per SM loops over work items
(query tile, head, batch), its K/V rings running on from one to the next and the next K
tile loading while the previous output is stored; any batch x heads. Full attention: CTA c
takes items c, c + grid, ... With a causal mask (items of different lengths, the longest
first) the producer warp of a CTA takes its next item from a global counter (one atomicAdd)
and passes it to its consumer warpgroups through shared memory, so items go to whichever
CTA is free first: docs/k6.md. At the lengths where it measured faster (LONGEST_FIRST) the
items come head group by head group, the longest query tile of every head of a group first,
instead of head by head (`longest_first`, docs/k6.md "Longest first, by head group").

Fourth step, two waits outside the GEMMs (LOAD_ORDER, below): the producer loads K_{j+1}
before V_j (FlashAttention-4's order, `v_lags_k`), so a K tile no longer queues behind a V
stage that frees a tile later; and O is staged in a buffer of its own (`own_o_buffer`, d <=
128: Q's 16-32 KiB more SMEM), so the next work item's Q loads under this one's epilogue.
+1.7-7.4% at d = 128, measured round-robin (docs/k6.md).

Fifth step, the waits themselves (common/tma.py): a consumer warp hands a stage back from an
elected lane (the library's lane-0 test made ptxas re-read the thread index before every
release), and at d = 128 the ring waits spin on `mbarrier.try_wait` instead of sleeping
between tries: +2.1-2.5% at d = 128, measured round-robin (docs/k6.md "Waits and releases").
Spinning pays elsewhere only together with V lagging behind K (whose wait then sits inside the
turn): at d = 64 on 192-row tiles with uniform-register descriptors as well, +2-3%, and at
d = 192 / 256 with a mask, +1-2%, where each setting alone lost (docs/k6.md "Three settings
that pay only together").
At d = 128 one exp2 in 16 is computed on the FMA pipe (a cubic, `exp2_on_fma`) instead of the
SFU: +0.8-1.4% without a mask (docs/k6.md "What each part of the softmax costs").

Sixth step, one branch less: a tile hands V_{n-1}'s stage back after P's conversion, with
one predicated arrive (none for the first tile, which has no V_{n-1}) instead of an `if`,
so no branch splits the exp2s from P's conversions; ptxas then spreads the conversions among
the exp2s as in FlashAttention-4's loop (`v_release_last`, V_RELEASE_LAST): +1.6-2.5% at
d = 64 without a mask, +0-1.1% at d = 128 without one and at d = 256 (docs/k6.md "One branch
less").

Seventh step, the PV wait among the exp2s (d = 128, PV_WAIT_AFTER): the wait back in the same
iteration, held below the tile's 7th exp2 by a memory fence (ptxas would hoist it to the row
maxima), with every row's maximum and alpha computed first, so O's multiplies and P's
conversions fill the gaps between the remaining exp2s, as in FlashAttention-4's loop, instead
of running one after the other at the loop's top: +1.9-4.5% without a mask, +3.9-5.1% with one
from N = 2k (docs/k6.md "The PV wait among the exp2s").

Eighth step, one PV group at d = 192 and 256, later 96 (PINNED_IN_ITERATION): with kv tiles
of 112 and 80 keys ptxas issued the loop's PV as one WGMMA group per k16 slice of P, so the softmax
overlapped only PV's last slice; P's slices converted last first (`reverse_p`) keep PV one
group when its wait is in the iteration, here after the softmax, pinned by a fence: +3.4-5.5%
at d = 192, up to +3% at d = 256 (docs/k6.md "One WGMMA group per P slice").

Ninth step, the schedule's edges: with a causal mask each consumer warpgroup stops at the
last kv tile its own rows see (`wg_causal_limit`, WG_CAUSAL_LIMIT: +1.4-2.7% at d = 256,
+3.6% at d = 64 N = 1k), and without one, at d = 128 from 8k queries and d = 192 from 4k,
the static schedule's last rounds run as stream-K, an item split across two CTAs and merged
(`stream_k`, STREAM_K, TileScheduler.piece: +0.7-1.0% and +1.2-1.7%); at d = 256 a key
length that is a multiple of the kv tile compiles a loop without the tail test (`kv_tail`,
NO_TAIL_TEST: +1.9-2.9%), and at d = 192 and 256 an item's first kv tile runs before the
loop, which then has no `n > 0` tests (`peel_first`, PEEL_FIRST: +2.1-3.5% at d = 256)
(docs/k6.md "Each warpgroup's own diagonal", "The static schedule's tail as stream-K", "A
loop without the tail test", "The first kv tile before the loop").

Tenth step, d = 64 (2026-11-28, H200): without a mask the PV wait is pinned before the
tile's exp2s, right after its row maxima, by a memory fence (`pv_wait_first`, PV_WAIT_FIRST),
so whole kv tiles can drop the tail test there too: +2.1-3.7% at N = 1k-16k, level with FA4
at 16k; with a mask, below N = 4k, the wait back in the iteration: +2.9-4.2% at 1k-3k
(docs/k6.md "The PV wait before the exp2s"). From 4k with a mask the warpgroups take turns
again, with the PV wait after 4 of a tile's exp2s (PV_WAIT_AFTER, P through opaque moves)
and ITEM_END's Q release and per-warpgroup stores: +3.8 / +3.7 / +2.6% at 4k / 8k / 16k,
level with FA4 at 16k (docs/k6.md "Turns again at d = 64 with a mask").

Eleventh step, d = 256 and d = 192 without a mask (2026-11-28, H200): O is rescaled only
where a row maximum grew by more than 2^8 (`lazy_rescale`, LAZY_RESCALE), in
PINNED_IN_ITERATION's loop, with P rounded to the input type before the row sums
(`round_p_sums`), so that l adds what the PV GEMM multiplies: d = 256 +1.0-1.9% without a
mask, -0.1 to +2.4% with one, d = 192 +1.8-6.1%; the error 1.00-1.16x torch's in bf16 (up to
1.55x in fp16), RMS 1-8% above the eager step's (docs/k6.md "Lazy rescaling with rounded
sums"). Since issue 9's closing runs also d = 192 with a mask: +0.3 / +2.0 / +3.6 / +3.0% at
1k / 2k / 4k / 8k, -0.1 / +0.5% at 16k (docs/k6.md "Issue 9's closing runs").
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
import torch
from cutlass.cute.nvgpu import warpgroup

from hopper_attn.common import tma, wgmma
from hopper_attn.common.contract import (MAX_GRID_YZ, KernelSpec, UnsupportedProblem,
                                         check_whole_kv_tiles, compile_attention,
                                         run_attention)
from hopper_attn.common.layouts import acc_rows_cols, smem_bytes, smem_tile_layout
from hopper_attn.common.scheduler import longest_first_default
from hopper_attn.common.softmax import OnlineSoftmax, ScoreSource, scale_rows
from hopper_attn.k5 import WG_EPILOGUE_BARRIER, FlashAttentionK5, lse_buffer

SPEC = KernelSpec(
    name="k6",
    summary="k5 + intra-warpgroup overlap, head dims 64-256, fp16, persistent scheduler",
    head_dims=(64, 96, 128, 192, 256),
    dtypes=(torch.bfloat16, torch.float16),
    separate_kv=True,           # GQA/MQA, seqlen_k != seqlen_q
    strided_inputs=True,        # e.g. q, k, v as views of a packed QKV tensor
    grid_per_tile=False,        # persistent: any batch x heads
    takes_work_counter=True,    # the dynamic schedule's (causal)
)

# head_dim -> (block_m, block_n, ping-pong): block_m / 64 consumer warpgroups. Both K and V
# rings hold 2 stages, so SMEM = (block_m + 4 * block_n) * d * 2 bytes (+ 1 KiB): at d = 256
# a 128 x 80 tile fills 225 of the 227 KiB an SM offers, at d = 192 128 x 112 takes 217.
# Registers per consumer thread (fp32): S block_n / 2, P block_n / 4, O d / 2 (d = 256:
# 40 + 20 + 128 of 240).
# d = 64 with a causal mask and a query length of at least this: 192-row tiles (compile_kernel;
# 2048 until the item-end options of ITEM_END: then 192 rows gained +4.5% at 768, +1.6 / +1.4%
# at 1k, +8.7% at 1280, +11.9 / +10.8% at 1536 and tied at 512, round-robin with cuDNN in the
# run, results/h100/2026-11-26_k6_d64_causal_192_short*.json)
LONG_CAUSAL_D64 = 768
# named barriers P_STORED_BARRIER + wg: a warpgroup's P is in shared memory (p_in_smem; after
# the epilogue's 1, the turns' 2-4 and exp_turns' next ids)
P_STORED_BARRIER = 8
# d = 96 without a mask and a query length of at least this: 192 x 96 tiles (compile_kernel)
LONG_D96 = 2048


def d96_wide_tiles(seqlen: int) -> bool:
    """d = 96 without a mask: 192 x 96 tiles (three consumer warpgroups, no turns) from
    LONG_D96 queries, and from 768 where the last 192-row query tile leaves at most one
    warpgroup idle. Round-robin against the 128 x 128 tile with turns, both with the item-end
    options, two runs with FA4 (results/h100/2026-11-26_k6_d96_192_short*.json), gain in
    time: +4.3 / +4.4% at N = 768, +3.2 / +2.9% at 1280 (64 rows idle), +11.0 / +11.1% at
    1536, but -7.2 / -7.1% at 1024 (two of three warpgroups idle on the last tile)."""
    return seqlen >= LONG_D96 or (seqlen >= 768 and -seqlen % 192 <= 64)


def any_length(seqlen: int) -> bool:
    return True


# (head_dim, causal) -> (v_lags_k, own_o_buffer) defaults, measured round-robin against the
# k6 before them (x FA4 in the same run; results/h100/2026-11-24_k6_v_lags_k_*.json, docs/k6.md
# "Loads in FlashAttention-4's order, O in its own buffer"): d = 128 +1.7-7.4%; d = 64 and 96
# with a mask +0.9-5%; d = 192 / 256 without one, V lagging alone, +1.5-2.2%. Elsewhere the
# lagging V lost (d = 96 full -4-5%), or lost alone and gains together with spinning waits
# (SPIN_WAITS): d = 192 / 256 causal -0.5-1.7% alone, +1.0-1.9% together; d = 64 full -4-5%
# alone, +2% with spinning waits and uniform descriptors (compile_kernel's `three_wg_d64`).
# O's buffer does not fit at d >= 192. Measured again with the defaults of 2026-11-26, O's own
# buffer without a mask, gain in time in two round-robin runs with FA4 (results/h100/2026-11-26_
# k6_own_o_buffer_*.json): d = 64 +5.5 / +5.5% (N = 1k), +2.5 / +2.5% (2k), +1.2 / +1.1% (4k),
# +0.1 / +0.1% (16k); d = 96 (192 x 96) +4.2 / +4.3% (2k), +2.3 / +2.2% (4k), +0.5 / +0.5% (16k),
# and +4.3% at 1k (128 x 128, one run):
# the shorter the items, the more the next Q's load under the epilogue saves
LOAD_ORDER = {(64, False): (True, True), (64, True): (True, True), (96, False): (False, True),
              (96, True): (True, True),
              (128, False): (True, True), (128, True): (True, True), (192, False): (True, False),
              (192, True): (True, False), (256, False): (True, False), (256, True): (True, False)}
# (head_dim, causal) whose K/V/Q waits spin on `mbarrier.try_wait` instead of sleeping between
# tries (tma.wait_full): d = 128 +1.1-2.3% in three round-robin runs; d = 192 and 256 with a
# mask, together with the lagging V (LOAD_ORDER), +1.0-1.9% in two; without a mask d = 192 and
# 256 lost 0.3-2.3% or tied (results/h100/2026-11-25_k6_spin_waits*.json,
# _k6_d192_256_*_options*.json, docs/k6.md); d = 64: compile_kernel's `three_wg_d64`
SPIN_WAITS = {(128, False), (128, True), (192, True), (256, True)}
# head_dim -> n: every n-th exp2 of the softmax on the FMA pipe (common/softmax.py,
# `exp2_on_fma`) instead of the SFU. At d = 128 +0.8-1.4% without a mask, +0.0-0.4% with one
# in three round-robin runs; n = 8 and 4 lose up to 6%, and at d = 64 any n loses 3-17%
# (results/h100/2026-11-25_k6_fma_exp2_*.json, _k6_p_by_bits_d128.json; docs/k6.md)
FMA_EXP2_EVERY = {128: 16}
# head_dim -> (MiB of K and V per group of heads, shortest and longest query length): with a
# causal mask the dynamic schedule then hands out work items head group by head group, the
# longest query tile of every head of a group first (scheduler.head_group_order), instead of
# head by head, so that the last items are short ones (docs/k6.md "Longest first"). Gain in
# time, two round-robin runs against FA4 on the H100 (results/h100/2026-11-26_k6_longest_
# first_*.json), N = 1k / 2k / 4k / 8k / 16k: d = 128 (8 MiB) +0.6 / +1.8-2.0 / +3.7-4.0 /
# +3.4-3.7 / -0.6-0.9%; d = 256 (32 MiB) -0.6 / +4.2-4.3 / +7.3 / +6.3-6.6 / -2.2-2.5%; d = 64
# (32 MiB) -11 / -1.4-1.7 / +0.8-1.2 / +1.7-2.1 / +1.7-1.9%. Where the order gains nothing the
# changed code costs up to 2.5%: on only inside the ranges that gained in both runs. Since
# the producer warp decodes the items for the consumers (scheduler.by_head_group) the order gains
# at d = 128 N = 1k as well: +1.6 / +1.1% over the head-by-head order in two runs, against
# +0.8 / +0.5% for the decode alone; at 16k still -0.2 / -0.25%
# (results/h100/2026-11-26_k6_decode_once_*.json)
# At d = 256 since the first kv tile runs before the loop (PEEL_FIRST) the order pays at 16k
# as well, together with each warpgroup's store (ITEM_END): +1.7 / +1.8% over neither, in two
# runs (results/h100/2026-11-26_k6_causal_long_d256_peel*.json)
LONGEST_FIRST = {64: (32, 4096, 16384), 128: (8, 1024, 8192), 256: (32, 2048, 16384)}
# (head_dim, causal) whose consumers hand V_{n-1}'s stage back after P's conversion, with a
# predicated arrive instead of an `if` (`v_release_last`; docs/k6.md "One branch less"); also
# d = 64 on 192-row tiles. Round-robin against the old order, two runs each, gain in time:
# d = 64 without a mask +1.6-2.5% (N = 2k-16k), with a mask (192 rows) -0.2 to +0.4%;
# d = 128 without a mask +0.0-0.7%, with one -0.3 to +0.2% (off); d = 256 (one run of this
# form, two of a first one that arrived on a spare barrier) +0.7-1.1% without a mask,
# +0.1-1.0% with one; d = 192 and 96 lost 1-2.6% in the first form: off
# (results/h100/2026-11-26_k6_v_release_last_*.json)
V_RELEASE_LAST = {(128, False), (256, False), (256, True)}
# (head_dim, causal) -> (n, shortest query length): the PV wait after n of a tile's exp2s, held
# there by a memory fence, instead of behind the loop's back edge (`pv_wait_after`;
# docs/k6.md "The PV wait among the exp2s"): O's 64 multiplies and P's 32 conversions then
# run among the remaining exp2s, as in FlashAttention-4's loop, instead of one after the other
# at the loop's top. d = 128, round-robin against the late wait: without a mask n = 7
# +1.9 / +2.9 / +3.7 / +4.3 / +4.5% (N = 1k / 2k / 4k / 8k / 16k), n = 10 +2-3.3%, 4 +2%, 14
# and 32 lose; with a mask (and V released after P's conversion, which it needs: without
# that a tie or -1-2%) +3.9 / +4.7 / +5.1 / +3.9% at 2k-16k but -4.6% at 1k; d = 64, 96,
# 192, 256 lose 1-19% (results/h100/2026-11-26_k6_pv_wait_after_*.json). d = 64 with a
# mask from 4k (192-row tiles), with turns and every exp2 through an opaque move (`opaque_p`:
# else ptxas computes a third of P twice), against the late wait without turns, H200, FA4 in
# the run (results/h200/2026-11-28_k6_d64_causal_turns*.json): n = 4 +3.8 / +1.9 / +1.4%
# (N = 4k / 8k / 16k), n = 2 and 8 within 0.5% of it; +0.7% at 3k, +0.3% at 2k, -3.8% at 1k
# (against each warpgroup stopping at its own diagonal, which turns rule out); with ITEM_END's
# change, final A/B +3.8 / +3.7 / +2.6% (_turns_ab_4k.json, _turns_ab_long.json)
PV_WAIT_AFTER = {(128, False): (7, 0), (128, True): (7, 2048), (64, True): (4, 4096)}
# (head_dim, causal) -> the query lengths (a rule) whose PV wait is back in the iteration,
# after the whole softmax, pinned there by a memory fence (`wait_pv_late=0, pin_pv_wait=1`),
# with P's k16 slices converted last first
# (`reverse_p`) so that the loop's PV is one WGMMA group and `wait_group(1)` no longer waits
# for all of PV but its last slice (docs/k6.md "One WGMMA group per P slice"). Round-robin
# against the late pinned wait with FA4 in the run, H100 (results/h100/2026-11-26_k6_pinned_
# in_iteration_*.json), gain in time: d = 256 without a mask +3.0 / +1.2% (N = 2k), +1.1 /
# +1.0% (4k), +0.6 / +0.7% (8k), -0.5 / +0.3% (16k); with one +1.2 / +1.3, +0.4 / +0.6,
# -0.2 / -0.4, +3.3 / +3.0%; d = 192 +5.4 / +5.5% without a mask and +3.4 / +3.9% with one
# (N = 4k / 16k). d = 96: on its 192 x 96 tile (no mask, d96_wide_tiles) +6.0 / +6.0% (2k),
# +6.4 / +6.4% (4k), +6.7 / +6.5% (16k) against the late wait (`_k6_d96_one_pv_group*.json`);
# with a mask, where the pinned wait already was the default (+2-3%), P last slice first
# +3.0 / +3.4 / +3.2% (2k / 4k / 16k) and +3.4 / +3.2% (4k / 16k; `_k6_d96_causal_reverse_p*`)
PINNED_IN_ITERATION = {(192, False): any_length, (192, True): any_length,
                       (256, False): any_length, (256, True): any_length,
                       (96, False): d96_wide_tiles, (96, True): any_length}
# head_dim -> kv tile for `s_ahead` (QK one tile ahead: two S accumulators next to O and P;
# wider tiles spill or make ptxas serialize the WGMMAs, and at d = 256 even 64 keys do
# (`C7512`); 48 splits PV into one group per slice; CPU); measured 0.42-0.48x the default
# loop (results/h100/2026-11-26_k6_s_ahead.json): off
S_AHEAD_BLOCK_N = {64: 64, 96: 64, 128: 64, 192: 64}
# The epilogue's TMA store not waited for until the next item's epilogue (`defer_store_wait`)
# pays where O has its own buffer and the consumer warpgroups take turns (a warpgroup that
# waits for the store holds up the others' turns), so that is compile_kernel's default.
# Gain in time, two round-robin runs each (results/h100/2026-11-26_k6_defer_store_wait_*.json):
# with turns d = 64 without a mask (192 rows) +1.7 / +1.6% (N = 1k), +1.0 / +1.0% (2k),
# +0.7 / +0.7% (4k), +0.3 / +0.3% (16k); d = 64 causal (128 rows) +1.4 / +1.0% (1k), +1.2 /
# +1.3% (1.5k); d = 96 (128 rows) +2.3 / +2.8% (1k), causal +2.1 / +2.0% (1k), +0.5 / +0.6% (4k).
# Without turns it loses or ties (one run): d = 64 causal 4k -1.4%, d = 96 192 x 96 -0.3 to
# +0.1%, d = 128 -0.5 to -1.3%, k7 -0.6 to -7% (_k7_defer_store_wait.json)
# ping-pong (turns between the consumer warpgroups) off at d = 128 since the waits and loads of
# 2026-11-25: +0.8-1.0% without a mask, +1.4-1.8% with one, in two round-robin runs
# (results/h100/2026-11-25_k6_d128_wait_pingpong_run*.json); d = 64 without a mask still
# needs it (-3.7-5.7% without), with a mask see compile_kernel (docs/k6.md)
# head_dim -> the query lengths below which, with a causal mask and without turns, each
# consumer warpgroup stops at the last kv tile its own 64 rows see (`wg_causal_limit`; docs/
# k6.md "Each warpgroup's own diagonal"). On 192 x 128 tiles (d = 64 from LONG_CAUSAL_D64
# queries) the top warpgroup skips a kv tile on most items, on 128 x 80 (d = 256) warpgroup
# 0 on four items of five. Gain in time, two round-robin runs with FA4 and cuDNN (results/
# h100/2026-11-26_k6_wg_causal_limit*.json): d = 64 +3.6 / +3.7% (N = 1k), +1.8% (1.5k),
# +0.8 / +0.7% (2k), -0.7 / -0.7% (4k), +0.6% (8k), 0.0 / +0.1% (16k); d = 256 +2.7 / +2.7%
# (1k), +1.9 / +1.7% (2k), +1.4 / +1.4% (4k), +0.8% (8k), +2.3 / +2.3% (16k). d = 192
# (128 x 112, one run) +1.3 / +0.5 / -0.2% at 1k / 4k / 16k: left off; d = 96 and 128 (128
# x 128) skip nothing when queries and keys are as long
WG_CAUSAL_LIMIT = {64: 4096, 256: 1 << 31}
# head_dim -> the shortest query length (no mask) at which the static schedule ends in
# stream-K (`stream_k`; docs/k6.md "The static schedule's tail as stream-K"): its last one to
# two rounds of items spread evenly over the CTAs, an item split across two of them. Gain in
# time, two round-robin runs with FA4 (results/h100/2026-11-26_k6_stream_k_*.json): d = 128
# -1.4 / -1.3% (N = 1k), -0.2% (2k), +0.4 / +0.3% (4k), +0.8% (8k), +1.0 / +1.0% (16k);
# d = 256 -3.5 / -0.3 / -0.1% (1k / 4k / 16k), -1.1 / -0.3 / -0.2% (2k / 4k / 16k);
# d = 192 +1.7 / +1.5% (4k / 16k) in one run, +0.3 / +1.7 / +1.2 / +1.2% (2k / 4k / 8k / 16k)
# in another (_k6_stream_k_d192_run2.json); d = 96 -3.4 / -1.7%, d = 64 -0.3 / -1.8%
STREAM_K = {128: 8192, 192: 4096}
# head dims whose kernel for a key length that is a multiple of the kv tile (no mask) has
# no tail test in its loop (`kv_tail=0`; the test is a branch ptxas schedules nothing
# across). Round-robin against the test, H100 (results/h100/2026-11-26_k6_kvt_*.json), gain
# in time: d = 256 +2.9 / +2.3% (N = 4000 / 16000); d = 128 -0.2 / -0.6%, d = 96 +0.1 / -0.4%
# (4096 / 16384); d = 64 -5.1 / -5.0% (ptxas then waits for PV later in the softmax); k7
# d = 128 -1.4 / -2.2% (4032 / 16128). Also wherever the PV wait is pinned before the exp2s
# (`pv_wait_first`, PV_WAIT_FIRST: d = 64), with which the loop without the test pays
NO_TAIL_TEST = {256}
# (head_dim, causal) whose PV wait is pinned before the tile's exp2s, right after its row
# maxima (`pv_wait_first=1`; docs/k6.md "The PV wait before the exp2s"). d = 64 without a mask,
# round-robin against the wait where ptxas puts it, H200, FA4 in the run
# (results/h200/2026-11-28_k6_pv_wait_first_*.json), gain in time: with the tail test
# +1.1 / +1.4 / +1.5 / +1.5 / +1.5% (N = 1k / 2k / 4k / 8k / 16k); without it (whole kv tiles,
# which alone loses 5%: ptxas then waits after 18 of the 66 exp2s) +2.1 /
# +3.1 / +3.4 / +3.6 / +3.7%. d = 64 causal -1.6 to -2.8%, d = 128 -12%, d = 256 -6%, k7
# d = 128 -0.2 to -0.7%: off there
PV_WAIT_FIRST = {(64, False)}
# head dims whose items run their first kv tile before the loop (`peel_first`), so that the
# loop's `n > 0` tests (branches, like the tail test above) fold away. Round-robin against the
# loop with them, H100, FA4 in the run (results/h100/2026-11-26_k6_peel_*.json), gain in
# time: d = 256 +2.5 / +2.1 / +2.5 / +2.5% (N = 2k / 4k / 8k / 16k), with a mask +2.2 / +3.5 /
# +0.6% (2k / 4k / 16k), but -0.5% at 4000 (whole kv tiles: no tail test, NO_TAIL_TEST);
# d = 192 +1.1 / +1.5%, with a mask +0.5 / +0.9% (4k / 16k); d = 96 -0.5 to -1.6%. Again
# (_run2): d = 256 +2.4 / +2.9 / +2.2 / +2.2% (1k / 2k / 4k / 16k), with a mask +2.6 / +2.2 /
# +3.4 / +2.3 / +0.7% (1k-16k); d = 192 +1.6 / +1.0 / +1.2%, with a mask +1.6 / +0.7 / +0.9%
# (2k / 4k / 16k). At d = 64 and 128 ptxas then serializes every WGMMA (a wait after each)
# unless P is converted last slice first (reverse_p), and with it measured d = 128 -0.8 to
# +0.4%, d = 64 -4.6 / -5.1% (_k6_peel_reverse_p_*.json)
PEEL_FIRST = {192, 256}
# (head_dim, causal) whose O is rescaled only when a row maximum grew by more than 2^8
# (`lazy_rescale`, FlashAttention-4's Blackwell rule), with P rounded to the input type
# before the row sums (`round_p_sums`: l then adds what the PV GEMM multiplies, which takes
# the stale maximum's error away) and the PV wait pinned in the iteration
# (PINNED_IN_ITERATION's loop). d = 256, round-robin against the eager step with FA4 and
# cuDNN in the run, two runs, H200 (results/h200/2026-11-28_k6_d256_lazy_round*.json), gain
# in time: without a mask +1.2 / +1.0 / +1.8, +1.9 / +1.5 / +1.2, +1.1% (N = 1k / 2k / 4k /
# 8k / 16k), with one -0.1 / +0.7 / +1.6, +1.4 / +2.0 / +2.4, +2.4%; error (max abs, x
# torch's on the same inputs, 1,601 keys: random, x 4, growing, outlier keys) at most 1.16x
# in bf16 and 1.55x in fp16, the eager step 1.00x (lazy without the rounded sums up to 1.96x
# at d = 256, 2.13x at 192). d = 192 without a mask, two runs: +1.8% (1k), +4.3 / +4.6% (4k),
# +6.0 / +6.1% (16k); with a mask +0.3 / +3.6 / -0.1% (1k / 4k / 16k), then +0.3 / +2.0 /
# +3.0% (1k / 2k / 8k) and +3.6 / +0.5% (4k / 16k) in two more runs
# (results/h200/2026-11-28_k6_d192_lazy_round*.json, _d192_causal_lazy_*.json)
LAZY_RESCALE = {(192, False), (192, True), (256, False), (256, True)}
# `exp_first`: past this growth of a row maximum (exp2 units) an exp2 taken from the old
# reference may have overflowed fp32 (2^128), and below this first maximum (a row's first
# tile, taken from 0) the largest P may have been flushed: the tile's scores are computed
# again, from q and k in memory (ScoreSource)
EXP_FIRST_OVERFLOW = 120.0
EXP_FIRST_UNDERFLOW = -100.0
TILES = {64: (192, 128, True), 96: (128, 128, True), 128: (128, 128, False),
         192: (128, 112, False), 256: (128, 80, False)}
# A work item's end (docs/k6.md "Where a work item ends"): `early_q_release` hands Q's stage
# back right after the item's last QK, so the next item's Q loads under the last softmax, PV
# and epilogue; `wg_store` lets each consumer warpgroup store its own 64 rows of O, so that
# none waits for the others at the item's end. early_q_release needs O's own buffer (d <=
# 128); wg_store without it writes each warpgroup's rows into its own rows of Q's buffer.
# (head_dim, causal) -> the query lengths below which each is compile_kernel's default.
# Gain in time, round-robin against the old default with FA4 and cuDNN in the run, H100
# (results/h100/2026-11-26_k6_item_end_*.json), both together unless said: d = 128 +6.2% (1k),
# +3.8% (2k), +2.3% (4k), +1.5% (8k), +1.1% (16k); with a mask +8.4, +3.6, +2.3, +0.8,
# +1.5%; d = 96 +4.2% (1k), +1.1% (4k), with a mask +5.8%, 0.0%; d = 64 with a mask +3.8 /
# +3.5% (1k), +3.4 / +3.5% (2k), +1.4 / +1.3% (4k), -1.0% (16k); d = 64 without a mask
# early_q_release alone +2.0 / +2.0% (1k), +1.0 / +1.0% (2k), +0.4 / +0.4% (4k), 0.0% (16k),
# with wg_store as well +3.8 / +3.9% (1k) but +0.4% (2k), -1.7% (4k), -3.4% (16k).
# wg_store alone at d = 192 and 256 (O in Q's buffer; _k6_wg_store_q_*.json, two runs):
# d = 256 +1.7 / +1.5% (1k), +1.5 / +1.3% (4k), +1.6 / +1.9% (16k), with a mask +0.9 / +1.0,
# +1.4 / +1.3, but -3.9 / -3.7% at 16k; d = 192 +1.8 / +1.7, +0.3 / +0.4, -0.2% (16k), with a
# mask +2.7 / +2.7, +1.1 / +1.1, +0.5% (16k). With PEEL_FIRST, d = 256 with a mask gains at 8k
# and 16k too: +1.4 / +1.3% (8k), +0.9 / +0.6 / +0.6% (16k; _k6_causal*_d256_peel*.json)
ALL_LENGTHS = 1 << 31
# d = 64 without a mask: wg_store at every length together with FAST_DIVMOD (below), +4.3-4.6%
# (2k), +2.9% (4k), +2.1% (8k), +1.1-1.6% (16k) in three round-robin runs
# (results/h100/2026-11-26_k6_d64_wg_store_fast_divmod*.json)
# d = 64 with a mask, since its long tiles take turns with the PV wait among the exp2s
# (PV_WAIT_AFTER): both at 8k and 16k too, +1.7 / +0.7% (results/h200/
# 2026-11-28_k6_d64_causal_turns_options.json)
ITEM_END = {(64, False): (ALL_LENGTHS, ALL_LENGTHS), (64, True): (ALL_LENGTHS, ALL_LENGTHS),
            (96, False): (ALL_LENGTHS, ALL_LENGTHS), (96, True): (4096, 4096),
            (128, False): (ALL_LENGTHS, ALL_LENGTHS), (128, True): (ALL_LENGTHS, ALL_LENGTHS),
            (192, False): (0, 8192), (192, True): (0, ALL_LENGTHS),
            (256, False): (0, ALL_LENGTHS), (256, True): (0, ALL_LENGTHS)}

# (head_dim, causal) whose static schedule decodes its work items with FastDivmod
# (`fast_divmod`, common/scheduler.py) instead of two integer divisions per item.
# Round-robin against the divisions, two runs with FA4 and cuDNN, H100
# (results/h100/2026-11-26_k6_fast_divmod_*.json), gain in time: d = 64 without a mask +5.0 /
# +5.0% (N = 1k, where wg_store was on) but -2.4 / -2.3% (2k) and -3.2% (4k) without wg_store;
# with wg_store at every length (ITEM_END) the pair gains at every length (three runs,
# _k6_d64_wg_store_fast_divmod*.json); d = 128 -0.8 / -0.7% (1k), -1.5 / -1.5% (2k); d = 96
# 0.0% (1k); d = 64 with a mask (dynamic: the consumers decode too) 0.0%. The loops' SASS is
# the same but for where it starts (docs/k6.md "FastDivmod for the static schedule, and where
# the loop starts"), so the gain is not the divisions' ~100 ns per item alone: on where
# measured only
FAST_DIVMOD = {(64, False)}

class FlashAttentionK6(FlashAttentionK5):
    def __init__(self, head_dim: int, causal: bool, block_m: int = 0, block_n: int = 0,
                 pingpong: Optional[bool] = None, persistent: bool = True,
                 dynamic: Optional[bool] = None, wait_pv_late: Optional[bool] = None,
                 lazy_rescale: bool = False, rescale_threshold_log2: float = 8.0,
                 exp_turns: bool = False, pin_pv_wait: Optional[bool] = None,
                 mask_per_row: Optional[bool] = None, p_in_smem: bool = False,
                 own_o_buffer: bool = False, v_lags_k: bool = False, fma_exp2_every: int = 0,
                 v_release_last: bool = False, pv_wait_after: int = 0, reverse_p: bool = False,
                 opaque_p: bool = False, rescale_before_pv: bool = False,
                 direct_store: bool = False, skip_idle_wgs: bool = False,
                 s_ahead: bool = False, defer_store_wait: bool = False,
                 early_q_release: bool = False, wg_store: bool = False,
                 wg_causal_limit: bool = False, peel_first: bool = False,
                 exp_first: bool = False, tail_n: int = 0, pv_wait_first: int = 0,
                 split_mask: bool = False, round_p_sums: bool = False, **options):
        # an item's kv tiles in two loops, the ones that need no mask first (`split_mask`):
        # neither loop tests its tiles for the mask (a branch ptxas schedules nothing across)
        if split_mask and (exp_first or s_ahead):
            raise ValueError("split_mask: not with exp_first or s_ahead")
        self.split_mask = bool(split_mask)
        # P rounded to the input type before the row sums (OnlineSoftmax.round_p): l then
        # adds what the PV GEMM multiplies, which keeps lazy rescaling as accurate as the
        # eager step
        self.round_p_sums = bool(round_p_sums)
        # the PV wait pinned before the tile's exp2s (`pv_wait_first`): wait_group(0) and a
        # memory fence right after the row maxima (1) or before them (2), so that ptxas
        # moves neither the wait nor an exp2 across (docs/k6.md "The PV wait before the
        # exp2s")
        if pv_wait_first not in (0, 1, 2):
            raise ValueError("pv_wait_first: 0 (off), 1 (after the row maxima) or 2 (before)")
        if pv_wait_first and (lazy_rescale or exp_turns or exp_first or pv_wait_after
                              or s_ahead):
            raise ValueError("pv_wait_first: not with lazy_rescale, exp_turns, exp_first, "
                             "pv_wait_after or s_ahead")
        self.pv_wait_first = int(pv_wait_first)
        # P from the reference maxima before the tile's maxima are known (lazy rescaling's
        # reference, here with `rescale_threshold_log2`); a rare branch corrects P (and O)
        self.exp_first = bool(exp_first)
        if exp_first:
            if lazy_rescale or exp_turns or pv_wait_after or rescale_before_pv:
                raise ValueError("exp_first: not with lazy_rescale, exp_turns, pv_wait_after "
                                 "or rescale_before_pv")
            lazy_rescale = True                 # (finish_tile: O rescaled by the step)
        default_m, default_n, default_pingpong = TILES[head_dim]
        # with a causal mask each consumer warpgroup stops at the last kv tile its own 64
        # rows see; the tiles after it, which only the warpgroups below need, it takes and
        # hands back without math (`idle_tiles`): where block_m / 64 rows end at another
        # kv tile than the tile's first row (192 x 128, 128 x 80), a warpgroup skips a tile
        # that would be masked out entirely
        self.wg_causal_limit = bool(wg_causal_limit) and causal
        # the first kv tile of an item before the loop, as FlashAttention-4 has it (its
        # `n > 0` tests then leave the loop)
        self.peel_first = bool(peel_first)
        # a consumer warpgroup whose 64 query rows all lie past the sequence's end (the last
        # query tile of a length that is no multiple of block_m) only keeps the rings and the
        # turns going (`idle_loop`) instead of computing rows nobody stores
        self.skip_idle_wgs = bool(skip_idle_wgs)
        # QK one tile ahead, into a second S accumulator (`s_ahead_loop`): a warpgroup's
        # softmax then runs under both of its GEMMs, QK_{n+1} and PV_{n-1}
        self.s_ahead = bool(s_ahead)
        # O stored from registers straight to global memory (k7's option): no staging
        # buffer, so Q is released after the item's last QK, as with own_o_buffer, also
        # where that buffer does not fit (d >= 192); the stores are less coalesced
        if direct_store and own_o_buffer:
            raise ValueError("direct_store needs no O buffer: own_o_buffer=0")
        self.direct_store = bool(direct_store)
        # V_{n-1}'s stage handed back after O's rescale and P's conversion instead of before:
        # its `n > 0` test is a branch, and ptxas schedules nothing across one, so before it
        # the exp2s, O's multiplies and P's conversions of a tile sat in separate blocks
        self.v_release_last = bool(v_release_last)
        # P's k16 slices converted into the PV operand last first inside the loop: at kv
        # tiles of 80 or 112 keys ptxas otherwise builds the last slice in other registers and
        # moves it after the WGMMA fence, which splits the loop's PV into one WGMMA group per
        # slice, so `wait_group(1)` waited for all but the last of them (docs/k6.md)
        self.reverse_p = bool(reverse_p)
        # every exp2 result through an opaque move (OnlineSoftmax.opaque_exp2): with
        # pv_wait_after on 192-row tiles the compiler recomputes part of P after the fence
        self.opaque_exp2 = bool(opaque_p)
        # O *= alpha between issuing QK_n and PV_{n-1} (under the QK GEMM, which does not
        # touch O) instead of in the tile's end, as FlashAttention-4 does at d > 128
        self.rescale_before_pv = bool(rescale_before_pv)
        # P handed to O += P V through shared memory (an SS GEMM) instead of registers, as
        # FlashAttention-4 does at d = 96: frees P's registers for wider tiles, costs a P
        # buffer, a store and a warpgroup barrier per tile (read by smem_estimate)
        self.p_in_smem = bool(p_in_smem)
        # O staged in a buffer of its own (as k7 does): Q is released after the work item's
        # loop (with early_q_release right after its last QK), so the next item's Q loads
        # under this one's epilogue
        self.own_o_buffer = bool(own_o_buffer)
        # and the epilogue's TMA store not waited for until the next item's epilogue (in
        # Q's buffer the next Q has to wait for the read anyway)
        if defer_store_wait and not own_o_buffer:
            raise ValueError("defer_store_wait needs own_o_buffer=1")
        self.defer_store_wait = bool(defer_store_wait)
        # the PV wait behind the back edge, measured (docs/k6.md): +2-3% at d = 128, +3-6% at
        # d = 256; at d = 64 -3% without a mask (192 x 128, three consumer WGs), a tie with one
        self.wait_pv_late = head_dim != 64 if wait_pv_late is None else bool(wait_pv_late)
        # the PV wait after this many of a tile's exp2s (0: off): a fence there stops ptxas
        # from hoisting the wait (written after the softmax) any higher, and the O rescale
        # and P's conversions that follow it interleave with the remaining exp2s. The row
        # maxima and alphas of all rows come first then, so that O's multiplies for every
        # row are free to move among the exp2s (`scores_to_probs_k6`)
        if pv_wait_after:
            self.softmax_fence_after = int(pv_wait_after)
            self.wait_pv_late = False
            pin_pv_wait = False
        if (pv_wait_after or rescale_before_pv) and (lazy_rescale or exp_turns):
            raise ValueError("pv_wait_after and rescale_before_pv need the eager rescale "
                             "without exp_turns")
        if rescale_before_pv and self.wait_pv_late:
            # with the late wait ptxas then serializes every WGMMA of the kernel (CPU, SASS)
            raise ValueError("rescale_before_pv needs the PV wait in the iteration "
                             "(pv_wait_after, or wait_pv_late=0)")
        self.lazy_rescale = bool(lazy_rescale)
        # a memory fence right before the PV wait keeps ptxas from hoisting the wait above
        # the softmax, in the same iteration (docs/k6.md "What the SASS says"); in front of
        # the late wait it measured +4-5% at d = 192 without a mask, +0.4-1.6% at d = 256,
        # a tie at d = 96 (results/h100/2026-11-23_k6_pin_late_fence_*): on at d >= 192
        self.pin_pv_wait = head_dim >= 192 if pin_pv_wait is None else bool(pin_pv_wait)
        # one key limit per row in masked tiles (k7's default, common/masking.py): with it
        # the 192-row d = 64 causal tile compiles without spills (compile_kernel's choice
        # for long sequences)
        if mask_per_row is not None:
            self.mask_per_row = bool(mask_per_row)
        self.rescale_threshold_log2 = float(rescale_threshold_log2)
        # d = 64 causal: with three consumer warpgroups (160 registers each) and the
        # two-compare mask ptxas spills 60 bytes, because P must now stay live under the
        # softmax and the mask adds coordinates; two warpgroups of 240 registers (block_m =
        # 128) fit. (compile_kernel picks 192 rows with one limit per row for long sequences.)
        if head_dim == 64 and causal:
            default_m = 128
        super().__init__(head_dim, causal, block_m or default_m, block_n or default_n,
                         pingpong=default_pingpong if pingpong is None else bool(pingpong),
                         persistent=bool(persistent),
                         dynamic=causal if dynamic is None else bool(dynamic),
                         v_lags_k=v_lags_k, fma_exp2_every=fma_exp2_every, **options)
        # exp2 in turns (off by default; an FP8 experiment, docs/k7.md): the consumer
        # warpgroups take turns for the exp2 part of their softmax, on named barriers of
        # their own (after the scheduler's), so that one warpgroup's exp2 has the SFU to itself
        # while the other's GEMMs run
        if exp_turns and self.lazy_rescale:
            raise ValueError("exp_turns needs the eager rescale (lazy_rescale=False)")
        self.exp_turns = dataclasses.replace(self.exp_turns, on=bool(exp_turns))
        if self.skip_idle_wgs and (exp_turns or self.p_in_smem):
            raise ValueError("skip_idle_wgs: not with exp_turns or p_in_smem")
        if self.wg_causal_limit and (self.pingpong.enabled or exp_turns or self.s_ahead):
            # a warpgroup that stops early would leave its turns to the others
            raise ValueError("wg_causal_limit: without turns (pingpong=0), exp_turns, s_ahead")
        # Q handed back inside the loop, right after the item's last QK (its stage is
        # then free while the last softmax, the last PV and the epilogue run), instead of
        # after the loop: needs O staged elsewhere than in Q's buffer
        if early_q_release and not (self.o_apart_from_q() or self.direct_store):
            raise ValueError("early_q_release needs own_o_buffer=1 or direct_store=1")
        if early_q_release and self.s_ahead:
            raise ValueError("early_q_release: not with s_ahead")
        self.early_q_release = bool(early_q_release)
        # each consumer warpgroup stores its own 64 rows of O (k5's `store_o_wg`): no barrier
        # of all consumer warpgroups at the end of a work item (O in its own buffer, or in
        # the warpgroup's own rows of Q's)
        if wg_store and self.direct_store:
            raise ValueError("wg_store stores through shared memory: not with direct_store")
        self.wg_store = bool(wg_store)
        if self.s_ahead and (self.pingpong.enabled or self.wait_pv_late or self.lazy_rescale
                             or exp_turns or self.p_in_smem or self.rescale_before_pv
                             or pv_wait_after or self.skip_idle_wgs):
            raise ValueError("s_ahead: without turns (pingpong=0), the late PV wait, "
                             "lazy_rescale, exp_turns, p_in_smem, rescale_before_pv, "
                             "pv_wait_after and skip_idle_wgs")
        # the item's last kv tile narrowed to its first tail_n keys (the key length's
        # remainder: compile_kernel checks it): that tile's softmax and PV skip the columns
        # past them. Only the default eager loop without a mask: there the last tile is the
        # only one the key length cuts
        if tail_n and (causal or tail_n % 32 or not 0 < tail_n < self.block_n
                       or self.s_ahead or self.lazy_rescale or exp_turns or pv_wait_after
                       or self.p_in_smem or self.stream_k or self.wait_pv_late
                       or self.peel_first or self.skip_idle_wgs):
            raise ValueError("tail_n: a multiple of 32 below block_n, without a mask, "
                             "lazy_rescale, exp_first, exp_turns, pv_wait_after, p_in_smem, "
                             "s_ahead, stream_k, peel_first, skip_idle_wgs or the late PV "
                             "wait")
        self.tail_n = int(tail_n)

    @cute.jit
    def mainloop(self, loads: tma.SplitKVLoads, wg, m_block, n_count, seqlen_q, seqlen_k,
                 mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, q_frag: cute.Tensor,
                 k_frag: cute.Tensor, vt_frag: cute.Tensor, p_frag: cute.Tensor,
                 acc_s: cute.Tensor, acc_o: cute.Tensor, s_coords: cute.Tensor,
                 softmax: OnlineSoftmax, k_state, v_state, n_base=0, scores=None):
        if cutlass.const_expr(self.s_ahead):
            k_state, v_state = self.s_ahead_loop(
                loads, m_block, n_count, seqlen_q, seqlen_k, mma_qk, mma_pv, q_frag, k_frag,
                vt_frag, p_frag, acc_s, acc_o, s_coords, softmax, k_state, v_state)
        elif cutlass.const_expr(self.skip_idle_wgs or self.wg_causal_limit):
            n_busy = n_count
            if cutlass.const_expr(self.wg_causal_limit):
                n_busy = cutlass.min(n_count, self.schedule.n_block_count_rows(
                    m_block, (wg + 1) * 64, seqlen_q, seqlen_k))
            busy = True
            if cutlass.const_expr(self.skip_idle_wgs):
                busy = m_block * self.block_m + wg * 64 < seqlen_q
            if busy:
                k_state, v_state = self.busy_loop(
                    loads, wg, m_block, n_busy, seqlen_q, seqlen_k, mma_qk, mma_pv, q_frag,
                    k_frag, vt_frag, p_frag, acc_s, acc_o, s_coords, softmax, k_state, v_state,
                    n_base, scores)
                if cutlass.const_expr(self.wg_causal_limit):
                    k_state, v_state = self.idle_tiles(loads, n_busy, n_count, k_state,
                                                       v_state)
            else:
                k_state, v_state = self.idle_loop(loads, wg, n_count, k_state, v_state)
        else:
            k_state, v_state = self.busy_loop(
                loads, wg, m_block, n_count, seqlen_q, seqlen_k, mma_qk, mma_pv, q_frag,
                k_frag, vt_frag, p_frag, acc_s, acc_o, s_coords, softmax, k_state, v_state,
                n_base, scores)
        return k_state, v_state

    @cute.jit
    def s_ahead_loop(self, loads: tma.SplitKVLoads, m_block, n_count, seqlen_q, seqlen_k,
                     mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, q_frag: cute.Tensor,
                     k_frag: cute.Tensor, vt_frag: cute.Tensor, p_frag: cute.Tensor,
                     acc_s: cute.Tensor, acc_o: cute.Tensor, s_coords: cute.Tensor,
                     softmax: OnlineSoftmax, k_state, v_state):
        """`s_ahead`: QK one tile ahead, S_n and S_{n+1} in two accumulators:

            issue QK_0 -> S_a; wait
            tile n:  issue QK_{n+1} -> the other S;  issue PV_{n-1}   (S_n is complete)
                     softmax(S_n) under both;  fence;  wait_group(0);  release V_{n-1}
                     O *= alpha;  P_n -> operand
            issue PV_last; wait; release V_last

        Every tile ends with `wait_group(0)`, so a tile starts with nothing in flight and
        ptxas sees that S_n is complete without counting groups across the loop's back edge
        (with `wait_group(2)` for S_n instead it serialized every WGMMA, C7514). Register
        arrays cannot be chosen at run time: two tiles per iteration (S_a, then S_b), the
        second skipped when n_count is odd."""
        o_rc = acc_rows_cols(acc_o)
        alpha = cute.make_rmem_tensor((cute.size(softmax.row_max),), Float32)
        acc_t = cute.make_rmem_tensor_like(acc_s)
        k_next = k_state.clone()                        # the next K to wait for
        loads.wait(loads.k_pipe, k_next)
        wgmma.gemm(mma_qk, acc_s, q_frag, k_frag[None, None, None, k_next.index],
                   zero_init=True)                      # S_0 = Q K_0^T
        k_next.advance()
        warpgroup.wait_group(0)
        for pair in cutlass.range((n_count + 1) // 2, unroll=1):
            n = 2 * pair
            k_next, k_state, v_state = self.s_ahead_tile(
                loads, n, n_count, m_block, seqlen_q, seqlen_k, mma_qk, mma_pv, q_frag,
                k_frag, vt_frag, p_frag, acc_s, acc_t, acc_o, o_rc, s_coords, softmax, alpha,
                k_next, k_state, v_state)
            if n + 1 < n_count:
                k_next, k_state, v_state = self.s_ahead_tile(
                    loads, n + 1, n_count, m_block, seqlen_q, seqlen_k, mma_qk, mma_pv,
                    q_frag, k_frag, vt_frag, p_frag, acc_t, acc_s, acc_o, o_rc, s_coords,
                    softmax, alpha, k_next, k_state, v_state)
        # the last tile's PV as in k5 (s_ahead runs without turns: no barrier there)
        v_state = self.last_pv(loads, 0, mma_pv, acc_o, p_frag, vt_frag, v_state)
        return k_state, v_state

    @cute.jit
    def s_ahead_tile(self, loads: tma.SplitKVLoads, n, n_count, m_block, seqlen_q, seqlen_k,
                     mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, q_frag: cute.Tensor,
                     k_frag: cute.Tensor, vt_frag: cute.Tensor, p_frag: cute.Tensor,
                     acc_cur: cute.Tensor, acc_next: cute.Tensor, acc_o: cute.Tensor,
                     o_rc: cute.Tensor, s_coords: cute.Tensor, softmax: OnlineSoftmax,
                     alpha: cute.Tensor, k_next, k_state, v_state):
        """One tile of `s_ahead_loop`: S_n complete in `acc_cur`, QK_{n+1} into `acc_next`."""
        # QK_{n+1} is issued on every tile, so that no branch yields S's registers while a
        # WGMMA writes them (ptxas would serialize every WGMMA, C7515): on the last tile it
        # recomputes S_n from K_n's stage into the unused accumulator
        more = n + 1 < n_count
        stage = k_state.index
        if more:
            loads.wait(loads.k_pipe, k_next)
            stage = k_next.index
        wgmma.gemm(mma_qk, acc_next, q_frag, k_frag[None, None, None, stage],
                   zero_init=True)                      # S_{n+1}
        if more:
            k_next.advance()
        if n > 0:
            loads.wait(loads.v_pipe, v_state)           # V_{n-1}
            self.issue_pv(mma_pv, acc_o, p_frag, vt_frag, v_state)   # O += P_{n-1} V_{n-1}
        if more:
            loads.release(loads.k_pipe, k_state)        # K_n: QK_n is complete
            k_state.advance()
        self.scores_to_probs_k6(acc_cur, o_rc, s_coords, softmax, alpha, 0, m_block, n,
                                n_count, seqlen_q, seqlen_k)
        # the wait below every exp2: a fence alone lets ptxas move exp2s past it, so its
        # predicate reads the row sums, which need them all (never true: a sum of exp2s)
        total = softmax.row_sum[0]
        for r in cutlass.range_constexpr(1, cute.size(softmax.row_sum)):
            total = total + softmax.row_sum[r]
        if total == Float32(-1.0) - Float32(seqlen_k):
            cute.arch.fence_acq_rel_cta()
        cute.arch.fence_acq_rel_cta()
        warpgroup.wait_group(0)                         # QK_{n+1}, PV_{n-1} done
        if not more:
            loads.release(loads.k_pipe, k_state)        # the last K, after its second read
            k_state.advance()
        if n > 0:
            loads.release(loads.v_pipe, v_state)        # V_{n-1} read
            v_state.advance()
        scale_rows(o_rc, alpha)
        self.probs_to_operand(acc_cur, p_frag)
        return k_next, k_state, v_state

    # ---- stream_k: an item split across two CTAs (TileScheduler.piece) ----
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
        pipeline.NamedBarrier(barrier_id=WG_EPILOGUE_BARRIER + wg,
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
        pipeline.NamedBarrier(barrier_id=WG_EPILOGUE_BARRIER + wg,
                              num_threads=128).arrive_and_wait()
        data, o_rc, stride, at = self.partial_state(mWork, slot, ctidx, acc_o)
        rows, cols = cute.size(o_rc, mode=[0]), cute.size(o_rc, mode=[1])
        for r in cutlass.range_constexpr(rows):
            a_own, a_other = softmax.merge_row(r, data[at + (rows * cols + r) * stride],
                                               data[at + (rows * cols + rows + r) * stride])
            for c in cutlass.range_constexpr(cols):
                o_rc[r, c] = o_rc[r, c] * a_own + data[at + (r * cols + c) * stride] * a_other

    @cute.jit
    def end_piece(self, mWork: cute.Tensor, ctidx, wg, acc_o: cute.Tensor,
                  softmax: OnlineSoftmax, k0, k1, n_count):
        """After a piece's kv tiles [k0, k1): one that begins an item leaves its raw state
        for the next CTA (`save_partial`), one that ends an item after another CTA's start
        merges that (`merge_partial`); returns whether the item ends here (its epilogue
        follows). k7's consumer loop; k5's keeps the two branches inline (folding them
        changes the stream-K kernels' SASS, measured there)."""
        if k1 < n_count:
            self.save_partial(mWork, ctidx, wg, acc_o, softmax)
        elif k0 > 0:
            self.merge_partial(mWork, ctidx, wg, acc_o, softmax)
        return k1 == n_count

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
        """`skip_idle_wgs`: a warpgroup without a valid query row takes every K and V tile
        (waits until it has landed, hands its stage back) and every turn, as `busy_loop` and
        `last_pv` do, so that the producer and the other warpgroups see the same arrivals,
        but issues no GEMM and runs no softmax."""
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
                  softmax: OnlineSoftmax, k_state, v_state, n_base=0, scores=None):
        pingpong = self.pingpong
        o_rc = acc_rows_cols(acc_o)
        alpha = cute.make_rmem_tensor((cute.size(softmax.row_max),), Float32)

        n_first = 0
        if cutlass.const_expr(self.peel_first):
            # tile 0 before the loop (its `n > 0` tests fold away), then a loop that knows
            # n > 0 (`later`): no branch left for them in it
            k_state, v_state = self.kv_tile(loads, wg, m_block, Int32(0), n_count, seqlen_q,
                                            seqlen_k, mma_qk, mma_pv, q_frag, k_frag, vt_frag,
                                            p_frag, acc_s, acc_o, o_rc, s_coords, softmax,
                                            alpha, k_state, v_state, n_base, scores=scores)
            n_first = 1
        # (tail_n: the item's last kv tile after the loop, narrowed; the loop is unchanged)
        n_loop = n_count - 1 if cutlass.const_expr(self.tail_n) else n_count
        # (first, end, mask) per loop: one loop whose tiles test for the mask, or with
        # split_mask the tiles left of the diagonal and before the key length's tail without
        # it, then the rest with it (a Python list: one compiled loop per entry)
        loops = [(n_first, n_loop, None)]
        if cutlass.const_expr(self.split_mask):
            n_plain = self.schedule.n_block_count_unmasked(m_block, seqlen_q, seqlen_k) - n_base
            n_plain = cutlass.max(cutlass.min(n_plain, n_loop), n_first)
            loops = [(n_first, n_plain, False), (n_plain, n_loop, True)]
        for first, end, mask in loops:
            for n in cutlass.range(first, end, unroll=1):
                k_state, v_state = self.kv_tile(
                    loads, wg, m_block, n, n_count, seqlen_q, seqlen_k, mma_qk, mma_pv,
                    q_frag, k_frag, vt_frag, p_frag, acc_s, acc_o, o_rc, s_coords, softmax,
                    alpha, k_state, v_state, n_base, self.peel_first, scores, mask=mask)
        if cutlass.const_expr(self.tail_n):
            k_state, v_state = self.kv_tile(loads, wg, m_block, n_count - 1, n_count, seqlen_q,
                                            seqlen_k, mma_qk, mma_pv, q_frag, k_frag, vt_frag,
                                            p_frag, acc_s, acc_o, o_rc, s_coords, softmax,
                                            alpha, k_state, v_state, n_base, tail=True)
        if cutlass.const_expr(self.wait_pv_late):
            v_state = self.finish_tile(loads, n_count - 1, acc_s, o_rc, p_frag, alpha, v_state)
        if cutlass.const_expr(self.rescale_before_pv):
            self.rescale_o(o_rc, p_frag, alpha)
        v_state = self.last_pv(loads, wg, mma_pv, acc_o, p_frag, vt_frag, v_state)  # as in k5
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
                later: cutlass.Constexpr = False, scores=None, tail: cutlass.Constexpr = False,
                mask: cutlass.Constexpr = None):
        """Tile n of a work item (kv tile n_base + n: stream_k's pieces start inside an item;
        later: n > 0 is known, `peel_first`'s loop; tail: the item's last tile, narrowed
        to its first tail_n keys; mask: whether it needs the mask, where the caller knows):
        S_n = Q K_n^T and O += P_{n-1} V_{n-1} in this warpgroup's
        turn, the softmax of S_n under PV_{n-1}, then (or, with the late wait, at the top of
        the next tile) tile n's end (`finish_tile`)."""
        pingpong = self.pingpong
        if cutlass.const_expr(self.wait_pv_late):
            if self.after_first(n, later):      # tile n-1's end, after the back edge
                v_state = self.finish_tile(loads, n - 1, acc_s, o_rc, p_frag, alpha,
                                           v_state, self.reverse_p)
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
                # (only QK_n is in flight: this wait costs nothing, and it shows ptxas
                # that no earlier PV still accumulates into O, so it adds no wait of its
                # own for QK before the multiplies)
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
            # Q's one stage, once the item's last QK is done (the kernel then only
            # advances its Q state)
            loads.release_if(loads.q_pipe, 0, n == n_count - 1)
        self.trace.end(phase)
        # --- under PV_{n-1}: everything of the softmax that touches neither O nor P
        phase = self.trace.start("softmax")
        if cutlass.const_expr(tail):
            # the eager step on the first tail_n columns only (masked past the key length):
            # the columns after them are neither exponentiated nor read by the last PV
            alpha.store(softmax.step(self.masked_scores(
                acc_s, s_coords, m_block, n_base + n, seqlen_q, seqlen_k, self.tail_n)).load())
        else:
            self.scores_to_probs_k6(acc_s, o_rc, s_coords, softmax, alpha, wg, m_block,
                                    n_base + n, n_count, seqlen_q, seqlen_k,   # S -> P, in place
                                    scores, mask)
        self.trace.end(phase)
        if cutlass.const_expr(not self.wait_pv_late):
            v_state = self.finish_tile(loads, n, acc_s, o_rc, p_frag, alpha, v_state,
                                       self.reverse_p, later)
        return k_state, v_state

    @cute.jit
    def scores_to_probs_k6(self, acc_s: cute.Tensor, o_rc: cute.Tensor, s_coords: cute.Tensor,
                           softmax: OnlineSoftmax, alpha: cute.Tensor, wg, m_block, n, n_count,
                           seqlen_q, seqlen_k, scores=None, mask: cutlass.Constexpr = None):
        """Mask, then the online-softmax step. Eager: every tile's factor alpha goes to
        `finish_tile`, which rescales O. Lazy: O is rescaled here, and only when a row maximum
        of this warp grew by more than 2^rescale_threshold_log2 (after waiting for PV_{n-1}:
        a rare branch); otherwise P keeps the old reference maximum (p <= 2^threshold).
        With exp_turns, the eager step in its parts: row maxima and alpha, then the exp2s
        and row sums inside this warpgroup's turn (one token per CTA, see PingPong)."""
        if cutlass.const_expr(self.pv_wait_first == 2):
            warpgroup.wait_group(0)                     # PV_{n-1} done, before the maxima
            cute.arch.fence_acq_rel_cta()               # ptxas moves nothing across this
        if cutlass.const_expr(self.exp_turns.enabled):
            s_rc = self.masked_scores(acc_s, s_coords, m_block, n, seqlen_q, seqlen_k,
                                      mask=mask)
            alpha.store(softmax.rebase(softmax.running_max(s_rc)).load())
            self.exp_turns.sync(wg)
            # ptxas moves ALU and SFU instructions across named barriers, but not across a
            # memory fence: the fences keep the exp2s between the sync and the arrive
            cute.arch.fence_acq_rel_cta()
            softmax.exponentiate(s_rc)
            cute.arch.fence_acq_rel_cta()
            self.exp_turns.pass_turn(wg)
        elif cutlass.const_expr(self.softmax_fence_after >= 0 or self.pv_wait_first == 1):
            s_rc = self.masked_scores(acc_s, s_coords, m_block, n, seqlen_q, seqlen_k,
                                      mask=mask)
            alpha.store(softmax.rebase(softmax.running_max(s_rc)).load())
            if cutlass.const_expr(self.pv_wait_first == 1):
                warpgroup.wait_group(0)                 # PV_{n-1} done, after the maxima
                cute.arch.fence_acq_rel_cta()           # and before any exp2
            softmax.exponentiate(s_rc)
        elif cutlass.const_expr(self.exp_first):
            self.exp_first_step(acc_s, o_rc, s_coords, softmax, m_block, n, seqlen_q,
                                seqlen_k, scores)
        elif cutlass.const_expr(not self.lazy_rescale):
            alpha.store(self.scores_to_probs(acc_s, s_coords, softmax, m_block, n, seqlen_q,
                                             seqlen_k, mask).load())
        else:
            s_rc = self.masked_scores(acc_s, s_coords, m_block, n, seqlen_q, seqlen_k,
                                      mask=mask)
            m_new = softmax.running_max(s_rc)
            if softmax.needs_rescale(m_new, self.rescale_threshold_log2):
                warpgroup.wait_group(0)                 # PV_{n-1} done: O may change
                scale_rows(o_rc, softmax.rebase(m_new))
            softmax.exponentiate(s_rc)

    @cute.jit
    def exp_first_step(self, acc_s: cute.Tensor, o_rc: cute.Tensor, s_coords: cute.Tensor,
                       softmax: OnlineSoftmax, m_block, n, seqlen_q, seqlen_k,
                       scores: ScoreSource):
        """`exp_first`: the exp2s do not wait for the tile's row maxima. P = 2^(s - m_ref)
        from the reference maxima (0 for a row's first tile), the maxima found beside the
        exp2s (they read S before P overwrites it). Then, if a maximum of the warp's rows
        grew by more than 2^threshold (on an item's first tile, and now and then later), the
        warp waits for PV_{n-1} and moves to the new maxima: P, O and l times
        2^(m_ref - m_new). If a maximum moved so far that an exp2 may have overflowed (or, on
        a first tile, underflowed), S is computed again from q and k in memory
        (`ScoreSource`)."""
        s_rc = self.masked_scores(acc_s, s_coords, m_block, n, seqlen_q, seqlen_k)
        m_new = softmax.running_max(s_rc)
        sums = cute.make_rmem_tensor_like(softmax.row_sum)
        sums.store(softmax.row_sum.load())
        softmax.exponentiate(s_rc)
        hi, lo, first = softmax.growth(m_new)
        if cute.arch.vote_any_sync(hi > self.rescale_threshold_log2 or first):
            warpgroup.wait_group(0)                     # PV_{n-1} done: O may change
            if cute.arch.vote_any_sync(hi >= EXP_FIRST_OVERFLOW or lo <= EXP_FIRST_UNDERFLOW):
                scores.recompute(s_rc, s_coords, m_block * self.block_m, n * self.block_n,
                                 seqlen_q, seqlen_k)
                s_rc = self.masked_scores(acc_s, s_coords, m_block, n, seqlen_q, seqlen_k)
                softmax.row_sum.store(sums.load())
                scale_rows(o_rc, softmax.rebase(m_new))
                softmax.exponentiate(s_rc)
            else:
                alpha = softmax.rebase(m_new, from_zero=True)   # l = (l + sum P) * alpha
                scale_rows(o_rc, alpha)
                scale_rows(s_rc, alpha)                 # P * alpha = 2^(s - m_new)

    def smem_estimate(self, head_dim: int, block_m: int, block_n: int, stages: int) -> int:
        p_bytes = smem_bytes(block_m * block_n * 2) if self.p_in_smem else 0
        o_bytes = smem_bytes(block_m * head_dim * 2) if self.own_o_buffer else 0
        return super().smem_estimate(head_dim, block_m, block_n, stages) + p_bytes + o_bytes

    def p_layout(self):
        return smem_tile_layout(self.dtype, self.block_m, self.block_n) if self.p_in_smem \
            else None

    @cute.jit
    def rescale_o(self, o_rc: cute.Tensor, p_frag, alpha: cute.Tensor):
        """O *= alpha per row, and with wgmma.PWithRowSums the running row sums likewise,
        after adding the last PV batch's."""
        scale_rows(o_rc, alpha)
        if cutlass.const_expr(isinstance(p_frag, wgmma.PWithRowSums)):
            p_frag.fold(alpha)          # (its last PV batch is done, as O's)

    @cute.jit
    def probs_to_operand(self, acc_s: cute.Tensor, p_frag, reverse: cutlass.Constexpr = False):
        """P (fp32, S's registers) -> the PV operand: registers (k5's), or with p_in_smem the
        P buffer (stmatrix), then fenced for the WGMMA's async proxy and a barrier of the
        warpgroup (its PV reads all 64 rows)."""
        if cutlass.const_expr(self.p_in_smem):
            p = cute.make_rmem_tensor_like(acc_s, self.dtype)
            p.store(acc_s.load().to(self.dtype))
            p_frag.store(p)
            cute.arch.fence_proxy("async.shared", space="cta")
            wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4 - 1
            cute.arch.barrier(barrier_id=P_STORED_BARRIER + wg, number_of_threads=128)
        else:
            super().probs_to_operand(acc_s, p_frag, reverse)

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
        if cutlass.const_expr(not self.lazy_rescale and not self.rescale_before_pv):
            self.rescale_o(o_rc, p_frag, alpha)
        self.probs_to_operand(acc_s, p_frag, reverse_p)
        if cutlass.const_expr(self.v_release_last):
            # tile 0 has no V_{n-1}: a predicated arrive instead of an `if`, so nothing here
            # ends the block that holds the exp2s and P's conversions
            loads.release_if(loads.v_pipe, v_state.index,
                              self.after_first(n, later))
            if self.after_first(n, later):
                v_state.advance()
        self.trace.end(phase)
        return v_state


def compile_kernel(problem, *, compile_options: str = "", block_m: int = 0,
                   block_n: int = 0, stages: int = 2, pingpong: Optional[bool] = None,
                   persistent: bool = True, persistent_ctas: int = 0,
                   dynamic: Optional[bool] = None, trace: bool = False,
                   uniform_descriptors: Optional[bool] = None,
                   wait_pv_late: Optional[bool] = None, lazy_rescale: Optional[bool] = None,
                   exp_turns: bool = False, pin_pv_wait: Optional[bool] = None,
                   mask_per_row: Optional[bool] = None, p_in_smem: bool = False,
                   own_o_buffer: Optional[bool] = None, v_lags_k: Optional[bool] = None,
                   spin_waits: Optional[bool] = None, fma_exp2_every: Optional[int] = None,
                   stmatrix_o: bool = True, longest_first: Optional[bool] = None,
                   group_mib: int = 0, v_release_last: Optional[bool] = None,
                   pv_wait_after: Optional[int] = None, reverse_p: Optional[bool] = None,
                   opaque_p: Optional[bool] = None, rescale_before_pv: bool = False,
                   direct_store: bool = False, skip_idle_wgs: Optional[bool] = None,
                   s_ahead: bool = False, defer_store_wait: Optional[bool] = None,
                   ctas_per_sm: int = 1, early_q_release: Optional[bool] = None,
                   wg_store: Optional[bool] = None, fast_divmod: Optional[bool] = None,
                   wg_causal_limit: Optional[bool] = None, stream_k: Optional[bool] = None,
                   kv_tail: Optional[bool] = None, peel_first: Optional[bool] = None,
                   exp_first: bool = False, exp_first_threshold: float = 8.0,
                   cluster: int = 1, multicast: bool = True,
                   pv_wait_first: Optional[int] = None, split_mask: bool = False,
                   round_p_sums: Optional[bool] = None):
    """Compile (or fetch from the cache) k6; options as k5's, 0 / None meaning the default
    of TILES for the head dim (pingpong: turn-taking between consumer warpgroups;
    persistent: a grid of one CTA per SM looping over work items (False: one CTA per work
    item, as in k5, for comparison); persistent_ctas: that grid's size (0: one per SM);
    dynamic: each CTA takes its next work item from a global counter (default: with a
    causal mask, whose work items differ in length) instead of every grid-th one;
    wait_pv_late: a tile's wait for PV (and the O rescale, P conversion) at the top of the
    next iteration (default: at d >= 96); lazy_rescale: rescale O only when a row maximum
    grew by more than 2^8, P's row sums rounded as P (round_p_sums) (None: LAZY_RESCALE's
    head dims and masks; docs/k6.md "Lazy rescaling with rounded sums"); pin_pv_wait: a
    memory fence in front of the PV wait (without wait_pv_late it keeps ptxas from hoisting the wait
    above the softmax; default: at d >= 192, in front of the late wait);
    exp_turns: the consumer warpgroups take turns for their exp2s (an FP8 experiment,
    docs/k7.md); mask_per_row: one key limit per row in masked tiles (None: the class's);
    p_in_smem: P to the PV GEMM through shared memory (FlashAttention-4's d = 96 path);
    own_o_buffer: O staged in a buffer of its own, so that the next work item's Q loads
    under the epilogue; v_lags_k: K_{j+1} loaded before V_j, V waited for inside the turn
    (FA4's order); None: LOAD_ORDER's choice for the head dim and mask; spin_waits: the
    rings' waits spin on `mbarrier.try_wait` instead of sleeping (None: SPIN_WAITS, and
    d = 64 on 192-row tiles);
    fma_exp2_every: every n-th exp2 on the FMA pipe instead of the SFU (0: none; None:
    FMA_EXP2_EVERY); stmatrix_o: O to SMEM with `stmatrix` (k5's); longest_first: the
    dynamic schedule's items head group by head group, the longest query tiles first (None:
    with a mask inside LONGEST_FIRST's lengths for the head dim), in groups of `group_mib`
    MiB of K and V (0: LONGEST_FIRST's); v_release_last: V's stage handed back after P's
    conversion, without a branch (None: V_RELEASE_LAST, and d = 64 on 192-row tiles);
    reverse_p: P's slices converted last first, one PV group (None: with the PV wait in the
    iteration where PINNED_IN_ITERATION has it); opaque_p: each exp2 result through an
    opaque move (no exp2 computed twice; None: with the PV wait among the exp2s on 192-row
    tiles, where ptxas would compute part of P again after the fence); rescale_before_pv: O
    rescaled under the QK GEMM (needs the PV wait in the iteration); direct_store: O from
    registers straight to global memory, no staging buffer (Q released after the last QK,
    where own_o_buffer does not fit); skip_idle_wgs: a consumer warpgroup whose query rows
    all lie past the sequence's end keeps only the rings and turns going; s_ahead: QK one
    tile ahead into a second S accumulator, the softmax under both GEMMs (no turns, the PV
    wait in the iteration);
    defer_store_wait: with own_o_buffer, the epilogue's TMA store is waited for (its read of
    O's buffer) only before the next item's epilogue (None: with O's own buffer and turns,
    as measured; see the comment above TILES); ctas_per_sm: 2
    runs two CTAs of one consumer warpgroup each (block_m=64) on every SM, so that one CTA's
    work-item boundary (epilogue, next Q, first QK and softmax) overlaps the other's loop;
    early_q_release: with O's own buffer (or direct_store), Q's stage handed back right after
    the item's last QK, inside the loop, instead of after its last PV; wg_store: with O's
    own buffer, each consumer warpgroup stores its 64 rows itself (a 64-row TMA store on a
    barrier of the warpgroup), without the epilogue's barrier of all consumers (None, both:
    ITEM_END's choice for the head dim, mask and length); fast_divmod: the static
    schedule's work items decoded with FastDivmod (None: where FAST_DIVMOD has it);
    wg_causal_limit: with a causal mask each consumer warpgroup stops at the last kv tile its
    own rows see and takes the rest of the item's tiles without math (needs pingpong=0;
    None: WG_CAUSAL_LIMIT's lengths where the turns are off); stream_k: without a mask, the
    static schedule's last rounds as stream-K, items split across two CTAs and merged
    through a workspace (None: STREAM_K's lengths); kv_tail: the loop tests each kv tile
    for the key length's tail (None: only where the key length is no multiple of the kv
    tile: a kernel for whole tiles tests none without a causal mask); peel_first: an item's
    first kv tile before the loop, whose `n > 0` tests then fold away (None: PEEL_FIRST's
    head dims, on the default tiles, where the loop keeps a mask test); exp_first: P from
    the reference row maxima before the tile's maxima are known, corrected in a rare branch
    where one grew by more than 2^exp_first_threshold (docs/k6.md "The exp2s before the row
    maximum": d = 64 +2.0-4.9% with 8, but 1.4-1.9x torch's error as lazy_rescale; 1.0x
    and -2.7..+0.8% with 1; d = 128 -9..-12%: off); cluster: 2 puts the CTAs in clusters
    of two that take neighbouring query tiles of one head and multicast each K/V tile into
    both (half the L2 reads; without a mask only, ignored with one; stream-K off with it;
    measured 3-5% higher clocks at the power limit but 1.6-4.9% less work per clock: -1.0 to
    -5.9% in the bench, off; docs/k6.md "K and V multicast to two CTAs"); multicast: False
    keeps the clusters' launch and pairing but has each CTA load its own K/V (a control);
    pv_wait_first: the PV wait and a memory fence right after the tile's row maxima (1) or
    before them (2), ahead of every exp2 (None: PV_WAIT_FIRST's, 1 at d = 64 without a mask,
    where whole kv tiles then also drop the tail test; docs/k6.md "The PV wait before the
    exp2s"); split_mask: an item's kv tiles in two loops, first those that need no mask
    (left of the causal diagonal, before the key length's tail), then the rest, so that
    neither loop tests its tiles (FlashAttention-4 runs its masked tiles apart too);
    round_p_sums: P rounded to the input type before the row sums, so that l adds the
    weights the PV GEMM multiplies (None: with lazy_rescale, whose error it takes away)."""
    if s_ahead:
        # its own loop: no turns, the PV wait in it, and a kv tile with room for a second S
        if problem.head_dim not in S_AHEAD_BLOCK_N and not block_n:
            raise UnsupportedProblem(f"k6 s_ahead: no kv tile fits two S accumulators at "
                                     f"d = {problem.head_dim} (k7:s_ahead=1 has one)")
        block_n = block_n or S_AHEAD_BLOCK_N[problem.head_dim]
        pingpong = False if pingpong is None else pingpong
        wait_pv_late = False if wait_pv_late is None else wait_pv_late
        pv_wait_after = 0 if pv_wait_after is None else pv_wait_after
    # measured on the default tiles only: a tile or P buffer of the caller's keeps both off
    custom = bool(block_m or block_n or p_in_smem)
    if lazy_rescale is None:
        lazy_rescale = ((problem.head_dim, problem.causal) in LAZY_RESCALE and not custom
                        and not (exp_first or exp_turns or s_ahead or rescale_before_pv
                                 or pv_wait_after or pv_wait_first))
    lags, own = (False, False) if custom else \
        LOAD_ORDER.get((problem.head_dim, problem.causal), (False, False))
    v_lags_k = lags if v_lags_k is None else v_lags_k
    own_o_buffer = (own and not direct_store) if own_o_buffer is None else own_o_buffer
    if (problem.head_dim == 64 and problem.causal and not block_m
            and problem.seqlen >= LONG_CAUSAL_D64):
        # 192-row tiles, one key limit per row (no spills), the late PV wait: +8% at N = 4k,
        # +13-15% at 16k, but -8% at 1k before ITEM_END (see LONG_CAUSAL_D64), measured
        # round-robin (results/h100/2026-11-23_k6_d64_causal_192.json, docs/k6.md)
        block_m = 192
        mask_per_row = True if mask_per_row is None else mask_per_row
        # the PV wait in the iteration: below WG_CAUSAL_LIMIT's length (each warpgroup
        # stopping at its own diagonal) after the softmax, +4.2 / +3.6 / +3.2 / +2.9% at
        # N = 1k / 1.5k / 2k / 3k against the late one (H200, round-robin with FA4 and cuDNN,
        # results/h200/2026-11-28_k6_d64_causal_*.json); from there among the exp2s
        # (PV_WAIT_AFTER), with turns
        wait_pv_late = False if wait_pv_late is None else wait_pv_late
        # turns only with the PV wait among the exp2s: with the late wait no turns measured
        # +1.4-2.0% (H100, _k6_d64_d96_pingpong_run*.json), turns with it on the H200
        # (results/h200/2026-11-28_k6_d64_causal_turns.json: -3.4 / -3.6% at 8k / 16k)
        if pingpong is None:
            pingpong = (problem.seqlen >= PV_WAIT_AFTER[(64, True)][1]
                        if pv_wait_after is None else pv_wait_after > 0)
        # the last tile's idle warpgroups skip the math (`skip_idle_wgs`): gain in time +3.1 /
        # +2.9% (N = 2k), +3.0 / +3.0% (4k), +0.9% (16k) in round-robin runs with FA4; with
        # turns (d = 64 without a mask) -2.4 to -2.6% (results/h100/2026-11-26_k6_skip_idle_*)
        skip_idle_wgs = True if skip_idle_wgs is None else skip_idle_wgs
    if problem.head_dim == 96 and not block_m:
        # measured round-robin against the 128 x 128 ping-pong tile with the late wait
        # (results/h100/2026-11-23_k6_d96_tiles.json, _k6_pin_pv_wait_d96_256.json, docs/k6.md)
        # (with a mask the PV wait pinned in place instead of late, +2-3% in two runs, and
        # the 192 x 96 tile's one PV group: PINNED_IN_ITERATION)
        if not problem.causal and d96_wide_tiles(problem.seqlen):
            # three consumer warpgroups on 192 x 96, no turns: +2.5-3.7% at N >= 4k, a tie
            # at 2k, -10% at 1k (fewer work items than SMs x warpgroups)
            block_m, block_n = 192, block_n or 96
            pingpong = False if pingpong is None else pingpong
            # idle warpgroups skip the last tile's math: +1.7 / +1.5% (2k), +0.8 / +0.6%
            # (4k), +2.1 / +1.9% (16k) in two runs (_k6_skip_idle_wgs_d96_run2.json)
            skip_idle_wgs = True if skip_idle_wgs is None else skip_idle_wgs
    # (measured with LOAD_ORDER's O buffer: a caller's other choice keeps both off)
    eqr_below, wg_below = (0, 0) if custom or direct_store or own_o_buffer != own else \
        ITEM_END.get((problem.head_dim, problem.causal), (0, 0))
    early_q_release = problem.seqlen < eqr_below if early_q_release is None else early_q_release
    wg_store = problem.seqlen < wg_below if wg_store is None else wg_store
    if fast_divmod is None:
        fast_divmod = not custom and (problem.head_dim, problem.causal) in FAST_DIVMOD
    if stream_k is None:
        stream_k = (not problem.causal and not custom and persistent and not dynamic
                    and cluster == 1
                    and problem.seqlen >= STREAM_K.get(problem.head_dim, 1 << 31))
    if wg_causal_limit is None:
        turns = TILES.get(problem.head_dim, (0, 0, False))[2] if pingpong is None else pingpong
        wg_causal_limit = (problem.causal and not custom and not turns and not exp_turns
                           and problem.seqlen < WG_CAUSAL_LIMIT.get(problem.head_dim, 0))
    if defer_store_wait is None:
        # (wg_store waits for each warpgroup's store one item later anyway)
        turns = TILES.get(problem.head_dim, (0, 0, False))[2] if pingpong is None else pingpong
        defer_store_wait = bool(own_o_buffer and not custom and turns and not wg_store)
    # d = 64 on 192-row tiles (three consumer warpgroups: without a mask, and with one from
    # LONG_CAUSAL_D64 queries on) takes three settings together: K_{j+1} loaded before V_j
    # (LOAD_ORDER), spinning waits and SMEM descriptors in uniform registers: +2.0-2.3%
    # without a mask and +3.1-3.3% with one (N = 2k-16k) in two round-robin runs against FA4,
    # where each alone lost up to 4% without a mask (results/h100/2026-11-25_k6_d64_options*,
    # docs/k6.md "Three settings that pay only together"); the 128-row causal tile keeps the
    # old ones (-1.6% there at N = 1k)
    three_wg_d64 = (not custom and problem.head_dim == 64
                    and (not problem.causal or block_m == 192))
    if spin_waits is None:
        spin_waits = (problem.head_dim, problem.causal) in SPIN_WAITS or three_wg_d64
    if fma_exp2_every is None:
        fma_exp2_every = FMA_EXP2_EVERY.get(problem.head_dim, 0)
    if uniform_descriptors is None:
        # SMEM descriptors built in uniform registers (wgmma.warpgroup_slice): measured
        # +0-1% at d = 128 but -4% at d = 64 without a mask on its own, so off there
        # (results/h100/2026-11-23_fwd_uniform_descriptors.json, docs/k6.md), except with
        # the other two settings of `three_wg_d64`
        uniform_descriptors = problem.head_dim != 64 or three_wg_d64
    if pv_wait_after is None:
        after, shortest = PV_WAIT_AFTER.get((problem.head_dim, problem.causal), (0, 0))
        pv_wait_after = after if (not custom and not lazy_rescale and not exp_turns
                                  and not exp_first and not pv_wait_first
                                  and problem.seqlen >= shortest) else 0
    if opaque_p is None:
        tile_m = block_m or TILES.get(problem.head_dim, (0,))[0]
        opaque_p = pv_wait_after > 0 and tile_m == 192
    pinned = PINNED_IN_ITERATION.get((problem.head_dim, problem.causal))
    one_pv_group = not custom and pinned is not None and pinned(problem.seqlen)
    if one_pv_group and not (pv_wait_after or exp_turns or exp_first):
        wait_pv_late = False if wait_pv_late is None else wait_pv_late
        pin_pv_wait = True if pin_pv_wait is None else pin_pv_wait
    if reverse_p is None:
        # one PV group needs the wait in the iteration; behind the late one it does not help
        reverse_p = one_pv_group and (pv_wait_after > 0 or wait_pv_late is False)
    if v_release_last is None:
        # with the PV wait among the exp2s always: the release's `if` would end their block
        v_release_last = ((problem.head_dim, problem.causal) in V_RELEASE_LAST or three_wg_d64
                          or pv_wait_after > 0)
    if pv_wait_first is None:
        pv_wait_first = int((problem.head_dim, problem.causal) in PV_WAIT_FIRST and not custom
                            and not (lazy_rescale or exp_turns or exp_first or pv_wait_after
                                     or s_ahead))
    tile_n = block_n or TILES.get(problem.head_dim, (0, 1))[1]
    whole_tiles = problem.kv_seqlen % tile_n == 0
    if kv_tail is None:
        kv_tail = not (whole_tiles and not problem.causal
                       and (problem.head_dim in NO_TAIL_TEST or pv_wait_first))
    if not kv_tail:
        check_whole_kv_tiles("k6", problem, tile_n)
    if peel_first is None:
        peel_first = (problem.head_dim in PEEL_FIRST and not custom and not s_ahead
                      and (kv_tail or problem.causal))
    if round_p_sums is None:
        round_p_sums = bool(lazy_rescale)
    measured_on, measured_mib = longest_first_default(LONGEST_FIRST, problem)
    longest_first = measured_on if longest_first is None else longest_first
    group_mib = group_mib or measured_mib
    if not persistent and max(problem.heads, problem.batch) > MAX_GRID_YZ:
        raise UnsupportedProblem(f"k6 with persistent=False launches one CTA per work item: "
                                 f"heads and batch must be <= {MAX_GRID_YZ}")
    return compile_attention(SPEC, FlashAttentionK6, problem,
                             {"block_m": block_m, "block_n": block_n, "stages": stages,
                              "pingpong": pingpong, "persistent": persistent,
                              "persistent_ctas": persistent_ctas, "dynamic": dynamic,
                              "trace": trace,
                              "uniform_descriptors": bool(uniform_descriptors),
                              "wait_pv_late": wait_pv_late,
                              "lazy_rescale": bool(lazy_rescale),
                              "exp_turns": bool(exp_turns),
                              "pin_pv_wait": pin_pv_wait,
                              "mask_per_row": mask_per_row,
                              "p_in_smem": bool(p_in_smem),
                              "own_o_buffer": bool(own_o_buffer),
                              "v_lags_k": bool(v_lags_k),
                              "spin_waits": bool(spin_waits),
                              "fma_exp2_every": int(fma_exp2_every),
                              "stmatrix_o": bool(stmatrix_o),
                              "longest_first": bool(longest_first),
                              "group_mib": int(group_mib),
                              "v_release_last": bool(v_release_last),
                              "pv_wait_after": int(pv_wait_after),
                              "pv_wait_first": int(pv_wait_first),
                              "split_mask": bool(split_mask),
                              "round_p_sums": bool(round_p_sums),
                              "reverse_p": bool(reverse_p),
                              "opaque_p": bool(opaque_p),
                              "rescale_before_pv": bool(rescale_before_pv),
                              "direct_store": bool(direct_store),
                              "skip_idle_wgs": bool(skip_idle_wgs),
                              "s_ahead": bool(s_ahead),
                              "defer_store_wait": bool(defer_store_wait),
                              "ctas_per_sm": int(ctas_per_sm),
                              "early_q_release": bool(early_q_release),
                              "wg_store": bool(wg_store),
                              "fast_divmod": bool(fast_divmod),
                              "wg_causal_limit": bool(wg_causal_limit),
                              "stream_k": bool(stream_k),
                              "kv_tail": bool(kv_tail),
                              "peel_first": bool(peel_first),
                              "exp_first": bool(exp_first),
                              "cluster": 1 if problem.causal else int(cluster),
                              "multicast": bool(multicast),
                              **({"rescale_threshold_log2": float(exp_first_threshold)}
                                 if exp_first else {})},
                             workspace_fn=lse_buffer, compile_options=compile_options)


def run_kernel(handle, q, k, v, out):
    run_attention(handle, q, k, v, out)
