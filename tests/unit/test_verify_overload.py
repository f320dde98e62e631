"""The overload scenario's verdict from its requests (verify/overload.py ``judge_overload``)."""

from __future__ import annotations

import asyncio
import time

from servetune.load.pace import STALL_BOUND_S, LoopStalls
from servetune.metrics import RequestRecord
from servetune.verify.document import EngineRun, stability
from servetune.verify.overload import judge_overload
from tests import builders


def served(i: int, sent: float, ttft_s: float) -> RequestRecord:
    return builders.served(i, sent, ttft_s, tail_s=0.1)


def turned_away(i: int, sent: float, after_s: float = 0.002) -> RequestRecord:
    return builders.lost(i, sent, after_s, error="HTTP 503: busy")


OVER = [served(i, 0.1 * i, 0.2) for i in range(10)] + [turned_away(10 + i, 0.1 * i + 0.05) for i in range(5)]
AFTER = [served(i, 0.2 * i, 0.05) for i in range(9)]


def test_quick_refusals_timely_admissions_and_a_recovery_pass():
    result = judge_overload(OVER, AFTER, wait_s=0.5, rate=10.0)
    assert result.passed, result.reason
    assert result.numbers["refused"] == 5 and result.numbers["admitted"] == 10 and result.numbers["recovery_s"] == 0.0


def test_no_refusal_is_no_bound():
    result = judge_overload(OVER[:10], AFTER, wait_s=0.5, rate=10.0)
    assert not result.passed and "no bound on the queue" in result.reason


def test_slow_refusals_late_admissions_and_no_recovery_each_fail():
    slow = [*OVER[:10], *(turned_away(20 + i, 0.1 * i, after_s=0.9) for i in range(5))]
    assert "refusals took" in judge_overload(slow, AFTER, 0.5, 10.0).reason
    late = [served(i, 0.1 * i, 0.8) for i in range(10)] + OVER[10:]
    assert "broke the bound" in judge_overload(late, AFTER, 0.5, 10.0).reason
    stuck = [*AFTER[:6], *(turned_away(30 + i, 1.2 + 0.2 * i) for i in range(3))]
    result = judge_overload(OVER, stuck, 0.5, 10.0)
    assert not result.passed and "not recovered" in result.reason and result.numbers["recovery_s"] > 1.2


def test_admitted_requests_over_the_bound_within_the_noise_pass_and_say_so_beyond_it_fail():
    near = [served(i, 0.1 * i, 0.53) for i in range(10)] + OVER[10:]  # P99 TTFT 530 ms against 500: 6% over
    result = judge_overload(near, AFTER, 0.5, 10.0, noise=0.10)
    assert result.passed and "over the bound 500 ms by 6%, within the noise 10%" in result.reason
    assert result.numbers["ttft_noise"] == 0.10
    beyond = judge_overload(near, AFTER, 0.5, 10.0, noise=0.05)
    assert not beyond.passed and "beyond the noise (5%)" in beyond.reason


def test_the_refusals_it_asked_for_are_not_the_services_5xx_rate(tmp_path):
    result = judge_overload(OVER, [*AFTER, turned_away(99, 1.0)], wait_s=0.5, rate=10.0)
    assert result.numbers["requests"] == 25 and result.numbers["http_5xx"] == 6
    elsewhere = [served(100 + i, i, 0.1) for i in range(19)] + [turned_away(200, 3.0)]  # the other scenarios
    every = OVER + AFTER + [turned_away(99, 1.0)] + elsewhere
    run = EngineRun("t", tmp_path / "engine.log")
    measured = stability({"overload": result}, every, run)
    assert measured["requests"] == 20 and measured["error_rate_5xx"] == 1 / 20
    assert stability({}, every, run)["error_rate_5xx"] == 7 / 45  # without the scenario, every 503 counts


def test_a_failure_the_clients_own_stall_accounts_for_is_unsettled_one_beyond_it_is_the_bounds():
    # refusals answered 0.9 s after they were sent, against a bound of 0.5 s (bench/overload_trace.py: 503s vLLM
    # decided in ~10 ms, read 1.2-1.6 s late by a client whose process did not run for up to 1.6 s)
    slow = [*OVER[:10], *(turned_away(20 + i, 0.1 * i, after_s=0.9) for i in range(5))]
    stalled = judge_overload(slow, AFTER, 0.5, 10.0, stall_s=0.6, stalled_s=1.5)
    assert not stalled.passed and stalled.numbers["unsettled"] is True
    assert "unsettled, the load client itself stalled for up to 600 ms" in stalled.reason
    assert stalled.numbers["client_stall_ms_max"] == 600.0 and stalled.numbers["client_stalled_s"] == 1.5
    short = judge_overload(slow, AFTER, 0.5, 10.0, stall_s=0.2)  # 0.9 - 0.2 s is still past the bound
    assert not short.passed and not short.numbers["unsettled"] and "refusals took" in short.reason
    assert "stalled for up to 200 ms" in short.reason
    # late admissions and a late recovery alike; a refusal in the recovery's tail is the engine's, stall or none
    late = [served(i, 0.1 * i, 0.8) for i in range(10)] + OVER[10:]
    assert judge_overload(late, AFTER, 0.5, 10.0, stall_s=0.5).numbers["unsettled"] is True
    tail_late = [*AFTER[:6], *(served(40 + i, 1.2 + 0.2 * i, 0.7) for i in range(3))]
    assert judge_overload(OVER, tail_late, 0.5, 10.0, stall_s=0.3).numbers["unsettled"] is True
    stuck = [*AFTER[:6], *(turned_away(30 + i, 1.2 + 0.2 * i) for i in range(3))]
    assert not judge_overload(OVER, stuck, 0.5, 10.0, stall_s=5.0).numbers["unsettled"]
    # an engine that refused nothing has no bound, however long the client stalled
    assert "no bound on the queue" in judge_overload(OVER[:10], AFTER, 0.5, 10.0, stall_s=5.0).reason


def test_the_clients_stalls_are_the_loops_wake_ups_past_the_send_lag_bound():
    async def blocked() -> LoopStalls:
        async with LoopStalls() as stalls:
            await asyncio.sleep(0.03)
            time.sleep(0.3)  # the loop does not run: as a process the host does not schedule
            await asyncio.sleep(0.03)
        return stalls

    stalls = asyncio.run(blocked())
    assert (
        stalls.longest_s >= 0.25
        and stalls.total_s >= stalls.longest_s
        and all(s > STALL_BOUND_S for s in stalls.stalls)
    )
