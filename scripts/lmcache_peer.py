#!/usr/bin/env python
"""LMCache's native C++ RESP client (``lmcache.lmcache_redis.LMCacheRedisClient``, from LMCache's wheel)
moving the same bytes through the same Redis as kvredis, for ``scripts/bench_chunks.py --peer``. Not part of
kvredis: it runs in an environment of its own (scripts/install_lmcache_peer.sh), and prints one JSON object.

For each value size and worker count: SET every value of ``--total`` bytes of pages (bfloat16, seeded), then
GET them all back into preallocated buffers (the client's one way to read), checked bit for bit; the median
of ``--repeat`` times of each half.

    python scripts/lmcache_peer.py --url redis://127.0.0.1:6379/0 --sizes 4MiB,32MiB --workers 1,2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import statistics
import sys
import time
import uuid
from typing import Any
from urllib.parse import urlparse

import torch
from lmcache.lmcache_redis import LMCacheRedisClient  # type: ignore[import-not-found]

_WAIT_S = 120.0


def _size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(text[:-len(unit)]) * factor
    return int(text)


class Peer:
    """The native client used synchronously: submit a batch, wait on its eventfd for its completion."""

    def __init__(self, host: str, port: int, workers: int) -> None:
        self.client = LMCacheRedisClient(host, port, workers, "", "")
        self.fd = int(self.client.event_fd())

    def _wait(self, future: int) -> None:
        deadline = time.monotonic() + _WAIT_S
        while True:
            for fid, ok, error, _ in self.client.drain_completions() or ():
                if int(fid) == future:
                    if not ok:
                        raise RuntimeError(f"LMCache's client failed: {error}")
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("LMCache's client did not complete a batch")
            select.select([self.fd], [], [], left)
            with contextlib.suppress(BlockingIOError):
                os.read(self.fd, 8)

    def set(self, keys: list[str], buffers: list[memoryview]) -> None:
        self._wait(int(self.client.submit_batch_set(keys, buffers)))

    def get(self, keys: list[str], buffers: list[memoryview]) -> None:
        self._wait(int(self.client.submit_batch_get(keys, buffers)))

    def delete(self, keys: list[str]) -> None:
        self._wait(int(self.client.submit_batch_delete(keys)))

    def close(self) -> None:
        self.client.close()


def measure(url: str, total: int, size: int, workers: int, repeat: int) -> dict[str, Any]:
    where = urlparse(url)
    peer = Peer(where.hostname or "127.0.0.1", where.port or 6379, workers)
    try:
        data = torch.randn(total // 2, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        source = data.view(torch.uint8).numpy().data.cast("B")
        out = torch.empty_like(data)
        target = out.view(torch.uint8).numpy().data.cast("B")
        count = total // size
        prefix = "lmcache-peer-" + uuid.uuid4().hex[:8]
        keys = [f"{prefix}:{i}" for i in range(count)]
        sources = [source[i * size:(i + 1) * size] for i in range(count)]
        targets = [target[i * size:(i + 1) * size] for i in range(count)]
        writes, reads = [], []
        for _ in range(repeat + 1):  # the first round trip warms up
            out.zero_()
            started = time.perf_counter()
            peer.set(keys, sources)
            written = time.perf_counter()
            peer.get(keys, targets)
            writes.append(written - started)
            reads.append(time.perf_counter() - written)
            if not torch.equal(out.view(torch.int16), data.view(torch.int16)):
                raise AssertionError("LMCache's client read other bytes than it wrote")
            peer.delete(keys)
        write, read = statistics.median(writes[1:]), statistics.median(reads[1:])
        return {"size": size, "workers": workers, "write_s": write, "read_s": read,
                "read_gbps": total / read / 1e9, "round_trip_gbps": total / (write + read) / 1e9}
    finally:
        peer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--total", default="128MiB")
    parser.add_argument("--sizes", default="4MiB,8MiB,32MiB")
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    total = _size(args.total)
    results = [measure(args.url, total, _size(size), int(workers), args.repeat)
               for size in args.sizes.split(",") for workers in args.workers.split(",")]
    json.dump({"total": total, "results": results}, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
