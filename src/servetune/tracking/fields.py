"""MLflow params and metrics of a trial run and of the study's parent run (pure: no MLflow, no I/O).

Trial params are the core engine parameters of the checklist (vLLM's default written as
``default`` when the launch left them unset) plus whatever the search varied. Trial metrics
are every level's flat summary (``LevelSummary.flat()`` names, step = level index) with the
level's cost, server counters and telemetry, then the best operating point as ``best_*``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from servetune.config.space import ENV_PREFIX
from servetune.metrics import COST_METRIC
from servetune.results import OperatingPoint, StudyInfo, TrialResult, best_level_index
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


def engine_value(trial: TrialResult, name: str) -> str:
    """An engine argument of the launch, or ``default`` when vLLM chose it."""
    return format_value(trial.engine_args.get(name))


def chosen_params(trial: TrialResult) -> dict[str, str]:
    """The values the search chose, as text; a secret (servetune/secrets.py) becomes ``***``."""
    return {name: format_value(value) for name, value in redact_params(trial.params).items()}


def trial_params(trial: TrialResult) -> dict[str, str]:
    """Core parameters (``default`` when unset), the varied ones, and the devices reserved."""
    params: dict[str, str] = {}
    for name in CORE_ENGINE_ARGS:
        if name == "gpu_memory_utilization" and trial.device == "cpu" and name not in trial.engine_args:
            continue  # the CPU build sizes its KV cache from VLLM_CPU_KVCACHE_SPACE instead
        params[name] = engine_value(trial, name)
    if trial.device == "cpu":
        params[ENV_PREFIX + CPU_KV_SPACE] = trial.env.get(CPU_KV_SPACE, DEFAULT)
    params.update({metric_key(name): value for name, value in chosen_params(trial).items()})
    params["devices"] = str(trial.devices)
    return params


def study_params(info: StudyInfo) -> dict[str, str]:
    return {
        "algorithm": info.algorithm,
        "objectives": ", ".join(f"{metric} ({mode})" for metric, mode in info.objectives),
        "slo": "; ".join(info.slo) or "none",
        "price_per_device_hour": format_value(info.price_per_device_hour),
        "model": info.model,
        "workload": info.workload,
        "device": info.device,
        "servetune_version": info.servetune_version,
    }


def _finite(items: Iterable[tuple[str, float | int | None]], step: int) -> list[MetricPoint]:
    out = []
    for key, value in items:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out.append(MetricPoint(metric_key(key), float(value), step))
    return out


def best_index(trial: TrialResult) -> int | None:
    """The trial's recorded best level, or the one ``best_level_index`` picks when none was recorded."""
    if trial.best_level_index is not None and trial.best_level_index < len(trial.levels):
        return trial.best_level_index
    return best_level_index(trial.levels)


def best_point(trial: TrialResult) -> OperatingPoint | None:
    index = best_index(trial)
    return None if index is None else trial.operating_points()[index]


def tail_ratio(p50: float | None, p99: float | None) -> float | None:
    """(P99 - P50) / P50: how far the tail stands from the middle (None without a middle)."""
    if p50 is None or p99 is None or p50 <= 0:
        return None
    return (p99 - p50) / p50


def trial_metrics(trial: TrialResult) -> list[MetricPoint]:
    """Per level (step = index): summary, cost, counts, server counters, telemetry; then best_* and trial totals."""
    points: list[MetricPoint] = []
    for op, level in zip(trial.operating_points(), trial.levels):
        summary = level.summary
        flat = dict(op.metrics)
        extra: dict[str, float | None] = {f"level_{k}": v for k, v in summary.level.items()}
        extra.update(
            completed=summary.completed, failed=summary.failed, meets_slo=float(level.meets_slo),
            ttft_ms_tail_ratio=tail_ratio(summary.ttft_ms.p50, summary.ttft_ms.p99),
        )  # fmt: skip
        for source in (level.server_metrics, level.telemetry):
            extra.update({k: v for k, v in source.items() if k not in flat})
        points += _finite([*flat.items(), *extra.items()], op.level_index)
    best = best_point(trial)
    if best is not None:
        points += _finite([(f"best_{k}", v) for k, v in best.metrics.items()], 0)
        points += _finite([("best_level_index", best.level_index)], 0)
    totals: dict[str, float | None] = {
        "levels_run": len(trial.levels), "startup_s": trial.startup_s, "duration_s": trial.duration_s,
        "kv_prediction_error": trial.kv_prediction_error,
        "kv_cache_tokens": trial.kv_capacity.tokens if trial.kv_capacity else None,
    }  # fmt: skip
    return points + _finite(totals.items(), 0)


def study_metrics(trials: Sequence[TrialResult]) -> dict[str, float]:
    """Counts by outcome, and the best goodput and lowest cost among points meeting the SLO."""
    out: dict[str, float] = {"trials_total": float(len(trials))}
    for outcome in ("COMPLETE", "INFEASIBLE", "FAILED"):
        out[f"trials_{outcome.lower()}"] = float(sum(t.outcome == outcome for t in trials))
    meeting = [p for t in trials if t.outcome == "COMPLETE" for p in t.operating_points() if p.meets_slo]
    out["trials_meeting_slo"] = float(len({p.trial_id for p in meeting}))
    goodputs = [_goodput(p.metrics) for p in meeting]
    goodputs = [g for g in goodputs if g is not None]
    costs = [p.metrics[COST_METRIC] for p in meeting if math.isfinite(p.metrics.get(COST_METRIC, math.inf))]
    if goodputs:
        out["best_goodput"] = max(goodputs)
    if costs:
        out["best_cost_per_mtok_usd"] = min(costs)
    return out


def _goodput(metrics: Mapping[str, float]) -> float | None:
    value = metrics.get("goodput", metrics.get("request_throughput"))
    return value if value is not None and math.isfinite(value) else None
