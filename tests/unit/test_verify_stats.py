"""verify's arithmetic: soak windows, jitter and drift, bootstrap verdicts, cancellation success."""

import math

import numpy as np
import pytest

from servetune.config.slo import Slo
from servetune.config.workload import load_workload
from servetune.load.runner import Level
from servetune.metrics import RequestRecord
from servetune.verify.document import Timeouts, finite
from servetune.verify.scenarios import Budget, _beyond_chance, gap_cv, mixed_workload, p99_input_tokens, scaled
from servetune.verify.shapes import fixed_workload
from servetune.verify.stats import (
    DropRound,
    StreamTimes,
    bootstrap_difference,
    bootstrap_mean,
    cancellation_success_rate,
    chance_of_spread,
    drift,
    growth,
    jitter,
    lead,
    step_s,
    survivors_running,
    tokens_stopped,
    window_samples,
    windows,
)


def request(i, sent, ttft, warmup=False):
    return RequestRecord(index=i, sent=sent, input_tokens=8, max_tokens=4, warmup=warmup, chunk_times=[sent + ttft + k * 0.01 for k in range(4)],
                         end=sent + ttft + 0.03, output_tokens=4, ok=True)  # fmt: skip


def test_windows_follow_send_time_and_leave_warmup_out():
    # TTFT 100 ms in the first half of the soak, 300 ms in the second; warm-up requests at 1 s TTFT.
    records = [request(i, i * 0.1, 1.0, warmup=True) for i in range(5)]
    records += [request(5 + i, 0.5 + i * 0.1, 0.1 if i < 50 else 0.3) for i in range(100)]
    ws = windows(records, 4, {"concurrency": 2})
    assert [w.requests for w in ws] == [25, 25, 25, 25]
    p99 = [w.ttft_ms_p99 for w in ws]
    assert p99[0] == pytest.approx(100) and p99[-1] == pytest.approx(300)
    assert jitter(p99) == pytest.approx(3.0) and drift(p99) == pytest.approx(3.0)


def soak_records(ttft_ms_of) -> list[RequestRecord]:
    """120 requests over 12 s, 6 windows of 20, TTFT from ``ttft_ms_of(index)``."""
    return [request(i, i * 0.1, ttft_ms_of(i) / 1000.0) for i in range(120)]


def test_one_slow_request_is_sampling_noise_a_slower_second_half_is_not():
    rng = np.random.default_rng(1)
    # Steady 50 +- 5 ms, one request at 400 ms: its window's P99 is near it, jitter far above 2.
    noisy = soak_records(lambda i: 400.0 if i == 70 else 50.0 + rng.uniform(-5, 5))
    samples = window_samples(noisy, 6)
    assert [len(s) for s in samples] == [w.requests for w in windows(noisy, 6, {})] == [20] * 6
    p99 = [w.ttft_ms_p99 for w in windows(noisy, 6, {})]
    assert jitter(p99) > 4.0
    chance = chance_of_spread(samples, jitter(p99), jitter, rounds=400)
    assert chance > 0.2  # wherever the slow request lands, its window looks as bad (about half the reshuffles)
    assert not _beyond_chance(jitter(p99), 2.0, chance)
    # Latency that doubled and more for the second half of the soak: no reshuffle gives as much.
    slower = soak_records(lambda i: (50.0 if i < 60 else 130.0) + rng.uniform(-5, 5))
    samples = window_samples(slower, 6)
    p99 = [w.ttft_ms_p99 for w in windows(slower, 6, {})]
    for statistic in (jitter, drift):
        chance = chance_of_spread(samples, statistic(p99), statistic, rounds=400)
        assert chance < 0.05 and _beyond_chance(statistic(p99), 2.0, chance)
    assert _beyond_chance(3.0, 2.0, None) and not _beyond_chance(1.5, 2.0, 0.0)
    assert chance_of_spread([[50.0] * 5, []], 1.0) is None  # one window with requests: nothing to compare


def test_jitter_and_drift_need_two_values():
    assert jitter([None, 5.0]) is None and drift([]) is None
    assert jitter([2.0, 4.0, 3.0]) == 2.0 and drift([4.0, 2.0]) == 0.5  # drift can improve


def test_growth_compares_the_last_samples_with_the_first():
    flat = [(t, 100.0) for t in range(10)]
    leaking = [(t, 100.0 + 10 * t) for t in range(10)]
    assert growth(flat) == 0.0
    assert growth(leaking) == pytest.approx(80.0)  # mean of the last 2 (180, 190) minus the first 2 (100, 110)
    assert growth([(0, 1.0)]) is None


def test_bootstrap_interval_holds_the_mean_and_narrows_with_less_spread():
    rng = np.random.default_rng(1)
    wide, narrow = rng.normal(10, 3, 6), rng.normal(10, 0.3, 6)
    a, b = bootstrap_mean(wide), bootstrap_mean(narrow)
    assert a.low <= a.mean <= a.high and b.low <= b.mean <= b.high
    assert (b.high - b.low) < (a.high - a.low) / 3
    assert bootstrap_mean([1.0]) is None
    same = bootstrap_mean([2.0] * 5)
    assert same.low == same.high == 2.0


def test_lead_is_real_only_beyond_the_noise():
    winner = [10.0, 10.4, 9.8, 10.1, 10.2]
    assert lead(winner, [8.0, 8.3, 7.9, 8.1, 8.2], "goodput").verdict == "real"
    assert lead(winner, [10.1, 9.9, 10.3, 9.7, 10.0], "goodput").verdict == "within noise"
    assert lead(winner, [12.0, 12.2, 11.9, 12.1, 12.3], "goodput").verdict == "runner-up ahead"
    assert lead([100.0, 101, 99, 100, 102], [150.0, 149, 151, 150, 152], "ttft", higher_is_better=False).real
    assert lead(winner, [8.0], "goodput").verdict == "not compared"
    diff = bootstrap_difference(winner, [8.0, 8.3, 7.9, 8.1, 8.2])
    assert diff.low > 0 and diff.mean == pytest.approx(2.0)


def test_cancellation_success_counts_what_vllm_still_holds_beyond_the_survivors():
    released = DropRound(
        dropped=4, survivors=4, before=8, settled=4, fell_back_s=0.2, server_tokens=600, client_tokens=512, streams=8
    )
    leaking = DropRound(
        dropped=4, survivors=4, before=8, settled=7, fell_back_s=None, server_tokens=1000, client_tokens=500, streams=8
    )
    unseen = DropRound(dropped=4, survivors=4, before=2, settled=0, fell_back_s=0.0)  # the gauge never showed the load
    ended = DropRound(dropped=4, survivors=0, before=8, settled=0, fell_back_s=0.0)  # all had ended on the server
    assert released.leaked == 0 and leaking.leaked == 3
    assert released.observed and leaking.observed and not unseen.observed and not ended.observed
    assert cancellation_success_rate([released]) == 1.0
    assert cancellation_success_rate([released, leaking]) == pytest.approx(5 / 8)
    assert cancellation_success_rate([released, unseen, ended]) == 1.0  # rounds that prove nothing are not judged
    assert cancellation_success_rate([unseen, ended]) is None
    assert tokens_stopped([released]) and not tokens_stopped([leaking])  # 500 tokens nobody received
    assert tokens_stopped([DropRound(4, 4, 8, 4, 0.1)])  # no token span (a survivor ended first): nothing against it
    assert cancellation_success_rate([DropRound(4, 4, math.nan, 4, None)]) is None
    late = DropRound(4, 4, 8, 8, None, released_s=3.1, allowed_s=2.0)  # released, but after the allowance
    assert late.observed and late.leaked == 4 and cancellation_success_rate([released, late]) == 0.5


def test_the_survivors_vllm_still_runs_are_its_own_count_not_the_clients():
    # 4 survivors; vLLM finished 3 of them since the round began, the client (reading behind it) has read the end of 1
    assert survivors_running(4, 3.0, open_by_client=3) == 1
    assert survivors_running(4, 0.0, open_by_client=4) == 4
    assert survivors_running(4, 6.0, open_by_client=0) == 0  # more finished than survivors: none runs (not negative)
    assert survivors_running(4, None, open_by_client=3) == 3  # no count from vLLM: the client's, lag and all
    # A release is its gauge at or below that: 2 dropped streams still held while both survivors have ended on the
    # engine but not yet on the client read 2 in flight, which the client's count (2 open) takes for released.
    held = 2.0
    assert held <= survivors_running(2, None, open_by_client=2)
    assert held > survivors_running(2, 2.0, open_by_client=2)


def test_a_round_says_when_its_phases_and_streams_ran_and_why_it_judges_nothing():
    # Each stream in a few numbers from the round's start, in seconds to the millisecond: its first two content
    # chunks, its end and how it ended.
    done = RequestRecord(index=0, sent=0.0, input_tokens=16, max_tokens=1007, chunk_times=[0.41234, 0.5, 0.6],
                         end=9.87654, output_tokens=1007)  # fmt: skip
    cut = RequestRecord(
        index=1, sent=0.0, input_tokens=16, max_tokens=1007, chunk_times=[7.5], end=10.0, error_kind="dropped"
    )
    assert StreamTimes.of(done, "finished") == StreamTimes(0.412, 0.5, 9.877, "finished", 3, 1007)
    assert StreamTimes.of(cut, "dropped") == StreamTimes(7.5, None, 10.0, "dropped", 1, None)
    assert StreamTimes.of(RequestRecord(index=2, sent=0.0, input_tokens=16, max_tokens=8), "open").first_s is None
    times = (StreamTimes.of(done, "finished"), StreamTimes.of(cut, "dropped"))
    given_up = DropRound(1, 1, 2, 0.0, None, streams=2, first_tokens_s=7.6, gauge_s=7.7, stream_times=times,
                         given_up="stream 0 ended (finished) at 9.88 s, before the drop")  # fmt: skip
    # A round given up before its drop judges nothing, whatever its gauge read, and says why.
    assert not given_up.observed and given_up.leaked == 0 and cancellation_success_rate([given_up]) is None
    doc = given_up.as_dict()
    assert doc["unobserved"] == "stream 0 ended (finished) at 9.88 s, before the drop" and doc["drop_s"] is None
    assert doc["first_tokens_s"] == 7.6 and doc["gauge_s"] == 7.7
    assert doc["stream_times"][0] == {"first_s": 0.412, "second_s": 0.5, "end_s": 9.877, "ended": "finished",
                                      "chunks": 3, "tokens": 1007, "error": None}  # fmt: skip
    # Rounds that dropped say why they judge nothing from their numbers; an observed one says nothing.
    assert "showed 2 in flight" in DropRound(4, 4, 2, 0, 0.0).unobserved
    assert "every request had ended" in DropRound(4, 0, 8, 0, 0.0).unobserved
    assert "could not be read" in DropRound(4, 4, math.nan, 4, None).unobserved
    assert DropRound(4, 4, 8, 4, 0.1, drop_s=1.2).as_dict()["unobserved"] is None


def test_the_engine_step_is_the_median_stream_gap_after_the_first_chunk():
    # The first chunk's wait (the prefill) is left out; a stream with one chunk says nothing.
    assert step_s([[1.0, 1.1, 1.2, 1.3], [5.0, 5.3, 5.6], [2.0, 2.2, 2.4], [9.0]]) == pytest.approx(0.2)
    assert step_s([[1.0], []]) == 0.0


def test_peak_burst_and_mix_loads():
    assert scaled(Level("concurrency", 8), 1.25).value == 10 and scaled(Level("concurrency", 2), 1.25).value == 3
    assert scaled(Level("rate", 4.0, "poisson"), 1.25).value == 5.0
    burst = Level("rate", 20.0, "gamma", burstiness=1 / 9)
    from servetune.load.runner import arrival_gaps

    gaps = arrival_gaps(burst, np.random.default_rng(0))
    sends = np.cumsum([next(gaps) for _ in range(20000)])
    records = [RequestRecord(index=i, sent=float(s), input_tokens=1, max_tokens=1) for i, s in enumerate(sends)]
    assert gap_cv(records) == pytest.approx(3.0, rel=0.1)
    workload = load_workload("cpu-tiny")  # input normal(128, 32) clipped to 32..256
    p99 = p99_input_tokens(workload)
    assert 128 + 2 * 32 <= p99 <= 256
    mixed = mixed_workload(workload, p99)
    weights = {c.name: c.weight for c in mixed.classes}
    assert weights["long"] == pytest.approx(0.1) and sum(weights.values()) == pytest.approx(1.0)


def test_timeouts_follow_the_slo():
    slo = Slo.parse("ttft_ms.p99=2000,tpot_ms.p95=50")
    t = Timeouts.from_slo(slo, 300)
    assert t.first_token_s == 20.0 and t.idle_s == 5.0 and t.total_s == 300  # 10x TTFT; 20x TPOT is 1 s, raised to 5
    assert Timeouts.from_slo(Slo(), 40).first_token_s == 10.0  # no TTFT bound: a quarter of the total
    assert Timeouts.from_slo(Slo.parse("ttft_ms.p99=60000"), 100).first_token_s == 100  # never past the total


def test_budget_is_short_on_cpu_and_full_on_gpus():
    gpu, cpu = Budget.for_device("gpu"), Budget.for_device("cpu")
    assert gpu.soak_s == 600 and gpu.repeats >= 5 and cpu.repeats >= 5
    assert cpu.soak_s <= 120 and cpu.long_output_cap is not None
    assert Budget.for_device("cpu", 20).scenario_s == 10 and Budget.for_device("cpu", 20).repeat_s == 6
    assert Budget.for_device("cpu", 200).scenario_s == 20  # a quarter of the soak, at most 20 s
    short = Budget.for_device("cpu", 4)  # a soak shorter than the scenarios' floor: they shrink to match
    assert short.scenario_s == 4 and short.repeat_s == 2


def test_verify_json_has_no_nan():
    assert finite({"a": [float("nan"), 1.0, {"b": float("inf")}]}) == {"a": [None, 1.0, {"b": None}]}


def test_a_window_that_sent_nothing_says_whether_requests_were_in_flight_across_it():
    # One client: a request sent at 2.0 s that ends at 4.5 s is in flight across the window of 3-4 s, which sends
    # nothing. Later the client pauses: nothing in flight from 4.7 s to its next send at 7.0 s.
    records = [request(i, 0.5 * i, 0.05) for i in range(5)]  # sent 0.0 .. 2.0 s, each over 80 ms later
    records[-1].end = 4.5
    records += [request(5, 4.6, 0.05), request(6, 7.0, 0.05), request(7, 7.4, 0.05), request(8, 8.0, 0.05)]
    ws = windows(records, 8, {"concurrency": 1})  # 1 s each from 0.0 s
    assert [w.requests for w in ws] == [2, 2, 1, 0, 1, 0, 0, 3] and sum(w.requests for w in ws) == len(records)
    assert [w.in_flight for w in ws] == [0, 0, 0, 1, 0, 0, 0, 0]  # the long request; then the pause holds none
    assert ws[3].as_dict()["in_flight"] == 1
    # warm-up requests are load too: one in flight across the first two windows (1-2 s, 2-3 s) counts there
    warm = [request(0, 0.0, 0.05, warmup=True)] + [request(1 + i, 1.0 + i, 0.05) for i in range(4)]
    warm[0].end = 3.5
    assert [w.in_flight for w in windows(warm, 3, {"concurrency": 1})] == [1, 1, 0]  # it ends at 3.5 s


def test_the_burst_reports_the_gaps_cv_it_scheduled_beside_the_one_it_sent(monkeypatch):
    """A client on a busy host that cannot send twice within 20 ms smooths the gaps it sends; the schedule it was
    asked for keeps the gamma process's burstiness."""
    import asyncio

    from servetune.load.runner import arrival_gaps
    from servetune.verify import scenarios
    from servetune.verify.scenarios import BURST_CV, Target, burst
    from tests.builders import level

    asked: list = []

    async def fake_level(client, url, workload, prompts, plan, *, stream, **_):
        asked.append(plan)
        gaps = arrival_gaps(plan.level, np.random.default_rng(stream))
        due = np.cumsum([next(gaps) for _ in range(400)])
        records, last = [], -1.0
        for i, at in enumerate(due):
            last = max(float(at), last + 0.02)
            records.append(RequestRecord(index=i, sent=last, input_tokens=1, max_tokens=1, scheduled=float(at)))
        return level(6, 100.0, 200.0), records

    monkeypatch.setattr(scenarios, "measure_level", fake_level)
    t = Target(client=None, url="", workload=None, prompts=None, slo=Slo(), level=Level("concurrency", 6.0),  # type: ignore[arg-type]
               budget=Budget.for_device("cpu", 6.0), max_model_len=0, measured_rate=20.0)  # fmt: skip
    result = asyncio.run(burst(t))
    plan = asked[0]
    assert (plan.level.kind, plan.level.value, plan.level.process) == ("rate", 20.0, "gamma")
    assert plan.level.burstiness == pytest.approx(1 / BURST_CV**2) and plan.warmup_requests == 0
    n = result.numbers
    scheduled = np.diff([r.scheduled for r in t.records])
    sent = np.diff([r.sent for r in t.records])
    assert n["scheduled_cv"] == pytest.approx(scheduled.std() / scheduled.mean())
    assert n["measured_cv"] == pytest.approx(sent.std() / sent.mean()) and n["measured_cv"] < n["scheduled_cv"]
    assert n["scheduled_cv"] > 2.0 and n["target_cv"] == BURST_CV  # what was asked: far burstier than Poisson
    assert f"{n['scheduled_cv']:.3g} asked, {n['measured_cv']:.3g} sent" in result.reason
    # a closed loop's records have no schedule: none to report
    bare = [RequestRecord(index=i, sent=0.1 * i, input_tokens=1, max_tokens=1) for i in range(10)]
    assert gap_cv(bare, scheduled=True) is None and gap_cv(bare) == pytest.approx(0.0, abs=1e-9)


def test_derived_workloads_ask_what_the_workloads_requests_ask():
    """The long-output and disconnect scenarios' fixed workload and the mix keep what the study's requests ask for
    (issue 41 item 5): their text, adapters and sampling, and each class its own sampling and structured output. The
    fixed one leaves out what would end a request before its length (stop sequences, a grammar) or multiply it (n)."""
    from servetune.config.workload import Workload

    workload = Workload.model_validate({
        "name": "agent-like", "api": "chat", "text": "corpus", "ignore_eos": False,
        "sampling": {"top_p": 0.9, "n": 2, "stop": ["###"], "temperature": 0.7},
        "structured": {"choice": ["yes", "no"]},
        "adapters": [{"name": "tuned", "path": "tiny"}],
        "mix": [
            {"name": "chat", "weight": 3, "input_tokens": {"dist": "fixed", "value": 100},
             "output_tokens": {"dist": "fixed", "value": 20}, "sampling": {"top_k": 5}},
            {"name": "tool", "weight": 1, "input_tokens": {"dist": "fixed", "value": 50},
             "output_tokens": {"dist": "fixed", "value": 10}, "structured": {"regex": "[a-z]+"}},
        ],
    })  # fmt: skip
    fixed = fixed_workload(workload, "long-output", 64, 512)
    ((only,),) = [fixed.classes]
    assert (only.input_tokens.value, only.output_tokens.value) == (64, 512) and fixed.ignore_eos
    assert fixed.text == "corpus" and fixed.api == "chat" and [a.name for a in fixed.adapters] == ["tuned"]
    assert fixed.sampling.top_p == 0.9 and fixed.sampling.temperature == 0.7
    assert fixed.sampling.stop is None and fixed.sampling.n is None and fixed.structured is None
    mixed = mixed_workload(workload, 400)
    by_name = {c.name: c for c in mixed.classes}
    assert by_name["chat"].sampling.top_k == 5 and by_name["tool"].structured.regex == "[a-z]+"
    assert by_name["long"].input_tokens.value == 400 and by_name["long"].sampling.top_k == 5  # asks as the first
    assert mixed.text == "corpus" and mixed.structured == workload.structured and mixed.sampling == workload.sampling
