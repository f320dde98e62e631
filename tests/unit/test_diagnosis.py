"""What limited a trial (report/diagnosis.py): each rule on a recorded result changed to show its symptom, and a
healthy recorded trial with no finding."""

from __future__ import annotations

import html
from pathlib import Path
from types import SimpleNamespace

import pytest

from servetune.cli.verify import opening_lines
from servetune.report import build_report, load_study, render_markdown
from servetune.report.diagnosis import RULES, diagnose, limit_level, limited_by
from servetune.report.html import render_html
from servetune.results import TrialResult, read_result
from servetune.tracking.fields import LIMITED_BY_TAG, diagnosis_tags

RECORDED = Path(__file__).parents[1] / "data" / "cpu-tiny-study" / "trials"


def recorded(trial_id: str) -> TrialResult:
    result = read_result(RECORDED / trial_id)
    assert result is not None
    return result


def climbing() -> TrialResult:
    """A recorded ladder (CPU build, max_num_seqs not set): concurrency 2 and 8 met the SLO, 32 broke TTFT P95."""
    return recorded("e57a166985b8")


def healthy() -> TrialResult:
    """The same trial without the level that broke the SLO: two levels, both within it, nothing queued."""
    trial = climbing()
    return trial.model_copy(update={"levels": trial.levels[:2]})


def with_engine_args(trial: TrialResult, **args: object) -> TrialResult:
    return trial.model_copy(update={"engine_args": {**trial.engine_args, **args}})


def with_server(trial: TrialResult, index: int, **values: float) -> TrialResult:
    levels = [lv.model_copy(deep=True) for lv in trial.levels]
    levels[index].server_metrics.update(values)
    return trial.model_copy(update={"levels": levels})


def rules_of(trial: TrialResult) -> list[str]:
    return [finding.rule for finding in diagnose(trial)]


def test_a_healthy_trial_has_no_finding():
    trial = healthy()
    assert all(not lv.slo_violations for lv in trial.levels)
    assert diagnose(trial) == []
    assert limited_by(trial) == "no limit found in what was recorded at concurrency 8"


def test_the_limit_level_is_the_first_to_break_the_slo_else_the_highest_load():
    assert limit_level(climbing()) == 2
    assert limit_level(healthy()) == 1
    reordered = healthy().model_copy(update={"levels": list(reversed(healthy().levels))})
    assert limit_level(reordered) == 0  # the highest load, wherever it was measured


def test_rules_run_in_the_checklists_order():
    names = [rule.__name__ for rule in RULES]
    assert names == ["client_bound", "client_stalled", "admission_refused", "gpu_idle", "frontend_bound", "batch_full", "scheduler_budget", "kv_bound", "prefix_hits_lost",
                     "prefill_queueing", "decode_slowdown", "tail_latency"]  # fmt: skip


def with_level(trial: TrialResult, index: int, **fields: object) -> TrialResult:
    levels = [lv.model_copy(deep=True) for lv in trial.levels]
    levels[index] = levels[index].model_copy(update=fields)
    return trial.model_copy(update={"levels": levels})


def test_a_client_that_fell_behind_comes_first_at_the_lowest_load_it_fell_behind_at():
    lag = "requests sent 180 ms late at the median (bound 50 ms)"
    trial = with_level(climbing(), 2, client_bound="the client process used 95% of a core (bound 90%)",
                       client_cpu_share=0.95)  # fmt: skip
    trial = with_level(trial, 1, client_bound=lag, send_lag_ms_p50=180.0, send_lag_ms_p99=400.0)
    findings = diagnose(trial)
    assert findings[0].rule == "client_bound" and findings[0].level == "concurrency 8"
    assert findings[0].symptom == f"the load client fell behind at concurrency 8: {lag}"
    assert findings[0].evidence == {"send_lag_ms_p50": 180.0, "send_lag_ms_p99": 400.0}
    assert limited_by(trial).startswith("the load client fell behind at concurrency 8") and "client_processes" in (
        limited_by(trial)
    )
    assert "client_bound" not in rules_of(climbing())  # the recorded client kept up


def test_requests_vllms_admission_bounds_refused_come_before_the_engines_rules():
    """The recorded trial at concurrency 32 (TTFT P95 broke) with vLLM's own count of 53 refusals there: the bounds
    admitted more than the engine served within the SLO; at concurrency 8 (met it) the bound set what was served."""
    refused = {"admission_rejections_max_num_queued_reqs": 12.0, "admission_rejections_max_num_queued_tokens": 41.0}
    findings = diagnose(with_server(climbing(), 2, **refused))
    assert findings[0].rule == "admission_refused" and findings[0].evidence == refused
    assert findings[0].symptom == (
        "vLLM's admission bounds refused 53: 41 by max_num_queued_tokens, 12 by max_num_queued_reqs at concurrency 32"
    )
    assert "tighten them, max_num_queued_tokens first" in findings[0].lever and "ttft_ms_p95" in findings[0].lever
    met = diagnose(with_server(healthy(), 1, **refused))
    assert met[0].rule == "admission_refused" and "loosen max_num_queued_tokens" in met[0].lever
    # none refused (vLLM writes both reasons from its start), or not counted: no finding
    assert "admission_refused" not in rules_of(with_server(climbing(), 2, **dict.fromkeys(refused, 0.0)))
    assert "admission_refused" not in rules_of(climbing())


def test_a_front_end_near_a_full_core_while_the_engine_had_room_is_front_end_bound():
    """The recorded trial at concurrency 32 ran at most 7 requests in the engine with nothing waiting: with its API
    server at 97% of a core, the front end held the rest."""
    trial = with_level(climbing(), 2, frontend_cpu_share=0.97)
    findings = diagnose(trial)
    assert findings[0].rule == "frontend_bound"
    assert findings[0].symptom == (
        "front end CPU-bound at concurrency 32: the API server used 97% of a core while the engine ran 7 and nothing "
        "waited"
    )
    assert "raise --api-server-count" in findings[0].lever and "vLLM default" in findings[0].lever
    assert findings[0].evidence == {
        "frontend_cpu_share": 0.97,
        "requests_running_max": 7.0,
        "requests_waiting_max": 0.0,
    }
    assert limited_by(trial).startswith("front end CPU-bound at concurrency 32")
    two = with_engine_args(with_engine_args(trial, api_server_count=2), max_num_seqs=16)
    assert "now 2" in diagnose(two)[0].lever and "ran 7 of 16" in diagnose(two)[0].symptom


@pytest.mark.parametrize(
    "process, named, lever",
    [
        ("replica", "the LLM replica's process", "more replicas (serve.num_replicas)"),
        ("proxy", "Serve's HTTP proxy", "more of Serve's proxies"),
        ("ingress", "Serve's ingress replica", "more ingress replicas"),
    ],
)
def test_a_serve_trials_busy_front_end_names_its_process_and_serves_lever(process, named, lever):
    """A Serve trial records which of its front-end processes was the busiest (serve/frontend.py); the rule, its
    conditions unchanged, names that process and Serve's lever for it, not vLLM's API server's."""
    trial = with_level(climbing(), 2, frontend_cpu_share=0.97, frontend_process=process)
    (finding,) = [f for f in diagnose(trial) if f.rule == "frontend_bound"]
    assert finding.symptom.startswith(f"front end CPU-bound at concurrency 32: {named}")
    assert "97% of a core" in finding.symptom and lever in finding.lever and "api-server-count" not in finding.lever


@pytest.mark.parametrize(
    "share, server, args",
    [
        (None, {}, {}),  # not recorded (bench --url, an older result)
        (0.5, {}, {}),  # the front end had CPU to spare
        (0.97, {"requests_waiting_max": 3.0}, {}),  # requests waited in the engine: the engine was the limit
        (0.97, {}, {"max_num_seqs": 7}),  # every sequence slot ran
        (0.97, {"kv_cache_usage_max": 0.95}, {}),  # the KV cache was full
        (0.97, {"preemptions": 2.0}, {}),
    ],
)
def test_a_busy_front_end_is_not_the_limit_where_the_engine_was_saturated(share, server, args):
    trial = with_engine_args(with_server(with_level(climbing(), 2, frontend_cpu_share=share), 2, **server), **args)
    assert "frontend_bound" not in rules_of(trial)


def test_prefix_hits_that_fell_with_load_were_lost_to_it():
    trial = with_server(with_server(climbing(), 0, prefix_cache_hit_rate=0.6), 2, prefix_cache_hit_rate=0.1,
                        kv_cache_usage_max=0.97)  # fmt: skip
    (finding,) = [f for f in diagnose(trial) if f.rule == "prefix_hits_lost"]
    assert (
        finding.symptom
        == "prefix-cache hits fell from 60% at concurrency 2 to 10% at concurrency 32, KV cache peak 97%"
    )
    assert finding.evidence["prefix_cache_hit_rate_lowest_load"] == 0.6 and "route requests by prefix" in finding.lever
    # Kept more than half of them, or shared next to nothing to begin with: not lost to the load.
    kept = with_server(with_server(climbing(), 0, prefix_cache_hit_rate=0.6), 2, prefix_cache_hit_rate=0.35)
    few = with_server(with_server(climbing(), 0, prefix_cache_hit_rate=0.1), 2, prefix_cache_hit_rate=0.0)
    assert "prefix_hits_lost" not in rules_of(kept) + rules_of(few) + rules_of(climbing())


@pytest.mark.parametrize("waiting, says", [(0.0, "check the load is enough"), (6.0, "raise max_num_seqs")])
def test_an_idle_gpu_says_whether_requests_queued(waiting: float, says: str):
    trial = with_server(healthy().model_copy(update={"device": "gpu"}), 1, requests_waiting_max=waiting)
    trial.levels[1].telemetry["gpu_util_mean"] = 23.0
    findings = diagnose(trial)
    assert findings[0].rule == "gpu_idle"
    assert findings[0].evidence["gpu_util_mean"] == 23.0
    assert "23%" in findings[0].symptom and says in findings[0].lever


def test_a_busy_gpu_or_a_cpu_host_is_not_idle():
    trial = healthy().model_copy(update={"device": "gpu"})
    trial.levels[1].telemetry["gpu_util_mean"] = 91.0
    assert "gpu_idle" not in rules_of(trial)
    host = healthy()  # the CPU build: no GPU utilization recorded, so nothing said
    assert "gpu_idle" not in rules_of(host)


def test_a_full_batch_with_kv_to_spare_asks_for_more_sequences():
    trial = with_engine_args(healthy(), max_num_seqs=8)  # concurrency 8 ran 8 at once
    level = trial.levels[1]
    finding = diagnose(trial)[0]
    assert finding.rule == "batch_full" and finding.level == "concurrency 8"
    assert finding.evidence["requests_running_max"] == level.server_metrics["requests_running_max"] == 8
    assert finding.evidence["kv_cache_usage_max"] == level.server_metrics["kv_cache_usage_max"]
    assert "raise max_num_seqs" in finding.lever
    assert limited_by(trial).startswith("decode-bound at concurrency 8: 8 running = max_num_seqs 8 with KV cache at 0%")


def test_a_full_batch_counts_every_data_parallel_engine():
    trial = with_engine_args(healthy(), max_num_seqs=8, data_parallel_size=2)  # 16 slots, 8 used
    assert "batch_full" not in rules_of(trial)


def test_a_full_batch_counts_every_replica_of_a_deployment_through_serve():
    """Through Serve the gauges are the replicas' added up (engine/metrics.py): 8 running on 2 replicas of
    max_num_seqs 8 left half the slots free."""
    trial = with_engine_args(healthy(), max_num_seqs=8).model_copy(update={"serve": {"replicas": 2}})
    assert "batch_full" not in rules_of(trial)
    assert rules_of(with_server(trial, 1, requests_running_max=16.0)) == ["batch_full"]


def test_a_level_where_nothing_was_read_of_the_engine_is_not_diagnosed_rather_than_found_healthy():
    trial = healthy()
    levels = [lv.model_copy(update={"server_metrics": {"requests_finished": 50.0}}) for lv in trial.levels]
    bare = trial.model_copy(update={"levels": levels})
    assert limited_by(bare) == (
        "not diagnosed: at concurrency 8 nothing was read of the engine: no vLLM gauges or counters (requests "
        "running and waiting, KV cache usage, preemptions: /metrics), no front-end CPU, no GPU utilization"
    )
    shared = with_level(bare, 1, frontend_cpu_share=0.2)  # the front end's CPU alone is something read
    assert limited_by(shared) == "no limit found in what was recorded at concurrency 8"


def test_the_batch_rules_say_nothing_where_max_num_seqs_was_not_recorded():
    trial = with_server(healthy(), 1, requests_waiting_max=5.0)
    assert "max_num_seqs" not in trial.engine_args and not trial.resolved_engine_args
    assert rules_of(trial) == []


def test_the_resolved_max_num_seqs_counts_where_the_launch_left_it_to_vllm():
    trial = healthy().model_copy(update={"resolved_engine_args": {"max_num_seqs": 8}})
    assert rules_of(trial) == ["batch_full"]


def test_requests_waiting_with_free_slots_point_at_the_token_budget():
    trial = with_server(with_engine_args(healthy(), max_num_seqs=32, max_num_batched_tokens=256), 1,
                        requests_waiting_max=5.0)  # fmt: skip
    finding = diagnose(trial)[0]
    assert finding.rule == "scheduler_budget"
    assert finding.evidence["requests_waiting_max"] == 5.0 and finding.evidence["max_num_seqs"] == 32
    assert "raise max_num_batched_tokens (now 256)" in finding.lever


def test_preemptions_or_a_full_kv_cache_are_kv_bound_not_the_budget():
    trial = with_server(with_engine_args(healthy(), max_num_seqs=32), 1, preemptions=14.0, requests_waiting_max=5.0)
    finding = diagnose(trial)[0]
    assert finding.rule == "kv_bound" and finding.evidence["preemptions"] == 14.0
    assert "gpu_memory_utilization" in finding.lever and "kv_cache_dtype fp8" in finding.lever
    full = with_server(healthy(), 1, kv_cache_usage_max=0.96, requests_waiting_max=5.0)
    assert rules_of(with_engine_args(full, max_num_seqs=32)) == ["kv_bound"]
    assert "KV cache peak 96%" in diagnose(full)[0].symptom


def test_ttft_growing_while_tpot_stays_flat_is_prefill_queueing():
    trial = climbing()
    low, limit = trial.levels[0].summary, trial.levels[2].summary
    finding = diagnose(trial)[0]
    assert finding.rule == "prefill_queueing" and finding.level == "concurrency 32"
    assert finding.evidence["ttft_growth"] == pytest.approx(limit.ttft_ms.mean / low.ttft_ms.mean)
    assert finding.evidence["tpot_growth"] == pytest.approx(limit.tpot_ms.mean / low.tpot_ms.mean)
    assert "max_num_batched_tokens" in finding.lever and "enable chunked prefill" not in finding.lever
    off = with_engine_args(trial, enable_chunked_prefill=False)
    assert diagnose(off)[0].lever.startswith("enable chunked prefill")


def test_a_level_within_the_slo_is_not_called_queueing_however_ttft_grew():
    trial = climbing()
    levels = [lv.model_copy(deep=True) for lv in trial.levels]
    levels[2].slo_violations = []
    assert "prefill_queueing" not in rules_of(trial.model_copy(update={"levels": levels}))


def test_tpot_growing_while_ttft_stays_flat_is_a_decode_slowdown():
    trial = climbing()
    levels = [lv.model_copy(deep=True) for lv in trial.levels]
    low, top = levels[0].summary, levels[2].summary
    top.ttft_ms.mean = low.ttft_ms.mean * 1.2
    top.tpot_ms.mean = low.tpot_ms.mean * 3.0
    levels[2].slo_violations = [f"tpot_ms_p95 = {top.tpot_ms.p95:.4g} > 20"]
    finding = diagnose(trial.model_copy(update={"levels": levels}))[0]
    assert finding.rule == "decode_slowdown"
    assert finding.evidence["tpot_growth"] == pytest.approx(3.0) and finding.evidence["ttft_growth"] == pytest.approx(
        1.2
    )
    assert "max_num_seqs" in finding.lever


def test_a_p99_far_from_the_median_is_a_tail_and_rules_out_what_was_recorded_absent():
    trial = recorded("46f77bcabf05")  # broke TTFT P99 at concurrency 2, P99 18x its P50, no preemption
    level = trial.levels[0]
    finding = diagnose(trial)[-1]
    assert finding.rule == "tail_latency"
    assert finding.evidence["ttft_ms_p99_over_p50"] == pytest.approx(
        level.summary.ttft_ms.p99 / level.summary.ttft_ms.p50
    )
    assert "preemption" not in finding.lever  # recorded: none, and the KV cache nearly empty
    preempted = with_server(trial, 0, preemptions=3.0)
    assert "preemption" in diagnose(preempted)[-1].lever


def test_a_tail_with_the_gpu_clock_down_names_the_clock():
    trial = recorded("46f77bcabf05").model_copy(update={"device": "gpu"})
    first = trial.levels[0].model_copy(deep=True)
    first.slo_violations, first.summary.level = [], {"concurrency": 1.0}
    first.telemetry["gpu_sm_clock_mhz_mean"] = 1980.0
    trial.levels[0].telemetry["gpu_sm_clock_mhz_mean"] = 1400.0
    finding = diagnose(trial.model_copy(update={"levels": [first, *trial.levels]}))[-1]
    assert finding.evidence["gpu_sm_clock_mhz_mean"] == 1400.0
    assert "GPU clock down to 1400 MHz (from 1980)" in finding.lever


def test_trials_that_did_not_complete_are_not_diagnosed():
    failed = healthy().model_copy(update={"outcome": "FAILED", "reason": "engine exited"})
    assert diagnose(failed) == [] and limited_by(failed) == "not diagnosed: FAILED"
    empty = healthy().model_copy(update={"levels": []})
    assert limited_by(empty) == "not diagnosed: no level completed a request"


def test_the_report_shows_what_limited_each_complete_trial():
    report = build_report(load_study(RECORDED.parent))
    rows = {row.trial_id: row for row in report.trial_table}
    assert rows["e57a166985b8"].limited_by == limited_by(climbing())
    assert rows["e57a166985b8"].limited_by.startswith("prefill queueing: TTFT mean grew")
    md, page = render_markdown(report), render_html(report)
    assert "### What limited each trial" in md and "What limited each trial" in page
    for row in report.trial_table:
        line = f"trial {row.trial_id}: {row.limited_by}"
        assert (f"- {line}" in md) == (row.outcome == "COMPLETE")
        assert (html.escape(line) in page) == (row.outcome == "COMPLETE")


def test_a_trial_broken_at_its_only_level_asks_for_a_lower_load():
    trial = recorded("18ae6e731937")  # one level, concurrency 2, broke TTFT P95; nothing else stood out
    assert len(trial.levels) == 1 and trial.levels[0].slo_violations
    assert diagnose(trial) == []
    assert limited_by(trial).startswith("SLO broken at the lowest load measured (concurrency 2)")


def test_mlflow_tags_say_what_limited_the_trial_and_every_rule_that_found_something():
    trial = with_server(with_engine_args(climbing(), max_num_seqs=8), 1, preemptions=2.0)
    trial.levels[2].server_metrics["preemptions"] = 9.0
    tags = diagnosis_tags(trial)
    assert tags[LIMITED_BY_TAG] == limited_by(trial) and tags[LIMITED_BY_TAG].startswith("KV-bound at concurrency 32")
    assert tags["servetune.findings"] == "kv_bound, prefill_queueing"
    assert diagnosis_tags(healthy()) == {LIMITED_BY_TAG: "no limit found in what was recorded at concurrency 8"}


def test_verify_says_what_limited_the_trial_it_starts_again():
    trial = climbing()
    winner = SimpleNamespace(trial_id=trial.trial_id, level="concurrency 8", result=trial,
                             spec=SimpleNamespace(serve_replicas=None), operating=None, admission=None)  # fmt: skip
    selection = SimpleNamespace(winner=winner, runner_up=SimpleNamespace(trial_id="8aede7346995"))
    lines = opening_lines(selection, runner_up=True)
    assert lines == [f"verifying trial {trial.trial_id} at concurrency 8; runner-up: trial 8aede7346995",
                     f"in the study, what limited it: {limited_by(trial)}", "admission bounds: none (not derived)"]  # fmt: skip
    assert opening_lines(selection, runner_up=False)[0] == f"verifying trial {trial.trial_id} at concurrency 8"
