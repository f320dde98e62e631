"""A measured load level: the client's summary, the server's counters, the SLO verdict and how much a repeat could
differ; the document ``servetune bench --json`` writes."""

from __future__ import annotations

import statistics
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from servetune.config.slo import Slo
from servetune.summary import LevelSummary

#: Results are records servetune writes and reads back, often with another version: a field this
#: version does not know (a newer servetune wrote it) is ignored rather than refused.
RECORD = ConfigDict(extra="ignore")


class LevelRun(BaseModel):
    """One run of a repeated level (``load.repeats``): what the client measured and its verdict."""

    model_config = RECORD

    summary: LevelSummary
    slo_violations: list[str] = []


class LevelEstimate(BaseModel):
    """The estimate of one measured level (servetune.estimate at the level's load, with the request lengths
    it served and the factors the trial was given) beside its relative error against the measurement."""

    model_config = RECORD

    ttft_ms: float | None = None  # mean TTFT; None: the model calls the load a queue without bound
    tpot_ms: float
    output_throughput: float
    error: dict[str, float] = {}  # metric -> predicted / measured - 1 (ttft_ms and tpot_ms against their means)


class LevelResult(BaseModel):
    """One load level: the client's summary, the server's own counters, and the SLO verdict.

    A repeated level reports its median run (trial/measure.py ``median_run``) and keeps every
    run, the reported one included, in ``runs``; a level run once has no ``runs``.
    """

    model_config = RECORD

    summary: LevelSummary
    server_metrics: dict[str, float] = {}
    telemetry: dict[str, float] = {}  # device (or host) samples during the level: see telemetry.py
    slo_violations: list[str] = []
    cache_note: str | None = None  # why the prefix cache may have been warm (trial/readings.py), else None
    stopped_early: str | None = None  # why the level ended before its planned requests (trial/measure.py)
    send_sync_share: float | None = None  # share of requests sent within 10 ms of another (summary.send_sync_share)
    itl_burst_share: float | None = None  # share of token gaps under 1 ms: read in bursts (summary.itl_burst_share)
    ttft_ms_distribution: list[float] | None = None  # TTFT at percentiles 0, 5, ..., 100 (summary.ttft_distribution_ms)
    energy_note: str | None = None  # why an energy of the measured window is missing (telemetry.py), else None
    client_cpu_share: float | None = None  # the client process's CPU seconds over the level's wall time (load/pace.py)
    send_lag_ms_p50: float | None = None  # an open loop's: how late its requests went out, median (load/pace.py)
    send_lag_ms_p99: float | None = None  # and its P99
    client_bound: str | None = None  # why the client may have fallen behind (load/pace.py): no SLO verdict then
    #: The load client's own stalls over the level (load/pace.py ``LoopStalls``: its event loop woke late by over
    #: 50 ms): the longest, in ms, and the seconds it stalled in, in s; a level split across client processes records
    #: its shards' together: the longest of any, and the union of their stalls (None: not recorded).
    client_stall_ms_max: float | None = None
    client_stalled_s: float | None = None
    #: Why the level's SLO verdict is unsettled: it broke the SLO by a margin the client's longest stall accounts
    #: for (:func:`stall_unsettled`); None where it met the SLO, no stall was recorded, or the miss is beyond it.
    client_stalled: str | None = None
    #: The front end's CPU: the busiest front-end process's CPU seconds over the level / its seconds (1.0: a full
    #: core; engine/frontend.py): vLLM's API servers for a bare engine; for a Serve trial the proxy the load went
    #: through, the ingress and the LLM replicas, on whichever node (serve/frontend.py). None where servetune did not
    #: start the server (bench --url) or cannot read its processes.
    frontend_cpu_share: float | None = None
    #: Which process that was, for a Serve trial: ``proxy``, ``ingress`` or ``replica`` (Serve LLM's server with
    #: vLLM's engine client); None for a bare engine (its API server) and where no share was read.
    frontend_process: str | None = Field(default=None, exclude_if=lambda role: role is None)
    runs: list[LevelRun] = Field(default=[], exclude_if=lambda runs: not runs)  # absent when run once
    estimate: LevelEstimate | None = None  # what the estimate predicted for this level (trial/estimated.py)

    @property
    def meets_slo(self) -> bool:
        return not self.slo_violations

    @property
    def measured_s(self) -> float:
        """Seconds spent measuring this level, every run counted."""
        return sum(run.summary.duration_s for run in self.runs) if self.runs else self.summary.duration_s


def stall_unsettled(level: LevelResult, slo: Slo, tolerance: float) -> str | None:
    """Why ``level``'s SLO miss is unsettled, or None: it broke a bound beyond ``tolerance`` (what the verdict
    forgives anyway: the noise of a level run once, config/slo.py ``noise_breaks``) and, once the load client's longest
    stall is taken off its latencies, none beyond it. The stall alone could then have made the miss: the client's
    process was not running (a host short of cores), its answers waited to be read, so the verdict says nothing of
    the server. A miss the stall does not account for, or no stall, is None (the verdict stands)."""
    stall = level.client_stall_ms_max
    if not stall or level.meets_slo or level.summary.completed == 0:
        return None
    beyond, off = slo.noise_breaks(level.summary, tolerance), slo.noise_breaks(level.summary, tolerance, stall)
    if not beyond.beyond or off.beyond:
        return None
    stalled = f" ({level.client_stalled_s:.3g} s in all)" if level.client_stalled_s else ""
    return (f"the load client stalled for up to {stall:.4g} ms{stalled}, which accounts for the SLO miss "
            f"({'; '.join(level.slo_violations)})" + (f" within the noise ({tolerance:.0%})" if tolerance else ""))  # fmt: skip


#: How much a level run once could differ on a repeat: five runs of one configuration at 32 in
#: flight on a two-core host (256 requests each) measured 23.0 to 27.7 req/s, about 10% either
#: side of the median (bench/README.md, "Results on data/cpu-tiny-grid-r4.json").
MARGIN = 0.10
#: The least margin, however close a level's repeats came.
MIN_MARGIN = 0.05


def noise_margin(level: LevelResult) -> float:
    """How much a repeat of this level could differ: half the spread of its runs' throughput and
    P99 TTFT relative to their median (``load.repeats``), at least MIN_MARGIN; MARGIN when run once."""
    if len(level.runs) < 2:
        return MARGIN
    ttft = _half_spread([r.summary.ttft_ms.p99 for r in level.runs])
    return max(throughput_noise(level), ttft if ttft is not None else MIN_MARGIN)


def throughput_noise(level: LevelResult) -> float:
    """How much a repeat of this level's output throughput could differ (so its cost per token: the cost
    is the devices' price over it): half its runs' spread relative to their median, at least
    MIN_MARGIN; MARGIN when run once. A P99 TTFT spreads far more between repeats than throughput
    (tens of percent on a shared host), and does not move the cost."""
    if len(level.runs) < 2:
        return MARGIN
    return max(MIN_MARGIN, _half_spread([r.summary.output_throughput for r in level.runs]) or 0.0)


def _half_spread(values: list[float | None]) -> float | None:
    """Half the spread of the values relative to their median; None without a positive median."""
    known = [v for v in values if v is not None]
    middle = statistics.median(known) if known else 0.0
    return (max(known) - min(known)) / (2 * middle) if middle > 0 else None


class KvCapacityReport(BaseModel):
    """What vLLM's start-up log said of its memory: the KV cache and, where logged (GPU), the GiB it had for
    it and the GiB the weights took (one engine's numbers; ``engines`` of them)."""

    model_config = RECORD

    tokens: int
    max_concurrency: float | None = None
    at_tokens_per_request: int | None = None
    engines: int = 1
    available_kv_gib: float | None = None
    model_load_gib: float | None = None
    planned_tokens: int | None = None  # what the capacity planner predicted for this engine (a trial's; None: none)


class ClaimedCores(BaseModel):
    """What a record of the CPU build says of the cores its engine ran on (engine/cores.py ``cores_words`` words it):
    a bare engine's, a trial's (trial/runner.py ``cores_record``), or through Serve its LLM replicas' engines'
    (serve/claims.py ``running_cores``). None of either: a GPU, or nothing told. A record inherits it beside
    ``BaseModel`` (``class Run(ClaimedCores, BaseModel)``), which tells ruff (RUF012) that it is a pydantic model."""

    cpu_binding: str | None = None  # the cores its ranks were bound to (VLLM_CPU_OMP_THREADS_BIND)
    cpu_unclaimed: str | None = None  # ... and why it claimed none of its own (other engines held them)


class BenchResult(ClaimedCores, BaseModel):
    """The JSON document ``servetune bench --json`` writes."""

    model_config = RECORD

    servetune_version: str
    created: str
    url: str
    model: str
    served_model_name: str
    engine_args: dict[str, Any]
    env: dict[str, str]
    command: list[str] | None
    vllm_version: str | None
    workload_file: str | None
    workload: dict[str, Any]
    slo: list[str]
    num_requests: int | None
    duration_s: float | None
    repeats: int = 1  # runs asked of each level (a level whose majority broke the SLO stops early)
    kv_capacity: KvCapacityReport | None
    startup_s: float | None
    levels: list[LevelResult]
    requests_file: str | None = None
    client_processes: int | Literal["auto"] = 1  # --client-processes: the load client split across processes


def level_load(level: LevelResult) -> float:
    """The load a level was measured at (its clients or its rate), as the capacity search names loads."""
    return max(level.summary.level.values(), default=0.0)


def by_load(levels: list[LevelResult]) -> dict[float, LevelResult]:
    """Each load's last measurement (the capacity search may measure a load twice)."""
    return {level_load(level): level for level in levels}


def level_throughput(level: LevelResult) -> float:
    """A level's output tok/s with every client busy (closed loop), else over the whole level."""
    return level.summary.steady_output_throughput


def highest_load_index(levels: list[LevelResult]) -> int | None:
    """The level measured at the highest load (levels run in the order measured: the capacity search
    may go on below the ladder's top, so the last level is not always the highest)."""
    if not levels:
        return None
    return max(range(len(levels)), key=lambda i: level_load(levels[i]))
