"""The report lists every level whose answers lacked what their requests asked (report/asks.py), a row per trial
and level, and warns where the recommended trial has one."""

from __future__ import annotations

from servetune.report import build_report, load_study, render_markdown
from servetune.report.html import render_html
from servetune.report.write import recommendation_lines
from tests.builders import demo_trials, study_info, write_study


def report_with(tmp_path, change):
    trials = demo_trials()  # t16 is recommended at concurrency 16 (its second level); t32 completed too
    change({t.trial_id: t for t in trials})
    return build_report(load_study(write_study(tmp_path / "s", study_info(), trials)))


def ignored(by_id):
    by_id["t32"].levels[0].summary.not_honoured = {"logprobs": 7}
    by_id["t32"].levels[1].summary.structured_valid = 0.9  # a structured answer in ten did not parse
    by_id["t32"].levels[2].summary.structured_valid = 1.0  # every one did: not listed
    by_id["t16"].levels[0].summary.not_honoured = {"n": 3, "logprobs": 1}


def section(md: str, title: str) -> list[str]:
    return md.split(f"### {title}", 1)[1].split("\n### ", 1)[0].splitlines()


def test_each_level_that_lacked_an_ask_is_a_row_the_recommended_trial_first_with_a_warning(tmp_path):
    report = report_with(tmp_path, ignored)
    assert report.recommendation.point.trial_id == "t16"
    assert [(a.trial_id, a.level) for a in report.asks] == [
        ("t16", "concurrency 8"), ("t32", "concurrency 16"), ("t32", "concurrency 32")
    ]  # fmt: skip
    md = render_markdown(report)
    rows = [line for line in section(md, "Answers without what they asked") if line.startswith(("| t16", "| t32"))]
    assert rows == [
        "| t16 | concurrency 8 | 100 | 1 | 3 | - |",  # logprobs, then n; no structured share measured there
        "| t32 | concurrency 16 | 100 | 7 | 0 | - |",
        "| t32 | concurrency 32 | 100 | 0 | 0 | 90.0% |",
    ]
    assert "| trial | level | completed | no logprobs | fewer choices than n | structured parsed as asked |" in md
    warning = report.asks_warning
    assert warning.startswith("Warning: trial t16's engine did not do what requests asked at 1 level")
    assert "not the recommended level" in warning and "3 of 100 answers with fewer choices than n" in warning
    assert md.index(warning) < md.index("## Trials")  # beside the recommendation, not only in the list below
    html = render_html(report)
    assert "id='asks-warning'" in html and "<h3 id='asks'>" in html
    assert "<tr class='recommended'><td>t16</td><td>concurrency 8</td>" in html
    assert "  warning: trial t16's engine did not do what requests asked" in "\n".join(
        recommendation_lines(report, tmp_path / "s")
    )  # what servetune report and run print


def test_the_warning_names_the_recommended_level_when_it_lacked_an_ask(tmp_path):
    report = report_with(tmp_path, lambda by_id: setattr(by_id["t16"].levels[1].summary, "not_honoured", {"n": 100}))
    assert "the recommended level itself" in report.asks_warning
    assert "concurrency 16: 100 of 100 answers with fewer choices than n" in report.asks_warning


def test_another_trial_lacking_an_ask_is_listed_without_a_warning(tmp_path):
    def only_t32(by_id):
        by_id["t32"].levels[1].summary.structured_valid = 0.5

    report = report_with(tmp_path, only_t32)
    assert report.asks_warning is None
    md = render_markdown(report)
    assert "Warning:" not in md
    assert section(md, "Answers without what they asked")[2:5] == [
        "| trial | level | completed | structured parsed as asked |", "|---|---|---|---|",
        "| t32 | concurrency 32 | 100 | 50.0% |",
    ]  # fmt: skip
    assert "id='asks-warning'" not in render_html(report)
    assert not any("warning" in line for line in recommendation_lines(report, tmp_path / "s"))


def test_a_study_whose_answers_carried_every_ask_has_no_such_section(tmp_path):
    def all_parsed(by_id):
        by_id["t16"].levels[1].summary.structured_valid = 1.0
        by_id["t16"].levels[0].summary.not_honoured = {"n": 0}

    report = report_with(tmp_path, all_parsed)
    assert report.asks == () and report.asks_warning is None
    assert "Answers without what they asked" not in render_markdown(report)
    assert "id='asks'" not in render_html(report)
