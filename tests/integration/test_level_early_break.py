"""A level that has clearly broken its SLO stops early and keeps what it measured (fake server)."""

from __future__ import annotations

import asyncio

from servetune.config.slo import Slo
from servetune.config.workload import load_workload
from servetune.load.client import StreamingClient
from servetune.load.requests import PromptFactory
from servetune.load.runner import Level
from servetune.testing.fake_openai import FakeOpenAI
from servetune.trial.measure import LevelPlan, measure_level
from tests.conftest import serve_fake


def measure(ttft_ms: float, slo: str, tokenizer):
    workload = load_workload("cpu-tiny")
    plan = LevelPlan(Level("concurrency", 4), num_requests=40, duration_s=None, warmup_requests=4)

    async def go(url: str):
        async with StreamingClient(url, "fake", api=workload.api, ignore_eos=True) as client:
            return await measure_level(client, url, workload, PromptFactory(tokenizer), plan, stream=1, slo=Slo.parse(slo))

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
    result, records = measure(20, "ttft_ms.p95=1000", tiny_tokenizer)
    assert result.stopped_early is None and result.summary.completed == 40
