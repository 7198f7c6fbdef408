"""RESP framed by kvredis itself, over a connection redis-py already opened.

redis-py (with or without hiredis) turns every reply into a new ``bytes`` object that kvredis then copies
into the output tensor: two passes over fresh memory per byte. Here the socket's ``recv_into`` writes the
payload directly where it belongs. Commands go out the same way: :func:`frame` turns arguments into a list
of buffers in which large values stay the caller's memoryviews, and :func:`send` hands them to
``socket.sendmsg`` (a scatter-gather write: no join, no copy), resuming after partial sends. Only the RESP
subset kvredis's commands need is parsed. The connection comes from redis-py's pool, so URL, TLS, ACL
login and timeouts are redis-py's; it is handed back clean, or disconnected if anything went wrong
mid-reply.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from kvredis.errors import KVRedisError

_CRLF = b"\r\n"
_REDIRECTIONS = ("MOVED ", "ASK ", "TRYAGAIN ")
_LINE_LIMIT = 4096
# Buffers shorter than this are joined into their neighbours: a copy of a few KiB costs less than an iovec.
_JOIN_BELOW = 16 << 10
_IOV_MAX = 512  # per sendmsg call (Linux allows 1024)
_MAX_DEPTH = 4  # nesting of array replies (EXEC of a transaction is 2)
# Where a large bulk reply is next, a line is received this many bytes at most: the payload behind it then
# goes from the socket straight to its place, instead of a buffer's worth of it through the reader's buffer
# (a second copy, made holding the GIL). Enough for a CRLF, a bulk header and a short reply between.
_HEADER_READ = 64

Buffer = bytes | bytearray | memoryview
Argument = str | bytes | bytearray | memoryview | int | float | Sequence[Buffer]
"""A command argument; a list or tuple of buffers is one bulk string made of all of them (not joined)."""


def _nbytes(value: Buffer) -> int:
    return value.nbytes if isinstance(value, memoryview) else len(value)


def frame(*args: Argument) -> list[Buffer]:
    """The RESP encoding of one command as buffers: small parts joined, large values left as they are."""
    return encode([args])


def encode(commands: Sequence[Sequence[Argument]]) -> list[Buffer]:
    """The RESP encoding of ``commands`` as buffers: everything joined but the values of ``_JOIN_BELOW``
    bytes or more, which stay the caller's memory (a memoryview of it)."""
    out: list[Buffer] = []
    pending: list[Buffer] = []  # small parts, joined once
    named = _NAMED.get
    for args in commands:
        pending.append(b"*%d\r\n" % len(args))
        for arg in args:
            value: Any = arg
            kind = type(value)
            if kind is str:
                framed = named(value)
                if framed is not None:  # a command's name or option, framed once
                    pending.append(framed)
                    continue
                value = value.encode()
            elif kind is int:
                value = b"%d" % value
            elif kind is not bytes:
                if isinstance(value, str):
                    value = value.encode()
                elif isinstance(value, bool):
                    raise TypeError("a bool is not a Redis argument")
                elif isinstance(value, (int, float)):
                    value = repr(value).encode()
            if type(value) is bytes and len(value) < _JOIN_BELOW:  # the common case: a name, a key, a number
                pending.append(b"$%d\r\n%b\r\n" % (len(value), value))
                continue
            parts: Sequence[Buffer] = value if isinstance(value, (list, tuple)) else (value,)
            pending.append(b"$%d\r\n" % sum(_nbytes(part) for part in parts))
            for part in parts:
                if _nbytes(part) < _JOIN_BELOW:
                    pending.append(part)
                else:
                    out.append(b"".join(pending))
                    out.append(part if isinstance(part, memoryview) else memoryview(part))
                    pending = []
            pending.append(_CRLF)
    out.append(b"".join(pending))
    return out


_NAMED = {name: b"$%d\r\n%s\r\n" % (len(name), name.encode()) for name in (
    "MULTI", "EXEC", "SET", "NX", "PX", "GET", "GETEX", "GETDEL", "GETRANGE", "STRLEN", "SADD", "PEXPIRE",
    "RPUSH", "BLPOP", "EVALSHA", "EXISTS", "DEL", "UNLINK", "LLEN")}
"""The RESP bulk strings of the command names and options kvredis sends most (small entries feel each
argument's encoding)."""


def send(sock: socket.socket, buffers: Sequence[Buffer]) -> None:
    """Write every buffer, in order: scatter-gather where the socket allows it (not over TLS)."""
    if len(buffers) == 1:
        sock.sendall(buffers[0])
        return
    if isinstance(sock, ssl.SSLSocket) or getattr(sock, "sendmsg", None) is None:
        for buffer in buffers:
            sock.sendall(buffer)
        return
    views = [b for b in buffers if _nbytes(b)]
    start = 0
    while start < len(views):
        sent = sock.sendmsg(views[start:start + _IOV_MAX])
        # Skip what went out whole; cut the first buffer that went out in part.
        while start < len(views) and sent >= _nbytes(views[start]):
            sent -= _nbytes(views[start])
            start += 1
        if sent:
            views[start] = memoryview(views[start]).cast("B")[sent:]


def pack_getdel(key: str) -> bytes:
    """The RESP encoding of ``GETDEL key``."""
    raw = key.encode()
    return b"*2\r\n$6\r\nGETDEL\r\n$%d\r\n%s\r\n" % (len(raw), raw)


Place = Callable[[int], "Sequence[memoryview] | None"]
"""Where a bulk reply of the given length goes: buffers whose lengths add up to it, filled in order (the
reply is then returned as :class:`Placed`), or ``None`` for a fresh ``bytearray`` as usual."""


class Placed:
    """A bulk reply that was received into the buffers its :data:`Place` gave."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class RespError(KVRedisError):
    """Redis answered a command with an error reply (``-ERR ...``)."""


class ProtocolError(KVRedisError):
    """The server sent something that is not the reply expected."""


@contextlib.contextmanager
def blocking(sock: socket.socket) -> Iterator[None]:
    """The socket in blocking mode, its Python timeout kept by the kernel (``SO_RCVTIMEO``/``SO_SNDTIMEO``),
    for a bulk transfer.

    A socket with a Python timeout is non-blocking underneath: every ``recv`` returns what has arrived, and
    the reading thread needs the GIL back after each one. In an engine whose threads spin on the GIL
    (vLLM's worker busy loop), that wait is most of a load. Blocking, a ``MSG_WAITALL`` receive of a whole
    piece is one system call that holds no GIL until the piece is in place. A timeout raises
    :class:`TimeoutError`, as with the Python timeout. TLS sockets are left as they are."""
    timeout = sock.gettimeout()
    if isinstance(sock, ssl.SSLSocket) or timeout is None:
        yield
        return
    seconds = max(timeout, 0.001)
    bound = struct.pack("ll", int(seconds), int(seconds % 1 * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, bound)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, bound)
    sock.settimeout(None)
    try:
        yield
    except BlockingIOError as exc:  # the kernel's bound ran out (EAGAIN)
        raise TimeoutError(f"no progress within {timeout:g} s") from exc
    finally:
        zero = struct.pack("ll", 0, 0)
        with contextlib.suppress(OSError):  # a closed socket: it is disconnected anyway
            sock.settimeout(timeout)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, zero)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, zero)


class BulkReader:
    """Reads RESP replies from a socket, copying bulk payloads straight into destination buffers."""

    def __init__(self, sock: socket.socket, buffer_bytes: int = 64 << 10) -> None:
        self._sock = sock
        self._buffer = bytearray(buffer_bytes)
        self._large = len(self._buffer)  # a placed reply this long or longer is read past the buffer
        self._start = 0
        self._end = 0
        # Scatter receives (one system call fills many buffers) need a plain socket; TLS reads one at a time.
        self._scatter = not isinstance(sock, ssl.SSLSocket) and hasattr(sock, "recvmsg_into")
        # A blocking socket (see :func:`blocking`) waits in the kernel for a whole buffer.
        self._wait_all = socket.MSG_WAITALL if self._scatter and sock.gettimeout() is None else 0

    def _fill(self, most: int = 0) -> None:
        """Receive what the socket has into the buffer (``most`` bytes at most, if given)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buffer):
            # Keep the unread bytes, move them to the front (and grow if they fill the buffer: a long line).
            remaining = self._buffer[self._start:self._end]
            if len(remaining) == len(self._buffer):
                self._buffer += bytes(len(self._buffer))
            self._buffer[:len(remaining)] = remaining
            self._start, self._end = 0, len(remaining)
        free = memoryview(self._buffer)[self._end:]
        received = self._sock.recv_into(free[:most] if most else free)
        if received == 0:
            raise ConnectionError("Redis closed the connection in the middle of a reply")
        self._end += received

    def _line(self, most: int = 0) -> bytes:
        """The next line, without its CRLF; each receive takes ``most`` bytes at most, if given."""
        while True:
            found = self._buffer.find(_CRLF, self._start, self._end)
            if found >= 0:
                line = bytes(self._buffer[self._start:found])
                self._start = found + 2
                return line
            if self._end - self._start > _LINE_LIMIT:
                raise ProtocolError("reply line longer than expected")
            self._fill(most)

    def _read_exact(self, destination: memoryview) -> None:
        self._read_parts([destination])

    def _read_parts(self, parts: Sequence[memoryview]) -> None:
        """Fill ``parts`` in order from the stream: what is buffered first, then straight from the socket
        (scatter receives where the socket allows them)."""
        views = [part for part in parts if part.nbytes]
        first = 0
        while first < len(views) and self._start < self._end:
            view = views[first]
            buffered = min(self._end - self._start, view.nbytes)
            view[:buffered] = self._buffer[self._start:self._start + buffered]
            self._start += buffered
            if buffered == view.nbytes:
                first += 1
            else:
                views[first] = view[buffered:]
        sock = self._sock
        if not self._scatter:
            for view in views[first:]:
                position = 0
                while position < view.nbytes:
                    received = sock.recv_into(view[position:])
                    if received == 0:
                        raise ConnectionError("Redis closed the connection in the middle of a reply")
                    position += received
            return
        while first < len(views):
            received = sock.recvmsg_into(views[first:first + _IOV_MAX], 0, self._wait_all)[0]
            if received == 0:
                raise ConnectionError("Redis closed the connection in the middle of a reply")
            # Skip what was filled whole; cut the first buffer that was filled in part.
            while first < len(views) and received >= views[first].nbytes:
                received -= views[first].nbytes
                first += 1
            if received:
                views[first] = views[first][received:]

    def _skip(self, count: int) -> None:
        scratch = memoryview(bytearray(min(count, 1 << 20)))
        while count:
            step = min(count, scratch.nbytes)
            self._read_exact(scratch[:step])
            count -= step

    def read_reply(self, depth: int = 0, place: Place | None = None, expect: int = 0) -> Any:
        """One whole reply: ``bytearray`` (bulk), ``str`` (status), ``int``, ``list``, ``None`` (null), or a
        :class:`RespError` (returned, not raised: the reply was read whole and the connection is in step).

        With ``place``, each bulk string of the reply (those inside an array too, in order) is first offered
        to it: where it gives buffers, the bytes go straight there and the bulk reads as :class:`Placed`.
        ``expect`` is the reply's expected length, if known: a long one is received past the buffer."""
        line = self._line(_HEADER_READ if place is not None and expect >= self._large else 0)
        kind = line[:1]
        if kind == b"$":
            length = int(line[1:])
            if length < 0:
                return None
            parts = None if place is None else place(length)
            if parts is not None:
                if sum(part.nbytes for part in parts) != length:
                    raise ValueError(f"a placement of {sum(part.nbytes for part in parts)} bytes for a "
                                     f"{length}-byte reply")
                self._read_parts(parts)
                # A long placed reply is mostly followed by another (the next piece of a value).
                if self._line(_HEADER_READ if length >= self._large else 0) != b"":
                    raise ProtocolError("bulk reply not terminated by CRLF")
                return Placed(length)
            # The value and its CRLF in one read: the CRLF alone would often cost another recv.
            value = bytearray(length + 2)
            self._read_exact(memoryview(value))
            if value[length:] != _CRLF:
                raise ProtocolError("bulk reply not terminated by CRLF")
            del value[length:]
            return value
        if kind == b"*":
            count = int(line[1:])
            if count < 0:
                return None
            if depth >= _MAX_DEPTH:
                raise ProtocolError("reply nested deeper than expected")
            return [self.read_reply(depth + 1, place) for _ in range(count)]
        if kind == b"+":
            return line[1:].decode(errors="replace")
        if kind == b":":
            return int(line[1:])
        if kind == b"-":
            return RespError(line[1:].decode(errors="replace"))
        if kind == b"_":
            return None
        raise ProtocolError(f"unexpected reply {line[:40]!r}")

    def read_bulk_into(self, destination: memoryview) -> str | None:
        """Read one reply into ``destination``: ``None`` when it filled it, else why not.

        ``"partial"`` for a null (the key is gone), ``"corrupt"`` for a value of another length or type.
        """
        most = _HEADER_READ if destination.nbytes >= self._large else 0
        line = self._line(most)
        kind, body = line[:1], line[1:]
        if kind == b"-":
            text = body.decode(errors="replace")
            if text.startswith("WRONGTYPE"):
                return "corrupt"
            raise RespError(text)
        if kind == b"_":  # RESP3's null, when redis-py negotiated protocol 3
            return "partial"
        if kind != b"$":
            raise ProtocolError(f"expected a bulk reply, got {line[:40]!r}")
        length = int(body)
        if length < 0:
            return "partial"
        if length != destination.nbytes:
            self._skip(length + 2)
            return "corrupt"
        self._read_exact(destination)
        if self._line(most) != b"":
            raise ProtocolError("bulk reply not terminated by CRLF")
        return None


def take_into(
    sock: socket.socket, keys: Sequence[str], sizes: Sequence[int], out: memoryview, window_bytes: int,
    redirected: list[int] | None = None,
) -> tuple[int, str] | None:
    """GETDEL ``keys`` into consecutive slices of ``out``, keeping about ``window_bytes`` requested ahead.

    Returns ``None`` when every piece arrived whole, else the index of the first bad one and why
    (see :meth:`BulkReader.read_bulk_into`). No request is sent after a bad piece, and every request sent
    is read back, so the connection stays in step.

    With a ``redirected`` list (Redis Cluster), a ``MOVED``/``ASK``/``TRYAGAIN`` reply (the key's slot is
    being resharded: the server did not run that GETDEL) appends the piece's index there and the read goes
    on; the caller fetches those pieces elsewhere. Without it, such a reply raises :class:`RespError`.
    """
    reader = BulkReader(sock)
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    sent = received = in_flight = 0
    failure: tuple[int, str] | None = None
    while received < sent or (sent < len(keys) and failure is None):
        batch = []
        while failure is None and sent < len(keys) and (in_flight < window_bytes or sent == received):
            batch.append(pack_getdel(keys[sent]))
            in_flight += sizes[sent]
            sent += 1
        if batch:
            sock.sendall(b"".join(batch))
        try:
            problem = reader.read_bulk_into(out[offsets[received]:offsets[received + 1]])
        except RespError as exc:  # the error line was read whole: the connection is still in step
            if redirected is None or not str(exc).startswith(_REDIRECTIONS):
                raise
            redirected.append(received)
            problem = None
        if problem is not None and failure is None:
            failure = (received, problem)
        in_flight -= sizes[received]
        received += 1
    return failure


def call(sock: socket.socket, *commands: Sequence[Argument]) -> list[Any]:
    """Send ``commands`` in one write and read their replies (see :meth:`BulkReader.read_reply`)."""
    send(sock, encode(commands))
    reader = BulkReader(sock, 4096)  # short replies; a long value goes straight to its own buffer
    return [reader.read_reply() for _ in commands]


def call_in_groups(sock: socket.socket, groups: Iterable[Sequence[Sequence[Argument]]]) -> list[Any]:
    """:func:`call` of commands made a group at a time: each group goes out as soon as it is made (making the
    next overlaps sending this one), then every reply is read. For commands with short replies only (Redis
    buffers what it answers meanwhile; none is read before the last group went out). The socket blocks
    meanwhile (:func:`blocking`): a group's megabytes go out in one system call that holds no GIL."""
    count = 0
    with blocking(sock):
        for group in groups:
            send(sock, encode(group))
            count += len(group)
        reader = BulkReader(sock, 4096)
        return [reader.read_reply() for _ in range(count)]


def pipeline(sock: socket.socket, commands: Sequence[Sequence[Argument]], places: Sequence[Place | None],
             costs: Sequence[int], window_bytes: int,
             on_reply: Callable[[int, list[Any]], None] | None = None) -> list[Any]:
    """Send ``commands`` and read their replies (see :meth:`BulkReader.read_reply`; reply ``i`` is placed by
    ``places[i]``), keeping about ``window_bytes`` of replies requested ahead, by their expected sizes
    ``costs`` (at least one command is always in flight). Every command sent is read back, so the
    connection stays in step. The socket blocks meanwhile (:func:`blocking`): a reply is received in as few
    system calls as the kernel can manage, none of them holding the GIL.

    ``on_reply(i, replies)`` runs as reply ``i`` is in (``replies`` holds it and those before), while
    Redis goes on sending the next into the socket's buffer: work on a value done there overlaps the
    transfer of the next. It must not raise (the connection would be closed for being out of step)."""
    with blocking(sock):
        return _pipeline(sock, commands, places, costs, window_bytes, on_reply)


def _pipeline(sock: socket.socket, commands: Sequence[Sequence[Argument]], places: Sequence[Place | None],
              costs: Sequence[int], window_bytes: int,
              on_reply: Callable[[int, list[Any]], None] | None = None) -> list[Any]:
    reader = BulkReader(sock)
    replies: list[Any] = []
    total = len(commands)
    sent = in_flight = 0
    while len(replies) < total:
        if sent < total and (in_flight < window_bytes or sent == len(replies)):
            first = sent
            while sent < total and (in_flight < window_bytes or sent == first):
                in_flight += costs[sent]
                sent += 1
            send(sock, encode(commands[first:sent]))
        index = len(replies)
        replies.append(reader.read_reply(place=places[index], expect=costs[index]))
        in_flight -= costs[index]
        if on_reply is not None:
            on_reply(index, replies)
    return replies


def first_error(replies: Sequence[Any]) -> RespError | None:
    """The first error among ``replies``, looking inside arrays (a transaction's EXEC)."""
    for reply in replies:
        if isinstance(reply, RespError):
            return reply
        if isinstance(reply, list):
            found = first_error(reply)
            if found is not None:
                return found
    return None


def put_pieces(
    sock: socket.socket, keys: Sequence[str], pieces: Sequence[Buffer], ttl_ms: int, batch_bytes: int,
) -> RespError | None:
    """``SET key piece PX ttl_ms`` for each piece, pipelined; the first error reply, or ``None``.

    Pieces go out as they are (scatter-gather, no copy). The replies of one batch of about
    ``batch_bytes`` are read after the next batch is sent, so the pipe never drains while replies wait;
    every command sent is read back, so the connection stays in step.
    """
    reader = BulkReader(sock)
    error: RespError | None = None
    unread = 0
    position = 0
    while position < len(keys):
        commands = []
        size = 0
        start = position
        while position < len(keys) and (size < batch_bytes or position == start):
            commands.append(("SET", keys[position], pieces[position], "PX", ttl_ms))
            size += _nbytes(pieces[position])
            position += 1
        send(sock, encode(commands))
        if unread:
            error = _read_set_replies(reader, unread) or error
        unread = position - start
    if unread:
        error = _read_set_replies(reader, unread) or error
    return error


def _read_set_replies(reader: BulkReader, count: int) -> RespError | None:
    """Read one batch's ``count`` SET replies; the first error among them, or ``None``."""
    error: RespError | None = None
    for _ in range(count):
        reply = reader.read_reply()
        if reply != "OK" and error is None:
            error = reply if isinstance(reply, RespError) else RespError(f"SET answered {str(reply)[:60]}")
    return error
