"""Conversations hit vLLM's real prefix cache (the fake server's cache knows whole prompts only).

One engine start (tens of seconds) and two short levels: the same lengths with and without
sessions. A later turn's prompt begins with the previous one, so vLLM reuses its blocks; prompts
on their own share nothing. The level's explained hit rate, from the turns' reused tokens, must
cover what vLLM measured, so a sessions level is not flagged as a warm cache; per turn, vLLM's own
per-request cached tokens show the hit rate rise after the first turn.
"""

import asyncio

import pytest

from servetune.config.slo import Slo
from servetune.config.workload import load_workload
from servetune.engine.server import VllmServer
from servetune.load.client import StreamingClient
from servetune.load.requests import PromptFactory
from servetune.load.runner import Level
from servetune.trial.measure import LevelPlan, measure_level
from tests.processes import processes_mentioning

pytestmark = pytest.mark.e2e

pytest.importorskip("vllm", reason="the e2e tests need vLLM (the CPU build: pip install servetune[cpu])")

LENGTHS = "input_tokens: {dist: uniform, min: 40, max: 80}\noutput_tokens: {dist: fixed, value: 16}\n"


def test_later_turns_hit_the_prefix_cache(tiny_model, tiny_tokenizer, tmp_path):
    (tmp_path / "single.yaml").write_text("name: single\n" + LENGTHS)
    (tmp_path / "talk.yaml").write_text("name: talk\n" + LENGTHS + "sessions: {turns: {dist: fixed, value: 4}}\n")
    single, talk = load_workload(tmp_path / "single.yaml"), load_workload(tmp_path / "talk.yaml")
    plan = LevelPlan(Level("concurrency", 2), num_requests=16, duration_s=None, warmup_requests=0)
    engine_args = {"enforce_eager": True, "max_model_len": 1024, "dtype": "float32", "block_size": 32,
                   "enable_prompt_tokens_details": True}  # fmt: skip
    server = VllmServer(
        tiny_model,
        engine_args,
        {"VLLM_CPU_KVCACHE_SPACE": "1"},
        log_path=tmp_path / "engine.log",
        startup_timeout_s=300,
    )

    async def measure(url, workload):
        async with StreamingClient(url, str(tiny_model), api="completions", ignore_eos=True) as client:
            result, records = await measure_level(
                client, url, workload, PromptFactory(tiny_tokenizer), plan, stream=1, slo=Slo()
            )
            return result, records

    with server:
        alone, _ = asyncio.run(measure(server.url, single))
        turns, records = asyncio.run(measure(server.url, talk))
    assert all(r.ok for r in records) and len(records) == 16, {r.error for r in records}
    assert alone.server_metrics["prefix_cache_hit_rate"] < 0.05
    # Four turns of about 60 new and 16 answer tokens: the later turns' earlier prompts are about
    # 60% of all prompt tokens; vLLM reuses whole blocks (32 tokens here), about 50%.
    assert turns.server_metrics["prefix_cache_hit_rate"] > 0.35
    assert turns.cache_note is None and alone.cache_note is None
    # Per turn, from vLLM's own per-request numbers (usage.prompt_tokens_details.cached_tokens): a first turn
    # shares nothing, every later turn reuses the conversation so far.
    talks = turns.summary.conversations
    assert talks is not None and alone.summary.conversations is None
    assert [t.turn for t in talks.by_turn] == [0, 1, 2, 3]
    assert all(t.cache_reported == t.requests > 0 for t in talks.by_turn)
    hits = [t.cache_hit_rate for t in talks.by_turn]
    assert hits[0] < 0.05 and all(h > 0.3 for h in hits[1:]), hits
    prompts = [t.prompt_tokens_mean for t in talks.by_turn]
    assert prompts == sorted(prompts), prompts  # each turn carries the one before
    assert talks.conversations == 4 and talks.e2el_ms.p50 > talks.ttft_worst_ms.p50 >= talks.ttft_ms.p50
    assert processes_mentioning(tiny_model) == []
