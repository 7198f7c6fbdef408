"""A namespace's cache generation: what makes a reset of a shared KV cache mean it.

Every chunk key of a namespace names the generation it was written in (folded into the request's context
digest, so into each chunk's chained digest: :func:`with_generation`). The generation is an integer kept in
Redis under ``<namespace>:generation`` (absent: 0, the keys kvredis always wrote). A reset (vLLM's
``reset_cache``, ``kvredis purge``) increments it: from then on every engine of the namespace looks up, loads
and stores chunks under the new generation, so nothing stored before the reset is found again, whatever a
writer still in flight stores under the old one afterwards; the old chunks age out with their TTL (``kvredis
purge`` deletes them at once). Engines read the generation with every lookup (:meth:`Generation.read`).

The key has no TTL, the one key of a namespace without one: it is a few bytes, read by every lookup (so never
the least recently used), and no ``volatile-*`` eviction policy can drop it. If it is lost anyway (an
``allkeys-*`` policy, a ``FLUSHALL``), the first engine that knew a higher generation writes that back
(:data:`_READ`): a generation never goes back to one whose chunks may still be stored.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

from kvredis.store.client import RedisStore
from kvredis.store.keys import check_digest

_GENERATION_HASH = hashlib.blake2b(digest_size=16, person=b"kvredis-gen")  # copied, never updated

_READ = """
local stored = tonumber(redis.call('GET', KEYS[1]) or '0')
local known = tonumber(ARGV[1])
if stored < known then
  redis.call('SET', KEYS[1], ARGV[1])
  return known
end
return stored
"""
"""The generation, never lower than the caller's (which it writes back if the key was lost)."""


def generation_key(namespace: str) -> str:
    """The key holding ``namespace``'s generation (kept by ``kvredis purge``, which increments it)."""
    return f"{namespace}:generation"


def with_generation(context: str, generation: int) -> str:
    """A request's context digest (``""``: none) in generation ``generation``: the digest its chunks are
    chained from. Generation 0 leaves it as it is, so a namespace never reset keeps its keys."""
    if generation == 0:
        return context
    if generation < 0:
        raise ValueError(f"a generation is not negative, got {generation}")
    hasher = _GENERATION_HASH.copy()
    hasher.update(generation.to_bytes(8, "little"))
    if context:
        hasher.update(check_digest(context).encode())
    return hasher.hexdigest()


class Generation:
    """One namespace's generation as an engine or the command line reads and bumps it."""

    def __init__(self, store: RedisStore, namespace: str) -> None:
        self._store = store
        self.key = generation_key(namespace)
        self.known = 0
        """The highest generation this process has read or made."""
        self._scripts: dict[int, Any] = {}

    def read(self, *, lookup: bool = True) -> int:
        """The namespace's generation now (one round trip; ``lookup``: bounded by the lookup timeout). Raises
        a :class:`~kvredis.errors.KVRedisError` when Redis cannot answer."""
        client = self._store.prober if lookup else self._store.redis
        script = self._scripts.get(id(client))
        if script is None:  # EVALSHA, loaded on a NOSCRIPT (the connector's ACL rule allows no EVAL)
            script = self._scripts[id(client)] = client.register_script(_READ)
        with self._store.guarded("reading the cache generation"):
            value = int(script(keys=[self.key], args=[self.known]))
        self.known = max(self.known, value)
        return self.known

    def bump(self) -> int:
        """Start a new generation (``INCR``): nothing stored before it is found again. Returns it; raises a
        :class:`~kvredis.errors.KVRedisError` when Redis cannot answer (then it may or may not have
        happened)."""
        with self._store.guarded("starting a new cache generation"):
            value = int(self._store.redis.execute_command("INCR", self.key))  # redis-py sends INCRBY
        self.known = max(self.known, value)
        return value


def read_generation(store: RedisStore, namespace: str) -> int:
    """The namespace's generation as Redis holds it (``GET``; ``kvredis stats``), writing nothing."""
    with store.guarded("reading the cache generation"):
        return int(store.redis.get(generation_key(namespace)) or 0)


def reset_namespace(store: RedisStore, namespace: str) -> int:
    """Make every chunk stored in ``namespace`` so far unreachable for every engine (a new generation); the
    new generation. vLLM's ``reset_cache`` and ``kvredis purge`` both start here."""
    return Generation(store, namespace).bump()


def purge_keys(store: RedisStore, namespace: str) -> Iterator[str]:
    """The keys ``kvredis purge`` deletes: every key of the namespace but its generation."""
    keep = generation_key(namespace)
    return (key for key in store.scan(f"{namespace}:*") if key != keep)
