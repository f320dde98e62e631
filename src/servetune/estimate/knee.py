"""The knee of a measured throughput curve, by the rule the estimate's own knee follows (issue 40's knee target).

The estimate's knee (queueing.py :func:`~servetune.estimate.queueing.knee`) is the smallest concurrency whose
throughput reaches ``KNEE_FRACTION`` (90 %) of the replica's capacity. On a measured ladder of loads
x_1 < ... < x_n (closed loop: clients) with output throughputs (one or more runs a load):

1. each load's throughput is the mean of its runs, t_i;
2. smoothed: s_i is the median of t_(i-1), t_i, t_(i+1) (at the ends, the mean of the two there are), so one
   noisy load neither makes nor hides the knee;
3. the plateau is the median of the s_i within 10 % of the largest (past the knee a closed loop's throughput stays
   at the capacity's, or falls a little where the host is oversubscribed; the largest alone is biased up by the
   noise of the many loads on a plateau);
4. the knee is the smallest load x_k with s_k >= 90 % of the plateau;
5. unless the curve is still climbing there: the loads past the knee must add less than half their proportional
   throughput, (t_n / t_k - 1) / (x_n / x_k - 1) < ``CLIMBING_GAIN`` (the unsmoothed means at x_k and the top
   load x_n). Otherwise (or when x_k is the top load) the ladder has no knee: it lies past its top.

In a closed loop this is also where latency bends: past it E2E grows with the clients (Little's law) while
throughput does not. A knee predicted at concurrency p is placed on the ladder at the first load >= p (one past
the top when p exceeds it); the target, "within one ladder step", is |that index - the measured knee's| <= 1, a
ladder without a knee counting as one past its top.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

from servetune.estimate.queueing import KNEE_FRACTION

PLATEAU_BAND = 0.9  # the plateau: the median of the smoothed throughputs within 10 % of the largest
CLIMBING_GAIN = 0.5  # the loads past a knee add less than this share of their proportional throughput


def curve_means(runs: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """(load, throughput) runs, a load any number of times, as (load, mean throughput) sorted by load."""
    by_load: dict[float, list[float]] = {}
    for load, throughput in runs:
        by_load.setdefault(load, []).append(throughput)
    return sorted((load, statistics.fmean(ts)) for load, ts in by_load.items())


def smoothed(throughputs: Sequence[float]) -> list[float]:
    """Each throughput's median with its neighbours on the ladder (the mean of two at the ends)."""
    if len(throughputs) < 3:
        return list(throughputs)
    return [statistics.median(throughputs[max(0, i - 1) : i + 2]) for i in range(len(throughputs))]


def measured_knee(runs: Iterable[tuple[float, float]], fraction: float = KNEE_FRACTION) -> float | None:
    """The knee of a measured curve (the module's rule); None when the curve still climbs at its top load."""
    points = curve_means(runs)
    if len(points) < 2:
        return None
    loads = [x for x, _ in points]
    means = [t for _, t in points]
    smooth = smoothed(means)
    top_s = max(smooth)
    plateau = statistics.median(s for s in smooth if s >= PLATEAU_BAND * top_s)
    k = next(i for i, s in enumerate(smooth) if s >= fraction * plateau)
    top = len(points) - 1
    if k == top or means[k] <= 0:
        return None
    gain = (means[top] / means[k] - 1) / (loads[top] / loads[k] - 1)
    return loads[k] if gain < CLIMBING_GAIN else None


def ladder_index(ladder: Sequence[float], knee: float | None) -> int:
    """Where a knee sits on a ladder of loads: the first load >= it; one past the top for None or beyond it."""
    loads = sorted(ladder)
    if knee is None:
        return len(loads)
    return next((i for i, x in enumerate(loads) if x >= knee), len(loads))


def steps_apart(ladder: Sequence[float], predicted: float | None, measured: float | None) -> int:
    """Ladder steps from the measured knee to the predicted one (positive: predicted later)."""
    return ladder_index(ladder, predicted) - ladder_index(ladder, measured)
