"""The online refit: factors refitted on a study's own points, shrunk toward the shipped ones."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from servetune.estimate import Efficiency, decode_s, load_factors
from servetune.estimate import calibrate as cal
from servetune.estimate import calibrate_cpu as cc
from servetune.estimate.refit import (
    point_residuals,
    predictable,
    refit,
    relative_errors,
    residual_weights,
    wait_share,
)

SURFACES = Path(__file__).resolve().parents[2] / "bench" / "data"
FITTED = ("decode_bandwidth", "prefill_flops", "step_overhead_ms", "sequence_overhead_ms")


def _trials(name: str) -> list[dict]:
    doc = json.loads((SURFACES / name).read_text(encoding="utf-8"))
    return [t for t in doc["trials"] if t["outcome"] == "COMPLETE"]


def _points(trials: list[dict]) -> list[cal.CalibrationPoint]:
    return [p for t in trials for p in cc.trial_points(t, "study", held_out=False)]


def _distance(eff: Efficiency, prior: Efficiency) -> float:
    return math.sqrt(sum(((getattr(eff, n) - getattr(prior, n)) / getattr(prior, n)) ** 2 for n in FITTED))


def _loss(points: list[cal.CalibrationPoint], eff: Efficiency) -> float:
    return sum(math.log1p(e) ** 2 for p in points for e in relative_errors(p, eff).values())


def test_without_points_the_refit_is_the_prior():
    prior = load_factors().for_class("CPU")
    assert refit([], prior) == prior
    failed = {**_trials("cpu-tiny-grid.json")[0], "outcome": "FAILED"}
    assert cc.trial_points(failed, "study", held_out=False) == []


def test_the_prior_weight_shrinks_the_refit_toward_the_shipped_factors():
    prior = load_factors().for_class("CPU")  # fitted on another host's surface: this one disagrees
    points = _points(_trials("cpu-tiny-grid.json")[:3])
    loose, usual, firm = (refit(points, prior, prior_points=w) for w in (0.01, 5.0, 1e4))
    assert _distance(loose, prior) > _distance(usual, prior) > _distance(firm, prior)
    assert _distance(firm, prior) < 0.05 * _distance(loose, prior)
    # every refit predicts the study's own points at least as well as the prior it started from
    assert _loss(points, loose) <= _loss(points, usual) <= _loss(points, firm) <= _loss(points, prior)


def test_more_points_move_the_refit_further_from_the_prior():
    prior = load_factors().for_class("CPU")
    trials = _trials("cpu-tiny-grid.json")
    one, ten = refit(_points(trials[:1]), prior), refit(_points(trials[:10]), prior)
    assert _distance(ten, prior) > _distance(one, prior) > 0


def test_a_weak_prior_recovers_factors_that_generated_the_measurements():
    prior = load_factors().for_class("CPU")
    # a step's fixed time (its overhead and the weights read) dominates the tiny model's times: the points pin it
    # down, though not how it splits between the two
    truth = prior.model_copy(update={"step_overhead_ms": 2 * prior.step_overhead_ms})
    points = _points(_trials("cpu-tiny-grid-r4.json")[:6])
    points = [dataclasses.replace(p, measured=cal.predict(p, truth)[0]) for p in points]
    got = refit(points, prior, prior_points=0.01)
    worst = max(e for p in points for e in relative_errors(p, got).values())
    assert worst < 0.02
    rep = points[0].replica
    assert decode_s(rep, got, 1, 150) == pytest.approx(decode_s(rep, truth, 1, 150), rel=0.05)
    assert got.step_overhead_ms > prior.step_overhead_ms


def _open_loop_near_capacity(point: cal.CalibrationPoint, eff: Efficiency, share: float) -> cal.CalibrationPoint:
    """``point`` as an open loop at ``share`` of the request rate ``eff`` serves it at, measured as it was."""
    predicted, _ = cal.predict(point, eff)
    rate = share * predicted["output_throughput"] / point.output_tokens
    return dataclasses.replace(point, regime="open", load=rate)


def test_an_open_loop_the_factors_saturate_keeps_its_residuals_so_the_refit_can_cross_saturation():
    """A twin's Poisson level (bench/estimate_refit.py, gpu-twin-grid) measured below saturation, that slower
    factors saturate: its TTFT, unbounded there, still counts (as UNBOUNDED_MISS), so the refit's residuals keep
    their length as it moves the factors across saturation (least_squares refuses a vector that changes length)."""
    prior = load_factors().for_class("CPU")
    slow = prior.model_copy(update={"decode_bandwidth": prior.decode_bandwidth / 3})
    points = [_open_loop_near_capacity(p, prior, 0.9) for p in _points(_trials("cpu-tiny-grid-r4.json")[:3])]
    assert all("ttft_ms" not in cal.predict(p, slow)[0] for p in points)  # slow factors saturate every level
    measured = sum(len(p.measured) for p in points)
    metrics = predictable(points, prior)
    assert sum(map(len, metrics)) == measured and sum(map(len, predictable(points, slow))) < measured
    assert len(point_residuals(points, prior, metrics)) == len(point_residuals(points, slow, metrics)) == measured
    # measured as a GPU unlike the prior: a third of its bandwidth, whose open loops would saturate the prior
    truth = [dataclasses.replace(p, measured={**p.measured, "tpot_ms": p.measured["tpot_ms"] * 2}) for p in points]
    eff = refit(truth, prior, prior_points=0.01)
    assert all(math.isfinite(getattr(eff, n)) for n in FITTED)


def test_a_level_the_prior_saturates_leaves_its_ttft_out_of_the_refit():
    """An open loop past the prior's capacity measures a finite TTFT (its level ends), which no factors near the
    prior can match: it must not pull the refit, whatever TTFT it measured."""
    prior = load_factors().for_class("CPU")
    points = [_open_loop_near_capacity(p, prior, 1.5) for p in _points(_trials("cpu-tiny-grid-r4.json")[:3])]
    assert all("ttft_ms" not in cal.predict(p, prior)[0] for p in points)
    short, long = ([dataclasses.replace(p, measured={**p.measured, "ttft_ms": t}) for p in points] for t in (1e2, 1e5))
    without = [dataclasses.replace(p, measured={m: v for m, v in p.measured.items() if m != "ttft_ms"}) for p in points]
    assert refit(short, prior) == refit(long, prior) == refit(without, prior)


def test_a_ttft_that_is_mostly_the_wait_for_a_slot_does_not_pull_the_factors_tpot_rests_on():
    """The shipped-factor GPU twin's Poisson levels (bench/estimate_refit.py): measured as the prior predicts but for
    the TTFT of the levels near capacity, off by 3x where the wait for a slot is most of it (the G/G/c wait's own
    error). In plain least squares those few log ratios of 1.1 moved the step overhead and bandwidth that TPOT rests
    on, and TPOT, which the prior predicted exactly, came out 5% off; weighted by the wait's share they count little."""
    prior = load_factors().for_class("CPU")
    points = []
    for base in _points(_trials("cpu-tiny-grid-r4.json")[:2]):
        for share in (0.3, 0.6, 0.9, 0.97):
            point = _open_loop_near_capacity(base, prior, share)
            predicted, _ = cal.predict(point, prior)
            if "ttft_ms" in predicted:
                miss = 3.0 if wait_share(point, prior) > 0.5 else 1.0
                points.append(
                    dataclasses.replace(point, measured={**predicted, "ttft_ms": predicted["ttft_ms"] * miss})
                )
    assert sum(wait_share(p, prior) > 0.5 for p in points) >= 2  # some levels' TTFT is mostly the wait
    weights = residual_weights(points, prior, predictable(points, prior))
    assert min(weights) < 0.1 and max(weights) == 1.0
    eff = refit(points, prior)
    worst_tpot = max(abs(cal.predict(p, eff)[0]["tpot_ms"] / p.measured["tpot_ms"] - 1) for p in points)
    assert worst_tpot < 0.02
