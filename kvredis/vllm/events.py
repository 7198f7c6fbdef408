"""KV events for routers: the blocks an engine stored in Redis (``BlockStored``) and those a reset dropped
(``BlockRemoved``), with the tier named (``medium`` :data:`MEDIUM`, ``locality`` ``"REMOTE"``), published by
vLLM's ZMQ publisher (``--kv-events-config``) beside the engine's own GPU blocks.

The scheduler knows a request's vLLM block hashes, the worker knows when its chunks are stored: each writer
rank reports its saves' outcome (:class:`StoreReports`, through ``get_kv_connector_kv_cache_events``, which
vLLM 0.32-0.34 hand to the scheduler's ``update_connector_output``); once every writer rank stored a prompt,
the scheduler publishes its full blocks (``take_events``). A block is published as stored in Redis only after
it is there; one whose save failed is not published.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents

MEDIUM = "REDIS"
"""The tier a kvredis event names (vLLM's own are ``"GPU"``, ``"CPU"``, ``"STORAGE"``)."""
LOCALITY = "REMOTE"
"""Relative to the publishing engine: Redis is shared by every engine of the namespace."""
_REMEMBERED = 100_000
"""Block hashes a scheduler remembers having published as stored (about 5 MB), to publish their removal at a
reset; older ones are forgotten (routers age entries out too)."""
_UNCONFIRMED = 4096
"""Saves a scheduler waits for its writers to report, at most (one whose report never comes is dropped)."""


class StoreReports(KVConnectorKVEvents):
    """What a worker tells the scheduler of its saves since the last step: ``(request id, stored)`` pairs.

    vLLM ships it as a step's ``kv_cache_events`` and, with several workers, joins theirs (``add_events``);
    the scheduler turns the reports into vLLM events (:class:`StoredBlocks`)."""

    def __init__(self, reports: list[tuple[str, bool]] | None = None, workers: int = 1) -> None:
        self.reports = list(reports or ())
        self.workers = workers

    def add_events(self, events: list[Any]) -> None:
        self.reports.extend(events)

    def aggregate(self) -> StoreReports:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self) -> list[Any]:
        return list(self.reports)

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.reports.clear()


class Outcomes:
    """A worker's save outcomes not yet reported (thread-safe: writer threads add, the step takes)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._reports: list[tuple[str, bool]] = []
        self._lock = threading.Lock()

    def add(self, req_id: str, stored: bool) -> None:
        """One save's outcome (nothing is kept unless KV events are on)."""
        if self.enabled:
            with self._lock:
                self._reports.append((req_id, stored))

    def take(self) -> StoreReports | None:
        with self._lock:
            reports, self._reports = self._reports, []
        return StoreReports(reports) if reports else None


@dataclass
class _Pending:
    event: BlockStored
    writers_left: int


class StoredBlocks:
    """The scheduler's side: saves waiting for their writers' reports, the events ready for vLLM's publisher,
    and the block hashes published as stored in the current cache generation."""

    def __init__(self, writers: int) -> None:
        self._writers = writers
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._published: OrderedDict[Any, None] = OrderedDict()
        self._ready: list[KVCacheEvent] = []
        self._lock = threading.Lock()  # the lookup thread drops blocks when it learns of a reset

    def expect(self, request: Any, num_tokens: int, block_size: int) -> None:
        """A save handed to the workers now: the request's full blocks of its first ``num_tokens`` positions
        (its vLLM block hashes) are published once every writer rank stored them."""
        event = block_stored(request, num_tokens, block_size)
        if event is None:
            return
        with self._lock:
            self._pending[request.request_id] = _Pending(event, self._writers)
            while len(self._pending) > _UNCONFIRMED:
                self._pending.popitem(last=False)

    def report(self, reports: StoreReports) -> None:
        """The workers' outcomes: a save every writer stored becomes a ``BlockStored`` event."""
        with self._lock:
            for req_id, stored in reports.reports:
                pending = self._pending.get(req_id)
                if pending is None:
                    continue
                if not stored:
                    del self._pending[req_id]
                    continue
                pending.writers_left -= 1
                if pending.writers_left <= 0:
                    del self._pending[req_id]
                    self._ready.append(pending.event)
                    for block_hash in pending.event.block_hashes:
                        self._published[block_hash] = None
                        self._published.move_to_end(block_hash)
                    while len(self._published) > _REMEMBERED:
                        self._published.popitem(last=False)

    def dropped(self) -> None:
        """A reset (this engine's or another's, learned now): every block published as stored is gone from
        the namespace; saves still in flight are in the old generation, so never published."""
        with self._lock:
            self._pending.clear()
            if self._published:
                self._ready.append(BlockRemoved(block_hashes=list(self._published), medium=MEDIUM,
                                                locality=LOCALITY))
            self._published.clear()

    def take(self) -> list[KVCacheEvent]:
        with self._lock:
            ready, self._ready = self._ready, []
        return ready


def block_stored(request: Any, num_tokens: int, block_size: int) -> BlockStored | None:
    """vLLM's ``BlockStored`` event for the full blocks of the request's first ``num_tokens`` positions, as
    its block pool builds one for the GPU (``None`` if there is no full block, or vLLM hashed none)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    hashes = list(getattr(request, "block_hashes", None) or ())[:num_tokens // block_size]
    if not hashes:
        return None
    tokens = list(request.all_token_ids[:len(hashes) * block_size])
    lora = getattr(request, "lora_request", None)
    return BlockStored(
        block_hashes=[maybe_convert_block_hash(h) for h in hashes], parent_block_hash=None,
        token_ids=tokens, block_size=block_size,
        lora_id=lora.adapter_id if lora is not None else None, medium=MEDIUM,
        lora_name=lora.name if lora is not None else None, extra_keys=_extra_keys(request, len(hashes),
                                                                                  block_size),
        locality=LOCALITY)


def _extra_keys(request: Any, blocks: int, block_size: int) -> list[Any] | None:
    """Each block's extra keys (LoRA name, images, salt), as vLLM publishes them for its own blocks."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

    keys = []
    index = 0
    for block in range(blocks):
        extra, index = generate_block_hash_extra_keys(request, block * block_size, (block + 1) * block_size,
                                                      index)
        keys.append(extra)
    return to_event_extra_keys(keys)
