"""What each Serve replica's core claim got on the CPU build, from the replica to the trial that deployed it.

A replica's :class:`~servetune.serve.cores.ClaimCores` callback tells its claim (``cpu_binding``, or
``cpu_unclaimed`` and why: a bare engine's words, trial/runner.py ``cores_record``) to Ray's key-value store in the
GCS, under the application's name and Serve's unique id of the replica; the trial reads those of the replicas that
run (``ServeCluster.replica_claims``) and forgets the application's when it ends. Not through the ``LLMConfig`` the
replica holds: Serve hands that back pickled with the engine configuration Ray Serve LLM resolved in the replica,
and unpickling it imports vLLM (about 8 core-seconds in a trial's worker, which otherwise never imports it).
Ray is imported where it is used: a replica's callback and a driver attached to Ray both have it.

Beside its claim, under a sibling key, the same callback tells what the replica was started with: its ``LLMConfig``'s
engine arguments and runtime environment variables (:func:`started_with`), which a rollout's check compares with what
was deployed (serve/trial.py ``replicas_started``), again without unpickling a replica's ``LLMConfig``. Secrets are
never stored: the value of an environment variable whose name says it is one (``HF_TOKEN``, ``*_API_KEY``:
secrets.py's rule), or of a credential engine argument (``api_key``, ``hf_token`` as text), is kept as its SHA-256
hash only, which the reader compares with the hash of what it deployed.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from servetune.secrets import is_secret_engine_arg, is_secret_env

logger = logging.getLogger(__name__)

#: The key-value store's namespace of servetune's claims, apart from Ray's and Serve's own keys.
NAMESPACE = "servetune-core-claims"
#: The sibling key (after the replica's) of what a replica was started with (:func:`tell_started`).
STARTED = "started"
#: How a secret's value is kept: this prefix and its SHA-256 (hex).
HASHED = "sha256:"


def _key(app: str, replica: str = "", what: str = "") -> str:
    return f"{app}/{replica}" + (f"/{what}" if what else "")


def _put(what: str, record: Mapping[str, Any], about: str) -> None:
    from ray import serve
    from ray.experimental.internal_kv import _internal_kv_put

    try:
        context = serve.get_replica_context()
        key = _key(context.app_name, context.replica_id.unique_id, what)
        _internal_kv_put(key, json.dumps(record), namespace=NAMESPACE)
    except Exception as exc:  # the replica runs as it does; only what it tells is lost
        logger.warning("servetune: could not keep %s (%s)", about, exc)


def _get(app: str, replicas: Iterable[str], what: str) -> list[dict[str, Any]]:
    from ray.experimental.internal_kv import _internal_kv_get

    found = []
    for replica in replicas:
        value = _internal_kv_get(_key(app, replica, what), namespace=NAMESPACE)
        found.append(json.loads(value) if value else {})
    return found


def tell(record: dict[str, str]) -> None:
    """In a replica: keep ``record`` (what its claim got) under its application's name and its unique id. A process
    that is no Serve replica (Serve's context missing), or a store that cannot be reached, keeps nothing: the trial
    then records nothing of the replica's cores."""
    _put("", record, "what this replica's core claim got")


def told(app: str, replicas: Iterable[str]) -> list[dict[str, str]]:
    """What each of the application's ``replicas`` (Serve's unique ids) told, in their order (``{}``: nothing, as a
    replica without the callback, on GPUs)."""
    return _get(app, replicas, "")


def replica_cores(told: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """A trial's ``cpu_binding`` and ``cpu_unclaimed`` (trial/runner.py ``cores_record``) from what each replica's
    claim got on the CPU build (serve/cores.py; :func:`told`, in the order Serve's replicas answered; ``{}``: one that
    told nothing, as on GPUs): the replicas' bindings with ``, `` between them (``|`` between one's ranks, ``auto`` for one
    left to vLLM's binding), and why each replica that claimed no cores of its own did, named by its place."""
    told = [record for record in told if record]
    bindings = [record.get("cpu_binding") or "auto" for record in told]
    why = [(f"replica {i} of {len(told)}: " if len(told) > 1 else "") + record["cpu_unclaimed"]
           for i, record in enumerate(told, 1) if record.get("cpu_unclaimed")]  # fmt: skip
    found = {"cpu_binding": ", ".join(bindings) if any(b != "auto" for b in bindings) else "",
             "cpu_unclaimed": "; ".join(why)}  # fmt: skip
    return {key: value for key, value in found.items() if value}


def running_cores(cluster: Any, app: str) -> dict[str, str]:
    """:func:`replica_cores` of the application's running LLM replicas, read through ``cluster``'s
    ``replica_claims`` (serve/cluster.py): on the CPU build in a local Ray, the cores each replica's engine claimed.
    Empty where no replica told (GPUs, a cluster joined) or the store cannot be read: the replicas' cores are a note
    of the record, never a reason to stop measuring."""
    try:
        return replica_cores(cluster.replica_claims(app))
    except Exception:
        return {}


def _hashed(value: Any) -> str:
    return HASHED + hashlib.sha256(str(value).encode()).hexdigest()


def started_with(engine_kwargs: Mapping[str, Any], env_vars: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"engine_kwargs": ..., "env_vars": ...}`` as a replica tells them and a reader compares them: JSON's types
    (what the store gives back), and every secret's value as :data:`HASHED` and its hash."""
    record = {
        "engine_kwargs": {k: _hashed(v) if is_secret_engine_arg(k, v) else v for k, v in engine_kwargs.items()},
        "env_vars": {k: _hashed(v) if is_secret_env(k) else v for k, v in env_vars.items()},
    }
    found: dict[str, dict[str, Any]] = json.loads(json.dumps(record, default=str))
    return found


def tell_started(llm_config: Any) -> None:
    """In a replica: keep what its ``LLMConfig`` starts it with (:func:`started_with`), beside its claim (none: told
    nothing, so a reader asks the replica's ``LLMConfig`` itself)."""
    if llm_config is None:
        return
    try:
        record = started_with(dict(getattr(llm_config, "engine_kwargs", None) or {}),
                              dict((getattr(llm_config, "runtime_env", None) or {}).get("env_vars") or {}))  # fmt: skip
    except Exception as exc:  # an LLMConfig of another shape: told nothing, read as before
        logger.warning("servetune: could not read what this replica was started with (%s)", exc)
        return
    _put(STARTED, record, "what this replica was started with")


def told_started(app: str, replicas: Iterable[str]) -> list[dict[str, dict[str, Any]]]:
    """What each of ``replicas`` was started with, as it told it (:func:`tell_started`; ``{}``: nothing, as a replica
    without the callback, on GPUs or on a cluster servetune joined, or one of a servetune that did not tell it)."""
    return _get(app, replicas, STARTED)


def forget(app: str) -> None:
    """Drop every claim the application's replicas told, and what they were started with (the trial that deployed it
    has ended)."""
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(_key(app), del_by_prefix=True, namespace=NAMESPACE)
