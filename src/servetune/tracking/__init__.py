"""MLflow tracking of studies: one experiment per study, a parent run, one nested run per trial.

The driver is the only writer, and it writes from the study directory on disk:
:class:`~servetune.tracking.callback.MlflowCallback` while Tune runs, :func:`sync_study` for
``servetune report STUDY_DIR --log-to-mlflow`` (idempotent: what MLflow holds is not logged
twice). Each trial run carries the checklist's experiment record (section 16) as tags and as
``record.md`` (``trials/record_template.md`` filled in).

``MlflowCallback`` imports Ray Tune, so it is loaded on first use: ``servetune report`` needs
neither Ray nor a cluster.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from servetune.tracking.connection import (
    DEFAULT_TRACKING_URI,
    TrackingError,
    TrackingUnavailable,
    resolve_tracking_uri,
    unreachable_reason,
)
from servetune.tracking.record import Conclusion, ExperimentRecord, build_record, conclude, render_record
from servetune.tracking.sync import StudySync, SyncReport, sync_study

if TYPE_CHECKING:
    from servetune.tracking.callback import MlflowCallback

__all__ = [
    "DEFAULT_TRACKING_URI",
    "Conclusion",
    "ExperimentRecord",
    "MlflowCallback",
    "StudySync",
    "SyncReport",
    "TrackingError",
    "TrackingUnavailable",
    "build_record",
    "conclude",
    "render_record",
    "resolve_tracking_uri",
    "sync_study",
    "unreachable_reason",
]


def __getattr__(name: str) -> Any:
    if name == "MlflowCallback":
        from servetune.tracking.callback import MlflowCallback

        return MlflowCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
