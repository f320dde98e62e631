"""A Serve deployment's vLLM metrics, read from Ray's metrics agents, as one server's /metrics."""

from __future__ import annotations

import pytest

from servetune.engine.metrics import Histogram, MetricsSnapshot, level_delta
from servetune.serve.metrics import replicas_snapshot

#: Two nodes' agents (shape as Ray 2.60 exports vLLM's metrics): replicas r1 and r2 of the trial's
#: deployment, o1 of another application's, and Serve's own request counter (not vLLM's).
NODE_A = """\
# HELP ray_vllm_num_requests_running Number of requests in model execution batches.
# TYPE ray_vllm_num_requests_running gauge
ray_vllm_num_requests_running{Component="core_worker",ReplicaId="r1",WorkerId="w1",engine="0",model_name="tiny"} 3.0
ray_vllm_num_requests_running{Component="core_worker",ReplicaId="o1",WorkerId="w3",engine="0",model_name="x"} 9.0
# HELP ray_vllm_num_requests_waiting Number of requests waiting to be processed.
# TYPE ray_vllm_num_requests_waiting gauge
ray_vllm_num_requests_waiting{Component="core_worker",ReplicaId="r1",WorkerId="w1",engine="0",model_name="tiny"} 2.0
ray_vllm_num_requests_waiting{Component="core_worker",ReplicaId="o1",WorkerId="w3",engine="0",model_name="x"} 50.0
# HELP ray_vllm_kv_cache_usage_perc KV-cache usage.
# TYPE ray_vllm_kv_cache_usage_perc gauge
ray_vllm_kv_cache_usage_perc{Component="core_worker",ReplicaId="r1",WorkerId="w1",engine="0",model_name="tiny"} 0.4
# HELP ray_vllm_prompt_tokens_total Number of prefill tokens processed.
# TYPE ray_vllm_prompt_tokens_total counter
ray_vllm_prompt_tokens_total{Component="core_worker",ReplicaId="r1",WorkerId="w1",engine="0",model_name="tiny"} 2800.0
ray_vllm_prompt_tokens_total{Component="core_worker",ReplicaId="o1",WorkerId="w3",engine="0",model_name="x"} 999.0
# HELP ray_vllm_prefix_cache_queries_total Prefix cache queries.
# TYPE ray_vllm_prefix_cache_queries_total counter
ray_vllm_prefix_cache_queries_total{Component="core_worker",ReplicaId="r1",WorkerId="w1",engine="0",model_name="tiny"} 2800.0
# HELP ray_vllm_prefix_cache_hits_total Prefix cache hits.
# TYPE ray_vllm_prefix_cache_hits_total counter
ray_vllm_prefix_cache_hits_total{Component="core_worker",ReplicaId="r1",WorkerId="w1",engine="0",model_name="tiny"} 700.0
# HELP ray_vllm_time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE ray_vllm_time_to_first_token_seconds histogram
ray_vllm_time_to_first_token_seconds_bucket{Component="core_worker",ReplicaId="r1",WorkerId="w1",engine="0",le="0.1",model_name="tiny"} 6.0
ray_vllm_time_to_first_token_seconds_bucket{Component="core_worker",ReplicaId="r1",WorkerId="w1",engine="0",le="1.0",model_name="tiny"} 10.0
ray_vllm_time_to_first_token_seconds_bucket{Component="core_worker",ReplicaId="r1",WorkerId="w1",engine="0",le="+Inf",model_name="tiny"} 10.0
ray_vllm_time_to_first_token_seconds_count{Component="core_worker",ReplicaId="r1",WorkerId="w1",engine="0",model_name="tiny"} 10.0
ray_vllm_time_to_first_token_seconds_sum{Component="core_worker",ReplicaId="r1",WorkerId="w1",engine="0",model_name="tiny"} 1.5
# HELP ray_serve_deployment_request_counter_total The number of queries.
# TYPE ray_serve_deployment_request_counter_total counter
ray_serve_deployment_request_counter_total{Component="core_worker",application="app",deployment="LLMServer:tiny",replica="r1",route="/"} 7.0
"""
NODE_B = """\
# TYPE ray_vllm_num_requests_running gauge
ray_vllm_num_requests_running{Component="core_worker",ReplicaId="r2",WorkerId="w2",engine="0",model_name="tiny"} 4.0
# TYPE ray_vllm_num_requests_waiting gauge
ray_vllm_num_requests_waiting{Component="core_worker",ReplicaId="r2",WorkerId="w2",engine="0",model_name="tiny"} 5.0
# TYPE ray_vllm_kv_cache_usage_perc gauge
ray_vllm_kv_cache_usage_perc{Component="core_worker",ReplicaId="r2",WorkerId="w2",engine="0",model_name="tiny"} 0.9
# TYPE ray_vllm_prompt_tokens_total counter
ray_vllm_prompt_tokens_total{Component="core_worker",ReplicaId="r2",WorkerId="w2",engine="0",model_name="tiny"} 1200.0
# TYPE ray_vllm_prefix_cache_queries_total counter
ray_vllm_prefix_cache_queries_total{Component="core_worker",ReplicaId="r2",WorkerId="w2",engine="0",model_name="tiny"} 1200.0
# TYPE ray_vllm_prefix_cache_hits_total counter
ray_vllm_prefix_cache_hits_total{Component="core_worker",ReplicaId="r2",WorkerId="w2",engine="0",model_name="tiny"} 100.0
# TYPE ray_vllm_time_to_first_token_seconds histogram
ray_vllm_time_to_first_token_seconds_bucket{Component="core_worker",ReplicaId="r2",WorkerId="w2",engine="0",le="0.1",model_name="tiny"} 0.0
ray_vllm_time_to_first_token_seconds_bucket{Component="core_worker",ReplicaId="r2",WorkerId="w2",engine="0",le="1.0",model_name="tiny"} 10.0
ray_vllm_time_to_first_token_seconds_bucket{Component="core_worker",ReplicaId="r2",WorkerId="w2",engine="0",le="+Inf",model_name="tiny"} 10.0
ray_vllm_time_to_first_token_seconds_count{Component="core_worker",ReplicaId="r2",WorkerId="w2",engine="0",model_name="tiny"} 10.0
ray_vllm_time_to_first_token_seconds_sum{Component="core_worker",ReplicaId="r2",WorkerId="w2",engine="0",model_name="tiny"} 5.5
"""


def test_the_replicas_add_up_as_one_server_and_other_applications_are_left_out():
    snap = replicas_snapshot([NODE_A, NODE_B], {"r1", "r2"})
    assert snap is not None
    assert snap.gauges["requests_running"] == 7 and snap.gauges["requests_waiting"] == 7  # o1's 9 and 50 left out
    assert snap.gauges["kv_cache_usage"] == pytest.approx(0.9)  # the fullest replica's share, not 1.3
    assert snap.counters["prompt_tokens"] == 4000 and snap.counters["prefix_cache_hits"] == 800
    ttft = snap.histograms["server_ttft"]
    assert ttft.count == 20 and ttft.sum == pytest.approx(7.0) and ttft.buckets[0.1] == 6 and ttft.buckets[1.0] == 20


def test_one_replica_alone_and_a_level_delta_from_the_agents():
    before = replicas_snapshot([NODE_A], {"r1"})
    after = replicas_snapshot([NODE_A.replace("} 2800.0", "} 3800.0").replace("} 700.0", "} 950.0")], {"r1"})
    delta = level_delta(before, after)
    assert delta["prompt_tokens"] == 1000 and delta["prefix_cache_queries"] == 1000
    assert delta["prefix_cache_hit_rate"] == pytest.approx(0.25)


def test_gauges_only_reads_no_counter_but_the_finished_requests_and_nothing_of_the_replicas_is_none():
    gauges = replicas_snapshot([NODE_A, NODE_B], {"r1", "r2"}, gauges_only=True)
    assert gauges.counters == {} and gauges.histograms == {}
    assert gauges.gauges == {"requests_running": 7.0, "requests_waiting": 7.0, "kv_cache_usage": pytest.approx(0.9)}
    assert replicas_snapshot([NODE_A, NODE_B], {"r9"}) is None  # not exported yet (or gone)
    assert replicas_snapshot(["not { prometheus"], {"r1"}) is None


def test_only_vllms_lines_are_parsed_so_another_metric_the_parser_refuses_hides_nothing():
    """A full read parses the agent's vLLM lines only, not Ray's and Serve's own metrics around them."""
    other = '# TYPE ray_component_cpu_percentage gauge\nray_component_cpu_percentage{pid="42"} not-a-number\n'
    snap = replicas_snapshot([other + NODE_A, NODE_B + other], {"r1", "r2"})
    assert snap is not None and snap == replicas_snapshot([NODE_A, NODE_B], {"r1", "r2"})
    assert snap.counters["prompt_tokens"] == 4000.0 and snap.histograms


def test_combined_snapshots_add_histogram_buckets_and_keep_a_single_engines_values():
    one = MetricsSnapshot(gauges={"requests_waiting": 3.0, "kv_cache_usage": 0.5}, counters={"preemptions": 2.0},
                          histograms={"server_itl": Histogram(sum=1.0, count=4.0, buckets={0.01: 1.0, 0.1: 4.0})})  # fmt: skip
    assert MetricsSnapshot.combined([one]) == one
    two = MetricsSnapshot.combined([one, one])
    assert two.gauges == {"requests_waiting": 6.0, "kv_cache_usage": 0.5} and two.counters == {"preemptions": 4.0}
    assert two.histograms["server_itl"] == Histogram(sum=2.0, count=8.0, buckets={0.01: 2.0, 0.1: 8.0})


def finished(replica: str, count: float, running: float = 0.0) -> str:
    """One replica's lines as Ray's agent exports them: requests finished, and running now."""
    return (f'ray_vllm_request_success_total{{ReplicaId="{replica}",engine="0",finished_reason="stop",model_name="tiny"}} {count}\n'
            f'ray_vllm_num_requests_running{{ReplicaId="{replica}",engine="0",model_name="tiny"}} {running}\n')  # fmt: skip


def test_counts_stay_monotonic_when_serve_replaces_a_replica_or_a_node_is_not_read():
    from servetune.serve.metrics import ReplicaCounts, replica_snapshots

    counts = ReplicaCounts()
    ids = {"r1", "r2", "r3"}
    first = counts.update(replica_snapshots([finished("r1", 100, 3), finished("r2", 50, 2)], ids))
    assert first.counters["requests_finished"] == 150 and first.gauges["requests_running"] == 5
    # r2's node did not answer this time: r2 keeps its 50, its running requests are not guessed
    second = counts.update(replica_snapshots([finished("r1", 110, 1)], ids))
    assert second.counters["requests_finished"] == 160 and second.gauges["requests_running"] == 1
    # r1 died, Serve started r3 (its counters from 0): r1's 110 stay counted, so a level's delta is never negative
    third = counts.update(replica_snapshots([finished("r3", 4, 4), finished("r2", 60)], ids))
    assert third.counters["requests_finished"] == 110 + 60 + 4 and third.gauges["requests_running"] == 4
    assert level_delta(second, third)["requests_finished"] == 14
    assert ReplicaCounts().update({}) is None
    # a light read (gauges_only) carries the finished requests too, added up over the replicas
    light = replicas_snapshot([finished("r1", 100, 3), finished("r2", 50, 2)], ids, gauges_only=True)
    assert light is not None and light.counters == {"requests_finished": 150} and light.gauges["requests_running"] == 5


class ReplayedAgents:
    """A cluster whose metrics agents give one text after another (the last one from then on)."""

    def __init__(self, texts: list[str], lag_s: float = 1.5) -> None:
        self.texts, self.reads, self.lag_s = texts, 0, lag_s

    def metrics_lag_s(self) -> float:
        return self.lag_s

    def replica_ids(self, name: str) -> list[str]:
        return ["r1"]

    def metrics_texts(self) -> list[str]:
        self.reads += 1
        return [self.texts[min(self.reads, len(self.texts)) - 1]]


def test_the_first_read_waits_until_what_ran_before_the_ladder_is_counted():
    from servetune.serve.trial import ReplicaMetrics

    # the quality probe's 16 requests reach the agent over two report intervals
    agents = ReplayedAgents([finished("r1", 9), finished("r1", 16), finished("r1", 16)])
    source = ReplicaMetrics(agents, "app")
    assert source.read().counters["requests_finished"] == 16 and agents.reads == 3
    assert source.read().counters["requests_finished"] == 16 and agents.reads == 4  # later reads do not wait
    # counts that never settle: the last read after the lag
    moving = ReplayedAgents([finished("r1", n) for n in range(1, 50)], lag_s=1.5)
    start = __import__("time").monotonic()
    assert ReplicaMetrics(moving, "app").read().counters["requests_finished"] >= 2
    # Reads 0.5 s apart until the 1.5 s lag is over: up to 2 s. Waiting for counts that settle would read all 49,
    # 24 s; 10 s is between the two, with seconds to spare for a busy host (the bound was 2.5 s, 0.5 s above).
    assert __import__("time").monotonic() - start < 10.0


def test_admission_refusals_add_up_over_the_replicas_by_reason():
    """vLLM's admission counter as Ray's agents export it (renamed, labelled with the replica); a replica whose
    counter never counted exports none (Ray exports a counter once it counts)."""
    from servetune.engine.metrics import refused_text, rejections

    def refusals(replica: str, reason: str, count: float) -> str:
        return (f'ray_vllm_admission_rejections_total{{Component="core_worker",ReplicaId="{replica}",WorkerId="w",'
                f'model_name="tiny",reason="{reason}"}} {count}\n')  # fmt: skip

    head = "# TYPE ray_vllm_admission_rejections_total counter\n"
    before = replicas_snapshot([finished("r1", 10) + finished("r2", 10)], {"r1", "r2"})
    after = replicas_snapshot(
        [head + refusals("r1", "max_num_queued_reqs", 5) + refusals("r1", "max_num_queued_tokens", 30)
         + refusals("r2", "max_num_queued_tokens", 11) + refusals("o1", "max_num_queued_reqs", 99)
         + finished("r1", 20) + finished("r2", 20)], {"r1", "r2"},
    )  # fmt: skip
    by_reason = rejections(level_delta(before, after))
    assert by_reason == {"max_num_queued_reqs": 5, "max_num_queued_tokens": 41}  # the other application's 99 left out
    assert refused_text(by_reason) == "refused 46: 41 by max_num_queued_tokens, 5 by max_num_queued_reqs"
