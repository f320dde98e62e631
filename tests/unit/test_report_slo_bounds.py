"""SLO bounds on the plots: every bound of an axis's metric family is drawn, broken points say which bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from servetune.report import build_report, load_study
from servetune.report.html import front_figure, hover_text
from servetune.report.labels import broken_label
from servetune.report.png import front_png
from servetune.report.points import SloLine, bounds_on_axis

RECORDED = Path(__file__).parents[1] / "data" / "cpu-tiny-study"  # SLO: TTFT P95 <= 150, P99 <= 300, TPOT P95 <= 20


@pytest.fixture(scope="module")
def report():
    return build_report(load_study(RECORDED))


def test_an_axis_gets_every_bound_of_its_family_its_own_statistic_first():
    lines = [SloLine("ttft_ms_p95", 150), SloLine("tpot_ms_p95", 20), SloLine("ttft_ms_p99", 300),
             SloLine("error_rate", 0.001)]  # fmt: skip
    ttft = bounds_on_axis(lines, "ttft_ms_p99")
    assert [(b.line.metric, b.same_statistic, b.label) for b in ttft] == [
        ("ttft_ms_p99", True, "SLO ttft_ms_p99 <= 300"),
        ("ttft_ms_p95", False, "SLO ttft_ms_p95 <= 150 (axis is P99)"),
    ]
    assert [b.label for b in bounds_on_axis(lines, "tpot_ms_p99")] == ["SLO tpot_ms_p95 <= 20 (axis is P99)"]
    assert bounds_on_axis(lines, "cost_per_mtok_usd") == [] and bounds_on_axis(lines, "e2el_ms_p99") == []
    assert [b.label for b in bounds_on_axis(lines, "error_rate")] == ["SLO error_rate <= 0.001"]


def test_the_html_plots_draw_the_p95_bounds_on_p99_axes(report):
    ttft = front_figure(report, report.front("cost-vs-ttft"))
    assert [(s.x0, s.line.dash) for s in ttft.layout.shapes] == [(300, "dash"), (150, "dot")]
    assert [a.text for a in ttft.layout.annotations] == [
        "SLO ttft_ms_p99 <= 300",
        "SLO ttft_ms_p95 <= 150 (axis is P99)",
    ]
    tpot = front_figure(report, report.front("cost-vs-tpot"))
    assert [(s.x0, s.line.dash) for s in tpot.layout.shapes] == [(20, "dot")]
    assert [a.text for a in tpot.layout.annotations] == ["SLO tpot_ms_p95 <= 20 (axis is P99)"]


def test_a_broken_point_is_labelled_with_the_bounds_it_broke(report):
    fig = front_figure(report, report.front("cost-vs-ttft"))
    apart = next(t for t in fig.data if t.name.startswith("apart"))
    assert apart.mode == "markers+text"
    labels = dict(zip(apart.x, apart.text, strict=True))
    # The cheapest grey point, inside the P99 line: it broke only the P95 bound, and says so.
    (inside,) = [x for x in apart.x if x < 300]
    assert labels[inside] == "TTFT P95"
    assert "TTFT P95/P99, TPOT P95" in apart.text
    hover = dict(zip(apart.x, apart.hovertext, strict=True))[inside]
    assert "<b>SLO broken</b> (TTFT P95):<br>ttft_ms_p95 = 160 &gt; 150" in hover


def test_broken_label_groups_statistics_by_metric(report):
    labels = {(p.trial_id, p.level_index): broken_label(p) for p in report.points}
    assert labels[("46f77bcabf05", 0)] == "TTFT P95/P99, TPOT P95"
    assert labels[("e57a166985b8", 0)] == ""  # met the SLO


def test_the_pngs_draw_the_same_bounds_and_labels(report):
    ax = front_png(report, report.front("cost-vs-ttft")).axes[0]
    bounds = [(line.get_label(), line.get_linestyle()) for line in ax.lines if line.get_label().startswith("SLO")]
    assert bounds == [("SLO ttft_ms_p99 <= 300", "--"), ("SLO ttft_ms_p95 <= 150 (axis is P99)", ":")]
    assert "TTFT P95" in [t.get_text() for t in ax.texts]
    tpot = front_png(report, report.front("cost-vs-tpot")).axes[0]
    assert [line.get_label() for line in tpot.lines if line.get_label().startswith("SLO")] == [
        "SLO tpot_ms_p95 <= 20 (axis is P99)"
    ]


def test_hover_of_a_trial_that_set_nothing_says_vllm_defaults(report):
    base = next(p for p in report.points if p.trial_id == "e57a166985b8")
    assert hover_text(base).split("<br>")[1] == "vLLM defaults"
