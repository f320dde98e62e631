"""Early stopping by dominance on made-up results, and what early stopping saved."""

import pytest

from servetune.accounting import early_stop_savings, stop_cause
from servetune.load.runner import Level
from servetune.results import MARGIN, MIN_MARGIN, KvCapacityReport, LevelRun, noise_margin
from servetune.study.early_stop import FinishedPoints, dominating_point, judge, optimistic_scale, stop_reason
from tests.builders import level, trial

SLOW = ("ttft_ms_p99 = 3000 > 2000",)


def point(result, index=0):
    return result.operating_points()[index]


# Cost is price x devices / output tok/s: at 2 USD per device-hour, 1 device at 1000 tok/s
# costs 0.56 $/Mtok, at 500 tok/s 1.11 $/Mtok.
FINISHED = trial("done", {"max_num_seqs": 64}, [level(4, 1000, 300), level(16, 2000, 900)])
LADDER = [Level("concurrency", c) for c in (4, 16, 64)]


def remaining(result):
    return LADDER[len(result.levels) :]


def test_a_costlier_and_slower_point_with_no_levels_left_is_dominated():
    running = trial("run", {"max_num_seqs": 8}, [level(4, 500, 400)])
    finished = FINISHED.operating_points()
    assert dominating_point(point(running), finished).trial_id == "done"
    assert judge(running, [], finished).startswith("dominated at concurrency 4: trial done at concurrency 4")


def test_a_trial_slower_at_low_load_keeps_climbing_while_higher_levels_could_still_make_it_cheapest():
    """The case that lost the winner: max_num_seqs 32 costs more at concurrency 2 than the baseline,
    but at 16 in flight it could be 4x cheaper than now: nothing finished beats that bound."""
    running = trial("run", {"max_num_seqs": 32}, [level(4, 500, 400)])
    assert optimistic_scale(running, remaining(running)) == 8.0  # 4 -> 32 (max_num_seqs caps 64)
    assert judge(running, remaining(running), FINISHED.operating_points()) is None


def test_the_engine_s_limits_cap_the_optimistic_bound():
    capped = trial("run", {"max_num_seqs": 4}, [level(4, 500, 400)])
    assert optimistic_scale(capped, remaining(capped)) == 1.0  # 4 at once already: more clients only queue
    assert judge(capped, remaining(capped), FINISHED.operating_points()).startswith("dominated at concurrency 4")
    kv = capped.model_copy(
        update={"engine_args": {}, "kv_capacity": KvCapacityReport(tokens=8192, max_concurrency=8.0)}
    )
    assert optimistic_scale(kv, remaining(kv)) == 2.0  # the KV cache holds 8 requests of max_model_len
    dp = capped.model_copy(update={"engine_args": {"max_num_seqs": 4, "data_parallel_size": 4}})
    assert optimistic_scale(dp, remaining(dp)) == 4.0
    resolved = capped.model_copy(update={"engine_args": {}, "resolved_engine_args": {"max_num_seqs": 8}})
    assert optimistic_scale(resolved, remaining(resolved)) == 2.0


@pytest.mark.parametrize(
    "out_tps, ttft_p99",
    [(500, 200), (1500, 400), (1000, 300), (500, 310), (1080, 400)],
    ids=["faster", "cheaper", "equal", "slower-within-noise", "costlier-within-noise"],
)
def test_better_on_either_count_or_within_the_noise_is_not_dominated(out_tps, ttft_p99):
    running = trial("run", {"max_num_seqs": 8}, [level(4, out_tps, ttft_p99)])
    assert judge(running, [], FINISHED.operating_points()) is None


def test_a_finished_point_at_another_level_counts():
    running = trial("run", {"max_num_seqs": 8}, [level(1, 500, 1000)])  # concurrency 1; done's points are at 4 and 16
    assert judge(running, [], FINISHED.operating_points()).startswith(
        "dominated at concurrency 1: trial done at concurrency"
    )


def test_a_finished_point_that_broke_the_slo_is_no_alternative():
    broke = trial("broke", {"max_num_seqs": 64}, [level(4, 1000, 300, violations=("tpot_ms_p99 = 150 > 100",))])
    running = trial("run", {"max_num_seqs": 8}, [level(4, 500, 400)])
    assert judge(running, [], broke.operating_points()) is None


def test_the_margin_comes_from_the_level_s_repeats():
    once = level(4, 500, 400)
    assert noise_margin(once) == MARGIN
    runs = [LevelRun(summary=level(4, tps, 400).summary) for tps in (400, 500, 600)]  # +-20% around 500
    assert noise_margin(once.model_copy(update={"runs": runs})) == pytest.approx(0.2)
    tight = [LevelRun(summary=level(4, tps, 400).summary) for tps in (499, 500, 501)]
    assert noise_margin(once.model_copy(update={"runs": tight})) == MIN_MARGIN
    # 0.56 against 1.11 $/Mtok is 50% cheaper: dominated under a 20% margin; not under 60%
    noisy = trial("run", {"max_num_seqs": 8}, [once.model_copy(update={"runs": runs})])
    assert judge(noisy, [], FINISHED.operating_points()) is not None


def test_devices_count_in_the_cost():
    # Twice the throughput on four devices costs twice as much per token as the finished trial.
    running = trial("run", {"tensor_parallel_size": 4}, [level(4, 2000, 400)], devices=4)
    assert judge(running, [], FINISHED.operating_points()) is not None


def test_a_trial_never_dominates_itself_and_the_cheapest_dominator_is_named():
    cheaper = trial("cheaper", {"max_num_seqs": 128}, [level(4, 1500, 350)])
    running = trial("done", {"max_num_seqs": 64}, [level(4, 400, 500)])  # the same id as FINISHED
    finished = [*FINISHED.operating_points(), *cheaper.operating_points()]
    assert dominating_point(point(running), finished).trial_id == "cheaper"
    assert dominating_point(point(running), FINISHED.operating_points()) is None


def test_the_reason_names_both_points_and_the_bound():
    running = trial("run", {"max_num_seqs": 8}, [level(4, 250, 400)])
    reason = judge(running, [Level("concurrency", 8)], FINISHED.operating_points())
    # at concurrency 8 it could at best halve its cost; done at 16 is cheaper still but slower (900 ms)
    assert reason == ("dominated at concurrency 4: trial done at concurrency 4 costs $0.556/Mtok "
                      "(this one $2.22, at best $1.11 higher up) with TTFT p99 300 ms (this one 400 ms)")  # fmt: skip
    assert stop_reason(point(running), None) is None


def test_finished_points_keep_complete_trials_and_levels_that_met_the_slo():
    board = FinishedPoints([
        trial("ok", {"max_num_seqs": 64}, [level(4, 1000, 300), level(16, 2000, 3000, violations=SLOW)]),
        trial("crashed", {"max_num_seqs": 32}, [level(4, 1000, 300)], outcome="FAILED", reason="engine died"),
    ])  # fmt: skip
    assert [(p.trial_id, p.level_index) for p in board.points()] == [("ok", 0)]
    board.add(trial("later", {"max_num_seqs": 16}, [level(4, 800, 200)]))
    assert [p.trial_id for p in board.points()] == ["ok", "later"]


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

    class Board:  # stands in for the actor handle: points.remote gives what ray.get returns
        def __init__(self, answer, capacities=()):
            self.points = type("Method", (), {"remote": staticmethod(lambda: answer)})()
            self.capacities = type("Method", (), {"remote": staticmethod(lambda: list(capacities))})()

    def get(answers, timeout):
        for answer in answers:
            if isinstance(answer, Exception):
                raise answer
        return answers

    monkeypatch.setattr(ray, "get", get)
    running = trial("run", {"max_num_seqs": 8}, [level(4, 500, 400)])
    board = FinishedPoints([FINISHED])
    assert dominance_rule(Board(board.points()))(running, []).startswith("dominated at concurrency 4")
    assert dominance_rule(Board([]))(running, []) is None
    assert dominance_rule(Board(GetTimeoutError("slow")))(running, []) is None
    assert dominance_rule(Board(RayActorError()))(running, []) is None


def test_a_trial_whose_capacity_cannot_beat_a_finished_ones_at_a_lower_cost_stops():
    """In capacity terms: a finished trial carries 16 clients within the SLO at 0.28 $/Mtok. A running trial that broke
    the SLO at 8 clients can carry fewer than 8, at best at its cost now: it stops, though its latency is better
    than the finished trial's there (which dominance by cost and TTFT alone would not stop)."""
    from servetune.results import Capacity

    done = trial(
        "done",
        {"max_num_seqs": 64},
        [level(4, 1000, 300), level(16, 2000, 900), level(32, 2100, 3000, violations=SLOW)],
    )
    done.capacity_at_slo = Capacity(value=16, unit="concurrency", bracket=(16, 32), bound="exact", tolerance=0.1)
    board = FinishedPoints([done])
    (capacity,) = board.capacities()
    assert (capacity.trial_id, capacity.kind, capacity.value) == ("done", "concurrency", 16)
    # Its ladder met the SLO at 4 clients and broke it at 8; the search met it at 6, at 250 ms: it can carry fewer
    # than 8 clients, at best at 7 (the search's next), where it still costs more than the finished trial at 16.
    running = trial("run", {"max_num_seqs": 8}, [level(4, 700, 200), level(8, 900, 2500, violations=SLOW),
                                                 level(6, 850, 250)])  # fmt: skip
    ahead = [Level("concurrency", 7)]
    assert judge(running, ahead, board.points()) is None  # its 250 ms: not dominated by cost and TTFT
    reason = judge(running, ahead, board.points(), board.capacities())
    assert reason.startswith("dominated at concurrency 6 in capacity: trial done carries 16 clients within the SLO")
    assert "this one at most 8 clients" in reason
    # One that could still carry more than the finished trial, or at a lower cost, goes on.
    climbing = trial("up", {"max_num_seqs": 64}, [level(4, 700, 200)])
    assert judge(climbing, LADDER[1:], board.points(), board.capacities()) is None  # up to 64 clients
    cheap = trial("cheap", {"max_num_seqs": 8}, [level(4, 3000, 200), level(8, 3200, 2500, violations=SLOW),
                                                 level(6, 3100, 250)])  # fmt: skip
    assert judge(cheap, ahead, board.points(), board.capacities()) is None


def test_a_replayed_cut_knows_only_the_levels_it_kept_not_the_capacity_its_full_run_found():
    """study/replay.stop_early cuts a recorded trial where the dominance rule would have stopped it live. A live trial
    stopped there has no capacity yet, so the cut's headline level is among its own levels (cap42 makes a found
    capacity the headline): it must not carry the full run's capacity and knee."""
    from servetune.results import Capacity
    from servetune.study.replay import stop_early

    recorded = trial("run", {"max_num_seqs": 8}, [level(4, 500, 400), level(16, 600, 1500), level(64, 700, 3000, violations=SLOW)])  # fmt: skip
    recorded.capacity_at_slo = Capacity(value=16, unit="concurrency", bracket=(16, 64), bound="exact", tolerance=0.1)
    ultra = trial("done", {"max_num_seqs": 64}, [level(4, 5000, 100), level(16, 9000, 200), level(64, 12000, 300)])
    cut = stop_early(recorded, LADDER, ultra.operating_points())
    assert cut.stopped_because and len(cut.levels) < len(recorded.levels)
    assert cut.capacity_at_slo is None and cut.knee is None
    assert cut.best_level_index is not None and cut.best_level_index < len(cut.levels)
