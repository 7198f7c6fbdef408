"""The seed's KV connector (vLLM's V0 API) over :class:`~kvredis.v0.buffer.RedisLookupBuffer`.

What it reads from vLLM's ``model_input`` (V0 ``ModelInputForGPUWithSamplingMetadata``):

- ``model_input.input_tokens``: the batch's prompt tokens, requests back to back (1-D int tensor);
- ``model_input.attn_metadata.seq_lens``: each request's length, in batch order;
- ``model_input.attn_metadata.slot_mapping``: the cache slot (``block * block_size + offset``) of
  every token, flattened;
- ``model_executable.model.start_layer`` / ``end_layer`` when present (pipeline parallelism), else
  every layer in ``kv_caches``.

Each layer's cache is the paged ``(2, num_blocks, block_size, num_kv_heads, head_size)`` tensor. Sending
gathers each request's K and V into ``[layers, tokens, heads, head_size]``; receiving scatters them to
the receiver's own slots.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import redis
import torch

from kvredis.config import KVRedisConfig
from kvredis.errors import KVRedisError
from kvredis.store.keys import CacheIdentity
from kvredis.v0.buffer import RedisLookupBuffer

logger = logging.getLogger("kvredis.connector")


class RedisConnector:
    """``send_kv_caches_and_hidden_states`` / ``recv_kv_caches_and_hidden_states`` through Redis."""

    def __init__(
        self,
        config: KVRedisConfig | None = None,
        *,
        identity: CacheIdentity | None = None,
        buffer: RedisLookupBuffer | None = None,
        client: redis.Redis | None = None,
    ) -> None:
        self.config = config if config is not None else KVRedisConfig.from_env()
        if buffer is None:
            buffer = RedisLookupBuffer(self.config, client, identity=identity)
        self.buffer = buffer

    def send_kv_caches_and_hidden_states(
        self,
        model_executable: Any,
        model_input: Any,
        kv_caches: Sequence[torch.Tensor],
        hidden_or_intermediate_states: torch.Tensor | Any,
    ) -> None:
        """Store each prefilled request's K, V and hidden states under its tokens."""
        if _is_profiling(kv_caches):
            return
        tokens, spans, slots = _batch(model_input)
        layers = _layer_range(model_executable, kv_caches)
        for start, end in spans:
            request_slots = slots[start:end]
            keys = torch.stack([_flat(kv_caches[i][0])[request_slots] for i in layers])
            values = torch.stack([_flat(kv_caches[i][1])[request_slots] for i in layers])
            hidden = hidden_or_intermediate_states[start:end] if isinstance(
                hidden_or_intermediate_states, torch.Tensor) else None
            self.buffer.insert(tokens[start:end], None, keys, values, hidden)

    def recv_kv_caches_and_hidden_states(
        self, model_executable: Any, model_input: Any, kv_caches: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor | None, bool, Any]:
        """Load each request's K and V into ``kv_caches``; bypass the model only if all were received."""
        if _is_profiling(kv_caches):
            return None, False, model_input
        tokens, spans, slots = _batch(model_input)
        layers = _layer_range(model_executable, kv_caches)
        hidden_parts: list[torch.Tensor] = []
        complete = True
        for start, end in spans:
            hidden = self._receive_one(tokens[start:end], slots[start:end], kv_caches, layers)
            if hidden is None:
                complete = False
            else:
                hidden_parts.append(hidden)
        if not complete or not hidden_parts:
            return None, False, model_input
        return torch.cat(hidden_parts, dim=0), True, model_input

    def _receive_one(
        self,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        layers: range,
    ) -> torch.Tensor | None:
        try:
            _, _, keys, values, hidden = self.buffer.drop_select(tokens, None)
        except KVRedisError as exc:
            logger.warning("KV for a %d-token request not received, recomputing: %s", len(tokens), exc)
            return None
        if keys is None or values is None or hidden is None:
            return None
        sample = kv_caches[layers.start]
        expected = (len(layers), len(tokens), sample.shape[-2], sample.shape[-1])
        if tuple(keys.shape) != expected or tuple(values.shape) != expected or keys.dtype != sample.dtype:
            logger.warning(
                "KV for a %d-token request has shape %s %s, expected %s %s: recomputing",
                len(tokens), tuple(keys.shape), keys.dtype, expected, sample.dtype,
            )
            return None
        for position, layer in enumerate(layers):
            cache = kv_caches[layer]
            _flat(cache[0])[slots] = keys[position].to(cache.device)
            _flat(cache[1])[slots] = values[position].to(cache.device)
        return hidden

    def close(self) -> None:
        """Close the lookup buffer."""
        self.buffer.close()


def _is_profiling(kv_caches: Sequence[torch.Tensor]) -> bool:
    # vLLM's memory-profiling run passes empty caches; there is nothing to move.
    return not kv_caches or kv_caches[0].numel() == 0


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """``(num_blocks, block_size, H, D)`` viewed as ``(slots, H, D)``."""
    return cache.reshape(-1, cache.shape[-2], cache.shape[-1])


def _batch(model_input: Any) -> tuple[torch.Tensor, list[tuple[int, int]], torch.Tensor]:
    tokens = model_input.input_tokens
    metadata = model_input.attn_metadata
    spans, start = [], 0
    for length in metadata.seq_lens:
        spans.append((start, start + int(length)))
        start += int(length)
    if start > tokens.numel():
        raise ValueError(f"seq_lens add up to {start} tokens but input_tokens has {tokens.numel()}")
    return tokens, spans, metadata.slot_mapping.flatten().long()


def _layer_range(model_executable: Any, kv_caches: Sequence[torch.Tensor]) -> range:
    model = getattr(model_executable, "model", None)
    start = getattr(model, "start_layer", 0)
    end = getattr(model, "end_layer", start + len(kv_caches))
    # V0 hands each pipeline stage only its own layers' caches, indexed from zero.
    return range(0, end - start)
