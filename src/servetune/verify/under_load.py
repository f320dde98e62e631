"""What the scenarios that change a Serve deployment under load share (verify/replica_lost.py, a replica's engine
killed; verify/rolling_update.py, the deployment moved to a new configuration): the SLO's TTFT bound, the load
after an event in windows judged against the SLO, the errors by kind, and a level that runs until told to stop
with its clock read back from the requests it finished.

All of it is arithmetic over :class:`~servetune.metrics.RequestRecord` on the level's clock (seconds from the
level's start), except :class:`Until` and :class:`LevelClock`, which the scenarios hand ``measure_level``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from servetune.config.slo import Slo
from servetune.load.runner import Level
from servetune.metrics import RequestRecord
from servetune.trial.measure import EarlyBreak


def ttft_bound_s(slo: Slo) -> float | None:
    """The SLO's TTFT bound in seconds: its P99 bound, else its highest one; None without one."""
    bounds = [b for b in slo.bounds if b.metric == "ttft_ms"]
    if not bounds:
        return None
    p99 = [b.limit for b in bounds if b.stat == "p99"]
    return (min(p99) if p99 else max(b.limit for b in bounds)) / 1000.0


def p99_ms(values: Sequence[float]) -> float | None:
    """The P99 of ``values`` (seconds) in milliseconds; None for none."""
    return float(np.percentile(np.asarray(values), 99)) * 1000.0 if values else None


def done_at(r: RequestRecord) -> float:
    """When the request ended (failed or not), else when it was sent."""
    return r.end if r.end is not None else r.sent


def error_kinds(records: Sequence[RequestRecord]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for r in records:
        kinds[r.error_kind or "error"] = kinds.get(r.error_kind or "error", 0) + 1
    return kinds


@dataclass(frozen=True)
class Window:
    start_s: float  # after the event
    requests: int
    failed: int
    ttft_ms_p99: float | None
    good: bool

    def as_dict(self) -> dict[str, Any]:
        return {"start_s": self.start_s, "requests": self.requests, "failed": self.failed,
                "ttft_ms_p99": self.ttft_ms_p99, "good": self.good}  # fmt: skip


def after_windows(records: Sequence[RequestRecord], event_at: float, window_s: float, ttft_s: float | None,
                  errors_max: float) -> list[Window]:  # fmt: skip
    """The requests sent after ``event_at``, in windows of ``window_s`` by when they were sent, each judged good or
    not: its error rate within ``errors_max`` and its TTFT P99 within ``ttft_s`` (None: no TTFT bound)."""
    after = [r for r in records if not r.warmup and r.sent >= event_at]
    if not after:
        return []
    count = int((max(r.sent for r in after) - event_at) // window_s) + 1
    out = []
    for i in range(count):
        inside = [r for r in after if i * window_s <= r.sent - event_at < (i + 1) * window_s]
        failed = sum(not r.ok for r in inside)
        p99 = p99_ms([r.ttft_s for r in inside if r.ok and r.ttft_s is not None])
        good = not inside or (  # a window nobody sent in is no evidence either way
            failed / len(inside) <= errors_max and (ttft_s is None or (p99 is not None and p99 <= ttft_s * 1000.0))
        )
        out.append(Window(i * window_s, len(inside), failed, p99, good))
    return out


class Until(EarlyBreak):
    """Ends the level at :attr:`stop_at` (``time.perf_counter()``) once it is set; no SLO bound ends it (an open
    loop may still stop saturated, as every scenario's)."""

    def __init__(self, level: Level, why: str) -> None:
        super().__init__(Slo(), level, None)
        self.stop_at: float | None = None
        self.why = why

    def broken(self) -> bool:
        if self.reason is None and self.stop_at is not None and time.perf_counter() >= self.stop_at:
            self.reason = self.why
        return self.reason is not None


class LevelClock:
    """The level's clock origin (``time.perf_counter()``), read back from each request it finished: pass
    :meth:`done` as ``measure_level``'s ``on_done``; a ``perf_counter`` reading minus :meth:`origin` is on the
    level's clock, as the records' ``sent`` and ``end`` are."""

    def __init__(self) -> None:
        self.origins: list[float] = []

    def done(self, record: RequestRecord) -> None:
        if record.end is not None:
            self.origins.append(time.perf_counter() - record.end)

    def origin(self, default: float) -> float:
        """The level's start (perf_counter); ``default`` when no request finished."""
        return min(self.origins, default=default)
