"""Everything a report shows, computed once: counts, points, fronts, SLO lines, recommendation, the trials
table, and what ``servetune verify`` found."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from servetune.accounting import device_time_lines
from servetune.capacity.prices import price_table
from servetune.errors import UserError
from servetune.metrics import IMAGES_SENT
from servetune.report.asks import AskLevel, ask_levels, asks_warning
from servetune.report.conversations import ConversationTable, conversation_tables, every_conversation
from servetune.report.distribution import LevelSpread, ttft_spreads
from servetune.report.gpus import WhichGpu, which_gpu
from servetune.report.paired import settle_ties
from servetune.report.pareto import ENERGY_FRONT, FRONTS, FrontSpec, ParetoFront, pareto_front, study_front
from servetune.report.points import (
    MIXED_GOODPUT,
    AxisBound,
    ReportPoint,
    SloLine,
    TrialOutline,
    bounds_on_axis,
    first_line,
    gather_points,
    known_metrics,
    level_label,
    mixed_goodput_windows,
    outline,
    parse_slo_lines,
)
from servetune.report.quality import QualityRow, RuleCheck, precision_rule, quality_rows
from servetune.report.recommend import Recommendation, recommend
from servetune.report.serving import ServeSection, serve_section
from servetune.report.speculation import gain_lines
from servetune.report.study import LoadedStudy, NotRead
from servetune.report.trials import TrialRow, trial_rows
from servetune.report.verification import Verification, conclusion, primary, verifications
from servetune.results import OUTCOMES, StudyInfo, TrialResult, estimate_accuracy


@dataclass(frozen=True)
class Front:
    spec: FrontSpec
    result: ParetoFront


@dataclass(frozen=True)
class FailureReason:
    outcome: str
    reason: str
    trial_ids: tuple[str, ...]


@dataclass(frozen=True)
class StudyReport:
    root: Path
    info: StudyInfo
    price_override: float | None  # --price-per-gpu-hour, when given
    trials: tuple[TrialOutline, ...]
    not_read: tuple[NotRead, ...]
    points: tuple[ReportPoint, ...]
    slo: tuple[SloLine, ...]
    fronts: tuple[Front, ...]  # FRONTS in order, then the study's own objectives if different
    recommendation: Recommendation
    device_time: tuple[str, ...] = ()  # where the reserved device time went (servetune/accounting.py)
    trial_table: tuple[TrialRow, ...] = ()  # a row per trial (report/trials.py)
    quality_table: tuple[QualityRow, ...] = ()  # a row per trial that ran the quality probe (report/quality.py)
    precision_rule: tuple[RuleCheck, ...] | None = None  # section 2's rule, for a lower-precision recommendation
    verification: Verification | None = (
        None  # the recommendation's verification, or how to run verify (report/verification.py)
    )
    verifications: tuple[Verification, ...] = ()  # every verified point, in verify order, then verify.json
    verification_conclusion: str = ""  # what the verdicts mean together (several points verified)
    ttft_spreads: tuple[
        LevelSpread, ...
    ] = ()  # the recommended trial's TTFT distribution per level (report/distribution.py)
    serve_check: ServeSection | None = None  # what serve-check measured on Ray Serve (report/serving.py)
    energy: str = ""  # where the energy per token came from, or why it is missing (energy_line)
    goodput_window: str = ""  # said where the trials counted goodput over different windows (points.MIXED_GOODPUT)
    prices: tuple[str, ...] = ()  # the prices the trials were costed at, with source and date (none overridden)
    which_gpu: WhichGpu | None = None  # each GPU type's best configuration and cost (report/gpus.py)
    estimate: tuple[str, ...] = ()  # how far the estimate was from the measurements (estimate_lines)
    speculative_gain: tuple[str, ...] = ()  # each speculative trial's gain by load (report/speculation.py)
    conversations: tuple[ConversationTable, ...] = ()  # the recommended trial's multi-turn levels (conversations.py)
    every_conversation: tuple[ConversationTable, ...] = ()  # every trial's, in the trial table's order (ditto)
    asks: tuple[AskLevel, ...] = ()  # levels whose answers lacked what their requests asked (report/asks.py)

    @property
    def asks_warning(self) -> str | None:
        """The warning for a recommended trial whose engine did not do what requests asked (report/asks.py)."""
        point = self.recommendation.point
        if point is None:
            return None
        return asks_warning(self.asks, point.trial_id, level_label(point.level))

    def price_line(self) -> str:
        """What the costs are at: each price the trials were costed at, with its source and the date it was read,
        else the one price they were all costed at (``--price-per-gpu-hour``, or study.json's)."""
        if self.prices:
            return f"prices: {'; '.join(self.prices)}"
        if self.price_override is not None:
            return f"price: ${self.price_override:g} per device-hour (from --price-per-gpu-hour)"
        if self.info.price_per_device_hour is None:
            return f"prices: each GPU type's, from the {self.info.price_list} price list (study.json)"
        return f"price: ${self.info.price_per_device_hour:g} per device-hour (from study.json)"

    def outcome_counts(self) -> dict[str, int]:
        """Trials by outcome, plus ``not read`` (every trial directory is counted once)."""
        counts: Counter[str] = Counter(t.outcome for t in self.trials)
        # PRUNED only in studies that pruned (search.estimate.prune): the others read as before
        out: dict[str, int] = {o: counts.get(o, 0) for o in OUTCOMES if o != "PRUNED" or counts.get(o)}
        out["not read"] = len(self.not_read)
        return out

    def failure_reasons(self) -> list[FailureReason]:
        """Trials that did not complete, grouped by outcome and the first line of their reason."""
        groups: dict[tuple[str, str], list[str]] = {}
        for trial in self.trials:
            if trial.outcome != "COMPLETE":
                groups.setdefault((trial.outcome, first_line(trial.reason) or "(no reason given)"), []).append(
                    trial.trial_id
                )
        reasons = [FailureReason(o, r, tuple(ids)) for (o, r), ids in groups.items()]
        return sorted(reasons, key=lambda f: (-len(f.trial_ids), f.outcome, f.reason))

    @property
    def sent_images(self) -> bool:
        """Whether a level's requests carried images (a vision-language workload): the level tables then count them."""
        return any(point.value(IMAGES_SENT) for point in self.points)

    def front(self, name: str) -> Front:
        for front in self.fronts:
            if front.spec.name == name:
                return front
        raise KeyError(name)

    @property
    def main_front(self) -> Front:
        """Cost vs P99 TTFT: the table ``servetune export --pick N`` indexes."""
        return self.fronts[0]

    @property
    def model_label(self) -> str:
        """The model as a reader of the report knows it: a hub id as it is; a directory inside the study
        (the generated tiny model) relative to it; any other directory by its name, since the recording
        machine's absolute path means nothing where the report is read."""
        path = Path(self.info.model)
        if not path.is_absolute():
            return self.info.model
        root = self.root.resolve()
        if path.is_relative_to(root):
            return f"{path.relative_to(root)} (in the study directory)"
        return f"{path.name} (a local directory)"

    def slo_for(self, metric: str) -> list[SloLine]:
        return [line for line in self.slo if line.metric == metric]

    def bounds_on(self, axis_metric: str) -> list[AxisBound]:
        """Every SLO bound a plot with this axis draws: its metric's whole family (P95 and P99 TTFT)."""
        return bounds_on_axis(self.slo, axis_metric)


def build_report(
    study: LoadedStudy, price_per_device_hour: float | None = None, target_rps: float | None = None
) -> StudyReport:
    """Compute the report of a loaded study (pure: no I/O). ``target_rps``: the load the "which GPU" section
    counts replicas for."""
    if price_per_device_hour is not None and price_per_device_hour < 0:
        raise UserError(f"--price-per-gpu-hour {price_per_device_hour:g}: a price cannot be negative")
    if target_rps is not None and not (0 < target_rps < math.inf):
        raise UserError(f"--target-rps {target_rps:g}: give a positive request rate (requests per second)")
    known = known_metrics()
    for index, (metric, _) in enumerate(study.info.objectives):
        if metric not in known:
            raise UserError(f"{study.root / 'study.json'}: objectives.{index}: unknown metric '{metric}'")
    points = gather_points(study.trials, price_per_device_hour)
    outlines = [outline(t) for t in study.trials]
    specs = list(FRONTS)
    if any(p.value(ENERGY_FRONT.y.metric) is not None for p in points):
        specs.append(ENERGY_FRONT)
    extra = study_front(study.info.objectives)
    if extra is not None:
        specs.append(extra)
    fronts = tuple(Front(spec, pareto_front(points, spec.objectives)) for spec in specs)
    recommendation = recommend(points, outlines)
    if recommendation.point is not None:
        picked = next(t for t in study.trials if t.trial_id == recommendation.point.trial_id)
        recommendation = settle_ties(recommendation, points, outlines, study.paired, picked.environment.get("vllm"),
                                     str(study.root))  # fmt: skip
    verified = verifications(study.root, study.verify, study.verified)
    rec_trial = recommendation.point.trial_id if recommendation.point is not None else None
    rows = tuple(trial_rows(study.trials, points, recommendation))
    order = [row.trial_id for row in rows]  # the recommended trial first
    return StudyReport(
        root=study.root,
        info=study.info,
        price_override=price_per_device_hour,
        trials=tuple(outlines),
        not_read=study.not_read,
        points=tuple(points),
        slo=tuple(slo_lines(study)),
        fronts=fronts,
        recommendation=recommendation,
        device_time=tuple(device_time_lines(list(study.trials), study.info.device, planned_levels(study))),
        trial_table=rows,
        quality_table=tuple(quality_rows(study.trials)),
        precision_rule=_rule(recommendation.point, study.trials, points),
        verification=primary(verified, rec_trial, study.root),
        verifications=verified,
        verification_conclusion=conclusion(verified, rec_trial, study.root),
        ttft_spreads=ttft_spreads(study.trials, recommendation.point),
        conversations=conversation_tables(study.trials, recommendation.point),
        every_conversation=every_conversation(study.trials, order),
        asks=ask_levels(study.trials, order),
        serve_check=serve_section(study.serve_check),
        energy=energy_line(study.trials, points, study.info.device),
        goodput_window=MIXED_GOODPUT if mixed_goodput_windows(study.trials) else "",
        prices=() if price_per_device_hour is not None else prices_used(study.trials),
        speculative_gain=tuple(gain_lines(study.trials)),
        which_gpu=which_gpu(
            study.trials,
            points,
            outlines,
            target_rps,
            price_per_device_hour,
            prices=price_table(study.info.prices, study.info.price_list),
            price_list=study.info.price_list,
            workload=study.workload,
            workload_unread=study.workload_unread,
            refit=study.refit,
        ),
        estimate=estimate_lines(study.trials),
    )


def prices_used(trials: Sequence[TrialResult]) -> tuple[str, ...]:
    """Each price the trials were costed at, once, with its source and date (results from before schema 7 say
    none: the study's one price then stands for them)."""
    return tuple(sorted({t.price.describe() for t in trials if t.price is not None}))


def energy_line(trials: Sequence[TrialResult], points: Sequence[ReportPoint], device: str) -> str:
    """Where the points' energy per token came from, and why the levels without one have none ('' when no level
    was measured)."""
    if not points:
        return ""
    measured = sum(p.value(ENERGY_FRONT.y.metric) is not None for p in points)
    source = "the GPUs' energy counters (NVML)" if device == "gpu" else "the host's CPU packages (RAPL)"
    notes = sorted({lv.energy_note for t in trials for lv in t.levels if lv.energy_note is not None})
    line = f"energy per token measured at {measured} of {len(points)} points, from {source}, warm-up left out"
    return line + (f"; {'; '.join(notes)}" if notes else "")


ESTIMATED = {"ttft_ms": "TTFT (mean)", "tpot_ms": "TPOT (mean)", "output_throughput": "output throughput"}


def estimate_lines(trials: Sequence[TrialResult]) -> tuple[str, ...]:
    """The estimate's error over the study, per metric (median and worst |predicted / measured - 1| over the
    estimated levels), the factors it used, and why the trials without one have none; () when none was made."""
    accuracy = estimate_accuracy(list(trials))
    lines = [
        f"{ESTIMATED.get(a.metric, a.metric)}: median {a.median:.0%}, worst {a.worst:.0%} over {a.levels} levels"
        for a in accuracy
    ]
    factors = sorted({t.estimate_factors for t in trials if t.estimate_factors is not None})
    if factors:
        refit = sum(t.estimate_factors == "refit" for t in trials)
        lines.append(f"factors: {' and '.join(factors)} ({refit} trials estimated with the study's refit factors)")
    notes = sorted({t.estimate_note for t in trials if t.estimate_note is not None})
    lines += notes
    return tuple(lines)


def _rule(
    point: ReportPoint | None, trials: Sequence[TrialResult], points: Sequence[ReportPoint]
) -> tuple[RuleCheck, ...] | None:
    checks = precision_rule(point, trials, points) if point is not None else None
    return tuple(checks) if checks is not None else None


def slo_lines(study: LoadedStudy) -> list[SloLine]:
    """The study's SLO bounds as lines to draw: typed in study.json since schema 2, parsed from text before."""
    if study.info.slo_bounds:
        return [SloLine(bound.name, bound.limit, bound.lower) for bound in study.info.slo_bounds]
    return parse_slo_lines(study.info.slo, source=f"{study.root / 'study.json'}: slo")


def planned_levels(study: LoadedStudy) -> int:
    """The rungs of the study's ladder; for a study.json written before it said, the most any trial ran."""
    return len(study.info.levels) or max((len(t.levels) for t in study.trials), default=0)
