"""Environment variables this process sets for a while: a default for a setting a library reads from the
environment (Ray's wait for its GCS port, MLflow's retries), never over what the user set.

It imports nothing of servetune's and sits below every room: ``local_ray`` (the bottom room) and ``tracking/`` both
use it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


@contextmanager
def env_defaults(values: Mapping[str, str]) -> Iterator[None]:
    """Each of ``values`` set in this process's environment for the block, unless it is set already (the user's
    choice stands); what it set is removed when the block ends, by an exception too."""
    added = [name for name in values if name not in os.environ]
    for name in added:
        os.environ[name] = values[name]
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)
