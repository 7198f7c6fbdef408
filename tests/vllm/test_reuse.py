"""Redis as a shared prefix cache (issue 23, reuse mode): ``vllm serve`` engines behind ``kvredis proxy``.

Two prefill instances, each behind a proxy of its own, share one decode and one Redis, all with
``reuse``: a prefix one prefill stored is loaded by the other instead of computed (and counted among the
cached tokens of its usage), a conversation whose turns alternate between the instances loads each earlier
turn, tenants under ``cache_salt`` share nothing, nor do a LoRA adapter and the base model, a prefix ends at
an evicted chunk, and an emptied Redis costs only misses. Every answer must be the one the decode engine
computes alone (under a fresh ``cache_salt``: nothing of its prefix cache nor of Redis is that salt's), token
for token; the prefills' counters (``vllm:kvredis_*_total``) say what came from Redis. Prefix caching, a
64-token prefill budget and LoRA (an adapter written here, changing K and V) are on everywhere. Chunks stay
after use (that is the mode); records and holders' sets never do. Three engines, not four, to keep CI's time.
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
    Disaggregated,
    Proxy,
    Server,
    kv_transfer_config,
    prompt_of,
    start_proxy,
    start_redis,
    start_server,
    wait_counters,
    wait_ready,
    write_lora_adapter,
)
from redis_servers import wait_until

from kvredis.config import KVRedisConfig
from kvredis.stack.tinymodel import prompt_text
from kvredis.store.chunk_keys import ChunkPlan

START_TIMEOUT_S = 600.0
MAX_MODEL_LEN = 1024
COUNTERS_BOUND_S = 90.0  # longer than this VM's freezes; a passing test never waits it out
CHUNK = KVRedisConfig().chunk_tokens
ADAPTER = "adapter-a"


@dataclass
class Shared(Disaggregated):
    """``prefill`` and ``other`` (two prefill instances), ``decode``, a proxy for each prefill."""

    other: Server
    proxy: Proxy
    other_proxy: Proxy

    def alone(self, prompt: list[int], model: str | None = None) -> list[int]:
        """The decode engine's own answer: a salt of its own finds nothing cached, locally or in Redis."""
        return self.complete(self.decode, prompt, model, cache_salt=uuid.uuid4().hex)

    def complete(self, where: Server | Proxy, prompt: list[int], model: str | None = None,
                 **extra: Any) -> list[int]:
        """A greedy completion's generated token IDs (the proxy's answer is the decode's); ``model``: the
        base model's name (default) or an adapter's."""
        return list(self.create(where, prompt, model, **extra).choices[0].model_extra["token_ids"])

    def create(self, where: Server | Proxy, prompt: list[int], model: str | None = None, **extra: Any) -> Any:
        """The whole answer (with its usage) of a greedy completion."""
        import openai

        client = openai.OpenAI(base_url=f"{where.url}/v1", api_key="unused", timeout=300.0, max_retries=0)
        return client.completions.create(
            model=model or self.decode.model, prompt=prompt_text(prompt), max_tokens=6, temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True, **extra})

    def assert_only_chunks_left(self) -> None:
        """Chunks stay (reuse); every transfer's record was taken and nothing holds a chunk."""
        wait_until(lambda: not [key for key in self.stored_keys() if b":t:" in key], COUNTERS_BOUND_S,
                   "every transfer record taken")
        keys = self.stored_keys()
        assert keys and all(b":c:" in key and not key.endswith(b":h") for key in keys), keys[:5]


@pytest.fixture(scope="module")
def shared(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    folder = tmp_path_factory.mktemp("reuse")
    redis_server = start_redis()
    namespace = "t-reuse-" + uuid.uuid4().hex[:10]
    adapter = write_lora_adapter(folder / "lora-a", tiny_model, seed=21)
    routine = ["--enable-prefix-caching", "--max-num-batched-tokens", "64", "--enable-lora",
               "--max-lora-rank", "8", "--max-loras", "1", "--lora-modules", f"{ADAPTER}={adapter}"]

    def kv_config(role: str) -> dict[str, Any]:
        return kv_transfer_config(role, redis_server.url, namespace, reuse=True)

    engines = [
        start_server("prefill", tiny_model, folder, kv_config("kv_producer"), serve=True,
                     max_model_len=MAX_MODEL_LEN, extra_args=routine),
        start_server("decode", tiny_model, folder, kv_config("kv_consumer"), serve=True,
                     max_model_len=MAX_MODEL_LEN, extra_args=routine),
        start_server("prefill-2", tiny_model, folder, kv_config("kv_producer"), serve=True,
                     max_model_len=MAX_MODEL_LEN, extra_args=routine),
    ]
    proxies: list[Proxy] = []
    try:
        wait_ready(engines, START_TIMEOUT_S)
        prefill, decode, other = engines
        proxies += [start_proxy(folder, "proxy", prefill.url, decode.url, redis_server.url),
                    start_proxy(folder, "proxy-2", other.url, decode.url, redis_server.url)]
        yield Shared(prefill, decode, redis_server, namespace, other, *proxies)
    finally:
        for process in (*proxies, *engines):
            process.stop()
        redis_server.__exit__(None, None, None)


@pytest.fixture(autouse=True)
def clean_slate(shared: Shared) -> Iterator[None]:
    """Each test starts from an empty store (chunks stay in this mode: a test's must not serve the next)."""
    shared.delete_keys()
    yield
    shared.delete_keys()


def settled(server: Server, before: dict[str, float], expected: dict[str, int]) -> dict[str, int]:
    """``server``'s counters since ``before`` once they reach ``expected`` (or the bound passed), its saves'
    reports drawn out by one-token requests."""
    return wait_counters(server, before, expected, COUNTERS_BOUND_S, nudge=True)


def found(server: Server, before: dict[str, float], tokens: int) -> dict[str, int]:
    """:func:`settled` once its lookups found ``tokens`` and its save is reported."""
    return settled(server, before, {"found_tokens": tokens, "saved_requests": 1})


def test_a_second_prefill_instance_loads_the_prefix_the_first_stored(shared: Shared) -> None:
    common = prompt_of(300, seed=700)
    first, second = common + prompt_of(40, seed=701), common + prompt_of(50, seed=702)
    want = [shared.alone(prompt) for prompt in (first, second)]
    assert shared.complete(shared.proxy, first) == want[0]
    before = shared.other.counters()
    assert shared.complete(shared.other_proxy, second) == want[1]
    stored = 300 // CHUNK * CHUNK  # the common prefix's whole chunks; the next one differs
    delta = found(shared.other, before, stored)
    assert delta.get("found_tokens") == stored and delta.get("loaded_tokens") == stored, delta
    assert delta.get("present_chunks") == stored // CHUNK, delta  # not written again
    assert "load_failures" not in delta and "lookup_errors" not in delta, delta
    shared.assert_only_chunks_left()


def test_a_request_to_the_instance_itself_reports_the_loaded_prefix_as_cached(shared: Shared) -> None:
    """Sent to the second prefill instance directly (no proxy), a prompt whose prefix the first stored:
    its usage counts the prefix loaded from Redis among its cached tokens, as vLLM counts a connector's."""
    common = prompt_of(200, seed=703)
    first, second = common + prompt_of(30, seed=704), common + prompt_of(20, seed=705)
    want = shared.alone(second)
    shared.complete(shared.proxy, first)
    before = shared.other.counters()
    answer = shared.create(shared.other, second)
    assert list(answer.choices[0].model_extra["token_ids"]) == want
    stored = 200 // CHUNK * CHUNK
    assert answer.usage.prompt_tokens_details.cached_tokens == stored
    delta = found(shared.other, before, stored)
    assert delta.get("found_tokens") == stored and delta.get("loaded_tokens") == stored, delta
    shared.assert_only_chunks_left()


def test_a_lora_request_never_hits_the_base_models_chunks(shared: Shared) -> None:
    """The same prompt under the base model and under an adapter (whose weights change K and V): neither
    finds the other's chunks; each finds its own."""
    prompt = prompt_of(230, seed=706)
    want_base, want_adapter = shared.alone(prompt), shared.alone(prompt, ADAPTER)
    assert want_base != want_adapter  # the adapter changes the answer: a hit across them would show
    assert shared.complete(shared.proxy, prompt) == want_base
    before = shared.other.counters()
    assert shared.complete(shared.other_proxy, prompt, ADAPTER) == want_adapter
    delta = settled(shared.other, before, {"saved_requests": 1})
    assert "found_tokens" not in delta and "loaded_tokens" not in delta, delta
    before = shared.prefill.counters()
    assert shared.complete(shared.proxy, prompt, ADAPTER) == want_adapter  # the adapter's own chunks
    stored = len(prompt) - 1
    assert found(shared.prefill, before, stored).get("loaded_tokens") == stored
    shared.assert_only_chunks_left()


def test_a_conversation_alternating_between_instances_loads_each_earlier_turn(shared: Shared) -> None:
    """Turn n on one instance, n+1 on the other: each prefill loads from Redis the earlier turns' chunks it
    does not hold in its own prefix cache (those the other instance stored), and answers as the engine
    alone does."""
    prompt: list[int] = []
    for turn in range(4):
        prompt = prompt + prompt_of(90, seed=710 + turn)
        want = shared.alone(prompt)
        prefill, proxy = ((shared.prefill, shared.proxy) if turn % 2 == 0
                          else (shared.other, shared.other_proxy))
        before = prefill.counters()
        got = shared.complete(proxy, prompt)
        assert got == want, f"turn {turn + 1}"
        delta = settled(prefill, before, {"saved_requests": 1})
        assert "load_failures" not in delta and "lookup_errors" not in delta, (turn + 1, delta)
        if turn:  # the other instance stored the turn before: whole chunks of it beyond this one's own cache
            assert delta.get("loaded_tokens", 0) >= CHUNK, (turn + 1, delta)
        prompt = prompt + prompt_of(6, seed=720 + turn)  # the answer's words (no special tokens)
    shared.assert_only_chunks_left()


def test_tenants_under_cache_salt_share_nothing(shared: Shared) -> None:
    prompt = prompt_of(260, seed=725)
    want = shared.alone(prompt)
    assert shared.complete(shared.proxy, prompt, cache_salt="tenant-a") == want
    before = shared.other.counters()
    assert shared.complete(shared.other_proxy, prompt, cache_salt="tenant-b") == want
    delta = settled(shared.other, before, {"saved_requests": 1})
    assert "found_tokens" not in delta and "loaded_tokens" not in delta, delta
    before = shared.other.counters()
    assert shared.complete(shared.other_proxy, prompt, cache_salt="tenant-a") == want  # its own tenant's
    stored = len(prompt) - 1  # the same prompt: every stored chunk, the short last one too
    assert found(shared.other, before, stored).get("loaded_tokens") == stored
    shared.assert_only_chunks_left()


def test_a_prefix_ends_at_an_evicted_chunk(shared: Shared) -> None:
    prompt = prompt_of(330, seed=730)
    longer = prompt + prompt_of(40, seed=731)
    want = shared.alone(longer)
    shared.complete(shared.proxy, prompt)
    shared.assert_only_chunks_left()
    # The second of the prompt's chunks is evicted: a reader may use the first only.
    keys = shared.stored_keys()
    prefix = keys[0].decode().rsplit(":c:", 1)[0]
    evicted = f"{prefix}:c:{{{ChunkPlan.of(prompt[:-1], CHUNK).digests[1]}}}"
    client = shared.redis.client()
    try:
        assert client.delete(evicted) == 1
    finally:
        client.close()
    before = shared.other.counters()
    assert shared.complete(shared.other_proxy, longer) == want
    delta = found(shared.other, before, CHUNK)
    assert delta.get("found_tokens") == CHUNK and delta.get("loaded_tokens") == CHUNK, delta
    shared.assert_only_chunks_left()


def test_redis_restarted_empty_costs_misses_and_no_error(shared: Shared) -> None:
    prompt = prompt_of(200, seed=740)
    want = shared.alone(prompt)
    assert shared.complete(shared.proxy, prompt) == want
    shared.assert_only_chunks_left()
    shared.redis.restart()  # nothing on disk: it comes back empty
    before = shared.other.counters()
    assert shared.complete(shared.other_proxy, prompt) == want
    delta = settled(shared.other, before, {"saved_requests": 1})
    assert "loaded_tokens" not in delta, delta
    assert shared.complete(shared.proxy, prompt) == want  # stored again by the other instance: loaded
    shared.assert_only_chunks_left()
