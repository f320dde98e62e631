"""The autoscaling policies compared on the ramp in rounds (``serve-check --ramp-policy A,B --ramp-rounds N``).

Run one after the other, the second policy always ran after the first: on a host the first had warmed, its caches
filled, its load just gone. Any difference between them was confounded with their order. So the policies run in
rounds whose order rotates (:func:`round_orders`: AB, BA, ...), each on a fresh deployment, and every policy runs
first as often as last. The verdict (:func:`compare_policies`) names a winner only where the difference between
policies stands beyond the spread between rounds of the same policy: that spread is what the host, the engine's
start and the order moved the same policy by, and a smaller difference is within it.

Everything here is pure: the CLI plans the rounds, ``serve.check.run_check`` runs them, the tables print the verdict.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from statistics import fmean

from pydantic import BaseModel

from servetune.errors import UserError
from servetune.results import RECORD
from servetune.serve.ramp import RampResult

#: What the verdict weighs, each with whether more is better. The mean replicas (replica-seconds over the ramp's
#: length) rather than the replica-seconds themselves: the 3x phase lasts until the new replica is RUNNING, so a
#: ramp's replica-seconds grow with its engine start, which no policy shortens; both are in the numbers.
METRICS = {"slo_attainment": True, "mean_replicas": False}
METRIC_WORDS = {"slo_attainment": "SLO met", "mean_replicas": "mean replicas"}


def round_orders(policies: Sequence[str], rounds: int | None = None) -> list[list[str]]:
    """The order of the policies in each round: round k starts at the k-th policy and wraps around (AB, BA for
    two), so over a multiple of len(policies) rounds each policy runs in every position equally often. ``rounds``
    None: one round per policy (AB, BA), the fewest that balance. Refused in one line where the rounds cannot
    balance the order."""
    n = len(policies)
    count = n if rounds is None else rounds
    if count < 1:
        raise UserError(f"--ramp-rounds {count}: give 1 or more")
    if n > 1 and count % n:
        raise UserError(f"--ramp-rounds {count}: the order of {n} policies rotates from round to round (AB, BA), so "
                        f"each runs first as often as last only over a multiple of {n} rounds")  # fmt: skip
    return [list(policies[k % n :]) + list(policies[: k % n]) for k in range(count)]


def orders_of(ran: Iterable[tuple[int, str]]) -> list[list[str]]:
    """Each round's order, from (round, policy) pairs in the order they ran."""
    return list(_by_round(ran).values())


def _by_round(ran: Iterable[tuple[int, str]]) -> dict[int, list[str]]:
    """Each round's policies in the order they ran, the rounds in their order."""
    rounds: dict[int, list[str]] = {}
    for number, policy in ran:
        rounds.setdefault(number, []).append(policy)
    return {k: rounds[k] for k in sorted(rounds)}


def balanced(orders: Sequence[Sequence[str]]) -> bool:
    """Whether every round ran the same policies once each and every policy ran in every position equally often
    (one round of one policy does)."""
    policies = set(orders[0]) if orders else set()
    if any(len(order) != len(set(order)) or set(order) != policies for order in orders):
        return False
    n = len(policies)
    if not n or len(orders) % n:
        return False
    return all(sum(order[i] == p for order in orders) == len(orders) // n for p in policies for i in range(n))


def mean_replicas(ramp: RampResult) -> float | None:
    """The replicas the ramp held on average: its replica-seconds over its length (the last phase's end)."""
    length = ramp.phases[-1].end_s if ramp.phases else None
    return ramp.replica_seconds / length if ramp.replica_seconds is not None and length else None


class PolicyRounds(BaseModel):
    """One policy's ramps, one per round, with what the verdict weighs."""

    model_config = RECORD

    policy: str
    rounds: list[int]  # the round of each ramp below (1-based)
    positions: list[int]  # where it ran in that round (1: first)
    slo_attainment: list[float | None]
    replica_seconds: list[float | None]
    mean_replicas: list[float | None]


class MetricCall(BaseModel):
    """One metric's comparison: the policy ahead on the means over the rounds, by how much, and the spread between
    rounds of one policy that a difference must pass (the larger of the two policies' max - min)."""

    model_config = RECORD

    metric: str  # a key of METRICS
    means: dict[str, float]  # per policy, over its rounds
    ahead: str | None = None  # the best mean (None: fewer than two policies with a value)
    difference: float | None = None  # the best mean against the next one, as a positive amount
    spread: float | None = None  # None: a policy with fewer than two rounds, so no spread to judge against
    beyond_noise: bool = False  # the difference passes the spread against every other policy


class RampComparison(BaseModel):
    """The policies over the rounds: each round's order, every ramp's numbers and the verdict."""

    model_config = RECORD

    orders: list[list[str]]
    balanced: bool
    policies: list[PolicyRounds]
    metrics: list[MetricCall]
    winner: str | None = None
    reason: str


def _values(rounds: PolicyRounds, metric: str) -> list[float]:
    return [v for v in getattr(rounds, metric) if v is not None]


def call_metric(per_policy: Sequence[PolicyRounds], metric: str) -> MetricCall:
    """The policy ahead on ``metric``'s mean, and whether its lead over every other policy passes the larger of the
    two's spread between rounds (max - min). A policy with fewer than two rounds has no spread: never beyond."""
    more_is_better = METRICS[metric]
    values = {p.policy: _values(p, metric) for p in per_policy}
    means = {p: fmean(v) for p, v in values.items() if v}
    if len(means) < 2:
        return MetricCall(metric=metric, means=means)
    ranked = sorted(means, key=lambda p: means[p], reverse=more_is_better)
    best = ranked[0]

    def spread(policy: str) -> float | None:
        got = values[policy]
        return max(got) - min(got) if len(got) >= 2 else None

    def beats(other: str) -> bool:
        spreads = (spread(best), spread(other))
        if spreads[0] is None or spreads[1] is None:
            return False
        lead, noise = abs(means[best] - means[other]), max(spreads[0], spreads[1])
        return lead > noise and not math.isclose(lead, noise, rel_tol=1e-9, abs_tol=1e-12)  # a tie is within

    runner_up = ranked[1]
    pair = (spread(best), spread(runner_up))
    return MetricCall(
        metric=metric, means=means, ahead=best, difference=abs(means[best] - means[runner_up]),
        spread=None if None in pair else max(s for s in pair if s is not None),
        beyond_noise=all(beats(other) for other in ranked[1:]),
    )  # fmt: skip


def _amount(metric: str, value: float) -> str:
    return f"{100 * value:.1f}%" if metric == "slo_attainment" else f"{value:.2f}"


def _gap(metric: str, value: float) -> str:
    return f"{100 * value:.1f} points" if metric == "slo_attainment" else f"{value:.2f}"


def describe_metric(call: MetricCall, per_policy: Sequence[PolicyRounds]) -> str:
    """``SLO met: inflight 62.8% (60.5-65.1), predictive 72.4% (66.8-77.9); predictive ahead by 9.6 points,
    within the spread between rounds of one policy (11.1 points)``."""
    metric, words = call.metric, METRIC_WORDS[call.metric]
    shown = []
    for p in per_policy:
        got = _values(p, metric)
        if got:
            span = f" ({_amount(metric, min(got))}-{_amount(metric, max(got))})" if len(got) > 1 else ""
            shown.append(f"{p.policy} {_amount(metric, fmean(got))}{span}")
    text = f"{words}: {', '.join(shown) or 'not measured'}"
    if call.ahead is None or call.difference is None:
        return text
    lead = "more" if METRICS[metric] else "fewer"
    text += f"; {call.ahead} {_gap(metric, call.difference)} {lead}"
    if call.spread is None:
        return text + ", no spread between rounds to judge it against (one round per policy)"
    where = "beyond" if call.beyond_noise else "within"
    return text + f", {where} the spread between rounds of one policy ({_gap(metric, call.spread)})"


def compare_policies(ramps: Sequence[RampResult]) -> RampComparison:
    """The verdict over the rounds (each ramp's ``round``; None counts as round 1). A winner is named only where the
    rounds balanced the order, each policy ran at least twice, and the policy is ahead beyond the noise on one
    metric (SLO met, mean replicas) with no other policy ahead beyond it on the other; else why not, with the
    numbers. Ahead on one each, beyond the noise, is a trade-off, not a winner."""
    by_round = _by_round((r.round or 1, r.policy) for r in ramps)
    orders = list(by_round.values())
    per_policy = []
    for policy in dict.fromkeys(r.policy for r in ramps):
        own = [r for r in ramps if r.policy == policy]
        per_policy.append(PolicyRounds(
            policy=policy, rounds=[r.round or 1 for r in own],
            positions=[by_round[r.round or 1].index(policy) + 1 for r in own],
            slo_attainment=[r.slo_attainment for r in own], replica_seconds=[r.replica_seconds for r in own],
            mean_replicas=[mean_replicas(r) for r in own],
        ))  # fmt: skip
    calls = [call_metric(per_policy, metric) for metric in METRICS]
    is_balanced = balanced(orders)
    numbers = "; ".join(describe_metric(call, per_policy) for call in calls)
    ahead = {call.ahead for call in calls if call.beyond_noise}
    winner = None
    if len(per_policy) < 2:
        reason = f"one policy, nothing to compare: {numbers}"
    elif not is_balanced:
        order_text = ", ".join(" then ".join(order) for order in orders)
        reason = f"no winner: the order was not balanced ({order_text}); {numbers}"
    elif any(len(p.rounds) < 2 for p in per_policy):
        reason = f"no winner: one round per policy, no spread between rounds to judge a difference against; {numbers}"
    elif not ahead:
        reason = f"no winner within the noise: {numbers}"
    elif len(ahead) > 1:
        reason = f"no winner: a trade-off, each ahead beyond the noise on one metric; {numbers}"
    else:
        winner = ahead.pop()
        reason = f"{winner}: {numbers}"
    return RampComparison(orders=orders, balanced=is_balanced, policies=per_policy, metrics=calls, winner=winner,
                          reason=reason)  # fmt: skip
