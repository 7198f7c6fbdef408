"""The exceptions kvredis raises: one base class, one subclass per cause.

Errors from the layers below (redis-py, msgpack, the socket) are translated at the Redis-access
boundary (:mod:`kvredis.store.client`), so callers only ever catch these.
"""

from __future__ import annotations

from pathlib import Path


class KVRedisError(Exception):
    """Base class of every error kvredis raises."""


class ConfigError(KVRedisError, ValueError):
    """A setting is missing, malformed or out of range; the message names the setting and value."""


class CodecError(KVRedisError, ValueError):
    """A blob could not be encoded or decoded: truncated, corrupt, foreign, oversized or inconsistent."""


class KVRedisConnectionError(KVRedisError, ConnectionError):
    """Redis could not be reached, refused the credentials, or dropped the connection."""


class KVRedisTimeoutError(KVRedisError, TimeoutError):
    """A Redis call did not finish within its configured bound."""


class EntryTooLargeError(KVRedisError, ValueError):
    """An entry is larger than ``KVREDIS_MAX_ENTRY_BYTES`` allows."""


class StackError(KVRedisError):
    """The one-machine stack (``kvredis up``, ``kvredis demo``) could not be set up, or a part failed."""


class ChildFailed(StackError):
    """A child exited or never became healthy; the message names it and quotes the end of its log."""

    def __init__(self, role: str, reason: str, log_path: Path | None, log_tail: str = "") -> None:
        self.role = role
        self.reason = reason
        self.log_path = log_path
        message = f"{role} failed: {reason}"
        if log_path is not None:
            message += f"\n--- last lines of {log_path} ---\n{log_tail}\n---"
        super().__init__(message)
