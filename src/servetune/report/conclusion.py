"""A trial's conclusion (tuning checklist, section 16): keep, eliminate, or next round.

The rule, kept simple:

- **eliminate** a trial that did not complete, that measured no load level, or that broke the
  SLO at every level it measured;
- **keep** a trial with an operating point on the Pareto front of cost vs P99 TTFT (the
  front ``servetune export --pick N`` indexes);
- otherwise **next round**: it meets the SLO somewhere but is dominated.

Pure: the report's table of trials and the MLflow record both state it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from servetune.report.pareto import FRONTS, pareto_front
from servetune.report.points import first_line, gather_points, level_label, quality_failures
from servetune.results import TrialResult

if TYPE_CHECKING:
    from servetune.report.recommend import Recommendation

Verdict = Literal["keep", "eliminate", "next round"]


@dataclass(frozen=True)
class Conclusion:
    verdict: Verdict
    why: str

    def __str__(self) -> str:
        return f"{self.verdict}: {self.why}"


def conclude(
    trial: TrialResult, study_trials: Sequence[TrialResult], recommendation: Recommendation | None = None
) -> Conclusion:
    """Keep a point on the cost vs P99 TTFT front, eliminate a trial that never met the SLO, else next round.
    The trial the study recommends is kept to ship, wherever it stands: vLLM's defaults may be recommended
    over a cheaper tuned point within the noise (report/recommend.py, rule 4)."""
    if recommendation is not None and recommendation.names(trial.trial_id):
        return recommended_conclusion(recommendation.reason)
    if trial.runs_again:  # its node or process died, or the cluster failed it: no verdict on the configuration
        why = (
            f"{trial.failure.cause} ({first_line(trial.reason)})" if trial.failure is not None else "the trial was lost"
        )
        return Conclusion("next round", f"not judged, {why}; it runs again on --resume")
    if trial.outcome != "COMPLETE":
        return Conclusion("eliminate", f"trial {trial.outcome}: {first_line(trial.reason) or 'no reason given'}")
    failed = quality_failures(trial)
    if failed:
        return Conclusion("eliminate", "failed the quality probe: " + "; ".join(failed))
    meeting = [lv for lv in trial.levels if lv.meets_slo and lv.summary.completed > 0]
    if not meeting:
        return Conclusion(
            "eliminate", "broke the SLO at every load level" if trial.levels else "no load level measured"
        )
    others = [t for t in study_trials if t.trial_id != trial.trial_id]
    spec = FRONTS[0]
    front = pareto_front(gather_points([*others, trial]), spec.objectives).front
    mine = [p for p in front if p.trial_id == trial.trial_id]
    if mine:
        where = ", ".join(level_label(p.level) for p in mine)
        return Conclusion("keep", f"on the Pareto front of cost vs P99 TTFT at {where}")
    return Conclusion(
        "next round",
        f"meets the SLO at {len(meeting)} of {len(trial.levels)} levels but is dominated on cost vs P99 TTFT",
    )


def recommended_conclusion(reason: str) -> Conclusion:
    """The conclusion of the trial the study recommends: keep it, and ship it."""
    return Conclusion("keep", f"recommended to ship ({reason})")
