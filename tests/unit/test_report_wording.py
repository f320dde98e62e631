"""Wording and numbers: units in tables, the recommendation's headline metrics, axis directions, the baseline."""

from __future__ import annotations

from pathlib import Path

import pytest

from servetune.accounting import device_time_lines
from servetune.report import build_report, load_study, render_markdown
from servetune.report.html import front_figure, render_html
from servetune.report.labels import metric_heading, point_metrics
from servetune.report.params import config_label
from servetune.report.png import front_png
from servetune.report.recommend import describe
from tests.builders import demo_study, level, study_info, trial, write_study

RECORDED = Path(__file__).parents[1] / "data" / "cpu-tiny-study"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build_report(load_study(demo_study(tmp_path_factory.mktemp("study") / "demo")))


def test_table_headings_carry_units():
    assert metric_heading("ttft_ms_p99") == "TTFT P99 (ms)"
    assert metric_heading("cost_per_mtok_usd") == "$/Mtok (USD)"
    assert metric_heading("goodput") == "goodput (req/s)"
    assert metric_heading("output_throughput") == "out tok/s"  # the short name says it


def test_html_tables_have_units_and_the_recommendation_box_its_headline_metrics(demo):
    page = render_html(demo)
    for heading in ("TTFT P99 (ms)", "TPOT P99 (ms)", "$/Mtok (USD)", "goodput (req/s)"):
        assert f"<th>{heading}</th>" in page
    box = page.split("<div class='rec'>")[1].split("</div>")[0]
    headline = point_metrics(demo.recommendation.point)
    assert [name for name, _ in headline][:3] == ["$/Mtok", "TTFT P99", "TPOT P99"]
    for name, value in headline:  # the same lines summary.md lists
        assert f"<li>{name}: {value}</li>" in box
        assert f"- {name}: {value}" in render_markdown(demo)
    assert "<li>TTFT P99: 600.0 ms</li>" in box and "<li>$/Mtok: 0.7937</li>" in box


def test_axes_say_which_way_is_better(demo):
    fig = front_figure(demo, demo.front("cost-vs-ttft"))
    assert fig.layout.yaxis.title.text == "USD per million output tokens — lower is better"
    assert fig.layout.xaxis.title.text == "P99 TTFT (ms) — lower is better"
    rates = front_figure(demo, demo.front("throughput-vs-interactivity"))
    assert rates.layout.yaxis.title.text.endswith("— higher is better")
    ax = front_png(demo, demo.front("cost-vs-ttft")).axes[0]
    assert ax.get_ylabel() == "USD per million output tokens — lower is better"


def test_early_stopping_savings_say_their_unit():
    def stopped(trial_id, because):
        t = trial(trial_id, {"max_num_seqs": 8}, [level(4, 400, 300)], devices=2)
        return t.model_copy(update={"duration_s": 300.0, "startup_s": 120.0, "stopped_because": because})

    trials = [stopped("a", "dominated at concurrency 4: ..."), stopped("b", "saturated at concurrency 4: ...")]
    gpu = device_time_lines(trials, "gpu", 3)[1]
    assert (
        gpu
        == "early stopping saved about 8.0 GPU-min (dominated: 1 trial(s), 4.0 GPU-min; saturated: 1 trial(s), 4.0 GPU-min)"
    )
    assert device_time_lines(trials, "cpu", 3)[1].endswith(
        "(dominated: 1 trial(s), 4.0 core-min; saturated: 1 trial(s), 4.0 core-min)"
    )


def test_the_baseline_is_vllm_defaults_in_one_way_everywhere(tmp_path):
    assert config_label({}) == "vLLM defaults"
    root = write_study(tmp_path / "s", study_info(), [trial("base", {}, [level(8, 400, 300)])])
    report = build_report(load_study(root))
    assert describe(report.points[0]).startswith("trial base (vLLM defaults) at concurrency 8")
    recorded = build_report(load_study(RECORDED))
    for text in (render_markdown(report), render_html(report), render_markdown(recorded), render_html(recorded)):
        assert "vLLM defaults" in text
        assert "(defaults)" not in text and "((vLLM" not in text


def test_the_summary_names_the_model_without_the_recording_machine_s_paths(tmp_path):
    from servetune.report import build_report, load_study, render_markdown
    from tests.builders import demo_trials, study_info, write_study

    hub = build_report(load_study(write_study(tmp_path / "hub", study_info(), demo_trials())))
    assert hub.model_label == "org/tiny-chat"
    root = tmp_path / "gen"
    inside = write_study(root, study_info(model=str((root / "models" / "tiny").resolve())), demo_trials())
    assert build_report(load_study(inside)).model_label == "models/tiny (in the study directory)"
    elsewhere = write_study(tmp_path / "far", study_info(model="/home/someone/checkpoints/llama-8b"), demo_trials())
    md = render_markdown(build_report(load_study(elsewhere)))
    assert "- model: `llama-8b (a local directory)`" in md and "/home/someone" not in md


def test_the_baseline_label_is_bare_and_the_sentence_or_table_around_it_adds_the_punctuation(tmp_path):
    """One label, ``vLLM defaults``, from both ways of naming a configuration; the run's console wraps it once
    where a sentence does, and its tables show it as the report's tables do."""
    from rich.console import Console

    from servetune.errors import UserError
    from servetune.quality.probe import make_plan
    from servetune.report.params import BASELINE, short_config
    from servetune.space_file import load_space
    from servetune.study.driver import keep_reference
    from servetune.study.progress import summary_table
    from servetune.trial.context import StudyContext, resolve_levels

    assert config_label({}) == short_config({}) == BASELINE == "vLLM defaults"
    assert config_label({"max_num_seqs": 32, "enable_prefix_caching": True, "gpu_memory_utilization": 0.90}) == (
        "max_num_seqs=32, enable_prefix_caching=true, gpu_memory_utilization=0.9"
    )
    shipped = Path(__file__).parents[2] / "search_spaces" / "cpu-tiny.yaml"
    space_file = tmp_path / "space.yaml"
    space_file.write_text(shipped.read_text() + "\nquality: {suites: [agreement], reference: baseline}\n")
    space = load_space(space_file)
    workload = space.resolved_workload(shipped.parent)
    plan = make_plan(space.quality, tmp_path, space.quality_reference)
    context = StudyContext(space, workload, tmp_path, "m", resolve_levels(space, workload), quality=plan)
    with pytest.raises(UserError) as refused:  # the reference never ran
        keep_reference(context)
    assert "the reference trial (vLLM defaults) gave no answers" in str(refused.value)
    console = Console(width=300, record=True)
    console.print(summary_table([trial("base", {}, [level(8, 400, 300)])], space))
    row = next(line for line in console.export_text().splitlines() if "base" in line)
    assert "vLLM defaults" in row and "(vLLM defaults)" not in row
