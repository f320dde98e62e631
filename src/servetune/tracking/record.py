"""The experiment record of one trial (tuning checklist, section 16), as data, tags and Markdown.

:func:`build_record` turns a trial's result, the lengths it sent and its model's fingerprint
into the ten fields of the checklist's template, each a line of text, plus structured tags
(``hardware.gpu_model``, ``stability.oom``...) that MLflow can filter on. :func:`render_record`
fills ``trials/record_template.md`` with them. Pure: the caller reads the files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from string import Template

from servetune.engine.cores import cores_words
from servetune.metrics import COST_METRIC, E2EL_P99, TPOT_P99, TTFT_P99
from servetune.report.conclusion import Conclusion, Verdict, conclude  # noqa: F401 (sync.py, __init__ import them here)
from servetune.report.points import first_line, is_out_of_memory, level_label
from servetune.report.trials import cache_notes
from servetune.results import LevelResult, StudyInfo, TrialResult, chosen_level
from servetune.shipped import trials_dir
from servetune.tracking.fields import (
    CORE_ENGINE_ARGS,
    CPU_KV_SPACE,
    chosen_params,
    engine_value,
    tail_ratio,
    trial_params,
)
from servetune.tracking.inputs import UNKNOWN, ModelFingerprint, RequestStats

TEMPLATE_FILE = trials_dir() / "record_template.md"
NOT_EVALUATED = "not evaluated"

#: The template's fields in order: (key, English name, checklist name).
FIELDS = (
    ("experiment", "Experiment id", "实验编号"),
    ("model_precision", "Model and precision", "模型与精度"),
    ("hardware", "Hardware", "硬件"),
    ("software", "Software stack", "软件栈"),
    ("request_distribution", "Request distribution", "请求分布"),
    ("core_parameters", "Core parameters", "核心参数"),
    ("performance", "Performance", "性能结果"),
    ("quality", "Quality", "质量结果"),
    ("stability", "Stability", "稳定性"),
    ("conclusion", "Conclusion", "结论"),
)
HARDWARE_KEYS = ("gpu_model", "gpu_count", "gpu_memory_gib", "interconnect", "cpu_model", "host_memory_gib")
SOFTWARE_KEYS = ("driver", "cuda", "nccl", "vllm", "torch", "ray")


@dataclass(frozen=True)
class ExperimentRecord:
    """The ten fields as text (``fields``), structured tags, and what the Markdown shows besides."""

    trial_id: str
    study: str
    fields: dict[str, str]
    tags: dict[str, str]
    outcome: str
    levels: list[str] = field(default_factory=list)  # one Markdown table row per level

    def all_tags(self) -> dict[str, str]:
        return {**self.tags, **{f"record.{key}": value for key, value in self.fields.items()}}


def build_record(
    trial: TrialResult, info: StudyInfo | None, requests: RequestStats | None, model: ModelFingerprint,
    conclusion: Conclusion, engine_log_tail: str = "",
) -> ExperimentRecord:  # fmt: skip
    env = trial.environment
    date = (trial.started_at or trial.finished_at or "")[:10] or UNKNOWN
    tags: dict[str, str] = {"record.id": f"{trial.study}/{trial.trial_id}", "record.date": date}
    dtype = engine_value(trial, "dtype")
    if dtype == "default" and model.config_dtype:
        dtype = f"default (checkpoint: {model.config_dtype})"
    tags.update({
        "model.name": trial.model, "model.weights_hash": model.weights_hash, "model.dtype": dtype,
        "model.quantization": engine_value(trial, "quantization"), "model.kv_cache_dtype": engine_value(trial, "kv_cache_dtype"),
        "hardware.device": trial.device, "hardware.devices": str(trial.devices),
    })  # fmt: skip
    tags.update({f"hardware.{k}": env.get(k) or UNKNOWN for k in HARDWARE_KEYS})
    tags.update({f"software.{k}": env.get(k) or UNKNOWN for k in SOFTWARE_KEYS})
    known = {*HARDWARE_KEYS, *SOFTWARE_KEYS, "device"}
    tags.update({f"environment.{k}": v for k, v in env.items() if k not in known})
    tags.update(_request_tags(trial, info, requests))
    rep = _representative(trial)
    stability = _stability_tags(trial, engine_log_tail, rep)
    tags.update(stability)
    quality = quality_tags(trial)
    tags.update({**quality, "conclusion": conclusion.verdict, "conclusion.why": conclusion.why})
    if trial.failure is not None:  # whose fault (trial/failures.py): filter out the cluster's in the UI
        tags.update({"failure.kind": trial.failure.kind, "failure.cause": trial.failure.cause})
    if trial.retried:
        tags["failure.retried"] = ", ".join(f.cause for f in trial.retried)

    fields = {
        "experiment": f"{trial.study}/{trial.trial_id}, {date}",
        "model_precision": f"{trial.model} (weights {model.weights_hash}); dtype {dtype}; quantization "
        f"{tags['model.quantization']}; KV cache dtype {tags['model.kv_cache_dtype']}",
        "hardware": _hardware_text(trial, tags),
        "software": ", ".join(f"{k} {tags['software.' + k]}" for k in SOFTWARE_KEYS),
        "request_distribution": _requests_text(tags),
        "core_parameters": _core_text(trial),
        "performance": _performance_text(trial, rep),
        "quality": quality_text(trial),
        "stability": f"OOM {stability['stability.oom']}; 5xx {stability['stability.http_5xx']}; cancelled "
        f"{stability['stability.cancelled']}; P99 jitter {stability['stability.ttft_p99_jitter']}",
        "conclusion": str(conclusion),
    }
    outcome = trial.outcome + (f": {first_line(trial.reason, 500)}" if trial.reason else "")
    return ExperimentRecord(trial.trial_id, trial.study, fields, tags, outcome, _level_rows(trial))


#: Section 16's three quality results, and the suites that measure each.
QUALITY_RESULTS = {"task_accuracy": ("arithmetic", "instructions", "multiturn"), "structured_output": ("json", "tools"),
                   "long_context_recall": ("recall",)}  # fmt: skip


def quality_tags(trial: TrialResult) -> dict[str, str]:
    """``quality`` (pass, FAIL: why, reference, or not evaluated) and section 16's three results, where measured."""
    q = trial.quality
    if q is None:
        return {"quality": NOT_EVALUATED}
    verdict = (
        "reference"
        if q.reference_trial == trial.trial_id
        else ("pass" if q.passed else "FAIL: " + "; ".join(q.failures))
    )
    tags = {"quality": verdict, "quality.reference_trial": q.reference_trial}
    for name, suites in QUALITY_RESULTS.items():
        scores = [q.suites[s] for s in suites if s in q.suites]
        if scores:
            tags[f"quality.{name}"] = (
                f"{sum(scores) / len(scores):.0%} ({', '.join(s for s in suites if s in q.suites)})"
            )
    if q.agreement is not None:
        tags["quality.agreement"] = f"{q.agreement:.0%}"
    return tags


def quality_text(trial: TrialResult) -> str:
    """The record's quality field: scores against the reference and the verdict."""
    q = trial.quality
    if q is None:
        return NOT_EVALUATED
    parts = []
    if q.agreement is not None:
        nll = f", NLL delta {q.nll_delta:+.3f} nats/token" if q.nll_delta is not None else ""
        parts.append(f"agreement {q.agreement:.0%}, exact match {q.exact_match or 0:.0%}{nll}")
    parts += [f"{name} {score:.0%}" for name, score in q.suites.items()]
    verdict = quality_tags(trial)["quality"]
    return f"{'; '.join(parts)} against trial {q.reference_trial}: {verdict}"


def _representative(trial: TrialResult) -> tuple[int, LevelResult, str] | None:
    """The level the trial is judged by (results.py ``chosen_level``), with a note saying which."""
    chosen = chosen_level(trial)
    return None if chosen is None else (chosen.index, trial.levels[chosen.index], chosen.note)


def _request_tags(trial: TrialResult, info: StudyInfo | None, requests: RequestStats | None) -> dict[str, str]:
    kinds: dict[str, list[str]] = {}
    for level in trial.levels:
        for name, value in level.summary.level.items():
            kinds.setdefault(name, []).append(f"{value:g}")
    levels = "; ".join(
        f"{name} {', '.join(values)}" + (" req/s" if name == "rate" else "") for name, values in kinds.items()
    )
    tags = {"requests.workload": info.workload if info else UNKNOWN, "requests.levels": levels or "none measured"}
    tags["requests.count"] = str(requests.requests) if requests else "0"
    for which in ("input_tokens", "output_tokens"):
        stats = getattr(requests, which) if requests else None
        for name in ("p50", "p95", "p99"):
            tags[f"requests.{which}_{name}"] = f"{getattr(stats, name):g}" if stats else UNKNOWN
    return tags


def _requests_text(tags: Mapping[str, str]) -> str:
    def lengths(which: str) -> str:
        return " / ".join(f"{p.upper()} {tags[f'requests.{which}_{p}']}" for p in ("p50", "p95", "p99"))

    return (f"workload {tags['requests.workload']}; input tokens {lengths('input_tokens')}; output tokens "
            f"{lengths('output_tokens')} ({tags['requests.count']} measured requests); levels: {tags['requests.levels']}")  # fmt: skip


def _hardware_text(trial: TrialResult, tags: Mapping[str, str]) -> str:
    host = f"CPU {tags['hardware.cpu_model']}, host memory {tags['hardware.host_memory_gib']} GiB"
    if trial.device == "cpu":
        bf16 = tags.get("environment.cpu_bf16")
        cpu = f"CPU build, {trial.devices} core(s) reserved{_cores_text(tags)}; {host}"
        return cpu + (f"; bfloat16 {bf16}" if bf16 else "")
    return (f"GPU {tags['hardware.gpu_model']}, count {tags['hardware.gpu_count']}, {tags['hardware.gpu_memory_gib']} GiB each, "
            f"interconnect {tags['hardware.interconnect']}; {trial.devices} GPU(s) reserved; {host}")  # fmt: skip


def _cores_text(tags: Mapping[str, str]) -> str:
    """Where the engine ran on the CPU build (engine/cores.py): the cores it was bound to, and, where it claimed none of
    its own, why: its numbers were measured on cores other engines used, not comparable with those of a trial that had
    its own."""
    return cores_words(tags.get("environment.cpu_binding"), tags.get("environment.cpu_unclaimed"))


def _core_text(trial: TrialResult) -> str:
    params = trial_params(trial)

    def get(name: str) -> str:
        return params.get(name, "default")

    kv = f"kv_cache_dtype {get('kv_cache_dtype')}, block_size {get('block_size')}"
    kv += (
        f", {CPU_KV_SPACE} {get('env.' + CPU_KV_SPACE)}"
        if trial.device == "cpu"
        else f", gpu_memory_utilization {get('gpu_memory_utilization')}"
    )
    text = (f"TP {get('tensor_parallel_size')}, PP {get('pipeline_parallel_size')}, DP {get('data_parallel_size')}; "
            f"context max_model_len {get('max_model_len')}; KV {kv}; batching max_num_seqs {get('max_num_seqs')}, "
            f"max_num_batched_tokens {get('max_num_batched_tokens')}; scheduling enable_chunked_prefill "
            f"{get('enable_chunked_prefill')}, enable_prefix_caching {get('enable_prefix_caching')}, enforce_eager {get('enforce_eager')}")  # fmt: skip
    core = {*CORE_ENGINE_ARGS, "env." + CPU_KV_SPACE}
    varied = {k: v for k, v in chosen_params(trial).items() if k not in core}
    return text + ("; also varied: " + ", ".join(f"{k}={v}" for k, v in varied.items()) if varied else "")


def _fmt(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:,.{digits}f}{unit}"


def _performance_text(trial: TrialResult, rep: tuple[int, LevelResult, str] | None) -> str:
    if rep is None:
        return "not measured (no load level ran)"
    index, level, note = rep
    s = level.summary
    lat = "; ".join(
        f"{name} P50 {_fmt(getattr(s, attr).p50, ' ms')} / P99 {_fmt(getattr(s, attr).p99, ' ms')}"
        for name, attr in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2el_ms"))
    )
    text = (f"at {level_label(s.level)} ({note}): {lat}; throughput {_fmt(s.output_throughput, ' output tok/s')}, "
            f"{_fmt(s.request_throughput, ' req/s', 2)}, goodput {_fmt(s.goodput, ' req/s', 2)}")  # fmt: skip
    if s.goodput_window == "every_client_busy":  # counted over the window the cost is priced at
        text += " with every client busy"
    cost = trial.operating_points()[index].metrics.get(COST_METRIC)
    text += f", {_fmt(cost, '', 3)} USD per million output tokens"
    if s.busy_output_throughput is not None:  # priced at the steady rate (LevelSummary.steady_output_throughput)
        text += f" (priced at {_fmt(s.busy_output_throughput, ' output tok/s')} with every client busy)"
    return text + "; " + _memory_text(level)


def _memory_text(level: LevelResult) -> str:
    t, parts = level.telemetry, []
    if "gpu_memory_used_gib_max" in t:
        parts.append(f"GPU memory peak {_fmt(t['gpu_memory_used_gib_max'], ' GiB')}")
    for key, label in (("engine_rss_gib_max", "engine RSS peak"), ("host_rss_gib_max", "host RSS peak"),
                       ("host_memory_used_gib_max", "host memory peak")):  # fmt: skip
        if key in t and not parts:
            parts.append(f"{label} {_fmt(t[key], ' GiB')}")
    if "gpu_util_mean" in t:
        parts.append(f"GPU utilization {_fmt(t['gpu_util_mean'], ' %')}")
    elif "host_cpu_percent_mean" in t:
        parts.append(f"host CPU {_fmt(t['host_cpu_percent_mean'], ' %')}")
    kv = level.server_metrics.get("kv_cache_usage_max")
    if kv is not None:
        parts.append(f"KV cache peak {_fmt(kv * 100, ' %')}")
    return ", ".join(parts) or "memory and utilization not sampled"


def _stability_tags(
    trial: TrialResult, engine_log_tail: str, rep: tuple[int, LevelResult, str] | None
) -> dict[str, str]:
    if trial.outcome in ("INFEASIBLE", "PRUNED"):
        oom = "not run"
    else:
        texts = [trial.reason, trial.log_tail] + ([engine_log_tail] if trial.outcome == "FAILED" else [])
        oom = "yes" if any(is_out_of_memory(t) for t in texts) else "no"
    errors: dict[str, int] = {}
    for level in trial.levels:
        for kind, count in level.summary.errors_by_kind.items():
            errors[kind] = errors.get(kind, 0) + count
    jitter = "-"
    if rep is not None:
        ratio = tail_ratio(rep[1].summary.ttft_ms.p50, rep[1].summary.ttft_ms.p99)
        if ratio is not None:
            jitter = f"{ratio:.2f} ((TTFT P99 - P50) / P50 at {level_label(rep[1].summary.level)})"
    p99s = [lv.summary.ttft_ms.p99 for lv in trial.levels if lv.summary.ttft_ms.p99 is not None]
    spread = f"{min(p99s):,.0f} to {max(p99s):,.0f} ms over {len(p99s)} levels" if p99s else "-"
    return {
        "stability.oom": oom, "stability.http_5xx": str(errors.get("http_5xx", 0)),
        "stability.cancelled": str(errors.get("cancelled", 0)), "stability.ttft_p99_jitter": jitter,
        "stability.ttft_p99_range": spread,
        "stability.errors": ", ".join(f"{k} {v}" for k, v in sorted(errors.items())) or "none",
        "stability.warm_cache": "; ".join(cache_notes(trial)) or "none",
    }  # fmt: skip


def _level_rows(trial: TrialResult) -> list[str]:
    rows = []
    for op, level in zip(trial.operating_points(), trial.levels, strict=True):
        m, s = op.metrics, level.summary
        verdict = "meets the SLO" if level.meets_slo else "breaks: " + "; ".join(level.slo_violations)
        rows.append(" | ".join([str(op.level_index), level_label(s.level), f"{s.completed}/{s.completed + s.failed}",
                                _fmt(m.get(TTFT_P99)), _fmt(m.get(TPOT_P99)), _fmt(m.get(E2EL_P99)),
                                _fmt(s.output_throughput), _fmt(s.goodput, digits=2), _fmt(m.get(COST_METRIC), digits=3),
                                _cell(verdict)]))  # fmt: skip
    return rows


_LEVEL_HEADER = ("| # | level | ok / sent | TTFT P99 ms | TPOT P99 ms | E2E P99 ms | output tok/s | goodput req/s "
                 "| USD / Mtok | SLO |\n|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip


def _cell(text: str) -> str:
    """Text that stays inside one Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def render_record(record: ExperimentRecord, template: str | None = None) -> str:
    """The filled ``record_template.md`` (or, without the template, the same fields as a plain table)."""
    if template is None:
        try:
            template = TEMPLATE_FILE.read_text(encoding="utf-8")
        except OSError:
            template = FALLBACK_TEMPLATE
    levels = "\n".join(f"| {row} |" for row in record.levels)
    values = {key: _cell(value) for key, value in record.fields.items()}
    values.update(
        experiment_id=f"{record.study}/{record.trial_id}", study=record.study, trial_id=record.trial_id,
        outcome=record.outcome, levels=f"{_LEVEL_HEADER}\n{levels}" if levels else "No load level was measured.",
    )  # fmt: skip
    return Template(template).substitute(values)


FALLBACK_TEMPLATE = (
    "# Experiment record ${experiment_id}\n\n| Field (字段) | This trial |\n|---|---|\n"
    + "".join(f"| {name} ({zh}) | ${{{key}}} |\n" for key, name, zh in FIELDS)
    + "\n## Outcome\n\n${outcome}\n\n## Load levels\n\n${levels}\n"
)
