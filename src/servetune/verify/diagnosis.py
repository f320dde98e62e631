"""What limited a verification: report/diagnosis.py's rules, run on the levels verify's own scenarios measured.

verify measures each load shape as a trial measures a level (trial/measure.py ``measure_level``: vLLM's ``/metrics``
before, after and its gauges' peaks, the client's pace, the API server's CPU where verify started the engine), so
the trial's rules read them unchanged: they are given the verified trial's result (its engine arguments, device,
replicas) with verify's levels in place of its ladder. No second set of rules.

- **The run's line** (verify.json ``limited_by``): the soak (the operating level) and the peak (1.25x) as a
  two-rung ladder, judged as a trial is: at the first that broke the SLO, else the peak; the rules that read a trend
  (prefix hits lost, prefill queueing, decode slowdown) compare the soak with the peak.
- **Each scenario's line** (``scenarios.NAME.limited_by``, for :data:`DIAGNOSED`): the soak, the burst and the mix
  on their own level (no lower load: the trend rules find nothing there), the peak with the soak beneath it.

verify runs no lower load, so where a level broke the SLO and no rule matched, the line names the bounds it broke
rather than ask for one (``ladder=False``).

Not diagnosed, as not one steady load: long_output (a few requests to the output limit), disconnects (dropped
streams), headroom (reads the peak's level), repeats (the operating level again, as the soak), overload (its 503s
are the admission bound working) and the opt-in fault scenarios (replica_lost, rolling_update, canary).
"""

from __future__ import annotations

from collections.abc import Mapping

from servetune.report.diagnosis import limit_level, limited_at
from servetune.results import LevelResult, TrialResult

#: The scenarios that get a line of their own, in the order they run.
DIAGNOSED = ("soak", "peak", "burst", "mix")
#: The levels the run's line reads: the operating level, then its peak.
STEADY = ("soak", "peak")


def _measured(levels: Mapping[str, LevelResult], name: str) -> LevelResult | None:
    level = levels.get(name)
    return level if level is not None and level.summary.completed > 0 else None


def _as_trial(trial: TrialResult, levels: list[LevelResult]) -> TrialResult:
    return trial.model_copy(update={"levels": levels, "outcome": "COMPLETE"})


def scenario_line(trial: TrialResult, name: str, levels: Mapping[str, LevelResult]) -> str:
    """What limited scenario ``name`` of ``trial``'s verification (``levels``: each scenario's measured level)."""
    if name not in levels:
        return "not diagnosed: the scenario measured no level (it did not run, or stopped before its end)"
    level = _measured(levels, name)
    if level is None:
        return "not diagnosed: no request completed"
    soak = _measured(levels, "soak")
    below = [soak] if name == "peak" and soak is not None else []
    return limited_at(_as_trial(trial, [*below, level]), len(below), ladder=False)


def run_line(trial: TrialResult, levels: Mapping[str, LevelResult]) -> str:
    """What limited ``trial`` in its verification: the soak and the peak, judged as a trial's ladder."""
    steady = [level for name in STEADY if (level := _measured(levels, name)) is not None]
    as_trial = _as_trial(trial, steady)
    limit = limit_level(as_trial)
    if limit is None:
        ran = [name for name in STEADY if name in levels]
        why = "no request completed in " + " or ".join(ran) if ran else "neither the soak nor the peak ran"
        return f"not diagnosed: {why}"
    return limited_at(as_trial, limit, ladder=False)


def diagnosis(trial: TrialResult, levels: Mapping[str, LevelResult]) -> tuple[str, dict[str, str]]:
    """The run's line and each diagnosed scenario's that ran or was planned (:data:`DIAGNOSED`)."""
    return run_line(trial, levels), {name: scenario_line(trial, name, levels) for name in DIAGNOSED}
