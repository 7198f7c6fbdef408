"""vLLM V1 connector: ``KVRedisConnector``, loaded by vLLM with ``kv_connector_module_path``.

::

    --kv-transfer-config '{"kv_connector": "KVRedisConnector", "kv_connector_module_path": "kvredis.vllm",
                           "kv_role": "kv_producer", "kv_load_failure_policy": "recompute"}'

Only this package imports vLLM:

- :mod:`kvredis.vllm.connector`: the connector, its scheduler side (what to load and save, announcements)
  and its worker side (pages in and out of the KV caches, background loads and saves);
- :mod:`kvredis.vllm.engine`: the supported releases, the engine identity an entry is written for, and the
  configurations refused at start-up;
- :mod:`kvredis.vllm.stats`: the counters vLLM logs and serves as ``vllm:kvredis_<name>_total``.
"""

from kvredis.vllm.connector import KVRedisConnector, KVRedisConnectorMetadata, TransferSpec
from kvredis.vllm.engine import SUPPORTED_VLLM, cache_identity, check_vllm_version, refuse_unsupported
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
