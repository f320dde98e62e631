"""The names of what a study logs to MLflow, as servetune's own sync logs them.

The stored demo study is sent through ``servetune.tracking.sync_study`` with its MLflow client
replaced by one that keeps the names in memory: the study directory is read, nothing is written,
no MLflow store is opened. So the names are those the sync's code produces, never a list kept by
hand.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError


class _Run:
    def __init__(self, run_id: str, tags: dict[str, str]) -> None:
        self.info = types.SimpleNamespace(run_id=run_id, status="RUNNING", start_time=None)
        self.data = types.SimpleNamespace(params={}, metrics={}, tags=dict(tags))
        self.artifacts: set[str] = set()


class _Page(list):  # type: ignore[type-arg]
    token = None


class RecordingClient:
    """The part of ``MlflowClient`` the study writer calls, keeping what was logged in memory."""

    def __init__(self, tracking_uri: str) -> None:
        self.experiment_tags: dict[str, str] = {}
        self.runs: list[_Run] = []

    def get_experiment_by_name(self, name: str) -> None:
        return None

    def create_experiment(self, name: str, tags: dict[str, str]) -> str:
        self.experiment_tags.update(tags)
        return "1"

    def set_experiment_tag(self, experiment_id: str, key: str, value: str) -> None:
        self.experiment_tags[key] = value

    def search_runs(self, *args: Any, **kwargs: Any) -> _Page:
        return _Page()

    def create_run(self, experiment_id: str, tags: dict[str, str], run_name: str = "", **kw: Any) -> _Run:
        run = _Run(str(len(self.runs)), tags)
        self.runs.append(run)
        return run

    def get_run(self, run_id: str) -> _Run:
        return self.runs[int(run_id)]

    def log_batch(self, run_id: str, metrics: Any = (), params: Any = (), tags: Any = ()) -> None:
        run = self.get_run(run_id)
        run.data.params.update({p.key: p.value for p in params})
        run.data.tags.update({t.key: t.value for t in tags})
        run.data.metrics.update({m.key: m.value for m in metrics})

    def log_artifact(self, run_id: str, path: str, artifact_path: str | None = None) -> None:
        self.get_run(run_id).artifacts.add(f"{artifact_path}/{Path(path).name}" if artifact_path else Path(path).name)

    def log_artifacts(self, run_id: str, path: str, artifact_path: str | None = None) -> None:
        self.get_run(run_id).artifacts.add(f"{artifact_path}/" if artifact_path else "./")

    def set_terminated(self, run_id: str, status: str, end_time: int | None = None) -> None:
        self.get_run(run_id).info.status = status

    def update_run(self, run_id: str, status: str) -> None:
        self.get_run(run_id).info.status = status

    def delete_run(self, run_id: str) -> None:
        raise PluginError("the MLflow names are read from a fresh store: nothing to delete")


def mlflow_names(study_dir: Path) -> str:
    """What ``servetune.tracking.sync_study`` logs of a study, a section per kind of name."""
    from unittest import mock

    from servetune.tracking import sync
    from servetune.tracking.fields import BY_LEVEL
    from servetune.tracking.stability import stability_metrics

    clients: list[RecordingClient] = []

    def client(uri: str) -> RecordingClient:
        clients.append(RecordingClient(uri))
        return clients[-1]

    with mock.patch.object(sync, "reachable_client", client):
        report = sync.sync_study(study_dir, "sqlite:///unused.db", report_dir=study_dir / "no-report")
    if not report.ok or not clients:
        raise PluginError(f"the MLflow names: the sync of {study_dir} failed: {report.error}")
    recorded = clients[0]
    role = "servetune.role"
    parent = [r for r in recorded.runs if r.data.tags.get(role) == "study"]
    trials = [r for r in recorded.runs if r.data.tags.get(role) == "trial"]

    def union(runs: list[_Run], read: Callable[[_Run], Iterable[str]]) -> list[str]:
        return sorted({name for run in runs for name in read(run)})

    def logged(run: _Run) -> list[str]:
        return [key for key in run.data.metrics if not key.startswith(BY_LEVEL)]

    def series(run: _Run) -> list[str]:
        return [key for key in run.data.metrics if key.startswith(BY_LEVEL)]

    verify = stability_metrics({"cancellation_success_rate": 1.0, "p99_jitter": 1.0, "error_rate_5xx": 0.0}, True)
    sections = [
        ("The experiment: tags", sorted(recorded.experiment_tags)),
        ("The study's run: params", union(parent, lambda r: r.data.params)),
        ("The study's run: metrics (step = the trials finished)", union(parent, logged)),
        ("The study's run: tags", union(parent, lambda r: r.data.tags)),
        ("The study's run: artifacts", union(parent, lambda r: r.artifacts)),
        ("A trial's run: params", union(trials, lambda r: r.data.params)),
        ("A trial's run: metrics (its chosen level, and totals)", union(trials, logged)),
        (f"A trial's run: `{BY_LEVEL}` series, a point per level (step = the level's index)", union(trials, series)),
        ("A trial's run: tags", union(trials, lambda r: r.data.tags)),
        ("A trial's run: artifacts", union(trials, lambda r: r.artifacts)),
        ("A trial's run, once `servetune verify` logged it: metrics (and the tag `verify.accepted`)", sorted(verify)),
    ]
    out = []
    for title, names in sections:
        out += [f"**{title}** ({len(names)})", "", ", ".join(f"`{name}`" for name in names), ""]
    return "\n".join(out).rstrip()
