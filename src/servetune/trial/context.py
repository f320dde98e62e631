"""Everything the driver resolves once and every trial needs (picklable, shipped to workers).

It sits beside the trial runner, under every room that builds a trial's spec from a study: the study's
driver, ``verify`` (a chosen trial started again) and ``serve-check`` (the study's levels).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servetune.capacity.hardware import ACCELERATOR, gpu_types, ray_accelerator_type
from servetune.capacity.startup import StartupBudget, startup_budget, unsized
from servetune.config.adapters import adapter_modules, lora_engine_args
from servetune.config.space import MODEL_PARAM, SearchSpace
from servetune.config.workload import Workload
from servetune.engine.compile_cache import compile_cache_env
from servetune.load.runner import Level, workload_levels
from servetune.quality.probe import QualityPlan
from servetune.trial.runner import TrialSpec


@dataclass(frozen=True)
class StudyContext:
    space: SearchSpace
    workload: Workload
    study_dir: Path
    model: str  # resolved: a directory or a hub id
    levels: tuple[Level, ...]
    python: str = sys.executable
    quality: QualityPlan | None = None  # the probe every trial runs, with the reference's answers once known
    models: dict[str, str] = field(default_factory=dict)  # the ``model`` parameter's checkpoints, resolved
    # each live node's resources when the trials were proposed (study/nodes.py placement_problem_of)
    nodes: tuple[dict[str, float], ...] = ()
    ledger: str | None = (
        None  # the run's device ledger, when trials through Serve run several at once (device_ledger.py)
    )
    unprune: bool = False  # ``run --resume --unprune``: measure the PRUNED trials, prune none
    # the workload's LoRA adapters, name -> directory (config/adapters.py adapter_modules); None: resolved (the tiny
    # adapter built into the study) when a trial's spec is made
    adapters: dict[str, str] | None = None

    def gpu_type(self, params: dict[str, Any]) -> str | None:
        """The Ray accelerator type a trial of ``params`` is pinned to (:func:`pinned_gpu_type`), from the nodes known."""
        return pinned_gpu_type(self.space, self.nodes, params)

    @property
    def trials_dir(self) -> Path:
        return self.study_dir / "trials"

    def spec_for(
        self, params: dict[str, Any], gpu_ids: list[str] | None = None, node_id: str | None = None
    ) -> TrialSpec:
        space = self.space
        engine_args, env = space.engine_params(params)
        engine_args = self._with_adapters(engine_args)
        devices = space.devices(params)
        extra_env: dict[str, str] = {}
        if space.device == "gpu":
            if gpu_ids:
                extra_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
            if devices > 1:
                engine_args.setdefault("distributed_executor_backend", "mp")
        # On the CPU build each rank is bound to a core of its own when the engine starts (engine/cores.py: the
        # first free cores of the host, so trials side by side never share one); a Serve replica claims its own.
        extra_env.update(compile_cache_env(env))  # the node's trials share vLLM's compile cache, safely
        extra_env.update(compile_threads_env(space, params, env))
        load = space.load
        model = (
            self.models.get(space.model_for(params), space.model_for(params)) if MODEL_PARAM in params else self.model
        )
        budget = startup_budget_for(space, params, model)
        pricing = space.pricing
        # its type's price (the list's, or the space's own): what its estimates are costed at before it runs, as
        # its result will be (trial/precheck.py price_trial), not the space's fallback
        price = pricing.resolve(space.gpu_for(params) if space.device == "gpu" else None).usd_per_device_hour
        return TrialSpec(
            study=space.name, trials_dir=self.trials_dir, params=dict(params), engine_args=engine_args, env=env,
            model=model,
            device=space.device, devices=devices, price_per_device_hour=price,
            workload=self.workload, levels=self.levels, requests_per_level=load.requests_per_level,
            seconds_per_level=load.seconds_per_level, warmup_requests=load.warmup_requests,
            request_timeout_s=load.request_timeout_s, startup_timeout_s=budget.timeout_s,
            startup_expected=budget.describe(),
            stop_on_slo_break=load.stop_on_slo_break, min_throughput_gain=load.min_throughput_gain,
            capacity_levels=load.capacity_levels, capacity_tolerance=load.capacity_tolerance,
            knee_fraction=load.knee_fraction,
            slo=space.slo_bounds, gpu=space.gpu_for(params), gpu_memory_gib=space.hardware.gpu_memory_gib,
            python=self.python, extra_env=extra_env, repeats=load.repeats, quality=self.quality, node_id=node_id,
            serve_replicas=space.serve_replicas(params), stream_batching_ms=space.stream_batching_ms(params),
            gpu_type=self.gpu_type(params), pricing=pricing,
            client_processes=load.client_processes, client_cpus=space.hardware.cpus_per_trial,
        )  # fmt: skip

    def _with_adapters(self, engine_args: dict[str, Any]) -> dict[str, Any]:
        """A trial's engine arguments with what serving the workload's LoRA adapters needs, unless the space set it."""
        adapters = self.workload.adapters
        if not adapters:
            return engine_args
        modules = self.adapters if self.adapters is not None else adapter_modules(adapters, self.study_dir / "models")
        return lora_engine_args(engine_args, modules, max(a.rank for a in adapters))


def startup_budget_for(space: SearchSpace, params: dict[str, Any], model: str) -> StartupBudget:
    """The start-up budget of one engine of ``params`` (capacity/startup.py): ``load.startup_timeout_s`` where the
    space gives a number, else sized from the model's checkpoint and the engine's TP, PP, DP and eagerness."""
    from servetune.errors import UserError

    load = space.load
    if load.startup_timeout_s != "auto":
        return StartupBudget(timeout_s=float(load.startup_timeout_s), reason="the space's load.startup_timeout_s")
    from servetune.capacity import load_model_arch

    engine, _ = space.engine_params(params)
    try:
        arch = load_model_arch(model)
    except (UserError, ValueError, OSError) as exc:
        return unsized(f"the model's size is unknown here: {str(exc).splitlines()[0] if str(exc) else exc}")
    return startup_budget(
        arch, device=space.device, tp=int(engine.get("tensor_parallel_size") or 1),
        pp=int(engine.get("pipeline_parallel_size") or 1), dp=int(engine.get("data_parallel_size") or 1),
        enforce_eager=bool(engine.get("enforce_eager")), load_gbps=load.weights_load_gbps,
    )  # fmt: skip


def resolve_levels(space: SearchSpace, workload: Workload) -> tuple[Level, ...]:
    """The study's levels: ``load.kind`` and ``load.levels`` over the workload's (see ``workload_levels``)."""
    return workload_levels(workload, space.load.kind, space.load.levels)


COMPILE_THREADS = "TORCHINDUCTOR_COMPILE_THREADS"


def compile_threads_env(space: SearchSpace, params: dict[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    """``torch.compile``'s worker count for the trial: the CPUs the trial reserved (its :func:`bundle`), not
    the host's. Inductor otherwise sizes its compile pool from every CPU of the node, so trials packed side by side
    on a GPU node each start a pool as large as the node and compile against one another. A value the space's
    ``env:`` or the environment sets is kept. Through Serve the replicas compile in Serve's processes: none set."""
    if space.serve_replicas(params) is not None or COMPILE_THREADS in env or COMPILE_THREADS in os.environ:
        return {}
    return {COMPILE_THREADS: str(max(1, int(bundle(space, params).get("CPU", 1))))}


#: Asking a sliver of a node's ``accelerator_type:T`` places a bundle on a node of that type (Ray's own convention,
#: as Ray Serve LLM asks 0.001).
ACCELERATOR_SLIVER = 0.001


def pinned_gpu_type(
    space: SearchSpace, nodes: Sequence[Mapping[str, float]], params: Mapping[str, Any] | None = None
) -> str | None:
    """The Ray accelerator type a trial of ``params`` must run on: its GPU type's (the ``gpu`` parameter, else
    ``hardware.gpu``; catalogue ``ray_type``), when the cluster's nodes declare types at all. Nodes that declare
    none (GPUs given by hand with ``ray start --num-gpus``, or an autoscaler yet to start its first GPU node)
    cannot be told apart: nothing is pinned."""
    gpu = space.gpu_for(dict(params or {}))
    if space.device != "gpu" or not gpu or not gpu_types(nodes):
        return None
    return ray_accelerator_type(gpu)


def bundle(space: SearchSpace, params: dict[str, Any], gpu_type: str | None = None) -> dict[str, float]:
    """One bundle per trial: with GPUs in other bundles ``ray.get_gpu_ids()`` would be empty. With ``gpu_type``
    (:func:`pinned_gpu_type`) it asks for a node of that GPU type.

    A trial through Serve holds one CPU, for its load client: Serve's replicas take their devices
    in placement groups of their own (``serve/trial.py``), pinned to the type in their config.
    """
    if space.serve_replicas(params) is not None:
        return {"CPU": 1.0}
    devices = space.devices(params)
    if space.device == "gpu":
        found = {"CPU": float(space.hardware.cpus_per_trial), "GPU": float(devices)}
        if gpu_type:
            found[ACCELERATOR + gpu_type] = ACCELERATOR_SLIVER
        return found
    return {"CPU": float(devices)}
