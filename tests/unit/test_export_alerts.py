"""``export --format prometheus-rules|grafana``: alerts from the SLO and the measured capacity.

promtool is a Go binary, not installable here: every expression is parsed by ``promql-parser``
(the Rust PromQL parser of GreptimeDB, Python bindings), and every vLLM metric it names is one
vLLM's own ``vllm/v1/metrics/loggers.py`` defines.
"""

from __future__ import annotations

import ast
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
from servetune.report.deploy import served_model_name
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


def test_a_p99_bound_burns_its_1_percent_budget_on_two_windows_each_read_between_the_buckets_around_it(point, rules):
    burns = {r.name: r for r in rules if "Burn" in r.name}
    fast, slow = burns["VllmSloTtftP99Burn1h"], burns["VllmSloTtftP99Burn6h"]
    assert (fast.threshold, fast.severity, slow.threshold, slow.severity) == (14.4, "critical", 6.0, "warning")
    # 300 ms lies a fifth of the way from vLLM's TTFT edge 0.25 s to 0.5 s: 0.8 of the one, 0.2 of the other
    for rule, windows in ((fast, ("1h", "5m")), (slow, ("6h", "30m"))):
        for window in windows:
            assert f'_bucket{{model_name="{served_model_name(point)}",le="0.25"}}[{window}])) * 0.8' in rule.expr
            assert f'le="0.5"}}[{window}])) * 0.2' in rule.expr
        assert rule.signal.endswith("/ 0.01") and rule.also.endswith(f"/ 0.01 > {rule.threshold:g}")
        assert "1% of requests may be slower" in rule.source and "edges 0.25 s and 0.5 s" in rule.source
    # P95 bounds (a 5% budget) burn on both windows too; the study's error_rate has no histogram
    assert set(burns) == {f"VllmSlo{m}Burn{w}" for m in ("TtftP99", "TtftP95", "TpotP95") for w in ("1h", "6h")}


def test_which_bounds_burn_and_how_a_bound_on_or_beyond_the_edges_is_read():
    from servetune.report.points import SloLine

    sel = '{model_name="m"}'
    names = [r.name for r in alerts._burn_rules([SloLine("ttft_ms_p50", 300), SloLine("ttft_ms_p90", 300),
                                                  SloLine("ttft_ms_mean", 300)], sel)]  # fmt: skip
    assert names == ["VllmSloTtftP90Burn6h"]  # a P90's 10% budget cannot burn 14.4x; a median or a mean has none
    on_edge, read = alerts.slow_share("ttft_ms", 0.25, sel, "5m")
    assert read == "vLLM's bucket edge at 0.25 s" and on_edge.count("_bucket") == 1 and "*" not in on_edge
    below, read = alerts.slow_share("ttft_ms", 0.0005, sel, "5m")
    assert "(0 * 0.5 + " in below and "edges 0.001 s" in read
    beyond, read = alerts.slow_share("e2el_ms", 9000.0, sel, "5m")
    assert 'le="7680.0"' in beyond and read.startswith("past vLLM's last bucket edge (7680 s)")
    for expr in (on_edge, below, beyond):
        promql_parser.parse(expr)


def test_the_bucket_edges_are_vllms_own():
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    source = (Path(spec.origin).parent / "v1" / "metrics" / "buckets.py").read_text()
    tuples = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(node.value, ast.Tuple):
            tuples[node.target.id] = ast.literal_eval(node.value)
    assert tuple(map(float, tuples["TIME_TO_FIRST_TOKEN_BUCKETS"])) == alerts.TTFT_BUCKETS
    assert tuple(map(float, tuples["INTER_TOKEN_LATENCY_BUCKETS"])) == alerts.ITL_BUCKETS
    assert tuple(map(float, tuples["REQUEST_LATENCY_BUCKETS"])) == alerts.REQUEST_LATENCY_BUCKETS


def test_queue_wait_alerts_at_half_the_tightest_ttft_bound(report, point, trial_points, rules):
    (rule,) = [r for r in rules if r.name == "VllmQueueWaitHigh"]
    tightest = min(line.max for line in report.slo if line.metric.startswith("ttft_ms_"))
    assert rule.threshold == pytest.approx(alerts.QUEUE_SHARE_OF_TTFT * tightest / 1000.0)
    assert "vllm:request_queue_time_seconds_sum" in rule.signal and "at the knee (concurrency 8)" in rule.source
    no_ttft = [line for line in report.slo if not line.metric.startswith("ttft_ms_")]
    assert "VllmQueueWaitHigh" not in {r.name for r in alerts.alert_rules(point, trial_points, no_ttft, "no knee")}


def test_gpu_health_from_dcgm_only_for_gpu_points(report, point, trial_points, rules):
    assert not [r for r in rules if "DCGM" in r.expr]  # the stored study ran on CPUs
    gpu = dataclasses.replace(point, device="gpu")
    health = [r for r in alerts.alert_rules(gpu, trial_points, report.slo, "no knee") if "DCGM" in r.expr]
    assert [r.name for r in health] == ["VllmGpuXidError", "VllmGpuRowRemapFailure"]
    for rule in health:
        promql_parser.parse(rule.expr)
        assert rule.severity == "critical" and "where DCGM is scraped" in rule.source
