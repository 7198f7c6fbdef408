"""A namespace's cache generation: the digest it folds into keys, reading and bumping it, and ``kvredis
purge`` (which starts a new one before deleting, sharing vLLM's reset path)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from kvredis import KVRedisError
from kvredis.cli import main
from kvredis.config import KVRedisConfig
from kvredis.store.client import RedisStore
from kvredis.store.generation import Generation, generation_key, purge_keys, reset_namespace, with_generation

CONTEXT = "ab" * 16


def test_generation_zero_keeps_the_keys_kvredis_always_wrote() -> None:
    assert with_generation("", 0) == "" and with_generation(CONTEXT, 0) == CONTEXT
    digests = {with_generation(context, generation) for context in ("", CONTEXT) for generation in (1, 2)}
    assert len(digests) == 4 and all(len(d) == 32 for d in digests)
    assert with_generation(CONTEXT, 3) == with_generation(CONTEXT, 3)  # stable across processes
    with pytest.raises(ValueError):
        with_generation("not a digest", 1)


@pytest.fixture
def store(real_redis_url: str) -> Iterator[tuple[RedisStore, str, redis.Redis]]:
    namespace = "t-gen-" + uuid.uuid4().hex[:10]
    store = RedisStore(KVRedisConfig.from_env({}, {"url": real_redis_url, "namespace": namespace}))
    admin = redis.Redis.from_url(real_redis_url)
    yield store, namespace, admin
    admin.delete(*admin.keys(f"{namespace}:*") or [b"-"])
    admin.close()
    store.close()


def test_bumps_are_seen_by_every_reader_and_a_lost_generation_is_written_back(store) -> None:
    store_, namespace, admin = store
    engine, other = Generation(store_, namespace), Generation(store_, namespace)
    assert engine.read() == 0 and admin.get(generation_key(namespace)) is None  # nothing written at 0
    assert reset_namespace(store_, namespace) == 1 and other.bump() == 2
    assert engine.read() == 2
    admin.delete(generation_key(namespace))  # an allkeys eviction, a FLUSHALL
    assert Generation(store_, namespace).read() == 0  # a newcomer knows nothing higher
    assert engine.read() == 2 and admin.get(generation_key(namespace)) == b"2"
    assert admin.ttl(generation_key(namespace)) == -1  # no TTL: no volatile-* policy evicts it


def test_an_unreachable_redis_raises() -> None:
    config = KVRedisConfig.from_env({}, {"url": "redis://127.0.0.1:1/0", "connect_timeout_s": 0.2})
    store = RedisStore(config)
    try:
        with pytest.raises(KVRedisError):
            Generation(store, "t-gen").bump()
    finally:
        store.close()


def test_purge_starts_a_new_generation_and_keeps_its_key(store, real_redis_url: str, capsys) -> None:
    store_, namespace, admin = store
    admin.set(f"{namespace}:abc:c:{{0}}", b"chunk", px=60_000)
    admin.set(generation_key(namespace), 4)
    assert sorted(purge_keys(store_, namespace)) == [f"{namespace}:abc:c:{{0}}"]
    assert main(["purge", "--url", real_redis_url, "--namespace", namespace, "--yes"]) == 0
    assert "deleted 1 keys" in capsys.readouterr().out
    assert admin.keys(f"{namespace}:*") == [generation_key(namespace).encode()]
    assert admin.get(generation_key(namespace)) == b"5"
