"""One prompt's KV from a prefill to a decode through the chunk store: save what Redis lacks, take what the
decode lacks, release what nobody will read.

A **save** (the producer's writer thread) learns in one round trip which of the prompt's chunks Redis holds
already, holding those for the transfer, and writes the others (write-if-absent, held too). With a transfer
id (an announced transfer) it then pushes the transfer's *record*, a small blob naming the chunks it holds,
onto a list of its own: the record lands last, so it says "every chunk of this transfer is in Redis".

A **take** (the decode's load thread) waits for that record with a blocking pop (bounded by the pop
timeout: a decode that arrives before the write ends waits for it), checks that it names the chunks of the
decode's own prompt, and reads only the chunks covering the positions the decode lacks (the first of them
whole, even where the decode's prefix cache holds part of it). What it returns ends at the first chunk
that is missing or fails a check: the decode computes from there. Then the transfer's holds are released,
and chunks nobody else holds are deleted. Without a transfer id (``store_all_prompts``), a take reads the
leading chunks that are present, and deletes them and those before them that no transfer holds (the prompt
is taken whole, as an entry was).

A transfer nobody will take (the decode computed the prompt, the request was aborted, the decode never got
it) is **discarded**: its record is taken (waiting for it, since the prefill may still be writing) and its
holds released.

Keys: the chunks and their holders' sets (:mod:`kvredis.chunk_keys`), and ``<prefix>:t:{<transfer id>}``
for the record. Every key has the TTL.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from kvredis import codec
from kvredis.chunk_keys import ChunkPlan
from kvredis.chunk_store import ChunkRead, ChunkStore, PageFormat
from kvredis.client import RedisStore
from kvredis.errors import CodecError, KVRedisError
from kvredis.keys import check_entry_id
from kvredis.redis_errors import WrongTypeError

logger = logging.getLogger("kvredis.transfer")

RECORD_KIND = "transfer"
_MAX_RECORD_BYTES = 1 << 20  # 16 bytes a chunk: 65,536 chunks, far past any context length
# A record: magic and version, the prompt's tokens, the chunk length, the chunks, the lengths of the key
# space and of the transfer id; then those two (UTF-8), each chunk's 16-byte digest, and XXH3-64 of all
# that before it (8 bytes, little-endian). Built with one pack and one hash, not a codec blob: a take builds
# the record its decode expects and compares bytes, and at small sizes the blob's encoding was measurable.
RECORD_MAGIC = b"KVT\x01"
_RECORD_HEAD = struct.Struct("<4sIIIHH")
_RECORD_SUM = struct.Struct("<Q")
# A save of at most this many bytes of pages does not ask Redis first which chunks it holds: it writes every
# chunk with write-if-absent (SET NX drops what is there already, and holds it all the same), saving a round
# trip, which costs about what sending 100-250 KB does on loopback and more across a network.
_PROBE_ABOVE_BYTES = 256 << 10


@dataclass
class Saved:
    """What a save did: chunks written, chunks found present (and so not written), bytes written."""

    written: int = 0
    present: int = 0
    nbytes: int = 0


@dataclass
class Taken:
    """What a take got: the pages of chunks ``first..`` in order (each ``[layers, pages, ...]``), ending at
    the first chunk that could not be read, and why nothing more (``"hit"``: everything asked for;
    ``"late"``: no transfer record within the pop bound, so nothing was read; else a chunk's cause)."""

    first: int
    chunks: list[torch.Tensor] = field(default_factory=list)
    cause: str = "hit"
    nbytes: int = 0

    def stop(self, plan: ChunkPlan) -> int:
        """The position up to which the pages taken hold the prompt's KV."""
        if not self.chunks:
            return plan.span(self.first)[0] if self.first < plan.num_chunks else plan.num_tokens
        return plan.span(self.first + len(self.chunks) - 1)[1]


class Transfers:
    """Saves, takes and discards of prompts' KV under one key space (namespace and engine identity)."""

    def __init__(self, store: RedisStore, prefix: str, *, chunk_tokens: int, block_size: int, ttl_ms: int,
                 pop_timeout_s: float, max_chunk_bytes: int, checksum: bool = True) -> None:
        if chunk_tokens <= 0 or chunk_tokens % block_size:
            raise ValueError(f"chunk_tokens {chunk_tokens} is not a positive multiple of the block size "
                             f"{block_size}")
        self.store = store
        self.prefix = prefix
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.ttl_ms = max(1, int(ttl_ms))
        self.pop_timeout_s = pop_timeout_s
        self.chunks = ChunkStore(store, prefix, ttl_ms=ttl_ms, block_size=block_size,
                                 max_chunk_bytes=max_chunk_bytes, checksum=checksum)

    def plan(self, tokens: list[int], context: str = "") -> ChunkPlan:
        """The prompt's chunks under this store's chunk length."""
        return ChunkPlan.of(tokens, self.chunk_tokens, context)

    def record_key(self, transfer_id: str) -> str:
        """The list holding transfer ``transfer_id``'s record."""
        return record_key(self.prefix, transfer_id)

    # -- the producer --------------------------------------------------------------------------------

    def save(self, plan: ChunkPlan, pages: torch.Tensor, *, transfer_id: str | None = None,
             pages_per_block: int = 1) -> Saved:
        """Store the prompt's pages (``[layers, kernel pages of every block of the prompt, ...]``): only the
        chunks Redis lacks are written; with ``transfer_id`` every chunk is held for it and the record is
        pushed last."""
        per_chunk = self.chunk_tokens // self.block_size * pages_per_block
        expected = -(-plan.num_tokens // self.block_size) * pages_per_block
        if pages.dim() < 2 or pages.shape[1] != expected:
            raise KVRedisError(f"a {plan.num_tokens}-token prompt has {expected} pages, got "
                               f"{tuple(pages.shape)}")
        if pages.numel() * pages.element_size() <= _PROBE_ABOVE_BYTES:
            missing = list(range(plan.num_chunks))
        else:
            present = self.chunks.present(plan.digests, holder=transfer_id)
            missing = [index for index, there in enumerate(present) if not there]
        chunks = [(index, pages[:, index * per_chunk:(index + 1) * per_chunk]) for index in missing]
        record = None
        if transfer_id is not None:
            record = (self.record_key(transfer_id), self._record(plan, transfer_id))
        try:
            # The record goes last, in the same round trip on one server: Redis runs the commands in order.
            written = self.chunks.write(plan, chunks, holder=transfer_id, record=record)
        except BaseException:
            if transfer_id is not None:
                self._release_quietly(plan.digests, transfer_id)
                # A record pushed after a chunk's write failed names a chunk that is not there: not left to
                # be taken (a decode that took it meanwhile finds that chunk missing: a miss, never bytes).
                self.chunks.delete_keys([self.record_key(transfer_id)])
            raise
        count = sum(1 for nbytes in written if nbytes)
        return Saved(count, plan.num_chunks - count, sum(written))

    def _record(self, plan: ChunkPlan, transfer_id: str) -> bytes:
        """The record of transfer ``transfer_id``: the digests of the chunks it holds."""
        return encode_record(self.prefix, transfer_id, plan.digests, plan.num_tokens, self.chunk_tokens)

    # -- the consumer --------------------------------------------------------------------------------

    def take(self, plan: ChunkPlan, start: int, stop: int, page_format: PageFormat, *,
             transfer_id: str | None = None) -> Taken:
        """The pages of the chunks covering positions ``start..stop-1``, waiting up to the pop timeout for
        the transfer's record when it has an id; then the transfer's holds are released (with no id, the
        chunks up to the last one read are deleted where no transfer holds them)."""
        indexes = plan.covering(start, stop)
        # Without a transfer the prompt's stored chunks are taken as an entry was, whole: those before the
        # ones read (the decode's prefix cache held them) go too.
        release = plan.digests if transfer_id is not None else plan.digests[:indexes.stop]
        queue = None if transfer_id is None else self.record_key(transfer_id)
        try:
            combined = self.chunks.take(plan, list(indexes), page_format, queue=queue,
                                        wait_s=self.pop_timeout_s, release=release,
                                        holder=transfer_id or _NOBODY)
        except BaseException:
            self._release_quietly(release, transfer_id or _NOBODY)  # the pipeline may have stopped before it
            raise
        if combined is None:  # a cluster or a stand-in client: one step after the other
            return self._take_stepwise(plan, indexes, page_format, transfer_id)
        record, reads = combined
        # The record this prompt's save pushed, byte for byte, needs no decoding; anything else is decoded to
        # tell why it does not fit.
        if transfer_id is not None and record != self._record(plan, transfer_id):
            cause, _ = self._checked_record(plan, transfer_id, record)
            if cause != "hit":
                return Taken(indexes.start if indexes else 0, cause=cause)
        return _leading(indexes, reads)

    def _take_stepwise(self, plan: ChunkPlan, indexes: range, page_format: PageFormat,
                       transfer_id: str | None) -> Taken:
        """:meth:`take` a round trip at a time: the record, then (if it fits) the chunks, then the release."""
        held: tuple[str, ...] = ()
        if transfer_id is not None:
            cause, held = self._take_record(plan, transfer_id)
            if cause != "hit":
                return Taken(indexes.start if indexes else 0, cause=cause)
        try:
            return self._read_leading(plan, indexes, page_format)
        finally:
            # Without a transfer the prompt's stored chunks are taken as an entry was, whole: those before
            # the ones read (the decode's prefix cache held them) go too.
            done = held if transfer_id is not None else plan.digests[:indexes.stop]
            self._release_quietly(done, transfer_id or _NOBODY)

    def _take_record(self, plan: ChunkPlan, transfer_id: str) -> tuple[str, tuple[str, ...]]:
        """Why the transfer's record does not fit ``plan`` (or ``"hit"``), and the chunks it holds."""
        record: Any
        try:
            record = self.store.pop_record(self.record_key(transfer_id), self.pop_timeout_s)
        except WrongTypeError as exc:
            record = exc
        return self._checked_record(plan, transfer_id, record)

    def _checked_record(self, plan: ChunkPlan, transfer_id: str, record: Any) -> tuple[str, tuple[str, ...]]:
        """:meth:`_take_record` of a record taken already (``None``: none came; an error: the list's key holds
        another type, and is deleted)."""
        if isinstance(record, Exception):
            self.chunks.delete_keys([self.record_key(transfer_id)])
            return "foreign", ()
        if record is None:
            return "late", ()
        try:
            held = record_digests(record, transfer_id, self.prefix)
        except CodecError as exc:
            logger.warning("dropped the unreadable record of transfer %s: %s", transfer_id, exc)
            return "corrupt", ()
        if held != plan.digests:
            # Another prompt's record under this id: release what it holds all the same.
            self._release_quietly(held, transfer_id)
            return "foreign", ()
        return "hit", held

    def _read_leading(self, plan: ChunkPlan, indexes: range, page_format: PageFormat) -> Taken:
        return _leading(indexes, self.chunks.read(plan, list(indexes), page_format))

    # -- nobody will take it ----------------------------------------------------------------------------

    def discard(self, transfer_id: str, *, wait_s: float = 0.0, prefix: str | None = None) -> bool:
        """:func:`discard_transfer` under this key space, or another rank's ``prefix``."""
        return discard_transfer(self.store, prefix or self.prefix, transfer_id, wait_s=wait_s)

    def _release_quietly(self, digests: tuple[str, ...] | list[str], holder: str) -> None:
        try:
            self.chunks.release(list(digests), holder)
        except KVRedisError as exc:
            logger.warning("could not release %d chunks (they expire with their TTL): %s", len(digests), exc)


def _leading(indexes: range, reads: list[ChunkRead]) -> Taken:
    """The chunks read, up to the first that could not be."""
    taken = Taken(indexes.start if indexes else 0)
    for read in reads:
        if read.pages is None:
            taken.cause = read.cause
            break
        taken.chunks.append(read.pages)
        taken.nbytes += read.nbytes
    return taken


_NOBODY = "0" * 16
"""The holder a take without a transfer id releases as: it holds nothing, so chunks nobody holds go."""


def record_key(prefix: str, transfer_id: str) -> str:
    """The list holding the record of transfer ``transfer_id`` in key space ``prefix``."""
    return f"{prefix}:t:{{{check_entry_id(transfer_id)}}}"


def discard_transfer(store: RedisStore, prefix: str, transfer_id: str, *, wait_s: float = 0.0) -> bool:
    """Release transfer ``transfer_id`` of key space ``prefix`` unread: its record taken (waiting up to
    ``wait_s`` for it: the prefill may still be writing) and every hold it names dropped; whether there was
    one. Needs no chunk length nor page format, so a proxy can call it with an announcement alone."""
    queue = record_key(prefix, transfer_id)
    # Releasing needs the chunks' keys only (no page format): a store for that and nothing else.
    chunks = ChunkStore(store, prefix, ttl_ms=1, block_size=1, max_chunk_bytes=0)
    try:
        record = store.pop_record(queue, wait_s)
    except WrongTypeError:
        chunks.delete_keys([queue])
        return False
    if record is None:
        return False
    try:
        held = record_digests(record, transfer_id, prefix)
    except CodecError as exc:
        logger.warning("discarded an unreadable record of transfer %s (its chunks expire with their TTL): %s",
                       transfer_id, exc)
        return True
    chunks.release(held, transfer_id)
    return True


def encode_record(space: str, transfer_id: str, digests: tuple[str, ...] | list[str], tokens: int,
                  chunk_tokens: int) -> bytes:
    """The record of transfer ``transfer_id`` in key space ``space``, naming chunks ``digests`` of a
    ``tokens``-token prompt in chunks of ``chunk_tokens`` (see :data:`RECORD_MAGIC`)."""
    space_raw, id_raw = space.encode(), transfer_id.encode()
    body = b"".join((_RECORD_HEAD.pack(RECORD_MAGIC, tokens, chunk_tokens, len(digests), len(space_raw),
                                       len(id_raw)), space_raw, id_raw, bytes.fromhex("".join(digests))))
    return body + _RECORD_SUM.pack(xxhash.xxh3_64_intdigest(body))


def record_digests(record: bytes | bytearray, transfer_id: str, space: str) -> tuple[str, ...]:
    """The chunk digests a transfer's record names, once checked as written for key space ``space`` and
    transfer ``transfer_id``; raises :class:`~kvredis.errors.CodecError` for any other bytes."""
    if record[:len(RECORD_MAGIC)] == RECORD_MAGIC:
        return _raw_record_digests(bytes(record), transfer_id, space)
    # A record as kvredis wrote it before (a codec blob): a prefill not yet upgraded.
    tensors, meta = codec.decode(record, max_payload_bytes=_MAX_RECORD_BYTES)
    if (meta.get("kind") != RECORD_KIND or meta.get("space") != space or meta.get("id") != transfer_id
            or len(tensors) != 1 or tensors[0] is None or tensors[0].dtype != torch.uint8
            or tensors[0].dim() != 1 or tensors[0].numel() % 16):
        raise CodecError(f"not a transfer record of {space} for {transfer_id}: {meta!r}")
    raw = codec.tensor_bytes(tensors[0]).tobytes()
    return tuple(raw[i:i + 16].hex() for i in range(0, len(raw), 16))


def _raw_record_digests(record: bytes, transfer_id: str, space: str) -> tuple[str, ...]:
    """:func:`record_digests` of a record in :data:`RECORD_MAGIC`'s format."""
    if not _RECORD_HEAD.size + _RECORD_SUM.size <= len(record) <= _MAX_RECORD_BYTES:
        raise CodecError(f"a transfer record of {len(record)} bytes")
    body, (checksum,) = record[:-_RECORD_SUM.size], _RECORD_SUM.unpack_from(record, len(record) - 8)
    if xxhash.xxh3_64_intdigest(body) != checksum:
        raise CodecError("corrupt transfer record: checksum mismatch")
    _, _, _, count, space_len, id_len = _RECORD_HEAD.unpack_from(body)
    names = _RECORD_HEAD.size + space_len + id_len
    if len(body) != names + 16 * count:
        raise CodecError(f"a transfer record of {len(body)} bytes naming {count} chunks")
    if (body[_RECORD_HEAD.size:_RECORD_HEAD.size + space_len] != space.encode()
            or body[_RECORD_HEAD.size + space_len:names] != transfer_id.encode()):
        raise CodecError(f"not a transfer record of {space} for {transfer_id}")
    return tuple(body[i:i + 16].hex() for i in range(names, len(body), 16))
