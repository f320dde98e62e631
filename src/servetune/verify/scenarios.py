"""The stability scenarios (tuning checklist, section 14, stage 6), each against a running engine.

Every scenario runs at, or from, the recommended operating level and returns a :class:`ScenarioResult`: its numbers,
``passed`` and the reason. The measuring is the trial's (``trial/measure.py measure_level``: prefix cache emptied,
``/metrics`` before and after, gauge peaks); new here is the load each scenario asks for and how it is judged:

- **soak**: the level for ``Budget.soak_s``; P99 TTFT and TPOT per window, their jitter (max over min) and drift
  (last over first), growth of KV-cache usage and of the engine's memory. Passes when the soak meets the SLO, the
  windowed P99 TTFT's jitter is at most ``JITTER_MAX``, its drift at most ``DRIFT_MAX`` (either may be over where
  reshuffling the requests over the windows gives as much by chance: ``CHANCE_MAX``), and the engine's memory grew
  by less than ``RSS_GROWTH_MAX``.
- **peak**: 1.25x the level. Passes without errors (its latency may break the SLO: reported).
- **burst**: gamma arrivals at the level's measured request rate, coefficient of variation 3 (the gaps' CV is
  reported as scheduled and as sent). Passes without errors; where the engine started with admission bounds, its
  503s are judged by ``admitted.py``'s rule instead (refusals the bounds explain, answered within the TTFT bound,
  the admitted within the SLO and its noise, other failures within the error budget; ``refusals.py``: vLLM's count).
- **mix**: 10% of requests at the workload's P99 input length among the usual ones; passes when the short ones' TTFT
  P99 stays within the SLO's TTFT bound (without one: twice the soak's).
- **long_output**: requests up to the server's output limit (``max_model_len`` minus the prompt; capped by
  ``Budget.long_output_cap`` on CPU). Passes when every one ends with every token asked.
- **disconnects** (``disconnects.py``): rounds of streams where half are dropped after their first tokens; vLLM must
  release them in time and stop generating for them.
- **headroom**: from the peak: KV-cache usage peak, preemptions, no out-of-memory. Passes with no preemption, no OOM
  and a KV peak under ``recommend.KV_USAGE_THIN``.
- **repeats**: the level ``Budget.repeats`` times; bootstrap intervals on goodput and P99 TTFT. Passes when most
  runs meet the SLO (the lead over the runner-up is judged by the caller).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from servetune.config.slo import Slo
from servetune.config.workload import Workload
from servetune.load.client import DROPPED, StreamingClient
from servetune.load.requests import PromptFactory
from servetune.load.runner import Level
from servetune.metrics import GOODPUT, RequestRecord
from servetune.report.autoscale import tolerable_wait_s
from servetune.report.points import is_out_of_memory
from servetune.report.recommend import KV_USAGE_THIN
from servetune.results import MARGIN, LevelResult
from servetune.summary import summarize
from servetune.trial.measure import EarlyBreak, Engine, LevelPlan, measure_level
from servetune.trial.readings import MetricsSource
from servetune.verify.admitted import describe as describe_admitted
from servetune.verify.admitted import judge_admitted
from servetune.verify.refusals import server_refusals
from servetune.verify.shapes import (
    LONG_CLASS,
    LONG_SHARE,
    fixed_workload,
    gap_cv,
    mixed_workload,
    p99_input_tokens,
    scaled,
)
from servetune.verify.stats import bootstrap_mean, chance_of_spread, drift, growth, jitter, window_samples, windows
from servetune.verify.watch import Trace

__all__ = ["LONG_SHARE"]  # its home is verify/shapes.py, with the loads the scenarios derive

#: Scenario names, in the order they run (verify.json's ``scenarios`` keys).
SCENARIOS = ("soak", "peak", "burst", "mix", "long_output", "disconnects", "headroom", "repeats")

JITTER_MAX = 2.0  # windowed P99 TTFT, max over min
DRIFT_MAX = 1.5  # windowed P99 TTFT, last over first
#: Jitter or drift over its bound fails the soak only when reshuffling the soak's requests over its
#: windows gives as much in under this share of rounds (stats.chance_of_spread): more than sampling.
CHANCE_MAX = 0.05
RSS_GROWTH_MAX = 0.10  # the engine's resident memory, growth over the soak relative to its start
PEAK_FACTOR = 1.25
BURST_CV = 3.0  # coefficient of variation of the gaps between arrivals; gamma shape = 1 / CV^2
DEFAULT_ERROR_RATE = 0.001  # allowed error rate where the SLO sets none
#: Each scenario draws its own prompts: streams far from the trial's (1 + level x repeats + run).
STREAMS = {name: 10_000 + 1_000 * i for i, name in enumerate(SCENARIOS)}


@dataclass(frozen=True)
class Budget:
    """How long and how big each scenario is: full on GPUs, short on the CPU stand-in."""

    soak_s: float
    windows: int
    scenario_s: float  # peak, burst, mix
    long_requests: int
    long_output_cap: int | None  # None: up to the server's limit
    drop_rounds: int
    repeats: int
    repeat_s: float
    warmup_cap: int  # warm-up requests of a level at most

    @classmethod
    def for_device(cls, device: str, duration_s: float | None = None) -> Budget:
        if device == "gpu":
            return cls(soak_s=duration_s or 600.0, windows=10, scenario_s=120.0, long_requests=8, long_output_cap=None,
                       drop_rounds=5, repeats=5, repeat_s=60.0, warmup_cap=32)  # fmt: skip
        # A quarter of the soak for peak, burst and mix, kept within 10-20 s, and never longer than
        # the soak itself; a repeat is 6 s, or half a soak shorter than 12 s (at least 2 s).
        soak = duration_s or 60.0
        return cls(soak_s=soak, windows=6, scenario_s=max(min(10.0, soak), min(20.0, soak / 4)), long_requests=2,
                   long_output_cap=1024, drop_rounds=3, repeats=5, repeat_s=min(6.0, max(2.0, soak / 2)), warmup_cap=4)  # fmt: skip


@dataclass
class ScenarioResult:
    name: str
    passed: bool
    reason: str
    numbers: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "reason": self.reason, **self.numbers}


@dataclass
class Target:
    """One running engine and how to load it."""

    client: StreamingClient
    url: str
    workload: Workload
    prompts: PromptFactory
    slo: Slo
    level: Level
    budget: Budget
    max_model_len: int
    measured_rate: float | None = None  # requests per second the study measured at the level
    capacity_rate: float | None = None  # requests per second it measured at the trial's capacity (report/operating.py)
    verdict_noise: float | None = None  # how much a repeat could differ there (results.py Capacity.verdict_noise)
    engine: Engine | None = None
    pid: int | None = None  # the engine's process (memory)
    # A deployment with no /metrics or /reset_prefix_cache at ``url`` (Serve's ingress): its replicas' metrics
    # (read late, by up to ``metrics.lag_s``) and how to empty their prefix caches.
    metrics: MetricsSource | None = None
    reset_cache: Callable[[], bool] | None = None
    records: list[RequestRecord] = field(default_factory=list)  # every request verify sent
    # The admission bounds the configuration sets (vLLM's max_num_queued_reqs / max_num_queued_tokens, admitted.py
    # ``bounds_of``): the burst's 503s are judged against them (admitted.py).
    admission: dict[str, int] = field(default_factory=dict)
    errors: dict[str, list[str]] = field(default_factory=dict)  # a few error messages per scenario
    levels: dict[str, LevelResult] = field(default_factory=dict)  # the level each scenario measured (diagnosis)

    @property
    def admission_bound(self) -> bool:
        """The configuration sets an admission bound: verify then runs the overload scenario (verify/overload.py)
        after the others."""
        return bool(self.admission)


def error_bound(slo: Slo) -> float:
    return min((b.limit for b in slo.bounds if b.metric == "error_rate"), default=DEFAULT_ERROR_RATE)


def ttft_breaks(slo: Slo, summary) -> list[str]:
    """The SLO's TTFT bounds a summary breaks, each at its own statistic."""
    broken = []
    for b in slo.bounds:
        if b.metric == "ttft_ms" and b.stat is not None:  # (a latency bound has a statistic)
            value = getattr(summary.ttft_ms, b.stat)
            if value is not None and b.breaks(value):
                broken.append(f"{b.name} = {value:.4g} > {b.limit:g}")
    return broken


class _Watch(EarlyBreak):
    """No SLO bound ends a scenario early (it runs its whole span; an open loop may still stop
    saturated), but a dead engine does: checked at most twice a second."""

    def __init__(self, level: Level, engine: Engine | None) -> None:
        super().__init__(Slo(), level, None)
        self.engine = engine
        self.checked = 0.0

    def broken(self) -> bool:
        if self.reason is None and self.engine is not None and time.monotonic() - self.checked >= 0.5:
            self.checked = time.monotonic()
            if not self.engine.alive():
                self.reason = "the engine died: stopped"
        return self.reason is not None


def _never_break(level: Level, engine: Engine | None = None) -> EarlyBreak:
    return _Watch(level, engine)


def _warmup(level: Level, budget: Budget) -> int:
    return int(min(max(level.value, 1), budget.warmup_cap))


def _core(result: LevelResult) -> dict[str, Any]:
    s = result.summary
    flat = s.flat()
    keep = ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p99", "itl_ms_p99", "e2el_ms_p99", "request_throughput",
            "output_throughput", GOODPUT, "error_rate")  # fmt: skip
    out: dict[str, Any] = {k: flat[k] for k in keep if k in flat}
    out.update(level=s.level, completed=s.completed, failed=s.failed, errors_by_kind=s.errors_by_kind,
               duration_s=s.duration_s, slo_violations=result.slo_violations)  # fmt: skip
    for name in ("kv_cache_usage_max", "requests_running_max", "requests_waiting_max", "preemptions"):
        if name in result.server_metrics:
            out[name] = result.server_metrics[name]
    if result.frontend_cpu_share is not None:
        out["frontend_cpu_share"] = result.frontend_cpu_share
    if result.frontend_process is not None:  # through Serve: which front-end process (serve/frontend.py)
        out["frontend_process"] = result.frontend_process
    if result.client_bound is not None:
        out["client_bound"] = result.client_bound
    for name in ("client_stall_ms_max", "client_stalled_s", "client_stalled"):  # the client's stalls (load/pace.py)
        if (value := getattr(result, name)) is not None:
            out[name] = value
    if result.stopped_early:
        out["stopped_early"] = result.stopped_early
    return out


def _error_samples(records: list[RequestRecord], limit: int = 3) -> list[str]:
    """The first few distinct errors, as the client recorded them."""
    seen: list[str] = []
    for r in records:
        text = f"{r.error_kind}: {r.error}"
        if r.error_kind and r.error_kind != DROPPED and text not in seen:
            seen.append(text)
            if len(seen) == limit:
                break
    return seen


async def _level(
    t: Target, plan: LevelPlan, stream: int, workload: Workload | None = None
) -> tuple[LevelResult, list[RequestRecord]]:
    """One level against the target (its metrics and prefix-cache reset where its URL has none), run whole
    unless the engine dies; its requests join ``t.records``."""
    result, records = await measure_level(
        t.client, t.url, workload or t.workload, t.prompts, plan, stream=stream, slo=t.slo,
        watch=_never_break(plan.level, t.engine), reset_cache=t.reset_cache, metrics=t.metrics,
        frontend_cpu=getattr(t.engine, "frontend_cpu", None),  # the API server's CPU, or Serve's front end's
        stall_tolerance=0.0,  # a scenario's own SLO verdict forgives no noise: a miss the client's stall accounts for
    )  # fmt: skip
    t.records.extend(records)
    return result, records


async def _measure(
    t: Target, plan: LevelPlan, scenario: str, workload: Workload | None = None
) -> tuple[LevelResult, list[RequestRecord]]:
    result, records = await _level(t, plan, STREAMS[scenario], workload)
    t.levels[scenario] = result
    errors = _error_samples(records)
    if errors:
        t.errors[scenario] = errors
    return result, records


def _errors_ok(result: LevelResult, slo: Slo) -> tuple[bool, str]:
    s = result.summary
    if s.completed == 0:
        return False, "no request completed"
    if s.error_rate > error_bound(slo):
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(s.errors_by_kind.items()))
        return False, f"error rate {s.error_rate:.2%} over {error_bound(slo):g} ({kinds})"
    return True, f"{s.completed} requests, error rate {s.error_rate:.2%}"


def fmt(value: float | None, unit: str = "", digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}{unit}"


async def soak(t: Target) -> ScenarioResult:
    b = t.budget
    plan = LevelPlan(t.level, num_requests=None, duration_s=b.soak_s, warmup_requests=_warmup(t.level, b))
    async with Trace(t.url, t.pid, t.metrics) as trace:
        result, records = await _measure(t, plan, "soak")
    ws = windows(records, b.windows, t.level.as_dict())
    ttft = [w.ttft_ms_p99 for w in ws]
    tpot = [w.tpot_ms_p99 for w in ws]
    rss_start = trace.rss_mib[0][1] if trace.rss_mib else None
    rss_growth = growth(trace.rss_mib)
    numbers = {
        **_core(result), "windows": [w.as_dict() for w in ws],
        "ttft_p99_jitter": jitter(ttft), "tpot_p99_jitter": jitter(tpot), "ttft_p99_drift": drift(ttft),
        "tpot_p99_drift": drift(tpot), "kv_usage_growth": growth(trace.kv_usage),
        "rss_start_mib": rss_start, "rss_growth_mib": rss_growth,
    }  # fmt: skip
    samples = window_samples(records, b.windows)
    numbers["ttft_p99_jitter_chance"] = chance_of_spread(samples, numbers["ttft_p99_jitter"], jitter)
    numbers["ttft_p99_drift_chance"] = chance_of_spread(samples, numbers["ttft_p99_drift"], drift)
    stalled = result.client_stalled  # the SLO miss is the client's stall's to account for: unsettled
    problems = [f"unsettled SLO: {stalled}"] if stalled else list(result.slo_violations)
    if _beyond_chance(numbers["ttft_p99_jitter"], JITTER_MAX, numbers["ttft_p99_jitter_chance"]):
        problems.append(f"windowed P99 TTFT jitter {numbers['ttft_p99_jitter']:.2f} > {JITTER_MAX:g}"
                        f"{_chance_note(numbers['ttft_p99_jitter_chance'])}")  # fmt: skip
    if _beyond_chance(numbers["ttft_p99_drift"], DRIFT_MAX, numbers["ttft_p99_drift_chance"]):
        problems.append(f"P99 TTFT drifted x{numbers['ttft_p99_drift']:.2f} from the first window to the last (> {DRIFT_MAX:g})"
                        f"{_chance_note(numbers['ttft_p99_drift_chance'])}")  # fmt: skip
    if rss_start and rss_growth is not None and rss_growth > RSS_GROWTH_MAX * rss_start:
        problems.append(f"the engine's memory grew {rss_growth:.0f} MiB from {rss_start:.0f} MiB")
    ok, errors = _errors_ok(result, t.slo)
    if not ok:
        problems.append(errors)
    if numbers.setdefault("unsettled", bool(stalled) and len(problems) == 1):
        problems[0] += "; rerun on a quiet host"
    reason = "; ".join(problems) if problems else (
        f"{b.soak_s:g} s at {t.level}: P99 TTFT per window {', '.join(fmt(v, '', 3) for v in ttft)} ms, "
        f"jitter {fmt(numbers['ttft_p99_jitter'])}, drift {fmt(numbers['ttft_p99_drift'])}"
        + _within_chance(numbers))  # fmt: skip
    return ScenarioResult("soak", not problems, reason, numbers)


def _beyond_chance(value: float | None, bound: float, chance: float | None) -> bool:
    """Over its bound, and more than the windows' sampling explains (or that could not be judged)."""
    return value is not None and value > bound and (chance is None or chance < CHANCE_MAX)


def _chance_note(chance: float | None) -> str:
    return "" if chance is None else f" (by chance in {chance:.1%} of reshuffles)"


def _within_chance(numbers: dict[str, Any]) -> str:
    """Says so when jitter or drift were over their bound but within what the windows' sampling gives."""
    over = [(name, numbers[f"ttft_p99_{name}"], numbers[f"ttft_p99_{name}_chance"], bound)
            for name, bound in (("jitter", JITTER_MAX), ("drift", DRIFT_MAX))]  # fmt: skip
    notes = [f"{name} {value:.2f} over {bound:g} but within sampling noise (as large by chance in {chance:.0%} of reshuffles)"
             for name, value, chance, bound in over if value is not None and value > bound and chance is not None]  # fmt: skip
    return ("; " + "; ".join(notes)) if notes else ""


async def peak(t: Target) -> tuple[ScenarioResult, LevelResult, Trace]:
    level = scaled(t.level, PEAK_FACTOR)
    plan = LevelPlan(level, num_requests=None, duration_s=t.budget.scenario_s, warmup_requests=_warmup(level, t.budget))
    async with Trace(t.url, t.pid, t.metrics) as trace:
        result, _ = await _measure(t, plan, "peak")
    ok, why = _errors_ok(result, t.slo)
    return ScenarioResult("peak", ok, f"{level} ({PEAK_FACTOR:g}x): {why}{peak_note(result, t.slo, t.verdict_noise)}",
                          _core(result)), result, trace  # fmt: skip


def peak_note(result: LevelResult, slo: Slo, noise: float | None) -> str:
    """The peak's SLO (reported, not judged): broken beyond the verdict noise (else ``MARGIN``), within it
    (config/slo.py ``noise_breaks``), or by a margin the client's longest stall accounts for."""
    if result.meets_slo:
        return "; meets the SLO"
    if result.client_stalled:
        return f"; SLO at peak unsettled: {result.client_stalled}"
    noise = noise or MARGIN
    breaks = slo.noise_breaks(result.summary, noise)
    if breaks.beyond or not breaks.within:
        return f"; SLO at peak: {'; '.join(result.slo_violations)}"
    return f"; SLO at peak within the noise ({noise:.0%}): {'; '.join(breaks.within)}"


async def burst(t: Target) -> ScenarioResult:
    rate = t.level.value if t.level.kind == "rate" else t.measured_rate
    if not rate:
        return ScenarioResult("burst", False, "the study measured no request rate at this level to burst around")
    level = Level("rate", rate, "gamma", burstiness=1.0 / BURST_CV**2)
    plan = LevelPlan(level, num_requests=None, duration_s=t.budget.scenario_s, warmup_requests=0)
    result, records = await _measure(t, plan, "burst")
    asked, cv = gap_cv(records, scheduled=True), gap_cv(records)
    numbers = {**_core(result), "mean_rate": rate, "target_cv": BURST_CV, "scheduled_cv": asked, "measured_cv": cv}
    head = f"gamma arrivals at {rate:.3g} req/s, gaps' CV {fmt(asked)} asked, {fmt(cv)} sent: "
    if t.admission:  # the bounds' 503s are theirs, judged apart (admitted.py)
        wait_s, _ = tolerable_wait_s([str(b) for b in t.slo.bounds])
        verdict = judge_admitted(records, t.admission, t.slo, level.as_dict(), wait_s, error_bound(t.slo),
                                 t.verdict_noise or MARGIN, result.client_stall_ms_max or 0.0)  # fmt: skip
        numbers.update(verdict.numbers)
        server = server_refusals(records, result.server_metrics, lagging=t.metrics is not None)  # vLLM's own count
        numbers.update(server.numbers())
        return ScenarioResult("burst", verdict.passed, f"{head}{describe_admitted(verdict)}; {server.text()}", numbers)
    ok, why = _errors_ok(result, t.slo)
    slo_note = (
        f"; SLO in the bursts: {'; '.join(result.slo_violations)}" if result.slo_violations else "; meets the SLO"
    )
    return ScenarioResult("burst", ok, f"{head}{why}{slo_note}", numbers)


async def mix(t: Target, soak_ttft_p99: float | None) -> ScenarioResult:
    long_tokens = min(p99_input_tokens(t.workload), t.max_model_len // 2)
    workload = mixed_workload(t.workload, long_tokens)
    plan = LevelPlan(
        t.level, num_requests=None, duration_s=t.budget.scenario_s, warmup_requests=_warmup(t.level, t.budget)
    )
    result, records = await _measure(t, plan, "mix", workload)
    measured = [r for r in records if not r.warmup]
    bounds = t.slo.request_bounds_ms() or None
    short = summarize([r for r in measured if r.request_class != LONG_CLASS], t.level.as_dict(), bounds)
    long = summarize([r for r in measured if r.request_class == LONG_CLASS], t.level.as_dict(), bounds)
    short_p99 = short.ttft_ms.p99
    ratio = short_p99 / soak_ttft_p99 if short_p99 and soak_ttft_p99 else None
    numbers = {**_core(result), "long_input_tokens": long_tokens, "long_requests": long.completed + long.failed,
               "short_ttft_ms_p99": short_p99, "long_ttft_ms_p99": long.ttft_ms.p99, "soak_ttft_ms_p99": soak_ttft_p99,
               "short_ttft_p99_vs_soak": ratio}  # fmt: skip
    ok, why = _errors_ok(result, t.slo)
    has_bound = any(b.metric == "ttft_ms" for b in t.slo.bounds)
    broken = ttft_breaks(t.slo, short)
    head = (f"with 10% of requests at {long_tokens} input tokens, the short ones' P99 TTFT is {fmt(short_p99)} ms "
            f"(soak: {fmt(soak_ttft_p99)} ms, x{fmt(ratio)})")  # fmt: skip
    if short_p99 is None:
        passed, reason = False, "no short request completed"
    elif has_bound:
        passed = ok and not broken
        reason = f"{head}; short requests: {'; '.join(broken) if broken else 'within the TTFT bounds'}; {why}"
    else:
        passed = ok and (ratio is None or ratio <= 2.0)
        reason = f"{head} (no TTFT bound: at most x2 passes); {why}"
    numbers["short_ttft_slo_violations"] = broken
    return ScenarioResult("mix", passed, reason, numbers)


async def long_output(t: Target) -> ScenarioResult:
    prompt = 32
    asked = t.max_model_len - prompt
    if t.budget.long_output_cap is not None:
        asked = min(asked, t.budget.long_output_cap)
    n = t.budget.long_requests
    level = Level("concurrency", float(n))
    plan = LevelPlan(level, num_requests=n, duration_s=None, warmup_requests=0)
    result, records = await _measure(t, plan, "long_output", fixed_workload(t.workload, "long-output", prompt, asked))
    got = [r.output_tokens for r in records if r.ok]
    numbers = {**_core(result), "asked_output_tokens": asked, "server_output_limit": t.max_model_len - prompt,
               "output_tokens": got}  # fmt: skip
    short = [g for g in got if g != asked]
    if len(got) < n:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(result.summary.errors_by_kind.items()))
        return ScenarioResult(
            "long_output", False, f"{n - len(got)} of {n} requests of {asked} output tokens failed ({kinds})", numbers
        )
    if short:
        return ScenarioResult("long_output", False, f"asked {asked} output tokens, got {short}", numbers)
    e2el = result.summary.e2el_ms.p99
    return ScenarioResult(
        "long_output", True, f"{n} requests of {asked} output tokens all ended whole (E2E P99 {fmt(e2el)} ms)", numbers
    )


def headroom(peak_result: LevelResult, trace: Trace, engine: Engine | None, log_text: str) -> ScenarioResult:
    m = peak_result.server_metrics
    kv = m.get("kv_cache_usage_max")
    preemptions = m.get("preemptions")
    alive = engine is None or engine.alive()
    oom = is_out_of_memory(log_text)
    numbers = {"kv_cache_usage_max": kv, "kv_margin": None if kv is None else 1.0 - kv, "preemptions": preemptions,
               "requests_waiting_max": m.get("requests_waiting_max"), "engine_alive": alive, "oom": oom,
               "rss_max_mib": max((v for _, v in trace.rss_mib), default=None)}  # fmt: skip
    problems = []
    if oom:
        problems.append("the engine ran out of memory")
    if not alive:
        problems.append("the engine died at peak load")
    if preemptions:
        problems.append(f"vLLM preempted {preemptions:g} requests at peak")
    if kv is not None and kv >= KV_USAGE_THIN:
        problems.append(f"KV-cache usage peaked at {kv:.0%} (>= {KV_USAGE_THIN:.0%})")
    if problems:
        return ScenarioResult("headroom", False, "; ".join(problems), numbers)
    kv_text = f"KV cache peaked at {kv:.1%}" if kv is not None else "KV usage not reported"
    return ScenarioResult("headroom", True, f"at peak: {kv_text}, {preemptions or 0:g} preemptions, no OOM", numbers)


def served_per_s(result: LevelResult) -> float:
    s = result.summary
    return s.goodput if s.goodput is not None else s.request_throughput


async def repeat_runs(t: Target, stream_base: int) -> list[LevelResult]:
    results = []
    for run in range(t.budget.repeats):
        plan = LevelPlan(
            t.level, num_requests=None, duration_s=t.budget.repeat_s, warmup_requests=_warmup(t.level, t.budget)
        )
        result, _ = await _level(t, plan, stream_base + run)
        results.append(result)
        if t.engine is not None and not t.engine.alive():
            break
    return results


def repeats_numbers(runs: list[LevelResult]) -> dict[str, Any]:
    goodput = [served_per_s(r) for r in runs]
    ttft = [r.summary.ttft_ms.p99 for r in runs]
    g, p = bootstrap_mean(goodput), bootstrap_mean([v for v in ttft if v is not None])
    return {"runs": len(runs), "goodput": goodput, "ttft_ms_p99": ttft, "meets_slo": [r.meets_slo for r in runs],
            "goodput_ci": g.as_dict() if g else None, "ttft_ms_p99_ci": p.as_dict() if p else None}  # fmt: skip


async def repeats(t: Target) -> tuple[ScenarioResult, list[LevelResult]]:
    runs = await repeat_runs(t, STREAMS["repeats"])
    numbers = repeats_numbers(runs)
    meeting = sum(numbers["meets_slo"])
    passed = len(runs) >= t.budget.repeats and meeting * 2 > len(runs)
    g = numbers["goodput_ci"]
    ci = f"goodput {g['mean']:.3g} req/s [{g['low']:.3g}, {g['high']:.3g}]" if g else "goodput interval not computed"
    reason = f"{meeting} of {len(runs)} runs of {t.level} met the SLO; {ci}"
    return ScenarioResult("repeats", passed, reason, numbers), runs


def not_run(name: str, why: str) -> ScenarioResult:
    return ScenarioResult(name, False, f"not run: {why}")
