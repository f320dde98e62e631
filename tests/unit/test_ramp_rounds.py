"""The policies compared on the ramp in rounds: each round's order (rotated, so each policy runs first as often as
last) and the verdict, which names a winner only beyond the spread between rounds of the same policy."""

from __future__ import annotations

import pytest

from servetune.errors import UserError
from servetune.serve.ramp import RampPhaseResult, RampResult
from servetune.serve.ramp_rounds import balanced, compare_policies, mean_replicas, orders_of, round_orders


def ramp(policy: str, round_: int | None, attained: float, replica_s: float, length: float = 100.0) -> RampResult:
    return RampResult(
        policy=policy, round=round_, knee_concurrency=6, autoscaling_config={}, max_ongoing_requests=10,
        max_queued_requests=4, reasons={}, replicas_before=1, replicas_peak=2, requests=1000,
        slo_violations=round(1000 * (1 - attained)), slo_attainment=attained, replica_seconds=replica_s,
        phases=[RampPhaseResult(name="back to 1x", concurrency=5, start_s=length - 20, end_s=length, requests=100,
                                slo_violations=0, errors=0)],
    )  # fmt: skip


def rounds_of(a: list[tuple[float, ...]], b: list[tuple[float, ...]]) -> list[RampResult]:
    """inflight's and predictive's (SLO met, replica-seconds[, the ramp's length, default 100 s]) per round, run AB,
    BA, AB, ..."""
    ran = []
    for k, (first, second) in enumerate(zip(a, b, strict=True), 1):
        pair = [ramp("inflight", k, *first), ramp("predictive", k, *second)]
        ran += pair if k % 2 else pair[::-1]
    return ran


def test_the_order_rotates_from_round_to_round_so_each_policy_runs_first_as_often_as_last():
    assert round_orders(["inflight", "predictive"]) == [["inflight", "predictive"], ["predictive", "inflight"]]
    assert round_orders(["inflight", "predictive"], 4) == [["inflight", "predictive"], ["predictive", "inflight"]] * 2
    assert round_orders(["a", "b", "c"]) == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert round_orders(["inflight"]) == [["inflight"]] and round_orders(["inflight"], 3) == [["inflight"]] * 3
    for policies, rounds in ((["inflight", "predictive"], 2), (["inflight", "predictive"], 6), (["a", "b", "c"], 3)):
        assert balanced(round_orders(policies, rounds))


def test_rounds_that_cannot_balance_the_order_are_refused():
    with pytest.raises(UserError, match=r"--ramp-rounds 3: .* only over a multiple of 2 rounds"):
        round_orders(["inflight", "predictive"], 3)
    with pytest.raises(UserError, match="--ramp-rounds 0: give 1 or more"):
        round_orders(["inflight"], 0)


def test_an_order_is_balanced_only_where_every_policy_ran_in_every_position_equally_often():
    assert not balanced([["inflight", "predictive"]])  # the order serve-check ran before rounds: predictive second
    assert not balanced([["inflight", "predictive"], ["inflight", "predictive"]])
    assert not balanced([["inflight", "predictive"], ["predictive"]])  # a round short of a policy
    assert not balanced([["a", "b", "c"], ["b", "c", "a"], ["b", "a", "c"]])  # b first twice
    assert balanced([["inflight"]]) and balanced([["predictive", "inflight"], ["inflight", "predictive"]])
    assert orders_of([(1, "a"), (1, "b"), (2, "b"), (2, "a")]) == [["a", "b"], ["b", "a"]]


def test_a_lead_within_the_spread_between_rounds_of_one_policy_names_no_winner():
    # docs/concepts/autoscaling.md's rounds 2 and 3 (SLO met, replica-s, ramp s): predictive ahead on the means by 9.2
    # points, but its two rounds are 11.1 apart (inflight's 3.9): within the noise. Mean replicas likewise.
    verdict = compare_policies(rounds_of([(0.612, 311.0, 164.0), (0.651, 336.0, 186.0)],
                                         [(0.668, 298.0, 168.0), (0.779, 293.0, 165.0)]))  # fmt: skip
    assert verdict.winner is None and verdict.balanced
    assert verdict.orders == [["inflight", "predictive"], ["predictive", "inflight"]]
    slo = verdict.metrics[0]
    assert (slo.metric, slo.ahead, slo.beyond_noise) == ("slo_attainment", "predictive", False)
    assert slo.difference == pytest.approx(0.0920) and slo.spread == pytest.approx(0.111)
    assert verdict.reason.startswith("no winner within the noise: SLO met: inflight 63.1% (61.2%-65.1%), "
                                     "predictive 72.4% (66.8%-77.9%); predictive 9.2 points more, within the spread between "
                                     "rounds of one policy (11.1 points)")  # fmt: skip
    assert verdict.reason.endswith("mean replicas: inflight 1.85 (1.81-1.90), predictive 1.77 (1.77-1.78); predictive "
                                   "0.08 fewer, within the spread between rounds of one policy (0.09)")  # fmt: skip
    by_policy = {p.policy: p for p in verdict.policies}
    assert by_policy["inflight"].positions == [1, 2] and by_policy["predictive"].positions == [2, 1]
    assert by_policy["predictive"].replica_seconds == [298.0, 293.0]


def test_a_lead_beyond_every_spread_names_the_winner():
    verdict = compare_policies(rounds_of([(0.60, 180.0), (0.62, 182.0)], [(0.75, 181.0), (0.78, 179.0)]))
    assert verdict.winner == "predictive"
    assert [(m.metric, m.ahead, m.beyond_noise) for m in verdict.metrics] == [
        ("slo_attainment", "predictive", True), ("mean_replicas", "predictive", False),
    ]  # fmt: skip
    assert verdict.reason.startswith("predictive: SLO met: ") and "beyond the spread" in verdict.reason
    # fewer replicas is the better side: inflight holding clearly fewer, at the same SLO met, wins on that
    verdict = compare_policies(rounds_of([(0.70, 150.0), (0.71, 152.0)], [(0.70, 180.0), (0.71, 181.0)]))
    assert verdict.winner == "inflight" and verdict.metrics[1].ahead == "inflight"


def test_the_larger_spread_of_the_two_sets_the_noise_and_a_tie_with_it_is_within():
    # predictive's own rounds barely move, inflight's by 20 points: a 15-point lead is within inflight's spread
    verdict = compare_policies(rounds_of([(0.50, 180.0), (0.70, 180.0)], [(0.75, 180.0), (0.75, 180.0)]))
    assert verdict.metrics[0].spread == pytest.approx(0.20) and verdict.winner is None
    # a lead exactly the spread is not beyond it
    verdict = compare_policies(rounds_of([(0.50, 180.0), (0.60, 180.0)], [(0.60, 180.0), (0.70, 180.0)]))
    assert verdict.metrics[0].difference == pytest.approx(verdict.metrics[0].spread) and verdict.winner is None


def test_each_ahead_beyond_the_noise_on_one_metric_is_a_trade_off_not_a_winner():
    verdict = compare_policies(rounds_of([(0.60, 150.0), (0.61, 151.0)], [(0.80, 190.0), (0.81, 191.0)]))
    assert [(m.ahead, m.beyond_noise) for m in verdict.metrics] == [("predictive", True), ("inflight", True)]
    assert verdict.winner is None and verdict.reason.startswith("no winner: a trade-off")


def test_without_rounds_or_with_one_per_policy_no_winner_is_named():
    # serve-check before rounds: inflight then predictive, once each; however far apart, the order was not balanced
    verdict = compare_policies([ramp("inflight", None, 0.5, 180.0), ramp("predictive", None, 0.9, 180.0)])
    assert verdict.winner is None and not verdict.balanced
    assert verdict.reason.startswith("no winner: the order was not balanced (inflight then predictive); SLO met: ")
    assert "no spread between rounds to judge it against" in verdict.reason
    verdict = compare_policies([ramp("inflight", 1, 0.6, 180.0)] * 2)
    assert verdict.winner is None and verdict.reason.startswith("one policy, nothing to compare")


def test_the_mean_replicas_are_the_replica_seconds_over_the_ramps_length():
    assert mean_replicas(ramp("inflight", 1, 0.6, 336.0, length=186.0)) == pytest.approx(1.806, abs=1e-3)
    assert mean_replicas(ramp("inflight", 1, 0.6, 336.0).model_copy(update={"phases": []})) is None
