"""kvredis: vLLM KV-cache transfer for disaggregated prefill, through Redis.

``RedisLookupBuffer`` (``kvredis.buffer``) and ``RedisConnector`` (``kvredis.connector``) are imported
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
    from kvredis.buffer import RedisLookupBuffer
    from kvredis.connector import RedisConnector

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
        from kvredis.buffer import RedisLookupBuffer

        return RedisLookupBuffer
    if name == "RedisConnector":
        from kvredis.connector import RedisConnector

        return RedisConnector
    raise AttributeError(f"module 'kvredis' has no attribute {name!r}")
