"""Shared fixtures: Redis back ends (fakeredis and a real server), chosen by fixture parameter."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

sys.path.insert(0, os.path.dirname(__file__))

from redis_servers import RedisServer

from kvredis.buffer import RedisLookupBuffer
from kvredis.config import KVRedisConfig

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


@pytest.fixture
def namespace() -> str:
    """A namespace no other test uses."""
    return "t-" + uuid.uuid4().hex[:12]


@pytest.fixture(params=["fake", "real"])
def backend(request: pytest.FixtureRequest) -> str:
    """Which Redis the test runs on: fakeredis in-process, or a real server."""
    return str(request.param)


@pytest.fixture
def make_buffer(
    backend: str, namespace: str, request: pytest.FixtureRequest
) -> Iterator[Callable[..., RedisLookupBuffer]]:
    """Build lookup buffers on the chosen back end, all sharing one Redis and one test namespace."""
    buffers: list[RedisLookupBuffer] = []
    fake_server: Any = None
    url = request.getfixturevalue("real_redis_url") if backend == "real" else "redis://fake:6379/0"
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
