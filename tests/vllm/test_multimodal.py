"""Requests with images through ``kvredis proxy``: a tiny BLIP-2 written at test time (vision tower,
Q-Former and the tiny Llama, ``kvredis.stack.tinymodel.write_tiny_blip2``), served by ``vllm serve`` engines
and driven with the ``openai`` client's chat completions carrying PNG images as data URIs.

Every image, whatever it shows, becomes the same 40 placeholder tokens at the start of the prompt: two
requests with the same text and different images have the same token IDs, and only vLLM's hash of each image
(which kvredis folds into the key, with the placeholders' positions) keeps their KV apart. Handed the other
image's KV, a decode would answer about the wrong image. A third engine with no connector says what each
image's answer is; every answer must be its answer, token for token. The prefill also stores prompts sent to
it directly (``store_all_prompts``): entries with no announcement, which any request of the same key takes.
"""

from __future__ import annotations

import base64
import io
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("vllm.version", reason="needs vLLM's CPU build (run with the vLLM environment's python)")

import numpy as np
import openai
from engine_servers import (
    Disaggregated,
    Proxy,
    Server,
    kv_transfer_config,
    loaded_tokens,
    prompt_of,
    start_proxy,
    start_redis,
    start_server,
    wait_counters,
    wait_ready,
)
from PIL import Image
from redis_servers import wait_until

from kvredis.config import KVRedisConfig
from kvredis.stack.tinymodel import IMAGE_TOKEN_ID, prompt_text, write_tiny_blip2

START_TIMEOUT_S = 600.0  # three engines on two cores: 1-3 minutes, more when the VM stalls
REQUEST_TIMEOUT_S = 300.0
QUERY_TOKENS = 40  # placeholders per image: one block of 32 and part of the next
TEXT_TOKENS = 30
POP_TIMEOUT_S = 120.0  # engine_servers.TEST_TIMEOUTS: a request that waited for an entry takes this long
# The first test also waits for the engines to start (the module's fixture).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(START_TIMEOUT_S + REQUEST_TIMEOUT_S)]


@dataclass
class Multimodal(Disaggregated):
    """The prefill and decode behind ``proxy``, and ``reference``: the same model with no connector."""

    reference: Server
    proxy: Proxy


@dataclass
class Answer:
    tokens: list[int]
    prompt_tokens: list[int]
    cached_tokens: int
    kv_transfer_params: dict[str, Any] | None
    decode_before: dict[str, float] | None  # the decode's counters just before (None: the reference asked)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Multimodal]:
    folder = tmp_path_factory.mktemp("multimodal")
    model = write_tiny_blip2(folder / "tiny-blip2", query_tokens=QUERY_TOKENS)
    redis_server = start_redis()
    namespace = "t-mm-" + uuid.uuid4().hex[:10]
    routine = ["--enable-prefix-caching"]
    engines = [
        start_server("prefill", model, folder,
                     kv_transfer_config("kv_producer", redis_server.url, namespace, store_all_prompts=True),
                     serve=True, max_model_len=1024, extra_args=routine),
        start_server("decode", model, folder, kv_transfer_config("kv_consumer", redis_server.url, namespace),
                     serve=True, max_model_len=1024, extra_args=routine),
        start_server("reference", model, folder, None, serve=True, max_model_len=1024,
                     extra_args=routine),
    ]
    proxies: list[Proxy] = []
    try:
        wait_ready(engines, START_TIMEOUT_S)
        prefill, decode, reference = engines
        proxies.append(start_proxy(folder, "proxy", prefill.url, decode.url, redis_server.url))
        yield Multimodal(prefill, decode, redis_server, namespace, reference, proxies[0])
    finally:
        for process in (*proxies, *engines):
            process.stop()
        redis_server.__exit__(None, None, None)


@pytest.fixture(autouse=True)
def clean_slate(vlm: Multimodal) -> Iterator[None]:
    """A failed test's keys must not fail the next one."""
    yield
    vlm.delete_keys()


def png(seed: int) -> str:
    """A 40x48 PNG of 4x4 blocks of seeded colours, as a data URI (every image here has that size)."""
    blocks = np.random.default_rng(seed).integers(0, 256, (4, 4, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(blocks.repeat(12, axis=0).repeat(10, axis=1)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def ask(vlm: Multimodal, where: Server | Proxy, image: str, text: str, max_tokens: int = 8,
        **extra: Any) -> Answer:
    """A greedy chat completion about ``image``, through the ``openai`` client."""
    client = openai.OpenAI(base_url=f"{where.url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S,
                           max_retries=0)
    decode_before = vlm.decode.counters() if where is not vlm.reference else None
    created = client.chat.completions.create(
        model=vlm.reference.model, max_tokens=max_tokens, temperature=0.0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                               {"type": "text", "text": text}]}],
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
    details = created.usage.prompt_tokens_details if created.usage else None
    prompt = list((created.model_extra or {})["prompt_token_ids"])
    assert created.usage is not None and created.usage.prompt_tokens == len(prompt)
    return Answer(list(created.choices[0].model_extra["token_ids"]), prompt,
                  int(details.cached_tokens or 0) if details else 0,
                  (created.model_extra or {}).get("kv_transfer_params"), decode_before)


def loaded_whole(answer: Answer) -> bool:
    """The decode, asked without a prefill's kv_transfer_params, computed only the last prompt token (its
    own prefix cache and Redis held the rest)."""
    return answer.cached_tokens == len(answer.prompt_tokens) - 1


def loaded_from_redis(vlm: Multimodal, answer: Answer) -> bool:
    """The decode loaded every prompt token but the last from Redis, by its counters (given a prefill's
    kv_transfer_params, vLLM reports the prefill's prefix-cache hit as the decode's cached tokens)."""
    want = len(answer.prompt_tokens) - 1
    return answer.decode_before is not None and loaded_tokens(vlm.decode, answer.decode_before, want) == want


def keys_are(vlm: Multimodal, expected: list[bytes]) -> None:
    """Wait until the namespace holds exactly ``expected`` (taken entries are deleted as they are read)."""
    wait_until(lambda: vlm.stored_keys() == expected, 90, f"exactly {len(expected)} keys in Redis")


def test_two_images_with_the_same_tokens_each_get_their_own_answer(vlm: Multimodal) -> None:
    """Images A and B, the same text: identical token IDs, different answers; through the proxy each gets
    its own, loaded from Redis (the decode computes only the last prompt token)."""
    text = prompt_text(prompt_of(TEXT_TOKENS, seed=11))
    images = {"a": png(1), "b": png(2)}
    want = {name: ask(vlm, vlm.reference, image, text) for name, image in images.items()}
    assert want["a"].prompt_tokens == want["b"].prompt_tokens, "the two prompts must be the same tokens"
    assert want["a"].prompt_tokens[:QUERY_TOKENS] == [IMAGE_TOKEN_ID] * QUERY_TOKENS
    assert len(want["a"].prompt_tokens) == QUERY_TOKENS + TEXT_TOKENS
    assert want["a"].tokens != want["b"].tokens, "the images must change the answer"
    before = vlm.decode.counters()
    for name in ("a", "b"):
        got = ask(vlm, vlm.proxy, images[name], text)
        assert got.tokens == want[name].tokens, name
        assert loaded_from_redis(vlm, got), (name, vlm.stored_keys(), vlm.decode.log_text()[-3000:])
    delta = wait_counters(vlm.decode, before, {"loaded_requests": 2}, timeout_s=90)
    assert delta.get("loaded_requests") == 2, delta
    assert delta.get("loaded_tokens") == 2 * (QUERY_TOKENS + TEXT_TOKENS - 1), delta
    assert "load_failures" not in delta and "skipped_requests" not in delta, delta
    keys_are(vlm, [])


def test_an_entry_is_found_only_by_a_request_with_its_image(vlm: Multimodal) -> None:
    """Entries stored with no announcement (``store_all_prompts``), found by key alone: the same tokens with
    image C and with image E are two entries; a request with E does not take C's, and a new request with C
    (the same PNG again, so the same hash) does."""
    text = prompt_text(prompt_of(TEXT_TOKENS, seed=12))
    c, e = png(3), png(4)
    want_c, want_e = ask(vlm, vlm.reference, c, text), ask(vlm, vlm.reference, e, text)
    assert want_c.tokens != want_e.tokens
    ask(vlm, vlm.prefill, c, text, max_tokens=1)  # no decode behind it: stored for any request of its key
    chunks = -(-(QUERY_TOKENS + TEXT_TOKENS - 1) // KVRedisConfig().chunk_tokens)  # a prompt's, stored
    chunks_c = vlm.stored_chunks(chunks, timeout_s=90)
    left = vlm.stored_keys()
    before = vlm.decode.counters()
    got = ask(vlm, vlm.decode, e, text)
    assert got.tokens == want_e.tokens and got.cached_tokens == 0, got.cached_tokens
    assert vlm.stored_keys() == left, "C's entry was touched by a request with image E"
    # Now E's prompt is stored too: the same tokens, two keys.
    ask(vlm, vlm.prefill, e, text, max_tokens=1)
    queues = vlm.stored_chunks(2 * chunks, timeout_s=90)
    assert len(queues) == 2 * chunks and set(chunks_c) <= set(queues), queues
    got = ask(vlm, vlm.decode, c, text)
    assert got.tokens == want_c.tokens and loaded_whole(got), got.cached_tokens
    # E's first two blocks are in the decode's own prefix cache (it computed E above); the rest is loaded.
    got = ask(vlm, vlm.decode, e, text)
    assert got.tokens == want_e.tokens and loaded_whole(got), got.cached_tokens
    delta = wait_counters(vlm.decode, before, {"loaded_requests": 2}, timeout_s=90)
    assert delta.get("loaded_requests") == 2, delta
    assert delta.get("loaded_tokens") == (QUERY_TOKENS + TEXT_TOKENS - 1) * 2 - 64, delta
    assert "load_failures" not in delta, delta
    keys_are(vlm, [])


def test_an_announcement_for_one_image_is_never_loaded_for_another(vlm: Multimodal) -> None:
    """F's client went away after its prefill: its announced entry stays. G through the proxy loads its own
    entry; H handed F's announcement (a proxy mixing requests up) is computed at once; F's own second request
    (the same image) takes F's entry."""
    text = prompt_text(prompt_of(TEXT_TOKENS, seed=13))
    f, g, h = png(5), png(6), png(7)
    want = {name: ask(vlm, vlm.reference, image, text) for name, image in (("f", f), ("g", g), ("h", h))}
    assert len({tuple(answer.tokens) for answer in want.values()}) == 3
    abandoned = ask(vlm, vlm.prefill, f, text, max_tokens=1,
                    kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    params_f = abandoned.kv_transfer_params
    assert isinstance(params_f, dict), abandoned
    vlm.transfer_records(1, timeout_s=90)
    left = vlm.stored_keys()
    before = vlm.decode.counters()
    got = ask(vlm, vlm.proxy, g, text)
    assert got.tokens == want["g"].tokens and loaded_from_redis(vlm, got)
    keys_are(vlm, left)
    started = time.monotonic()
    got = ask(vlm, vlm.decode, h, text, kv_transfer_params=params_f)
    assert time.monotonic() - started < POP_TIMEOUT_S, "a request waited for another image's entry"
    assert got.tokens == want["h"].tokens
    assert vlm.stored_keys() == left, "F's entry was touched by a request with image H"
    wait_until(lambda: "names a transfer written for another" in vlm.decode.log_text(), 30, "the warning")
    got = ask(vlm, vlm.decode, f, text, kv_transfer_params=params_f)
    assert got.tokens == want["f"].tokens and loaded_from_redis(vlm, got)
    delta = wait_counters(vlm.decode, before, {"loaded_requests": 2, "skipped_requests": 1}, timeout_s=90)
    assert delta.get("loaded_requests") == 2 and delta.get("skipped_requests") == 1, delta
    assert "load_failures" not in delta, delta
    keys_are(vlm, [])


def test_images_vllm_names_by_a_counter_are_never_moved(vlm: Multimodal, tmp_path_factory) -> None:
    """With prefix caching and the multimodal processor cache both off, vLLM does not hash images: it names
    each one by a per-process counter, so the first image a prefill sees and the first a decode sees share
    a name whatever they show. Keyed by that name, image A's entry would be loaded for image B (the same
    tokens). Such engines neither save nor load requests with images; text requests still move."""
    folder = tmp_path_factory.mktemp("multimodal-unhashed")
    model = vlm.reference.model
    namespace = vlm.namespace + "-unhashed"
    unhashed = ["--no-enable-prefix-caching", "--mm-processor-cache-gb", "0"]
    engines = [
        start_server("prefill-unhashed", model, folder,
                     kv_transfer_config("kv_producer", vlm.redis.url, namespace, store_all_prompts=True),
                     serve=True, max_model_len=1024, extra_args=unhashed),
        start_server("decode-unhashed", model, folder,
                     kv_transfer_config("kv_consumer", vlm.redis.url, namespace), serve=True,
                     max_model_len=1024, extra_args=unhashed),
    ]
    pair = Disaggregated(engines[0], engines[1], vlm.redis, namespace)
    try:
        wait_ready(engines, START_TIMEOUT_S)
        text = prompt_of(TEXT_TOKENS, seed=14)
        a, b = png(8), png(9)
        want_b = ask(vlm, vlm.reference, b, prompt_text(text))
        assert want_b.tokens != ask(vlm, vlm.reference, a, prompt_text(text)).tokens
        before = {server.name: server.counters() for server in engines}
        # Each engine's first image: the same counter name on both.
        ask(vlm, pair.prefill, a, prompt_text(text), max_tokens=1)
        got = ask(vlm, pair.decode, b, prompt_text(text))
        assert got.tokens == want_b.tokens, "image B was answered with image A's KV"
        assert got.cached_tokens == 0, got.cached_tokens
        for server in engines:
            delta = wait_counters(server, before[server.name], {"skipped_requests": 1}, timeout_s=90)
            assert delta.get("skipped_requests") == 1, (server.name, delta)
            assert "loaded_requests" not in delta and "saved_requests" not in delta, (server.name, delta)
            assert "multimodal processor cache" in server.log_text(), server.name
        assert pair.stored_keys() == []
        # Text alone still moves between such engines.
        prompt = prompt_of(70, seed=15)
        pair.prefill.complete(prompt, max_tokens=1)
        assert pair.stored_chunks(1, timeout_s=90)
        answer = pair.decode.complete(prompt)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
        wait_until(lambda: pair.stored_keys() == [], 90, "the text entry taken")
    finally:
        pair.delete_keys()
        for server in engines:
            server.stop()
