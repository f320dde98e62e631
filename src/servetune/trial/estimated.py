"""Every measured level beside its estimate: :func:`estimate_levels`, called as a trial ends.

The estimate (:mod:`servetune.estimate`) is made at each level's load (clients or requests/s) with the
mean request lengths the level served, on the hardware the capacity check sized, with the factors
the trial was given (the shipped ones unless the study refitted them). Its relative error against the
measured mean TTFT, mean TPOT and output throughput is recorded beside it. Where no estimate can be
made (a model the memory ledger does not plan, a GPU outside the catalogue), ``estimate_note`` says why;
the trial itself never fails for it. A speculative trial is estimated at the acceptance each level measured
(vLLM's mean acceptance length), so the error is the step model's, not a guess of the acceptance's. A level of a
vision-language workload served its images' tokens in its prompts (vLLM's ``usage`` counts them) and is estimated
with the vision tower's time to encode them too (estimate/encoder.py ``workload_images``), as ``servetune estimate``
and the dry run estimate it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from servetune.capacity import Hardware, ModelArch, gpu_hardware, load_model_arch, plan_capacity, resolve_hardware
from servetune.capacity.draft import load_draft, speculative_config
from servetune.errors import UserError
from servetune.estimate import Efficiency, Estimate, Load, estimate, gpu_class, load_factors, replica_from_plan
from servetune.estimate.calibrate import CalibrationPoint
from servetune.estimate.calibrate_cpu import RECORDED_HOST
from servetune.estimate.encoder import workload_images
from servetune.estimate.model import arrival_burstiness
from servetune.estimate.speculative import acceptance_for_length
from servetune.metrics import SPEC_MEAN_ACCEPTED_LENGTH
from servetune.results import LevelEstimate, LevelResult, TrialResult

if TYPE_CHECKING:
    from servetune.config.workload import Workload

#: The metrics an estimate is compared on: (estimate field, summary field, statistic).
COMPARED = (("ttft_ms", "ttft_ms", "mean"), ("tpot_ms", "tpot_ms", "mean"), ("output_throughput", None, None))


def estimate_levels(
    result: TrialResult,
    gpu: str | None,
    gpu_memory_gib: float | None,
    efficiency: Efficiency | None = None,
    workload: Workload | None = None,
) -> None:
    """Fill each measured level's ``estimate`` of ``result`` (or ``result.estimate_note``); never raises.

    ``gpu`` / ``gpu_memory_gib``: the space's ``hardware.gpu`` (else the GPU the trial got, from its
    environment); ``efficiency``: refit factors for that GPU class (None: the shipped ones). On vLLM's CPU
    build the cores' rates are the recording host's (``calibrate_cpu.RECORDED_HOST``), which the shipped CPU
    factors were fitted with. ``workload``: the trial's, whose images the vision tower encodes (None: text).
    """
    levels = [lv for lv in result.levels if lv.summary.completed]
    if not levels:
        return
    if result.capacity is not None and not result.capacity.planned:
        result.estimate_note = f"not estimated: the memory ledger did not plan the model ({result.capacity.reason})"
        return
    try:
        resolved = _resolve(result, gpu, gpu_memory_gib)
        if resolved is None:
            result.estimate_note = "not estimated: no GPU named in hardware.gpu and none seen by the trial"
            return
        arch, hardware = resolved
        factors = load_factors()
        rates = RECORDED_HOST if result.device == "cpu" else None
        if efficiency is not None:
            factors = factors.with_class(gpu_class(hardware.name), efficiency)
        draft = load_draft(result.engine_args)
        _image_tokens, flops = workload_images(workload, arch.vision, result.engine_args)  # already in the prompts
        for level in levels:
            load = Load.measured(level.summary, flops, arrival_burstiness(workload))
            if load is None:
                continue
            est = estimate(arch, result.engine_args, hardware, load, factors, env=result.env, rates=rates,
                           acceptance=measured_acceptance(level, result.engine_args), draft=draft)  # fmt: skip
            level.estimate = _compared(est.ttft_ms, est.tpot_ms, est.output_throughput, level)
        result.estimate_factors = "shipped" if efficiency is None else "refit"
    except UserError as exc:  # a model or GPU the estimate does not cover: said in the user's words
        result.estimate_note = f"not estimated: {str(exc).splitlines()[0]}"
    except Exception as exc:  # the estimate is a side note of the measurement: it never costs the trial its result
        result.estimate_note = f"not estimated: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def measured_acceptance(level: LevelResult, engine_args: dict[str, Any]) -> float | None:
    """The drafter's acceptance per draft position at this level, from vLLM's mean acceptance length (None without
    a drafter or a measurement): the estimate then models the step the level ran, not an assumed acceptance."""
    length = level.server_metrics.get(SPEC_MEAN_ACCEPTED_LENGTH)
    if length is None:
        return None
    config = speculative_config(engine_args)
    if config is None or config.get("num_speculative_tokens") is None:
        return None
    return acceptance_for_length(length, int(config["num_speculative_tokens"]))


def _resolve(result: TrialResult, gpu: str | None, gpu_memory_gib: float | None) -> tuple[ModelArch, Hardware] | None:
    """The model and the hardware the trial's estimate is made for; None where no GPU is known."""
    arch = load_model_arch(result.model)
    seen = result.environment.get("gpu_model")
    if result.device == "cpu":
        return arch, resolve_hardware("cpu")
    if gpu is not None:
        return arch, resolve_hardware("gpu", gpu, gpu_memory_gib)
    if seen and not seen.startswith("no NVIDIA GPU"):
        return arch, gpu_hardware(seen, int(float(result.environment.get("gpu_memory_gib", "0")) * 2**30))
    return None


def calibration_points(
    result: TrialResult, gpu: str | None, gpu_memory_gib: float | None, workload: Workload | None = None
) -> list[CalibrationPoint]:
    """A COMPLETE trial's measured levels as points the factors can be refitted on (:mod:`servetune.estimate.refit`);
    none for another outcome, or where the trial was not estimated. ``workload``'s images (None: text) are encoded
    in each point's prediction as in the level's estimate, so the refit does not fold the encoder into the factors."""
    if result.outcome != "COMPLETE" or result.estimate_note is not None:
        return []
    resolved = _resolve(result, gpu, gpu_memory_gib)
    if resolved is None:
        return []
    arch, hardware = resolved
    _image_tokens, flops = workload_images(workload, arch.vision, result.engine_args)
    points: list[CalibrationPoint] = []
    for level in result.levels:
        load = Load.measured(level.summary, flops, arrival_burstiness(workload))
        if load is None or (load.concurrency is None and load.rate is None):
            continue
        s = level.summary
        plan = plan_capacity(arch, result.engine_args, hardware, env=result.env,
                             request_tokens=load.input_tokens + load.output_tokens)  # fmt: skip
        if not plan.fits:
            return []
        rates = RECORDED_HOST if result.device == "cpu" else None
        replica = replica_from_plan(arch, plan, result.engine_args, rates)
        dp = int(result.engine_args.get("data_parallel_size") or 1)
        measured = {"ttft_ms": s.ttft_ms.mean, "tpot_ms": s.tpot_ms.mean, "output_throughput": s.output_throughput / dp}
        points.append(
            CalibrationPoint(
                row=len(points), source_id=result.trial_id, gpu_class=gpu_class(replica.rates.gpu),
                model=arch.name, replica=replica, regime="closed" if load.concurrency is not None else "open",
                input_tokens=load.input_tokens, output_tokens=load.output_tokens,
                load=float(load.concurrency if load.concurrency is not None else load.rate or 0) / dp,
                measured={k: v for k, v in measured.items() if v is not None and v > 0}, held_out=False,
                encoder_flops=load.encoder_flops, burstiness=load.burstiness,
                requests=None if load.requests is None else load.requests / dp,
            )
        )  # fmt: skip
    return points


def _compared(ttft_ms: float | None, tpot_ms: float, throughput: float, level: LevelResult) -> LevelEstimate:
    predicted = {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "output_throughput": throughput}
    error = {}
    for metric, field, stat in COMPARED:
        got = predicted[metric]
        summary = level.summary
        measured = getattr(getattr(summary, field), stat) if field and stat else summary.output_throughput
        if got is not None and measured:
            error[metric] = got / measured - 1
    return LevelEstimate(ttft_ms=ttft_ms, tpot_ms=tpot_ms, output_throughput=throughput, error=error)


def planned_estimate(
    model: str, device: str, engine_args: dict[str, Any], env: dict[str, str], gpu: str | None,
    gpu_memory_gib: float | None, kind: str, value: float, input_tokens: int, output_tokens: int,
    workload: Workload | None = None, requests: int | None = None,
) -> Estimate | str:  # fmt: skip
    """The estimate of a trial before it runs, at one load (``kind`` concurrency or rate) with the workload's mean
    lengths (text: ``workload``'s images add their tokens and the tower's encoding, estimate/encoder.py
    ``workload_images``) and the shipped factors; where none can be made, why, in words (``run --dry-run``'s
    column). ``requests``: an open-loop level's planned requests, whose wait for a slot starts on an empty queue
    (``LevelPlan.open_loop_requests``; None: the long run's wait)."""
    if device == "gpu" and gpu is None:
        return "no hardware.gpu"
    try:
        arch = load_model_arch(model)
        hardware = resolve_hardware("cpu") if device == "cpu" else resolve_hardware("gpu", gpu, gpu_memory_gib)
        image_tokens, flops = workload_images(workload, arch.vision, engine_args)
        load = Load.at_level(
            kind, value, input_tokens + image_tokens, output_tokens, flops, arrival_burstiness(workload), requests
        )
        rates = RECORDED_HOST if device == "cpu" else None
        return estimate(arch, engine_args, hardware, load, env=env, rates=rates)
    except (UserError, ValueError, KeyError) as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
