"""What a request asks beyond its text (n choices, log-probabilities) is checked in its answer: the client marks a
record whose answer lacked an ask, the level counts them per ask, and bench's table says so."""

import asyncio

import pytest
from aiohttp import web

from servetune.config.workload import Workload
from servetune.load.client import ASK_LOGPROBS, ASK_N, StreamingClient
from servetune.load.requests import RequestSpec
from servetune.metrics import RequestRecord
from servetune.summary import asks_note, summarize
from servetune.testing.fake_openai import FakeOpenAI
from tests.builders import completions_server, stream_events
from tests.conftest import serve_fake


def asking_workload(api: str) -> Workload:
    return Workload.model_validate(
        {
            "name": "t", "api": api,
            "mix": [
                {"name": "plain", "input_tokens": {"dist": "fixed", "value": 8}, "output_tokens": {"dist": "fixed", "value": 4}},
                {"name": "asks", "input_tokens": {"dist": "fixed", "value": 8}, "output_tokens": {"dist": "fixed", "value": 4},
                 "sampling": {"temperature": 0.8, "n": 3, "logprobs": 2}},
            ],
        }
    )  # fmt: skip


def spec_of(w: Workload, name: str) -> RequestSpec:
    cls = next(c for c in w.classes if c.name == name)
    return RequestSpec(0, "hello", 1, 4, name, sampling=tuple(w.sampling_of(cls).items()))


async def send_each(url: str, w: Workload, names: list[str]) -> list[RequestRecord]:
    records = []
    async with StreamingClient(url, "m", api=w.api, ignore_eos=w.ignore_eos) as client:
        for name in names:
            record = RequestRecord(index=len(records), sent=0.0, input_tokens=1, max_tokens=4, request_class=name)
            records.append(await client.send(spec_of(w, name), record, 0.0))
    return records


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_answers_that_carry_what_was_asked_pass_and_answers_that_lack_it_are_counted(api):
    w = asking_workload(api)
    names = ["asks", "plain", "asks"]
    with serve_fake(FakeOpenAI(ttft_ms=1, itl_ms=1)) as url:
        honoured = asyncio.run(send_each(url, w, names))
    with serve_fake(FakeOpenAI(ttft_ms=1, itl_ms=1, honour_asks=False)) as url:
        ignored = asyncio.run(send_each(url, w, names))
    assert all(r.ok for r in honoured + ignored)  # an answer without its asks is still an answer: timed as one
    assert [r.not_honoured for r in honoured] == [None, None, None]
    assert honoured[0].output_tokens == 3 * 4  # the server's usage counts every choice's tokens
    assert [r.not_honoured for r in ignored] == [[ASK_N, ASK_LOGPROBS], None, [ASK_N, ASK_LOGPROBS]]
    level = summarize(ignored, {"concurrency": 1})
    assert level.not_honoured == {ASK_N: 2, ASK_LOGPROBS: 2}
    assert {k: v for k, v in level.flat().items() if k.startswith("not_honoured")} == {  # MLflow's per-level metrics
        "not_honoured_n": 2.0, "not_honoured_logprobs": 2.0
    }  # fmt: skip
    assert asks_note(level) == "answers without what they asked: 2 with no logprobs, 2 with fewer choices than n"
    assert summarize(honoured, {"concurrency": 1}).not_honoured is None and asks_note(summarize(honoured, {})) is None


def stream_of(choices: list[dict]) -> list[dict]:
    return [
        *({"choices": [c]} for c in choices),
        {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 4}},
    ]


LOGPROBS = {"tokens": ["a"], "token_logprobs": [-0.1], "top_logprobs": [{"a": -0.1}], "text_offset": [0]}


@pytest.mark.parametrize(
    "choices, lacked",
    [
        # every choice streamed, each token with its log-probabilities; a finishing chunk without a token needs none
        ([{"index": i, "text": "a", "logprobs": LOGPROBS} for i in (0, 1, 2, 0)] + [{"index": 0, "text": ""}], None),
        ([{"index": i, "text": "a", "logprobs": LOGPROBS} for i in (0, 1, 1)], [ASK_N]),  # choice 2 never came
        ([{"index": i, "text": "a", "logprobs": LOGPROBS} for i in (0, 1)] + [{"index": 2, "text": "a", "logprobs": None}],
         [ASK_LOGPROBS]),  # one token without them
        ([{"index": 0, "text": "a"}] * 3, [ASK_N, ASK_LOGPROBS]),
    ],
)  # fmt: skip
def test_one_choice_missing_or_one_token_without_logprobs_is_enough_to_mark_the_answer(choices, lacked):
    w = asking_workload("completions")

    async def run() -> list[RequestRecord]:
        async def complete(request: web.Request) -> web.StreamResponse:
            return await stream_events(request, stream_of(choices))

        async with completions_server(complete) as url:
            return await send_each(url, w, ["asks", "plain"])

    asked, plain = asyncio.run(run())
    assert asked.ok and asked.not_honoured == lacked
    assert plain.ok and plain.not_honoured is None  # it asked for neither: nothing to lack


def test_a_failed_request_is_an_error_not_an_ask_it_lacked():
    w = asking_workload("completions")
    with serve_fake(FakeOpenAI(fail_status=400, honour_asks=False)) as url:
        (record,) = asyncio.run(send_each(url, w, ["asks"]))
    assert not record.ok and record.error_kind == "http_4xx" and record.not_honoured is None
    assert summarize([record], {"concurrency": 1}).not_honoured is None


def test_vllms_own_request_models_read_the_asks_servetune_sends():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    for api, model in (("completions", CompletionRequest), ("chat", ChatCompletionRequest)):
        w = asking_workload(api)
        body = StreamingClient("http://x", "m", api=api).payload(spec_of(w, "asks"))
        request = model.model_validate(body)
        assert request.n == 3 and request.temperature == 0.8
        if api == "chat":
            assert request.logprobs is True and request.top_logprobs == 2
        else:
            assert request.logprobs == 2
