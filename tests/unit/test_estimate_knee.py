"""estimate/knee.py: the knee of a measured throughput curve, read by the rule the estimate's knee follows."""

from __future__ import annotations

import numpy as np

from servetune.estimate.knee import ladder_index, measured_knee, smoothed, steps_apart

LADDER = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 16, 18, 20, 22, 24, 27, 30, 33, 36, 40, 44, 48, 53, 58, 64]


def saturating(capacity: float, per_client: float = 100.0):
    """A closed loop whose throughput grows with the clients until ``capacity`` of them, then stays."""
    return [(x, per_client * min(x, capacity)) for x in LADDER]


def test_a_clear_knee_is_the_first_load_reaching_nine_tenths_of_the_plateau():
    # 100 tok/s a client up to 12 clients, flat after: 90 % of 1200 is first reached at 11 clients
    assert measured_knee(saturating(12)) == 11
    assert measured_knee(saturating(31)) == 30  # 2790 tok/s first reached at 30 clients (27: 2700)


def test_a_curve_still_climbing_at_its_top_load_has_no_knee():
    assert measured_knee([(x, 100.0 * x) for x in LADDER]) is None
    # a knee past the ladder: still doubling from 48 to 64 clients is no plateau
    assert measured_knee(saturating(100)) is None


def test_a_knee_just_below_the_top_still_counts_when_the_curve_flattened():
    assert measured_knee(saturating(53)) == 48


def test_one_noisy_load_neither_makes_nor_hides_the_knee():
    runs = saturating(21)
    assert measured_knee(runs) == 20
    spiked = [(x, t * (1.6 if x == 12 else 1.0)) for x, t in runs]  # 1920 tok/s: past 90 % of 2100 on its own
    assert measured_knee(spiked) == 20
    dipped = [(x, t * (0.5 if x == 20 else 1.0)) for x, t in runs]  # the knee's own load measured at half
    assert abs(steps_apart(LADDER, measured_knee(dipped), 20)) <= 1


def test_a_noisy_curve_of_three_runs_a_load_lands_within_one_ladder_step_of_its_true_knee():
    rng = np.random.default_rng(7)
    true_knee = measured_knee(saturating(16))
    for _ in range(20):
        runs = [(x, t * rng.normal(1.0, 0.08)) for x, t in saturating(16) for _ in range(3)]
        assert abs(steps_apart(LADDER, measured_knee(runs), true_knee)) <= 1


def test_runs_of_a_load_count_at_their_mean():
    runs = [(1, 100.0), (2, 150.0), (2, 250.0), (4, 400.0), (8, 400.0), (16, 400.0), (32, 410.0)]
    assert measured_knee(runs) == 4
    assert smoothed([1.0, 5.0, 2.0, 8.0]) == [3.0, 2.0, 5.0, 5.0]


def test_a_predicted_knee_sits_on_the_first_ladder_load_reaching_it():
    assert ladder_index(LADDER, 15) == LADDER.index(16)
    assert ladder_index(LADDER, 16) == LADDER.index(16)
    assert ladder_index(LADDER, 80) == len(LADDER)
    assert ladder_index(LADDER, None) == len(LADDER)
    assert steps_apart(LADDER, 15, 14) == 1  # 15 clients land on 16, the step after 14
    assert steps_apart(LADDER, 4, 8) == -4
    assert steps_apart(LADDER, 80, None) == 0  # both past the top
