"""The connector's CUDA data path (kvredis.vllm.staging) under vLLM's real scheduler, on a fake device.

No GPU runs here: each engine's worker gets a :class:`fake_device.FakeDevice` in place of
``kvredis.vllm.staging.device_for``'s answer, so its caches (CPU tensors) are moved the way they would be on a
GPU: through pinned buffers, on side streams, with events that complete when the test says so (or, with
``auto``, when someone waits for them). The harness is ``test_scheduler``'s; engines without a fake take the
CPU path (``staging.device_for`` is ``None`` for CPU caches), whose own tests are the other files.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("vllm.version", reason="needs vLLM's CPU build (run with the vLLM environment's python)")

import test_scheduler
import torch
from fake_device import FakeDevice, FakeStream
from test_scheduler import (
    BLOCK_SIZE,
    LAYERS,
    STEP_TIMEOUT_S,
    Engine,
    assert_nothing_left,
    assert_pages_moved,
    prompt_of,
    redis_keys,
)
from vllm.v1.request import RequestStatus

from kvredis.vllm import staging

make_engine = test_scheduler.make_engine  # the harness's fixture

PROXY_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}


@pytest.fixture
def make_gpu_engine(make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
                    ) -> Any:
    """Engines whose worker moves pages as on a GPU, each with its own fake device; afterwards, no device
    operation may have come from an unbound thread or onto a thread's own stream."""
    fakes: list[FakeDevice] = []

    def make(role: str, auto: bool = False, **settings: Any) -> tuple[Engine, FakeDevice]:
        fake = FakeDevice(auto=auto)
        with monkeypatch.context() as patch:
            patch.setattr(staging, "device_for", lambda caches: fake)
            engine = make_engine(role, **settings)
        assert engine.worker.worker._staging is not None and engine.worker.worker._staging.device is fake
        fakes.append(fake)
        return engine, fake

    yield make
    for fake in fakes:
        assert not fake.violations, fake.violations


def streams(engine: Engine) -> tuple[FakeStream, FakeStream]:
    """The worker's save and load streams."""
    assert engine.worker.worker._staging is not None
    return engine.worker.worker._staging._save_stream, engine.worker.worker._staging._load_stream


def test_cpu_caches_take_the_direct_path(make_engine) -> None:
    engine = make_engine("kv_both")
    assert engine.worker.worker._staging is None
    engine.assert_empty()


@pytest.mark.parametrize(("length", "hooked"), [(100, "all"), (300, "all"), (3 * BLOCK_SIZE + 1, "none"),
                                                (3 * BLOCK_SIZE + 1, "first-layer")])
def test_a_prompt_moves_through_the_gpu_path_bit_identical(make_gpu_engine, length: int, hooked: str) -> None:
    """300 tokens prefill in three steps; "none" and "first-layer": a full CUDA graph ran no per-layer
    hook, and wait_for_save queues the other layers' copies through the same staging."""
    producer, on_producer = make_gpu_engine("kv_producer", auto=True)
    consumer, on_consumer = make_gpu_engine("kv_consumer", auto=True)
    producer.hooked_layers = {"all": set(LAYERS), "none": set(), "first-layer": {LAYERS[0]}}[hooked]
    prompt = prompt_of(length, seed=80 + length)
    params = producer.produce("p", prompt)
    save_stream, _ = streams(producer)
    (saved,) = on_producer.events_on(save_stream)  # one event, in the step that completed the prefill
    assert ("wait", "compute", saved) in on_producer.log
    assert len(on_producer.ops("gather")) == len(LAYERS)
    consumer.add("c", prompt, params=params)
    consumer.run(lambda: "c" in consumer.new_reqs)
    assert consumer.new_reqs["c"].num_computed_tokens == length - 1
    assert_pages_moved(producer, consumer, "c", "p", 0, -(-(length - 1) // BLOCK_SIZE))
    _, load_stream = streams(consumer)
    assert len(on_consumer.events_on(load_stream)) == 1  # one event for the load's copies
    # Each chunk's pages go to the device from where they were received (the leased pinned slot): a copy a
    # layer and chunk, none through a host copy.
    chunks = -(-(length - 1) // consumer.worker.endpoint.transfers.chunk_tokens)
    assert len(on_consumer.ops("scatter")) == len(LAYERS) * chunks
    slot = consumer.worker.worker._staging._slot_bytes
    assert [shape for op, _, shape in on_consumer.log if op == "pinned"] == [(4 * slot,)]  # the pool, once
    consumer.finish("c")
    assert_nothing_left(producer, consumer)
    assert producer.stats["saved_requests"] == 1 and consumer.stats["loaded_requests"] == 1
    for fake in (on_producer, on_consumer):
        assert fake.syncs["MainThread"] == 0  # the engine's thread never waited for the device


def test_the_writer_waits_for_the_steps_event_not_the_engine(make_gpu_engine, make_engine) -> None:
    """Saves queue their copies per layer and hand the step's one event to the writer: the step ends without
    a host sync, Redis gets nothing until the event completed, then exactly the pages."""
    producer, fake = make_gpu_engine("kv_producer")
    consumer = make_engine("kv_consumer")  # the CPU path reads what the GPU path wrote
    save_stream, _ = streams(producer)
    prompt = prompt_of(100, seed=90)
    producer.add("p", prompt, max_tokens=1, params=PROXY_PARAMS)
    producer.step()  # the whole prompt in one step: its pages are saved in this one
    (saved,) = fake.events_on(save_stream)
    assert ("wait", "compute", saved) in fake.log
    waits = fake.ops("wait", save_stream)  # per layer, behind the forward's stream at the hook
    assert len(waits) == len(LAYERS) and all(detail.stream is fake.compute for _, _, detail in waits)
    assert fake.syncs["MainThread"] == 0
    assert "p" in producer.finished
    time.sleep(0.3)
    assert producer.worker.worker._saves_in_flight, "the writer did not wait for the copies"
    assert redis_keys(producer.redis_url, producer.namespace) == []
    fake.complete(saved)
    producer.wait_saved()
    for _ in range(3):
        producer.step()
    assert len(fake.events_on(save_stream)) == 1  # steps without saves record none
    params = producer.finished["p"].kv_transfer_params
    consumer.add("c", prompt, params=params)
    consumer.run(lambda: "c" in consumer.new_reqs)
    assert consumer.new_reqs["c"].num_computed_tokens == 99
    assert_pages_moved(producer, consumer, "c", "p", 0, 4)
    consumer.finish("c")
    assert_nothing_left(producer, consumer)
    assert fake.syncs["MainThread"] == 0 and fake.syncs["kvredis-save_0"] == 1


def _start_load(producer: Engine, consumer: Engine, fake: FakeDevice, seed: int) -> tuple[list[int], Any]:
    """Announce a prompt to the consumer and step until its load queued its copies; (its blocks, the load's
    event)."""
    prompt = prompt_of(100, seed=seed)
    params = producer.produce("p", prompt)
    consumer.add("c", prompt, max_tokens=2, params=params)
    consumer.step()
    _, load_stream = streams(consumer)
    (loaded,) = fake.wait_for_events(load_stream, 1, STEP_TIMEOUT_S)
    first_wait = fake.ops("wait", load_stream)[0]
    assert first_wait[2].stream is fake.compute  # behind the forward's stream as the step started the load
    return consumer.block_ids("c"), loaded


def test_a_load_is_finished_only_once_its_copy_ran(make_gpu_engine, make_engine) -> None:
    producer = make_engine("kv_producer")
    consumer, fake = make_gpu_engine("kv_consumer")
    blocks, loaded = _start_load(producer, consumer, fake, seed=91)
    for _ in range(5):
        consumer.step()
        time.sleep(0.01)
    assert "c" not in consumer.recved
    assert consumer.scheduler.requests["c"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    targets = torch.tensor(blocks[:4])
    assert all(bool((consumer.layers[name][targets] == 0).all()) for name in LAYERS)  # nothing landed
    fake.complete(loaded)
    consumer.run(lambda: "c" in consumer.recved)
    assert_pages_moved(producer, consumer, "c", "p", 0, 4)
    consumer.run(lambda: "c" in consumer.new_reqs)
    assert consumer.new_reqs["c"].num_computed_tokens == 99
    consumer.finish("c")
    assert_nothing_left(producer, consumer)
    assert consumer.stats["loaded_requests"] == 1 and fake.syncs["MainThread"] == 0


def _assert_sleep_waits_for(engine: Any, fake: Any, event: Any, what: str) -> None:
    """``unregister_kv_caches`` (sleep mode) blocks until ``event`` completes, then returns; the caches are
    restored after."""
    asleep = threading.Thread(target=engine.worker.unregister_kv_caches)
    asleep.start()
    asleep.join(0.3)
    assert asleep.is_alive(), f"unregister_kv_caches returned while {what}"
    fake.complete(event)
    asleep.join(STEP_TIMEOUT_S)
    assert not asleep.is_alive()
    engine.worker.restore_kv_caches()


def test_sleep_waits_for_a_load_whose_copy_has_not_run(make_gpu_engine, make_engine) -> None:
    """The sleep-mode gate is held until the copy ran, not just until it was queued."""
    producer = make_engine("kv_producer")
    consumer, fake = make_gpu_engine("kv_consumer")
    _, loaded = _start_load(producer, consumer, fake, seed=92)
    _assert_sleep_waits_for(consumer, fake, loaded, "a load's copy had not run")
    consumer.run(lambda: "c" in consumer.new_reqs)
    assert consumer.new_reqs["c"].num_computed_tokens == 99  # it finished before the caches went
    assert_pages_moved(producer, consumer, "c", "p", 0, 4)
    consumer.finish("c")
    assert_nothing_left(producer, consumer)


def test_sleep_waits_for_save_copies_still_reading_the_caches(make_gpu_engine) -> None:
    producer, fake = make_gpu_engine("kv_producer")
    save_stream, _ = streams(producer)
    producer.add("p", prompt_of(70, seed=93), max_tokens=1, params=PROXY_PARAMS)
    producer.step()
    (saved,) = fake.events_on(save_stream)
    _assert_sleep_waits_for(producer, fake, saved, "save copies could still read the caches")
    producer.wait_saved()
    producer.assert_empty()
    assert producer.stats["saved_requests"] == 1


@pytest.mark.parametrize("when", ["queued", "ran"])
def test_a_failed_copy_reports_the_blocks(make_gpu_engine, make_engine, when: str) -> None:
    """A copy that fails as it is queued (say, out of device memory) or when it runs (a CUDA error the
    event reports): the request's blocks are reported like any failed load, and it is recomputed."""
    producer = make_engine("kv_producer")
    consumer, fake = make_gpu_engine("kv_consumer", auto=True)
    error = RuntimeError("CUDA error: an illegal memory access was encountered")
    if when == "queued":
        fake.fail_copies = error
    else:
        fake.fail_events = error
    prompt = prompt_of(100, seed=94)
    params = producer.produce("p", prompt)
    consumer.add("c", prompt, max_tokens=1, params=params)
    consumer.step()
    blocks = consumer.block_ids("c")
    consumer.finish("c")
    assert consumer.invalid_blocks == [set(blocks[:4])]
    assert consumer.new_reqs["c"].num_computed_tokens == 0  # recomputed
    assert consumer.stats["load_failures"] == 1 and consumer.stats["loaded_requests"] == 0
    assert_nothing_left(producer, consumer)


def test_a_save_whose_copy_failed_is_not_stored(make_gpu_engine) -> None:
    producer, fake = make_gpu_engine("kv_producer", auto=True)
    fake.fail_events = RuntimeError("CUDA error: unspecified launch failure")
    producer.produce("p", prompt_of(70, seed=95))
    producer.assert_empty()
    assert producer.stats["save_failures"] == 1 and producer.stats["saved_requests"] == 0
    assert redis_keys(producer.redis_url, producer.namespace) == []
