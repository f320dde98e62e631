"""Pruning by the estimate: skip a trial the estimate rules out beyond its own expected error (``search.estimate.prune``).

Before a trial starts measuring, its configuration is estimated at every level of the ladder
(:func:`~servetune.study.forecast.forecast`). Each figure is then widened by the estimate's expected error,
toward the trial's favour: a relative error ``m`` (``|predicted / measured - 1| <= m``) means a latency
measured at least ``predicted / (1 + m)`` and a throughput at most ``predicted / (1 - m)`` (no bound at
``m >= 1``). The error is the shipped fit's held-out 90th percentile per metric (GPUs only: the CPU build's
factors come from one recording host), and once the study has measured ``MIN_STUDY_LEVELS`` estimated levels
of a metric, the 90th percentile of its own errors.

The trial is PRUNED only when, optimistic as that is,
- at every level of its ladder some SLO bound is missed (a bound on the mean or a percentile from p90 up:
  the estimate is a mean, and those are at least the mean), or
- a finished trial's measured point that met the SLO is cheaper than the trial's cheapest level and faster
  than its fastest TTFT, each by the noise margin (results.py ``MARGIN``), as early stopping compares
  (study/early_stop.py ``dominating_point``). The finished point's cost is taken at its whole level's output
  throughput here, the rate the estimate is fitted to and its throughput error measured against
  (trial/estimated.py), not at the steady rate the study prices it at (results ``OperatingPoint.priced_at``): at
  the steady rate, higher, every finished point would look cheaper against the estimate than it is, and the bound
  would no longer be optimistic.

A figure the estimate cannot give (no error known for the metric, an open loop past saturation whose TTFT
has no bound, a margin of 100 % or more) rules nothing out, so the estimate never prunes where it is unsure.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from servetune.config.slo import Slo
from servetune.estimate import load_factors
from servetune.estimate.factors import MetricError
from servetune.estimate.slo import ESTIMATED_METRICS, ESTIMATED_STATS
from servetune.metrics import COST_METRIC, OUTPUT_THROUGHPUT, cost_per_mtok_usd
from servetune.results import MARGIN, OperatingPoint, Pruned, PrunedLevel
from servetune.study.early_stop import TTFT_METRIC, _level_text, dominating_point
from servetune.study.forecast import LevelForecast, forecast
from servetune.trial.runner import TrialSpec

#: The study's own errors replace the shipped fit's once it has measured this many estimated levels of a metric.
MIN_STUDY_LEVELS = 5
#: The quantile of the errors the estimate is widened by.
ERROR_QUANTILE = 0.9


def shipped_error(device: str) -> dict[str, MetricError]:
    """The error the shipped fit expects of the estimate: its held-out error on public GPU measurements; none on the
    CPU build, whose factors were fitted on one recording host and miss others by tens of percent (cli/run.py
    ``estimate_note``): there the study prunes only once it has measured its own error."""
    return dict(load_factors().held_out_error) if device == "gpu" else {}


def error_margins(
    held_out: Mapping[str, MetricError], study_errors: Mapping[str, Sequence[float]]
) -> tuple[dict[str, float], str]:
    """The relative error per metric the estimate is widened by, and where it came from, in words."""
    margins = {metric: error.p90 for metric, error in held_out.items()}
    own = []
    for metric, errors in study_errors.items():
        values = sorted(abs(e) for e in errors)
        if len(values) >= MIN_STUDY_LEVELS:
            margins[metric] = statistics.quantiles(values, n=10, method="inclusive")[int(ERROR_QUANTILE * 10) - 1]
            own.append(f"{metric} on {len(values)} levels")
    source = "the shipped fit's held-out p90 error"
    if own:
        source = f"the study's own p90 error ({', '.join(own)}), else {source}"
    return margins, source


def optimistic(forecast: LevelForecast, margins: Mapping[str, float]) -> dict[str, float]:
    """The level's figures widened by their errors toward the trial's favour; a figure without a bound is left out."""
    est = forecast.estimate
    out: dict[str, float] = {}
    for name in ("ttft_ms", "tpot_ms"):
        value, margin = getattr(est, name), margins.get(name)
        if value is not None and margin is not None:
            out[name] = value / (1 + margin)
    margin = margins.get("output_throughput")
    if margin is not None and margin < 1:
        out["output_throughput"] = est.output_throughput / (1 - margin)
    return out


def missed_bound(figures: Mapping[str, float], slo: Slo) -> str | None:
    """The first SLO bound even the optimistic figures break, as ``ttft_ms_p99 <= 2000: 2,510 ms``; None if none."""
    for bound in slo.bounds:
        if bound.metric not in ESTIMATED_METRICS or bound.stat not in ESTIMATED_STATS:
            continue
        value = figures.get(ESTIMATED_METRICS[bound.metric])
        if value is not None and bound.breaks(value):
            return f"{bound}: {value:,.0f} ms"
    return None


def judge_prune(
    forecasts: Sequence[LevelForecast],
    slo: Slo,
    margins: Mapping[str, float],
    finished: Sequence[OperatingPoint],
    price_per_device_hour: float,
    devices: int,
    *,
    trial_id: str = "",
    error_source: str = "",
    factors: str = "shipped",
) -> Pruned | None:
    """Why the trial cannot win, as the :class:`Pruned` record, or None to run it (see the module's rule)."""
    if not forecasts:
        return None
    levels = []
    for fc in forecasts:
        figures = optimistic(fc, margins)
        levels.append(
            PrunedLevel(
                level=fc.level.as_dict(), ttft_ms=fc.estimate.ttft_ms, tpot_ms=fc.estimate.tpot_ms,
                output_throughput=fc.estimate.output_throughput, optimistic=figures, missed=missed_bound(figures, slo),
            )
        )  # fmt: skip
    record: dict[str, Any] = {
        "error_margin": dict(margins),
        "error_source": error_source,
        "factors": factors,
        "levels": levels,
    }
    if all(level.missed is not None for level in levels):
        return Pruned(rule="slo", **record)
    best = _best_case(levels, price_per_device_hour, devices)
    if best is None:
        return None
    point = OperatingPoint(trial_id=trial_id, level_index=-1, level={}, config={}, devices=devices, metrics=best,
                           meets_slo=True)  # fmt: skip
    dominator = dominating_point(point, priced_as_estimated(finished), margin=MARGIN)
    if dominator is None:
        return None
    return Pruned(
        rule="dominated", dominated_by=dominator.trial_id, optimistic_point=best,
        dominating={k: dominator.metrics[k] for k in (COST_METRIC, TTFT_METRIC)}, **record,
    )  # fmt: skip


def priced_as_estimated(points: Sequence[OperatingPoint]) -> list[OperatingPoint]:
    """``points`` with each cost at its whole level's output throughput (``output_throughput``), as the estimate's
    costs are (see the module's doc); a point priced at that rate already, or without the rates, as it is."""
    out = []
    for p in points:
        cost, at, whole = p.metrics.get(COST_METRIC), p.priced_at, p.metrics.get(OUTPUT_THROUGHPUT)
        if cost is not None and at and whole and at != whole:
            p = p.model_copy(update={"metrics": {**p.metrics, COST_METRIC: cost * at / whole}})
        out.append(p)
    return out


def _best_case(levels: Sequence[PrunedLevel], price: float, devices: int) -> dict[str, float] | None:
    """The trial's best case over its levels: the cost at its highest optimistic throughput and its lowest optimistic
    TTFT; None where a level lacks either (the estimate is unsure there)."""
    throughputs = [lv.optimistic.get("output_throughput") for lv in levels]
    ttfts = [lv.optimistic.get("ttft_ms") for lv in levels]
    if any(v is None for v in (*throughputs, *ttfts)):
        return None
    cost = cost_per_mtok_usd(price, devices, max(t for t in throughputs if t is not None))
    if not math.isfinite(cost):
        return None
    return {COST_METRIC: cost, TTFT_METRIC: min(t for t in ttfts if t is not None)}


def prune_reason(record: Pruned) -> str:
    """The PRUNED trial's reason in one line, with the numbers that ruled it out."""
    margin = ", ".join(f"{m} ±{100 * v:.0f}%" for m, v in record.error_margin.items())
    if record.rule == "slo":
        misses = "; ".join(f"{_level_text(lv.level)}: {lv.missed}" for lv in record.levels)
        return f"pruned: the estimate misses the SLO at every level even widened by its error ({margin}): {misses}"
    dom, best = record.dominating, record.optimistic_point
    return (
        f"pruned: dominated by trial {record.dominated_by}, measured at ${dom[COST_METRIC]:.3g}/Mtok with TTFT p99 "
        f"{dom[TTFT_METRIC]:,.0f} ms; this one at best ${best[COST_METRIC]:.3g}/Mtok and TTFT {best[TTFT_METRIC]:,.0f} "
        f"ms by the estimate widened by its error ({margin})"
    )


def study_errors(levels_errors: Sequence[Mapping[str, float]]) -> dict[str, list[float]]:
    """The estimate's relative errors per metric over a study's estimated levels (``LevelEstimate.error`` of each)."""
    out: dict[str, list[float]] = {}
    for errors in levels_errors:
        for metric, error in errors.items():
            out.setdefault(metric, []).append(abs(error))
    return out


@dataclass(frozen=True)
class PrunePreview:
    """What ``run --dry-run`` shows of one grid point under ``search.estimate.prune``: the study's own verdict
    (:func:`judge_prune`) before any trial has finished, so by the SLO rule alone, and the device-seconds a
    pruned point saves by the estimate."""

    record: Pruned | None  # None: it would run
    device_s: float = 0.0  # the estimate's device time of what pruning skips (0 where it runs)
    unsure: str | None = None  # why the estimate cannot judge it (it runs)


def preview_prune(spec: TrialSpec, lengths: tuple[int, int], startup_s: float | None) -> PrunePreview:
    """The dry run's prune verdict of ``spec`` (mean request ``lengths``; ``startup_s``: the engine's expected
    start-up, capacity/startup.py): the shipped fit's error as the margin (the study has measured nothing yet)
    and no finished point to dominate it, the study's rule otherwise (:func:`judge_prune`)."""
    forecasts = forecast(spec, lengths, spec.estimate_efficiency)
    if isinstance(forecasts, str):
        return PrunePreview(None, unsure=forecasts)
    margins, source = error_margins(shipped_error(spec.device), {})
    record = judge_prune(forecasts, spec.slo, margins, [], spec.price_per_device_hour, spec.devices,
                         trial_id=spec.trial_id, error_source=source)  # fmt: skip
    if record is None:
        return PrunePreview(None)
    return PrunePreview(record, spec.devices * ((startup_s or 0.0) + skipped_levels_s(spec, forecasts)))


def skipped_levels_s(spec: TrialSpec, forecasts: Sequence[LevelForecast]) -> float:
    """The estimate's time of the levels a trial that misses the SLO at every level runs: the first alone where the
    ladder stops at a break (``load.stop_on_slo_break``), else all of them; each level's warm-up and measured
    requests at the estimated request rate (an open loop's sends at its rate where the engine keeps up), or its
    ``seconds_per_level``, times its repeats. The capacity search's levels after the ladder are not counted: a
    lower bound of what pruning saves."""
    from servetune.trial.measure import LevelPlan

    ran = forecasts[:1] if spec.stop_on_slo_break else forecasts
    total = 0.0
    for fc in ran:
        plan = LevelPlan.sized(fc.level, spec.requests_per_level, spec.seconds_per_level, spec.warmup_requests)
        rate = fc.estimate.request_throughput
        if fc.level.kind == "rate":
            rate = min(rate, fc.level.value)
        if rate <= 0:
            continue
        warmup_s = plan.warmup_requests / rate
        measured_s = plan.duration_s if plan.duration_s is not None else (plan.num_requests or 0) / rate
        total += warmup_s + measured_s * spec.repeats
    return total
