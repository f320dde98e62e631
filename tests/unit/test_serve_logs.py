"""A trial's engine log through Serve: its replicas' worker logs, found in Ray's GCS actor table (a fake
one here) and Ray's log directory (files made here). Files are named by pid, which the OS reuses."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

HERE = "10.0.0.1"


def replica(name, pid, start_s, end_s=0.0, ip=HERE, app="trial-app", state="ALIVE"):
    return {"ActorClassName": f"ServeReplica:{app}:LLMServer:tiny", "State": state, "Pid": pid, "Name": name,
            "Address": {"IPAddress": ip}, "StartTime": int(start_s * 1000), "EndTime": int(end_s * 1000)}  # fmt: skip


def log_file(logs, worker, pid, text, mtime):
    path = logs / f"worker-{worker}-01000000-{pid}.err"
    path.write_text(text)
    os.utime(path, (mtime, mtime))


@pytest.fixture
def ray_here(monkeypatch, tmp_path):
    import ray

    logs = tmp_path / "logs"
    logs.mkdir()
    actors: dict[str, dict] = {}
    monkeypatch.setattr(ray._private.state, "actors", lambda: actors)
    monkeypatch.setattr(ray._private.worker, "_global_node", SimpleNamespace(get_logs_dir_path=lambda: str(logs)))
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: HERE)
    return logs, actors


def test_the_engine_log_keeps_a_replaced_replica_and_leaves_out_pid_reuse_other_hosts_and_earlier_deployments(ray_here):
    from servetune.serve.cluster import ServeCluster

    logs, actors = ray_here
    now = time.time()
    actors["a1"] = replica("r1", 100, start_s=now - 200)  # alive
    log_file(logs, "w1", 100, "r1: KV cache 524288 tokens\n", now - 5)
    log_file(logs, "w0", 100, "an earlier worker that had pid 100\n", now - 1000)
    actors["a2"] = replica("r2", 200, start_s=now - 250, end_s=now - 100, state="DEAD")  # Serve replaced it
    log_file(logs, "w2", 200, "r2: died mid-trial, its engine flushed late\n", now - 70)
    log_file(logs, "w9", 200, "a later worker that got pid 200\n", now - 10)
    actors["a3"] = replica("r3", 300, start_s=now - 200, ip="10.0.0.2")  # another host: pid 300 means nothing here
    log_file(logs, "w3", 300, "a local worker with pid 300\n", now - 5)
    actors["a4"] = replica(
        "r4", 400, start_s=now - 900, end_s=now - 400, state="DEAD"
    )  # an earlier deployment of the name
    log_file(logs, "w4", 400, "the earlier deployment\n", now - 401)
    actors["a5"] = replica("o1", 500, start_s=now - 200, app="other-app")
    log_file(logs, "w5", 500, "another application\n", now - 5)
    actors["a6"] = replica(
        "r6", 600, start_s=now - 150, end_s=now - 120, ip="", state="DEAD"
    )  # the GCS cleared its address
    log_file(logs, "w6", 600, "r6: died, address unknown\n", now - 121)

    cluster = ServeCluster("ray://nowhere:1", {})
    text = cluster.replica_logs("trial-app", leave_out={"a4"})
    for ours in ("r1: KV cache", "r2: died mid-trial", "r6: died, address unknown"):
        assert ours in text
    for other in (
        "earlier worker",
        "later worker",
        "local worker with pid 300",
        "earlier deployment",
        "another application",
    ):
        assert other not in text
    assert "the earlier deployment" in cluster.replica_logs("trial-app")  # nothing left out: every replica of the name
    assert cluster.engine_replicas("trial-app") == ["a1", "a3"]
    assert cluster.engine_replicas("trial-app", live_only=False) == ["a1", "a2", "a3", "a4", "a6"]
