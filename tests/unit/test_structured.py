"""Structured output in workloads: the bodies servetune sends, read by vLLM's own request models; bad schemas
refused in one line; the client's verdict on each answer and the level's share; the backend as an engine
argument vLLM's parser knows."""

import asyncio
import textwrap

import pytest
from aiohttp import web

from servetune.config.workload import Workload, load_workload
from servetune.engine.args import ArgSpec, engine_argv, validate_engine_args
from servetune.errors import UserError
from servetune.load.client import StreamingClient
from servetune.load.requests import RequestSpec
from servetune.metrics import STRUCTURED_VALID, RequestRecord
from servetune.summary import summarize
from tests.builders import completions_server, stream_events

TOOL_CALL = {
    "type": "object",
    "properties": {"tool": {"type": "string", "enum": ["search", "answer"]}, "query": {"type": "string"}},
    "required": ["tool", "query"],
}
KINDS = {
    "json_schema": TOOL_CALL,
    "choice": ["yes", "no"],
    "regex": r"\d{3}-[a-z]+",
    "grammar": 'root ::= "ok" | "fail"',
}


def structured_workload(api: str, kind: str, **extra) -> Workload:
    return Workload.model_validate(
        {
            "name": "t", "api": api,
            "mix": [
                {"name": "free", "input_tokens": {"dist": "fixed", "value": 8}, "output_tokens": {"dist": "fixed", "value": 8}},
                {"name": "tool", "input_tokens": {"dist": "fixed", "value": 8}, "output_tokens": {"dist": "fixed", "value": 8},
                 "structured": {kind: KINDS[kind]}},
            ],
            **extra,
        }
    )  # fmt: skip


def spec_of(w: Workload, name: str) -> RequestSpec:
    cls = next(c for c in w.classes if c.name == name)
    return RequestSpec(
        0, "hello", 1, 16, name, sampling=tuple(w.sampling_of(cls).items()), structured=w.structured_of(cls)
    )


@pytest.mark.parametrize("api", ["completions", "chat"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_vllms_own_request_models_read_the_constraint_servetune_sends(api, kind):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    w = structured_workload(api, kind)
    client = StreamingClient("http://x", "m", api=api, ignore_eos=w.ignore_eos)
    body = client.payload(spec_of(w, "tool"))
    assert body["ignore_eos"] is False  # a structured answer ends where its structure ends
    request = (ChatCompletionRequest if api == "chat" else CompletionRequest).model_validate(body)
    params = request.extract_structured_outputs()
    assert params is not None
    expected = {"json_schema": "json"}.get(kind, kind)
    assert getattr(params, expected) == KINDS[kind]  # what the engine is asked for is what the workload said
    free = (ChatCompletionRequest if api == "chat" else CompletionRequest).model_validate(
        client.payload(spec_of(w, "free"))
    )
    assert free.extract_structured_outputs() is None and free.ignore_eos is True


@pytest.mark.parametrize(
    "structured, needle",
    [
        ("{json_schema: {type: objekt}}", "mix.0.structured.json_schema: not a JSON schema at type"),
        ("{json_schema: {properties: {a: {minLength: -1}}}}", "not a JSON schema at properties/a/minLength"),
        ("{regex: '[a-z'}", "mix.0.structured.regex: not a regular expression"),
        ("{choice: []}", "mix.0.structured.choice"),
        ("{choice: [a], regex: 'a+'}", "mix.0.structured: give exactly one of json_schema, choice, regex, grammar"),
        ("{jsonschema: {}}", "mix.0.structured.jsonschema: unknown key"),
    ],
)
def test_a_bad_constraint_is_one_line_naming_the_file_and_field(tmp_path, structured, needle):
    path = tmp_path / "w.yaml"
    path.write_text(
        textwrap.dedent(f"""\
            name: t
            mix:
              - input_tokens: {{dist: fixed, value: 8}}
                output_tokens: {{dist: fixed, value: 8}}
                structured: {structured}
            """)
    )
    with pytest.raises(UserError) as err:
        load_workload(path)
    assert str(err.value).startswith(f"{path}: ") and needle in str(err.value) and "\n" not in str(err.value)


def test_structured_output_with_ignore_eos_on_is_refused():
    with pytest.raises(ValueError, match=r"sampling\.ignore_eos: a request with structured output ends"):
        structured_workload("completions", "choice", sampling={"ignore_eos": True})
    with pytest.raises(ValueError, match="ignore_eos: a request with structured output ends"):
        Workload.model_validate(
            {"name": "t", "input_tokens": {"dist": "fixed", "value": 8}, "output_tokens": {"dist": "fixed", "value": 8},
             "structured": {"choice": ["a"]}, "ignore_eos": True}
        )  # fmt: skip
    w = Workload.model_validate(  # the workload's default ignore_eos stays for its free classes
        {"name": "t", "input_tokens": {"dist": "fixed", "value": 8}, "output_tokens": {"dist": "fixed", "value": 8},
         "structured": {"choice": ["a"]}}
    )  # fmt: skip
    assert w.sampling_of(w.classes[0])["ignore_eos"] is False


@pytest.mark.parametrize(
    "kind, text, valid",
    [
        ("json_schema", '{"tool": "search", "query": "q"}', True),
        ("json_schema", '{"tool": "delete", "query": "q"}', False),  # JSON, not under the schema
        ("json_schema", '{"tool": "search", "query": ', False),  # cut off at max_tokens
        ("choice", "no", True),
        ("choice", "maybe", False),
        ("regex", "123-abc", True),
        ("regex", "123-abc!", False),  # matched in full, not in part
        ("grammar", "ok", None),
    ],
)
def test_the_answer_is_checked_against_what_was_asked(kind, text, valid):
    w = structured_workload("completions", kind)
    assert w.structured_of(w.classes[1]).valid(text) is valid


async def _send_all(w: Workload, answers: dict[str, list[str]], n: int = 1) -> list[RequestRecord]:
    """Each class's request against a server that streams ``answers[class]`` (``n`` choices alike)."""

    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        name = "tool" if "response_format" in body or "structured_outputs" in body else "free"
        chunks = [{"choices": [{"index": index, "text": piece}]} for piece in answers[name] for index in range(n)]
        usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": len(answers[name]) * n}}
        return await stream_events(request, [*chunks, usage])

    records = []
    async with completions_server(complete) as url, StreamingClient(url, "m") as client:
        for name in ("tool", "tool", "free"):
            spec = spec_of(w, name)
            record = RequestRecord(index=len(records), sent=0.0, input_tokens=1, max_tokens=16)
            records.append(await client.send(spec, record, 0.0))
    return records


@pytest.mark.parametrize("n", [1, 2])
def test_the_client_checks_each_structured_answer_from_its_streamed_text_and_the_level_counts_them(n):
    w = structured_workload("completions", "json_schema")
    good = asyncio.run(_send_all(w, {"tool": ['{"tool": "sea', 'rch", "query"', ': "q"}'], "free": ["a", "b"]}, n))
    assert [r.ok for r in good] == [True] * 3
    assert [r.structured_valid for r in good] == [True, True, None]  # the free class asked for nothing
    assert summarize(good, {"concurrency": 1}).structured_valid == 1.0
    bad = asyncio.run(_send_all(w, {"tool": ['{"tool": "search"'], "free": ["a"]}, n))
    level = summarize(bad + good[:1], {"concurrency": 1})
    assert [r.structured_valid for r in bad] == [False, False, None]
    assert level.structured_valid == pytest.approx(1 / 3) and level.flat()[STRUCTURED_VALID] == level.structured_valid
    assert summarize(good[2:], {"concurrency": 1}).structured_valid is None  # no class asked: no share
    assert STRUCTURED_VALID not in summarize(good[2:], {"concurrency": 1}).flat()


SPECS = {
    "structured_outputs_config": ArgSpec("structured_outputs_config", "--structured-outputs-config", "value"),
    "structured_outputs_config.backend": ArgSpec(
        "structured_outputs_config.backend",
        "--structured-outputs-config.backend",
        "value",
        ("auto", "guidance", "lm-format-enforcer", "outlines", "xgrammar"),
    ),
}


def test_the_backend_is_a_dotted_engine_argument_checked_against_vllms_choices():
    args = validate_engine_args({"structured-outputs-config.backend": "guidance"}, SPECS)
    assert engine_argv(args, SPECS) == ["--structured-outputs-config.backend", "guidance"]
    with pytest.raises(UserError, match=r"'structured_outputs_config\.backend': 'xgrammer' is not one of auto"):
        validate_engine_args({"structured_outputs_config.backend": "xgrammer"}, SPECS)
    with pytest.raises(UserError, match=r"did you mean structured_outputs_config\.backend"):
        validate_engine_args({"structured_outputs_config.backends": "auto"}, SPECS)


def test_vllms_parser_gives_the_backends_and_a_space_searches_them(tmp_path):
    from servetune.engine.args import load_argspecs
    from servetune.space_file import load_space

    specs = load_argspecs()  # vLLM's own parser's options, the config options' fields among them
    assert specs is not None
    backend = specs["structured_outputs_config.backend"]
    assert backend.flag == "--structured-outputs-config.backend" and {"auto", "xgrammar", "guidance"} <= set(
        backend.choices or ()
    )
    path = tmp_path / "space.yaml"
    head = "name: t\nmodel: tiny\ndevice: cpu\nworkload: cpu-tiny\nengine_args: {max_model_len: 1024}\n"
    path.write_text(head + "params: {structured_outputs_config.backend: [xgrammar, guidance]}\n")
    space = load_space(path, specs)
    kept, _ = space.grid()
    argvs = [engine_argv(space.engine_params(point)[0], specs) for point in kept]
    assert sorted(a[a.index("--structured-outputs-config.backend") + 1] for a in argvs) == ["guidance", "xgrammar"]
    path.write_text(head + "params: {structured_outputs_config.backend: [xgrammar, xgrammer]}\n")
    with pytest.raises(UserError, match=r"space.yaml: params: .*'xgrammer' is not one of auto"):
        load_space(path, specs)
