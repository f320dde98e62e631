"""The load ladder: a generator that yields the next level and is sent the measured result.

Early stopping lives here, in one place: stop climbing once a level breaks the SLO, once
output throughput stops growing (less than ``min_gain`` over the best level so far), or when
the study's own ``stop_rule`` gives a reason (a level finished trials dominate, say).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

from servetune.load.runner import Level
from servetune.results import LevelResult


def ladder(
    levels: Sequence[Level], *, stop_on_slo_break: bool = True, min_gain: float = 0.0,
    stop_rule: Callable[[LevelResult], str | None] | None = None,
) -> Generator[Level, LevelResult, str | None]:
    """Yield levels in order; ``send`` each level's result. Returns why it stopped early, if it did."""
    best_throughput = 0.0
    for index, level in enumerate(levels):
        result = yield level
        if index == len(levels) - 1:
            break
        summary = result.summary
        if summary.completed == 0:
            return f"no request completed at {level}"
        if stop_on_slo_break and not result.meets_slo:
            return f"SLO broken at {level}: {'; '.join(result.slo_violations)}"
        if best_throughput > 0 and summary.output_throughput < best_throughput * (1 + min_gain):
            return f"saturated at {level}: output throughput {summary.output_throughput:.1f} tok/s, best so far {best_throughput:.1f}"
        best_throughput = max(best_throughput, summary.output_throughput)
        reason = stop_rule(result) if stop_rule is not None else None
        if reason:
            return reason
    return None

