"""Starting a Ray of this machine's own from a servetune process: the rules every command and bench
script that does so follows (``run``'s study, ``verify`` and ``serve-check`` through Serve, the bench
scripts). It imports Ray only when called, and of servetune's only ``env_vars`` (below every room): every room may
use it.

Ray 2.60 turns token authentication on for a local ``ray.init()`` and, when the user has no
token yet, writes one to ``~/.ray/auth_token``. From then on every ``ray start --head`` on the
machine enables token authentication (it finds that file), while ``ray job submit`` and
``ray.init(address=...)`` send the token only when ``RAY_AUTH_MODE=token`` is set: the README's
cluster commands are refused ("Token authentication is enabled but no authentication token was
found") after one local command. So a local Ray started here keeps token authentication, with a
token that lives in this process's environment (and its workers') for as long as the process, not
in ``~/.ray``. A user's own choice (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``,
or a token already in ``~/.ray/auth_token``) is left as it is.

On a busy host a local start can time out in Ray's own fixed wait (:data:`STARTUP_TIMED_OUT`): that start is
stopped, by the ids of the processes it left, and made again (:func:`start_retrying`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from servetune.env_vars import env_defaults

logger = logging.getLogger(__name__)

AUTH_MODE = "RAY_AUTH_MODE"
AUTH_TOKEN = "RAY_AUTH_TOKEN"
AUTH_TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"

#: A local Ray that runs Serve replicas to be measured: its metrics agent reports every second (the
#: replicas' request counts are read from it), and its workers run at niceness 0, not Ray's 15. A Serve
#: replica's engine inherits its worker's niceness; at 15 it lost the CPU to the load client and Ray's
#: daemons on the two-core stand-in, where a bare engine started by servetune runs at 0.
SERVE_SYSTEM_CONFIG = {"metrics_report_interval_ms": 1000, "worker_niceness": 0}

#: What Ray 2.60 raises (a plain ``Exception``) when a new node's raylet has not registered with its GCS within 30 s
#: of its start (``ray/_private/node.py``: ``raylet_start_wait_time_s = 30``, a literal that no config or environment
#: variable sets). Seen on this two-core host at a load of ~10 (integration tier at ``-n 3``): a Ray slow to start.
STARTUP_TIMED_OUT = "The current node timed out during startup"
#: Starts of a local Ray, the first included, before its timing out is the caller's (each waits Ray's 30 s again).
START_TRIES = 3
#: Ray's wait for its new GCS to write its port (``RAY_gcs_server_port_wait_time_s``, read by ``ray.init``; 30 s by
#: default, 120 s where Ray itself expects a slow GCS): a local start waits 120 s unless the user set it.
GCS_PORT_WAIT = "RAY_gcs_server_port_wait_time_s"
GCS_PORT_WAIT_S = "120"


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
    A start that times out in Ray's fixed wait is stopped and made again (:func:`start_retrying`). What it raises
    is Ray's; the caller says it in its own words and stops what was started (``ray.shutdown``).
    """
    import ray

    token_for_local_cluster()

    def start() -> None:
        with keeping_sigterm(), env_defaults({GCS_PORT_WAIT: GCS_PORT_WAIT_S}):
            ray.init(address="local", **{"include_dashboard": False, **init_kwargs})

    start_retrying(start, ChildProcesses)


def start_timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` is Ray's start timing out in its fixed wait for the raylet (:data:`STARTUP_TIMED_OUT`), and
    not another failure (a port taken, a bad argument, the GCS dying), which a second start would not mend."""
    return type(exc) is Exception and STARTUP_TIMED_OUT in str(exc)


class Started(Protocol):
    def stop(self) -> int:
        """Stop what was started since this was made; how many processes that was."""
        ...


def start_retrying(start: Callable[[], None], watch: Callable[[], Started], tries: int = START_TRIES) -> None:
    """``start()``, watched by ``watch()`` (made just before each try); where it times out in Ray's fixed wait
    (:func:`start_timed_out`), what it started is stopped and it is made again, each time saying so in one warning
    line, up to ``tries`` starts in all; the last one's timing out is stopped too, and raised. Any other failure is
    raised as Ray raised it, at once.

    A retry, not a longer wait: Ray 2.60 sets the wait in code (:data:`STARTUP_TIMED_OUT`), and a timed-out
    ``ray.init`` leaves the processes it started running (its node was never recorded, so ``ray.shutdown`` does not
    know them)."""
    for attempt in range(1, tries + 1):
        started = watch()
        try:
            start()
            return
        except Exception as exc:
            if not start_timed_out(exc):
                raise
            stopped = started.stop()  # nothing else would: ray.shutdown does not know them
            if attempt == tries:
                raise
            logger.warning(
                "servetune: the local Ray did not start within Ray's 30 s (a busy host?); stopped the %d processes "
                "it started and starting it again (try %d of %d)", stopped, attempt + 1, tries,
            )  # fmt: skip


class ChildProcesses:
    """This process's children started after this was made whose command line names ``owner`` (by default Ray's
    package directory: its GCS server, raylet, dashboard and monitors all run from there), and their descendants:
    what a ``ray.init`` started (Ray starts its GCS, raylet and the rest as children of the process that calls it;
    the raylet starts its workers and agents). A child of another kind started meanwhile (by another thread of this
    process) is not Ray's and is left alone."""

    def __init__(self, owner: str | None = None) -> None:
        import psutil

        if owner is None:
            import ray

            owner = os.path.dirname(ray.__file__)
        self.owner = owner
        self.before = {child.pid for child in psutil.Process().children()}

    def stop(self) -> int:
        """SIGTERM them (a stopped one is also sent SIGCONT to act on it), SIGKILL what is left after 5 s; reaped."""
        import psutil

        procs = []
        for child in psutil.Process().children():
            with contextlib.suppress(psutil.Error):
                if child.pid not in self.before and any(self.owner in arg for arg in child.cmdline()):
                    procs += [child, *child.children(recursive=True)]
        stop_processes(procs, grace_s=5.0)
        return len(procs)


def stop_processes(procs: list[Any], grace_s: float) -> None:
    """SIGTERM the ``procs`` (psutil processes, parents before their children: the last first), a stopped one also
    sent SIGCONT to act on it; SIGKILL what is left after ``grace_s``; reaped. Those gone already are passed over."""
    import psutil

    for proc in reversed(procs):
        with contextlib.suppress(psutil.Error):
            proc.terminate()
            proc.resume()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace_s)


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
