"""Pareto fronts over operating points, as plain data (renderers draw them; tests check them).

A point may stand on a front when its trial completed, it meets every SLO, and it has a
finite value for every objective. Among those, a point is on the front when no other point
dominates it: at least as good on every objective and strictly better on one. Two equal
points do not dominate each other, so both are on the front.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from servetune.metrics import COST_METRIC, E2EL_P99, ENERGY_PER_TOKEN, TPOT_P99, TTFT_P99
from servetune.report.points import OUTPUT_THROUGHPUT_PER_DEVICE, OUTPUT_THROUGHPUT_PER_USER, ReportPoint

Direction = Literal["min", "max"]


@dataclass(frozen=True)
class Objective:
    metric: str
    direction: Direction = "min"

    def better_or_equal(self, a: float, b: float) -> bool:
        return a <= b if self.direction == "min" else a >= b

    def sort_key(self, value: float) -> float:
        """Ascending order of this key is best-first."""
        return value if self.direction == "min" else -value


@dataclass(frozen=True)
class ParetoFront:
    """The result: which points are on the front, which are dominated, which stand apart."""

    objectives: tuple[Objective, ...]
    front: tuple[ReportPoint, ...]  # best-first by the first objective, then the next ones
    dominated: tuple[ReportPoint, ...]  # eligible, with values, but beaten by a front point
    apart: tuple[ReportPoint, ...]  # not eligible (trial not COMPLETE or SLO broken) or a value missing

    def values(self, point: ReportPoint) -> tuple[float | None, ...]:
        return tuple(point.value(o.metric) for o in self.objectives)

    def drawable(self, points: Sequence[ReportPoint]) -> list[ReportPoint]:
        """The points that have a value for every objective (the ones a plot can place)."""
        return [p for p in points if None not in self.values(p)]


def dominates(a: Sequence[float], b: Sequence[float], objectives: Sequence[Objective]) -> bool:
    """``a`` dominates ``b``: no worse on every objective, strictly better on at least one."""
    no_worse = all(o.better_or_equal(x, y) for o, x, y in zip(objectives, a, b, strict=True))
    return no_worse and any(x != y for x, y in zip(a, b, strict=True))


def pareto_front(points: Sequence[ReportPoint], objectives: Sequence[Objective]) -> ParetoFront:
    """Split ``points`` into front / dominated / apart for the given objectives."""
    objectives = tuple(objectives)
    if not objectives:
        raise ValueError("pareto_front needs at least one objective")
    candidates: list[tuple[ReportPoint, tuple[float, ...]]] = []
    apart: list[ReportPoint] = []
    for point in points:
        values = tuple(v for o in objectives if (v := point.value(o.metric)) is not None)
        if point.eligible and len(values) == len(objectives):
            candidates.append((point, values))
        else:
            apart.append(point)
    front: list[tuple[ReportPoint, tuple[float, ...]]] = []
    dominated: list[tuple[ReportPoint, tuple[float, ...]]] = []
    for point, values in candidates:
        beaten = any(dominates(other, values, objectives) for _, other in candidates)
        (dominated if beaten else front).append((point, values))

    def order(item: tuple[ReportPoint, tuple[float, ...]]) -> tuple:
        point, values = item
        return (*(o.sort_key(v) for o, v in zip(objectives, values, strict=True)), point.trial_id, point.level_index)

    return ParetoFront(
        objectives=objectives,
        front=tuple(p for p, _ in sorted(front, key=order)),
        dominated=tuple(p for p, _ in sorted(dominated, key=order)),
        apart=tuple(apart),
    )


@dataclass(frozen=True)
class FrontSpec:
    """A named front: ``objectives[0]`` is the vertical axis and the table's order, ``[1]`` the horizontal."""

    name: str  # file-name friendly: cost-vs-ttft
    title: str
    objectives: tuple[Objective, ...]

    @property
    def y(self) -> Objective:
        return self.objectives[0]

    @property
    def x(self) -> Objective:
        return self.objectives[1] if len(self.objectives) > 1 else self.objectives[0]


COST = Objective(COST_METRIC, "min")

#: The fronts every report draws. The first one's table is what ``export --pick N`` indexes.
FRONTS: tuple[FrontSpec, ...] = (
    FrontSpec("cost-vs-ttft", "Cost vs P99 time to first token", (COST, Objective(TTFT_P99))),
    FrontSpec("cost-vs-tpot", "Cost vs P99 time per output token", (COST, Objective(TPOT_P99))),
    FrontSpec("cost-vs-e2el", "Cost vs P99 end-to-end latency", (COST, Objective(E2EL_P99))),
    FrontSpec(
        "throughput-vs-interactivity",
        "Output tokens/s per device vs tokens/s per user",
        (Objective(OUTPUT_THROUGHPUT_PER_DEVICE, "max"), Objective(OUTPUT_THROUGHPUT_PER_USER, "max")),
    ),
)


#: Drawn when some point has an energy (telemetry.py: a GPU's NVML, the CPU stand-in's RAPL where readable).
ENERGY_FRONT = FrontSpec(
    "energy-vs-e2el",
    "Energy per output token vs P99 end-to-end latency",
    (Objective(ENERGY_PER_TOKEN), Objective(E2EL_P99)),
)


def study_front(objectives: Sequence[tuple[str, Direction]]) -> FrontSpec | None:
    """A front for the study's own objectives when they differ from every standard front."""
    if len(objectives) < 2:
        return None
    wanted = tuple(Objective(metric, direction) for metric, direction in objectives)
    if any(set(spec.objectives) == set(wanted) for spec in (*FRONTS, ENERGY_FRONT)):
        return None
    title = "Study objectives: " + " vs ".join(f"{o.metric} ({o.direction})" for o in wanted)
    return FrontSpec("study-objectives", title, wanted)
