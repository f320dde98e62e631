"""What the scenarios that change a Serve deployment under load share (verify/replica_lost.py, a replica's engine
killed; verify/rolling_update.py, the deployment moved to a new configuration): the SLO's TTFT bound, the load
after an event in windows judged against the SLO, the errors by kind, and a level that runs until told to stop
with its clock read back from the requests it finished.

All of it is arithmetic over :class:`~servetune.metrics.RequestRecord` on the level's clock (seconds from the
level's start), except :func:`around_event`, the load both scenarios run: the level, the event half the scenario's
time in, Serve followed until the event has settled, then the scenario's time more.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from servetune.config.slo import Slo
from servetune.load.runner import Level
from servetune.metrics import RequestRecord
from servetune.trial.measure import EarlyBreak, LevelPlan, measure_level
from servetune.verify.scenarios import Target, _error_samples, _warmup

EVENT_AFTER = 0.5  # of the scenario's time, the load before the event
POLL_S = 0.5  # how often Serve is read after it
T = TypeVar("T")


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


@dataclass
class AroundEvent(Generic[T]):
    """What :func:`around_event` measured; times on the level's clock (None: the event did not happen)."""

    records: list[RequestRecord]
    level: dict[str, float] | None  # the level's load, as its summary says
    called_at: float | None  # the event was called
    returned_at: float | None  # it returned
    settled_at: float | None  # Serve said it had settled (None: not within the run)
    value: T | None  # what the event returned
    ended_early: bool = False  # the load ended before the event (its requests could not be sent)
    error: Exception | None = None  # the event raised: the load stopped there
    started_wall_s: float | None = None  # the level's start on the wall clock (time.time()): Ray's times to its clock


async def around_event(t: Target, name: str, stream: int, event: Callable[[], T], settled: Callable[[T], bool],
                       why_stop: str, cap_s: float | None = None) -> AroundEvent[T]:  # fmt: skip
    """Run the level, call ``event`` (in a thread) ``EVENT_AFTER`` of the scenario's time in, then ask ``settled`` with
    what it returned every ``POLL_S`` (a read that raises is asked again next time); the load goes on until it says so
    and the scenario's time more (``why_stop`` is the level's stop reason), at most ``cap_s`` (default the scenario's
    time) and that after the event. Every request joins ``t.records``, a few error messages ``t.errors[name]``."""
    span = t.budget.scenario_s
    before_s = EVENT_AFTER * span
    plan = LevelPlan(t.level, num_requests=None, duration_s=before_s + (cap_s or span) + span,
                     warmup_requests=_warmup(t.level, t.budget))  # fmt: skip
    clock = LevelClock()
    until = Until(plan.level, why_stop)
    load = asyncio.ensure_future(measure_level(
        t.client, t.url, t.workload, t.prompts, plan, stream=stream, slo=t.slo, on_done=clock.done, watch=until,
        reset_cache=t.reset_cache, metrics=t.metrics,
    ))  # fmt: skip
    await asyncio.sleep(before_s)
    if load.done():
        records = (await load)[1]
        t.records.extend(records)
        return AroundEvent(records, None, None, None, None, None, ended_early=True)
    called = time.perf_counter()
    try:
        value = await asyncio.to_thread(event)
    except Exception as exc:  # the load finishes, the scenario says why
        until.stop_at = time.perf_counter()
        records = (await load)[1]
        t.records.extend(records)
        return AroundEvent(records, None, None, None, None, None, error=exc)
    returned = time.perf_counter()
    done: float | None = None
    while not load.done():
        if done is None:
            with contextlib.suppress(Exception):  # Serve unreadable this time: the next poll reads it
                if await asyncio.to_thread(settled, value):
                    done = time.perf_counter()
                    until.stop_at = done + span
        await asyncio.sleep(POLL_S)
    result, records = await load
    t.records.extend(records)
    if samples := _error_samples(records):  # verify.json's error_samples: what the clients saw of the event
        t.errors[name] = samples
    origin = clock.origin(called)
    wall_origin = time.time() - (time.perf_counter() - origin)
    return AroundEvent(records, result.summary.level, called - origin, returned - origin,
                       None if done is None else done - origin, value, started_wall_s=wall_origin)  # fmt: skip
