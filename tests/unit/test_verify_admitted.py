"""The burst under admission bounds (verify/admitted.py): refusals the bounds explain are theirs, not errors; the
admitted must meet the SLO, the refusals be quick, and a refusal the bounds cannot have made fails the burst."""

from __future__ import annotations

import asyncio

from servetune.config.slo import Slo
from servetune.load.runner import Level
from servetune.metrics import RequestRecord
from servetune.results import LevelResult
from servetune.summary import summarize
from servetune.verify import scenarios
from servetune.verify.admitted import bounds_of, explained, judge_admitted
from servetune.verify.document import EngineRun, stability
from servetune.verify.scenarios import Budget, Target, burst
from tests import builders

SLO = Slo.parse("ttft_ms.p99=500")
LEVEL = {"request_rate": 10.0}


def served(i: int, sent: float, ttft_s: float = 0.1) -> RequestRecord:
    return builders.served(i, sent, ttft_s, tail_s=0.4)


def turned_away(i: int, sent: float, after_s: float = 0.002) -> RequestRecord:
    return builders.lost(i, sent, after_s, error="HTTP 503: The engine is currently busy")


# A burst of four at 0-0.03 s, each in flight until ~0.5 s, two refused inside it, then quiet arrivals.
BURST = [served(i, 0.01 * i) for i in range(4)] + [turned_away(4, 0.2), turned_away(5, 0.3)]
QUIET = [served(10 + i, 1.0 + 0.6 * i) for i in range(14)]
RECORDS = BURST + QUIET


def judge(records, bounds, slo=SLO, noise=0.10, error_bound=0.001):
    return judge_admitted(records, bounds, slo, LEVEL, wait_s=0.5, error_bound=error_bound, noise=noise)


def test_a_refusal_is_explained_only_where_the_requests_or_prompt_tokens_in_flight_reach_a_bound():
    late = turned_away(30, 2.95)  # the quiet phase: one request in flight at most
    assert explained([*RECORDS, late], {"max_num_queued_reqs": 4}) == [True, True, False]
    assert explained(RECORDS, {"max_num_queued_reqs": 5}) == [False, False]  # four in flight never fill five
    # the token bound counts the prompts still waiting for their first token: 4 x 16 at 0.05 s, none at 0.2 s
    early = turned_away(31, 0.05)
    assert explained([*RECORDS, early], {"max_num_queued_tokens": 64}) == [False, False, True]
    assert explained([*RECORDS, early], {"max_num_queued_tokens": 65}) == [False, False, False]
    assert bounds_of({"max_num_queued_reqs": 6, "max_num_queued_tokens": None, "max_num_seqs": 2}) == {
        "max_num_queued_reqs": 6
    }


def test_refusals_the_bound_explains_pass_and_are_reported_apart_from_errors():
    verdict = judge(RECORDS, {"max_num_queued_reqs": 4})
    n = verdict.numbers
    assert verdict.passed, verdict.problems
    assert (n["refused"], n["refused_explained"], n["refused_unexplained"]) == (2, 2, 0)
    assert n["refused_share"] == 2 / 20 and n["admitted"] == 18 and n["admitted_error_rate"] == 0.0
    assert n["refuse_ms_p99"] < 500 and n["admission_bounds"] == {"max_num_queued_reqs": 4}


def test_a_burst_that_refuses_more_than_the_bound_explains_fails():
    verdict = judge(RECORDS, {"max_num_queued_reqs": 5})  # five fit: the engine cannot have been full
    assert not verdict.passed and verdict.numbers["refused_unexplained"] == 2
    assert any("2 refusals the bounds do not explain" in p for p in verdict.problems)
    # and they count as errors, even where the SLO's error budget is wide
    loose = judge(RECORDS, {"max_num_queued_reqs": 5}, error_bound=0.5)
    assert not loose.passed and loose.numbers["admitted_error_rate"] == 2 / 20


def test_slow_refusals_other_errors_and_admitted_requests_past_the_slo_each_fail():
    slow = [*BURST[:4], turned_away(4, 0.2, after_s=0.9), *QUIET]
    assert any("refusals took" in p for p in judge(slow, {"max_num_queued_reqs": 4}).problems)
    broken = [*RECORDS, builders.lost(40, 5.0)]  # an HTTP 500 is no refusal: the error budget
    assert any("error rate 5.26% over 0.001" in p for p in judge(broken, {"max_num_queued_reqs": 4}).problems)
    late = [served(i, 0.01 * i, ttft_s=0.6) for i in range(4)] + BURST[4:] + QUIET  # admitted P99 TTFT ~600 ms
    verdict = judge(late, {"max_num_queued_reqs": 4})
    assert not verdict.passed and any("break the SLO beyond the noise (10%)" in p for p in verdict.problems)
    within = judge(late, {"max_num_queued_reqs": 4}, noise=0.25)
    assert within.passed and within.within_noise and within.numbers["admitted_slo_violations"]


def test_the_burst_scenario_judges_its_503s_by_the_bounds_it_started_with(monkeypatch):
    """Without bounds every 503 counts against the error budget (as before); with them, the refusals they
    explain are theirs."""

    async def fake_level(client, url, workload, prompts, plan, *, stream, **_):
        summary = summarize(RECORDS, LEVEL, SLO.request_bounds_ms())
        return LevelResult(summary=summary, slo_violations=SLO.violations(summary)), list(RECORDS)

    monkeypatch.setattr(scenarios, "measure_level", fake_level)

    def target(admission):
        return Target(client=None, url="", workload=None, prompts=None, slo=SLO, level=Level("rate", 10.0),  # type: ignore[arg-type]
                      budget=Budget.for_device("cpu", 6.0), max_model_len=0, admission=admission)  # fmt: skip

    bare = asyncio.run(burst(target({})))
    assert not bare.passed and "error rate 10.00%" in bare.reason
    bounded = asyncio.run(burst(target({"max_num_queued_reqs": 4})))
    assert bounded.passed, bounded.reason
    assert "2 refused (503, 10% of the requests; bounds max_num_queued_reqs 4), 2 explained" in bounded.reason
    assert bounded.numbers["refused_explained"] == 2 and bounded.numbers["scheduled_cv"] is None
    tight = asyncio.run(burst(target({"max_num_queued_reqs": 5})))
    assert not tight.passed and "refusals the bounds do not explain" in tight.reason


def test_the_refusals_the_bounds_explain_are_not_the_services_5xx_rate(tmp_path):
    result = scenarios.ScenarioResult("burst", True, "", judge(RECORDS, {"max_num_queued_reqs": 4}).numbers)
    elsewhere = [served(100 + i, 10.0 + i) for i in range(19)] + [turned_away(200, 40.0)]
    run = EngineRun("t", tmp_path / "engine.log")
    measured = stability({"burst": result}, RECORDS + elsewhere, run)
    assert measured["requests"] == 38 and measured["error_rate_5xx"] == 1 / 38
    assert stability({}, RECORDS + elsewhere, run)["error_rate_5xx"] == 3 / 40  # without bounds, every 503 counts
