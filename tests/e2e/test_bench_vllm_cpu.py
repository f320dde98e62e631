"""``servetune bench`` on the real vLLM CPU build with the tiny model (tens of seconds each), and conversations
hitting vLLM's real prefix cache (the fake server's cache knows whole prompts only).

Two engine starts: ``bench`` starts one itself (its own start, claim and log are what the first test checks), and the
module's engine (:func:`engine`) serves the rest: every ask a request can make (through its LoRA adapter, under a
grammar), benched at its ``--url``, and the conversations, measured on it directly. Sharing it saves a start (about 45 s
of a core here) over an engine each.
"""

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from servetune.config.slo import Slo
from servetune.config.workload import load_workload
from servetune.engine.args import load_argspecs, validate_engine_args
from servetune.engine.server import VllmServer
from servetune.load.client import StreamingClient
from servetune.load.requests import PromptFactory
from servetune.load.runner import Level
from servetune.metrics import metric_names
from servetune.results import BenchResult
from servetune.trial.measure import LevelPlan, measure_level
from tests.e2e.needs import need
from tests.processes import processes_mentioning

pytestmark = pytest.mark.e2e

need("vllm")


def servetune(*argv, timeout=600):
    return subprocess.run([sys.executable, "-m", "servetune", *argv], capture_output=True, text=True, timeout=timeout)


def most_in_flight(records: list[dict]) -> int:
    """The most requests that were open at one moment (sent, not yet ended)."""
    events = sorted([(r["sent"], 1) for r in records] + [(r["end"], -1) for r in records], key=lambda e: (e[0], e[1]))
    open_now = most = 0
    for _, step in events:
        open_now += step
        most = max(most, open_now)
    return most


def test_bench_concurrency_1_and_16(tiny_model, tmp_path):
    out = tmp_path / "bench.json"
    done = servetune(
        "bench", "--model", str(tiny_model), "--env", "VLLM_CPU_KVCACHE_SPACE=1", "--engine-arg", "enforce_eager=true",
        "--workload", "cpu-tiny", "--concurrency", "1,16", "--num-requests", "48",
        "--slo", "ttft_ms.p99=5000,tpot_ms.p95=500", "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = BenchResult.model_validate_json(out.read_text())
    one, sixteen = (lv.summary for lv in result.levels)
    for summary in (one, sixteen):
        assert summary.completed == 48 and summary.failed == 0
        assert set(summary.flat()) == set(metric_names())
        assert summary.total_output_tokens == 48 * 32  # ignore_eos holds the output length
        # With every client busy (what the ladder's saturation rule compares): the same engine's tok/s,
        # the staggered start and the last wave left out. The same order of magnitude, no closer: a
        # host stall in the last wave (seen in CI: 2.6 s, all 16 requests) lengthens the level but
        # not the busy window, and put them 4x apart.
        ratio = summary.busy_output_throughput / summary.output_throughput
        assert 0.2 < ratio < 10, (summary.busy_output_throughput, summary.output_throughput)
    assert result.kv_capacity.tokens == 524288  # what the CPU build reports for 1 GiB
    assert result.levels[1].server_metrics["generation_tokens"] >= 48 * 32
    assert "--enforce-eager" in result.command
    records = [json.loads(line) for line in (tmp_path / "bench.requests.jsonl").read_text().splitlines()]
    assert len(records) == 48 + 1 + 48 + 16 and all(r["ok"] for r in records)
    # The client kept the level's concurrency: one request at a time, then up to 16 together.
    # (How much 16 gains in throughput is the engine's and this shared host's, not bench's.)
    assert most_in_flight([r for r in records if r["level"] == 0]) == 1
    assert most_in_flight([r for r in records if r["level"] == 1 and not r["warmup"]]) >= 12
    log = (tmp_path / "bench.engine.log").read_text()
    assert log.count("KV cache size") == 1
    # The engine ran on the core it claimed (one rank), as a trial's does, and says which.
    assert result.cpu_binding is not None and re.findall(r"core ids=\[([0-9, ]+)\]", log) == [result.cpu_binding], (
        result.cpu_binding
    )
    assert f"bound to cores {result.cpu_binding}" in " ".join((done.stdout + done.stderr).split())
    assert processes_mentioning(tiny_model) == []


def test_unknown_engine_argument_is_caught_before_launch(tiny_model):
    done = servetune("bench", "--model", str(tiny_model), "--engine-arg", "max_num_seq=4", timeout=300)
    assert done.returncode == 2
    assert "unknown engine argument 'max_num_seq'" in done.stderr and "did you mean max_num_seqs" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


#: Every ask a request can make of vLLM, on the tiny model: a tool call under a JSON schema (enums and a boolean, so
#: the random model's answer ends), and sampled answers with n choices and log-probabilities; all through the tiny
#: LoRA adapter (built as the tiny model is, models/tiny.py).
ASKS_WORKLOAD = """\
name: asks
seed: 0
api: chat
adapters:
  - {name: tiny-lora, path: tiny}
mix:
  - name: tool
    input_tokens: {dist: fixed, value: 32}
    output_tokens: {dist: fixed, value: 48}
    structured:
      json_schema:
        type: object
        properties: {tool: {enum: [search, answer]}, ok: {type: boolean}}
        required: [tool, ok]
        additionalProperties: false
  - name: sampled
    input_tokens: {dist: fixed, value: 32}
    output_tokens: {dist: fixed, value: 8}
    sampling: {temperature: 0.8, top_p: 0.9, top_k: 20, n: 2, logprobs: 2, presence_penalty: 0.5}
"""


#: The module's engine: the conversations' arguments (float32, 32-token blocks, each answer's cached prompt tokens
#: reported) and the asks': a grammar backend that allows no whitespace between JSON tokens (greedy decoding of the
#: random model may otherwise pick whitespace for ever) and the asks workload's LoRA adapter.
ENGINE_ARGS = {"enforce_eager": True, "max_model_len": 1024, "dtype": "float32", "block_size": 32,
               "enable_prompt_tokens_details": True, "structured_outputs_config.backend": "xgrammar",
               "structured_outputs_config.disable_any_whitespace": True}  # fmt: skip


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory) -> Iterator[tuple[VllmServer, Path]]:
    """One engine for the asks and the conversations, started as ``bench`` starts one for the asks workload (its
    adapter's engine arguments from the workload, checked against vLLM's parser), and the served model's path. The
    model is the tiny one under another path, so a test looking for what mentions ``tiny_model`` (bench's own engine,
    gone) never finds this one, whatever ran first; none of this one is left either."""
    root = tmp_path_factory.mktemp("bench-engine")
    (root / "asks.yaml").write_text(ASKS_WORKLOAD)
    model = root / "tiny"
    model.symlink_to(tiny_model, target_is_directory=True)
    specs = load_argspecs(sys.executable)
    engine_args = load_workload(root / "asks.yaml").adapter_engine_args(
        validate_engine_args(ENGINE_ARGS, specs), root / "models"
    )
    server = VllmServer(model, engine_args, {"VLLM_CPU_KVCACHE_SPACE": "1"}, log_path=root / "engine.log",
                        startup_timeout_s=300, argspecs=specs)  # fmt: skip
    command = server.command()
    # vLLM serves the workload's adapter: the LoRA arguments bench adds for a workload that names one
    assert "--enable-lora" in command and any("tiny-lora=" in arg for arg in command), command
    with server:
        yield server, model
    assert processes_mentioning(model) == []


def test_bench_sends_every_ask_and_vllms_answers_carry_it(engine, tmp_path):
    """Bench at the module's engine's --url: structured output, n > 1, logprobs, sampling and a LoRA adapter reach
    vLLM, and its answers show it."""
    server, model = engine
    workload = tmp_path / "asks.yaml"
    workload.write_text(ASKS_WORKLOAD)
    out = tmp_path / "asks.json"
    done = servetune(
        "bench", "--url", server.url, "--model", str(model),
        "--workload", str(workload), "--concurrency", "4", "--num-requests", "16", "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = BenchResult.model_validate_json(out.read_text())
    assert result.url == server.url and result.command is None  # benched there, nothing started
    (level,) = result.levels
    summary = level.summary
    assert summary.completed == 16 and summary.failed == 0
    # vLLM ran every request with the adapter each named as its model (an unknown model name is a 404)
    assert summary.requests_by_adapter == {"tiny-lora": 16}
    # every tool call is JSON under the schema; every sampled answer had its n choices and logprobs on each token
    assert summary.structured_valid == 1.0 and summary.not_honoured is None
    assert "100% of structured answers parsed as asked" in " ".join((done.stdout + done.stderr).split())
    records = [json.loads(line) for line in (tmp_path / "asks.requests.jsonl").read_text().splitlines()]
    sampled = [r for r in records if r["request_class"] == "sampled"]
    tools = [r for r in records if r["request_class"] == "tool"]
    assert sampled and tools and all(r["ok"] for r in records)
    # n = 2 answers of 8 tokens each (ignore_eos): vLLM's usage counts both choices' tokens
    assert all(r["output_tokens"] == 2 * 8 and r["not_honoured"] is None for r in sampled)
    # a tool call ends where its JSON ends, before max_tokens (ignore_eos is off for structured output)
    assert all(r["structured_valid"] is True and r["output_tokens"] < 48 for r in tools)


LENGTHS = "input_tokens: {dist: uniform, min: 40, max: 80}\noutput_tokens: {dist: fixed, value: 16}\n"


def test_later_turns_hit_the_prefix_cache(engine, tiny_tokenizer, tmp_path):
    """Two short levels on the module's engine: the same lengths with and without sessions. A later turn's prompt
    begins with the previous one, so vLLM reuses its blocks; prompts on their own share nothing. The level's explained
    hit rate, from the turns' reused tokens, must cover what vLLM measured, so a sessions level is not flagged as a
    warm cache; per turn, vLLM's own per-request cached tokens show the hit rate rise after the first turn. (The
    asks' requests, if they ran first, share no prefix with these: random words of other lengths.)"""
    server, model = engine
    (tmp_path / "single.yaml").write_text("name: single\n" + LENGTHS)
    (tmp_path / "talk.yaml").write_text("name: talk\n" + LENGTHS + "sessions: {turns: {dist: fixed, value: 4}}\n")
    single, talk = load_workload(tmp_path / "single.yaml"), load_workload(tmp_path / "talk.yaml")
    plan = LevelPlan(Level("concurrency", 2), num_requests=16, duration_s=None, warmup_requests=0)

    async def measure(url, workload):
        async with StreamingClient(url, str(model), api="completions", ignore_eos=True) as client:
            result, records = await measure_level(
                client, url, workload, PromptFactory(tiny_tokenizer), plan, stream=1, slo=Slo()
            )
            return result, records

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
