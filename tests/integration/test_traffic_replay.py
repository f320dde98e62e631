"""Trace replay and conversations against the fake server: when requests are sent."""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics

import pytest

from servetune.config.workload import load_workload
from servetune.load.client import StreamingClient
from servetune.load.requests import RequestSpec
from servetune.load.runner import Level, run_level, workload_levels
from servetune.summary import summarize
from servetune.testing.process import fake_server_process

#: Scheduling slack on a shared two-core host: a stall of a busy host (an engine starting beside
#: the test) reached 0.05 s; still well under the 0.3 s think time whose absence the test catches. A send is never
#: early; how late the sends are is judged by their median, since a stall of the client's process (bench/fake_pace_noise.py:
#: a stall adds time once, the schedule is absolute) makes the sends due during it late together, by as much as it
#: lasted (a flake census round at load 21, 2026-12-08: one send 0.21 s late, a turn 0.25 s).
SLACK_S = 0.2


def assert_on_time(got: list[float], want: list[float]) -> None:
    """Each send at or after its time (5 ms of timer resolution), and the sends' median lateness within the slack."""
    late = [g - w for g, w in zip(got, want, strict=True)]
    assert min(late) >= -0.005 and statistics.median(late) <= SLACK_S, (got, want)


def run(url: str, specs: list[RequestSpec], level: Level, n: int) -> list:
    async def go():
        async with StreamingClient(url, "fake", api="completions", ignore_eos=True) as client:
            return await run_level(client, specs, level, num_requests=n, warmup_requests=0)

    return asyncio.run(go())


def trace_workload(tmp_path, times: list[float], sessions: list[str] | None = None, extra: str = ""):
    log = tmp_path / "log.jsonl"
    rows = [{"timestamp": 1_700_000_000 + t, "input_tokens": 5, "output_tokens": 2} for t in times]
    if sessions is not None:
        for row, session in zip(rows, sessions, strict=True):
            row["session_id"] = session
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "w.yaml"
    path.write_text("name: t\ninput_tokens: {dist: fixed, value: 5}\noutput_tokens: {dist: fixed, value: 2}\n"
                    f"arrival: {{process: trace, file: log.jsonl, speedup: 2}}\n{extra}")  # fmt: skip
    return load_workload(path)


def test_trace_replay_sends_at_the_recorded_times_over_the_speedup(tmp_path):
    times = [0.0, 0.2, 0.25, 0.9, 1.0, 1.6]
    (level,) = workload_levels(trace_workload(tmp_path, times), None, None)
    assert level.speedup == pytest.approx(2.0) and level.value == pytest.approx(2 * 5 / 1.6)
    specs = [RequestSpec(i, "a b c", 3, 2, "default") for i in range(8)]
    with fake_server_process("--ttft-ms", "5", "--itl-ms", "1") as url:
        records = run(url, specs, level, 8)
    sent = [r.sent - records[0].sent for r in records]
    mean_gap = 1.6 / 5
    # After its last request the trace starts over, one mean gap later.
    expected = [t / 2 for t in times] + [(1.6 + mean_gap) / 2, (1.6 + mean_gap + 0.2) / 2]
    assert all(r.ok for r in records)
    assert_on_time(sent, expected)


def test_conversations_follow_their_answers_after_the_think_time(tmp_path):
    """A closed loop of 2 holds 2 conversations at a time; each turn waits for the last answer and the think time."""
    think = 0.3
    specs = []
    for session in range(4):
        for turn in range(3):
            index = len(specs)  # input_tokens tell the records apart
            specs.append(RequestSpec(index, "a b c", 100 + index, 4, "default", session=session, turn=turn,
                                     think_s=think if turn else 0.0))  # fmt: skip
    with fake_server_process("--ttft-ms", "20", "--itl-ms", "5") as url:
        records = run(url, specs, Level("concurrency", 2), 12)
    by_spec = {r.input_tokens - 100: r for r in records}
    assert sorted(by_spec) == list(range(12)) and all(r.ok for r in records)
    spans, sent, due = [], [], []
    for session in range(4):
        turns = [by_spec[3 * session + t] for t in range(3)]
        for before, after in itertools.pairwise(turns):
            sent.append(after.sent)
            due.append(before.end + think)
        spans.append((turns[0].sent, turns[-1].end))
    assert_on_time(sent, due)
    for t, _ in spans:  # never more than two conversations in flight
        assert sum(start <= t < end for start, end in spans) <= 2


def test_an_open_loop_starts_conversations_at_the_trace_times(tmp_path):
    """With sessions, a trace times each conversation's first turn; later turns follow their think time."""
    times = [0.0, 0.1, 0.4, 0.5, 0.6, 1.2]
    w = trace_workload(
        tmp_path, times, sessions=["a", "a", "b", "a", "b", "c"], extra="sessions: {turns: {dist: fixed, value: 2}}\n"
    )
    (level,) = workload_levels(w, None, None)
    assert level.trace == pytest.approx((0.4, 0.8))  # conversations a, b, c start at 0, 0.4, 1.2
    think = 0.2
    specs = []
    for session in range(3):
        for turn in range(2):
            index = len(specs)
            specs.append(RequestSpec(index, "a b c", 100 + index, 2, "default", session=session, turn=turn,
                                     think_s=think if turn else 0.0))  # fmt: skip
    with fake_server_process("--ttft-ms", "5", "--itl-ms", "1") as url:
        records = run(url, specs, level, 6)
    by_spec = {r.input_tokens - 100: r for r in records}
    t0 = by_spec[0].sent
    starts = [by_spec[2 * s].sent - t0 for s in range(3)]
    for got, want in zip(starts, (0.0, 0.2, 0.6), strict=True):  # speed-up 2
        assert want - 0.005 <= got <= want + SLACK_S, starts
    for s in range(3):
        first, second = by_spec[2 * s], by_spec[2 * s + 1]
        assert first.end + think - 0.005 <= second.sent <= first.end + think + SLACK_S
        assert (first.session, first.turn, second.session, second.turn) == (s, 0, s, 1)
    # per conversation: three of two turns each, their E2E from the first send to the second's end (think included)
    talks = summarize(records, {"rate": 1.0}).conversations
    assert talks is not None and talks.conversations == 3 and [t.turn for t in talks.by_turn] == [0, 1]
    assert talks.e2el_ms.p99 <= (2 * max(r.e2el_s for r in records) + think + SLACK_S) * 1000
    assert think * 1000 - 5 <= talks.think_ms_mean <= (think + SLACK_S) * 1000
    assert talks.e2el_ms.mean >= talks.think_ms_mean + sum(r.e2el_s for r in records) / 3 * 1000 - 1e-6
    assert [t.cache_hit_rate for t in talks.by_turn] == [None, None]  # the fake does not report cached tokens
