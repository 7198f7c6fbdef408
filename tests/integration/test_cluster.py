"""The lookup buffer on Redis Cluster (``redis+cluster://``): the core buffer tests, shards, load, resharding
in the middle of the load, and a primary killed with its replica promoted.

The cluster tests share one 3-primary cluster with a replica each (``redis_cluster``, started once per
session); the failover test starts a cluster of its own, since it kills a node.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
import test_buffer
import test_chunk_store
import test_transfer
import torch
from kv_entries import assert_entry, identical, kv_entry, random_tensor
from redis.crc import key_slot
from redis_servers import ClusterServers, free_port
from test_chunk_store import chunk_store  # noqa: F401 - the fixture
from test_security import Certs, certs  # noqa: F401 - the fixture, for the TLS cluster
from test_transfer import make_shared, make_transfers  # noqa: F401 - the fixtures

from kvredis import KVRedisConnectionError, KVRedisError
from kvredis.config import KVRedisConfig
from kvredis.errors import ConfigError
from kvredis.store.client import RedisStore
from kvredis.store.keys import Prompt
from kvredis.store.redis_errors import translate_errors
from kvredis.v0.buffer import RedisLookupBuffer

MISS = [None] * 5

# --- the core buffer tests, through the cluster ---------------------------------------------------------
# Every test of test_buffer.py that takes its Redis from ``make_buffer`` or ``real_redis_url`` runs here
# again, with those fixtures pointing at the cluster.
globals().update(test_buffer.redis_backed_tests())
# And the chunk store's: a prompt's chunks spread over slots, each chunk's scripts run in its own.
globals().update({name: test for name, test in vars(test_chunk_store).items()
                  if name.startswith("test_") and "two_writers" not in name})
# And transfers (both modes, small ones in their record): each step one round trip per slot, not one in all.
# Those counting kvredis's own framed round trips are one server's.
globals().update({name: test for name, test in vars(test_transfer).items()
                  if name.startswith("test_") and "round_trip" not in name and "one_command" not in name})


@pytest.fixture(params=["cluster"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def real_redis_url(redis_cluster: ClusterServers) -> str:
    return redis_cluster.url


@pytest.fixture
def buffer_defaults() -> dict[str, Any]:
    return {"pop_timeout_s": 0.3, "connect_timeout_s": 1.0, "socket_timeout_s": 3.0}


def entry_slot(buffer: RedisLookupBuffer, tokens: torch.Tensor) -> int:
    return int(key_slot(buffer.keyspace.keys_for(Prompt.of(tokens)).queue.encode()))


def make_entries(count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]]:
    """Entries of 2-40 KiB (most go in 4 KiB pieces, the smallest inline), distinct prompts."""
    generator = torch.Generator().manual_seed(seed)
    entries = []
    for i in range(count):
        tokens = torch.arange(seed * 100_000 + i * 100, seed * 100_000 + i * 100 + 8 + i % 40)
        key = random_tensor((1 + i % 2, tokens.numel(), 2 + 2 * (i % 3), 8), torch.float16, generator)
        hidden = random_tensor((tokens.numel(), 8), torch.float32, generator) if i % 2 else None
        entries.append((tokens, key, torch.flip(key, (1,)), hidden))
    return entries


@dataclass
class LoadResult:
    stored: set[int] = field(default_factory=set)
    store_failed: dict[int, str] = field(default_factory=dict)
    loaded: dict[int, int] = field(default_factory=dict)
    read_failed: dict[int, str] = field(default_factory=dict)
    wrong: list[str] = field(default_factory=list)
    seconds: float = 0.0


def run_load(writer: RedisLookupBuffer, reader: RedisLookupBuffer, entries: list, threads: int = 4,
             pause_s: float = 0.0, on_stored: Callable[[int], None] | None = None,
             readers_after: int = 0) -> LoadResult:
    """``threads`` writers insert the entries in random order, ``threads`` readers take them in another.

    A reader asks for each of its entries in turn with the reader's (short) pop timeout and comes back to
    the ones that missed, until the writers are done and one more round found nothing (like a decode
    instance that recomputes what is not there). ``on_stored(n)`` runs in the writer that stored the n-th
    entry; readers start once ``readers_after`` entries are stored (a backlog in Redis).
    """
    result = LoadResult()
    lock = threading.Lock()
    writers_done, backlog = threading.Event(), threading.Event()
    if readers_after <= 0:
        backlog.set()
    order, requests = list(range(len(entries))), list(range(len(entries)))
    random.Random(1).shuffle(order)
    random.Random(2).shuffle(requests)

    def write(part: list[int]) -> None:
        for i in part:
            tokens, key, value, hidden = entries[i]
            try:
                writer.insert(tokens, None, key, value, hidden)
            except KVRedisError as exc:
                with lock:
                    result.store_failed[i] = str(exc)
            else:
                with lock:
                    result.stored.add(i)
                    count = len(result.stored)
                if count >= readers_after:
                    backlog.set()
                if on_stored is not None:
                    on_stored(count)
            if pause_s:
                time.sleep(pause_s)

    def read(part: list[int]) -> None:
        backlog.wait(30)
        pending = list(part)
        while pending:
            final_round = writers_done.is_set()
            for i in list(pending):
                tokens, key, value, hidden = entries[i]
                try:
                    got = reader.drop_select(tokens, None)
                except KVRedisError as exc:
                    with lock:
                        result.read_failed[i] = str(exc)
                    continue
                if got == MISS:
                    continue
                pending.remove(i)
                same = (identical(got[0], tokens) and identical(got[2], key) and identical(got[3], value)
                        and identical(got[4], hidden))
                with lock:
                    if not same:
                        result.wrong.append(f"entry {i} came back different")
                    result.loaded[i] = result.loaded.get(i, 0) + 1
            if final_round:
                break

    workers = [threading.Thread(target=write, args=(order[k::threads],)) for k in range(threads)]
    readers = [threading.Thread(target=read, args=(requests[k::threads],)) for k in range(threads)]
    begin = time.monotonic()
    for thread in workers + readers:
        thread.start()
    for thread in workers:
        thread.join(timeout=60)
    writers_done.set()
    backlog.set()
    for thread in readers:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in workers + readers), "the load did not finish in time"
    result.seconds = time.monotonic() - begin
    return result


def namespace_keys(buffer: RedisLookupBuffer) -> list[str]:
    return list(buffer.store.scan(f"{buffer.config.namespace}:*"))


# --- URLs, settings and errors (no server needed) -------------------------------------------------------


@pytest.mark.parametrize("url, nodes", [
    ("redis+cluster://10.0.0.1:7000,10.0.0.2:7001", (("10.0.0.1", 7000), ("10.0.0.2", 7001))),
    ("redis+cluster://h1,h2:7001/0", (("h1", 6379), ("h2", 7001))),
    ("rediss+cluster://u:pw@[::1]:7000,h:7001/?ssl_cert_reqs=none", (("::1", 7000), ("h", 7001))),
])
def test_cluster_urls_are_accepted(url, nodes):
    config = KVRedisConfig.from_env({"KVREDIS_URL": url})
    topology = config.topology()
    assert (topology.kind, topology.nodes, topology.tls) == ("cluster", nodes, url.startswith("rediss"))


@pytest.mark.parametrize("url, complaint", [
    ("redis+cluster://h:7000/1", "only database 0"),
    ("redis+cluster://h:7000?db=2", "only database 0"),
    ("redis+cluster://", "no host"),
    ("redis+cluster://h:7000,,h:7001", "empty host"),
    ("redis+cluster://h:70000", "port"),
    ("redis+cluster://h:x", "port"),
    ("redis+cluster://::1:7000", "brackets"),
    ("redis+cluster://h:7000?ssl_ca_certs=/etc/hosts", "rediss"),
    ("redis+cluster://h:7000?socket_timeout=3", "unknown URL parameter"),
    ("redis+cluster://h:7000?sentinel_password=x", "unknown URL parameter"),
])
def test_malformed_cluster_urls_are_refused_naming_the_variable(url, complaint):
    with pytest.raises(ConfigError, match=f"KVREDIS_URL=.*{complaint}"):
        KVRedisConfig.from_env({"KVREDIS_URL": url})


def test_cluster_url_password_is_masked_and_handed_over_as_an_option():
    config = KVRedisConfig.from_env({"KVREDIS_URL": "redis+cluster://alice:s3cret@h1:7000,h2:7001/0"})
    assert config.masked_url == "redis+cluster://alice:***@h1:7000,h2:7001/0"
    assert "s3cret" not in repr(config) + str(config.describe())
    assert config.connection_options() == ("redis+cluster://h1:7000,h2:7001/0",
                                           {"username": "alice", "password": "s3cret"})


@pytest.mark.parametrize("raised, kind, words", [
    (redis.exceptions.ClusterDownError("The cluster is down"), KVRedisConnectionError, "Cluster is down"),
    (redis.exceptions.MasterDownError("MASTERDOWN Link with MASTER is down"), KVRedisConnectionError,
     "Cluster is down"),
    (redis.exceptions.TryAgainError("TRYAGAIN"), KVRedisError, "resharding"),
    (redis.exceptions.MovedError("3999 127.0.0.1:6381"), KVRedisError, "redirected"),
    (redis.exceptions.AskError("3999 127.0.0.1:6381"), KVRedisError, "redirected"),
    (redis.exceptions.ClusterError("TTL exhausted."), KVRedisError, "redirected the command too many times"),
    (redis.exceptions.SlotNotCoveredError("slot 7"), KVRedisConnectionError, "no Redis Cluster node"),
    (redis.exceptions.RedisClusterException("Redis Cluster cannot be connected"), KVRedisConnectionError,
     "Redis Cluster: Redis Cluster cannot be connected"),
    (redis.sentinel.MasterNotFoundError("No master found for 'x'"), KVRedisConnectionError,
     "no sentinel names a healthy primary"),
])
def test_cluster_and_sentinel_errors_become_kvredis_errors(raised, kind, words):
    config = KVRedisConfig.from_env({"KVREDIS_URL": "redis+cluster://u:pw@h:7000"})
    with pytest.raises(kind, match=words) as info, translate_errors("BLPOP q", config):
        raise raised
    assert type(info.value) is kind and "redis+cluster://u:***@h:7000" in str(info.value)


def test_unreachable_cluster_fails_clearly_and_the_buffer_works_once_it_is_up(namespace, buffers):
    port = free_port()
    buffer = buffers(f"redis+cluster://127.0.0.1:{port}", namespace, connect_timeout_s=0.5)  # no error yet
    tokens, key, value, hidden = kv_entry(3)
    started = time.monotonic()
    with pytest.raises(KVRedisConnectionError, match=f"127.0.0.1:{port}"):
        buffer.insert(tokens, None, key, value, hidden)
    with pytest.raises(KVRedisConnectionError):
        buffer.drop_select(tokens, None)
    with pytest.raises(KVRedisConnectionError):
        buffer.contains(tokens)
    assert time.monotonic() - started < 3.0
    assert buffer.metrics["store_failed_error"] == 1 and buffer.metrics["miss_error"] == 1


# --- shards ------------------------------------------------------------------------------------------


def test_entries_spread_over_every_shard_and_each_entry_stays_in_one_slot(redis_cluster, buffers, namespace):
    buffer = buffers(redis_cluster.url, namespace, chunk_bytes=4096)
    entries = make_entries(60, seed=1)
    for tokens, key, value, hidden in entries:
        buffer.insert(tokens, None, key, value, hidden)
    assert buffer.contains(entries[0][0])
    primaries = redis_cluster.primaries()
    assert len(primaries) == 3
    owners = redis_cluster.slot_owners()
    per_node = {}
    for server in primaries:
        keys = [name.decode() for name in redis_cluster.keys_on(server, f"{namespace}:*")]
        per_node[server.port] = len(keys)
        assert all(owners[key_slot(name.encode())] == server.port for name in keys)
    assert all(count > 0 for count in per_node.values()), f"keys per primary: {per_node}"
    summary = buffer.store.summary(f"{namespace}:*")  # SCAN over every primary
    assert summary["keys"] == sum(per_node.values()) and summary["entries"] == len(entries)
    assert summary["redis_used_memory"] > 0
    by_entry: dict[str, set[int]] = {}
    for name in namespace_keys(buffer):
        tag = name[name.index("{"):name.index("}") + 1]
        by_entry.setdefault(tag, set()).add(key_slot(name.encode()))
    assert len(by_entry) == len(entries) and all(len(slots) == 1 for slots in by_entry.values())
    assert sum(1 for name in namespace_keys(buffer) if not name.endswith(":q")) > len(entries)  # pieces
    for tokens, key, value, hidden in entries:
        assert_entry(buffer.drop_select(tokens, None), tokens, key, value, hidden)
    assert namespace_keys(buffer) == []


# --- load --------------------------------------------------------------------------------------------


def test_400_entries_through_8_threads_come_back_identical_exactly_once(redis_cluster, buffers, namespace):
    writer = buffers(redis_cluster.url, namespace, chunk_bytes=4096)
    reader = buffers(redis_cluster.url, namespace, chunk_bytes=4096, pop_timeout_s=0.05)
    entries = make_entries(400, seed=2)
    result = run_load(writer, reader, entries, threads=4)
    assert result.store_failed == {} and result.read_failed == {} and result.wrong == []
    assert sorted(result.loaded) == list(range(len(entries))) and set(result.loaded.values()) == {1}
    assert reader.metrics["loaded"] == len(entries) and reader.metrics["dropped"] == 0
    assert namespace_keys(writer) == []
    print(f"400 entries in {result.seconds:.1f} s")


def test_slots_migrated_in_the_middle_of_the_load_lose_nothing(redis_cluster, buffers, namespace,
                                                                monkeypatch):
    """A third of one shard's slots that hold entries move to another primary while writers and readers run.
    For half a second the entries' pieces, records and lists are split between the two nodes (ASK), then
    the slots' owner changes (MOVED). Every entry stored comes back identical, exactly once."""
    writer = buffers(redis_cluster.url, namespace, chunk_bytes=4096)
    reader = buffers(redis_cluster.url, namespace, chunk_bytes=4096, pop_timeout_s=0.05)
    entries = make_entries(300, seed=3)
    source, target = redis_cluster.primaries()[:2]
    owners = redis_cluster.slot_owners()
    slots = sorted({entry_slot(writer, tokens) for tokens, *_ in entries} & {
        slot for slot, port in owners.items() if port == source.port})
    slots = slots[:len(slots) // 3]
    moving = sum(1 for tokens, *_ in entries if entry_slot(writer, tokens) in slots)
    redirected: list[int] = []
    original = RedisStore._take_redirected

    def counting(self, keys, sizes, out, indexes):  # type: ignore[no-untyped-def]
        redirected.append(len(indexes))
        return original(self, keys, sizes, out, indexes)

    monkeypatch.setattr(RedisStore, "_take_redirected", counting)
    started, migration = threading.Event(), {}
    asking_before = redis_cluster.command_calls(target, "asking")

    def migrate() -> None:
        started.wait(30)
        begin = time.monotonic()
        migration["keys"] = redis_cluster.migrate_slots(slots, target, keys_per_batch=2, duration_s=0.5,
                                                        pause_s=0.002)
        migration["ms"] = int((time.monotonic() - begin) * 1000)

    mover = threading.Thread(target=migrate)
    mover.start()
    # Writers pause between inserts (the load lasts about a second); readers start with half of it stored.
    result = run_load(writer, reader, entries, threads=4, pause_s=0.01, readers_after=len(entries) // 2,
                      on_stored=lambda stored: stored >= len(entries) // 4 and started.set())
    mover.join(timeout=30)
    assert not mover.is_alive()
    owners = redis_cluster.slot_owners()
    assert all(owners[slot] == target.port for slot in slots)
    asking = redis_cluster.command_calls(target, "asking") - asking_before
    print(f"{len(slots)} slots ({moving} entries) moved in {migration['ms']} ms, {migration['keys']} keys "
          f"moved with them, {asking} ASKING on the target, {len(redirected)} bulk reads had "
          f"{sum(redirected)} pieces redirected; load {result.seconds:.1f} s")
    assert migration["keys"] > 0 and asking > 0, "the migration did not overlap the load"
    assert result.store_failed == {} and result.read_failed == {} and result.wrong == []
    assert sorted(result.loaded) == sorted(result.stored) == list(range(len(entries)))
    assert set(result.loaded.values()) == {1}
    assert namespace_keys(writer) == []
    redis_cluster.migrate_slots(slots, source)  # give the slots back: the cluster is shared


# --- failover ----------------------------------------------------------------------------------------


@pytest.fixture
def own_cluster() -> Iterator[ClusterServers]:
    """A cluster of this test's own (it kills a node), with a 1 s node timeout for a quick failover."""
    try:
        cluster = ClusterServers(primaries=3, replicas=1, node_timeout_ms=1000, extra_args=["--hz", "100"])
        cluster.start()
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"cannot start a Redis Cluster: {exc}")
    yield cluster
    cluster.stop()


def test_a_primary_killed_and_its_replica_promoted(own_cluster, buffers, namespace):
    """A primary is killed in the middle of a load. Calls fail with a kvredis error within their bounds while
    its replica takes over; entries stored on it come back identical (replicated in time) or read as clean
    misses; entries elsewhere all come back; once the replica has taken over, the same buffer objects store
    and read again, on every shard, without another error."""
    cluster = own_cluster
    writer = buffers(cluster.url, namespace, chunk_bytes=4096, socket_timeout_s=2.0)
    reader = buffers(cluster.url, namespace, chunk_bytes=4096, pop_timeout_s=0.1, socket_timeout_s=2.0)
    entries = make_entries(160, seed=4)
    victim = cluster.primaries()[0]
    owners = cluster.slot_owners()
    on_victim = {i for i, (tokens, *_) in enumerate(entries)
                 if owners[entry_slot(writer, tokens)] == victim.port}
    assert 20 < len(on_victim) < 100

    killed_at: list[float] = []

    def kill(stored: int) -> None:
        if stored == 30:  # a quarter of the way: SIGKILL, in the middle of the other writers' calls
            cluster.kill(victim)
            killed_at.append(time.monotonic())

    result = run_load(writer, reader, entries[:120], threads=2, pause_s=0.01, on_stored=kill)
    assert killed_at, "the primary was not killed"
    new_primary = cluster.wait_failover(victim)
    failover_s = time.monotonic() - killed_at[0]
    time.sleep(1.0)  # the buffers re-read the slot map every 0.5 s since their first error
    assert result.wrong == [], result.wrong
    assert result.store_failed, "no insert failed: the primary died after the load"
    assert set(result.loaded.values()) == {1}

    # Entries stored and not taken during the load: identical, or a clean miss if they died with the primary.
    lost = []
    for i in sorted(result.stored - set(result.loaded)):
        tokens, key, value, hidden = entries[i]
        got = reader.drop_select(tokens, None)
        if got == MISS:
            lost.append(i)
        else:
            assert_entry(got, tokens, key, value, hidden)
    # (With cluster-require-full-coverage yes, every shard refuses calls from the moment the primary is
    # declared failed until its replica takes over: an entry popped just before, whose pieces could not be
    # read then, is lost too. Its read failed with an error.)
    assert set(lost) <= on_victim | set(result.read_failed), "entries on surviving primaries were lost"
    assert reader.metrics["dropped_corrupt"] == reader.metrics["dropped_foreign"] == 0

    # Later entries work at once, on every shard (the promoted one included), with the same buffers.
    errors = writer.metrics["store_failed_error"], reader.metrics["miss_error"]
    later = entries[120:]
    for tokens, key, value, hidden in later:
        writer.insert(tokens, None, key, value, hidden)
        assert reader.contains(tokens)
    for tokens, key, value, hidden in later:
        assert_entry(reader.drop_select(tokens, None), tokens, key, value, hidden)
    assert (writer.metrics["store_failed_error"], reader.metrics["miss_error"]) == errors
    assert any(cluster.slot_owners()[entry_slot(writer, tokens)] == new_primary.port for tokens, *_ in later)
    print(f"failover took {failover_s:.1f} s; during the load {len(result.stored)} stored, "
          f"{len(result.store_failed)} inserts and {len(result.read_failed)} reads failed, "
          f"{len(result.loaded)} taken; afterwards {len(lost)} of "
          f"{len(on_victim & (result.stored - set(result.loaded)))} entries left on the killed primary lost")


def test_a_primary_down_without_a_replica_the_other_shards_keep_working(namespace, buffers):
    """With ``cluster-require-full-coverage no`` the surviving shards serve on while a primary with no
    replica is down, also to a buffer made after it died (its cluster client is discovered through the
    dead node's address, listed first); calls for the dead shard fail at once with a clear error."""
    try:
        cluster = ClusterServers(primaries=3, replicas=0, node_timeout_ms=500,
                                 extra_args=["--cluster-require-full-coverage", "no"]).start()
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"cannot start a Redis Cluster: {exc}")
    try:
        dead = cluster.owner(0)  # the first primary redis-py knows of: its default node
        others = [s for s in cluster.primaries() if s is not dead]
        cluster.kill(dead)
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in [dead, *others])
        buffer = buffers(url, namespace, chunk_bytes=4096, connect_timeout_s=0.5)
        owners = cluster.slot_owners(others[0])
        entries = make_entries(40, seed=6)
        alive = [e for e in entries if owners[entry_slot(buffer, e[0])] != dead.port]
        gone = [e for e in entries if owners[entry_slot(buffer, e[0])] == dead.port]
        assert alive and gone
        for tokens, key, value, hidden in alive:
            buffer.insert(tokens, None, key, value, hidden)
            assert_entry(buffer.drop_select(tokens, None), tokens, key, value, hidden)
        started = time.monotonic()
        for tokens, key, value, hidden in gone[:3]:
            with pytest.raises(KVRedisConnectionError, match=f"127.0.0.1:{dead.port}|Cluster"):
                buffer.insert(tokens, None, key, value, hidden)
            with pytest.raises(KVRedisConnectionError):
                buffer.drop_select(tokens, None)
        assert time.monotonic() - started < 6 * 1.0
    finally:
        cluster.stop()


def test_tls_and_a_password_through_rediss_cluster(certs: Certs, namespace, buffers):  # noqa: F811
    """``rediss+cluster://`` with the URL's password and the KVREDIS_TLS_* files: every node's connections
    (bulk reads included) use them; a wrong password or no client certificate fails clearly."""
    try:
        cluster = ClusterServers(primaries=3, tls=certs.server("yes"), password="cluster-pw").start()
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"cannot start a TLS Redis Cluster: {exc}")
    try:
        url = cluster.url.replace("://", "://:cluster-pw@")
        assert url.startswith("rediss+cluster://")
        tls = {"tls_ca_file": certs.ca, "tls_cert_file": certs.client_cert, "tls_key_file": certs.client_key}
        buffer = buffers(url, namespace, chunk_bytes=4096, **tls)
        entries = make_entries(12, seed=8)
        for tokens, key, value, hidden in entries:
            buffer.insert(tokens, None, key, value, hidden)
        assert buffer.store.summary(f"{namespace}:*")["entries"] == len(entries)
        for tokens, key, value, hidden in entries:
            assert_entry(buffer.drop_select(tokens, None), tokens, key, value, hidden)
        tokens, key, value, hidden = entries[0]
        wrong = buffers(url.replace("cluster-pw", "n0t-the-pw"), namespace, **tls)
        with pytest.raises(KVRedisConnectionError, match="authentication failed") as info:
            wrong.insert(tokens, None, key, value, hidden)
        assert "n0t-the-pw" not in str(info.value) and ":***@" in str(info.value)
        no_cert = buffers(url, namespace, tls_ca_file=certs.ca)
        with pytest.raises(KVRedisConnectionError, match="TLS") as info:
            no_cert.insert(tokens, None, key, value, hidden)
        print(f"wrong password: {wrong.metrics['store_failed_error']} failure; no client certificate: "
              f"{info.value}")
    finally:
        cluster.stop()


def test_the_acl_rule_for_a_cluster_user(redis_cluster, namespace, buffers):
    """On a cluster a lookup-buffer user needs, besides the single-server rule, +cluster|slots and +command
    (redis-py discovers the cluster with them) and +asking (to follow ASK while a slot moves). Without them
    the error names NOPERM."""
    rule = (f"on >acl-pw resetkeys ~{namespace}:* resetchannels -@all +rpush +pexpire +multi +exec +blpop "
            "+llen +set +getdel +del").split()
    users = {"kv-" + namespace: [*rule, "+cluster|slots", "+command", "+asking"], "bare-" + namespace: rule}
    for server in redis_cluster.live():
        for user, user_rule in users.items():
            redis_cluster.ask(server, "ACL", "SETUSER", user, *user_rule)
    try:
        host = redis_cluster.url.partition("://")[2]
        buffer = buffers(f"redis+cluster://kv-{namespace}:acl-pw@{host}", namespace, chunk_bytes=4096)
        for tokens, key, value, hidden in make_entries(6, seed=9):
            buffer.insert(tokens, None, key, value, hidden)
            assert buffer.contains(tokens)
            assert_entry(buffer.drop_select(tokens, None), tokens, key, value, hidden)
        bare = buffers(f"redis+cluster://bare-{namespace}:acl-pw@{host}", namespace)
        tokens, key, value, hidden = kv_entry(4)
        with pytest.raises(KVRedisError, match=r"denied by the Redis ACL \(NOPERM.*cluster\|slots") as info:
            bare.insert(tokens, None, key, value, hidden)
        assert "acl-pw" not in str(info.value)
    finally:
        for server in redis_cluster.live():
            redis_cluster.ask(server, "ACL", "DELUSER", *users)
