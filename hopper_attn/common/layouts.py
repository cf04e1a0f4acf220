"""Layout views shared by the kernels (device side, CuTe DSL).

Nothing here moves data: every function returns a new *view* (same memory, another layout).

* ``ndhb_view``: torch's (batch, seqlen, heads, head_dim) tensor seen as (seqlen, head_dim,
  heads, batch), so that ``t[None, None, h, b]`` is one head's (seqlen, head_dim) matrix, the
  shape TMA tiles and ``local_tile`` slice. The runtime strides are declared multiples of
  8 elements (16 bytes), which lets the compiler emit 16-byte vector loads and stores.
* ``smem_tile_layout``: the swizzled shared-memory layout Hopper's TMA and WGMMA agree on
  (128-byte swizzle, head_dim contiguous), optionally with a stage mode for a ring buffer.
* ``acc_rows_cols``: a WGMMA accumulator fragment seen as a (rows, cols) matrix per thread.
* ``acc_as_operand_a``: the same registers seen as the A operand of a following WGMMA.
* ``transposed``: the first two modes swapped (V (kv, d) read as (d, kv) for P @ V).
* ``wg_major_o_buffer``: k6's and k7's own O buffer as one (64, d) slab per warpgroup.
"""

from __future__ import annotations

import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum


def ndhb_view(t: cute.Tensor) -> cute.Tensor:
    """(B, N, H, d) tensor -> (N, d, H, B) view with 16-byte-divisible runtime strides."""
    layout = cute.select(t.layout, mode=[1, 3, 2, 0])
    strides = tuple(s if isinstance(s, int) else cute.assume(s, divby=8) for s in layout.stride)
    return cute.make_tensor(t.iterator, cute.make_layout(layout.shape, stride=strides))


def smem_tile_layout(dtype, rows: int, cols: int, stages: int | None = None,
                     atom_cols: int | None = None):
    """Swizzled SMEM layout for a (rows, cols) tile with cols contiguous, times `stages`.

    The swizzle atom is the widest one the row length allows (128 B for head_dim >= 64 in
    bf16): 16-byte chunks of a row are XOR-permuted by the row index, which is what TMA's
    SWIZZLE_128B mode writes and what a K-major WGMMA descriptor reads. For scalar code the
    payoff is the same: 8 consecutive rows at the same column land in 8 different bank groups.
    `atom_cols`: pick the atom for rows this many elements wide instead (a narrower swizzle,
    for a tile also read MN-major in column blocks the row's atom does not divide).
    """
    atom_kind = sm90_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, atom_cols or cols)
    atom = warpgroup.make_smem_layout_atom(atom_kind, dtype)
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def smem_bytes(nbytes: int) -> int:
    """A shared-memory buffer's footprint: its bytes rounded up to the 1024-byte alignment
    every swizzled tile buffer gets (for the kernels' SMEM estimates)."""
    return -(-nbytes // 1024) * 1024


def qkv_smem(storage, q_layout, kv_layout):
    """The Q tile and the K and V rings of a SharedStorage (fields sQ, sK, sV) as swizzled
    tensors: (block_m, d), (block_n, d, stage), (block_n, d, stage)."""
    return tuple(buf.get_tensor(layout.outer, swizzle=layout.inner)
                 for buf, layout in ((storage.sQ, q_layout), (storage.sK, kv_layout),
                                     (storage.sV, kv_layout)))


def transposed(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of `t` (further modes, e.g. the stage, are kept)."""
    rank = cute.rank(t)
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    # a compact layout over the swapped shape whose mode 1 runs fastest, then compose:
    # element (i, j, ...) of the result is element (j, i, ...) of t
    swap = cute.make_ordered_layout(shape, order=(1, 0, *range(2, rank)))
    return cute.composition(t, swap)


def swap_modes(layout):
    """`transposed` for a (possibly swizzled) layout: the same memory indexed with the first
    two modes swapped (host side, e.g. a TMA box written as the transpose of an SMEM tile)."""
    rank = cute.rank(layout)
    shape = (layout.shape[1], layout.shape[0], *layout.shape[2:])
    return cute.composition(layout, cute.make_ordered_layout(shape, order=(1, 0, *range(2, rank))))


def _regrouped(layout: cute.Layout, regroup) -> cute.Layout:
    # `regroup` rearranges the modes of a compact layout over layout's own domain; composing
    # with it works for any fragment layout, including coordinate probes whose "strides" are
    # coordinate bases rather than integers.
    domain = cute.make_layout(layout.shape)
    shape, stride = regroup(domain.shape, domain.stride)
    return cute.composition(layout, cute.make_layout(shape, stride=stride))


def _rows_cols(shape, stride):
    # A WGMMA accumulator fragment has shape ((2, 2, V), MMA_M, MMA_N) per thread:
    #   mode 0.0: two adjacent columns, 0.1: rows r and r + 8, 0.2: V column groups 8 apart,
    #   then the tile repeats MMA_M times down and MMA_N times across.
    # Regroup the same registers as ((2, MMA_M) rows, (2, V, MMA_N) columns).
    return (
        ((shape[0][1], shape[1]), (shape[0][0], shape[0][2], shape[2])),
        ((stride[0][1], stride[1]), (stride[0][0], stride[0][2], stride[2])),
    )


def acc_rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """View a WGMMA accumulator (or its coordinate probe) as [row, col] per thread."""
    return cute.make_tensor(acc.iterator, _regrouped(acc.layout, _rows_cols))


def _operand_a(shape, stride):
    v = shape[0][2]
    if v % 2 != 0:
        raise ValueError("the kv tile must be a multiple of 16 columns to feed a k16 WGMMA")
    s2 = stride[0][2]
    return (
        ((shape[0][0], shape[0][1], 2), shape[1], (v // 2, shape[2])),
        ((stride[0][0], stride[0][1], s2), stride[1], (s2 * 2, stride[2])),
    )


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """View the accumulator of S = Q K^T as the register A operand of O += P V.

    For 16-bit inputs a k16 slice of the A operand holds (2 cols, 2 rows, 2 column halves
    8 apart) per thread, which is exactly two neighbouring 8-column groups of the
    accumulator. So the V column groups of mode 0 are taken in pairs: ((2, 2, V), MMA_M,
    MMA_N) becomes ((2, 2, 2), MMA_M, (V / 2, MMA_N)). No register moves; a bf16 copy made
    through this view has the A-fragment layout the PV WGMMA expects.
    """
    return cute.make_tensor(acc.iterator, _regrouped(acc.layout, _operand_a))


def operand_a_as_acc(frag: cute.Tensor, acc: cute.Tensor) -> cute.Tensor:
    """The registers of an A fragment written through `acc_as_operand_a(acc)`, viewed with
    the accumulator's own layout: the regrouping keeps the register order when a warpgroup
    holds one MMA tile along M, so element i of one view is element i of the other. A tile
    converted once (e.g. dS^T in bf16) can then feed a register-A WGMMA and be stored to
    SMEM through the accumulator's partition, without a second conversion."""
    if cute.size(acc.shape[1]) != 1:
        raise ValueError("operand_a_as_acc needs one MMA tile along M per warpgroup")
    return cute.make_tensor(frag.iterator, acc.layout)


@cute.jit
def wg_major_o_buffer(storage, dtype, warpgroups: int, head_dim: int):
    """O's own buffer as one (64, d) TMA box per consumer warpgroup: (a (64 x W, d) view for
    the stmatrix partition, the (64, d, W) slabs), one swizzle (slabs 1024-byte aligned)."""
    slabs = smem_tile_layout(dtype, 64, head_dim, warpgroups)
    outer = slabs.outer
    rows = cute.make_layout(((outer.shape[0], outer.shape[2]), outer.shape[1]),
                            stride=((outer.stride[0], outer.stride[2]), outer.stride[1]))
    return (storage.sO.get_tensor(rows, swizzle=slabs.inner),
            storage.sO.get_tensor(outer, swizzle=slabs.inner))
