"""Replaying a recorded response surface: how many trials a search needs, without engines.

A surface (study/surface.py) is a grid measured once for real, every point a trial's ``result.json``. Replaying it
runs the study's own search code (the grid's order, random points, and :class:`ConstrainedOptunaSearch` for TPE,
NSGA-II and GP, constraints included) and answers each proposal with the recorded result, so a search's cost can
be counted in trials over many seeds in seconds (study/replay_cost.py).

With ``seeds`` (:func:`estimate_seeds_for`), a Bayesian searcher is built as a study with
``search.estimate.seed`` builds it: the estimate's likely winners, ranked by the study's own
:func:`~servetune.study.forecast.estimate_seeds`, are its first proposals.

With ``early_stopping``, the replay also runs the study's stop rule (study/early_stop.py
:func:`~servetune.study.early_stop.judge`) on the recorded levels, revealed one at a time: a
trial cut at level ``k`` is told (and scored) as its recording truncated to ``levels[:k+1]``.
A recording may itself have stopped early (SLO broken, saturated), so the replay can only cut
further. A trial is compared with the trials finished when it started: with one in flight
that is every trial before it, exactly as in a study; with several, the trials running
alongside it may finish while it climbs and would then count, which the replay leaves out
(it cuts a little less than a study could).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from servetune.config.space import SearchSpace
from servetune.load.runner import Level
from servetune.results import OperatingPoint, TrialResult, best_level
from servetune.study.objectives import objectives_and_constraints
from servetune.study.surface import Surface, key, score

ALGORITHMS = ("grid", "random", "tpe", "nsga2", "gp")


class Searcher(Protocol):
    """What the replay drives: as much of Ray Tune's ``Searcher`` as Tune itself uses.

    ``suggest`` proposes a trial's config (``{"params": ...}``), ``FINISHED`` when it has
    nothing more to propose; ``on_trial_complete`` is told the trial's final report.
    """

    FINISHED: str

    def suggest(self, trial_id: str) -> dict[str, Any] | str | None: ...

    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False) -> None: ...


def space_for(
    surface: Surface, algorithm: str, seed: int, in_flight: int = 1, budget: int | None = None
) -> SearchSpace:
    """The surface's space searched by ``algorithm``: the baseline (vLLM's defaults, not a grid
    point, so not on the surface) left out; ``in_flight`` at once, as ``servetune run`` would
    order them (the grid's order one at a time, packing order for several); ``budget`` trials
    (``num_trials``; the whole grid if None)."""
    search = surface.space.search.model_copy(
        update={"algorithm": algorithm, "seed": seed, "baseline": False, "max_concurrent": in_flight,
                "num_trials": min(budget or len(surface.results), len(surface.results))}
    )  # fmt: skip
    return surface.space.model_copy(update={"search": search})


def planned_levels(surface: Surface, base_dir: Path = Path()) -> tuple[Level, ...]:
    """The load levels every trial of the surface's space plans to climb, as ``servetune run`` resolves them."""
    from servetune.trial.context import resolve_levels

    return resolve_levels(surface.space, surface.space.resolved_workload(base_dir))


def stop_early(recorded: TrialResult, planned: Sequence[Level], finished: Sequence[OperatingPoint]) -> TrialResult:
    """The recorded result as a ladder with the dominance rule would have ended it.

    The rule is asked after each level the recorded ladder went on from (it is not asked at the
    last planned level, nor where the ladder stopped for its own reasons: trial/ladder.py), with
    the planned levels left. Only a complete trial is cut.
    """
    if recorded.outcome != "COMPLETE":
        return recorded
    from servetune.study.early_stop import judge

    for index in range(min(len(recorded.levels), len(planned)) - 1):
        levels = recorded.levels[: index + 1]
        # what a live trial knows at that level: its levels so far, not the capacity and knee its full run found
        # (a capacity there would make its headline level one it never reached: results/trial.py best_level)
        partial = {"levels": levels, "capacity_at_slo": None, "knee": None}
        reason = judge(recorded.model_copy(update=partial), planned[index + 1 :], finished)
        if reason:
            cut = recorded.model_copy(update={**partial, "stopped_because": reason})
            cut.best_level_index = best_level(cut)
            return cut
    return recorded


@dataclass(frozen=True)
class Told:
    """One trial of a replay as the searcher was told it."""

    params: dict[str, Any]
    result: TrialResult  # the recording, truncated where early stopping cut it
    recorded: TrialResult

    @property
    def cut(self) -> bool:
        return len(self.result.levels) < len(self.recorded.levels)

    @property
    def device_seconds_saved(self) -> float:
        """Measuring time of the recorded levels not run, times the devices the trial held."""
        return (
            sum(level.measured_s for level in self.recorded.levels[len(self.result.levels) :]) * self.recorded.devices
        )


class ReplayRun:
    """One search over a surface: answers each trial from the recording, cut by early stopping when on."""

    def __init__(self, surface: Surface, early_stopping: bool = False) -> None:
        self.surface = surface
        self.planned = planned_levels(surface) if early_stopping else ()
        self.early_stopping = early_stopping
        self.told: list[Told] = []
        self._finished_at_start: dict[str, list[OperatingPoint]] = {}

    def start(self, trial_id: str, params: dict[str, Any]) -> None:
        if self.early_stopping:
            from servetune.study.early_stop import FinishedPoints

            self._finished_at_start[trial_id] = FinishedPoints(t.result for t in self.told).points()

    def tell(self, trial_id: str, params: dict[str, Any]) -> Told:
        recorded = self.surface.results[key(params)]
        result = recorded
        if self.early_stopping:
            result = stop_early(recorded, self.planned, self._finished_at_start.pop(trial_id))
        self.told.append(Told(params, result, recorded))
        return self.told[-1]


def estimate_seeds_for(surface: Surface, algorithm: str, model: str | Path, budget: int | None = None,
                       base_dir: Path = Path()) -> list[dict[str, Any]]:  # fmt: skip
    """The points a study of the surface's space searched by ``algorithm`` with ``budget`` trials proposes first
    (``search.estimate.seed``): the study's own :func:`~servetune.study.forecast.estimate_seeds` and
    :func:`~servetune.study.forecast.seed_count`, the model read from ``model`` (a directory holding its
    ``config.json``, or a catalogue name). Empty for grid and random search, or where seeding is off."""
    from servetune.study.forecast import estimate_seeds, seed_count
    from servetune.trial.context import StudyContext

    space = space_for(surface, algorithm, 0, budget=budget)
    assert space.search.num_trials is not None  # space_for sets it
    workload = space.resolved_workload(base_dir)
    context = StudyContext(space, workload, base_dir, str(model), planned_levels(surface, base_dir))
    return estimate_seeds(context, seed_count(space, space.search.num_trials))


def replay(
    surface: Surface, algorithm: str, seed: int, budget: int | None = None, in_flight: int = 1, until: float | None = None,
    early_stopping: bool = False, seeds: Sequence[dict[str, Any]] = (),
) -> list[float]:  # fmt: skip
    """The scores of the trials a search runs, in the order their results come back (at most ``budget``)."""
    told = replay_trials(surface, algorithm, seed, budget, in_flight, until, early_stopping, seeds)
    return [score(t.result) for t in told]


def replay_trials(
    surface: Surface, algorithm: str, seed: int, budget: int | None = None, in_flight: int = 1, until: float | None = None,
    early_stopping: bool = False, seeds: Sequence[dict[str, Any]] = (),
) -> list[Told]:  # fmt: skip
    """The trials a search runs, as told, in the order their results come back (at most ``budget``).

    Grid and random search run their proposals (:func:`~servetune.study.driver.proposals`);
    the Bayesian searchers are told each result. All run with ``in_flight`` trials at once
    (:func:`in_flight_order`). With ``until``, the replay ends at the first trial scoring at
    least that much. A Bayesian searcher proposes ``seeds`` first (:func:`estimate_seeds_for`); grid and random
    search ignore them, as a study does.
    """
    space = space_for(surface, algorithm, seed, in_flight, budget)
    budget = space.search.num_trials
    assert budget is not None  # space_for sets it
    run = ReplayRun(surface, early_stopping)
    if algorithm in ("grid", "random"):
        from servetune.study.driver import proposals

        searcher: Searcher = ListSearcher(proposals(space, budget))

        def report(trial_id: str, params: dict[str, Any]) -> dict[str, Any]:
            run.tell(trial_id, params)
            return {}
    else:
        from servetune.study.searcher import CONSTRAINTS_KEY, OBJECTIVES_KEY, ConstrainedOptunaSearch

        searcher = ConstrainedOptunaSearch(space, baseline=False, seeds=seeds)

        def report(trial_id: str, params: dict[str, Any]) -> dict[str, Any]:
            told = run.tell(trial_id, params)
            values, constraints = objectives_and_constraints(
                told.result, space.search.objectives, space.slo_bounds, space.quality_bounds
            )
            return {OBJECTIVES_KEY: json.dumps(values), CONSTRAINTS_KEY: json.dumps(constraints)}

    for _ in in_flight_order(searcher, report, budget, in_flight, on_start=run.start):
        if until is not None and score(run.told[-1].result) >= until:
            break
    return run.told


class ListSearcher:
    """A fixed list of proposals (grid and random search) behind the :class:`Searcher` protocol; results change nothing."""

    FINISHED = "FINISHED"

    def __init__(self, points: Sequence[dict[str, Any]]) -> None:
        self._points = deque(points)

    def suggest(self, trial_id: str) -> dict[str, Any] | str:
        return {"params": self._points.popleft()} if self._points else self.FINISHED

    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False) -> None:
        pass


def in_flight_order(
    searcher: Searcher,
    report: Callable[[str, dict[str, Any]], dict[str, Any]],
    budget: int,
    in_flight: int,
    on_start: Callable[[str, dict[str, Any]], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """Drive ``searcher`` as a cluster running ``in_flight`` trials at once would; yield each
    trial's params as its result is told.

    The searcher is asked until ``in_flight`` trials are outstanding (``budget`` in all), then
    the oldest is told its ``report`` and its slot asked again: every proposal after the first
    ``in_flight`` is made with ``in_flight - 1`` others still running. Ends once ``budget``
    trials were told, or the searcher proposes nothing more and none is left running.
    ``on_start`` hears each trial as it is proposed; ``report`` is called with its id and params.
    """
    running: deque[tuple[str, dict[str, Any]]] = deque()
    proposed = 0
    while True:
        while proposed < budget and len(running) < in_flight:
            suggestion = searcher.suggest(str(proposed))
            if not isinstance(suggestion, dict):  # None or FINISHED
                budget = proposed  # nothing changes while it waits: it has nothing more to propose
                break
            running.append((str(proposed), suggestion["params"]))
            if on_start is not None:
                on_start(*running[-1])
            proposed += 1
        if not running:
            return
        trial_id, params = running.popleft()
        searcher.on_trial_complete(trial_id, report(trial_id, params))
        yield params
