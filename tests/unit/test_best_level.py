"""A trial's best level is worked out once (results.py ``best_level``, and ``chosen_level`` for the level its numbers
are shown at), and every reader asks it: the report's trial table, ``export --pick TRIAL_ID``, MLflow's tags, verify's
default level and the search's objectives. The trials below are those on which the readers used to disagree."""

from __future__ import annotations

import pytest

from servetune.config.slo import Slo
from servetune.report import build_report, load_study
from servetune.report.export import pick_point
from servetune.report.points import level_label
from servetune.results import Capacity, TrialResult, best_level, chosen_level
from servetune.study.objectives import told_level
from servetune.tracking.fields import level_tags
from servetune.verify.checklist import verified_level
from tests.builders import level, study_info, trial, write_study

BROKEN = ("ttft_ms_p99 = 3000 > 2000",)


def unsettled_top() -> TrialResult:
    """Three levels meeting the SLO; the capacity search left the top one (32, the highest goodput) unsettled."""
    t = trial("unsettled", {"max_num_seqs": 32}, [level(8, 400, 300), level(16, 700, 600), level(32, 1100, 1900)])
    t.capacity_at_slo = Capacity(value=16, unit="concurrency", bracket=(16, 32), bound="exact", tolerance=0.1,
                                 unsettled=[32.0])  # fmt: skip
    return t


def best_below_the_top() -> TrialResult:
    """Both levels meet the SLO; 8 clients give more goodput than 16 (a saturated engine), so 8 is best."""
    return trial("below", {"max_num_seqs": 8}, [level(8, 400, 300), level(16, 300, 900)])


def never_met_searched_down() -> TrialResult:
    """No level met the SLO, and the capacity search went below the ladder's first level: measured 8, 4, 2, 1."""
    return trial("never", {"max_num_seqs": 64}, [level(c, 100 * c, 3000, violations=BROKEN) for c in (8, 4, 2, 1)])


@pytest.mark.parametrize(
    ("made", "best", "chosen"),
    [(unsettled_top, 1, (1, True)), (best_below_the_top, 0, (0, True)), (never_met_searched_down, None, (0, False))],
)
def test_the_best_level_is_the_highest_goodput_meeting_the_slo_and_settled_else_the_numbers_are_at_the_highest_load(
    made, best, chosen
):
    t = made()
    assert best_level(t) == best
    assert (chosen_level(t).index, chosen_level(t).meets_slo) == chosen


def test_levels_without_a_completed_request_or_without_goodput_are_judged_by_the_same_rule():
    empty = level(32, 0, 100)
    empty.summary.completed = 0  # met the SLO with nothing completed: not a level to ship
    t = trial("t", {}, [level(8, 400, 300), empty])
    assert best_level(t) == 0
    no_goodput = trial("g", {}, [level(8, 400, 300), level(16, 600, 400)])
    for lv in no_goodput.levels:
        lv.summary.goodput = None  # no per-request SLO: request throughput decides
    assert best_level(no_goodput) == 1
    assert best_level(trial("none", {}, [])) is None and chosen_level(trial("none", {}, [])) is None


def test_the_rule_reads_the_levels_not_a_stale_record():
    """A result.json written by an older servetune records the unsettled top as best; it reads as the rule says."""
    t = unsettled_top()
    t.best_level_index = 2
    assert best_level(t) == 1 and t.best is not None and t.best.level_index == 1


def test_every_reader_names_the_same_level(tmp_path):
    trials = [unsettled_top(), best_below_the_top(), never_met_searched_down()]
    report = build_report(load_study(write_study(tmp_path / "study", study_info(), trials)))
    rows = {row.trial_id: row for row in report.trial_table}
    slo = Slo.parse("ttft_ms.p99=2000,tpot_ms.p99=100")
    for t in trials:
        chosen = chosen_level(t)
        assert chosen is not None
        label = level_label(t.levels[chosen.index].summary.level)
        best = best_level(t)
        assert rows[t.trial_id].best_level == (level_label(t.levels[best].summary.level) if best is not None else None)
        assert rows[t.trial_id].numbers_level == label  # the report's table of all trials
        assert pick_point(report, t.trial_id).level_index == chosen.index  # export --pick TRIAL_ID
        assert level_tags(t)["servetune.level"] == label  # MLflow
        assert verified_level(t, None) == chosen.index  # verify, when it was not told a level
        if best is not None:
            assert told_level(t, slo) == best  # what the search is told
