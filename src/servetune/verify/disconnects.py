"""The disconnect scenario: do dropped streams stop costing the engine anything?

Each round sends streams that last as long as the server allows, waits until every one has its
first tokens and vLLM's gauges show them all in flight, then closes half the connections (the
client's task is cancelled: aiohttp drops the connection mid-stream). vLLM's running and waiting
requests must fall back to the survivors it still runs within the allowance:
``FALLBACK_S``, or ``RELEASE_STEPS`` of the engine's steps as the streams showed them, when its
steps are slow (a loaded host). The survivors it still runs are those it has not finished by its
own count (``vllm:request_success_total`` since the round began, read in the same scrape as the
gauge: ``stats.survivors_running``), not those the client still holds open: a client reading
behind the engine (a loaded host) holds a survivor open after the engine finished it, and a
dropped stream still held would pass for released. The gauge is watched on for ``WATCH_S``, so that a release that
came late is told apart from one that never came (a leak). The survivors, as long as the dropped
ones, must still run then: a round whose requests had all ended on the server (a fast engine
outruns a client on a loaded host) proves nothing, is not judged, and is tried again (up to as
many extra rounds). So is a round where a stream ends before the drop (every stream's first tokens,
then the gauge): on a loaded two-core host vLLM's engine ran one of a round's streams at a time (its
log: running 1, waiting 0) and the client got each stream whole, in one burst at its end, seconds
after the round began, so the first streams had ended before the last had their first tokens. Such a
round is given up when its first stream ends, without a drop or a watch, and tried again (up to twice
as many rounds in all); ``DropRound`` keeps when its phases and each stream ran, and why it judged
nothing. The streams are not ended by the client's first-token and idle timeouts (only
by its total one): they are the round's probes, and a pause of the engine is not what it judges.
Then, for ``TOKEN_SPAN_S``, the tokens vLLM generates
(``vllm:generation_tokens_total``) must follow what the survivors receive. ``stats.DropRound``
holds a round, ``stats.cancellation_success_rate`` and ``stats.tokens_stopped`` judge them.

Through Serve the gauges and the finished count are the replicas' added up, read through Ray's metrics agents up to the
source's lag late: the waits, the allowance and the token span grow by it (the span by twice it,
so that two reads each late by up to the lag still cover mostly the same tokens as the client's).
The agents are read once a report interval (``readings.report_interval_s``, 1 s on servetune's local Ray), as often
as what they hold changes, not every 0.1 s as a bare engine's ``/metrics``: each read makes Ray's dashboard agent
render every metric of its node.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import replace

import aiohttp

from servetune.load.client import DROPPED, StreamingClient
from servetune.load.requests import iter_requests
from servetune.metrics import RequestRecord
from servetune.trial.readings import report_interval_s
from servetune.verify.scenarios import STREAMS, ScenarioResult, Target, fixed_workload, fmt
from servetune.verify.stats import (
    DropRound,
    StreamTimes,
    cancellation_success_rate,
    step_s,
    survivors_running,
    tokens_stopped,
)
from servetune.verify.watch import finished, in_flight, lag_s, read_metrics

DROP_SHARE = 0.5
FALLBACK_S = 2.0  # vLLM must release dropped requests within this, or within RELEASE_STEPS steps
RELEASE_STEPS = 10  # engine steps a release may take: notice the closed connection, abort, step, report
WATCH_S = 10.0  # how long the gauge is followed after a drop, to tell a late release from a leak
UNREAD_LIMIT = 3  # scrapes in a row that fail end the watch
GAUGE_WAIT_S = 5.0  # how long a round waits for /metrics to show the streams it sent
TOKEN_SPAN_S = 1.0  # then vLLM's generated tokens are compared with what the survivors receive


async def _wait_first_tokens(
    records: list[RequestRecord], tasks: list[asyncio.Task], chunks: int, timeout_s: float
) -> None:
    """Until every stream has ``chunks`` content chunks, or one has ended (the round is given up)."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if any(task.done() for task in tasks) or all(len(r.chunk_times) >= chunks for r in records):
            return
        await asyncio.sleep(0.02)


def _ended_first(records: list[RequestRecord]) -> str | None:
    """Why the round is given up before its drop: a stream ended first (None: none has)."""
    ended = [r for r in records if r.end is not None]
    if not ended:
        return None
    r = min(ended, key=lambda r: r.end or 0.0)
    how = "finished" if r.error_kind is None else r.error_kind
    return (f"stream {r.index} ended ({how}) at {r.end:.2f} s, after {len(r.chunk_times)} chunks, before the "
            f"drop: {len(ended)} of {len(records)} had ended")  # fmt: skip


def _how(r: RequestRecord) -> str:
    if r.error_kind is None:
        return "finished" if r.end is not None else "open"
    if r.error_kind == DROPPED:
        return "dropped" if r.error == DROP_TEXT else "closed"
    return r.error_kind


DROP_TEXT = "closed by the client after its first tokens"


async def _drop_round(
    t: Target, session: aiohttp.ClientSession, client: StreamingClient, requests, streams: int, dropped: int
) -> tuple[DropRound, list[RequestRecord]]:
    t0 = time.perf_counter()
    lag = lag_s(t.metrics)
    poll_s = 0.1 if t.metrics is None else report_interval_s(t.metrics)  # a lagging source: once a report interval

    async def read(gauges_only: bool = False):
        return await read_metrics(session, t.url, t.metrics, gauges_only=gauges_only)

    # What vLLM had finished before the round: the survivors it finishes are counted from here.
    finished_at = finished(await read(gauges_only=True))
    specs = [next(requests) for _ in range(streams)]
    records = [RequestRecord(index=i, sent=0.0, input_tokens=s.input_tokens, max_tokens=s.output_tokens,
                             request_class="dropped" if i < dropped else "survivor") for i, s in enumerate(specs)]  # fmt: skip
    # The streams are probes, closed by the round (its drop, its end), not users judged on latency: the
    # client's first-token and idle timeouts do not end them. An engine paused past them on a loaded host
    # (5 s at the least) would otherwise have closed every stream before the drop, and no round could judge.
    sends = [client.send(s, r, t0, latency_timeouts=False) for s, r in zip(specs, records, strict=True)]
    tasks = [asyncio.ensure_future(send) for send in sends]
    try:
        round_ = await _judge(t, read, records, tasks, streams, dropped, t0, lag, poll_s, finished_at)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for r in records:
            if r.error_kind == "cancelled":  # the survivors, closed on purpose at the round's end
                r.error_kind, r.error = DROPPED, "closed by verify at the end of the round"
        t.records.extend(records)
    return replace(round_, stream_times=tuple(StreamTimes.of(r, _how(r)) for r in records)), records


async def _judge(t: Target, read, records, tasks, streams: int, dropped: int, t0: float, lag: float,
                 poll_s: float, finished_at: float | None) -> DropRound:  # fmt: skip
    """The round from its first tokens on: its drop while every stream is in flight, the watch, the token span."""

    def since() -> float:
        return round(time.perf_counter() - t0, 3)

    await _wait_first_tokens(records, tasks, 2, 60.0)
    first_tokens_s = since()
    # vLLM's gauges follow its steps: wait (a little) until they show every stream in flight.
    before, gauge_s, seen_by = float("nan"), None, time.perf_counter() + GAUGE_WAIT_S + lag
    while (given_up := _ended_first(records)) is None and time.perf_counter() < seen_by:
        snap = await read(gauges_only=True)
        if snap is not None:
            before, gauge_s = in_flight(snap), since()
            if before >= streams:
                # a source with nothing to read at the round's start (a late one) counts from here: every stream runs
                finished_at = finished(snap) if finished_at is None else finished_at
                break
        await asyncio.sleep(poll_s)
    # A stream that ended before the drop (a loaded host: the pre-drop phase outlasted it) leaves nothing to judge
    # the drop by: the round is given up at once, unobserved, and tried again, rather than dropping what has ended.
    if (given_up := given_up or _ended_first(records)) is not None:
        if gauge_s is None and (snap := await read(gauges_only=True)) is not None:
            before, gauge_s = in_flight(snap), since()
        survivors = sum(r.end is None for r in records[dropped:])
        return DropRound(dropped, survivors, before, 0.0, None, streams=streams, first_tokens_s=first_tokens_s,
                         gauge_s=gauge_s, given_up=given_up)  # fmt: skip
    for task in tasks[:dropped]:
        task.cancel()  # the client goes away: aiohttp closes the connection mid-stream
    await asyncio.gather(*tasks[:dropped], return_exceptions=True)
    for r in records[:dropped]:
        if r.error_kind == "cancelled":
            r.error_kind, r.error = DROPPED, DROP_TEXT
    dropped_at = time.perf_counter()
    drop_s = since()
    survivors = records[dropped:]
    allowed = max(FALLBACK_S, RELEASE_STEPS * step_s([r.chunk_times for r in records])) + lag
    # vLLM released the dropped streams once what it holds is no more than the survivors it still runs by its own count
    # of those it finished; ``settled`` is the last sample asked within the allowance.
    released, unread = None, 0
    settled, open_now, done_then = before, sum(r.end is None for r in survivors), None
    # Without a gauge before the drop (the engine cannot be read, or died) there is nothing to watch.
    while not math.isnan(before) and (asked := time.perf_counter() - dropped_at) <= max(WATCH_S, 2 * allowed):
        open_then = sum(r.end is None for r in survivors)
        snap = await read(gauges_only=True)
        unread = 0 if snap is not None else unread + 1
        if unread >= UNREAD_LIMIT:
            break  # the engine stopped answering: what it holds cannot be told
        if snap is not None:
            held = in_flight(snap)
            done = None if finished_at is None or (now := finished(snap)) is None else now - finished_at
            running = survivors_running(len(survivors), done, open_then)
            if asked <= allowed:
                settled, open_now, done_then = held, running, done
            if held <= running:
                # Without vLLM's count, the client's: a survivor the engine finished just before the read still reads
                # open to the client until its last chunk is handled, so it must hold a poll later too.
                if done is None:
                    await asyncio.sleep(poll_s)
                    if sum(r.end is None for r in survivors) != open_then:
                        continue
                released = asked
                break
        await asyncio.sleep(poll_s)
    fell_back = released if released is not None and released <= allowed else None
    # Then vLLM's generated tokens must follow what the survivors receive: a dropped request
    # it still ran would add its own (judged only while every survivor streams on).
    server_tokens = client_tokens = None
    first = await read()
    start = time.perf_counter() - t0
    await asyncio.sleep(TOKEN_SPAN_S + 2 * lag)
    last = await read()
    end = time.perf_counter() - t0
    if (
        first is not None
        and last is not None
        and "generation_tokens" in last.counters
        and all(r.end is None for r in survivors)
    ):
        server_tokens = last.counters["generation_tokens"] - first.counters.get("generation_tokens", 0.0)
        client_tokens = sum(start <= c <= end for r in survivors for c in r.chunk_times)
    return DropRound(dropped, open_now, before, settled, fell_back, server_tokens, client_tokens, streams,
                     released_s=released, allowed_s=allowed, first_tokens_s=first_tokens_s, gauge_s=gauge_s,
                     drop_s=drop_s, survivors_finished=done_then)  # fmt: skip


async def _drained(session: aiohttp.ClientSession, t: Target, timeout_s: float = 10.0) -> None:
    deadline = time.perf_counter() + timeout_s + lag_s(t.metrics)
    while time.perf_counter() < deadline:
        snap = await read_metrics(session, t.url, t.metrics, gauges_only=True)
        if snap is None or in_flight(snap) == 0:
            return
        await asyncio.sleep(0.2 if t.metrics is None else report_interval_s(t.metrics))


async def disconnects(t: Target) -> ScenarioResult:
    streams = int(max(4, min(t.level.value if t.level.kind == "concurrency" else 8, 64)))
    dropped = max(1, round(streams * DROP_SHARE))
    prompt = min(16, t.max_model_len // 4)
    out = t.max_model_len - prompt - 1  # survivors must outlast the check: as long as the server allows
    requests = iter_requests(
        fixed_workload(t.workload, "disconnects", prompt, out), t.prompts, stream=STREAMS["disconnects"]
    )
    rounds: list[DropRound] = []
    tries = 2 * t.budget.drop_rounds
    # The streams open connections of their own: a round starting as the last one's streams end would otherwise send
    # on their pooled keep-alive connections, which vLLM's server, slow on a loaded host, closed under two to four
    # requests in each of three runs of the real-vLLM e2e ("Server disconnected" before any token).
    async with aiohttp.ClientSession() as session, t.client.with_fresh_connections() as client:
        # A round that proves nothing (not observed) is tried again, up to as many extra rounds that drop; rounds
        # given up before their drop (a stream ended first: they end then, without a watch) up to twice as many rounds.
        while sum(r.drop_s is not None for r in rounds) < tries and len(rounds) < 2 * tries:
            await _drained(session, t)
            round_, _ = await _drop_round(t, session, client, requests, streams, dropped)
            rounds.append(round_)
            if sum(r.observed for r in rounds) >= t.budget.drop_rounds or math.isnan(round_.before):
                break  # enough rounds judged, or the engine's gauges cannot be read: another round would not change that
        await _drained(session, t)
    rate = cancellation_success_rate(rounds)
    stopped = tokens_stopped(rounds)
    numbers = {"streams": streams, "dropped_per_round": dropped, "output_tokens": out, "fallback_s_max": FALLBACK_S,
               "release_steps": RELEASE_STEPS, "watch_s": WATCH_S, "rounds": [r.as_dict() for r in rounds],
               "cancellation_success_rate": rate, "tokens_stopped": stopped}  # fmt: skip
    if rate is None:
        why = rounds[-1].unobserved if rounds else None
        return ScenarioResult(
            "disconnects",
            False,
            f"vLLM's /metrics never showed the streams in flight: cancellation not observed in {len(rounds)} rounds "
            f"(the last: {why})",
            numbers,
        )
    seen = [r for r in rounds if r.observed]
    passed = rate >= 1.0 and stopped
    reason = (f"{len(seen)} rounds dropping {dropped} of {streams} streams ({len(rounds) - len(seen)} more not observed): "
              f"in flight fell back to the survivors in {', '.join(_release_text(r) for r in seen)}; "
              f"cancellation success {rate:.0%}; tokens vLLM generated "
              f"{'matched what the client received' if stopped else 'exceeded what the client received'}")  # fmt: skip
    return ScenarioResult("disconnects", passed, reason, numbers)


def _release_text(r: DropRound) -> str:
    allowed = f"{r.allowed_s or FALLBACK_S:.1f} s allowed"
    if r.fell_back_s is not None:
        return fmt(r.fell_back_s, " s", 2)
    if r.released_s is not None:
        return f"{r.released_s:.2f} s (late: {allowed})"
    return f"never ({r.settled - r.survivors:g} dropped still held after {allowed}, and after the {WATCH_S:g} s watch)"
