"""Reading bulk replies straight into a caller's buffer, over a connection redis-py already opened.

redis-py (with or without hiredis) turns every reply into a new ``bytes`` object that kvredis then copies
into the output tensor: two passes over fresh memory per byte. Here the socket's ``recv_into`` writes the
payload directly where it belongs. Only the tiny RESP subset GETDEL needs is parsed: a bulk string, a
nil, or an error. The connection comes from redis-py's pool, so URL, TLS, ACL login and timeouts are
redis-py's; it is handed back clean, or disconnected if anything went wrong mid-reply.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

from kvredis.errors import KVRedisError

_CRLF = b"\r\n"
_REDIRECTIONS = ("MOVED ", "ASK ", "TRYAGAIN ")
_LINE_LIMIT = 4096


class RespError(KVRedisError):
    """Redis answered a command with an error reply (``-ERR ...``)."""


class ProtocolError(KVRedisError):
    """The server sent something that is not the reply expected."""


def pack_getdel(key: str) -> bytes:
    """The RESP encoding of ``GETDEL key``."""
    raw = key.encode()
    return b"*2\r\n$6\r\nGETDEL\r\n$%d\r\n%s\r\n" % (len(raw), raw)


class BulkReader:
    """Reads RESP replies from a socket, copying bulk payloads straight into destination buffers."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray(64 << 10)
        self._start = 0
        self._end = 0

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buffer):
            # Keep the unread bytes, move them to the front.
            remaining = self._buffer[self._start:self._end]
            self._buffer[:len(remaining)] = remaining
            self._start, self._end = 0, len(remaining)
        received = self._sock.recv_into(memoryview(self._buffer)[self._end:])
        if received == 0:
            raise ConnectionError("Redis closed the connection in the middle of a reply")
        self._end += received

    def _line(self) -> bytes:
        while True:
            found = self._buffer.find(_CRLF, self._start, self._end)
            if found >= 0:
                line = bytes(self._buffer[self._start:found])
                self._start = found + 2
                return line
            if self._end - self._start > _LINE_LIMIT:
                raise ProtocolError("reply line longer than expected")
            self._fill()

    def _read_exact(self, destination: memoryview) -> None:
        position = 0
        buffered = min(self._end - self._start, destination.nbytes)
        if buffered:
            destination[:buffered] = self._buffer[self._start:self._start + buffered]
            self._start += buffered
            position = buffered
        while position < destination.nbytes:
            received = self._sock.recv_into(destination[position:])
            if received == 0:
                raise ConnectionError("Redis closed the connection in the middle of a reply")
            position += received

    def _skip(self, count: int) -> None:
        scratch = memoryview(bytearray(min(count, 1 << 20)))
        while count:
            step = min(count, scratch.nbytes)
            self._read_exact(scratch[:step])
            count -= step

    def read_bulk_into(self, destination: memoryview) -> str | None:
        """Read one reply into ``destination``: ``None`` when it filled it, else why not.

        ``"partial"`` for a null (the key is gone), ``"corrupt"`` for a value of another length or type.
        """
        line = self._line()
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
        if self._line() != b"":
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
