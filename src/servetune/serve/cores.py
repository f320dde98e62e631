"""Cores of its own for each engine replica of a Serve deployment on vLLM's CPU build.

vLLM's CPU build binds its OpenMP threads to the cores it finds allowed, the first of them first
(``VLLM_CPU_OMP_THREADS_BIND=auto``: every core of the first NUMA node but one, kept for the
frontend), and every replica of a deployment is started with the same environment. So on one host
every replica's engine ran on the same cores, and two replicas measured as one (their engine logs:
``core ids=[0]`` twice on two cores). Ray schedules CPUs as counts, never as core ids.

:class:`ClaimCores` is a Ray Serve LLM callback (``LLMConfig.callback_config``) that runs in each
replica's process before its engine starts. The host's cores but one (vLLM's reserve) are split
among the replicas servetune deploys on it (:data:`~servetune.serve.plan.REPLICAS_PER_HOST`, set
where servetune starts a local Ray), at least one core per rank: one replica alone gets what vLLM
would give it. A replica takes the first free ones by a lock file per core (``flock``: held for
the replica process's life, let go by the kernel when it ends however it ends; a replica being
replaced may hold them a while, so a claim waits up to ``WAIT_S``), and sets
``VLLM_CPU_OMP_THREADS_BIND`` for the engine it then starts (a list of cores per rank). A bind the
user set, or too few free cores, keeps vLLM's own choice. ``export --format ray-serve`` never
carries the callback.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from ray.llm._internal.common.callbacks.base import CallbackBase

from servetune.serve.plan import REPLICAS_PER_HOST

BIND = "VLLM_CPU_OMP_THREADS_BIND"
WAIT_S = 60.0  # how long a claim waits for cores a replica being replaced still holds

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


def per_rank(allowed: int, ranks: int, replicas: int) -> int:
    """Cores for each rank when ``replicas`` replicas of ``ranks`` ranks share ``allowed`` cores, one of
    them kept for the frontends as vLLM keeps it: at least one."""
    return max(1, (allowed - 1) // max(replicas * ranks, 1))


def bind_text(cores: list[int], ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``cores`` split evenly among ``ranks`` (``0,1|2,3``)."""
    size = len(cores) // ranks
    return "|".join(",".join(map(str, cores[i * size:(i + 1) * size])) for i in range(ranks))


class ClaimCores(CallbackBase):
    """``callback_kwargs``: ``ranks``, the engine's ranks (TP x PP), each a process on cores of its own."""

    def __init__(self, *args: Any, ranks: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ranks = int(ranks)

    async def on_before_node_init(self) -> None:
        if os.environ.get(BIND, "auto") != "auto":
            return  # the user's binding wins
        allowed = sorted(os.sched_getaffinity(0))
        count = self.ranks * per_rank(len(allowed), self.ranks, int(os.environ.get(REPLICAS_PER_HOST) or 1))
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                cores, held = claim(count, allowed, lock_dir())
            except OSError as exc:  # the lock directory cannot be used: vLLM binds as it would
                logger.warning("servetune: cannot claim cores (%s); vLLM binds the engine itself", exc)
                return
            if cores or time.monotonic() >= deadline:
                break
            await asyncio.sleep(1.0)
        if not cores:
            logger.warning("servetune: fewer than %d free cores on this host after %.0f s; vLLM binds the engine itself",
                           count, WAIT_S)  # fmt: skip
            return
        HELD.extend(held)
        os.environ[BIND] = bind_text(cores, self.ranks)  # the engine process the replica starts inherits it
        logger.info("servetune: this replica's engine runs on cores %s", os.environ[BIND])
