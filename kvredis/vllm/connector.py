"""``KVRedisConnector``: vLLM's V1 KV-connector interface over the lookup buffer.

The producer (prefill) saves the prompts a decode will ask for (requests with ``do_remote_decode``, as
the proxy sends them; every prompt with ``KVREDIS_STORE_ALL_PROMPTS``): ``save_kv_layer`` copies the
request's pages (whole blocks, see :mod:`kvredis.paged`) out of each layer as the layer finishes, and
``wait_for_save`` copies any layer whose hook did not run (a CUDA graph replays no Python) from the
registered caches, then hands the prompt to a background thread that writes it to Redis, so the write
overlaps the next step. The blocks are free to reuse as soon as the step ends (the pages were copied; on
a GPU the copies are queued on a side stream into pinned memory, and every later kernel of the forward's
stream waits for them: :mod:`kvredis.staging`). ``request_finished`` then tells the proxy, through
``kv_transfer_params``, which entry is on its way and what engine wrote it (:mod:`kvredis.announcement`).

An entry's key covers the prompt's tokens, the engine's identity (:func:`kvredis.vllm.engine.cache_identity`)
and the request's context (LoRA adapter, multimodal inputs, ``cache_salt``; :mod:`kvredis.request_keys`),
so no request reads KV computed for another adapter, image or tenant. Requests with prompt embeddings are
neither saved nor loaded. Configurations whose pages the connector cannot express are refused at start-up.

The consumer (decode) reports ``len(prompt) - 1`` loadable tokens when the request says an entry is on
its way, or when Redis already holds an unannounced one; vLLM computes the last token itself. An announced
request takes exactly the entry its prefill wrote; one written by an engine configured differently is not
waited for (a warning names what differs), and an announced entry the decode will not load (its prefix
cache covers the prompt, the request ended first) is deleted at once. The load runs on a
background thread (asynchronous, reported through ``get_finished``): it takes the entry with the
blocking pop, bounded by ``KVREDIS_POP_TIMEOUT_S``, and writes the pages into the request's blocks. A load
that fails for any reason (missing, expired, evicted, corrupt, another model or layout, Redis down or
slow) reports the request's blocks through ``get_block_ids_with_load_errors``, so vLLM recomputes them
(``kv_load_failure_policy: "recompute"``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvredis import staging
from kvredis.announcement import Announcement, MalformedAnnouncement, read_announcement
from kvredis.buffer import RedisLookupBuffer
from kvredis.chunk_keys import ChunkPlan
from kvredis.chunk_store import PageFormat
from kvredis.config import KVRedisConfig
from kvredis.errors import KVRedisError
from kvredis.keys import KeySpace, new_entry_id, prompt_digest
from kvredis.paged import PagedLayout, block_span
from kvredis.request_keys import UNHASHED_MULTIMODAL, AdapterDigests, request_context
from kvredis.transfer import Transfers
from kvredis.vllm.engine import (
    cache_identity,
    check_vllm_version,
    multimodal_inputs_hashed,
    refuse_unsupported,
    worker_pp_rank,
    worker_tp_rank,
)
from kvredis.vllm.stats import Counts, KVRedisPromMetrics, KVRedisStats

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


_SHUTDOWN_WAIT_S = 30.0
_LOOKUP_PAUSE_S = 10.0
"""After a failed lookup, the scheduler computes prompts without asking Redis for this long."""

# -- metadata -------------------------------------------------------------------------------------


@dataclass
class TransferSpec:
    """One request's KV to move this step: the pages holding positions ``start..stop-1`` of ``token_ids``.

    ``context`` is the request's context digest (part of its key); ``entry_id`` names the announced entry
    to write or to take (``None``: the prompt's shared list).
    """

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    stop: int
    context: str = ""
    entry_id: str | None = None


@dataclass
class KVRedisConnectorMetadata(KVConnectorMetadata):
    """What the scheduler asks the workers to load and save in one step."""

    loads: list[TransferSpec] = field(default_factory=list)
    saves: list[TransferSpec] = field(default_factory=list)


@dataclass
class _Capture:
    """A prompt's pages copied out of the layers during its last prefill step: ``[layers, pages, ...]``."""

    pages: torch.Tensor
    layers: set[str] = field(default_factory=set)
    broken: bool = False


@dataclass
class _Prefill:
    token_ids: list[int]
    block_ids: list[int]
    computed: int
    context: str
    entry_id: str | None


@dataclass
class _Announcement:
    """What a producer's ``kv_transfer_params`` said of the entry it wrote for this request."""

    entry_id: str | None  # None: an announcement without an id (any entry of the prompt will do)
    differences: list[str]  # how the producer's engine differs from this one; empty: the entry fits
    shards: list[str]  # the key prefixes of the producer's ranks, for deleting the entry unread


@dataclass
class _RequestState:
    """The scheduler's view of one request, from its first lookup until it finishes."""

    context: str
    unsupported: str | None
    remote_decode: bool
    announcement: _Announcement | None
    transfer_params: bool = False  # the request carried kv_transfer_params (a proxy's, or a client's own)
    external_stop: int = 0  # the last lookup's answer: positions up to this one can be loaded
    plan: ChunkPlan | None = None  # the prompt's chunks, hashed at its first lookup


class _CacheWrites:
    """The gate loads pass to write into the registered KV caches, closed while vLLM has released them.

    vLLM 0.33+'s sleep mode releases the caches' memory between ``unregister_kv_caches`` and
    ``restore_kv_caches``. A load thread may be in its blocking pop then, or copying pages: ``close``
    refuses every write from then on and waits for those in progress (on a GPU, a write is in progress
    until its copies ran); a load refused fails (its blocks are reported, vLLM recomputes them). Saves copy
    their pages out during the engine step (on a GPU, queued then on a side stream, waited for at sleep), so
    no background thread reads the caches.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._open = True
        self._writers = 0

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Hold the gate open for one write; raises :class:`~kvredis.KVRedisError` while it is closed."""
        with self._changed:
            if not self._open:
                raise KVRedisError("the KV caches were released (vLLM sleep mode) before its pages arrived")
            self._writers += 1
        try:
            yield
        finally:
            with self._changed:
                self._writers -= 1
                self._changed.notify_all()

    def close(self, timeout_s: float) -> bool:
        """Refuse new writes; wait for those in progress. ``False`` if some still run after the bound."""
        with self._changed:
            self._open = False
            return self._changed.wait_for(lambda: self._writers == 0, timeout=timeout_s)

    def reopen(self) -> None:
        with self._changed:
            self._open = True


# -- the connector --------------------------------------------------------------------------------


class KVRedisConnector(KVConnectorBase_V1):
    """Disaggregated prefill through Redis: the producer saves prompts' KV, the consumer loads it."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        check_vllm_version(vllm.__version__)
        _log_through_vllm()  # by now vLLM has configured this process's logging
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None  # the base class refused a missing one
        self.config = KVRedisConfig.from_env(overrides=transfer.kv_connector_extra_config or {})
        refuse_unsupported(vllm_config, kv_cache_config)
        self._producer = bool(transfer.is_kv_producer)
        self._consumer = bool(transfer.is_kv_consumer)
        self._block_size = int(vllm_config.cache_config.block_size)
        # Layers with a paged cache (a speculative decoder's draft layers included): an entry holds them all.
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
        self._kv_layers = len(groups[0].layer_names) if groups else None
        worker = role == KVConnectorRole.WORKER
        self.identity = cache_identity(vllm_config, worker_tp_rank() if worker else 0,
                                       worker_pp_rank() if worker else 0)
        if not worker and self._consumer and getattr(transfer, "kv_load_failure_policy", None) == "fail":
            logger.warning(
                'kv_load_failure_policy is "fail" (vLLM\'s default): a request whose KV cannot be loaded '
                "from Redis (expired, evicted, Redis down or slow) fails instead of being computed here; "
                'add "kv_load_failure_policy": "recompute" to --kv-transfer-config')
        self._multimodal_hashed = multimodal_inputs_hashed(vllm_config)
        if not worker and not self._multimodal_hashed:
            logger.warning("requests with %s are neither saved to nor loaded from Redis", UNHASHED_MULTIMODAL)
        buffer_config = self.config
        if not worker:
            # The scheduler only looks entries up, inside vLLM's scheduling loop: the store bounds the reply
            # by KVREDIS_LOOKUP_TIMEOUT_S, and opening a connection to an unreachable Redis must not take
            # longer than that either.
            buffer_config = self.config.replace(
                connect_timeout_s=min(self.config.connect_timeout_s, self.config.lookup_timeout_s))
        self.buffer = RedisLookupBuffer(buffer_config, identity=self.identity)
        # Chunks are whole blocks: the configured length is rounded up to the next multiple of a block.
        chunk_tokens = -(-self.config.chunk_tokens // self._block_size) * self._block_size
        self.transfers = Transfers(
            self.buffer.store, self.buffer.keyspace.prefix, chunk_tokens=chunk_tokens,
            block_size=self._block_size, ttl_ms=int(self.config.ttl_s * 1000),
            pop_timeout_s=self.config.pop_timeout_s, max_chunk_bytes=self.config.max_entry_bytes,
            checksum=self.config.checksum)
        self.metrics = self.buffer.metrics
        self.counts = Counts()
        # Scheduler side.
        self._lookups_paused_until = 0.0
        self._requests: dict[str, _RequestState] = {}
        self._pending_loads: dict[str, TransferSpec] = {}
        self._loading: set[str] = set()
        self._loaded_once: set[str] = set()
        self._prefills: dict[str, _Prefill] = {}
        self._saved: dict[str, str | None] = {}  # request id -> the entry id its save was given
        self._stored_any = False  # a prefill was handed to the writers (the producer is not silent)
        self._adapters = AdapterDigests()
        self._warned: set[tuple[str, ...]] = set()
        parallel = vllm_config.parallel_config
        # Every rank's key prefix: the scheduler deletes an unused announced entry's shards itself.
        self._shards = [KeySpace(self.config.namespace, cache_identity(vllm_config, tp, pp)).prefix
                        for pp in range(int(parallel.pipeline_parallel_size))
                        for tp in range(int(parallel.tensor_parallel_size))]
        self._discard_pool: ThreadPoolExecutor | None = None
        self._discards: set[Future[None]] = set()
        # Worker side.
        self._layers: dict[str, torch.Tensor] = {}
        self._layouts: dict[str, PagedLayout] = {}
        self._layer_index: dict[str, int] = {}
        self._gathered: dict[str, _Capture] = {}
        self._staging: staging.DeviceStaging | None = None  # on a CUDA device; None: pages move directly
        self._slots: dict[str, torch.Tensor] = {}
        # Loads may wait in a blocking pop for an entry still being written; saves have their own threads
        # so that waiting loads never hold them up (kv_both), nor saves the loads.
        self._load_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvredis-load")
        self._save_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvredis-save")
        self._saves_in_flight: set[Future[None]] = set()
        self._lock = threading.Lock()
        self._received: set[str] = set()
        self._failed: dict[str, set[int]] = {}
        self._failed_reported: set[str] = set()
        self._error_blocks: set[int] = set()
        self._cache_writes = _CacheWrites()

    # -- scheduler side ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens loadable from Redis beyond the local hit: ``len(prompt) - 1`` if an entry is known."""
        state = self._state_of(request)
        if not self._consumer or request.request_id in self._loaded_once or state.unsupported:
            return 0, False
        tokens = _token_list(request.prompt_token_ids)
        if not tokens:
            return 0, False
        loadable = len(tokens) - 1
        if loadable <= num_computed_tokens:
            return 0, False
        announcement = state.announcement
        if announcement is not None and announcement.differences:
            return 0, False
        if announcement is None:
            if time.monotonic() < self._lookups_paused_until:
                return 0, False
            try:
                plan = self._plan_of(state, tokens)
                stored = self.transfers.chunks.stored_prefix(plan.digests, lookup=True)
            except KVRedisError as exc:
                self._lookups_paused_until = time.monotonic() + _LOOKUP_PAUSE_S
                self.metrics.miss("error")
                self.counts.add(lookup_errors=1)
                logger.warning("request %s: cannot look up its KV in Redis, computing it (and not looking "
                               "prompts up for %g s): %s", request.request_id, _LOOKUP_PAUSE_S, exc)
                return 0, False
            # Chunks found without an announcement: a prefix of the prompt, maybe all of it.
            loadable = min(loadable, stored * self.transfers.chunk_tokens)
            if loadable <= num_computed_tokens:
                return 0, False
        state.external_stop = loadable
        return loadable - num_computed_tokens, True

    def _plan_of(self, state: _RequestState, tokens: list[int]) -> ChunkPlan:
        """The prompt's chunks, hashed once per request (the scheduler may ask about it every step)."""
        if state.plan is None:
            state.plan = _stored_plan(self.transfers, tokens, state.context)
        return state.plan

    def _state_of(self, request: Any) -> _RequestState:
        """The request's state, made at its first lookup (on the producer too: it decides the save)."""
        state = self._requests.get(request.request_id)
        if state is None:
            context = request_context(request, self._adapters, multimodal_hashed=self._multimodal_hashed)
            params = request.kv_transfer_params if isinstance(request.kv_transfer_params, dict) else {}
            state = self._requests[request.request_id] = _RequestState(
                context.digest, context.unsupported, bool(params.get("do_remote_decode")),
                self._announcement(request, params, context.digest) if self._consumer else None,
                bool(params))
            if context.unsupported:
                self.counts.add(skipped_requests=1)
                self._warn_once(("unsupported", context.unsupported),
                                "requests with %s are neither saved to nor loaded from Redis (their KV "
                                "depends on more than their token IDs); such requests are computed here",
                                context.unsupported)
        return state

    def _announcement(self, request: Any, params: Any, context: str) -> _Announcement | None:
        """What the producer said of its entry, checked against this engine and this request (its tokens and
        ``context`` digest); ``None`` if nothing."""
        req_id = request.request_id
        try:
            announced = read_announcement(params)
        except MalformedAnnouncement as exc:
            logger.warning("request %s: ignoring %s", req_id, exc)
            return None
        if announced is None:
            return None
        if announced.context is not None and announced.context != context:
            # An entry announced for another adapter, tenant or set of images (a proxy or client mixing up
            # requests): its key differs from this request's, so no pop could find it. Compute at once.
            self.counts.add(skipped_requests=1)
            self._warn_once(("context",), "request %s: its announcement names an entry written for another "
                            "LoRA adapter, cache_salt or multimodal input; computing the prompt here", req_id)
            return _Announcement(announced.entry_id, ["context"], [])
        if (announced.digest is not None
                and announced.digest != prompt_digest(_token_list(request.prompt_token_ids), None, context)):
            # Written for other prompt tokens (a proxy or client mixing up requests, or the two engines
            # tokenizing the prompt differently): no pop could find it under this request's key.
            self.counts.add(skipped_requests=1)
            self._warn_once(("tokens",), "request %s: its announcement names an entry written for other "
                            "prompt tokens (do prefill and decode tokenize alike?); computing it here",
                            req_id)
            return _Announcement(announced.entry_id, ["tokens"], [])
        differences = announced.differences(self._engine_description())
        if differences:
            self.counts.add(skipped_requests=1)
            self._warn_once(("engine", *differences),
                            "request %s: its KV was written by a prefill engine configured differently (%s); "
                            "such requests are computed here, without waiting for Redis", req_id,
                            "; ".join(differences))
        return _Announcement(announced.entry_id, differences, list(announced.shards or self._shards))

    def _engine_description(self) -> dict[str, Any]:
        """This engine's side of an announcement (rank 0's identity, less the rank)."""
        identity = self.identity
        return {"namespace": self.config.namespace, "model": identity.model, "kv_dtype": identity.kv_dtype,
                "layout": identity.layout, "block_size": identity.block_size, "tp_size": identity.tp_size,
                "format_version": identity.format_version, "weights": identity.weights,
                "layers": self._kv_layers, "chunk_tokens": self.transfers.chunk_tokens}

    def _warn_once(self, cause: tuple[str, ...], message: str, *args: Any) -> None:
        if cause not in self._warned:
            self._warned.add(cause)
            logger.warning(message + " (said once)", *args)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of the external tokens into the blocks just allocated; an announced entry that
        will not be loaded is deleted now."""
        req_id = request.request_id
        state = self._requests.get(req_id)
        if num_external_tokens <= 0 or req_id in self._loaded_once:
            if state is not None and state.announcement is not None and req_id not in self._loaded_once:
                self._discard_announced(request, state)
            return
        tokens = _token_list(request.prompt_token_ids)
        stop = state.external_stop if state is not None and state.external_stop else len(tokens) - 1
        announcement = state.announcement if state is not None else None
        self._pending_loads[req_id] = TransferSpec(
            req_id, tokens, list(blocks.get_block_ids()[0]), stop - num_external_tokens, stop,
            context=state.context if state is not None else "",
            entry_id=announcement.entry_id if announcement is not None else None,
        )
        if state is not None:
            state.announcement = None  # taken by the load from now on

    def _discard_announced(self, request: Any, state: _RequestState) -> None:
        """Delete, on a background thread, the announced entry this request will not load (every shard)."""
        announcement, state.announcement = state.announcement, None
        if announcement is None or announcement.entry_id is None:
            return  # without an id, the entry is any reader's: it is left to them or to its TTL
        for shard in announcement.shards:
            self._submit_discard(request.request_id, announcement.entry_id, shard)

    def _discard_when_written(self, spec: TransferSpec) -> None:
        """Delete, on a background thread, this rank's shard of an announced entry a load gave up waiting
        for, if it lands within another pop bound (it would otherwise wait out its TTL)."""
        assert spec.entry_id is not None
        self._submit_discard(spec.req_id, spec.entry_id, self.buffer.keyspace.prefix)

    def _submit_discard(self, req_id: str, entry_id: str, shard: str) -> None:
        """Run :meth:`_discard` on the discard threads (started at the first), tracked until it ends."""
        if self._discard_pool is None:
            self._discard_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvredis-discard")
        future = self._discard_pool.submit(self._discard, req_id, entry_id, shard)
        with self._lock:
            self._discards.add(future)
        future.add_done_callback(self._forget_discard)

    def _discard(self, req_id: str, entry_id: str, shard: str) -> None:
        try:
            # The producer may still be writing it (it announces before its writer thread is done).
            deleted = self.transfers.discard(entry_id, wait_s=self.config.pop_timeout_s, prefix=shard)
        except Exception as exc:  # a background thread: say so, or it vanishes in its future
            logger.warning("request %s: could not delete its unused entry %s (%s); it expires with its TTL",
                           req_id, entry_id, exc)
            return
        if deleted:
            self.counts.add(discarded_entries=1)

    def _forget_discard(self, future: Future[None]) -> None:
        with self._lock:
            self._discards.discard(future)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's loads (planned at allocation) and saves (prompts whose prefill completes now)."""
        meta = KVRedisConnectorMetadata(loads=list(self._pending_loads.values()))
        self._loading.update(self._pending_loads)
        self._loaded_once.update(self._pending_loads)
        self._pending_loads.clear()
        if self._producer:
            meta.saves = self._completed_prefills(scheduler_output)
        return meta

    def _completed_prefills(self, scheduler_output: Any) -> list[TransferSpec]:
        for new in scheduler_output.scheduled_new_reqs:
            # A one-token prompt has nothing a decoder could load (it computes the last token itself); a
            # request already saved comes back here when vLLM 0.34 resumes it after preemption.
            state = self._requests.get(new.req_id)
            if (new.prompt_token_ids is None or len(new.prompt_token_ids) <= 1
                    or new.req_id in self._loaded_once or new.req_id in self._saved
                    or state is None or state.unsupported):
                continue
            if state.remote_decode or self.config.store_all_prompts:
                self._stored_any = True
                self._prefills[new.req_id] = _Prefill(
                    _token_list(new.prompt_token_ids), list(new.block_ids[0]), int(new.num_computed_tokens),
                    state.context, new_entry_id() if state.remote_decode else None)
            elif not self._stored_any and not state.transfer_params:
                # vLLM's offline flow (its LLM class, no proxy): no request asks for a remote decode, so
                # nothing would ever reach Redis and the consumer would compute every prompt, unwarned.
                self._warn_once(
                    ("nothing stored",),
                    "request %s: its prompt is not stored in Redis: it did not ask for a remote decode "
                    "(kv_transfer_params do_remote_decode, which kvredis's proxy sets) and store_all_prompts "
                    "is off, so this producer has stored nothing yet. Without a proxy (vLLM's LLM class, "
                    "requests sent to the producer directly) set KVREDIS_STORE_ALL_PROMPTS=1 or "
                    "\"store_all_prompts\": true in kv_connector_extra_config", new.req_id)
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            prefill = self._prefills.get(req_id)
            if prefill is None:
                continue
            new_blocks = cached.new_block_ids[index]
            if req_id in getattr(cached, "resumed_req_ids", ()):
                prefill.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                prefill.block_ids.extend(new_blocks[0])
            prefill.computed = int(cached.num_computed_tokens[index])
        saves = []
        for req_id, prefill in list(self._prefills.items()):
            scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if scheduled and prefill.computed + scheduled >= len(prefill.token_ids):
                saves.append(TransferSpec(req_id, prefill.token_ids, prefill.block_ids, 0,
                                          len(prefill.token_ids), prefill.context, prefill.entry_id))
                self._saved[req_id] = prefill.entry_id
                del self._prefills[req_id]
        return saves

    def update_connector_output(self, connector_output: Any) -> None:
        """Forget loads the workers report finished."""
        for req_id in getattr(connector_output, "finished_recving", None) or ():
            self._loading.discard(req_id)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks of a request whose load is still writing; announce a saved prompt; delete an
        announced entry the request ended without loading."""
        req_id = request.request_id
        if self._consumer and req_id not in self._requests:
            self._state_of(request)  # aborted before its first lookup: its announcement still counts
        state = self._requests.pop(req_id, None)
        if state is not None and state.announcement is not None:
            self._discard_announced(request, state)
        self._prefills.pop(req_id, None)
        self._loaded_once.discard(req_id)
        self._pending_loads.pop(req_id, None)
        params = None
        if req_id in self._saved:
            entry_id = self._saved.pop(req_id)
            if entry_id is not None:
                context = state.context if state is not None else ""
                tokens = _token_list(request.prompt_token_ids)
                params = Announcement(
                    entry_id, prompt_digest(tokens, None, context), context, self._engine_description(),
                    tuple(self._shards), len(tokens)).to_params()
        return req_id in self._loading, params

    # -- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Remember each layer's paged tensor and its layout (the order is the layer order), and how pages
        move on their device: directly on the CPU, through pinned buffers on side streams on a GPU."""
        self._layers = dict(kv_caches)
        self._layouts = {name: PagedLayout.of(tensor) for name, tensor in kv_caches.items()}
        self._layer_index = {name: index for index, name in enumerate(self._layers)}
        device = staging.device_for(kv_caches)
        self._staging = staging.DeviceStaging(device) if device is not None else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start this step's loads on background threads; they finish through ``get_finished``."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVRedisConnectorMetadata)
        # On a GPU, a load's writes are queued after what the forward's stream holds now: vLLM zeroes newly
        # allocated blocks on it before it starts loads (0.32-0.34, _zero_block_ids / the mixin's comment),
        # and kernels of earlier steps (and their saves) may still read the blocks.
        after = self._staging.mark_compute() if self._staging is not None and meta.loads else None
        for spec in meta.loads:
            try:
                self._load_pool.submit(self._load, spec, after)
            except RuntimeError as exc:  # shut down: the request must still hear that nothing comes
                self._load_failed(spec, f"the load could not start: {exc}")

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: loads are asynchronous and finish before the request is scheduled."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Copy the pages of prompts completing this step out of the layer, while the next layer computes."""
        # vLLM (0.32-0.34, maybe_transfer_kv_layer) calls this right after the layer's attention op queued
        # its KV writes, on the engine's thread with the forward's stream current; eagerly or between the
        # pieces of a piecewise CUDA graph, never inside a full graph's replay (wait_for_save covers those
        # layers), nor while graphs are captured (no metadata is bound then).
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVRedisConnectorMetadata) or not meta.saves:
            return
        index = self._layer_index.get(layer_name)
        if index is None:  # not a layer registered with a paged cache
            return
        layout = self._layouts[layer_name]
        staged: list[tuple[TransferSpec, torch.Tensor, _Capture]] = []
        for spec in meta.saves:
            pages = layout.kernel_blocks(self._prompt_blocks(spec), self._block_size)
            capture = self._gathered.get(spec.req_id)
            if capture is None:
                # One buffer for every layer: the pages are copied once, straight into what is stored.
                shape = (len(self._layer_index), len(pages), *layout.page_shape)
                capture = self._gathered[spec.req_id] = _Capture(self._host_empty(shape, kv_layer.dtype))
            if self._staging is not None:
                staged.append((spec, pages, capture))
                continue
            try:
                if kv_layer.device.type == "cpu":
                    torch.index_select(kv_layer, 0, pages, out=capture.pages[index])
                else:
                    capture.pages[index].copy_(layout.gather(kv_layer, pages))
            except RuntimeError as exc:  # a layer whose pages differ from the first one's
                capture.broken = True
                logger.warning("request %s: cannot copy the pages of %s: %s", spec.req_id, layer_name, exc)
            else:
                capture.layers.add(layer_name)
        if staged:
            self._stage_layer(layer_name, kv_layer, index, staged)

    def _host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host memory for a prompt's pages: pinned where a device copies into it asynchronously."""
        if self._staging is not None:
            return self._staging.host_empty(shape, dtype)
        return torch.empty(shape, dtype=dtype)

    def _stage_layer(self, layer_name: str, kv_layer: torch.Tensor, index: int,
                     staged: list[tuple[TransferSpec, torch.Tensor, _Capture]]) -> None:
        """Queue the copies of the layer's pages on the device's save stream (no host sync here; the step's
        one event is recorded in ``wait_for_save``)."""
        assert self._staging is not None
        try:
            self._staging.save_layer(kv_layer, [(pages, capture.pages[index])
                                                for _, pages, capture in staged])
        except (RuntimeError, ValueError) as exc:  # a layer whose pages differ from the first one's
            for spec, _, capture in staged:
                capture.broken = True
                logger.warning("request %s: cannot copy the pages of %s: %s", spec.req_id, layer_name, exc)
        else:
            for _, _, capture in staged:
                capture.layers.add(layer_name)

    def _prompt_blocks(self, spec: TransferSpec) -> list[int]:
        return [spec.block_ids[i] for i in block_span(self._block_size, spec.start, spec.stop)]

    def wait_for_save(self) -> None:
        """Hand each saved prompt to a writer thread; the step does not wait for Redis."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVRedisConnectorMetadata):
            return
        captured: list[tuple[TransferSpec, torch.Tensor]] = []
        for spec in meta.saves:
            capture = self._gathered.pop(spec.req_id, None)
            try:
                captured.append((spec, self._whole_capture(spec, capture)))
            except Exception as exc:  # a save that cannot be made must not fail the engine's step
                self.counts.add(save_failures=1)
                logger.warning("request %s: cannot copy its KV out of the caches, not saving it: %s",
                               spec.req_id, exc)
        # On a GPU: the step's one event, which the compute stream waits for; the writers wait for it.
        copied = self._staging.finish_saves() if self._staging is not None else None
        for spec, pages in captured:
            future = self._save_pool.submit(self._save, spec, pages, copied, time.monotonic())
            with self._lock:
                self._saves_in_flight.add(future)
            future.add_done_callback(self._forget_save)

    def _whole_capture(self, spec: TransferSpec, capture: _Capture | None) -> torch.Tensor:
        """Every layer's pages of the prompt: those ``save_kv_layer`` copied, and the rest copied now from
        the registered caches (a full CUDA graph or a compiled region runs no per-layer hook; the step's
        blocks cannot be reused before this call returns)."""
        if capture is not None and capture.broken:
            raise KVRedisError("a layer's pages differ in shape from the first layer's")
        names = list(self._layer_index)
        if not names:
            raise KVRedisError("no KV caches registered")
        if capture is not None and len(capture.layers) == len(names):
            return capture.pages
        first = self._layouts[names[0]]
        pages = first.kernel_blocks(self._prompt_blocks(spec), self._block_size)
        if capture is None:
            shape = (len(names), len(pages), *first.page_shape)
            capture = _Capture(self._host_empty(shape, self._layers[names[0]].dtype))
        for index, name in enumerate(names):
            if name in capture.layers:
                continue
            if self._staging is not None:
                # Queued on the save stream behind what the step's forward (a graph replay) queued.
                self._staging.save_layer(self._layers[name], [(pages, capture.pages[index])])
            else:
                capture.pages[index].copy_(self._layouts[name].gather(self._layers[name], pages))
        return capture.pages

    def _forget_save(self, future: Future[None]) -> None:
        with self._lock:
            self._saves_in_flight.discard(future)

    def _on_device(self) -> AbstractContextManager[None]:
        """Binds a background thread to the caches' device (a no-op on the CPU)."""
        return self._staging.bound() if self._staging is not None else nullcontext()

    def _save(self, spec: TransferSpec, pages: torch.Tensor, copied: staging.Transfer | None,
              handed_at: float) -> None:
        started = time.monotonic()
        try:
            with self._on_device():
                if copied is not None:
                    copied.wait()  # the step's copies into ``pages`` ran (this thread waits, not the engine)
                plan = _stored_plan(self.transfers, spec.token_ids, spec.context)
                per_block = pages.shape[1] // max(len(self._prompt_blocks(spec)), 1)
                stored = -(-plan.num_tokens // self._block_size) * per_block  # the last token's block may go
                saved = self.transfers.save(plan, pages[:, :stored], transfer_id=spec.entry_id,
                                            pages_per_block=per_block)
        except KVRedisError as exc:
            self.counts.add(save_failures=1)
            logger.warning("request %s: KV of %d tokens not saved to Redis: %s", spec.req_id,
                           len(spec.token_ids), exc)
        except Exception:  # on a writer thread nobody waits for: say so, or it vanishes in its future
            self.counts.add(save_failures=1)
            logger.exception("request %s: unexpected error saving KV of %d tokens to Redis", spec.req_id,
                             len(spec.token_ids))
        else:
            self.metrics.stored(saved.nbytes, time.monotonic() - started)
            self.counts.add(saved_requests=1, saved_tokens=len(spec.token_ids), written_chunks=saved.written,
                            present_chunks=saved.present, written_bytes=saved.nbytes)
            self._report_late_save(spec, handed_at, started)

    def _report_late_save(self, spec: TransferSpec, handed_at: float, started: float) -> None:
        """Warn when a prompt's entry reached Redis so late that its decode may have given up waiting (it then
        recomputes the prompt), saying whether the writer waited for a thread or for Redis."""
        done = time.monotonic()
        if spec.entry_id is None or done - handed_at < self.config.pop_timeout_s / 2:
            return
        # On the CPU, the usual cause: a decode on this engine's core, spinning while it waits (README).
        hint = ("" if self._staging is not None else "; CPU engines on one machine need cores of their own "
                "(VLLM_CPU_OMP_THREADS_BIND), or a waiting decode can hold the prefill back")
        logger.warning("request %s: its KV reached Redis %.1f s after its prefill step (%.1f s waiting for a "
                       "writer thread, %.1f s writing); a decode waits up to %g s (KVREDIS_POP_TIMEOUT_S)%s",
                       spec.req_id, done - handed_at, started - handed_at, done - started,
                       self.config.pop_timeout_s, hint)

    def _load(self, spec: TransferSpec, after: staging.Event | None = None) -> None:
        loaded = spec.start
        try:
            with self._on_device():
                cause, loaded = self._load_into_blocks(spec, after)
        except KVRedisError as exc:
            cause = str(exc)
        except Exception as exc:  # a load must never take the engine down: recompute instead.
            logger.exception("request %s: unexpected error loading KV", spec.req_id)
            cause = f"{type(exc).__name__}: {exc}"
        if cause is None:
            with self._lock:
                self._received.add(spec.req_id)
                self.counts.add(loaded_requests=1, loaded_tokens=spec.stop - spec.start)
            return
        self._load_failed(spec, cause, loaded)

    def _load_failed(self, spec: TransferSpec, cause: str, loaded: int | None = None) -> None:
        """Report the request's blocks from position ``loaded`` on (default: all it was to load) as not
        loaded: vLLM recomputes from the first of them (or fails the request). Never raises."""
        loaded = spec.start if loaded is None else max(spec.start, loaded)
        try:
            blocks = {spec.block_ids[i] for i in block_span(self._block_size, loaded, spec.stop)}
        except Exception:  # page arithmetic that cannot hold: every block of the request is suspect
            blocks = set(spec.block_ids)
        with self._lock:
            self._failed[spec.req_id] = blocks
            self.counts.add(load_failures=1, failed_tokens=spec.stop - loaded,
                            loaded_tokens=loaded - spec.start)
        logger.warning("request %s: KV of %d tokens not loaded from Redis (%s); vLLM recomputes them",
                       spec.req_id, spec.stop - loaded, cause)

    def _page_format(self) -> PageFormat:
        """The pages this engine's caches hold: what a chunk must carry to be written into them."""
        names = list(self._layers)
        layout = self._layouts[names[0]]
        return PageFormat(self._layers[names[0]].dtype, len(names), layout.page_shape,
                          self._block_size // layout.kernel_block_size)

    def _load_into_blocks(self, spec: TransferSpec,
                          after: staging.Event | None = None) -> tuple[str | None, int]:
        """Read the chunks covering the request's external positions and write their pages into its blocks;
        returns why not all of them (``None``: all), and the position up to which the blocks hold loaded KV
        (on a GPU, once the copies ran: the request is reported finished only then)."""
        if not self._layers:
            return "no KV caches registered", spec.start
        started = time.perf_counter()
        plan = _stored_plan(self.transfers, spec.token_ids, spec.context)
        taken = self.transfers.take(plan, spec.start, spec.stop, self._page_format(),
                                    transfer_id=spec.entry_id)
        loaded = min(spec.stop, taken.stop(plan)) if taken.chunks else spec.start
        if taken.chunks:
            self._write_chunks(spec, plan, taken.first, taken.chunks, loaded, after)
            self.metrics.loaded(taken.nbytes, time.perf_counter() - started)
            self.counts.add(loaded_bytes=taken.nbytes)
        if taken.cause == "hit":
            return None, spec.stop
        self.metrics.miss(taken.cause if taken.cause in ("absent", "corrupt", "foreign", "partial")
                          else "mismatch")
        if taken.cause == "absent" and spec.entry_id is not None and not taken.chunks:
            # Announced but not written in time (a stalled prefill): delete it when it lands.
            self._discard_when_written(spec)
            awaited = self.transfers.record_key(spec.entry_id)
            return (f"no transfer record within {self.config.pop_timeout_s:g} s at {awaited} (missing, "
                    "expired or evicted)"), spec.start
        return f"its chunks end at position {loaded} ({taken.cause})", loaded

    def _write_chunks(self, spec: TransferSpec, plan: ChunkPlan, first: int, chunks: list[torch.Tensor],
                      loaded: int, after: staging.Event | None) -> None:
        """Write the pages of the blocks holding positions ``spec.start..loaded-1`` into the request's
        blocks, from ``chunks`` (chunk ``first`` on). Blocks before ``spec.start`` are the local prefix
        cache's, shared with other requests: never written."""
        names = list(self._layers)
        layout = self._layouts[names[0]]
        blocks = list(block_span(self._block_size, spec.start, loaded))
        offset = first * (plan.chunk_tokens // self._block_size)  # the block the first chunk starts at
        stored = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)
        sources = layout.kernel_blocks([block - offset for block in blocks], self._block_size)
        targets = layout.kernel_blocks([spec.block_ids[block] for block in blocks], self._block_size)
        with self._cache_writes.writing():  # held until the copies ran: vLLM may release the caches after
            if self._staging is None:
                for index, name in enumerate(names):
                    self._layouts[name].scatter(self._layers[name], targets, stored[index, sources])
            else:
                # One contiguous pinned range a layer, copied to the device without a pageable intermediate.
                shape = (len(names), len(sources), *layout.page_shape)
                pinned = self._staging.host_empty(shape, stored.dtype)
                pinned.copy_(stored[:, sources])
                self._staging.load([(self._layers[name], pinned[index]) for index, name in enumerate(names)],
                                   targets, after)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Loads finished since the last call (failed ones once their blocks were reported)."""
        with self._lock:
            done = self._received | self._failed_reported
            self._received.clear()
            self._failed_reported.clear()
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed; their requests finish in the next ``get_finished``."""
        with self._lock:
            blocks: set[int] = set()
            for req_id, failed in self._failed.items():
                blocks |= failed
                self._failed_reported.add(req_id)
            self._failed.clear()
        return blocks

    # -- hooks of later vLLM releases: early loads (0.34), sleep mode (0.33) ---------------------------

    def may_load_async(self, request: Any) -> bool:
        """Whether this request's KV may load asynchronously: an announced entry that fits this engine.

        vLLM 0.34 asks when the request enters the waiting queues; with ``--max-num-inflight-kv-loads``,
        those answered true start their loads while the running batch is full. Cheap (no Redis round
        trip), so an unannounced prompt, which may be found in Redis, answers false and waits for a slot.
        """
        if not self._consumer or request.request_id in self._loaded_once:
            return False  # a request preempted after its load is not loaded again
        state = self._requests.get(request.request_id)
        if state is not None:  # seen before: its announcement may have been taken or found unusable
            announcement = state.announcement
            return announcement is not None and not announcement.differences and not state.unsupported
        try:
            announced = read_announcement(request.kv_transfer_params)
        except MalformedAnnouncement:
            return False
        return announced is not None and not announced.differences(self._engine_description())

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """Sleep mode is supported (vLLM 0.33+): no load writes into the KV caches while they are released."""
        return True

    def unregister_kv_caches(self) -> None:
        """Before vLLM releases the KV caches (sleep): stop loads from writing into them, and wait for the
        writes in progress. A load still waiting for its entry fails when the entry comes (its blocks are
        reported, so vLLM recomputes them). On a GPU, also wait for the save copies still reading the caches
        on the save stream. Idempotent."""
        if not self._cache_writes.close(_SHUTDOWN_WAIT_S):
            logger.error("a load is still writing into the KV caches %g s after vLLM asked to release them",
                         _SHUTDOWN_WAIT_S)
        if self._staging is not None:
            try:
                self._staging.wait_saves()
            except Exception as exc:  # a failed copy: its save already failed; sleep must go on
                logger.error("a save's copy out of the KV caches failed: %s", exc)

    def restore_kv_caches(self) -> None:
        """After vLLM backed the KV caches again (wake-up): loads may write into them again. The registered
        tensors keep their addresses through sleep (vLLM remaps the same memory), so they stay registered.
        Idempotent."""
        self._cache_writes.reopen()

    # -- stats ----------------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVRedisStats | None:
        """Counts since the last call (vLLM calls it every step, on the workers and the scheduler)."""
        return self.counts.take()

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
        with self._lock:
            pending = set(self._saves_in_flight)
        if pending:
            wait_futures(pending, timeout=_SHUTDOWN_WAIT_S)
        self._load_pool.shutdown(wait=False, cancel_futures=True)
        self._save_pool.shutdown(wait=False, cancel_futures=True)
        if self._discard_pool is not None:
            self._discard_pool.shutdown(wait=False, cancel_futures=True)
        self.buffer.close()


def _stored_plan(transfers: Transfers, tokens: list[int], context: str) -> ChunkPlan:
    """The chunks a prompt is stored as: every position but the last, whose KV no reader uses (vLLM computes
    a prompt's last token itself), so a prompt of k chunks and one token stores k whole chunks."""
    return transfers.plan(tokens[:-1], context)


def _token_list(tokens: Any) -> list[int]:
    """Prompt token IDs as a list of ints (vLLM 0.34 hands a ``TokenBuffer`` array)."""
    return [] if tokens is None else [int(t) for t in tokens]

