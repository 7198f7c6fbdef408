"""The connector's counters and latencies, shipped through vLLM's KV-connector stats from the worker
processes and the scheduler to the API server, which logs them (its periodic "KV Transfer metrics" line:
counts, Avg/P90 times, MB/s) and serves them on ``/metrics`` as ``vllm:kvredis_<name>_total`` counters and
``vllm:kvredis_*`` histograms.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvredis.store.metrics import Metrics

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


TIMINGS = {
    "load_seconds": ("vllm:kvredis_load_time_seconds",
                     "Time to load one request's KV from Redis (a decode's wait for its prefill's write "
                     "included), per rank"),
    "store_seconds": ("vllm:kvredis_store_time_seconds",
                      "Time to store one prompt's KV in Redis (from the step that computed it), per rank"),
    "lookup_seconds": ("vllm:kvredis_lookup_time_seconds",
                       "Delay of one scheduler lookup of a prompt in Redis (from the request's ask to "
                       "Redis's answer, the cache generation's read included)"),
}
"""Latencies, one sample per load, store or lookup, served as ``vllm:kvredis_*_seconds`` histograms and
summed up (Avg, P90) in vLLM's "KV Transfer metrics" line."""
SIZES = {
    "load_bytes": ("vllm:kvredis_load_bytes", "Bytes of KV one load read from Redis, per rank"),
    "store_bytes": ("vllm:kvredis_store_bytes", "Bytes of KV one store wrote to Redis, per rank"),
}
"""Sizes, one sample per load or store (beside its time), served as histograms; with the times they give the
line's MB/s."""
SAMPLES = (*TIMINGS, *SIZES)

_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BYTE_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))  # 2 KiB to 8 GiB, as NIXL's


@dataclass
class KVRedisStats(KVConnectorStats):
    """Counts of :data:`STATS` and samples of :data:`SAMPLES` since the last report; vLLM ships them from
    workers to its stat loggers (``data`` is a plain dict: numbers and lists of numbers)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVRedisStats:
        for name, value in (other.data or {}).items():
            if isinstance(value, list):
                self.data[name] = [*self.data.get(name, ()), *value]
            else:
                self.data[name] = self.data.get(name, 0) + int(value)
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counts, and for loads, stores and lookups their number, average and 90th percentile time (ms)
        and throughput (MB/s), as NIXL's line says them."""
        reduced: dict[str, int | float] = {
            name: int(self.data[name]) for name in STATS if self.data.get(name)}
        for kind, label in (("load", "load"), ("store", "store"), ("lookup", "lookup")):
            times = self.data.get(f"{kind}_seconds") or []
            if not times:
                continue
            ordered = sorted(times)
            reduced[f"Avg {label} time (ms)"] = round(sum(times) / len(times) * 1e3, 3)
            reduced[f"P90 {label} time (ms)"] = round(_percentile(ordered, 0.9) * 1e3, 3)
            sizes = self.data.get(f"{kind}_bytes") or []
            if sizes and sum(times) > 0:
                reduced[f"Avg MB per {label}"] = round(sum(sizes) / len(sizes) / 2**20, 3)
                reduced[f"{label.capitalize()} throughput (MB/s)"] = round(sum(sizes) / 2**20 / sum(times), 3)
        return reduced

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _percentile(ordered: list[float], fraction: float) -> float:
    """The ``fraction`` percentile of sorted samples, interpolated linearly (numpy's default)."""
    position = (len(ordered) - 1) * fraction
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class KVRedisPromMetrics(KVConnectorPromMetrics):
    """On vLLM's ``/metrics``, one series per engine: ``vllm:kvredis_<name>_total`` counters of :data:`STATS`,
    and histograms of :data:`TIMINGS` and :data:`SIZES`. They are registered in the process that serves
    ``/metrics`` (vLLM's API server), so no ``PROMETHEUS_MULTIPROC_DIR`` is needed."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric: Any) -> dict[int, Any]:
            return {engine: metric.labels(*values) for engine, values in per_engine_labelvalues.items()}

        self._series = {
            name: per_engine(self._counter_cls(name=f"vllm:kvredis_{name}", documentation=help_text,
                                               labelnames=labelnames))
            for name, help_text in STATS.items()
        }
        self._histograms = {
            name: per_engine(self._histogram_cls(name=metric, documentation=help_text, labelnames=labelnames,
                                                 buckets=_TIME_BUCKETS if name in TIMINGS else _BYTE_BUCKETS))
            for name, (metric, help_text) in {**TIMINGS, **SIZES}.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if isinstance(value, list):
                histogram = self._histograms.get(name, {}).get(engine_idx)
                if histogram is not None:
                    for sample in value:
                        histogram.observe(sample)
                continue
            series = self._series.get(name, {}).get(engine_idx)
            if series is not None and value:
                series.inc(value)


class Counts:
    """Thread-safe counts of :data:`STATS` and samples of :data:`SAMPLES`, taken (and reset) by
    ``get_kv_connector_stats``."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._samples: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def add(self, **amounts: int) -> None:
        with self._lock:
            self._counts.update(amounts)

    def observe(self, **samples: float) -> None:
        """One sample of each named series of :data:`SAMPLES` (a load's time and bytes, say)."""
        with self._lock:
            for name, value in samples.items():
                self._samples.setdefault(name, []).append(value)

    def take(self) -> KVRedisStats | None:
        with self._lock:
            if not any(self._counts.values()) and not self._samples:
                return None
            data: dict[str, Any] = {**self._counts, **self._samples}
            self._counts.clear()
            self._samples = {}
        return KVRedisStats(data=data)


class ConnectorMetrics(Metrics):
    """The endpoint's :class:`~kvredis.store.metrics.Metrics` (``kvredis_*`` series of the process's
    registry), whose every store and load is also a sample of vLLM's connector stats (:class:`Counts`)."""

    def __init__(self, namespace: str, counts: Counts) -> None:
        super().__init__(namespace)
        self._counts = counts

    def stored(self, nbytes: int, seconds: float) -> None:
        super().stored(nbytes, seconds)
        self._counts.observe(store_seconds=seconds, store_bytes=nbytes)

    def loaded(self, nbytes: int, seconds: float, waited: float | None = None) -> None:
        super().loaded(nbytes, seconds, waited)
        self._counts.observe(load_seconds=seconds, load_bytes=nbytes)
