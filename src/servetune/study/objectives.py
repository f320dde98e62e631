"""What a finished trial tells the search: objective values and constraint values.

Constraint values follow Optuna's convention (<= 0 is satisfied): one per SLO bound, the
relative slack ``value / bound - 1`` at the trial's chosen level, one per bounded quality score
(``drop / max_drop - 1``, config/quality.py; 1 when the probe did not measure it), plus one that
is 1 when the trial did not run to completion (infeasible or failed) and 0 otherwise. So a sampler with a
``constraints_func`` learns to avoid both SLO breakers and configurations that do not fit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from servetune.config.settings import Objective
from servetune.config.slo import Slo
from servetune.results import TrialResult, best_level

#: Objective values for a trial that measured nothing (a finite "worst", as Optuna needs).
PENALTY = {"max": 0.0, "min": 1e12}


def told_level(result: TrialResult, slo: Slo) -> int | None:
    """The level the search is told: its level at capacity, else the best meeting the SLO (results.py
    ``best_level``), else the one that broke it least."""
    best = best_level(result)
    if best is not None:
        return best
    if not result.levels:
        return None

    def worst_slack(index: int) -> float:
        flat = result.levels[index].summary.flat()
        return max((b.slack(flat[b.name]) if b.name in flat else float("inf") for b in slo.bounds), default=0.0)

    return min(range(len(result.levels)), key=worst_slack)


def quality_slack(result: TrialResult, quality_bounds: Mapping[str, float]) -> list[float]:
    """One value per bounded quality score: ``drop / bound - 1`` (<= 0 within the bound), 1 when not measured."""
    drops = result.quality.drops if result.quality is not None else {}
    slack = []
    for name, bound in quality_bounds.items():
        drop = drops.get(name)
        slack.append(1.0 if drop is None else (drop - bound) / max(bound, 0.01))
    return slack


def objectives_and_constraints(result: TrialResult, objectives: Sequence[Objective], slo: Slo,
                               quality_bounds: Mapping[str, float] = {}) -> tuple[list[float], list[float]]:  # fmt: skip
    index = told_level(result, slo) if result.outcome == "COMPLETE" else None
    if index is None:
        return [PENALTY[o.mode] for o in objectives], [1.0] * (len(slo.bounds) + len(quality_bounds) + 1)
    metrics = result.operating_points()[index].metrics
    values = []
    for o in objectives:
        value = metrics.get(o.metric)
        if value is None or value != value or value in (float("inf"), float("-inf")):
            value = PENALTY[o.mode]
        values.append(float(value))
    slack = []
    for bound in slo.bounds:
        measured = metrics.get(bound.name)
        slack.append(1.0 if measured is None else bound.slack(measured))
    return values, [*slack, *quality_slack(result, quality_bounds), 0.0]
