"""Every kvredis setting, read from ``KVREDIS_*`` environment variables and an optional override mapping.

The mapping is vLLM's ``kv_connector_extra_config``: the same names in lower case without the prefix
(``{"url": ..., "ttl_s": ...}``). Each setting is declared once in :data:`SETTINGS`, with its variable,
default and meaning; README's table is checked against that list by the tests.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from kvredis.errors import ConfigError

ENV_PREFIX = "KVREDIS_"
URL_SCHEMES = (
    "redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel",
)
_TLS_SCHEMES = ("rediss", "rediss+cluster", "rediss+sentinel")
_DEFAULT_PORTS = {"cluster": 6379, "sentinel": 26379}
_SERVICE_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMG]i?B?|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


_CERT_REQS = ("none", "optional", "required")
URL_QUERY_OPTIONS = (
    "db", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname",
)
"""The query parameters a URL may carry (redis-py's names); the ``ssl_*`` ones only with ``rediss``
schemes.

Anything else (``socket_timeout``, ``retry_on_timeout``, ``password``...) is refused: redis-py would let it
override kvredis's own bounds and no-retry rule, or carry a secret where it would be printed."""
SENTINEL_QUERY_OPTIONS = ("sentinel_username", "sentinel_password")
"""Extra query parameters of ``redis+sentinel://`` URLs: the credentials of the sentinels themselves (the
URL's user and password, and ``KVREDIS_USERNAME``/``KVREDIS_PASSWORD``, are the Redis primary's)."""


@dataclass(frozen=True)
class Topology:
    """Which kind of Redis a URL names, and where to find it.

    ``single``: one server (``redis://``, ``rediss://``, ``unix://``; ``nodes`` is empty, redis-py reads the
    URL). ``cluster``: Redis Cluster, ``nodes`` are the startup nodes. ``sentinel``: the primary of
    ``service`` as the sentinels at ``nodes`` report it, database ``db``.
    """

    kind: str
    nodes: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    db: int = 0
    tls: bool = False


def _kind(scheme: str) -> str:
    return scheme.partition("+")[2] or "single"


def _hosts(netloc: str, default_port: int) -> tuple[tuple[str, int], ...]:
    """``host:port,host:port`` (IPv6 hosts in brackets) after any ``user:password@``."""
    listed = netloc.rpartition("@")[2]
    if not listed:
        raise ValueError("no host: list the nodes as host:port,host:port")
    nodes = []
    for item in listed.split(","):
        if item.startswith("["):
            host, bracket, rest = item[1:].partition("]")
            if not bracket or (rest and not rest.startswith(":")):
                raise ValueError(f"malformed host {item!r}")
            port_text = rest[1:]
        else:
            host, _, port_text = item.partition(":")
            if ":" in port_text:
                raise ValueError(f"malformed host {item!r} (an IPv6 address needs brackets: [::1]:6379)")
        if not host:
            raise ValueError(f"empty host in {listed!r}")
        if port_text == "":
            port = default_port
        elif port_text.isdigit() and 0 < int(port_text) < 65536:
            port = int(port_text)
        else:
            raise ValueError(f"the port of {item!r} is not a number between 1 and 65535")
        nodes.append((host, port))
    return tuple(nodes)


def _topology(url: str) -> Topology:
    """The URL's kind and nodes; raises ValueError naming what is malformed."""
    parts = urlsplit(url)
    kind = _kind(parts.scheme)
    query = _url_query(url)
    tls = parts.scheme in _TLS_SCHEMES
    if kind == "single":
        return Topology("single", tls=tls)
    nodes = _hosts(parts.netloc, _DEFAULT_PORTS[kind])
    path = [unquote(segment) for segment in parts.path.split("/") if segment]
    if kind == "cluster":
        if path not in ([], ["0"]) or query.get("db", 0) != 0:
            raise ValueError("Redis Cluster has only database 0: use redis+cluster://host:port,host:port[/0]")
        return Topology("cluster", nodes, tls=tls)
    if not path or len(path) > 2:
        raise ValueError("name the service: redis+sentinel://host:26379,host:26379/SERVICE[/db]")
    if not _SERVICE_RE.fullmatch(path[0]):
        raise ValueError(f"malformed service name {path[0]!r}")
    if len(path) == 2 and not path[1].isdigit():
        raise ValueError(f"the database after the service must be a number, not {path[1]!r}")
    db = int(query.get("db", path[1] if len(path) == 2 else 0))
    return Topology("sentinel", nodes, service=path[0], db=db, tls=tls)


def _parse_url(value: Any) -> str:
    url = str(value).strip()
    parts = urlsplit(url)
    scheme = parts.scheme
    if scheme not in URL_SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; use one of {', '.join(s + '://' for s in URL_SCHEMES)}")
    if _kind(scheme) != "single":
        _topology(url)
        return url
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError:
        raise ValueError("the port is not a number between 0 and 65535") from None
    if scheme != "unix":
        db = unquote(parts.path).strip("/")
        if db and not db.isdigit():
            raise ValueError(f"the path must be a database number, not {db!r}")
    _url_query(url)
    return url


def _url_query(url: str) -> dict[str, Any]:
    """The URL's query parameters, validated and converted to what redis-py takes."""
    parts = urlsplit(url)
    options: dict[str, Any] = {}
    sentinel = _kind(parts.scheme) == "sentinel"
    accepted = URL_QUERY_OPTIONS + (SENTINEL_QUERY_OPTIONS if sentinel else ())
    for name, raw in parse_qsl(parts.query, keep_blank_values=True):
        if name not in accepted:
            raise ValueError(
                f"unknown URL parameter {name!r}; kvredis accepts {', '.join(accepted)} "
                "(timeouts, credentials and TLS files have KVREDIS_* variables)"
            )
        if name.startswith("ssl_") and parts.scheme not in _TLS_SCHEMES:
            raise ValueError(f"URL parameter {name!r} needs a rediss:// URL (or rediss+cluster://, "
                             "rediss+sentinel://)")
        if name in SENTINEL_QUERY_OPTIONS:
            options[name] = raw
        elif name == "db":
            if not raw.isdigit():
                raise ValueError(f"URL parameter 'db' must be a database number, not {raw!r}")
            options[name] = int(raw)
        elif name == "ssl_cert_reqs":
            if raw.lower() not in _CERT_REQS:
                raise ValueError(f"URL parameter 'ssl_cert_reqs' must be one of {', '.join(_CERT_REQS)}")
            options[name] = raw.lower()
        elif name == "ssl_check_hostname":
            try:
                options[name] = _bool(raw)
            except ValueError:
                raise ValueError("URL parameter 'ssl_check_hostname' must be true or false") from None
        else:  # a file
            if not os.path.isfile(raw):
                raise ValueError(f"URL parameter {name!r}: no such file {raw!r}")
            options[name] = raw
    return options


def _parse_namespace(value: Any) -> str:
    text = str(value)
    if not _NAMESPACE_RE.fullmatch(text):
        # Colons, braces and globs would break key parsing, cluster hash tags and ACL key patterns.
        raise ValueError("must be 1-64 characters of letters, digits, '_', '.' or '-'")
    return text


def _positive_float(value: Any) -> float:
    number = float(value)
    if not number > 0 or number == float("inf"):
        raise ValueError("must be a positive, finite number")
    return number


def _size(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("must be a size in bytes")
    if isinstance(value, int):
        number = value
    else:
        match = _SIZE_RE.match(str(value))
        if not match:
            raise ValueError("must be a size in bytes, optionally with a KiB/MiB/GiB suffix")
        unit = (match.group(2) or "").upper()[:1] or ""
        number = int(match.group(1)) * _SIZE_UNITS[unit]
    if number <= 0:
        raise ValueError("must be a positive size")
    return number


def _chunk_size(value: Any) -> int:
    number = _size(value)
    # Redis refuses single values past 512 MB (proto-max-bulk-len); tiny pieces waste round trips.
    if not 4096 <= number <= 256 << 20:
        raise ValueError("must be between 4 KiB and 256 MiB")
    return number


def _chunk_tokens(value: Any) -> int:
    if isinstance(value, bool) or not str(value).strip().isdigit():
        raise ValueError("must be a whole number of tokens")
    number = int(str(value).strip())
    if not 16 <= number <= 65536:
        raise ValueError("must be between 16 and 65536 tokens")
    return number


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError("must be one of true/false, 1/0, yes/no, on/off")


def _optional_str(value: Any) -> str | None:
    text = "" if value is None else str(value)
    return text or None


def _optional_file(value: Any) -> str | None:
    path = _optional_str(value)
    if path is not None and not os.path.isfile(path):
        raise ValueError("no such file")
    return path


@dataclass(frozen=True)
class Setting:
    """One configurable value: its field name, parser, default and one-line meaning."""

    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    secret: bool = False

    @property
    def env(self) -> str:
        """The environment variable that sets it."""
        return ENV_PREFIX + self.name.upper()


SETTINGS: tuple[Setting, ...] = (
    Setting("url", _parse_url, "redis://localhost:6379/0",
            "Redis to use: `redis://[user:pass@]host:port/db`, `rediss://` for TLS, `unix:///path.sock`; "
            "Redis Cluster `redis+cluster://host:port,host:port`; Sentinel "
            "`redis+sentinel://host:port,host:port/SERVICE[/db]` (`rediss+...` for TLS)."),
    Setting("namespace", _parse_namespace, "kvredis",
            "Key prefix; tenants sharing one Redis use different namespaces."),
    Setting("ttl_s", _positive_float, 300.0,
            "Seconds an entry lives in Redis if no one takes it."),
    Setting("pop_timeout_s", _positive_float, 5.0,
            "Longest a reader waits for an entry that is not there yet (blocking pop)."),
    Setting("chunk_bytes", _chunk_size, 1 << 20,
            "Large values move in pieces of this size (4 KiB-256 MiB; `1MiB` works): chunks are read in "
            "ranges of it, and a lookup buffer entry larger than it is stored as pieces of 16 bytes less "
            "(which Redis holds without rounding up to its next size class)."),
    Setting("chunk_tokens", _chunk_tokens, 64,
            "Prompt positions a stored KV chunk covers (rounded up to whole KV blocks): a decode reads and a "
            "prefill writes whole chunks, and prompts share the chunks of a common prefix."),
    Setting("inflight_bytes", _size, 4 << 20,
            "Bytes of pieces a reader keeps requested ahead (deeper read pipelines slow down)."),
    Setting("pinned_bytes", _size, 256 << 20,
            "Pinned host memory a GPU engine's loads receive chunks into: allocated at the first load and "
            "kept, one slot a load thread (a larger load gets pinned memory of its own)."),
    Setting("write_batch_bytes", _size, 16 << 20,
            "Bytes of pieces a writer sends per pipelined round trip."),
    Setting("max_entry_bytes", _size, 8 << 30,
            "Largest entry accepted on write or read; a header claiming more is refused before allocating."),
    Setting("connect_timeout_s", _positive_float, 2.0,
            "Bound on opening a connection to Redis."),
    Setting("socket_timeout_s", _positive_float, 10.0,
            "Bound on any single Redis reply (added to the pop timeout for blocking pops)."),
    Setting("lookup_timeout_s", _positive_float, 0.5,
            "Bound on the existence check vLLM's scheduler makes per new request (it must not stall)."),
    Setting("checksum", _bool, True,
            "Write and verify an XXH3-64 checksum of every payload (costs ~0.1 ms per MiB a side)."),
    Setting("username", _optional_str, None,
            "ACL user name (overrides the one in the URL)."),
    Setting("password", _optional_str, None,
            "Password (overrides the one in the URL); never printed.", secret=True),
    Setting("tls_ca_file", _optional_file, None,
            "CA bundle to verify the server with `rediss://`."),
    Setting("tls_cert_file", _optional_file, None,
            "Client certificate for mutual TLS."),
    Setting("tls_key_file", _optional_file, None,
            "Private key of the client certificate."),
    Setting("reuse", _bool, False,
            "Keep stored KV chunks for any later request with that prefix, on any engine (a shared prefix "
            "cache): nothing is deleted when a decode reads it; a chunk's TTL restarts on each use and "
            "Redis's eviction takes the least used. Off: chunks live only while a transfer needs them."),
    Setting("store_all_prompts", _bool, False,
            "vLLM producers store every prompt they prefill, for any decode of the same prompt (the seed's "
            "behaviour), not only those the proxy sends on to a decode."),
)
_BY_NAME = {setting.name: setting for setting in SETTINGS}


_SECRET_QUERY = re.compile(r"(?i)pass|secret|token|key(?!file)")


def _mask_url(url: str) -> str:
    try:
        parts = urlsplit(url)
    except ValueError:  # unparseable (a stray IPv6 bracket): hide whatever could be a secret
        scheme, sep, rest = url.partition("://")
        rest = rest.partition("?")[0] + ("?***" if "?" in rest else "")
        userinfo, at, hosts = rest.rpartition("@")
        if at:
            rest = f"{userinfo.partition(':')[0]}:***@{hosts}"
        return f"{scheme}{sep}{rest}"
    if parts.query:
        # A refused URL is quoted in its ConfigError: a ?password=... there must not be printed either.
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        if any(_SECRET_QUERY.search(name) for name, _ in pairs):
            masked = [(name, "***" if _SECRET_QUERY.search(name) else value) for name, value in pairs]
            parts = parts._replace(query=urlencode(masked, safe="*/"))
            url = urlunsplit(parts)
    if parts.password is None:
        return url
    user = parts.username or ""
    # Keep the host exactly as written (IPv6 brackets, case): only the password is replaced.
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


@dataclass(frozen=True)
class KVRedisConfig:
    """The effective kvredis settings; build it with :meth:`from_env`."""

    url: str = "redis://localhost:6379/0"
    namespace: str = "kvredis"
    ttl_s: float = 300.0
    pop_timeout_s: float = 5.0
    chunk_bytes: int = 1 << 20
    chunk_tokens: int = 64
    inflight_bytes: int = 4 << 20
    pinned_bytes: int = 256 << 20
    write_batch_bytes: int = 16 << 20
    max_entry_bytes: int = 8 << 30
    connect_timeout_s: float = 2.0
    socket_timeout_s: float = 10.0
    lookup_timeout_s: float = 0.5
    checksum: bool = True
    username: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    reuse: bool = False
    store_all_prompts: bool = False

    def __post_init__(self) -> None:
        for setting in SETTINGS:
            value = getattr(self, setting.name)
            if value is None or value == setting.default:
                continue
            try:
                object.__setattr__(self, setting.name, setting.parse(value))
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{setting.env}={_shown(setting, value)}: {exc}") from None

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
    ) -> KVRedisConfig:
        """Read ``KVREDIS_*`` variables from ``env`` (default ``os.environ``), then apply ``overrides``."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for setting in SETTINGS:
            if setting.env in env:
                values[setting.name] = _parse(setting, env[setting.env], setting.env)
        for key, raw in (overrides or {}).items():
            found = _BY_NAME.get(str(key).lower())
            if found is None:
                known = ", ".join(sorted(_BY_NAME))
                raise ConfigError(f"unknown kvredis setting {key!r} in overrides; known: {known}")
            values[found.name] = _parse(found, raw, f"{key} (override)")
        return cls(**values)

    def replace(self, **changes: Any) -> KVRedisConfig:
        """A copy with some settings changed (validated like the originals)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> dict[str, str]:
        """Every setting as text keyed by its variable, secrets and URL passwords masked."""
        shown = {}
        for setting in SETTINGS:
            value = getattr(self, setting.name)
            shown[setting.env] = _shown(setting, value)
        return shown

    def connection_options(self) -> tuple[str, dict[str, Any]]:
        """The URL without credentials or query, and the redis-py options the rest of the settings give.

        ``KVREDIS_USERNAME``/``KVREDIS_PASSWORD`` win over the URL's user and password, and the
        ``KVREDIS_TLS_*`` files over the URL's ``ssl_*`` parameters (redis-py alone would let the URL win).
        For a cluster or sentinel URL the credentials are the data nodes'; the options may also hold ``db``
        and ``sentinel_username``/``sentinel_password`` (see :meth:`topology` for the nodes).
        """
        parts = urlsplit(self.url)
        try:
            options = _url_query(self.url)
        except ValueError as exc:  # checked when the config was made; a file may have gone since
            raise ConfigError(f"KVREDIS_URL={self.masked_url}: {exc}") from None
        if parts.username:
            options["username"] = unquote(parts.username)
        if parts.password:
            options["password"] = unquote(parts.password)
        if self.username is not None:
            options["username"] = self.username
        if self.password is not None:
            options["password"] = self.password
        if parts.scheme in _TLS_SCHEMES:
            for name, option in (("tls_ca_file", "ssl_ca_certs"), ("tls_cert_file", "ssl_certfile"),
                                 ("tls_key_file", "ssl_keyfile")):
                if getattr(self, name) is not None:
                    options[option] = getattr(self, name)
        host = parts.netloc.rpartition("@")[2]
        return f"{parts.scheme}://{host}{parts.path}", options

    def topology(self) -> Topology:
        """Single server, Redis Cluster or Sentinel, and the nodes to reach it through."""
        try:
            return _topology(self.url)
        except ValueError as exc:  # checked when the config was made; a file may have gone since
            raise ConfigError(f"KVREDIS_URL={self.masked_url}: {exc}") from None

    @property
    def masked_url(self) -> str:
        """The URL with any password replaced by ``***``."""
        return _mask_url(self.url)

    def __repr__(self) -> str:
        fields = ", ".join(f"{s.name}={_shown(s, getattr(self, s.name))!s}" for s in SETTINGS)
        return f"KVRedisConfig({fields})"


def _parse(setting: Setting, raw: Any, source: str) -> Any:
    try:
        return setting.parse(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}={_shown(setting, raw)}: {exc}") from None


def _shown(setting: Setting, value: Any) -> str:
    if value is None:
        return ""
    if setting.secret:
        return "***"
    if setting.name == "url":
        return _mask_url(str(value))
    return str(value)
