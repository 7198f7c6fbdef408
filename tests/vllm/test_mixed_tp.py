"""A prefill and a decode of different tensor-parallel sizes at the level of vLLM's scheduler: one real
``Scheduler`` and one worker-role connector per rank, each rank's paged caches holding its own KV heads
(:mod:`kvredis.vllm.heads`), stepped as vLLM's engine core and executor do (a request has finished loading
once every rank said so; a block any rank failed to load is recomputed).

The fake forward writes, for each token, values that name its token, position, layer and KV head, so every
loaded page is checked at its slot against what that head's values must be, whichever ranks wrote them.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm.version", reason="needs vLLM's CPU build (run with the vLLM environment's python)")

import redis
from conftest import BLOCK_SIZE
from scheduler_steps import (
    STEP_TIMEOUT_S,
    Stepped,
    delete_namespace,
    finish_step,
    lookups_ready,
    new_request,
    redis_keys,
    wait_saved,
)
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.structured_output import StructuredOutputManager

from kvredis.errors import ConfigError
from kvredis.stack.tinymodel import write_tiny_llama
from kvredis.store.announcement import TRANSFER_PARAM
from kvredis.store.transfer import record_digests
from kvredis.vllm import KVRedisConnector
from kvredis.vllm import endpoint as endpoint_module
from kvredis.vllm.heads import HeadSplit
from kvredis.vllm.metadata import stored_plan

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
WIDTH = 128  # 2 * head_size
NUM_BLOCKS = 48
MAX_LEN = 1024
TOKEN_BUDGET = 128
SAMPLED = 7

init_none_hash(sha256)


def kv_values(tokens: torch.Tensor, positions: torch.Tensor, layer: int, heads: range) -> torch.Tensor:
    """``[n, len(heads), WIDTH]``: unique for each token, position, layer, head and lane."""
    head = torch.tensor(list(heads), dtype=torch.float32).reshape(1, -1, 1)
    lane = torch.arange(WIDTH, dtype=torch.float32).reshape(1, 1, WIDTH)
    return (tokens.float().reshape(-1, 1, 1) + positions.float().reshape(-1, 1, 1) / 1024.0
            + head / 64.0 + lane / 65536.0 + layer * 2048.0)


@dataclasses.dataclass
class ShardedEngine(Stepped):
    """One scheduler and a worker-role connector per tensor-parallel rank."""

    scheduler: Scheduler
    workers: list[KVRedisConnector]
    caches: list[dict[str, torch.Tensor]]
    split: HeadSplit
    redis_url: str
    namespace: str
    stats: Counter[str] = dataclasses.field(default_factory=Counter)
    finished: dict[str, Any] = dataclasses.field(default_factory=dict)
    recved: set[str] = dataclasses.field(default_factory=set)
    invalid_blocks: list[set[int]] = dataclasses.field(default_factory=list)
    new_reqs: dict[str, Any] = dataclasses.field(default_factory=dict)
    _reports: Counter[str] = dataclasses.field(default_factory=Counter)  # finished_recving, by rank
    _blocks: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    @property
    def connector(self) -> KVRedisConnector:
        connector = self.scheduler.connector
        assert isinstance(connector, KVRedisConnector)
        return connector

    def heads_of(self, rank: int) -> range:
        part = self.split.part_of(rank)
        return range(part * self.split.width, (part + 1) * self.split.width)

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 2,
            params: dict[str, Any] | None = None, **fields: Any) -> None:
        self.scheduler.add_request(new_request(req_id, prompt, max_tokens, params, **fields))

    def step(self) -> Any:
        """One engine step on every rank; loads count as finished once every rank reported them."""
        output = self.scheduler.schedule()
        context = SimpleNamespace(attn_metadata=None, no_compile_layers={})
        for worker in self.workers:
            worker.bind_connector_metadata(output.kv_connector_metadata)
            worker.start_load_kv(context)
        sampled = self._forward(output) if output.total_num_scheduled_tokens else {}
        recving: set[str] = set()
        invalid: set[int] = set()
        for worker in self.workers:
            worker.wait_for_save()
            _, done = worker.get_finished(output.finished_req_ids)
            invalid |= worker.get_block_ids_with_load_errors()
            stats = worker.get_kv_connector_stats()
            if stats is not None:
                self.stats.update(stats.reduce())
            worker.clear_connector_metadata()
            for req_id in done or ():
                self._reports[req_id] += 1
                if self._reports[req_id] == len(self.workers):  # as vLLM's KVOutputAggregator counts
                    del self._reports[req_id]
                    recving.add(req_id)
        if invalid:
            self.invalid_blocks.append(invalid)
        self.recved |= recving
        kv_output = KVConnectorOutput(finished_sending=None, finished_recving=recving or None,
                                      invalid_block_ids=invalid)
        finish_step(self.scheduler, output, sampled, kv_output, self.stats, self.finished)
        return output

    def _forward(self, output: Any) -> dict[str, list[int]]:
        """Write every scheduled token's KV (each rank its heads), save layer by layer, sample."""
        starts: dict[str, int] = {}
        for new in output.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[0])
            starts[new.req_id] = int(new.num_computed_tokens)
            self.new_reqs.setdefault(new.req_id, new)
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if cached.new_block_ids[i]:
                self._blocks[req_id].extend(cached.new_block_ids[i][0])
            starts[req_id] = int(cached.num_computed_tokens[i])
        sampled: dict[str, list[int]] = {}
        for req_id, count in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            start = starts[req_id]
            positions = torch.arange(start, start + count)
            tokens = torch.tensor(list(request.all_token_ids)[start:start + count])
            blocks = torch.tensor(self._blocks[req_id])[positions // BLOCK_SIZE]
            for rank, caches in enumerate(self.caches):
                for index, name in enumerate(LAYERS):
                    caches[name][blocks, :, positions % BLOCK_SIZE, :] = kv_values(
                        tokens, positions, index, self.heads_of(rank))
            sampled[req_id] = [SAMPLED] if start + count >= request.num_tokens else []
        for worker, caches in zip(self.workers, self.caches, strict=True):
            for name, layer in caches.items():
                worker.save_kv_layer(name, layer, SimpleNamespace())
        return sampled

    def wait_saved(self) -> None:
        for worker in self.workers:
            wait_saved(worker, self.stats)

    def assert_loaded(self, req_id: str, prompt: list[int], stop: int) -> None:
        """Every rank's blocks of the request hold, for positions ``0..stop-1``, exactly its heads' values."""
        blocks = torch.tensor(self._blocks[req_id])
        positions = torch.arange(stop)
        tokens = torch.tensor(prompt[:stop])
        for rank, caches in enumerate(self.caches):
            for index, name in enumerate(LAYERS):
                got = caches[name][blocks[positions // BLOCK_SIZE], :, positions % BLOCK_SIZE, :]
                want = kv_values(tokens, positions, index, self.heads_of(rank))
                assert torch.equal(got, want), f"rank {rank}, {name}: pages differ from the heads' values"

    def clear_caches(self) -> None:
        for caches in self.caches:
            for layer in caches.values():
                layer.zero_()

    def assert_idle(self) -> None:
        self.step()
        assert not self.scheduler.requests
        manager = self.scheduler.kv_cache_manager
        assert manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
        c = self.connector.scheduler
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while c.discards.pending() or any(w.worker.discards.pending() for w in self.workers):
            assert time.monotonic() < deadline, "a discard did not finish"
            time.sleep(0.002)
        assert not (c._pending_loads or c._loading or c._requests)


@pytest.fixture(scope="module")
def four_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("mixed-tp") / "llama", layers=2, kv_heads=4, head_dim=64)


@pytest.fixture(scope="module")
def two_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("mixed-tp") / "llama", layers=2, kv_heads=2, head_dim=64)


@pytest.fixture
def make_engine(real_redis_url: str,
                monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., ShardedEngine]]:
    namespace = "t-mixed-tp-" + uuid.uuid4().hex[:10]
    engines: list[ShardedEngine] = []

    def make(model: Path, role: str, tp: int, **settings: Any) -> ShardedEngine:
        extra = {"url": real_redis_url, "namespace": namespace, "pop_timeout_s": 5.0, **settings}
        vllm_config = VllmConfig(
            model_config=ModelConfig(model=str(model), dtype="float32", seed=0, max_model_len=MAX_LEN),
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=TOKEN_BUDGET,
                                             max_model_len=MAX_LEN, enable_chunked_prefill=True,
                                             is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=BLOCK_SIZE, gpu_memory_utilization=0.9, cache_dtype="auto",
                                     enable_prefix_caching=True),
            parallel_config=ParallelConfig(tensor_parallel_size=tp),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVRedisConnector", kv_connector_module_path="kvredis.vllm", kv_role=role,
                kv_connector_extra_config=extra, kv_load_failure_policy="recompute"),
            device_config=DeviceConfig("cpu"),
        )
        vllm_config.cache_config.kv_cache_layout = "LBHNC"
        vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
        split = HeadSplit.of(vllm_config)
        kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(list(LAYERS), FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=split.width,
                                                             head_size=WIDTH // 2, dtype=torch.float32))])
        scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                              structured_output_manager=StructuredOutputManager(vllm_config),
                              block_size=BLOCK_SIZE, log_stats=True)
        workers, caches = [], []
        for rank in range(tp):
            monkeypatch.setattr(endpoint_module, "worker_tp_rank", lambda rank=rank: rank)
            worker = KVRedisConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
            layers = {name: torch.zeros(NUM_BLOCKS, split.width, BLOCK_SIZE, WIDTH) for name in LAYERS}
            worker.register_kv_caches(layers)
            workers.append(worker)
            caches.append(layers)
        engine = ShardedEngine(scheduler, workers, caches, split, real_redis_url, namespace)
        lookups_ready(engine.connector)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        for worker in engine.workers:
            worker.shutdown()
        engine.connector.shutdown()
    delete_namespace(real_redis_url, namespace)


def prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, 1024, (length,), generator=generator).tolist()


@pytest.mark.parametrize(("heads", "prefill_tp", "decode_tp"), [
    (4, 2, 1), (4, 1, 2), (4, 2, 2), (4, 4, 2), (4, 1, 4),
    (2, 4, 1), (2, 1, 4),  # more ranks than KV heads: each head is held by two ranks, stored once
], ids=lambda value: str(value))
def test_a_decode_of_another_tp_size_loads_every_head_at_its_slot(make_engine, four_heads: Path,
                                                                  two_heads: Path, heads: int,
                                                                  prefill_tp: int, decode_tp: int) -> None:
    """Transfer mode, announced by the prefill: each decode rank assembles its heads from the prefill's
    parts (a slice of one, or several side by side), every value lands at its slot, every rank counts the
    load, and no key is left once the decode took it."""
    model = four_heads if heads == 4 else two_heads
    producer = make_engine(model, "kv_producer", prefill_tp)
    consumer = make_engine(model, "kv_consumer", decode_tp)
    prompt = prompt_of(150, seed=prefill_tp * 10 + decode_tp)  # 5 chunks of 32 tokens, the last partial
    params = producer.produce("p", prompt)
    engine = params[TRANSFER_PARAM]["engine"]
    assert (engine["kv_heads"], engine["kv_parts"]) == (heads, min(prefill_tp, heads))
    written = redis_keys(producer.redis_url, producer.namespace)
    assert written, "the prefill stored nothing"
    consumer.add("c", prompt, params=params)
    consumer.run(lambda: "c" in consumer.new_reqs)
    assert "c" in consumer.recved and consumer.new_reqs["c"].num_computed_tokens == 149
    consumer.assert_loaded("c", prompt, 149)
    assert consumer.invalid_blocks == []
    assert consumer.stats["loaded_requests"] == decode_tp and consumer.stats["load_failures"] == 0
    # What a decode rank reads: the whole of every prefill part it holds heads of (a chunk stores a part's
    # pages [layers, pages, heads, ...], where a slice of the heads is not one byte range), plus headers.
    parts, reader_parts = min(prefill_tp, heads), min(decode_tp, heads)
    part_bytes = len(LAYERS) * 5 * (heads // parts) * BLOCK_SIZE * WIDTH * 4  # 5 pages: 149 positions
    per_rank = part_bytes * max(1, parts // reader_parts)
    assert per_rank * decode_tp <= consumer.stats["loaded_bytes"] <= per_rank * decode_tp * 1.02, \
        consumer.stats["loaded_bytes"]
    consumer.finish("c")
    consumer.assert_idle()
    producer.assert_idle()
    assert redis_keys(consumer.redis_url, consumer.namespace) == []


def test_one_copy_a_head_range_is_stored_however_many_ranks_hold_it(make_engine, two_heads: Path) -> None:
    """Four ranks, two KV heads: ranks 0-1 hold head 0, ranks 2-3 head 1; only ranks 0 and 2 write, under
    keys naming the heads (not the rank), so the pages are stored once."""
    producer = make_engine(two_heads, "kv_producer", 4, reuse=True)
    prompt = prompt_of(96, seed=5)
    producer.add("p", prompt, max_tokens=1)
    producer.finish("p")
    producer.wait_saved()
    keys = redis_keys(producer.redis_url, producer.namespace)
    prefixes = {key.decode().rsplit(":{", 1)[0] for key in keys}
    assert len(prefixes) == 2 and len(keys) == 2 * 2, keys  # two parts, two chunks (95 positions) each
    assert producer.stats["saved_requests"] == 2
    producer.assert_idle()


@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(2, 1), (1, 2), (4, 2)], ids=str)
def test_a_shared_prefix_written_at_one_tp_size_is_a_hit_at_another(make_engine, four_heads: Path,
                                                                    writer_tp: int, reader_tp: int) -> None:
    """Reuse mode, no announcement: the reader's lookup finds the prompt under the writer's split of heads
    (its own has none of it), and every rank loads its heads from there; the chunks stay for other
    readers."""
    writer = make_engine(four_heads, "kv_both", writer_tp, reuse=True)
    reader = make_engine(four_heads, "kv_both", reader_tp, reuse=True)
    prompt = prompt_of(130, seed=writer_tp * 10 + reader_tp)
    writer.add("w", prompt, max_tokens=1)
    writer.finish("w")
    writer.wait_saved()
    stored = redis_keys(writer.redis_url, writer.namespace)
    reader.add("r", prompt + prompt_of(20, seed=99))
    reader.run(lambda: "r" in reader.new_reqs)
    assert reader.new_reqs["r"].num_computed_tokens == 128  # every whole chunk of the written prompt
    reader.assert_loaded("r", prompt, 128)
    assert reader.stats["loaded_requests"] == reader_tp and reader.stats["load_failures"] == 0
    reader.finish("r")
    assert set(stored) <= set(redis_keys(reader.redis_url, reader.namespace))  # kept for the next reader
    reader.assert_idle()


def test_a_missing_shard_is_a_miss_for_the_ranks_that_needed_it(make_engine, four_heads: Path) -> None:
    """TP 2 -> 1: one of the prefill's parts lost a chunk (evicted): the decode rank gathering both parts
    has that chunk's heads only half, so the chunk and those after it are recomputed, never half a cache;
    the other part's chunks are released all the same."""
    producer = make_engine(four_heads, "kv_producer", 2)
    consumer = make_engine(four_heads, "kv_consumer", 1)
    prompt = prompt_of(150, seed=21)
    params = producer.produce("p", prompt)
    announced = params[TRANSFER_PARAM]
    shard, entry = announced["shards"][1], announced["entry"]
    client = redis.Redis.from_url(producer.redis_url)
    digests = record_digests(client.lindex(f"{shard}:t:{{{entry}}}", 0), entry, shard)
    assert len(digests) == 3  # 149 positions in chunks of 64
    assert client.delete(*[key for key in client.scan_iter(match=f"{shard}:c:*")
                           if digests[1] in key.decode() and not key.endswith(b":h")]) == 1
    client.close()
    consumer.add("c", prompt, params=params)
    consumer.finish("c")
    assert consumer.stats["load_failures"] == 1
    first_lost = announced["engine"]["chunk_tokens"] // BLOCK_SIZE  # chunk 1's first block
    assert consumer.invalid_blocks and min(consumer.invalid_blocks[0]) == consumer._blocks["c"][first_lost]
    consumer.assert_loaded("c", prompt, 149)  # recomputed from chunk 2 on: every value right
    consumer.assert_idle()
    assert redis_keys(consumer.redis_url, consumer.namespace) == []


def test_a_split_that_does_not_nest_is_named_and_computed(make_engine, four_heads: Path, caplog) -> None:
    """An announcement from a prefill whose heads are split in parts that do not nest with the decode's (as
    TP 4 and TP 6 of 12 heads would be) is computed at once, with the reason said once."""
    producer = make_engine(four_heads, "kv_producer", 2)
    consumer = make_engine(four_heads, "kv_consumer", 4)
    prompt = prompt_of(70, seed=31)
    params = producer.produce("p", prompt)
    params[TRANSFER_PARAM]["engine"]["kv_parts"] = 3
    consumer.add("c", prompt, max_tokens=1, params=params)
    assert consumer.step().num_scheduled_tokens["c"] == 70
    consumer.finish("c")
    said = [r.getMessage() for r in caplog.records if "tensor-parallel" in r.getMessage()]
    assert said and "KV heads in 3 tensor-parallel parts on prefill, 4 here" in said[0], said
    consumer.assert_idle()
    assert redis_keys(consumer.redis_url, consumer.namespace) == []


def test_heads_that_cannot_be_split_over_the_ranks_are_refused() -> None:
    with pytest.raises(ConfigError, match="cannot be split evenly"):
        HeadSplit(total=12, ranks=8)
    assert HeadSplit(12, 4).nests(2) and not HeadSplit(12, 4).nests(6)


def test_a_lookup_reads_the_split_holding_the_longest_prefix(make_engine, four_heads: Path) -> None:
    """Reuse: the reader's own split holds the prompt's first chunk (a TP 1 engine wrote a shorter prompt),
    a TP 2 engine's parts hold three: the reader loads the three from the TP 2 parts. Another split is asked
    for the one chunk that could make it longer before it is looked up whole: none holds it, none is."""
    short = make_engine(four_heads, "kv_both", 1, reuse=True)
    wide = make_engine(four_heads, "kv_both", 2, reuse=True)
    reader = make_engine(four_heads, "kv_both", 1, reuse=True)
    prompt = prompt_of(200, seed=41)
    for writer, length in ((short, 70), (wide, 200)):
        writer.add("w", prompt[:length], max_tokens=1)
        writer.finish("w")
        writer.wait_saved()
    scheduler = reader.connector.scheduler
    plan = stored_plan(scheduler.transfers, [*prompt, 5], "")
    assert scheduler._stored_positions((plan,), scheduler._sources_of(1)) == 64  # its own split: one chunk
    assert scheduler._may_hold_more(plan, 64) == [2]  # 4 parts hold nothing
    assert scheduler._may_hold_more(plan, 192) == []  # nobody holds chunk 3 of this prompt
    reader.add("r", [*prompt, 5, 6, 7])
    reader.run(lambda: "r" in reader.new_reqs)
    assert reader.new_reqs["r"].num_computed_tokens == 192
    reader.assert_loaded("r", prompt, 192)
    reader.finish("r")
    reader.assert_idle()
