"""k5 on the CPU: it compiles for sm_90a without spills, and its PTX/SASS shows the warp
specialization (a producer branch that alone issues TMA loads, setmaxnreg), separate K and V
mbarrier rings, and the named-barrier ping-pong. A small model of the consumer/producer
protocol checks that it cannot deadlock and leaves no barrier arrival pending."""

import random
import re

import pytest

from hopper_attn.harness.compile_report import resource_usage, sass
from ptx import TMA_LOAD, TMA_STORE, WGMMA, WGMMA_REG_A, compiled, count

CONFIGS = [(64, False), (64, True), (128, False), (128, True)]
REGS = {64: (32, 160, 128, 3), 128: (24, 240, 168, 2)}   # producer, consumer, entry, consumer WGs


def artifacts(d, causal, name="k5"):
    return compiled(name, d, causal)


@pytest.mark.compile
@pytest.mark.parametrize("d,causal", CONFIGS)
def test_no_spills_and_entry_registers_allow_setmaxnreg(d, causal):
    art = artifacts(d, causal)
    producer, consumer, entry, wgs = REGS[d]
    assert art["kernel"]["threads"] == 128 * (wgs + 1)
    (fn,) = resource_usage(art["cubin"])
    assert fn["local"] == 0 and fn["stack"] == 0, fn
    # the cubin's count is what every thread gets at launch: the CTA must fit one per SM,
    # and the producer gives back / the consumers take within the register file
    assert fn["registers"] == entry
    assert fn["registers"] * art["kernel"]["threads"] <= 65536
    assert producer <= fn["registers"] <= consumer
    assert 128 * (producer + wgs * consumer) <= 65536


@pytest.mark.compile
@pytest.mark.parametrize("d,causal", CONFIGS)
def test_setmaxnreg_splits_registers(d, causal):
    art = artifacts(d, causal)
    producer, consumer, _, _ = REGS[d]
    ptx = art["ptx"]
    assert re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", ptx) == [str(producer)]
    assert re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx) == [str(consumer)]
    code = sass(art["cubin"])
    assert count(code, r"USETMAXREG\.DEALLOC") == 1 and count(code, r"USETMAXREG\.TRY_ALLOC") == 1


@pytest.mark.compile
@pytest.mark.parametrize("d,causal", CONFIGS)
def test_only_the_producer_branch_loads(d, causal):
    ptx = artifacts(d, causal)["ptx"]
    loads = [m.start() for m in re.finditer(TMA_LOAD, ptx)]
    # K_0, Q, V_0, then K_j and V_j in the loop: five load sites, each split into d / 64
    # boxes of 64 columns (128-byte swizzle)
    assert len(loads) == 5 * (d // 64)
    dec = ptx.index("setmaxnreg.dec")
    inc = ptx.index("setmaxnreg.inc")
    assert dec < inc
    # the producer branch is the code between the two: every load lies in it
    assert all(dec < pos < inc for pos in loads)
    assert count(ptx, r"bar\.sync\s+0;") == 1            # the one CTA-wide sync, before the split
    assert count(ptx, TMA_STORE) == d // 64               # O, by one consumer warp


@pytest.mark.compile
@pytest.mark.parametrize("d,causal", CONFIGS)
def test_k_and_v_have_their_own_mbarriers(d, causal):
    art = artifacts(d, causal)
    stages = art["kernel"]["stages"]
    assert art["kernel"]["mbarriers"] == {"q": 2, "k": 2 * stages, "v": 2 * stages}
    ptx = art["ptx"]
    assert count(ptx, r"mbarrier\.init\.shared") == 2 + 4 * stages
    # wait sites: producer on the "empty" barriers of K_0, Q, V_0 and of K_j, V_j (loop);
    # consumers on Q, K, V (in the loop) and V (last PV); a spinning wait (k5's default,
    # tma.wait_full) tries once before its loop and once inside it
    sites = 9 * (2 if art["kernel"]["spin_waits"] else 1)
    assert count(ptx, r"mbarrier\.try_wait") == sites
    # release sites: V_{n-1} and K_n in the loop, V after the last PV, Q after the output
    # left its buffer; K and V on different barriers
    releases = re.findall(r"mbarrier\.arrive\.shared\.b64\s+\S+,\s*\[([^\]]+)\]", ptx)
    assert len(releases) == 4 and len(set(releases[:2])) == 2


@pytest.mark.compile
@pytest.mark.parametrize("d,causal", CONFIGS)
def test_named_barriers_ping_pong_and_epilogue(d, causal):
    art = artifacts(d, causal)
    _, _, _, wgs = REGS[d]
    ptx = art["ptx"]
    assert art["kernel"]["named_barriers"] == {"epilogue": 1,
                                               "scheduler": [2 + k for k in range(wgs)]}
    # scheduler: 256 threads = 128 that sync + 128 that arrive; ids in registers (per WG)
    sched = r"(%r\d+|[2-9]|1[0-5]),\s*256;"               # ids 0 and 1 are not scheduler ids
    syncs = re.findall(r"bar\.sync\s+" + sched, ptx)
    arrives = re.findall(r"bar\.arrive\s+" + sched, ptx)
    # each tile's turn, the last PV's turn, and WG 1's drain (it takes the token back once,
    # after the CTA's last work item: PingPong)
    assert len(syncs) == 3
    assert len(arrives) == 3                              # WG 1's start, after each turn, finish
    assert "2" in arrives                                 # the first turn goes to WG 1 (id 2)
    # epilogue: consumer threads only, twice (before writing sQ, before the TMA store)
    assert count(ptx, rf"bar\.sync\s+1,\s*{128 * wgs};") == 2


@pytest.mark.compile
@pytest.mark.parametrize("d,causal", CONFIGS)
def test_wgmma_counts_and_p_from_registers(d, causal):
    art = artifacts(d, causal)
    ptx = art["ptx"]
    block_n = art["kernel"]["block_n"]
    # QK slices + PV slices, PV issued at two sites (in the loop, and the last tile's)
    assert count(ptx, WGMMA) == d // 16 + 2 * block_n // 16
    assert count(ptx, WGMMA_REG_A) == 2 * block_n // 16   # PV takes P from registers
    assert count(ptx, r"ld\.shared") == 0
    assert "HGMMA" in sass(art["cubin"])


@pytest.mark.compile
@pytest.mark.parametrize("name,d", [("k5:trace=1", 64), ("k5:block_m=64", 128)])
def test_variants_compile(name, d):
    art = artifacts(d, True, name)
    (fn,) = resource_usage(art["cubin"])
    assert fn["local"] == 0 and fn["stack"] == 0
    if "block_m=64" in name:                              # one consumer WG: no ping-pong
        assert count(art["ptx"], r"bar\.(sync|arrive)\s+\S+,\s*256;") == 0


# ---------------------------------------------------------------------------------------
# A model of k5's protocol (no compile): producer + W consumer warpgroups over n tiles,
# named barriers counted per warpgroup (2 arrivals complete a phase), K/V rings of
# `stages`. Random interleavings must finish, never have two warpgroups in their turn at
# once, and leave every named barrier with no pending arrival.
# ---------------------------------------------------------------------------------------

class Model:
    def __init__(self, wgs, n, stages):
        self.wgs, self.n, self.stages = wgs, n, stages
        self.count = [0] * wgs
        self.phase = [0] * wgs
        self.loaded = {"k": 0, "v": 0}
        self.released = {"k": [0] * n, "v": [0] * n}
        self.in_turn = set()

    def hit(self, b):
        self.count[b] += 1
        if self.count[b] == 2:
            self.count[b], self.phase[b] = 0, self.phase[b] + 1

    def sync(self, b):
        ph = self.phase[b]
        self.hit(b)
        yield lambda: self.phase[b] > ph

    def take_turn(self, wg):
        assert not self.in_turn, "two warpgroups in their turn"
        self.in_turn.add(wg)

    def pass_turn(self, wg):
        self.in_turn.discard(wg)
        self.hit((wg + 1) % self.wgs)

    def producer(self):
        for j in range(self.n):
            for ring in ("k", "v"):
                free = j - self.stages
                yield lambda ring=ring, free=free: free < 0 or self.released[ring][free] == self.wgs
                self.loaded[ring] += 1

    def consumer(self, wg):                          # the order of k5's consumer branch
        if wg == 0:
            self.hit(0)                              # start()
        for j in range(self.n):
            yield lambda j=j: self.loaded["k"] > j   # wait K_j
            if j > 0:
                yield lambda j=j: self.loaded["v"] > j - 1      # wait V_{j-1}
            yield from self.sync(wg)
            self.take_turn(wg)                       # issue PV_{j-1} (j > 0) and QK_j
            self.pass_turn(wg)
            if j > 0:
                self.released["v"][j - 1] += 1
            self.released["k"][j] += 1
        yield lambda: self.loaded["v"] > self.n - 1  # the last PV, in one more turn
        yield from self.sync(wg)
        self.take_turn(wg)
        if wg != self.wgs - 1:                       # finish()
            self.pass_turn(wg)
        else:
            self.in_turn.discard(wg)
        self.released["v"][self.n - 1] += 1

    def run(self, rng):
        agents = [self.producer()] + [self.consumer(w) for w in range(self.wgs)]
        waiting = {i: None for i in range(len(agents))}
        while waiting:
            ready = [i for i, cond in waiting.items() if cond is None or cond()]
            assert ready, f"deadlock: {self.count=} {self.loaded=}"
            i = rng.choice(ready)
            try:
                waiting[i] = next(agents[i])
            except StopIteration:
                del waiting[i]
        assert self.count == [0] * self.wgs, "a named barrier was left with a pending arrive"


@pytest.mark.parametrize("wgs", [2, 3])
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_ping_pong_protocol_model(wgs, stages):
    rng = random.Random(wgs * 10 + stages)
    for n in (1, 2, 3, 7):
        for _ in range(200):
            Model(wgs, n, stages).run(rng)
