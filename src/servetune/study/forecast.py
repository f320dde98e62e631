"""The estimate of a trial before it runs, at every level of its ladder: what pruning and seeding read.

:func:`forecast` estimates a trial's configuration (:mod:`servetune.estimate`) at each level of the study's
ladder with the workload's mean request lengths; :func:`estimated_metrics` turns a level's estimate into the
study's metric names; :func:`likely_winners` ranks a space's grid by the first objective as estimated, the
points a Bayesian study proposes first (``search.estimate.seed``). Pure functions of the spec: no Ray, no
engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from servetune.capacity import load_model_arch, resolve_hardware
from servetune.config.settings import Objective
from servetune.config.slo import Slo
from servetune.config.space import SearchSpace
from servetune.config.workload import mean_lengths
from servetune.errors import UserError
from servetune.estimate import Efficiency, Estimate, Load, estimate, gpu_class, load_factors
from servetune.estimate.calibrate_cpu import RECORDED_HOST
from servetune.estimate.encoder import workload_images
from servetune.estimate.model import arrival_burstiness
from servetune.estimate.slo import ESTIMATED_METRICS
from servetune.load.runner import Level
from servetune.metrics import COST_METRIC, cost_per_mtok_usd
from servetune.trial.context import StudyContext
from servetune.trial.measure import LevelPlan
from servetune.trial.runner import TrialSpec


@dataclass(frozen=True)
class LevelForecast:
    """The estimate of one configuration at one level of the ladder."""

    level: Level
    estimate: Estimate


def forecast(
    spec: TrialSpec, lengths: tuple[int, int], efficiency: Efficiency | None = None
) -> list[LevelForecast] | str:
    """The estimate of ``spec`` at each level of its ladder (``lengths``: mean input and output tokens, text; a
    vision-language workload's requests add their images' tokens and encoding, estimate/encoder.py
    ``workload_images``), with the shipped factors or ``efficiency`` (the study's refit); where none can be made,
    why, in words. An open-loop level's wait for a slot is over the requests it will measure (``LevelPlan``
    ``open_loop_requests``: ``load.requests_per_level``, or its rate over ``seconds_per_level``) sent into an empty
    queue, as the trial's estimate of the measured level counts it (trial/estimated.py), not the long run's."""
    if spec.device == "gpu" and spec.gpu is None:
        return "no hardware.gpu named"
    if any(level.conversations or level.kind not in ("concurrency", "rate") for level in spec.levels):
        return "the ladder's loads are conversations, which the estimate does not model"
    try:
        arch = load_model_arch(spec.model)
        hardware = resolve_hardware("cpu") if spec.device == "cpu" else resolve_hardware("gpu", spec.gpu,
                                                                                           spec.gpu_memory_gib)  # fmt: skip
        factors = load_factors()
        if efficiency is not None:
            factors = factors.with_class(gpu_class(hardware.name), efficiency)
        rates = RECORDED_HOST if spec.device == "cpu" else None
        out = []
        image_tokens, flops = workload_images(spec.workload, arch.vision, spec.engine_args)
        for level in spec.levels:
            # an open loop's level waits for a slot over its planned requests, as its measurement will be estimated
            planned = LevelPlan.sized(level, spec.requests_per_level, spec.seconds_per_level, spec.warmup_requests)
            load = Load.at_level(level.kind, level.value, lengths[0] + image_tokens, lengths[1], flops,
                                 arrival_burstiness(spec.workload), planned.open_loop_requests)  # fmt: skip
            est = estimate(arch, spec.engine_args, hardware, load, factors, env=spec.env, rates=rates)
            out.append(LevelForecast(level, est))
        return out
    except (UserError, ValueError, KeyError, OSError) as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def estimated_metrics(est: Estimate, price_per_device_hour: float, devices: int) -> dict[str, float]:
    """A level's estimate under the study's metric names: every latency statistic takes the estimated mean."""
    out = {"output_throughput": est.output_throughput, "request_throughput": est.request_throughput,
           COST_METRIC: cost_per_mtok_usd(price_per_device_hour, devices, est.output_throughput)}  # fmt: skip
    for metric, field in ESTIMATED_METRICS.items():
        value = getattr(est, field)
        if value is not None:
            out.update({f"{metric}_{stat}": value for stat in ("mean", "p50", "p90", "p95", "p99")})
    return out


def meets_slo(metrics: dict[str, float], slo: Slo) -> bool:
    """Whether estimated ``metrics`` meet every bound the estimate predicts (others, error_rate say, are not judged)."""
    return all(metrics.get(b.name, 0.0) <= b.limit for b in slo.bounds if b.metric in ESTIMATED_METRICS)


def estimated_objective(
    forecasts: Sequence[LevelForecast], objective: Objective, slo: Slo, price: float, devices: int
) -> float | None:
    """The objective at the level the trial would be judged at (the highest request throughput meeting the SLO, as
    estimated), with goodput as that level's request throughput; None when no level meets it or it has no value."""
    meeting = [
        metrics
        for fc in forecasts
        if meets_slo(metrics := estimated_metrics(fc.estimate, price, devices), slo) and not fc.estimate.saturated
    ]
    if not meeting:
        return None
    best = max(meeting, key=lambda m: m["request_throughput"])
    value = best["request_throughput"] if objective.metric == "goodput" else best.get(objective.metric)
    return value


def seed_count(space: SearchSpace, budget: int) -> int:
    """How many of the estimate's likely winners a Bayesian study proposes first: ``search.estimate.seed_trials``,
    else min(4, a quarter of the trials); none when seeding is off or the search is a grid or random."""
    settings = space.search.estimate
    if not settings.seed or space.search.algorithm in ("grid", "random"):
        return 0
    return settings.seed_trials if settings.seed_trials is not None else min(4, budget // 4)


def likely_winners(
    scored: Sequence[tuple[dict[str, Any], float | None]], objective: Objective, k: int
) -> list[dict[str, Any]]:
    """The ``k`` points with the best estimated objective (None: not a likely winner), best first; ties keep order."""
    known = [(params, value) for params, value in scored if value is not None]
    known.sort(key=lambda pv: pv[1], reverse=objective.mode == "max")
    return [params for params, _ in known[:k]]


def estimate_seeds(context: StudyContext, k: int) -> list[dict[str, Any]]:
    """The ``k`` points of the space's grid the estimate ranks best by the first objective (shipped factors, the
    workload's mean lengths), best first; none for a space without a grid (continuous ranges) or where no point
    can be estimated."""
    if k <= 0:
        return []
    space = context.space
    try:
        kept, _ = space.grid()
    except ValueError:
        return []
    objective, lengths = space.search.objectives[0], mean_lengths(context.workload)
    scored = []
    for params in kept:
        spec = context.spec_for(params)
        forecasts = forecast(spec, lengths)
        value = None
        if not isinstance(forecasts, str):
            value = estimated_objective(
                forecasts, objective, space.slo_bounds, spec.price_per_device_hour, spec.devices
            )
        scored.append((params, value))
    return likely_winners(scored, objective, k)
