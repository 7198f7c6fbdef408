"""Tests of the disaggregation proxy against stub prefill and decode servers on loopback ports."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

aiohttp = pytest.importorskip("aiohttp")
import torch  # noqa: E402
from aiohttp import web  # noqa: E402

from kvredis.config import KVRedisConfig  # noqa: E402
from kvredis.errors import ConfigError  # noqa: E402
from kvredis.stack.proxy import ProxyConfig, start_proxy  # noqa: E402
from kvredis.store.announcement import TRANSFER_PARAM, Announcement  # noqa: E402
from kvredis.store.keys import new_entry_id, prompt_digest  # noqa: E402
from kvredis.store.transfer import Transfers  # noqa: E402
from kvredis.v0.buffer import RedisLookupBuffer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
# Upper bound on any one scenario, so a proxy bug shows up as a failure rather than a hung test run.
SCENARIO_BOUND_S = 5.0
PREFILL_KV_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "engine-p",
    "remote_block_ids": [3, 4],
}

T = TypeVar("T")


def run(scenario: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(scenario, SCENARIO_BOUND_S))


@dataclass
class Received:
    upstream: str
    path: str
    body: Any
    headers: Mapping[str, str]


@dataclass
class Stub:
    """An OpenAI-compatible upstream that records what it receives and answers as the test sets it up to."""

    name: str
    journal: list[Received]
    url: str = ""
    status: int = 200
    kv_params: dict[str, Any] | None = field(default_factory=lambda: dict(PREFILL_KV_PARAMS))
    hang: bool = False
    stream_chunks: int = 3
    # When set, a stream waits for it after its first chunk: the test sets it once it has seen that chunk.
    gate: asyncio.Event | None = None
    gate_timed_out: bool = False
    die_mid_stream: bool = False
    received: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completion)
        app.router.add_post("/v1/chat/completions", self.completion)
        app.router.add_get("/v1/models", self.models)
        return app

    async def models(self, request: web.Request) -> web.Response:
        self.journal.append(Received(self.name, request.path, None, request.headers.copy()))
        return web.json_response({"object": "list", "data": [{"id": "stub-model", "owned_by": self.name}]})

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.journal.append(Received(self.name, request.path, body, request.headers.copy()))
        self.received.set()
        if self.hang:
            await self.release.wait()
            if request.transport is None or request.transport.is_closing():
                # The proxy gave up on this request already; answering would only log a write error.
                return web.Response(status=499)
        if self.status != 200:
            return web.json_response({"error": {"message": f"{self.name} refused"}}, status=self.status)
        if body.get("stream") is True:
            return await self.stream(request)
        answer: dict[str, Any] = {"object": "text_completion", "choices": [{"text": f"from {self.name}"}]}
        if self.kv_params is not None:
            answer["kv_transfer_params"] = self.kv_params
        return web.json_response(answer)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index in range(self.stream_chunks):
            await response.write(f"data: {json.dumps({'n': index, 'from': self.name})}\n\n".encode())
            if index == 0 and self.die_mid_stream:
                assert request.transport is not None
                request.transport.abort()
                return response
            if index == 0 and self.gate is not None:
                try:
                    await asyncio.wait_for(self.gate.wait(), 2.0)
                except TimeoutError:
                    self.gate_timed_out = True
            await asyncio.sleep(0.01)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@dataclass
class Deployment:
    url: str
    client: Any
    prefill: list[Stub]
    decode: list[Stub]
    journal: list[Received]

    def calls(self, role: str) -> list[Received]:
        names = {stub.name for stub in (self.prefill if role == "prefill" else self.decode)}
        return [entry for entry in self.journal if entry.upstream in names]

    async def post(self, path: str, body: Any, **kwargs: Any) -> tuple[int, Any]:
        async with self.client.post(self.url + path, json=body, **kwargs) as response:
            return response.status, await response.json(content_type=None)


@asynccontextmanager
async def deployment(
    prefill: int = 1,
    decode: int = 1,
    *,
    prefill_urls: list[str] | None = None,
    decode_urls: list[str] | None = None,
    **config: Any,
) -> AsyncIterator[Deployment]:
    """Stub prefill and decode servers behind a proxy, plus a client session aimed at the proxy."""
    journal: list[Received] = []
    prefills = [Stub(f"p{index}", journal) for index in range(prefill)]
    decodes = [Stub(f"d{index}", journal, kv_params=None) for index in range(decode)]
    config.setdefault("connect_timeout_s", 1.0)
    config.setdefault("prefill_timeout_s", 2.0)
    config.setdefault("decode_ttfb_timeout_s", 2.0)
    async with AsyncExitStack() as stack:
        for stub in prefills + decodes:
            stub.url = await stack.enter_async_context(serving(stub.app()))
            # Registered after the server, so it runs first and a hanging stub handler lets cleanup finish.
            stack.callback(stub.release.set)
        proxy_config = ProxyConfig(
            prefill_urls=prefill_urls or [stub.url for stub in prefills],
            decode_urls=decode_urls or [stub.url for stub in decodes],
            **config,
        )
        runner, port = await start_proxy(proxy_config)
        stack.push_async_callback(runner.cleanup)
        client = await stack.enter_async_context(aiohttp.ClientSession())
        yield Deployment(f"http://127.0.0.1:{port}", client, prefills, decodes, journal)


@pytest.fixture
def refused_url() -> Iterator[str]:
    """A loopback URL whose port is bound but not listening, so connecting is refused at once."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


COMPLETION = {"model": "m", "prompt": "Hello", "max_tokens": 16, "temperature": 0.5}


def test_prefill_then_decode_with_kv_transfer_params_handed_over() -> None:
    async def scenario() -> None:
        async with deployment() as d:
            body = {**COMPLETION, "min_tokens": 4, "kv_transfer_params": {"client_hint": 7}}
            status, answer = await d.post("/v1/completions", body, headers={"X-Request-Id": "req-42"})
            assert status == 200
            assert answer["choices"][0]["text"] == "from d0"
            assert [entry.upstream for entry in d.journal] == ["p0", "d0"]
            prefill, decode = d.journal
            assert prefill.path == decode.path == "/v1/completions"
            assert prefill.body["max_tokens"] == 1
            assert prefill.body["stream"] is False
            assert "min_tokens" not in prefill.body
            assert prefill.body["kv_transfer_params"] == {
                "client_hint": 7,
                "do_remote_decode": True,
                "do_remote_prefill": False,
            }
            assert decode.body == {**body, "kv_transfer_params": PREFILL_KV_PARAMS}
            assert prefill.headers["X-Request-Id"] == decode.headers["X-Request-Id"] == "req-42"

    run(scenario())


def test_decode_gets_original_body_when_prefill_returns_no_kv_params() -> None:
    async def scenario() -> None:
        async with deployment() as d:
            d.prefill[0].kv_params = None
            status, _ = await d.post("/v1/completions", COMPLETION)
            assert status == 200
            assert d.calls("decode")[0].body == COMPLETION

    run(scenario())


def test_stream_is_relayed_chunk_by_chunk() -> None:
    async def scenario() -> None:
        async with deployment() as d:
            gate = asyncio.Event()
            d.decode[0].gate = gate
            body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
            async with d.client.post(d.url + "/v1/completions", json=body) as response:
                assert response.status == 200
                assert response.headers["Content-Type"].startswith("text/event-stream")
                first = await response.content.readany()
                # The stub has not sent anything past its first chunk until the gate opens.
                assert first.startswith(b"data: ") and b'"n": 0' in first and b"[DONE]" not in first
                gate.set()
                rest = await response.content.read()
            assert not d.decode[0].gate_timed_out
            assert b'"n": 2' in rest and rest.endswith(b"data: [DONE]\n\n")
            prefill, decode = d.journal
            assert prefill.body["stream"] is False and "stream_options" not in prefill.body
            assert decode.body == {**body, "kv_transfer_params": PREFILL_KV_PARAMS}

    run(scenario())


def test_chat_completions_streaming() -> None:
    async def scenario() -> None:
        async with deployment() as d:
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_completion_tokens": 32,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with d.client.post(d.url + "/v1/chat/completions", json=body) as response:
                assert response.status == 200
                text = await response.text()
            assert text.count("data: ") == 4 and text.endswith("data: [DONE]\n\n")
            prefill, decode = d.journal
            assert prefill.path == decode.path == "/v1/chat/completions"
            assert prefill.body["max_tokens"] == 1 and prefill.body["max_completion_tokens"] == 1
            assert prefill.body["stream"] is False and "stream_options" not in prefill.body
            assert decode.body == {**body, "kv_transfer_params": PREFILL_KV_PARAMS}

    run(scenario())


def test_round_robin_over_two_prefill_and_two_decode() -> None:
    async def scenario() -> None:
        async with deployment(prefill=2, decode=2) as d:
            for _ in range(4):
                status, _ = await d.post("/v1/completions", COMPLETION)
                assert status == 200
            assert [entry.upstream for entry in d.calls("prefill")] == ["p0", "p1", "p0", "p1"]
            assert [entry.upstream for entry in d.calls("decode")] == ["d0", "d1", "d0", "d1"]

    run(scenario())


def test_least_outstanding_picks_the_idle_decode() -> None:
    async def scenario() -> None:
        async with deployment(decode=2, policy="least_outstanding") as d:
            busy = d.decode[0]
            busy.hang = True
            held = asyncio.create_task(d.post("/v1/completions", COMPLETION))
            await busy.received.wait()
            async with d.client.get(d.url + "/health") as response:
                health = await response.json()
            assert [entry["in_flight"] for entry in health["decode"]] == [1, 0]
            # Round robin would send the second of these to the busy d0.
            for _ in range(2):
                status, _ = await d.post("/v1/completions", COMPLETION)
                assert status == 200
            assert [entry.upstream for entry in d.calls("decode")] == ["d0", "d1", "d1"]
            busy.release.set()
            assert (await held)[0] == 200

    run(scenario())


def test_prefill_refusing_connection_is_502_and_decode_not_called(refused_url: str) -> None:
    async def scenario() -> None:
        async with deployment(prefill_urls=[refused_url]) as d:
            status, answer = await d.post("/v1/completions", COMPLETION)
            assert status == 502
            assert answer["error"]["type"] == "upstream_error"
            assert answer["error"]["upstream"] == refused_url
            assert answer["error"]["message"].startswith(f"prefill upstream {refused_url} failed: ")
            assert d.journal == []

    run(scenario())


def test_prefill_hanging_is_504_within_the_bound() -> None:
    async def scenario() -> None:
        async with deployment(prefill_timeout_s=0.3) as d:
            d.prefill[0].hang = True
            started = time.monotonic()
            status, answer = await d.post("/v1/completions", COMPLETION)
            elapsed = time.monotonic() - started
            assert status == 504
            assert answer["error"]["upstream"] == d.prefill[0].url
            assert answer["error"]["message"].startswith(f"prefill upstream {d.prefill[0].url} failed: ")
            assert 0.25 <= elapsed < 1.5
            assert d.calls("decode") == []

    run(scenario())


def test_prefill_error_status_is_passed_back_and_decode_not_called() -> None:
    async def scenario() -> None:
        async with deployment() as d:
            d.prefill[0].status = 400
            status, answer = await d.post("/v1/completions", COMPLETION)
            assert status == 400
            assert answer["error"]["upstream"] == d.prefill[0].url
            assert "p0 refused" in answer["error"]["message"]
            assert d.calls("decode") == []

    run(scenario())


def test_decode_refusing_connection_is_502(refused_url: str) -> None:
    async def scenario() -> None:
        async with deployment(decode_urls=[refused_url]) as d:
            status, answer = await d.post("/v1/completions", COMPLETION)
            assert status == 502
            assert answer["error"]["upstream"] == refused_url
            assert answer["error"]["message"].startswith(f"decode upstream {refused_url} failed: ")
            assert len(d.calls("prefill")) == 1

    run(scenario())


@pytest.mark.parametrize("stream", [False, True])
def test_decode_hanging_is_504_within_the_bound(stream: bool) -> None:
    async def scenario() -> None:
        async with deployment(decode_ttfb_timeout_s=0.3) as d:
            d.decode[0].hang = True
            started = time.monotonic()
            status, answer = await d.post("/v1/completions", {**COMPLETION, "stream": stream})
            elapsed = time.monotonic() - started
            assert status == 504
            assert answer["error"]["upstream"] == d.decode[0].url
            assert answer["error"]["message"].startswith(f"decode upstream {d.decode[0].url} failed: ")
            assert 0.25 <= elapsed < 1.5

    run(scenario())


def test_decode_error_status_is_passed_through() -> None:
    async def scenario() -> None:
        async with deployment() as d:
            d.decode[0].status = 503
            status, answer = await d.post("/v1/completions", COMPLETION)
            assert status == 503
            assert answer == {"error": {"message": "d0 refused"}}

    run(scenario())


def test_decode_dying_mid_stream_ends_with_an_sse_error_event() -> None:
    async def scenario() -> None:
        async with deployment() as d:
            d.decode[0].die_mid_stream = True
            async with d.client.post(
                d.url + "/v1/completions", json={**COMPLETION, "stream": True}
            ) as response:
                assert response.status == 200
                text = await response.text()
            events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
            assert json.loads(events[0]) == {"n": 0, "from": "d0"}
            error = json.loads(events[-1])["error"]
            assert error["upstream"] == d.decode[0].url
            assert error["message"].startswith(f"decode upstream {d.decode[0].url} failed: ")
            assert "[DONE]" not in text

    run(scenario())


def test_health_lists_upstreams() -> None:
    async def scenario() -> None:
        async with deployment(prefill=2, decode=1) as d:
            async with d.client.get(d.url + "/health") as response:
                assert response.status == 200
                health = await response.json()
            assert health["status"] == "ok" and health["policy"] == "round_robin"
            assert health["prefill"] == [{"url": stub.url, "in_flight": 0} for stub in d.prefill]
            assert health["decode"] == [{"url": d.decode[0].url, "in_flight": 0}]

    run(scenario())


def test_models_forwarded_to_decode() -> None:
    async def scenario() -> None:
        async with deployment() as d:
            async with d.client.get(d.url + "/v1/models") as response:
                assert response.status == 200
                models = await response.json()
            assert models["data"][0]["owned_by"] == "d0"
            assert [entry.upstream for entry in d.journal] == ["d0"]

    run(scenario())


def test_non_object_body_is_400_without_upstream_calls() -> None:
    async def scenario() -> None:
        async with deployment() as d:
            status, answer = await d.post("/v1/completions", ["not", "an", "object"])
            assert status == 400
            assert answer["error"]["type"] == "invalid_request_error"
            assert d.journal == []

    run(scenario())


@pytest.mark.parametrize(
    ("overrides", "mentions"),
    [
        ({"prefill_urls": []}, "prefill_urls"),
        ({"decode_urls": "http://127.0.0.1:1"}, "decode_urls"),
        ({"decode_urls": ["127.0.0.1:1"]}, "decode_urls"),
        ({"prefill_urls": ["http://a:1", "http://a:1/"]}, "prefill_urls"),
        ({"policy": "random"}, "policy"),
        ({"prefill_timeout_s": 0}, "prefill_timeout_s"),
    ],
)
def test_config_rejects_unusable_settings(overrides: dict[str, Any], mentions: str) -> None:
    settings: dict[str, Any] = {"prefill_urls": ["http://p:1"], "decode_urls": ["http://d:1"], **overrides}
    with pytest.raises(ConfigError, match=mentions):
        ProxyConfig(**settings)


def test_config_normalises_urls() -> None:
    config = ProxyConfig(prefill_urls=["http://p:1/"], decode_urls=["http://d:1", "http://d:2/"])
    assert config.prefill_urls == ("http://p:1",)
    assert config.decode_urls == ("http://d:1", "http://d:2")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_run_proxy_stops_cleanly_on_signal(signum: int) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = (
        "from kvredis.stack.proxy import ProxyConfig, run_proxy\n"
        f"run_proxy(ProxyConfig(['http://127.0.0.1:1'], ['http://127.0.0.1:2']), '127.0.0.1', {port})\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    child = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + SCENARIO_BOUND_S
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                    assert response.status == 200
                break
            except OSError:
                assert child.poll() is None, child.stderr.read() if child.stderr else ""
                assert time.monotonic() < deadline, "proxy did not come up"
                time.sleep(0.05)
        child.send_signal(signum)
        assert child.wait(timeout=SCENARIO_BOUND_S) == 0
        assert child.stderr is not None and b"Traceback" not in child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


# -- entries whose decode never took them ------------------------------------------------------------


@pytest.fixture
def announced_entry(
    real_redis_url: str, namespace: str
) -> Iterator[tuple[RedisLookupBuffer, dict[str, Any]]]:
    """A transfer of three chunks in the real Redis, announced as a prefill announces it; a buffer of its
    namespace."""
    buffer = RedisLookupBuffer(KVRedisConfig.from_env({}, {"url": real_redis_url, "namespace": namespace}))
    transfers = Transfers(buffer.store, buffer.keyspace.prefix, chunk_tokens=16, block_size=16, ttl_ms=60_000,
                          pop_timeout_s=1.0, max_chunk_bytes=1 << 20)
    tokens = list(range(40))
    entry_id = new_entry_id()
    transfers.save(transfers.plan(tokens), torch.randn(2, 3, 2, 16, 8), transfer_id=entry_id)
    shards = (buffer.keyspace.prefix,)
    params = Announcement(entry_id, prompt_digest(tokens), "", None, shards, 40).to_params()
    assert len(_keys_of(buffer)) == 7, "a record, three chunks and their holders"
    yield buffer, params
    buffer.store.delete(_keys_of(buffer))
    buffer.close()


def _keys_of(buffer: RedisLookupBuffer) -> list[str]:
    return list(buffer.store.scan(buffer.keyspace.namespace_pattern))


async def _until_gone(buffer: RedisLookupBuffer) -> None:
    while await asyncio.to_thread(_keys_of, buffer):
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("failure", ["refused", "error status", "no first bytes"])
def test_an_entry_whose_decode_failed_is_deleted(
    announced_entry: tuple[RedisLookupBuffer, dict[str, Any]], refused_url: str, real_redis_url: str,
    failure: str,
) -> None:
    """The decode never got the request (or refused it): the proxy releases the announced transfer, record
    and chunks, instead of leaving it to its TTL."""
    buffer, params = announced_entry

    async def scenario() -> None:
        async with deployment(decode_urls=[refused_url] if failure == "refused" else None,
                              decode_ttfb_timeout_s=0.3,
                              redis_config=KVRedisConfig.from_env({}, {"url": real_redis_url})) as d:
            d.prefill[0].kv_params = params
            if failure == "error status":
                d.decode[0].status = 400
            if failure == "no first bytes":
                d.decode[0].hang = True
            status, _ = await d.post("/v1/completions", COMPLETION)
            assert status == {"refused": 502, "error status": 400, "no first bytes": 504}[failure]
            await _until_gone(buffer)

    run(scenario())


def test_an_entry_whose_decode_answered_is_left_to_the_decode(
    announced_entry: tuple[RedisLookupBuffer, dict[str, Any]], real_redis_url: str,
) -> None:
    """A decode that answered took the request: the entry is its connector's to load or delete."""
    buffer, params = announced_entry
    before = _keys_of(buffer)

    async def scenario() -> None:
        async with deployment(redis_config=KVRedisConfig.from_env({}, {"url": real_redis_url})) as d:
            d.prefill[0].kv_params = params
            status, _ = await d.post("/v1/completions", COMPLETION)
            assert status == 200
            assert d.decode[0].journal[-1].body["kv_transfer_params"] == params

    run(scenario())
    assert sorted(_keys_of(buffer)) == sorted(before)


def test_without_a_redis_a_failed_decode_leaves_the_entry(
    announced_entry: tuple[RedisLookupBuffer, dict[str, Any]], refused_url: str,
) -> None:
    buffer, params = announced_entry
    before = _keys_of(buffer)

    async def scenario() -> None:
        async with deployment(decode_urls=[refused_url]) as d:
            d.prefill[0].kv_params = params
            status, _ = await d.post("/v1/completions", COMPLETION)
            assert status == 502

    run(scenario())
    assert sorted(_keys_of(buffer)) == sorted(before)


@pytest.mark.parametrize("field", ["entry", "shards"])  # the digest names no key the proxy deletes
def test_a_malformed_announcement_deletes_nothing(
    announced_entry: tuple[RedisLookupBuffer, dict[str, Any]], refused_url: str, real_redis_url: str,
    field: str,
) -> None:
    """An entry id or key prefix that could name another key is never used to delete anything."""
    buffer, params = announced_entry
    before = _keys_of(buffer)
    announced = dict(params[TRANSFER_PARAM])
    announced[field] = {"entry": "../x", "shards": ["kvredis:*"]}[field]

    async def scenario() -> None:
        async with deployment(decode_urls=[refused_url],
                              redis_config=KVRedisConfig.from_env({}, {"url": real_redis_url})) as d:
            d.prefill[0].kv_params = {TRANSFER_PARAM: announced}
            status, _ = await d.post("/v1/completions", COMPLETION)
            assert status == 502
            await asyncio.sleep(0.3)

    run(scenario())
    assert sorted(_keys_of(buffer)) == sorted(before)
