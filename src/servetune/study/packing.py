"""How a study uses the cluster's GPUs: the order trials are proposed in, and where the time went.

Tune proposes trials in order, at most ``max_concurrent`` at a time, and each waits until all
of its GPUs are free on one node (one placement-group bundle: gang scheduling). It is not a
FIFO queue: every proposed trial holds a placement-group request, and when GPUs free up Ray
places a request that fits, not the oldest, and small ones win (a request that keeps failing
to fit backs off). Seen with Ray 2.60 on 8 declared GPUs and 17 of 30 trials in flight: two
4-GPU trials ran first, then every 1- and 2-GPU trial, then the other ten 4-GPU trials. So:

- ``max_concurrent`` is the lever. Waiting trials count against it, and large trials that
  wait can leave no room to propose the small ones that would fill a gap. With twice as many
  in flight as the smallest trials need to fill the node, plus one
  (:func:`max_concurrent_to_fill`), Ray's backfilling does the rest, in any order.
- Where fewer are in flight, largest first (the obvious guess) is the worst order: the large
  trials wait while the small ones Ray prefers slip past, and hold places the next small ones
  would need. Smallest first goes with Ray: small trials fill the nodes while they last, and
  the large ones come last, when they fill nodes among themselves (:func:`order_for_packing`,
  which also groups sizes that do not divide a node so that each group fills one). Measured
  with bench/packing.py (15 trials of 1, 2 and 4 GPUs on 8 declared GPUs, 5 in flight): 82%
  of GPU time used largest first, 90% smallest first. In the model in
  tests/unit/test_packing.py (seven mixes of 1 to 8 GPUs per trial, 5 in flight, Ray placing
  the smallest that fits): 0.73 largest first, 0.79 in grid order, 0.88 smallest first, 0.89
  in these groups; with 17 in flight, 0.90 to 0.91 in any order.

Everything here is pure: it reads points and reservations, never Ray.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from servetune.config.space import SearchSpace

Point = TypeVar("Point")


def order_for_packing(
    points: Sequence[Point], devices_of: Callable[[Point], int], devices_per_node: int | None = None
) -> list[Point]:
    """The points smallest trials first, in groups that each fill a node.

    First-fit decreasing makes the groups (``devices_per_node`` devices each; default: the
    largest trial): the trials, largest first, each go to the first group with room. The
    groups are then proposed last to first, each smallest trial first. Where trial sizes divide
    the node (1, 2, 4 on 8) that is simply smallest first; where they do not (3-GPU trials on
    8), the trials that fill a node's gap come beside each other. Stable: points of one size
    keep their order (the grid's).
    """
    sizes = [max(int(devices_of(p)), 1) for p in points]
    capacity = max([devices_per_node or 0, *sizes], default=0)
    groups: list[list[int]] = []  # the sizes in each group
    room: list[int] = []
    for size in sorted(sizes, reverse=True):
        first = next((g for g, free in enumerate(room) if free >= size), None)
        if first is None:
            groups.append([])
            room.append(capacity)
            first = len(groups) - 1
        groups[first].append(size)
        room[first] -= size
    by_size: dict[int, list[Point]] = {}
    for point, size in zip(points, sizes, strict=True):
        by_size.setdefault(size, []).append(point)
    queues = {size: iter(same) for size, same in by_size.items()}
    return [next(queues[size]) for group in reversed(groups) for size in reversed(group)]


def max_concurrent_to_fill(capacity: int, sizes: Iterable[int]) -> int:
    """Trials in flight enough for Ray to fill every GPU: twice what the smallest trials need, plus one.

    ``capacity`` is the GPUs of the cluster (or of the node a study runs on); waiting trials
    count against ``max_concurrent``, hence the margin.
    """
    smallest = min((max(int(s), 1) for s in sizes), default=1)
    return 2 * max(capacity // smallest, 1) + 1


def resolve_max_concurrent(space: SearchSpace, cluster_devices: float | Sequence[float] | None) -> int:
    """``search.max_concurrent`` as a number: ``auto`` fills the cluster's GPUs, node by node.

    ``cluster_devices``: the GPUs of each node (a single number: one node). A trial runs inside
    one node, so what counts is how many of the smallest trials each node holds: two nodes of 3
    GPUs run two 2-GPU trials, not three. Grid and random search: twice that, plus one (trials
    waiting for GPUs count, so a margin lets Ray backfill; :func:`max_concurrent_to_fill`).
    Bayesian search: as many as the nodes run at once, no more, so each proposal still learns
    from as many results as it can. On CPU, one: trials on one host would share the cores their
    measurements run on. Trials through Serve count replicas, each inside one node (a trial's replicas spread
    over nodes); they take their devices from the study's ledger before they deploy (``device_ledger.py``).
    """
    wanted = space.search.max_concurrent
    if wanted != "auto":
        return int(wanted)
    nodes = [cluster_devices] if isinstance(cluster_devices, (int, float)) else list(cluster_devices or ())
    if space.device != "gpu" or not any(nodes):
        return 1
    if space.through_serve:  # no margin to backfill: the ledger serves trials in arrival order
        return max(max(sum(int(n) // each for n in nodes) // replicas for each, replicas in replica_shapes(space)), 1)
    smallest = max(min(trial_sizes(space)), 1)
    at_once = sum(int(n) // smallest for n in nodes)
    if space.search.algorithm in ("grid", "random"):
        return 2 * max(at_once, 1) + 1
    return max(at_once, 1)


def replica_shapes(space: SearchSpace) -> set[tuple[int, int]]:
    """(one replica's devices, replicas) of each combination of the parallel sizes and Serve replica counts the space varies."""
    return {(space.replica_devices(combo), space.serve_replicas(combo) or 1) for combo in _parallel_combos(space)}


def trial_sizes(space: SearchSpace) -> list[int]:
    """The devices each combination of the parallel sizes (and Serve replica counts) the space varies would reserve."""
    return sorted({space.devices(combo) for combo in _parallel_combos(space)})


def _parallel_combos(space: SearchSpace) -> Iterator[dict[str, Any]]:
    from servetune.config.space import ENGINE_DEFAULTS, SERVE_REPLICAS, Range

    axes = {name: values.grid_values() if isinstance(values, Range) else values
            for name, values in space.params.items() if name in ENGINE_DEFAULTS or name == SERVE_REPLICAS}  # fmt: skip
    for combo in itertools.product(*axes.values()):
        yield dict(zip(axes, combo, strict=True))


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
