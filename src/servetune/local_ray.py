"""Starting a Ray of this machine's own from a servetune process: the rules every command and bench
script that does so follows (``run``'s study, ``verify`` and ``serve-check`` through Serve, the bench
scripts). It imports Ray only when called, and nothing of servetune's: every room may use it.

Ray 2.60 turns token authentication on for a local ``ray.init()`` and, when the user has no
token yet, writes one to ``~/.ray/auth_token``. From then on every ``ray start --head`` on the
machine enables token authentication (it finds that file), while ``ray job submit`` and
``ray.init(address=...)`` send the token only when ``RAY_AUTH_MODE=token`` is set: the README's
cluster commands are refused ("Token authentication is enabled but no authentication token was
found") after one local command. So a local Ray started here keeps token authentication, with a
token that lives in this process's environment (and its workers') for as long as the process, not
in ``~/.ray``. A user's own choice (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``,
or a token already in ``~/.ray/auth_token``) is left as it is.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

AUTH_MODE = "RAY_AUTH_MODE"
AUTH_TOKEN = "RAY_AUTH_TOKEN"
AUTH_TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"

#: A local Ray that runs Serve replicas to be measured: its metrics agent reports every second (the
#: replicas' request counts are read from it), and its workers run at niceness 0, not Ray's 15. A Serve
#: replica's engine inherits its worker's niceness; at 15 it lost the CPU to the load client and Ray's
#: daemons on the two-core stand-in, where a bare engine started by servetune runs at 0.
SERVE_SYSTEM_CONFIG = {"metrics_report_interval_ms": 1000, "worker_niceness": 0}


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


def start_local_ray(**init_kwargs: Any) -> None:
    """``ray.init`` of a new Ray on this machine, without the dashboard, as servetune starts one: with a token of
    its own (:func:`token_for_local_cluster`) and the process's SIGTERM handler kept (:func:`keeping_sigterm`).

    "local": a new Ray here even where ``$RAY_ADDRESS`` or a ``ray start`` names another. ``init_kwargs`` go to
    ``ray.init`` (``num_cpus``, ``log_to_driver``, ``_system_config=SERVE_SYSTEM_CONFIG`` for Serve replicas...).
    What it raises is Ray's; the caller says it in its own words and stops what was started (``ray.shutdown``).
    """
    import ray

    token_for_local_cluster()
    with keeping_sigterm():
        ray.init(address="local", **{"include_dashboard": False, **init_kwargs})


@contextmanager
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
