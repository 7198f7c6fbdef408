"""Sleep mode (vLLM 0.33+): no load writes into the KV caches while vLLM has released them.

Before sleeping, vLLM's worker calls ``unregister_kv_caches`` and then releases the caches' memory; after
waking it backs them again and calls ``restore_kv_caches``. A kvredis load runs on a thread of its own and
may be waiting in its blocking pop, or copying pages, at that moment. These tests play the worker's side
with the harness of ``test_scheduler`` (vLLM before 0.33 never calls the two hooks; the tests call them, so
they run on every version).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

pytest.importorskip("vllm.version", reason="needs vLLM's CPU build (run with the vLLM environment's python)")

import test_scheduler
import torch
from redis_servers import wait_until
from test_scheduler import (
    STEP_TIMEOUT_S,
    announcement,
    assert_nothing_left,
    assert_pages_moved,
    prompt_of,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvredis.vllm import KVRedisConnector
from kvredis.vllm import worker as worker_module
from kvredis.vllm.paged import PagedLayout

make_engine = test_scheduler.make_engine  # the harness's fixtures
next_entry_id = test_scheduler.next_entry_id


def test_sleep_mode_is_supported(make_engine) -> None:
    """vLLM 0.33+ refuses --enable-sleep-mode for a connector that says it cannot follow the remap."""
    consumer = make_engine("kv_consumer")
    transfer = consumer.worker._vllm_config.kv_transfer_config
    assert KVRedisConnector.supports_sleep_mode(transfer)
    if hasattr(KVConnectorBase_V1, "supports_sleep_mode"):  # 0.33+: what VllmConfig asks the factory's class
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        assert KVConnectorFactory.get_connector_class(transfer).supports_sleep_mode(transfer)
    consumer.assert_empty()


def test_a_load_waiting_for_its_entry_during_sleep_writes_nothing(make_engine, next_entry_id: str) -> None:
    """The load is in its blocking pop when the engine sleeps; the entry comes while it sleeps. Nothing is
    written into the released caches; the load fails, and after waking the prompt is recomputed. Loads
    work again after wake-up."""
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer", pop_timeout_s=5.0)
    prompt = prompt_of(100, seed=70)
    consumer.add("c", prompt, max_tokens=2, params=announcement(prompt, next_entry_id))
    consumer.step()
    consumer.step()  # the load waits in Redis now
    blocks = consumer.block_ids("c")
    started = time.monotonic()
    consumer.worker.unregister_kv_caches()
    consumer.worker.unregister_kv_caches()  # idempotent
    assert time.monotonic() - started < STEP_TIMEOUT_S / 2  # nothing was writing: nothing to wait for
    before = {name: layer.clone() for name, layer in consumer.layers.items()}
    producer.produce("p", prompt, wait=False)
    wait_until(lambda: "c" in consumer.worker.worker._failed, STEP_TIMEOUT_S,
               "the load to end while the engine slept", interval_s=0.002)
    for name, layer in consumer.layers.items():
        assert torch.equal(layer, before[name]), f"{name} written while its memory was released"
    consumer.worker.restore_kv_caches()
    consumer.worker.restore_kv_caches()  # idempotent
    consumer.finish("c")
    assert consumer.invalid_blocks == [set(blocks)]
    assert consumer.new_reqs["c"].num_computed_tokens == 0  # recomputed after waking
    assert consumer.stats["load_failures"] == 1 and consumer.stats["loaded_requests"] == 0
    # Awake again: the next announced prompt loads as usual.
    again = prompt_of(70, seed=71)
    params = producer.produce("p2", again)
    consumer.add("c2", again, params=params)
    consumer.run(lambda: "c2" in consumer.new_reqs)
    assert consumer.new_reqs["c2"].num_computed_tokens == 69
    assert_pages_moved(producer, consumer, "c2", "p2", 0, 3)
    consumer.finish("c2")
    assert_nothing_left(producer, consumer)


@pytest.mark.parametrize("in_place", [True, False], ids=["received-in-place", "written-after-the-read"])
def test_sleep_waits_for_a_load_copying_its_pages(make_engine, monkeypatch: pytest.MonkeyPatch,
                                                  in_place: bool) -> None:
    """``unregister_kv_caches`` returns only once a load already copying pages into the caches is done:
    one receiving a chunk straight into the blocks (the CPU caches' way), or writing pages it read."""
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer")
    prompt = prompt_of(90, seed=72)
    params = producer.produce("p", prompt)
    copying, release = threading.Event(), threading.Event()

    def paused(original: Any) -> Any:
        def slow(self: Any, *args: Any) -> Any:
            result = original(self, *args)  # in place: the write gate is held from here on
            copying.set()
            assert release.wait(STEP_TIMEOUT_S * 3), "the test never let the copy go on"
            return result
        return slow

    if in_place:
        target: Any = worker_module._BlockPlacement
        name = "__call__"
    else:
        target, name = PagedLayout, "scatter"
        monkeypatch.setattr(consumer.worker.worker, "_page_views", {})  # no layer takes a read in place
    original = getattr(target, name)
    monkeypatch.setattr(target, name, paused(original))
    consumer.add("c", prompt, max_tokens=2, params=params)
    consumer.step()
    assert copying.wait(STEP_TIMEOUT_S), "the load did not start copying"
    asleep = threading.Thread(target=consumer.worker.unregister_kv_caches)
    asleep.start()
    asleep.join(0.3)
    assert asleep.is_alive(), "unregister_kv_caches returned while a load was writing into the caches"
    release.set()
    asleep.join(STEP_TIMEOUT_S)
    assert not asleep.is_alive()
    consumer.worker.restore_kv_caches()
    monkeypatch.setattr(target, name, original)
    consumer.run(lambda: "c" in consumer.new_reqs)
    assert consumer.new_reqs["c"].num_computed_tokens == 89  # it finished before the caches went
    assert_pages_moved(producer, consumer, "c", "p", 0, 3)
    consumer.finish("c")
    assert_nothing_left(producer, consumer)
