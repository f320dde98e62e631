"""The report's "which GPU" section (report/gpus.py): each GPU type's best configuration and what serving on
it costs, estimated rows for catalogue GPUs not measured, and the type recommended."""

import html
import math

import pytest

from servetune.capacity.prices import DevicePrice, Price, load_price_table
from servetune.errors import UserError
from servetune.estimate import load_factors
from servetune.report import build_report, load_study, render_markdown
from servetune.report.html import render_html
from tests.builders import level, study_info, trial, write_study

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # in the catalogue: the estimate can price other GPUs


def on(gpu: str, trial_id: str, levels, extra: dict | None = None):
    t = trial(trial_id, {"gpu": gpu, **(extra or {})}, levels)
    t.model = MODEL
    t.engine_args = {k: v for k, v in t.engine_args.items() if k != "gpu"}  # as engine_params leaves it out
    listed = load_price_table()[gpu]
    t.price = DevicePrice(
        usd_per_device_hour=listed.usd_per_device_hour, source=listed.source, date=listed.date, gpu=gpu
    )
    t.price_per_device_hour = listed.usd_per_device_hour
    return t


BROKEN = ("ttft_ms_p99 <= 2000",)


def study(tmp_path, h200_scale: float = 1.0, **info):
    trials = [
        on("H100-SXM", "h100", [level(8, 900, 300), level(16, 1500, 900), level(32, 1600, 4000, violations=BROKEN)]),
        on("H200", "h200", [level(8, 1000 * h200_scale, 250), level(16, 1900 * h200_scale, 600),
                            level(32, 2600 * h200_scale, 1500)]),
        on("H200", "h200s", [level(8, 700, 400), level(16, 800, 3000, violations=BROKEN)], {"max_num_seqs": 8}),
    ]  # fmt: skip
    for t in trials:  # 64 output tokens a request whatever the pace: the same load for the estimate
        for lv in t.levels:
            lv.summary = lv.summary.model_copy(update={"total_output_tokens": 6400})
    return load_study(write_study(tmp_path / f"s{h200_scale}", study_info(model=MODEL, **info), trials))


def test_each_measured_type_has_its_best_configuration_at_its_capacity_with_its_price(tmp_path):
    section = build_report(study(tmp_path), target_rps=100).which_gpu
    rows = {r.gpu: r for r in section.rows if not r.estimated}
    assert set(rows) == {"H100-SXM", "H200"}
    assert rows["H100-SXM"].trial_id == "h100" and rows["H100-SXM"].capacity == "concurrency 16"  # 32 broke the SLO
    assert rows["H200"].trial_id == "h200" and rows["H200"].capacity == "concurrency 32"
    for gpu, tput in (("H100-SXM", 1500), ("H200", 2600)):
        row, price = rows[gpu], load_price_table()[gpu].usd_per_device_hour
        assert row.usd_per_device_hour == price and row.request_rate == pytest.approx(tput / 60)
        assert row.cost_per_mtok == pytest.approx(price / (tput * 3600) * 1e6)
        assert row.replicas == math.ceil(100 / (tput / 60)) and row.fleet_usd_per_hour == pytest.approx(
            row.replicas * price
        )
    cheapest = min(rows.values(), key=lambda r: r.fleet_usd_per_hour)
    assert section.choice == cheapest.gpu and section.why.startswith(f"{cheapest.gpu}: {cheapest.replicas} replica(s)")


def test_unmeasured_catalogue_gpus_are_estimated_calibrated_on_the_measured_type_and_never_recommended(tmp_path):
    one = build_report(study(tmp_path)).which_gpu
    estimated = {r.gpu: r for r in one.rows if r.estimated}
    priced = set(load_price_table()) - {"H100-SXM", "H200"}
    assert set(estimated) <= priced and len(estimated) >= 3
    error = load_factors().held_out_error["output_throughput"].median
    assert all(r.expected_error == error for r in estimated.values())
    assert one.choice in ("H100-SXM", "H200")
    # The calibration: the measured type twice as fast makes every estimated row's cost half (where it fits).
    two = {r.gpu: r for r in build_report(study(tmp_path, 2.0)).which_gpu.rows if r.estimated}
    if one.choice == "H200":
        costed = [g for g, r in estimated.items() if r.cost_per_mtok is not None]
        assert costed and all(two[g].cost_per_mtok == pytest.approx(estimated[g].cost_per_mtok / 2) for g in costed)
    loaded = study(tmp_path / "again")
    fifty = build_report(loaded, target_rps=50)  # with a target the choice is the cheapest fleet, not $/Mtok
    md = render_markdown(fifty)
    assert "## Which GPU for 50 req/s" in md and f"estimated ±{error:.0%}" in md
    assert f"Recommended: {fifty.which_gpu.choice}" in md
    page = render_html(build_report(loaded))
    assert "<h2 id='which-gpu'>Which GPU</h2>" in page and "--target-rps" in page
    for gpu in estimated:  # each estimated row's price is cited: the shipped one, its source and the date read
        price = load_price_table()[gpu]
        cited = f"{gpu} at ${price.usd_per_device_hour:g} per device-hour ({price.provider}: {price.source}, read {price.date})"
        assert cited in md and html.escape(cited) in page


def test_estimated_rows_are_priced_from_the_study_s_price_list_under_its_own_prices(tmp_path):
    aws = load_price_table("aws")
    own = Price(usd_per_device_hour=0.5, source="our contract", date="2026-12-01")
    estimated_gpu = next(g for g in aws if g not in ("H100-SXM", "H200") and g != "L40S")
    loaded = study(tmp_path, price_list="aws", prices={"L40S": own})
    report = build_report(loaded)
    estimated = {r.gpu: r for r in report.which_gpu.rows if r.estimated}
    assert set(estimated) <= set(aws) | {"L40S"} and estimated_gpu in estimated
    assert estimated[estimated_gpu].usd_per_device_hour == aws[estimated_gpu].usd_per_device_hour
    assert estimated["L40S"].usd_per_device_hour == 0.5 and "our contract" in estimated["L40S"].price_source
    assert "Estimated rows are priced from the shipped aws list" in render_markdown(report)
    # Without a list in study.json (older studies): the shipped default list, as before.
    default = {r.gpu: r for r in build_report(study(tmp_path / "old")).which_gpu.rows if r.estimated}
    assert all(r.usd_per_device_hour == load_price_table()[g].usd_per_device_hour for g, r in default.items())


def test_a_bad_target_is_one_clear_line_and_a_cpu_study_has_no_section(tmp_path):
    with pytest.raises(UserError, match="--target-rps -1: give a positive request rate"):
        build_report(study(tmp_path), target_rps=-1)
    cpu = [trial("c", {}, [level(8, 900, 300)], device="cpu")]
    assert build_report(load_study(write_study(tmp_path / "cpu", study_info(device="cpu"), cpu))).which_gpu is None


def test_the_command_prints_the_gpu_it_recommends_and_refuses_a_bad_target_in_one_line(tmp_path, capsys):
    from servetune import cli

    loaded = study(tmp_path)
    assert cli.main(["report", str(loaded.root), "--target-rps", "120", "--out", str(tmp_path / "out")]) == 0
    choice = build_report(loaded, target_rps=120).which_gpu
    assert f"which GPU: {choice.why}" in capsys.readouterr().out
    assert "## Which GPU for 120 req/s" in (tmp_path / "out" / "summary.md").read_text()
    assert cli.main(["report", str(loaded.root), "--target-rps", "0", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "--target-rps 0: give a positive request rate" in err and err.count("\n") == 1 and "Traceback" not in err


def test_the_reason_compares_the_other_types_on_the_measure_the_choice_was_made_by(tmp_path):
    trials = [
        on("H100-SXM", "h100", [level(8, 900, 300), level(16, 1500, 900)]),
        on("H200", "h200", [level(8, 1000, 250), level(16, 2600, 600)]),
        on("L40S", "l40s", [level(8, 300, 2500, violations=BROKEN)]),  # no level met the SLO
    ]
    loaded = load_study(write_study(tmp_path / "s", study_info(model=MODEL), trials))
    for target in (None, 100.0):
        section = build_report(loaded, target_rps=target).which_gpu
        rows = {r.gpu: r for r in section.rows if not r.estimated}
        assert rows["L40S"].cost_per_mtok is None and "no configuration on L40S met the SLO" in section.why
        other = next(r for g, r in rows.items() if g in ("H100-SXM", "H200") and g != section.choice)
        if target is None:  # ranked by $/Mtok: the other type is shown at its $/Mtok
            assert f"{other.gpu} ${other.cost_per_mtok:.4g}/Mtok" in section.why
        else:  # ranked by the fleet for the target: the other type's fleet, so the two can be compared
            chosen = rows[section.choice]
            assert chosen.fleet_usd_per_hour <= other.fleet_usd_per_hour
            assert f"{other.gpu} {other.replicas} x 1 GPU ${other.fleet_usd_per_hour:,.2f}/h" in section.why


def test_estimated_rows_draw_the_measured_gpus_share_of_its_power_limit_on_their_own(tmp_path):
    from servetune.capacity.hardware import find_gpu

    loaded = study(tmp_path)
    bare = build_report(loaded).which_gpu
    assert all(r.joules_per_token is None for r in bare.rows if r.estimated)
    assert "energy not estimated: none measured on" in " ".join(r.note for r in bare.rows if r.estimated)
    # Every measured level drew half its GPU's board limit: J/token = 0.5 x limit / output tokens a second.
    for t in loaded.trials:
        limit = find_gpu(t.params["gpu"]).perf.tdp_w
        for lv in t.levels:
            lv.telemetry = {
                "gpu_energy_measured_j": 0.5 * limit * lv.summary.total_output_tokens / lv.summary.output_throughput
            }
    section = build_report(loaded).which_gpu
    choice = next(r for r in section.rows if r.gpu == section.choice)
    measured = next(t for t in loaded.trials if t.trial_id == choice.trial_id).levels[choice.level_index].summary
    assert choice.joules_per_token == pytest.approx(0.5 * find_gpu(choice.gpu).perf.tdp_w / measured.output_throughput)
    estimated = [r for r in section.rows if r.estimated and r.cost_per_mtok is not None]
    assert estimated
    for row in estimated:
        out = row.usd_per_device_hour * row.devices * 1e6 / (row.cost_per_mtok * 3600)  # its estimated output tok/s
        assert row.joules_per_token == pytest.approx(0.5 * find_gpu(row.gpu).perf.tdp_w * row.devices / out)
        assert f"({0.5:.0%} of its board power limit)" in row.note
    assert "J/token" in render_markdown(build_report(loaded))
    # Closed loops priced at their steady rate, here 1.5x the whole level's: an estimated row's cost follows it, its
    # energy stays over the whole level's tokens, as the measured row's joules a token are (1.5x fewer tok/s).
    for t in loaded.trials:
        for lv in t.levels:
            lv.summary = lv.summary.model_copy(update={"busy_output_throughput": 1.5 * lv.summary.output_throughput})
    steady = build_report(loaded).which_gpu
    assert next(r for r in steady.rows if r.gpu == steady.choice).joules_per_token == pytest.approx(
        choice.joules_per_token
    )
    for row in (r for r in steady.rows if r.estimated and r.cost_per_mtok is not None):
        out = row.usd_per_device_hour * row.devices * 1e6 / (row.cost_per_mtok * 3600)  # at the steady rate
        assert row.joules_per_token == pytest.approx(0.5 * find_gpu(row.gpu).perf.tdp_w * row.devices * 1.5 / out)


def test_an_unreadable_refit_file_is_one_line_naming_it_and_no_report_is_written(tmp_path, capsys):
    from servetune import cli
    from servetune.results.files import REFIT_FILE

    loaded = study(tmp_path)
    (loaded.root / REFIT_FILE).write_text("{}")  # the estimate's refit, read for the Which GPU rows
    assert cli.main(["report", str(loaded.root), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert str(loaded.root / REFIT_FILE) in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out" / "summary.md").exists()
