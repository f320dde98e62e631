"""``export --format ray-serve --keep-ingress`` applied with Serve's own config deploy (the controller's
``deploy_apps``, what ``serve deploy`` and the REST API call) on a real local Ray, its replicas running the fake Serve
engine (testing/serve_engine.py) in place of vLLM. First the pick exported as one application (as without the flag):
it deploys as written and answers with the pick's engine. Then the move to the split files docs/commands/export.md
describes: the pick's split config over it (one ingress replacement: the application ``llm`` changes its
``import_path``), then the runner-up's (other engine arguments and environment), over which Serve keeps the ingress
replica and replaces the engines'. Each deployment answers a completion through the ingress. Five replica starts in
all. (That Serve replaces the ingress of one application redeployed with other engines, the gap the flag closes, is
Serve's own behaviour, report/export.py ``KEEP_INGRESS_WHY``; it is not deployed here: two more replicas.)

It runs in a process of its own, which starts a Ray and stops it; it writes what the test checks to a JSON file."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from servetune.report import ReportPoint
from servetune.report.export import ray_serve_yaml
from tests.ray_heads import skip_without_ray_serve_llm

skip_without_ray_serve_llm()  # imported by the driver only (this process reads what it wrote)

ROOT = Path(__file__).parents[2]


def point(model: str, trial_id: str, max_num_seqs: int, ttft_ms: int) -> ReportPoint:
    from servetune.testing.serve_engine import ENGINE_ENV, START_S_ENV  # Ray Serve LLM's: in the driver

    env = {**ENGINE_ENV, "SERVETUNE_FAKE_TTFT_MS": str(ttft_ms), "SERVETUNE_FAKE_ITL_MS": "5", START_S_ENV: "1"}
    return ReportPoint(trial_id=trial_id, level={"concurrency": 2.0}, model=model, device="cpu", env=env,
                       engine_args={"max_model_len": 1024, "max_num_seqs": max_num_seqs}, metrics={})  # fmt: skip


def deploy_config(cluster, config: dict, timeout_s: float = 240.0) -> None:
    """Apply ``config`` as ``serve deploy`` does and wait until every application of it is RUNNING and healthy."""
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    cluster.open_serve()
    client = _get_global_client()
    client.deploy_apps(ServeDeploySchema.model_validate({"applications": config["applications"]}))
    names = [app["name"] for app in config["applications"]]
    time.sleep(1.0)  # the controller takes the new target
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        apps = serve.status().applications
        if all(name in apps and str(apps[name].status).endswith("RUNNING") for name in names) and all(
            str(d.status).endswith("HEALTHY") for name in names for d in apps[name].deployments.values()
        ):
            return
        time.sleep(0.5)
    raise AssertionError(f"not RUNNING after {timeout_s} s: {serve.status().applications}")


def wait_replaced(cluster, app: str, old: list[str], timeout_s: float = 240.0) -> None:
    """Until ``app`` runs engine replicas and none of ``old`` (replica ids of any deployment) is alive in it or in the
    ingress application ``llm``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (
        not cluster.engine_replicas(app)
        or set(cluster.engine_replicas(app, "") + cluster.engine_replicas("llm", "")) & set(old)
    ):
        time.sleep(0.5)


def completion(url: str, model: str) -> str:
    body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 4, "stream": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read().decode()


def roll(work: str, model: str) -> None:
    """Deploy the pick's export as one application, then split, then the runner-up's split; ``work/deployed.json``."""
    from servetune.serve.cluster import ServeCluster

    pick, runner_up = point(model, "pick", 4, 20), point(model, "runner-up", 8, 60)
    split = [yaml.safe_load(ray_serve_yaml(p, autoscaling="fixed", keep_ingress=True)) for p in (pick, runner_up)]
    one = [yaml.safe_load(ray_serve_yaml(p, autoscaling="fixed")) for p in (pick, runner_up)]
    engines = split[0]["applications"][-1]["name"]  # the engines' application
    out: dict = {"split": {"apps": [[app["name"] for app in c["applications"]] for c in split]},
                 "one": {"apps": [[app["name"] for app in c["applications"]] for c in one]}}  # fmt: skip
    with ServeCluster(None, {"CPU": 6}) as cluster:
        # the pick as one application, then the pick split over it, then the runner-up split
        for name, step, config, app in (("one", 0, one[0], "llm"), ("split", 0, split[0], engines),
                                        ("split", 1, split[1], engines)):  # fmt: skip
            seen = out[name]
            # what must go: onto the split files, the one application's ingress and engine; then the split engine
            old: list[str] = []  # the first deployment
            if step:
                old = cluster.engine_replicas(app)
            elif name == "split":
                old = cluster.engine_replicas("llm", "")
            deploy_config(cluster, config)
            wait_replaced(cluster, app, old)
            seen[f"ingress{step}"] = sorted(
                set(cluster.engine_replicas("llm", "")) - set(cluster.engine_replicas("llm"))
            )
            seen[f"engines{step}"] = cluster.engine_replicas(app)
            seen[f"configs{step}"] = cluster.replica_llm_configs(app)
            seen[f"answer{step}"] = completion(cluster.url, model)
        # leaving shuts Serve and its Ray down (ServeCluster.__exit__): no application to delete one by one first
    (Path(work) / "deployed.json").write_text(json.dumps(out, default=str))


def test_serve_deploy_of_the_runner_ups_export_keeps_the_ingress_replica_and_replaces_the_engines(tiny_model, tmp_path):
    code = "import sys\nfrom tests.integration.test_export_deploy_serve import roll\nroll(sys.argv[1], sys.argv[2])"
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path), str(tiny_model)], cwd=ROOT, capture_output=True,
                          text=True, timeout=540)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads((tmp_path / "deployed.json").read_text())
    split, one = out["split"], out["one"]
    assert split["apps"] == [["llm", "llm-engines"]] * 2 and one["apps"] == [["llm"]] * 2

    # One application (the pick's): Serve's config deploy takes it as written, its one ingress replica in front of one
    # engine of the pick's arguments and environment.
    assert len(one["ingress0"]) == 1 and len(one["engines0"]) == 1
    assert [c["engine_kwargs"]["max_num_seqs"] for c in one["configs0"]] == [4]
    assert [c["env_vars"]["SERVETUNE_FAKE_TTFT_MS"] for c in one["configs0"]] == ["20"]

    # Onto the split files: one ingress replacement (the application llm's import_path changed), a new engine replica.
    assert len(split["ingress0"]) == 1 and split["ingress0"] != one["ingress0"]
    assert len(split["engines0"]) == 1 and split["engines0"] != one["engines0"]

    # Split: the one ingress replica is the same before and after; the engine replica is a new one, running the
    # runner-up's engine arguments and environment.
    assert split["ingress1"] == split["ingress0"]
    assert len(split["engines1"]) == 1 and split["engines1"] != split["engines0"]
    assert [c["engine_kwargs"]["max_num_seqs"] for c in split["configs0"]] == [4]
    assert [c["engine_kwargs"]["max_num_seqs"] for c in split["configs1"]] == [8]
    assert [c["env_vars"]["SERVETUNE_FAKE_TTFT_MS"] for c in split["configs1"]] == ["60"]

    # Every deployment answered a completion through its ingress (the split one by a handle to the other application).
    for answer in (one["answer0"], split["answer0"], split["answer1"]):
        assert '"text"' in answer and "[DONE]" in answer
