"""Ray Tune wiring: resources per trial (one bundle), the search algorithm, the Tuner."""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ray.tune import Callback
from ray.tune.experiment import Trial

from servetune.config.space import SearchSpace
from servetune.device_ledger import give_back
from servetune.study.driver import finished_results, trainable
from servetune.study.nodes import placement_problem_of
from servetune.study.ray_cluster import init_ray  # noqa: F401 - `servetune run` starts Ray through here
from servetune.study.refit import start_study_refit, write_refit
from servetune.study.searcher import ConstrainedOptunaSearch
from servetune.trial.context import StudyContext, bundle


def cluster_devices(space: SearchSpace) -> list[float]:
    """The devices (GPUs, or CPUs for a CPU space) of each live node of the Ray cluster."""
    from servetune.study.nodes import alive_nodes

    return [node.get("GPU" if space.device == "gpu" else "CPU", 0.0) for node in alive_nodes()]


def trial_resources(context: StudyContext, params: dict[str, Any]) -> list[dict[str, float]]:
    """The trial's one bundle; a sliver of the head for a trial no node can hold, which only records
    that it is INFEASIBLE (in Ray's queue it would wait forever)."""
    from servetune.study.nodes import HEAD_SLIVER

    return (
        [dict(HEAD_SLIVER)]
        if placement_problem_of(context, params)
        else [bundle(context.space, params, context.gpu_type(params))]
    )


def run_tuner(context: StudyContext, points: list[dict[str, Any]] | None, searcher: ConstrainedOptunaSearch | None,
              num_samples: int, callbacks: list, max_concurrent: int | None = None) -> None:  # fmt: skip
    """Run the study's trials through Ray Tune; ``max_concurrent`` defaults to the space's, resolved."""
    import ray
    from ray import tune
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback
    from ray.tune.search import ConcurrencyLimiter

    from servetune.study.early_stop import start_finished_points
    from servetune.study.nodes import alive_nodes

    context = dataclasses.replace(context, nodes=tuple(alive_nodes()))
    space = context.space
    if max_concurrent is None:
        from servetune.study.packing import resolve_max_concurrent

        max_concurrent = resolve_max_concurrent(space, cluster_devices(space))
    ledger = None
    if space.through_serve and max_concurrent > 1:  # trials in flight take their devices from the run's ledger
        from servetune.device_ledger import ledger_name, start_ledger
        from servetune.serve.trial import app_name

        ledger_id = ledger_name(space.name)
        context = dataclasses.replace(context, ledger=ledger_id)
        ledger = start_ledger(ledger_id, space.device, space.hardware.devices_per_node)
        spec_of = context.spec_for
        callbacks = [
            *callbacks,
            GiveBack(ledger, lambda params: spec_of(params).trial_id, lambda params: app_name(spec_of(params))),
        ]
    resources = lambda config: tune.PlacementGroupFactory(trial_resources(context, config["params"]))  # noqa: E731
    # Trials stop at levels finished trials dominate: they ask this actor (study/early_stop.py).
    prunes = space.search.estimate.prune and not context.unprune  # pruning reads them too (study/prune.py)
    finished_points = (
        start_finished_points(finished_results(context.study_dir)) if space.stops_when_dominated or prunes else None
    )
    # The estimate's factors, refitted after each completed trial (study/refit.py); later trials are estimated with them.
    study_refit = start_study_refit(
        space.hardware.gpu, space.hardware.gpu_memory_gib, finished_results(context.study_dir), context.workload
    )
    # Tune's own progress.csv and result.json per trial, as it writes by default; not its TensorBoard files, whose
    # logger imports tensorboardX and so torch (about 3.4 s of a core in every `servetune run`) for files that
    # nothing reads: servetune's results are its own result.json and MLflow. TUNE_DISABLE_AUTO_CALLBACK_LOGGERS=0
    # in the environment brings them back.
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    callbacks = [*callbacks, RefitWriter(study_refit, context.study_dir), CSVLoggerCallback(), JsonLoggerCallback()]
    fn = tune.with_resources(
        tune.with_parameters(trainable, context=context, finished_points=finished_points, study_refit=study_refit),
        resources,
    )
    if points is not None:
        param_space = {"params": tune.grid_search(points)}
        tune_config = tune.TuneConfig(num_samples=1, max_concurrent_trials=max_concurrent)
    else:
        assert searcher is not None  # a study runs its points, else its searcher's
        param_space = {}
        limited = ConcurrencyLimiter(searcher, max_concurrent=max_concurrent)
        tune_config = tune.TuneConfig(search_alg=limited, num_samples=num_samples)
    run_config = tune.RunConfig(
        name="tune-" + dt.datetime.now().strftime("%Y%m%d-%H%M%S"),
        storage_path=str(context.study_dir.resolve() / "tune"),
        callbacks=callbacks, verbose=0, failure_config=tune.FailureConfig(max_failures=0),
    )  # fmt: skip
    # Ray 2.60's default reporter prints its "Configuration for experiment" box even at verbose=0;
    # the older one keeps quiet, and servetune shows its own progress.
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    try:
        tune.Tuner(fn, param_space=param_space, tune_config=tune_config, run_config=run_config).fit()
    finally:
        RefitWriter(study_refit, context.study_dir).write()
        for actor in (finished_points, ledger, study_refit):
            if actor is not None:
                ray.kill(actor)


class RefitWriter(Callback):
    """The study's refit factors written to ``estimate_factors.json`` after each trial (study/refit.py)."""

    def __init__(self, study_refit: Any, study_dir: Path) -> None:
        self.study_refit, self.study_dir = study_refit, study_dir

    def write(self) -> None:
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        try:
            write_refit(self.study_dir, ray.get(self.study_refit.record.remote(), timeout=30))
        except (GetTimeoutError, RayError, OSError) as exc:  # a side note of the study: said, never fatal
            print(f"servetune: could not write the refit estimate factors ({type(exc).__name__})", file=sys.stderr)

    def on_trial_complete(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        self.write()


class GiveBack(Callback):
    """The driver's side of the study's device ledger (device_ledger.py): a trial that ended holds nothing. One
    whose process was killed never deleted its Serve application, whose replicas would keep the devices the
    ledger hands on: it is deleted first."""

    def __init__(
        self, ledger: Any, holder_of: Callable[[dict[str, Any]], str], app_of: Callable[[dict[str, Any]], str]
    ) -> None:
        self.ledger, self.holder_of, self.app_of = ledger, holder_of, app_of

    def on_trial_complete(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        give_back(self.ledger, self.holder_of(trial.config.get("params", {})))

    def on_trial_error(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        from servetune.serve.trial import delete_left_app

        params = trial.config.get("params", {})
        delete_left_app(self.app_of(params))
        give_back(self.ledger, self.holder_of(params))
