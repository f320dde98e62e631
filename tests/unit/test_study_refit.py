"""The study's online refit: each completed trial refits the factors the next trials are estimated with."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from servetune.estimate import load_factors
from servetune.estimate.refit import Refit
from servetune.models.tiny import TINY_CONFIG
from servetune.results import TrialResult
from servetune.study.refit import REFIT_FILE, StudyRefit, write_refit
from servetune.trial.estimated import estimate_levels

SURFACES = Path(__file__).resolve().parents[2] / "bench" / "data"


def _recorded(tmp_path: Path, name: str) -> list[TrialResult]:
    model = tmp_path / "tiny"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    trials = json.loads((SURFACES / name).read_text())["trials"]
    return [TrialResult.model_validate({**t, "model": str(model)}) for t in trials if t["outcome"] == "COMPLETE"]


def _tpot_error(result: TrialResult) -> float:
    return statistics.median(abs(lv.estimate.error["tpot_ms"]) for lv in result.levels if lv.estimate is not None)


def test_before_any_trial_the_shipped_factors_are_used_and_nothing_is_written(tmp_path):
    refit = StudyRefit(None, None)
    assert refit.efficiency() is None and refit.record() is None
    write_refit(tmp_path, refit.record())
    assert not (tmp_path / REFIT_FILE).exists()
    failed = _recorded(tmp_path, "cpu-tiny-grid.json")[0].model_copy(update={"outcome": "FAILED"})
    refit.add(failed)
    assert refit.efficiency() is None


def test_after_five_trials_on_another_host_the_next_trial_is_estimated_better(tmp_path):
    # cpu-tiny-grid.json was recorded on an Intel host in bfloat16: the shipped CPU factors (an AMD host's) miss it
    results = _recorded(tmp_path, "cpu-tiny-grid.json")
    refit = StudyRefit(None, None)
    for result in results[:5]:
        refit.add(result)
        refit.add(result)  # the same trial twice counts once
    record = refit.record()
    assert record is not None and record.trials == [r.trial_id for r in results[:5]]
    assert record.prior == load_factors().for_class("CPU") and record.efficiency != record.prior
    nxt = results[5]
    shipped, refitted = nxt.model_copy(deep=True), nxt.model_copy(deep=True)
    estimate_levels(shipped, None, None)
    estimate_levels(refitted, None, None, refit.efficiency())
    assert refitted.estimate_factors == "refit"
    assert _tpot_error(refitted) < _tpot_error(shipped)

    write_refit(tmp_path, record)
    assert Refit.model_validate_json((tmp_path / REFIT_FILE).read_text()) == record
    resumed = StudyRefit(None, None, results[:5])  # --resume: the study's finished trials, read back
    assert resumed.efficiency() == refit.efficiency()


def test_a_trial_whose_model_cannot_be_read_is_left_out(tmp_path):
    result = _recorded(tmp_path, "cpu-tiny-grid.json")[0]
    refit = StudyRefit(None, None, [result.model_copy(update={"model": str(tmp_path / "nowhere")})])
    assert refit.efficiency() is None
