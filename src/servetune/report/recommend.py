"""Which configuration to ship: the cheapest meeting every SLO, one notch back from OOM.

The tuning checklist (section 15) asks that the configuration that goes live sits at least
one safety notch back from the out-of-memory boundary. The rule, kept simple:

1. Candidates are the operating points whose trial completed and that meet every SLO, with a
   finite ``cost_per_mtok_usd``; they are taken cheapest first (ties: lower P99 TTFT).
2. A candidate's memory margin is *thin* when any of these holds:

   - **out-of-memory neighbour**: for one of ``max_num_seqs``, ``gpu_memory_utilization``,
     ``max_num_batched_tokens``, the trial with the same other parameters and the next-higher
     value of that knob failed or was infeasible for lack of memory (its reason or log says
     so: "out of memory", "does not fit", ...);
   - **KV cache nearly full**: the level's peak KV-cache usage (``kv_cache_usage_max``) is
     at least 90 %;
   - **preemptions**: the server preempted requests during the level.

3. The recommendation is the first candidate without a thin margin. When that is not the
   cheapest one, the report says which cheaper points were passed over and why. When every
   candidate is thin, the cheapest is recommended with its warnings.
4. Tuning has to pay beyond the noise. When the study measured vLLM's defaults (the baseline
   trial, which sets no parameter) and they have a candidate without a thin margin, the tuned
   recommendation must cost less than the defaults' cheapest by more than the two levels' noise
   together: each level's cost could be off by its own (results.py ``throughput_noise``: 10%
   either side for a level run once, half the spread of the repeats' throughput with
   ``load.repeats``), so two single runs of one configuration can differ by 20%. Otherwise vLLM's
   defaults are recommended, and the reason says how close the tuned point came: a gain inside
   the noise is not one a team can count on.
5. Capacities that cannot be told apart are a tie (checked last, on the recommendation): where the trials
   searched for their capacity at the SLO, another trial whose capacity bracket overlaps the recommended one's
   (each widened by its verdict noise) and whose cost at capacity is within the two levels' noise is named as a
   tie. The choice stands; the reason says either would do, and why. A paired re-check of the two may then settle
   it (report/paired.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from servetune.config.space import GPU_PARAM
from servetune.metrics import COST_METRIC, TTFT_P99
from servetune.report.params import config_label, tuned
from servetune.report.points import (
    KV_CACHE_USAGE_MAX,
    PREEMPTIONS,
    ReportPoint,
    TrialOutline,
    first_line,
    level_label,
)

#: Engine arguments that trade memory for throughput: raising one moves toward the OOM boundary.
MEMORY_KNOBS = ("max_num_seqs", "gpu_memory_utilization", "max_num_batched_tokens")
#: Peak KV-cache usage (fraction) at or above which the margin counts as thin.
KV_USAGE_THIN = 0.9


@dataclass(frozen=True)
class PassedOver:
    point: ReportPoint
    signals: tuple[str, ...]


@dataclass(frozen=True)
class Recommendation:
    point: ReportPoint | None  # None when no point meets every SLO
    reason: str
    passed_over: tuple[PassedOver, ...] = ()  # cheaper candidates skipped for a thin margin
    warnings: tuple[str, ...] = ()  # thin-margin signals of the recommended point itself
    ties: tuple[ReportPoint, ...] = ()  # other trials' capacity points the recommendation cannot be told from (rule 5)
    next_steps: tuple[str, ...] = ()  # commands that would settle a tie no paired re-check has (report/paired.py)

    def names(self, trial_id: str) -> bool:
        """Whether this recommends the trial ``trial_id``."""
        return self.point is not None and self.point.trial_id == trial_id

    @property
    def stepped_back(self) -> bool:
        return bool(self.passed_over) and self.point is not self.passed_over[0].point


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def oom_neighbours(point: ReportPoint, trials: Sequence[TrialOutline]) -> list[tuple[str, TrialOutline]]:
    """(knob, trial) for each memory knob whose next-higher value, all else equal, ran out of memory."""
    found = []
    for knob in MEMORY_KNOBS:
        # A knob the point left to vLLM (vLLM's defaults leave all three) counts at the value vLLM resolved.
        mine = _number(point.params[knob] if knob in point.params else point.resolved_engine_args.get(knob))
        if mine is None:
            continue
        others = {k: v for k, v in point.params.items() if k != knob}
        higher: list[tuple[float, TrialOutline]] = []
        for trial in trials:
            value = _number(trial.params.get(knob))
            if value is None or value <= mine:
                continue
            if {k: v for k, v in trial.params.items() if k != knob} == others:
                higher.append((value, trial))
        if not higher:
            continue
        next_value = min(v for v, _ in higher)
        oom = [t for v, t in higher if v == next_value and t.out_of_memory]
        if oom:
            found.append((knob, oom[0]))
    return found


def margin_signals(point: ReportPoint, trials: Sequence[TrialOutline]) -> list[str]:
    """Why this point's memory margin is thin (empty when it is not)."""
    signals = []
    for knob, trial in oom_neighbours(point, trials):
        reason = first_line(trial.reason, 100) or "out of memory"
        signals.append(f"the next-higher {knob} ({trial.params[knob]}, trial {trial.trial_id}) failed: {reason}")
    kv = point.server_metrics.get(KV_CACHE_USAGE_MAX)
    if kv is not None and kv >= KV_USAGE_THIN:
        signals.append(f"KV cache usage peaked at {kv:.0%} (>= {KV_USAGE_THIN:.0%})")
    preemptions = point.server_metrics.get(PREEMPTIONS)
    if preemptions:
        signals.append(f"the server preempted {preemptions:g} requests")
    return signals


def candidates(points: Sequence[ReportPoint]) -> list[ReportPoint]:
    """Eligible points with a cost, cheapest first (ties: lower P99 TTFT, then trial and level)."""
    usable = [p for p in points if p.eligible and p.value(COST_METRIC) is not None]

    def order(p: ReportPoint) -> tuple:
        ttft = p.value(TTFT_P99)
        return (p.value(COST_METRIC), float("inf") if ttft is None else ttft, p.trial_id, p.level_index)

    return sorted(usable, key=order)


def _room(point: ReportPoint) -> str:
    kv = point.server_metrics.get(KV_CACHE_USAGE_MAX)
    preemptions = point.server_metrics.get(PREEMPTIONS)
    return ", ".join([
        "no out-of-memory neighbour",
        ("KV cache peaked under 1%" if kv < 0.005 else f"KV cache peaked at {kv:.0%}") if kv is not None
        else "KV-cache peak not measured",
        "no preemptions" if preemptions is not None else "preemptions not measured",
    ])  # fmt: skip


def describe(point: ReportPoint, configuration: bool = True) -> str:
    """``trial abc (max_num_seqs=32) at concurrency 8, $0.5 per million output tokens``; without the
    configuration where the sentence has named it already."""
    cost = point.value(COST_METRIC)
    price = f"${cost:.4g} per million output tokens" if cost is not None else "cost unknown"
    named = f" ({config_label(point.params)})" if configuration else ""
    return f"trial {point.trial_id}{named} at {level_label(point.level)}, {price}"


def recommend(points: Sequence[ReportPoint], trials: Sequence[TrialOutline]) -> Recommendation:
    """Apply the rule in this module's docstring."""
    ranked = candidates(points)
    if not ranked:
        counted = f"{_plural(len(points), 'operating point')} from {_plural(len(trials), 'trial')}"
        return Recommendation(None, f"no configuration met every SLO ({counted})")
    return capacity_ties(against_defaults(cheapest_with_room(ranked, trials), ranked, trials), points)


def _widened(point: ReportPoint) -> tuple[float, float]:
    lo, hi = point.capacity_bracket or (None, None)
    noise = point.capacity_noise or 0.0
    return (lo or 0.0) * (1 - noise), (hi if hi is not None else float("inf")) * (1 + noise)


def _capacity_text(point: ReportPoint) -> str:
    lo, hi = point.capacity_bracket or (None, None)
    return f"{lo:g}" + (f" [{lo:g}, {hi:g})" if lo is not None and hi is not None else "+" if lo is not None else "")


def capacity_ties(rec: Recommendation, points: Sequence[ReportPoint]) -> Recommendation:
    """Rule 5: the trials whose capacity at the SLO, and cost there, the recommendation cannot be told from."""
    if rec.point is None:
        return rec
    mine = next((p for p in points if p.trial_id == rec.point.trial_id and p.at_capacity), None)
    if mine is None or mine.capacity_bracket is None or mine.capacity_bracket[0] is None:
        return rec
    low, high = _widened(mine)
    cost = mine.value(COST_METRIC)
    ties = []
    for other in points:
        if other.trial_id == mine.trial_id or not other.at_capacity or not other.eligible:
            continue
        if other.capacity_bracket is None or other.capacity_bracket[0] is None:
            continue
        other_low, other_high = _widened(other)
        other_cost = other.value(COST_METRIC)
        if cost is None or other_cost is None or max(low, other_low) > min(high, other_high):
            continue
        if abs(cost - other_cost) / min(cost, other_cost) <= mine.noise + other.noise:
            ties.append(other)
    if not ties:
        return rec
    named = "; ".join(f"trial {t.trial_id} ({config_label(t.params)}): capacity {_capacity_text(t)}, "
                      f"${t.value(COST_METRIC):.4g}/Mtok" for t in ties)  # fmt: skip
    why = (f"{rec.reason}. A tie within the noise: its capacity {_capacity_text(mine)} at ${cost:.4g}/Mtok cannot be "
           f"told from {named} (brackets overlap once widened by their verdict noise, costs within the levels' "
           "noise); either would do")  # fmt: skip
    return replace(rec, reason=why, ties=tuple(ties))


def against_defaults(
    rec: Recommendation, ranked: Sequence[ReportPoint], trials: Sequence[TrialOutline]
) -> Recommendation:
    """Rule 4: a tuned recommendation stands only when it is cheaper than vLLM's defaults beyond the noise."""
    point = rec.point
    if point is None or not tuned(point.params):
        return rec
    gpu = point.params.get(GPU_PARAM)  # GPU types compared: vLLM's defaults on the same type
    defaults = next(
        (p for p in ranked if not tuned(p.params) and p.params.get(GPU_PARAM) == gpu and not margin_signals(p, trials)),
        None,
    )
    cost = point.value(COST_METRIC)
    base_cost = defaults.value(COST_METRIC) if defaults is not None else None
    if defaults is None or cost is None or not base_cost:
        return rec
    saving, noise = 1.0 - cost / base_cost, point.noise + defaults.noise
    same = f"{point.noise:.0%}" == f"{defaults.noise:.0%}"
    each = f"±{point.noise:.0%} each" if same else f"±{point.noise:.0%} and ±{defaults.noise:.0%}"
    if saving > noise:
        return replace(rec, reason=f"{rec.reason}; {saving:.0%} cheaper than vLLM's defaults ({describe(defaults, configuration=False)}), "
                                   f"beyond the two measurements' noise ({each})")  # fmt: skip
    # (The tuned point is no dearer: the defaults would have been the cheapest with room.)
    why = (
        f"vLLM's defaults: the best tuned point, {describe(point)}, is only {saving:.0%} cheaper than the defaults, "
        f"within the two measurements' noise ({each}), so tuning gained nothing measurable here "
        f"(load.repeats measures the noise, and narrows it when it is smaller); the defaults meet every SLO with "
        f"room to spare: {_room(defaults)}"
    )
    return Recommendation(defaults, why, passed_over=rec.passed_over)


def cheapest_with_room(ranked: Sequence[ReportPoint], trials: Sequence[TrialOutline]) -> Recommendation:
    """Rules 1-3: the cheapest of the candidates (at least one) without a thin memory margin."""
    passed: list[PassedOver] = []
    for point in ranked:
        signals = margin_signals(point, trials)
        if not signals:
            break
        passed.append(PassedOver(point, tuple(signals)))
    else:
        cheapest = passed[0]
        return Recommendation(
            cheapest.point,
            "every configuration meeting the SLOs has a thin memory margin; this is the cheapest, "
            "ship it with care: " + "; ".join(cheapest.signals),
            passed_over=tuple(passed),
            warnings=cheapest.signals,
        )
    # ``point`` is now the first candidate without a thin margin.
    if not passed:
        return Recommendation(
            point, "the cheapest configuration meeting every SLO, with room to spare: " + _room(point)
        )
    first = passed[0]
    more = len(passed) - 1
    extra = f" ({_plural(more, 'more cheaper point')} passed over for a thin margin)" if more else ""
    cheap_cost, cost = first.point.value(COST_METRIC), point.value(COST_METRIC)
    delta = f" (+{(cost / cheap_cost - 1):.0%})" if cheap_cost and cost is not None else ""
    return Recommendation(
        point,
        f"stepped one notch back from the out-of-memory boundary: the cheapest point meeting every SLO, "
        f"{describe(first.point)}, has a thin margin ({'; '.join(first.signals)}){extra}; "
        f"this one costs ${cost:.4g} per million output tokens{delta}",
        passed_over=tuple(passed),
    )
