"""kvredis: vLLM KV-cache transfer for disaggregated prefill, through Redis.

``RedisLookupBuffer`` (``kvredis.v0.buffer``) and ``RedisConnector`` (``kvredis.v0.connector``) are imported
on first use, so ``import kvredis`` stays cheap for the command line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvredis.config import KVRedisConfig
from kvredis.errors import (
    CodecError,
    ConfigError,
    EntryTooLargeError,
    KVRedisConnectionError,
    KVRedisError,
    KVRedisTimeoutError,
)

if TYPE_CHECKING:
    from kvredis.v0.buffer import RedisLookupBuffer
    from kvredis.v0.connector import RedisConnector

__version__ = "0.1.0"

__all__ = [
    "CodecError",
    "ConfigError",
    "EntryTooLargeError",
    "KVRedisConfig",
    "KVRedisConnectionError",
    "KVRedisError",
    "KVRedisTimeoutError",
    "RedisConnector",
    "RedisLookupBuffer",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name == "RedisLookupBuffer":
        from kvredis.v0.buffer import RedisLookupBuffer

        return RedisLookupBuffer
    if name == "RedisConnector":
        from kvredis.v0.connector import RedisConnector

        return RedisConnector
    raise AttributeError(f"module 'kvredis' has no attribute {name!r}")
