"""Redis errors as kvredis's: where redis-py's exceptions (and the socket's, and error replies of kvredis's
own framing) become :class:`~kvredis.KVRedisError` and its kinds, each naming what failed and, where it
helps, why (TLS, the ACL, a cluster between primaries)."""

from __future__ import annotations

import contextlib
import re
import ssl
from collections.abc import Iterator, Sequence
from typing import Any

import redis
from redis.sentinel import MasterNotFoundError

from kvredis.config import KVRedisConfig
from kvredis.errors import KVRedisConnectionError, KVRedisError, KVRedisTimeoutError
from kvredis.store import resp

REDIRECTS = 16
"""How many times one call follows MOVED/ASK/TRYAGAIN before giving up (redis-py's own limit is 16)."""


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


def _denied(exc: BaseException) -> BaseException | None:
    """The NOPERM error behind ``exc`` (redis-py hides it behind its own when discovering a cluster)."""
    seen: BaseException | None = exc
    for _ in range(6):
        if seen is None:
            return None
        if isinstance(seen, redis.exceptions.NoPermissionError) or "NOPERM" in str(seen):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


_PIPELINE_NOTE = re.compile(r"Command # (\d+) \((\S+).*? of pipeline caused error: ", re.DOTALL)


def _without_arguments(text: str) -> str:
    """redis-py quotes a failed pipeline command with its arguments (a binary record): keep only its name."""
    return _PIPELINE_NOTE.sub(lambda m: f"command {m[1]} of the pipeline ({m[2]}) failed: ", text)


@contextlib.contextmanager
def translate_errors(what: str, config: KVRedisConfig | None = None) -> Iterator[None]:
    """Re-raise redis-py errors raised inside the block as kvredis errors naming ``what``."""
    try:
        yield
    except Exception as exc:
        error = translated(exc, what, config)
        if error is None:
            raise
        raise error from None


def translated(exc: BaseException, what: str, config: KVRedisConfig | None = None) -> KVRedisError | None:
    """The kvredis error for ``exc``, a redis-py (or socket) error raised by ``what``; ``None`` for any other
    exception, a kvredis one included (translated already: a cluster client made on first use, say)."""
    if isinstance(exc, KVRedisError):
        return None
    where = f" at {config.masked_url}" if config is not None else ""
    if isinstance(exc, redis.exceptions.TimeoutError):
        return KVRedisTimeoutError(f"{what}{where} timed out: {exc}")
    if isinstance(exc, redis.exceptions.AuthenticationError):
        return KVRedisConnectionError(f"{what}{where}: authentication failed: {exc}")
    if isinstance(exc, MasterNotFoundError):
        return KVRedisConnectionError(
            f"{what}{where} failed: no sentinel names a healthy primary (sentinels unreachable, wrong "
            f"service name, or a failover in progress): {exc}"
        )
    if isinstance(exc, redis.exceptions.ClusterDownError):  # before ResponseError: it is one
        return KVRedisConnectionError(
            f"{what}{where} failed: the Redis Cluster is down for this key's slot (a primary failed and no "
            f"replica has taken over yet, or slots are unassigned): {exc}"
        )
    if isinstance(exc, (redis.exceptions.AskError, redis.exceptions.TryAgainError)):  # MOVED is an ASK
        return KVRedisError(
            f"{what}{where} failed: still redirected after {REDIRECTS} tries (resharding?): "
            f"{type(exc).__name__}: {exc}"
        )
    if isinstance(exc, redis.exceptions.SlotNotCoveredError):
        return KVRedisConnectionError(f"{what}{where} failed: no Redis Cluster node serves the slot: {exc}")
    if isinstance(exc, redis.exceptions.RedisClusterException):  # not a RedisError: cluster discovery failed
        cause = exc.__cause__  # what the last startup node said
        denied = _denied(exc)
        if denied is not None:
            return KVRedisError(
                f"{what}{where}: denied by the Redis ACL (NOPERM; discovering the cluster needs "
                f"+cluster|slots +command): {denied}"
            )
        if isinstance(cause, redis.exceptions.AuthenticationError):
            return KVRedisConnectionError(f"{what}{where}: authentication failed: {cause}")
        problem = _connection_problem(cause, config) if cause is not None else ""
        if cause is not None and problem != str(cause):  # TLS: say so
            return KVRedisConnectionError(
                f"{what}{where} failed: no Redis Cluster node could be reached: {problem}")
        return KVRedisConnectionError(f"{what}{where} failed: Redis Cluster: {exc}")
    if isinstance(exc, redis.exceptions.ClusterError):  # "TTL exhausted": redirected too many times
        return KVRedisError(
            f"{what}{where} failed: Redis Cluster redirected the command too many times (resharding?): {exc}"
        )
    if isinstance(exc, redis.exceptions.ConnectionError):
        return KVRedisConnectionError(f"{what}{where} failed: {_connection_problem(exc, config)}")
    if isinstance(exc, redis.exceptions.ResponseError):
        text = _without_arguments(str(exc))
        if "NOPERM" in text or isinstance(exc, redis.exceptions.NoPermissionError):
            return KVRedisError(f"{what}{where}: denied by the Redis ACL (NOPERM): {text}")
        if "user executing the script can't run" in text:  # a command inside a script (Redis 7 words it so)
            return KVRedisError(f"{what}{where}: denied by the Redis ACL (NOPERM) in a script: {text}")
        if "EXEC without MULTI" in text:  # MULTI itself was refused; redis-py reports only the EXEC
            return KVRedisError(
                f"{what}{where}: MULTI was refused (NOPERM? the Redis ACL needs +multi +exec): {text}"
            )
        if "WRONGTYPE" in text:
            return WrongTypeError(f"{what}{where} failed: a key holds a foreign value: {text}")
        return KVRedisError(f"{what}{where} failed: {type(exc).__name__}: {text}")
    if isinstance(exc, redis.exceptions.RedisError):
        return KVRedisError(f"{what}{where} failed: {type(exc).__name__}: {exc}")
    if isinstance(exc, TimeoutError):  # the bulk path reads the socket itself
        return KVRedisTimeoutError(f"{what}{where} timed out: {exc}")
    if isinstance(exc, OSError):  # TLS set-up errors and the like surface as plain OSErrors.
        return KVRedisConnectionError(f"{what}{where} failed: {_connection_problem(exc, config)}")
    return None


def raise_first_error(replies: Sequence[Any]) -> None:
    """Raise the first error reply of kvredis's framing (:mod:`kvredis.store.resp`) as redis-py would have, so
    that :func:`translate_errors` names it (NOPERM, WRONGTYPE...)."""
    error = resp.first_error(replies)
    if error is not None:
        text = str(error)
        if text.startswith("NOPERM"):
            raise redis.exceptions.NoPermissionError(text)
        raise redis.exceptions.ResponseError(text)
