"""Supervising child processes: each in its own process group, health waits, signals, a staged stop.

:class:`Supervisor` starts :class:`ChildSpec` commands phase by phase (every member of a phase at once), each
as the leader of its own process group with its output in a log file, and waits for each phase's health
checks within their bounds. A child that exits or stays unhealthy raises :class:`ChildFailed`, naming it
and quoting the end of its log, after everything started is stopped. Stopping goes the last phase first:
SIGTERM to each child, which stops the processes it started in its own order (a service manager does the
same); SIGTERM to the rest of its process group once the child has exited, if some of it is left; SIGKILL
to the whole group after a grace period. :func:`stop_signals` turns SIGINT and SIGTERM into
:class:`StopRequested` so that a stop always runs to its end.

Children die with the supervisor, however it dies. Each group is listed with a watchdog process
(:mod:`kvredis.stack.watchdog`) that holds a pipe from the supervisor and stops every listed group when the
pipe ends, which it does when the supervisor exits, even by SIGKILL. On Linux each child also gets a
parent-death signal (``PR_SET_PDEATHSIG``, SIGTERM), set before it runs its command, which covers the
moment between its start and its listing. The kernel sends that signal when the *thread* that started
the child ends, so start a supervisor from a thread that outlives it (the main thread).

Nothing here knows about Redis, vLLM or the proxy: :mod:`kvredis.stack.up` composes those.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TextIO
from urllib.parse import urlsplit

from kvredis.errors import ChildFailed, StackError

_POLL_S = 0.2
_LOG_TAIL_LINES = 30
# After SIGKILL a process is gone at once; this only bounds waiting for the kernel to say so.
_KILL_WAIT_S = 5.0
# How long the watchdog gives the groups of a supervisor that died between SIGTERM and SIGKILL.
_WATCHDOG_GRACE_S = 5.0
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


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


def child_failed(role: str, reason: str, log_path: Path | None) -> ChildFailed:
    """:class:`ChildFailed` for ``role``, quoting the end of its log when there is one."""
    return ChildFailed(role, reason, log_path, log_tail(log_path) if log_path is not None else "")


def group_members(pgid: int) -> list[int]:
    """The live processes of group ``pgid``, read from ``/proc`` (Linux); a zombie does not count: where
    PID 1 does not reap orphans (some containers), a killed engine's worker stays a zombie in the group
    forever, and killpg(pgid, 0) on a group of zombies succeeds."""
    members = []
    for entry in Path("/proc").iterdir():
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
            members.append(int(entry.name))
    return members


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (a zombie, holding only its pid, does not count)."""
    if Path("/proc").is_dir():
        return bool(group_members(pgid))
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- health checks and children -----------------------------------------------------------------


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
    stopped_after_s: float | None = None
    """Seconds from the stop's SIGTERM until no process of the child's group ran (set by a stop)."""
    killed: bool = False
    """The stop sent SIGKILL: the group still ran after the grace period."""

    @property
    def pid(self) -> int:
        """The child's pid, which is also its process group id."""
        return int(self.process.pid)


class Supervisor:
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
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._die_with_parent: Callable[[], None] | None = None
        self.stopped = False

    def __enter__(self) -> Supervisor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def start(self) -> None:
        """Start every phase and wait for its health checks; on any failure stop what started and raise."""
        # Made here, not in __init__: it names this process as the parent.
        self._die_with_parent = _parent_death_signal()
        try:
            self._start_watchdog()
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
                    env=env, start_new_session=True, preexec_fn=self._die_with_parent,
                )
            except OSError as exc:
                raise child_failed(spec.role, f"cannot run {shlex.join(spec.argv)}: {exc}", None) from exc
        child = Child(spec, process, log_path, time.monotonic())
        self.children.append(child)
        self._tell_watchdog(f"+{child.pid}")
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
                    raise child_failed(child.spec.role, reason, child.log_path)
                if child.spec.ready():
                    child.ready_after_s = time.monotonic() - child.started_at
                    self._say(f"{child.spec.role} ready after {child.ready_after_s:.1f} s")
                    waiting.remove(child)
                elif time.monotonic() - child.started_at > child.spec.startup_timeout_s:
                    raise child_failed(
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
            raise child_failed(child.spec.role, f"exited with {_exit_status(code)}", child.log_path)

    def stop(self) -> None:
        """Stop every child, the last phase first: SIGTERM to it (and to what it leaves of its group), SIGKILL
        to its group after the grace period."""
        if self.stopped:
            return
        self.stopped = True
        if self.children:
            self._say("stopping " + ", ".join(child.spec.role for child in reversed(self.children)))
        # Last phase first: the proxy before the engines, and the engines before Redis, which they write
        # their last KV caches to while shutting down.
        for phase in reversed(self._started):
            self._stop_phase(phase)
        self._stop_watchdog()
        if self.children:
            self._say("stopped " + ", ".join(
                f"{child.spec.role} ({_stop_took(child)})" for child in reversed(self.children)))

    def _stop_phase(self, children: Sequence[Child]) -> None:
        # The child alone, not its group: a vLLM API server stops its engine core, and the engine core its
        # workers. Signalled all at once, they exit by themselves while their parent is stopping them, and
        # vLLM 0.32's API server fails its shutdown on a process that vanishes under it (psutil's
        # NoSuchProcess out of kill_process_tree): its HTTP server then runs on until SIGKILL.
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        deadline = signalled + self.stop_grace_s
        pending = list(children)
        orphans_signalled: set[int] = set()
        while pending:
            still = [c for c in pending if c.process.poll() is None or group_alive(c.pid)]
            for child in pending:
                if child not in still:
                    child.stopped_after_s = time.monotonic() - signalled
                elif child.process.poll() is not None and child.pid not in orphans_signalled:
                    # The child exited and left processes of its group behind.
                    orphans_signalled.add(child.pid)
                    signal_group(child.pid, signal.SIGTERM)
            pending = still
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for child in pending:
            self._say(f"{child.spec.role} (pid {child.pid}) still running {self.stop_grace_s:g} s after "
                      "SIGTERM: killing its process group")
            child.killed = True
            signal_group(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + _KILL_WAIT_S
        for child in pending:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            while group_alive(child.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if child.process.poll() is None or group_alive(child.pid):
                self._say(f"warning: process group {child.pid} of {child.spec.role} survived SIGKILL")
            else:
                child.stopped_after_s = time.monotonic() - signalled
        for child in children:
            if child.process.poll() is not None and not group_alive(child.pid):
                self._tell_watchdog(f"-{child.pid}")

    def _start_watchdog(self) -> None:
        try:
            # A session of its own: a Ctrl-C in the terminal, or a kill of this process's group, leaves the
            # watchdog to do its work. Its standard input is the pipe whose end it waits for.
            self._watchdog = subprocess.Popen(
                [sys.executable, "-m", "kvredis.stack.watchdog", f"{_WATCHDOG_GRACE_S:g}"],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as exc:
            raise StackError(f"cannot start the watchdog that stops the children if this process dies: "
                             f"{exc}") from exc

    def _tell_watchdog(self, line: str) -> None:
        watchdog = self._watchdog
        if watchdog is None or watchdog.stdin is None:
            return
        try:
            watchdog.stdin.write(line.encode() + b"\n")
            watchdog.stdin.flush()
        except OSError as exc:
            self._watchdog = None
            self._say(f"warning: the watchdog is gone ({exc}); if this process is killed, stop the "
                      "children's process groups by hand")

    def _stop_watchdog(self) -> None:
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is None:
            return
        # End of file: the watchdog stops the groups still listed (none, after a clean stop) and exits.
        with contextlib.suppress(OSError):
            if watchdog.stdin is not None:
                watchdog.stdin.close()
        try:
            watchdog.wait(timeout=_WATCHDOG_GRACE_S + _KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            watchdog.kill()
            watchdog.wait()

    def rows(self) -> list[tuple[str, str, str, str]]:
        """(pid, role, URL, log) of every child."""
        return [(str(c.pid), c.spec.role, c.spec.url, str(c.log_path)) for c in self.children]


def signal_group(pgid: int, signum: int) -> None:
    """Send ``signum`` to process group ``pgid``, if it still exists."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signum)


def _parent_death_signal() -> Callable[[], None] | None:
    """On Linux, a ``preexec_fn`` giving the child SIGTERM when this process (the starting thread) ends."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def set_signal() -> None:
        # Runs in the child between fork and exec: nothing here may take a lock another thread could hold.
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:  # the parent died before prctl: no signal will come
            os._exit(1)

    return set_signal


def _stop_took(child: Child) -> str:
    if child.stopped_after_s is None:
        return "still running"
    how = ", after SIGKILL" if child.killed else ""
    return f"{child.stopped_after_s:.1f} s{how}"


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
