"""ServeCluster's own failure paths, with Ray's calls replaced: a deployment stopped while it waits is
deleted (on a cluster Serve would keep it and its devices), and a local Ray that fails to start leaves
the core-claim switch as it found it."""

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
    import ray

    monkeypatch.delenv(CLAIM_CORES_ENV, raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)

    def failing_init(**kwargs):
        assert os.environ[CLAIM_CORES_ENV] == "1" and kwargs["address"] == "local"  # set for the workers it would start
        raise RuntimeError("no Ray here")

    monkeypatch.setattr(ray, "init", failing_init)
    with pytest.raises(RuntimeError, match="no Ray here"):
        ServeCluster(None, {"CPU": 2}).__enter__()
    assert CLAIM_CORES_ENV not in os.environ
