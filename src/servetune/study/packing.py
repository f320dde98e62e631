"""How a study uses the cluster's GPUs: the order trials are proposed in, and where the time went.

Tune starts trials in the order they are proposed, each once all of its GPUs are free on one
node (a single placement-group bundle: gang scheduling). Ray may start a later, smaller trial in
a gap while a larger one waits, but only among the ``max_concurrent`` trials already proposed.
So the order decides how well trials of 1, 2 and 4 GPUs fill the nodes:

- larger trials first: while every GPU is free, any trial fits; small ones left for later can
  fill the gaps larger ones leave, never the other way round, and the study ends on short,
  small trials instead of one big trial running beside idle GPUs;
- proposed as bins that fill a node (first-fit decreasing): where sizes do not divide the node
  (3 + 3 + 2 on 8 GPUs), the trial that fills the gap is already among those proposed. Where
  they do (1, 2, 4 on 8), this is the plain largest-first order.

Everything here is pure: it reads points and results, never Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from servetune.results import TrialResult

Point = TypeVar("Point")


def order_for_packing(points: Sequence[Point], devices_of: Callable[[Point], int], devices_per_node: int | None = None) -> list[Point]:
    """The points in the order that keeps GPUs busy: node-filling bins, largest trials first.

    First-fit decreasing into bins of ``devices_per_node`` (default: the largest trial), then
    the bins one after the other. Stable: points of one size keep their order (the grid's).
    """
    sizes = [max(int(devices_of(p)), 1) for p in points]
    capacity = max([devices_per_node or 0, *sizes], default=0)
    bins: list[list[int]] = []  # indices into points
    room: list[int] = []
    for index in sorted(range(len(points)), key=lambda i: -sizes[i]):  # sorted() is stable
        for b, free in enumerate(room):
            if sizes[index] <= free:
                bins[b].append(index)
                room[b] -= sizes[index]
                break
        else:
            bins.append([index])
            room.append(capacity - sizes[index])
    return [points[i] for b in bins for i in b]


def trials_to_fill(capacity: int, sizes: Iterable[int]) -> int:
    """A ``max_concurrent`` that lets the smallest trials fill every GPU, plus one waiting.

    The waiting one already holds a resource request, so it starts the moment GPUs free up
    instead of after Tune has proposed it.
    """
    smallest = min((max(int(s), 1) for s in sizes), default=1)
    return max(capacity // smallest, 1) + 1


@dataclass(frozen=True)
class Reservation:
    """GPUs held by one trial from ``start`` to ``end`` (seconds, one clock for all)."""

    start: float
    end: float
    devices: int
    label: str = ""


def utilization(reservations: Sequence[Reservation], capacity: int) -> float:
    """GPU-seconds reserved by running trials over GPU-seconds available, first start to last end."""
    if not reservations or capacity <= 0:
        return 0.0
    span = max(r.end for r in reservations) - min(r.start for r in reservations)
    if span <= 0:
        return 0.0
    return sum(r.devices * (r.end - r.start) for r in reservations) / (capacity * span)


def peak_devices(reservations: Iterable[Reservation]) -> int:
    """The most devices held at any instant (a trial ending at t does not overlap one starting at t)."""
    events = sorted([(r.start, 1, r.devices) for r in reservations] + [(r.end, 0, -r.devices) for r in reservations])
    held = peak = 0
    for _, _, change in events:  # at equal times, ends (0) sort before starts (1)
        held += change
        peak = max(peak, held)
    return peak


def overlapping(reservations: Sequence[Reservation]) -> list[tuple[Reservation, Reservation]]:
    """Every pair of reservations that ran at the same time."""
    ordered = sorted(reservations, key=lambda r: r.start)
    pairs = []
    for i, first in enumerate(ordered):
        for second in ordered[i + 1 :]:
            if second.start >= first.end:
                break
            pairs.append((first, second))
    return pairs


def time_accounting(results: Iterable[TrialResult]) -> dict[str, Any]:
    """Where the device time reserved by trials went: measuring, against starting engines and the rest.

    Device-seconds (GPU-seconds; core-seconds on the CPU stand-in) are a trial's duration times
    its devices. ``measuring`` is the measured part of every load level; ``starting`` is engine
    startup (process start to healthy); ``other`` is the rest: capacity check, tokenizer
    loading, warm-up requests, failed starts and teardown. Shares are of the total (0 when
    nothing ran).
    """
    total = measuring = starting = 0.0
    startups: list[float] = []
    trials = 0
    for result in results:
        trials += 1
        duration = result.duration_s or 0.0
        measured = sum(level.summary.duration_s for level in result.levels)
        startup = result.startup_s or 0.0
        if result.startup_s is not None:
            startups.append(result.startup_s)
        total += duration * result.devices
        measuring += min(measured, duration) * result.devices
        starting += min(startup, max(duration - measured, 0.0)) * result.devices
    other = max(total - measuring - starting, 0.0)

    def share(x: float) -> float:
        return x / total if total > 0 else 0.0

    return {
        "trials": trials,
        "device_seconds": total,
        "measuring_device_seconds": measuring,
        "starting_device_seconds": starting,
        "other_device_seconds": other,
        "measuring_share": share(measuring),
        "starting_share": share(starting),
        "other_share": share(other),
        "engine_starts": len(startups),
        "startup_s_mean": sum(startups) / len(startups) if startups else None,
        "startup_s_max": max(startups, default=None),
    }  # fmt: skip
