"""The Makefile's installs: ``make run`` installs the package with its runtime dependencies only, ``make test``
adds the test extra; ``make run`` then ``make test`` installs the extra once, ``make test`` then ``make run``
installs nothing more. Run on a copy of the Makefile and pyproject.toml with ``PY`` a stand-in interpreter that
makes the venv's ``python`` a script logging its arguments (no install, no download: make alone)."""

from __future__ import annotations

import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FAKE_PYTHON = """#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && exit 0; fi
echo "$*" >> "{log}"
"""


@pytest.fixture
def project(tmp_path) -> tuple[Path, Path]:
    if shutil.which("make") is None:
        pytest.skip("no make here")
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy2(ROOT / name, tmp_path / name)
    log = tmp_path / "calls.log"
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_PYTHON.format(log=log))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return tmp_path, log


def _make(project: tuple[Path, Path], target: str) -> list[str]:
    """The venv python's calls that ``make <target>`` made (installs and the target's own command)."""
    folder, log = project
    log.write_text("")
    done = subprocess.run(["make", "-s", f"PY={folder / 'fake_python'}", target], cwd=folder, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [line for line in log.read_text().splitlines() if "pip install" in line and "--upgrade pip" not in line]


def test_run_installs_the_runtime_only_and_test_adds_the_extra_once(project):
    assert _make(project, "run") == ["-m pip install -q -e ."]
    assert _make(project, "test") == ["-m pip install -q -e .[test]"]
    assert _make(project, "test") == [] and _make(project, "run") == []


def test_test_then_run_installs_nothing_more(project):
    assert _make(project, "test") == ["-m pip install -q -e .[test]"]
    assert _make(project, "run") == []
