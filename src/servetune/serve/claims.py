"""What each Serve replica's core claim got on the CPU build, from the replica to the trial that deployed it.

A replica's :class:`~servetune.serve.cores.ClaimCores` callback tells its claim (``cpu_binding``, or
``cpu_unclaimed`` and why: a bare engine's words, trial/runner.py ``cores_record``) to Ray's key-value store in the
GCS, under the application's name and Serve's unique id of the replica; the trial reads those of the replicas that
run (``ServeCluster.replica_claims``) and forgets the application's when it ends. Not through the ``LLMConfig`` the
replica holds: Serve hands that back pickled with the engine configuration Ray Serve LLM resolved in the replica,
and unpickling it imports vLLM (about 8 core-seconds in a trial's worker, which otherwise never imports it).
Ray is imported where it is used: a replica's callback and a driver attached to Ray both have it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence

logger = logging.getLogger(__name__)

#: The key-value store's namespace of servetune's claims, apart from Ray's and Serve's own keys.
NAMESPACE = "servetune-core-claims"


def _key(app: str, replica: str = "") -> str:
    return f"{app}/{replica}"


def tell(record: dict[str, str]) -> None:
    """In a replica: keep ``record`` (what its claim got) under its application's name and its unique id. A process
    that is no Serve replica (Serve's context missing), or a store that cannot be reached, keeps nothing: the trial
    then records nothing of the replica's cores."""
    from ray import serve
    from ray.experimental.internal_kv import _internal_kv_put

    try:
        context = serve.get_replica_context()
        _internal_kv_put(_key(context.app_name, context.replica_id.unique_id), json.dumps(record), namespace=NAMESPACE)
    except Exception as exc:  # the claim itself stands; only its record is lost
        logger.warning("servetune: could not keep what this replica's core claim got (%s)", exc)


def told(app: str, replicas: Iterable[str]) -> list[dict[str, str]]:
    """What each of the application's ``replicas`` (Serve's unique ids) told, in their order (``{}``: nothing, as a
    replica without the callback, on GPUs)."""
    from ray.experimental.internal_kv import _internal_kv_get

    found = []
    for replica in replicas:
        value = _internal_kv_get(_key(app, replica), namespace=NAMESPACE)
        found.append(json.loads(value) if value else {})
    return found


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


def forget(app: str) -> None:
    """Drop every claim the application's replicas told (the trial that deployed it has ended)."""
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(_key(app), del_by_prefix=True, namespace=NAMESPACE)
