"""serve-check against a real local Ray with Serve, no vLLM: a Serve application of the same name
that is already running is refused (one line, exit 2) and left running; nothing else is deployed. A failed
deployment is one error with its log tail; the LLM deployment is pinned to a version for --routers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from servetune.cli import main

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

FIXTURE = Path(__file__).parents[1] / "data" / "cpu-tiny-study"
TRIAL = "e57a166985b8"


def one_trial_study(root: Path, model: Path) -> Path:
    (root / "trials" / TRIAL).mkdir(parents=True)
    shutil.copy(FIXTURE / "study.json", root / "study.json")
    shutil.copy(FIXTURE / "space.yaml", root / "space.yaml")
    result = json.loads((FIXTURE / "trials" / TRIAL / "result.json").read_text())
    result["model"] = str(model)
    (root / "trials" / TRIAL / "result.json").write_text(json.dumps(result))
    return root


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Someone:
    def __call__(self, request) -> str:
        return "theirs"


def test_an_application_of_the_same_name_is_refused_and_left_running(serve_apps, tiny_model, tmp_path, capsys):
    study = one_trial_study(tmp_path / "study", tiny_model)
    serve.run(Someone.bind(), name="taken", route_prefix="/theirs")
    code = main(["serve-check", str(study), "--pick", TRIAL, "--replicas", "1", "--app-name", "taken"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("servetune serve-check: error: a Serve application named taken is already running")
    assert "pass --replace" in err[-1]
    assert list(serve.status().applications) == ["taken"]  # theirs stays; nothing of serve-check's was deployed
    assert not (study / "serve-check.json").exists()


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Broken:
    def __init__(self) -> None:
        print("loading the weights: cannot find model.safetensors", flush=True)
        raise RuntimeError("cannot find model.safetensors")


def test_a_deployment_that_fails_is_one_error_with_its_log_tail_and_is_deleted(serve_apps):
    from servetune.errors import EngineStartError
    from servetune.serve.cluster import ServeCluster

    with ServeCluster(None, {"CPU": 2}) as cluster:
        assert not cluster.started_ray and not cluster.started_serve  # the module's: serve-check leaves them running
        with pytest.raises(EngineStartError) as failed:
            cluster.run_app("broken", Broken.bind(), timeout_s=120)
        message = str(failed.value)
        assert message.splitlines()[0].startswith("the Serve deployment of broken failed: ")
        assert "cannot find model.safetensors" in message.splitlines()[0]
        assert "cannot find model.safetensors" in failed.value.log_tail
        assert "broken" not in cluster.applications()


def test_the_llm_deployment_is_pinned_to_the_engine_version_and_the_ingress_is_not(module_ray):
    """What --routers rests on (a redeploy with only the router changed keeps the LLM replicas; the e2e run on
    vLLM shows it): Ray Serve LLM's application built, its LLMServer deployment given the version, its ingress none.
    (Building the application starts Ray when none runs: the module's is running.)"""
    pytest.importorskip("ray.serve.llm")
    from ray.serve.llm import build_openai_app

    from servetune.serve.versions import pin_llm_servers

    app = build_openai_app({"llm_configs": [{"model_loading_config": {"model_id": "m", "model_source": "/nowhere"},
                                             "deployment_config": {"num_replicas": 2}}]})  # fmt: skip
    pin_llm_servers(app, "v1")
    servers = app._bound_deployment.init_kwargs["llm_deployments"]
    assert [(s._bound_deployment.name, s._bound_deployment._version) for s in servers.values()] == [
        ("LLMServer:m", "v1")
    ]
    assert app._bound_deployment._version is None  # the ingress gets a new version, so a new router, each deploy


def test_the_ingress_is_pinned_to_its_model_and_router_on_ray_serve_llms_own_application(module_ray):
    """What serve-check's in-place steps rest on (the e2e times it): the ingress ``build_openai_app`` makes, pinned,
    has one version for one model and router however often it is built, and another for another router."""
    pytest.importorskip("ray.serve.llm")
    from ray.serve.llm import build_openai_app

    from servetune.serve.routing import routed_llm_config, router_config
    from servetune.serve.versions import pin_ingress

    def ingress(router: str, replicas: int = 2) -> str:
        config = routed_llm_config({"model_loading_config": {"model_id": "m", "model_source": "/nowhere"},
                                    "deployment_config": {"num_replicas": replicas}}, router)  # fmt: skip
        app = build_openai_app({"llm_configs": [config]})
        pin_ingress(app, router_config(config))
        return app._bound_deployment._version

    default = ingress("default")
    assert default == ingress("default", replicas=1)  # a new count: the same ingress
    assert ingress("prefix-aware") == ingress("prefix-aware") != default


def test_a_study_deletes_the_serve_applications_a_stopped_run_of_it_left_and_no_others(serve_apps):
    """What a trial through Serve leaves when its driver is killed on a cluster (Serve outlives it): the
    study's next run deletes its own, matched by study name and trial id, and leaves every other one."""
    from servetune.serve.trial import remove_study_apps

    names = ["servetune-s1-0123456789ab", "servetune-s1-extra-0123456789ab", "servetune-s1-notatrialid", "theirs"]
    for name in names:
        serve.run(Someone.bind(), name=name, route_prefix=f"/{name}")
    assert remove_study_apps("s1") == ["servetune-s1-0123456789ab"]
    assert sorted(serve.status().applications) == sorted(names[1:])
    assert remove_study_apps("s1") == []


@serve.deployment(ray_actor_options={"num_cpus": 0}, num_replicas=2)
class Replica:
    def __call__(self, request) -> str:
        return "ok"


def test_a_rollout_is_done_once_no_replica_from_before_the_update_is_alive(serve_apps):
    """What verify's rolling_update scenario follows (serve.cluster ``redeploy_app`` / ``rolled_out``): the same
    application deployed again under its name is a new version; Serve replaces both replicas, and the rollout is
    done only once neither of the ones read before the update is alive and the application is RUNNING again."""
    import time

    from servetune.serve.cluster import ServeCluster

    serve.run(Replica.options(name="LLMServer:m").bind(), name="roll", route_prefix="/roll")
    cluster = ServeCluster(None, {})
    old = cluster.engine_replicas("roll")
    assert len(old) == 2 and cluster.rolled_out("roll", [])  # up, and nothing to replace
    cluster.redeploy_app("roll", Replica.options(name="LLMServer:m").bind(), "/roll")
    assert not cluster.rolled_out("roll", old)  # the controller holds the new target: DEPLOYING
    deadline = time.monotonic() + 60
    while not cluster.rolled_out("roll", old) and time.monotonic() < deadline:
        time.sleep(0.5)
    now = cluster.engine_replicas("roll")
    assert cluster.rolled_out("roll", old) and len(now) == 2 and not set(now) & set(old)
    assert cluster.replica_states("roll") == {"RUNNING": 2}


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Recording:
    """A replica that records requests waiting at its engine, as servetune's LLMServer records vLLM's (serve/replica.py),
    and is sent no request: Serve's own in-flight count stays 0."""

    def __init__(self, waiting: float) -> None:
        self.waiting = waiting

    async def record_autoscaling_stats(self) -> dict[str, float]:
        from servetune.report.autoscale_policy import WAITING_METRIC

        return {WAITING_METRIC: self.waiting}

    def __call__(self, request) -> str:
        return "ok"


def test_serves_controller_runs_the_predictive_policy_on_the_waiting_requests_replicas_record(serve_apps):
    """What ``export --autoscaling-policy predictive`` ships (issue #42 item 3): Serve's controller imports servetune's
    PredictivePolicy and scales on what the replicas record, not only on requests in flight. With no request sent, a
    replica recording 5 requests waiting against 2 a replica may hold is scaled out to the 3 that drain them, and one
    recording none, deployed beside it with the same policy, is still at 1 once that has happened."""
    import time

    from servetune.report.autoscale_policy import POLICY_FUNCTION, PredictiveThresholds
    from servetune.serve.cluster import ServeCluster

    thresholds = PredictiveThresholds(target_ongoing_requests=8, waiting_per_replica=2, kv_usage_limit=0.85)
    config = {"min_replicas": 1, "initial_replicas": 1, "max_replicas": 3, "upscale_delay_s": 0.5,
              "downscale_delay_s": 600, "look_back_period_s": 2, "metrics_interval_s": 0.5,
              "policy": {"policy_function": POLICY_FUNCTION, "policy_kwargs": thresholds.policy_kwargs()}}  # fmt: skip
    for name, waiting in (("idle", 0.0), ("queued", 5.0)):
        serve.run(Recording.options(autoscaling_config=config).bind(waiting), name=name, route_prefix=f"/{name}")

    def running(app: str) -> int:
        return ServeCluster(None, {}).replica_states(app, deployment_prefix="Recording").get("RUNNING", 0)

    deadline = time.monotonic() + 120
    while running("queued") < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert running("queued") == 3, serve.status().applications["queued"]
    assert running("idle") == 1, serve.status().applications["idle"]


RESET_IN_THROUGHPUT_MODE = """
import sys

import ray
from ray import serve

from servetune.serve.cluster import ServeCluster

# The replicas in the driver's mode too, as on a Ray started from its environment.
THROUGHPUT = {"env_vars": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}}


@serve.deployment(ray_actor_options={"num_cpus": 0, "runtime_env": THROUGHPUT}, num_replicas=2)
class Engine:
    def reset_prefix_cache(self) -> bool:
        return True

    def __call__(self, request) -> str:
        return "ok"


ray.init(address=sys.argv[1], log_to_driver=False)  # the module's Ray and Serve, its token in the environment
try:
    serve.run(Engine.options(name="LLMServer:m").bind(), name="app", route_prefix="/app")
    cluster = ServeCluster(None, {})
    print("reset", cluster.reset_prefix_caches("app"), cluster.reset_prefix_caches("app"))  # twice, as serve-check does
finally:
    ray.shutdown()  # this driver's connection only; the test's serve_apps deletes the application
"""


def test_prefix_caches_are_reset_from_a_driver_in_serves_throughput_optimized_mode(serve_apps, tmp_path):
    """Ray's advice for LLM serving, RAY_SERVE_THROUGHPUT_OPTIMIZED=1 in the environment, makes a handle build
    its router on the caller's event loop; serve-check calls from none. Each replica is still reset. The driver is a
    process of its own (Serve reads the variable when it is imported), joined to the module's Ray and Serve: a Ray
    and a Serve of its own cost the module 13 core-seconds (of 86) more."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
    address = ray.get_runtime_context().gcs_address
    done = subprocess.run([sys.executable, "-c", RESET_IN_THROUGHPUT_MODE, address], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reset 2 2" in done.stdout.splitlines(), done.stdout
