"""An engine's KV cache groups as kvredis stores them: *series* of layers, each with the positions a reader
needs of it.

vLLM's hybrid KV cache manager gives each kind of layer a group with a block table of its own (a model may
hold several groups of one kind). kvredis stores the layers of one kind together, as one series of chunks
under a key prefix of its own (:attr:`Series.tag`):

- **full attention** (``""``, the only series of a plain model, whose keys it keeps): every position of the
  prompt, in chunks of ``chunk_tokens``;
- **sliding window** (``w<window>``) and **chunked local attention** (``l<chunk>``): vLLM frees a request's
  blocks as they leave the window, so a reader resuming at position ``s`` needs only the blocks of the
  positions ``s`` still attends to (:meth:`Series.needed`). These series are stored a block a chunk, and
  only near the prompt's end: a chunk of such a layer names the block's prefix like any other, so a block a
  prefill still held is a hit for any reader whose window covers it.
- **state** (``s``): Mamba and linear-attention (Gated DeltaNet) layers keep one recurrent state a request,
  not a page a position. With prefix caching on (vLLM's ``align`` mode, its default for these models) a
  request's block ``j`` of such a group holds the state after positions ``0..(j+1)*block_size-1``, and vLLM
  ends a prefill step at the prompt's last block boundary, so the state there survives the last step. That
  state is stored, keyed as the block it ends: a reader resumes exactly there (never from the state after
  the whole prompt, which already holds the last token a reader must compute to sample), and computes the
  rest of the prompt, less than a block.

With prefix caching off (``none`` mode) vLLM keeps only the running state, which no reader can resume from:
such engines serve with the connector moving nothing (:func:`unsupported_state`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvredis.errors import ConfigError

FULL, WINDOW, LOCAL, STATE = "full", "window", "local", "state"


@dataclass(frozen=True)
class Series:
    """Layers stored together: their kind, its span of positions (the window or the local chunk, in
    tokens; 0 for full attention), the KV cache groups they come from and their layers in storage order."""

    tag: str
    kind: str
    span: int
    groups: tuple[int, ...]
    layers: tuple[str, ...]
    layer_groups: tuple[int, ...]  # the KV cache group of each of ``layers``
    shape: str = ""  # what a state holds (its tensors' shapes and dtypes): engines must agree on it

    def needed(self, resume: int) -> int:
        """The first position a reader that computes from position ``resume`` on attends to in these layers
        (everything before it may be missing)."""
        if self.kind == WINDOW:
            return max(0, resume - self.span + 1)
        if self.kind == LOCAL:
            return resume // self.span * self.span
        if self.kind == STATE:
            return max(0, resume - 1)  # the state at ``resume``, stored with the block that ends there
        return 0

    @property
    def whole(self) -> bool:
        """Whether every position of a prompt is kept (full attention)."""
        return self.kind == FULL


def cache_series(kv_cache_config: Any) -> tuple[Series, ...]:
    """The series of an engine's KV cache groups, full attention first; :class:`~kvredis.ConfigError` for a
    kind of layer kvredis cannot store. Groups whose KV vLLM does not transfer (its ephemeral replicas) are
    left out."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    kinds: dict[tuple[str, int], list[int]] = {}
    for index, group in enumerate(groups):
        if not getattr(group, "enable_kv_transfer", True):
            continue
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            key = (WINDOW, int(spec.sliding_window))
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            key = (LOCAL, int(spec.attention_chunk_size))
        elif isinstance(spec, FullAttentionSpec):
            # A sliding-window layer promoted to full attention (the hybrid manager off) keeps every page.
            key = (FULL, 0)
        elif isinstance(spec, MambaSpec):
            key = (STATE, 0)
        else:
            raise ConfigError(f"kvredis cannot store KV cache group {index} of this model: its layers "
                              f"({', '.join(group.layer_names[:3])}...) have a {type(spec).__name__}")
        kinds.setdefault(key, []).append(index)
    series = []
    for (kind, span), indexes in sorted(kinds.items(), key=lambda item: (item[0][0] != FULL, item[0])):
        layers = [(name, index) for index in indexes for name in groups[index].layer_names]
        tag = "" if kind == FULL else f"{kind[0]}{span or ''}"
        shape = _state_shape(groups[indexes[0]].kv_cache_spec) if kind == STATE else ""
        series.append(Series(tag, kind, span, tuple(indexes), tuple(name for name, _ in layers),
                             tuple(index for _, index in layers), shape))
    return tuple(series)


def _state_shape(spec: Any) -> str:
    """A state's tensors, as two engines must agree on them to share it (another TP size, conv kernel or
    state dtype makes other bytes)."""
    tensors = zip(getattr(spec, "shapes", ()), getattr(spec, "dtypes", ()), strict=False)
    return ",".join(f"{'x'.join(map(str, shape))}:{str(dtype).removeprefix('torch.')}"
                    for shape, dtype in tensors)


def unsupported_state(kv_cache_config: Any) -> str | None:
    """Why this engine's KV cannot be moved at all (Mamba or linear-attention layers whose state vLLM keeps
    only as it runs, with prefix caching off: no reader could resume from it); ``None`` if it can."""
    from vllm.v1.kv_cache_interface import MambaSpec

    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = group.kv_cache_spec
        if (getattr(group, "enable_kv_transfer", True) and isinstance(spec, MambaSpec)
                and getattr(spec, "mamba_cache_mode", "none") != "align"):
            return (f"Mamba or linear-attention layers ({group.layer_names[0]}...) whose state vLLM keeps at "
                    "block boundaries only with prefix caching on (--enable-prefix-caching)")
    return None


def resume_step(series: tuple[Series, ...], chunk_tokens: int) -> int:
    """The positions a reader may resume at are multiples of this: a state's block boundaries (whose length
    is the chunk's then), anywhere otherwise."""
    return chunk_tokens if any(s.kind == STATE for s in series) else 1


def describe(series: tuple[Series, ...]) -> list[str]:
    """The series as an announcement names them: what a peer's must equal for its chunks to fit."""
    return [f"{s.kind}{s.span or ''}x{len(s.layers)}" + (f"({s.shape})" if s.shape else "") for s in series]
