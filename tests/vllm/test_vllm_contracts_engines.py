"""vLLM's contracts for a shared KV store, with real ``vllm serve`` engines (CPU build): two ``kv_both``
instances in reuse mode sharing a namespace, started as a user would (no ``PROMETHEUS_MULTIPROC_DIR``), in
vLLM's dev mode (``VLLM_SERVER_DEV_MODE=1``, for ``POST /reset_prefix_cache``); the first publishes KV events
over ZMQ (``--kv-events-config``).

- A reset (``/reset_prefix_cache?reset_external=true``) on one: neither engine loads anything stored before
  it, and each answers as it does computing alone (temperature 0, under a fresh ``cache_salt``).
- ``/metrics`` has the ``vllm:kvredis_*`` latency histograms, ``vllm:prompt_tokens_cached_by_source`` names
  the tier, and the "KV Transfer metrics" line says Avg/P90 and MB/s.
- A ZMQ subscriber, decoding vLLM's ``KVEventBatch`` with msgspec as a router does, receives the blocks the
  first stored in Redis and their removal by the reset.
"""

from __future__ import annotations

import os
import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.version", reason="needs vLLM's CPU build (run with the vLLM environment's python)")

import requests
from conftest import BLOCK_SIZE
from engine_servers import Server, kv_transfer_config, prompt_of, start_redis, start_server, wait_ready
from redis_servers import free_port
from test_shared_cache import COUNTERS_BOUND_S, MAX_MODEL_LEN, START_TIMEOUT_S, Pair, settled

from kvredis.store.generation import generation_key


class Subscriber:
    """A router's end of vLLM's KV events: a ZMQ SUB socket decoding each ``KVEventBatch`` with msgspec."""

    def __init__(self, port: int) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.events: list[Any] = []
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.connect(f"tcp://127.0.0.1:{port}")
        self._socket.setsockopt_string(zmq.SUBSCRIBE, "")
        self._socket.setsockopt(zmq.RCVTIMEO, 200)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                _topic, _seq, payload = self._socket.recv_multipart()
            except zmq.Again:
                continue
            try:
                self.events.extend(self._decoder.decode(payload).events)
            except Exception as exc:  # kept, so that a test says what it could not decode
                self.events.append(exc)

    def redis_events(self, kind: str) -> list[Any]:
        return [e for e in list(self.events)
                if type(e).__name__ == kind and getattr(e, "medium", None) == "REDIS"]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)


@dataclass
class Engines(Pair):
    subscriber: Subscriber


@pytest.fixture(scope="module")
def engines(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    folder = tmp_path_factory.mktemp("contracts")
    redis_server = start_redis()
    namespace = "t-contracts-" + uuid.uuid4().hex[:10]
    routine = ["--enable-prefix-caching", "--max-num-batched-tokens", "64"]
    config = kv_transfer_config("kv_both", redis_server.url, namespace, reuse=True)
    events_port = free_port()
    events = ('{"enable_kv_cache_events": true, "publisher": "zmq", '
              f'"endpoint": "tcp://*:{events_port}"}}')
    # As a user starts it: the kvredis_* histograms of vLLM's own channel need no multiprocess directory.
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    first = start_server("both-1", tiny_model, folder, config, serve=True, max_model_len=MAX_MODEL_LEN,
                         extra_args=[*routine, "--kv-events-config", events], env=env)
    second = start_server("both-2", tiny_model, folder, config, serve=True, max_model_len=MAX_MODEL_LEN,
                          extra_args=routine, env=env)
    subscriber = Subscriber(events_port)
    try:
        wait_ready([first, second], START_TIMEOUT_S)
        yield Engines(first, second, redis_server, namespace, subscriber)
    finally:
        subscriber.close()
        for engine in (first, second):
            engine.stop()
        redis_server.__exit__(None, None, None)


def alone(server: Server, prompt: list[int]) -> list[int]:
    """The engine's answer computing the prompt itself (a fresh salt: nothing cached is that salt's)."""
    answer = server.complete(prompt, cache_salt=uuid.uuid4().hex)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    return answer["choices"][0]["token_ids"]


def served(server: Server, prompt: list[int]) -> tuple[dict[str, Any], dict[str, int]]:
    """The engine's answer to the prompt, and its counters' change once the save landed."""
    before = server.counters()
    answer = server.complete(prompt)
    return answer, settled(server, before, {"saved_requests": 1})


def metrics_text(server: Server) -> str:
    return requests.get(f"{server.url}/metrics", timeout=10).text


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a series' samples whose labels include ``labels``."""
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match[1]))
        if all(found.get(key) == value for key, value in labels.items()):
            total += float(match[2])
    return total


def wait_for(condition: Any, timeout_s: float = COUNTERS_BOUND_S, nudge: Server | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not in time"
        if nudge is not None:
            nudge.complete([7], max_tokens=1)  # a step: reports and events travel with steps
        time.sleep(0.2)


def test_after_a_reset_neither_engine_loads_what_was_stored_before_it(engines: Engines) -> None:
    x, y = prompt_of(200, seed=900), prompt_of(200, seed=901)
    want = {(server.name, name): alone(server, prompt) for server in (engines.first, engines.second)
            for name, prompt in (("x", x), ("y", y))}
    served(engines.first, x)  # x stored by the first
    served(engines.second, y)  # y stored by the second
    answer, delta = served(engines.second, x)
    assert delta.get("loaded_tokens") == 199, delta  # the cache works: x loaded whole but its last token
    assert answer["choices"][0]["token_ids"] == want[engines.second.name, "x"]
    stored = len(engines.subscriber.redis_events("BlockStored"))

    reply = requests.post(f"{engines.second.url}/reset_prefix_cache", params={"reset_external": "true"},
                          timeout=60)
    assert reply.status_code == 200 and reply.json() == {"success": True}, reply.text
    client = engines.redis.client()
    try:
        assert int(client.get(generation_key(engines.namespace)) or 0) == 1
    finally:
        client.close()
    # The second (whose own prefix cache was reset with it) loads nothing of x; the first nothing of y.
    for server, name, prompt in ((engines.second, "x", x), (engines.first, "y", y)):
        answer, delta = served(server, prompt)
        assert answer["choices"][0]["token_ids"] == want[server.name, name], server.name
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, server.name
        assert "loaded_tokens" not in delta and "found_tokens" not in delta, (server.name, delta)
    # Stored again since the reset: shared again.
    answer, delta = served(engines.second, y)
    assert delta.get("loaded_tokens") == 199, delta
    assert answer["choices"][0]["token_ids"] == want[engines.second.name, "y"]

    # The router's view: the first published x's blocks, then their removal once it learned of the reset.
    assert stored >= 1, [(type(e).__name__, getattr(e, "medium", None)) for e in engines.subscriber.events]
    wait_for(lambda: engines.subscriber.redis_events("BlockRemoved"), nudge=engines.first)
    (removed,) = engines.subscriber.redis_events("BlockRemoved")
    blocks = 199 // BLOCK_SIZE  # every position but the last is stored: its full blocks
    # x's own event (the salted reference requests were stored too, under their salt's extra keys).
    (x_stored,) = [e for e in engines.subscriber.redis_events("BlockStored")
                   if e.token_ids == x[:blocks * BLOCK_SIZE] and not any(e.extra_keys or ())]
    assert len(x_stored.block_hashes) == blocks and x_stored.locality == "REMOTE"
    assert set(x_stored.block_hashes) <= set(removed.block_hashes)


def test_metrics_and_the_log_line_carry_latency_and_the_hit_source(engines: Engines) -> None:
    """A plain ``vllm serve`` (no multiprocess directory) serves the histograms; its hits are ``host``
    (found in the shared cache); vLLM's periodic line says Avg/P90 and MB/s."""
    prompt = prompt_of(200, seed=910)
    served(engines.first, prompt)
    before = metric(metrics_text(engines.second), "vllm:prompt_tokens_cached_by_source_total", source="host")
    _, delta = served(engines.second, prompt)
    assert delta.get("loaded_tokens") == 199, delta
    text = metrics_text(engines.second)
    assert metric(text, "vllm:prompt_tokens_cached_by_source_total", source="host") - before == 199
    for name in ("vllm:kvredis_load_time_seconds_count", "vllm:kvredis_load_bytes_count",
                 "vllm:kvredis_store_time_seconds_count", "vllm:kvredis_store_bytes_count",
                 "vllm:kvredis_lookup_time_seconds_count"):
        assert metric(text, name) >= 1, name
    assert 'vllm:kvredis_load_time_seconds_bucket{' in text
    assert metric(text, "vllm:kvredis_loaded_tokens_total") >= 199  # the counters keep their names
    # vLLM logs the line every 10 s while it has stats to log.
    wait_for(lambda: "Avg load time (ms)" in engines.second.log_text(), nudge=engines.second)
    (line, *_) = [line for line in engines.second.log_text().splitlines() if "Avg load time (ms)" in line]
    for part in ("KV Transfer metrics:", "P90 load time (ms)=", "Load throughput (MB/s)="):
        assert part in line, line
