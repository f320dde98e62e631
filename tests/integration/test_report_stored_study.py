"""The report regenerated from a small stored study that a real CPU run produced."""

from pathlib import Path

from servetune.cli import main
from servetune.results import TrialResult

STUDY = Path(__file__).parents[1] / "data" / "cpu-tiny-study"


def test_report_from_a_real_cpu_study(tmp_path, capsys):
    trials = [TrialResult.model_validate_json(p.read_text()) for p in STUDY.glob("trials/*/result.json")]
    meeting = [p for t in trials if t.outcome == "COMPLETE" for p in t.operating_points() if p.meets_slo]
    cheapest = min(meeting, key=lambda p: p.metrics["cost_per_mtok_usd"])

    assert main(["report", str(STUDY), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"recommendation: trial {cheapest.trial_id}" in out
    summary = (tmp_path / "summary.md").read_text()
    assert f"{len(trials)} COMPLETE" in summary or f"COMPLETE | {len(trials)}" in summary
    assert cheapest.trial_id in summary
    html = (tmp_path / "report.html").read_text()
    assert "plotly" in html.lower() and cheapest.trial_id in html
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "pareto-cost-vs-e2el.png", "pareto-cost-vs-tpot.png", "pareto-cost-vs-ttft.png", "pareto-throughput-vs-interactivity.png",
    ]  # fmt: skip
