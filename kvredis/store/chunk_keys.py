"""Keys of block-addressed KV: a prompt cut into chunks, each named by a digest chained over its prefix.

A *chunk* is a run of ``chunk_tokens`` consecutive token positions of a prompt (a multiple of the block size,
so a chunk is whole pages); a prompt's last chunk may be shorter. Chunk ``i`` covers positions
``i * chunk_tokens`` up to the next boundary or the prompt's end. Its digest is chained::

    digest[0] = blake2b(seed,          start=0,  count, tokens[0:count])
    digest[i] = blake2b(digest[i - 1], start=s,  count, tokens[s:s + count])

where the *seed* covers the request's context digest (LoRA adapter, multimodal inputs, ``cache_salt``:
:func:`kvredis.store.keys.context_digest`). The engine's identity (model, KV dtype, page layout, block size,
rank) is the key prefix (:class:`kvredis.store.keys.KeySpace`), as for entries. So a chunk's key names exactly
one prefix: two keys are equal only when the engine, the context and every token from the prompt's first to
the chunk's last agree, and a chunk's position and length are part of what its key names. A short last
chunk is never taken for a full one: its count is hashed, and no full chunk has that count.

Keys carry their digest as a Redis Cluster hash tag: a chunk and its holders' set share a slot, and the
chunks of one prompt spread over the cluster (they are shared by every prompt with that prefix).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from kvredis.store.keys import _token_view, check_digest

_DIGEST_BYTES = 16
_CHUNK_HASH = hashlib.blake2b(digest_size=_DIGEST_BYTES, person=b"kvredis-chunk")  # copied, never updated
_SEED_HASH = hashlib.blake2b(digest_size=_DIGEST_BYTES, person=b"kvredis-chseed")


def chunk_seed(context: str = "") -> str:
    """The digest chunk 0 chains from: covers the request's context digest (``""``: none)."""
    seed = _SEED_HASH.copy()
    if context:
        seed.update(check_digest(context).encode())
    return seed.hexdigest()


def chain(parent: str, start: int, tokens: memoryview) -> str:
    """The digest of the chunk at position ``start`` holding ``tokens`` (int64 view), after ``parent``."""
    hasher = _CHUNK_HASH.copy()
    hasher.update(bytes.fromhex(parent))
    hasher.update(start.to_bytes(8, "little"))
    hasher.update(len(tokens).to_bytes(8, "little"))
    hasher.update(tokens)
    return hasher.hexdigest()


@dataclass(frozen=True, eq=False)
class ChunkPlan:
    """A prompt cut into chunks of ``chunk_tokens`` positions, with each chunk's chained digest.

    A *tail* plan (:meth:`tail`) covers the prompt's chunks from ``first`` on: its chunk ``i`` is the prompt's
    chunk ``first + i``, at the same positions and with the same digest (chained from the prompt's start),
    so a tail stores and finds exactly the chunks a whole plan would.
    """

    chunk_tokens: int
    tokens: memoryview  # the prompt's token IDs, int64 (format "q")
    seed: str
    first: int = 0  # the prompt's chunks before this one are not part of the plan

    @classmethod
    def of(cls, input_tokens: Any, chunk_tokens: int, context: str = "") -> ChunkPlan:
        """Plan ``input_tokens`` (a list, tuple, array or integer tensor) under ``context``."""
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        return cls(chunk_tokens, _token_view(input_tokens), chunk_seed(context))

    def tail(self, first: int) -> ChunkPlan:
        """The plan of this prompt's chunks from chunk ``first`` (of the whole prompt) on."""
        if not 0 <= first <= self._total_chunks:
            raise IndexError(f"chunk {first} of a {self._total_chunks}-chunk prompt")
        tail = ChunkPlan(self.chunk_tokens, self.tokens, self.seed, first)
        if "_chain" in self.__dict__:
            object.__setattr__(tail, "_chain", self._chain)  # hashed once for the whole prompt
        return tail

    @property
    def num_tokens(self) -> int:
        """Positions in the prompt (the whole prompt's, for a tail too)."""
        return len(self.tokens)

    @property
    def start(self) -> int:
        """The position the plan's first chunk starts at (0 unless a tail)."""
        return self.first * self.chunk_tokens

    @property
    def _total_chunks(self) -> int:
        return -(-self.num_tokens // self.chunk_tokens)

    @property
    def num_chunks(self) -> int:
        """Chunks in the plan, the last one short if it does not fill up."""
        return self._total_chunks - self.first

    def span(self, index: int) -> tuple[int, int]:
        """Positions ``start..stop-1`` of chunk ``index``."""
        if not 0 <= index < self.num_chunks:
            raise IndexError(f"chunk {index} of a {self.num_chunks}-chunk plan")
        start = (self.first + index) * self.chunk_tokens
        return start, min(start + self.chunk_tokens, self.num_tokens)

    def is_full(self, index: int) -> bool:
        """Whether chunk ``index`` holds ``chunk_tokens`` positions (only the last may not)."""
        start, stop = self.span(index)
        return stop - start == self.chunk_tokens

    def covering(self, start: int, stop: int) -> range:
        """The chunks holding positions ``start..stop-1`` (a chunk holding any of them counts whole)."""
        if stop <= start:
            return range(0)
        if start < self.start or stop > self.num_tokens:
            raise ValueError(f"positions {start}..{stop - 1} outside positions {self.start}.."
                             f"{self.num_tokens - 1} of a prompt")
        size = self.chunk_tokens
        return range(start // size - self.first, (stop - 1) // size + 1 - self.first)

    def chunk_tokens_of(self, index: int) -> memoryview:
        """The token IDs of chunk ``index`` (an int64 view)."""
        start, stop = self.span(index)
        return self.tokens[start:stop]

    @cached_property
    def _chain(self) -> tuple[str, ...]:
        """The digest of every chunk of the whole prompt (a prompt's chain is hashed in one pass)."""
        digests: list[str] = []
        parent = self.seed
        for index in range(self._total_chunks):
            start = index * self.chunk_tokens
            parent = chain(parent, start, self.tokens[start:start + self.chunk_tokens])
            digests.append(parent)
        return tuple(digests)

    @cached_property
    def digests(self) -> tuple[str, ...]:
        """Every chunk's digest, in order."""
        return self._chain[self.first:]

    def parent(self, index: int) -> str:
        """The digest chunk ``index`` chains from (the seed for the prompt's chunk 0)."""
        whole = self.first + index
        return self.seed if whole == 0 else self._chain[whole - 1]


@dataclass(frozen=True)
class ChunkKeys:
    """The Redis keys of chunks under one key space prefix (``namespace:identity``)."""

    prefix: str

    def chunk(self, digest: str) -> str:
        """The key holding the chunk (one self-describing value: header, tokens and pages)."""
        return f"{self.prefix}:c:{{{digest}}}"

    def holders(self, digest: str) -> str:
        """The set of the transfers still to read the chunk (transfer mode), in the chunk's slot."""
        return f"{self.prefix}:c:{{{digest}}}:h"

    @property
    def pattern(self) -> str:
        """A SCAN pattern for every chunk key (and holders' set) under this prefix."""
        return f"{self.prefix}:c:*"


def key_kind(key: str) -> str | None:
    """What a key of the chunk store's shapes holds: ``"chunks"`` (:meth:`ChunkKeys.chunk`), ``"holders"``
    (:meth:`ChunkKeys.holders`) or ``"transfers"`` (a transfer's record, ``<prefix>:t:{<id>}``:
    :func:`kvredis.store.transfer.record_key`); ``None`` for any other key."""
    if ":c:{" in key:
        return "holders" if key.endswith("}:h") else "chunks"
    if ":t:{" in key:
        return "transfers"
    return None
