"""Early stopping by dominance, and what early stopping saved.

Beyond the ladder's own rules (SLO broken, saturated), a trial stops at a level where a
finished trial, at the same level, already did better on both counts: a lower cost per
million output tokens and a lower P99 TTFT, while meeting the SLO. Climbing further would
rarely give a point on the Pareto front: the finished trial climbed too. It is a heuristic
that trades completeness for GPU time, so it is on by default for Bayesian search and off for
grid and random search (``load.stop_when_dominated``).

Finished trials' points reach running trials through :class:`FinishedPoints`, a small Ray
actor the driver starts with the points already on disk (``--resume``) and every trial adds
its own to when it completes. Trials may run on other nodes with no disk shared with the
driver, and the points stay current while a trial runs, which a snapshot in the trial's
configuration would not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from servetune.accounting import DOMINATED
from servetune.metrics import COST_METRIC
from servetune.results import OperatingPoint, TrialResult

#: What dominance compares (lower is better for both).
TTFT_METRIC = "ttft_ms_p99"
#: How much better a finished point must be on both counts: P99 TTFT of one level is noisy,
#: and a trial stopped on noise never shows what it does at higher load.
MARGIN = 0.05


def _level_key(level: Mapping[str, float]) -> tuple[tuple[str, float], ...]:
    return tuple(sorted((k, float(v)) for k, v in level.items()))


def _level_text(level: Mapping[str, float]) -> str:
    return ", ".join(f"rate {v:g} req/s" if k == "rate" else f"{k} {v:g}" for k, v in level.items())


def dominating_point(point: OperatingPoint, finished: Iterable[OperatingPoint]) -> OperatingPoint | None:
    """A finished point at the same level that meets the SLO and is cheaper and faster, if any.

    Better by at least :data:`MARGIN` on both counts; of several, the cheapest. Points missing
    either metric neither dominate nor are dominated.
    """
    cost, ttft = point.metrics.get(COST_METRIC), point.metrics.get(TTFT_METRIC)
    if cost is None or ttft is None:
        return None
    key = _level_key(point.level)
    better = [
        other for other in finished
        if other.meets_slo and other.trial_id != point.trial_id and _level_key(other.level) == key
        and other.metrics.get(COST_METRIC, float("inf")) <= cost * (1 - MARGIN)
        and other.metrics.get(TTFT_METRIC, float("inf")) <= ttft * (1 - MARGIN)
    ]  # fmt: skip
    return min(better, key=lambda p: p.metrics[COST_METRIC], default=None)


def dominated_at_level(point: OperatingPoint, finished: Iterable[OperatingPoint]) -> bool:
    """Whether a finished trial did better at this level: cheaper AND lower P99 TTFT, within the SLO."""
    return dominating_point(point, finished) is not None


def stop_reason(point: OperatingPoint, dominator: OperatingPoint | None) -> str | None:
    """The ladder's reason to stop (``dominated at ...``), or None to keep climbing."""
    if dominator is None:
        return None
    return (
        f"{DOMINATED} {_level_text(point.level)}: trial {dominator.trial_id} costs "
        f"${dominator.metrics[COST_METRIC]:.3g}/Mtok (this one ${point.metrics[COST_METRIC]:.3g}) with TTFT p99 "
        f"{dominator.metrics[TTFT_METRIC]:.0f} ms (this one {point.metrics[TTFT_METRIC]:.0f} ms)"
    )


class FinishedPoints:
    """The operating points of finished trials, by level: what a running trial compares itself to.

    Plain Python; during a study it runs as a Ray actor (:func:`start_finished_points`).
    Only trials that ran to completion count, and only their levels that met the SLO.
    """

    def __init__(self, results: Iterable[TrialResult] = ()) -> None:
        self._by_level: dict[tuple[tuple[str, float], ...], list[OperatingPoint]] = {}
        for result in results:
            self.add(result)

    def add(self, result: TrialResult) -> None:
        if result.outcome != "COMPLETE":
            return
        for point in result.operating_points():
            if point.meets_slo:
                self._by_level.setdefault(_level_key(point.level), []).append(point)

    def at_level(self, level: Mapping[str, float]) -> list[OperatingPoint]:
        return list(self._by_level.get(_level_key(level), []))


def start_finished_points(results: Iterable[TrialResult]) -> Any:
    """The :class:`FinishedPoints` actor of a study (no CPU reserved: it only answers look-ups)."""
    import ray

    return ray.remote(num_cpus=0)(FinishedPoints).remote(list(results))


def dominance_rule(board: Any, timeout_s: float = 10.0) -> Callable[[OperatingPoint], str | None]:
    """The stop rule a trial adds to its ladder: asks the study's :class:`FinishedPoints` actor.

    Without an answer in ``timeout_s`` (the driver is gone, say), the trial keeps climbing:
    stopping early saves time, it is never needed for a correct result.
    """
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    def rule(point: OperatingPoint) -> str | None:
        try:
            finished = ray.get(board.at_level.remote(point.level), timeout=timeout_s)
        except (GetTimeoutError, RayError):  # the actor is gone or slow: keep climbing
            return None
        return stop_reason(point, dominating_point(point, finished))

    return rule
