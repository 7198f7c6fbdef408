"""The one-machine stack's process handling (``kvredis up``), with stand-in children instead of vLLM.

Stand-ins: small Python HTTP servers that answer ``/health`` (and, as fake engines, ``/v1/completions``)
and start a grandchild the way ``vllm serve`` starts its engine core, so that stopping is checked for whole
process groups. Nothing here needs vLLM; the proxy and ``redis-server`` (when on the PATH) are the real ones.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvredis import stack as stack_module
from kvredis.stack import (
    ChildFailed,
    ChildSpec,
    DemoResult,
    Stack,
    StackError,
    StackOptions,
    demo_requests,
    format_table,
    free_ports,
    group_alive,
    http_ok,
    open_stack,
    parse_samples,
    redis_ping,
)

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
# kv_role, so a request through the proxy shows which engine answered. FAKE_ENGINE_FAIL_ROLE makes the
# engine of that role die at start-up; FAKE_ENGINE_HANG makes every engine start but never listen.
FAKE_ENGINE = textwrap.dedent("""
    import argparse, http.server, json, os, signal, subprocess, sys, time
    parser = argparse.ArgumentParser()
    parser.add_argument("--host"); parser.add_argument("--port", type=int)
    parser.add_argument("--kv-transfer-config")
    args, _ = parser.parse_known_args()
    role = json.loads(args.kv_transfer_config)["kv_role"]
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
    deadline = time.monotonic() + bound_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


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


def grandchild_pid(log: Path) -> int:
    wait_until(lambda: "grandchild" in log.read_text())
    return int(re.search(r"grandchild (\d+)", log.read_text()).group(1))  # type: ignore[union-attr]


def assert_all_gone(pids: list[int]) -> None:
    left = [pid for pid in pids if running(pid)]
    assert not left, f"processes left behind: {left}"


# -- Stack ----------------------------------------------------------------------------------------


def test_starts_phases_and_stops_every_process_and_grandchild(tmp_path: Path) -> None:
    first, second, third = (server_spec(role, tmp_path) for role in ("first", "second", "third"))
    stack = Stack([[first], [second, third]], tmp_path / "logs", stop_grace_s=BOUND_S)
    with stack:
        assert [child.spec.role for child in stack.children] == ["first", "second", "third"]
        assert all(http_ok(spec.url + "/health") for spec in (first, second, third))
        pids = [child.pid for child in stack.children]
        grandchildren = [grandchild_pid(child.log_path) for child in stack.children]
        assert all(running(pid) for pid in pids + grandchildren)
        assert all(child.ready_after_s is not None for child in stack.children)
    assert_all_gone(pids + grandchildren)
    assert not any(group_alive(pid) for pid in pids)
    assert all(child.process.returncode is not None for child in stack.children)
    stack.stop()  # idempotent


def test_a_group_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    spec = server_spec("stubborn", tmp_path, ignore_term=True)
    stack = Stack([[spec]], tmp_path / "logs", stop_grace_s=0.5, out=sys.stderr)
    stack.start()
    leader = stack.children[0].pid
    grandchild = grandchild_pid(stack.children[0].log_path)
    began = time.monotonic()
    stack.stop()
    assert time.monotonic() - began < BOUND_S
    assert_all_gone([leader, grandchild])


def test_a_child_exiting_at_start_stops_the_others_and_is_named_with_its_log_tail(tmp_path: Path) -> None:
    healthy = server_spec("redis", tmp_path)
    waiting = server_spec("prefill", tmp_path)
    crash = "import sys; print('loading weights'); print('OSError: [Errno 98] address in use'); sys.exit(3)"
    failing = ChildSpec("decode", [sys.executable, "-c", crash], "http://127.0.0.1:9", lambda: False)
    stack = Stack([[healthy], [waiting, failing]], tmp_path / "logs", stop_grace_s=BOUND_S)
    with pytest.raises(ChildFailed) as failed:
        stack.start()
    message = str(failed.value)
    assert failed.value.role == "decode"
    assert message.startswith("decode failed: exited with code 3 before it was ready")
    assert "address in use" in message and "loading weights" in message
    assert str(tmp_path / "logs" / "decode.log") in message
    pids = [child.pid for child in stack.children]
    assert len(pids) == 3
    assert_all_gone([*pids, grandchild_pid(stack.children[0].log_path)])
    assert stack.stopped


def test_a_child_never_healthy_times_out_and_stops_the_others(tmp_path: Path) -> None:
    healthy = server_spec("redis", tmp_path)
    hanging = ChildSpec("prefill", [sys.executable, "-c", "print('still loading', flush=True); "
                                    "import time; time.sleep(600)"],
                        "http://127.0.0.1:9", lambda: False, startup_timeout_s=1.0)
    stack = Stack([[healthy], [hanging]], tmp_path / "logs")
    began = time.monotonic()
    with pytest.raises(ChildFailed) as failed:
        stack.start()
    assert time.monotonic() - began < BOUND_S
    assert "prefill failed: not healthy at http://127.0.0.1:9 within 1 s" in str(failed.value)
    assert "still loading" in str(failed.value)
    assert_all_gone([child.pid for child in stack.children])


def test_a_command_that_cannot_run_is_named(tmp_path: Path) -> None:
    healthy = server_spec("redis", tmp_path)
    missing = ChildSpec("proxy", [str(tmp_path / "no-such-program")], "http://127.0.0.1:9", lambda: True)
    stack = Stack([[healthy], [missing]], tmp_path / "logs")
    with pytest.raises(ChildFailed, match=r"proxy failed: cannot run .*no-such-program"):
        stack.start()
    assert_all_gone([child.pid for child in stack.children])


def test_check_reports_a_child_that_died_after_start(tmp_path: Path) -> None:
    with Stack([[server_spec("decode", tmp_path)]], tmp_path / "logs") as stack:
        stack.check()
        child = stack.children[0]
        os.kill(child.pid, signal.SIGKILL)
        child.process.wait(timeout=BOUND_S)
        with pytest.raises(ChildFailed, match="decode failed: exited with signal SIGKILL"):
            stack.check()


# -- open_stack and `kvredis up` with stand-in engines --------------------------------------------


@pytest.fixture
def fake_engine(tmp_path: Path) -> str:
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE_ENGINE)
    return f"{sys.executable} {script}"


def completion_through(proxy_url: str) -> dict[str, object]:
    import http.client

    host, port = proxy_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        body = json.dumps({"model": "m", "prompt": "t5", "max_tokens": 4})
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        return json.loads(response.read())  # type: ignore[no-any-return]
    finally:
        connection.close()


def test_open_stack_falls_back_to_fakeredis_without_redis_server(
    tmp_path: Path, fake_engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("fakeredis").TcpFakeServer  # noqa: B018
    pytest.importorskip("aiohttp")
    monkeypatch.setattr(stack_module.shutil, "which", lambda name: None)
    options = StackOptions(model="stand-in", engine_command=fake_engine.split(), proxy_port=0,
                           log_dir=tmp_path / "logs", startup_timeout_s=BOUND_S)
    with open_stack(options, out=sys.stderr) as running_stack:
        assert "fakeredis" in running_stack.redis_kind
        assert redis_ping(running_stack.redis_url)
        assert [role for _, role, _, _ in running_stack.stack.rows()] == ["prefill", "decode", "proxy"]
        answer = completion_through(running_stack.proxy_url)
        # The decode engine answered, with the parameters the prefill engine handed over.
        assert answer["choices"] == [{"text": "kv_consumer", "index": 0}]
        assert answer["seen"] == {"from": "kv_producer"}
        described = running_stack.describe()
        assert running_stack.proxy_url in described and "(fakeredis, in this process)" in described
        pids = [child.pid for child in running_stack.stack.children]
        redis_url = running_stack.redis_url
    assert_all_gone(pids)
    assert not redis_ping(redis_url)


def test_unreachable_kvredis_url_is_refused_before_anything_starts(tmp_path: Path, fake_engine: str) -> None:
    (port,) = free_ports(1)
    options = StackOptions(redis_url=f"redis://:secret@127.0.0.1:{port}/0", model="x",
                           engine_command=fake_engine.split(), log_dir=tmp_path / "logs")
    unreachable = r"Redis at redis://:\*\*\*@127.0.0.1:\d+/0 is unreachable"
    with pytest.raises(StackError, match=unreachable) as failed, open_stack(options, out=sys.stderr):
        pass
    assert "secret" not in str(failed.value)
    assert not list((tmp_path / "logs").glob("*.log"))


def kvredis(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvredis.cli", *args], cwd=REPO_ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})},
    )


def up_args(fake_engine: str, tmp_path: Path) -> list[str]:
    return ["up", "--model", "stand-in", "--engine-command", fake_engine, "--port", "0",
            "--log-dir", str(tmp_path / "logs"), "--stop-grace", "10", "--startup-timeout", str(BOUND_S)]


def started_pids(log_dir: Path) -> list[int]:
    """The stack's children and their grandchildren, from the fake engines' logs and `ps`-free means."""
    pids = []
    for log in log_dir.glob("*.log"):
        found = re.search(r"engine core pid (\d+)", log.read_text())
        if found:
            pids.append(int(found.group(1)))
    return pids


@pytest.fixture
def reaper() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts, killed if the test fails before they exit."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_kvredis_up_stops_every_child_on_a_signal(
    tmp_path: Path, fake_engine: str, signum: int, reaper: list[subprocess.Popen[str]]
) -> None:
    pytest.importorskip("aiohttp")
    up = kvredis(*up_args(fake_engine, tmp_path))
    reaper.append(up)
    assert up.stdout is not None
    lines = []
    deadline = time.monotonic() + BOUND_S
    while not lines or not lines[-1].startswith("try: curl"):
        assert time.monotonic() < deadline and up.poll() is None, up.stderr.read() if up.stderr else ""
        lines.append(up.stdout.readline().rstrip("\n"))
    assert lines[0].startswith("kvredis stack is up: the proxy listens on http://127.0.0.1:")
    rows = [line.split() for line in lines if re.match(r"\s+\d+\s", line)]
    assert [row[1] for row in rows] == ["redis", "prefill", "decode", "proxy"] or \
        [row[1] for row in rows] == ["prefill", "decode", "proxy"]
    proxy_url = re.search(r"listens on (http://\S+)", lines[0]).group(1)  # type: ignore[union-attr]
    assert completion_through(proxy_url)["choices"] == [{"text": "kv_consumer", "index": 0}]
    children = [int(row[0]) for row in rows if int(row[0]) != up.pid]
    grandchildren = started_pids(tmp_path / "logs")
    assert len(grandchildren) == 2 and all(running(pid) for pid in children + grandchildren)
    up.send_signal(signum)
    _, err = up.communicate(timeout=BOUND_S)
    assert up.returncode == 0, err
    assert f"{signal.Signals(signum).name}: stack stopped" in err
    assert_all_gone(children + grandchildren)


def test_kvredis_up_with_a_failing_engine_stops_the_rest_and_names_it(
    tmp_path: Path, fake_engine: str, reaper: list[subprocess.Popen[str]]
) -> None:
    up = kvredis(*up_args(fake_engine, tmp_path), env={"FAKE_ENGINE_FAIL_ROLE": "kv_consumer"})
    reaper.append(up)
    _, err = up.communicate(timeout=BOUND_S)
    assert up.returncode == 1
    assert "kvredis: decode failed: exited with code 3 before it was ready" in err
    assert "RuntimeError: kv_consumer cannot allocate its KV cache" in err
    assert str(tmp_path / "logs" / "decode.log") in err
    pids = [int(pid) for pid in re.findall(r"started \w+ \(pid (\d+)\)", err)]
    assert len(pids) >= 2
    assert_all_gone(pids + started_pids(tmp_path / "logs"))


def test_kvredis_up_stops_cleanly_on_sigterm_while_engines_start(
    tmp_path: Path, fake_engine: str, reaper: list[subprocess.Popen[str]]
) -> None:
    up = kvredis(*up_args(fake_engine, tmp_path), env={"FAKE_ENGINE_HANG": "1"})
    reaper.append(up)
    assert up.stderr is not None
    seen = []
    while not any(line.startswith("waiting for prefill, decode") for line in seen):
        line = up.stderr.readline()
        assert line, "".join(seen)
        seen.append(line)
    wait_until(lambda: len(started_pids(tmp_path / "logs")) == 2)
    up.send_signal(signal.SIGTERM)
    _, err = up.communicate(timeout=BOUND_S)
    err = "".join(seen) + err
    assert up.returncode == 128 + signal.SIGTERM, err
    pids = [int(pid) for pid in re.findall(r"started \w+ \(pid (\d+)\)", err)]
    assert_all_gone(pids + started_pids(tmp_path / "logs"))


# -- the proxy and demo commands ------------------------------------------------------------------


def test_kvredis_proxy_serves_and_stops_on_sigterm(reaper: list[subprocess.Popen[str]]) -> None:
    pytest.importorskip("aiohttp")
    (port,) = free_ports(1)
    proxy = kvredis("proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                    "--port", str(port), "--policy", "least_outstanding", "--prefill-timeout", "7")
    reaper.append(proxy)
    wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/health") or proxy.poll() is not None)
    assert proxy.poll() is None
    proxy.send_signal(signal.SIGTERM)
    _, err = proxy.communicate(timeout=BOUND_S)
    assert proxy.returncode == 0, err
    assert f"listening on http://127.0.0.1:{port} (policy least_outstanding" in err


def test_kvredis_proxy_rejects_bad_settings() -> None:
    proxy = kvredis("proxy", "--prefill", "localhost:1", "--decode", "http://127.0.0.1:2")
    _, err = proxy.communicate(timeout=BOUND_S)
    assert proxy.returncode == 1
    assert "is not an http:// or https:// base URL" in err


# Makes `import aiohttp` fail, as in an install without the proxy extra.
NO_AIOHTTP = textwrap.dedent("""
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name == "aiohttp" or name.startswith("aiohttp."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, Block())
    from kvredis.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_without_aiohttp_version_works_and_proxy_says_what_to_install() -> None:
    version = subprocess.run([sys.executable, "-c", NO_AIOHTTP, "--version"], capture_output=True, text=True,
                             cwd=REPO_ROOT, timeout=BOUND_S)
    assert version.returncode == 0 and version.stdout.startswith("kvredis "), version.stderr
    proxy = subprocess.run([sys.executable, "-c", NO_AIOHTTP, "proxy", "--prefill", "http://a:1", "--decode",
                            "http://b:2"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=BOUND_S)
    assert proxy.returncode == 2
    assert "pip install 'kvredis[proxy]'" in proxy.stderr


def test_demo_without_vllm_says_how_to_install_it() -> None:
    if stack_module.vllm_installed():
        pytest.skip("vLLM is installed here")
    demo = kvredis("demo")
    _, err = demo.communicate(timeout=BOUND_S)
    assert demo.returncode == 1
    assert "vLLM is not installed" in err
    assert "scripts/install_vllm_cpu.sh" in err and "scripts/demo.sh" in err


# -- demo helpers ---------------------------------------------------------------------------------


def test_parse_samples_keeps_one_namespace_and_sums_duplicates() -> None:
    text = textwrap.dedent("""
        # HELP kvredis_bytes_total Payload bytes moved
        kvredis_bytes_total{direction="loaded",namespace="demo"} 65728.0
        kvredis_bytes_total{direction="stored",namespace="demo"} 10.0
        kvredis_bytes_total{direction="loaded",namespace="other"} 5.0
        kvredis_entries_loaded_total{namespace="demo"} 1.0
        kvredis_entries_loaded_total{namespace="demo"} 2.0
        kvredis_load_seconds_sum{namespace="demo"} 0.25
        vllm:num_requests_running{model_name="m"} 0.0
    """)
    assert parse_samples(text, "kvredis_", {"namespace": "demo"}) == {
        'kvredis_bytes_total{direction="loaded"}': 65728.0,
        'kvredis_bytes_total{direction="stored"}': 10.0,
        "kvredis_entries_loaded_total": 3.0,
        "kvredis_load_seconds_sum": 0.25,
    }


def test_demo_requests_have_the_planned_lengths_and_differ() -> None:
    requests = demo_requests(8, 16)
    assert [len(r.token_ids) for r in requests] == [12, 31, 32, 75, 200, 480, 19, 38]
    assert all(4 <= token < 1024 for r in requests for token in r.token_ids)
    assert len({r.token_ids[:12] for r in requests}) == 8
    assert demo_requests(8, 16) == requests


def test_table_and_verdicts() -> None:
    good = DemoResult(prompt_tokens=12, cached_tokens=11, kv_bytes=65728, store_s=0.003, load_s=0.004,
                      loaded=1, misses=0, ttft_s=0.1, answer="t5 t6 t7 t8 t9", reference="t5 t6 t7 t8 t9",
                      reference_cached=0)
    recomputed = DemoResult(prompt_tokens=12, cached_tokens=0, kv_bytes=0, store_s=0.003, load_s=5.0,
                            loaded=0, misses=1, ttft_s=5.2, answer="t5", reference="t6", reference_cached=0)
    assert good.matched and good.from_redis and good.reference_alone
    assert not recomputed.matched and not recomputed.from_redis
    table = format_table([good, recomputed])
    first, second = table.splitlines()[1:3]
    assert first.split() == ["1", "12", "11", "65,728", "3.0", "4.0", "100.0", "yes", "yes", "t5", "t6", "t7",
                             "t8", "..."]
    assert second.split()[7:9] == ["NO", "NO"]


def test_a_busy_proxy_port_is_refused_before_the_engines_start(tmp_path: Path, fake_engine: str) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        options = StackOptions(model="x", engine_command=fake_engine.split(), proxy_port=port,
                               log_dir=tmp_path / "logs")
        with pytest.raises(StackError, match=f"cannot listen on 127.0.0.1:{port}.*--port"), \
                open_stack(options, out=sys.stderr):
            pass
    assert not list((tmp_path / "logs").glob("*.log"))


def test_open_stack_starts_several_instances_of_each_role_behind_the_proxy(
    tmp_path: Path, fake_engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("fakeredis").TcpFakeServer  # noqa: B018
    pytest.importorskip("aiohttp")
    monkeypatch.setattr(stack_module.shutil, "which", lambda name: None)
    options = StackOptions(model="stand-in", engine_command=fake_engine.split(), proxy_port=0,
                           log_dir=tmp_path / "logs", startup_timeout_s=BOUND_S, prefill_instances=2,
                           decode_instances=3, policy="least_outstanding")
    with open_stack(options, out=sys.stderr) as running_stack:
        roles = [role for _, role, _, _ in running_stack.stack.rows()]
        assert roles == ["prefill-1", "prefill-2", "decode-1", "decode-2", "decode-3", "proxy"]
        assert {log.name for log in (tmp_path / "logs").glob("*.log")} == {f"{role}.log" for role in roles}
        assert len(running_stack.prefill_urls) == 2 and len(running_stack.decode_urls) == 3
        assert len({*running_stack.prefill_urls, *running_stack.decode_urls, running_stack.proxy_url}) == 6
        assert running_stack.prefill_url == running_stack.prefill_urls[0]
        assert running_stack.decode_url == running_stack.decode_urls[0]
        proxy_argv = list(running_stack.stack.children[-1].spec.argv)
        assert [proxy_argv[i + 1] for i, arg in enumerate(proxy_argv) if arg == "--prefill"] == \
            running_stack.prefill_urls
        assert [proxy_argv[i + 1] for i, arg in enumerate(proxy_argv) if arg == "--decode"] == \
            running_stack.decode_urls
        assert proxy_argv[proxy_argv.index("--policy") + 1] == "least_outstanding"
        for _ in range(3):
            answer = completion_through(running_stack.proxy_url)
            assert answer["choices"] == [{"text": "kv_consumer", "index": 0}]
            assert answer["seen"] == {"from": "kv_producer"}
        pids = [child.pid for child in running_stack.stack.children]
    assert_all_gone(pids)


@pytest.mark.parametrize(("changes", "message"), [
    ({"prefill_instances": 0}, "at least one prefill instance"),
    ({"decode_instances": -1}, "at least one decode instance"),
    ({"policy": "random"}, "policy 'random' is not one of"),
])
def test_open_stack_refuses_bad_instance_options(
    tmp_path: Path, fake_engine: str, changes: dict[str, object], message: str
) -> None:
    options = StackOptions(model="x", engine_command=fake_engine.split(), log_dir=tmp_path / "logs",
                           **changes)  # type: ignore[arg-type]
    with pytest.raises(StackError, match=message), open_stack(options, out=sys.stderr):
        pass


def test_up_and_demo_take_instance_counts_and_policy() -> None:
    from kvredis.cli import _stack_options, build_parser

    for command in ("up", "demo"):
        args = build_parser().parse_args(
            [command, "--prefill-instances", "2", "--decode-instances", "3", "--policy", "least_outstanding"])
        options = _stack_options(args, args.port)
        assert (options.prefill_instances, options.decode_instances, options.policy) == (
            2, 3, "least_outstanding")
        defaults = _stack_options(build_parser().parse_args([command]), 0)
        assert (defaults.prefill_instances, defaults.decode_instances, defaults.policy) == (
            1, 1, "round_robin")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--prefill-instances", "0"])
