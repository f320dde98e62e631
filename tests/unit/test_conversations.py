"""Per-conversation numbers of a multi-turn level (summary.ConversationStats, issue #41 item 7)."""

from __future__ import annotations

import pytest

from servetune.metrics import RequestRecord
from servetune.summary import summarize


def turn(index, session, turn, sent, ttft, e2el, prompt=100, cached=None):
    return RequestRecord(index=index, sent=sent, input_tokens=prompt, max_tokens=10, chunk_times=[sent + ttft, sent + e2el],
                         end=sent + e2el, prompt_tokens=prompt, output_tokens=10, ok=True, session=session, turn=turn,
                         cached_tokens=cached)  # fmt: skip


def test_each_conversation_counts_once_its_ttft_the_mean_of_its_turns_its_e2e_their_sum():
    records = [turn(0, 0, 0, 0.0, 0.10, 1.0), turn(1, 0, 1, 2.0, 0.30, 1.0),  # 0.2 s TTFT, 2 s waited
               turn(2, 1, 0, 0.5, 0.20, 0.5), turn(3, 1, 1, 1.5, 0.20, 0.5)]  # 0.2 s, 1 s  # fmt: skip
    talks = summarize(records, {"concurrency": 2}).conversations
    assert talks is not None and talks.conversations == 2
    assert talks.ttft_ms.mean == pytest.approx(200.0) and talks.e2el_ms.mean == pytest.approx(1500.0)
    assert [(t.turn, t.requests) for t in talks.by_turn] == [(0, 2), (1, 2)]
    assert talks.by_turn[1].ttft_ms_mean == pytest.approx(250.0) and talks.by_turn[0].cache_hit_rate is None
    flat = summarize(records, {"concurrency": 2}).flat()
    assert flat["conversation_e2el_ms_mean"] == pytest.approx(1500.0) and "conversation_ttft_ms_p99" in flat


def test_the_hit_rate_per_turn_is_cached_over_prompt_tokens_where_the_server_said():
    records = [turn(0, 0, 0, 0.0, 0.1, 1.0, prompt=100, cached=0), turn(1, 0, 1, 2.0, 0.1, 1.0, prompt=300, cached=96),
               turn(2, 1, 1, 2.0, 0.1, 1.0, prompt=100, cached=None)]  # fmt: skip
    talks = summarize(records, {"concurrency": 2}).conversations
    assert talks.by_turn[0].cache_hit_rate == 0.0 and talks.by_turn[1].cache_hit_rate == pytest.approx(96 / 300)


def test_a_level_without_conversations_has_none():
    records = [turn(0, None, 0, 0.0, 0.1, 1.0)]
    assert summarize(records, {"concurrency": 1}).conversations is None
    assert not any(k.startswith("conversation_") for k in summarize(records, {"concurrency": 1}).flat())
