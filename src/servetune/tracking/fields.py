"""MLflow params and metrics of a trial run and of the study's parent run (pure: no MLflow, no I/O).

Trial params are the core engine parameters of the checklist, each the value the launch set or,
where it left one to vLLM, the value vLLM resolved at start-up (``resolved_engine_args``); one
whose value is known neither way is left out rather than written as a word among numbers. The
varied values and the devices reserved follow.

Trial metrics: the unprefixed names (``ttft_ms_p99``, ``goodput``, ``cost_per_mtok_usd``...) are
the trial's *chosen* operating point, so a column of the runs table compares like with like: its
level at capacity, else its best level meeting the SLO, else the highest load it measured (results.py
``chosen_level`` says which, and the run's ``servetune.level`` and ``servetune.level_choice`` tags name it). Every level's numbers are also logged as series
``by_level/<name>`` with step = level index. Values are rounded to :data:`SIGNIFICANT` digits.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from servetune.config.space import ENV_PREFIX
from servetune.metrics import COST_METRIC, ENERGY_PER_TOKEN, GOODPUT, REQUEST_THROUGHPUT
from servetune.report.diagnosis import diagnose, limited_by
from servetune.report.params import short_config
from servetune.report.points import level_label
from servetune.results import OUTCOMES, StudyInfo, TrialResult, chosen_level, estimate_accuracy
from servetune.secrets import redact_params

#: Engine arguments every trial run records (checklist: TP PP DP, context, KV, batching, scheduling).
CORE_ENGINE_ARGS = (
    "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "dtype", "quantization",
    "kv_cache_dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization",
    "block_size", "enable_chunked_prefill", "enable_prefix_caching", "enforce_eager",
)  # fmt: skip
#: The CPU build's KV space (GiB), which stands in for gpu_memory_utilization there.
CPU_KV_SPACE = "VLLM_CPU_KVCACHE_SPACE"
DEFAULT = "default"
BY_LEVEL = "by_level/"  # prefix of the per-level series (MLflow groups charts by the part before "/")
SIGNIFICANT = 4  # significant digits of a logged metric that is not a whole number
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. :/]")


@dataclass(frozen=True)
class MetricPoint:
    key: str
    value: float
    step: int = 0


def metric_key(name: str) -> str:
    """A name MLflow accepts (letters, digits, ``_-. :/``)."""
    return _UNSAFE.sub("_", name)


def format_value(value: Any) -> str:
    if value is None:
        return DEFAULT
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def engine_setting(trial: TrialResult, name: str) -> Any:
    """An engine argument as the launch set it, else as vLLM resolved it (None when neither is known)."""
    value = trial.engine_args.get(name)
    return value if value is not None else trial.resolved_engine_args.get(name)


def engine_value(trial: TrialResult, name: str) -> str:
    """:func:`engine_setting` as text, ``default`` when unknown."""
    return format_value(engine_setting(trial, name))


def chosen_params(trial: TrialResult) -> dict[str, str]:
    """The values the search chose, as text; a secret (servetune/secrets.py) becomes ``***``."""
    return {name: format_value(value) for name, value in redact_params(trial.params).items()}


def trial_params(trial: TrialResult) -> dict[str, str]:
    """Core parameters (as set, else as vLLM resolved them; unknown ones left out), the varied ones, devices."""
    params: dict[str, str] = {}
    for name in CORE_ENGINE_ARGS:
        if name == "gpu_memory_utilization" and trial.device == "cpu" and name not in trial.engine_args:
            continue  # the CPU build sizes its KV cache from VLLM_CPU_KVCACHE_SPACE instead
        value = engine_setting(trial, name)
        if value is not None:
            params[name] = format_value(value)
    if trial.device == "cpu" and CPU_KV_SPACE in trial.env:
        params[ENV_PREFIX + CPU_KV_SPACE] = trial.env[CPU_KV_SPACE]
    params.update({metric_key(name): value for name, value in chosen_params(trial).items()})
    params["devices"] = str(trial.devices)
    if trial.price is not None:  # the price its cost is at, and where it came from (capacity/prices.py)
        params["price_per_device_hour"] = format_value(trial.price.usd_per_device_hour)
        params["price_source"] = trial.price.describe()
    if trial.capacity is not None and trial.capacity.profile is not None:  # the vLLM memory profile it was planned with
        params["capacity_profile"] = trial.capacity.profile
    return params


def short_label(params: Mapping[str, Any]) -> str:
    """The chosen values in few characters, as the report writes them (``seqs=32 mbt=4096 chunk=off``,
    ``vLLM defaults`` for the baseline), secrets masked."""
    return short_config(redact_params(params))


def run_name(trial: TrialResult) -> str:
    """What the runs table shows first: the configuration, then the trial id."""
    return f"{short_label(trial.params)} · {trial.trial_id}"


def study_params(info: StudyInfo) -> dict[str, str]:
    return {
        "algorithm": info.algorithm,
        "objectives": ", ".join(f"{metric} ({mode})" for metric, mode in info.objectives),
        "slo": "; ".join(info.slo) or "none",
        "price_per_device_hour": format_value(info.price_per_device_hour)
        if info.price_per_device_hour is not None
        else f"per GPU type ({info.price_list} price list)",
        "model": info.model,
        "workload": info.workload,
        "device": info.device,
        "servetune_version": info.servetune_version,
    }


def rounded(value: float, digits: int = SIGNIFICANT) -> float:
    """``value`` to ``digits`` significant digits; whole numbers (counts, tokens) stay exact."""
    if value == 0 or float(value).is_integer():
        return float(value)
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def _finite(items: Iterable[tuple[str, float | int | None]], step: int) -> list[MetricPoint]:
    out = []
    for key, value in items:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out.append(MetricPoint(metric_key(key), rounded(float(value)), step))
    return out


def tail_ratio(p50: float | None, p99: float | None) -> float | None:
    """(P99 - P50) / P50: how far the tail stands from the middle (None without a middle)."""
    if p50 is None or p99 is None or p50 <= 0:
        return None
    return (p99 - p50) / p50


def level_metrics(trial: TrialResult) -> list[dict[str, float | None]]:
    """Per level: summary, cost, load, counts, SLO verdict, server counters and telemetry."""
    out = []
    for op, level in zip(trial.operating_points(), trial.levels, strict=True):
        summary = level.summary
        values: dict[str, float | None] = dict(op.metrics)
        values.update({f"level_{k}": v for k, v in summary.level.items()})
        values.update(
            completed=summary.completed, failed=summary.failed, meets_slo=float(level.meets_slo),
            ttft_ms_tail_ratio=tail_ratio(summary.ttft_ms.p50, summary.ttft_ms.p99), send_sync_share=level.send_sync_share,
            frontend_cpu_share=level.frontend_cpu_share,
        )  # fmt: skip
        for source in (level.server_metrics, level.telemetry):
            values.update({k: v for k, v in source.items() if k not in values})
        if level.estimate is not None:  # what the estimate predicted for the level, and how far off it was
            est = level.estimate
            values.update({"estimate/ttft_ms": est.ttft_ms, "estimate/tpot_ms": est.tpot_ms,
                           "estimate/output_throughput": est.output_throughput})  # fmt: skip
            values.update({f"estimate_error/{metric}": error for metric, error in est.error.items()})
        out.append(values)
    return out


def trial_metrics(trial: TrialResult) -> list[MetricPoint]:
    """The chosen level's numbers under plain names, every level's as ``by_level/`` series, and trial totals."""
    levels = level_metrics(trial)
    points: list[MetricPoint] = []
    for index, values in enumerate(levels):
        points += _finite([(BY_LEVEL + k, v) for k, v in values.items()], index)
    chosen = chosen_level(trial)
    if chosen is not None:
        points += _finite(levels[chosen.index].items(), 0)
        points += _finite([("level_index", chosen.index)], 0)
    totals: dict[str, float | None] = {
        "levels_run": len(trial.levels), "startup_s": trial.startup_s, "duration_s": trial.duration_s,
        "kv_prediction_error": trial.kv_prediction_error,
        "kv_cache_tokens": trial.kv_capacity.tokens if trial.kv_capacity else None,
        "kv_cache_tokens_planned": trial.kv_capacity.planned_tokens if trial.kv_capacity else None,
    }  # fmt: skip
    startup = {f"startup/{k}": v for k, v in trial.startup_phases.items()}
    return (
        points + _finite(totals.items(), 0) + _finite(quality_metrics(trial).items(), 0) + _finite(startup.items(), 0)
        + _finite(capacity_metrics(trial).items(), 0) + _finite(knee_metrics(trial).items(), 0)
    )  # fmt: skip


def knee_metrics(trial: TrialResult) -> dict[str, float | None]:
    """Where the trial's throughput stopped growing with load (results.py ``find_knee``): ``knee``, and the
    output tok/s measured there as ``knee/output_throughput`` (none without a level measured)."""
    knee = trial.knee_found
    if knee is None:
        return {}
    return {"knee": knee.value, "knee/output_throughput": knee.throughput}


def capacity_metrics(trial: TrialResult) -> dict[str, float | None]:
    """The capacity search's answer (trial/capacity.py): ``capacity`` and its bracket ``capacity_lo`` (met the SLO)
    and ``capacity_hi`` (broke it), the verdict noise, and the cost and goodput of the level measured at capacity,
    the numbers a team ships on (none without a capacity search)."""
    found = trial.capacity_at_slo
    if found is None:
        return {}
    values: dict[str, float | None] = {"capacity": found.value, "capacity_lo": found.bracket[0],
                                       "capacity_hi": found.bracket[1], "capacity_verdict_noise": found.verdict_noise}  # fmt: skip
    index = trial.capacity_level_index
    if index is not None:
        at = trial.operating_points()[index].metrics
        values.update({f"capacity/{name}": at.get(name) for name in (COST_METRIC, GOODPUT, ENERGY_PER_TOKEN)})
    return values


def quality_metrics(trial: TrialResult) -> dict[str, float | None]:
    """The quality probe's scores as ``quality/`` metrics (none without a probe)."""
    q = trial.quality
    if q is None:
        return {}
    values: dict[str, float | None] = {"quality/agreement": q.agreement, "quality/exact_match": q.exact_match,
                                       "quality/nll_delta": q.nll_delta, "quality/probe_s": q.duration_s}  # fmt: skip
    if q.passed is not None:
        values["quality/passed"] = float(q.passed)
    values.update({f"quality/{name}": score for name, score in q.suites.items()})
    return values


def level_tags(trial: TrialResult) -> dict[str, str]:
    """Which level the plain metric names hold (``servetune.level``) and why that one, the throughput its
    ``cost_per_mtok_usd`` is priced at (``servetune.cost_priced_by``: LevelSummary.priced_by), the window its
    ``goodput`` is counted over (``servetune.goodput_window``, where it has one), and why that level has no energy
    per token where it has none (``servetune.energy_note``)."""
    chosen = chosen_level(trial)
    if chosen is None:
        return {"servetune.level": "none measured"}
    level = trial.levels[chosen.index]
    tags = {"servetune.level": level_label(level.summary.level), "servetune.level_choice": chosen.note,
            "servetune.cost_priced_by": level.summary.priced_by}  # fmt: skip
    if level.summary.goodput_window is not None:
        tags["servetune.goodput_window"] = level.summary.goodput_window
    if level.energy_note is not None:
        tags["servetune.energy_note"] = level.energy_note
    return tags


#: The tag that says what limited a trial, and the next lever (report/diagnosis.py).
LIMITED_BY_TAG = "servetune.limited_by"


def diagnosis_tags(trial: TrialResult) -> dict[str, str]:
    """What limited the trial (``servetune.limited_by``: its first finding, ``symptom → lever``, or why none) and
    every rule that found something (``servetune.findings``, in the checklist's order, where any did)."""
    tags = {LIMITED_BY_TAG: limited_by(trial)}
    findings = diagnose(trial)
    if findings:
        tags["servetune.findings"] = ", ".join(finding.rule for finding in findings)
    return tags


def study_metrics(trials: Sequence[TrialResult]) -> dict[str, float]:
    """Counts by outcome, and the best goodput and lowest cost among points meeting the SLO."""
    out: dict[str, float] = {"trials_total": float(len(trials))}
    for outcome in OUTCOMES:
        out[f"trials_{outcome.lower()}"] = float(sum(t.outcome == outcome for t in trials))
    meeting = [p for t in trials if t.outcome == "COMPLETE" for p in t.operating_points() if p.meets_slo]
    out["trials_meeting_slo"] = float(len({p.trial_id for p in meeting}))
    goodputs = [g for p in meeting if (g := _goodput(p.metrics)) is not None]
    costs = [p.metrics[COST_METRIC] for p in meeting if math.isfinite(p.metrics.get(COST_METRIC, math.inf))]
    if goodputs:
        out["best_goodput"] = max(goodputs)
    if costs:
        out["best_cost_per_mtok_usd"] = min(costs)
    for accuracy in estimate_accuracy(list(trials)):  # |predicted / measured - 1| over the study's levels
        out[f"estimate_error_median/{accuracy.metric}"] = accuracy.median
        out[f"estimate_error_worst/{accuracy.metric}"] = accuracy.worst
    return out


def _goodput(metrics: Mapping[str, float]) -> float | None:
    value = metrics.get(GOODPUT, metrics.get(REQUEST_THROUGHPUT))
    return value if value is not None and math.isfinite(value) else None
