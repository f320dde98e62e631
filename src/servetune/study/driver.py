"""The study driver: the trainable a trial runs on its node, and the study directory it is kept in.

Trials are keyed by a hash of their resolved configuration: a trial whose ``result.json`` exists is
never run again, so ``--resume`` after a killed driver re-runs only what is missing. The trainable's
final report, and the driver's copy of the trial's files, are study/mirror.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from servetune import __version__
from servetune.config.quality import LM_EVAL_PREFIX
from servetune.config.space import MODEL_PARAM, SearchSpace
from servetune.errors import UserError
from servetune.report.params import config_label
from servetune.results import (
    REFERENCE_FILE,
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
from servetune.study.mirror import FETCH_KEY, FILES_KEY, carried_files, final_report
from servetune.study.packing import order_for_packing
from servetune.study.searcher import PROPOSED_KEY, ConstrainedOptunaSearch
from servetune.trial.context import StudyContext
from servetune.trial.runner import new_result, write_atomic


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
    the final report (study/mirror.py: :func:`carried_files`, :class:`ResultMirror`).
    """
    return Path.cwd() / "servetune"


def pruned(spec: Any, context: StudyContext, finished_points: Any, study_refit: Any,
           timeout_s: float = 60.0) -> TrialResult | None:  # fmt: skip
    """PRUNED before anything starts, when the estimate rules the trial out beyond its error (study/prune.py); None
    to run it: the estimate cannot, or the study's actors did not answer (pruning saves time, it is never needed).
    ``timeout_s`` bounds the wait for the actors: their first answer waits for Ray to start their worker processes,
    which took over 10 s (the bound before) on a two-core host shared by two test processes and other jobs, and the
    trial then ran unpruned; a minute is still short of the engine start a pruned trial saves."""
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
        space_file=str(space_path.resolve()), model=model,
        workload=space.workload if isinstance(space.workload, str) else space.workload.name,
        device=space.device, algorithm=space.search.algorithm,
        objectives=[(o.metric, o.mode) for o in space.search.objectives],
        slo=[str(b) for b in space.slo_bounds.bounds], slo_bounds=list(space.slo_bounds.bounds),
        price_per_device_hour=space.price_per_device_hour if space.device == "cpu" else space.pricing.fixed,
        price_list=space.price_list, prices=space.prices, servetune_version=__version__,
        levels=[str(lv) for lv in levels], tracking_uri=tracking_uri,
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
