"""Redis access: connection set-up from the config, error translation, and the bulk piece transfers.

This module is the one boundary where redis-py's exceptions become kvredis's
(:func:`translate_errors`). Connections use redis-py's Python command packer instead of hiredis's: it
sends memoryviews straight to the socket, where hiredis's packer copies every large value twice
(../shared/notes/redis-transport.md). hiredis still parses replies. Retries are off: a retried RPUSH
would store an entry twice and a retried BLPOP could drop one, so a failed call fails once, clearly.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import ssl
from collections.abc import Iterator, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.connection import Encoder, PythonRespSerializer
from redis.retry import Retry

from kvredis import resp
from kvredis.config import KVRedisConfig
from kvredis.errors import KVRedisConnectionError, KVRedisError, KVRedisTimeoutError

logger = logging.getLogger("kvredis.client")

# Arguments longer than this (and every memoryview) go to the socket as buffers of their own; shorter
# ones are joined into one write. A small record's copy costs less than the extra send call it saves.
_BUFFER_CUTOFF = 256 << 10


class WrongTypeError(KVRedisError):
    """A key kvredis uses holds another kind of value (planted or foreign): Redis answered WRONGTYPE."""


def _connection_problem(exc: BaseException, config: KVRedisConfig | None) -> str:
    """redis-py's message, saying so when TLS is what failed (its own words are often cryptic)."""
    text = str(exc)
    if "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text:
        return f"TLS certificate verification failed (is KVREDIS_TLS_CA_FILE the server's CA?): {text}"
    cause: BaseException | None = exc
    for _ in range(5):  # redis-py raises its ConnectionError while handling the ssl module's error
        if cause is None or isinstance(cause, ssl.SSLError):
            break
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, ssl.SSLError):
        hint = ""
        if config is not None and config.tls_cert_file is None and "ssl_certfile=" not in config.url:
            hint = " (the server may require a client certificate: KVREDIS_TLS_CERT_FILE, _KEY_FILE)"
        return f"TLS connection failed{hint}: {text}"
    return text


_PIPELINE_NOTE = re.compile(r"Command # (\d+) \((\S+).*? of pipeline caused error: ", re.DOTALL)


def _without_arguments(text: str) -> str:
    """redis-py quotes a failed pipeline command with its arguments (a binary record): keep only its name."""
    return _PIPELINE_NOTE.sub(lambda m: f"command {m[1]} of the pipeline ({m[2]}) failed: ", text)


@contextlib.contextmanager
def translate_errors(what: str, config: KVRedisConfig | None = None) -> Iterator[None]:
    """Re-raise redis-py errors raised inside the block as kvredis errors naming ``what``."""
    where = f" at {config.masked_url}" if config is not None else ""
    try:
        yield
    except redis.exceptions.TimeoutError as exc:
        raise KVRedisTimeoutError(f"{what}{where} timed out: {exc}") from None
    except redis.exceptions.AuthenticationError as exc:
        raise KVRedisConnectionError(f"{what}{where}: authentication failed: {exc}") from None
    except redis.exceptions.ConnectionError as exc:
        raise KVRedisConnectionError(f"{what}{where} failed: {_connection_problem(exc, config)}") from None
    except redis.exceptions.ResponseError as exc:
        text = _without_arguments(str(exc))
        if "NOPERM" in text or isinstance(exc, redis.exceptions.NoPermissionError):
            raise KVRedisError(f"{what}{where}: denied by the Redis ACL (NOPERM): {text}") from None
        if "EXEC without MULTI" in text:  # MULTI itself was refused; redis-py reports only the EXEC
            raise KVRedisError(
                f"{what}{where}: MULTI was refused (NOPERM? the Redis ACL needs +multi +exec): {text}"
            ) from None
        if "WRONGTYPE" in text:
            raise WrongTypeError(f"{what}{where} failed: a key holds a foreign value: {text}") from None
        raise KVRedisError(f"{what}{where} failed: {type(exc).__name__}: {text}") from None
    except redis.exceptions.RedisError as exc:
        raise KVRedisError(f"{what}{where} failed: {type(exc).__name__}: {exc}") from None
    except TimeoutError as exc:  # the bulk path reads the socket itself
        raise KVRedisTimeoutError(f"{what}{where} timed out: {exc}") from None
    except OSError as exc:  # TLS set-up errors and the like surface as plain OSErrors.
        raise KVRedisConnectionError(f"{what}{where} failed: {_connection_problem(exc, config)}") from None


def connect(config: KVRedisConfig, *, read_timeout_s: float | None = None) -> redis.Redis:
    """A redis-py client for ``config``: URL, credentials, TLS, timeouts, no retries, zero-copy packer.

    ``read_timeout_s`` bounds each reply (default ``socket_timeout_s``).
    """
    kwargs: dict[str, Any] = {
        "socket_connect_timeout": config.connect_timeout_s,
        "socket_timeout": config.socket_timeout_s if read_timeout_s is None else read_timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "command_packer": PythonRespSerializer(_BUFFER_CUTOFF, Encoder("utf-8", "strict", False).encode),
    }
    # Credentials and query options go in as arguments, not in the URL: redis-py lets the URL's win over
    # arguments, which would silently ignore KVREDIS_PASSWORD or the socket bounds.
    url, options = config.connection_options()
    kwargs.update(options)
    tls_files = (config.tls_ca_file, config.tls_cert_file, config.tls_key_file)
    if not url.startswith("rediss://") and any(path is not None for path in tls_files):
        logger.warning("KVREDIS_TLS_* files are set but %s is not a rediss:// URL: TLS is not used",
                       config.masked_url)
    with translate_errors("connecting to Redis", config):
        return redis.Redis.from_url(url, **kwargs)


class RedisStore:
    """The Redis commands kvredis needs, each bounded by the config's timeouts and translated errors.

    Large payloads move as pieces: pipelined SETs with a TTL, and pipelined GETDELs copied into a
    caller's buffer, with about ``inflight_bytes`` in flight per round trip.
    """

    def __init__(self, config: KVRedisConfig, client: redis.Redis | None = None) -> None:
        self.config = config
        self._owns_clients = client is None
        self.redis = client if client is not None else connect(config)
        # Blocking pops wait up to the pop timeout on the server, so their socket bound is longer.
        self._popper = client if client is not None else connect(
            config, read_timeout_s=config.socket_timeout_s + config.pop_timeout_s
        )
        # vLLM's scheduler asks for every new request; a slow Redis must cost it little.
        self._prober = client if client is not None else connect(
            config, read_timeout_s=config.lookup_timeout_s
        )

    def _guard(self, what: str) -> contextlib.AbstractContextManager[None]:
        return translate_errors(what, self.config)

    def ping(self) -> None:
        """Raise a kvredis error unless Redis answers."""
        with self._guard("PING"):
            self.redis.ping()

    def push_record(self, queue: str, record: bytes | memoryview, ttl_ms: int) -> None:
        """Append ``record`` to list ``queue`` and refresh the list's TTL, atomically."""
        with self._guard(f"storing record in {queue}"):
            pipe = self.redis.pipeline(transaction=True)
            pipe.rpush(queue, record)
            pipe.pexpire(queue, ttl_ms)
            pipe.execute()

    def pop_record(self, queue: str, timeout_s: float) -> bytes | None:
        """Take the oldest record of ``queue``, waiting up to ``timeout_s`` for one; ``None`` if none came."""
        with self._guard(f"BLPOP {queue}"):
            reply = self._popper.blpop([queue], timeout=max(timeout_s, 0.001))
        if reply is None:
            return None
        record = reply[1]
        if not isinstance(record, bytes):
            raise KVRedisError("the Redis client decodes responses to text; kvredis needs raw bytes")
        return record

    def peek_length(self, queue: str) -> int:
        """How many records wait in ``queue`` (no side effect)."""
        with self._guard(f"LLEN {queue}"):
            return int(self._prober.llen(queue))

    def put_pieces(self, keys: Sequence[str], pieces: Sequence[bytes | memoryview], ttl_ms: int) -> None:
        """SET each key to its piece with a TTL, pipelined; raise if any SET was refused."""
        batch_bytes = max(self.config.write_batch_bytes, 1)
        with self._guard(f"storing {len(keys)} pieces"):
            pipe = self.redis.pipeline(transaction=False)
            pending = 0
            for key, piece in zip(keys, pieces, strict=True):
                pipe.set(key, piece, px=ttl_ms)
                pending += len(piece)
                if pending >= batch_bytes:
                    _check_all(pipe.execute(raise_on_error=True), "SET")
                    pending = 0
            if len(pipe):
                _check_all(pipe.execute(raise_on_error=True), "SET")

    def take_pieces(
        self, keys: Sequence[str], sizes: Sequence[int], out: memoryview
    ) -> tuple[str, str] | None:
        """GETDEL each key into consecutive slices of ``out``; ``None``, or the first bad key and why.

        Why is ``"partial"`` for a missing piece (expired, evicted) and ``"corrupt"`` for one of the wrong
        size or type (planted). Stops early at the first bad piece: the entry is lost either way, and the
        caller deletes what is left.
        """
        with self._guard(f"reading {len(keys)} pieces"):
            pool = self.redis.connection_pool
            connection = pool.get_connection()
            try:
                sock = getattr(connection, "_sock", None)
                if not isinstance(sock, socket.socket):  # fakeredis and other stand-ins
                    return self._take_pieces_pipelined(keys, sizes, out)
                failure = resp.take_into(sock, keys, sizes, out, self.config.inflight_bytes)
            except BaseException:
                # A reply may be half read: the connection cannot be reused.
                connection.disconnect()
                raise
            finally:
                pool.release(connection)
        return None if failure is None else (keys[failure[0]], failure[1])

    def _take_pieces_pipelined(
        self, keys: Sequence[str], sizes: Sequence[int], out: memoryview
    ) -> tuple[str, str] | None:
        per_batch = max(1, self.config.inflight_bytes // max(max(sizes, default=1), 1))
        position = 0
        for start in range(0, len(keys), per_batch):
            batch = keys[start:start + per_batch]
            pipe = self.redis.pipeline(transaction=False)
            for key in batch:
                pipe.getdel(key)
            replies = pipe.execute(raise_on_error=False)
            for key, size, value in zip(batch, sizes[start:start + per_batch], replies, strict=True):
                if value is None:
                    return key, "partial"
                if isinstance(value, redis.exceptions.ResponseError) and "WRONGTYPE" not in str(value):
                    raise value
                if not isinstance(value, bytes) or len(value) != size:
                    return key, "corrupt"
                out[position:position + size] = value
                position += size
        return None

    def delete(self, keys: Sequence[str]) -> int:
        """Delete keys (ignoring ones already gone); returns how many existed."""
        if not keys:
            return 0
        with self._guard(f"deleting {len(keys)} keys"):
            return int(self.redis.delete(*keys))

    def scan(self, pattern: str, count: int = 1000) -> Iterator[str]:
        """Iterate over keys matching ``pattern`` without blocking the server."""
        with self._guard(f"SCAN {pattern}"):
            for key in self.redis.scan_iter(match=pattern, count=count):
                yield key.decode() if isinstance(key, bytes) else str(key)

    def summary(self, pattern: str) -> dict[str, Any]:
        """Keys, entries, pieces, bytes and TTLs of the keys matching ``pattern``, and server memory."""
        keys = list(self.scan(pattern))
        entries = prompts = stored_bytes = 0
        ttls: list[int] = []
        with self._guard(f"summarising {pattern}"):
            pipe = self.redis.pipeline(transaction=False)
            for key in keys:
                pipe.type(key)
                pipe.pttl(key)
                pipe.memory_usage(key)
            replies = pipe.execute()
            queues = [key for i, key in enumerate(keys) if replies[3 * i] in (b"list", "list")]
            pipe = self.redis.pipeline(transaction=False)
            for key in queues:
                pipe.llen(key)
            entries = sum(int(n) for n in pipe.execute())
            prompts = len(queues)
            for i in range(len(keys)):
                ttl, usage = replies[3 * i + 1], replies[3 * i + 2]
                stored_bytes += int(usage or 0)
                if ttl is not None and int(ttl) >= 0:
                    ttls.append(int(ttl))
            memory = self.redis.info("memory")
        return {
            "keys": len(keys),
            "prompts": prompts,
            "entries": entries,
            "pieces": len(keys) - prompts,
            "bytes": stored_bytes,
            "ttl_min_s": min(ttls) / 1000 if ttls else None,
            "ttl_max_s": max(ttls) / 1000 if ttls else None,
            "keys_without_ttl": len(keys) - len(ttls),
            "redis_used_memory": memory.get("used_memory"),
            "redis_maxmemory": memory.get("maxmemory"),
            "redis_maxmemory_policy": memory.get("maxmemory_policy"),
        }

    def close(self) -> None:
        """Close the connections this store opened (not a client passed in)."""
        if self._owns_clients:
            self.redis.close()
            self._popper.close()
            self._prober.close()


def _check_all(replies: list[Any], command: str) -> None:
    for reply in replies:
        if reply is not True and reply != b"OK":
            raise KVRedisError(f"{command} was refused: {reply!r}")
