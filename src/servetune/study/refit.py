"""The study's online refit of the estimate's factors (issue 40, item 3).

:class:`StudyRefit` holds the calibration points of the study's completed trials
(:func:`servetune.trial.estimated.calibration_points`) and refits the efficiency factors on them after
each one (:func:`servetune.estimate.refit.refit`, shrunk toward the shipped factors); the trials that
start next are estimated with the refit (``TrialSpec.estimate_efficiency``), and the driver writes it to
``estimate_factors.json`` in the study directory. Plain Python; during a study it runs as a Ray actor
(:func:`start_study_refit`), as :class:`~servetune.study.early_stop.FinishedPoints` does.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from servetune.config.workload import Workload
from servetune.errors import UserError
from servetune.estimate import Efficiency, load_factors
from servetune.estimate.calibrate import CalibrationPoint
from servetune.estimate.refit import DEFAULT_PRIOR_POINTS, Refit, refit
from servetune.results import TrialResult
from servetune.results.files import REFIT_FILE
from servetune.trial.estimated import calibration_points

#: The refit factors in the study directory.


class StudyRefit:
    """The factors refitted on a study's completed trials, for one GPU class (the study's)."""

    def __init__(
        self,
        gpu: str | None,
        gpu_memory_gib: float | None,
        results: Iterable[TrialResult] = (),
        prior_points: float = DEFAULT_PRIOR_POINTS,
        workload: Workload | None = None,
    ) -> None:
        self._gpu, self._gpu_memory_gib, self._prior_points = gpu, gpu_memory_gib, prior_points
        self._workload = workload  # the study's: its images are encoded in each point's prediction
        self._points: list[CalibrationPoint] = []
        self._trials: list[str] = []
        self._refit: Refit | None = None
        self._errors: dict[str, dict[str, float]] = {}  # (trial, level) -> the estimate's relative error per metric
        for result in results:
            self.add(result)

    def add(self, result: TrialResult) -> None:
        """Take a finished trial's levels (none unless it COMPLETEd and was estimated) and refit."""
        if result.outcome == "COMPLETE":
            for index, level in enumerate(result.levels):
                if level.estimate is not None and level.estimate.error:
                    self._errors[f"{result.trial_id}/{index}"] = dict(level.estimate.error)
        if result.trial_id in self._trials:
            return
        try:
            points = calibration_points(result, self._gpu, self._gpu_memory_gib, self._workload)
        except (UserError, OSError, ValueError):  # its model is not readable here: the refit goes on without it
            return
        if not points:
            return
        classes = {p.gpu_class for p in [*self._points, *points]}
        if len(classes) > 1:  # trials on GPUs of other kinds: factors are per class, keep the first class's
            return
        self._points += points
        self._trials.append(result.trial_id)
        cls = points[0].gpu_class
        prior = load_factors().for_class(cls)
        efficiency = refit(self._points, prior, prior_points=self._prior_points)
        measured = sum(len(p.measured) for p in self._points)
        self._refit = Refit(gpu_class=cls, prior=prior, prior_points=self._prior_points, points=measured,
                            trials=list(self._trials), efficiency=efficiency)  # fmt: skip

    def efficiency(self) -> Efficiency | None:
        """The refit factors, or None before any trial completed (the shipped ones then)."""
        return None if self._refit is None else self._refit.efficiency

    def errors(self) -> list[dict[str, float]]:
        """The estimate's relative errors (``LevelEstimate.error``) of every estimated level the study completed."""
        return list(self._errors.values())

    def record(self) -> Refit | None:
        return self._refit


def write_refit(study_dir: Path, record: Refit | None) -> None:
    """``estimate_factors.json`` in the study directory (nothing before a refit)."""
    if record is not None:
        path = study_dir / REFIT_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(record.model_dump_json(indent=2) + "\n", encoding="utf-8")
        tmp.replace(path)


def start_study_refit(
    gpu: str | None, gpu_memory_gib: float | None, results: Iterable[TrialResult], workload: Workload | None = None
) -> Any:
    """The :class:`StudyRefit` actor of a study (no CPU reserved: it refits in milliseconds to seconds)."""
    import ray

    return ray.remote(num_cpus=0)(StudyRefit).remote(gpu, gpu_memory_gib, list(results), workload=workload)


def refit_for_trial(actor: Any, timeout_s: float = 10.0) -> Efficiency | None:
    """The factors a trial starting now is estimated with; None (the shipped ones) if the actor does not answer."""
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    try:
        efficiency: Efficiency | None = ray.get(actor.efficiency.remote(), timeout=timeout_s)
    except (GetTimeoutError, RayError):  # the estimate is a side note: never hold a trial up for it
        return None
    return efficiency
