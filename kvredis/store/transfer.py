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

A **small transfer** (one chunk of at most 256 KiB of pages) travels inside its record instead: the record,
padded, then the chunk's blob, pushed in one transaction. Its take is the record's pop alone and it holds
nothing to release: an entry's commands (four to save, one to take), not the chunk path's 8 and 3. Both sides
decide so from the prompt and the page format; a take that finds the other kind of record than it expected
handles it all the same.

In **reuse** mode (``KVREDIS_REUSE``) nothing is held, released or deleted after use: a save restarts the
TTL of the chunks present and writes the others, its record names chunks it does not hold
(:data:`SHARED_MAGIC`), and a take restarts the TTL of the chunks it reads and of those before them. Chunks
leave by their TTL and Redis's eviction (:meth:`ChunkStore.ttl_at` orders a prompt's chunks for it).

A transfer nobody will take (the decode computed the prompt, the request was aborted, the decode never got
it) is **discarded**: its record is taken (waiting for it, since the prefill may still be writing) and its
holds released.

Keys: the chunks and their holders' sets (:mod:`kvredis.store.chunk_keys`), and ``<prefix>:t:{<transfer id>}``
for the record. Every key has the TTL.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from kvredis.errors import CodecError, KVRedisError
from kvredis.store import codec
from kvredis.store.chunk_keys import ChunkPlan
from kvredis.store.chunk_store import NOBODY, ChunkRead, ChunkStore, PageFormat, PagesPlace
from kvredis.store.client import RedisStore
from kvredis.store.keys import check_entry_id
from kvredis.store.redis_errors import WrongTypeError

logger = logging.getLogger("kvredis.transfer")

RECORD_KIND = "transfer"
_MAX_RECORD_BYTES = 1 << 20  # 16 bytes a chunk: 65,536 chunks, far past any context length
# A record: magic and version, the prompt's tokens, the chunk length, the chunks, the lengths of the key
# space and of the transfer id; then those two (UTF-8), each chunk's 16-byte digest, and XXH3-64 of all
# that before it (8 bytes, little-endian). Built with one pack and one hash, not a codec blob: a take builds
# the record its decode expects and compares bytes, and at small sizes the blob's encoding was measurable.
RECORD_MAGIC = b"KVT\x01"
INLINE_MAGIC = b"KVT\x02"
"""A record in :data:`RECORD_MAGIC`'s layout, padded with zeros to a multiple of ``codec.ALIGN``, then the
transfer's one chunk as a blob (its transfer holds no chunk in Redis)."""
SHARED_MAGIC = b"KVT\x03"
"""A record in :data:`RECORD_MAGIC`'s layout whose transfer holds none of the chunks it names (reuse: they
stay for any reader, under their TTL)."""
_RECORD_HEAD = struct.Struct("<4sIIIHH")
_RECORD_SUM = struct.Struct("<Q")
# A save of at most this many bytes of pages does not ask Redis first which chunks it holds: it writes every
# chunk with write-if-absent (SET NX drops what is there already, and holds it all the same), saving a round
# trip, which costs about what sending 100-250 KB does on loopback and more across a network.
_PROBE_ABOVE_BYTES = 256 << 10
# A transfer of one chunk of at most this many bytes of pages goes inside its record (INLINE_MAGIC): at 64 KiB
# the chunk path's commands and their framing cost 10-20% of a round trip; the record is popped into memory
# of its own, not received in place, which from about this size on costs more than it saves.
_INLINE_MAX_BYTES = 256 << 10
_NOT_POPPED = object()
"""``Transfers._take_stepwise``'s default: the record is still to be popped."""


@dataclass
class Saved:
    """What a save did: chunks written, chunks found present (and so not written), bytes written."""

    written: int = 0
    present: int = 0
    nbytes: int = 0


@dataclass
class Taken:
    """What a take got: the pages of chunks ``first..`` in order (each ``[layers, pages, ...]``, or ``None``
    where they were received in place: :data:`~kvredis.store.chunk_store.PagesPlace`), ending at
    the first chunk that could not be read, and why nothing more (``"hit"``: everything asked for;
    ``"late"``: no transfer record within the pop bound, so nothing was read; else a chunk's cause)."""

    first: int
    chunks: list[torch.Tensor | None] = field(default_factory=list)  # None: received in place
    cause: str = "hit"
    nbytes: int = 0
    waited: float | None = None  # seconds the take waited for its transfer's record (None: no record)

    def stop(self, plan: ChunkPlan) -> int:
        """The position up to which the pages taken hold the prompt's KV."""
        if not self.chunks:
            return plan.span(self.first)[0] if self.first < plan.num_chunks else plan.num_tokens
        return plan.span(self.first + len(self.chunks) - 1)[1]


@dataclass(frozen=True)
class Record:
    """A transfer's record as read: the digests of the prompt's chunks it names, and the chunk it carries
    (a small transfer's; its transfer then holds none in Redis)."""

    digests: tuple[str, ...]
    inline: memoryview | None = None
    holds: bool = True  # False: written in reuse mode, it names chunks nobody holds
    tokens: int = 0  # the prompt's length and chunk length it names (0: a record of an earlier kvredis)
    chunk_tokens: int = 0

    @property
    def held(self) -> tuple[str, ...]:
        """The chunks its transfer holds in Redis."""
        return self.digests if self.holds and self.inline is None else ()


class Transfers:
    """Saves, takes and discards of prompts' KV under one key space (namespace and engine identity)."""

    def __init__(self, store: RedisStore, prefix: str, *, chunk_tokens: int, block_size: int, ttl_ms: int,
                 pop_timeout_s: float, max_chunk_bytes: int, checksum: bool = True,
                 inline_max_bytes: int = _INLINE_MAX_BYTES, reuse: bool = False) -> None:
        if chunk_tokens <= 0 or chunk_tokens % block_size:
            raise ValueError(f"chunk_tokens {chunk_tokens} is not a positive multiple of the block size "
                             f"{block_size}")
        self.store = store
        self.prefix = prefix
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.ttl_ms = max(1, int(ttl_ms))
        self.pop_timeout_s = pop_timeout_s
        self.reuse = reuse  # chunks stay for any later reader: nothing held, released or deleted after use
        # 0: every transfer's chunks under their own keys (reuse needs them there, for other readers).
        self.inline_max_bytes = 0 if reuse else inline_max_bytes
        self.chunks = ChunkStore(store, prefix, ttl_ms=ttl_ms, block_size=block_size,
                                 max_chunk_bytes=max_chunk_bytes, checksum=checksum)

    def plan(self, tokens: list[int], context: str = "") -> ChunkPlan:
        """The prompt's chunks under this store's chunk length."""
        return ChunkPlan.of(tokens, self.chunk_tokens, context)

    def record_key(self, transfer_id: str) -> str:
        """The list holding transfer ``transfer_id``'s record."""
        return record_key(self.prefix, transfer_id)

    def _inline(self, plan: ChunkPlan, transfer_id: str | None, pages_nbytes: int) -> bool:
        """Whether the transfer travels inside its record: announced, one chunk, small."""
        return transfer_id is not None and plan.num_chunks == 1 and 0 < pages_nbytes <= self.inline_max_bytes

    # -- the producer --------------------------------------------------------------------------------

    def save(self, plan: ChunkPlan, pages: torch.Tensor, *, transfer_id: str | None = None,
             pages_per_block: int = 1, known: int = 0) -> Saved:
        """Store the prompt's pages (``[layers, kernel pages of every block of the prompt, ...]``): only the
        chunks Redis lacks are written; with ``transfer_id`` every chunk is held for it and the record is
        pushed last. ``known`` (reuse): the first chunks Redis held when the engine looked the prompt up;
        ``pages`` starts after them. Their TTLs restart as the others'; one gone since is not written (a
        later prefill of the prefix writes it again)."""
        per_chunk = self.chunk_tokens // self.block_size * pages_per_block
        if known and (not self.reuse or plan.start or known > plan.num_chunks):
            raise ValueError(f"{known} chunks known present in a save that cannot skip them")
        expected = -(-(plan.num_tokens - plan.start) // self.block_size) * pages_per_block - known * per_chunk
        if pages.dim() < 2 or pages.shape[1] != max(expected, 0):
            first = plan.start + known * self.chunk_tokens
            raise KVRedisError(f"positions {first}..{plan.num_tokens - 1} of a prompt have {expected} pages, "
                               f"got {tuple(pages.shape)}")
        nbytes = pages.numel() * pages.element_size()
        if self._inline(plan, transfer_id, nbytes):
            assert transfer_id is not None
            return self._save_inline(plan, pages, transfer_id)
        # Reuse: nothing is held; the chunks present have their TTL restarted (a prompt sent again keeps
        # them), and the record, if any, holds nothing either.
        holder = None if self.reuse else transfer_id
        if self.reuse:
            present = self.chunks.present(plan.digests, refresh=True)
            missing = [index for index, there in enumerate(present) if not there and index >= known]
        elif nbytes <= _PROBE_ABOVE_BYTES:
            missing = list(range(plan.num_chunks))
        else:
            present = self.chunks.present(plan.digests, holder=transfer_id)
            missing = [index for index, there in enumerate(present) if not there]
        chunks = [(index, pages[:, (index - known) * per_chunk:(index - known + 1) * per_chunk])
                  for index in missing]
        record = None
        if transfer_id is not None:
            record = (self.record_key(transfer_id), self._record(plan, transfer_id, holds=holder is not None))
        try:
            # The record goes last, in the same round trip on one server: Redis runs the commands in order.
            written = self.chunks.write(plan, chunks, holder=holder, record=record)
        except BaseException:
            if transfer_id is not None:
                if holder is not None:
                    self._release_quietly(plan.digests, holder)
                # A record pushed after a chunk's write failed names a chunk that is not there: not left to
                # be taken (a decode that took it meanwhile finds that chunk missing: a miss, never bytes).
                self.chunks.delete_keys([self.record_key(transfer_id)])
            raise
        count = sum(1 for nbytes in written if nbytes)
        return Saved(count, plan.num_chunks - count, sum(written))

    def _save_inline(self, plan: ChunkPlan, pages: torch.Tensor, transfer_id: str) -> Saved:
        """:meth:`save` of a small transfer: its one chunk inside its record, one transaction."""
        blob = self.chunks.encode(plan, 0, pages)
        queue = self.record_key(transfer_id)
        try:
            self.store.push_record(queue, [self._record(plan, transfer_id, inline=True), blob.header,
                                           *blob.payload], self.ttl_ms)
        except BaseException:
            self.chunks.delete_keys([queue])  # a failed save leaves nothing, as a chunked one
            raise
        return Saved(1, 0, blob.nbytes)

    def _record(self, plan: ChunkPlan, transfer_id: str, *, inline: bool = False,
                holds: bool = True) -> bytes:
        """The record of transfer ``transfer_id``: the digests of the prompt's chunks (held, shared, or the
        one that follows it inline)."""
        return encode_record(self.prefix, transfer_id, plan.digests, plan.num_tokens, self.chunk_tokens,
                             inline=inline, holds=holds)

    # -- the consumer --------------------------------------------------------------------------------

    def take(self, plan: ChunkPlan, start: int, stop: int, page_format: PageFormat, *,
             transfer_id: str | None = None, hand_on: tuple[str, ...] = (), keep: bool = False,
             into: PagesPlace | None = None) -> Taken:
        """The pages of the chunks covering positions ``start..stop-1``, waiting up to the pop timeout for
        the transfer's record when it has an id; then the transfer's holds are released (with no id, the
        chunks up to the last one read are deleted where no transfer holds them). ``hand_on``: the ids under
        which other readers of the same chunks take the transfer (ranks of a decode holding the same KV
        heads): once the record is here, each gets holds and a record of its own. ``keep``: a take without
        an id deletes nothing (other ranks read the same chunks). ``into``: where the chunks' pages are
        received (an engine's KV blocks; a small transfer's chunk, carried in its record, is not placed).
        With an id, :attr:`Taken.waited` says how long the record was waited for."""
        clock = _RecordClock()
        taken = self._take(plan, start, stop, page_format, transfer_id, hand_on, keep, into, clock)
        if transfer_id is not None and clock.arrived is not None:
            taken.waited = clock.arrived - clock.started
        return taken

    def _take(self, plan: ChunkPlan, start: int, stop: int, page_format: PageFormat, transfer_id: str | None,
              hand_on: tuple[str, ...], keep: bool, into: PagesPlace | None, clock: _RecordClock) -> Taken:
        indexes = plan.covering(start, stop)
        if plan.num_chunks == 1 and self._inline(plan, transfer_id,
                                                 self.chunks.pages_nbytes(plan, 0, page_format)):
            assert transfer_id is not None
            return self._take_inline(plan, indexes, page_format, transfer_id, hand_on, clock)
        if hand_on and transfer_id is not None:
            return self._take_stepwise(plan, indexes, page_format, transfer_id,
                                       popped=self._pop_record(transfer_id, hand_on, clock), into=into)
        # Without a transfer the prompt's stored chunks are taken as an entry was, whole: those before the
        # ones read (the decode's prefix cache held them) go too. In reuse mode nothing goes.
        release: tuple[str, ...] = plan.digests if transfer_id is not None else plan.digests[:indexes.stop]
        if self.reuse or (keep and transfer_id is None):
            release = ()
        queue = None if transfer_id is None else self.record_key(transfer_id)
        try:
            combined = self.chunks.take(plan, list(indexes), page_format, queue=queue,
                                        wait_s=self.pop_timeout_s, release=release,
                                        holder=transfer_id or NOBODY, refresh_ttl=self.reuse, into=into,
                                        on_record=clock.mark)
        except BaseException:
            self._release_quietly(release, transfer_id or NOBODY)  # the pipeline may have stopped before it
            raise
        if combined is None:  # a cluster or a stand-in client: one step after the other
            return self._take_stepwise(plan, indexes, page_format, transfer_id, keep=keep, into=into,
                                       clock=clock)
        record, reads = combined
        # The record this prompt's save pushed, byte for byte, needs no decoding; anything else is decoded to
        # tell why it does not fit.
        if transfer_id is not None and record != self._record(plan, transfer_id, holds=not self.reuse):
            cause, checked = self._checked_record(plan, transfer_id, record)
            if cause != "hit":
                return Taken(indexes.start if indexes else 0, cause=cause)
            assert checked is not None
            if self.reuse and checked.held:  # written by a prefill in transfer mode: its holds go
                self._release_quietly(checked.held, transfer_id)
            if checked.inline is not None:  # a small transfer after all
                return self._inline_taken(plan, indexes, page_format, checked.inline)
        return _leading(indexes, reads)

    def _take_inline(self, plan: ChunkPlan, indexes: range, page_format: PageFormat,
                     transfer_id: str, hand_on: tuple[str, ...], clock: _RecordClock) -> Taken:
        """:meth:`take` of a small transfer: its record's pop, the chunk it carries checked (any other
        record, one carrying none from a prefill that judged otherwise say, is taken as
        :meth:`_take_stepwise` does)."""
        record = self._pop_record(transfer_id, hand_on, clock)
        expected = self._record(plan, transfer_id, inline=True)
        if isinstance(record, (bytes, bytearray)) and record.startswith(expected):
            # The record this save pushed, byte for byte: the chunk follows it.
            return self._inline_taken(plan, indexes, page_format, memoryview(record)[len(expected):])
        return self._take_stepwise(plan, indexes, page_format, transfer_id, popped=record)

    def _inline_taken(self, plan: ChunkPlan, indexes: range, page_format: PageFormat,
                      blob: memoryview) -> Taken:
        """What a take of a small transfer got from the chunk its record carried."""
        if not indexes:
            return Taken(0)
        read = self.chunks.check(plan, 0, blob, page_format)
        if not read.ok:
            logger.warning("dropped the chunk a transfer record carried (%s)", read.cause)
        return _leading(indexes, [read])

    def _take_stepwise(self, plan: ChunkPlan, indexes: range, page_format: PageFormat,
                       transfer_id: str | None, popped: Any = _NOT_POPPED, keep: bool = False,
                       into: PagesPlace | None = None, clock: _RecordClock | None = None) -> Taken:
        """:meth:`take` a round trip at a time: the record (unless ``popped`` already), then (if it fits) the
        chunks, then the release."""
        held: tuple[str, ...] = ()
        if transfer_id is not None:
            record = self._pop_record(transfer_id, (), clock) if popped is _NOT_POPPED else popped
            cause, checked = self._checked_record(plan, transfer_id, record)
            if cause != "hit":
                return Taken(indexes.start if indexes else 0, cause=cause)
            assert checked is not None
            if checked.inline is not None:
                return self._inline_taken(plan, indexes, page_format, checked.inline)
            held = checked.held
        try:
            return self._read_leading(plan, indexes, page_format, into)
        finally:
            # Without a transfer the prompt's stored chunks are taken as an entry was, whole: those before
            # the ones read (the decode's prefix cache held them) go too.
            kept = self.reuse or keep
            done = held if transfer_id is not None else () if kept else plan.digests[:indexes.stop]
            if done:
                self._release_quietly(done, transfer_id or NOBODY)

    def _pop_record(self, transfer_id: str, hand_on: tuple[str, ...] = (),
                    clock: _RecordClock | None = None) -> Any:
        """The transfer's record, waiting up to the pop timeout: its bytes, ``None`` if none came, or the
        error of a key holding another type; handed on to the readers ``hand_on`` first."""
        try:
            record = self.store.pop_record(self.record_key(transfer_id), self.pop_timeout_s)
        except WrongTypeError as exc:
            return exc
        finally:
            if clock is not None:
                clock.mark()
        if hand_on and record is not None:
            self._hand_on(record, transfer_id, hand_on)
        return record

    def _hand_on(self, record: bytes | bytearray, transfer_id: str, others: tuple[str, ...]) -> None:
        """Give each of ``others`` the transfer whose record was popped: holds on the chunks it holds, then a
        record of its own (a record that cannot be read is not handed on: the others find none, and compute
        the prompt, as this take does)."""
        try:
            parsed = parse_record(record, transfer_id, self.prefix)
        except CodecError:
            return
        if not parsed.chunk_tokens:
            return  # a record of an earlier kvredis
        for other in others:
            if parsed.held:
                self.chunks.present(list(parsed.held), holder=other)
            copy = encode_record(self.prefix, other, parsed.digests, parsed.tokens, parsed.chunk_tokens,
                                 inline=parsed.inline is not None, holds=parsed.holds)
            self.store.push_record(self.record_key(other),
                                   [copy, parsed.inline] if parsed.inline is not None else copy, self.ttl_ms)

    def _checked_record(self, plan: ChunkPlan, transfer_id: str, record: Any) -> tuple[str, Record | None]:
        """Why a popped record (:meth:`_pop_record`) does not fit ``plan`` (or ``"hit"``), and the record
        (``None``: none came; an error: the list's key holds another type, and is deleted)."""
        if isinstance(record, Exception):
            self.chunks.delete_keys([self.record_key(transfer_id)])
            return "foreign", None
        if record is None:
            return "late", None
        try:
            parsed = parse_record(record, transfer_id, self.prefix)
        except CodecError as exc:
            logger.warning("dropped the unreadable record of transfer %s: %s", transfer_id, exc)
            return "corrupt", None
        if parsed.digests[len(parsed.digests) - len(plan.digests):] != plan.digests:
            # Another prompt's record under this id: release what it holds all the same.
            self._release_quietly(parsed.held, transfer_id)
            return "foreign", None
        if len(parsed.digests) > len(plan.digests):
            # A transfer of more of the prompt's chunks than the reader needs (a sliding window's blocks, of
            # which it reads the last): chained digests, so the same prompt; the chunks before its own go.
            extra = parsed.held[:len(parsed.held) - len(plan.digests)]
            if extra:
                self._release_quietly(extra, transfer_id)
            return "hit", Record(parsed.digests[len(parsed.digests) - len(plan.digests):], parsed.inline,
                                 parsed.holds)
        return "hit", parsed

    def _read_leading(self, plan: ChunkPlan, indexes: range, page_format: PageFormat,
                      into: PagesPlace | None = None) -> Taken:
        return _leading(indexes, self.chunks.read(plan, list(indexes), page_format, refresh_ttl=self.reuse,
                                                  into=into))

    # -- nobody will take it ----------------------------------------------------------------------------

    def discard(self, transfer_id: str, *, wait_s: float = 0.0, prefix: str | None = None) -> bool:
        """:func:`discard_transfer` under this key space, or another rank's ``prefix``."""
        return discard_transfer(self.store, prefix or self.prefix, transfer_id, wait_s=wait_s)

    def _release_quietly(self, digests: tuple[str, ...] | list[str], holder: str) -> None:
        try:
            self.chunks.release(list(digests), holder)
        except KVRedisError as exc:
            logger.warning("could not release %d chunks (they expire with their TTL): %s", len(digests), exc)


class _RecordClock:
    """When a take started and when its transfer's record arrived (the pop's wait ended)."""

    __slots__ = ("arrived", "started")

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.arrived: float | None = None

    def mark(self) -> None:
        if self.arrived is None:
            self.arrived = time.perf_counter()


def _leading(indexes: range, reads: list[ChunkRead]) -> Taken:
    """The chunks read, up to the first that could not be."""
    taken = Taken(indexes.start if indexes else 0)
    for read in reads:
        if not read.ok:
            taken.cause = read.cause
            break
        taken.chunks.append(read.pages)
        taken.nbytes += read.nbytes
    return taken



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
        held = parse_record(record, transfer_id, prefix).held
    except CodecError as exc:
        logger.warning("discarded an unreadable record of transfer %s (its chunks expire with their TTL): %s",
                       transfer_id, exc)
        return True
    chunks.release(held, transfer_id)
    return True


def encode_record(space: str, transfer_id: str, digests: tuple[str, ...] | list[str], tokens: int,
                  chunk_tokens: int, *, inline: bool = False, holds: bool = True) -> bytes:
    """The record of transfer ``transfer_id`` in key space ``space``, naming chunks ``digests`` of a
    ``tokens``-token prompt in chunks of ``chunk_tokens`` (see :data:`RECORD_MAGIC`); with ``inline``, the
    head of a record its one chunk's blob follows (:data:`INLINE_MAGIC`, padded); without ``holds``, one
    whose transfer holds none of them (:data:`SHARED_MAGIC`)."""
    space_raw, id_raw = space.encode(), transfer_id.encode()
    magic = INLINE_MAGIC if inline else RECORD_MAGIC if holds else SHARED_MAGIC
    body = b"".join((_RECORD_HEAD.pack(magic, tokens, chunk_tokens, len(digests), len(space_raw),
                                       len(id_raw)), space_raw, id_raw, bytes.fromhex("".join(digests))))
    record = body + _RECORD_SUM.pack(xxhash.xxh3_64_intdigest(body))
    return record.ljust(_inline_offset(len(record)), b"\0") if inline else record


def record_digests(record: bytes | bytearray, transfer_id: str, space: str) -> tuple[str, ...]:
    """The chunk digests a transfer's record names, once checked as written for key space ``space`` and
    transfer ``transfer_id``; raises :class:`~kvredis.errors.CodecError` for any other bytes."""
    return parse_record(record, transfer_id, space).digests


def parse_record(record: bytes | bytearray, transfer_id: str, space: str) -> Record:
    """A transfer's record, once checked as written for key space ``space`` and transfer ``transfer_id``;
    raises :class:`~kvredis.errors.CodecError` for any other bytes. The chunk a small transfer's record
    carries is not checked here (:meth:`ChunkStore.check` does, against the reader's plan)."""
    magic = bytes(record[:len(RECORD_MAGIC)])
    if magic in (RECORD_MAGIC, INLINE_MAGIC, SHARED_MAGIC):
        parsed = _parse_raw_record(record, transfer_id, space, inline=magic == INLINE_MAGIC)
        return dataclasses.replace(parsed, holds=magic != SHARED_MAGIC)
    # A record as kvredis wrote it before (a codec blob): a prefill not yet upgraded.
    tensors, meta = codec.decode(record, max_payload_bytes=_MAX_RECORD_BYTES)
    if (meta.get("kind") != RECORD_KIND or meta.get("space") != space or meta.get("id") != transfer_id
            or len(tensors) != 1 or tensors[0] is None or tensors[0].dtype != torch.uint8
            or tensors[0].dim() != 1 or tensors[0].numel() % 16):
        raise CodecError(f"not a transfer record of {space} for {transfer_id}: {meta!r}")
    raw = codec.tensor_bytes(tensors[0]).tobytes()
    return Record(tuple(raw[i:i + 16].hex() for i in range(0, len(raw), 16)))


def _inline_offset(record_nbytes: int) -> int:
    """Where the chunk starts in a small transfer's record of ``record_nbytes`` (aligned as a blob's payload
    is within the blob, so its tensors are as aligned as an entry's)."""
    return -(-record_nbytes // codec.ALIGN) * codec.ALIGN


def _parse_raw_record(record: bytes | bytearray, transfer_id: str, space: str, *, inline: bool) -> Record:
    """:func:`parse_record` of a record in :data:`RECORD_MAGIC`'s or :data:`INLINE_MAGIC`'s layout."""
    if len(record) < _RECORD_HEAD.size + _RECORD_SUM.size:
        raise CodecError(f"a transfer record of {len(record)} bytes")
    _, tokens, chunk_tokens, count, space_len, id_len = _RECORD_HEAD.unpack_from(record)
    names = _RECORD_HEAD.size + space_len + id_len
    size = names + 16 * count + _RECORD_SUM.size  # the record's own bytes, with its checksum
    if size > _MAX_RECORD_BYTES or len(record) < size or (not inline and len(record) != size):
        raise CodecError(f"a transfer record of {len(record)} bytes naming {count} chunks")
    view = memoryview(record)
    body = bytes(view[:size - _RECORD_SUM.size])
    if xxhash.xxh3_64_intdigest(body) != _RECORD_SUM.unpack_from(record, size - _RECORD_SUM.size)[0]:
        raise CodecError("corrupt transfer record: checksum mismatch")
    if (body[_RECORD_HEAD.size:_RECORD_HEAD.size + space_len] != space.encode()
            or body[_RECORD_HEAD.size + space_len:names] != transfer_id.encode()):
        raise CodecError(f"not a transfer record of {space} for {transfer_id}")
    digests = tuple(body[i:i + 16].hex() for i in range(names, len(body), 16))
    if not inline:
        return Record(digests, tokens=tokens, chunk_tokens=chunk_tokens)
    start = _inline_offset(size)
    if count != 1 or len(record) <= start or any(view[size:start]):
        raise CodecError(f"a small transfer's record of {len(record)} bytes naming {count} chunks")
    return Record(digests, view[start:], tokens=tokens, chunk_tokens=chunk_tokens)
