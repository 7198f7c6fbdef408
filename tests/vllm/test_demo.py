"""``kvredis demo`` end to end, as a user runs it: real vLLM CPU engines, a real Redis, the proxy.

Runs in the vLLM environment (``scripts/test.sh`` builds it). The demo starts its own ``redis-server`` (or
uses ``KVREDIS_URL``); without either it would fall back to fakeredis, which this test refuses: the point is
the real server.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

# "vllm.version", not "vllm": with tests/ on sys.path, tests/vllm itself imports as a namespace package
# named vllm, so importorskip("vllm") would not skip where vLLM is missing.
pytest.importorskip("vllm.version")

from engine_servers import TEST_TIMEOUT_ENV
from processes import running

from kvredis.stack.demo import DEMO_LENGTHS
from kvredis.stack.supervisor import group_alive

REPO_ROOT = Path(__file__).resolve().parents[2]
# The demo takes about a minute here (engines start in 30-40 s, concurrently); the bound leaves room for a
# loaded CI machine without letting a hang run forever.
DEMO_BOUND_S = 480
REQUESTS = 6


@pytest.mark.vllm
@pytest.mark.timeout(DEMO_BOUND_S + 60)
def test_kvredis_demo_is_green_end_to_end(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None and not os.environ.get("KVREDIS_URL"):
        pytest.skip("neither redis-server on the PATH nor KVREDIS_URL: the demo would run on fakeredis")
    log_dir = tmp_path / "logs"
    argv = [sys.executable, "-m", "kvredis.cli", "demo", f"--requests={REQUESTS}", f"--log-dir={log_dir}"]
    began = time.monotonic()
    try:
        # The engines inherit the environment: Redis bounds that outlast this VM's freezes (engine_servers).
        demo = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=DEMO_BOUND_S,
                              env={**os.environ, **TEST_TIMEOUT_ENV})
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"kvredis demo ran past {DEMO_BOUND_S} s; logs in {log_dir}\n{exc.stderr!s}")
    took = time.monotonic() - began
    report = f"exit {demo.returncode}, {took:.0f} s\n--- stdout\n{demo.stdout}\n--- stderr\n{demo.stderr}"
    assert demo.returncode == 0, report

    lines = demo.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#  prompt tokens"))
    rows = [line.split() for line in lines[header + 1 : header + 1 + REQUESTS]]
    for row, length in zip(rows, DEMO_LENGTHS, strict=True):
        _, prompt, cached, kv_bytes, store_ms, load_ms, ttft_ms, from_redis, matched = row[:9]
        assert int(prompt) == length, report
        # The decode computed only the last prompt token; the rest came from Redis.
        assert int(cached) == length - 1, report
        assert int(kv_bytes.replace(",", "")) > 0, report
        assert float(store_ms) > 0 and float(load_ms) > 0 and float(ttft_ms) > 0, report
        assert (from_redis, matched) == ("yes", "yes"), report
    assert f"{REQUESTS}/{REQUESTS} answers matched" in demo.stdout, report
    assert f"{REQUESTS}/{REQUESTS} with no cached prompt token" in demo.stdout, report
    assert f"{REQUESTS}/{REQUESTS} decodes loaded their prompt's KV from Redis" in demo.stdout, report
    assert "fakeredis" not in demo.stderr, report

    # Every process the demo started is gone: the children (printed with their pids) and what they
    # started (vLLM's engine-core and worker processes, in the children's process groups).
    pids = [int(pid) for pid in re.findall(r"started \w+ \(pid (\d+)\)", demo.stderr)]
    assert len(pids) >= 3, report
    assert not [pid for pid in pids if running(pid)], report
    assert not [pid for pid in pids if group_alive(pid)], report
    print(f"kvredis demo: {took:.0f} s\n{demo.stdout}")
