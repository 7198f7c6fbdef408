"""A fake :class:`kvredis.vllm.staging.Device` for testing the CUDA data path's logic on the CPU.

It behaves like a GPU where it matters to the logic, and records what it was asked to do:

- The *compute* stream (where the test plays the forward, writing CPU tensors directly) runs everything at
  once; its events are complete when recorded.
- Side streams (:meth:`new_stream`) queue their copies: a device-to-host copy reads the layer when it is
  queued (the side stream waited for the forward's writes, and nothing else writes those pages within the
  step) but lands in the host buffer only when an event after it completes; a host-to-device copy reads its
  pinned pages and writes the layer only then. Until then a host buffer holds the garbage it was
  allocated with (``0xA5`` bytes), so reading it too early gives wrong bytes.
- An event on a side stream completes when the test calls :meth:`FakeDevice.complete` (or, with
  ``auto=True``, when someone waits for it); :meth:`FakeEvent.synchronize` blocks until then, bounded.
- Every :meth:`FakeEvent.synchronize` counts as a host sync of the calling thread; copies from a
  background thread outside :meth:`bound`, onto the compute stream, or into or from host memory that did
  not come from :meth:`pinned_empty` are recorded in :attr:`FakeDevice.violations`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from kvredis.vllm.staging import copy_pages_in, copy_pages_out

GARBAGE = 0xA5
SYNC_BOUND_S = 60.0  # a fake event nobody completes fails the waiting thread instead of hanging it


@dataclass(eq=False)
class FakeStream:
    name: str
    immediate: bool = False  # the compute stream: everything runs when queued
    queue: list[Any] = field(default_factory=list)  # callables, and ("wait", event) markers
    ran: int = 0  # how much of the queue has run


class FakeEvent:
    def __init__(self, device: FakeDevice, stream: FakeStream, position: int) -> None:
        self.device, self.stream, self.position = device, stream, position
        self.done = threading.Event()
        self.error: BaseException | None = None  # raised by synchronize (a failed copy before it)
        if stream.immediate:
            self.done.set()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.device.syncs[threading.current_thread().name] += 1
        if self.device.auto:
            self.device.complete(self)
        if not self.done.wait(SYNC_BOUND_S):
            raise TimeoutError(f"fake event on {self.stream.name} was never completed")
        if self.error is not None:
            raise self.error

    def __repr__(self) -> str:
        return f"<event {self.stream.name}@{self.position}{' done' if self.query() else ''}>"


class FakeDevice:
    """See the module docstring. ``log`` holds ``(operation, stream name, detail)`` in call order."""

    def __init__(self, auto: bool = False) -> None:
        self.auto = auto
        self.compute = FakeStream("compute", immediate=True)
        self.streams: list[FakeStream] = []
        self.events: list[FakeEvent] = []
        self.log: list[tuple[str, str, Any]] = []
        self.syncs: Counter[str] = Counter()
        self.violations: list[str] = []
        self.fail_copies: BaseException | None = None  # raised by the next host-to-device copy queued
        self.fail_events: BaseException | None = None  # raised by synchronize on the next side event
        self._pinned: list[tuple[int, int]] = []
        self._held: list[torch.Tensor] = []  # pinned tensors stay alive: their addresses are never reused
        self._lock = threading.RLock()
        self._bound = threading.local()
        self._main = threading.main_thread()

    # -- what the test looks at ---------------------------------------------------------------------

    def events_on(self, stream: FakeStream) -> list[FakeEvent]:
        with self._lock:
            return [event for event in self.events if event.stream is stream]

    def ops(self, operation: str, stream: FakeStream | None = None) -> list[tuple[str, str, Any]]:
        with self._lock:
            return [entry for entry in self.log
                    if entry[0] == operation and (stream is None or entry[1] == stream.name)]

    def wait_for_events(self, stream: FakeStream, count: int, timeout_s: float) -> list[FakeEvent]:
        """Until ``count`` events were recorded on ``stream`` (by a background thread, say)."""
        deadline = time.monotonic() + timeout_s
        while len(events := self.events_on(stream)) < count:
            assert time.monotonic() < deadline, f"{stream.name} never got {count} events: {self.log}"
            time.sleep(0.002)
        return events

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        with self._lock:
            return any(low <= start and end <= high for low, high in self._pinned)

    def complete(self, event: FakeEvent) -> None:
        """Run the event's stream up to the event, then mark every event up to it done."""
        with self._lock:
            stream = event.stream
            while stream.ran < event.position:
                item = stream.queue[stream.ran]
                if isinstance(item, tuple):
                    awaited = item[1]
                    assert awaited.query(), f"{stream.name} reached a wait for {awaited}, not completed yet"
                else:
                    item()
                stream.ran += 1
            for other in self.events:
                if other.stream is stream and other.position <= event.position and not other.query():
                    other.done.set()

    # -- the Device protocol ------------------------------------------------------------------------

    def _check(self, operation: str, stream: FakeStream) -> None:
        thread = threading.current_thread()
        if thread is not self._main and not getattr(self._bound, "on", False):
            self.violations.append(f"{operation} from {thread.name}, not bound to the device")
        if stream is self.compute and thread is not self._main:
            self.violations.append(f"{operation} on the compute stream from {thread.name}")
        if stream.name == "legacy":
            self.violations.append(f"{operation} on a background thread's default stream")

    def current_stream(self) -> FakeStream:
        if threading.current_thread() is self._main:
            return self.compute
        return FakeStream("legacy", immediate=True)  # a thread's own: nothing may be queued on it

    def new_stream(self) -> FakeStream:
        with self._lock:
            stream = FakeStream(f"side{len(self.streams)}")
            self.streams.append(stream)
            return stream

    def record_event(self, stream: FakeStream) -> FakeEvent:
        with self._lock:
            self._check("record", stream)
            event = FakeEvent(self, stream, len(stream.queue))
            if not stream.immediate and self.fail_events is not None:
                event.error, self.fail_events = self.fail_events, None
            self.events.append(event)
            self.log.append(("record", stream.name, event))
            return event

    def wait_event(self, stream: FakeStream, event: Any) -> None:
        with self._lock:
            self._check("wait", stream)
            self.log.append(("wait", stream.name, event))
            if not stream.immediate:
                stream.queue.append(("wait", event))

    def pinned_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.empty(tuple(shape), dtype=dtype)
        tensor.view(-1).view(torch.uint8).fill_(GARBAGE)
        with self._lock:
            start = tensor.data_ptr()
            self._pinned.append((start, start + tensor.numel() * tensor.element_size()))
            self._held.append(tensor)
            self.log.append(("pinned", "", tuple(shape)))
        return tensor

    def upload_index(self, stream: FakeStream, index: torch.Tensor) -> torch.Tensor:
        with self._lock:
            self._check("upload", stream)
            self.log.append(("upload", stream.name, index.tolist()))
            return index.clone()

    def gather_to_host(self, stream: FakeStream, layer: torch.Tensor, index: torch.Tensor,
                       out: torch.Tensor) -> None:
        with self._lock:
            self._check("gather", stream)
            if not self.is_pinned(out):
                self.violations.append("a device-to-host copy into pageable memory")
            gathered = torch.empty_like(out)
            copy_pages_out(layer, index, gathered)  # the pages as the side stream reads them, now
            self.log.append(("gather", stream.name, index.tolist()))
            self._queue(stream, lambda: out.copy_(gathered))

    def scatter_from_host(self, stream: FakeStream, layer: torch.Tensor, index: torch.Tensor,
                          pages: torch.Tensor) -> None:
        with self._lock:
            self._check("scatter", stream)
            if self.fail_copies is not None:
                error, self.fail_copies = self.fail_copies, None
                raise error
            if not self.is_pinned(pages):
                self.violations.append("a host-to-device copy from pageable memory")
            if tuple(pages.shape) != (index.numel(), *layer.shape[1:]):
                raise ValueError(f"cannot write {tuple(pages.shape)} into {tuple(layer.shape)}")
            self.log.append(("scatter", stream.name, index.tolist()))
            self._queue(stream, lambda: copy_pages_in(layer, index, pages))

    def _queue(self, stream: FakeStream, operation: Callable[[], Any]) -> None:
        if stream.immediate:
            operation()
        else:
            stream.queue.append(operation)

    @contextmanager
    def bound(self) -> Iterator[None]:
        previous = getattr(self._bound, "on", False)
        self._bound.on = True
        try:
            yield
        finally:
            self._bound.on = previous
