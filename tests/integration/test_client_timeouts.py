"""The load client's timeouts and dropped streams against the fake server (section 10 of the checklist)."""

import asyncio
import time

from servetune.load.client import DROPPED, TIMEOUT_FIRST_TOKEN, TIMEOUT_IDLE, TIMEOUT_TOTAL, StreamingClient
from servetune.load.requests import RequestSpec
from servetune.metrics import RequestRecord
from servetune.testing.fake_openai import FakeOpenAI
from tests.conftest import serve_fake


def send_one(url, out=10, drop_after=None, **timeouts):
    async def go():
        async with StreamingClient(url, "fake", **timeouts) as client:
            record = RequestRecord(index=0, sent=0.0, input_tokens=1, max_tokens=out)
            return await client.send(
                RequestSpec(0, "x", 1, out, "d"), record, time.perf_counter(), drop_after=drop_after
            )

    return asyncio.run(go())


def test_first_token_timeout_is_its_own_kind():
    with serve_fake(FakeOpenAI(ttft_ms=3000, itl_ms=5)) as url:
        started = time.perf_counter()
        r = send_one(url, first_token_timeout_s=0.3, idle_timeout_s=0.2, timeout_s=30)
        took = time.perf_counter() - started
    assert not r.ok and r.error_kind == TIMEOUT_FIRST_TOKEN and r.chunk_times == []
    # It gave up at the first-token deadline (0.3 s), not when the first token came (3 s): the
    # 2.2 s between them are a loaded host's room to start the client and notice the deadline.
    assert took < 2.5, f"{took:.2f} s to give up on a first token due at 3 s, with a 0.3 s deadline"


def test_idle_stream_timeout_after_tokens_arrived():
    # The first three tokens 5 ms apart, then 4 s of silence: an idle timeout of 1 s fires in it (with 3 s to spare)
    # and not before the third token unless the host stalls 1 s, twice the half second seen on a busy host (at 0.3 s
    # it was below that: the fake sleeps to a schedule, so a loaded host adds time once, bench/fake_pace_noise.py).
    with serve_fake(FakeOpenAI(ttft_ms=10, itl_ms=5, stall_after=3, stall_ms=4000)) as url:
        r = send_one(url, first_token_timeout_s=2.0, idle_timeout_s=1.0, timeout_s=30)
    assert not r.ok and r.error_kind == TIMEOUT_IDLE and len(r.chunk_times) == 3


def test_a_slow_but_steady_stream_passes_the_idle_timeout():
    with serve_fake(FakeOpenAI(ttft_ms=10, itl_ms=100)) as url:
        r = send_one(url, out=12, first_token_timeout_s=2.0, idle_timeout_s=0.8, timeout_s=30)
    assert r.ok and r.output_tokens == 12, (
        r
    )  # every gap (0.1 s) stays under 0.8 s (room for a loaded host), the whole takes longer


def test_total_timeout_on_a_steady_stream():
    # The first-token and idle timeouts as long as the total one: they are set (so the client weighs them), but
    # only the total one can bind, since the others start no earlier than it. With an idle timeout of 0.5 s a
    # stall of half a second on a busy host ended the stream as idle instead. 40 tokens take 2 s (the fake
    # paces them by its clock, so never sooner); 1.2 s leaves a second for the first 3 (0.11 s on a quiet host).
    with serve_fake(FakeOpenAI(ttft_ms=10, itl_ms=50)) as url:
        r = send_one(url, out=40, first_token_timeout_s=1.2, idle_timeout_s=1.2, timeout_s=1.2)
    assert not r.ok and r.error_kind == TIMEOUT_TOTAL and 3 <= len(r.chunk_times) < 40, (r.error_kind, r.chunk_times)


def test_a_dropped_stream_closes_the_connection_and_the_server_sees_it():
    fake = FakeOpenAI(ttft_ms=10, itl_ms=20)
    with serve_fake(fake) as url:
        r = send_one(url, out=200, drop_after=3)
        deadline = (
            time.monotonic() + 15.0
        )  # the server notices at its next write, 20 ms on: ample room for a loaded host
        while fake.running and time.monotonic() < deadline:
            time.sleep(0.02)
        running, generated, disconnected = fake.running, fake.generated, fake.disconnected
    assert not r.ok and r.error_kind == DROPPED and len(r.chunk_times) == 3
    # It stopped long before its 200 tokens (its tokens are paced by the clock, so a slow notice is only a few more).
    assert running == 0 and disconnected == 1 and generated < 20, (running, disconnected, generated)
