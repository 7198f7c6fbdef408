"""The seed's KV lookup buffer on Redis: ``insert`` and ``drop_select`` keyed by the prompt.

Each entry is one *record* pushed onto the prompt's list, taken with a blocking pop (BLPOP). Taking
the record is the atomic select-and-drop: two readers never get the same entry, a reader that comes
first waits for the writer, and entries are taken in any order. A small entry's payload rides inside
the record; a larger one is written first as pieces of ``chunk_bytes`` under their own keys, and its
record is pushed only after every piece is stored, so a reader never sees a half-written entry. The
reader takes the pieces with GETDEL; if any is gone (evicted, expired) the entry counts as missing and
nothing of it is returned. Every key carries the TTL; a taken entry leaves no key behind.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import redis
import torch

from kvredis import codec
from kvredis.client import RedisStore
from kvredis.config import KVRedisConfig
from kvredis.errors import CodecError, EntryTooLargeError, KVRedisError, KVRedisTimeoutError
from kvredis.keys import CacheIdentity, EntryKeys, KeySpace, canonical_roi, canonical_tokens
from kvredis.metrics import Metrics

logger = logging.getLogger("kvredis.buffer")

Entry = list[torch.Tensor | None]
"""``[input_tokens, roi, key, value, hidden]``, as the seed's ``drop_select`` returns it."""

_MISS: tuple[None, None, None, None, None] = (None, None, None, None, None)


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
        value: torch.Tensor,
        hidden: torch.Tensor | None,
    ) -> None:
        """Store ``[key, value, hidden]`` for the prompt; returns once the whole entry is in Redis."""
        self._check_open()
        started = time.perf_counter()
        tokens = torch.from_numpy(canonical_tokens(input_tokens))
        mask = torch.from_numpy(canonical_roi(roi, tokens.numel())).to(torch.bool)
        keys = self.keyspace.entry(tokens, mask)
        tensors = [tokens, mask, key, value, hidden]
        size = codec.payload_size(tensors)
        if size > self.config.max_entry_bytes:
            raise EntryTooLargeError(
                f"entry of {size} bytes exceeds KVREDIS_MAX_ENTRY_BYTES={self.config.max_entry_bytes}"
            )
        ttl_ms = max(1, int(self.config.ttl_s * 1000))
        chunk = self.config.chunk_bytes
        entry_id = os.urandom(8).hex()
        if size <= chunk:
            encoded = codec.encode(tensors, {"id": entry_id}, checksum=self.config.checksum)
            self.store.push_record(keys.queue, encoded.to_bytes(), ttl_ms)
        else:
            count = -(-size // chunk)
            meta = {"id": entry_id, "chunk": chunk, "pieces": count}
            encoded = codec.encode(tensors, meta, checksum=self.config.checksum)
            piece_keys = [keys.chunk(entry_id, i) for i in range(count)]
            self.store.put_pieces(piece_keys, _pieces(encoded.payload, chunk), ttl_ms)
            self.store.push_record(keys.queue, encoded.header, ttl_ms)
        self.metrics.stored(size, time.perf_counter() - started)

    # -- reading ---------------------------------------------------------------------------------

    def drop_select(
        self, input_tokens: torch.Tensor | None, roi: torch.Tensor | None
    ) -> list[torch.Tensor | None]:
        """Take the prompt's oldest entry, waiting up to ``pop_timeout_s``; five ``None`` if none came."""
        self._check_open()
        if input_tokens is None:
            raise ValueError("drop_select needs input_tokens: entries are looked up by their tokens")
        tokens = torch.from_numpy(canonical_tokens(input_tokens))
        mask = torch.from_numpy(canonical_roi(roi, tokens.numel())).to(torch.bool)
        keys = self.keyspace.entry(tokens, mask)
        started = time.perf_counter()
        deadline = time.monotonic() + self.config.pop_timeout_s
        cause = "absent"
        try:
            while (remaining := deadline - time.monotonic()) > 0:
                record = self.store.pop_record(keys.queue, remaining)
                if record is None:
                    break
                entry, cause = self._read_entry(keys, record, tokens, mask)
                if entry is not None:
                    nbytes = sum(t.nbytes for t in entry if t is not None)
                    self.metrics.loaded(nbytes, time.perf_counter() - started)
                    return entry
        except KVRedisTimeoutError:
            self.metrics.timeout()
            self.metrics.miss("timeout")
            raise
        except KVRedisError:
            self.metrics.miss("error")
            raise
        self.metrics.miss(cause)
        return list(_MISS)

    def contains(self, input_tokens: torch.Tensor, roi: torch.Tensor | None = None) -> bool:
        """Whether an entry for the prompt waits in Redis now (a hint: it may be taken or expire)."""
        return self.store.peek_length(self.keyspace.entry(input_tokens, roi).queue) > 0

    def _read_entry(
        self, keys: EntryKeys, record: bytes, tokens: torch.Tensor, mask: torch.Tensor
    ) -> tuple[Entry | None, str]:
        """The entry in ``record``, or ``None`` and why it was dropped."""
        try:
            header = codec.read_header(record, max_payload_bytes=self.config.max_entry_bytes)
            pieces = header.meta.get("pieces", 0)
            if not pieces:
                payload: Any = memoryview(record)[header.payload_offset:]
            else:
                payload = self._take_pieces(keys, header)
                if payload is None:
                    self.metrics.dropped("partial")
                    return None, "partial"
            entry = codec.decode_payload(header, payload, verify=self.config.checksum)
        except CodecError as exc:
            cause = "foreign" if "foreign" in str(exc) or "version" in str(exc) else "corrupt"
            self.metrics.dropped(cause)
            logger.warning("dropped an unreadable entry in %s: %s", keys.queue, exc)
            return None, cause
        if len(entry) != 5 or not _same(entry[0], tokens) or not _same(entry[1], mask):
            self.metrics.dropped("foreign")
            logger.warning("dropped an entry in %s whose tokens differ from the request", keys.queue)
            return None, "foreign"
        return entry, "hit"

    def _take_pieces(self, keys: EntryKeys, header: codec.Header) -> torch.Tensor | None:
        meta = header.meta
        entry_id, chunk, count = meta.get("id"), meta.get("chunk"), meta.get("pieces")
        total = header.payload_nbytes
        if not (isinstance(entry_id, str) and isinstance(chunk, int) and isinstance(count, int)
                and chunk > 0 and count == -(-total // chunk)):
            raise CodecError(f"corrupt record: inconsistent piece layout {meta!r} for {total} bytes")
        piece_keys = [keys.chunk(entry_id, i) for i in range(count)]
        sizes = [min(chunk, total - i * chunk) for i in range(count)]
        out = torch.empty(total, dtype=torch.uint8)
        missing = self.store.take_pieces(piece_keys, sizes, out.numpy().data.cast("B"))
        if missing:
            self.store.delete(piece_keys)
            logger.warning("entry %s in %s lost piece %s (evicted or expired): treated as a miss",
                           entry_id, keys.queue, missing[0])
            return None
        return out

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


def _same(stored: torch.Tensor | None, expected: torch.Tensor) -> bool:
    return stored is not None and stored.shape == expected.shape and bool(torch.equal(stored, expected))


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

