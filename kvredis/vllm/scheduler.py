"""The connector's scheduler side: which requests load from Redis and how much, which prompts are saved,
and what a prefill announces to its decode.

On a consumer (decode), a request is loadable when its prefill announced a transfer that fits this engine
(:mod:`kvredis.store.announcement`), or when Redis holds the first chunks of its prompt (one bounded lookup,
:meth:`kvredis.store.chunk_store.ChunkStore.stored_prefix`, on a thread of its own: a lookup Redis has not
answered within the step's short wait is answered "not yet", which vLLM's scheduler takes as "ask again next
step", so a slow Redis never holds the engine's step). It reports the tokens beyond its own prefix-cache hit
up to the stored ones (never the last: vLLM computes it), and plans their load into the blocks vLLM
allocated. An announced transfer it will not load (the prefix cache covers the prompt, the request ended
first) is released at once. On a producer (prefill), a prompt whose request asks for a remote decode is
saved when its last prefill step is scheduled, and announced in the finished request's
``kv_transfer_params``.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvredis.errors import KVRedisError
from kvredis.store.announcement import (
    GENERATION_FIELD,
    Announcement,
    MalformedAnnouncement,
    read_announcement,
)
from kvredis.store.chunk_keys import ChunkPlan
from kvredis.store.generation import Generation, with_generation
from kvredis.store.keys import KeySpace, new_entry_id, prompt_digest
from kvredis.store.tally import Tally
from kvredis.store.transfer import Transfers
from kvredis.vllm.cache_groups import STATE, resume_step
from kvredis.vllm.discards import Discards
from kvredis.vllm.endpoint import Endpoint, kv_events_enabled, series_prefix
from kvredis.vllm.engine import cache_identity
from kvredis.vllm.events import StoredBlocks, StoreReports
from kvredis.vllm.heads import sources
from kvredis.vllm.metadata import KVRedisConnectorMetadata, TransferSpec, resume_end, stored_plan, token_list
from kvredis.vllm.request_keys import AdapterDigests, request_context

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("kvredis.vllm")

_LOOKUP_PAUSE_S = 10.0
"""After a failed lookup, the scheduler computes prompts without asking Redis for this long."""
_STEP_LOOKUP_WAIT_S = 0.005
"""How long one scheduler step waits for Redis's answers to its lookups, all requests together. A lookup of a
1,000-token prompt takes about 0.2 ms on one host, handed to the thread and back (docs/benchmarks.md), a
network round trip more; one still out after this is answered "not yet" and asked about again at the next
step, while it runs on (up to the lookup timeout)."""
_NOT_YET = object()
_GENERATION_TRIES = 3
"""Lookups of a prompt in successive generations, at most, when resets keep coming while it is looked up."""
_GENERATION_REFRESH_S = 1.0
"""How often, at most, a scheduler re-reads its namespace's cache generation besides its lookups (which each
read it): an engine that looks nothing up (a producer, a decode taking only announced transfers) learns of
another engine's reset within this (and a step)."""


@dataclass
class _Prefill:
    token_ids: list[int]
    block_ids: list[list[int]]  # one list per KV cache group
    computed: int
    context: str
    entry_id: str | None
    known: int = 0  # its first chunks Redis held at its lookup (reuse): not copied out again
    generation: int = 0  # the cache generation it is stored in


@dataclass
class _Announcement:
    """What a producer's ``kv_transfer_params`` said of the transfer it wrote for this request."""

    entry_id: str | None  # None: an announcement without an id (the prompt's chunks are taken as found)
    differences: list[str]  # how the producer's engine differs from this one; empty: the chunks fit
    shards: list[str]  # the key prefixes of the producer's ranks, for releasing the transfer unread
    transfer_ids: list[str] = field(default_factory=list)  # the ids of the transfer's records in each shard
    parts: int = 0  # the KV head ranges the producer wrote (its tensor-parallel split); 0: this engine's


@dataclass
class _RequestState:
    """The scheduler's view of one request, from its first lookup until it finishes."""

    base_context: str  # its context digest (adapter, images, salt), before the cache generation
    generation: int  # the namespace's cache generation its keys are in (the last lookup's)
    unsupported: str | None
    remote_decode: bool
    announcement: _Announcement | None
    transfer_params: bool = False  # the request carried kv_transfer_params (a proxy's, or a client's own)
    external_stop: int = 0  # the last lookup's answer: positions up to this one can be loaded
    plans: tuple[ChunkPlan, ...] = ()  # the prompt's chunks in each series, hashed at its first lookup
    lookup: Future[tuple[int, int, int] | None] | None = None  # a lookup Redis has not answered yet
    counted: bool = False  # its lookup is in the counters (vLLM may ask again while the request waits)
    parts: int = 0  # the KV head ranges its stored chunks were found in (another TP size's); 0: this engine's
    stored: int = 0  # positions Redis held of it in this engine's own key space at its last lookup
    plans_generation: int = 0  # the generation ``plans`` were hashed in
    request: Any = None  # vLLM's request (its block hashes), kept for KV events only

    @property
    def context(self) -> str:
        """The digest its chunks are chained from: its context in its cache generation."""
        return with_generation(self.base_context, self.generation)


class KVRedisScheduler:
    """The scheduler-side half of :class:`~kvredis.vllm.KVRedisConnector` (one per engine)."""

    def __init__(self, vllm_config: VllmConfig, endpoint: Endpoint, *, producer: bool, consumer: bool,
                 kv_layers: int | None, multimodal_hashed: bool) -> None:
        self.endpoint = endpoint
        self.config = endpoint.config
        self.transfers = endpoint.transfers
        self.counts = endpoint.counts
        self._producer = producer
        self._consumer = consumer
        # A shared prefix cache (reuse): any engine, a prefill too, loads what Redis holds of a prompt.
        self._loads = consumer or self.config.reuse
        self._kv_layers = kv_layers
        # Where a reader may resume: anywhere, or at a Mamba state's block boundaries.
        self._step = resume_step(endpoint.series, self.transfers.chunk_tokens)
        self._multimodal_hashed = multimodal_hashed
        self._lookups_paused_until = 0.0
        self._lookups_failing = False  # warned about; said again only once Redis answers again
        # One thread asks Redis; the scheduler waits for it at most _STEP_LOOKUP_WAIT_S a step.
        self._lookup_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvredis-lookup")
        self._step_wait_left = _STEP_LOOKUP_WAIT_S
        self._tally = Tally(endpoint.store, self.config.namespace)  # kvredis stats' hit rate
        # The namespace's cache generation (a reset starts a new one): read with every lookup, and at least
        # every _GENERATION_REFRESH_S while steps run.
        self._generation = Generation(endpoint.store, self.config.namespace)
        self._generation_read_at = 0.0
        self._generation_refresh: Future[None] | None = None
        self._requests: dict[str, _RequestState] = {}
        self._pending_loads: dict[str, TransferSpec] = {}
        self._loading: set[str] = set()
        self._loaded_once: set[str] = set()
        self._prefills: dict[str, _Prefill] = {}
        # request id -> the transfer id its save was given, the context digest and generation it is in
        self._saved: dict[str, tuple[str | None, str, int]] = {}
        self._stored_any = False  # a prefill was handed to the writers (the producer is not silent)
        self._adapters = AdapterDigests()
        self._warned: set[tuple[str, ...]] = set()
        parallel = vllm_config.parallel_config
        # Every shard's key prefix (one a range of KV heads), in each series: the scheduler releases an
        # unused announced transfer's shards itself.
        tags = [series.tag for series in endpoint.series] or [""]
        split = endpoint.split
        self._shards = [
            series_prefix(KeySpace(self.config.namespace, cache_identity(vllm_config, part, pp)).prefix, tag)
            for pp in range(int(parallel.pipeline_parallel_size))
            for part in range(split.parts) for tag in tags]
        # Other tensor-parallel sizes whose chunks this engine reads (their head ranges nest with its own),
        # tried when its own finds less than the whole prompt; a Mamba state's split must be this engine's.
        self._other_splits = [] if any(s.kind == STATE for s in endpoint.series) else [
            parts for parts in range(1, split.total + 1) if parts != split.parts and split.nests(parts)]
        self.discards = Discards(self.transfers, self.counts, self.config.pop_timeout_s)
        # KV events (--kv-events-config): what every writer rank (one a KV head range of each pipeline stage)
        # stored, for vLLM's publisher.
        self._stored_blocks = (StoredBlocks(writers=int(parallel.pipeline_parallel_size) * split.parts)
                               if kv_events_enabled(vllm_config) else None)
        if self._loads:
            # The lookups' connection is opened now, not by the first request's lookup, which would then
            # outlast its step's wait on a connect (that request would wait a step for nothing).
            self._lookup_thread.submit(self._connect)
        self._refresh_generation()

    # -- lookups and loads ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens loadable from Redis beyond the local hit: up to ``len(prompt) - 1`` if announced, else up
        to the end of the stored chunks."""
        state = self._state_of(request)
        if not self._loads or request.request_id in self._loaded_once or state.unsupported:
            return 0, False
        tokens = token_list(request.prompt_token_ids)
        if not tokens:
            return 0, False
        loadable = resume_end(len(tokens), self._step)
        if loadable <= num_computed_tokens:
            return 0, False
        announcement = state.announcement
        if announcement is not None and announcement.differences:
            return 0, False
        if announcement is not None and state.generation != self._generation.known:
            return 0, False  # announced before a reset this engine knows of: its KV may be the old weights'

        if announcement is None:
            if state.lookup is None:
                if time.monotonic() < self._lookups_paused_until:
                    return 0, False
                state.lookup = self._lookup_thread.submit(self._look_up, request.request_id, state, tokens,
                                                          time.monotonic())
            answer = self._answer(state)
            if answer is _NOT_YET:
                return None, False  # vLLM skips the request this step and asks again at the next
            if answer is None:
                return 0, False  # the lookup failed or was skipped: nothing is stored, as far as we know
            assert isinstance(answer, tuple)
            stored, state.parts, generation = answer
            if generation < self._generation.known:
                return None, False  # answered before a reset this scheduler made: asked again next step
            state.generation = generation  # the keys the load reads are those the lookup found
            state.stored = stored if state.parts == self.endpoint.split.parts else 0
            # Found without an announcement: a prefix of the prompt, maybe all of it.
            found = min(loadable, stored)
            if not state.counted:
                state.counted = True
                amounts = {"lookup_tokens": loadable - num_computed_tokens,
                           "found_tokens": max(found - num_computed_tokens, 0)}
                self.counts.add(**{name: value for name, value in amounts.items() if value})
                self._tally.add(**amounts)
                if self._tally.due():
                    self._lookup_thread.submit(self._tally.flush)
            loadable = found
            if loadable <= num_computed_tokens:
                return 0, False
        state.external_stop = loadable
        return loadable - num_computed_tokens, True

    def _look_up(self, req_id: str, state: _RequestState, tokens: list[int],
                 asked_at: float) -> tuple[int, int, int] | None:
        """How many of the prompt's positions a reader can take from Redis, the split of KV heads they
        were found in, and the cache generation they are in (the lookup thread's task); ``None`` if lookups
        are paused or this one failed (counted, warned about, and lookups paused).

        The prompt is looked up in the generation this scheduler knows; a hit is then checked against the
        generation Redis holds (a round trip after the lookup's, for hits only: a miss loads nothing), and
        looked up again in a newer one. So a lookup whose chunks Redis found after a reset of any engine of
        the namespace is never answered with what was stored before it."""
        if time.monotonic() < self._lookups_paused_until:
            return None  # queued behind the lookup that failed
        try:
            generation = self._generation.known
            for _ in range(_GENERATION_TRIES):
                found = self._found(self._plans_of(state, tokens, generation))
                if not found[0]:
                    break
                checked = self._read_generation()
                if checked == generation:
                    break
                generation = checked
            else:
                found = (0, found[1])  # resets in a row: nothing found is known to be of the current one
            stored = (*found, generation)
            self.counts.observe(lookup_seconds=time.monotonic() - asked_at)
        except Exception as exc:  # any failure means "nothing stored", never a dead engine
            self._lookups_paused_until = time.monotonic() + _LOOKUP_PAUSE_S
            self.endpoint.metrics.miss("error")
            self.counts.add(lookup_errors=1)
            # Once per outage: a Redis down for an hour is one warning, not one every pause.
            log = logger.debug if self._lookups_failing else logger.warning
            self._lookups_failing = True
            log("request %s: cannot look up its KV in Redis, computing it (and not looking prompts up for "
                "%g s at a time until Redis answers): %s", req_id, _LOOKUP_PAUSE_S, exc,
                exc_info=not isinstance(exc, KVRedisError))
            return None
        if self._lookups_failing:
            self._lookups_failing = False
            logger.warning("Redis answers lookups again: prompts are looked up in it again")
        return stored

    def _connect(self) -> None:
        """Open the lookups' connection (the lookup thread's first task); a Redis not there yet is the first
        lookup's to find and say."""
        try:
            self.endpoint.store.prober.ping()
        except Exception as exc:  # the lookups report an outage; this is only a head start
            logger.debug("could not connect for lookups yet: %s", exc)

    def _answer(self, state: _RequestState) -> object:
        """The request's lookup's answer, waited for while the step's wait lasts; ``_NOT_YET`` if Redis has
        not answered by then (the lookup goes on)."""
        lookup = state.lookup
        assert lookup is not None
        if not lookup.done() and self._step_wait_left > 0:
            started = time.monotonic()
            wait_for((lookup,), timeout=self._step_wait_left)
            self._step_wait_left -= time.monotonic() - started
        if not lookup.done():
            return _NOT_YET
        state.lookup = None  # asked again later (the request may wait for room), Redis is asked again
        return lookup.result()

    def _plans_of(self, state: _RequestState, tokens: list[int], generation: int) -> tuple[ChunkPlan, ...]:
        """The prompt's chunks in each series in cache generation ``generation``, hashed once per request and
        generation (the scheduler may ask about it every step)."""
        if not state.plans or state.plans_generation != generation:
            context = with_generation(state.base_context, generation)
            state.plans = tuple(stored_plan(store, tokens, context) for store in self.endpoint.stores)
            state.plans_generation = generation
        return state.plans

    # -- the cache generation (resets) ------------------------------------------------------------

    def _read_generation(self) -> int:
        """The namespace's generation, read now (on the lookup thread)."""
        known = self._generation.known
        generation = self._generation.read()
        self._generation_read_at = time.monotonic()
        if generation > known and self._stored_blocks is not None:
            self._stored_blocks.dropped()  # another engine reset the namespace
        return generation

    def _refresh_generation(self) -> None:
        """Have the lookup thread re-read the generation if the last read is :data:`_GENERATION_REFRESH_S`
        old (called once a step; never waits)."""
        pending = self._generation_refresh
        if (pending is not None and not pending.done()) or (
                time.monotonic() - self._generation_read_at < _GENERATION_REFRESH_S):
            return
        self._generation_read_at = time.monotonic()  # not asked again while this one runs
        self._generation_refresh = self._lookup_thread.submit(self._read_quietly)

    def _read_quietly(self) -> None:
        try:
            self._read_generation()
        except Exception as exc:  # the next lookup reports an outage; this only keeps the generation fresh
            logger.debug("could not read the cache generation: %s", exc)

    def reset_cache(self) -> bool:
        """Start a new cache generation of the namespace (vLLM's ``reset_cache``: ``POST
        /reset_prefix_cache?reset_external=true``, sleep level 1 and up, a pause that clears caches).

        From then on no engine of the namespace finds what was stored before: this one at once, the others
        at their next lookup that finds chunks (each such reads the generation), or within
        :data:`_GENERATION_REFRESH_S` of their next step. Prompts
        this engine was prefilling are not stored (their KV may predate the reset); lookups answered before
        it are asked again. ``False`` (logged) when Redis cannot be reached: nothing was reset then, as far
        as this engine knows."""
        try:
            generation = self._generation.bump()
        except Exception as exc:  # Redis down, slow, or an ACL without incr: the reset did not happen
            logger.warning("cannot reset the shared KV cache of namespace %r (a new cache generation in "
                           "Redis): %s; KV stored before may still be loaded", self.config.namespace, exc,
                           exc_info=not isinstance(exc, KVRedisError))
            return False
        logger.info("reset the shared KV cache of namespace %r: cache generation %d; nothing stored before "
                    "is loaded by any engine of the namespace from now on", self.config.namespace, generation)
        if self._stored_blocks is not None:
            self._stored_blocks.dropped()
        return True

    def take_events(self) -> list[Any]:
        """KV events since the last call: blocks stored in Redis, blocks a reset dropped."""
        return self._stored_blocks.take() if self._stored_blocks is not None else []

    def _found(self, plans: tuple[ChunkPlan, ...]) -> tuple[int, int]:
        """The longest prefix of the prompt stored in this engine's split of KV heads, or, where that is not
        all of it, in another tensor-parallel size's: its length, and the number of head ranges it is in."""
        own = self.endpoint.split.parts
        best = self._stored_positions(plans, self._sources_of(own)), own
        if best[0] >= plans[0].num_tokens // self._step * self._step:
            return best
        for parts in self._may_hold_more(plans[0], best[0]):
            found = self._stored_positions(plans, self._sources_of(parts))
            if found > best[0]:
                best = found, parts
        return best

    def _may_hold_more(self, plan: ChunkPlan, stored: int) -> list[int]:
        """The other splits worth a lookup: to resume past ``stored``, a split must hold the full-attention
        chunk covering that position (one round trip asks each split for it, so an engine whose peers all
        share its TP size pays one round trip more on a partial hit, not one a split)."""
        series = self.endpoint.series
        if not self._other_splits or (series and not series[0].whole):
            return self._other_splits
        index = stored // self.transfers.chunk_tokens
        if index >= plan.num_chunks:
            return []
        split = self.endpoint.split
        keys = [self.endpoint.stores_of(parts, sources(split, 0, parts)[0].part)[0].chunks.keys.chunk(
                plan.digests[index]) for parts in self._other_splits]
        there = self.transfers.chunks.exists(keys)
        return [parts for parts, found in zip(self._other_splits, there, strict=True) if found]

    def _sources_of(self, parts: int) -> list[tuple[Transfers, ...]]:
        """For each series, the stores a reader with rank 0's heads reads from chunks written in ``parts``
        head ranges (several where the writer's are narrower)."""
        split = self.endpoint.split
        per_source = [self.endpoint.stores_of(parts, source.part) for source in sources(split, 0, parts)]
        return [tuple(stores[number] for stores in per_source) for number in range(len(per_source[0]))]

    def _stored_positions(self, plans: tuple[ChunkPlan, ...], stores: list[tuple[Transfers, ...]]) -> int:
        """The longest prefix of the prompt a reader can resume after from what Redis holds in ``stores``
        (each series' sources): the full attention chunks from the first without a gap, in every source,
        and, for a hybrid model, every block each window attends to from there (tried at the chunks' end and
        the two chunk boundaries before it)."""
        series = self.endpoint.series
        top = plans[0].num_tokens
        if not series or series[0].whole:
            chunks = min(store.chunks.stored_prefix(plans[0].digests, lookup=True) for store in stores[0])
            top = min(top, chunks * stores[0][0].chunk_tokens)
            if len(plans) == 1:
                return top
        top = top // self._step * self._step
        step = self.transfers.chunk_tokens
        candidates = [top, *range((top - 1) // step * step, 0, -step)][:3]
        windows = [(s, sources, plan) for s, sources, plan in zip(series, stores, plans, strict=True)
                   if not s.whole]
        wanted: list[list[set[int]]] = []  # for each window series, for each candidate: its blocks
        for window, in_sources, _ in windows:
            size = in_sources[0].chunk_tokens
            wanted.append([set(range(window.needed(at) // size, -(-at // size))) for at in candidates])
        present: list[set[int]] = []
        for (_, in_sources, plan), per_candidate in zip(windows, wanted, strict=True):
            indexes = sorted(set().union(*per_candidate))
            found_in_all = set(indexes)
            for store in in_sources:
                there = store.chunks.present([plan.digests[i] for i in indexes], lookup=True)
                found_in_all &= {index for index, found in zip(indexes, there, strict=True) if found}
            present.append(found_in_all)
        for position, at in enumerate(candidates):
            if all(blocks[position] <= found for blocks, found in zip(wanted, present, strict=True)):
                return at
        return 0

    def _state_of(self, request: Any) -> _RequestState:
        """The request's state, made at its first lookup (on the producer too: it decides the save)."""
        state = self._requests.get(request.request_id)
        if state is None:
            context = request_context(request, self._adapters, multimodal_hashed=self._multimodal_hashed)
            params = request.kv_transfer_params if isinstance(request.kv_transfer_params, dict) else {}
            generation = self._generation.known
            state = self._requests[request.request_id] = _RequestState(
                context.digest, generation, context.unsupported, bool(params.get("do_remote_decode")),
                self._announcement(request, params, context.digest)
                if self._consumer else None,
                bool(params))
            if self._stored_blocks is not None:
                state.request = request
            if context.unsupported:
                self.counts.add(skipped_requests=1)
                self._warn_once(("unsupported", context.unsupported),
                                "requests with %s are neither saved to nor loaded from Redis (their KV "
                                "depends on more than their token IDs); such requests are computed here",
                                context.unsupported)
        return state

    def _announcement(self, request: Any, params: Any, base_context: str) -> _Announcement | None:
        """What the producer said of its transfer, checked against this engine and this request (its tokens
        and ``base_context`` digest); ``None`` if nothing."""
        req_id = request.request_id
        try:
            announced = read_announcement(params)
        except MalformedAnnouncement as exc:
            logger.warning("request %s: ignoring %s", req_id, exc)
            return None
        if announced is None:
            return None
        # The request's context in the generation the producer stored it in: a transfer of another generation
        # is this request's, but from before or after a reset (an engine difference, below), not another's.
        generation = (announced.engine or {}).get(GENERATION_FIELD, 0)
        context = with_generation(base_context, generation if type(generation) is int and generation >= 0
                                  else self._generation.known)
        if getattr(request, "abort_immediately", False):
            # vLLM's clean-up of a request it refused (0.32+): its serving layer's stand-in for a rejected
            # request (the real id and kv_transfer_params, one token [0], no adapter or salt), or 0.34's
            # engine paused. It never runs; only the transfer its id names is released.
            return _Announcement(announced.entry_id, ["refused"], list(announced.shards or self._shards),
                                 announced.transfer_ids())
        if announced.context is not None and announced.context != context:
            # A transfer announced for another adapter, tenant or set of images (a proxy or client mixing up
            # requests): its chunks' keys differ from this request's. Compute at once.
            self.counts.add(skipped_requests=1)
            self._warn_once(("context",), "request %s: its announcement names a transfer written for "
                            "another LoRA adapter, cache_salt or multimodal input, or in another cache "
                            "generation (the namespace was reset and one of the engines does not know yet); "
                            "computing the prompt here", req_id)
            return _Announcement(announced.entry_id, ["context"], [])
        if (announced.digest is not None
                and announced.digest != prompt_digest(token_list(request.prompt_token_ids), None, context)):
            # Written for other prompt tokens (a proxy or client mixing up requests, or the two engines
            # tokenizing the prompt differently): its chunks are not this prompt's.
            self.counts.add(skipped_requests=1)
            self._warn_once(("tokens",), "request %s: its announcement names a transfer written for other "
                            "prompt tokens (do prefill and decode tokenize alike?); computing it here",
                            req_id)
            return _Announcement(announced.entry_id, ["tokens"], [])
        differences = announced.differences(self.engine_description())
        parts = self._announced_parts(announced, differences)
        if differences:
            self.counts.add(skipped_requests=1)
            self._warn_once(("engine", *differences),
                            "request %s: its KV was written by a prefill engine configured differently (%s); "
                            "such requests are computed here, without waiting for Redis", req_id,
                            "; ".join(differences))
        return _Announcement(announced.entry_id, differences, list(announced.shards or self._shards),
                             announced.transfer_ids(), parts)

    def _announced_parts(self, announced: Announcement, differences: list[str]) -> int:
        """The number of KV head ranges the producer wrote (its tensor-parallel split); a split this engine
        cannot read is added to ``differences``."""
        own = self.endpoint.split.parts
        parts = own if announced.engine is None else announced.engine.get("kv_parts", own)
        if type(parts) is not int or not self.endpoint.split.nests(parts):
            differences.append(f"KV heads in {parts!r} tensor-parallel parts on prefill, {own} here (kvredis "
                               "moves KV between tensor-parallel sizes where one divides the other)")
        elif parts != own and any(series.kind == STATE for series in self.endpoint.series):
            differences.append(f"KV heads in {parts} tensor-parallel parts on prefill, {own} here (a Mamba "
                               "or linear-attention state moves only between equal tensor-parallel sizes)")
        return parts if type(parts) is int else own

    def engine_description(self, generation: int | None = None) -> dict[str, Any]:
        """This engine's side of an announcement (rank 0's identity, less the rank), in cache generation
        ``generation`` (``None``: the one it knows now; generation 0 is left unsaid, as before resets)."""
        if generation is None:
            generation = self._generation.known
        return {**self.endpoint.engine_fields(), "layers": self._kv_layers,
                **({GENERATION_FIELD: generation} if generation else {})}

    def _warn_once(self, cause: tuple[str, ...], message: str, *args: Any) -> None:
        if cause not in self._warned:
            self._warned.add(cause)
            logger.warning(message + " (said once)", *args)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of the external tokens into the blocks just allocated; an announced transfer that
        will not be loaded is released now."""
        req_id = request.request_id
        state = self._requests.get(req_id)
        if state is not None and state.lookup is not None:
            state.lookup.cancel()  # scheduled without its answer: a later ask (after a preemption) asks anew
            state.lookup = None
        if num_external_tokens <= 0 or req_id in self._loaded_once:
            if state is not None and state.announcement is not None and req_id not in self._loaded_once:
                self._discard_announced(request, state)
            return
        tokens = token_list(request.prompt_token_ids)
        stop = (state.external_stop if state is not None and state.external_stop
                else resume_end(len(tokens), self._step))
        announcement = state.announcement if state is not None else None
        parts = announcement.parts if announcement is not None else state.parts if state is not None else 0
        self._pending_loads[req_id] = TransferSpec(
            req_id, tokens, [list(ids) for ids in blocks.get_block_ids()], stop - num_external_tokens, stop,
            context=state.context if state is not None else "",
            entry_id=announcement.entry_id if announcement is not None else None,
            parts=parts,
        )
        if state is not None:
            state.announcement = None  # taken by the load from now on

    def _discard_announced(self, request: Any, state: _RequestState) -> None:
        """Release, on a background thread, the announced transfer this request will not load (every
        shard)."""
        announcement, state.announcement = state.announcement, None
        if announcement is None or announcement.entry_id is None:
            return  # without an id, the chunks are any reader's: they are left to them or to their TTL
        for shard in announcement.shards:
            for transfer_id in announcement.transfer_ids or [announcement.entry_id]:
                self.discards.submit(request.request_id, transfer_id, shard)

    # -- saves and the step's metadata ------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> KVRedisConnectorMetadata:
        """This step's loads (planned at allocation) and saves (prompts whose prefill completes now)."""
        self._step_wait_left = _STEP_LOOKUP_WAIT_S  # this is the step's end: the next one waits afresh
        self._refresh_generation()
        meta = KVRedisConnectorMetadata(loads=list(self._pending_loads.values()),
                                        idle=not scheduler_output.total_num_scheduled_tokens)
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
            # A prompt this engine loaded is in Redis already, but in reuse mode only its stored prefix:
            # the rest is saved (what Redis holds is not written again).
            loaded = new.req_id in self._loaded_once and not self.config.reuse
            if (new.prompt_token_ids is None or len(new.prompt_token_ids) <= 1 or loaded
                    or new.req_id in self._saved or state is None or state.unsupported):
                continue
            if state.generation != self._generation.known:
                continue  # a reset since its lookup: KV computed from here on is stored under the new one
            # A shared prefix cache (reuse) keeps every prompt an engine prefills, for any later request.
            if state.remote_decode or self.config.store_all_prompts or self.config.reuse:
                self._stored_any = True
                # A shared prefix cache's save copies out only the chunks its lookup did not find in Redis.
                known = state.stored // self.transfers.chunk_tokens if self.config.reuse else 0
                self._prefills[new.req_id] = _Prefill(
                    token_list(new.prompt_token_ids), [list(ids) for ids in new.block_ids],
                    int(new.num_computed_tokens),
                    state.context, new_entry_id() if state.remote_decode else None,
                    generation=state.generation, known=known)
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
                prefill.block_ids = [list(ids) for ids in new_blocks] if new_blocks else []
            elif new_blocks:
                for group, ids in zip(prefill.block_ids, new_blocks, strict=True):
                    group.extend(ids)
            prefill.computed = int(cached.num_computed_tokens[index])
        saves = []
        # The block tables as they are now (vLLM 0.32+): a window's freed blocks and a state's moves show
        # there, not in the blocks appended step by step.
        tables = getattr(scheduler_output, "kv_connector_block_state", None)
        for req_id, prefill in list(self._prefills.items()):
            scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if not scheduled or prefill.computed + scheduled < len(prefill.token_ids):
                continue
            del self._prefills[req_id]
            if prefill.generation != self._generation.known:
                continue  # its prefill overlapped a reset: part of its KV may be the old weights'
            end = resume_end(len(prefill.token_ids), self._step)
            if end == 0:
                continue  # shorter than a Mamba state's block and a token: no reader could resume from it
            if self._step > 1 and prefill.computed != end:
                # A Mamba state is kept at the prompt's last block boundary only if this step starts there;
                # without it no reader could resume, so nothing is stored (nor announced).
                self._warn_once(("state",), "request %s: its prefill's last step started at position %d, not "
                                "at the prompt's last block boundary (%d): its Mamba state there is gone, so "
                                "it is not stored (a prefill budget, --max-num-batched-tokens, of at least a "
                                "block avoids this)", req_id, prefill.computed, end)
                continue
            current = tables.get_block_ids(req_id) if tables is not None else None
            block_ids = [list(ids) for ids in current] if current else prefill.block_ids
            saves.append(TransferSpec(req_id, prefill.token_ids, block_ids, 0, len(prefill.token_ids),
                                      prefill.context, prefill.entry_id, computed=prefill.computed,
                                      known=prefill.known))
            state = self._requests.get(req_id)
            if (self._stored_blocks is not None and state is not None and state.request is not None
                    and (prefill.entry_id is None or self.config.reuse)):
                # Chunks any reader may find (a transfer's are deleted once its decode took them).
                self._stored_blocks.expect(state.request, end, self.endpoint.block_size)
            self._saved[req_id] = prefill.entry_id, prefill.context, prefill.generation
        return saves

    def update_connector_output(self, connector_output: Any) -> None:
        """Forget loads the workers report finished; take their saves' outcomes (KV events)."""
        for req_id in getattr(connector_output, "finished_recving", None) or ():
            self._loading.discard(req_id)
        reports = getattr(connector_output, "kv_cache_events", None)
        if self._stored_blocks is not None and isinstance(reports, StoreReports):
            self._stored_blocks.report(reports)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks of a request whose load is still writing; announce a saved prompt; release an
        announced transfer the request ended without loading."""
        req_id = request.request_id
        if self._consumer and req_id not in self._requests:
            self._state_of(request)  # aborted before its first lookup: its announcement still counts
        state = self._requests.pop(req_id, None)
        if state is not None and state.lookup is not None:
            state.lookup.cancel()  # its answer is not needed (if it runs already, it is dropped)
        if state is not None and state.announcement is not None:
            self._discard_announced(request, state)
        self._prefills.pop(req_id, None)
        self._loaded_once.discard(req_id)
        self._pending_loads.pop(req_id, None)
        params = None
        if req_id in self._saved:
            entry_id, context, generation = self._saved.pop(req_id)
            if entry_id is not None:
                tokens = token_list(request.prompt_token_ids)
                params = Announcement(
                    entry_id, prompt_digest(tokens, None, context), context,
                    self.engine_description(generation), tuple(self._shards), len(tokens)).to_params()
        return req_id in self._loading, params

    def hit_source(self, request: Any) -> str:
        """Where the tokens this request loads come from, as vLLM's ``CacheHitSource`` names tiers:
        ``"p2p"`` for a transfer a prefill announced (KV moved from another vLLM instance), ``"host"`` for
        a prefix found in the shared cache (KV kept in Redis's memory, for any engine)."""
        spec = self._pending_loads.get(request.request_id)
        return "p2p" if spec is not None and spec.entry_id is not None else "host"

    def may_load_async(self, request: Any) -> bool:
        """Whether this request's KV may load asynchronously: an announced transfer that fits this engine.

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
        return announced is not None and not announced.differences(self.engine_description())

    def shutdown(self) -> None:
        self._lookup_thread.shutdown(wait=False, cancel_futures=True)
        self._tally.flush()  # bounded by the lookup timeout, as a lookup is
        self.discards.shutdown()
