"""How the study looks in the MLflow UI: the experiment's kind, a runs-table view, the parent's description.

Pure: these build the values; :mod:`servetune.tracking.writer` writes them.

- MLflow 3 opens an experiment on its GenAI overview (traces, token usage) unless the
  experiment's ``mlflow.experimentKind`` tag says it holds model-development runs; servetune's
  says so, and the experiment opens on its runs table.
- The runs table's columns live in the browser, but MLflow can load a saved view from an
  experiment tag ``mlflow.sharedViewState.<key>`` when the page is opened with
  ``?viewStateShareKey=<key>``. servetune saves one (:data:`VIEW_KEY`) that lists the trials,
  best goodput first, with the varied parameters and the chosen operating point's metrics as
  columns; the parent run's description links to it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from servetune.metrics import COST_METRIC, GOODPUT, TPOT_P99, TTFT_P99
from servetune.report.build import StudyReport
from servetune.report.labels import point_metrics
from servetune.report.points import level_label
from servetune.tracking.fields import metric_key, short_label

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"  # opens on the runs table, not the GenAI overview
SHARED_VIEW_PREFIX = "mlflow.sharedViewState."
VIEW_KEY = "servetune-trials"
RECOMMENDED_TAG = "servetune.recommended"
#: The chosen operating point's metrics a user compares trials by, in column order.
COMPARED_METRICS = (GOODPUT, TTFT_P99, TPOT_P99, COST_METRIC, "meets_slo")


def _column(kind: str, name: str) -> str:
    """A runs-table column as MLflow's UI names it: ``params.`max_num_seqs```."""
    return f"{kind}.`{name}`"


#: What a trial costs per million tokens at its capacity at the SLO (tracking/fields.py's capacity metrics).
CAPACITY_COST = f"capacity/{COST_METRIC}"
CAPACITY_METRICS = ("capacity", "capacity_lo", "capacity_hi", CAPACITY_COST)


def runs_view(varied: Sequence[str], capacity: bool = False) -> dict[str, object]:
    """The saved view: trial runs only (flat), varied params and compared metrics; cheapest at capacity first
    where trials searched for their capacity at the SLO (``capacity``), else best goodput first."""
    columns = [_column("params", metric_key(name)) for name in varied]
    metrics = (*CAPACITY_METRICS, *COMPARED_METRICS) if capacity else COMPARED_METRICS
    columns += [_column("metrics", name) for name in metrics]
    columns += [_column("tags", "servetune.level"), _column("tags", RECOMMENDED_TAG), _column("tags", "conclusion")]
    return {
        "searchFilter": "tags.`servetune.role` = 'trial'",
        "orderByKey": _column("metrics", CAPACITY_COST if capacity else GOODPUT),
        "orderByAsc": capacity,
        "selectedColumns": columns,
        "runsHiddenMode": "SHOW_ALL",
    }


def runs_view_tag(varied: Sequence[str], capacity: bool = False) -> tuple[str, str]:
    return SHARED_VIEW_PREFIX + VIEW_KEY, json.dumps(runs_view(varied, capacity))


def runs_view_link(experiment_id: str) -> str:
    """The view's address relative to the MLflow UI's root (prefix it with the UI's URL).

    ``workflowType=machine_learning`` is the UI's "Model training" mode: without it a browser
    that never chose opens MLflow 3's GenAI pages, whatever the experiment's kind."""
    return f"#/experiments/{experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={VIEW_KEY}"


def ui_hint(tracking_uri: str, experiment_id: str) -> str:
    """Where a user sees the trials side by side, for this tracking store."""
    link = runs_view_link(experiment_id)
    if tracking_uri.startswith(("http://", "https://")):
        return f"compare the trials at {tracking_uri.rstrip('/')}/{link}"
    return f"compare the trials: mlflow ui --backend-store-uri {tracking_uri}, then open http://127.0.0.1:5000/{link}"


def study_description(report: StudyReport, experiment_id: str) -> str:
    """The parent run's description (Markdown): the recommendation, why, its numbers and how to export it."""
    rec = report.recommendation
    lines = [f"# servetune study {report.info.name}", ""]
    if rec.point is None:
        lines += [f"**No recommendation**: {rec.reason}.", ""]
    else:
        point = rec.point
        lines += [
            f"**Recommended: trial {point.trial_id}** ({short_label(point.params)}) at {level_label(point.level)}.",
            "",
            f"Why: {rec.reason}.",
            "",
            *(f"- {heading}: {value}" for heading, value in point_metrics(point)),
            "",
            f"Its run is tagged `{RECOMMENDED_TAG} = true`. Export it:",
            "",
            f"    servetune export {report.root} --pick best --format vllm     # or ray-serve, json",
            "",
        ]
    counts = ", ".join(f"{n} {name}" for name, n in report.outcome_counts().items() if n)
    lines += [
        f"Trials: {counts or 'none yet'}. Model `{report.model_label}`, workload `{report.info.workload}`, "
        f"search `{report.info.algorithm}`, SLO: {', '.join(f'`{line}`' for line in report.slo) or 'none'}.",
        "",
        f"Compare the trials side by side: open [the trials view]({runs_view_link(experiment_id)}) "
        "(the varied parameters and each trial's chosen operating point as columns). "
        "The full report is in this run's artifacts, under `report/`.",
    ]
    return "\n".join(lines) + "\n"
