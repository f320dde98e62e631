"""The layer order of the rooms (pyproject.toml's [tool.importlinter]) holds, `make lint` checks it, and the check
fails on what it is there to stop: an import from a lower room to a higher one, a circle inside a room, and a new
room not given its place in the order. Each case runs lint-imports on a copy of src/ changed by one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(src: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", str(ROOT / "pyproject.toml")], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.fixture
def src(tmp_path: Path) -> Path:
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "servetune", copy / "servetune", ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_make_lint_runs_the_layer_check_on_this_checkouts_src(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("needs make")
    done = subprocess.run(["make", "-n", "lint", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                          text=True, check=True)  # fmt: skip
    assert f"PYTHONPATH=src {tmp_path / 'venv'}/bin/lint-imports" in done.stdout.splitlines()


def test_the_rooms_keep_their_layers_and_the_check_fails_on_each_thing_it_forbids(src, tmp_path):
    kept = lint_imports(src, tmp_path)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert "Contracts: 2 kept, 0 broken." in kept.stdout

    errors = src / "servetune" / "errors.py"
    original = errors.read_text()
    errors.write_text(original + "\n\ndef _upward() -> None:\n    from servetune.study import driver  # noqa: F401\n")
    upward = lint_imports(src, tmp_path)
    assert upward.returncode == 1 and "servetune.errors is not allowed to import servetune.study" in upward.stdout
    errors.write_text(original)

    params = src / "servetune" / "report" / "params.py"  # report/markdown.py imports it
    params.write_text(params.read_text() + "\nimport servetune.report.markdown  # noqa: E402, F401\n")
    circle = lint_imports(src, tmp_path)
    assert circle.returncode == 1 and "No cycles are allowed in servetune.report" in circle.stdout
    assert "a room imports only the rooms below it KEPT" in circle.stdout  # a circle inside one room

    params.write_text((ROOT / "src" / "servetune" / "report" / "params.py").read_text())
    (src / "servetune" / "new_room.py").write_text('"""A room nobody placed."""\n')
    unplaced = lint_imports(src, tmp_path)
    assert unplaced.returncode == 1 and "not listed as layers:\n\n- servetune.new_room" in unplaced.stdout
