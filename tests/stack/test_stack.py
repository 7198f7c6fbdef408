"""The one-machine stack (``open_stack``, ``kvredis up``) with stand-in engines instead of vLLM.

The stand-in engines (tests/processes.py) take ``vllm serve``'s arguments, answer ``/health`` and
``/v1/completions`` with their role, and start a grandchild the way ``vllm serve`` starts its engine core.
The proxy and ``redis-server`` (when on the PATH) are the real ones.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import (
    BOUND_S,
    assert_all_gone,
    kvredis,
    running,
    started_pids,
    wait_all_gone,
    wait_until,
)

from kvredis.stack import up as stack_module
from kvredis.stack.up import StackError, StackOptions, engine_cpu_binds, free_ports, open_stack, redis_ping


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
        assert [role for _, role, _, _ in running_stack.supervisor.rows()] == ["prefill", "decode", "proxy"]
        answer = completion_through(running_stack.proxy_url)
        # The decode engine answered, with the parameters the prefill engine handed over.
        assert answer["choices"] == [{"text": "kv_consumer", "index": 0}]
        assert answer["seen"] == {"from": "kv_producer"}
        described = running_stack.describe()
        assert running_stack.proxy_url in described and "(fakeredis, in this process)" in described
        pids = [child.pid for child in running_stack.supervisor.children]
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


def up_args(fake_engine: str, tmp_path: Path) -> list[str]:
    return ["up", "--model", "stand-in", "--engine-command", fake_engine, "--port", "0",
            "--log-dir", str(tmp_path / "logs"), "--stop-grace", "10", "--startup-timeout", str(BOUND_S)]


def wait_up(up: subprocess.Popen[str], log_dir: Path) -> tuple[str, list[int]]:
    """The proxy's URL once ``kvredis up`` says it is up, and the pids of its children and grandchildren."""
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
    children = [int(row[0]) for row in rows if int(row[0]) != up.pid]
    grandchildren = started_pids(log_dir)
    assert len(grandchildren) == 2 and all(running(pid) for pid in children + grandchildren)
    return proxy_url, children + grandchildren


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_kvredis_up_stops_every_child_on_a_signal(
    tmp_path: Path, fake_engine: str, signum: int, reaper: list[subprocess.Popen[str]]
) -> None:
    pytest.importorskip("aiohttp")
    up = kvredis(*up_args(fake_engine, tmp_path))
    reaper.append(up)
    proxy_url, pids = wait_up(up, tmp_path / "logs")
    assert completion_through(proxy_url)["choices"] == [{"text": "kv_consumer", "index": 0}]
    up.send_signal(signum)
    _, err = up.communicate(timeout=BOUND_S)
    assert up.returncode == 0, err
    assert f"{signal.Signals(signum).name}: stack stopped" in err
    assert_all_gone(pids)


def test_kvredis_up_killed_with_sigkill_leaves_no_process_behind(
    tmp_path: Path, fake_engine: str, reaper: list[subprocess.Popen[str]]
) -> None:
    pytest.importorskip("aiohttp")
    up = kvredis(*up_args(fake_engine, tmp_path))
    reaper.append(up)
    _, pids = wait_up(up, tmp_path / "logs")
    up.kill()
    up.wait(timeout=BOUND_S)
    # Redis (when redis-server is on the PATH), both engines with their engine cores, and the proxy.
    wait_all_gone(pids)


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
    monkeypatch.setattr(stack_module.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    options = StackOptions(model="stand-in", engine_command=fake_engine.split(), proxy_port=0,
                           log_dir=tmp_path / "logs", startup_timeout_s=BOUND_S, prefill_instances=2,
                           decode_instances=3, policy="least_outstanding")
    with open_stack(options, out=sys.stderr) as running_stack:
        roles = [role for _, role, _, _ in running_stack.supervisor.rows()]
        assert roles == ["prefill-1", "prefill-2", "decode-1", "decode-2", "decode-3", "proxy"]
        # Each CPU engine computes on cores of its own: no decode shares one with a prefill.
        children = running_stack.supervisor.children
        binds = [child.spec.env.get("VLLM_CPU_OMP_THREADS_BIND") for child in children]
        assert binds == ["0,1", "2,3", "4", "5", "6,7", None]
        # ... and runs its worker inside its engine-core process, its OpenMP threads bound to those cores.
        layouts = [child.spec.env.get("VLLM_ENABLE_V1_MULTIPROCESSING") for child in children]
        assert layouts == ["0", "0", "0", "0", "0", None]
        places = [child.spec.env.get("OMP_PLACES") for child in children]
        assert places == ["{0,1}", "{2,3}", "{4}", "{5}", "{6,7}", None]
        assert {log.name for log in (tmp_path / "logs").glob("*.log")} == {f"{role}.log" for role in roles}
        assert len(running_stack.prefill_urls) == 2 and len(running_stack.decode_urls) == 3
        assert len({*running_stack.prefill_urls, *running_stack.decode_urls, running_stack.proxy_url}) == 6
        assert running_stack.prefill_url == running_stack.prefill_urls[0]
        assert running_stack.decode_url == running_stack.decode_urls[0]
        proxy_argv = list(running_stack.supervisor.children[-1].spec.argv)
        assert [proxy_argv[i + 1] for i, arg in enumerate(proxy_argv) if arg == "--prefill"] == \
            running_stack.prefill_urls
        assert [proxy_argv[i + 1] for i, arg in enumerate(proxy_argv) if arg == "--decode"] == \
            running_stack.decode_urls
        assert proxy_argv[proxy_argv.index("--policy") + 1] == "least_outstanding"
        for _ in range(3):
            answer = completion_through(running_stack.proxy_url)
            assert answer["choices"] == [{"text": "kv_consumer", "index": 0}]
            assert answer["seen"] == {"from": "kv_producer"}
        pids = [child.pid for child in running_stack.supervisor.children]
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


@pytest.mark.parametrize(("prefills", "decodes", "cpus", "expected"), [
    (1, 1, [0, 1], ["0", "1"]),
    (1, 1, [0, 1, 2], ["0,1", "2"]),  # the prefills, which compute whole prompts, get the odd core
    (1, 1, [4, 5, 6, 7, 0, 1, 2, 3], ["0,1,2,3", "4,5,6,7"]),
    (2, 3, range(8), ["0,1", "2,3", "4", "5", "6,7"]),
    (2, 2, [0, 1], ["0", "0", "1", "1"]),  # fewer cores than instances: a role's instances share its part
    (1, 1, [3], None),  # one CPU: nothing to split
])
def test_engine_cpu_binds_keep_prefills_and_decodes_on_cores_of_their_own(
    prefills: int, decodes: int, cpus: list[int], expected: list[str] | None
) -> None:
    binds = engine_cpu_binds(prefills, decodes, cpus)
    assert binds == expected
    if binds is not None:
        cores = [set(map(int, bind.split(","))) for bind in binds]
        assert not set.union(*cores[:prefills]) & set.union(*cores[prefills:])
        assert set.union(*cores) == set(cpus)


def test_the_stack_leaves_a_bind_the_user_set_and_says_when_one_cpu_cannot_be_split(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    options = StackOptions(prefill_instances=1, decode_instances=2)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3|4-7")
    assert stack_module._cpu_binds(options, sys.stdout) == [None, None, None]
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cuda")  # a GPU engine's workers are not bound by this variable
    assert stack_module._cpu_binds(options, sys.stdout) == [None, None, None]
    monkeypatch.delenv("VLLM_TARGET_DEVICE")
    monkeypatch.setattr(stack_module.os, "sched_getaffinity", lambda pid: {0})
    assert stack_module._cpu_binds(options, sys.stdout) == [None, None, None]
    assert "one CPU" in capsys.readouterr().out
    monkeypatch.setattr(stack_module.os, "sched_getaffinity", lambda pid: {0, 1})
    assert stack_module._cpu_binds(options, sys.stdout) == ["0", "1", "1"]
    assert capsys.readouterr().out == ""


def test_cpu_engines_run_their_worker_in_the_engine_core_on_their_cores_unless_the_user_said_otherwise(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    one_process = stack_module.one_process_engine_env
    # vLLM binds OpenMP only as it starts a worker process: in one process, the placement is the stack's.
    assert one_process("0,2-4") == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "4",
                                    "OMP_PLACES": "{0,2,3,4}", "OMP_PROC_BIND": "true"}
    assert one_process("nobind") == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    for bind in (None, "auto", "0-3|4-7", "0-x"):  # only vLLM's worker process applies these
        assert one_process(bind) == {}, bind
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the user's choice is left to the engines
    assert one_process("0") == {}
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cuda")  # a GPU engine of one worker is one process already
    assert one_process("0") == {}


def _engine_args(log: Path) -> list[str]:
    """The arguments a stand-in engine was started with (its log's first line)."""
    import ast

    first = log.read_text().splitlines()[0]
    return list(ast.literal_eval(first.split(" args ", 1)[1]))


def _transfer_config(log: Path) -> dict[str, object] | None:
    args = _engine_args(log)
    if "--kv-transfer-config" not in args:
        return None
    return json.loads(args[args.index("--kv-transfer-config") + 1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("reuse", [True, False])
def test_the_stack_is_a_shared_prefix_cache_on_a_bounded_redis_evicting_by_ttl(
    tmp_path: Path, fake_engine: str, reuse: bool
) -> None:
    """By default every engine shares the prefix cache (``reuse`` in its connector's settings), and the
    redis-server the stack starts is bounded and evicts the key nearest its expiry; ``reuse=False`` makes
    the engines take each prompt's KV once."""
    import shutil

    import redis

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on the PATH")
    pytest.importorskip("aiohttp")
    options = StackOptions(model="stand-in", engine_command=fake_engine.split(), proxy_port=0,
                           log_dir=tmp_path / "logs", startup_timeout_s=BOUND_S, redis_maxmemory="64mb",
                           **({} if reuse else {"reuse": False}))
    with open_stack(options, out=sys.stderr) as running_stack:
        client = redis.Redis.from_url(running_stack.redis_url)
        try:
            settings = client.config_get("maxmemory*")
            assert (settings["maxmemory"], settings["maxmemory-policy"]) == (str(64 << 20), "volatile-ttl")
        finally:
            client.close()
        for role in ("prefill", "decode"):
            config = _transfer_config(tmp_path / "logs" / f"{role}.log")
            assert config is not None
            assert config["kv_connector_extra_config"] == {"namespace": "kvredis", "reuse": reuse,
                                                           "url": running_stack.redis_url}


def test_a_stack_without_the_connector_runs_plain_engines(tmp_path: Path, fake_engine: str) -> None:
    """The benchmarks' baseline: the same engines, no kvredis in them."""
    pytest.importorskip("aiohttp")
    options = StackOptions(model="stand-in", engine_command=fake_engine.split(), proxy_port=0,
                           log_dir=tmp_path / "logs", startup_timeout_s=BOUND_S, connector=False)
    with open_stack(options, out=sys.stderr):
        for role in ("prefill", "decode"):
            assert _transfer_config(tmp_path / "logs" / f"{role}.log") is None


@pytest.mark.parametrize(("argv", "env", "expected"), [
    ([], {}, True),
    (["--no-reuse"], {}, False),
    ([], {"KVREDIS_REUSE": "0"}, False),
    (["--reuse"], {"KVREDIS_REUSE": "0"}, True),
])
def test_kvredis_up_reuses_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                                 env: dict[str, str], expected: bool) -> None:
    from kvredis.cli import _stack_options, build_parser

    monkeypatch.delenv("KVREDIS_REUSE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["up", *argv])
    assert _stack_options(args, 0).reuse is expected
