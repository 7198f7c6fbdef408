"""Chunks of KV pages in Redis: which are present, writing only the missing, reading, releasing.

Each chunk (:mod:`kvredis.chunk_keys`) is one self-describing value: a kvredis blob (:mod:`kvredis.codec`)
holding the chunk's token IDs and its pages ``[layers, pages, *page_shape]``, with metadata naming the key
space, the chunk's position, its digest and its parent's. One value, written by one ``SET``, so a reader
sees all of a chunk or none of it, and eviction cannot leave half of one (the two-key layouts of peers
went half-missing so). Reads check everything the key promises: the blob's checksums, its key space, its
digest and parent, its position and its tokens, and the page shape and dtype the reader needs; a chunk
that fails a check is deleted and counts as missing.

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

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
import torch

from kvredis import codec
from kvredis.chunk_keys import ChunkKeys, ChunkPlan
from kvredis.client import RedisStore, raise_first_error
from kvredis.errors import CodecError, KVRedisError
from kvredis.resp import RespError

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
# KEYS: the chunk, its holders. ARGV: holder. Drops the hold; the last one deletes the chunk. Returns 1 if it
# deleted the chunk.
_RELEASE = """
redis.call('SREM', KEYS[2], ARGV[1])
if redis.call('SCARD', KEYS[2]) == 0 then return redis.call('DEL', KEYS[1]) end
return 0
"""

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


@dataclass
class ChunkRead:
    """One chunk as read: its pages, or ``None`` and why (``absent``, ``corrupt``, ``foreign``,
    ``mismatch``)."""

    index: int
    pages: torch.Tensor | None
    cause: str = "hit"
    nbytes: int = 0


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

    def _pair(self, digest: str) -> list[str]:
        """A chunk's key and its holders' set (one slot): the keys every script takes."""
        return [self.keys.chunk(digest), self.keys.holders(digest)]

    def _eval_each(self, client: Any, source: str, calls: Sequence[tuple[list[str], list[Any]]]) -> list[Any]:
        """Run script ``source`` once per ``(keys, args)``, pipelined in one round trip (EVALSHA; a server
        that lacks the script loads it and runs those calls again: NOSCRIPT means they did not run)."""
        sha = _SHAS.get(source)
        if sha is None:
            sha = _SHAS[source] = hashlib.sha1(source.encode()).hexdigest()
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

    def present(self, digests: Sequence[str], *, holder: str | None = None,
                lookup: bool = False) -> list[bool]:
        """Which of the chunks are in Redis now; with ``holder``, each present one is held for it (transfer
        mode). ``lookup``: bounded by ``lookup_timeout_s`` (a call from vLLM's scheduler)."""
        if not digests:
            return []
        client = self.store.prober if lookup else self.store.redis
        with self.store.guarded(f"looking up {len(digests)} chunks"):
            if holder is None:
                replies = _no_errors(self._run(client, [("EXISTS", self.keys.chunk(d)) for d in digests]))
                return [bool(int(reply)) for reply in replies]
            replies = self._eval_each(client, _HOLD, [(self._pair(digest), [holder, self.ttl_ms])
                                                      for digest in digests])
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
        return frames.encode(meta, checksum=self.checksum)

    def write(self, plan: ChunkPlan, chunks: Sequence[tuple[int, torch.Tensor]], *,
              holder: str | None = None) -> list[int]:
        """Write each ``(index, pages)`` unless Redis holds that chunk already (then it is left as it is);
        the bytes written for each (0: it was there). With ``holder``, each is held for that transfer
        either way."""
        if not chunks:
            return []
        blobs = [(plan.digests[index], self.encode(plan, index, pages)) for index, pages in chunks]
        client = self.store.redis
        with self.store.guarded(f"writing {len(blobs)} chunks"):
            replies = None if self.store.cluster else self._write_framed(client, blobs, holder)
            if replies is None:
                # A script per chunk: one slot each, whatever node holds it (values pass through Lua: slower).
                calls = [(self._pair(digest), [[blob.header, *blob.payload], self.ttl_ms, holder or ""])
                         for digest, blob in blobs]
                replies = [bool(int(reply)) for reply in self._eval_each(client, _WRITE, calls)]
            return [blob.nbytes if _ok(reply) else 0 for (_, blob), reply in zip(blobs, replies, strict=True)]

    def _write_framed(self, client: Any, blobs: list[tuple[str, codec.Encoded]],
                      holder: str | None) -> list[Any] | None:
        """:meth:`write` on one server, framed by kvredis: a transaction per chunk, SET NX (the value as its
        header and payload buffers, never joined nor passed through Lua) and the hold together, so no release
        comes between them. Each SET's reply; ``None`` for a stand-in client."""
        commands: list[tuple[Any, ...]] = []
        for digest, blob in blobs:
            key, holders = self._pair(digest)
            value = [blob.header, *blob.payload]
            if holder is None:
                commands.append(("SET", key, value, "NX", "PX", self.ttl_ms))
                continue
            commands += [("MULTI",), ("SET", key, value, "NX", "PX", self.ttl_ms), ("SADD", holders, holder),
                         ("PEXPIRE", holders, self.ttl_ms), ("PEXPIRE", key, self.ttl_ms), ("EXEC",)]
        replies = self.store.call(client, *commands)
        if replies is None:
            return None
        _no_errors(replies)
        if holder is None:
            return replies
        executed = replies[5::6]  # EXEC's: [SET's, SADD's, PEXPIRE's, PEXPIRE's]
        return _no_errors([reply[0] if isinstance(reply, list) else reply for reply in executed])

    # -- reading ----------------------------------------------------------------------------------

    def read(self, plan: ChunkPlan, indexes: Sequence[int], page_format: PageFormat, *,
             refresh_ttl: bool = False) -> list[ChunkRead]:
        """Read chunks ``indexes`` of ``plan`` (one round trip) and check each; a chunk that fails a check
        is deleted and read as ``None`` with its cause. ``refresh_ttl``: a hit's TTL starts again (reuse)."""
        if not indexes:
            return []
        keys = [self.keys.chunk(plan.digests[index]) for index in indexes]
        client = self.store.redis
        with self.store.guarded(f"reading {len(keys)} chunks"):
            commands = [("GETEX", key, "PX", self.ttl_ms) if refresh_ttl else ("GET", key) for key in keys]
            values = self._run(client, commands)
            for value in values:  # raised here, to be named as the Redis error it is
                if _is_error(value) and "WRONGTYPE" not in str(value):
                    _raise(value)
        reads = []
        bad: list[str] = []
        for index, key, value in zip(indexes, keys, values, strict=True):
            if value is None:
                reads.append(ChunkRead(index, None, "absent"))
                continue
            if _is_error(value):  # WRONGTYPE: a list or set planted at a chunk's key
                read = ChunkRead(index, None, "foreign")
            else:
                read = self._verified(plan, index, value, page_format)
            if read.pages is None:
                logger.warning("dropped chunk %s (%s)", key, read.cause)
                bad.append(key)
            reads.append(read)
        if bad:
            self.delete_keys(bad)
        return reads

    def _verified(self, plan: ChunkPlan, index: int, value: Any, page_format: PageFormat) -> ChunkRead:
        """The chunk's pages if ``value`` is exactly what chunk ``index`` of ``plan`` must hold."""
        if not isinstance(value, (bytes, bytearray)):
            return ChunkRead(index, None, "foreign")
        try:
            tensors, meta = codec.decode(value, max_payload_bytes=self.max_chunk_bytes, verify=self.checksum)
        except CodecError as exc:
            cause = "foreign" if "foreign" in str(exc) or "version" in str(exc) else "corrupt"
            logger.debug("chunk %d of a prompt: %s", index, exc)
            return ChunkRead(index, None, cause)
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
        return ChunkRead(index, pages, "hit", len(value))

    # -- releasing --------------------------------------------------------------------------------

    def release(self, digests: Sequence[str], holder: str) -> int:
        """Drop ``holder``'s hold on each chunk; the last holder deletes it. How many chunks were deleted."""
        if not digests:
            return 0
        client = self.store.redis
        with self.store.guarded(f"releasing {len(digests)} chunks"):
            calls = [(self._pair(digest), [holder]) for digest in digests]
            replies = self._eval_each(client, _RELEASE, calls)
            return sum(int(reply) for reply in replies)

    def delete_keys(self, keys: Sequence[str]) -> None:
        """Best-effort delete of unusable chunks; what cannot be deleted expires with its TTL."""
        try:
            self.store.delete(list(keys))
        except KVRedisError as exc:
            logger.debug("could not delete %d unusable chunks (they expire with their TTL): %s", len(keys),
                         exc)


def _is_error(reply: Any) -> bool:
    """Whether ``reply`` is an error reply (kvredis's framing or redis-py's)."""
    return isinstance(reply, (RespError, redis.exceptions.RedisError))


def _raise(reply: Any) -> None:
    """Raise an error reply as redis-py would have, so that the guard names it (NOPERM, WRONGTYPE...)."""
    if isinstance(reply, redis.exceptions.RedisError):  # a redis-py pipeline's (cluster, stand-in client)
        raise reply
    raise_first_error([reply])


def _no_errors(replies: list[Any]) -> list[Any]:
    """``replies``, once none of them is an error (the first one is raised)."""
    for reply in replies:
        if _is_error(reply):
            _raise(reply)
    return replies


def _ok(reply: Any) -> bool:
    """Whether a SET's reply says it stored the value (``NX`` answers nil when the key was there)."""
    return reply is True or reply in ("OK", b"OK")
