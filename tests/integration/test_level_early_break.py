"""A level that has clearly broken its SLO stops early and keeps what it measured (fake server)."""

from __future__ import annotations

import asyncio

import pytest

from servetune.config.slo import Slo
from servetune.config.workload import load_workload
from servetune.load.client import StreamingClient
from servetune.load.requests import PromptFactory
from servetune.load.runner import Level
from servetune.testing.fake_openai import FakeOpenAI
from servetune.testing.process import fake_server_process
from servetune.trial.measure import EarlyBreak, LevelPlan, measure_level
from tests.conftest import serve_fake


def measure(ttft_ms: float, slo: str, tokenizer):
    workload = load_workload("cpu-tiny")
    plan = LevelPlan(Level("concurrency", 4), num_requests=40, duration_s=None, warmup_requests=4)

    async def go(url: str):
        async with StreamingClient(url, "fake", api=workload.api, ignore_eos=True) as client:
            return await measure_level(
                client, url, workload, PromptFactory(tokenizer), plan, stream=1, slo=Slo.parse(slo)
            )

    with serve_fake(FakeOpenAI(ttft_ms=ttft_ms, itl_ms=1)) as url:
        return asyncio.run(go(url))


def test_a_level_twice_over_its_ttft_bound_stops_at_half_and_keeps_its_numbers(tiny_tokenizer):
    result, records = measure(300, "ttft_ms.p95=100", tiny_tokenizer)
    measured = [r for r in records if not r.warmup]
    assert 20 <= len(measured) <= 20 + 4  # half of 40, and those in flight then finish
    assert result.stopped_early.startswith("ttft_ms_p95 = ") and "over 2x its bound 100" in result.stopped_early
    assert result.summary.completed == len(measured) and not result.meets_slo
    assert result.summary.ttft_ms.p95 > 200


def test_a_level_within_its_bound_runs_every_request(tiny_tokenizer):
    result, _ = measure(20, "ttft_ms.p95=1000", tiny_tokenizer)
    assert result.stopped_early is None and result.summary.completed == 40


def test_an_open_loop_above_the_server_s_capacity_stops_once_its_queue_keeps_growing(tiny_tokenizer):
    workload = load_workload("cpu-tiny")
    plan = LevelPlan(Level("rate", 40), num_requests=400, duration_s=None, warmup_requests=0)
    slo = Slo()
    watch = EarlyBreak(slo, plan.level, plan.num_requests, queue_window_s=2.0, queue_growth=8)

    async def go(url: str):
        async with StreamingClient(url, "fake", api=workload.api, ignore_eos=True) as client:
            return await measure_level(client, url, workload, PromptFactory(tokenizer=tiny_tokenizer), plan, stream=1,
                                       slo=slo, sample_every_s=0.2, watch=watch)  # fmt: skip

    # 2 at once, 32 tokens at 5 ms: about 6 requests/s served against 40 offered. The fake in a process of its
    # own: in the client's (a thread, one GIL) a loaded host once starved both, and the queue never grew enough.
    with fake_server_process("--ttft-ms", "5", "--itl-ms", "5", "--max-num-seqs", "2") as url:
        result, records = asyncio.run(go(url))
    assert result.stopped_early.startswith("saturated: vLLM's waiting queue grew from")
    assert 0 < result.summary.completed < 400 and len(records) < 400


def test_a_levels_energy_is_asked_for_its_measured_window_alone(tiny_tokenizer):
    """The device telemetry runs over the whole level, its warm-up requests included; the level asks it for the
    energy of the measured window only (first measured send -> last measured end, on the sampler's clock), so
    energy per token divides the measured requests' energy by their tokens."""
    import time

    import servetune.telemetry as telemetry

    windows = []

    class FixedEnergy(telemetry.TelemetrySampler):
        def __enter__(self):
            self.entered = time.perf_counter()
            return self

        def __exit__(self, *exc):
            self.exited = time.perf_counter()

        def summary(self, window=None):
            windows.append((self.entered, window, self.exited))
            return {"gpu_energy_measured_j": 1000.0} if window is not None else {}

        @property
        def energy_note(self):
            return "RAPL not readable: /sys/class/powercap absent"

    fake = FakeOpenAI(ttft_ms=2, itl_ms=1)
    workload = load_workload("cpu-tiny")
    plan = LevelPlan(Level("concurrency", 2), num_requests=6, duration_s=None, warmup_requests=3)

    async def go(url: str):
        async with StreamingClient(url, "fake", api=workload.api, ignore_eos=True) as client:
            return await measure_level(client, url, workload, PromptFactory(tiny_tokenizer), plan, stream=1,
                                       slo=Slo(), telemetry=lambda: FixedEnergy())  # fmt: skip

    with serve_fake(fake) as url:
        result, records = asyncio.run(go(url))
    (entered, (start, end), exited) = windows[0]
    assert entered < start < end < exited  # inside the sampled span: the warm-up before it is left out
    assert end - start == pytest.approx(result.summary.duration_s)
    warmup_sent = max(r.sent for r in records if r.warmup)
    assert start - entered > warmup_sent  # the first measured send came after the warm-up's
    assert result.telemetry["gpu_energy_measured_j"] == 1000.0
    assert result.energy_note == "RAPL not readable: /sys/class/powercap absent"
