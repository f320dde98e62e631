"""Fixtures the integration tests share."""

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def module_ray() -> Iterator[None]:
    """One local Ray of two CPUs for a test module (about 5 s to start and 2.5 s to stop on a two-core host,
    paid once per module instead of once per test), shut down after the module's last test."""
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture
def local_ray(module_ray: None) -> Iterator[None]:
    """The module's local Ray, with Serve stopped after the test: every test starts with no Serve application
    and no Serve controller of an earlier test's."""
    serve = pytest.importorskip("ray.serve")
    try:
        yield
    finally:
        serve.shutdown()
