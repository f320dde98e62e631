"""Processes a test starts: waiting for them to serve, and proving none is left behind."""

from __future__ import annotations

import time

import psutil


def processes_mentioning(*needles: object) -> list[int]:
    """Live processes whose command line contains every one of ``needles``."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            if proc.info["status"] != psutil.STATUS_ZOMBIE and all(str(n) in cmdline for n in needles):
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def still_running_after(timeout_s: float, *needles: object) -> list[int]:
    """:func:`processes_mentioning` once none is left or ``timeout_s`` passed: what another process
    (Ray's shutdown, a reaper) stops is gone a moment after the command that asked for it returns."""
    deadline = time.monotonic() + timeout_s
    while (found := processes_mentioning(*needles)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return found
