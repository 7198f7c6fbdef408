#!/usr/bin/env bash
# The environment scripts/bench_chunks.py --peer runs LMCache's native Redis client in: CPU torch and LMCache's
# wheel (its C++ RESP client links only libtorch), nothing of kvredis. For benchmarks only: kvredis does not
# depend on LMCache.
# Usage: scripts/install_lmcache_peer.sh [VENV_DIR]   (default ~/.cache/kvredis/lmcache-venv)
set -euo pipefail

VENV="${1:-$HOME/.cache/kvredis/lmcache-venv}"
PYTHON_BIN="${PYTHON:-python3}"
LMCACHE_VERSION="0.5.6"
TORCH_VERSION="2.13.0"

if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import torch, lmcache.lmcache_redis" >/dev/null 2>&1; then
  echo "install_lmcache_peer: reusing $VENV"
  exit 0
fi
[[ -x "$VENV/bin/python" ]] || "$PYTHON_BIN" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# torch pinned as scripts/install_vllm_cpu.sh pins it (the CPU wheel on the machines kvredis is tested on).
"${PIP[@]}" install "torch==${TORCH_VERSION}"
"${PIP[@]}" install numpy
# --no-deps: LMCache declares CUDA-side requirements its RESP client does not use.
"${PIP[@]}" install --no-deps "lmcache==${LMCACHE_VERSION}"
"$VENV/bin/python" -c "import torch, lmcache.lmcache_redis; print('lmcache peer: torch', torch.__version__)"
