"""A study's trial through Ray Serve: the configuration deployed as a Ray Serve LLM application of
``serve.num_replicas`` replicas, measured through Serve's OpenAI ingress like a bare engine.

The application is the one ``export --format ray-serve`` prints for the trial (``serve.plan.llm_config``),
named and routed after the study and the trial (``/servetune-<study>-<trial id>``), so studies can share
one Serve, and a study finds what a killed run of it left: Serve outlives the driver on a cluster, and
so would the replicas and their devices (:func:`remove_study_apps`). Each replica takes its devices in a placement group of its own; the trial's Tune bundle
holds one CPU, for the load client. Every level starts on emptied prefix caches (Serve broadcasts
the reset to each replica); the result keeps what each replica served (Serve's own counter).
Leaving deletes the application and waits until its replica processes on this node are gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from servetune.engine.frontend import CpuReading
from servetune.engine.metrics import MetricsSnapshot
from servetune.engine.server import KvCapacity
from servetune.report.points import ReportPoint
from servetune.results import ENGINE_LOG
from servetune.serve import claims
from servetune.serve.actors import remove_shared_memory, shared_memory_of, wait_gone
from servetune.serve.claims import running_cores
from servetune.serve.cluster import ServeCluster
from servetune.serve.frontend import read_front_end
from servetune.serve.metrics import ReplicaCounts, replica_snapshots, replicas_snapshot
from servetune.serve.plan import Needs, llm_config, measured_gpu, needs, pin_gpu_type
from servetune.serve.proxies import pick_proxy
from servetune.trial.readings import report_interval_s
from servetune.trial.runner import TrialSpec, write_atomic

#: Placement the engine gets from Serve, not from the trial's environment.
NOT_SHIPPED = ("CUDA_VISIBLE_DEVICES",)


def app_name(spec: TrialSpec) -> str:
    return f"servetune-{spec.study}-{spec.trial_id}"


def remove_study_apps(study: str) -> list[str]:
    """Delete the Serve applications of ``study``'s trials still deployed (a killed run's: the trial's
    own teardown deletes its application); the names deleted. Another study's are left alone."""
    from ray import serve

    mine = re.compile(rf"servetune-{re.escape(study)}-[0-9a-f]{{12}}")
    names = sorted(name for name in serve.status().applications if mine.fullmatch(name))
    if names:
        cluster = ServeCluster.attached()
        for name in names:
            cluster.delete(name)  # and what its replicas told of their cores
    return names


def delete_left_app(name: str) -> None:
    """Delete the Serve application ``name`` that a killed trial or verification task left deployed (its own
    teardown did not run), so its replicas free the devices the study's ledger hands on (device_ledger.py)."""
    with contextlib.suppress(Exception):  # Serve is gone: nothing holds the devices
        ServeCluster.attached().delete(name)


def _shipped(spec: TrialSpec) -> tuple[ReportPoint, dict[str, str]]:
    env = {**spec.env, **{k: v for k, v in spec.extra_env.items() if k not in NOT_SHIPPED}}
    point = ReportPoint(trial_id=spec.trial_id, params=spec.params, engine_args=spec.engine_args, env=env,
                        model=spec.model, device=spec.device, devices=spec.devices)  # fmt: skip
    return point, env


def pinned_spec(spec: TrialSpec, environment: Mapping[str, str], nodes: Sequence[Mapping[str, float]],
                where: str) -> TrialSpec:  # fmt: skip
    """A trial's spec, started again on the cluster of ``nodes`` (each live node's resources) outside its study
    (``verify``), with its replicas pinned to the GPU type it was measured on (its ``gpu``, else the name NVML gave in
    its ``environment``): serve/plan.py ``pin_gpu_type``, which refuses in one line a cluster with none of that type."""
    gpu_type = pin_gpu_type(measured_gpu(spec.device, spec.gpu, environment), nodes, spec.trial_id, where)
    return spec if gpu_type == spec.gpu_type else dataclasses.replace(spec, gpu_type=gpu_type)


def trial_llm_config(spec: TrialSpec) -> dict[str, Any]:
    """The trial's ``LLMConfig`` (a dict): its engine arguments and environment, at its replica count."""
    assert spec.serve_replicas is not None
    point, env = _shipped(spec)
    return llm_config(point, spec.serve_replicas, env=env, accelerator_type=spec.gpu_type)


def trial_needs(spec: TrialSpec) -> Needs:
    """What the trial's replicas and Serve's ingress take from a Ray cluster (a local Ray is started with it)."""
    assert spec.serve_replicas is not None
    point, _ = _shipped(spec)
    return needs(point, trial_llm_config(spec), spec.serve_replicas)


def replicas_started(cluster: ServeCluster, name: str) -> list[dict[str, dict[str, Any]]]:
    """What each running LLM replica of the application was started with (``engine_kwargs``, ``env_vars``; secrets'
    values hashed: serve/claims.py ``started_with``), as each told it to Ray's key-value store beside its core claim.
    Where one told nothing (a replica without servetune's callback: on GPUs, on a cluster servetune joined, or
    deployed by an older servetune), every replica's ``LLMConfig`` is read from the replicas instead
    (:meth:`ServeCluster.replica_llm_configs`), which imports vLLM in this process to unpickle them (about 8
    core-seconds)."""
    told = claims.told_started(name, cluster.replica_ids(name))
    if told and all(told):
        return told
    return [claims.started_with(c["engine_kwargs"], c["env_vars"]) for c in cluster.replica_llm_configs(name)]


def replicas_on(cluster: ServeCluster, name: str, deployed: Mapping[str, Any]) -> tuple[int, int]:
    """(LLM replicas of the application running, those of them started with the engine arguments and environment
    variables of ``deployed``, an ``LLMConfig`` dict: each of its values, other values beside them allowed)."""
    wanted = claims.started_with(deployed.get("engine_kwargs") or {},
                                 (deployed.get("runtime_env") or {}).get("env_vars") or {})  # fmt: skip
    held = replicas_started(cluster, name)
    on = [h for h in held if all(all(h.get(part, {}).get(k) == v for k, v in values.items())
                                 for part, values in wanted.items())]  # fmt: skip
    return len(held), len(on)


class ServeEngine:
    """The :class:`~servetune.trial.runner.Engine` of a trial through Serve (see the module's doc); the class
    is the engine factory the study's trainable gives ``run_trial``."""

    def __init__(self, spec: TrialSpec, trial_dir: Path, cluster: ServeCluster | None = None) -> None:
        self.spec = spec
        self.trial_dir = trial_dir
        self.name = app_name(spec)
        self.cluster = cluster
        self.url = ""
        self.startup_s: float | None = None
        self.process: psutil.Process | None = None  # an LLM replica on this node (telemetry follows its memory)
        self.pids: list[int] = []
        self.not_ours: set[str] = set()  # replica actor ids whose logs are not this trial's
        self.earlier: set[str] = set()  # Serve replica ids of an earlier deployment of this name, counted by Ray still
        self.server_metrics: ReplicaMetrics | None = None  # the replicas' vLLM metrics, once deployed
        self.replica_nodes: dict[str, int] = {}  # replicas per Ray node, as placed
        self.device_nodes: dict[str, int] = {}  # their devices per Ray node (told to the study's ledger)
        self.deployed: dict[str, Any] = {}  # the LLMConfig deployed last (the trial's, or what an update moved to)
        self.proxy_record: dict[str, str] = {}  # the Serve proxy the client sends to, and why (serve/proxies.py)
        self.cpu_binding: str | None = None  # the CPU build: the cores each replica's engine claimed (replica_cores)
        self.cpu_unclaimed: str | None = None  # ... and why a replica's claimed none

    def __enter__(self) -> ServeEngine:
        self.cluster = self.cluster or ServeCluster.attached()
        self.cluster.delete(self.name)  # a killed driver's deployment of this very trial (--resume)
        self.not_ours = set(
            self.cluster.engine_replicas(self.name, live_only=False)
        )  # its replicas' logs are not this trial's
        # Replicas an earlier deployment of this name had (the trial's, when a study verifies it; a killed run's): Ray's
        # metrics agents keep exporting their request counters after they are gone.
        with contextlib.suppress(Exception):
            self.earlier = set(self.cluster.served_per_replica(self.name))
        route = f"/{self.name}"
        self.deployed = trial_llm_config(self.spec)
        self.startup_s = self.cluster.deploy(self.name, self.deployed, self.spec.startup_timeout_s,
                                             route_prefix=route, on_poll=self._placed, keep_ingress=True)  # fmt: skip
        try:
            # The proxy on the replicas' node, else the head's: the client's requests go where the replicas are.
            proxy = pick_proxy(self.replica_nodes, self.cluster.url, route)
            self.url, self.proxy_record = proxy.url + route, proxy.record()
            # Replicas that failed while deploying: their logs would count an engine (and its start) twice.
            live = set(self.cluster.engine_replicas(self.name))
            self.not_ours |= set(self.cluster.engine_replicas(self.name, live_only=False)) - live
            self.pids = self.cluster.replica_pids(self.name)
            # The first LLM replica here, whose process tree holds its engine: not the lowest of the pids above, which
            # after the host's pids wrap may be any child, or the ingress's replica.
            engines = self.cluster.replica_engines(self.name)
            if engines:
                self.process = psutil.Process(engines[0][0])
            self.server_metrics = ReplicaMetrics(self.cluster, self.name)
            if self.spec.device == "cpu":  # where replicas claim cores (serve/cores.py): what each got
                told = running_cores(self.cluster, self.name)  # replicas that cannot say: nothing of their cores
                self.cpu_binding, self.cpu_unclaimed = told.get("cpu_binding"), told.get("cpu_unclaimed")
            self._keep_log()
        except BaseException:  # deployed, but not entered: nothing else would delete it
            self.__exit__()
            raise
        return self

    def _placed(self) -> None:
        """Where Ray placed the replicas and their devices, read while they start and whenever measuring asks
        whether they are alive; told to the study's ledger when it changes (a replica placed, or replaced
        elsewhere) and every replica is placed."""
        from servetune.device_ledger import replica_share, report_placement

        assert self.cluster is not None
        with contextlib.suppress(Exception):  # the GCS tables could not be read this time: the next poll reads them
            replicas, devices = self.cluster.replica_devices(self.name, replica_share(self.spec)[1])
            if devices != self.device_nodes and sum(replicas.values()) == self.spec.serve_replicas:
                self.replica_nodes, self.device_nodes = replicas, devices
                report_placement(devices)

    def _keep_log(self) -> None:
        """The replicas' vLLM logs (those on this node, replicas Serve replaced during the trial included)
        as the trial's engine log: its start-up phases and KV capacity are read from it, as a bare engine's
        are, when the deployment is up (before any replica was replaced)."""
        assert self.cluster is not None
        text = self.cluster.replica_logs(self.name, leave_out=self.not_ours)
        if text:
            write_atomic(self.trial_dir / ENGINE_LOG, text)

    def __exit__(self, *exc: object) -> None:
        assert self.cluster is not None
        with contextlib.suppress(Exception):  # the whole log, the ladder's part included, while the replicas still run
            self._keep_log()
        found = set(self.pids)
        with contextlib.suppress(Exception):  # unreadable replicas must not keep the application deployed
            found |= set(self.cluster.replica_pids(self.name))
        segments = shared_memory_of(found)  # read while the engines run: Serve's stop kills them before vLLM unlinks
        self.cluster.delete(self.name)
        left = wait_gone(sorted(found), timeout_s=60.0)
        for pid in left:  # Serve stopped them in its own time before; never leave an engine behind
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
        remove_shared_memory(segments)

    # --- what measuring asks ---------------------------------------------------------------
    def alive(self) -> bool:
        """Whether the application runs; asked after each level and the probe, which is when a replica that Serve
        replaced since, perhaps on another node, is read back into the study's ledger."""
        assert self.cluster is not None
        running = self.cluster.applications().get(self.name, "").endswith("RUNNING")
        if running:
            self._placed()
        return running

    def failure_reason(self) -> str:
        assert self.cluster is not None
        status = self.cluster.applications().get(self.name, "deleted")
        return f"the Serve application {self.name} is {status.rsplit('.', 1)[-1]}"

    def log_tail(self, lines: int = 40) -> str:
        assert self.cluster is not None
        return self.cluster.log_tail(self.name, lines)

    def log_text(self) -> str:
        """The replicas' vLLM log so far (on this node), as :meth:`_keep_log` keeps it."""
        with contextlib.suppress(Exception):
            self._keep_log()
        path = self.trial_dir / ENGINE_LOG
        return path.read_text(errors="replace") if path.exists() else ""

    def kv_capacity(self) -> KvCapacity | None:
        """One replica's KV capacity (every replica's engine is configured alike), from its log."""
        path = self.trial_dir / ENGINE_LOG
        return KvCapacity.from_log(path.read_text(errors="replace")) if path.exists() else None

    def reset_prefix_cache(self) -> bool:
        """Empty every replica's prefix cache (Serve broadcasts it); whether every replica did."""
        assert self.cluster is not None and self.spec.serve_replicas is not None
        try:
            return self.cluster.reset_prefix_caches(self.name) >= self.spec.serve_replicas
        except Exception:  # a replica that cannot: the level says its cache may be warm
            return False

    def frontend_cpu(self) -> CpuReading | None:
        """The front end's CPU seconds now (serve/frontend.py): the proxy the client sends to, the ingress and the LLM
        replicas, each read on its node; None where Ray's actor table or their processes cannot be read."""
        with contextlib.suppress(Exception):  # a level without the reading, never a failed one
            return read_front_end(self.name, self.proxy_record.get("serve_proxy_node_id", ""))
        return None

    def kill_engine(self) -> tuple[int, str]:
        """SIGKILL one replica's vLLM engine (verify's replica_lost scenario): the engine core process the replica
        started, found through the replica actor's pid on this host; where it started none (the engine runs in the
        replica's own process), the replica's process. (pid, ``engine process`` or ``replica process``)."""
        assert self.cluster is not None
        found = self.cluster.replica_engines(self.name)
        if not found:
            raise RuntimeError(f"no live replica of {self.name} on this host")
        replica, engines = found[0]
        pid, what = (engines[0], "engine process") if engines else (replica, "replica process")
        psutil.Process(pid).kill()
        return pid, what

    def update(self, spec: TrialSpec | None = None) -> list[str]:
        """Move the deployment to ``spec``'s configuration (default: the trial's own again, a new version all the
        same, so Serve replaces every replica) under load, through Serve's update path (verify's rolling_update
        scenario), without waiting for it; on the GPU type the deployment is pinned to. Its ``LLMConfig`` is built now,
        on the cluster it runs on, as the trial's was on entering (on a local Ray servetune started, its replicas claim
        cores of their own). Only the LLM deployment moves: the ingress, deployed with a version of what it is built
        from (``keep_ingress``), keeps its replica and routes throughout, where the model's card is the same. The LLM
        replicas' actor ids before the update, for :meth:`rolled_out`."""
        assert self.cluster is not None
        old = self.cluster.engine_replicas(self.name)
        moved = self.spec if spec is None else dataclasses.replace(spec, gpu_type=self.spec.gpu_type)
        config = trial_llm_config(moved)
        self.cluster.redeploy(self.name, config, route_prefix=f"/{self.name}", keep_ingress=True)
        self.deployed = config
        return old

    def rolled_out(self, old: list[str]) -> bool:
        """Whether every replica runs the new version (:meth:`ServeCluster.rolled_out`)."""
        assert self.cluster is not None
        return self.cluster.rolled_out(self.name, old)

    def replica_lifetimes(self) -> list[dict[str, Any]]:
        """When each replica of the application (the ingress's too, dead ones too) started and ended, on the wall
        clock (:meth:`ServeCluster.replica_lifetimes`): which replicas a rollout replaced, and when."""
        assert self.cluster is not None
        return self.cluster.replica_lifetimes(self.name)

    def replicas_on_deployed(self) -> tuple[int, int]:
        """(LLM replicas running, those of them started with the engine arguments and environment deployed last),
        from what each replica says it was started with (:func:`replicas_started`): after a rollout, whether the
        replicas Serve left run the configuration it was moved to."""
        assert self.cluster is not None
        return replicas_on(self.cluster, self.name, self.deployed)

    def running_replicas(self) -> int:
        """The LLM replicas Serve reports RUNNING now."""
        assert self.cluster is not None
        return self.cluster.replica_states(self.name).get("RUNNING", 0)

    def record(self) -> dict[str, Any]:
        """What the result keeps of the deployment: its name, replicas, the requests each served, and the
        niceness its replica processes on this node ran at (Ray gives its workers 15 unless told otherwise)."""
        assert self.cluster is not None and self.spec.serve_replicas is not None
        niceness = set()
        for pid in self.pids:
            try:
                niceness.add(psutil.Process(pid).nice())
            except psutil.Error:
                continue
        return {"application": self.name, "replicas": self.spec.serve_replicas,
                "requests_per_replica": {replica: n for replica, n in self.cluster.requests_per_replica(self.name).items()
                                         if replica not in self.earlier},
                "replica_niceness": sorted(niceness), "replica_nodes": dict(self.replica_nodes),
                "device_nodes": dict(self.device_nodes)}  # fmt: skip


class ReplicaMetrics:
    """The deployment's vLLM metrics, its replicas' added up (``serve.metrics``), read from Ray's metrics
    agents: what a bare engine's ``/metrics`` gives a level (:class:`~servetune.trial.readings.MetricsSource`).

    The first full read (the first level's opening one) waits until the counts stop moving for one
    report interval, at most the lag: what ran before the ladder (the quality probe) is then counted
    before the level, not in it."""

    def __init__(self, cluster: ServeCluster, name: str) -> None:
        self.cluster, self.name = cluster, name
        self.lag_s = cluster.metrics_lag_s()
        self.replicas: set[str] = set(cluster.replica_ids(name))
        self.counts = ReplicaCounts()
        self.settled = False

    def read(self, gauges_only: bool = False) -> MetricsSnapshot | None:
        if gauges_only:  # twice a second: the replica ids known are looked up again on full reads only
            return replicas_snapshot(
                self.cluster.metrics_texts(), self._replica_ids(refresh=not self.replicas), gauges_only=True
            )
        if not self.settled:
            self.settled = True
            return self._settle()
        return self._counted()

    def _replica_ids(self, refresh: bool) -> set[str]:
        if refresh:  # a replica Serve restarted has a new id
            self.replicas = set(self.cluster.replica_ids(self.name)) or self.replicas
        return self.replicas

    def _counted(self) -> MetricsSnapshot | None:
        return self.counts.update(replica_snapshots(self.cluster.metrics_texts(), self._replica_ids(refresh=True)))

    def _settle(self) -> MetricsSnapshot | None:
        interval_s = report_interval_s(self)
        deadline = time.monotonic() + self.lag_s
        last = self._counted()
        while time.monotonic() < deadline:
            time.sleep(interval_s)
            now = self._counted()
            if _finished(now) == _finished(last):
                return now
            last = now
        return last


def _finished(snap: MetricsSnapshot | None) -> float | None:
    return snap.counters.get("requests_finished") if snap is not None else None
