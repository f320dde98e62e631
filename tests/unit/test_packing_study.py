"""The study proposes grid points in packing order, and its summary says where device time went."""

from servetune.accounting import device_time_lines
from servetune.config.space import SearchSpace
from servetune.study.driver import proposals
from tests.builders import level, trial


def space(max_concurrent: int, **search) -> SearchSpace:
    return SearchSpace.model_validate({
        "name": "s", "model": "org/m", "workload": "chat", "hardware": {"devices_per_node": 8},
        "params": {"tensor_parallel_size": [1, 2, 4], "max_num_seqs": [64, 256]},
        "search": {"algorithm": "grid", "max_concurrent": max_concurrent, **search},
    })  # fmt: skip


def test_one_trial_at_a_time_keeps_the_grid_order_and_the_baseline_first():
    points = proposals(space(1), None)
    assert points[0] == {}
    assert [p["tensor_parallel_size"] for p in points[1:]] == [1, 1, 2, 2, 4, 4]


def test_several_at_a_time_propose_smallest_first_in_node_filling_groups():
    points = proposals(space(4), None)
    assert [space(4).devices(p) for p in points] == [1, 1, 1, 2, 2, 4, 4]
    assert points[0] == {}  # the baseline (1 device) stays first among the smallest
    assert [p["max_num_seqs"] for p in points if p.get("tensor_parallel_size") == 4] == [
        64,
        256,
    ]  # the grid's order among equals


def test_max_trials_picks_the_same_points_whatever_the_order():
    assert sorted(map(str, proposals(space(4), 3))) == sorted(map(str, proposals(space(1), 3)))


def timed(trial_id, devices, levels, because=None, startup_s=30.0):
    result = trial(trial_id, {"tensor_parallel_size": devices}, levels, devices=devices)
    return result.model_copy(
        update={"duration_s": 60.0 * (len(levels) + 1), "startup_s": startup_s, "stopped_because": because}
    )


def test_the_summary_states_device_time_by_phase_and_what_early_stopping_saved():
    results = [
        timed("a", 1, [level(1, 100, 100), level(4, 300, 200), level(16, 600, 400)]),
        timed("b", 4, [level(1, 100, 500)], because="dominated at concurrency 1: ..."),
    ]
    lines = device_time_lines(results, "gpu", planned_levels=3)
    assert lines[0] == ("GPU time: 12.0 GPU-min reserved by 2 trial(s): 58% measuring, 21% starting engines "
                        "(2 starts, mean 30 s, max 30 s), 21% warm-up, teardown and checks")  # fmt: skip
    assert lines[1] == "early stopping saved about 8.0 GPU-min (dominated: 1 trial(s), 8.0 GPU-min)"


def test_the_summary_without_early_stops_or_trials():
    results = [timed("a", 1, [level(1, 100, 100)] * 3)]
    assert device_time_lines(results, "cpu", 3)[1] == "early stopping: every ladder ran to its last level"
    assert device_time_lines(results, "cpu", 3)[0].startswith("core time: 4.0 core-min reserved by 1 trial(s)")
    assert device_time_lines([], "gpu", 3) == []
