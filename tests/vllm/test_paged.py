"""Paging arithmetic: block spans, kernel blocks, and pages in and out of every physical layout."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="needs vLLM's CPU build (run with the vLLM environment's python)")

import torch

from kvredis.vllm.paged import PagedLayout, block_span

BLOCKS, HEADS, BLOCK, WIDTH = 12, 2, 8, 6


def standard_view(physical_order: str, heads: int = HEADS, width: int = WIDTH) -> torch.Tensor:
    """A ``[B, H, N, C]`` view over memory laid out block-major NHD (``[B, N, H, C]``) or HND."""
    if physical_order == "NHD":
        return torch.zeros(BLOCKS, BLOCK, heads, width).permute(0, 2, 1, 3)
    if physical_order == "layer-interleaved":  # BL*: two layers share each block's memory
        return torch.zeros(BLOCKS, 2, heads, BLOCK, width)[:, 1]
    return torch.zeros(BLOCKS, heads, BLOCK, width)


def test_block_span_covers_exactly_the_positions():
    assert list(block_span(BLOCK, 0, 20)) == [0, 1, 2]
    assert list(block_span(BLOCK, 8, 16)) == [1]
    assert list(block_span(BLOCK, 15, 17)) == [1, 2]
    assert list(block_span(BLOCK, 16, 17)) == [2]
    assert list(block_span(BLOCK, 3, 3)) == []


@pytest.mark.parametrize("order", ["HND", "NHD", "layer-interleaved", "MLA"])
def test_pages_move_between_caches_at_other_blocks(order):
    if order == "MLA":
        source, target = standard_view("HND", heads=1, width=9), standard_view("HND", heads=1, width=9)
    else:
        source, target = standard_view(order), standard_view(order)
    source.copy_(torch.randn(source.shape))
    target.fill_(-1.0)
    layout = PagedLayout.of(source)
    assert layout.page_shape == tuple(source.shape[1:])
    pages = layout.gather(source, layout.kernel_blocks([3, 7, 1], BLOCK))
    assert tuple(pages.shape) == (3, *layout.page_shape)
    layout.scatter(target, layout.kernel_blocks([10, 0, 4], BLOCK), pages)
    assert torch.equal(target[10], source[3]) and torch.equal(target[0], source[7])
    assert torch.equal(target[4], source[1])
    others = [b for b in range(BLOCKS) if b not in (10, 0, 4)]
    assert bool((target[others] == -1.0).all())


def test_pages_are_copies_not_views():
    layer = standard_view("HND")
    layout = PagedLayout.of(layer)
    pages = layout.gather(layer, layout.kernel_blocks([2], BLOCK))
    layer.fill_(5.0)
    assert bool((pages == 0).all())


def test_scheduler_blocks_split_into_kernel_blocks():
    # vLLM may split a 16-token scheduler block into two 8-token kernel blocks (virtual block splitting).
    layout = PagedLayout.of(standard_view("HND"))
    assert layout.kernel_blocks([2, 4], 16).tolist() == [4, 5, 8, 9]
    assert layout.kernel_blocks([2, 4], BLOCK).tolist() == [2, 4]
    with pytest.raises(ValueError, match="multiple"):
        layout.kernel_blocks([1], 12)


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="unsupported paged KV layout"):
        PagedLayout.of(torch.zeros(2, 3, 4, 5, 6))
