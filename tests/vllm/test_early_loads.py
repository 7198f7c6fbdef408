"""Loads that start while the batch is full: vLLM 0.34's ``may_load_async``, ``--max-num-inflight-kv-loads``.

With the option set, vLLM 0.34 keeps requests whose connector answers ``may_load_async`` true in a queue of
their own, and starts their loads even when no running slot is free: the KV arrives while the batch is
busy, and the request only needs a slot to compute its last token. kvredis answers true for a request a
prefill announced (with an entry that fits this engine). Releases before 0.34 have neither the hook nor the
option: there the same request waits for a slot before its load starts, which the test checks too, so the
file runs (and means something) on every version. The harness is ``test_scheduler``'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

pytest.importorskip("vllm.version", reason="needs vLLM's CPU build (run with the vLLM environment's python)")

import test_scheduler
from test_scheduler import TRANSFER_PARAM, announcement, prompt_of
from vllm.config import SchedulerConfig
from vllm.v1.request import RequestStatus

from kvredis.store.keys import new_entry_id

make_engine = test_scheduler.make_engine  # the harness's fixture

HAS_INFLIGHT_LOADS = "max_num_inflight_kv_loads" in {f.name for f in dataclasses.fields(SchedulerConfig)}
"""vLLM 0.34+: async loads may start while the running batch is full."""


def _full_consumer(make_engine: Any) -> Any:
    """A consumer that runs one request at a time (async loads in flight: up to 2, where vLLM has the
    option), busy with a long decode of an unannounced prompt."""
    limits: dict[str, Any] = {"max_num_seqs": 1}
    if HAS_INFLIGHT_LOADS:
        limits["max_num_inflight_kv_loads"] = 2
    consumer = make_engine("kv_consumer", scheduler_settings=limits)
    consumer.add("busy", prompt_of(40, seed=60), max_tokens=60)
    # Running once its lookup is answered: at the first step unless the host stalls past the step's
    # few-millisecond wait for it.
    consumer.run(lambda: "busy" in consumer.new_reqs)
    assert [request.request_id for request in consumer.scheduler.running] == ["busy"]
    return consumer


def test_an_announced_load_starts_while_the_batch_is_full(make_engine) -> None:
    producer = make_engine("kv_producer")
    consumer = _full_consumer(make_engine)
    prompt = prompt_of(100, seed=61)
    params = producer.produce("p", prompt)
    consumer.add("c", prompt, max_tokens=2, params=params)
    assert consumer.connector.may_load_async(consumer.scheduler.requests["c"])
    status = consumer.scheduler.requests["c"].status
    if HAS_INFLIGHT_LOADS:
        # The load starts while "busy" holds the only slot; no step runs until it is over, so "busy" cannot
        # finish first however slow the load thread is (stepping meanwhile raced 60 fast steps against it).
        consumer.run(lambda: consumer.scheduler.requests["c"].status == RequestStatus.WAITING_FOR_REMOTE_KVS)
        consumer.wait_loaded("c")
        consumer.run(lambda: "c" in consumer.recved)  # the KV arrived while "busy" held the only slot
        assert "busy" not in consumer.finished and "c" not in consumer.new_reqs
        assert consumer.stats["loaded_requests"] == 1
    else:
        for _ in range(5):  # no slot, no load: it waits in the plain queue, nothing allocated
            consumer.step()
            assert consumer.scheduler.requests["c"].status == status == RequestStatus.WAITING
            assert "c" not in consumer.recved and not consumer.block_ids("c")
    consumer.run(lambda: "c" in consumer.finished, timeout_s=30.0)
    assert consumer.new_reqs["c"].num_computed_tokens == 99  # loaded, not computed
    assert consumer.scheduled["c"][0] == 1
    assert consumer.stats["loaded_requests"] == 1 and consumer.stats["load_failures"] == 0
    consumer.finish("busy")
    producer.assert_empty()
    consumer.assert_empty()


def test_only_announced_requests_that_fit_may_load_early(make_engine) -> None:
    """Cheap and without false positives that matter: no Redis lookup, no early load for what is computed."""
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer")
    prompt = prompt_of(70, seed=62)
    entry = new_entry_id()
    other_engine = announcement(prompt, entry)
    other_engine[TRANSFER_PARAM]["engine"] = {"block_size": 16}
    requests = {
        "announced": consumer.add("announced", prompt, params=announcement(prompt, entry)),
        "unannounced": consumer.add("unannounced", prompt),
        "malformed": consumer.add("malformed", prompt, params={TRANSFER_PARAM: "entry"}),
        "other-engine": consumer.add("other-engine", prompt, params=other_engine),
    }
    assert {name: consumer.connector.may_load_async(request) for name, request in requests.items()} == {
        "announced": True, "unannounced": False, "malformed": False, "other-engine": False}
    produced = producer.add("p", prompt, params=announcement(prompt, entry))
    assert not producer.connector.may_load_async(produced)
    for engine in (producer, consumer):
        engine.scheduler.finish_requests(list(engine.scheduler.requests), RequestStatus.FINISHED_ABORTED)
        engine.wait_discarded()
        engine.assert_empty()


def test_a_request_loaded_once_is_not_offered_an_early_load_again(make_engine) -> None:
    """After its load (as when vLLM puts a preempted request back in the waiting queues)."""
    producer, consumer = make_engine("kv_producer"), make_engine("kv_consumer")
    prompt = prompt_of(90, seed=63)
    params = producer.produce("p", prompt)
    request = consumer.add("c", prompt, max_tokens=4, params=params)
    consumer.run(lambda: "c" in consumer.new_reqs)
    assert not consumer.connector.may_load_async(request)
    consumer.finish("c")
    producer.assert_empty()
    consumer.assert_empty()
