"""``kvredis up`` killed with SIGKILL, with real vLLM CPU engines: no Redis, engine or proxy process is left.

Runs in the vLLM environment (``scripts/test.sh`` builds it), like ``test_demo.py``. The engines start their
own engine-core processes in their process groups; every process of every group must be gone after the
``kvredis up`` process is killed (the watchdog's SIGTERM, then SIGKILL 5 s later).
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

# "vllm.version", not "vllm": see test_demo.py.
pytest.importorskip("vllm.version")

from engine_servers import TEST_TIMEOUT_ENV
from processes import running, wait_all_gone

from kvredis.stack.supervisor import group_alive, group_members

REPO_ROOT = Path(__file__).resolve().parents[2]
# Both engines start in 30-40 s here, concurrently; the bound leaves room for a loaded CI machine.
STARTUP_BOUND_S = 420.0
# The watchdog's grace (5 s) plus room for a loaded machine.
GONE_BOUND_S = 30.0


@pytest.mark.vllm
@pytest.mark.timeout(STARTUP_BOUND_S + 120)
def test_kvredis_up_killed_with_sigkill_leaves_no_process_behind(tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    argv = [sys.executable, "-m", "kvredis.cli", "up", "--port", "0", f"--log-dir={log_dir}",
            f"--startup-timeout={STARTUP_BOUND_S:g}"]
    up = subprocess.Popen(argv, cwd=REPO_ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          env={**os.environ, **TEST_TIMEOUT_ENV})
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert up.stdout is not None
        for line in up.stdout:
            lines.put(line.rstrip("\n"))

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + STARTUP_BOUND_S
        while not seen or not seen[-1].startswith("try: curl"):
            assert up.poll() is None and time.monotonic() < deadline, "\n".join(seen)
            try:
                seen.append(lines.get(timeout=1.0))
            except queue.Empty:
                continue
        report = f"logs in {log_dir}\n" + "\n".join(seen)
        rows = [line.split() for line in seen if re.match(r"\s+\d+\s", line)]
        roles = [row[1] for row in rows]
        assert roles in (["redis", "prefill", "decode", "proxy"], ["prefill", "decode", "proxy"]), report
        leaders = [int(row[0]) for row in rows if int(row[0]) != up.pid]
        # Every process of every part's group: vLLM's API servers, their engine cores, Redis, the proxy.
        pids = sorted({pid for leader in leaders for pid in group_members(leader)})
        assert len(pids) > len(leaders), (pids, report)
        assert all(running(pid) for pid in pids), report
        up.kill()
        up.wait(timeout=GONE_BOUND_S)
        began = time.monotonic()
        wait_all_gone(pids, GONE_BOUND_S)
        assert not [leader for leader in leaders if group_alive(leader)], report
        took = time.monotonic() - began
        print(f"kvredis up killed: its {len(pids)} processes were gone after {took:.1f} s")
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
