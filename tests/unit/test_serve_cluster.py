"""ServeCluster's own failure paths, with Ray's calls replaced: a deployment stopped while it waits is
deleted (on a cluster Serve would keep it and its devices), and a local Ray that fails to start leaves
the core-claim switch as it found it (and was started through the token rule of local_ray.py)."""

import os

import pytest

pytest.importorskip("ray.serve")

from servetune.serve.cluster import ServeCluster
from servetune.serve.plan import CLAIM_CORES_ENV


def test_a_deployment_stopped_while_it_waits_is_deleted(monkeypatch):
    import ray.serve

    monkeypatch.setattr(ray.serve, "run_many", lambda targets, wait_for_applications_running: None)

    def interrupted(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr("servetune.serve.cluster.time.sleep", interrupted)
    cluster = ServeCluster("ray://somewhere:10001", {"CPU": 2})
    deleted = []
    monkeypatch.setattr(cluster, "delete", deleted.append)
    with pytest.raises(KeyboardInterrupt):
        cluster.run_app("servetune-x", object(), timeout_s=600)
    assert deleted == ["servetune-x"]


def test_a_local_ray_that_fails_to_start_restores_the_claim_switch(monkeypatch):
    """The local Ray of serve-check and verify is started through the token rule (none left in ~/.ray), declaring
    the CPUs asked for, with Serve's system config."""
    import ray

    from servetune import local_ray

    monkeypatch.delenv(CLAIM_CORES_ENV, raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    calls = []
    monkeypatch.setattr(local_ray, "token_for_local_cluster", lambda: calls.append("token"))

    def failing_init(**kwargs):
        assert os.environ[CLAIM_CORES_ENV] == "1" and kwargs["address"] == "local"  # set for the workers it would start
        assert kwargs["num_cpus"] == 3 and kwargs["_system_config"] == local_ray.SERVE_SYSTEM_CONFIG
        calls.append("init")
        raise RuntimeError("no Ray here")

    monkeypatch.setattr(ray, "init", failing_init)
    with pytest.raises(RuntimeError, match="no Ray here"):
        ServeCluster(None, {"CPU": 2.5}).__enter__()
    assert CLAIM_CORES_ENV not in os.environ
    assert calls == ["token", "init"]
