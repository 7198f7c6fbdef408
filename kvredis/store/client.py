"""Redis access: connection set-up from the config, and the bulk piece transfers.

Every call goes through :func:`kvredis.store.redis_errors.translate_errors`, the one boundary where redis-py's
exceptions become kvredis's. Connections use redis-py's Python command packer instead of hiredis's: it
sends memoryviews straight to the socket, where hiredis's packer copies every large value twice
(docs/design.md). hiredis still parses replies. Retries are off: a retried RPUSH
would store an entry twice and a retried BLPOP could drop one, so a failed call fails once, clearly.

Three kinds of Redis (:meth:`KVRedisConfig.topology`): one server; Redis Cluster through redis-py's
``RedisCluster``; the primary that Sentinel names, through redis-py's ``Sentinel.master_for``. On a cluster,
every key of an entry shares one hash slot (the ``{digest}`` tag), so each operation talks to one primary.
Redirections are followed: a ``MOVED``, ``ASK`` or ``TRYAGAIN`` reply means the server did *not* run the
command (for a transaction: it refused it whole, ``EXECABORT``), so sending it again to the node named is
safe. What is never sent again is a command whose connection broke or timed out: it may have run. After
such an error the cluster's slot map is refreshed, so the next call finds a promoted replica.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import Encoder, PythonRespSerializer
from redis.retry import Retry
from redis.sentinel import Sentinel

from kvredis.config import KVRedisConfig, Topology
from kvredis.errors import KVRedisConnectionError, KVRedisError, KVRedisTimeoutError
from kvredis.store import resp
from kvredis.store.chunk_keys import key_kind
from kvredis.store.redis_errors import REDIRECTS, raise_first_error, translate_errors, translated

logger = logging.getLogger("kvredis.client")

# Arguments longer than this (and every memoryview) go to the socket as buffers of their own; shorter
# ones are joined into one write. A small record's copy costs less than the extra send call it saves.
_BUFFER_CUTOFF = 256 << 10
# After a connection error or timeout on a cluster, a background thread re-reads the slot maps every
# _REFRESH_EVERY_S for _WATCH_S: a replica promoted meanwhile is found without another failed call.
_WATCH_S = 60.0
_REFRESH_EVERY_S = 0.5

Client = redis.Redis | RedisCluster
"""What :func:`connect` returns: a plain client (one server, or Sentinel's primary) or a cluster client."""


def connect(config: KVRedisConfig, *, read_timeout_s: float | None = None) -> Client:
    """A redis-py client for ``config``: URL, credentials, TLS, timeouts, no retries, zero-copy packer.

    ``read_timeout_s`` bounds each reply (default ``socket_timeout_s``). A ``redis+cluster://`` URL gives a
    ``RedisCluster`` (which discovers the cluster here, so this raises if no startup node answers); a
    ``redis+sentinel://`` URL gives a plain client whose connections go to the primary the sentinels name.
    """
    read_timeout = config.socket_timeout_s if read_timeout_s is None else read_timeout_s
    kwargs: dict[str, Any] = {
        "socket_connect_timeout": config.connect_timeout_s,
        "socket_timeout": read_timeout,
        "retry": Retry(NoBackoff(), 0),
        "command_packer": PythonRespSerializer(_BUFFER_CUTOFF, Encoder("utf-8", "strict", False).encode),
    }
    # Credentials and query options go in as arguments, not in the URL: redis-py lets the URL's win over
    # arguments, which would silently ignore KVREDIS_PASSWORD or the socket bounds.
    url, options = config.connection_options()
    kwargs.update(options)
    topology = config.topology()
    tls_files = (config.tls_ca_file, config.tls_cert_file, config.tls_key_file)
    if not topology.tls and any(path is not None for path in tls_files):
        logger.warning("KVREDIS_TLS_* files are set but %s is not a rediss:// URL: TLS is not used",
                       config.masked_url)
    with translate_errors("connecting to Redis", config):
        if topology.kind == "cluster":
            return _cluster_client(topology, kwargs)
        if topology.kind == "sentinel":
            return _sentinel_client(topology, kwargs, min(config.socket_timeout_s, read_timeout))
        return redis.Redis.from_url(url, **kwargs)


def _cluster_client(topology: Topology, kwargs: dict[str, Any]) -> RedisCluster:
    """``RedisCluster`` on the startup nodes: redirections followed, nothing re-sent after errors."""
    if int(redis.__version__.split(".")[0]) < 6:
        raise KVRedisError(f"redis+cluster:// needs redis-py 6.0 or later (installed: {redis.__version__})")
    kwargs = dict(kwargs)
    packer = kwargs.pop("command_packer")
    no_retry = kwargs.pop("retry")  # the cluster's own: 0, no command is re-sent after a connection error
    kwargs.pop("db", None)  # checked to be 0; RedisCluster refuses the argument
    if topology.tls:
        kwargs["ssl"] = True

    def zero_copy(connection: Any) -> None:
        # RedisCluster makes each node's connections itself and passes no command packer on: set ours
        # once a connection is up (after its handshake), for the large values that follow.
        if hasattr(connection, "_command_packer"):
            connection._command_packer = packer

    client = RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in topology.nodes],
        # Discovery (CLUSTER SLOTS, then COMMAND on one primary) may try other nodes: a client made while a
        # primary is down must not fail for it. Once made, no command is re-sent.
        retry=Retry(NoBackoff(), 2),
        # Serve the slots that have a primary even while others have none (a failover in progress).
        require_full_coverage=False,
        redis_connect_func=zero_copy,
        **kwargs,
    )
    client.set_retry(no_retry)
    return client


def _sentinel_client(topology: Topology, kwargs: dict[str, Any], sentinel_timeout_s: float) -> redis.Redis:
    """A client of the service's current primary: each new connection asks the sentinels where it is."""
    kwargs = dict(kwargs)
    kwargs.pop("db", None)
    sentinel_kwargs: dict[str, Any] = {
        "socket_connect_timeout": kwargs["socket_connect_timeout"],
        "socket_timeout": sentinel_timeout_s,
        "retry": Retry(NoBackoff(), 0),
    }
    for name in ("sentinel_username", "sentinel_password"):
        value = kwargs.pop(name, None)
        if value:
            sentinel_kwargs[name.removeprefix("sentinel_")] = value
    if topology.tls:
        kwargs["ssl"] = True
        sentinel_kwargs.update({key: value for key, value in kwargs.items() if key.startswith("ssl")})
    sentinel = Sentinel(list(topology.nodes), sentinel_kwargs=sentinel_kwargs, **kwargs)
    return sentinel.master_for(str(topology.service), db=topology.db)


def _close(client: Client) -> None:
    client.close()
    manager = getattr(getattr(client, "connection_pool", None), "sentinel_manager", None)
    for sentinel in getattr(manager, "sentinels", ()):  # Sentinel's own clients, one per sentinel
        sentinel.close()


class RedisStore:
    """The Redis commands kvredis needs, each bounded by the config's timeouts and translated errors.

    Large payloads move as pieces: pipelined SETs with a TTL, and pipelined GETDELs copied into a
    caller's buffer, with about ``inflight_bytes`` in flight per round trip.
    """

    def __init__(self, config: KVRedisConfig, client: Client | None = None) -> None:
        self.config = config
        self._owns_clients = client is None
        self._lock = threading.Lock()
        self._clients: dict[str, Client] = {}
        self._watch_until = 0.0  # see _WATCH_S
        self._watcher: threading.Thread | None = None
        self._closed = False
        # Connections kvredis frames its own commands on, kept out of the pool between calls: a pool's
        # get_connection checks each one with several Python calls, which a 64 KiB entry feels. Keyed by
        # pool; one per concurrent caller (list pop and append are atomic: no lock around any I/O).
        self._idle: dict[int, list[Any]] = {}
        if client is not None:
            self.cluster = isinstance(client, RedisCluster)
            self._clients = dict.fromkeys(self._read_timeouts(), client)
        else:
            self.cluster = config.topology().kind == "cluster"
            if not self.cluster:
                # A cluster client discovers the cluster when it is made, so cluster clients are made on
                # first use: a store (and a buffer) can be created while the cluster is unreachable.
                for role, read_timeout_s in self._read_timeouts().items():
                    self._clients[role] = connect(config, read_timeout_s=read_timeout_s)

    def _read_timeouts(self) -> dict[str, float | None]:
        return {
            "main": None,
            # Blocking pops wait up to the pop timeout on the server, so their socket bound is longer.
            "pop": self.config.socket_timeout_s + self.config.pop_timeout_s,
            # vLLM's scheduler asks for every new request; a slow Redis must cost it little.
            "probe": self.config.lookup_timeout_s,
        }

    def _client(self, role: str) -> Client:
        client = self._clients.get(role)
        if client is None:
            with self._lock:
                # All three at once: a reader that could pop an entry must be able to read its pieces too.
                for name, read_timeout_s in self._read_timeouts().items():
                    if name not in self._clients:
                        self._clients[name] = connect(self.config, read_timeout_s=read_timeout_s)
                client = self._clients[role]
        return client

    def _watch_topology(self) -> None:
        """Re-read every cluster client's slot map in the background for a while (see ``_WATCH_S``).

        Calls never wait for it. Without it, each client would learn of a promoted replica only by failing
        once more against the dead primary's address.
        """
        with self._lock:
            self._watch_until = time.monotonic() + _WATCH_S
            if self._watcher is None and not self._closed:
                self._watcher = threading.Thread(target=self._refresh_slot_maps, daemon=True,
                                                 name="kvredis-cluster-watch")
                self._watcher.start()

    def _refresh_slot_maps(self) -> None:
        while True:
            time.sleep(_REFRESH_EVERY_S)
            with self._lock:
                if self._closed or time.monotonic() >= self._watch_until:
                    self._watcher = None
                    return
                clients = {id(client): client for client in self._clients.values()}.values()
            for client in clients:
                if isinstance(client, RedisCluster):
                    with contextlib.suppress(Exception):  # a failed refresh leaves the map as it was
                        client.nodes_manager.initialize()

    @property
    def redis(self) -> Any:
        """The client for all but blocking pops and existence checks (a ``RedisCluster`` on a cluster)."""
        return self._client("main")

    @property
    def prober(self) -> Any:
        """The client whose replies are bounded by ``lookup_timeout_s`` (lookups in vLLM's scheduler)."""
        return self._client("probe")

    def guarded(self, what: str) -> _Guard:
        """A block whose redis-py errors become kvredis errors naming ``what`` (callers of :attr:`redis`)."""
        return _Guard(self, what)

    @property
    def popper(self) -> Any:
        """The client whose replies may wait up to ``pop_timeout_s`` on the server (blocking pops)."""
        return self._client("pop")

    @property
    def _popper(self) -> Any:
        return self._client("pop")

    @property
    def _prober(self) -> Any:
        return self._client("probe")

    def _guard(self, what: str) -> _Guard:
        """A block whose redis-py errors become kvredis errors naming ``what`` (see :func:`translated`)."""
        return _Guard(self, what)

    def _failed(self, error: BaseException) -> None:
        """Note a failed call: on a cluster, a primary may be failing over, so watch the slot map a while."""
        if self.cluster and isinstance(error, (KVRedisConnectionError, KVRedisTimeoutError)):
            self._watch_topology()

    def ping(self) -> None:
        """Raise a kvredis error unless Redis answers (on the connections entries move over)."""
        with self._guard("PING"):
            if not self.cluster:
                for client in (self.redis, self._popper):
                    with self._socket(client) as sock:
                        if sock is not None:
                            raise_first_error(resp.call(sock, ("PING",)))
                            continue
                        client.ping()
                return
            self.redis.ping()

    @contextlib.contextmanager
    def _socket(self, client: Any) -> Iterator[socket.socket | None]:
        """A connection's socket, for commands kvredis frames itself (``None``: a stand-in client such as
        fakeredis, whose commands go through redis-py). A connection that saw an error is closed: a reply
        may be half read."""
        pool, connection, sock = self._checkout(client)
        try:
            yield sock
        except BaseException:
            self._checkin(pool, connection, sock, failed=True)
            raise
        self._checkin(pool, connection, sock, failed=False)

    def call(self, client: Any, *commands: Sequence[resp.Argument]) -> list[Any] | None:
        """:func:`resp.call` on a kept connection of ``client``; ``None`` for a stand-in client (fakeredis),
        whose commands go through redis-py. What :meth:`_socket` does, without a context manager: a small
        entry's round trip feels each layer."""
        return self._on_kept_socket(client, resp.call, *commands)

    def call_in_groups(self, client: Any,
                       groups: Iterable[Sequence[Sequence[resp.Argument]]]) -> list[Any] | None:
        """:func:`resp.call_in_groups` on a kept connection of ``client``; ``None`` for a stand-in client (the
        groups are then not made)."""
        return self._on_kept_socket(client, resp.call_in_groups, groups)

    def pipeline(self, client: Any, commands: Sequence[Sequence[resp.Argument]],
                 places: Sequence[resp.Place | None], costs: Sequence[int],
                 window_bytes: int,
                 on_reply: Callable[[int, list[Any]], None] | None = None) -> list[Any] | None:
        """:func:`resp.pipeline` on a kept connection of ``client`` (bulk replies received where ``places``
        say, about ``window_bytes`` requested ahead, ``on_reply`` run as each is in); ``None`` for a
        stand-in client, as :meth:`call`."""
        return self._on_kept_socket(client, resp.pipeline, commands, places, costs, window_bytes, on_reply)

    def _on_kept_socket(self, client: Any, run: Callable[..., list[Any]], *args: Any) -> list[Any] | None:
        """``run(sock, *args)`` on a kept connection of ``client``, checked in again as failed if it raised;
        ``None`` for a stand-in client (its connection is given back unused)."""
        pool, connection, sock = self._checkout(client)
        if sock is None:
            pool.release(connection)
            return None
        try:
            replies = run(sock, *args)
        except BaseException:
            self._checkin(pool, connection, sock, failed=True)
            raise
        self._checkin(pool, connection, sock, failed=False)
        return replies

    def _checkout(self, client: Any) -> tuple[Any, Any, socket.socket | None]:
        """An idle connection of ``client``'s pool still open (else a new one), and its socket if kvredis
        can frame commands on it."""
        pool = client.connection_pool
        idle = self._idle.get(id(pool))
        if idle is None:
            idle = self._idle.setdefault(id(pool), [])
        connection = None
        while idle:
            candidate = idle.pop()
            if _still_open(candidate):
                connection = candidate
                break
            candidate.disconnect()
            pool.release(candidate)
        if connection is None:
            connection = self._connection(pool)
        sock = getattr(connection, "_sock", None)
        return pool, connection, sock if isinstance(sock, socket.socket) else None

    def _checkin(self, pool: Any, connection: Any, sock: socket.socket | None, *, failed: bool) -> None:
        """Keep a connection for the next call, or hand it back to its pool (closed if the call failed)."""
        if failed:
            connection.disconnect()
            pool.release(connection)
        elif self._closed or sock is None or isinstance(sock, ssl.SSLSocket):
            pool.release(connection)
        else:
            self._idle[id(pool)].append(connection)

    def _release_idle(self) -> None:
        for client in {id(client): client for client in self._clients.values()}.values():
            pool = getattr(client, "connection_pool", None)
            if pool is not None:
                for connection in self._idle.pop(id(pool), []):
                    pool.release(connection)

    def push_record(self, queue: str, record: resp.Buffer | Sequence[resp.Buffer], ttl_ms: int) -> None:
        """Append ``record`` (one buffer, or a list of buffers sent as one value, not joined) to list
        ``queue`` and refresh the list's TTL, atomically, in one round trip."""
        parts: list[resp.Buffer] = (
            [record] if isinstance(record, (bytes, bytearray, memoryview)) else list(record))
        with self._guard(f"storing record in {queue}"):
            if not self.cluster:
                replies = self.call(self.redis, ("MULTI",), ("RPUSH", queue, parts),
                                     ("PEXPIRE", queue, ttl_ms), ("EXEC",))
                if replies is not None:
                    raise_first_error(replies)
                    return
            value = parts[0] if len(parts) == 1 else b"".join(parts)
            if self.cluster:
                self._cluster_transaction(queue, [("RPUSH", queue, value), ("PEXPIRE", queue, ttl_ms)])
                return
            pipe = self.redis.pipeline(transaction=True)
            pipe.rpush(queue, value)
            pipe.pexpire(queue, ttl_ms)
            pipe.execute()

    def pop_record(self, queue: str, timeout_s: float) -> bytes | bytearray | None:
        """Take the oldest record of ``queue``, waiting up to ``timeout_s`` for one; ``None`` if none came."""
        wait = max(timeout_s, 0.001)  # BLPOP 0 would wait forever
        with self._guard(f"BLPOP {queue}"):
            if not self.cluster:
                replies = self.call(self._popper, ("BLPOP", queue, f"{wait:.3f}"))
                if replies is not None:
                    raise_first_error(replies)
                    (reply,) = replies
                    if reply is None:
                        return None
                    if not (isinstance(reply, list) and len(reply) == 2 and isinstance(reply[1], bytearray)):
                        raise KVRedisError(f"BLPOP {queue} answered {str(reply)[:60]}")
                    return reply[1]  # writable: the entry's tensors are views of it
            reply = self._popper.blpop([queue], timeout=wait)
        if reply is None:
            return None
        record = reply[1]
        if not isinstance(record, bytes):
            raise KVRedisError("the Redis client decodes responses to text; kvredis needs raw bytes")
        return record

    def peek_length(self, queue: str) -> int:
        """How many records wait in ``queue`` (no side effect)."""
        with self._guard(f"LLEN {queue}"):
            if not self.cluster:
                replies = self.call(self._prober, ("LLEN", queue))
                if replies is not None:
                    raise_first_error(replies)
                    return int(replies[0])
            return int(self._prober.llen(queue))

    def put_pieces(self, keys: Sequence[str], pieces: Sequence[bytes | memoryview], ttl_ms: int) -> None:
        """SET each key to its piece with a TTL, pipelined; raise if any SET was refused."""
        batch_bytes = max(self.config.write_batch_bytes, 1)
        with self._guard(f"storing {len(keys)} pieces"):
            if not self.cluster:
                with self._socket(self.redis) as sock:
                    if sock is not None:
                        raise_first_error([resp.put_pieces(sock, keys, pieces, ttl_ms, batch_bytes)])
                        return
            pipe = self.redis.pipeline(transaction=False)
            pending = 0
            for key, piece in zip(keys, pieces, strict=True):
                pipe.set(key, piece, px=ttl_ms)
                pending += len(piece)
                if pending >= batch_bytes:
                    _check_all(pipe.execute(raise_on_error=True), "SET")
                    pending = 0
            if len(pipe):
                _check_all(pipe.execute(raise_on_error=True), "SET")

    def take_pieces(
        self, keys: Sequence[str], sizes: Sequence[int], out: memoryview
    ) -> tuple[str, str] | None:
        """GETDEL each key into consecutive slices of ``out``; ``None``, or the first bad key and why.

        Why is ``"partial"`` for a missing piece (expired, evicted) and ``"corrupt"`` for one of the wrong
        size or type (planted). Stops early at the first bad piece: the entry is lost either way, and the
        caller deletes what is left.
        """
        with self._guard(f"reading {len(keys)} pieces"):
            redirected: list[int] | None = None
            if self.cluster:
                # Read from the primary of the entry's slot; pieces being resharded come back redirected.
                redirected = []
                node = self.redis.nodes_manager.get_node_from_slot(self.redis.keyslot(keys[0]))
                pool = self.redis.get_redis_connection(node).connection_pool
            else:
                pool = self.redis.connection_pool
            connection = self._connection(pool)
            try:
                sock = getattr(connection, "_sock", None)
                if not isinstance(sock, socket.socket):  # fakeredis and other stand-ins
                    return self._take_pieces_pipelined(keys, sizes, out)
                failure = resp.take_into(sock, keys, sizes, out, self.config.inflight_bytes, redirected)
            except BaseException as exc:
                # A reply may be half read: the connection cannot be reused.
                connection.disconnect()
                if self.cluster and isinstance(exc, (OSError, redis.exceptions.RedisError)):
                    self._refresh_slots()
                raise
            finally:
                pool.release(connection)
            if failure is None and redirected:
                return self._take_redirected(keys, sizes, out, redirected)
        return None if failure is None else (keys[failure[0]], failure[1])

    def _take_redirected(
        self, keys: Sequence[str], sizes: Sequence[int], out: memoryview, indexes: list[int]
    ) -> tuple[str, str] | None:
        """GETDEL the pieces a resharding node redirected, through the cluster client (it follows ASK)."""
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + size)
        pipe = self.redis.pipeline(transaction=False)
        for index in indexes:
            pipe.getdel(keys[index])
        for index, value in zip(indexes, pipe.execute(raise_on_error=False), strict=True):
            if value is None:
                return keys[index], "partial"
            if isinstance(value, redis.exceptions.ResponseError) and "WRONGTYPE" not in str(value):
                raise value
            if not isinstance(value, bytes) or len(value) != sizes[index]:
                return keys[index], "corrupt"
            out[offsets[index]:offsets[index + 1]] = value
        return None

    def _cluster_transaction(self, key: str, commands: list[tuple[Any, ...]]) -> list[Any]:
        """MULTI/EXEC of ``commands`` (all on ``key``'s slot) on the slot's primary, following redirections.

        A ``MOVED``/``ASK``/``TRYAGAIN`` reply to a queued command makes the server refuse the whole
        transaction (``EXECABORT``: nothing ran), so it is sent again to the node named (after ``ASKING``
        for an ``ASK``). A connection error or timeout is raised, never re-sent: the commands may have run.
        redis-py's cluster transactions neither send ``ASKING`` nor exist before redis-py 6.
        """
        cluster = self.redis
        slot = cluster.keyslot(key)
        node = cluster.nodes_manager.get_node_from_slot(slot)
        asking = False
        redirect: Exception | None = None
        for _ in range(REDIRECTS):
            stack = [("ASKING",)] if asking else []
            stack += [("MULTI",), *commands, ("EXEC",)]
            pool = cluster.get_redis_connection(node).connection_pool
            connection = self._connection(pool)
            replies: list[Any] = []
            try:
                connection.send_packed_command(connection.pack_commands(stack))
                for _command in stack:
                    try:
                        replies.append(connection.read_response())
                    except redis.exceptions.ResponseError as exc:  # a whole error reply: still in step
                        replies.append(exc)
            except BaseException as exc:
                connection.disconnect()
                if isinstance(exc, (OSError, redis.exceptions.RedisError)):
                    self._refresh_slots()
                raise
            finally:
                pool.release(connection)
            queued, result = replies[-len(commands) - 1:-1], replies[-1]
            redirect = next((reply for reply in queued if isinstance(
                reply, (redis.exceptions.AskError, redis.exceptions.TryAgainError))), None)
            if redirect is None:
                results = result if isinstance(result, list) else [result]
                errors = [reply for reply in [*replies[:-1], *results] if isinstance(reply, Exception)]
                if errors:
                    raise errors[0]
                return list(result)
            asking = False
            if isinstance(redirect, redis.exceptions.MovedError):  # the slot has a new owner: learn the map
                self._refresh_slots()
                node = cluster.nodes_manager.get_node_from_slot(slot)
            elif isinstance(redirect, redis.exceptions.AskError):  # mid-migration: this key is on the target
                target = cluster.get_node(host=redirect.host, port=redirect.port)
                if target is None:
                    self._refresh_slots()
                    target = cluster.get_node(host=redirect.host, port=redirect.port)
                if target is None:
                    raise redirect
                node, asking = target, True
            else:  # TRYAGAIN: keys of the command are split between the two nodes for a moment
                time.sleep(0.05)
        assert redirect is not None
        raise redirect

    def _connection(self, pool: Any) -> Any:
        """A connection from ``pool``, connected; on a cluster, a node that cannot be reached makes the
        slot map be read again (as redis-py does for the commands it sends itself)."""
        try:
            return pool.get_connection()
        except (OSError, redis.exceptions.RedisError):
            if self.cluster:
                self._refresh_slots()
            raise

    def _refresh_slots(self) -> None:
        """Re-read the cluster's slot map after an error (best effort: the error itself is what is raised)."""
        with contextlib.suppress(Exception):
            self.redis.nodes_manager.initialize()

    def _take_pieces_pipelined(
        self, keys: Sequence[str], sizes: Sequence[int], out: memoryview
    ) -> tuple[str, str] | None:
        per_batch = max(1, self.config.inflight_bytes // max(max(sizes, default=1), 1))
        position = 0
        for start in range(0, len(keys), per_batch):
            batch = keys[start:start + per_batch]
            pipe = self.redis.pipeline(transaction=False)
            for key in batch:
                pipe.getdel(key)
            replies = pipe.execute(raise_on_error=False)
            for key, size, value in zip(batch, sizes[start:start + per_batch], replies, strict=True):
                if value is None:
                    return key, "partial"
                if isinstance(value, redis.exceptions.ResponseError) and "WRONGTYPE" not in str(value):
                    raise value
                if not isinstance(value, bytes) or len(value) != size:
                    return key, "corrupt"
                out[position:position + size] = value
                position += size
        return None

    def delete(self, keys: Sequence[str]) -> int:
        """Delete keys (ignoring ones already gone); returns how many existed."""
        if not keys:
            return 0
        with self._guard(f"deleting {len(keys)} keys"):
            return int(self.redis.delete(*keys))

    def scan(self, pattern: str, count: int = 1000) -> Iterator[str]:
        """Iterate over keys matching ``pattern`` without blocking the server."""
        with self._guard(f"SCAN {pattern}"):
            for key in self.redis.scan_iter(match=pattern, count=count):
                yield key.decode() if isinstance(key, bytes) else str(key)

    def summary(self, pattern: str, *, besides: tuple[str, ...] = ()) -> dict[str, Any]:
        """What the keys matching ``pattern`` hold: KV chunks (the vLLM connector's), transfer records and
        holders' sets, the lookup buffer's entries and pieces, their bytes and TTLs, and server memory.
        ``besides``: keys left out (counted by their readers, as the tally is)."""
        keys = [key for key in self.scan(pattern) if key not in besides]
        entries = prompts = stored_bytes = chunk_bytes = 0
        ttls: list[int] = []
        chunk_ttls: list[int] = []
        kinds = {"chunks": 0, "holders": 0, "transfers": 0}
        with self._guard(f"summarising {pattern}"):
            pipe = self.redis.pipeline(transaction=False)
            for key in keys:
                pipe.type(key)
                pipe.pttl(key)
                pipe.memory_usage(key)
            replies = pipe.execute()
            names = [key.decode(errors="replace") if isinstance(key, bytes) else str(key) for key in keys]
            # Lists that are not transfer records are the lookup buffer's queues of entries.
            kind_of = [key_kind(name) for name in names]
            queues = [key for i, key in enumerate(keys)
                      if kind_of[i] is None and replies[3 * i] in (b"list", "list")]
            pipe = self.redis.pipeline(transaction=False)
            for key in queues:
                pipe.llen(key)
            entries = sum(int(n) for n in pipe.execute())
            prompts = len(queues)
            for i in range(len(keys)):
                ttl, usage = replies[3 * i + 1], replies[3 * i + 2]
                stored_bytes += int(usage or 0)
                if ttl is not None and int(ttl) >= 0:
                    ttls.append(int(ttl))
                kind = kind_of[i]
                if kind is not None:
                    kinds[kind] += 1
                if kind == "chunks":
                    chunk_bytes += int(usage or 0)
                    if ttl is not None and int(ttl) >= 0:
                        chunk_ttls.append(int(ttl))
            if self.cluster:  # every primary's memory, summed (each holds part of the namespace)
                per_node = self.redis.info("memory", target_nodes=RedisCluster.PRIMARIES)
                infos = list(per_node.values())
                memory: dict[str, Any] = {name: sum(int(info.get(name) or 0) for info in infos)
                                          for name in ("used_memory", "maxmemory")}
                memory["maxmemory_policy"] = ",".join(sorted({str(info.get("maxmemory_policy"))
                                                              for info in infos}))
            else:
                memory = self.redis.info("memory")
        chunk_ttls.sort()
        return {
            "keys": len(keys),
            **kinds,
            "chunk_bytes": chunk_bytes,
            "chunk_ttl_min_s": chunk_ttls[0] / 1000 if chunk_ttls else None,
            "chunk_ttl_median_s": chunk_ttls[len(chunk_ttls) // 2] / 1000 if chunk_ttls else None,
            "chunk_ttl_max_s": chunk_ttls[-1] / 1000 if chunk_ttls else None,
            "prompts": prompts,
            "entries": entries,
            "pieces": len(keys) - prompts - sum(kinds.values()),
            "bytes": stored_bytes,
            "ttl_min_s": min(ttls) / 1000 if ttls else None,
            "ttl_max_s": max(ttls) / 1000 if ttls else None,
            "keys_without_ttl": len(keys) - len(ttls),
            "redis_used_memory": memory.get("used_memory"),
            "redis_maxmemory": memory.get("maxmemory"),
            "redis_maxmemory_policy": memory.get("maxmemory_policy"),
        }

    def close(self) -> None:
        """Close the connections this store opened (not a client passed in)."""
        with self._lock:
            self._closed = True
        self._release_idle()
        if self._owns_clients:
            for client in self._clients.values():
                _close(client)


class _Guard:
    """:meth:`RedisStore._guard`: :func:`translate_errors` and the cluster watch in one plain context manager
    (a generator-based one costs a small entry's round trip several microseconds a call)."""

    __slots__ = ("store", "what")

    def __init__(self, store: RedisStore, what: str) -> None:
        self.store = store
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc is None or not isinstance(exc, Exception):
            return
        error = translated(exc, self.what, self.store.config)
        self.store._failed(exc if error is None else error)
        if error is not None:
            raise error from None


def _still_open(connection: Any) -> bool:
    """Whether an idle connection's server end is still there and has sent nothing unasked (one peek)."""
    sock = getattr(connection, "_sock", None)
    if not isinstance(sock, socket.socket):
        return False
    try:
        # Readable while idle means closed (EOF) or out of step; a zero-timeout select never waits.
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


def _check_all(replies: list[Any], command: str) -> None:
    for reply in replies:
        if reply is not True and reply != b"OK":
            raise KVRedisError(f"{command} was refused: {reply!r}")

