"""Replaying a recorded response surface: how many trials a search needs, without engines.

A surface is a grid measured once for real (every point of a search space's grid, each a
trial's ``result.json``), stored with how it was made. Replaying it runs the study's own
search code (the grid's order, random points, and :class:`ConstrainedOptunaSearch` for TPE,
NSGA-II and GP, constraints included) and answers each proposal with the recorded result, so
a search's cost can be counted in trials over many seeds in seconds.

The score of a trial is its best goodput that met the SLO (0 when none did, or when it failed
or did not fit); a search has *reached* the optimum once a trial scored within ``tolerance``
of the best score on the surface.
"""

from __future__ import annotations

import json
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml

from servetune.config.space import Range, SearchSpace
from servetune.errors import UserError
from servetune.results import TrialResult
from servetune.study.objectives import objectives_and_constraints

ALGORITHMS = ("grid", "random", "tpe", "nsga2", "gp")
SCORE_METRIC = "goodput"
#: What a surface keeps of a trial's result: enough for objectives, constraints and the score.
DROPPED_FIELDS = {"log_tail", "environment", "capacity"}


class Searcher(Protocol):
    """What the replay drives: as much of Ray Tune's ``Searcher`` as Tune itself uses.

    ``suggest`` proposes a trial's config (``{"params": ...}``), ``FINISHED`` when it has
    nothing more to propose; ``on_trial_complete`` is told the trial's final report.
    """

    FINISHED: str

    def suggest(self, trial_id: str) -> dict[str, Any] | str | None: ...

    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False) -> None: ...


def key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, default=str)


def score(result: TrialResult) -> float:
    """A trial's best goodput meeting the SLO; 0 if it has none."""
    best = result.best if result.outcome == "COMPLETE" else None
    value = best.metrics.get(SCORE_METRIC) if best is not None else None
    return float(value) if value is not None else 0.0


@dataclass
class Surface:
    """A search space and a recorded result for every point of its grid."""

    space: SearchSpace
    results: dict[str, TrialResult]  # by key(params)
    made_by: dict[str, Any]

    @classmethod
    def from_results(cls, space: SearchSpace, results: Iterable[TrialResult], made_by: dict[str, Any] | None = None) -> Surface:
        if any(isinstance(values, Range) for values in space.params.values()):
            raise UserError(f"search space '{space.name}': a surface needs lists for every parameter, not ranges")
        by_key = {key(r.params): r for r in results}
        kept, _ = space.grid()
        missing = [p for p in kept if key(p) not in by_key]
        if missing:
            raise UserError(f"search space '{space.name}': {len(missing)} of {len(kept)} grid points have no result, e.g. {missing[0]}")
        return cls(space, {key(p): by_key[key(p)] for p in kept}, dict(made_by or {}))

    @classmethod
    def load(cls, path: Path) -> Surface:
        try:
            data = json.loads(Path(path).read_text())
            space = SearchSpace.model_validate(yaml.safe_load(data["space"]))
            results = [TrialResult.model_validate(r) for r in data["trials"]]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UserError(f"{path}: not a recorded surface ({str(err).splitlines()[0]})") from None
        return cls.from_results(space, results, data.get("made_by"))

    def dump(self, path: Path, space_text: str) -> None:
        trials = [r.model_dump(mode="json", exclude=DROPPED_FIELDS) for r in self.results.values()]
        data = {"made_by": self.made_by, "space": space_text, "trials": trials}
        Path(path).write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")

    @property
    def best_score(self) -> float:
        best = max(score(r) for r in self.results.values())
        if best <= 0:
            raise UserError(f"search space '{self.space.name}': no recorded trial met the SLO, so there is no optimum to find")
        return best

    def score_of(self, params: dict[str, Any]) -> float:
        return score(self.results[key(params)])


def space_for(surface: Surface, algorithm: str, seed: int, in_flight: int = 1, budget: int | None = None) -> SearchSpace:
    """The surface's space searched by ``algorithm``: the baseline (vLLM's defaults, not a grid
    point, so not on the surface) left out; ``in_flight`` at once, as ``servetune run`` would
    order them (the grid's order one at a time, packing order for several); ``budget`` trials
    (``num_trials``; the whole grid if None)."""
    search = surface.space.search.model_copy(
        update={"algorithm": algorithm, "seed": seed, "baseline": False, "max_concurrent": in_flight,
                "num_trials": min(budget or len(surface.results), len(surface.results))}
    )  # fmt: skip
    return surface.space.model_copy(update={"search": search})


def replay(
    surface: Surface, algorithm: str, seed: int, budget: int | None = None, in_flight: int = 1, until: float | None = None
) -> list[float]:
    """The scores of the trials a search runs, in the order their results come back (at most ``budget``).

    Grid and random search run their proposals (:func:`~servetune.study.driver.proposals`);
    the Bayesian searchers run with ``in_flight`` trials at once (:func:`in_flight_order`).
    With ``until``, the replay ends at the first trial scoring at least that much.
    """
    from servetune.study.driver import proposals

    space = space_for(surface, algorithm, seed, in_flight, budget)
    budget = space.search.num_trials
    if algorithm in ("grid", "random"):
        scores = [surface.score_of(p) for p in proposals(space, budget)]
        reached = trials_to_reach(scores, until) if until is not None else None
        return scores[:reached] if reached else scores
    from servetune.study.searcher import CONSTRAINTS_KEY, OBJECTIVES_KEY, ConstrainedOptunaSearch

    def report(params: dict[str, Any]) -> dict[str, str]:
        values, constraints = objectives_and_constraints(surface.results[key(params)], space.search.objectives, space.slo_bounds)
        return {OBJECTIVES_KEY: json.dumps(values), CONSTRAINTS_KEY: json.dumps(constraints)}

    scores: list[float] = []
    for params in in_flight_order(ConstrainedOptunaSearch(space, baseline=False), report, budget, in_flight):
        scores.append(surface.score_of(params))
        if until is not None and scores[-1] >= until:
            break
    return scores


def in_flight_order(
    searcher: Searcher, report: Callable[[dict[str, Any]], dict[str, Any]], budget: int, in_flight: int
) -> Iterator[dict[str, Any]]:
    """Drive ``searcher`` as a cluster running ``in_flight`` trials at once would; yield each
    trial's params as its result is told.

    The searcher is asked until ``in_flight`` trials are outstanding (``budget`` in all), then
    the oldest is told its ``report`` and its slot asked again: every proposal after the first
    ``in_flight`` is made with ``in_flight - 1`` others still running. Ends once ``budget``
    trials were told, or the searcher proposes nothing more and none is left running.
    """
    running: deque[tuple[str, dict[str, Any]]] = deque()
    proposed = 0
    while True:
        while proposed < budget and len(running) < in_flight:
            suggestion = searcher.suggest(str(proposed))
            if suggestion in (None, searcher.FINISHED):
                budget = proposed  # nothing changes while it waits: it has nothing more to propose
                break
            running.append((str(proposed), suggestion["params"]))
            proposed += 1
        if not running:
            return
        trial_id, params = running.popleft()
        searcher.on_trial_complete(trial_id, report(params))
        yield params


def trials_to_reach(scores: Sequence[float], target: float) -> int | None:
    """1-based count of trials until one scored at least ``target`` (None: never)."""
    return next((i + 1 for i, s in enumerate(scores) if s >= target), None)


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
    surface: Surface, algorithm: str, seeds: Iterable[int], tolerance: float = 0.05, in_flight: int = 1, budget: int | None = None
) -> Efficiency:
    """Trials each seed needed to come within ``tolerance`` of the best, searching at most ``budget``."""
    target = (1 - tolerance) * surface.best_score
    needed = [
        trials_to_reach(replay(surface, algorithm, seed, budget=budget, in_flight=in_flight, until=target), target)
        for seed in seeds
    ]  # fmt: skip
    return Efficiency(algorithm, len(needed), len(surface.results), needed)
