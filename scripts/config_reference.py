"""Write the settings tables of docs/configuration.md and README.md from ``kvredis.config.SETTINGS``.

Each file holds its table between two marker comments; this script rewrites what lies between them and
leaves the rest of the file alone. docs/configuration.md gets the full reference (variable, key in vLLM's
``kv_connector_extra_config``, default, meaning), README.md the short one (variable, default, key).

    python scripts/config_reference.py           # rewrite both tables
    python scripts/config_reference.py --check   # exit 1 naming each file whose table is not SETTINGS's

``tests/test_config_reference.py`` runs the check, so a setting added to or changed in ``kvredis/config.py``
without running this script fails the tests.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # document this checkout's settings, not those of an installed kvredis
    sys.path.insert(0, str(ROOT))

from kvredis.config import SETTINGS, Setting  # noqa: E402

BEGIN = ("<!-- settings: generated from kvredis.config.SETTINGS by scripts/config_reference.py; "
         "do not edit -->")
END = "<!-- /settings -->"
UNSET = "unset"

_UNITS = ((30, "GiB"), (20, "MiB"), (10, "KiB"))


def _reads_back(setting: Setting, text: str) -> bool:
    try:
        return bool(setting.parse(text) == setting.default)
    except (TypeError, ValueError):
        return False


def default_text(setting: Setting) -> str:
    """The default as a user would write it in the variable (``1MiB``, ``300``, ``true``), or ``unset``.

    Every text is checked to read back as the default through the setting's own parser."""
    value = setting.default
    if value is None:
        return UNSET
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, int):
        text = str(value)
        for shift, unit in _UNITS:
            sized = f"{value >> shift}{unit}"
            if value >= 1 << shift and value % (1 << shift) == 0 and _reads_back(setting, sized):
                text = sized
                break
    elif isinstance(value, float):
        text = f"{value:g}"
    else:
        text = str(value)
    if not _reads_back(setting, text):
        raise ValueError(f"{setting.env}: the default {value!r}, written {text!r}, does not read back as it")
    return text


def _cell(text: str) -> str:
    return text if text == UNSET else f"`{text}`"


def reference_table() -> str:
    """docs/configuration.md's table: every setting with its variable, key, default and meaning."""
    rows = ["| Variable | `kv_connector_extra_config` key | Default | Meaning |", "|---|---|---|---|"]
    for setting in SETTINGS:
        default = _cell(default_text(setting))
        rows.append(f"| `{setting.env}` | `{setting.name}` | {default} | {setting.help} |")
    return "\n".join(rows)


def readme_table() -> str:
    """README.md's table: every setting's variable, default and key (meanings in docs/configuration.md)."""
    rows = ["| Variable | Default | `kv_connector_extra_config` key |", "|---|---|---|"]
    for setting in SETTINGS:
        rows.append(f"| `{setting.env}` | {_cell(default_text(setting))} | `{setting.name}` |")
    return "\n".join(rows)


TARGETS: dict[str, Callable[[], str]] = {
    "docs/configuration.md": reference_table,
    "README.md": readme_table,
}


def render(text: str, table: str, name: str) -> str:
    """``text`` with what lies between its markers replaced by ``table``."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{name} must hold the markers {BEGIN!r} and {END!r} once each, in that order")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def stale(root: Path = ROOT) -> list[str]:
    """The target files under ``root`` whose table differs from what SETTINGS gives."""
    return [name for name, table in TARGETS.items()
            if (text := (root / name).read_text(encoding="utf-8")) != render(text, table(), name)]


def write(root: Path = ROOT) -> list[str]:
    """Rewrite the tables under ``root``; returns the files that changed."""
    changed = []
    for name, table in TARGETS.items():
        path = root / name
        text = path.read_text(encoding="utf-8")
        new = render(text, table(), name)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(name)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a table is out of date")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if args.check:
            behind = stale(args.root)
            for name in behind:
                print(f"{name}: its settings table differs from kvredis.config.SETTINGS; "
                      "run python scripts/config_reference.py", file=sys.stderr)
            return 1 if behind else 0
        for name in write(args.root):
            print(f"rewrote the settings table of {name}")
    except ValueError as exc:
        print(f"config_reference: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
