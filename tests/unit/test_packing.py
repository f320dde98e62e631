"""The order trials are proposed in, the packing invariants, and where reserved device time went."""

import heapq
import random

import pytest

from servetune.accounting import device_time_lines, searched_s, time_accounting
from servetune.results import Capacity, Knee
from servetune.study.packing import (
    Reservation,
    max_concurrent_to_fill,
    order_for_packing,
    overlapping,
    peak_devices,
    utilization,
)
from tests.builders import level, trial


def sizes(points):
    return [p["gpus"] for p in points]


def make(*gpus):
    return [{"gpus": g, "n": i} for i, g in enumerate(gpus)]


def gpus_of(point):
    return point["gpus"]


def test_smallest_first_where_sizes_divide_the_node():
    points = make(*([1, 2, 4, 2, 4] * 3))
    ordered = order_for_packing(points, gpus_of, devices_per_node=8)
    assert sizes(ordered) == [1] * 3 + [2] * 6 + [4] * 6
    assert [p["n"] for p in ordered if p["gpus"] == 2] == [1, 3, 6, 8, 11, 13]  # the grid's order among equals


def test_sizes_that_do_not_divide_the_node_come_in_groups_that_fill_it():
    ordered = order_for_packing(make(3, 3, 3, 3, 2, 2, 1, 1), gpus_of, devices_per_node=8)
    assert sizes(ordered) == [1, 1, 2, 3, 3, 2, 3, 3]  # 1 + 1, then 2 + 3 + 3 twice


def test_one_size_keeps_the_grid_order():
    points = make(2, 2, 2, 2, 2)
    assert order_for_packing(points, gpus_of, devices_per_node=8) == points


@pytest.mark.parametrize("seed", range(20))
def test_the_order_is_a_permutation_that_ends_with_a_largest_trial(seed):
    rng = random.Random(seed)
    points = make(*(rng.choice([1, 2, 3, 4, 8]) for _ in range(rng.randrange(0, 30))))
    ordered = order_for_packing(points, gpus_of, devices_per_node=8)
    assert sorted(p["n"] for p in ordered) == list(range(len(points)))
    if points:
        assert ordered[-1]["gpus"] == max(sizes(points))
    for size in set(sizes(points)):
        assert [p["n"] for p in ordered if p["gpus"] == size] == [p["n"] for p in points if p["gpus"] == size]


def test_without_a_node_size_the_largest_trial_sets_it():
    assert sizes(order_for_packing(make(2, 1, 3), gpus_of)) == [1, 2, 3]  # groups of 3: [3], [2, 1]
    assert order_for_packing([], gpus_of) == []


def test_enough_trials_in_flight_for_the_smallest_to_fill_the_node_twice_plus_one():
    assert max_concurrent_to_fill(8, [4, 2, 1]) == 17
    assert max_concurrent_to_fill(4, [4, 2]) == 5
    assert max_concurrent_to_fill(8, []) == 17


# --- a model of Tune's start order: what the order and max_concurrent buy --------------------


def simulate(points, durations, capacity, window, rng, ray_prefers_small=False):
    """Trials proposed in order, at most ``window`` in flight (waiting ones included); when GPUs
    are free, Ray places a proposed trial that fits: any of them, or the smallest (placement
    groups that keep failing to fit back off, so small ones tend to win). Returns reservations."""
    time, free, next_index = 0.0, capacity, 0
    waiting, running, done = [], [], []
    while next_index < len(points) or waiting or running:
        while next_index < len(points) and len(waiting) + len(running) < window:
            waiting.append(next_index)
            next_index += 1
        while fitting := [i for i in waiting if points[i]["gpus"] <= free]:
            index = min(fitting, key=lambda i: points[i]["gpus"]) if ray_prefers_small else rng.choice(fitting)
            waiting.remove(index)
            free -= points[index]["gpus"]
            heapq.heappush(running, (time + durations[points[index]["n"]], index, time))
        end, index, start = heapq.heappop(running)
        time, free = end, free + points[index]["gpus"]
        done.append(Reservation(start, end, points[index]["gpus"], str(index)))
    return done


MIXES = {
    "tp x dp <= 4": [1, 2, 4, 2, 4] * 6,
    "tp x dp x pp <= 8": [1, 2, 2, 4, 4, 4, 8, 8, 8, 8] * 3,
    "a few small": [1] * 2 + [2] * 6 + [4] * 6,
    "many small": [1] * 16 + [2] * 6 + [4] * 4,
    "sizes that do not divide": [3, 3, 2, 1] * 6,
    "up to a node": [8, 4, 2, 1, 2, 4] * 4,
    "bench/packing.py": [1] * 3 + [2] * 6 + [4] * 6,
}
ORDERS = {
    "grid": lambda points: points,
    "largest first": lambda points: sorted(points, key=lambda p: -p["gpus"]),
    "smallest first": lambda points: sorted(points, key=lambda p: p["gpus"]),
    "ours": lambda points: order_for_packing(points, gpus_of, 8),
}


def mean_utilization(mix, window, order, ray_prefers_small=False, draws=30):
    total = 0.0
    for seed in range(draws):
        rng = random.Random(seed)
        points = make(*MIXES[mix])
        durations = [rng.uniform(20, 60) for _ in points]
        reservations = simulate(ORDERS[order](points), durations, 8, window, rng, ray_prefers_small)
        assert peak_devices(reservations) <= 8 and len(reservations) == len(points)
        total += utilization(reservations, 8)
    return total / draws


@pytest.mark.parametrize("ray_prefers_small", [False, True], ids=["ray places any", "ray places the smallest"])
@pytest.mark.parametrize("window", [5, 9])
def test_in_the_model_our_order_does_best_when_few_trials_are_in_flight(window, ray_prefers_small):
    use = {order: [mean_utilization(mix, window, order, ray_prefers_small) for mix in MIXES] for order in ORDERS}
    mean = {order: sum(values) / len(values) for order, values in use.items()}
    assert mean["ours"] >= max(mean.values()) - 0.01, mean  # best on average over the mixes, or within a point
    assert mean["ours"] >= mean["largest first"] + 0.02, mean
    for ours, smallest_first in zip(
        use["ours"], use["smallest first"], strict=True
    ):  # and never worse than plain smallest first
        assert ours >= smallest_first - 0.01, use


def test_in_the_model_enough_in_flight_matters_more_than_the_order():
    for order in ORDERS:
        filled = sum(mean_utilization(mix, max_concurrent_to_fill(8, MIXES[mix]), order) for mix in MIXES) / len(MIXES)
        everything = sum(mean_utilization(mix, 1000, order) for mix in MIXES) / len(MIXES)
        assert filled >= everything - 0.01, order


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


def test_the_levels_the_capacity_search_measured_beyond_the_ladder_are_counted_for_the_capacity_and_the_knee():
    searched = timed("a", 2, 600.0, 60.0, [level(x, 100 * x, 300) for x in (2, 8, 32, 16, 11, 4)])
    searched.capacity_at_slo = Capacity(value=11, unit="concurrency", bracket=(11, 16), bound="exact", tolerance=0.1,
                                        extra_levels=2)  # fmt: skip
    searched.knee = Knee(value=2, unit="concurrency", bracket=(2, 4), bound="exact", throughput=200, extra_levels=1)
    ladder_only = timed("b", 1, 200.0, 60.0, [level(1, 100, 300)])
    out = time_accounting([searched, ladder_only])
    assert searched_s(searched) == (pytest.approx(120), pytest.approx(60))  # 16 and 11 clients; 4 clients
    assert out["capacity_search_device_seconds"] == pytest.approx(2 * 120)
    assert out["knee_search_device_seconds"] == pytest.approx(2 * 60)
    assert out["capacity_search_share"] == pytest.approx(240 / 1400) and searched_s(ladder_only) == (0, 0)
    line = device_time_lines([searched, ladder_only], "cpu", 3)[0]
    assert "measuring (17% the capacity search beyond the ladder, 9% the knee's)" in line
