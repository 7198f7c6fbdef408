"""MLA (a tiny DeepSeek-V2 written here) with tensor parallelism in real engines: a prefill and a decode, each
over two worker processes (``--tensor-parallel-size 2``, CPU build), sharing one real Redis.

Every rank of an MLA engine holds the same latent KV (its one "head"), so it is stored once: the first rank
writes one copy under a key space shared by the ranks, one record; the decode's first rank takes it and
hands the transfer on to the second (a hold and a record of its own). Answers are checked against the
decode engine computing the same prompt itself (a fresh ``cache_salt`` keeps Redis out); no key is left.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm.version", reason="needs vLLM's CPU build (run with the vLLM environment's python)")


from engine_servers import (
    Disaggregated,
    cached_tokens,
    kv_transfer_config,
    prompt_of,
    start_redis,
    start_server,
    tokens_of,
    wait_counters,
    wait_ready,
)

from kvredis.stack.tinymodel import write_tiny_deepseek_mla
from kvredis.store import codec
from kvredis.store.announcement import TRANSFER_PARAM
from kvredis.store.transfer import parse_record

TP = 2
START_TIMEOUT_S = 400.0
LAYERS, LATENT = 2, 512 + 64  # kv_lora_rank + qk_rope_head_dim


@pytest.fixture(scope="module")
def mla(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Disaggregated]:
    folder = tmp_path_factory.mktemp("mla-engines")
    model = write_tiny_deepseek_mla(folder / "deepseek", seed=5, layers=LAYERS)
    server = start_redis()
    namespace = "t-mla-" + uuid.uuid4().hex[:10]

    def kv_config(role: str) -> dict[str, Any]:
        return kv_transfer_config(role, server.url, namespace)

    # On a CPU with AMX tiles vLLM picks its AMX MLA backend, whose weight packing takes bf16, fp16 or int8
    # only and refuses this float32 model at load; the reference CPU backend runs it on every x86 CPU.
    backend = ("--attention-backend", "CPU_MLA")
    servers = [start_server("prefill-tp2", model, folder, kv_config("kv_producer"), tensor_parallel=TP,
                            extra_args=backend),
               start_server("decode-tp2", model, folder, kv_config("kv_consumer"), tensor_parallel=TP,
                            extra_args=backend)]
    try:
        wait_ready(servers, START_TIMEOUT_S)
        yield Disaggregated(*servers, redis=server, namespace=namespace)
    finally:
        for engine in servers:
            engine.stop()
        server.__exit__(None, None, None)


@pytest.mark.vllm
@pytest.mark.timeout(START_TIMEOUT_S + 240)
def test_the_latent_kv_is_stored_once_and_every_rank_loads_it(mla: Disaggregated) -> None:
    prompts = [prompt_of(length, seed=4000 + length) for length in (40, 300)]
    for prompt in prompts:
        alone = mla.decode.complete(prompt, cache_salt=uuid.uuid4().hex)
        assert cached_tokens(alone) == 0, alone
        params = mla.prefill_params(prompt)
        entry = params[TRANSFER_PARAM]["entry"]
        assert params[TRANSFER_PARAM]["engine"]["kv_parts"] == 1, params
        # One key space for both ranks, one record under the announced id.
        (queue,) = mla.transfer_records(1)
        assert queue.rsplit(":t:", 1)[1] == "{" + entry + "}", queue
        client = mla.redis.client()
        try:
            record = parse_record(client.lindex(queue, 0), entry, queue.rsplit(":t:", 1)[0])
            chunks = [key for key in client.scan_iter(match=f"{mla.namespace}:*:c:*")
                      if not key.endswith(b":h")]
            blobs = ([bytes(record.inline)] if record.inline is not None
                     else [client.get(key) for key in chunks])
        finally:
            client.close()
        # One copy: the chunks of the prompt once (a small transfer's one chunk in its record), each holding
        # every layer's latent pages.
        for blob in blobs:
            pages = codec.decode(blob, max_payload_bytes=1 << 30)[0][1]
            assert pages.shape[0] == LAYERS and pages.shape[-1] == LATENT, pages.shape
        stored = sum(codec.decode(blob, max_payload_bytes=1 << 30)[0][1].shape[1] for blob in blobs)
        assert stored == -(-(len(prompt) - 1) // 16), (stored, len(prompt))  # 16: CPU MLA's block size

        seen = mla.decode.counters()
        decoded = mla.decode.complete(prompt, params=params)
        assert tokens_of(decoded) == tokens_of(alone), f"{len(prompt)} tokens"
        # Every rank loaded the prompt (vLLM adds up the workers' counts).
        delta = wait_counters(mla.decode, seen, {"loaded_tokens": TP * (len(prompt) - 1)})
        assert delta.get("loaded_tokens") == TP * (len(prompt) - 1), delta
        assert "load_failures" not in delta, delta
        mla.assert_no_keys()
