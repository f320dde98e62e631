"""A command a test runs with a time limit (tests/ray_heads.py ``run_tree``) leaves nothing running when it passes
the limit: its whole process tree is stopped by process id, not only the command (``subprocess.run`` kills only its
own child, and a ``servetune run`` stopped that way left its local Ray's agents behind). Without Ray: a Python
whose child stands in for a raylet's agent."""

import subprocess
import sys

import psutil
import pytest

from tests.ray_heads import run_tree

PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(120)
"""


def _still_running(pid_file) -> bool:
    """Whether the command's child (its pid in ``pid_file``) still runs; stopped here if it does."""
    assert pid_file.exists() and pid_file.read_text(), "the command did not start its child"
    try:
        child = psutil.Process(int(pid_file.read_text()))
        if child.status() == psutil.STATUS_ZOMBIE:
            return False
        child.kill()
    except psutil.NoSuchProcess:
        return False
    return True


def test_a_command_past_its_time_limit_is_stopped_with_its_descendants(tmp_path):
    pid_file = tmp_path / "child.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_tree([sys.executable, "-c", PARENT, str(pid_file)], timeout=3)
    assert not _still_running(pid_file), "the command's child outlived it"


def test_a_command_within_its_limit_gives_its_output_and_status():
    done = run_tree([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                    timeout=60)  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
