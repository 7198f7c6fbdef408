"""Tensor parallelism in real vLLM engines: a prefill and a decode engine, each sharded over two worker
processes (``--tensor-parallel-size 2``, CPU build, tiny model), sharing one real Redis.

Each rank holds half of every layer's KV heads, so each stores its own shard under its own key (the cache
identity names the heads) from its own process, and the rank of the decode engine holding the same heads
takes it: the two shards move in parallel, and neither rank ever sees the other's. A third engine, one
process (TP 1), reads both shards and writes one the TP 2 decode's ranks split between them, each behind
``kvredis proxy``. Answers are checked against the decode engine computing the same prompt itself (a fresh
``cache_salt`` keeps its prefix cache out).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm.version", reason="needs vLLM's CPU build (run with the vLLM environment's python)")

from conftest import BLOCK_SIZE
from engine_servers import (
    Disaggregated,
    Server,
    cached_tokens,
    completion_tokens,
    kv_transfer_config,
    loaded_tokens,
    openai_client,
    prompt_of,
    start_proxy,
    start_redis,
    start_server,
    tokens_of,
    wait_counters,
    wait_ready,
)

from kvredis.config import KVRedisConfig
from kvredis.stack.tinymodel import write_tiny_llama
from kvredis.store import codec
from kvredis.store.announcement import TRANSFER_PARAM
from kvredis.store.transfer import parse_record

TP = 2
START_TIMEOUT_S = 300.0
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 64  # the tiny model's (kvredis.stack.tinymodel defaults)


@dataclass
class Sharded(Disaggregated):
    """The two engines, each over TP worker processes."""

    def stored_pages(self, record_key: str) -> torch.Tensor:
        """The pages of the transfer whose record waits at ``record_key``, read without taking it."""
        client = self.redis.client()
        try:
            prefix, braced = record_key.rsplit(":t:", 1)
            record = parse_record(client.lindex(record_key, 0), braced.strip("{}"), prefix)
            if record.inline is not None:  # a small transfer: its one chunk rides in the record
                blobs = [bytes(record.inline)]
            else:
                blobs = [client.get(key) for key in self.transfer_chunks(record_key)]
        finally:
            client.close()
        return torch.cat([codec.decode(blob, max_payload_bytes=1 << 30)[0][1] for blob in blobs], dim=1)

    single: Server | None = None  # TP 1, kv_both: the TP 2 prefill's decode, the TP 2 decode's prefill
    folder: Path | None = None

    def computed_alone(self, prompt: list[int]) -> dict[str, Any]:
        """The decode engine's own answer, computed without Redis or its prefix cache."""
        answer = self.decode.complete(prompt, cache_salt=uuid.uuid4().hex)
        assert cached_tokens(answer) == 0, answer
        return answer


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sharded]:
    folder = tmp_path_factory.mktemp("tp-engines")
    model: Path = write_tiny_llama(folder / "tiny-llama", layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    server = start_redis()
    namespace = "t-tp-" + uuid.uuid4().hex[:10]

    def kv_config(role: str) -> dict[str, Any]:
        return kv_transfer_config(role, server.url, namespace)

    servers = [start_server("prefill-tp2", model, folder, kv_config("kv_producer"), tensor_parallel=TP),
               start_server("decode-tp2", model, folder, kv_config("kv_consumer"), tensor_parallel=TP),
               start_server("both-tp1", model, folder, kv_config("kv_both"))]
    try:
        wait_ready(servers, START_TIMEOUT_S)
        yield Sharded(*servers[:2], redis=server, namespace=namespace, single=servers[2], folder=folder)
    finally:
        for engine in servers:
            engine.stop()
        server.__exit__(None, None, None)


@pytest.mark.vllm
@pytest.mark.timeout(START_TIMEOUT_S + 240)
def test_each_rank_stores_and_loads_its_own_shard(sharded: Sharded) -> None:
    prompts = [prompt_of(length, seed=3000 + length) for length in (33, 257, 1000)]
    expected = [tokens_of(sharded.computed_alone(prompt)) for prompt in prompts]
    decode_before, prefill_before = sharded.decode.counters(), sharded.prefill.counters()
    for prompt, want in zip(prompts, expected, strict=True):
        params = sharded.prefill_params(prompt)
        queues = sharded.transfer_records(TP)
        # One transfer per rank: the same announced transfer id, under two cache identities
        # (<namespace>:<identity>:t:{<transfer id>}).
        assert len(queues) == TP, queues
        assert len({queue.split(":")[-1] for queue in queues}) == 1, queues
        assert len({queue.split(":")[-3] for queue in queues}) == TP, queues
        assert "{" + params[TRANSFER_PARAM]["entry"] + "}" == queues[0].split(":")[-1], params
        pages = -(-(len(prompt) - 1) // BLOCK_SIZE)  # the last position is not stored
        shards = []
        for queue in queues:
            stored = sharded.stored_pages(queue)
            # Each rank holds half of the KV heads: K and V of one head per page, for every layer.
            assert stored.shape[:2] == (LAYERS, pages), stored.shape
            assert stored.numel() == LAYERS * pages * 2 * (KV_HEADS // TP) * BLOCK_SIZE * HEAD_DIM
            shards.append(stored)
        assert not shards[0].equal(shards[1])  # different heads, not one shard twice

        seen = sharded.decode.counters()
        decoded = sharded.decode.complete(prompt, params=params)
        # Counted by every rank: vLLM adds up the workers' stats.
        assert loaded_tokens(sharded.decode, seen, TP * (len(prompt) - 1)) == TP * (len(prompt) - 1), \
            f"{len(prompt)} tokens: KV not loaded; the decode's warnings:\n{sharded.decode.warnings()}"
        assert tokens_of(decoded) == want, f"{len(prompt)} tokens"
    assert sharded.stored_keys() == []  # each rank of the decode took its own entry
    loaded = sum(len(prompt) - 1 for prompt in prompts)
    # Counted by every rank: vLLM adds up the workers' stats.
    delta = wait_counters(sharded.decode, decode_before,
                          {"loaded_requests": TP * len(prompts), "loaded_tokens": TP * loaded})
    assert delta.pop("loaded_bytes") > 0
    assert delta == {"loaded_requests": TP * len(prompts), "loaded_tokens": TP * loaded}
    sharded.prefill.complete([7], max_tokens=1)  # one more engine step reports the last saves
    delta = wait_counters(sharded.prefill, prefill_before, {"saved_requests": TP * len(prompts)})
    assert delta.get("saved_requests") == TP * len(prompts) and "save_failures" not in delta


@pytest.mark.vllm
@pytest.mark.timeout(240)
def test_a_lost_shard_makes_the_decode_recompute_the_prompt(sharded: Sharded) -> None:
    """One rank's first chunk is lost (evicted, say): that rank loads nothing, so vLLM computes the whole
    prompt again and the answer is still right; the other rank's transfer is taken, and no key is left."""
    prompt = prompt_of(1100, seed=3999)  # many chunks a rank
    want = tokens_of(sharded.computed_alone(prompt))
    before = sharded.decode.counters()
    params = sharded.prefill_params(prompt)
    queues = sharded.transfer_records(TP)
    chunks = sharded.transfer_chunks(queues[0])
    assert len(chunks) == -(-(len(prompt) - 1) // KVRedisConfig().chunk_tokens), chunks
    client = sharded.redis.client()
    try:
        assert client.delete(chunks[0]) == 1
    finally:
        client.close()
    decoded = sharded.decode.complete(prompt, params=params)
    assert tokens_of(decoded) == want
    expected = {"load_failures": 1, "failed_tokens": len(prompt) - 1, "loaded_requests": 1,
                "loaded_tokens": len(prompt) - 1}
    delta = wait_counters(sharded.decode, before, expected)
    assert delta.pop("loaded_bytes") > 0  # the other rank's
    assert delta == expected
    assert sharded.stored_keys() == []


@pytest.mark.vllm
@pytest.mark.timeout(400)
def test_engines_of_tp_2_and_tp_1_move_kv_both_ways_behind_the_proxy(sharded: Sharded) -> None:
    """TP 2 prefill -> TP 1 decode (one rank gathers both shards) and TP 1 prefill -> TP 2 decode (each rank
    reads its half of one shard, the first handing the transfer on to the second), behind ``kvredis proxy``,
    called with the ``openai`` client: the answers are the decode's own, every decode rank loaded the prompt,
    and no key is left."""
    assert sharded.single is not None and sharded.folder is not None
    prompts = [prompt_of(length, seed=5000 + length) for length in (40, 300)]
    pairs = ((sharded.prefill, sharded.single, 1, "tp2-to-tp1"),
             (sharded.single, sharded.decode, TP, "tp1-to-tp2"))
    for prefill, decode, ranks, name in pairs:
        proxy = start_proxy(sharded.folder, name, prefill.url, decode.url, sharded.redis.url)
        try:
            client = openai_client(proxy.url)
            for index, prompt in enumerate(prompts):
                alone = decode.complete(prompt, cache_salt=uuid.uuid4().hex)
                assert cached_tokens(alone) == 0, alone
                seen = decode.counters()
                got = completion_tokens(client, decode.model, prompt, stream=index % 2 == 1)
                assert got == tokens_of(alone), f"{name}, {len(prompt)} tokens"
                # Every rank of the decode loaded the prompt (vLLM adds up the workers' counts).
                delta = wait_counters(decode, seen, {"loaded_tokens": ranks * (len(prompt) - 1)})
                assert delta.get("loaded_tokens") == ranks * (len(prompt) - 1), (name, delta)
                assert "load_failures" not in delta, (name, delta)
            sharded.assert_no_keys()
        finally:
            proxy.stop()
