"""Stopping the stack again and again, with real vLLM CPU engines: every part exits within the grace after
SIGTERM, none by SIGKILL, and no process of any part is left.

Issue 26: a decode's API server ran on 20 s after SIGTERM, logging its stats, until it was killed. The
supervisor sent SIGTERM to each whole process group, so vLLM's engine core and worker began exiting on their
own while the API server (also signalled) was killing them: vLLM 0.32's ``kill_process_tree`` raises
psutil's ``NoSuchProcess`` when a process it lists exits and is reaped under it, which ends the API server's
shutdown task before it stops its HTTP server. The supervisor now signals each child alone (vLLM's API
server stops its own engine core). The race is narrow, so a stack that stops well once proves little: the
stack is stopped three times, idle, with requests in flight, and just after a request.
"""

from __future__ import annotations

import io
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

# "vllm.version", not "vllm": see test_demo.py.
pytest.importorskip("vllm.version")

from engine_servers import TEST_TIMEOUT_ENV
from processes import running

from kvredis.stack.supervisor import group_alive, group_members
from kvredis.stack.up import TINY_MODEL_NAME, StackOptions, open_stack

# Both engines start in 30-40 s here, concurrently; the bound leaves room for a loaded CI machine.
STARTUP_BOUND_S = 420.0
GRACE_S = 20.0
MOMENTS = ("idle", "requests in flight", "just after a request")


def _complete(url: str, max_tokens: int, errors: list[str]) -> None:
    body = json.dumps({"model": TINY_MODEL_NAME, "prompt": " ".join(f"t{i}" for i in range(10, 90)),
                       "max_tokens": max_tokens, "ignore_eos": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            answer.read()
    except (OSError, urllib.error.HTTPError) as exc:  # the stack stopping under the request
        errors.append(f"{type(exc).__name__}: {exc}")


@pytest.mark.vllm
@pytest.mark.timeout(len(MOMENTS) * (STARTUP_BOUND_S + 2 * GRACE_S) + 60)
def test_a_stack_stopped_again_and_again_stops_within_its_grace(tmp_path: Path, monkeypatch) -> None:
    # The engines inherit the environment: Redis bounds that outlast this VM's freezes (engine_servers).
    for name, value in TEST_TIMEOUT_ENV.items():
        monkeypatch.setenv(name, value)
    took = []
    for attempt, moment in enumerate(MOMENTS):
        out = io.StringIO()
        options = StackOptions(proxy_port=0, stop_grace_s=GRACE_S, startup_timeout_s=STARTUP_BOUND_S,
                               log_dir=tmp_path / f"stop-{attempt}")
        errors: list[str] = []
        requests: list[threading.Thread] = []
        with open_stack(options, command="up", out=out) as stack:
            if moment != "idle":
                _complete(stack.proxy_url, 4, errors)
                assert not errors, errors
            if moment == "requests in flight":
                requests = [threading.Thread(target=_complete, args=(stack.proxy_url, 400, errors),
                                             daemon=True) for _ in range(3)]
                for request in requests:
                    request.start()
                time.sleep(1.0)  # the prefills done, the decodes generating
            supervisor = stack.supervisor
            pids = sorted({pid for child in supervisor.children for pid in group_members(child.pid)})
            stopped_at = time.monotonic()
        for request in requests:
            request.join(timeout=30)
        report = f"stop {attempt + 1} ({moment}); logs in {options.log_dir}\n{out.getvalue()}"
        assert len(pids) > len(supervisor.children), report  # the engines' engine cores and workers
        for child in supervisor.children:
            assert not child.killed, report
            assert child.stopped_after_s is not None and child.stopped_after_s < GRACE_S, report
            assert not group_alive(child.pid), report
        assert not [pid for pid in pids if running(pid)], report
        took.append(f"{moment}: " + ", ".join(f"{child.spec.role} {child.stopped_after_s:.1f} s"
                                              for child in reversed(supervisor.children))
                    + f" (the stop {time.monotonic() - stopped_at:.1f} s)")
    print("stopped after SIGTERM:\n" + "\n".join(took))
