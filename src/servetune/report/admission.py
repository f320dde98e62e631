"""vLLM's admission bounds sized from what a trial measured: ``--max-num-queued-reqs`` and
``--max-num-queued-tokens`` (vLLM 0.32, ``vllm/config/scheduler.py``). Past either, vLLM's API server
answers 503 at once (``AsyncLLM.check_admission``) instead of letting its waiting queue, which
nothing else bounds, grow until every request breaks the TTFT bound (checklist item 15.15).

The rule, for the level measured at the trial's capacity at the SLO (else its highest level that met
the SLO), at request throughput ``X`` req/s, prompt-token throughput ``P`` tok/s, with ``N`` requests in
flight (its clients; for an open loop, Little's law ``X`` x mean E2E latency), and the SLO's TTFT bound
``W`` seconds (its P99, else its tightest TTFT bound, else section 11's 300 ms: autoscale.py
``tolerable_wait_s``):

- **the wait left** ``L = W - T``, ``T`` the TTFT the level measured at the bound's percentile (its
  ``ttft_ms_p99`` for a P99 bound): a request admitted behind the queue still takes its own ``T`` once it
  leaves the queue (the engine carrying ``N`` within the SLO took that long), so only ``L`` of the bound is
  left for queueing (``autoscale_policy.wait_left``, which Serve's queue cap and the predictive policy's
  ``waiting_per_replica`` are sized on too). ``L = W`` where the wait is not a TTFT bound (section 11's queue
  wait) or the level recorded no such TTFT; ``L = W / 10`` where ``T`` spends the whole bound.
- **queue depth** ``Q = ceil(X x L)`` (at least 1): an open loop served at ``X`` req/s drains a waiting
  queue of ``Q`` requests in ``Q / X`` seconds, so the last request admitted starts within ``L`` and has its
  first token within ``T + L = W``; one more would break the bound. (``ceil(X x W)``, the queue without
  ``T``, let the last admitted request's TTFT reach ``W + T``: past the bound by the TTFT at capacity.)
- ``max_num_queued_reqs = ceil(N) + Q``: vLLM counts waiting and running requests together, so the bound
  is what the engine carried within the SLO plus the queue it can drain in time.
- ``max_num_queued_tokens = ceil(P x L)``: vLLM's own formula (target TTFT x prefill throughput) with the
  wait left as the target, the prefill throughput being the prompt tokens the engine took in at capacity (a
  lower bound of what it can prefill: it was not prefilling all the time).

vLLM counts both across the data-parallel ranks one API server routes to, as the trial measured them,
so nothing is divided by DP here. A trial measured through Serve (``serve.num_replicas`` R) spread its load
over R replicas, each its own vLLM: ``X``, ``P`` and ``N`` are each replica's share, the whole level's over R.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from servetune.config.space import SERVE_REPLICAS
from servetune.errors import UserError
from servetune.metrics import REQUEST_THROUGHPUT
from servetune.report.autoscale import bound_ttft_ms, tolerable_wait_s
from servetune.report.autoscale_policy import wait_left
from servetune.report.points import ReportPoint, level_label

INPUT_THROUGHPUT = "input_throughput"  # prompt tok/s of a level (summary.py LevelSummary)


@dataclass(frozen=True)
class AdmissionBounds:
    """vLLM's two admission bounds for one configuration, and why each has its value."""

    max_num_queued_reqs: int
    max_num_queued_tokens: int | None  # None: the level recorded no prompt-token throughput
    queue_depth: int
    in_flight: float
    request_throughput: float
    wait_s: float
    reasons: dict[str, str]

    def engine_args(self) -> dict[str, int]:
        """The engine arguments, as servetune's engine arguments are spelled."""
        args = {"max_num_queued_reqs": self.max_num_queued_reqs}
        if self.max_num_queued_tokens is not None:
            args["max_num_queued_tokens"] = self.max_num_queued_tokens
        return args


def comment_lines(admission: AdmissionBounds | str | None) -> list[str]:
    """What an exported file says of the bounds, a line each without its comment mark: each bound and why, or why
    there are none (``admission`` as :func:`derive_admission` gave it, or the reason it gave none)."""
    if isinstance(admission, AdmissionBounds):
        return [
            "Admission bounds (503 past them), derived from the trial's measurements:",
            *(f"  {name}: {why}" for name, why in admission.reasons.items()),
        ]
    return [] if admission is None else [f"No admission bounds derived: {admission}"]


def size_admission(
    request_throughput: float, in_flight: float, wait_s: float, input_throughput: float | None = None,
    ttft_s: float = 0.0,
) -> tuple[int, int | None, int]:  # fmt: skip
    """(max_num_queued_reqs, max_num_queued_tokens, queue depth) by the module's rule, ``ttft_s`` being the TTFT
    the level measured (``T``; 0: none to take off the wait)."""
    if request_throughput <= 0 or wait_s <= 0:
        raise UserError("admission bounds: the level served no request, so there is no rate to size a queue on")
    left, _ = wait_left(wait_s, "", ttft_s * 1000.0 if ttft_s else None)  # a tenth of W where T spends it all
    queue = max(1, math.ceil(request_throughput * left - 1e-9))
    tokens = max(1, math.ceil(input_throughput * left - 1e-9)) if input_throughput else None
    return max(1, math.ceil(in_flight - 1e-9)) + queue, tokens, queue


def derive_admission(trial_points: Sequence[ReportPoint], slo_lines: Sequence[str]) -> AdmissionBounds:
    """The bounds of one trial, from its level at capacity (else its highest meeting the SLO)."""
    meeting = [p for p in trial_points if p.meets_slo]
    if not meeting:
        trial = trial_points[0].trial_id if trial_points else "?"
        raise UserError(
            f"admission bounds: trial {trial} met the SLO at no load level, so it has no capacity to size on"
        )
    at = next((p for p in meeting if p.at_capacity), None) or max(meeting, key=lambda p: max(p.level.values()))
    # Measured through Serve, the load was spread over its replicas, each one vLLM whose queue the bounds size
    replicas = max(1, int(at.params.get(SERVE_REPLICAS) or 1))
    per = f" / {replicas} Serve replicas" if replicas > 1 else ""
    rate = float(at.metrics.get(REQUEST_THROUGHPUT) or 0.0) / replicas
    prompt_rate = at.metrics.get(INPUT_THROUGHPUT)
    prompt_rate = prompt_rate / replicas if prompt_rate is not None else None
    if at.level.get("concurrency"):
        in_flight, in_flight_why = (
            float(at.level["concurrency"]) / replicas,
            f"its {at.level['concurrency']:g} clients{per}",
        )
    else:
        e2el_s = float(at.metrics.get("e2el_ms_mean") or 0.0) / 1000.0
        in_flight, in_flight_why = (
            rate * e2el_s,
            f"Little's law: {rate:.2f} req/s{per} x {e2el_s:.2f} s mean E2E latency",
        )
    wait_s, wait_why = tolerable_wait_s(slo_lines)
    bound, ttft_ms = bound_ttft_ms(slo_lines, at.metrics)
    ttft_s = ttft_ms / 1000.0 if ttft_ms is not None else 0.0
    left = f"{wait_s:g} s - {ttft_s:.3f} s {bound[0]} measured there" if ttft_s and bound else f"{wait_s:g} s"
    if bound and ttft_s >= wait_s:  # wait_left's floor: any queue breaks the bound, so a short one
        left = f"a tenth of {wait_s:g} s, the {bound[0]} measured there ({ttft_s:.3f} s) spending it all"
    reqs, tokens, queue = size_admission(rate, in_flight, wait_s, prompt_rate, ttft_s)
    where = f"at {level_label(at.level)}, {'its capacity at the SLO' if at.at_capacity else 'its highest level meeting the SLO'}"
    reasons = {
        "max_num_queued_reqs": (f"{reqs}: {math.ceil(in_flight - 1e-9)} in flight ({in_flight_why}) + a queue of {queue} = "
                                f"ceil({rate:.2f} req/s x ({left})), what drains within {wait_why} ({where}); "
                                "vLLM answers 503 past it"),
        "max_num_queued_tokens": (f"{tokens}: ceil({prompt_rate:.1f} prompt tok/s x ({left})), vLLM's target TTFT x "
                                  f"prefill throughput ({where})" if tokens is not None
                                  else "not set: the level recorded no prompt-token throughput"),
    }  # fmt: skip
    return AdmissionBounds(reqs, tokens, queue, in_flight, rate, wait_s, reasons)
