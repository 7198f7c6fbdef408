"""What a vLLM engine is, as far as its KV pages are concerned: the supported releases, the identity an
entry is written for (:func:`cache_identity`), and the configurations whose pages the connector cannot
move (:func:`refuse_unsupported`), whether it names multimodal inputs by their content
(:func:`multimodal_inputs_hashed`). The scheduler and every worker compute the same identity from the same
configuration; a worker adds the KV heads it holds and its pipeline stage.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import TYPE_CHECKING, Any

import torch

from kvredis.errors import ConfigError
from kvredis.store.keys import CacheIdentity
from kvredis.vllm.heads import HeadSplit, part_label

if TYPE_CHECKING:
    from vllm.config import VllmConfig

SUPPORTED_VLLM = ((0, 32), (0, 34))
"""The oldest and newest vLLM minor versions this connector is tested against, inclusive."""


def check_vllm_version(version: str) -> None:
    """Raise :class:`~kvredis.ConfigError` unless ``version`` is within :data:`SUPPORTED_VLLM`."""
    match = re.match(r"(\d+)\.(\d+)", version)
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED_VLLM
    supported = f"{low_major}.{low_minor} to {high_major}.{high_minor}"
    if match is None:
        raise ConfigError(f"kvredis supports vLLM {supported}; cannot read this vLLM's version {version!r}")
    found = (int(match.group(1)), int(match.group(2)))
    if not SUPPORTED_VLLM[0] <= found <= SUPPORTED_VLLM[1]:
        raise ConfigError(f"kvredis supports vLLM {supported}; this is vLLM {version}")


def cache_identity(vllm_config: VllmConfig, part: int = 0, pp_rank: int = 0,
                   parts: int | None = None) -> CacheIdentity:
    """What decides whether a stored KV cache fits this engine, computed alike by scheduler and workers.

    Chunks are keyed by the KV heads they hold (:mod:`kvredis.vllm.heads`), not by the tensor-parallel rank
    or size: ``part`` of the engine's head ranges (or of ``parts`` ranges, another split's), so that engines
    of any two nesting TP sizes find each other's chunks. Each pipeline stage has its own layers.
    """
    split = HeadSplit.of(vllm_config)
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    kv_dtype = str(cache_config.cache_dtype)
    if kv_dtype == "auto":
        kv_dtype = str(model_config.dtype).removeprefix("torch.")
    use_mla = bool(getattr(model_config, "use_mla", False))
    head_size = model_config.get_head_size()
    # A page's bytes depend on the platform, the kernel's packing (the CPU ISA) and the physical order;
    # engines that differ in any of these must never share pages.
    layout = ":".join([
        _platform(), _cpu_isa(kv_dtype, cache_config.block_size, head_size),
        str(getattr(cache_config, "kv_cache_layout", None) or "default"),
        "mla" if use_mla else "mha", f"d{head_size}",
        f"pp{pp_rank}/{parallel.pipeline_parallel_size}",
    ])
    # Layers left unquantized (--kv-cache-dtype-skip-layers) hold pages of another dtype than the rest.
    unquantized = sorted(map(str, getattr(cache_config, "kv_cache_dtype_skip_layers", None) or ()))
    return CacheIdentity(
        model=str(model_config.model),
        kv_dtype=f"{kv_dtype} except layers {','.join(unquantized)}" if unquantized else kv_dtype,
        layout=layout,
        block_size=int(cache_config.block_size),
        weights=_weights(model_config),
        kv_heads=part_label(split.total, parts or split.parts, part),
    )


_POSITIONAL_SETTINGS = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor",
                        "max_position_embeddings", "num_hidden_layers")
"""Model settings that change the keys every layer caches (rotary embeddings are applied to K before it is
cached), and which ``--hf-overrides`` can change without changing the model's path."""


def _weights(model_config: Any) -> str:
    """What besides the model's path decides the KV its layers compute: the weights' dtype, revision and
    quantization, and a digest of the positional settings (two engines differing in any of them compute
    different KV for the same tokens)."""
    text_config = getattr(model_config, "hf_text_config", None)
    settings = {name: getattr(text_config, name, None) for name in _POSITIONAL_SETTINGS}
    canonical = json.dumps(settings, sort_keys=True, default=str, separators=(",", ":")).encode()
    digest = hashlib.blake2b(canonical, digest_size=6).hexdigest()
    dtype = str(getattr(model_config, "dtype", "")).removeprefix("torch.")
    return (f"dtype {dtype}, revision {getattr(model_config, 'revision', None)}, "
            f"quantization {getattr(model_config, 'quantization', None)}, positions {digest}")


def refuse_unsupported(vllm_config: VllmConfig) -> None:
    """Raise :class:`~kvredis.ConfigError` for a configuration whose pages the connector cannot move (kinds
    of layers it cannot store are refused by :func:`kvredis.vllm.cache_groups.cache_series`)."""
    parallel = vllm_config.parallel_config
    for flag, name in (("--decode-context-parallel-size (-dcp)", "decode_context_parallel_size"),
                       ("--prefill-context-parallel-size (-pcp)", "prefill_context_parallel_size")):
        size = int(getattr(parallel, name, 1) or 1)
        if size > 1:
            raise ConfigError(f"kvredis does not support {flag} {size}: context parallelism splits a "
                              "request's KV over ranks in a way its pages cannot express; run without it")


def multimodal_inputs_hashed(vllm_config: VllmConfig) -> bool:
    """Whether this engine names each multimodal input by a hash of its content (vLLM 0.32-0.34's
    ``_process_mm_uuids``): with prefix caching and the multimodal processor cache both off it names them
    ``renderer<rank>-mm-<n>-<modality>-<i>`` instead, a counter of this process alone."""
    multimodal = getattr(vllm_config.model_config, "multimodal_config", None)
    if multimodal is None:
        return True  # no multimodal inputs at all
    cache_gb = getattr(multimodal, "mm_processor_cache_gb", None)
    return bool(vllm_config.cache_config.enable_prefix_caching) or cache_gb is None or cache_gb > 0


def _platform() -> str:
    try:
        from vllm.platforms import current_platform

        return str(current_platform.device_type)
    except Exception:  # platform detection failing must not stop the engine; the page shape check still runs
        return "unknown"


def _cpu_isa(kv_dtype: str, block_size: int, head_size: int) -> str:
    if _platform() != "cpu":
        return "-"
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(getattr(torch, kv_dtype, torch.float32), block_size, head_size))
    except Exception:  # a private helper that may move between versions
        return "cpu"


def worker_tp_rank() -> int:
    """This worker's tensor-parallel rank (0 outside a worker process)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, RuntimeError):
        return 0


def worker_pp_rank() -> int:
    """This worker's pipeline stage: stages hold different layers, so they must not share entries."""
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return int(get_pp_group().rank_in_group)
    except (ImportError, AssertionError, RuntimeError, AttributeError):
        return 0
