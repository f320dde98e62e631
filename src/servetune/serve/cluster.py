"""Ray and Serve, as serve-check uses them: connect (or start a local Ray sized for the
application), deploy one Ray Serve LLM application, wait for it, count what each replica served,
and tear down what was started, proving by process id that no replica process is left (the replicas' actors,
processes and log files are read in ``serve/actors.py``).

Only this module of serve/ starts Ray. A local Ray is started by the driver as every command starts
one (``local_ray.start_local_ray``: no token left in ``~/.ray``) and stopped with it; on a cluster
given by address, only the application serve-check deployed is deleted. Joining starts no Serve: the
checks that can refuse (GPU type, fit, an application of the name) read Ray and Serve's status only, and
Serve starts with the first deployment (:meth:`ServeCluster.open_serve`). A Serve this driver started on
a cluster is shut down on leaving once no application is left on it; one that was running is left as found.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from servetune.engine.server import free_port
from servetune.errors import EngineStartError, UserError
from servetune.local_ray import SERVE_SYSTEM_CONFIG, keeping_sigterm, start_local_ray
from servetune.serve import actors, claims
from servetune.serve.builder import quiet_serve_logs, run_openai_app, send_app, start_builder
from servetune.serve.plan import CLAIM_CORES_ENV
from servetune.serve.proxies import is_wildcard
from servetune.serve.routing import merge_counters, read_replica_counters

#: Seconds between two reads of a deploying application's status: its ready time (``ready_s``, a trial's ``startup_s``)
#: is known to this much, and a wait for it ends at most this late (Serve's controller answers each read at once).
STATUS_POLL_S = 0.5
#: Seconds between two calls of a deploy's ``on_poll`` (which reads the GCS actor table) while the engines start.
ON_POLL_S = 2.0


class ServeCluster:
    """``with ServeCluster(address, resources) as cluster:`` a Ray cluster with Serve on it.

    ``address`` None starts a local Ray declaring ``resources`` (CPUs the replicas and the ingress
    need: Ray's CPUs are what it schedules by, not the cores vLLM runs on); leaving shuts Serve and that
    Ray down. An address joins that cluster; leaving disconnects this driver.

    Entering starts no Serve, so a refusal between entering and :meth:`open_serve` (the first deployment
    calls it) leaves nothing on the cluster: Serve's controller outlives the driver on a cluster. Serve
    this object started there (none was running) is shut down on leaving if no application is left on
    it; Serve that was running, and the applications of others, are left as they were.
    """

    def __init__(self, address: str | None, resources: Mapping[str, float]) -> None:
        self.address = address
        self.resources = dict(resources)
        self.started_ray = False
        self.joined = False  # this driver connected to the cluster at ``address`` (disconnected on leaving)
        self.serving = False  # Serve started (or found running) by :meth:`open_serve`
        self.started_serve = False  # no Serve controller was running: :meth:`open_serve` started one
        self.url = ""
        self.in_study = False  # a study's trial on its driver's cluster: its builder builds (serve/builder.py)
        self._env_before: str | None = None

    def __enter__(self) -> ServeCluster:
        import ray

        quiet_serve_logs()
        if self.address is None:
            if not ray.is_initialized():
                # The replicas claim a core per rank on the CPU build (serve/cores.py): its workers inherit the variable.
                self._env_before = os.environ.get(CLAIM_CORES_ENV)
                os.environ[CLAIM_CORES_ENV] = "1"
                # CPUs are declared (what Serve schedules by); GPUs are left for Ray to detect. A new Ray here, even
                # where $RAY_ADDRESS or a `ray start` names another (--address joins one), with a token of its own.
                try:
                    start_local_ray(num_cpus=int(self.resources.get("CPU", 1) + 0.999), log_to_driver=False,
                                    _system_config=SERVE_SYSTEM_CONFIG)  # fmt: skip
                except BaseException:
                    self._restore_env()
                    raise
                self.started_ray = True
        else:
            try:
                with keeping_sigterm():
                    ray.init(address=self.address, log_to_driver=False)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise UserError(f"--address {self.address}: cannot connect to Ray ({exc})") from None
            self.joined = True
        return self

    def open_serve(self) -> None:
        """Serve on the cluster, once every refusal is behind (the first deployment calls it; again, nothing): its
        HTTP proxy on 127.0.0.1 at a free port on a local Ray; on a cluster, Serve's own options, or those of the
        Serve already running there."""
        if self.serving:
            return
        from ray import serve
        from ray.serve.context import _get_global_client

        self.started_serve = _get_global_client(raise_if_no_controller_running=False) is None
        if self.started_serve:  # a Serve shut down just before may still be going: its proxy's name is taken
            actors.wait_serve_gone()
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()} if self.address is None else None)
        self.serving = True
        self.url = _ingress_url(self.address)

    @classmethod
    def attached(cls) -> ServeCluster:
        """The cluster this process already belongs to (a Ray worker: a study's trial), with Serve
        running on it (:func:`start_serve`); nothing to start or stop."""
        import ray

        cluster = cls(ray.get_runtime_context().gcs_address, {})
        cluster.serving, cluster.in_study = True, True
        cluster.url = _ingress_url(cluster.address)
        return cluster

    def __exit__(self, *exc: object) -> None:
        import ray
        from ray import serve

        if self.started_ray:
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()
            self._restore_env()
            return
        if self.started_serve:  # Serve started here on a cluster that ran none: gone with its last application
            with contextlib.suppress(Exception):  # unreachable: nothing this driver can stop
                if not serve.status().applications:
                    serve.shutdown()
                    actors.wait_serve_gone()
        if self.joined:
            ray.shutdown()  # this driver's connection only; the cluster runs on

    def _restore_env(self) -> None:
        if self._env_before is None:
            os.environ.pop(CLAIM_CORES_ENV, None)
        else:
            os.environ[CLAIM_CORES_ENV] = self._env_before

    # --- what the cluster has -------------------------------------------------------------
    def available(self) -> dict[str, float]:
        import ray

        return dict(ray.available_resources())

    def nodes(self) -> list[dict[str, float]]:
        """Each live node's resources, all of them (its ``accelerator_type:T`` says its GPU type)."""
        import ray

        return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]

    def applications(self) -> dict[str, str]:
        """Serve applications on the cluster and their status."""
        from ray import serve

        return {name: str(app.status) for name, app in serve.status().applications.items()}

    # --- one application --------------------------------------------------------------------
    def deploy(
        self, name: str, llm_config: Mapping[str, Any], timeout_s: float, engine_version: str | None = None,
        route_prefix: str = "/", on_poll: Callable[[], None] | None = None, keep_ingress: bool = False,
    ) -> float:  # fmt: skip
        """Deploy the Ray Serve LLM application (``build_openai_app``) and wait until it is RUNNING;
        returns the seconds it took. Deployed again unpinned, it is a new version: Serve rolls it out,
        replacing every replica.

        ``engine_version`` pins the LLM deployment's version (``serve.routing.engine_version``): deployed
        again with the same one and only options Serve applies in place changed (the replica count, the
        autoscaling, the request router), Serve keeps its replicas and their engines. The ingress is not
        pinned unless ``keep_ingress``, which gives it the version of what it is built from and of the router the
        LLM deployment asks for (serve/versions.py ``pin_ingress``: a handle builds its request router once, so only
        a new ingress routes with a new one): deployed again with the same router, or a :meth:`redeploy` that moves
        only the LLM deployment, keeps the ingress replica. ``on_poll`` is called while the deployment's status is read (at most
        every ``ON_POLL_S``) and once it is up: where its replicas went can be read while their engines start."""
        return self.run_app(name, None, timeout_s, route_prefix, on_poll,
                            send=lambda: self._send_openai_app(name, llm_config, keep_ingress, engine_version,
                                                               route_prefix))  # fmt: skip

    def redeploy(self, name: str, llm_config: Mapping[str, Any], route_prefix: str = "/",
                 keep_ingress: bool = False) -> None:  # fmt: skip
        """Deploy the LLM application ``name`` again with ``llm_config`` through Serve's own update path
        (as :meth:`redeploy_app`), its LLM deployment unpinned: a new version, which Serve rolls out over the running
        replicas while they serve. ``keep_ingress`` (the application deployed with it too): the ingress keeps its
        version where what it is built from did not change, so Serve keeps its replica and it routes throughout;
        else Serve replaces the single ingress replica too, stopping it before it starts the new one
        (``max_surge_percent`` 0), and requests wait at the proxy meanwhile."""
        self.open_serve()
        self._send_openai_app(name, llm_config, keep_ingress, None, route_prefix, delete_late=False)

    def _send_openai_app(self, name: str, llm_config: Mapping[str, Any], keep_ingress: bool,
                         engine_version: str | None, route_prefix: str, delete_late: bool = True) -> float:  # fmt: skip
        """Build the LLM application and give it to Serve, not waiting: in a study's trial, by the study's builder
        (serve/builder.py: the trial's process need not import Ray Serve LLM and vLLM to build it). The seconds
        Serve took to take it."""
        return run_openai_app(
            name,
            llm_config,
            keep_ingress,
            engine_version,
            route_prefix,
            attached=self.in_study,
            delete_late=delete_late,
        )  # an update (a rollout) Serve takes late is not deleted

    def redeploy_app(self, name: str, app: Any, route_prefix: str = "/") -> None:
        """``serve.run`` the application ``app`` under the name of one running, and return once Serve's controller
        holds the new target (the application DEPLOYING), not waiting for the rollout: :meth:`rolled_out` says when
        it is done."""
        self.open_serve()
        send_app(name, app, route_prefix, delete_late=False)  # a rollout Serve takes late is not deleted

    def rolled_out(self, name: str, old: Collection[str], deployment_prefix: str = "LLMServer") -> bool:
        """Whether a rollout of ``name`` is done: the application RUNNING, every deployment HEALTHY (Serve says
        UPDATING while replicas of the old version remain), and none of the LLM replicas ``old`` (actor ids, read
        before the update) still alive."""
        from ray import serve

        app = serve.status().applications.get(name)
        if app is None or not str(app.status).endswith("RUNNING"):
            return False
        if not all(str(d.status).endswith("HEALTHY") for d in app.deployments.values()):
            return False
        return not set(self.engine_replicas(name, deployment_prefix)) & set(old)

    def engine_replicas(self, name: str, deployment_prefix: str = "LLMServer", live_only: bool = True) -> list[str]:
        """Actor ids of the application's live LLM deployment replicas (each holds one engine): the same
        ids before and after a redeploy mean Serve kept the replicas, a new id is a replica it started.
        ``live_only`` False: dead ones the GCS still knows too (replaced, or of an earlier deployment)."""
        return sorted(actor_id for actor_id, _ in actors.replica_actors(name, deployment_prefix, live_only))

    def replica_devices(
        self, name: str, each: int, deployment_prefix: str = "LLMServer"
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Where Ray placed the application's live LLM replicas, exactly: (replicas per node, by each one's actor;
        devices per node). A replica's devices are its placement group's bundles (Ray Serve LLM's: one per rank,
        the replica actor in the first; Serve names the group after the replica's actor), each on the node Ray put
        it on, so a replica that PACK stretched over two nodes counts on both. A replica without a placement group
        (its devices in its actor) holds ``each`` on its actor's node. A replica whose actor or bundles are not all
        placed yet (a group being rescheduled after a lost node) counts in neither."""
        import ray

        groups = {entry.get("name"): entry for entry in ray.util.placement_group_table().values()
                  if entry.get("name") and entry.get("state") == "CREATED"}  # fmt: skip
        replicas: dict[str, int] = {}
        devices: dict[str, int] = {}
        for _, actor in actors.replica_actors(name, deployment_prefix):
            node = actors.node_of(actor)
            group = groups.get(actor.get("Name"))
            bundles = (
                [str(n) for n in (group.get("bundles_to_node_id") or {}).values()]
                if group is not None
                else [node] * each
            )
            if not node or not bundles or not all(b.strip("0") for b in bundles):
                continue
            replicas[node] = replicas.get(node, 0) + 1
            for bundle_node in bundles:
                devices[bundle_node] = devices.get(bundle_node, 0) + 1
        return replicas, devices

    def replica_lifetimes(self, name: str) -> list[dict[str, Any]]:
        """Every replica of the application's deployments the GCS knows, dead ones too (``actors.replica_lifetimes``):
        when each started and ended (wall clock), the ingress's as well as the LLM replicas'."""
        return actors.replica_lifetimes(name)

    def replica_ids(self, name: str, deployment_prefix: str = "LLMServer") -> list[str]:
        """Serve's unique ids of the application's live LLM replicas: the ``ReplicaId`` their engines'
        metrics carry (the replica actor's name is ``SERVE_REPLICA::<app>#<deployment>#<unique id>``)."""
        return sorted(
            str(actor.get("Name", "")).rsplit("#", 1)[-1] for _, actor in actors.replica_actors(name, deployment_prefix)
        )

    def metrics_lag_s(self) -> float:
        """How far what Ray's metrics agents export lags a worker's own counts: two report intervals
        (1 s on a local Ray servetune starts for Serve; Ray's default is 10 s), and half a second."""
        import ray

        try:
            interval_s = max(float(ray._config.metrics_report_interval_ms()), 1000.0) / 1000.0
        except Exception:  # an older Ray: its default
            interval_s = 10.0
        return 2 * interval_s + 0.5

    def reset_prefix_caches(self, name: str, deployment_prefix: str = "LLMServer", timeout_s: float = 60.0) -> int:
        """Empty the prefix cache of every replica of the application's LLM deployment (Ray Serve LLM's
        ``LLMServer.reset_prefix_cache``, broadcast by Serve to each running replica); the number reset."""
        return sum(
            len(handle.broadcast("reset_prefix_cache").results(timeout_s=timeout_s))
            for handle in _llm_handles(name, deployment_prefix)
        )

    def replica_claims(self, name: str) -> list[dict[str, str]]:
        """What the core claim of each running LLM replica of the application got on the CPU build (serve/claims.py;
        ``{}``: one that told nothing), in :meth:`replica_ids`' order."""
        return claims.told(name, self.replica_ids(name))

    def replica_llm_configs(
        self, name: str, deployment_prefix: str = "LLMServer", timeout_s: float = 60.0
    ) -> list[dict[str, Any]]:
        """What each running replica of the application's LLM deployment was started with, as it holds it (Ray Serve
        LLM's ``LLMServer.llm_config``, broadcast by Serve to every running replica): its ``engine_kwargs``, its
        ``env_vars`` (its runtime environment's) and its ``callback_class`` (None: Ray Serve LLM's own). What a
        rollout left running, read from the replicas rather than from what was asked for, where they told nothing
        (serve/trial.py ``replicas_started``): unpickling each imports vLLM in this process."""
        found = []
        for handle in _llm_handles(name, deployment_prefix):
            for config in handle.broadcast("llm_config").results(timeout_s=timeout_s):
                callback = getattr(getattr(config, "callback_config", None), "callback_class", None)
                found.append({
                    "engine_kwargs": dict(config.engine_kwargs or {}),
                    "env_vars": dict((config.runtime_env or {}).get("env_vars") or {}),
                    "callback_class": None if callback is None else str(callback),
                })  # fmt: skip
        return found

    def run_app(
        self, name: str, app: Any, timeout_s: float, route_prefix: str = "/", on_poll: Callable[[], None] | None = None,
        send: Callable[[], float] | None = None,
    ) -> float:  # fmt: skip
        """``serve.run`` one application at ``route_prefix`` and wait for every deployment to be HEALTHY. One that
        fails (or is not up within ``timeout_s``) is deleted and raised as :class:`EngineStartError`
        with Serve's message and the tail of its replicas' logs. ``send`` gives Serve the application in place of
        ``app`` (:meth:`deploy`: built where it is cheapest) and returns the seconds Serve took to take it: the time
        returned runs from when Serve was given the application, wherever and however long it was built before."""
        from ray import serve

        self.open_serve()
        # run_many can return before the application is up (serve.run waits, with no time limit).
        sent_s = send() if send is not None else send_app(name, app, route_prefix)
        start = time.monotonic() - sent_s
        try:
            time.sleep(1.0)  # let the controller take the new target before its status is read
            polled = float("-inf")
            while True:
                app = serve.status().applications.get(name)
                status = str(app.status) if app is not None else "NOT_STARTED"
                up = status.endswith("RUNNING") and all(
                    str(d.status).endswith("HEALTHY") for d in app.deployments.values()
                )
                if on_poll is not None and (up or time.monotonic() - polled >= ON_POLL_S):
                    polled = time.monotonic()
                    with contextlib.suppress(Exception):  # what the caller reads on the way never fails the deploy
                        on_poll()
                if up:
                    return time.monotonic() - start
                failed = status.endswith(("DEPLOY_FAILED", "UNHEALTHY"))
                if failed or time.monotonic() - start > timeout_s:
                    message = _status_message(app) if failed else f"not RUNNING after {timeout_s:.0f} s ({status})"
                    tail = self.log_tail(name)
                    self.delete(name)
                    raise EngineStartError(f"the Serve deployment of {name} failed: {message}", tail)
                time.sleep(STATUS_POLL_S)
        except (
            KeyboardInterrupt,
            SystemExit,
        ):  # stopped while it deploys: on a cluster Serve would keep it (and its devices)
            with contextlib.suppress(Exception):
                self.delete(name)
            raise

    def delete(self, name: str) -> None:
        """Delete the application and forget what its replicas told (serve/claims.py)."""
        from ray import serve

        if name in serve.status().applications:
            serve.delete(name, _blocking=True)
        with contextlib.suppress(Exception):  # a Ray that went away: nothing of it to forget
            claims.forget(name)

    def replica_pids(self, name: str) -> list[int]:
        """Process ids of the application's replica actors on this host and what they started (``actors.replica_pids``)."""
        return actors.replica_pids(name)

    def replica_engines(self, name: str, deployment_prefix: str = "LLMServer") -> list[tuple[int, list[int]]]:
        """The live LLM replicas on this host and their vLLM engine processes (``actors.replica_engines``)."""
        return actors.replica_engines(name, deployment_prefix)

    def requests_per_replica(self, name: str, deployment_prefix: str = "LLMServer") -> dict[str, int]:
        """Requests each replica of the LLM deployment handled, from Serve's own counter
        (``ray_serve_deployment_request_counter``, per replica, exported by Ray's metrics agent
        on this node). Empty when the agent cannot be read."""
        time.sleep(self.metrics_lag_s())  # until the metrics agents have the latest counts
        return self.served_per_replica(name, deployment_prefix)

    def served_per_replica(self, name: str, deployment_prefix: str = "LLMServer") -> dict[str, int]:
        """Serve's per-replica request counter as the metrics agents have it now (a report interval behind)."""
        counters = self._read_counters(name, deployment_prefix)
        return {replica: int(c["requests"]) for replica, c in counters.items() if "requests" in c}

    def replica_counters(self, name: str, deployment_prefix: str = "LLMServer") -> dict[str, dict[str, float]]:
        """Per replica: Serve's request counter and vLLM's token and prefix-cache counters
        (``serve.routing.read_replica_counters``), once the metrics agents have the latest counts."""
        time.sleep(self.metrics_lag_s())  # until the metrics agents have the latest counts
        return self._read_counters(name, deployment_prefix)

    def _read_counters(self, name: str, deployment_prefix: str) -> dict[str, dict[str, float]]:
        # A replica's counters are exported by the metrics agent of the node it runs on.
        return merge_counters([read_replica_counters(text, name, deployment_prefix) for text in self.metrics_texts()])

    def metrics_texts(self) -> list[str]:
        """What Ray's metrics agent on every alive node exports (Prometheus text), one per node
        that could be read: this node's on 127.0.0.1, the others' on their node address."""
        import urllib.request

        import ray

        here = ray.get_runtime_context().get_node_id()
        texts = []
        for node in ray.nodes():
            port = node.get("MetricsExportPort")
            if not node.get("Alive") or not port:
                continue
            host = "127.0.0.1" if node.get("NodeID") == here else node.get("NodeManagerAddress")
            try:
                with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as resp:
                    texts.append(resp.read().decode())
            except OSError:
                continue
        return texts

    def replica_states(self, name: str, deployment_prefix: str = "LLMServer") -> dict[str, int]:
        """Replicas of the application's LLM deployment by state (RUNNING, STARTING, ...), as Serve reports them."""
        from ray import serve

        app = serve.status().applications.get(name)
        counts: dict[str, int] = {}
        for deployment_name, deployment in app.deployments.items() if app is not None else ():
            if deployment_name.startswith(deployment_prefix):
                for state, n in deployment.replica_states.items():
                    key = str(getattr(state, "value", state))
                    counts[key] = counts.get(key, 0) + int(n)
        return counts

    def replica_logs(self, name: str, max_bytes: int = 4 << 20, leave_out: Collection[str] = ()) -> str:
        """What the application's LLM replicas on this node wrote, dead ones too (``actors.replica_logs``)."""
        return actors.replica_logs(name, max_bytes, leave_out)

    def log_tail(self, name: str, lines: int = 40) -> str:
        """The last lines the application's replicas wrote on this node (``actors.log_tail``)."""
        return actors.log_tail(name, lines)


def start_serve(local: bool) -> None:
    """Serve on the connected cluster, once, before a study's trials deploy through it: its HTTP proxy on
    127.0.0.1 at a free port for a local cluster; on a cluster, on every address of the head (trials
    on other nodes reach it there). Serve already running keeps its options. Beside it, the study's builder of its
    trials' applications, the driver's until it exits (serve/builder.py)."""
    from ray import serve

    quiet_serve_logs()
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()} if local else {"host": "0.0.0.0"})
    start_builder()  # the trials' applications built in one process, not each in its own (serve/builder.py)


def _llm_handles(name: str, deployment_prefix: str) -> list[Any]:
    """Serve's handles of the application's LLM deployments (none where it is not deployed), each routing on a loop of
    its own: its callers (a thread of verify's, serve-check's driver) have none running, and Serve's
    throughput-optimized mode (RAY_SERVE_THROUGHPUT_OPTIMIZED=1) would otherwise build its router on the caller's and
    refuse."""
    from ray import serve

    app = serve.status().applications.get(name)
    handles = []
    for deployment in app.deployments if app is not None else ():
        if deployment.startswith(deployment_prefix):
            handle = serve.get_deployment_handle(deployment, name)
            if not handle.is_initialized:  # Serve hands out one handle per deployment, initialized once
                handle._init(_run_router_in_separate_loop=True)
            handles.append(handle)
    return handles


def _status_message(app: Any) -> str:
    parts = [app.message] if getattr(app, "message", "") else []
    for name, deployment in app.deployments.items():
        if getattr(deployment, "message", ""):
            parts.append(f"{name}: {deployment.message}")
    text = " | ".join(parts) or str(app.status)
    lines = [line for line in text.splitlines() if line.strip()]
    return " ".join(lines[-3:])[:600]


def _ingress_url(address: str | None) -> str:
    from ray.serve.context import _get_global_client

    client = _get_global_client()  # typed Optional, but raises rather than return None (raise_if_no_controller_running)
    assert client is not None
    config = client.http_config  # Serve's HTTP options (host, port) as the controller has them
    host = config.host
    if is_wildcard(host):
        host = address.split("://")[-1].rsplit(":", 1)[0] if address and address != "auto" else "127.0.0.1"
    return f"http://{host}:{config.port}"
