"""A level stops early only when, at half its requests, a latency percentile is twice its bound."""

from __future__ import annotations

from servetune.config.slo import Slo
from servetune.load.runner import Level
from servetune.metrics import RequestRecord
from servetune.trial.measure import EarlyBreak


def record(index: int, ttft_s: float, warmup: bool = False) -> RequestRecord:
    return RequestRecord(index=index, sent=0.0, input_tokens=10, max_tokens=4, warmup=warmup,
                         chunk_times=[ttft_s + 0.01 * i for i in range(4)], end=ttft_s + 0.03,
                         prompt_tokens=10, output_tokens=4, ok=True)  # fmt: skip


def watch(ttfts: list[float], slo: str = "ttft_ms.p95=500", planned: int | None = 32) -> EarlyBreak:
    early = EarlyBreak(Slo.parse(slo), Level("concurrency", 8), planned)
    early.finished(record(-1, 99.0, warmup=True))  # warm-up requests never count
    for i, ttft in enumerate(ttfts):
        early.finished(record(i, ttft))
    return early


def test_twice_the_bound_at_half_the_level_stops_it_and_says_why():
    early = watch([1.2] * 16)  # 1200 ms against 500: 2.4x
    assert early.broken() and early.reason.startswith("ttft_ms_p95 = 1200 after 16 requests, over 2x its bound 500")


def test_a_level_over_its_bound_but_not_twice_runs_to_its_end():
    assert not watch([0.9] * 32).broken()  # 1.8x: within what noise and the level's second half can change


def test_it_judges_only_at_half_so_a_slow_start_alone_does_not_stop_it():
    early = watch([1.2] * 15)
    assert not early.broken()  # fewer than half finished
    early = watch([0.1] * 16 + [5.0] * 16)
    assert not early.broken()  # fine at half; the rest is measured in full


def test_timed_levels_and_slos_without_latency_bounds_are_never_cut():
    assert not watch([5.0] * 40, planned=None).broken()
    assert not watch([5.0] * 40, slo="error_rate=0.01").broken()


def test_an_open_loop_whose_waiting_queue_grows_steadily_is_saturated():
    early = EarlyBreak(Slo(), Level("rate", 50), planned=1000, queue_window_s=10)
    for i in range(21):  # one sample every half second, the queue growing by one each
        early.waiting(i * 0.5, float(i))
    assert (
        early.broken()
        and early.reason == "saturated: vLLM's waiting queue grew from 0 to 20 requests over 10 s: stopped early"
    )


def test_a_queue_that_drains_or_a_closed_loop_is_not_saturated():
    early = EarlyBreak(Slo(), Level("rate", 50), planned=1000, queue_window_s=10)
    for i in range(21):
        early.waiting(i * 0.5, float(i if i != 15 else 3))  # it caught up once: the window starts over
    assert not early.broken()
    closed = EarlyBreak(Slo(), Level("concurrency", 64), planned=1000, queue_window_s=10)
    for i in range(40):
        closed.waiting(i * 0.5, float(i))
    assert not closed.broken()
    slow = EarlyBreak(Slo(), Level("rate", 50), planned=1000, queue_window_s=10)
    for i in range(40):
        slow.waiting(i * 0.5, float(i // 6))  # 0 to 6 over 19.5 s: creeping, not 8 requests behind
    assert not slow.broken()
