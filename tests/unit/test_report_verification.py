"""The report's Verification section: verify.json's verdict, stability, scenarios and checklist, or how to run verify."""

from __future__ import annotations

import json

import pytest

from servetune.report import build_report, load_study, render_markdown
from servetune.report.html import render_html
from servetune.report.verification import VERIFY_FILE, read_verify_file, verification
from servetune.verify.checklist import evaluate
from tests.builders import demo_study, full_verify


def verified(root, **changes):
    """The demo study with a verify.json for its recommendation (t16 at 16 in flight), checklist evaluated."""
    study = demo_study(root)
    result = next(t for t in load_study(study).trials if t.trial_id == "t16")
    verify = full_verify() | {"trial_id": "t16", "level": {"concurrency": 16}, "accepted": False,
                              "reason": "15.15 FAIL: no hard queue limit"}  # fmt: skip
    verify.update(changes)
    verify["checklist"] = [item.model_dump() for item in evaluate(study, result, verify)]
    (study / VERIFY_FILE).write_text(json.dumps(verify))
    return study, verify


def section(md: str) -> str:
    return md.split("## Verification")[1].split("\n## ")[0]


def test_without_verify_json_both_renderers_say_how_to_run_verify(tmp_path):
    study = demo_study(tmp_path / "demo")
    report = build_report(load_study(study))
    assert report.verification is not None and not report.verification.found
    md = section(render_markdown(report))
    assert f"Not verified yet. Run `servetune verify {study}`" in md and "| 15." not in md
    page = render_html(report)
    assert page.count(f"servetune verify {study}") == 2  # under the recommendation and in the section
    assert "<h2 id='verification'>Verification</h2>" in page and "id='checklist'" not in page


def test_markdown_shows_the_verdict_stability_scenarios_and_every_checklist_item(tmp_path):
    study, verify = verified(tmp_path / "demo")
    md = render_markdown(build_report(load_study(study)))
    assert md.index("## Recommendation") < md.index("## Verification") < md.index("## Trials")
    text = section(md)
    assert "**Rejected**: trial t16 at concurrency 16. 15.15 FAIL: no hard queue limit." in text
    assert "| cancellation success rate | 100% |" in text and "| out of memory | no |" in text
    scenarios = [line.split(" | ")[0].lstrip("| ") for line in text.split("### Scenarios")[1].split("###")[0].splitlines()
                 if line.startswith("| ") and not line.startswith("| scenario")]  # fmt: skip
    assert scenarios == ["soak", "peak", "burst", "mix", "long_output", "disconnects", "headroom", "repeats"]
    assert (
        "| disconnects | passed | dropped 8, running_fell_back yes, fallback_s 0.6, cancellation_success_rate 100% |"
        in text
    )
    rows = [line for line in text.splitlines() if line.startswith("| 15.")]
    assert [r.split(" | ")[0].lstrip("| ") for r in rows] == [item["id"] for item in verify["checklist"]]
    statuses = [r.split(" | ")[2] for r in rows]
    assert statuses == [item["status"] for item in verify["checklist"]]
    counts = {s: statuses.count(s) for s in ("FAIL", "NOT CHECKED", "PASS")}
    assert (
        f"### Acceptance checklist ({counts['FAIL']} FAIL, {counts['NOT CHECKED']} NOT CHECKED, {counts['PASS']} PASS)"
        in text
    )


def test_html_escapes_text_and_marks_each_row_by_status(tmp_path):
    study, verify = verified(tmp_path / "demo", reason="<script>alert(1)</script> & more")
    verify["checklist"][0]["evidence"] = "weights <b>x</b> | 'quoted'"
    (study / VERIFY_FILE).write_text(json.dumps(verify))
    page = render_html(build_report(load_study(study)))
    assert "<script>alert(1)</script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; more" in page
    assert "weights &lt;b&gt;x&lt;/b&gt; | &#x27;quoted&#x27;" in page
    checklist = page.split("id='checklist'>")[1].split("</table>")[0]
    classes = [chunk.split("'")[0] for chunk in checklist.split("<tr class='")[1:]]
    assert classes == [item["status"].lower().replace(" ", "-") for item in verify["checklist"]]
    assert "<p class='verdict rejected'><b>Verification: rejected</b> · trial t16 at concurrency 16" in page


@pytest.mark.parametrize("content, problem", [("{not json", "not valid JSON"), ("[1, 2]", "not a JSON object")])
def test_an_unreadable_verify_json_is_named_and_the_report_still_builds(tmp_path, content, problem):
    study = demo_study(tmp_path / "demo")
    (study / VERIFY_FILE).write_text(content)
    report = build_report(load_study(study))
    text = section(render_markdown(report))
    assert f"`{study / VERIFY_FILE}` could not be read: {problem}" in text
    assert "could not be read" in render_html(report)


def test_odd_keys_show_as_dashes_and_numbers_read_as_people_read_them(tmp_path):
    (tmp_path / VERIFY_FILE).write_text(json.dumps({
        "accepted": "yes", "level": 2, "trial_id": "t1",
        "stability": {"oom": True, "error_rate_5xx": 0.0004, "extra": [1, 2]},
        "scenarios": {"zeta": {"passed": True}, "soak": {"p99_ttft_ms_windows": [900, 450, 400, 410, 420]}, "peak": 3},
        "checklist": [{"id": "15.1", "status": "PASS"}, "not an item"],
    }))  # fmt: skip
    v = verification(tmp_path, read_verify_file(tmp_path))
    assert v.verdict == "no verdict recorded" and v.subject == "trial t1, level #2"
    assert dict(v.stability) == {"out of memory": "yes", "5xx error rate": "0.04%", "cancellation success rate": "-",
                                 "P99 jitter (max over min of the windowed P99)": "-", "extra": "[1, 2]"}  # fmt: skip
    assert [(r.name, r.result) for r in v.scenarios] == [
        ("soak", "no verdict"),
        ("peak", "no verdict"),
        ("zeta", "passed"),
    ]
    assert v.scenarios[0].numbers == "p99_ttft_ms_windows 5 values, 400 to 900"
    assert [(r.id, r.text, r.status, r.evidence) for r in v.checklist] == [("15.1", "-", "PASS", "-")]
    assert v.counts() == {"FAIL": 0, "NOT CHECKED": 0, "PASS": 1}


def test_a_stopped_verification_never_replaces_a_verdict(tmp_path):
    """verify writes a stopped verification beside a finished verify.json (verify.stopped.json), not over it."""
    import json

    from servetune.verify.document import finished_document
    from servetune.verify.run import stop_status

    path = tmp_path / "verify.json"
    assert not finished_document(path)  # none yet
    path.write_text("{not json")
    assert not finished_document(path)
    path.write_text(json.dumps({"accepted": False, "stopped": "SIGTERM"}))
    assert not finished_document(path)  # an earlier stopped one is replaced
    path.write_text(json.dumps({"accepted": False, "reasons": ["peak: broke the SLO"]}))
    assert finished_document(path)
    assert (
        stop_status("SIGTERM"),
        stop_status("SIGINT"),
        stop_status("interrupted"),
        stop_status("exit 3"),
        stop_status("odd"),
    ) == (143, 130, 130, 3, 1)


def test_what_limited_the_verification_shows_under_the_verdict_and_beside_each_scenario(tmp_path):
    line = "KV-bound at concurrency 20: 6 preemptions, KV cache peak 97% → more KV cache"
    study, verify = verified(tmp_path / "demo", limited_by=line)
    verify["scenarios"]["peak"]["limited_by"] = line
    verify["scenarios"]["soak"]["limited_by"] = "no limit found in what was recorded at concurrency 16"
    (study / VERIFY_FILE).write_text(json.dumps(verify))
    report = build_report(load_study(study))
    text = section(render_markdown(report))
    assert f"What limited it in the verification (soak and peak): {line}" in text
    assert f"| peak | passed | requests_waiting_max 7 | within SLO at 1.25x; what limited it: {line} |" in text
    assert "| soak | passed |" in text and "P99 drift 5%; what limited it: no limit found" in text
    page = render_html(report)
    assert "What limited it in the verification (soak and peak): KV-bound at concurrency 20" in page
    assert verification(study, read_verify_file(study)).limited_by == line
    del verify["limited_by"]  # a verify.json from before the field: nothing said
    (study / VERIFY_FILE).write_text(json.dumps(verify))
    assert "What limited it in the verification" not in render_markdown(build_report(load_study(study)))
