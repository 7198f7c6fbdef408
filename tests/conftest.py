"""Shared fixtures: Redis back ends (fakeredis, a real server, a Redis Cluster, Sentinel), chosen by fixture
parameter. The cluster and Sentinel back ends are started once per session, only by the tests that ask."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

# tests/ for the shared helpers (processes, redis_servers, fake_device), and the folders that mirror the
# package's layers, whose test modules others import by name (the integration tests run test_buffer's,
# test_chunk_store's and test_transfer's tests against a cluster). Test module names are unique across
# these folders.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "store"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "v0"))
sys.path.insert(0, os.path.dirname(__file__))

from processes import FAKE_ENGINE
from redis_servers import ClusterServers, RedisServer, SentinelServers

from kvredis.config import KVRedisConfig
from kvredis.v0.buffer import RedisLookupBuffer

REAL_URL = os.environ.get("KVREDIS_TEST_URL", "redis://127.0.0.1:6379/0")
# CI sets this so that a missing Redis fails the run instead of silently skipping the real-server tests.
REQUIRE_REAL = os.environ.get("KVREDIS_REQUIRE_REAL_REDIS", "") not in ("", "0")


def _unavailable(reason: str) -> None:
    if REQUIRE_REAL:
        pytest.fail(f"real Redis required (KVREDIS_REQUIRE_REAL_REDIS=1) but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def real_redis_url() -> str:
    """The URL of a reachable real Redis (the machine's, or KVREDIS_TEST_URL)."""
    try:
        redis.Redis.from_url(REAL_URL, socket_connect_timeout=2).ping()
    except redis.exceptions.RedisError as exc:
        _unavailable(f"no Redis at {REAL_URL}: {exc}")
    return REAL_URL


@pytest.fixture
def redis_server() -> Iterator[Callable[..., RedisServer]]:
    """A factory of ``redis-server`` processes owned by the test (stopped afterwards)."""
    servers: list[RedisServer] = []

    def start(*extra_args: str) -> RedisServer:
        try:
            server = RedisServer(extra_args)
        except RuntimeError as exc:
            _unavailable(str(exc))
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.__exit__(None, None, None)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[ClusterServers]:
    """A 3-primary Redis Cluster with a replica per primary (hz 100: blocking pops time out to 10 ms),
    shared by the session: do not kill its nodes."""
    try:
        cluster = ClusterServers(primaries=3, replicas=1, extra_args=["--hz", "100"]).start()
    except (RuntimeError, OSError) as exc:
        _unavailable(f"cannot start a Redis Cluster: {exc}")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def redis_sentinel() -> Iterator[SentinelServers]:
    """A primary, a replica and three sentinels, shared by the session: do not kill them."""
    try:
        servers = SentinelServers().start()
    except (RuntimeError, OSError) as exc:
        _unavailable(f"cannot start Redis Sentinel: {exc}")
    yield servers
    servers.stop()


@pytest.fixture
def namespace() -> str:
    """A namespace no other test uses."""
    return "t-" + uuid.uuid4().hex[:12]


@pytest.fixture(params=["fake", "real"])
def backend(request: pytest.FixtureRequest) -> str:
    """Which Redis the test runs on: fakeredis in-process, or a real server (``cluster`` and ``sentinel``
    too, where a test module overrides this fixture's parameters)."""
    return str(request.param)


@pytest.fixture
def make_buffer(
    backend: str, namespace: str, request: pytest.FixtureRequest
) -> Iterator[Callable[..., RedisLookupBuffer]]:
    """Build lookup buffers on the chosen back end, all sharing one Redis and one test namespace."""
    buffers: list[RedisLookupBuffer] = []
    fake_server: Any = None
    url = {
        "real": lambda: request.getfixturevalue("real_redis_url"),
        "cluster": lambda: request.getfixturevalue("redis_cluster").url,
        "sentinel": lambda: request.getfixturevalue("redis_sentinel").url,
    }.get(backend, lambda: "redis://fake:6379/0")()
    if backend == "fake":
        import fakeredis

        fake_server = fakeredis.FakeServer()

    def make(**overrides: Any) -> RedisLookupBuffer:
        settings = {"url": url, "namespace": namespace, "pop_timeout_s": 1.0, **overrides}
        config = KVRedisConfig.from_env({}, settings)
        client = None
        if fake_server is not None:
            import fakeredis

            client = fakeredis.FakeRedis(server=fake_server)
        buffer = RedisLookupBuffer(config, client)
        buffers.append(buffer)
        return buffer

    yield make
    if buffers:
        leftover = list(buffers[0].store.scan(f"{namespace}:*"))
        buffers[0].store.delete(leftover)
    for buffer in buffers:
        buffer.close()


def namespace_keys(buffer: RedisLookupBuffer) -> list[str]:
    """Every key under the buffer's namespace."""
    return list(buffer.store.scan(f"{buffer.config.namespace}:*"))


@pytest.fixture
def buffer_defaults() -> dict[str, Any]:
    """Short bounds for the buffers of fault tests; a test module overrides this fixture to change them."""
    return {"pop_timeout_s": 0.3, "connect_timeout_s": 1.0, "socket_timeout_s": 2.0}


@pytest.fixture
def buffers(buffer_defaults: dict[str, Any]) -> Iterator[Callable[..., RedisLookupBuffer]]:
    """Lookup buffers on a given URL and namespace, closed after the test."""
    made: list[RedisLookupBuffer] = []

    def make(url: str, namespace: str, **overrides: Any) -> RedisLookupBuffer:
        settings = {"url": url, "namespace": namespace, **buffer_defaults, **overrides}
        buffer = RedisLookupBuffer(KVRedisConfig.from_env({}, settings))
        made.append(buffer)
        return buffer

    yield make
    for buffer in made:
        buffer.close()


@pytest.fixture
def fake_engine(tmp_path: Path) -> str:
    """A command line standing in for ``vllm serve`` (tests/processes.py's ``FAKE_ENGINE``)."""
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE_ENGINE)
    return f"{sys.executable} {script}"


@pytest.fixture
def reaper() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts, killed if the test fails before they exit."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()
