"""How much load a configuration carries: the memory ledger's prediction (:class:`CapacityReport`), the capacity
search's bracket at the SLO (:class:`Capacity`), where throughput stops growing (:class:`Knee`), and why the
estimate ruled a trial out before it ran (:class:`Pruned`)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel

from servetune.results.levels import RECORD, LevelResult, level_load, level_throughput, throughput_noise


class PrunedLevel(BaseModel):
    """One ladder level of a pruned trial: the estimate there, its optimistic end, and the SLO bound it missed."""

    model_config = RECORD

    level: dict[str, float]  # {"concurrency": 8} or {"rate": 2.0}
    ttft_ms: float | None  # the estimate (mean); None: a queue without bound
    tpot_ms: float
    output_throughput: float
    optimistic: dict[str, float]  # metric -> the estimate widened by its error toward the trial's favour
    missed: str | None = None  # the SLO bound even the optimistic estimate breaks, "ttft_ms_p99 <= 2000: 2,510 ms"


class Pruned(BaseModel):
    """Why the study skipped a trial (study/prune.py): the estimate, the error margin it was widened by, and the SLO
    bound it missed at every level (``rule`` "slo") or the finished trial that dominates it (``rule`` "dominated")."""

    model_config = RECORD

    rule: Literal["slo", "dominated"]
    error_margin: dict[str, float]  # metric -> the relative error the estimate was widened by
    error_source: str  # where the margin came from: the shipped fit's held-out error, or the study's own
    factors: str  # the factors the estimate was made with: "shipped" or "refit"
    levels: list[PrunedLevel]
    dominated_by: str | None = None  # the trial whose measured point dominates it
    dominating: dict[str, float] = {}  # that point's cost_per_mtok_usd and ttft_ms_p99
    optimistic_point: dict[str, float] = {}  # this trial's best case over its levels: cost, TTFT (mean)


class CapacityReport(BaseModel):
    """What the capacity planner predicted for a trial (before any launch).

    ``planned`` False: the ledger cannot size this configuration (``reason`` says why, "not planned: ...");
    the trial starts anyway (``fits`` True) and its ``kv_capacity`` holds vLLM's own numbers."""

    model_config = RECORD

    fits: bool
    reason: str
    planned: bool = True
    kv_cache_tokens: int | None = None
    kv_cache_gib: float | None = None
    max_concurrency: float | None = None
    advice: list[str] = []
    profile: str | None = None  # the vLLM memory profile planned with (capacity/profile.py); None before it was kept


class Capacity(BaseModel):
    """The load a configuration carries while meeting its SLO, as the capacity search found it on
    the trial's engine (trial/capacity.py). Not the memory ledger's prediction (:class:`CapacityReport`).

    ``bracket`` is [the highest load that met the SLO, the lowest that broke it] among those measured;
    ``value`` is its first end. ``bound`` says which ends are known: "exact" (both: the capacity lies
    between them, within ``tolerance`` unless the budget or ``ended`` says otherwise), "lower" (no load
    measured broke the SLO: capacity >= value), "upper" (none met it: capacity < the second end).
    """

    model_config = RECORD

    value: float | None  # the highest load known to meet the SLO; None when none did
    unit: Literal["concurrency", "req/s", "conversations/s"]
    bracket: tuple[float | None, float | None]  # [meets the SLO, breaks it]
    bound: Literal["exact", "lower", "upper"]
    tolerance: float  # the search stops once bracket[1] / bracket[0] - 1 is at most this
    # How far each end of the bracket stood from the SLO: ``value / bound - 1`` of its worst metric in its
    # worst measurement (below 0 inside the SLO; None for an end not measured or with no finite margin).
    slo_margins: tuple[float | None, float | None] = (None, None)
    # How much a repeat of the bracket's ends could differ (results.noise_margin, the largest of theirs):
    # a verdict whose SLO margin is within it is unsettled (trial/capacity.py).
    verdict_noise: float | None = None
    # The SLO bound the breaking end came nearest to or went furthest over, as ``str(SloBound)``
    # ("ttft_ms_p99 <= 2000"); None when it broke none (an open loop that fell behind its rate).
    breaking_slo: str | None = None
    extra_levels: int = 0  # levels measured beyond the ladder (repeats included)
    unsettled: list[float] = []  # loads whose verdict stayed within the noise, counted as breaking the SLO
    ended: str | None = None  # why the search ended, in words


#: The knee's rule: throughput gains per load increase below this share of proportional growth.
KNEE_FRACTION = 0.5


class Knee(BaseModel):
    """Where throughput stops growing with load, from the levels a trial measured (the ladder and the capacity
    search: :func:`find_knee`): ``bracket`` is [the knee, the next load measured above it]. The capacity search
    (trial/capacity.py) bisects that bracket with what is left of its budget where the knee lies below the
    capacity; ``extra_levels`` is what that took and ``ended`` why it stopped (both 0/None for a knee read
    from levels alone, as in results before it).

    ``value`` is the lowest load past which output throughput grew by less than ``fraction`` of proportional
    growth (``(t2 / t1 - 1) / (x2 / x1 - 1) < fraction`` between consecutive loads x1 < x2); ``bound`` is
    "exact" there, and "lower" when throughput kept growing up to the highest load measured (the knee lies at
    or beyond it: ``bracket`` [that load, None]).
    """

    model_config = RECORD

    value: float
    unit: Literal["concurrency", "req/s", "conversations/s"]
    bracket: tuple[float, float | None]
    bound: Literal["exact", "lower"]
    throughput: float  # output tok/s measured at ``value`` (with every client busy, for a closed loop)
    fraction: float = KNEE_FRACTION
    # How far a repeat could move the throughput gain of the step that decided the knee (``value`` to ``bracket[1]``):
    # :func:`slope_noise` of the two loads' throughput noise; the decision is within the noise when the gain lies
    # within it of ``fraction`` (None: a lower bound, no step decided it).
    slope_noise: float | None = None
    gain: float | None = None  # that step's gain, ``(t2 / t1 - 1) / (x2 / x1 - 1)``
    extra_levels: int = 0  # levels the capacity search measured to bisect the knee (within its budget)
    tolerance: float | None = None  # the bisection stops once bracket[1] / bracket[0] - 1 is at most this
    ended: str | None = None  # why the knee's bisection ended (or was not run), in words


def slope_noise(ratio: float, throughput_ratio: float, noise_1: float, noise_2: float) -> float:
    """How far a repeat could move the throughput gain ``(t2 / t1 - 1) / (x2 / x1 - 1)`` between two loads whose
    throughput could each differ by ``noise_1``, ``noise_2`` (relative: :func:`throughput_noise`), with
    ``ratio`` = x2 / x1 and ``throughput_ratio`` = t2 / t1: ``t2 / t1 x (n1 + n2) / (x2 / x1 - 1)``. A narrow step
    magnifies it: at 10% noise each, a 4x step's gain moves by 0.07, a 1.25x step's by 0.8 (bench/knee_noise.py
    measures it on the recorded surfaces)."""
    return throughput_ratio * (noise_1 + noise_2) / (ratio - 1) if ratio > 1 else math.inf


def find_knee(
    levels: Sequence[LevelResult], fraction: float = KNEE_FRACTION,
    unit: Literal["concurrency", "req/s", "conversations/s"] | None = None,
) -> Knee | None:  # fmt: skip
    """The knee of ``levels`` (see :class:`Knee`), in ``unit`` (default: concurrency or req/s, as the levels
    were measured); a load measured more than once counts at its mean throughput. None without a level at a
    load above 0."""
    by_load: dict[float, list[float]] = {}
    noise: dict[float, float] = {}
    for level in levels:
        load = level_load(level)
        if load > 0:
            by_load.setdefault(load, []).append(level_throughput(level))
            noise[load] = max(noise.get(load, 0.0), throughput_noise(level))
    if not by_load:
        return None
    if unit is None:
        unit = "concurrency" if levels[0].summary.level.get("concurrency") else "req/s"
    points = sorted((load, sum(ts) / len(ts)) for load, ts in by_load.items())
    for (x1, t1), (x2, t2) in itertools.pairwise(points):
        gain = (t2 / t1 - 1) / (x2 / x1 - 1) if t1 > 0 else math.inf
        if gain < fraction:
            return Knee(value=x1, unit=unit, bracket=(x1, x2), bound="exact", throughput=t1, fraction=fraction,
                        slope_noise=slope_noise(x2 / x1, t2 / t1, noise[x1], noise[x2]), gain=gain)  # fmt: skip
    top, throughput = points[-1]
    return Knee(value=top, unit=unit, bracket=(top, None), bound="lower", throughput=throughput, fraction=fraction)
