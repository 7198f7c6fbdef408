"""The connector's counters, shipped through vLLM's KV-connector stats from the worker processes and the
scheduler to the API server, which logs them ("KV Transfer metrics") and serves them on ``/metrics`` as
``vllm:kvredis_<name>_total``.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

STATS = {
    "loaded_requests": "Requests whose prompt KV was loaded from Redis",
    "loaded_tokens": "Prompt tokens loaded from Redis instead of computed",
    "load_failures": "Announced or found entries that could not be loaded (their tokens were recomputed)",
    "failed_tokens": "Prompt tokens that were to be loaded but were recomputed",
    "saved_requests": "Prompts whose KV was stored in Redis",
    "saved_tokens": "Prompt tokens whose KV was stored in Redis",
    "save_failures": "Prompts whose KV could not be stored in Redis",
    "lookup_errors": "Scheduler lookups in Redis that failed (Redis down or slow)",
    "lookup_tokens": "Prompt tokens the scheduler looked up in Redis (beyond its own prefix cache's hit)",
    "found_tokens": "Prompt tokens of those looked up that Redis held (a stored prefix)",
    "skipped_requests": "Requests neither saved nor loaded (prompt embeddings, or announced by a prefill "
                        "engine configured differently)",
    "discarded_entries": "Announced entries deleted unread because the decode computed the prompt itself",
    "loaded_bytes": "Bytes of KV chunks read from Redis",
    "written_chunks": "KV chunks a prefill wrote to Redis",
    "present_chunks": "KV chunks a prefill did not write because Redis held them already",
    "written_bytes": "Bytes of KV pages a prefill wrote to Redis",
    "copied_bytes": "Bytes of KV pages a prefill copied out of its KV cache to store (none of the chunks its "
                    "lookup found in Redis)",
}
"""The connector's counters, reported through vLLM's KV-connector stats: vLLM logs them ("KV Transfer
metrics") and serves them on ``/metrics`` as ``vllm:kvredis_<name>_total``. Worker counts are summed over
tensor-parallel ranks (each rank moves its own shard)."""


@dataclass
class KVRedisStats(KVConnectorStats):
    """Counts of :data:`STATS` since the last report; vLLM ships them from workers to its stat loggers."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVRedisStats:
        for name, value in (other.data or {}).items():
            self.data[name] = self.data.get(name, 0) + int(value)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: int(self.data[name]) for name in STATS if self.data.get(name)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVRedisPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvredis_<name>_total`` counters on vLLM's ``/metrics``, one series per engine."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._series = {
            name: {
                engine: counter.labels(*values)
                for engine, values in per_engine_labelvalues.items()
            }
            for name, counter in (
                (name, self._counter_cls(name=f"vllm:kvredis_{name}", documentation=help_text,
                                         labelnames=labelnames))
                for name, help_text in STATS.items()
            )
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            series = self._series.get(name, {}).get(engine_idx)
            if series is not None and value:
                series.inc(value)


class Counts:
    """Thread-safe counts of :data:`STATS`, taken (and reset) by ``get_kv_connector_stats``."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, **amounts: int) -> None:
        with self._lock:
            self._counts.update(amounts)

    def take(self) -> KVRedisStats | None:
        with self._lock:
            if not any(self._counts.values()):
                return None
            data = dict(self._counts)
            self._counts.clear()
        return KVRedisStats(data=data)
