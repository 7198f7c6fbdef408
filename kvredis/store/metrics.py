"""Counters and latency histograms: kept in-process, and exported to Prometheus when it is installed.

vLLM already serves ``prometheus_client``'s default registry on its ``/metrics`` endpoint, so kvredis
registers there and its series appear next to vLLM's. Without ``prometheus_client`` (the ``metrics``
extra) only the in-process counts exist; nothing else changes.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

try:
    import prometheus_client
except ImportError:  # an optional extra
    prometheus_client = None  # type: ignore[assignment]

MISS_CAUSES = ("absent", "partial", "corrupt", "foreign", "mismatch", "error", "timeout")
"""Why a lookup missed: nothing came; a piece was gone; unreadable; another format or prompt; a shape or
dtype this reader cannot use; Redis failed; Redis did not answer in time."""

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_prometheus: dict[str, Any] = {}
_prometheus_lock = threading.Lock()


def _series() -> dict[str, Any]:
    """The process-wide Prometheus series, created once (a name can be registered only once)."""
    if prometheus_client is None:
        return {}
    with _prometheus_lock:
        if not _prometheus:
            counter, histogram = prometheus_client.Counter, prometheus_client.Histogram
            _prometheus.update(
                stored=counter("kvredis_entries_stored", "Entries written to Redis", ["namespace"]),
                loaded=counter("kvredis_entries_loaded", "Entries read back from Redis", ["namespace"]),
                misses=counter("kvredis_misses", "Lookups that found no usable entry",
                               ["namespace", "cause"]),
                dropped=counter("kvredis_dropped_entries", "Entries taken but unusable, dropped",
                                ["namespace", "cause"]),
                store_failures=counter("kvredis_store_failures", "Inserts that raised instead of storing",
                                       ["namespace", "cause"]),
                timeouts=counter("kvredis_timeouts", "Redis calls that ran past their bound", ["namespace"]),
                bytes=counter("kvredis_bytes", "Payload bytes moved", ["namespace", "direction"]),
                store_seconds=histogram("kvredis_store_seconds", "Time to store one entry", ["namespace"],
                                        buckets=_LATENCY_BUCKETS),
                load_seconds=histogram("kvredis_load_seconds", "Time to load one entry", ["namespace"],
                                       buckets=_LATENCY_BUCKETS),
                wait_seconds=histogram("kvredis_wait_seconds",
                                       "Time a load of an announced transfer waited for its record (the "
                                       "prefill's write still in flight), part of kvredis_load_seconds",
                                       ["namespace"], buckets=_LATENCY_BUCKETS),
            )
    return _prometheus


class Metrics:
    """The counters of one buffer or connector, labelled with its namespace."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._series = _series()
        # Looking a labelled child up costs more than the increment: the hot ones are bound once.
        self._hot: dict[Any, Any] = {}
        if self._series:
            self._hot = {
                "stored": self._series["stored"].labels(namespace),
                "loaded": self._series["loaded"].labels(namespace),
                "bytes_stored": self._series["bytes"].labels(namespace, "stored"),
                "bytes_loaded": self._series["bytes"].labels(namespace, "loaded"),
                "store_seconds": self._series["store_seconds"].labels(namespace),
                "load_seconds": self._series["load_seconds"].labels(namespace),
                "wait_seconds": self._series["wait_seconds"].labels(namespace),
            }

    def _add(self, *names: str) -> None:
        with self._lock:
            for name in names:
                self.counts[name] += 1

    def _labelled(self, series: str, *labels: str) -> Any:
        """The Prometheus child of ``series`` for this namespace and ``labels``, looked up once."""
        key = (series, *labels)
        child = self._hot.get(key)
        if child is None:
            child = self._hot[key] = self._series[series].labels(self.namespace, *labels)
        return child

    def stored(self, nbytes: int, seconds: float) -> None:
        """One entry written."""
        with self._lock:
            self.counts["stored"] += 1
            self.counts["bytes_stored"] += nbytes
        if self._hot:
            self._hot["stored"].inc()
            self._hot["bytes_stored"].inc(nbytes)
            self._hot["store_seconds"].observe(seconds)

    def loaded(self, nbytes: int, seconds: float, waited: float | None = None) -> None:
        """One entry read back (a hit), in ``seconds``, of which it ``waited`` for a transfer's record
        (``None``: it was not waiting for one)."""
        with self._lock:
            self.counts["loaded"] += 1
            self.counts["bytes_loaded"] += nbytes
        if self._hot:
            self._hot["loaded"].inc()
            self._hot["bytes_loaded"].inc(nbytes)
            self._hot["load_seconds"].observe(seconds)
            if waited is not None:
                self._hot["wait_seconds"].observe(waited)

    def miss(self, cause: str) -> None:
        """One lookup that found nothing usable, and why (one of :data:`MISS_CAUSES`)."""
        if cause not in MISS_CAUSES:
            raise ValueError(f"unknown miss cause {cause!r}")
        self._add("misses", f"miss_{cause}")
        if self._series:
            self._labelled("misses", cause).inc()

    def dropped(self, cause: str) -> None:
        """One entry taken from Redis but dropped as unusable (one of :data:`MISS_CAUSES`)."""
        if cause not in MISS_CAUSES:
            raise ValueError(f"unknown drop cause {cause!r}")
        self._add("dropped", f"dropped_{cause}")
        if self._series:
            self._labelled("dropped", cause).inc()

    def store_failed(self, cause: str) -> None:
        """One insert that raised (``"timeout"`` or ``"error"``); readers never see half of it."""
        if cause not in ("timeout", "error"):
            raise ValueError(f"unknown store failure cause {cause!r}")
        self._add("store_failed", f"store_failed_{cause}")
        if self._series:
            self._labelled("store_failures", cause).inc()

    def timeout(self) -> None:
        """One Redis call that ran past its bound."""
        self._add("timeouts")
        if self._series:
            self._labelled("timeouts").inc()

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self.counts[name]
