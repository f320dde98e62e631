"""A trial's result (``result.json``): its outcome, levels, quality, and the rules that pick the level it is judged by."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from servetune.capacity.prices import DevicePrice
from servetune.metrics import (
    COST_METRIC,
    ENERGY_PER_REQUEST,
    ENERGY_PER_TOKEN,
    IMAGE_PIXELS,
    IMAGES_SENT,
    MEASURED_ENERGY,
    cost_per_mtok_usd,
    energy_per,
)
from servetune.results.levels import RECORD, KvCapacityReport, LevelResult, highest_load_index, level_load
from servetune.results.limits import Capacity, CapacityReport, Knee, Pruned, find_knee

#: PRUNED: the study skipped the trial before any engine started, because the estimate ruled it out beyond its
#: expected error (:class:`Pruned` says with which numbers); ``run --resume --unprune`` runs it.
Outcome = Literal["COMPLETE", "INFEASIBLE", "FAILED", "PRUNED"]
#: Every outcome, in the order reports count them.
OUTCOMES: tuple[Outcome, ...] = ("COMPLETE", "INFEASIBLE", "FAILED", "PRUNED")


class OperatingPoint(BaseModel):
    """One (trial, load level): what Pareto fronts are drawn over."""

    model_config = RECORD

    trial_id: str
    level_index: int
    level: dict[str, float]
    config: dict[str, Any]  # the trial's varied parameters
    devices: int  # GPUs the trial reserved (CPU cores on the CPU stand-in)
    metrics: dict[str, float]  # LevelSummary.flat() plus cost_per_mtok_usd, energy and images where measured
    meets_slo: bool
    # the throughput cost_per_mtok_usd is priced at (LevelSummary.steady_output_throughput): with every client busy
    # where that was measured, else the whole level's
    priced_by: str = "output_throughput"
    priced_at: float | None = None  # that throughput's tok/s (None: a point from before it was kept)


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
            metrics[COST_METRIC] = cost_per_mtok_usd(price, self.devices, level.summary.steady_output_throughput)
            metrics.update(self.energy_metrics(level))
            images = {IMAGES_SENT: level.summary.images_sent, IMAGE_PIXELS: level.summary.image_pixels}
            metrics.update({name: float(count) for name, count in images.items() if count is not None})
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
                    priced_by=level.summary.priced_by,
                    priced_at=level.summary.steady_output_throughput,
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


def capacity_level(trial: TrialResult) -> int | None:
    """The index of the level measured at the capacity the search found, where it found one: the passing side of
    a bracket (``capacity_at_slo.bound`` "exact"), measured on the trial's engine with requests completed and the
    client keeping up (:attr:`TrialResult.capacity_level_index`). None for a lower or upper bound, without a
    capacity search (a result from before it) or where that level is not among the trial's levels."""
    found = trial.capacity_at_slo
    index = trial.capacity_level_index if found is not None and found.bound == "exact" else None
    if index is None:
        return None
    level = trial.levels[index]
    if level.summary.completed == 0 or level.client_bound is not None or level_load(level) in trial.unsettled_loads:
        return None
    return index


def best_level(trial: TrialResult) -> int | None:
    """The index of the level the trial is judged at (its headline level), None when no level meets the SLO: the
    level at its capacity where the capacity search found one (:func:`capacity_level`), so its cost per million
    tokens and goodput at capacity are its headline numbers and what the search is told; else the highest goodput
    (request throughput without a per-request SLO) among the levels that met the SLO with requests completed,
    leaving out the loads whose verdict the capacity search found within the noise (a measurement that met the
    SLO there could as well have broken it on a repeat), and the levels where the client fell behind
    (``client_bound``, load/pace.py: what they measured may be the client's).

    The one rule every reader asks (the report's trial table and ``export --pick TRIAL_ID``, MLflow, verify,
    the search's objectives), computed from the levels, so a study recorded before a change of the rule reads
    as the others do. The trial writes it into ``result.json`` as ``best_level_index`` for readers outside
    servetune."""
    at_capacity = capacity_level(trial)
    if at_capacity is not None:
        return at_capacity
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


#: What ``ChosenLevel.note`` says (MLflow's tag ``servetune.level_choice`` and the run's performance note).
LEVEL_CHOICES = {
    "capacity": "level at the capacity at the SLO",
    "best": "best level meeting the SLO",
    "highest": "highest load measured; no level met the SLO",
}


@dataclass(frozen=True)
class ChosenLevel:
    """The level a trial is judged by: its level at capacity or else its best meeting the SLO (:func:`best_level`),
    else the highest load it measured. ``rule``: which of the three (a key of :data:`LEVEL_CHOICES`)."""

    index: int
    meets_slo: bool
    rule: Literal["capacity", "best", "highest"] = "best"

    @property
    def note(self) -> str:
        return LEVEL_CHOICES[self.rule]


def chosen_level(trial: TrialResult) -> ChosenLevel | None:
    """The level a trial's numbers are shown at (MLflow's plain metrics, the report's trial table, ``export
    --pick TRIAL_ID``, verify's default level); None when it measured none."""
    if not trial.levels:
        return None
    best = best_level(trial)
    if best is not None:
        return ChosenLevel(best, True, "capacity" if best == capacity_level(trial) else "best")
    highest = highest_load_index(trial.levels)
    assert highest is not None  # it has levels
    return ChosenLevel(highest, False, "highest")


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
