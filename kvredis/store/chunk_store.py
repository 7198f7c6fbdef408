"""Chunks of KV pages in Redis: which are present, writing only the missing, reading, releasing.

Each chunk (:mod:`kvredis.store.chunk_keys`) is one self-describing value: a kvredis blob
(:mod:`kvredis.store.codec`) holding the chunk's token IDs and its pages ``[layers, pages, *page_shape]``,
with metadata naming the key space, the chunk's position, its digest and its parent's. One value, written by
one ``SET``, so a reader sees all of a chunk or none of it, and eviction cannot leave half of one (the two-key
layouts of peers went half-missing so). Reads check everything the key promises: the blob's checksums, its key
space, its digest and parent, its position and its tokens, and the page shape and dtype the reader needs; a
chunk that fails a check is deleted and counts as missing.

**Transfer mode** keeps a chunk only while a transfer still needs it. Each chunk has a *holders* set in its
slot: a producer adds its transfer's id when it writes the chunk or finds it present, and whoever consumes
or abandons the transfer removes it; the last removal deletes the chunk. Each of those steps is one Lua
script on the chunk's two keys, so a chunk is never deleted between another producer finding it and
holding it. In *reuse* mode nobody holds or releases: chunks live under their TTL (refreshed on a hit)
and Redis's eviction.

Every call is one pipelined round trip per Redis node, bounded by the client's timeouts; errors are
:class:`~kvredis.KVRedisError` subclasses.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import hashlib
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import redis
import torch

from kvredis.errors import CodecError, KVRedisError
from kvredis.store import codec, resp
from kvredis.store.chunk_keys import ChunkKeys, ChunkPlan
from kvredis.store.client import RedisStore
from kvredis.store.memory import fresh_output
from kvredis.store.redis_errors import raise_first_error
from kvredis.store.resp import RespError

logger = logging.getLogger("kvredis.chunks")

CHUNK_KIND = "chunk"
"""The ``kind`` of a chunk blob's metadata (an entry of the lookup buffer has none)."""

# KEYS: the chunk, its holders. ARGV: holder ("" = none), TTL in ms. Returns 1 if the chunk is there (and now
# held, TTLs refreshed), 0 if not (nothing changed).
_HOLD = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[1] ~= '' then
  redis.call('SADD', KEYS[2], ARGV[1])
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 1
"""
# KEYS: the chunk, its holders. ARGV: the value, TTL in ms, holder ("" = none). Writes the chunk unless it is
# there already (two producers writing one chunk leave one good copy), and holds it. Returns 1 if written.
_WRITE = """
local written = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
if ARGV[3] ~= '' then
  redis.call('SADD', KEYS[2], ARGV[3])
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  if not written then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
end
if written then return 1 end
return 0
"""
# KEYS: the chunk, its holders. ARGV: holder, "1" if that is NOBODY. Drops the hold; the last one deletes the
# chunk. A holder that held nothing deletes nothing (a chunk of a reuse-mode writer has no holders and stays),
# but NOBODY, a take without a transfer, deletes a chunk nobody holds. Returns 1 if it deleted the chunk.
_RELEASE = """
local dropped = redis.call('SREM', KEYS[2], ARGV[1])
if (dropped == 1 or ARGV[2] == '1') and redis.call('SCARD', KEYS[2]) == 0 then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

_PURGED_VALUE_BYTES = (7 << 20) - (1 << 10)
"""A chunk's value from about this size on (with its header and Redis's own) lands in jemalloc's 8 MiB size
class or above, which Redis's jemalloc hands back to the kernel as soon as it is freed: the next such value
page-faults in every page (docs/deployment.md, "Chunk length")."""

NOBODY = "0" * 16
"""The holder a take without a transfer id releases as: it holds nothing, so chunks nobody holds go."""

_SHAS: dict[str, str] = {}


@dataclass(frozen=True)
class PageFormat:
    """What a reader's engine needs of a chunk's pages: their dtype and the shape of one layer's page."""

    dtype: torch.dtype
    layers: int
    page_shape: tuple[int, ...]
    pages_per_block: int = 1  # kernel pages a scheduler block holds

    def shape(self, pages: int) -> tuple[int, ...]:
        """The pages tensor of a chunk with ``pages`` pages."""
        return (self.layers, pages, *self.page_shape)


class PagesPlace(Protocol):
    """Where the pages of a plan's chunks are to be received."""

    in_place: bool
    """The buffers are where the pages end up (an engine's KV blocks): a read returns no tensor of them.
    Otherwise they are one buffer a read returns the pages in (a pinned buffer a device copies from)."""

    def __call__(self, index: int) -> Sequence[memoryview] | None:
        """Buffers whose bytes, in order, are chunk ``index``'s pages as stored (``[layers, pages, ...]``), or
        ``None`` for a buffer of the read's own. Called when the chunk's reply arrives; may raise to abandon
        the read."""


@dataclass
class ChunkRead:
    """One chunk as read: its pages (``None`` when they were received in place, see :data:`PagesPlace`), and
    why not (``cause``: ``hit``, or ``absent``, ``corrupt``, ``foreign``, ``mismatch``)."""

    index: int
    pages: torch.Tensor | None
    cause: str = "hit"
    nbytes: int = 0

    @property
    def ok(self) -> bool:
        """Whether the chunk was read and passed every check."""
        return self.cause == "hit"


class ChunkStore:
    """The chunks of one key space (namespace and engine identity) in Redis."""

    def __init__(self, store: RedisStore, prefix: str, *, ttl_ms: int, block_size: int,
                 max_chunk_bytes: int, checksum: bool = True) -> None:
        self.store = store
        self.keys = ChunkKeys(prefix)
        self.prefix = prefix
        self.ttl_ms = max(1, int(ttl_ms))
        self.block_size = block_size
        self.max_chunk_bytes = max_chunk_bytes
        self.checksum = checksum
        self._warned_large = False

    def ttl_at(self, index: int) -> int:
        """The TTL of a prompt's chunk ``index``, in ms: shorter the further the chunk lies (by up to a
        quarter of the TTL, from position 1,024 on), so that a Redis evicting by TTL (``volatile-ttl``) takes
        a prompt's later chunks before its earlier ones. Every use restarts it (reuse)."""
        return self.ttl_ms - min(index, _TTL_STEPS) * (self.ttl_ms // (4 * _TTL_STEPS))

    def _pair(self, digest: str) -> list[str]:
        """A chunk's key and its holders' set (one slot): the keys every script takes."""
        return [self.keys.chunk(digest), self.keys.holders(digest)]

    def _eval_each(self, client: Any, source: str, calls: Sequence[tuple[list[str], list[Any]]]) -> list[Any]:
        """Run script ``source`` once per ``(keys, args)``, pipelined in one round trip (EVALSHA; a server
        that lacks the script loads it and runs those calls again: NOSCRIPT means they did not run)."""
        sha = _sha(source)
        replies: list[Any] = [None] * len(calls)
        pending = list(range(len(calls)))
        for attempt in range(2):
            results = self._run(client, [("EVALSHA", sha, len(keys), *keys, *args)
                                         for keys, args in (calls[i] for i in pending)])
            missing = []
            for i, result in zip(pending, results, strict=True):
                no_script = isinstance(result, redis.exceptions.NoScriptError) or "NOSCRIPT" in str(result)
                if _is_error(result) and no_script and attempt == 0:
                    missing.append(i)
                elif _is_error(result):
                    _raise(result)
                else:
                    replies[i] = result
            if not missing:
                break
            _no_errors(self._run(client, [("SCRIPT", "LOAD", source)]))
            pending = missing
        return replies

    def _run(self, client: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
        """``commands`` in one round trip, their replies (errors among them, not raised). On one server,
        framed by kvredis (values given as lists of buffers go out unjoined, bulk replies arrive as writable
        buffers); on a cluster or a stand-in client, through a redis-py pipeline."""
        if not self.store.cluster:
            replies = self.store.call(client, *commands)
            if replies is not None:
                return replies
        pipe = client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*(b"".join(arg) if isinstance(arg, list) else arg for arg in command))
        return list(pipe.execute(raise_on_error=False))

    # -- presence ---------------------------------------------------------------------------------

    def present(self, digests: Sequence[str], *, holder: str | None = None, lookup: bool = False,
                refresh: bool = False) -> list[bool]:
        """Which of a prompt's chunks (``digests``, from its first) are in Redis now; with ``holder``, each
        present one is held for it (transfer mode); with ``refresh``, its TTL restarts (reuse: a prompt sent
        again keeps its chunks). ``lookup``: bounded by ``lookup_timeout_s`` (a call from vLLM's scheduler;
        it changes nothing, so a lookup does not count as a use)."""
        if not digests:
            return []
        client = self.store.prober if lookup else self.store.redis
        with self.store.guarded(f"looking up {len(digests)} chunks"):
            if holder is None:
                commands = [("PEXPIRE", self.keys.chunk(d), self.ttl_at(i)) if refresh
                            else ("EXISTS", self.keys.chunk(d)) for i, d in enumerate(digests)]
                replies = _no_errors(self._run(client, commands))
                return [bool(int(reply)) for reply in replies]
            replies = self._eval_each(client, _HOLD, [(self._pair(digest), [holder, self.ttl_at(i)])
                                                      for i, digest in enumerate(digests)])
            return [bool(int(reply)) for reply in replies]

    def exists(self, keys: Sequence[str], *, lookup: bool = True) -> list[bool]:
        """Whether each of ``keys`` (chunks of any key space) is in Redis, in one round trip; ``lookup``:
        bounded by ``lookup_timeout_s``."""
        if not keys:
            return []
        client = self.store.prober if lookup else self.store.redis
        with self.store.guarded(f"looking up {len(keys)} chunks"):
            replies = _no_errors(self._run(client, [("EXISTS", key) for key in keys]))
        return [bool(int(reply)) for reply in replies]

    def stored_prefix(self, digests: Sequence[str], *, lookup: bool = True) -> int:
        """How many chunks from the first are in Redis without a gap (a prefix ends at its first hole)."""
        count = 0
        for there in self.present(digests, lookup=lookup):
            if not there:
                break
            count += 1
        return count

    # -- writing ----------------------------------------------------------------------------------

    def encode(self, plan: ChunkPlan, index: int, pages: torch.Tensor) -> codec.Encoded:
        """Chunk ``index`` of ``plan`` with its pages ``[layers, pages, *page_shape]`` as a blob."""
        frames, meta = self._frames(plan, index, pages)
        return frames.encode(meta, checksum=self.checksum)

    def _frames(self, plan: ChunkPlan, index: int,
                pages: torch.Tensor) -> tuple[codec.Frames, dict[str, Any]]:
        """Chunk ``index``'s tensors as frames (not hashed yet), and its metadata."""
        start, stop = plan.span(index)
        blocks = -(-(stop - start) // self.block_size)
        if pages.dim() < 2 or pages.shape[1] % blocks:
            raise KVRedisError(
                f"chunk {index} covers {blocks} blocks, its pages tensor is {tuple(pages.shape)}")
        frames = codec.Frames.of([plan.chunk_tokens_of(index), pages])
        if frames.nbytes > self.max_chunk_bytes:
            raise KVRedisError(f"chunk of {frames.nbytes} bytes exceeds KVREDIS_MAX_ENTRY_BYTES="
                               f"{self.max_chunk_bytes}")
        meta = {"kind": CHUNK_KIND, "space": self.prefix, "start": start, "digest": plan.digests[index],
                "parent": plan.parent(index)}
        return frames, meta

    def write(self, plan: ChunkPlan, chunks: Sequence[tuple[int, torch.Tensor]], *,
              holder: str | None = None, record: tuple[str, bytes] | None = None) -> list[int]:
        """Write each ``(index, pages)`` unless Redis holds that chunk already (then it is left as it is);
        the bytes written for each (0: it was there). With ``holder``, each is held for that transfer
        either way. With ``record`` (a list's key and a value), the value is then pushed onto that list
        (its TTL refreshed), after every chunk: on one server in the same round trip."""
        if not chunks and record is None:
            return []
        framed = [(index, plan.digests[index], *self._frames(plan, index, pages)) for index, pages in chunks]
        self._warn_if_large(framed)
        client = self.store.redis
        with self.store.guarded(f"writing {len(framed)} chunks"):
            written = None if self.store.cluster else self._write_framed(client, framed, holder, record)
            if written is not None:
                return written
            # A script per chunk: one slot each, whatever node holds it (values pass through Lua: slower).
            blobs = [(index, digest, frames.encode(meta, checksum=self.checksum))
                     for index, digest, frames, meta in framed]
            calls = [(self._pair(digest), [[blob.header, *blob.payload], self.ttl_at(index), holder or ""])
                     for index, digest, blob in blobs]
            replies = [bool(int(reply)) for reply in self._eval_each(client, _WRITE, calls)]
            if record is not None:
                self.store.push_record(record[0], record[1], self.ttl_ms)
            return [blob.nbytes if _ok(reply) else 0
                    for (_, _, blob), reply in zip(blobs, replies, strict=True)]

    def _warn_if_large(self, framed: list[tuple[int, str, codec.Frames, dict[str, Any]]]) -> None:
        """Say once, at the first chunk of :data:`_PURGED_VALUE_BYTES` or more, what such values cost a Redis
        whose allocator is left as it comes, and what to do."""
        if self._warned_large or not framed:
            return
        nbytes = max(frames.nbytes for _, _, frames, _ in framed)
        if nbytes < _PURGED_VALUE_BYTES:
            return
        self._warned_large = True
        logger.warning(
            "chunks of %.1f MiB: Redis's jemalloc gives a freed value over 7 MiB back to the kernel at once, "
            "so each write of one page-faults in all its pages (writes 2-3x slower on the test machine). "
            "Choose KVREDIS_CHUNK_TOKENS so that a chunk stays under 7 MiB, or run Redis with "
            "dirty_decay_ms:-1 in its jemalloc configuration (docs/deployment.md, \"Chunk length\" and "
            "\"The allocator\")", nbytes / (1 << 20))

    def _write_framed(self, client: Any, framed: list[tuple[int, str, codec.Frames, dict[str, Any]]],
                      holder: str | None, record: tuple[str, bytes] | None = None) -> list[int] | None:
        """:meth:`write` on one server, framed by kvredis: a transaction per chunk, SET NX (the value as its
        header and payload buffers, never joined nor passed through Lua) and the hold together, so no release
        comes between them. The record, if any, is pushed in the last chunk's transaction (with no holder,
        one of its own). The bytes written for each chunk; ``None`` for a stand-in client.

        A large write hashes each chunk on a thread of its own while the one before it is sent (as an
        entry's pieces are): at 128 MiB the checksums alone are 9 ms of a 120 ms save on the test VM."""
        merged = record is not None and holder is not None and bool(framed)
        pushing: list[tuple[Any, ...]] = []
        if record is not None:
            pushing = [("RPUSH", record[0], record[1]), ("PEXPIRE", record[0], self.ttl_ms)]
        ahead = None
        if self.checksum and len(framed) > 1 and sum(f.nbytes for _, _, f, _ in framed) >= _HASH_AHEAD_BYTES:
            ahead = codec.ChecksumsAhead([frames for _, _, frames, _ in framed])
        sizes: list[int] = []

        def groups() -> Iterator[list[tuple[Any, ...]]]:
            for position, (index, digest, frames, meta) in enumerate(framed):
                crcs = None if ahead is None else ahead.get(position)
                blob = frames.encode(meta, checksum=self.checksum, crcs=crcs)
                sizes.append(blob.nbytes)
                key, holders = self._pair(digest)
                ttl = self.ttl_at(index)
                write = ("SET", key, [blob.header, *blob.payload], "NX", "PX", ttl)
                if holder is None:
                    yield [write]
                    continue
                last = pushing if merged and position == len(framed) - 1 else []
                yield [("MULTI",), write, ("SADD", holders, holder), ("PEXPIRE", holders, ttl),
                       ("PEXPIRE", key, ttl), *last, ("EXEC",)]
            if record is not None and not merged:
                yield [("MULTI",), *pushing, ("EXEC",)]

        try:
            if ahead is None:  # one write: a small save's round trip feels each send
                replies = self.store.call(client, *[command for group in groups() for command in group])
            else:
                replies = self.store.call_in_groups(client, groups())
        finally:
            if ahead is not None:
                ahead.close()
        if replies is None:
            return None
        _no_errors(replies)  # the first error in order: a NOPERM when queued, not the EXECABORT after it
        if merged:  # the last transaction: ... QUEUED QUEUED [SET, SADD, PEXPIRE, PEXPIRE, RPUSH, PEXPIRE]
            last = replies[-1]
            raise_first_error([*replies[-3:-1], last[4:] if isinstance(last, list) else last])
            del replies[-3:-1]
            if isinstance(last, list):
                replies[-1] = last[:4]
        elif record is not None:
            raise_first_error(replies[-4:])
            replies = replies[:-4]
        if holder is not None:
            executed = replies[5::6]  # EXEC's: [SET's, SADD's, PEXPIRE's, PEXPIRE's]
            replies = _no_errors([reply[0] if isinstance(reply, list) else reply for reply in executed])
        return [size if _ok(reply) else 0 for size, reply in zip(sizes, replies, strict=True)]

    # -- reading ----------------------------------------------------------------------------------

    def read(self, plan: ChunkPlan, indexes: Sequence[int], page_format: PageFormat, *,
             refresh_ttl: bool = False, into: PagesPlace | None = None) -> list[ChunkRead]:
        """Read chunks ``indexes`` of ``plan`` (one round trip) and check each; a chunk that fails a check
        is deleted and read as ``None`` with its cause. ``refresh_ttl`` (reuse): the TTL of each chunk read,
        and of every chunk before it, restarts. ``into``: where pages go (on one server)."""
        if not indexes:
            return []
        keys = [self.keys.chunk(plan.digests[index]) for index in indexes]
        touch = self._touches(plan, indexes) if refresh_ttl else []
        client = self.store.redis
        with self.store.guarded(f"reading {len(keys)} chunks"):
            fetched = None
            if not self.store.cluster:
                fetched = self._fetch_framed(client, plan, indexes, keys, page_format, refresh_ttl,
                                             after=touch, into=into)
            if fetched is not None:
                values = fetched[1]
                _no_errors(fetched[2])
            else:
                values = self._fetch(client, keys, self._ttls(indexes) if refresh_ttl else None)
                if touch:
                    _no_errors(self._run(client, touch))
            _raise_unless_wrongtype(values)
        return self._checked_reads(plan, indexes, keys, values, page_format)

    def take(self, plan: ChunkPlan, indexes: Sequence[int], page_format: PageFormat, *, queue: str | None,
             wait_s: float, release: Sequence[str], holder: str, refresh_ttl: bool = False,
             into: PagesPlace | None = None,
             on_record: Callable[[], None] | None = None) -> tuple[Any, list[ChunkRead]] | None:
        """In one round trip on one server: take the oldest record of list ``queue`` (a blocking pop, waiting
        up to ``wait_s``; none without a queue), read chunks ``indexes`` as :meth:`read` does, then drop
        ``holder``'s hold on each of ``release`` as :meth:`release` does. Redis runs them in that order, so
        the chunks are read after the record came and before they are released. The pop's reply (the
        record, ``None`` when none came, or the error reply of a key holding another type) and the reads;
        ``None`` on a cluster or a stand-in client, whose callers do each step on its own.

        The reads and the release run whether or not a record came: a caller that finds none (or a record of
        another prompt) has released the holds ``holder`` had on ``release`` all the same. ``refresh_ttl``
        (reuse): the TTL of each chunk read, and of every chunk before it, restarts. ``into``: where pages
        go. ``on_record``: called as the record's reply starts to arrive (the pop's wait is over)."""
        if self.store.cluster:
            return None
        keys = [self.keys.chunk(plan.digests[index]) for index in indexes]
        sha = _sha(_RELEASE)
        before = [] if queue is None else [("BLPOP", queue, f"{max(wait_s, 0.001):.3f}")]
        after = [("EVALSHA", sha, 2, *self._pair(digest), *_release_args(holder)) for digest in release]
        if refresh_ttl:
            after += self._touches(plan, indexes)
        client = self.store.popper if queue is not None else self.store.redis
        with self.store.guarded(f"taking {len(keys)} chunks"):
            fetched = self._fetch_framed(client, plan, indexes, keys, page_format, refresh_ttl, before, after,
                                         into, on_record)
            if fetched is None:
                return None
            popped, values, released = fetched
            if isinstance(popped, RespError) and "WRONGTYPE" not in str(popped):
                _raise(popped)
            missing = []
            _no_errors(released[len(release):])
            for digest, reply in zip(release, released[:len(release)], strict=True):
                if _is_error(reply) and "NOSCRIPT" in str(reply):
                    missing.append(digest)
                elif _is_error(reply):
                    _raise(reply)
            if missing:  # the script was not loaded yet: those releases did not run
                self._eval_each(client, _RELEASE, [(self._pair(digest), _release_args(holder))
                                                   for digest in missing])
            _raise_unless_wrongtype(values)
        record = popped[1] if isinstance(popped, list) and len(popped) == 2 else popped
        return record, self._checked_reads(plan, indexes, keys, values, page_format)

    def _touches(self, plan: ChunkPlan, indexes: Sequence[int]) -> list[tuple[Any, ...]]:
        """The TTL restarts of the chunks before ``indexes``: a prefix is worth more than its suffix, so a
        use of a prompt's later chunks is a use of its earlier ones too (reuse)."""
        return [("PEXPIRE", self.keys.chunk(plan.digests[i]), self.ttl_at(i))
                for i in range(min(indexes, default=0))]

    def _ttls(self, indexes: Sequence[int]) -> list[int]:
        return [self.ttl_at(index) for index in indexes]

    def _fetch(self, client: Any, keys: list[str], ttls: list[int] | None) -> list[Any]:
        """Each chunk's whole value (or ``None``, or an error reply: its callers raise those but WRONGTYPE),
        in one round trip; with ``ttls``, each one's TTL restarts at its own."""
        commands = [("GET", key) for key in keys] if ttls is None else [
            ("GETEX", key, "PX", ttl) for key, ttl in zip(keys, ttls, strict=True)]
        return self._run(client, commands)

    def _fetch_framed(self, client: Any, plan: ChunkPlan, indexes: Sequence[int], keys: list[str],
                      page_format: PageFormat, refresh_ttl: bool, before: Sequence[tuple[Any, ...]] = (),
                      after: Sequence[tuple[Any, ...]] = (), into: PagesPlace | None = None,
                      on_before: Callable[[], None] | None = None) -> tuple[Any, list[Any], list[Any]] | None:
        """The chunks read on one server, framed by kvredis, between commands ``before`` (at most one) and
        ``after``: the reply of ``before``, each chunk's value (or its :class:`ChunkRead`, where it was
        checked as it arrived), the replies of ``after``; ``None`` for a stand-in client. ``on_before`` is
        called as the reply of ``before`` starts to arrive.

        Each chunk's payload is received straight where it belongs: its pages where ``into`` says (an
        engine's KV blocks), or into one output buffer allocated for all of them (huge pages for large
        reads, :mod:`kvredis.store.memory`); its header into a small buffer of its own. The payload's length
        is known from the page format, and it is the value's tail. A chunk of at most
        ``KVREDIS_INFLIGHT_BYTES`` (or ``KVREDIS_CHUNK_BYTES`` if larger) is one GET; a larger one is read in
        pieces of ``KVREDIS_CHUNK_BYTES`` with GETRANGE, about ``KVREDIS_INFLIGHT_BYTES`` requested ahead
        (Redis serves a reply of a few MiB much faster than one of many: docs/benchmarks-history.md).
        Pieces of one value read apart could come from two values if the key were written again between
        them; each chunk's checksum then fails, so the read is a miss, never mixed bytes. Without checksums
        the pieces are read inside one MULTI/EXEC, one snapshot. A value whose length does not fit the
        layout (another format, a planted value) is fetched again whole and checked as such, so it is
        dropped for the same cause as ever."""
        piece = max(self.store.config.chunk_bytes, 1)
        # A value Redis serves well as one reply (up to the bytes kept in flight) is one GET: cut into
        # pieces, a chunk just over a piece would cost a round trip for its last few bytes.
        one_reply = max(piece, self.store.config.inflight_bytes)
        sizes = [self._payload_nbytes(plan, index, page_format) for index in indexes]
        out = None if into is not None else fresh_output(sum(sizes)).numpy().data.cast("B")
        commands: list[tuple[Any, ...]] = list(before)
        places: list[resp.Place | None] = [None] * len(before)
        if before and on_before is not None:
            places[0] = _noticing(on_before)
        costs: list[int] = [0] * len(before)
        reads: list[_Read] = []
        offset = 0
        snapshot = not self.checksum
        for index, key, size in zip(indexes, keys, sizes, strict=True):
            ttl = self.ttl_at(index)
            if into is None:
                assert out is not None
                read = _Read(size, piece, Scatter([out[offset:offset + size]]))
            else:
                read = _Read(size, piece, None, functools.partial(_placed_payload, into, index, size,
                                                                  page_format))
            offset += size
            reads.append(read)
            read.first = read.last = len(commands)
            read.stop = read.first + 1
            if size <= one_reply:
                commands.append(("GETEX", key, "PX", ttl) if refresh_ttl else ("GET", key))
                places.append(read.place_whole)
                costs.append(size)
                continue
            # The header is what precedes the payload's ``size`` bytes; the pieces are counted from the end.
            ranges = [("GETRANGE", key, 0, -size - 1)]
            ranges += [("GETRANGE", key, start - size, min(start + piece, size) - size - 1)
                       for start in range(0, size, piece)]
            expiry = [("PEXPIRE", key, ttl)] if refresh_ttl else []
            if snapshot:
                group = [("MULTI",), *ranges, *expiry, ("EXEC",)]
                read.last = len(commands) + len(group) - 1
                read.stop = read.last + 1
                commands += group
                places += [None] * (len(group) - 1) + [read.place_in_exec]
                costs += [0] * (len(group) - 1) + [size]
                continue
            read.last = len(commands) + len(ranges) - 1
            read.stop = read.last + 1 + len(expiry)
            commands += ranges + expiry
            places += [None] + [read.piece_place(j) for j in range(len(ranges) - 1)] + [None] * len(expiry)
            costs += [0] + [min(piece, size - start) for start in range(0, size, piece)] + [0] * len(expiry)
        first_after = len(commands)
        commands += after
        places += [None] * len(after)
        costs += [0] * len(after)
        window = self.store.config.inflight_bytes
        if snapshot:  # Redis makes a transaction's whole reply before sending any: two in flight at least
            window = max(window, 2 * max(sizes, default=0))
        checked: list[ChunkRead | None] = [None] * len(reads)
        ends = {read.stop - 1: k for k, read in enumerate(reads)}

        def check_arrived(at: int, replies: list[Any]) -> None:
            # A chunk is checked as its last reply is in, while Redis sends the next one: its checksum
            # overlaps the transfer instead of following it (and its bytes are still in the CPU's cache).
            k = ends.get(at)
            if k is None:
                return
            value = reads[k].value(replies)
            if isinstance(value, _Split):
                with contextlib.suppress(Exception):  # checked again after the read, and raised there
                    checked[k] = self._verified(plan, indexes[k], value, page_format)

        replies = self.store.pipeline(client, commands, places, costs, window, check_arrived)
        if replies is None:
            return None
        values = [read.value(replies) if done is None else done
                  for read, done in zip(reads, checked, strict=True)]
        again = [i for i, value in enumerate(values) if value is _AGAIN]
        if again:
            whole = self._fetch(self.store.redis, [keys[i] for i in again],
                                self._ttls([indexes[i] for i in again]) if refresh_ttl else None)
            for i, value in zip(again, whole, strict=True):
                values[i] = value
        return (replies[0] if before else None), values, replies[first_after:]

    def pages_nbytes(self, plan: ChunkPlan, index: int, page_format: PageFormat) -> int:
        """The bytes of chunk ``index``'s pages in ``page_format``."""
        start, stop = plan.span(index)
        blocks = -(-(stop - start) // self.block_size)
        pages = page_format.dtype.itemsize
        for dim in page_format.shape(blocks * page_format.pages_per_block):
            pages *= dim
        return pages

    def _payload_nbytes(self, plan: ChunkPlan, index: int, page_format: PageFormat) -> int:
        """The payload length of chunk ``index`` written in ``page_format``: its tokens, then its pages."""
        start, stop = plan.span(index)
        return _aligned(8 * (stop - start)) + _aligned(self.pages_nbytes(plan, index, page_format))

    def _checked_reads(self, plan: ChunkPlan, indexes: Sequence[int], keys: list[str], values: list[Any],
                       page_format: PageFormat) -> list[ChunkRead]:
        """Each value checked (:meth:`_verified`); those that fail a check deleted."""
        reads = []
        bad: list[str] = []
        for index, key, value in zip(indexes, keys, values, strict=True):
            if value is None:
                reads.append(ChunkRead(index, None, "absent"))
                continue
            if isinstance(value, ChunkRead):  # checked as it arrived (_fetch_framed)
                read = value
            elif _is_error(value):  # WRONGTYPE: a list or set planted at a chunk's key
                read = ChunkRead(index, None, "foreign")
            else:
                read = self._verified(plan, index, value, page_format)
            if not read.ok:
                logger.warning("dropped chunk %s (%s)", key, read.cause)
                bad.append(key)
            reads.append(read)
        if bad:
            self.delete_keys(bad)
        return reads

    def check(self, plan: ChunkPlan, index: int, blob: bytes | bytearray | memoryview,
              page_format: PageFormat) -> ChunkRead:
        """Chunk ``index`` of ``plan`` from a blob received some other way than from its key (a transfer's
        record carries a small transfer's one chunk): the checks of :meth:`read`, nothing deleted."""
        return self._verified(plan, index, blob, page_format)

    def _verified(self, plan: ChunkPlan, index: int, value: Any, page_format: PageFormat) -> ChunkRead:
        """The chunk's pages if ``value`` (a whole value, or a :class:`_Split` one) is exactly what chunk
        ``index`` of ``plan`` must hold."""
        try:
            if isinstance(value, _Split):
                header = codec.read_header(value.header, max_payload_bytes=self.max_chunk_bytes)
                if header.payload_offset != len(value.header):  # not the layout the split assumed
                    return self._verified(plan, index, value.joined(), page_format)
                split = value
            elif isinstance(value, (bytes, bytearray, memoryview)):
                view = memoryview(value).cast("B")
                header = codec.read_header(view, max_payload_bytes=self.max_chunk_bytes)
                if view.readonly or view.nbytes != header.payload_offset + header.payload_nbytes:
                    # Immutable bytes (a redis-py reply) are copied once; a blob of another length is named.
                    tensors, meta = codec.decode(view, max_payload_bytes=self.max_chunk_bytes,
                                                 verify=self.checksum)
                    return self._matched(plan, index, meta, tensors, view.nbytes, page_format)
                split = _Split(view[:header.payload_offset], Scatter([view[header.payload_offset:]]),
                               view.nbytes)
            else:
                return ChunkRead(index, None, "foreign")
            checked = self._verified_split(plan, index, header, split, page_format)
            if checked is not None:
                return checked
            # Not a chunk's two tensors: decoded (from a copy if it lies in several buffers) to say why not.
            views = split.payload.views
            tensors = codec.decode_payload(header, views[0] if len(views) == 1 else split.payload.join(),
                                           verify=self.checksum)
        except CodecError as exc:
            cause = "foreign" if "foreign" in str(exc) or "version" in str(exc) else "corrupt"
            logger.debug("chunk %d of a prompt: %s", index, exc)
            return ChunkRead(index, None, cause)
        return self._matched(plan, index, header.meta, tensors, split.nbytes, page_format)

    def _matched(self, plan: ChunkPlan, index: int, meta: dict[str, Any], tensors: list[torch.Tensor | None],
                 nbytes: int, page_format: PageFormat) -> ChunkRead:
        """:meth:`_verified` of a decoded value: its metadata, tokens and pages against the chunk's."""
        start, stop = plan.span(index)
        if (meta.get("kind") != CHUNK_KIND or meta.get("space") != self.prefix or meta.get("start") != start
                or meta.get("digest") != plan.digests[index] or meta.get("parent") != plan.parent(index)
                or len(tensors) != 2):
            return ChunkRead(index, None, "foreign")
        tokens, pages = tensors
        expected_tokens = plan.chunk_tokens_of(index)
        if (tokens is None or tokens.dtype != torch.int64 or tuple(tokens.shape) != (stop - start,)
                or codec.tensor_bytes(tokens).tobytes() != expected_tokens.tobytes()):
            return ChunkRead(index, None, "foreign")
        blocks = -(-(stop - start) // self.block_size)
        expected = page_format.shape(blocks * page_format.pages_per_block)
        if pages is None or pages.dtype != page_format.dtype or tuple(pages.shape) != expected:
            found = "nothing" if pages is None else f"{tuple(pages.shape)} {pages.dtype}"
            logger.warning("chunk %d holds %s; this engine needs %s %s", index, found, expected,
                           page_format.dtype)
            return ChunkRead(index, None, "mismatch")
        return ChunkRead(index, pages, "hit", nbytes)

    def _verified_split(self, plan: ChunkPlan, index: int, header: codec.Header, value: _Split,
                        page_format: PageFormat) -> ChunkRead | None:
        """:meth:`_verified` of a chunk received in place whose header is read: the same checks, in an order
        that makes one tensor (its pages) and none for its tokens, which are compared as bytes. ``None``
        when the header does not describe a chunk's two tensors (the general path then says why)."""
        if len(header.specs) != 2:
            return None
        tokens, pages = header.specs[0], header.specs[1]
        tokens_at, pages_at = header.starts
        if tokens is None or pages is None or not pages.nbytes:
            return None
        meta = header.meta
        start, stop = plan.span(index)
        if (meta.get("kind") != CHUNK_KIND or meta.get("space") != self.prefix or meta.get("start") != start
                or meta.get("digest") != plan.digests[index] or meta.get("parent") != plan.parent(index)
                or tokens.dtype != torch.int64 or tokens.shape != (stop - start,)):
            return ChunkRead(index, None, "foreign")
        payload = value.payload
        raw_tokens = payload.span(tokens_at, tokens_at + tokens.nbytes)
        raw_pages = payload.span(pages_at, pages_at + pages.nbytes)
        if self.checksum and (
                (tokens.crc is not None and codec.parts_checksum(header.version, raw_tokens) != tokens.crc)
                or (pages.crc is not None and codec.parts_checksum(header.version, raw_pages) != pages.crc)):
            logger.debug("chunk %d of a prompt: checksum mismatch", index)
            return ChunkRead(index, None, "corrupt")
        expected_tokens = plan.chunk_tokens_of(index).cast("B")
        if (raw_tokens[0] if len(raw_tokens) == 1 else b"".join(raw_tokens)) != expected_tokens:
            return ChunkRead(index, None, "foreign")
        blocks = -(-(stop - start) // self.block_size)
        expected = page_format.shape(blocks * page_format.pages_per_block)
        if pages.dtype != page_format.dtype or pages.shape != expected:
            logger.warning("chunk %d holds %s %s; this engine needs %s %s", index, pages.shape, pages.dtype,
                           expected, page_format.dtype)
            return ChunkRead(index, None, "mismatch")
        if payload.in_place:
            return ChunkRead(index, None, "hit", value.nbytes)
        raw = raw_pages[0] if len(raw_pages) == 1 else bytearray(b"".join(raw_pages))
        tensor = torch.frombuffer(raw, dtype=pages.dtype, count=pages.nbytes // pages.dtype.itemsize)
        return ChunkRead(index, tensor.view(expected), "hit", value.nbytes)

    # -- releasing --------------------------------------------------------------------------------

    def release(self, digests: Sequence[str], holder: str) -> int:
        """Drop ``holder``'s hold on each chunk; the last holder deletes it. How many chunks were deleted."""
        if not digests:
            return 0
        client = self.store.redis
        with self.store.guarded(f"releasing {len(digests)} chunks"):
            calls = [(self._pair(digest), _release_args(holder)) for digest in digests]
            replies = self._eval_each(client, _RELEASE, calls)
            return sum(int(reply) for reply in replies)

    def delete_keys(self, keys: Sequence[str]) -> None:
        """Best-effort delete of unusable chunks; what cannot be deleted expires with its TTL."""
        try:
            self.store.delete(list(keys))
        except KVRedisError as exc:
            logger.debug("could not delete %d unusable chunks (they expire with their TTL): %s", len(keys),
                         exc)


def _release_args(holder: str) -> list[Any]:
    """The release script's arguments for ``holder``."""
    return [holder, "1" if holder == NOBODY else "0"]


def _is_error(reply: Any) -> bool:
    """Whether ``reply`` is an error reply (kvredis's framing or redis-py's)."""
    return isinstance(reply, (RespError, redis.exceptions.RedisError))


def _raise(reply: Any) -> None:
    """Raise an error reply as redis-py would have, so that the guard names it (NOPERM, WRONGTYPE...)."""
    if isinstance(reply, redis.exceptions.RedisError):  # a redis-py pipeline's (cluster, stand-in client)
        raise reply
    raise_first_error([reply])


def _raise_unless_wrongtype(values: list[Any]) -> None:
    """Raise the first error reply among a read's values but WRONGTYPE (a foreign value at a chunk's key,
    which reads as such), to be named as the Redis error it is (NOPERM...)."""
    for value in values:
        if _is_error(value) and "WRONGTYPE" not in str(value):
            _raise(value)


def _no_errors(replies: list[Any]) -> list[Any]:
    """``replies``, once none of them is an error (the first one is raised)."""
    for reply in replies:
        if _is_error(reply):
            _raise(reply)
    return replies


def _ok(reply: Any) -> bool:
    """Whether a SET's reply says it stored the value (``NX`` answers nil when the key was there)."""
    return reply is True or reply in ("OK", b"OK")


def _sha(source: str) -> str:
    sha = _SHAS.get(source)
    if sha is None:
        sha = _SHAS[source] = hashlib.sha1(source.encode()).hexdigest()
    return sha


def _aligned(nbytes: int) -> int:
    return (nbytes + codec.ALIGN - 1) // codec.ALIGN * codec.ALIGN


_TTL_STEPS = 1024  # chunk positions over which a prompt's TTLs shorten (ChunkStore.ttl_at)
_HASH_AHEAD_BYTES = 32 << 20  # a write of this many bytes or more hashes on a thread while it sends
_MIN_HEADER = codec.ALIGN  # a blob's prefix and header, padded: never less than this
_AGAIN = object()
"""A chunk read in pieces whose value did not have the layout expected: to be fetched again whole."""


class Scatter:
    """A payload's bytes laid over several buffers, in order (one buffer of the read's own, or the chunk's
    tokens in a small buffer and its pages in an engine's KV blocks: ``in_place``)."""

    __slots__ = ("ends", "in_place", "views")

    def __init__(self, views: Sequence[memoryview], *, in_place: bool = False) -> None:
        self.views = list(views)
        self.in_place = in_place
        self.ends = list(itertools.accumulate(view.nbytes for view in self.views))

    @property
    def nbytes(self) -> int:
        return self.ends[-1] if self.ends else 0

    def span(self, start: int, stop: int) -> list[memoryview]:
        """The buffers holding bytes ``start..stop-1``, the first and last cut to them."""
        if stop <= start:
            return []
        if stop > self.nbytes:
            raise ValueError(f"bytes up to {stop} of a {self.nbytes}-byte payload")
        first = bisect.bisect_right(self.ends, start)
        last = bisect.bisect_left(self.ends, stop)
        begin = self.ends[first] - self.views[first].nbytes
        if first == last:
            return [self.views[first][start - begin:stop - begin]]
        out = self.views[first:last + 1]
        out[0] = out[0][start - begin:]
        end_begin = self.ends[last] - self.views[last].nbytes
        out[-1] = out[-1][:stop - end_begin]
        return out

    def join(self) -> bytes:
        """Every byte in one buffer (a copy)."""
        return b"".join(self.views)


def _noticing(call: Callable[[], None]) -> resp.Place:
    """A :data:`~kvredis.store.resp.Place` calling ``call`` at its reply's first bulk string; it places
    nothing."""
    called: list[bool] = []

    def place(length: int) -> None:
        if not called:
            called.append(True)
            call()
    return place


def _placed_payload(into: PagesPlace, index: int, size: int, page_format: PageFormat) -> Scatter:
    """Where chunk ``index``'s payload of ``size`` bytes goes when ``into`` places its pages: the tokens and
    any padding in small buffers of their own, the pages where ``into`` says (or all of it in a buffer of
    the read's own, where ``into`` declines)."""
    views = into(index)
    if views is None:
        return Scatter([fresh_output(size).numpy().data.cast("B")])
    pages = sum(view.nbytes for view in views)
    head = size - _aligned(pages)
    if head < 0 or pages % page_format.dtype.itemsize:
        raise ValueError(f"{pages} bytes of pages placed for a {size}-byte payload")
    pad = _aligned(pages) - pages
    return Scatter([memoryview(bytearray(head)), *views, *([memoryview(bytearray(pad))] if pad else [])],
                   in_place=into.in_place)


@dataclass
class _Split:
    """A chunk's value as received: its header (what precedes the payload) and its payload, in place."""

    header: bytearray | memoryview
    payload: Scatter
    nbytes: int

    def joined(self) -> bytearray:
        """The whole value in one buffer (a copy: for values that fail the split's assumptions)."""
        return bytearray(self.header) + self.payload.join()


class _Read:
    """Where one chunk's reply goes: the payload where its :class:`Scatter` says (made when the reply
    arrives), the header into a buffer of its own. Its ``place_*`` methods are the reply's
    :data:`kvredis.store.resp.Place`."""

    __slots__ = ("first", "header", "last", "make", "payload", "piece", "pieces", "size", "stop")

    def __init__(self, size: int, piece: int, payload: Scatter | None,
                 make: Callable[[], Scatter] | None = None) -> None:
        self.size = size
        self.piece = piece
        self.payload = payload
        self.make = make
        # The indexes of its first and last commands (GET; the header's GETRANGE and the last piece's, or
        # MULTI and EXEC), and the first after its own (a TTL's restart included).
        self.first = self.last = self.stop = 0
        self.header: bytearray | None = None
        self.pieces = -1  # bulk replies of a transaction's read seen so far (-1: the header's next)

    def _scatter(self) -> Scatter:
        if self.payload is None:
            assert self.make is not None
            self.payload = self.make()
        return self.payload

    def place_whole(self, length: int) -> list[memoryview] | None:
        """A GET's value: the header, then the payload in place (if the length allows that layout)."""
        header = length - self.size
        if header < _MIN_HEADER or header % codec.ALIGN or header > codec.MAX_HEADER_BYTES + codec.ALIGN:
            return None
        self.header = bytearray(header)
        return [memoryview(self.header), *self._scatter().views]

    def piece_place(self, number: int) -> resp.Place:
        """Where piece ``number``'s reply goes: its slot of the payload, if it has the length expected."""
        def place(length: int) -> Sequence[memoryview] | None:
            start = number * self.piece
            if length != min(self.piece, self.size - start) or length <= 0:
                return None
            return self._scatter().span(start, start + length)
        return place

    def place_in_exec(self, length: int) -> Sequence[memoryview] | None:
        """The bulk replies inside a transaction's EXEC: the header (kept as it is), then each piece."""
        seen, self.pieces = self.pieces, self.pieces + 1
        return None if seen < 0 else self.piece_place(seen)(length)

    def value(self, replies: list[Any]) -> Any:
        """The chunk's value from its replies: whole, :class:`_Split`, ``None`` (absent), an error reply
        (WRONGTYPE), or :data:`_AGAIN`."""
        reply = replies[self.first]
        if isinstance(reply, resp.Placed):  # a GET, split as expected
            assert self.header is not None and self.payload is not None
            return _Split(self.header, self.payload, reply.nbytes)
        if self.last == self.first:  # a GET's whole value, None, or an error reply
            return reply
        # An error anywhere (NOPERM, WRONGTYPE) is the chunk's reply.
        for answer in replies[self.first:self.stop]:
            if _is_error(answer):
                return answer
        count = -(-self.size // self.piece)
        if isinstance(reply, str):  # MULTI's OK: the pieces are inside EXEC's reply
            executed = replies[self.last]
            if not isinstance(executed, list) or len(executed) < 1 + count:
                return _AGAIN
            for answer in executed:
                if _is_error(answer):
                    return answer
            header, *pieces = executed[:1 + count]
        else:
            header, *pieces = replies[self.first:self.last + 1]
        # An absent key reads as empty ranges: the whole fetch tells absent from short.
        if (not isinstance(header, bytearray) or len(header) < _MIN_HEADER or self.payload is None
                or not all(isinstance(piece, resp.Placed) for piece in pieces)):
            return _AGAIN
        return _Split(header, self.payload, len(header) + self.size)
