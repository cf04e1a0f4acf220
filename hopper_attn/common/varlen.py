"""Variable-length (packed) batches: per-sequence lengths and TMA over ragged tensors.

A packed batch holds its sequences back to back in one token dimension: q is (total_q, H, d),
k and v (total_k, H_kv, d), sequence b owning tokens cu_seqlens[b] .. cu_seqlens[b + 1] - 1
(int32 device tensors of batch + 1 entries; FlashAttention's `flash_attn_varlen_func`
convention). `seqused_k` (optional, int32 (batch,)) uses only the first seqused_k[b] keys of
sequence b. The forward (k6 with `varlen`) and the backward (kb2) share this module:

Interface (stable; additions only):

* ``SeqInfo.create(batch, cu_seqlens_q, cu_seqlens_k, seqused_k=None)`` (device): the
  sequence's ``offset_q, seqlen_q, offset_k, seqlen_k`` (Int32), read from global memory
  once per work item.
* ``PackedBatch(cu_seqlens_q, cu_seqlens_k, seqused_k)`` (device; a trace-time holder of the
  kernel's tensors): ``.sequence(batch)`` is ``SeqInfo.create(...)``, ``.batch_size`` the
  number of sequences.
* ``sequence_loads(loads, head, kv_head, seq)`` (device): k5/k6's `tma.SplitKVLoads` bound to
  one sequence (`SplitKVLoads.at` for a packed batch), tiles counted from its first token.
* ``ragged(t)`` (host, inside a @cute.jit before `make_tiled_tma_atom`): the TMA view of a
  packed tensor `t` given as an (N, d, H, 1) tensor (the (1, total, H, d) torch view through
  `layouts.ndhb_view`): (BIG, d, H, (MAX, MAX)), every extent and stride chosen so that
  ``sequence_rows(tma_tensor, length)`` and ``sequence_batch(offset, length)`` address one
  sequence as a (length, d, H) tensor whose loads past ``length`` are zero-filled and whose
  stores past it are dropped by TMA's own bounds check:

      tiles = TmaTiles.partition(atom, sequence_rows(tma_tensor, seq.seqlen_q), head,
                                 sequence_batch(seq.offset_q, seq.seqlen_q), smem)
      tiles.copy(m_block, barrier)          # rows m_block * rows .. of the sequence only

* ``lse_rows(mLSE, offset, length)`` (device): a view of the packed (1, H, total) fp32 LSE in
  which ``view[sequence_batch(offset, length), head, row]`` is ``lse[head, offset + row]``
  (k5's ``store_lse`` indexes ``mLSE[batch, head, row]``; the writer keeps row < length).
* ``check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
  seqused_k)`` (host): every ValueError that needs no device read (dtypes, devices, shapes,
  lengths), shared by the forward and the backward. What it cannot see without a sync: the
  last entries equal to the token counts, offsets non-decreasing, lengths <= max_seqlen.
* Pure python, for references and tests: ``ragged_address`` (the byte address TMA computes
  for a row of a sequence), ``query_tiles`` and ``decode_item`` (the varlen work list of
  common/scheduler.py).

How the ragged view works. TMA clips a box against the extents of its descriptor; a packed
tensor's only extent is total_tokens, so a box past one sequence's end would read (or, for a
store, overwrite) the next sequence. The view gives the token mode the extent BIG and adds two
modes of extent MAX: one with stride W - s and one with stride s (s: the token stride in
elements; W = 2^64 / BIG = 2^34, so that BIG x W elements are a multiple of 2^64 bytes). A sequence
at offset o of length L is the view with its token coordinates shifted by BIG - L and the
extra coordinates (BIG, o + L): row r then sits at

    base + ((BIG - L + r) s + BIG (W - s) + (o + L) s) e  =  base + (o + r) s e + BIG W e
                                                         ==  base + (o + r) s e  (mod 2^64)

(e: bytes per element), and r >= L is past BIG, out of the box's bounds. The descriptor's base
stays the tensor's own pointer (no pointer moved before the allocation, which TMA loads do not
accept: FlashAttention-4 / quack's note on their one-extra-mode variant), at the price of a
5-D descriptor: (BIG, d, H, MAX, MAX). Strides: W - s elements fit TMA's 2^40-byte limit and
stay multiples of 16 bytes wherever s does.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

BIG = 1 << 30                   # the token mode's extent in the ragged view
MAX = (1 << 31) - 1             # the extra modes' extents
WRAP = (1 << 64) // BIG         # elements: BIG * WRAP * e bytes == 0 (mod 2^64), e = 1, 2, 4


# ---------------------------------------------------------------------------------------------
# host side (inside the @cute.jit launch function)
# ---------------------------------------------------------------------------------------------

def ragged(t: cute.Tensor) -> cute.Tensor:
    """(N, d, H, 1) packed tensor -> its ragged TMA view (BIG, d, H, (MAX, MAX)); see the
    module doc. N's stride s must be a multiple of 16 bytes (as for every TMA tensor)."""
    s = t.layout.stride[0]
    s_wide = Int64(s) if not isinstance(s, int) else s
    shape = (BIG, t.shape[1], t.shape[2], (MAX, MAX))
    stride = (s, t.layout.stride[1], t.layout.stride[2], (WRAP - s_wide, s))
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


# ---------------------------------------------------------------------------------------------
# device side
# ---------------------------------------------------------------------------------------------

@cute.jit
def sequence_rows(tma_tensor: cute.Tensor, length):
    """The ragged TMA tensor with its token coordinates shifted by BIG - length (see the
    module doc): row r of the sequence is token coordinate r."""
    return cute.domain_offset((BIG - length, 0, 0, (0, 0)), tma_tensor)


def sequence_batch(offset, length):
    """The coordinate of a sequence in the ragged view's last mode (`batch` in
    TmaTiles.partition's (rows, d, head, batch) indexing)."""
    return (Int32(BIG), offset + length)


@cute.jit
def lse_rows(mLSE: cute.Tensor, offset, length):
    """A view of the packed (1, H, total) fp32 LSE: view[sequence_batch(offset, length), head,
    row] = lse[0, head, offset + row]."""
    heads, total = mLSE.shape[1], mLSE.shape[2]
    layout = cute.make_layout(((MAX, MAX), heads, total),
                              stride=((0, 1), mLSE.layout.stride[1], 1))
    return cute.make_tensor(mLSE.iterator - length, layout)


@dataclasses.dataclass(frozen=True)
class SeqInfo:
    """Where one sequence of a packed batch lies: tokens offset_q .. offset_q + seqlen_q - 1
    of q (and of the output, the LSE), offset_k .. offset_k + seqlen_k - 1 of k and v."""

    offset_q: Int32
    seqlen_q: Int32
    offset_k: Int32
    seqlen_k: Int32

    @staticmethod
    @cute.jit
    def create(batch, cu_seqlens_q: cute.Tensor, cu_seqlens_k: cute.Tensor,
               seqused_k: Optional[cute.Tensor] = None) -> "SeqInfo":
        offset_q = cu_seqlens_q[batch]
        seqlen_q = cu_seqlens_q[batch + 1] - offset_q
        offset_k = cu_seqlens_k[batch]
        seqlen_k = cu_seqlens_k[batch + 1] - offset_k
        if cutlass.const_expr(seqused_k is not None):
            seqlen_k = seqused_k[batch]
        return SeqInfo(Int32(offset_q), Int32(seqlen_q), Int32(offset_k), Int32(seqlen_k))

    def __extract_mlir_values__(self):
        return [v for f in dataclasses.fields(self)
                for v in cutlass.extract_mlir_values(getattr(self, f.name))]

    def __new_from_mlir_values__(self, values):
        return SeqInfo(*(Int32(v) for v in values))


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """The kernel's packed-batch tensors (seqused_k may be None)."""

    cu_seqlens_q: cute.Tensor
    cu_seqlens_k: cute.Tensor
    seqused_k: Optional[cute.Tensor] = None

    @property
    def batch_size(self):
        return self.cu_seqlens_q.shape[0] - 1

    def sequence(self, batch) -> SeqInfo:
        return SeqInfo.create(batch, self.cu_seqlens_q, self.cu_seqlens_k, self.seqused_k)


def sequence_loads(loads, head, kv_head, seq: SeqInfo):
    """`loads.at(head, kv_head, batch)` for sequence `seq` of a packed batch: Q's tiles from
    its queries, K's and V's from its keys, each clipped at the sequence's end."""
    from hopper_attn.common.tma import TmaTiles
    q_rows = (seq.offset_q, seq.seqlen_q)
    kv_rows = (seq.offset_k, seq.seqlen_k)
    q, k, v = (TmaTiles.partition(atom, sequence_rows(tensor, rows[1]), h,
                                  sequence_batch(*rows), smem)
               for atom, tensor, smem, h, rows in zip(loads.atoms, loads.tensors, loads.smem,
                                                      (head, kv_head, kv_head),
                                                      (q_rows, kv_rows, kv_rows)))
    return dataclasses.replace(loads, q=q, k=k, v=v)


# ---------------------------------------------------------------------------------------------
# host checks (no device reads)
# ---------------------------------------------------------------------------------------------

def check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 seqused_k=None) -> int:
    """ValueError for anything wrong that is visible without reading device memory; returns
    the batch size. q: (total_q, H, d), k and v: (total_k, H_kv, d) with H a multiple of
    H_kv; cu_seqlens_*: int32, 1-D, batch + 1 entries each, on q's device; seqused_k: int32
    (batch,); max_seqlen_*: python ints >= 0 (larger than the longest sequence is fine);
    total_q <= batch x max_seqlen_q. Not checked (they
    would need a sync): cu_seqlens_*[-1] equal to the token counts, offsets non-decreasing,
    every length <= max_seqlen_*, seqused_k[b] <= the sequence's key count."""
    import torch
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be (total_tokens, heads, head_dim), got shape "
                             f"{tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must share head_dim, got {q.shape[2]} and {k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q's heads ({q.shape[1]}) must be a multiple of k's and v's "
                         f"({k.shape[1]})")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, "
                         f"{v.device}")
    batch = None
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"{name} must be 1-D with batch + 1 entries, got shape "
                             f"{tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device}, q on {q.device}")
        if batch is not None and cu.shape[0] - 1 != batch:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length "
                             f"(batch + 1), got {batch + 1} and {cu.shape[0]}")
        batch = cu.shape[0] - 1
    if seqused_k is not None:
        if not isinstance(seqused_k, torch.Tensor) or seqused_k.dtype != torch.int32 or \
                tuple(seqused_k.shape) != (batch,) or seqused_k.device != q.device:
            got = (f"{tuple(seqused_k.shape)} {seqused_k.dtype} on {seqused_k.device}"
                   if isinstance(seqused_k, torch.Tensor) else type(seqused_k).__name__)
            raise ValueError(f"seqused_k must be an int32 tensor of shape ({batch},) on "
                             f"{q.device}, got {got}")
    for name, m, total in (("max_seqlen_q", max_seqlen_q, q.shape[0]),
                           ("max_seqlen_k", max_seqlen_k, k.shape[0])):
        if isinstance(m, bool) or not isinstance(m, (int, torch.SymInt)):
            raise ValueError(f"{name} must be a python int, got {type(m).__name__}")
        if m < 0 or m >= BIG:
            raise ValueError(f"{name} must be in [0, {BIG}), got {m}")
    if q.shape[0] > batch * max_seqlen_q:
        raise ValueError(f"q's {q.shape[0]} tokens do not fit {batch} sequences of at most "
                         f"max_seqlen_q = {max_seqlen_q} tokens (cu_seqlens_q[-1] must be "
                         f"q's token count)")
    if q.shape[0] >= BIG or k.shape[0] >= BIG:
        raise ValueError(f"at most {BIG - 1} tokens")
    return batch


# ---------------------------------------------------------------------------------------------
# pure python (references, tests)
# ---------------------------------------------------------------------------------------------

def ragged_address(base: int, offset: int, length: int, row: int, token_stride: int,
                   elem_bytes: int):
    """The byte address TMA computes for row `row` of the sequence (offset, length) through
    the ragged view, modulo 2^64, or None where its bounds check clips the row (row >= length;
    rows are never negative)."""
    coords = (BIG - length + row, BIG, offset + length)
    strides = (token_stride, WRAP - token_stride, token_stride)
    if not 0 <= coords[0] < BIG:
        return None
    return (base + sum(c * s for c, s in zip(coords, strides)) * elem_bytes) % (1 << 64)


def query_tiles(cu_seqlens_q, block_m: int, heads: int = 1) -> list:
    """Work items per sequence: ceil(seqlen_q / block_m) x heads."""
    return [-(-(b - a) // block_m) * heads for a, b in zip(cu_seqlens_q[:-1], cu_seqlens_q[1:])]


def decode_item(index: int, tiles_per_sequence, heads: int = 1, last_first: bool = False,
                groups=None):
    """(sequence, query tile, head) of work item `index` of the varlen work list
    (scheduler.varlen_item), or None past its end: sequences in order, inside one the query
    tile fastest, then the head, or (groups[b]: heads per group in sequence b) the heads in
    groups, the remainder group first, inside a group tile 0 of every head, then tile 1, ...
    (scheduler.head_group_order); last_first: tiles counted from the last (the longest with
    a causal mask)."""
    for b, count in enumerate(tiles_per_sequence):
        if index < count:
            m_blocks = count // heads
            if groups is None:
                head, slot = divmod(index, m_blocks)
            else:
                group, first = groups[b], heads % groups[b]
                if index < first * m_blocks:
                    slot, head = divmod(index, first)
                else:
                    rest = index - first * m_blocks
                    slot = rest % (group * m_blocks) // group
                    head = first + rest // (group * m_blocks) * group + rest % group
            return b, (m_blocks - 1 - slot if last_first else slot), head
        index -= count
    return None
