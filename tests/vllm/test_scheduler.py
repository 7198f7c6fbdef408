"""KVRedisConnector under vLLM's real V1 ``Scheduler``, with worker-role connectors fed synthetic pages.

Each test drives two "engines" against one real Redis: a producer (kv_producer) and a consumer
(kv_consumer), each a real ``vllm.v1.core.sched.scheduler.Scheduler`` (which builds the scheduler-role
connector from ``kv_connector_module_path``) plus a worker-role ``KVRedisConnector`` holding paged layer
tensors ``[num_blocks, heads, block_size, 2 * head_size]``. :class:`Engine.step` plays vLLM's model
runner: bind the metadata, "compute" the scheduled tokens (each token's KV is a function of its id,
position and layer, so a page's bytes say where they came from), call ``save_kv_layer`` per layer,
``start_load_kv``, ``wait_for_save``, ``get_finished`` and ``get_block_ids_with_load_errors``, and hand
the scheduler a ``ModelRunnerOutput``. Every test ends with no request, block or Redis key left over.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm.version", reason="needs vLLM's CPU build (run with the vLLM environment's python)")

import redis
import torch
from conftest import BLOCK_SIZE
from redis_servers import RedisServer
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
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvredis.store import codec
from kvredis.store.announcement import TRANSFER_PARAM
from kvredis.store.chunk_keys import ChunkPlan
from kvredis.store.keys import new_entry_id
from kvredis.store.tally import read_tally
from kvredis.store.transfer import record_digests
from kvredis.vllm import KVRedisConnector
from kvredis.vllm import scheduler as scheduler_module
from kvredis.vllm import worker as worker_module

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
HEADS, WIDTH = 2, 128  # the tiny model's KV heads and 2 * head_size
NUM_BLOCKS = 64
MAX_LEN = 1024
TOKEN_BUDGET = 128  # prompts longer than this prefill in several chunks
SAMPLED = 7  # the token every fake forward "samples" (not EOS)

init_none_hash(sha256)


def kv_values(tokens: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
    """The KV a fake forward writes for tokens at positions: ``[n, HEADS, WIDTH]``, unique per input."""
    lane = torch.arange(HEADS * WIDTH, dtype=torch.float32).reshape(1, HEADS, WIDTH)
    return (tokens.float().reshape(-1, 1, 1) + positions.float().reshape(-1, 1, 1) / 1024.0
            + lane / 65536.0 + layer * 2048.0)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a.view(torch.int32), b.view(torch.int32)))


@dataclasses.dataclass
class Engine(Stepped):
    """One scheduler and one worker-role connector, stepped like vLLM's engine core and model runner."""

    scheduler: Scheduler
    worker: KVRedisConnector
    layers: dict[str, torch.Tensor]
    redis_url: str
    namespace: str
    stats: Counter[str] = dataclasses.field(default_factory=Counter)  # kv_connector_stats, as vLLM logs them
    samples: Counter[str] = dataclasses.field(default_factory=Counter)  # latency and size samples, by series
    finished: dict[str, Any] = dataclasses.field(default_factory=dict)  # request id -> final output
    recved: set[str] = dataclasses.field(default_factory=set)  # reported in finished_recving
    invalid_blocks: list[set[int]] = dataclasses.field(default_factory=list)
    snapshots: dict[str, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)
    new_reqs: dict[str, Any] = dataclasses.field(default_factory=dict)  # first NewRequestData per id
    scheduled: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # tokens per step, by id
    _blocks: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # The layers whose save_kv_layer hook runs (a full CUDA graph replay runs none).
    hooked_layers: set[str] = dataclasses.field(default_factory=lambda: set(LAYERS))
    num_blocks: int = NUM_BLOCKS  # in the KV cache, block 0 (the null block) included

    @property
    def connector(self) -> KVRedisConnector:
        """The scheduler-role connector vLLM built."""
        connector = self.scheduler.connector
        assert isinstance(connector, KVRedisConnector)
        return connector

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 2,
            params: dict[str, Any] | None = None, **fields: Any) -> Request:
        """Add a request; ``fields`` are more of ``Request``'s (``lora_request``, ``cache_salt``, ...)."""
        request = new_request(req_id, prompt, max_tokens, params, **fields)
        self.scheduler.add_request(request)
        return request

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def step(self) -> Any:
        """One engine step; returns the scheduler output."""
        output = self.scheduler.schedule()
        worker = self.worker
        worker.bind_connector_metadata(output.kv_connector_metadata)
        forward_context = SimpleNamespace(attn_metadata=None, no_compile_layers={})
        if output.has_sync_kv_loads:
            worker.start_load_kv(forward_context)
        sampled = self._forward(output) if output.total_num_scheduled_tokens else {}
        if not output.has_sync_kv_loads:
            worker.start_load_kv(forward_context)
        worker.wait_for_save()
        sending, recving = worker.get_finished(output.finished_req_ids)
        invalid = worker.get_block_ids_with_load_errors()
        stats = worker.get_kv_connector_stats()
        events = worker.get_kv_connector_kv_cache_events()  # as vLLM's model runner collects them
        worker.clear_connector_metadata()
        if invalid:
            self.invalid_blocks.append(set(invalid))
        self.recved |= set(recving or ())
        kv_output = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                      invalid_block_ids=invalid, kv_connector_stats=stats,
                                      kv_cache_events=events)
        finish_step(self.scheduler, output, sampled, kv_output, self.stats, self.finished, self.samples)
        return output

    def _forward(self, output: Any) -> dict[str, list[int]]:
        """Write the KV of every scheduled token into its block, save layer by layer, sample."""
        starts: dict[str, int] = {}
        for new in output.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[0])
            starts[new.req_id] = int(new.num_computed_tokens)
            self.new_reqs.setdefault(new.req_id, new)
        cached = output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set())
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            if req_id in resumed:
                self._blocks[req_id] = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                self._blocks[req_id].extend(new_blocks[0])
            starts[req_id] = int(cached.num_computed_tokens[i])
        sampled: dict[str, list[int]] = {}
        for req_id, count in output.num_scheduled_tokens.items():
            self.scheduled.setdefault(req_id, []).append(count)
            request = self.scheduler.requests[req_id]
            start = starts[req_id]
            positions = torch.arange(start, start + count)
            tokens = torch.tensor(list(request.all_token_ids)[start:start + count])
            blocks = torch.tensor(self._blocks[req_id])[positions // BLOCK_SIZE]
            for index, name in enumerate(LAYERS):
                self.layers[name][blocks, :, positions % BLOCK_SIZE, :] = kv_values(tokens, positions, index)
            sampled[req_id] = [SAMPLED] if start + count >= request.num_tokens else []
        for name, layer in self.layers.items():
            if name in self.hooked_layers:
                self.worker.save_kv_layer(name, layer, SimpleNamespace())
        for spec in output.kv_connector_metadata.saves:
            blocks = torch.tensor(self._blocks[spec.req_id][:-(-len(spec.token_ids) // BLOCK_SIZE)])
            self.snapshots[spec.req_id] = {name: layer[blocks].clone() for name, layer in self.layers.items()}
        return sampled

    def wait_saved(self) -> None:
        """Until the writer threads stored every entry handed to them (their counts join ``stats``)."""
        wait_saved(self.worker, self.stats, self.samples)

    def wait_loaded(self, req_id: str) -> None:
        """Until the request's load has finished, no step run: finished on its thread (reported with the next
        step), or so fast that the step which started it already reported it."""
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while req_id not in self.worker.worker._received and req_id not in self.recved:
            assert time.monotonic() < deadline, f"the load of {req_id} did not finish"
            time.sleep(0.002)

    def wait_discarded(self) -> None:
        """Until the scheduler's and the worker's threads deleted every unused announced entry handed to
        them."""
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while self.connector.scheduler.discards.pending() or self.worker.worker.discards.pending():
            assert time.monotonic() < deadline, "a discard did not finish"
            time.sleep(0.002)

    def assert_empty(self) -> None:
        """No request, block, load, save or connector state left over (after one more step)."""
        self.step()  # hands the last finished ids to the worker, as the next engine step would
        s = self.scheduler
        assert not s.requests and not s.running and len(s.waiting) == 0
        assert len(getattr(s, "kv_holding_waiting", ())) == 0
        assert not getattr(s, "deferred_waiting", ()) and not getattr(s, "_inflight_prefills", ())
        assert not s.finished_recving_kv_req_ids and not s.failed_recving_kv_req_ids
        assert not any(getattr(s, "_kv_fetch_counts", {}).values())
        manager = s.kv_cache_manager.coordinator.single_type_managers[0]
        assert not manager.req_to_blocks and not manager.num_cached_block
        assert self.free_blocks() == self.num_blocks - 1  # block 0 is the null block
        assert all(block.ref_cnt == 0 for block in s.kv_cache_manager.block_pool.blocks)
        c = self.connector.scheduler
        self.wait_discarded()
        assert not (c._pending_loads or c._loading or c._loaded_once or c._prefills or c._saved)
        assert not c._requests
        w = self.worker.worker
        assert not (w._gathered or w._received or w._failed or w._failed_reported)


def assert_nothing_left(*engines: Any) -> None:
    """Every engine idle with no request, block or load left, and no key left in their namespace."""
    for engine in engines:
        engine.assert_empty()
    assert redis_keys(engines[-1].redis_url, engines[-1].namespace) == []


@pytest.fixture
def make_engine(tiny_model: Path, real_redis_url: str) -> Iterator[Callable[..., Engine]]:
    """Build engines (scheduler + worker connector); all of one test share a fresh namespace."""
    namespace = "t-vllm-" + uuid.uuid4().hex[:10]
    engines: list[Engine] = []

    def make(role: str, url: str = real_redis_url, policy: str = "recompute", num_blocks: int = NUM_BLOCKS,
             scheduler_settings: dict[str, Any] | None = None, model_settings: dict[str, Any] | None = None,
             layers: tuple[str, ...] = LAYERS, vllm_settings: dict[str, Any] | None = None,
             **settings: Any) -> Engine:
        """``scheduler_settings`` and ``model_settings``: more of ``SchedulerConfig``'s and ``ModelConfig``'s
        fields; ``layers``: the paged caches (the fake forward writes ``LAYERS``); ``vllm_settings``: more of
        ``VllmConfig``'s (``kv_events_config``); ``settings``: the connector's."""
        extra = {"url": url, "namespace": namespace, "pop_timeout_s": 2.0, **settings}
        vllm_config = VllmConfig(
            model_config=ModelConfig(model=str(tiny_model), dtype="float32", seed=0, max_model_len=MAX_LEN,
                                     **(model_settings or {})),
            scheduler_config=SchedulerConfig(**{
                "max_num_seqs": 8, "max_num_batched_tokens": TOKEN_BUDGET, "max_model_len": MAX_LEN,
                "enable_chunked_prefill": True, "is_encoder_decoder": False, **(scheduler_settings or {})}),
            cache_config=CacheConfig(block_size=BLOCK_SIZE, gpu_memory_utilization=0.9,
                                     cache_dtype="auto", enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVRedisConnector", kv_connector_module_path="kvredis.vllm", kv_role=role,
                kv_connector_extra_config=extra, kv_load_failure_policy=policy),
            device_config=DeviceConfig("cpu"),
            **(vllm_settings or {}),
        )
        vllm_config.cache_config.kv_cache_layout = "LBHNC"  # the engine core resolves it before connectors
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(list(layers), FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS,
                                                             head_size=WIDTH // 2, dtype=torch.float32))])
        scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                              structured_output_manager=StructuredOutputManager(vllm_config),
                              block_size=BLOCK_SIZE, log_stats=True)
        worker = KVRedisConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        caches = {name: torch.zeros(num_blocks, HEADS, BLOCK_SIZE, WIDTH) for name in layers}
        worker.register_kv_caches(caches)
        engine = Engine(scheduler, worker, caches, url, namespace, num_blocks=num_blocks)
        lookups_ready(engine.connector)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.worker.shutdown()
        engine.connector.shutdown()
    delete_namespace(real_redis_url, namespace)


def prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, 1024, (length,), generator=generator).tolist()


def assert_pages_moved(producer: Engine, consumer: Engine, req_id: str, source_id: str,
                       first_block: int, num_blocks: int) -> None:
    """Blocks ``first_block..`` of the consumer's request hold exactly the producer's saved pages."""
    targets = torch.tensor(consumer.block_ids(req_id)[first_block:first_block + num_blocks], dtype=torch.long)
    assert len(targets) == num_blocks
    for name in LAYERS:
        sent = producer.snapshots[source_id][name][first_block:first_block + num_blocks]
        assert same_bits(consumer.layers[name][targets], sent), f"{name}: pages differ"


# -- hits -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [20, 32, 33, 65, 70, 300, 600], ids=lambda n: f"len{n}")
def test_hit_loads_the_pages_and_schedules_the_last_token(make_engine, length: int) -> None:
    """20 < one block; 33 and 65 are k*32+1 (the loaded part ends on a block edge); 300 prefills in chunks."""
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer")
    prompt = prompt_of(length, seed=length)
    params = producer.produce("p", prompt)
    assert TRANSFER_PARAM in params
    if length > TOKEN_BUDGET:
        assert len(producer.scheduled["p"]) > 1, "the prompt was meant to prefill in chunks"
    # The announcement names the transfer's record (the proxy releases a transfer whose decode failed by it).
    announced = params[TRANSFER_PARAM]
    record = f"{announced['shards'][0]}:t:{{{announced['entry']}}}".encode()
    assert record in redis_keys(consumer.redis_url, consumer.namespace)

    consumer.add("c", prompt, max_tokens=3, params=params)
    first = consumer.step()
    assert consumer.scheduler.requests["c"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert "c" not in first.num_scheduled_tokens
    consumer.run(lambda: "c" in consumer.recved)
    loaded_blocks = -(-(length - 1) // BLOCK_SIZE)
    assert_pages_moved(producer, consumer, "c", "p", 0, loaded_blocks)
    assert consumer.invalid_blocks == []

    consumer.run(lambda: "c" in consumer.new_reqs)
    assert consumer.new_reqs["c"].num_computed_tokens == length - 1
    assert consumer.scheduled["c"][0] == 1  # only the last prompt token is computed
    assert consumer.finish("c").new_token_ids
    assert consumer.stats["loaded_requests"] == 1 and consumer.stats["loaded_tokens"] == length - 1
    assert consumer.stats["load_failures"] == 0
    producer.assert_empty()  # steps once more: a save ends after its step, and is counted at the next
    assert producer.stats["saved_requests"] == 1 and producer.stats["saved_tokens"] == length
    consumer.assert_empty()
    assert redis_keys(consumer.redis_url, consumer.namespace) == []


def test_an_entry_found_in_redis_is_loaded_without_an_announcement(make_engine) -> None:
    """No kv_transfer_params: the scheduler looks the prompt up in Redis (LLEN) and loads an entry that a
    producer storing every prompt (KVREDIS_STORE_ALL_PROMPTS) left for any reader."""
    producer = make_engine("kv_producer", store_all_prompts=True)
    consumer = make_engine("kv_consumer")
    prompt = prompt_of(90, seed=1)
    producer.add("p", prompt, max_tokens=1)  # not a proxy's request: no do_remote_decode
    assert producer.finish("p").kv_transfer_params is None  # nothing announced
    producer.wait_saved()
    consumer.add("c", prompt)
    consumer.run(lambda: "c" in consumer.new_reqs)
    assert consumer.new_reqs["c"].num_computed_tokens == 89
    assert_pages_moved(producer, consumer, "c", "p", 0, 3)
    consumer.finish("c")
    assert_nothing_left(producer, consumer)


@pytest.fixture
def next_entry_id(monkeypatch: pytest.MonkeyPatch) -> str:
    """The id the producer gives its next entry, known before it runs (to announce it to a decode first)."""
    import kvredis.vllm.scheduler

    entry_id = new_entry_id()
    monkeypatch.setattr(kvredis.vllm.scheduler, "new_entry_id", lambda: entry_id)
    return entry_id


def announcement(prompt: list[int], entry_id: str) -> dict[str, Any]:
    """What a producer's answer says of the entry it writes (the engine's description left out)."""
    return {TRANSFER_PARAM: {"prompt_tokens": len(prompt), "entry": entry_id}}


def test_a_decode_that_arrives_before_the_entry_waits_for_it(make_engine, next_entry_id: str) -> None:
    """The proxy sends the decode as soon as prefill answers: the load waits (blocking pop), no recompute."""
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer", pop_timeout_s=5.0)
    prompt = prompt_of(100, seed=2)
    consumer.add("c", prompt, params=announcement(prompt, next_entry_id))
    consumer.step()
    consumer.step()  # the load is waiting in Redis now
    assert consumer.scheduler.requests["c"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    producer.produce("p", prompt, wait=False)
    consumer.run(lambda: "c" in consumer.new_reqs)
    assert consumer.new_reqs["c"].num_computed_tokens == 99
    assert_pages_moved(producer, consumer, "c", "p", 0, 4)
    consumer.finish("c")
    assert consumer.stats["loaded_requests"] == 1 and consumer.stats["load_failures"] == 0
    assert_nothing_left(producer, consumer)


def test_a_step_computing_nothing_waits_for_the_load_and_reports_it_as_it_ends(
    make_engine, next_entry_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a request waits for its KV, vLLM steps without pause (its worker polls its queue between steps,
    on the core, and GIL, the load needs): a step that computes nothing waits on the load instead, and
    reports it in the step it ends in."""
    monkeypatch.setattr(worker_module, "IDLE_STEP_WAIT_S", 300.0)  # a passing test never waits for it
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer", pop_timeout_s=60.0)
    prompt = prompt_of(100, seed=4)
    consumer.add("c", prompt, params=announcement(prompt, next_entry_id))
    with ThreadPoolExecutor(max_workers=1) as pool:
        # The prefill writes the entry a while after the decode began waiting for it.
        produced = pool.submit(lambda: (time.sleep(0.3), producer.produce("p", prompt, wait=False)))
        steps = consumer.run(lambda: "c" in consumer.recved)
        produced.result()
    # Stepping without the wait: one step per 2 ms of the harness for the prefill's 0.3 s and more.
    assert steps <= 3, f"{steps} steps while the load was in flight"
    consumer.run(lambda: "c" in consumer.new_reqs)
    assert consumer.new_reqs["c"].num_computed_tokens == 99
    assert_pages_moved(producer, consumer, "c", "p", 0, 4)
    consumer.finish("c")
    assert_nothing_left(producer, consumer)


def test_a_step_computing_nothing_waits_for_a_load_no_longer_than_its_bound(
    make_engine, next_entry_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request arriving while the only others wait for their KV is scheduled within the bound."""
    monkeypatch.setattr(worker_module, "IDLE_STEP_WAIT_S", 0.2)
    monkeypatch.setattr(scheduler_module, "_STEP_LOOKUP_WAIT_S", 30.0)  # m's lookup answered in its step
    consumer = make_engine("kv_consumer", pop_timeout_s=60.0)
    prompt = prompt_of(100, seed=5)
    consumer.add("c", prompt, params=announcement(prompt, next_entry_id))  # no prefill writes it yet
    started = time.monotonic()
    first = consumer.step()
    assert time.monotonic() - started >= 0.2
    assert "c" not in first.num_scheduled_tokens and "c" not in consumer.recved
    consumer.add("m", prompt_of(40, seed=6))
    second = consumer.step()
    assert second.num_scheduled_tokens.get("m") == 40
    consumer.finish("m")
    producer = make_engine("kv_producer")
    producer.produce("p", prompt)
    consumer.finish("c")
    assert consumer.stats["loaded_requests"] == 1 and consumer.stats["load_failures"] == 0
    assert_nothing_left(producer, consumer)


def test_a_step_that_computes_does_not_wait_for_loads(make_engine, next_entry_id: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests computing beside a load in flight are not held back by it."""
    monkeypatch.setattr(worker_module, "IDLE_STEP_WAIT_S", 300.0)
    # "m" is scheduled in the first step its lookup is answered in; a step before that computes nothing and
    # rightly waits for the load. The scheduler waits 5 ms a step for lookups, which a stalled VM overran
    # (1 run in 15): wait as long as it takes here, so that every one of m's steps computes.
    monkeypatch.setattr(scheduler_module, "_STEP_LOOKUP_WAIT_S", 30.0)
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer", pop_timeout_s=60.0)
    prompt = prompt_of(100, seed=7)
    consumer.add("c", prompt, params=announcement(prompt, next_entry_id))  # waits for an entry to come
    consumer.add("m", prompt_of(40, seed=8), max_tokens=3)
    consumer.finish("m")  # each of its steps would wait out the bound for the load in flight
    assert "c" not in consumer.recved and consumer.worker.worker._loads_in_flight == 1
    producer.produce("p", prompt)
    consumer.run(lambda: "c" in consumer.new_reqs)
    assert_pages_moved(producer, consumer, "c", "p", 0, 4)
    consumer.finish("c")
    assert_nothing_left(producer, consumer)


def test_an_entry_written_after_its_load_gave_up_is_deleted_when_it_lands(
    make_engine, next_entry_id: str
) -> None:
    """The prefill's write comes after the decode's pop bound (a stalled prefill): the decode computes the
    prompt, then deletes the entry when it lands instead of leaving it to its TTL."""
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer", pop_timeout_s=5.0)
    prompt = prompt_of(100, seed=4)
    consumer.add("c", prompt, max_tokens=1, params=announcement(prompt, next_entry_id))
    consumer.finish("c")  # the load waits out its bound; the prompt is computed
    assert consumer.stats["load_failures"] == 1 and consumer.new_reqs["c"].num_computed_tokens == 0
    producer.produce("p", prompt)  # lands now, as the entry announced to "c"
    consumer.wait_discarded()
    assert redis_keys(consumer.redis_url, consumer.namespace) == []
    consumer.assert_empty()  # one more step reports the discard's count
    assert consumer.stats["discarded_entries"] == 1
    assert_nothing_left(producer, consumer)


def test_an_announcement_for_other_tokens_is_not_waited_for(make_engine, caplog) -> None:
    """A decode handed the announcement of another prompt (a proxy mixing requests up, or engines that
    tokenize the prompt differently) computes at once, says so once, and leaves that entry to its request."""
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer", pop_timeout_s=60.0)
    written, asked = prompt_of(70, seed=71), prompt_of(70, seed=72)
    params = producer.produce("p", written)
    stored = redis_keys(consumer.redis_url, consumer.namespace)
    with caplog.at_level(logging.WARNING, logger="kvredis"):
        started = time.monotonic()
        consumer.add("c", asked, max_tokens=1, params=params)
        assert consumer.step().num_scheduled_tokens["c"] == 70  # computed now, nothing awaited
        consumer.finish("c")
        assert time.monotonic() - started < 30.0
    said = [r.getMessage() for r in caplog.records if "other prompt tokens" in r.getMessage()]
    assert len(said) == 1 and "request c" in said[0], said
    assert redis_keys(consumer.redis_url, consumer.namespace) == stored  # the other prompt's, untouched
    consumer.add("c2", written, max_tokens=1, params=params)
    consumer.run(lambda: "c2" in consumer.recved)
    consumer.finish("c2")
    assert consumer.stats["skipped_requests"] == 1 and consumer.stats["loaded_requests"] == 1
    assert consumer.stats["load_failures"] == 0
    assert_nothing_left(producer, consumer)


def test_a_miss_computes_the_prompt(make_engine) -> None:
    """Nothing in Redis, nothing announced: 0 external tokens, the whole prompt is computed at once."""
    consumer = make_engine("kv_consumer", pop_timeout_s=60.0)
    started = time.monotonic()
    consumer.add("c", prompt_of(70, seed=3))
    # Scheduled once Redis answered the lookup: at the first step unless the host stalls past the step's
    # few-millisecond wait for it, never after a pop's wait (60 s here).
    consumer.run(lambda: "c" in consumer.new_reqs)
    assert time.monotonic() - started < 30.0  # a lookup, not a wait
    assert consumer.new_reqs["c"].num_computed_tokens == 0
    assert consumer.scheduled["c"] == [70]  # the whole prompt at once
    consumer.finish("c")
    assert consumer.stats == Counter(lookup_tokens=69) and consumer.invalid_blocks == []  # found none
    consumer.assert_empty()


def test_local_prefix_hit_and_the_rest_loaded(make_engine) -> None:
    """The consumer holds the first two blocks in its prefix cache; only blocks 2.. come from Redis."""
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer")
    prefix = prompt_of(2 * BLOCK_SIZE, seed=4)
    consumer.add("warm", prefix + prompt_of(10, seed=5), max_tokens=1)
    consumer.finish("warm")
    local_blocks = consumer.new_reqs["warm"].block_ids[0][:2]  # freed now, but kept in the prefix cache
    prompt = prefix + prompt_of(39, seed=6)  # 103 tokens: 102 loadable, 64 of them local
    params = producer.produce("p", prompt)
    consumer.add("c", prompt, params=params)
    consumer.run(lambda: "c" in consumer.new_reqs)
    assert consumer.new_reqs["c"].num_computed_tokens == 102
    assert consumer.block_ids("c")[:2] == local_blocks
    assert consumer.stats["loaded_tokens"] == 102 - 2 * BLOCK_SIZE
    assert_pages_moved(producer, consumer, "c", "p", 0, 4)  # local blocks hold the same bytes
    consumer.finish("c")
    assert_nothing_left(producer, consumer)


CHUNK_TOKENS = 256  # the two tests below count chunks and pages at this length (not the default)
PAGE_BYTES = len(LAYERS) * HEADS * BLOCK_SIZE * WIDTH * 4  # one block of every layer, float32


def test_the_next_turn_moves_only_what_each_side_lacks(make_engine) -> None:
    """A chat's second turn: the decode, whose prefix cache holds the first turn, reads only the chunk
    covering the rest (held in part: read whole, written only into the blocks it lacks). Its pages are the
    prefill's. In transfer mode the first turn's chunks went with its decode, so the prefill writes both."""
    producer = make_engine("kv_producer", chunk_tokens=CHUNK_TOKENS)
    consumer = make_engine("kv_consumer", chunk_tokens=CHUNK_TOKENS)
    first = prompt_of(300, seed=90)
    consumer.add("c1", first, max_tokens=1, params=producer.produce("p1", first))
    consumer.finish("c1")
    producer.assert_empty()
    consumer.assert_empty()
    written, read = producer.stats["written_bytes"], consumer.stats["loaded_bytes"]
    assert producer.stats["written_chunks"] == 2 and read == written  # positions 0..298: two chunks

    second = first + prompt_of(120, seed=91)  # 420 tokens: chunk 0 as the first turn's, chunk 1 new
    params = producer.produce("p2", second)
    consumer.add("c2", second, params=params)
    consumer.run(lambda: "c2" in consumer.new_reqs)
    local = 9 * BLOCK_SIZE  # the first turn's whole blocks, in the decode's prefix cache
    assert consumer.block_ids("c2")[:9] == consumer.new_reqs["c1"].block_ids[0][:9]
    assert consumer.new_reqs["c2"].num_computed_tokens == len(second) - 1
    assert_pages_moved(producer, consumer, "c2", "p2", 9, -(-(len(second) - 1) // BLOCK_SIZE) - 9)
    consumer.finish("c2")
    producer.assert_empty()
    consumer.assert_empty()
    assert producer.stats["written_chunks"] == 4 and producer.stats["present_chunks"] == 0
    lacked = len(second) - 1 - local
    taken = consumer.stats["loaded_bytes"] - read
    assert consumer.stats["loaded_tokens"] == (len(first) - 1) + lacked
    # Chunk 1 only: positions 256..418, six pages (and its tokens and header), within the bound.
    one_chunk = CHUNK_TOKENS * (PAGE_BYTES // BLOCK_SIZE + 8) + 1024  # pages, token IDs, header
    assert 6 * PAGE_BYTES < taken <= -(-lacked // BLOCK_SIZE) * PAGE_BYTES + one_chunk
    assert producer.stats["written_bytes"] - written > taken  # chunk 0 was written, and not read
    assert_nothing_left(producer, consumer)


def test_prompts_sharing_a_prefix_in_flight_at_once_both_load(make_engine) -> None:
    """Two prompts with a 300-token common prefix, prefilled one after the other (the second finds the
    prefix's chunk stored and holds it), then decoded: the first decode's release leaves what the second
    still needs, and the second's deletes it."""
    producer = make_engine("kv_producer", chunk_tokens=CHUNK_TOKENS)
    consumer = make_engine("kv_consumer", chunk_tokens=CHUNK_TOKENS)
    prefix = prompt_of(300, seed=92)
    prompts = {"a": prefix + prompt_of(40, seed=93), "b": prefix + prompt_of(70, seed=94)}
    params = {name: producer.produce(f"p{name}", prompt) for name, prompt in prompts.items()}
    producer.assert_empty()
    assert producer.stats["written_chunks"] == 3 and producer.stats["present_chunks"] == 1
    for name, prompt in prompts.items():
        consumer.add(name, prompt, max_tokens=1, params=params[name])
    consumer.run(lambda: {"a", "b"} <= set(consumer.new_reqs))
    for name, prompt in prompts.items():
        assert consumer.new_reqs[name].num_computed_tokens == len(prompt) - 1
    consumer.finish("a")
    consumer.finish("b")
    assert consumer.stats["load_failures"] == 0
    assert_nothing_left(producer, consumer)


# -- failures ---------------------------------------------------------------------------------------


def _corrupt_chunk(url: str, namespace: str, index: int = 0) -> None:
    """Flip one payload byte of chunk ``index`` of the only transfer: its checksum no longer matches."""
    client = redis.Redis.from_url(url)
    try:
        (record,) = client.scan_iter(match=f"{namespace}:*:t:*")
        prefix, braced = record.decode().rsplit(":t:", 1)
        digest = record_digests(client.lindex(record, 0), braced.strip("{}"), prefix)[index]
        key = prefix + ":c:{" + digest + "}"
        chunk = bytearray(client.get(key))
        header = codec.read_header(bytes(chunk), max_payload_bytes=1 << 30)
        chunk[header.payload_offset + header.payload_nbytes - 5] ^= 0x40
        client.set(key, bytes(chunk), keepttl=True)
    finally:
        client.close()


def _plant_other_shape(consumer: Engine, prompt: list[int], entry_id: str) -> None:
    """A transfer under the consumer's own keys whose pages have another shape (one layer, half the width)."""
    transfers = consumer.worker.endpoint.transfers
    stored = prompt[:-1]  # the connector stores every position but the last
    pages = torch.zeros(1, -(-len(stored) // BLOCK_SIZE), HEADS, BLOCK_SIZE, WIDTH // 2)
    transfers.save(transfers.plan(stored), pages, transfer_id=entry_id)


@pytest.mark.parametrize("fault", ["missing", "corrupt", "other-shape"])
def test_a_failed_load_reports_its_blocks_and_the_request_is_recomputed(
    make_engine, caplog: pytest.LogCaptureFixture, fault: str
) -> None:
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer", pop_timeout_s=0.5)
    prompt = prompt_of(80, seed=7)
    if fault == "missing":  # announced, but the entry never comes (expired, evicted, never written)
        params = announcement(prompt, new_entry_id())
    else:
        params = producer.produce("p", prompt)
        if fault == "corrupt":
            _corrupt_chunk(consumer.redis_url, consumer.namespace)
        else:
            # Take the good entry away first, so the planted one is what the consumer finds.
            client = redis.Redis.from_url(consumer.redis_url)
            client.delete(*redis_keys(consumer.redis_url, consumer.namespace))
            client.close()
            _plant_other_shape(consumer, prompt, params[TRANSFER_PARAM]["entry"])
    with caplog.at_level(logging.WARNING, logger="kvredis"):
        consumer.add("c", prompt, max_tokens=2, params=params)
        consumer.step()
        blocks = consumer.block_ids("c")
        consumer.finish("c")
    assert consumer.invalid_blocks == [set(blocks)]  # all 3 blocks that were to be loaded
    assert "c" in consumer.recved  # still reported finished, so the scheduler moves on
    assert consumer.new_reqs["c"].num_computed_tokens == 0  # recomputed from the start ...
    assert sum(consumer.scheduled["c"][:-1]) == 80  # ... every prompt token (then one decode step)
    assert consumer.stats["load_failures"] == 1 and consumer.stats["loaded_requests"] == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "kvredis.vllm"]
    assert len(warnings) == 1 and "request c" in warnings[0], warnings
    assert_nothing_left(producer, consumer)


def test_a_chunk_received_in_place_that_fails_its_checksum_leaves_its_blocks_to_be_recomputed(
    make_engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages land straight in the request's blocks (the CPU caches); a chunk whose checksum fails there is a
    miss: its blocks and every later one are reported failed and recomputed, the earlier chunk's stay."""
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer", pop_timeout_s=5)
    prompt = prompt_of(200, seed=9)  # chunks of 64: positions 0..63, 64..127, 128..191, 192..198
    params = producer.produce("p", prompt)
    _corrupt_chunk(consumer.redis_url, consumer.namespace, index=1)
    placed: list[int] = []
    place = worker_module._BlockPlacement.__call__

    def counted(self: Any, index: int) -> Any:
        placed.append(index)
        return place(self, index)

    monkeypatch.setattr(worker_module._BlockPlacement, "__call__", counted)
    consumer.add("c", prompt, max_tokens=2, params=params)
    consumer.run(lambda: "c" in consumer.new_reqs)
    blocks = consumer.block_ids("c")
    assert_pages_moved(producer, consumer, "c", "p", 0, 64 // BLOCK_SIZE)
    consumer.finish("c")
    assert placed == [0, 1, 2, 3]  # every chunk was received into the blocks
    assert consumer.invalid_blocks == [set(blocks[64 // BLOCK_SIZE:])]  # from the damaged chunk on
    assert consumer.new_reqs["c"].num_computed_tokens == 64  # the first chunk loaded ...
    assert sum(consumer.scheduled["c"][:-1]) == 200 - 64  # ... the rest computed
    assert consumer.stats["load_failures"] == 1 and consumer.stats["failed_tokens"] == 199 - 64
    assert_nothing_left(producer, consumer)


def test_a_placement_lands_each_page_in_its_block_and_pages_side_by_side_in_one_range() -> None:
    """Where a chunk's pages are received: each loaded block's page of each layer, pages adjacent in memory
    as one range, a block the load must not write (the local prefix cache's) in scratch memory."""
    layers = [torch.zeros(10, 2, 4) for _ in range(2)]  # 10 pages of 32 bytes a layer
    views = [worker_module._PageViews.of(layer) for layer in layers]
    assert all(view is not None for view in views)
    plan = ChunkPlan.of(list(range(200)), 64)  # blocks of 32: chunk 1 is blocks 2-3, chunk 2 blocks 4-5
    table = [0, 8, 7, 4, 5, 6, 2]  # block -> page
    gate = worker_module._CacheWrites()
    placement = worker_module._BlockPlacement(plan, 32, range(3, 7), 1, False,
                                              [(view, table) for view in views if view is not None], gate)
    first = placement(1)
    assert [part.nbytes for part in first] == [32, 32, 32, 32]  # per layer: block 2 scratch, block 3 page 4
    second = placement(2)
    assert [part.nbytes for part in second] == [64, 64]  # per layer: pages 5 and 6, side by side
    assert gate._writers == 1  # held from the first placement ...
    for number, part in enumerate([*first, *second]):
        part[:] = bytes([number + 1]) * part.nbytes
    placement.done()
    assert gate._writers == 0  # ... until the load is over
    for row, layer in enumerate(layers):
        as_bytes = layer.view(torch.uint8).reshape(10, -1)
        assert (as_bytes[4] == 2 * row + 2).all()  # block 3
        assert (as_bytes[5] == 5 + row).all() and (as_bytes[6] == 5 + row).all()  # blocks 4, 5
        untouched = [page for page in range(10) if page not in (4, 5, 6)]
        assert (as_bytes[untouched] == 0).all()  # block 2's page 7 too: the prefix cache's, not written


@pytest.mark.parametrize("outcome", ["entry-arrives", "load-fails"])
def test_abort_while_loading_holds_the_blocks_until_the_worker_is_done(
    make_engine, next_entry_id: str, outcome: str
) -> None:
    """An aborted request's blocks stay allocated while its load may still write them, then are freed."""
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer", pop_timeout_s=1.0)
    prompt = prompt_of(100, seed=8)
    consumer.add("c", prompt, params=announcement(prompt, next_entry_id))
    consumer.step()  # allocates 4 blocks and starts the load, which waits in Redis
    held = NUM_BLOCKS - 1 - consumer.free_blocks()
    assert held == 4
    consumer.scheduler.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    for _ in range(3):
        consumer.step()
        assert NUM_BLOCKS - 1 - consumer.free_blocks() == held, "blocks freed while the load may write them"
        assert "c" in consumer.scheduler.requests
    if outcome == "entry-arrives":
        producer.produce("p", prompt, wait=False)
    consumer.run(lambda: "c" in consumer.recved)
    consumer.step()
    assert consumer.free_blocks() == NUM_BLOCKS - 1
    assert "c" not in consumer.finished  # aborted: no output
    if outcome == "entry-arrives":
        assert consumer.stats["loaded_requests"] == 1
    else:
        assert consumer.stats["load_failures"] == 1
    assert_nothing_left(producer, consumer)


@pytest.mark.parametrize("fault", ["killed", "stalled"])
def test_redis_down_lookups_fail_fast_and_pause(make_engine, redis_server, monkeypatch, fault: str) -> None:
    """With Redis gone or frozen, the scheduler's lookups neither stall the engine nor warn per request:
    one lookup fails within KVREDIS_LOOKUP_TIMEOUT_S, the next ones are skipped for a while."""
    import kvredis.vllm.scheduler

    server: RedisServer = redis_server()
    consumer = make_engine("kv_consumer", url=server.url, lookup_timeout_s=0.3)
    assert server.process is not None
    if fault == "killed":
        server.kill()
    else:
        os.kill(server.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        for i in range(3):
            consumer.add(f"c{i}", prompt_of(50, seed=20 + i), max_tokens=1)
        consumer.run(lambda: len(consumer.finished) == 3)
        assert time.monotonic() - started < 1.5
        assert consumer.stats["lookup_errors"] == 1  # one failed lookup, then a pause
    finally:
        if fault == "killed":
            server.start()
        else:
            os.kill(server.process.pid, signal.SIGCONT)
    monkeypatch.setattr(kvredis.vllm.scheduler, "_LOOKUP_PAUSE_S", 0.0)
    consumer.connector.scheduler._lookups_paused_until = 0.0
    consumer.add("after", prompt_of(50, seed=30), max_tokens=1)
    consumer.finish("after")
    assert consumer.stats["lookup_errors"] == 1  # Redis answers again
    consumer.assert_empty()


def test_an_outage_of_redis_is_warned_about_once_and_its_end_said(make_engine, redis_server, monkeypatch,
                                                                  caplog) -> None:
    """Lookups failing pause by pause through an outage: one warning (each failure still counted), then one
    line when Redis answers again."""
    import kvredis.vllm.scheduler

    server: RedisServer = redis_server()
    consumer = make_engine("kv_consumer", url=server.url, lookup_timeout_s=0.3)
    monkeypatch.setattr(kvredis.vllm.scheduler, "_LOOKUP_PAUSE_S", 0.0)  # every request looks up
    server.kill()
    with caplog.at_level(logging.DEBUG, logger="kvredis.vllm"):
        for i in range(3):
            consumer.add(f"down{i}", prompt_of(50, seed=40 + i), max_tokens=1)
            consumer.finish(f"down{i}")
        server.start()
        for i in range(2):
            consumer.add(f"up{i}", prompt_of(50, seed=45 + i), max_tokens=1)
            consumer.finish(f"up{i}")
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "kvredis.vllm" and r.levelno >= logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "cannot look up its KV in Redis" in warnings[0] and "answers lookups again" in warnings[1]
    assert consumer.stats["lookup_errors"] == 3
    consumer.assert_empty()


# -- small pieces -----------------------------------------------------------------------------------


def test_versions_outside_the_supported_range_are_refused_at_start_up() -> None:
    from kvredis.errors import ConfigError
    from kvredis.vllm import check_vllm_version

    for version in ("0.32.0", "0.33.1", "0.34.0rc1", "0.34.2+cpu"):
        check_vllm_version(version)
    for version in ("0.31.9", "0.35.0", "1.0.0", "dev"):
        with pytest.raises(ConfigError, match=r"0\.32 to 0\.34"):
            check_vllm_version(version)


def test_layers_left_unquantized_are_part_of_the_identity(make_engine) -> None:
    """``--kv-cache-dtype-skip-layers`` keeps some layers' pages in the model's dtype: engines that skip
    different layers never share entries, and the difference is named."""
    import copy

    from kvredis.vllm import cache_identity

    config = make_engine("kv_consumer").worker._vllm_config
    plain = cache_identity(config, 0)
    skipping = copy.deepcopy(config)
    skipping.cache_config.kv_cache_dtype_skip_layers = ["2", "0"]
    other = cache_identity(skipping, 0)
    assert other.kv_dtype == "float32 except layers 0,2" and plain.kv_dtype == "float32"
    assert other.digest() != plain.digest()


def test_each_parallel_rank_has_its_own_keys(make_engine) -> None:
    """Tensor- and pipeline-parallel ranks hold different shards: their entries must never mix."""
    from kvredis.vllm import cache_identity

    config = make_engine("kv_consumer").worker._vllm_config
    identities = {cache_identity(config, tp, pp).digest() for tp in range(2) for pp in range(2)}
    assert len(identities) == 4


# -- what decides an entry (issue: LoRA, multimodal, cache_salt) ------------------------------------


def _adapter(folder: Path, name: str, seed: int) -> Any:
    """A LoRA request naming an adapter folder with its own bytes (the scheduler only hashes them)."""
    from vllm.lora.request import LoRARequest

    path = folder / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 4, "peft_type": "LORA"}')
    (path / "adapter_model.safetensors").write_bytes(os.urandom(64) + bytes([seed]))
    return LoRARequest(lora_name=name, lora_int_id=seed, lora_path=str(path))


def _image(identifier: str, offset: int = 4, length: int = 16) -> Any:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def test_an_entry_written_for_one_adapter_is_never_loaded_for_another(make_engine, tmp_path: Path) -> None:
    """Same prompt, two adapters: B's request, announced with A's entry left by a client that went away,
    does not get A's KV; each request loads the entry its own prefill wrote."""
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer")
    lora_a, lora_b = _adapter(tmp_path, "a", 1), _adapter(tmp_path, "b", 2)
    prompt = prompt_of(70, seed=40)
    params_a = producer.produce("pa", prompt, lora_request=lora_a)  # its decode never comes
    params_b = producer.produce("pb", prompt, lora_request=lora_b)
    # The worst a proxy or client could do: hand B's request A's announcement. The announcement names the
    # context it was written for, so B's request is computed at once: no load is tried, nothing waits.
    consumer.add("wrong", prompt, max_tokens=1, params=params_a, lora_request=lora_b)
    consumer.finish("wrong")
    assert consumer.new_reqs["wrong"].num_computed_tokens == 0  # computed, A's entry not taken
    assert consumer.stats["loaded_requests"] == 0 and consumer.invalid_blocks == []
    assert consumer.stats["skipped_requests"] == 1
    consumer.add("b", prompt, params=params_b, lora_request=lora_b)
    consumer.run(lambda: "b" in consumer.new_reqs)
    assert consumer.new_reqs["b"].num_computed_tokens == 69
    assert_pages_moved(producer, consumer, "b", "pb", 0, 3)
    consumer.finish("b")
    # A's entry is still there for A's own decode; without the adapter the prompt finds nothing.
    consumer.add("plain", prompt, max_tokens=1)
    consumer.finish("plain")
    assert consumer.new_reqs["plain"].num_computed_tokens == 0
    consumer.add("a", prompt, params=params_a, lora_request=lora_a)
    consumer.finish("a")
    assert consumer.new_reqs["a"].num_computed_tokens == 69
    assert consumer.stats["loaded_requests"] == 2
    assert_nothing_left(producer, consumer)


def test_an_adapter_renamed_to_other_weights_gets_other_keys(tmp_path: Path) -> None:
    """The key holds the adapter's bytes: the same name pointed at new weights must not hit old entries;
    the same weights under another folder (the decode engine's own copy) must."""
    from vllm.lora.request import LoRARequest

    from kvredis.vllm.request_keys import AdapterDigests, request_context

    digests = AdapterDigests()
    first = _adapter(tmp_path / "one", "a", 1)
    same_bytes = tmp_path / "two" / "a"
    same_bytes.mkdir(parents=True)
    for item in Path(first.lora_path).iterdir():
        (same_bytes / item.name).write_bytes(item.read_bytes())
    copy = LoRARequest(lora_name="a", lora_int_id=1, lora_path=str(same_bytes))

    def context(lora: Any) -> str:
        return request_context(SimpleNamespace(lora_request=lora, mm_features=[], cache_salt=None,
                                               prompt_embeds=None), digests).digest

    assert context(first) == context(copy) != ""
    weights = Path(first.lora_path) / "adapter_model.safetensors"
    weights.write_bytes(b"retrained" + weights.read_bytes())
    assert context(first) != context(copy)
    elsewhere = LoRARequest(lora_name="a", lora_int_id=1, lora_path=str(tmp_path / "no"))
    assert context(elsewhere) != context(first)


def test_cache_salt_keeps_tenants_apart(make_engine) -> None:
    """An entry written under one salt is never loaded under another salt or under none."""
    producer, consumer = make_engine("kv_producer", store_all_prompts=True), make_engine("kv_consumer")
    prompt = prompt_of(80, seed=41)
    producer.add("p", prompt, max_tokens=1, cache_salt="tenant-a")
    producer.finish("p")
    producer.wait_saved()
    for req_id, salt in (("none", None), ("other", "tenant-b")):
        consumer.add(req_id, prompt, max_tokens=1, cache_salt=salt)
        consumer.finish(req_id)
        assert consumer.new_reqs[req_id].num_computed_tokens == 0, req_id
    assert len(redis_keys(consumer.redis_url, consumer.namespace)) == 2  # both chunks still there, untouched
    consumer.add("same", prompt, max_tokens=1, cache_salt="tenant-a")
    consumer.finish("same")
    assert consumer.new_reqs["same"].num_computed_tokens == 79
    assert consumer.stats["loaded_requests"] == 1
    assert_nothing_left(producer, consumer)


def test_multimodal_inputs_are_part_of_the_key(make_engine) -> None:
    """Same placeholder tokens, different images (or the same image elsewhere): different keys. The
    scheduler's lookup and the worker's store compute the same key for the same image."""
    from kvredis.vllm.request_keys import request_context

    consumer = make_engine("kv_consumer")
    prompt = prompt_of(60, seed=42)
    cat, dog = [_image("hash-of-cat")], [_image("hash-of-dog")]
    moved = [_image("hash-of-cat", offset=5)]
    requests = {name: Request(request_id=name, prompt_token_ids=prompt, sampling_params=SamplingParams(),
                              pooling_params=None, mm_features=features)
                for name, features in (("cat", cat), ("dog", dog), ("moved", moved), ("text", None))}
    contexts = {name: request_context(request).digest for name, request in requests.items()}
    assert len(set(contexts.values())) == 4 and contexts["text"] == ""
    again = Request(request_id="cat2", prompt_token_ids=prompt, sampling_params=SamplingParams(),
                    pooling_params=None, mm_features=[_image("hash-of-cat")])
    assert request_context(again).digest == contexts["cat"]
    # Chunks a producer's worker stores for the cat image are found for the cat only.
    transfers = consumer.worker.endpoint.transfers
    stored = prompt[:-1]  # the connector stores every position but the last
    transfers.save(transfers.plan(stored, contexts["cat"]),
                   torch.zeros(len(LAYERS), -(-len(stored) // BLOCK_SIZE), HEADS, BLOCK_SIZE, WIDTH))

    def answer(request: Request) -> tuple[int | None, bool]:
        # A step waits a few ms for its lookups; one Redis has not answered by then is asked again at the
        # next step, as vLLM does (a busy host can hold a lookup past one step's wait).
        deadline = time.monotonic() + 60
        while (found := consumer.connector.get_num_new_matched_tokens(request, 0))[0] is None:
            assert time.monotonic() < deadline, "the lookup was never answered"
            consumer.step()
        return found

    found = {name: answer(request) for name, request in requests.items()}
    assert found == {"cat": (59, True), "dog": (0, False), "moved": (0, False), "text": (0, False)}
    for request in requests.values():
        consumer.connector.request_finished(request, [])
    client = redis.Redis.from_url(consumer.redis_url)
    client.delete(*redis_keys(consumer.redis_url, consumer.namespace))
    client.close()


def test_images_are_not_moved_where_vllm_names_them_by_a_counter(tiny_model: Path, tmp_path: Path) -> None:
    """vLLM hashes an image's content unless prefix caching and the multimodal processor cache are both off;
    then it names it by a counter of the process, the same on every engine for its n-th image. Requests with
    images are unsupported there (never keyed by such a name); text-only requests are not affected."""
    from kvredis.stack.tinymodel import write_tiny_blip2
    from kvredis.vllm.engine import multimodal_inputs_hashed
    from kvredis.vllm.request_keys import request_context

    blip2 = write_tiny_blip2(tmp_path / "blip2")

    def hashed(model: Path, prefix_caching: bool, cache_gb: float) -> bool:
        settings = {"mm_processor_cache_gb": cache_gb} if model == blip2 else {}
        return multimodal_inputs_hashed(VllmConfig(
            model_config=ModelConfig(model=str(model), dtype="float32", max_model_len=MAX_LEN, **settings),
            cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching)))

    assert not hashed(blip2, prefix_caching=False, cache_gb=0)
    assert hashed(blip2, prefix_caching=True, cache_gb=0)
    assert hashed(blip2, prefix_caching=False, cache_gb=4)
    assert hashed(tiny_model, prefix_caching=False, cache_gb=0)  # no multimodal inputs at all

    prompt = prompt_of(60, seed=44)
    counted = Request(request_id="img", prompt_token_ids=prompt, sampling_params=SamplingParams(),
                      pooling_params=None, mm_features=[_image("renderer0-mm-1-image-0")])
    text = Request(request_id="text", prompt_token_ids=prompt, sampling_params=SamplingParams(),
                   pooling_params=None, mm_features=None, cache_salt="tenant")
    unhashed = request_context(counted, multimodal_hashed=False)
    assert unhashed.unsupported is not None and "counter" in unhashed.unsupported
    assert request_context(text, multimodal_hashed=False) == request_context(text)
    assert request_context(text).digest != ""


def test_prompt_embeddings_are_neither_saved_nor_loaded(make_engine, caplog) -> None:
    producer = make_engine("kv_producer", store_all_prompts=True)
    with caplog.at_level(logging.WARNING, logger="kvredis"):
        for req_id in ("e1", "e2"):
            producer.add(req_id, [0] * 40, max_tokens=1, prompt_embeds=torch.randn(40, 8),
                         params={"do_remote_decode": True})
            assert producer.finish(req_id).kv_transfer_params is None
    producer.assert_empty()
    assert producer.stats["skipped_requests"] == 2 and producer.stats["saved_requests"] == 0
    said = [r.getMessage() for r in caplog.records if "prompt embeddings" in r.getMessage()]
    assert len(said) == 1, said
    assert redis_keys(producer.redis_url, producer.namespace) == []


# -- who writes, who takes, what is left ------------------------------------------------------------


def test_a_producer_stores_only_prompts_a_decode_will_ask_for(make_engine) -> None:
    """Direct requests to a producer (or a kv_both instance's ordinary traffic) leave nothing in Redis."""
    for role in ("kv_producer", "kv_both"):
        engine = make_engine(role)
        engine.add(f"{role}-direct", prompt_of(50, seed=43), max_tokens=2)
        assert engine.finish(f"{role}-direct").kv_transfer_params is None
        engine.wait_saved()
        assert redis_keys(engine.redis_url, engine.namespace) == []
        assert engine.stats["saved_requests"] == 0
        engine.assert_empty()


def test_a_producer_that_stores_nothing_says_so_once_naming_the_setting(make_engine, caplog) -> None:
    """vLLM's offline flow (its LLM class, no proxy): no request asks for a remote decode, so nothing is
    stored. The producer says so once, naming store_all_prompts; not where it has stored a prompt already
    (a proxy's traffic, with a direct request beside it), nor with store_all_prompts."""

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "has stored nothing" in r.getMessage()]

    offline = make_engine("kv_producer")
    with caplog.at_level(logging.WARNING, logger="kvredis"):
        for req_id in ("offline-1", "offline-2"):
            offline.add(req_id, prompt_of(50, seed=45), max_tokens=2)
            assert offline.finish(req_id).kv_transfer_params is None
    assert len(said()) == 1, said()
    assert "request offline-1:" in said()[0]
    assert "KVREDIS_STORE_ALL_PROMPTS=1" in said()[0] and '"store_all_prompts": true' in said()[0]
    assert "kv_connector_extra_config" in said()[0]
    offline.wait_saved()
    assert redis_keys(offline.redis_url, offline.namespace) == []
    offline.assert_empty()

    caplog.clear()
    proxied, stores_all = make_engine("kv_producer"), make_engine("kv_producer", store_all_prompts=True)
    with caplog.at_level(logging.WARNING, logger="kvredis"):
        assert proxied.produce("proxied", prompt_of(50, seed=46))[TRANSFER_PARAM]["entry"]
        proxied.add("direct", prompt_of(50, seed=47), max_tokens=2)
        assert proxied.finish("direct").kv_transfer_params is None
        stores_all.add("stored", prompt_of(50, seed=48), max_tokens=2)
        stores_all.finish("stored")
        stores_all.wait_saved()
    assert said() == []
    stores_all.step()  # a writer thread's save is counted with the next step
    assert stores_all.stats["saved_requests"] == 1


def test_a_decode_takes_its_own_entry_not_an_older_one(make_engine) -> None:
    """Two prefills of one prompt: the first one's client went away. The decode announced with the second
    transfer takes that one at once; the chunks, which the second prefill found stored and did not write
    again, stay held by the older transfer (until its TTL), and its record is taken by nobody."""
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer")
    prompt = prompt_of(75, seed=44)
    old = producer.produce("old", prompt)[TRANSFER_PARAM]["entry"]
    params = producer.produce("new", prompt)
    new = params[TRANSFER_PARAM]["entry"]
    assert old != new
    started = time.monotonic()
    consumer.add("c", prompt, params=params)
    consumer.finish("c")
    assert time.monotonic() - started < STEP_TIMEOUT_S / 2
    assert consumer.new_reqs["c"].num_computed_tokens == 74
    left = [key.decode() for key in redis_keys(consumer.redis_url, consumer.namespace)]
    records = [key for key in left if ":t:" in key]
    assert records == [f"{consumer.worker.endpoint.transfers.record_key(old)}"], left
    client = redis.Redis.from_url(consumer.redis_url)
    holders = [key for key in left if key.endswith(":h")]
    assert holders and all(client.smembers(key) == {old.encode()} for key in holders), holders
    client.close()
    other = make_engine("kv_consumer")  # a decode whose prefix cache does not hold the prompt
    other.add("unannounced", prompt, max_tokens=1)  # finds the chunks: the same KV, loaded, left held
    other.finish("unannounced")
    assert other.new_reqs["unannounced"].num_computed_tokens == 74
    other.assert_empty()
    assert sorted(key.decode() for key in redis_keys(consumer.redis_url, consumer.namespace)) == sorted(left)
    client = redis.Redis.from_url(consumer.redis_url)
    client.delete(*left)
    client.close()
    producer.assert_empty()  # steps once more: the second save's counts are published then
    chunks = -(-(len(prompt) - 1) // producer.worker.endpoint.transfers.chunk_tokens)
    assert producer.stats["written_chunks"] == chunks and producer.stats["present_chunks"] == chunks
    consumer.assert_empty()


def test_an_announced_entry_covered_by_the_local_prefix_cache_is_deleted(make_engine) -> None:
    """The decode already holds the prompt (3 blocks + 1 token) in its prefix cache: it loads nothing and
    the announced entry is deleted at once, not left for a later request with the same tokens."""
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer")
    prompt = prompt_of(3 * BLOCK_SIZE + 1, seed=45)
    consumer.add("warm", prompt, max_tokens=1)
    consumer.finish("warm")
    params = producer.produce("p", prompt)
    assert redis_keys(consumer.redis_url, consumer.namespace)
    consumer.add("c", prompt, params=params)
    consumer.finish("c")
    assert consumer.new_reqs["c"].num_computed_tokens == 3 * BLOCK_SIZE  # from its own cache
    consumer.wait_discarded()
    assert redis_keys(consumer.redis_url, consumer.namespace) == []
    producer.assert_empty()
    consumer.assert_empty()  # one more step: the count comes with it
    assert consumer.stats["discarded_entries"] == 1 and consumer.stats["loaded_requests"] == 0


def test_an_announced_request_aborted_before_loading_deletes_its_entry(make_engine) -> None:
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer")
    prompt = prompt_of(90, seed=46)
    params = producer.produce("p", prompt)
    consumer.add("c", prompt, params=params)
    consumer.scheduler.finish_requests("c", RequestStatus.FINISHED_ABORTED)  # before any step
    consumer.wait_discarded()
    assert redis_keys(consumer.redis_url, consumer.namespace) == []
    producer.assert_empty()
    consumer.assert_empty()
    assert consumer.stats["discarded_entries"] == 1 and consumer.stats["loaded_requests"] == 0


@pytest.mark.parametrize("stand_in", [True, False], ids=["serving-layer-rejection", "engine-paused"])
def test_a_request_vllm_refuses_releases_its_transfer(make_engine, caplog, stand_in: bool) -> None:
    """vLLM's clean-up of a decode request it refused: the serving layer, when a request with
    do_remote_prefill fails validation, adds a one-token stand-in ([0], the real id and kv_transfer_params,
    no adapter or salt) with abort_immediately; 0.34 does the same with the real request when the engine is
    paused. The connector releases the announced transfer either way, without a warning about the stand-in's
    tokens or context, and counts nothing skipped."""
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer")
    prompt = prompt_of(90, seed=146)
    params = producer.produce("p", prompt, cache_salt="tenant-a")
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert redis_keys(consumer.redis_url, consumer.namespace)
    with caplog.at_level(logging.WARNING, logger="kvredis"):
        if stand_in:
            request = consumer.add("c", [0], max_tokens=1, params=dict(params))
        else:
            request = consumer.add("c", prompt, params=dict(params), cache_salt="tenant-a")
        request.abort_immediately = True  # what EngineCore.add_request reads before aborting it
        consumer.scheduler.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    consumer.wait_discarded()
    assert redis_keys(consumer.redis_url, consumer.namespace) == []
    assert not [r for r in caplog.records if r.name.startswith("kvredis")], caplog.text
    producer.assert_empty()
    consumer.assert_empty()
    assert consumer.stats["discarded_entries"] == 1
    assert "skipped_requests" not in consumer.stats and consumer.stats["loaded_requests"] == 0


def test_an_entry_from_an_engine_configured_differently_is_not_waited_for(make_engine, caplog) -> None:
    """The announcement says what the prefill engine wrote for; a decode that differs computes at once,
    says once what differs, and deletes the entry (which cannot fit)."""
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer", pop_timeout_s=60.0)
    with caplog.at_level(logging.WARNING, logger="kvredis"):
        for index in range(2):
            prompt = prompt_of(70, seed=47 + index)
            params = producer.produce(f"p{index}", prompt)
            params[TRANSFER_PARAM]["engine"]["block_size"] = 16  # as a prefill run with --block-size 16
            started = time.monotonic()
            consumer.add(f"c{index}", prompt, max_tokens=1, params=params)
            first = consumer.step()
            assert first.num_scheduled_tokens[f"c{index}"] == 70  # computed now, nothing awaited
            consumer.finish(f"c{index}")
            assert time.monotonic() - started < 5.0
    said = [r.getMessage() for r in caplog.records if "configured differently" in r.getMessage()]
    assert len(said) == 1 and "block size 16 on prefill, 32 here" in said[0], said
    consumer.wait_discarded()
    assert redis_keys(consumer.redis_url, consumer.namespace) == []
    producer.assert_empty()
    consumer.assert_empty()
    assert consumer.stats["skipped_requests"] == 2 and consumer.stats["discarded_entries"] == 2


def test_an_entry_from_a_model_with_other_positions_is_not_loaded(make_engine, caplog) -> None:
    """Same model path, dtype and layout, but the prefill's rotary embeddings were changed with
    ``--hf-overrides`` (its cached keys differ for every token): the decode computes the prompt, says why
    once, and the entry is deleted; an engine alike in every setting still loads."""
    positions = {"hf_overrides": {"rope_parameters": {"rope_theta": 20000.0, "rope_type": "default"}}}
    producer = make_engine("kv_producer", model_settings=positions)
    consumer = make_engine("kv_consumer", pop_timeout_s=60.0)
    assert producer.worker.endpoint.identity.digest() != consumer.worker.endpoint.identity.digest()
    prompt = prompt_of(70, seed=61)
    with caplog.at_level(logging.WARNING, logger="kvredis"):
        consumer.add("c", prompt, max_tokens=1, params=producer.produce("p", prompt))
        assert consumer.step().num_scheduled_tokens["c"] == 70  # computed now, nothing awaited
        consumer.finish("c")
    said = [r.getMessage() for r in caplog.records if "configured differently" in r.getMessage()]
    assert len(said) == 1 and "model weights and settings" in said[0], said
    consumer.wait_discarded()
    consumer.assert_empty()  # one more step reports the counts of the discard
    assert consumer.stats["skipped_requests"] == 1 and consumer.stats["discarded_entries"] == 1

    alike = make_engine("kv_consumer", model_settings=positions)
    prompt = prompt_of(70, seed=62)
    alike.add("c2", prompt, max_tokens=1, params=producer.produce("p2", prompt))
    alike.run(lambda: "c2" in alike.recved)
    assert alike.stats["loaded_requests"] == 1
    alike.finish("c2")
    assert_nothing_left(producer, consumer, alike)


def test_a_decode_with_more_cache_layers_is_named_not_waited_on(make_engine, caplog) -> None:
    """A decode whose KV caches hold layers the prefill's do not (a speculative decoder's draft layers, on
    the decode alone): the entry cannot fill them, so the decode computes the prompt at once, says why once
    and deletes the entry, rather than taking it and failing the load (which fails the request under
    vLLM's default policy)."""
    producer = make_engine("kv_producer")
    consumer = make_engine("kv_consumer", layers=(*LAYERS, "drafter.layers.0.self_attn.attn"),
                           pop_timeout_s=60.0)
    prompt = prompt_of(70, seed=64)
    with caplog.at_level(logging.WARNING, logger="kvredis"):
        started = time.monotonic()
        consumer.add("c", prompt, max_tokens=1, params=producer.produce("p", prompt))
        assert consumer.step().num_scheduled_tokens["c"] == 70  # computed now, nothing awaited
        consumer.finish("c")
        assert time.monotonic() - started < 5.0
    said = [r.getMessage() for r in caplog.records if "configured differently" in r.getMessage()]
    assert len(said) == 1 and "KV cache layers 2 on prefill, 3 here" in said[0], said
    consumer.wait_discarded()
    consumer.assert_empty()
    assert consumer.stats["skipped_requests"] == 1 and consumer.stats["discarded_entries"] == 1
    assert consumer.stats["load_failures"] == 0
    assert_nothing_left(producer, consumer)


def test_a_save_late_enough_to_outlast_a_decode_is_reported(make_engine, monkeypatch, caplog) -> None:
    """An entry that reaches Redis after half the pop bound may come after its decode gave up: the producer
    says so, and how long the writer waited for a thread and for Redis; a prompt saved in time is not
    reported. The connector's clock moves only when the slow insert says so: a VM pause cannot make the
    prompt saved in time late."""
    clock = [1000.0]
    monkeypatch.setattr(worker_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    producer = make_engine("kv_producer", pop_timeout_s=0.4)
    save = producer.worker.endpoint.transfers.save

    def slow_save(*args: Any, **kwargs: Any) -> Any:
        clock[0] += 0.3
        return save(*args, **kwargs)

    with caplog.at_level(logging.WARNING, logger="kvredis"):
        producer.produce("fast", prompt_of(70, seed=65))
        monkeypatch.setattr(producer.worker.endpoint.transfers, "save", slow_save)
        producer.produce("slow", prompt_of(70, seed=66))
    said = [r.getMessage() for r in caplog.records if "reached Redis" in r.getMessage()]
    assert said == [
        "request slow: its KV reached Redis 0.3 s after its prefill step (0.0 s waiting for a writer thread, "
        "0.3 s writing); a decode waits up to 0.4 s (KVREDIS_POP_TIMEOUT_S); CPU engines on one machine need "
        "cores of their own (VLLM_CPU_OMP_THREADS_BIND), or a waiting decode can hold the prefill back"], said
    producer.assert_empty()
    assert producer.stats["saved_requests"] == 2  # the entries expire unread; the fixture deletes them


@pytest.mark.parametrize("hooked", ["none", "first-layer"])
def test_a_prefill_whose_layer_hooks_did_not_run_is_still_saved_whole(make_engine, hooked: str) -> None:
    """A full CUDA graph replay (or a compiled region) runs no save_kv_layer: the pages are copied from the
    registered caches in wait_for_save, and the decode gets exactly the prefill's KV."""
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer")
    producer.hooked_layers = set() if hooked == "none" else {LAYERS[0]}
    prompt = prompt_of(3 * BLOCK_SIZE + 1, seed=49)  # the last step prefills one token
    params = producer.produce("p", prompt)
    consumer.add("c", prompt, params=params)
    consumer.run(lambda: "c" in consumer.new_reqs)
    assert consumer.new_reqs["c"].num_computed_tokens == 3 * BLOCK_SIZE
    assert_pages_moved(producer, consumer, "c", "p", 0, 3)
    consumer.finish("c")
    producer.assert_empty()
    assert producer.stats["saved_requests"] == 1 and producer.stats["save_failures"] == 0
    consumer.assert_empty()


# -- start-up checks --------------------------------------------------------------------------------


def test_a_fail_load_policy_is_warned_about_at_start_up(make_engine, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="kvredis"):
        make_engine("kv_consumer", policy="fail")
    said = [r.getMessage() for r in caplog.records if "kv_load_failure_policy" in r.getMessage()]
    assert len(said) == 1 and '"recompute"' in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvredis"):
        make_engine("kv_consumer", policy="recompute")
        make_engine("kv_producer", policy="fail")  # a producer loads nothing
    assert not [r for r in caplog.records if "kv_load_failure_policy" in r.getMessage()]


def test_configurations_the_pages_cannot_express_are_refused() -> None:
    from vllm.v1.kv_cache_interface import CrossAttentionSpec, SlidingWindowSpec

    from kvredis.errors import ConfigError
    from kvredis.vllm import refuse_unsupported
    from kvredis.vllm.cache_groups import cache_series

    def config(dcp: int = 1, pcp: int = 1) -> Any:
        return SimpleNamespace(parallel_config=SimpleNamespace(decode_context_parallel_size=dcp,
                                                               prefill_context_parallel_size=pcp))

    full = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=WIDTH // 2,
                             dtype=torch.float32)
    window = SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=WIDTH // 2,
                               dtype=torch.float32, sliding_window=128)
    one = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["a"], full)])
    assert [(s.tag, s.kind) for s in cache_series(one)] == [("", "full")]  # a plain model keeps its keys
    refuse_unsupported(config())
    with pytest.raises(ConfigError, match=r"-dcp"):
        refuse_unsupported(config(dcp=2))
    with pytest.raises(ConfigError, match=r"-pcp"):
        refuse_unsupported(config(pcp=2))
    # Kinds of layers kvredis cannot store are refused when their series are made.
    cross = CrossAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=WIDTH // 2,
                               dtype=torch.float32)
    encoder_decoder = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["a"], full), KVCacheGroupSpec(["x"], cross)])
    with pytest.raises(ConfigError, match="CrossAttentionSpec"):
        cache_series(encoder_decoder)
    hybrid = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["a"], full), KVCacheGroupSpec(["b"], window), KVCacheGroupSpec(["c"], window)])
    assert [(s.tag, s.kind, s.layers, s.layer_groups) for s in cache_series(hybrid)] == [
        ("", "full", ("a",), (0,)), ("w128", "window", ("b", "c"), (1, 2))]


def test_no_exception_escapes_a_load_without_its_blocks_reported(make_engine, monkeypatch) -> None:
    """Page arithmetic that raises (as decode context parallelism would) still ends the load: the request's
    blocks are reported and it is recomputed, not left waiting."""
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer")
    prompt = prompt_of(70, seed=50)
    params = producer.produce("p", prompt)

    def broken(*args: Any) -> None:
        raise IndexError("block table shorter than the span")

    # Both ways pages reach blocks: received in place (the CPU caches here) and written after the read.
    monkeypatch.setattr(consumer.worker.worker, "_in_place", broken)
    monkeypatch.setattr(consumer.worker.worker, "_write_chunks", broken)
    consumer.add("c", prompt, max_tokens=1, params=params)
    consumer.finish("c")
    assert "c" in consumer.recved and len(consumer.invalid_blocks) == 1
    assert consumer.stats["load_failures"] == 1
    producer.assert_empty()
    consumer.assert_empty()
    left = redis_keys(consumer.redis_url, consumer.namespace)
    if left:  # the load failed before taking the entry
        client = redis.Redis.from_url(consumer.redis_url)
        client.delete(*left)
        client.close()


# -- reuse: a shared prefix cache (issue 23) --------------------------------------------------------------


def test_in_reuse_mode_another_prefill_loads_the_stored_prefix_and_writes_only_the_rest(make_engine) -> None:
    """Two prefill instances and a decode, all in reuse mode: the second prefill finds the first one's
    chunks of a common prefix, loads them instead of computing them (its pages are the first prefill's) and
    writes only its new chunks; its decode loads what it lacks; the chunks stay, nothing else does."""
    first, second = make_engine("kv_producer", reuse=True), make_engine("kv_producer", reuse=True)
    decode = make_engine("kv_consumer", reuse=True)
    shared = prompt_of(300, seed=95)
    first.add("a", shared, max_tokens=1)  # no decode behind it: in reuse mode it is stored all the same
    assert first.finish("a").kv_transfer_params is None
    first.wait_saved()
    first.assert_empty()
    assert first.stats["written_chunks"] == 5  # positions 0..298: four whole chunks of 64, one of 43
    prompt = shared + prompt_of(120, seed=96)
    params = second.produce("b", prompt)
    stored = 4 * 64  # the short fifth chunk of the first prompt is not a chunk of this one
    assert second.new_reqs["b"].num_computed_tokens == stored  # loaded, not computed
    assert sum(second.scheduled["b"]) == len(prompt) - stored
    blocks = torch.tensor(second.new_reqs["b"].block_ids[0][:stored // BLOCK_SIZE])  # freed, not reused yet
    for name in LAYERS:
        assert same_bits(second.layers[name][blocks], first.snapshots["a"][name][:stored // BLOCK_SIZE])
    second.assert_empty()
    assert second.stats["loaded_tokens"] == stored and second.stats["found_tokens"] == stored
    assert second.stats["lookup_tokens"] == len(prompt) - 1
    assert (second.stats["present_chunks"], second.stats["written_chunks"]) == (4, 3)  # 256..418 new
    # Copied out of the second prefill's caches: the pages of the chunks its lookup did not find, no more.
    page = sum(second.layers[name][0].numel() * second.layers[name].element_size() for name in LAYERS)
    assert first.stats["copied_bytes"] == -(-(len(shared) - 1) // BLOCK_SIZE) * page
    assert second.stats["copied_bytes"] == (-(-(len(prompt) - 1) // BLOCK_SIZE) - stored // BLOCK_SIZE) * page
    decode.add("c", prompt, params=params)
    decode.run(lambda: "c" in decode.new_reqs)
    assert decode.new_reqs["c"].num_computed_tokens == len(prompt) - 1
    assert_pages_moved(second, decode, "c", "b", stored // BLOCK_SIZE, -(-(len(prompt) - 1) // BLOCK_SIZE)
                       - stored // BLOCK_SIZE)
    assert_pages_moved(first, decode, "c", "a", 0, stored // BLOCK_SIZE)
    decode.finish("c")
    decode.assert_empty()
    for engine in (first, second, decode):
        engine.connector.scheduler._tally.flush()  # what vLLM's steps send within a second
    # The namespace's tally (kvredis stats' hit rate): the engines' lookups together (the decode's was
    # announced, so it looked nothing up).
    tally = read_tally(decode.connector.scheduler.endpoint.store, decode.namespace)
    looked_up = first.stats["lookup_tokens"] + second.stats["lookup_tokens"]
    assert (tally["lookup_tokens"], tally["found_tokens"]) == (looked_up, stored)
    keys = redis_keys(decode.redis_url, decode.namespace)
    assert len(keys) == 5 + 3 and all(b":c:" in key and not key.endswith(b":h") for key in keys), keys


def test_in_reuse_mode_a_prompt_redis_holds_whole_is_copied_out_of_no_cache(make_engine) -> None:
    """A prompt another prefill stored whole is loaded, not copied out of the second prefill again (no page
    of it), and its transfer to a decode still goes through (the record names every chunk)."""
    first, second = make_engine("kv_producer", reuse=True), make_engine("kv_producer", reuse=True)
    decode = make_engine("kv_consumer", reuse=True)
    prompt = prompt_of(257, seed=98)  # positions 0..255: four whole chunks
    first.add("a", prompt, max_tokens=1)
    first.finish("a")
    first.wait_saved()
    first.assert_empty()
    params = second.produce("b", prompt)
    second.wait_saved()
    assert second.new_reqs["b"].num_computed_tokens == len(prompt) - 1
    assert second.stats["copied_bytes"] == 0 and second.stats["written_chunks"] == 0
    assert second.stats["present_chunks"] == 4
    decode.add("c", prompt, params=params)
    decode.run(lambda: "c" in decode.new_reqs)
    assert decode.new_reqs["c"].num_computed_tokens == len(prompt) - 1
    assert_pages_moved(first, decode, "c", "a", 0, (len(prompt) - 1) // BLOCK_SIZE)
    decode.finish("c")
    decode.assert_empty()


def test_in_reuse_mode_a_chunk_gone_since_the_lookup_is_not_written_from_nothing(make_engine) -> None:
    """A chunk the lookup found but Redis lost before the save (evicted): the save writes the chunks it
    copied, never the lost one from pages it does not have; the next prefill of the prefix writes it."""
    first, second = make_engine("kv_producer", reuse=True), make_engine("kv_producer", reuse=True)
    shared = prompt_of(129, seed=99)  # two whole chunks
    first.add("a", shared, max_tokens=1)
    first.finish("a")
    first.wait_saved()
    first.assert_empty()
    prompt = shared + prompt_of(100, seed=100)
    store = second.connector.scheduler.transfers
    plan = store.plan(prompt[:-1])
    lost = store.chunks.keys.chunk(plan.digests[1])
    scheduler = second.connector.scheduler
    original = scheduler._completed_prefills

    evicted: list[int] = []

    def evict_then_complete(output: Any) -> Any:  # once, between the lookup and the save
        if not evicted:
            client = redis.Redis.from_url(second.redis_url)
            evicted.append(client.delete(lost))
            client.close()
        return original(output)

    scheduler._completed_prefills = evict_then_complete
    second.add("b", prompt, max_tokens=1)
    second.finish("b")
    second.wait_saved()
    second.assert_empty()
    assert evicted == [1] and second.stats["found_tokens"] == 128
    assert second.stats["written_chunks"] == 2 and second.stats["present_chunks"] == 2  # chunk 1 not there
    keys = redis_keys(second.redis_url, second.namespace)
    assert lost.encode() not in keys
    scheduler._completed_prefills = original
    first.add("a2", prompt, max_tokens=1)  # its lookup finds chunk 0 only: it computes and writes chunk 1
    first.finish("a2")
    first.wait_saved()
    assert lost.encode() in redis_keys(first.redis_url, first.namespace)


def test_in_reuse_mode_a_salted_request_finds_nothing_of_another_tenant(make_engine) -> None:
    first, second = make_engine("kv_producer", reuse=True), make_engine("kv_producer", reuse=True)
    prompt = prompt_of(200, seed=97)
    first.add("a", prompt, max_tokens=1, cache_salt="tenant-a")
    first.finish("a")
    first.wait_saved()
    first.assert_empty()
    second.produce("b", prompt, cache_salt="tenant-b")
    assert second.new_reqs["b"].num_computed_tokens == 0
    second.assert_empty()
    assert second.stats["found_tokens"] == 0 and second.stats["loaded_tokens"] == 0
    assert second.stats["written_chunks"] == first.stats["written_chunks"] == 4  # each tenant its own
    second.add("b2", prompt, max_tokens=1, cache_salt="tenant-a")  # the same tenant again: found, all of it
    second.finish("b2")
    assert second.new_reqs["b2"].num_computed_tokens == len(prompt) - 1
    second.assert_empty()


def test_a_lookup_redis_has_not_answered_is_not_yet_and_holds_no_step(make_engine, redis_server) -> None:
    """Redis frozen while a request is looked up: vLLM is told "not yet" and steps on (a running request
    decodes a token a step; a step that waited would wait out the 30 s lookup bound and count an error), and
    once Redis answers, the request loads what it holds."""
    server: RedisServer = redis_server()
    assert server.process is not None
    producer = make_engine("kv_producer", url=server.url, reuse=True)
    engine = make_engine("kv_consumer", url=server.url, reuse=True, lookup_timeout_s=30.0)
    prompt = prompt_of(200, seed=98)
    producer.add("a", prompt, max_tokens=1)
    producer.finish("a")
    producer.wait_saved()
    producer.assert_empty()
    engine.add("running", prompt_of(40, seed=99), max_tokens=1000)
    engine.run(lambda: "running" in engine.new_reqs)
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        engine.add("late", prompt, max_tokens=1)
        for _ in range(20):
            output = engine.step()
            assert output.num_scheduled_tokens == {"running": 1}
        assert engine.connector.scheduler._requests["late"].lookup is not None  # still out, not given up
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    engine.finish("late")
    assert engine.new_reqs["late"].num_computed_tokens == len(prompt) - 1  # all it asks for, from Redis
    assert engine.stats["lookup_errors"] == 0 and engine.stats["loaded_tokens"] == len(prompt) - 1
    engine.scheduler.finish_requests("running", RequestStatus.FINISHED_ABORTED)
    engine.assert_empty()


def test_in_reuse_mode_kv_both_engines_share_a_prefix_cache_without_a_proxy(make_engine) -> None:
    """Two kv_both engines serving their own traffic (data-parallel instances behind a load balancer, no
    disaggregation): the second loads the prefix the first stored and computes only the rest; each stores
    what Redis lacks; nothing but chunks is left."""
    first, second = make_engine("kv_both", reuse=True), make_engine("kv_both", reuse=True)
    shared = prompt_of(260, seed=120)
    first.add("a", shared, max_tokens=3)
    assert first.finish("a").kv_transfer_params is None
    first.wait_saved()
    first.assert_empty()
    assert first.stats["written_chunks"] == 5 and first.stats["found_tokens"] == 0
    prompt = shared + prompt_of(90, seed=121)
    second.add("b", prompt, max_tokens=3)
    second.finish("b")
    second.wait_saved()
    stored = 4 * 64  # the first prompt's whole chunks
    assert second.new_reqs["b"].num_computed_tokens == stored
    assert sum(second.scheduled["b"]) == len(prompt) - stored + 2  # the rest of the prompt, 2 more tokens
    blocks = torch.tensor(second.new_reqs["b"].block_ids[0][:stored // BLOCK_SIZE])
    for name in LAYERS:
        assert same_bits(second.layers[name][blocks], first.snapshots["a"][name][:stored // BLOCK_SIZE])
    assert (second.stats["found_tokens"], second.stats["loaded_tokens"]) == (stored, stored)
    assert (second.stats["present_chunks"], second.stats["written_chunks"]) == (4, 2)  # 256..348 new
    second.assert_empty()
    keys = redis_keys(second.redis_url, second.namespace)
    assert len(keys) == 5 + 2 and all(b":c:" in key and not key.endswith(b":h") for key in keys), keys
