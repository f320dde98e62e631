"""Measure load levels against one running server.

For each level: scrape ``/metrics``, run the level while sampling vLLM's gauges twice a
second (peaks of running and waiting requests and of KV-cache usage), scrape again, and
summarize. Works against any OpenAI-compatible server; ``/metrics`` is optional.

Every run of a level starts from an empty prefix cache (``POST /reset_prefix_cache``, one of
vLLM's development endpoints, which servetune's engines serve on 127.0.0.1): a later level must
not hit prefixes an earlier one cached. Where the reset is refused, or the hit rate vLLM reports
is well above what the workload's shared prefix explains, the level says so (``cache_note``; the server reads are in
trial/readings.py).

A level that has clearly broken the SLO stops early (:class:`EarlyBreak`): once half its
requests have finished, a latency percentile already twice its bound cannot come back under
it; the rest would only spend device time. The level keeps what it measured and says why it
stopped (``stopped_early``).

A level can be run several times on the same engine (``load.repeats``): it then reports its
median run, ordered by how far the run stayed inside the SLO, so its verdict is the majority's
and one stall of a shared host cannot decide it. Repeating stops early once a majority of runs
broke the SLO: more runs could not change the verdict.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final, Literal, Protocol

import aiohttp

from servetune.config.slo import Slo
from servetune.config.workload import Workload, mean_lengths
from servetune.engine.frontend import CpuReading, busiest
from servetune.engine.metrics import MetricsSnapshot, level_delta
from servetune.errors import EngineDiedError, UserError
from servetune.load.client import StreamingClient
from servetune.load.pace import LoopStalls, client_bound, client_pace, longest_stall_s, stalled_s
from servetune.load.requests import PromptFactory, RequestSpec, iter_requests
from servetune.load.runner import Level, cancel_and_wait, run_level
from servetune.load.shard import ClientSettings, ShardedRun, auto_client_processes, run_sharded
from servetune.metrics import RequestRecord
from servetune.results import MARGIN, LevelResult, LevelRun, stall_unsettled
from servetune.summary import itl_burst_share, measured_window, send_sync_share, summarize, ttft_distribution_ms
from servetune.telemetry import TelemetrySampler
from servetune.trial.readings import (
    SETTLE_LAGS,
    MetricsSource,
    cache_note,
    keep_peaks,
    read_metrics,
    report_interval_s,
    reset_prefix_cache,
    settled,
)

#: ``requests`` that sizes a level by its load (:meth:`LevelPlan.sized`).
AUTO: Final = "auto"


@dataclass(frozen=True)
class LevelPlan:
    level: Level
    num_requests: int | None
    duration_s: float | None
    warmup_requests: int

    @classmethod
    def sized(
        cls,
        level: Level,
        requests: int | Literal["auto"] | None = AUTO,
        seconds: float | None = None,
        warmup: int | None = None,
    ) -> LevelPlan:
        """A level's plan; ``requests`` "auto" sizes it by its load.

        "auto": eight requests per client in flight, or 30 s of an open loop's rate, 32 to 500,
        so that the clients' first and last waves, when fewer than all are busy, stay a small part
        of the level (48 requests at 32 in flight measured the same engine from 19.8 to 24.3 req/s
        in five runs; 256 from 23.0 to 24.5 in four of five). With ``seconds``, "auto" leaves the
        time alone to end the level. Warm-up: one request per client, at most 32.
        """
        if requests == AUTO:
            guess = 8 * level.value if level.kind == "concurrency" else 30 * level.value
            requests = None if seconds is not None else int(min(max(guess, 32), 500))
        if warmup is None:
            warmup = int(min(max(level.value, 1), 32))
        return cls(level=level, num_requests=requests, duration_s=seconds, warmup_requests=warmup)

    @property
    def open_loop_requests(self) -> int | None:
        """An open loop's measured requests as planned, the count its estimate waits for a slot over (estimate/
        queueing.py ``level_share``; a measured level's estimate counts its completed and failed ones,
        ``Load.measured``): ``num_requests``, or what its rate sends in ``duration_s`` after the warm-up, the fewer
        where both end it. None for a closed loop, whose wait is not an open queue's, and for conversations, whose
        rate counts conversations started, not requests."""
        if self.level.kind != "rate" or self.level.conversations:
            return None
        counts = [] if self.num_requests is None else [self.num_requests]
        if self.duration_s is not None:
            counts.append(max(1, round(self.level.value * self.duration_s) - self.warmup_requests))
        return min(counts) if counts else None


#: How far over its bound a percentile must be, with half the level measured, to end the level:
#: twice the bound stands far above the run-to-run spread of a level on a shared host (tens of %).
BREAK_FACTOR = 2.0


#: An open loop is saturated when vLLM's waiting queue grew through this many seconds of samples
#: (never shrinking by more than one request between two) by at least QUEUE_GROWTH requests.
QUEUE_WINDOW_S = 10.0
QUEUE_GROWTH = 8


class EarlyBreak:
    """Watches a level; :meth:`broken` once it has clearly broken, with the reason in :attr:`reason`.

    - **SLO**: at half its finished requests, a latency percentile (or mean) is ``factor`` times its
      bound. The error rate is left to the whole level. ``planned`` is the level's measured request
      count (None for a timed level, which this rule never cuts).
    - **saturation** (open loops only, where arrivals do not wait for answers): vLLM's waiting queue
      grew steadily for ``queue_window_s`` (the server is not keeping up: throughput is flat at its
      capacity and every later request only waits longer). A closed loop's queue is bounded by its
      clients, so it is not judged this way.
    """

    def __init__(self, slo: Slo, level: Level, planned: int | None, factor: float = BREAK_FACTOR,
                 queue_window_s: float = QUEUE_WINDOW_S, queue_growth: int = QUEUE_GROWTH) -> None:  # fmt: skip
        self.bounds = [b for b in slo.bounds if b.stat is not None]
        self.level = level
        self.half = None if planned is None else max(planned // 2, 8)
        self.factor = factor
        self.queue_window_s, self.queue_growth = queue_window_s, queue_growth
        self.queue: list[tuple[float, float]] = []  # (seconds, requests waiting) since the queue last shrank
        self.done: list[RequestRecord] = []
        self.reason: str | None = None

    def waiting(self, at_s: float, requests: float) -> None:
        """A sample of vLLM's waiting queue (``requests_waiting``), ``at_s`` seconds into the level."""
        if self.level.kind != "rate" or self.reason is not None:
            return
        if self.queue and requests < self.queue[-1][1] - 1:
            self.queue = []  # it shrank: the server caught up, start over
        self.queue.append((at_s, requests))
        (first_s, first), (last_s, last) = self.queue[0], self.queue[-1]
        if last_s - first_s >= self.queue_window_s and last - first >= self.queue_growth:
            self.reason = (f"saturated: vLLM's waiting queue grew from {first:g} to {last:g} requests over "
                           f"{last_s - first_s:.0f} s: stopped early")  # fmt: skip

    def finished(self, record: RequestRecord) -> None:
        if record.warmup or self.reason is not None or self.half is None or not self.bounds:
            return
        self.done.append(record)
        if len(self.done) != self.half:
            return  # judged once, at half the level: one summary, no load on the client while it drives
        flat = summarize(self.done, self.level.as_dict(), saturation=False).flat()
        for bound in self.bounds:
            value = flat.get(bound.name)
            if bound.lower:  # a floor (structured_valid) has no "far over it" to stop early on
                continue
            if value is not None and value >= self.factor * bound.limit:
                self.reason = (f"{bound.name} = {value:.4g} after {len(self.done)} requests, over "
                               f"{self.factor:g}x its bound {bound.limit:g}: stopped early")  # fmt: skip
                return

    def broken(self) -> bool:
        return self.reason is not None


async def _sample_gauges(read: Callable[[bool], Awaitable[MetricsSnapshot | None]], peaks: dict[str, float], every_s: float,
                         watch: EarlyBreak | None = None) -> None:  # fmt: skip
    start = time.perf_counter()
    while True:
        snap = await read(True)
        if snap is not None:
            keep_peaks(peaks, snap)
            if watch is not None and "requests_waiting" in snap.gauges:
                watch.waiting(time.perf_counter() - start, snap.gauges["requests_waiting"])
        await asyncio.sleep(every_s)


async def measure_level(
    client: StreamingClient,
    url: str,
    workload: Workload,
    prompts: PromptFactory,
    plan: LevelPlan,
    *,
    stream: int,
    slo: Slo,
    on_done: Callable[[RequestRecord], None] | None = None,
    sample_every_s: float = 0.5,
    telemetry: Callable[[], TelemetrySampler] | None = None,
    watch: EarlyBreak | None = None,
    reset_cache: Callable[[], bool] | None = None,
    metrics: MetricsSource | None = None,
    client_processes: int | Literal["auto"] = 1,
    client_cpus: int = 1,
    frontend_cpu: Callable[[], CpuReading | None] | None = None,
    stall_tolerance: float = MARGIN,
) -> tuple[LevelResult, list[RequestRecord]]:
    """Run one level and return its result and the per-request records.

    ``telemetry`` makes a sampler of the devices (or host) that runs while the level does.
    ``reset_cache`` empties the prefix cache before it where ``POST /reset_prefix_cache`` cannot
    (Ray Serve's ingress has no such endpoint: its replicas are reset through Serve).
    ``metrics`` reads the server's metrics where ``{url}/metrics`` cannot (Serve's ingress has none);
    its gauges are then sampled every half of its lag, and the level's closing read waits (at most
    its lag) until the source has counted the level's finished requests; that read's gauges, the level's
    last moments as the source saw them late, count toward the peaks.
    ``client_processes`` (``load.client_processes``) splits the level's load across that many client processes
    (load/shard.py; "auto": :func:`~servetune.load.shard.auto_client_processes` at most ``client_cpus``).
    ``frontend_cpu`` reads the CPU seconds of the server's front end (``VllmServer.frontend_cpu``: vLLM's API
    server; ``ServeEngine.frontend_cpu``: Serve's proxy and the application's replicas), at the level's start and its
    end: the level's ``frontend_cpu_share`` and ``frontend_process`` (None without it).
    The load client's own stalls (load/pace.py ``LoopStalls``) are recorded over the level (``client_stall_ms_max``,
    ``client_stalled_s``; a level split across client processes takes its shards' together: the longest of any, the
    seconds any of them stalled in), and a level
    that broke the SLO beyond ``stall_tolerance`` (what its verdict forgives: the noise of a level run once) by a
    margin the longest stall accounts for says so in ``client_stalled`` (results ``stall_unsettled``): its verdict
    is unsettled.
    """
    drawn: list[RequestSpec] = []

    def requests():  # the level's requests, kept to tell what its prompts reuse
        for spec in iter_requests(workload, prompts, stream=stream):
            drawn.append(spec)
            yield spec

    watch = watch if watch is not None else EarlyBreak(slo, plan.level, plan.num_requests)

    def done(record: RequestRecord) -> None:
        watch.finished(record)
        if on_done is not None:
            on_done(record)

    async with aiohttp.ClientSession() as session:

        async def read(gauges_only: bool = False) -> MetricsSnapshot | None:
            return await read_metrics(session, url, metrics, gauges_only)

        reset = (
            await asyncio.to_thread(reset_cache) if reset_cache is not None else await reset_prefix_cache(session, url)
        )
        before = await read()
        if before is None and metrics is not None:
            before = MetricsSnapshot()  # fresh replicas report a counter once it counts: none yet is zero
        peaks: dict[str, float] = {}
        every_s = max(sample_every_s, metrics.lag_s / 2) if metrics is not None else sample_every_s
        sampler = asyncio.ensure_future(_sample_gauges(read, peaks, every_s, watch)) if before else None
        devices = telemetry() if telemetry is not None else contextlib.nullcontext()
        origin: list[float] = []  # the level's clock origin, in time.perf_counter() seconds
        cpu_at = time.process_time()  # the client process's CPU over the level (load/pace.py)
        frontend_at = frontend_cpu() if frontend_cpu is not None else None  # the API server's (engine/frontend.py)
        sharded: ShardedRun | None = None
        stalls = LoopStalls()  # the client's own stalls, which a miss's verdict tells from the server's answers
        try:
            processes = client_shards(workload, plan, client_processes, client_cpus)
            with devices:
                if processes > 1:
                    specs = list(itertools.islice(requests(), plan.num_requests + plan.warmup_requests))  # type: ignore[operator]
                    sharded = await run_sharded(
                        ClientSettings.of(client), specs, plan.level, processes, duration_s=plan.duration_s,
                        warmup_requests=plan.warmup_requests, seed=workload.seed + stream, on_done=done,
                        stop=watch.broken, on_start=origin.append,
                    )  # fmt: skip
                    records = sharded.records
                else:
                    async with stalls:
                        records = await run_level(
                            client, requests(), plan.level, num_requests=plan.num_requests,
                            duration_s=plan.duration_s, warmup_requests=plan.warmup_requests,
                            seed=workload.seed + stream, on_done=done, stop=watch.broken, on_start=origin.append,
                        )  # fmt: skip
            cpu_s = time.process_time() - cpu_at
            frontend = busiest(frontend_at, frontend_cpu() if frontend_cpu is not None else None)
            wall_s = time.perf_counter() - origin[0] if origin else None
        finally:
            if sampler is not None:
                await cancel_and_wait(sampler)
        if before and metrics is not None:  # the source lags: wait until it has counted the level's requests
            after = await settled(read, before, sum(r.ok for r in records), metrics.lag_s * SETTLE_LAGS,
                                  every_s=report_interval_s(metrics), peaks=peaks)  # fmt: skip
        else:
            after = await read() if before else None
    server = {**level_delta(before, after), **peaks} if before and after else {}
    summary = summarize(records, plan.level.as_dict(), slo.request_bounds_ms() or None)
    measured: dict[str, float] = {}
    energy_note = None
    if isinstance(devices, TelemetrySampler):
        # The energy of the measured window alone (the summary's: first measured send -> last measured end),
        # so it is divided by the measured requests' tokens; the warm-up's is left out.
        window = measured_window(records)
        measured = devices.summary(
            None if window is None or not origin else (origin[0] + window[0], origin[0] + window[1])
        )
        energy_note = devices.energy_note
    pace = client_pace(records, cpu_s, wall_s) if sharded is None else sharded.pace
    spans = stalls.spans if sharded is None else sharded.stall_spans
    bound = client_bound(pace) if sharded is None else sharded.client_bound
    mean_prompt = summary.total_input_tokens / summary.completed if summary.completed else 0.0
    reused = None
    if workload.sessions is not None and drawn:
        reused = sum(s.reused_tokens for s in drawn) / max(sum(s.input_tokens for s in drawn), 1)
    result = LevelResult(
        summary=summary, server_metrics=server, telemetry=measured, slo_violations=slo.violations(summary),
        cache_note=cache_note(server, workload, mean_prompt, reset, reused), stopped_early=watch.reason,
        send_sync_share=send_sync_share(records), itl_burst_share=itl_burst_share(records),
        ttft_ms_distribution=ttft_distribution_ms(records), energy_note=energy_note,
        client_cpu_share=pace.cpu_share, send_lag_ms_p50=pace.send_lag_ms_p50, send_lag_ms_p99=pace.send_lag_ms_p99,
        client_bound=bound, frontend_cpu_share=frontend[0] if frontend else None,
        frontend_process=frontend[1] if frontend else None,
        client_stall_ms_max=longest_stall_s(spans) * 1000.0, client_stalled_s=stalled_s(spans),
    )  # fmt: skip
    result.client_stalled = stall_unsettled(result, slo, stall_tolerance)
    return result, records


def client_shards(
    workload: Workload, plan: LevelPlan, processes: int | Literal["auto"], cpus: int,
    setting: str = "load.client_processes",
) -> int:  # fmt: skip
    """The client processes a level runs on (``load.client_processes``). "auto" gives 1 where a level cannot be
    split (conversations, a level bounded by time alone); a number above 1 there is the user's to change (the
    error names ``setting``: where the user set it)."""
    splittable = workload.sessions is None and plan.num_requests is not None
    if processes == "auto":
        return auto_client_processes(plan.level, mean_lengths(workload)[1], cpus) if splittable else 1
    if processes > 1 and not splittable:
        why = "conversations (workload.sessions)" if workload.sessions is not None else "a level bounded by time alone"
        raise UserError(f"{setting}: {processes} cannot split {why}; set it to 1")
    return processes


def run_stream(level_index: int, run: int, repeats: int) -> int:
    """The prompt stream of one run of a level: its own for every run, and ``level_index + 1``
    when levels run once (the numbering from before repeats, so such runs draw the same prompts)."""
    return 1 + level_index * repeats + run


def record_tags(level_index: int, run: int, repeats: int) -> dict[str, int]:
    """What a per-request record says of where it was measured (its run only when levels repeat)."""
    return {"level": level_index, "repeat": run} if repeats > 1 else {"level": level_index}


def slo_standing(result: LevelResult, slo: Slo) -> tuple[bool, float, float]:
    """How a run stands against the SLO, best first: meeting it, then its worst relative slack
    over the bounds (a metric it lacks counts as infinitely over), then more goodput (requests
    per second where the SLO sets no per-request bound)."""
    flat = result.summary.flat()
    worst = max((b.slack(flat[b.name]) if b.name in flat else math.inf for b in slo.bounds), default=0.0)
    summary = result.summary
    served = summary.goodput if summary.goodput is not None else summary.request_throughput
    return not result.meets_slo, worst, -served


def median_run(runs: list[LevelResult], slo: Slo) -> LevelResult:
    """The run a repeated level reports, with every run kept in ``runs``.

    Runs are ordered by :func:`slo_standing`; the median is the middle one (of an even count,
    the worse of the two middle ones). So the level meets the SLO only if most runs did.
    """
    if len(runs) == 1:
        return runs[0]
    chosen = sorted(runs, key=lambda run: slo_standing(run, slo))[len(runs) // 2]
    kept = [LevelRun(summary=run.summary, slo_violations=run.slo_violations) for run in runs]
    return chosen.model_copy(update={"runs": kept})


class Engine(Protocol):
    """What measuring needs of the server it measures (``engine.server.VllmServer`` is one)."""

    def alive(self) -> bool: ...

    def failure_reason(self) -> str: ...

    def log_tail(self, lines: int = 40) -> str: ...


async def measure_rung(
    client: StreamingClient, url: str, workload: Workload, prompts: PromptFactory, plan: LevelPlan, index: int, *,
    repeats: int, slo: Slo, record: Callable[[dict], None], engine: Engine | None = None,
    telemetry: Callable[[], TelemetrySampler] | None = None, on_done: Callable[[RequestRecord], None] | None = None,
    on_run: Callable[[int], None] | None = None, client_processes: int | Literal["auto"] = 1, client_cpus: int = 1,
) -> LevelResult:  # fmt: skip
    """One rung of a ladder, the one path ``servetune run`` trials and ``servetune bench`` both take.

    Runs the level ``repeats`` times (:func:`measure_repeated`), each run on its own prompt stream,
    hands every request's record to ``record`` tagged with where it was measured, and reports the
    median run. ``on_run(run)`` is called before each run; ``engine`` (when servetune started the
    server) ends the repeats once it is gone: :func:`check_alive` then says so, after the caller kept the result.
    """

    async def once(run: int) -> tuple[LevelResult, list[RequestRecord]]:
        if on_run is not None:
            on_run(run)
        result, records = await measure_level(
            client, url, workload, prompts, plan, stream=run_stream(index, run, repeats), slo=slo,
            on_done=on_done, telemetry=telemetry, reset_cache=getattr(engine, "reset_prefix_cache", None),
            metrics=getattr(engine, "server_metrics", None), client_processes=client_processes, client_cpus=client_cpus,
            frontend_cpu=getattr(engine, "frontend_cpu", None),
        )  # fmt: skip
        tags = record_tags(index, run, repeats)
        for request in records:
            record({**tags, **request.to_dict()})
        return result, records

    gone = (lambda: not engine.alive()) if engine is not None else (lambda: False)
    result, _ = await measure_repeated(once, repeats, slo, gone=gone)
    return result


#: How long a level whose requests failed waits for a dying engine to be seen gone (see :func:`check_alive`).
DEATH_SETTLE_S = 2.0


def check_alive(
    engine: Engine | None, level: Level, failed_requests: int = 0, settle_s: float = DEATH_SETTLE_S
) -> None:
    """Raise :class:`EngineDiedError`, with the engine log's tail, when the engine died during ``level``.

    A killed engine closes its sockets before its process is gone: requests sent in between fail at once
    (connection refused), and a whole level of them can end while the process still reads as alive (seen in
    CI: a bench level of 8 requests failed within milliseconds and the engine was taken for alive, so the
    run ended as 'every request failed' instead of 'the engine died'). So after a level with failed
    requests the engine's liveness is read again for up to ``settle_s`` before it counts as alive."""
    if engine is None:
        return
    deadline = time.monotonic() + (settle_s if failed_requests else 0.0)
    while engine.alive():
        if time.monotonic() >= deadline:
            return
        time.sleep(0.05)
    raise EngineDiedError(f"the engine died during {level} ({engine.failure_reason()})", engine.log_tail())


async def measure_repeated(
    measure_once: Callable[[int], Awaitable[tuple[LevelResult, list[RequestRecord]]]],
    repeats: int,
    slo: Slo,
    gone: Callable[[], bool] = lambda: False,
) -> tuple[LevelResult, list[list[RequestRecord]]]:
    """Run a level up to ``repeats`` times (``measure_once(run_index)``) and report its median run.

    Returns the level's result and each run's records. Stops once the median run must break
    the SLO (half the runs, rounded up, broke it), or when ``gone()`` says the server is.
    """
    runs: list[LevelResult] = []
    records: list[list[RequestRecord]] = []
    decided = (repeats + 1) // 2
    for index in range(repeats):
        result, run_records = await measure_once(index)
        runs.append(result)
        records.append(run_records)
        if sum(not run.meets_slo for run in runs) >= decided or gone():
            break
    return median_run(runs, slo), records
