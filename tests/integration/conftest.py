"""Fixtures the integration tests share."""

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def module_ray() -> Iterator[None]:
    """One local Ray of two CPUs for a test module (about 5 s to start and 2.5 s to stop on a two-core host,
    paid once per module instead of once per test), shut down after the module's last test. Started as servetune
    starts one (``start_local_ray``): with a token of its own in the environment, so no ``~/.ray/auth_token`` is
    left in the runner's home to turn token authentication on for every later ``ray start --head``. The token, and
    the ``RAY_AUTH_MODE=token`` Ray's ``ray.init`` sets in this process's environment beside it, leave the environment
    with the cluster: a mode left behind without its token made the next module's ``start_local_ray`` add no token
    (the mode counts as the user's choice) and its GCS die at start ("Token authentication is enabled but Ray
    couldn't find an authentication token"), on a machine without ``~/.ray/auth_token``, as CI's; and Ray's cache of
    them in this process is reset (as Ray's own tests reset it), else the next cluster's clients send the last token."""
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from servetune.local_ray import AUTH_MODE, AUTH_TOKEN, AUTH_TOKEN_PATH, start_local_ray

    before = {name: os.environ.get(name) for name in (AUTH_MODE, AUTH_TOKEN, AUTH_TOKEN_PATH)}
    start_local_ray(num_cpus=2, log_to_driver=False)
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        # Ray caches the mode and the token in this process: the next module's cluster has a token of its own.
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


@pytest.fixture
def local_ray(module_ray: None) -> Iterator[None]:
    """The module's local Ray, with Serve stopped after the test: every test starts with no Serve application
    and no Serve controller of an earlier test's."""
    serve = pytest.importorskip("ray.serve")
    try:
        yield
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def module_serve(module_ray: None) -> None:
    """One Serve for a test module, on its local Ray (the HTTP proxy on 127.0.0.1 at a free port), stopped with that
    Ray: a Serve start is its controller and proxy, two Ray actors in processes of their own that import Serve,
    paid once per module instead of once per test. Its tests take it through :func:`serve_apps`; a test that takes
    ``local_ray`` beside them would shut it down."""
    serve = pytest.importorskip("ray.serve")
    from servetune.engine.server import free_port

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})


@pytest.fixture
def serve_apps(module_serve: None) -> Iterator[None]:
    """The module's Serve with every application a test left deleted after it: each test starts with none, and
    Serve's controller and proxy stay for the next."""
    serve = pytest.importorskip("ray.serve")
    try:
        yield
    finally:
        for name in list(serve.status().applications):
            serve.delete(name)  # until it is gone
