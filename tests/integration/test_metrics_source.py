"""A level measured against a server whose metrics come from elsewhere than its ``/metrics`` (a Serve
deployment's replicas, read from Ray's metrics agents): the level's server metrics, its gauge peaks and
its warm-cache check come from that source (fake server, its metrics rewritten as Ray's agent names them)."""

from __future__ import annotations

import asyncio
import re
import time

from servetune.config.slo import Slo
from servetune.config.workload import load_workload
from servetune.load.client import StreamingClient
from servetune.load.requests import PromptFactory
from servetune.load.runner import Level
from servetune.serve.metrics import replicas_snapshot
from servetune.testing.fake_openai import FakeOpenAI
from servetune.trial.measure import LevelPlan, measure_level
from tests.conftest import serve_fake


class AgentSource:
    """The fake's metrics as Ray's agent exports a replica's (``ray_vllm_*``, ``ReplicaId``), ``delay_s``
    late, as an agent is a report interval behind; the first read finds nothing yet, as before a fresh
    replica has counted anything."""

    lag_s = 3.0  # what the source promises: the closing read waits at most this long
    delay_s = 1.0  # how late it really is

    def __init__(self, fake: FakeOpenAI) -> None:
        self.fake, self.history, self.gauge_reads = fake, [], 0

    def read(self, gauges_only: bool = False):
        now = time.monotonic()
        self.history.append((now, self.fake.metrics_text()))
        self.gauge_reads += gauges_only
        text = next((text for at, text in reversed(self.history) if at <= now - self.delay_s), None)
        if text is None:
            return None
        text = re.sub(r"vllm:(\w+)\{", r'ray_vllm_\1{ReplicaId="r1",', text)
        return replicas_snapshot([text.replace("# TYPE vllm:", "# TYPE ray_vllm_")], {"r1"}, gauges_only)


def test_a_levels_server_metrics_come_from_the_source_given(tiny_tokenizer):
    fake = FakeOpenAI(ttft_ms=5, itl_ms=20, max_num_seqs=2)
    source = AgentSource(fake)
    workload = load_workload("cpu-tiny")
    plan = LevelPlan(Level("concurrency", 6), num_requests=18, duration_s=None, warmup_requests=0)

    async def go(url: str):
        async with StreamingClient(url, "fake", api=workload.api, ignore_eos=True) as client:
            return await measure_level(client, url, workload, PromptFactory(tiny_tokenizer), plan, stream=1, slo=Slo(),
                                       reset_cache=lambda: True, metrics=source, sample_every_s=0.05)  # fmt: skip

    with serve_fake(fake) as url:
        result, _ = asyncio.run(go(url))
    server = result.server_metrics
    # the first read found nothing: the level counts from zero; the closing read waited until the late
    # source counted every request (one read after the level would have missed the last second's)
    assert server["generation_tokens"] == result.summary.total_output_tokens == fake.generated, server
    assert server["requests_finished"] == 18 and server["prefix_cache_queries"] > 0
    # gauges were sampled from the source (every half of its lag, not every 0.05 s)
    assert source.gauge_reads >= 2, source.gauge_reads
    assert server["requests_waiting_max"] >= 1 and server["requests_running_max"] == 2, server
    assert result.cache_note is None


def test_the_closing_read_waits_only_until_the_source_has_counted_the_level():
    from servetune.engine.metrics import MetricsSnapshot
    from servetune.trial.readings import settled as _settled

    reads = []

    async def counting(finished_by_read):
        async def read(gauges_only=False):
            reads.append(time.monotonic())
            return MetricsSnapshot(
                counters={"requests_finished": finished_by_read[min(len(reads), len(finished_by_read)) - 1]}
            )

        return read

    async def go(finished_by_read, wait_s):
        reads.clear()
        start = time.monotonic()
        after = await _settled(await counting(finished_by_read), MetricsSnapshot(counters={"requests_finished": 10.0}), 8,
                               wait_s=wait_s, every_s=0.05)  # fmt: skip
        return after.counters["requests_finished"], time.monotonic() - start

    # the source reaches 18 (10 before + the level's 8) on its third read: no longer. Three reads 0.05 s apart
    # take 0.1 s; the wait it must not sit out is 20 s, so half of that is the bound (a busy host's stalls are
    # seconds at worst, and waiting it out would read far more than three times).
    counted, took = asyncio.run(go([12.0, 15.0, 18.0, 18.0], wait_s=20.0))
    assert counted == 18.0 and len(reads) == 3 and took < 20.0 / 2, (counted, len(reads), took)
    # it never does (a request the engine did not count): the last read, after the promised lag
    counted, took = asyncio.run(go([12.0], wait_s=0.5))
    assert counted == 12.0 and took >= 0.5, (counted, took)


def test_the_closing_reads_keep_the_gauges_of_a_level_shorter_than_the_lag():
    from servetune.engine.metrics import MetricsSnapshot
    from servetune.trial.readings import settled as _settled

    # the source, late: the level's middle (4 running) before it counts the level's requests, then idle
    shown = iter([({"requests_running": 4.0}, 14.0), ({"requests_running": 0.0}, 18.0)])

    async def read(gauges_only=False):
        gauges, finished = next(shown)
        return MetricsSnapshot(gauges=gauges, counters={"requests_finished": finished})

    peaks: dict[str, float] = {}
    after = asyncio.run(
        _settled(read, MetricsSnapshot(counters={"requests_finished": 10.0}), 8, wait_s=5.0, every_s=0.01, peaks=peaks)
    )
    assert after.counters["requests_finished"] == 18.0 and peaks == {"requests_running_max": 4.0}, peaks


def test_a_source_with_nothing_to_read_is_not_waited_for():
    from servetune.engine.metrics import MetricsSnapshot
    from servetune.trial.readings import settled as _settled

    async def nothing(gauges_only=False):
        return None

    start = time.monotonic()
    assert asyncio.run(_settled(nothing, MetricsSnapshot(), 8, wait_s=20.0)) is None
    # not the 20 s promised lag (Ray's default report interval on a cluster): half of it, far above a busy host's stalls
    assert time.monotonic() - start < 20.0 / 2
