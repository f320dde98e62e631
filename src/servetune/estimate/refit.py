"""Online refit: the efficiency factors refitted on a study's own measurements, shrunk toward a prior.

After each completed trial, :func:`refit` fits the factors on every level the study has measured
so far, with the shipped factors (:func:`~servetune.estimate.load_factors`) as a prior worth
``prior_points`` pseudo-points: each fitted factor's relative distance from the prior costs as
much as ``prior_points`` measurements missed by that fraction. With no points the refit is the
prior; with a few it moves only as far as they agree; with many the data decide. Deterministic,
like :func:`~servetune.estimate.calibrate.fit_efficiency`.

Each residual counts by its expected spread (:func:`residual_weights`): an open loop's TTFT that is mostly the
wait for a slot, the model's least certain term, counts less, so its misses do not pull the factors TPOT rests on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from servetune.estimate.calibrate import BOUNDS, FITTED, CalibrationPoint, predict
from servetune.estimate.calibrate_cpu import CPU_BOUNDS
from servetune.estimate.encoder import encode_s
from servetune.estimate.factors import Efficiency
from servetune.estimate.queueing import open_loop, steady

DEFAULT_PRIOR_POINTS = 5.0
#: How far off a prediction without a value (the TTFT of an open loop the refit's factors saturate and the prior's
#: did not) counts in the refit.
UNBOUNDED_MISS = 10.0
#: A measured level's run-to-run spread (log sigma; testing/twin.py RUN_SPREAD_SIGMA, from bench/README.md's
#: knee_noise.py): a residual expected to be off by this much counts fully.
LEVEL_SPREAD = 0.066
#: The expected log error of an open loop's wait for a slot (queueing.slot_wait_s: 2-8x off near capacity on the GPU
#: twin, bench/README.md): a TTFT that is mostly wait counts about LEVEL_SPREAD / WAIT_SPREAD of a full residual.
WAIT_SPREAD = 1.0
# Below these a factor's relative distance from the prior is measured against the floor instead,
# so a prior of 0 (an overhead fitted away) can still move.
_SCALE_FLOOR = {
    "decode_bandwidth": 1e-3,
    "prefill_flops": 1e-3,
    "step_overhead_ms": 0.05,
    "sequence_overhead_ms": 0.005,
    "allreduce_us": 1.0,
}


class Refit(BaseModel):
    """The factors of one GPU class after a study's measured points, as written to the study dir."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu_class: str
    prior: Efficiency = Field(description="the factors the refit was shrunk toward (the shipped ones)")
    prior_points: float = Field(description="the prior's weight, in measured points")
    points: int = Field(description="measured (trial, level, metric) values the refit used")
    trials: list[str] = Field(default_factory=list, description="the trials whose levels were used")
    efficiency: Efficiency


def refit(
    points: Sequence[CalibrationPoint],
    prior: Efficiency,
    prior_points: float = DEFAULT_PRIOR_POINTS,
    bounds: tuple[tuple[float, ...], tuple[float, ...]] | None = None,
) -> Efficiency:
    """The factors that best predict ``points`` with ``prior`` worth ``prior_points`` measurements.

    Each measured metric of each point is one residual, log(predicted / measured); each fitted
    factor adds sqrt(prior_points) x its relative distance from the prior. ``bounds`` default to
    the CPU build's where every point is on the CPU, else the GPU fit's.
    """
    measured = sum(len(p.measured) for p in points)
    if not points or measured == 0:
        return prior
    if bounds is None:
        bounds = CPU_BOUNDS if all(p.gpu_class == "CPU" for p in points) else BOUNDS
    fitted = FITTED if any(p.replica.tp > 1 for p in points) else FITTED[:-1]
    n = len(fitted)
    lo, hi = np.array(bounds[0][:n]), np.array(bounds[1][:n])
    x_prior = np.array([getattr(prior, name) for name in fitted])
    scale = np.array([max(abs(getattr(prior, name)), _SCALE_FLOOR[name]) for name in fitted])
    weight = math.sqrt(max(prior_points, 0.0))

    def efficiency(x: np.ndarray) -> Efficiency:
        return prior.model_copy(update={name: float(v) for name, v in zip(fitted, x, strict=True)})

    # the levels the prior saturates keep their TTFT out of the fit: the model has no finite value to match there
    metrics = predictable(points, prior)

    # a TTFT that is mostly the wait for a slot counts less: that wait is the model's least certain term
    spread = residual_weights(points, prior, metrics)

    def residuals(x: np.ndarray) -> np.ndarray:
        return np.concatenate(
            [spread * point_residuals(points, efficiency(x), metrics), weight * (x - x_prior) / scale]
        )

    from scipy.optimize import least_squares  # here, not at import: scipy.optimize costs about a second of a core

    start = np.clip(x_prior, lo, hi)
    result = least_squares(residuals, start, bounds=(lo, hi), loss="linear", x_scale=scale, diff_step=1e-3)
    return prior.model_copy(update={name: round(float(v), 6) for name, v in zip(fitted, result.x, strict=True)})


def predictable(points: Sequence[CalibrationPoint], eff: Efficiency) -> list[tuple[str, ...]]:
    """The metrics each point measured that ``eff`` predicts: all but the TTFT of an open loop it saturates (its
    queue grows without bound, while a level of finite length measures a finite TTFT)."""
    return [tuple(m for m in point.measured if m in predict(point, eff)[0]) for point in points]


def residual_weights(
    points: Sequence[CalibrationPoint], prior: Efficiency, metrics: Sequence[Sequence[str]]
) -> np.ndarray:
    """Each residual's weight, :data:`LEVEL_SPREAD` over its expected spread: a level's run-to-run spread, and for an
    open loop's TTFT, in quadrature, :data:`WAIT_SPREAD` x the share of the TTFT ``prior`` gives to the wait for a slot.
    Fixed by the prior (like :func:`predictable`), so the refit's objective does not move with the factors."""
    out: list[float] = []
    for point, names in zip(points, metrics, strict=True):
        share = wait_share(point, prior) if "ttft_ms" in names else 0.0
        out.extend(LEVEL_SPREAD / math.hypot(LEVEL_SPREAD, WAIT_SPREAD * share if m == "ttft_ms" else 0.0)
                   for m in names)  # fmt: skip
    return np.asarray(out)


def wait_share(point: CalibrationPoint, eff: Efficiency) -> float:
    """The share of an open loop's predicted TTFT that is the wait for a slot (queueing.slot_wait_s); 0 for other
    regimes, and where ``eff`` saturates the level."""
    if point.regime != "open":
        return 0.0
    rep, i, o = point.replica, point.input_tokens, max(point.output_tokens, 2)
    encode = encode_s(rep, eff, point.encoder_flops)
    p = open_loop(rep, eff, point.load, i, o, encode, 1 / point.burstiness, point.requests)
    if not p.ttft_s:
        return 0.0
    bare = steady(rep, eff, p.in_flight, i, o, encode=encode).ttft_s
    return max(p.ttft_s - bare, 0.0) / p.ttft_s


def point_residuals(
    points: Sequence[CalibrationPoint], eff: Efficiency, metrics: Sequence[Sequence[str]]
) -> np.ndarray:
    """log(predicted / measured) of each point's ``metrics`` (:func:`predictable` by the prior), one each whatever
    ``eff`` is: a TTFT ``eff`` leaves unbounded (an open loop it saturates, which the prior did not) counts as
    :data:`UNBOUNDED_MISS` x the measured one, so the vector keeps its length as the fit moves across saturation."""
    out: list[float] = []
    for point, names in zip(points, metrics, strict=True):
        predicted, _ = predict(point, eff)
        out.extend(math.log(predicted[m] / point.measured[m]) if m in predicted else math.log(UNBOUNDED_MISS)
                   for m in names)  # fmt: skip
    return np.asarray(out)


def relative_errors(point: CalibrationPoint, eff: Efficiency) -> dict[str, float]:
    """|predicted / measured - 1| of each metric ``point`` measured, with ``eff``."""
    predicted, _ = predict(point, eff)
    return {m: abs(predicted[m] / v - 1) for m, v in point.measured.items() if m in predicted}
