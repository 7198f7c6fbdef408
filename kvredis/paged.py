"""Paging arithmetic: where a request's tokens live in vLLM's paged KV tensors.

vLLM addresses a token by its *slot*, ``block_id * block_size + offset``. These helpers turn a request's
block IDs into slots and copy token rows in and out of one layer's paged tensor, whatever its layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedLayout:
    """How token rows sit in one layer's paged KV tensor, read off the tensor itself.

    - ``"BHNC"``: vLLM's standardized per-layer view ``[blocks, heads, block_size, C]`` (FlashAttention
      with K and V packed in ``C`` whatever the physical order; MLA with one head);
    - ``"2BNHD"``: the older ``[2, blocks, block_size, heads, head_size]`` (K and V split on dim 0).

    A row is one token's ``[heads, C]`` (or ``[2, heads, head_size]``), so entries hold the logical
    content and do not depend on the physical memory order.
    """

    kind: str
    kernel_block_size: int
    row_shape: tuple[int, ...]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> PagedLayout:
        """The layout of a paged layer tensor; raises ``ValueError`` for one it does not know."""
        if tensor.dim() == 4:
            _, heads, block_size, width = tensor.shape
            return cls("BHNC", int(block_size), (int(heads), int(width)))
        if tensor.dim() == 5 and tensor.shape[0] == 2:
            _, _, block_size, heads, head_size = tensor.shape
            return cls("2BNHD", int(block_size), (2, int(heads), int(head_size)))
        raise ValueError(f"unsupported paged KV layout: tensor of shape {tuple(tensor.shape)}")

    def gather(self, layer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Copy the rows at ``slots`` out of ``layer``: ``[len(slots), *row_shape]``."""
        blocks, offsets = slots // self.kernel_block_size, slots % self.kernel_block_size
        if self.kind == "BHNC":
            return layer[blocks, :, offsets]
        return layer[:, blocks, offsets].transpose(0, 1)

    def scatter(self, layer: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``rows`` (``[len(slots), *row_shape]``) into ``layer`` at ``slots``."""
        blocks, offsets = slots // self.kernel_block_size, slots % self.kernel_block_size
        if self.kind == "BHNC":
            layer[blocks, :, offsets] = rows
        else:
            layer[:, blocks, offsets] = rows.transpose(0, 1)


def token_slots(block_ids: list[int], block_size: int, start: int, stop: int) -> torch.Tensor:
    """Cache slots (``block_id * block_size + offset``) of token positions ``start..stop-1``."""
    positions = torch.arange(start, stop, dtype=torch.long)
    blocks = torch.tensor(block_ids, dtype=torch.long)[positions // block_size]
    return blocks * block_size + positions % block_size


def blocks_of(block_ids: list[int], block_size: int, start: int, stop: int) -> set[int]:
    """The block IDs holding token positions ``start..stop-1``."""
    if stop <= start:
        return set()
    return set(block_ids[start // block_size:(stop - 1) // block_size + 1])
