"""One engine process's end of the Redis link, as both sides of the connector use it: its settings, the
identity its chunks are keyed for, the Redis connection, the chunk transfers and the counters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvredis.config import KVRedisConfig
from kvredis.store.client import RedisStore
from kvredis.store.keys import CacheIdentity, KeySpace
from kvredis.store.metrics import Metrics
from kvredis.store.transfer import Transfers
from kvredis.vllm.cache_groups import STATE, Series, describe
from kvredis.vllm.engine import cache_identity, worker_pp_rank, worker_tp_rank
from kvredis.vllm.events import Outcomes
from kvredis.vllm.heads import HeadSplit
from kvredis.vllm.stats import ConnectorMetrics, Counts

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass
class Endpoint:
    """What a scheduler or a worker needs to reach Redis; :meth:`open` builds it from vLLM's configuration."""

    config: KVRedisConfig
    identity: CacheIdentity
    keyspace: KeySpace
    store: RedisStore
    transfers: Transfers
    metrics: Metrics
    counts: Counts
    block_size: int
    series: tuple[Series, ...] = ()
    stores: tuple[Transfers, ...] = field(default=())
    """Each series' transfers of this rank's KV heads, in the order of ``series`` (``transfers`` is the
    first's)."""
    split: HeadSplit = field(default_factory=lambda: HeadSplit(1))
    """How the engine's KV heads are split over its tensor-parallel ranks."""
    rank: int = 0
    """This rank (the scheduler's: 0)."""
    identity_of: Callable[[int, int], CacheIdentity] | None = None
    """The identity of part ``part`` of a split into ``parts`` head ranges (another TP size's chunks)."""
    outcomes: Outcomes = field(default_factory=lambda: Outcomes(enabled=False))
    """A worker's save outcomes, for the scheduler's KV events (kept only with ``--kv-events-config``)."""
    _other_stores: dict[tuple[int, int], tuple[Transfers, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.stores:
            self.stores = (self.transfers,)

    @property
    def writes(self) -> bool:
        """Whether this rank writes its KV (the first of the ranks holding the same heads does, for all)."""
        return self.rank % self.split.replicas == 0

    @classmethod
    def open(cls, vllm_config: VllmConfig, config: KVRedisConfig, *, worker: bool,
             series: tuple[Series, ...] = (), rank: int | None = None) -> Endpoint:
        """The endpoint of this process: a worker's keys name the KV heads its tensor-parallel rank holds and
        its pipeline stage; the scheduler's are rank 0's, and its connection is bounded by the lookup
        timeout. Each series of a hybrid model's layers (:mod:`kvredis.vllm.cache_groups`) has its chunks
        under a prefix of its own; a window's are a block long."""
        if rank is None:
            rank = worker_tp_rank() if worker else 0
        pp_rank = worker_pp_rank() if worker else 0
        split = HeadSplit.of(vllm_config)

        def identity_of(part: int, parts: int) -> CacheIdentity:
            return cache_identity(vllm_config, part, pp_rank, parts)

        identity = identity_of(split.part_of(rank), split.parts)
        if not worker:
            # The scheduler looks chunks up inside vLLM's scheduling loop: the store bounds the reply by
            # KVREDIS_LOOKUP_TIMEOUT_S, and opening a connection to an unreachable Redis must not take longer.
            config = config.replace(connect_timeout_s=min(config.connect_timeout_s, config.lookup_timeout_s))
        block_size = int(vllm_config.cache_config.block_size)
        keyspace = KeySpace(config.namespace, identity)
        store = RedisStore(config)
        stores = series_stores(store, config, block_size, series, keyspace.prefix)
        counts = Counts()
        return cls(config, identity, keyspace, store, stores[0], ConnectorMetrics(config.namespace, counts),
                   counts, block_size, series, stores, split, rank, identity_of,
                   Outcomes(enabled=worker and kv_events_enabled(vllm_config)))

    def stores_of(self, parts: int, part: int) -> tuple[Transfers, ...]:
        """Each series' transfers of part ``part`` of a split into ``parts`` head ranges (this rank's own, or
        another tensor-parallel size's)."""
        if parts == self.split.parts and part == self.split.part_of(self.rank):
            return self.stores
        stores = self._other_stores.get((parts, part))
        if stores is None:
            assert self.identity_of is not None, "an endpoint built without vLLM's configuration"
            prefix = KeySpace(self.config.namespace, self.identity_of(part, parts)).prefix
            stores = series_stores(self.store, self.config, self.block_size, self.series, prefix)
            self._other_stores[parts, part] = stores
        return stores

    def engine_fields(self) -> dict[str, Any]:
        """The fields of this engine that decide whether its chunks fit another (an announcement's
        ``engine``; the heads are said as the split, ``kv_parts`` head ranges of ``kv_heads``: a reader whose
        split nests with it reads the chunks of any tensor-parallel size)."""
        identity = self.identity
        return {"namespace": self.config.namespace, "model": identity.model, "kv_dtype": identity.kv_dtype,
                "layout": identity.layout, "block_size": identity.block_size,
                "kv_heads": self.split.total, "kv_parts": self.split.parts,
                "format_version": identity.format_version, "weights": identity.weights,
                "chunk_tokens": self.transfers.chunk_tokens,
                # A hybrid model's series (a plain model's announcement has none, as before there were any).
                **({"series": describe(self.series)} if any(not s.whole for s in self.series) else {})}

    def close(self) -> None:
        """Release the Redis connections (chunks already stored stay until taken or expired)."""
        self.store.close()


def kv_events_enabled(vllm_config: VllmConfig) -> bool:
    """Whether vLLM publishes KV events (``--kv-events-config`` with ``enable_kv_cache_events``)."""
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and getattr(events, "enable_kv_cache_events", False))


def series_prefix(prefix: str, tag: str) -> str:
    """The key prefix of a series of layers (:mod:`kvredis.vllm.cache_groups`): the engine's own for full
    attention, so a plain model keeps its keys."""
    return f"{prefix}:{tag}" if tag else prefix


def series_stores(store: RedisStore, config: KVRedisConfig, block_size: int, series: tuple[Series, ...],
                  prefix: str) -> tuple[Transfers, ...]:
    """Each series' transfers under the key prefix of one identity."""
    # Chunks are whole blocks: the configured length is rounded up to the next multiple of a block.
    chunk_tokens = -(-config.chunk_tokens // block_size) * block_size
    if any(s.kind == STATE for s in series):
        # A reader resumes where a state is kept, at block boundaries: chunks end there too.
        chunk_tokens = block_size

    def transfers_of(tag: str, whole: bool) -> Transfers:
        return Transfers(
            store, series_prefix(prefix, tag),
            chunk_tokens=chunk_tokens if whole else block_size, block_size=block_size,
            ttl_ms=int(config.ttl_s * 1000), pop_timeout_s=config.pop_timeout_s,
            max_chunk_bytes=config.max_entry_bytes, checksum=config.checksum, reuse=config.reuse)

    return tuple(transfers_of(s.tag, s.whole) for s in series) or (transfers_of("", True),)
