"""A level's goodput is counted over the window its cost is priced at: a closed loop's with every client busy
(its staggered start and final drain left out) where that was measured, else the whole level's; the whole level's
goodput stays in the record as ``whole_level_goodput``, and results from before it was kept read as they were."""

from __future__ import annotations

import json

import pytest

from servetune.config.settings import Objective
from servetune.config.slo import Slo
from servetune.metrics import COST_METRIC, GOODPUT
from servetune.report.markdown import render_markdown
from servetune.report.study import load_study
from servetune.report.write import build_report
from servetune.results import Capacity, LevelResult, TrialResult, best_level
from servetune.study.objectives import objectives_and_constraints
from servetune.summary import summarize
from servetune.tracking import conclude
from servetune.tracking.fields import capacity_metrics, level_tags
from servetune.tracking.inputs import ModelFingerprint
from servetune.tracking.record import build_record
from tests.builders import CPU_TINY_STUDY, study_info, trial, write_study
from tests.unit.test_ladder_saturation import Engine, closed_loop, open_loop

PRICE = 2.0
TOKENS = 250  # every answer of closed_loop's
EVERY_REQUEST = {"ttft_ms": 1e6}  # a bound every request meets


def measured(clients: int, requests: int, slots: int = 1000, bounds: dict | None = None) -> LevelResult:
    records = closed_loop(Engine(slots), clients, requests, seed=3)
    return LevelResult(summary=summarize(records, {"concurrency": clients}, bounds or EVERY_REQUEST))


def priced_tok_s(cost: float, devices: int = 1) -> float:
    """The output tok/s a cost per million tokens was priced at."""
    return PRICE * devices / (cost * 3600) * 1e6


def test_a_level_with_a_long_drain_counts_goodput_over_the_window_its_cost_is_priced_at():
    # 48 requests at 32 clients: the staggered start and the last wave are most of the level
    s = measured(32, 48).summary
    assert s.priced_by == "busy_output_throughput" and s.goodput_window == "every_client_busy"
    # every request met the bound and answered 250 tokens: goodput is the cost's rate in requests
    assert s.goodput is not None and s.goodput * TOKENS == pytest.approx(s.busy_output_throughput)
    # the whole level's, drain included, as vllm bench serve divides, is kept under its own name
    assert s.whole_level_goodput is not None and s.whole_level_goodput * TOKENS == pytest.approx(s.output_throughput)
    assert s.whole_level_goodput < 0.7 * s.goodput
    point = trial("t1", {"max_num_seqs": 32}, [LevelResult(summary=s)], price=PRICE).operating_points()[0]
    assert point.metrics[GOODPUT] == s.goodput
    assert point.metrics[GOODPUT] * TOKENS == pytest.approx(priced_tok_s(point.metrics[COST_METRIC]))


def test_warm_up_requests_served_in_the_window_are_held_to_no_bound():
    # 8 slots for 32 clients: the warm-up requests, first in, answer in ms; every measured one queues for seconds
    fast_warmup = measured(32, 96, slots=8, bounds={"ttft_ms": 3000}).summary
    assert fast_warmup.ttft_ms.p50 > 3000 and fast_warmup.busy_output_throughput is not None
    assert fast_warmup.goodput == 0.0 and fast_warmup.whole_level_goodput == 0.0
    # met by all, the warm-up requests' share of the window counts as their tokens do
    loose = measured(32, 96, slots=8).summary
    assert loose.goodput is not None and loose.goodput * TOKENS == pytest.approx(loose.busy_output_throughput)


def test_an_open_loop_counts_goodput_over_the_whole_level_as_its_cost():
    records = open_loop(Engine(1000), 8.0, 64, seed=1)
    s = summarize(records, {"rate": 8.0}, EVERY_REQUEST)
    assert s.priced_by == "output_throughput" and s.goodput_window == "whole_level"
    assert s.goodput == s.whole_level_goodput == pytest.approx(s.request_throughput)
    assert summarize(records, {"rate": 8.0}).goodput_window is None  # no per-request bound, no goodput


def two_levels() -> TrialResult:
    """24 clients over a long level and 32 over a short one: over the whole level 24 serves more good requests a
    second, with every client busy (and so by cost) 32 does."""
    long, short = measured(24, 192), measured(32, 48)
    assert long.summary.whole_level_goodput > short.summary.whole_level_goodput
    assert long.summary.goodput < short.summary.goodput
    t = trial("t1", {"max_num_seqs": 32}, [long, short], price=PRICE)
    t.capacity_at_slo = Capacity(value=32, unit="concurrency", bracket=(32, None), bound="lower", tolerance=0.1)
    return t


def test_the_best_level_the_objectives_and_goodput_at_capacity_read_the_cost_s_window():
    t = two_levels()
    points = t.operating_points()
    assert best_level(t) == 1
    assert min(points, key=lambda p: p.metrics[COST_METRIC]).level_index == 1  # the cheapest level is the best
    slo = Slo.parse("ttft_ms.p99=2000")
    values, _ = objectives_and_constraints(t, [Objective(metric=GOODPUT, mode="max")], slo)
    assert values == [t.levels[1].summary.goodput]
    at = capacity_metrics(t)
    assert at[f"capacity/{GOODPUT}"] * TOKENS == pytest.approx(priced_tok_s(at[f"capacity/{COST_METRIC}"]))


def performance(t: TrialResult) -> str:
    record = build_record(t, study_info(), None, ModelFingerprint("unknown", None), conclude(t, [t]))
    return record.fields["performance"]


def test_the_record_and_mlflow_say_which_window_goodput_is_counted_over():
    t = two_levels()
    assert level_tags(t)["servetune.goodput_window"] == "every_client_busy"
    assert f"goodput {t.levels[1].summary.goodput:,.2f} req/s with every client busy" in performance(t)
    data = json.loads(t.model_dump_json())
    assert [lv["summary"]["goodput_window"] for lv in data["levels"]] == ["every_client_busy"] * 2
    data["levels"][0]["summary"]["goodput_window"] = "whole_level"  # worked out again from what was measured
    assert TrialResult.model_validate(data).levels[0].summary.goodput_window == "every_client_busy"


def test_a_result_json_from_before_whole_level_goodput_loads_and_reports_its_goodput_as_recorded(tmp_path):
    data = json.loads(two_levels().model_dump_json())
    for lv in data["levels"]:  # as price40's servetune wrote them: busy rates, goodput over the whole level
        summary = lv["summary"]
        summary["goodput"] = summary.pop("whole_level_goodput")
        del summary["goodput_window"]
    old = TrialResult.model_validate(data)
    recorded = [lv["summary"]["goodput"] for lv in data["levels"]]
    assert [lv.summary.goodput for lv in old.levels] == recorded
    assert {lv.summary.goodput_window for lv in old.levels} == {"whole_level"}
    assert [p.metrics[GOODPUT] for p in old.operating_points()] == recorded
    assert best_level(old) == 0  # judged as it was
    assert level_tags(old)["servetune.goodput_window"] == "whole_level"
    assert "req/s with every client busy" not in performance(old)
    report = build_report(load_study(write_study(tmp_path / "s", study_info(), [old])))
    assert report.recommendation.point is not None and report.recommendation.point.trial_id == "t1"
    assert "goodput is counted over the same window" in render_markdown(report)


def test_the_stored_study_reads_its_goodput_over_the_whole_level():
    files = sorted(CPU_TINY_STUDY.glob("trials/*/result.json"))
    levels = [lv for p in files for lv in TrialResult.model_validate_json(p.read_text()).levels]
    assert levels and all(lv.summary.whole_level_goodput is None for lv in levels)
    assert {lv.summary.goodput_window for lv in levels} <= {"whole_level", None}
    assert build_report(load_study(CPU_TINY_STUDY)).recommendation.point is not None


def test_a_study_resumed_across_the_window_change_compares_every_trials_goodput_over_the_whole_level(tmp_path):
    data = json.loads(two_levels().model_dump_json())
    for lv in data["levels"]:  # the trial measured before the change: goodput over the whole level
        summary = lv["summary"]
        summary["goodput"] = summary.pop("whole_level_goodput")
        del summary["goodput_window"]
    data["trial_id"] = "old"
    new = two_levels()
    whole = [lv.summary.whole_level_goodput for lv in new.levels]
    assert all(w is not None and w < lv.summary.goodput for w, lv in zip(whole, new.levels, strict=True))
    report = build_report(
        load_study(write_study(tmp_path / "s", study_info(), [TrialResult.model_validate(data), new]))
    )
    goodput = {(p.trial_id, p.level_index): p.metrics[GOODPUT] for p in report.points}
    assert [goodput["t1", i] for i in range(2)] == whole  # the busy window's higher goodput is not compared
    assert [goodput["old", i] for i in range(2)] == [lv["summary"]["goodput"] for lv in data["levels"]]
    assert "goodput over the whole level for every trial" in render_markdown(report)
    alone = build_report(load_study(write_study(tmp_path / "n", study_info(), [new])))  # one window: as measured
    assert [p.metrics[GOODPUT] for p in alone.points] == [lv.summary.goodput for lv in new.levels]
    assert "goodput over the whole level for every trial" not in render_markdown(alone)
