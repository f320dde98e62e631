"""Ray Serve autoscaling derived from what the study measured (checklist sections 10 and 11).

The rule, one field at a time (``Autoscaling.reasons`` carries each as a sentence for the
exported file):

- **knee** (the operating load): with a ``headroom`` (``export --headroom``, default 0.8), headroom x
  min(capacity, knee): the capacity at the SLO (results.py ``Capacity``, else the highest level that
  met every SLO bound) and the knee where throughput stopped growing with load (results.py
  ``find_knee``), whichever is lower, so a replica runs short of both. Its throughput is the measured
  level's at or below it (the highest such level meeting the SLO, else the lowest meeting it), scaled
  by load: below the knee throughput grows with load, which is what the knee means. Without a
  ``headroom`` (serve-check's ramp, unchanged), the highest load level of the trial that met every
  SLO bound. Either way per replica (a trial with data parallelism DP, or run through Serve at
  ``serve.num_replicas`` N, measured DP or N replicas at once, so its level and throughput are
  divided by them). Without a level that met the SLO there is nothing safe to scale on, and the
  derivation refuses.
- ``target_ongoing_requests`` = the knee's requests in flight per replica (its concurrency; for
  an open-loop level, Little's law: request throughput x mean E2E latency). Serve adds replicas
  when the requests in flight per replica stay above it, so a replica is kept at load it was
  measured to serve within the SLO.
- ``max_ongoing_requests`` = ceil(1.25 x target): Serve's guidance (20-50% above the target) so
  the autoscaler sees load above the target while the excess waits in Serve's queue, not in the
  engine's, where no one bounds it.
- ``min_replicas`` = 1 (a replica starts in minutes: scaling to zero trades every first request
  for a cold start); ``max_replicas`` = ceil(peak / knee), the peak being what the user states or
  else the top of the study's ladder.
- ``max_queued_requests`` (section 10: a queue has a hard cap) = ceil(arrival rate x tolerable
  wait): the rate all ``max_replicas`` serve at the knee, and the tolerable wait the SLO's TTFT
  bound (its P99, else the tightest TTFT bound; without one, section 11's 300 ms queue wait).
  Requests beyond it get 503 at once rather than a wait longer than the SLO.
- delays (section 11): scale up when queue wait has stayed high for 2 minutes
  (``upscale_delay_s`` 120), down after 10 minutes of low load (``downscale_delay_s`` 600),
  the load averaged over Serve's 30 s window (``look_back_period_s``). ``delay_scale`` shrinks all
  three for a quick check (serve-check's ramp on the CPU stand-in), the window no shorter than 1.5 x Serve's 10 s
  metrics push; exported files keep them.

Section 11's other triggers (queue wait, KV-cache usage above 85%, never GPU utilization alone) are
not expressible in Serve's request-based policy; the knee's measured KV usage is stated beside it.
``with_policy("predictive")`` swaps in the custom policy of :mod:`servetune.report.autoscale_policy`,
which scales on requests waiting and KV usage as well, its thresholds derived here too.
:meth:`Autoscaling.scaling_signals` lists the signals and thresholds of the chosen policy: Serve's policy
evaluates that list, and the Kubernetes and KServe exports (:mod:`servetune.report.deploy`) turn it into
their autoscalers' Prometheus metrics.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from servetune.config.space import SERVE_REPLICAS
from servetune.errors import UserError
from servetune.metrics import REQUEST_THROUGHPUT
from servetune.report.autoscale_policy import (
    POLICIES,
    POLICY_FUNCTION,
    PredictiveThresholds,
    ScalingSignal,
    predictive_thresholds,
    scaling_signals,
    wait_left,
)
from servetune.report.points import KV_CACHE_USAGE_MAX, ReportPoint, level_label
from servetune.results import Capacity, Knee

#: Section 11: scale up after the queue wait stayed high for 2 minutes; down after 10-20 minutes low.
UPSCALE_DELAY_S = 120.0
DOWNSCALE_DELAY_S = 600.0
#: Serve's default window over which requests in flight are averaged.
LOOK_BACK_PERIOD_S = 30.0
#: How often Serve's replicas and handles push the load its autoscaler averages (Ray Serve 2.60's metrics_interval_s
#: and its RAY_SERVE_*_AUTOSCALING_METRIC_PUSH_INTERVAL_S, 10 s). Serve warns that look_back_period_s must be above
#: it (an error in a later release), so ``delay_scale`` never shrinks the window below 1.5 pushes: section 11's 30 s
#: x 0.05 gave 1.5 s, and a replica then also recorded its load every 0.3 s (0.2 x the window).
SERVE_METRICS_PUSH_S = 10.0
#: Section 11's queue-wait threshold: the tolerable wait when the SLO bounds no TTFT.
QUEUE_WAIT_S = 0.3
#: Serve's guidance: max_ongoing_requests 20-50% above target_ongoing_requests.
ONGOING_HEADROOM = 1.25
#: Section 11: scale up beyond this KV-cache usage.
KV_USAGE_LIMIT = 0.85


@dataclass(frozen=True)
class Autoscaling:
    """Serve's settings for one configuration, and why each has its value."""

    knee: Mapping[str, float]  # the trial's operating load it rests on, as a level (whole trial, all DP ranks)
    knee_per_replica: float  # that level's value per replica (concurrency, or rate)
    in_flight_per_replica: float  # requests in flight per replica at the knee
    throughput_per_replica: float  # req/s per replica at the knee
    peak: float  # in the level's unit (concurrency or rate), for the whole deployment
    peak_source: str
    min_replicas: int
    max_replicas: int
    target_ongoing_requests: int
    max_ongoing_requests: int
    max_queued_requests: int
    tolerable_wait_s: float
    upscale_delay_s: float
    downscale_delay_s: float
    look_back_period_s: float
    kv_cache_usage_at_knee: float | None = None
    reasons: dict[str, str] = field(default_factory=dict)
    policy: str = "inflight"  # Serve's request-based policy; "predictive": autoscale_policy.PredictivePolicy
    predictive: PredictiveThresholds | None = None  # the predictive policy's thresholds, derived beside
    predictive_reasons: dict[str, str] = field(default_factory=dict)
    study: str = ""  # the study the trial belongs to, where known (export's objects name it)

    def scaling_signals(self) -> tuple[ScalingSignal, ...]:
        """What an autoscaler scales on under this policy, and at which thresholds (the Kubernetes export's
        triggers; Serve's predictive policy evaluates the same list)."""
        thresholds = self.predictive or PredictiveThresholds(float(self.target_ongoing_requests), 1.0, KV_USAGE_LIMIT)
        return scaling_signals(thresholds, predictive=self.policy == "predictive" and self.predictive is not None)

    def signal_reason(self, signal: ScalingSignal) -> str:
        """Where ``signal``'s threshold came from, as a sentence."""
        return self.predictive_reasons.get(signal.key) or self.reasons[signal.key]

    def autoscaling_config(self) -> dict[str, Any]:
        """Serve's ``autoscaling_config`` (ray.serve.config.AutoscalingConfig fields)."""
        return {
            "min_replicas": self.min_replicas, "initial_replicas": self.min_replicas, "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests, "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s, "look_back_period_s": self.look_back_period_s,
            "upscaling_factor": 1.0,
        } | ({"policy": {"policy_function": POLICY_FUNCTION, "policy_kwargs": self.predictive.policy_kwargs()}}
             if self.policy == "predictive" and self.predictive is not None else {})  # fmt: skip

    def deployment_config(self) -> dict[str, Any]:
        """The LLM deployment's ``deployment_config``: autoscaling plus the per-replica and queue caps."""
        return {
            "autoscaling_config": self.autoscaling_config(),
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
        }

    def with_policy(self, policy: str) -> Autoscaling:
        """The same settings scaled by ``policy``: "inflight" (Serve's own) or "predictive" (its reasons added)."""
        if policy not in POLICIES:
            raise UserError(f"autoscaling policy {policy!r}: choose one of {', '.join(POLICIES)}")
        if policy == self.policy:
            return self
        reasons = {k: v for k, v in self.reasons.items() if k not in self.predictive_reasons}
        if policy == "predictive":
            reasons |= self.predictive_reasons
        return dataclasses.replace(self, policy=policy, reasons=reasons)

    def with_max_replicas(self, cap: int, why: str) -> Autoscaling:
        """The same settings with at most ``cap`` replicas (what a smaller cluster holds)."""
        if cap >= self.max_replicas:
            return self
        reasons = {**self.reasons, "max_replicas": f"{self.reasons['max_replicas']}; capped at {cap}: {why}"}
        return dataclasses.replace(self, max_replicas=max(cap, self.min_replicas), reasons=reasons)


def _level_value(level: Mapping[str, float]) -> tuple[str, float] | None:
    for kind in ("concurrency", "rate"):
        if level.get(kind):
            return kind, float(level[kind])
    return None


def ttft_bound(slo_lines: Sequence[str]) -> tuple[str, float] | None:
    """The TTFT bound a queue wait is sized on, (metric, ms): the SLO's TTFT P99 bound, else its tightest TTFT
    bound; None when the SLO bounds no TTFT."""
    ttft: dict[str, float] = {}
    for line in slo_lines:
        name, _, bound = str(line).partition(" <= ")
        if name.startswith("ttft_ms_"):
            ttft[name] = float(bound)
    if "ttft_ms_p99" in ttft:
        return "ttft_ms_p99", ttft["ttft_ms_p99"]
    if ttft:
        name = min(ttft, key=ttft.__getitem__)
        return name, ttft[name]
    return None


def bound_ttft_ms(
    slo_lines: Sequence[str], metrics: Mapping[str, Any]
) -> tuple[tuple[str, float] | None, float | None]:
    """The TTFT bound a queue wait is sized on (:func:`ttft_bound`) and the TTFT ``metrics`` measured at its
    percentile, in ms (None: the SLO bounds no TTFT, or the level did not record it)."""
    bound = ttft_bound(slo_lines)
    measured = metrics.get(bound[0]) if bound is not None else None
    return bound, None if measured is None else float(measured)


def tolerable_wait_s(slo_lines: Sequence[str]) -> tuple[float, str]:
    """The longest a request may wait in Serve's queue: the SLO's TTFT P99 bound, else its tightest
    TTFT bound (:func:`ttft_bound`), else section 11's 300 ms queue wait."""
    bound = ttft_bound(slo_lines)
    if bound is None:
        return QUEUE_WAIT_S, "section 11's 300 ms queue wait (the SLO bounds no TTFT)"
    name, ms = bound
    return ms / 1000.0, f"the SLO's {name} bound ({ms:g} ms)"


def interpolated_rate(points: Sequence[tuple[float, float]], load: float) -> float:
    """Request throughput at ``load``, linear between the measured (load, throughput) points and from (0, 0)
    below the lowest; beyond the highest, that one's throughput per unit of load."""
    ordered = [(0.0, 0.0), *sorted(points)]
    for (x1, t1), (x2, t2) in itertools.pairwise(ordered):
        if x1 <= load <= x2:
            return t1 + (t2 - t1) * (load - x1) / (x2 - x1) if x2 > x1 else t2
    top, throughput = ordered[-1]
    return throughput * load / top if top > 0 else 0.0


def operating_load(
    meeting: Sequence[float], capacity: Capacity | None, knee: Knee | None, headroom: float
) -> tuple[float, str]:
    """headroom x min(capacity, knee), and how it was found (see the module's rule): the capacity the search
    found, else the highest of the ``meeting`` loads (those that met the SLO)."""
    if not 0 < headroom <= 1:
        raise UserError(f"--headroom {headroom:g}: the headroom must be above 0 and at most 1")
    limits = {"the highest load meeting the SLO": max(meeting)}
    if capacity is not None and capacity.value is not None:
        limits = {"the capacity at the SLO": capacity.value}
    if knee is not None:
        limits["the knee" + (" (a lower bound: throughput still grew)" if knee.bound == "lower" else "")] = knee.value
    name = min(limits, key=limits.__getitem__)
    others = ", ".join(f"{other} {value:g}" for other, value in limits.items() if other != name)
    return headroom * limits[name], f"{headroom:g} x {name} {limits[name]:g}" + (f" (below {others})" if others else "")


def derive_autoscaling(
    trial_points: Sequence[ReportPoint], slo_lines: Sequence[str], peak: float | None = None,
    delay_scale: float = 1.0, *, headroom: float | None = None, capacity: Capacity | None = None,
    knee: Knee | None = None,
) -> Autoscaling:  # fmt: skip
    """Serve's autoscaling for one trial, from its measured levels (see the module's rule): with a ``headroom``,
    at headroom x min(``capacity``, ``knee``); without, at the highest level meeting the SLO."""
    if not trial_points:
        raise UserError("autoscaling: the trial measured no load level")
    trial_id = trial_points[0].trial_id
    measured = [(p, _level_value(p.level)) for p in trial_points]
    meeting = [(p, lv) for p, lv in measured if p.meets_slo and lv is not None]
    if not meeting:
        raise UserError(f"autoscaling: trial {trial_id} met the SLO at no load level, so it has no knee to scale on")
    if headroom is None:
        base, (kind, value) = max(meeting, key=lambda m: m[1][1])
        rate_scale, operating_why = 1.0, ""
    else:
        value, operating_why = operating_load([lv[1] for _, lv in meeting], capacity, knee, headroom)
        above = [m for m in meeting if m[1][1] >= value]
        base, (kind, _) = min(above, key=lambda m: m[1][1]) if above else max(meeting, key=lambda m: m[1][1])
        rate = interpolated_rate([(lv[1], float(p.metrics.get(REQUEST_THROUGHPUT) or 0.0)) for p, lv in meeting], value)
        base_rate = float(base.metrics.get(REQUEST_THROUGHPUT) or 0.0)
        rate_scale = rate / base_rate if base_rate > 0 else 0.0
        operating_why += (
            f", its throughput interpolated between the levels measured, latency as at {level_label(base.level)}"
        )
    engine = {**base.resolved_engine_args, **{k: v for k, v in base.engine_args.items() if v is not None}}
    expert_parallel = bool(engine.get("enable_expert_parallel"))
    dp = 1 if expert_parallel else max(1, int(engine.get("data_parallel_size") or 1))
    dp = int(base.params.get(SERVE_REPLICAS) or dp)  # measured through Serve: spread over its replicas
    throughput = rate_scale * float(base.metrics.get(REQUEST_THROUGHPUT) or 0.0) / dp
    per_replica = value / dp
    if kind == "concurrency":
        in_flight = per_replica
        in_flight_why = f"its {value:g} clients in flight"
    else:
        e2el_s = float(base.metrics.get("e2el_ms_mean") or 0.0) / 1000.0
        in_flight = throughput * e2el_s
        in_flight_why = f"Little's law: {throughput * dp:.2f} req/s x {e2el_s:.2f} s mean E2E latency"
    per = f" / {dp} {'Serve' if base.params.get(SERVE_REPLICAS) else 'data-parallel'} replicas" if dp > 1 else ""
    top = max((lv[1] for _, lv in measured if lv is not None and lv[0] == kind), default=value)
    if peak is None:
        peak, peak_source = top, f"the top of the study's ladder ({kind} {top:g})"
    else:
        if peak <= 0:
            raise UserError(f"--peak {peak:g}: the peak load must be above 0")
        peak_source = f"the stated peak ({kind} {peak:g})"
    target = max(1, math.floor(in_flight))
    max_replicas = max(1, math.ceil(peak / per_replica - 1e-9))
    wait_s, wait_why = tolerable_wait_s(slo_lines)
    bound, ttft_ms = bound_ttft_ms(slo_lines, base.metrics)  # the TTFT a request takes anyway once it leaves a queue
    left_s, left_why = wait_left(wait_s, wait_why, ttft_ms, bounded=bound is not None)
    queue = max(1, math.ceil(max_replicas * throughput * left_s - 1e-9))
    max_ongoing = max(target + 1, math.ceil(ONGOING_HEADROOM * target))
    kv = base.server_metrics.get(KV_CACHE_USAGE_MAX)
    scale = f" (section 11's value x {delay_scale:g} for a quick check)" if delay_scale != 1.0 else ""
    look_back = max(LOOK_BACK_PERIOD_S * delay_scale, 1.5 * SERVE_METRICS_PUSH_S)
    look_back_why = (f"{look_back:g}: Serve's window for averaging the load"
                     + (scale if look_back == LOOK_BACK_PERIOD_S * delay_scale else
                        f" (30 s x {delay_scale:g} = {LOOK_BACK_PERIOD_S * delay_scale:g} s for a quick check, raised to "
                        f"1.5 x Serve's {SERVE_METRICS_PUSH_S:g} s metrics push: Serve needs the window above it)"))  # fmt: skip
    predictive, predictive_reasons = predictive_thresholds(
        target, throughput, wait_s, wait_why, ttft_ms, KV_USAGE_LIMIT
    )
    reasons = {
        "knee": (f"trial {trial_id}'s highest level meeting every SLO bound: {level_label(base.level)}{per}, "
                 f"{throughput:.2f} req/s per replica" if headroom is None else
                 f"trial {trial_id}'s operating load: {kind} {value:g}{per} ({operating_why}), "
                 f"{throughput:.2f} req/s per replica"),
        "target_ongoing_requests": (f"{target}: requests in flight per replica at the knee ({in_flight_why}{per}); "
                                    "above it the autoscaler adds replicas"),
        "max_ongoing_requests": (f"{max_ongoing}: ceil({ONGOING_HEADROOM:g} x target), Serve's 20-50% headroom; "
                                 "the rest waits in Serve's bounded queue, not in vLLM's unbounded one"),
        "min_replicas": "1: a replica starts in minutes, so one stays warm (no scale to zero)",
        "max_replicas": f"{max_replicas}: ceil(peak {peak:g} / knee {per_replica:g} per replica), the peak being {peak_source}",
        "max_queued_requests": (f"{queue}: {max_replicas} replicas x {throughput:.2f} req/s x {left_s:g} s of queue wait "
                                f"({left_why}); section 10's hard queue cap, 503 beyond it"),
        "upscale_delay_s": f"{UPSCALE_DELAY_S * delay_scale:g}: section 11, load above target for 2 minutes{scale}",
        "downscale_delay_s": f"{DOWNSCALE_DELAY_S * delay_scale:g}: section 11, 10 minutes of low load before scaling down{scale}",
        "look_back_period_s": look_back_why,
        "upscaling_factor": "1.0: straight to the replicas the load needs (each takes minutes to warm up)",
        "kv_cache": (f"KV-cache usage peaked at {kv:.1%} at the knee"
                     + (f", above section 11's {KV_USAGE_LIMIT:.0%}: lower target_ongoing_requests" if kv > KV_USAGE_LIMIT
                        else f", under section 11's {KV_USAGE_LIMIT:.0%}")
                     if kv is not None else "KV-cache usage at the knee was not recorded")
                    + "; Serve scales on requests in flight, not on KV usage or GPU utilization",
    }  # fmt: skip
    return Autoscaling(
        knee=dict(base.level) if headroom is None else {kind: value}, knee_per_replica=per_replica, in_flight_per_replica=in_flight,
        throughput_per_replica=throughput, peak=float(peak), peak_source=peak_source, min_replicas=1,
        max_replicas=max_replicas, target_ongoing_requests=target, max_ongoing_requests=max_ongoing,
        max_queued_requests=queue, tolerable_wait_s=wait_s, upscale_delay_s=UPSCALE_DELAY_S * delay_scale,
        downscale_delay_s=DOWNSCALE_DELAY_S * delay_scale, look_back_period_s=look_back,
        kv_cache_usage_at_knee=kv, reasons=reasons, predictive=predictive, predictive_reasons=predictive_reasons,
    )  # fmt: skip
