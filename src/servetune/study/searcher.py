"""Optuna samplers behind Ray Tune, with constraints that actually reach the sampler.

Ray's ``OptunaSearch`` does not pass constraint values on, so this searcher drives an Optuna
study through ask/tell itself: ``suggest`` asks (and answers at once, as infeasible, a point
that breaks the space's static constraints, without running it), ``on_trial_complete`` sets
the trial's constraint values (``Trial.set_constraint``, which TPE, NSGA-II and GP all read:
<= 0 is feasible) and tells the objective values.

Trials in flight stay RUNNING in the Optuna study until their result comes back, and are never
told anything else: TPE (``constant_liar``) and GP (batch acquisition) steer away from running
points, NSGA-II and random search ignore them. When the sampler proposes a point again:
- if it is still running, that proposal is told FAIL, a state every sampler ignores, and the
  searcher asks again (a running point has no result to tell);
- if it has finished, the proposal is told its measured answer (real data, told again); GP, whose
  proposal would be the same again, explores the closest unmeasured point instead where the space
  is lists only.
GP sees a list of three or more numbers as its index (``ordered``): 8 lies between 2 and 32.
A trial that failed for the cluster's reasons (trial/failures.py: its port taken, its GPU held by another
process, the model hub refusing) is told FAIL too: it says nothing about its point.
The searcher's state is its history of finished, told points: pickling keeps only that history
and rebuilds the Optuna study from it; trials in flight are not part of it.
"""

from __future__ import annotations

import contextlib
import json
import pickle
from collections.abc import Iterator, Sequence
from typing import Any

import optuna
from ray.tune.search import Searcher

from servetune.config.space import Range, SearchSpace
from servetune.study.objectives import PENALTY

optuna.logging.set_verbosity(optuna.logging.WARNING)

OBJECTIVES_KEY = "servetune_objectives"
CONSTRAINTS_KEY = "servetune_constraints"
FAILURE_KEY = "servetune_failure_kind"  # "infrastructure": the trial failed for reasons outside its configuration
#: Beside a proposal's params: who proposed it where not the sampler ("estimate #1 of 4": study/forecast.py).
PROPOSED_KEY = "servetune_proposed_by"

Told = tuple[dict[str, Any], list[float], list[float]]  # params, objective values, constraint values


def make_sampler(algorithm: str, seed: int) -> optuna.samplers.BaseSampler:
    if algorithm == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if algorithm == "tpe":
        return optuna.samplers.TPESampler(seed=seed, constant_liar=True, multivariate=True, n_startup_trials=4)
    if algorithm == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=8)
    if algorithm == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=4)
    raise ValueError(f"no Optuna sampler for '{algorithm}'")


@contextlib.contextmanager
def one_torch_thread(algorithm: str) -> Iterator[None]:
    """GP fits its model with torch, which runs every fit on a thread per core: in the driver of a
    CPU study those threads take the cores the trials' engines run on, and on a busy two-core host
    one thread is 3-5x faster with the same proposals (bench/README.md). Other samplers: no-op."""
    if algorithm != "gp":
        yield
        return
    import torch  # GPSampler's own dependency

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


#: The samplers that see a list of numbers as its index (:func:`ordered`). GP models the index as a number, so
#: it learns that 8 lies between 2 and 32; replayed on the recorded surfaces, it then needs fewer trials
#: (bench/README.md, "Lists of numbers in order"). TPE needed more, NSGA-II the same: they see categories.
ORDERED_FOR = frozenset({"gp"})


def ordered(values: list[Any]) -> list[Any] | None:
    """A list of three or more distinct numbers, sorted: GP sees its index, so it knows 8 lies between 2 and 32
    (as a category, each value is learnt on its own). None for any other list."""
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    if not numbers or len(values) < 3 or len(set(values)) != len(values):
        return None
    return sorted(values)


def orders(space: SearchSpace) -> dict[str, list[Any]]:
    """The lists the space's sampler sees as their index (:data:`ORDERED_FOR`), each sorted."""
    if space.search.algorithm not in ORDERED_FOR:
        return {}
    return {
        name: order
        for name, values in space.params.items()
        if not isinstance(values, Range) and (order := ordered(values)) is not None
    }


def distributions(space: SearchSpace) -> dict[str, optuna.distributions.BaseDistribution]:
    """The sampler's view of each parameter: ranges as they are, a list in :func:`orders` as its index, any
    other list as categories."""
    indexed = orders(space)
    out: dict[str, optuna.distributions.BaseDistribution] = {}
    for name, values in space.params.items():
        if isinstance(values, Range):
            if values.is_int:
                step = int(values.step or 1)
                out[name] = optuna.distributions.IntDistribution(
                    int(values.low), int(values.high), log=values.log, step=step
                )
            else:
                out[name] = optuna.distributions.FloatDistribution(
                    values.low, values.high, log=values.log, step=values.step
                )
        elif name in indexed:
            out[name] = optuna.distributions.IntDistribution(0, len(values) - 1)
        else:
            out[name] = optuna.distributions.CategoricalDistribution(values)
    return out


def constraint_names(space: SearchSpace) -> list[str]:
    """One constraint per SLO bound, one per bounded quality score, and ``ran`` (the trial fitted and ran to completion)."""
    return (
        [bound.name for bound in space.slo_bounds.bounds]
        + [f"quality.{name}" for name in space.quality_bounds]
        + ["ran"]
    )


class ConstrainedOptunaSearch(Searcher):
    #: Proposals of known points before the searcher picks the closest unmeasured one itself.
    REPEATS_BEFORE_NUDGE = 20
    #: Asks per ``suggest`` before the searcher gives up (``FINISHED``).
    MAX_ASKS = 60

    def __init__(
        self, space: SearchSpace, *, baseline: bool, history: Sequence[Told] = (), seeds: Sequence[dict[str, Any]] = ()
    ) -> None:
        super().__init__(metric=None, mode=None)
        self.space = space
        self.baseline = baseline
        self.baselines_left = space.baselines() if baseline else []  # vLLM's defaults, on each GPU type compared
        self.objectives = space.search.objectives
        self.names = constraint_names(space)
        self.distributions = distributions(space)
        self.orders = orders(space)
        # GP's proposal is its acquisition's maximum: a point it proposes again, it will propose again (each time
        # told anew, a copy that slows every later fit). Where the grid is the sampler's whole domain (lists only:
        # a range's grid is a sample of it), its closest unmeasured point is explored at once.
        lists_only = all(isinstance(values, list) for values in space.params.values())
        self.repeats_before_nudge = 0 if space.search.algorithm == "gp" and lists_only else self.REPEATS_BEFORE_NUDGE
        self.study = optuna.create_study(
            directions=["maximize" if o.mode == "max" else "minimize" for o in self.objectives],
            sampler=make_sampler(space.search.algorithm, space.search.seed),
        )
        self.history: list[Told] = []
        self.finished: dict[str, tuple[list[float], list[float]]] = {}
        for params, values, constraints in history:
            self._add_finished(params, values, constraints)
        self.live: dict[str, optuna.trial.Trial | None] = {}  # by Tune trial id; None: the baseline
        # The estimate's likely winners, best first: asked before the sampler's own proposals (Optuna's queue),
        # each marked with its rank so its result says the estimate proposed it. One already measured is not.
        self.seeds = list(seeds)
        for rank, point in enumerate(self.seeds, 1):
            listed = self._as_listed(point)
            if listed is not None and self._key(listed) not in self.finished:
                self.study.enqueue_trial(
                    self._indexed(listed), user_attrs={PROPOSED_KEY: f"estimate #{rank} of {len(self.seeds)}"}
                )

    def __getstate__(self) -> dict[str, Any]:
        return {"space": self.space, "baseline": self.baseline, "history": self.history, "seeds": self.seeds}

    def __setstate__(self, state: dict[str, Any]) -> None:
        ConstrainedOptunaSearch.__init__(self, state["space"], baseline=state["baseline"], history=state["history"],
                                         seeds=state.get("seeds", ()))  # fmt: skip

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

    def _values(self, trial: optuna.trial.BaseTrial) -> dict[str, Any]:
        """The point an Optuna trial stands for: each ordered list's index turned back into its value."""
        return {name: self.orders[name][v] if name in self.orders else v for name, v in trial.params.items()}

    def _indexed(self, params: dict[str, Any]) -> dict[str, Any]:
        """A point of the space (its values as listed) as the sampler sees it."""
        return {name: self.orders[name].index(v) if name in self.orders else v for name, v in params.items()}

    def _as_listed(self, params: dict[str, Any]) -> dict[str, Any] | None:
        """``params`` with each listed value as the space lists it (``4.0`` recorded, ``4`` listed: ``4``), or
        None where a parameter is missing or extra, or a value is no longer in its list (the space changed since
        it was measured): a point the sampler cannot be told. A value out of its range is Optuna's to refuse."""
        if set(params) != set(self.distributions):
            return None
        out = {}
        for name, value in params.items():
            listed = self.space.params[name]
            if isinstance(listed, Range):  # Optuna checks it against the range (_add_finished)
                out[name] = value
                continue
            same = [v for v in listed if v == value and isinstance(v, bool) == isinstance(value, bool)]
            if not same:
                return None
            out[name] = same[0]
        return out

    def _penalty(self) -> tuple[list[float], list[float]]:
        return [PENALTY[o.mode] for o in self.objectives], [1.0] * len(self.names)

    def running(self) -> set[str]:
        """The keys of the points in flight (proposed, no result yet)."""
        return {self._key(self._values(trial)) for trial in self.live.values() if trial is not None}

    def _add_finished(self, params: dict, values: list[float], constraints: list[float]) -> None:
        listed = self._as_listed(params)
        if listed is None:
            return  # the baseline, or a point of another space: nothing the sampler can use
        try:
            told = optuna.trial.create_trial(
                params=self._indexed(listed), distributions=self.distributions, values=values,
                constraints=dict(zip(self.names, constraints, strict=True)),
            )  # fmt: skip
        except ValueError:
            return  # a value outside its range now (the space changed): not a point of this space
        self.history.append((listed, values, constraints))
        self.finished[self._key(listed)] = (values, constraints)
        self.study.add_trial(told)

    def _tell(self, trial: optuna.trial.Trial, values: list[float], constraints: list[float]) -> None:
        """Tell a finished answer: the measured one, or a penalty for a point that cannot run."""
        for name, value in zip(self.names, constraints, strict=True):
            trial.set_constraint(name, value)
        self.study.tell(trial, values)
        self.history.append((self._values(trial), values, constraints))
        self.finished[self._key(self._values(trial))] = (values, constraints)

    def _drop(self, trial: optuna.trial.Trial) -> None:
        """End an ask that will not run, telling the sampler nothing (FAIL: every sampler ignores it)."""
        self.study.tell(trial, state=optuna.trial.TrialState.FAIL)

    # Ray annotates Optional[Dict], but its docstring and its callers take Searcher.FINISHED (a str) too.
    def suggest(self, trial_id: str) -> dict | str | None:  # type: ignore[override]
        """The next point to run; it stays RUNNING in the Optuna study until its result comes back.

        Asks until the sampler proposes a new point that meets the static constraints: a known
        finished point is told its answer again, a point in flight is dropped, a point breaking
        a constraint is told a penalty. A sampler that keeps proposing known points is nudged to
        the closest unmeasured point (discrete spaces); ``FINISHED`` when none is left.
        """
        if self.baselines_left:
            point = self.baselines_left.pop(0)
            self.baseline = bool(self.baselines_left)
            self.live[trial_id] = None
            return {"params": point}
        with one_torch_thread(self.space.search.algorithm):
            return self._suggest(trial_id, self.running())

    def _suggest(self, trial_id: str, running: set[str]) -> dict | str | None:
        for attempt in range(self.MAX_ASKS):
            trial = self.study.ask(self.distributions)
            point = self._values(trial)
            known = self._key(point) in self.finished or self._key(point) in running
            if known and attempt >= self.repeats_before_nudge:
                nudged = self._nudge(trial, running)
                if nudged is None:
                    return Searcher.FINISHED
                trial = nudged
                point = self._values(trial)
            key = self._key(point)
            if key in running:
                self._drop(trial)
                continue
            if key in self.finished:
                self._tell(trial, *self.finished[key])
                continue
            if self.space.constraint_violations(point):
                self._tell(trial, *self._penalty())
                continue
            self.live[trial_id] = trial
            proposed = trial.user_attrs.get(PROPOSED_KEY)
            return {"params": point, PROPOSED_KEY: proposed} if proposed else {"params": point}
        return Searcher.FINISHED

    def _nudge(self, trial: optuna.trial.Trial, running: set[str]) -> optuna.trial.Trial | None:
        """Replace a repeated proposal by the closest point neither measured nor running (None: none left).

        The sampler keeps coming back to known points (GP on a small discrete space does):
        explore an unmeasured point instead, and learn from it as usual.
        """
        self._drop(trial)
        fresh = self._unseen_point(self._values(trial), running)
        if fresh is None:
            return None
        self.study.enqueue_trial(self._indexed(fresh))
        return self.study.ask(self.distributions)

    def _unseen_point(self, near: dict[str, Any], running: set[str]) -> dict[str, Any] | None:
        """The grid point neither measured nor running closest to ``near`` (None if none is left)."""
        try:
            kept, _ = self.space.grid()
        except ValueError:
            return None  # a continuous space: the sampler will not run out of new points
        unseen = [p for p in kept if self._key(p) not in self.finished and self._key(p) not in running]
        if not unseen:
            return None
        return min(unseen, key=lambda p: self._distance(p, near))

    def _distance(self, a: dict[str, Any], b: dict[str, Any]) -> float:
        total = 0.0
        for name, dist in self.distributions.items():
            if name in self.orders:  # steps along the sorted list
                total += abs(self.orders[name].index(a[name]) - self.orders[name].index(b[name])) / (
                    len(self.orders[name]) - 1
                )
            elif isinstance(dist, optuna.distributions.CategoricalDistribution):
                total += float(a[name] != b[name])
            else:
                # distributions() makes no other kind
                assert isinstance(dist, (optuna.distributions.IntDistribution, optuna.distributions.FloatDistribution))
                total += abs(a[name] - b[name]) / max(dist.high - dist.low, 1e-12)
        return total

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        """Tell a trial's result: its objectives and constraints, or a penalty if it reported none. A trial that
        failed for the cluster's reasons (trial/failures.py) is told nothing: its point may be proposed again."""
        trial = self.live.pop(trial_id, None)
        if trial is None:
            return
        if result and result.get(FAILURE_KEY) == "infrastructure":
            self._drop(trial)
            return
        if error or not result or OBJECTIVES_KEY not in result:
            values, constraints = self._penalty()
        else:
            values, constraints = json.loads(result[OBJECTIVES_KEY]), json.loads(result[CONSTRAINTS_KEY])
        self._tell(trial, values, constraints)
