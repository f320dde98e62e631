"""What an engine's log says of its life: when it was alive, to compare engines that ran side by side.

A trial's own clock (``started_at`` to ``finished_at``) is wider than its engine's life: the trial claims cores, starts
the engine, measures, stops it and then still reports. On a busy host one trial's engine can stop, and let its core
go, while the trial still reports, and the next trial's engine then takes that core, as it should. So a check that
engines side by side had cores of their own asks the engines' logs, not the trials' clocks.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta

#: vLLM's log lines: ``INFO 12-06 03:20:11 [file.py:12] ...`` (month-day and time, to the second).
VLLM_TIME = re.compile(r"(?:DEBUG|INFO|WARNING|ERROR) (\d\d-\d\d \d\d:\d\d:\d\d) ")


def engine_alive(log: str) -> tuple[datetime, datetime]:
    """The first and last time an engine's log names (vLLM's second-resolution timestamps)."""
    times = [datetime.strptime(f"2000-{t}", "%Y-%m-%d %H:%M:%S") for t in VLLM_TIME.findall(log)]  # a leap year
    assert times, log[-2000:]
    return times[0], times[-1]


def overlap(a: tuple[datetime, datetime], b: tuple[datetime, datetime]) -> bool:
    """Whether two engines were surely alive at once: each began at least a second (the logs' resolution) before
    the other's last line. Ignores a year turning between them."""
    second = timedelta(seconds=1)
    return a[0] + second <= b[1] and b[0] + second <= a[1]
