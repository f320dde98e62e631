"""Which configuration verify starts again, and the runner-up it is compared with.

The pick is ``servetune export``'s (``report/export.py pick_point``: ``best``, a row of the cost
vs P99 TTFT Pareto table, or a trial id). A configuration is rebuilt from the study as its trial
ran it: the space copied beside ``study.json`` gives the engine arguments and the environment
(``result.json`` masks secrets), the study's resolved model, and the level the point names.
Bad input (no completed trial, a row out of range, a failed or infeasible trial, a trial that
never met the SLO, a trial through Serve whose replicas this machine cannot hold) is a one-line
``UserError`` before anything starts.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from servetune.config.space import SERVE_REPLICAS, SearchSpace
from servetune.config.workload import Workload
from servetune.errors import UserError
from servetune.load.runner import Level
from servetune.report import build_report, load_study
from servetune.report.build import StudyReport
from servetune.report.export import pick_point
from servetune.report.points import ReportPoint, first_line
from servetune.report.recommend import candidates
from servetune.report.study import LoadedStudy
from servetune.results import SPACE_FILE, TRIALS_DIR, StudyInfo, TrialResult, read_result
from servetune.space_file import load_space
from servetune.trial.context import StudyContext, resolve_levels
from servetune.trial.runner import TrialSpec


@dataclass(frozen=True)
class Chosen:
    """One configuration to start again, at one level."""

    point: ReportPoint
    result: TrialResult
    spec: TrialSpec  # engine arguments, environment and timeouts, as the trial ran
    level: Level

    @property
    def trial_id(self) -> str:
        return self.result.trial_id


@dataclass(frozen=True)
class Selection:
    study_dir: Path
    info: StudyInfo
    space: SearchSpace
    workload: Workload
    report: StudyReport
    winner: Chosen
    runner_up: Chosen | None


def _workload(space: SearchSpace, info: StudyInfo, study_dir: Path) -> Workload:
    for base in (Path(info.space_file).parent, study_dir, Path.cwd()):
        try:
            return space.resolved_workload(base)
        except UserError:
            continue
    return space.resolved_workload(study_dir)  # raises the one-line error naming the workload


def _level(point: ReportPoint, levels: tuple[Level, ...], workload: Workload) -> Level:
    ((kind, value),) = point.level.items()
    for level in levels:
        if level.kind == kind and level.value == value:
            return level
    arrival = workload.arrival
    if kind == "concurrency":
        return Level("concurrency", float(value), "concurrency", arrival.burstiness)
    if kind == "rate":
        return Level("rate", float(value), "gamma" if arrival.process == "gamma" else "poisson", arrival.burstiness)
    raise ValueError(f"a level of unknown kind {kind!r}")  # Level.as_dict makes no other


def select(study_dir: Path, pick: str, python: str = sys.executable, address: str | None = None) -> Selection:
    """The configuration to verify and its runner-up (the best other candidate); UserError on bad input.
    ``address``: the Ray cluster trials through Serve are deployed on (default: a local Ray)."""
    study = load_study(study_dir)
    complete = [t for t in study.trials if t.outcome == "COMPLETE"]
    if not complete:
        counts = ", ".join(f"{t.trial_id} {t.outcome}" for t in study.trials) or "no trial finished"
        raise UserError(f"{study_dir}: no completed trial to verify ({counts})")
    report = build_report(study)
    if pick == "best" and report.recommendation.point is None:
        raise UserError(f"--pick best: nothing to verify, {report.recommendation.reason}")
    point = pick_point(report, pick)
    trial = next(t for t in study.trials if t.trial_id == point.trial_id)
    if trial.outcome != "COMPLETE":
        raise UserError(f"--pick {pick}: trial {trial.trial_id} is {trial.outcome} "
                        f"({first_line(trial.reason) or 'no reason given'}): only a completed trial can be verified")  # fmt: skip
    if not point.meets_slo:
        raise UserError(f"--pick {pick}: trial {trial.trial_id} never met the SLO ({'; '.join(point.slo_violations)}): "
                        "nothing to verify")  # fmt: skip
    rebuild = _Rebuild.of(study_dir, study, report, python)
    others = [c for c in candidates(report.points) if c.trial_id != point.trial_id]
    selection = rebuild.selection(point, others[0] if others else None)
    for chosen in (selection.winner, selection.runner_up):
        if chosen is not None and chosen.spec.serve_replicas is not None:
            check_serve(chosen, address)
    return selection


def check_serve(chosen: Chosen, address: str | None) -> None:
    """A trial the study measured through Ray Serve is verified through Serve, as that deployment: refused
    before anything starts where Ray Serve LLM is missing, or where this machine cannot hold its replicas
    (a local Ray; a cluster at ``address`` is asked once joined, when Serve deploys)."""
    import importlib.util

    from servetune.serve.check import local_devices
    from servetune.serve.plan import check_fits
    from servetune.serve.trial import trial_needs

    replicas = chosen.spec.serve_replicas
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise UserError(f"trial {chosen.trial_id} was measured through Ray Serve ({SERVE_REPLICAS} {replicas}): "
                        "verify deploys it through Serve, which needs ray[serve,llm] (pip install 'ray[serve,llm]')")  # fmt: skip
    need = dataclasses.replace(
        trial_needs(chosen.spec), asked_by=f"trial {chosen.trial_id}'s {SERVE_REPLICAS} {replicas}"
    )
    devices = local_devices(need) if address is None else None
    if devices is not None:
        check_fits(need, devices, need.cpus, "this machine (verify deploys on a local Ray; --address joins a cluster)")


def top_points(report: StudyReport, k: int) -> list[ReportPoint]:
    """The ``k`` best points to verify, one per trial, in recommendation order: the recommendation
    (``verify --pick best``), then the other candidates cheapest first (as verify's runner-up is
    chosen), each trial at its cheapest level meeting every SLO. Fewer when fewer trials have one;
    none without a recommendation."""
    first = report.recommendation.point
    if first is None:
        return []
    chosen, seen = [first], {first.trial_id}
    for point in candidates(report.points):
        if len(chosen) >= k:
            break
        if point.trial_id not in seen:
            chosen.append(point)
            seen.add(point.trial_id)
    return chosen[:k]


def select_top(study_dir: Path, k: int, python: str = sys.executable) -> list[Selection]:
    """A selection per point of :func:`top_points` (no runner-up: the points are each verified)."""
    study = load_study(study_dir)
    report = build_report(study)
    points = top_points(report, k)
    if not points:
        return []
    rebuild = _Rebuild.of(study_dir, study, report, python)
    return [rebuild.selection(point, None) for point in points]


@dataclass(frozen=True)
class _Rebuild:
    """What turns a point of the study back into a configuration to start."""

    study_dir: Path
    info: StudyInfo
    space: SearchSpace
    workload: Workload
    report: StudyReport
    context: StudyContext

    @classmethod
    def of(cls, study_dir: Path, study: LoadedStudy, report: StudyReport, python: str) -> _Rebuild:
        space_path = study_dir / SPACE_FILE
        if not space_path.is_file():
            raise UserError(
                f"{space_path}: no such file (verify starts the trial's configuration from the study's space)"
            )
        space = load_space(space_path)
        workload = _workload(space, study.info, study_dir)
        model = study.info.model
        if model.startswith("/") and not Path(model).is_dir():
            if space.model != "tiny":
                raise UserError(
                    f"{study_dir / 'study.json'}: model {model} is not there any more (was the study moved?)"
                )
            from servetune.models.tiny import build_tiny_model

            # The generated tiny model is deterministic (seeded): build it again inside the study.
            model = str(build_tiny_model(study_dir / "models" / "tiny").resolve())
        levels = resolve_levels(space, workload)
        context = StudyContext(space, workload, study_dir.resolve(), model, levels, python=python)
        return cls(study_dir, study.info, space, workload, report, context)

    def chosen(self, point: ReportPoint) -> Chosen:
        result = read_result(self.study_dir / TRIALS_DIR / point.trial_id)
        assert result is not None  # the report read it
        return Chosen(
            point, result, self.context.spec_for(dict(result.params)), _level(point, self.context.levels, self.workload)
        )

    def selection(self, point: ReportPoint, runner_up: ReportPoint | None) -> Selection:
        return Selection(self.study_dir, self.info, self.space, self.workload, self.report, self.chosen(point),
                         self.chosen(runner_up) if runner_up is not None else None)  # fmt: skip
