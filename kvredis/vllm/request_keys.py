"""What besides its tokens decides a vLLM request's KV, folded into the context digest of its key.

vLLM's prefix cache keeps two requests' blocks apart when their tokens match but their KV cannot: its block
hashes carry "extra keys" for the LoRA adapter, each multimodal input (its content hash and where its
placeholder tokens sit), the tenant's ``cache_salt`` and prompt embeddings. An entry in Redis must be kept
apart by the same things, or a request reads KV computed for another adapter, another image or another
tenant. :func:`request_context` reads them off a request (vLLM's ``Request``, by attribute, so this module
needs no vLLM) the same way on the producer and the consumer.

Where vLLM names an adapter by path, the key holds a digest of the adapter's files instead: a prefill and a
decode engine load the same adapter from their own folders, and re-pointing a name at another adapter
changes the digest. Requests with prompt embeddings are not moved at all (their KV depends on a tensor
that the token IDs do not show), nor are requests with images on an engine whose multimodal identifiers are
not content hashes (see :func:`request_context`).
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvredis.store.keys import context_digest

_HASH_CHUNK = 1 << 20
UNHASHED_MULTIMODAL = ("multimodal inputs that vLLM names by a counter, not by their content (prefix caching "
                       "and the multimodal processor cache are both off; turn either on to move them)")
"""Why requests with images are not moved by an engine whose multimodal identifiers are not hashes."""


@dataclass(frozen=True)
class RequestContext:
    """A request's context digest (``""``: its tokens alone decide its KV), or why it cannot be moved."""

    digest: str = ""
    unsupported: str | None = None


def request_context(request: Any, adapters: AdapterDigests | None = None, *,
                    multimodal_hashed: bool = True) -> RequestContext:
    """The context of a vLLM ``Request``: its LoRA adapter, multimodal inputs and cache salt.
    ``multimodal_hashed=False``: the engine names multimodal inputs by something other than their content
    (vLLM's per-process counter), so a request with any is unsupported."""
    if getattr(request, "prompt_embeds", None) is not None:
        return RequestContext(unsupported="prompt embeddings")
    features = getattr(request, "mm_features", None) or ()
    if features and not multimodal_hashed:
        # Two engines' n-th images get the same name whatever they show: keyed by it, one image's KV
        # would be loaded for another with the same placeholder tokens.
        return RequestContext(unsupported=UNHASHED_MULTIMODAL)
    parts: list[tuple[str | int, ...]] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        content = (adapters or _ADAPTERS).digest(str(getattr(lora, "lora_path", "") or ""))
        parts.append(("lora", str(lora.lora_name), content))
    for feature in features:
        identifier = getattr(feature, "identifier", None)
        position = getattr(feature, "mm_position", None)
        if not identifier or position is None:
            return RequestContext(unsupported="a multimodal input without a content hash")
        parts.append(("mm", str(getattr(feature, "modality", "")), str(identifier), int(position.offset),
                      int(position.length)))
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(("salt", str(salt)))
    return RequestContext(context_digest(parts))


class AdapterDigests:
    """Digests of LoRA adapters' files, computed once per adapter and again only when a file changes."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[tuple[tuple[str, int, int], ...], str]] = {}
        self._lock = threading.Lock()

    def digest(self, path: str) -> str:
        """``"files:<blake2b>"`` of the adapter's files (names and bytes), or ``"path:<path>"`` where there
        is nothing to read (a path this process cannot see still keeps two adapters apart)."""
        files = _adapter_files(path)
        if not files:
            return f"path:{path}"
        signature = tuple((str(name), size, mtime) for name, size, mtime, _ in files)
        with self._lock:
            known = self._known.get(path)
        if known is not None and known[0] == signature:
            return known[1]
        hasher = hashlib.blake2b(digest_size=16, person=b"kvredis-lora")
        for name, size, _, full in files:
            hasher.update(f"{name}\0{size}\0".encode())
            with open(full, "rb") as handle:
                while block := handle.read(_HASH_CHUNK):
                    hasher.update(block)
        digest = "files:" + hasher.hexdigest()
        with self._lock:
            self._known[path] = (signature, digest)
        return digest


_ADAPTERS = AdapterDigests()


def _adapter_files(path: str) -> list[tuple[str, int, int, Path]]:
    """The adapter's regular files as ``(relative name, size, mtime_ns, path)``, sorted by name."""
    if not path:
        return []
    root = Path(path)
    try:
        if root.is_file():
            stat = root.stat()
            return [(root.name, stat.st_size, stat.st_mtime_ns, root)]
        if not root.is_dir():
            return []
        found = []
        for folder, _, names in os.walk(root):
            for name in names:
                full = Path(folder, name)
                stat = full.stat()
                found.append((full.relative_to(root).as_posix(), stat.st_size, stat.st_mtime_ns, full))
    except OSError:
        return []
    return sorted(found)
