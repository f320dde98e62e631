"""Cores of its own for each engine replica of a Serve deployment on vLLM's CPU build.

vLLM's CPU build binds its OpenMP threads to the cores it finds allowed, the first of them first
(``VLLM_CPU_OMP_THREADS_BIND=auto``), and every replica of a deployment is started with the same
environment. So on one host every replica's engine ran on the same cores, and two replicas measured
as one (their engine logs: ``core ids=[0]`` twice on two cores). Ray schedules CPUs as counts, never
as core ids.

:class:`ClaimCores` is a Ray Serve LLM callback (``LLMConfig.callback_config``) that runs in each
replica's process before its engine starts. Each rank of the engine takes one core, the CPU build's
device as servetune counts it (a replica count needs as many cores, ``plan.check_fits``), so every
layout of a device budget runs on as many cores, in a study, in serve-check and in verify alike. A
replica takes the first free cores by a lock file per core (engine/cores.py, the same locks bare
engines take; ``flock``: held for the replica
process's life, let go by the kernel when it ends however it ends; a replica being replaced may hold
them a while, so a claim waits up to ``WAIT_S``), and sets ``VLLM_CPU_OMP_THREADS_BIND`` for the
engine it then starts (``0|1`` for two ranks). A bind the user set is kept. Too few free cores: one
rank keeps vLLM's own binding; several are bound to the first cores, as ``export`` binds them
(vLLM's own would refuse several ranks on one NUMA node). Only deployments in a local Ray servetune
started carry the callback (:data:`~servetune.serve.plan.CLAIM_CORES_ENV`); ``export --format
ray-serve`` never does. Cores are logical CPUs, a physical core each first (engine/cores.py `physical_first`).
What the claim got (the binding, or why the replica runs on no cores of its own) is told to the trial that deployed
the replica, for its record, and so is what the replica was started with, for a rollout's check (serve/claims.py).

The same callback skips Ray Serve LLM's node initialization for a model that is a directory on this host: that
step only runs a Ray task per node to "download" the model, which for a local directory returns the path as it
was given, but starts a worker of its own that imports torch and transformers (12 s of each replica's start in
a local study here, two replicas starting beside each other). A local Ray is this host, so the directory is
where the replica reads it. A hub id is still fetched as Ray Serve LLM fetches it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import IO, Any

from ray.llm._internal.common.callbacks.base import CallbackBase

from servetune.engine.cores import BIND, binding, claim, lock_dir, locks_unusable, none_free
from servetune.serve import claims

__all__ = ["BIND", "HELD", "WAIT_S", "ClaimCores", "claim", "lock_dir"]

WAIT_S = 60.0  # how long a claim waits for cores a replica being replaced still holds

logger = logging.getLogger("servetune.serve.cores")
#: The locks this process holds, for its life: module state, as Ray pickles the callback with its config.
HELD: list[IO[str]] = []


class ClaimCores(CallbackBase):
    """``callback_kwargs``: ``ranks``, the engine's ranks (TP x PP x PCP), each a process on cores of its own."""

    def __init__(self, *args: Any, ranks: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ranks = int(ranks)

    async def on_before_node_init(self) -> None:
        if local_model_dir(self.llm_config) is not None:
            _torch_kernels_dir()
            self.ctx.run_init_node = False  # nothing to download: the path is used as given
        claims.tell_started(self.llm_config)  # what a rollout's check compares (serve/trial.py replicas_started)
        claims.tell(await self.bind())

    async def bind(self) -> dict[str, str]:
        """Claim the engine's cores and bind it to them; what the replica's record keeps of it, in a bare engine's
        words (trial/runner.py ``cores_record``): ``cpu_binding``, and ``cpu_unclaimed`` (why) where it got none."""
        if os.environ.get(BIND, "auto") != "auto":
            return {"cpu_binding": os.environ[BIND]}  # the user's binding wins
        allowed = sorted(os.sched_getaffinity(0))
        deadline = time.monotonic() + WAIT_S
        cores: list[int] = []
        unusable: OSError | None = None
        try:
            directory = lock_dir()
            while True:
                cores, held = claim(self.ranks, allowed, directory)
                if cores or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(1.0)
        except OSError as exc:  # the lock directory cannot be used: as without free cores
            unusable = exc
        if cores:
            HELD.extend(held)
        bind = binding(self.ranks, cores, allowed)  # without free cores: several ranks bound as export binds them
        unclaimed = (
            locks_unusable(unusable) if unusable is not None
            else None if cores else none_free(self.ranks, allowed, directory, bind, WAIT_S)
        )  # fmt: skip
        if unclaimed is not None:
            logger.warning("servetune: this replica's engine claimed no cores of its own: %s", unclaimed)
        if bind is not None:
            os.environ[BIND] = bind  # a core per rank; the engine process the replica starts inherits it
            logger.info("servetune: this replica's engine runs on cores %s", bind)
        return {key: value for key, value in (("cpu_binding", bind), ("cpu_unclaimed", unclaimed)) if value}


def local_model_dir(llm_config: Any) -> str | None:
    """The model of ``llm_config`` when it is a directory on this host (what Ray Serve LLM's node initialization
    would hand back unchanged), else None."""
    if llm_config is None:
        return None
    model = llm_config.get_engine_config().actual_hf_model_id
    return model if isinstance(model, str) and os.path.isdir(model) else None


def _torch_kernels_dir() -> None:
    """What the skipped node initialization also did (Ray Serve LLM's ``download_model_files``): create torch's
    ``kernels`` cache directory, which torch cannot create itself when its parent is missing."""
    import torch

    os.makedirs(os.path.join(torch.hub._get_torch_home(), "kernels"), exist_ok=True)
