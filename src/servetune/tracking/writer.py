"""MLflow writes of one study through ``MlflowClient``: the experiment, the parent run, trial runs.

Layout: one experiment per study (named after it); one parent run tagged
``servetune.role=study``; one nested run per trial (``mlflow.parentRunId``) tagged
``servetune.trial_id``. A trial run is created RUNNING and terminated last (FINISHED, or FAILED
for a trial that failed or did not fit), so a run still RUNNING was cut short while logging and
is replaced on the next sync. Nothing here reads a study directory: the caller hands it data.
"""

from __future__ import annotations

import datetime as dt
import math
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag

from servetune.results import TrialResult
from servetune.tracking.connection import TrackingError
from servetune.tracking.fields import MetricPoint

ROLE_TAG = "servetune.role"
STUDY_TAG = "servetune.study"
STUDY_DIR_TAG = "servetune.study_dir"
TRIAL_TAG = "servetune.trial_id"
OUTCOME_TAG = "servetune.outcome"
REASON_TAG = "servetune.reason"
CONCLUSION_TAG = "conclusion"
PARENT_TAG = "mlflow.parentRunId"
NOTE_TAG = "mlflow.note.content"  # the run's description in the MLflow UI (Markdown)
RUN_NAME_TAG = "mlflow.runName"
RECORD_FILE = "record.md"
_BATCH = 100  # MLflow accepts at most 100 params and 100 tags per batch, 1000 entities in all
_METRICS_PER_BATCH = 1000 - 2 * _BATCH
_TAG_LIMIT = 7900  # MLflow stores at most 8000 characters per tag value


@dataclass(frozen=True)
class TrialRun:
    trial_id: str
    run_id: str
    status: str
    tags: Mapping[str, str]
    start_time: int | None = None  # epoch ms: the logged result's started_at

    @property
    def complete(self) -> bool:
        """Every write of the trial landed (the run was terminated last)."""
        return self.status != "RUNNING"

    def holds(self, trial: TrialResult) -> bool:
        """The run logged this result, not an earlier one of the same trial id (a trial whose node
        was lost ran again on ``--resume``: same id, new outcome and start)."""
        if self.tags.get(OUTCOME_TAG, trial.outcome) != trial.outcome:
            return False
        return trial.started_at is None or self.start_time is None or self.start_time == millis(trial.started_at)


def millis(iso: str | None) -> int:
    """An ISO timestamp from result.json in epoch milliseconds (now when missing or unreadable)."""
    try:
        return int(dt.datetime.fromisoformat(iso).timestamp() * 1000) if iso else int(time.time() * 1000)
    except ValueError:
        return int(time.time() * 1000)


def _clip(text: str, limit: int = _TAG_LIMIT) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


class MlflowStudyWriter:
    """Every MLflow call servetune makes. Each method may raise ``TRACKING_ERRORS``."""

    def __init__(self, client: MlflowClient) -> None:
        self.client = client

    def experiment(self, name: str, tags: Mapping[str, str]) -> str:
        """The id of the study's experiment, created when missing; ``tags`` set on it either way."""
        found = self.client.get_experiment_by_name(name)
        if found is None:
            return self.client.create_experiment(name, tags={ROLE_TAG: "study", **tags})
        if found.lifecycle_stage == "deleted":
            raise TrackingError(f"MLflow experiment '{name}' is deleted: restore it (mlflow experiments restore "
                                f"--experiment-id {found.experiment_id}) or remove it for good (mlflow gc)")  # fmt: skip
        self.set_experiment_tags(found.experiment_id, {k: v for k, v in tags.items() if found.tags.get(k) != v})
        return found.experiment_id

    def set_experiment_tags(self, experiment_id: str, tags: Mapping[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_experiment_tag(experiment_id, key, value)

    def describe_study(self, run_id: str, description: str, tags: Mapping[str, str]) -> None:
        """The parent run's description (Markdown, shown on its page) and tags."""
        self._batch(run_id, tags={**tags, NOTE_TAG: description})

    def study_run(self, experiment_id: str, name: str, tags: Mapping[str, str], params: Mapping[str, str],
                  artifacts: Iterable[tuple[Path, str | None]]) -> str:  # fmt: skip
        """The parent run (created once; reopened as RUNNING), with its params and input files."""
        runs = self.client.search_runs(
            [experiment_id], f"tags.`{ROLE_TAG}` = 'study'", order_by=["attributes.start_time ASC"], max_results=1
        )
        if runs:
            run_id = runs[0].info.run_id
            if runs[0].info.status != "RUNNING":
                self.client.update_run(run_id, status="RUNNING")
            logged = runs[0].data.params
        else:
            run_id = self.client.create_run(experiment_id, tags={ROLE_TAG: "study", **tags}, run_name=name).info.run_id
            logged = {}
        new = {k: v for k, v in params.items() if k not in logged}  # params are write-once in MLflow
        self._batch(run_id, params=new, tags={} if not runs else tags)
        for path, artifact_dir in artifacts:
            if path.is_file():
                self.client.log_artifact(run_id, str(path), artifact_dir)
        return run_id

    def trial_runs(self, experiment_id: str) -> list[TrialRun]:
        """Every (not deleted) trial run of the experiment, in one paged search."""
        runs: list[TrialRun] = []
        token = None
        while True:
            page = self.client.search_runs(
                [experiment_id], f"tags.`{ROLE_TAG}` = 'trial'", max_results=1000, page_token=token
            )
            runs += [
                TrialRun(
                    r.data.tags.get(TRIAL_TAG, ""), r.info.run_id, r.info.status, dict(r.data.tags), r.info.start_time
                )
                for r in page
            ]
            token = page.token
            if not token:
                return runs

    def discard(self, run_id: str) -> None:
        """Delete a trial run that was cut short, or whose trial ran again (it is logged again from disk)."""
        self.client.delete_run(run_id)

    def log_trial(
        self, experiment_id: str, parent_run_id: str, trial: TrialResult, run_name: str, params: Mapping[str, str],
        metrics: Sequence[MetricPoint], tags: Mapping[str, str], record_md: str, files: Iterable[Path],
    ) -> str:  # fmt: skip
        """One nested run with everything; terminated last."""
        base = {
            ROLE_TAG: "trial", STUDY_TAG: trial.study, TRIAL_TAG: trial.trial_id, OUTCOME_TAG: trial.outcome,
            REASON_TAG: _clip(trial.reason or ""), PARENT_TAG: parent_run_id,
        }  # fmt: skip
        run = self.client.create_run(
            experiment_id, start_time=millis(trial.started_at), tags=base, run_name=run_name[:250]
        )
        run_id = run.info.run_id
        stamp = millis(trial.finished_at)
        entries = [Metric(m.key, m.value, stamp, m.step) for m in metrics]
        self._batch(run_id, params=params, tags={**tags, NOTE_TAG: record_md}, metrics=entries)
        self._log_record(run_id, record_md)
        for path in files:
            if path.is_file():
                self.client.log_artifact(run_id, str(path))
        status = "FINISHED" if trial.outcome == "COMPLETE" else "FAILED"
        self.client.set_terminated(run_id, status, end_time=millis(trial.finished_at))
        return run_id

    def update_record(self, run_id: str, tags: Mapping[str, str], record_md: str, run_name: str | None = None) -> None:
        """(Re)write a trial's record: its tags, record.md, the run description (and its name)."""
        named = {RUN_NAME_TAG: run_name[:250]} if run_name else {}
        self._batch(run_id, tags={**tags, **named, NOTE_TAG: record_md})
        self._log_record(run_id, record_md)

    def _log_record(self, run_id: str, record_md: str) -> None:
        with tempfile.TemporaryDirectory(prefix="servetune-record-") as tmp:
            path = Path(tmp) / RECORD_FILE
            path.write_text(record_md, encoding="utf-8")
            self.client.log_artifact(run_id, str(path))

    def finish_study(
        self, run_id: str, metrics: Mapping[str, float], step: int, report_dir: Path | None, end: bool
    ) -> None:
        """Study summary metrics (only those that changed), the report files, and the parent's end."""
        current = self.client.get_run(run_id).data.metrics
        changed = [Metric(k, v, int(time.time() * 1000), step) for k, v in metrics.items() if current.get(k) != v]
        self._batch(run_id, metrics=changed)
        if report_dir is not None and report_dir.is_dir() and any(report_dir.iterdir()):
            self.client.log_artifacts(run_id, str(report_dir), "report")
        if end:
            self.client.set_terminated(run_id, "FINISHED")

    def _batch(self, run_id: str, params: Mapping[str, str] | None = None, tags: Mapping[str, str] | None = None,
               metrics: Sequence[Metric] = ()) -> None:  # fmt: skip
        """As few ``log_batch`` calls as MLflow's limits allow (100 params, 100 tags, 1000 entities each)."""
        p = [Param(k, v[:6000]) for k, v in (params or {}).items()]
        t = [RunTag(k, _clip(v)) for k, v in (tags or {}).items()]
        m = list(metrics)
        calls = max(math.ceil(len(p) / _BATCH), math.ceil(len(t) / _BATCH), math.ceil(len(m) / _METRICS_PER_BATCH))
        for i in range(calls):
            self.client.log_batch(
                run_id, metrics=m[i * _METRICS_PER_BATCH : (i + 1) * _METRICS_PER_BATCH],
                params=p[i * _BATCH : (i + 1) * _BATCH], tags=t[i * _BATCH : (i + 1) * _BATCH],
            )  # fmt: skip
