"""A paired re-check in the report: a capacity tie (recommend.py rule 5) settled, confirmed or left open by
``recheck-paired-*.json`` files that verify/paired.py wrote (its own model, judged by its own rule)."""

from __future__ import annotations

import pytest

from servetune import cli
from servetune.errors import UserError
from servetune.report import build_report, load_study, render_markdown
from servetune.report.html import render_html
from servetune.report.write import recommendation_lines
from servetune.results import Capacity
from servetune.verify.paired import Paired, PairedRound, judge
from tests.builders import level, study_info, trial, write_study

VLLM = "0.32.0"


def searched(trial_id, seqs, capacity, broke, out_tps, kv=0.3):
    levels = [level(2, 300, 400), level(capacity, out_tps, 900, server={"kv_cache_usage_max": kv}),
              level(broke, out_tps, 2500, violations=("ttft",))]  # fmt: skip
    t = trial(trial_id, {"max_num_seqs": seqs}, levels)
    t.capacity_at_slo = Capacity(value=capacity, unit="concurrency", bracket=(capacity, broke), bound="exact",
                                 tolerance=0.1, verdict_noise=0.1)  # fmt: skip
    t.environment = {"vllm": VLLM}
    return t


def paired_file(root, a, b, b_over_a, vllm=VLLM, name=None, failure=None, created="2026-12-06T07:00:00"):
    """What ``servetune recheck --paired`` writes: three rounds, B's goodput ``b_over_a`` times A's in each
    (with a little spread), judged by verify/paired.py's own rule."""
    rounds = []
    for i, wobble in enumerate((1.0, 1.02, 0.98)):
        a_goodput = 10.0 * wobble
        a_side = {"goodput": a_goodput, "output_throughput": 600 * wobble}
        b_side = {"goodput": a_goodput * b_over_a, "output_throughput": 600 * wobble * b_over_a}
        rounds.append(PairedRound(round=i + 1, first="A" if i % 2 == 0 else "B", a=a_side, b=b_side, a_meets_slo=True,
                                  b_meets_slo=True))  # fmt: skip
    metrics, decided, verdict, reason = judge(rounds)
    doc = Paired(study="demo", vllm=vllm, a_trial_id=a, b_trial_id=b, level={"concurrency": 5}, mode="side by side",
                 rounds_asked=3, rounds=rounds, metrics=metrics, decided_on=decided, verdict=verdict, reason=reason,
                 failure=failure, created=created)  # fmt: skip
    path = root / (name or f"recheck-paired-{vllm}.json")
    path.write_text(doc.model_dump_json(indent=2))
    return doc


@pytest.fixture
def tie(tmp_path):
    """Trials a and b: capacities 5 [5, 6) and 6 [6, 7) within their noise, a a little cheaper: a tie, a picked."""
    root = tmp_path / "tie"
    write_study(root, study_info(), [searched("a", 8, 5, 6, 620), searched("b", 16, 6, 7, 600)])
    rec = build_report(load_study(root)).recommendation
    assert rec.point.trial_id == "a" and [t.trial_id for t in rec.ties] == ["b"]
    return root


def test_a_tie_without_a_paired_comparison_names_the_command_that_would_settle_it(tie):
    rec = build_report(load_study(tie)).recommendation
    assert rec.point.trial_id == "a" and [t.trial_id for t in rec.ties] == ["b"]
    assert f"no paired comparison on the study's vLLM {VLLM}" in rec.reason
    assert f"`servetune recheck {tie} --paired --against b`" in rec.reason


def test_an_open_tie_is_the_next_step_of_the_command_line_and_every_report(tie, tmp_path, capsys):
    command = f"servetune recheck {tie} --paired --against b"
    report = build_report(load_study(tie))
    assert report.recommendation.next_steps == (command,)
    assert f"  next: {command}  (a tie within the noise: measures the two round by round)" in recommendation_lines(
        report, tie
    )  # what servetune run and servetune report print last about the recommendation
    assert f"- next: `{command}` settles the tie round by round" in render_markdown(report)
    assert f"Next: <code>{command}</code>" in render_html(report)
    assert cli.main(["report", str(tie), "--out", str(tmp_path / "out")]) == 0
    assert f"next: {command}" in capsys.readouterr().out
    assert not (tie / "recheck").exists()  # named, never run: it costs engine time


@pytest.mark.parametrize("b_over_a", [1.25, 0.8, 1.0])
def test_a_tie_a_paired_comparison_settled_or_confirmed_has_no_next_step(tie, b_over_a):
    paired_file(tie, "a", "b", b_over_a)
    report = build_report(load_study(tie))
    assert report.recommendation.next_steps == ()
    assert not any("next:" in line for line in recommendation_lines(report, tie))
    assert "--paired --against" not in render_markdown(report)


def test_a_comparison_on_another_vllm_leaves_the_next_step_in_place(tie):
    paired_file(tie, "a", "b", 1.25, vllm="0.33.0")
    rec = build_report(load_study(tie)).recommendation
    assert rec.next_steps == (f"servetune recheck {tie} --paired --against b",)


def test_a_paired_comparison_that_finds_the_tie_better_recommends_it_and_says_by_how_much(tie):
    doc = paired_file(tie, "a", "b", 1.25)
    assert doc.verdict == "B better"  # the paired rule's own judgement of these rounds
    report = build_report(load_study(tie))
    rec = report.recommendation
    assert rec.point.trial_id == "b" and rec.point.at_capacity and rec.ties == ()
    assert "a paired comparison (3 rounds, recheck-paired-0.32.0.json) measured it better than trial a" in rec.reason
    assert doc.reason in rec.reason  # the paired numbers themselves: the change, its interval, the rounds ahead
    assert "measured it better than trial a" in render_markdown(report)


def test_a_switch_reaches_the_trial_table_the_front_and_the_command_line(tie, tmp_path, capsys):
    paired_file(tie, "a", "b", 1.25)
    report = build_report(load_study(tie))
    assert [row.trial_id for row in report.trial_table if row.recommended] == ["b"]
    assert "recommended to ship" in next(r for r in report.trial_table if r.trial_id == "b").conclusion.why
    assert cli.main(["report", str(tie), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "recommendation: trial b" in out and "measured it better than trial a" in out and "next:" not in out


def test_a_paired_comparison_that_confirms_the_pick_or_the_tie_keeps_the_pick(tie):
    paired_file(tie, "a", "b", 0.8)
    rec = build_report(load_study(tie)).recommendation
    assert rec.point.trial_id == "a" and "settled by a paired comparison (3 rounds" in rec.reason
    assert "trial a better" in rec.reason
    # A within the paired noise (the newest file counts: created later, same pair)
    doc = paired_file(tie, "b", "a", 1.0, name="recheck-paired-again.json")
    doc.created = "2026-12-06T08:00:00"
    (tie / "recheck-paired-again.json").write_text(doc.model_dump_json())
    assert doc.verdict == "tie within the paired noise"
    rec = build_report(load_study(tie)).recommendation
    assert rec.point.trial_id == "a" and "found them within its noise too" in rec.reason


def test_a_paired_comparison_on_another_vllm_or_one_that_failed_is_not_taken(tie):
    paired_file(tie, "a", "b", 1.25, vllm="0.33.0")
    paired_file(tie, "a", "b", 1.25, name="recheck-paired-failed.json", failure="B did not start")
    rec = build_report(load_study(tie)).recommendation
    assert rec.point.trial_id == "a" and [t.trial_id for t in rec.ties] == ["b"]
    assert "recheck-paired-0.33.0.json compared them on vLLM 0.33.0" in rec.reason
    assert "failed: B did not start" in rec.reason and "not taken: another engine" in rec.reason


def test_a_better_tie_with_a_thin_memory_margin_is_not_switched_to(tmp_path):
    root = tmp_path / "thin"
    write_study(root, study_info(), [searched("a", 8, 5, 6, 620), searched("b", 16, 6, 7, 600, kv=0.95)])
    paired_file(root, "a", "b", 1.25)
    rec = build_report(load_study(root)).recommendation
    assert rec.point.trial_id == "a"
    assert (
        "found trial b better" in rec.reason and "its memory margin is thin: KV cache usage peaked at 95%" in rec.reason
    )


def test_an_unreadable_paired_file_is_one_line_naming_it(tie):
    (tie / "recheck-paired-0.32.0.json").write_text('{"a_trial_id": "a"}')
    with pytest.raises(UserError, match=r"recheck-paired-0\.32\.0\.json: .*b_trial_id"):
        load_study(tie)


def test_every_paired_run_s_own_file_is_read_and_the_report_names_the_runs_beside_the_one_it_took(tie):
    """Each paired run keeps its result in its own folder (recheck/<vllm>/<run>/recheck-paired.json); the study-level
    file is the latest run's only, here a REFUSED one that overwrote it. The report reads every run, counts the
    study-level copy once, settles on the latest run that measured the two, and names the others."""
    runs = tie / "recheck" / VLLM
    folders = [runs / f"20261206T0{h}0000Z" for h in (7, 8, 9)]
    for folder in folders:
        folder.mkdir(parents=True)
    paired_file(folders[0], "a", "b", 0.8, name="recheck-paired.json")  # A better
    paired_file(folders[1], "a", "b", 1.0, name="recheck-paired.json", created="2026-12-06T08:00:00")  # a tie
    refused = Paired(study="demo", vllm=VLLM, a_trial_id="a", b_trial_id="b", level={"concurrency": 5},
                     mode="side by side", rounds_asked=3, rounds=[], metrics=[], decided_on=None, verdict="REFUSED",
                     reason="vLLM refuses trial b", failure="vLLM refuses trial b", created="2026-12-06T09:00:00")  # fmt: skip
    for path in (folders[2] / "recheck-paired.json", tie / f"recheck-paired-{VLLM}.json"):
        path.write_text(refused.model_dump_json(indent=2))
    study = load_study(tie)
    assert len(study.paired) == 3  # the study-level copy of the third run counted once
    rec = build_report(study).recommendation
    assert rec.point.trial_id == "a" and "found them within its noise too" in rec.reason
    assert (f"3 rounds, recheck/{VLLM}/20261206T080000Z/recheck-paired.json; the latest of 2 that measured them on "
            f"vLLM {VLLM}; the other runs: recheck/{VLLM}/20261206T070000Z/recheck-paired.json: A better, "
            f"recheck/{VLLM}/20261206T090000Z/recheck-paired.json: REFUSED (vLLM refuses trial b)") in rec.reason  # fmt: skip
    assert f"recheck-paired-{VLLM}.json" not in rec.reason and not rec.next_steps
