#!/usr/bin/env python
"""The scheduler's lookup of a prompt's stored chunks, against the same EXISTS commands on a raw socket.

vLLM's scheduler asks the connector, for every request without an announcement, how many of its tokens Redis
holds: kvredis hashes the prompt's chunk chain and asks which chunks exist, in one round trip. This times
that call (``ChunkPlan.of`` + ``ChunkStore.stored_prefix`` on the lookup client) for prompts of 1 and 1,000
tokens and more, with a store of ``--stored`` chunks (of ``--chunk-tokens``, the default's), and the same
EXISTS commands pre-encoded and sent on a raw socket to the same Redis (the round trip's floor), and prints
the medians and their ratio; and the same lookup as vLLM's scheduler waits for it: handed to a thread of its
own (the connector's lookup thread) and waited for.

    python scripts/bench_lookup.py                      # a redis-server of its own on a free port
    python scripts/bench_lookup.py --url redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from kvredis.config import KVRedisConfig  # noqa: E402
from kvredis.store.chunk_keys import ChunkPlan  # noqa: E402
from kvredis.store.chunk_store import ChunkStore  # noqa: E402
from kvredis.store.client import RedisStore  # noqa: E402
from kvredis.store.resp import frame  # noqa: E402

BLOCK_SIZE = 16


def raw_exists(sock: socket.socket, commands: bytes, replies: int) -> None:
    """Send pre-encoded EXISTS commands and read their integer replies (``:0\\r\\n`` or ``:1\\r\\n``)."""
    sock.sendall(commands)
    want, got = 4 * replies, b""
    while len(got) < want:
        chunk = sock.recv(want - len(got))
        if not chunk:
            raise ConnectionError("Redis closed the connection")
        got += chunk


def median_us(samples: list[float]) -> float:
    return 1e6 * statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a Redis of yours (default: start one on a free port)")
    parser.add_argument("--stored", type=int, default=10_000, help="chunks in the store (default 10,000)")
    parser.add_argument("--repeat", type=int, default=2000)
    parser.add_argument("--chunk-tokens", type=int, default=KVRedisConfig().chunk_tokens)
    args = parser.parse_args()

    with own_redis(args.url) as url:
        return measure(url, args)


@contextlib.contextmanager
def own_redis(url: str | None, malloc_conf: str | None = None) -> Iterator[str]:
    """``url``, or a redis-server of our own on a free port (no persistence), stopped afterwards; its
    jemalloc configured with ``malloc_conf`` (``MALLOC_CONF`` for a system jemalloc, ``JE_MALLOC_CONF`` for
    the one Redis bundles) if given."""
    if url is not None:
        yield url
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = None if malloc_conf is None else {**os.environ, "MALLOC_CONF": malloc_conf,
                                            "JE_MALLOC_CONF": malloc_conf}
    server = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
                               "--dir", tempfile.mkdtemp()], stdout=subprocess.DEVNULL, env=env)
    try:
        for _ in range(100):
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait(timeout=10)


def measure(url: str, args: argparse.Namespace) -> int:
    chunk_tokens = args.chunk_tokens
    config = KVRedisConfig.from_env({}, {"url": url, "namespace": "bench-lookup"})
    store = RedisStore(config)
    chunks = ChunkStore(store, "bench-lookup:0123456789abcdef", ttl_ms=600_000, block_size=BLOCK_SIZE,
                        max_chunk_bytes=1 << 20)
    try:
        # The store: --stored chunks of other prompts (1 KiB each), then the prompts looked up.
        filler = ChunkPlan.of(list(range(args.stored * chunk_tokens)), chunk_tokens)
        pages = torch.zeros(1, chunk_tokens // BLOCK_SIZE, 1, BLOCK_SIZE, 1)
        for start in range(0, args.stored, 500):
            chunks.write(filler, [(i, pages) for i in range(start, min(start + 500, args.stored))])
        parts = urlsplit(url)
        sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        print(f"lookup of a prompt's chunks ({chunk_tokens} tokens each), {args.stored:,} chunks stored, "
              f"median of {args.repeat}:")
        print(f"  {'tokens':>7} {'chunks':>6} {'kvredis µs':>11} {'hash µs':>8} {'raw EXISTS µs':>14} "
              f"{'ratio':>6} {'on its thread µs':>17}")
        thread = ThreadPoolExecutor(max_workers=1)

        def look_up(tokens: list[int]) -> int:
            return chunks.stored_prefix(ChunkPlan.of(tokens, chunk_tokens).digests)

        for length in (1, 1000, 8000, 32000):
            tokens = list(range(7, 7 + length))
            stored = ChunkPlan.of(tokens, chunk_tokens)
            half = stored.num_chunks // 2
            chunks.write(stored, [(i, pages[:, :-(-(stored.span(i)[1] - stored.span(i)[0]) // BLOCK_SIZE)])
                                  for i in range(max(half, 1))])
            commands = b"".join(bytes(part) for d in stored.digests
                                for part in frame(b"EXISTS", chunks.keys.chunk(d).encode()))
            timed, hashed, raw, threaded = [], [], [], []
            for _ in range(args.repeat):
                started = time.perf_counter()
                plan = ChunkPlan.of(tokens, chunk_tokens)
                digests = plan.digests
                middle = time.perf_counter()
                found = chunks.stored_prefix(digests)
                timed.append(time.perf_counter() - started)
                hashed.append(middle - started)
                started = time.perf_counter()
                raw_exists(sock, commands, len(digests))
                raw.append(time.perf_counter() - started)
                started = time.perf_counter()
                thread.submit(look_up, tokens).result()
                threaded.append(time.perf_counter() - started)
            assert found == max(half, 1), (found, half)
            ratio = statistics.median(timed) / statistics.median(raw)
            print(f"  {length:>7,} {stored.num_chunks:>6} {median_us(timed):>11.1f} "
                  f"{median_us(hashed):>8.1f} {median_us(raw):>14.1f} {ratio:>6.2f} "
                  f"{median_us(threaded):>17.1f}")
        sock.close()
        thread.shutdown()
    finally:
        store.delete(list(store.scan("bench-lookup:*")))
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
