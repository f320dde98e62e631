"""What a level reads from the server it measures: vLLM's metrics (``/metrics``, or a source in its place for a
Serve deployment, read until it has counted the level), its prefix cache emptied before a level, and whether a
level's cache hit rate is more than its workload's shared prefix explains (``cache_note``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import aiohttp

from servetune.config.workload import Workload
from servetune.engine.metrics import MetricsSnapshot


async def scrape(session: aiohttp.ClientSession, url: str, gauges_only: bool = False) -> MetricsSnapshot | None:
    """One read of ``/metrics``; None when the server has none or did not answer."""
    try:
        async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
            return MetricsSnapshot.parse_gauges(text) if gauges_only else MetricsSnapshot.parse(text)
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None


async def reset_prefix_cache(session: aiohttp.ClientSession, url: str) -> bool:
    """Empty the server's prefix cache; False where it has no such endpoint or refused."""
    try:
        async with session.post(f"{url}/reset_prefix_cache", timeout=aiohttp.ClientTimeout(total=30)) as resp:
            return resp.status == 200
    except (TimeoutError, aiohttp.ClientError):
        return False


#: How far (absolute) the measured prefix-cache hit rate may stand above the workload's before a
#: level is flagged: block rounding and the shared prefix's first, cold request make the
#: explained rate an approximation.
HIT_RATE_MARGIN = 0.05


def explained_hit_rate(workload: Workload, mean_prompt_tokens: float, reused_share: float | None = None) -> float:
    """The prefix-cache hit rate the workload's shared prefix explains (prompts are otherwise unique).

    With sessions, later turns reuse their conversation: ``reused_share`` is the share of the
    level's prompt tokens that an earlier prompt began with (``RequestSpec.reused_tokens``).
    """
    if reused_share is not None:
        return min(1.0, reused_share)
    shared = workload.shared_prefix
    if shared is None or mean_prompt_tokens <= 0:
        return 0.0
    return min(1.0, shared.fraction * shared.tokens / mean_prompt_tokens)


def cache_note(server: dict[str, float], workload: Workload, mean_prompt_tokens: float, reset: bool,
               reused_share: float | None = None) -> str | None:  # fmt: skip
    """Why this level's prefix cache may have been warm (None when nothing says so)."""
    measured = server.get("prefix_cache_hit_rate")
    if measured is not None:
        explained = explained_hit_rate(workload, mean_prompt_tokens, reused_share)
        if measured > explained + HIT_RATE_MARGIN:
            return (f"prefix-cache hit rate {measured:.0%} is above the {explained:.0%} the workload's shared "
                    "prefix explains: a warm cache may flatter this level")  # fmt: skip
    if not reset:
        return "the prefix cache could not be emptied before the level (the server has no /reset_prefix_cache)"
    return None


class MetricsSource(Protocol):
    """Where a server's metrics come from when it has no ``/metrics`` of its own (a Serve deployment's
    replicas export theirs through Ray's metrics agents): ``read`` is one read, blocking; the values
    read lag the server's by up to ``lag_s``, so the read that closes a level may wait that long."""

    lag_s: float

    def read(self, gauges_only: bool = False) -> MetricsSnapshot | None: ...


def report_interval_s(metrics: MetricsSource) -> float:
    """How often a lagging source's values change, so how often a read of it can tell something new: one report
    interval of Ray's metrics agents, which its ``lag_s`` holds twice, with half a second (``ServeCluster.metrics_lag_s``).
    A poll at this interval sees a change at most an interval after it reached the agents, within the second interval of
    ``lag_s``; each read makes the agents render every metric of their node, which costs Ray's dashboard agent CPU."""
    return max((metrics.lag_s - 0.5) / 2, 0.5)


async def read_metrics(session: aiohttp.ClientSession, url: str, metrics: MetricsSource | None,
                       gauges_only: bool = False) -> MetricsSnapshot | None:  # fmt: skip
    """One read of the server's vLLM metrics: ``metrics`` where given, else ``{url}/metrics``."""
    if metrics is not None:
        return await asyncio.to_thread(metrics.read, gauges_only)
    return await scrape(session, url, gauges_only=gauges_only)


#: How many of a lagging source's promised lags the read that closes a level may wait for it to count the level's
#: requests. One was not enough on a busy two-core host: in a clean-clone CI run Ray's metrics agents had counted 19
#: of a Serve level's 24 requests 2.5 s (two report intervals and a half) after it, while the load client, the
#: replicas and the next test's processes shared both cores. The wait ends as soon as the count is there, so a
#: source that keeps up costs nothing more.
SETTLE_LAGS = 4


async def settled(read: Callable[[], Awaitable[MetricsSnapshot | None]], before: MetricsSnapshot, finished: int,
                   wait_s: float, every_s: float = 0.25, peaks: dict[str, float] | None = None) -> MetricsSnapshot | None:  # fmt: skip
    """A lagging source's read once it counts ``finished`` more requests than ``before`` did (vLLM's
    ``request_success``), or its last read after ``wait_s``: no longer than the lag needs. A source
    with nothing to read is not waited for. Each read's gauges raise ``peaks``: until the source has
    counted the level, what it shows is the level itself, late (a level shorter than the lag is
    seen only here)."""
    deadline = time.perf_counter() + wait_s
    while True:
        after = await read()
        if after is None:
            return None  # nothing to read after a whole level (a replica's counters appear within an interval): it cannot be read
        if peaks is not None:
            keep_peaks(peaks, after)
        counted = after.counters.get("requests_finished", 0.0) - before.counters.get("requests_finished", 0.0)
        if counted >= finished or time.perf_counter() >= deadline:
            return after
        await asyncio.sleep(every_s)


def keep_peaks(peaks: dict[str, float], snap: MetricsSnapshot) -> None:
    """Raise each gauge's peak (``<gauge>_max``) to what ``snap`` read."""
    for name, value in snap.gauges.items():
        peaks[f"{name}_max"] = max(peaks.get(f"{name}_max", 0.0), value)
