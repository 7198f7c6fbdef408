"""Releasing, on background threads, announced transfers their decode will never take, so nothing waits out
its TTL in transfer mode. Both sides use it: the scheduler for a request that ends or computes its prompt
without loading, a worker for a transfer that lands after its load gave up waiting."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from kvredis.store.transfer import Transfers
from kvredis.vllm.stats import Counts

logger = logging.getLogger("kvredis.vllm")


class Discards:
    """Releases announced transfers (one rank's shard a call), each waiting up to ``wait_s`` for the
    producer to finish writing it (it announces before its writer thread is done)."""

    def __init__(self, transfers: Transfers, counts: Counts, wait_s: float) -> None:
        self._transfers = transfers
        self._counts = counts
        self._wait_s = wait_s
        self._pool: ThreadPoolExecutor | None = None  # started at the first discard
        self._lock = threading.Lock()
        self._pending: set[Future[None]] = set()

    def submit(self, req_id: str, transfer_id: str, shard: str) -> None:
        """Release the transfer ``transfer_id`` under the key prefix ``shard``, in the background."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvredis-discard")
            future = self._pool.submit(self._discard, req_id, transfer_id, shard)
            self._pending.add(future)
        future.add_done_callback(self._forget)

    def pending(self) -> bool:
        """Whether a discard is queued or running."""
        with self._lock:
            return bool(self._pending)

    def shutdown(self) -> None:
        """Drop queued discards (their transfers expire with their TTL)."""
        with self._lock:
            pool = self._pool
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _discard(self, req_id: str, transfer_id: str, shard: str) -> None:
        try:
            released = self._transfers.discard(transfer_id, wait_s=self._wait_s, prefix=shard)
        except Exception as exc:  # a background thread: say so, or it vanishes in its future
            logger.warning("request %s: could not delete its unused transfer %s (%s); it expires with its "
                           "TTL", req_id, transfer_id, exc)
            return
        if released:
            self._counts.add(discarded_entries=1)

    def _forget(self, future: Future[None]) -> None:
        with self._lock:
            self._pending.discard(future)
