#!/usr/bin/env python
"""Where a small entry's round trip goes: the wire, or Python.

One warm process, one connection each, the same 64 KiB (``--size``) of bytes, median of ``--repeat`` blocks
of ``--calls`` round trips:

``wire kvredis``  kvredis's commands (``MULTI``/``RPUSH``/``PEXPIRE``/``EXEC``, then ``BLPOP``) as bytes
                  encoded beforehand, sent on a raw socket, replies read and not parsed: what Redis and the
                  loopback cost for kvredis's choice of commands.
``wire SET+GET``  the same for one ``SET`` and one ``GET``: the same cost for the plain commands.
``redis-py``      ``SET`` and ``GET`` through a default ``redis.Redis`` (``bench_transfer.py``'s raw-A).
``kvredis``       ``RedisLookupBuffer.insert`` then ``drop_select`` of a 1-token entry of that size.

Each client's time beyond its wire's is the Python it runs per round trip. ``bench_transfer.py`` times the
same paths in fresh alternating processes (colder, so slower); this one says which part of the gap is
whose.

    KVREDIS_URL=redis://127.0.0.1:6391/0 python scripts/bench_small.py
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable
from urllib.parse import urlparse

import redis
import torch

from kvredis.config import KVRedisConfig
from kvredis.store import resp
from kvredis.v0.buffer import RedisLookupBuffer


def command(*args: bytes | str | int) -> bytes:
    """One command's RESP bytes, encoded before the clock starts (by kvredis's encoder: Redis checks it)."""
    return b"".join(resp.frame(*args))


class Wire:
    """Pre-encoded commands on a raw socket; a reply is read as a known number of bytes."""

    def __init__(self, host: str, port: int) -> None:
        # With a timeout, a miscounted reply fails the run instead of hanging it.
        self.sock = socket.create_connection((host, port), timeout=10.0)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = memoryview(bytearray(4 << 20))

    def exchange(self, request: bytes, reply_bytes: int) -> None:
        self.sock.sendall(request)
        got = 0
        while got < reply_bytes:
            received = self.sock.recv_into(self.buffer[got:])
            if not received:
                raise ConnectionError("Redis closed the connection")
            got += received
        if got != reply_bytes or self.buffer[:1] == b"-":
            raise RuntimeError(f"Redis answered {bytes(self.buffer[:min(got, 60)])!r}..., not the "
                               f"{reply_bytes}-byte reply expected")

    def close(self) -> None:
        self.sock.close()


def timed(round_trip: Callable[[], None], calls: int, repeat: int) -> float:
    """Median ms per round trip over ``repeat`` blocks of ``calls``, after one block of warm-up."""
    for _ in range(calls):
        round_trip()
    blocks = []
    for _ in range(repeat):
        started = time.perf_counter()
        for _ in range(calls):
            round_trip()
        blocks.append((time.perf_counter() - started) / calls * 1e3)
    return statistics.median(blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=64 << 10, help="entry bytes (default 64 KiB)")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    url = os.environ.get("KVREDIS_URL", "redis://127.0.0.1:6379/0")
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379
    namespace = f"bench-small-{os.getpid()}"

    kv = torch.randn(2, args.size // 4).to(torch.bfloat16)  # key and value, args.size bytes in all
    data = kv.view(torch.uint8).numpy().tobytes()
    tokens = torch.tensor([1000], dtype=torch.int64)
    queue, key = f"{namespace}:q", f"{namespace}:k"

    wire = Wire(host, port)
    record = data + bytes(256)  # the header and padding kvredis adds to a 64 KiB record, about
    push = (command("MULTI") + command("RPUSH", queue, record) + command("PEXPIRE", queue, 60000)
            + command("EXEC"))
    push_reply = len(b"+OK\r\n+QUEUED\r\n+QUEUED\r\n*2\r\n:1\r\n:1\r\n")
    pop = command("BLPOP", queue, "5.000")
    framing = b"*2\r\n$%d\r\n%b\r\n$%d\r\n\r\n" % (len(queue), queue.encode(), len(record))
    pop_reply = len(framing) + len(record)
    put, get = command("SET", key, data), command("GET", key)
    get_reply = len(b"$%d\r\n\r\n" % len(data)) + len(data)

    def wire_kvredis() -> None:
        wire.exchange(push, push_reply)
        wire.exchange(pop, pop_reply)

    def wire_set_get() -> None:
        wire.exchange(put, 5)
        wire.exchange(get, get_reply)

    client = redis.Redis.from_url(url)
    view = memoryview(data)

    def redis_py() -> None:
        client.set(key, view)
        assert client.get(key) is not None

    buffer = RedisLookupBuffer(KVRedisConfig.from_env(overrides={"url": url, "namespace": namespace}))

    def kvredis() -> None:
        buffer.insert(tokens, None, kv[0], kv[1], None)
        assert buffer.drop_select(tokens, None)[2] is not None

    try:
        results = {name: timed(run, args.calls, args.repeat) for name, run in (
            ("wire kvredis", wire_kvredis), ("wire SET+GET", wire_set_get), ("redis-py", redis_py),
            ("kvredis", kvredis))}
    finally:
        client.delete(key, queue)
        buffer.close()
        client.close()
        wire.close()
    print(f"{args.size} bytes, median ms per round trip ({args.repeat} x {args.calls}, one warm process)")
    for name, ms in results.items():
        print(f"  {name:14s} {ms:7.3f} ms")
    wire_ratio = results["wire kvredis"] / results["wire SET+GET"]
    print(f"  wire: kvredis's commands cost {wire_ratio:.2f}x SET+GET's")
    python_kv = results["kvredis"] - results["wire kvredis"]
    python_py = results["redis-py"] - results["wire SET+GET"]
    print(f"  Python per round trip: kvredis {python_kv:.3f} ms, redis-py {python_py:.3f} ms "
          f"({python_kv / python_py:.2f}x)")
    print(f"  kvredis / redis-py: {results['kvredis'] / results['redis-py']:.2f}x (target 1.5x, measured by "
          f"bench_transfer.py in fresh processes)")


if __name__ == "__main__":
    main()
