"""The rolling-update scenario (opt-in, ``servetune verify --scenario rolling_update``): a Serve deployment moved to
a new configuration under load, and what its clients saw while Serve rolled its replicas over.

The load runs at the verified level; half the scenario's time in, the application is deployed again under its own
name and route through Serve's update path (``serve.run`` of the new application, :class:`Rollout` ``update``):
with the runner-up's configuration where verify has a runner-up measured through Serve on the same model whose
replicas can take the winner's places during the rollout (:func:`new_configuration`), else the same configuration
as a new version (Serve gives every unpinned deployment a new version, so it replaces every replica all the same).
Serve's status is read twice a second; the rollout is done when the application is RUNNING, every deployment
HEALTHY, and none of the replicas from before the update is alive. The load goes on the scenario's time after that
(the new replicas measured serving), at most the trial's start-up timeout and that after the update. Then each
running replica is asked what it was started with (``replicas_after``, and ``replicas_on_new`` of them with the
engine arguments and environment moved to).

:func:`judge_rolling_update` is a pure function of the requests' records and those times (the level's clock):

- **during the change**: the requests in flight at some point from the update call until the rollout was done
  (sent before it ended, ended after the call), the ones that failed, and their error rate; the TTFT of those sent
  during it that succeeded: the worst and the P99;
- **the time it took**: ``update_s``, from the update call until the rollout was done (None: not within the run);
- **after**: the requests sent after it, their error rate and TTFT P99, and the same in windows of ``window_s``
  (verify/under_load.py);
- **the stall**: the replicas Serve started and stopped from the update call on (``replica_changes``: each one's
  deployment, whether it is an LLM replica or the ingress's, and when, from Ray's actor table), whether the ingress
  replica was among them (``ingress_replaced``), and when the request of the worst TTFT was sent and answered
  relative to the update call and to each of those changes: a request that waited for a replica to start shows there.

Only the LLM deployment moves: the ingress is deployed with a version of what it is built from
(serve/cluster.py ``keep_ingress``), so Serve keeps its one replica routing throughout. Unpinned, Serve stopped it
and started a new one at every update (``max_surge_percent`` 0), and requests waited at the proxy meanwhile, though
an LLM replica was serving all along.

Passes when the rollout was done within the run, the failed share of the requests during it is within the SLO's
error-rate bound (``error_rate``, else 0.1%), their TTFT P99 within the SLO's TTFT bound (P99, else the highest
bound), the load after it held both, and every replica after it runs the new configuration (where that was read).
It gives checklist item 15.23 its rollback half: a rollback is the same update path back to the configuration before.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from servetune.config.slo import Slo
from servetune.metrics import RequestRecord
from servetune.serve.trial import trial_needs
from servetune.trial.runner import TrialSpec
from servetune.verify.scenarios import ScenarioResult, Target, error_bound, fmt
from servetune.verify.under_load import after_windows, around_event, done_at, error_kinds, p99_ms, ttft_bound_s

NAME = ROLLING_UPDATE = "rolling_update"
STREAM = 32_000  # its arrivals' seed (replica_lost's is 31_000)
SAME_CONFIGURATION = "the same configuration as a new version"


class Rollout(Protocol):
    """A deployment that can be moved to a new configuration under load (``serve.trial.ServeEngine``)."""

    def update(self, spec: TrialSpec | None = None) -> list[str]:
        """Deploy ``spec``'s configuration (None: the same one, a new version) without waiting; the replicas before."""
        ...

    def rolled_out(self, old: list[str]) -> bool:
        """Whether the rollout is done: every replica runs the new version, none of ``old`` is alive."""
        ...

    def replicas_on_deployed(self) -> tuple[int, int]:
        """(Replicas running, those of them started with the configuration deployed last), as the replicas say.
        Optional: a deployment without it is not asked."""
        ...

    def replica_lifetimes(self) -> list[dict[str, Any]]:
        """Every replica of the application, dead ones too: ``deployment``, ``replica``, ``engine`` (an LLM replica,
        else the ingress's), ``started_s`` and ``ended_s`` (the wall clock; None: not yet). Optional, as above."""
        ...


@dataclass(frozen=True)
class ReplicaChange:
    """A replica started or stopped during the rollout: its deployment, Serve's replica id, whether it is an LLM
    replica (else the ingress's), ``started`` or ``stopped``, and when (its actor's, on the level's clock)."""

    deployment: str
    replica: str
    engine: bool
    what: str
    at_s: float

    def words(self) -> str:
        return f"{'LLM' if self.engine else 'ingress'} replica {self.replica} {self.what}"


def replica_changes(lifetimes: Sequence[Mapping[str, Any]], started_wall_s: float, since_s: float,
                    until_s: float) -> list[ReplicaChange]:  # fmt: skip
    """The replicas started or stopped from ``since_s`` until ``until_s`` (the level's clock, which started at
    ``started_wall_s`` on the wall clock), from their lifetimes (:meth:`Rollout.replica_lifetimes`); in order."""
    changes = []
    for life in lifetimes:
        for what, key in (("started", "started_s"), ("stopped", "ended_s")):
            if life.get(key) is not None and since_s <= (at := float(life[key]) - started_wall_s) <= until_s:
                changes.append(ReplicaChange(str(life["deployment"]), str(life["replica"]), bool(life["engine"]),
                                             what, at))  # fmt: skip
    return sorted(changes, key=lambda c: c.at_s)


def refusal(replicas: int | None) -> str | None:
    """Why the scenario cannot run on a trial of ``replicas`` through Serve (None: not through Serve), or None."""
    if replicas is None:
        return "rolling_update needs a trial measured through Ray Serve (serve.num_replicas); this one ran bare"
    return None


def new_configuration(winner: TrialSpec, runner_up: TrialSpec | None) -> tuple[TrialSpec | None, str]:
    """What the deployment is moved to: the runner-up (its engine arguments, environment and replica count; its
    ``LLMConfig`` is built when the update is made, on the cluster it is made on) where it was measured through Serve
    on the same model and its replicas can take the winner's places during the rollout (:func:`placement_problem`),
    else None (the same configuration, a new version); and the change in words, with why where the runner-up was
    passed over."""
    if runner_up is None or runner_up.serve_replicas is None or runner_up.model != winner.model:
        return None, SAME_CONFIGURATION
    if why := placement_problem(winner, runner_up):
        return None, f"{SAME_CONFIGURATION} (the runner-up, trial {runner_up.trial_id}, {why})"
    return runner_up, f"to the runner-up's configuration (trial {runner_up.trial_id})"


def placement_problem(winner: TrialSpec, runner_up: TrialSpec) -> str | None:
    """Why the runner-up's replicas could not all be placed while Serve rolls the winner's over, or None.

    The room is what the winner's deployment holds (a local Ray is started with just that). Serve's rolling update
    (Ray 2.60, ``max_surge_percent`` 0, as servetune deploys) stops old replicas before it starts their replacements
    at an equal count, but starts the replicas a larger count adds while every old one still runs, and stops the next
    old ones only once those run: so more replicas than the winner's would wait for room the old ones hold, and
    the old ones for them, however few devices each takes. A runner-up pinned to another GPU type
    (``accelerator_type``) would wait for nodes of that type; one that takes more devices or CPUs in all would wait
    for the last of them."""
    if runner_up.gpu_type is not None and runner_up.gpu_type != winner.gpu_type:
        return f"runs on {runner_up.gpu_type} GPUs, the verified deployment on {winner.gpu_type or 'GPUs of any type'}"
    room, wanted = trial_needs(winner), trial_needs(runner_up)
    if wanted.replicas > room.replicas:
        return (f"runs {wanted.replicas} replicas, the verified deployment {room.replicas}: Serve starts the extra ones "
                "beside the old replicas, in room the deployment does not hold")  # fmt: skip
    held = room.resources()
    for resource, amount in wanted.resources().items():
        if amount > held.get(resource, 0.0):
            return f"needs {amount:g} {resource}s in all, the verified deployment holds {held.get(resource, 0.0):g}"
    return None


def judge_rolling_update(records: Sequence[RequestRecord], updated_at: float, done_at_s: float | None, slo: Slo,
                         window_s: float, change: str = SAME_CONFIGURATION, replicas: tuple[int, int] | None = None,
                         changes: Sequence[ReplicaChange] | None = None) -> ScenarioResult:  # fmt: skip
    """The verdict on a run whose deployment was updated at ``updated_at`` (the level's clock), the rollout done at
    ``done_at_s`` (None: not within the run), after which ``replicas`` (running, on the new configuration; None: not
    read) were found, Serve having started and stopped the replicas ``changes`` (None: not read); see the module
    docstring."""
    sent = list(records)
    records = [r for r in sent if not r.warmup]
    ttft_s, errors_max = ttft_bound_s(slo), error_bound(slo)
    bound_ms = None if ttft_s is None else ttft_s * 1000.0
    until = done_at_s if done_at_s is not None else max((done_at(r) for r in records), default=updated_at)
    during = [r for r in records if r.sent < until and done_at(r) >= updated_at]  # in flight during the change
    failed = [r for r in during if not r.ok]
    rate = len(failed) / len(during) if during else None
    answered = [r for r in during if r.ok and r.ttft_s is not None and r.sent >= updated_at]
    ttfts = [r.ttft_s for r in answered if r.ttft_s is not None]
    worst = max(ttfts) * 1000.0 if ttfts else None
    slowest = max(answered, key=lambda r: r.ttft_s or 0.0) if answered else None
    during_p99 = p99_ms(ttfts)
    after = [r for r in records if done_at_s is not None and r.sent >= done_at_s]
    after_failed = sum(not r.ok for r in after)
    after_p99 = p99_ms([r.ttft_s for r in after if r.ok and r.ttft_s is not None])
    after_rate = after_failed / len(after) if after else None
    held_after = (after_rate is not None and after_rate <= errors_max
                  and (bound_ms is None or (after_p99 is not None and after_p99 <= bound_ms)))  # fmt: skip
    windows = after_windows(records, done_at_s, window_s, ttft_s, errors_max) if done_at_s is not None else []
    numbers: dict[str, Any] = {
        "change": change, "updated_at_s": updated_at, "rolled_out": done_at_s is not None,
        "update_s": None if done_at_s is None else done_at_s - updated_at,
        # every request sent and its 5xx (warm-up too): the update's, left out of verify's stability 5xx rate
        "requests": len(sent), "http_5xx": sum(r.error_kind == "http_5xx" for r in sent),
        "requests_during": len(during), "failed": len(failed), "errors_by_kind": error_kinds(failed),
        "error_rate_during": rate, "ttft_ms_max_during": worst, "ttft_ms_p99_during": during_p99,
        "requests_after": len(after), "failed_after": after_failed, "ttft_ms_p99_after": after_p99,
        "held_after": held_after, "ttft_bound_ms": bound_ms, "error_rate_bound": errors_max,
        "window_s": window_s, "windows": [w.as_dict() for w in windows],
        "replicas_after": None if replicas is None else replicas[0],
        "replicas_on_new": None if replicas is None else replicas[1],
        **stall(slowest, updated_at, changes),
    }  # fmt: skip
    took = f"rolled out in {fmt(numbers['update_s'], ' s')}" if done_at_s is not None else "not rolled out"
    head = (f"updated {change} under load: {took}; {len(failed)} of {len(during)} requests failed during it, TTFT "
            f"worst {fmt(worst, ' ms')}, P99 {fmt(during_p99, ' ms')}"
            + (f" (bound {fmt(bound_ms, ' ms')})" if bound_ms is not None else "")
            + stall_words(slowest, updated_at, changes))  # fmt: skip
    problems = []
    if done_at_s is None:
        problems.append("Serve did not finish the rollout within the run")
    if rate is not None and rate > errors_max:
        problems.append(f"{rate:.2%} of the requests during the change failed (bound {errors_max:.2%})")
    if not during:
        problems.append("no request was in flight during the change")
    if bound_ms is not None and during_p99 is not None and during_p99 > bound_ms:
        problems.append(f"TTFT P99 during the change {fmt(during_p99, ' ms')} broke the bound")
    if done_at_s is not None and not held_after:
        problems.append(
            "no request was sent after the rollout" if not after else
            f"after the rollout the SLO did not hold ({after_failed} of {len(after)} failed, TTFT P99 "
            f"{fmt(after_p99, ' ms')})"
        )  # fmt: skip
    if replicas is not None and replicas[1] < replicas[0]:
        problems.append(f"{replicas[0] - replicas[1]} of the {replicas[0]} replicas after it run another configuration")
    if problems:
        return ScenarioResult(NAME, False, head + "; " + "; ".join(problems), numbers)
    tail = f"; after it {len(after)} requests, TTFT P99 {fmt(after_p99, ' ms')}, {after_failed} failed"
    return ScenarioResult(NAME, True, head + tail, numbers)


def stall(slowest: RequestRecord | None, updated_at: float, changes: Sequence[ReplicaChange] | None) -> dict[str, Any]:
    """When the request of the worst TTFT during the change (``slowest``) was sent and answered, from the update call
    (``worst_sent_after_update_s``, ``worst_answered_after_update_s``), and each replica change: when, from the
    update call (``after_update_s``), and the worst request's send from it (``worst_sent_after_s``; negative: sent
    before it)."""
    sent = answered = None
    if slowest is not None and slowest.ttft_s is not None:
        sent, answered = slowest.sent, slowest.sent + slowest.ttft_s
    return {
        "worst_sent_after_update_s": None if sent is None else sent - updated_at,
        "worst_answered_after_update_s": None if answered is None else answered - updated_at,
        "ingress_replaced": None if changes is None else any(not c.engine for c in changes),
        "replica_changes": None if changes is None else [
            {**asdict(c), "after_update_s": c.at_s - updated_at, "worst_sent_after_s": None if sent is None else sent - c.at_s}
            for c in changes
        ],
    }  # fmt: skip


def stall_words(slowest: RequestRecord | None, updated_at: float, changes: Sequence[ReplicaChange] | None) -> str:
    """The stall in words: when the worst was sent, the replica change just before, the last one while it waited
    (after it was sent, before it was answered: what it may have waited for), and which replicas the rollout
    replaced."""
    if slowest is None or slowest.ttft_s is None:
        return ""
    sent, answered = slowest.sent, slowest.sent + slowest.ttft_s
    text = f"; the worst sent {fmt(sent - updated_at, ' s')} after the update call"
    before = [c for c in changes or () if c.at_s <= sent]
    if before:
        text += f", {fmt(sent - before[-1].at_s, ' s')} after {before[-1].words()}"
    waited = [c for c in changes or () if sent < c.at_s <= answered]
    if waited:
        text += f", answered {fmt(answered - waited[-1].at_s, ' s')} after {waited[-1].words()}"
    if changes is not None:
        llm = [c for c in changes if c.engine]
        text += (f"; LLM replicas {sum(c.what == 'stopped' for c in llm)} stopped, "
                 f"{sum(c.what == 'started' for c in llm)} started, the ingress "
                 + ("replaced" if any(not c.engine for c in changes) else "kept"))  # fmt: skip
    return text


async def rolling_update(t: Target, new_spec: TrialSpec | None = None, change: str = SAME_CONFIGURATION,
                         update_timeout_s: float | None = None) -> ScenarioResult:  # fmt: skip
    """Run the load, update the deployment to ``new_spec``'s configuration (None: the same, a new version) ``scenario_s
    / 2`` in, follow Serve's rollout, and judge. The load goes on until the rollout is done and ``scenario_s`` more,
    at most ``update_timeout_s`` (the trial's start-up timeout; default the scenario's time) and that after the
    update; then the replicas are asked what they run."""
    deployment = t.engine
    if not (hasattr(deployment, "update") and hasattr(deployment, "rolled_out")):
        return ScenarioResult(NAME, False, "not run: the engine is not a Serve deployment")
    run = await around_event(t, NAME, STREAM, lambda: deployment.update(new_spec), deployment.rolled_out,  # type: ignore[union-attr]
                             "the new configuration was measured for the scenario's time: stopped", update_timeout_s)  # fmt: skip
    if run.ended_early:
        return ScenarioResult(NAME, False, f"not run: the load ended before the update ({len(run.records)} requests)")
    if run.error is not None or run.called_at is None:
        return ScenarioResult(NAME, False, f"not run: Serve did not take the update ({run.error})")
    replicas: tuple[int, int] | None = None
    ask = getattr(deployment, "replicas_on_deployed", None)
    if run.settled_at is not None and ask is not None:
        with contextlib.suppress(Exception):  # the replicas could not be asked: the verdict rests on the load alone
            replicas = await asyncio.to_thread(ask)
    changes: list[ReplicaChange] | None = None
    lifetimes = getattr(deployment, "replica_lifetimes", None)
    if lifetimes is not None and run.started_wall_s is not None:
        with contextlib.suppress(Exception):  # Ray's actor table unreadable: the stall is told without the replicas
            until = max((done_at(r) for r in run.records), default=run.called_at)
            changes = replica_changes(await asyncio.to_thread(lifetimes), run.started_wall_s, run.called_at, until)
    verdict = judge_rolling_update(run.records, run.called_at, run.settled_at, t.slo,
                                   max(t.budget.scenario_s / 10, 1.0), change, replicas, changes)  # fmt: skip
    verdict.numbers["level"] = run.level
    return verdict
