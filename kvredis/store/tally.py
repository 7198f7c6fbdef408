"""A namespace's shared-prefix-cache tally in Redis: prompt tokens every engine looked up and found, so that
``kvredis stats`` shows the hit rate of a whole deployment (each engine's own counts are on its
``/metrics``).

An engine adds to its counts in memory and sends them (``HINCRBY``, one round trip) at most once every
:data:`FLUSH_INTERVAL_S`, off vLLM's scheduling step. A tally that cannot be sent (Redis down, an ACL without
``hincrby``) is warned about once and kept for the next try: it never fails a lookup.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvredis.errors import KVRedisError
from kvredis.store.client import RedisStore

logger = logging.getLogger("kvredis.tally")

FIELDS = ("lookup_tokens", "found_tokens")
"""Prompt tokens looked up in Redis (beyond an engine's own prefix cache), and those of them Redis held."""
FLUSH_INTERVAL_S = 1.0
_KEEP_MS = 7 * 24 * 3600 * 1000  # a tally nobody adds to for a week is gone (every key of ours has a TTL)


def tally_key(namespace: str) -> str:
    """The hash holding ``namespace``'s tally (``kvredis purge`` deletes it with the rest)."""
    return f"{namespace}:tally"


class Tally:
    """One engine's counts of :data:`FIELDS` not yet sent to its namespace's tally in Redis."""

    def __init__(self, store: RedisStore, namespace: str) -> None:
        self._store = store
        self._key = tally_key(namespace)
        self._counts = dict.fromkeys(FIELDS, 0)
        self._lock = threading.Lock()
        self._sent_at = time.monotonic()
        self._warned = False

    def add(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._counts[name] += amount

    def due(self) -> bool:
        """Whether counts are waiting and the last send is :data:`FLUSH_INTERVAL_S` old."""
        with self._lock:
            return any(self._counts.values()) and time.monotonic() - self._sent_at >= FLUSH_INTERVAL_S

    def flush(self) -> None:
        """Send the counts waiting; on failure (warned about once) they wait for the next send."""
        try:
            self.send()
        except KVRedisError as exc:
            if not self._warned:
                self._warned = True
                logger.warning("cannot add to the namespace's tally in Redis (kvredis stats' hit rate); "
                               "will retry: %s (said once)", exc)

    def send(self) -> None:
        """Send the counts waiting (one pipeline); on failure they wait for the next send and it raises
        :class:`~kvredis.errors.KVRedisError`."""
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(FIELDS, 0)
            self._sent_at = time.monotonic()
        if not any(counts.values()):
            return
        try:
            with self._store.guarded("adding to the tally"):
                pipe = self._store.prober.pipeline(transaction=False)
                for name, amount in counts.items():
                    if amount:
                        pipe.hincrby(self._key, name, amount)
                pipe.pexpire(self._key, _KEEP_MS)
                pipe.execute()
        except KVRedisError:
            self.add(**counts)
            raise


def read_tally(store: RedisStore, namespace: str) -> dict[str, Any]:
    """The namespace's tally: :data:`FIELDS` and ``hit_rate`` (found / looked up; ``None`` before any)."""
    with store.guarded("reading the tally"):
        values = store.redis.hmget(tally_key(namespace), list(FIELDS))
    tally: dict[str, Any] = {name: int(value or 0) for name, value in zip(FIELDS, values, strict=True)}
    looked_up = tally["lookup_tokens"]
    tally["hit_rate"] = round(tally["found_tokens"] / looked_up, 4) if looked_up else None
    return tally
