"""A trial's best level is worked out once (results.py ``best_level``, and ``chosen_level`` for the level its numbers
are shown at), and every reader asks it: the report's trial table, ``export --pick TRIAL_ID``, MLflow's tags, verify's
default level and the search's objectives. The trials below are those on which the readers used to disagree."""

from __future__ import annotations

import pytest

from servetune.config.settings import Objective
from servetune.config.slo import Slo
from servetune.metrics import COST_METRIC, GOODPUT
from servetune.report import build_report, load_study
from servetune.report.export import pick_point
from servetune.report.points import level_label
from servetune.results import Capacity, TrialResult, best_level, chosen_level
from servetune.study.objectives import objectives_and_constraints, told_level
from servetune.tracking.fields import level_tags, trial_metrics
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


def capacity_above_the_best(bound: str = "exact") -> TrialResult:
    """8 clients give more goodput than 16 (a saturated engine), both meet the SLO, 32 broke it: the capacity
    search's bracket is (16, 32), so its capacity is 16 and its best goodput below it, at 8. ``bound`` "lower":
    the same levels, as a search that found no load breaking the SLO (32 left out) records them."""
    levels = [level(8, 600, 300), level(16, 500, 900)]
    if bound == "exact":
        levels.append(level(32, 550, 3000, violations=BROKEN))
    t = trial(f"cap-{bound}", {"max_num_seqs": 16}, levels)
    t.capacity_at_slo = Capacity(value=16, unit="concurrency", bracket=(16, 32 if bound == "exact" else None),
                                 bound=bound, tolerance=0.1)  # fmt: skip
    return t


def readers(t: TrialResult, tmp_path) -> dict[str, object]:
    """The level (or its numbers) each reader takes as the trial's headline."""
    report = build_report(load_study(write_study(tmp_path / t.trial_id, study_info(), [t])))
    row = next(r for r in report.trial_table if r.trial_id == t.trial_id)
    plain = {m.key: m.value for m in trial_metrics(t) if m.step == 0}
    objectives = (Objective(metric="goodput", mode="max"), Objective(metric=COST_METRIC, mode="min"))
    told, _ = objectives_and_constraints(t, objectives, Slo.parse("ttft_ms.p99=2000,tpot_ms.p99=100"))
    return {
        "best_level": best_level(t),
        "mlflow level_index": plain["level_index"],
        "mlflow goodput": plain[GOODPUT],
        "mlflow level": level_tags(t)["servetune.level"],
        "report row": (row.best_level, row.numbers_level),
        "report goodput": row.values[GOODPUT],
        "export --pick": pick_point(report, t.trial_id).level_index,
        "verify": verified_level(t, None),
        "search told": told_level(t, Slo.parse("ttft_ms.p99=2000,tpot_ms.p99=100")),
        "objectives": told,
    }


def test_a_trial_is_judged_at_its_capacity_where_its_best_goodput_lies_below_it(tmp_path):
    t = capacity_above_the_best()
    at = t.operating_points()[1].metrics
    assert readers(t, tmp_path) == {
        "best_level": 1,
        "mlflow level_index": 1,
        "mlflow goodput": pytest.approx(500 / 60, abs=1e-3),
        "mlflow level": "concurrency 16",
        "report row": ("concurrency 16", "concurrency 16"),
        "report goodput": pytest.approx(500 / 60),
        "export --pick": 1,
        "verify": 1,
        "search told": 1,
        "objectives": [pytest.approx(500 / 60), pytest.approx(at[COST_METRIC])],
    }
    chosen = chosen_level(t)
    assert chosen is not None and chosen.rule == "capacity"
    assert level_tags(t)["servetune.level_choice"] == "level at the capacity at the SLO"


@pytest.mark.parametrize("capacity", ["lower", None])
def test_a_trial_with_only_a_lower_bound_or_no_capacity_is_judged_at_its_best_goodput(tmp_path, capacity):
    t = capacity_above_the_best("lower")
    if capacity is None:
        t.capacity_at_slo = None  # a result.json from before the capacity search
    at = t.operating_points()[0].metrics
    assert readers(t, tmp_path) == {
        "best_level": 0,
        "mlflow level_index": 0,
        "mlflow goodput": pytest.approx(600 / 60, abs=1e-3),
        "mlflow level": "concurrency 8",
        "report row": ("concurrency 8", "concurrency 8"),
        "report goodput": pytest.approx(600 / 60),
        "export --pick": 0,
        "verify": 0,
        "search told": 0,
        "objectives": [pytest.approx(600 / 60), pytest.approx(at[COST_METRIC])],
    }
    assert level_tags(t)["servetune.level_choice"] == "best level meeting the SLO"


def test_a_capacity_level_the_client_fell_behind_at_or_left_unsettled_is_no_headline():
    """The capacity's level is the headline only where it takes an SLO verdict: otherwise today's rule."""
    t = capacity_above_the_best()
    t.levels[1].client_bound = "send lag"
    assert best_level(t) == 0
    t = capacity_above_the_best()
    t.capacity_at_slo.unsettled = [16.0]
    assert best_level(t) == 0
