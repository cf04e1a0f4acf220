"""The CUDA-core attention tile (device side): k2's compute, reused by k3 and k4_qk.

One CTA of 256 threads owns a 64-row query tile and walks 64-column kv tiles. Everything is
fp32 FMAs on the CUDA cores; the tiles sit in shared memory as bf16 (what TMA delivers) in
the 128-byte-swizzled layout, and are widened to fp32 in registers 16 bytes at a time.

Thread (rg, cg): rg = 2 * warp + lane // 16 (0..15), cg = lane % 16 (0..15).

    S tile (64 x 64)   rows 4*rg .. 4*rg+3,  cols cg, cg+16, cg+32, cg+48     (4 x 4 regs)
    O tile (64 x d)    rows 4*rg .. 4*rg+3,  cols cg*d/16 .. (cg+1)*d/16 - 1  (4 x d/16 regs)

A row of S is spread over the 16 lanes of one half-warp (row max/sum = 4 butterfly
shuffles), and a thread owns the same rows of S and O, so rescaling O is thread-local.
Interleaving the S columns by 16 makes the 16 lanes read 16 consecutive K rows, which the
swizzle spreads over all banks.

P goes through shared memory transposed, P^T[kv col][query row] (fp32, rows padded by 4
floats): in P @ V each thread then reads its 4 rows of P for one kv column as one 16-byte
load, and the 16 lanes sharing those rows read the same address (a broadcast). The rows a
thread reads were written by its own half-warp, so warp barriers (not CTA barriers) order
the P store after the previous tile's P V loads and before this tile's.

Per thread: 16 S + 4*d/16 O accumulators, 8 + 8 operands per 8-wide step, ~100-130 regs.
SMEM: Q, K, V tiles 64*d*2 bytes each (+ stages), P^T 64*68*4 = 17 KiB.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from .masking import mask_scores
from .softmax import OnlineSoftmax, scale_rows


# Frozen dataclasses: the DSL passes them through dynamic loops as constants (a plain object
# whose method is called inside a loop would have to be carried as a loop variable).
@dataclasses.dataclass(frozen=True)
class ScalarTile:
    head_dim: int
    unroll: int = 4            # 8-column chunks of head_dim per trip of the S loop (P V: 2x rows)
    block_m: ClassVar[int] = 64
    block_n: ClassVar[int] = 64
    threads: ClassVar[int] = 256
    rows_per_thread: ClassVar[int] = 4
    lanes_per_row: ClassVar[int] = 16      # threads sharing one row of S (a half-warp)
    s_cols_per_thread: ClassVar[int] = 4   # block_n // lanes_per_row
    chunk: ClassVar[int] = 8               # bf16 per 16-byte shared-memory read
    p_pad: ClassVar[int] = 4               # floats of padding per P^T row (bank spread)

    def __post_init__(self):
        if self.head_dim % 16 != 0:
            raise ValueError(f"head_dim must be a multiple of 16, got {self.head_dim}")
        if (self.head_dim // self.chunk) % self.unroll or self.block_n % (2 * self.unroll):
            raise ValueError(f"unroll={self.unroll} must divide head_dim/8 and block_n/2")

    @property
    def o_cols(self) -> int:
        """Contiguous O columns per thread."""
        return self.head_dim // 16

    # ---------------------------------------------------------------- layouts and views
    def p_layout(self, buffers: int = 1) -> cute.Layout:
        """P^T in SMEM: [kv column j, query row i, buffer], fp32, rows padded."""
        row = self.block_m + self.p_pad
        return cute.make_layout((self.block_n, self.block_m, buffers),
                                stride=(row, 1, row * self.block_n))

    def thread_groups(self, tidx: Int32):
        warp = tidx // 32
        lane = tidx % 32
        return warp * 2 + lane // 16, lane % 16

    def my_rows(self, t: cute.Tensor, rg: Int32) -> cute.Tensor:
        """Rows 4*rg .. 4*rg+3 of a (rows, cols) tile."""
        return cute.local_tile(t, (self.rows_per_thread, cute.size(t, mode=[1])), (rg, 0))

    def my_kv_rows(self, t: cute.Tensor, cg: Int32) -> cute.Tensor:
        """Rows cg, cg+16, cg+32, cg+48 of a (block_n, cols) tile."""
        return cute.local_partition(t, cute.make_layout((self.lanes_per_row, 1)), cg)

    def s_coords(self, rg: Int32, cg: Int32) -> cute.Tensor:
        """(row, col) inside the tile of each S register, as a 4 x 4 [row, col] tensor."""
        c_s = cute.make_identity_tensor((self.block_m, self.block_n))
        mine = self.my_rows(c_s, rg)
        return cute.local_partition(mine, cute.make_layout((1, self.lanes_per_row)), cg)

    def p_slots(self, s_pt: cute.Tensor, rg: Int32, cg: Int32) -> cute.Tensor:
        """Where this thread's S/P values live in P^T: [s col b, s row a] (4 x 4)."""
        cols = self.my_kv_rows(s_pt, cg)                          # (4, block_m)
        return cute.local_tile(cols, (self.s_cols_per_thread, self.rows_per_thread), (0, rg))

    def pv_views(self, s_pt: cute.Tensor, s_v: cute.Tensor, rg: Int32, cg: Int32):
        """P^T columns of my rows (block_n x 4) and V columns of my O columns (block_n x d/16)."""
        p_rows = cute.local_tile(s_pt, (self.block_n, self.rows_per_thread), (0, rg))
        v_cols = cute.local_tile(s_v, (self.block_n, self.o_cols), (0, cg))
        return p_rows, v_cols

    def new_o_accumulator(self) -> cute.Tensor:
        acc_o = cute.make_rmem_tensor((self.rows_per_thread, self.o_cols), Float32)
        acc_o.fill(0.0)
        return acc_o

    def new_softmax(self, scale_log2: Float32) -> OnlineSoftmax:
        return OnlineSoftmax.create(self.rows_per_thread, scale_log2, self.lanes_per_row)

    # ---------------------------------------------------------------- the math
    @cute.jit
    def qk(self, q_rows: cute.Tensor, k_rows: cute.Tensor) -> cute.Tensor:
        """S[a, b] = sum_k Q[a, k] K[b, k] for my 4 query rows and 4 kv rows (fp32)."""
        acc_s = cute.make_rmem_tensor((self.rows_per_thread, self.s_cols_per_thread), Float32)
        acc_s.fill(0.0)
        # ((1, 8) chunk, (row, chunk index)): one 16-byte read per (row, chunk index)
        q_chunks = cute.zipped_divide(q_rows, (1, self.chunk))
        k_chunks = cute.zipped_divide(k_rows, (1, self.chunk))
        q = cute.make_rmem_tensor(((1, self.chunk), self.rows_per_thread), Float32)
        k = cute.make_rmem_tensor(((1, self.chunk), self.s_cols_per_thread), Float32)
        # Unrolled by hand, `unroll` chunks per trip, so the compiler can issue later chunks'
        # loads while FMAs run (in CuTe DSL 4.5.3 an `unroll=` on a loop nested in another
        # dynamic loop was seen to unroll the outer loop instead).
        per_trip = self.unroll
        for trip in cutlass.range(self.head_dim // (per_trip * self.chunk), unroll=1):
            for part in cutlass.range_constexpr(per_trip):
                c = trip * per_trip + part
                for a in cutlass.range_constexpr(self.rows_per_thread):
                    q[None, a].store(q_chunks[None, (a, c)].load().to(Float32))   # bf16 -> fp32
                for b in cutlass.range_constexpr(self.s_cols_per_thread):
                    k[None, b].store(k_chunks[None, (b, c)].load().to(Float32))
                for a in cutlass.range_constexpr(self.rows_per_thread):
                    for b in cutlass.range_constexpr(self.s_cols_per_thread):
                        for e in cutlass.range_constexpr(self.chunk):
                            acc_s[a, b] += q[(0, e), a] * k[(0, e), b]
        return acc_s

    @cute.jit
    def pv(self, p_rows: cute.Tensor, v_cols: cute.Tensor, acc_o: cute.Tensor):
        """O[a, e] += sum_j P[a, j] V[j, e] over the kv tile, P read from P^T."""
        p = cute.make_rmem_tensor((self.rows_per_thread,), Float32)
        v = cute.make_rmem_tensor((self.o_cols,), Float32)
        per_trip = 2 * self.unroll
        for trip in cutlass.range(self.block_n // per_trip, unroll=1):
            for part in cutlass.range_constexpr(per_trip):
                j = trip * per_trip + part
                p.store(p_rows[j, None].load())
                v.store(v_cols[j, None].load().to(Float32))
                for a in cutlass.range_constexpr(self.rows_per_thread):
                    for e in cutlass.range_constexpr(self.o_cols):
                        acc_o[a, e] += p[a] * v[e]

    @cute.jit
    def store_p(self, acc_s: cute.Tensor, p_slots: cute.Tensor):
        for b in cutlass.range_constexpr(self.s_cols_per_thread):
            p_slots[b, None].store(acc_s[None, b].load())

    @cute.jit
    def load_s(self, p_slots: cute.Tensor) -> cute.Tensor:
        """Read my 4 x 4 scores back from P^T (k4_qk: the WGMMA wrote S there)."""
        acc_s = cute.make_rmem_tensor((self.rows_per_thread, self.s_cols_per_thread), Float32)
        for b in cutlass.range_constexpr(self.s_cols_per_thread):
            acc_s[None, b].store(p_slots[b, None].load())
        return acc_s

    @cute.jit
    def attend(self, acc_s: cute.Tensor, acc_o: cute.Tensor, softmax: OnlineSoftmax,
               needs_mask, s_coords: cute.Tensor, row0: Int32, col0: Int32, seqlen: Int32,
               causal: cutlass.Constexpr[bool], p_slots: cute.Tensor, p_rows: cute.Tensor,
               v_cols: cute.Tensor):
        """One kv tile after S is known: mask, online softmax, P -> SMEM, O = O*alpha + P V.

        P rows are written and read by one half-warp only, so two warp barriers (which also
        order shared memory among the warp's lanes) replace CTA-wide ones.
        """
        if needs_mask:
            mask_scores(acc_s, s_coords, row0, col0, seqlen, causal)
        alpha = softmax.step(acc_s)
        scale_rows(acc_o, alpha)
        cute.arch.sync_warp()     # my warp is done reading the previous tile's P
        self.store_p(acc_s, p_slots)
        cute.arch.sync_warp()     # ... and has written this tile's P
        self.pv(p_rows, v_cols, acc_o)

    # ---------------------------------------------------------------- global memory
    @cute.jit
    def load_tile(self, g_tile: cute.Tensor, s_tile: cute.Tensor, rows_left: Int32, tidx: Int32):
        """Thread-strided 16-byte copies of a (rows, d) tile; rows >= rows_left become 0."""
        rows = cute.size(g_tile, mode=[0])
        chunks_per_row = self.head_dim // self.chunk
        g = cute.zipped_divide(g_tile, (1, self.chunk))
        s = cute.zipped_divide(s_tile, (1, self.chunk))
        frag = cute.make_rmem_tensor((1, self.chunk), BFloat16)
        for i in cutlass.range_constexpr(rows * chunks_per_row // self.threads):
            idx = tidx + i * self.threads
            r = idx // chunks_per_row
            c = idx % chunks_per_row
            if r < rows_left:
                frag.store(g[None, (r, c)].load())
            else:
                frag.fill(0.0)
            s[None, (r, c)].store(frag.load())

    @cute.jit
    def store_o(self, acc_o: cute.Tensor, g_o: cute.Tensor, inv_l: cute.Tensor,
                rows_left: Int32, rg: Int32, cg: Int32):
        """O / l -> bf16 -> global, my 4 rows x d/16 contiguous columns, rows < rows_left."""
        mine = cute.local_tile(g_o, (self.rows_per_thread, self.o_cols), (rg, cg))
        scale_rows(acc_o, inv_l)
        for a in cutlass.range_constexpr(self.rows_per_thread):
            if rg * self.rows_per_thread + a < rows_left:
                mine[a, None].store(acc_o[a, None].load().to(BFloat16))
