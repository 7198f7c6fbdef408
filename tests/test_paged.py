"""Paging arithmetic: slots from block IDs, and token rows in and out of every paged layout."""

from __future__ import annotations

import pytest
import torch

from kvredis.paged import PagedLayout, blocks_of, token_slots

BLOCKS, BLOCK, HEADS, WIDTH = 12, 8, 2, 6


def standard_view(physical_order: str, heads: int = HEADS, width: int = WIDTH) -> torch.Tensor:
    """A ``[B, H, N, C]`` view over memory laid out as NHD (``[B, N, H, C]``) or HND (``[B, H, N, C]``)."""
    if physical_order == "NHD":
        return torch.zeros(BLOCKS, BLOCK, heads, width).permute(0, 2, 1, 3)
    return torch.zeros(BLOCKS, heads, BLOCK, width)


def test_slots_follow_the_block_table():
    slots = token_slots([5, 2, 9], BLOCK, 0, 20)
    assert slots[:8].tolist() == list(range(40, 48))
    assert slots[8:16].tolist() == list(range(16, 24))
    assert slots[16:].tolist() == list(range(72, 76))
    assert token_slots([5, 2, 9], BLOCK, 10, 12).tolist() == [18, 19]


def test_blocks_of_a_token_range():
    assert blocks_of([5, 2, 9], BLOCK, 0, 20) == {5, 2, 9}
    assert blocks_of([5, 2, 9], BLOCK, 8, 16) == {2}
    assert blocks_of([5, 2, 9], BLOCK, 15, 17) == {2, 9}
    assert blocks_of([5, 2, 9], BLOCK, 3, 3) == set()


@pytest.mark.parametrize("layout", ["NHD", "HND", "MLA", "2BNHD"])
def test_rows_move_between_caches_at_different_slots(layout):
    if layout == "2BNHD":
        shape = (2, BLOCKS, BLOCK, HEADS, WIDTH)
        source, target = torch.zeros(shape), torch.zeros(shape)
    elif layout == "MLA":
        source, target = standard_view("HND", heads=1, width=9), standard_view("HND", heads=1, width=9)
    else:
        source, target = standard_view(layout), standard_view(layout)
    source.copy_(torch.randn(source.shape))
    target.fill_(-1.0)
    paged = PagedLayout.of(source)
    send_slots = token_slots([3, 7, 1], BLOCK, 0, 19)
    recv_slots = token_slots([10, 0, 4], BLOCK, 0, 19)
    rows = paged.gather(source, send_slots)
    assert tuple(rows.shape) == (19, *paged.row_shape)
    paged.scatter(target, recv_slots, rows)
    assert torch.equal(paged.gather(target, recv_slots), rows)
    # Nothing but the 19 target slots changed.
    untouched = torch.ones(BLOCKS * BLOCK, dtype=torch.bool)
    untouched[recv_slots] = False
    rest = paged.gather(target, torch.arange(BLOCKS * BLOCK)[untouched])
    assert bool((rest == -1.0).all())


def test_rows_are_the_logical_content_whatever_the_physical_order():
    nhd, hnd = standard_view("NHD"), standard_view("HND")
    nhd.copy_(torch.randn(nhd.shape))
    hnd.copy_(nhd)
    slots = token_slots([4, 6], BLOCK, 2, 13)
    assert torch.equal(PagedLayout.of(nhd).gather(nhd, slots), PagedLayout.of(hnd).gather(hnd, slots))


def test_kernel_blocks_smaller_than_scheduler_blocks():
    # vLLM may split a 16-token scheduler block into two 8-token kernel blocks (virtual block splitting).
    layer = standard_view("HND")
    layer.copy_(torch.randn(layer.shape))
    paged = PagedLayout.of(layer)
    slots = token_slots([2, 4], 16, 0, 32)  # scheduler block 2 = kernel blocks 4 and 5
    rows = paged.gather(layer, slots)
    assert torch.equal(rows[0], layer[4, :, 0])
    assert torch.equal(rows[8], layer[5, :, 0])
    assert torch.equal(rows[16], layer[8, :, 0])


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="unsupported paged KV layout"):
        PagedLayout.of(torch.zeros(3, 4, 5))
