"""A local Ray start that times out in Ray's fixed 30 s wait for its raylet (``start_local_ray``, as ``run``,
``verify`` and ``serve-check`` start one; tests' ``module_ray`` too) is stopped and made again, and leaves nothing.

Made to happen without a busy host: a thread of the driver SIGSTOPs the first start's raylet as soon as it exists, so
it never registers with its GCS and Ray raises "The current node timed out during startup" after 30 s, as it did on
this two-core host at a load of ~10. Costs Ray's 30 s and two starts.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.processes import still_running_after
from tests.ray_heads import last_json, user_env

pytest.importorskip("ray")

DRIVER = r"""
import json, threading, time
import psutil, ray
from servetune.local_ray import start_local_ray

me = psutil.Process()
first = []  # the first start's processes, once its raylet is stopped


def stop_the_first_raylet():
    while True:
        for proc in me.children(recursive=True):
            try:
                if proc.name() == "raylet":
                    proc.suspend()
                    first.extend(p.pid for p in me.children(recursive=True))
                    return
            except psutil.Error:
                pass
        time.sleep(0.05)


threading.Thread(target=stop_the_first_raylet, daemon=True).start()
start_local_ray(num_cpus=1, log_to_driver=False, logging_level="ERROR")
left = [pid for pid in first if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
raylets = [p.pid for p in me.children(recursive=True) if p.name() == "raylet"]
print(json.dumps({"first": first, "left": left, "raylets": raylets, "answer": ray.get(ray.put(7))}))
ray.shutdown()
"""


@pytest.fixture
def shell(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A user's shell whose Ray temp dir is the test's own (short: Ray's sockets live under it)."""
    ray_tmpdir = Path(tempfile.mkdtemp(prefix="st-", dir="/tmp"))
    home = tmp_path / "home"
    home.mkdir()
    try:
        yield user_env(home, RAY_TMPDIR=str(ray_tmpdir))
    finally:
        assert still_running_after(30, ray_tmpdir) == [], "the driver's local Ray outlived it"
        shutil.rmtree(ray_tmpdir, ignore_errors=True)


def test_a_local_start_whose_raylet_never_registers_is_stopped_and_made_again(shell):
    done = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, env=shell, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = last_json(done.stdout)
    assert seen["first"] and seen["left"] == [], seen  # the timed-out start's processes: stopped before the retry
    assert len(seen["raylets"]) == 1 and seen["raylets"][0] not in seen["first"], seen  # the second start's only
    assert seen["answer"] == 7
    retried = [line for line in done.stderr.splitlines() if "did not start within Ray's 30 s" in line]
    assert len(retried) == 1 and "try 2 of 3" in retried[0], done.stderr[-3000:]
