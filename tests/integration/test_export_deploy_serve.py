"""``export --format ray-serve --keep-ingress`` applied with Serve's own config deploy (the controller's
``deploy_apps``, what ``serve deploy`` and the REST API call) on a real local Ray, its replicas running the fake Serve
engine (testing/serve_engine.py) in place of vLLM: the pick's exported config, then the runner-up's over it (other
engine arguments and environment). With the ingress and the engines as two applications, Serve keeps the ingress
replica and replaces the engines'; the same two points exported as one application (as without the flag) replace the
ingress too (Serve versions a config-deployed application as a whole: report/export.py ``KEEP_INGRESS_WHY``). Each
deployment answers a completion through the ingress.

It runs in a process of its own, which starts a Ray and stops it; it writes what the test checks to a JSON file."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from servetune.report import ReportPoint
from servetune.report.export import ray_serve_yaml
from servetune.testing.serve_engine import ENGINE_ENV, START_S_ENV

pytest.importorskip("ray.serve.llm")

ROOT = Path(__file__).parents[2]


def point(model: str, trial_id: str, max_num_seqs: int, ttft_ms: int) -> ReportPoint:
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
    deadline = time.monotonic() + timeout_s
    while set(cluster.engine_replicas(app, "")) & set(old) and time.monotonic() < deadline:
        time.sleep(0.5)


def completion(url: str, model: str) -> str:
    body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 4, "stream": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read().decode()


def roll(work: str, model: str) -> None:
    """Deploy the pick's export then the runner-up's, split and then as one application; ``work/deployed.json``."""
    from servetune.serve.cluster import ServeCluster

    pick, runner_up = point(model, "pick", 4, 20), point(model, "runner-up", 8, 60)
    out: dict = {}
    with ServeCluster(None, {"CPU": 6}) as cluster:
        for keep in (True, False):
            configs = [yaml.safe_load(ray_serve_yaml(p, autoscaling="fixed", keep_ingress=keep)) for p in (pick, runner_up)]  # fmt: skip
            engines = configs[0]["applications"][-1]["name"]  # the engines' application (the only one unsplit)
            seen: dict = {"apps": [[app["name"] for app in c["applications"]] for c in configs]}
            for step, config in enumerate(configs):
                old = cluster.engine_replicas(engines) if step else []
                deploy_config(cluster, config)
                wait_replaced(cluster, engines, old)
                seen[f"ingress{step}"] = sorted(
                    set(cluster.engine_replicas("llm", "")) - set(cluster.engine_replicas("llm"))
                )
                seen[f"engines{step}"] = cluster.engine_replicas(engines)
                seen[f"configs{step}"] = cluster.replica_llm_configs(engines)
                seen[f"answer{step}"] = completion(cluster.url, model)
            out["split" if keep else "one"] = seen
            for app in reversed(configs[-1]["applications"]):
                cluster.delete(app["name"])
    (Path(work) / "deployed.json").write_text(json.dumps(out, default=str))


def test_serve_deploy_of_the_runner_ups_export_keeps_the_ingress_replica_and_replaces_the_engines(tiny_model, tmp_path):
    code = "import sys\nfrom tests.integration.test_export_deploy_serve import roll\nroll(sys.argv[1], sys.argv[2])"
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path), str(tiny_model)], cwd=ROOT, capture_output=True,
                          text=True, timeout=540)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads((tmp_path / "deployed.json").read_text())
    split, one = out["split"], out["one"]
    assert split["apps"] == [["llm", "llm-engines"]] * 2 and one["apps"] == [["llm"]] * 2

    # Split: the one ingress replica is the same before and after; the engine replica is a new one, running the
    # runner-up's engine arguments and environment.
    assert len(split["ingress0"]) == 1 and split["ingress1"] == split["ingress0"]
    assert len(split["engines0"]) == 1 and len(split["engines1"]) == 1
    assert split["engines1"] != split["engines0"]
    assert [c["engine_kwargs"]["max_num_seqs"] for c in split["configs0"]] == [4]
    assert [c["engine_kwargs"]["max_num_seqs"] for c in split["configs1"]] == [8]
    assert [c["env_vars"]["SERVETUNE_FAKE_TTFT_MS"] for c in split["configs1"]] == ["60"]

    # One application: Serve replaced the ingress replica with the engines' (the gap the split closes).
    assert len(one["ingress0"]) == 1 and len(one["ingress1"]) == 1 and one["ingress1"] != one["ingress0"]
    assert one["engines1"] != one["engines0"]
    assert [c["engine_kwargs"]["max_num_seqs"] for c in one["configs1"]] == [8]

    # Every deployment answered a completion through its ingress (the split one by a handle to the other application).
    for seen in (split, one):
        for step in (0, 1):
            assert '"text"' in seen[f"answer{step}"] and "[DONE]" in seen[f"answer{step}"]
