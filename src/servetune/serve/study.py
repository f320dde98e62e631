"""What serve-check reads of a study: the picked point, its trial, the workload, ladder and SLO."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from servetune.config.loading import load_yaml_model
from servetune.config.slo import Slo
from servetune.config.space import SearchSpace
from servetune.config.workload import Workload
from servetune.errors import UserError
from servetune.report import build_report, load_study
from servetune.report.export import pick_point
from servetune.report.points import ReportPoint
from servetune.results import SPACE_FILE, TrialResult
from servetune.trial.context import resolve_levels
from servetune.trial.measure import LevelPlan


@dataclass(frozen=True)
class PickedStudy:
    study: str
    point: ReportPoint
    trial: TrialResult  # the bare engine's measurements of the picked configuration
    space: SearchSpace
    workload: Workload
    plans: tuple[LevelPlan, ...]  # the study's ladder, sized as its trials sized it
    trial_points: tuple[ReportPoint, ...] = ()  # every level of the picked trial, as the report sees it

    @property
    def slo(self) -> Slo:
        return self.space.slo_bounds

    @property
    def startup_timeout_s(self) -> float:
        """How long one of its engines may take to start (the study's, sized as its trials' were)."""
        from servetune.trial.context import startup_budget_for

        return startup_budget_for(self.space, dict(self.trial.params), self.point.model).timeout_s


def read_picked(study_dir: Path, pick: str) -> PickedStudy:
    """The configuration ``servetune export --pick`` would print, with what measuring it needs."""
    loaded = load_study(study_dir)
    report = build_report(loaded)
    point = pick_point(report, pick)
    trial = next(t for t in loaded.trials if t.trial_id == point.trial_id)
    space_path = study_dir / SPACE_FILE
    if not space_path.is_file():
        raise UserError(f"{space_path}: no such file (serve-check measures with the study's workload and ladder)")
    space = load_yaml_model(space_path, SearchSpace)
    workload = space.resolved_workload(study_dir)
    load = space.load
    plans = tuple(
        LevelPlan.sized(level, load.requests_per_level, load.seconds_per_level, load.warmup_requests)
        for level in resolve_levels(space, workload)
    )
    points = tuple(p for p in report.points if p.trial_id == point.trial_id)
    return PickedStudy(loaded.info.name, point, trial, space, workload, plans, points)
