"""What serve-check reads of a study: the picked point, its trial, the workload, ladder and SLO, and the
trial's operating point (report/operating.py: headroom x min(capacity at the SLO, knee), as export)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from servetune.config.slo import Slo
from servetune.config.space import SearchSpace
from servetune.config.workload import Workload
from servetune.errors import UserError
from servetune.load.runner import Level
from servetune.report import build_report, load_study
from servetune.report.export import pick_point
from servetune.report.operating import DEFAULT_HEADROOM, OperatingLoad, operating_point_of
from servetune.report.points import ReportPoint
from servetune.results import TrialResult
from servetune.serve.plan import measured_gpu, pin_gpu_type
from servetune.space_file import load_study_space
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
    operating: OperatingLoad | None = None  # where a replica runs: the load the routers and layouts are offered
    # the Ray accelerator type its replicas are pinned to, once the cluster is known (:meth:`pinned`); None: not pinned
    gpu_type: str | None = None

    @property
    def slo(self) -> Slo:
        return self.space.slo_bounds

    def operating_level(self) -> Level:
        """The ladder's level of the picked point (its arrival process), at the operating point's load; the
        picked level itself without an operating point."""
        level = next((p.level for p in self.plans if p.level.as_dict() == dict(self.point.level)), self.plans[0].level)
        if self.operating is None or self.operating.kind != level.kind:
            return level
        return dataclasses.replace(level, value=self.operating.value)

    @property
    def measured_gpu(self) -> str | None:
        """The GPU the picked trial was measured on (serve/plan.py :func:`measured_gpu`)."""
        return measured_gpu(self.point.device, self.space.gpu_for(dict(self.trial.params)), self.trial.environment)

    def pinned(self, nodes: Sequence[Mapping[str, float]], where: str) -> PickedStudy:
        """This pick with its replicas pinned to the GPU type it was measured on, where ``nodes`` (each live node's
        resources) declare types (serve/plan.py :func:`pin_gpu_type`: refused in one line where none is of it)."""
        return dataclasses.replace(self, gpu_type=pin_gpu_type(self.measured_gpu, nodes, self.point.trial_id, where))

    @property
    def startup_timeout_s(self) -> float:
        """How long one of its engines may take to start (the study's, sized as its trials' were)."""
        from servetune.trial.context import startup_budget_for

        return startup_budget_for(self.space, dict(self.trial.params), self.point.model).timeout_s


def read_picked(study_dir: Path, pick: str, headroom: float = DEFAULT_HEADROOM) -> PickedStudy:
    """The configuration ``servetune export --pick`` would print, with what measuring it needs and its operating
    point at ``headroom`` (None where the trial met the SLO at no level: serve-check measures its ladder still)."""
    loaded = load_study(study_dir)
    report = build_report(loaded)
    point = pick_point(report, pick)
    trial = next(t for t in loaded.trials if t.trial_id == point.trial_id)
    space, workload = load_study_space(study_dir, loaded.info.space_file)
    load = space.load
    plans = tuple(
        LevelPlan.sized(level, load.requests_per_level, load.seconds_per_level, load.warmup_requests)
        for level in resolve_levels(space, workload)
    )
    points = tuple(p for p in report.points if p.trial_id == point.trial_id)
    if not 0 < headroom <= 1:
        raise UserError(f"--headroom {headroom:g}: the headroom must be above 0 and at most 1")
    operating = operating_point_of(report, point, headroom) if any(p.meets_slo for p in points) else None
    return PickedStudy(loaded.info.name, point, trial, space, workload, plans, points, operating)
