"""``KVRedisConnector``: vLLM's V1 KV-connector interface, kvredis's chunk store behind it.

vLLM builds one connector per process and role: the scheduler's
(:class:`~kvredis.vllm.scheduler.KVRedisScheduler`: what to load and save, what a prefill announces) and
each worker's (:class:`~kvredis.vllm.worker.KVRedisWorker`: pages in and out of the KV caches, the
background reads and writes). This class checks the engine's
configuration, opens the process's :class:`~kvredis.vllm.endpoint.Endpoint` and hands each hook to its side.

The producer (prefill) saves the prompts a decode will ask for (requests with ``do_remote_decode``, as the
proxy sends them; every prompt with ``KVREDIS_STORE_ALL_PROMPTS``) as chunks of whole blocks, writing only
those Redis lacks, and announces the transfer in the finished request's ``kv_transfer_params``
(:mod:`kvredis.store.announcement`). The consumer (decode) loads the tokens beyond its own prefix-cache hit:
those of the announced transfer, or of the chunks Redis already holds. A chunk's key covers the engine's
identity (:func:`kvredis.vllm.engine.cache_identity`), the request's context (LoRA adapter, multimodal inputs,
``cache_salt``: :mod:`kvredis.vllm.request_keys`) and every token to its end, so no request reads KV computed
for another adapter, image or tenant. Requests with prompt embeddings are neither saved nor loaded;
configurations whose pages the connector cannot express are refused at start-up. A load that fails for any
reason (missing, expired, evicted, corrupt, another model or layout, Redis down or slow) reports the blocks
it could not fill, so vLLM recomputes them (``kv_load_failure_policy: "recompute"``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvredis.config import KVRedisConfig
from kvredis.vllm.cache_groups import cache_series, unsupported_state
from kvredis.vllm.endpoint import Endpoint
from kvredis.vllm.engine import check_vllm_version, multimodal_inputs_hashed, refuse_unsupported
from kvredis.vllm.events import StoreReports
from kvredis.vllm.metadata import KVRedisConnectorMetadata
from kvredis.vllm.request_keys import UNHASHED_MULTIMODAL
from kvredis.vllm.scheduler import KVRedisScheduler
from kvredis.vllm.stats import KVRedisPromMetrics, KVRedisStats
from kvredis.vllm.worker import KVRedisWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("kvredis.vllm")


def _log_through_vllm() -> None:
    """Send kvredis's records in vLLM's processes out with vLLM's format and level (``VLLM_LOGGING_LEVEL``).

    Without a handler they would reach stderr bare (no time, no process), through logging's last resort.
    Left alone where the application configured logging itself (a root or ``kvredis`` handler).
    """
    ours, theirs = logging.getLogger("kvredis"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


class KVRedisConnector(KVConnectorBase_V1, SupportsHMA):
    """Disaggregated prefill through Redis: the producer saves prompts' KV, the consumer loads it.

    It supports vLLM's hybrid KV cache manager (``SupportsHMA``): a model with sliding-window or chunked
    local layers beside full attention keeps its KV cache groups, each with its own blocks, and the
    connector stores each kind of layer as a series of its own (:mod:`kvredis.vllm.cache_groups`).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        check_vllm_version(vllm.__version__)
        _log_through_vllm()  # by now vLLM has configured this process's logging
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None  # the base class refused a missing one
        config = KVRedisConfig.from_env(overrides=transfer.kv_connector_extra_config or {})
        refuse_unsupported(vllm_config)
        worker = role == KVConnectorRole.WORKER
        series = cache_series(kv_cache_config) if kv_cache_config is not None else ()
        # Without a way to move a Mamba layer's state, no prompt can be resumed from Redis: the engine serves
        # with the connector idle rather than not at all.
        idle = unsupported_state(kv_cache_config) if kv_cache_config is not None else None
        self.endpoint = Endpoint.open(vllm_config, config, worker=worker, series=series)
        self.scheduler: KVRedisScheduler | None = None
        self.worker: KVRedisWorker | None = None
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
        if worker:
            self.worker = KVRedisWorker(self.endpoint, groups=len(groups))
            return
        if idle is not None:
            logger.warning("kvredis moves no KV for this model: it has %s; every prompt is computed here",
                           idle)
        consumer = bool(transfer.is_kv_consumer)
        if consumer and getattr(transfer, "kv_load_failure_policy", None) == "fail":
            logger.warning(
                'kv_load_failure_policy is "fail" (vLLM\'s default): a request whose KV cannot be loaded '
                "from Redis (expired, evicted, Redis down or slow) fails instead of being computed here; "
                'add "kv_load_failure_policy": "recompute" to --kv-transfer-config')
        multimodal_hashed = multimodal_inputs_hashed(vllm_config)
        if not multimodal_hashed:
            logger.warning("requests with %s are neither saved to nor loaded from Redis", UNHASHED_MULTIMODAL)
        # Layers with a paged cache (a speculative decoder's draft layers included): the chunks hold them all.
        self.scheduler = KVRedisScheduler(
            vllm_config, self.endpoint, producer=bool(transfer.is_kv_producer) and idle is None,
            consumer=consumer and idle is None,
            kv_layers=sum(len(s.layers) for s in series) if series else None,
            multimodal_hashed=multimodal_hashed)

    @property
    def config(self) -> KVRedisConfig:
        """The settings this connector runs with (environment, then ``kv_connector_extra_config``)."""
        return self.endpoint.config

    def _scheduler_side(self) -> KVRedisScheduler:
        assert self.scheduler is not None, "a scheduler hook called on a worker's connector"
        return self.scheduler

    def _worker_side(self) -> KVRedisWorker:
        assert self.worker is not None, "a worker hook called on the scheduler's connector"
        return self.worker

    def _step_metadata(self) -> KVRedisConnectorMetadata | None:
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KVRedisConnectorMetadata) else None

    def _idle_step(self) -> bool:
        meta = self._step_metadata()
        return meta is not None and meta.idle

    # -- scheduler side ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens loadable from Redis beyond the local hit, and whether they load asynchronously."""
        return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of the external tokens into the blocks just allocated."""
        self._scheduler_side().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's loads and saves, for the workers."""
        return self._scheduler_side().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """Forget loads the workers report finished."""
        self._scheduler_side().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """Whether the request's blocks must wait for a load still writing, and what a prefill announces."""
        return self._scheduler_side().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """:meth:`request_finished` with the hybrid KV cache manager (block ids of every group)."""
        return self._scheduler_side().request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """The KV cache groups a load writes: every stored series' (vLLM must not zero their new blocks)."""
        return tuple(sorted(group for series in self.endpoint.series for group in series.groups))

    def take_events(self) -> Any:
        """KV events for vLLM's publisher (``--kv-events-config``): blocks stored in Redis, and removed by a
        reset (medium ``"REDIS"``)."""
        return self._scheduler_side().take_events()

    def may_load_async(self, request: Any) -> bool:
        """Whether the request's KV may load while the running batch is full (vLLM 0.34)."""
        return self._scheduler_side().may_load_async(request)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        """The tier the loaded tokens came from, for ``vllm:prompt_tokens_cached_by_source``: ``p2p`` for an
        announced transfer from a prefill, ``host`` for a prefix found in the shared cache (Redis's
        memory)."""
        if not num_external_tokens:
            return {}
        from vllm.v1.metrics.cache_hit_source import CacheHitSource  # in every release that asks

        return {CacheHitSource(self._scheduler_side().hit_source(request)): num_external_tokens}

    def reset_cache(self) -> bool:
        """Make everything the namespace stored so far unreachable for every engine of it (a new cache
        generation in Redis; :meth:`KVRedisScheduler.reset_cache`). ``False``, logged, when Redis cannot be
        reached."""
        return self._scheduler_side().reset_cache()

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        """No (vLLM 0.34 then keeps EAGLE's trailing-block drop): a chunk's key covers its tokens only, not
        the tokens an EAGLE drafter reads after its last block, which lookahead hashing requires every store
        shared by engines to key on (docs/design.md, "vLLM's contracts for a shared cache")."""
        return False

    # -- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Remember each layer's paged tensor (the order is the layer order)."""
        self._worker_side().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start this step's loads on background threads; they finish through ``get_finished``."""
        meta = self._step_metadata()
        assert meta is not None
        self._worker_side().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: loads are asynchronous and finish before the request is scheduled."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Copy the pages of prompts completing this step out of the layer, while the next layer computes."""
        meta = self._step_metadata()
        if meta is not None:
            self._worker_side().save_kv_layer(meta, layer_name, kv_layer)

    def wait_for_save(self) -> None:
        """Hand each saved prompt to a writer thread; the step does not wait for Redis."""
        meta = self._step_metadata()
        if meta is not None:
            self._worker_side().wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Loads finished since the last call (failed ones once their blocks were reported); in a step
        that computes nothing, after waiting briefly for a load in flight to end."""
        return self._worker_side().get_finished(finished_req_ids, idle=self._idle_step())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Loads finished since the last call; with several KV cache groups a failed load is reported by its
        request (vLLM recomputes it whole), since block ids name blocks of one group only."""
        worker = self._worker_side()
        _, finished = worker.get_finished(finished_req_ids, idle=self._idle_step())
        failed = worker.take_failed_requests()
        return KVConnectorTransferResults(finished_recving=set(finished or ()) | failed,
                                          failed_recving=failed)

    def get_kv_connector_kv_cache_events(self) -> StoreReports | None:
        """This worker's saves since the last step, stored or not, for the scheduler's KV events."""
        return self._worker_side().endpoint.outcomes.take()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed; their requests finish in the next ``get_finished``."""
        return self._worker_side().get_block_ids_with_load_errors()

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """Sleep mode is supported (vLLM 0.33+): no load writes into the KV caches while they are released."""
        return True

    def unregister_kv_caches(self) -> None:
        """Before vLLM releases the KV caches (sleep): no load writes into them from now on."""
        self._worker_side().unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """After vLLM backed the KV caches again (wake-up): loads may write into them again."""
        self._worker_side().restore_kv_caches()

    # -- stats and shutdown -----------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVRedisStats | None:
        """Counts since the last call (vLLM calls it every step, on the workers and the scheduler)."""
        return self.endpoint.counts.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVRedisStats:
        """Rebuild the stats vLLM shipped as a dict (in its stat loggers' process)."""
        return KVRedisStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVRedisPromMetrics:
        """The ``vllm:kvredis_*`` counters of ``/metrics``."""
        return KVRedisPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Let saves in flight finish (bounded), then close the Redis connections."""
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()
        self.endpoint.close()
