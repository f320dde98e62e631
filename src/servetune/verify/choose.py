"""Which configuration verify starts again, and the runner-up it is compared with.

The pick is ``servetune export``'s (``report/export.py pick_point``: ``best``, a row of the cost
vs P99 TTFT Pareto table, or a trial id). A configuration is rebuilt from the study as its trial
ran it: the space copied beside ``study.json`` gives the engine arguments and the environment
(``result.json`` masks secrets) and the study's resolved model. It runs at its trial's operating point
(report/operating.py, as ``export`` derives it): ``headroom`` x min(capacity at the SLO, knee), in the
kind of the level the point names, not at that ladder level. A bare engine starts with the admission bounds
``export --format vllm`` ships (report/admission.py: ``max_num_queued_reqs``, ``max_num_queued_tokens``, sized
from the trial's capacity), so the configuration verified is the one shipped; a trial through Ray Serve keeps
its Serve deployment, whose queue Serve bounds (``max_queued_requests``).
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
from servetune.report.admission import AdmissionBounds
from servetune.report.build import StudyReport
from servetune.report.export import admission_for, pick_point
from servetune.report.operating import DEFAULT_HEADROOM, OperatingLoad, operating_point_of
from servetune.report.points import ReportPoint, first_line
from servetune.report.recommend import candidates
from servetune.report.study import LoadedStudy
from servetune.results import TRIALS_DIR, StudyInfo, TrialResult, read_result
from servetune.space_file import load_study_space
from servetune.trial.context import StudyContext, resolve_levels
from servetune.trial.runner import TrialSpec


@dataclass(frozen=True)
class Chosen:
    """One configuration to start again, at one level: its operating point."""

    point: ReportPoint  # the study's point it was picked by (its trial, a level the study measured)
    result: TrialResult
    spec: TrialSpec  # engine arguments, environment and timeouts, as the trial ran
    level: Level  # the operating point's load, in the kind of the point's level
    operating: OperatingLoad | None = None  # what ``level`` rests on (capacity, knee, headroom)
    # The admission bounds its engine starts with, as export ships them (in ``spec.engine_args``), or why none
    admission: AdmissionBounds | str | None = None

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


def point_level(point: ReportPoint, levels: tuple[Level, ...], workload: Workload) -> Level:
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


def at_operating_point(level: Level, operating: OperatingLoad) -> Level:
    """``level`` (the point's, with its arrival process) at the operating point's load."""
    if operating.kind != level.kind:
        raise ValueError(f"an operating point in {operating.kind} for a level in {level.kind}")
    return dataclasses.replace(level, value=operating.value)


def select(study_dir: Path, pick: str, python: str = sys.executable, address: str | None = None,
           headroom: float = DEFAULT_HEADROOM, admission: bool = True, against: str | None = None) -> Selection:  # fmt: skip
    """The configuration to verify and its runner-up (the best other candidate), each at its operating point
    (``headroom`` x min(capacity, knee)); UserError on bad input.
    ``against``: the other configuration as ``--pick`` names one (``runner-up`` or None: the best other candidate),
    in ``runner_up``; any other completed trial than the pick's, whether it met the SLO or not (then at its
    point's own level, without an operating point).
    ``address``: the Ray cluster trials through Serve are deployed on (default: a local Ray).
    ``admission``: start each with the admission bounds export ships (:func:`with_admission`); without, each is
    launched as its trial was (recheck measures the recorded ladder again, where a bound would refuse the top
    levels' excess that the recorded engine queued)."""
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
    other = _against(study, report, point, against) if against not in (None, "runner-up") else None
    rebuild = _Rebuild.of(study_dir, study, report, python, headroom)
    others = [c for c in candidates(report.points) if c.trial_id != point.trial_id]
    if other is not None:  # at the point's own level: it may never have met the SLO
        selection = rebuild.selection(point, other, admission, runner_up_operating=False)
    else:
        selection = rebuild.selection(point, others[0] if others else None, admission)
    for chosen in (selection.winner, selection.runner_up):
        if chosen is not None and chosen.spec.serve_replicas is not None:
            check_serve(chosen, address)
    return selection


def _against(study: LoadedStudy, report: StudyReport, point: ReportPoint, against: str) -> ReportPoint:
    """The point ``--against`` names (as ``--pick`` names one): a completed trial other than ``point``'s."""
    try:
        other = pick_point(report, against)
    except UserError as exc:  # said of --pick, whose choices --against shares
        raise UserError(str(exc).replace("--pick", "--against", 1)) from None
    if other.trial_id == point.trial_id:
        raise UserError(f"--against {against}: that is trial {point.trial_id}, the one picked: name another")
    trial = next(t for t in study.trials if t.trial_id == other.trial_id)
    if trial.outcome != "COMPLETE":
        raise UserError(f"--against {against}: trial {trial.trial_id} is {trial.outcome} "
                        f"({first_line(trial.reason) or 'no reason given'}): only a completed trial can be measured")  # fmt: skip
    return other


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


def select_top(study_dir: Path, k: int, python: str = sys.executable,
               headroom: float = DEFAULT_HEADROOM) -> list[Selection]:  # fmt: skip
    """A selection per point of :func:`top_points` (no runner-up: the points are each verified), each at its
    operating point."""
    study = load_study(study_dir)
    report = build_report(study)
    points = top_points(report, k)
    if not points:
        return []
    rebuild = _Rebuild.of(study_dir, study, report, python, headroom)
    return [rebuild.selection(point, None) for point in points]


def with_admission(spec: TrialSpec, report: StudyReport, point: ReportPoint) -> tuple[TrialSpec, AdmissionBounds | str]:
    """``spec`` with the admission bounds ``export --format vllm`` adds for ``point``'s trial (report/admission.py),
    and those bounds; unchanged, with why, where there are none or the trial runs through Ray Serve."""
    if spec.serve_replicas is not None:
        return spec, "measured through Ray Serve: Serve bounds the queue (max_queued_requests), as export ships it"
    bounds = admission_for(report, point)
    if isinstance(bounds, str):
        return spec, bounds
    return dataclasses.replace(spec, engine_args={**spec.engine_args, **bounds.engine_args()}), bounds


@dataclass(frozen=True)
class _Rebuild:
    """What turns a point of the study back into a configuration to start."""

    study_dir: Path
    info: StudyInfo
    space: SearchSpace
    workload: Workload
    report: StudyReport
    context: StudyContext
    headroom: float

    @classmethod
    def of(cls, study_dir: Path, study: LoadedStudy, report: StudyReport, python: str,
           headroom: float = DEFAULT_HEADROOM) -> _Rebuild:  # fmt: skip
        space, workload = load_study_space(study_dir, study.info.space_file)
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
        return cls(study_dir, study.info, space, workload, report, context, headroom)

    def chosen(self, point: ReportPoint, admission: bool = True, operating_point: bool = True) -> Chosen:
        """``point``'s configuration at its operating point; with ``admission``, with the admission bounds export
        ships (:func:`with_admission`), else as its trial ran it. Without ``operating_point``, at the point's own
        level (a trial that never met the SLO has no operating point)."""
        result = read_result(self.study_dir / TRIALS_DIR / point.trial_id)
        assert result is not None  # the report read it
        level = point_level(point, self.context.levels, self.workload)
        operating = operating_point_of(self.report, point, self.headroom) if operating_point else None
        level = at_operating_point(level, operating) if operating is not None else level
        spec = self.context.spec_for(dict(result.params))
        if not admission:
            return Chosen(point, result, spec, level, operating)
        spec, bounds = with_admission(spec, self.report, point)
        return Chosen(point, result, spec, level, operating, bounds)

    def selection(self, point: ReportPoint, runner_up: ReportPoint | None, admission: bool = True,
                  runner_up_operating: bool = True) -> Selection:  # fmt: skip
        other = self.chosen(runner_up, admission, runner_up_operating) if runner_up is not None else None
        return Selection(self.study_dir, self.info, self.space, self.workload, self.report,
                         self.chosen(point, admission), other)  # fmt: skip
