"""Levels whose answers lacked what their requests asked (issue #41 item 5), a row per trial and level.

The client checks each answer against its request's asks beyond text (load/client.py ``AskCheck``): ``n``
choices and log-probabilities, counted per ask in ``LevelSummary.not_honoured``; and a structured answer's text
against its schema, choice or regex (``LevelSummary.structured_valid``, the share that parsed). A level is listed
where any answer lacked an ask or any structured answer did not parse: the engine took those requests and did
not do what they asked, so the level measured other work than the workload describes (an engine that ignores
``n`` decodes one choice, not ``n``). A LoRA adapter the engine does not serve fails its request (HTTP 404),
which "Failed requests" lists. Rows come in the trial table's order, the recommended trial's first; a recommended
trial with such a level gets a warning (:func:`asks_warning`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from servetune.report.points import in_table_order, level_label
from servetune.results import TrialResult

#: A column per ask an answer can lack (load/client.py ASK_N, ASK_LOGPROBS); any other ask by its own name.
ASK_HEADINGS: Mapping[str, str] = {"n": "fewer choices than n", "logprobs": "no logprobs"}
STRUCTURED_HEADING = "structured parsed as asked"


@dataclass(frozen=True)
class AskLevel:
    trial_id: str
    level: str  # ``concurrency 8``
    completed: int  # the level's completed requests
    lacked: Mapping[str, int]  # answers that lacked each ask (``n``, ``logprobs``)
    structured_valid: float | None  # the share of structured answers that parsed; None where none were asked

    @property
    def text(self) -> str:
        """``concurrency 8: 3 of 40 answers with fewer choices than n; 90% of structured answers parsed as asked``."""
        parts = [
            f"{count} of {self.completed} answers with {ASK_HEADINGS.get(ask, f'no {ask}')}"
            for ask, count in sorted(self.lacked.items())
        ]
        if self.structured_valid is not None and self.structured_valid < 1:
            parts.append(f"{self.structured_valid:.1%} of structured answers parsed as asked")
        return f"{self.level}: {'; '.join(parts)}"


def ask_levels(trials: Sequence[TrialResult], order: Sequence[str] = ()) -> tuple[AskLevel, ...]:
    """Every level where an answer lacked an ask or a structured answer did not parse, trial by trial in
    ``order`` (trial ids: the trial table's, the recommended first), any trial not named after, as given."""
    rows = []
    for trial in in_table_order(trials, order):
        for lv in trial.levels:
            s = lv.summary
            lacked = {ask: n for ask, n in (s.not_honoured or {}).items() if n}
            unparsed = s.structured_valid is not None and s.structured_valid < 1
            if lacked or unparsed:
                rows.append(AskLevel(trial.trial_id, level_label(s.level), s.completed, lacked, s.structured_valid))
    return tuple(rows)


def ask_headings(rows: Sequence[AskLevel]) -> list[str]:
    """trial, level, completed, a column per ask some row lacked, and the structured share where one was measured."""
    asks = sorted({ask for row in rows for ask in row.lacked})
    structured = [STRUCTURED_HEADING] if any(row.structured_valid is not None for row in rows) else []
    return ["trial", "level", "completed", *(ASK_HEADINGS.get(ask, f"no {ask}") for ask in asks), *structured]


def ask_cells(rows: Sequence[AskLevel]) -> list[list[str]]:
    asks = sorted({ask for row in rows for ask in row.lacked})
    structured = any(row.structured_valid is not None for row in rows)
    return [
        [row.trial_id, row.level, str(row.completed), *(str(row.lacked.get(ask, 0)) for ask in asks)]
        + ([("-" if row.structured_valid is None else f"{row.structured_valid:.1%}")] if structured else [])
        for row in rows
    ]


def asks_warning(rows: Sequence[AskLevel], recommended: str | None, level: str | None = None) -> str | None:
    """The warning for a recommended trial with such a level (None where it has none, or nothing is recommended);
    ``level``: the recommended level, named when it is one of them."""
    mine = [row for row in rows if recommended is not None and row.trial_id == recommended]
    if not mine:
        return None
    at = "the recommended level itself" if any(row.level == level for row in mine) else "not the recommended level"
    levels = "1 level" if len(mine) == 1 else f"{len(mine)} levels"
    return (
        f"Warning: trial {recommended}'s engine did not do what requests asked at {levels}, {at} "
        f"({'; '.join(row.text for row in mine)}): those levels measured other work than the workload describes"
    )


ASKS_NOTE = (
    "Answers the engine gave without what their request asked: n choices or log-probabilities (counted per ask by "
    "the client), or structured output that did not parse under its schema, choice or regex. Such a level measured "
    "other work than the workload describes. A LoRA adapter the engine does not serve fails its requests instead "
    '(see "Failed requests").'
)
