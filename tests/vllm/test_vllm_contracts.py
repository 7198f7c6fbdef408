"""vLLM's own contracts for a shared KV store, under its real V1 ``Scheduler`` (the harness of
``test_scheduler.py``): a cache reset that means it (``reset_cache``), where hits came from
(``vllm:prompt_tokens_cached_by_source``), and the lookahead-hashing answer. Run on 0.32, 0.33 and 0.34
(``scripts/test.sh``): each of these hooks is one vLLM's scheduler calls in all three.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

pytest.importorskip("vllm.version", reason="needs vLLM's CPU build (run with the vLLM environment's python)")

import redis
import test_scheduler
from conftest import BLOCK_SIZE
from redis_servers import RedisServer
from test_scheduler import Engine, assert_nothing_left, prompt_of
from vllm.config import KVTransferConfig

from kvredis.store.generation import generation_key
from kvredis.vllm import KVRedisConnector
from kvredis.vllm.stats import Counts

make_engine = test_scheduler.make_engine  # the harness's fixtures


def served(engine: Engine, req_id: str, prompt: list[int], max_tokens: int = 2) -> Any:
    """Run a request to its end with its save landed; its final output."""
    engine.add(req_id, prompt, max_tokens=max_tokens)
    output = engine.finish(req_id)
    engine.wait_saved()
    return output


def generation_in_redis(engine: Engine) -> int:
    client = redis.Redis.from_url(engine.redis_url)
    try:
        return int(client.get(generation_key(engine.namespace)) or 0)
    finally:
        client.close()


# -- reset_cache ---------------------------------------------------------------------------------------


def test_after_a_reset_no_engine_of_the_namespace_loads_what_was_stored_before(make_engine) -> None:
    """Two kv_both engines sharing a namespace (reuse): the first stores two prompts; the second resets the
    cache (as vLLM's ``reset_prefix_cache?reset_external=true`` asks it); then neither loads either prompt,
    each computes it, and what is stored from then on is shared again."""
    first, second = make_engine("kv_both", reuse=True), make_engine("kv_both", reuse=True)
    x, y = prompt_of(200, seed=300), prompt_of(200, seed=310)
    served(first, "x", x)
    served(first, "y", y)
    served(second, "y1", y)
    assert second.stats["loaded_tokens"] == 199  # the cache works: the whole prompt but its last token
    assert second.scheduler.reset_prefix_cache(reset_connector=True)  # vLLM's path to reset_cache
    assert generation_in_redis(second) == 1
    served(second, "y2", y)
    assert second.stats["loaded_tokens"] == 199, "loaded KV stored before the reset"
    assert second.new_reqs["y2"].num_computed_tokens == 0  # its own prefix cache was reset with it
    served(first, "x2", x)
    # The first's own prefix cache (vLLM's, which the second's reset does not reach) held 192 tokens of it;
    # the 7 after them, in Redis before the reset, were computed, not loaded.
    assert first.new_reqs["x2"].num_computed_tokens == 192
    assert first.stats["loaded_tokens"] == 0
    # Each stored its prompt again in the new generation: shared again.
    assert first.stats["written_chunks"] == 3 * 4 and second.stats["written_chunks"] == 4
    served(second, "x3", x)
    assert second.stats["loaded_tokens"] == 2 * 199
    first.assert_empty()
    second.assert_empty()


def test_a_prefill_that_overlaps_a_reset_is_not_stored(make_engine) -> None:
    """A prompt whose prefill began before the reset (its first chunks' KV may be the old weights') is not
    stored under either generation."""
    engine = make_engine("kv_both", reuse=True)
    prompt = prompt_of(300, seed=301)  # three prefill steps of 128 tokens
    engine.add("a", prompt, max_tokens=1)
    engine.run(lambda: "a" in engine.new_reqs)  # its first prefill step ran (once its lookup was answered)
    assert engine.connector.reset_cache() is True
    engine.finish("a")
    engine.wait_saved()
    assert engine.stats["written_chunks"] == 0 and engine.stats["saved_requests"] == 0
    assert_nothing_left(engine)


def test_a_decode_does_not_load_a_transfer_announced_before_its_reset(make_engine) -> None:
    """P/D: a transfer the prefill stored before the decode reset is computed on the decode, not loaded."""
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer")
    prompt = prompt_of(100, seed=302)
    params = producer.produce("p", prompt)
    consumer.add("d", prompt, params=params)
    assert consumer.connector.reset_cache()
    consumer.finish("d")
    consumer.wait_discarded()
    assert consumer.stats["loaded_tokens"] == 0 and consumer.new_reqs["d"].num_computed_tokens == 0
    assert_nothing_left(producer, consumer)  # the unread transfer was released


def test_every_engine_learns_of_a_reset_within_a_second_without_a_lookup(make_engine, monkeypatch) -> None:
    """A producer that looks nothing up (transfer mode) re-reads the generation as its steps run: the
    transfers it announces after another engine's reset are in the new generation, so the decode loads
    them."""
    import kvredis.vllm.scheduler

    monkeypatch.setattr(kvredis.vllm.scheduler, "_GENERATION_REFRESH_S", 0.0)
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer")
    assert consumer.connector.reset_cache()
    producer.step()  # a step re-reads the generation (on the lookup thread)
    test_scheduler.lookups_ready(producer.connector)
    assert producer.connector.scheduler._generation.known == 1
    prompt = prompt_of(100, seed=303)
    consumer.add("d", prompt, params=producer.produce("p", prompt))
    consumer.finish("d")
    assert consumer.stats["loaded_tokens"] == 99
    assert_nothing_left(producer, consumer)


def test_a_reset_redis_cannot_take_returns_false_and_says_so(make_engine, redis_server, caplog) -> None:
    server: RedisServer = redis_server()
    engine = make_engine("kv_both", url=server.url, reuse=True, lookup_timeout_s=0.3)
    server.kill()
    try:
        with caplog.at_level(logging.WARNING, logger="kvredis.vllm"):
            assert engine.scheduler.reset_prefix_cache(reset_connector=True) is False
        assert any("cannot reset the shared KV cache" in r.getMessage() for r in caplog.records)
    finally:
        server.start()
    assert engine.connector.reset_cache() is True  # Redis back: the reset happens


def test_a_lost_generation_is_written_back_never_lowered(make_engine, monkeypatch) -> None:
    """If Redis loses the generation (an allkeys eviction policy, FLUSHALL), an engine that knew a higher one
    writes it back at its next read: the namespace never returns to a generation whose chunks may remain."""
    import kvredis.vllm.scheduler

    engine = make_engine("kv_both", reuse=True)
    assert engine.connector.reset_cache() and engine.connector.reset_cache()
    client = redis.Redis.from_url(engine.redis_url)
    try:
        client.delete(generation_key(engine.namespace))
        monkeypatch.setattr(kvredis.vllm.scheduler, "_GENERATION_REFRESH_S", 0.0)
        engine.step()  # a step re-reads the generation
        test_scheduler.lookups_ready(engine.connector)
        assert generation_in_redis(engine) == 2
    finally:
        client.close()
    engine.assert_empty()


# -- where hits came from ------------------------------------------------------------------------------


@pytest.fixture
def hit_sources(monkeypatch) -> list[dict[str, int]]:
    """What the connector tells vLLM each load's tokens came from (vLLM adds them to
    ``vllm:prompt_tokens_cached_by_source``)."""
    said: list[dict[str, int]] = []
    real = KVRedisConnector.get_external_cache_hit_sources

    def spy(self: KVRedisConnector, request: Any, num_external_tokens: int) -> Any:
        sources = real(self, request, num_external_tokens)
        said.append({str(source.value): tokens for source, tokens in sources.items()})
        return sources

    monkeypatch.setattr(KVRedisConnector, "get_external_cache_hit_sources", spy)
    return said


def test_hits_are_named_by_their_source(make_engine, hit_sources: list[dict[str, int]]) -> None:
    """An announced transfer's tokens are ``p2p`` (moved from the prefill instance), a prefix found in the
    shared cache ``host`` (Redis's memory); vLLM's scheduler asks at admission."""
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer", reuse=True)
    prompt = prompt_of(100, seed=305)
    consumer.add("d", prompt, params=producer.produce("p", prompt))
    consumer.finish("d")
    assert hit_sources == [{"p2p": 99}]
    other = make_engine("kv_both", reuse=True)
    served(other, "a", prompt_of(150, seed=306))
    served(consumer, "b", prompt_of(150, seed=306))
    assert hit_sources == [{"p2p": 99}, {"host": 149}]
    for engine in (producer, consumer, other):
        engine.assert_empty()


def test_lookahead_block_hashes_are_declined() -> None:
    """kvredis keys a chunk by its own tokens, not by the tokens an EAGLE drafter reads after it: vLLM 0.34
    keeps its trailing-block drop (older releases never ask)."""
    config = KVTransferConfig(kv_connector="KVRedisConnector", kv_connector_module_path="kvredis.vllm",
                              kv_role="kv_both")
    assert KVRedisConnector.supports_lookahead_block_hashes(config) is False


# -- latency and throughput through vLLM's connector stats ---------------------------------------------


def test_loads_stores_and_lookups_reach_vllms_log_line_and_metrics_with_their_latency(make_engine,
                                                                                      monkeypatch) -> None:
    """Every store, load and lookup is a sample in the stats vLLM ships to its loggers: its periodic "KV
    Transfer metrics" line says their Avg/P90 time and MB/s beside the counts, and ``/metrics`` has
    ``vllm:kvredis_*`` histograms of them next to the counters (registered in the serving process, as vLLM's
    stat logger does, so no multiprocess directory is involved)."""
    import prometheus_client
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    first, second = make_engine("kv_both", reuse=True), make_engine("kv_both", reuse=True)
    prompt = prompt_of(200, seed=320)
    served(first, "a", prompt)
    served(second, "b", prompt)
    assert first.samples["store_seconds"] == first.samples["store_bytes"] == 1
    assert second.samples["load_seconds"] == second.samples["load_bytes"] == 1
    assert first.samples["lookup_seconds"] == second.samples["lookup_seconds"] == 1
    # What the worker and the scheduler report, as vLLM hands it to its loggers (plain dicts).
    reports: list[dict[str, Any]] = []
    take = Counts.take

    def recorded(self: Counts) -> Any:
        report = take(self)
        if report is not None:
            reports.append(report.data)
        return report

    monkeypatch.setattr(Counts, "take", recorded)
    first.add("c", prompt_of(100, seed=321), max_tokens=1)
    first.finish("c")
    first.wait_saved()
    kinds = {name for data in reports for name, value in data.items() if isinstance(value, list)}
    assert {"store_seconds", "store_bytes", "lookup_seconds"} <= kinds, reports
    transfer_config = first.scheduler.vllm_config.kv_transfer_config
    logging_ = KVConnectorLogging(transfer_config)
    for data in reports:
        logging_.observe(data)
    lines: list[str] = []
    logging_.log(lambda fmt, *args: lines.append(fmt % args))
    (line,) = lines
    assert line.startswith("KV Transfer metrics: ")
    for part in ("saved_requests=1", "Avg store time (ms)=", "P90 store time (ms)=",
                 "Store throughput (MB/s)=", "Avg lookup time (ms)=", "P90 lookup time (ms)="):
        assert part in line, line

    registry = prometheus_client.CollectorRegistry()
    metric_types = {cls: _in(registry, cls) for cls in (prometheus_client.Gauge, prometheus_client.Counter,
                                                        prometheus_client.Histogram)}
    prom = KVRedisConnector.build_prom_metrics(first.scheduler.vllm_config, metric_types, ["engine"],
                                               {0: ["0"]})
    for data in reports:
        prom.observe(data, 0)
    text = prometheus_client.generate_latest(registry).decode()
    for series in ('vllm:kvredis_store_time_seconds_count{engine="0"} 1.0',
                   'vllm:kvredis_store_bytes_count{engine="0"} 1.0',
                   'vllm:kvredis_lookup_time_seconds_count{engine="0"} 1.0',
                   'vllm:kvredis_saved_requests_total{engine="0"} 1.0',
                   'vllm:kvredis_load_time_seconds_bucket{engine="0",le="0.0005"} 0.0'):
        assert series in text, text
    first.assert_empty()
    second.assert_empty()


def _in(registry: Any, cls: type) -> Any:
    """``cls`` registering its metrics in ``registry`` (as vLLM's metric types are the default registry's)."""
    return lambda *args, **kwargs: cls(*args, registry=registry, **kwargs)


# -- KV events -----------------------------------------------------------------------------------------


def events_engine(make_engine: Any, role: str = "kv_both") -> tuple[Engine, list[Any]]:
    """A reuse-mode engine publishing KV events (``--kv-events-config``); the events vLLM's scheduler hands
    its publisher, as they come."""
    from vllm.config import KVEventsConfig

    engine = make_engine(role, reuse=True, vllm_settings={
        "kv_events_config": KVEventsConfig(enable_kv_cache_events=True, publisher="null")})
    published: list[Any] = []
    engine.scheduler.kv_event_publisher.publish = lambda batch: published.extend(batch.events)
    return engine, published


def redis_events(published: list[Any]) -> list[Any]:
    return [event for event in published if getattr(event, "medium", None) == "REDIS"]


def test_stored_chunks_and_a_resets_drop_are_published_as_kv_events(make_engine, monkeypatch) -> None:
    """An engine publishes the blocks it stored in Redis (vLLM's block hashes, the tier named) once its
    writers stored them, and their removal when the namespace is reset, by itself or by another engine."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    engine, published = events_engine(make_engine)
    other, other_published = events_engine(make_engine)
    prompt = prompt_of(200, seed=330)
    request = engine.add("a", prompt, max_tokens=2)
    engine.finish("a")
    engine.wait_saved()
    engine.step()  # the writers' report reaches the scheduler with the next step's output
    (stored,) = redis_events(published)
    assert isinstance(stored, BlockStored) and stored.locality == "REMOTE"
    blocks = 199 // BLOCK_SIZE  # every position but the last is stored: its full blocks
    assert len(stored.block_hashes) == blocks and stored.block_size == BLOCK_SIZE
    # vLLM's own block hashes, as its block pool publishes them for the GPU (64-bit ints by default)
    assert stored.block_hashes == [maybe_convert_block_hash(h) for h in request.block_hashes[:blocks]]
    assert stored.token_ids == prompt[:blocks * BLOCK_SIZE] and stored.parent_block_hash is None
    # The GPU's own events are there too, under their medium.
    assert any(isinstance(e, BlockStored) and e.medium == "GPU" for e in published)
    assert other.connector.reset_cache()
    assert redis_events(other_published) == []  # the other stored nothing: nothing to remove
    import kvredis.vllm.scheduler

    monkeypatch.setattr(kvredis.vllm.scheduler, "_GENERATION_REFRESH_S", 0.0)
    engine.step()  # the engine re-reads the generation (on its lookup thread) and learns of the reset
    test_scheduler.lookups_ready(engine.connector)
    engine.step()  # its events reach the publisher with the next step
    removed = [e for e in redis_events(published) if isinstance(e, BlockRemoved)]
    assert len(removed) == 1 and removed[0].block_hashes == stored.block_hashes
    engine.assert_empty()
    other.assert_empty()


def test_a_save_that_failed_is_not_published(make_engine, monkeypatch) -> None:
    from kvredis.errors import KVRedisError
    from kvredis.store.transfer import Transfers

    engine, published = events_engine(make_engine)

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise KVRedisError("Redis refused the write")

    monkeypatch.setattr(Transfers, "save", failing)
    served(engine, "a", prompt_of(100, seed=332))
    engine.step()
    assert engine.stats["save_failures"] == 1 and redis_events(published) == []
    assert not engine.connector.scheduler._stored_blocks._pending  # its report came: nothing waits
    engine.assert_empty()


def test_a_prompt_is_published_once_every_writer_rank_stored_it() -> None:
    """With tensor parallelism each writer rank (a KV head range) reports its own save; the blocks are
    published when the last one did, and not at all if one failed."""
    from scheduler_steps import new_request

    from kvredis.vllm.events import StoredBlocks, StoreReports

    blocks = StoredBlocks(writers=2)
    for req_id in ("a", "b"):
        blocks.expect(new_request(req_id, prompt_of(100, seed=340)), 99, BLOCK_SIZE)
    blocks.report(StoreReports([("a", True), ("b", True)]))
    assert blocks.take() == []  # one rank of two
    blocks.report(StoreReports([("a", True), ("b", False), ("unknown", True)]))
    (event,) = blocks.take()
    assert len(event.block_hashes) == 99 // BLOCK_SIZE and event.medium == "REDIS"
    blocks.dropped()
    (removed,) = blocks.take()
    assert removed.block_hashes == event.block_hashes
    blocks.dropped()
    assert blocks.take() == []  # nothing published since
