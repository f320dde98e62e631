"""The autoscaling ramp: the derived ``autoscaling_config`` deployed, then 1x (the most clients one replica holds
below Serve's scale-up threshold, :func:`one_replica_clients`), 3x held until Serve has scaled out (and a while
after), and back to 1x. Before 1x the ramp waits, with no client, until Serve's averaging window holds none of the
load of the step before it (:func:`settle_s`), so one replica is what the 1x phase measures.

Every second it samples what Serve reports (replicas RUNNING and STARTING of the LLM deployment)
and Serve's own per-replica request counter; every request's record says whether it met the SLO.
From those: the time to decide (3x offered -> Serve started an extra replica, the autoscaling policy's part) and
the time to scale up (3x offered -> the extra replicas RUNNING, their engine start added), SLO violations per
phase and per window, the requests each replica served, and whether a new replica served any
request before Serve had it RUNNING, which for Ray Serve LLM means its engine had started (it
must not). Serve's counter reaches the metrics agent a report interval late, so a request is
seen at or after the moment it was served: the check never blames a replica wrongly, and a
violation it reports is real.

``summarize_ramp`` is pure (tests feed it samples); ``run_ramp`` drives a real ingress.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypedDict

from pydantic import BaseModel

from servetune.config.workload import Workload
from servetune.load.client import StreamingClient
from servetune.load.requests import PromptFactory, iter_requests
from servetune.metrics import RequestRecord
from servetune.results import RECORD, ClaimedCores
from servetune.summary import meets_request_slo

#: Seconds per window of the ramp's table.
WINDOW_S = 5.0
#: Seconds of pause after each sample of Serve's status and counters before the next: the sample's own reads add to
#: it (samples came 1.7-2.7 s apart in serve-check's e2e on a busy two-core host), a pause rather than a fixed rate so
#: that slow reads on a loaded host do not follow each other back to back beside the engines being measured.
SAMPLE_S = 1.0


class ScaleWatch(Protocol):
    """What the ramp reads of Serve (``serve.cluster.ServeCluster`` is one)."""

    def replica_states(self, name: str) -> dict[str, int]: ...

    def served_per_replica(self, name: str) -> dict[str, int]: ...


@dataclass(frozen=True)
class Phase:
    name: str  # "1x", "3x", "back to 1x"
    concurrency: int
    hold_s: float  # seconds at this load (for 3x: after the extra replicas are RUNNING)
    wait_for_replicas: int = 0  # 3x: first wait until this many replicas are RUNNING (0: do not wait)


class RampSample(BaseModel):
    model_config = RECORD

    t_s: float  # since the ramp began
    phase: str
    offered: int  # clients in flight the ramp asked for
    running: int  # the LLM deployment's replicas Serve has RUNNING
    starting: int  # ... and still starting (engine loading)
    served: dict[str, int] = {}  # Serve replica id -> requests it handled since it started


class RampWindow(BaseModel):
    model_config = RECORD

    start_s: float
    phase: str
    offered: int
    running: int  # the most RUNNING in the window
    completed: int
    slo_violations: int  # finished requests sent in the window that broke a per-request SLO bound, or failed
    ttft_ms_p95: float | None = None
    served: dict[str, int] = {}  # requests each replica handled in the window (Serve's counter)


class RampPhaseResult(BaseModel):
    model_config = RECORD

    name: str
    concurrency: int
    start_s: float
    end_s: float
    requests: int
    slo_violations: int
    errors: int


class RampResult(ClaimedCores, BaseModel):  # its cores: the LLM replicas' at its end
    model_config = RECORD

    policy: str = "inflight"  # the autoscaling policy deployed (report.autoscale_policy.POLICIES)
    # --ramp-rounds: the round it ran in (1-based; serve.ramp_rounds); None: recorded before rounds, one ramp a policy
    round: int | None = None
    knee_concurrency: int  # requests in flight a replica at the operating load, rounded
    # the 1x phase's clients (one_replica_clients: below target_ongoing_requests); None: recorded before, when 1x
    # was knee_concurrency, which could equal the target and scale up during 1x
    base_concurrency: int | None = None
    autoscaling_config: dict
    max_ongoing_requests: int
    max_queued_requests: int
    reasons: dict[str, str]
    ready_s: float | None = None  # serve.run of the autoscaled config until it was RUNNING
    engines_reused: bool | None = None  # True: it started from the engine the replica count left (prefix cache reset)
    phases: list[RampPhaseResult] = []
    windows: list[RampWindow] = []
    samples: list[RampSample] = []
    replicas_before: int
    replicas_peak: int
    time_to_scale_up_s: float | None = None  # 3x offered -> the extra replicas RUNNING; None: never
    # 3x offered -> Serve started an extra replica (RUNNING or starting): the policy's decision, before the new
    # replica's engine start, which time_to_scale_up_s adds and which no policy shortens; negative: Serve started it
    # during the 1x phase (ramp.decided); None: never
    time_to_decide_s: float | None = None
    new_replicas: list[str] = []  # replica ids that first served during the ramp's 3x phase or later
    new_replica_running_s: float | None = None  # first sample with more replicas RUNNING than before
    new_replica_first_served_s: float | None = None  # first sample with a new replica's count above 0
    traffic_before_ready: bool = False  # a new replica served before Serve had it RUNNING (must not)
    slo_violations: int = 0
    requests: int = 0
    slo_attainment: float | None = None  # share of the ramp's finished requests that met every per-request bound
    replica_seconds: float | None = None  # replicas RUNNING or starting, integrated over the ramp's time


def replica_seconds(samples: Sequence[RampSample], end_s: float) -> float:
    """Replica-seconds the ramp used: each sample's replicas (RUNNING and starting, which hold their
    resources alike) held until the next sample, the last until ``end_s``; nothing before the first sample."""
    ordered = sorted(samples, key=lambda s: s.t_s)
    total = 0.0
    stops = [s.t_s for s in ordered[1:]] + [end_s] if ordered else []
    for s, stop in zip(ordered, stops, strict=True):
        total += (s.running + s.starting) * max(0.0, min(stop, end_s) - s.t_s)
    return total


def slo_attainment(requests: int, slo_violations: int) -> float | None:
    """The share of requests that met the SLO (a failed request broke it); None without a request."""
    return (requests - slo_violations) / requests if requests else None


def decided(
    samples: Sequence[RampSample], up_at: float, running_at: float | None, replicas_before: int
) -> float | None:
    """When Serve started the replica that scaled the ramp up: the first of the unbroken run of samples with more
    replicas RUNNING or starting than before that reaches ``running_at`` (the extra replica RUNNING), which may come
    before ``up_at`` (3x offered: a ramp recorded before the 1x phase was held below Serve's threshold and Serve's
    window settled before it, when the 1x load or the step before's asked for it); without one RUNNING, the first
    such sample from ``up_at`` on."""
    ordered = sorted(samples, key=lambda s: s.t_s)
    if running_at is None:
        return next((s.t_s for s in ordered if s.t_s >= up_at and s.running + s.starting > replicas_before), None)
    k = next(i for i, s in enumerate(ordered) if s.t_s == running_at)
    while k > 0 and ordered[k - 1].running + ordered[k - 1].starting > replicas_before:
        k -= 1
    return ordered[k].t_s


def summarize_ramp(
    samples: Sequence[RampSample], records: Sequence[RequestRecord], record_phase: Sequence[str],
    phases: Sequence[Phase], phase_starts: Mapping[str, float], slo_ms: Mapping[str, float], end_s: float,
    baseline: Mapping[str, int] | None = None,
) -> dict:  # fmt: skip
    """The ramp's phases, windows and scale-up facts, from the samples and the request records
    (times on the ramp's clock; ``record_phase[i]`` is the phase record ``i`` was sent in). ``baseline``:
    Serve's per-replica counter before the ramp (a replica kept from the step before has served already),
    what the first window's counts start from."""

    def broke(r: RequestRecord) -> bool:
        return not meets_request_slo(r, slo_ms) if slo_ms else not r.ok

    finished = [r for r in records if r.end is not None]
    phase_results = []
    names = [p.name for p in phases]
    for i, p in enumerate(phases):
        start = phase_starts.get(p.name)
        if start is None:
            continue
        stop = phase_starts.get(names[i + 1], end_s) if i + 1 < len(names) else end_s
        sent = [r for r, ph in zip(records, record_phase, strict=True) if ph == p.name and r.end is not None]
        phase_results.append(RampPhaseResult(
            name=p.name, concurrency=p.concurrency, start_s=start, end_s=stop, requests=len(sent),
            slo_violations=sum(broke(r) for r in sent), errors=sum(not r.ok for r in sent),
        ))  # fmt: skip
    windows = []
    for k in range(max(1, math.ceil(end_s / WINDOW_S))):
        lo, hi = k * WINDOW_S, (k + 1) * WINDOW_S
        inside = [s for s in samples if lo <= s.t_s < hi]
        sent = [r for r in finished if lo <= r.sent < hi]
        ttfts = sorted(r.ttft_s * 1000.0 for r in sent if r.ok and r.ttft_s is not None)
        before = max((s for s in samples if s.t_s < lo), key=lambda s: s.t_s, default=None)
        last = inside[-1] if inside else before
        served = {}
        if last is not None:
            base = before.served if before is not None else (baseline or {})
            served = {rid: n - base.get(rid, 0) for rid, n in last.served.items() if n - base.get(rid, 0) > 0}
        seen = inside or ([before] if before is not None else [])  # a window without a sample keeps the last one
        windows.append(RampWindow(
            start_s=lo, phase=seen[0].phase if seen else "",
            offered=max((s.offered for s in seen), default=0), running=max((s.running for s in seen), default=0),
            completed=len(sent), slo_violations=sum(broke(r) for r in sent),
            ttft_ms_p95=ttfts[min(len(ttfts) - 1, math.ceil(0.95 * len(ttfts)) - 1)] if ttfts else None, served=served,
        ))  # fmt: skip
    up = next((p for p in phases if p.wait_for_replicas), None)
    up_at = phase_starts.get(up.name) if up is not None else None
    before_up = [s for s in samples if up_at is None or s.t_s < up_at]
    replicas_before = max((s.running for s in before_up[-3:]), default=0)
    running_at = decided_at = None
    if up_at is not None:
        running_at = next((s.t_s for s in samples if s.t_s >= up_at and s.running > replicas_before), None)
        decided_at = decided(samples, up_at, running_at, replicas_before)
    known = {rid for s in before_up for rid in s.served}
    new_first = {}
    for s in samples:
        for rid, n in s.served.items():
            if rid not in known and n > 0 and rid not in new_first:
                new_first[rid] = s
    first_served = min((s.t_s for s in new_first.values()), default=None)
    # A new replica seen serving in a sample where Serve did not yet run more replicas than before.
    early = any(s.running <= replicas_before for s in new_first.values())
    broken, sent_total = sum(p.slo_violations for p in phase_results), sum(p.requests for p in phase_results)
    return {
        "phases": phase_results, "windows": windows, "replicas_before": replicas_before,
        "replicas_peak": max((s.running for s in samples), default=0),
        "time_to_scale_up_s": None if running_at is None or up_at is None else running_at - up_at,
        "time_to_decide_s": None if decided_at is None or up_at is None else decided_at - up_at,
        "new_replicas": sorted(new_first), "new_replica_running_s": running_at,
        "new_replica_first_served_s": first_served, "traffic_before_ready": early,
        "slo_violations": broken, "requests": sent_total, "slo_attainment": slo_attainment(sent_total, broken),
        "replica_seconds": replica_seconds(samples, end_s),
    }  # fmt: skip


def one_replica_clients(target_ongoing_requests: int) -> int | None:
    """The ramp's 1x: the most clients in flight one replica holds below Serve's scale-up threshold. Serve's
    in-flight policy asks for ceil(in flight / target) replicas (``upscaling_factor`` 1), in flight averaged over its
    window, so a closed loop of ``target`` clients sits on the threshold and any count a fraction of a request above
    it scales out (Serve's log read 6.16 of a target of 6 in a ramp at 6 clients, and scaled out during 1x). One
    client below the target leaves a whole request of margin. None for a target of 1: no whole number of clients
    stays below it."""
    return target_ongoing_requests - 1 if target_ongoing_requests >= 2 else None


def settle_s(look_back_period_s: float, metrics_push_s: float) -> float:
    """Seconds with no client before the ramp's 1x, so Serve's averaging window (``look_back_period_s``, its
    load pushed every ``metrics_push_s``) no longer holds the step before's load: the replica count measured the
    study's levels, above the 1x, on the engine the ramp starts from."""
    return look_back_period_s + metrics_push_s


def ramp_phases(clients: int, max_replicas: int, hold_s: float, target: int | None = None) -> list[Phase]:
    """1x ``clients``, 3x, back to 1x; the 3x waits for the replicas Serve's in-flight rule asks for at 3x,
    ceil(3 x clients / ``target``) (all ``max_replicas`` without a target), at most ``max_replicas``."""
    asked = max_replicas if target is None else min(max_replicas, math.ceil(3 * clients / target))
    return [
        Phase("1x", clients, hold_s),
        Phase("3x", 3 * clients, hold_s, wait_for_replicas=asked if asked > 1 else 0),
        Phase("back to 1x", clients, hold_s),
    ]


class _RampState(TypedDict):
    phase: str  # the phase running now
    offered: int  # the clients it asks for
    over: bool  # the clients stop


async def run_ramp(
    watch: ScaleWatch, name: str, url: str, served_model: str, workload: Workload, prompts: PromptFactory,
    phases: Sequence[Phase], slo_ms: Mapping[str, float], request_timeout_s: float, scale_up_timeout_s: float,
    on_phase: Callable[[str, float], None] | None = None, settle: float = 0.0,
) -> tuple[dict, list[RampSample], list[RequestRecord], list[str]]:  # fmt: skip
    """Drive the phases as a closed loop whose number of clients follows the phase, after ``settle`` seconds with
    no client (:func:`settle_s`, not part of the ramp's clock); returns the summary (:func:`summarize_ramp`), the
    samples, every request's record and its phase."""
    records: list[RequestRecord] = []
    record_phase: list[str] = []
    samples: list[RampSample] = []
    starts: dict[str, float] = {}
    state: _RampState = {"phase": phases[0].name, "offered": 0, "over": False}
    specs = iter_requests(workload, prompts, stream=7)  # a stream no study level used
    await asyncio.sleep(settle)
    baseline = await asyncio.to_thread(watch.served_per_replica, name)  # a kept replica has served already
    t0 = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - t0

    async with StreamingClient(url, served_model, timeout_s=request_timeout_s) as client:

        async def worker(k: int) -> None:
            while not state["over"]:
                if k >= state["offered"]:
                    await asyncio.sleep(0.05)
                    continue
                spec = next(specs)
                record = RequestRecord(index=len(records), sent=0.0, input_tokens=spec.input_tokens,
                                       max_tokens=spec.output_tokens, request_class=spec.request_class)  # fmt: skip
                records.append(record)
                record_phase.append(state["phase"])
                await client.send(spec, record, t0)

        async def sampler() -> None:
            while not state["over"]:
                # What each replica served first, its state after: a replica seen serving was RUNNING before that
                # read, so the state read next shows it RUNNING. Read the other way round (or side by side), a
                # replica that started and took its first request between the two reads counted as traffic
                # before it was ready: a race a busy host's slow reads widen, not Serve's routing.
                served = await asyncio.to_thread(watch.served_per_replica, name)
                states = await asyncio.to_thread(watch.replica_states, name)
                samples.append(RampSample(
                    t_s=now(), phase=state["phase"], offered=state["offered"], running=states.get("RUNNING", 0),
                    starting=sum(states.get(k, 0) for k in ("STARTING", "UPDATING", "RECOVERING")), served=served,
                ))  # fmt: skip
                await asyncio.sleep(SAMPLE_S)

        most = max(p.concurrency for p in phases)
        workers = [asyncio.ensure_future(worker(k)) for k in range(most)]
        sampling = asyncio.ensure_future(sampler())
        try:
            for phase in phases:
                starts[phase.name] = now()
                state.update({"phase": phase.name, "offered": phase.concurrency})
                if on_phase is not None:
                    on_phase(phase.name, starts[phase.name])
                if phase.wait_for_replicas:
                    deadline = time.perf_counter() + scale_up_timeout_s
                    while time.perf_counter() < deadline and not (
                        samples and samples[-1].running >= phase.wait_for_replicas
                    ):
                        await asyncio.sleep(SAMPLE_S / 2)
                await asyncio.sleep(phase.hold_s)
        finally:
            state["over"] = True  # clients finish their request in flight, then stop
            end = now()
            await asyncio.gather(*workers, return_exceptions=True)
            await sampling
    summary = summarize_ramp(samples, records, record_phase, phases, starts, slo_ms, end, baseline)
    return summary, samples, records, record_phase
