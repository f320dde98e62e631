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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np

from servetune.load.client import StreamingClient
from servetune.load.requests import RequestSpec
from servetune.metrics import RequestRecord


@dataclass(frozen=True)
class Level:
    """One rung of the load ladder."""

    kind: Literal["concurrency", "rate"]
    value: float
    process: Literal["concurrency", "poisson", "gamma"] = "concurrency"
    burstiness: float = 1.0
    max_concurrency: int | None = None  # cap on requests in flight for open loops

    def as_dict(self) -> dict[str, float]:
        return {self.kind: self.value}

    def __str__(self) -> str:
        return f"concurrency {self.value:g}" if self.kind == "concurrency" else f"rate {self.value:g} req/s"


def arrival_gaps(level: Level, rng: np.random.Generator) -> Iterator[float]:
    """Seconds between consecutive sends of an open loop (Poisson, or gamma with burstiness)."""
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
) -> list[RequestRecord]:
    """Run one level and return every request's record (warm-up ones flagged).

    ``stagger`` (closed loops): the first client starts at once and the others at seeded random
    moments within the first request's duration, as real users do, rather than all together. With
    equal output lengths, clients started together stay in lock-step and every request arrives in
    a wave behind the others' prefills, which measures the waves more than the server.
    """
    if num_requests is None and duration_s is None:
        raise ValueError("a level needs num_requests or duration_s")
    total = None if num_requests is None else num_requests + warmup_requests
    stream = iter(requests) if total is None else iter(list(itertools.islice(requests, total)))
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    deadline = None if duration_s is None else t0 + duration_s

    def next_record() -> tuple[RequestSpec, RequestRecord] | None:
        if total is not None and len(records) >= total:
            return None
        if deadline is not None and time.perf_counter() >= deadline:
            return None
        if stop is not None and stop():
            return None
        spec = next(stream, None)
        if spec is None:
            return None
        record = RequestRecord(
            index=len(records), sent=0.0, input_tokens=spec.input_tokens, max_tokens=spec.output_tokens,
            warmup=len(records) < warmup_requests, request_class=spec.request_class,
        )  # fmt: skip
        records.append(record)
        return spec, record

    async def send(spec: RequestSpec, record: RequestRecord) -> None:
        await client.send(spec, record, t0)
        if on_done is not None:
            on_done(record)

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
                while (item := next_record()) is not None:
                    started = time.perf_counter()
                    await send(*item)
                    if not first_done.is_set():
                        first_took.append(time.perf_counter() - started)
                        first_done.set()
            finally:
                if not first_done.is_set():  # nothing was sent: release the others at once
                    first_took.append(0.0)
                    first_done.set()

        await asyncio.gather(*(worker(k) for k in range(clients)))
        return records

    limit = asyncio.Semaphore(level.max_concurrency) if level.max_concurrency else None

    async def limited(spec: RequestSpec, record: RequestRecord) -> None:
        if limit is None:
            return await send(spec, record)
        async with limit:
            return await send(spec, record)

    tasks = []
    gaps = arrival_gaps(level, np.random.default_rng(seed))
    next_send = time.perf_counter()
    while (item := next_record()) is not None:
        tasks.append(asyncio.ensure_future(limited(*item)))
        next_send += next(gaps)
        delay = next_send - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
    await asyncio.gather(*tasks)
    return records
