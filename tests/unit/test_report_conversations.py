"""The report's per-conversation tables for the recommended trial's multi-turn levels (issue #41 item 7)."""

from __future__ import annotations

from servetune.metrics import RequestRecord
from servetune.report import build_report, load_study, render_markdown
from servetune.report.html import render_html
from servetune.summary import ConversationStats
from tests.builders import demo_trials, study_info, write_study


def turn(index, session, turn, sent, ttft, e2el, prompt, cached):
    return RequestRecord(index=index, sent=sent, input_tokens=prompt, max_tokens=4, chunk_times=[sent + ttft, sent + e2el],
                         end=sent + e2el, prompt_tokens=prompt, output_tokens=4, ok=True, session=session, turn=turn,
                         cached_tokens=cached)  # fmt: skip


def talks(cached_second: int | None) -> ConversationStats:
    # two conversations of two turns, ending at 3.0 s and 2.0 s after 1.0 s and 0.5 s between their turns; the
    # second turns' prompts begin with the first's
    records = [turn(0, 0, 0, 0.0, 0.1, 1.0, 100, 0), turn(1, 0, 1, 2.0, 0.3, 1.0, 200, cached_second),
               turn(2, 1, 0, 0.0, 0.1, 1.0, 100, 0), turn(3, 1, 1, 1.5, 0.1, 0.5, 200, cached_second)]  # fmt: skip
    stats = ConversationStats.of(records)
    assert stats is not None
    return stats


def study_with(tmp_path, stats_by_level):
    trials = demo_trials()
    for level, stats in zip(trials[0].levels, stats_by_level, strict=True):
        level.summary.conversations = stats
    return build_report(load_study(write_study(tmp_path / "s", study_info(), trials)))


def test_each_multi_turn_level_of_the_recommended_trial_gets_its_tables(tmp_path):
    report = study_with(tmp_path, [talks(96), talks(None)])
    assert report.recommendation.point.trial_id == "t16"
    assert [t.level for t in report.conversations] == ["concurrency 8", "concurrency 16"]
    md = render_markdown(report)
    section = md.split("### Conversations of the recommended trial (t16)")[1]
    assert "concurrency 8: 2 conversations. E2E includes the time between turns: 0.75 s per conversation" in section
    e2e = next(line for line in section.splitlines() if line.startswith("| E2E"))
    assert e2e.split(" | ")[1] == "2500"  # 0 -> 3.0 s and 0 -> 2.0 s: the mean, think time included
    worst = next(line for line in section.splitlines() if line.startswith("| TTFT, its worst turn"))
    assert worst.split(" | ")[1] == "200"  # 300 and 100 ms
    turns = [line for line in section.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert turns[:2] == ["| 1 | 2 | 100 | 100 | 0% |", "| 2 | 2 | 200 | 200 | 48% |"]
    assert turns[3] == "| 2 | 2 | 200 | 200 | not reported |"  # the second level's engine did not say
    html = render_html(report)
    assert "id='conversations'" in html and "not reported" in html


def test_a_study_without_conversations_has_no_such_section(tmp_path):
    report = study_with(tmp_path, [None, None])
    assert report.conversations == ()
    assert "Conversations" not in render_markdown(report) and "id='conversations'" not in render_html(report)
