"""Hybrid models on real ``vllm serve`` engines behind ``kvredis proxy``: a sliding-window model (a tiny
Gemma 3), a Gated DeltaNet hybrid (a tiny Qwen3-Next) and a Mamba2 hybrid (a tiny Nemotron-H), each written
here with seeded random weights.

For each, a prefill and a decode with the connector (vLLM's hybrid KV cache manager on: kvredis declares
``SupportsHMA``) and an engine computing alone with the same settings: prefix caching on and chunked prefill
with a small budget (a block, where vLLM raised the block size to a Mamba state's page). Every answer through
the proxy must be the lone engine's, token for token; the decode's counters must show what it loaded from
Redis (everything but the last token for the window model; up to the prompt's last block boundary, with the
state there, for the state models); its KV capacity must be the lone engine's; no key is left.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
    cpu_bind,
    kv_transfer_config,
    openai_client,
    prompt_of,
    start_proxy,
    start_redis,
    start_server,
    wait_counters,
    wait_ready,
)

from kvredis.stack.tinymodel import (
    prompt_text,
    write_tiny_gemma3,
    write_tiny_nemotron_h,
    write_tiny_qwen3_next,
)

START_TIMEOUT_S = 600.0
MAX_MODEL_LEN = 1024
COUNTERS_BOUND_S = 90.0


@dataclass(frozen=True)
class Family:
    write: Callable[..., Path]
    dtype: str
    budget: int  # the prefill budget (--max-num-batched-tokens)
    kind: str  # what the decode loads besides full attention: "window" or "state"


FAMILIES = {
    "gemma3-sliding-window": Family(write_tiny_gemma3, "float32", 64, "window"),
    # vLLM raises the block size to 256 tokens for this model's state: a budget of a block.
    "qwen3-next-gated-deltanet": Family(write_tiny_qwen3_next, "bfloat16", 256, "state"),
    # Its block is 128 tokens; a budget of half a block (vLLM's CPU Mamba2 kernels fail a 128-token chunk
    # of a prompt that crosses a block boundary, connector or not): prompts whose last 64 tokens cross the
    # boundary keep no state there, and move nothing.
    "nemotron-h-mamba2": Family(write_tiny_nemotron_h, "float32", 64, "state"),
}


@dataclass
class Hybrid(Disaggregated):
    family: Family
    reference: Server
    proxy: Proxy

    def client(self, where: Server | Proxy) -> openai.OpenAI:
        return openai_client(where.url)

    def block_size(self) -> int:
        """The block size vLLM chose for the decode (raised to fit a Mamba state's page)."""
        found = re.findall(r"kv lcm block sizes (\d+)", self.decode.log_text())
        return int(found[-1]) if found else 32

    def loadable(self, prompt: list[int]) -> int:
        """The positions the decode loads of ``prompt``: all but the last; for a state model, up to the last
        block boundary before it, if the prefill's last step starts there (vLLM cuts a step at the boundary,
        so it does when the rest of the prompt fits the budget), else none."""
        if self.family.kind != "state":
            return len(prompt) - 1
        block = self.block_size()
        end = (len(prompt) - 1) // block * block
        return end if len(prompt) - end <= self.family.budget else 0


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hybrid]:
    family = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    model = family.write(folder / "model", seed=3)
    redis_server = start_redis()
    namespace = "t-hybrid-" + uuid.uuid4().hex[:10]
    template = folder / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    routine = ["--enable-prefix-caching", "--max-num-batched-tokens", str(family.budget),
               "--chat-template", str(template)]

    def start(name: str, role: str | None, **options: Any) -> Server:
        kv_config = kv_transfer_config(role, redis_server.url, namespace) if role else None
        return start_server(name, model, folder, kv_config, serve=True, max_model_len=MAX_MODEL_LEN,
                            extra_args=routine, dtype=family.dtype, **options)

    # The reference computes with as many threads as the decode (on the decode's core): on a CPU with AVX-512
    # BF16, vLLM's accelerated Gated DeltaNet kernel gives other bits with another thread count, and by the
    # third turn of the chat a decode computing everything itself, with nothing from Redis, answered otherwise
    # than an unpinned reference (two threads here).
    same_threads = {"VLLM_CPU_OMP_THREADS_BIND": cpu_bind({"kv_role": "kv_consumer"})}
    engines = [start("prefill", "kv_producer"), start("decode", "kv_consumer"),
               start("reference", None, env=same_threads)]
    proxy: Proxy | None = None
    try:
        wait_ready(engines, START_TIMEOUT_S)
        prefill, decode, reference = engines
        proxy = start_proxy(folder, "proxy", prefill.url, decode.url, redis_server.url)
        yield Hybrid(prefill, decode, redis_server, namespace, family, reference, proxy)
    finally:
        for process in (proxy, *engines):
            if process is not None:
                process.stop()
        redis_server.__exit__(None, None, None)


@pytest.fixture(autouse=True)
def clean_slate(hybrid: Hybrid) -> Iterator[None]:
    yield
    hybrid.delete_keys()


def complete(hybrid: Hybrid, where: Server | Proxy, prompt: list[int], *, stream: bool = False) -> list[int]:
    return completion_tokens(hybrid.client(where), hybrid.reference.model, prompt, stream=stream)


def kv_cache_tokens(server: Server) -> int:
    """The KV cache size the engine reported at start-up, in tokens."""
    found = re.findall(r"KV cache size: ([\d,]+) tokens", server.log_text())
    assert found, f"{server.name} reported no KV cache size:\n{server.log_tail()}"
    return int(found[-1].replace(",", ""))


def test_the_kv_cache_is_as_large_as_without_the_connector(hybrid: Hybrid) -> None:
    """vLLM keeps its hybrid KV cache manager on: a window's blocks are freed as it passes them and a state
    is a slot, so the decode holds as many tokens as the engine alone (not the 2x or more fewer of every
    layer kept whole)."""
    assert "Turning off hybrid kv cache manager" not in hybrid.decode.log_text()
    assert kv_cache_tokens(hybrid.decode) == kv_cache_tokens(hybrid.reference)
    assert kv_cache_tokens(hybrid.prefill) == kv_cache_tokens(hybrid.reference)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_answers_through_the_proxy_are_the_engines_own_and_come_from_redis(hybrid: Hybrid,
                                                                            stream: bool) -> None:
    """Prompts of less than a block to several of the prefill's budget: the lone engine's answers, with the
    decode's KV loaded from Redis (the window's blocks or the state with the full-attention pages)."""
    prompts = [prompt_of(length, seed=40 + length + stream) for length in (20, 150, 300, 620)]
    want = [complete(hybrid, hybrid.reference, prompt) for prompt in prompts]
    before = hybrid.decode.counters()
    got = [complete(hybrid, hybrid.proxy, prompt, stream=stream) for prompt in prompts]
    assert got == want
    expected = sum(hybrid.loadable(prompt) for prompt in prompts)
    delta = wait_counters(hybrid.decode, before, {"loaded_tokens": expected}, timeout_s=COUNTERS_BOUND_S)
    assert delta.get("loaded_tokens") == expected, delta
    assert "load_failures" not in delta, delta
    hybrid.assert_no_keys(timeout_s=30.0)


def test_a_streamed_chat_of_three_turns(hybrid: Hybrid) -> None:
    """Each turn's prompt holds the last; the decode's own prefix cache holds the earlier turns (for a state
    model, up to their last block boundary), and Redis the rest: every turn the prefill could store (see
    :meth:`Hybrid.loadable`) is loaded."""
    messages: list[dict[str, str]] = []
    before = hybrid.decode.counters()
    loads = 0
    for turn in range(3):
        messages.append({"role": "user", "content": prompt_text(prompt_of(140, seed=60 + turn))})
        alone = hybrid.client(hybrid.reference).chat.completions.create(
            model=hybrid.reference.model, messages=messages, max_tokens=8, temperature=0.0,
            extra_body={"ignore_eos": True, "skip_special_tokens": False})
        assert alone.usage is not None
        loads += hybrid.loadable([0] * alone.usage.prompt_tokens) > 0
        streamed = hybrid.client(hybrid.proxy).chat.completions.create(
            model=hybrid.reference.model, messages=messages, max_tokens=8, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True, "skip_special_tokens": False})
        answer = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
        assert answer == alone.choices[0].message.content, f"turn {turn}"
        messages.append({"role": "assistant", "content": answer})
    assert loads >= 2  # the turns must be worth loading, or this tests nothing
    delta = wait_counters(hybrid.decode, before, {"loaded_requests": loads}, timeout_s=COUNTERS_BOUND_S)
    assert delta.get("loaded_requests") == loads and "load_failures" not in delta, delta
    hybrid.assert_no_keys(timeout_s=30.0)
