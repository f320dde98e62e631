"""Cores of its own for each engine replica of a Serve deployment on vLLM's CPU build.

vLLM's CPU build binds its OpenMP threads to the cores it finds allowed, the first of them first
(``VLLM_CPU_OMP_THREADS_BIND=auto``), and every replica of a deployment is started with the same
environment. So on one host every replica's engine ran on core 0, and two replicas measured as one
(their engine logs: ``core ids=[0]`` twice). Ray schedules CPUs as counts, never as core ids.

:class:`ClaimCores` is a Ray Serve LLM callback (``LLMConfig.callback_config``) that runs in each
replica's process before its engine starts. It takes the first cores of this host that no other
replica holds, by a lock file per core (``flock``: held for the replica process's life, let go by
the kernel when it ends however it ends), and sets ``VLLM_CPU_OMP_THREADS_BIND`` to them for the
engine the replica then starts. A replica finding too few free cores, or a bind set by the user,
keeps vLLM's own choice. Only servetune's own deployments carry the callback on the CPU build;
``export --format ray-serve`` does not (a GPU deployment places its devices through Ray).
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from pathlib import Path
from typing import IO, Any

from ray.llm._internal.common.callbacks.base import CallbackBase

BIND = "VLLM_CPU_OMP_THREADS_BIND"

logger = logging.getLogger("servetune.serve.cores")
#: The locks this process holds, for its life: module state, as Ray pickles the callback with its config.
HELD: list[IO[str]] = []


def lock_dir() -> Path:
    """Where this host's core locks are (shared by every replica on it, of any application)."""
    path = Path(tempfile.gettempdir()) / "servetune-cpu-cores"
    path.mkdir(exist_ok=True)
    return path


def claim(count: int, allowed: list[int], directory: Path) -> tuple[list[int], list[IO[str]]]:
    """The first ``count`` cores of ``allowed`` no other process holds, and their held locks; nothing
    (all let go) when fewer are free."""
    held: list[tuple[int, IO[str]]] = []
    for core in sorted(allowed):
        if len(held) == count:
            break
        handle = open(directory / f"core-{core}.lock", "a")  # noqa: SIM115 - held for the process's life
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            continue
        held.append((core, handle))
    if len(held) < count:
        for _, handle in held:
            handle.close()
        return [], []
    return [core for core, _ in held], [handle for _, handle in held]


class ClaimCores(CallbackBase):
    """``callback_kwargs``: ``cores``, the cores each replica's engine takes (one per rank on the CPU build)."""

    def __init__(self, *args: Any, cores: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cores = int(cores)

    async def on_before_node_init(self) -> None:
        if os.environ.get(BIND, "auto") != "auto":
            return  # the user's binding wins
        cores, held = claim(self.cores, sorted(os.sched_getaffinity(0)), lock_dir())
        HELD.extend(held)
        if not cores:
            logger.warning("servetune: fewer than %d free cores on this host; vLLM binds the engine itself", self.cores)
            return
        os.environ[BIND] = "|".join(map(str, cores))  # a core per rank; the engine process the replica starts inherits it
        logger.info("servetune: this replica's engine runs on cores %s", os.environ[BIND])
