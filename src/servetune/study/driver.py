"""The study driver: resolve the space, build the Ray Tune ``Tuner``, run it, summarize.

Trials are keyed by a hash of their resolved configuration: a trial whose ``result.json``
exists is never run again, so ``--resume`` after a killed driver re-runs only what is missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ray.tune import Callback

from servetune import __version__
from servetune.config.quality import LM_EVAL_PREFIX
from servetune.config.space import MODEL_PARAM, SearchSpace
from servetune.errors import UserError
from servetune.report.params import config_label
from servetune.results import (
    ENGINE_LOG,
    LM_EVAL_RESULTS_FILE,
    QUALITY_FILE,
    REFERENCE_FILE,
    REQUESTS_FILE,
    RESULT_FILE,
    SCHEMA_VERSION,
    SPACE_FILE,
    STUDY_FILE,
    TRIALS_DIR,
    ReferenceAnswers,
    StudyInfo,
    TrialResult,
    read_model,
    read_result,
)
from servetune.study.objectives import objectives_and_constraints
from servetune.study.packing import order_for_packing
from servetune.study.searcher import (
    CONSTRAINTS_KEY,
    FAILURE_KEY,
    OBJECTIVES_KEY,
    PROPOSED_KEY,
    ConstrainedOptunaSearch,
)
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


def trainable(
    config: dict[str, Any], context: StudyContext, finished_points: Any = None, study_refit: Any = None
) -> None:
    """The Ray Tune function trainable: one trial on the resources Tune reserved for it.

    ``finished_points``: the study's :class:`~servetune.study.early_stop.FinishedPoints` actor
    when trials stop at levels finished trials dominate; the trial adds its own points to it.
    ``study_refit``: the study's :class:`~servetune.study.refit.StudyRefit` actor: the trial's levels
    are estimated with its factors, and the trial adds its own levels to it.
    With ``search.estimate.prune`` (and not ``--unprune``), a trial the estimate rules out is recorded PRUNED
    before any engine starts (:func:`pruned`, study/prune.py), judged against both actors' data.
    """
    import ray
    from ray import tune

    from servetune.load.requests import PromptFactory
    from servetune.load.tokenizer import load_tokenizer
    from servetune.study.early_stop import dominance_rule
    from servetune.study.nodes import placement_problem_of
    from servetune.trial.failures import retries_elsewhere
    from servetune.trial.runner import EngineFactory, fits, load_result, run_trial, vllm_engine

    normal_priority()
    context = dataclasses.replace(context, study_dir=node_local_dir())  # trials write only on their own node
    gpu_ids = [str(g) for g in ray.get_gpu_ids()] if context.space.device == "gpu" else None
    spec = context.spec_for(config["params"], gpu_ids, node_id=ray.get_runtime_context().get_node_id())
    result = load_result(spec.trial_dir)
    if result is not None and result.outcome == "PRUNED" and context.unprune:  # --resume --unprune: measure it now
        result = None
    carried: dict[str, str] | None = None  # the files of a retry on another node, picked there
    fetched: dict[str, Any] = {}
    problem = placement_problem_of(context, config["params"])
    if study_refit is not None and result is None and not problem:
        from servetune.study.refit import refit_for_trial

        spec = dataclasses.replace(spec, estimate_efficiency=refit_for_trial(study_refit))
    if result is None and problem:  # no node can hold it: it holds a sliver of the head, to say so
        result = unplaceable(spec, problem)
    if result is None and context.space.search.estimate.prune and not context.unprune:
        result = pruned(spec, context, finished_points, study_refit)  # None: the estimate cannot rule it out
    if result is None:  # never measured (or --resume after a kill): run it
        stops = finished_points is not None and context.space.stops_when_dominated
        rule = dominance_rule(finished_points) if stops else None
        engine: EngineFactory = vllm_engine
        held: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if spec.serve_replicas is not None:
            from servetune.device_ledger import devices_held, replica_share
            from servetune.serve.trial import ServeEngine

            engine = ServeEngine

            if fits(spec):  # one the capacity check rejects is rejected in seconds, without waiting for devices
                held = devices_held(
                    context.ledger, spec.trial_id, *replica_share(spec)
                )  # trials in flight share no device
        with held:
            result = run_trial(
                spec, tune.report, lambda: PromptFactory(load_tokenizer(spec.tokenizer)), stop_rule=rule, engine=engine
            )
        if spec.serve_replicas is None and retries_elsewhere(result):  # the node's fault: once more, on another node
            from servetune.study.elsewhere import run_elsewhere
            from servetune.trial.context import bundle

            trial_bundle = bundle(context.space, config["params"], context.gpu_type(config["params"]))
            result, carried, fetched = run_elsewhere(context, config["params"], [trial_bundle], result,
                                                     carried_files, normal_priority)  # fmt: skip
        if config.get(PROPOSED_KEY):  # the estimate seeded the search with it (study/forecast.py)
            result.proposed_by = str(config[PROPOSED_KEY])
            write_atomic(spec.trial_dir / RESULT_FILE, result.model_dump_json(indent=2) + "\n")
        if finished_points is not None:  # before the final report: trials that start next see it
            ray.wait([finished_points.add.remote(result)], timeout=10)
        if study_refit is not None:  # likewise: the refit is written once Tune has the final report
            ray.wait([study_refit.add.remote(result)], timeout=60)
    inline, fetch = (carried, fetched) if carried is not None else carried_files(spec.trial_dir, spec.node_id)
    tune.report({**final_report(result, context), FILES_KEY: json.dumps(inline), FETCH_KEY: json.dumps(fetch)})


def node_local_dir() -> Path:
    """Where a trial writes its files: Tune's working directory for it, on its own node.

    Tune runs each trial in ``<node's Ray temp dir>/session_*/artifacts/.../working_dirs/<trial>``
    (unless ``RAY_CHDIR_TO_TRIAL_DIR=0``: then the job's working directory, local too). Nothing
    is written to the driver's study directory from a node: what the driver needs comes back in
    the final report (:func:`carried_files`, :class:`ResultMirror`).
    """
    return Path.cwd() / "servetune"


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


def pruned(spec: Any, context: StudyContext, finished_points: Any, study_refit: Any,
           timeout_s: float = 10.0) -> TrialResult | None:  # fmt: skip
    """PRUNED before anything starts, when the estimate rules the trial out beyond its error (study/prune.py); None
    to run it: the estimate cannot, or the study's actors did not answer (pruning saves time, it is never needed)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    from servetune.config.workload import mean_lengths
    from servetune.study.forecast import forecast
    from servetune.study.prune import error_margins, judge_prune, prune_reason, shipped_error, study_errors

    forecasts = forecast(spec, mean_lengths(context.workload), spec.estimate_efficiency)
    if isinstance(forecasts, str):
        return None
    try:
        finished = ray.get(finished_points.points.remote(), timeout=timeout_s) if finished_points is not None else []
        errors = ray.get(study_refit.errors.remote(), timeout=timeout_s) if study_refit is not None else []
    except (GetTimeoutError, RayError):
        return None
    margins, source = error_margins(shipped_error(spec.device), study_errors(errors))
    record = judge_prune(forecasts, context.space.slo_bounds, margins, finished, spec.price_per_device_hour,
                         spec.devices, trial_id=spec.trial_id, error_source=source,
                         factors="shipped" if spec.estimate_efficiency is None else "refit")  # fmt: skip
    if record is None:
        return None
    result = new_result(spec, "PRUNED", prune_reason(record))
    result.pruned, result.finished_at = record, result.started_at
    spec.trial_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(spec.trial_dir / RESULT_FILE, result.model_dump_json(indent=2) + "\n")
    return result


def pruned_points(results: Sequence[TrialResult], context: StudyContext) -> list[dict[str, Any]]:
    """The params of the trials still PRUNED (``run --resume --unprune``), those the space still names as they were
    recorded (a trial of a space changed since has another id: it is not the pruned one)."""
    return [r.params for r in results if r.outcome == "PRUNED" and context.spec_for(r.params).trial_id == r.trial_id]


def unplaceable(spec: Any, problem: str) -> TrialResult:
    """INFEASIBLE before anything starts: no node of the cluster can hold the trial's bundle."""
    result = new_result(spec, "INFEASIBLE", f"placement: {problem}")
    result.finished_at = result.started_at
    spec.trial_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(spec.trial_dir / RESULT_FILE, result.model_dump_json(indent=2) + "\n")
    return result


def normal_priority() -> int:
    """Undo Ray's worker niceness (15) for this trial's thread, where permitted; the niceness now.

    The engine and the load client inherit it. At niceness 15 they lose the CPU to anything at
    0 (the driver, Ray's own daemons) for as long as it runs: on the CPU stand-in that showed as
    both requests in flight stalling together for 0.2-0.8 s, and most trials breaking a TTFT P95
    bound they met between stalls. Linux niceness is per thread: this sets the calling one's.
    """
    # Lowering niceness needs CAP_SYS_NICE (a PermissionError); the environment record says what it was.
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    return os.getpriority(os.PRIO_PROCESS, 0)


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

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
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

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        files = json.loads(result.pop(FILES_KEY, None) or "{}")
        fetch = json.loads(result.pop(FETCH_KEY, None) or "{}")
        if result.get(RESULT_KEY):
            self._write(result["servetune_trial_id"], result[RESULT_KEY], files, fetch)

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
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


def resolve_model(space: SearchSpace, study_dir: Path, space_dir: Path) -> str:
    """The space's model as trials load it: a directory (the tiny model built here) or a hub id."""
    return _resolve(space.model, study_dir, space_dir, "model")


def resolve_models(space: SearchSpace, study_dir: Path, space_dir: Path) -> dict[str, str]:
    """Each checkpoint the ``model`` parameter lists, as trials load it (empty without one)."""
    values = space.params.get(MODEL_PARAM) or []
    assert isinstance(values, list)  # the space's validator takes only a list of checkpoints
    return {name: _resolve(name, study_dir, space_dir, f"params.{MODEL_PARAM}") for name in values}


def _resolve(name: str, study_dir: Path, space_dir: Path, field: str) -> str:
    if name == "tiny":
        from servetune.models.tiny import build_tiny_model

        return str(build_tiny_model(study_dir / "models" / "tiny").resolve())
    path = Path(name).expanduser()
    if not path.is_absolute() and (space_dir / path).exists():
        path = space_dir / path
    if path.exists():
        return str(path.resolve())
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise UserError(f"{field}: '{name}' is neither a directory nor a hub id (org/name)")
    return name  # a hub id: vLLM and the tokenizer fetch it on the cluster


def proposals(space: SearchSpace, max_trials: int | None) -> list[dict[str, Any]]:
    """The configurations grid and random search run, in order.

    One at a time: the baseline first, then the grid's order (random search: the order drawn,
    see :func:`random_points`). Several at a time: smallest
    trials first, in groups that fill a node (study/packing.py), the order Ray places them in
    anyway; the largest come last, where they fill nodes among themselves.
    """
    kept, _ = space.grid() if space.search.algorithm == "grid" else (random_points(space), [])
    points: list[dict[str, Any]] = (space.baselines() if space.search.baseline else []) + kept
    limit = (
        max_trials or (space.search.num_trials if space.search.algorithm != "grid" else None) or space.search.num_trials
    )
    points = points[:limit] if limit else points
    if packs(space):
        points = order_for_packing(points, space.devices, space.hardware.devices_per_node)
    return points


def packs(space: SearchSpace) -> bool:
    """Whether several trials may run at once (``auto`` is one at a time on CPU)."""
    concurrent = space.search.max_concurrent
    return (concurrent == "auto" and space.device == "gpu") or (isinstance(concurrent, int) and concurrent > 1)


def random_points(space: SearchSpace) -> list[dict[str, Any]]:
    """Random search's points: ``num_trials`` (10 if unset) distinct points, in the order drawn.

    Drawn by Optuna's ``RandomSampler`` (seeded with ``search.seed``) through the study's
    searcher, all asked before any result comes back, as they run: none breaks the space's
    constraints, none repeats a point; fewer when the space has fewer points.
    """
    searcher = ConstrainedOptunaSearch(space, baseline=False)
    points: list[dict[str, Any]] = []
    for number in range(space.search.num_trials or 10):
        suggestion = searcher.suggest(f"random-{number}")
        if not isinstance(suggestion, dict):  # None or FINISHED
            break
        points.append(suggestion["params"])
    return points


def study_info(
    space: SearchSpace, space_path: Path, model: str, levels: Sequence[object] = (), tracking_uri: str | None = None
) -> StudyInfo:
    return StudyInfo(
        schema_version=SCHEMA_VERSION, name=space.name,
        created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        space_file=str(space_path), model=model,
        workload=space.workload if isinstance(space.workload, str) else space.workload.name,
        device=space.device, algorithm=space.search.algorithm,
        objectives=[(o.metric, o.mode) for o in space.search.objectives],
        slo=[str(b) for b in space.slo_bounds.bounds], slo_bounds=list(space.slo_bounds.bounds),
        price_per_device_hour=space.price_per_device_hour,
        servetune_version=__version__, levels=[str(lv) for lv in levels], tracking_uri=tracking_uri,
    )  # fmt: skip


def finished_results(study_dir: Path) -> list[TrialResult]:
    """Every finished trial of the study. An invalid ``result.json`` is a one-line error naming it, so
    ``--resume`` stops before starting anything rather than failing at the end of the study."""
    out = []
    for trial_dir in sorted(p for p in (study_dir / TRIALS_DIR).glob("*") if p.is_dir() and not p.name.startswith(".")):
        try:
            result = read_result(trial_dir)
        except UserError as exc:
            raise UserError(f"{exc} (remove {trial_dir} to run that trial again)") from None
        if result is not None:
            out.append(result)
    return out


def prepare_study_dir(study_dir: Path, space_path: Path, resume: bool) -> None:
    existing = finished_results(study_dir)
    if existing and not resume:
        raise UserError(
            f"{study_dir} already holds {len(existing)} finished trials: pass --resume to continue that study, or choose another --storage"
        )
    (study_dir / TRIALS_DIR).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(space_path, study_dir / SPACE_FILE)


def read_reference(study_dir: Path, params: dict[str, Any], trial_id: str | None = None) -> ReferenceAnswers | None:
    """The answers the study kept for the quality reference ``params`` (None before it ran, or
    when the space now names another reference: that one runs first). With ``trial_id``, the
    reference trial as the probe is now (its id covers the suites, lm-eval tasks and bounds): a
    probe that changed since, a suite added say, has the reference answer it again."""
    path = study_dir / REFERENCE_FILE
    kept = read_model(path, ReferenceAnswers) if path.exists() else None
    if kept is None or kept.params != params or (trial_id is not None and kept.trial_id != trial_id):
        return None
    return kept


def keep_reference(context: StudyContext) -> StudyContext:
    """After the reference trial: keep its answers with the study and hand them to every later trial.

    A reference that did not answer (it failed to start, or its probe failed) leaves nothing to
    compare with: a :class:`UserError` that says why.
    """
    assert context.quality is not None
    params = context.quality.reference_params
    result = read_result(context.spec_for(params).trial_dir)
    answers = result.quality.reference_answers if result is not None and result.quality is not None else None
    if answers is None or (not answers.continuations and not answers.scores):
        why = "it did not run" if result is None else (result.reason or "its probe answered nothing")
        if result is not None and result.quality is not None and result.quality.errors:
            why += f" ({result.quality.errors[0]})"
        raise UserError(f"quality: the reference trial ({config_label(params)}) gave no answers to compare with: {why}")
    unscored = [
        name for name in context.quality.bounds if name.startswith(LM_EVAL_PREFIX) and name not in answers.scores
    ]
    if unscored:  # lm-eval failed on the reference (no task data on the node, a timeout): every trial would fail it
        errors = result.quality.errors if result is not None and result.quality is not None else []
        why = next((e for e in errors if e.startswith("lm-eval")), "no score")
        raise UserError(
            f"quality: the reference trial ({config_label(params)}) has no {unscored[0]} score to compare with: {why}"
        )
    path = context.study_dir / REFERENCE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, answers.model_dump_json(indent=1) + "\n")
    return dataclasses.replace(context, quality=context.quality.model_copy(update={"reference": answers}))


def write_study_info(study_dir: Path, info: StudyInfo) -> None:
    (study_dir / STUDY_FILE).write_text(info.model_dump_json(indent=2) + "\n")
