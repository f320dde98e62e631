"""Which of Serve's HTTP proxies a Serve trial's load client sends to: the one on a node where the trial's replicas
run, so concurrent trials do not all stream through the head node's proxy (one Python process), and the measured
path is a replica's node's own: client -> that node's proxy -> its replica.

Serve runs a proxy on every node that holds a replica (``ProxyLocation.EveryNode``, Serve's default); each binds
Serve's ``http_options.host`` at ``http_options.port`` on its node, except that a worker node's proxy binds
``RAY_SERVE_WORKER_PROXY_HTTP_PORT`` where that is set in the node's environment. A proxy bound to every address
(``0.0.0.0``, ``::``) is reached at its node's IP; one bound to a loopback address only from its own machine (a
node whose IP is loopback as well: every node on one host); one bound to another address only at that address.

:func:`choose_proxy` is the rule, over plain tables (the replicas per node, each node's proxy) that
:func:`read_proxies` reads from Ray and Serve; where no proxy on a replica's node can be used, the head's
(the cluster's ingress URL) is, and the choice says why.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass

#: How the choice is recorded in a trial's ``environment``.
HEAD_FALLBACK = "head (fallback)"
REPLICA_NODE = "replica's node"


@dataclass(frozen=True)
class NodeProxy:
    """Serve's HTTP proxy on one node: the node's IP (Ray's ``NodeManagerAddress``), the port it binds, and whether
    Serve reports it HEALTHY."""

    ip: str
    port: int
    healthy: bool


@dataclass(frozen=True)
class ProxyChoice:
    """The proxy a trial's client sends to: ``url`` (scheme, host and port), the node it runs on (empty for the
    head's fallback when the head's node is not known), and ``via`` (:data:`REPLICA_NODE` or :data:`HEAD_FALLBACK`)
    with ``why`` in words."""

    url: str
    node_id: str
    via: str
    why: str

    def record(self) -> dict[str, str]:
        """As a trial's ``environment`` keeps it."""
        return {"serve_proxy_url": self.url, "serve_proxy_node_id": self.node_id, "serve_proxy": self.via,
                "serve_proxy_why": self.why}  # fmt: skip


def is_wildcard(host: str) -> bool:
    """Whether Serve binding ``host`` listens on every address of its node."""
    return host in ("", "0.0.0.0", "::")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def proxy_host(bind_host: str, node_ip: str, here_ip: str = "") -> str | None:
    """The host a client on this machine (its Ray node at ``here_ip``) reaches a node's proxy at, the proxy bound to
    ``bind_host`` on the node at ``node_ip``; None where it cannot be reached from here (a loopback bind on a node of
    another machine, or a specific address that is not the node's)."""
    if is_wildcard(bind_host):
        return node_ip
    if _is_loopback(bind_host):
        return bind_host if _is_loopback(node_ip) or node_ip == here_ip else None
    return bind_host if bind_host == node_ip else None


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def choose_proxy(
    replica_nodes: Mapping[str, int], proxies: Mapping[str, NodeProxy], bind_host: str, head_url: str,
    head_node_id: str = "", here_ip: str = "",
) -> ProxyChoice:  # fmt: skip
    """The proxy on the node holding most of the trial's replicas (ties: the lower node id) whose proxy Serve reports
    HEALTHY and a client here can reach (:func:`proxy_host`); else the next such node; else the head's proxy at
    ``head_url``, saying why. A replica on the head node is reached at ``head_url`` (its proxy is the head's).
    ``replica_nodes``: the trial's live replicas per node id; ``proxies``: Serve's proxy per node id; ``bind_host``:
    Serve's ``http_options.host``; ``here_ip``: the client's own node's IP."""
    ranked = sorted((node for node, n in replica_nodes.items() if n > 0), key=lambda node: (-replica_nodes[node], node))
    if not ranked:
        return ProxyChoice(head_url, head_node_id, HEAD_FALLBACK, "where the replicas run is not known")
    passed = []
    for node in ranked:
        proxy = proxies.get(node)
        if proxy is None:
            passed.append(f"node {node[:12]} has no Serve proxy")
            continue
        if not proxy.healthy:
            passed.append(f"the Serve proxy on node {node[:12]} is not HEALTHY")
            continue
        if node == head_node_id:
            return ProxyChoice(head_url, node, REPLICA_NODE, f"{replica_nodes[node]} replica(s) on the head node")
        host = proxy_host(bind_host, proxy.ip, here_ip)
        if host is None:
            passed.append(f"the Serve proxy on node {node[:12]} ({proxy.ip}) binds {bind_host} only")
            continue
        return ProxyChoice(_url(host, proxy.port), node, REPLICA_NODE, f"{replica_nodes[node]} replica(s) there")
    return ProxyChoice(head_url, head_node_id, HEAD_FALLBACK, "; ".join(passed))


# --- read from Ray and Serve -------------------------------------------------------------------
#: Seconds a trial waits, once deployed, for Serve's proxy on its replicas' node to be up and route it.
PROXY_WAIT_S = 20.0
WORKER_PORT_ENV = "RAY_SERVE_WORKER_PROXY_HTTP_PORT"


def _worker_port(node_id: str) -> int | None:
    """``RAY_SERVE_WORKER_PROXY_HTTP_PORT`` as the worker node's processes (its proxy too) have it: read by a task
    of no CPU pinned there; None where it is not set or the node does not answer."""
    import os

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def read() -> str | None:
        return os.environ.get(WORKER_PORT_ENV)

    try:
        value = ray.get(read.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(),
                        timeout=30)  # fmt: skip
        return int(value) if value else None
    except Exception:  # the node is going, or its value is not a port: Serve's own port
        return None


def read_proxies(nodes: set[str]) -> tuple[dict[str, NodeProxy], str, str]:
    """Serve's proxy on each of ``nodes`` that has one (its node's IP, the port it binds, whether HEALTHY), Serve's
    bind host, and the head node's id."""
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    assert client is not None
    config = client.http_config
    statuses = serve.status().proxies
    head, proxies = "", {}
    for node in ray.nodes():
        node_id = node.get("NodeID", "")
        if "node:__internal_head__" in (node.get("Resources") or {}):
            head = node_id
        if node_id in nodes and node_id in statuses and node.get("Alive"):
            port = (_worker_port(node_id) if node_id != head else None) or config.port
            healthy = str(statuses[node_id]).endswith("HEALTHY") and not str(statuses[node_id]).endswith("UNHEALTHY")
            proxies[node_id] = NodeProxy(str(node.get("NodeManagerAddress", "")), int(port), healthy)
    return proxies, str(config.host or ""), head


def routes(url: str, route: str, timeout_s: float = 5.0) -> str | None:
    """None when the proxy at ``url`` lists ``route`` among its routes (``GET /-/routes``); else what it said."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/-/routes", timeout=timeout_s) as resp:
            listed = json.loads(resp.read().decode() or "{}")
    except (OSError, ValueError) as exc:
        return f"no answer from {url}/-/routes ({exc})"
    return None if route in listed else f"{url}/-/routes does not list {route} yet"


def pick_proxy(
    replica_nodes: Mapping[str, int], head_url: str, route: str, wait_s: float = PROXY_WAIT_S
) -> ProxyChoice:
    """The trial's proxy (:func:`choose_proxy` over what Ray and Serve say now), once it routes ``route``: Serve starts
    a node's proxy when a replica lands there, so it may still be starting when the application is RUNNING; read
    again until ``wait_s``, then the head's, saying why."""
    import time

    import ray

    if not replica_nodes:  # nothing to read: the head's
        return choose_proxy(replica_nodes, {}, "", head_url)
    if not ray.is_initialized():  # no Ray to read from: Serve's look-ups would start a plain local one of their own
        return ProxyChoice(head_url, "", HEAD_FALLBACK, "not connected to Ray: Serve's proxies were not read")
    here = ray.util.get_node_ip_address()
    deadline = time.monotonic() + wait_s
    while True:
        try:
            proxies, bind_host, head = read_proxies(set(replica_nodes))
        except Exception as exc:  # Serve's or Ray's tables unreadable: the head's proxy, which the trial had before
            return ProxyChoice(head_url, "", HEAD_FALLBACK, f"Serve's proxies could not be read ({exc})")
        choice = choose_proxy(replica_nodes, proxies, bind_host, head_url, head, here)
        if choice.via == REPLICA_NODE:
            problem = None if choice.url == head_url else routes(choice.url, route)
            if problem is None:
                return choice
        elif set(proxies) >= set(replica_nodes) and all(p.healthy for p in proxies.values()):
            return choice  # every replica node's proxy is up, and none of them will do
        else:
            problem = choice.why
        if time.monotonic() >= deadline:
            return ProxyChoice(head_url, head, HEAD_FALLBACK, problem)
        time.sleep(1.0)
