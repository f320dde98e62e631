"""Early stopping that cannot lose the winner, and what early stopping saved.

Beyond the ladder's own rules (SLO broken, saturated), a trial stops climbing when no level it
has left could give a point that a finished trial does not already beat. The bound is
optimistic on purpose:

- **cost**: output throughput grows at most in proportion to the load. At concurrency ``c``
  going to ``c'`` (or a rate ``r`` to ``r'``), it can at best be multiplied by ``c'/c``, and
  concurrency beyond what the engine runs at once (``max_num_seqs`` x data parallel, and the
  KV cache's maximum concurrency) adds nothing. So no higher level costs less than
  ``cost now / scale``.
- **latency**: P99 TTFT does not fall as load rises, so no higher level is faster than now.

A finished point that meets the SLO, at any level, and is cheaper than that optimistic cost and
faster than now, by the noise margin on both counts, dominates every point the trial could
still measure: the trial stops. The margin is the measured spread of the level's own repeats
(``load.repeats``), at least ``MIN_MARGIN``; a level run once takes ``MARGIN``, measured on this
kind of host (results.py's ``noise_margin``; the ladder's saturation rule uses it too). It is on
by default for Bayesian search and off for grid and random search (``load.stop_when_dominated``).

In capacity terms too (trials that search for their capacity at the SLO): a trial stops once the most load it
could still carry within the SLO (below the lowest load that broke it, else the top of what it may still measure,
at most what its engine runs at once) cannot beat a finished trial's measured capacity at an equal or lower cost:
the finished trial carries more than this one ever could, by the margin, at a cost at capacity below this one's
optimistic cost by the margin too.

Finished trials' points reach running trials through :class:`FinishedPoints`, a small Ray
actor the driver starts with the points already on disk (``--resume``) and every trial adds
its own to when it completes. Trials may run on other nodes with no disk shared with the
driver, and the points stay current while a trial runs, which a snapshot in the trial's
configuration would not.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from servetune.accounting import DOMINATED
from servetune.load.runner import Level
from servetune.metrics import COST_METRIC, TTFT_P99
from servetune.results import MARGIN, OperatingPoint, TrialResult, level_load, noise_margin
from servetune.trial.runner import StopRule

#: What dominance compares (lower is better for both).
TTFT_METRIC = TTFT_P99


def _level_text(level: Mapping[str, float]) -> str:
    return ", ".join(f"rate {v:g} req/s" if k == "rate" else f"{k} {v:g}" for k, v in level.items())


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def engine_limit(result: TrialResult) -> float | None:
    """The most requests the trial's engine runs at once (None when not known)."""
    limits = []
    for args in (result.engine_args, result.resolved_engine_args):
        seqs = _number(args.get("max_num_seqs"))
        if seqs is not None:
            limits.append(seqs * (_number(args.get("data_parallel_size")) or 1.0))
            break
    if result.kv_capacity is not None and result.kv_capacity.max_concurrency:
        limits.append(result.kv_capacity.max_concurrency * max(result.kv_capacity.engines, 1))
    return min(limits) if limits else None


def optimistic_scale(result: TrialResult, remaining: Sequence[Level]) -> float:
    """At most how many times its current output throughput the trial could reach at the levels it has left."""
    if not result.levels:
        return 1.0
    (kind, now), *_ = result.levels[-1].summary.level.items()
    ahead = [level.value for level in remaining if level.kind == kind]
    if not ahead or now <= 0:
        return 1.0
    top = max(ahead)
    limit = engine_limit(result) if kind == "concurrency" else None
    if limit is not None:
        top = min(top, max(limit, now))
    return max(top / now, 1.0)


def dominating_point(point: OperatingPoint, finished: Iterable[OperatingPoint], scale: float = 1.0,
                     margin: float = MARGIN) -> OperatingPoint | None:  # fmt: skip
    """A finished point, at any level, that beats every point this trial could still measure.

    It meets the SLO and is cheaper than ``cost now / scale`` and faster than P99 TTFT now, each
    by ``margin``; of several, the cheapest. Points missing either metric neither dominate nor are dominated.
    """
    cost, ttft = point.metrics.get(COST_METRIC), point.metrics.get(TTFT_METRIC)
    if cost is None or ttft is None:
        return None
    best_cost = cost / scale
    better = [
        other for other in finished
        if other.meets_slo and other.trial_id != point.trial_id
        and other.metrics.get(COST_METRIC, float("inf")) <= best_cost * (1 - margin)
        and other.metrics.get(TTFT_METRIC, float("inf")) <= ttft * (1 - margin)
    ]  # fmt: skip
    return min(better, key=lambda p: p.metrics[COST_METRIC], default=None)


def stop_reason(point: OperatingPoint, dominator: OperatingPoint | None, scale: float = 1.0) -> str | None:
    """The ladder's reason to stop (``dominated at ...``), or None to keep climbing."""
    if dominator is None:
        return None
    at_best = f", at best ${point.metrics[COST_METRIC] / scale:.3g} higher up" if scale > 1 else ""
    return (
        f"{DOMINATED} {_level_text(point.level)}: trial {dominator.trial_id} at {_level_text(dominator.level)} costs "
        f"${dominator.metrics[COST_METRIC]:.3g}/Mtok (this one ${point.metrics[COST_METRIC]:.3g}{at_best}) with TTFT p99 "
        f"{dominator.metrics[TTFT_METRIC]:.0f} ms (this one {point.metrics[TTFT_METRIC]:.0f} ms)"
    )


@dataclass(frozen=True)
class FinishedCapacity:
    """A finished trial's capacity at the SLO and its cost per million output tokens there."""

    trial_id: str
    kind: str  # concurrency | rate
    value: float
    cost: float


def optimistic_capacity(result: TrialResult, remaining: Sequence[Level]) -> tuple[str, float] | None:
    """The most load the trial could still carry within the SLO, in its ladder's kind: below the lowest load that broke
    the SLO (that load, as the exclusive bound), else the highest it measured or may still measure, at most what its
    engine runs at once (concurrency)."""
    if not result.levels:
        return None
    (kind, _), *_ = result.levels[-1].summary.level.items()
    broke = [level_load(lv) for lv in result.levels if not lv.meets_slo and kind in lv.summary.level]
    if broke:
        return kind, min(broke)
    loads = [level_load(lv) for lv in result.levels if kind in lv.summary.level]
    loads += [level.value for level in remaining if level.kind == kind]
    top = max(loads)
    limit = engine_limit(result) if kind == "concurrency" else None
    return kind, (min(top, limit) if limit is not None else top)


def capacity_reason(result: TrialResult, remaining: Sequence[Level], finished: Iterable[FinishedCapacity],
                    point: OperatingPoint, scale: float, margin: float) -> str | None:  # fmt: skip
    """Why the trial's capacity cannot beat a finished trial's at an equal or lower cost, or None (``point``: its
    last level's, ``scale``: :func:`optimistic_scale` over ``remaining``)."""
    reach = optimistic_capacity(result, remaining)
    if reach is None:
        return None
    kind, most = reach
    cost = point.metrics.get(COST_METRIC)
    if cost is None:
        return None
    best_cost = cost / scale
    beaten = [f for f in finished if f.trial_id != result.trial_id and f.kind == kind
              and f.value >= most * (1 + margin) and f.cost <= best_cost * (1 - margin)]  # fmt: skip
    if not beaten:
        return None
    best = max(beaten, key=lambda f: (f.value, -f.cost))
    unit = "req/s" if kind == "rate" else "clients"
    return (f"{DOMINATED} {_level_text(point.level)} in capacity: trial {best.trial_id} carries {best.value:g} {unit} "
            f"within the SLO at ${best.cost:.3g}/Mtok; this one at most {most:g} {unit}, at best ${best_cost:.3g}")  # fmt: skip


def judge(result: TrialResult, remaining: Sequence[Level], finished: Iterable[OperatingPoint],
          capacities: Iterable[FinishedCapacity] = ()) -> str | None:  # fmt: skip
    """The stop rule on plain data: why the trial cannot win any more, or None to keep climbing."""
    if not result.levels:
        return None
    point = result.operating_points()[-1]
    scale = optimistic_scale(result, remaining)
    margin = noise_margin(result.levels[-1])
    return stop_reason(point, dominating_point(point, finished, scale, margin), scale) or capacity_reason(
        result, remaining, capacities, point, scale, margin
    )


class FinishedPoints:
    """The operating points of finished trials: what a running trial compares itself to.

    Plain Python; during a study it runs as a Ray actor (:func:`start_finished_points`).
    Only trials that ran to completion and passed their quality probe count, and only their
    levels that met the SLO: a configuration that cannot be shipped stops no other.
    """

    def __init__(self, results: Iterable[TrialResult] = ()) -> None:
        self._points: list[OperatingPoint] = []
        self._capacities: list[FinishedCapacity] = []
        for result in results:
            self.add(result)

    def add(self, result: TrialResult) -> None:
        if result.outcome != "COMPLETE" or (result.quality is not None and result.quality.passed is False):
            return
        points = result.operating_points()
        self._points += [point for point in points if point.meets_slo]
        index = result.capacity_level_index
        if index is not None and result.capacity_at_slo is not None and result.capacity_at_slo.value is not None:
            at = points[index]
            (kind, _), *_ = at.level.items()
            cost = at.metrics.get(COST_METRIC)
            if cost is not None:
                self._capacities.append(FinishedCapacity(result.trial_id, kind, result.capacity_at_slo.value, cost))

    def points(self) -> list[OperatingPoint]:
        return list(self._points)

    def capacities(self) -> list[FinishedCapacity]:
        return list(self._capacities)


def start_finished_points(results: Iterable[TrialResult]) -> Any:
    """The :class:`FinishedPoints` actor of a study (no CPU reserved: it only answers look-ups)."""
    import ray

    return ray.remote(num_cpus=0)(FinishedPoints).remote(list(results))


def dominance_rule(board: Any, timeout_s: float = 10.0) -> StopRule:
    """The stop rule a trial adds to its ladder: :func:`judge` against the study's :class:`FinishedPoints` actor.

    Without an answer in ``timeout_s`` (the driver is gone, say), the trial keeps climbing:
    stopping early saves time, it is never needed for a correct result.
    """
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    def rule(result: TrialResult, remaining: Sequence[Level]) -> str | None:
        try:
            finished, capacities = ray.get([board.points.remote(), board.capacities.remote()], timeout=timeout_s)
        except (GetTimeoutError, RayError):  # the actor is gone or slow: keep climbing
            return None
        return judge(result, remaining, finished, capacities)

    return rule
