"""``servetune report`` with and without verify.json, as a user runs it: the Verification section in both files."""

from __future__ import annotations

import json
from pathlib import Path

from servetune.cli import main
from servetune.report.study import load_study
from servetune.verify.checklist import evaluate
from tests.builders import demo_study, full_verify

STORED = Path(__file__).parents[1] / "data" / "cpu-tiny-study"


def test_report_of_a_verified_study_carries_the_verdict_and_the_checklist(tmp_path, capsys):
    study = demo_study(tmp_path / "demo")
    result = next(t for t in load_study(study).trials if t.trial_id == "t16")
    verify = full_verify() | {
        "trial_id": "t16",
        "level": {"concurrency": 16},
        "accepted": True,
        "reason": "every scenario passed",
    }
    verify["checklist"] = [item.model_dump() for item in evaluate(study, result, verify)]
    (study / "verify.json").write_text(json.dumps(verify))
    assert main(["report", str(study)]) == 0
    out = capsys.readouterr().out
    statuses = [item["status"] for item in verify["checklist"]]
    counts = ", ".join(f"{statuses.count(s)} {s}" for s in ("FAIL", "NOT CHECKED", "PASS"))
    assert f"verification: accepted (trial t16 at concurrency 16; {counts})" in out
    summary = (study / "report" / "summary.md").read_text()
    assert "**Accepted**: trial t16 at concurrency 16. every scenario passed." in summary
    assert sum(line.startswith("| 15.") for line in summary.splitlines()) == 23
    page = (study / "report" / "report.html").read_text()
    assert page.count("<tr class='") >= 23 + 8 and "<b>Verification: accepted</b>" in page


def test_report_of_the_stored_cpu_study_says_how_to_verify_it(tmp_path, capsys):
    assert main(["report", str(STORED), "--out", str(tmp_path)]) == 0
    assert f"verification: none yet: servetune verify {STORED}" in capsys.readouterr().out
    assert f"Not verified yet. Run `servetune verify {STORED}`" in (tmp_path / "summary.md").read_text()
    assert f"servetune verify {STORED}" in (tmp_path / "report.html").read_text()
