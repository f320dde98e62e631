"""Ray Serve LLM applications built in one process per study, not in each trial's.

Building a Ray Serve LLM application (``build_openai_app``) imports ``ray.serve.llm`` and with it vLLM: about eight
core-seconds in a fresh process. A study's trials each run in a fresh Ray worker (Tune's trial actor, verify's
task), so each paid that to build an application that takes a second to hand to Serve. The study's driver starts
one builder actor beside Serve (:func:`start_builder`, from ``cluster.start_serve``), which imports Ray Serve LLM
once; a trial's deploy on the cluster it is attached to (``ServeCluster.deploy``/``redeploy``) hands it the
``LLMConfig``, and it builds the application (:func:`openai_app`, the same code a driver runs) and gives it to Serve
(``serve.run_many``, not waiting: the trial waits for it as before). Where no builder runs (``servetune verify`` and
``serve-check`` build in their driver, once), the caller builds it itself.

The builder is the driver's: an actor it owns, not detached, so Ray stops it when the driver ends or dies, a local
run's or a ``ray job submit``'s alike; the driver holds its handle until it exits (Ray stops an actor no handle refers
to, a named one too) and stops it then. Its name carries the driver's job id, which the trials and the verify task
the driver starts share on whatever node they run, and no other study's driver has. It runs with the job's runtime
environment, as the trials do: Serve gives the application the builder's (``serve.run_many``'s default) as it gave it
the trial's. A trial that finds no live builder (it died) builds the application itself, as before, and says so; so does
one the builder does not answer within :data:`BUILD_TIMEOUT_S` (Serve not answering it, its node gone unnoticed, a
queue of builds ahead), and the builder, its turn come, drops a build its caller stopped waiting for rather than give
it to Serve after the caller's own (:meth:`AppBuilder.run`). Every hand-off to Serve, the builder's and a trial's own,
is bounded (:data:`SEND_TIMEOUT_S`): a Serve that does not take the application fails that deploy, and the trial with
it, rather than hang it, and what Serve takes after the hand-off was given up is deleted (:func:`send_app`).
Taking no CPU, it runs where Ray places it, mostly the driver's node (a ``ray job submit``'s: the head's), which so
needs Ray Serve LLM and vLLM importable, as the images Ray Serve LLM documents have on every node; where they are not,
it dies starting and each trial builds its own, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from servetune.errors import EngineStartError
from servetune.serve.routing import router_config
from servetune.serve.versions import pin_ingress, pin_llm_servers

logger = logging.getLogger(__name__)

#: The builder actor's name, before the driver's job id (:func:`builder_name`).
BUILDER_PREFIX = "servetune-serve-builder-"
#: How long a trial waits for the builder to build its application and give it to Serve before it builds it itself:
#: the wait includes the builds queued ahead of its own (one at a time) and, for a study's first trials, the builder's
#: start (its import of Ray Serve LLM). Measured on a real Serve, a local Ray of two CPUs on a two-core host that other
#: runs kept busy: Serve and the builder started (``start_serve``), six fake-engine applications built through it
#: one after another (``run_openai_app``) waited 15.7 s (the first: the builder's start), then 0.9, 1.3, 1.1, 1.3 and
#: 1.4 s, of which ``serve.run_many`` took 0.24-0.33 s. Ten times the slowest, rounded up: a queue of a study's
#: concurrent trials' builds (about 1.4 s each) fits in it too.
BUILD_TIMEOUT_S = 180.0
#: How long before its caller's deadline the builder still gives a build to Serve: a hand-off that starts later could
#: land after the caller's own (or after the caller deleted its application, which would come back). ``serve.run_many``
#: took 0.24-0.33 s in the measurements above; with :data:`SEND_TIMEOUT_S` under it, a hand-off the builder starts is
#: taken or given up before its caller's deadline.
SEND_MARGIN_S = 90.0
#: How long a hand-off (:func:`send_app`, the builder's and a trial's own) waits for Serve to take the application
#: before it is given up, a failure of the deploy rather than a hang: two hundred times the slowest ``serve.run_many``
#: measured above on a quiet host, as a controller on a host loaded past ten runnable processes a core (the suite's
#: integration tier, CI) can take tens of times longer and a trial failed on a slow hand-off is a false failure.
SEND_TIMEOUT_S = 60.0
#: The name of a hand-off's thread, before the application's (:class:`_Handoff`).
HANDOFF_THREAD = "servetune-handoff-"
#: How a hand-off Serve did not take in time (or one refused behind it) begins its failure: the Serve's, not the
#: configuration's (trial/failures.py ``SERVE_HANDOFF`` reads it).
NOT_TAKEN = "Serve did not take the application"


def builder_name() -> str:
    """The name of the builder of this process's study: the driver's job id, shared by its trials and tasks."""
    import ray

    return BUILDER_PREFIX + ray.get_runtime_context().get_job_id()


def openai_app(llm_config: Mapping[str, Any], keep_ingress: bool, engine_version: str | None = None) -> Any:
    """Ray Serve LLM's OpenAI application of one ``llm_config`` (``build_openai_app``): its LLM deployment pinned to
    ``engine_version`` where given, its ingress to what it is built from where ``keep_ingress`` (serve/versions.py)."""
    from ray.serve.llm import build_openai_app

    app = build_openai_app({"llm_configs": [dict(llm_config)]})
    if engine_version is not None:
        pin_llm_servers(app, engine_version)
    if keep_ingress:  # routed as the LLM deployment is: a new router needs a new ingress (versions.pin_ingress)
        pin_ingress(app, router_config(llm_config))
    return app


def quiet_serve_logs() -> None:
    """Serve's and Ray Serve LLM's INFO lines would bury servetune's own progress."""
    for name in ("ray.serve", "ray.llm"):
        logging.getLogger(name).setLevel(logging.WARNING)


def send_app(
    name: str, app: Any, route_prefix: str, timeout_s: float = SEND_TIMEOUT_S, delete_late: bool = True
) -> float:
    """``serve.run_many`` the application ``app`` as ``name`` at ``route_prefix``, not waiting for it to run; the
    seconds that took (a deploy's clock starts when Serve is given the application, not when it was built).

    Bounded: a Serve that has not taken it within ``timeout_s`` (its controller not answering) raises
    :class:`EngineStartError` (:data:`NOT_TAKEN`, an infrastructure failure: trial/failures.py), the deploy's failure,
    and the hand-off, given up, deletes the application should Serve take it later (:class:`_Handoff`; at this
    process's exit too, :func:`_settle_handoffs`): nothing of a deploy its caller gave up stays on Serve.
    ``delete_late=False`` for an update of a running application (a rollout): one Serve takes late is a rollout
    late, and deleting it would take the running application down with it."""
    if name in handoffs_in_flight():  # its late end would delete (or replace) what this one gives: not both
        raise EngineStartError(f"{NOT_TAKEN} {name} yet: an earlier hand-off of it, given up, is still in flight")
    handoff = _Handoff(name, app, route_prefix, delete_late)
    start = time.monotonic()
    handoff.start()
    if not handoff.taken(timeout_s):
        late = "it is deleted should Serve take it later" if delete_late else "Serve may still apply it"
        raise EngineStartError(f"{NOT_TAKEN} {name} within {timeout_s:.0f} s (SEND_TIMEOUT_S, a timeout): given up, "
                               f"{late}")  # fmt: skip
    if handoff.error is not None:
        raise handoff.error
    return time.monotonic() - start


def handoffs_in_flight() -> list[str]:
    """The applications whose hand-off this process gave up and Serve has not taken yet (nor refused)."""
    return [t.name.removeprefix(HANDOFF_THREAD) for t in threading.enumerate() if t.name.startswith(HANDOFF_THREAD)]


class _Handoff(threading.Thread):
    """One ``serve.run_many`` in a thread of its own, so that its caller can stop waiting for it
    (:meth:`taken`): Ray cannot call back a call its controller was sent. A daemon, as a hung call must not keep the
    process from exiting (:func:`_settle_handoffs` waits for it a while at exit); one that returns after it was given
    up deletes the application it gave Serve (``delete_late``)."""

    def __init__(self, name: str, app: Any, route_prefix: str, delete_late: bool = True) -> None:
        super().__init__(name=HANDOFF_THREAD + name, daemon=True)
        self.app_name, self.app, self.route_prefix, self.delete_late = name, app, route_prefix, delete_late
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._done = self._given_up = False

    def run(self) -> None:
        from ray import serve
        from ray.serve.api import RunTarget

        try:
            target = RunTarget(target=self.app, name=self.app_name, route_prefix=self.route_prefix)
            serve.run_many([target], wait_for_applications_running=False)
        except BaseException as exc:  # the caller's to raise, as run_many's own
            self.error = exc
        with self._lock:
            self._done = True
            late = self._given_up and self.error is None
        if late and self.delete_late:  # its caller gave the deploy up (and failed it): the application must not stay
            _delete_given_up(self.app_name, "Serve took it after its hand-off was given up")
        elif late:
            logger.warning("servetune: Serve took the update of %s after its hand-off was given up", self.app_name)

    def taken(self, timeout_s: float) -> bool:
        """Whether Serve took the application (or refused it: :attr:`error`) within ``timeout_s``; if not, the
        hand-off is given up, atomically with the thread's own end."""
        self.join(timeout_s)
        with self._lock:
            self._given_up = not self._done
            if self._given_up:
                _settle_at_exit()
            return self._done


_settling: list[bool] = []  # whether _settle_handoffs is registered to run at exit (once)


def _settle_at_exit() -> None:
    if not _settling:
        _settling.append(True)
        atexit.register(_settle_handoffs)


def _delete_given_up(name: str, why: str) -> None:
    from ray import serve

    try:
        serve.delete(name, _blocking=False)
    except Exception as exc:  # Serve gone with its cluster: nothing of it stays either
        logger.warning("servetune: %s; deleting %s failed: %s", why, name, exc)
    else:
        logger.warning("servetune: %s; deleted %s", why, name)


def _settle_handoffs(wait_s: float = SEND_TIMEOUT_S) -> None:
    """At this process's exit, where a hand-off it gave up is still in flight (a daemon thread, which dies with the
    process): wait for them a while, the thread deleting what Serve takes, then delete the applications of those
    still not done, as Serve may yet take them after this process has gone (on a cluster, with its GPUs)."""
    deadline = time.monotonic() + wait_s
    for thread in [t for t in threading.enumerate() if t.name.startswith(HANDOFF_THREAD)]:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive() and isinstance(thread, _Handoff) and thread.delete_late:
            _delete_given_up(thread.app_name, "its hand-off still not taken at exit")


class AppBuilder:
    """The builder actor's class (see the module's doc): Ray Serve LLM imported when it starts, before the first
    trial asks.

    It builds one application at a time (a sync actor method, Ray's default ``max_concurrency`` of 1): two trials'
    builds queue, the second behind the first, and a build that hangs holds the queue (its callers each build their own
    after :data:`BUILD_TIMEOUT_S`). Kept so, not threaded: ``serve.run_many`` starts with ``serve_start``, whose twin
    Ray documents as not thread-safe ("This function is not thread-safe", ray/serve/_private/api.py
    ``serve_start_async``, Ray 2.60; ``serve_start`` checks and sets the same module-global client,
    ray/serve/context.py ``_set_global_client``, with no lock), and neither it nor ``build_openai_app`` is documented
    safe from several threads. A build's turn takes about a second (0.9-1.4 s measured, :data:`BUILD_TIMEOUT_S`), so
    a queue of a study's concurrent trials costs them seconds."""

    def __init__(self) -> None:
        import ray.serve.llm  # noqa: F401  # the import every build needs, done once and ahead of the first

        quiet_serve_logs()  # as the driver keeps them

    def run(
        self, name: str, llm_config: Mapping[str, Any], keep_ingress: bool, engine_version: str | None,
        route_prefix: str, deadline: float, delete_late: bool = True,
    ) -> float | None:  # fmt: skip
        """Build the application and give it to Serve (:func:`send_app`'s seconds), unless the wall clock is within
        :data:`SEND_MARGIN_S` of ``deadline`` (``time.time()``), when its caller stops waiting and builds it itself, or
        past it: then None, and nothing given to Serve, so that no late hand-off of this one replaces (same name) the
        application its caller gave. A hand-off Serve does not take within :data:`SEND_TIMEOUT_S` (before the
        deadline) fails the caller's deploy (:class:`EngineStartError`, raised in the caller as here), which so
        builds nothing itself. Asked while a hand-off it gave up is still in flight, it gives Serve nothing (None):
        its caller builds and hands off its own, bounded as every hand-off is, rather than the rest of a study
        failing behind one stuck call."""
        app = openai_app(llm_config, keep_ingress, engine_version)
        if time.time() > deadline - SEND_MARGIN_S:
            return None
        given_up = handoffs_in_flight()
        if given_up:  # Serve still holds the one it gave up: one ``serve.run_many`` at a time (see the class's doc)
            logger.warning("servetune: Serve has not taken %s since its hand-off was given up; %s is built by its "
                           "trial", ", ".join(given_up), name)  # fmt: skip
            return None
        return send_app(name, app, route_prefix, delete_late=delete_late)


def start_builder() -> Any:
    """Start the builder actor of this process (the study's driver), owned by it and named after its job; it takes no
    CPU Ray schedules by. Its handle is held until this process exits, which stops it (:func:`stop_builder`)."""
    import ray

    remote = ray.remote(num_cpus=0, max_restarts=0)(AppBuilder)
    handle = remote.options(name=builder_name(), get_if_exists=True, lifetime="non_detached").remote()
    atexit.register(stop_builder, handle)  # the handle kept while the driver runs: the trials look the builder up
    return handle


def stop_builder(handle: Any) -> None:
    """Stop the builder ``handle`` (gone already, with its Ray: nothing to do)."""
    import ray

    with contextlib.suppress(Exception):
        if ray.is_initialized():
            ray.kill(handle)


def run_openai_app(
    name: str, llm_config: Mapping[str, Any], keep_ingress: bool, engine_version: str | None, route_prefix: str,
    attached: bool, delete_late: bool = True,
) -> float:  # fmt: skip
    """Build the application of ``llm_config`` and give it to Serve (:func:`send_app`): through the study's builder
    where this process is attached to a study's cluster and the builder runs there and answers within
    :data:`BUILD_TIMEOUT_S`, else here. The seconds Serve took to take it (not those building it, nor those waiting
    for the builder). ``delete_late``: as :func:`send_app`'s (False for an update of a running application)."""
    if attached:
        import ray

        builder: Any
        try:
            builder = ray.get_actor(builder_name())
        except ValueError:  # none started: a driver that is not a study's (its own Serve builds here)
            builder = None
        if builder is not None:
            sent_s = _through(builder, name, llm_config, keep_ingress, engine_version, route_prefix, delete_late)
            if sent_s is not None:
                return sent_s
    return send_app(name, openai_app(llm_config, keep_ingress, engine_version), route_prefix, delete_late=delete_late)


def _through(
    builder: Any, name: str, llm_config: Mapping[str, Any], keep_ingress: bool, engine_version: str | None,
    route_prefix: str, delete_late: bool = True,
) -> float | None:  # fmt: skip
    """:func:`run_openai_app` by the builder: the seconds Serve took, or None (said why) where the caller builds it
    itself, the builder gone or not done within :data:`BUILD_TIMEOUT_S` (past which it drops the build itself)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    deadline = time.time() + BUILD_TIMEOUT_S  # on the builder's clock too, as Ray's nodes share the time of day
    try:
        sent_s = ray.get(
            builder.run.remote(
                name, dict(llm_config), keep_ingress, engine_version, route_prefix, deadline, delete_late
            ),
            timeout=BUILD_TIMEOUT_S,
        )
    except RayActorError as exc:  # it died
        logger.warning("servetune: the study's Serve builder is gone (%s); %s is built here",
                       type(exc).__name__, name)  # fmt: skip
        return None
    except RayTaskError as exc:  # the build failed: as it fails here, not as Ray's remote traceback
        if isinstance(exc.cause, BaseException):
            raise exc.cause from None
        raise
    except GetTimeoutError:
        sent_s = None
    if sent_s is None:  # not answered in time, or answered past its deadline (a clock ahead of this one's)
        logger.warning("servetune: the study's Serve builder did not give %s to Serve within %.0f s "
                       "(BUILD_TIMEOUT_S, a timeout); it is built here", name, BUILD_TIMEOUT_S)  # fmt: skip
        return None
    return float(sent_s)
