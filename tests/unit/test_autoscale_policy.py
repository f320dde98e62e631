"""The predictive autoscaling policy: its thresholds from the study, its decision, Serve's acceptance of it."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from servetune.cli import main
from servetune.errors import UserError
from servetune.report import build_report, load_study
from servetune.report.autoscale import derive_autoscaling
from servetune.report.autoscale_policy import (
    POLICY_FUNCTION,
    PredictivePolicy,
    PredictiveThresholds,
    predictive_replicas,
    predictive_thresholds,
)

STUDY = Path(__file__).parents[1] / "data" / "cpu-tiny-study"
BASELINE = "e57a166985b8"  # met the SLO at concurrency 2 and 8, broke it at 32
LIMITS = PredictiveThresholds(target_ongoing_requests=8, waiting_per_replica=4, kv_usage_limit=0.85)


def test_each_signal_asks_for_its_own_replicas_and_the_most_wins():
    assert predictive_replicas(2, in_flight=16, waiting=0, kv_usage=0.3, thresholds=LIMITS) == (2, "in flight")
    # a queue building at the same in-flight count: 10 waiting / 4 per replica
    assert predictive_replicas(2, in_flight=16, waiting=10, kv_usage=0.3, thresholds=LIMITS) == (3, "queue wait")
    # KV usage 0.95 on 2 replicas: 2 x 0.95 / 0.85 = 2.24
    assert predictive_replicas(2, in_flight=16, waiting=0, kv_usage=0.95, thresholds=LIMITS) == (3, "KV usage")
    # low load scales down as the in-flight rule does; no KV recorded leaves that signal out
    assert predictive_replicas(3, in_flight=5, waiting=0, kv_usage=None, thresholds=LIMITS) == (1, "in flight")
    assert predictive_replicas(3, in_flight=0, waiting=0, kv_usage=None, thresholds=LIMITS)[0] == 0


def test_the_policy_reads_serves_queue_and_the_replicas_custom_metrics():
    policy = PredictivePolicy(**LIMITS.policy_kwargs())
    ctx = SimpleNamespace(
        current_num_replicas=2, total_num_requests=18.0, total_queued_requests=2.0,
        aggregated_metrics={"num_requests_waiting": {"r1": 5.0, "r2": 6.0}, "kv_cache_usage": {"r1": 0.4, "r2": 0.5}},
    )  # fmt: skip
    wanted, state = policy(ctx)
    assert wanted == math.ceil((2 + 5 + 6) / 4) and state["servetune_signal"] == "queue wait"
    plain = SimpleNamespace(current_num_replicas=1, total_num_requests=9.0, total_queued_requests=0.0,
                            aggregated_metrics=None)  # fmt: skip
    assert policy(plain)[0] == 2  # without custom metrics: in flight 9 / target 8


def test_waiting_per_replica_is_what_a_replica_drains_within_the_ttft_the_slo_leaves():
    t, why = predictive_thresholds(8, 30.0, 0.3, "the SLO's ttft_ms_p99 bound (300 ms)", 100.0, 0.85)
    assert t.waiting_per_replica == math.floor(30.0 * 0.2)
    assert "less the measured TTFT 100 ms = 200 ms" in why["waiting_per_replica"]
    spent, why = predictive_thresholds(8, 30.0, 0.3, "the bound", 400.0, 0.85)
    assert (
        spent.waiting_per_replica == max(1, math.floor(30.0 * 0.03)) and "leaves nothing" in why["waiting_per_replica"]
    )


def test_derived_autoscaling_carries_the_predictive_policy_only_when_chosen():
    report = build_report(load_study(STUDY))
    points = [p for p in report.points if p.trial_id == BASELINE]
    a = derive_autoscaling(points, [str(s) for s in report.slo])
    assert "policy" not in a.autoscaling_config() and "waiting_per_replica" not in a.reasons
    p = a.with_policy("predictive")
    policy = p.autoscaling_config()["policy"]
    assert policy["policy_function"] == POLICY_FUNCTION
    assert policy["policy_kwargs"]["target_ongoing_requests"] == a.target_ongoing_requests
    knee = next(pt for pt in points if pt.level == {"concurrency": 8.0})
    left_s = 0.3 - knee.metrics["ttft_ms_p99"] / 1000.0  # the study's ttft_ms.p99 <= 300
    assert policy["policy_kwargs"]["waiting_per_replica"] == max(
        1, math.floor(a.throughput_per_replica * left_s + 1e-9)
    )
    assert "waiting_per_replica" in p.reasons and p.with_policy("inflight").reasons == a.reasons
    with pytest.raises(UserError, match="autoscaling policy 'cpu'"):
        a.with_policy("cpu")


def test_export_writes_the_predictive_policy_serve_accepts(capsys):
    assert main(["export", str(STUDY), "--pick", BASELINE, "--format", "ray-serve",
                 "--autoscaling-policy", "predictive"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    deployment = yaml.safe_load(text)["applications"][0]["args"]["llm_configs"][0]["deployment_config"]
    assert deployment["autoscaling_config"]["policy"]["policy_function"] == POLICY_FUNCTION
    assert "#   waiting_per_replica: " in text
    serve_config = pytest.importorskip("ray.serve._private.config")
    checked = serve_config.DeploymentConfig(**deployment)  # the installed Ray imports and pickles the policy
    loaded = checked.autoscaling_config.policy
    assert loaded.policy_kwargs == deployment["autoscaling_config"]["policy"]["policy_kwargs"]
    assert loaded.get_serialized_policy_def()


def test_the_predictive_export_deploys_replicas_that_record_the_signals_the_policy_reads(capsys):
    """Ray Serve LLM loads the named class (its builders deploy ``LLMConfig.server_cls`` as
    ``<class name>:<model id>``, so it keeps the name serve-check and verify look for); the in-flight export keeps
    Ray's own LLMServer. (Building the app here would start a Ray: the by-hand check deploys it.)"""
    from ray.serve.llm import LLMConfig
    from ray.serve.llm.deployment import LLMServer as RayLLMServer

    from servetune.serve.replica import LLMServer

    configs = {}
    for policy in ("inflight", "predictive"):
        assert main(["export", str(STUDY), "--pick", BASELINE, "--format", "ray-serve",
                     "--autoscaling-policy", policy]) == 0  # fmt: skip
        text = capsys.readouterr().out
        configs[policy] = yaml.safe_load(text)["applications"][0]["args"]["llm_configs"][0]
    assert "server_cls" not in configs["inflight"]
    assert LLMConfig(**configs["predictive"]).server_cls is LLMServer
    assert f"# Replicas: {configs['predictive']['server_cls']}, " in text
    assert issubclass(LLMServer, RayLLMServer) and LLMServer.__name__ == RayLLMServer.__name__
    assert "record_autoscaling_stats" in vars(LLMServer) and not hasattr(RayLLMServer, "record_autoscaling_stats")


def test_serve_checks_predictive_ramp_deploys_the_same_replicas_and_health_check_as_export():
    from servetune.report.export import health_check_config, pick_point
    from servetune.serve.plan import autoscaled_llm_config

    report = build_report(load_study(STUDY))
    point = pick_point(report, "best")
    derived = derive_autoscaling([p for p in report.points if p.trial_id == point.trial_id],
                                 [str(s) for s in report.slo])  # fmt: skip
    predictive = autoscaled_llm_config(point, derived.with_policy("predictive").deployment_config())
    inflight = autoscaled_llm_config(point, derived.deployment_config())
    assert predictive["server_cls"] == "servetune.serve.replica:LLMServer" and "server_cls" not in inflight
    for config in (predictive, inflight):
        assert health_check_config().items() <= config["deployment_config"].items()
