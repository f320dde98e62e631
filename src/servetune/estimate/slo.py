"""Which of an SLO's bounds an estimate breaks: where along a load ladder each bound is predicted to break.

The estimate gives mean TTFT and mean TPOT (ITL is TPOT on average). A bound on the mean, P90, P95 or P99 of
TTFT, TPOT or ITL is judged by that mean: each of those statistics is at least the mean for the latency
distributions servetune measures, so a mean over the bound predicts the bound broken (a mean within it does not
promise the tail is). A bound on the median (a tail pulls the mean above it), on E2E latency, the error rate or
structured output is not judged. A saturated open loop's queue grows without bound, and so does its TTFT: it
breaks every TTFT bound judged.
"""

from __future__ import annotations

from servetune.config.slo import Slo, SloBound
from servetune.estimate.model import Estimate

#: The statistics of an SLO bound the estimate (a mean) is compared with: each is at least the mean for the
#: latency distributions servetune measures (a bound on the median is not: a tail pulls the mean above it).
ESTIMATED_STATS = frozenset({"mean", "p90", "p95", "p99"})
#: The SLO metrics the estimate predicts, and the estimate's figure for each (ITL is TPOT on average).
ESTIMATED_METRICS = {"ttft_ms": "ttft_ms", "tpot_ms": "tpot_ms", "itl_ms": "tpot_ms"}


def judged_bounds(slo: Slo) -> tuple[SloBound, ...]:
    """The bounds of ``slo`` an estimate can judge (the module says which), in the SLO's order."""
    return tuple(b for b in slo.bounds if b.metric in ESTIMATED_METRICS and b.stat in ESTIMATED_STATS)


def broken_bounds(est: Estimate, slo: Slo) -> list[str]:
    """The judged bounds ``est`` breaks, as ``ttft_ms_p95 <= 800: 1,234 ms`` (``unbounded`` for a saturated open
    loop's TTFT); empty where the estimate meets every bound it judges."""
    broken = []
    for bound in judged_bounds(slo):
        value = getattr(est, ESTIMATED_METRICS[bound.metric])
        if value is None:  # an open loop past its capacity: the queue, and every request's TTFT, grow without end
            broken.append(f"{bound}: unbounded (saturated)")
        elif bound.breaks(value):
            broken.append(f"{bound}: {value:,.0f} ms")
    return broken
