"""The study's search pieces without Ray: objectives, constraints, the ladder, the searcher."""

import json

import numpy as np
import pytest

from servetune.config.settings import Objective
from servetune.config.slo import Slo
from servetune.config.space import SearchSpace
from servetune.load.runner import Level
from servetune.study.objectives import PENALTY, objectives_and_constraints
from servetune.study.searcher import CONSTRAINTS_KEY, FAILURE_KEY, OBJECTIVES_KEY, ConstrainedOptunaSearch
from servetune.trial.ladder import ladder
from tests.builders import level, trial

SLO = Slo.parse("ttft_ms.p99=2000,tpot_ms.p99=100")
GOODPUT = (Objective(metric="goodput", mode="max"),)


def test_objectives_of_a_trial_meeting_the_slo():
    t = trial("a", {"x": 1}, [level(1, 600, 500), level(4, 1200, 1500), level(16, 1800, 3000, violations=("ttft",))])
    t.best_level_index = 1
    values, constraints = objectives_and_constraints(t, GOODPUT, SLO)
    assert values == [pytest.approx(1200 / 60)]
    assert constraints == [pytest.approx(1500 / 2000 - 1), pytest.approx(40 / 100 - 1), 0.0]


def test_constraints_of_a_trial_breaking_the_slo_use_its_least_bad_level():
    t = trial("b", {"x": 1}, [level(1, 600, 2500, violations=("ttft",)), level(4, 900, 4000, violations=("ttft",))])
    values, constraints = objectives_and_constraints(t, GOODPUT, SLO)
    assert constraints[0] == pytest.approx(2500 / 2000 - 1) and constraints[0] > 0
    assert values == [pytest.approx(600 / 60)]


@pytest.mark.parametrize("outcome", ["INFEASIBLE", "FAILED"])
def test_trials_that_did_not_run_are_infeasible(outcome):
    values, constraints = objectives_and_constraints(trial("c", {}, [], outcome=outcome), GOODPUT, SLO)
    assert values == [PENALTY["max"]] and constraints == [1.0, 1.0, 1.0]


def test_ladder_stops_on_slo_break_and_saturation():
    levels = [Level("concurrency", c) for c in (1, 2, 4, 8)]
    steps = ladder(levels, stop_on_slo_break=True, min_gain=0.05)
    assert next(steps).value == 1
    assert steps.send(level(1, 100, 100)).value == 2
    assert steps.send(level(2, 200, 100)).value == 4
    with pytest.raises(StopIteration) as stop:
        steps.send(level(4, 205, 100))  # +2.5%: saturated
    assert stop.value.value.startswith("saturated at concurrency 4")

    steps = ladder(levels, stop_on_slo_break=True)
    next(steps)
    with pytest.raises(StopIteration) as stop:
        steps.send(level(1, 100, 5000, violations=("ttft_ms_p99 = 5000 > 2000",)))
    assert "SLO broken at concurrency 1" in stop.value.value

    steps = ladder(levels[:2], stop_on_slo_break=False)
    next(steps)
    assert steps.send(level(1, 100, 5000, violations=("x",))).value == 2
    with pytest.raises(StopIteration) as stop:
        steps.send(level(2, 50, 5000, violations=("x",)))
    assert stop.value.value is None  # the last level ends the ladder, not a rule


def make_space(algorithm="tpe", **extra) -> SearchSpace:
    data = {
        "name": "s", "model": "m", "workload": "cpu-tiny", "slo": {"ttft_ms": {"p99": 1000}},
        "params": {"x": list(range(1, 61)), "y": [1, 2]},
        "constraints": ["y == 1 or x <= 45"],
        "search": {"algorithm": algorithm, "seed": 3, "objectives": [{"metric": "goodput", "mode": "max"}]},
    }  # fmt: skip
    data.update(extra)
    return SearchSpace.model_validate(data)


def answer(params):
    """A made-up response surface: goodput grows with x, but x > 30 breaks the TTFT SLO."""
    x = params["x"]
    ttft = 500 + 1000 * max(0, x - 30)
    return [float(x)], [ttft / 1000 - 1, 0.0]


@pytest.mark.parametrize("algorithm", ["tpe", "nsga2", "gp"])
def test_searcher_learns_the_constraint(algorithm):
    searcher = ConstrainedOptunaSearch(make_space(algorithm), baseline=True)
    assert searcher.suggest("t0") == {"params": {}}  # the baseline comes first
    searcher.on_trial_complete("t0", {OBJECTIVES_KEY: json.dumps([0.0]), CONSTRAINTS_KEY: json.dumps([0.0, 0.0])})
    proposed = []
    for i in range(1, 31):
        config = searcher.suggest(f"t{i}")
        params = config["params"]
        assert params["y"] == 1 or params["x"] <= 45  # static constraints never reach a trial
        values, constraints = answer(params)
        searcher.on_trial_complete(
            f"t{i}", {OBJECTIVES_KEY: json.dumps(values), CONSTRAINTS_KEY: json.dumps(constraints)}
        )
        proposed.append(params["x"])
    measured = [t for t in searcher.study.trials if t.state.name == "COMPLETE"]
    assert all(t.constraints for t in measured)  # every told point carries its constraint values
    if algorithm == "tpe":  # TPE learns fastest on a discrete space: mostly feasible late on
        assert sum(x <= 30 for x in proposed[-12:]) >= 8, proposed
    best = list(searcher.study.best_trials)
    best_x = [searcher._values(t)["x"] for t in best]  # GP sees x as its index in the list
    assert best and all(x <= 30 for x in best_x)  # the best feasible point, not the highest x
    assert max(best_x) >= 22


def test_searcher_never_reruns_a_measured_point_and_survives_pickling():
    import pickle

    space = make_space("tpe", params={"x": [1, 2, 3], "y": [1]}, constraints=[])
    searcher = ConstrainedOptunaSearch(space, baseline=False)
    seen = []
    for i in range(3):
        params = searcher.suggest(f"t{i}")["params"]
        seen.append(params["x"])
        searcher.on_trial_complete(
            f"t{i}", {OBJECTIVES_KEY: json.dumps([1.0]), CONSTRAINTS_KEY: json.dumps([0.0, 0.0])}
        )
    assert sorted(seen) == [1, 2, 3]
    clone = pickle.loads(pickle.dumps(searcher))
    assert len(clone.study.trials) == len(searcher.study.trials)


def test_a_trial_that_failed_for_the_clusters_reasons_teaches_the_searcher_nothing():
    """Its point is not told a penalty (FAIL: every sampler ignores it) and is not finished, so it can run again."""
    space = make_space("tpe", params={"x": [1, 2], "y": [1]}, constraints=[])
    searcher = ConstrainedOptunaSearch(space, baseline=False)
    first = searcher.suggest("t0")["params"]
    searcher.on_trial_complete("t0", {OBJECTIVES_KEY: json.dumps([0.0]), CONSTRAINTS_KEY: json.dumps([1.0, 1.0]),
                                      FAILURE_KEY: "infrastructure"})  # fmt: skip
    assert not searcher.finished and not searcher.history
    assert [t.state.name for t in searcher.study.trials] == ["FAIL"]
    proposals = [searcher.suggest(f"t{i}")["params"] for i in (1, 2)]
    assert first in proposals  # proposed again: nothing was learned from it
    # A failure that is the configuration's is told as today: the penalty, and the point is finished.
    searcher.on_trial_complete("t1", {OBJECTIVES_KEY: json.dumps([0.0]), CONSTRAINTS_KEY: json.dumps([1.0, 1.0]),
                                      FAILURE_KEY: "configuration"})  # fmt: skip
    assert len(searcher.finished) == 1


def test_searcher_resumes_from_history():
    space = make_space("tpe")
    history = [({"x": x, "y": 1}, *answer({"x": x})) for x in (3, 40, 18)]
    searcher = ConstrainedOptunaSearch(space, baseline=False, history=history)
    assert len(searcher.study.trials) == 3
    assert [t.constraints for t in searcher.study.trials][1]["ttft_ms_p99"] > 0
    assert np.isfinite(searcher.study.trials[0].value)


def test_gp_fits_on_one_torch_thread_and_gives_the_driver_its_threads_back(monkeypatch):
    import optuna
    import torch

    seen = []
    fit = optuna.samplers.GPSampler.sample_relative

    def watched(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(optuna.samplers.GPSampler, "sample_relative", watched)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        searcher = ConstrainedOptunaSearch(make_space("gp"), baseline=False)
        for i in range(6):  # past the 4 start-up trials: GP fits its model for the last ones
            params = searcher.suggest(f"t{i}")["params"]
            values, constraints = answer(params)
            searcher.on_trial_complete(
                f"t{i}", {OBJECTIVES_KEY: json.dumps(values), CONSTRAINTS_KEY: json.dumps(constraints)}
            )
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_gp_sees_a_list_of_numbers_as_ordered_and_proposes_its_values():
    """GP gets a list of numbers as its index (``max_num_seqs: [2, 8, 32]``: 8 lies between 2 and 32); the
    trials, the history and the pickled searcher carry the values; other lists, and other samplers, see categories."""
    import pickle

    import optuna

    params = {"x": [64, 4, 16, 1], "y": [True, False], "q": [None, "fp8"], "z": [0.5, 2.0]}
    gp = ConstrainedOptunaSearch(make_space("gp", params=params, constraints=[]), baseline=False,
                                 history=[({"x": 16, "y": True, "q": None, "z": 0.5}, [1.0], [0.0, 0.0]),
                                          ({"x": 32, "y": True, "q": None, "z": 0.5}, [9.0], [0.0, 0.0])])  # fmt: skip
    assert gp.distributions["x"] == optuna.distributions.IntDistribution(0, 3)  # 1, 4, 16, 64
    assert all(
        isinstance(gp.distributions[n], optuna.distributions.CategoricalDistribution) for n in "yqz"
    )  # bools, None, two numbers
    assert [t.params["x"] for t in gp.study.trials] == [2]  # 16 is index 2; 32 is no longer listed: left out
    proposed = []
    for i in range(5):
        point = gp.suggest(f"t{i}")["params"]
        proposed.append(point["x"])
        gp.on_trial_complete(
            f"t{i}", {OBJECTIVES_KEY: json.dumps([float(point["x"])]), CONSTRAINTS_KEY: json.dumps([0.0, 0.0])}
        )
    assert set(proposed) <= {1, 4, 16, 64}, proposed
    assert {p["x"] for p, _, _ in gp.history} == {16, *proposed}  # values (a known point proposed again is told again)
    clone = pickle.loads(pickle.dumps(gp))
    assert [t.params for t in clone.study.trials] == [t.params for t in gp.study.trials if t.state.name == "COMPLETE"]
    near = {"x": 64, "y": True, "q": None, "z": 0.5}
    assert gp._distance(near, {**near, "x": 16}) < gp._distance(near, {**near, "x": 1})  # steps along the list
    tpe = ConstrainedOptunaSearch(make_space("tpe", params=params, constraints=[]), baseline=False)
    assert isinstance(
        tpe.distributions["x"], optuna.distributions.CategoricalDistribution
    )  # TPE learnt worse from the index


def test_gp_climbs_a_list_of_numbers_to_its_peak_in_a_few_trials():
    """A made-up surface over ten batch sizes: goodput peaks at 128 and falls off on both sides, a flag adds a
    little. Seen as categories, GP needed up to 11 trials to reach the peak on these seeds; in order, at most 6."""
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]

    def goodput(point):
        return 100.0 - 10 * abs(sizes.index(point["x"]) - 7) + (3 if point["y"] else 0)

    needed = []
    for seed in range(8):
        space = make_space("gp", params={"x": sizes, "y": [True, False]}, constraints=[], search={
            "algorithm": "gp", "seed": seed, "objectives": [{"metric": "goodput", "mode": "max"}]})  # fmt: skip
        searcher = ConstrainedOptunaSearch(space, baseline=False)
        for i in range(1, 21):
            point = searcher.suggest(f"t{i}")["params"]
            if goodput(point) == 103.0:
                break
            searcher.on_trial_complete(
                f"t{i}", {OBJECTIVES_KEY: json.dumps([goodput(point)]), CONSTRAINTS_KEY: json.dumps([0.0, 0.0])}
            )
        needed.append(i)
    assert max(needed) <= 7, needed


def test_gp_on_lists_explores_the_closest_unmeasured_point_instead_of_proposing_a_measured_one_again():
    """GP proposes its acquisition's maximum, so a measured point it proposes once it proposes again: each time told
    anew, a copy that slowed every later fit (a 30-trial search took 90 s, not 5). On lists (the grid is GP's whole
    domain) the closest unmeasured point is explored at once; with a range the grid is only a sample of it, so the
    searcher asks again first, as for the other samplers."""
    searcher = ConstrainedOptunaSearch(make_space("gp"), baseline=False)
    for i in range(30):
        point = searcher.suggest(f"t{i}")["params"]
        values, constraints = answer(point)
        searcher.on_trial_complete(
            f"t{i}", {OBJECTIVES_KEY: json.dumps(values), CONSTRAINTS_KEY: json.dumps(constraints)}
        )
    told = [json.dumps(p, sort_keys=True) for p, _, _ in searcher.history]
    assert (
        len(told) == len(set(told)) >= 30
    )  # no measured point told twice (a point breaking a constraint: told its penalty)
    ranged = make_space("gp", params={"x": {"low": 1, "high": 60}, "y": [1, 2]})
    assert (
        ConstrainedOptunaSearch(ranged, baseline=False).repeats_before_nudge
        == ConstrainedOptunaSearch.REPEATS_BEFORE_NUDGE
    )


@pytest.mark.parametrize("algorithm", ["tpe", "gp"])
def test_resume_over_a_changed_space_skips_what_it_no_longer_holds_and_keys_values_as_listed(algorithm):
    """--resume after the space was edited: a value no longer listed, or out of its range now, is left out (it
    once stopped the run); a value recorded as 4.0 is the listed 4, so that point is not measured again."""
    params = {"x": [1, 4, 16], "y": [True, False], "z": {"low": 1, "high": 10}}
    space = make_space(algorithm, params=params, constraints=[])
    ok = [0.0, 0.0]
    history = [({"x": 1.0, "y": True, "z": 3}, [1.0], ok), ({"x": 4.0, "y": True, "z": 3}, [2.0], ok),
               ({"x": 16.0, "y": True, "z": 3}, [3.0], ok),
               ({"x": 8, "y": True, "z": 3}, [9.0], ok), ({"x": 4, "y": 1, "z": 3}, [9.0], ok),  # 8: no longer listed; 1: not True
               ({"x": 4, "y": False, "z": 20}, [9.0], ok)]  # fmt: skip  # z 20: out of its range now
    searcher = ConstrainedOptunaSearch(space, baseline=False, history=history)
    assert [p for p, _, _ in searcher.history] == [{"x": x, "y": True, "z": 3} for x in (1, 4, 16)]
    assert all(type(p["x"]) is int for p, _, _ in searcher.history)  # as listed
    assert len(searcher.study.trials) == 3
    assert {json.dumps(p, sort_keys=True) for p, _, _ in searcher.history} <= set(searcher.finished)


def energy_trial(trial_id: str, params: dict, joules: list[float], device: str = "gpu"):
    """A trial whose levels measured these joules over their measured windows (its devices' energy)."""
    levels = [level(2**i, 600 * (i + 1), 500 * (i + 1)) for i in range(len(joules))]
    key = "gpu_energy_measured_j" if device == "gpu" else "cpu_energy_measured_j"
    for lv, j in zip(levels, joules, strict=True):
        lv.telemetry = {key: j, "gpu_energy_j": 10 * j}  # the whole level's energy is not what counts
    return trial(trial_id, params, levels, device=device)


def test_energy_per_token_is_an_objective_at_the_told_level():
    t = energy_trial("e", {"x": 1}, [3600.0, 7200.0])
    t.levels[1].slo_violations = []
    energy = (Objective(metric="energy_per_token", mode="min"), Objective(metric="energy_per_request", mode="min"))
    values, constraints = objectives_and_constraints(t, energy, SLO)
    told = t.levels[1].summary  # both meet the SLO: the higher goodput is told
    assert values == [pytest.approx(7200.0 / told.total_output_tokens), pytest.approx(7200.0 / told.completed)]
    assert constraints[-1] == 0.0
    # a trial whose energy was not measured (no RAPL on the CPU stand-in) is told the penalty, not a zero
    unmeasured = trial("u", {"x": 2}, [level(1, 600, 500)])
    assert objectives_and_constraints(unmeasured, energy, SLO)[0] == [PENALTY["min"], PENALTY["min"]]
    # the CPU stand-in's energy is its host's packages' (RAPL)
    cpu = energy_trial("c", {"x": 3}, [600.0], device="cpu")
    assert objectives_and_constraints(cpu, energy[:1], SLO)[0] == [pytest.approx(600.0 / 36000)]


@pytest.mark.parametrize("algorithm", ["grid", "random", "tpe", "nsga2", "gp"])
def test_every_searcher_minimizes_energy_per_token_under_the_slo(algorithm):
    """x costs energy the less it batches, and x > 30 breaks the TTFT SLO: the searchers that learn find low
    energy within the SLO, and every algorithm accepts the objective."""
    objectives = [{"metric": "energy_per_token", "mode": "min"}]
    space = make_space(algorithm, search={"algorithm": algorithm, "seed": 3, "objectives": objectives})
    if algorithm in ("grid", "random"):  # no sampler: the study only reports the objective
        assert space.search.objectives[0].metric == "energy_per_token"
        return
    searcher = ConstrainedOptunaSearch(space, baseline=False)
    for i in range(25):
        params = searcher.suggest(f"t{i}")["params"]
        x = params["x"]
        lv = level(8, 600 + 20 * x, 500 + 1000 * max(0, x - 30), violations=("ttft",) if x > 30 else ())
        lv.telemetry = {"gpu_energy_measured_j": 36000.0 * (1 + 1 / x)}
        values, constraints = objectives_and_constraints(trial(f"t{i}", params, [lv]), space.search.objectives,
                                                         space.slo_bounds)  # fmt: skip
        searcher.on_trial_complete(
            f"t{i}", {OBJECTIVES_KEY: json.dumps(values), CONSTRAINTS_KEY: json.dumps(constraints)}
        )
    best = [searcher._values(t)["x"] for t in searcher.study.best_trials]
    assert best and all(x <= 30 for x in best)  # the least energy that meets the SLO, not the highest x
