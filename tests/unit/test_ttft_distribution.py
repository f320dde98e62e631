"""The TTFT distribution a level keeps, and the report's view of it for the recommended trial."""

from __future__ import annotations

from servetune.metrics import DISTRIBUTION_PERCENTILES, RequestRecord
from servetune.report import build_report, load_study, render_markdown
from servetune.report.html import render_html, spread_figure
from servetune.summary import ttft_distribution_ms
from tests.builders import demo_trials, study_info, write_study


def record(index: int, ttft_s: float, warmup: bool = False, ok: bool = True) -> RequestRecord:
    return RequestRecord(index=index, sent=float(index), input_tokens=10, max_tokens=4, warmup=warmup,
                         chunk_times=[index + ttft_s, index + ttft_s + 0.01], end=index + ttft_s + 0.01,
                         output_tokens=2, ok=ok)  # fmt: skip


def test_a_level_keeps_its_ttft_at_every_fifth_percentile_from_measured_requests_only():
    # Waves: 70 requests got their first token alone (30 ms), 30 waited behind a wave (200 ms).
    records = [record(i, 0.030) for i in range(70)] + [record(70 + i, 0.200) for i in range(30)]
    records += [record(200, 5.0, warmup=True), record(201, 9.0, ok=False)]  # neither counts
    spread = ttft_distribution_ms(records)
    assert len(spread) == len(DISTRIBUTION_PERCENTILES) == 21
    by = {p: round(ms, 6) for p, ms in zip(DISTRIBUTION_PERCENTILES, spread, strict=True)}
    assert by[0] == by[50] == by[65] == 30.0 and by[75] == by[100] == 200.0  # the step is where the wave starts
    assert spread == sorted(spread)
    assert ttft_distribution_ms([record(0, 1.0, warmup=True)]) is None


def test_report_shows_the_recommended_trials_distribution_per_level(tmp_path):
    trials = demo_trials()
    t16 = trials[0]
    waves = [30.0] * 14 + [200.0] * 7  # at percentiles 0..65 alone, 70..100 behind a wave
    for lv, share in zip(t16.levels, (0.1, 0.8), strict=True):
        lv.ttft_ms_distribution, lv.send_sync_share = waves, share
    report = build_report(load_study(write_study(tmp_path / "s", study_info(), trials)))
    assert report.recommendation.point.trial_id == "t16"
    assert [s.level for s in report.ttft_spreads] == ["concurrency 8", "concurrency 16"]
    assert report.ttft_spreads[1].spread == 200.0 / 30.0
    md = render_markdown(report)
    section = md.split("### TTFT distribution of the recommended trial (t16)")[1].split("\n\n")[1]
    rows = [line for line in section.splitlines() if line.startswith("| concurrency")]
    assert rows == ["| concurrency 8 | 30 | 30 | 30 | 200 | 200 | 200 | 6.7x | 10% | met |",
                    "| concurrency 16 | 30 | 30 | 30 | 200 | 200 | 200 | 6.7x | 80% | met |"]  # fmt: skip
    fig = spread_figure(report)
    assert [trace.name for trace in fig.data] == [
        "concurrency 8 · 10% sent together",
        "concurrency 16 · 80% sent together",
    ]
    assert list(fig.data[0].x) == waves and list(fig.data[0].y) == list(DISTRIBUTION_PERCENTILES)
    assert any(shape.x0 == 2000 for shape in fig.layout.shapes)  # the SLO's TTFT P99 bound
    assert "id='ttft-distribution'" in render_html(report)


def test_a_study_recorded_before_distributions_were_kept_has_no_such_section(tmp_path):
    report = build_report(load_study(write_study(tmp_path / "s", study_info(), demo_trials())))
    assert report.ttft_spreads == ()
    assert "TTFT distribution" not in render_markdown(report) and "ttft-distribution" not in render_html(report)
