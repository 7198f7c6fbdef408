"""kvredis's own RESP framing: commands as buffers (no copies), partial sends, replies, pipelined SETs."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid

import pytest
import redis

from kvredis.store import resp


class TrickleSocket(socket.socket):
    """A socket whose sendmsg takes at most ``step`` bytes a call (as a full kernel buffer would)."""

    step = 7

    def sendmsg(self, buffers, *args):  # type: ignore[override]
        data = b"".join(bytes(b) for b in buffers)[:self.step]
        return super().sendmsg([data])


def pair(cls: type[socket.socket] = socket.socket) -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    wrapped = cls(a.family, a.type, a.proto, fileno=a.detach())
    return wrapped, b


def receive_all(sock: socket.socket, into: list[bytes]) -> threading.Thread:
    def run() -> None:
        while chunk := sock.recv(1 << 16):
            into.append(chunk)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_frame_joins_small_arguments_and_keeps_large_values_as_they_are() -> None:
    big = memoryview(bytearray(b"x" * (64 << 10)))
    buffers = resp.frame("SET", "key", big, "PX", 1000)
    assert any(b is big for b in buffers)  # the caller's memory, not a copy
    assert b"".join(bytes(b) for b in buffers) == (
        b"*5\r\n$3\r\nSET\r\n$3\r\nkey\r\n$65536\r\n" + bytes(big) + b"\r\n$2\r\nPX\r\n$4\r\n1000\r\n")


def test_a_list_argument_is_one_value_made_of_its_parts() -> None:
    head, tail = b"abc", memoryview(bytearray(b"y" * (20 << 10)))
    buffers = resp.frame("RPUSH", "q", [head, tail])
    wire = b"".join(bytes(b) for b in buffers)
    assert wire == b"*3\r\n$5\r\nRPUSH\r\n$1\r\nq\r\n$%d\r\nabc" % (3 + tail.nbytes) + bytes(tail) + b"\r\n"
    assert any(b is tail for b in buffers)


def test_names_framed_once_frame_as_any_string() -> None:
    """The command names kept framed are the same bytes as any other string's framing (here compared with
    a name that is not among them, and with the names' own framing done the long way)."""
    for name in resp._NAMED:
        assert resp.frame(name, "k") == [b"*2\r\n$%d\r\n%s\r\n$1\r\nk\r\n" % (len(name), name.encode())]
    assert b"".join(resp.frame("MULTI")) == b"*1\r\n$5\r\nMULTI\r\n"
    assert b"".join(resp.frame("EXEC")) == b"*1\r\n$4\r\nEXEC\r\n"


def test_frame_refuses_a_bool() -> None:
    with pytest.raises(TypeError):
        resp.frame("SET", "k", True)  # type: ignore[arg-type]


@pytest.mark.parametrize("step", [1, 7, 4096])
def test_send_resumes_after_partial_sends(step: int) -> None:
    TrickleSocket.step = step
    sender, receiver = pair(TrickleSocket)
    buffers = [b"a" * 10, memoryview(bytearray(range(256)) * 300), b"", b"tail"]
    got: list[bytes] = []
    thread = receive_all(receiver, got)
    resp.send(sender, buffers)
    sender.close()
    thread.join()
    assert b"".join(got) == b"".join(bytes(b) for b in buffers)


def test_send_without_sendmsg_writes_each_buffer() -> None:
    class NoScatter(socket.socket):
        sendmsg = None  # type: ignore[assignment]

    sender, receiver = pair(NoScatter)
    got: list[bytes] = []
    thread = receive_all(receiver, got)
    resp.send(sender, [b"one", memoryview(b"two"), b"three"])
    sender.close()
    thread.join()
    assert b"".join(got) == b"onetwothree"


def replies_of(wire: bytes) -> list[object]:
    a, b = socket.socketpair()
    b.sendall(wire)
    b.close()
    reader = resp.BulkReader(a, 16)  # a tiny buffer: lines and values cross refills
    out = []
    try:
        while True:
            out.append(reader.read_reply())
    except ConnectionError:
        return out
    finally:
        a.close()


def test_read_reply_parses_what_kvredis_commands_answer() -> None:
    wire = (b"+OK\r\n+QUEUED\r\n:42\r\n$5\r\nhello\r\n$-1\r\n*-1\r\n_\r\n*2\r\n:1\r\n-WRONGTYPE nope\r\n"
            b"$0\r\n\r\n")
    got = replies_of(wire)
    assert got[:7] == ["OK", "QUEUED", 42, bytearray(b"hello"), None, None, None]
    assert got[7][0] == 1 and isinstance(got[7][1], resp.RespError) and "WRONGTYPE" in str(got[7][1])
    assert got[8] == bytearray()
    assert isinstance(got[3], bytearray)  # writable: tensors decoded over it are views
    assert resp.first_error(got) is got[7][1]


@pytest.mark.parametrize("wire", [b"?what\r\n", b"$3\r\nabcXY\r\n", b"*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n"])
def test_read_reply_refuses_what_it_does_not_expect(wire: bytes) -> None:
    a, b = socket.socketpair()
    b.sendall(wire)
    b.close()
    with pytest.raises(resp.ProtocolError):
        resp.BulkReader(a).read_reply()
    a.close()


def test_a_reply_cut_short_is_a_connection_error() -> None:
    a, b = socket.socketpair()
    b.sendall(b"$10\r\nabc")
    b.close()
    with pytest.raises(ConnectionError):
        resp.BulkReader(a).read_reply()
    a.close()


@pytest.fixture
def real_socket(real_redis_url: str):
    client = redis.Redis.from_url(real_redis_url)
    connection = client.connection_pool.get_connection()
    yield connection._sock, client
    client.connection_pool.release(connection)
    client.close()


def test_put_pieces_stores_every_piece_with_its_ttl(real_socket) -> None:
    sock, client = real_socket
    prefix = f"t-resp-{uuid.uuid4().hex[:8]}"
    pieces = [memoryview(bytearray(os.urandom(1000 + i))) for i in range(40)]
    keys = [f"{prefix}:{i}" for i in range(40)]
    assert resp.put_pieces(sock, keys, pieces, 60_000, batch_bytes=5000) is None
    assert [client.get(k) for k in keys] == [bytes(p) for p in pieces]
    assert all(0 < client.pttl(k) <= 60_000 for k in keys)
    client.delete(*keys)
    assert resp.call(sock, ("PING",)) == ["PONG"]  # the connection is still in step


def test_put_pieces_reads_every_reply_and_returns_the_first_error(real_socket) -> None:
    sock, client = real_socket
    prefix = f"t-resp-{uuid.uuid4().hex[:8]}"
    keys = [f"{prefix}:{i}" for i in range(5)]
    error = resp.put_pieces(sock, keys, [b"v"] * 5, 0, batch_bytes=2)  # PX 0 is refused
    assert isinstance(error, resp.RespError) and "expire" in str(error)
    assert client.exists(*keys) == 0
    assert resp.call(sock, ("PING",)) == ["PONG"]


def test_call_sends_a_transaction_in_one_write(real_socket) -> None:
    sock, client = real_socket
    queue = f"t-resp-{uuid.uuid4().hex[:8]}:q"
    replies = resp.call(sock, ("MULTI",), ("RPUSH", queue, [b"ab", b"cd"]), ("PEXPIRE", queue, 5000),
                        ("EXEC",))
    assert replies == ["OK", "QUEUED", "QUEUED", [1, 1]]
    assert client.lpop(queue) == b"abcd"



def test_a_placed_bulk_reply_goes_into_the_buffers_given_inside_arrays_too() -> None:
    a, b = socket.socketpair()
    b.sendall(b"$10\r\n0123456789\r\n*3\r\n:7\r\n$4\r\nabcd\r\n$2\r\nxy\r\n$3\r\nfoo\r\n")
    b.close()
    reader = resp.BulkReader(a, 16)  # lines and values cross refills
    head, tail = bytearray(4), bytearray(6)
    placed = reader.read_reply(place=lambda n: [memoryview(head), memoryview(tail)])
    assert isinstance(placed, resp.Placed) and placed.nbytes == 10
    assert (head, tail) == (bytearray(b"0123"), bytearray(b"456789"))
    slots: list[bytearray] = []

    def only_fours(length: int) -> list[memoryview] | None:  # the 4-byte bulk placed, the 2-byte one not
        if length != 4:
            return None
        slots.append(bytearray(length))
        return [memoryview(slots[-1])]

    executed = reader.read_reply(place=only_fours)
    assert executed[0] == 7 and isinstance(executed[1], resp.Placed) and executed[2] == bytearray(b"xy")
    assert slots == [bytearray(b"abcd")]
    with pytest.raises(ValueError, match="placement"):  # buffers that do not add up to the reply
        reader.read_reply(place=lambda n: [memoryview(bytearray(n + 1))])
    a.close()


@pytest.mark.parametrize("window", [1, 3, 1 << 20])
def test_a_pipeline_keeps_its_window_and_reads_every_reply_in_order(real_socket, window: int) -> None:
    sock, client = real_socket
    prefix = f"t-resp-{uuid.uuid4().hex[:8]}"
    values = [os.urandom(100 + i) for i in range(12)]
    for i, value in enumerate(values):
        client.set(f"{prefix}:{i}", value, px=60_000)
    out = [bytearray(len(value)) for value in values]
    commands = [("GET", f"{prefix}:{i}") for i in range(12)] + [("GET", f"{prefix}:none")]
    places = [(lambda n, slot=slot: [memoryview(slot)]) for slot in out] + [None]
    replies = resp.pipeline(sock, commands, places, [1] * 13, window)
    assert all(isinstance(reply, resp.Placed) for reply in replies[:12]) and replies[12] is None
    assert [bytes(slot) for slot in out] == values
    client.delete(*[f"{prefix}:{i}" for i in range(12)])
    assert resp.call(sock, ("PING",)) == ["PONG"]


def test_a_reply_spread_over_many_buffers_arrives_whole_in_blocking_mode() -> None:
    """A placed reply lands in many small buffers (an engine's pages) in one blocking receive, the bytes
    already buffered first, the socket's own timeout kept by the kernel and restored after."""
    a, b = socket.socketpair()
    a.settimeout(5.0)
    payload = os.urandom(64 << 10)
    sizes = [1, 7, 4096, 100, 0, 12345] + [1000] * 48
    sizes.append(len(payload) - sum(sizes))
    sender = threading.Thread(target=lambda: (b.sendall(b"$%d\r\n" % len(payload) + payload + b"\r\n:1\r\n")))
    sender.start()
    parts = [memoryview(bytearray(size)) for size in sizes]
    with resp.blocking(a):
        assert a.gettimeout() is None
        reader = resp.BulkReader(a, 64)  # a few payload bytes come with the length line
        placed = reader.read_reply(place=lambda n: parts)
        assert reader.read_reply() == 1
    sender.join(5)
    assert isinstance(placed, resp.Placed) and b"".join(parts) == payload
    assert a.gettimeout() == 5.0
    a.close()
    b.close()


class CountingSocket(socket.socket):
    """A socket that counts the bytes ``recv_into`` takes (what passes through the reader's own buffer)."""

    buffered = 0

    def recv_into(self, buffer, nbytes=0, flags=0):  # type: ignore[override]
        received = super().recv_into(buffer, nbytes, flags)
        self.buffered += received
        return received


def test_long_placed_replies_go_past_the_readers_buffer_and_short_ones_around_them_still_parse() -> None:
    """Where a long reply is expected, or follows one that was placed, the reader receives lines a few bytes
    at a time, so that the payload goes from the socket to its place and not through its buffer; replies that
    are not what was expected (an error line longer than such a read, a null) read as ever."""
    a, b = pair(CountingSocket)
    payloads = [os.urandom(200_000 + i) for i in range(4)]
    error = b"-ERR " + b"x" * 200
    wire = b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in payloads[:2])
    wire += error + b"\r\n$-1\r\n:5\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in payloads[2:])
    sender = threading.Thread(target=lambda: (b.sendall(wire), b.shutdown(socket.SHUT_WR)))
    sender.start()
    out = [bytearray(len(p)) for p in payloads]
    with resp.blocking(a):
        reader = resp.BulkReader(a)
        replies = [reader.read_reply(place=lambda n, slot=slot: [memoryview(slot)], expect=len(slot))
                   for slot in out[:2]]
        replies.append(reader.read_reply(place=lambda n: None, expect=1 << 20))  # the error, then a null
        replies.append(reader.read_reply(place=lambda n: None, expect=1 << 20))
        replies.append(reader.read_reply())
        replies += [reader.read_reply(place=lambda n, slot=slot: [memoryview(slot)], expect=len(slot))
                    for slot in out[2:]]
    sender.join(5)
    assert all(isinstance(reply, resp.Placed) for reply in replies[:2] + replies[5:])
    assert isinstance(replies[2], resp.RespError) and replies[2].args[0] == error[1:].decode()
    assert replies[3] is None and replies[4] == 5
    assert [bytes(slot) for slot in out] == payloads
    # Lines, CRLFs and a few payload bytes each; without the short reads, 64 KiB of each payload.
    assert a.buffered < 1024, a.buffered
    a.close()
    b.close()


def test_a_stalled_reply_in_blocking_mode_times_out_at_the_sockets_bound() -> None:
    a, b = socket.socketpair()
    a.settimeout(0.3)
    b.sendall(b"$10\r\nabc")  # then nothing: a server that stalls mid-reply
    slot = bytearray(10)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        resp.pipeline(a, [("GET", "k")], [lambda n: [memoryview(slot)]], [10], 1 << 20)
    assert 0.25 < time.monotonic() - started < 5
    assert a.gettimeout() == 0.3  # restored for redis-py's own commands
    a.close()
    b.close()


def test_a_pipeline_hands_each_reply_on_as_it_is_in(real_socket) -> None:
    """``on_reply`` sees reply ``i`` (and those before) as soon as it is read, before the next is read."""
    sock, client = real_socket
    prefix = f"t-resp-{uuid.uuid4().hex[:8]}"
    for i in range(5):
        client.set(f"{prefix}:{i}", b"v%d" % i, px=60_000)
    seen: list[tuple[int, list[object]]] = []
    replies = resp.pipeline(sock, [("GET", f"{prefix}:{i}") for i in range(5)], [None] * 5, [1] * 5, 2,
                            lambda index, so_far: seen.append((index, list(so_far))))
    assert [index for index, _ in seen] == [0, 1, 2, 3, 4]
    assert all(len(so_far) == index + 1 and so_far[index] == b"v%d" % index for index, so_far in seen)
    assert replies == [b"v%d" % i for i in range(5)]
    client.delete(*[f"{prefix}:{i}" for i in range(5)])


def test_a_write_to_a_peer_that_stops_reading_times_out_at_the_sockets_bound() -> None:
    """Large writes send with the socket blocking (no GIL held): a server that stops reading still ends the
    call within the socket's bound (twice, at most: a send that moved some bytes is tried once more)."""
    a, b = socket.socketpair()
    a.settimeout(0.3)
    value = memoryview(bytearray(8 << 20))  # far more than the socket's buffers hold
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        resp.call_in_groups(a, [[("SET", "k", value)]])
    assert 0.25 < time.monotonic() - started < 5
    assert a.gettimeout() == 0.3
    a.close()
    b.close()
