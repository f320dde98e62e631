"""Stored records read across versions: newer fields are ignored, older files lack new ones."""

import json

from servetune.results import StudyInfo, TrialResult
from tests.builders import level, study_info, trial


def test_a_result_written_by_a_newer_servetune_loads_without_its_new_fields():
    data = json.loads(trial("t1", {"max_num_seqs": 8}, [level(4, 500, 900)]).model_dump_json())
    data["from_the_future"] = 1
    data["levels"][0]["from_the_future"] = {"a": 1}
    data["levels"][0]["summary"]["from_the_future"] = 2.0
    data["levels"][0]["summary"]["ttft_ms"]["p999"] = 1200.0
    loaded = TrialResult.model_validate(data)
    assert loaded.levels[0].summary.ttft_ms.p99 == 900 and not hasattr(loaded, "from_the_future")


def test_a_result_written_before_repeats_existed_has_no_runs():
    data = json.loads(trial("t1", {"max_num_seqs": 8}, [level(4, 500, 900)]).model_dump_json())
    assert "runs" not in data["levels"][0]  # a level run once is written as before
    loaded = TrialResult.model_validate(data)
    assert loaded.levels[0].runs == [] and loaded.levels[0].measured_s == loaded.levels[0].summary.duration_s


def test_a_study_file_with_a_newer_field_loads():
    data = json.loads(study_info().model_dump_json())
    data["from_the_future"] = [1, 2]
    assert StudyInfo.model_validate(data).name == "demo"


def test_the_cpu_record_says_whether_bfloat16_runs_in_hardware():
    from servetune.environment import cpu_bf16

    amd = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
    sapphire = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
    graviton3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
    assert cpu_bf16(amd) == "emulated" and cpu_bf16(sapphire) == "native" and cpu_bf16(graviton3) == "native"
    assert cpu_bf16("processor: 0\n") == "unknown"


def test_files_say_which_layout_wrote_them_and_any_version_opens():
    from servetune.results import SCHEMA_VERSION

    old = json.loads(study_info().model_dump_json())
    old.pop("schema_version")  # written before the version was recorded
    assert StudyInfo.model_validate(old).schema_version == 1
    newer = {**old, "schema_version": SCHEMA_VERSION + 5, "from_the_future": True}
    assert StudyInfo.model_validate(newer).schema_version == SCHEMA_VERSION + 5
    result = json.loads(trial("t1", {}, [level(4, 500, 900)]).model_dump_json())
    result.pop("schema_version")
    loaded = TrialResult.model_validate(result)
    assert loaded.schema_version == 1 and loaded.resolved_engine_args == {} and loaded.levels[0].cache_note is None


def test_slo_bounds_are_stored_typed_and_a_report_reads_them_without_parsing_text(tmp_path):
    from servetune.config.slo import SloBound
    from servetune.report import build_report, load_study
    from servetune.report.points import SloLine
    from tests.builders import demo_trials, write_study

    typed = study_info(slo=["(text for people)"], slo_bounds=[SloBound(metric="ttft_ms", stat="p95", max=500)])
    data = json.loads(typed.model_dump_json())
    assert data["slo_bounds"] == [{"metric": "ttft_ms", "stat": "p95", "max": 500.0}]
    report = build_report(load_study(write_study(tmp_path / "typed", typed, demo_trials())))
    assert report.slo == (SloLine("ttft_ms_p95", 500.0),)
    older = build_report(load_study(write_study(tmp_path / "older", study_info(), demo_trials())))
    assert older.slo == (SloLine("ttft_ms_p99", 2000.0), SloLine("tpot_ms_p99", 100.0))  # parsed from text


def test_a_result_from_before_window_energy_loads_without_energy_metrics():
    """Schema 5 recorded the whole level's energy (warm-up included) and no note: such a level loads, and its
    points carry no energy per token rather than one that counted the warm-up."""
    data = json.loads(trial("t1", {}, [level(4, 500, 900)]).model_dump_json())
    data["schema_version"] = 5
    data["levels"][0]["telemetry"] = {"gpu_energy_j": 5000.0, "gpu_energy_j_per_output_token": 0.1}
    data["levels"][0].pop("energy_note", None)
    loaded = TrialResult.model_validate(data)
    assert loaded.levels[0].energy_note is None
    assert "energy_per_token" not in loaded.operating_points()[0].metrics


def test_a_levels_energy_per_token_and_request_come_from_its_measured_window():
    t = trial("t1", {}, [level(4, 500, 900)])
    t.levels[0].telemetry = {"gpu_energy_measured_j": 3000.0, "cpu_energy_measured_j": 99.0}
    metrics = t.operating_points()[0].metrics
    summary = t.levels[0].summary
    assert metrics["energy_per_token"] == 3000.0 / summary.total_output_tokens  # the GPUs', not the host's
    assert metrics["energy_per_request"] == 3000.0 / summary.completed
    reloaded = TrialResult.model_validate_json(t.model_dump_json())
    assert reloaded.operating_points()[0].metrics["energy_per_token"] == metrics["energy_per_token"]
