"""The ramp's summary: time to scale up, SLO violations per phase and window, and whether a new
replica served before Serve had it RUNNING."""

from __future__ import annotations

import pytest

from servetune.metrics import RequestRecord
from servetune.serve.ramp import RampSample, ramp_phases, replica_seconds, slo_attainment, summarize_ramp

PHASES = ramp_phases(2, max_replicas=2, hold_s=5)
STARTS = {"1x": 0.0, "3x": 10.0, "back to 1x": 40.0}


def sample(t, running, served, starting=0):
    phase = "1x" if t < 10 else "3x" if t < 40 else "back to 1x"
    return RampSample(
        t_s=t, phase=phase, offered=6 if phase == "3x" else 2, running=running, starting=starting, served=served
    )


def request(sent, ttft, ok=True):
    r = RequestRecord(index=0, sent=sent, input_tokens=10, max_tokens=4, output_tokens=4, ok=ok)
    r.chunk_times = [sent + ttft, sent + ttft + 0.01, sent + ttft + 0.02, sent + ttft + 0.03]
    r.end = sent + ttft + 0.03
    return r


def test_scale_up_time_phases_and_a_new_replica_that_waited_for_running():
    samples = [
        sample(1, 1, {"old": 5}), sample(8, 1, {"old": 20}), sample(12, 1, {"old": 30}, starting=1),
        sample(30, 1, {"old": 80}, starting=1), sample(31, 2, {"old": 85}), sample(33, 2, {"old": 90, "new": 4}),
        sample(45, 2, {"old": 95, "new": 9}),
    ]  # fmt: skip
    records = [request(1, 0.05), request(12, 0.5), request(20, 0.9), request(35, 0.05), request(41, 0.05, ok=False)]
    phase_of = ["1x", "3x", "3x", "3x", "back to 1x"]
    s = summarize_ramp(samples, records, phase_of, PHASES, STARTS, {"ttft_ms": 300}, end_s=50)
    assert s["replicas_before"] == 1 and s["replicas_peak"] == 2
    assert s["time_to_scale_up_s"] == pytest.approx(21.0)  # 3x at 10 s, the second replica RUNNING at 31 s
    assert s["new_replicas"] == ["new"] and s["new_replica_first_served_s"] == 33
    assert s["traffic_before_ready"] is False
    assert [(p.name, p.requests, p.slo_violations, p.errors) for p in s["phases"]] == [
        ("1x", 1, 0, 0), ("3x", 3, 2, 0), ("back to 1x", 1, 1, 1),
    ]  # fmt: skip
    assert (s["requests"], s["slo_violations"]) == (5, 3)
    windows = {w.start_s: w for w in s["windows"]}
    assert windows[30.0].running == 2 and windows[30.0].served == {
        "old": 60,
        "new": 4,
    }  # since the last sample before the window (12 s)
    assert windows[0.0].served == {"old": 5}  # no sample before the first window: the counter's own start
    # A replica kept from the step before the ramp had served 2 requests: the first window counts from there.
    kept = summarize_ramp(samples, records, phase_of, PHASES, STARTS, {"ttft_ms": 300}, end_s=50, baseline={"old": 2})
    assert {w.start_s: w for w in kept["windows"]}[0.0].served == {"old": 3}
    assert windows[10.0].slo_violations == 1 and windows[10.0].ttft_ms_p95 == pytest.approx(500)
    assert (windows[20.0].offered, windows[20.0].running, windows[20.0].served) == (6, 1, {})  # no sample: the last one


def test_the_time_to_decide_is_serve_starting_the_replica_apart_from_its_engine_start():
    # 3x at 10 s; Serve starts the second replica at 12 s (the policy's decision), its engine RUNNING at 31 s.
    samples = [sample(8, 1, {}), sample(12, 1, {}, starting=1), sample(30, 1, {}, starting=1), sample(31, 2, {})]
    s = summarize_ramp(samples, [], [], PHASES, STARTS, {}, end_s=50)
    assert s["time_to_decide_s"] == pytest.approx(2.0) and s["time_to_scale_up_s"] == pytest.approx(21.0)
    # A replica that started and came up between two samples: decided when it was first seen, RUNNING.
    quick = summarize_ramp([sample(8, 1, {}), sample(20, 2, {})], [], [], PHASES, STARTS, {}, end_s=50)
    assert quick["time_to_decide_s"] == quick["time_to_scale_up_s"] == pytest.approx(10.0)
    # Started during the 1x phase (8 s, before the 3x at 10 s) and starting until RUNNING: decided 2 s before the 3x.
    early = [sample(5, 1, {}), sample(8, 1, {}, starting=1), sample(12, 1, {}, starting=1), sample(31, 2, {})]
    s = summarize_ramp(early, [], [], PHASES, STARTS, {}, end_s=50)
    assert s["time_to_decide_s"] == pytest.approx(-2.0) and s["replicas_before"] == 1
    # Still starting, never RUNNING: the first sample of the 3x with it, as no scale-up is timed.
    never = summarize_ramp(early[:3], [], [], PHASES, STARTS, {}, end_s=50)
    assert never["time_to_decide_s"] == pytest.approx(2.0) and never["time_to_scale_up_s"] is None


def test_a_new_replica_counted_while_serve_still_ran_one_is_traffic_before_ready():
    samples = [
        sample(5, 1, {"old": 5}),
        sample(20, 1, {"old": 30, "new": 2}, starting=1),
        sample(25, 2, {"old": 40, "new": 8}),
    ]
    s = summarize_ramp(samples, [], [], PHASES, STARTS, {}, end_s=30)
    assert s["traffic_before_ready"] is True and s["new_replica_first_served_s"] == 20
    assert s["time_to_scale_up_s"] == pytest.approx(15.0)


def test_a_ramp_that_never_scales_says_so():
    samples = [sample(5, 1, {"old": 5}), sample(20, 1, {"old": 30}), sample(45, 1, {"old": 60})]
    s = summarize_ramp(samples, [], [], PHASES, STARTS, {}, end_s=50)
    assert s["time_to_scale_up_s"] is None and s["new_replicas"] == [] and s["replicas_peak"] == 1
    assert ramp_phases(4, 1, 3)[1].wait_for_replicas == 0  # nothing to wait for with one replica at most


def test_the_3x_waits_for_the_replicas_serves_in_flight_rule_asks_for_not_more():
    # 1x 2 clients below a target of 3: 3x is 6 in flight, ceil(6 / 3) = 2 replicas, though 3 are allowed.
    assert [p.concurrency for p in ramp_phases(2, 3, 5, target=3)] == [2, 6, 2]
    assert ramp_phases(2, 3, 5, target=3)[1].wait_for_replicas == 2
    assert ramp_phases(5, 2, 5, target=6)[1].wait_for_replicas == 2  # ceil(15 / 6) = 3, capped at 2
    assert ramp_phases(5, 3, 5, target=6)[1].wait_for_replicas == 3
    assert ramp_phases(2, 3, 5)[1].wait_for_replicas == 3  # no target: every replica allowed


def test_replica_seconds_hold_each_samples_replicas_until_the_next_and_count_starting_ones():
    samples = [sample(0, 1, {}), sample(10, 1, {}, starting=1), sample(20, 2, {}), sample(30, 1, {})]
    # 1 x 10 s, then 2 (one starting) x 10 s, 2 x 10 s, 1 x the last 5 s
    assert replica_seconds(samples, end_s=35) == pytest.approx(10 + 20 + 20 + 5)
    assert replica_seconds(list(reversed(samples)), end_s=35) == pytest.approx(55)  # order of arrival does not matter
    assert replica_seconds(samples, end_s=15) == pytest.approx(10 + 2 * 5)  # a sample past the end adds nothing
    assert replica_seconds([], end_s=35) == 0.0


def test_attainment_counts_failed_and_slow_requests_as_broken():
    samples = [sample(1, 1, {"old": 1}), sample(45, 2, {"old": 2})]
    records = [request(1, 0.05), request(12, 0.5), request(35, 0.05), request(41, 0.05, ok=False)]
    s = summarize_ramp(samples, records, ["1x", "3x", "3x", "back to 1x"], PHASES, STARTS, {"ttft_ms": 300}, end_s=50)
    assert s["slo_violations"] == 2 and s["slo_attainment"] == pytest.approx(2 / 4)
    assert s["replica_seconds"] == pytest.approx(1 * 44 + 2 * 5)
    assert slo_attainment(0, 0) is None
