"""The namespace's tally: lookup counts sent to Redis now and then, never lost to a failed send."""

from __future__ import annotations

import logging
import uuid

from kvredis.config import KVRedisConfig
from kvredis.store.client import RedisStore
from kvredis.store.tally import FLUSH_INTERVAL_S, Tally, read_tally, tally_key


def store_for(url: str, namespace: str) -> RedisStore:
    return RedisStore(KVRedisConfig.from_env({}, {"url": url, "namespace": namespace,
                                                  "connect_timeout_s": 0.5, "lookup_timeout_s": 0.5}))


def test_counts_are_due_once_the_interval_has_passed_and_sent_once(real_redis_url: str, monkeypatch) -> None:
    namespace = "t-tally-" + uuid.uuid4().hex[:8]
    store = store_for(real_redis_url, namespace)
    clock = [1000.0]
    monkeypatch.setattr("kvredis.store.tally.time.monotonic", lambda: clock[0])
    try:
        tally = Tally(store, namespace)
        assert not tally.due()  # nothing counted
        tally.add(lookup_tokens=10, found_tokens=4)
        assert not tally.due()  # counted, but sent less than the interval ago
        clock[0] += FLUSH_INTERVAL_S
        assert tally.due()
        tally.flush()
        assert not tally.due()
        tally.flush()  # nothing waiting: nothing sent twice
        assert read_tally(store, namespace) == {"lookup_tokens": 10, "found_tokens": 4, "hit_rate": 0.4}
        assert 0 < store.redis.pttl(tally_key(namespace)) <= 7 * 24 * 3600 * 1000
    finally:
        store.delete([tally_key(namespace)])
        store.close()


def test_a_failed_send_keeps_the_counts_and_warns_once(real_redis_url: str, redis_server, caplog) -> None:
    namespace = "t-tally-" + uuid.uuid4().hex[:8]
    server = redis_server()
    store = store_for(server.url, namespace)
    try:
        tally = Tally(store, namespace)
        server.kill()
        tally.add(lookup_tokens=64, found_tokens=64)
        with caplog.at_level(logging.WARNING, logger="kvredis.tally"):
            tally.flush()
            tally.add(lookup_tokens=36)
            tally.flush()
        assert sum("tally" in record.getMessage() for record in caplog.records) == 1  # two failed sends
        server.start()
        tally.flush()
        assert read_tally(store, namespace) == {"lookup_tokens": 100, "found_tokens": 64, "hit_rate": 0.64}
    finally:
        store.close()


def test_a_tally_nobody_sent_reads_as_no_hit_rate(real_redis_url: str) -> None:
    store = store_for(real_redis_url, "t-tally-" + uuid.uuid4().hex[:8])
    try:
        assert read_tally(store, "t-tally-none") == {"lookup_tokens": 0, "found_tokens": 0, "hit_rate": None}
    finally:
        store.close()

