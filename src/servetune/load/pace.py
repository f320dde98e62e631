"""Whether the load client kept up with the load it was asked to make: a level's ``client_bound``.

A level is *client-bound* when the numbers it measured may be the client's rather than the server's:

- an open loop whose requests went out later than their schedule: the median send lag
  (``RequestRecord.sent - RequestRecord.scheduled``, measured requests only) past
  :data:`SEND_LAG_BOUND_MS`. A late send delays the load the server sees and, when the client's
  event loop is busy, the reading of chunks that already arrived (TTFT and ITL then grow on the
  client's side). The median, not a tail: a client that cannot keep up falls further behind with
  every request (the schedule is absolute), while a shared host's scheduler delays a few sends
  by tens of ms now and then without the client being short of CPU (the P99 is recorded beside it);
- or a client process near saturation: its CPU seconds over the level (``time.process_time``, every
  thread of the process) at least :data:`CPU_SHARE_BOUND` of the level's wall time. The client reads
  every stream on one event loop, one core at most; at that share chunks wait to be parsed.

A client-bound level is recorded with its reason and never decides an SLO verdict: the capacity
search counts its verdict as unsettled, :func:`servetune.results.best_level` passes over it, and the
report's trial table marks it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from servetune.metrics import RequestRecord

#: The median send lag past which an open loop is client-bound, in ms. bench/client_rate.py (bench/README.md,
#: "The load client's cost per chunk") measured open loops of 50-800 req/s on the shared two-core development
#: host (load average 13-48) with the client's CPU share at 0.04-0.12: medians of 5-17 ms up to 200 req/s
#: (41 ms at 800, a burst of new connections) and P99s of 15-137 ms. A client that cannot keep up falls
#: further behind with every send: its median grows without bound, far past this.
SEND_LAG_BOUND_MS = 50.0
#: The client process's CPU share of the level's wall time from which it counts as saturated. The client reads
#: every stream on one event loop, so a share of 1.0 is its ceiling; the same bench measured 0.1 while it read
#: 14,000-20,000 chunks/s from a fake answering at once (the fake, not the client, was the limit there), so a
#: share of 0.9 is a client doing nearly nothing but its own reading. A host short of cores lowers the share
#: (the process waits to run): that case shows as send lag instead.
CPU_SHARE_BOUND = 0.9


@dataclass(frozen=True)
class ClientPace:
    """How the client kept up over one level: its CPU share of the wall time and its send lag's median and P99
    (None where not measured: a closed loop has no schedule)."""

    cpu_share: float | None
    send_lag_ms_p50: float | None
    send_lag_ms_p99: float | None


def send_lags_ms(records: Iterable[RequestRecord]) -> list[float]:
    """How late each measured request with a schedule (an open loop's) was sent, in ms (0 for an early one)."""
    return [max(0.0, r.sent - r.scheduled) * 1e3 for r in records if r.scheduled is not None and not r.warmup]


def client_pace(records: Iterable[RequestRecord], cpu_s: float | None, wall_s: float | None) -> ClientPace:
    """The client's pace over a level from its records and the CPU seconds it spent over ``wall_s`` seconds."""
    lags = send_lags_ms(records)
    share = cpu_s / wall_s if cpu_s is not None and wall_s else None
    if not lags:
        return ClientPace(share, None, None)
    return ClientPace(share, float(np.percentile(lags, 50)), float(np.percentile(lags, 99)))


def client_bound(
    pace: ClientPace, lag_bound_ms: float = SEND_LAG_BOUND_MS, cpu_bound: float = CPU_SHARE_BOUND
) -> str | None:
    """Why the level is client-bound (one line), or None when the client kept up."""
    reasons = []
    if pace.send_lag_ms_p50 is not None and pace.send_lag_ms_p50 > lag_bound_ms:
        reasons.append(f"requests sent {pace.send_lag_ms_p50:.0f} ms late at the median (bound {lag_bound_ms:g} ms)")
    if pace.cpu_share is not None and pace.cpu_share >= cpu_bound:
        reasons.append(f"the client process used {pace.cpu_share:.0%} of a core (bound {cpu_bound:.0%})")
    return "; ".join(reasons) or None


def shards_bound(paces: Sequence[ClientPace]) -> str | None:
    """Why a level run across several client processes (load/shard.py) is client-bound, or None: any shard that
    fell behind makes the level client-bound (its share of the load was not sent or read as asked)."""
    if len(paces) == 1:
        return client_bound(paces[0])
    reasons = [f"shard {k + 1} of {len(paces)}: {why}" for k, pace in enumerate(paces) if (why := client_bound(pace))]
    return "; ".join(reasons) or None


#: How late a tick of the client's event loop may wake before it counts as a stall: the send lag's bound.
STALL_BOUND_S = SEND_LAG_BOUND_MS / 1000.0

#: A stall's span: from when the loop should have woken to when it did, in ``time.perf_counter`` seconds (the
#: system's monotonic clock: one for every process, so the spans of a level's shards, load/shard.py, compare).
StallSpan = tuple[float, float]


def longest_stall_s(spans: Iterable[StallSpan]) -> float:
    """The longest of the stalls, in seconds (0 without any). Over a level split across client processes, the
    longest of any shard's: a request is read by one shard, so its latency grew by its shard's longest stall at most,
    and the longest of all bounds every request's (what ``config.slo.stall_off`` takes off)."""
    return max((end - start for start, end in spans), default=0.0)


def stalled_s(spans: Iterable[StallSpan]) -> float:
    """The seconds some client stalled in: the union of the spans. One event loop's stalls follow one another, so for
    one process this is their sum. Over a level's shards it is the seconds in which some of the level's client was
    not running: a sum would count a stall of the whole host (a host short of cores stops every shard at once) once
    per shard, and the most of any one shard's would miss stalls that came to different shards at different times."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class LoopStalls:
    """The load client's own stalls while it runs (``async with LoopStalls() as stalls``): a task on the client's
    event loop sleeps ``tick_s`` again and again and notes each wake-up later than asked by over
    :data:`STALL_BOUND_S`, with its span (``spans``). A stall is the client not running: a host short of cores did
    not schedule its process, or something blocked its loop. A request in flight across a stall was timed up to the
    stall's length too long (its answer waited to be read), and one due in it was sent that much late. The send lag's
    median (:func:`client_bound`) passes over a few such stalls; a verdict on a request's tail cannot
    (verify/overload.py). A level split across client processes runs one in each shard (load/shard.py), and the
    level's stalls are theirs together: the longest of any (:func:`longest_stall_s`), the union of their spans
    (:func:`stalled_s`)."""

    def __init__(self, tick_s: float = 0.01) -> None:
        self.tick_s = tick_s
        self.spans: list[StallSpan] = []  # each stall: from when the tick was due to when it woke
        self._task: asyncio.Future[None] | None = None

    async def __aenter__(self) -> LoopStalls:
        self._task = asyncio.ensure_future(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _tick(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(self.tick_s)
            woke = time.perf_counter()
            if woke - before - self.tick_s > STALL_BOUND_S:
                self.spans.append((before + self.tick_s, woke))

    @property
    def stalls(self) -> list[float]:
        """Each stall's seconds past the tick."""
        return [end - start for start, end in self.spans]

    @property
    def longest_s(self) -> float:
        return longest_stall_s(self.spans)

    @property
    def total_s(self) -> float:
        return stalled_s(self.spans)
