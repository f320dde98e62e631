"""Pruning by the estimate (search.estimate.prune) and the search seeded by it: the rule, the record, the order."""

from __future__ import annotations

import pytest

from servetune.config.slo import Slo, SloBound
from servetune.config.space import SearchSpace
from servetune.errors import UserError
from servetune.estimate import Estimate
from servetune.estimate.factors import MetricError
from servetune.load.runner import Level
from servetune.metrics import COST_METRIC, cost_per_mtok_usd
from servetune.report import build_report, load_study
from servetune.report.labels import TRIAL_HEADINGS, trial_cells
from servetune.results import OperatingPoint, read_result
from servetune.space_file import load_space
from servetune.study.driver import pruned, pruned_points
from servetune.study.early_stop import TTFT_METRIC
from servetune.study.forecast import (
    LevelForecast,
    estimate_seeds,
    estimated_objective,
    forecast,
    likely_winners,
    seed_count,
)
from servetune.study.prune import MIN_STUDY_LEVELS, error_margins, judge_prune, optimistic, prune_reason
from servetune.study.searcher import PROPOSED_KEY, ConstrainedOptunaSearch
from servetune.tracking.fields import study_metrics
from servetune.trial.context import StudyContext, resolve_levels
from tests.builders import study_info, trial, write_study

TTFT_P99 = Slo(bounds=(SloBound(metric="ttft_ms", stat="p99", max=1000),))
MARGINS = {"ttft_ms": 0.5, "tpot_ms": 0.5, "output_throughput": 0.2}


def fc(value: float, ttft: float | None, throughput: float = 1000.0, tpot: float = 20.0) -> LevelForecast:
    est = Estimate(ttft_ms=ttft, tpot_ms=tpot, itl_ms=tpot, output_throughput=throughput, request_throughput=throughput / 100,
                   saturated=ttft is None, knee=8, in_flight_per_replica=value, kv_preemption=False, gpu_class="H100")  # fmt: skip
    return LevelForecast(Level("concurrency", value), est)


def test_a_trial_is_pruned_only_when_even_its_estimate_widened_by_the_error_misses_the_slo_at_every_level():
    ladder = [fc(4, 1800.0), fc(16, 2400.0)]  # widened by 50 %: 1200 and 1600 ms, both over 1000
    record = judge_prune(ladder, TTFT_P99, MARGINS, [], 2.0, 1)
    assert record is not None and record.rule == "slo"
    assert [lv.missed for lv in record.levels] == ["ttft_ms_p99 <= 1000: 1,200 ms", "ttft_ms_p99 <= 1000: 1,600 ms"]
    assert "pruned: the estimate misses the SLO at every level" in prune_reason(
        record
    ) and "ttft_ms ±50%" in prune_reason(record)
    # a wider error reaches the bound at the lowest level: it might meet it there, so it runs
    assert judge_prune(ladder, TTFT_P99, {**MARGINS, "ttft_ms": 0.9}, [], 2.0, 1) is None
    # one level the optimistic estimate meets is enough to run it
    assert judge_prune([fc(1, 1400.0), *ladder], TTFT_P99, MARGINS, [], 2.0, 1) is None


@pytest.mark.parametrize(
    "slo, margins, ladder",
    [
        (
            Slo(bounds=(SloBound(metric="ttft_ms", stat="p50", max=1000),)),
            MARGINS,
            [fc(4, 5000.0)],
        ),  # a median: not judged
        (TTFT_P99, {"tpot_ms": 0.5}, [fc(4, 5000.0)]),  # no error known for TTFT
        (TTFT_P99, MARGINS, [fc(4, None)]),  # an open loop past saturation: its TTFT has no bound
        (TTFT_P99, MARGINS, []),  # nothing estimated
    ],
)
def test_the_estimate_never_prunes_where_it_is_unsure(slo, margins, ladder):
    assert judge_prune(ladder, slo, margins, [], 2.0, 1) is None


def point(trial_id: str, cost: float, ttft: float) -> OperatingPoint:
    return OperatingPoint(trial_id=trial_id, level_index=0, level={"concurrency": 8}, config={}, devices=1,
                          metrics={COST_METRIC: cost, TTFT_METRIC: ttft}, meets_slo=True)  # fmt: skip


def test_a_trial_a_finished_point_beats_even_at_its_best_case_is_pruned_as_dominated():
    ladder = [fc(4, 300.0, throughput=400.0), fc(16, 600.0, throughput=800.0)]  # meets the SLO at both
    best_cost = cost_per_mtok_usd(2.0, 1, 800.0 / (1 - 0.2))  # at its highest throughput widened by 20 %
    best_ttft = 300.0 / 1.5
    cheaper_faster = point("abc", best_cost * 0.8, best_ttft * 0.8)
    record = judge_prune(ladder, TTFT_P99, MARGINS, [cheaper_faster], 2.0, 1)
    assert record is not None and record.rule == "dominated" and record.dominated_by == "abc"
    assert record.optimistic_point == pytest.approx({COST_METRIC: best_cost, TTFT_METRIC: best_ttft})
    assert "dominated by trial abc" in prune_reason(record)
    # within the noise margin on either count, or no faster: not dominated
    assert judge_prune(ladder, TTFT_P99, MARGINS, [point("abc", best_cost * 0.95, best_ttft * 0.8)], 2.0, 1) is None
    assert judge_prune(ladder, TTFT_P99, MARGINS, [point("abc", best_cost * 0.8, best_ttft * 1.1)], 2.0, 1) is None
    # an estimate of throughput off by 100 % or more bounds no cost: unsure, it runs
    assert judge_prune(ladder, TTFT_P99, {**MARGINS, "output_throughput": 1.0}, [cheaper_faster], 2.0, 1) is None
    assert optimistic(ladder[0], {**MARGINS, "output_throughput": 1.0}).keys() == {"ttft_ms", "tpot_ms"}


def test_a_finished_point_is_weighed_against_the_estimate_at_its_whole_levels_rate_not_its_steady_one():
    # The estimate is fitted to (and its error measured against) a level's whole output throughput; the study prices
    # a closed loop at its steady rate, here 1.5x the whole level's. Priced so, the finished point looks 33 % cheaper
    # than like for like and would rule out a trial whose optimistic best case beats it at the same rate.
    ladder = [fc(4, 300.0, throughput=400.0), fc(16, 600.0, throughput=800.0)]
    best_cost = cost_per_mtok_usd(2.0, 1, 800.0 / (1 - 0.2))
    whole_cost = best_cost * 0.9  # within the 10 % noise margin of the best case, at the rate the estimate speaks of
    finished = OperatingPoint(trial_id="abc", level_index=0, level={"concurrency": 8}, config={}, devices=1,
                              metrics={COST_METRIC: whole_cost / 1.5, TTFT_METRIC: 100.0, "output_throughput": 1000.0},
                              meets_slo=True, priced_by="busy_output_throughput", priced_at=1500.0)  # fmt: skip
    assert judge_prune(ladder, TTFT_P99, MARGINS, [finished], 2.0, 1) is None
    # priced at the whole level's rate already (or recorded before the rate was kept): taken as it is
    as_is = finished.model_copy(update={"priced_at": None})
    record = judge_prune(ladder, TTFT_P99, MARGINS, [as_is], 2.0, 1)
    assert record is not None and record.dominated_by == "abc"


def test_the_margin_is_the_shipped_error_until_the_study_has_measured_its_own():
    shipped = {
        "ttft_ms": MetricError(median=0.3, p90=0.6, points=10),
        "tpot_ms": MetricError(median=0.1, p90=0.2, points=9),
    }
    few = {"ttft_ms": [0.05] * (MIN_STUDY_LEVELS - 1)}
    assert error_margins(shipped, few) == ({"ttft_ms": 0.6, "tpot_ms": 0.2}, "the shipped fit's held-out p90 error")
    own = [0.01 * i for i in range(1, 11)]  # 0.01 .. 0.10
    margins, source = error_margins(shipped, {"ttft_ms": own})
    assert 0.09 <= margins["ttft_ms"] <= 0.10 and margins["tpot_ms"] == 0.2
    assert "study's own p90 error (ttft_ms on 10 levels)" in source


def gpu_space(**search) -> SearchSpace:
    return SearchSpace.model_validate({
        "name": "prune", "model": "meta-llama/Llama-3.1-8B-Instruct", "workload": "chat", "device": "gpu",
        "hardware": {"gpu": "H100-SXM"}, "engine_args": {"max_model_len": 4096},
        "params": {"max_num_seqs": [4, 64, 256]}, "slo": {"ttft_ms": {"p99": 1}},
        "load": {"kind": "concurrency", "levels": [4, 16]}, "search": search,
    })  # fmt: skip


def context_of(space: SearchSpace, tmp_path) -> StudyContext:
    workload = space.resolved_workload(tmp_path)
    return StudyContext(space, workload, tmp_path, space.model, resolve_levels(space, workload))


def test_the_study_records_a_pruned_trial_with_its_numbers_and_the_report_shows_why(tmp_path):
    space = gpu_space(estimate={"prune": True})  # TTFT p99 <= 1 ms: no H100 prefills a chat prompt that fast
    context = context_of(space, tmp_path)
    spec = context.spec_for({"max_num_seqs": 64})
    result = pruned(spec, context, None, None)  # no engine, no Ray: the estimate alone
    assert result is not None and result.outcome == "PRUNED" and result.pruned is not None
    assert result.pruned.rule == "slo" and len(result.pruned.levels) == 2 and result.reason.startswith("pruned:")
    kept = read_result(spec.trial_dir)
    assert kept == result and kept.levels == [] and kept.startup_s is None
    assert pruned_points([kept, trial("x", {"max_num_seqs": 4})], context) == [{"max_num_seqs": 64}]

    root = write_study(tmp_path / "study", study_info(), [kept, trial("done", {"max_num_seqs": 4})])
    report = build_report(load_study(root))
    assert report.outcome_counts()["PRUNED"] == 1
    cells = dict(
        zip(TRIAL_HEADINGS, trial_cells(next(r for r in report.trial_table if r.outcome == "PRUNED")), strict=True)
    )
    assert cells["outcome"] == "PRUNED"
    assert study_metrics(load_study(root).trials)["trials_pruned"] == 1
    from servetune.study.progress import summary_table

    assert "1 complete, 0 infeasible, 0 failed, 1 pruned;" in str(summary_table(load_study(root).trials, space).title)


def test_a_trial_the_estimate_cannot_rule_out_runs(tmp_path):
    space = gpu_space(estimate={"prune": True}).model_copy(update={"slo": SearchSpace.model_validate(
        {"name": "x", "model": "m", "workload": "chat", "slo": {"ttft_ms": {"p99": 60000}}}).slo})  # fmt: skip
    context = context_of(space, tmp_path)
    assert pruned(context.spec_for({"max_num_seqs": 64}), context, None, None) is None


@pytest.mark.parametrize(
    "text, field",
    [
        ("estimate: {prun: true}", "search.estimate.prun"),
        ("estimate: {seed_trials: -1}", "search.estimate.seed_trials"),
    ],
)
def test_a_bad_estimate_setting_is_one_line_naming_file_and_field(tmp_path, text, field):
    path = tmp_path / "space.yaml"
    path.write_text(f"name: s\nmodel: tiny\ndevice: cpu\nworkload: chat\nsearch:\n  {text}\n")
    with pytest.raises(UserError) as err:
        load_space(path)
    assert str(err.value).startswith(str(path)) and field in str(err.value) and "\n" not in str(err.value)


def test_pruning_is_off_and_seeding_on_unless_the_space_says_otherwise():
    assert not gpu_space().search.estimate.prune and gpu_space().search.estimate.seed
    assert seed_count(gpu_space(algorithm="tpe"), 20) == 4 and seed_count(gpu_space(algorithm="tpe"), 8) == 2
    assert seed_count(gpu_space(algorithm="tpe", estimate={"seed": False}), 20) == 0
    assert seed_count(gpu_space(algorithm="grid"), 20) == 0
    assert seed_count(gpu_space(algorithm="gp", estimate={"seed_trials": 1}), 20) == 1


def test_the_seeds_are_the_grid_points_with_the_best_estimated_objective_best_first(tmp_path):
    space = SearchSpace.model_validate({**gpu_space(algorithm="tpe").model_dump(), "slo": {"ttft_ms": {"p99": 60000}}})
    context = context_of(space, tmp_path)
    objective = space.search.objectives[0]  # goodput, max
    seeds = estimate_seeds(context, 2)
    assert len(seeds) == 2
    values = []
    for params in space.grid()[0]:
        spec = context.spec_for(params)
        forecasts = forecast(spec, (64, 64))
        assert not isinstance(forecasts, str)
        values.append((params, estimated_objective(forecasts, objective, space.slo_bounds, 1.0, 1)))
    scores = {str(params): value for params, value in values}
    known = sorted((v for v in scores.values() if v is not None), reverse=True)
    assert len(known) >= 2, "the estimate covers this space"
    assert [scores[str(p)] for p in seeds] == known[:2]  # the two best by estimated goodput, best first
    assert likely_winners([({"a": 1}, 1.0), ({"a": 2}, None), ({"a": 3}, 3.0)], objective, 2) == [{"a": 3}, {"a": 1}]


def test_a_bayesian_search_proposes_the_seeds_first_marked_as_the_estimates():
    space = gpu_space(algorithm="tpe", baseline=False)
    seeds = [{"max_num_seqs": 256}, {"max_num_seqs": 4}]
    searcher = ConstrainedOptunaSearch(space, baseline=False, seeds=seeds)
    first, second = searcher.suggest("t1"), searcher.suggest("t2")
    assert first == {"params": {"max_num_seqs": 256}, PROPOSED_KEY: "estimate #1 of 2"}
    assert second == {"params": {"max_num_seqs": 4}, PROPOSED_KEY: "estimate #2 of 2"}
    third = searcher.suggest("t3")
    assert isinstance(third, dict) and PROPOSED_KEY not in third
    # a seed already measured (--resume) is not proposed again
    resumed = ConstrainedOptunaSearch(
        space, baseline=False, seeds=seeds, history=[({"max_num_seqs": 256}, [1.0], [0.0, 0.0])]
    )
    assert resumed.suggest("t1") == {"params": {"max_num_seqs": 4}, PROPOSED_KEY: "estimate #2 of 2"}


def test_unprune_needs_resume(tmp_path):
    from servetune import cli

    path = tmp_path / "space.yaml"
    path.write_text("name: s\nmodel: tiny\ndevice: cpu\nworkload: chat\n")
    args = cli.build_parser().parse_args(["run", str(path), "--unprune"])
    with pytest.raises(UserError, match="--unprune runs the pruned trials of a stored study: pass --resume too"):
        args.run(args)


def test_the_runs_device_time_says_what_pruning_saved():
    from servetune.accounting import device_time_lines, prune_savings

    ran = [trial("a", {"max_num_seqs": 4}, devices=2), trial("b", {"max_num_seqs": 8}, devices=2)]
    ran[0].duration_s, ran[1].duration_s = 300.0, 900.0
    skipped = trial("c", {"max_num_seqs": 16}, outcome="PRUNED", reason="pruned: ...", devices=4)
    assert prune_savings(ran) == {"trials_pruned": 0, "device_minutes_saved": 0.0, "mean_trial_s": 600.0}
    assert prune_savings([*ran, skipped])["device_minutes_saved"] == 600.0 * 4 / 60
    assert device_time_lines([*ran, skipped], "gpu", 3)[-1] == (
        "the estimate pruned 1 trial(s) before any engine started: about 40.0 GPU-min saved (each at the 600 s mean "
        "of the trials measured)"
    )
    assert not any("pruned" in line for line in device_time_lines(ran, "gpu", 3))


def test_a_measured_result_replaces_a_pruned_one_in_the_study_but_never_the_reverse(tmp_path):
    from types import SimpleNamespace

    from servetune.study.mirror import ResultMirror, final_report
    from servetune.trial.runner import load_result
    from tests.builders import level

    space = gpu_space(estimate={"prune": True})
    context = context_of(space, tmp_path)
    skipped = trial("abc", {"max_num_seqs": 64}, outcome="PRUNED", reason="pruned: the estimate misses the SLO")
    measured = trial("abc", {"max_num_seqs": 64}, [level(4, 100, 50)])
    mirror = ResultMirror(context)
    tune_trial = SimpleNamespace(trial_id="tune_0")
    mirror.on_trial_result(0, [], tune_trial, final_report(skipped, context))
    assert load_result(tmp_path / "trials" / "abc").outcome == "PRUNED"
    mirror.on_trial_result(0, [], tune_trial, final_report(measured, context))  # --resume --unprune measured it
    assert load_result(tmp_path / "trials" / "abc") == measured
    mirror.on_trial_result(0, [], tune_trial, final_report(skipped, context))
    assert load_result(tmp_path / "trials" / "abc") == measured


def test_on_the_cpu_build_the_study_prunes_only_once_it_measured_the_estimates_error(tmp_path, tiny_model):
    from servetune.study.prune import shipped_error

    assert shipped_error("cpu") == {} and shipped_error("gpu")  # the CPU factors come from one recording host
    space = SearchSpace.model_validate({
        "name": "cpu", "model": str(tiny_model), "device": "cpu", "workload": "cpu-tiny",
        "env": {"VLLM_CPU_KVCACHE_SPACE": 1}, "load": {"kind": "concurrency", "levels": [1, 4]},
        "slo": {"ttft_ms": {"p99": 0.01}}, "search": {"estimate": {"prune": True}},
    })  # fmt: skip
    context = context_of(space, tmp_path)
    assert pruned(context.spec_for({"max_num_seqs": 4}), context, None, None) is None


def test_the_pruning_replay_accounts_every_recorded_minute_and_says_when_the_best_was_lost(tiny_model):
    from pathlib import Path

    from servetune.study.replay_prune import pruning_effect
    from servetune.study.surface import Surface, score

    surface = Surface.load(Path(__file__).resolve().parents[2] / "bench" / "data" / "cpu-tiny-grid-r4.json")
    total = sum((r.duration_s or 0) * r.devices / 60 for r in surface.results.values())
    # an SLO no engine meets, 10 us TTFT: once five levels have measured the estimate's error, every trial is pruned
    strict = surface.space.model_copy(update={"slo": SearchSpace.model_validate(
        {"name": "x", "model": "m", "workload": "chat", "slo": {"ttft_ms": {"p99": 0.01}}}).slo})  # fmt: skip
    for space in (surface.space, strict):
        effect = pruning_effect(Surface(space, surface.results, {}), tiny_model, range(2))
        for saved, spent in zip(effect.device_minutes_saved, effect.device_minutes_spent, strict=True):
            assert saved + spent == pytest.approx(total)
        for seed, lost in enumerate(effect.best_lost):
            kept = [score(r) for r in surface.results.values()
                    if r.params not in [t.params for t in effect.trials if t.seed == seed]]  # fmt: skip
            assert lost == (max(kept, default=0) < 0.95 * surface.best_score)
    assert all(0 < n < len(surface.results) for n in effect.pruned)  # the first trials ran: the error was unknown
    assert all("misses the SLO at every level" in t.reason for t in effect.trials)
