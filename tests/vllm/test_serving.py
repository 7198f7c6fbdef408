"""``vllm serve`` engines behind ``kvredis proxy``, driven as operators drive them: the ``openai`` client
(completions and chat, streamed and not) and ``vllm bench serve``.

Every engine runs the configurations vLLM turns on by default or users turn on routinely: prefix caching,
chunked prefill with a 64-token budget (prompts of several chunks), two LoRA adapters written here with
weights that change K and V, and a decode KV space of 40 blocks, small enough for several requests in flight
to preempt each other. A third engine computes alone with the same settings and no connector: every answer
through the proxy must be its answer, token for token, and the decode's counters must show that the KV came
from Redis. A fourth engine, a prefill with another block size, shares the decode through a second proxy.
After every test, no key is left in Redis except those the test left on purpose (and then deleted).
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.version", reason="needs vLLM's CPU build (run with the vLLM environment's python)")

import openai
from engine_servers import (
    CHAT_TEMPLATE,
    Disaggregated,
    Proxy,
    Server,
    completion_tokens,
    counter_delta,
    kv_transfer_config,
    openai_client,
    prompt_of,
    start_proxy,
    start_redis,
    start_server,
    wait_counters,
    wait_ready,
    write_lora_adapter,
)
from prometheus_client.parser import text_string_to_metric_families
from redis_servers import wait_until

from kvredis.config import KVRedisConfig
from kvredis.stack.tinymodel import prompt_text

START_TIMEOUT_S = 600.0  # four engines with LoRA on two cores: 2-4 minutes, more when the VM stalls
DECODE_BLOCKS = 40  # x 32 tokens: three 400-token requests fill it
MAX_MODEL_LEN = 1024
COUNTERS_BOUND_S = 90.0
"""How long a test waits for what an engine reports after answering (its counters, a log line, a record in
Redis): longer than this VM's freezes (up to 46 s); a passing test never waits it out."""

# -- the deployment --------------------------------------------------------------------------------


@dataclass
class Serving(Disaggregated):
    reference: Server
    other_block_prefill: Server  # block size 64, in front of the same decode through ``other_proxy``
    proxy: Proxy
    other_proxy: Proxy
    dead_decode_proxy: Proxy  # in front of the prefill and a decode address that refuses connections
    adapters: list[str] = field(default_factory=list)

    def client(self, server: Server | Proxy) -> openai.OpenAI:
        return openai_client(server.url)


@pytest.fixture(scope="module")
def serving(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    folder = tmp_path_factory.mktemp("serving")
    redis_server = start_redis()
    namespace = "t-serve-" + uuid.uuid4().hex[:10]
    adapters = {name: write_lora_adapter(folder / f"lora-{name}", tiny_model, seed)
                for name, seed in (("a", 11), ("b", 12))}
    template = folder / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    routine = ["--enable-prefix-caching", "--max-num-batched-tokens", "64", "--chat-template", str(template),
               "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
               "--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]

    def kv_config(role: str) -> dict[str, Any]:
        return kv_transfer_config(role, redis_server.url, namespace)

    engines = [
        start_server("prefill", tiny_model, folder, kv_config("kv_producer"), serve=True,
                     max_model_len=MAX_MODEL_LEN, extra_args=routine),
        start_server("decode", tiny_model, folder, kv_config("kv_consumer"), serve=True,
                     max_model_len=MAX_MODEL_LEN,
                     extra_args=[*routine, "--num-gpu-blocks-override", str(DECODE_BLOCKS)]),
        start_server("reference", tiny_model, folder, None, serve=True,
                     max_model_len=MAX_MODEL_LEN, extra_args=routine),
        start_server("prefill-64", tiny_model, folder, kv_config("kv_producer"), serve=True, block_size=64,
                     max_model_len=MAX_MODEL_LEN),
    ]
    proxies: list[Proxy] = []
    refusing = socket.socket()  # bound, never listening: a decode that is down
    refusing.bind(("127.0.0.1", 0))
    try:
        wait_ready(engines, START_TIMEOUT_S)
        prefill, decode, reference, other = engines
        proxies += [start_proxy(folder, "proxy", prefill.url, decode.url, redis_server.url),
                    start_proxy(folder, "proxy-64", other.url, decode.url, redis_server.url),
                    start_proxy(folder, "proxy-dead-decode", prefill.url,
                                f"http://127.0.0.1:{refusing.getsockname()[1]}", redis_server.url)]
        yield Serving(prefill, decode, redis_server, namespace, reference, other, *proxies, sorted(adapters))
    finally:
        for process in (*proxies, *engines):
            process.stop()
        refusing.close()
        redis_server.__exit__(None, None, None)


@pytest.fixture(autouse=True)
def clean_slate(serving: Serving) -> Iterator[None]:
    """A failed test's keys must not fail the next one."""
    yield
    serving.delete_keys()


# -- requests --------------------------------------------------------------------------------------


def complete(serving: Serving, where: Server | Proxy, prompt: list[int], max_tokens: int = 8, *,
             model: str | None = None, stream: bool = False, **extra: Any) -> list[int]:
    """A greedy completion's generated token IDs, through the ``openai`` client."""
    return completion_tokens(serving.client(where), model or serving.reference.model, prompt, max_tokens,
                             stream=stream, **extra)


def chat(serving: Serving, where: Server | Proxy, messages: list[dict[str, str]], max_tokens: int = 8, *,
         stream: bool = True, model: str | None = None, **extra: Any) -> str:
    created = serving.client(where).chat.completions.create(
        model=model or serving.reference.model, messages=messages, max_tokens=max_tokens, temperature=0.0,
        stream=stream, extra_body={"ignore_eos": True, "skip_special_tokens": False, **extra})
    if stream:
        return "".join(chunk.choices[0].delta.content or "" for chunk in created if chunk.choices)
    return created.choices[0].message.content or ""


def prefill_only(serving: Serving, prompt: list[int], *, model: str | None = None, **extra: Any) -> Any:
    """What the proxy sends to the prefill, and then nothing: a client that went away before its decode.
    Returns the answer's kv_transfer_params (the entry is written once the prefill has answered)."""
    answer = serving.client(serving.prefill).completions.create(
        model=model or serving.reference.model, prompt=prompt_text(prompt), max_tokens=1, temperature=0.0,
        extra_body={"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}, **extra})
    return answer.model_extra["kv_transfer_params"]


def entry_written(serving: Serving, count: int) -> None:
    wait_until(lambda: len([key for key in serving.stored_keys() if b":t:" in key]) >= count, 60,
               f"{count} entries written by the prefill")


def metric(server: Server, name: str) -> float:
    """A vLLM metric from ``/metrics``, summed over its label sets."""
    import requests

    text = requests.get(f"{server.url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name)


def loaded(serving: Serving, before: dict[str, float], requests: int) -> dict[str, int]:
    """The decode's counters once ``requests`` more loads are reported (vLLM publishes them per step)."""
    return wait_counters(serving.decode, before, {"loaded_requests": requests}, timeout_s=30)


# -- answers through the proxy are the engine's own -------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_through_the_proxy_match_the_engine_alone(serving: Serving, stream: bool) -> None:
    """Prompts of one to many 64-token prefill chunks, k blocks + 1 among them, each loaded from Redis."""
    prompts = [prompt_of(length, seed=100 + length + stream) for length in (20, 33, 65, 200, 257, 700)]
    before = serving.decode.counters()
    for prompt in prompts:
        want = complete(serving, serving.reference, prompt)
        got = complete(serving, serving.proxy, prompt, stream=stream)
        assert got == want, f"{len(prompt)} tokens"
    delta = loaded(serving, before, len(prompts))
    assert delta.get("loaded_requests") == len(prompts), delta
    assert delta.get("loaded_tokens") == sum(len(p) - 1 for p in prompts), delta
    assert "load_failures" not in delta
    serving.assert_no_keys()


def test_prefix_caching_on_both_sides(serving: Serving) -> None:
    """The same prompt twice (9 blocks + 1 token: the decode's own prefix cache covers all it could load
    the second time), and prompts that share a prefix: right answers, and the announced entry the decode
    does not need is deleted at once, not left to its TTL."""
    prompt = prompt_of(9 * 32 + 1, seed=300)
    sharing = [prompt[:160] + prompt_of(90, seed=301), prompt[:160] + prompt_of(130, seed=302)]
    want = [complete(serving, serving.reference, p) for p in (prompt, *sharing)]
    before = serving.decode.counters()
    assert complete(serving, serving.proxy, prompt) == want[0]
    assert complete(serving, serving.proxy, prompt) == want[0]
    for request, expected in zip(sharing, want[1:], strict=True):
        assert complete(serving, serving.proxy, request) == expected
    delta = wait_counters(serving.decode, before, {"loaded_requests": 3, "discarded_entries": 1},
                          timeout_s=30)
    # First sight of the prompt: loaded. Second: all 288 loadable tokens are in the decode's prefix cache,
    # so its entry is discarded. The sharing prompts: their first 5 blocks are local, the rest loaded.
    assert delta.get("loaded_requests") == 3 and delta.get("discarded_entries") == 1, delta
    assert delta.get("loaded_tokens") == 288 + (249 - 160) + (289 - 160), delta
    serving.assert_no_keys()


def test_a_streamed_multi_turn_chat(serving: Serving) -> None:
    """The second turn's prompt starts with the first turn and its answer: the decode has that prefix
    cached, loads the rest, and answers as the engine alone does."""
    first = [{"role": "user", "content": prompt_text(prompt_of(150, seed=400))}]
    before = serving.decode.counters()
    answer = chat(serving, serving.proxy, first)
    assert answer == chat(serving, serving.reference, first, stream=False)
    second = [*first, {"role": "assistant", "content": answer},
              {"role": "user", "content": prompt_text(prompt_of(120, seed=401))}]
    assert chat(serving, serving.proxy, second) == chat(serving, serving.reference, second, stream=False)
    delta = loaded(serving, before, 2)
    assert delta.get("loaded_requests") == 2 and "load_failures" not in delta, delta
    serving.assert_no_keys()


KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4  # the tiny model: 2 layers, K and V, 2 KV heads of 64, float32


@pytest.mark.parametrize("variant", ["streamed", "whole", "lora", "cache_salt"])
def test_a_six_turn_chat_moves_only_what_the_decode_lacks(serving: Serving, variant: str) -> None:
    """Each turn the whole conversation so far plus 60 new words: every answer is the engine alone's, and
    each turn the decode takes from Redis at most the bytes of the tokens it lacked (its prefix cache holds
    the earlier turns) plus one chunk, read from its counters. Under an adapter or a salt too."""
    model = "a" if variant == "lora" else None
    extra = {"cache_salt": f"tenant-{uuid.uuid4().hex[:6]}"} if variant == "cache_salt" else {}
    chunk = KVRedisConfig().chunk_tokens
    messages: list[dict[str, str]] = []
    for turn in range(6):
        messages.append({"role": "user", "content": prompt_text(prompt_of(60, seed=450 + turn))})
        want = chat(serving, serving.reference, messages, stream=False, model=model, **extra)
        before = serving.decode.counters()
        answer = chat(serving, serving.proxy, messages, stream=variant != "whole", model=model, **extra)
        assert answer == want, f"turn {turn + 1}"
        delta = loaded(serving, before, 1)
        assert delta.get("loaded_requests") == 1 and "load_failures" not in delta, (turn + 1, delta)
        lacked, taken = delta["loaded_tokens"], delta["loaded_bytes"]
        if turn:
            assert lacked < 60 + 32 + 16, (turn + 1, delta)  # the new words, the answer, a partial block
        # Pages are whole blocks, and each chunk read carries its token IDs and a header.
        chunks_read = -(-lacked // chunk) + 1
        bound = (lacked + chunk + 32) * KV_BYTES_PER_TOKEN + chunks_read * (chunk * 8 + 1024)
        assert taken <= bound, (turn + 1, delta, bound)
        messages.append({"role": "assistant", "content": answer})
    serving.assert_no_keys()


def test_two_requests_sharing_a_prefix_at_once_are_both_loaded(serving: Serving) -> None:
    """Two prompts with a common prefix of four chunks and endings of their own, sent at once through the
    proxy (one streamed), three rounds with a new prefix each: the transfers hold the shared chunks
    together, so neither decode's release takes them from the other. Both answers are the engine alone's,
    both decodes load from Redis with no failure, and no key is left."""
    chunk = KVRedisConfig().chunk_tokens
    for round_ in range(3):
        prefix = prompt_of(4 * chunk, seed=1100 + round_)
        prompts = [prefix + prompt_of(40, seed=1110 + round_), prefix + prompt_of(70, seed=1120 + round_)]
        want = [complete(serving, serving.reference, prompt) for prompt in prompts]
        before = serving.decode.counters()
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda pair: complete(serving, serving.proxy, pair[1], stream=pair[0] == 1),
                                enumerate(prompts)))
        assert got == want, f"round {round_ + 1}"
        delta = wait_counters(serving.decode, before, {"loaded_requests": 2}, timeout_s=COUNTERS_BOUND_S)
        assert delta.get("loaded_requests") == 2 and "load_failures" not in delta, (round_ + 1, delta)
        # Each loads what the decode's prefix cache lacks when it arrives: the other's blocks of the prefix
        # may be there already, its own ending never is.
        lacked = sum(len(prompt) - 1 - len(prefix) for prompt in prompts)
        assert lacked <= delta["loaded_tokens"] <= sum(len(prompt) - 1 for prompt in prompts), delta
        serving.assert_no_keys(timeout_s=60)


# -- what decides an entry: the adapter, the tenant ------------------------------------------------


def test_two_lora_adapters_each_get_their_own_answer(serving: Serving) -> None:
    """Same prompt for the base model and both adapters, interleaved, with an entry left by adapter A's
    client that went away: every request gets its own adapter's answer, loaded from its own entry."""
    prompt = prompt_of(130, seed=500)
    models = [serving.reference.model, *serving.adapters]
    want = {model: complete(serving, serving.reference, prompt, model=model) for model in models}
    assert len({tuple(tokens) for tokens in want.values()}) == 3, "the adapters must change the answer"
    prefill_only(serving, prompt, model="a")
    entry_written(serving, 1)
    left = serving.stored_keys()
    before = serving.decode.counters()
    for model in ("b", serving.reference.model, "a", "b", "a"):
        assert complete(serving, serving.proxy, prompt, model=model) == want[model], model
    delta = loaded(serving, before, 5)
    assert delta.get("loaded_requests") == 5 and "load_failures" not in delta, delta
    wait_until(lambda: serving.stored_keys() == left, 30, "only the abandoned entry left")
    client = serving.redis.client()
    try:
        assert all(client.pttl(key) > 0 for key in left)  # it expires on its own
        client.delete(*left)
    finally:
        client.close()


def test_cache_salt_keeps_tenants_apart(serving: Serving) -> None:
    """An entry written under one salt is never loaded under another or under none, even when a request
    carries that entry's announcement (the worst a proxy could do), and no such request waits for it."""
    prompt = prompt_of(100, seed=600)
    want = complete(serving, serving.reference, prompt)
    params_a = prefill_only(serving, prompt, cache_salt="tenant-a")
    entry_written(serving, 1)
    left = serving.stored_keys()
    before = serving.decode.counters()
    started = time.monotonic()
    for salt in (None, "tenant-b"):
        extra = {"cache_salt": salt} if salt else {}
        assert complete(serving, serving.decode, prompt, kv_transfer_params=params_a, **extra) == want
    assert time.monotonic() - started < 120.0, "a request waited for another tenant's entry"
    delta = wait_counters(serving.decode, before, {"skipped_requests": 2}, timeout_s=30)
    assert delta.get("skipped_requests") == 2 and "loaded_requests" not in delta, delta
    assert serving.stored_keys() == left
    # Through the proxy, tenant B gets its own entry, not A's.
    assert complete(serving, serving.proxy, prompt, cache_salt="tenant-b") == want
    assert loaded(serving, before, 1).get("loaded_requests") == 1
    assert serving.stored_keys() == left
    # Tenant A's own decode takes A's entry: all of it (nothing of A's is in the decode's prefix cache).
    got = complete(serving, serving.decode, prompt, kv_transfer_params=params_a, cache_salt="tenant-a")
    assert got == want
    delta = loaded(serving, before, 2)
    assert delta.get("loaded_requests") == 2, delta
    serving.assert_no_keys()


# -- a chunk lost between the prefill and the decode ----------------------------------------------


@pytest.mark.parametrize("lost", [1, 0], ids=["second-chunk", "first-chunk"])
def test_a_chunk_lost_before_the_decode_reads_it(serving: Serving, lost: int) -> None:
    """The prefill stores a prompt as three chunks and announces them, as the proxy asks; one of them goes
    (evicted, say) before the decode reads it. The decode loads the chunks before it, reports the rest as
    not loaded, and vLLM recomputes them: the answer is the engine alone's. The decode releases every chunk
    of the transfer, those it did not read too: no key is left."""
    chunk = KVRedisConfig().chunk_tokens
    prompt = prompt_of(2 * chunk + 42, seed=1200 + lost)  # its first 169 tokens stored: 64, 64 and 41
    stored = len(prompt) - 1
    want = complete(serving, serving.reference, prompt)
    params = serving.prefill_params(prompt)
    (record,) = serving.transfer_records(timeout_s=COUNTERS_BOUND_S)
    chunks = serving.transfer_chunks(record)
    assert len(chunks) == 3, chunks
    client = serving.redis.client()
    try:
        read_bytes = sum(client.strlen(key) for key in chunks[:lost])
        assert client.delete(chunks[lost]) == 1
        pops_before = blocked_pops(client)
        before = serving.decode.counters()
        answer = serving.decode.complete(prompt, params=params)
        pops_after = blocked_pops(client)
    finally:
        client.close()
    assert answer["choices"][0]["token_ids"] == want
    loaded = lost * chunk
    delta = wait_counters(serving.decode, before, {"load_failures": 1, "failed_tokens": stored - loaded},
                          timeout_s=COUNTERS_BOUND_S)
    assert delta.get("load_failures") == 1 and delta.get("failed_tokens") == stored - loaded, delta
    assert delta.get("loaded_tokens", 0) == loaded and delta.get("loaded_bytes", 0) == read_bytes, delta
    assert "loaded_requests" not in delta, delta
    serving.assert_no_keys(timeout_s=60)
    # It says why, naming the tokens it recomputes.
    warning = re.compile(rf"request {re.escape(answer['id'])}-\S*: KV of (\d+) tokens not loaded from Redis "
                         r"\((.*)\); vLLM recomputes them")
    said = wait_until(lambda: warning.search(serving.decode.log_text()), COUNTERS_BOUND_S,
                      f"the decode's warning for {answer['id']}")
    assert said[1] == str(stored - loaded), said[0]
    # The record was there, a chunk was not: the warning says so, and nothing waits for a record after.
    assert said[2] == f"its chunks end at position {loaded} (absent)", said[0]
    assert pops_after <= pops_before, "the decode waits for a record after its load ended"


def blocked_pops(client: Any) -> int:
    """Redis clients blocked in a BLPOP (a decode waiting for a transfer's record)."""
    return sum(1 for c in client.client_list() if c.get("cmd") == "blpop" and "b" in c.get("flags", ""))


# -- aborts, preemption -----------------------------------------------------------------------------


def test_a_client_gone_between_prefill_and_decode_costs_no_one_else(serving: Serving) -> None:
    """Its entry stays until its TTL; the next request for the same prompt loads its own."""
    prompt = prompt_of(180, seed=700)
    want = complete(serving, serving.reference, prompt)
    prefill_only(serving, prompt)
    entry_written(serving, 1)
    left = serving.stored_keys()
    before = serving.decode.counters()
    assert complete(serving, serving.proxy, prompt) == want
    assert loaded(serving, before, 1).get("loaded_requests") == 1
    wait_until(lambda: serving.stored_keys() == left, 30, "only the abandoned entry left")
    client = serving.redis.client()
    try:
        assert all(client.pttl(key) > 0 for key in left)
        client.delete(*left)
    finally:
        client.close()


def _send_and_hang_up(url: str, body: dict[str, Any], after_s: float) -> socket.socket:
    """POST a request; ``after_s`` later, close the connection without reading the answer (``after_s``
    None: return the open connection, for the caller to close)."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    time.sleep(after_s)
    return sock


def _request_body(serving: Serving, prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": serving.reference.model, "prompt": prompt_text(prompt), "max_tokens": 64,
            "temperature": 0.0, "ignore_eos": True, "stream": True, **extra}


def _decode_idle(serving: Serving) -> None:
    """No request in the decode, none waiting, and every KV block free again."""
    def idle() -> bool:
        return (metric(serving.decode, "vllm:num_requests_running") == 0
                and metric(serving.decode, "vllm:num_requests_waiting") == 0
                and metric(serving.decode, "vllm:kv_cache_usage_perc") == 0.0)
    wait_until(idle, 60, "decode idle with every block free")


@pytest.mark.parametrize("after_s", [0.0, 0.3, 1.0])
def test_a_client_hanging_up_on_the_proxy_leaves_nothing_behind(serving: Serving, after_s: float) -> None:
    """Clients that hang up on the proxy during the prefill, between prefill and decode, or during the
    decode: the decode still takes the entry (the proxy finds the client gone when it relays the first
    bytes, and drops the decode), no key is left, no block is held, and the next answer is right."""
    prompt = prompt_of(900, seed=800 + int(after_s * 10))
    _send_and_hang_up(serving.proxy.url, _request_body(serving, prompt), after_s).close()
    serving.assert_no_keys(timeout_s=60)
    _decode_idle(serving)
    followup = prompt_of(400, seed=850 + int(after_s * 10))
    assert complete(serving, serving.proxy, followup) == complete(serving, serving.reference, followup)
    serving.assert_no_keys()


def test_a_decode_that_is_down_leaves_nothing_behind(serving: Serving) -> None:
    """The prefill writes and announces the entry, the decode refuses the connection: the client gets a
    502 and the proxy deletes the entry at once (it would otherwise wait out its TTL in Redis)."""
    prompt = prompt_of(700, seed=870)
    before = serving.prefill.counters()
    with pytest.raises(openai.APIStatusError) as failed:
        complete(serving, serving.dead_decode_proxy, prompt)
    assert failed.value.status_code == 502
    deleted = re.compile(r"deleted entry \w+ .*which its decode never took")
    wait_until(lambda: deleted.search(serving.dead_decode_proxy.log.read_text()), 60,
               "the proxy's delete of the announced entry")
    serving.assert_no_keys(timeout_s=60)
    serving.prefill.complete([7], max_tokens=1)  # one more engine step reports the save (a writer thread's)
    assert wait_counters(serving.prefill, before, {"saved_requests": 1}, timeout_s=60).get("saved_requests")


def test_a_request_aborted_while_its_load_is_in_flight(serving: Serving) -> None:
    """The decode's load is waiting for its entry when the client hangs up: vLLM aborts the request, the
    connector holds its blocks until the load is over, the entry is taken when it lands, and nothing is
    left: no key, no block."""
    prompt = prompt_of(700, seed=870)
    params = prefill_only(serving, prompt)
    entry_written(serving, 1)
    client = serving.redis.client()
    try:
        (queue,) = [key for key in serving.stored_keys() if b":t:" in key]
        client.rename(queue, queue + b":late")  # the entry is "still being written"
        before = serving.decode.counters()
        connection = _send_and_hang_up(serving.decode.url, _request_body(serving, prompt,
                                                                         kv_transfer_params=params), 0.0)
        wait_until(lambda: metric(serving.decode, "vllm:num_requests_waiting") == 1, 60,
                   "the decode waiting for its KV")
        connection.close()
        wait_until(lambda: metric(serving.decode, "vllm:num_requests_waiting") == 0, 60, "request aborted")
        client.rename(queue + b":late", queue)  # the write lands; the load in flight takes it
    finally:
        client.close()
    serving.assert_no_keys(timeout_s=60)
    _decode_idle(serving)
    delta = counter_delta(before, serving.decode.counters())
    assert "discarded_entries" not in delta, delta
    followup = prompt_of(400, seed=871)
    assert complete(serving, serving.proxy, followup) == complete(serving, serving.reference, followup)
    serving.assert_no_keys()


def test_decode_preemption_while_loads_are_in_flight(serving: Serving) -> None:
    """Eight requests at once whose answers outgrow a decode KV space of 40 blocks: the decode preempts
    requests it loaded (and recomputes them), answers stay the engine's own, no block or key is left."""
    prompts = [prompt_of(100 + 4 * i, seed=900 + i) for i in range(8)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        want = list(pool.map(lambda p: complete(serving, serving.reference, p, max_tokens=300), prompts))
    preempted = metric(serving.decode, "vllm:num_preemptions_total")
    before = serving.decode.counters()
    client = serving.redis.client()
    try:
        # Redis holds the prefill's writes and the decode's pops until all eight wait in the decode: they run
        # there at once, however fast each engine is (one that finished before the last arrived would leave
        # room for the rest, and nothing would be preempted).
        client.execute_command("CLIENT", "PAUSE", 120_000, "WRITE")
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = [pool.submit(complete, serving, serving.proxy, p, max_tokens=300) for p in prompts]
            try:
                wait_until(lambda: metric(serving.decode, "vllm:num_requests_waiting") == len(prompts), 120,
                           "all eight requests waiting for their KV in the decode")
            finally:
                client.execute_command("CLIENT", "UNPAUSE")
            got = [answer.result() for answer in answers]
    finally:
        client.close()
    assert got == want
    assert metric(serving.decode, "vllm:num_preemptions_total") > preempted, "nothing was preempted"
    delta = loaded(serving, before, len(prompts))
    failures = [line for line in serving.decode.log_text().splitlines() if "not loaded" in line]
    assert delta.get("loaded_requests") == len(prompts) and "load_failures" not in delta, (delta, failures)
    serving.assert_no_keys()
    _decode_idle(serving)


# -- engines configured differently ----------------------------------------------------------------


def test_a_prefill_with_another_block_size_is_named_not_waited_on(serving: Serving) -> None:
    """Prefill block size 64, decode 32: right answers at once (the decode's pop bound is 120 s here; a
    request that waited for it would take that long), one warning naming the difference, nothing left."""
    prompts = [prompt_of(length, seed=1000 + length) for length in (70, 200, 333)]
    want = [complete(serving, serving.reference, p) for p in prompts]
    before = serving.decode.counters()
    started = time.monotonic()
    got = [complete(serving, serving.other_proxy, p) for p in prompts]
    elapsed = time.monotonic() - started
    assert got == want
    assert elapsed < 120.0, f"the decode waited for entries it cannot use ({elapsed:.0f} s)"
    delta = wait_counters(serving.decode, before, {"skipped_requests": len(prompts)}, timeout_s=30)
    assert delta.get("skipped_requests") == len(prompts) and "loaded_requests" not in delta, delta
    warnings = [line for line in serving.decode.log_text().splitlines() if "block size 64" in line]
    assert len(warnings) == 1, warnings
    assert "32" in warnings[0]
    serving.assert_no_keys()


# -- vLLM's own load generator ---------------------------------------------------------------------


def test_vllm_bench_serve_through_the_proxy(serving: Serving, tmp_path: Path) -> None:
    """24 random prompts, 4 at a time: no failed request, every decode loaded, nothing left in Redis."""
    before = serving.decode.counters()
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
               "--base-url", serving.proxy.url, "--endpoint", "/v1/completions",
               "--model", serving.reference.model, "--tokenizer", serving.reference.model,
               "--dataset-name", "random", "--random-input-len", "160", "--random-output-len", "8",
               "--num-prompts", "24", "--max-concurrency", "4", "--ignore-eos", "--seed", "0",
               "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["completed"] == 24 and result.get("failed", 0) == 0, result.get("errors")
    # The benchmark's warm-up request goes through the proxy too.
    delta = loaded(serving, before, 24)
    assert delta.get("loaded_requests", 0) >= 24 and "load_failures" not in delta, delta
    serving.assert_no_keys()
