"""``servetune serve-check`` on a local Ray with Ray Serve LLM and the real vLLM CPU build.

The study is one COMPLETE trial of the checked-in CPU study (tests/data/cpu-tiny-study, vLLM's
defaults, measured on this kind of host) with its model pointed at the test's tiny model: what
serve-check needs of a study is the trial's engine arguments, environment, model and measured
levels, and the space's workload, ladder and SLO. One fixed replica is measured, then the ramp
deploys the derived autoscaling (1-2 replicas, delays x 0.05) and offers 6, 18 and 6 clients (the operating
point: 0.8 x the 8 clients that met the SLO, in whole clients), each for the shortest hold serve-check allows
(5 s; 18 from when the second replica is RUNNING): the
second replica must start, be RUNNING before it serves, and take traffic. The ramp starts on the
replica the count left running. Then --routers puts Serve's default router on the ramp's engines (two
replicas, prefix caches reset) and switches them, engines kept and caches reset again, to Ray Serve
LLM's prefix-aware one, each offered a RAG-like workload scaled to the tiny model (most prompts start
with one shared prefix). Last, --layouts compares a two-core budget laid out as 2x1 (the routers' two
replicas, switched back to Serve's default router, prefix caches reset) and 1x2 (one replica with
TP=2, its ranks bound to the two cores, deployed fresh), both at concurrency 12 (the operating point, 6
on one core, scaled to two). Engines started: one for the count, one by the ramp, one for 1x2.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from servetune.serve.result import ServeCheckResult
from tests.e2e.needs import need

pytestmark = pytest.mark.e2e
need("vllm")
need("ray.serve.llm", "serve-check needs ray[serve,llm]")

FIXTURE = Path(__file__).parents[1] / "data" / "cpu-tiny-study"
TRIAL = "e57a166985b8"  # vLLM's defaults: measured at concurrency 2, 8 and 32

SPACE = """
name: cpu-tiny
model: tiny
device: cpu
workload: cpu-tiny
load: {levels: [8], requests_per_level: 24, request_timeout_s: 120, startup_timeout_s: 600}
slo: {ttft_ms: {p99: 5000}}
hardware: {devices_per_node: 2}
engine_args: {enforce_eager: true, max_model_len: 1024, dtype: bfloat16}
env: {VLLM_CPU_KVCACHE_SPACE: 1}
"""


RAG_TINY = """
name: rag-tiny
description: rag scaled to the tiny model (max_model_len 1024)
input_tokens: {dist: lognormal, median: 320, sigma: 0.3, min: 200, max: 600}
output_tokens: {dist: fixed, value: 16}
shared_prefix: {tokens: 160, fraction: 0.8}
"""


def one_trial_study(root: Path, model: Path) -> Path:
    (root / "trials" / TRIAL).mkdir(parents=True)
    shutil.copy(FIXTURE / "study.json", root / "study.json")
    result = json.loads((FIXTURE / "trials" / TRIAL / "result.json").read_text())
    result["model"] = str(model)
    (root / "trials" / TRIAL / "result.json").write_text(json.dumps(result))
    (root / "space.yaml").write_text(SPACE)
    return root


def servetune(*argv, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "servetune", *map(str, argv)], capture_output=True, text=True, timeout=timeout
    )


def test_one_replica_a_ramp_to_two_routers_and_layouts_compared_and_all_are_torn_down(tiny_model, tmp_path):
    study = one_trial_study(tmp_path / "study", tiny_model)
    (tmp_path / "rag-tiny.yaml").write_text(RAG_TINY)
    # One fixed replica, then the ramp in place of a fixed two-replica run: it scales out to two.
    done = servetune("serve-check", study, "--pick", TRIAL, "--replicas", "1", "--ramp", "--ramp-max-replicas", "2",
                     "--ramp-hold", "5", "--delay-scale", "0.05", "--routers", "default,prefix-aware",
                     "--routing-replicas", "2", "--workload", tmp_path / "rag-tiny.yaml", "--layouts", "2x1,1x2",
                     timeout=1500)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = ServeCheckResult.model_validate_json((study / "serve-check.json").read_text())
    (one,) = result.runs
    (lv,) = one.levels
    assert one.replicas == 1 and len(one.requests_per_replica) == 1
    assert lv.summary.level == {"concurrency": 8.0} and lv.summary.completed == 24 and lv.summary.failed == 0
    (row,) = result.rows
    assert row.scaling_efficiency == pytest.approx(1.0)
    assert row.bare_output_throughput == pytest.approx(938, abs=1) and row.ttft_p50_overhead_ms is not None
    assert "scaling eff." in done.stdout and "router TTFT p50" in done.stdout
    assert result.replica_pids and not [p for p in result.replica_pids if psutil.pid_exists(p) and
                                        psutil.Process(p).status() != psutil.STATUS_ZOMBIE]  # fmt: skip
    assert (study / "serve-check.requests.jsonl").is_file()
    # The ramp: the derived autoscaling (6 in flight a replica, 1-2 replicas) under 5, 15, 5 clients: 1x one below
    # the target, so one replica holds it without Serve scaling out.
    assert result.operating_point is not None and result.operating_point["level"] == {"concurrency": 6.0}
    ramp = result.ramp
    assert ramp is not None and [p.name for p in ramp.phases] == ["1x", "3x", "back to 1x"]
    assert ramp.knee_concurrency == 6 and ramp.autoscaling_config["target_ongoing_requests"] == 6
    assert ramp.base_concurrency == 5 and [p.concurrency for p in ramp.phases] == [5, 15, 5]
    assert ramp.time_to_decide_s is not None and ramp.time_to_decide_s > 0  # not during 1x
    assert ramp.autoscaling_config["max_replicas"] == 2 and ramp.autoscaling_config["upscale_delay_s"] == 6.0
    # The second replica starts its engine beside one serving 15 clients: 170 s in a recorded run here at 24, of the
    # startup_timeout_s (600) the ramp's 3x waits for it, which is why that is well above a lone start's 100 s.
    assert ramp.replicas_before == 1 and ramp.replicas_peak == 2, [(s.t_s, s.running, s.starting) for s in ramp.samples]
    assert ramp.engines_reused is True  # on the count's engine: no engine start (a deploy time proves nothing here)
    assert ramp.time_to_scale_up_s is not None and ramp.time_to_scale_up_s > ramp.autoscaling_config["upscale_delay_s"]
    assert ramp.new_replicas and not ramp.traffic_before_ready
    assert ramp.new_replica_first_served_s >= ramp.new_replica_running_s
    assert all(p.requests > 0 and p.errors == 0 for p in ramp.phases), ramp.phases
    assert sum(len(w.served) > 1 for w in ramp.windows) >= 1  # both replicas served within one window
    new = ramp.new_replicas[0]
    assert ramp.samples[-1].served.get(new, 0) >= 6  # the new replica took a real share of the 3x load
    assert "time to scale up" in done.stdout
    # The routers: each on the same two replicas, the same 24 requests at the operating point (concurrency 6).
    routing = result.routing
    assert routing is not None and [r.router for r in routing.runs] == ["default", "prefix-aware"]
    assert routing.runs[1].router_class.endswith("PrefixCacheAffinityRouter") and routing.level == {"concurrency": 6.0}
    for run in routing.runs:
        s = run.level.summary
        assert s.completed == 24 and s.failed == 0 and s.warmup_excluded == 0, run.router
        traffic = list(run.per_replica.values())
        assert sum(t.requests for t in traffic) == 24, run.per_replica  # Serve's counter, per replica
        # vLLM's own counters, per replica through Ray's metrics agent, add up to what the client saw.
        assert sum(t.generation_tokens for t in traffic) == s.total_output_tokens == 24 * 16, run.per_replica
        assert sum(t.prompt_tokens for t in traffic) >= s.total_input_tokens, run.per_replica
        assert 0 < run.prefix_cache_hit_rate < 1, run.per_replica  # the shared prefix is reused, the rest is not
    default, prefix_aware = routing.runs
    # The first router is deployed on the ramp's engines, the second switched to on the same ones: Serve kept
    # the LLM replicas (same actors).
    assert default.engines_reused is True and prefix_aware.engines_reused is True, routing.runs
    assert prefix_aware.engine_replicas == default.engine_replicas and len(default.engine_replicas) == 2
    assert "on the engines already running (Serve kept them" in " ".join(done.stdout.split())
    # The caches were reset between the routers: the same prompts again hit only their shared 160-token prefix
    # (a cache kept from the default run would also hit the rest of every prompt served again on its replica).
    for run in routing.runs:
        assert sum(t.prefix_cache_hits for t in run.per_replica.values()) <= 160 * 24, (run.router, run.per_replica)
    assert len(default.per_replica) == 2  # power of two choices spreads the load over both replicas
    # The prefix-aware router keeps the shared prefix on the replica that has it: the load piles up there.
    assert prefix_aware.imbalance > default.imbalance and prefix_aware.imbalance >= 1.3, (
        default.per_replica,
        prefix_aware.per_replica,
    )
    assert routing.verdict is not None and "verdict:" in done.stdout and "hit rate" in done.stdout
    sent = [json.loads(line) for line in (study / "serve-check.requests.jsonl").read_text().splitlines()]
    assert [sum(r.get("router") == name for r in sent) for name in ("default", "prefix-aware")] == [24, 24]
    # The layouts: two cores as 2x1 and 1x2, at the same offered load, each served, a verdict naming one.
    laid = result.layouts
    assert laid is not None and laid.budget == 2 and laid.level == {"concurrency": 12.0}
    small, big = laid.runs
    assert (small.layout, small.replicas, small.tensor_parallel_size) == ("2x1", 2, 1)
    assert (big.layout, big.replicas, big.tensor_parallel_size, big.devices) == ("1x2", 1, 2, 2)
    for run in laid.runs:
        s = run.level.summary
        assert s.level == {"concurrency": 12.0} and s.completed == 24 and s.failed == 0, run.layout
        assert sum(run.requests_per_replica.values()) >= 24, run.requests_per_replica  # Serve's counter, warm-up too
        assert s.output_throughput > 0 and run.cost_per_mtok_usd is not None and run.cost_per_hour_usd is not None
    assert len(small.requests_per_replica) == 2 and len(big.requests_per_replica) == 1
    # 2x1 is the routers' engines, switched back to the default router; 1x2 a fresh deployment.
    assert small.engines_reused is True and big.engines_reused is False and big.ready_s > small.ready_s
    assert laid.verdict is not None and laid.verdict.ship in ("2x1", "1x2"), laid.verdict
    assert "serve-check --layouts" in done.stdout and "verdict: ship" in " ".join(done.stdout.split())
    sent_small, sent_big = (sum(r.get("layout") == name for r in sent) for name in ("2x1", "1x2"))
    assert sent_small == sent_big >= 24  # the same plan (warm-up and 24 measured) offered to both
