"""Optuna samplers behind Ray Tune, with constraints that actually reach the sampler.

Ray's ``OptunaSearch`` does not pass constraint values on, so this searcher drives an Optuna
study through ask/tell itself: ``suggest`` asks (and answers at once, as infeasible, a point
that breaks the space's static constraints, without running it), ``on_trial_complete`` sets
the trial's constraint values (``Trial.set_constraint``, which TPE, NSGA-II and GP all read:
<= 0 is feasible) and tells the objective values. TPE runs with ``constant_liar`` so parallel
trials spread out. The searcher's state is its history of told points: pickling keeps that
history and rebuilds the Optuna study from it.
"""

from __future__ import annotations

import json
import pickle
from typing import Any

import optuna
from ray.tune.search import Searcher

from servetune.config.space import Range, SearchSpace
from servetune.study.objectives import PENALTY

optuna.logging.set_verbosity(optuna.logging.WARNING)

OBJECTIVES_KEY = "servetune_objectives"
CONSTRAINTS_KEY = "servetune_constraints"

Told = tuple[dict[str, Any], list[float], list[float]]  # params, objective values, constraint values


def make_sampler(algorithm: str, seed: int) -> optuna.samplers.BaseSampler:
    if algorithm == "tpe":
        return optuna.samplers.TPESampler(seed=seed, constant_liar=True, multivariate=True, n_startup_trials=4)
    if algorithm == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=8)
    if algorithm == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=4)
    raise ValueError(f"no Optuna sampler for '{algorithm}'")


def distributions(space: SearchSpace) -> dict[str, optuna.distributions.BaseDistribution]:
    out: dict[str, optuna.distributions.BaseDistribution] = {}
    for name, values in space.params.items():
        if isinstance(values, Range):
            if values.is_int:
                step = int(values.step or 1)
                out[name] = optuna.distributions.IntDistribution(int(values.low), int(values.high), log=values.log, step=step)
            else:
                out[name] = optuna.distributions.FloatDistribution(values.low, values.high, log=values.log, step=values.step)
        else:
            out[name] = optuna.distributions.CategoricalDistribution(values)
    return out


def constraint_names(space: SearchSpace) -> list[str]:
    """One constraint per SLO bound, and ``ran`` (the trial fitted and ran to completion)."""
    return [bound.name for bound in space.slo_bounds.bounds] + ["ran"]


class ConstrainedOptunaSearch(Searcher):
    def __init__(self, space: SearchSpace, *, baseline: bool, history: list[Told] = ()) -> None:
        super().__init__(metric=None, mode=None)
        self.space = space
        self.baseline = baseline
        self.objectives = space.search.objectives
        self.names = constraint_names(space)
        self.distributions = distributions(space)
        self.study = optuna.create_study(
            directions=["maximize" if o.mode == "max" else "minimize" for o in self.objectives],
            sampler=make_sampler(space.search.algorithm, space.search.seed),
        )
        self.history: list[Told] = []
        self.seen: dict[str, tuple[list[float], list[float]]] = {}
        for params, values, constraints in history:
            self._add_finished(params, values, constraints)
        self.live: dict[str, optuna.trial.Trial | None] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"space": self.space, "baseline": self.baseline, "history": self.history}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["space"], baseline=state["baseline"], history=state["history"])

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.__getstate__(), f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__setstate__(pickle.load(f))

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict, **spec: Any) -> bool:
        return True  # objectives come from the search space, not from Tune's metric/mode

    def _key(self, params: dict[str, Any]) -> str:
        return json.dumps(params, sort_keys=True, default=str)

    def _penalty(self) -> tuple[list[float], list[float]]:
        return [PENALTY[o.mode] for o in self.objectives], [1.0] * len(self.names)

    def _add_finished(self, params: dict, values: list[float], constraints: list[float]) -> None:
        if set(params) != set(self.distributions):
            return  # the baseline, or a point of another space: nothing the sampler can use
        self.history.append((params, values, constraints))
        self.seen[self._key(params)] = (values, constraints)
        self.study.add_trial(
            optuna.trial.create_trial(
                params=params, distributions=self.distributions, values=values,
                constraints=dict(zip(self.names, constraints)),
            )  # fmt: skip
        )

    def _tell(self, trial: optuna.trial.Trial, values: list[float], constraints: list[float]) -> None:
        for name, value in zip(self.names, constraints):
            trial.set_constraint(name, value)
        self.study.tell(trial, values)
        self.history.append((dict(trial.params), values, constraints))

    def suggest(self, trial_id: str) -> dict | None:
        if self.baseline:
            self.baseline = False
            self.live[trial_id] = None
            return {"params": {}}
        for attempt in range(60):
            trial = self.study.ask(self.distributions)
            params = dict(trial.params)
            key = self._key(params)
            if key in self.seen and attempt >= 20:
                # The sampler keeps coming back to measured points (GP on a small discrete
                # space does): explore an unmeasured point instead, and learn from it as usual.
                fresh = self._unseen_point(params)
                if fresh is None:
                    self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
                    return Searcher.FINISHED
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
                self.study.enqueue_trial(fresh)
                trial = self.study.ask(self.distributions)
                params, key = dict(trial.params), self._key(fresh)
            if key in self.seen:  # measured (or running) already: tell the known answer, ask again
                self._tell(trial, *self.seen[key])
                continue
            if self.space.constraint_violations(params):
                self._tell(trial, *self._penalty())
                continue
            self.live[trial_id] = trial
            self.seen[key] = self._penalty()  # until the trial tells its own answer
            return {"params": params}
        return Searcher.FINISHED

    def _unseen_point(self, near: dict[str, Any]) -> dict[str, Any] | None:
        """The unmeasured grid point closest to what the sampler asked for (None if none is left)."""
        try:
            kept, _ = self.space.grid()
        except ValueError:
            return None  # a continuous space: the sampler will not run out of new points
        unseen = [p for p in kept if self._key(p) not in self.seen]
        if not unseen:
            return None
        return min(unseen, key=lambda p: self._distance(p, near))

    def _distance(self, a: dict[str, Any], b: dict[str, Any]) -> float:
        total = 0.0
        for name, dist in self.distributions.items():
            if isinstance(dist, optuna.distributions.CategoricalDistribution):
                total += float(a[name] != b[name])
            else:
                total += abs(a[name] - b[name]) / max(dist.high - dist.low, 1e-12)
        return total

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        trial = self.live.pop(trial_id, None)
        if trial is None:
            return
        if error or not result or OBJECTIVES_KEY not in result:
            values, constraints = self._penalty()
        else:
            values, constraints = json.loads(result[OBJECTIVES_KEY]), json.loads(result[CONSTRAINTS_KEY])
        self.seen[self._key(dict(trial.params))] = (values, constraints)
        self._tell(trial, values, constraints)
