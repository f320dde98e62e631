"""The knee: where a trial's output throughput stops growing with load (results.py ``find_knee``)."""

from __future__ import annotations

import pytest

from servetune.results import LevelRun, TrialResult, find_knee
from servetune.tracking.fields import trial_metrics
from tests.builders import trial
from tests.unit.test_capacity_search import result


def saturating(load: float, limit: float) -> float:
    """Output tok/s of an engine that serves 100 tok/s per client up to ``limit`` clients, then no more."""
    return 100.0 * min(load, limit)


@pytest.mark.parametrize(("limit", "expected"), [(3.0, 4.0), (8.0, 8.0), (20.0, 16.0)])
def test_the_knee_is_the_lowest_load_past_which_throughput_grows_less_than_half_as_fast(limit, expected):
    loads = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
    knee = find_knee([result(x, 100.0, out_tps=saturating(x, limit)) for x in loads])
    # limit 3: 2 -> 4 clients still gains half of proportional (200 -> 300), 4 -> 8 nothing
    assert knee is not None and knee.bound == "exact" and knee.unit == "concurrency"
    assert knee.value == expected and knee.bracket == (expected, 2 * expected)
    assert knee.throughput == pytest.approx(saturating(expected, limit))


def test_the_fraction_decides_how_flat_a_step_must_be():
    # throughput grows by 60% of proportional from 4 to 8 clients (400 -> 640), then flat
    levels = [result(2, 100, out_tps=200), result(4, 100, out_tps=400), result(8, 100, out_tps=640),
              result(16, 100, out_tps=650)]  # fmt: skip
    assert find_knee(levels, fraction=0.5).value == 8  # 60% is still growth at half
    assert find_knee(levels, fraction=0.7).value == 4  # not at 70%


def test_throughput_that_keeps_growing_gives_a_lower_bound_at_the_top():
    knee = find_knee([result(x, 100.0, kind="rate") for x in (1.0, 2.0, 4.0)])
    assert knee is not None and knee.bound == "lower" and knee.bracket == (4.0, None) and knee.unit == "req/s"


def test_loads_are_taken_in_order_and_repeats_at_their_mean():
    # measured as the capacity search does: out of order, the 4-client load twice
    levels = [result(2, 100, out_tps=200), result(8, 100, out_tps=420), result(4, 100, out_tps=300),
              result(4, 100, out_tps=500)]  # fmt: skip
    knee = find_knee(levels)
    assert knee.value == 4 and knee.throughput == pytest.approx(400) and knee.bracket == (4, 8)


def test_no_level_no_knee():
    assert find_knee([]) is None


def test_a_result_from_before_schema_8_reads_its_knee_from_its_levels_and_mlflow_logs_it():
    recorded = trial("t1", {}, [result(x, 100.0, out_tps=saturating(x, 4)) for x in (1.0, 2.0, 4.0, 8.0)])
    old = TrialResult.model_validate({k: v for k, v in recorded.model_dump(mode="json").items() if k != "knee"})
    assert old.knee is None and old.knee_found is not None and old.knee_found.value == 4
    metrics = {point.key: point.value for point in trial_metrics(old)}
    assert metrics["knee"] == 4 and metrics["knee/output_throughput"] == pytest.approx(400)


def test_the_report_shows_the_knee_beside_the_capacity():
    from servetune.report.labels import TRIAL_HEADINGS, knee_text

    assert TRIAL_HEADINGS.index("knee") == TRIAL_HEADINGS.index("capacity at the SLO") + 1
    levels = [result(x, 100.0, out_tps=saturating(x, 8)) for x in (2.0, 4.0, 8.0, 16.0)]
    assert knee_text(find_knee(levels)).startswith("8 clients at 800 tok/s (to 16:")
    assert knee_text(find_knee(levels[:2])) == ">= 4 clients (still growing)"
    assert knee_text(None) == "-"


def test_the_knee_records_the_gain_that_decided_it_and_how_far_noise_could_move_it():
    levels = [result(2, 100, out_tps=200), result(8, 100, out_tps=400), result(32, 100, out_tps=400)]
    knee = find_knee(levels)  # 2 -> 8 clients: throughput x2 for a load x4, a gain of 1/3
    assert knee.value == 2 and knee.gain == pytest.approx(1 / 3)
    assert knee.slope_noise == pytest.approx(2 * (0.10 + 0.10) / 3)  # run once: 10% each
    spread = [made.model_copy(update={"runs": [LevelRun(summary=made.summary.model_copy(
        update={"output_throughput": made.summary.output_throughput * f})) for f in (0.92, 1.0, 1.08)]})
        for made in levels]  # fmt: skip
    assert find_knee(spread).slope_noise == pytest.approx(2 * (0.08 + 0.08) / 3)  # their measured spread
    assert find_knee([result(x, 100.0) for x in (1.0, 2.0)]).slope_noise is None  # a lower bound: no step decided it
