"""The load ``verify`` and ``serve-check`` run a picked configuration at: its operating point, as ``export``
derives the autoscaling from (report/autoscale.py ``operating_load``), not the ladder's level.

``headroom`` x min(capacity, knee): the capacity at the SLO the trial's search found (results.py
``Capacity``; without one, the highest level that met the SLO) and the knee where its throughput stopped
growing with load, whichever is lower. A closed loop runs whole clients, so the load is rounded down (at
least one client): a replica is run short of both, never past them. A rate keeps three significant figures.
Its request rate is interpolated between the levels measured (``interpolated_rate``), and the rate at the
capacity (what verify's overload scenario multiplies) is the one measured at the capacity's level.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from servetune.errors import UserError
from servetune.metrics import REQUEST_THROUGHPUT
from servetune.report.autoscale import interpolated_rate, operating_load
from servetune.report.build import StudyReport
from servetune.report.points import ReportPoint
from servetune.results import Capacity, Knee

#: export's default (checklist section 11: run a replica at 70-80% of what it carries).
DEFAULT_HEADROOM = 0.8


@dataclass(frozen=True)
class OperatingLoad:
    """The load to run one trial's configuration at, and what it rests on."""

    trial_id: str
    kind: str  # "concurrency" or "rate", as the study's ladder
    value: float  # headroom x min(capacity, knee), as the ladder's kind takes it
    headroom: float
    why: str  # "0.8 x the capacity at the SLO 12 (below the knee 16)"
    request_rate: float  # req/s at ``value``, interpolated between the levels measured
    capacity_rate: float  # req/s measured at the capacity (else at the highest level meeting the SLO)
    capacity: Capacity | None
    knee: Knee | None

    def level(self) -> dict[str, float]:
        return {self.kind: self.value}

    def describe(self) -> str:
        """``concurrency 9 (0.8 x the capacity at the SLO 12 ...)``, as verify and serve-check print it."""
        unit = "" if self.kind == "concurrency" else " req/s"
        return f"{self.kind} {self.value:g}{unit} ({self.why})"

    def as_dict(self) -> dict[str, Any]:
        """What verify.json and serve-check.json record of it."""
        capacity = self.capacity
        return {
            "level": self.level(), "headroom": self.headroom, "why": self.why,
            "request_rate": self.request_rate, "capacity_rate": self.capacity_rate,
            "capacity": None if capacity is None else {"value": capacity.value, "unit": capacity.unit,
                                                       "bracket": list(capacity.bracket), "bound": capacity.bound},
            "knee": None if self.knee is None else {"value": self.knee.value, "bracket": list(self.knee.bracket),
                                                    "bound": self.knee.bound},
        }  # fmt: skip


def _load(point: ReportPoint) -> tuple[str, float] | None:
    for kind in ("concurrency", "rate"):
        if point.level.get(kind):
            return kind, float(point.level[kind])
    return None


def rounded(kind: str, value: float) -> float:
    """A load as a ladder of ``kind`` takes it: whole clients, rounded down (at least one), or 3 significant figures."""
    if kind == "concurrency":
        return float(max(1, math.floor(value + 1e-9)))
    return float(f"{value:.3g}")


def operating_point(
    trial_points: Sequence[ReportPoint], capacity: Capacity | None, knee: Knee | None, headroom: float
) -> OperatingLoad:
    """The operating load of one trial (see the module docstring); UserError when it met the SLO at no level
    or ``headroom`` is not in (0, 1]."""
    trial = trial_points[0].trial_id if trial_points else "?"
    meeting = [(p, lv) for p in trial_points if p.meets_slo and (lv := _load(p)) is not None]
    if not meeting:
        raise UserError(f"trial {trial} met the SLO at no load level, so it has no operating point")
    kind = meeting[0][1][0]
    loads = [lv[1] for _, lv in meeting if lv[0] == kind]
    exact, why = operating_load(loads, capacity, knee, headroom)
    value = rounded(kind, exact)
    rates = [(lv[1], float(p.metrics.get(REQUEST_THROUGHPUT) or 0.0)) for p, lv in meeting if lv[0] == kind]
    at_capacity = next((p for p, _ in meeting if p.at_capacity), None)
    if at_capacity is not None:
        capacity_rate = float(at_capacity.metrics.get(REQUEST_THROUGHPUT) or 0.0)
    else:
        capacity_rate = max(rates)[1]
    if value != exact:
        why = f"{exact:.3g}, rounded down to whole clients: {why}" if kind == "concurrency" else why
    return OperatingLoad(trial, kind, value, headroom, why, interpolated_rate(rates, value), capacity_rate,
                         capacity, knee)  # fmt: skip


def operating_point_of(report: StudyReport, point: ReportPoint, headroom: float) -> OperatingLoad:
    """:func:`operating_point` of the trial of a picked ``point``, with the capacity and knee the report read."""
    points = [p for p in report.points if p.trial_id == point.trial_id]
    row = next((r for r in report.trial_table if r.trial_id == point.trial_id), None)
    return operating_point(points, row.capacity if row else None, row.knee if row else None, headroom)
