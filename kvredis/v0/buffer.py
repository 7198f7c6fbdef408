"""The seed's KV lookup buffer on Redis: ``insert`` and ``drop_select`` keyed by the prompt.

Each entry is one *record* pushed onto the prompt's list, taken with a blocking pop (BLPOP). Taking
the record is the atomic select-and-drop: two readers never get the same entry, a reader that comes
first waits for the writer, and entries are taken in any order. A small entry's payload rides inside
the record; a larger one is written first as pieces of ``chunk_bytes`` under their own keys, and its
record is pushed only after every piece is stored, so a reader never sees a half-written entry. The
reader takes the pieces with GETDEL; if any is gone (evicted, expired) the entry counts as missing and
nothing of it is returned. An unusable record (corrupt, foreign, missing a piece) ends the wait: records
already queued behind it are still tried, but the reader does not block again for one that may never come.
Every key carries the TTL; a taken entry leaves no key behind.

An entry inserted with an ``entry_id`` goes on a list of its own instead of the prompt's shared one: it is
*announced* (the V1 connector's producer tells the decode which entry to take), and only a reader naming
that id takes it, so an older entry of the same prompt can neither be taken in its place nor delay it.
The prompt's key also covers a *context* digest (:func:`kvredis.store.keys.context_digest`): a LoRA adapter,
multimodal inputs or a tenant's salt give the same tokens another key.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
import torch

from kvredis.config import KVRedisConfig
from kvredis.errors import CodecError, EntryTooLargeError, KVRedisError, KVRedisTimeoutError
from kvredis.store import codec
from kvredis.store.client import RedisStore
from kvredis.store.keys import (
    CacheIdentity,
    EntryKeys,
    KeySpace,
    Prompt,
    check_digest,
    check_entry_id,
    new_entry_id,
    prompt_digest,
)
from kvredis.store.memory import fresh_output
from kvredis.store.metrics import Metrics
from kvredis.store.redis_errors import WrongTypeError

logger = logging.getLogger("kvredis.buffer")

Entry = list[torch.Tensor | None]
"""``[input_tokens, roi, key, value, hidden]``, as the seed's ``drop_select`` returns it."""

Allocate = Callable[[int], torch.Tensor]
"""Returns an uninitialised contiguous CPU ``uint8`` tensor of the given byte count (``take``'s output)."""

_MISS: tuple[None, None, None, None, None] = (None, None, None, None, None)
_MIN_CHUNK, _MAX_CHUNK = 4096, 256 << 20  # KVREDIS_CHUNK_BYTES's range
# Entries this large (and chunked) are hashed in a thread while their pieces are sent: at 128 MiB the
# checksum took 14 ms of a 90 ms write, which the raw-socket reference does not spend
# (docs/benchmarks-history.md).
_HASH_ALONGSIDE_BYTES = 32 << 20
# Redis keeps a value of n bytes in n + 12 (its string header, a NUL, and the CRLF a large argument came
# with) rounded up to its allocator's size class: a piece of exactly 1 MiB takes 1.25 MiB of memory, one of
# 16 bytes less takes 1 MiB (`MEMORY USAGE`, docs/design.md "Why pieces of 1 MiB").
_REDIS_VALUE_OVERHEAD = 16


class RedisLookupBuffer:
    """The seed's lookup buffer (``insert`` / ``drop_select``) stored in Redis.

    Thread-safe: redis-py's pool gives each concurrent call its own connection.
    """

    def __init__(
        self,
        config: KVRedisConfig | None = None,
        client: redis.Redis | None = None,
        *,
        identity: CacheIdentity | None = None,
    ) -> None:
        self.config = config if config is not None else KVRedisConfig.from_env()
        self.keyspace = KeySpace(self.config.namespace, identity or CacheIdentity())
        self.store = RedisStore(self.config, client)
        self.metrics = Metrics(self.config.namespace)
        self._closed = False

    # -- writing ---------------------------------------------------------------------------------

    def insert(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor | None,
        key: torch.Tensor,
        value: torch.Tensor | None,
        hidden: torch.Tensor | None,
        *,
        context: str = "",
        entry_id: str | None = None,
    ) -> None:
        """Store ``[key, value, hidden]`` for the prompt; returns once the whole entry is in Redis.

        ``value`` and ``hidden`` may be ``None`` (the V1 connector packs K and V into ``key``). With an
        ``entry_id`` (from :func:`kvredis.store.keys.new_entry_id`) the entry is announced: only a reader
        naming that id takes it. ``context`` is the prompt's :func:`kvredis.store.keys.context_digest`.
        """
        self._check_open()
        started = time.perf_counter()
        announced = entry_id is not None
        entry_id = check_entry_id(entry_id) if announced else new_entry_id()
        prompt = Prompt.of(input_tokens, roi, context)
        keys = self.keyspace.keys_for(prompt)
        # The token IDs and mask go in as the prompt's canonical bytes (int64 and bool views): no tensor
        # is made of them.
        frames = codec.Frames.of([prompt.tokens, prompt.mask, key, value, hidden])
        size = frames.nbytes
        if size > self.config.max_entry_bytes:
            raise EntryTooLargeError(
                f"entry of {size} bytes exceeds KVREDIS_MAX_ENTRY_BYTES={self.config.max_entry_bytes}"
            )
        ttl_ms = max(1, int(self.config.ttl_s * 1000))
        chunk = _piece_bytes(self.config.chunk_bytes)
        queue = keys.entry_queue(entry_id) if announced else keys.queue
        meta: dict[str, Any] = {"id": entry_id, "space": self.keyspace.prefix}
        piece_keys: list[str] = []
        if size > self.config.chunk_bytes:
            count = -(-size // chunk)
            meta.update(chunk=chunk, pieces=count)
            piece_keys = [keys.chunk(entry_id, i) for i in range(count)]
        alongside: codec.ChecksumsAhead | None = None
        if piece_keys and self.config.checksum and size >= _HASH_ALONGSIDE_BYTES:
            # The checksums go into the record, which is written last: they are computed while the pieces
            # go out (the socket gives the GIL up while Redis drains it). The header is tried first, so that
            # what cannot be written is refused before anything is.
            frames.encode(meta, checksum=False)
            alongside = codec.ChecksumsAhead([frames])
            payload = frames.payload()
        else:
            encoded = frames.encode(meta, checksum=self.config.checksum)
            payload = encoded.payload
        try:
            if piece_keys:
                try:
                    self.store.put_pieces(piece_keys, _pieces(payload, chunk), ttl_ms)
                except BaseException:
                    if alongside is not None:
                        alongside.close()  # not left running over the caller's tensors; its result is moot
                    raise
                if alongside is not None:
                    try:
                        encoded = frames.encode(meta, crcs=alongside.get(0))
                    except BaseException:
                        self._discard(piece_keys, queue)  # no record will name them
                        raise
                self.store.push_record(queue, encoded.header, ttl_ms)
            else:
                # Header and payload go out as one value, without joining them first.
                self.store.push_record(queue, [encoded.header, *encoded.payload], ttl_ms)
        except KVRedisError as exc:
            cause = self._failure_cause(exc)
            self.metrics.store_failed(cause)
            logger.warning("insert into %s failed (%s): %s", queue, cause, exc)
            if piece_keys and cause != "timeout":
                # Pieces of an entry whose record may or may not have landed: without them a record that
                # did land reads as a miss, never as half an entry. After a timeout another round trip
                # would break the caller's bound, so those pieces are left to their TTL.
                self._discard(piece_keys, queue)
            raise
        self.metrics.stored(size, time.perf_counter() - started)
        logger.debug("stored entry %s in %s: %d bytes, %d pieces", entry_id, queue, size,
                     len(piece_keys))

    # -- reading ---------------------------------------------------------------------------------

    def drop_select(
        self, input_tokens: torch.Tensor | None, roi: torch.Tensor | None
    ) -> list[torch.Tensor | None]:
        """Take the prompt's oldest entry, waiting up to ``pop_timeout_s``; five ``None`` if none came."""
        entry, _ = self.take(input_tokens, roi)
        return entry if entry is not None else list(_MISS)

    def take(
        self, input_tokens: torch.Tensor | None, roi: torch.Tensor | None, *, context: str = "",
        entry_id: str | None = None, allocate: Allocate | None = None,
    ) -> tuple[Entry | None, str]:
        """:meth:`drop_select`, saying why nothing came: ``"absent"`` (no entry within the bound) or why the
        entry that came was dropped (``"corrupt"``, ``"foreign"``, ``"partial"``). With ``entry_id``, only
        that announced entry is taken. With ``allocate``, the payload is received into the memory it
        returns (pinned host memory, for a GPU), and the tensors are views over it."""
        self._check_open()
        if input_tokens is None:
            raise ValueError("drop_select needs input_tokens: entries are looked up by their tokens")
        prompt = Prompt.of(input_tokens, roi, context)
        keys = self.keyspace.keys_for(prompt)
        queue = keys.entry_queue(entry_id) if entry_id is not None else keys.queue
        started = time.perf_counter()
        deadline = time.monotonic() + self.config.pop_timeout_s
        cause = "absent"
        try:
            while (remaining := deadline - time.monotonic()) > 0:
                if cause != "absent":
                    # The prompt's entry came and was unusable: the wait is over (a prefill writes one
                    # entry per prompt), but records queued behind it are still tried.
                    remaining = 0.0
                try:
                    record = self.store.pop_record(queue, remaining)
                except WrongTypeError as exc:
                    self._drop_foreign_key(queue, exc)
                    cause = "foreign"
                    continue
                if record is None:
                    break
                entry, cause, size = self._read_entry(keys, record, prompt, entry_id, allocate)
                if entry is not None:
                    self.metrics.loaded(size, time.perf_counter() - started)
                    logger.debug("loaded an entry from %s", queue)
                    return entry, cause
        except KVRedisError as exc:
            failure = self._failure_cause(exc)
            self.metrics.miss(failure)
            logger.warning("drop_select from %s failed (%s): %s", queue, failure, exc)
            raise
        self.metrics.miss(cause)
        logger.debug("no usable entry in %s (%s)", queue, cause)
        return None, cause

    def discard(
        self, input_tokens: Any, roi: Any = None, *, context: str = "", entry_id: str, wait_s: float = 0.0,
        prefix: str | None = None,
    ) -> bool:
        """Delete the announced entry ``entry_id`` of the prompt without reading its pieces, waiting up to
        ``wait_s`` for it to be written; whether one was deleted. For entries nobody will take.

        ``prefix`` names another key space's entry (another tensor-parallel rank's shard, say); by default
        this buffer's own."""
        return self.discard_entry(prompt_digest(input_tokens, roi, context), entry_id, wait_s=wait_s,
                                  prefix=prefix)

    def discard_entry(
        self, digest: str, entry_id: str, *, wait_s: float = 0.0, prefix: str | None = None
    ) -> bool:
        """:meth:`discard` of an entry named by its prompt digest (an announcement's), not its tokens."""
        self._check_open()
        keys = EntryKeys(prefix or self.keyspace.prefix, check_digest(digest))
        queue = keys.entry_queue(entry_id)
        try:
            record = self.store.pop_record(queue, wait_s)  # BLPOP: at least a millisecond
        except WrongTypeError as exc:
            self._drop_foreign_key(queue, exc)
            return False
        if record is None:
            return False
        # The pieces are named by the announced id, so they can be deleted whatever the record says; only
        # how many there are is read from it, bounded so that a planted record cannot name millions.
        try:
            header = codec.read_header(record, max_payload_bytes=self.config.max_entry_bytes)
            count = header.meta.get("pieces", 0)
            chunk = header.meta.get("chunk", 0)
            if count and not (isinstance(count, int) and isinstance(chunk, int) and chunk >= _MIN_CHUNK
                              and count == -(-header.payload_nbytes // chunk)):
                raise CodecError(f"inconsistent piece layout {header.meta!r}")
        except CodecError as exc:
            logger.warning("discarded an unreadable record in %s (its pieces expire with their TTL): %s",
                           queue, exc)
            return True
        if count:
            self._discard([keys.chunk(entry_id, i) for i in range(count)], queue)
        logger.debug("discarded entry %s (%d pieces): announced, but nobody will take it", entry_id, count)
        return True

    def contains(self, input_tokens: Any, roi: Any = None, *, context: str = "") -> bool:
        """Whether an unannounced entry for the prompt waits in Redis now (a hint: it may be taken or
        expire)."""
        queue = self.keyspace.entry(input_tokens, roi, context).queue
        try:
            return self.store.peek_length(queue) > 0
        except WrongTypeError as exc:
            logger.warning("contains: %s holds a foreign value, not an entry list: %s", queue, exc)
            return False
        except KVRedisError as exc:
            failure = self._failure_cause(exc)
            logger.warning("contains(%s) failed (%s): %s", queue, failure, exc)
            raise

    def _read_entry(
        self, keys: EntryKeys, record: bytes | bytearray, prompt: Prompt, entry_id: str | None = None,
        allocate: Allocate | None = None,
    ) -> tuple[Entry | None, str, int]:
        """The entry in ``record`` and its payload size, or ``None`` and why it was dropped."""
        try:
            header = codec.read_header(record, max_payload_bytes=self.config.max_entry_bytes)
            space = header.meta.get("space")
            if space != self.keyspace.prefix:
                self.metrics.dropped("foreign")
                logger.warning("dropped an entry in %s written for another namespace or model identity "
                               "(%r)", keys.queue, space)
                return None, "foreign", 0
            if entry_id is not None and header.meta.get("id") != entry_id:
                self.metrics.dropped("foreign")
                logger.warning("dropped a record in the list of entry %s that names entry %r", entry_id,
                               header.meta.get("id"))
                return None, "foreign", 0
            pieces = header.meta.get("pieces", 0)
            if not pieces:
                payload: Any = memoryview(record)[header.payload_offset:]
                raw = payload
                if allocate is not None and payload.nbytes == header.payload_nbytes:
                    payload = _received(allocate, payload.nbytes, payload)
            else:
                payload, cause = self._take_pieces(keys, header, allocate)
                if payload is None:
                    self.metrics.dropped(cause)
                    return None, cause, 0
                raw = payload.numpy().data
            entry = codec.decode_payload(header, payload, verify=self.config.checksum)
        except CodecError as exc:
            cause = "foreign" if "foreign" in str(exc) or "version" in str(exc) else "corrupt"
            self.metrics.dropped(cause)
            logger.warning("dropped an unreadable entry in %s (%s): %s", keys.queue, cause, exc)
            return None, cause, 0
        if len(entry) != 5 or not _holds(header, raw, entry, 0, prompt.tokens) \
                or not _holds(header, raw, entry, 1, prompt.mask):
            self.metrics.dropped("foreign")
            logger.warning("dropped an entry in %s whose tokens differ from the request", keys.queue)
            return None, "foreign", 0
        return entry, "hit", header.payload_nbytes

    def _take_pieces(
        self, keys: EntryKeys, header: codec.Header, allocate: Allocate | None = None
    ) -> tuple[torch.Tensor | None, str]:
        """The entry's payload from its pieces, or ``None`` and why (``partial`` or ``corrupt``)."""
        meta = header.meta
        entry_id, chunk, count = meta.get("id"), meta.get("chunk"), meta.get("pieces")
        total = header.payload_nbytes
        # Checked before any key is named or byte allocated: a planted record must not make the reader
        # build millions of keys (tiny chunk) or take keys outside its own entry (odd id).
        if not (isinstance(entry_id, str) and _valid_entry_id(entry_id) and isinstance(chunk, int)
                and isinstance(count, int) and _MIN_CHUNK <= chunk <= _MAX_CHUNK
                and count == -(-total // chunk)):
            raise CodecError(f"corrupt record: inconsistent piece layout {meta!r} for {total} bytes")
        piece_keys = [keys.chunk(entry_id, i) for i in range(count)]
        sizes = [min(chunk, total - i * chunk) for i in range(count)]
        out = fresh_output(total) if allocate is None else _received(allocate, total)
        try:
            bad = self.store.take_pieces(piece_keys, sizes, out.numpy().data.cast("B"))
        except KVRedisError as exc:
            if not isinstance(exc, KVRedisTimeoutError):
                self._discard(piece_keys, keys.queue)
            raise
        if bad is None:
            return out, "hit"
        key, cause = bad
        self._discard(piece_keys, keys.queue)
        if cause == "partial":
            logger.warning("entry %s in %s lost piece %s (evicted or expired): treated as a miss",
                           entry_id, keys.queue, key)
        else:
            logger.warning("entry %s in %s has a foreign piece %s (wrong size or type): dropped",
                           entry_id, keys.queue, key)
        return None, cause

    def _drop_foreign_key(self, queue: str, exc: KVRedisError) -> None:
        """Delete a foreign value planted at an entry list's key, so that writers and readers work again."""
        self.metrics.dropped("foreign")
        logger.warning("deleted %s: it held a foreign value, not an entry list (%s)", queue, exc)
        self.store.delete([queue])

    def _discard(self, keys: list[str], queue: str) -> None:
        """Best-effort delete of an unusable entry's pieces; what cannot be deleted expires with its TTL."""
        try:
            self.store.delete(keys)
        except KVRedisError as exc:
            logger.debug("could not delete %d pieces of an entry in %s (they expire with their TTL): %s",
                         len(keys), queue, exc)

    def _failure_cause(self, exc: KVRedisError) -> str:
        """``"timeout"`` (and counted as one) or ``"error"``."""
        if isinstance(exc, KVRedisTimeoutError):
            self.metrics.timeout()
            return "timeout"
        return "error"

    # -- housekeeping ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise KVRedisError("the lookup buffer is closed")

    def close(self) -> None:
        """Release the Redis connections; entries already stored stay until taken or expired."""
        if not self._closed:
            self._closed = True
            self.store.close()

    def __enter__(self) -> RedisLookupBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_CANONICAL = {"q": torch.int64, "?": torch.bool}  # the dtype kvredis writes each prompt view's bytes as


def _holds(
    header: codec.Header, raw: memoryview, entry: Entry, index: int, expected: memoryview[Any]
) -> bool:
    """Whether tensor ``index`` of the decoded entry equals ``expected`` (the prompt's tokens or mask).

    What kvredis writes (int64 tokens, bool mask) is compared as bytes, in place; another dtype by value,
    as :func:`torch.equal` does (it promotes).
    """
    spec, stored = header.specs[index], entry[index]
    if spec is None or stored is None or spec.shape != (len(expected),):
        return False
    if spec.dtype is _CANONICAL[expected.format]:
        offset = header.starts[index]
        return raw[offset:offset + spec.nbytes].tobytes() == expected.tobytes()
    reference = torch.tensor(expected.tolist(), dtype=_CANONICAL[expected.format])
    return bool(torch.equal(stored, reference))


def _piece_bytes(chunk_bytes: int) -> int:
    """The length of an entry's pieces under ``KVREDIS_CHUNK_BYTES``: a little less, so that Redis's copy of
    a piece fills an allocator size class instead of spilling into the next (readers take it from the
    record)."""
    trimmed = chunk_bytes - _REDIS_VALUE_OVERHEAD
    return trimmed if trimmed >= _MIN_CHUNK else chunk_bytes


def _pieces(frames: Sequence[memoryview], size: int) -> list[bytes | memoryview]:
    """Cut the payload frames into pieces of ``size`` bytes without copying, except across frame seams."""
    pieces: list[bytes | memoryview] = []
    pending: list[memoryview] = []
    pending_bytes = 0
    for frame in frames:
        position = 0
        while position < frame.nbytes:
            take = min(size - pending_bytes, frame.nbytes - position)
            part = frame[position:position + take]
            position += take
            if not pending and take == size:
                pieces.append(part)
                continue
            pending.append(part)
            pending_bytes += take
            if pending_bytes == size:
                pieces.append(b"".join(pending))
                pending, pending_bytes = [], 0
    if pending:
        pieces.append(pending[0] if len(pending) == 1 else b"".join(pending))
    return pieces



def _received(allocate: Allocate, nbytes: int, data: memoryview | None = None) -> torch.Tensor:
    """``allocate(nbytes)``, checked, holding a copy of ``data`` if given."""
    out = allocate(nbytes)
    if not (isinstance(out, torch.Tensor) and out.device.type == "cpu" and out.dtype == torch.uint8
            and out.dim() == 1 and out.numel() == nbytes and out.is_contiguous()):
        raise TypeError(f"take's allocate must return a contiguous CPU uint8 tensor of {nbytes} bytes")
    if data is not None and nbytes:
        out.numpy().data.cast("B")[:] = data
    return out


def _valid_entry_id(entry_id: object) -> bool:
    try:
        check_entry_id(entry_id)
    except ValueError:
        return False
    return True
