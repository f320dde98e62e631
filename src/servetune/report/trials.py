"""The table of all trials, a row per trial, as plain data (the renderers draw it; tests check it).

A row says what the trial varied, how it ended, its best load level under the SLO and the
numbers there (or at the highest load it measured when none met the SLO), its capacity at the SLO (what its
capacity search found: trial/capacity.py), which SLO bounds broke first and
at which level, why its ladder stopped, what limited it (:mod:`servetune.report.diagnosis`), its conclusion
(:mod:`servetune.report.conclusion`), and the capacity planner's KV tokens against those vLLM logged when it
started (:func:`kv_plan_check`).

Rows are ordered as a user picks: the recommended trial first, then kept trials, those for a
next round, the eliminated ones; within each, cheapest first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from servetune.capacity.compare import measured_kv_tokens
from servetune.metrics import (
    COST_METRIC,
    GOODPUT,
    SPEC_ACCEPTANCE_RATE,
    SPEC_DRAFT_TOKENS,
    SPEC_MEAN_ACCEPTED_LENGTH,
    TPOT_P99,
    TTFT_P99,
    spec_acceptance_at,
)
from servetune.report.conclusion import Conclusion, conclude
from servetune.report.diagnosis import limited_by
from servetune.report.params import short_config, varied_params
from servetune.report.points import ReportPoint, first_line, level_label, violated_metrics
from servetune.results import Capacity, Knee, Outcome, TrialResult, best_level, chosen_level

if TYPE_CHECKING:
    from servetune.report.recommend import Recommendation

#: The numbers a row shows, at the trial's best level (the renderers add units to the headings).
TRIAL_METRICS = (GOODPUT, TTFT_P99, TPOT_P99, COST_METRIC)

_VERDICT_ORDER = {"keep": 0, "next round": 1, "eliminate": 2}


@dataclass(frozen=True)
class SloBreak:
    """The first level at which a trial broke the SLO, with the trial's own verdict."""

    level: str  # ``concurrency 2``
    violations: tuple[str, ...]  # ``ttft_ms_p95 = 222.2 > 150``, as the trial recorded them
    later_levels: int = 0  # levels after this one that broke the SLO too

    @property
    def metrics(self) -> tuple[str, ...]:
        """The metrics whose bound broke: ``("ttft_ms_p95", "ttft_ms_p99")``."""
        return violated_metrics(self.violations)


@dataclass(frozen=True)
class TrialRow:
    trial_id: str
    config: str  # the varied parameters, short: ``seqs=32 mbt=4096 chunk=off``
    outcome: Outcome
    best_level: str | None  # results.py best_level: at capacity, else the best meeting the SLO; None: none did
    numbers_level: (
        str | None
    )  # the level ``values`` come from (results.py chosen_level): the best, else the highest load
    values: Mapping[str, float | None]  # TRIAL_METRICS at ``numbers_level``
    slo_break: SloBreak | None
    stopped: str  # why the ladder stopped, in a few words: ``SLO broken at concurrency 2``
    stopped_detail: str  # the whole reason, as the trial recorded it
    conclusion: Conclusion
    recommended: bool = False
    cache_notes: tuple[str, ...] = ()  # levels whose prefix cache may have been warm: ``concurrency 8: ...``
    # Levels where the load client fell behind (load/pace.py), with why: ``rate 64 req/s: requests sent ...``.
    # They take no SLO verdict (results.py best_level, trial/capacity.py).
    client_bound: tuple[str, ...] = ()
    # Levels where requests failed, with why (:func:`failed_request_notes`): ``concurrency 4: 12 of 24 failed ...``
    failed_requests: tuple[str, ...] = ()
    capacity: Capacity | None = None  # the load it carries at the SLO, as its capacity search found it
    knee: Knee | None = None  # where its throughput stopped growing with load (results.py find_knee)
    speculation: str | None = None  # speculative decoding's acceptance at ``numbers_level`` (:func:`speculation_text`)
    structured: str | None = None  # the share of structured answers that parsed as asked (:func:`structured_text`)
    limited_by: str = ""  # what limited it and the next lever (report/diagnosis.py ``limited_by``)
    kv_plan: KvPlanCheck | None = None  # the planner's KV tokens against vLLM's (:func:`kv_plan_check`)


@dataclass(frozen=True)
class KvPlanCheck:
    """The capacity planner's KV tokens beside the ones vLLM logged at start-up, for one trial."""

    planned_tokens: int
    measured_tokens: int
    profile: str | None  # the vLLM memory profile planned with (None in results before it was recorded)

    @property
    def relative_error(self) -> float:
        """(planned - measured) / measured: positive where the planner promised more than vLLM gave."""
        return (self.planned_tokens - self.measured_tokens) / self.measured_tokens


def kv_plan_check(trial: TrialResult) -> KvPlanCheck | None:
    """Planned against measured KV tokens; None where either is missing (no plan, no engine start, CPU build
    sized from host memory). Results written before ``kv_capacity.planned_tokens`` read the plan's tokens."""
    kv, plan = trial.kv_capacity, trial.capacity
    planned = kv.planned_tokens if kv is not None and kv.planned_tokens is not None else None
    if planned is None and plan is not None and plan.planned:
        planned = plan.kv_cache_tokens
    if kv is None or planned is None or kv.tokens <= 0:
        return None
    measured = measured_kv_tokens(kv.tokens, kv.max_concurrency, kv.at_tokens_per_request)
    return KvPlanCheck(planned, measured, plan.profile if plan is not None else None)


def worst_kv_plan(rows: Sequence[TrialRow]) -> TrialRow | None:
    """The trial whose planned KV tokens were furthest from vLLM's (None where no trial has both)."""
    checked = [row for row in rows if row.kv_plan is not None]
    return max(checked, key=lambda row: abs(row.kv_plan.relative_error), default=None)  # type: ignore[union-attr]


def cache_notes(trial: TrialResult) -> tuple[str, ...]:
    return tuple(f"{level_label(lv.summary.level)}: {lv.cache_note}" for lv in trial.levels if lv.cache_note)


def client_bound_notes(trial: TrialResult) -> tuple[str, ...]:
    """``rate 64 req/s: requests sent 38 ms late at P99 (bound 10 ms)`` for each level where the client fell behind."""
    return tuple(f"{level_label(lv.summary.level)}: {lv.client_bound}" for lv in trial.levels if lv.client_bound)


def failed_request_notes(trial: TrialResult) -> tuple[str, ...]:
    """``concurrency 4: 12 of 24 requests failed: http_5xx 12 (HTTP 500 (in the stream): Internal server error); by
    request class: tool_call 12`` for each level where requests failed: the kinds with the first text of each, and
    the classes they were sent in (a structured class failing alone points at its backend)."""
    notes = []
    for lv in trial.levels:
        s = lv.summary
        if not s.failed:
            continue
        examples = s.error_examples or {}
        kinds = ", ".join(f"{kind} {count}" + (f" ({examples[kind]})" if examples.get(kind) else "")
                          for kind, count in sorted(s.errors_by_kind.items()))  # fmt: skip
        note = f"{level_label(s.level)}: {s.failed} of {s.failed + s.completed} requests failed: {kinds}"
        if s.failed_by_class:
            note += "; by request class: " + ", ".join(f"{c} {n}" for c, n in sorted(s.failed_by_class.items()))
        notes.append(note)
    return tuple(notes)


def speculation_text(server_metrics: Mapping[str, float]) -> str | None:
    """``accepted 55% of 40 drafted tokens, 2.10 tokens per step; by draft position 75% 35%`` from a level's
    counters (engine/metrics.py); None where the level drafted nothing."""
    rate, drafted = server_metrics.get(SPEC_ACCEPTANCE_RATE), server_metrics.get(SPEC_DRAFT_TOKENS)
    if rate is None or not drafted:
        return None
    text = f"accepted {rate:.0%} of {drafted:,.0f} drafted tokens"
    length = server_metrics.get(SPEC_MEAN_ACCEPTED_LENGTH)
    if length is not None:
        text += f", {length:.2f} tokens per step"
    by_position, position = [], 0
    while (at := server_metrics.get(spec_acceptance_at(position))) is not None:
        by_position.append(f"{at:.0%}")
        position += 1
    return text + (f"; by draft position {' '.join(by_position)}" if by_position else "")


def structured_text(trial: TrialResult, index: int) -> str | None:
    """``97.5% of structured answers parsed as asked; lowest 91.0% at concurrency 32`` at level ``index``; None
    where the level measured none (the workload asked for no structured output)."""
    share = trial.levels[index].summary.structured_valid
    if share is None:
        return None
    text = f"{share:.1%} of structured answers parsed as asked"
    measured = [lv for lv in trial.levels if lv.summary.structured_valid is not None]
    lowest = min(measured, key=lambda lv: lv.summary.structured_valid or 0.0)
    if lowest.summary.structured_valid is not None and lowest.summary.structured_valid < share:
        text += f"; lowest {lowest.summary.structured_valid:.1%} at {level_label(lowest.summary.level)}"
    return text


def slo_break(trial: TrialResult) -> SloBreak | None:
    broken = [level for level in trial.levels if level.slo_violations]
    if not broken:
        return None
    level = broken[0]
    return SloBreak(level_label(level.summary.level), tuple(level.slo_violations), len(broken) - 1)


def why_stopped(trial: TrialResult) -> tuple[str, str]:
    """(a few words, the whole text): the failure's reason, the ladder's reason to stop, or that it ran every level."""
    if trial.outcome != "COMPLETE":
        reason = first_line(trial.reason)
        return first_line(reason, 80) or "no reason given", reason
    if trial.stopped_because:
        return trial.stopped_because.split(": ", 1)[0], trial.stopped_because
    if not trial.levels:
        return "no level measured", ""
    return "ran every level", ""


def trial_rows(
    trials: Sequence[TrialResult], points: Sequence[ReportPoint], recommendation: Recommendation | None = None
) -> list[TrialRow]:
    """A row per trial. ``points`` are the study's (they carry the report's price); the recommended trial is
    marked, and concluded as MLflow concludes it (:func:`conclude`)."""
    varied = varied_params(t.params for t in trials)
    by_trial: dict[str, dict[int, ReportPoint]] = {}
    for point in points:
        by_trial.setdefault(point.trial_id, {})[point.level_index] = point
    rows = []
    for trial in trials:
        best, chosen = best_level(trial), chosen_level(trial)
        shown = by_trial.get(trial.trial_id, {}).get(chosen.index) if chosen is not None else None
        stopped, detail = why_stopped(trial)
        rows.append(
            TrialRow(
                trial_id=trial.trial_id,
                config=short_config(trial.params, varied),
                outcome=trial.outcome,
                best_level=level_label(trial.levels[best].summary.level) if best is not None else None,
                numbers_level=level_label(shown.level) if shown is not None else None,
                values={m: shown.value(m) if shown is not None else None for m in TRIAL_METRICS},
                slo_break=slo_break(trial),
                stopped=stopped,
                stopped_detail=detail,
                conclusion=conclude(trial, trials, recommendation),
                recommended=recommendation is not None and recommendation.names(trial.trial_id),
                cache_notes=cache_notes(trial),
                client_bound=client_bound_notes(trial),
                failed_requests=failed_request_notes(trial),
                capacity=trial.capacity_at_slo,
                knee=trial.knee_found,
                speculation=speculation_text(trial.levels[chosen.index].server_metrics) if chosen is not None else None,
                structured=structured_text(trial, chosen.index) if chosen is not None else None,
                limited_by=limited_by(trial),
                kv_plan=kv_plan_check(trial),
            )
        )

    def order(row: TrialRow) -> tuple:
        cost = row.values.get(COST_METRIC)
        return (not row.recommended, _VERDICT_ORDER[row.conclusion.verdict],
                float("inf") if cost is None else cost, row.trial_id)  # fmt: skip

    return sorted(rows, key=order)
