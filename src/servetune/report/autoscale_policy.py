"""The predictive autoscaling policy: Serve scales on what comes before an SLO breach, not only on
requests in flight (issue #42 item 3, checklist section 11).

The installed Ray Serve (2.60) runs a custom policy in its controller: ``AutoscalingConfig.policy``
= ``{"policy_function": "module:Class", "policy_kwargs": {...}}``; a class is built once with the
kwargs and called with Serve's ``AutoscalingContext`` every control loop; it returns the replicas
wanted and Serve applies min/max_replicas, the upscale/downscale delays and the scaling factors
around it. A replica can add its own numbers with a ``record_autoscaling_stats`` method (Serve
averages them per replica over ``look_back_period_s``: ``ctx.aggregated_metrics``).

The rule (:func:`predictive_replicas`, pure): the most replicas any of these asks for

- in flight: ceil(requests in flight / ``target_ongoing_requests``), the in-flight policy's own rule,
  so the predictive one never runs fewer replicas than it;
- queue wait: ceil(requests waiting / ``waiting_per_replica``). Waiting is Serve's queue (requests
  its handles hold because every replica has ``max_ongoing_requests``) plus the engines'
  ``num_requests_waiting`` where a replica records it. ``waiting_per_replica`` is what a replica
  drains within the TTFT the SLO leaves above the knee's measured TTFT
  (:func:`predictive_thresholds`);
- KV usage: ceil(replicas x peak KV usage / ``kv_usage_limit``) where a replica records
  ``kv_cache_usage``: above section 11's 85%, the engine preempts next.

The signals and thresholds are one list (:func:`scaling_signals`): the Kubernetes export's KEDA triggers and
HPA metrics are built from the same list, and an HPA too runs the most replicas any of its metrics asks for.

No Ray import here: the tests call the policy with a plain context.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

# The custom metrics a replica may record (``record_autoscaling_stats``) that the policy reads: defined in
# servetune.metrics, which a replica imports without report/.
from servetune.metrics import KV_METRIC, WAITING_METRIC

#: Where Serve's controller imports the policy from (servetune must be installed on the cluster).
POLICY_FUNCTION = "servetune.report.autoscale_policy:PredictivePolicy"
#: The policies ``export --autoscaling-policy`` and ``serve-check --ramp-policy`` know.
POLICIES = ("inflight", "predictive")


@dataclass(frozen=True)
class PredictiveThresholds:
    """The predictive policy's thresholds (its ``policy_kwargs``)."""

    target_ongoing_requests: float  # requests in flight per replica at the operating load
    waiting_per_replica: float  # requests waiting per replica above which TTFT is predicted to break the SLO
    kv_usage_limit: float  # KV-cache usage (0..1) above which the engine is predicted to preempt

    def policy_kwargs(self) -> dict[str, float]:
        return asdict(self)


def wait_left(tolerable_wait_s: float, wait_why: str, ttft_ms: float | None, bounded: bool = True) -> tuple[float, str]:
    """The wait a request may still spend queued, in seconds, and why: the tolerable wait (the SLO's TTFT bound)
    less the TTFT measured at the operating load (``ttft_ms``, at the bound's percentile), which a request leaving
    the queue still takes to its first token; a tenth of the tolerable wait where the measured TTFT spends it all
    (any queue breaks the bound), the whole of it where no TTFT was recorded. The predictive policy's
    ``waiting_per_replica``, Serve's ``max_queued_requests`` (autoscale.py) and vLLM's admission bounds
    (admission.py) are sized on it. ``bounded``: the SLO bounds a TTFT (else the wait is a queue wait, nothing to
    take a TTFT off)."""
    if ttft_ms is None or not bounded:
        return tolerable_wait_s, wait_why if not bounded else f"{wait_why} (the TTFT there was not recorded)"
    left_s = tolerable_wait_s - ttft_ms / 1000.0
    if left_s <= 0:
        left_s = tolerable_wait_s * 0.1
        return left_s, (f"the measured TTFT {ttft_ms:g} ms leaves nothing of {wait_why}, "
                        f"so a tenth of it ({left_s * 1000:g} ms)")  # fmt: skip
    return left_s, f"{wait_why} less the measured TTFT {ttft_ms:g} ms = {left_s * 1000:g} ms"


def predictive_thresholds(
    target_ongoing_requests: int, throughput_per_replica: float, tolerable_wait_s: float, wait_why: str,
    ttft_ms_at_knee: float | None, kv_usage_limit: float,
) -> tuple[PredictiveThresholds, dict[str, str]]:  # fmt: skip
    """The thresholds from the study's operating point, and each one's origin as a sentence.

    The wait a request may still spend queued is the tolerable wait (the SLO's TTFT bound) less the TTFT
    measured at the knee (the prefill and first token it takes anyway); a replica serving
    ``throughput_per_replica`` req/s drains throughput x that wait requests within it, so more waiting than
    that predicts a TTFT above the bound."""
    left_s, left_why = wait_left(tolerable_wait_s, wait_why, ttft_ms_at_knee)
    waiting = max(1.0, math.floor(throughput_per_replica * left_s + 1e-9))
    thresholds = PredictiveThresholds(float(target_ongoing_requests), float(waiting), kv_usage_limit)
    reasons = {
        "policy": (f"{POLICY_FUNCTION}: the most replicas asked for by requests in flight (target "
                   f"{target_ongoing_requests}), by requests waiting and by KV-cache usage; Serve applies the "
                   "bounds and delays below around it (servetune must be installed where Serve's controller runs)"),
        "waiting_per_replica": (f"{waiting:g}: {throughput_per_replica:.2f} req/s per replica x the queue wait the "
                                f"SLO leaves, {left_why}; more waiting predicts a TTFT breach"),
        "kv_usage_limit": (f"{kv_usage_limit:.0%}: section 11, above it the engine preempts; the fullest engine's "
                           f"usage (on Serve, where a replica records {KV_METRIC})"),
    }  # fmt: skip
    return thresholds, reasons


@dataclass(frozen=True)
class ScalingSignal:
    """One signal an autoscaler scales on, with its threshold: Serve's predictive policy and the Kubernetes
    export (KEDA's triggers, the HPA's metrics) are built from the same list (:func:`scaling_signals`).

    A ``per_replica`` signal is a total over the replicas and asks for ceil(total / threshold) replicas
    (an HPA's ``AverageValue`` target); the other is a share of one engine's capacity, its fullest
    replica's, and asks for ceil(replicas x value / threshold) (an HPA's ``Value`` target)."""

    name: str  # in the user's words: "in flight", "queue wait", "KV usage"
    key: str  # the threshold's field of PredictiveThresholds (and of the derivation's reasons)
    gauges: tuple[str, ...]  # the engine gauges (engine/metrics.py GAUGES) summed per engine to give it
    threshold: float
    per_replica: bool

    def replicas(self, value: float, current: int) -> int:
        """The replicas this signal asks for at ``value`` with ``current`` replicas running."""
        load = value if self.per_replica else current * value
        return max(0, math.ceil(load / self.threshold - 1e-9))


def scaling_signals(thresholds: PredictiveThresholds, predictive: bool = True) -> tuple[ScalingSignal, ...]:
    """The signals and thresholds to scale on: requests in flight (running + waiting) at the in-flight target,
    and with ``predictive`` also requests waiting (queue wait) and the fullest engine's KV-cache usage."""
    in_flight = ScalingSignal(
        "in flight", "target_ongoing_requests", ("requests_running", "requests_waiting"),
        thresholds.target_ongoing_requests, per_replica=True,
    )  # fmt: skip
    if not predictive:
        return (in_flight,)
    return (
        in_flight,
        ScalingSignal("queue wait", "waiting_per_replica", ("requests_waiting",), thresholds.waiting_per_replica, True),
        ScalingSignal("KV usage", "kv_usage_limit", ("kv_cache_usage",), thresholds.kv_usage_limit, per_replica=False),
    )


def predictive_replicas(
    current: int, in_flight: float, waiting: float, kv_usage: float | None, thresholds: PredictiveThresholds
) -> tuple[int, str]:
    """The replicas the predictive rule wants (before Serve's bounds and delays), and which signal set it."""
    values = {"in flight": in_flight, "queue wait": waiting, "KV usage": kv_usage}
    asks = {
        s.name: s.replicas(value, current)
        for s in scaling_signals(thresholds)
        if (value := values[s.name]) is not None and (s.per_replica or current > 0)
    }
    signal = max(asks, key=asks.__getitem__)
    return asks[signal], signal


def _per_replica(metrics: Mapping[str, Mapping[Any, float]] | None, name: str) -> list[float]:
    return [float(v) for v in ((metrics or {}).get(name) or {}).values()]


class PredictivePolicy:
    """Serve's custom autoscaling policy (``AutoscalingPolicy(policy_function=POLICY_FUNCTION,
    policy_kwargs=thresholds.policy_kwargs())``): called with Serve's ``AutoscalingContext``."""

    def __init__(self, **kwargs: float) -> None:
        self.thresholds = PredictiveThresholds(**kwargs)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        custom = ctx.aggregated_metrics
        queued = float(ctx.total_queued_requests or 0.0)
        waiting = queued + sum(_per_replica(custom, WAITING_METRIC))
        kv = _per_replica(custom, KV_METRIC)
        wanted, signal = predictive_replicas(
            ctx.current_num_replicas,
            float(ctx.total_num_requests or 0.0),
            waiting,
            max(kv) if kv else None,
            self.thresholds,
        )
        return wanted, {"servetune_signal": signal, "servetune_waiting": waiting}
