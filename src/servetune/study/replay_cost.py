"""What a search costs, counted by replaying it over many seeds: trials until it finds the best, and what early
stopping saves and loses.

A search has *reached* the optimum once a trial scored (study/surface.py :func:`~servetune.study.surface.score`)
within ``tolerance`` of the best score on the surface, or with the target ``noise`` (:func:`reaching`), within the
two points' measured noise of it where that is the wider margin. :func:`efficiency` counts the trials each seed's
replay (study/replay.py) needed; :func:`early_stopping_effect` replays each seed with early stopping off and on.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from servetune.results import MARGIN, TrialResult, best_level, throughput_noise
from servetune.study.replay import replay_trials
from servetune.study.surface import Surface, key, score

#: What counts as finding the best: within ``tolerance`` of it, or within the larger of that and the noise.
TARGETS = ("tolerance", "noise")


def trials_to_reach(scores: Sequence[float], target: float) -> int | None:
    """1-based count of trials until one scored at least ``target`` (None: never)."""
    return next((i + 1 for i, s in enumerate(scores) if s >= target), None)


def score_noise(result: TrialResult) -> float:
    """How much a repeat of a trial's score could differ: the throughput noise of the level it is judged at
    (results ``throughput_noise``: half its repeats' spread, at least ``MIN_MARGIN``; ``MARGIN`` when run once)."""
    index = best_level(result) if result.outcome == "COMPLETE" else None
    return MARGIN if index is None else throughput_noise(result.levels[index])


def reaching(surface: Surface, tolerance: float = 0.05, target: str = "tolerance") -> set[str]:
    """The grid points (by :func:`~servetune.study.surface.key`) that count as finding the best. ``tolerance``:
    scoring within ``tolerance`` of the best. ``noise``: below the best by no more than the larger of ``tolerance``
    and the two points' noise together (:func:`score_noise`), the rule servetune's results compare two measurements
    by (report/recommend.py rule 4): a point a repeat could rank first is as good a find as the best. The second
    holds the first."""
    best_score = surface.best_score  # one clear error where nothing met the SLO
    best_noise = score_noise(max(surface.results.values(), key=score))
    margins = {k: tolerance if target == "tolerance" else max(tolerance, score_noise(r) + best_noise)
               for k, r in surface.results.items()}  # fmt: skip
    return {k for k, r in surface.results.items() if score(r) > 0 and score(r) >= (1 - margins[k]) * best_score}


@dataclass(frozen=True)
class Efficiency:
    algorithm: str
    seeds: int
    grid_size: int
    needed: list[int | None]  # per seed

    @property
    def reached(self) -> int:
        return sum(n is not None for n in self.needed)

    @property
    def mean(self) -> float:
        """Mean trials needed; a seed that never reached the target counts as the whole grid."""
        return statistics.fmean(n if n is not None else self.grid_size for n in self.needed)

    @property
    def share_of_grid(self) -> float:
        return self.mean / self.grid_size

    @property
    def worst(self) -> int:
        return max(n if n is not None else self.grid_size for n in self.needed)


def efficiency(
    surface: Surface, algorithm: str, seeds: Iterable[int], tolerance: float = 0.05, in_flight: int = 1,
    budget: int | None = None, proposed_first: Sequence[dict[str, Any]] = (), target: str = "tolerance",
) -> Efficiency:  # fmt: skip
    """Trials each seed needed to reach the best (:func:`reaching` with ``target``), searching at most ``budget``; a
    Bayesian searcher proposes ``proposed_first`` first (:func:`~servetune.study.replay.estimate_seeds_for`)."""
    return efficiencies(surface, algorithm, seeds, tolerance, in_flight, budget, proposed_first)[target]


def efficiencies(
    surface: Surface, algorithm: str, seeds: Iterable[int], tolerance: float = 0.05, in_flight: int = 1,
    budget: int | None = None, proposed_first: Sequence[dict[str, Any]] = (),
) -> dict[str, Efficiency]:  # fmt: skip
    """:func:`efficiency` for every target in :data:`TARGETS` from one replay a seed: it runs until a trial is
    within ``tolerance`` of the best, a point every target counts."""
    goals = {target: reaching(surface, tolerance, target) for target in TARGETS}
    needed: dict[str, list[int | None]] = {target: [] for target in TARGETS}
    for seed in seeds:
        told = replay_trials(surface, algorithm, seed, budget, in_flight, until=(1 - tolerance) * surface.best_score,
                             seeds=proposed_first)  # fmt: skip
        for target, goal in goals.items():
            needed[target].append(next((i + 1 for i, t in enumerate(told) if key(t.params) in goal), None))
    return {target: Efficiency(algorithm, len(n), len(surface.results), n) for target, n in needed.items()}


@dataclass(frozen=True)
class Loss:
    """A seed where the search found a worse best with early stopping, and the cut that explains it (if one does)."""

    seed: int
    best_off: float
    best_on: float
    cut_params: (
        dict[str, Any] | None
    )  # a trial cut below best_off that its recording reaches, else the search went elsewhere
    cut_at_level: int | None  # the last level it ran
    reason: str | None  # stopped_because: the level and the dominating trial


@dataclass(frozen=True)
class EarlyStoppingEffect:
    """One algorithm over seeds: the best found with early stopping against without, and the time it saved."""

    algorithm: str
    grid_size: int
    trials: list[int]  # per seed, with early stopping
    cut: list[int]  # trials cut per seed
    lowered: list[int]  # per seed, cut trials whose own score fell (the cut dropped a level that scored higher)
    device_seconds_saved: list[float]  # per seed
    losses: list[Loss]
    needed: list[int | None] = field(
        default_factory=list
    )  # per seed, with early stopping: trials until one came within the tolerance

    @property
    def seeds(self) -> int:
        return len(self.trials)

    @property
    def mean_needed(self) -> float | None:
        """Mean trials to come within the tolerance of the best, with early stopping, over the seeds that did."""
        reached = [n for n in self.needed if n is not None]
        return statistics.fmean(reached) if reached else None

    @property
    def mean_trials(self) -> float:
        return statistics.fmean(self.trials)

    @property
    def best_lost_share(self) -> float:
        return len(self.losses) / self.seeds

    @property
    def device_minutes_saved(self) -> float:
        """Mean per seed."""
        return statistics.fmean(self.device_seconds_saved) / 60


def early_stopping_effect(
    surface: Surface,
    algorithm: str,
    seeds: Iterable[int],
    in_flight: int = 1,
    budget: int | None = None,
    slack: float = 1e-9,
    tolerance: float = 0.05,
) -> EarlyStoppingEffect:
    """Each seed searched twice, early stopping off and on: did it find as good a best, how many trials did it take
    to come within ``tolerance`` of the surface's best with early stopping on, and what did it save?"""
    trials, cut, lowered, saved, losses, needed = [], [], [], [], [], []
    for seed in seeds:
        off = replay_trials(surface, algorithm, seed, budget, in_flight)
        on = replay_trials(surface, algorithm, seed, budget, in_flight, early_stopping=True)
        best_off, best_on = max(score(t.result) for t in off), max(score(t.result) for t in on)
        trials.append(len(on))
        needed.append(trials_to_reach([score(t.result) for t in on], (1 - tolerance) * surface.best_score))
        cut.append(sum(t.cut for t in on))
        lowered.append(sum(t.cut and score(t.result) < score(t.recorded) - slack for t in on))
        saved.append(sum(t.device_seconds_saved for t in on))
        if best_on < best_off - slack:
            culprit = next((t for t in on if t.cut and score(t.recorded) > best_on + slack), None)
            losses.append(Loss(seed, best_off, best_on, culprit.params if culprit else None,
                               len(culprit.result.levels) - 1 if culprit else None, culprit.result.stopped_because if culprit else None))  # fmt: skip
    return EarlyStoppingEffect(algorithm, len(surface.results), trials, cut, lowered, saved, losses, needed)
