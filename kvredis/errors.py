"""The exceptions kvredis raises: one base class, one subclass per cause.

Errors from the layers below (redis-py, msgpack, the socket) are translated at the Redis-access
boundary (:mod:`kvredis.client`), so callers only ever catch these.
"""

from __future__ import annotations


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
