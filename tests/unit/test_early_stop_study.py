"""How the study wires early stopping by dominance: the option, the ladder's stop rule, the runner."""

import pytest

from servetune.config.space import SearchSpace
from servetune.load.runner import Level
from servetune.study.early_stop import FinishedPoints, judge
from servetune.trial.ladder import ladder
from tests.builders import level, trial

LEVELS = [Level("concurrency", c) for c in (1, 4, 16)]


def space(**fields) -> SearchSpace:
    return SearchSpace.model_validate({"name": "s", "model": "org/m", "workload": "chat", **fields})


@pytest.mark.parametrize(
    "algorithm, option, stops",
    [("tpe", None, True), ("nsga2", None, True), ("gp", None, True), ("grid", None, False), ("random", None, False),
     ("grid", True, True), ("tpe", False, False)],
)  # fmt: skip
def test_stop_when_dominated_is_on_for_bayesian_search_unless_the_space_says(algorithm, option, stops):
    load = {} if option is None else {"stop_when_dominated": option}
    assert space(search={"algorithm": algorithm}, load=load).stops_when_dominated is stops


def test_the_ladder_stops_where_the_study_s_rule_gives_a_reason():
    seen = []

    def rule(result):
        seen.append(result.summary.level)
        return "dominated at concurrency 4: ..." if result.summary.level == {"concurrency": 4} else None

    steps = ladder(LEVELS, stop_rule=rule)
    assert next(steps).value == 1
    assert steps.send(level(1, 100, 100)).value == 4
    with pytest.raises(StopIteration) as stop:
        steps.send(level(4, 400, 100))
    assert stop.value.value == "dominated at concurrency 4: ..."
    assert seen == [{"concurrency": 1}, {"concurrency": 4}]


def test_the_ladder_s_own_rules_come_first_and_the_last_level_asks_nobody():
    steps = ladder(LEVELS, stop_rule=lambda result: "dominated")
    next(steps)
    with pytest.raises(StopIteration) as stop:
        steps.send(level(1, 100, 5000, violations=("ttft_ms_p99 = 5000 > 2000",)))
    assert stop.value.value.startswith("SLO broken")

    asked = []
    steps = ladder(LEVELS[:1], stop_rule=lambda result: asked.append(result) or "dominated")
    next(steps)
    with pytest.raises(StopIteration) as stop:
        steps.send(level(1, 100, 100))
    assert stop.value.value is None and asked == []


def test_a_rule_over_finished_points_as_a_trial_would_use_it():
    board = FinishedPoints(
        [trial("done", {"max_num_seqs": 64}, [level(1, 300, 100), level(4, 1000, 300), level(16, 2000, 900)])]
    )
    running = trial("run", {"max_num_seqs": 8}, [])

    def rule(result):  # what the runner does with the study's rule: the trial so far and the levels left
        running.levels.append(result)
        return judge(running, LEVELS[len(running.levels) :], board.points())

    steps = ladder(LEVELS, stop_rule=rule)
    next(steps)
    assert steps.send(level(1, 200, 90)).value == 4  # faster than any finished point: keep climbing
    with pytest.raises(StopIteration) as stop:
        steps.send(level(4, 300, 400))  # even at twice the throughput higher up, costlier and slower
    assert stop.value.value.startswith("dominated at concurrency 4: trial done")
