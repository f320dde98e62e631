"""The canary scenario (opt-in, ``servetune verify --scenario canary``): the candidate (the study's runner-up) takes
``--canary-share`` of the load beside the incumbent (the verified point), each measured on its own share, and the
verdict comes with confidence intervals.

Both run as Ray Serve LLM applications on one cluster, each behind its own route (``/servetune-<study>-<trial>``);
the load client splits the verified level between them: an open loop's rate into ``rate x (1 - share)`` and
``rate x share`` (two Poisson streams of those rates are one Poisson stream of the whole rate whose every request
goes to the candidate with probability ``share``), a closed loop's clients into ``share`` of them (at least one)
and the rest. Two applications and a split in the client, rather than a router deployment in front of both: the
client knows for certain which deployment served each request (it sent it there), and neither share pays for a
proxy hop the other does not; a router would add one to both and would have to return its choice in a header.

:func:`judge_canary` is a pure function of the two shares' request records and the SLO:

- per share: requests, failed, the error rate, TTFT and TPOT P50 and P99, each with a 95% bootstrap interval
  over the requests (``stats.bootstrap_percentile``; the error rate's over the requests' failed-or-not);
- the candidate minus the incumbent for TTFT P99, TPOT P99 and the error rate, each with its bootstrap interval
  (the two shares resampled independently, ``stats.bootstrap_percentile_difference``);
- a metric **regressed** when the whole interval of the difference is above 0 (the candidate worse beyond the
  noise the requests show) *and* the candidate's share breaks an SLO bound on it (each bound at its own statistic:
  ``tpot_ms.p95`` at the share's P95; the error rate's bound, else 0.1%), or the SLO does not bound that metric.

It passes when no metric regressed: the candidate no worse than the incumbent beyond the intervals, or within the
SLO where it is worse. With fewer than ``MIN_REQUESTS`` completed on either share it is not judged (and fails:
run longer, or a larger share). Its verdict is about the candidate, not the verified point, so it does not reject
the verification; it is checklist item 15.23 (canary release, linked to performance data).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np

from servetune.config.slo import Slo
from servetune.load.client import StreamingClient
from servetune.load.runner import Level
from servetune.metrics import RequestRecord
from servetune.trial.measure import Engine, LevelPlan, measure_level
from servetune.trial.readings import MetricsSource
from servetune.verify.scenarios import ScenarioResult, Target, _error_samples, _never_break, _warmup, error_bound, fmt
from servetune.verify.stats import (
    Interval,
    bootstrap_difference,
    bootstrap_mean,
    bootstrap_percentile,
    bootstrap_percentile_difference,
)

NAME = CANARY = "canary"
DEFAULT_SHARE = 0.1
#: Completed requests each share needs before a P99 and its interval mean anything.
MIN_REQUESTS = 20
CONFIDENCE = 0.95
STREAM = 32_000  # the incumbent's arrivals' seed; the candidate's is the next (replica_lost's is 31_000)
#: The metrics compared: (name, the SLO metric whose P99 bound applies, the record's value in seconds, in words).
LATENCIES = (("ttft_ms_p99", "ttft_ms", "ttft_s", "TTFT P99"), ("tpot_ms_p99", "tpot_ms", "tpot_s", "TPOT P99"))


class Candidate(Engine, Protocol):
    """The candidate's deployment, once running (``serve.trial.ServeEngine``): its address, its replicas' metrics,
    and how to empty their prefix caches."""

    @property
    def url(self) -> str: ...

    @property
    def server_metrics(self) -> MetricsSource | None: ...

    def reset_prefix_cache(self) -> bool: ...


@dataclasses.dataclass(frozen=True)
class Deploy:
    """How to start the candidate: its trial id, the model name its server answers to, and its deployment beside
    the incumbent's engine (a context manager that deploys on entering and deletes on leaving)."""

    trial_id: str
    model: str
    open: Callable[[object], AbstractContextManager[Candidate]]


def _ms(values: Sequence[float | None]) -> list[float]:
    return [v * 1000.0 for v in values if v is not None]


def _interval(value: Interval | None) -> dict[str, float] | None:
    return None if value is None else value.as_dict()


def share_numbers(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """One share's numbers: requests, failed, the error rate and TTFT/TPOT P50/P99, each an interval
    ``{mean, low, high}`` (``mean`` holds the percentile) or None with fewer than two values."""
    measured = [r for r in records if not r.warmup]
    ttft = _ms([r.ttft_s for r in measured if r.ok])
    tpot = _ms([r.tpot_s for r in measured if r.ok])
    failed = [0.0 if r.ok else 1.0 for r in measured]
    return {
        "requests": len(measured), "completed": sum(r.ok for r in measured), "failed": int(sum(failed)),
        "error_rate": _interval(bootstrap_mean(failed, CONFIDENCE)) if len(failed) >= 2 else None,
        "ttft_ms_p50": _interval(bootstrap_percentile(ttft, 50, CONFIDENCE)),
        "ttft_ms_p99": _interval(bootstrap_percentile(ttft, 99, CONFIDENCE)),
        "tpot_ms_p50": _interval(bootstrap_percentile(tpot, 50, CONFIDENCE)),
        "tpot_ms_p99": _interval(bootstrap_percentile(tpot, 99, CONFIDENCE)),
    }  # fmt: skip


def slo_breaks(values_ms: Sequence[float], slo: Slo, metric: str) -> tuple[list[str], list[str]]:
    """(the SLO's bounds on ``metric`` (``ttft_ms``, ``tpot_ms``), those a share's values break), each bound judged
    at its own statistic (``ttft_ms_p95`` at the share's P95)."""
    bounds = [b for b in slo.bounds if b.metric == metric and b.stat is not None]
    broken = []
    for b in bounds:
        if not values_ms or b.stat is None:
            continue
        value = float(np.mean(values_ms)) if b.stat == "mean" else float(np.percentile(values_ms, float(b.stat[1:])))
        if b.breaks(value):
            broken.append(f"{b.name} {value:.4g} > {b.limit:g}")
    return [b.name for b in bounds], broken


def _text(i: Interval | dict[str, float] | None, unit: str = "", digits: int = 3) -> str:
    if i is None:
        return "-"
    d = i.as_dict() if isinstance(i, Interval) else i
    return f"{fmt(d['mean'], unit, digits)} [{fmt(d['low'], '', digits)}, {fmt(d['high'], '', digits)}]"


def judge_canary(incumbent: Sequence[RequestRecord], candidate: Sequence[RequestRecord], slo: Slo, share: float,
                 incumbent_id: str = "incumbent", candidate_id: str = "candidate") -> ScenarioResult:  # fmt: skip
    """The verdict on the two shares' records (see the module docstring)."""
    mine, theirs = share_numbers(incumbent), share_numbers(candidate)
    inc = [r for r in incumbent if not r.warmup]
    cand = [r for r in candidate if not r.warmup]
    total = len(inc) + len(cand)
    numbers: dict[str, Any] = {
        "incumbent_trial": incumbent_id, "candidate_trial": candidate_id, "share": share,
        "candidate_share": len(cand) / total if total else None, "confidence": CONFIDENCE,
        "incumbent": mine, "candidate": theirs, "min_requests": MIN_REQUESTS,
    }  # fmt: skip
    short = [f"{who} {n['completed']}" for who, n in (("incumbent", mine), ("candidate", theirs))
             if n["completed"] < MIN_REQUESTS]  # fmt: skip
    if short:
        numbers.update(judged=False, regressed=[])
        return ScenarioResult(NAME, False, f"not judged: too few completed requests ({', '.join(short)}; at least "
                                           f"{MIN_REQUESTS} each): run longer (--duration) or a larger --canary-share",
                              numbers)  # fmt: skip
    differences: dict[str, dict[str, float] | None] = {}
    bounds: dict[str, Any] = {}
    broken: dict[str, list[str]] = {}
    regressed: list[str] = []
    findings: list[str] = []
    for name, metric, attr, label in LATENCIES:
        values = [_ms([getattr(r, attr) for r in rs if r.ok]) for rs in (cand, inc)]
        diff = bootstrap_percentile_difference(values[0], values[1], 99, CONFIDENCE)
        bounds[name], broken[name] = slo_breaks(values[0], slo, metric)
        differences[name] = _interval(diff)
        worse = diff is not None and diff.low > 0
        if worse and (broken[name] or not bounds[name]):
            regressed.append(name)
            findings.append(f"{label} regressed: candidate {_text(theirs[name], ' ms')} vs incumbent "
                            f"{_text(mine[name], ' ms')}, difference {_text(diff, ' ms')}"
                            + (f", and it breaks the SLO ({'; '.join(broken[name])})" if broken[name]
                               else " (the SLO does not bound it)"))  # fmt: skip
        elif worse:
            findings.append(f"{label} {_text(diff, ' ms')} slower, within the SLO ({', '.join(bounds[name])})")
        else:
            findings.append(f"{label} difference {_text(diff, ' ms')}")
    failed_flags = [[0.0 if r.ok else 1.0 for r in rs] for rs in (cand, inc)]
    err_diff = bootstrap_difference(failed_flags[0], failed_flags[1], CONFIDENCE)
    err_bound = error_bound(slo)
    differences["error_rate"], bounds["error_rate"] = _interval(err_diff), err_bound
    err_value = (theirs["error_rate"] or {}).get("mean")
    if err_diff is not None and err_diff.low > 0 and err_value is not None and err_value > err_bound:
        regressed.append("error_rate")
        findings.append(f"error rate regressed: candidate {_text(theirs['error_rate'], '', 2)} vs incumbent "
                        f"{_text(mine['error_rate'], '', 2)}, over the bound {err_bound:g}")  # fmt: skip
    numbers.update(judged=True, differences=differences, bounds=bounds, slo_broken=broken, regressed=regressed)
    head = (f"candidate trial {candidate_id} took {fmt(numbers['candidate_share'] * 100, '%', 2)} of the load "
            f"({len(cand)} requests) beside trial {incumbent_id} ({len(inc)}); candidate minus incumbent, "
            f"{CONFIDENCE:.0%} bootstrap intervals over the requests: ")  # fmt: skip
    return ScenarioResult(NAME, not regressed, head + "; ".join(findings), numbers)


def split(level: Level, share: float) -> tuple[Level, Level]:
    """(the incumbent's level, the candidate's): an open loop's rate (and its cap on requests in flight) in
    proportion, a closed loop's clients rounded, each at least one."""
    if level.kind == "concurrency":
        theirs = max(1, round(level.value * share))
        return dataclasses.replace(level, value=float(max(1, round(level.value) - theirs))), dataclasses.replace(
            level, value=float(theirs)
        )
    cap = level.max_concurrency

    def part(f: float) -> Level:
        return dataclasses.replace(level, value=level.value * f,
                                   max_concurrency=None if cap is None else max(1, math.ceil(cap * f)))  # fmt: skip

    return part(1 - share), part(share)


def span_s(t: Target, share: float) -> float:
    """How long both shares run: twice the scenario's time, longer where the candidate's share of the measured
    rate needs it to complete twice ``MIN_REQUESTS``, at most the soak's time (and never under twice the scenario's)."""
    base = 2 * t.budget.scenario_s
    if not t.measured_rate:
        return base
    return max(base, min(2 * MIN_REQUESTS / (t.measured_rate * share), t.budget.soak_s))


async def canary(t: Target, deploy: Deploy, share: float, incumbent_id: str = "incumbent") -> ScenarioResult:
    """Deploy the candidate beside the running incumbent, load both with their shares of the level at once, judge,
    delete the candidate."""
    seconds = span_s(t, share)
    mine, theirs = split(t.level, share)
    deployment = deploy.open(t.engine)
    entering = asyncio.ensure_future(asyncio.to_thread(deployment.__enter__))
    try:
        engine = await asyncio.shield(entering)
    except asyncio.CancelledError:  # stopped while it deploys: once deployed, it is deleted again, not left behind
        with contextlib.suppress(Exception):
            await entering
            await asyncio.to_thread(deployment.__exit__, None, None, None)
        raise
    except Exception as exc:  # its start failed: a failure of the candidate, told as the trial's would be
        return ScenarioResult(NAME, False, f"not run: the candidate trial {deploy.trial_id} did not start ({exc})",
                              {"judged": False, "candidate_trial": deploy.trial_id, "share": share})  # fmt: skip
    try:
        c = t.client
        async with StreamingClient(engine.url, deploy.model, api=c.api, timeout_s=c.timeout_s,
                                   first_token_timeout_s=c.first_token_timeout_s, idle_timeout_s=c.idle_timeout_s,
                                   ignore_eos=c.ignore_eos, temperature=c.temperature) as client:  # fmt: skip

            def plan(level: Level) -> LevelPlan:
                return LevelPlan(level, num_requests=None, duration_s=seconds, warmup_requests=_warmup(level, t.budget))

            (_, inc), (_, cand) = await asyncio.gather(
                measure_level(t.client, t.url, t.workload, t.prompts, plan(mine), stream=STREAM, slo=t.slo,
                              watch=_never_break(mine, t.engine), reset_cache=t.reset_cache, metrics=t.metrics),
                measure_level(client, engine.url, t.workload, t.prompts, plan(theirs), stream=STREAM + 1, slo=t.slo,
                              watch=_never_break(theirs, engine), reset_cache=engine.reset_prefix_cache,
                              metrics=engine.server_metrics),
            )  # fmt: skip
    finally:
        with contextlib.suppress(Exception):  # the candidate's teardown must not lose the verdict
            await asyncio.to_thread(deployment.__exit__, None, None, None)
    t.records.extend(inc)  # the verified point's requests count in verify's stability; the candidate's do not
    if samples := _error_samples([*inc, *cand]):
        t.errors[NAME] = samples
    verdict = judge_canary(inc, cand, t.slo, share, incumbent_id, deploy.trial_id)
    verdict.numbers.update(level=t.level.as_dict(), incumbent_level=mine.as_dict(), candidate_level=theirs.as_dict(),
                           duration_s=seconds)  # fmt: skip
    return verdict


def refusal(replicas: int | None, candidate: str | None) -> str | None:
    """Why the scenario cannot run: the verified trial not through Serve (``replicas`` None), or no candidate."""
    if replicas is None:
        return "canary needs a trial measured through Ray Serve (serve.num_replicas); this one ran bare"
    if candidate is None:
        return (
            "canary needs a candidate: the study has no runner-up (a second trial that met the SLO) to deploy beside it"
        )
    return None
