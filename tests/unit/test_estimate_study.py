"""``servetune estimate SPACE --study DIR``: the estimate calibrated on a measured study first, as the report's "Which
GPU" table is (report/gpus.py ``calibration``), with each row's energy per output token and what it rests on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from servetune import cli
from servetune.capacity.hardware import find_gpu
from tests.unit.test_report_gpus import study

REPO = Path(__file__).resolve().parents[2]


def space(tmp_path: Path) -> Path:
    """offline-batch's model compared on an H100-SXM (measured by the study) and an L40S (not)."""
    doc = yaml.safe_load((REPO / "search_spaces" / "offline-batch.yaml").read_text())
    doc["params"] = {"gpu": ["H100-SXM", "L40S"], "tensor_parallel_size": [1], "max_num_seqs": [128]}
    doc["constraints"] = []
    doc["hardware"].pop("gpu")
    doc.pop("price_per_device_hour", None)
    path = tmp_path / "types.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def estimate(capsys, *args: str) -> dict:
    assert cli.main(["estimate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def with_energy(loaded, share: float, pace: float = 1.0) -> Path:
    """The study rewritten with every measured level drawing ``share`` of its GPU's board power limit over its
    window (NVML's counter), and serving ``pace`` times the tokens and requests a second it was built with."""
    for t in loaded.trials:
        limit = find_gpu(t.params["gpu"]).perf.tdp_w
        for lv in t.levels:
            s = lv.summary = lv.summary.model_copy(update={"output_throughput": lv.summary.output_throughput * pace,
                                                           "request_throughput": lv.summary.request_throughput * pace})  # fmt: skip
            lv.telemetry = {"gpu_energy_measured_j": share * limit * s.total_output_tokens / s.output_throughput}
        (loaded.root / "trials" / t.trial_id / "result.json").write_text(t.model_dump_json(indent=2))
    return loaded.root


def rows_of(report: dict) -> dict[str, dict]:
    return {json.dumps([r["params"], r["level"]], sort_keys=True): r for r in report["rows"] if "estimate" in r}


# The study's recommended type at its capacity load (report/gpus.py) is what the rows are calibrated on: the H200's
# 32 clients measured at half the model's output tok/s, or at four times it.
@pytest.mark.parametrize(("h200_scale", "pace", "direction"), [(1.0, 0.5, "slower"), (4.0, 1.0, "faster")])
def test_rows_move_by_the_studys_measured_error_and_draw_its_power_share(tmp_path, capsys, h200_scale, pace, direction):
    path = space(tmp_path)
    plain = rows_of(estimate(capsys, str(path)))
    root = with_energy(study(tmp_path, h200_scale), 0.5, pace)
    report = estimate(capsys, str(path), "--study", str(root))
    cal = report["calibration"]
    measured = ("H200", 2600 * h200_scale * pace)
    assert (cal["gpu"], cal["measured_output_throughput"]) == measured
    error = cal["measured_output_throughput"] / cal["estimated_output_throughput"]
    assert (error < 0.7) if direction == "slower" else (error > 1.5)  # the rows must move that way
    calibrated = rows_of(report)
    assert calibrated.keys() == plain.keys() and calibrated
    for key, row in calibrated.items():
        raw = plain[key]["estimate"]["output_throughput"]
        assert row["estimate"] == plain[key]["estimate"]  # the model's own numbers are kept beside the calibrated
        assert row["calibrated"]["output_throughput"] == pytest.approx(raw * error)  # in the measured direction
        assert row["cost_per_mtok_usd"] == pytest.approx(plain[key]["cost_per_mtok_usd"] / error)
        # half the measured GPU's limit, drawn at half of this row's GPU's limit over its calibrated tokens
        limit = find_gpu(row["params"]["gpu"]).perf.tdp_w
        assert row["joules_per_token_basis"] == "measured_power_share"
        assert row["joules_per_token"] == pytest.approx(0.5 * limit / (raw * error))
        # without a study: the GPU's whole limit over the model's tokens, an upper bound
        assert plain[key]["joules_per_token_basis"] == "board_power_limit"
        assert plain[key]["joules_per_token"] == pytest.approx(limit / raw)
    assert cal["power_share"] == pytest.approx(0.5) and report["expected_error"]["output_throughput"] > 0
    assert "measured share of its board power limit, 50%" in report["energy"]
    assert cli.main(["estimate", str(path), "--study", str(root)]) == 0
    table = capsys.readouterr().out
    assert f"calibrated on {root}: {measured[0]}'s best configuration" in table
    assert "J/token estimated ±" in table and "<=" not in table.split("J/token", 2)[-1]


def test_without_a_measured_energy_each_row_keeps_the_power_limits_upper_bound_and_says_so(tmp_path, capsys):
    path = space(tmp_path)
    report = estimate(capsys, str(path), "--study", str(study(tmp_path).root))
    assert {r["joules_per_token_basis"] for r in rows_of(report).values()} == {"board_power_limit"}
    assert "an upper bound" in report["energy"] and "measured no GPU energy" in report["energy"]
    assert cli.main(["estimate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "J/token" in out and "<=" in out and "upper bound" in out


def test_a_bad_study_is_one_line_naming_it(tmp_path, capsys):
    path = space(tmp_path)
    for bad, words in ((tmp_path / "nowhere", "no such study directory"), (path, "not a directory")):
        assert cli.main(["estimate", str(path), "--study", str(bad)]) == 2
        err = capsys.readouterr().err
        assert str(bad) in err and words in err and err.count("\n") == 1 and "Traceback" not in err


def test_the_studys_own_gpu_class_is_estimated_with_the_factors_it_refitted_the_others_by_the_ratio(tmp_path, capsys):
    from servetune.estimate import load_factors
    from servetune.estimate.refit import Refit
    from servetune.study.refit import REFIT_FILE

    path = space(tmp_path)
    plain = rows_of(estimate(capsys, str(path)))
    root = with_energy(study(tmp_path, 1.0), 0.5, 0.5)  # the H200's point measured at half the model's tok/s
    prior = load_factors().for_class("H100")
    slower = prior.model_copy(update={"decode_bandwidth": prior.decode_bandwidth / 2})  # as a study of H100s refits
    record = Refit(gpu_class="H100", prior=prior, prior_points=5.0, points=12, trials=["h100"], efficiency=slower)
    (root / REFIT_FILE).write_text(record.model_dump_json())
    report = estimate(capsys, str(path), "--study", str(root))
    error = report["calibration"]["scale_output_throughput"]
    assert report["refit"]["gpu_class"] == "H100" and report["refit"]["points"] == 12
    for key, row in rows_of(report).items():
        raw = plain[key]["estimate"]
        if row["params"]["gpu"] == "H100-SXM":  # the refit's slower decode: TPOT too, and no ratio on top
            assert row["calibrated"]["by"] == "refit" and row["estimate"]["tpot_ms"] > 1.3 * raw["tpot_ms"]
            assert row["calibrated"]["output_throughput"] == row["estimate"]["output_throughput"]
            assert row["estimate"]["output_throughput"] < raw["output_throughput"] / 1.3
        else:  # the L40S: the shipped factors and the measured ratio, as before
            assert row["calibrated"]["by"] == "measured_ratio" and row["estimate"] == raw
            assert row["calibrated"]["output_throughput"] == pytest.approx(raw["output_throughput"] * error)
    assert cli.main(["estimate", str(path), "--study", str(root)]) == 0
    assert "refit: H100 GPUs' rows use the factors the study refitted" in capsys.readouterr().out
    (root / REFIT_FILE).write_text("{}")
    assert cli.main(["estimate", str(path), "--study", str(root)]) == 2
    err = capsys.readouterr().err
    assert str(root / REFIT_FILE) in err and err.count("\n") == 1 and "Traceback" not in err


def test_the_reports_estimated_rows_of_the_refitted_class_take_the_studys_refit_as_estimate_study_does(tmp_path):
    from servetune.estimate import load_factors
    from servetune.estimate.refit import Refit
    from servetune.estimate.specs import gpu_class
    from servetune.report import build_report, load_study
    from servetune.study.refit import REFIT_FILE

    root = with_energy(study(tmp_path, 1.0), 0.5)
    before = {r.gpu: r for r in build_report(load_study(root)).which_gpu.rows if r.estimated and r.request_rate}
    refitted = "A100" if any(gpu_class(g) == "A100" for g in before) else gpu_class(next(iter(before)))
    prior = load_factors().for_class(refitted)
    slower = prior.model_copy(update={"decode_bandwidth": prior.decode_bandwidth / 2})
    record = Refit(gpu_class=refitted, prior=prior, prior_points=5.0, points=12, trials=["a", "b"], efficiency=slower)
    (root / REFIT_FILE).write_text(record.model_dump_json())
    after = {r.gpu: r for r in build_report(load_study(root)).which_gpu.rows if r.estimated and r.request_rate}
    assert set(after) == set(before)
    mine = [g for g in after if gpu_class(g) == refitted]
    assert mine and len(mine) < len(after)
    for gpu, row in after.items():
        if gpu in mine:  # the refit's own factors, with no measured ratio on top: slower decode, fewer requests
            assert row.request_rate < before[gpu].request_rate and "refitted on 12 measured values of 2" in row.note
        else:  # every other class: the shipped factors and the measured ratio, as before
            assert row == before[gpu]
