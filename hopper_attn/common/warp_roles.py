"""Warp specialization pieces (device side, from k5 on): the role split with register
reallocation, and the ping-pong "scheduler" barriers between consumer warpgroups.

Roles. Warpgroup 0 (warps 0-3) is the producer: its warp 0 issues every TMA load, warps
1-3 have nothing to do. Warpgroups 1..W are consumers (64 query rows each). A CTA of
128 * (W + 1) threads launched one per SM starts with at most 65536 / threads registers per
thread (ptxas allocates that many at entry: 168 for 384 threads, 128 for 512). Right after
the split the producer warpgroup hands registers back (`setmaxnreg.dec`) and the consumer
warpgroups take them (`setmaxnreg.inc`, which blocks until the pool has enough):

    consumer WGs   producer   consumer   128 x (producer + W x consumer)
    1              56         256        39,936
    2              24         240        64,512
    3              32         160        65,536   (the whole register file)

(FlashAttention-3/4's numbers. Counts are multiples of 8 in [24, 256]; every warp of a
warpgroup must execute the same setmaxnreg.)

Ping-pong. With two or more consumer warpgroups, only one of them issues WGMMAs at a time
while the others run their softmax, so the tensor cores are never idle waiting on exp2s.
"The turn" is a token passed around the consumer warpgroups with named barriers: warpgroup
k owns barrier `first_barrier + k`, which counts 256 threads: its own 128 (bar.sync: wait
for the turn) and the previous warpgroup's 128 (bar.arrive: hand the turn over, without
waiting). Rotation 0 -> 1 -> ... -> W-1 -> 0. See `PingPong` for the count per barrier.
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute

REGISTERS_PER_SM = 65536

# consumer warpgroups -> (producer, consumer) registers per thread after setmaxnreg
REGISTER_SPLIT = {1: (56, 256), 2: (24, 240), 3: (32, 160)}


@dataclasses.dataclass(frozen=True)   # frozen: a compile-time constant inside dynamic code
class WarpRoles:
    consumer_warpgroups: int
    producer_regs: int
    consumer_regs: int

    @staticmethod
    def create(consumer_warpgroups: int) -> "WarpRoles":
        """REGISTER_SPLIT's registers for `consumer_warpgroups` (one CTA per SM)."""
        if consumer_warpgroups not in REGISTER_SPLIT:
            raise ValueError(f"1 to 3 consumer warpgroups (block_m 64, 128 or 192), not "
                             f"{consumer_warpgroups}")
        producer, consumer = REGISTER_SPLIT[consumer_warpgroups]
        roles = WarpRoles(consumer_warpgroups, producer, consumer)
        assert roles.registers_after <= REGISTERS_PER_SM
        assert producer <= roles.entry_regs <= consumer
        # setmaxnreg.inc waits until the CTA's own pool has the registers: only what the
        # producer gave back (its entry count minus its new one) can go to the consumers;
        # asking for more hangs the kernel
        if (roles.entry_regs - producer) < consumer_warpgroups * (consumer - roles.entry_regs):
            raise ValueError(f"setmaxnreg split {producer}/{consumer}: the producer frees "
                             f"{128 * (roles.entry_regs - producer)} registers, the consumers "
                             f"need {128 * consumer_warpgroups * (consumer - roles.entry_regs)}")
        return roles

    @property
    def threads(self) -> int:
        return 128 * (self.consumer_warpgroups + 1)

    @property
    def consumer_threads(self) -> int:
        return 128 * self.consumer_warpgroups

    @property
    def entry_regs(self) -> int:
        """The most registers ptxas may give each thread at launch (one CTA per SM)."""
        return min(REGISTERS_PER_SM // self.threads // 8 * 8, 255)

    @property
    def registers_after(self) -> int:
        return 128 * (self.producer_regs + self.consumer_warpgroups * self.consumer_regs)

    def become_producer(self):
        """First statement of the producer branch (all 4 warps of warpgroup 0)."""
        cute.arch.setmaxregister_decrease(self.producer_regs)

    def become_consumer(self):
        """First statement of the consumer branch (every warp of warpgroups 1..W)."""
        cute.arch.setmaxregister_increase(self.consumer_regs)


@dataclasses.dataclass(frozen=True)   # frozen: a compile-time constant inside dynamic loops
class PingPong:
    """Turn-taking between consumer warpgroups `wg` = 0..W-1 (a run-time, warp-uniform value).

    Protocol (per consumer warpgroup; work items of n kv tiles each, n >= 1):

        start()                      once per CTA, wg 0 only: arrive on its own barrier
                                     (the token)
        per work item:
            sync()                   wait for the first turn
            for j < n:  QK_j; pass_turn(); ...softmax...; sync(); PV_j
            finish()                 pass the turn on (the last warpgroup: back to wg 0)
        drain()                      once per CTA, wg 0 only: take the token back

    Counts per barrier b_k (all in units of 128 threads, 256 completes a phase): bar.sync
    by wg k: n + 1 per item (+ 1 from drain() for k = 0); bar.arrive on b_k from wg k-1:
    n + 1 per item (+ 1 from start() for k = 0). So every sync completes and no arrival is
    left pending when the CTA exits. The token is created once per CTA, so a barrier never
    holds more than one pending arrive of 128 threads, however far one warpgroup runs ahead
    of another (a token created per work item could: with k6's item_end="own_buffer_wg"
    no barrier of all consumer warpgroups separates two items, and warpgroup 0 then passed
    its next item's first turn while the last warpgroup had not yet taken the last turn of
    this one: 256 arrivals of one warpgroup completed a phase, and the turns hung, rarely,
    at 70,000 one-tile items).
    """

    warpgroups: int
    first_barrier: int = 2
    threads: int = 256                 # 128 that sync + 128 that arrive
    on: bool = True                    # False: every warpgroup issues whenever it is ready

    @property
    def enabled(self) -> bool:
        return self.on and self.warpgroups > 1

    @cute.jit
    def start(self, wg):
        if cutlass.const_expr(self.enabled):
            if wg == 0:
                cute.arch.barrier_arrive(barrier_id=self.first_barrier,
                                         number_of_threads=self.threads)

    @cute.jit
    def sync(self, wg):
        """Wait until it is `wg`'s turn."""
        if cutlass.const_expr(self.enabled):
            cute.arch.barrier(barrier_id=self.first_barrier + wg, number_of_threads=self.threads)

    @cute.jit
    def pass_turn(self, wg):
        """Hand the turn to the next warpgroup (does not wait)."""
        if cutlass.const_expr(self.enabled):
            cute.arch.barrier_arrive(barrier_id=self.first_barrier + (wg + 1) % self.warpgroups,
                                     number_of_threads=self.threads)

    @cute.jit
    def finish(self, wg):
        """After a work item's last tile: let the next warpgroup take its last turn (the
        last warpgroup hands the token back to warpgroup 0, for the next item)."""
        self.pass_turn(wg)

    @cute.jit
    def drain(self, wg):
        """After the CTA's last work item: warpgroup 0 takes the token back, so that no
        arrive is left pending on its barrier."""
        if cutlass.const_expr(self.enabled):
            if wg == 0:
                cute.arch.barrier(barrier_id=self.first_barrier, number_of_threads=self.threads)
