"""The fake engine Ray Serve LLM's replicas run in the integration tests (testing/serve_engine.py), without Serve: the
streamed chunks servetune's client reads (text, then the usage, then the end), its engine arguments said when it
starts, and ``max_num_seqs`` streams at once, the next one waiting for a slot."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from servetune.testing.serve_engine import ENGINE_ENV, START_S_ENV, STARTED, FakeServeEngine


def request(max_tokens: int, prompt: str = "one two three") -> SimpleNamespace:
    return SimpleNamespace(stream=True, max_tokens=max_tokens, prompt=prompt, model="tiny")


async def events(engine: FakeServeEngine, name: str, max_tokens: int, log: list[str]) -> list[dict]:
    chunks = []
    async for packet in engine.completions(request(max_tokens)):
        assert packet.startswith("data: ") and packet.endswith("\n\n")
        body = packet.removeprefix("data: ").strip()
        log.append(f"{name} {'done' if body == '[DONE]' else 'chunk'}")
        if body != "[DONE]":
            chunks.append(json.loads(body))
    return chunks


def test_it_streams_text_then_usage_says_its_arguments_and_keeps_to_max_num_seqs(monkeypatch, capsys):
    monkeypatch.setenv("SERVETUNE_FAKE_TTFT_MS", "1")
    monkeypatch.setenv("SERVETUNE_FAKE_ITL_MS", "1")
    engine = FakeServeEngine(SimpleNamespace(engine_kwargs={"max_num_seqs": 1, "max_model_len": 1024}))

    async def main() -> tuple[list[dict], list[dict], list[str]]:
        await engine.start()
        log: list[str] = []
        first, second = await asyncio.gather(events(engine, "a", 3, log), events(engine, "b", 2, log))
        return first, second, log

    first, second, log = asyncio.run(main())
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith(STARTED)]
    assert [json.loads(line.removeprefix(STARTED)) for line in said] == [{"max_model_len": 1024, "max_num_seqs": 1}]
    assert [c["choices"][0]["text"] for c in first[:-1]] == ["x", "x", "x"] and first[-1]["choices"] == []
    assert first[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert second[-1]["usage"]["completion_tokens"] == 2 and all(c["model"] == "tiny" for c in first + second)
    # one slot: the second stream starts only once the first has sent its last token
    assert log.index("b chunk") > log.index("a chunk") + 2


def test_the_environment_it_is_named_by_is_the_one_ray_serve_llm_reads():
    from ray._common.utils import import_attr
    from ray.llm._internal.serve.constants import RAYLLM_VLLM_ENGINE_CLS_ENV

    assert list(ENGINE_ENV) == [RAYLLM_VLLM_ENGINE_CLS_ENV]
    assert import_attr(ENGINE_ENV[RAYLLM_VLLM_ENGINE_CLS_ENV]) is FakeServeEngine


def test_it_answers_streaming_requests_only():
    engine = FakeServeEngine(SimpleNamespace(engine_kwargs={}))

    async def main() -> None:
        await engine.start()
        async for _ in engine.completions(SimpleNamespace(stream=False, max_tokens=2, prompt="p", model="tiny")):
            pass

    with pytest.raises(ValueError, match="streaming requests only"):
        asyncio.run(main())


def test_it_takes_its_start_delay_to_start_and_says_so_only_then(monkeypatch, capsys):
    monkeypatch.setenv(START_S_ENV, "0.2")
    engine = FakeServeEngine(SimpleNamespace(engine_kwargs={}))

    async def main() -> list[str]:
        starting = asyncio.ensure_future(engine.start())
        await asyncio.sleep(0.05)
        early = capsys.readouterr().out
        await starting
        return [early, capsys.readouterr().out]

    early, late = asyncio.run(main())  # not started before its delay (a sleep never ends early), started after it
    assert STARTED not in early and STARTED in late
