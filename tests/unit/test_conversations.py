"""Per-conversation numbers of a multi-turn level (summary.ConversationStats, issue #41 item 7)."""

from __future__ import annotations

import json

import pytest

from servetune.metrics import CONVERSATION_METRICS, RequestRecord, turn_cache_hit_rate, turn_prompt_tokens
from servetune.summary import summarize


def turn(index, session, turn, sent, ttft, e2el, prompt=100, cached=None, ok=True, warmup=False):
    return RequestRecord(index=index, sent=sent, input_tokens=prompt, max_tokens=10, chunk_times=[sent + ttft, sent + e2el],
                         end=sent + e2el, prompt_tokens=prompt, output_tokens=10, ok=ok, session=session, turn=turn,
                         cached_tokens=cached, warmup=warmup)  # fmt: skip


def two_conversations():
    # conversation 0: turns at 0 s (TTFT 0.1, ends 1.0) and 2 s (TTFT 0.3, ends 3.0): 1 s of think time between
    # conversation 1: turns at 0.5 s (TTFT 0.2, ends 1.0) and 1.5 s (TTFT 0.2, ends 2.0): 0.5 s between
    return [turn(0, 0, 0, 0.0, 0.10, 1.0), turn(1, 0, 1, 2.0, 0.30, 1.0),
            turn(2, 1, 0, 0.5, 0.20, 0.5), turn(3, 1, 1, 1.5, 0.20, 0.5)]  # fmt: skip


def test_a_conversations_ttft_is_its_turns_mean_and_its_worst_turn():
    talks = summarize(two_conversations(), {"concurrency": 2}).conversations
    assert talks is not None and talks.conversations == 2 and talks.left_out == 0
    assert talks.ttft_ms.mean == pytest.approx(200.0)  # (100 + 300) / 2 and (200 + 200) / 2
    assert talks.ttft_worst_ms.mean == pytest.approx(250.0)  # 300 and 200
    assert talks.ttft_worst_ms.p99 == pytest.approx(299.0)


def test_a_conversations_e2e_runs_from_its_first_send_to_its_last_end_think_time_included():
    talks = summarize(two_conversations(), {"concurrency": 2}).conversations
    assert talks.e2el_ms.mean == pytest.approx((3000.0 + 1500.0) / 2)  # 0 -> 3.0 s and 0.5 -> 2.0 s
    assert talks.think_ms_mean == pytest.approx((1000.0 + 500.0) / 2)
    # their turns' own E2E add up to less: the difference is the think time
    assert talks.e2el_ms.mean - talks.think_ms_mean == pytest.approx((2000.0 + 1000.0) / 2)


def test_per_turn_position_the_requests_prompt_tokens_and_ttft():
    records = two_conversations()
    records[1].prompt_tokens, records[3].prompt_tokens = 300, 200
    talks = summarize(records, {"concurrency": 2}).conversations
    assert [(t.turn, t.requests) for t in talks.by_turn] == [(0, 2), (1, 2)]
    assert talks.by_turn[0].prompt_tokens_mean == pytest.approx(100.0)
    assert talks.by_turn[1].prompt_tokens_mean == pytest.approx(250.0)
    assert talks.by_turn[1].ttft_ms_mean == pytest.approx(250.0)


def test_the_hit_rate_per_turn_is_cached_over_prompt_tokens_where_the_server_said():
    records = [turn(0, 0, 0, 0.0, 0.1, 1.0, prompt=100, cached=0), turn(1, 0, 1, 2.0, 0.1, 1.0, prompt=300, cached=96),
               turn(2, 1, 0, 0.0, 0.1, 1.0, prompt=100, cached=None), turn(3, 1, 1, 2.0, 0.1, 1.0, prompt=200)]  # fmt: skip
    talks = summarize(records, {"concurrency": 2}).conversations
    first, second = talks.by_turn
    assert first.cache_hit_rate == 0.0 and second.cache_hit_rate == pytest.approx(96 / 300)  # only those that said
    assert (first.cache_reported, second.cache_reported) == (1, 1) and second.requests == 2


def test_a_server_that_does_not_report_cached_tokens_gives_no_hit_rate():
    talks = summarize(two_conversations(), {"concurrency": 2}).conversations
    assert [t.cache_hit_rate for t in talks.by_turn] == [None, None]
    assert [t.cache_reported for t in talks.by_turn] == [0, 0]
    assert not any(key.endswith("cache_hit_rate") for key in summarize(two_conversations(), {"concurrency": 2}).flat())


def test_a_conversation_with_a_failed_or_warm_up_turn_is_left_out_of_the_per_conversation_numbers():
    records = [*two_conversations(), turn(4, 2, 0, 0.0, 0.1, 0.5), turn(5, 2, 1, 1.0, 5.0, 9.0, ok=False),
               turn(6, 3, 0, 0.0, 9.0, 9.5, warmup=True), turn(7, 3, 1, 10.0, 0.1, 0.5)]  # fmt: skip
    talks = summarize(records, {"concurrency": 2}).conversations
    assert talks.conversations == 2 and talks.left_out == 2
    assert talks.ttft_worst_ms.mean == pytest.approx(250.0)  # as without them
    # their measured, completed turns still count per turn position
    assert [t.requests for t in talks.by_turn] == [3, 3]


def test_flat_names_every_conversation_metric_and_each_turns_numbers_from_turn_1():
    records = two_conversations()
    records[1].cached_tokens = 64
    flat = summarize(records, {"concurrency": 2}).flat()
    for name in CONVERSATION_METRICS:
        assert f"{name}_p50" in flat and f"{name}_p99" in flat
    assert flat["conversation_e2el_ms_mean"] == pytest.approx(2250.0)
    assert flat[turn_prompt_tokens(1)] == pytest.approx(100.0) and turn_prompt_tokens(3) not in flat
    assert flat[turn_cache_hit_rate(2)] == pytest.approx(64 / 100) and turn_cache_hit_rate(1) not in flat


def test_a_level_without_conversations_has_none_and_its_summary_is_unchanged():
    records = [turn(0, None, 0, 0.0, 0.1, 1.0)]
    summary = summarize(records, {"concurrency": 1})
    assert summary.conversations is None
    assert not any(k.startswith("conversation_") for k in summary.flat())
    dumped = json.loads(summary.model_dump_json())
    assert dumped["conversations"] is None  # as before per-conversation numbers were kept


def test_mlflow_gets_each_levels_conversation_numbers_and_hit_rate_per_turn():
    from servetune.tracking.fields import trial_metrics
    from tests.builders import demo_trials

    base = {t.trial_id: t for t in demo_trials()}["t32"]
    records = two_conversations()
    records[1].cached_tokens, records[3].cached_tokens = 50, 30
    base.levels[0].summary.conversations = summarize(records, {"concurrency": 2}).conversations
    by_key = {(m.key, m.step): m.value for m in trial_metrics(base)}
    assert by_key[("by_level/conversation_e2el_ms_mean", 0)] == pytest.approx(2250.0)
    assert by_key[("by_level/conversation_ttft_worst_ms_p50", 0)] == pytest.approx(250.0)
    assert by_key[("by_level/" + turn_cache_hit_rate(2), 0)] == pytest.approx(80 / 200)
    assert ("by_level/" + turn_cache_hit_rate(1), 0) not in by_key  # the first turns' answers did not say
    assert not any(key.startswith("by_level/conversation_") and step == 1 for key, step in by_key)


def test_a_study_of_conversations_asks_vllm_for_the_cached_tokens_of_each_answer(tmp_path):
    """A bare engine measuring a workload with sessions starts with ``enable_prompt_tokens_details`` (vLLM reports
    each answer's cached prompt tokens only then), unless the space set it; the trial's id and arguments keep the
    space's own; another workload's engine is started as the space says."""
    from servetune.config.space import SearchSpace
    from servetune.trial.context import StudyContext, resolve_levels
    from servetune.trial.runner import vllm_engine

    def engine(workload: str, engine_args: dict | None = None):
        space = SearchSpace.model_validate({"name": "s", "model": "m", "workload": workload,
                                            "engine_args": engine_args or {}})  # fmt: skip
        loaded = space.resolved_workload(tmp_path)
        spec = StudyContext(space, loaded, tmp_path, "m", resolve_levels(space, loaded)).spec_for({"max_num_seqs": 4})
        return spec, vllm_engine(spec, tmp_path)

    spec, server = engine("agent")  # a shipped workload with sessions
    assert server.engine_args["enable_prompt_tokens_details"] is True
    assert "enable_prompt_tokens_details" not in spec.engine_args  # not a configuration choice: not in the trial's id
    _, server = engine("agent", {"enable_prompt_tokens_details": False})
    assert server.engine_args["enable_prompt_tokens_details"] is False  # the space's choice stands
    _, server = engine("cpu-tiny")
    assert "enable_prompt_tokens_details" not in server.engine_args
