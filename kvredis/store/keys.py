"""Deterministic Redis keys for KV-cache entries.

A key names *what* a KV cache is: the prompt (token IDs and the roi mask, hashed with blake2b over
canonical int64 little-endian bytes, whatever dtype or device they came in, together with a *context*
digest of whatever else decides the prompt's KV: a LoRA adapter, multimodal inputs, a tenant's salt; see
:func:`context_digest`) under a namespace and a :class:`CacheIdentity` (model, KV dtype, layout, block
size, tensor-parallel rank and size, format version). Two processes that agree on those always compute
the same key; Python's ``hash()`` would not. All keys of one entry carry the prompt digest as a Redis
Cluster hash tag, so they share one slot.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

FORMAT_VERSION = 2  # of the key layout, in every key prefix (2: prompts as chunks); blobs have their own
_DIGEST_BYTES = 16  # 128 bits: collisions are out of reach, and entries re-check their tokens anyway.
_CONTEXT = re.compile(rf"\A[0-9a-f]{{{2 * _DIGEST_BYTES}}}\Z")
_ENTRY_ID = re.compile(r"\A[0-9a-f]{16}\Z")
_PROMPT_HASH = hashlib.blake2b(digest_size=_DIGEST_BYTES, person=b"kvredis-prompt")  # copied, never updated
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
    weights: str = ""  # what else decides the KV a model computes: weights' dtype, quantization, rope...
    kv_heads: str = ""  # the KV heads a vLLM engine's chunk holds, "first-end/total" (in place of the rank)

    def digest(self) -> str:
        """A short stable hex digest of every field (part of each key)."""
        fields = asdict(self)
        for optional in ("weights", "kv_heads"):
            if not fields[optional]:
                del fields[optional]  # identities that do not say keep the keys they always had
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
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
    """A prompt in canonical form and its blake2b digest, computed once.

    ``tokens``: the token IDs as int64 little-endian (a flat memoryview, format ``q``); ``mask``: the roi
    mask as 0/1 bytes (a flat memoryview, format ``?``).
    """

    tokens: memoryview[int]
    mask: memoryview[bool]
    digest: str

    @classmethod
    def of(cls, input_tokens: Any, roi: Any = None, context: str = "") -> Prompt:
        """Canonicalise and hash tokens (tensor on any device, array or sequence), a roi mask and the
        prompt's context digest (``""``: nothing but the tokens decides its KV)."""
        tokens = _token_view(input_tokens)
        count = len(tokens)
        if roi is None:
            mask = memoryview(b"\x01" * count).cast("?")
        else:
            mask = memoryview(canonical_roi(roi, count).data).cast("?")
        hasher = _PROMPT_HASH.copy()
        hasher.update(count.to_bytes(8, "little"))
        hasher.update(tokens)
        hasher.update(mask)
        if context:
            # Only when present, so that context-free prompts keep the keys they always had.
            if not _CONTEXT.match(context):
                raise ValueError(f"a prompt's context must be a context_digest(), got {context!r}")
            hasher.update(b"context:" + context.encode())
        return cls(tokens, mask, hasher.hexdigest())


def _token_view(input_tokens: Any) -> memoryview[int]:
    """:func:`canonical_tokens` as a flat int64 memoryview, without numpy for the common inputs.

    An integer tensor's values are read with one ``tolist`` and a list or tuple of ints is packed with
    ``struct``: the fewest calls into torch and none into numpy, which a small entry and a lookup in
    vLLM's scheduler loop (a list of up to thousands of IDs) feel most right after other work. Anything
    else, or anything these refuse, takes the general path (which also raises the errors).
    """
    values = input_tokens
    kind = type(input_tokens)
    if kind is torch.Tensor and input_tokens.dtype in _INTEGER_DTYPES:
        values = input_tokens.tolist()  # ints from a 1-D tensor; an int or nested lists otherwise
        kind = type(values)
    if (kind is list or kind is tuple) and values and type(values[0]) is int:
        # A list led by a bool must raise (numpy makes an all-bool list a bool array): it takes the
        # general path, as does an empty one (numpy decides what an empty list or tensor is).
        try:
            packed = struct.pack(f"<{len(values)}q", *values)
        except (struct.error, TypeError, OverflowError):
            pass  # floats, strings, nested lists, values past int64
        else:
            return memoryview(packed).cast("q")
    return canonical_tokens(input_tokens).data.cast("B").cast("q")


def prompt_digest(input_tokens: Any, roi: Any = None, context: str = "") -> str:
    """The blake2b hex digest of the canonical tokens, roi mask and context digest."""
    return Prompt.of(input_tokens, roi, context).digest


def context_digest(parts: Sequence[Sequence[str | int]]) -> str:
    """A stable digest of what besides the tokens decides a prompt's KV; ``""`` when there is nothing.

    ``parts`` are tuples of strings and integers, each led by its kind (``("lora", name, content)``,
    ``("mm", identifier, offset, length)``, ``("salt", salt)``); their order is kept, since it is
    meaningful (the n-th image sits at the n-th placeholder).
    """
    if not parts:
        return ""
    canonical = []
    for part in parts:
        if not part or not all(isinstance(item, (str, int)) and not isinstance(item, bool) for item in part):
            raise TypeError(f"a context part is a non-empty tuple of strings and integers, got {part!r}")
        canonical.append(list(part))
    encoded = json.dumps(canonical, separators=(",", ":"), ensure_ascii=False).encode()
    return hashlib.blake2b(encoded, digest_size=_DIGEST_BYTES, person=b"kvredis-context").hexdigest()


def new_entry_id() -> str:
    """A fresh random entry id (64 bits, hex): names one entry's pieces and, when announced, its list."""
    try:
        return _ENTRY_IDS.pop()  # atomic: no two threads get the same
    except IndexError:
        # os.urandom 256 ids at a time: one getrandom call instead of one an entry.
        fresh = os.urandom(8 * 256).hex()
        _ENTRY_IDS[:] = [fresh[i:i + 16] for i in range(16, len(fresh), 16)]
        return fresh[:16]


_ENTRY_IDS: list[str] = []
if hasattr(os, "register_at_fork"):  # a forked child must not hand out its parent's ids
    os.register_at_fork(after_in_child=_ENTRY_IDS.clear)


def reader_id(entry_id: str, reader: int) -> str:
    """The transfer id under which reader ``reader`` of a transfer takes it: the id itself for the first,
    one derived from it for each other rank that reads the one copy a shard's ranks share (MLA's latent KV,
    KV heads replicated over ranks), so that each holds the chunks and pops a record of its own."""
    check_entry_id(entry_id)
    if reader == 0:
        return entry_id
    derived = hashlib.blake2b(f"{entry_id}:{reader}".encode(), digest_size=8, person=b"kvredis-reader")
    return derived.hexdigest()


def check_entry_id(entry_id: object) -> str:
    """``entry_id`` if it is one :func:`new_entry_id` could have made; a ``ValueError`` otherwise (a key
    must never be built from an arbitrary string a peer sent)."""
    if not isinstance(entry_id, str) or not _ENTRY_ID.match(entry_id):
        raise ValueError(f"not a kvredis entry id: {entry_id!r}")
    return entry_id


def check_digest(digest: object) -> str:
    """``digest`` if it has the form of a :func:`prompt_digest`; a ``ValueError`` otherwise (a digest a peer
    sent becomes part of a key)."""
    if not isinstance(digest, str) or not _CONTEXT.match(digest):
        raise ValueError(f"not a kvredis prompt digest: {digest!r}")
    return digest


@dataclass(frozen=True)
class EntryKeys:
    """The keys of every entry stored for one prompt.

    ``queue`` is a list of entry records, taken with a blocking pop by any reader of the prompt; an entry
    announced to one reader (by its id) has a list of its own, ``entry_queue(entry_id)``, so that no other
    entry of the prompt can be taken in its place. Each chunked entry's payload pieces live in
    ``chunk(entry_id, i)``. The ``{digest}`` hash tag keeps them in one cluster slot.
    """

    prefix: str
    digest: str

    @property
    def queue(self) -> str:
        """The list holding this prompt's entry records."""
        return f"{self.prefix}:{{{self.digest}}}:q"

    def entry_queue(self, entry_id: str) -> str:
        """The list holding the record of the one entry ``entry_id`` (an announced entry)."""
        check_entry_id(entry_id)
        return f"{self.prefix}:{{{self.digest}}}:{entry_id}:q"

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

    def entry(self, input_tokens: Any, roi: Any = None, context: str = "") -> EntryKeys:
        """The keys for a prompt's entries."""
        return EntryKeys(self.prefix, prompt_digest(input_tokens, roi, context))

    def keys_for(self, prompt: Prompt) -> EntryKeys:
        """The keys for an already canonical prompt's entries."""
        return EntryKeys(self.prefix, prompt.digest)
