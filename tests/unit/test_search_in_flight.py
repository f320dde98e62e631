"""Trials in flight: the searcher never tells a running point as a result, and random search
goes through the same searcher (Optuna's seeded ``RandomSampler``)."""

import json
import pickle

import optuna
import pytest

from servetune.config.space import SearchSpace
from servetune.study.driver import proposals, random_points
from servetune.study.objectives import PENALTY
from servetune.study.searcher import CONSTRAINTS_KEY, OBJECTIVES_KEY, ConstrainedOptunaSearch

COMPLETE, FAIL, RUNNING = (
    optuna.trial.TrialState.COMPLETE,
    optuna.trial.TrialState.FAIL,
    optuna.trial.TrialState.RUNNING,
)


def make_space(
    algorithm="tpe", x=tuple(range(1, 61)), y=(1, 2), constraints=("y == 1 or x <= 45",), **search
) -> SearchSpace:
    return SearchSpace.model_validate({
        "name": "s", "model": "m", "workload": "cpu-tiny", "slo": {"ttft_ms": {"p99": 1000}},
        "params": {"x": list(x), "y": list(y)}, "constraints": list(constraints),
        "search": {"algorithm": algorithm, "seed": 3, "objectives": [{"metric": "goodput", "mode": "max"}], **search},
    })  # fmt: skip


def answer(params) -> tuple[list[float], list[float]]:
    """A made-up surface: goodput is x + y, every point feasible."""
    return [float(params["x"] + params["y"])], [-0.5, 0.0]


def report(params) -> dict[str, str]:
    values, constraints = answer(params)
    return {OBJECTIVES_KEY: json.dumps(values), CONSTRAINTS_KEY: json.dumps(constraints)}


def told_values(searcher) -> list[tuple[dict, list[float]]]:
    return [(t.params, t.values) for t in searcher.study.trials if t.state == COMPLETE]


@pytest.mark.parametrize("algorithm", ["tpe", "gp", "nsga2", "random"])
def test_a_re_proposed_running_point_is_never_told_a_result_nor_kept(algorithm):
    # Four points, all asked before any result: the samplers re-propose running points often.
    searcher = ConstrainedOptunaSearch(make_space(algorithm, x=(1, 2), constraints=()), baseline=False)
    running = {f"t{i}": searcher.suggest(f"t{i}")["params"] for i in range(4)}
    assert sorted((p["x"], p["y"]) for p in running.values()) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert searcher.suggest("t4") == searcher.FINISHED  # every point runs: nothing left to propose
    states = [t.state for t in searcher.study.trials]
    assert states.count(RUNNING) == 4 and FAIL in states  # re-proposals happened, and were dropped
    assert told_values(searcher) == [] and searcher.history == []

    searcher.on_trial_complete("t0", report(running["t0"]))
    assert searcher.suggest("t5") == searcher.FINISHED  # a re-proposal of the finished point is told its answer
    assert all(values == answer(params)[0] for params, values in told_values(searcher))
    assert [params for params, _, _ in searcher.history] == [running["t0"]] * len(searcher.history)
    for trial_id in ("t1", "t2", "t3"):
        searcher.on_trial_complete(trial_id, report(running[trial_id]))
    assert all(values == answer(params)[0] and values != [PENALTY["max"]] for params, values in told_values(searcher))
    assert {json.dumps(p, sort_keys=True) for p, _, _ in searcher.history} == {
        json.dumps(p, sort_keys=True) for p in running.values()
    }


def test_pickling_mid_flight_keeps_only_finished_results():
    searcher = ConstrainedOptunaSearch(make_space("tpe", x=(1, 2, 3), constraints=()), baseline=False)
    running = {f"t{i}": searcher.suggest(f"t{i}")["params"] for i in range(5)}
    searcher.on_trial_complete("t0", report(running["t0"]))
    clone = pickle.loads(pickle.dumps(searcher))
    assert [params for params, _, _ in clone.history] == [running["t0"]]
    assert [(t.params, t.values) for t in clone.study.trials] == [(running["t0"], answer(running["t0"])[0])]
    assert clone.live == {}
    nxt = clone.suggest("t5")["params"]  # the restored searcher proposes again, never the finished point
    assert nxt != running["t0"]


def test_random_search_draws_from_optuna_s_seeded_random_sampler_through_the_searcher():
    space = make_space("random", num_trials=12)
    points = random_points(space)
    # The same draws, asked of Optuna directly: the first 12 distinct points that meet the constraint.
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    searcher = ConstrainedOptunaSearch(space, baseline=False)
    expected: list[dict] = []
    while len(expected) < 12:
        params = study.ask(searcher.distributions).params
        if params not in expected and not space.constraint_violations(params):
            expected.append(params)
    assert points == expected
    assert all(p["y"] == 1 or p["x"] <= 45 for p in points)
    assert random_points(space) == points  # seeded: reproducible
    assert random_points(make_space("random", num_trials=12, seed=4)) != points
    assert proposals(space, None) == [{}, *points[:11]]  # the baseline first, num_trials in all


def test_random_search_stops_at_the_space_s_size():
    space = make_space("random", x=(1, 2, 3), y=(1,), constraints=("x != 2",), baseline=False, num_trials=10)
    assert sorted(p["x"] for p in proposals(space, None)) == [1, 3]
