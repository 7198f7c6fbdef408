"""The lookup buffer on Redis Sentinel (``redis+sentinel://``): the core buffer tests through the primary the
sentinels name, clear errors when they name none, and the primary killed in the middle of a run.

The core tests share one set-up (a primary, a replica, three sentinels: ``redis_sentinel``); the failover
test starts one of its own, since it kills the primary.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import test_buffer
from kv_entries import assert_entry, kv_entry
from redis_servers import SentinelServers, free_port
from test_cluster import make_entries

from kvredis import KVRedisConnectionError, KVRedisError
from kvredis.config import KVRedisConfig
from kvredis.errors import ConfigError
from kvredis.store.client import RedisStore

MISS = [None] * 5

# Every test of test_buffer.py that takes its Redis from ``make_buffer`` or ``real_redis_url`` runs here
# again, through Sentinel.
globals().update(test_buffer.redis_backed_tests())


@pytest.fixture(params=["sentinel"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def real_redis_url(redis_sentinel: SentinelServers) -> str:
    return redis_sentinel.url


@pytest.fixture
def buffer_defaults() -> dict[str, Any]:
    return {"pop_timeout_s": 0.3, "connect_timeout_s": 0.5, "socket_timeout_s": 2.0}


# --- URLs --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("url, nodes, service, db", [
    ("redis+sentinel://10.0.0.1:26379,10.0.0.2:26380/mymaster", (("10.0.0.1", 26379), ("10.0.0.2", 26380)),
     "mymaster", 0),
    ("redis+sentinel://s1,s2/kv-cache/3", (("s1", 26379), ("s2", 26379)), "kv-cache", 3),
    ("rediss+sentinel://u:pw@[::1]:26379/m?db=2&ssl_cert_reqs=none", (("::1", 26379),), "m", 2),
])
def test_sentinel_urls_are_accepted(url, nodes, service, db):
    topology = KVRedisConfig.from_env({"KVREDIS_URL": url}).topology()
    assert (topology.kind, topology.nodes, topology.service, topology.db) == ("sentinel", nodes, service, db)
    assert topology.tls == url.startswith("rediss")


@pytest.mark.parametrize("url, complaint", [
    ("redis+sentinel://s1:26379", "name the service"),
    ("redis+sentinel://s1:26379/", "name the service"),
    ("redis+sentinel://s1:26379/m/x", "must be a number"),
    ("redis+sentinel://s1:26379/m/0/1", "name the service"),
    ("redis+sentinel://s1:26379/m%20m", "malformed service name"),
    ("redis+sentinel://s1:99999/m", "port"),
    ("redis+sentinel://s1/m?ssl_certfile=/etc/hosts", "rediss"),
    ("redis+sentinel://s1/m?retry_on_timeout=1", "unknown URL parameter"),
])
def test_malformed_sentinel_urls_are_refused_naming_the_variable(url, complaint):
    with pytest.raises(ConfigError, match=f"KVREDIS_URL=.*{complaint}"):
        KVRedisConfig.from_env({"KVREDIS_URL": url})


def test_sentinel_url_passwords_are_masked():
    config = KVRedisConfig.from_env(
        {"KVREDIS_URL": "redis+sentinel://bob:data-pw@s1:26379,s2:26379/m?sentinel_password=sentinel-pw"})
    shown = config.masked_url + repr(config) + str(config.describe())
    assert "data-pw" not in shown and "sentinel-pw" not in shown
    assert config.masked_url == "redis+sentinel://bob:***@s1:26379,s2:26379/m?sentinel_password=***"
    assert config.connection_options() == ("redis+sentinel://s1:26379,s2:26379/m", {
        "sentinel_password": "sentinel-pw", "username": "bob", "password": "data-pw"})


# --- errors ------------------------------------------------------------------------------------------


def test_an_unknown_service_fails_clearly(redis_sentinel, buffers, namespace):
    url = redis_sentinel.url.rsplit("/", 1)[0] + "/no-such-service"
    buffer = buffers(url, namespace)
    tokens, key, value, hidden = kv_entry(4)
    with pytest.raises(KVRedisConnectionError, match=r"no sentinel names a healthy primary.*no-such-service"):
        buffer.insert(tokens, None, key, value, hidden)
    with pytest.raises(KVRedisConnectionError, match="no sentinel names a healthy primary"):
        buffer.drop_select(tokens, None)


def test_unreachable_sentinels_fail_within_the_connect_timeout(buffers, namespace):
    url = f"redis+sentinel://127.0.0.1:{free_port()},127.0.0.1:{free_port()}/kvredis"
    buffer = buffers(url, namespace)
    tokens, key, value, hidden = kv_entry(4)
    started = time.monotonic()
    with pytest.raises(KVRedisConnectionError, match="sentinel"):
        buffer.insert(tokens, None, key, value, hidden)
    assert time.monotonic() - started < 2.0
    assert buffer.metrics["store_failed_error"] == 1


def test_writes_and_pops_go_to_the_primary(redis_sentinel, buffers, namespace):
    buffer = buffers(redis_sentinel.url, namespace, chunk_bytes=4096)
    primary = redis_sentinel.primary()
    tokens, key, value, hidden = kv_entry(64)
    buffer.insert(tokens, None, key, value, hidden)
    client = primary.client()
    try:
        assert len(list(client.scan_iter(match=f"{namespace}:*"))) > 1  # pieces and the list
        assert_entry(buffer.drop_select(tokens, None), tokens, key, value, hidden)
        assert list(client.scan_iter(match=f"{namespace}:*")) == []
    finally:
        client.close()
    assert isinstance(buffer.store, RedisStore) and not buffer.store.cluster


# --- failover ----------------------------------------------------------------------------------------


@pytest.fixture
def own_sentinel() -> Iterator[SentinelServers]:
    """A set-up of this test's own (it kills the primary); sentinels call a primary down after 500 ms."""
    try:
        servers = SentinelServers(down_after_ms=500, failover_timeout_ms=3000).start()
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"cannot start Redis Sentinel: {exc}")
    yield servers
    servers.stop()


def test_the_primary_killed_during_a_run_the_buffer_recovers_within_the_failover(own_sentinel, buffers,
                                                                                  namespace):
    """A prefill writes entries and a decode takes each a few entries later (so some are always in flight);
    the primary is killed a third of the way. Every call returns within its bound (a kvredis error while
    there is no primary); the same buffers work again as soon as the sentinels have promoted the replica;
    entries in flight come back identical or read as clean misses; everything after works."""
    servers = own_sentinel
    writer = buffers(servers.url, namespace, chunk_bytes=4096)
    reader = buffers(servers.url, namespace, chunk_bytes=4096, pop_timeout_s=0.1)
    entries = make_entries(400, seed=7)
    lag, step_s, bound_s = 5, 0.02, 2.0 + 0.5 + 1.0  # socket bound, connect bound, slack
    events: list[tuple[float, str, int, str]] = []  # (time, op, entry, outcome)
    stop = threading.Event()

    def run() -> None:
        for i in range(len(entries) + lag):
            if stop.is_set():
                return
            for op, j in (("insert", i), ("take", i - lag)):
                if not 0 <= j < len(entries):
                    continue
                tokens, key, value, hidden = entries[j]
                begin = time.monotonic()
                try:
                    if op == "insert":
                        writer.insert(tokens, None, key, value, hidden)
                        outcome = "ok"
                    else:
                        got = reader.drop_select(tokens, None)
                        if got == MISS:
                            outcome = "miss"
                        else:
                            assert_entry(got, tokens, key, value, hidden)
                            outcome = "ok"
                except KVRedisError as exc:
                    outcome = f"error: {type(exc).__name__}"
                assert time.monotonic() - begin < bound_s, f"{op} {j} took {time.monotonic() - begin:.1f} s"
                events.append((time.monotonic(), op, j, outcome))
            time.sleep(step_s)

    failure: list[BaseException] = []

    def guarded() -> None:
        try:
            run()
        except BaseException as exc:
            failure.append(exc)

    client = threading.Thread(target=guarded)
    client.start()
    try:
        while len(events) < 100 and client.is_alive():
            time.sleep(0.01)
        old = servers.primary()
        old.kill()
        killed_at = time.monotonic()
        servers.wait_failover(old, timeout_s=20)
        promoted_at = time.monotonic()
        while client.is_alive() and (not events or events[-1][0] < promoted_at + 2.0):
            time.sleep(0.05)
    finally:
        stop.set()
        client.join(timeout=30)
    assert not failure, failure
    after_kill = [e for e in events if e[0] > killed_at]
    errors = [e for e in after_kill if e[3].startswith("error")]
    assert errors, "no call failed: the primary died after the run"
    last_error = max(e[0] for e in errors)
    recovered_s = min(e[0] for e in after_kill if e[0] > last_error) - killed_at
    assert last_error < promoted_at + 1.0, "calls kept failing after the sentinels promoted the replica"
    # After the last error: every insert worked and every entry inserted after it came back identical.
    later = [e for e in events if e[0] > last_error]
    inserted_later = {e[2] for e in later if e[1] == "insert"}
    assert all(e[3] == "ok" for e in later if e[1] == "insert")
    assert all(e[3] == "ok" for e in later if e[1] == "take" and e[2] in inserted_later)
    assert len(inserted_later) > 20
    # Entries in flight at the kill (stored, not yet taken): identical or clean misses, never anything else.
    stored = {e[2] for e in events if e[1] == "insert" and e[3] == "ok" and e[0] < killed_at}
    in_flight = stored - {e[2] for e in events if e[1] == "take" and e[3] == "ok" and e[0] < killed_at}
    lost = []
    for j in sorted(in_flight - {e[2] for e in events if e[1] == "take" and e[3] == "ok"}):
        tokens, key, value, hidden = entries[j]
        got = reader.drop_select(tokens, None)
        if got == MISS:
            lost.append(j)
        else:
            assert_entry(got, tokens, key, value, hidden)
    assert in_flight and reader.metrics["dropped_corrupt"] == reader.metrics["dropped_foreign"] == 0
    print(f"failover: sentinels promoted the replica {promoted_at - killed_at:.1f} s after the kill, the "
          f"buffers' calls worked again {recovered_s:.1f} s after it; {len(errors)} calls failed meanwhile; "
          f"{len(in_flight)} entries in flight, {len(lost)} lost")


def test_passwords_for_the_servers_and_for_the_sentinels(namespace, buffers):
    """The URL's password is the servers'; ``?sentinel_password=`` the sentinels' own. Either one wrong or
    missing fails clearly, without showing it."""
    try:
        servers = SentinelServers(password="data-pw", sentinel_password="sentinel-pw").start()
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"cannot start Redis Sentinel: {exc}")
    try:
        url = servers.url.replace("://", "://:data-pw@") + "?sentinel_password=sentinel-pw"
        buffer = buffers(url, namespace, chunk_bytes=4096)
        tokens, key, value, hidden = kv_entry(64)
        buffer.insert(tokens, None, key, value, hidden)
        assert_entry(buffer.drop_select(tokens, None), tokens, key, value, hidden)

        no_sentinel_pw = buffers(url.split("?")[0], namespace)
        with pytest.raises(KVRedisConnectionError, match="no sentinel names a healthy primary") as info:
            no_sentinel_pw.insert(tokens, None, key, value, hidden)
        wrong_pw = buffers(url.replace("data-pw", "n0t-the-pw"), namespace)
        with pytest.raises(KVRedisConnectionError, match="authentication failed") as wrong:
            wrong_pw.insert(tokens, None, key, value, hidden)
        shown = str(info.value) + str(wrong.value)
        assert "data-pw" not in shown and "sentinel-pw" not in shown and "n0t-the-pw" not in shown
    finally:
        servers.stop()
