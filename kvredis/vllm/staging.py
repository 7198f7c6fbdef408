"""Moving pages between a device's paged KV caches and host memory, without stalling the engine's step.

On the CPU the connector copies pages directly (``index_select`` into the capture, indexed writes into the
caches) and uses nothing here but :func:`device_for`, which answers ``None``. On a CUDA device,
:class:`DeviceStaging` moves them through pinned host buffers on side streams:

- **Saves.** Per layer, a save stream first waits for the stream the forward runs on (the layer's KV must
  be written before it is read), gathers the request's pages on the device and copies them
  ``non_blocking`` into one pinned buffer per prompt (all layers). Once per step (``wait_for_save``), one
  event is recorded on the save stream and the compute stream is made to wait for it: no later kernel can
  overwrite or reuse the step's blocks before the copies have read them, and the host never waits. The
  writer thread synchronises on that event before it encodes the buffer.
- **Loads.** The entry arrives in pinned memory; a load stream waits for an event the compute stream
  recorded when the step started the load (vLLM zeroes newly allocated blocks on that stream before it
  starts loads, and earlier steps' kernels may still read the blocks), copies the pages ``non_blocking``
  to the device, writes them into the blocks and records an event; the load thread synchronises on it
  before the request is reported finished.

The device tensors the side streams use are the registered caches (never freed while registered; before
vLLM releases them in sleep mode the connector waits for the copies in flight) and temporaries allocated
while the side stream is current (the caching allocator reuses their memory only behind that stream's
work); the pinned buffers stay referenced until their event completed.

Every device operation goes through :class:`Device`, which :class:`CudaDevice` implements over
``torch.cuda``; tests substitute a fake whose events complete when the test says so.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvredis.errors import ConfigError


class Event(Protocol):
    """A point in a stream's work: done once everything queued on the stream before it has run."""

    def query(self) -> bool:
        """Whether the work before the event has run (never blocks)."""

    def synchronize(self) -> None:
        """Block the calling thread until the work before the event has run."""


class Device(Protocol):
    """The device operations :class:`DeviceStaging` needs: :class:`CudaDevice` on a GPU, a fake in tests.

    ``stream`` arguments are opaque handles from :meth:`current_stream` or :meth:`new_stream`; every copy
    is queued on the stream given and returns at once.
    """

    def current_stream(self) -> Any:
        """The calling thread's current stream on the device (where vLLM runs the forward)."""

    def new_stream(self) -> Any:
        """A stream of its own, for work that must overlap the forward."""

    def record_event(self, stream: Any) -> Event:
        """An event after the work queued on ``stream`` so far."""

    def wait_event(self, stream: Any, event: Event) -> None:
        """Make work queued on ``stream`` from now on wait for ``event`` (the host does not wait)."""

    def pinned_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised page-locked host tensor (copies to and from it can be asynchronous)."""

    def upload_index(self, stream: Any, index: torch.Tensor) -> torch.Tensor:
        """A host index tensor's copy on the device, queued on ``stream`` (through pinned memory)."""

    def gather_to_host(self, stream: Any, layer: torch.Tensor, index: torch.Tensor,
                       out: torch.Tensor) -> None:
        """Queue on ``stream``: pages ``index`` (on the device) of ``layer`` into pinned ``out``."""

    def scatter_from_host(self, stream: Any, layer: torch.Tensor, index: torch.Tensor,
                          pages: torch.Tensor) -> None:
        """Queue on ``stream``: pinned ``pages`` into ``layer`` at pages ``index`` (on the device)."""

    def bound(self) -> AbstractContextManager[None]:
        """Bind the calling (background) thread to the device for the block's duration."""

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies in pinned host memory (a copy from it to the device is asynchronous)."""


def copy_pages_out(layer: torch.Tensor, index: torch.Tensor, out: torch.Tensor, *,
                   non_blocking: bool = False) -> None:
    """Pages ``index`` of ``layer`` into ``out``, shaped ``[len(index), *layer.shape[1:]]``."""
    if tuple(out.shape) != (index.numel(), *layer.shape[1:]) or out.dtype != layer.dtype:
        raise ValueError(f"cannot copy {index.numel()} pages of {tuple(layer.shape)} {layer.dtype} into "
                         f"{tuple(out.shape)} {out.dtype}")
    out.copy_(torch.index_select(layer, 0, index), non_blocking=non_blocking)


def copy_pages_in(layer: torch.Tensor, index: torch.Tensor, pages: torch.Tensor, *,
                  non_blocking: bool = False) -> None:
    """``pages`` (any device) into ``layer`` at pages ``index`` (on ``layer``'s device)."""
    if tuple(pages.shape) != (index.numel(), *layer.shape[1:]) or pages.dtype != layer.dtype:
        raise ValueError(f"cannot write {tuple(pages.shape)} {pages.dtype} into {index.numel()} pages of "
                         f"{tuple(layer.shape)} {layer.dtype}")
    layer[index] = pages.to(layer.device, non_blocking=non_blocking)


class CudaDevice:
    """:class:`Device` over ``torch.cuda``, for one GPU of a vLLM worker."""

    def __init__(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise ConfigError(f"the KV caches are on {device}, but CUDA is not available to torch here")
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)

    def current_stream(self) -> Any:
        # vLLM runs the forward on a stream of its own, not the default one (vllm.utils.torch_utils'
        # current_stream() makes one per process and sets it current): ask, never assume.
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(device=self.device)

    def record_event(self, stream: Any) -> Event:
        # blocking=True: a thread waiting on it sleeps instead of spinning a core the engine needs.
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Event) -> None:
        stream.wait_event(event)

    def pinned_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        # torch's caching host allocator: freed blocks are reused, after the copies recorded on them ended.
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)

    def upload_index(self, stream: Any, index: torch.Tensor) -> torch.Tensor:
        # From pageable memory cudaMemcpyAsync would first wait for the stream, and this one waits for the
        # forward: staged through pinned memory, the host never waits.
        host = self.pinned_empty(index.shape, torch.long)
        host.copy_(index)
        with torch.cuda.stream(stream):  # allocated on the side stream: its memory is reused only after it
            return host.to(self.device, non_blocking=True)

    def gather_to_host(self, stream: Any, layer: torch.Tensor, index: torch.Tensor,
                       out: torch.Tensor) -> None:
        with torch.cuda.stream(stream):
            copy_pages_out(layer, index, out, non_blocking=True)

    def scatter_from_host(self, stream: Any, layer: torch.Tensor, index: torch.Tensor,
                          pages: torch.Tensor) -> None:
        with torch.cuda.stream(stream):
            copy_pages_in(layer, index, pages, non_blocking=True)

    def bound(self) -> AbstractContextManager[None]:
        # A thread that is not bound would create a context on GPU 0 and queue on its legacy default stream.
        return torch.cuda.device(self.device)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return bool(tensor.is_pinned())


def device_for(caches: Mapping[str, torch.Tensor]) -> Device | None:
    """The :class:`Device` whose streams move these caches' pages; ``None`` where pages move directly (the
    CPU, and devices without streams here). :class:`~kvredis.ConfigError` for caches on several devices."""
    devices = {tensor.device for tensor in caches.values()}
    if len(devices) > 1:
        raise ConfigError(f"the KV caches are on several devices ({sorted(map(str, devices))}); kvredis "
                          "moves one worker's caches, on one device")
    if not devices:
        return None
    (device,) = devices
    return CudaDevice(device) if device.type == "cuda" else None


@dataclass
class Transfer:
    """Copies queued on a side stream, done when ``event`` is; ``keep`` holds what they read or write."""

    event: Event
    keep: list[torch.Tensor] = field(default_factory=list)

    def wait(self) -> None:
        """Block until the copies ran (a background thread's call: the engine's step never waits)."""
        self.event.synchronize()
        self.keep = []


class PinnedLease:
    """A load's pinned host memory (``buffer``, ``uint8``), its until :meth:`release`."""

    def __init__(self, buffer: torch.Tensor, give_back: Callable[[], None] | None) -> None:
        self.buffer = buffer
        self.pooled = give_back is not None
        self._give_back = give_back

    def release(self) -> None:
        """Hand the memory back (once its copies to the device ran); idempotent."""
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back()


class DeviceStaging:
    """One worker's page transfers between its device's caches and pinned host memory.

    The save methods (:meth:`save_layer`, :meth:`finish_saves`) run on the engine's thread, inside its
    step; :meth:`load` runs on a load thread; :meth:`host_empty` and :meth:`host_bytes` anywhere.
    """

    def __init__(self, device: Device, pinned_bytes: int = 0, slots: int = 1) -> None:
        self.device = device
        # Loads receive chunks into slots of one pinned buffer, allocated at the first load and kept.
        self._slots = max(slots, 1)
        self._slot_bytes = pinned_bytes // self._slots
        self._pool: torch.Tensor | None = None
        self._free_slots = list(range(self._slots))
        self._save_stream = device.new_stream()
        # One load stream for every load thread: copies to one device share its copy engines anyway.
        self._load_stream = device.new_stream()
        self._step_keep: list[torch.Tensor] = []  # what this step's save copies use, until finish_saves
        self._step_indices: dict[tuple[int, ...], torch.Tensor] = {}  # uploaded once per step
        self._saves: deque[Transfer] = deque()  # handed out, maybe not done yet
        self._lock = threading.Lock()

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A pinned host tensor to copy pages into."""
        return self.device.pinned_empty(shape, dtype)

    def host_bytes(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of pinned host memory (a ``uint8`` tensor): where a load receives its entry."""
        return self.device.pinned_empty((nbytes,), torch.uint8)

    def bound(self) -> AbstractContextManager[None]:
        """Bind the calling background thread to the device (its allocations, its streams)."""
        return self.device.bound()

    def pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies in pinned host memory."""
        return self.device.is_pinned(tensor)

    def lease(self, nbytes: int) -> PinnedLease:
        """Pinned memory for one load to receive ``nbytes`` of pages into: a slot of the pool (allocated at
        the first lease, then reused; a slot is never handed to two loads at once), or, for a load larger
        than a slot or while every slot is leased, a buffer of its own."""
        with self._lock:
            if 0 < nbytes <= self._slot_bytes and self._free_slots:
                if self._pool is None:
                    self._pool = self.host_bytes(self._slot_bytes * self._slots)
                slot = self._free_slots.pop()
                start = slot * self._slot_bytes
                return PinnedLease(self._pool[start:start + nbytes], lambda: self._give_back(slot))
        return PinnedLease(self.host_bytes(nbytes), None)

    def _give_back(self, slot: int) -> None:
        with self._lock:
            if slot in self._free_slots:
                raise RuntimeError(f"pinned slot {slot} given back twice")
            self._free_slots.append(slot)

    # -- saves (the engine's thread) --------------------------------------------------------------

    def save_layer(self, layer: torch.Tensor, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Queue, for each ``(pages, out)``, the copy of host-indexed ``pages`` of ``layer`` into pinned
        ``out``, after the work the forward queued so far. Never waits; raises before queueing anything if
        a shape differs."""
        for pages, out in copies:
            if tuple(out.shape) != (pages.numel(), *layer.shape[1:]) or out.dtype != layer.dtype:
                raise ValueError(f"cannot copy {pages.numel()} pages of {tuple(layer.shape)} {layer.dtype} "
                                 f"into {tuple(out.shape)} {out.dtype}")
        if not copies:
            return
        stream = self._save_stream
        # The layer's KV for this step was queued on the forward's stream just before vLLM called the hook.
        self.device.wait_event(stream, self.device.record_event(self.device.current_stream()))
        for pages, out in copies:
            key = tuple(pages.tolist())  # a host tensor: no device sync
            index = self._step_indices.get(key)
            if index is None:
                index = self._step_indices[key] = self.device.upload_index(stream, pages)
                self._step_keep.append(index)
            self.device.gather_to_host(stream, layer, index, out)
            self._step_keep.append(out)

    def finish_saves(self) -> Transfer | None:
        """End the step's saves: one event on the save stream, which the compute stream waits for (so no
        later kernel reuses the blocks before the copies read them); ``None`` if nothing was queued."""
        if not self._step_keep:
            return None
        event = self.device.record_event(self._save_stream)
        self.device.wait_event(self.device.current_stream(), event)
        transfer = Transfer(event, self._step_keep)
        self._step_keep, self._step_indices = [], {}
        with self._lock:
            while self._saves and self._saves[0].event.query():  # done: let their buffers go
                self._saves.popleft()
            self._saves.append(transfer)
        return transfer

    def wait_saves(self) -> None:
        """Block until every save copy queued so far ran (before vLLM releases the caches); raises the first
        failed copy's error once every transfer was waited for."""
        with self._lock:
            pending = list(self._saves)
            self._saves.clear()
        failure: Exception | None = None
        for transfer in pending:
            try:
                transfer.wait()
            except Exception as exc:  # a failed copy: the others must still be waited for
                failure = failure or exc
        if failure is not None:
            raise failure

    # -- loads (a load thread) -------------------------------------------------------------------------

    def mark_compute(self) -> Event:
        """An event on the forward's stream now (the engine's thread, as the step starts its loads)."""
        return self.device.record_event(self.device.current_stream())

    def load(self, writes: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
             after: Event | None) -> None:
        """Write each ``(layer, pages, targets)``'s pinned ``pages`` into ``layer`` at host-indexed
        ``targets``, after ``after``; returns once every copy ran (one event for them all). Call from a
        thread :meth:`bound` to the device."""
        stream = self._load_stream
        if after is not None:
            self.device.wait_event(stream, after)
        indices: dict[tuple[int, ...], torch.Tensor] = {}  # each index uploaded once
        keep: list[torch.Tensor] = []
        for layer, pages, targets in writes:
            key = tuple(targets.tolist())
            index = indices.get(key)
            if index is None:
                index = indices[key] = self.device.upload_index(stream, targets)
                keep.append(index)
            self.device.scatter_from_host(stream, layer, index, pages)
            keep.append(pages)
        Transfer(self.device.record_event(stream), keep).wait()
