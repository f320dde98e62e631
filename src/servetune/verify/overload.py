"""The overload scenario: the chosen configuration at 1.5x its capacity, then the load dropped.

It checks what an admission bound (vLLM's ``max_num_queued_reqs`` / ``max_num_queued_tokens``, sized by
report/admission.py and shipped by ``export --format vllm``) promises, checklist item 15.15 ("the request
queue has a hard limit"):

1. **overload**: Poisson arrivals at ``OVERLOAD_FACTOR`` x the rate the study measured at the trial's
   capacity (report/operating.py ``capacity_rate``; verify runs the other scenarios at headroom x it),
   else at the level, for the scenario's time. Requests past the bound must be refused (HTTP 503)
   *quickly*: their P99 answer time within the SLO's TTFT bound (a refusal that came later than a first
   token would have is no help to a client that retries elsewhere); the requests admitted must meet the
   SLO's TTFT bound (P99), within the noise of a P99 TTFT: over it by less than the verdict noise the
   study measured at the trial's capacity (results.py ``Capacity.verdict_noise``, else ``MARGIN``, 10%)
   passes, and the reason says it was within the noise. A single run's P99 TTFT moves far more than that
   between repeats on a shared host (bench/knee_noise.py: a median of 45% on the recorded CPU surfaces),
   and an unbounded queue breaks the bound by multiples, not by a few percent, so a miss inside the noise
   is no evidence that the bound failed.
2. **recovery**: the load drops to ``RECOVERY_FACTOR`` x the rate for as long again. ``recovery_s`` is
   when, after the drop, the last request was refused or started past the TTFT bound (0: none was); the
   engine recovered when the last third of that phase had neither.

An engine with no bound queues every request, refuses none and fails (the bound is what is checked). The
judgement (:func:`judge_overload`) is a pure function of the two phases' requests and of the load client's own
stalls while they ran (load/pace.py ``LoopStalls``, recorded by every level: trial/measure.py). The admitted TTFT
is compared with the bound by config/slo.py ``noise_breaks``, the rule the burst's admitted requests take too.

**A failure the client's stall accounts for is unsettled, not the bound's.** On a host short of cores the load
client's process goes unscheduled for a while: every answer in flight then waits to be read, every send due then goes
out late, together. bench/overload_trace.py saw it on the shared two-core host (load average 5-8): the client's event
loop stalled for up to 1.4-1.6 s in a 6-second phase, while vLLM's API server and engine core sat idle, so 503s
vLLM decided in ~10 ms (its ``check_admission`` runs in the request's handler) were read 1.2-1.6 s after they were
sent, and the sends held back went out in one burst. A problem whose number is within the bound once the
client's longest stall is taken off (refusals' P99, admitted TTFT P99, the recovery's late requests when none of them
was refused) could be the client's alone: the scenario then fails as *unsettled*, says so with the stall, and the
numbers carry ``unsettled``; a problem beyond it, or an engine that refused nothing, fails as before.

Beside the client's 503s, each phase records vLLM's own count of its refusals by the bound that made them, and the
reason says whether the two agree (verify/refusals.py); the verdict stays the client's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from servetune.config.slo import SloBound, noise_breaks
from servetune.load.runner import Level
from servetune.metrics import RequestRecord
from servetune.report.autoscale import tolerable_wait_s
from servetune.results import MARGIN
from servetune.trial.measure import LevelPlan
from servetune.verify.admitted import p99_ms, refused
from servetune.verify.refusals import ServerRefusals, server_refusals
from servetune.verify.scenarios import ScenarioResult, Target, _level, fmt

NAME = OVERLOAD = "overload"
OVERLOAD_FACTOR = 1.5
RECOVERY_FACTOR = 0.5
STREAM = 30_000  # its arrivals' seed (scenarios.py STREAMS are 10_000 + 1_000 x i)


def judge_overload(over: Sequence[RequestRecord], after: Sequence[RequestRecord], wait_s: float,
                   rate: float, noise: float = MARGIN, stall_s: float = 0.0,
                   stalled_s: float = 0.0) -> ScenarioResult:  # fmt: skip
    """The verdict on the two phases (see the module docstring); ``wait_s`` is the SLO's TTFT bound, ``noise``
    how far over it (relative) the admitted requests' P99 TTFT may be, within the noise; ``stall_s`` the load
    client's longest stall over the two phases, ``stalled_s`` their sum."""
    over = [r for r in over if not r.warmup]
    after = sorted((r for r in after if not r.warmup), key=lambda r: r.sent)
    turned = [r for r in over if refused(r)]
    admitted = [r for r in over if r.ok]
    refuse_p99 = p99_ms([r.e2el_s for r in turned if r.e2el_s is not None])
    admitted_p99 = p99_ms([r.ttft_s for r in admitted if r.ttft_s is not None])

    def bad(r: RequestRecord) -> bool:
        return refused(r) or not r.ok or (r.ttft_s is not None and r.ttft_s > wait_s)

    late = [r.sent for r in after if bad(r)]
    tail = after[len(after) - len(after) // 3 :] if len(after) >= 3 else after
    recovered = bool(after) and not any(bad(r) for r in tail)
    # the recovery's failure is the client's stall's to account for when its tail was only late, by less than it
    tail_late_s = max((r.ttft_s for r in tail if r.ttft_s is not None), default=0.0)
    tail_refused = any(refused(r) or not r.ok for r in tail)
    numbers: dict[str, Any] = {
        "overload_rate": OVERLOAD_FACTOR * rate, "recovery_rate": RECOVERY_FACTOR * rate, "sent": len(over),
        "refused": len(turned), "refused_share": len(turned) / len(over) if over else None,
        "admitted": len(admitted), "refuse_ms_p99": refuse_p99, "admitted_ttft_ms_p99": admitted_p99,
        "ttft_bound_ms": wait_s * 1000.0, "recovery_s": max(late, default=0.0), "recovered": recovered,
        "other_errors": len([r for r in over if not r.ok and not refused(r)]), "ttft_noise": noise,
        "client_stall_ms_max": stall_s * 1000.0, "client_stalled_s": stalled_s, "unsettled": False,
        # both phases' requests and their 5xx: refused on purpose, verify's stability (verify/document.py) leaves them
        # out of the service's 5xx rate in normal operation
        "requests": len(over) + len(after), "http_5xx": sum(r.error_kind == "http_5xx" for r in [*over, *after]),
    }  # fmt: skip
    bound_ms = wait_s * 1000.0
    head = f"{fmt(OVERLOAD_FACTOR * rate)} req/s ({OVERLOAD_FACTOR:g}x): {len(turned)} of {len(over)} refused (503)"
    if not turned:
        return ScenarioResult(NAME, False, head + ": no bound on the queue, every request was queued", numbers)
    stall_ms = stall_s * 1000.0
    problems: list[tuple[str, bool]] = []  # each problem, and whether the client's longest stall accounts for it
    if refuse_p99 is not None and refuse_p99 > bound_ms:
        problems.append((f"refusals took {fmt(refuse_p99, ' ms')} (P99), past the TTFT bound {bound_ms:g} ms",
                         refuse_p99 - stall_ms <= bound_ms))  # fmt: skip
    ttft = [SloBound(metric="ttft_ms", stat="p99", max=bound_ms)]  # the admitted's TTFT P99, with the noise
    admitted_breaks = noise_breaks(ttft, {"ttft_ms_p99": admitted_p99}, noise)
    if admitted_p99 is None:
        problems.append(("no request admitted completed", False))
    elif admitted_breaks.beyond:
        problems.append((f"admitted requests' TTFT P99 {fmt(admitted_p99, ' ms')} broke the bound {bound_ms:g} ms "
                         f"beyond the noise ({noise:.0%})",
                         not noise_breaks(ttft, {"ttft_ms_p99": admitted_p99}, noise, stall_ms).beyond))  # fmt: skip
    if not recovered:
        problems.append((f"not recovered at {fmt(RECOVERY_FACTOR * rate)} req/s: the last third still refused or late",
                         not tail_refused and tail_late_s - stall_s <= wait_s))  # fmt: skip
    detail = (f" in {fmt(refuse_p99, ' ms')} (P99); admitted TTFT P99 {fmt(admitted_p99, ' ms')}; recovered "
              f"{fmt(numbers['recovery_s'], ' s')} after the drop")  # fmt: skip
    if problems:
        text = "; ".join(problem for problem, _ in problems)
        stalled = (f"the load client itself stalled for up to {fmt(stall_ms, ' ms')} ({fmt(stalled_s, ' s')} in all: "
                   "its process not running, a host short of cores)")  # fmt: skip
        if all(explained for _, explained in problems):
            numbers["unsettled"] = True
            return ScenarioResult(NAME, False, f"{head}: unsettled, {stalled}, which accounts for each problem: "
                                  f"{text}; rerun on a quiet host", numbers)  # fmt: skip
        return ScenarioResult(NAME, False, f"{head}: {text}" + (f" ({stalled})" if stall_s else ""), numbers)
    if admitted_p99 is not None and admitted_breaks.within:
        detail += (
            f" (over the bound {bound_ms:g} ms by {admitted_p99 / bound_ms - 1:.0%}, within the noise {noise:.0%})"
        )
    return ScenarioResult(NAME, True, head + detail, numbers)


async def overload(t: Target) -> ScenarioResult:
    """Run the two phases against the target and judge them."""
    rate = t.capacity_rate or (t.level.value if t.level.kind == "rate" else t.measured_rate)
    if not rate:
        return ScenarioResult(NAME, False, "the study measured no request rate at this level to overload")
    wait_s, _ = tolerable_wait_s([str(b) for b in t.slo.bounds])
    seconds = t.budget.scenario_s
    phases, levels, counted = [], [], []
    for factor, stream in ((OVERLOAD_FACTOR, STREAM), (RECOVERY_FACTOR, STREAM + 1)):
        plan = LevelPlan(Level("rate", factor * rate, "poisson"), num_requests=None, duration_s=seconds,
                         warmup_requests=0)  # fmt: skip
        level, records = await _level(t, plan, stream)  # with the client's own stalls (trial/measure.py)
        phases.append(records)
        levels.append(level)
        counted.append(server_refusals(records, level.server_metrics, lagging=t.metrics is not None))
    result = judge_overload(phases[0], phases[1], wait_s, rate, t.verdict_noise or MARGIN,
                            stall_s=max((lv.client_stall_ms_max or 0.0) for lv in levels) / 1000.0,
                            stalled_s=sum((lv.client_stalled_s or 0.0) for lv in levels))  # fmt: skip
    return with_server_count(result, counted[0], counted[1])


def with_server_count(result: ScenarioResult, over: ServerRefusals, after: ServerRefusals) -> ScenarioResult:
    """The verdict with vLLM's own count of each phase's refusals beside the client's (verify/refusals.py): in its
    numbers (the recovery's as ``recovery_*``), and in its reason where the recovery's refused any or disagrees."""
    result.numbers.update(over.numbers())
    result.numbers.update(after.numbers("recovery_"))
    result.reason += f"; {over.text()}"
    if after.server or after.agrees is False:
        result.reason += f"; in the recovery phase, {after.text()}"
    return result
