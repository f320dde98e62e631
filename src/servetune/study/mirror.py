"""What a trial carries back to the driver, and the driver's copy of it.

A trial writes its directory on the node that ran it; the nodes share no disk. Its final report
(:func:`final_report`) carries ``result.json`` and, under ``FILES_KEY``, the files the driver keeps
(:func:`carried_files`); those too large to ride in a report are fetched from the node
(:func:`fetch_from_node`). :class:`ResultMirror`, a Tune callback on the driver, writes them into the
study directory, and records a trial whose process or node died as FAILED.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from ray.tune import Callback

from servetune.results import (
    ENGINE_LOG,
    LM_EVAL_RESULTS_FILE,
    QUALITY_FILE,
    REQUESTS_FILE,
    RESULT_FILE,
    TrialResult,
    read_result,
)
from servetune.study.objectives import objectives_and_constraints
from servetune.study.searcher import CONSTRAINTS_KEY, FAILURE_KEY, OBJECTIVES_KEY
from servetune.trial.context import StudyContext
from servetune.trial.runner import new_result, write_atomic, write_bytes_atomic

RESULT_KEY = "servetune_result"
#: The trial's files, carried to the driver in its final report (a JSON object: file name -> text).
FILES_KEY = "servetune_files"
#: How much of a trial's engine log comes back to the driver: its end, where a failure shows.
ENGINE_LOG_CARRIED = 1 << 20
#: A carried file larger than this does not ride in the report (Tune passes every report through its result
#: pipeline, and an offline-batch trial's per-request records run to hundreds of MB): the report names it, and the
#: driver fetches it from the trial's node as the file it is (:func:`fetch_from_node`).
INLINE_LIMIT = 1 << 20
#: The files the driver fetches: a JSON object ``{"node_id": ..., "files": {name: path on that node}}``.
FETCH_KEY = "servetune_fetch"
#: The trial's files that come back to the driver whole (carried in the report, or fetched past INLINE_LIMIT).
CARRIED_WHOLE = (REQUESTS_FILE, QUALITY_FILE, LM_EVAL_RESULTS_FILE)


def carried_files(trial_dir: Path, node_id: str | None = None) -> tuple[dict[str, str], dict[str, Any]]:
    """The trial's files the driver keeps: the per-request records, the quality probe's answers and lm-eval's
    results whole, the engine log's last ``ENGINE_LOG_CARRIED`` bytes. Those up to ``INLINE_LIMIT`` as text to carry
    in the report; larger ones (given the trial's Ray node) as paths for the driver to fetch (``FETCH_KEY``)."""
    files: dict[str, str] = {}
    fetch: dict[str, str] = {}
    for name in CARRIED_WHOLE:
        path = trial_dir / name
        if not path.exists():
            continue
        if node_id is not None and path.stat().st_size > INLINE_LIMIT:
            fetch[name] = str(path.resolve())
        else:
            files[name] = path.read_text(errors="replace")
    log = trial_dir / ENGINE_LOG
    if log.exists():
        with log.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(size - ENGINE_LOG_CARRIED, 0))
            text = f.read().decode(errors="replace")
        files[ENGINE_LOG] = (
            text
            if size <= ENGINE_LOG_CARRIED
            else f"[servetune: the engine log's last {ENGINE_LOG_CARRIED} of {size} bytes]\n" + text
        )
    return files, ({"node_id": node_id, "files": fetch} if fetch else {})


def fetch_from_node(node_id: str, paths: dict[str, str], timeout_s: float = 600.0) -> dict[str, bytes]:
    """The named files of a trial's node, read there by a Ray task pinned to it and sent through Ray's object
    store (zlib-compressed: per-request records shrink about tenfold), not through Tune's results."""
    import zlib

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0, max_retries=0)
    def read(named: dict[str, str]) -> dict[str, bytes]:
        return {name: zlib.compress(Path(path).read_bytes(), 1) for name, path in named.items()}

    task = read.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
    return {name: zlib.decompress(blob) for name, blob in ray.get(task.remote(paths), timeout=timeout_s).items()}


def final_report(result: TrialResult, context: StudyContext) -> dict[str, Any]:
    values, constraints = objectives_and_constraints(result, context.space.search.objectives, context.space.slo_bounds,
                                                    context.space.quality_bounds)  # fmt: skip
    best = result.best
    report: dict[str, Any] = {
        "servetune_trial_id": result.trial_id, "outcome": result.outcome, "reason": result.reason or "",
        "levels_run": len(result.levels), "meets_slo": best is not None,
        OBJECTIVES_KEY: json.dumps(values), CONSTRAINTS_KEY: json.dumps(constraints),
        RESULT_KEY: result.model_dump_json(),  # the driver keeps a copy: nodes need not share a disk
    }  # fmt: skip
    if best is not None:
        report.update({f"best_{k}": v for k, v in best.metrics.items()})
    if result.quality is not None:
        report["quality_passed"] = bool(result.quality.passed)
    if result.failure is not None:  # the searcher learns nothing from a failure that was not the configuration's
        report[FAILURE_KEY] = result.failure.kind
    return report


class ResultMirror(Callback):
    """Writes every trial's files into the driver's study directory, the only one read after.

    A trial writes its directory on the node that ran it (:func:`node_local_dir`); the nodes
    share no disk. Its final report carries ``result.json``, ``requests.jsonl``,
    ``quality.jsonl`` and the engine log's end (``FILES_KEY``), which are written here, the
    result last (a result on disk means the trial finished). ``FILES_KEY`` is taken out of the
    report, so Tune's own loggers do not copy the records again. A trial whose process or node
    died never reports: it is recorded here as FAILED with Ray's reason, and ``lost`` (``--resume``
    runs it again). Runs before the other callbacks (MLflow's reads what this wrote); never
    overwrites a result but a lost one.
    """

    def __init__(self, context: StudyContext, node_death_wait_s: float = 60.0) -> None:
        self.context = context
        self.node_death_wait_s = node_death_wait_s  # Ray's health check declares a silent node dead in about 30 s
        self._actors: dict[str, str] = {}  # Tune's trial id -> the id of the Ray actor that runs it

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        actor = getattr(getattr(trial, "temporary_state", None), "ray_actor", None)
        actor_id = getattr(actor, "_actor_id", None)
        if actor_id is not None:
            self._actors[trial.trial_id] = actor_id.hex()

    def _write(
        self, trial_id: str, text: str, files: dict[str, str] | None = None, fetch: dict[str, Any] | None = None
    ) -> None:
        trial_dir = self.context.trials_dir / trial_id
        kept = read_result(trial_dir) if (trial_dir / RESULT_FILE).exists() else None
        # a lost trial's record gives way to the run that replaced it, a pruned one to its measurement (--unprune)
        if kept is None or kept.runs_again or (kept.outcome == "PRUNED" and not _pruned(text)):
            trial_dir.mkdir(parents=True, exist_ok=True)
            for name, content in (files or {}).items():
                if name in (*CARRIED_WHOLE, ENGINE_LOG):  # names this driver chose, never a path
                    write_atomic(trial_dir / name, content)
            if fetch and fetch.get("files"):
                named = {n: p for n, p in fetch["files"].items() if n in CARRIED_WHOLE}
                try:
                    for name, content_bytes in fetch_from_node(fetch["node_id"], named).items():
                        write_bytes_atomic(trial_dir / name, content_bytes)
                except Exception as exc:  # the node went away since it reported: the result is kept all the same
                    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    print(f"servetune: trial {trial_id}: could not fetch {', '.join(named)} from its node ({first})",
                          file=sys.stderr)  # fmt: skip
            write_atomic(trial_dir / RESULT_FILE, text)

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict[str, Any], **info: Any) -> None:
        files = json.loads(result.pop(FILES_KEY, None) or "{}")
        fetch = json.loads(result.pop(FETCH_KEY, None) or "{}")
        if result.get(RESULT_KEY):
            self._write(result["servetune_trial_id"], result[RESULT_KEY], files, fetch)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        spec = self.context.spec_for(trial.config.get("params", {}))
        error = _ray_error(trial)
        node = dead_node_of(self._actors.get(trial.trial_id), self.node_death_wait_s)
        if node is not None:
            reason = f"the trial's node died while it ran (node {node[:12]}; Ray: {error})"
        elif _node_died(error):
            reason = f"the trial's node died while it ran ({error})"
        else:
            reason = f"the trial's process died before it finished ({error})"
        failed = new_result(spec, "FAILED", reason)
        failed.finished_at, failed.lost = failed.started_at, True
        self._write(spec.trial_id, failed.model_dump_json(indent=2) + "\n")


def _pruned(text: str) -> bool:
    """Whether a reported result.json is a PRUNED record."""
    try:
        return json.loads(text).get("outcome") == "PRUNED"
    except ValueError:
        return False


def dead_node_of(actor_id: str | None, wait_s: float) -> str | None:
    """The id of the node the trial's actor ran on, if that node is dead (waiting up to ``wait_s``
    for Ray to declare it so); None when it lives, or when Ray cannot tell."""
    if actor_id is None:
        return None
    import time

    import ray

    try:
        node_id = ray._private.state.actors(actor_id)["Address"]["NodeID"]  # GCS's actor table (no dashboard needed)
    except Exception:  # an unknown actor, or Ray's private API changed: the error text decides
        return None
    deadline = time.monotonic() + wait_s
    while True:
        alive = {n["NodeID"]: n.get("Alive") for n in ray.nodes()}
        if not alive.get(node_id, False):
            return node_id
        if time.monotonic() >= deadline:
            return None
        time.sleep(1.0)


def _node_died(error: str) -> bool:
    """Whether Ray's error says the node under the trial went away (``NodeDiedError``, or an
    actor that died with its node)."""
    lowered = error.lower()
    return any(words in lowered for words in ("nodediederror", "node has died", "node died")) or (
        "raylet" in lowered and "died" in lowered
    )


def _ray_error(trial: Any) -> str:
    """The last line of the error Ray recorded for a trial, if it wrote one."""
    path = getattr(trial, "error_file", None)
    try:
        lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()] if path else []
    except OSError:
        lines = []
    return lines[-1].strip()[:300] if lines else "no error recorded by Ray"
