"""Where MLflow lives, whether it answers, and how long a study may wait for it.

The tracking URI is ``--tracking-uri``, else ``$MLFLOW_TRACKING_URI``, else MLflow's own local
default ``sqlite:///mlflow.db`` in the current directory, made absolute so that a callback
Tune restores later still writes to the same file. A study records the URI it logged to in its
``study.json`` (credentials left out), and what works on the study later (``verify``, ``report
--log-to-mlflow``, ``run --resume``) writes there unless told otherwise (:func:`study_tracking_uri`):
never to a store the user did not name. A remote server is asked ``/health`` with a
short timeout before anything is logged, so an unreachable server costs seconds, not MLflow's
minutes of retries.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

from mlflow.exceptions import MlflowException

from servetune.env_vars import env_defaults
from servetune.results import STUDY_FILE

if TYPE_CHECKING:
    from mlflow import MlflowClient

#: MLflow's default local store (MLflow 3), relative to the current directory.
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"

_RETRIES = "MLFLOW_HTTP_REQUEST_MAX_RETRIES"
_TIMEOUT = "MLFLOW_HTTP_REQUEST_TIMEOUT"
_BACKOFF = "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"
_QUIET = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"


class TrackingError(Exception):
    """MLflow refused what servetune asked (``str()`` is one line saying what to do)."""


class TrackingUnavailable(TrackingError):
    """MLflow cannot be reached; ``str()`` is one line naming the URI and the cause."""


#: What a failed tracking call raises: ours, MLflow's own (it wraps HTTP failures), I/O errors.
TRACKING_ERRORS: tuple[type[BaseException], ...] = (TrackingError, MlflowException, OSError)


def resolve_tracking_uri(uri: str | None = None) -> str:
    """The URI to log to: the argument, else ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<cwd>/mlflow.db``."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/") and ":memory:" not in uri:
        return prefix + str(Path(uri[len(prefix) :]).resolve())
    if "://" not in uri and uri not in ("databricks", "databricks-uc"):
        return Path(uri).resolve().as_uri()  # a bare directory: MLflow's file store
    return uri


def without_credentials(uri: str) -> str:
    """``uri`` without the ``user:password@`` a server URI may carry: what a study may write down.
    (MLflow reads credentials from ``$MLFLOW_TRACKING_USERNAME``/``PASSWORD`` or ``$MLFLOW_TRACKING_TOKEN``.)"""
    parts = urllib.parse.urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def recorded_tracking_uri(study_dir: Path) -> str | None:
    """The tracking URI the study at ``study_dir`` recorded in its ``study.json`` (None: none recorded, or no file)."""
    try:
        recorded = json.loads((Path(study_dir) / STUDY_FILE).read_text(encoding="utf-8")).get("tracking_uri")
    except (OSError, ValueError, AttributeError):
        return None
    return recorded if isinstance(recorded, str) and recorded else None


def study_tracking_uri(study_dir: Path, given: str | None) -> str:
    """Where work on a study logs: ``given`` (``--tracking-uri``), else the store the study recorded, else
    :func:`resolve_tracking_uri`'s default."""
    return resolve_tracking_uri(given or recorded_tracking_uri(study_dir))


def is_remote(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def unreachable_reason(uri: str, timeout_s: float = 3.0) -> str | None:
    """None when a tracking server answers ``GET /health`` (any HTTP status), else why not.

    Only ``http(s)://`` URIs are checked; a local store is checked by using it.
    """
    if not is_remote(uri):
        return None
    request = urllib.request.Request(uri.rstrip("/") + "/health", method="GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            return None
    except urllib.error.HTTPError:
        return None  # it answered: a proxy or an auth layer in front of /health, but reachable
    except urllib.error.URLError as exc:
        return _short(exc.reason)
    except (OSError, ValueError) as exc:  # timeouts, resets, a malformed URL
        return _short(exc)


def check_reachable(uri: str, timeout_s: float = 3.0) -> None:
    reason = unreachable_reason(uri, timeout_s)
    if reason is not None:
        raise TrackingUnavailable(f"MLflow at {uri} is unreachable ({reason})")


def reachable_client(uri: str) -> MlflowClient:
    """A client of the store at ``uri``, once a remote server has answered (:func:`check_reachable`)."""
    check_reachable(uri)
    from mlflow import MlflowClient

    return MlflowClient(uri)


def log_to_study(tracking_uri: str | None, study: str, what: str, log: Callable[[MlflowClient, str], str],
                 no_store_hint: str = "") -> str:  # fmt: skip
    """Log ``what`` into the existing experiment of ``study`` at ``tracking_uri``: ``log(client, experiment_id)``
    does it (MLflow's retries bounded) and says what it did. Returns one line, ``MLflow <uri>: `` and that, or why
    ``what`` was not logged (a SQLite file that is not there, with ``no_store_hint`` after; a server that does not
    answer; no experiment of that name; MLflow failing), never raising for MLflow: the file on disk holds
    everything either way."""
    uri = resolve_tracking_uri(tracking_uri)
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not Path(uri[len(prefix) :]).is_file():
        return f"MLflow: no store at {uri} (the study was not logged there): {what} not logged{no_store_hint}"
    try:
        with mlflow_env(bounded=True):
            client = reachable_client(uri)
            experiment = client.get_experiment_by_name(study)
            if experiment is None:
                return f"MLflow {uri}: no experiment '{study}': {what} not logged"
            return f"MLflow {uri}: {log(client, experiment.experiment_id)}"
    except TRACKING_ERRORS as exc:
        return f"MLflow {uri}: {what} not logged ({describe_error(exc)})"


def describe_error(exc: BaseException) -> str:
    """A tracking failure as one short line (MLflow's messages run to many lines of retries)."""
    return _short(exc)


def _short(cause: object, limit: int = 200) -> str:
    text = " ".join(str(cause).split()) or type(cause).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def mlflow_env(bounded: bool = False) -> AbstractContextManager[None]:
    """Settings MLflow reads on every call, for the duration; values the user set are left alone
    (:func:`servetune.env_vars.env_defaults`).

    Always: no "View run at" lines on stdout (MLflow prints two per finished run on a server).
    With ``bounded``: at most one retry and 60 s per HTTP request. MLflow's defaults (7 retries
    with exponential backoff, 120 s timeouts) would let a server that dies mid-study hold the
    Tune driver for minutes.
    """
    wanted = {_QUIET: "true"}
    if bounded:
        wanted.update({_RETRIES: "1", _TIMEOUT: "60", _BACKOFF: "1"})
    return env_defaults(wanted)
