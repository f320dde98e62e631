"""tests/ray_token_guard.py: a session that leaves ``~/.ray/auth_token`` behind fails, naming it, also when a
pytest-xdist worker's test wrote it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ray_token_guard import created, failed_status, message

ROOT = Path(__file__).resolve().parents[2]

CONFTEST = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from tests import ray_token_guard

def pytest_configure(config):
    ray_token_guard.register(config)
"""

WRITES = """
from pathlib import Path

def test_starts_ray_the_plain_way():
    token = Path.home() / ".ray" / "auth_token"
    token.parent.mkdir(exist_ok=True)
    token.write_text("written as a plain ray.init() does")

def test_another():
    pass
"""


def test_only_a_file_the_session_made_counts_and_a_pass_becomes_a_failure(tmp_path):
    token = tmp_path / ".ray" / "auth_token"
    assert not created(token, existed_at_start=False)
    token.parent.mkdir()
    token.write_text("t")
    assert created(token, existed_at_start=False) and not created(token, existed_at_start=True)
    assert failed_status(pytest.ExitCode.OK) == failed_status(pytest.ExitCode.NO_TESTS_COLLECTED) == 1
    assert failed_status(pytest.ExitCode.TESTS_FAILED) == 1 and failed_status(pytest.ExitCode.INTERRUPTED) == 2
    assert str(token) in message(token)


def session(tmp_path: Path, token_at_start: bool, *flags: str) -> tuple[subprocess.CompletedProcess, Path]:
    """A pytest session with the guard, whose test writes the token under a home of its own."""
    suite, home = tmp_path / "suite", tmp_path / "home"
    suite.mkdir()
    (home / ".ray").mkdir(parents=True)
    token = home / ".ray" / "auth_token"
    if token_at_start:
        token.write_text("the user's own")
    (suite / "conftest.py").write_text(CONFTEST)
    (suite / "test_writes.py").write_text(WRITES)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    env.update(HOME=str(home), PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src")]))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *flags, str(suite)],
                          capture_output=True, text=True, cwd=suite, env=env, timeout=120)  # fmt: skip
    return done, token


def test_a_token_written_by_a_workers_test_fails_the_session_naming_the_file(tmp_path):
    done, token = session(tmp_path, False, "-n", "2")
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout and f"{token} was created during this test session" in done.stdout


def test_a_token_there_before_the_session_is_the_users(tmp_path):
    done, _ = session(tmp_path, True)
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
