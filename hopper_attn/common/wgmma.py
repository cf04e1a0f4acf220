"""Warpgroup MMA (WGMMA) helpers shared by k4_qk and k4.

A WGMMA is issued by a warpgroup (4 consecutive warps, 128 threads) and computes a
64 x N x 16 tile: A (64 x 16) from shared memory or registers, B (N x 16) from shared memory,
both read through 64-bit SMEM descriptors (start address, strides, swizzle mode) built from
the swizzled layouts in layouts.py. The accumulator stays in registers of the 128 threads.
The instruction is asynchronous:

    warpgroup.fence()         order earlier register writes (accumulator, A) before the MMA
    wgmma.mma_async ... x K/16  one per 16-wide slice of the reduction dimension
    warpgroup.commit_group()  close the batch
    warpgroup.wait_group(n)   wait until at most n batches are still in flight
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import BFloat16, Float32
from cutlass.cute.nvgpu import warpgroup

from .layouts import acc_as_operand_a, acc_rows_cols, transposed


def qk_mma(warpgroups_m: int, warpgroups_n: int, tile_n: int, dtype=BFloat16,
           acc_dtype=Float32):
    """S = Q K^T: Q (M x d) and K (N x d) both K-major (head_dim contiguous) in SMEM.

    Each warpgroup computes 64 rows x tile_n columns; warpgroups are stacked
    `warpgroups_m` down and `warpgroups_n` across. `acc_dtype`: S's type (fp32; k7's
    `s_f16`: fp16, two scores per register)."""
    return sm90_helpers.make_trivial_tiled_mma(
        dtype, dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
        acc_dtype, (warpgroups_m, warpgroups_n, 1), tiler_mn=(64, tile_n))


def pv_mma(warpgroups_m: int, head_dim: int, dtype=BFloat16, vt_k_major: bool = False):
    """O += P V: P from registers (the converted S accumulator), V from SMEM read
    MN-major: V is stored (kv, d) with d contiguous, and B = V^T (d x kv) therefore has its
    N dimension (d) contiguous. FP8 WGMMAs read only K-major SMEM operands, so k7 stores V
    transposed, (d, kv) with kv contiguous (`vt_k_major`)."""
    b_major = cute.nvgpu.OperandMajorMode.K if vt_k_major else cute.nvgpu.OperandMajorMode.MN
    return sm90_helpers.make_trivial_tiled_mma(
        dtype, dtype, cute.nvgpu.OperandMajorMode.K, b_major,
        Float32, (warpgroups_m, 1, 1), tiler_mn=(64, head_dim),
        a_source=warpgroup.OperandSource.RMEM)


def smem_mma(warpgroups_m: int, warpgroups_n: int, tile_n: int, a_major, b_major,
             dtype=BFloat16):
    """Both operands from SMEM with the given major modes (the backward's dQ = dS K reads
    dS^T and K, both MN-major); warpgroups stacked as in `qk_mma`."""
    return sm90_helpers.make_trivial_tiled_mma(
        dtype, dtype, a_major, b_major, Float32, (warpgroups_m, warpgroups_n, 1),
        tiler_mn=(64, tile_n))


def dq_mma(head_dim: int, dtype=BFloat16, swap_ab: bool = False, block_m: int = 64,
           rows: bool = False):
    """The backward's dQ = dS K for a query tile of `block_m` rows (a multiple of 64): two
    warpgroups side by side, each block_m x d/2 (A = dS and B = K^T, both read MN-major from
    SMEM). A WGMMA's M is a multiple of 64, so a tile of 80 rows (kb2 at d = 128) computes
    the transpose instead (`swap_ab`): dQ^T = K^T dS^T, the warpgroups one above the other
    over head_dim (64 rows each) and the query rows as N. `rows` (128-row tiles): the
    warpgroups one above the other, 64 query rows x d each (FA4's at d = 64): half the
    WGMMAs, each twice as wide, and K^T read once a k-step instead of twice."""
    mn = cute.nvgpu.OperandMajorMode.MN
    if swap_ab:
        return smem_mma(head_dim // 64, 1, block_m, mn, mn, dtype)
    if rows:
        return smem_mma(block_m // 64, 1, head_dim, mn, mn, dtype)
    return smem_mma(1, 2, head_dim // 2, mn, mn, dtype)


def dq_tile_shape(block_m: int, head_dim: int, swap_ab: bool = False) -> tuple:
    """The (M, N) tile `dq_mma` computes: dQ (block_m, d), or dQ^T (d, block_m) with swap_ab
    (what the kernel's accumulator and the postprocess's partition both use)."""
    return (head_dim, block_m) if swap_ab else (block_m, head_dim)


@cute.jit
def gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor,
         zero_init: cutlass.Constexpr[bool], k_blocks=None):
    """Issue acc (+)= A B as one committed WGMMA batch (does not wait). k_blocks: (first,
    end) of the K blocks to issue (a part of the product), default all."""
    warpgroup.fence()
    first, end = (0, cute.size(a, mode=[2])) if k_blocks is None else k_blocks
    # a fresh atom: its ACCUMULATE field is flipped after the first k-slice
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(first, end):
        cute.gemm(atom, acc, a[None, None, k], b[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


def warpgroup_slice(tiled_mma: cute.TiledMma, tidx, uniform: bool = True):
    """The slice of `tiled_mma` owned by the warpgroup of thread `tidx` (operand partitions
    are per warpgroup: the SMEM descriptors are shared by its 128 threads). The warpgroup
    index goes through `make_warp_uniform`: without it the compiler builds every SMEM
    descriptor in per-thread registers and copies it to uniform ones (R2UR) before each
    WGMMA."""
    if not uniform:                        # (k6's POLICY column uniform_descriptors)
        return tiled_mma.get_slice((tidx // 128) * 128)
    return tiled_mma.get_slice(cute.arch.make_warp_uniform(tidx // 128) * 128)


def stmatrix_store(tiled_mma: cute.TiledMma, dtype, num_matrices: int = 4) -> cute.TiledCopy:
    """A copy from `tiled_mma`'s accumulator layout (converted to the 16-bit `dtype`) to
    shared memory with `stmatrix`: four 8 x 8 blocks per warp instruction, instead of one
    4-byte store (and its swizzled address) per register pair. Used for O (k5-k7's
    epilogue) and dS^T (kb2). `num_matrices` 2: two blocks (16 x 8 a warp), for an N that
    is not a multiple of 16 (kb2's dkv_swap_ab at d = 256: 24 keys a warpgroup)."""
    return cute.make_tiled_copy_C(
        cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False,
                                                              num_matrices=num_matrices),
                            dtype), tiled_mma)


@dataclasses.dataclass(frozen=True)
class AttentionMmas:
    """The two GEMMs of a warpgroup-per-64-rows attention kernel (k4 on), partitioned for
    thread `tidx` (counted from the first thread of the first computing warpgroup).

    S = Q K^T takes both operands from SMEM; O += P V takes P from registers (`p_frag`,
    bf16) and V^T from SMEM (`vt_frag`, MN-major). Operand fragments are SMEM descriptors
    shared by a warpgroup; accumulators and `s_coords` (each S register's (row, col) in the
    tile, as a [row, col] view) are per thread.
    """

    mma_qk: cute.TiledMma
    mma_pv: cute.TiledMma
    thr_qk: object
    thr_pv: object
    q_frag: cute.Tensor
    k_frag: cute.Tensor
    vt_frag: cute.Tensor
    p_frag: cute.Tensor             # registers
    s_coords: cute.Tensor
    s_dtype: object = Float32       # S's accumulator type

    @staticmethod
    def create(warpgroups: int, block_m: int, block_n: int, head_dim: int, tidx,
               sQ: cute.Tensor, sK: cute.Tensor, sVt: cute.Tensor,
               dtype=BFloat16, uniform: bool = True,
               vt_k_major: bool = False, s_dtype=Float32,
               head_dim_v: int = 0) -> "AttentionMmas":
        """`s_dtype`: S's accumulator type; `head_dim_v`: V's and O's head dim, the PV
        GEMM's N (0: head_dim); `sQ` None: no Q tile (Q from registers:
        `with_q_in_registers`)."""
        mma_qk = qk_mma(warpgroups, 1, block_n, dtype, s_dtype)
        mma_pv = pv_mma(warpgroups, head_dim_v or head_dim, dtype, vt_k_major)
        wg_qk = warpgroup_slice(mma_qk, tidx, uniform)
        wg_pv = warpgroup_slice(mma_pv, tidx, uniform)
        thr_qk, thr_pv = mma_qk.get_slice(tidx), mma_pv.get_slice(tidx)
        p_frag = wg_pv.make_fragment_A(wg_pv.partition_shape_A((block_m, block_n)))
        return AttentionMmas(
            mma_qk, mma_pv, thr_qk, thr_pv,
            q_frag=None if sQ is None else wg_qk.make_fragment_A(wg_qk.partition_A(sQ)),
            k_frag=wg_qk.make_fragment_B(wg_qk.partition_B(sK)),
            vt_frag=wg_pv.make_fragment_B(wg_pv.partition_B(sVt)),
            p_frag=p_frag,
            s_coords=acc_rows_cols(thr_qk.partition_C(
                cute.make_identity_tensor((block_m, block_n)))),
            s_dtype=s_dtype)

    def new_o_accumulator(self, block_m: int, head_dim: int) -> cute.Tensor:
        """O (fp32, per thread), zeroed."""
        acc_o = cute.make_rmem_tensor(self.thr_pv.partition_shape_C((block_m, head_dim)), Float32)
        acc_o.fill(0.0)
        return acc_o

    def new_s_accumulator(self, block_m: int, block_n: int) -> cute.Tensor:
        return cute.make_rmem_tensor(self.thr_qk.partition_shape_C((block_m, block_n)),
                                     self.s_dtype)


def with_q_in_registers(mmas: AttentionMmas, sK: cute.Tensor, q_acc: cute.Tensor,
                        tidx) -> AttentionMmas:
    """`mmas` (one warpgroup) with S = Q K^T taking Q from registers (an RS WGMMA), so that
    no kv tile's WGMMA reads Q from SMEM again. `q_acc`: Q (16-bit) held in the layout of
    a 64 x d O accumulator (mma_pv's C), turned into the A fragment as P is
    (`acc_as_operand_a`)."""
    block_n, head_dim = cute.size(sK, mode=[0]), cute.size(sK, mode=[1])
    dtype = sK.element_type
    mma_qk = sm90_helpers.make_trivial_tiled_mma(
        dtype, dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
        mmas.s_dtype, (1, 1, 1), tiler_mn=(64, block_n),
        a_source=warpgroup.OperandSource.RMEM)
    wg = warpgroup_slice(mma_qk, tidx)
    q_frag = wg.make_fragment_A(wg.partition_shape_A((64, head_dim)))
    q_frag.store(acc_as_operand_a(q_acc).load())
    return dataclasses.replace(mmas, mma_qk=mma_qk, q_frag=q_frag,
                               k_frag=wg.make_fragment_B(wg.partition_B(sK)))


@dataclasses.dataclass(frozen=True)
class BackwardMmas:
    """The five GEMMs of a backward CTA (kb1, kb2) that owns `block_n` keys (64 per
    warpgroup) and walks `block_m`-row query tiles, partitioned for thread `tidx` (counted
    from the first computing thread):

        S^T = K Q^T, dP^T = V dO^T   mma_sdp: keys x queries, A and B K-major from SMEM
        dV += P^T dO, dK += dS^T Q   mma_dkv: keys x d, A from registers (pt_frag, dst_frag),
                                     B = dO^T, Q^T (the same tiles read MN-major)
        dQ = dS K                    mma_dq: queries x d/2 per warpgroup, A = (dS^T)^T and
                                     B = K^T, both MN-major from SMEM; with `dq_swap_ab`
                                     dQ^T = K^T dS^T, 64 of d x queries per warpgroup

    sQ and sdO have a stage mode, sdSt (keys x queries) a buffer mode. `st_coords[r, c]` is
    the (key, query) of S^T register [r, c] inside the tile.

    `shared_keys` (kb2 at d = 192): both warpgroups on the same 64 keys, S^T and dP^T split
    by queries (block_m / 2 each), dK and dV by columns (d / 2 each), so each thread holds
    d / 2 dK and dV floats instead of d (with v's head dim dv: dv / 2 dV floats, `mma_dv`).
    Neither warpgroup then holds all of P^T or dS^T: both go through SMEM (sPt, sdSt, by
    buffer) and pt_frag / dst_frag are SMEM fragments.
    """

    mma_sdp: cute.TiledMma
    mma_dkv: cute.TiledMma
    mma_dq: cute.TiledMma
    thr_sdp: object
    thr_dkv: object
    thr_dq: object
    k_frag: cute.Tensor
    v_frag: cute.Tensor
    q_frag: cute.Tensor
    do_frag: cute.Tensor
    dot_frag: cute.Tensor
    qt_frag: cute.Tensor
    pt_frag: cute.Tensor
    dst_frag: cute.Tensor
    ds_frag: cute.Tensor
    kt_frag: cute.Tensor
    st_coords: cute.Tensor
    mma_dv: cute.TiledMma = None    # dV += P^T dO where dV is narrower than dK (dv != d;
    thr_dv: object = None           # else mma_dkv and thr_dkv)
    dq_swap_ab: bool = False
    shared_keys: bool = False

    @staticmethod
    def create(warpgroups: int, block_m: int, block_n: int, head_dim: int, tidx,
               sK: cute.Tensor, sV: cute.Tensor, sQ: cute.Tensor, sdO: cute.Tensor,
               sdSt: cute.Tensor, dtype=BFloat16, dq_swap_ab: bool = False,
               columns=None, sPt=None, head_dim_v: int = 0,
               dq_rows: bool = False) -> "BackwardMmas":
        """`columns`: (head_dim part, sK, sQ, sdO views of that part's columns) when this
        CTA computes dK, dV and dQ for part of d only (S^T and dP^T still contract over all
        of it); None: all of d. `head_dim_v`: V's, dO's and dV's head dim (0: head_dim;
        dP^T = V dO^T then contracts over it)."""
        bm, bn = block_m, block_n
        d_out, sK_out, sQ_out, sdO_out = columns or (head_dim, sK, sQ, sdO)
        # shared_keys (see above): 64 keys x (queries, columns) split between warpgroups
        shared_keys = sPt is not None
        mma_sdp = qk_mma(1, 2, bm // 2, dtype) if shared_keys else qk_mma(warpgroups, 1, bm, dtype)
        wg_sdp, thr_sdp = warpgroup_slice(mma_sdp, tidx), mma_sdp.get_slice(tidx)
        mma_dkv = smem_mma(1, 2, d_out // 2, cute.nvgpu.OperandMajorMode.K,
                           cute.nvgpu.OperandMajorMode.MN, dtype) if shared_keys \
            else pv_mma(warpgroups, d_out, dtype)
        wg_dkv, thr_dkv = warpgroup_slice(mma_dkv, tidx), mma_dkv.get_slice(tidx)
        mma_dv, wg_dv, thr_dv = mma_dkv, wg_dkv, thr_dkv
        if head_dim_v and head_dim_v != head_dim:
            # (shared_keys: dV's columns split at dv / 2 per warpgroup, P^T from SMEM)
            mma_dv = smem_mma(1, 2, head_dim_v // 2, cute.nvgpu.OperandMajorMode.K,
                              cute.nvgpu.OperandMajorMode.MN, dtype) if shared_keys \
                else pv_mma(warpgroups, head_dim_v, dtype)
            wg_dv, thr_dv = warpgroup_slice(mma_dv, tidx), mma_dv.get_slice(tidx)
        mma_dq = dq_mma(d_out, dtype, dq_swap_ab, bm, dq_rows)      # (dq_rows: dq_mma)
        wg_dq, thr_dq = warpgroup_slice(mma_dq, tidx), mma_dq.get_slice(tidx)
        if dq_swap_ab:          # dQ^T = K^T dS^T: K^T is A (d x keys), dS^T is B (queries x keys)
            ds_frag = wg_dq.make_fragment_B(wg_dq.partition_B(transposed(sdSt)))
            kt_frag = wg_dq.make_fragment_A(wg_dq.partition_A(transposed(sK_out)))
        else:
            ds_frag = wg_dq.make_fragment_A(wg_dq.partition_A(transposed(sdSt)))
            kt_frag = wg_dq.make_fragment_B(wg_dq.partition_B(transposed(sK_out)))
        return BackwardMmas(
            mma_sdp, mma_dkv, mma_dq, thr_sdp, thr_dkv, thr_dq,
            k_frag=wg_sdp.make_fragment_A(wg_sdp.partition_A(sK)),
            v_frag=wg_sdp.make_fragment_A(wg_sdp.partition_A(sV)),
            q_frag=wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ)),
            do_frag=wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO)),
            dot_frag=wg_dv.make_fragment_B(wg_dv.partition_B(transposed(sdO_out))),
            qt_frag=wg_dkv.make_fragment_B(wg_dkv.partition_B(transposed(sQ_out))),
            pt_frag=wg_dv.make_fragment_A(wg_dv.partition_A(sPt)) if shared_keys
            else wg_dkv.make_fragment_A(wg_dkv.partition_shape_A((bn, bm))),
            dst_frag=wg_dkv.make_fragment_A(wg_dkv.partition_A(sdSt) if shared_keys
                                            else wg_dkv.partition_shape_A((bn, bm))),
            ds_frag=ds_frag, kt_frag=kt_frag,
            st_coords=acc_rows_cols(thr_sdp.partition_C(cute.make_identity_tensor((bn, bm)))),
            dq_swap_ab=dq_swap_ab, shared_keys=shared_keys, mma_dv=mma_dv,
            thr_dv=thr_dv)

    def issue_dv(self, acc_dv: cute.Tensor, stage, k_blocks: tuple, buf=0):
        """dV += P^T dO over P^T's K blocks (16 queries each) first .. end - 1 (`k_blocks`),
        one WGMMA batch: all of them at once, or in the two parts of kb2's `split_dv`;
        dO from Q / dO ring stage `stage`, P^T (shared_keys) from SMEM buffer `buf`."""
        gemm(self.mma_dv, acc_dv, self.dkv_operand_a(self.pt_frag, buf),
             self.dot_frag[None, None, None, stage], zero_init=False, k_blocks=k_blocks)

    def dkv_operand_a(self, frag: cute.Tensor, buf) -> cute.Tensor:
        """P^T (pt_frag) or dS^T (dst_frag) as dV's or dK's A operand: the registers, or
        with shared_keys the SMEM buffer `buf`."""
        return frag[None, None, None, buf] if self.shared_keys else frag

    def dq_operands(self, buf):
        """(A, B) of the dQ GEMM, dS^T read from SMEM buffer `buf`."""
        if self.dq_swap_ab:
            return self.kt_frag, self.ds_frag[None, None, None, buf]
        return self.ds_frag[None, None, None, buf], self.kt_frag

    def new_dkv_accumulator(self, block_n: int, head_dim: int) -> cute.Tensor:
        """dK or dV (fp32, per thread), zeroed."""
        acc = cute.make_rmem_tensor(self.thr_dkv.partition_shape_C((block_n, head_dim)), Float32)
        acc.fill(0.0)
        return acc

    def new_dv_accumulator(self, block_n: int, head_dim_v: int) -> cute.Tensor:
        """dV (fp32, per thread), zeroed: dK's where dv = d."""
        acc = cute.make_rmem_tensor(self.thr_dv.partition_shape_C((block_n, head_dim_v)),
                                    Float32)
        acc.fill(0.0)
        return acc

    def new_st_accumulator(self, block_m: int, block_n: int) -> cute.Tensor:
        """S^T or dP^T (fp32, per thread)."""
        return cute.make_rmem_tensor(self.thr_sdp.partition_shape_C((block_n, block_m)), Float32)

    def new_dq_accumulator(self, block_m: int, head_dim: int) -> cute.Tensor:
        """dQ (or dQ^T with dq_swap_ab) of a query tile (fp32, per thread)."""
        shape = dq_tile_shape(block_m, head_dim, self.dq_swap_ab)
        return cute.make_rmem_tensor(self.thr_dq.partition_shape_C(shape), Float32)
