"""The capacity search driven with made-up levels: an engine that meets the SLO below X clients.

TTFT P99 grows as (load / X) ** 8 times the 2000 ms bound, steep enough that a level a whole
client from X stands beyond the 10% noise of a level run once; a test about verdicts near the
bound makes its own.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from servetune.config.slo import Slo
from servetune.load.runner import Level
from servetune.results import Capacity, LevelResult, LevelRun, TrialResult
from servetune.trial.capacity import CapacitySearch
from servetune.trial.ladder import ladder
from tests.builders import level as made_level
from tests.builders import trial

SLO = Slo.parse("ttft_ms.p99=2000")
LADDER = [Level("concurrency", c) for c in (2, 8, 32)]


def result(load: float, ttft_p99: float, out_tps: float | None = None, slo: Slo = SLO, kind: str = "concurrency",
           tpot_p99: float = 40.0, **summary) -> LevelResult:  # fmt: skip
    """One measured level: ``out_tps`` defaults to 100 tok/s per unit of load (no saturation)."""
    made = made_level(load, 100.0 * load if out_tps is None else out_tps, ttft_p99, tpot_p99=tpot_p99)
    made.summary = made.summary.model_copy(update={"level": {kind: load}, **summary})
    return made.model_copy(update={"slo_violations": slo.violations(made.summary)})


def meets_below(capacity: float, **kwargs) -> Callable[[Level], LevelResult]:
    """An engine whose TTFT P99 reaches the 2000 ms bound at ``capacity``."""
    return lambda level: result(level.value, 2000.0 * (level.value / capacity) ** 8, kind=level.kind, **kwargs)


def drive(steps, measure: Callable[[Level], LevelResult]) -> tuple[list[float], str | None]:
    """Run a generator of the ladder's protocol to its end: the loads it measured and what it returned."""
    measured, level = [], next(steps)
    while True:
        measured.append(level.value)
        try:
            level = steps.send(measure(level))
        except StopIteration as stop:
            return measured, stop.value


def search(measure, levels=LADDER, **kwargs) -> tuple[list[float], str | None, CapacitySearch]:
    found = CapacitySearch(levels, kwargs.pop("slo", SLO), **kwargs)
    measured, reason = drive(found.steps(), measure)
    return measured, reason, found


def test_a_bracket_from_the_ladder_is_bisected_to_within_the_tolerance():
    measured, reason, found = search(meets_below(12.5))
    assert measured == [2, 8, 32, 16, 11, 13, 12]  # geometric midpoints, whole clients
    assert reason is None  # the ladder measured every level: its own reason, as today
    capacity = found.capacity
    assert capacity is not None and capacity.value == 12 and capacity.bracket == (12, 13)
    assert capacity.bound == "exact" and capacity.unit == "concurrency" and capacity.extra_levels == 4
    assert capacity.tolerance == 0.10 and capacity.verdict_noise == 0.10  # levels run once
    assert capacity.breaking_slo == "ttft_ms_p99 <= 2000" and capacity.unsettled == []
    assert capacity.slo_margins == pytest.approx((0.96**8 - 1, 1.04**8 - 1))  # 28% inside, 37% over
    assert capacity.ended.startswith("within 10%")


def test_a_ladder_stopped_by_the_slo_keeps_its_reason_and_is_bisected_below_the_break():
    levels = [Level("concurrency", c) for c in (2, 8, 32, 64)]
    measured, reason, found = search(meets_below(12.5), levels)
    assert measured == [2, 8, 32, 16, 11, 13, 12]
    assert reason is not None and reason.startswith("SLO broken at concurrency 32: ttft_ms_p99")
    assert found.capacity.value == 12 and found.capacity.bracket == (12, 13)


def test_a_trial_meeting_the_slo_at_the_top_climbs_by_doubling_then_bisects():
    measured, reason, found = search(meets_below(50))
    assert measured == [2, 8, 32, 64, 45, 54, 49]
    capacity = found.capacity
    assert reason is None and capacity.value == 49 and capacity.bracket == (49, 54) and capacity.bound == "exact"
    assert capacity.ended == "the budget of 4 extra levels is spent"  # 54/49 is still 10.2% apart


def test_a_climb_that_runs_out_of_budget_records_a_lower_bound():
    measured, _, found = search(meets_below(1000), budget=2)
    assert measured == [2, 8, 32, 64, 128]
    capacity = found.capacity
    assert capacity.value == 128 and capacity.bracket == (128, None) and capacity.bound == "lower"
    assert capacity.breaking_slo is None and capacity.extra_levels == 2


def test_a_closed_loop_whose_throughput_stopped_growing_climbs_no_further():
    def measure(level: Level) -> LevelResult:  # meets the SLO everywhere; 8 clients fill the engine
        return result(level.value, 100.0, out_tps=100.0 * min(level.value, 8))

    measured, reason, found = search(measure, min_gain=0.03)
    assert measured == [2, 8, 32] and reason is None  # the ladder does not judge its last level; the search does
    capacity = found.capacity
    assert capacity.bound == "lower" and capacity.value == 32 and capacity.extra_levels == 0
    assert capacity.ended.startswith("saturated at concurrency 32")


def test_a_trial_breaking_the_slo_at_the_first_level_goes_down_by_halving():
    measured, reason, found = search(meets_below(3.5), [Level("concurrency", c) for c in (8, 32)])
    assert measured == [8, 4, 2, 3]
    assert reason.startswith("SLO broken at concurrency 8")
    capacity = found.capacity
    assert capacity.value == 3 and capacity.bracket == (3, 4) and capacity.bound == "exact"
    assert capacity.ended == "no load left between concurrency 3 and concurrency 4"


def test_a_closed_loop_never_goes_below_one_client_and_records_an_upper_bound():
    measured, _, found = search(meets_below(0.5), [Level("concurrency", c) for c in (4, 16)])
    assert measured == [4, 2, 1]
    capacity = found.capacity
    assert capacity.value is None and capacity.bracket == (None, 1) and capacity.bound == "upper"
    assert capacity.ended == "concurrency 1 broke the SLO and no lower load is left"


def test_an_open_loop_halves_its_rate_until_the_budget_is_spent_then_records_an_upper_bound():
    measured, _, found = search(meets_below(0.1), [Level("rate", r, "poisson") for r in (2, 8)], budget=2)
    assert measured == [2, 1, 0.5]
    capacity = found.capacity
    assert capacity.unit == "req/s" and capacity.bound == "upper" and capacity.bracket == (None, 0.5)


def test_an_open_loop_that_falls_behind_its_rate_counts_as_breaking_the_slo():
    def measure(level: Level) -> LevelResult:  # meets the TTFT bound everywhere; keeps up to 5.3 req/s
        behind = level.value > 5.3
        return result(level.value, 500.0, kind="rate", send_span_s=30.0, ttft_growth=0.5 if behind else 0.0,
                      ttft_growth_low=0.4 if behind else -0.01)  # fmt: skip

    measured, reason, found = search(measure, [Level("rate", r, "poisson") for r in (2, 4, 8)])
    assert measured == [2, 4, 8, 5.66, 4.76, 5.19]  # rates to three significant figures
    assert reason is None
    capacity = found.capacity
    assert capacity.value == 5.19 and capacity.bracket == (5.19, 5.66) and capacity.bound == "exact"
    assert capacity.breaking_slo is None  # no bound broke: it fell behind


@pytest.mark.parametrize(
    "measure, levels",
    [
        (meets_below(12.5), LADDER),
        (meets_below(1000), LADDER),
        (meets_below(3.5), [Level("concurrency", c) for c in (8, 32)]),
        (lambda lv: result(lv.value, 100.0, out_tps=100.0 * min(lv.value, 4)), [Level("concurrency", c) for c in (1, 4, 8, 16)]),
    ],
)  # fmt: skip
def test_with_no_budget_it_is_the_ladder(measure, levels):
    plain = drive(ladder(levels, min_gain=0.03), measure)
    measured, reason, found = search(measure, levels, budget=0, min_gain=0.03)
    assert (measured, reason) == plain and found.capacity is None


def test_with_no_budget_the_stop_rule_is_asked_with_the_rest_of_the_ladder_as_today():
    asked = []

    def rule(level: LevelResult, ahead) -> str | None:
        asked.append([lv.value for lv in ahead])
        return None

    search(meets_below(1000), budget=0, stop_rule=rule)
    assert asked == [[8, 32], [32]]


def test_the_stop_rule_sees_the_climb_the_budget_allows_and_ends_the_search():
    asked = []

    def rule(level: LevelResult, ahead) -> str | None:
        asked.append([lv.value for lv in ahead])
        return "dominated at concurrency 64: trial x" if level.summary.level["concurrency"] == 64 else None

    measured, reason, found = search(meets_below(1000), budget=3, stop_rule=rule)
    assert asked == [[8, 32, 64, 128, 256], [32, 64, 128, 256], [64, 128, 256], [128, 256]]
    assert measured == [2, 8, 32, 64] and reason == "dominated at concurrency 64: trial x"
    assert found.capacity.bound == "lower" and found.capacity.value == 64 and found.capacity.ended == reason


def test_a_level_with_no_completed_request_ends_the_search():
    def measure(level: Level) -> LevelResult:
        return result(level.value, 100.0) if level.value < 32 else result(level.value, 100.0, completed=0)

    measured, reason, found = search(measure)
    assert measured == [2, 8, 32] and reason == "no request completed at concurrency 32"
    assert found.capacity.value == 8 and found.capacity.bracket == (8, 32)


def test_an_unsettled_verdict_at_the_bracket_is_measured_again_and_two_that_agree_settle_it():
    # 8 clients meet the bound by 2%, inside the 10% noise of a level run once: unsettled, then met again.
    def measure(level: Level) -> LevelResult:
        return result(level.value, 1960.0 if level.value == 8 else (100.0 if level.value < 8 else 3000.0))

    measured, _, found = search(measure)
    assert measured == [2, 8, 32, 8, 16, 11, 9]  # 8 again, then bisected above it
    capacity = found.capacity
    assert capacity.value == 8 and capacity.bracket == (8, 9) and capacity.unsettled == []
    assert capacity.extra_levels == 4


def test_split_verdicts_within_the_noise_count_as_breaking_the_slo_and_are_listed():
    # The case the other way round: 8 clients meet the bound by 2%, then miss it by 1.5% (507.8 ms).
    slo = Slo.parse("ttft_ms.p95=500")
    runs = {8: [490.0 / 0.95, 507.8 / 0.95]}  # builders.stats: p95 = 0.95 p99

    def measure(level: Level) -> LevelResult:
        p99 = runs[8].pop(0) if level.value == 8 else (200.0 if level.value < 8 else 2000.0)
        return result(level.value, p99, slo=slo)

    measured, _, found = search(measure, slo=slo)
    assert measured == [2, 8, 32, 8, 4, 6, 7]
    capacity = found.capacity
    assert capacity.value == 7 and capacity.bracket == (7, 8) and capacity.bound == "exact"
    assert capacity.unsettled == [8] and capacity.verdict_noise == 0.10
    assert capacity.slo_margins[1] == pytest.approx(0.0156)  # its worse measurement, 1.56% over
    assert capacity.breaking_slo == "ttft_ms_p95 <= 500"  # the bound it came within the noise of


def test_a_break_within_the_noise_is_not_measured_again_and_counts_as_breaking():
    # The case: 8 clients miss the bound by 1.5%. A repeat could only confirm the break or split (both
    # counted as breaking): the bracket would stay (2, 8), so the level goes on bisecting instead.
    slo = Slo.parse("ttft_ms.p95=500")

    def measure(level: Level) -> LevelResult:
        return result(level.value, (507.8 if level.value == 8 else 200.0 if level.value < 8 else 2000.0) / 0.95,
                      slo=slo)  # fmt: skip

    measured, reason, found = search(measure, slo=slo)
    assert measured == [2, 8, 4, 6, 7]  # today's rule measured 8 twice: [2, 8, 8, 4, 6, 7]
    assert reason.startswith("SLO broken at concurrency 8")
    capacity = found.capacity
    assert capacity.value == 7 and capacity.bracket == (7, 8) and capacity.unsettled == [8]
    assert capacity.extra_levels == 3 and capacity.ended == "no load left between concurrency 7 and concurrency 8"
    assert capacity.breaking_slo == "ttft_ms_p95 <= 500"


@pytest.mark.parametrize(("ttfts", "measured_after"), [
    ((1500.0, 1900.0, 2600.0), [23, 19, 17]),  # majority of three met it: decided, the bisection goes on above
    ((1500.0, 1900.0), [16, 23, 19]),  # two runs: no majority to decide by, within the noise, so measured again
])  # fmt: skip
def test_a_level_of_three_runs_is_decided_by_their_majority_however_wide_their_spread(ttfts, measured_after):
    def measure(level: Level) -> LevelResult:  # 16 clients meet the bound by 5%, their runs' P99 TTFT far apart
        made = result(level.value, 1900.0 if level.value == 16 else (100.0 if level.value < 16 else 3000.0))
        runs = [LevelRun(summary=result(level.value, p).summary) for p in ttfts]
        return made.model_copy(update={"runs": runs})

    measured, _, found = search(measure)
    assert measured == [2, 8, 32, 16, *measured_after]
    capacity = found.capacity
    assert capacity.value == 16 and capacity.unsettled == []
    assert capacity.verdict_noise > 0.05  # the spread is still recorded: wider than the margin


def test_an_unsettled_verdict_the_budget_cannot_repeat_counts_as_breaking_and_is_listed():
    def measure(level: Level) -> LevelResult:  # 16 clients meet the bound by 1%: unsettled
        return result(level.value, 1980.0 if level.value == 16 else (100.0 if level.value < 16 else 3000.0))

    measured, _, found = search(measure, budget=1)
    assert measured == [2, 8, 32, 16]
    capacity = found.capacity
    assert capacity.value == 8 and capacity.bracket == (8, 16) and capacity.unsettled == [16]


def test_the_noise_of_repeated_levels_is_their_spread():
    def measure(level: Level) -> LevelResult:  # 16 clients meet the bound by 6%, their three runs 1% apart
        made = result(level.value, 1880.0 if level.value == 16 else (100.0 if level.value < 16 else 3000.0))
        runs = [LevelRun(summary=result(level.value, p).summary) for p in (1870.0, 1880.0, 1890.0)]
        return made.model_copy(update={"runs": runs})

    measured, _, found = search(measure)
    assert measured == [2, 8, 32, 16, 23, 19, 17]  # 16 settled beyond its 5% noise: not measured again
    capacity = found.capacity
    assert capacity.value == 16 and capacity.bracket == (16, 17) and capacity.verdict_noise == pytest.approx(0.05)


def test_breaking_slo_names_the_bound_broken_furthest_at_the_breaking_level():
    slo = Slo.parse("ttft_ms.p99=2000,tpot_ms.p99=100")

    def measure(level: Level) -> LevelResult:  # TPOT breaks first, at 10 clients; TTFT only at 32
        return result(level.value, 2000.0 * (level.value / 20) ** 2, slo=slo, tpot_p99=100.0 * (level.value / 9.5) ** 8)

    _, _, found = search(measure, slo=slo)
    assert found.capacity.breaking_slo == "tpot_ms_p99 <= 100" and found.capacity.value == 9


def test_a_trial_result_without_a_capacity_still_loads_and_one_with_it_round_trips():
    _, _, found = search(meets_below(12.5))
    recorded = trial("t1", {}, [made_level(4, 500, 900)])
    old = json.loads(recorded.model_dump_json())
    old.pop("capacity_at_slo")
    assert TrialResult.model_validate(old).capacity_at_slo is None
    recorded.capacity_at_slo = found.capacity
    again = TrialResult.model_validate_json(recorded.model_dump_json())
    assert again.capacity_at_slo == found.capacity and again.capacity_at_slo.bracket == (12, 13)


def test_the_highest_load_measured_is_found_by_load_once_the_search_went_below_the_ladder():
    from servetune.tracking.fields import chosen_level
    from servetune.verify.checklist import verified_level

    broken = ("ttft_ms_p99 = 3000 > 2000",)
    recorded = trial("t1", {}, [made_level(c, 100 * c, 3000, violations=broken) for c in (8, 4, 2, 1)])
    assert chosen_level(recorded).index == 0 and not chosen_level(recorded).meets_slo
    assert verified_level(recorded, None) == 0


def test_a_load_left_unsettled_is_measured_but_neither_the_trials_best_level_nor_on_a_front():
    """The capacity search counted 32 clients within the noise: its measurement met the SLO, a repeat could as well
    have broken it, so the trial's best level, the report's eligible points and the recommendation stay below it."""
    from servetune.report.points import trial_points
    from servetune.report.recommend import candidates
    from servetune.results import best_level

    ladder_levels = [made_level(8, 400, 300), made_level(16, 700, 600), made_level(32, 1100, 1900)]
    measured = trial("t", {"max_num_seqs": 32}, ladder_levels)
    assert best_level(measured) == 2  # the ladder alone: the cheapest level meeting the SLO is 32
    measured.capacity_at_slo = Capacity(value=16, unit="concurrency", bracket=(16, 32), bound="exact",
                                        tolerance=0.1, unsettled=[32.0])  # fmt: skip
    assert measured.unsettled_loads == {32.0}
    assert best_level(measured) == 1
    points = trial_points(measured)
    assert [p.unsettled for p in points] == [False, False, True] and points[2].meets_slo and not points[2].eligible
    assert [p.level for p in candidates(points)] == [{"concurrency": 16.0}, {"concurrency": 8.0}]


def saturating_at(capacity: float, limit: float) -> Callable[[Level], LevelResult]:
    """An engine meeting the SLO below ``capacity`` whose output throughput stops growing at ``limit`` clients."""
    slo_side = meets_below(capacity)
    return lambda level: result(
        level.value, slo_side(level).summary.ttft_ms.p99, out_tps=100.0 * min(level.value, limit), kind=level.kind
    )


def repeated(made: LevelResult, spread: float) -> LevelResult:
    """``made`` as three runs whose output throughput lies within +-``spread`` of it (``load.repeats: 3``)."""
    runs = [LevelRun(summary=made.summary.model_copy(update={"output_throughput": made.summary.output_throughput * f}))
            for f in (1 - spread, 1.0, 1 + spread)]  # fmt: skip
    return made.model_copy(update={"runs": runs})


def test_a_knee_below_the_capacity_is_bisected_with_what_the_capacity_left_of_the_budget():
    measured, _, found = search(saturating_at(20.5, 4), budget=8, knee_fraction=0.5, min_gain=0.03)
    # the capacity first (5 levels), then the knee the ladder bracketed at (2, 8): 4 grows, 6 does not
    assert measured == [2, 8, 32, 16, 23, 19, 21, 20, 4, 6]
    assert found.capacity.bracket == (20, 21) and found.capacity.extra_levels == 5
    knee = found.knee
    assert knee is not None and knee.value == 4 and knee.bracket == (4, 6) and knee.bound == "exact"
    assert knee.extra_levels == 2 and knee.tolerance == 0.10 and knee.throughput == pytest.approx(400)
    assert knee.gain == 0 and knee.slope_noise == pytest.approx((0.1 + 0.1) / (6 / 4 - 1))
    # levels run once (10% noise each): a step from 4 to 5 clients moves the gain by 0.2 / 0.25 = 0.8
    assert knee.ended == ("within the noise: a step from concurrency 4 to concurrency 5 could not tell a gain of "
                          "0.5 from flat (throughput noise 10% moves its slope by 0.80)")  # fmt: skip


def test_the_knee_bisection_stops_within_the_tolerance_on_an_open_loop():
    def measure(level: Level) -> LevelResult:  # flat past 3 req/s; three runs within 1% (the 5% floor counts)
        return repeated(saturating_at(20.5, 3.0)(level), 0.01)

    levels = [Level("rate", r, "poisson") for r in (1.0, 4.0, 16.0)]
    measured, _, found = search(measure, levels, budget=16, knee_fraction=0.5, min_gain=0.03, tolerance=0.45)
    lo, hi = found.knee.bracket
    # 1 -> 4 req/s still grows at 2/3 of proportional, 4 -> 16 not at all: the ladder brackets the knee at
    # (4, 16), and each load between shows throughput flat, so the bracket closes down on 4
    knee_loads = measured[len(measured) - found.knee.extra_levels :]
    assert measured[:3] == [1, 4, 16] and found.knee.bound == "exact" and found.knee.extra_levels >= 2
    assert found.capacity.ended.startswith("within 45%")
    assert all(4 < x < 16 for x in knee_loads) and knee_loads == sorted(knee_loads, reverse=True)
    assert lo == 4 and hi / lo - 1 <= 0.45 and found.knee.ended.startswith("within 45%")
    assert found.knee.extra_levels + found.capacity.extra_levels == found.extra == len(measured) - 3
    assert found.knee.slope_noise == pytest.approx(0.10 / (hi / lo - 1))  # 5% each


def test_a_knee_left_with_no_budget_keeps_the_ladders_bracket_and_says_why():
    measured, _, found = search(saturating_at(20.5, 4), budget=5, knee_fraction=0.5, min_gain=0.03)
    assert measured == [2, 8, 32, 16, 23, 19, 21, 20]
    assert found.knee.bracket == (2, 8) and found.knee.extra_levels == 0
    assert found.knee.ended == "the budget of 5 extra levels is spent"


def test_a_knee_at_or_above_the_capacity_or_not_bracketed_is_not_searched():
    measured, _, found = search(saturating_at(5.5, 16), budget=8, knee_fraction=0.5)
    assert measured == [2, 8, 4, 6, 5]  # the capacity's levels only
    assert found.knee.bound == "lower" and found.knee.extra_levels == 0
    assert found.knee.ended.startswith("throughput still grew at concurrency 8")

    measured, _, found = search(saturating_at(3.5, 4), [Level("concurrency", c) for c in (2, 8)], budget=8,
                                knee_fraction=0.5)  # fmt: skip
    assert found.capacity.value == 3 and found.knee.bracket == (4, 8) and found.knee.extra_levels == 0
    assert found.knee.ended.endswith("the capacity sets the operating point")


def test_the_stop_rule_ends_the_knee_bisection_too():
    asked: list[float] = []

    def rule(level: LevelResult, ahead) -> str | None:
        asked.append(ahead[0].value)
        return "dominated at concurrency 4" if ahead[0].value == 4 else None

    measured, reason, found = search(saturating_at(20.5, 4), budget=8, knee_fraction=0.5, stop_rule=rule)
    assert measured[-1] == 20 and asked[-1] == 4 and reason == "dominated at concurrency 4"
    assert found.knee.ended == "dominated at concurrency 4" and found.knee.extra_levels == 0
    assert found.capacity.ended.startswith("within 10%")
