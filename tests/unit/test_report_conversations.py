"""The report's per-conversation tables for the recommended trial's multi-turn levels (issue #41 item 7)."""

from __future__ import annotations

from servetune.metrics import RequestRecord
from servetune.report import build_report, load_study, render_markdown
from servetune.report.conversations import ConversationTable, hit_rates_text
from servetune.report.html import render_html
from servetune.summary import ConversationStats
from tests.builders import demo_trials, study_info, write_study


def turn(index, session, turn, sent, ttft, e2el, prompt, cached):
    return RequestRecord(index=index, sent=sent, input_tokens=prompt, max_tokens=4, chunk_times=[sent + ttft, sent + e2el],
                         end=sent + e2el, prompt_tokens=prompt, output_tokens=4, ok=True, session=session, turn=turn,
                         cached_tokens=cached)  # fmt: skip


def talks(cached_second: int | None, cached_first: int | None = 0) -> ConversationStats:
    # two conversations of two turns, ending at 3.0 s and 2.0 s after 1.0 s and 0.5 s between their turns; the
    # second turns' prompts begin with the first's
    records = [turn(0, 0, 0, 0.0, 0.1, 1.0, 100, cached_first), turn(1, 0, 1, 2.0, 0.3, 1.0, 200, cached_second),
               turn(2, 1, 0, 0.0, 0.1, 1.0, 100, cached_first), turn(3, 1, 1, 1.5, 0.1, 0.5, 200, cached_second)]  # fmt: skip
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


def study_of_every_trial(tmp_path, broken=False):
    trials = demo_trials()  # t16 (two levels) is recommended; t32 (three levels) is not
    for t in trials[:2]:
        for index, lv in enumerate(t.levels):
            lv.summary.conversations = talks(96 if index == 0 else None)
            if broken:  # no level meets the SLO: nothing is recommended
                lv.slo_violations = ["ttft_ms_p99 = 3000 > 2000"]
    return build_report(load_study(write_study(tmp_path / "s", study_info(), trials)))


def test_every_trial_with_conversations_gets_a_row_per_level_the_recommended_first(tmp_path):
    report = study_of_every_trial(tmp_path)
    assert [t.trial_id for t in report.conversations] == ["t16", "t16"]  # in full, as before
    assert [(t.trial_id, t.level) for t in report.every_conversation] == [
        ("t16", "concurrency 8"), ("t16", "concurrency 16"),
        ("t32", "concurrency 16"), ("t32", "concurrency 32"), ("t32", "concurrency 64"),
    ]  # fmt: skip
    md = render_markdown(report)
    assert md.index("### Conversations of the recommended trial (t16)") < md.index("### Conversations of every trial")
    rows = [
        line
        for line in md.split("### Conversations of every trial")[1].splitlines()
        if line.startswith(("| t16", "| t32"))
    ]
    # conversations; TTFT mean of turns (200, 100 ms) P50, P95; worst turn (300, 100) P95; E2E (3.0, 2.0 s) P50,
    # P95; hit rate by turn (numpy percentiles, linear)
    assert rows[0].split(" | ")[2:] == ["2", "150", "195", "290", "2500", "2950", "0% / 48% |"]
    assert rows[2].startswith("| t32 | concurrency 16 | 2 |") and rows[2].endswith("| 0% / 48% |")
    assert rows[3].endswith("| 0% / - |")  # the second turns' answers gave no cached tokens
    html = render_html(report)
    assert "<details><summary>Conversations of every trial (2), a row per level</summary>" in html
    assert "<tr class='recommended'><td>t16</td><td>concurrency 8</td><td>2</td>" in html


def test_a_study_without_a_recommendation_shows_every_trials_conversations(tmp_path):
    report = study_of_every_trial(tmp_path, broken=True)
    assert report.recommendation.point is None and report.conversations == ()
    assert len(report.every_conversation) == 5
    md = render_markdown(report)
    assert "Conversations of the recommended trial" not in md
    section = md.split("### Conversations of every trial")[1]
    assert sum(line.startswith(("| t16 |", "| t32 |")) for line in section.splitlines()) == 5
    html = render_html(report)
    assert "<h2 id='conversations'>Conversations</h2>" in html and "<details open>" in html


def test_only_the_recommended_trial_with_conversations_adds_no_rows_of_every_trial(tmp_path):
    report = study_with(tmp_path, [talks(96), talks(None)])
    assert len(report.every_conversation) == 2
    assert "Conversations of every trial" not in render_markdown(report)
    assert "every-conversation" not in render_html(report)


def test_a_level_whose_engine_reported_no_cached_tokens_says_so_in_its_row():
    assert hit_rates_text(ConversationTable("t", "concurrency 2", talks(None, cached_first=None))) == "not reported"
    assert hit_rates_text(ConversationTable("t", "concurrency 2", talks(96))) == "0% / 48%"
