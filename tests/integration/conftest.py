"""Fixtures the integration tests share."""

from collections.abc import Iterator

import pytest


@pytest.fixture
def local_ray() -> Iterator[None]:
    """A local Ray of two CPUs for the test, with Serve stopped and Ray shut down after it."""
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()
