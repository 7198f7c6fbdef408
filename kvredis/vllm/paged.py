"""Paging arithmetic: which pages of vLLM's paged KV tensors hold a request's tokens.

vLLM hands connectors each layer's cache as the logical view ``[blocks, heads, block_size, C]``
(vLLM 0.32-0.34, every backend; MLA has one head). Token position ``p`` of a request lives in block
``block_ids[p // block_size]``. kvredis moves whole blocks ("pages"), never single tokens: inside a
block the CPU backend stores K transposed, so only a whole page is portable, and a page is the unit
vLLM allocates anyway. The engine may split each scheduler block into ``r`` kernel blocks (the tensor's
dim 0 then has ``r`` times as many entries); scheduler block ``b`` is kernel blocks ``b*r .. b*r+r-1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def block_span(block_size: int, start: int, stop: int) -> range:
    """Indices into a request's block list of the blocks holding token positions ``start..stop-1``."""
    if stop <= start:
        return range(0)
    return range(start // block_size, (stop - 1) // block_size + 1)


@dataclass(frozen=True)
class PagedLayout:
    """One layer's paged tensor: its kernel block size and the shape of one page, read off the tensor."""

    kernel_block_size: int
    page_shape: tuple[int, ...]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> PagedLayout:
        """The layout of a ``[blocks, heads, block_size, C]`` layer; ``ValueError`` for any other shape."""
        if tensor.dim() != 4:
            shape = tuple(tensor.shape)
            raise ValueError(f"unsupported paged KV layout {shape}: expected [blocks, heads, block_size, C]")
        _, heads, block_size, width = (int(d) for d in tensor.shape)
        return cls(block_size, (heads, block_size, width))

    def kernel_blocks(self, block_ids: list[int], block_size: int) -> torch.Tensor:
        """Kernel-block indices of scheduler blocks ``block_ids``, in order."""
        if block_size % self.kernel_block_size:
            raise ValueError(
                f"block size {block_size} is not a multiple of the kernel's {self.kernel_block_size}")
        ratio = block_size // self.kernel_block_size
        blocks = torch.tensor(block_ids, dtype=torch.long).reshape(-1, 1)
        return (blocks * ratio + torch.arange(ratio, dtype=torch.long)).reshape(-1)

    def gather(self, layer: torch.Tensor, kernel_blocks: torch.Tensor) -> torch.Tensor:
        """Copy pages ``kernel_blocks`` out of ``layer``: ``[len(kernel_blocks), *page_shape]``."""
        return layer[kernel_blocks.to(layer.device)]

    def scatter(self, layer: torch.Tensor, kernel_blocks: torch.Tensor, pages: torch.Tensor) -> None:
        """Write ``pages`` into ``layer`` at ``kernel_blocks``."""
        layer[kernel_blocks.to(layer.device)] = pages.to(layer.device)
