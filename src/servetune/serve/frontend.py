"""The front end of a trial through Ray Serve, and its CPU over a level (engine/frontend.py reads and compares it).

A request to a Serve trial goes client -> Serve's HTTP proxy on the node the client sends to (serve/proxies.py) ->
the application's ingress replica (Ray Serve LLM's OpenAI-compatible routes) -> an LLM replica (``LLMServer``: Ray
Serve LLM's server and vLLM's engine client, which detokenizes and streams); vLLM's engine core runs in a process the
replica started, and is not the front end. Each of the three is a Ray actor, one Python process on one asyncio event
loop (with Ray's own threads beside it), so each, like vLLM's API server, tops out at about a core.

Their process ids and nodes come from the GCS actor table (as serve/actors.py reads replicas): the proxy actor is
named ``SERVE_PROXY_ACTOR-<node id>`` (Ray Serve's ``SERVE_PROXY_NAME``), a replica ``ServeReplica:<app>:<deployment>``
(class name). Those on the reader's own Ray node are read here; those on another node by one Ray task of no CPU
pinned to it (as doctor reads each node), which reads them with that node's pids and its own clock. A node that does
not answer within :data:`REMOTE_READ_TIMEOUT_S` is left out of that reading.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Collection, Mapping
from typing import Any

import psutil

from servetune.engine.frontend import CpuReading, ProcessKey, read_cpu
from servetune.serve.actors import node_of

#: Ray Serve's proxy actor's name, before ``-<node id>`` (ray.serve._private.constants.SERVE_PROXY_NAME).
PROXY_ACTOR = "SERVE_PROXY_ACTOR"
#: The roles a Serve front-end process is recorded under (``LevelResult.frontend_process``).
PROXY, INGRESS, REPLICA = "proxy", "ingress", "replica"
#: Seconds the reads on other nodes may take together, at a level's start or end: a task pinned to a node that is
#: busy starting a worker or going away must not hold the level up.
REMOTE_READ_TIMEOUT_S = 10.0


def front_end_by_node(actors: Mapping[str, Mapping[str, Any]], name: str, proxy_node: str) -> dict[str, dict[int, str]]:
    """The pids of the application ``name``'s front end among ``actors`` (the GCS actor table), by the node each
    runs on, each with its role: the live proxy on ``proxy_node`` (every live proxy where it is empty: which one the
    client reached is not known), the application's live ingress replicas and LLM replicas."""
    nodes: dict[str, dict[int, str]] = {}
    for actor in actors.values():
        pid, node = int(actor.get("Pid") or 0), node_of(actor)
        if actor.get("State") != "ALIVE" or not pid or not node:
            continue
        class_name = str(actor.get("ActorClassName", ""))
        proxy = str(actor.get("Name", "")).startswith(f"{PROXY_ACTOR}-")
        if class_name.startswith(f"ServeReplica:{name}:"):
            role = REPLICA if class_name.split(":", 2)[-1].startswith("LLMServer") else INGRESS
        elif proxy and (not proxy_node or node == proxy_node):
            role = PROXY
        else:
            continue
        nodes.setdefault(node, {})[pid] = role
    return nodes


def actor_table() -> Mapping[str, Mapping[str, Any]]:
    """Ray's GCS actor table, every actor (serve/actors.py reads it the same way: no dashboard needed)."""
    import ray

    return ray._private.state.actors()


def this_node() -> str:
    """The Ray node this process runs on."""
    import ray

    return str(ray.get_runtime_context().get_node_id())


def _alive(pids: Collection[int]) -> list[psutil.Process]:
    """The processes of ``pids`` that exist on this node."""
    processes = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            processes.append(psutil.Process(pid))
    return processes


def read_on_node(pids: Collection[int]) -> tuple[float, dict[int, float]]:
    """On a node (a Ray task pinned there): its ``perf_counter()`` now and the CPU seconds of those of ``pids`` alive
    there."""
    reading = read_cpu(_alive(pids))
    return (reading.at_s, {int(k): v for k, v in reading.cpu_s.items()}) if reading else (time.perf_counter(), {})


@functools.cache
def _read_task() -> Any:
    import ray

    return ray.remote(num_cpus=0, max_retries=0)(read_on_node)


def read_elsewhere(
    nodes: Mapping[str, Collection[int]], timeout_s: float = REMOTE_READ_TIMEOUT_S
) -> dict[str, tuple[float, dict[int, float]]]:
    """:func:`read_on_node` on each of ``nodes`` (node id -> its pids), all at once, each a Ray task pinned there;
    a node that has not answered within ``timeout_s`` (all of them together) is left out."""
    if not nodes:
        return {}
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = _read_task()
    pending = {node: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
        sorted(pids)) for node, pids in nodes.items()}  # fmt: skip
    deadline = time.monotonic() + timeout_s
    read: dict[str, tuple[float, dict[int, float]]] = {}
    for node, ref in pending.items():
        try:
            read[node] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except Exception:  # the node is gone or slow: its processes are left out of this reading
            with contextlib.suppress(Exception):
                ray.cancel(ref)
    return read


def read_front_end(name: str, proxy_node: str) -> CpuReading | None:
    """The CPU seconds now of the application's front-end processes (:func:`front_end_by_node`), with their roles:
    those on this process's node read here (by pid), those on other nodes by :func:`read_elsewhere` (by
    ``"<node id>:<pid>"``, at their node's clock); None where none could be read."""
    by_node = front_end_by_node(actor_table(), name, proxy_node)
    roles = by_node.pop(this_node(), {})
    here = read_cpu(_alive(roles), roles)
    cpu_s: dict[ProcessKey, float] = dict(here.cpu_s) if here else {}
    found: dict[ProcessKey, str] = dict(here.roles) if here else {}
    clocks: dict[ProcessKey, float] = {}
    for node, (at_s, read) in read_elsewhere(by_node).items():
        for pid, seconds in read.items():
            key = f"{node}:{pid}"
            cpu_s[key], found[key], clocks[key] = seconds, by_node[node][pid], at_s
    if not cpu_s:
        return None
    return CpuReading(here.at_s if here else time.perf_counter(), cpu_s, found, clocks)
