"""The connector's worker side: pages in and out of the registered KV caches, and the background threads
that write chunks to Redis and read them back.

A producer's ``save_kv_layer`` copies the pages of prompts completing this step out of each layer as the
layer finishes, and ``wait_for_save`` copies any layer whose hook did not run (a CUDA graph replays no
Python) from the registered caches, then hands the prompt to a writer thread, so the write overlaps the next
step. The blocks are free to reuse as soon as the step ends (the pages were copied; on a GPU the copies are
queued on a side stream into pinned memory, and every later kernel of the forward's stream waits for them:
:mod:`kvredis.vllm.staging`). A consumer's loads run on threads of their own: each takes the chunks covering
the request's external positions (waiting for an announced transfer up to ``KVREDIS_POP_TIMEOUT_S``) and
writes their pages into the request's blocks; a load that fails for any reason reports the blocks from the
first position it could not fill through ``get_block_ids_with_load_errors``, so vLLM recomputes them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from kvredis.errors import KVRedisError
from kvredis.store.chunk_keys import ChunkPlan
from kvredis.store.chunk_store import PageFormat
from kvredis.store.keys import reader_id
from kvredis.store.transfer import Saved, Taken, Transfers
from kvredis.vllm import staging
from kvredis.vllm.cache_groups import FULL, STATE, Series, resume_step
from kvredis.vllm.discards import Discards
from kvredis.vllm.endpoint import Endpoint
from kvredis.vllm.heads import Source, sources
from kvredis.vllm.metadata import (
    KVRedisConnectorMetadata,
    TransferSpec,
    resume_end,
    series_plan,
    stored_blocks,
)
from kvredis.vllm.paged import PagedLayout, block_span

logger = logging.getLogger("kvredis.vllm")

_LOAD_THREADS = 4

IDLE_STEP_WAIT_S = 0.01
"""How long a step that computes nothing waits for a load in flight to end before it returns. vLLM steps
without pause while a request waits for its KV (0.32-0.34: a 1 ms sleep in the engine core, the worker's
busy poll of its queue), so the load shares its core, and on a GPU the GIL, with that loop; waiting on the
load instead gives it both, and reports it in the step it ends in. The bound is the most a request arriving
meanwhile waits to be scheduled."""

SHUTDOWN_WAIT_S = 30.0
"""How long shutdown waits for saves in flight, and sleep for loads writing into the caches."""
_NULL_BLOCK = 0
"""vLLM's null block (its block pool's first, never allocated): what a request's block table holds where a
window freed a block. Never stored, never written."""


@dataclass
class _Capture:
    """A prompt's pages copied out of the layers during its last prefill step: ``[layers, pages, ...]``."""

    pages: torch.Tensor
    layers: set[str] = field(default_factory=set)
    broken: bool = False


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
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def enter(self) -> None:
        """Begin a write (:meth:`writing` without a block: a receive in place begins when its first reply
        arrives); raises :class:`~kvredis.KVRedisError` while the gate is closed."""
        with self._changed:
            if not self._open:
                raise KVRedisError("the KV caches were released (vLLM sleep mode) before its pages arrived")
            self._writers += 1

    def leave(self) -> None:
        """End a write begun by :meth:`enter`."""
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


class KVRedisWorker:
    """The worker-side half of :class:`~kvredis.vllm.KVRedisConnector` (one per tensor/pipeline rank)."""

    def __init__(self, endpoint: Endpoint, *, groups: int = 1) -> None:
        self.endpoint = endpoint
        # Block ids name blocks of one KV cache group: with several, a failed load is reported by request.
        self._per_request_failures = groups > 1
        self._series: tuple[Series, ...] = endpoint.series
        self.config = endpoint.config
        self.transfers = endpoint.transfers
        self.counts = endpoint.counts
        self._block_size = endpoint.block_size
        self._layers: dict[str, torch.Tensor] = {}
        self._layouts: dict[str, PagedLayout] = {}
        self._page_views: dict[str, _PageViews] = {}  # CPU layers whose pages a read can land in directly
        self._layer_index: dict[str, int] = {}  # a layer's row in its series' chunks
        self._layer_series: dict[str, int] = {}
        self._gathered: dict[tuple[str, int], _Capture] = {}  # (request, series)
        self._staging: staging.DeviceStaging | None = None  # on a CUDA device; None: pages move directly
        # Loads may wait in a blocking pop for a transfer still being written; saves have their own threads
        # so that waiting loads never hold them up (kv_both), nor saves the loads.
        self._load_pool = ThreadPoolExecutor(max_workers=_LOAD_THREADS, thread_name_prefix="kvredis-load")
        self._save_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvredis-save")
        self._saves_in_flight: set[Future[None]] = set()
        self._lock = threading.Lock()
        self._load_ended = threading.Condition(self._lock)
        self._loads_in_flight = 0
        self._received: set[str] = set()
        self._failed: dict[str, set[int]] = {}
        self._failed_reported: set[str] = set()
        self._failed_requests: set[str] = set()  # several groups: reported by request
        self._cache_writes = _CacheWrites()
        self.discards = Discards(self.transfers, self.counts, self.config.pop_timeout_s)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Remember each stored layer's paged tensor and its layout (in its series' order), and how pages
        move on their device: directly on the CPU, through pinned buffers on side streams on a GPU."""
        if not self._series:  # no KV cache configuration given: every layer is one full-attention group's
            names = tuple(kv_caches)
            self._series = (Series("", FULL, 0, (0,), names, (0,) * len(names)),)
        self._layers = {name: kv_caches[name] for series in self._series for name in series.layers}
        self._layouts = {name: PagedLayout.of(tensor) for name, tensor in self._layers.items()}
        self._layer_index, self._layer_series = {}, {}
        for number, series in enumerate(self._series):
            shapes = {(self._layouts[name], self._layers[name].dtype) for name in series.layers}
            if len(shapes) > 1:
                raise KVRedisError(f"the layers of one KV cache kind have pages of several shapes: {shapes}")
            for row, name in enumerate(series.layers):
                self._layer_index[name] = row
                self._layer_series[name] = number
        device = staging.device_for(self._layers)
        self._staging = (staging.DeviceStaging(device, self.config.pinned_bytes, slots=_LOAD_THREADS)
                         if device is not None else None)
        self._page_views = {}
        if self._staging is None:
            for name, tensor in self._layers.items():
                views = _PageViews.of(tensor)
                if views is not None:
                    self._page_views[name] = views

    def start_load_kv(self, meta: KVRedisConnectorMetadata) -> None:
        """Start this step's loads on background threads; they finish through ``get_finished``."""
        # On a GPU, a load's writes are queued after what the forward's stream holds now: vLLM zeroes newly
        # allocated blocks on it before it starts loads (0.32-0.34, _zero_block_ids / the mixin's comment),
        # and kernels of earlier steps (and their saves) may still read the blocks.
        after = self._staging.mark_compute() if self._staging is not None and meta.loads else None
        for spec in meta.loads:
            with self._lock:
                self._loads_in_flight += 1
            try:
                self._load_pool.submit(self._load, spec, after)
            except RuntimeError as exc:  # shut down: the request must still hear that nothing comes
                self._load_failed(spec, f"the load could not start: {exc}")
                self._load_over()

    def save_kv_layer(self, meta: KVRedisConnectorMetadata, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Copy the pages of prompts completing this step out of the layer, while the next layer computes."""
        # vLLM (0.32-0.34, maybe_transfer_kv_layer) calls this right after the layer's attention op queued
        # its KV writes, on the engine's thread with the forward's stream current; eagerly or between the
        # pieces of a piecewise CUDA graph, never inside a full graph's replay (wait_for_save covers those
        # layers), nor while graphs are captured (no metadata is bound then).
        if not meta.saves or not self.endpoint.writes:  # a rank whose KV heads another rank writes
            return
        index = self._layer_index.get(layer_name)
        if index is None:  # not a layer registered with a paged cache
            return
        # The registered view: what vLLM hands the hook may be another view of it (MLA's drops the heads).
        kv_layer = self._layers[layer_name]
        number = self._layer_series[layer_name]
        series = self._series[number]
        group = series.layer_groups[index]
        layout = self._layouts[layer_name]
        staged: list[tuple[TransferSpec, torch.Tensor, _Capture]] = []
        for spec in meta.saves:
            pages = self._pages(number, layout, self._saved_blocks(spec, number, group))
            capture = self._gathered.get((spec.req_id, number))
            if capture is None:
                # One buffer for the series' layers: the pages are copied once, straight into what is stored.
                shape = (len(series.layers), len(pages), *layout.page_shape)
                capture = _Capture(self._host_empty(shape, kv_layer.dtype))
                self._gathered[spec.req_id, number] = capture
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

    @property
    def _step(self) -> int:
        return resume_step(self._series, self.transfers.chunk_tokens)

    def _stored_range(self, spec: TransferSpec, number: int) -> range:
        """The blocks (indexes into the request's block table) a save stores of series ``number``."""
        return stored_blocks(self._series[number], len(spec.token_ids), spec.computed,
                             self.transfers.chunk_tokens, self._block_size, self._step, spec.known)

    def _saved_blocks(self, spec: TransferSpec, number: int, group: int) -> list[int]:
        """The block ids of group ``group`` a save stores of series ``number``."""
        table = spec.block_ids[group]
        blocks = [table[i] for i in self._stored_range(spec, number)]
        if not self._series[number].whole and _NULL_BLOCK in blocks:
            # vLLM freed a block the window or state still needs (never, by its arithmetic): nothing rather
            # than a block of someone else's.
            raise KVRedisError(f"a {self._series[number].kind} block of the prompt was freed before its save")
        return blocks

    def _pages(self, number: int, layout: PagedLayout, block_ids: list[int]) -> torch.Tensor:
        """The pages of ``block_ids`` in series ``number``'s layers: a state layer has one a block, whatever
        its tensor's shape says; an attention layer's block may be several kernel blocks."""
        if self._series[number].kind == STATE:
            return torch.tensor(block_ids, dtype=torch.long)
        return layout.kernel_blocks(block_ids, self._block_size)

    def wait_for_save(self, meta: KVRedisConnectorMetadata) -> None:
        """Hand each saved prompt to a writer thread; the step does not wait for Redis."""
        captured: list[tuple[TransferSpec, list[torch.Tensor]]] = []
        if not self.endpoint.writes:  # the first of the ranks holding these KV heads writes them, for all
            return
        for spec in meta.saves:
            captures = [self._gathered.pop((spec.req_id, number), None)
                        for number in range(len(self._series))]
            try:
                captured.append((spec, [self._whole_capture(spec, number, capture)
                                        for number, capture in enumerate(captures)]))
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

    def _whole_capture(self, spec: TransferSpec, number: int, capture: _Capture | None) -> torch.Tensor:
        """Every layer's pages of the prompt in series ``number``: those ``save_kv_layer`` copied, and the
        rest copied now from the registered caches (a full CUDA graph or a compiled region runs no per-layer
        hook; the step's blocks cannot be reused before this call returns)."""
        if capture is not None and capture.broken:
            raise KVRedisError("a layer's pages differ in shape from the first layer's")
        series = self._series[number]
        names = list(series.layers)
        if not names or not self._layers:
            raise KVRedisError("no KV caches registered")
        if capture is not None and len(capture.layers) == len(names):
            return capture.pages
        first = self._layouts[names[0]]
        for index, name in enumerate(names):
            if capture is not None and name in capture.layers:
                continue
            pages = self._pages(number, first, self._saved_blocks(spec, number, series.layer_groups[index]))
            if capture is None:
                shape = (len(names), len(pages), *first.page_shape)
                capture = _Capture(self._host_empty(shape, self._layers[names[0]].dtype))
            if self._staging is not None:
                # Queued on the save stream behind what the step's forward (a graph replay) queued.
                self._staging.save_layer(self._layers[name], [(pages, capture.pages[index])])
            else:
                capture.pages[index].copy_(self._layouts[name].gather(self._layers[name], pages))
        assert capture is not None
        return capture.pages

    def _forget_save(self, future: Future[None]) -> None:
        with self._lock:
            self._saves_in_flight.discard(future)

    def _on_device(self) -> AbstractContextManager[None]:
        """Binds a background thread to the caches' device (a no-op on the CPU)."""
        return self._staging.bound() if self._staging is not None else nullcontext()

    def _save(self, spec: TransferSpec, captured: list[torch.Tensor], copied: staging.Transfer | None,
              handed_at: float) -> None:
        started = time.monotonic()
        try:
            with self._on_device():
                if copied is not None:
                    copied.wait()  # the step's copies into the pages ran (this thread waits, not the engine)
                saved = Saved()
                copied_out = 0
                end = resume_end(len(spec.token_ids), self._step)
                for number, (store, pages) in enumerate(zip(self.endpoint.stores, captured, strict=True)):
                    blocks = self._stored_range(spec, number)
                    whole = self._series[number].whole
                    known = spec.known if whole else 0
                    if not blocks and not known:
                        continue
                    plan = series_plan(self._series[number], store, spec.token_ids, spec.context, blocks, end)
                    part = store.save(plan, pages, transfer_id=spec.entry_id, known=known,
                                      pages_per_block=self._page_format(number).pages_per_block)
                    saved.written += part.written
                    saved.present += part.present
                    saved.nbytes += part.nbytes
                    copied_out += pages.numel() * pages.element_size()
        except KVRedisError as exc:
            self.counts.add(save_failures=1)
            self.endpoint.outcomes.add(spec.req_id, False)
            logger.warning("request %s: KV of %d tokens not saved to Redis: %s", spec.req_id,
                           len(spec.token_ids), exc)
        except Exception:  # on a writer thread nobody waits for: say so, or it vanishes in its future
            self.counts.add(save_failures=1)
            self.endpoint.outcomes.add(spec.req_id, False)
            logger.exception("request %s: unexpected error saving KV of %d tokens to Redis", spec.req_id,
                             len(spec.token_ids))
        else:
            self.endpoint.metrics.stored(saved.nbytes, time.monotonic() - started)
            self.counts.add(saved_requests=1, saved_tokens=len(spec.token_ids), written_chunks=saved.written,
                            present_chunks=saved.present, written_bytes=saved.nbytes, copied_bytes=copied_out)
            self.endpoint.outcomes.add(spec.req_id, True)  # for KV events (kvredis.vllm.events)
            self._report_late_save(spec, handed_at, started)

    def _report_late_save(self, spec: TransferSpec, handed_at: float, started: float) -> None:
        """Warn when a prompt's entry reached Redis so late that its decode may have given up waiting (it then
        recomputes the prompt), saying whether the writer waited for a thread or for Redis."""
        done = time.monotonic()
        if spec.entry_id is None or done - handed_at < self.config.pop_timeout_s / 2:
            return
        # On the CPU, the usual cause: a decode on this engine's core, spinning while it waits
        # (docs/deployment.md, "CPU engines on one machine").
        hint = ("" if self._staging is not None else "; CPU engines on one machine need cores of their own "
                "(VLLM_CPU_OMP_THREADS_BIND), or a waiting decode can hold the prefill back")
        logger.warning("request %s: its KV reached Redis %.1f s after its prefill step (%.1f s waiting for a "
                       "writer thread, %.1f s writing); a decode waits up to %g s (KVREDIS_POP_TIMEOUT_S)%s",
                       spec.req_id, done - handed_at, started - handed_at, done - started,
                       self.config.pop_timeout_s, hint)

    def _load(self, spec: TransferSpec, after: staging.Event | None = None) -> None:
        try:
            self._load_one(spec, after)
        finally:
            self._load_over()

    def _load_over(self) -> None:
        """Count a load out of those in flight and wake a step waiting for one to end."""
        with self._lock:
            self._loads_in_flight -= 1
            self._load_ended.notify_all()

    def _load_one(self, spec: TransferSpec, after: staging.Event | None) -> None:
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
        loaded: vLLM recomputes from the first of them (or fails the request); with several KV cache groups,
        the request is reported and recomputed whole. Never raises."""
        loaded = spec.start if loaded is None or self._per_request_failures else max(spec.start, loaded)
        blocks: set[int] = set()
        if not self._per_request_failures:
            try:
                blocks = {spec.block_ids[0][i] for i in block_span(self._block_size, loaded, spec.stop)}
            except Exception:  # page arithmetic that cannot hold: every block of the request is suspect
                blocks = set(spec.block_ids[0]) if spec.block_ids else set()
        with self._lock:
            if self._per_request_failures:
                self._failed_requests.add(spec.req_id)
            else:
                self._failed[spec.req_id] = blocks
            self.counts.add(load_failures=1, failed_tokens=spec.stop - loaded,
                            loaded_tokens=loaded - spec.start)
        logger.warning("request %s: KV of %d tokens not loaded from Redis (%s); vLLM recomputes them",
                       spec.req_id, spec.stop - loaded, cause)

    def take_failed_requests(self) -> set[str]:
        """Requests whose load failed since the last call, reported by request (several KV cache groups)."""
        with self._lock:
            failed, self._failed_requests = self._failed_requests, set()
        return failed

    def _taken_as(self, spec: TransferSpec, source: Source) -> tuple[str | None, tuple[str, ...]]:
        """The transfer id this rank takes the request's announced transfer under in ``source`` (``None``:
        none), and those it hands the transfer on to (the first of the ranks reading the same KV heads does,
        for the others)."""
        if spec.entry_id is None:
            return None, ()
        hand_on = range(1, source.readers) if source.reader == 0 else range(0)
        return (reader_id(spec.entry_id, source.reader),
                tuple(reader_id(spec.entry_id, reader) for reader in hand_on))

    def _page_format(self, number: int = 0, heads: int | None = None) -> PageFormat:
        """The pages series ``number``'s layers hold, with ``heads`` KV heads (default: this rank's): what
        its chunks must carry to be written into them."""
        names = self._series[number].layers
        layout = self._layouts[names[0]]
        state = self._series[number].kind == STATE
        per_block = 1 if state else self._block_size // layout.kernel_block_size
        page_shape = layout.page_shape if state or heads is None else (heads, *layout.page_shape[1:])
        return PageFormat(self._layers[names[0]].dtype, len(names), page_shape, per_block)

    def _load_into_blocks(self, spec: TransferSpec,
                          after: staging.Event | None = None) -> tuple[str | None, int]:
        """Read the chunks covering the request's external positions, in every series (a window's from the
        first position it attends to) and from every writer's part of KV heads this rank holds heads of
        (:mod:`kvredis.vllm.heads`), and write their pages into its blocks; returns why not all of them
        (``None``: all), and the position up to which the blocks hold loaded KV (on a GPU, once the copies
        ran: the request is reported finished only then). Where pages are received in place or into a
        leased pinned buffer, the placement is let go once the load is over."""
        with ExitStack() as held:
            return self._load_series(spec, after, held)

    def _load_series(self, spec: TransferSpec, after: staging.Event | None,
                     held: ExitStack) -> tuple[str | None, int]:
        if not self._layers:
            return "no KV caches registered", spec.start
        started = time.perf_counter()
        causes: list[str] = []
        loaded_to, nbytes, late = spec.stop, 0, False
        waited: float | None = None
        parts = spec.parts or self.endpoint.split.parts
        head_sources = sources(self.endpoint.split, self.endpoint.rank, parts)
        for number, series in enumerate(self._series):
            first = spec.start if series.whole else max(spec.start, series.needed(spec.stop))
            blocks = range(first // self._block_size, -(-spec.stop // self._block_size))
            # The same chunks in every part's key space (a part's chunks differ in their heads alone).
            plan = series_plan(series, self.endpoint.stores[number], spec.token_ids, spec.context, blocks,
                               spec.stop)
            takes: list[tuple[Transfers, str | None, Taken]] = []
            for source in head_sources:
                store = self.endpoint.stores_of(parts, source.part)[number]
                transfer_id, hand_on = self._taken_as(spec, source)
                if late:  # its record would not come either: released if it ever lands
                    assert transfer_id is not None
                    self.discards.submit(spec.req_id, transfer_id, store.prefix)
                    continue
                # Without a transfer, chunks other ranks read too are left to them (and their TTL).
                page_format = self._page_format(number, source.width)
                into: _BlockPlacement | _PinnedPlacement | None = None
                if len(head_sources) == 1 and source.whole:
                    into = self._placement(spec, number, plan, first, page_format)
                    if into is not None:
                        held.callback(into.done)  # after the pages were written (on a GPU, copied)
                taken = store.take(plan, first, spec.stop, page_format, transfer_id=transfer_id,
                                   hand_on=hand_on, keep=source.readers > 1, into=into)
                takes.append((store, transfer_id, taken))
                nbytes += taken.nbytes
                if taken.waited is not None:
                    waited = (waited or 0.0) + taken.waited
            if late:
                continue
            # Every head of a chunk or none: the chunks every source holds, assembled into this rank's heads.
            count = min(len(taken.chunks) for _, _, taken in takes)
            if len(head_sources) == 1 and head_sources[0].whole:
                assembled = takes[0][2]  # perhaps received in place
            else:  # a slice of a part or several parts: never received in place
                assembled = Taken(takes[0][2].first, [_heads_of(head_sources, [_held(t.chunks[i])
                                                                               for _, _, t in takes])
                                                      for i in range(count)])
            loaded = min(spec.stop, assembled.stop(plan)) if assembled.chunks else first
            self._write_chunks(spec, number, plan, assembled.first, assembled.chunks, first, loaded, after)
            missed = [(store, transfer_id, t.cause) for store, transfer_id, t in takes if t.cause != "hit"]
            for store, transfer_id, cause in missed:
                late = late or cause == "late"
                causes.append(self._missed(spec, store, cause, loaded, transfer_id))
            if missed:
                # A window's blocks are needed together: without all of them, none counts.
                loaded_to = min(loaded_to, loaded if series.whole else spec.start)
        if nbytes:
            self.endpoint.metrics.loaded(nbytes, time.perf_counter() - started, waited)
            self.counts.add(loaded_bytes=nbytes)
        return ("; ".join(causes), loaded_to) if causes else (None, spec.stop)

    def _missed(self, spec: TransferSpec, store: Transfers, cause: str, loaded: int,
                transfer_id: str | None) -> str:
        """Count a take (of transfer ``transfer_id``) that did not get everything, and say why."""
        miss = "absent" if cause == "late" else cause  # a record not there in time: absent
        known = ("absent", "corrupt", "foreign", "partial")
        self.endpoint.metrics.miss(miss if miss in known else "mismatch")
        if cause == "late":
            assert transfer_id is not None
            # Announced but not written in time (a stalled prefill): released if it lands within a pop bound.
            self.discards.submit(spec.req_id, transfer_id, store.prefix)
            return (f"no transfer record within {self.config.pop_timeout_s:g} s at "
                    f"{store.record_key(transfer_id)} (missing, expired or evicted)")
        return f"its chunks end at position {loaded} ({cause})"

    def _placement(self, spec: TransferSpec, number: int, plan: ChunkPlan, start: int,
                   page_format: PageFormat) -> _BlockPlacement | _PinnedPlacement | None:
        """Where a read of series ``number``'s chunks for positions ``start..`` of the request lands their
        pages: in its blocks (CPU caches), in a pinned buffer leased for the load (a GPU's), or ``None``."""
        if self._staging is None:
            return self._in_place(spec, number, plan, start, spec.stop)
        store = self.endpoint.stores[number].chunks
        indexes = plan.covering(start, spec.stop)
        sizes = {index: store.pages_nbytes(plan, index, page_format) for index in indexes}
        return _PinnedPlacement(self._staging.lease(sum(sizes.values())), sizes)

    def _in_place(self, spec: TransferSpec, number: int, plan: ChunkPlan, start: int,
                  stop: int) -> _BlockPlacement | None:
        """Where a read lands the pages of series ``number``'s chunks straight in the request's blocks
        holding positions ``start..stop-1`` (``None``: the caches' pages cannot take a read)."""
        series = self._series[number]
        views = [self._page_views.get(name) for name in series.layers]
        if not views or any(view is None for view in views):
            return None
        tables = [spec.block_ids[group] for group in series.layer_groups]
        blocks = block_span(self._block_size, start, stop)
        for table in {id(table): table for table in tables}.values():
            if _NULL_BLOCK in (table[block] for block in blocks):
                raise KVRedisError(f"block {_NULL_BLOCK} (vLLM's null block) among the blocks to load")
        per_block = self._page_format(number).pages_per_block
        return _BlockPlacement(plan, self._block_size, blocks, per_block, self._series[number].kind == STATE,
                               [(view, table) for view, table in zip(views, tables, strict=True)
                                if view is not None], self._cache_writes)

    def _write_chunks(self, spec: TransferSpec, number: int, plan: ChunkPlan, first: int,
                      chunks: list[torch.Tensor | None], start: int, loaded: int,
                      after: staging.Event | None) -> None:
        """Write series ``number``'s pages of the blocks holding positions ``start..loaded-1`` into the
        request's blocks (each layer's group's), from ``chunks`` (the plan's chunk ``first`` on), a chunk at a
        time (no copy of them joined); a chunk received in place (``None``) is in its blocks already. Blocks
        before ``spec.start`` are the local prefix cache's, shared with other requests: never written."""
        if all(chunk is None for chunk in chunks):
            return
        series = self._series[number]
        names = series.layers
        layout = self._layouts[names[0]]
        copies: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # a device's, queued together
        with self._cache_writes.writing():  # held until the copies ran: vLLM may release the caches after
            for index, stored in enumerate(chunks, start=first):
                if stored is None:
                    continue
                chunk_start, chunk_stop = plan.span(index)
                blocks = list(block_span(self._block_size, max(start, chunk_start), min(loaded, chunk_stop)))
                if not blocks:
                    continue
                offset = chunk_start // self._block_size  # the chunk's first block
                sources = self._pages(number, layout, [block - offset for block in blocks])
                for group in series.groups:
                    ids = [spec.block_ids[group][block] for block in blocks]
                    if _NULL_BLOCK in ids:
                        raise KVRedisError(f"block {_NULL_BLOCK} (vLLM's null block) among the blocks to "
                                           "load")
                    targets = self._pages(number, layout, ids)
                    rows = [row for row, owner in enumerate(series.layer_groups) if owner == group]
                    if self._staging is None:
                        for row in rows:
                            name = names[row]
                            self._layouts[name].scatter(self._layers[name], targets, stored[row, sources])
                        continue
                    pinned = self._pinned_pages(stored, rows, sources)
                    copies += [(self._layers[names[row]], pages, targets)
                               for row, pages in zip(rows, pinned, strict=True)]
            if copies:
                assert self._staging is not None
                self._staging.load(copies, after)

    def _pinned_pages(self, stored: torch.Tensor, rows: list[int],
                      sources: torch.Tensor) -> list[torch.Tensor]:
        """Each row's ``sources`` pages of a chunk, in pinned memory for a copy to the device: views of the
        chunk where it was received into the pinned buffers and the pages lie side by side, else a copy."""
        assert self._staging is not None
        first, count = int(sources[0]), len(sources)
        if self._staging.pinned(stored) and int(sources[-1]) - first + 1 == count:
            return [stored[row].narrow(0, first, count) for row in rows]
        # One contiguous pinned range a layer, copied to the device without a pageable intermediate.
        pinned = self._staging.host_empty((len(rows), count, *stored.shape[2:]), stored.dtype)
        pinned.copy_(stored[rows][:, sources])
        return list(pinned)

    def get_finished(self, finished_req_ids: set[str], *,
                     idle: bool = False) -> tuple[set[str] | None, set[str] | None]:
        """Loads finished since the last call (failed ones once their blocks were reported). In an ``idle``
        step (nothing computed), first waits up to :data:`IDLE_STEP_WAIT_S` for a load in flight to end."""
        with self._lock:
            if idle and self._loads_in_flight and not self._ended_unreported():
                self._load_ended.wait(IDLE_STEP_WAIT_S)
            done = self._received | self._failed_reported
            self._received.clear()
            self._failed_reported.clear()
        return None, done or None

    def _ended_unreported(self) -> bool:
        """Whether a load ended that the engine has not heard of yet (the lock held)."""
        return bool(self._received or self._failed or self._failed_reported or self._failed_requests)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed; their requests finish in the next ``get_finished``."""
        with self._lock:
            blocks: set[int] = set()
            for req_id, failed in self._failed.items():
                blocks |= failed
                self._failed_reported.add(req_id)
            self._failed.clear()
        return blocks

    def unregister_kv_caches(self) -> None:
        """Before vLLM releases the KV caches (sleep): stop loads from writing into them, and wait for the
        writes in progress. A load still waiting for its entry fails when the entry comes (its blocks are
        reported, so vLLM recomputes them). On a GPU, also wait for the save copies still reading the caches
        on the save stream. Idempotent."""
        if not self._cache_writes.close(SHUTDOWN_WAIT_S):
            logger.error("a load is still writing into the KV caches %g s after vLLM asked to release them",
                         SHUTDOWN_WAIT_S)
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

    def shutdown(self) -> None:
        """Let saves in flight finish (bounded); drop queued loads and discards."""
        with self._lock:
            pending = set(self._saves_in_flight)
        if pending:
            wait_futures(pending, timeout=SHUTDOWN_WAIT_S)
        self._load_pool.shutdown(wait=False, cancel_futures=True)
        self._save_pool.shutdown(wait=False, cancel_futures=True)
        self.discards.shutdown()


def _heads_of(head_sources: list[Source], chunks: list[torch.Tensor]) -> torch.Tensor:
    """A chunk's pages (``[layers, pages, heads, ...]``) with this rank's KV heads, from the same chunk of
    each source: a slice of one writer's heads, or several writers' side by side."""
    if len(chunks) == 1:
        source = head_sources[0]
        return chunks[0] if source.whole else chunks[0].narrow(2, source.first, source.count)
    return torch.cat(chunks, dim=2)


def _held(chunk: torch.Tensor | None) -> torch.Tensor:
    """A chunk's pages as read into memory of the read's own (a take given no placement has them all)."""
    if chunk is None:
        raise KVRedisError("a chunk was received in place where its pages were to be assembled")
    return chunk


@dataclass(frozen=True)
class _PageViews:
    """A CPU layer's pages as byte ranges of its memory: page ``k`` is ``flat[k * stride:][:nbytes]``."""

    flat: memoryview
    stride: int
    nbytes: int

    @classmethod
    def of(cls, layer: torch.Tensor) -> _PageViews | None:
        """The views of ``layer``'s pages (``[pages, ...]``), or ``None`` where a page is not one range of
        host memory."""
        if layer.device.type != "cpu" or layer.dim() < 2 or not layer[0].is_contiguous() or not layer.numel():
            return None
        raw = layer.view(torch.uint8) if layer.element_size() != 1 else layer
        stride = raw.stride(0)
        nbytes = raw[0].numel()
        if stride < nbytes:
            return None
        span = torch.as_strided(raw, ((raw.shape[0] - 1) * stride + nbytes,), (1,), raw.storage_offset())
        return cls(span.numpy().data.cast("B"), stride, nbytes)


class _PinnedPlacement:
    """A load's :data:`~kvredis.store.chunk_store.PagesPlace` on a GPU: each chunk's pages in its own range of
    a pinned buffer leased for the load (the read returns them as tensors there, which the device copies
    from); :meth:`done` hands the buffer back once those copies ran."""

    in_place = False

    def __init__(self, lease: staging.PinnedLease, sizes: dict[int, int]) -> None:
        self._lease = lease
        self._ranges: dict[int, tuple[int, int]] = {}
        offset = 0
        for index, nbytes in sizes.items():
            self._ranges[index] = (offset, nbytes)
            offset += nbytes
        self._bytes = lease.buffer.numpy().data.cast("B")

    def __call__(self, index: int) -> list[memoryview] | None:
        where = self._ranges.get(index)
        if where is None:
            return None
        offset, nbytes = where
        return [self._bytes[offset:offset + nbytes]]

    def done(self) -> None:
        self._lease.release()


class _BlockPlacement:
    """A load's :data:`~kvredis.store.chunk_store.PagesPlace`: each chunk's pages land in the request's blocks
    (every layer's, in the chunk's ``[layers, pages, ...]`` order), those of blocks the load does not write
    (the local prefix cache's, shared with other requests) in scratch memory of their own, so that the
    chunk's checksum still covers every byte. The first placement holds the caches' write gate until
    :meth:`done`: vLLM may not release the caches while bytes land in them."""

    in_place = True

    def __init__(self, plan: ChunkPlan, block_size: int, blocks: range, per_block: int, state: bool,
                 layers: list[tuple[_PageViews, list[int]]], gate: _CacheWrites) -> None:
        self._plan = plan
        self._block_size = block_size
        self._blocks = blocks
        self._per_block = per_block
        self._state = state
        self._layers = layers
        self._gate = gate
        self._held = False

    def __call__(self, index: int) -> list[memoryview]:
        if not self._held:
            self._gate.enter()
            self._held = True
        start, stop = self._plan.span(index)
        chunk_blocks = range(start // self._block_size, -(-stop // self._block_size))
        out: list[memoryview] = []
        for views, table in self._layers:
            run_start = run_stop = -1  # pages side by side in the layer's memory are one range
            for block in chunk_blocks:
                if block not in self._blocks:
                    if run_start >= 0:
                        out.append(views.flat[run_start:run_stop])
                        run_start = -1
                    out.append(memoryview(bytearray(views.nbytes * self._per_block)))
                    continue
                first = table[block] if self._state else table[block] * self._per_block
                for page in range(first, first + self._per_block):
                    at = page * views.stride
                    if at == run_stop and views.stride == views.nbytes:
                        run_stop = at + views.nbytes
                        continue
                    if run_start >= 0:
                        out.append(views.flat[run_start:run_stop])
                    run_start, run_stop = at, at + views.nbytes
            if run_start >= 0:
                out.append(views.flat[run_start:run_stop])
        return out

    def done(self) -> None:
        """The read is over: release the write gate if a placement took it."""
        if self._held:
            self._held = False
            self._gate.leave()
