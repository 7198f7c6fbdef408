"""Real vLLM engines: a prefill engine (kv_producer) and a decode engine (kv_consumer), separate processes
sharing one real Redis, checked against a third engine with no connector.

Each request goes as kvredis's proxy sends it: to prefill with ``max_tokens=1`` and ``kv_transfer_params``,
then the original request, with the ``kv_transfer_params`` of the prefill answer, to decode. The Redis
is a ``redis-server`` this module starts (tests/redis_servers.py), so that one test can stop it; nothing
touches the machine's shared Redis. Engines start once for the module (40-90 s on 2 cores).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

pytest.importorskip("vllm.version", reason="needs vLLM's CPU build (run with the vLLM environment's python)")

import torch
from conftest import BLOCK_SIZE
from engine_servers import (
    DECODE_TOKENS,
    REQUEST_TIMEOUT_S,
    TEST_TIMEOUTS,
    Disaggregated,
    Server,
    cached_tokens,
    counter_delta,
    kv_transfer_config,
    loaded_tokens,
    prompt_of,
    start_redis,
    start_server,
    tokens_of,
    wait_counters,
    wait_ready,
)
from redis_servers import wait_until

from kvredis.config import KVRedisConfig
from kvredis.stack.tinymodel import prompt_text
from kvredis.store import codec

START_TIMEOUT_S = 300.0
CHUNK_TOKENS = KVRedisConfig().chunk_tokens  # the default, a multiple of the engines' block size
LENGTHS = [5, 20, 31, 32, 33, 64, 65, 100, 257, 513, 1000, 1500]
BLOCK_PAGES_BYTES = 2 * (2 * 2 * BLOCK_SIZE * 64 * 4)  # a block's pages in the tiny Llama's 2 layers (K and V
# of 2 KV heads of 64, float32): kvredis.stack.tinymodel's defaults
"""Prompt lengths: shorter than a block (5, 20, 31), whole blocks (32, 64), k*32+1 (33, 65, 257, 513),
~1000 tokens and more."""


@dataclass
class Deployment(Disaggregated):
    reference: Server  # the same model with no connector


@pytest.fixture(scope="module")
def deployment(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    folder = tmp_path_factory.mktemp("engines")
    server = start_redis()
    namespace = "t-engine-" + uuid.uuid4().hex[:10]

    def kv_config(role: str) -> dict[str, Any]:
        return kv_transfer_config(role, server.url, namespace)

    # vLLM's CPU default, a worker process beside each engine core, as plain `vllm serve` runs on a CPU: the
    # connector's scheduler and worker halves in two processes (the other engine tests run one process).
    servers = [start_server("prefill", tiny_model, folder, kv_config("kv_producer"), worker_process=True),
               start_server("decode", tiny_model, folder, kv_config("kv_consumer"), worker_process=True),
               start_server("reference", tiny_model, folder, None)]
    try:
        wait_ready(servers, START_TIMEOUT_S)
        prefill, decode, reference = servers
        yield Deployment(prefill, decode, server, namespace, reference)
    finally:
        for engine in servers:
            engine.stop()
        server.__exit__(None, None, None)


@pytest.fixture(autouse=True)
def no_leftovers(deployment: Deployment) -> Iterator[None]:
    """Each test checks it leaves no key; this keeps one failure from cascading into the next tests."""
    yield
    deployment.delete_keys()


def reference_answers(deployment: Deployment, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """The engine without connector's answers, all at once (engines idling after work spin their cores
    for about a second, so alternating between three engines on two cores would crawl)."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(deployment.reference.complete, prompts))


def diagnosis(deployment: Deployment, prefill_before: dict[str, float]) -> str:
    """What tells a late entry from a lost one: the prefill's counts, the keys left, kvredis's log lines."""
    time.sleep(2.0)  # a late write lands, and the next stats report carries it
    deployment.prefill.complete([7], max_tokens=1)
    saved = counter_delta(prefill_before, deployment.prefill.counters())
    lines = [f"prefill counters since the test began: {saved}", f"keys in Redis: {deployment.stored_keys()}"]
    for server in (deployment.prefill, deployment.decode):
        said = [line for line in server.log_text().splitlines() if "request " in line and "KV" in line]
        lines.append(f"{server.name} log: {said[-5:]}")
    return "\n".join(lines)


# -- the decode output is the same, and its KV came from Redis ---------------------------------------


def test_decode_matches_an_engine_without_connector_and_loads_every_prompt(deployment: Deployment) -> None:
    decode_before, prefill_before = deployment.decode.counters(), deployment.prefill.counters()
    prompts = [prompt_of(length, seed=length) for length in LENGTHS]
    references = reference_answers(deployment, prompts)
    for prompt, expected in zip(prompts, references, strict=True):
        params = deployment.prefill_params(prompt)
        seen = deployment.decode.counters()
        decoded = deployment.decode.complete(prompt, params=params)
        assert tokens_of(decoded) == tokens_of(expected), f"{len(prompt)} tokens"
        assert len(tokens_of(decoded)) == DECODE_TOKENS
        assert loaded_tokens(deployment.decode, seen, len(prompt) - 1) == len(prompt) - 1, \
            f"{len(prompt)} tokens: KV not loaded\n{diagnosis(deployment, prefill_before)}"
        # vLLM's remote-prefill accounting: the decode reports the prefill's prefix-cache hit (none here).
        assert cached_tokens(decoded) == 0 and cached_tokens(expected) == 0
    loaded = sum(len(p) - 1 for p in prompts)
    decode_delta = wait_counters(deployment.decode, decode_before,
                                 {"loaded_requests": len(prompts), "loaded_tokens": loaded})
    deployment.prefill.complete([7], max_tokens=1)  # one more engine step reports the last save
    chunks = sum(-(-(len(p) - 1) // CHUNK_TOKENS) for p in prompts)  # the last token's KV is not stored
    prefill_delta = wait_counters(deployment.prefill, prefill_before,
                                  {"saved_requests": len(prompts), "written_chunks": chunks})
    # Distinct prompts, none in the decode's prefix cache: it read every chunk the prefill wrote, no more.
    written = prefill_delta.get("written_bytes", 0)
    assert decode_delta == {"loaded_requests": len(prompts), "loaded_tokens": loaded, "loaded_bytes": written}
    # Copied out of the prefill's cache: every block's pages of every stored position (nothing was in Redis).
    copied = sum(-(-(len(p) - 1) // BLOCK_SIZE) for p in prompts) * BLOCK_PAGES_BYTES
    assert prefill_delta == {"saved_requests": len(prompts), "saved_tokens": loaded + len(prompts),
                             "written_chunks": chunks, "written_bytes": written, "copied_bytes": copied}
    assert written > 0
    assert deployment.stored_keys() == []


def test_concurrent_requests_are_batched_and_all_loaded(deployment: Deployment) -> None:
    """Eight prefills at once, then eight decodes at once: loads overlap and land in a shared batch."""
    prompts = [prompt_of(length, seed=1000 + length) for length in (40, 90, 128, 129, 200, 333, 480, 700)]
    before = deployment.decode.counters()
    expected = reference_answers(deployment, prompts)
    with ThreadPoolExecutor(len(prompts)) as pool:
        params = list(pool.map(deployment.prefill_params, prompts))
        decoded = list(pool.map(lambda pair: deployment.decode.complete(pair[0], params=pair[1]),
                                zip(prompts, params, strict=True)))
    for prompt, got, want in zip(prompts, decoded, expected, strict=True):
        assert tokens_of(got) == tokens_of(want), f"{len(prompt)} tokens"
    loaded = sum(len(prompt) - 1 for prompt in prompts)
    delta = wait_counters(deployment.decode, before,
                          {"loaded_requests": len(prompts), "loaded_tokens": loaded})
    assert delta.get("loaded_requests") == len(prompts) and "load_failures" not in delta
    assert delta.get("loaded_tokens") == loaded
    assert deployment.stored_keys() == []


def test_the_prefill_writes_while_a_decode_waits_for_its_entry(deployment: Deployment) -> None:
    """A decode waiting for an entry steps without pause. The prefill keeps computing and writing meanwhile:
    with both engines' workers pinned to the same core (vLLM's default on one machine), the waiting decode
    kept the prefill from running until it gave up, so every entry written then came too late."""
    held, other = prompt_of(300, seed=82), prompt_of(513, seed=83)
    expected = [tokens_of(answer) for answer in reference_answers(deployment, [held, other])]
    client = deployment.redis.client()
    try:
        held_params = deployment.prefill_params(held)
        (queue,) = deployment.transfer_records()
        client.rename(queue, queue + ":late")  # the transfer is "still being written": the decode waits

        def decode_waiting() -> bool:
            return any(c.get("cmd") == "blpop" and "b" in c.get("flags", "") for c in client.client_list())

        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(deployment.decode.complete, held, params=held_params)
            wait_until(decode_waiting, START_TIMEOUT_S, "the decode to wait for the entry set aside")
            other_params = deployment.prefill_params(other)
            deployment.transfer_records(timeout_s=TEST_TIMEOUTS["pop_timeout_s"])  # the held one is renamed
            # Written while the decode still waits: it has not given up on the first entry.
            assert decode_waiting() and not waiting.done()
            seen = deployment.decode.counters()
            client.rename(queue + ":late", queue)  # the write lands; the waiting decode takes it
            decoded = waiting.result(timeout=REQUEST_TIMEOUT_S)
        assert tokens_of(decoded) == expected[0]
        assert loaded_tokens(deployment.decode, seen, len(held) - 1) == len(held) - 1
        seen = deployment.decode.counters()
        decoded = deployment.decode.complete(other, params=other_params)
        assert tokens_of(decoded) == expected[1]
        assert loaded_tokens(deployment.decode, seen, len(other) - 1) == len(other) - 1
    finally:
        client.close()
    assert deployment.stored_keys() == []


# -- vLLM's own P/D protocol ------------------------------------------------------------------------


def test_a_decode_reports_its_prefills_cache_hit_as_vllm_does(deployment: Deployment) -> None:
    """The prefill's kv_transfer_params say do_remote_prefill, so vLLM adds the prefill's prefix-cache hit
    (remote_prefill_cached_tokens) and the decode reports that hit as its cached tokens, as with vLLM's own
    connectors. The decode still loads only what its own prefix cache lacks."""
    shared = prompt_of(160, seed=90)
    first, second = shared + prompt_of(20, seed=91), shared + prompt_of(30, seed=92)
    expected = tokens_of(reference_answers(deployment, [second])[0])
    deployment.decode.complete(first, params=deployment.prefill_params(first))
    params = deployment.prefill_params(second)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    hit = params["remote_prefill_cached_tokens"]  # the prefill computed ``first`` just before
    assert 0 < hit <= len(shared) and hit % 16 == 0, params
    seen = deployment.decode.counters()
    decoded = deployment.decode.complete(second, params=params)
    assert tokens_of(decoded) == expected
    assert cached_tokens(decoded) == hit
    # The decode's own cache holds the same blocks of ``shared``: it loads the rest of the prompt, no more.
    assert loaded_tokens(deployment.decode, seen, len(second) - 1 - hit) == len(second) - 1 - hit
    assert deployment.stored_keys() == []


def test_a_request_the_decodes_serving_layer_rejects_releases_its_transfer(deployment: Deployment) -> None:
    """vLLM's clean-up when a decode's serving layer rejects a request that carries a prefill's
    kv_transfer_params (here: more tokens asked for than the model's length): the request never reaches the
    engine; vLLM adds a one-token stand-in with those params, aborted at once, and the connector releases
    the transfer. Nothing waits for its TTL, and the engine serves on."""
    prompt = prompt_of(150, seed=94)
    (expected,) = reference_answers(deployment, [prompt])
    before = deployment.decode.counters()
    params = deployment.prefill_params(prompt)
    assert deployment.transfer_records()  # written
    body = {"model": deployment.decode.model, "prompt": prompt_text(prompt), "max_tokens": 1_000_000,
            "temperature": 0.0, "kv_transfer_params": params}
    reply = requests.post(f"{deployment.decode.url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    assert reply.status_code == 400, reply.text[:500]
    wait_until(lambda: deployment.stored_keys() == [], 60, "the rejected request's transfer to be released")
    # The same prompt, prefilled again and sent right, is served from Redis. (The scheduler's count of the
    # release is published with the next engine step: this request's.)
    params = deployment.prefill_params(prompt)
    decoded = deployment.decode.complete(prompt, params=params)
    assert tokens_of(decoded) == tokens_of(expected)
    expected_counts = {"discarded_entries": 1, "loaded_requests": 1, "loaded_tokens": len(prompt) - 1}
    delta = wait_counters(deployment.decode, before, expected_counts)
    assert delta.pop("loaded_bytes") > 0
    assert delta == expected_counts, delta
    assert deployment.stored_keys() == []


# -- the loaded KV is really used ------------------------------------------------------------------


def _rewrite_chunks(deployment: Deployment, change: Any, first_only: bool = False) -> None:
    """Replace the chunks of the only transfer in Redis (or its first), keeping their TTL."""
    (record,) = deployment.transfer_records()
    keys = deployment.transfer_chunks(record)
    client = deployment.redis.client()
    try:
        for key in keys[:1] if first_only else keys:
            client.set(key, change(client.get(key)), keepttl=True)
    finally:
        client.close()


def test_a_corrupted_entry_is_rejected_and_the_prompt_recomputed(deployment: Deployment) -> None:
    """One flipped bit in the stored pages: the CRC rejects the entry and the decode engine recomputes."""
    prompt = prompt_of(100, seed=77)
    (expected,) = reference_answers(deployment, [prompt])
    before = deployment.decode.counters()
    params = deployment.prefill_params(prompt)
    deployment.transfer_records()

    def flip(chunk: bytes) -> bytes:
        header = codec.read_header(chunk, max_payload_bytes=1 << 30)
        changed = bytearray(chunk)
        changed[header.payload_offset + header.payload_nbytes // 2] ^= 0x01
        return bytes(changed)

    _rewrite_chunks(deployment, flip, first_only=True)
    decoded = deployment.decode.complete(prompt, params=params)
    assert tokens_of(decoded) == tokens_of(expected)
    warning = (rf"request {re.escape(decoded['id'])}-\S*: KV of 99 tokens not loaded from Redis "
               r"\(its chunks end at position 0 \(corrupt\)\)")
    deadline = time.monotonic() + 10
    while not re.search(warning, deployment.decode.log_text()):
        assert time.monotonic() < deadline, deployment.decode.log_tail()
        time.sleep(0.1)
    delta = wait_counters(deployment.decode, before, {"load_failures": 1})
    assert delta == {"load_failures": 1, "failed_tokens": 99}
    assert deployment.stored_keys() == []


def test_a_consistently_altered_entry_changes_the_output(deployment: Deployment) -> None:
    """Pages replaced by other values, re-encoded with valid checksums: decode uses them, so its output
    differs from the reference. (With the true pages it is equal: the first test.)"""
    prompt = prompt_of(100, seed=78)
    expected = tokens_of(reference_answers(deployment, [prompt])[0])
    before = deployment.decode.counters()
    params = deployment.prefill_params(prompt)
    deployment.transfer_records()

    def alter(chunk: bytes) -> bytes:
        tensors, meta = codec.decode(chunk, max_payload_bytes=1 << 30)
        pages = tensors[1]
        assert pages is not None
        generator = torch.Generator().manual_seed(0)
        tensors[1] = torch.randn(pages.shape, generator=generator, dtype=pages.dtype) * pages.std() * 4
        return codec.encode(tensors, meta, checksum=True).to_bytes()

    _rewrite_chunks(deployment, alter)
    decoded = deployment.decode.complete(prompt, params=params)
    assert tokens_of(decoded) != expected  # loaded (the counters below) and used
    delta = wait_counters(deployment.decode, before, {"loaded_requests": 1})
    assert delta.pop("loaded_bytes") > 0
    assert delta == {"loaded_requests": 1, "loaded_tokens": 99}
    assert deployment.stored_keys() == []


# -- Redis down ------------------------------------------------------------------------------------


def test_with_redis_stopped_decode_recomputes_and_warns(deployment: Deployment) -> None:
    prompt, other, after = prompt_of(150, seed=79), prompt_of(60, seed=80), prompt_of(120, seed=81)
    expected = [tokens_of(answer) for answer in reference_answers(deployment, [prompt, other, after])]
    params = deployment.prefill_params(prompt)
    deployment.transfer_records()
    before = deployment.decode.counters()
    deployment.redis.stop()
    try:
        decoded = deployment.decode.complete(prompt, params=params)
        assert tokens_of(decoded) == expected[0]
        request_id = decoded["id"]  # vLLM's internal id is this, a dash and a suffix
        deadline = time.monotonic() + 10
        while not re.search(rf"request {re.escape(request_id)}-\S*: KV of 149 tokens not loaded from Redis",
                            deployment.decode.log_text()):
            assert time.monotonic() < deadline, deployment.decode.log_tail()
            time.sleep(0.1)
        # Not announced: the scheduler's own lookup fails, fast, and the prompt is computed.
        started = time.monotonic()
        answer = deployment.decode.complete(other)
        assert time.monotonic() - started < 5.0
        assert tokens_of(answer) == expected[1]
        delta = wait_counters(deployment.decode, before, {"load_failures": 1, "lookup_errors": 1})
        assert delta == {"load_failures": 1, "failed_tokens": 149, "lookup_errors": 1}
    finally:
        deployment.redis.start()  # empty: what the stopped server held is gone
    # Both engines reconnect by themselves once Redis is back.
    params = deployment.prefill_params(after)
    seen = deployment.decode.counters()
    decoded = deployment.decode.complete(after, params=params)
    assert loaded_tokens(deployment.decode, seen, len(after) - 1) == len(after) - 1
    assert tokens_of(decoded) == expected[2]
    assert deployment.stored_keys() == []
