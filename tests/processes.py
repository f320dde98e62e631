"""Finding processes a test started, to prove none is left behind."""

from __future__ import annotations

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
