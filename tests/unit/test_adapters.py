"""LoRA adapters in workloads: each request names one, drawn by weight with the workload's seed, as its model;
the engine gets enable_lora and lora_modules (unless the space sets them); bad adapters refused in one line."""

import asyncio
from collections import Counter

import pytest
from aiohttp import web

from servetune.config.adapters import lora_engine_args, lora_rank_for
from servetune.config.workload import Workload, load_workload
from servetune.engine.args import ArgSpec, engine_argv
from servetune.errors import UserError
from servetune.load.client import StreamingClient
from servetune.load.requests import PromptFactory, RequestSpec, iter_requests
from servetune.metrics import RequestRecord
from servetune.models.tiny import build_tiny_adapter
from servetune.summary import summarize
from tests.builders import completions_server, stream_events

LENGTHS = {"input_tokens": {"dist": "uniform", "min": 4, "max": 40}, "output_tokens": {"dist": "uniform", "max": 9}}


def workload(adapters=(), **extra) -> Workload:
    return Workload.model_validate({"name": "t", "seed": 3, **LENGTHS, "adapters": list(adapters), **extra})


def take(w: Workload, tokenizer, n: int, stream: int = 0) -> list[RequestSpec]:
    stream_ = iter_requests(w, PromptFactory(tokenizer), stream=stream)
    return [next(stream_) for _ in range(n)]


def test_requests_name_adapters_by_weight_and_keep_their_lengths(tiny_tokenizer):
    adapters = [{"name": "sql", "path": "tiny", "weight": 3}, {"name": "chat", "path": "tiny", "weight": 1}]
    with_adapters = take(workload(adapters), tiny_tokenizer, 800)
    counts = Counter(r.model for r in with_adapters)
    assert set(counts) == {"sql", "chat"} and 2.4 < counts["sql"] / counts["chat"] < 3.8  # 3:1 drawn
    assert [r.model for r in take(workload(adapters), tiny_tokenizer, 800)] == [r.model for r in with_adapters]
    assert [r.model for r in take(workload(adapters), tiny_tokenizer, 800, stream=1)] != [
        r.model for r in with_adapters
    ]
    plain = take(workload(), tiny_tokenizer, 800)
    assert {r.model for r in plain} == {None}
    # adapters are drawn apart from lengths and prompts: the same requests, each now naming an adapter
    strip = lambda specs: [(r.prompt, r.input_tokens, r.output_tokens) for r in specs]  # noqa: E731
    assert strip(with_adapters) == strip(plain)
    assert {r.model for r in take(workload(adapters[:1]), tiny_tokenizer, 20)} == {"sql"}


def test_a_conversation_keeps_its_adapter(tiny_tokenizer):
    adapters = [{"name": "a", "path": "tiny"}, {"name": "b", "path": "tiny"}]
    sessions = {"turns": {"dist": "fixed", "value": 3}}
    specs = take(workload(adapters, sessions=sessions), tiny_tokenizer, 60)
    by_session: dict[int, set] = {}
    for spec in specs:
        by_session.setdefault(spec.session, set()).add(spec.model)
    assert all(len(models) == 1 for models in by_session.values())
    assert {m for models in by_session.values() for m in models} == {"a", "b"}


def test_the_request_sends_its_adapter_as_the_model_and_the_level_counts_them():
    seen: list[str] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        seen.append((await request.json())["model"])
        usage = {"prompt_tokens": 1, "completion_tokens": 1}
        return await stream_events(request, [{"choices": [{"index": 0, "text": "x"}]}, {"choices": [], "usage": usage}])

    async def run() -> list[RequestRecord]:
        records = []
        async with completions_server(completions) as url, StreamingClient(url, "base") as client:
            for i, model in enumerate(["sql", None, "sql", "chat"]):
                record = RequestRecord(index=i, sent=0.0, input_tokens=1, max_tokens=1, adapter=model)
                records.append(await client.send(RequestSpec(i, "hi", 1, 1, "default", model=model), record, 0.0))
        return records

    records = asyncio.run(run())
    assert seen == ["sql", "base", "sql", "chat"] and all(r.ok for r in records)
    assert summarize(records, {"concurrency": 1}).requests_by_adapter == {"sql": 2, "chat": 1}
    assert summarize(records[1:2], {"concurrency": 1}).requests_by_adapter is None


def test_adapter_paths_are_read_from_the_workload_file_and_bad_ones_are_one_line(tmp_path):
    build_tiny_adapter(tmp_path / "adapters" / "mine")
    path = tmp_path / "w.yaml"
    head = "name: w\ninput_tokens: {dist: fixed, value: 8}\noutput_tokens: {dist: fixed, value: 8}\n"
    path.write_text(head + "adapters: [{name: mine, path: adapters/mine, weight: 2}]\n")
    adapter = load_workload(path).adapters[0]
    assert adapter.directory(tmp_path / "unused") == (tmp_path / "adapters" / "mine").resolve() and adapter.rank == 8
    assert not (tmp_path / "unused").exists()
    for body, message in [
        (
            "[{name: x, path: nowhere}]",
            r"adapters\.0: \S*nowhere is not a PEFT adapter directory \(no adapter_config.json\)",
        ),
        ("[{name: x, path: tiny}, {name: x, path: tiny}]", "adapters: the name 'x' is given twice"),
        ("[{name: 'a b', path: tiny}]", r"adapters\.0\.name: String should match pattern"),
        ("[{name: x, path: tiny, weight: 0}]", r"adapters\.0\.weight: Input should be greater than 0"),
    ]:
        path.write_text(head + f"adapters: {body}\n")
        with pytest.raises(UserError, match=message) as err:
            load_workload(path)
        assert str(err.value).startswith(f"{path}: ") and "\n" not in str(err.value)


def test_the_engine_gets_lora_unless_the_space_sets_it(tmp_path):
    w = workload([{"name": "a", "path": "tiny"}])
    args = w.adapter_engine_args({"max_num_seqs": 4}, tmp_path)
    directory = tmp_path / "tiny-lora"
    assert (directory / "adapter_config.json").exists()
    assert args == {"max_num_seqs": 4, "enable_lora": True, "lora_modules": [f"a={directory.resolve()}"]}
    own = {"enable_lora": True, "lora_modules": ["a=/elsewhere"], "max_loras": 2}
    assert w.adapter_engine_args(own, tmp_path) == own
    assert workload().adapter_engine_args({"max_num_seqs": 4}, tmp_path) == {"max_num_seqs": 4}
    # an adapter above vLLM's default rank (16) gets a max_lora_rank vLLM takes that holds it
    assert lora_engine_args({}, {"big": "/p"}, max_rank=24)["max_lora_rank"] == 32 == lora_rank_for(17)
    assert "max_lora_rank" not in lora_engine_args({}, {"small": "/p"}, max_rank=16)
    specs = {
        "enable_lora": ArgSpec("enable_lora", "--enable-lora", "bool"),
        "lora_modules": ArgSpec("lora_modules", "--lora-modules", "list"),
    }
    assert engine_argv(lora_engine_args({}, {"a": "/x", "b": "/y"}), specs) == [
        "--enable-lora", "--lora-modules", "a=/x", "b=/y",
    ]  # fmt: skip


def test_vllms_parser_reads_the_lora_arguments_servetune_adds(tmp_path):
    from servetune.engine.args import load_argspecs, validate_engine_args

    specs = load_argspecs()
    assert specs is not None
    w = workload([{"name": "a", "path": "tiny"}, {"name": "b", "path": "tiny"}])
    args = validate_engine_args({"max_loras": 2, "max_lora_rank": 8}, specs)
    argv = engine_argv(w.adapter_engine_args(args, tmp_path), specs)
    assert argv[argv.index("--lora-modules") + 1 :][:2] == [f"{n}={(tmp_path / 'tiny-lora').resolve()}" for n in "ab"]
    assert "--enable-lora" in argv and argv[argv.index("--max-loras") + 1] == "2"
    with pytest.raises(UserError, match="did you mean max_loras"):
        validate_engine_args({"max_lora": 2}, specs)


def test_a_trial_of_a_study_serves_the_workloads_adapters(tmp_path):
    from servetune.config.space import SearchSpace
    from servetune.trial.context import StudyContext, resolve_levels

    space = SearchSpace.model_validate({
        "name": "s", "model": "tiny", "device": "cpu", "env": {"VLLM_CPU_KVCACHE_SPACE": 1},
        "workload": {"name": "w", **LENGTHS, "adapters": [{"name": "a", "path": "tiny"}]},
        "params": {"max_loras": [1, 2]},
    })  # fmt: skip
    workload_ = space.resolved_workload(tmp_path)
    context = StudyContext(space, workload_, tmp_path, "m", resolve_levels(space, workload_))
    spec = context.spec_for({"max_loras": 2})
    directory = (tmp_path / "models" / "tiny-lora").resolve()
    assert spec.engine_args["enable_lora"] is True and spec.engine_args["lora_modules"] == [f"a={directory}"]
    assert spec.engine_args["max_loras"] == 2 and spec.trial_id != context.spec_for({"max_loras": 1}).trial_id
