"""docs/configuration.md's settings reference (and README's table) is what scripts/config_reference.py makes
of kvredis.config.SETTINGS: every setting, each with its real default."""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvredis.config import SETTINGS

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "configuration.md"
_ROW = re.compile(r"^\|\s*`(KVREDIS_[A-Z0-9_]+)`\s*\|\s*`([a-z0-9_]+)`\s*\|\s*([^|]*?)\s*\|")


def _script() -> ModuleType:
    path = ROOT / "scripts" / "config_reference.py"
    spec = importlib.util.spec_from_file_location("config_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


config_reference = _script()


def _reference_rows(text: str) -> dict[str, tuple[str, str]]:
    """Each documented variable's ``kv_connector_extra_config`` key and default, as written."""
    rows: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        match = _ROW.match(line.strip())
        if match:
            rows[match.group(1)] = (match.group(2), match.group(3).strip("`"))
    return rows


def test_every_setting_is_in_the_reference_and_nothing_else() -> None:
    rows = _reference_rows(REFERENCE.read_text(encoding="utf-8"))
    missing = [setting.env for setting in SETTINGS if setting.env not in rows]
    assert not missing, f"docs/configuration.md lacks {missing}: run python scripts/config_reference.py"
    unknown = sorted(set(rows) - {setting.env for setting in SETTINGS})
    assert not unknown, f"docs/configuration.md documents settings that do not exist: {unknown}"


def test_each_documented_default_and_key_is_the_settings_own() -> None:
    rows = _reference_rows(REFERENCE.read_text(encoding="utf-8"))
    wrong: list[tuple[str, str, str, object]] = []
    for setting in SETTINGS:
        key, default = rows.get(setting.env, ("", ""))
        if key != setting.name:
            wrong.append((setting.env, "key", key, setting.name))
        if setting.default is None:
            if default != config_reference.UNSET:
                wrong.append((setting.env, "default", default, None))
        elif setting.parse(default) != setting.default:
            wrong.append((setting.env, "default", default, setting.default))
    assert not wrong, f"docs/configuration.md disagrees with SETTINGS (variable, what, written, real) {wrong}"


def test_the_tables_are_what_the_script_writes() -> None:
    assert config_reference.stale() == [], "run python scripts/config_reference.py"
    assert config_reference.main(["--check"]) == 0


@pytest.mark.parametrize("change", ["drop a row", "wrong default", "edit outside the table"])
def test_the_check_sees_a_table_out_of_date(tmp_path: Path, change: str) -> None:
    for name in config_reference.TARGETS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    copy = tmp_path / "docs" / "configuration.md"
    text = copy.read_text(encoding="utf-8")
    if change == "drop a row":
        lines = text.splitlines(keepends=True)
        text = "".join(line for line in lines if not line.startswith("| `KVREDIS_TTL_S`"))
    elif change == "wrong default":
        text = text.replace("| `ttl_s` | `300` |", "| `ttl_s` | `600` |")
    else:
        text = text.replace("# Configuration", "# Settings")
    copy.write_text(text, encoding="utf-8")
    if change == "edit outside the table":
        assert config_reference.main(["--check", "--root", str(tmp_path)]) == 0  # prose is not generated
        return
    assert config_reference.stale(tmp_path) == ["docs/configuration.md"]
    assert config_reference.main(["--check", "--root", str(tmp_path)]) == 1
    assert config_reference.main(["--root", str(tmp_path)]) == 0
    assert config_reference.stale(tmp_path) == []
    assert copy.read_text(encoding="utf-8") == REFERENCE.read_text(encoding="utf-8")


def test_every_default_is_written_as_its_parser_reads_it() -> None:
    for setting in SETTINGS:
        text = config_reference.default_text(setting)
        if setting.default is None:
            assert text == config_reference.UNSET
        else:
            assert setting.parse(text) == setting.default, (setting.env, text)
