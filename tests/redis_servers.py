"""Redis servers the tests own: ``redis-server`` started on a free loopback port, so they can hurt it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class ServerTLS:
    """PEM files for a TLS-only server, and the client certificate the tests' own client uses."""

    ca_file: str
    cert_file: str
    key_file: str
    client_cert_file: str
    client_key_file: str
    auth_clients: str = "yes"  # redis-server's --tls-auth-clients: yes, optional or no

    def args(self, port: int) -> list[str]:
        """redis-server arguments: TLS on ``port``, no plain-text port."""
        return ["--port", "0", "--tls-port", str(port), "--tls-cert-file", self.cert_file,
                "--tls-key-file", self.key_file, "--tls-ca-cert-file", self.ca_file,
                "--tls-auth-clients", self.auth_clients]

    def client_kwargs(self) -> dict[str, Any]:
        """redis-py arguments of a client this server trusts."""
        return {"ssl": True, "ssl_ca_certs": self.ca_file, "ssl_certfile": self.client_cert_file,
                "ssl_keyfile": self.client_key_file}


class RedisServer:
    """One ``redis-server`` process with nothing on disk; ``stop``/``kill``/``start`` for fault tests.

    With ``tls`` it listens only on a TLS port (redis-server must be built with TLS).
    """

    def __init__(
        self, extra_args: Sequence[str] = (), port: int | None = None, tls: ServerTLS | None = None
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on the PATH")
        self.binary = binary
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.tls = tls
        self.dir = tempfile.mkdtemp(prefix="kvredis-test-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` (``rediss://`` with TLS)."""
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start the server (again, on the same port after ``kill``) and wait until it answers PING."""
        ports = self.tls.args(self.port) if self.tls else ["--port", str(self.port)]
        args = [self.binary, *ports, "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self.dir, *self.extra_args]
        log = open(os.path.join(self.dir, "redis.log"), "ab")  # noqa: SIM115 - lives as long as the server
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()  # the child has its own copy
        deadline = time.monotonic() + timeout_s
        client = self.client(socket_timeout=1)
        while True:
            try:
                if client.ping():
                    break
            except redis.exceptions.RedisError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start: {self.log_tail()}")
            time.sleep(0.02)
        client.close()
        return self

    def client(self, **kwargs: Any) -> redis.Redis:
        """A plain redis-py client for inspecting the server (as the default user, over TLS if need be)."""
        options: dict[str, Any] = {"socket_timeout": 5, **(self.tls.client_kwargs() if self.tls else {})}
        options.update(kwargs)
        return redis.Redis(host="127.0.0.1", port=self.port, **options)

    def restart(self) -> RedisServer:
        """SIGKILL, then start again on the same port, empty (nothing is persisted)."""
        self.kill()
        return self.start()

    def kill(self) -> None:
        """SIGKILL: the server dies mid-whatever, as in a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self) -> None:
        """Terminate the server and wait for it."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, lines: int = 20) -> str:
        """The end of the server's log."""
        try:
            with open(os.path.join(self.dir, "redis.log"), "rb") as log:
                return b"".join(log.readlines()[-lines:]).decode(errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
