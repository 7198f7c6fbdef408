"""What the scheduler-level tests share (``test_scheduler.py``, ``test_hybrid.py``): a request as vLLM's
serving layer builds it, a step's model-runner output handed to the real ``Scheduler`` as vLLM's engine
core does, the writers' late counts, and the keys a test's namespace holds."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import redis
from conftest import BLOCK_SIZE
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

from kvredis.store.generation import generation_key
from kvredis.store.tally import tally_key

STEP_TIMEOUT_S = 10.0


def new_request(req_id: str, prompt: list[int], max_tokens: int = 2, params: dict[str, Any] | None = None,
                **fields: Any) -> Request:
    """A greedy request; ``params`` its ``kv_transfer_params``, ``fields`` more of ``Request``'s."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                              extra_args={"kv_transfer_params": params} if params is not None else None)
    sampling.update_from_generation_config({}, 2)
    return Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=sampling,
                   pooling_params=None, block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
                   **{"mm_features": None, **fields})


def finish_step(scheduler: Any, output: Any, sampled: dict[str, list[int]], kv_output: KVConnectorOutput,
                stats: Counter[str], finished: dict[str, Any], samples: Counter[str] | None = None) -> None:
    """Hand the scheduler the step's model-runner output; add the connector's counts to ``stats`` (the number
    of its latency and size samples to ``samples``) and the requests that finished to ``finished``."""
    ids = list(sampled)
    extra = {}
    if "req_id_to_index" in {field.name for field in dataclasses.fields(ModelRunnerOutput)}:  # not 0.34
        extra["req_id_to_index"] = {rid: i for i, rid in enumerate(ids)}
    runner_output = ModelRunnerOutput(
        req_ids=ids, sampled_token_ids=[sampled[rid] for rid in ids], logprobs=None,
        prompt_logprobs_dict={}, pooler_output=None,
        kv_connector_output=None if kv_output.is_empty() else kv_output, **extra)
    for outputs in scheduler.update_from_output(output, runner_output).values():
        if outputs.scheduler_stats is not None and outputs.scheduler_stats.kv_connector_stats:
            add_counts(stats, outputs.scheduler_stats.kv_connector_stats, samples)
        for engine_output in outputs.outputs:
            if engine_output.finish_reason is not None:
                finished[engine_output.request_id] = engine_output


def wait_saved(worker: Any, stats: Counter[str], samples: Counter[str] | None = None) -> None:
    """Until the worker-role connector's writer threads stored every prompt handed to them; their counts join
    ``stats`` (and ``samples``, as :func:`add_counts`; vLLM would collect them at its next step)."""
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while worker.worker._saves_in_flight:
        assert time.monotonic() < deadline, "a save did not finish"
        time.sleep(0.002)
    late = worker.get_kv_connector_stats()
    if late is not None:
        add_counts(stats, late.data, samples)


def add_counts(stats: Counter[str], data: dict[str, Any], samples: Counter[str] | None = None) -> None:
    """Add a report's counts to ``stats``, and to ``samples`` the number of samples of each of its series
    (loads', stores' and lookups' times and sizes)."""
    for name, value in data.items():
        if not isinstance(value, list):
            stats[name] += value
        elif samples is not None:
            samples[name] += len(value)


def redis_keys(url: str, namespace: str) -> list[bytes]:
    """The namespace's keys but its tally (the schedulers' lookup counts, not KV) and its cache generation
    (made by a reset, kept)."""
    client = redis.Redis.from_url(url)
    besides = {tally_key(namespace).encode(), generation_key(namespace).encode()}
    try:
        return sorted(key for key in client.scan_iter(match=f"{namespace}:*", count=1000)
                      if key not in besides)
    finally:
        client.close()


def lookups_ready(connector: Any) -> None:
    """Until the scheduler-role connector's lookup thread has opened its connection, as it has in an engine
    by its first request (a real engine takes seconds to start; a test's scheduler none): the first lookup
    then answers within its step's wait, as every later one does."""
    scheduler = connector.scheduler
    if scheduler is not None:
        scheduler._lookup_thread.submit(lambda: None).result(timeout=STEP_TIMEOUT_S)


def delete_namespace(url: str, namespace: str) -> None:
    """Delete what a test left in its namespace (a failed test's keys, the schedulers' tally, its cache
    generation)."""
    client = redis.Redis.from_url(url)
    try:
        client.delete(*redis_keys(url, namespace), tally_key(namespace).encode(),
                      generation_key(namespace).encode())
    finally:
        client.close()


class Stepped:
    """The stepping every scheduler-level harness shares, over its own ``step``, ``add`` and ``wait_saved``
    and its ``finished`` outputs."""

    finished: dict[str, Any]

    def step(self) -> Any:
        raise NotImplementedError

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 2, params: dict[str, Any] | None = None,
            **fields: Any) -> Any:
        raise NotImplementedError

    def wait_saved(self) -> None:
        raise NotImplementedError

    def run(self, until: Callable[[], bool], timeout_s: float = STEP_TIMEOUT_S) -> int:
        """Step until ``until()`` holds; returns the number of steps."""
        deadline = time.monotonic() + timeout_s
        steps = 0
        while not until():
            assert time.monotonic() < deadline, "the engine did not get there in time"
            output = self.step()
            steps += 1
            if not output.total_num_scheduled_tokens:
                time.sleep(0.002)  # idle step: a load is in flight on a worker thread
        return steps

    def finish(self, req_id: str) -> Any:
        """Step until the request finished; its final output."""
        self.run(lambda: req_id in self.finished)
        return self.finished[req_id]

    def produce(self, req_id: str, prompt: list[int], wait: bool = True, **fields: Any) -> dict[str, Any]:
        """Prefill as the proxy asks (one token); the kv_transfer_params the answer carries, once the save
        landed (``wait``)."""
        self.add(req_id, prompt, max_tokens=1, params={"do_remote_decode": True, "do_remote_prefill": False},
                 **fields)
        params = self.finish(req_id).kv_transfer_params
        if wait:
            self.wait_saved()
        return params
