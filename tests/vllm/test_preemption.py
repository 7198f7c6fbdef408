"""Preemption under vLLM's real scheduler: a request whose blocks are taken back mid-prefill or mid-decode.

vLLM preempts a running request when another cannot get a block: the preempted one loses its blocks (the
full ones stay in the prefix cache until reused) and later comes back to compute what it lost. vLLM before
0.34 sends it back to the workers as a resumed request (``resumed_req_ids``) with a new block table; 0.34
sends it as a new request. Either way a producer must save the prompt once, whole, from the blocks it
ends in, and a consumer must neither load again nor recompute what its prefix cache still holds. The
engines here have 16 blocks (15 usable) so that two requests fill them. The harness is ``test_scheduler``'s.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("vllm.version", reason="needs vLLM's CPU build (run with the vLLM environment's python)")

import test_scheduler
import torch
from conftest import BLOCK_SIZE
from test_scheduler import (
    LAYERS,
    STEP_TIMEOUT_S,
    TRANSFER_PARAM,
    assert_nothing_left,
    assert_pages_moved,
    kv_values,
    prompt_of,
    redis_keys,
    same_bits,
)

make_engine = test_scheduler.make_engine  # the harness's fixture

SMALL = 16  # blocks per engine, the null block included


def _run(engine: Any, until: Any, outputs: list[Any], timeout_s: float = STEP_TIMEOUT_S) -> None:
    """``Engine.run``, keeping every scheduler output (to see what was preempted, loaded, resumed)."""
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "the engine did not get there in time"
        output = engine.step()
        outputs.append(output)
        if not output.total_num_scheduled_tokens:
            time.sleep(0.002)


def _preempted(outputs: list[Any]) -> set[str]:
    return set().union(*(output.preempted_req_ids or () for output in outputs))


def _computed_at_schedule(outputs: list[Any], req_id: str) -> list[int]:
    """``num_computed_tokens`` each time the request was (re)scheduled from the waiting queue."""
    found = []
    for output in outputs:
        for new in output.scheduled_new_reqs:
            if new.req_id == req_id:
                found.append(int(new.num_computed_tokens))
        cached = output.scheduled_cached_reqs
        for index, cached_id in enumerate(cached.req_ids):
            if cached_id == req_id and cached_id in (getattr(cached, "resumed_req_ids", None) or ()):
                found.append(int(cached.num_computed_tokens[index]))
    return found


def _expected_pages(prompt: list[int], layer: int, blocks: int) -> torch.Tensor:
    """The pages the fake forward computes for the prompt's first ``blocks`` blocks: ``[blocks, H, B, W]``."""
    positions = torch.arange(blocks * BLOCK_SIZE)
    values = kv_values(torch.tensor(prompt[:blocks * BLOCK_SIZE]), positions, layer)
    return values.reshape(blocks, BLOCK_SIZE, *values.shape[1:]).transpose(1, 2)


def test_a_prefill_preempted_midway_is_saved_once_whole(make_engine) -> None:
    # Admitted on its first chunk's blocks alone (not the whole prompt's), as vLLM allows, so that it can run
    # out of blocks midway.
    producer = make_engine("kv_producer", num_blocks=SMALL,
                           scheduler_settings={"scheduler_reserve_full_isl": False})
    consumer = make_engine("kv_consumer")
    producer.add("busy", prompt_of(100, seed=80), max_tokens=40)  # 4 blocks, growing to 5
    prompt = prompt_of(400, seed=81)  # 13 blocks: with "busy"'s, more than the 15 there are
    producer.add("p", prompt, max_tokens=1, params={"do_remote_decode": True, "do_remote_prefill": False})
    outputs: list[Any] = []
    _run(producer, lambda: "p" in producer.finished, outputs, timeout_s=30.0)
    assert "p" in _preempted(outputs), "the prefill was meant to be preempted"
    # Started from nothing; resumed from the 8 full blocks its first chunks computed (the prefix cache).
    assert _computed_at_schedule(outputs, "p") == [0, 8 * BLOCK_SIZE]
    saves = [spec for output in outputs for spec in output.kv_connector_metadata.saves]
    assert [spec.req_id for spec in saves] == ["p"] and (saves[0].start, saves[0].stop) == (0, 400)
    params = producer.finished["p"].kv_transfer_params
    assert params and TRANSFER_PARAM in params
    producer.wait_saved()
    for index, name in enumerate(LAYERS):  # what was saved is the whole prompt, every position
        assert same_bits(producer.snapshots["p"][name][:12], _expected_pages(prompt, index, 12)), name
    consumer.add("c", prompt, params=params)
    consumer.run(lambda: "c" in consumer.new_reqs)
    assert consumer.new_reqs["c"].num_computed_tokens == 399
    assert_pages_moved(producer, consumer, "c", "p", 0, 13)
    consumer.finish("c")
    producer.finish("busy")
    producer.assert_empty()
    assert producer.stats["saved_requests"] == 1 and producer.stats["save_failures"] == 0
    consumer.assert_empty()
    assert redis_keys(consumer.redis_url, consumer.namespace) == []


def test_a_decode_preempted_after_its_load_neither_loads_again_nor_recomputes_it(make_engine) -> None:
    """Priority scheduling, so that the loaded request is the one preempted when the other grows."""
    producer = make_engine("kv_producer")
    consumer = make_engine("kv_consumer", num_blocks=SMALL, scheduler_settings={"policy": "priority"})
    prompt = prompt_of(9 * BLOCK_SIZE + 1, seed=82)  # loads 9 full blocks, computes the last token
    params = producer.produce("p", prompt)
    consumer.add("c", prompt, max_tokens=100, params=params, priority=1)
    outputs: list[Any] = []
    _run(consumer, lambda: "c" in consumer.new_reqs and len(consumer.scheduled["c"]) >= 2, outputs)
    assert consumer.new_reqs["c"].num_computed_tokens == 9 * BLOCK_SIZE
    loaded_blocks = consumer.block_ids("c")[:9]
    consumer.add("urgent", prompt_of(150, seed=83), max_tokens=20, priority=0)  # 5 blocks, growing to 6
    _run(consumer, lambda: "c" in _preempted(outputs), outputs)
    _run(consumer, lambda: "c" in consumer.finished, outputs, timeout_s=30.0)
    assert "urgent" in consumer.finished  # it ran first, in the blocks "c" gave back
    loads = [spec.req_id for output in outputs for spec in output.kv_connector_metadata.loads]
    assert loads == ["c"], loads  # loaded once
    assert consumer.stats["loaded_requests"] == 1 and consumer.stats["load_failures"] == 0
    assert consumer.invalid_blocks == []
    computed = _computed_at_schedule(outputs, "c")
    assert computed == [9 * BLOCK_SIZE, 9 * BLOCK_SIZE], computed  # first run, and the resumed one
    for index, name in enumerate(LAYERS):  # the loaded pages are still what the prefill computed
        assert same_bits(consumer.layers[name][torch.tensor(loaded_blocks)],
                         _expected_pages(prompt, index, 9)), name
    assert_nothing_left(producer, consumer)
