"""The test session ends with pytest's status and without the interpreter's teardown (tests/conftest.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

TESTS = """
import os, sys


class Finalized:
    \"\"\"Writes its file when the interpreter tears the module down (as a C extension's statics would run).\"\"\"

    path = os.environ["FINALIZED"]

    def __del__(self, open=open):  # module globals may be gone by then: nothing looked up late
        with open(self.path, "w") as f:
            f.write("torn down")


KEPT = Finalized()


def test_one():
    assert os.environ["OUTCOME"] == "pass"
"""


def session(tmp_path: Path, outcome: str, harness: bool = True) -> tuple[subprocess.CompletedProcess, Path]:
    """pytest on the probe, in a fresh interpreter, with tests/conftest.py as a plugin or without it."""
    (tmp_path / "test_probe.py").write_text(TESTS)
    marker = tmp_path / "finalized"
    plugin = ["-p", "tests.conftest"] if harness else []
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *plugin, "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_probe.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**env, "OUTCOME": outcome, "FINALIZED": str(marker)},
    )  # fmt: skip
    return done, marker


@pytest.mark.parametrize(("outcome", "status"), [("pass", 0), ("fail", 1)])
def test_the_session_exits_with_pytests_status_and_skips_the_interpreters_teardown(tmp_path, outcome, status):
    done, marker = session(tmp_path, outcome)
    assert done.returncode == status, done.stdout[-2000:] + done.stderr[-2000:]
    assert ("1 passed" if status == 0 else "1 failed") in done.stdout  # the summary was printed before the exit
    assert not marker.exists()  # the module's objects were never torn down


def test_without_the_harness_the_probe_is_torn_down(tmp_path):
    """The probe's own check: without tests/conftest.py the interpreter tears the module down."""
    done, marker = session(tmp_path, "pass", harness=False)
    assert done.returncode == 0, done.stdout[-2000:]
    assert marker.read_text() == "torn down"
