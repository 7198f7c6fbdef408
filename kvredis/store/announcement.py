"""What a prefill tells its decode through vLLM's ``kv_transfer_params``: which transfer it wrote, for what.

A producer's ``request_finished`` returns ``{"do_remote_prefill": true, "do_remote_decode": false,
"kvredis": {...}}`` (vLLM's P/D fields and kvredis's); a proxy relays them with the request to a decode,
whose connector takes exactly that transfer, and releases it itself when the decode never got the request.
Everything here is read from a peer, so each field is checked before it names a key:

- ``entry``: the transfer id (its record is :func:`kvredis.store.transfer.record_key`; the id is a capability:
  whoever holds it can take or release the transfer, so it is random and only the proxy and decode see it);
- ``digest``: the prompt digest of the request's tokens and context, checked against the decode's request;
- ``context``: the request's context digest (LoRA adapter, multimodal inputs, ``cache_salt``), so a decode
  handed another request's announcement sees that it is not its own;
- ``engine``: what decides whether the pages fit another engine (:data:`ENGINE_FIELDS`);
- ``shards``: the key prefix of every shard: a range of KV heads of a pipeline stage (one rank writes each);
- ``prompt_tokens``: the prompt's length, for logs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvredis.store.keys import check_digest, check_entry_id

GENERATION_FIELD = "cache_generation"
"""The engine field naming the cache generation a transfer is stored in (:mod:`kvredis.store.generation`;
absent: 0)."""
TRANSFER_PARAM = "kvredis"
"""The key under which the producer announces an entry in ``kv_transfer_params``."""

ENGINE_FIELDS = {
    "namespace": "namespace", "model": "model", "kv_dtype": "KV dtype", "layout": "page layout",
    "block_size": "block size", "kv_heads": "KV heads", "format_version": "entry format",
    "weights": "model weights and settings", "layers": "KV cache layers", "chunk_tokens": "chunk length",
    "series": "KV cache groups (attention kinds and windows)",
    "cache_generation": "cache generation (the namespace was reset, and one of the engines knows it already)",
}
"""The fields an announcement carries about the producer's engine, and how a warning names each (the engine
also says ``kv_parts``, the ranges its KV heads are split in: a reader's need only nest with them)."""

_SHARD_PREFIX = re.compile(r"\A[A-Za-z0-9_.-]{1,64}:[0-9a-f]{16}(:(?:[wl][0-9]{1,9}|s))?\Z")
_MAX_SHARDS = 1024


class MalformedAnnouncement(ValueError):
    """``kv_transfer_params`` carry a kvredis announcement that cannot be used (the message says why)."""


@dataclass(frozen=True)
class Announcement:
    """A producer's announcement of one entry; ``None`` for a field it did not give (or gave unusable,
    for ``digest``, ``context``, ``engine`` and ``shards``: a reader falls back on what it knows)."""

    entry_id: str | None
    digest: str | None = None
    context: str | None = None
    engine: Mapping[str, Any] | None = None
    shards: tuple[str, ...] | None = None
    prompt_tokens: int | None = None

    def transfer_ids(self) -> list[str]:
        """The ids of the transfer's records in each shard (the announced one; the ranks of a decode that
        read one shard together hand it on to each other under ids of their own)."""
        return [] if self.entry_id is None else [self.entry_id]

    def to_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` that announce this transfer to a decode: vLLM's own P/D fields (a decode
        with ``do_remote_prefill`` is counted as a remote prefill, reports the prefill's prefix-cache hit as
        its cached tokens, and has vLLM clean up when its serving layer rejects it) and kvredis's."""
        fields = {"prompt_tokens": self.prompt_tokens, "entry": self.entry_id, "digest": self.digest,
                  "context": self.context, "engine": dict(self.engine) if self.engine is not None else None,
                  "shards": list(self.shards) if self.shards is not None else None}
        return {"do_remote_prefill": True, "do_remote_decode": False,
                TRANSFER_PARAM: {name: value for name, value in fields.items() if value is not None}}

    def differences(self, engine: Mapping[str, Any]) -> list[str]:
        """How the announcing engine differs from ``engine``, one phrase a field (empty: the pages fit).
        An announcement without an engine description is taken to fit."""
        if self.engine is None:
            return []
        return [f"{label} {self.engine.get(name)!r} on prefill, {engine.get(name)!r} here"
                for name, label in ENGINE_FIELDS.items() if self.engine.get(name) != engine.get(name)]


def read_announcement(params: Any) -> Announcement | None:
    """The announcement in ``kv_transfer_params`` (``None`` where there is none); raises
    :class:`MalformedAnnouncement` for one that names no usable entry."""
    announced = params.get(TRANSFER_PARAM) if isinstance(params, Mapping) else None
    if announced is None:
        return None
    if not isinstance(announced, Mapping):
        raise MalformedAnnouncement(f"a malformed kvredis announcement {announced!r}")
    entry_id = announced.get("entry")
    try:
        entry_id = None if entry_id is None else check_entry_id(entry_id)
    except ValueError:
        raise MalformedAnnouncement(f"an announcement naming entry {entry_id!r}") from None
    digest = announced.get("digest")
    try:
        digest = None if digest is None else check_digest(digest)
    except ValueError:
        digest = None  # a reader that has the tokens does without it
    context = announced.get("context")
    engine = announced.get("engine")
    tokens = announced.get("prompt_tokens")
    return Announcement(
        entry_id,
        digest,
        context if isinstance(context, str) else None,
        engine if isinstance(engine, Mapping) else None,
        _shards(announced.get("shards")),
        tokens if type(tokens) is int else None,
    )


def _shards(shards: Any) -> tuple[str, ...] | None:
    """Key prefixes a peer named, if every one has the shape of a key space's prefix."""
    if (isinstance(shards, Sequence) and not isinstance(shards, str) and 0 < len(shards) <= _MAX_SHARDS
            and all(isinstance(shard, str) and _SHARD_PREFIX.match(shard) for shard in shards)):
        return tuple(shards)
    return None
