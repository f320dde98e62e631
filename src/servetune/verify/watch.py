"""What verify watches while it loads the engine: vLLM's ``/metrics`` and the engine's memory.

:class:`Trace` samples, once a second, vLLM's gauges (requests running and waiting, KV-cache
usage) and the resident memory of the engine's processes; ``read_metrics`` (the trial's own reader,
``trial/measure.py``) reads them once, counters included (the disconnect scenario follows running
requests, the requests finished, which a light read carries too, and generated tokens): from ``/metrics``, or from a
:class:`~servetune.trial.readings.MetricsSource` where the URL has none (a Serve deployment's replicas,
read through Ray's metrics agents, late by up to the source's ``lag_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import psutil

from servetune.engine.metrics import MetricsSnapshot
from servetune.load.runner import cancel_and_wait
from servetune.trial.readings import MetricsSource, read_metrics


def in_flight(snap: MetricsSnapshot) -> float:
    """Requests vLLM holds: running plus waiting."""
    return snap.gauges.get("requests_running", 0.0) + snap.gauges.get("requests_waiting", 0.0)


def finished(snap: MetricsSnapshot | None) -> float | None:
    """Requests vLLM finished (``request_success``, aborts left out), a light read's too; None: not read."""
    return snap.counters.get("requests_finished") if snap is not None else None


def engine_rss_bytes(pid: int | None) -> float | None:
    """Resident memory of a process and all its descendants (the engine under its reaper)."""
    if pid is None:
        return None
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return float(total)


def lag_s(metrics: MetricsSource | None) -> float:
    """How late the engine's metrics can be read: 0 from its own ``/metrics``."""
    return metrics.lag_s if metrics is not None else 0.0


class Trace:
    """Samples in the background while a scenario runs: ``async with Trace(url, pid, metrics) as trace``
    (a lagging source is read every half of its lag: it changes no faster)."""

    def __init__(self, url: str, pid: int | None, metrics: MetricsSource | None = None, every_s: float = 1.0) -> None:
        self.url, self.pid, self.metrics = url, pid, metrics
        self.every_s = max(every_s, lag_s(metrics) / 2)
        self.kv_usage: list[tuple[float, float]] = []  # (seconds, fraction)
        self.rss_mib: list[tuple[float, float]] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        start = time.perf_counter()
        async with aiohttp.ClientSession() as session:
            while True:
                at = time.perf_counter() - start
                snap = await read_metrics(session, self.url, self.metrics, gauges_only=True)
                if snap is not None and "kv_cache_usage" in snap.gauges:
                    self.kv_usage.append((at, snap.gauges["kv_cache_usage"]))
                rss = engine_rss_bytes(self.pid)
                if rss is not None:
                    self.rss_mib.append((at, rss / 2**20))
                await asyncio.sleep(self.every_s)

    async def __aenter__(self) -> Trace:
        self._task = asyncio.ensure_future(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
