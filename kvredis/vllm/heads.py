"""How an engine's KV heads are split over its tensor-parallel ranks, and where a rank of one split finds its
heads in the chunks another split wrote.

Chunks are keyed by the KV heads they hold, not by the rank that wrote them: rank ``r`` of a TP-``T`` engine
with ``H`` KV heads holds the *part* ``r // replicas`` of ``parts = min(T, H)`` equal head ranges (ranks
beyond ``H`` replicate heads, MLA's ranks all hold its one latent "head"), and only the first of a part's
replicas writes it. A reader whose split nests with the writer's (one number of parts divides the other)
assembles its heads from the writer's parts: a slice of one part where the writer's are wider, several whole
parts where they are narrower.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvredis.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass(frozen=True)
class HeadSplit:
    """``total`` KV heads over ``ranks`` tensor-parallel ranks."""

    total: int
    ranks: int = 1

    def __post_init__(self) -> None:
        if self.total < 1 or self.ranks < 1 or (self.total % self.ranks and self.ranks % self.total):
            raise ConfigError(f"{self.total} KV heads cannot be split evenly over {self.ranks} "
                              "tensor-parallel ranks (one must divide the other)")

    @classmethod
    def of(cls, vllm_config: VllmConfig) -> HeadSplit:
        """The split of this engine (MLA's latent KV counts as one head every rank holds)."""
        model_config = vllm_config.model_config
        ranks = int(vllm_config.parallel_config.tensor_parallel_size)
        if getattr(model_config, "use_mla", False):
            return cls(1, ranks)
        return cls(int(model_config.get_total_num_kv_heads()), ranks)

    @property
    def parts(self) -> int:
        """Distinct head ranges (each written once)."""
        return min(self.ranks, self.total)

    @property
    def replicas(self) -> int:
        """Ranks in a row holding the same part."""
        return self.ranks // self.parts

    @property
    def width(self) -> int:
        """KV heads in a part."""
        return self.total // self.parts

    def part_of(self, rank: int) -> int:
        return rank // self.replicas

    def label(self, part: int) -> str:
        """The head range of ``part`` as its chunks' identity names it: ``first-end/total``."""
        return part_label(self.total, self.parts, part)

    def nests(self, parts: int) -> bool:
        """Whether a split into ``parts`` head ranges can be read by this one, or read this one's."""
        return self.total % parts == 0 and (parts % self.parts == 0 or self.parts % parts == 0)


def part_label(total: int, parts: int, part: int) -> str:
    """The head range of part ``part`` of ``total`` heads split in ``parts``: ``first-end/total``."""
    width = total // parts
    return f"{part * width}-{(part + 1) * width}/{total}"


@dataclass(frozen=True)
class Source:
    """Where a reader rank takes some of its heads from: the writer's part ``part`` (of ``parts``, each
    ``width`` heads wide), its heads ``first..first+count-1``, as reader ``reader`` of the ``readers`` ranks
    that read that part."""

    parts: int
    part: int
    width: int
    first: int
    count: int
    reader: int
    readers: int

    @property
    def whole(self) -> bool:
        """Whether the reader takes every head of the part."""
        return self.first == 0 and self.count == self.width


def sources(split: HeadSplit, rank: int, parts: int) -> list[Source]:
    """Where rank ``rank`` of ``split`` finds its heads in chunks written by a split into ``parts`` head
    ranges, in head order (``ValueError`` if the splits do not nest)."""
    if not split.nests(parts):
        raise ValueError(f"a split of {split.total} KV heads into {parts} parts does not nest with "
                         f"{split.parts}")
    mine = split.part_of(rank)
    width = split.total // parts  # heads in a writer's part
    if parts <= split.parts:  # the writer's parts are wider: a slice of one
        per = split.parts // parts  # reader parts in one writer part
        part = mine // per
        readers = split.ranks // parts
        return [Source(parts, part, width, (mine % per) * split.width, split.width, rank - part * readers,
                       readers)]
    per = parts // split.parts  # writer parts in one reader part
    return [Source(parts, part, width, 0, width, rank % split.replicas, split.replicas)
            for part in range(mine * per, (mine + 1) * per)]
