"""Copy a study directory into MLflow, idempotently: the one writer, on the driver, from disk.

:class:`StudySync` is the session both the Tune callback and ``servetune report
--log-to-mlflow`` use: :meth:`~StudySync.open` finds or creates the experiment and the parent
run and lists the trial runs already there; :meth:`~StudySync.log_new` logs every finished
trial whose ``servetune.trial_id`` is not yet in the experiment; :meth:`~StudySync.finish`
refreshes the trials' conclusions (a later trial can push one off the Pareto front), writes
the study summary and the report files, and ends the parent run. Running it twice logs nothing
twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from servetune.errors import UserError
from servetune.report import LoadedStudy, Recommendation, StudyReport, build_report, load_study
from servetune.report.conclusion import conclude
from servetune.results import (
    ENGINE_LOG,
    QUALITY_FILE,
    REQUESTS_FILE,
    RESULT_FILE,
    SPACE_FILE,
    STUDY_FILE,
    TRIALS_DIR,
    StudyInfo,
    TrialResult,
)
from servetune.tracking.connection import (
    TRACKING_ERRORS,
    TrackingError,
    describe_error,
    mlflow_env,
    reachable_client,
    resolve_tracking_uri,
)
from servetune.tracking.fields import (
    diagnosis_tags,
    level_tags,
    run_name,
    study_metrics,
    study_params,
    trial_metrics,
    trial_params,
)
from servetune.tracking.inputs import (
    ModelFingerprint,
    log_tail,
    model_fingerprint,
    read_request_stats,
)
from servetune.tracking.record import ExperimentRecord, build_record, render_record
from servetune.tracking.view import (
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    RECOMMENDED_TAG,
    runs_view_tag,
    study_description,
    ui_hint,
)
from servetune.tracking.writer import (
    CONCLUSION_TAG,
    OUTCOME_TAG,
    STUDY_DIR_TAG,
    STUDY_TAG,
    MlflowStudyWriter,
    TrialRun,
    millis,
)

#: The tags whose change means a logged trial's record must be written again.
_REFRESHED_TAGS = (CONCLUSION_TAG, f"{CONCLUSION_TAG}.why", RECOMMENDED_TAG)

REPORT_DIR = "report"


@dataclass
class SyncReport:
    """What one sync did (``error`` set when MLflow could not be used; nothing is raised for that)."""

    study_dir: Path
    tracking_uri: str
    experiment_id: str | None = None
    parent_run_id: str | None = None
    logged: list[str] = field(default_factory=list)  # trial ids logged by this sync
    already: list[str] = field(default_factory=list)  # trial ids that were in MLflow before
    refreshed: list[str] = field(default_factory=list)  # trials whose conclusion changed
    replaced: list[str] = field(
        default_factory=list
    )  # trials that ran again: their earlier run deleted, the new logged
    not_read: list[str] = field(default_factory=list)  # trial directories without a usable result
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def summary(self) -> str:
        if self.error is not None:
            done = f" ({len(self.logged)} trial(s) logged before that)" if self.logged else " (nothing logged)"
            return f"{self.error}{done}"
        parts = [f"{len(self.logged)} trial(s) logged", f"{len(self.already)} already there"]
        if self.refreshed:
            parts.append(f"{len(self.refreshed)} conclusion(s) updated")
        if self.replaced:
            parts.append(f"{len(self.replaced)} replaced by a re-run")
        if self.not_read:
            parts.append(f"{len(self.not_read)} without a result yet")
        return (
            f"MLflow {self.tracking_uri}: experiment {self.experiment_id}, parent run {self.parent_run_id}: "
            + ", ".join(parts)
            + (f"; {ui_hint(self.tracking_uri, self.experiment_id)}" if self.experiment_id else "")
        )


class StudySync:
    """One study's MLflow record. Construct freely (no I/O); :meth:`open` before the rest."""

    def __init__(self, study_dir: Path, tracking_uri: str) -> None:
        self.study_dir = Path(study_dir)
        self.tracking_uri = tracking_uri
        self.writer: MlflowStudyWriter | None = None
        self.experiment_id = ""
        self.parent_run_id = ""
        self.runs: dict[str, TrialRun] = {}  # complete trial runs by trial id
        self._fingerprints: dict[str, ModelFingerprint] = {}

    def open(self, report: SyncReport) -> None:
        """Check the server, then find or create the experiment and the parent run. Raises ``TRACKING_ERRORS``."""
        self.writer = MlflowStudyWriter(reachable_client(self.tracking_uri))
        study = load_study(self.study_dir, skip_unreadable=True)
        info = study.info
        self.experiment_id = self.writer.experiment(info.name, {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        tags = {STUDY_TAG: info.name, STUDY_DIR_TAG: str(self.study_dir.resolve()), "model.name": info.model,
                "requests.workload": info.workload, "hardware.device": info.device, "created": info.created}  # fmt: skip
        inputs: list[tuple[Path, str | None]] = [
            (self.study_dir / SPACE_FILE, None),
            (self.study_dir / STUDY_FILE, None),
        ]
        workload = self._workload_file(info)
        if workload is not None:
            inputs.append((workload, "workload"))
        self.parent_run_id = self.writer.study_run(self.experiment_id, info.name, tags, study_params(info), inputs)
        self.runs = {}
        for run in self.writer.trial_runs(self.experiment_id):
            if not run.complete:
                self.writer.discard(run.run_id)  # cut short while logging: logged again from disk
            elif run.trial_id not in self.runs:
                self.runs[run.trial_id] = run
        report.experiment_id, report.parent_run_id = self.experiment_id, self.parent_run_id

    def log_new(self, report: SyncReport) -> None:
        """Log every finished trial on disk that the experiment does not hold yet."""
        writer = self._writer()
        study = load_study(self.study_dir, skip_unreadable=True)
        report.not_read = [n.path.name for n in study.not_read]
        recommendation = recommend_of(study)
        for trial in study.trials:
            earlier = self.runs.get(trial.trial_id)
            if earlier is not None and not earlier.holds(trial):
                writer.discard(earlier.run_id)  # one run per trial: the result on disk is the one that counts
                del self.runs[trial.trial_id]
                report.replaced.append(trial.trial_id)
            if trial.trial_id in self.runs:
                if trial.trial_id not in report.logged and trial.trial_id not in report.already:
                    report.already.append(trial.trial_id)
                continue
            record = self.record(trial, study.trials, study.info, recommendation)
            trial_dir = self.study_dir / TRIALS_DIR / trial.trial_id
            files = [
                trial_dir / RESULT_FILE,
                trial_dir / ENGINE_LOG,
                trial_dir / REQUESTS_FILE,
                trial_dir / QUALITY_FILE,
            ]
            tags = trial_tags(trial, record, recommendation)
            run_id = writer.log_trial(self.experiment_id, self.parent_run_id, trial, run_name(trial), trial_params(trial),
                                      trial_metrics(trial), tags, render_record(record), files)  # fmt: skip
            self.runs[trial.trial_id] = TrialRun(trial.trial_id, run_id, "FINISHED", {**tags, OUTCOME_TAG: trial.outcome},
                                                 millis(trial.started_at) if trial.started_at else None)  # fmt: skip
            report.logged.append(trial.trial_id)

    def finish(self, report: SyncReport, end: bool = True, report_dir: Path | None = None) -> None:
        """Refresh conclusions, write the study summary and the report files (``report_dir``, default
        ``STUDY_DIR/report``, if it exists), and (``end``) end the parent run."""
        writer = self._writer()
        study = load_study(self.study_dir, skip_unreadable=True)
        study_report = report_of(study)
        recommendation = study_report.recommendation if study_report is not None else None
        for trial in study.trials:
            run = self.runs.get(trial.trial_id)
            if run is None:
                continue
            record = self.record(trial, study.trials, study.info, recommendation)
            tags = trial_tags(trial, record, recommendation)
            if all(run.tags.get(key, "") == tags.get(key, "") for key in _REFRESHED_TAGS):
                continue
            writer.update_record(run.run_id, tags, render_record(record), run_name(trial))
            self.runs[trial.trial_id] = replace(run, tags={**run.tags, **tags})
            report.refreshed.append(trial.trial_id)
        self._describe(study, study_report)
        metrics = study_metrics(study.trials)
        report_dir = report_dir if report_dir is not None else self.study_dir / REPORT_DIR
        writer.finish_study(self.parent_run_id, metrics, len(study.trials), report_dir, end)

    def record(self, trial: TrialResult, trials: tuple[TrialResult, ...], info: StudyInfo,
               recommendation: Recommendation | None) -> ExperimentRecord:  # fmt: skip
        trial_dir = self.study_dir / TRIALS_DIR / trial.trial_id
        if trial.model not in self._fingerprints:
            self._fingerprints[trial.model] = model_fingerprint(trial.model)
        tail = log_tail(trial_dir / ENGINE_LOG) if trial.outcome == "FAILED" else ""
        conclusion = conclude(trial, trials, recommendation)
        return build_record(trial, info, read_request_stats(trial_dir / REQUESTS_FILE), self._fingerprints[trial.model],
                            conclusion, tail)  # fmt: skip

    def _describe(self, study: LoadedStudy, report: StudyReport | None) -> None:
        """The parent run's description and the experiment's trials view, from the study as it is now."""
        writer = self._writer()
        varied: dict[str, None] = {}
        for trial in study.trials:
            varied.update(dict.fromkeys(trial.params))
        key, view = runs_view_tag(list(varied), capacity=any(t.capacity_at_slo is not None for t in study.trials))
        writer.set_experiment_tags(self.experiment_id, {key: view})
        if report is None:
            return  # a study.json this servetune cannot report on: the trials are logged all the same
        recommended = report.recommendation.point
        writer.describe_study(self.parent_run_id, study_description(report, self.experiment_id),
                              {"servetune.recommended_trial": recommended.trial_id if recommended else "none"})  # fmt: skip

    def _writer(self) -> MlflowStudyWriter:
        if self.writer is None:
            raise RuntimeError("StudySync.open() first")
        return self.writer

    def _workload_file(self, info: StudyInfo) -> Path | None:
        """The workload YAML the space named (None for a workload written inline in the space)."""
        from servetune.config.workload import resolve_workload_path

        try:
            space = yaml.safe_load((self.study_dir / SPACE_FILE).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            return None
        named = space.get("workload") if isinstance(space, dict) else None
        if not isinstance(named, str):
            return None
        beside_space = Path(info.space_file).parent / named
        try:
            path = beside_space if beside_space.is_file() else resolve_workload_path(named)
        except UserError:
            return None
        return path if path.is_file() else None


def report_of(study: LoadedStudy) -> StudyReport | None:
    """The study's report as data (None for a study.json this servetune cannot report on)."""
    try:
        return build_report(study)
    except UserError:
        return None


def recommend_of(study: LoadedStudy) -> Recommendation | None:
    report = report_of(study)
    return report.recommendation if report is not None else None


def trial_tags(trial: TrialResult, record: ExperimentRecord, recommendation: Recommendation | None) -> dict[str, str]:
    """A trial run's tags: its record's, which level its plain metrics hold, what limited it, and whether it is
    the one to ship."""
    return {
        **record.all_tags(),
        **level_tags(trial),
        **diagnosis_tags(trial),
        RECOMMENDED_TAG: str(bool(recommendation and recommendation.names(trial.trial_id))).lower(),
    }


def sync_study(study_dir: Path | str, tracking_uri: str | None = None, finish: bool = True,
               report_dir: Path | None = None) -> SyncReport:  # fmt: skip
    """Log a study directory to MLflow; re-running logs only what is missing.

    ``finish`` ends the parent run; ``report_dir`` (default ``STUDY_DIR/report``) holds the
    report files logged to it, when it exists.

    MLflow problems (unreachable server, refused writes) come back as ``SyncReport.error``; a
    directory that is not a study raises ``UserError`` as ``servetune report`` does.
    """
    uri = resolve_tracking_uri(tracking_uri)
    report = SyncReport(Path(study_dir), uri)
    session = StudySync(Path(study_dir), uri)
    try:
        with mlflow_env():
            session.open(report)
            session.log_new(report)
            session.finish(report, end=finish, report_dir=report_dir)
    except TrackingError as exc:
        report.error = str(exc)
    except TRACKING_ERRORS as exc:
        report.error = f"MLflow logging failed ({describe_error(exc)})"
    return report
