"""The fake server (``servetune.testing.fake_openai``) in a process of its own, for tests and bench scripts whose
client must share no GIL with it, and waiting for a started process to serve."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from servetune.engine.server import free_port


def wait_until_healthy(url: str, proc: subprocess.Popen, timeout_s: float, poll_s: float = 0.1) -> bool:
    """Poll ``url`` until it answers; False if ``proc`` exits or the time runs out first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return True
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(poll_s)


@contextmanager
def fake_server_process(*args: str, timeout_s: float = 120.0) -> Iterator[str]:
    """The fake server started with ``args`` (its flags, ``--ttft-ms 40 ...``) on a free port of 127.0.0.1, in a
    session of its own; yields its URL once ``/health`` answers, and kills its process group on exit.
    ``timeout_s``: an interpreter starting beside running engines can take 5-15 s; RuntimeError past it, or where
    the process exits first."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "servetune.testing.fake_openai", "--port", str(port), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_until_healthy(url + "/health", proc, timeout_s=timeout_s, poll_s=0.05):
            status = proc.poll()
            why = f"it exited with status {status}" if status is not None else f"not serving after {timeout_s:g} s"
            raise RuntimeError(f"the fake server did not start: {why}")
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):  # its group already gone: it exited, and so did its children
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
