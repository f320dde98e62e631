"""vLLM's own count of its admission refusals beside the client's 503s (verify/refusals.py), from a recorded
``/metrics`` excerpt, and how the burst and the overload scenarios carry it into their evidence."""

from __future__ import annotations

import asyncio
from pathlib import Path

from servetune.config.slo import Slo
from servetune.engine.metrics import MetricsSnapshot, level_delta
from servetune.load.runner import Level
from servetune.results import LevelResult
from servetune.summary import summarize
from servetune.verify import scenarios
from servetune.verify.overload import judge_overload, with_server_count
from servetune.verify.refusals import server_refusals
from servetune.verify.scenarios import Budget, Target, burst
from tests import builders

#: vLLM 0.32's /metrics after 12 refusals by max_num_queued_reqs and 41 by max_num_queued_tokens.
EXCERPT = (Path(__file__).parents[1] / "data" / "vllm-metrics" / "admission-rejections.txt").read_text()
SLO = Slo.parse("ttft_ms.p99=500")
LEVEL = {"request_rate": 10.0}


def counted(reqs: int, tokens: int) -> dict[str, float]:
    """A level's server metrics (trial/measure.py's ``level_delta``) over which vLLM refused so many by each bound."""
    zero = MetricsSnapshot.parse(EXCERPT.replace(" 12.0", " 0.0").replace(" 41.0", " 0.0"))
    after = MetricsSnapshot.parse(EXCERPT.replace(" 12.0", f" {reqs}.0").replace(" 41.0", f" {tokens}.0"))
    return level_delta(zero, after)


def turned_away(i: int, sent: float) -> object:
    return builders.lost(i, sent, 0.002, error="HTTP 503: The engine is currently busy")


def level(refused: int, served: int = 10, start: float = 0.0) -> list:
    """``served`` requests, then ``refused`` 503s sent while they were in flight."""
    return [builders.served(i, start + 0.01 * i, 0.1, 0.4) for i in range(served)] + [
        turned_away(100 + i, start + 0.2 + 0.01 * i) for i in range(refused)
    ]


def test_the_servers_count_by_reason_agrees_with_the_clients_503s():
    check = server_refusals(level(53), counted(12, 41))
    assert check.agrees and check.server == 53 and check.client == 53
    assert check.text() == ("vLLM's own count: refused 53: 41 by max_num_queued_tokens, 12 by max_num_queued_reqs "
                            "(the client's 503s: 53, in agreement)")  # fmt: skip
    assert check.numbers() == {"server_refused": 53, "client_503": 53, "refusals_agree": True,
                               "server_refused_by_reason": {"max_num_queued_reqs": 12, "max_num_queued_tokens": 41}}  # fmt: skip


def test_503s_the_server_did_not_make_point_at_another_layer():
    proxy = server_refusals(level(60), counted(12, 41))
    assert proxy.agrees is False
    assert "the client counted 60 503s, 7 more than vLLM refused: those came from another layer" in proxy.text()
    assert proxy.numbers()["server_refused_note"].startswith("the client counted 60 503s")
    # vLLM refused more than the client read: the two requests it stopped reading (timeouts) may be those...
    unread = [builders.lost(200 + i, 0.3, 30.0, kind="timeout_first_token", error="no token") for i in range(2)]
    assert server_refusals(level(51) + unread, counted(12, 41)).agrees
    # ...but not more
    over = server_refusals(level(50) + unread, counted(12, 41))
    assert over.agrees is False and "vLLM refused 3 more than the 50 503s the client counted" in over.text()


def test_not_read_says_why_and_a_lagging_source_may_miss_the_last_refusals():
    missing = server_refusals(level(5), {})
    assert missing.agrees is None and missing.server is None and missing.numbers()["server_refused"] is None
    assert missing.text() == (
        "vLLM's own count of refusals not read: vLLM's /metrics did not answer before or after the level"
    )
    assert "Ray's metrics agents" in server_refusals(level(5), {}, lagging=True).why
    older = server_refusals(level(5), {"requests_finished": 10.0})  # read, but no such counter (before vLLM 0.32)
    assert older.by_reason is None and "no vllm:admission_rejections" in older.why
    # Through Serve a replica that never refused exports no counter: none refused, so the client's 5 disagree...
    serve = server_refusals(level(5), {"requests_finished": 10.0}, lagging=True)
    assert serve.server == 0 and serve.agrees is False
    # ...unless they came after the last admitted request ended (0.5 s), which the closing read may not have counted
    late = [builders.served(i, 0.01 * i, 0.1, 0.4) for i in range(10)] + [turned_away(100 + i, 0.6) for i in range(5)]
    assert server_refusals(late, {"requests_finished": 10.0}, lagging=True).agrees
    assert not server_refusals(late, {"requests_finished": 10.0}).agrees  # read straight: no lag to allow


def test_the_burst_puts_the_servers_count_beside_the_clients(monkeypatch):
    records = level(2, served=18)

    async def fake_level(client, url, workload, prompts, plan, *, stream, **_):
        summary = summarize(records, LEVEL, SLO.request_bounds_ms())
        return LevelResult(summary=summary, slo_violations=SLO.violations(summary), server_metrics=counted(2, 0)), list(
            records
        )

    monkeypatch.setattr(scenarios, "measure_level", fake_level)
    t = Target(client=None, url="", workload=None, prompts=None, slo=SLO, level=Level("rate", 10.0),  # type: ignore[arg-type]
               budget=Budget.for_device("cpu", 6.0), max_model_len=0, admission={"max_num_queued_reqs": 4})  # fmt: skip
    result = asyncio.run(burst(t))
    assert result.reason.endswith(
        "vLLM's own count: refused 2: 2 by max_num_queued_reqs (the client's 503s: 2, in agreement)"
    )
    assert result.numbers["server_refused_by_reason"] == {"max_num_queued_reqs": 2, "max_num_queued_tokens": 0}
    assert result.numbers["refusals_agree"] is True and result.numbers["refused"] == 2


def test_the_overload_carries_each_phases_count_and_says_when_they_disagree():
    over, after = level(53), level(0, start=10.0)
    judged = judge_overload(over, after, wait_s=0.5, rate=10.0)
    result = with_server_count(judged, server_refusals(over, counted(12, 41)), server_refusals(after, counted(0, 0)))
    assert result.numbers["server_refused"] == 53 and result.numbers["recovery_server_refused"] == 0
    assert "refused 53: 41 by max_num_queued_tokens, 12 by max_num_queued_reqs (the client's 503s: 53" in result.reason
    assert "in the recovery phase" not in result.reason  # it refused none, in agreement
    proxied = with_server_count(judge_overload(over, after, wait_s=0.5, rate=10.0),
                                server_refusals(over, counted(10, 30)), server_refusals(after, counted(0, 0)))  # fmt: skip
    assert proxied.numbers["refusals_agree"] is False and "13 more than vLLM refused" in proxied.reason
    assert proxied.passed == judged.passed  # the verdict stays the client's
    late = with_server_count(judge_overload(over, after, wait_s=0.5, rate=10.0), server_refusals(over, counted(12, 41)),
                             server_refusals(after, counted(3, 0)))  # fmt: skip
    assert "in the recovery phase, vLLM's own count: refused 3: 3 by max_num_queued_reqs; it disagrees" in late.reason
