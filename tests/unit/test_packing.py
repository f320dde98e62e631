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


def test_node_sized_bins_that_mix_sizes_largest_first():
    # 3 + 12 + 24 = 39 devices: 5 bins of 8; the 4s spread over them first, then the 2s, then the 1s.
    points = make(*([1, 2, 4, 2, 4] * 3))
    ordered = order_for_packing(points, gpus_of, devices_per_node=8)
    assert sizes(ordered) == [4, 4, 4, 2, 2, 4, 2, 2, 4, 2, 1, 1, 4, 2, 1]
    assert [p["n"] for p in ordered if p["gpus"] == 2] == [1, 3, 6, 8, 11, 13]  # the grid's order among equals


def test_sizes_that_do_not_divide_the_node():
    ordered = order_for_packing(make(3, 3, 3, 3, 2, 2, 1, 1), gpus_of, devices_per_node=8)
    assert sizes(ordered) == [3, 3, 3, 2, 1, 3, 2, 1]  # bins 3+3, 3+2+1, 3+2+1


def test_one_size_keeps_the_grid_order():
    points = make(2, 2, 2, 2, 2)
    assert order_for_packing(points, gpus_of, devices_per_node=8) == points


@pytest.mark.parametrize("seed", range(20))
def test_the_order_is_a_permutation_that_starts_with_a_largest_trial(seed):
    rng = random.Random(seed)
    points = make(*(rng.choice([1, 2, 3, 4, 8]) for _ in range(rng.randrange(0, 30))))
    ordered = order_for_packing(points, gpus_of, devices_per_node=8)
    assert sorted(p["n"] for p in ordered) == list(range(len(points)))
    if points:
        assert ordered[0]["gpus"] == max(sizes(points))
    for size in set(sizes(points)):
        assert [p["n"] for p in ordered if p["gpus"] == size] == [p["n"] for p in points if p["gpus"] == size]


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


MIXES = {
    "tp x dp <= 4": [1, 2, 4, 2, 4] * 6,
    "few small": [1] * 2 + [2] * 6 + [4] * 6,
    "many small": [1] * 16 + [2] * 6 + [4] * 4,
    "sizes that do not divide": [3, 3, 2, 1] * 6,
    "up to a node": [8, 4, 2, 1, 2, 4] * 4,
}


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("window", [3, 5, 9, 100])
def test_in_the_model_bins_keep_gpus_busier_than_the_grid_order_or_largest_first(mix, window):
    mean = {"grid": 0.0, "largest first": 0.0, "bins": 0.0}
    draws = 40
    for seed in range(draws):
        rng = random.Random(seed)
        points = make(*MIXES[mix])
        durations = [rng.uniform(20, 60) for _ in points]
        orders = {"grid": points, "largest first": sorted(points, key=lambda p: -p["gpus"]),
                  "bins": order_for_packing(points, gpus_of, 8)}  # fmt: skip
        for name, order in orders.items():
            reservations = simulate(order, durations, capacity=8, window=window)
            assert peak_devices(reservations) <= 8 and len(reservations) == len(points)
            mean[name] += utilization(reservations, 8) / draws
    assert mean["bins"] >= mean["grid"] - 0.03 and mean["bins"] >= mean["largest first"] - 0.03, mean


def test_in_the_model_bins_do_better_on_average():
    totals = {"grid": [], "largest first": [], "bins": []}
    for mix in MIXES.values():
        for window in (3, 5, 9, 100):
            for seed in range(20):
                rng = random.Random(seed)
                points = make(*mix)
                durations = [rng.uniform(20, 60) for _ in points]
                for name, order in (("grid", points), ("largest first", sorted(points, key=lambda p: -p["gpus"])),
                                    ("bins", order_for_packing(points, gpus_of, 8))):  # fmt: skip
                    totals[name].append(utilization(simulate(order, durations, 8, window), 8))
    mean = {name: sum(v) / len(v) for name, v in totals.items()}
    assert mean["bins"] > mean["largest first"] + 0.01 and mean["bins"] > mean["grid"] + 0.02, mean


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
