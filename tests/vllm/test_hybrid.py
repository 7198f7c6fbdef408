"""Hybrid KV caches under vLLM's real V1 ``Scheduler`` (hybrid KV cache manager on): full attention beside a
sliding window (a Gemma 3 / gpt-oss shape) and beside a Mamba state group (a Qwen3-Next / Qwen3.5 shape).

Each "engine" is a real ``Scheduler`` over a ``KVCacheConfig`` with several groups, plus a worker-role
``KVRedisConnector`` holding one paged tensor a layer. :meth:`HybridEngine.step` plays the model runner: every
scheduled token's KV is a function of its id, position and layer, written into the block its group's table
gives; a state layer's running slot gets a digest of every token so far. So the decode's blocks can be checked
value by value against what they must hold: the full layer at every position it loaded, the window layer over
the window before the resume position, the state layer at the resume position, and nothing else written.
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

pytest.importorskip("vllm.version", reason="needs vLLM's CPU build (run with the vLLM environment's python)")

import redis
import torch
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
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.structured_output import StructuredOutputManager

from kvredis.vllm import KVRedisConnector

HEADS, WIDTH = 2, 128
STATE_WIDTH = 64  # floats of a state slot
WINDOW = 2 * BLOCK_SIZE + 5  # not a multiple of the block: the window's first block is partly outside
NUM_BLOCKS = 96
MAX_LEN = 1024
TOKEN_BUDGET = 96
SAMPLED = 7
FULL, SLIDING = "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"
STATE = "model.layers.2.linear_attn"

init_none_hash(sha256)


def kv_values(tokens: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
    lane = torch.arange(HEADS * WIDTH, dtype=torch.float32).reshape(1, HEADS, WIDTH)
    return (tokens.float().reshape(-1, 1, 1) + positions.float().reshape(-1, 1, 1) / 1024.0
            + lane / 65536.0 + layer * 2048.0)


def state_after(tokens: list[int], width: int = STATE_WIDTH) -> torch.Tensor:
    """The fake recurrent state after ``tokens``: depends on every one of them, and on their count."""
    generator = torch.Generator().manual_seed(hash(tuple(tokens)) & 0x7FFFFFFF)
    return torch.rand(width, generator=generator) + len(tokens)


def prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, 1024, (length,), generator=generator).tolist()


def attention_spec(window: int | None, local: bool = False) -> Any:
    common = {"block_size": BLOCK_SIZE, "num_kv_heads": HEADS, "head_size": WIDTH // 2,
              "dtype": torch.float32}
    if window is None:
        return FullAttentionSpec(**common)
    if local:
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=window)
    return SlidingWindowSpec(**common, sliding_window=window)


def first_attended(stop: int, window: int, local: bool = False) -> int:
    """The first position a token at ``stop`` attends to in a windowed layer."""
    return stop // window * window if local else max(0, stop - window + 1)


def state_spec(mamba_type: str = "MAMBA2", width: int = STATE_WIDTH) -> MambaSpec:
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    return MambaSpec(block_size=BLOCK_SIZE, shapes=((width,),), dtypes=(torch.float32,),
                     mamba_cache_mode="align", mamba_type=MambaAttentionBackendEnum[mamba_type])


@dataclasses.dataclass
class HybridEngine(Stepped):
    scheduler: Scheduler
    worker: KVRedisConnector
    layers: dict[str, torch.Tensor]
    groups: dict[str, int]  # layer -> its KV cache group
    redis_url: str
    namespace: str
    stats: Counter[str] = dataclasses.field(default_factory=Counter)
    finished: dict[str, Any] = dataclasses.field(default_factory=dict)
    failed_recving: set[str] = dataclasses.field(default_factory=set)
    new_reqs: dict[str, Any] = dataclasses.field(default_factory=dict)
    scheduled: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    prompts: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    @property
    def connector(self) -> KVRedisConnector:
        connector = self.scheduler.connector
        assert isinstance(connector, KVRedisConnector)
        return connector

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 2,
            params: dict[str, Any] | None = None, **fields: Any) -> None:
        self.prompts[req_id] = list(prompt)
        self.scheduler.add_request(new_request(req_id, prompt, max_tokens, params, **fields))

    def step(self) -> Any:
        output = self.scheduler.schedule()
        worker = self.worker
        worker.bind_connector_metadata(output.kv_connector_metadata)
        context = SimpleNamespace(attn_metadata=None, no_compile_layers={})
        sampled = self._forward(output) if output.total_num_scheduled_tokens else {}
        worker.start_load_kv(context)
        worker.wait_for_save()
        results = worker.get_transfer_results(output.finished_req_ids)
        invalid = worker.get_block_ids_with_load_errors()
        assert not invalid, "block-level load errors with several KV cache groups (vLLM raises)"
        stats = worker.get_kv_connector_stats()
        worker.clear_connector_metadata()
        self.failed_recving |= results.failed_recving
        kv_output = KVConnectorOutput(finished_sending=results.finished_sending or None,
                                      finished_recving=results.finished_recving or None,
                                      failed_recving=results.failed_recving, kv_connector_stats=stats)
        finish_step(self.scheduler, output, sampled, kv_output, self.stats, self.finished)
        return output

    def _forward(self, output: Any) -> dict[str, list[int]]:
        """Write each scheduled token's KV where its group's block table says, and the state after the step
        into the state group's running slot (the block of the step's last position)."""
        starts = {new.req_id: int(new.num_computed_tokens) for new in output.scheduled_new_reqs}
        for new in output.scheduled_new_reqs:
            self.new_reqs.setdefault(new.req_id, new)
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            starts[req_id] = int(cached.num_computed_tokens[i])
        sampled: dict[str, list[int]] = {}
        for req_id, count in output.num_scheduled_tokens.items():
            self.scheduled.setdefault(req_id, []).append(count)
            request = self.scheduler.requests[req_id]
            tables = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            start = starts[req_id]
            everything = list(request.all_token_ids)
            positions = torch.arange(start, start + count)
            tokens = torch.tensor(everything[start:start + count])
            for index, (name, layer) in enumerate(self.layers.items()):
                table = torch.tensor(tables[self.groups[name]])
                if name == STATE:
                    end = start + count
                    slot = table[-(-end // BLOCK_SIZE) - 1]
                    layer[slot, 0, 0] = state_after(everything[:end], layer.shape[-1])
                    continue
                blocks = table[positions // BLOCK_SIZE]
                assert not (blocks == 0).any(), "a token's KV written into the null block"
                layer[blocks, :, positions % BLOCK_SIZE, :] = kv_values(tokens, positions, index)
            sampled[req_id] = [SAMPLED] if start + count >= request.num_tokens else []
        for name, layer in self.layers.items():
            if name != STATE:  # vLLM runs no per-layer hook for a Mamba layer
                self.worker.save_kv_layer(name, layer, SimpleNamespace())
        return sampled

    def wait_saved(self) -> None:
        wait_saved(self.worker, self.stats)

    def assert_loaded(self, req_id: str, start: int, stop: int, window: int, local: bool = False) -> None:
        """The decode's blocks hold exactly what the prefill computed: the full layer at ``start..stop-1``,
        the window layer over the window before ``stop``, the state layer's slot at ``stop``."""
        tables = self.new_reqs[req_id].block_ids
        tokens = torch.tensor(self.prompts[req_id])
        for index, (name, layer) in enumerate(self.layers.items()):
            table = tables[self.groups[name]]
            if name == STATE:
                slot = layer[table[stop // BLOCK_SIZE - 1], 0, 0]
                assert torch.equal(slot, state_after(self.prompts[req_id][:stop]))
                continue
            first = start if name == FULL else max(start, first_attended(stop, window, local))
            positions = torch.arange(first, stop)
            blocks = torch.tensor([table[p // BLOCK_SIZE] for p in positions.tolist()])
            got = layer[blocks, :, positions % BLOCK_SIZE, :]
            assert torch.equal(got, kv_values(tokens[positions], positions, index)), name

    def assert_empty(self) -> None:
        self.step()
        s = self.scheduler
        assert not s.requests and not s.running and len(s.waiting) == 0
        assert not s.finished_recving_kv_req_ids and not s.failed_recving_kv_req_ids
        for manager in s.kv_cache_manager.coordinator.single_type_managers:
            assert not manager.req_to_blocks
        c = self.connector.scheduler
        assert c is not None
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while c.discards.pending() or self.worker.worker.discards.pending():
            assert time.monotonic() < deadline
            time.sleep(0.002)
        assert not (c._pending_loads or c._loading or c._loaded_once or c._prefills or c._saved)
        assert not c._requests
        w = self.worker.worker
        assert not (w._gathered or w._received or w._failed or w._failed_requests)


@pytest.fixture
def make_engine(tiny_model: Path, real_redis_url: str) -> Iterator[Callable[..., HybridEngine]]:
    namespace = "t-hybrid-" + uuid.uuid4().hex[:10]
    engines: list[HybridEngine] = []

    def make(role: str, kinds: tuple[str, ...] = ("full", "window"), window: int = WINDOW,
             local: bool = False, mamba_type: str = "MAMBA2", state_width: int = STATE_WIDTH,
             **settings: Any) -> HybridEngine:
        extra = {"url": real_redis_url, "namespace": namespace, "pop_timeout_s": 2.0, **settings}
        vllm_config = VllmConfig(
            model_config=ModelConfig(model=str(tiny_model), dtype="float32", seed=0, max_model_len=MAX_LEN),
            scheduler_config=SchedulerConfig(
                max_num_seqs=8, max_num_batched_tokens=TOKEN_BUDGET, max_model_len=MAX_LEN,
                enable_chunked_prefill=True, is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=BLOCK_SIZE, gpu_memory_utilization=0.9, cache_dtype="auto",
                                     enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVRedisConnector", kv_connector_module_path="kvredis.vllm", kv_role=role,
                kv_connector_extra_config=extra, kv_load_failure_policy="recompute"),
            device_config=DeviceConfig("cpu"),
        )
        vllm_config.cache_config.kv_cache_layout = "LBHNC"
        vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
        names = {"full": FULL, "window": SLIDING, "state": STATE}
        specs = {"full": attention_spec(None), "window": attention_spec(window, local),
                 "state": state_spec(mamba_type, state_width)}
        if "state" in kinds:
            vllm_config.cache_config.mamba_cache_mode = "align"
        groups = [KVCacheGroupSpec([names[kind]], specs[kind]) for kind in kinds]
        kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
        scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                              structured_output_manager=StructuredOutputManager(vllm_config),
                              block_size=BLOCK_SIZE, log_stats=True)
        worker = KVRedisConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        caches = {names[kind]: torch.zeros(NUM_BLOCKS, 1, 1, state_width) if kind == "state"
                  else torch.zeros(NUM_BLOCKS, HEADS, BLOCK_SIZE, WIDTH) for kind in kinds}
        worker.register_kv_caches(caches)
        engine = HybridEngine(scheduler, worker, caches, {names[k]: i for i, k in enumerate(kinds)},
                              real_redis_url, namespace)
        lookups_ready(engine.connector)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.worker.shutdown()
        engine.connector.shutdown()
    delete_namespace(real_redis_url, namespace)


@pytest.mark.parametrize("local", [False, True], ids=["sliding-window", "chunked-local"])
def test_a_windowed_model_moves_the_window_and_every_full_attention_page(make_engine, local: bool) -> None:
    """Transfer mode: a prompt prefilled in several steps (vLLM freed the window's early blocks meanwhile)
    reaches the decode whole in its full-attention layer and over the last window in its windowed one; the
    decode computes only the last token, and nothing is left in Redis."""
    window = WINDOW if not local else 2 * BLOCK_SIZE
    producer = make_engine("kv_producer", window=window, local=local)
    consumer = make_engine("kv_consumer", window=window, local=local)
    prompt = prompt_of(300, seed=1)
    params = producer.produce("p", prompt)
    stored = len(prompt) - 1
    keys = redis_keys(producer.redis_url, producer.namespace)
    tag = b":l" if local else b":w"
    window_blocks = [key for key in keys if tag in key and b":c:" in key and not key.endswith(b":h")]
    # The window before the prompt's end and before its last chunk boundary, a block each: never the prompt.
    assert 0 < len(window_blocks) <= -(-(window + stored % 64) // BLOCK_SIZE) + 1 < stored // BLOCK_SIZE
    consumer.add("c", prompt, params=params)
    consumer.finish("c")
    assert consumer.new_reqs["c"].num_computed_tokens == stored
    consumer.assert_loaded("c", 0, stored, window, local)
    assert consumer.stats["loaded_tokens"] == stored and not consumer.stats["load_failures"]
    producer.assert_empty()
    consumer.assert_empty()
    assert redis_keys(consumer.redis_url, consumer.namespace) == []


def test_a_lost_window_block_is_a_miss_of_the_whole_request(make_engine) -> None:
    """A window block missing: the request is reported failed as a whole (vLLM recomputes it; with several
    groups block ids cannot say which), never half a cache; nothing is left."""
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer")
    prompt = prompt_of(200, seed=2)
    params = producer.produce("p", prompt)
    client = redis.Redis.from_url(producer.redis_url)
    window = sorted(key for key in redis_keys(producer.redis_url, producer.namespace)
                    if b":w" in key and b":c:" in key and not key.endswith(b":h"))
    client.delete(window[0])
    client.close()
    consumer.add("c", prompt, params=params)
    consumer.finish("c")
    assert "c" in consumer.failed_recving
    assert consumer.stats["load_failures"] == 1
    assert sum(consumer.scheduled["c"]) >= len(prompt)  # computed whole, after the failed load
    consumer.assert_empty()
    producer.assert_empty()
    assert redis_keys(consumer.redis_url, consumer.namespace) == []


def test_a_decode_with_another_window_computes_and_names_it(make_engine) -> None:
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer", window=WINDOW + BLOCK_SIZE)
    prompt = prompt_of(150, seed=3)
    params = producer.produce("p", prompt)
    decode = consumer.connector.scheduler
    assert decode is not None
    assert params["kvredis"]["engine"]["series"] != decode.engine_description()["series"]
    consumer.add("c", prompt, params=params)
    consumer.finish("c")
    assert consumer.new_reqs["c"].num_computed_tokens == 0 and not consumer.stats["loaded_tokens"]
    assert consumer.stats["skipped_requests"] == 1
    consumer.assert_empty()
    producer.assert_empty()
    assert redis_keys(consumer.redis_url, consumer.namespace) == []


@pytest.mark.parametrize("mamba_type", ["MAMBA1", "MAMBA2", "GDN_ATTN"])
def test_a_state_model_resumes_at_the_prompts_last_block_boundary(make_engine, mamba_type: str) -> None:
    """A Mamba/GDN group beside full attention: the state after the prompt's last block boundary (where
    vLLM's prefill stops a step) is stored with the attention pages before it; the decode loads up to that
    boundary exactly, state included, and computes the rest of the prompt. Mamba1 (Jamba) has no kernel in
    vLLM's CPU build: it runs here only."""
    kinds = ("full", "state")
    producer = make_engine("kv_producer", kinds=kinds, mamba_type=mamba_type)
    consumer = make_engine("kv_consumer", kinds=kinds, mamba_type=mamba_type)
    prompt = prompt_of(250, seed=6)
    params = producer.produce("p", prompt)
    resume = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert params is not None
    consumer.add("c", prompt, params=params)
    consumer.finish("c")
    assert consumer.new_reqs["c"].num_computed_tokens == resume
    consumer.assert_loaded("c", 0, resume, 0)
    assert sum(consumer.scheduled["c"]) == len(prompt) - resume + 1
    producer.assert_empty()
    consumer.assert_empty()
    assert redis_keys(consumer.redis_url, consumer.namespace) == []


def test_a_state_model_stores_nothing_for_a_prompt_within_its_first_block(make_engine) -> None:
    """No block boundary before the last token: no state a reader could resume from, so nothing is stored
    nor announced, and the decode computes the prompt without waiting for Redis."""
    kinds = ("full", "state")
    producer, consumer = make_engine("kv_producer", kinds=kinds), make_engine("kv_consumer", kinds=kinds)
    prompt = prompt_of(BLOCK_SIZE, seed=7)  # its last token is the block's last position
    params = producer.produce("p", prompt)
    assert params is None and redis_keys(producer.redis_url, producer.namespace) == []
    consumer.add("c", prompt, params={"do_remote_prefill": True})
    consumer.finish("c")
    assert consumer.new_reqs["c"].num_computed_tokens == 0 and not consumer.stats["lookup_errors"]
    producer.assert_empty()
    consumer.assert_empty()


def test_a_decode_whose_state_differs_computes_and_names_it(make_engine) -> None:
    """Another state shape (a conv kernel, a TP size or a state dtype of its own): the announcement says so,
    and the decode computes at once instead of reading chunks that cannot fit."""
    kinds = ("full", "state")
    producer = make_engine("kv_producer", kinds=kinds)
    consumer = make_engine("kv_consumer", kinds=kinds, state_width=2 * STATE_WIDTH)
    prompt = prompt_of(150, seed=10)
    params = producer.produce("p", prompt)
    consumer.add("c", prompt, params=params)
    consumer.finish("c")
    assert consumer.new_reqs["c"].num_computed_tokens == 0 and not consumer.stats["loaded_tokens"]
    assert consumer.stats["skipped_requests"] == 1 and not consumer.stats["load_failures"]
    consumer.assert_empty()
    producer.assert_empty()
    assert redis_keys(consumer.redis_url, consumer.namespace) == []


@pytest.mark.parametrize("kinds", [("full", "window"), ("full", "state")], ids=["sliding-window", "state"])
def test_reuse_a_conversation_resumes_where_the_last_turn_was_stored(make_engine,
                                                                      kinds: tuple[str, ...]) -> None:
    """Reuse mode: turn 2 extends turn 1; its lookup finds turn 1's full chunks and, at turn 1's last chunk
    boundary, the window's blocks before it (or the state there: a state model's chunk is a block), loads
    them, and computes the rest."""
    first = make_engine("kv_both", kinds=kinds, reuse=True)
    second = make_engine("kv_both", kinds=kinds, reuse=True)
    turn1 = prompt_of(230, seed=4)
    first.add("a", turn1, max_tokens=1)
    first.finish("a")
    first.wait_saved()
    turn2 = turn1 + prompt_of(80, seed=5)
    second.add("b", turn2, max_tokens=1)
    second.finish("b")
    chunk = second.connector.endpoint.transfers.chunk_tokens
    resume = (len(turn1) - 1) // chunk * chunk
    assert second.new_reqs["b"].num_computed_tokens == resume
    second.assert_loaded("b", 0, resume, WINDOW)
    first.assert_empty()
    second.assert_empty()
