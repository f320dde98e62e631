"""Drive one load level: a closed loop of N clients, or an open loop at a rate.

A level ends after ``num_requests`` measured requests were sent, or ``duration_s`` seconds,
whichever comes first, or once ``stop()`` says the level has told enough (it is asked after
every finished request); requests in flight then finish (no survivor bias from cutting long
requests off). The first ``warmup_requests`` requests are flagged and left out of summaries.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import numpy as np

from servetune.config.workload import Workload
from servetune.errors import UserError
from servetune.load.client import StreamingClient
from servetune.load.requests import RequestSpec
from servetune.metrics import RequestRecord

_T = TypeVar("_T")


async def cancel_and_wait(task: asyncio.Future[_T]) -> None:
    """Cancel a background task of ours and wait until it has ended. A cancellation of the caller (SIGTERM, Ctrl-C)
    while it waits still propagates: only the task's own CancelledError is absorbed, which a
    ``suppress(CancelledError)`` around ``await task`` cannot tell apart from the caller's."""
    task.cancel()
    await asyncio.wait([task])
    if not task.cancelled() and (exc := task.exception()) is not None:
        raise exc  # it had failed before: as ``await task`` raised it


@dataclass(frozen=True)
class Level:
    """One rung of the load ladder."""

    kind: Literal["concurrency", "rate"]
    value: float
    process: Literal["concurrency", "poisson", "gamma", "trace"] = "concurrency"
    burstiness: float = 1.0
    max_concurrency: int | None = None  # cap on requests in flight for open loops
    trace: tuple[float, ...] | None = None  # trace replay: the recorded gaps between sends, in seconds
    conversations: bool = False  # the workload has sessions: a rate counts conversations started

    def as_dict(self) -> dict[str, float]:
        return {self.kind: self.value}

    @property
    def speedup(self) -> float | None:
        """A trace replay's speed-up: its rate over the trace's own mean rate."""
        if not self.trace:
            return None
        return self.value / trace_rate(self.trace)

    def __str__(self) -> str:
        if self.kind == "concurrency":
            return f"concurrency {self.value:g}"
        per = "conversations/s" if self.conversations else "req/s"
        if self.trace:
            return f"trace x{self.speedup:.3g} ({self.value:.3g} {per})"
        return f"rate {self.value:g} {per}"


def trace_rate(gaps: tuple[float, ...]) -> float:
    """A trace's mean rate: its gaps per second of trace."""
    return len(gaps) / sum(gaps)


def workload_levels(workload: Workload, kind: Literal["concurrency", "rate"] | None, values: tuple[float, ...] | None,
                    max_concurrency: int | None = None) -> tuple[Level, ...]:  # fmt: skip
    """The ladder's levels for ``workload``, one path for ``servetune run`` and ``servetune bench``.

    ``kind`` (``load.kind``) defaults to the workload's arrival: a closed loop for
    ``concurrency``, an open loop otherwise. ``values`` default to the arrival's ``levels``, else
    1, 4, 16 clients or 1, 2, 4 req/s.

    A trace (``process: trace``) with no ``kind`` given takes its values as **speed-ups** (default:
    its ``speedup``): speed-up 2 sends at twice the recorded pace. Each becomes a rate level at the
    trace's mean rate times the speed-up, so reports, early stopping and the ladder see rates as for
    any open loop. With ``kind: rate`` the values are rates and the trace is scaled to each; with
    ``kind: concurrency`` its times are not used (a closed loop).

    With sessions, rates count conversations started a second (and a trace times conversations'
    first turns; think times between turns are the workload's, not scaled by the speed-up).
    """
    arrival = workload.arrival
    talk = workload.sessions is not None
    speedups = arrival.process == "trace" and kind is None
    kind = kind or ("concurrency" if arrival.process == "concurrency" else "rate")
    if arrival.process == "trace" and kind == "rate":
        times = arrival.trace_times(sessions=workload.sessions is not None)
        gaps = tuple(float(b - a) for a, b in itertools.pairwise(times))
        if sum(gaps) <= 0:
            raise UserError(f"the trace {arrival.file} has nothing to replay (one arrival, or all at one time)")
        base = trace_rate(gaps)
        if speedups:
            rates = tuple(base * s for s in (values or arrival.levels or (arrival.speedup,)))
        else:
            rates = tuple(values or tuple(base * s for s in (arrival.levels or (arrival.speedup,))))
        return tuple(Level("rate", float(r), "trace", 1.0, max_concurrency, gaps, talk) for r in rates)
    values = values or arrival.levels or ((1, 4, 16) if kind == "concurrency" else (1, 2, 4))
    process: Literal["concurrency", "poisson", "gamma"] = (
        "concurrency" if kind == "concurrency" else ("gamma" if arrival.process == "gamma" else "poisson")
    )
    return tuple(
        Level(kind, float(v), process, arrival.burstiness, max_concurrency, None, talk and kind == "rate")
        for v in values
    )


def arrival_gaps(level: Level, rng: np.random.Generator) -> Iterator[float]:
    """Seconds between consecutive sends of an open loop (Poisson, gamma with burstiness, or a trace)."""
    if level.process == "trace" and level.trace and level.speedup is not None:  # a trace has a speed-up
        scale = 1.0 / level.speedup
        between = sum(level.trace) / len(level.trace)  # from the trace's end to its start again
        while True:
            for gap in level.trace:
                yield gap * scale
            yield between * scale
    if level.process == "gamma":
        shape = level.burstiness
        scale = 1.0 / (level.value * shape)
        while True:
            yield float(rng.gamma(shape, scale))
    while True:
        yield float(rng.exponential(1.0 / level.value))


async def run_level(
    client: StreamingClient,
    requests: Iterable[RequestSpec],
    level: Level,
    *,
    num_requests: int | None,
    duration_s: float | None = None,
    warmup_requests: int = 0,
    seed: int = 0,
    on_done: Callable[[RequestRecord], None] | None = None,
    stop: Callable[[], bool] | None = None,
    stagger: bool = True,
    on_start: Callable[[float], None] | None = None,
    t0: float | None = None,
    schedule: Sequence[float] | None = None,
) -> list[RequestRecord]:
    """Run one level and return every request's record (warm-up ones flagged).

    ``on_start`` is told the level's clock origin (``time.perf_counter()``), which records' times count from.

    ``stagger`` (closed loops): the first client starts at once and the others at seeded random
    moments within the first request's duration, as real users do, rather than all together. With
    equal output lengths, clients started together stay in lock-step and every request arrives in
    a wave behind the others' prefills, which measures the waves more than the server.

    ``t0`` gives the level's clock origin (default: now) and ``schedule`` an open loop's send times, in seconds
    from ``t0``, one per request, in place of drawn gaps: a shard of a level run across client processes
    (load/shard.py) sends its share of the level's one schedule on the level's one clock.
    """
    if num_requests is None and duration_s is None:
        raise ValueError("a level needs num_requests or duration_s")
    total = None if num_requests is None else num_requests + warmup_requests
    stream = iter(requests) if total is None else iter(list(itertools.islice(requests, total)))
    records: list[RequestRecord] = []
    t0 = time.perf_counter() if t0 is None else t0
    if on_start is not None:
        on_start(t0)
    deadline = None if duration_s is None else t0 + duration_s
    ahead: list[RequestSpec] = []  # the first turn of the next conversation, read ahead

    def over() -> bool:
        if total is not None and len(records) >= total:
            return True
        if deadline is not None and time.perf_counter() >= deadline:
            return True
        return stop is not None and stop()

    def take() -> list[RequestSpec]:
        """The next request, or the next conversation's turns (empty when the stream ended)."""
        first = ahead.pop() if ahead else next(stream, None)
        if first is None:
            return []
        unit = [first]
        if first.session is not None:
            for spec in stream:
                if spec.session != first.session:
                    ahead.append(spec)
                    break
                unit.append(spec)
        return unit

    def admit(spec: RequestSpec) -> RequestRecord | None:
        if over():
            return None
        record = RequestRecord(
            index=len(records), sent=0.0, input_tokens=spec.input_tokens, max_tokens=spec.output_tokens,
            warmup=len(records) < warmup_requests, request_class=spec.request_class, session=spec.session,
            turn=spec.turn, adapter=spec.model, images=len(spec.images),
            image_pixels=sum(image.pixels for image in spec.images),
        )  # fmt: skip
        records.append(record)
        return record

    limit = asyncio.Semaphore(level.max_concurrency) if level.max_concurrency and level.kind == "rate" else None

    async def send(spec: RequestSpec, record: RequestRecord) -> None:
        if limit is None:
            await client.send(spec, record, t0)
        else:
            async with limit:
                if record.scheduled is not None:  # held by the cap on requests in flight: due from now on
                    record.scheduled = max(record.scheduled, time.perf_counter() - t0)
                await client.send(spec, record, t0)
        if on_done is not None:
            on_done(record)

    async def later_turns(unit: list[RequestSpec]) -> bool:
        """Send a conversation's turns after its first, each after its think time; False once the level is over."""
        for spec in unit[1:]:
            if over():
                return False
            if spec.think_s > 0:
                await asyncio.sleep(spec.think_s)
            record = admit(spec)
            if record is None:
                return False
            await send(spec, record)
        return True

    if level.kind == "concurrency":
        clients = max(1, int(level.value))
        first_done = asyncio.Event()
        first_took: list[float] = []
        offsets = np.random.default_rng(seed).uniform(0.0, 1.0, clients)

        async def worker(k: int) -> None:
            if stagger and k:
                await first_done.wait()
                await asyncio.sleep(float(offsets[k]) * first_took[0])
            try:
                while not over() and (unit := take()):
                    record = admit(unit[0])
                    if record is None:
                        return
                    started = time.perf_counter()
                    await send(unit[0], record)
                    if not first_done.is_set():
                        first_took.append(time.perf_counter() - started)
                        first_done.set()
                    if not await later_turns(unit):
                        return
            finally:
                if not first_done.is_set():  # nothing was sent: release the others at once
                    first_took.append(0.0)
                    first_done.set()

        await asyncio.gather(*(worker(k) for k in range(clients)))
        return records

    async def conversation(unit: list[RequestSpec], record: RequestRecord) -> None:
        await send(unit[0], record)
        await later_turns(unit)

    tasks = []
    due = None if schedule is None else iter(schedule)
    gaps = arrival_gaps(level, np.random.default_rng(seed))
    next_send = time.perf_counter() if due is None else t0 + next(due, 0.0)
    if due is not None and (delay := next_send - time.perf_counter()) > 0:
        await asyncio.sleep(delay)
    while not over() and (unit := take()):
        record = admit(unit[0])
        if record is None:
            break
        record.scheduled = next_send - t0  # its send lag tells a client that fell behind (load/pace.py)
        tasks.append(asyncio.ensure_future(conversation(unit, record)))
        if due is None:
            next_send += next(gaps)
        elif (at := next(due, None)) is not None:
            next_send = t0 + at
        else:
            break  # the schedule's last send
        delay = next_send - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
    await asyncio.gather(*tasks)
    return records
