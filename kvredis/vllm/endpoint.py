"""One engine process's end of the Redis link, as both sides of the connector use it: its settings, the
identity its chunks are keyed for, the Redis connection, the chunk transfers and the counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvredis.client import RedisStore
from kvredis.config import KVRedisConfig
from kvredis.keys import CacheIdentity, KeySpace
from kvredis.metrics import Metrics
from kvredis.transfer import Transfers
from kvredis.vllm.cache_groups import STATE, Series, describe
from kvredis.vllm.engine import cache_identity, worker_pp_rank, worker_tp_rank
from kvredis.vllm.stats import Counts

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
    """Each series' transfers, in the order of ``series`` (``transfers`` is the first's)."""
    replicas: int = 1
    """Ranks in a row holding the same KV: one of them writes it (the first), every one reads it."""
    reader: int = 0
    """This rank among those ``replicas``: it takes a transfer as :func:`kvredis.keys.reader_id` says."""

    def __post_init__(self) -> None:
        if not self.stores:
            self.stores = (self.transfers,)

    @classmethod
    def open(cls, vllm_config: VllmConfig, config: KVRedisConfig, *, worker: bool,
             series: tuple[Series, ...] = (), replicas: int = 1) -> Endpoint:
        """The endpoint of this process: a worker's keys carry its tensor- and pipeline-parallel rank; the
        scheduler's are rank 0's, and its connection is bounded by the lookup timeout. Each series of a
        hybrid model's layers (:mod:`kvredis.vllm.cache_groups`) has its chunks under a prefix of its own;
        a window's are a block long. Ranks holding the same KV (``replicas``) share their keys."""
        rank = worker_tp_rank() if worker else 0
        identity = cache_identity(vllm_config, rank, worker_pp_rank() if worker else 0, replicas)
        if not worker:
            # The scheduler looks chunks up inside vLLM's scheduling loop: the store bounds the reply by
            # KVREDIS_LOOKUP_TIMEOUT_S, and opening a connection to an unreachable Redis must not take longer.
            config = config.replace(connect_timeout_s=min(config.connect_timeout_s, config.lookup_timeout_s))
        block_size = int(vllm_config.cache_config.block_size)
        keyspace = KeySpace(config.namespace, identity)
        store = RedisStore(config)
        # Chunks are whole blocks: the configured length is rounded up to the next multiple of a block.
        chunk_tokens = -(-config.chunk_tokens // block_size) * block_size
        if any(s.kind == STATE for s in series):
            # A reader resumes where a state is kept, at block boundaries: chunks end there too.
            chunk_tokens = block_size

        def transfers_of(tag: str, whole: bool) -> Transfers:
            return Transfers(
                store, series_prefix(keyspace.prefix, tag),
                chunk_tokens=chunk_tokens if whole else block_size, block_size=block_size,
                ttl_ms=int(config.ttl_s * 1000), pop_timeout_s=config.pop_timeout_s,
                max_chunk_bytes=config.max_entry_bytes, checksum=config.checksum, reuse=config.reuse,
                # A small transfer rides in its record, and ranks sharing one copy each take a record.
                **({"inline_max_bytes": 0} if replicas > 1 else {}))

        stores = tuple(transfers_of(s.tag, s.whole) for s in series) or (transfers_of("", True),)
        return cls(config, identity, keyspace, store, stores[0], Metrics(config.namespace), Counts(),
                   block_size, series, stores, replicas, rank % replicas)

    def engine_fields(self) -> dict[str, Any]:
        """The fields of this engine that decide whether its chunks fit another (an announcement's
        ``engine``; the rank is left out: every rank of a peer has its own)."""
        identity = self.identity
        return {"namespace": self.config.namespace, "model": identity.model, "kv_dtype": identity.kv_dtype,
                "layout": identity.layout, "block_size": identity.block_size, "tp_size": identity.tp_size,
                "format_version": identity.format_version, "weights": identity.weights,
                "chunk_tokens": self.transfers.chunk_tokens,
                # A hybrid model's series (a plain model's announcement has none, as before there were any).
                **({"series": describe(self.series)} if any(not s.whole for s in self.series) else {}),
                **({"kv_replicas": self.replicas} if self.replicas > 1 else {})}

    def close(self) -> None:
        """Release the Redis connections (chunks already stored stay until taken or expired)."""
        self.store.close()


def series_prefix(prefix: str, tag: str) -> str:
    """The key prefix of a series of layers (:mod:`kvredis.vllm.cache_groups`): the engine's own for full
    attention, so a plain model keeps its keys."""
    return f"{prefix}:{tag}" if tag else prefix
