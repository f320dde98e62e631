"""Speculative decoding's gain by load against the same configuration without a drafter (report/speculation.py)."""

from __future__ import annotations

from servetune.report.build import build_report
from servetune.report.html import render_html
from servetune.report.markdown import render_markdown
from servetune.report.speculation import gain_lines, speculative_pairs
from servetune.report.study import load_study
from tests.builders import level, study_info, trial, write_study

PLAIN = {"max_num_seqs": 64, "speculative.method": "none"}
NGRAM = {"max_num_seqs": 64, "speculative.method": "ngram", "speculative.num_speculative_tokens": 5}


def levels(*throughputs, tpot=(20.0, 20.0, 20.0)):
    return [level(c, t, 300, tpot_mean=m) for c, t, m in zip((1, 8, 32), throughputs, tpot, strict=True)]


def test_each_load_both_measured_is_a_gain_a_loss_or_within_the_noise_and_the_turn_is_named():
    plain = trial("plain", PLAIN, levels(100, 600, 1500))
    drafted = trial("ngram", NGRAM, levels(160, 630, 1100, tpot=(12.0, 19.0, 27.0)))
    (pair,) = speculative_pairs([plain, drafted])
    assert (pair.trial_id, pair.baseline_id, pair.method) == ("ngram", "plain", "ngram")
    # run once: 10% noise each side, so a gain must pass 20%
    assert [r.verdict for r in pair.loads] == ["gain", "within the noise", "loss"]
    assert pair.loads[0].tpot_ratio == 12.0 / 20.0 and pair.turns_negative_at == 32
    (line,) = gain_lines([plain, drafted])
    assert "1 clients: +60% (gain" in line and "the gain turns negative from 32 clients" in line


def test_a_loss_the_highest_load_recovers_from_is_no_turn():
    plain = trial("plain", PLAIN, levels(100, 600, 1500))
    drafted = trial("ngram", NGRAM, levels(160, 400, 1600))
    (pair,) = speculative_pairs([plain, drafted])
    assert [r.verdict for r in pair.loads] == ["gain", "loss", "within the noise"]
    assert pair.turns_negative_at is None
    assert gain_lines([plain, drafted])[0].endswith("no load measured loses beyond the noise")


def test_without_a_trial_of_the_same_other_parameters_there_is_nothing_to_compare():
    other = trial("plain", {**PLAIN, "max_num_seqs": 128}, levels(100, 600, 1500))
    drafted = trial("ngram", NGRAM, levels(160, 630, 1100))
    assert speculative_pairs([other, drafted]) == [] and gain_lines([drafted]) == []


def test_the_report_shows_the_gain_under_speculative_decoding(tmp_path):
    trials = [trial("plain", PLAIN, levels(100, 600, 1500)), trial("ngram", NGRAM, levels(160, 630, 1100))]
    report = build_report(load_study(write_study(tmp_path / "s", study_info(), trials)))
    text = render_markdown(report)
    section = text.split("### Speculative decoding", 1)[1]
    assert "trial ngram (method=ngram, num_speculative_tokens=5) against plain" in section
    assert "without a drafter, at each load both measured" in section
    html = render_html(report)
    assert "<h3>Speculative decoding</h3>" in html and "the gain turns negative from 32 clients" in html
