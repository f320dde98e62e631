"""Alerts and a dashboard for a chosen operating point, from the SLO and what the study measured.

:func:`alert_rules` returns plain data (one :class:`AlertRule` per signal, with where its threshold
came from); :func:`prometheus_rules_yaml` writes it as a Prometheus rule file (``groups:``, also the
``spec`` of a Prometheus Operator ``PrometheusRule``) and :func:`grafana_dashboard` as a dashboard
with one panel per signal, the threshold drawn on it. The rules, each over vLLM's own metrics
(``vllm/v1/metrics/loggers.py``) of the served model (label ``model_name``):

- **latency**: every SLO bound on TTFT, TPOT, ITL or E2E latency (a percentile through
  ``histogram_quantile`` over the histogram's buckets, a mean as ``rate(_sum) / rate(_count)``)
  above the bound, for 5 minutes.
- **queue growing**: requests waiting, and their number rising over 10 minutes (section 11: a
  queue that grows is load beyond what the replicas serve).
- **KV-cache usage** above the lowest usage at which the trial saw preemptions, else 0.9.
- **preemptions**: any, for 5 minutes, when the trial's knee had none (its capacity was measured
  without them); else above the knee's count spread over the level.
- **request rate** per engine above 80% of the capacity measured per replica at the trial's knee
  (the highest load meeting the SLO), the engines counted by their ``num_requests_running`` series.
- **error-budget burn** of every latency percentile bound whose budget is 10% or less (P90 and up): the share of
  requests slower than the bound, read from the histogram's buckets (linear between the two edges around the
  bound, as ``histogram_quantile`` reads them), over the budget (1% for a P99), on two windows at once (the
  SRE workbook's multiwindow rule): 14.4 over 1 hour and 5 minutes pages, 6 over 6 hours and 30 minutes is a
  ticket. A burn the budget cannot reach (14.4 on a P90's 10%) is left out.
- **queue wait**: the mean time requests waited in vLLM's queue above half the SLO's tightest TTFT bound (a
  request that waited that long has spent half its TTFT before its prefill began).
- **GPU health** where DCGM is present (GPU points only): an XID error or a failed row remap on any GPU
  dcgm-exporter reports (no series, no alert, where it is not scraped).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml
from prometheus_client.utils import floatToGoString

from servetune.engine.metrics import COUNTERS, GAUGES, HISTOGRAMS
from servetune.metrics import PERCENTILES, REQUEST_THROUGHPUT
from servetune.report.autoscale import Autoscaling
from servetune.report.deploy import app_name, served_model_name
from servetune.report.points import KV_CACHE_USAGE_MAX, PREEMPTIONS, ReportPoint, SloLine, level_label

#: The SLO's latency metrics as vLLM's histograms (seconds).
LATENCY_HISTOGRAMS = {
    "ttft_ms": HISTOGRAMS["server_ttft"][0],
    "itl_ms": HISTOGRAMS["server_itl"][0],
    "tpot_ms": "vllm:request_time_per_output_token_seconds",  # per request, as the SLO's TPOT is
    "e2el_ms": HISTOGRAMS["server_e2el"][0],
}
#: vLLM 0.32's default bucket edges of those histograms, in seconds (vllm/v1/metrics/buckets.py; TPOT per request
#: takes the inter-token family's). A server started with ``custom_histogram_buckets`` has others.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
LATENCY_BUCKETS = {"ttft_ms": TTFT_BUCKETS, "itl_ms": ITL_BUCKETS, "tpot_ms": ITL_BUCKETS,
                   "e2el_ms": REQUEST_LATENCY_BUCKETS}  # fmt: skip
#: (burn rate, long window, short window, for, severity): the SRE workbook's multiwindow, multi-burn-rate alerts
#: (2% of a 30-day budget in an hour pages; 5% in six hours is a ticket).
BURNS = ((14.4, "1h", "5m", "2m", "critical"), (6.0, "6h", "30m", "15m", "warning"))
#: Burn alerts only for bounds whose error budget is at most this share (P90 and tighter).
BURN_BUDGET_MAX = 0.1
#: Alert when requests wait in vLLM's queue, on average, for this share of the SLO's tightest TTFT bound.
QUEUE_SHARE_OF_TTFT = 0.5
#: Without preemptions seen in the study: alert above this KV-cache usage.
KV_USAGE_DEFAULT = 0.9
#: Alert when the request rate passes this share of the measured capacity.
CAPACITY_SHARE = 0.8
#: The window rates and quantiles are taken over.
WINDOW = "5m"


@dataclass(frozen=True)
class AlertRule:
    """One alert: ``signal > threshold`` for ``for_``; ``source`` says where the threshold came from."""

    name: str
    signal: str  # PromQL, the value drawn on the dashboard
    threshold: float
    for_: str
    severity: str
    summary: str
    source: str
    unit: str  # Grafana's unit of the signal
    also: str = ""  # PromQL that must hold too (``and``)

    @property
    def expr(self) -> str:
        own = f"{self.signal} > {self.threshold:g}"
        return f"({own}) and ({self.also})" if self.also else own


def _selector(point: ReportPoint) -> str:
    return f'{{model_name="{served_model_name(point)}"}}'


def latency_signal(metric: str, stat: str, selector: str) -> str:
    """PromQL of an SLO latency statistic in seconds, from vLLM's histogram."""
    family = LATENCY_HISTOGRAMS[metric]
    if stat == "mean":
        return f"sum(rate({family}_sum{selector}[{WINDOW}])) / sum(rate({family}_count{selector}[{WINDOW}]))"
    quantile = PERCENTILES[stat] / 100.0
    return f"histogram_quantile({quantile:g}, sum by (le) (rate({family}_bucket{selector}[{WINDOW}])))"


def _latency_rules(slo: Sequence[SloLine], selector: str) -> list[AlertRule]:
    rules = []
    for line in slo:
        metric, _, stat = line.metric.rpartition("_")
        if metric not in LATENCY_HISTOGRAMS or (stat != "mean" and stat not in PERCENTILES):
            continue  # error_rate: vLLM counts no failed requests per model
        word = metric.removesuffix("_ms").upper()
        rules.append(AlertRule(
            name=f"VllmSlo{word.title()}{stat.title()}", signal=latency_signal(metric, stat, selector),
            threshold=line.max / 1000.0, for_="5m", severity="critical",
            summary=f"{word} {stat.upper()} above the SLO's {line.max:g} ms",
            source=f"SLO {line.metric} <= {line.max:g} (study.json)", unit="s",
        ))  # fmt: skip
    return rules


def slow_share(metric: str, bound_s: float, selector: str, window: str) -> tuple[str, str]:
    """PromQL of the share of requests slower than ``bound_s`` over ``window``, and how it was read: the bucket at
    the bound, or linear between the two edges around it."""
    family, edges = LATENCY_HISTOGRAMS[metric], LATENCY_BUCKETS[metric]

    def at(edge: float | None) -> str:
        if edge is None:  # below the first edge: nothing counted under it
            return "0"
        le = selector[:-1] + f',le="{floatToGoString(edge)}"}}'
        return f"sum(rate({family}_bucket{le}[{window}]))"

    total = f"sum(rate({family}_count{selector}[{window}]))"
    lo = max((e for e in edges if e <= bound_s), default=None)
    hi = min((e for e in edges if e >= bound_s), default=None)
    if hi is None:  # past the last edge: counted as slow from the last
        return f"(1 - {at(lo)} / {total})", f"past vLLM's last bucket edge ({lo:g} s): slower than {lo:g} s"
    if lo == hi:
        return f"(1 - {at(lo)} / {total})", f"vLLM's bucket edge at {hi:g} s"
    weight = (bound_s - (lo or 0.0)) / (hi - (lo or 0.0))
    faster = f"({at(lo)} * {1 - weight:.6g} + {at(hi)} * {weight:.6g})"
    edge = f"{lo:g} s and " if lo is not None else ""
    return f"(1 - {faster} / {total})", f"linear between vLLM's bucket edges {edge}{hi:g} s"


def _burn_rules(slo: Sequence[SloLine], selector: str) -> list[AlertRule]:
    rules = []
    for line in slo:
        metric, _, stat = line.metric.rpartition("_")
        if metric not in LATENCY_HISTOGRAMS or stat not in PERCENTILES:
            continue
        budget = 1.0 - PERCENTILES[stat] / 100.0
        if not 0 < budget <= BURN_BUDGET_MAX:
            continue
        word = metric.removesuffix("_ms").upper()
        for burn, long, short, for_, severity in BURNS:
            if burn * budget >= 1.0:
                continue  # a burn this fast would need more than every request slow
            share, read = slow_share(metric, line.max / 1000.0, selector, long)
            short_share, _ = slow_share(metric, line.max / 1000.0, selector, short)
            rules.append(AlertRule(
                name=f"VllmSlo{word.title()}{stat.title()}Burn{long}", signal=f"{share} / {budget:g}",
                also=f"{short_share} / {budget:g} > {burn:g}", threshold=burn, for_=for_, severity=severity,
                summary=f"{word} {stat.upper()}'s error budget burning {burn:g}x over {long} and {short}",
                source=(f"SLO {line.metric} <= {line.max:g} (study.json): {budget:.0%} of requests may be slower; "
                        f"slower than {line.max:g} ms read {read}"),
                unit="short",
            ))  # fmt: skip
    return rules


def _queue_rule(slo: Sequence[SloLine], selector: str, knee: ReportPoint) -> AlertRule | None:
    ttft = [line for line in slo if line.metric.startswith("ttft_ms_") and not line.lower]
    if not ttft:
        return None
    tightest = min(ttft, key=lambda line: line.max)
    family = HISTOGRAMS["server_queue"][0]
    measured = knee.server_metrics.get("server_queue_ms_mean")
    seen = f"; at the knee ({level_label(knee.level)}) requests waited {measured:.0f} ms on average" if (
        measured is not None) else ""  # fmt: skip
    return AlertRule(
        name="VllmQueueWaitHigh",
        signal=f"sum(rate({family}_sum{selector}[{WINDOW}])) / sum(rate({family}_count{selector}[{WINDOW}]))",
        threshold=round(QUEUE_SHARE_OF_TTFT * tightest.max / 1000.0, 6),
        for_="5m",
        severity="warning",
        summary=f"requests wait in the queue for {QUEUE_SHARE_OF_TTFT:.0%} of the TTFT bound on average",
        source=f"{QUEUE_SHARE_OF_TTFT:.0%} of the SLO's {tightest.metric} <= {tightest.max:g} ms (study.json){seen}",
        unit="s",
    )


#: DCGM exporter's fields (its default counters): any non-zero value is a GPU fault.
DCGM_HEALTH = (
    ("VllmGpuXidError", "DCGM_FI_DEV_XID_ERRORS", "a GPU reported an XID error (driver or hardware fault)"),
    ("VllmGpuRowRemapFailure", "DCGM_FI_DEV_ROW_REMAP_FAILURE", "a GPU failed to remap a faulty memory row"),
)


def _gpu_health_rules() -> list[AlertRule]:
    return [AlertRule(name=name, signal=f"max by (Hostname, gpu) ({field})", threshold=0, for_="1m",
                      severity="critical", summary=summary,
                      source=f"dcgm-exporter's {field}, where DCGM is scraped: not measured by the study",
                      unit="short") for name, field, summary in DCGM_HEALTH]  # fmt: skip


def kv_usage_threshold(trial_points: Sequence[ReportPoint]) -> tuple[float, str]:
    """The lowest peak KV usage at a level where the trial saw preemptions, else :data:`KV_USAGE_DEFAULT`."""
    seen = [
        (float(p.server_metrics[KV_CACHE_USAGE_MAX]), p)
        for p in trial_points
        if p.server_metrics.get(PREEMPTIONS) and p.server_metrics.get(KV_CACHE_USAGE_MAX) is not None
    ]
    if not seen:
        return KV_USAGE_DEFAULT, f"no preemptions seen by the trial at any level: the default {KV_USAGE_DEFAULT:g}"
    usage, at = min(seen, key=lambda s: s[0])
    return usage, (f"trial {at.trial_id} saw {at.server_metrics[PREEMPTIONS]:g} preemptions at "
                   f"{level_label(at.level)} with KV-cache usage peaking at {usage:.1%}")  # fmt: skip


def alert_rules(
    point: ReportPoint, trial_points: Sequence[ReportPoint], slo: Sequence[SloLine], autoscaling: Autoscaling | str,
) -> list[AlertRule]:  # fmt: skip
    """The alerts for ``point`` (see the module's rules); ``trial_points`` are its trial's levels."""
    sel = _selector(point)
    # each family's newest name (engine/metrics.py lists them newest first)
    running, waiting, kv = GAUGES["requests_running"][0], GAUGES["requests_waiting"][0], GAUGES["kv_cache_usage"][0]
    preempted, finished = COUNTERS["preemptions"][0], COUNTERS["requests_finished"][0]
    rules = _latency_rules(slo, sel) + _burn_rules(slo, sel)
    rules.append(AlertRule(
        name="VllmQueueGrowing",
        signal=f"deriv(sum({waiting}{sel})[10m:1m])", also=f"sum({waiting}{sel}) > 0",
        threshold=0, for_="10m", severity="warning", summary="requests are waiting and their number keeps rising",
        source="section 11: a queue that grows for 10 minutes is load beyond what the replicas serve", unit="short",
    ))  # fmt: skip
    kv_limit, kv_why = kv_usage_threshold(trial_points or [point])
    rules.append(AlertRule(
        name="VllmKvCacheHigh", signal=f"max({kv}{sel})", threshold=round(kv_limit, 4), for_="5m", severity="warning",
        summary=f"KV-cache usage above {kv_limit:.0%}, where preemptions begin", source=kv_why, unit="percentunit",
    ))  # fmt: skip
    knee = point if isinstance(autoscaling, str) else _knee(trial_points, autoscaling) or point
    if (queue := _queue_rule(slo, sel, knee)) is not None:
        rules.append(queue)
    knee_preempted = knee.server_metrics.get(PREEMPTIONS)
    at_knee = f"the knee ({level_label(knee.level)}, trial {knee.trial_id})"
    if knee_preempted is None:
        preempt_why = f"{at_knee} recorded no preemption count: any is a warning"
    elif not knee_preempted:
        preempt_why = f"{at_knee} had no preemptions"
    else:
        preempt_why = f"{at_knee} had {knee_preempted:g}: any is a warning"
    rules.append(AlertRule(
        name="VllmPreempting", signal=f"sum(rate({preempted}_total{sel}[{WINDOW}]))", threshold=0, for_="5m",
        severity="warning", summary="vLLM is preempting requests (KV cache exhausted): latency suffers",
        source=preempt_why,
        unit="ops",
    ))  # fmt: skip
    if isinstance(autoscaling, Autoscaling):
        capacity = autoscaling.throughput_per_replica
        where = f"at the knee, the highest load meeting the SLO ({level_label(knee.level)})"
    else:
        capacity = float(point.metrics.get(REQUEST_THROUGHPUT) or 0.0)
        where = f"at the exported point ({level_label(point.level)}), which had no load meeting the SLO"
    if capacity > 0:
        rules.append(AlertRule(
            name="VllmNearCapacity",
            signal=f"sum(rate({finished}_total{sel}[{WINDOW}])) / count({running}{sel})",
            threshold=round(CAPACITY_SHARE * capacity, 3), for_="10m", severity="warning",
            summary=f"request rate per replica above {CAPACITY_SHARE:.0%} of the measured capacity",
            source=f"capacity {capacity:.2f} req/s per replica measured by trial {knee.trial_id} {where}",
            unit="reqps",
        ))  # fmt: skip
    if point.device == "gpu":
        rules += _gpu_health_rules()
    return rules


def _knee(trial_points: Sequence[ReportPoint], autoscaling: Autoscaling) -> ReportPoint | None:
    return next((p for p in trial_points if dict(p.level) == dict(autoscaling.knee)), None)


def prometheus_rules(point: ReportPoint, rules: Sequence[AlertRule]) -> dict[str, Any]:
    """A Prometheus rule file (also a ``PrometheusRule``'s ``spec``)."""
    return {
        "groups": [{
            "name": f"servetune-{app_name(point)}",
            "rules": [{
                "alert": r.name, "expr": r.expr, "for": r.for_,
                "labels": {"severity": r.severity, "model_name": served_model_name(point)},
                "annotations": {"summary": r.summary, "threshold": f"{r.threshold:g}: {r.source}",
                                "servetune_trial": point.trial_id},
            } for r in rules],
        }],
    }  # fmt: skip


def prometheus_rules_yaml(point: ReportPoint, rules: Sequence[AlertRule]) -> str:
    header = (
        f"# Prometheus alerting rules (servetune trial {point.trial_id}, measured at {level_label(point.level)}).\n"
        "# Load: rule_files in prometheus.yml, or as the spec of a PrometheusRule (Prometheus Operator).\n"
    )
    return header + yaml.safe_dump(prometheus_rules(point, rules), sort_keys=False, width=1000)


def grafana_dashboard(point: ReportPoint, rules: Sequence[AlertRule]) -> dict[str, Any]:
    """A Grafana dashboard: one time-series panel per alert's signal, its threshold drawn in red."""
    panels = []
    for i, r in enumerate(rules):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": r.summary,
            "description": f"threshold {r.threshold:g}: {r.source}",
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "targets": [{"refId": "A", "expr": r.signal, "legendFormat": r.name}],
            "fieldConfig": {"defaults": {
                "unit": r.unit, "custom": {"thresholdsStyle": {"mode": "line"}},
                "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None},
                                                             {"color": "red", "value": r.threshold}]},
            }, "overrides": []},
        })  # fmt: skip
    return {
        "title": f"vLLM {served_model_name(point)} (servetune trial {point.trial_id})",
        "uid": app_name(point)[:40],
        "tags": ["vllm", "servetune"],
        "timezone": "browser",
        "schemaVersion": 39,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {
            "list": [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}]
        },
        "panels": panels,
    }


def grafana_json(point: ReportPoint, rules: Sequence[AlertRule]) -> str:
    return json.dumps(grafana_dashboard(point, rules), indent=2) + "\n"
