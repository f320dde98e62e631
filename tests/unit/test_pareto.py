"""Pareto fronts on made-up points: dominance, ties, maximize, points kept apart."""

from __future__ import annotations

import math

import pytest

from servetune.report import FRONTS, Objective, ReportPoint, pareto_front
from servetune.report.pareto import dominates, study_front
from servetune.report.points import OUTPUT_THROUGHPUT_PER_DEVICE as PER_DEVICE
from servetune.report.points import OUTPUT_THROUGHPUT_PER_USER as PER_USER
from servetune.report.points import known_metrics

COST_TTFT = (Objective("cost_per_mtok_usd", "min"), Objective("ttft_ms_p99", "min"))


def pt(name: str, cost: float | None = None, ttft: float | None = None, **kwargs) -> ReportPoint:
    metrics = {k: v for k, v in (("cost_per_mtok_usd", cost), ("ttft_ms_p99", ttft)) if v is not None}
    metrics.update(kwargs.pop("metrics", {}))
    return ReportPoint(trial_id=name, metrics=metrics, **kwargs)


def names(points) -> list[str]:
    return [p.trial_id for p in points]


def test_dominance_splits_front_from_dominated_and_orders_the_front_by_cost():
    points = [pt("a", 1.0, 10.0), pt("b", 2.0, 5.0), pt("c", 3.0, 6.0), pt("d", 0.5, 20.0), pt("e", 2.0, 12.0)]
    result = pareto_front(points, COST_TTFT)
    assert names(result.front) == ["d", "a", "b"]
    assert names(result.dominated) == ["e", "c"]  # e: b is as cheap and faster; c: b is cheaper and faster
    assert result.apart == ()


def test_equal_points_are_both_on_the_front_and_an_equal_cost_slower_point_is_not():
    points = [pt("x", 1.0, 10.0), pt("y", 1.0, 10.0), pt("z", 1.0, 11.0), pt("w", 0.8, 30.0)]
    result = pareto_front(points, COST_TTFT)
    assert names(result.front) == ["w", "x", "y"]
    assert names(result.dominated) == ["z"]


def test_maximize_both_objectives():
    objectives = (Objective(PER_DEVICE, "max"), Objective(PER_USER, "max"))
    points = [
        pt("dense", metrics={PER_DEVICE: 1000.0, PER_USER: 10.0}),
        pt("snappy", metrics={PER_DEVICE: 200.0, PER_USER: 60.0}),
        pt("middle", metrics={PER_DEVICE: 600.0, PER_USER: 30.0}),
        pt("worse", metrics={PER_DEVICE: 500.0, PER_USER: 25.0}),  # middle beats it on both
    ]
    result = pareto_front(points, objectives)
    assert names(result.front) == ["dense", "middle", "snappy"]  # best-first on tok/s per device
    assert names(result.dominated) == ["worse"]


def test_failed_slo_breaking_and_unmeasured_points_stay_apart_and_dominate_nothing():
    points = [
        pt("ok", 2.0, 500.0),
        pt("failed", 0.1, 10.0, outcome="FAILED", reason="CUDA out of memory"),
        pt("infeasible", 0.1, 10.0, outcome="INFEASIBLE"),
        pt("slow", 0.2, 3000.0, slo_violations=("ttft_ms_p99 = 3000 > 2000",)),
        pt("no-ttft", 0.1),
        pt("no-output", math.inf, 100.0),
    ]
    result = pareto_front(points, COST_TTFT)
    assert names(result.front) == ["ok"] and result.dominated == ()
    assert names(result.apart) == ["failed", "infeasible", "slow", "no-ttft", "no-output"]
    assert names(result.drawable(result.apart)) == ["failed", "infeasible", "slow"]
    assert result.apart[0].why_apart == "trial FAILED: CUDA out of memory"
    assert result.apart[2].why_apart.startswith("SLO broken: ttft_ms_p99")


def test_three_objectives_and_empty_input():
    objectives = (*COST_TTFT, Objective("tpot_ms_p99", "min"))
    points = [
        pt("a", 1.0, 10.0, metrics={"tpot_ms_p99": 50.0}),
        pt("b", 2.0, 20.0, metrics={"tpot_ms_p99": 10.0}),  # worse on two, better on TPOT: on the front
        pt("c", 2.0, 20.0, metrics={"tpot_ms_p99": 60.0}),
    ]
    assert names(pareto_front(points, objectives).front) == ["a", "b"]
    empty = pareto_front([], COST_TTFT)
    assert empty.front == empty.dominated == empty.apart == ()
    with pytest.raises(ValueError):
        pareto_front(points, ())


def test_dominates_is_strict():
    o = COST_TTFT
    assert dominates((1, 1), (1, 2), o) and not dominates((1, 2), (1, 1), o)
    assert not dominates((1, 1), (1, 1), o)
    assert not dominates((1, 3), (2, 2), o) and not dominates((2, 2), (1, 3), o)


def test_standard_fronts_use_known_metrics_and_the_study_front_is_added_only_when_new():
    known = set(known_metrics())
    assert [f.name for f in FRONTS] == ["cost-vs-ttft", "cost-vs-tpot", "cost-vs-e2el", "throughput-vs-interactivity"]
    assert all(o.metric in known for f in FRONTS for o in f.objectives)
    assert FRONTS[0].y.metric == "cost_per_mtok_usd" and FRONTS[0].x.metric == "ttft_ms_p99"
    assert study_front([("ttft_ms_p99", "min"), ("cost_per_mtok_usd", "min")]) is None
    extra = study_front([("cost_per_mtok_usd", "min"), ("goodput", "max")])
    assert extra is not None and extra.x == Objective("goodput", "max")
    assert study_front([("cost_per_mtok_usd", "min")]) is None
