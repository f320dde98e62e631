"""Pruning by the estimate, replayed on a recorded surface: device-minutes saved, and whether the best was lost.

Each seed runs the surface's grid one trial at a time in an order of its own (seed 0: the grid's order;
others: shuffled with the seed), as a study with ``search.estimate.prune`` would: before each trial its
estimate at every planned level (:func:`~servetune.study.forecast.forecast`, shipped factors, the workload's
mean lengths) is judged by the study's own rule (:func:`~servetune.study.prune.judge_prune`) against the
points of the trials measured before it, with the error margin those trials' measured errors give
(:func:`~servetune.study.prune.error_margins`). A pruned trial is not measured: its recorded device time is
saved, and neither its points nor its errors count for later trials. A measured one is answered with its
recording. The seed *lost the best* when no trial it measured scored within ``tolerance`` of the surface's
best goodput under the SLO.

The replay leaves out the study's online refit of the factors (it would only narrow the estimate's error and
so prune more); its margins come from the recorded errors as they were with the shipped factors.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from servetune.config.workload import mean_lengths
from servetune.study.early_stop import FinishedPoints
from servetune.study.forecast import LevelForecast, forecast
from servetune.study.prune import error_margins, judge_prune, prune_reason, shipped_error, study_errors
from servetune.study.replay import planned_levels
from servetune.study.surface import Surface, score
from servetune.trial.context import StudyContext
from servetune.trial.estimated import estimate_levels


@dataclass(frozen=True)
class PrunedTrial:
    seed: int
    params: dict
    score: float  # what it would have scored (its recording)
    reason: str


@dataclass
class PruningEffect:
    """What pruning did over the seeds."""

    grid_size: int
    best: float
    pruned: list[int] = field(default_factory=list)  # trials pruned, per seed
    device_minutes_saved: list[float] = field(default_factory=list)  # per seed
    device_minutes_spent: list[float] = field(default_factory=list)  # measuring the rest, per seed
    best_lost: list[bool] = field(default_factory=list)  # per seed
    trials: list[PrunedTrial] = field(default_factory=list)
    unsure: str | None = None  # why no trial could be estimated, if none could

    @property
    def best_lost_share(self) -> float:
        return sum(self.best_lost) / len(self.best_lost) if self.best_lost else 0.0

    @property
    def mean_saved(self) -> float:
        return statistics.fmean(self.device_minutes_saved) if self.device_minutes_saved else 0.0


def pruning_effect(
    surface: Surface, model_dir: Path, seeds: range, tolerance: float = 0.05, base_dir: Path = Path()
) -> PruningEffect:
    """Replay pruning over ``seeds`` (see the module); ``model_dir`` holds the surface's model's ``config.json``."""
    space = surface.space
    workload = space.resolved_workload(base_dir)
    context = StudyContext(space, workload, base_dir, str(model_dir), planned_levels(surface, base_dir))
    lengths = mean_lengths(workload)
    forecasts: dict[str, list[LevelForecast] | str] = {}
    errors: dict[str, list[dict[str, float]]] = {}
    for k, recorded in surface.results.items():
        forecasts[k] = forecast(context.spec_for(recorded.params), lengths)
        estimated = recorded.model_copy(deep=True, update={"model": str(model_dir)})
        estimate_levels(estimated, None, None, workload=workload)
        errors[k] = [dict(lv.estimate.error) for lv in estimated.levels if lv.estimate is not None]
    effect = PruningEffect(grid_size=len(surface.results), best=surface.best_score)
    unsure = [f for f in forecasts.values() if isinstance(f, str)]
    if len(unsure) == len(forecasts):
        effect.unsure = str(unsure[0])
    held_out = shipped_error(space.device)
    for seed in seeds:
        order = list(surface.results)
        if seed:
            random.Random(seed).shuffle(order)
        finished = FinishedPoints()
        seen: list[dict[str, float]] = []
        pruned, saved, spent, kept = 0, 0.0, 0.0, []
        for k in order:
            recorded = surface.results[k]
            fc = forecasts[k]
            minutes = (recorded.duration_s or 0.0) * recorded.devices / 60.0
            verdict = None
            if not isinstance(fc, str):
                margins, source = error_margins(held_out, study_errors(seen))
                verdict = judge_prune(fc, space.slo_bounds, margins, finished.points(), recorded.price_per_device_hour,
                                      recorded.devices, trial_id=recorded.trial_id, error_source=source)  # fmt: skip
            if verdict is not None:
                pruned, saved = pruned + 1, saved + minutes
                effect.trials.append(PrunedTrial(seed, recorded.params, score(recorded), prune_reason(verdict)))
                continue
            spent += minutes
            kept.append(score(recorded))
            finished.add(recorded)
            seen += errors[k]
        effect.pruned.append(pruned)
        effect.device_minutes_saved.append(saved)
        effect.device_minutes_spent.append(spent)
        effect.best_lost.append(max(kept, default=0.0) < surface.best_score * (1 - tolerance))
    return effect
