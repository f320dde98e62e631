"""The TTFT distribution of the recommended trial at each of its levels, not only P50 and P99.

Closed-loop clients with equal output lengths tend to move in waves: a request that arrives
alone gets its first token in tens of milliseconds, one that arrives behind a wave of prefills
waits several times longer. Percentiles hide that shape; the distribution (each level keeps its
TTFT at every fifth percentile, ``LevelResult.ttft_ms_distribution``) and the share of requests
sent within 10 ms of another (``send_sync_share``) show it. The renderers draw it: an
empirical CDF per level in the HTML, a row of percentiles per level in the Markdown.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from servetune.metrics import DISTRIBUTION_PERCENTILES
from servetune.report.points import ReportPoint, level_label, point_trial
from servetune.results import TrialResult

#: The percentiles the Markdown table shows (the HTML draws all of them).
TABLE_PERCENTILES = (5, 25, 50, 75, 95, 100)


@dataclass(frozen=True)
class LevelSpread:
    """One level's TTFTs: in milliseconds at :data:`~servetune.metrics.DISTRIBUTION_PERCENTILES`."""

    level: str  # ``concurrency 8``
    ttft_ms: tuple[float, ...]
    sent_together: float | None  # share of requests sent within 10 ms of another
    meets_slo: bool

    def at(self, percentile: int) -> float:
        return self.ttft_ms[DISTRIBUTION_PERCENTILES.index(percentile)]

    @property
    def spread(self) -> float | None:
        """P95 over P5: near 1 when every request waited alike; far above when some waited behind waves."""
        low = self.at(5)
        return self.at(95) / low if low > 0 else None


def ttft_spreads(trials: Sequence[TrialResult], point: ReportPoint | None) -> tuple[LevelSpread, ...]:
    """Every level of the recommended point's trial that kept its TTFT distribution (none before it was kept)."""
    trial = point_trial(trials, point)
    if trial is None:
        return ()
    return tuple(
        LevelSpread(level_label(lv.summary.level), tuple(lv.ttft_ms_distribution), lv.send_sync_share, lv.meets_slo)
        for lv in trial.levels
        if lv.ttft_ms_distribution is not None and len(lv.ttft_ms_distribution) == len(DISTRIBUTION_PERCENTILES)
    )


def spread_headings() -> list[str]:
    return ["level", *(("max" if p == 100 else f"P{p}") for p in TABLE_PERCENTILES), "P95/P5", "sent together", "SLO"]


def spread_cells(spread: LevelSpread) -> list[str]:
    ratio = spread.spread
    together = "-" if spread.sent_together is None else f"{spread.sent_together:.0%}"
    return [
        spread.level,
        *(f"{spread.at(p):.0f}" for p in TABLE_PERCENTILES),
        "-" if ratio is None else f"{ratio:.1f}x",
        together,
        "met" if spread.meets_slo else "broken",
    ]


SPREAD_NOTE = (
    "TTFT in ms over the level's measured requests. A wide P95/P5 with many requests sent together means "
    "the clients moved in waves: the early requests of a wave wait behind the others' prefills."
)
