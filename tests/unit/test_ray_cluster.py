"""Joining a cluster that asks for a token, and starting a study's local Ray (study/ray_cluster.py), without Ray
running. The token rule of a local Ray (local_ray.py) is tests/unit/test_local_ray.py's."""

import pytest

from servetune import local_ray
from servetune.errors import UserError
from servetune.study import ray_cluster
from servetune.study.ray_cluster import check_token_accepted, token_refused_message


def test_refused_says_what_to_set():
    assert token_refused_message("10.0.0.1:6379", {}).startswith(
        "the Ray cluster at 10.0.0.1:6379 requires token authentication: set RAY_AUTH_MODE=token"
    )
    assert "set RAY_AUTH_TOKEN" in token_refused_message("10.0.0.1:6379", {"RAY_AUTH_MODE": "token"})
    assert "\n" not in token_refused_message("h:1", {}) + token_refused_message("h:1", {"RAY_AUTH_MODE": "token"})


def test_a_refusal_becomes_one_line_and_other_failures_are_left_to_ray(monkeypatch):
    from ray import _raylet
    from ray.exceptions import AuthenticationError

    def refuse(address):
        raise AuthenticationError("RPC error: InvalidAuthToken")

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setattr(_raylet, "GcsClient", refuse)
    with pytest.raises(UserError, match="requires token authentication: set RAY_AUTH_MODE=token"):
        check_token_accepted("127.0.0.1:6379")
    check_token_accepted("ray://head:10001")  # Ray Client: not a GCS address, ray.init judges it

    def unreachable(address):
        raise RuntimeError("Failed to connect to GCS")

    monkeypatch.setattr(_raylet, "GcsClient", unreachable)
    check_token_accepted("127.0.0.1:6379")  # ray.init reports it in its own words


def test_init_ray_checks_the_token_before_joining(monkeypatch):
    import ray

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(("init", kwargs.get("address"))))
    monkeypatch.setattr(ray_cluster, "check_token_accepted", lambda address: calls.append(("check", address)))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray_cluster.init_ray("10.0.0.1:6379")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")  # inside `ray job submit`
    ray_cluster.init_ray(None)
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setattr(local_ray, "token_for_local_cluster", lambda: calls.append(("token", None)))
    assert ray_cluster.init_ray(None) is True  # a new local Ray, not a `ray start` running on this machine
    assert calls == [("check", "10.0.0.1:6379"), ("init", "10.0.0.1:6379"), ("check", "10.0.0.2:6379"), ("init", None),
                     ("token", None), ("init", "local")]  # fmt: skip


def test_a_ray_that_does_not_come_up_is_one_line_and_what_it_started_is_stopped(monkeypatch):
    import ray

    calls = []

    def timed_out(**kwargs):
        calls.append("init")
        raise Exception("The current node timed out during startup. This could happen because ...\nmore")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", timed_out)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(local_ray, "token_for_local_cluster", lambda: None)
    monkeypatch.setattr(ray_cluster, "check_token_accepted", lambda address: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(UserError) as local:
        ray_cluster.init_ray(None)
    assert (
        str(local.value)
        == "could not start a local Ray cluster: The current node timed out during startup. This could happen because ..."
    )
    with pytest.raises(UserError, match=r"^cannot join the Ray cluster at 10.0.0.1:6379: The current node timed out"):
        ray_cluster.init_ray("10.0.0.1:6379")
    # a local start that timed out is made again (local_ray.start_retrying); joining a cluster is not
    assert calls == ["init"] * local_ray.START_TRIES + ["shutdown", "init", "shutdown"]


def test_a_local_ray_leaves_the_commands_sigterm_handler_in_place(monkeypatch):
    """Ray's local start installs its own SIGTERM handler (exit 15); the command's (exit 143, teardown) stays."""
    import signal

    import ray

    def ours(signum, frame):
        raise SystemExit(128 + signum)

    def rays_init(**kwargs):
        signal.signal(signal.SIGTERM, lambda signum, frame: __import__("sys").exit(signum))

    before = signal.signal(signal.SIGTERM, ours)
    try:
        monkeypatch.setattr(ray, "is_initialized", lambda: False)
        monkeypatch.setattr(ray, "init", rays_init)
        monkeypatch.setattr(local_ray, "token_for_local_cluster", lambda: None)
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        assert ray_cluster.init_ray(None) is True
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, before)
