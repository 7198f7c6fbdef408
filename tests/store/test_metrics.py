"""Observability: the in-process counts, the Prometheus series, and what is logged (and what is not).

The Prometheus registry is process-wide, so every check is a difference between two readings.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

import prometheus_client
import pytest
import torch
from conftest import namespace_keys
from kv_entries import assert_entry, kv_entry
from redis_servers import free_port

from kvredis import KVRedisConnectionError, KVRedisTimeoutError
from kvredis.config import KVRedisConfig
from kvredis.store import codec
from kvredis.store.metrics import MISS_CAUSES, Metrics
from kvredis.v0.buffer import RedisLookupBuffer

MISS = [None] * 5


class Series:
    """Readings of every kvredis series of one namespace, to compare before and after."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.before = self.read()

    def read(self) -> dict[str, float]:
        names: dict[str, dict[str, str]] = {
            "stored": {}, "loaded": {}, "timeouts": {},
            "bytes_stored": {"direction": "stored"}, "bytes_loaded": {"direction": "loaded"},
            **{f"miss_{cause}": {"cause": cause} for cause in MISS_CAUSES},
            **{f"dropped_{cause}": {"cause": cause} for cause in MISS_CAUSES},
            "store_failed_timeout": {"cause": "timeout"}, "store_failed_error": {"cause": "error"},
        }
        metric = {"stored": "kvredis_entries_stored_total", "loaded": "kvredis_entries_loaded_total",
                  "timeouts": "kvredis_timeouts_total", "bytes": "kvredis_bytes_total",
                  "miss": "kvredis_misses_total", "dropped": "kvredis_dropped_entries_total",
                  "store": "kvredis_store_failures_total"}
        values = {}
        for name, labels in names.items():
            family = name.split("_")[0] if name.split("_")[0] in metric else name
            values[name] = self._get(metric[family], labels)
        values["store_seconds_count"] = self._get("kvredis_store_seconds_count", {})
        values["load_seconds_count"] = self._get("kvredis_load_seconds_count", {})
        return values

    def _get(self, sample: str, labels: dict[str, str]) -> float:
        value = prometheus_client.REGISTRY.get_sample_value(sample, {"namespace": self.namespace, **labels})
        return value or 0.0

    def delta(self) -> dict[str, float]:
        """What changed since the first reading (only the series that moved)."""
        after = self.read()
        return {name: after[name] - self.before[name] for name in after if after[name] != self.before[name]}


@pytest.fixture
def series(namespace: str) -> Series:
    return Series(namespace)


def sized(entry: tuple[torch.Tensor, ...]) -> int:
    tokens = entry[0]
    return codec.payload_size([tokens.to(torch.int64), torch.ones(tokens.numel(), dtype=torch.bool),
                               *entry[1:]])


# --- Prometheus series --------------------------------------------------------------------------------


def test_hits_count_entries_bytes_both_ways_and_latencies(make_buffer, series):
    buffer = make_buffer(chunk_bytes=4096)
    small, large = kv_entry(8, seed=1), kv_entry(200, seed=2)
    for entry in (small, large):
        buffer.insert(entry[0], None, *entry[1:])
    for entry in (small, large):
        assert_entry(buffer.drop_select(entry[0], None), *entry)
    nbytes = sized(small) + sized(large)
    assert series.delta() == {"stored": 2, "loaded": 2, "bytes_stored": nbytes, "bytes_loaded": nbytes,
                              "store_seconds_count": 2, "load_seconds_count": 2}
    assert buffer.metrics["bytes_stored"] == buffer.metrics["bytes_loaded"] == nbytes


def test_each_miss_cause_has_its_series(make_buffer, series):
    buffer = make_buffer(chunk_bytes=4096, pop_timeout_s=0.1)
    redis_client = buffer.store.redis
    # absent: nothing there
    assert buffer.drop_select(torch.arange(5), None) == MISS
    # partial: a piece evicted
    partial = kv_entry(200, seed=3)
    buffer.insert(partial[0], None, *partial[1:])
    piece = next(name for name in namespace_keys(buffer) if not name.endswith(":q"))
    redis_client.delete(piece)
    assert buffer.drop_select(partial[0], None) == MISS
    # foreign: a blob that is not kvredis's
    foreign = kv_entry(9, seed=4)
    redis_client.rpush(buffer.keyspace.entry(foreign[0]).queue, os.urandom(100))
    assert buffer.drop_select(foreign[0], None) == MISS
    # corrupt: kvredis's magic, broken header
    corrupt = kv_entry(10, seed=5)
    redis_client.rpush(buffer.keyspace.entry(corrupt[0]).queue, b"KVR\x01" + os.urandom(60))
    assert buffer.drop_select(corrupt[0], None) == MISS
    delta = series.delta()
    assert delta == {"stored": 1, "store_seconds_count": 1, "bytes_stored": sized(partial),
                     "miss_absent": 1, "miss_partial": 1, "miss_foreign": 1, "miss_corrupt": 1,
                     "dropped_partial": 1, "dropped_foreign": 1, "dropped_corrupt": 1}
    counts = buffer.metrics
    assert counts["misses"] == 4 and counts["dropped"] == 3 and counts["loaded"] == 0


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers: a stalled Redis."""
    listener = socket.create_server(("127.0.0.1", 0))
    yield int(listener.getsockname()[1])
    listener.close()


def own_buffer(port: int, namespace: str, **overrides: Any) -> RedisLookupBuffer:
    settings = {"url": f"redis://127.0.0.1:{port}/0", "namespace": namespace, "socket_timeout_s": 0.2,
                "pop_timeout_s": 0.1, "connect_timeout_s": 0.5, **overrides}
    return RedisLookupBuffer(KVRedisConfig.from_env({}, settings))


def test_timeouts_and_errors_have_their_series(silent_port, namespace, series):
    entry = kv_entry(8)
    with own_buffer(silent_port, namespace) as stalled:
        with pytest.raises(KVRedisTimeoutError):
            stalled.insert(entry[0], None, *entry[1:])
        with pytest.raises(KVRedisTimeoutError):
            stalled.drop_select(entry[0], None)
    with own_buffer(free_port(), namespace) as refused:
        with pytest.raises(KVRedisConnectionError):
            refused.insert(entry[0], None, *entry[1:])
        with pytest.raises(KVRedisConnectionError):
            refused.drop_select(entry[0], None)
    assert series.delta() == {"timeouts": 2, "store_failed_timeout": 1, "miss_timeout": 1,
                              "store_failed_error": 1, "miss_error": 1}


def test_in_process_counts_work_without_prometheus(monkeypatch):
    import kvredis.store.metrics as metrics_module

    monkeypatch.setattr(metrics_module, "_prometheus", {})
    monkeypatch.setattr(metrics_module, "prometheus_client", None)
    metrics = Metrics("no-prometheus")
    metrics.stored(10, 0.1)
    metrics.miss("absent")
    metrics.store_failed("timeout")
    assert metrics["stored"] == 1 and metrics["miss_absent"] == 1 and metrics["store_failed_timeout"] == 1
    with pytest.raises(ValueError, match="unknown"):
        metrics.miss("bored")
    with pytest.raises(ValueError, match="unknown"):
        metrics.store_failed("absent")


# --- logging ------------------------------------------------------------------------------------------


def above_debug(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.levelno > logging.DEBUG]


def kvredis_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.levelno >= logging.WARNING and record.name.startswith("kvredis")]


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 4096], ids=["inline", "chunked"])
def test_success_logs_nothing_above_debug(make_buffer, caplog, chunk_bytes):
    caplog.set_level(logging.DEBUG)
    buffer = make_buffer(chunk_bytes=chunk_bytes, pop_timeout_s=0.1)
    entry = kv_entry(200)
    buffer.insert(entry[0], None, *entry[1:])
    assert buffer.contains(entry[0])
    assert_entry(buffer.drop_select(entry[0], None), *entry)
    assert buffer.drop_select(entry[0], None) == MISS  # nothing there is no failure either
    assert above_debug(caplog) == []
    assert any(record.name.startswith("kvredis") for record in caplog.records)  # DEBUG lines exist


def test_kvredis_logs_under_the_kvredis_logger(make_buffer, caplog):
    caplog.set_level(logging.DEBUG)
    buffer = make_buffer()
    entry = kv_entry(8)
    buffer.insert(entry[0], None, *entry[1:])
    buffer.drop_select(entry[0], None)
    names = {record.name for record in caplog.records if "kvredis" in record.name}
    assert names and all(name == "kvredis" or name.startswith("kvredis.") for name in names)


def _partial(buffer: RedisLookupBuffer) -> tuple[str, Callable[[], Any]]:
    entry = kv_entry(200, seed=6)
    buffer.insert(entry[0], None, *entry[1:])
    buffer.store.redis.delete(next(k for k in namespace_keys(buffer) if not k.endswith(":q")))
    return buffer.keyspace.entry(entry[0]).queue, lambda: buffer.drop_select(entry[0], None)


def _planted(blob: bytes) -> Callable[[RedisLookupBuffer], tuple[str, Callable[[], Any]]]:
    def plant(buffer: RedisLookupBuffer) -> tuple[str, Callable[[], Any]]:
        tokens = torch.arange(7)
        queue = buffer.keyspace.entry(tokens).queue
        buffer.store.redis.rpush(queue, blob)
        return queue, lambda: buffer.drop_select(tokens, None)
    return plant


@pytest.mark.parametrize("make_failure, cause", [
    (_partial, "lost piece"),
    (_planted(b"not a kvredis blob"), "foreign"),
    (_planted(b"KVR\x01" + bytes(60)), "corrupt"),
], ids=["partial", "foreign", "corrupt"])
def test_a_dropped_entry_logs_one_warning_naming_its_list_and_cause(make_buffer, caplog, make_failure,
                                                                    cause):
    caplog.set_level(logging.DEBUG)
    buffer = make_buffer(chunk_bytes=4096, pop_timeout_s=0.1)
    queue, call = make_failure(buffer)
    caplog.clear()
    assert call() == MISS
    warnings = kvredis_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert queue in warnings[0] and cause in warnings[0]


@pytest.mark.parametrize("fault", ["stalled", "refused"])
@pytest.mark.parametrize("operation", ["insert", "drop_select", "contains"])
def test_a_failed_call_logs_one_warning_naming_its_list_and_cause(silent_port, namespace, caplog, fault,
                                                                 operation):
    caplog.set_level(logging.DEBUG)
    port = silent_port if fault == "stalled" else free_port()
    entry = kv_entry(200)
    with own_buffer(port, namespace, chunk_bytes=4096) as buffer:
        call = {"insert": lambda: buffer.insert(entry[0], None, *entry[1:]),
                "drop_select": lambda: buffer.drop_select(entry[0], None),
                "contains": lambda: buffer.contains(entry[0])}[operation]
        with pytest.raises(KVRedisTimeoutError if fault == "stalled" else KVRedisConnectionError):
            call()
    warnings = kvredis_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert buffer.keyspace.entry(entry[0]).queue in warnings[0]
    assert ("timeout" if fault == "stalled" else "error") in warnings[0]
