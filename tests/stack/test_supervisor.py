"""The supervisor: children in process groups, phases, health waits, failures named with their logs, stops.

Stand-ins (tests/processes.py) instead of real servers: small HTTP servers that start a grandchild, so that
stopping is checked for whole process groups.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from processes import (
    BOUND_S,
    REPO_ROOT,
    SERVER,
    assert_all_gone,
    grandchild_pid,
    running,
    wait_all_gone,
)

from kvredis.stack.supervisor import ChildFailed, ChildSpec, Supervisor, group_alive, http_ok
from kvredis.stack.up import free_ports


def server_spec(
    role: str, tmp_path: Path, *, ignore_term: bool = False, timeout_s: float = BOUND_S
) -> ChildSpec:
    (port,) = free_ports(1)
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    url = f"http://127.0.0.1:{port}"
    env = {"IGNORE_TERM": "1"} if ignore_term else {}
    argv = [sys.executable, str(script), str(port)]
    return ChildSpec(role, argv, url, lambda: http_ok(url + "/health"), env, startup_timeout_s=timeout_s)


def test_starts_phases_and_stops_every_process_and_grandchild(tmp_path: Path) -> None:
    first, second, third = (server_spec(role, tmp_path) for role in ("first", "second", "third"))
    supervisor = Supervisor([[first], [second, third]], tmp_path / "logs", stop_grace_s=BOUND_S)
    with supervisor:
        assert [child.spec.role for child in supervisor.children] == ["first", "second", "third"]
        assert all(http_ok(spec.url + "/health") for spec in (first, second, third))
        pids = [child.pid for child in supervisor.children]
        grandchildren = [grandchild_pid(child.log_path) for child in supervisor.children]
        assert all(running(pid) for pid in pids + grandchildren)
        assert all(child.ready_after_s is not None for child in supervisor.children)
    assert_all_gone(pids + grandchildren)
    assert not any(group_alive(pid) for pid in pids)
    assert all(child.process.returncode is not None for child in supervisor.children)
    # The stand-ins exit at SIGTERM leaving their grandchildren; SIGTERM to the rest of the group stops them.
    for child in supervisor.children:
        assert not child.killed
        assert child.stopped_after_s is not None and child.stopped_after_s < BOUND_S
    supervisor.stop()  # idempotent


# A server that stops its grandchild itself at SIGTERM, as vLLM's API server stops its engine core; the
# grandchild (RECORDS_ITS_SIGTERM) writes down who sent it SIGTERM.
STOPS_ITS_GRANDCHILD = textwrap.dedent("""
    import http.server, signal, subprocess, sys
    port, grandchild_script, senders = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    grandchild = subprocess.Popen([sys.executable, grandchild_script, senders], stdout=subprocess.PIPE)
    grandchild.stdout.readline()  # its SIGTERM is blocked from now on
    print("grandchild", grandchild.pid, flush=True)
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *args):
            pass
    def stop(*_):
        grandchild.terminate(); grandchild.wait(); sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
""")
RECORDS_ITS_SIGTERM = textwrap.dedent("""
    import signal, sys
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    print("ready", flush=True)
    info = signal.sigwaitinfo({signal.SIGTERM})
    with open(sys.argv[1], "a") as senders:
        senders.write(f"{info.si_pid}\\n")
""")


def test_sigterm_goes_to_the_child_which_stops_what_it_started(tmp_path: Path) -> None:
    """vLLM's API server stops its engine core itself; signalled at once by the supervisor too, the engine
    core exited while the API server was killing it, which failed vLLM's shutdown (issue 26)."""
    (port,) = free_ports(1)
    script, grandchild, senders = tmp_path / "server.py", tmp_path / "grandchild.py", tmp_path / "senders"
    script.write_text(STOPS_ITS_GRANDCHILD)
    grandchild.write_text(RECORDS_ITS_SIGTERM)
    url = f"http://127.0.0.1:{port}"
    spec = ChildSpec("engine", [sys.executable, str(script), str(port), str(grandchild), str(senders)], url,
                     lambda: http_ok(url + "/health"), startup_timeout_s=BOUND_S)
    with Supervisor([[spec]], tmp_path / "logs", stop_grace_s=BOUND_S) as supervisor:
        child = supervisor.children[0]
        grandchild_started = grandchild_pid(child.log_path)
    assert_all_gone([child.pid, grandchild_started])
    assert senders.read_text().split() == [str(child.pid)]  # from its parent only, not from the supervisor
    assert not child.killed and child.stopped_after_s is not None and child.stopped_after_s < BOUND_S


def test_a_group_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    spec = server_spec("stubborn", tmp_path, ignore_term=True)
    supervisor = Supervisor([[spec]], tmp_path / "logs", stop_grace_s=0.5, out=sys.stderr)
    supervisor.start()
    leader = supervisor.children[0].pid
    grandchild = grandchild_pid(supervisor.children[0].log_path)
    began = time.monotonic()
    supervisor.stop()
    assert time.monotonic() - began < BOUND_S
    assert_all_gone([leader, grandchild])
    assert supervisor.children[0].killed


def test_a_child_exiting_at_start_stops_the_others_and_is_named_with_its_log_tail(tmp_path: Path) -> None:
    healthy = server_spec("redis", tmp_path)
    waiting = server_spec("prefill", tmp_path)
    crash = "import sys; print('loading weights'); print('OSError: [Errno 98] address in use'); sys.exit(3)"
    failing = ChildSpec("decode", [sys.executable, "-c", crash], "http://127.0.0.1:9", lambda: False)
    supervisor = Supervisor([[healthy], [waiting, failing]], tmp_path / "logs", stop_grace_s=BOUND_S)
    with pytest.raises(ChildFailed) as failed:
        supervisor.start()
    message = str(failed.value)
    assert failed.value.role == "decode"
    assert message.startswith("decode failed: exited with code 3 before it was ready")
    assert "address in use" in message and "loading weights" in message
    assert str(tmp_path / "logs" / "decode.log") in message
    pids = [child.pid for child in supervisor.children]
    assert len(pids) == 3
    assert_all_gone([*pids, grandchild_pid(supervisor.children[0].log_path)])
    assert supervisor.stopped


def test_a_child_never_healthy_times_out_and_stops_the_others(tmp_path: Path) -> None:
    healthy = server_spec("redis", tmp_path)
    hanging = ChildSpec("prefill", [sys.executable, "-c", "print('still loading', flush=True); "
                                    "import time; time.sleep(600)"],
                        "http://127.0.0.1:9", lambda: False, startup_timeout_s=1.0)
    supervisor = Supervisor([[healthy], [hanging]], tmp_path / "logs")
    began = time.monotonic()
    with pytest.raises(ChildFailed) as failed:
        supervisor.start()
    assert time.monotonic() - began < BOUND_S
    assert "prefill failed: not healthy at http://127.0.0.1:9 within 1 s" in str(failed.value)
    assert "still loading" in str(failed.value)
    assert_all_gone([child.pid for child in supervisor.children])


def test_a_command_that_cannot_run_is_named(tmp_path: Path) -> None:
    healthy = server_spec("redis", tmp_path)
    missing = ChildSpec("proxy", [str(tmp_path / "no-such-program")], "http://127.0.0.1:9", lambda: True)
    supervisor = Supervisor([[healthy], [missing]], tmp_path / "logs")
    with pytest.raises(ChildFailed, match=r"proxy failed: cannot run .*no-such-program"):
        supervisor.start()
    assert_all_gone([child.pid for child in supervisor.children])


def test_check_reports_a_child_that_died_after_start(tmp_path: Path) -> None:
    with Supervisor([[server_spec("decode", tmp_path)]], tmp_path / "logs") as supervisor:
        supervisor.check()
        child = supervisor.children[0]
        os.kill(child.pid, signal.SIGKILL)
        child.process.wait(timeout=BOUND_S)
        with pytest.raises(ChildFailed, match="decode failed: exited with signal SIGKILL"):
            supervisor.check()


# A supervisor in a process of its own, for killing: it starts a server whose grandchild ignores SIGTERM and
# one whose grandchild does not, prints "ready", then waits to be killed.
SUPERVISED = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from kvredis.stack.up import free_ports
    from kvredis.stack.supervisor import ChildSpec, Supervisor, http_ok
    script, log_dir = sys.argv[1], Path(sys.argv[2])
    specs = []
    for role, env in (("stubborn", {"IGNORE_TERM": "1"}), ("plain", {})):
        (port,) = free_ports(1)
        url = f"http://127.0.0.1:{port}"
        specs.append(ChildSpec(role, [sys.executable, script, str(port)], url,
                               lambda url=url: http_ok(url + "/health"), env))
    supervisor = Supervisor([specs], log_dir, stop_grace_s=30)
    supervisor.start()
    print("ready", *(child.pid for child in supervisor.children), flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("kill_group", [False, True], ids=["parent", "parent-group"])
def test_children_and_grandchildren_die_when_the_supervisor_is_killed(
    tmp_path: Path, kill_group: bool, reaper: list[subprocess.Popen[str]]
) -> None:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    parent = subprocess.Popen(
        [sys.executable, "-c", SUPERVISED, str(script), str(tmp_path / "logs")], cwd=REPO_ROOT, text=True,
        stdout=subprocess.PIPE, start_new_session=True,
    )
    reaper.append(parent)
    assert parent.stdout is not None
    line = parent.stdout.readline()
    assert line.startswith("ready"), line
    children = [int(pid) for pid in line.split()[1:]]
    grandchildren = [grandchild_pid(tmp_path / "logs" / f"{role}.log") for role in ("stubborn", "plain")]
    assert all(running(pid) for pid in children + grandchildren)
    if kill_group:
        # As a terminal's or a service manager's kill of the whole group would: the watchdog, in a session
        # of its own, is not in it.
        os.killpg(parent.pid, signal.SIGKILL)
    else:
        parent.kill()
    parent.wait(timeout=BOUND_S)
    # The stubborn grandchild ignores SIGTERM: it goes with the watchdog's SIGKILL, 5 s later.
    wait_all_gone(children + grandchildren)
    assert not any(group_alive(pid) for pid in children)


def test_the_watchdog_stops_the_groups_still_listed_at_end_of_file() -> None:
    from kvredis.stack.watchdog import watch

    assert watch([b"+10\n", b"+11\n", b"-10\n", b"junk\n", b"+12"]) == {11, 12}
