"""The replica-lost scenario (opt-in, ``servetune verify --scenario replica_lost``): a Serve deployment of two or
more replicas loses one replica's engine mid-load, and verify measures what its clients saw.

The load runs at the verified level; half the scenario's time in, one replica's vLLM engine process is killed
with SIGKILL (:class:`Replicas` ``kill_engine``: the engine core vLLM starts as a child process of the replica
actor, found through the replica's pid; where the engine runs inside the replica's own process, that process:
Serve sees either as a dead replica and starts a new one). The replicas Serve reports RUNNING are read twice
a second; the load goes on until the count is whole again and the scenario's time more, so the replacement is
measured serving (at most the trial's start-up timeout and that after the kill: a replacement vLLM starts as
slowly as the first).

:func:`judge_replica_lost` is a pure function of the requests' records and those times:

- **error burst**: the requests that failed after the kill (those in flight on the lost replica, and any Serve
  routed to it before it was marked dead), and the burst's span: the first failure's end to the last one's;
- **recovery**: the load after the kill in windows of ``window_s``; a window is good when its error rate is
  within the SLO's (``error_rate`` bound, else 0.1%) and its TTFT P99 within the SLO's TTFT bound (P99, else
  the highest bound). ``recovery_s`` is from the kill to the start of the first good window after which every
  window is good (0: the clients never saw it; a window with no request sent is neither); not recovered when the
  last window is bad;
- **replaced**: the RUNNING replica count was whole again, and when (``replaced_s`` after the kill);
- **survivors**: the requests sent while the replica was lost (from the kill until the count was whole, else
  until the burst's end, at least one window) that succeeded, served by the other replicas: their TTFT P99
  against the bound.

- **routed to the dead replica**: failures of requests sent after the kill, and how long after it the last
  such request was sent (``routed_to_dead_s``): Serve kept routing new requests to a replica whose engine was
  gone until its health check found it.

Passes when the replica was replaced, the load recovered, the survivors held the TTFT bound, and new requests
stopped failing within ``ROUTED_TO_DEAD_MAX_S``. The requests in flight on the lost engine do not fail it (a lost
engine loses its requests; the numbers say how many). By hand on vLLM 0.32's CPU build and Ray 2.60 (two replicas
of the tiny model, 6 clients), the replica kept answering 5xx for 40 s after its EngineCore was killed: Serve's
health-check period and timeout (10 + 30 s) before it was marked dead, then replaced 129 s after the kill. It gives
checklist item 15.20 its second half: the replacement is a new instance, and whether it took traffic only once
warm shows in the windows after it came back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from servetune.config.slo import Slo
from servetune.metrics import RequestRecord
from servetune.report.export import HEALTH_CHECK_PERIOD_S
from servetune.verify.scenarios import ScenarioResult, Target, error_bound, fmt
from servetune.verify.under_load import after_windows, around_event, done_at, error_kinds, p99_ms, ttft_bound_s

NAME = REPLICA_LOST = "replica_lost"
#: New requests may fail on the lost replica for at most this long: the health check servetune deploys the LLM
#: deployment with (``report.export.health_check_config``) finds a dead engine within about 4 periods (3 failed checks
#: in a row, Serve's ``REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD``, after the one in flight at the kill), then Serve's
#: routers hear of it; one more period for that.
ROUTED_TO_DEAD_MAX_S = 5 * HEALTH_CHECK_PERIOD_S
STREAM = 31_000  # its arrivals' seed (overload's is 30_000)
MIN_REPLICAS = 2


class Replicas(Protocol):
    """A deployment that can lose one replica's engine (``serve.trial.ServeEngine``)."""

    def kill_engine(self) -> tuple[int, str]:
        """SIGKILL one replica's engine; (the pid killed, what it was: ``engine process`` or ``replica process``)."""
        ...

    def running_replicas(self) -> int:
        """Replicas Serve reports RUNNING now."""
        ...


def judge_replica_lost(records: Sequence[RequestRecord], killed_at: float, replaced_at: float | None,
                       replicas: int, slo: Slo, window_s: float, killed: str = "") -> ScenarioResult:  # fmt: skip
    """The verdict on a run that lost one of ``replicas`` at ``killed_at`` (the level's clock), Serve running them all
    again at ``replaced_at`` (None: not within the run); see the module docstring."""
    sent = list(records)
    records = [r for r in sent if not r.warmup]
    ttft_s, errors_max = ttft_bound_s(slo), error_bound(slo)
    failures = sorted((r for r in records if not r.ok and done_at(r) >= killed_at), key=done_at)
    burst_start = done_at(failures[0]) if failures else None
    burst_end = done_at(failures[-1]) if failures else None
    routed = [r.sent for r in failures if r.sent >= killed_at]  # sent after the kill, and still failed
    routed_s = max(routed) - killed_at if routed else None
    ws = after_windows(records, killed_at, window_s, ttft_s, errors_max)
    first_good = next((i for i in range(len(ws)) if all(w.good for w in ws[i:])), None)
    recovered = first_good is not None
    recovery_s = ws[first_good].start_s if first_good is not None else None
    lost_until = replaced_at if replaced_at is not None else max(burst_end or killed_at, killed_at + window_s)
    survivors = [r for r in records if r.ok and r.ttft_s is not None and killed_at <= r.sent < lost_until]
    survivors_p99 = p99_ms([r.ttft_s for r in survivors if r.ttft_s is not None])
    held = ttft_s is None or survivors_p99 is None or survivors_p99 <= ttft_s * 1000.0
    numbers: dict[str, Any] = {
        "replicas": replicas, "killed": killed, "killed_at_s": killed_at,
        # every request sent and its 5xx (warm-up too): the fault's, left out of verify's stability 5xx rate
        "requests": len(sent), "http_5xx": sum(r.error_kind == "http_5xx" for r in sent),
        "requests_after_kill": sum(r.sent >= killed_at for r in records), "failed": len(failures),
        "errors_by_kind": error_kinds(failures), "error_burst_s": None if burst_start is None or burst_end is None else burst_end - burst_start,
        "error_burst_from_kill_s": None if burst_end is None else burst_end - killed_at,
        "failed_in_flight": len(failures) - len(routed), "failed_sent_after_kill": len(routed),
        "routed_to_dead_s": routed_s,
        "recovered": recovered, "recovery_s": recovery_s, "replaced": replaced_at is not None,
        "replaced_s": None if replaced_at is None else replaced_at - killed_at,
        "survivor_requests": len(survivors), "survivor_ttft_ms_p99": survivors_p99,
        "ttft_bound_ms": None if ttft_s is None else ttft_s * 1000.0, "error_rate_bound": errors_max,
        "window_s": window_s, "windows": [w.as_dict() for w in ws],
    }  # fmt: skip
    burst = (f"{len(failures)} requests failed over {fmt(numbers['error_burst_s'], ' s')}" if failures
             else "no request failed")  # fmt: skip
    head = f"one of {replicas} replicas lost ({killed or 'killed'}): {burst}"
    problems = []
    if replaced_at is None:
        problems.append(f"Serve did not run {replicas} replicas again within the run")
    if not recovered:
        problems.append(f"not recovered: the last {window_s:g} s window still broke the SLO"
                        if ws else "no request was sent after the kill")  # fmt: skip
    if routed_s is not None and routed_s > ROUTED_TO_DEAD_MAX_S:
        problems.append(f"new requests still failed {fmt(routed_s, ' s')} after the kill (> {ROUTED_TO_DEAD_MAX_S:g} s, "
                        f"5 health-check periods of {HEALTH_CHECK_PERIOD_S:g} s): Serve kept routing to the lost replica; "
                        "check the LLM deployment's health_check_period_s / health_check_timeout_s")  # fmt: skip
    if not held:
        problems.append(f"the surviving replicas' TTFT P99 {fmt(survivors_p99, ' ms')} broke the bound "
                        f"{fmt(numbers['ttft_bound_ms'], ' ms')} while one was lost")  # fmt: skip
    if problems:
        return ScenarioResult(NAME, False, head + "; " + "; ".join(problems), numbers)
    detail = (f"; back within the SLO {fmt(recovery_s, ' s')} after the kill, replaced in "
              f"{fmt(numbers['replaced_s'], ' s')}; survivors' TTFT P99 {fmt(survivors_p99, ' ms')}"
              + (f" (bound {fmt(numbers['ttft_bound_ms'], ' ms')})" if ttft_s is not None else ""))  # fmt: skip
    return ScenarioResult(NAME, True, head + detail, numbers)


def refusal(replicas: int | None) -> str | None:
    """Why the scenario cannot run on a deployment of ``replicas`` (None: through Serve not at all), or None."""
    if replicas is None:
        return "replica_lost needs a trial measured through Ray Serve (serve.num_replicas >= 2); this one ran bare"
    if replicas < MIN_REPLICAS:
        return f"replica_lost needs serve.num_replicas >= {MIN_REPLICAS}; this trial has {replicas}"
    return None


async def replica_lost(t: Target, replicas: int, replace_timeout_s: float | None = None) -> ScenarioResult:
    """Run the load, lose a replica ``scenario_s / 2`` in, follow Serve's replica count, and judge. The load goes on
    until the count is whole again and ``scenario_s`` more (with the replacement serving), at most
    ``replace_timeout_s`` (the trial's start-up timeout; default the scenario's time) and that after the kill."""
    deployment = t.engine
    if not (hasattr(deployment, "kill_engine") and hasattr(deployment, "running_replicas")):
        return ScenarioResult(NAME, False, "not run: the engine is not a Serve deployment")
    seen_down = False

    def replaced(_: object) -> bool:
        nonlocal seen_down
        running = deployment.running_replicas()  # type: ignore[union-attr]
        seen_down = seen_down or running < replicas
        return seen_down and running >= replicas

    run = await around_event(t, NAME, STREAM, deployment.kill_engine, replaced,  # type: ignore[union-attr]
                             "the replaced replica was measured for the scenario's time: stopped", replace_timeout_s)  # fmt: skip
    if run.ended_early:
        return ScenarioResult(NAME, False, f"not run: the load ended before the kill ({len(run.records)} requests)")
    if run.error is not None or run.value is None or run.returned_at is None:
        return ScenarioResult(NAME, False, f"not run: no replica's engine could be killed ({run.error})")
    pid, what = run.value
    verdict = judge_replica_lost(run.records, run.returned_at, run.settled_at, replicas, t.slo,
                                 max(t.budget.scenario_s / 10, 1.0), f"{what} {pid}")  # fmt: skip
    verdict.numbers["level"] = run.level
    return verdict
