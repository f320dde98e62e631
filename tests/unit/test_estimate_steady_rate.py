"""calibrate_cpu.read_output_throughput: a recorded closed-loop level read at its steady rate, not its drain."""

from __future__ import annotations

import heapq

import pytest

from servetune.estimate import calibrate_cpu as cc
from servetune.estimate.knee import measured_knee
from servetune.metrics import RequestRecord
from servetune.summary import summarize

OUTPUT_TOKENS = 32


def closed_loop(clients: int, requests: int, slots: int = 1000, token_s: float = 0.01) -> list[RequestRecord]:
    """A closed loop of ``clients`` sending ``requests`` back to back to an engine of ``slots`` that streams each
    running request's tokens ``token_s`` apart; past the slots a request waits for one. Request i's output is
    stretched by a repeating 0.6-1.4 pattern so the clients fall out of step (as real ones do) and the last
    requests drain one by one."""
    free = [(0.0, c) for c in range(clients)]  # when each client can send next
    running: list[float] = []  # when each busy slot frees
    records = []
    for i in range(requests):
        sent, client = heapq.heappop(free)
        while running and running[0] <= sent:
            heapq.heappop(running)
        start = sent if len(running) < slots else heapq.heappop(running)
        gap = token_s * (0.6 + 0.8 * ((i * 7) % 11) / 10)
        chunks = [start + gap * (k + 1) for k in range(OUTPUT_TOKENS)]
        end = chunks[-1]
        heapq.heappush(running, end)
        heapq.heappush(free, (end, client))
        records.append(
            RequestRecord(
                index=i,
                sent=sent,
                input_tokens=128,
                max_tokens=OUTPUT_TOKENS,
                chunk_times=chunks,
                end=end,
                prompt_tokens=128,
                output_tokens=OUTPUT_TOKENS,
                ok=True,
            )
        )
    return records


def level(clients: int, requests: int = 64, **engine) -> dict:
    """A level's summary as a recorded surface holds it (the JSON of summary.summarize)."""
    return summarize(closed_loop(clients, requests, **engine), {"concurrency": clients}).model_dump(mode="json")


def test_the_steady_rate_leaves_out_the_drain_that_the_level_rate_holds():
    s = level(16)
    steady = 16 * OUTPUT_TOKENS / (s["e2el_ms"]["mean"] / 1000)  # Little's law, every client always in flight
    assert cc.read_output_throughput(s, "level") == s["output_throughput"]
    assert cc.read_output_throughput(s, "little") == pytest.approx(steady)
    assert cc.read_output_throughput(s, "busy") == s["busy_output_throughput"]
    # 64 requests over 16 clients: the last ones finish with ever fewer clients busy, so the level reads low
    assert s["output_throughput"] < 0.9 * steady
    assert s["busy_output_throughput"] == pytest.approx(steady, rel=0.1)


def test_a_level_without_a_busy_window_keeps_its_latencies_and_no_throughput():
    s = level(48)  # 64 requests over 48 clients: fewer than 48 finish with every client busy
    assert s["busy_output_throughput"] is None
    assert cc.read_output_throughput(s, "busy") is None
    trial = {
        "outcome": "COMPLETE",
        "engine_args": {"max_num_seqs": 8, "max_model_len": 1024, "dtype": "float32"},
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
        "levels": [{"summary": s}, {"summary": level(8)}],
    }
    points = cc.trial_points(trial, "synthetic", held_out=False, throughput="busy")
    has = [("output_throughput" in p.measured, "tpot_ms" in p.measured) for p in points]
    assert has == [(False, True), (True, True)]
    level_points = cc.trial_points(trial, "synthetic", held_out=False)
    assert level_points[0].measured["output_throughput"] == s["output_throughput"]


def test_little_s_law_over_about_one_request_a_client_reads_high_past_the_slots():
    # 40 clients, 12 slots, 64 requests: the first wave's queue is shorter than a steady loop's, so the mean
    # latency is, and clients / mean latency overstates the engine's 12 slots x 100 tok/s
    s = level(40, slots=12)
    assert s["busy_output_throughput"] is None
    assert cc.read_output_throughput(s, "little") > 1.2 * 12 * 100
    assert level(8, slots=12)["output_throughput"] < cc.read_output_throughput(level(8, slots=12), "little")


def recorded(clients: float, steady: float, requests: int = 64) -> dict:
    """A recorded level's summary whose steady rate is ``steady`` and whose whole window holds the drain as the
    capacity surface's do: the level's rate is about requests / (requests + 0.8 x clients) of the steady one."""
    return {
        "level": {"concurrency": clients},
        "completed": requests,
        "total_input_tokens": 128 * requests,
        "total_output_tokens": OUTPUT_TOKENS * requests,
        "output_throughput": steady * requests / (requests + 0.8 * clients),
        "busy_output_throughput": steady if clients <= 44 else None,
        "tpot_ms": {"mean": 10.0},
        "ttft_ms": {"mean": 50.0},
        "e2el_ms": {"mean": 1000.0 * clients * OUTPUT_TOKENS / steady},
    }


def test_the_knee_read_at_the_steady_rate_is_the_engine_s_not_the_run_s_length():
    # an engine whose steady rate grows by 100 tok/s a client up to 16 clients, flat past them: knee at 16
    loads = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 16, 18, 20, 22, 24, 27, 30, 33, 36, 40, 44, 48, 53, 64]
    trial = {
        "outcome": "COMPLETE",
        "engine_args": {"max_num_seqs": 32, "max_model_len": 1024, "dtype": "float32"},
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
        "levels": [{"summary": recorded(x, 100.0 * min(x, 16))} for x in loads],
    }

    def knee(throughput: cc.Throughput) -> float | None:
        points = cc.trial_points(trial, "synthetic", held_out=False, throughput=throughput)
        read = [p for p in points if "output_throughput" in p.measured]
        return measured_knee((p.load, p.measured["output_throughput"]) for p in read)

    assert knee("busy") == 16  # the levels past 44 clients have no busy window: the curve stops there
    assert knee("little") == 16
    # the drain's share grows with the clients, so the level's rate bends early and falls past the knee
    assert knee("level") == 14
