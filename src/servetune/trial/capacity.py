"""The capacity search: the ladder's generator taught to bisect toward the highest load meeting the SLO.

It has the ladder's protocol (yield a level, be sent its result, return why it stopped early) and
runs the ladder first (trial/ladder.py, unchanged). Then, on the same engine and within a budget
of ``capacity_levels`` more levels, it goes on from what the ladder measured, in the ladder's kind
(whole clients for a closed loop, a rate to three significant figures for an open one):

- **bracketed** (a load met the SLO below the lowest that broke it): bisect between the two, at
  their geometric mean (the tolerance is relative), until ``hi / lo - 1 <= tolerance`` or no
  distinct load is left between them;
- **every load met the SLO**: double the highest until one breaks it, then bisect. A closed loop
  whose output throughput stopped growing (the ladder's saturation rule) climbs no further: more
  clients would only queue, and the capacity is a lower bound there (``capacity >= load``);
- **the lowest load broke it**: halve it (never below one client) until one meets it, then bisect;
- **the budget runs out** first: what is known is recorded, a lower bound (none broke it) or an
  upper bound (none met it) where one end is missing.

An open loop that fell behind its rate (ladder.py ``fell_behind``) counts as breaking the SLO: the
engine cannot sustain that rate, whatever a level of it measured before the queue told.

**Verdicts near the bound.** A level's SLO margin is how far its worst metric stands from its
bound, relative (``value / bound - 1`` over the SLO's bounds; below 0 inside it). Its noise is how
much a repeat could differ (results.py ``noise_margin``: the spread of its ``load.repeats``, 10%
when run once). A repeat costs a level of the budget, so the search measures a load again only
where the repeat could move the bracket:

- a level already the majority of ``MAJORITY_RUNS`` (3) or more runs (``load.repeats``) is decided
  by them, whatever its margin: a repeat would run the same load as many times again, and its
  verdict is the majority-of-repeats rule's already. Its margin and noise are still recorded;
- a level run once (or twice) whose margin is within the noise is *unsettled*. Where it decides the
  bracket (its lowest breaking end, where unsettled loads are put until settled) and *met* the
  SLO, it is measured once more, as an extra level, before the search goes on: both met it, it
  meets it and the bracket's lower end moves up to it. One that *broke* the SLO within the noise is
  not measured again: a second break would confirm it and a split counts as breaking, so either way
  the bracket would stay where it is; it counts as breaking and is listed as unsettled. A repeat is
  also never needed where the bracket is already within ``tolerance``;
- split measurements, or an unsettled load the budget cannot measure again, count as breaking the
  SLO: the capacity is a load known to meet it, so an unsettled verdict can only narrow the
  bracket from above. Such loads are listed in ``Capacity.unsettled``; how far each end of the
  bracket stood from the SLO is ``Capacity.slo_margins``, and their noise ``Capacity.verdict_noise``.
- a level that broke the SLO beyond the noise by a margin the load client's longest stall accounts for
  (``LevelResult.client_stalled``, results.py ``stall_unsettled``: within the noise once the stall is taken off its
  latencies; the client's process not running on a host short of cores reads as a slow server) is unsettled as
  one within the noise is: it counts as breaking the SLO, is listed in ``Capacity.unsettled`` and is not measured
  again (a break could only be confirmed or split). The same level without the stall is a settled failure;
- a level where the load client fell behind (``LevelResult.client_bound``, load/pace.py) is unsettled
  whatever its margin, and is not measured again (the same client would fall behind again): it
  counts as breaking the SLO for the bracket and is listed in ``Capacity.unsettled``.

**The knee** (results.py ``find_knee``: the lowest load past which output throughput grows by less than
``knee_fraction`` of proportional growth), with what is left of the same budget once the capacity is
settled (given a ``knee_fraction``): where the loads measured bracket it below the capacity (the knee
then sets the operating point, headroom x min(capacity, knee)), the search bisects its bracket the same
way, at the geometric mean of its two loads, until it is within ``tolerance``, no load is left between
them, or the step to the middle is too narrow for the throughput noise: a step from x1 to x2 moves the
gain by ``(n1 + n2) / (x2 / x1 - 1)`` at throughput noise n (results.py ``slope_noise``, measured in
bench/knee_noise.py), and where that reaches min(fraction, 1 - fraction) it cannot tell a gain of the
fraction from flat, so the knee stays at the bracket it has. The knee is then read again from every level measured, so a level that shows throughput still
growing moves it up, one that shows it flat moves its bracket down. A knee at or above the capacity, or
one the loads do not bracket (throughput still grew at the top), is not searched: the capacity sets the
operating point there. Capacity first: a knee level that unsettles the capacity's bracket (it broke the
SLO below the load that met it) sends the search back to the capacity. :attr:`CapacitySearch.knee` holds
it, with its bracket, the levels it took and why its search ended.

The study's stop rule (early stopping by dominance) and a level with no completed request end the
search as they end the ladder; the capacity then records what was measured. With
``capacity_levels`` 0 this is the ladder alone: the same levels, the same return, no capacity.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from servetune.config.slo import Slo, SloBound
from servetune.load.runner import Level
from servetune.results import Capacity, Knee, LevelResult, find_knee, noise_margin, slope_noise, throughput_noise
from servetune.trial.ladder import busy_throughput, fell_behind, ladder

#: Asked before each further level with the last level's result and the loads the trial may still
#: measure (the rest of the ladder and what the search could add): a reason to stop, or None.
SearchStopRule = Callable[[LevelResult, Sequence[Level]], str | None]

#: Default budget and tolerance (``load.capacity_levels``, ``load.capacity_tolerance``).
CAPACITY_LEVELS = 4
CAPACITY_TOLERANCE = 0.10
#: A level of at least this many runs is decided by their majority (trial/measure.py ``median_run``), not repeated.
MAJORITY_RUNS = 3


def slo_margin(result: LevelResult, slo: Slo) -> float:
    """How far the level's worst SLO metric stands from its bound, relative: ``value / bound - 1``
    for the bound it comes nearest to breaking or breaks most (a metric not measured is infinitely
    over); below 0 inside the SLO, -inf with no bounds."""
    flat = result.summary.flat()
    return max((_slack(flat, bound) for bound in slo.bounds), default=-math.inf)


def worst_bound(result: LevelResult, slo: Slo) -> SloBound | None:
    """The bound the level comes nearest to breaking or breaks most (the first, among equals)."""
    flat = result.summary.flat()
    return max(slo.bounds, key=lambda bound: _slack(flat, bound), default=None)


def _slack(flat: dict[str, float], bound: SloBound) -> float:
    value = flat.get(bound.name)
    return math.inf if value is None else bound.slack(value)


@dataclass(frozen=True)
class Verdict:
    """One measurement of a load against the SLO."""

    meets: bool  # met the SLO (and, for an open loop, kept up with its rate)
    settled: bool  # margin beyond its noise, a majority of MAJORITY_RUNS runs, or an outright failure
    margin: float  # slo_margin
    noise: float  # noise_margin
    client_bound: bool = False  # the client fell behind (load/pace.py): unsettled, and a repeat would not settle it
    client_stalled: bool = False  # broke the SLO by a margin the client's longest stall accounts for: unsettled


def verdict(level: Level, result: LevelResult, slo: Slo) -> Verdict:
    noise = noise_margin(result)
    margin = slo_margin(result, slo)
    if result.summary.completed == 0:
        return Verdict(meets=False, settled=True, margin=margin, noise=noise)
    # An open loop that fell behind its rate broke it, unless the client was what fell behind.
    if result.client_bound is None and level.kind == "rate" and fell_behind(level, result):
        return Verdict(meets=False, settled=True, margin=margin, noise=noise)
    if result.client_bound is not None:
        return Verdict(meets=result.meets_slo, settled=False, margin=margin, noise=noise, client_bound=True)
    if result.client_stalled is not None:  # the client's stall accounts for the miss: unsettled, as within the noise
        return Verdict(meets=False, settled=False, margin=margin, noise=noise, client_stalled=True)
    majority = len(result.runs) >= MAJORITY_RUNS  # decided by its runs' majority: a repeat would be more of the same
    return Verdict(meets=result.meets_slo, settled=majority or abs(margin) > noise, margin=margin, noise=noise)


@dataclass
class Point:
    """One load the trial measured, with each measurement of it (one that met the SLO within the noise, twice)."""

    level: Level
    verdicts: list[Verdict] = field(default_factory=list)
    results: list[LevelResult] = field(default_factory=list)

    @property
    def value(self) -> float:
        return self.level.value

    @property
    def within_noise(self) -> bool:
        """Measured once, its verdict within the noise (or its client fell behind, or stalled through its miss)."""
        return len(self.verdicts) == 1 and not self.verdicts[0].settled

    @property
    def pending(self) -> bool:
        """Met the SLO once, within the noise: a repeat that met it too would make it a load meeting the SLO.
        (A break within the noise is not: a repeat could only confirm it or split, both counted as breaking.)"""
        first = self.verdicts[0]
        return self.within_noise and first.meets and not first.client_bound

    @property
    def unsettled(self) -> bool:
        """Within the noise once, split between measurements, or measured by a client that fell behind."""
        split = len({v.meets for v in self.verdicts}) > 1
        return self.within_noise or split or any(v.client_bound for v in self.verdicts)

    @property
    def meets(self) -> bool:
        """Counts as meeting the SLO for the bracket: every measurement did, and it is not unsettled."""
        return all(v.meets for v in self.verdicts) and not self.unsettled

    @property
    def throughput(self) -> float:
        """Mean output tok/s with every client busy (ladder.py ``busy_throughput``) over its measurements."""
        return sum(busy_throughput(r) for r in self.results) / len(self.results)


def _margin(point: Point | None) -> float | None:
    """The SLO margin of a point's worst measurement (None: no point, or no finite margin)."""
    if point is None:
        return None
    worst = max(v.margin for v in point.verdicts)
    return worst if math.isfinite(worst) else None


class CapacitySearch:
    """The ladder, then the search (see the module docstring). :meth:`steps` is the generator a trial
    drives; once it has ended, :attr:`capacity` holds what it found (None with a budget of 0), and
    :attr:`knee` the knee (None with a budget of 0 or no ``knee_fraction``: no knee search)."""

    def __init__(self, levels: Sequence[Level], slo: Slo, *, tolerance: float = CAPACITY_TOLERANCE,
                 budget: int = CAPACITY_LEVELS, stop_on_slo_break: bool = True, min_gain: float = 0.0,
                 stop_rule: SearchStopRule | None = None, knee_fraction: float | None = None) -> None:  # fmt: skip
        if not levels:
            raise ValueError("a capacity search needs a ladder of at least one level")
        self.levels, self.slo = tuple(levels), slo
        self.tolerance, self.budget = tolerance, budget
        self.stop_on_slo_break, self.min_gain, self.stop_rule = stop_on_slo_break, min_gain, stop_rule
        self.kind = self.levels[0].kind
        self.points: dict[float, Point] = {}
        self.measured = 0  # levels measured, the ladder's and the search's
        self.extra = 0  # levels measured beyond the ladder, the capacity's and the knee's
        self.knee_fraction = knee_fraction
        self.knee_levels = 0  # of those, the levels measured to bisect the knee
        self.capacity: Capacity | None = None
        self.knee: Knee | None = None
        self._knee_why: str | None = None  # why the knee was not searched (further)
        self._ruled: str | None = None  # the stop rule's reason, when it ended the ladder

    def steps(self) -> Generator[Level, LevelResult, str | None]:
        """Yield levels; ``send`` each level's result. Returns why the ladder or the search stopped early."""
        climbing = ladder(self.levels, stop_on_slo_break=self.stop_on_slo_break, min_gain=self.min_gain,
                          stop_rule=self._ladder_rule if self.stop_rule is not None else None)  # fmt: skip
        level = next(climbing)
        while True:
            result = yield level
            self._add(level, result)
            try:
                level = climbing.send(result)
            except StopIteration as stop:
                ladder_reason: str | None = stop.value
                break
        if self.budget == 0:
            return ladder_reason
        if self._ruled is not None:
            return self._end(self._ruled, self._ruled)
        while True:
            if result.summary.completed == 0:
                reason = f"no request completed at {level}"
                return self._end(reason, reason)
            following, why = self._next()
            settled = why  # why the capacity needs no further level (when ``following`` is None)
            for_knee = following is None
            if for_knee:
                following, self._knee_why = self._knee_next()
            if following is None:
                return self._end(settled, ladder_reason)
            if self.extra >= self.budget:
                spent = f"the budget of {self.budget} extra levels is spent"
                if for_knee:
                    self._knee_why = spent
                return self._end(settled if for_knee else spent, ladder_reason)
            ruled = self.stop_rule(result, self._ahead(following)) if self.stop_rule is not None else None
            if ruled:
                if for_knee:
                    self._knee_why = ruled
                return self._end(settled if for_knee else ruled, ruled)
            level = following
            result = yield level
            self.extra += 1
            self.knee_levels += for_knee
            self._add(level, result)

    def _ladder_rule(self, result: LevelResult) -> str | None:
        """The stop rule as the ladder asks it: with the rest of the ladder and the climb beyond its top."""
        assert self.stop_rule is not None
        ahead = self.levels[self.measured :]
        if self.budget:
            ahead += self._doubling(max(level.value for level in self.levels), self.budget)
        self._ruled = self.stop_rule(result, ahead)
        return self._ruled

    def _add(self, level: Level, result: LevelResult) -> None:
        self.measured += 1
        point = self.points.setdefault(level.value, Point(level))
        point.verdicts.append(verdict(level, result, self.slo))
        point.results.append(result)

    def bracket(self) -> tuple[Point | None, Point | None]:
        """(the highest load meeting the SLO below the lowest breaking it, that lowest load): either may be None.

        Unsettled loads count as breaking it; a load that met it above one that broke it is not trusted.
        """
        breaking = [p for p in self.points.values() if not p.meets]
        hi = min(breaking, key=lambda p: p.value, default=None)
        meeting = [p for p in self.points.values() if p.meets and (hi is None or p.value < hi.value)]
        return max(meeting, key=lambda p: p.value, default=None), hi

    def _next(self) -> tuple[Level | None, str]:
        """The next load to measure, or None with why the search is over."""
        lo, hi = self.bracket()
        if lo is not None and hi is not None and hi.value / lo.value - 1 <= self.tolerance:
            return None, f"within {self.tolerance:.0%}: between {lo.level} and {hi.level}"
        if hi is not None and hi.pending:
            return hi.level, "repeat"  # met the SLO within the noise: a second pass would move the bracket up to it
        if hi is None:
            assert lo is not None  # a point measured is either
            saturated = self._saturated(lo)
            if saturated:
                return None, saturated
            return self._level(self._rounded(2 * lo.value)), "climb"
        if lo is None:
            lower = self._rounded(hi.value / 2)
            if lower >= hi.value:
                return None, f"{hi.level} broke the SLO and no lower load is left"
            return self._level(lower), "descend"
        middle = self._between(lo.value, hi.value)
        if middle is None:
            return None, f"no load left between {lo.level} and {hi.level}"
        return self._level(middle), "bisect"

    def found_knee(self) -> Knee | None:
        """The knee of every level measured so far (results.py ``find_knee``); None without a ``knee_fraction``."""
        if self.knee_fraction is None:
            return None
        results = [r for p in sorted(self.points.values(), key=lambda p: p.value) for r in p.results]
        return find_knee(results, self.knee_fraction, self._unit())

    def _knee_next(self) -> tuple[Level | None, str]:
        """The next load to bisect the knee at, or None with why the knee is not searched (further)."""
        knee = self.found_knee()
        if knee is None:
            return None, "no knee search"
        if knee.bound == "lower":
            return None, f"throughput still grew at {self._label(knee.value)}: the knee lies beyond the loads measured"
        capacity, _ = self.bracket()
        if capacity is None:
            return None, "no load met the SLO: the knee sets no operating point"
        if knee.value >= capacity.value:
            return None, (f"the knee ({self._label(knee.value)}) is at or above the capacity "
                          f"({capacity.level}): the capacity sets the operating point")  # fmt: skip
        lo, hi = knee.bracket
        assert hi is not None  # an exact knee has both ends
        if hi / lo - 1 <= self.tolerance:
            return None, f"within {self.tolerance:.0%}: between {self._label(lo)} and {self._label(hi)}"
        middle = self._between(lo, hi)
        if middle is None:
            return None, f"no load left between {self._label(lo)} and {self._label(hi)}"
        noise = max(throughput_noise(r) for r in self.points[lo].results)
        blur = slope_noise(middle / lo, 1.0, noise, noise)
        if blur >= min(self.knee_fraction or 0.0, 1 - (self.knee_fraction or 0.0)):
            return None, (f"within the noise: a step from {self._label(lo)} to {self._label(middle)} could not tell a "
                          f"gain of {self.knee_fraction:g} from flat (throughput noise {noise:.0%} moves its slope by "
                          f"{blur:.2f})")  # fmt: skip
        return self._level(middle), "knee"

    def _label(self, value: float) -> str:
        return str(self._level(value))

    def _saturated(self, top: Point) -> str | None:
        """Why a closed loop climbs no further from ``top`` (ladder.py's rule: output throughput with
        every client busy grew less than ``min_gain`` over the best below), None to go on."""
        if self.kind != "concurrency":
            return None  # an open loop that falls behind breaks the SLO instead (see verdict)
        below = [p.throughput for p in self.points.values() if p.value < top.value]
        best = max(below, default=0.0)
        throughput = top.throughput
        if best > 0 and throughput < best * (1 + self.min_gain):
            return (f"saturated at {top.level}: output throughput {throughput:.1f} tok/s, best below "
                    f"{best:.1f} (less than {self.min_gain:.0%} more)")  # fmt: skip
        return None

    def _rounded(self, value: float) -> float:
        """A load as the ladder's kind takes it: whole clients (at least one), or three significant figures."""
        if self.kind == "concurrency":
            return float(max(1, math.floor(value)))
        return float(f"{value:.3g}")

    def _between(self, lo: float, hi: float) -> float | None:
        """A load strictly between ``lo`` and ``hi``, near their geometric mean (None: none left)."""
        middle = math.sqrt(lo * hi)
        if self.kind == "concurrency":
            candidate = float(min(max(round(middle), math.floor(lo) + 1), math.ceil(hi) - 1))
        else:
            candidate = self._rounded(middle)
        return candidate if lo < candidate < hi else None

    def _level(self, value: float) -> Level:
        return dataclasses.replace(self.levels[-1], value=value)

    def _doubling(self, top: float, count: int) -> tuple[Level, ...]:
        return tuple(self._level(self._rounded(top * 2**k)) for k in range(1, count + 1))

    def _ahead(self, following: Level) -> tuple[Level, ...]:
        """What the trial may still measure from ``following`` on: the climb's doublings within the
        budget left, else loads below the bracket's breaking end (that end, as an optimistic cap)."""
        left = self.budget - self.extra
        _, hi = self.bracket()
        if hi is None:
            return (following, *self._doubling(following.value, left - 1))
        return (following, hi.level) if hi.value > following.value else (following,)

    def _end(self, why: str, reason: str | None) -> str | None:
        """Record the capacity found (``why`` its search ended) and the knee, and return ``reason``."""
        self.capacity = self.found(why)
        knee = self.found_knee()
        if knee is not None:
            ended = self._knee_why or f"not searched: the capacity's search ended first ({why})"
            self.knee = knee.model_copy(update={"extra_levels": self.knee_levels, "tolerance": self.tolerance,
                                                "ended": ended})  # fmt: skip
        return reason

    def found(self, why: str | None = None) -> Capacity:
        """What the levels measured so far say of the capacity."""
        lo, hi = self.bracket()
        ends = [p for p in (lo, hi) if p is not None]
        return Capacity(
            value=lo.value if lo is not None else None, unit=self._unit(),
            bracket=(lo.value if lo is not None else None, hi.value if hi is not None else None),
            bound="exact" if lo is not None and hi is not None else ("lower" if lo is not None else "upper"),
            tolerance=self.tolerance, slo_margins=(_margin(lo), _margin(hi)),
            verdict_noise=max((v.noise for p in ends for v in p.verdicts), default=None),
            breaking_slo=self._breaking_slo(hi), extra_levels=self.extra - self.knee_levels,
            unsettled=sorted(p.value for p in self.points.values() if p.unsettled), ended=why,
        )  # fmt: skip

    def _breaking_slo(self, hi: Point | None) -> str | None:
        """The bound the breaking end broke (or came within the noise of) furthest, in its worst
        measurement; None when it broke none (an open loop that fell behind its rate)."""
        if hi is None:
            return None
        verdict, result = max(zip(hi.verdicts, hi.results, strict=True), key=lambda pair: pair[0].margin)
        if verdict.margin <= -verdict.noise:
            return None
        bound = worst_bound(result, self.slo)
        return str(bound) if bound is not None else None

    def _unit(self) -> Literal["concurrency", "req/s", "conversations/s"]:
        if self.kind == "concurrency":
            return "concurrency"
        return "conversations/s" if self.levels[0].conversations else "req/s"
