"""A Serve trial's front end (serve/frontend.py): its processes found in Ray's actor table (the proxy the client sends
to, the application's ingress and LLM replicas), by node, their CPU read as a bare engine's API server's is
(engine/frontend.py), here for this node and by a task pinned to each other node, and the busiest one's share and role
kept for the level."""

from __future__ import annotations

from types import SimpleNamespace
from typing import ClassVar

import psutil
import pytest

from servetune.engine.frontend import CpuReading, busiest
from servetune.serve import frontend
from servetune.serve.frontend import front_end_by_node, read_front_end, read_on_node
from servetune.serve.trial import ServeEngine

NODE, OTHER = "a" * 56, "b" * 56


def actor(name: str, class_name: str, pid: int, node: str = NODE, state: str = "ALIVE", ip: str = "10.0.0.1") -> dict:
    """An entry of the GCS actor table, as ``ray._private.state.actors()`` gives it."""
    return {"Name": name, "ActorClassName": class_name, "Pid": pid, "State": state,
            "Address": {"NodeID": node, "IPAddress": ip}}  # fmt: skip


TABLE = {
    "p1": actor(f"SERVE_PROXY_ACTOR-{NODE}", "ProxyActor", 101),
    "p2": actor(f"SERVE_PROXY_ACTOR-{OTHER}", "ProxyActor", 102, node=OTHER),  # another node's proxy
    "c": actor("SERVE_CONTROLLER_ACTOR", "ServeController", 103),  # not on a request's path
    "i": actor("SERVE_REPLICA::app#OpenAiIngress#x", "ServeReplica:app:OpenAiIngress", 104),
    "r1": actor("SERVE_REPLICA::app#LLMServer:m#y", "ServeReplica:app:LLMServer:m", 105),
    "r2": actor("SERVE_REPLICA::app#LLMServer:m#z", "ServeReplica:app:LLMServer:m", 106, OTHER, ip="10.0.0.2"),
    "dead": actor("SERVE_REPLICA::app#LLMServer:m#w", "ServeReplica:app:LLMServer:m", 107, state="DEAD"),
    "other": actor("SERVE_REPLICA::app2#LLMServer:m#v", "ServeReplica:app2:LLMServer:m", 108),  # another trial's
    "starting": actor("SERVE_REPLICA::app#LLMServer:m#u", "ServeReplica:app:LLMServer:m", 0),  # no process yet
}


def test_the_front_end_is_the_clients_proxy_the_ingress_and_the_llm_replicas_alive_by_node():
    assert front_end_by_node(TABLE, "app", NODE) == {NODE: {101: "proxy", 104: "ingress", 105: "replica"},
                                                     OTHER: {106: "replica"}}  # fmt: skip


def test_where_the_proxys_node_is_not_known_every_proxy_counts():
    assert front_end_by_node(TABLE, "app", "") == {NODE: {101: "proxy", 104: "ingress", 105: "replica"},
                                                   OTHER: {102: "proxy", 106: "replica"}}  # fmt: skip
    assert front_end_by_node(TABLE, "app", OTHER)[OTHER] == {102: "proxy", 106: "replica"}


class FakeProcess:
    """A process whose CPU seconds the test sets (``CPU[pid]``); pid 999 is gone."""

    CPU: ClassVar[dict[int, float]] = {}

    def __init__(self, pid: int) -> None:
        if pid == 999:
            raise psutil.NoSuchProcess(pid)
        self.pid = pid

    def cpu_times(self):
        return SimpleNamespace(user=self.CPU[self.pid] * 0.75, system=self.CPU[self.pid] * 0.25)


@pytest.fixture
def processes(monkeypatch):
    table = {**TABLE, "gone": actor("SERVE_REPLICA::app#LLMServer:m#t", "ServeReplica:app:LLMServer:m", 999)}
    monkeypatch.setattr(frontend, "actor_table", lambda: table)
    monkeypatch.setattr(frontend, "this_node", lambda: NODE)
    monkeypatch.setattr(frontend, "read_elsewhere", lambda nodes: {})  # the other node's replica: see below
    monkeypatch.setattr(psutil, "Process", FakeProcess)
    clock = iter([10.0, 14.0])
    monkeypatch.setattr("servetune.engine.frontend.time.perf_counter", lambda: next(clock))
    FakeProcess.CPU.clear()
    return FakeProcess.CPU


def test_the_busiest_front_end_process_over_the_window_is_the_levels_share_with_its_role(processes):
    processes.update({101: 2.0, 104: 1.0, 105: 3.0})
    before = read_front_end("app", NODE)
    assert before == CpuReading(10.0, {101: 2.0, 104: 1.0, 105: 3.0}, {101: "proxy", 104: "ingress", 105: "replica"})
    processes.update({101: 4.4, 104: 1.4, 105: 6.2})  # the proxy 2.4 s of 4 s, the replica 3.2 s: the replica
    assert busiest(before, read_front_end("app", NODE)) == pytest.approx((0.8, "replica"))


def test_a_busier_proxy_is_named_and_a_process_without_a_role_names_none(processes):
    processes.update({101: 0.0, 104: 0.0, 105: 0.0})
    before = read_front_end("app", NODE)
    processes.update({101: 3.8, 104: 0.4, 105: 1.0})
    assert busiest(before, read_front_end("app", NODE)) == pytest.approx((0.95, "proxy"))
    assert busiest(CpuReading(0.0, {7: 0.0}), CpuReading(2.0, {7: 1.0})) == (0.5, None)  # vLLM's API server


def test_a_serve_engine_reads_the_front_end_behind_the_proxy_its_client_sends_to(monkeypatch):
    asked = []
    monkeypatch.setattr("servetune.serve.trial.read_front_end", lambda name, node: asked.append((name, node)) or "r")
    engine = ServeEngine.__new__(ServeEngine)
    engine.name, engine.proxy_record = "servetune-s-t", {"serve_proxy_node_id": NODE, "serve_proxy": "replica's node"}
    assert engine.frontend_cpu() == "r" and asked == [("servetune-s-t", NODE)]

    def unreadable(name, node):
        raise ConnectionError("the GCS is gone")

    monkeypatch.setattr("servetune.serve.trial.read_front_end", unreadable)
    assert engine.frontend_cpu() is None  # the level goes on without the reading


def test_a_front_end_on_another_node_is_read_there_at_that_nodes_clock_and_may_be_the_busiest(processes, monkeypatch):
    asked = []
    # the other node's proxy and replica, read by the task pinned there: its clock moved 2 s between the readings
    there = iter([(500.0, {102: 1.0, 106: 0.5}), (502.0, {102: 2.9, 106: 1.0})])
    monkeypatch.setattr(frontend, "read_elsewhere", lambda nodes: asked.append(nodes) or {OTHER: next(there)})
    processes.update({101: 0.0, 104: 0.0, 105: 0.0})
    before = read_front_end("app", "")  # the proxy the client reached is not known: every proxy
    processes.update({101: 1.0, 104: 0.4, 105: 2.0})  # this node's busiest: the replica, 2 s of 4 s
    after = read_front_end("app", "")
    assert asked == [{OTHER: {102: "proxy", 106: "replica"}}] * 2  # this node's own processes are read here
    key = f"{OTHER}:102"  # the other node's pid, which means nothing here
    assert before.cpu_s[key] == 1.0 and before.roles[key] == "proxy" and before.clocks[key] == 500.0
    assert 101 in before.cpu_s and 101 not in before.clocks  # read here, at this host's clock
    # 1.9 s over that node's 2 s: the busiest, though over this host's 4 s it would read 0.475, under the replica's 0.5
    assert busiest(before, after) == pytest.approx((0.95, "proxy"))


def test_the_task_on_a_node_reads_the_processes_alive_there():
    import os

    at, read = read_on_node([os.getpid(), 2**22 + 1])  # this process, and a pid above Linux's highest
    assert list(read) == [os.getpid()] and read[os.getpid()] > 0 and at > 0
