"""Data-parallel engines sharing a prefix cache in Redis, no disaggregation: two ``kv_both`` ``vllm serve``
instances in reuse mode, each serving its own clients as behind a load balancer (no proxy).

What one instance computed, the other loads instead of computing: a shared prefix (counted among the cached
tokens of its usage) and the earlier turns of a streamed chat whose turns alternate between the instances.
Every answer must be the one the same instance computes alone (under a fresh ``cache_salt``: nothing of its
prefix cache nor of Redis is that salt's), token for token; the counters (``vllm:kvredis_*_total``) say what
came from Redis. Prefix caching and a 64-token prefill budget are on. Only chunks are left in Redis.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.version", reason="needs vLLM's CPU build (run with the vLLM environment's python)")

from engine_servers import (
    CHAT_TEMPLATE,
    NamespaceKeys,
    Server,
    kv_transfer_config,
    openai_client,
    prompt_of,
    start_redis,
    start_server,
    wait_counters,
    wait_ready,
)
from redis_servers import RedisServer

from kvredis.config import KVRedisConfig
from kvredis.stack.tinymodel import prompt_text
from kvredis.store.chunk_keys import key_kind

START_TIMEOUT_S = 600.0
MAX_MODEL_LEN = 1024
COUNTERS_BOUND_S = 90.0  # longer than this VM's freezes; a passing test never waits it out
CHUNK = KVRedisConfig().chunk_tokens


@dataclass
class Pair(NamespaceKeys):
    """Two kv_both instances on one Redis namespace."""

    first: Server
    second: Server
    redis: RedisServer
    namespace: str

    def client(self, server: Server) -> Any:
        return openai_client(server.url)


@pytest.fixture(scope="module")
def pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    folder = tmp_path_factory.mktemp("shared-cache")
    redis_server = start_redis()
    namespace = "t-shared-" + uuid.uuid4().hex[:10]
    template = folder / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    routine = ["--enable-prefix-caching", "--max-num-batched-tokens", "64", "--chat-template", str(template)]
    config = kv_transfer_config("kv_both", redis_server.url, namespace, reuse=True)
    engines = [start_server(name, tiny_model, folder, config, serve=True, max_model_len=MAX_MODEL_LEN,
                            extra_args=routine) for name in ("both-1", "both-2")]
    try:
        wait_ready(engines, START_TIMEOUT_S)
        yield Pair(*engines, redis_server, namespace)
    finally:
        for engine in engines:
            engine.stop()
        redis_server.__exit__(None, None, None)


@pytest.fixture(autouse=True)
def clean_slate(pair: Pair) -> Iterator[None]:
    """Each test starts from an empty store (chunks stay in this mode: a test's must not serve the next)."""
    pair.delete_keys()
    yield
    pair.delete_keys()


def settled(server: Server, before: dict[str, float], expected: dict[str, int]) -> dict[str, int]:
    """``server``'s counters since ``before`` once they reach ``expected`` (or the bound passed), its saves'
    reports drawn out by one-token requests."""
    return wait_counters(server, before, expected, COUNTERS_BOUND_S, nudge=True)


def test_an_instance_loads_the_prefix_the_other_stored(pair: Pair) -> None:
    common = prompt_of(300, seed=800)
    first, second = common + prompt_of(40, seed=801), common + prompt_of(50, seed=802)
    want = pair.second.complete(second, cache_salt=uuid.uuid4().hex)["choices"][0]["token_ids"]
    before = pair.first.counters()
    pair.first.complete(first)
    settled(pair.first, before, {"saved_requests": 1})
    before = pair.second.counters()
    answer = pair.second.complete(second)
    assert answer["choices"][0]["token_ids"] == want
    stored = 300 // CHUNK * CHUNK  # the common prefix's whole chunks
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == stored
    delta = settled(pair.second, before, {"found_tokens": stored, "saved_requests": 1})
    assert delta.get("found_tokens") == stored and delta.get("loaded_tokens") == stored, delta
    assert delta.get("present_chunks") == stored // CHUNK, delta  # not written again
    assert "load_failures" not in delta and "lookup_errors" not in delta, delta
    assert {key_kind(key.decode()) for key in pair.stored_keys()} == {"chunks"}


def test_a_streamed_chat_alternating_between_instances_loads_each_earlier_turn(pair: Pair) -> None:
    """Turn n on one instance, n+1 on the other, streamed as a chat client does: each turn's instance loads
    from Redis the earlier turns it does not hold itself, and answers as it does alone."""
    messages: list[dict[str, str]] = []
    for turn in range(4):
        messages.append({"role": "user", "content": prompt_text(prompt_of(90, seed=810 + turn))})
        server = (pair.first, pair.second)[turn % 2]
        client = pair.client(server)
        alone = client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=6, temperature=0.0,
            extra_body={"ignore_eos": True, "cache_salt": uuid.uuid4().hex})
        before = server.counters()
        stream = client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=6, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True})
        got = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert got == alone.choices[0].message.content, f"turn {turn + 1}"
        delta = settled(server, before, {"saved_requests": 1})
        assert "load_failures" not in delta and "lookup_errors" not in delta, (turn + 1, delta)
        if turn:  # the other instance stored the turn before: whole chunks of it beyond this one's cache
            assert delta.get("loaded_tokens", 0) >= CHUNK, (turn + 1, delta)
        messages.append({"role": "assistant", "content": got})
    assert {key_kind(key.decode()) for key in pair.stored_keys()} == {"chunks"}
