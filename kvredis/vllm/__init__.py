"""vLLM V1 connector: ``KVRedisConnector``, loaded by vLLM with ``kv_connector_module_path``.

::

    --kv-transfer-config '{"kv_connector": "KVRedisConnector", "kv_connector_module_path": "kvredis.vllm",
                           "kv_role": "kv_producer", "kv_load_failure_policy": "recompute"}'

Only this package imports vLLM:

- :mod:`kvredis.vllm.connector`: the connector vLLM loads; it hands each hook to one of its two sides:
- :mod:`kvredis.vllm.scheduler`: what to load and save, and what a prefill announces;
- :mod:`kvredis.vllm.worker`: pages in and out of the KV caches, background loads and saves;
- :mod:`kvredis.vllm.metadata`: what the scheduler tells the workers each step;
- :mod:`kvredis.vllm.endpoint`: a process's link to Redis (settings, identity, connection, counters);
- :mod:`kvredis.vllm.discards`: releasing announced transfers no decode will take;
- :mod:`kvredis.vllm.engine`: the supported releases, the engine identity chunks are keyed for, and the
  configurations refused at start-up;
- :mod:`kvredis.vllm.stats`: the counters and latencies vLLM logs and serves as ``vllm:kvredis_*``;
- :mod:`kvredis.vllm.events`: KV events for routers (blocks stored in Redis, and dropped by a reset);
- :mod:`kvredis.vllm.request_keys`: a request's context digest (LoRA adapter, multimodal inputs,
  ``cache_salt``);
- :mod:`kvredis.vllm.paged`: the paging arithmetic between KV cache blocks and chunks' pages;
- :mod:`kvredis.vllm.staging`: the CUDA data path (pages copied through pinned memory on side streams).
"""

from kvredis.vllm.connector import KVRedisConnector
from kvredis.vllm.engine import SUPPORTED_VLLM, cache_identity, check_vllm_version, refuse_unsupported
from kvredis.vllm.metadata import KVRedisConnectorMetadata, TransferSpec
from kvredis.vllm.stats import STATS

__all__ = [
    "STATS",
    "SUPPORTED_VLLM",
    "KVRedisConnector",
    "KVRedisConnectorMetadata",
    "TransferSpec",
    "cache_identity",
    "check_vllm_version",
    "refuse_unsupported",
]
