"""Deterministic Redis keys for KV-cache entries.

A key names *what* a KV cache is: the prompt (token IDs and the roi mask, hashed with blake2b over
canonical int64 little-endian bytes, whatever dtype or device they came in) under a namespace and a
:class:`CacheIdentity` (model, KV dtype, layout, block size, tensor-parallel rank and size, format
version). Two processes that agree on those always compute the same key; Python's ``hash()`` would not.
All keys of one entry carry the prompt digest as a Redis Cluster hash tag, so they share one slot.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

FORMAT_VERSION = 1
_DIGEST_BYTES = 16  # 128 bits: collisions are out of reach, and entries re-check their tokens anyway.
_INTEGER_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True)
class CacheIdentity:
    """What decides whether a stored KV cache can be reused by a reader."""

    model: str = ""
    kv_dtype: str = ""
    layout: str = ""
    block_size: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    format_version: int = FORMAT_VERSION

    def digest(self) -> str:
        """A short stable hex digest of every field (part of each key)."""
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(canonical, digest_size=8).hexdigest()


def canonical_tokens(input_tokens: Any) -> np.ndarray:
    """Token IDs as a flat little-endian int64 array, from a tensor (any device), array or sequence."""
    if isinstance(input_tokens, torch.Tensor):
        if input_tokens.dtype not in _INTEGER_DTYPES:
            raise TypeError(f"token IDs must be an integer tensor, got {input_tokens.dtype}")
        flat = input_tokens.detach().to("cpu", torch.int64).reshape(-1).numpy()
    else:
        flat = np.asarray(input_tokens)
        if flat.size and flat.dtype.kind not in "iu":
            raise TypeError(f"token IDs must be integers, got {flat.dtype}")
        flat = flat.reshape(-1)
    return np.ascontiguousarray(flat, dtype="<i8")


def canonical_roi(roi: Any, num_tokens: int) -> np.ndarray:
    """The roi mask as a flat uint8 0/1 array; ``None`` means every token."""
    if roi is None:
        return np.ones(num_tokens, dtype=np.uint8)
    if isinstance(roi, torch.Tensor):
        mask = roi.detach().to("cpu").reshape(-1).numpy()
    else:
        mask = np.asarray(roi).reshape(-1)
    if mask.shape[0] != num_tokens:
        raise ValueError(f"roi has {mask.shape[0]} elements but there are {num_tokens} tokens")
    return np.ascontiguousarray(mask != 0, dtype=np.uint8)


@dataclass(frozen=True, eq=False)
class Prompt:
    """A prompt in canonical form (int64 tokens, uint8 roi mask) and its blake2b digest, computed once."""

    tokens: np.ndarray
    mask: np.ndarray
    digest: str

    @classmethod
    def of(cls, input_tokens: Any, roi: Any = None) -> Prompt:
        """Canonicalise and hash tokens (tensor on any device, array or sequence) and a roi mask."""
        tokens = canonical_tokens(input_tokens)
        mask = canonical_roi(roi, tokens.shape[0])
        hasher = hashlib.blake2b(digest_size=_DIGEST_BYTES, person=b"kvredis-prompt")
        hasher.update(tokens.shape[0].to_bytes(8, "little"))
        hasher.update(tokens.data.cast("B"))
        hasher.update(mask.data)
        return cls(tokens, mask, hasher.hexdigest())


def prompt_digest(input_tokens: Any, roi: Any = None) -> str:
    """The blake2b hex digest of the canonical tokens and roi mask."""
    return Prompt.of(input_tokens, roi).digest


@dataclass(frozen=True)
class EntryKeys:
    """The keys of every entry stored for one prompt.

    ``queue`` is a list of entry records, taken with a blocking pop; each chunked entry's payload pieces
    live in ``chunk(entry_id, i)``. The ``{digest}`` hash tag keeps them in one cluster slot.
    """

    prefix: str
    digest: str

    @property
    def queue(self) -> str:
        """The list holding this prompt's entry records."""
        return f"{self.prefix}:{{{self.digest}}}:q"

    def chunk(self, entry_id: str, index: int) -> str:
        """The key of payload piece ``index`` of entry ``entry_id``."""
        return f"{self.prefix}:{{{self.digest}}}:{entry_id}:{index}"


@dataclass(frozen=True)
class KeySpace:
    """Keys under one namespace and cache identity."""

    namespace: str
    identity: CacheIdentity = CacheIdentity()

    @cached_property
    def prefix(self) -> str:
        """The prefix of every key this key space writes."""
        return f"{self.namespace}:{self.identity.digest()}"

    @property
    def namespace_pattern(self) -> str:
        """A SCAN/ACL pattern covering every key of the namespace, whatever the identity."""
        return f"{self.namespace}:*"

    def entry(self, input_tokens: Any, roi: Any = None) -> EntryKeys:
        """The keys for a prompt's entries."""
        return EntryKeys(self.prefix, prompt_digest(input_tokens, roi))

    def keys_for(self, prompt: Prompt) -> EntryKeys:
        """The keys for an already canonical prompt's entries."""
        return EntryKeys(self.prefix, prompt.digest)
