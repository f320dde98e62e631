"""Every measured level beside its estimate and the estimate's error (trial/estimated.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servetune.estimate import load_factors
from servetune.models.tiny import TINY_CONFIG
from servetune.results import CapacityReport, TrialResult
from servetune.trial.estimated import estimate_levels

SURFACES = Path(__file__).resolve().parents[2] / "bench" / "data"


def _recorded(tmp_path: Path, name: str = "cpu-tiny-grid-r4.json", index: int = 0) -> TrialResult:
    """A recorded CPU trial, its model pointed at a local copy of the tiny model's config."""
    model = tmp_path / "tiny"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    trial = json.loads((SURFACES / name).read_text())["trials"][index]
    return TrialResult.model_validate({**trial, "model": str(model)})


def test_each_level_records_its_estimate_and_the_relative_error(tmp_path):
    result = _recorded(tmp_path)
    assert all(level.estimate is None for level in result.levels)  # recorded before schema 8: loads as it was
    estimate_levels(result, None, None)
    assert result.estimate_factors == "shipped" and result.estimate_note is None
    for level in result.levels:
        est = level.estimate
        assert est is not None and set(est.error) == {"ttft_ms", "tpot_ms", "output_throughput"}
        s = level.summary
        assert est.error["tpot_ms"] == pytest.approx(est.tpot_ms / s.tpot_ms.mean - 1)
        assert est.error["output_throughput"] == pytest.approx(est.output_throughput / s.output_throughput - 1)
    # more clients than max_num_seqs (2 here): the estimate, like the measurement, has them queue for the first token
    by_load = sorted(result.levels, key=lambda lv: lv.summary.level["concurrency"])
    assert result.engine_args["max_num_seqs"] < by_load[-1].summary.level["concurrency"]
    assert by_load[-1].estimate.ttft_ms > 5 * by_load[0].estimate.ttft_ms
    again = TrialResult.model_validate_json(result.model_dump_json())
    assert again.levels[0].estimate == result.levels[0].estimate


def test_refit_factors_change_the_estimate_and_are_named(tmp_path):
    shipped, refit = _recorded(tmp_path), _recorded(tmp_path)
    estimate_levels(shipped, None, None)
    slower = load_factors().for_class("CPU").model_copy(update={"step_overhead_ms": 30.0})
    estimate_levels(refit, None, None, slower)
    assert refit.estimate_factors == "refit"
    assert refit.levels[0].estimate.tpot_ms > shipped.levels[0].estimate.tpot_ms


def test_where_no_estimate_can_be_made_a_note_says_why_and_nothing_fails(tmp_path):
    unplanned = _recorded(tmp_path)
    unplanned.capacity = CapacityReport(fits=True, planned=False, reason="not planned: an unknown architecture")
    estimate_levels(unplanned, None, None)
    assert unplanned.estimate_note.startswith("not estimated: the memory ledger did not plan")
    assert all(level.estimate is None for level in unplanned.levels)

    on_gpu = _recorded(tmp_path).model_copy(update={"device": "gpu", "environment": {}})
    estimate_levels(on_gpu, None, None)
    assert on_gpu.estimate_note == "not estimated: no GPU named in hardware.gpu and none seen by the trial"

    unknown = _recorded(tmp_path).model_copy(update={"model": str(tmp_path / "nowhere")})
    estimate_levels(unknown, None, None)
    assert unknown.estimate_note.startswith("not estimated: ") and unknown.estimate_factors is None


def test_the_estimates_error_reaches_mlflow_and_the_report(tmp_path):
    from servetune.report.build import estimate_lines
    from servetune.results import estimate_accuracy
    from servetune.tracking.fields import study_metrics, trial_metrics

    trials = [_recorded(tmp_path, index=i) for i in range(3)]
    assert estimate_accuracy(trials) == [] and estimate_lines(trials) == ()  # results from before: nothing said
    for trial in trials:
        estimate_levels(trial, None, None)
    errors = [abs(lv.estimate.error["tpot_ms"]) for t in trials for lv in t.levels]
    (tpot,) = [a for a in estimate_accuracy(trials) if a.metric == "tpot_ms"]
    assert tpot.levels == len(errors) and tpot.worst == max(errors) and min(errors) <= tpot.median <= tpot.worst

    metrics = {(m.key, m.step): m.value for m in trial_metrics(trials[0])}
    first = trials[0].levels[0].estimate
    assert metrics[("by_level/estimate/tpot_ms", 0)] == pytest.approx(first.tpot_ms, rel=1e-3)
    assert metrics[("by_level/estimate_error/output_throughput", 0)] == pytest.approx(
        first.error["output_throughput"], rel=1e-3, abs=1e-6
    )
    study = study_metrics(trials)
    assert study["estimate_error_worst/tpot_ms"] == tpot.worst

    unplanned = _recorded(tmp_path, index=3)
    unplanned.capacity = CapacityReport(fits=True, planned=False, reason="not planned: an unknown architecture")
    estimate_levels(unplanned, None, None)
    lines = estimate_lines([*trials, unplanned])
    assert any(line.startswith("TPOT (mean): median ") for line in lines)
    assert "factors: shipped (0 trials estimated with the study's refit factors)" in lines
    assert unplanned.estimate_note in lines


def test_a_planned_estimate_before_the_trial_runs(tmp_path):
    from servetune.trial.estimated import planned_estimate

    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    args, env = {"max_model_len": 1024, "dtype": "float32", "max_num_seqs": 4}, {"VLLM_CPU_KVCACHE_SPACE": "1"}
    two = planned_estimate(str(model), "cpu", args, env, None, None, "concurrency", 2, 128, 32)
    wider = planned_estimate(
        str(model), "cpu", {**args, "data_parallel_size": 2}, env, None, None, "concurrency", 8, 128, 32
    )
    eight = planned_estimate(str(model), "cpu", args, env, None, None, "concurrency", 8, 128, 32)
    assert not isinstance(two, str) and not isinstance(eight, str) and not isinstance(wider, str)
    assert eight.saturated and not two.saturated  # 8 clients, 4 sequences at once
    assert wider.output_throughput > eight.output_throughput  # two replicas share the 8 clients
    assert planned_estimate(str(model), "gpu", args, env, None, None, "rate", 2, 128, 32) == "no hardware.gpu"
    assert isinstance(
        planned_estimate(str(tmp_path / "nowhere"), "cpu", args, env, None, None, "rate", 2, 128, 32), str
    )


def test_a_speculative_trial_is_estimated_at_the_acceptance_each_level_measured(tmp_path):
    from servetune.estimate.speculative import acceptance_for_length, accepted_length
    from servetune.metrics import SPEC_MEAN_ACCEPTED_LENGTH

    assert acceptance_for_length(accepted_length(0.7, 3), 3) == pytest.approx(0.7)
    assert (acceptance_for_length(0.9, 3), acceptance_for_length(9.0, 3)) == (0.0, 1.0)
    result = _recorded(tmp_path)
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    result.engine_args = {**result.engine_args, "speculative_config": json.dumps(config)}
    low, high = result.levels[0], result.levels[0].model_copy(deep=True)
    low.server_metrics = {**low.server_metrics, SPEC_MEAN_ACCEPTED_LENGTH: 1.2}
    high.server_metrics = {**high.server_metrics, SPEC_MEAN_ACCEPTED_LENGTH: 3.0}
    result.levels = [low, high]
    estimate_levels(result, None, None)
    assert result.estimate_note is None, result.estimate_note
    # the same load and lengths: the level that accepted more drafts is estimated at a shorter TPOT, by less than
    # the ratio of the accepted lengths (2.5) since verifying costs the same whatever is accepted
    assert low.estimate.tpot_ms / 2.5 < high.estimate.tpot_ms < low.estimate.tpot_ms / 1.5
