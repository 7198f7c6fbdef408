"""Tests that run vLLM's CPU build: its real V1 scheduler, and real engines as separate processes.

They run in the vLLM environment (``scripts/test.sh`` builds it; ``$HOME/.cache/kvredis/vllm-cpu-venv``).
Without vLLM the directory is skipped, unless ``KVREDIS_REQUIRE_VLLM=1`` (CI), which makes a missing or
broken vLLM an error instead of a silent skip.

The scheduler-level tests also run against the Python code of later releases, laid over the CPU
environment (``scripts/install_vllm_overlay.sh``, first on ``PYTHONPATH``). ``KVREDIS_EXPECT_VLLM=<version>``
names the release such a run means to test: the vLLM imported must be that one (a broken overlay must not
quietly test the CPU build underneath). With either variable set (as CI sets them), a skipped test fails
the run: every version runs every test it is given.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
EXPECT_VLLM = os.environ.get("KVREDIS_EXPECT_VLLM", "")
VLLM_VERSION: str | None = None  # the vLLM these tests run against, if it imports

# "vllm.version", not "vllm": with tests/ on sys.path, this directory imports as a namespace package named
# vllm wherever vLLM is missing, so a bare "import vllm" would succeed there.
try:
    import vllm.version
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401
except Exception as exc:  # ImportError, or a broken install failing inside vLLM's own imports
    if REQUIRE_VLLM:
        raise RuntimeError(
            f"KVREDIS_REQUIRE_VLLM=1 but vLLM cannot be imported ({type(exc).__name__}: {exc}); "
            "run these tests with the vLLM environment's python (scripts/test.sh builds it)"
        ) from exc
    # Each test module starts with pytest.importorskip("vllm.version"), so the skip shows in the summary.
    if EXPECT_VLLM:
        raise RuntimeError(f"KVREDIS_EXPECT_VLLM={EXPECT_VLLM} but vLLM cannot be imported "
                           f"({type(exc).__name__}: {exc})") from exc
else:
    VLLM_VERSION = vllm.version.__version__
    if EXPECT_VLLM and VLLM_VERSION.split("+")[0] != EXPECT_VLLM:
        raise RuntimeError(f"KVREDIS_EXPECT_VLLM={EXPECT_VLLM} but this is vLLM {VLLM_VERSION} from "
                           f"{vllm.version.__file__} (is the overlay first on PYTHONPATH?)")


def _allow_cpu_platform_without_triton() -> None:
    """Let vLLM 0.34+'s CPU platform accept an engine configuration on a machine without triton-cpu.

    From 0.34 on, ``CpuPlatform.check_and_update_config`` refuses every x86 configuration unless Triton
    imports ("vLLM on x86 CPUs requires Triton (triton-cpu)"): its CPU model runner compiles Triton
    kernels. The releases after 0.32 only exist as CUDA wheels, tested here as their Python code laid
    over the 0.32 CPU build, where triton-cpu cannot be installed; and the scheduler-level tests build a
    ``VllmConfig`` (whose check this is) but never a model runner: no kernel, Triton or other, runs. So
    for the length of that one check, and for nothing else, vLLM is told Triton is there; everything the
    check does besides (block size, cache layout, ...) runs as released. Engine tests never get here: they
    run on the 0.32 CPU build, which has no such check.
    """
    import functools

    import vllm.triton_utils
    from vllm.platforms.cpu import CpuPlatform

    if vllm.triton_utils.HAS_TRITON:
        return
    original = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    @functools.wraps(original)
    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        vllm.triton_utils.HAS_TRITON = True
        try:
            original(cls, vllm_config)
        finally:
            vllm.triton_utils.HAS_TRITON = False

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[assignment]


if VLLM_VERSION is not None and tuple(int(part) for part in VLLM_VERSION.split(".")[:2]) >= (0, 34):
    _allow_cpu_platform_without_triton()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Iterator[None]:
    """In CI (``KVREDIS_REQUIRE_VLLM`` or ``KVREDIS_EXPECT_VLLM``), a skipped test is a failed one."""
    outcome = yield
    _fail_a_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """The same for a module skipped whole (``pytest.importorskip``)."""
    outcome = yield
    _fail_a_skip(outcome.get_result())


def _fail_a_skip(report: Any) -> None:
    if (REQUIRE_VLLM or EXPECT_VLLM) and report.skipped:
        report.outcome = "failed"
        report.longrepr = (f"skipped, and a skip fails the run here (KVREDIS_REQUIRE_VLLM={REQUIRE_VLLM:d}, "
                           f"KVREDIS_EXPECT_VLLM={EXPECT_VLLM!r}): {report.longrepr}")


BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama folder (config, word-level tokenizer, seeded weights), written once per session."""
    from kvredis.stack.tinymodel import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
