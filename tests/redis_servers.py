"""Redis servers the tests own: ``redis-server`` started on a free loopback port, so they can hurt it.

Also a Redis Cluster (:class:`ClusterServers`: ``redis-server --cluster-enabled yes`` nodes joined by
``redis-cli --cluster create``) and a Sentinel set-up (:class:`SentinelServers`: a primary, replicas and
sentinels), each with the levers the tests pull: kill a node, migrate a slot, wait for a failover.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
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

    With ``tls`` it listens only on a TLS port (redis-server must be built with TLS). ``password`` is the
    one its ``requirepass`` (in ``extra_args``) asks for: :meth:`client` and :meth:`start`'s PING use it.
    """

    def __init__(
        self, extra_args: Sequence[str] = (), port: int | None = None, tls: ServerTLS | None = None,
        password: str | None = None,
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on the PATH")
        self.binary = binary
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.tls = tls
        self.password = password
        self.dir = tempfile.mkdtemp(prefix="kvredis-test-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` (``rediss://`` with TLS)."""
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        """The ``redis-server`` command line."""
        ports = self.tls.args(self.port) if self.tls else ["--port", str(self.port)]
        return [self.binary, *ports, "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self.dir, *self.extra_args]

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start the server (again, on the same port after ``kill``) and wait until it answers PING."""
        args = self.command()
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
        if self.password is not None:
            options["password"] = self.password
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


def wait_until(condition: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    """Poll ``condition`` until it returns something true, and return that; raise after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = condition()
        except (redis.exceptions.RedisError, LookupError):  # not there yet
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def _redis_cli() -> str:
    binary = shutil.which("redis-cli")
    if binary is None:
        raise RuntimeError("redis-cli is not on the PATH")
    return binary


class ClusterServers:
    """A Redis Cluster on loopback: ``primaries`` shards with ``replicas`` replicas each.

    ``node_timeout_ms`` is ``cluster-node-timeout``: how long a primary may be silent before the others
    mark it failed and a replica takes over (an automatic failover takes about two to three times that).
    """

    def __init__(self, primaries: int = 3, replicas: int = 0, node_timeout_ms: int = 1000,
                 extra_args: Sequence[str] = (), tls: ServerTLS | None = None,
                 password: str | None = None) -> None:
        self.replicas = replicas
        self.tls = tls
        self.password = password
        # Replicas sync at once (no 5 s wait for more replicas to share a diskless sync) and may take over
        # however long ago they last heard their primary.
        args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(node_timeout_ms), "--repl-diskless-sync-delay", "0",
                "--cluster-replica-validity-factor", "0", *extra_args]
        if tls is not None:  # the cluster bus and replication over TLS too (nodes show the client cert)
            args += ["--tls-cluster", "yes", "--tls-replication", "yes", "--tls-client-cert-file",
                     tls.client_cert_file, "--tls-client-key-file", tls.client_key_file]
        if password is not None:
            args += ["--requirepass", password, "--masterauth", password]
        # The cluster bus port is set: the default (port + 10000) does not exist for ports past 55535.
        self.servers = [RedisServer([*args, "--cluster-port", str(free_port())], tls=tls, password=password)
                        for _ in range(primaries * (1 + replicas))]
        self._clients: dict[int, redis.Redis] = {}

    @property
    def url(self) -> str:
        """``redis+cluster://`` (``rediss+cluster://`` with TLS) naming two nodes, without credentials."""
        scheme = "rediss+cluster" if self.tls else "redis+cluster"
        return f"{scheme}://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers[:2])

    def start(self, timeout_s: float = 30.0) -> ClusterServers:
        """Start every node, join them with ``redis-cli --cluster create``, wait until they agree."""
        for server in self.servers:
            server.start()
        command = [_redis_cli(), "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in self.servers),
                   "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        if self.tls is not None:
            command += ["--tls", "--cacert", self.tls.ca_file, "--cert", self.tls.client_cert_file,
                        "--key", self.tls.client_key_file]
        if self.password is not None:
            command += ["--pass", self.password, "--no-auth-warning"]
        done = subprocess.run(command, capture_output=True, timeout=timeout_s, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-2000:]!r} {done.stderr!r}")
        self.wait_healthy(timeout_s)
        return self

    def ask(self, server: RedisServer, *command: Any) -> Any:
        """Run one command on one node (no redirection)."""
        client = self._clients.get(server.port)
        if client is None:
            client = self._clients[server.port] = server.client(socket_timeout=2)
        try:
            return client.execute_command(*command)
        except redis.exceptions.ConnectionError:
            client.close()  # the node may have been killed; a restarted one gets a new connection
            raise

    def command_calls(self, server: RedisServer, command: str) -> int:
        """How many times ``server`` ran ``command`` (INFO commandstats)."""
        stats = self.ask(server, "INFO", "commandstats")
        return int(stats.get(f"cmdstat_{command.lower()}", {}).get("calls", 0))

    def live(self) -> list[RedisServer]:
        """The nodes whose process runs."""
        return [s for s in self.servers if s.process is not None and s.process.poll() is None]

    def node_id(self, server: RedisServer) -> str:
        return bytes(self.ask(server, "CLUSTER", "MYID")).decode()

    def slot_owners(self, server: RedisServer | None = None) -> dict[int, int]:
        """Slot -> port of the primary serving it, as ``server`` (default: a live node) sees it."""
        owners = {}
        for start, end, owner, *_ in self.ask(server or self.live()[0], "CLUSTER", "SLOTS"):
            for slot in range(start, end + 1):
                owners[slot] = int(owner[1])
        return owners

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Until every live node says ``cluster_state:ok``, all see the same slot owners (every slot served
        by a live primary) and every replica's link to its primary is up."""
        live_ports = {s.port for s in self.live()}

        def healthy() -> bool:
            views, replicas = [], 0
            for server in self.live():
                if b"cluster_state:ok" not in self.ask(server, "CLUSTER", "INFO"):
                    return False
                info = self.ask(server, "INFO", "replication")
                if info["role"] == "slave":
                    if info.get("master_link_status") != "up":
                        return False
                    replicas += 1
                views.append(self.slot_owners(server))
            primaries = set(views[0].values())
            return all(view == views[0] for view in views) and len(views[0]) == 16384 \
                and primaries <= live_ports and replicas == len(self.live()) - len(primaries)

        wait_until(healthy, timeout_s, "the cluster to be healthy and agree on its slots")

    def by_port(self, port: int) -> RedisServer:
        return next(s for s in self.servers if s.port == port)

    def primaries(self) -> list[RedisServer]:
        """The nodes serving slots now, in port order."""
        return [self.by_port(port) for port in sorted(set(self.slot_owners().values()))]

    def owner(self, slot: int) -> RedisServer:
        """The primary serving ``slot`` now."""
        return self.by_port(self.slot_owners()[slot])

    def keyslot(self, key: str) -> int:
        return int(self.ask(self.live()[0], "CLUSTER", "KEYSLOT", key))

    def keys_on(self, server: RedisServer, pattern: str) -> list[bytes]:
        """The keys matching ``pattern`` that node ``server`` holds."""
        client = server.client()
        try:
            return list(client.scan_iter(match=pattern, count=1000))
        finally:
            client.close()

    def migrate_slots(self, slots: Sequence[int], target: RedisServer, keys_per_batch: int = 10,
                      duration_s: float = 0.0, pause_s: float = 0.0) -> int:
        """Move ``slots`` (all on one primary) to ``target`` as ``redis-cli --cluster reshard`` does.

        IMPORTING on the target and MIGRATING on the source, then ``MIGRATE ... KEYS`` a batch at a time
        (``pause_s`` after each), for at least ``duration_s`` (keys written meanwhile are moved too) and
        until the source holds none; then ``SETSLOT NODE`` on every primary. Returns how many keys moved.
        """
        sources = {self.owner(slot) for slot in slots}
        if len(sources) != 1 or target in sources:
            raise ValueError("the slots must share one primary, other than the target")
        source = sources.pop()
        others = [s for s in self.primaries() if s not in (source, target)]
        source_id, target_id = self.node_id(source), self.node_id(target)
        for slot in slots:
            self.ask(target, "CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
            self.ask(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        moved, deadline = 0, time.monotonic() + duration_s
        while True:
            batches = 0
            for slot in slots:
                keys = self.ask(source, "CLUSTER", "GETKEYSINSLOT", slot, keys_per_batch)
                if keys:
                    self.ask(source, "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
                    moved += len(keys)
                    batches += 1
                    time.sleep(pause_s)
            if not batches and time.monotonic() >= deadline:
                break
            if not batches:
                time.sleep(max(pause_s, 0.001))
        for slot in slots:
            for server in (target, source, *others):  # the target first, as redis-cli does
                self.ask(server, "CLUSTER", "SETSLOT", slot, "NODE", target_id)
        return moved

    def migrate_slot(self, slot: int, target: RedisServer) -> int:
        """Move one slot to ``target`` (see :meth:`migrate_slots`)."""
        return self.migrate_slots([slot], target)

    def kill(self, server: RedisServer) -> None:
        """SIGKILL one node (remembering which nodes were primaries, for :meth:`wait_failover`)."""
        self._primaries_before = {s.port for s in self.primaries()}
        server.kill()

    def wait_failover(self, dead: RedisServer, timeout_s: float = 20.0) -> RedisServer:
        """After :meth:`kill` of primary ``dead``: wait until a replica serves all its slots and the cluster
        is healthy again; return the promoted node."""

        def promoted() -> RedisServer | None:
            owners = self.slot_owners()
            if dead.port in owners.values() or len(owners) < 16384:
                return None
            return next((s for s in self.primaries() if s.port not in self._primaries_before), None)

        what = f"a replica to take over from 127.0.0.1:{dead.port}"
        new: RedisServer = wait_until(promoted, timeout_s, what)
        self.wait_healthy(timeout_s)
        return new

    def stop(self) -> None:
        for client in self._clients.values():
            client.close()
        for server in self.servers:
            server.__exit__(None, None, None)

    def __enter__(self) -> ClusterServers:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SentinelServer(RedisServer):
    """``redis-server --sentinel`` watching the primary at ``primary_port`` as ``service``.

    ``down_after_ms`` is how long the primary may be silent before this sentinel calls it down; with the
    quorum of sentinels agreeing, they elect a leader that promotes a replica.
    """

    def __init__(self, primary_port: int, service: str, quorum: int = 2, down_after_ms: int = 500,
                 failover_timeout_ms: int = 3000, auth_pass: str | None = None,
                 password: str | None = None) -> None:
        super().__init__(password=password)
        self.config_file = os.path.join(self.dir, "sentinel.conf")
        with open(self.config_file, "w", encoding="utf-8") as config:
            config.write(
                f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
                f"sentinel monitor {service} 127.0.0.1 {primary_port} {quorum}\n"
                f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
                f"sentinel failover-timeout {service} {failover_timeout_ms}\n"
                f"sentinel parallel-syncs {service} 1\n"
            )
            if auth_pass is not None:  # the password of the servers it watches
                config.write(f"sentinel auth-pass {service} {auth_pass}\n")
            if password is not None:  # its own (sentinels use it with each other too)
                config.write(f"requirepass {password}\n")

    def command(self) -> list[str]:
        return [self.binary, self.config_file, "--sentinel"]  # sentinel rewrites its file: it must own it


class SentinelServers:
    """One primary, ``replicas`` replicas and ``sentinels`` sentinels watching them as ``service``.

    ``password`` is the servers' ``requirepass``; ``sentinel_password`` the sentinels' own.
    """

    def __init__(self, replicas: int = 1, sentinels: int = 3, service: str = "kvredis",
                 down_after_ms: int = 500, failover_timeout_ms: int = 3000, password: str | None = None,
                 sentinel_password: str | None = None) -> None:
        self.service = service
        args = ["--repl-diskless-sync-delay", "0"]
        if password is not None:
            args += ["--requirepass", password, "--masterauth", password]
        primary = RedisServer(args, password=password)
        self.servers = [primary] + [
            RedisServer([*args, "--replicaof", "127.0.0.1", str(primary.port)], password=password)
            for _ in range(replicas)]
        self.sentinels = [SentinelServer(primary.port, service, quorum=sentinels // 2 + 1,
                                         down_after_ms=down_after_ms, failover_timeout_ms=failover_timeout_ms,
                                         auth_pass=password, password=sentinel_password)
                          for _ in range(sentinels)]

    @property
    def url(self) -> str:
        """``redis+sentinel://`` naming every sentinel and the service."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}"

    def start(self, timeout_s: float = 30.0) -> SentinelServers:
        """Start the servers, then the sentinels; wait until every sentinel knows the others and replicas."""
        for server in [*self.servers, *self.sentinels]:
            server.start()
        self.wait_healthy(timeout_s)
        return self

    def _sentinel_view(self, sentinel: RedisServer) -> dict[str, Any]:
        client = sentinel.client(socket_timeout=2)
        try:
            return dict(client.sentinel_master(self.service))
        finally:
            client.close()

    def primary(self) -> RedisServer:
        """The server the sentinels name as primary now (all live sentinels must agree)."""
        ports = {int(self._sentinel_view(s)["port"]) for s in self.sentinels
                 if s.process is not None and s.process.poll() is None}
        if len(ports) != 1:
            raise LookupError(f"the sentinels disagree on the primary: {sorted(ports)}")
        port = ports.pop()
        return next(s for s in self.servers if s.port == port)

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Until every sentinel sees the others, a primary that is up, and every live replica in sync."""
        live = [s for s in self.servers if s.process is not None and s.process.poll() is None]

        def healthy() -> bool:
            for sentinel in self.sentinels:
                view = self._sentinel_view(sentinel)
                if view["num-other-sentinels"] != len(self.sentinels) - 1 or view["is_sdown"] \
                        or view["is_odown"] or view["num-slaves"] < len(live) - 1:
                    return False
            primary = self.primary()
            for server in live:
                client = server.client(socket_timeout=2)
                try:
                    info = client.info("replication")
                finally:
                    client.close()
                wanted = "master" if server is primary else "slave"
                if info["role"] != wanted or (wanted == "slave" and info.get("master_link_status") != "up"):
                    return False
            return True

        wait_until(healthy, timeout_s, f"the sentinels to agree on a healthy {self.service!r}", 0.1)

    def wait_failover(self, old: RedisServer, timeout_s: float = 20.0) -> RedisServer:
        """After the primary ``old`` was killed: wait until the sentinels name another live primary."""

        def promoted() -> RedisServer | None:
            primary = self.primary()
            if primary is old:
                return None
            client = primary.client(socket_timeout=2)
            try:
                return primary if client.info("replication")["role"] == "master" else None
            finally:
                client.close()

        new: RedisServer = wait_until(promoted, timeout_s, f"a replica to take over from {old.port}", 0.05)
        return new

    def stop(self) -> None:
        for server in [*self.sentinels, *self.servers]:
            server.__exit__(None, None, None)

    def __enter__(self) -> SentinelServers:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
