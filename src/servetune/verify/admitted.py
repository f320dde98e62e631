"""A scenario's requests judged against the admission bounds the engine started with (vLLM's
``max_num_queued_reqs`` / ``max_num_queued_tokens``, sized by report/admission.py and shipped by
``export --format vllm``; verify starts the engine with them): the burst's rule.

A bound turns requests away on purpose (HTTP 503 at once, vLLM's ``AsyncLLM.check_admission``), so under bursty
arrivals some refusals are the bound working, not errors. The burst with bounds set passes when all four hold:

1. **every refusal is explained by the bound** (:func:`explained`): vLLM refuses a request when the requests it
   holds (waiting and running) already fill ``max_num_queued_reqs``, or the prompt tokens of those still waiting
   for their first token reach ``max_num_queued_tokens``. A 503 is explained when, counted from the client's own
   times, either could have been so at some moment of the refusal's round trip: the admitted requests that were
   in flight during it (sent before its answer came, not ended before it was sent) number at least
   ``max_num_queued_reqs``, or those among them without a first token by its sending hold at least
   ``max_num_queued_tokens`` prompt tokens. The count is generous (the client sees every end and first token
   after the server did, and counts requests still on the wire), so a refusal it does not explain is one the
   bound cannot have made: another 503 (a proxy, Serve's back-pressure), or a bound far tighter than the one
   set. One such refusal fails the burst (a burst that refuses more than the bound explains is a failure), and
   each counts as an error in rule 2.
2. **errors within the budget**: every failure but the explained refusals, over the requests sent less the
   explained refusals, at most the SLO's ``error_rate`` (else ``scenarios.DEFAULT_ERROR_RATE``).
3. **refusals are quick**: their P99 answer time within the SLO's TTFT bound (``autoscale.tolerable_wait_s``), as
   the overload scenario's: a refusal later than a first token would have been is no help to a client that
   retries elsewhere.
4. **the admitted requests meet the SLO**: their own summary (the explained refusals left out) against every
   latency bound of the SLO, a bound broken by at most the verdict noise passing with a note (config/slo.py
   ``noise_breaks``, the overload scenario's admitted TTFT's rule: a single run's P99 moves that much between
   repeats). A break beyond the noise that the load client's longest stall over the burst accounts for (within the
   noise once the stall is taken off) fails as *unsettled* (``unsettled``), as the overload's does, when nothing
   else failed.

How many were refused is reported (``refused``, ``refused_share``), not judged: a share that is high at the
operating point says the bound is tight for bursts of this shape, a sizing question (report/admission.py), not a
fault of the engine. Without bounds the burst is judged as before: every failure counts against the error budget.

Pure functions of the records; ``scenarios.burst`` runs the load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servetune.config.slo import Slo
from servetune.engine.metrics import ADMISSION_REASONS
from servetune.metrics import RequestRecord
from servetune.summary import summarize

#: vLLM's engine arguments that bound admission (a configuration setting either gets the overload scenario in verify,
#: and its burst judged by this module's rule): the reasons vLLM counts its refusals by, named after them.
ADMISSION_ARGS = ADMISSION_REASONS


def refused(record: RequestRecord) -> bool:
    """Turned away by an admission bound: HTTP 503 (vLLM's QueueOverflowError and MaxQueuedTokensError)."""
    return bool(record.error) and str(record.error).startswith("HTTP 503")


def p99_ms(values: Sequence[float]) -> float | None:
    return float(np.percentile(np.asarray(values), 99)) * 1000.0 if values else None


def bounds_of(engine_args: Mapping[str, Any]) -> dict[str, int]:
    """The admission bounds ``engine_args`` set (those of :data:`ADMISSION_ARGS` given a value)."""
    return {k: int(engine_args[k]) for k in ADMISSION_ARGS if engine_args.get(k) is not None}


def explained(records: Sequence[RequestRecord], bounds: Mapping[str, int]) -> list[bool]:
    """For each refusal among ``records`` (in their order), whether the bounds explain it (the module's rule 1).
    ``records``: every request the scenario sent (warm-up ones are load too)."""
    admitted = [r for r in records if not refused(r)]
    sent = np.asarray([r.sent for r in admitted], dtype=float)
    # a request with no end recorded is counted in flight to the last
    ended = np.asarray([r.end if r.end is not None else np.inf for r in admitted], dtype=float)
    first = np.asarray([r.chunk_times[0] if r.chunk_times else (r.end if r.end is not None else np.inf)
                        for r in admitted], dtype=float)  # fmt: skip
    tokens = np.asarray([max(r.prompt_tokens or 0, r.input_tokens) for r in admitted], dtype=float)
    max_reqs, max_tokens = bounds.get("max_num_queued_reqs"), bounds.get("max_num_queued_tokens")
    out = []
    for r in records:
        if not refused(r):
            continue
        answered = r.end if r.end is not None else r.sent
        during = (sent <= answered) & (ended >= r.sent)
        reqs_full = max_reqs is not None and int(during.sum()) >= max_reqs
        tokens_full = max_tokens is not None and float(tokens[during & (first >= r.sent)].sum()) >= max_tokens
        out.append(reqs_full or tokens_full)
    return out


@dataclass
class AdmittedVerdict:
    """The rule's numbers and the problems it found (none: passed), and the SLO bounds broken within the noise."""

    numbers: dict[str, Any]
    problems: list[str] = field(default_factory=list)
    within_noise: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems and not self.unsettled

    @property
    def unsettled(self) -> bool:
        """The admitted broke the SLO beyond the noise only by what the load client's longest stall accounts for."""
        return bool(self.numbers.get("unsettled"))


def judge_admitted(records: Sequence[RequestRecord], bounds: Mapping[str, int], slo: Slo, level: Mapping[str, float],
                   wait_s: float, error_bound: float, noise: float, stall_ms: float = 0.0) -> AdmittedVerdict:  # fmt: skip
    """The rule (module docstring) on a scenario's requests; ``wait_s``: the SLO's TTFT bound (refusals must come
    within it), ``error_bound``: the error rate allowed, ``noise``: how far (relative) a latency bound may be broken
    within the noise (config/slo.py ``noise_breaks``, as the overload's admitted TTFT); ``stall_ms``: the load
    client's longest stall over the scenario (load/pace.py): a break beyond the noise it accounts for is unsettled."""
    turned = [r for r in records if refused(r)]
    why = explained(records, bounds)
    unexplained = [r for r, ok in zip(turned, why, strict=True) if not ok]
    kept = [r for r in records if not refused(r)] + unexplained  # what the SLO and the error budget judge
    summary = summarize(kept, level, slo.request_bounds_ms() or None, saturation=False)
    measured = [r for r in records if not r.warmup]
    refuse_p99 = p99_ms([r.e2el_s for r in turned if not r.warmup and r.e2el_s is not None])
    others = [r for r in kept if not r.warmup and not r.ok]
    numbers: dict[str, Any] = {
        "admission_bounds": dict(bounds), "refused": sum(not r.warmup for r in turned),
        "refused_share": sum(not r.warmup for r in turned) / len(measured) if measured else None,
        "refused_explained": sum(ok for r, ok in zip(turned, why, strict=True) if not r.warmup),
        "refused_unexplained": sum(not r.warmup for r in unexplained), "refuse_ms_p99": refuse_p99,
        "ttft_bound_ms": wait_s * 1000.0, "admitted": summary.completed, "admitted_ttft_ms_p99": summary.ttft_ms.p99,
        "admitted_error_rate": summary.error_rate, "ttft_noise": noise,
        "client_stall_ms_max": stall_ms, "unsettled": False,
    }  # fmt: skip
    verdict = AdmittedVerdict(numbers)
    if summary.completed == 0:
        verdict.problems.append("no admitted request completed")
    if unexplained:
        verdict.problems.append(f"{numbers['refused_unexplained']} refusals the bounds do not explain "
                                f"(fewer requests or prompt tokens in flight than {_bounds_text(bounds)})")  # fmt: skip
    if summary.error_rate > error_bound:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(summary.errors_by_kind.items()))
        verdict.problems.append(f"error rate {summary.error_rate:.2%} over {error_bound:g} beside the refusals the "
                                f"bounds explain ({kinds}; {len(others)} requests)")  # fmt: skip
    if refuse_p99 is not None and refuse_p99 > wait_s * 1000.0:
        verdict.problems.append(f"refusals took {refuse_p99:.3g} ms (P99), past the TTFT bound {wait_s * 1000.0:g} ms")
    breaks = slo.noise_breaks(summary, noise, latency_only=True)
    beyond, within = breaks.beyond, breaks.within
    if beyond and summary.completed:
        broke = f"admitted requests break the SLO beyond the noise ({noise:.0%}): {'; '.join(beyond)}"
        if stall_ms and not slo.noise_breaks(summary, noise, stall_ms, latency_only=True).beyond:
            numbers["unsettled"] = not verdict.problems  # the stall accounts for it, and nothing else failed
            broke += f" (the load client stalled for up to {stall_ms:.4g} ms, which accounts for it)"
        verdict.problems.append(broke)
    verdict.within_noise = within
    numbers["admitted_slo_violations"] = beyond + within
    return verdict


def _bounds_text(bounds: Mapping[str, int]) -> str:
    return " or ".join(f"{k} {v}" for k, v in bounds.items()) or "no bound"


def describe(verdict: AdmittedVerdict) -> str:
    """The rule's outcome in words, for the scenario's reason."""
    n = verdict.numbers
    share = n["refused_share"]
    head = (f"{n['refused']} refused (503, {share:.0%} of the requests; bounds {_bounds_text(n['admission_bounds'])})"
            if share is not None else "none sent")  # fmt: skip
    if n["refused"]:
        head += f", {n['refused_explained']} explained by the bounds, answered in {_ms(n['refuse_ms_p99'])} (P99)"
    head += (f"; {n['admitted']} admitted requests completed, TTFT P99 {_ms(n['admitted_ttft_ms_p99'])}, "
             f"error rate {n['admitted_error_rate']:.2%}")  # fmt: skip
    if verdict.unsettled:
        return head + ": unsettled, " + "; ".join(verdict.problems) + "; rerun on a quiet host"
    if verdict.problems:
        return head + ": " + "; ".join(verdict.problems)
    if verdict.within_noise:
        return (
            head
            + f"; the admitted meet the SLO within the noise ({n['ttft_noise']:.0%}: {'; '.join(verdict.within_noise)})"
        )
    return head + "; the admitted meet the SLO"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g} ms"
