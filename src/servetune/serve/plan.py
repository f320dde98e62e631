"""What serve-check deploys and what it needs, computed without Ray.

The application is the one ``servetune export --format ray-serve`` prints
(:func:`servetune.report.export.ray_serve_app`), with the replica count fixed
(``min_replicas = max_replicas = N``). Each replica is one placement group: the engine's
TP x PP (x PCP) devices (GPUs, or cores on the CPU build), plus one CPU for the replica actor, which
Ray Serve LLM adds to the first bundle. The OpenAI ingress is one more replica with one CPU.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from servetune.capacity.hardware import ACCELERATOR, gpu_types, ray_accelerator_type
from servetune.config.space import engine_ranks
from servetune.errors import UserError
from servetune.report.autoscale_policy import POLICY_FUNCTION
from servetune.report.export import SIGNALS_SERVER_CLASS, health_check_config, ray_serve_app
from servetune.report.points import ReportPoint
from servetune.secrets import MASK

#: The Serve application serve-check deploys, unless --app-name says otherwise.
APP_NAME = "servetune-serve-check"
#: CPUs of the OpenAI ingress replica (Serve's default for a deployment).
INGRESS_CPUS = 1.0
#: CPUs of each LLM replica actor, added by Ray Serve LLM to its first placement bundle.
REPLICA_ACTOR_CPUS = 1.0
#: The Ray Serve LLM callback that gives each replica's engine cores of its own on the CPU build.
CLAIM_CORES = "servetune.serve.cores:ClaimCores"
#: Set ("1") before servetune starts a local Ray (whose workers inherit it): the CPU build's replicas
#: then claim a core per rank (serve/cores.py). Unset (a cluster servetune joins), replicas carry no
#: callback (its nodes need no servetune) and vLLM binds them as it does.
CLAIM_CORES_ENV = "SERVETUNE_CLAIM_CORES"


@dataclass(frozen=True)
class Needs:
    """What ``replicas`` replicas of one configuration take from a Ray cluster."""

    replicas: int
    device: str  # "GPU" or "CPU" (the CPU build's ranks are cores)
    devices_per_replica: int  # TP x PP x PCP
    cpus_per_replica: float  # the engine's CPU bundles plus the replica actor
    asked_by: str = ""  # the option that asked for this many replicas, for refusals (default: --replicas N)

    @property
    def devices(self) -> int:
        return self.replicas * self.devices_per_replica

    @property
    def cpus(self) -> float:
        return self.replicas * self.cpus_per_replica + INGRESS_CPUS

    def resources(self) -> dict[str, float]:
        """Ray resources the application needs in all (what a local Ray is started with)."""
        found = {"CPU": self.cpus}
        if self.device == "GPU":
            found["GPU"] = float(self.devices)
        return found


def parse_replicas(text: str) -> list[int]:
    """``1,2,4`` -> [1, 2, 4] (sorted, no repeats): scaling up one replica count at a time."""
    try:
        counts = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise UserError(f"--replicas '{text}' is not a comma-separated list of whole numbers") from None
    if not counts or counts[0] < 1:
        raise UserError(f"--replicas needs replica counts of 1 or more, got '{text}'")
    return counts


def llm_config(
    point: ReportPoint, replicas: int, env: Mapping[str, str] | None = None, accelerator_type: str | None = None
) -> dict[str, Any]:
    """The ``LLMConfig`` (as a dict) of ``export --format ray-serve``, at ``replicas`` fixed replicas; on the CPU
    build in a local Ray servetune started, each replica claims cores of its own for its engine (:data:`CLAIM_CORES`).

    Secrets the study did not store (shown as ``***``) are taken from ``env`` (the caller's
    environment); one missing there is an error, not a deployment that fails later. ``accelerator_type``: Ray's
    GPU type the replicas must run on (trial/context.py pinned_gpu_type).
    """
    app = ray_serve_app(point, accelerator_type)["applications"][0]
    if app["import_path"] != "ray.serve.llm:build_openai_app":
        raise UserError(f"trial {point.trial_id} runs expert parallelism across data-parallel ranks "
                        "(build_dp_openai_app); serve-check measures build_openai_app replicas only")  # fmt: skip
    config = copy.deepcopy(app["args"]["llm_configs"][0])
    autoscaling = config.setdefault("deployment_config", {}).setdefault("autoscaling_config", {})
    autoscaling.update(min_replicas=replicas, max_replicas=replicas, initial_replicas=replicas)
    if point.device == "cpu" and os.environ.get(CLAIM_CORES_ENV):  # each replica's engine on cores of its own
        kwargs = config.get("engine_kwargs", {})
        ranks = engine_ranks(kwargs)
        config["callback_config"] = {"callback_class": CLAIM_CORES, "callback_kwargs": {"ranks": ranks}}
    env = os.environ if env is None else env
    env_vars = config.get("runtime_env", {}).get("env_vars", {})
    for name, value in env_vars.items():
        if value == MASK:
            if name not in env:
                raise UserError(f"the study stored {name} masked; set {name} in the environment to deploy it")
            env_vars[name] = env[name]
    return config


def autoscaled_llm_config(
    point: ReportPoint, deployment_config: Mapping[str, Any], accelerator_type: str | None = None
) -> dict[str, Any]:
    """The ``LLMConfig`` of :func:`llm_config` with the derived autoscaling's deployment config (and the health check
    export sets); under the predictive policy its replicas record the engine signals it reads, as exported."""
    config = llm_config(point, 1, accelerator_type=accelerator_type)
    config["deployment_config"] = health_check_config() | copy.deepcopy(dict(deployment_config))
    policy = (deployment_config.get("autoscaling_config") or {}).get("policy") or {}
    if policy.get("policy_function") == POLICY_FUNCTION:
        config["server_cls"] = SIGNALS_SERVER_CLASS
    return config


def needs(point: ReportPoint, config: Mapping[str, Any], replicas: int) -> Needs:
    kwargs = config.get("engine_kwargs", {})
    per_replica = engine_ranks(kwargs)  # TP x PP x PCP
    bundles = (config.get("placement_group_config") or {}).get("bundles") or []
    bundle_cpus = sum(float(b.get("CPU", 0)) for b in bundles)
    return Needs(
        replicas=replicas, device="GPU" if point.device == "gpu" else "CPU", devices_per_replica=per_replica,
        cpus_per_replica=bundle_cpus + REPLICA_ACTOR_CPUS,
    )  # fmt: skip


def measured_gpu(device: str, gpu: str | None, environment: Mapping[str, str]) -> str | None:
    """The GPU a trial was measured on: its ``gpu`` (the ``gpu`` parameter, else ``hardware.gpu``), else the name NVML
    gave the trial's GPUs (its environment's ``gpu_model``); None on the CPU build, or where neither is known."""
    if device != "gpu":
        return None
    return gpu or environment.get("gpu_model") or None


def pin_gpu_type(gpu: str | None, nodes: Sequence[Mapping[str, float]], trial_id: str, where: str) -> str | None:
    """The Ray accelerator type a point's replicas are pinned to (``accelerator_type`` in its ``LLMConfig``, as
    ``export --accelerator-type`` writes it): the type of ``gpu``, the GPU its trial was measured on
    (:func:`measured_gpu`), as trials are pinned (trial/context.py ``pinned_gpu_type``). ``nodes``: each live node's
    resources. None where nothing can be pinned: no GPU known, one the catalogue gives no Ray type, or a cluster whose
    nodes declare no type (GPUs given by hand, or an autoscaler yet to start a GPU node): they cannot be told apart.
    A cluster whose nodes declare types, none of them that one: refused in one line, before anything is deployed."""
    wanted = ray_accelerator_type(gpu) if gpu else None
    declared = gpu_types(nodes)
    if wanted is None or not declared:
        return None
    if wanted not in declared:
        raise UserError(f"trial {trial_id} was measured on {gpu} GPUs (Ray accelerator_type {wanted}); {where} has "
                        f"GPUs of type {', '.join(declared)} only: nothing was deployed")  # fmt: skip
    return wanted


def gpus_of_type(nodes: Sequence[Mapping[str, float]], gpu_type: str) -> float:
    """The GPUs of the nodes that declare ``gpu_type`` (their ``accelerator_type:T``), all of them."""
    return sum(node.get("GPU", 0.0) for node in nodes if node.get(ACCELERATOR + gpu_type, 0.0) > 0)


def check_fits(need: Needs, devices: float, cpus: float, where: str) -> None:
    """Refuse, before anything is deployed, a replica count the cluster cannot hold.

    ``devices``: GPUs (or, on the CPU build, cores the engines can run on); ``cpus``: Ray's CPUs.
    """
    unit = "GPUs" if need.device == "GPU" else "CPU cores"
    asked = need.asked_by or f"--replicas {need.replicas}"
    if need.devices > devices:
        raise UserError(
            f"{asked}: {need.replicas} replicas of {need.devices_per_replica} "
            f"{unit[:-1] if need.devices_per_replica == 1 else unit} (TP x PP x PCP) need {need.devices} {unit}; "
            f"{where} has {devices:g}: nothing was deployed"
        )
    if need.cpus > cpus:
        raise UserError(
            f"{asked}: the replicas and the ingress need {need.cpus:g} Ray CPUs; "
            f"{where} has {cpus:g}: nothing was deployed"
        )


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or not math.isfinite(denominator) or denominator <= 0:
        return None
    return numerator / denominator


def same_level(a: Mapping[str, float], b: Mapping[str, float]) -> bool:
    return dict(a) == dict(b)


def find_level(levels: Sequence[Any], level: Mapping[str, float]) -> Any | None:
    """The level result measured at ``level`` (``{"concurrency": 8}``), or None."""
    return next((lv for lv in levels if same_level(lv.summary.level, level)), None)
