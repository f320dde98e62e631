"""Early stopping by dominance on made-up results, and what early stopping saved."""

import pytest

from servetune.accounting import early_stop_savings, stop_cause
from servetune.study.early_stop import FinishedPoints, dominated_at_level, dominating_point, stop_reason
from tests.builders import level, trial

SLOW = ("ttft_ms_p99 = 3000 > 2000",)


def point(result, index=0):
    return result.operating_points()[index]


# Cost is price x devices / output tok/s: at 2 USD per device-hour, 1 device at 1000 tok/s
# costs 0.56 $/Mtok, at 500 tok/s 1.11 $/Mtok.
FINISHED = trial("done", {"max_num_seqs": 64}, [level(4, 1000, 300), level(16, 2000, 900)])


def test_a_costlier_and_slower_point_at_the_same_level_is_dominated():
    running = trial("run", {"max_num_seqs": 8}, [level(4, 500, 400)])
    finished = FINISHED.operating_points()
    assert dominated_at_level(point(running), finished)
    assert dominating_point(point(running), finished).trial_id == "done"


@pytest.mark.parametrize(
    "out_tps, ttft_p99",
    [(500, 200), (1500, 400), (1000, 300), (500, 310), (1040, 400)],
    ids=["faster", "cheaper", "equal", "slower-within-noise", "costlier-within-noise"],
)
def test_better_on_either_count_is_not_dominated(out_tps, ttft_p99):
    running = trial("run", {"max_num_seqs": 8}, [level(4, out_tps, ttft_p99)])
    assert not dominated_at_level(point(running), FINISHED.operating_points())


def test_only_points_at_the_same_level_count():
    running = trial("run", {"max_num_seqs": 8}, [level(1, 500, 1000)])  # concurrency 1: nothing finished there
    assert not dominated_at_level(point(running), FINISHED.operating_points())


def test_a_finished_point_that_broke_the_slo_is_no_alternative():
    broke = trial("broke", {"max_num_seqs": 64}, [level(4, 1000, 300, violations=("tpot_ms_p99 = 150 > 100",))])
    running = trial("run", {"max_num_seqs": 8}, [level(4, 500, 400)])
    assert not dominated_at_level(point(running), broke.operating_points())


def test_devices_count_in_the_cost():
    # Twice the throughput on four devices costs twice as much per token as the finished trial.
    running = trial("run", {"tensor_parallel_size": 4}, [level(4, 2000, 400)], devices=4)
    assert dominated_at_level(point(running), FINISHED.operating_points())


def test_a_trial_never_dominates_itself_and_the_cheapest_dominator_is_named():
    cheaper = trial("cheaper", {"max_num_seqs": 128}, [level(4, 1500, 350)])
    running = trial("done", {"max_num_seqs": 64}, [level(4, 400, 500)])  # the same id as FINISHED
    finished = [*FINISHED.operating_points(), *cheaper.operating_points()]
    assert dominating_point(point(running), finished).trial_id == "cheaper"
    assert dominating_point(point(running), FINISHED.operating_points()) is None


def test_the_reason_names_the_level_the_dominating_trial_and_both_points():
    running = trial("run", {"max_num_seqs": 8}, [level(4, 500, 400)])
    dominator = dominating_point(point(running), FINISHED.operating_points())
    reason = stop_reason(point(running), dominator)
    assert reason.startswith("dominated at concurrency 4: trial done costs $0.556/Mtok (this one $1.11)")
    assert "TTFT p99 300 ms (this one 400 ms)" in reason
    assert stop_reason(point(running), None) is None


def test_finished_points_keep_complete_trials_and_levels_that_met_the_slo():
    board = FinishedPoints([
        trial("ok", {"max_num_seqs": 64}, [level(4, 1000, 300), level(16, 2000, 3000, violations=SLOW)]),
        trial("crashed", {"max_num_seqs": 32}, [level(4, 1000, 300)], outcome="FAILED", reason="engine died"),
    ])  # fmt: skip
    assert [p.trial_id for p in board.at_level({"concurrency": 4})] == ["ok"]
    assert board.at_level({"concurrency": 16}) == []  # broke the SLO there
    board.add(trial("later", {"max_num_seqs": 16}, [level(4, 800, 200)]))
    assert [p.trial_id for p in board.at_level({"concurrency": 4.0})] == ["ok", "later"]
    assert board.at_level({"rate": 4}) == []


@pytest.mark.parametrize(
    "stopped_because, cause",
    [
        (None, None),
        ("dominated at concurrency 4: trial x costs ...", "dominated"),
        ("SLO broken at concurrency 16: ttft_ms_p99 = 3000 > 2000", "slo"),
        ("saturated at concurrency 16: output throughput 10.0 tok/s, best so far 11.0", "saturated"),
        ("no request completed at concurrency 1", "no requests"),
        ("something new", "other"),
    ],
)
def test_stop_cause(stopped_because, cause):
    assert stop_cause(stopped_because) == cause


def test_savings_are_the_levels_not_run_at_the_trial_s_own_pace_times_its_devices():
    def stopped(trial_id, devices, n_levels, because, outcome="COMPLETE"):
        levels = [level(2**i, 1000, 300) for i in range(n_levels)]  # 60 measured seconds each
        result = trial(trial_id, {"tensor_parallel_size": devices}, levels, outcome=outcome, devices=devices)
        return result.model_copy(update={"stopped_because": because, "duration_s": 60.0 * (n_levels + 1)})

    results = [
        stopped("full", 1, 4, None),
        stopped("dom", 2, 1, "dominated at concurrency 1: ..."),  # 3 levels of 60 s on 2 devices: 6 min
        stopped("slo", 4, 2, "SLO broken at concurrency 2: ..."),  # 2 levels on 4 devices: 8 min
        stopped("failed", 8, 1, "dominated at concurrency 1: ...", outcome="FAILED"),  # a failure saved nothing
    ]
    out = early_stop_savings(results, planned_levels=4)
    assert out["saved_by_cause"] == pytest.approx({"dominated": 6.0, "slo": 8.0})
    assert out["device_minutes_saved"] == pytest.approx(14.0)
    assert out["trials_stopped"] == {"dominated": 1, "slo": 1}
    assert out["device_minutes_spent"] == pytest.approx(5 + 2 * 2 + 4 * 3 + 8 * 2)


def test_the_rule_a_trial_uses_asks_the_board_and_keeps_climbing_when_it_cannot(monkeypatch):
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    from servetune.study.early_stop import dominance_rule

    class Board:  # stands in for the actor handle: at_level.remote gives what ray.get returns
        def __init__(self, answer):
            self.at_level = type("Method", (), {"remote": staticmethod(lambda level: answer)})()

    def get(answer, timeout):
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(ray, "get", get)
    running = point(trial("run", {"max_num_seqs": 8}, [level(4, 500, 400)]))
    board = FinishedPoints([FINISHED])
    assert dominance_rule(Board(board.at_level({"concurrency": 4}))).__call__(running).startswith("dominated at concurrency 4")
    assert dominance_rule(Board([])).__call__(running) is None
    assert dominance_rule(Board(GetTimeoutError("slow"))).__call__(running) is None
    assert dominance_rule(Board(RayActorError())).__call__(running) is None
