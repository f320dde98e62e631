"""``export --format prometheus-rules|grafana``: alerts from the SLO and the measured capacity.

promtool is a Go binary, not installable here: every expression is parsed by ``promql-parser``
(the Rust PromQL parser of GreptimeDB, Python bindings), and every vLLM metric it names is one
vLLM's own ``vllm/v1/metrics/loggers.py`` defines.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from pathlib import Path

import promql_parser
import pytest
import yaml

from servetune.cli import main
from servetune.report import ReportPoint, alerts, build_report, load_study
from servetune.report.export import autoscaling_for, pick_point
from servetune.report.points import KV_CACHE_USAGE_MAX, PREEMPTIONS

STUDY = Path(__file__).parents[1] / "data" / "cpu-tiny-study"
BASELINE = "e57a166985b8"  # met the SLO at concurrency 2 and 8, broke it at 32
DURATION = re.compile(r"^((\d+)y)?((\d+)w)?((\d+)d)?((\d+)h)?((\d+)m)?((\d+)s)?((\d+)ms)?$")  # Prometheus' durations


@pytest.fixture(scope="module")
def report():
    return build_report(load_study(STUDY))


@pytest.fixture(scope="module")
def point(report):
    return pick_point(report, BASELINE)


@pytest.fixture(scope="module")
def trial_points(report):
    return [p for p in report.points if p.trial_id == BASELINE]


@pytest.fixture(scope="module")
def rules(report, point, trial_points):
    return alerts.alert_rules(point, trial_points, report.slo, autoscaling_for(report, point))


def vllm_families() -> set[str]:
    """The metric families vLLM's loggers.py defines, read from its source (importing vLLM takes seconds)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    loggers = Path(spec.origin).parent / "v1" / "metrics" / "loggers.py"
    return set(re.findall(r'name="(vllm:[a-z_]+)"', loggers.read_text()))


def test_every_expression_parses_and_names_only_metrics_vllm_exports(rules):
    families = vllm_families()
    assert "vllm:num_requests_waiting" in families  # the reading of loggers.py finds them
    for rule in rules:
        promql_parser.parse(rule.expr)
        promql_parser.parse(rule.signal)
        for name in re.findall(r"vllm:[a-z_]+", rule.expr):
            family = re.sub(r"_(bucket|sum|count|total)$", "", name)
            assert family in families, f"{rule.name}: {name} is not a metric vLLM exports"


def test_a_broken_expression_is_caught_by_the_parser(rules):
    with pytest.raises(ValueError):
        promql_parser.parse(rules[0].expr[:-5] + ")))")


def test_each_latency_bound_of_the_slo_becomes_a_percentile_alert_at_that_bound(report, rules):
    latency = [line for line in report.slo if line.metric.rpartition("_")[0] in alerts.LATENCY_HISTOGRAMS]
    assert latency and any(line.metric == "error_rate" for line in report.slo)  # the study's error_rate is skipped
    by_source = {r.source: r for r in rules}
    for line in latency:
        rule = by_source[f"SLO {line.metric} <= {line.max:g} (study.json)"]
        metric, _, stat = line.metric.rpartition("_")
        assert rule.threshold == pytest.approx(line.max / 1000.0)
        assert rule.signal.startswith(f"histogram_quantile({int(stat[1:]) / 100:g}, ")
        assert f"{alerts.LATENCY_HISTOGRAMS[metric]}_bucket" in rule.signal


def test_a_mean_bound_is_a_ratio_of_the_histograms_sum_and_count():
    signal = alerts.latency_signal("tpot_ms", "mean", '{model_name="m"}')
    assert "vllm:request_time_per_output_token_seconds_sum" in signal and "_count" in signal
    promql_parser.parse(signal)


def test_capacity_alert_is_80_percent_of_the_knees_throughput_per_replica(report, point, rules):
    autoscaling = autoscaling_for(report, point)
    (rule,) = [r for r in rules if r.name == "VllmNearCapacity"]
    assert rule.threshold == pytest.approx(alerts.CAPACITY_SHARE * autoscaling.throughput_per_replica, abs=1e-3)
    assert (
        f"capacity {autoscaling.throughput_per_replica:.2f} req/s per replica measured by trial {BASELINE}"
        in rule.source
    )


def test_kv_threshold_is_the_lowest_usage_where_the_trial_was_preempted(trial_points):
    levels = [
        dataclasses.replace(trial_points[0], level={"concurrency": c}, server_metrics={KV_CACHE_USAGE_MAX: u, PREEMPTIONS: n})
        for c, u, n in ((8, 0.5, 0), (16, 0.83, 3), (32, 0.97, 40))
    ]  # fmt: skip
    usage, why = alerts.kv_usage_threshold(levels)
    assert usage == 0.83 and "3 preemptions at concurrency 16" in why
    assert alerts.kv_usage_threshold(levels[:1])[0] == alerts.KV_USAGE_DEFAULT  # usage without preemptions is no limit


def test_without_a_knee_the_capacity_is_the_points_own_throughput(report, point, trial_points):
    rules = alerts.alert_rules(point, trial_points, report.slo, "no knee")
    (rule,) = [r for r in rules if r.name == "VllmNearCapacity"]
    assert rule.threshold == pytest.approx(alerts.CAPACITY_SHARE * point.metrics["request_throughput"], abs=1e-3)
    assert "had no load meeting the SLO" in rule.source


def test_the_rule_file_is_prometheus_shaped_and_each_rule_says_where_its_threshold_came_from(point, rules):
    text = alerts.prometheus_rules_yaml(point, rules)
    (group,) = yaml.safe_load(text)["groups"]
    assert set(group) == {"name", "rules"}
    names = [r["alert"] for r in group["rules"]]
    assert len(names) == len(set(names)) == len(rules)
    assert {"VllmQueueGrowing", "VllmKvCacheHigh", "VllmPreempting", "VllmNearCapacity"} <= set(names)
    for written, rule in zip(group["rules"], rules, strict=True):
        assert set(written) == {"alert", "expr", "for", "labels", "annotations"}
        assert DURATION.match(written["for"]) and written["expr"] == rule.expr
        assert all(isinstance(v, str) for v in [*written["labels"].values(), *written["annotations"].values()])
        assert written["annotations"]["threshold"] == f"{rule.threshold:g}: {rule.source}"


def test_the_dashboard_draws_each_alerts_signal_with_its_threshold(point, rules):
    board = json.loads(alerts.grafana_json(point, rules))
    panels = board["panels"]
    assert [p["targets"][0]["expr"] for p in panels] == [r.signal for r in rules]
    assert [p["fieldConfig"]["defaults"]["thresholds"]["steps"][-1]["value"] for p in panels] == [
        r.threshold for r in rules
    ]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in panels]
    assert len(set(cells)) == len(cells)  # no two panels on one spot
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels)
    assert board["templating"]["list"][0]["name"] == "datasource"


def test_rules_name_the_served_model_as_vllm_labels_it(point, report, trial_points):
    served = dataclasses.replace(point, engine_args={**point.engine_args, "served_model_name": ["chat"]})
    rules = alerts.alert_rules(served, trial_points, report.slo, "no knee")
    assert all('{model_name="chat"}' in r.expr for r in rules)


@pytest.mark.parametrize("fmt", ["prometheus-rules", "grafana"])
def test_the_command_prints_them_for_the_stored_study(fmt, capsys):
    assert main(["export", str(STUDY), "--pick", BASELINE, "--format", fmt]) == 0
    out = capsys.readouterr().out
    data = yaml.safe_load(out)  # JSON is YAML too
    assert data["groups"][0]["rules"] if fmt == "prometheus-rules" else data["panels"]


def test_a_point_with_no_levels_of_its_trial_still_gets_rules(report):
    lone = ReportPoint(trial_id="t", model="m", level={"concurrency": 4}, metrics={"request_throughput": 2.0})
    rules = alerts.alert_rules(lone, [], report.slo, "no knee")
    assert {r.name for r in rules} >= {"VllmKvCacheHigh", "VllmNearCapacity"}
