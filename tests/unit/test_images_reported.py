"""A vision-language study's images per level reach MLflow and the report's level tables; a text study's do not."""

from __future__ import annotations

from pathlib import Path

from servetune.report import build_report, load_study, render_markdown
from servetune.report.html import render_html
from servetune.results import TrialResult
from servetune.tracking.fields import BY_LEVEL, trial_metrics
from tests.builders import demo_trials, study_info, write_study

PIXELS = 1280 * 720


def _with_images(trials: list[TrialResult]) -> list[TrialResult]:
    """Each measured request carried 1 image (level index 0), 2 (index 1)...: the counts tell the levels apart."""
    for t in trials:
        for index, lv in enumerate(t.levels):
            lv.summary.images_sent = (index + 1) * lv.summary.completed
            lv.summary.image_pixels = lv.summary.images_sent * PIXELS
    return trials


def test_images_are_logged_per_level_and_at_the_operating_point() -> None:
    t32 = _with_images(demo_trials())[1]
    points = trial_metrics(t32)
    series = {(p.key, p.step): p.value for p in points if p.key.startswith(BY_LEVEL)}
    for index, lv in enumerate(t32.levels):
        assert series[(BY_LEVEL + "images_sent", index)] == lv.summary.images_sent
        assert series[(BY_LEVEL + "image_pixels", index)] == lv.summary.image_pixels
    plain = {p.key: p.value for p in points if not p.key.startswith(BY_LEVEL)}
    chosen = t32.levels[int(plain["level_index"])].summary
    assert plain["images_sent"] == chosen.images_sent and plain["image_pixels"] == chosen.image_pixels
    # a text trial logs neither
    text = demo_trials()[1]
    assert not [p.key for p in trial_metrics(text) if "image" in p.key]


def _pareto_section(md: str) -> str:
    return md.split("## Pareto front: Cost vs P99 time to first token")[1].split("## ")[0]


def test_the_level_tables_count_the_images_where_the_study_sent_them(tmp_path: Path) -> None:
    report = build_report(load_study(write_study(tmp_path / "vlm", study_info(), _with_images(demo_trials()))))
    assert report.sent_images
    section = _pareto_section(render_markdown(report))
    heading = next(line for line in section.splitlines() if line.startswith("| # |"))
    assert heading.endswith("| images | image Mpx |")
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert rows
    points = {(p.trial_id, p.level_index): p for p in report.points}
    by_label = {(p.trial_id, f"concurrency {p.level['concurrency']:g}"): p for p in points.values()}
    for row in rows:
        level = by_label[(row[1], row[3])].level_index
        sent = (level + 1) * 100  # the builder's levels complete 100 requests
        assert row[-2] == f"{sent:,}" and row[-1].rstrip(" |") == f"{sent * PIXELS / 1e6:,.1f}"
    assert "<th>images</th><th>image Mpx</th>" in render_html(report)


def test_a_text_study_has_no_image_columns(tmp_path: Path) -> None:
    report = build_report(load_study(write_study(tmp_path / "text", study_info(), demo_trials())))
    assert not report.sent_images
    md = render_markdown(report)
    assert "images" not in _pareto_section(md) and "image Mpx" not in md
    assert "image Mpx" not in render_html(report)
