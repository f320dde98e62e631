"""Derived metrics, and the renderers drawing the computed report: Markdown, HTML, PNG."""

from __future__ import annotations

import re

import pytest

from servetune.report import build_report, gather_points, load_study, render_markdown
from servetune.report.html import front_figure, hover_text, render_html
from servetune.report.png import write_pngs
from tests.builders import demo_study, level, trial


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return build_report(load_study(demo_study(tmp_path_factory.mktemp("study") / "demo")))


def test_cost_per_device_and_per_user_rates_and_the_price_override():
    t = trial(
        "t", {"tensor_parallel_size": 2}, [level(16, out_tps=900.0, ttft_p99=400, tpot_mean=20.0)], devices=2, price=3.0
    )
    (point,) = gather_points([t])
    assert point.metrics["cost_per_mtok_usd"] == pytest.approx(3.0 * 2 / (900 * 3600) * 1e6)
    assert point.metrics["output_throughput_per_device"] == pytest.approx(450.0)
    assert point.metrics["output_throughput_per_user"] == pytest.approx(50.0)  # 1000 / 20 ms
    (cheaper,) = gather_points([t], price_per_device_hour=1.5)
    assert cheaper.metrics["cost_per_mtok_usd"] == pytest.approx(point.metrics["cost_per_mtok_usd"] / 2)


def test_markdown_has_counts_reasons_pareto_table_and_recommendation(report):
    md = render_markdown(report)
    for row in ("| COMPLETE | 2 |", "| INFEASIBLE | 1 |", "| FAILED | 1 |", "| not read | 1 |"):
        assert row in md
    assert "| FAILED | engine exited with code 1: torch.OutOfMemoryError: CUDA out of memory." in md
    assert "| INFEASIBLE | does not fit: KV pool would be -3.1 GiB at max_model_len 2048 | t256 |" in md
    assert "t-running`: no result.json" in md
    section = md.split("## Pareto front: Cost vs P99 time to first token")[1].split("## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split(" | ")[1:4] for r in rows] == [
        ["t32", "max_num_seqs=32, gpu_memory_utilization=0.9", "concurrency 32"],
        ["t32", "max_num_seqs=32, gpu_memory_utilization=0.9", "concurrency 16"],
        ["t16", "max_num_seqs=16, gpu_memory_utilization=0.9", "concurrency 8"],
    ]
    assert rows[0].split(" | ")[4:6] == ["0.463", "1,500.0"]  # $/Mtok, TTFT P99
    rec = md.split("## Recommendation")[1].split("## Trials")[0]
    assert "**trial t16 (max_num_seqs=16, gpu_memory_utilization=0.9) at concurrency 16" in rec
    assert "stepped one notch back from the out-of-memory boundary" in rec
    assert "- passed over: trial t32" in rec and "--pick best --format vllm" in rec


def test_figure_data_front_apart_recommended_and_slo_line(report):
    fig = front_figure(report, report.front("cost-vs-ttft"))
    traces = {t.name.split(" (")[0]: t for t in fig.data}
    assert list(traces) == ["apart: failed or SLO broken", "meets SLO, dominated", "Pareto front", "recommended"]
    front = traces["Pareto front"]
    assert front.mode == "lines+markers"
    assert sorted(front.x) == list(front.x) == [300.0, 500.0, 1500.0]  # connected left to right
    assert traces["apart: failed or SLO broken"].marker.symbol == "x" and list(
        traces["apart: failed or SLO broken"].x
    ) == [3000.0]
    assert "ttft_ms_p99 = 3000 &gt; 2000" in traces["apart: failed or SLO broken"].hovertext[0]
    assert list(traces["recommended"].x) == [600.0]
    assert "max_num_seqs=32" in front.hovertext[2] and "concurrency 32" in front.hovertext[2]
    assert [(s.type, s.x0) for s in fig.layout.shapes] == [("line", 2000)]  # SLO ttft_ms_p99 <= 2000
    tpot = front_figure(report, report.front("cost-vs-tpot"))
    assert [s.x0 for s in tpot.layout.shapes] == [100]


def test_hover_text_escapes_and_lists_config_and_numbers(report):
    point = report.recommendation.point
    text = hover_text(point)
    assert text.startswith("<b>trial t16</b> · concurrency 16<br>max_num_seqs=16<br>gpu_memory_utilization=0.9")
    assert "$/Mtok: 0.7937" in text and "TTFT P99: 600.0" in text and "KV cache peak: 55%" in text
    assert text.endswith("SLO met")


def test_html_is_self_contained_with_every_front_and_the_hover_data(report):
    page = render_html(report)
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"<script[^>]*\ssrc=", page)  # plotly.js is inline: the page works offline
    assert "plotly.js v" in page  # the bundled library's banner
    assert page.count("Plotly.newPlot") == 4
    for name in ("cost-vs-ttft", "cost-vs-tpot", "cost-vs-e2el", "throughput-vs-interactivity"):
        assert f'id="front-{name}"' in page
    assert "max_num_seqs=32" in page and "SLO ttft_ms_p99 \\u003c= 2000" in page
    assert "stepped one notch back" in page


def test_png_files_are_written(report, tmp_path):
    paths = write_pngs(report, tmp_path / "out")
    assert [p.name for p in paths] == [
        "pareto-cost-vs-ttft.png", "pareto-cost-vs-tpot.png", "pareto-cost-vs-e2el.png",
        "pareto-throughput-vs-interactivity.png",
    ]  # fmt: skip
    for path in paths:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_the_report_says_where_device_time_went_and_what_early_stopping_saved(tmp_path):
    from tests.builders import study_info, write_study

    def timed(trial_id, levels, because=None):
        t = trial(trial_id, {"max_num_seqs": 8 * len(levels)}, levels, devices=2)
        return t.model_copy(update={"duration_s": 300.0, "startup_s": 120.0, "stopped_because": because})

    trials = [timed("a", [level(4, 400, 300), level(16, 900, 600)]),
              timed("b", [level(4, 300, 2500, violations=("ttft_ms_p99 = 2500 > 2000",))], because="SLO broken at concurrency 4: ...")]  # fmt: skip
    info = study_info(levels=["concurrency 4", "concurrency 16", "concurrency 64"])
    md = render_markdown(build_report(load_study(write_study(tmp_path / "s", info, trials))))
    section = md.split("## Device time")[1].split("## ")[0]
    assert (
        "- GPU time: 20.0 GPU-min reserved by 2 trial(s): 30% measuring, 40% starting engines (2 starts, mean 120 s, max 120 s), 30% warm-up"
        in section
    )
    assert (
        "- early stopping saved about 4.0 GPU-min (SLO broken: 1 trial(s), 4.0 GPU-min)" in section
    )  # 2 levels of 60 s on 2 GPUs
    older = render_markdown(build_report(load_study(write_study(tmp_path / "old", study_info(), trials))))
    assert "early stopping saved about 2.0 GPU-min" in older  # no ladder in study.json: the longest one run counts


def test_each_trials_capacity_at_the_slo_is_drawn_and_labelled_on_the_fronts(tmp_path):
    from servetune.results import Capacity
    from tests.builders import study_info, write_study

    # Ladder 2, 8 and the search's 4 and 6: capacity 4 clients; the other trial ran the ladder alone.
    searched = trial("c4", {"max_num_seqs": 8}, [level(2, 300, 400), level(8, 900, 3000, violations=("ttft",)),
                                                 level(4, 560, 900), level(6, 700, 2500, violations=("ttft",))])  # fmt: skip
    searched.capacity_at_slo = Capacity(value=4, unit="concurrency", bracket=(4, 6), bound="exact", tolerance=0.1)
    ladder = trial("l", {"max_num_seqs": 4}, [level(2, 250, 300), level(8, 600, 1200)])
    write_study(tmp_path / "s", study_info(), [searched, ladder])
    built = build_report(load_study(tmp_path / "s"))
    assert [p.key for p in built.points if p.at_capacity] == ["c4#2"]
    traces = {t.name.split(" (")[0]: t for t in front_figure(built, built.front("cost-vs-ttft")).data}
    capacity = traces["capacity at the SLO"]
    assert list(capacity.x) == [900.0] and list(capacity.text) == ["c4: capacity concurrency 4"]
    assert capacity.marker.symbol == "diamond-open"


def test_two_capacities_that_overlap_within_their_noise_are_a_tie_and_the_reason_says_so(tmp_path):
    from servetune.results import Capacity
    from tests.builders import study_info, write_study

    def searched(trial_id, seqs, capacity, broke, out_tps, noise=0.1):
        levels = [level(2, 300, 400), level(capacity, out_tps, 900), level(broke, out_tps, 2500, violations=("ttft",))]
        t = trial(trial_id, {"max_num_seqs": seqs}, levels)
        t.capacity_at_slo = Capacity(value=capacity, unit="concurrency", bracket=(capacity, broke), bound="exact",
                                     tolerance=0.1, verdict_noise=noise)  # fmt: skip
        return t

    write_study(tmp_path / "tie", study_info(), [searched("a", 8, 5, 6, 620), searched("b", 16, 6, 7, 600)])
    rec = build_report(load_study(tmp_path / "tie")).recommendation
    assert rec.point.trial_id == "a" and [p.trial_id for p in rec.ties] == ["b"]
    assert (
        "A tie within the noise: its capacity 5 [5, 6)" in rec.reason
        and "trial b (max_num_seqs=16): capacity 6 [6, 7)" in rec.reason
    )
    # Capacities apart beyond their noise are no tie, however close the costs.
    write_study(
        tmp_path / "apart", study_info(), [searched("a", 8, 5, 6, 620, 0.02), searched("c", 32, 12, 14, 600, 0.02)]
    )
    assert build_report(load_study(tmp_path / "apart")).recommendation.ties == ()


def test_energy_per_token_gets_its_front_against_p99_latency_where_it_was_measured(tmp_path):
    from servetune.report.pareto import ENERGY_FRONT
    from tests.builders import demo_trials, study_info, write_study

    trials = demo_trials()
    # t16's levels drew little energy per token (less at its higher load), t32's much, at a higher E2E P99 too
    for t, joules in zip(trials[:2], ([400.0, 560.0], [8000.0, 20000.0, 30000.0]), strict=True):
        for lv, j in zip(t.levels, joules, strict=True):
            lv.telemetry = {"gpu_energy_measured_j": j}
    report = build_report(load_study(write_study(tmp_path / "energy", study_info(), trials)))
    (front,) = [f.result for f in report.fronts if f.spec == ENERGY_FRONT]
    points = {(p.trial_id, p.level_index): p for p in report.points}
    assert points[("t16", 0)].value("energy_per_token") == pytest.approx(400.0 / (400 * 60))
    on_front = {(p.trial_id, p.level_index) for p in front.front}
    assert on_front == {("t16", 0), ("t16", 1)}  # fewer joules per token and quicker end to end than t32's
    assert ("t32", 2) in {(p.trial_id, p.level_index) for p in front.apart}  # it broke the SLO
    md = render_markdown(report)
    assert "| J/tok |" in md  # the Pareto tables' column
    assert "- energy per token measured at 5 of 5 points, from the GPUs' energy counters (NVML)" in md
    assert 'id="front-energy-vs-e2el"' in render_html(report)
    # without an energy measured (no RAPL on the CPU stand-in, a study from before) the front is not drawn
    trials = demo_trials()
    trials[0].levels[0].energy_note = "GPU energy not measured: NVML not available"
    plain = build_report(load_study(write_study(tmp_path / "plain", study_info(), trials)))
    assert ENERGY_FRONT not in [f.spec for f in plain.fronts]
    assert plain.energy.startswith("energy per token measured at 0 of 5 points")
    assert plain.energy.endswith("; GPU energy not measured: NVML not available")
