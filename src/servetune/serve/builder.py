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
the trial's. A trial that finds no live builder (it died) builds the application itself, as before, and says so.
Taking no CPU, it runs where Ray places it, mostly the driver's node (a ``ray job submit``'s: the head's), which so
needs Ray Serve LLM and vLLM importable, as the images Ray Serve LLM documents have on every node; where they are not,
it dies starting and each trial builds its own, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

from servetune.serve.routing import router_config
from servetune.serve.versions import pin_ingress, pin_llm_servers

logger = logging.getLogger(__name__)

#: The builder actor's name, before the driver's job id (:func:`builder_name`).
BUILDER_PREFIX = "servetune-serve-builder-"


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


def send_app(name: str, app: Any, route_prefix: str) -> float:
    """``serve.run_many`` the application ``app`` as ``name`` at ``route_prefix``, not waiting for it to run; the
    seconds that took (a deploy's clock starts when Serve is given the application, not when it was built)."""
    from ray import serve
    from ray.serve.api import RunTarget

    start = time.monotonic()
    serve.run_many([RunTarget(target=app, name=name, route_prefix=route_prefix)], wait_for_applications_running=False)
    return time.monotonic() - start


class AppBuilder:
    """The builder actor's class (see the module's doc): Ray Serve LLM imported when it starts, before the first
    trial asks."""

    def __init__(self) -> None:
        import ray.serve.llm  # noqa: F401  # the import every build needs, done once and ahead of the first

        quiet_serve_logs()  # as the driver keeps them

    def run(
        self, name: str, llm_config: Mapping[str, Any], keep_ingress: bool, engine_version: str | None,
        route_prefix: str,
    ) -> float:  # fmt: skip
        return send_app(name, openai_app(llm_config, keep_ingress, engine_version), route_prefix)


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
    attached: bool,
) -> float:  # fmt: skip
    """Build the application of ``llm_config`` and give it to Serve (:func:`send_app`): through the study's builder
    where this process is attached to a study's cluster and the builder runs there, else here. The seconds Serve took
    to take it (not those building it, nor those waiting for the builder)."""
    if attached:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        builder: Any
        try:
            builder = ray.get_actor(builder_name())
        except ValueError:  # none started: a driver that is not a study's (its own Serve builds here)
            builder = None
        if builder is not None:
            try:
                return float(
                    ray.get(builder.run.remote(name, dict(llm_config), keep_ingress, engine_version, route_prefix))
                )
            except RayActorError as exc:  # it died
                logger.warning("servetune: the study's Serve builder is gone (%s); %s is built here",
                               type(exc).__name__, name)  # fmt: skip
            except RayTaskError as exc:  # the build failed: as it fails here, not as Ray's remote traceback
                if isinstance(exc.cause, BaseException):
                    raise exc.cause from None
                raise
    return send_app(name, openai_app(llm_config, keep_ingress, engine_version), route_prefix)
