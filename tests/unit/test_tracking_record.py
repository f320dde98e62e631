"""The experiment record, params and metrics of a trial run, computed from made-up results (no MLflow store)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from servetune.engine.server import free_port
from servetune.tracking import conclude, render_record, resolve_tracking_uri, unreachable_reason
from servetune.tracking.connection import mlflow_env
from servetune.tracking.fields import (
    level_tags,
    rounded,
    run_name,
    short_label,
    study_metrics,
    study_params,
    trial_metrics,
    trial_params,
)
from servetune.tracking.inputs import ModelFingerprint, model_fingerprint, read_request_stats
from servetune.tracking.record import FALLBACK_TEMPLATE, FIELDS, TEMPLATE_FILE, build_record
from tests.builders import demo_trials, level, study_info, trial

ENVIRONMENT = {
    "gpu_model": "NVIDIA H100 80GB HBM3", "gpu_count": "2", "gpu_memory_gib": "79.6", "interconnect": "NVLink",
    "cpu_model": "AMD EPYC 9654", "host_memory_gib": "1511.0", "driver": "550.54.15", "cuda": "12.4",
    "vllm": "0.11.0", "torch": "2.8.0", "ray": "2.60.0", "python": "3.11.9",
}  # fmt: skip


def rich_trial():
    """t32 of the demo study with the stack, telemetry, times and its best level filled in."""
    base = {t.trial_id: t for t in demo_trials()}["t32"]
    levels = [
        lv.model_copy(update={"telemetry": {"gpu_memory_used_gib_max": 71.5, "gpu_util_mean": 88.0}})
        for lv in base.levels
    ]
    levels[1].summary.errors_by_kind.update({"http_5xx": 3, "cancelled": 1})
    return base.model_copy(update={
        "levels": levels, "environment": ENVIRONMENT, "started_at": "2025-03-04T10:00:00+00:00",
        "finished_at": "2025-03-04T10:12:00+00:00", "best_level_index": 1,
    })  # fmt: skip


def write_requests(path: Path) -> None:
    rows = [{"level": 0, "warmup": True, "input_tokens": 9999, "prompt_tokens": 9999, "output_tokens": 9999}]
    rows += [{"level": i % 2, "warmup": False, "input_tokens": 200, "prompt_tokens": 100 + i, "output_tokens": 10 * i, "ok": True}
             for i in range(1, 101)]  # fmt: skip
    rows.append(
        {"level": 1, "warmup": False, "input_tokens": 150, "prompt_tokens": None, "output_tokens": None, "ok": False}
    )
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{cut short")


def test_params_are_the_core_engine_args_as_set_or_resolved_and_never_a_word_among_numbers():
    params = trial_params(rich_trial())
    assert params["max_num_seqs"] == "32" and params["gpu_memory_utilization"] == "0.9"
    assert params["enforce_eager"] == "true" and params["max_model_len"] == "2048"
    unset = ("tensor_parallel_size", "dtype", "quantization", "kv_cache_dtype", "block_size", "enable_prefix_caching")
    assert not set(unset) & set(params) and "default" not in params.values()
    assert params["devices"] == "1"
    resolved = rich_trial().model_copy(update={"resolved_engine_args": {
        "tensor_parallel_size": 1, "dtype": "bfloat16", "block_size": 16, "max_num_seqs": 256, "enable_prefix_caching": True,
    }})  # fmt: skip
    params = trial_params(resolved)
    assert params["tensor_parallel_size"] == "1" and params["dtype"] == "bfloat16" and params["block_size"] == "16"
    assert params["enable_prefix_caching"] == "true"
    assert params["max_num_seqs"] == "32"  # what the launch set wins over what vLLM would have chosen
    assert "quantization" not in params


def test_run_names_lead_with_the_varied_values_in_short_and_end_with_the_trial_id():
    varied = trial("abc123", {"max_num_seqs": 32, "max_num_batched_tokens": 4096, "enable_chunked_prefill": False,
                              "env.VLLM_CPU_KVCACHE_SPACE": 2})  # fmt: skip
    assert run_name(varied) == "seqs=32 mbt=4096 chunk=off kvGiB=2 · abc123"
    assert run_name(trial("base", {})) == "vLLM defaults · base"
    assert short_label({"env.HF_TOKEN": "hf_x", "api_key": "k"}) == "HF_TOKEN=*** api_key=***"


def test_cpu_trials_record_the_kv_space_and_secrets_among_varied_values_are_redacted():
    cpu = trial("c1", {"env.VLLM_CPU_KVCACHE_SPACE": 2, "max_num_seqs": 8, "env.HF_TOKEN": "hf_secret"},
                device="cpu", env={"VLLM_CPU_KVCACHE_SPACE": "2", "HF_TOKEN": "***"})  # fmt: skip
    params = trial_params(cpu)
    assert params["env.VLLM_CPU_KVCACHE_SPACE"] == "2" and "gpu_memory_utilization" not in params
    assert params["env.HF_TOKEN"] == "***" and "hf_secret" not in json.dumps(params)
    record = build_record(cpu, study_info(), None, ModelFingerprint("unknown", None), conclude(cpu, [cpu]))
    assert "hf_secret" not in render_record(record) and "hf_secret" not in json.dumps(record.all_tags())
    assert "VLLM_CPU_KVCACHE_SPACE 2" in record.fields["core_parameters"]


def test_plain_metrics_hold_the_chosen_level_and_the_by_level_series_every_level():
    metrics = trial_metrics(rich_trial())
    by_key: dict[str, dict[int, float]] = {}
    for m in metrics:
        by_key.setdefault(m.key, {})[m.step] = m.value
    assert by_key["by_level/ttft_ms_p99"] == {0: 500, 1: 1500, 2: 3000}
    assert by_key["by_level/level_concurrency"] == {0: 16, 1: 32, 2: 64}
    assert by_key["by_level/meets_slo"] == {0: 1.0, 1: 1.0, 2: 0.0}
    assert by_key["by_level/gpu_memory_used_gib_max"][1] == 71.5
    # the best level meeting the SLO is level 1 (concurrency 32): the plain names hold it, once
    assert by_key["ttft_ms_p99"] == {0: 1500} and by_key["level_concurrency"] == {0: 32}
    assert by_key["output_throughput"] == {0: 1200} and by_key["level_index"] == {0: 1}
    assert by_key["meets_slo"] == {0: 1.0} and not any(k.startswith("best_") for k in by_key)
    # 1 device x 2 USD/h / (1200 tok/s x 3600) x 1e6, to 4 significant digits
    assert by_key["cost_per_mtok_usd"][0] == pytest.approx(2 / (1200 * 3600) * 1e6, rel=1e-3)
    assert by_key["cost_per_mtok_usd"][0] == rounded(by_key["cost_per_mtok_usd"][0])
    assert by_key["levels_run"] == {0: 3}
    assert level_tags(rich_trial()) == {
        "servetune.level": "concurrency 32",
        "servetune.level_choice": "best level meeting the SLO",
        "servetune.cost_priced_by": "output_throughput",
        "servetune.goodput_window": "whole_level",
    }


def test_a_trial_that_never_met_the_slo_shows_its_last_level_and_says_so():
    broken = trial("b", {"max_num_seqs": 8}, [level(2, 100, 500, violations=("ttft_ms_p95 = 612 > 500",)),
                                             level(8, 300, 900, violations=("ttft_ms_p95 = 812 > 500",))])  # fmt: skip
    plain = {m.key: m.value for m in trial_metrics(broken) if m.step == 0 and "/" not in m.key}
    assert plain["level_concurrency"] == 8 and plain["meets_slo"] == 0.0 and plain["level_index"] == 1
    assert level_tags(broken)["servetune.level_choice"] == "highest load measured; no level met the SLO"


def test_values_are_rounded_to_four_significant_digits_and_counts_stay_exact():
    assert rounded(123.456789) == 123.5 and rounded(0.000123456) == 0.0001235 and rounded(98765.4321) == 98770
    assert rounded(1048576.0) == 1048576 and rounded(0.0) == 0.0 and rounded(-2.34567) == -2.346


def test_non_finite_values_are_left_out():
    stalled = trial("s", {}, [level(1, 0.0, 100)])  # no output: the cost is infinite
    keys = {m.key for m in trial_metrics(stalled)}
    assert "cost_per_mtok_usd" not in keys and "output_throughput" in keys
    assert all(math.isfinite(m.value) for m in trial_metrics(stalled))


def test_conclusions_keep_the_front_eliminate_failures_and_slo_breakers():
    trials = demo_trials()
    verdicts = {t.trial_id: conclude(t, trials) for t in trials}
    assert verdicts["t32"].verdict == "keep" and "cost vs P99 TTFT" in verdicts["t32"].why
    assert verdicts["t64"].verdict == "eliminate" and "CUDA out of memory" in verdicts["t64"].why
    assert verdicts["t256"].verdict == "eliminate" and "INFEASIBLE" in verdicts["t256"].why
    slow = trial("slow", {"max_num_seqs": 8}, [level(8, 300, 5000, violations=("ttft_ms_p99 = 5000 > 2000",))])
    assert conclude(slow, [*trials, slow]).verdict == "eliminate"
    assert "every load level" in conclude(slow, [*trials, slow]).why
    # dearer and slower than t32 at the same load: meets the SLO but is dominated
    dominated = trial("dom", {"max_num_seqs": 24}, [level(16, 600, 900)], devices=2)
    assert conclude(dominated, [*trials, dominated]).verdict == "next round"


def test_request_lengths_from_requests_jsonl_skip_warmup_and_broken_lines(tmp_path):
    write_requests(tmp_path / "requests.jsonl")
    stats = read_request_stats(tmp_path / "requests.jsonl")
    assert stats is not None and stats.requests == 101
    assert stats.input_tokens.p50 == 150  # prompt_tokens preferred, else input_tokens
    assert stats.output_tokens.p99 == pytest.approx(990, abs=2)  # failed requests have no output
    assert read_request_stats(tmp_path / "missing.jsonl") is None


def test_weights_fingerprint_is_names_and_sizes_and_reads_the_checkpoint_dtype(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    (model / "model-00001-of-00002.safetensors").write_bytes(b"x" * 10)
    (model / "model-00002-of-00002.safetensors").write_bytes(b"x" * 20)
    first = model_fingerprint(str(model))
    assert first.weights_hash.startswith("sha256:") and "safetensors names+sizes" in first.weights_hash
    assert first.config_dtype == "bfloat16"
    (model / "model-00002-of-00002.safetensors").write_bytes(b"x" * 21)
    assert model_fingerprint(str(model)).weights_hash != first.weights_hash
    assert model_fingerprint("no-such-org/no-such-model-xyz").weights_hash == "unknown"


def test_record_fills_every_field_of_the_template(tmp_path):
    write_requests(tmp_path / "requests.jsonl")
    t = rich_trial()
    record = build_record(t, study_info(), read_request_stats(tmp_path / "requests.jsonl"),
                          ModelFingerprint("sha256:0123456789abcdef (safetensors names+sizes)", "bfloat16"), conclude(t, demo_trials()))  # fmt: skip
    text = render_record(record)
    assert "${" not in text and TEMPLATE_FILE.is_file()
    for _, name, zh in FIELDS:
        assert f"{name} ({zh})" in text
    rows = {
        line.split("|")[1].strip(): line.split("|")[3].strip()
        for line in text.splitlines()
        if line.startswith("| ") and line.count("|") == 4
    }
    assert rows["Experiment id (实验编号)"] == "demo/t32, 2025-03-04"
    assert (
        "sha256:0123456789abcdef" in rows["Model and precision (模型与精度)"]
        and "default (checkpoint: bfloat16)" in rows["Model and precision (模型与精度)"]
    )
    assert "NVIDIA H100 80GB HBM3, count 2" in rows["Hardware (硬件)"] and "NVLink" in rows["Hardware (硬件)"]
    assert "cuda 12.4" in rows["Software stack (软件栈)"] and "nccl unknown" in rows["Software stack (软件栈)"]
    assert (
        "input tokens P50 150 /" in rows["Request distribution (请求分布)"]
        and "concurrency 16, 32, 64" in rows["Request distribution (请求分布)"]
    )
    assert (
        "max_num_seqs 32" in rows["Core parameters (核心参数)"] and "TP default" in rows["Core parameters (核心参数)"]
    )
    perf = rows["Performance (性能结果)"]
    assert "at concurrency 32 (best level meeting the SLO)" in perf and "TTFT P50 750.0 ms / P99 1,500.0 ms" in perf
    assert "GPU memory peak 71.5 GiB" in perf and "GPU utilization 88.0 %" in perf
    assert rows["Quality (质量结果)"] == "not evaluated"
    assert rows["Stability (稳定性)"].startswith("OOM no; 5xx 3; cancelled 1; P99 jitter 1.00")
    assert rows["Conclusion (结论)"].startswith("keep: on the Pareto front")
    # the same trial on two devices costs twice as much: t16 then dominates it
    dearer = t.model_copy(update={"devices": 2})
    assert conclude(dearer, demo_trials()).verdict == "next round"
    assert "| 2 | concurrency 64 | 100/100 | 3,000.0 |" in text and "breaks: ttft_ms_p99 = 3000 > 2000" in text
    tags = record.all_tags()
    assert tags["hardware.gpu_model"] == "NVIDIA H100 80GB HBM3" and tags["software.nccl"] == "unknown"
    assert tags["environment.python"] == "3.11.9" and tags["requests.output_tokens_p99"] != "unknown"
    assert tags["conclusion"] == "keep" and tags["quality"] == "not evaluated" and tags["record.date"] == "2025-03-04"


def test_record_of_failed_and_infeasible_trials():
    trials = {t.trial_id: t for t in demo_trials()}
    unknown = ModelFingerprint("unknown", None)
    failed = build_record(trials["t64"], study_info(), None, unknown, conclude(trials["t64"], list(trials.values())))
    assert failed.tags["stability.oom"] == "yes" and failed.tags["conclusion"] == "eliminate"
    assert failed.tags["hardware.gpu_model"] == "unknown" and failed.tags["requests.input_tokens_p50"] == "unknown"
    assert "not measured" in failed.fields["performance"] and "CUDA out of memory" in render_record(failed)
    infeasible = build_record(trials["t256"], None, None, unknown, conclude(trials["t256"], list(trials.values())))
    assert infeasible.tags["stability.oom"] == "not run"
    fallback = render_record(infeasible, template=FALLBACK_TEMPLATE)
    assert "${" not in fallback and "| Stability (稳定性) | OOM not run;" in fallback


def test_a_failure_that_was_the_clusters_is_tagged_and_not_held_against_the_configuration():
    from servetune.results import Failure

    busy = Failure(kind="infrastructure", cause="device_busy", evidence="Free memory on device cuda:0 ...")
    t = trial("f", {}, outcome="FAILED", reason="engine start: vLLM exited with code 1 during startup")
    t.failure, t.retried = busy, [busy, busy]
    record = build_record(t, None, None, ModelFingerprint("unknown", None), conclude(t, [t]))
    assert (record.tags["failure.kind"], record.tags["failure.cause"]) == ("infrastructure", "device_busy")
    assert record.tags["failure.retried"] == "device_busy, device_busy"
    assert record.tags["conclusion"] == "next round" and "runs again on --resume" in record.tags["conclusion.why"]
    t.failure = busy.model_copy(update={"kind": "configuration", "cause": "engine"})
    assert (
        build_record(t, None, None, ModelFingerprint("unknown", None), conclude(t, [t])).tags["conclusion"]
        == "eliminate"
    )


def test_engine_log_tail_tells_an_oom_of_a_failed_trial():
    t = trial("f", {}, outcome="FAILED", reason="the engine died during concurrency 8 (exit code -9)")
    unknown = ModelFingerprint("unknown", None)
    assert build_record(t, None, None, unknown, conclude(t, [t])).tags["stability.oom"] == "no"
    log = "INFO ...\nERROR torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.2 GiB\n"
    assert build_record(t, None, None, unknown, conclude(t, [t]), log).tags["stability.oom"] == "yes"


def test_study_params_and_summary_metrics():
    params = study_params(study_info())
    assert params["algorithm"] == "grid" and params["objectives"] == "cost_per_mtok_usd (min), ttft_ms_p99 (min)"
    assert params["slo"] == "ttft_ms_p99 <= 2000; tpot_ms_p99 <= 100" and params["price_per_device_hour"] == "2"
    metrics = study_metrics(demo_trials())
    assert metrics["trials_total"] == 4 and metrics["trials_complete"] == 2 and metrics["trials_failed"] == 1
    assert metrics["trials_infeasible"] == 1 and metrics["trials_meeting_slo"] == 2
    assert metrics["best_goodput"] == pytest.approx(1200 / 60)
    assert metrics["best_cost_per_mtok_usd"] == pytest.approx(2 / (1200 * 3600) * 1e6)


def test_tracking_uri_resolution(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert resolve_tracking_uri("sqlite:///x/db.sqlite") == f"sqlite:///{tmp_path / 'x' / 'db.sqlite'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    assert resolve_tracking_uri() == "http://mlflow.internal:5000"
    assert resolve_tracking_uri("https://other") == "https://other"


def test_a_study_s_recorded_store_is_where_later_work_logs_and_it_keeps_no_credentials(tmp_path, monkeypatch):
    from servetune.tracking.connection import study_tracking_uri, without_credentials

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env:5000")
    study = tmp_path / "study"
    study.mkdir()
    assert study_tracking_uri(study, None) == "http://env:5000"  # no study.json: as any command would
    (study / "study.json").write_text(json.dumps({"name": "s", "tracking_uri": "sqlite:////data/x.db"}))
    assert study_tracking_uri(study, None) == "sqlite:////data/x.db"  # the study's store, not the environment's
    assert study_tracking_uri(study, "http://told:5000") == "http://told:5000"  # unless told otherwise
    (study / "study.json").write_text(json.dumps({"name": "s"}))  # a study from before the field
    assert study_tracking_uri(study, None) == "http://env:5000"
    assert without_credentials("https://alice:s3cret@mlflow.example:443/") == "https://mlflow.example:443/"
    assert without_credentials("sqlite:////data/x.db") == "sqlite:////data/x.db"


def test_report_log_to_mlflow_logs_into_the_store_the_study_recorded_unless_told(tmp_path, monkeypatch):
    """``report --log-to-mlflow`` run from another directory syncs the study into the store its study.json
    recorded, not the environment's nor ``./mlflow.db``; ``--tracking-uri`` overrides it (issue #42 item 7)."""
    import shutil
    from types import SimpleNamespace

    from servetune.cli import main

    study = tmp_path / "study"
    shutil.copytree(Path(__file__).parents[1] / "data" / "cpu-tiny-study", study)
    info = json.loads((study / "study.json").read_text())
    (study / "study.json").write_text(json.dumps({**info, "tracking_uri": "sqlite:////data/recorded.db"}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env:5000")
    synced: list[str] = []

    def sync_study(study_dir, uri, report_dir=None):
        synced.append(uri)
        return SimpleNamespace(ok=True, summary=lambda: f"synced to {uri}")

    monkeypatch.setattr("servetune.tracking.sync_study", sync_study)
    assert main(["report", str(study), "--log-to-mlflow"]) == 0
    assert main(["report", str(study), "--tracking-uri", "sqlite:///told.db"]) == 0
    assert synced == ["sqlite:////data/recorded.db", f"sqlite:///{elsewhere / 'told.db'}"]
    assert list(elsewhere.iterdir()) == []


def test_a_closed_port_is_unreachable_at_once_and_local_stores_are_not_probed():
    reason = unreachable_reason(f"http://127.0.0.1:{free_port()}", timeout_s=2)
    assert reason is not None and "refused" in reason.lower()
    assert unreachable_reason("sqlite:////nowhere/mlflow.db") is None


def test_mlflow_env_bounds_retries_and_restores_what_it_set(monkeypatch):
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    with mlflow_env(bounded=True):
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "1"
        assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "5"  # the user's choice stands
        assert os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] == "true"
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ and os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "5"


def test_the_record_names_levels_whose_prefix_cache_may_have_been_warm():
    t = {x.trial_id: x for x in demo_trials()}["t32"]
    warm = t.levels[1].model_copy(update={"cache_note": "the prefix cache could not be emptied"})
    t = t.model_copy(update={"levels": [t.levels[0], warm, t.levels[2]]})
    record = build_record(t, study_info(), None, ModelFingerprint("unknown", None), conclude(t, [t]))
    assert record.tags["stability.warm_cache"] == "concurrency 32: the prefix cache could not be emptied"
    cold = {x.trial_id: x for x in demo_trials()}["t16"]
    assert (
        build_record(cold, study_info(), None, ModelFingerprint("unknown", None), conclude(cold, [cold])).tags[
            "stability.warm_cache"
        ]
        == "none"
    )


def test_capacity_its_bracket_and_the_cost_and_goodput_there_are_metrics():
    from servetune.metrics import COST_METRIC, GOODPUT
    from servetune.results import Capacity

    # Ladder 2, 8; the search went on to 4, then 6, which broke the SLO: capacity 4 clients.
    t = trial("c", {}, [level(2, 300, 400), level(8, 900, 3000, violations=("ttft",)), level(4, 560, 900),
                        level(6, 700, 2500, violations=("ttft",))])  # fmt: skip
    assert "capacity" not in {p.key for p in trial_metrics(t)}  # no search, no capacity metrics
    t.capacity_at_slo = Capacity(value=4, unit="concurrency", bracket=(4, 6), bound="exact", tolerance=0.1,
                                 verdict_noise=0.05)  # fmt: skip
    values = {p.key: p.value for p in trial_metrics(t)}
    assert (values["capacity"], values["capacity_lo"], values["capacity_hi"]) == (4, 4, 6)
    assert values["capacity_verdict_noise"] == 0.05 and t.capacity_level_index == 2
    at_capacity = t.operating_points()[2].metrics
    assert values[f"capacity/{COST_METRIC}"] == pytest.approx(at_capacity[COST_METRIC], rel=1e-3)
    assert values[f"capacity/{GOODPUT}"] == pytest.approx(560 / 60, rel=1e-3)
    # The saved view then puts the cheapest at capacity first; a study without the search, the best goodput.
    from servetune.tracking.view import runs_view

    with_capacity, without = runs_view(["max_num_seqs"], capacity=True), runs_view(["max_num_seqs"])
    assert with_capacity["orderByKey"] == f"metrics.`capacity/{COST_METRIC}`" and with_capacity["orderByAsc"] is True
    assert "metrics.`capacity_lo`" in with_capacity["selectedColumns"]
    assert without["orderByKey"] == "metrics.`goodput`" and "metrics.`capacity`" not in without["selectedColumns"]


def test_energy_per_token_and_request_are_metrics_and_a_missing_one_says_why():
    t = rich_trial()
    for index, lv in enumerate(t.levels):
        lv.telemetry = {**lv.telemetry, "gpu_energy_measured_j": 1000.0 * (index + 1)}
    by_key: dict[str, dict[int, float]] = {}
    for m in trial_metrics(t):
        by_key.setdefault(m.key, {})[m.step] = m.value
    chosen = t.levels[1].summary  # the best level meeting the SLO
    assert by_key["energy_per_token"] == {0: rounded(2000.0 / chosen.total_output_tokens)}
    assert by_key["energy_per_request"] == {0: rounded(2000.0 / chosen.completed)}
    assert set(by_key["by_level/energy_per_token"]) == {0, 1, 2}
    assert "servetune.energy_note" not in level_tags(t)
    t.levels[1].energy_note = "RAPL not readable: /sys/class/powercap absent"
    assert level_tags(t)["servetune.energy_note"] == "RAPL not readable: /sys/class/powercap absent"


def test_the_price_a_trial_was_costed_at_is_a_param_with_its_source():
    from servetune.capacity.prices import DevicePrice
    from servetune.tracking.fields import trial_params

    t = rich_trial()
    assert "price_source" not in trial_params(t)  # a result from before the price list
    t.price = DevicePrice(usd_per_device_hour=3.78, source="https://example.com/p", gpu="H100-SXM")
    params = trial_params(t)
    assert params["price_per_device_hour"] == "3.78"
    assert params["price_source"] == "H100-SXM at $3.78 per device-hour (https://example.com/p)"


def test_the_record_says_where_a_cpu_trial_ran_and_that_one_on_shared_cores_is_not_comparable():
    """engine/cores.py: a trial on cores of its own records its binding; one that claimed none records why."""
    unknown = ModelFingerprint("unknown", None)

    def hardware(environment: dict[str, str]) -> str:
        cpu = trial("c1", {}, device="cpu").model_copy(update={"environment": environment})
        return build_record(cpu, None, None, unknown, conclude(cpu, [cpu])).fields["hardware"]

    assert hardware({"cpu_binding": "3"}).startswith("CPU build, 1 core(s) reserved, bound to cores 3; CPU ")
    why = "no 1 of the 2 cores free: other engines hold their locks in /tmp/locks; vLLM binds it itself"
    shared = hardware({"cpu_unclaimed": why})
    assert shared.startswith(f"CPU build, 1 core(s) reserved (no cores of its own, measured on shared cores: {why}); ")
    assert "bound to" not in shared
    assert hardware({}).startswith("CPU build, 1 core(s) reserved; CPU ")  # a record from before cores were claimed
