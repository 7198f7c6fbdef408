"""Process helpers for the tests of the supervisor, the stack and the command line.

Stand-ins: small Python HTTP servers that answer ``/health`` (and, as fake engines, ``/v1/completions``) and
start a grandchild the way ``vllm serve`` starts its engine core, so that stopping is checked for whole
process groups. Nothing here needs vLLM.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Bound on any stand-in stack's start or stop; they take well under a second.
BOUND_S = 30.0

# An HTTP server answering 200 on every GET; it starts a grandchild (like vLLM's engine core) and prints
# the grandchild's pid. With IGNORE_TERM, the grandchild ignores SIGTERM, so only SIGKILL stops it.
SERVER = textwrap.dedent("""
    import http.server, os, signal, subprocess, sys
    port = int(sys.argv[1])
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n" if os.environ.get("IGNORE_TERM") else ""
    grandchild = [sys.executable, "-c", "import signal, time\\n" + ignore + "time.sleep(600)"]
    print("grandchild", subprocess.Popen(grandchild).pid, flush=True)
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *args):
            pass
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
""")

# A stand-in for `vllm serve`: takes its arguments, answers /health, and answers /v1/completions with its
# kv_role ("plain" without a connector), so a request through the proxy shows which engine answered.
# FAKE_ENGINE_FAIL_ROLE makes the engine of that role die at start-up; FAKE_ENGINE_HANG makes every engine
# start but never listen.
FAKE_ENGINE = textwrap.dedent("""
    import argparse, http.server, json, os, signal, subprocess, sys, time
    parser = argparse.ArgumentParser()
    parser.add_argument("--host"); parser.add_argument("--port", type=int)
    parser.add_argument("--kv-transfer-config")
    args, _ = parser.parse_known_args()
    role = json.loads(args.kv_transfer_config)["kv_role"] if args.kv_transfer_config else "plain"
    print("fake engine", role, "args", sys.argv[1:], flush=True)
    engine_core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("engine core pid", engine_core.pid, flush=True)
    if os.environ.get("FAKE_ENGINE_FAIL_ROLE") == role:
        print(f"RuntimeError: {role} cannot allocate its KV cache", flush=True)
        engine_core.kill()
        sys.exit(3)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if os.environ.get("FAKE_ENGINE_HANG"):
        time.sleep(600)
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            answer = {"choices": [{"text": role, "index": 0}], "kv_transfer_params": {"from": role},
                      "seen": body.get("kv_transfer_params")}
            raw = json.dumps(answer).encode()
            self.send_response(200); self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw))); self.end_headers(); self.wfile.write(raw)
        def log_message(self, *args):
            pass
    http.server.HTTPServer((args.host, args.port), Handler).serve_forever()
""")


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process; a zombie (dead, not yet reaped by a non-reaping init) is not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2] not in "ZX"


def wait_until(condition: object, bound_s: float = BOUND_S) -> None:
    """Poll ``condition`` until it holds; fail after ``bound_s``."""
    deadline = time.monotonic() + bound_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def grandchild_pid(log: Path) -> int:
    """The pid a stand-in server printed for its grandchild."""
    wait_until(lambda: "grandchild" in log.read_text())
    return int(re.search(r"grandchild (\d+)", log.read_text()).group(1))  # type: ignore[union-attr]


def assert_all_gone(pids: list[int]) -> None:
    """Fail naming any of ``pids`` still running."""
    left = [pid for pid in pids if running(pid)]
    assert not left, f"processes left behind: {left}"


def kvredis(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``python -m kvredis.cli ARGS`` started with pipes for its output."""
    return subprocess.Popen(
        [sys.executable, "-m", "kvredis.cli", *args], cwd=REPO_ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})},
    )


def started_pids(log_dir: Path) -> list[int]:
    """The grandchildren the fake engines started (their engine cores), from the engines' logs."""
    pids = []
    for log in log_dir.glob("*.log"):
        found = re.search(r"engine core pid (\d+)", log.read_text())
        if found:
            pids.append(int(found.group(1)))
    return pids


def wait_all_gone(pids: list[int], bound_s: float = BOUND_S) -> None:
    """Return as soon as none of ``pids`` runs; fail naming those left after ``bound_s``."""
    deadline = time.monotonic() + bound_s
    while [pid for pid in pids if running(pid)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert_all_gone(pids)
