"""Variable-length batches (hopper_attn.attention_varlen, common/varlen.py): the ragged TMA
index math in pure python, the argument checks, one compile of the varlen kernel."""

import pytest
import torch

from hopper_attn.common import varlen


@pytest.mark.parametrize("elem_bytes", [1, 2, 4])
def test_ragged_address_lands_on_the_sequence(elem_bytes):
    """Every row inside a sequence maps to its packed address mod 2^64; rows past its end are
    out of TMA's bounds, whatever the neighbours."""
    base, stride = 0x7F3A_0000_0000, 16 * 128        # 16 heads x d 128 per token
    cu = [0, 0, 1, 18, 131, 1131]
    for o, e in zip(cu[:-1], cu[1:]):
        length = e - o
        for row in range(length + 130):
            addr = varlen.ragged_address(base, o, length, row, stride, elem_bytes)
            if 0 <= row < length:
                assert addr == base + (o + row) * stride * elem_bytes
            else:
                assert addr is None


def test_decode_item_covers_every_tile_once():
    cu = [0, 0, 1, 17, 130, 1130, 1130]
    heads, block_m = 3, 128
    tiles = varlen.query_tiles(cu, block_m, heads)
    assert tiles == [0, 3, 3, 3, 24, 0]
    for longest_first in (False, True):
        seen = [varlen.decode_item(i, tiles, heads, longest_first) for i in range(sum(tiles))]
        assert len(set(seen)) == len(seen) == sum(tiles)
        assert varlen.decode_item(sum(tiles), tiles, heads) is None
        assert all(m < -(-(cu[b + 1] - cu[b]) // block_m) for b, m, _ in seen)
    # longest first: a sequence's last query tile before its first
    assert varlen.decode_item(9, tiles, heads, True) == (4, 7, 0)
