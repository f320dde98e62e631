"""ServeCluster's own failure paths, with Ray's calls replaced: a deployment stopped while it waits is
deleted (on a cluster Serve would keep it and its devices), a local Ray that fails to start leaves
the core-claim switch as it found it (and was started through the token rule of local_ray.py), and on a
joined cluster Serve starts only with the first deployment and is left as it was found.
tests/integration/test_gpu_type_ray.py checks the same on a real cluster."""

import os
import types

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
    monkeypatch.setattr(cluster, "open_serve", lambda: None)  # Serve up on the cluster
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


@pytest.fixture
def joined(monkeypatch):
    """Ray's and Serve's calls on a cluster at an address replaced: what each call did, in order, and the state they
    read (``controller``: a Serve controller runs there; ``apps``: its applications)."""
    import ray
    import ray.serve
    import ray.serve.context
    import ray.util

    state = types.SimpleNamespace(calls=[], controller=False, apps={})

    def start(http_options=None):
        state.calls.append("serve.start")
        state.controller = True

    def shutdown_serve():
        state.calls.append("serve.shutdown")
        state.controller, state.apps = False, {}

    monkeypatch.setattr(ray, "init", lambda **kwargs: state.calls.append("ray.init"))
    monkeypatch.setattr(ray, "shutdown", lambda: state.calls.append("ray.shutdown"))
    monkeypatch.setattr(ray.serve, "start", start)
    monkeypatch.setattr(ray.serve, "shutdown", shutdown_serve)
    monkeypatch.setattr(ray.serve, "status", lambda: types.SimpleNamespace(applications=dict(state.apps)))
    monkeypatch.setattr(ray.util, "list_named_actors",
                        lambda all_namespaces=False: [{"name": "SERVE_CONTROLLER_ACTOR"}] if state.controller else [])  # fmt: skip
    monkeypatch.setattr(ray.serve.context, "_get_global_client",
                        lambda raise_if_no_controller_running=True: object() if state.controller else None)  # fmt: skip
    monkeypatch.setattr("servetune.serve.cluster._ingress_url", lambda address: "http://head:8000")
    return state


def test_joining_a_cluster_starts_no_serve_so_a_refusal_leaves_nothing_there(joined):
    with ServeCluster("auto", {}) as cluster:
        assert cluster.applications() == {}  # what the refusals read: Serve's status, not a Serve of its own
    assert joined.calls == ["ray.init", "ray.shutdown"] and not joined.controller  # the driver only, gone


@pytest.mark.parametrize("controller, left, shut", [
    (False, {}, True),  # Serve started here, its last application deleted: Serve goes too
    (False, {"theirs": "RUNNING"}, False),  # someone deployed on the Serve started here meanwhile: it stays
    (True, {}, False),  # Serve was running before: left as found
])  # fmt: skip
def test_a_serve_started_on_a_joined_cluster_goes_with_its_last_application_and_no_other_serve_does(
    joined, controller, left, shut
):  # fmt: skip
    joined.controller = controller
    with ServeCluster("auto", {}) as cluster:
        cluster.open_serve()
        cluster.open_serve()  # the next deployment: Serve is up
        assert cluster.url == "http://head:8000" and cluster.started_serve is not controller
        joined.apps = dict(left)
    assert joined.calls == ["ray.init", "serve.start", *(["serve.shutdown"] if shut else []), "ray.shutdown"]
    assert joined.controller is not shut


def test_a_serve_being_shut_down_is_waited_for_until_its_named_actors_are_gone(monkeypatch):
    import ray.util

    from servetune.serve import actors

    going = [[{"name": "SERVE_PROXY_ACTOR-abc", "namespace": "serve"}, {"name": "theirs", "namespace": "x"}]] * 3
    calls = []

    def named(all_namespaces=False):
        calls.append(all_namespaces)
        return going.pop() if going else [{"name": "theirs", "namespace": "x"}]

    monkeypatch.setattr(ray.util, "list_named_actors", named)
    assert actors.wait_serve_gone(timeout_s=5) is True and len(calls) == 4 and all(calls)
    monkeypatch.setattr(
        ray.util, "list_named_actors", lambda all_namespaces=False: [{"name": "SERVE_CONTROLLER_ACTOR"}]
    )
    assert actors.wait_serve_gone(timeout_s=0.3) is False
