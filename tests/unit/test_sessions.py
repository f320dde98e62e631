"""Multi-turn sessions: each turn's prompt carries the conversation so far."""

import itertools

import numpy as np
import pytest

from servetune.config.workload import load_workload
from servetune.errors import UserError
from servetune.load.requests import PromptFactory, iter_requests

SESSIONS = """
name: s
input_tokens: {dist: uniform, min: 10, max: 30}
output_tokens: {dist: fixed, value: 12}
shared_prefix: {tokens: 5, fraction: 1.0}
sessions:
  turns: {dist: uniform, min: 2, max: 5}
  think_time_s: {dist: exponential, mean: 2.0}
"""


def workload(tmp_path, text):
    path = tmp_path / "w.yaml"
    path.write_text(text)
    return load_workload(path)


def turns(w, tokenizer, n=200, stream=0):
    return list(itertools.islice(iter_requests(w, PromptFactory(tokenizer), stream=stream), n))


def test_each_turn_carries_the_conversation_so_far(tmp_path, tiny_tokenizer):
    reqs = turns(workload(tmp_path, SESSIONS), tiny_tokenizer)
    prefactory = PromptFactory(tiny_tokenizer)
    conversations = {}
    for r in reqs:
        conversations.setdefault(r.session, []).append(r)
    assert list(conversations) == sorted(conversations)  # a conversation's turns come together, in order
    complete = list(conversations.values())[:-1]  # the last one may be cut by islice
    assert {len(c) for c in complete} <= {2, 3, 4, 5} and len({len(c) for c in complete}) > 1
    for conversation in complete:
        assert [r.turn for r in conversation] == list(range(len(conversation)))
        assert conversation[0].think_s == 0 and all(r.think_s > 0 for r in conversation[1:])
        for before, after in itertools.pairwise(conversation):
            assert after.prompt.startswith(before.prompt)
            # the previous prompt, its answer (12 tokens) and a new message of 10 to 30 tokens
            new = after.input_tokens - before.input_tokens - 12
            assert 10 <= new <= 30, new
            assert prefactory.count(after.prompt) == after.input_tokens
    think = [r.think_s for c in complete for r in c[1:]]
    assert np.mean(think) == pytest.approx(2.0, rel=0.3)
    # Conversations differ from each other but for the shared prefix.
    firsts = [c[0].prompt for c in complete]
    assert len(set(firsts)) == len(firsts)


def test_sessions_are_deterministic_and_streams_differ(tmp_path, tiny_tokenizer):
    w = workload(tmp_path, SESSIONS)
    assert turns(w, tiny_tokenizer, 30) == turns(w, tiny_tokenizer, 30)
    assert turns(w, tiny_tokenizer, 30, stream=1)[0].prompt != turns(w, tiny_tokenizer, 30)[0].prompt


def test_a_conversation_ends_before_it_outgrows_its_context(tmp_path, tiny_tokenizer):
    text = (
        SESSIONS.replace("turns: {dist: uniform, min: 2, max: 5}", "turns: {dist: fixed, value: 50}")
        + "  max_context_tokens: 200\n"
    )
    reqs = turns(workload(tmp_path, text), tiny_tokenizer, 100)
    assert all(r.input_tokens + r.output_tokens <= 200 for r in reqs if r.turn)
    assert len({r.session for r in reqs}) > 5  # conversations end early, new ones start
    assert max(r.turn for r in reqs) < 50


def test_without_sessions_the_stream_is_unchanged(tmp_path, tiny_tokenizer):
    """Requests on their own carry no conversation (the prompts the earlier streams drew)."""
    w = workload(tmp_path, SESSIONS.split("sessions:")[0])
    reqs = turns(w, tiny_tokenizer, 20)
    assert all(r.session is None and r.turn == 0 and r.think_s == 0 for r in reqs)


@pytest.mark.parametrize(
    "extra, needle",
    [
        ("sessions: {think_time_s: {dist: fixed, value: 1}}\n", "sessions.turns: Field required"),
        (
            "sessions: {turns: {dist: fixed, value: 2}, think_time_s: {dist: fixed, value: -1}}\n",
            "sessions.think_time_s.value",
        ),
        ("sessions: {turns: {dist: fixed, value: 2}, bogus: 1}\n", "sessions.bogus: unknown key"),
        ("arrival: {process: trace}\n", "process: trace needs file"),
        ("arrival: {process: poisson, file: x.jsonl}\n", "file is for process: trace"),
        ("arrival: {process: trace, file: missing.jsonl}\n", "missing.jsonl: file not found"),
    ],
)
def test_bad_sessions_and_traces_name_the_field(tmp_path, extra, needle):
    path = tmp_path / "w.yaml"
    path.write_text("name: t\ninput_tokens: {dist: fixed, value: 3}\noutput_tokens: {dist: fixed, value: 1}\n" + extra)
    with pytest.raises(UserError) as info:
        load_workload(path)
    assert needle in str(info.value) and str(path) in str(info.value)


def test_a_bad_trace_line_names_the_log_and_line(tmp_path):
    (tmp_path / "log.jsonl").write_text('{"timestamp": 0, "input_tokens": 3, "output_tokens": 1}\n{"timestamp": 1}\n')
    path = tmp_path / "w.yaml"
    path.write_text(
        "name: t\ninput_tokens: {dist: fixed, value: 3}\noutput_tokens: {dist: fixed, value: 1}\narrival: {process: trace, file: log.jsonl}\n"
    )
    with pytest.raises(UserError, match=r"log.jsonl line 2: no input size"):
        load_workload(path)


def test_later_turns_take_the_sessions_own_lengths(tmp_path, tiny_tokenizer):
    text = SESSIONS.replace(
        "sessions:\n", "sessions:\n  input_tokens: {dist: fixed, value: 7}\n  output_tokens: {dist: fixed, value: 3}\n"
    )
    reqs = turns(workload(tmp_path, text), tiny_tokenizer, 60)
    for before, after in itertools.pairwise(reqs):
        if after.turn:
            assert after.output_tokens == 3 and after.input_tokens - before.input_tokens - before.output_tokens == 7
        else:
            assert after.output_tokens == 12 and 10 <= after.input_tokens <= 30  # first turns: the class's lengths
