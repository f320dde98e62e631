"""A pytest run stopped with SIGTERM still stops what its running test started (tests/conftest.py)."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).parents[2]

SLOW_TEST = """
import subprocess, sys
from pathlib import Path

def test_holds_a_server(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    Path({pidfile!r}).write_text(str(proc.pid))
    try:
        proc.wait()
    finally:
        proc.kill()
        proc.wait()
"""


def test_sigterm_runs_the_running_tests_cleanup(tmp_path):
    pidfile = tmp_path / "child.pid"
    pytest_run = None
    test_file = tmp_path / "test_held.py"
    test_file.write_text(SLOW_TEST.format(pidfile=str(pidfile)))
    try:
        # The suite's conftest as a plugin (run from the repository, where ``tests`` imports), the test outside it.
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                "--rootdir", str(tmp_path), str(test_file)]  # fmt: skip
        pytest_run = subprocess.Popen(
            argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 120
        while not pidfile.exists() and time.monotonic() < deadline and pytest_run.poll() is None:
            time.sleep(0.2)
        assert pidfile.exists(), pytest_run.communicate(timeout=30)[0]
        child = int(pidfile.read_text())
        pytest_run.send_signal(signal.SIGTERM)
        out = pytest_run.communicate(timeout=60)[0].decode(errors="replace")
        assert pytest_run.returncode != 0, out
        assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE, out
    finally:
        if pytest_run is not None and pytest_run.poll() is None:
            os.killpg(pytest_run.pid, signal.SIGKILL)
        if pidfile.exists():  # a child the run left (this test failing): stopped by its own process group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(pidfile.read_text()), signal.SIGKILL)
