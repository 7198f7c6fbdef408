#!/usr/bin/env python
"""Benchmark moving one vLLM KV-cache entry through Redis: kvredis against the plain ways of doing it.

For each size, a bf16 entry shaped like a real one (key and value tensors ``[layers, tokens, kv_heads,
head_dim]`` of a Llama-3-8B-sized model: 32 layers, 8 KV heads, head dim 128, i.e. 128 KiB per token;
entries under one token keep 1 token and fewer layers) goes through five paths against the same Redis:

``kvredis``  ``RedisLookupBuffer.insert`` then ``drop_select`` (fresh namespace per run), bit-identical.
``naive``    ``.tobytes()`` of key and value in a msgpack ``{dtype, shape, data}`` dict, one SET and one GET
             with a default ``redis.Redis`` (hiredis), msgpack-unpack and ``torch.frombuffer`` back.
``raw-A``    one SET + GET of the same bytes as one key, default client (reference, no tensor rebuilt).
``raw-B``    the same bytes in 1 MiB pieces, SETs pipelined in one batch, GETs 4 at a time (~4 MiB in
             flight), Python command packer with memoryview values, replies copied into one output
             tensor: the best plain redis-py set-up.
``memcpy``   ``copy_`` into an already-touched preallocated buffer, one thread (the floor).

Each path's writer and reader run in their own fresh process (multiprocessing ``forkserver``, preloaded
with torch and redis so that starting one is cheap). Extra peak memory of a phase is
``ru_maxrss`` after it minus ``ru_maxrss`` right before it, in the same process, with the input tensor
already allocated and touched; before each phase the process's high-water mark is reset to its current
RSS (``/proc/self/clear_refs``, Linux), so an earlier peak cannot hide the phase's. The reader's output
tensor counts as extra. Times are the median over ``--repeat`` runs (best also shown); round-trip MB/s is
key+value bytes (10^6 B/s) over write + read time.

    python scripts/bench_transfer.py                       # 64KiB,1MiB,16MiB,128MiB
    python scripts/bench_transfer.py --large --json out.json
    python scripts/bench_transfer.py --sweep-only          # piece size x in-flight bytes at 128 MiB
    python scripts/bench_transfer.py --phases              # where kvredis spends its time, per phase
    python scripts/bench_transfer.py --device cuda         # the entry on the GPU (kvredis and memcpy only)

With ``--device cuda`` the entry lives on the GPU, as a V1 connector's pages do: ``kvredis``'s writer
copies it into pinned host memory (``non_blocking``, then waits for the stream) and inserts that, and its
reader receives into pinned memory (``take(allocate=...)``) and copies the tensors to the GPU; ``memcpy``
becomes a device-to-host-to-device copy through a preallocated pinned buffer. The other paths and the
targets are the CPU path's, so they are left out.

Beside the paths, the scheduler's lookup (``RedisLookupBuffer.contains`` of a 1- and a 1000-token prompt,
each measured as a phase of its own in a fresh process) is timed against its 0.2 ms target.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import multiprocessing as mp
import os
import platform
import re
import resource
import statistics
import sys
import time
import traceback
import uuid
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

LAYERS, KV_HEADS, HEAD_DIM, ELEMENT = 32, 8, 128, 2  # Llama-3-8B-sized KV cache, bf16
TOKEN_BYTES = 2 * LAYERS * KV_HEADS * HEAD_DIM * ELEMENT  # key + value bytes per token: 128 KiB
LAYER_TOKEN_BYTES = 2 * KV_HEADS * HEAD_DIM * ELEMENT  # key + value bytes per token per layer: 4 KiB
PATHS = ("kvredis", "raw-socket", "naive", "raw-A", "raw-B", "memcpy")
CUDA_PATHS = ("kvredis", "memcpy")  # the paths --device cuda runs
DEVICE_ENV = "KVREDIS_BENCH_DEVICE"  # how a worker process learns the entry's device
DEFAULT_SIZES = "64KiB,1MiB,16MiB,128MiB"
REDIS_MAX_BULK = 512 << 20  # proto-max-bulk-len's default: one value cannot be larger
RAW_B_PIECE = 1 << 20
RAW_B_INFLIGHT = 4 << 20
RAW_WRITE_DEPTH, RAW_READ_DEPTH = 16, 4  # raw-socket: SETs unanswered, GETDELs requested ahead
LOOKUP_TOKENS = (1, 1000)  # prompt lengths of the scheduler's lookup: a token, and a long prompt
LOOKUP_TARGET_S = 0.2e-3  # issue 13: the median lookup under 0.2 ms
SWEEP_CHUNKS = ("256KiB", "1MiB", "4MiB")
SWEEP_INFLIGHT = ("1MiB", "4MiB", "16MiB")
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMG]?)i?B?\s*$", re.IGNORECASE)
_PRELOAD = ["torch", "numpy", "msgpack", "redis", "hiredis", "kvredis.v0.buffer", "kvredis.store.client",
            "kvredis.store.codec"]


# -- sizes and tensors ---------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    match = _SIZE_RE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 64KiB, 1MiB, 1GiB)")
    return int(match.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[match.group(2).upper()]


def fmt_size(n: int) -> str:
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def kv_shape(nbytes: int) -> tuple[int, int]:
    """(layers, tokens) of a key+value pair of ``nbytes`` (32 layers when at least one token fits)."""
    if nbytes >= TOKEN_BYTES:
        if nbytes % TOKEN_BYTES:
            raise SystemExit(f"{fmt_size(nbytes)} is not a whole number of {TOKEN_BYTES}-byte tokens")
        return LAYERS, nbytes // TOKEN_BYTES
    if nbytes % LAYER_TOKEN_BYTES or nbytes < LAYER_TOKEN_BYTES:
        raise SystemExit(f"{fmt_size(nbytes)} is not a whole number of {LAYER_TOKEN_BYTES}-byte layers")
    return nbytes // LAYER_TOKEN_BYTES, 1


def make_kv(nbytes: int, seed: int) -> Any:
    """A stacked ``[2, layers, tokens, heads, dim]`` bf16 tensor of normal values, filled in place."""
    import torch

    layers, tokens = kv_shape(nbytes)
    kv = torch.empty(2, layers, tokens, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    kv.normal_(generator=torch.Generator().manual_seed(seed))
    return kv


def flat_bytes(tensor: Any) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
    import torch

    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def bit_equal(a: Any, b: Any) -> bool:
    import torch

    return (a is not None and a.shape == b.shape and a.dtype == b.dtype
            and bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))))


# -- peak memory -------------------------------------------------------------------------------------


def _reset_peak() -> bool:
    """Reset this process's RSS high-water mark (hence ru_maxrss) to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _rss() -> int:
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


@contextmanager
def measured(record: dict[str, Any], wake: Callable[[], None]) -> Iterator[None]:
    """Time the block and record its extra peak memory (ru_maxrss after minus right before).

    ``wake`` (a PING) runs right before the clock starts: an idle core here takes ~0.4 ms to wake, which
    would otherwise land on whichever command comes first. The garbage collector is off in the measuring
    processes and runs after each phase (in the worker), not right before one: a full collection walks
    the whole heap (torch's objects included) and would leave every path's next phase with cold caches,
    which no transfer in a serving process sees.
    """
    record["peak_reset"] = _reset_peak()
    before = _maxrss()
    record["rss_before"] = _rss()
    wake()
    start = time.perf_counter()
    yield
    record["seconds"] = time.perf_counter() - start
    record["extra_bytes"] = max(0, _maxrss() - before)


# -- the paths ---------------------------------------------------------------------------------------


class Path:
    """One way of moving the entry: ``run`` is the timed phase; the rest is set-up and clean-up."""

    warm_up = True  # whether a 4 KiB round trip through the same clients comes before measuring

    def __init__(self, role: str, kv: Any, url: str, env: dict[str, str]) -> None:
        self.role, self.kv, self.url, self.env = role, kv, url, env

    def prepare(self, tag: str) -> None: ...

    def wake(self) -> None: ...

    def run(self, tag: str) -> Any: ...

    def verify(self, result: Any) -> bool:
        return True

    def finish(self, tag: str) -> None: ...

    def close(self) -> None: ...


class KVRedisPath(Path):
    """One long-lived buffer per process, as in a vLLM worker, in a namespace fresh for this run."""

    def prepare(self, tag: str) -> None:
        import torch

        from kvredis.config import KVRedisConfig
        from kvredis.v0.buffer import RedisLookupBuffer

        if not hasattr(self, "buffer"):
            namespace = tag.rsplit("-", 1)[0]  # the tag without its round-trip number
            config = KVRedisConfig.from_env(overrides={"url": self.url, "namespace": namespace})
            self.buffer = RedisLookupBuffer(config)
        self.tokens = torch.arange(kv_shape(self.kv.numel() * ELEMENT)[1], dtype=torch.int64) + 1000

    def wake(self) -> None:
        self.buffer.store.ping()  # the connections entries move over, outside the timed phase

    def run(self, tag: str) -> Any:
        if self.kv.is_cuda:
            return self._run_cuda()
        if self.role == "write":
            return self.buffer.insert(self.tokens, None, self.kv[0], self.kv[1], None)
        return self.buffer.drop_select(self.tokens, None)

    def _run_cuda(self) -> Any:
        """The GPU entry staged through pinned host memory each way, as the V1 connector does."""
        import torch

        stream = torch.cuda.current_stream()
        if self.role == "write":
            host = torch.empty(self.kv.shape, dtype=self.kv.dtype, pin_memory=True)
            host.copy_(self.kv, non_blocking=True)
            stream.synchronize()
            return self.buffer.insert(self.tokens, None, host[0], host[1], None)
        entry, _ = self.buffer.take(self.tokens, None,
                                    allocate=lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
        if entry is None:
            return [None] * 5
        key, value = (tensor.to(self.kv.device, non_blocking=True) for tensor in entry[2:4])
        stream.synchronize()
        return [entry[0], entry[1], key, value, None]

    def verify(self, result: Any) -> bool:
        if self.role == "write":
            return True
        return bit_equal(result[2], self.kv[0]) and bit_equal(result[3], self.kv[1])

    def close(self) -> None:
        if hasattr(self, "buffer"):
            self.buffer.close()


class NaivePath(Path):
    def prepare(self, tag: str) -> None:
        import redis

        if not hasattr(self, "client"):
            self.client = redis.Redis.from_url(self.url)

    def wake(self) -> None:
        self.client.ping()

    def run(self, tag: str) -> Any:
        import msgpack
        import torch

        if self.role == "write":
            blob = msgpack.packb({
                name: {"dtype": "bfloat16", "shape": list(t.shape),
                       "data": t.view(torch.uint8).numpy().tobytes()}
                for name, t in (("key", self.kv[0]), ("value", self.kv[1]))
            })
            self.client.set(tag, blob)
            return None
        blob = self.client.get(tag)
        entry = msgpack.unpackb(blob)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer over read-only bytes
            return [torch.frombuffer(entry[n]["data"], dtype=torch.bfloat16).reshape(entry[n]["shape"])
                    for n in ("key", "value")]

    def verify(self, result: Any) -> bool:
        return self.role == "write" or (bit_equal(result[0], self.kv[0]) and bit_equal(result[1], self.kv[1]))

    def finish(self, tag: str) -> None:
        if self.role == "read":
            self.client.delete(tag)

    def close(self) -> None:
        if hasattr(self, "client"):
            self.client.close()


class RawAPath(NaivePath):
    def run(self, tag: str) -> Any:
        if self.role == "write":
            self.client.set(tag, flat_bytes(self.kv))
            return None
        return self.client.get(tag)

    def verify(self, result: Any) -> bool:
        import numpy as np

        return self.role == "write" or np.array_equal(np.frombuffer(result, dtype=np.uint8),
                                                      np.asarray(flat_bytes(self.kv)))


class RawBPath(Path):
    def wake(self) -> None:
        self.client.ping()

    def prepare(self, tag: str) -> None:
        import redis
        from redis.connection import Encoder, PythonRespSerializer

        if not hasattr(self, "client"):
            packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
            self.pool = redis.ConnectionPool.from_url(self.url, command_packer=packer)
            self.client = redis.Redis(connection_pool=self.pool)
        total = self.kv.numel() * ELEMENT
        self.keys = [f"{tag}:{i}" for i in range(-(-total // RAW_B_PIECE))]

    def run(self, tag: str) -> Any:
        import torch

        data = flat_bytes(self.kv)
        if self.role == "write":
            pipe = self.client.pipeline(transaction=False)
            for i, key in enumerate(self.keys):
                pipe.set(key, data[i * RAW_B_PIECE:(i + 1) * RAW_B_PIECE])
            pipe.execute()
            return None
        out = torch.empty(data.nbytes, dtype=torch.uint8)
        view = memoryview(out.numpy()).cast("B")
        per_batch = max(1, RAW_B_INFLIGHT // RAW_B_PIECE)
        position = 0
        for start in range(0, len(self.keys), per_batch):
            pipe = self.client.pipeline(transaction=False)
            for key in self.keys[start:start + per_batch]:
                pipe.get(key)
            for value in pipe.execute():
                view[position:position + len(value)] = value
                position += len(value)
        return out.view(torch.bfloat16).reshape(self.kv.shape)

    def verify(self, result: Any) -> bool:
        return self.role == "write" or bit_equal(result, self.kv)

    def finish(self, tag: str) -> None:
        if self.role == "read":
            self.client.delete(*self.keys)

    def close(self) -> None:
        if hasattr(self, "client"):
            self.client.close()
            self.pool.disconnect()


class MemcpyPath(Path):
    warm_up = False

    def __init__(self, *args: Any) -> None:
        import torch

        super().__init__(*args)
        torch.set_num_threads(1)
        self.out = torch.empty_like(self.kv)
        self.out.view(torch.uint8).fill_(0)  # touch every page before the phase
        if self.kv.is_cuda:  # device to host to device, through a pinned buffer like kvredis's
            self.host = torch.empty(self.kv.shape, dtype=self.kv.dtype, pin_memory=True)
            self.host.view(torch.uint8).fill_(0)

    def run(self, tag: str) -> Any:
        if self.kv.is_cuda:
            import torch

            self.host.copy_(self.kv, non_blocking=True)
            self.out.copy_(self.host, non_blocking=True)  # same stream: after the first copy
            torch.cuda.current_stream().synchronize()
            return self.out
        return self.out.copy_(self.kv)

    def verify(self, result: Any) -> bool:
        return bit_equal(result, self.kv)


class MiniResp:
    """A ~50-line RESP client over a raw socket: the wire's reference, independent of kvredis's code."""

    def __init__(self, url: str) -> None:
        import socket
        from urllib.parse import urlparse

        parsed = urlparse(url)
        self.sock = socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 6379))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(1 << 16)
        self.start = self.end = 0
        db = (parsed.path or "/0").strip("/") or "0"
        if db != "0":
            self.command(b"SELECT", db.encode())

    def _fill(self) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        n = self.sock.recv_into(memoryview(self.buf)[self.end:])
        if not n:
            raise ConnectionError("closed")
        self.end += n

    def line(self) -> bytes:
        while (i := self.buf.find(b"\r\n", self.start, self.end)) < 0:
            self._fill()
        out = bytes(self.buf[self.start:i])
        self.start = i + 2
        return out

    def into(self, dest: memoryview) -> None:
        """Read one bulk reply of exactly ``dest``'s length into ``dest``."""
        header = self.line()
        if header != b"$%d" % dest.nbytes:
            raise RuntimeError(f"unexpected reply {header[:40]!r}")
        have = min(self.end - self.start, dest.nbytes)
        dest[:have] = self.buf[self.start:self.start + have]
        self.start += have
        while have < dest.nbytes:
            have += self.sock.recv_into(dest[have:])
        if self.line() != b"":
            raise RuntimeError("bulk not terminated")

    @staticmethod
    def pack(*args: bytes) -> bytes:
        return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)

    def command(self, *args: bytes) -> bytes:
        self.sock.sendall(self.pack(*args))
        return self.line()

    def close(self) -> None:
        self.sock.close()


def raw_socket_write(client: MiniResp, keys: list[bytes], data: memoryview, piece: int, depth: int) -> None:
    """SET each piece (memoryviews, no join), at most ``depth`` unanswered."""
    unanswered = 0
    for i, key in enumerate(keys):
        chunk = data[i * piece:(i + 1) * piece]
        client.sock.sendall(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, chunk.nbytes))
        client.sock.sendall(chunk)
        client.sock.sendall(b"\r\n")
        unanswered += 1
        if unanswered == depth:
            if client.line() != b"+OK":
                raise RuntimeError("SET refused")
            unanswered -= 1
    for _ in range(unanswered):
        if client.line() != b"+OK":
            raise RuntimeError("SET refused")


def raw_socket_read(client: MiniResp, keys: list[bytes], out: memoryview, piece: int, depth: int) -> None:
    """GETDEL each piece straight into its slice of ``out``, ``depth`` requested ahead."""
    sent = 0
    for i in range(len(keys)):
        while sent < len(keys) and sent < i + depth:
            client.sock.sendall(client.pack(b"GETDEL", keys[sent]))
            sent += 1
        client.into(out[i * piece:min((i + 1) * piece, out.nbytes)])


class RawSocketPath(Path):
    """The wire's reference: 1 MiB pieces over a raw socket, SET 16 deep, GETDEL 4 deep into the output
    (allocated before the clock, fresh each round trip, like kvredis's: its first-touch faults count)."""

    def prepare(self, tag: str) -> None:
        import torch

        if not hasattr(self, "client"):
            self.client = MiniResp(self.url)
        total = self.kv.numel() * ELEMENT
        self.piece = min(RAW_B_PIECE, total)
        self.keys = [f"{tag}:{i}".encode() for i in range(-(-total // self.piece))]
        if self.role == "read":
            self.out = torch.empty(total, dtype=torch.uint8)

    def wake(self) -> None:
        self.client.command(b"PING")

    def run(self, tag: str) -> Any:
        import torch

        if self.role == "write":
            raw_socket_write(self.client, self.keys, flat_bytes(self.kv), self.piece, RAW_WRITE_DEPTH)
            return None
        raw_socket_read(self.client, self.keys, memoryview(self.out.numpy()).cast("B"), self.piece,
                        RAW_READ_DEPTH)
        return self.out.view(torch.bfloat16).reshape(self.kv.shape)

    def verify(self, result: Any) -> bool:
        return self.role == "write" or bit_equal(result, self.kv)

    def finish(self, tag: str) -> None:
        self.out = None

    def close(self) -> None:
        if hasattr(self, "client"):
            self.client.close()


PATH_CLASSES: dict[str, type[Path]] = {
    "kvredis": KVRedisPath, "naive": NaivePath, "raw-A": RawAPath, "raw-B": RawBPath,
    "raw-socket": RawSocketPath, "memcpy": MemcpyPath,
}


def feasible(path: str, nbytes: int) -> str | None:
    """Why ``path`` cannot move ``nbytes`` (``None`` if it can)."""
    if path in ("naive", "raw-A") and nbytes + 1024 > REDIS_MAX_BULK:
        return "one value over proto-max-bulk-len (512 MB)"
    return None


# -- workers -----------------------------------------------------------------------------------------


def worker_main(conn: Any, role: str, path: str, nbytes: int, seed: int, url: str,
                env: dict[str, str]) -> None:
    """A fresh process playing one role of one path; each ``run`` request is one measured phase."""
    try:
        gc.disable()  # no collection inside a measured phase: one runs after each
        os.environ.update(env)
        device = os.environ.get(DEVICE_ENV, "cpu")
        kv = make_kv(nbytes, seed).to(device)
        impl = PATH_CLASSES[path](role, kv, url, env)
        # Warm-up round trips move a 4 KiB entry through the same clients: they load lazily imported
        # code and open connections without leaving payload-sized free memory behind that the first
        # measured phase could reuse.
        tiny = make_kv(LAYER_TOKEN_BYTES, seed).to(device)
        conn.send(("ready", None))
        while True:
            command, tag = conn.recv()
            if command == "stop":
                break
            if command == "warmup":
                if impl.warm_up:
                    impl.kv = tiny
                    impl.prepare(tag)
                    impl.wake()
                    if not impl.verify(impl.run(tag)):
                        raise RuntimeError("warm-up round trip returned different bytes")
                    impl.finish(tag)
                    impl.kv = kv
                gc.collect()
                conn.send(("done", None))
                continue
            impl.prepare(tag)
            record: dict[str, Any] = {}
            with measured(record, impl.wake):
                result = impl.run(tag)
            record["verified"] = bool(impl.verify(result))
            del result
            impl.finish(tag)
            gc.collect()  # before replying: the next phase (maybe the other process's) must not share a core
            conn.send(("done", record))
        impl.close()
        conn.send(("stopped", None))
    except BaseException:  # report anything to the parent, which raises it
        conn.send(("error", traceback.format_exc()))


class Worker:
    def __init__(self, ctx: Any, role: str, path: str, nbytes: int, seed: int, url: str,
                 env: dict[str, str]) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, args=(child, role, path, nbytes, seed, url, env),
                                   daemon=True)
        self.process.start()
        child.close()
        self.what = f"{path} {role}er"

    def _reply(self) -> Any:
        kind, payload = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"{self.what} failed:\n{payload}")
        return payload

    def ready(self) -> None:
        self._reply()

    def run(self, tag: str, command: str = "run") -> dict[str, Any]:
        self.conn.send((command, tag))
        return self._reply()

    def stop(self) -> None:
        try:
            self.conn.send(("stop", None))
            self._reply()
        finally:
            self.process.join(timeout=30)


def measure(ctx: Any, variants: dict[str, tuple[str, dict[str, str]]], nbytes: int, repeat: int, url: str,
            prefix: str, tick: Callable[[], None] = lambda: None,
            warmup: int = 2) -> dict[str, dict[str, Any]]:
    """``repeat`` write+read round trips of each variant (name: (path, env)) at one size.

    Each variant's writer and reader are fresh processes. Round trips are interleaved (rep 1 of every
    variant, then rep 2...) so that load from elsewhere on the machine spreads over all of them.
    """
    workers: dict[str, tuple[Worker, Worker]] = {}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    try:
        for name, (path, env) in variants.items():
            workers[name] = (Worker(ctx, "write", path, nbytes, 1234, url, env),
                             Worker(ctx, "read", path, nbytes, 1234, url, env))
        for name, (writer, reader) in workers.items():
            writer.ready()
            reader.ready()
            for rep in range(warmup):  # the same for every path
                tag = f"{prefix}-{_tagged(name)}-{fmt_size(nbytes)}-warmup{rep}"
                writer.run(tag, "warmup")
                reader.run(tag, "warmup")
        prime_redis(url, nbytes, f"{prefix}-prime")
        names = list(variants)
        for rep in range(repeat):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                writer, reader = workers[name]
                tag = f"{prefix}-{_tagged(name)}-{fmt_size(nbytes)}-{rep}"
                runs[name].append({"write": writer.run(tag), "read": reader.run(tag)})
                tick()
    finally:
        for pair in workers.values():
            for worker in pair:
                worker.stop()
    return {name: summarize(runs[name], nbytes) for name in variants}


def prime_redis(url: str, nbytes: int, tag: str) -> None:
    """Store and delete ``nbytes`` in 1 MiB values before a size's measured rounds, so that Redis's own
    first growth to that size (fresh pages in the server) lands on no path: it would land on the first
    path of the first round, kvredis's write every time (3.4 s for 1 GiB against 0.7 s in later rounds)."""
    if nbytes < RAW_B_PIECE:
        return
    client = MiniResp(url)
    try:
        keys = [f"{tag}:{i}".encode() for i in range(-(-nbytes // RAW_B_PIECE))]
        data = memoryview(bytearray(RAW_B_PIECE))
        for start in range(0, len(keys), 64):
            batch = keys[start:start + 64]
            for key in batch:
                client.sock.sendall(client.pack(b"SET", key, data))
            for _ in batch:
                if client.line() != b"+OK":
                    raise RuntimeError("SET refused while priming Redis")
        for start in range(0, len(keys), 500):
            client.command(b"DEL", *keys[start:start + 500])
    finally:
        client.close()


def _tagged(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "", name)


def summarize(runs: list[dict[str, Any]], nbytes: int) -> dict[str, Any]:
    writes = [r["write"]["seconds"] for r in runs]
    reads = [r["read"]["seconds"] for r in runs]
    totals = [w + r for w, r in zip(writes, reads, strict=True)]
    return {
        "bytes": nbytes,
        "runs": runs,
        "write_s": statistics.median(writes),
        "read_s": statistics.median(reads),
        "total_s": statistics.median(totals),
        "best_total_s": min(totals),
        "mbps": nbytes / statistics.median(totals) / 1e6,
        "best_mbps": nbytes / min(totals) / 1e6,
        "writer_extra": max(r["write"]["extra_bytes"] for r in runs) / nbytes,
        "reader_extra": max(r["read"]["extra_bytes"] for r in runs) / nbytes,
        "verified": all(r["read"]["verified"] and r["write"]["verified"] for r in runs),
        "peak_reset": all(r["read"]["peak_reset"] and r["write"]["peak_reset"] for r in runs),
    }


# -- phase profile of kvredis ------------------------------------------------------------------------


class PhaseTimer:
    """Inclusive times of nested, named calls (``insert/put_pieces/execute``...), summed per name."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.order: dict[str, None] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.stack.append(name)
            key = "/".join(self.stack)
            self.order.setdefault(key, None)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[key] += time.perf_counter() - start
                self.calls[key] += 1
                self.stack.pop()
        return wrapped


def phases_main(conn: Any, nbytes: int, url: str, prefix: str, repeat: int) -> None:
    """Insert then drop_select in one process with kvredis's internals wrapped in timers."""
    try:
        import redis.client
        import torch

        from kvredis.config import KVRedisConfig
        from kvredis.store import client, codec
        from kvredis.v0 import buffer

        timer = PhaseTimer()
        patches = [
            (buffer.RedisLookupBuffer, "insert"), (buffer.RedisLookupBuffer, "drop_select"),
            (buffer, "_pieces"), (buffer, "_holds"), (buffer.RedisLookupBuffer, "_take_pieces"),
            (codec.Frames, "of"), (codec.Frames, "encode"), (codec, "read_header"), (codec, "decode_payload"),
            (client.RedisStore, "put_pieces"), (client.RedisStore, "push_record"),
            (client.RedisStore, "pop_record"), (client.RedisStore, "take_pieces"),
            (redis.client.Pipeline, "execute"),
        ]
        for owner, name in patches:
            setattr(owner, name, timer.wrap(name, getattr(owner, name)))

        checksum = timer.wrap("checksum", codec.CHECKSUMS[codec.FORMAT_VERSION])
        codec.CHECKSUMS[codec.FORMAT_VERSION] = checksum  # decode looks it up by the blob's version
        codec._WRITE_CHECKSUM = checksum  # type: ignore[attr-defined]
        torch_empty = torch.empty
        buffer.torch = type("T", (), {"__getattr__": lambda s, n: getattr(torch, n)})()  # type: ignore
        buffer.torch.empty = timer.wrap("torch.empty", torch_empty)  # type: ignore[attr-defined]

        kv = make_kv(nbytes, 1234)
        tokens = torch.arange(kv_shape(nbytes)[1], dtype=torch.int64) + 1000
        tiny = make_kv(LAYER_TOKEN_BYTES, 1)
        results = []
        for rep in range(-1, repeat):  # rep -1: a 4 KiB warm-up, not recorded
            entry_kv, entry_tokens = (tiny, tokens[:1]) if rep < 0 else (kv, tokens)
            timer.total.clear()
            timer.calls.clear()
            if rep == 0:
                timer.order.clear()  # list phases in the order of a measured (chunked) round trip
            config = KVRedisConfig.from_env(overrides={"url": url, "namespace": f"{prefix}-ph{rep + 1}"})
            with buffer.RedisLookupBuffer(config) as buf:
                buf.store.ping()
                buf.insert(entry_tokens, None, entry_kv[0], entry_kv[1], None)
                entry = buf.drop_select(entry_tokens, None)
            assert bit_equal(entry[2], entry_kv[0]) and bit_equal(entry[3], entry_kv[1])
            del entry
            if rep >= 0:
                results.append({k: (timer.total[k], timer.calls[k]) for k in timer.order})
        conn.send(("done", results))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def run_phases(ctx: Any, nbytes: int, url: str, prefix: str, repeat: int) -> list[tuple[str, float, int]]:
    parent, child = ctx.Pipe()
    process = ctx.Process(target=phases_main, args=(child, nbytes, url, prefix, repeat), daemon=True)
    process.start()
    kind, payload = parent.recv()
    process.join(timeout=30)
    if kind == "error":
        raise RuntimeError(payload)
    keys = list(payload[0])
    return [(k, statistics.median(r[k][0] for r in payload), payload[0][k][1]) for k in keys]


# -- the scheduler's lookup ------------------------------------------------------------------------


def lookup_prompt(length: int, first: int = 1000) -> list[int]:
    """A prompt of ``length`` token IDs as vLLM's scheduler hands it over (a list of ints)."""
    return list(range(first, first + length))


def lookup_main(conn: Any, url: str, namespace: str, lengths: tuple[int, ...]) -> None:
    """A fresh process asking, as vLLM's scheduler does for each new request, whether an entry waits for a
    prompt (``RedisLookupBuffer.contains``); each ``lookup`` request is one measured phase."""
    try:
        gc.disable()  # as in worker_main: collections run between phases
        import torch

        from kvredis.config import KVRedisConfig
        from kvredis.v0.buffer import RedisLookupBuffer

        buffer = RedisLookupBuffer(KVRedisConfig.from_env(overrides={"url": url, "namespace": namespace}))
        prompts = {length: lookup_prompt(length) for length in lengths}
        tiny = make_kv(LAYER_TOKEN_BYTES, 0)
        for tokens in prompts.values():  # an entry waits for each prompt: every lookup must say so
            buffer.insert(torch.tensor(tokens), None, tiny[0], tiny[1], None)
        absent_ok = not buffer.contains(lookup_prompt(max(lengths), first=7))
        conn.send(("ready", None))
        while True:
            command, length = conn.recv()
            if command == "stop":
                break
            record: dict[str, Any] = {}
            with measured(record, buffer.store.ping):
                found = buffer.contains(prompts[length])
            record["verified"] = found is True and absent_ok
            gc.collect()
            conn.send(("done", record))
        buffer.close()
        conn.send(("stopped", None))
    except BaseException:  # report anything to the parent, which raises it
        conn.send(("error", traceback.format_exc()))


def run_lookups(ctx: Any, url: str, prefix: str, repeat: int, lengths: tuple[int, ...] = LOOKUP_TOKENS,
                tick: Callable[[], None] = lambda: None, warmup: int = 2) -> dict[int, dict[str, Any]]:
    """``repeat`` measured lookups of each prompt length in one fresh process, lengths interleaved, after
    ``warmup`` unrecorded ones each (as many as the transfer paths' warm-up round trips)."""
    parent, child = ctx.Pipe()
    process = ctx.Process(target=lookup_main, args=(child, url, f"{prefix}-lookup", lengths), daemon=True)
    process.start()
    child.close()

    def reply() -> Any:
        kind, payload = parent.recv()
        if kind == "error":
            raise RuntimeError(f"lookup process failed:\n{payload}")
        return payload

    runs: dict[int, list[dict[str, Any]]] = {length: [] for length in lengths}
    try:
        reply()  # ready
        for rep in range(-warmup, repeat):  # below 0: warm-up, not recorded
            for length in lengths if rep % 2 == 0 else lengths[::-1]:
                parent.send(("lookup", length))
                record = reply()
                if rep >= 0:
                    runs[length].append(record)
            if rep >= 0:
                tick()
        parent.send(("stop", None))
        reply()
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    return summarize_lookups(runs)


def summarize_lookups(runs: dict[int, list[dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    """Median, 90th percentile and best seconds of each prompt length's lookups; whether all were right."""
    summary: dict[int, dict[str, Any]] = {}
    for length, records in runs.items():
        seconds = sorted(r["seconds"] for r in records)
        summary[length] = {
            "runs": len(seconds),
            "median_s": statistics.median(seconds),
            "p90_s": seconds[min(len(seconds) - 1, int(0.9 * len(seconds)))],
            "best_s": seconds[0],
            "verified": all(r["verified"] for r in records),
        }
    return summary


def check_lookups(summary: dict[int, dict[str, Any]], out: Callable[[str], None]) -> bool:
    """Print the lookup table and a PASS/FAIL line per prompt length; whether every one passed."""
    out(f"{'tokens':>7} {'median ms':>10} {'p90 ms':>8} {'best ms':>8}  ok")
    for length, r in summary.items():
        out(f"{length:>7} {r['median_s'] * 1e3:10.3f} {r['p90_s'] * 1e3:8.3f} {r['best_s'] * 1e3:8.3f}  "
            f"{'yes' if r['verified'] else 'NO'}")
    passed = True
    for length, r in summary.items():
        ok = r["median_s"] < LOOKUP_TARGET_S and r["verified"]
        passed = passed and ok
        out(f"{'PASS' if ok else 'FAIL'}  lookup of a {length}-token prompt: median "
            f"{r['median_s'] * 1e3:.3f} ms < {LOOKUP_TARGET_S * 1e3:.1f} ms"
            f"{'' if r['verified'] else ' (WRONG ANSWER)'}")
    return passed


# -- concurrency: several threads, each moving its own entries, at once -------------------------------


def run_concurrency(url: str, threads: int, nbytes: int, repeat: int, prefix: str) -> dict[str, Any]:
    """``threads`` threads each insert then drop_select their own entry through ONE shared buffer, against
    the raw-socket reference with one connection per thread; rounds interleaved. Aggregate MB/s is all
    threads' key+value bytes over the wall time from a common start to the last thread's end."""
    import threading

    import torch

    from kvredis.config import KVRedisConfig
    from kvredis.v0.buffer import RedisLookupBuffer

    kvs = [make_kv(nbytes, 100 + i) for i in range(threads)]
    tokens = [torch.arange(kv_shape(nbytes)[1], dtype=torch.int64) + 1000 * (i + 1) for i in range(threads)]
    buffer = RedisLookupBuffer(KVRedisConfig.from_env(overrides={"url": url, "namespace": f"{prefix}-cc"}))
    clients = [MiniResp(url) for _ in range(threads)]
    piece = min(RAW_B_PIECE, nbytes)

    def kvredis_job(i: int, rep: int) -> bool:
        buffer.insert(tokens[i], None, kvs[i][0], kvs[i][1], None)
        entry = buffer.drop_select(tokens[i], None)
        return bit_equal(entry[2], kvs[i][0]) and bit_equal(entry[3], kvs[i][1])

    def raw_job(i: int, rep: int) -> bool:
        keys = [f"{prefix}-cc-raw-{rep}-{i}:{k}".encode() for k in range(-(-nbytes // piece))]
        out = torch.empty(nbytes, dtype=torch.uint8)
        raw_socket_write(clients[i], keys, flat_bytes(kvs[i]), piece, RAW_WRITE_DEPTH)
        raw_socket_read(clients[i], keys, memoryview(out.numpy()).cast("B"), piece, RAW_READ_DEPTH)
        return bit_equal(out.view(torch.bfloat16).reshape(kvs[i].shape), kvs[i])

    def once(job: Callable[[int, int], bool], rep: int) -> tuple[float, bool]:
        barrier = threading.Barrier(threads + 1)
        ok: list[bool] = [False] * threads

        def body(i: int) -> None:
            barrier.wait()
            ok[i] = job(i, rep)

        workers = [threading.Thread(target=body, args=(i,)) for i in range(threads)]
        for worker in workers:
            worker.start()
        gc.collect()
        barrier.wait()
        start = time.perf_counter()
        for worker in workers:
            worker.join()
        return time.perf_counter() - start, all(ok)

    times: dict[str, list[float]] = {"kvredis": [], "raw-socket": []}
    verified = True
    try:
        for rep in range(-1, repeat):  # rep -1: warm-up
            order = [("kvredis", kvredis_job), ("raw-socket", raw_job)]
            for name, job in order if rep % 2 else order[::-1]:
                seconds, ok = once(job, rep)
                verified = verified and ok
                if rep >= 0:
                    times[name].append(seconds)
    finally:
        buffer.close()
        for client in clients:
            client.close()
    total = threads * nbytes
    return {"threads": threads, "bytes": nbytes, "verified": verified,
            **{f"{name}_mbps": total / statistics.median(ts) / 1e6 for name, ts in times.items()},
            **{f"{name}_best_mbps": total / min(ts) / 1e6 for name, ts in times.items()}}


# -- redis-benchmark: the C client's rate, the native limit -----------------------------------------


def redis_benchmark(url: str, piece: int, requests: int) -> dict[str, float] | None:
    """``redis-benchmark -d piece -P 8 -c 1 -t set,get``: MB/s of SET and GET (``None`` if not installed)."""
    import shutil
    import subprocess
    from urllib.parse import urlparse

    exe = shutil.which("redis-benchmark")
    if exe is None:
        return None
    parsed = urlparse(url)
    command = [exe, "-h", parsed.hostname or "127.0.0.1", "-p", str(parsed.port or 6379), "-d", str(piece),
               "-P", "8", "-c", "1", "-n", str(requests), "-t", "set,get", "--csv"]
    output = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True).stdout
    rates: dict[str, float] = {}
    for row in output.splitlines():
        cells = [c.strip('"') for c in row.split(",")]
        if len(cells) > 1 and cells[0] in ("SET", "GET"):
            rates[cells[0].lower()] = float(cells[1]) * piece / 1e6
    return rates


# -- reporting ---------------------------------------------------------------------------------------


def machine_info(url: str) -> dict[str, Any]:
    import hiredis
    import msgpack
    import redis
    import torch

    info: dict[str, Any] = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "redis_py": redis.__version__,
        "hiredis": getattr(hiredis, "__version__", "?"),
        "msgpack": ".".join(map(str, msgpack.version)),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    try:
        with open("/proc/cpuinfo") as handle:
            models = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
        info["cpu_model"] = models[0] if models else "?"
        with open("/proc/meminfo") as handle:
            info["mem_total_gib"] = round(int(handle.readline().split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    client = redis.Redis.from_url(url)
    server = client.info("server")
    info["redis_version"] = server.get("redis_version")
    info["redis_config"] = {k: v for k, v in client.config_get("proto-max-bulk-len").items()}
    client.close()
    return info


def print_table(results: dict[int, dict[str, Any]], out: Callable[[str], None]) -> None:
    head = (f"{'size':>7} {'path':<8} {'write ms':>9} {'read ms':>9} {'RT MB/s':>8} {'best':>7} "
            f"{'writer mem':>10} {'reader mem':>10}  ok")
    out(head)
    out("-" * len(head))
    for nbytes, by_path in results.items():
        for i, path in enumerate(PATHS):
            if path not in by_path:
                continue
            r = by_path[path]
            label = fmt_size(nbytes) if i == 0 or PATHS[0] not in by_path else ""
            if "skipped" in r:
                out(f"{label:>7} {path:<8} {'n/a: ' + r['skipped']}")
                continue
            out(f"{label:>7} {path:<8} {r['write_s'] * 1e3:9.2f} {r['read_s'] * 1e3:9.2f} {r['mbps']:8.0f} "
                f"{r['best_mbps']:7.0f} {r['writer_extra']:9.2f}x {r['reader_extra']:9.2f}x  "
                f"{'yes' if r['verified'] else 'NO'}")
        kv = by_path.get("kvredis")
        if kv and "skipped" not in kv:
            parts = []
            for other in ("raw-socket", "naive", "raw-A", "raw-B"):
                o = by_path.get(other)
                if o and "skipped" not in o:
                    parts.append(f"kvredis/{other} {o['total_s'] / kv['total_s']:.2f}x "
                                 f"(best {o['best_total_s'] / kv['best_total_s']:.2f}x)")
            if parts:
                out(f"{'':>7} ratios   " + ", ".join(parts))
        out("")


def check_targets(results: dict[int, dict[str, Any]], out: Callable[[str], None]) -> bool:
    """Print PASS/FAIL lines for the targets; returns whether every (non-stretch) target passed."""
    passed = True

    def line(ok: bool, text: str, stretch: bool = False) -> None:
        nonlocal passed
        passed = passed and (ok or stretch)
        out(f"{'PASS' if ok else 'FAIL'}  {text}{'  (stretch)' if stretch else ''}")

    big = results.get(128 << 20, {})
    kv = big.get("kvredis")
    if kv and "skipped" not in kv:
        o = big.get("raw-socket")  # naive stays a reference only: its rate swings 3.6x between runs
        if o and "skipped" not in o:
            ratio = o["total_s"] / kv["total_s"]
            line(ratio >= 0.9, f"128MiB round trip kvredis/raw-socket = {ratio:.2f}x >= 0.9x")
    huge = results.get(1 << 30, {}).get("kvredis")
    if huge and "skipped" not in huge and kv and "skipped" not in kv:
        line(huge["mbps"] >= kv["mbps"], f"1GiB kvredis round trip {huge['mbps']:.0f} MB/s >= 128MiB's "
                                         f"{kv['mbps']:.0f} MB/s (best {huge['best_mbps']:.0f} vs "
                                         f"{kv['best_mbps']:.0f})")
    for size in (128 << 20, 1 << 30):
        r = results.get(size, {}).get("kvredis")
        if not r or "skipped" in r:
            continue
        for role, need in (("writer", 0.25), ("reader", 1.25)):
            extra = r[f"{role}_extra"]
            line(extra <= need, f"{fmt_size(size)} {role} extra peak memory {extra:.2f}x <= {need}x payload")
        line(r["verified"], f"{fmt_size(size)} kvredis result bit-identical")
    small = results.get(64 << 10, {})
    kv, raw = small.get("kvredis"), small.get("raw-A")
    if kv and raw and "skipped" not in kv:
        ratio = kv["total_s"] / raw["total_s"]
        line(ratio <= 1.5, f"64KiB kvredis insert+drop_select {kv['total_s'] * 1e3:.3f} ms = {ratio:.2f}x "
                           f"raw-A SET+GET {raw['total_s'] * 1e3:.3f} ms <= 1.5x")
    return passed


def write_png(results: dict[int, dict[str, Any]], path: str, info: dict[str, Any],
              native: dict[str, float] | None = None, native_piece: int = 0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    for name in PATHS:
        points = [(n, r[name]["mbps"]) for n, r in results.items() if name in r and "skipped" not in r[name]]
        if points:
            xs, ys = zip(*sorted(points), strict=True)
            ax.plot(xs, ys, marker="o", label=name, linestyle="--" if name == "memcpy" else "-")
    if native and native.get("set") and native.get("get"):
        rt = 1 / (1 / native["set"] + 1 / native["get"])
        ax.axhline(rt, color="grey", linestyle=":",
                   label=f"redis-benchmark ({fmt_size(native_piece)} pieces)")
    sizes = sorted(results)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [fmt_size(n) for n in sizes])
    ax.set_xlabel("KV entry size (key + value, bf16)")
    ax.set_ylabel("round trip MB/s (write + read, median)")
    ax.set_title(f"KV entry through Redis {info.get('redis_version', '')} on loopback, "
                 f"{info.get('cpus', '?')} cores", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def torch_device_name() -> str:
    import torch

    return f"cuda ({torch.cuda.get_device_name()})"


def cleanup(url: str, prefix: str) -> int:
    """Delete every key this run wrote (some may be left by a failure); returns how many remained."""
    import redis

    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    for start in range(0, len(keys), 500):
        client.delete(*keys[start:start + 500])
    left = sum(1 for _ in client.scan_iter(match=f"{prefix}*", count=1000))
    client.close()
    if left:
        raise RuntimeError(f"{left} keys under {prefix}* could not be deleted")
    return len(keys)


# -- main --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("KVREDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma-separated (default {DEFAULT_SIZES})")
    parser.add_argument("--large", action="store_true", help="also 1GiB")
    parser.add_argument("--repeat", type=int, default=3, help="round trips per path and size (median/best)")
    parser.add_argument("--small-repeat", type=int, default=15,
                        help="round trips for sizes up to 1MiB, which are short and noisy (default 15)")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help="comma-separated subset of " + ",".join(PATHS))
    parser.add_argument("--png", default=None,
                        help="chart (default docs/bench_transfer.png; with --device cuda, none unless given)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the entry lives (cuda: staged through pinned memory; kvredis and memcpy)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--sweep", action="store_true",
                        help="also sweep KVREDIS_CHUNK_BYTES x KVREDIS_INFLIGHT_BYTES for kvredis")
    parser.add_argument("--sweep-only", action="store_true", help="only the sweep")
    parser.add_argument("--sweep-size", type=parse_size, default=128 << 20)
    parser.add_argument("--phases", action="store_true",
                        help="also time kvredis's internal phases (insert, drop_select) per size")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--warmup", type=int, default=2, metavar="N",
                        help="4 KiB round trips through every path's clients before measuring (default 2)")
    parser.add_argument("--lookup-repeat", type=int, default=51, metavar="N",
                        help="measured lookups (RedisLookupBuffer.contains) of a 1- and a 1000-token prompt "
                             "(default 51; 0: skip)")
    parser.add_argument("--concurrency", type=int, default=0, metavar="THREADS",
                        help="also THREADS threads at once, each its own --concurrency-size entry, through "
                             "one buffer, against raw-socket with a connection per thread")
    parser.add_argument("--concurrency-size", type=parse_size, default=16 << 20)
    parser.add_argument("--redis-benchmark", type=parse_size, default=RAW_B_PIECE, metavar="PIECE",
                        help="piece size for the redis-benchmark figure (0: skip it; default 1MiB)")
    args = parser.parse_args(argv)

    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if args.large and (1 << 30) not in sizes:
        sizes.append(1 << 30)
    paths = [p for p in args.paths.split(",") if p]
    unknown = set(paths) - set(PATHS)
    if unknown:
        parser.error(f"unknown paths {sorted(unknown)}; use {','.join(PATHS)}")
    device_env: dict[str, str] = {}
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: CUDA is not available to torch here (torch.cuda.is_available() is "
                         f"False; torch {torch.__version__}, built for CUDA {torch.version.cuda})")
        if args.sweep or args.sweep_only or args.phases or args.concurrency:
            parser.error("--device cuda runs the path table only (no --sweep, --phases or --concurrency)")
        if args.paths == ",".join(PATHS):
            paths = list(CUDA_PATHS)
        elif set(paths) - set(CUDA_PATHS):
            others = sorted(set(paths) - set(CUDA_PATHS))
            parser.error(f"--device cuda runs {','.join(CUDA_PATHS)} only, not {others}")
        device_env = {DEVICE_ENV: "cuda"}
    png = args.png if args.png is not None else ("docs/bench_transfer.png" if args.device == "cpu" else None)
    for size in sizes:
        kv_shape(size)

    from tqdm import tqdm

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    prefix = f"kvbench-{uuid.uuid4().hex[:8]}"
    info = machine_info(args.url)
    out: list[str] = []

    def emit(text: str = "") -> None:
        out.append(text)

    print(f"Redis {info['redis_version']} at {args.url}; redis-py {info['redis_py']}, "
          f"hiredis {info['hiredis']}, "
          f"torch {info['torch']}, {info['cpus']} CPUs; keys under {prefix}*", flush=True)
    results: dict[int, dict[str, Any]] = {}
    sweep: list[dict[str, Any]] = []
    phases: dict[int, list[tuple[str, float, int]]] = {}
    started = time.perf_counter()
    native: dict[str, float] | None = None
    concurrency: dict[str, Any] | None = None
    lookups: dict[int, dict[str, Any]] = {}
    try:
        steps = 0
        if not args.sweep_only:
            steps += sum(len(paths) * (args.small_repeat if size <= 1 << 20 else args.repeat)
                         for size in sizes)
        if args.sweep or args.sweep_only:
            steps += len(SWEEP_CHUNKS) * len(SWEEP_INFLIGHT) * args.repeat
        if args.phases:
            steps += len(sizes)
        if args.lookup_repeat and not args.sweep_only:
            steps += args.lookup_repeat
        bar = tqdm(total=steps, disable=args.no_progress, unit="round trip", file=sys.stderr)
        tick = lambda: bar.update(1)  # noqa: E731
        if args.lookup_repeat and not args.sweep_only:
            # First: a latency measurement, before the bulk transfers, whose after-effects (Redis handing
            # GiBs of memory back) would land on it.
            bar.set_description("lookups")
            lookups = run_lookups(ctx, args.url, prefix, args.lookup_repeat, tick=tick, warmup=args.warmup)
        if not args.sweep_only:
            for size in sizes:
                bar.set_description(f"{fmt_size(size):>6}")
                results[size] = {}
                variants = {}
                for path in paths:
                    why = feasible(path, size)
                    if why:
                        results[size][path] = {"skipped": why}
                    else:
                        variants[path] = (path, dict(device_env))
                repeat = args.small_repeat if size <= 1 << 20 else args.repeat
                measured_paths = measure(ctx, variants, size, repeat, args.url, prefix, tick, args.warmup)
                results[size] = {p: results[size].get(p) or measured_paths[p] for p in paths}
        if args.sweep or args.sweep_only:
            bar.set_description(f"sweep {fmt_size(args.sweep_size)}")
            variants = {f"{c}/{i}": ("kvredis", {"KVREDIS_CHUNK_BYTES": c, "KVREDIS_INFLIGHT_BYTES": i})
                        for c in SWEEP_CHUNKS for i in SWEEP_INFLIGHT}
            swept = measure(ctx, variants, args.sweep_size, args.repeat, args.url, f"{prefix}-sw", tick)
            sweep = [{"chunk": name.split("/")[0], "inflight": name.split("/")[1], **r}
                     for name, r in swept.items()]
        if args.phases:
            for size in sizes:
                bar.set_description(f"phases {fmt_size(size)}")
                reps = args.small_repeat if size <= 1 << 20 else args.repeat
                phases[size] = run_phases(ctx, size, args.url, prefix, reps)
                tick()
        bar.close()
        if args.concurrency:
            concurrency = run_concurrency(args.url, args.concurrency, args.concurrency_size, args.repeat,
                                          prefix)
        if args.redis_benchmark and not args.sweep_only:
            requests = max(200, (512 << 20) // args.redis_benchmark)
            native = redis_benchmark(args.url, args.redis_benchmark, requests)
    finally:
        removed = cleanup(args.url, prefix)
    elapsed = time.perf_counter() - started

    emit(f"# {info['date']}  Redis {info['redis_version']}, redis-py {info['redis_py']}, hiredis "
         f"{info['hiredis']}, torch {info['torch']}, {info['cpus']} CPUs ({info.get('cpu_model', '?')})")
    emit(f"# write/read: median ms over {args.repeat} round trips ({args.small_repeat} up to 1MiB), after "
         f"{args.warmup} warm-up round trips of every path; "
         "RT MB/s = key+value bytes / (write+read), 10^6 B/s, median and best;")
    emit("# ratios = throughput of kvredis over the other path (its time / kvredis's), median (best)")
    emit("# mem = extra peak RSS of the writer / reader process in its phase, x payload (output included;")
    emit("#       the kernel's RSS counters are approximate to ~0.5 MB: ignore multiples below 16MiB)")
    emit()
    passed = True
    if results:
        print_table(results, emit)
        if args.device == "cuda":
            emit(f"# the entry on {torch_device_name()}; the CPU path's targets are not checked here")
        else:
            passed = check_targets(results, emit)
        emit()
    if lookups:
        emit(f"# lookup: RedisLookupBuffer.contains (LLEN on a kept connection) of a prompt given as a list "
             f"of ints, as vLLM's scheduler asks; {args.lookup_repeat} each, every one a phase of its own")
        passed = check_lookups(lookups, emit) and passed
        emit()
    if concurrency:
        c = concurrency
        ratio = c["kvredis_mbps"] / c["raw-socket_mbps"]
        emit(f"# concurrency: {c['threads']} threads x {fmt_size(c['bytes'])} entries at once, aggregate "
             f"round-trip MB/s, median (best) of {args.repeat}")
        emit(f"  kvredis (one shared buffer)        {c['kvredis_mbps']:8.0f} ({c['kvredis_best_mbps']:.0f})")
        emit(f"  raw-socket (a connection a thread) {c['raw-socket_mbps']:8.0f} "
             f"({c['raw-socket_best_mbps']:.0f})")
        ok = ratio >= 0.9 and c["verified"]
        passed = passed and ok
        emit(f"{'PASS' if ok else 'FAIL'}  concurrency kvredis/raw-socket = {ratio:.2f}x >= 0.9x"
             f"{'' if c['verified'] else ' (NOT bit-identical)'}")
        emit()
    if native:
        set_mbps, get_mbps = native.get("set", 0.0), native.get("get", 0.0)
        rt = 1 / (1 / set_mbps + 1 / get_mbps) if set_mbps and get_mbps else 0.0
        emit(f"# redis-benchmark -d {args.redis_benchmark} -P 8 -c 1 -t set,get (C client, native limit): "
             f"SET {set_mbps:.0f} MB/s, GET {get_mbps:.0f} MB/s, round trip {rt:.0f} MB/s")
        for size, by_path in results.items():
            kv = by_path.get("kvredis")
            if kv and "skipped" not in kv and rt:
                emit(f"#   {fmt_size(size)}: kvredis round trip {kv['mbps']:.0f} MB/s = "
                     f"{kv['mbps'] / rt:.2f}x redis-benchmark's")
        emit()
    if sweep:
        emit(f"# sweep: kvredis at {fmt_size(args.sweep_size)}, KVREDIS_CHUNK_BYTES x KVREDIS_INFLIGHT_BYTES")
        emit(f"{'chunk':>7} {'inflight':>8} {'write ms':>9} {'read ms':>9} {'RT MB/s':>8} {'best':>7} "
             f"{'writer mem':>10} {'reader mem':>10}")
        for r in sweep:
            emit(f"{r['chunk']:>7} {r['inflight']:>8} {r['write_s'] * 1e3:9.2f} {r['read_s'] * 1e3:9.2f} "
                 f"{r['mbps']:8.0f} {r['best_mbps']:7.0f} {r['writer_extra']:9.2f}x "
                 f"{r['reader_extra']:9.2f}x")
        top = max(sweep, key=lambda r: r["mbps"])
        emit(f"best: KVREDIS_CHUNK_BYTES={top['chunk']} KVREDIS_INFLIGHT_BYTES={top['inflight']} "
             f"({top['mbps']:.0f} MB/s)")
        emit()
    for size, rows in phases.items():
        emit(f"# kvredis phases at {fmt_size(size)} (median ms per round trip, inclusive; calls)")
        for name, seconds, calls in rows:
            depth = name.count("/")
            label = name.rsplit("/", 1)[-1]
            emit(f"  {'  ' * depth}{label:<{34 - 2 * depth}} {seconds * 1e3:9.3f} ms  x{calls}")
        emit()
    emit(f"# {removed} keys removed; {elapsed:.0f} s")
    print("\n".join(out), flush=True)

    if results and png:
        write_png(results, png, info, native, args.redis_benchmark)
        print(f"chart: {png}")
    if args.json:
        document = {"command": sys.argv, "machine": info, "device": args.device,
                    "results": {str(k): v for k, v in results.items()},
                    "redis_benchmark": native, "concurrency": concurrency, "sweep": sweep,
                    "lookups": {str(k): v for k, v in lookups.items()},
                    "phases": {str(k): v for k, v in phases.items()}, "passed": passed}
        with open(args.json, "w") as handle:
            json.dump(document, handle, indent=1, default=str)
        print(f"json: {args.json}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
