"""TLS, ACL users, secrets kept out of every message, tenants, and hostile data planted in a namespace.

TLS and ACL tests start their own ``redis-server`` (certificates are made at test time); hostile-input
tests run on fakeredis and on the real server, each in a namespace of its own.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import pickle
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import namespace_keys
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from kv_entries import assert_entry, kv_entry
from redis_servers import RedisServer, ServerTLS, free_port

from kvredis import ConfigError, KVRedisConnectionError, KVRedisError, KVRedisTimeoutError
from kvredis.config import KVRedisConfig
from kvredis.store import codec
from kvredis.store.chunk_store import PageFormat
from kvredis.store.client import RedisStore
from kvredis.store.generation import Generation, generation_key
from kvredis.store.keys import CacheIdentity, new_entry_id
from kvredis.store.tally import Tally, tally_key
from kvredis.store.transfer import Transfers
from kvredis.v0.buffer import RedisLookupBuffer

MISS = [None] * 5
BUFFER_COMMANDS = ("rpush", "pexpire", "multi", "exec", "blpop", "llen", "set", "getdel", "del")
"""The commands the lookup buffer sends; the minimal ACL rule of docs/deployment.md lists exactly these."""


def acl_rules(namespace: str, commands: tuple[str, ...] = BUFFER_COMMANDS) -> list[str]:
    """docs/deployment.md's minimal rule for a buffer user of ``namespace``, as ACL SETUSER arguments."""
    return [f"~{namespace}:*", "resetchannels", "-@all", *(f"+{name}" for name in commands)]


def buffer_for(url: str, namespace: str, env: dict[str, str] | None = None, **overrides: Any
               ) -> RedisLookupBuffer:
    settings = {"url": url, "namespace": namespace, "pop_timeout_s": 0.2, "connect_timeout_s": 1.0,
                "socket_timeout_s": 2.0, "chunk_bytes": 4096, **overrides}
    return RedisLookupBuffer(KVRedisConfig.from_env(env or {}, settings))


def round_trips(buffer: RedisLookupBuffer, seed: int = 0) -> None:
    """An inline and a chunked entry in and out, ``contains`` before and after, and a miss."""
    for tokens_count, chunk_bytes in ((8, None), (200, buffer.config.chunk_bytes)):
        tokens, key, value, hidden = kv_entry(tokens_count, seed=seed)
        assert (codec.payload_size([key, value]) > buffer.config.chunk_bytes) == (chunk_bytes is not None)
        buffer.insert(tokens, None, key, value, hidden)
        assert buffer.contains(tokens)
        assert_entry(buffer.drop_select(tokens, None), tokens, key, value, hidden)
        assert not buffer.contains(tokens)
    assert buffer.drop_select(torch.arange(3), None) == MISS


# --- certificates -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Certs:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str  # a CA that signed nothing here

    def server(self, auth_clients: str = "yes") -> ServerTLS:
        return ServerTLS(self.ca, self.server_cert, self.server_key, self.client_cert, self.client_key,
                         auth_clients)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: str, issuer: x509.Name, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


def _write(directory: Path, stem: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate
           ) -> tuple[str, str]:
    key_path, cert_path = directory / f"{stem}.key", directory / f"{stem}.crt"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(cert_path), str(key_path)


def _ca(directory: Path, stem: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder(f"kvredis test {stem}", _name(f"kvredis test {stem}"), key)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert, _write(directory, stem, key, cert)[0]


def _leaf(directory: Path, stem: str, ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate,
          server: bool) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (_builder(stem, ca_cert.subject, key)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return _write(directory, stem, key, builder.sign(ca_key, hashes.SHA256()))


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    directory = tmp_path_factory.mktemp("tls")
    ca_key, ca_cert, ca_path = _ca(directory, "ca")
    server_cert, server_key = _leaf(directory, "server", ca_key, ca_cert, server=True)
    client_cert, client_key = _leaf(directory, "client", ca_key, ca_cert, server=False)
    other_ca = _ca(directory, "other-ca")[2]
    return Certs(ca_path, server_cert, server_key, client_cert, client_key, other_ca)


@pytest.fixture
def tls_server(certs: Certs) -> Iterator[Callable[[str], RedisServer]]:
    servers: list[RedisServer] = []

    def start(auth_clients: str = "yes") -> RedisServer:
        server = RedisServer(tls=certs.server(auth_clients))
        servers.append(server)
        try:
            return server.start()
        except RuntimeError as exc:  # e.g. a redis-server built without TLS: say so, do not skip
            pytest.fail(f"could not start a TLS redis-server: {exc}")

    yield start
    for server in servers:
        server.__exit__(None, None, None)


# --- TLS ----------------------------------------------------------------------------------------------


def test_tls_round_trip_with_kvredis_tls_variables(tls_server, certs, namespace):
    server = tls_server("yes")  # mutual TLS: the client must show its certificate
    env = {"KVREDIS_TLS_CA_FILE": certs.ca, "KVREDIS_TLS_CERT_FILE": certs.client_cert,
           "KVREDIS_TLS_KEY_FILE": certs.client_key}
    with buffer_for(server.url, namespace, env) as buffer:
        assert buffer.config.url.startswith("rediss://")
        round_trips(buffer)


def test_tls_round_trip_with_redis_py_url_query(tls_server, certs, namespace):
    server = tls_server("yes")
    url = (f"{server.url}?ssl_ca_certs={certs.ca}&ssl_certfile={certs.client_cert}"
           f"&ssl_keyfile={certs.client_key}&ssl_cert_reqs=required&ssl_check_hostname=true")
    with buffer_for(url, namespace) as buffer:
        round_trips(buffer)


def test_tls_variables_win_over_the_url_query(tls_server, certs, namespace):
    server = tls_server("optional")
    url = f"{server.url}?ssl_ca_certs={certs.other_ca}"
    with buffer_for(url, namespace, {"KVREDIS_TLS_CA_FILE": certs.ca}) as buffer:
        round_trips(buffer)
    with buffer_for(url, namespace) as buffer, pytest.raises(KVRedisConnectionError):
        buffer.contains(torch.arange(3))


def test_tls_without_client_certificate_when_the_server_does_not_ask(tls_server, certs, namespace):
    server = tls_server("optional")
    with buffer_for(server.url, namespace, {"KVREDIS_TLS_CA_FILE": certs.ca}) as buffer:
        round_trips(buffer)


def test_tls_wrong_ca_fails_with_certificate_verification_error_not_a_miss(tls_server, certs, namespace):
    server = tls_server("yes")
    env = {"KVREDIS_TLS_CA_FILE": certs.other_ca, "KVREDIS_TLS_CERT_FILE": certs.client_cert,
           "KVREDIS_TLS_KEY_FILE": certs.client_key}
    with buffer_for(server.url, namespace, env) as buffer:
        tokens, key, value, hidden = kv_entry(8)
        for call in (lambda: buffer.insert(tokens, None, key, value, hidden),
                     lambda: buffer.drop_select(tokens, None),
                     lambda: buffer.contains(tokens)):
            started = time.monotonic()
            with pytest.raises(KVRedisConnectionError, match="certificate verification failed"):
                call()
            assert time.monotonic() - started < buffer.config.connect_timeout_s
        assert buffer.metrics["miss_error"] == 1 and buffer.metrics["store_failed_error"] == 1


def test_tls_missing_client_certificate_fails_clearly(tls_server, certs, namespace):
    server = tls_server("yes")
    with buffer_for(server.url, namespace, {"KVREDIS_TLS_CA_FILE": certs.ca}) as buffer, \
            pytest.raises(KVRedisConnectionError, match=r"TLS connection failed.*client certificate"):
        buffer.contains(torch.arange(3))


def test_plain_text_client_against_a_tls_port_fails_clearly(tls_server, namespace):
    server = tls_server("optional")
    with buffer_for(server.url.replace("rediss://", "redis://"), namespace) as buffer:
        started = time.monotonic()
        with pytest.raises(KVRedisError):
            buffer.contains(torch.arange(3))
        assert time.monotonic() - started < buffer.config.socket_timeout_s + 0.5


@pytest.mark.parametrize("query, problem", [
    ("ssl_cert_reqs=sometimes", "ssl_cert_reqs"),
    ("ssl_ca_certs=/nonexistent/ca.pem", "no such file"),
    ("socket_timeout=100", "unknown URL parameter 'socket_timeout'"),
    ("retry_on_timeout=yes", "unknown URL parameter"),
])
def test_url_query_is_checked_when_the_config_is_read(query, problem):
    with pytest.raises(ConfigError, match=problem):
        KVRedisConfig.from_env({"KVREDIS_URL": f"rediss://127.0.0.1:6380/0?{query}"})


def test_tls_query_on_a_plain_url_is_refused(certs):
    with pytest.raises(ConfigError, match="needs a rediss:// URL"):
        KVRedisConfig.from_env({"KVREDIS_URL": f"redis://127.0.0.1:6379/0?ssl_ca_certs={certs.ca}"})


def test_tls_variables_with_a_plain_url_warn(certs, caplog, namespace, real_redis_url):
    caplog.set_level(logging.WARNING, logger="kvredis")
    with buffer_for(real_redis_url, namespace, {"KVREDIS_TLS_CA_FILE": certs.ca}):
        pass
    assert any("TLS is not used" in record.getMessage() for record in caplog.records)


# --- how the URL and the variables combine ------------------------------------------------------------


def test_connection_options_let_the_variables_win_and_keep_secrets_out_of_the_url(certs):
    config = KVRedisConfig.from_env({
        "KVREDIS_URL": f"rediss://alice:url%40pw@127.0.0.1:6380/2?ssl_ca_certs={certs.other_ca}"
                       "&ssl_cert_reqs=optional",
        "KVREDIS_PASSWORD": "env-pw", "KVREDIS_TLS_CA_FILE": certs.ca})
    url, options = config.connection_options()
    assert url == "rediss://127.0.0.1:6380/2"
    assert options == {"username": "alice", "password": "env-pw", "ssl_ca_certs": certs.ca,
                       "ssl_cert_reqs": "optional"}
    unix = KVRedisConfig.from_env({"KVREDIS_URL": "unix://bob:pw@/run/redis.sock?db=3"})
    assert unix.connection_options() == ("unix:///run/redis.sock",
                                         {"db": 3, "username": "bob", "password": "pw"})


def test_unix_socket_url_with_credentials(redis_server, namespace):
    directory = tempfile.mkdtemp(prefix="kvr-")  # short: socket paths are limited to ~100 bytes
    path = os.path.join(directory, "redis.sock")
    try:
        server = redis_server("--unixsocket", path, "--unixsocketperm", "700")
        admin = server.client()
        set_user(admin, "kv", "pw-u", acl_rules(namespace))
        admin.close()
        with buffer_for(f"unix://kv:pw-u@{path}?db=0", namespace) as buffer:
            round_trips(buffer)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# --- ACL ----------------------------------------------------------------------------------------------


@pytest.fixture
def acl_server(redis_server: Callable[..., RedisServer]) -> Iterator[tuple[RedisServer, Any]]:
    server = redis_server()
    admin = server.client()
    yield server, admin
    admin.close()


def set_user(admin: Any, name: str, password: str, rules: list[str]) -> None:
    admin.execute_command("ACL", "SETUSER", name, "reset", "on", f">{password}", *rules)


def test_the_minimal_acl_rule_runs_the_whole_buffer(acl_server, namespace):
    server, admin = acl_server
    set_user(admin, "kv", "pw-1", acl_rules(namespace))
    url = f"redis://kv:pw-1@127.0.0.1:{server.port}/0"
    with buffer_for(url, namespace, chunk_bytes=4096, inflight_bytes=4096, write_batch_bytes=4096) as buffer:
        round_trips(buffer)
        # The clean-up paths too: a partial entry's remaining pieces and a foreign value are deleted.
        tokens, key, value, hidden = kv_entry(200, seed=1)
        buffer.insert(tokens, None, key, value, hidden)
        pieces = sorted(k for k in admin.scan_iter(match=f"{namespace}:*") if not k.endswith(b":q"))
        admin.delete(pieces[0])
        assert buffer.drop_select(tokens, None) == MISS
        assert buffer.metrics["miss_partial"] == 1
        admin.set(buffer.keyspace.entry(tokens).queue, b"planted")
        assert buffer.drop_select(tokens, None) == MISS
        assert buffer.metrics["dropped_foreign"] == 1
        assert list(admin.scan_iter(match=f"{namespace}:*")) == []


def test_stats_and_purge_need_only_the_documented_extra_commands(acl_server, namespace):
    server, admin = acl_server
    stats_rule = ("scan", "type", "pttl", "memory|usage", "info")
    set_user(admin, "ops", "pw-ops", acl_rules(namespace, BUFFER_COMMANDS + stats_rule))
    url = f"redis://ops:pw-ops@127.0.0.1:{server.port}/0"
    with buffer_for(url, namespace) as buffer:
        entry = kv_entry(200)
        buffer.insert(entry[0], None, *entry[1:])
        summary = buffer.store.summary(f"{namespace}:*")
        assert summary["entries"] == 1 and summary["pieces"] > 1 and summary["keys_without_ttl"] == 0
        assert buffer.store.delete(list(buffer.store.scan(f"{namespace}:*"))) == summary["keys"]
    set_user(admin, "ops", "pw-ops", acl_rules(namespace))
    with buffer_for(url, namespace) as buffer, pytest.raises(KVRedisError, match="NOPERM"):
        buffer.store.summary(f"{namespace}:*")


def test_credentials_from_kvredis_variables(acl_server, namespace):
    server, admin = acl_server
    set_user(admin, "kv", "pw-2", acl_rules(namespace))
    env = {"KVREDIS_USERNAME": "kv", "KVREDIS_PASSWORD": "pw-2"}
    with buffer_for(server.url, namespace, env) as buffer:
        round_trips(buffer)
    # The variables win over the URL's user and password (redis-py alone would let the URL win).
    url = f"redis://someone:wrong@127.0.0.1:{server.port}/0"
    with buffer_for(url, namespace, env) as buffer:
        round_trips(buffer)


def _setup_entry(url: str, namespace: str, chunked: bool) -> tuple[torch.Tensor, ...]:
    entry = kv_entry(200 if chunked else 8, seed=9)
    with buffer_for(url, namespace, chunk_bytes=4096) as full:
        full.insert(entry[0], None, *entry[1:])
    return entry


@pytest.mark.parametrize("missing", BUFFER_COMMANDS)
def test_a_user_lacking_any_command_of_the_rule_fails_clearly(acl_server, namespace, missing):
    server, admin = acl_server
    rule = tuple(name for name in BUFFER_COMMANDS if name != missing)
    set_user(admin, "kv", "pw-3", acl_rules(namespace, rule))
    url = f"redis://kv:pw-3@127.0.0.1:{server.port}/0"
    tokens, key, value, hidden = kv_entry(8, seed=2)
    with buffer_for(url, namespace, chunk_bytes=4096) as buffer:
        if missing in ("rpush", "pexpire", "multi", "exec"):
            call = lambda: buffer.insert(tokens, None, key, value, hidden)  # noqa: E731
        elif missing == "set":
            big = kv_entry(200, seed=2)
            call = lambda: buffer.insert(big[0], None, *big[1:])  # noqa: E731
        elif missing == "blpop":
            call = lambda: buffer.drop_select(tokens, None)  # noqa: E731
        elif missing == "getdel":
            big = _setup_entry(server.url, namespace, chunked=True)
            call = lambda: buffer.drop_select(big[0], None)  # noqa: E731
        elif missing == "llen":
            call = lambda: buffer.contains(tokens)  # noqa: E731
        else:  # del: needed to clear a foreign value planted at an entry list's key
            admin.set(buffer.keyspace.entry(tokens).queue, b"planted")
            call = lambda: buffer.drop_select(tokens, None)  # noqa: E731
        with pytest.raises(KVRedisError, match="NOPERM") as info:
            call()
        assert not isinstance(info.value, KVRedisConnectionError)


CHUNK_COMMANDS = ("exists", "evalsha", "script|load", "set", "sadd", "srem", "scard", "pexpire", "get", "del",
                  "getrange", "getex", "rpush", "multi", "exec", "blpop", "hincrby", "incr")
"""The commands the vLLM connector's chunk store sends, its scripts' included (ACL checks those too);
docs/deployment.md's rule for connector users lists exactly these."""


def transfer_round_trip(url: str, namespace: str, admin: Any) -> None:
    """A transfer saved, taken and released; another saved and discarded; a small one (in its record) saved
    and taken: nothing left. Then in reuse mode a prompt saved, taken and left for any reader."""
    # Pieces of 4 KiB, 4 KiB in flight: chunks of 16 KiB are read in pieces (GETRANGE), chunks of 1 KiB with
    # one GET.
    config = KVRedisConfig.from_env({}, {"url": url, "namespace": namespace, "pop_timeout_s": 1.0,
                                         "socket_timeout_s": 2.0, "chunk_bytes": 4096,
                                         "inflight_bytes": 4096})
    store = RedisStore(config)
    try:
        transfers = Transfers(store, f"{namespace}:0123456789abcdef", chunk_tokens=16, block_size=16,
                              ttl_ms=60_000, pop_timeout_s=1.0, max_chunk_bytes=1 << 20)
        plan = transfers.plan(list(range(40)))
        for page_shape in ((2, 16, 4), (2, 16, 64)):
            page_format = PageFormat(torch.float32, 2, page_shape)
            pages = torch.randn(2, 3, *page_shape)
            transfers.save(plan, pages, transfer_id=(first := new_entry_id()))
            assert transfers.chunks.stored_prefix(plan.digests) == 3
            taken = transfers.take(plan, 0, 39, page_format, transfer_id=first)
            assert taken.cause == "hit" and torch.equal(torch.cat(taken.chunks, dim=1), pages)
            transfers.save(plan, pages, transfer_id=(second := new_entry_id()))
            assert transfers.discard(second)
        small = transfers.plan(list(range(10)))
        transfers.save(small, torch.ones(2, 1, 2, 16, 4), transfer_id=(third := new_entry_id()))
        page_format = PageFormat(torch.float32, 2, (2, 16, 4))
        assert transfers.take(small, 0, 9, page_format, transfer_id=third).cause == "hit"
        assert list(admin.scan_iter(match=f"{namespace}:*")) == []
        shared = Transfers(store, f"{namespace}:0123456789abcdef", chunk_tokens=16, block_size=16,
                           ttl_ms=60_000, pop_timeout_s=1.0, max_chunk_bytes=1 << 20, reuse=True)
        pages = torch.randn(2, 3, 2, 16, 4)  # chunks of 1 KiB: each read with one GETEX
        shared.save(plan, pages, transfer_id=(fourth := new_entry_id()))
        taken = shared.take(plan, 20, 39, page_format, transfer_id=fourth)
        assert taken.cause == "hit" and torch.equal(torch.cat(taken.chunks, dim=1), pages[:, 1:])
        assert shared.save(plan, pages).present == 3
        tally = Tally(store, namespace)  # what a scheduler adds to kvredis stats' hit rate
        tally.add(lookup_tokens=39, found_tokens=32)
        tally.send()
        assert admin.hgetall(tally_key(namespace)) == {b"lookup_tokens": b"39", b"found_tokens": b"32"}
        admin.delete(tally_key(namespace))
        generation = Generation(store, namespace)  # what a scheduler reads with each lookup, and a reset
        assert generation.read() == 0 and generation.bump() == 1 and generation.read() == 1
        admin.delete(generation_key(namespace))
        left = list(admin.scan_iter(match=f"{namespace}:*"))
        assert len(left) == 3  # the chunks, for any reader
        admin.delete(*left)
    finally:
        store.close()


def test_the_connector_rule_runs_every_transfer(acl_server, namespace):
    server, admin = acl_server
    set_user(admin, "kv", "pw-c", acl_rules(namespace, CHUNK_COMMANDS))
    admin.script_flush()  # the first call loads its scripts itself
    transfer_round_trip(f"redis://kv:pw-c@127.0.0.1:{server.port}/0", namespace, admin)


@pytest.mark.parametrize("missing", CHUNK_COMMANDS)
def test_a_connector_user_lacking_any_command_fails_clearly(acl_server, namespace, missing):
    server, admin = acl_server
    set_user(admin, "kv", "pw-d", acl_rules(namespace, tuple(c for c in CHUNK_COMMANDS if c != missing)))
    admin.script_flush()
    with pytest.raises(KVRedisError, match="NOPERM") as info:
        transfer_round_trip(f"redis://kv:pw-d@127.0.0.1:{server.port}/0", namespace, admin)
    assert not isinstance(info.value, KVRedisConnectionError)


def test_a_user_limited_to_one_namespace_cannot_touch_another(acl_server, namespace):
    server, admin = acl_server
    set_user(admin, "tenant-a", "pw-a", acl_rules("tenant-a"))
    url = f"redis://tenant-a:pw-a@127.0.0.1:{server.port}/0"
    with buffer_for(url, "tenant-a") as mine:
        round_trips(mine)
    tokens, key, value, hidden = kv_entry(8)
    with buffer_for(url, "tenant-b") as theirs:
        with pytest.raises(KVRedisError, match="NOPERM"):
            theirs.insert(tokens, None, key, value, hidden)
        with pytest.raises(KVRedisError, match="NOPERM"):
            theirs.drop_select(tokens, None)


@pytest.mark.parametrize("where", ["url", "variables"])
def test_wrong_credentials_fail_clearly_within_the_connect_timeout(acl_server, namespace, where):
    server, admin = acl_server
    set_user(admin, "kv", "right-password", acl_rules(namespace))
    if where == "url":
        buffer = buffer_for(f"redis://kv:wrong-password@127.0.0.1:{server.port}/0", namespace)
    else:
        buffer = buffer_for(server.url, namespace,
                            {"KVREDIS_USERNAME": "kv", "KVREDIS_PASSWORD": "wrong-password"})
    tokens, key, value, hidden = kv_entry(8)
    with buffer:
        for call in (lambda: buffer.insert(tokens, None, key, value, hidden),
                     lambda: buffer.drop_select(tokens, None), lambda: buffer.contains(tokens)):
            started = time.monotonic()
            with pytest.raises(KVRedisConnectionError, match="authentication failed") as info:
                call()
            assert time.monotonic() - started < buffer.config.connect_timeout_s
            assert "wrong-password" not in str(info.value)


# --- secrets ------------------------------------------------------------------------------------------

SECRET = "Zq9-not-in-any-message"


def _every_text(exc: BaseException) -> str:
    """The exception, everything chained to it, and its formatted traceback."""
    texts = ["".join(traceback.format_exception(exc))]
    seen: BaseException | None = exc
    while seen is not None:
        texts += [str(seen), repr(seen)]
        seen = seen.__cause__ or seen.__context__
    return "\n".join(texts)


def _silent_server() -> socket.socket:
    """A TCP port that accepts connections and never answers (a stalled Redis)."""
    return socket.create_server(("127.0.0.1", 0))


@pytest.mark.parametrize("where", ["url", "variable"])
def test_passwords_never_appear_in_errors_logs_config_or_metrics(acl_server, namespace, caplog, where):
    caplog.set_level(logging.DEBUG)
    server, admin = acl_server
    set_user(admin, "kv", SECRET, acl_rules(namespace, ("llen",)))  # right password, few commands
    silent = _silent_server()
    tokens, key, value, hidden = kv_entry(8)
    ports = {"refused": free_port(), "silent": silent.getsockname()[1], "nopermission": server.port}
    texts = []
    try:
        for case, port in ports.items():
            for password in (SECRET, SECRET + "-wrong"):
                if where == "url":
                    url, env = f"redis://kv:{password}@127.0.0.1:{port}/0", {}
                else:
                    url, env = f"redis://127.0.0.1:{port}/0", {"KVREDIS_USERNAME": "kv",
                                                              "KVREDIS_PASSWORD": password}
                buffer = buffer_for(url, namespace, env, socket_timeout_s=0.2, pop_timeout_s=0.1)
                with buffer:
                    with pytest.raises(KVRedisError) as info:
                        buffer.insert(tokens, None, key, value, hidden)
                    texts.append(_every_text(info.value))
                    with pytest.raises(KVRedisError) as info:
                        buffer.drop_select(tokens, None)
                    texts.append(_every_text(info.value))
                    if case == "silent":
                        assert isinstance(info.value, KVRedisTimeoutError)
                    texts += [repr(buffer.config), str(buffer.config), repr(buffer.config.describe()),
                              buffer.config.masked_url, repr(buffer.metrics.counts), repr(buffer.store.redis)]
    finally:
        silent.close()
    import prometheus_client

    exposition = prometheus_client.generate_latest().decode()
    assert "authentication failed" in "\n".join(texts) and "NOPERM" in "\n".join(texts)
    everything = "\n".join(texts) + caplog.text + exposition
    assert SECRET not in everything
    assert caplog.records, "nothing was logged: the check above proves nothing"


# --- tenants ------------------------------------------------------------------------------------------


def test_two_namespaces_never_see_each_others_entries(real_redis_url, namespace):
    tokens, key, value, hidden = kv_entry(32)
    other_key = key.flip(0)
    with buffer_for(real_redis_url, namespace + "-a", chunk_bytes=1 << 20) as tenant_a, \
            buffer_for(real_redis_url, namespace + "-b", chunk_bytes=1 << 20) as tenant_b:
        tenant_a.insert(tokens, None, key, value, hidden)
        assert tenant_a.contains(tokens) and not tenant_b.contains(tokens)
        assert tenant_b.drop_select(tokens, None) == MISS
        tenant_b.insert(tokens, None, other_key, value, hidden)
        assert_entry(tenant_b.drop_select(tokens, None), tokens, other_key, value, hidden)
        assert_entry(tenant_a.drop_select(tokens, None), tokens, key, value, hidden)
        # A record copied from one tenant's list into the other's is refused there.
        tenant_a.insert(tokens, None, key, value, hidden)
        record = tenant_a.store.redis.lpop(tenant_a.keyspace.entry(tokens).queue)
        tenant_b.store.redis.rpush(tenant_b.keyspace.entry(tokens).queue, record)
        assert tenant_b.drop_select(tokens, None) == MISS
        assert tenant_b.metrics["dropped_foreign"] == 1
        assert namespace_keys(tenant_a) == namespace_keys(tenant_b) == []


# --- hostile data planted in the namespace ------------------------------------------------------------


class _Boom:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("echo pwned > /tmp/kvredis-pwned",))


@pytest.fixture
def no_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any unpickling fail the test loudly."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("kvredis unpickled data read from Redis")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)


def _plant_then_insert(buffer: RedisLookupBuffer, planted: bytes, entry: tuple[torch.Tensor, ...]) -> str:
    queue = buffer.keyspace.entry(entry[0]).queue
    buffer.store.redis.rpush(queue, planted)
    buffer.insert(entry[0], None, *entry[1:])
    return queue


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("kvredis")]


def _other_version(blob: bytes) -> bytes:
    return blob[:3] + bytes([blob[3] + 1]) + blob[4:]


def _flipped_payload(blob: bytes) -> bytes:
    flipped = bytearray(blob)
    flipped[-70] ^= 0x01  # inside the key tensor's bytes: header intact, payload CRC wrong
    return bytes(flipped)


@pytest.mark.parametrize("kind, cause", [
    ("random", "foreign"),
    ("pickle", "foreign"),
    ("other_version", "foreign"),
    ("other_identity", "foreign"),
    ("other_tokens", "foreign"),
    ("flipped_payload", "corrupt"),
    ("truncated", "corrupt"),
])
def test_a_planted_record_is_rejected_logged_counted_and_the_next_entry_returned(
        make_buffer, caplog, no_pickle, kind, cause):
    caplog.set_level(logging.DEBUG, logger="kvredis")
    buffer = make_buffer(pop_timeout_s=0.2)
    entry = kv_entry(16)
    tokens = entry[0]
    if kind == "random":
        planted = os.urandom(512)
    elif kind == "pickle":
        planted = pickle.dumps(_Boom())
    elif kind in ("other_identity", "other_tokens"):
        other_tokens = tokens if kind == "other_identity" else tokens + 1
        identity = CacheIdentity(model="some-other-model") if kind == "other_identity" else CacheIdentity()
        other = RedisLookupBuffer(buffer.config, buffer.store.redis, identity=identity)
        other.insert(other_tokens, None, *entry[1:])
        planted = buffer.store.redis.lpop(other.keyspace.entry(other_tokens).queue)
    else:
        blob = codec.encode([tokens, torch.ones(16, dtype=torch.bool), *entry[1:]],
                            {"id": "0" * 16, "space": buffer.keyspace.prefix}).to_bytes()
        planted = {"other_version": _other_version, "flipped_payload": _flipped_payload,
                   "truncated": lambda b: b[:-100]}[kind](blob)
    queue = _plant_then_insert(buffer, planted, entry)
    assert_entry(buffer.drop_select(tokens, None), *entry)
    assert buffer.metrics[f"dropped_{cause}"] == 1 and buffer.metrics["dropped"] == 1
    assert buffer.metrics["loaded"] == 1 and buffer.metrics["misses"] == 0
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and queue in warnings[0]
    # Alone in the list, it is a miss counted by the same cause.
    buffer.store.redis.rpush(queue, planted)
    assert buffer.drop_select(tokens, None) == MISS
    assert buffer.metrics[f"miss_{cause}"] == 1
    assert not os.path.exists("/tmp/kvredis-pwned")


def test_a_foreign_value_at_an_entry_list_key_is_deleted_and_counted(make_buffer, caplog):
    caplog.set_level(logging.WARNING, logger="kvredis")
    buffer = make_buffer(pop_timeout_s=0.2)
    tokens, key, value, hidden = kv_entry(16)
    queue = buffer.keyspace.entry(tokens).queue
    buffer.store.redis.set(queue, b"a string where a list belongs")
    assert not buffer.contains(tokens)
    assert buffer.drop_select(tokens, None) == MISS
    assert buffer.metrics["dropped_foreign"] == 1 and buffer.metrics["miss_foreign"] == 1
    assert any(queue in message and "foreign" in message for message in _warnings(caplog))
    buffer.insert(tokens, None, key, value, hidden)  # writers work again
    assert_entry(buffer.drop_select(tokens, None), tokens, key, value, hidden)


@pytest.mark.parametrize("piece", [b"short", "list"])
def test_a_planted_piece_is_rejected_as_corrupt(make_buffer, caplog, piece):
    caplog.set_level(logging.WARNING, logger="kvredis")
    buffer = make_buffer(chunk_bytes=4096, pop_timeout_s=0.2)
    tokens, key, value, hidden = kv_entry(64)
    buffer.insert(tokens, None, key, value, hidden)
    pieces = sorted(name for name in namespace_keys(buffer) if not name.endswith(":q"))
    buffer.store.redis.delete(pieces[1])
    if piece == "list":
        buffer.store.redis.rpush(pieces[1], b"x")
    else:
        buffer.store.redis.set(pieces[1], piece)
    assert buffer.drop_select(tokens, None) == MISS
    assert buffer.metrics["dropped_corrupt"] == 1 and buffer.metrics["miss_corrupt"] == 1
    assert namespace_keys(buffer) == []
    assert len(_warnings(caplog)) == 1


@pytest.mark.parametrize("layout", [
    {"id": "0" * 16, "chunk": 1, "pieces": None},  # a million one-byte pieces: refused before naming them
    {"id": "../../x*", "chunk": 4096, "pieces": None},  # an id that is not one kvredis writes
    {"id": "0" * 16, "chunk": 4096, "pieces": 3},  # a count that does not fit the payload
])
def test_a_planted_record_with_a_hostile_piece_layout_is_refused_cheaply(make_buffer, layout):
    buffer = make_buffer(pop_timeout_s=0.2)
    tokens = torch.arange(16)
    key = torch.zeros(1 << 20, dtype=torch.uint8)
    tensors = [tokens, torch.ones(16, dtype=torch.bool), key, None, None]
    total = codec.payload_size(tensors)
    meta = {**layout, "space": buffer.keyspace.prefix}
    if meta["pieces"] is None:
        meta["pieces"] = -(-total // meta["chunk"])
    header = codec.encode(tensors, meta).header
    buffer.store.redis.rpush(buffer.keyspace.entry(tokens).queue, header)
    started = time.monotonic()
    assert buffer.drop_select(tokens, None) == MISS
    assert time.monotonic() - started < 1.0
    assert buffer.metrics["dropped_corrupt"] == 1


def test_foreign_keys_elsewhere_in_the_namespace_are_left_alone(make_buffer):
    buffer = make_buffer()
    namespace = buffer.config.namespace
    redis_client = buffer.store.redis
    redis_client.set(f"{namespace}:junk", os.urandom(64))
    redis_client.hset(f"{namespace}:{buffer.keyspace.identity.digest()}:h", "f", "v")
    tokens, key, value, hidden = kv_entry(16)
    buffer.insert(tokens, None, key, value, hidden)
    assert_entry(buffer.drop_select(tokens, None), tokens, key, value, hidden)
    assert sorted(namespace_keys(buffer)) == sorted(
        [f"{namespace}:junk", f"{namespace}:{buffer.keyspace.identity.digest()}:h"])
