"""Every level starts from an empty prefix cache, and a level whose cache was warm says so (fake server)."""

from __future__ import annotations

import asyncio

import pytest

from servetune.config.slo import Slo
from servetune.config.workload import load_workload
from servetune.load.client import StreamingClient
from servetune.load.requests import PromptFactory
from servetune.load.runner import Level
from servetune.testing.fake_openai import FakeOpenAI
from servetune.trial.measure import LevelPlan, measure_level
from servetune.trial.readings import cache_note, explained_hit_rate
from tests.conftest import serve_fake


def two_levels_on_the_same_prompts(fake: FakeOpenAI, tokenizer) -> list:
    """Two runs of one level that draw the same prompts (the same stream): the second can only hit a warm cache."""
    workload = load_workload("cpu-tiny")
    plan = LevelPlan(Level("concurrency", 4), num_requests=16, duration_s=None, warmup_requests=0)

    async def go(url: str) -> list:
        async with StreamingClient(url, "fake", api=workload.api, ignore_eos=True) as client:
            return [
                (await measure_level(client, url, workload, PromptFactory(tokenizer), plan, stream=1, slo=Slo()))[0]
                for _ in range(2)
            ]

    with serve_fake(fake) as url:
        return asyncio.run(go(url))


def test_each_level_resets_the_prefix_cache_so_repeated_prompts_do_not_hit(tiny_tokenizer):
    fake = FakeOpenAI(ttft_ms=1, itl_ms=1)
    first, second = two_levels_on_the_same_prompts(fake, tiny_tokenizer)
    assert fake.resets == 2
    assert second.server_metrics["prefix_cache_hit_rate"] == 0.0
    assert first.cache_note is None and second.cache_note is None


def test_a_server_that_cannot_reset_shows_the_warm_cache_in_its_hit_rate(tiny_tokenizer):
    fake = FakeOpenAI(ttft_ms=1, itl_ms=1, dev_mode=False)
    first, second = two_levels_on_the_same_prompts(fake, tiny_tokenizer)
    assert second.server_metrics["prefix_cache_hit_rate"] == pytest.approx(1.0)
    assert "above the 0% the workload's shared prefix explains" in second.cache_note
    assert first.cache_note.startswith("the prefix cache could not be emptied")


def test_the_workloads_shared_prefix_explains_its_own_hits():
    rag = load_workload("rag")  # 1500 shared tokens for 80% of requests
    assert explained_hit_rate(rag, 4000) == pytest.approx(0.8 * 1500 / 4000)
    assert cache_note({"prefix_cache_hit_rate": 0.33}, rag, 4000, reset=True) is None
    assert "above the 30%" in cache_note({"prefix_cache_hit_rate": 0.5}, rag, 4000, reset=True)
