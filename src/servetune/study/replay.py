"""Replaying a recorded response surface: how many trials a search needs, without engines.

A surface is a grid measured once for real (every point of a search space's grid, each a
trial's ``result.json``), stored with how it was made. Replaying it runs the study's own
search code (the grid's order, random points, and :class:`ConstrainedOptunaSearch` for TPE,
NSGA-II and GP, constraints included) and answers each proposal with the recorded result, so
a search's cost can be counted in trials over many seeds in seconds.

The score of a trial is its best goodput that met the SLO (0 when none did, or when it failed
or did not fit); a search has *reached* the optimum once a trial scored within ``tolerance``
of the best score on the surface, or with the target ``noise`` (:func:`reaching`), within the
two points' measured noise of it where that is the wider margin.

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
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml

from servetune.config.space import Range, SearchSpace
from servetune.errors import UserError
from servetune.load.runner import Level
from servetune.results import MARGIN, OperatingPoint, TrialResult, best_level, throughput_noise
from servetune.study.objectives import objectives_and_constraints

ALGORITHMS = ("grid", "random", "tpe", "nsga2", "gp")
#: What counts as finding the best: within ``tolerance`` of it, or within the larger of that and the noise.
TARGETS = ("tolerance", "noise")
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
    def from_results(
        cls, space: SearchSpace, results: Iterable[TrialResult], made_by: dict[str, Any] | None = None
    ) -> Surface:
        if any(isinstance(values, Range) for values in space.params.values()):
            raise UserError(f"search space '{space.name}': a surface needs lists for every parameter, not ranges")
        by_key = {key(r.params): r for r in results}
        kept, _ = space.grid()
        missing = [p for p in kept if key(p) not in by_key]
        if missing:
            raise UserError(
                f"search space '{space.name}': {len(missing)} of {len(kept)} grid points have no result, e.g. {missing[0]}"
            )
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
            raise UserError(
                f"search space '{self.space.name}': no recorded trial met the SLO, so there is no optimum to find"
            )
        return best

    def score_of(self, params: dict[str, Any]) -> float:
        return score(self.results[key(params)])


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
        reason = judge(recorded.model_copy(update={"levels": levels}), planned[index + 1 :], finished)
        if reason:
            cut = recorded.model_copy(update={"levels": levels, "stopped_because": reason})
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


def trials_to_reach(scores: Sequence[float], target: float) -> int | None:
    """1-based count of trials until one scored at least ``target`` (None: never)."""
    return next((i + 1 for i, s in enumerate(scores) if s >= target), None)


def score_noise(result: TrialResult) -> float:
    """How much a repeat of a trial's score could differ: the throughput noise of the level it is judged at
    (results ``throughput_noise``: half its repeats' spread, at least ``MIN_MARGIN``; ``MARGIN`` when run once)."""
    index = best_level(result) if result.outcome == "COMPLETE" else None
    return MARGIN if index is None else throughput_noise(result.levels[index])


def reaching(surface: Surface, tolerance: float = 0.05, target: str = "tolerance") -> set[str]:
    """The grid points (by :func:`key`) that count as finding the best. ``tolerance``: scoring within ``tolerance``
    of the best. ``noise``: below the best by no more than the larger of ``tolerance`` and the two points' noise
    together (:func:`score_noise`), the rule servetune's results compare two measurements by (report/recommend.py
    rule 4): a point a repeat could rank first is as good a find as the best. The second holds the first."""
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
    Bayesian searcher proposes ``proposed_first`` first (:func:`estimate_seeds_for`)."""
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
