"""What a level's cost is priced at: its steady output rate (every client busy) where a closed loop measured one,
else the whole level's output tok/s, and the record says which."""

from __future__ import annotations

import json

import pytest

from servetune.metrics import COST_METRIC
from servetune.report.markdown import render_markdown
from servetune.report.study import load_study
from servetune.report.write import build_report
from servetune.results import LevelResult, TrialResult
from servetune.serve.layouts import Layout, layout_run
from servetune.summary import summarize
from servetune.tracking import conclude
from servetune.tracking.fields import level_tags, trial_metrics
from servetune.tracking.inputs import ModelFingerprint
from servetune.tracking.record import build_record
from tests.builders import CPU_TINY_STUDY, level, study_info, trial, write_study
from tests.unit.test_ladder_saturation import Engine, closed_loop

PRICE = 2.0


def per_mtok(tok_s: float, devices: int = 1) -> float:
    return PRICE * devices / (tok_s * 3600) * 1e6


def short_closed_level(clients: int = 32, requests: int = 48) -> LevelResult:
    """A closed loop of ``requests`` at ``clients``: its staggered start and last wave are most of it."""
    records = closed_loop(Engine(1000), clients, requests, seed=3)
    return LevelResult(summary=summarize(records, {"concurrency": clients}))


def busy_level(concurrency: float, whole: float, busy: float, ttft_p99: float = 300) -> LevelResult:
    measured = level(concurrency, whole, ttft_p99)
    measured.summary.busy_output_throughput = busy
    return measured


def test_a_short_closed_loop_is_priced_at_its_rate_with_every_client_busy_not_over_its_drain():
    measured = short_closed_level()
    s = measured.summary
    assert s.busy_output_throughput is not None and s.output_throughput < 0.8 * s.busy_output_throughput
    assert s.steady_output_throughput == s.busy_output_throughput and s.priced_by == "busy_output_throughput"
    point = trial("t1", {"max_num_seqs": 32}, [measured], price=PRICE).operating_points()[0]
    assert point.metrics[COST_METRIC] == pytest.approx(per_mtok(s.busy_output_throughput))
    assert point.priced_by == "busy_output_throughput"
    # output_throughput keeps vllm bench serve's meaning: the whole level's tokens over its whole window
    assert point.metrics["output_throughput"] == s.output_throughput


def test_a_level_without_a_busy_rate_is_priced_over_the_whole_level():
    open_level = level(8, 400, 300)  # an open loop, a level too short to tell, or a record from before it was kept
    assert open_level.summary.busy_output_throughput is None and open_level.summary.priced_by == "output_throughput"
    point = trial("t1", {"max_num_seqs": 8}, [open_level], price=PRICE, devices=2).operating_points()[0]
    assert point.metrics[COST_METRIC] == pytest.approx(per_mtok(400, devices=2))
    assert point.priced_by == "output_throughput"


def test_the_result_file_says_which_rate_priced_each_level_and_reads_back_the_same():
    t = trial("t1", {"max_num_seqs": 8}, [busy_level(8, 400, 500), level(16, 600, 400)], price=PRICE)
    data = json.loads(t.model_dump_json())
    assert [lv["summary"]["priced_by"] for lv in data["levels"]] == ["busy_output_throughput", "output_throughput"]
    loaded = TrialResult.model_validate(data)
    assert [p.metrics[COST_METRIC] for p in loaded.operating_points()] == pytest.approx([per_mtok(500), per_mtok(600)])
    # a record whose summary names another rate (edited, or a later servetune's) is priced by what it measured
    data["levels"][0]["summary"]["priced_by"] = "output_throughput"
    assert TrialResult.model_validate(data).levels[0].summary.priced_by == "busy_output_throughput"


def test_the_stored_study_from_before_busy_rates_reports_at_its_whole_level_costs():
    files = sorted(CPU_TINY_STUDY.glob("trials/*/result.json"))
    trials = [TrialResult.model_validate_json(p.read_text()) for p in files]
    levels = [(t, i, lv) for t in trials for i, lv in enumerate(t.levels)]
    assert levels and all(lv.summary.busy_output_throughput is None for _, _, lv in levels)
    for t, i, lv in levels:
        point = t.operating_points()[i]
        assert point.priced_by == "output_throughput"
        assert point.metrics[COST_METRIC] == pytest.approx(
            t.price_per_device_hour * t.devices / (lv.summary.output_throughput * 3600) * 1e6
        )
    report = build_report(load_study(CPU_TINY_STUDY))
    assert report.recommendation.point is not None
    assert "priced at a level's output tok/s with every client busy" in render_markdown(report)


def test_the_recommendation_and_the_cost_front_rank_by_the_steady_cost(tmp_path):
    # a drains more of its level than b: over the whole level b looks cheaper, at the steady rate a is
    a = trial("a", {"max_num_seqs": 32}, [busy_level(32, 500, 900, ttft_p99=400)], price=PRICE)
    b = trial("b", {"max_num_seqs": 16}, [busy_level(16, 600, 650, ttft_p99=500)], price=PRICE)
    report = build_report(load_study(write_study(tmp_path / "s", study_info(), [a, b])))
    assert report.recommendation.point is not None and report.recommendation.point.trial_id == "a"
    front = report.main_front  # cost against P99 TTFT: a is cheaper and faster, b is dominated
    assert front.spec.y.metric == COST_METRIC and [p.trial_id for p in front.result.front] == ["a"]


def performance(t: TrialResult) -> str:
    record = build_record(t, study_info(), None, ModelFingerprint("unknown", None), conclude(t, [t]))
    return record.fields["performance"]


def test_mlflow_and_the_record_say_which_rate_priced_the_chosen_level():
    t = trial("t1", {"max_num_seqs": 8}, [busy_level(8, 400, 500)], price=PRICE)
    assert level_tags(t)["servetune.cost_priced_by"] == "busy_output_throughput"
    plain = {m.key: m.value for m in trial_metrics(t) if m.step == 0}
    assert plain[COST_METRIC] == pytest.approx(per_mtok(500), rel=1e-3)
    assert "(priced at 500.0 output tok/s with every client busy)" in performance(t)
    old = trial("t2", {"max_num_seqs": 8}, [level(8, 400, 300)], price=PRICE)
    assert level_tags(old)["servetune.cost_priced_by"] == "output_throughput"
    assert "priced at" not in performance(old)


def test_a_serve_layout_is_priced_at_its_steady_rate():
    run = layout_run(Layout(2, 1), 1, busy_level(16, 400, 800), PRICE)
    assert run.cost_per_mtok_usd == pytest.approx(per_mtok(800, devices=2))
    assert run.device_hours_per_mtok == pytest.approx(2 / (800 * 3600) * 1e6)
