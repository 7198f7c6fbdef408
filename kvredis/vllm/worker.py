"""The connector's worker side: pages in and out of the registered KV caches, and the background threads
that write chunks to Redis and read them back.

A producer's ``save_kv_layer`` copies the pages of prompts completing this step out of each layer as the
layer finishes, and ``wait_for_save`` copies any layer whose hook did not run (a CUDA graph replays no
Python) from the registered caches, then hands the prompt to a writer thread, so the write overlaps the next
step. The blocks are free to reuse as soon as the step ends (the pages were copied; on a GPU the copies are
queued on a side stream into pinned memory, and every later kernel of the forward's stream waits for them:
:mod:`kvredis.staging`). A consumer's loads run on threads of their own: each takes the chunks covering the
request's external positions (waiting for an announced transfer up to ``KVREDIS_POP_TIMEOUT_S``) and writes
their pages into the request's blocks; a load that fails for any reason reports the blocks from the first
position it could not fill through ``get_block_ids_with_load_errors``, so vLLM recomputes them.
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

import torch

from kvredis import staging
from kvredis.chunk_keys import ChunkPlan
from kvredis.chunk_store import PageFormat
from kvredis.errors import KVRedisError
from kvredis.paged import PagedLayout, block_span
from kvredis.vllm.discards import Discards
from kvredis.vllm.endpoint import Endpoint
from kvredis.vllm.metadata import KVRedisConnectorMetadata, TransferSpec, stored_plan

logger = logging.getLogger("kvredis.vllm")

SHUTDOWN_WAIT_S = 30.0
"""How long shutdown waits for saves in flight, and sleep for loads writing into the caches."""


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


class KVRedisWorker:
    """The worker-side half of :class:`~kvredis.vllm.KVRedisConnector` (one per tensor/pipeline rank)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.config = endpoint.config
        self.transfers = endpoint.transfers
        self.counts = endpoint.counts
        self._block_size = endpoint.block_size
        self._layers: dict[str, torch.Tensor] = {}
        self._layouts: dict[str, PagedLayout] = {}
        self._layer_index: dict[str, int] = {}
        self._gathered: dict[str, _Capture] = {}
        self._staging: staging.DeviceStaging | None = None  # on a CUDA device; None: pages move directly
        # Loads may wait in a blocking pop for a transfer still being written; saves have their own threads
        # so that waiting loads never hold them up (kv_both), nor saves the loads.
        self._load_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvredis-load")
        self._save_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvredis-save")
        self._saves_in_flight: set[Future[None]] = set()
        self._lock = threading.Lock()
        self._received: set[str] = set()
        self._failed: dict[str, set[int]] = {}
        self._failed_reported: set[str] = set()
        self._cache_writes = _CacheWrites()
        self.discards = Discards(self.transfers, self.counts, self.config.pop_timeout_s)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Remember each layer's paged tensor and its layout (the order is the layer order), and how pages
        move on their device: directly on the CPU, through pinned buffers on side streams on a GPU."""
        self._layers = dict(kv_caches)
        self._layouts = {name: PagedLayout.of(tensor) for name, tensor in kv_caches.items()}
        self._layer_index = {name: index for index, name in enumerate(self._layers)}
        device = staging.device_for(kv_caches)
        self._staging = staging.DeviceStaging(device) if device is not None else None

    def start_load_kv(self, meta: KVRedisConnectorMetadata) -> None:
        """Start this step's loads on background threads; they finish through ``get_finished``."""
        # On a GPU, a load's writes are queued after what the forward's stream holds now: vLLM zeroes newly
        # allocated blocks on it before it starts loads (0.32-0.34, _zero_block_ids / the mixin's comment),
        # and kernels of earlier steps (and their saves) may still read the blocks.
        after = self._staging.mark_compute() if self._staging is not None and meta.loads else None
        for spec in meta.loads:
            try:
                self._load_pool.submit(self._load, spec, after)
            except RuntimeError as exc:  # shut down: the request must still hear that nothing comes
                self._load_failed(spec, f"the load could not start: {exc}")

    def save_kv_layer(self, meta: KVRedisConnectorMetadata, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Copy the pages of prompts completing this step out of the layer, while the next layer computes."""
        # vLLM (0.32-0.34, maybe_transfer_kv_layer) calls this right after the layer's attention op queued
        # its KV writes, on the engine's thread with the forward's stream current; eagerly or between the
        # pieces of a piecewise CUDA graph, never inside a full graph's replay (wait_for_save covers those
        # layers), nor while graphs are captured (no metadata is bound then).
        if not meta.saves:
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

    def wait_for_save(self, meta: KVRedisConnectorMetadata) -> None:
        """Hand each saved prompt to a writer thread; the step does not wait for Redis."""
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
                plan = stored_plan(self.transfers, spec.token_ids, spec.context)
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
            self.endpoint.metrics.stored(saved.nbytes, time.monotonic() - started)
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
        plan = stored_plan(self.transfers, spec.token_ids, spec.context)
        taken = self.transfers.take(plan, spec.start, spec.stop, self._page_format(),
                                    transfer_id=spec.entry_id)
        loaded = min(spec.stop, taken.stop(plan)) if taken.chunks else spec.start
        if taken.chunks:
            self._write_chunks(spec, plan, taken.first, taken.chunks, loaded, after)
            self.endpoint.metrics.loaded(taken.nbytes, time.perf_counter() - started)
            self.counts.add(loaded_bytes=taken.nbytes)
        if taken.cause == "hit":
            return None, spec.stop
        miss = "absent" if taken.cause == "late" else taken.cause  # a record not there in time: absent
        known = ("absent", "corrupt", "foreign", "partial")
        self.endpoint.metrics.miss(miss if miss in known else "mismatch")
        if taken.cause == "late":
            assert spec.entry_id is not None
            # Announced but not written in time (a stalled prefill): released if it lands within a pop bound.
            self.discards.submit(spec.req_id, spec.entry_id, self.endpoint.keyspace.prefix)
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
