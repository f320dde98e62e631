"""Which Serve proxy a Serve trial's client sends to (serve/proxies.py), from node and replica tables, without Ray."""

import pytest

from servetune.serve import proxies
from servetune.serve.proxies import HEAD_FALLBACK, REPLICA_NODE, NodeProxy, choose_proxy, proxy_host

HEAD_URL = "http://10.0.0.1:8000"
HEAD, A, B = "h" * 56, "a" * 56, "b" * 56
UP = {
    HEAD: NodeProxy("10.0.0.1", 8000, True),
    A: NodeProxy("10.0.0.2", 8000, True),
    B: NodeProxy("10.0.0.3", 8000, True),
}


def test_the_client_sends_to_the_proxy_on_the_node_holding_most_of_its_replicas_at_that_nodes_ip():
    choice = choose_proxy({A: 1, B: 2}, UP, "0.0.0.0", HEAD_URL, HEAD)
    assert (choice.url, choice.node_id, choice.via) == ("http://10.0.0.3:8000", B, REPLICA_NODE)
    assert choice.record() == {"serve_proxy_url": "http://10.0.0.3:8000", "serve_proxy_node_id": B,
                               "serve_proxy": REPLICA_NODE, "serve_proxy_why": "2 replica(s) there"}  # fmt: skip
    # A tie goes to the lower node id, so a trial's choice does not depend on the table's order.
    assert choose_proxy({B: 1, A: 1}, UP, "0.0.0.0", HEAD_URL, HEAD).node_id == A


def test_a_worker_proxy_on_a_port_of_its_own_is_reached_there():
    moved = {**UP, A: NodeProxy("10.0.0.2", 9123, True)}  # RAY_SERVE_WORKER_PROXY_HTTP_PORT on that node
    assert choose_proxy({A: 1}, moved, "0.0.0.0", HEAD_URL, HEAD).url == "http://10.0.0.2:9123"
    assert choose_proxy({A: 1}, {A: NodeProxy("fd00::2", 8000, True)}, "::", HEAD_URL).url == "http://[fd00::2]:8000"


def test_a_replica_on_the_head_is_reached_at_the_heads_url_as_before():
    choice = choose_proxy({HEAD: 1}, UP, "127.0.0.1", "http://127.0.0.1:40001", HEAD, here_ip="192.0.2.2")
    assert (choice.url, choice.via) == ("http://127.0.0.1:40001", REPLICA_NODE)


def test_a_node_whose_proxy_is_missing_or_unhealthy_gives_way_to_the_next_and_then_to_the_head():
    sick = {**UP, B: NodeProxy("10.0.0.3", 8000, False)}
    assert choose_proxy({B: 2, A: 1}, sick, "0.0.0.0", HEAD_URL, HEAD).node_id == A
    choice = choose_proxy({B: 2, A: 1}, {B: sick[B]}, "0.0.0.0", HEAD_URL, HEAD)
    assert (choice.url, choice.node_id, choice.via) == (HEAD_URL, HEAD, HEAD_FALLBACK)
    assert choice.why == f"the Serve proxy on node {B[:12]} is not HEALTHY; node {A[:12]} has no Serve proxy"


def test_where_the_replicas_run_is_unknown_the_head_is_used_and_the_record_says_so():
    choice = choose_proxy({}, UP, "0.0.0.0", HEAD_URL, HEAD)
    assert (choice.url, choice.via, choice.why) == (HEAD_URL, HEAD_FALLBACK, "where the replicas run is not known")
    assert choose_proxy({A: 0}, UP, "0.0.0.0", HEAD_URL, HEAD).via == HEAD_FALLBACK  # a node that holds none


def test_a_proxy_bound_to_one_address_is_reached_only_where_that_address_leads_to_it():
    # Every address: the node's IP.
    assert proxy_host("0.0.0.0", "10.0.0.2") == "10.0.0.2" and proxy_host("", "10.0.0.2") == "10.0.0.2"
    # Loopback: only on this machine (a node at a loopback IP, as on one host, or at this node's IP).
    assert proxy_host("127.0.0.1", "127.0.0.2") == "127.0.0.1"
    assert proxy_host("127.0.0.1", "192.0.2.2", here_ip="192.0.2.2") == "127.0.0.1"
    assert proxy_host("127.0.0.1", "10.0.0.2", here_ip="10.0.0.1") is None
    # Another address: that node's only.
    assert proxy_host("10.0.0.2", "10.0.0.2") == "10.0.0.2" and proxy_host("10.0.0.2", "10.0.0.3") is None
    choice = choose_proxy({A: 1}, UP, "127.0.0.1", HEAD_URL, HEAD, here_ip="10.0.0.1")
    assert (
        choice.via == HEAD_FALLBACK
        and choice.why == f"the Serve proxy on node {A[:12]} (10.0.0.2) binds 127.0.0.1 only"
    )


def test_picking_waits_for_the_replica_nodes_proxy_to_route_the_trial_then_falls_back(monkeypatch):
    """Serve starts a node's proxy once a replica lands there: it may not route the trial yet when the application is
    RUNNING. The pick reads again until it does, and after the wait takes the head's, saying why."""
    monkeypatch.setattr(proxies, "read_proxies", lambda nodes: ({A: UP[A]}, "0.0.0.0", HEAD))
    monkeypatch.setattr("ray.util.get_node_ip_address", lambda: "10.0.0.1")
    monkeypatch.setattr("ray.is_initialized", lambda: True)
    answers = iter(["http://10.0.0.2:8000/-/routes does not list /r yet", None])
    monkeypatch.setattr(proxies, "routes", lambda url, route: next(answers))
    assert proxies.pick_proxy({A: 1}, HEAD_URL, "/r", wait_s=60).url == "http://10.0.0.2:8000"
    monkeypatch.setattr(proxies, "routes", lambda url, route: "no answer from http://10.0.0.2:8000/-/routes (refused)")
    late = proxies.pick_proxy({A: 1}, HEAD_URL, "/r", wait_s=0)
    assert (late.url, late.via, late.why) == (HEAD_URL, HEAD_FALLBACK,
                                              "no answer from http://10.0.0.2:8000/-/routes (refused)")  # fmt: skip
    assert proxies.pick_proxy({}, HEAD_URL, "/r").via == HEAD_FALLBACK  # nothing read where nothing is placed


def test_without_ray_connected_nothing_is_read_and_the_heads_proxy_is_taken(monkeypatch):
    """Serve's look-ups would start a plain local Ray of their own (and leave ~/.ray/auth_token behind): nothing is
    read, and the head's proxy is the trial's, saying why."""
    monkeypatch.setattr("ray.is_initialized", lambda: False)
    monkeypatch.setattr(proxies, "read_proxies", lambda nodes: pytest.fail("read without Ray"))
    choice = proxies.pick_proxy({A: 1}, HEAD_URL, "/r")
    assert (choice.url, choice.via) == (HEAD_URL, HEAD_FALLBACK) and "not connected to Ray" in choice.why
