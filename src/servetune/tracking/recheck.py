"""A re-check (``servetune recheck``) as an MLflow run of its own in the study's experiment.

The run is tagged ``servetune.role`` = ``recheck``, with the re-checked trial (``recheck.trial_id``;
``servetune.trial_id`` names the trial's own run), the two vLLM versions (``recheck.vllm_before``,
``recheck.vllm_after``), the verdict (``recheck.verdict``) and the SLO at the shipped level (``recheck.slo_after``).
Its metrics are the re-measured values at each load both measured (``recheck.<metric>.<level>``, e.g.
``recheck.ttft_ms_p99.concurrency_8``, with its relative change as ``....change``) and the capacity at the SLO
(``recheck.capacity_at_slo``); the recheck file is its artifact. MLflow being unreachable, or the study never logged
there, is one line: the recheck file holds everything either way. A paired recheck (``--paired``) is logged
the same way by :func:`log_paired`, with names of its own (``recheck.mode`` = ``paired``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from servetune.tracking.connection import log_to_study
from servetune.tracking.writer import ROLE_TAG, RUN_NAME_TAG, STUDY_TAG

if TYPE_CHECKING:
    from mlflow import MlflowClient

RECHECK_ROLE = "recheck"


def recheck_metrics(doc: Mapping[str, Any]) -> dict[str, float]:
    """The numbers to log: each compared metric at each load both measured (``recheck.ttft_ms_p99.concurrency_8``)
    and its relative change (``....change``), and the capacity at the SLO."""
    out: dict[str, float] = {}
    for change in doc.get("changes") or []:
        where = "_".join(f"{kind}_{value:g}" for kind, value in change["level"].items())
        out[f"recheck.{change['metric']}.{where}"] = float(change["after"])
        out[f"recheck.{change['metric']}.{where}.change"] = float(change["change"])
    if isinstance(doc.get("capacity_after"), (int, float)):
        out["recheck.capacity_at_slo"] = float(doc["capacity_after"])
    return out


def recheck_tags(doc: Mapping[str, Any]) -> dict[str, str]:
    return {
        ROLE_TAG: RECHECK_ROLE,
        STUDY_TAG: str(doc.get("study")),
        "recheck.trial_id": str(doc.get("trial_id")),  # not servetune.trial_id: that finds the trial's own run
        "recheck.vllm_before": str(doc.get("vllm_before")),
        "recheck.vllm_after": str(doc.get("vllm_after")),
        "recheck.verdict": str(doc.get("verdict")),
        "recheck.slo_after": {True: "met", False: "broken", None: "not measured"}[doc.get("slo_after")],
        RUN_NAME_TAG: f"recheck {doc.get('trial_id')} on {doc.get('vllm_after')}",
    }


def log_recheck(tracking_uri: str, doc: Mapping[str, Any], recheck_file: Path | None = None) -> str:
    """Log the re-check as a run of the study's experiment; returns one line saying what happened (never raises)."""
    values = [(k, v, 0) for k, v in recheck_metrics(doc).items()]
    return _log_run(tracking_uri, str(doc.get("study")), "recheck", recheck_tags(doc), values, recheck_file)


def _log_run(tracking_uri: str, study: str, what: str, tags: Mapping[str, str],
             values: list[tuple[str, float, int]], artifact: Path | None) -> str:  # fmt: skip
    """One finished run of the study's experiment: ``tags``, ``values`` as (name, value, step) metrics, ``artifact``
    attached where it exists; one line back, never raises (:func:`log_to_study`)."""

    def log(client: MlflowClient, experiment_id: str) -> str:
        from mlflow.entities import Metric

        run = client.create_run(experiment_id, tags=dict(tags))
        stamp = int(time.time() * 1000)
        client.log_batch(run.info.run_id, metrics=[Metric(k, v, stamp, step) for k, v, step in values])
        if artifact is not None and artifact.is_file():
            client.log_artifact(run.info.run_id, str(artifact), RECHECK_ROLE)
        client.set_terminated(run.info.run_id)
        return f"{what} logged as run {run.info.run_id} of experiment '{study}'"

    return log_to_study(tracking_uri, study, what, log)


def paired_metrics(doc: Mapping[str, Any]) -> dict[str, float]:
    """A paired recheck's numbers: per metric, B against A (``paired.goodput.change``) and the paired noise."""
    out: dict[str, float] = {}
    for m in doc.get("metrics") or []:
        out[f"paired.{m['metric']}.change"] = float(m["change"])
        out[f"paired.{m['metric']}.noise"] = float(m["noise"])
    return out


def log_paired(tracking_uri: str, doc: Mapping[str, Any], paired_file: Path | None = None) -> str:
    """Log a paired recheck (verify/paired.py) as a run of the study's experiment, tagged as a recheck with
    ``recheck.mode`` = ``paired``, the two trials and the verdict; each round's values of A and B as steps of
    ``paired.<metric>.a`` / ``.b``. One line back, never raises."""
    study = str(doc.get("study"))
    tags = {ROLE_TAG: RECHECK_ROLE, STUDY_TAG: study, "recheck.mode": "paired",
            "recheck.trial_id": str(doc.get("a_trial_id")), "recheck.against": str(doc.get("b_trial_id")),
            "recheck.verdict": str(doc.get("verdict")), "recheck.vllm_after": str(doc.get("vllm")),
            RUN_NAME_TAG: f"paired {doc.get('a_trial_id')} vs {doc.get('b_trial_id')} on {doc.get('vllm')}"}  # fmt: skip
    values = [(k, v, 0) for k, v in paired_metrics(doc).items()]
    for one in doc.get("rounds") or []:
        for side in ("a", "b"):
            values += [(f"paired.{name}.{side}", float(value), int(one["round"])) for name, value in one[side].items()]
    return _log_run(tracking_uri, study, "paired recheck", tags, values, paired_file)
