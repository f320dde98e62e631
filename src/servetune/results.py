"""Typed results that measurement writes and tracking/reports read (no imports of trial/)."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from servetune.capacity.prices import DevicePrice
from servetune.config.slo import SloBound
from servetune.errors import UserError
from servetune.metrics import (
    COST_METRIC,
    ENERGY_PER_REQUEST,
    ENERGY_PER_TOKEN,
    MEASURED_ENERGY,
    LevelSummary,
    cost_per_mtok_usd,
    energy_per,
)

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
    cache_note: str | None = None  # why the prefix cache may have been warm (trial/measure.py), else None
    stopped_early: str | None = None  # why the level ended before its planned requests (trial/measure.py)
    send_sync_share: float | None = None  # share of requests sent within 10 ms of another (metrics.send_sync_share)
    itl_burst_share: float | None = None  # share of token gaps under 1 ms: read in bursts (metrics.itl_burst_share)
    ttft_ms_distribution: list[float] | None = None  # TTFT at percentiles 0, 5, ..., 100 (metrics.ttft_distribution_ms)
    energy_note: str | None = None  # why an energy of the measured window is missing (telemetry.py), else None
    client_cpu_share: float | None = None  # the client process's CPU seconds over the level's wall time (load/pace.py)
    send_lag_ms_p50: float | None = None  # an open loop's: how late its requests went out, median (load/pace.py)
    send_lag_ms_p99: float | None = None  # and its P99
    client_bound: str | None = None  # why the client may have fallen behind (load/pace.py): no SLO verdict then
    runs: list[LevelRun] = Field(default=[], exclude_if=lambda runs: not runs)  # absent when run once
    estimate: LevelEstimate | None = None  # what the estimate predicted for this level (trial/estimated.py)

    @property
    def meets_slo(self) -> bool:
        return not self.slo_violations

    @property
    def measured_s(self) -> float:
        """Seconds spent measuring this level, every run counted."""
        return sum(run.summary.duration_s for run in self.runs) if self.runs else self.summary.duration_s


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


class BenchResult(BaseModel):
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
    cpu_binding: str | None = None  # the CPU build: the cores its ranks were bound to (VLLM_CPU_OMP_THREADS_BIND)


#: PRUNED: the study skipped the trial before any engine started, because the estimate ruled it out beyond its
#: expected error (:class:`Pruned` says with which numbers); ``run --resume --unprune`` runs it.
Outcome = Literal["COMPLETE", "INFEASIBLE", "FAILED", "PRUNED"]
#: Every outcome, in the order reports count them.
OUTCOMES: tuple[Outcome, ...] = ("COMPLETE", "INFEASIBLE", "FAILED", "PRUNED")


class PrunedLevel(BaseModel):
    """One ladder level of a pruned trial: the estimate there, its optimistic end, and the SLO bound it missed."""

    model_config = RECORD

    level: dict[str, float]  # {"concurrency": 8} or {"rate": 2.0}
    ttft_ms: float | None  # the estimate (mean); None: a queue without bound
    tpot_ms: float
    output_throughput: float
    optimistic: dict[str, float]  # metric -> the estimate widened by its error toward the trial's favour
    missed: str | None = None  # the SLO bound even the optimistic estimate breaks, "ttft_ms_p99 <= 2000: 2,510 ms"


class Pruned(BaseModel):
    """Why the study skipped a trial (study/prune.py): the estimate, the error margin it was widened by, and the SLO
    bound it missed at every level (``rule`` "slo") or the finished trial that dominates it (``rule`` "dominated")."""

    model_config = RECORD

    rule: Literal["slo", "dominated"]
    error_margin: dict[str, float]  # metric -> the relative error the estimate was widened by
    error_source: str  # where the margin came from: the shipped fit's held-out error, or the study's own
    factors: str  # the factors the estimate was made with: "shipped" or "refit"
    levels: list[PrunedLevel]
    dominated_by: str | None = None  # the trial whose measured point dominates it
    dominating: dict[str, float] = {}  # that point's cost_per_mtok_usd and ttft_ms_p99
    optimistic_point: dict[str, float] = {}  # this trial's best case over its levels: cost, TTFT (mean)


class OperatingPoint(BaseModel):
    """One (trial, load level): what Pareto fronts are drawn over."""

    model_config = RECORD

    trial_id: str
    level_index: int
    level: dict[str, float]
    config: dict[str, Any]  # the trial's varied parameters
    devices: int  # GPUs the trial reserved (CPU cores on the CPU stand-in)
    metrics: dict[str, float]  # LevelSummary.flat() plus cost_per_mtok_usd
    meets_slo: bool


class CapacityReport(BaseModel):
    """What the capacity planner predicted for a trial (before any launch).

    ``planned`` False: the ledger cannot size this configuration (``reason`` says why, "not planned: ...");
    the trial starts anyway (``fits`` True) and its ``kv_capacity`` holds vLLM's own numbers."""

    model_config = RECORD

    fits: bool
    reason: str
    planned: bool = True
    kv_cache_tokens: int | None = None
    kv_cache_gib: float | None = None
    max_concurrency: float | None = None
    advice: list[str] = []
    profile: str | None = None  # the vLLM memory profile planned with (capacity/profile.py); None before it was kept


class Capacity(BaseModel):
    """The load a configuration carries while meeting its SLO, as the capacity search found it on
    the trial's engine (trial/capacity.py). Not the memory ledger's prediction (:class:`CapacityReport`).

    ``bracket`` is [the highest load that met the SLO, the lowest that broke it] among those measured;
    ``value`` is its first end. ``bound`` says which ends are known: "exact" (both: the capacity lies
    between them, within ``tolerance`` unless the budget or ``ended`` says otherwise), "lower" (no load
    measured broke the SLO: capacity >= value), "upper" (none met it: capacity < the second end).
    """

    model_config = RECORD

    value: float | None  # the highest load known to meet the SLO; None when none did
    unit: Literal["concurrency", "req/s", "conversations/s"]
    bracket: tuple[float | None, float | None]  # [meets the SLO, breaks it]
    bound: Literal["exact", "lower", "upper"]
    tolerance: float  # the search stops once bracket[1] / bracket[0] - 1 is at most this
    # How far each end of the bracket stood from the SLO: ``value / bound - 1`` of its worst metric in its
    # worst measurement (below 0 inside the SLO; None for an end not measured or with no finite margin).
    slo_margins: tuple[float | None, float | None] = (None, None)
    # How much a repeat of the bracket's ends could differ (results.noise_margin, the largest of theirs):
    # a verdict whose SLO margin is within it is unsettled (trial/capacity.py).
    verdict_noise: float | None = None
    # The SLO bound the breaking end came nearest to or went furthest over, as ``str(SloBound)``
    # ("ttft_ms_p99 <= 2000"); None when it broke none (an open loop that fell behind its rate).
    breaking_slo: str | None = None
    extra_levels: int = 0  # levels measured beyond the ladder (repeats included)
    unsettled: list[float] = []  # loads whose verdict stayed within the noise, counted as breaking the SLO
    ended: str | None = None  # why the search ended, in words


#: The knee's rule: throughput gains per load increase below this share of proportional growth.
KNEE_FRACTION = 0.5


class Knee(BaseModel):
    """Where throughput stops growing with load, from the levels a trial measured (the ladder and the capacity
    search: :func:`find_knee`): ``bracket`` is [the knee, the next load measured above it]. The capacity search
    (trial/capacity.py) bisects that bracket with what is left of its budget where the knee lies below the
    capacity; ``extra_levels`` is what that took and ``ended`` why it stopped (both 0/None for a knee read
    from levels alone, as in results before it).

    ``value`` is the lowest load past which output throughput grew by less than ``fraction`` of proportional
    growth (``(t2 / t1 - 1) / (x2 / x1 - 1) < fraction`` between consecutive loads x1 < x2); ``bound`` is
    "exact" there, and "lower" when throughput kept growing up to the highest load measured (the knee lies at
    or beyond it: ``bracket`` [that load, None]).
    """

    model_config = RECORD

    value: float
    unit: Literal["concurrency", "req/s", "conversations/s"]
    bracket: tuple[float, float | None]
    bound: Literal["exact", "lower"]
    throughput: float  # output tok/s measured at ``value`` (with every client busy, for a closed loop)
    fraction: float = KNEE_FRACTION
    # How far a repeat could move the throughput gain of the step that decided the knee (``value`` to ``bracket[1]``):
    # :func:`slope_noise` of the two loads' throughput noise; the decision is within the noise when the gain lies
    # within it of ``fraction`` (None: a lower bound, no step decided it).
    slope_noise: float | None = None
    gain: float | None = None  # that step's gain, ``(t2 / t1 - 1) / (x2 / x1 - 1)``
    extra_levels: int = 0  # levels the capacity search measured to bisect the knee (within its budget)
    tolerance: float | None = None  # the bisection stops once bracket[1] / bracket[0] - 1 is at most this
    ended: str | None = None  # why the knee's bisection ended (or was not run), in words


def level_throughput(level: LevelResult) -> float:
    """A level's output tok/s with every client busy (closed loop), else over the whole level."""
    summary = level.summary
    return summary.busy_output_throughput if summary.busy_output_throughput is not None else summary.output_throughput


def slope_noise(ratio: float, throughput_ratio: float, noise_1: float, noise_2: float) -> float:
    """How far a repeat could move the throughput gain ``(t2 / t1 - 1) / (x2 / x1 - 1)`` between two loads whose
    throughput could each differ by ``noise_1``, ``noise_2`` (relative: :func:`throughput_noise`), with
    ``ratio`` = x2 / x1 and ``throughput_ratio`` = t2 / t1: ``t2 / t1 x (n1 + n2) / (x2 / x1 - 1)``. A narrow step
    magnifies it: at 10% noise each, a 4x step's gain moves by 0.07, a 1.25x step's by 0.8 (bench/knee_noise.py
    measures it on the recorded surfaces)."""
    return throughput_ratio * (noise_1 + noise_2) / (ratio - 1) if ratio > 1 else math.inf


def find_knee(
    levels: Sequence[LevelResult], fraction: float = KNEE_FRACTION,
    unit: Literal["concurrency", "req/s", "conversations/s"] | None = None,
) -> Knee | None:  # fmt: skip
    """The knee of ``levels`` (see :class:`Knee`), in ``unit`` (default: concurrency or req/s, as the levels
    were measured); a load measured more than once counts at its mean throughput. None without a level at a
    load above 0."""
    by_load: dict[float, list[float]] = {}
    noise: dict[float, float] = {}
    for level in levels:
        load = level_load(level)
        if load > 0:
            by_load.setdefault(load, []).append(level_throughput(level))
            noise[load] = max(noise.get(load, 0.0), throughput_noise(level))
    if not by_load:
        return None
    if unit is None:
        unit = "concurrency" if levels[0].summary.level.get("concurrency") else "req/s"
    points = sorted((load, sum(ts) / len(ts)) for load, ts in by_load.items())
    for (x1, t1), (x2, t2) in itertools.pairwise(points):
        gain = (t2 / t1 - 1) / (x2 / x1 - 1) if t1 > 0 else math.inf
        if gain < fraction:
            return Knee(value=x1, unit=unit, bracket=(x1, x2), bound="exact", throughput=t1, fraction=fraction,
                        slope_noise=slope_noise(x2 / x1, t2 / t1, noise[x1], noise[x2]), gain=gain)  # fmt: skip
    top, throughput = points[-1]
    return Knee(value=top, unit=unit, bracket=(top, None), bound="lower", throughput=throughput, fraction=fraction)


FailureKind = Literal["configuration", "infrastructure"]


class Failure(BaseModel):
    """Why a trial failed, as trial/failures.py read it from the engine's log."""

    model_config = RECORD

    kind: FailureKind
    cause: str  # a short name: port_in_use, device_busy, hub_auth, hub_rate_limit, weights_download, ...
    evidence: str  # the log line (or reason) it was read from, at most 300 characters
    retry_after_s: float | None = None  # a retry may help, after this long; None: it would fail the same way
    # the node is at fault (its GPU, driver, interconnect or disk): no retry there, one on another node
    retry_elsewhere: bool = False
    node_id: str | None = None  # the Ray node the start failed on, where the trial ran on one


class ReferenceAnswers(BaseModel):
    """What the quality reference answered: what every other trial's probe is compared with."""

    model_config = RECORD

    trial_id: str
    params: dict[str, Any]
    max_model_len: int | None = None  # the window the recall suite was built for
    prompt_ids: list[list[int]] = []  # agreement prompts as the server tokenized them
    continuations: list[list[int]] = []  # the reference's greedy continuations
    nll: list[float | None] = []  # the reference's own teacher-forced NLL per token
    scores: dict[str, float] = {}  # suite -> share of items passed


class LosslessCheck(BaseModel):
    """A speculative trial's greedy outputs against the reference's (quality/lossless.py)."""

    model_config = RECORD

    method: str  # the trial's speculative method
    reference_trial: str
    reference_method: str | None = None  # the reference's own speculation (None: it ran without)
    prompts: int  # agreement prompts compared
    mismatched: list[int] = []  # indices of the prompts whose continuation differs from the reference's
    mismatch_rate: float
    max_mismatch: float  # the share allowed to differ (numerical near-ties)
    passed: bool | None = None  # None: not judged (the reference speculates too)


class QualityResult(BaseModel):
    """A trial's quality probe (quality/probe.py): scores, drops against the reference, verdict."""

    model_config = RECORD

    reference_trial: str
    agreement: float | None = None  # mean share of the reference's tokens reproduced before the first difference
    exact_match: float | None = None  # share of agreement prompts continued exactly as the reference did
    nll_delta: float | None = (
        None  # nats per token: this trial's NLL of the reference's tokens minus the reference's own
    )
    suites: dict[str, float] = {}  # suite -> share of items passed
    drops: dict[str, float] = {}  # score -> the reference's value minus this trial's (nll_delta as is)
    bounds: dict[str, float] = {}  # score -> the largest drop allowed
    failures: list[str] = []  # the bounds broken, as sentences
    passed: bool | None = None
    duration_s: float | None = None
    errors: list[str] = []  # requests of the probe that failed (first 20)
    answers: dict[str, list[Any]] = {}  # per prompt: agreement token ids, suite answers (texts)
    reference_answers: ReferenceAnswers | None = None  # on the reference trial only
    lossless: LosslessCheck | None = None  # speculative trials: greedy outputs against the reference's


class TrialResult(BaseModel):
    """``result.json`` of one trial directory: everything a report needs, GPUs not required."""

    model_config = RECORD

    schema_version: int = 1  # see SCHEMA_VERSION
    trial_id: str  # hash of the resolved configuration; names the trial directory
    study: str
    params: dict[str, Any]  # the values the search chose
    engine_args: dict[str, Any]  # every vLLM engine argument of the launch (fixed + chosen)
    env: dict[str, str]  # redacted
    # What vLLM resolved at start-up for the core engine arguments the launch left to it
    # (``max_num_seqs``, ``max_num_batched_tokens``...): what an export pins.
    resolved_engine_args: dict[str, Any] = {}
    model: str
    device: Literal["gpu", "cpu"]
    devices: int
    price_per_device_hour: float
    price: DevicePrice | None = None  # where price_per_device_hour came from (None in results before schema 7)
    slo: list[str]
    outcome: Outcome
    reason: str | None = None
    log_tail: str | None = None
    capacity: CapacityReport | None = None  # the memory ledger's prediction, before any launch
    capacity_at_slo: Capacity | None = None  # the load it carries at the SLO (None: no capacity search ran)
    knee: Knee | None = None  # where its throughput stopped growing with load (None: before schema 8, or no level)
    kv_capacity: KvCapacityReport | None = None
    kv_prediction_error: float | None = None  # (predicted - reported) / reported
    startup_s: float | None = None
    startup_phases: dict[str, float] = {}  # seconds per start-up phase vLLM logged (engine/startup.py)
    started_at: str | None = None
    finished_at: str | None = None
    duration_s: float | None = None
    levels: list[LevelResult] = []
    stopped_because: str | None = None
    best_level_index: int | None = None  # best_level() when the trial ended, for readers outside servetune
    environment: dict[str, str] = {}  # hardware and software stack of the trial: see environment.py
    quality: QualityResult | None = None  # the quality probe, when the space has a ``quality:`` section
    # Through Ray Serve (``serve.num_replicas``): the application, its replicas and what each served.
    serve: dict[str, Any] | None = None
    # FAILED because the trial's process or node died under it (recorded by the driver): no verdict
    # on the configuration, so ``--resume`` runs it again.
    lost: bool = False
    # Whose fault a FAILED trial was (trial/failures.py): an infrastructure failure is no verdict on the
    # configuration either. ``retried``: the start-up failures a retry followed, in order.
    failure: Failure | None = None
    retried: list[Failure] = []
    # The estimate of every level (LevelResult.estimate) was made with these factors ("shipped", or "refit on N
    # points"); where it could not be made, ``estimate_note`` says why (the trial is measured all the same).
    estimate_factors: str | None = None
    estimate_note: str | None = None
    pruned: Pruned | None = None  # PRUNED: the numbers that ruled the trial out (study/prune.py)
    proposed_by: str | None = None  # who proposed it, where not the searcher: "estimate #1 of 4" (study/forecast.py)

    @property
    def runs_again(self) -> bool:
        """Whether ``--resume`` runs this trial again and the searcher learns nothing from it: its process or
        node died under it, or it failed for a reason outside its configuration."""
        return self.lost or (
            self.outcome == "FAILED" and self.failure is not None and self.failure.kind == "infrastructure"
        )

    def operating_points(self, price_per_device_hour: float | None = None) -> list[OperatingPoint]:
        """Every measured level as a point; ``price_per_device_hour`` replaces the recorded price in the cost."""
        price = self.price_per_device_hour if price_per_device_hour is None else price_per_device_hour
        points = []
        for index, level in enumerate(self.levels):
            metrics = level.summary.flat()
            metrics[COST_METRIC] = cost_per_mtok_usd(price, self.devices, level.summary.output_throughput)
            metrics.update(self.energy_metrics(level))
            points.append(
                OperatingPoint(
                    trial_id=self.trial_id,
                    level_index=index,
                    level=level.summary.level,
                    config=self.params,
                    devices=self.devices,
                    metrics=metrics,
                    # a level where the client fell behind takes no verdict (load/pace.py): not a point meeting it
                    meets_slo=level.meets_slo and level.client_bound is None,
                )
            )
        return points

    def energy_metrics(self, level: LevelResult) -> dict[str, float]:
        """Joules per output token and per completed request over the level's measured window, from the
        energy of the devices the trial reserved (metrics.MEASURED_ENERGY); empty where it was not measured."""
        energy = level.telemetry.get(MEASURED_ENERGY[self.device])
        per = {
            ENERGY_PER_TOKEN: energy_per(energy, level.summary.total_output_tokens),
            ENERGY_PER_REQUEST: energy_per(energy, level.summary.completed),
        }
        return {name: value for name, value in per.items() if value is not None}

    @property
    def unsettled_loads(self) -> frozenset[float]:
        """The loads whose SLO verdict the capacity search left within the noise (none without a search)."""
        return frozenset(self.capacity_at_slo.unsettled) if self.capacity_at_slo is not None else frozenset()

    @property
    def capacity_level_index(self) -> int | None:
        """The level measured at the capacity the search found (the last measurement at that load that met the
        SLO), whose cost and goodput are the trial's at capacity; None without a capacity or such a level."""
        value = self.capacity_at_slo.value if self.capacity_at_slo is not None else None
        if value is None:
            return None
        at = [i for i, lv in enumerate(self.levels) if lv.meets_slo and level_load(lv) == value]
        return at[-1] if at else None

    @property
    def knee_found(self) -> Knee | None:
        """The knee the trial recorded, else the one its levels show (a result from before schema 8)."""
        if self.knee is not None:
            return self.knee
        return find_knee(self.levels, unit=self.capacity_at_slo.unit if self.capacity_at_slo is not None else None)

    @property
    def best(self) -> OperatingPoint | None:
        """The point of the trial's best level (:func:`best_level`; None if no level meets the SLO)."""
        index = best_level(self)
        return None if index is None else self.operating_points()[index]


def level_load(level: LevelResult) -> float:
    """The load a level was measured at (its clients or its rate), as the capacity search names loads."""
    return max(level.summary.level.values(), default=0.0)


def best_level(trial: TrialResult) -> int | None:
    """The index of the level the trial is judged best at, None when no level meets the SLO: the highest goodput
    (request throughput without a per-request SLO) among the levels that met the SLO with requests completed,
    leaving out the loads whose verdict the capacity search found within the noise (a measurement that met the
    SLO there could as well have broken it on a repeat), and the levels where the client fell behind
    (``client_bound``, load/pace.py: what they measured may be the client's).

    The one rule every reader asks (the report's trial table and ``export --pick TRIAL_ID``, MLflow, verify,
    the search's objectives), computed from the levels, so a study recorded before a change of the rule reads
    as the others do. The trial writes it into ``result.json`` as ``best_level_index`` for readers outside
    servetune."""
    unsettled = trial.unsettled_loads
    meeting = [(i, lv) for i, lv in enumerate(trial.levels)
               if lv.meets_slo and lv.summary.completed > 0 and level_load(lv) not in unsettled
               and lv.client_bound is None]  # fmt: skip
    if not meeting:
        return None

    def score(item: tuple[int, LevelResult]) -> float:
        s = item[1].summary
        return s.goodput if s.goodput is not None else s.request_throughput

    return max(meeting, key=score)[0]


@dataclass(frozen=True)
class ChosenLevel:
    """The level a trial is judged by: its best meeting the SLO (:func:`best_level`), else the highest load it
    measured."""

    index: int
    meets_slo: bool

    @property
    def note(self) -> str:
        return "best level meeting the SLO" if self.meets_slo else "highest load measured; no level met the SLO"


def chosen_level(trial: TrialResult) -> ChosenLevel | None:
    """The level a trial's numbers are shown at (MLflow's plain metrics, the report's trial table, ``export
    --pick TRIAL_ID``, verify's default level); None when it measured none."""
    if not trial.levels:
        return None
    best = best_level(trial)
    if best is not None:
        return ChosenLevel(best, True)
    highest = highest_load_index(trial.levels)
    assert highest is not None  # it has levels
    return ChosenLevel(highest, False)


def highest_load_index(levels: list[LevelResult]) -> int | None:
    """The level measured at the highest load (levels run in the order measured: the capacity search
    may go on below the ladder's top, so the last level is not always the highest)."""
    if not levels:
        return None
    return max(range(len(levels)), key=lambda i: level_load(levels[i]))


@dataclass(frozen=True)
class EstimateAccuracy:
    """How far the estimate was from the measurements of a study, for one metric: |predicted / measured - 1|."""

    metric: str  # ttft_ms, tpot_ms or output_throughput (LevelEstimate.error's keys)
    median: float
    worst: float
    levels: int


def estimate_accuracy(trials: list[TrialResult]) -> list[EstimateAccuracy]:
    """The median and worst relative error of the estimate per metric, over every estimated level of ``trials``."""
    errors: dict[str, list[float]] = {}
    for trial in trials:
        for level in trial.levels:
            for metric, error in (level.estimate.error if level.estimate is not None else {}).items():
                errors.setdefault(metric, []).append(abs(error))
    return [
        EstimateAccuracy(metric, statistics.median(values), max(values), len(values))
        for metric, values in errors.items()
    ]


#: The layout of ``study.json`` and ``result.json`` this servetune writes. Readers take any version:
#: a field they do not know is ignored and one they miss takes its default, so a study opens in an
#: older or a newer servetune alike; the number says which layout wrote a file. 1: before it was
#: recorded; 2: results carry ``resolved_engine_args`` and a level its ``cache_note``; 3: a level's
#: summary carries what the ladder judges saturation on (``busy_output_throughput``,
#: ``send_span_s``, ``ttft_growth``, ``ttft_growth_low``); 4: results carry ``capacity_at_slo`` and
#: their levels may go on past the ladder, in the order measured (trial/capacity.py); 5: a FAILED result
#: carries ``failure`` (whose fault: trial/failures.py) and ``retried``; 6: a level's telemetry carries the
#: energy of its measured window alone (``gpu_energy_measured_j``, ``cpu_energy_measured_j``: telemetry.py) and
#: the level its ``energy_note``, so operating points have ``energy_per_token`` and ``energy_per_request`` (a
#: result from before has neither: its energy counted the warm-up too); 7: a result carries ``price``, the price
#: of its GPU type with its source and date (capacity/prices.py); 8: a result carries ``knee``, where throughput stopped growing with load (:func:`find_knee`;
#: a result from before has none, and readers derive it from its levels with :attr:`TrialResult.knee_found`).
#: 9: a level carries its ``estimate`` (predicted TTFT, TPOT, throughput and their relative errors) and the result
#: ``estimate_factors`` or ``estimate_note``. 10: a result may be PRUNED, with ``pruned`` (the estimate that ruled it
#: out), and carry ``proposed_by`` (a point the estimate seeded the search with).
SCHEMA_VERSION = 10


class StudyInfo(BaseModel):
    """``study.json`` at the top of a study directory: what the study was asked to do."""

    model_config = RECORD

    schema_version: int = 1  # files from before the version was written read as 1
    name: str
    created: str
    space_file: str  # copied beside study.json as space.yaml
    model: str
    workload: str
    device: Literal["gpu", "cpu"]
    algorithm: str
    objectives: list[tuple[str, Literal["min", "max"]]]  # e.g. [("cost_per_mtok_usd", "min"), ("ttft_ms_p99", "min")]
    slo: list[str]  # as text, for people and for older readers
    slo_bounds: list[SloBound] = []  # the same bounds, typed (empty in study.json files before schema 2)
    price_per_device_hour: float
    servetune_version: str
    levels: list[str] = []  # the load ladder each trial climbs, e.g. "concurrency 8" (empty in older study.json files)
    # the MLflow store the study logged to, without credentials (tracking/connection.py study_tracking_uri): verify and
    # report log there unless told otherwise (None in older study.json files)
    tracking_uri: str | None = None


#: Layout of a study directory (``--storage``/<study name>/).
STUDY_FILE = "study.json"
SPACE_FILE = "space.yaml"
TRIALS_DIR = "trials"
RESULT_FILE = "result.json"
QUALITY_FILE = "quality.jsonl"  # the quality probe's answers, a row per prompt (quality/probe.py)
LM_EVAL_RESULTS_FILE = (
    "lm_eval_results.json"  # lm-eval's results JSON, when the probe ran lm-eval tasks (quality/lm_eval.py)
)
ENGINE_LOG = "engine.log"  # the engine's stdout and stderr (trial/runner.py)
REQUESTS_FILE = "requests.jsonl"  # the per-request records, a row per request (trial/runner.py)
REFERENCE_FILE = (
    Path("quality") / "reference.json"
)  # the quality reference's answers, kept by the study (study/driver.py)


Model = TypeVar("Model", bound=BaseModel)


def validation_message(exc: ValidationError) -> str:
    """The first problem of a pydantic error as ``field.path: message`` on one line."""
    errors = exc.errors()
    first = errors[0]
    if first.get("type") == "json_invalid":
        text = f"not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
    else:
        loc = ".".join(str(part) for part in first.get("loc", ())) or "(top level)"
        text = f"{loc}: {first.get('msg')}"
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more problems)"
    return " ".join(text.split())


def read_model(path: Path, model: type[Model]) -> Model:
    """Validate one JSON file; a missing, unreadable or invalid file is a one-line UserError."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read: {exc}") from None
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        raise UserError(f"{path}: {validation_message(exc)}") from None


def read_result(trial_dir: Path) -> TrialResult | None:
    """The one reader of ``result.json``: None when the trial has none yet (still running, or never
    finished); a file that is there but invalid is a one-line ``UserError`` naming it and the field."""
    path = trial_dir / RESULT_FILE
    if not path.is_file():
        return None
    return read_model(path, TrialResult)
