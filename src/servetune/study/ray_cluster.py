"""Joining a Ray cluster, or starting a local one, and Ray's token authentication (Ray 2.60).

Ray 2.60 turns token authentication on for a local ``ray.init()`` and, when the user has no
token yet, writes one to ``~/.ray/auth_token``. From then on every ``ray start --head`` on the
machine enables token authentication (it finds that file), while ``ray job submit`` and
``ray.init(address=...)`` send the token only when ``RAY_AUTH_MODE=token`` is set: the README's
cluster commands are refused ("Token authentication is enabled but no authentication token was
found") after one local study. So:

- the local cluster of a study keeps token authentication, with a token that lives in this
  process's environment (and its workers') for as long as the study, not in ``~/.ray``;
- joining a cluster that asks for a token this process will not send fails at once, in one line
  that says what to set, instead of twenty seconds of retries and a traceback.

A user's own choice (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, or a token
already in ``~/.ray/auth_token``) is left as it is.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

from servetune.errors import UserError

AUTH_MODE = "RAY_AUTH_MODE"
AUTH_TOKEN = "RAY_AUTH_TOKEN"
AUTH_TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"


def default_token_path() -> Path:
    """Where Ray keeps a user's token (``ray get-auth-token --generate`` writes it there too)."""
    return Path.home() / ".ray" / "auth_token"


def token_for_local_cluster(environ: MutableMapping[str, str] | None = None) -> bool:
    """Give a new local cluster a token of its own in ``environ``, so Ray writes none to ``~/.ray``.

    Returns whether it did: not when the user set an authentication mode or token, or already has
    ``~/.ray/auth_token`` (Ray then uses that one, as it would without servetune).
    """
    environ = os.environ if environ is None else environ
    if any(environ.get(name) for name in (AUTH_MODE, AUTH_TOKEN, AUTH_TOKEN_PATH)) or default_token_path().exists():
        return False
    from ray._private.authentication.authentication_token_generator import generate_new_authentication_token

    # RAY_AUTH_MODE stays unset: ray.init() turns token mode on itself for a new local cluster
    # (and refreshes its cached config, which setting the variable here would not).
    environ[AUTH_TOKEN] = generate_new_authentication_token()
    return True


def token_refused_message(address: str, environ: MutableMapping[str, str] | None = None) -> str:
    """The one line for a cluster that refused this process: what to set, given what is set."""
    environ = os.environ if environ is None else environ
    if (environ.get(AUTH_MODE) or "").lower() != "token":
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


#: A local Ray that runs Serve replicas to be measured: its metrics agent reports every second (the
#: replicas' request counts are read from it), and its workers run at niceness 0, not Ray's 15. A Serve
#: replica's engine inherits its worker's niceness; at 15 it lost the CPU to the load client and Ray's
#: daemons on the two-core stand-in, where a bare engine started by servetune runs at 0.
SERVE_SYSTEM_CONFIG = {"metrics_report_interval_ms": 1000, "worker_niceness": 0}


def init_ray(address: str | None, local_cpus: int | None = None) -> bool:
    """Join ``address`` (else ``$RAY_ADDRESS``, as inside ``ray job submit``), else start a local cluster;
    whether it started one. ``local_cpus``: the CPUs a local cluster declares (default: the cores), for
    Serve replicas (:data:`SERVE_SYSTEM_CONFIG`; on the CPU build each claims a core per rank, serve/cores.py)."""
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"logging_level": "WARNING", "log_to_driver": False, "configure_logging": True}
    joining = address or os.environ.get("RAY_ADDRESS")
    if joining:
        check_token_accepted(joining)
    else:
        token_for_local_cluster()
    try:
        with keeping_sigterm():
            _init(ray, joining, address, local_cpus, kwargs)
    except Exception as exc:  # Ray raises plain Exception when its processes do not come up
        with contextlib.suppress(Exception):
            ray.shutdown()  # what this ray.init started, stopped
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        where = f"cannot join the Ray cluster at {joining}" if joining else "could not start a local Ray cluster"
        raise UserError(f"{where}: {lines[0]}") from None
    return not joining


@contextlib.contextmanager
def keeping_sigterm() -> Iterator[None]:
    """The process's SIGTERM handler as it was before: a ``ray.init`` that starts a local Ray installs its own
    (``sys.exit(15)``), and the command's (exit 128 + 15, teardown on the way) must stay."""
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if (
            before is not None
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is not before
        ):
            signal.signal(signal.SIGTERM, before)


def _init(ray: Any, joining: str | None, address: str | None, local_cpus: int | None, kwargs: dict[str, Any]) -> None:
    if joining:
        ray.init(address=address, **kwargs) if address else ray.init(**kwargs)
        return
    if local_cpus is not None:
        from servetune.serve.plan import CLAIM_CORES_ENV

        kwargs.update(num_cpus=local_cpus, _system_config=SERVE_SYSTEM_CONFIG)
        os.environ[CLAIM_CORES_ENV] = "1"  # its workers inherit it: CPU replicas claim a core per rank
    # "local": a new Ray on this machine, even where a `ray start` runs here (--address joins one; and with
    # the CPUs declared, joining would fail in Ray's words).
    ray.init(address="local", include_dashboard=False, **kwargs)


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
