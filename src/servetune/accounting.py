"""Where a study's device time went: measuring, starting engines, the rest, and what early stopping saved.

Device-seconds are GPU-seconds on GPUs and core-seconds on the CPU stand-in: a trial's duration
times the devices it reserved. Pure: reads results, never Ray (the report uses it too).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from servetune.results import TrialResult, WeightsPrefetch

#: How the ladder words its reasons to stop early (trial/ladder.py, study/early_stop.py).
DOMINATED = "dominated at"


def time_accounting(results: Iterable[TrialResult]) -> dict[str, Any]:
    """Where the device time reserved by trials went: measuring, against starting engines and the rest.

    Device-seconds (GPU-seconds; core-seconds on the CPU stand-in) are a trial's duration times
    its devices. ``measuring`` is the measured part of every load level; ``starting`` is engine
    startup (process start to healthy); ``quality`` is the quality probe (config/quality.py);
    ``other`` is the rest: capacity check, tokenizer loading, warm-up requests, failed starts and
    teardown. Shares are of the total (0 when nothing ran). Of ``measuring``, ``capacity_search`` and
    ``knee_search`` are the levels the capacity search measured beyond the ladder (trial/capacity.py: its
    budget ``load.capacity_levels``, shared by the capacity and the knee's bisection).
    """
    total = measuring = starting = quality = capacity_search = knee_search = 0.0
    startups: list[float] = []
    trials = 0
    for result in results:
        trials += 1
        duration = result.duration_s or 0.0
        measured = sum(level.measured_s for level in result.levels)
        startup = result.startup_s or 0.0
        if result.startup_s is not None:
            startups.append(result.startup_s)
        total += duration * result.devices
        measuring += min(measured, duration) * result.devices
        for_capacity, for_knee = searched_s(result)
        capacity_search += for_capacity * result.devices
        knee_search += for_knee * result.devices
        starting += min(startup, max(duration - measured, 0.0)) * result.devices
        probe = result.quality.duration_s if result.quality is not None and result.quality.duration_s else 0.0
        quality += min(probe, max(duration - measured - startup, 0.0)) * result.devices
    other = max(total - measuring - starting - quality, 0.0)

    def share(x: float) -> float:
        return x / total if total > 0 else 0.0

    return {
        "trials": trials,
        "device_seconds": total,
        "measuring_device_seconds": measuring,
        "starting_device_seconds": starting,
        "quality_device_seconds": quality,
        "other_device_seconds": other,
        "measuring_share": share(measuring),
        "starting_share": share(starting),
        "quality_share": share(quality),
        "other_share": share(other),
        "capacity_search_device_seconds": capacity_search,
        "knee_search_device_seconds": knee_search,
        "capacity_search_share": share(capacity_search),
        "knee_search_share": share(knee_search),
        "engine_starts": len(startups),
        "startup_s_mean": sum(startups) / len(startups) if startups else None,
        "startup_s_max": max(startups, default=None),
    }  # fmt: skip


def searched_s(result: TrialResult) -> tuple[float, float]:
    """Seconds measured beyond the ladder: (for the capacity, for the knee). The search measures its levels after
    the ladder's, the capacity's and the knee's interleaved, so they are the last ones; each level is counted
    by the order the search spent them in (the knee's after the capacity's)."""
    capacity = result.capacity_at_slo.extra_levels if result.capacity_at_slo is not None else 0
    knee = result.knee.extra_levels if result.knee is not None else 0
    extra = result.levels[max(len(result.levels) - capacity - knee, 0) :]
    seconds = [level.measured_s for level in extra]
    return sum(seconds[: len(seconds) - knee]), sum(seconds[len(seconds) - knee :])


#: Start-up phases in the order an engine goes through them, with their words (engine/startup.py).
STARTUP_PHASES = {"download_s": "downloading weights (the starts that did)", "load_weights_s": "loading weights", "compile_s": "torch.compile", "cuda_graphs_s": "CUDA graphs",
                  "kv_profile_warmup_s": "KV profiling and warm-up", "other_s": "imports, API server and the rest"}  # fmt: skip


def prefetch_lines(records: Iterable[WeightsPrefetch]) -> list[str]:
    """``weights downloaded before the first trial (servetune/prefetch.py), outside every start-up and its loading
    weights: org/model 16.1 GB on 2 node(s), 93 s on the slowest``; where a node failed, how many."""
    by_model: dict[str, list[WeightsPrefetch]] = {}
    for record in records:
        by_model.setdefault(record.model, []).append(record)
    lines = []
    for model, nodes in by_model.items():
        fetched = [r for r in nodes if r.error is None]
        failed = (
            f"; failed on {len(nodes) - len(fetched)} (their trials downloaded)" if len(fetched) < len(nodes) else ""
        )
        if fetched:
            size = max(r.bytes for r in fetched) / 1e9
            slowest = max(r.download_s for r in fetched)
            lines.append(f"weights downloaded before the first trial, outside every start-up (and its loading weights): "
                         f"{model} {size:.1f} GB on {len(fetched)} node(s), {slowest:.0f} s on the slowest{failed}")  # fmt: skip
        else:
            lines.append(f"weights of {model}: the prefetch failed on every node{failed.removeprefix(';')}")
    return lines


def startup_lines(results: Iterable[TrialResult], unit: str = "GPU") -> list[str]:
    """``engine start-up, mean of 4: loading weights 5.3 s, torch.compile 21 s, ...; compile cache hit in 3 of 4``."""
    logged = [r.startup_phases for r in results if r.startup_phases]
    if not logged:
        return []
    parts = []
    for key, words in STARTUP_PHASES.items():
        values = [p[key] for p in logged if key in p]
        if values:
            parts.append(f"{words} {sum(values) / len(values):.1f} s")
    hits = sum(p.get("compile_cache_hit", 0.0) > 0 for p in logged)
    compiled = sum("compile_s" in p or p.get("compile_cache_hit", 0.0) > 0 for p in logged)
    cache = f"; compile cache hit in {hits} of {compiled}" if compiled else ""
    return [f"engine start-up, mean of {len(logged)}: {', '.join(parts)}{cache}"]


def stop_cause(stopped_because: str | None) -> str | None:
    """Which rule stopped the ladder: ``dominated``, ``slo``, ``saturated``, ``no requests`` or ``other`` (None: it did not stop early)."""
    if not stopped_because:
        return None
    for prefix, cause in (
        (DOMINATED, "dominated"),
        ("SLO broken", "slo"),
        ("saturated", "saturated"),
        ("no request completed", "no requests"),
    ):
        if stopped_because.startswith(prefix):
            return cause
    return "other"


def early_stop_savings(results: Iterable[TrialResult], planned_levels: int) -> dict[str, Any]:
    """Device-minutes (GPU-minutes; core-minutes on the CPU stand-in) spent by trials, and an
    estimate of those saved by stopping ladders early, by cause (see :func:`stop_cause`).

    A trial that stopped after k of ``planned_levels`` levels saved (planned - k) levels, each
    estimated at the mean measured seconds of its own levels, times its devices. Warm-up and
    drain make real levels longer, so this errs low.
    """
    spent = 0.0
    saved: dict[str, float] = {}
    stopped: dict[str, int] = {}
    for result in results:
        spent += (result.duration_s or 0.0) * result.devices / 60.0
        cause = stop_cause(result.stopped_because) if result.outcome == "COMPLETE" else None
        if cause is None or not result.levels:
            continue
        per_level_s = sum(level.measured_s for level in result.levels) / len(result.levels)
        skipped = max(planned_levels - len(result.levels), 0)
        saved[cause] = saved.get(cause, 0.0) + per_level_s * skipped * result.devices / 60.0
        stopped[cause] = stopped.get(cause, 0) + 1
    return {
        "device_minutes_spent": spent,
        "device_minutes_saved": sum(saved.values()),
        "saved_by_cause": saved,
        "trials_stopped": stopped,
    }


def search_part(spent: dict[str, Any]) -> str:
    """`` (12% the capacity search beyond the ladder, 4% the knee's)``: the search's levels beyond the ladder, where any ran."""
    if not spent["capacity_search_device_seconds"] and not spent["knee_search_device_seconds"]:
        return ""
    knee = f", {spent['knee_search_share']:.0%} the knee's" if spent["knee_search_device_seconds"] else ""
    return f" ({spent['capacity_search_share']:.0%} the capacity search beyond the ladder{knee})"


def prune_savings(results: Iterable[TrialResult]) -> dict[str, Any]:
    """The trials the estimate pruned (study/prune.py) and the device-minutes that saved: each pruned trial at the
    mean duration of the trials that ran to completion, times its own devices (None with none to take it from)."""
    results = list(results)
    pruned = [r for r in results if r.outcome == "PRUNED"]
    ran = [r.duration_s for r in results if r.outcome == "COMPLETE" and r.duration_s]
    mean_s = sum(ran) / len(ran) if ran else None
    saved = None if mean_s is None else sum(mean_s * r.devices for r in pruned) / 60.0
    return {"trials_pruned": len(pruned), "device_minutes_saved": saved, "mean_trial_s": mean_s}


def device_time_lines(results: list[TrialResult], device: str, planned_levels: int) -> list[str]:
    """Where the device time reserved by trials went, and what stopping ladders early saved.

    ``device`` is the study's (``gpu``, or ``cpu``: core time); ``planned_levels`` the rungs
    of its load ladder.
    """
    unit = "GPU" if device == "gpu" else "core"
    spent = time_accounting(results)
    if not spent["device_seconds"]:
        return []
    starts = ""
    if spent["engine_starts"]:
        starts = f" ({spent['engine_starts']} starts, mean {spent['startup_s_mean']:.0f} s, max {spent['startup_s_max']:.0f} s)"
    lines = [
        f"{unit} time: {spent['device_seconds'] / 60:,.1f} {unit}-min reserved by {spent['trials']} trial(s): "
        f"{spent['measuring_share']:.0%} measuring{search_part(spent)}, {spent['starting_share']:.0%} starting engines{starts}, "
        + (f"{spent['quality_share']:.0%} quality probe, " if spent["quality_device_seconds"] else "")
        + f"{spent['other_share']:.0%} warm-up, teardown and checks"
    ]
    phases = startup_lines(results, unit)
    lines += phases
    savings = early_stop_savings(results, planned_levels)
    if savings["trials_stopped"]:
        causes = {
            "dominated": "dominated",
            "slo": "SLO broken",
            "saturated": "saturated",
            "no requests": "no request completed",
            "other": "other",
        }
        parts = [
            f"{causes[c]}: {n} trial(s), {savings['saved_by_cause'][c]:,.1f} {unit}-min"
            for c, n in savings["trials_stopped"].items()
        ]
        lines.append(
            f"early stopping saved about {savings['device_minutes_saved']:,.1f} {unit}-min ({'; '.join(parts)})"
        )
    else:
        lines.append("early stopping: every ladder ran to its last level")
    pruning = prune_savings(results)
    if pruning["trials_pruned"]:
        saved = pruning["device_minutes_saved"]
        about = (
            f": about {saved:,.1f} {unit}-min saved (each at the {pruning['mean_trial_s']:,.0f} s mean of the trials "
            "measured)"
            if saved is not None
            else ""
        )
        lines.append(f"the estimate pruned {pruning['trials_pruned']} trial(s) before any engine started{about}")
    return lines
