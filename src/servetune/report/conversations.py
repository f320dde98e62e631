"""Multi-turn levels, per conversation and per turn (issue #41 item 7): the recommended trial's in full, every
trial's in a row per level.

A level whose workload has ``sessions`` keeps its conversations' numbers (``LevelSummary.conversations``,
summary.ConversationStats). Per level this gives two small tables: each conversation's TTFT (the mean of its
turns', and its worst turn's) and E2E (its first turn sent to its last turn's end, the think times between turns
included) as mean and percentiles over the level's conversations; and per turn position (numbered from 1) the
requests, their mean prompt tokens and TTFT, and the prefix-cache hit rate vLLM reported for them, or "not
reported" where it did not (it reports cached tokens with ``--enable-prompt-tokens-details``; the report never
estimates them). Every trial with such levels, the recommended one included and first, also gets a row per level
(:func:`summary_cells`): its conversations, their TTFT (mean of turns, worst turn) and E2E at P50 and P95, and the
hit rate by turn; a study without a recommendation shows only those rows. The renderers draw these rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from servetune.report.points import ReportPoint, in_table_order, level_label, point_trial
from servetune.results import TrialResult
from servetune.summary import ConversationStats, LatencyStats, TurnStats

NOT_REPORTED = "not reported"


@dataclass(frozen=True)
class ConversationTable:
    """One multi-turn level of a trial: its conversations' numbers."""

    trial_id: str
    level: str  # ``concurrency 2``
    stats: ConversationStats

    @property
    def caption(self) -> str:
        s = self.stats
        left = f", {s.left_out} more left out (a warm-up or failed turn)" if s.left_out else ""
        think = "" if s.think_ms_mean is None else f": {s.think_ms_mean / 1000:.2f} s per conversation on average"
        return f"{self.level}: {s.conversations} conversations{left}. E2E includes the time between turns{think}."


def conversation_tables(trials: Sequence[TrialResult], point: ReportPoint | None) -> tuple[ConversationTable, ...]:
    """Every level of the recommended point's trial that had conversations (none without a recommendation)."""
    trial = point_trial(trials, point)
    if trial is None:
        return ()
    return tuple(
        ConversationTable(trial.trial_id, level_label(lv.summary.level), lv.summary.conversations)
        for lv in trial.levels
        if lv.summary.conversations is not None
    )


def every_conversation(trials: Sequence[TrialResult], order: Sequence[str] = ()) -> tuple[ConversationTable, ...]:
    """Every multi-turn level of every trial, trial by trial in ``order`` (trial ids: the trial table's, the
    recommended first), any trial not named after, as given."""
    return tuple(
        ConversationTable(trial.trial_id, level_label(lv.summary.level), lv.summary.conversations)
        for trial in in_table_order(trials, order)
        for lv in trial.levels
        if lv.summary.conversations is not None
    )


CONVERSATION_HEADINGS = ("per conversation, ms", "mean", "P50", "P95", "P99")
TURN_HEADINGS = ("turn", "requests", "prompt tokens", "TTFT mean ms", "prefix-cache hit rate")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def conversation_cells(table: ConversationTable) -> list[list[str]]:
    s = table.stats
    rows: list[tuple[str, LatencyStats]] = [
        ("TTFT, mean of its turns", s.ttft_ms),
        ("TTFT, its worst turn", s.ttft_worst_ms),
        ("E2E, first turn sent to last turn's end", s.e2el_ms),
    ]
    return [[name, _ms(x.mean), _ms(x.p50), _ms(x.p95), _ms(x.p99)] for name, x in rows]


def hit_rate_text(turn: TurnStats) -> str:
    """The turn's hit rate, "not reported" where no answer said, and how many did where not all."""
    if turn.cache_hit_rate is None:
        return NOT_REPORTED
    some = f" ({turn.cache_reported} of {turn.requests} reported)" if turn.cache_reported < turn.requests else ""
    return f"{turn.cache_hit_rate:.0%}{some}"


def turn_cells(table: ConversationTable) -> list[list[str]]:
    return [
        [str(t.turn + 1), str(t.requests), "-" if t.prompt_tokens_mean is None else f"{t.prompt_tokens_mean:.0f}",
         _ms(t.ttft_ms_mean), hit_rate_text(t)]
        for t in table.stats.by_turn
    ]  # fmt: skip


CONVERSATION_NOTE = (
    "A conversation counts when every turn it sent completed. Its TTFT is the mean of its turns' and, beside it, its "
    "worst turn's; its E2E runs from its first turn sent to its last turn's end, think times included. The hit rate "
    "is the cached over the prompt tokens vLLM reported per request (engine argument enable_prompt_tokens_details); "
    '"not reported" where the engine did not say. A row of every trial gives each turn\'s hit rate from the first, '
    '"-" for a turn the engine did not say it for.'
)


SUMMARY_HEADINGS = ("trial", "level", "conversations", "TTFT P50 ms (mean of turns)", "TTFT P95 ms (mean of turns)",
                    "TTFT P95 ms (worst turn)", "E2E P50 ms", "E2E P95 ms", "prefix-cache hit rate by turn")  # fmt: skip


def hit_rates_text(table: ConversationTable) -> str:
    """``0% / 48% / 61%``: each turn's hit rate from the first, "-" for a turn vLLM gave none for; "not reported"
    where it gave none at all."""
    rates = [t.cache_hit_rate for t in table.stats.by_turn]
    if all(rate is None for rate in rates):
        return NOT_REPORTED
    return " / ".join("-" if rate is None else f"{rate:.0%}" for rate in rates)


def summary_cells(tables: Sequence[ConversationTable]) -> list[list[str]]:
    """A row per trial and multi-turn level, as :data:`SUMMARY_HEADINGS` names them."""
    return [
        [t.trial_id, t.level, str(t.stats.conversations), _ms(t.stats.ttft_ms.p50), _ms(t.stats.ttft_ms.p95),
         _ms(t.stats.ttft_worst_ms.p95), _ms(t.stats.e2el_ms.p50), _ms(t.stats.e2el_ms.p95), hit_rates_text(t)]
        for t in tables
    ]  # fmt: skip


def others_shown(in_full: Sequence[ConversationTable], every: Sequence[ConversationTable]) -> bool:
    """Whether the rows of every trial add to the recommended trial's tables: another trial has conversations,
    or nothing is recommended."""
    shown = {t.trial_id for t in in_full}
    return any(t.trial_id not in shown for t in every)
