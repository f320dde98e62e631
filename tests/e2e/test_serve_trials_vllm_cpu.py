"""A study whose trials run through Ray Serve LLM (``serve.num_replicas``) on a local Ray with the real
vLLM CPU build: one and two replicas of the tiny model, each deployed as its own Serve application
by ``servetune run``, measured through Serve's OpenAI ingress, recorded with what each replica served,
and torn down; the two-replica trial exports as a Ray Serve config at its replica count. Ray Serve LLM's stream
batching is a parameter (``serve.stream_batching_interval_ms``): the one-replica trial at 50 ms, the two-replica
trial with it off (0).

``max_concurrent: 2`` on the two cores the space declares: Tune starts both trials at once, and the one that asks the
study's ledger second waits there until the other gave its cores back (device_ledger.py): one replica's core and two
replicas' cores are three. Two Serve trials side by side, each replica on a core of its own, were a third trial's
engine start (67 s and 120 core-s of this module at a load of 10); bare trials side by side on cores of their own are
the e2e study's (test_study_vllm_cpu.py), replicas of one trial on cores of their own are this module's two-replica
trial, and both take the same core locks (engine/cores.py). The study ends by verifying its recommendation
(``search.verify``) as that Serve application, deployed on the study's own Serve."""

import json
import re
import subprocess
import sys

import pytest
import yaml

from tests.e2e.needs import need
from tests.processes import processes_mentioning, still_running_after

pytestmark = pytest.mark.e2e
need("vllm")
need("ray.serve.llm", "trials through Serve need ray[serve,llm]")

SPACE = """
name: serve-trials
model: tiny
device: cpu
workload: cpu-tiny
load: {levels: [4], requests_per_level: 24, warmup_requests: 0, request_timeout_s: 120, startup_timeout_s: 400,
       capacity_levels: 0}  # one level: the capacity search would climb past it
slo: {ttft_ms: {p99: 5000}}
hardware: {devices_per_node: 2}
engine_args: {enforce_eager: true, max_model_len: 512, dtype: bfloat16}
env: {VLLM_CPU_KVCACHE_SPACE: 1}
params:
  serve.num_replicas: [1, 2]
  serve.stream_batching_interval_ms: [0, 50]
constraints: ["serve.num_replicas * tensor_parallel_size <= devices_per_node",  # two trials: 1 replica at 50 ms, 2 at 0
              "serve.num_replicas == 1 or serve.stream_batching_interval_ms == 0",
              "serve.num_replicas == 2 or serve.stream_batching_interval_ms == 50"]
search:  # both trials asked for at once, one waits in the ledger; the recommendation verified through the study's Serve
  {algorithm: grid, baseline: false, max_concurrent: 2, verify: {top: 1, duration_s: 4}}
"""


def servetune(*argv, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "servetune", *map(str, argv)], capture_output=True, text=True, timeout=1200, cwd=cwd
    )


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """The study, run once: the tests below read it, and verify deploys its recommendation again."""
    root = tmp_path_factory.mktemp("serve-trials")
    (root / "space.yaml").write_text(SPACE)
    done = servetune("run", root / "space.yaml", "--storage", root / "results", cwd=root)
    return root, done


def test_one_and_two_replicas_measured_through_serve_recorded_and_torn_down(study):
    tmp_path, done = study
    assert done.returncode in (0, 1), done.stderr[-4000:]  # 1: the verified recommendation was rejected
    study_dir = tmp_path / "results" / "serve-trials"
    results, paths = {}, {}
    for path in study_dir.glob("trials/*/result.json"):
        result = json.loads(path.read_text())
        results[result["params"]["serve.num_replicas"]] = result
        paths[result["params"]["serve.num_replicas"]] = path
    assert sorted(results) == [1, 2] and len(paths) == 2, list(results)
    # Ray Serve LLM's stream batching, a parameter: at 50 ms a replica sends its tokens in batches (most
    # token gaps under 1 ms at the client: 0.82-0.85 measured); at 0 each token as it comes (0.02).
    batched, unbatched = results[1], results[2]
    assert (batched["params"]["serve.stream_batching_interval_ms"], unbatched["params"]["serve.stream_batching_interval_ms"]) == (50, 0)  # fmt: skip
    burst_50, burst_0 = batched["levels"][0]["itl_burst_share"], unbatched["levels"][0]["itl_burst_share"]
    assert burst_50 > burst_0 + 0.2, (burst_50, burst_0)
    for replicas, result in results.items():
        path = paths[replicas]
        assert result["outcome"] == "COMPLETE", (replicas, result["reason"], result.get("log_tail"))
        assert result["devices"] == replicas  # priced for every replica's core
        serve = result["serve"]
        assert serve["replicas"] == replicas and serve["application"].endswith(result["trial_id"])
        served = serve["requests_per_replica"]  # Serve's own counter, per replica
        assert len(served) == replicas and all(n > 0 for n in served.values()), served
        (level,) = result["levels"]
        assert level["summary"]["completed"] == 24 and level["summary"]["failed"] == 0
        # the quality probe and the load all went through Serve: at least the level's requests
        assert sum(served.values()) >= 24, served
        assert level.get("cache_note") is None  # each level began on emptied caches (reset through Serve)
        assert result["startup_s"] > 0
        # vLLM's own metrics, every replica's added up, read from Ray's metrics agents (Serve's ingress has no /metrics)
        server = level["server_metrics"]
        out = level["summary"]["total_output_tokens"]
        assert abs(server.get("generation_tokens", 0) - out) <= 0.05 * out, (server, out)
        assert server.get("requests_running_max", 0) >= 1 and server.get("prefix_cache_queries", 0) > 0, server
        # the replicas' vLLM log is the trial's engine log: the KV capacity comes from it, as a bare engine's does
        log = path.parent / "engine.log"
        assert log.exists() and "KV cache" in log.read_text(), sorted(p.name for p in path.parent.iterdir())
        # each replica's engine on a core of its own (vLLM's CPU build would bind them all to core 0)
        cores = re.findall(r"core ids=\[([0-9, ]+)\]", log.read_text())
        assert len(cores) == replicas and len(set(cores)) == replicas, cores
        # ... as the replicas' claims told the trial (serve/claims.py), or why one ran without a claim of its own
        environment = result["environment"]
        assert "cpu_binding" in environment or "cpu_unclaimed" in environment, environment
        if "cpu_unclaimed" not in environment:
            assert sorted(environment["cpu_binding"].split(", ")) == sorted(c.strip() for c in cores), environment
        assert result["kv_capacity"]["tokens"] > 0, result.get("kv_capacity")
        assert serve["replica_niceness"] == [0]  # not Ray's 15: the engines get the CPU a bare engine gets
        assert list(serve["replica_nodes"].values()) == [replicas], serve  # where Ray placed them (one node here)
        assert serve["device_nodes"] == serve["replica_nodes"], serve  # and their devices: one rank (CPU bundle) each
    assert results[1]["trial_id"] != results[2]["trial_id"]
    # Both asked for at once (max_concurrent: 2), run one after the other: one replica's core and two replicas' cores
    # are more than the two the space declares, so the second waited until the first had finished and given its cores
    # back to the study's ledger (a trial's clock starts once the ledger gave it its devices).
    first, second = sorted(results.values(), key=lambda r: r["started_at"])
    assert second["started_at"] >= first["finished_at"], [(r["started_at"], r["finished_at"]) for r in results.values()]
    assert "2 trial(s) at once" in done.stderr
    assert (
        still_running_after(60, "ServeReplica:servetune-serve-trials-") == []
        and processes_mentioning(study_dir, "vllm") == []
    )
    # The exported Serve application scales on what one of the trial's replicas served: at the measured load itself
    # (--headroom 1; the default keeps 0.8 of it), 4 clients over 2 replicas is 2 in flight per replica, and the
    # ladder's top (4) needs both.
    export = servetune(
        "export", study_dir, "--pick", results[2]["trial_id"], "--format", "ray-serve", "--headroom", "1"
    )
    assert export.returncode == 0, export.stderr
    config = yaml.safe_load(export.stdout)["applications"][0]["args"]["llm_configs"][0]
    autoscaling = config["deployment_config"]["autoscaling_config"]
    assert autoscaling["target_ongoing_requests"] == 2 and autoscaling["max_replicas"] == 2, autoscaling
    assert "serve.num_replicas" not in config["engine_kwargs"] and "/ 2 Serve replicas" in export.stdout
    assert config["experimental_configs"] == {"stream_batching_interval_ms": 0}  # measured at, not Ray's default 50


def test_the_study_verifies_its_recommendation_through_its_own_serve(study):
    """search.verify: the recommended trial deployed again, as the Serve application it was measured as, on
    the study's Serve (no Ray of its own), every scenario loaded through Serve's ingress, vLLM's gauges and
    counters read from its replicas through Ray's agents. (``servetune verify`` takes the same path on a
    local Ray of its own: verify/run.py ``started``.)"""
    tmp_path, done = study
    assert done.returncode in (0, 1), done.stderr[-4000:]
    assert "Traceback" not in done.stderr
    study_dir = tmp_path / "results" / "serve-trials"
    (path,) = (study_dir / "verify").glob("*.json")
    doc = json.loads(path.read_text())
    assert (done.returncode == 0) == doc["accepted"], doc["reasons"]
    trial = json.loads((study_dir / "trials" / doc["trial_id"] / "result.json").read_text())
    replicas = trial["params"]["serve.num_replicas"]
    served = doc["engine"]["serve"]["requests_per_replica"]
    assert (
        doc["engine"]["serve"]["replicas"] == replicas
        and len(served) == replicas
        and all(n > 0 for n in served.values())
    ), doc["engine"]
    scenarios = doc["scenarios"]
    assert list(scenarios) == ["soak", "peak", "burst", "mix", "long_output", "disconnects", "headroom", "repeats"]
    assert not any(s["reason"].startswith("not run") for s in scenarios.values()), doc["reasons"]
    # The replicas' gauges, through Ray's agents (Serve's ingress has no /metrics): the streams were seen in
    # flight before the drop, and the allowance grew by the agents' lag (2.5 s on the local Ray).
    rounds = scenarios["disconnects"]["rounds"]
    seen = [r for r in rounds if r["observed"]]
    assert seen and all(r["allowed_s"] >= 2.0 + 2.5 and r["released_s"] is not None for r in seen), rounds
    assert scenarios["headroom"]["kv_cache_usage_max"] is not None and scenarios["headroom"]["engine_alive"], scenarios[
        "headroom"
    ]
    assert scenarios["soak"]["rss_start_mib"] > 50  # a replica's engine memory was followed
    # the context length from the replicas' log (Serve's models list has none): max_model_len minus the prompt
    assert scenarios["long_output"]["server_output_limit"] == 512 - 32, scenarios["long_output"]
    assert doc["stability"]["error_rate_5xx"] == 0.0
    assert (
        doc["placement"]["assigned_resources"].get("CPU") == 1.0 and "GPU" not in doc["placement"]["assigned_resources"]
    )  # the load client's: Serve holds the devices
    assert "KV cache" in (study_dir / "verify" / doc["trial_id"] / "engine.log").read_text()
    assert f"verify: trial {doc['trial_id']} {'ACCEPTED' if doc['accepted'] else 'REJECTED'}" in done.stderr
    assert (
        still_running_after(60, "ServeReplica:servetune-serve-trials-") == []
        and processes_mentioning(study_dir, "vllm") == []
    )
