"""serve-check --routers without Ray: router names, the deployed router config, the per-replica
counters read from Ray's metrics agent text, hit rates, imbalance, the verdict, the comparison's
order of deployments, switches and cache resets (a fake cluster), and refusals before Ray starts."""

from __future__ import annotations

import pytest

from servetune.cli import main
from servetune.errors import UserError
from servetune.serve.check import Routing, Teardown, run_check
from servetune.serve.routing import (
    ReplicaTraffic,
    RouterRun,
    engine_version,
    imbalance,
    merge_counters,
    parse_routers,
    read_replica_counters,
    routed_llm_config,
    traffic_between,
    verdict,
)
from servetune.serve.study import read_picked
from tests.builders import cpu_study, level
from tests.unit.test_serve_check import FakeCluster

# the hub ids these tests name are made up (org/tiny-chat): none is asked of a hub (tests/conftest.py no_hub)
pytestmark = pytest.mark.usefixtures("no_hub")

#: What Ray's metrics agent exports (shape as Ray 2.60 writes it): Serve's request counter for the LLM
#: deployment and the ingress, and vLLM's counters labelled with the replica (ReplicaId).
AGENT_TEXT = """\
# HELP ray_serve_deployment_request_counter_total The number of queries that have been processed in this replica.
# TYPE ray_serve_deployment_request_counter_total counter
ray_serve_deployment_request_counter_total{Component="core_worker",application="app",deployment="LLMServer:tiny",replica="r1",route="/"} 7.0
ray_serve_deployment_request_counter_total{Component="core_worker",application="app",deployment="LLMServer:tiny",replica="r2",route="/"} 3.0
ray_serve_deployment_request_counter_total{Component="core_worker",application="app",deployment="OpenAiIngress",replica="i1",route="/"} 10.0
ray_serve_deployment_request_counter_total{Component="core_worker",application="other",deployment="LLMServer:x",replica="o1",route="/"} 5.0
# HELP ray_vllm_prompt_tokens_total Number of prefill tokens processed.
# TYPE ray_vllm_prompt_tokens_total counter
ray_vllm_prompt_tokens_total{Component="core_worker",ReplicaId="r1",WorkerId="w1",engine="0",model_name="tiny"} 2800.0
ray_vllm_prompt_tokens_total{Component="core_worker",ReplicaId="r2",WorkerId="w2",engine="0",model_name="tiny"} 1200.0
ray_vllm_prompt_tokens_total{Component="core_worker",ReplicaId="o1",WorkerId="w3",engine="0",model_name="x"} 999.0
# HELP ray_vllm_generation_tokens_total Number of generation tokens processed.
# TYPE ray_vllm_generation_tokens_total counter
ray_vllm_generation_tokens_total{Component="core_worker",ReplicaId="r1",WorkerId="w1",engine="0",model_name="tiny"} 112.0
ray_vllm_generation_tokens_total{Component="core_worker",ReplicaId="r2",WorkerId="w2",engine="0",model_name="tiny"} 48.0
# HELP ray_vllm_prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE ray_vllm_prefix_cache_queries_total counter
ray_vllm_prefix_cache_queries_total{Component="core_worker",ReplicaId="r1",WorkerId="w1",engine="0",model_name="tiny"} 2800.0
ray_vllm_prefix_cache_queries_total{Component="core_worker",ReplicaId="r2",WorkerId="w2",engine="0",model_name="tiny"} 1200.0
# HELP ray_vllm_prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE ray_vllm_prefix_cache_hits_total counter
ray_vllm_prefix_cache_hits_total{Component="core_worker",ReplicaId="r1",WorkerId="w1",engine="0",model_name="tiny"} 1600.0
ray_vllm_prefix_cache_hits_total{Component="core_worker",ReplicaId="r2",WorkerId="w2",engine="0",model_name="tiny"} 320.0
# HELP ray_vllm_num_requests_running Number of requests in model execution batches.
# TYPE ray_vllm_num_requests_running gauge
ray_vllm_num_requests_running{Component="core_worker",ReplicaId="r1",WorkerId="w1",engine="0",model_name="tiny"} 0.0
"""


def test_router_names_keep_their_order_and_unknown_ones_are_refused():
    assert parse_routers("default, prefix-aware,default") == ["default", "prefix-aware"]
    for bad in ("round-robbin", "default,prefix", ""):
        with pytest.raises(UserError, match=r"--routers '.*': unknown router .*\(known: default, prefix-aware\)"):
            parse_routers(bad)


def test_the_prefix_aware_router_is_ray_serve_llms_class_and_default_leaves_serves_own():
    # (that the name resolves to Ray's class, and routes by prefix, the e2e run on real Serve shows)
    config = {"deployment_config": {"autoscaling_config": {"min_replicas": 2}}}
    routed = routed_llm_config(config, "prefix-aware")
    assert routed["deployment_config"]["request_router_config"] == {
        "request_router_class": "ray.serve.llm.request_router:PrefixCacheAffinityRouter"
    }
    assert "request_router_config" not in config["deployment_config"]  # the caller's config is not changed
    assert routed_llm_config(routed, "default")["deployment_config"] == {"autoscaling_config": {"min_replicas": 2}}


def test_the_engine_version_ignores_what_serve_applies_in_place_and_nothing_else():
    config = {"engine_kwargs": {"max_num_seqs": 8}, "deployment_config": {"autoscaling_config": {"min_replicas": 2}}}
    version = engine_version(config)
    assert engine_version(routed_llm_config(config, "prefix-aware")) == version  # a router switch keeps the engines
    # So do another replica count, the ramp's autoscaling and its queue limits: Serve applies them to running replicas.
    assert (
        engine_version(
            {
                **config,
                "deployment_config": {
                    "autoscaling_config": {"min_replicas": 1, "max_replicas": 3},
                    "max_ongoing_requests": 10,
                    "max_queued_requests": 4,
                },
            }
        )
        == version
    )
    assert engine_version({**config, "deployment_config": {"num_replicas": 3}}) == version
    assert engine_version({**config, "engine_kwargs": {"max_num_seqs": 16}}) != version  # a new engine config does not
    assert engine_version({**config, "runtime_env": {"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}}) != version
    assert (
        engine_version(
            {**config, "deployment_config": {"autoscaling_config": {}, "ray_actor_options": {"num_cpus": 2}}}
        )
        != version
    )


def test_counters_per_replica_come_from_the_agents_text_for_the_applications_llm_deployment_only():
    counters = read_replica_counters(AGENT_TEXT, "app")
    assert counters == {
        "r1": {
            "requests": 7,
            "prompt_tokens": 2800,
            "generation_tokens": 112,
            "prefix_cache_queries": 2800,
            "prefix_cache_hits": 1600,
        },
        "r2": {
            "requests": 3,
            "prompt_tokens": 1200,
            "generation_tokens": 48,
            "prefix_cache_queries": 1200,
            "prefix_cache_hits": 320,
        },
    }  # fmt: skip  (the ingress, another application's replicas and gauges are not counted)
    assert read_replica_counters("not { prometheus", "app") == {}
    assert read_replica_counters('ray_serve_deployment_request_counter_total{application="app" 7.0\n', "app") == {}


#: Another of the agent's metrics, as the many it exports beside the counters, with a sample the parser refuses.
UNREADABLE_OTHER = """\
# TYPE ray_component_cpu_percentage gauge
ray_component_cpu_percentage{Component="raylet",pid="42"} not-a-number
"""


def test_only_the_counters_lines_are_parsed_so_another_metric_the_parser_refuses_hides_nothing():
    """The agent's text is thousands of lines of Ray's, Serve's and vLLM's metrics; the counters' lines alone are
    parsed (each parsed line costs a core about 0.1 ms, and serve-check's ramp reads every second)."""
    assert read_replica_counters(UNREADABLE_OTHER + AGENT_TEXT, "app") == read_replica_counters(AGENT_TEXT, "app")
    assert read_replica_counters(AGENT_TEXT + UNREADABLE_OTHER, "app")["r1"]["requests"] == 7


def test_replicas_on_two_nodes_are_read_from_each_nodes_agent_and_merged():
    # Each node's metrics agent exports the samples of the replicas on that node only.
    def node_text(replica):
        return (
            "\n".join(line for line in AGENT_TEXT.splitlines() if line.startswith("#") or f'"{replica}"' in line) + "\n"
        )

    per_node = [read_replica_counters(node_text(r), "app") for r in ("r1", "r2")]
    assert [set(c) for c in per_node] == [{"r1"}, {"r2"}]
    assert merge_counters(per_node) == read_replica_counters(AGENT_TEXT, "app")
    assert merge_counters([{"r1": {"requests": 2}}, {"r1": {"requests": 3, "prompt_tokens": 5}}]) == {
        "r1": {"requests": 5, "prompt_tokens": 5}
    }


@pytest.mark.parametrize("interval_ms, lag_s", [(1000, 2.5), (10_000, 20.5)])
def test_the_counters_are_read_after_the_agents_lag_not_a_fixed_wait(monkeypatch, interval_ms, lag_s):
    # A local Ray servetune starts reports every second; a cluster at Ray's default every 10 s, and a
    # read 2.5 s after a level would miss its last requests there.
    from types import SimpleNamespace

    import ray

    from servetune.serve import cluster as cluster_module

    waits = []
    monkeypatch.setattr(ray, "_config", SimpleNamespace(metrics_report_interval_ms=lambda: interval_ms))
    monkeypatch.setattr(cluster_module.time, "sleep", waits.append)
    serve_cluster = cluster_module.ServeCluster("ray://nowhere:1", {})
    monkeypatch.setattr(serve_cluster, "metrics_texts", lambda: [AGENT_TEXT])
    assert serve_cluster.requests_per_replica("app") == {"r1": 7, "r2": 3}
    assert serve_cluster.replica_counters("app") == read_replica_counters(AGENT_TEXT, "app")
    assert waits == [lag_s, lag_s]


def test_traffic_is_what_the_counters_grew_by_and_hit_rates_and_imbalance_follow():
    before = {"r1": {"requests": 2, "prompt_tokens": 800, "prefix_cache_queries": 800, "prefix_cache_hits": 0},
              "old": {"requests": 9, "prompt_tokens": 999}}  # fmt: skip
    after = read_replica_counters(AGENT_TEXT, "app") | {"old": {"requests": 9, "prompt_tokens": 999}}
    traffic = traffic_between(before, after)
    assert set(traffic) == {"r1", "r2"}  # a replica whose counters did not move is not in the run
    r1, r2 = traffic["r1"], traffic["r2"]
    assert (r1.requests, r1.tokens_served, r1.prefix_cache_hit_rate) == (5, 2000 + 112, pytest.approx(1600 / 2000))
    assert r2.tokens_served == 1248 and r2.prefix_cache_hit_rate == pytest.approx(320 / 1200)
    run = RouterRun(router="default", router_class=None, replicas=2, level=level(8, 100, 400), per_replica=traffic)
    assert run.prefix_cache_hit_rate == pytest.approx((1600 + 320) / (2000 + 1200))
    assert run.imbalance == pytest.approx(2112 / ((2112 + 1248) / 2))
    dumped = run.model_dump()
    assert dumped["imbalance"] == run.imbalance and dumped["per_replica"]["r1"]["prefix_cache_hit_rate"] == 0.8


def test_imbalance_counts_a_replica_that_served_nothing():
    assert imbalance([100, 100], 2) == 1.0
    assert imbalance([100], 2) == 2.0  # everything on one of two replicas
    assert imbalance([300, 100], 4) == pytest.approx(3.0)
    assert imbalance([], 2) is None and ReplicaTraffic().prefix_cache_hit_rate is None


def run_of(router: str, ttft_p50: float, hits: int, queries: int = 1000, failed: int = 0, goodput_scale: float = 1.0):
    lv = level(8, 600 * goodput_scale, 2 * ttft_p50)  # the builder's P50 is half its P99
    lv.summary.failed = failed
    traffic = {"a": ReplicaTraffic(requests=10, prompt_tokens=queries, prefix_cache_queries=queries, prefix_cache_hits=hits),
               "b": ReplicaTraffic(requests=2, prompt_tokens=100)}  # fmt: skip
    return RouterRun(router=router, router_class=None, replicas=2, level=lv, per_replica=traffic)


def test_verdict_names_a_router_only_beyond_the_margins():
    base = run_of("default", 200, 400)
    faster = verdict([base, run_of("prefix-aware", 150, 400)])  # 50 ms lower, margin max(20, 15% of 200) = 30
    assert faster.ship == "prefix-aware" and "faster" in faster.reason and "margin 30 ms" in faster.reason
    slower = verdict([base, run_of("prefix-aware", 240, 900)])
    assert slower.ship == "default" and "prefix-aware is worse" in slower.reason
    reuse = verdict([base, run_of("prefix-aware", 210, 500)])  # +10 points at a TTFT within the margin
    assert reuse.ship == "prefix-aware" and "hit rate 50% against 40%" in reuse.reason and "imbalance" in reuse.reason
    noise = verdict([base, run_of("prefix-aware", 180, 420)])  # -20 ms (margin 30), +2 points
    assert noise.ship is None and noise.reason.startswith("no difference above noise")
    starved = verdict([base, run_of("prefix-aware", 150, 400, goodput_scale=0.8)])
    assert starved.ship == "default" and "goodput" in starved.reason
    assert verdict([base, run_of("prefix-aware", 100, 900, failed=1)]).ship is None
    assert verdict([base]) is None


def routing_cluster(restarts: bool = False):
    """A fake cluster that records deploys, deletes, resets and counter reads in order; ``restarts``: Serve
    starts new LLM replicas on every deploy (new actor ids), as it would if the version pin did not hold."""
    events: list[tuple] = []

    class Cluster(FakeCluster):
        def deploy(self, name, config, timeout_s, engine_version=None, keep_ingress=False):
            events.append(("deploy", config["deployment_config"], engine_version))
            return super().deploy(name, config, timeout_s, engine_version, keep_ingress)

        def delete(self, name):
            events.append(("delete", name in self.running))
            super().delete(name)

        def reset_prefix_caches(self, name):
            events.append(("reset",))
            return super().reset_prefix_caches(name)

        def replica_counters(self, name):  # before a router's level: nothing yet; after it: the agent's text
            events.append(("counters",))
            reads = sum(e == ("counters",) for e in events)
            return read_replica_counters(AGENT_TEXT, "app") if reads % 2 == 0 else {}

    return Cluster(restarts=restarts), events


def compare(tmp_path, cluster):
    picked = read_picked(cpu_study(tmp_path / "s", price=None), "t1")
    measured: list[str] = []

    def measure(url, served, router):
        measured.append(router)
        return level(8, 300, 400)

    routing = Routing(routers=["default", "prefix-aware"], replicas=2, workload="rag-tiny", measure=measure)
    teardown = Teardown(pids=set())
    result = run_check(
        picked, [1], cluster, "app", lambda url, served, n: [level(8, 380, 320)], teardown, routing=routing
    )
    assert measured == ["default", "prefix-aware"]
    return result, teardown


def test_routers_switch_on_the_same_engines_with_their_caches_reset_after_the_replica_counts(tmp_path):
    cluster, events = routing_cluster()
    result, teardown = compare(tmp_path, cluster)
    kinds = [e[0] for e in events]
    # The replica count deployed fresh; the first router on its engine (one replica added) and the next switched
    # to on the same two (no delete between), the caches reset before each router's counters are read (Serve
    # counts the reset as a request per replica).
    assert kinds == [
        "delete",
        "deploy",
        "deploy",
        "reset",
        "counters",
        "counters",
        "deploy",
        "reset",
        "counters",
        "counters",
    ]
    counted, first, switched = events[1], events[2], events[6]
    assert counted[1]["autoscaling_config"]["min_replicas"] == 1
    assert first[1]["autoscaling_config"]["min_replicas"] == 2 and "request_router_config" not in first[1]
    assert switched[1]["request_router_config"]["request_router_class"].endswith(":PrefixCacheAffinityRouter")
    assert counted[2] is not None and counted[2] == first[2] == switched[2]  # one pinned engine version
    assert cluster.started == 2  # one engine for the count, one added for the routers: none started twice
    routed = result.routing
    assert routed.replicas == 2 and routed.level == {"concurrency": 8.0} and routed.workload == "rag-tiny"
    assert [r.router for r in routed.runs] == ["default", "prefix-aware"] and routed.runs[1].per_replica[
        "r1"
    ].requests == 7
    assert [r.engines_reused for r in routed.runs] == [True, True]
    assert routed.runs[0].engine_replicas == routed.runs[1].engine_replicas == ["actor0", "actor1"]
    assert routed.verdict is not None and routed.verdict.ship is None  # the same numbers: no router named
    assert {101, 102} <= teardown.pids


def test_a_switch_on_which_serve_restarted_the_engines_is_recorded(tmp_path):
    cluster, _ = routing_cluster(restarts=True)
    result, _ = compare(tmp_path, cluster)
    default, prefix_aware = result.routing.runs
    assert prefix_aware.engines_reused is False and prefix_aware.engine_replicas != default.engine_replicas


def test_cli_refuses_bad_routing_options_in_one_line_before_ray_starts(tmp_path, capsys):
    ray = pytest.importorskip("ray")
    study = cpu_study(tmp_path / "s", {"max_model_len": 1024}, price=None)  # the CPU stand-in's max_model_len
    cases = {
        ("--routers", "default,round-robin"): "--routers 'default,round-robin': unknown router 'round-robin' "
        "(known: default, prefix-aware)",
        ("--routers", "default,prefix-aware", "--replicas", "1"): "it needs 2 or more, got 1",
        ("--routers", "default", "--workload", "cpu-tiny"): "--workload cpu-tiny: no shared_prefix",
        ("--routers", "default", "--workload", str(tmp_path / "nope.yaml")): "nope.yaml: file not found",
        ("--workload", "rag"): "--routing-replicas and --workload go with --routers",
        (
            "--routers",
            "default,prefix-aware",
        ): "--workload rag: its smallest request (1532 tokens with its answer) passes the trial's max_model_len 1024",
    }
    for argv, message in cases.items():
        assert main(["serve-check", str(study), "--pick", "t1", *argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (argv, err)
    assert not ray.is_initialized() and not (study / "serve-check.json").exists()
