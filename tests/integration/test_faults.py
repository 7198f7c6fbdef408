"""The lookup buffer against a Redis that dies, stalls, restarts empty, expires and evicts.

Every test owns its ``redis-server`` (the machine's shared one is never hurt). What must hold: the caller
gets a kvredis error or a clean miss within the configured bounds, never half an entry or wrong data, the
same buffer object works again once Redis is back, and the counters say why.
"""

from __future__ import annotations

import contextlib
import random
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from kv_entries import assert_entry, identical, kv_entry, random_tensor
from redis_servers import RedisServer

from kvredis import KVRedisConnectionError, KVRedisError, KVRedisTimeoutError
from kvredis.store import resp
from kvredis.v0 import buffer as buffer_module

MISS = [None] * 5
SLACK_S = 0.5  # scheduling and start-up slack on a loaded 2-core machine




def keys_of(server: RedisServer, namespace: str) -> list[bytes]:
    client = server.client()
    try:
        return sorted(client.scan_iter(match=f"{namespace}:*", count=1000))
    finally:
        client.close()


def big_entry(mib: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, key, value, hidden of about ``mib`` MiB (key and value bf16, half each)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.arange(seed * 10_000, seed * 10_000 + 1024)
    layers = max(1, mib // 4)
    key = random_tensor((layers, 1024, 8, 128), torch.bfloat16, generator)  # 2 MiB per layer
    value = random_tensor((layers, 1024, 8, 128), torch.bfloat16, generator)
    hidden = random_tensor((1024, 64), torch.float32, generator)
    return tokens, key, value, hidden


def pieces_a_batch(write_batch_bytes: int, chunk_bytes: int) -> int:
    """The pieces of a large entry in one batch of SETs: a batch closes at the piece that reaches
    ``write_batch_bytes``, and pieces are a little shorter than ``chunk_bytes`` (Redis's size classes)."""
    return -(-write_batch_bytes // buffer_module._piece_bytes(chunk_bytes))


@contextlib.contextmanager
def after_first_batch(command: str, action: Callable[[], None]) -> Iterator[list[int]]:
    """Run ``action`` right after the first batch of pieces has been answered (``command``: SET).

    Deterministic "in the middle of": the first batch of pieces has landed, the rest has not all been sent
    yet (kvredis sends the next batch before it reads the first one's replies). Yields the list of batch
    sizes seen (for asserting it did happen mid-way).
    """
    assert command == "SET"
    original = resp._read_set_replies
    batches: list[int] = []

    def read(reader: resp.BulkReader, count: int) -> Any:
        result = original(reader, count)
        batches.append(count)
        if len(batches) == 1:
            action()
        return result

    resp._read_set_replies = read  # type: ignore[assignment]
    try:
        yield batches
    finally:
        resp._read_set_replies = original  # type: ignore[assignment]


@contextlib.contextmanager
def after_pieces_read(count: int, action: Callable[[], None]) -> Iterator[list[str | None]]:
    """Run ``action`` right after the bulk reader has received ``count`` pieces (deterministic mid-read)."""
    original = resp.BulkReader.read_bulk_into
    seen: list[str | None] = []

    def read(self: resp.BulkReader, destination: memoryview) -> str | None:
        result = original(self, destination)
        seen.append(result)
        if len(seen) == count:
            action()
        return result

    resp.BulkReader.read_bulk_into = read  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        resp.BulkReader.read_bulk_into = original  # type: ignore[method-assign]


class StallProxy:
    """A loopback TCP proxy in front of a Redis, that can stop forwarding (stall) or cut connections."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.port = int(self.listener.getsockname()[1])
        self.flowing = threading.Event()
        self.flowing.set()
        self.closed = False
        self.budget: dict[str, int] = {}  # direction -> bytes still forwarded before cutting everything
        self.lock = threading.Lock()
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self.closed:
            try:
                downstream, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            pair = (downstream, upstream)
            with self.lock:
                self.pairs.append(pair)
            for src, dst, direction in ((downstream, upstream, "up"), (upstream, downstream, "down")):
                thread = threading.Thread(target=self._pump, args=(src, dst, pair, direction), daemon=True)
                self.threads.append(thread)
                thread.start()

    def _pump(
        self, src: socket.socket, dst: socket.socket, pair: tuple[socket.socket, ...], direction: str
    ) -> None:
        while not self.closed:
            if not self.flowing.is_set():
                time.sleep(0.01)  # stalled: read nothing, forward nothing, keep the connection open
                continue
            try:
                if not select.select([src], [], [], 0.02)[0]:
                    continue
                data = src.recv(1 << 18)
            except (OSError, ValueError):  # closed by cut() meanwhile
                break
            if not data:
                break
            if not self.flowing.is_set():
                continue  # stalled while waiting: this never reaches the other side (resume() cuts)
            with self.lock:
                budget = self.budget.get(direction)
                if budget is not None:
                    data = data[:budget]
                    self.budget[direction] = budget - len(data)
            try:
                dst.sendall(data)
            except OSError:
                break
            if budget is not None and budget - len(data) <= 0:
                self.budget.pop(direction, None)
                self.cut()
                break
        self._close(pair)

    def _close(self, pair: tuple[socket.socket, ...]) -> None:
        with self.lock:
            if pair in self.pairs:
                self.pairs.remove(pair)
        for sock in pair:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def stall(self) -> None:
        """Stop forwarding either way: Redis looks alive (TCP up) but never answers."""
        self.flowing.clear()

    def cut(self) -> None:
        """Close every open connection, as a network reset would; new connections still work."""
        with self.lock:
            pairs = list(self.pairs)
        for pair in pairs:
            self._close(pair)

    def cut_after(self, nbytes: int, direction: str) -> None:
        """Cut every connection once ``nbytes`` more have gone ``"up"`` (to Redis) or ``"down"``."""
        with self.lock:
            self.budget[direction] = nbytes

    def resume(self) -> None:
        """Forward again, on new connections only (what was sent during the stall is dropped)."""
        self.cut()
        self.flowing.set()

    def close(self) -> None:
        self.closed = True
        self.flowing.set()
        self.listener.close()
        self.cut()
        for thread in self.threads:
            thread.join(timeout=2)


@pytest.fixture
def proxy(redis_server: Callable[..., RedisServer]) -> Iterator[StallProxy]:
    server = redis_server()
    stall_proxy = StallProxy(server.port)
    stall_proxy.server = server  # type: ignore[attr-defined]
    yield stall_proxy
    stall_proxy.close()


# --- Redis killed and restarted on the same port ------------------------------------------------------


def test_redis_killed_mid_chunked_insert_fails_clearly_and_the_buffer_recovers(
        redis_server, buffers, namespace):
    server = redis_server()
    buffer = buffers(server.url, namespace, chunk_bytes=64 << 10, write_batch_bytes=1 << 20, ttl_s=60)
    small = kv_entry(16, seed=1)
    buffer.insert(small[0], None, *small[1:])  # the pool holds live connections when Redis dies
    assert_entry(buffer.drop_select(small[0], None), *small)
    tokens, key, value, hidden = big_entry(64)

    started = time.monotonic()
    with after_first_batch("SET", server.kill) as batches, pytest.raises(KVRedisConnectionError) as info:
        buffer.insert(tokens, None, key, value, hidden)
    elapsed = time.monotonic() - started
    first = pieces_a_batch(1 << 20, 64 << 10)
    assert batches == [first], "Redis was not killed after the first of many batches of pieces"
    assert elapsed < 5.0  # 64 MiB to encode and send; a kill must not wait out any timeout
    assert "127.0.0.1" in str(info.value)
    assert buffer.metrics["store_failed_error"] == 1 and buffer.metrics["stored"] == 1

    server.start()  # same port, empty
    assert keys_of(server, namespace) == []
    assert buffer.drop_select(tokens, None) == MISS  # nothing half-written survives
    buffer.insert(tokens, None, key, value, hidden)  # the same buffer object works again
    assert_entry(buffer.drop_select(tokens, None), tokens, key, value, hidden)
    assert keys_of(server, namespace) == []


def test_redis_killed_mid_chunked_drop_select_fails_clearly_and_the_buffer_recovers(
        redis_server, buffers, namespace):
    server = redis_server()
    buffer = buffers(server.url, namespace, chunk_bytes=64 << 10, inflight_bytes=1 << 20, ttl_s=60)
    tokens, key, value, hidden = big_entry(16)
    buffer.insert(tokens, None, key, value, hidden)

    started = time.monotonic()
    with after_pieces_read(16, server.kill) as seen, pytest.raises(KVRedisConnectionError):
        buffer.drop_select(tokens, None)
    assert time.monotonic() - started < 2.0
    # Killed mid-way: after the first pieces, long before the 256th (replies already buffered may still
    # be read before the closed socket is noticed).
    assert 16 <= len(seen) < 256 and all(result is None for result in seen)
    assert buffer.metrics["miss_error"] == 1 and buffer.metrics["loaded"] == 0

    server.start()
    assert buffer.drop_select(tokens, None) == MISS  # the entry died with Redis: a clean miss
    assert buffer.metrics["miss_absent"] == 1
    buffer.insert(tokens, None, key, value, hidden)
    assert_entry(buffer.drop_select(tokens, None), tokens, key, value, hidden)
    assert keys_of(server, namespace) == []


def test_redis_killed_while_a_reader_waits_fails_at_once(redis_server, buffers, namespace):
    server = redis_server()
    buffer = buffers(server.url, namespace, pop_timeout_s=10.0)
    tokens, key, value, hidden = kv_entry(20)
    assert not buffer.contains(tokens)  # connections are pooled before the kill
    outcome: list[Any] = []

    def read() -> None:
        started = time.monotonic()
        try:
            outcome.append(buffer.drop_select(tokens, None))
        except KVRedisError as exc:
            outcome.append(exc)
        outcome.append(time.monotonic() - started)

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.3)
    server.kill()
    reader.join(timeout=5)
    assert not reader.is_alive()
    assert isinstance(outcome[0], KVRedisConnectionError)
    assert outcome[1] < 2.0  # not the 10 s pop timeout
    server.start()
    buffer.insert(tokens, None, key, value, hidden)
    assert_entry(buffer.drop_select(tokens, None), tokens, key, value, hidden)


# --- connection cut while Redis lives on: the buffer cleans up after itself ---------------------------


def test_connection_cut_mid_chunked_insert_leaves_no_piece(proxy, buffers, namespace):
    buffer = buffers(proxy.url, namespace, chunk_bytes=16 << 10, write_batch_bytes=64 << 10, ttl_s=60)
    tokens, key, value, hidden = big_entry(4)
    # The first batch lands, then the connection drops halfway through sending the second.
    cut = lambda: proxy.cut_after(32 << 10, "up")  # noqa: E731
    with after_first_batch("SET", cut) as batches, pytest.raises(KVRedisConnectionError):
        buffer.insert(tokens, None, key, value, hidden)
    # The second batch went out before the first one's replies were read, so it may have landed too.
    per_batch = pieces_a_batch(64 << 10, 16 << 10)
    assert batches in ([per_batch], [per_batch, per_batch])
    # The first batch landed; the failed insert deleted it instead of leaving it to the 60 s TTL.
    assert keys_of(proxy.server, namespace) == []
    assert buffer.drop_select(tokens, None) == MISS
    buffer.insert(tokens, None, key, value, hidden)
    assert_entry(buffer.drop_select(tokens, None), tokens, key, value, hidden)


def test_connection_cut_mid_chunked_drop_select_leaves_no_piece(proxy, buffers, namespace):
    buffer = buffers(proxy.url, namespace, chunk_bytes=16 << 10, inflight_bytes=64 << 10, ttl_s=60)
    tokens, key, value, hidden = big_entry(4)
    buffer.insert(tokens, None, key, value, hidden)
    assert len(keys_of(proxy.server, namespace)) > 8
    cut = lambda: proxy.cut_after(32 << 10, "down")  # noqa: E731
    with after_pieces_read(4, cut), pytest.raises(KVRedisConnectionError):
        buffer.drop_select(tokens, None)
    assert keys_of(proxy.server, namespace) == []  # the taken entry's remaining pieces were deleted
    buffer.insert(tokens, None, key, value, hidden)
    assert_entry(buffer.drop_select(tokens, None), tokens, key, value, hidden)


def test_pieces_refused_for_memory_are_deleted_and_the_error_says_why(redis_server, buffers, namespace):
    server = redis_server("--maxmemory", "4mb", "--maxmemory-policy", "noeviction")
    buffer = buffers(server.url, namespace, chunk_bytes=64 << 10, write_batch_bytes=256 << 10, ttl_s=60)
    tokens, key, value, hidden = big_entry(8)
    with pytest.raises(KVRedisError, match="maxmemory"):
        buffer.insert(tokens, None, key, value, hidden)
    assert keys_of(server, namespace) == []
    small = kv_entry(16)
    buffer.insert(small[0], None, *small[1:])
    assert_entry(buffer.drop_select(small[0], None), *small)


# --- Redis stalled: every call returns within its bound -----------------------------------------------


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 4096], ids=["inline", "chunked"])
def test_stalled_redis_every_call_returns_within_its_bound(proxy, buffers, namespace, chunk_bytes):
    socket_s, pop_s = 0.5, 0.4
    buffer = buffers(proxy.url, namespace, socket_timeout_s=socket_s, pop_timeout_s=pop_s,
                     connect_timeout_s=0.5, chunk_bytes=chunk_bytes)
    tokens, key, value, hidden = kv_entry(64)
    buffer.insert(tokens, None, key, value, hidden)
    assert buffer.contains(tokens)
    assert_entry(buffer.drop_select(tokens, None), tokens, key, value, hidden)

    proxy.stall()
    timings = {}
    for name, call, bound in (
        ("insert", lambda: buffer.insert(tokens, None, key, value, hidden), socket_s),
        ("drop_select", lambda: buffer.drop_select(tokens, None), socket_s + pop_s),
        ("contains", lambda: buffer.contains(tokens), socket_s),
    ):
        started = time.monotonic()
        with pytest.raises(KVRedisTimeoutError, match="timed out"):
            call()
        timings[name] = elapsed = time.monotonic() - started
        assert elapsed <= bound + SLACK_S, f"{name} took {elapsed:.2f} s, bound {bound} s"
    assert timings["insert"] >= socket_s * 0.9  # it did wait for Redis, then gave up
    assert buffer.metrics["timeouts"] == 3
    assert buffer.metrics["store_failed_timeout"] == 1 and buffer.metrics["miss_timeout"] == 1

    proxy.resume()
    buffer.insert(tokens, None, key, value, hidden)
    assert_entry(buffer.drop_select(tokens, None), tokens, key, value, hidden)


# --- entries gone: restarted empty, expired, evicted --------------------------------------------------


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 4096], ids=["inline", "chunked"])
def test_redis_restarted_empty_is_a_clean_miss(redis_server, buffers, namespace, chunk_bytes):
    server = redis_server()
    buffer = buffers(server.url, namespace, chunk_bytes=chunk_bytes)
    tokens, key, value, hidden = kv_entry(64)
    buffer.insert(tokens, None, key, value, hidden)
    assert buffer.contains(tokens)
    server.restart()
    assert not buffer.contains(tokens)
    assert buffer.drop_select(tokens, None) == MISS
    assert buffer.metrics["miss_absent"] == 1 and buffer.metrics["misses"] == 1


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 4096], ids=["inline", "chunked"])
def test_entry_expired_before_it_is_read_is_a_miss_counted_absent(redis_server, buffers, namespace,
                                                                  chunk_bytes):
    server = redis_server()
    buffer = buffers(server.url, namespace, ttl_s=0.2, chunk_bytes=chunk_bytes)
    tokens, key, value, hidden = kv_entry(64)
    buffer.insert(tokens, None, key, value, hidden)
    time.sleep(0.4)
    assert buffer.drop_select(tokens, None) == MISS
    assert buffer.metrics["miss_absent"] == 1 and buffer.metrics["dropped"] == 0
    assert keys_of(server, namespace) == []


def test_evicted_pieces_read_as_misses_never_as_wrong_data(redis_server, buffers, namespace):
    server = redis_server("--maxmemory", "4mb", "--maxmemory-policy", "volatile-lru",
                          "--maxmemory-samples", "10", "--hz", "100")  # BLPOP timeouts to 10 ms
    buffer = buffers(server.url, namespace, chunk_bytes=4096, pop_timeout_s=0.01, ttl_s=120)
    generator = torch.Generator().manual_seed(11)
    entries = []
    for i in range(110):
        tokens = torch.arange(i * 1000, i * 1000 + 64)
        key = random_tensor((2, 64, 4, 16), torch.float16, generator)  # 16 KiB, and as much for value
        entries.append((tokens, key, key.flip(0), None))
    stored = []
    for i, (tokens, key, value, hidden) in enumerate(entries):
        if i == 60:
            # Redis's LRU clock ticks once a second: the first 60 entries become the least recently used.
            time.sleep(1.1)
        with contextlib.suppress(KVRedisError):  # an OOM refusal is a clean failure too
            buffer.insert(tokens, None, key, value, hidden)
            stored.append(i)
    client = server.client()
    evicted = int(client.info("stats")["evicted_keys"])
    client.close()
    assert evicted > 0, "nothing was evicted: the test wrote too little"
    assert len(stored) > 100
    hits = 0
    for i in stored:
        tokens, key, value, hidden = entries[i]
        result = buffer.drop_select(tokens, None)
        if result != MISS:
            assert_entry(result, tokens, key, value, hidden)
            hits += 1
    metrics = buffer.metrics
    assert hits == metrics["loaded"] and hits > 0
    assert metrics["misses"] == len(stored) - hits
    assert metrics["miss_partial"] > 0, "no entry lost a piece: eviction took only whole entries"
    assert metrics["miss_partial"] + metrics["miss_absent"] == metrics["misses"]
    assert metrics["dropped_partial"] == metrics["miss_partial"]
    assert metrics["dropped_corrupt"] == metrics["dropped_foreign"] == 0


# --- load, with Redis restarted in the middle -------------------------------------------------------
# --- load, with Redis restarted in the middle -------------------------------------------------------


def test_load_with_a_restart_in_the_middle_never_returns_wrong_or_duplicate_data(
        redis_server, buffers, namespace):
    """500 entries, 8 writers and 8 readers in random orders, Redis killed and restarted halfway.

    Readers poll like a decode instance does: each asks for its entries in turn with a short pop timeout
    and comes back to the ones that missed, until the writers are done and a last round found nothing.
    """
    count, threads_each, ttl_s = 500, 8, 4.0
    server = redis_server("--hz", "100")  # BLPOP timeouts to 10 ms instead of 100 ms
    writer = buffers(server.url, namespace, chunk_bytes=4096, ttl_s=ttl_s)
    reader = buffers(server.url, namespace, chunk_bytes=4096, ttl_s=ttl_s, pop_timeout_s=0.05)
    generator = torch.Generator().manual_seed(5)
    entries = []
    for i in range(count):
        tokens = torch.arange(i * 100, i * 100 + 8 + i % 40)
        shape = (1 + i % 2, tokens.numel(), 2 + 2 * (i % 3), 8)  # a third of the entries go in pieces
        key = random_tensor(shape, torch.float16, generator)
        hidden = random_tensor((tokens.numel(), 8), torch.float32, generator) if i % 2 else None
        entries.append((tokens, key, torch.flip(key, (1,)), hidden))
    # Every entry is asked for by one reader, and 50 of them by two readers at once.
    requests = list(range(count)) + list(range(0, count, count // 50))
    order = list(range(count))
    random.Random(1).shuffle(order)
    random.Random(2).shuffle(requests)

    lock = threading.Lock()
    stored: set[int] = set()
    store_failed: set[int] = set()
    loaded: dict[int, int] = {}
    read_failed: set[int] = set()
    wrong: list[str] = []
    restarted = threading.Event()
    writers_done = threading.Event()
    stored_before_restart = 0

    def write(part: list[int]) -> None:
        nonlocal stored_before_restart
        for i in part:
            tokens, key, value, hidden = entries[i]
            try:
                writer.insert(tokens, None, key, value, hidden)
            except KVRedisError:
                with lock:
                    store_failed.add(i)
            else:
                with lock:
                    stored.add(i)
                    if len(stored) == count // 2 and not restarted.is_set():
                        stored_before_restart = len(stored)
                        server.restart()  # SIGKILL, start empty on the same port
                        restarted.set()
            time.sleep(0.01)

    def read(part: list[int]) -> None:
        pending = list(part)
        while pending:
            final_round = writers_done.is_set()
            for i in list(pending):
                tokens, key, value, hidden = entries[i]
                try:
                    result = reader.drop_select(tokens, None)
                except KVRedisError:
                    with lock:
                        read_failed.add(i)
                    continue
                if result == MISS:
                    continue
                pending.remove(i)
                same = (identical(result[0], tokens) and identical(result[2], key)
                        and identical(result[3], value) and identical(result[4], hidden))
                with lock:
                    if not same:
                        wrong.append(f"entry {i} came back different")
                    loaded[i] = loaded.get(i, 0) + 1
            if final_round:
                break

    writers = [threading.Thread(target=write, args=(order[k::threads_each],)) for k in range(threads_each)]
    readers = [threading.Thread(target=read, args=(requests[k::threads_each],)) for k in range(threads_each)]
    started = time.monotonic()
    for thread in writers + readers:
        thread.start()
    for thread in writers:
        thread.join(timeout=60)
    writers_done.set()
    for thread in readers:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in writers + readers)
    run_s = time.monotonic() - started

    assert restarted.is_set() and stored_before_restart == count // 2
    assert wrong == []
    duplicates = sorted(i for i, times in loaded.items() if times > 1)
    assert duplicates == [], f"entries returned twice: {duplicates}"
    assert len(stored) + len(store_failed) == count
    assert len(stored) > count // 2 + 150, "hardly anything was stored after the restart"
    lost = len(stored) - len(loaded)
    assert 0 < lost < count // 2, f"{lost} entries lost: the restart did not hit the middle ({run_s:.1f} s)"
    assert set(loaded) <= stored | store_failed  # (an insert cut off after its RPUSH may still land)
    assert writer.metrics["stored"] == len(stored)
    assert reader.metrics["loaded"] == len(loaded)
    assert reader.metrics["dropped_corrupt"] == reader.metrics["dropped_foreign"] == 0
    assert not any(reader.contains(entries[i][0]) for i in loaded)  # no second copy of a loaded entry

    client = server.client()
    try:
        assert all(client.pttl(name) > 0 for name in client.scan_iter(match=f"{namespace}:*"))
        deadline = time.monotonic() + ttl_s + 2.0
        while keys_of(server, namespace) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert keys_of(server, namespace) == [], "keys outlived their TTL"
    finally:
        client.close()
