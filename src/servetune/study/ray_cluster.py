"""Joining a Ray cluster, or starting a local one, for a study (``servetune run``).

A local cluster is started as every servetune command starts one (:mod:`servetune.local_ray`: a token of
its own, never written to ``~/.ray``). Joining a cluster that asks for a token this process will not send
fails at once, in one line that says what to set, instead of twenty seconds of retries and a traceback:
Ray 2.60's ``ray.init(address=...)`` sends the token only when ``RAY_AUTH_MODE=token`` is set.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

from servetune import local_ray
from servetune.config.space import SERVE_REPLICAS
from servetune.errors import UserError

if TYPE_CHECKING:
    from servetune.config.space import SearchSpace


def token_refused_message(address: str, environ: MutableMapping[str, str] | None = None) -> str:
    """The one line for a cluster that refused this process: what to set, given what is set."""
    environ = os.environ if environ is None else environ
    if (environ.get(local_ray.AUTH_MODE) or "").lower() != "token":
        return (
            f"the Ray cluster at {address} requires token authentication: set RAY_AUTH_MODE=token "
            "(Ray then sends the token in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
        )
    return (
        f"the Ray cluster at {address} refused this token: set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the "
        "cluster's token (`ray get-auth-token` on its head prints it)"
    )


def check_token_accepted(address: str) -> None:
    """Raise :class:`UserError` in one line if the cluster at ``address`` (host:port) refuses us.

    One quick call to the cluster's GCS, with the token this process would send; anything but a
    refusal (the cluster unreachable, a ``ray://`` address) is left for ``ray.init`` to report.
    """
    if "://" in address or address in ("auto", "local"):
        return
    from ray._raylet import GcsClient  # type: ignore[attr-defined]  # compiled in; ray's _raylet.pyi omits it
    from ray.exceptions import AuthenticationError

    try:
        with _stderr_silenced():  # Ray's C++ client logs each refused attempt
            GcsClient(address=address)
    except AuthenticationError:
        raise UserError(token_refused_message(address)) from None
    except Exception:  # not ours to judge: ray.init reports it in its own words
        return


def init_ray(address: str | None, local_cpus: int | None = None) -> bool:
    """Join ``address`` (else ``$RAY_ADDRESS``, as inside ``ray job submit``), else start a local cluster;
    whether it started one. ``local_cpus``: the CPUs a local cluster declares (default: the cores), for
    Serve replicas (:data:`~servetune.local_ray.SERVE_SYSTEM_CONFIG`; on the CPU build each claims a core per
    rank, serve/cores.py)."""
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"logging_level": "WARNING", "log_to_driver": False, "configure_logging": True}
    joining = address or os.environ.get("RAY_ADDRESS")
    if joining:
        check_token_accepted(joining)
    try:
        if joining:
            with local_ray.keeping_sigterm():
                ray.init(address=address, **kwargs)  # None: $RAY_ADDRESS's
        else:
            _start_local(local_cpus, kwargs)
    except Exception as exc:  # Ray raises plain Exception when its processes do not come up
        with contextlib.suppress(Exception):
            ray.shutdown()  # what this ray.init started, stopped
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        where = f"cannot join the Ray cluster at {joining}" if joining else "could not start a local Ray cluster"
        raise UserError(f"{where}: {lines[0]}") from None
    return not joining


def local_serve_cpus(space: SearchSpace) -> int:
    """The CPUs a local Ray declares for a study through Serve: its largest trial's replicas (each its
    engine's CPU bundles, one per rank on the CPU build, and the replica actor's one), Serve's OpenAI
    ingress and the trial's load client, for each trial in flight; at least the host's cores. Ray schedules
    by these, not by the cores vLLM runs on: with two on this host, the ingress would wait for a CPU forever."""
    from servetune.serve.plan import INGRESS_CPUS, REPLICA_ACTOR_CPUS
    from servetune.study.packing import resolve_max_concurrent

    try:
        points, _ = space.grid()
    except (ValueError, UserError):  # a continuous range: the largest replica a node holds
        points = []
    counts = space.params[SERVE_REPLICAS]
    assert isinstance(counts, list)  # the space's validator takes only a list of counts
    replicas = max(counts)
    per_engine = max((space.replica_devices(p) for p in points), default=space.hardware.devices_per_node)
    per_replica = (per_engine if space.device == "cpu" else 0) + REPLICA_ACTOR_CPUS
    at_once = resolve_max_concurrent(space, space.hardware.devices_per_node)  # a local Ray: one node
    return max(int(at_once * (replicas * per_replica + INGRESS_CPUS + 1)), os.cpu_count() or 1)


def _start_local(local_cpus: int | None, kwargs: dict[str, Any]) -> None:
    if local_cpus is not None:
        from servetune.serve.plan import CLAIM_CORES_ENV

        kwargs.update(num_cpus=local_cpus, _system_config=local_ray.SERVE_SYSTEM_CONFIG)
        os.environ[CLAIM_CORES_ENV] = "1"  # its workers inherit it: CPU replicas claim a core per rank
    # A new Ray on this machine, even where a `ray start` runs here (--address joins one; and with the CPUs
    # declared, joining would fail in Ray's words).
    local_ray.start_local_ray(**kwargs)


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """File descriptor 2 to /dev/null for a moment (C++ logging does not go through ``sys.stderr``)."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
