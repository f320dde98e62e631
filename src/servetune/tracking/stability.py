"""Section 16's stability field, as ``servetune verify`` measured it, on the verified trial's run.

The trial's run is the study experiment's run tagged ``servetune.trial_id``. Written as metrics
(``stability.cancellation_success_rate``, ``stability.p99_jitter``, ``stability.error_rate_5xx``,
``stability.oom`` 0/1, ``verify.accepted`` 0/1), a ``verify.accepted`` tag, a ``verify.limited_by`` tag
(what limited the configuration in the verification) and ``verify.json`` as an artifact under ``verify/``. MLflow being unreachable, or the study never logged there, is one
line; verification's results are in verify.json either way.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from servetune.tracking.connection import log_to_study
from servetune.tracking.writer import TRIAL_TAG

if TYPE_CHECKING:
    from mlflow import MlflowClient

#: The tag of what limited the configuration in its verification.
LIMITED_BY_TAG = "verify.limited_by"
METRICS = {
    "stability.cancellation_success_rate": "cancellation_success_rate",
    "stability.p99_jitter": "p99_jitter",
    "stability.error_rate_5xx": "error_rate_5xx",
}


def stability_metrics(stability: Mapping[str, Any], accepted: bool) -> dict[str, float]:
    """The numbers to log (those measured), booleans as 0/1."""
    out = {
        key: float(stability[name]) for key, name in METRICS.items() if isinstance(stability.get(name), (int, float))
    }
    out["stability.oom"] = 1.0 if stability.get("oom") else 0.0
    out["verify.accepted"] = 1.0 if accepted else 0.0
    return out


def log_stability(tracking_uri: str | None, study: str, trial_id: str, stability: Mapping[str, Any], accepted: bool,
                  verify_file: Path | None = None, limited_by: str | None = None) -> str:  # fmt: skip
    """Log on the trial's run; returns one line saying what happened (never raises for MLflow). ``limited_by``: what
    limited the configuration in the verification (verify.json's, verify/diagnosis.py), tagged ``verify.limited_by``
    beside the study's ``servetune.limited_by``."""

    def log(client: MlflowClient, experiment_id: str) -> str:
        from mlflow.entities import Metric, RunTag

        runs = client.search_runs([experiment_id], f"tags.`{TRIAL_TAG}` = '{trial_id}'", max_results=1)
        if not runs:
            return f"no run of trial {trial_id} in experiment '{study}': stability not logged"
        run_id = runs[0].info.run_id
        stamp = int(time.time() * 1000)
        metrics = [Metric(k, v, stamp, 0) for k, v in stability_metrics(stability, accepted).items()]
        tags = [RunTag("verify.accepted", "yes" if accepted else "no")]
        if limited_by is not None:
            tags.append(RunTag(LIMITED_BY_TAG, limited_by))
        client.log_batch(run_id, metrics=metrics, tags=tags)
        if verify_file is not None and verify_file.is_file():
            client.log_artifact(run_id, str(verify_file), "verify")
        return f"stability logged on the run of trial {trial_id} ({run_id})"

    return log_to_study(tracking_uri, study, "stability", log, no_store_hint=" (pass --tracking-uri)")
