#!/usr/bin/env bash
# Install the CPU build of torch into a Python environment, and say where it came from.
#
# Usage: scripts/install_torch_cpu.sh PYTHON VERSION      e.g. scripts/install_torch_cpu.sh .venv/bin/python 2.13.0
#   KVREDIS_TORCH_CPU_INDEX  PyTorch's CPU wheel index, or a mirror of it (default https://download.pytorch.org/whl/cpu)
#
# On Linux (and Windows) PyPI's torch is the CUDA build, which pulls gigabytes of nvidia-* wheels; the CPU build
# is the same version with a "+cpu" label, published on PyTorch's CPU index. So this asks for torch==VERSION+cpu:
#   1. from the sources this machine's pip already uses (pip.conf, PIP_* variables: a local wheel folder given
#      as find-links, a mirror), so a machine that keeps the CPU wheel on disk needs no network for it;
#   2. failing that, from the CPU index, with PyPI (or the configured index) kept for torch's own requirements.
# On macOS PyPI's wheels are CPU builds without a label, and the plain pin is asked for. Either way the result
# must import and report no CUDA (torch.version.cuda is None), or the script fails. pip's output goes to a log
# shown only if a step fails; the last line says which build came from where.
set -euo pipefail

if (( $# != 2 )); then
  echo "usage: $0 PYTHON VERSION" >&2
  exit 2
fi
PY=$1
VERSION=$2
CPU_INDEX=${KVREDIS_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
PIP=("$PY" -m pip --disable-pip-version-check install --only-binary=torch)

if [[ "$(uname -s)" == Darwin ]]; then
  WANT="torch==${VERSION}"
else
  WANT="torch==${VERSION}+cpu"
fi

if "${PIP[@]}" "$WANT" >"$LOG" 2>&1; then
  from="this machine's pip configuration (pip.conf, PIP_* settings)"
elif "${PIP[@]}" --extra-index-url "$CPU_INDEX" "$WANT" >"$LOG" 2>&1; then
  from="PyTorch's CPU index ($CPU_INDEX)"
else
  cat "$LOG" >&2
  echo "install_torch_cpu: $WANT is neither where this machine's pip looks nor on $CPU_INDEX" >&2
  exit 1
fi
# pip's own line for the wheel it took: a file on this machine (Processing), a download, its cache, or the
# torch already there.
taken=$(grep -m1 -E '^ *((Processing|Downloading|Using cached) ([^ ]*/)?torch-|Requirement already satisfied: torch[^-_a-z])' \
  "$LOG" \
  | sed -E 's/^ +//' || true)

if ! built=$("$PY" -W ignore -c 'import sys, torch; print(torch.__version__); sys.exit(torch.version.cuda is not None)'); then
  echo "install_torch_cpu: torch $built was installed, but it is a CUDA build" >&2
  exit 1
fi
echo "install_torch_cpu: torch $built (CPU build) from $from${taken:+: $taken}"
