"""The Kubernetes and KServe autoscalers scale on the signals and thresholds of Serve's autoscaling derivation
(issue #42 items 1 and 3): what predicts a breach (requests waiting, KV usage) beside requests in flight.

The ScaledObject is checked against KEDA's own CRD schema and the InferenceService's scaling fields against
KServe's (both vendored under tests/data, with their source commit), made strict as ``kubectl apply``'s field
validation is; every query is parsed by the PromQL parser the prometheus-rules export is checked with, and
evaluated on a small set of series to show that the autoscaler's rule (the most replicas any metric asks for)
is Serve's predictive policy's.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema
import promql_parser
import pytest
import yaml

from servetune.cli import main
from servetune.report import build_report, deploy, load_study
from servetune.report.autoscale_policy import predictive_replicas
from servetune.report.export import autoscaling_for, pick_point
from tests.unit.test_export_alerts import vllm_families
from tests.unit.test_export_deploy import validate_definition, validate_k8s

DATA = Path(__file__).parents[1] / "data"
STUDY = DATA / "cpu-tiny-study"
BASELINE = "e57a166985b8"  # met the SLO at concurrency 2 and 8, broke it at 32


def strict(schema: Any) -> Any:
    """A CRD's structural schema as ``kubectl apply --validate=strict`` applies it: unknown fields are errors."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        closed = "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields")
        if schema.get("type") == "object" and closed and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def keda_schema() -> dict[str, Any]:
    crd = yaml.safe_load((DATA / "keda" / "keda.sh_scaledobjects.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return strict(version["schema"]["openAPIV3Schema"])


@pytest.fixture(scope="module")
def kserve_scaling_schema() -> dict[str, Any]:
    return strict(json.loads((DATA / "kserve" / "predictor-scaling.schema.json").read_text()))


@pytest.fixture(scope="module")
def report():
    return build_report(load_study(STUDY))


@pytest.fixture(scope="module")
def point(report):
    return dataclasses.replace(pick_point(report, BASELINE), device="gpu")


@pytest.fixture(scope="module")
def predictive(report, point):
    return autoscaling_for(report, point, headroom=0.8).with_policy("predictive")  # as `export` derives it


def scaled_object(point, autoscaling) -> dict[str, Any]:
    *_, obj = deploy.kubernetes_documents(point, autoscaling, autoscaler="keda", prometheus="http://prom:9090")
    return obj


# A PromQL evaluator for the few forms the exports write: sum/max/count (by pod) of vector selectors, and + / *
# between single-element results. A series is its labels with "__name__" and a value.
Series = tuple[Mapping[str, str], float]


def _matches(labels: Mapping[str, str], selector: promql_parser.VectorSelector) -> bool:
    if labels["__name__"] != selector.name:
        return False
    for m in selector.matchers.matchers:
        value = labels.get(m.name, "")
        if m.op == promql_parser.MatchOp.Equal and value != m.value:
            return False
        if m.op == promql_parser.MatchOp.Re and not re.fullmatch(m.value, value):
            return False
        assert m.op in (promql_parser.MatchOp.Equal, promql_parser.MatchOp.Re), m.op
    return True


def evaluate(expr: Any, series: list[Series]) -> list[Series]:
    if isinstance(expr, promql_parser.ParenExpr):
        return evaluate(expr.expr, series)
    if isinstance(expr, promql_parser.VectorSelector):
        return [(labels, v) for labels, v in series if _matches(labels, expr)]
    if isinstance(expr, promql_parser.AggregateExpr):
        inner = evaluate(expr.expr, series)
        by = list(expr.modifier.labels) if expr.modifier is not None else []
        groups: dict[tuple[str, ...], list[float]] = {}
        for labels, v in inner:
            groups.setdefault(tuple(labels.get(k, "") for k in by), []).append(v)
        op = {"sum": sum, "max": max, "count": len}[str(expr.op)]
        return [(dict(zip(by, key, strict=True)), float(op(vs))) for key, vs in groups.items()]
    if isinstance(expr, promql_parser.BinaryExpr):
        (lhs,), (rhs,) = evaluate(expr.lhs, series), evaluate(expr.rhs, series)
        value = {"+": lhs[1] + rhs[1], "*": lhs[1] * rhs[1]}[str(expr.op)]
        return [({}, value)]
    raise AssertionError(f"unexpected PromQL node {type(expr).__name__}")


def query_value(query: str, series: list[Series]) -> float:
    (result,) = evaluate(promql_parser.parse(query), series)
    return result[1]


def engines(point, deployment: str, pods: Mapping[str, tuple[float, float, float]]) -> list[Series]:
    """vLLM's gauges of one engine per pod (running, waiting, KV usage), labelled as Prometheus scrapes them,
    plus the same gauges of another model and of a canary Deployment serving this one, which must not count."""
    model = deploy.served_model_name(point)
    series: list[Series] = []
    others = {f"{deployment}-canary-5d9f7-x2x2x": model, f"{deployment}-7f8c9-zz9zz": "another-model"}
    for pod, model_name in [*((p, model) for p in pods), *others.items()]:
        running, waiting, kv = pods.get(pod, (50.0, 50.0, 0.99))
        for name, value in (("vllm:num_requests_running", running), ("vllm:num_requests_waiting", waiting),
                            ("vllm:kv_cache_usage_perc", kv)):  # fmt: skip
            series.append(({"__name__": name, "model_name": model_name, "engine": "0", "pod": pod,
                            "namespace": "serving"}, value))  # fmt: skip
    return series


def keda_replicas(triggers: list[Mapping[str, Any]], series: list[Series], current: int) -> int:
    """The replicas KEDA's HPA asks for: per trigger, AverageValue ceil(value / threshold), Value
    ceil(current x value / threshold); the most of them."""
    asks = []
    for trigger in triggers:
        value = query_value(trigger["metadata"]["query"], series)
        threshold = float(trigger["metadata"]["threshold"])
        load = value if trigger.get("metricType", "AverageValue") == "AverageValue" else current * value
        asks.append(math.ceil(load / threshold - 1e-9))
    return max(asks)


def states(t: float, w: float) -> dict[str, dict[str, tuple[float, float, float]]]:
    """Two pods' running, waiting and KV usage where each signal in turn asks for the most replicas, given the
    in-flight target ``t`` and the waiting threshold ``w``."""
    return {
        "in flight": {"a-1": (1.4 * t, 0.0, 0.3), "a-2": (1.3 * t, 0.0, 0.4)},
        "queue wait": {"a-1": (0.0, 3 * w, 0.5), "a-2": (0.0, 3 * w, 0.5)},
        "KV usage": {"a-1": (0.1 * t, 0.0, 0.97), "a-2": (0.1 * t, 0.0, 0.2)},
    }


@pytest.mark.parametrize("state", ["in flight", "queue wait", "KV usage"])
def test_keda_asks_for_the_replicas_serves_predictive_policy_asks_for(point, predictive, state):
    name = deploy.app_name(point)
    limits = predictive.predictive
    assert limits.waiting_per_replica < limits.target_ongoing_requests  # else waiting never asks for the most
    chosen = states(limits.target_ongoing_requests, limits.waiting_per_replica)[state]
    pods = {f"{name}-6b7c8d9f5c-{p[-1]}abcd": v for p, v in chosen.items()}
    series = engines(point, name, pods)
    serve_wants, signal = predictive_replicas(
        len(pods),
        in_flight=sum(r + w for r, w, _ in pods.values()),
        waiting=sum(w for _, w, _ in pods.values()),
        kv_usage=max(kv for *_, kv in pods.values()),
        thresholds=limits,
    )
    assert signal == state  # each state is set by the signal it is named after
    assert keda_replicas(scaled_object(point, predictive)["spec"]["triggers"], series, len(pods)) == serve_wants
    # KServe hands KEDA its metrics with no metric type (AverageValue): the same replicas from its queries
    metrics = deploy.kserve_inference_service(point, predictive)["spec"]["predictor"]["autoScaling"]["metrics"]
    kserve_series = engines(
        point, name + "-predictor", {k.replace(name, name + "-predictor"): v for k, v in pods.items()}
    )
    triggers = [{"metadata": {"query": m["external"]["metric"]["query"], "threshold": m["external"]["target"]["value"]}}
                for m in metrics]  # fmt: skip
    assert keda_replicas(triggers, kserve_series, len(pods)) == serve_wants


def test_the_triggers_carry_serves_thresholds_and_query_vllms_own_gauges(point, predictive):
    kwargs = predictive.autoscaling_config()["policy"]["policy_kwargs"]  # what Serve's controller is given
    triggers = {t["name"]: t for t in scaled_object(point, predictive)["spec"]["triggers"]}
    assert {n: float(t["metadata"]["threshold"]) for n, t in triggers.items()} == {
        "in-flight": kwargs["target_ongoing_requests"],
        "queue-wait": kwargs["waiting_per_replica"],
        "kv-usage": kwargs["kv_usage_limit"],
    }
    assert (triggers["in-flight"]["metricType"], triggers["kv-usage"]["metricType"]) == ("AverageValue", "Value")
    families = vllm_families()
    for trigger in triggers.values():
        query = trigger["metadata"]["query"]
        promql_parser.parse(query)
        named = {m for m in families if m + "{" in query}
        assert named and all(f'{m}{{model_name="{deploy.served_model_name(point)}",pod=~' in query for m in named)
    assert "vllm:num_requests_waiting{" in triggers["queue-wait"]["metadata"]["query"]
    assert "vllm:kv_cache_usage_perc{" in triggers["kv-usage"]["metadata"]["query"]


def test_the_scaled_object_is_valid_against_kedas_crd(point, predictive, keda_schema):
    for autoscaling in (predictive, predictive.with_policy("inflight")):
        obj = scaled_object(point, autoscaling)
        jsonschema.Draft7Validator(keda_schema).validate(obj)
        validate_definition(obj["metadata"], "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta")
    assert len(scaled_object(point, predictive.with_policy("inflight"))["spec"]["triggers"]) == 1


def test_kedas_crd_check_catches_a_misspelt_field_and_a_number_for_a_string(point, predictive, keda_schema):
    obj = scaled_object(point, predictive)
    misspelt = copy.deepcopy(obj)
    misspelt["spec"]["triggers"][0]["metricTyp"] = misspelt["spec"]["triggers"][0].pop("metricType")
    number = copy.deepcopy(obj)
    number["spec"]["triggers"][0]["metadata"]["threshold"] = 6
    for broken in (misspelt, number):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.Draft7Validator(keda_schema).validate(broken)


def test_the_hpa_has_a_per_pod_metric_per_signal_at_its_threshold_and_adapter_rules_for_them(point, predictive):
    *_, hpa = deploy.kubernetes_documents(point, predictive)
    validate_k8s(dict(hpa))
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in hpa["spec"]["metrics"]}
    assert targets == {
        deploy.HPA_METRICS[s.name]: {"type": "AverageValue", "averageValue": f"{s.threshold:g}"}
        for s in predictive.scaling_signals()
    }
    assert len(targets) == 3
    text = deploy.kubernetes_yaml(point, predictive)
    for name in targets:  # every metric the HPA reads has an adapter rule, whose query parses once filled in
        (rule,) = [line for line in text.splitlines() if f"as: '{name}'" in line]
        after = text.splitlines()[text.splitlines().index(rule) + 1]
        query = after.split("metricsQuery: '", 1)[1].rstrip("'")
        promql_parser.parse(query.replace("<<.GroupBy>>", "pod").replace("<<.LabelMatchers>>", 'namespace="x"'))


def test_each_threshold_states_its_origin_on_the_object(report, point, predictive):
    for obj in (scaled_object(point, predictive), deploy.kubernetes_documents(point, predictive)[-1],
                deploy.kserve_inference_service(point, predictive)):  # fmt: skip
        notes = obj["metadata"]["annotations"]
        assert notes["servetune/study"] == report.info.name and notes["servetune/trial"] == BASELINE
        assert notes["servetune/operating-load"] == predictive.reasons["knee"]
        assert "0.8 x" in notes["servetune/operating-load"]  # the headroom, and what it multiplies
        for signal in predictive.scaling_signals():
            note = notes[f"servetune/threshold-{deploy.SIGNAL_ANNOTATIONS[signal.name]}"]
            assert note == predictive.signal_reason(signal)
        assert "TTFT" in notes["servetune/threshold-queue-wait"]
        validate_definition(obj["metadata"], "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta")


def test_kserve_scales_through_keda_with_fields_valid_against_kserves_crd(point, predictive, kserve_scaling_schema):
    isvc = deploy.kserve_inference_service(point, predictive, prometheus="http://prom:9090")
    notes = isvc["metadata"]["annotations"]
    assert notes["serving.kserve.io/autoscalerClass"] == "keda"
    assert notes["serving.kserve.io/deploymentMode"] == "RawDeployment"
    predictor = dict(isvc["spec"]["predictor"])
    own = {k: predictor.pop(k) for k in ("minReplicas", "maxReplicas", "autoScaling")}
    jsonschema.Draft7Validator(kserve_scaling_schema).validate(own)
    validate_definition(predictor, "io.k8s.api.core.v1.PodSpec")
    validate_definition(own["autoScaling"]["behavior"], "io.k8s.api.autoscaling.v2.HorizontalPodAutoscalerBehavior")
    servers = {m["external"]["metric"]["serverAddress"] for m in own["autoScaling"]["metrics"]}
    assert servers == {"http://prom:9090"}
    broken = copy.deepcopy(own)
    broken["autoScaling"]["metrics"][0]["external"]["metric"]["backend"] = "prometheus2"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(kserve_scaling_schema).validate(broken)


@pytest.mark.parametrize(("fmt", "policy", "signals"), [
    ("kubernetes", None, 3), ("kubernetes", "inflight", 1), ("kserve", None, 3), ("kserve", "inflight", 1),
])  # fmt: skip
def test_the_command_scales_kubernetes_on_the_predictive_signals_unless_told(fmt, policy, signals, capsys):
    argv = ["export", str(STUDY), "--pick", BASELINE, "--format", fmt, "--autoscaler", "keda"]
    assert main(argv + (["--autoscaling-policy", policy] if policy else [])) == 0
    (*_, obj) = deploy.documents(capsys.readouterr().out)
    if fmt == "kubernetes":
        assert len(obj["spec"]["triggers"]) == signals
    else:
        assert len(obj["spec"]["predictor"]["autoScaling"]["metrics"]) == signals
    assert obj["metadata"]["annotations"]["servetune/policy"] == (policy or "predictive")
