"""KVRedisConfig: defaults, KVREDIS_* variables, overrides, validation, secret masking, README table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvredis
from kvredis.config import SETTINGS, KVRedisConfig
from kvredis.errors import ConfigError, KVRedisError

README = Path(__file__).resolve().parent.parent / "README.md"

EXPECTED_DEFAULTS = {
    "url": "redis://localhost:6379/0",
    "namespace": "kvredis",
    "ttl_s": 300.0,
    "pop_timeout_s": 5.0,
    "chunk_bytes": 1 << 20,
    "chunk_tokens": 64,
    "inflight_bytes": 4 << 20,
    "pinned_bytes": 256 << 20,
    "write_batch_bytes": 16 << 20,
    "max_entry_bytes": 8 << 30,
    "connect_timeout_s": 2.0,
    "socket_timeout_s": 10.0,
    "lookup_timeout_s": 0.5,
    "checksum": True,
    "username": None,
    "password": None,
    "tls_ca_file": None,
    "tls_cert_file": None,
    "tls_key_file": None,
    "reuse": False,
    "store_all_prompts": False,
}

# One valid non-default text value per setting, and what it parses to (TLS files are filled in per test).
ENV_CASES = {
    "url": ("rediss://cache.example:6380/2", "rediss://cache.example:6380/2"),
    "namespace": ("tenant-a.v2_x", "tenant-a.v2_x"),
    "ttl_s": ("12.5", 12.5),
    "pop_timeout_s": ("0.25", 0.25),
    "chunk_bytes": ("65536", 65536),
    "inflight_bytes": ("8MiB", 8 << 20),
    "write_batch_bytes": ("32MiB", 32 << 20),
    "max_entry_bytes": ("1GiB", 1 << 30),
    "connect_timeout_s": ("3", 3.0),
    "socket_timeout_s": ("7.5", 7.5),
    "lookup_timeout_s": ("0.25", 0.25),
    "checksum": ("false", False),
    "username": ("alice", "alice"),
    "password": ("hunter2", "hunter2"),
    "reuse": ("on", True),
}


def config(**env: str) -> KVRedisConfig:
    return KVRedisConfig.from_env(env=env)


@pytest.fixture
def tls_file(tmp_path: Path) -> str:
    path = tmp_path / "ca.pem"
    path.write_text("-----BEGIN CERTIFICATE-----\n")
    return str(path)


# --- errors -------------------------------------------------------------------------------------------


def test_config_error_is_value_error_and_kvredis_error() -> None:
    assert issubclass(ConfigError, ValueError)
    assert issubclass(ConfigError, KVRedisError)
    assert kvredis.ConfigError is ConfigError


def test_bad_value_raises_catchable_as_value_error() -> None:
    with pytest.raises(ValueError):
        config(KVREDIS_TTL_S="-1")


# --- defaults -----------------------------------------------------------------------------------------


def test_settings_cover_every_dataclass_field() -> None:
    assert [s.name for s in SETTINGS] == list(EXPECTED_DEFAULTS)
    assert len({s.env for s in SETTINGS}) == len(SETTINGS)


@pytest.mark.parametrize("name", list(EXPECTED_DEFAULTS))
def test_empty_env_gives_documented_default(name: str) -> None:
    cfg = KVRedisConfig.from_env(env={})
    assert getattr(cfg, name) == EXPECTED_DEFAULTS[name]
    assert type(getattr(cfg, name)) is type(EXPECTED_DEFAULTS[name])


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_setting_default_matches_dataclass_default(setting) -> None:
    assert getattr(KVRedisConfig(), setting.name) == setting.default


def test_setting_env_name_is_prefixed_upper_case() -> None:
    for setting in SETTINGS:
        assert setting.env == "KVREDIS_" + setting.name.upper()


def test_from_env_without_mapping_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVREDIS_TTL_S", "42")
    monkeypatch.setenv("KVREDIS_NAMESPACE", "fromos")
    cfg = KVRedisConfig.from_env()
    assert cfg.ttl_s == 42.0
    assert cfg.namespace == "fromos"


def test_explicit_env_mapping_ignores_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVREDIS_TTL_S", "42")
    assert KVRedisConfig.from_env(env={}).ttl_s == 300.0


def test_unrelated_and_lowercase_env_variables_are_ignored() -> None:
    cfg = config(REDIS_URL="http://nope", kvredis_ttl_s="-5", KVREDIS_UNKNOWN="x")
    assert cfg == KVRedisConfig()


# --- every variable read from the env mapping ---------------------------------------------------------


@pytest.mark.parametrize("name", list(ENV_CASES))
def test_each_variable_is_read_from_env(name: str) -> None:
    text, expected = ENV_CASES[name]
    cfg = config(**{"KVREDIS_" + name.upper(): text})
    assert getattr(cfg, name) == expected
    others = {n: getattr(cfg, n) for n in EXPECTED_DEFAULTS if n != name}
    assert others == {n: v for n, v in EXPECTED_DEFAULTS.items() if n != name}


@pytest.mark.parametrize("name", ["tls_ca_file", "tls_cert_file", "tls_key_file"])
def test_each_tls_file_variable_is_read_from_env(name: str, tls_file: str) -> None:
    cfg = config(**{"KVREDIS_" + name.upper(): tls_file})
    assert getattr(cfg, name) == tls_file


def test_empty_optional_string_means_unset() -> None:
    cfg = config(KVREDIS_USERNAME="", KVREDIS_PASSWORD="", KVREDIS_TLS_CA_FILE="")
    assert cfg.username is None
    assert cfg.password is None
    assert cfg.tls_ca_file is None


def test_every_setting_can_be_set_at_once(tls_file: str) -> None:
    env = {"KVREDIS_" + n.upper(): text for n, (text, _) in ENV_CASES.items()}
    env.update(KVREDIS_TLS_CA_FILE=tls_file, KVREDIS_TLS_CERT_FILE=tls_file, KVREDIS_TLS_KEY_FILE=tls_file)
    cfg = KVRedisConfig.from_env(env=env)
    for name, (_, expected) in ENV_CASES.items():
        assert getattr(cfg, name) == expected, name
    assert cfg.tls_key_file == tls_file


# --- booleans -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["1", "true", "TRUE", "Yes", "on", " true "])
def test_truthy_bool_texts(text: str) -> None:
    assert config(KVREDIS_CHECKSUM=text).checksum is True


@pytest.mark.parametrize("text", ["0", "false", "False", "NO", "off"])
def test_falsy_bool_texts(text: str) -> None:
    assert config(KVREDIS_CHECKSUM=text).checksum is False


@pytest.mark.parametrize("text", ["maybe", "", "2", "t", "enabled"])
def test_bad_bool_is_refused_naming_variable_and_value(text: str) -> None:
    with pytest.raises(ConfigError, match=rf"KVREDIS_CHECKSUM={re.escape(text)}:"):
        config(KVREDIS_CHECKSUM=text)


# --- sizes --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1MiB", 1 << 20),
        ("512KiB", 512 << 10),
        ("2M", 2 << 20),
        ("2MB", 2 << 20),
        ("4k", 4 << 10),
        ("3 MiB", 3 << 20),
        ("8192", 8192),
        ("8192B", 8192),
    ],
)
def test_size_suffixes(text: str, expected: int) -> None:
    assert config(KVREDIS_CHUNK_BYTES=text).chunk_bytes == expected


def test_large_size_suffix_for_max_entry_bytes() -> None:
    assert config(KVREDIS_MAX_ENTRY_BYTES="16GiB").max_entry_bytes == 16 << 30


@pytest.mark.parametrize("text", ["abc", "1.5MiB", "-4096", "1TiB", "MiB", "0x1000", "4096 KiBs"])
def test_malformed_size_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="KVREDIS_INFLIGHT_BYTES"):
        config(KVREDIS_INFLIGHT_BYTES=text)


@pytest.mark.parametrize("text", ["0", "0MiB"])
def test_zero_size_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match=f"KVREDIS_MAX_ENTRY_BYTES={text}"):
        config(KVREDIS_MAX_ENTRY_BYTES=text)


@pytest.mark.parametrize("text", ["4095", "1KiB", "257MiB", "1GiB", str((256 << 20) + 1)])
def test_chunk_size_out_of_range_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match=rf"KVREDIS_CHUNK_BYTES={re.escape(text)}:.*4 KiB"):
        config(KVREDIS_CHUNK_BYTES=text)


@pytest.mark.parametrize(("text", "expected"), [("4096", 4096), ("4KiB", 4096), ("256MiB", 256 << 20)])
def test_chunk_size_bounds_are_inclusive(text: str, expected: int) -> None:
    assert config(KVREDIS_CHUNK_BYTES=text).chunk_bytes == expected


# --- numbers ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["TTL_S", "POP_TIMEOUT_S", "CONNECT_TIMEOUT_S", "SOCKET_TIMEOUT_S"])
@pytest.mark.parametrize("text", ["-1", "abc", "0", "0.0", "inf", "-inf", "nan", ""])
def test_bad_positive_number_is_refused_naming_variable_and_value(name: str, text: str) -> None:
    var = "KVREDIS_" + name
    with pytest.raises(ConfigError, match=rf"{var}={re.escape(text)}(:|$)"):
        config(**{var: text})


def test_negative_ttl_message_names_variable_and_value() -> None:
    with pytest.raises(ConfigError) as info:
        config(KVREDIS_TTL_S="-30")
    assert "KVREDIS_TTL_S" in str(info.value)
    assert "-30" in str(info.value)


def test_tiny_positive_number_is_accepted() -> None:
    assert config(KVREDIS_POP_TIMEOUT_S="0.001").pop_timeout_s == 0.001


# --- URL ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "redis://localhost:6379/0",
        "redis://user:pw@10.0.0.1:6390/3",
        "rediss://secure.example:6380/0",
        "unix:///var/run/redis/redis.sock",
        "REDIS://upper.example:6379/0",
    ],
)
def test_supported_url_schemes_are_accepted(url: str) -> None:
    assert config(KVREDIS_URL=url).url == url


@pytest.mark.parametrize(
    "url", ["http://localhost:6379", "https://h", "tcp://h:6379", "localhost:6379", "", "redis-cluster://h"]
)
def test_unknown_url_scheme_is_refused(url: str) -> None:
    with pytest.raises(ConfigError, match=rf"KVREDIS_URL={re.escape(url)}:.*scheme"):
        config(KVREDIS_URL=url)


def test_bad_url_error_does_not_leak_password() -> None:
    with pytest.raises(ConfigError) as info:
        config(KVREDIS_URL="http://user:s3cret@host:6379/0")
    assert "s3cret" not in str(info.value)
    assert "http://user:***@host:6379/0" in str(info.value)


# --- namespace ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("namespace", ["a", "A-b_c.d", "x" * 64, "0"])
def test_valid_namespace_is_accepted(namespace: str) -> None:
    assert config(KVREDIS_NAMESPACE=namespace).namespace == namespace


@pytest.mark.parametrize(
    "namespace", ["a:b", "a{b", "a}b", "a*", "a?b", "a[b]", "", "x" * 65, "a b", "ns/x", "é"]
)
def test_invalid_namespace_is_refused_naming_it(namespace: str) -> None:
    with pytest.raises(ConfigError, match=rf"KVREDIS_NAMESPACE={re.escape(namespace)}:"):
        config(KVREDIS_NAMESPACE=namespace)


def test_namespace_with_trailing_newline_is_refused() -> None:
    with pytest.raises(ConfigError, match="KVREDIS_NAMESPACE"):
        config(KVREDIS_NAMESPACE="kvredis\n")


# --- TLS files ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("var", ["KVREDIS_TLS_CA_FILE", "KVREDIS_TLS_CERT_FILE", "KVREDIS_TLS_KEY_FILE"])
def test_missing_tls_file_is_refused_naming_variable_and_path(var: str, tmp_path: Path) -> None:
    missing = str(tmp_path / "absent.pem")
    with pytest.raises(ConfigError, match=rf"{var}={re.escape(missing)}:.*no such file"):
        config(**{var: missing})


def test_tls_directory_is_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="KVREDIS_TLS_CA_FILE"):
        config(KVREDIS_TLS_CA_FILE=str(tmp_path))


# --- overrides ----------------------------------------------------------------------------------------


def test_override_wins_over_env() -> None:
    cfg = KVRedisConfig.from_env(
        env={"KVREDIS_TTL_S": "10", "KVREDIS_NAMESPACE": "envns"}, overrides={"ttl_s": 20}
    )
    assert cfg.ttl_s == 20.0
    assert cfg.namespace == "envns"


def test_override_alone_sets_value_without_env() -> None:
    cfg = KVRedisConfig.from_env(env={}, overrides={"url": "unix:///tmp/r.sock", "namespace": "t1"})
    assert cfg.url == "unix:///tmp/r.sock"
    assert cfg.namespace == "t1"


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("ttl_s", 60, 60.0),
        ("ttl_s", 1.5, 1.5),
        ("ttl_s", "2.5", 2.5),
        ("chunk_bytes", 65536, 65536),
        ("chunk_bytes", "2MiB", 2 << 20),
        ("checksum", False, False),
        ("checksum", "off", False),
        ("checksum", 0, False),
        ("checksum", 1, True),
        ("max_entry_bytes", 1 << 33, 1 << 33),
        ("username", "bob", "bob"),
    ],
)
def test_typed_override_values(key: str, value: object, expected: object) -> None:
    cfg = KVRedisConfig.from_env(env={}, overrides={key: value})
    assert getattr(cfg, key) == expected
    assert type(getattr(cfg, key)) is type(expected)


def test_override_false_beats_env_true() -> None:
    cfg = KVRedisConfig.from_env(env={"KVREDIS_CHECKSUM": "true"}, overrides={"checksum": False})
    assert cfg.checksum is False


def test_override_key_is_case_insensitive() -> None:
    assert KVRedisConfig.from_env(env={}, overrides={"TTL_S": 7}).ttl_s == 7.0


@pytest.mark.parametrize("key", ["ttl", "KVREDIS_TTL_S", "hostname", "kv_role"])
def test_unknown_override_key_is_refused_naming_it(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"unknown kvredis setting '{key}'.*ttl_s"):
        KVRedisConfig.from_env(env={}, overrides={key: 1})


@pytest.mark.parametrize(
    ("key", "value"),
    [("ttl_s", -1), ("ttl_s", 0), ("ttl_s", float("inf")), ("ttl_s", "abc"), ("ttl_s", None),
     ("chunk_bytes", 1024), ("chunk_bytes", True), ("chunk_bytes", 1.5), ("checksum", "maybe"),
     ("checksum", 2), ("namespace", "a:b"), ("url", "http://h")],
)
def test_bad_override_is_refused_naming_key_and_value(key: str, value: object) -> None:
    shown = "" if value is None else str(value)
    with pytest.raises(ConfigError, match=rf"{key} \(override\)={re.escape(shown)}:"):
        KVRedisConfig.from_env(env={}, overrides={key: value})


def test_bad_env_is_reported_even_if_override_would_fix_it() -> None:
    with pytest.raises(ConfigError, match="KVREDIS_TTL_S=abc"):
        KVRedisConfig.from_env(env={"KVREDIS_TTL_S": "abc"}, overrides={"ttl_s": 5})


def test_empty_overrides_mapping_changes_nothing() -> None:
    assert KVRedisConfig.from_env(env={}, overrides={}) == KVRedisConfig()
    assert KVRedisConfig.from_env(env={}, overrides=None) == KVRedisConfig()


# --- direct construction and replace ------------------------------------------------------------------


def test_constructor_validates_values() -> None:
    with pytest.raises(ConfigError, match="KVREDIS_TTL_S=-1"):
        KVRedisConfig(ttl_s=-1)


def test_constructor_parses_text_values() -> None:
    cfg = KVRedisConfig(chunk_bytes="64KiB", checksum="no")
    assert cfg.chunk_bytes == 64 << 10
    assert cfg.checksum is False


def test_replace_validates_and_keeps_others() -> None:
    base = KVRedisConfig.from_env(env={"KVREDIS_NAMESPACE": "keep"})
    changed = base.replace(ttl_s=9)
    assert changed.ttl_s == 9.0
    assert changed.namespace == "keep"
    assert base.ttl_s == 300.0
    with pytest.raises(ConfigError, match="KVREDIS_NAMESPACE"):
        base.replace(namespace="bad:ns")


def test_config_is_frozen() -> None:
    cfg = KVRedisConfig()
    with pytest.raises(AttributeError):
        cfg.ttl_s = 1.0  # type: ignore[misc]


# --- secrets ------------------------------------------------------------------------------------------

SECRET = "s3cret-Pa55"


def _all_text(cfg: KVRedisConfig) -> str:
    return repr(cfg) + str(cfg) + repr(cfg.describe()) + cfg.masked_url


def test_password_variable_never_shown() -> None:
    cfg = config(KVREDIS_PASSWORD=SECRET)
    assert cfg.password == SECRET
    assert SECRET not in _all_text(cfg)
    assert cfg.describe()["KVREDIS_PASSWORD"] == "***"
    assert "password=***" in repr(cfg)


def test_password_override_never_shown() -> None:
    cfg = KVRedisConfig.from_env(env={}, overrides={"password": SECRET})
    assert SECRET not in _all_text(cfg)


def test_password_in_url_is_masked() -> None:
    cfg = config(KVREDIS_URL=f"redis://user:{SECRET}@host:6379/0")
    assert cfg.url == f"redis://user:{SECRET}@host:6379/0"
    assert cfg.masked_url == "redis://user:***@host:6379/0"
    assert cfg.describe()["KVREDIS_URL"] == "redis://user:***@host:6379/0"
    assert SECRET not in _all_text(cfg)


def test_password_without_user_in_url_is_masked() -> None:
    cfg = config(KVREDIS_URL=f"rediss://:{SECRET}@host:6380/1")
    assert cfg.masked_url == "rediss://:***@host:6380/1"
    assert SECRET not in _all_text(cfg)


def test_password_with_at_sign_in_url_is_masked() -> None:
    cfg = config(KVREDIS_URL="redis://u:p@ss@host:6379/0")
    assert cfg.masked_url == "redis://u:***@host:6379/0"
    assert "p@ss" not in _all_text(cfg)


def test_url_without_password_is_shown_unchanged() -> None:
    cfg = config(KVREDIS_URL="redis://user@host:6379/0")
    assert cfg.masked_url == "redis://user@host:6379/0"
    assert cfg.describe()["KVREDIS_URL"] == "redis://user@host:6379/0"


def test_masked_ipv6_url_keeps_brackets() -> None:
    assert config(KVREDIS_URL="redis://u:pw@[::1]:6379/0").masked_url == "redis://u:***@[::1]:6379/0"


def test_password_in_url_query_is_never_shown() -> None:
    # redis-py honours ?password=...: kvredis may refuse such a URL or accept it, but never print the secret.
    try:
        cfg = config(KVREDIS_URL=f"redis://host:6379/0?password={SECRET}")
    except ConfigError as exc:
        assert SECRET not in str(exc)
        return
    assert SECRET not in _all_text(cfg)


def test_describe_lists_every_variable_as_text() -> None:
    shown = KVRedisConfig().describe()
    assert list(shown) == [s.env for s in SETTINGS]
    assert all(isinstance(v, str) for v in shown.values())
    assert shown["KVREDIS_TTL_S"] == "300.0"
    assert shown["KVREDIS_PASSWORD"] == ""


def test_repr_shows_non_secret_values() -> None:
    text = repr(config(KVREDIS_NAMESPACE="visible", KVREDIS_USERNAME="alice"))
    assert text.startswith("KVRedisConfig(")
    assert "namespace=visible" in text
    assert "username=alice" in text


# --- README table -------------------------------------------------------------------------------------

_ROW = re.compile(r"^\|\s*`(KVREDIS_[A-Z0-9_]+)`\s*\|\s*([^|]*?)\s*\|\s*([^|]*?)\s*\|\s*$")
_UNSET = {"", "-", "—", "none", "(none)", "unset", "(unset)", "null"}


def _readme_rows() -> dict[str, str]:
    if not README.is_file():
        pytest.fail(f"README.md is missing at {README}: it must document every KVREDIS_* variable")
    rows: dict[str, str] = {}
    for line in README.read_text(encoding="utf-8").splitlines():
        match = _ROW.match(line.strip())
        if match:
            rows[match.group(1)] = match.group(2).strip().strip("`").strip()
    return rows


def test_readme_lists_every_setting() -> None:
    rows = _readme_rows()
    missing = [s.env for s in SETTINGS if s.env not in rows]
    assert not missing, f"README.md variable table lacks {missing}"


def test_readme_lists_no_unknown_variables() -> None:
    known = {s.env for s in SETTINGS}
    unknown = sorted(set(_readme_rows()) - known)
    assert not unknown, f"README.md documents variables that do not exist: {unknown}"


def test_readme_defaults_match_settings() -> None:
    rows = _readme_rows()
    wrong = []
    for setting in SETTINGS:
        if setting.env not in rows:
            continue
        text = rows[setting.env]
        if setting.default is None:
            if text.lower() not in _UNSET:
                wrong.append((setting.env, text, None))
            continue
        try:
            documented = setting.parse(text)
        except ValueError:
            documented = text
        if documented != setting.default:
            wrong.append((setting.env, text, setting.default))
    assert not wrong, f"README.md defaults disagree with SETTINGS (variable, README, actual): {wrong}"


@pytest.mark.parametrize(("raw", "expected"), [("16", 16), (" 512 ", 512), (1024, 1024)])
def test_chunk_tokens_are_read_as_a_count(raw: object, expected: int) -> None:
    assert KVRedisConfig.from_env({}, {"chunk_tokens": raw}).chunk_tokens == expected


@pytest.mark.parametrize("raw", ["0", "8", "1e3", "256.5", "-256", "70000", True])
def test_a_chunk_length_out_of_range_is_refused(raw: object) -> None:
    with pytest.raises(ConfigError, match="chunk_tokens"):
        KVRedisConfig.from_env({}, {"chunk_tokens": raw})
