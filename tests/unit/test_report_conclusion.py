"""A trial's conclusion (checklist section 16): keep, eliminate, or next round."""

from __future__ import annotations

from pathlib import Path

from servetune.report.conclusion import conclude
from tests.builders import demo_trials, level, trial


def test_conclusion_keeps_the_front_eliminates_failures_and_sends_dominated_trials_to_a_next_round():
    costly = trial("costly", {"max_num_seqs": 24, "gpu_memory_utilization": 0.9}, [level(8, 200, 900)])
    trials = [*demo_trials(), costly]
    verdicts = {t.trial_id: conclude(t, trials) for t in trials}
    assert str(verdicts["t16"]) == "keep: on the Pareto front of cost vs P99 TTFT at concurrency 8"
    assert verdicts["t32"].verdict == "keep"
    assert str(verdicts["t64"]).startswith("eliminate: trial FAILED: engine exited with code 1")
    assert verdicts["t256"].verdict == "eliminate"
    assert str(verdicts["costly"]) == (
        "next round: meets the SLO at 1 of 1 levels but is dominated on cost vs P99 TTFT"
    )
    slow = trial("slow", {"max_num_seqs": 8}, [level(8, 300, 9000, violations=("ttft_ms_p99 = 9000 > 2000",))])
    assert str(conclude(slow, [slow])) == "eliminate: broke the SLO at every load level"


def test_the_rule_is_the_one_the_mlflow_record_states():
    from servetune.report import load_study
    from servetune.tracking.record import conclude as record_conclude

    recorded = load_study(Path(__file__).parents[1] / "data" / "cpu-tiny-study").trials
    costly = trial("costly", {"max_num_seqs": 24}, [level(8, 200, 900)])
    for trials in ([*demo_trials(), costly], list(recorded)):
        assert [str(conclude(t, trials)) for t in trials] == [str(record_conclude(t, trials)) for t in trials]


def test_tracking_states_the_rule_from_report():
    from servetune.tracking import record

    assert record.conclude is conclude  # one rule, in report/conclusion.py
