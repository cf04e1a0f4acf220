"""FP8 (e4m3) pieces of k7 (device side): V transposed in shared memory, P as an FP8 operand.

Two layout rules separate an FP8 attention kernel from a 16-bit one (docs/k7.md):

1. An FP8 WGMMA reads its SMEM operands K-major only. S = Q K^T is fine (head_dim is
   contiguous in Q and K). O = P V reduces over the kv index, but V arrives as (kv, d) with d
   contiguous, MN-major for that GEMM. `VTranspose` rewrites every V tile as V^T, (d, kv)
   with kv contiguous, in shared memory: `ldmatrix.trans` (8 x 8 blocks of 16-bit pairs),
   two byte permutes, `stmatrix`.
2. Per thread, an FP8 A operand in registers holds 4 *consecutive* k (bytes) of a row, where
   the fp32 accumulator of S = Q K^T holds pairs of columns 8 apart: k-slot 4q + i of a row
   (q = lane % 4, i = 0..3) would need S column 4q + i, which another thread owns.

The fix of 2 costs nothing. The sum over kv in P V does not depend on the order of kv, as
long as P's columns and V's rows follow the same order. So inside each 16-wide kv block,
k-slot 4q + i takes the S column this thread already has,

    slot 4q + i  <-  S column 2q + (i % 2) + 8 * (i // 2)          (q = 0..3, i = 0..3)

(the accumulator registers c0, c1, c4, c5 of a row, for rows r and r + 8 alike), and the
transpose writes V's rows into V^T's columns in the same order, which `ldmatrix.trans` plus
the byte permutes produce by themselves (`VTranspose`). P is then converted in registers
with no shuffle (`probs_to_fp8_operand`).
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass.experimental.primitives import nvvm_wrapper as nvvm

# byte selectors of `prmt` (bytes 0-3 from the first word, 4-7 from the second)
EVEN_BYTES = 0x6420         # bytes 0 and 2 of each word: the even d column of both pairs
ODD_BYTES = 0x7531          # bytes 1 and 3: the odd one
BATCH = 4                   # ldmatrix issued back to back (4 x 4 registers in flight)


@dataclasses.dataclass(frozen=True)
class VTranspose:
    """V (block_n x d, d contiguous) -> V^T (d x block_n, kv contiguous, kv permuted as above)
    for one ring stage, by `warps` warps. The work unit is 16 kv rows x 32 d bytes:

      ldmatrix.x4.trans  the four 8 x 8 matrices of 16-bit pairs (kv 0-7 / 8-15 x d bytes
                         0-15 / 16-31); lane (q, j) = (lane % 4, lane // 4) of matrix m gets
                         V[2q][2j], V[2q][2j+1], V[2q+1][2j], V[2q+1][2j+1] in one word
      prmt (x4)          words of kv 0-7 and 8-15 -> V[2q][c], V[2q+1][c], V[2q+8][c],
                         V[2q+9][c] for c = 2j (even bytes) and 2j + 1 (odd bytes): four kv
                         values of one V^T row, in the k-slot order 4q .. 4q + 3 P uses
      stmatrix.x4        row j of matrix m = V^T row c, 16 kv bytes: four 8-row matrices
                         (rows 2j, 2j + 1, 16 + 2j, 17 + 2j of the 32 d values)

    Warp w takes the units of d columns [32 w J, 32 (w + 1) J) (J = d / 32 / warps), every kv.
    The swizzle XORs a row's 16-byte chunks with the row index mod 8, so a unit's SMEM
    addresses are not a linear function of its position; but both tiles repeat every 16 rows
    (V: kv, V^T: d), so each thread computes its J source and block_n / 16 destination
    addresses once (`addresses`), and every unit of every tile adds only constants to them.
    """

    block_n: int
    head_dim: int
    warps: int
    batch: int = BATCH

    def __post_init__(self):
        if self.block_n % 16 or self.head_dim % (32 * self.warps):
            raise ValueError(f"V transpose: block_n ({self.block_n}) must be a multiple of 16 "
                             f"and head_dim ({self.head_dim}) of 32 x {self.warps} warps")

    @property
    def d_units(self) -> int:
        """32-column units of d per warp."""
        return self.head_dim // 32 // self.warps

    @cute.jit
    def addresses(self, sv: cute.Pointer, v_layout: cute.ComposedLayout, svt: cute.Pointer,
                  vt_layout: cute.ComposedLayout, warp, lane):
        """This thread's row addresses (stage 0, first unit of each row period): the
        ldmatrix source for each of its warp's d units, the stmatrix destination for each
        16-row kv unit. `warp`: 0 .. warps - 1 among the transposing warps."""
        m, r = lane // 8, lane % 8               # the matrix and the row this lane addresses
        d_first = 32 * self.d_units * warp
        src = [sv + cute.crd2idx((8 * (m % 2) + r, d_first + 32 * j + 16 * (m // 2), 0),
                                 v_layout)
               for j in range(self.d_units)]
        dst = [svt + cute.crd2idx((d_first + 16 * (m // 2) + (m % 2) + 2 * r, 16 * u, 0),
                                  vt_layout)
               for u in range(self.block_n // 16)]
        # what 16 more rows of V and 32 more rows of V^T add (check_row_period)
        steps = (cute.crd2idx((16, 0, 0), v_layout), cute.crd2idx((32, 0, 0), vt_layout))
        return src, dst, steps

    @cute.jit
    def stage(self, src: list, dst: list, steps: tuple, stage):
        """Transpose ring stage `stage` (every unit of this warp), from `addresses`.

        Units go in batches of `batch`: all of a batch's loads, then its permutes and stores.
        Unit by unit, each ldmatrix would wait for the previous stmatrix (the compiler cannot
        tell that they touch different buffers), so every load's latency would be exposed.
        """
        v_tile = self.block_n * self.head_dim           # bytes per stage, V and V^T alike
        units = [(u, j) for u in range(self.block_n // 16) for j in range(self.d_units)]
        for b in cutlass.range_constexpr(0, len(units), self.batch):
            batch = units[b:b + self.batch]
            loaded = [nvvm.ldmatrix((src[j] + (stage * v_tile + u * steps[0]))
                                    .llvm_ptr, num=4, layout=nvvm.MMALayout.COL)
                      for u, j in batch]
            for (u, j), words in zip(batch, loaded):
                out = [cute.arch.prmt(words[2 * h], words[2 * h + 1], sel)
                       for h in (0, 1) for sel in (EVEN_BYTES, ODD_BYTES)]
                nvvm.stmatrix((dst[u] + (stage * v_tile + j * steps[1])).llvm_ptr,
                              out, nvvm.MMALayout.ROW)


def check_row_period(layout: cute.ComposedLayout, rows: int, cols: int, period: int = 16):
    """Host side: assert that `layout` (rows, cols, stages) maps (row + period t, col, stage)
    to offset(row, col, 0) + t * offset(period, 0, 0) + stage * rows * cols, which
    `VTranspose` relies on: the swizzle repeats every 8 rows and swizzle atoms are stacked
    down the rows (a row wider than one atom continues in the next column of atoms)."""
    step = cute.crd2idx((period, 0, 0), layout)
    for row in range(period):
        for col in range(0, cols, 16):
            base = cute.crd2idx((row, col, 0), layout)
            for t in range(1, rows // period):
                assert cute.crd2idx((row + period * t, col, 0), layout) == base + t * step, \
                    "layout is not row-periodic"
            assert cute.crd2idx((row, col, 1), layout) == base + rows * cols, \
                "stages are not contiguous"


def _fp8_operand(shape, stride):
    # S accumulator per thread: ((2, 2, V), MMA_M, MMA_N) = (column pair, rows r / r + 8,
    # V groups of 8 columns). FP8 A operand per k32 slice: ((4 k-slots, 2 rows, 2 halves)).
    # Slot 4q + i of a 16-wide half <- pair element i % 2 of column group i // 2 (see above).
    v = shape[0][2]
    if v % 4:
        raise ValueError("the kv tile must be a multiple of 32 columns to feed a k32 WGMMA")
    s0, s1, s2 = stride[0]
    return (
        (((2, 2), shape[0][1], 2), shape[1], (v // 4, shape[2])),
        (((s0, s2), s1, 2 * s2), stride[1], (4 * s2, stride[2])),
    )


def acc_as_fp8_operand(acc: cute.Tensor) -> cute.Tensor:
    """The S accumulator seen in the FP8 A-operand order (no register moves)."""
    from .layouts import _regrouped
    return cute.make_tensor(acc.iterator, _regrouped(acc.layout, _fp8_operand))


@cute.jit
def probs_to_fp8_operand(acc_s: cute.Tensor, p_frag: cute.Tensor):
    """P (fp32, S's registers) -> e4m3 A operand of O += P V (cvt.rn.satfinite.e4m3x2)."""
    p = acc_as_fp8_operand(acc_s)
    p_frag.store(p.load().to(p_frag.element_type))
