"""The order trials are proposed in, the packing invariants, and where reserved device time went."""

import heapq
import random

import pytest

from servetune.study.packing import (
    Reservation,
    order_for_packing,
    overlapping,
    peak_devices,
    time_accounting,
    trials_to_fill,
    utilization,
)
from tests.builders import level, trial


def sizes(points):
    return [p["gpus"] for p in points]


def make(*gpus):
    return [{"gpus": g, "n": i} for i, g in enumerate(gpus)]


def gpus_of(point):
    return point["gpus"]


def test_largest_first_and_stable_within_a_size():
    points = make(1, 4, 2, 1, 4, 2, 1)
    ordered = order_for_packing(points, gpus_of, devices_per_node=8)
    assert sizes(ordered) == [4, 4, 2, 2, 1, 1, 1]
    assert [p["n"] for p in ordered if p["gpus"] == 1] == [0, 3, 6]  # the grid's order among equals


def test_sizes_that_do_not_divide_the_node_are_proposed_as_bins_that_fill_it():
    ordered = order_for_packing(make(3, 3, 3, 3, 2, 2, 1, 1), gpus_of, devices_per_node=8)
    assert sizes(ordered) == [3, 3, 2, 3, 3, 2, 1, 1]  # 3 + 3 + 2 fills 8; plain sorting would leave 2 idle


@pytest.mark.parametrize("seed", range(20))
def test_the_order_is_a_permutation_and_divisible_sizes_come_largest_first(seed):
    rng = random.Random(seed)
    points = make(*(rng.choice([1, 2, 4, 8]) for _ in range(rng.randrange(0, 30))))
    ordered = order_for_packing(points, gpus_of, devices_per_node=8)
    assert sorted(p["n"] for p in ordered) == list(range(len(points)))
    assert sizes(ordered) == sorted(sizes(points), reverse=True)


def test_without_a_node_size_the_largest_trial_sets_it():
    assert sizes(order_for_packing(make(1, 2, 2, 1), gpus_of)) == [2, 2, 1, 1]
    assert order_for_packing([], gpus_of) == []


def test_enough_trials_in_flight_to_fill_every_gpu_with_the_smallest_plus_one_waiting():
    assert trials_to_fill(8, [4, 2, 1]) == 9
    assert trials_to_fill(4, [4, 2]) == 3
    assert trials_to_fill(8, []) == 9


# --- a model of Tune's start order: what the order buys -------------------------------------


def simulate(points, durations, capacity, window):
    """Trials proposed in order, at most ``window`` in flight; any proposed trial whose GPUs are
    free starts, earliest proposed first (Tune's placement-group requests). Returns reservations."""
    time, free, next_index = 0.0, capacity, 0
    waiting, running, done = [], [], []
    while next_index < len(points) or waiting or running:
        while next_index < len(points) and len(waiting) + len(running) < window:
            waiting.append(next_index)
            next_index += 1
        for index in list(waiting):
            if points[index]["gpus"] <= free:
                waiting.remove(index)
                free -= points[index]["gpus"]
                heapq.heappush(running, (time + durations[points[index]["n"]], index, time))
        end, index, start = heapq.heappop(running)
        time, free = end, free + points[index]["gpus"]
        done.append(Reservation(start, end, points[index]["gpus"], str(index)))
    return done


@pytest.mark.parametrize("seed", range(10))
def test_in_the_model_packing_order_beats_the_grid_order_and_never_oversubscribes(seed):
    rng = random.Random(seed)
    # A grid over TP x DP x something else: the grid's order interleaves sizes.
    points = make(*([1, 2, 4, 2, 4] * 6))
    durations = [rng.uniform(20, 60) for _ in points]
    grid = simulate(points, durations, capacity=8, window=trials_to_fill(8, [1]))
    packed = simulate(order_for_packing(points, gpus_of, 8), durations, capacity=8, window=trials_to_fill(8, [1]))
    assert peak_devices(packed) <= 8 and peak_devices(grid) <= 8
    assert utilization(packed, 8) >= utilization(grid, 8) - 0.02
    assert utilization(packed, 8) > 0.8


# --- reservations -----------------------------------------------------------------------------


def test_utilization_is_reserved_over_available_from_first_start_to_last_end():
    reservations = [Reservation(0, 10, 4), Reservation(0, 10, 2), Reservation(10, 20, 8)]
    assert utilization(reservations, 8) == pytest.approx((40 + 20 + 80) / 160)
    assert utilization([], 8) == 0.0


def test_peak_devices_counts_a_handover_at_the_same_instant_once():
    assert peak_devices([Reservation(0, 10, 4), Reservation(10, 20, 4), Reservation(5, 15, 4)]) == 8
    assert peak_devices([Reservation(0, 10, 4), Reservation(2, 3, 4), Reservation(2.5, 4, 1)]) == 9


def test_overlapping_pairs():
    a, b, c = Reservation(0, 10, 1, "a"), Reservation(5, 15, 1, "b"), Reservation(15, 20, 1, "c")
    assert [(x.label, y.label) for x, y in overlapping([c, b, a])] == [("a", "b")]


# --- time accounting --------------------------------------------------------------------------


def timed(trial_id, devices, duration_s, startup_s, levels, outcome="COMPLETE"):
    return trial(trial_id, {"tensor_parallel_size": devices}, levels, outcome=outcome, devices=devices).model_copy(
        update={"duration_s": duration_s, "startup_s": startup_s}
    )


def test_time_accounting_splits_reserved_device_time_into_measuring_starting_and_the_rest():
    results = [
        timed("a", 1, 200.0, 60.0, [level(1, 100, 300), level(4, 300, 500)]),  # 2 levels x 60 s measured
        timed("b", 4, 100.0, 50.0, [level(1, 100, 300)]),  # 60 s measured
        timed("c", 2, 30.0, None, [], outcome="FAILED"),  # the engine never came up
    ]
    out = time_accounting(results)
    assert out["device_seconds"] == pytest.approx(200 + 400 + 60)
    assert out["measuring_device_seconds"] == pytest.approx(120 + 240)
    assert out["starting_device_seconds"] == pytest.approx(60 + 4 * min(50, 100 - 60))
    assert out["other_device_seconds"] == pytest.approx(660 - 360 - 220)
    assert out["measuring_share"] + out["starting_share"] + out["other_share"] == pytest.approx(1.0)
    assert out["engine_starts"] == 2 and out["startup_s_mean"] == pytest.approx(55) and out["startup_s_max"] == 60


def test_time_accounting_of_nothing():
    out = time_accounting([])
    assert out["device_seconds"] == 0 and out["measuring_share"] == 0 and out["startup_s_mean"] is None
