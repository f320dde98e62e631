"""The front end of a trial through Ray Serve, and its CPU over a level (engine/frontend.py reads and compares it).

A request to a Serve trial goes client -> Serve's HTTP proxy on the node the client sends to (serve/proxies.py) ->
the application's ingress replica (Ray Serve LLM's OpenAI-compatible routes) -> an LLM replica (``LLMServer``: Ray
Serve LLM's server and vLLM's engine client, which detokenizes and streams); vLLM's engine core runs in a process the
replica started, and is not the front end. Each of the three is a Ray actor, one Python process on one asyncio event
loop (with Ray's own threads beside it), so each, like vLLM's API server, tops out at about a core.

Their process ids come from the GCS actor table (as serve/actors.py reads replicas): the proxy actor is named
``SERVE_PROXY_ACTOR-<node id>`` (Ray Serve's ``SERVE_PROXY_NAME``), a replica ``ServeReplica:<app>:<deployment>``
(class name). Only processes on this host can be read; a replica elsewhere is left out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import psutil

from servetune.engine.frontend import CpuReading, read_cpu
from servetune.serve.actors import node_of, on_this_host

#: Ray Serve's proxy actor's name, before ``-<node id>`` (ray.serve._private.constants.SERVE_PROXY_NAME).
PROXY_ACTOR = "SERVE_PROXY_ACTOR"
#: The roles a Serve front-end process is recorded under (``LevelResult.frontend_process``).
PROXY, INGRESS, REPLICA = "proxy", "ingress", "replica"


def front_end_roles(
    actors: Mapping[str, Mapping[str, Any]], name: str, proxy_node: str, here: Callable[[Mapping[str, Any]], bool]
) -> dict[int, str]:
    """The pids of the application ``name``'s front end among ``actors`` (the GCS actor table), each with its role:
    the live proxy on ``proxy_node`` (every live proxy where it is empty: which one the client reached is not known),
    the application's live ingress replicas and LLM replicas; only actors ``here`` says run on this host."""
    roles: dict[int, str] = {}
    for actor in actors.values():
        pid = int(actor.get("Pid") or 0)
        if actor.get("State") != "ALIVE" or not pid or not here(actor):
            continue
        class_name = str(actor.get("ActorClassName", ""))
        proxy = str(actor.get("Name", "")).startswith(f"{PROXY_ACTOR}-")
        if class_name.startswith(f"ServeReplica:{name}:"):
            roles[pid] = REPLICA if class_name.split(":", 2)[-1].startswith("LLMServer") else INGRESS
        elif proxy and (not proxy_node or node_of(actor) == proxy_node):
            roles[pid] = PROXY
    return roles


def actor_table() -> Mapping[str, Mapping[str, Any]]:
    """Ray's GCS actor table, every actor (serve/actors.py reads it the same way: no dashboard needed)."""
    import ray

    return ray._private.state.actors()


def read_front_end(name: str, proxy_node: str) -> CpuReading | None:
    """The CPU seconds now of the application's front-end processes on this host (:func:`front_end_roles`), with
    their roles; None where none could be read."""
    roles = front_end_roles(actor_table(), name, proxy_node, on_this_host)
    processes = []
    for pid in roles:
        with contextlib.suppress(psutil.Error):
            processes.append(psutil.Process(pid))
    return read_cpu(processes, roles)
