"""Fixtures the integration tests share."""

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def module_ray() -> Iterator[None]:
    """One local Ray of two CPUs for a test module (about 5 s to start and 2.5 s to stop on a two-core host,
    paid once per module instead of once per test), shut down after the module's last test. Started as servetune
    starts one (``start_local_ray``): with a token of its own in the environment, so no ``~/.ray/auth_token`` is
    left in the runner's home to turn token authentication on for every later ``ray start --head``; the token
    leaves the environment with the cluster."""
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from servetune.local_ray import AUTH_TOKEN, start_local_ray

    before = os.environ.get(AUTH_TOKEN)
    start_local_ray(num_cpus=2, log_to_driver=False)
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()
        if before is None:
            os.environ.pop(AUTH_TOKEN, None)
        else:
            os.environ[AUTH_TOKEN] = before


@pytest.fixture
def local_ray(module_ray: None) -> Iterator[None]:
    """The module's local Ray, with Serve stopped after the test: every test starts with no Serve application
    and no Serve controller of an earlier test's."""
    serve = pytest.importorskip("ray.serve")
    try:
        yield
    finally:
        serve.shutdown()
