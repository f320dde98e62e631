"""Operating points as a report sees them: the trial's measured level plus what drawing needs.

A :class:`ReportPoint` is one (trial, load level) with its flat metrics (``LevelSummary.flat()``
names, ``cost_per_mtok_usd``, and the two derived rates below), its configuration, the trial's
outcome and the level's SLO verdict. A :class:`TrialOutline` is one trial with or without
points: what the out-of-memory neighbour rule and the outcome counts need.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from servetune.config.slo import Slo
from servetune.errors import UserError
from servetune.metrics import (
    COST_METRIC,
    ENERGY_METRICS,
    GOODPUT,
    LATENCY_METRICS,
    OUTPUT_THROUGHPUT_PER_DEVICE,
    OUTPUT_THROUGHPUT_PER_USER,
    STATS,
    STRUCTURED_VALID,
    metric_names,
)
from servetune.results import MARGIN, Outcome, TrialResult, chosen_level, level_load, throughput_noise

DERIVED_METRICS = (OUTPUT_THROUGHPUT_PER_DEVICE, OUTPUT_THROUGHPUT_PER_USER)

#: Server-side peaks and counters the measurement records per level (engine/metrics.py names).
KV_CACHE_USAGE_MAX = "kv_cache_usage_max"  # fraction 0..1, peak sampled during the level
PREEMPTIONS = "preemptions"  # counted during the level

# A reason (or log tail) that says the engine ran out of memory or would not fit: CUDA's and
# vLLM's own messages, and the capacity check's verdicts (capacity/ledger.py) other than
# "vLLM refuses this configuration", which is about shapes, not memory.
_OUT_OF_MEMORY = re.compile(
    r"out of memory|\bOOM\b|OutOfMemory|no available memory|larger than the available"
    r"|can be stored in KV cache|not enough (?:\w+ )?memory|insufficient (?:\w+ )?memory|does not fit"
    r"|no memory left|but vLLM may use only|more than the GPU's|not enough for one request",
    re.IGNORECASE,
)


def known_metrics() -> list[str]:
    """Every metric name a report point can carry."""
    return [*metric_names(), COST_METRIC, *ENERGY_METRICS, *DERIVED_METRICS, STRUCTURED_VALID]


def is_out_of_memory(text: str | None) -> bool:
    return bool(text and _OUT_OF_MEMORY.search(text))


@dataclass(frozen=True, eq=False)
class ReportPoint:
    """One operating point. Points compare by identity; :attr:`key` names one."""

    trial_id: str
    level_index: int = 0
    level: Mapping[str, float] = field(default_factory=dict)
    params: Mapping[str, Any] = field(default_factory=dict)  # the values the search chose
    engine_args: Mapping[str, Any] = field(default_factory=dict)  # every engine argument of the launch
    resolved_engine_args: Mapping[str, Any] = field(default_factory=dict)  # what vLLM resolved for the rest
    env: Mapping[str, str] = field(default_factory=dict)  # redacted on disk
    model: str = ""
    device: str = "gpu"
    devices: int = 1
    outcome: Outcome = "COMPLETE"
    reason: str | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    server_metrics: Mapping[str, float] = field(default_factory=dict)
    slo_violations: tuple[str, ...] = ()
    quality_failures: tuple[str, ...] = ()  # the quality bounds the trial's probe broke (config/quality.py)
    noise: float = MARGIN  # how much a repeat of this level's cost could differ (results.py throughput_noise)
    # The trial's capacity search found this load's SLO verdict within the noise (trial/capacity.py): a
    # repeat could as well break the SLO, so the point is drawn but neither on a front nor recommended.
    unsettled: bool = False
    # Why the load client fell behind at this level (load/pace.py), else None: drawn, never eligible.
    client_bound: str | None = None
    # The level the trial's capacity search found to be its capacity at the SLO (results.py capacity_level_index):
    # drawn and labelled on the fronts beside the ladder's points.
    at_capacity: bool = False
    # On that point: the capacity's bracket [met the SLO, broke it] (None: no load broke it) and how far a repeat's
    # verdict could differ (results.Capacity.verdict_noise).
    capacity_bracket: tuple[float | None, float | None] | None = None
    capacity_noise: float | None = None

    @property
    def key(self) -> str:
        return f"{self.trial_id}#{self.level_index}"

    @property
    def meets_slo(self) -> bool:
        return not self.slo_violations

    @property
    def eligible(self) -> bool:
        """May stand on a Pareto front or be recommended: its trial completed, it meets every SLO beyond
        the noise (not an unsettled load of the capacity search), the load client kept up (``client_bound``), and
        the trial kept its quality within the bounds."""
        return (self.outcome == "COMPLETE" and self.meets_slo and not self.unsettled and not self.quality_failures
                and self.client_bound is None)  # fmt: skip

    def value(self, metric: str) -> float | None:
        """The metric's value when it is a finite number, else None."""
        value = self.metrics.get(metric)
        return value if value is not None and math.isfinite(value) else None

    @property
    def broken_metrics(self) -> tuple[str, ...]:
        """The metrics whose SLO bound this level broke (``ttft_ms_p95``), as the trial's verdict names them."""
        return violated_metrics(self.slo_violations)

    @property
    def why_apart(self) -> str:
        """Why the point is not eligible ('' when it is)."""
        if self.outcome != "COMPLETE":
            return f"trial {self.outcome}" + (f": {first_line(self.reason)}" if self.reason else "")
        if self.slo_violations:
            return "SLO broken: " + "; ".join(self.slo_violations)
        if self.quality_failures:
            return "quality failed: " + "; ".join(self.quality_failures)
        return ""


@dataclass(frozen=True)
class TrialOutline:
    """One trial, whatever its outcome."""

    trial_id: str
    params: Mapping[str, Any]
    outcome: Outcome
    reason: str | None = None
    out_of_memory: bool = False  # failed or infeasible because memory ran out / would not fit
    chosen_level: int | None = None  # the level it is judged by (results.py chosen_level); None: none measured


@dataclass(frozen=True)
class SloLine:
    """One SLO bound as a line to draw: ``metric <= max`` (``metric >= max`` for a lower bound, ``lower``)."""

    metric: str
    max: float  # the bound's value
    lower: bool = False  # a floor (``structured_valid >= 0.99``), not a ceiling

    def __str__(self) -> str:
        return f"{self.metric} {'>=' if self.lower else '<='} {self.max:g}"

    @property
    def family(self) -> str:
        """What the bound measures, whatever the statistic: ``ttft_ms`` for ``ttft_ms_p95``."""
        return metric_family(self.metric)


@dataclass(frozen=True)
class AxisBound:
    """An SLO bound drawn on an axis of the same family, perhaps of another statistic (P95 on a P99 axis)."""

    line: SloLine
    axis_metric: str

    @property
    def same_statistic(self) -> bool:
        return self.line.metric == self.axis_metric

    @property
    def label(self) -> str:
        """``SLO ttft_ms_p99 <= 300``; ``SLO ttft_ms_p95 <= 150 (axis is P99)`` when the statistics differ."""
        if self.same_statistic:
            return f"SLO {self.line}"
        stat = self.axis_metric.rpartition("_")[2]
        return f"SLO {self.line} (axis is {stat.upper() if stat.startswith('p') else stat})"


def bounds_on_axis(lines: Iterable[SloLine], axis_metric: str) -> list[AxisBound]:
    """Every bound of the axis metric's family (TTFT P95 and P99 bounds on a TTFT P99 axis), the axis's own first."""
    family = metric_family(axis_metric)
    found = [AxisBound(line, axis_metric) for line in lines if line.family == family]
    return sorted(found, key=lambda bound: not bound.same_statistic)


def metric_family(metric: str) -> str:
    """``ttft_ms_p99`` -> ``ttft_ms``; a metric without a statistic is its own family."""
    base, _, stat = metric.rpartition("_")
    return base if base in LATENCY_METRICS and stat in STATS else metric


def violated_metrics(violations: Iterable[str]) -> tuple[str, ...]:
    """The metric each SLO violation names: ``ttft_ms_p95 = 222.2 > 150`` -> ``ttft_ms_p95``.

    The trial's verdict (config/slo.py ``Slo.violations``) starts each entry with the metric's name.
    """
    return tuple(text.split()[0] for text in violations if text.strip())


def first_line(text: str | None, limit: int = 160) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def outline(trial: TrialResult) -> TrialOutline:
    oom = trial.outcome != "COMPLETE" and (is_out_of_memory(trial.reason) or is_out_of_memory(trial.log_tail))
    reason = trial.reason
    if (
        trial.runs_again and trial.failure is not None and not trial.lost
    ):  # the reader should not blame the configuration
        reason = f"not the configuration's ({trial.failure.cause}; runs again on --resume): {reason}"
    chosen = chosen_level(trial)
    return TrialOutline(
        trial_id=trial.trial_id, params=dict(trial.params), outcome=trial.outcome, reason=reason,
        out_of_memory=oom, chosen_level=chosen.index if chosen is not None else None,
    )  # fmt: skip


def trial_points(
    trial: TrialResult, price_per_device_hour: float | None = None, whole_level_goodput: bool = False
) -> list[ReportPoint]:
    """Every measured level of a trial; ``price_per_device_hour`` replaces the recorded price;
    ``whole_level_goodput``: each level's goodput over the whole level, as records before the busy window had it
    (:func:`mixed_goodput_windows`)."""
    points = []
    unsettled = trial.unsettled_loads
    capacity_index = trial.capacity_level_index
    for op, level in zip(trial.operating_points(price_per_device_hour), trial.levels, strict=True):
        metrics = dict(op.metrics)
        if whole_level_goodput and level.summary.whole_level_goodput is not None:
            metrics[GOODPUT] = level.summary.whole_level_goodput
        metrics[OUTPUT_THROUGHPUT_PER_DEVICE] = level.summary.output_throughput / max(trial.devices, 1)
        tpot_mean = level.summary.tpot_ms.mean
        if tpot_mean is not None and tpot_mean > 0:
            metrics[OUTPUT_THROUGHPUT_PER_USER] = 1000.0 / tpot_mean
        points.append(
            ReportPoint(
                trial_id=trial.trial_id,
                level_index=op.level_index,
                level=dict(op.level),
                params=dict(trial.params),
                engine_args=dict(trial.engine_args),
                resolved_engine_args=dict(trial.resolved_engine_args),
                env=dict(trial.env),
                model=trial.model,
                device=trial.device,
                devices=trial.devices,
                outcome=trial.outcome,
                reason=trial.reason,
                metrics=metrics,
                server_metrics=dict(level.server_metrics),
                slo_violations=tuple(level.slo_violations),
                quality_failures=quality_failures(trial),
                noise=throughput_noise(level),
                unsettled=level_load(level) in unsettled,
                client_bound=level.client_bound,
                at_capacity=op.level_index == capacity_index,
                capacity_bracket=trial.capacity_at_slo.bracket
                if op.level_index == capacity_index and trial.capacity_at_slo
                else None,
                capacity_noise=trial.capacity_at_slo.verdict_noise
                if op.level_index == capacity_index and trial.capacity_at_slo
                else None,
            )
        )
    return points


def point_trial(trials: Iterable[TrialResult], point: ReportPoint | None) -> TrialResult | None:
    """The trial ``point`` was measured in (None without a point, or where the trials lack it)."""
    if point is None:
        return None
    return next((t for t in trials if t.trial_id == point.trial_id), None)


def in_table_order(trials: Iterable[TrialResult], order: Sequence[str]) -> list[TrialResult]:
    """``trials`` in ``order`` (trial ids: the trial table's, the recommended first), any trial not named after, as
    given."""
    rank = {trial_id: index for index, trial_id in enumerate(order)}
    return sorted(trials, key=lambda t: rank.get(t.trial_id, len(rank)))


def quality_failures(trial: TrialResult) -> tuple[str, ...]:
    """The quality bounds a trial broke (empty when it passed or ran no probe)."""
    if trial.quality is None or trial.quality.passed is not False:
        return ()
    return tuple(trial.quality.failures) or ("the quality probe failed",)


def gather_points(trials: Iterable[TrialResult], price_per_device_hour: float | None = None) -> list[ReportPoint]:
    """Every operating point of every trial, in trial order then level order; where the trials count a closed
    loop's goodput over different windows (:func:`mixed_goodput_windows`), every level's over the whole level."""
    trials = list(trials)
    whole = mixed_goodput_windows(trials)
    return [p for trial in trials for p in trial_points(trial, price_per_device_hour, whole)]


def mixed_goodput_windows(trials: Iterable[TrialResult]) -> bool:
    """Whether some closed-loop levels count goodput with every client busy (LevelSummary.goodput_window) and
    others over the whole level, as records from before the busy window did: a study resumed across that change.
    The busy window reads higher (the final drain left out), so such trials compare only over the whole level,
    which both kept."""
    windows = {lv.summary.goodput_window for t in trials for lv in t.levels if lv.summary.busy_output_throughput}
    return {"every_client_busy", "whole_level"} <= windows


#: The report's line for a study whose trials counted goodput over different windows (mixed_goodput_windows).
MIXED_GOODPUT = ("goodput over the whole level for every trial: some trials were measured before servetune counted "
                 "a closed loop's goodput with every client busy, and the two windows do not compare")  # fmt: skip


_BOUND = re.compile(r"^\s*([a-z0-9_]+)\s*(<=|>=)\s*([-+0-9.eE]+)\s*$")


def parse_slo_lines(texts: Iterable[str], source: str = "study.json: slo") -> list[SloLine]:
    """``["ttft_ms_p99 <= 2000"]`` (as trials write them) or ``ttft_ms.p99=2000`` -> lines to draw."""
    lines: list[SloLine] = []
    for index, text in enumerate(texts):
        match = _BOUND.match(text)
        if match:
            metric, bound = match.group(1), float(match.group(3))
            if metric not in known_metrics():
                raise UserError(f"{source}[{index}]: unknown metric '{metric}' in '{text}'")
            lines.append(SloLine(metric, bound, lower=match.group(2) == ">="))
            continue
        slo = Slo.parse(text, source=f"{source}[{index}]")
        lines += [SloLine(b.name, b.limit, b.lower) for b in slo.bounds]
    return lines


def level_label(level: Mapping[str, float]) -> str:
    """``{"concurrency": 16}`` -> ``concurrency 16``; ``{"rate": 8}`` -> ``rate 8 req/s``."""
    parts = []
    for name, value in level.items():
        parts.append(f"{name} {value:g}" + (" req/s" if name == "rate" else ""))
    return ", ".join(parts) or "-"
