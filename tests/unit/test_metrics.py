import numpy as np
import pytest

from servetune.metrics import RequestRecord, cost_per_mtok_usd, metric_names
from servetune.summary import send_sync_share, summarize


def record(index, sent, ttft, gaps, output_tokens=None, ok=True, warmup=False, error_kind=None):
    times = [sent + ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    n = len(times) if output_tokens is None else output_tokens
    return RequestRecord(
        index=index,
        sent=sent,
        input_tokens=100,
        max_tokens=n,
        warmup=warmup,
        chunk_times=times if ok else [],
        end=times[-1],
        prompt_tokens=100 if ok else None,
        output_tokens=n if ok else None,
        ok=ok,
        error_kind=error_kind,
    )


def test_per_request_definitions():
    r = record(0, sent=1.0, ttft=0.2, gaps=[0.05, 0.05, 0.1])
    assert r.ttft_s == pytest.approx(0.2)
    assert r.e2el_s == pytest.approx(0.4)
    assert r.tpot_s == pytest.approx(0.2 / 3)
    assert r.itls_s() == pytest.approx([0.05, 0.05, 0.1])


def test_tpot_uses_server_token_count_not_chunks():
    # Two chunks but the server says 5 tokens: TPOT divides by (5 - 1).
    r = record(0, sent=0.0, ttft=0.1, gaps=[0.4], output_tokens=5)
    assert r.tpot_s == pytest.approx(0.1)


def test_single_token_has_no_tpot():
    assert record(0, 0.0, 0.1, []).tpot_s is None


def test_summary_percentiles_throughput_and_warmup_exclusion():
    rng = np.random.default_rng(1)
    ttfts = rng.uniform(0.01, 0.5, size=50)
    records = [record(i, sent=i * 0.1, ttft=t, gaps=[0.02] * 9) for i, t in enumerate(ttfts)]
    warm = record(99, sent=0.0, ttft=10.0, gaps=[0.02] * 9, warmup=True)
    s = summarize([warm, *records], {"concurrency": 4})
    assert s.completed == 50 and s.warmup_excluded == 1 and s.failed == 0
    assert s.ttft_ms.p99 == pytest.approx(np.percentile(ttfts * 1000, 99))
    assert s.ttft_ms.mean == pytest.approx(ttfts.mean() * 1000)
    assert s.itl_ms.p50 == pytest.approx(20.0)
    start = 0.0
    end = max(r.end for r in records)
    assert s.duration_s == pytest.approx(end - start)
    assert s.output_throughput == pytest.approx(500 / (end - start))
    assert s.request_throughput == pytest.approx(50 / (end - start))
    assert s.total_token_throughput == pytest.approx((500 + 5000) / (end - start))
    assert s.goodput is None


def test_goodput_counts_requests_meeting_every_bound():
    fast = record(0, 0.0, 0.1, [0.01] * 4)
    slow_ttft = record(1, 0.0, 3.0, [0.01] * 4)
    slow_tpot = record(2, 0.0, 0.1, [0.5] * 4)
    s = summarize([fast, slow_ttft, slow_tpot], {"concurrency": 3}, {"ttft_ms": 1000, "tpot_ms": 100})
    assert s.goodput == pytest.approx(1 / s.duration_s)


def test_errors_counted_by_kind_and_not_in_latency():
    ok = record(0, 0.0, 0.1, [0.01])
    bad = [
        record(i, 0.0, 0.1, [], ok=False, error_kind=k) for i, k in enumerate(["http_5xx", "http_5xx", "timeout"], 1)
    ]
    s = summarize([ok, *bad], {"rate": 1.0})
    assert s.errors_by_kind == {"http_5xx": 2, "timeout": 1}
    assert s.failed == 3 and s.error_rate == pytest.approx(0.75)
    assert s.ttft_ms.count == 1


def test_flat_names_are_the_declared_metric_names():
    s = summarize([record(0, 0.0, 0.1, [0.01, 0.01])], {"concurrency": 1}, {"ttft_ms": 1000})
    assert set(s.flat()) == set(metric_names())


def test_empty_level():
    s = summarize([], {"concurrency": 1})
    assert s.completed == 0 and s.output_throughput == 0 and s.ttft_ms.p99 is None


def test_cost_per_million_tokens():
    # $2/GPU-hour, 2 GPUs, 1000 tok/s -> 3.6M tok/h for $4 -> $1.111/Mtok
    assert cost_per_mtok_usd(2.0, 2, 1000.0) == pytest.approx(4 / 3.6)
    assert cost_per_mtok_usd(2.0, 1, 0.0) == float("inf")


def test_tokens_read_in_bursts_are_counted_and_flagged_on_the_level_table():
    from rich.console import Console

    from servetune.cli.display import level_table
    from servetune.config.slo import Slo
    from servetune.results import LevelResult
    from servetune.summary import itl_burst_share, itl_note

    steady = record(0, sent=0.0, ttft=0.1, gaps=[0.02] * 9)
    bunched = record(
        1, sent=0.0, ttft=0.1, gaps=[0.0001, 0.0001, 0.0001, 0.06] * 2 + [0.02]
    )  # 6 of 9 gaps read at once
    ignored = [record(2, 0.0, 0.1, [0.0] * 9, warmup=True), record(3, 0.0, 0.1, [0.0] * 9, ok=False)]
    assert itl_burst_share([steady, *ignored]) == 0.0 and itl_note(0.0) is None
    share = itl_burst_share([steady, bunched, *ignored])
    assert share == pytest.approx(6 / 18) and itl_burst_share([]) is None
    level = LevelResult(summary=summarize([steady, bunched], {"concurrency": 2}), itl_burst_share=share)
    out = Console(width=200, record=True)
    out.print(level_table([level], Slo()))
    text = " ".join(out.export_text().split())
    assert "concurrency 2: tokens read in bursts: 33% of token gaps under 1 ms" in text, text
    assert "ITL percentiles understate" in text


def test_the_send_sync_share_counts_measured_sends_within_10_ms_of_another():
    # Two pairs 5 ms apart (one with a warm-up request, which counts as a neighbour but not in the share), and
    # three sends 100 ms or more from any other: 3 of the 5 measured sends are close.
    sends = [(0.0, True), (0.005, False), (0.2, False), (0.3, False), (0.305, False), (0.5, False)]
    records = [record(i, sent, 0.1, [], warmup=warmup) for i, (sent, warmup) in enumerate(sends)]
    assert send_sync_share(records) == pytest.approx(3 / 5)
    assert send_sync_share(records, window_s=0.001) == 0.0
    assert send_sync_share(records[:1]) is None
